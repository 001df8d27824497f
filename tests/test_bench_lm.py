"""benchmarks/lm.py's counting and benchmarks/_torchft_peer.py's model (no torchft needed)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import stalewise as sw
from stalewise import tasks

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
TINY = dict(size="tiny", context=16, batch_size=4, corpus_bytes=200_000, eval_windows=8)


@pytest.fixture(scope="module")
def bench(request):
    sys.path.insert(0, str(BENCH))  # lm imports _report; worker processes import lm
    try:
        import _torchft_peer
        import lm

        yield lm, _torchft_peer
    finally:
        sys.path.remove(str(BENCH))


def test_peer_module_computes_the_tasks_loss_and_gradient(bench):
    _, peer = bench
    task = tasks.get("lm", **TINY)
    params = task.init_params(3)
    batch = next(task.batches(0, 1))
    module = peer._module(params)
    x, y = batch[:, :-1], batch[:, 1:]
    logits = task.logits(peer._tree(module), x)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
    loss.backward()
    want_loss, want_grads = task.loss_and_grad(params, batch)
    assert loss.item() == pytest.approx(want_loss, rel=1e-6)
    got = dict(module.named_parameters())
    assert len(got) == sum(1 for _ in module.parameters()) == 16  # one layer, wte tied
    torch.testing.assert_close(got["wte"].grad, want_grads["wte"])
    torch.testing.assert_close(
        got["blocks.0.mlp.fc.w"].grad, want_grads["blocks"]["0"]["mlp"]["fc"]["w"]
    )


def test_tokens_count_sent_rounds_and_the_run_stops_at_its_token_budget(bench, tmp_path):
    """4 real worker processes, DiLoCo H=5 under BSP: every record's tokens are whole
    rounds that were sent, the run stops at the token budget before its push cap, and
    the final count adds each worker's last round."""
    lm, _ = bench
    task = tasks.get("lm", **TINY)
    m = dict(steps=10, delay=0.0, eval_interval=0.1, compute=0.001)
    make = lambda lr: dict(  # noqa: E731
        strategy=sw.strategies.diloco(local_steps=5, inner=sw.optim.adamw(lr)),
        consistency=sw.BSP(),
    )
    r = lm.run_one(task, m, "DiLoCo H=5", 3e-3, make, 1)  # a cap of 52 pushes of 1 step
    per_round = 4 * 5 * task.tokens_per_batch
    budget = int(np.ceil(lm.EXTRA * 4 * m["steps"])) * task.tokens_per_batch
    tokens = [rec["tokens"] for rec in r["records"]]
    assert all(t % (5 * task.tokens_per_batch) == 0 for t in tokens)
    assert tokens == sorted(tokens) and tokens[-1] >= budget
    assert r["pushes"] < 52  # stopped by the tokens, not the push cap
    # every push's round, the last ones too (a round made as the run stopped may be unsent)
    assert tokens[-1] <= r["tokens"] <= r["pushes"] * 5 * task.tokens_per_batch + per_round
    assert r["tokens"] >= r["pushes"] * 5 * task.tokens_per_batch
    # the last record, made once every push was applied, stands at every push's tokens
    assert r["records"][-1]["pushes"] == r["pushes"]
    assert r["records"][-1]["tokens"] == r["pushes"] * 5 * task.tokens_per_batch


def test_the_medium_gpt_has_a_million_parameters_and_the_streaming_rows_count_tokens(bench):
    lm, _ = bench
    task = tasks.get("lm", size="medium", corpus_bytes=200_000, eval_windows=8)
    assert task.num_params() >= 1_000_000
    m = dict(lm.MODES["medium"], compute=0.01)
    assert m["steps"] >= 30 * 20  # 30 outer rounds at H=20 per worker
    rows = {name: (make, h) for name, _, _, make, h in lm.methods(m, "int8")}
    for name, asynchronous in ((lm.STREAM, False), (lm.ASYNC_STREAM, True)):
        make, h = rows[name]
        kw = make(1e-2, (0.7, 0.9))
        s = kw["strategy"]
        assert (s.count, s.delay, s.alpha, s.asynchronous) == (4, 2, 0.5, asynchronous)
        assert h == 5 and repr(kw["codec"]) == "int4()"
        assert isinstance(lm.counting(s), lm.CountingStreaming)
