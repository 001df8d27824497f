"""Tests for the byte-level GPT task (stalewise.tasks.lm)."""

from __future__ import annotations

import math
import os
import pickle
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
import torch

import stalewise as sw
from stalewise import config, tasks
from stalewise.tasks.lm import CORPUS_MODULES, LanguageModel, load_corpus

TINY = dict(size="tiny", context=32, batch_size=16, corpus_bytes=400_000, eval_windows=64)
LN256 = math.log(256)


@pytest.fixture(autouse=True)
def one_torch_thread():
    """A tiny model runs fastest on one thread, and several threads on a loaded machine
    run several times slower (the local runtime caps its workers' threads the same way)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        out.update(_leaves(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return out


# ----------------------------------------------------------------------------- corpus


def test_corpus_is_the_listed_stdlib_files_in_order_and_its_hash_is_stable_across_processes():
    corpus = load_corpus(300_000, 0.1)
    stdlib = sysconfig.get_paths()["stdlib"]
    expected = b""
    for rel in corpus.files:
        with open(os.path.join(stdlib, rel), "rb") as f:
            expected += f.read() + b"\0"
    assert (
        len(expected)
        >= 300_000
        > len(expected) - os.path.getsize(os.path.join(stdlib, corpus.files[-1]))
    )
    data = corpus.train.tobytes() + corpus.val.tobytes()
    assert data == expected[:300_000]
    assert corpus.files[0] == "abc.py" and list(CORPUS_MODULES) == sorted(CORPUS_MODULES)
    # a fresh interpreter (as a worker process is) reads the same bytes
    code = "from stalewise.tasks.lm import load_corpus; print(load_corpus(300_000, 0.1).sha256)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == corpus.sha256
    import hashlib

    assert corpus.sha256 == hashlib.sha256(expected[:300_000]).hexdigest()


def test_held_out_split_is_disjoint_from_every_training_window():
    task = LanguageModel(**TINY)
    n_train = len(task.corpus.train)
    assert len(task.corpus.val) == round(400_000 * task.val_fraction)
    train_ends = task.train_window_starts() + task.context + 1
    assert train_ends.max() <= n_train
    evals = task.eval_window_starts()
    assert evals.min() >= n_train and len(evals) == 64
    assert evals.max() + task.context + 1 <= n_train + len(task.corpus.val)
    # every row of a worker's batches is one of its shard's training windows
    train, width = task.corpus.train, task.context + 1
    owner = {}
    for w in range(3):
        for s in task.train_window_starts()[w::3]:
            owner.setdefault(train[s : s + width].tobytes(), set()).add(w)
    for w in range(3):
        it = task.batches(w, 3)
        for _ in range(20):
            for row in next(it).numpy().astype(np.uint8):
                assert w in owner[row.tobytes()]


def test_evaluate_is_deterministic_and_starts_near_uniform():
    task = LanguageModel(**TINY)
    params = task.init_params(seed=0)
    first = task.evaluate(params)
    assert first == task.evaluate(params) == LanguageModel(**TINY).evaluate(params)
    assert abs(first["loss"] - LN256) < 0.2
    assert first["perplexity"] == pytest.approx(math.exp(first["loss"]))


def test_vocab_widens_the_tied_embedding_and_starts_near_its_uniform_loss():
    task = LanguageModel(**TINY, vocab=1000)
    params = task.init_params(seed=0)
    assert params["wte"].shape == (1000, task.dim)
    assert task.num_params() == LanguageModel(**TINY).num_params() + 744 * task.dim
    assert abs(task.evaluate(params)["loss"] - math.log(1000)) < 0.2
    loss, grads = task.loss_and_grad(params, next(task.batches(0, 2)))
    assert grads["wte"].shape == (1000, task.dim) and math.isfinite(loss)
    with pytest.raises(ValueError, match="vocab must be an integer >= 256, got 255"):
        LanguageModel(**TINY, vocab=255)


# ----------------------------------------------------------------------------- model


def test_grads_have_the_params_structure_and_match_a_finite_difference():
    task = LanguageModel(size="tiny", context=8, batch_size=4, corpus_bytes=50_000, layers=2)
    params = task.init_params(seed=1)
    batch = next(task.batches(0, 1))
    loss, grads = task.loss_and_grad(params, batch)
    p, g = _leaves(params), _leaves(grads)
    assert list(g) == list(p)  # same leaves in the same order
    assert "wte" in p and "head" not in " ".join(p)  # the output head is tied to wte
    for name in p:
        assert isinstance(g[name], torch.Tensor)
        assert g[name].shape == p[name].shape and g[name].dtype == torch.float32, name
        assert torch.isfinite(g[name]).all(), name
    assert loss == pytest.approx(float(task._loss(params, batch)), rel=1e-6)
    # directional derivative in float64 along a random direction
    gen = torch.Generator().manual_seed(0)
    p64 = {k: v.double() for k, v in p.items()}
    v = {k: torch.randn(t.shape, generator=gen, dtype=torch.float64) for k, t in p64.items()}

    def at(eps: float) -> float:
        moved = {k: p64[k] + eps * v[k] for k in p64}
        return float(task._loss(_nest(moved), batch))

    eps = 1e-5
    numeric = (at(eps) - at(-eps)) / (2 * eps)
    _, g64 = task.loss_and_grad(_nest(p64), batch)
    analytic = sum(float((_leaves(g64)[k] * v[k]).sum()) for k in p64)
    assert numeric == pytest.approx(analytic, rel=1e-5)
    # the head's share reaches wte: without the tied head, wte's gradient differs
    assert float(_leaves(g64)["wte"].abs().sum()) > 0


def _nest(flat: dict) -> dict:
    out: dict = {}
    for name, value in flat.items():
        *path, leaf = name.split(".")
        node = out
        for k in path:
            node = node.setdefault(k, {})
        node[leaf] = value
    return out


def test_attention_is_causal():
    task = LanguageModel(size="tiny", context=16, batch_size=2, corpus_bytes=50_000)
    params = task.init_params(seed=0)
    x = next(task.batches(0, 1))[:, :-1]
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % 256  # change the future
    a, b = task.logits(params, x), task.logits(params, y)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.equal(a[:, 10:], b[:, 10:])


def test_task_pickles_without_its_corpus_and_rejects_bad_options():
    task = tasks.get("lm", **TINY)
    assert isinstance(task, tasks.Task) and task.name == "lm"
    blob = pickle.dumps(task)
    assert len(blob) < 2000  # configuration only: the corpus is reread in the worker
    clone = pickle.loads(blob)
    assert repr(clone) == repr(task)
    params, batch = task.init_params(0), next(task.batches(0, 2))
    assert clone.loss_and_grad(params, batch)[0] == task.loss_and_grad(params, batch)[0]
    with pytest.raises(
        ValueError, match="size must be one of tiny, small, base, medium, got 'huge'"
    ):
        tasks.get("lm", size="huge")
    with pytest.raises(ValueError, match="dim=30 is not a multiple of heads=4"):
        tasks.get("lm", dim=30, heads=4)
    with pytest.raises(ValueError, match="context must be an integer >= 1, got 0"):
        tasks.get("lm", context=0)
    with pytest.raises(ValueError, match="corpus_bytes=100: no training window"):
        tasks.get("lm", corpus_bytes=100, context=64, val_fraction=0.9)
    with pytest.raises(ValueError, match=r"val_fraction=0\.01: 1 held-out bytes, fewer than"):
        tasks.get("lm", corpus_bytes=100, context=64, val_fraction=0.01)
    small = LanguageModel(size="small", corpus_bytes=50_000)
    assert (small.dim, small.layers, small.heads) == (64, 2, 4)
    assert LanguageModel(size="small", layers=3, corpus_bytes=50_000).layers == 3


# ----------------------------------------------------------------------------- training


def test_trains_in_the_simulator_well_below_uniform():
    task = tasks.get("lm", **TINY)
    params = task.init_params(0)
    start = task.evaluate(params)["loss"]
    job = sw.Job(params, optimizer=sw.optim.adam(3e-3), consistency=sw.BSP())
    result = job.train(
        task.loss_and_grad,
        data=task.batches,
        evaluate=task.evaluate,
        workers=2,
        steps=300,
        runtime="sim",
        metrics=sw.Metrics(every=0.05),
    )
    end = result.records[-1]["loss"]
    assert result.pushes >= 300
    assert end < start - 1.5, (start, end)  # 5.4 -> about 3.0 nats per byte
    assert end == task.evaluate(result.params)["loss"]


def test_trains_on_two_local_worker_processes(no_leaks):
    task = tasks.get("lm", **TINY)
    params = task.init_params(0)
    start = task.evaluate(params)["loss"]
    job = sw.Job(params, optimizer=sw.optim.adam(3e-3))
    result = job.train(
        task.loss_and_grad,
        data=task.batches,
        evaluate=task.evaluate,
        workers=2,
        steps=300,
        metrics=sw.Metrics(every=0.5),
        timeouts=sw.Timeouts(total=240),
    )
    end = task.evaluate(result.params)["loss"]
    assert result.pushes >= 300 and not result.failures
    assert end < start - 1.0, (start, end)


def test_config_builds_the_lm_task_by_name():
    cfg = config.parse(
        {
            "task": {"name": "lm", "args": {"size": "tiny", "context": 16, "corpus_bytes": 50_000}},
            "optimizer": {"name": "adam", "lr": 0.003},
            "run": {"workers": 2, "steps": 4},
        }
    )
    assert isinstance(cfg.task, LanguageModel) and cfg.task.context == 16
    assert cfg.job.config.spec.size == cfg.task.num_params()
    with pytest.raises(config.ConfigError, match=r"task\.args"):
        config.parse(
            {
                "task": {"name": "lm", "args": {"size": "huge"}},
                "optimizer": {"name": "adam", "lr": 0.003},
            }
        )


def test_module_examples_run():
    import doctest

    from stalewise.tasks import lm

    result = doctest.testmod(lm, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0
