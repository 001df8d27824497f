"""Checkpoints that cannot run code, cannot overflow, and cannot cost a finished run.

- A checkpoint is a file people pass around: loading or resuming one unpickles
  nothing and imports nothing it names. Crafted manifests (a pickle payload, a
  class naming ``os:system`` or a module whose import has side effects, with the
  checksums recomputed so they pass) are refused with a one-line CheckpointError
  or loaded as plain data, and nothing runs.
- Every field loading reads is checked in one place: out-of-range or ill-typed
  counts are refused with a one-line CheckpointError, never an OverflowError.
- A checkpoint that cannot be written never loses the run: the run goes on (or
  returns its TrainResult), a FailureWarning names the folder and the OS error,
  the failure is in ``result.failures``, the previous checkpoint stays loadable,
  and ``stalewise train`` exits non-zero after writing its metrics.

The write failures are real ones that root cannot bypass (tests run as root, so a
chmod-ed folder would not fail): ``RLIMIT_FSIZE`` (the kernel refuses to grow any
file past it with EFBIG, for root too; CPython ignores SIGXFSZ, so the write raises
OSError), lowered mid-run in this process and restored at once; and a checkpoint
folder whose path is taken by a regular file.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pickle
import re
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import safetensors.numpy
from test_checkpoint import _trained_states

import stalewise as sw
from stalewise import checkpoint, tree
from stalewise.checkpoint import store
from stalewise.cli import main


class Pair(NamedTuple):
    w: np.ndarray
    b: np.ndarray


@dataclasses.dataclass
class Conf:
    scale: np.ndarray
    name: str = dataclasses.field(default="conf", metadata={"static": True})


def _params():
    return {
        "pair": Pair(np.zeros(4, np.float32), np.zeros(2, np.float32)),
        "conf": Conf(np.ones(3, np.float32), name="kept"),
    }


def _loss_and_grad(p, batch):
    gw, gb, gs = p["pair"].w - 1.0, p["pair"].b + 1.0, p["conf"].scale - 3.0
    loss = float(sum(float((g * g).sum()) for g in (gw, gb, gs)))
    return loss, {"pair": Pair(gw, gb), "conf": Conf(gs, name=p["conf"].name)}


def _sim_train(d, steps=20, **checkpoints):
    job = sw.Job(_params(), optimizer=sw.optim.sgd(0.1))
    return job.train(
        _loss_and_grad,
        data=[[0]],
        workers=1,
        steps=steps,
        runtime=sw.Simulation(seed=1),
        checkpoints=sw.Checkpoints(d, **checkpoints),
        timeouts=sw.Timeouts(total=60),
    )


def _rewrite(ckpt_dir: Path, edit) -> None:
    """Edits a checkpoint's manifest and recomputes its checksum, as an attacker would."""
    manifest = json.loads((ckpt_dir / "manifest.json").read_text())
    edit(manifest)
    text = json.dumps(manifest, indent=1, allow_nan=True)
    (ckpt_dir / "manifest.json").write_text(text)
    (ckpt_dir / "manifest.sha256").write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")


def _one_ckpt(d: Path) -> Path:
    (path,) = [p for p in d.iterdir() if p.name.startswith("ckpt-")]
    return path


class _Touch:
    """Unpickling it creates a file: the stand-in for any code a pickle can run."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def evil(tmp_path, monkeypatch):
    """A marker file that must never appear, a pickle that creates it, and a module on
    sys.path whose import creates it."""
    marker = tmp_path / "ran"
    name = f"sw_evil_{tmp_path.name[-8:].replace('-', '_')}"
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / f"{name}.py").write_text(
        f"open({str(marker)!r}, 'w').close()\nclass Thing:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    payload = ["pickle", base64.b64encode(pickle.dumps(_Touch(str(marker)))).decode()]
    yield marker, name, payload
    assert not marker.exists(), "a checkpoint ran code"
    assert name not in sys.modules, "a checkpoint imported a module it named"


def _tree(m):
    return m["spec"]["tree"]


def _pair_node(m):
    tree = _tree(m)
    return tree["children"][[k[1] for k in tree["keys"]].index("pair")]


# what each crafted manifest does, and what the one-line refusal says (None: loaded as data)
CRAFTED = {
    "pickle-in-a-tree-key": (
        lambda m, e: _pair_node(m)["keys"].__setitem__(0, e[2]),
        "key .* is not one of",
    ),
    "pickle-in-a-leaf-path": (
        lambda m, e: m["spec"]["leaves"][0]["path"].__setitem__(0, e[2]),
        "key .* is not one of",
    ),
    "kind-naming-a-module": (
        lambda m, e: _pair_node(m).__setitem__("kind", f"{e[1]}:Thing"),
        "unknown tree node kind",
    ),
    "backend-naming-a-module": (
        lambda m, e: m["spec"]["leaves"][0].__setitem__("backend", e[1]),
        "unknown backend",
    ),
    "shard-file-outside-the-folder": (
        lambda m, e: m["shards"][0].__setitem__("file", "../../etc/passwd"),
        r"shards\[0\]\.file",
    ),
    "format-1-with-cls-and-pickled-statics": (
        lambda m, e: (
            m.__setitem__("format", 1),
            _pair_node(m).update(cls=f"{e[1]}:Thing", static=[["x", e[2]]]),
            _tree(m).update(cls="os:system"),
        ),
        "unknown format 1.*pickles",
    ),
    "cls-os-system-and-a-module-type": (
        lambda m, e: (
            _pair_node(m).update(cls="os:system", type=f"{e[1]}.Thing", static=[["x", e[2]]]),
            _tree(m).update(cls=f"{e[1]}:Thing"),
        ),
        None,  # fields the loader does not know: read as plain data, never followed
    ),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_checkpoint_runs_nothing(tmp_path, evil, case):
    edit, refusal = CRAFTED[case]
    d = tmp_path / "ckpt"
    trained = _sim_train(d)
    path = _one_ckpt(d)
    _rewrite(path, lambda m: edit(m, evil))
    if refusal is None:
        back = sw.load_params(d)
        assert type(back["pair"]) is dict and type(back["conf"]) is dict
        np.testing.assert_array_equal(back["pair"]["w"], trained.params["pair"].w)
        assert checkpoint.load(d).version == trained.stats["version"]
        return
    with pytest.raises(sw.CheckpointError, match=refusal) as e:
        sw.load_params(path)  # the folder itself: no fallback, its own message
    assert "\n" not in str(e.value) and str(path / "manifest.json") in str(e.value)
    for load in (sw.load_params, checkpoint.load):
        with pytest.raises(sw.CheckpointError, match="no usable checkpoint") as e:
            load(d)
        assert "\n" not in str(e.value)
    with pytest.raises(sw.CheckpointError, match="no usable checkpoint"):
        _sim_train(d, steps=40, resume=True)


def test_loading_neither_unpickles_nor_imports(tmp_path):
    """Python's audit hooks see every pickle class lookup and every module import: none
    happens while crafted checkpoints are loaded (after a clean one has warmed the path)."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    _sim_train(good)
    _sim_train(bad)
    marker = tmp_path / "ran"
    payload = ["pickle", base64.b64encode(pickle.dumps(_Touch(str(marker)))).decode()]
    _rewrite(
        _one_ckpt(bad),
        lambda m: (
            _pair_node(m).update(cls="os:system", type="json.tool.main", static=[["x", payload]]),
            m["spec"]["leaves"][1]["path"].__setitem__(0, payload),
        ),
    )
    script = textwrap.dedent(
        """
        import json, sys
        import stalewise as sw
        good, bad = sys.argv[1:3]
        sw.load_params(good)
        seen = []
        watched = ("import", "pickle.find_class", "exec", "os.system", "subprocess.Popen")
        sys.addaudithook(lambda event, args: event in watched and seen.append(event))
        try:
            sw.load_params(bad)
        except sw.CheckpointError as e:
            print("refused:", e, file=sys.stderr)
        print(json.dumps([e for e in seen]))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(good), str(_one_ckpt(bad))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    assert "refused:" in out.stderr and "is not one of" in out.stderr
    assert not marker.exists()


@pytest.mark.parametrize("module", sorted(Path(checkpoint.__file__).parent.glob("*.py")))
def test_the_load_and_resume_modules_import_neither_pickle_nor_importlib(module):
    source = ast.parse(module.read_text())
    imported = {
        alias.name.partition(".")[0]
        for node in ast.walk(source)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (
            node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]
        )
    }
    assert not imported & {"pickle", "importlib", "marshal", "dill", "cloudpickle"}
    calls = {n.id for n in ast.walk(source) if isinstance(n, ast.Name)}
    assert not calls & {"__import__", "eval", "exec"}


# -- sw.load_params(path, like=...) --------------------------------------------------------------


def test_like_rebuilds_namedtuples_and_dataclasses_plain_without(tmp_path):
    d = tmp_path / "ckpt"
    result = _sim_train(d)
    back = sw.load_params(d, like=_params())
    assert isinstance(back["pair"], Pair) and isinstance(back["conf"], Conf)
    assert back["conf"].name == "kept"  # a static field comes from like=
    for got, want in [
        (back["pair"].w, result.params["pair"].w),
        (back["pair"].b, result.params["pair"].b),
        (back["conf"].scale, result.params["conf"].scale),
    ]:
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(back["pair"].w, np.zeros(4))  # it trained
    plain = sw.load_params(d)
    assert type(plain) is dict and type(plain["pair"]) is dict and type(plain["conf"]) is dict
    assert sorted(plain["pair"]) == ["b", "w"] and list(plain["conf"]) == ["scale"]
    np.testing.assert_array_equal(plain["conf"]["scale"], back["conf"].scale)
    # what the manifest says of the classes is for reading, never imported
    node = _pair_node(json.loads((_one_ckpt(d) / "manifest.json").read_text()))
    assert node["kind"] == "namedtuple" and node["type"].endswith("Pair")


def test_like_a_torch_model(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    job = sw.Job(model, optimizer=sw.optim.sgd(0.1), shards=2)
    states = _trained_states(job, pushes=2, workers=1)
    checkpoint.save(
        tmp_path,
        states,
        spec=job.config.spec,
        config_info=checkpoint.config_info(job.config),
        step_info={"pushes": 2},
    )
    want = tree.unflatten(np.concatenate([s["params"] for s in states]), job.config.spec)
    for back in (sw.load_params(tmp_path, like=model), sw.load_params(tmp_path)):
        assert type(back) is dict and list(back) == list(want)
        for name, tensor in back.items():
            assert isinstance(tensor, torch.Tensor) and tensor.dtype == want[name].dtype
            assert torch.equal(tensor, want[name]), name
    assert not torch.equal(want["0.bias"], model[0].bias.detach())  # it moved
    as_numpy = sw.load_params(tmp_path, like=model, backend="numpy")
    assert isinstance(as_numpy["0.weight"], np.ndarray)


@pytest.mark.parametrize(
    ("like", "message"),
    [
        (
            lambda p: {**p, "pair": Pair(np.zeros(5, np.float32), p["pair"].b)},
            r"leaf 1 is 'pair.w' \(float32, shape \(4,\)\) in the checkpoint, "
            r"'pair.w' \(float32, shape \(5,\)\) in like",
        ),
        (
            lambda p: {**p, "pair": Pair(p["pair"].w.astype(np.float16), p["pair"].b)},
            r"leaf 1 is 'pair.w' \(float32.* 'pair.w' \(float16",
        ),
        (
            lambda p: {"conf": p["conf"]},
            "like has 1 leaves, the checkpoint 3; the first missing is 'pair.w'",
        ),
        (
            lambda p: {**p, "zz": np.zeros(1, np.float32)},
            "like has more leaves than the checkpoint's 3, from 'zz'",
        ),
        (lambda p: {**p, "conf": {"scale": p["conf"].scale}}, None),  # names, shapes match
    ],
    ids=["shape", "dtype", "fewer", "more", "other-containers"],
)
def test_like_is_checked_against_the_manifest(tmp_path, like, message):
    d = tmp_path / "ckpt"
    _sim_train(d, steps=5)
    if message is None:
        back = sw.load_params(d, like=like(_params()))
        assert type(back["conf"]) is dict and isinstance(back["pair"], Pair)
        return
    with pytest.raises(sw.CheckpointError, match=message) as e:
        sw.load_params(d, like=like(_params()))
    assert "\n" not in str(e.value)


# -- fields out of range or of the wrong type --------------------------------------------


def _deep(m):
    node = {"kind": "leaf", "keys": [], "children": []}
    for _ in range(300):
        node = {"kind": "list", "keys": [["int", 0]], "children": [node]}
    _tree(m)["children"][0] = node


BAD_FIELDS = {
    "version-2**70": (lambda m: m.__setitem__("version", 2**70), "version is 1180591620717"),
    "shard-version-2**70": (
        lambda m: m["shards"][0]["values"].update(version=2**70),
        r"shards\[0\]\.values\['version'\] is 1180591620717411303424, expected integers in",
    ),
    "shard-count-negative": (
        lambda m: m["shards"][0]["values"].update({"round.count": -1}),
        r"values\['round.count'\] is -1, expected integers in \[0, 2\*\*62\)",
    ),
    "shard-count-huge-float": (
        lambda m: m["shards"][0]["values"].update({"stats.applied": 1e300}),
        r"values\['stats.applied'\] is 1e\+300, expected integers in",
    ),
    "pushes-1e300": (lambda m: m["step"].update(pushes=1e300), r"step.pushes is 1e\+300"),
    "pushes-2**63": (
        lambda m: m["step"].update(pushes=2**63),
        "step.pushes is 9223372036854775808",
    ),
    "time-nan": (lambda m: m["step"].update(time=float("nan")), "step.time is nan"),
    "sim-pushes-string": (lambda m: m["step"]["sim"].update(pushes="7"), "step.sim.pushes is '7'"),
    "drawn-2**70": (lambda m: m["step"].update(drawn=[2**70]), "step.drawn is"),
    "shards-not-a-list": (lambda m: m.__setitem__("shards", {"0": 1}), "shards is"),
    "leaf-size-lies": (
        lambda m: m["spec"]["leaves"][0].update(size=2**70),
        "size is 1180591620717.*its shape",
    ),
    "leaf-negative-shape": (
        lambda m: m["spec"]["leaves"][0].update(shape=[-3]),
        r"shape is \[-3\], expected a list of counts",
    ),
    "leaf-dtype-object": (
        lambda m: m["spec"]["leaves"][0].update(dtype="object"),
        "dtype is 'object'",
    ),
    "alias-out-of-range": (
        lambda m: _tree(m)["children"].__setitem__(
            0, {"kind": "alias", "keys": [], "children": [], "leaf": 10**30}
        ),
        "an alias names leaf",
    ),
    "tree-nested-300-deep": (_deep, "nested more than 256 levels"),
    "feedback-2**40-workers": (
        lambda m: m.__setitem__("feedback", {"file": "feedback.safetensors", "workers": 2**40}),
        "feedback.workers is 1099511627776",
    ),
    "params-declared-int8": (
        lambda m: m["files"]["shard-0.safetensors"]["arrays"].update(params=["int8", [9]]),
        r"files\['shard-0.safetensors'\]\.arrays\['params'\] is \['int8', \[9\]\], "
        r"expected \['float32', \[n\]\] \(the spec's\)",
    ),
    "params-declared-2d": (
        lambda m: m["files"]["shard-0.safetensors"]["arrays"].update(params=["float32", [3, 3]]),
        r"arrays\['params'\] is \['float32', \[3, 3\]\], expected",
    ),
    "array-declared-object": (
        lambda m: m["files"]["shard-0.safetensors"]["arrays"].update(clocks=["object", [1]]),
        r"arrays\['clocks'\] is \['object', \[1\]\], expected \[dtype, shape\]",
    ),
    "file-size-missing": (
        lambda m: m["files"]["shard-0.safetensors"].pop("bytes"),
        r"files\['shard-0.safetensors'\]\.bytes is .*, expected a size in bytes",
    ),
    "format-2-without-sizes": (
        lambda m: (m.pop("files"), m.__setitem__("format", 2)),
        "unknown format 2, expected 3 .format 2 declared neither its files' sizes",
    ),
}


@pytest.mark.parametrize("case", list(BAD_FIELDS))
def test_an_out_of_range_or_ill_typed_manifest_is_refused_in_one_line(tmp_path, caplog, case):
    edit, message = BAD_FIELDS[case]
    d = tmp_path / "ckpt"
    _sim_train(d)
    path = _one_ckpt(d)
    _rewrite(path, edit)
    with pytest.raises(sw.CheckpointError, match=message) as e:
        checkpoint.load(path)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400
    # resuming from it stops before anything starts, with a CheckpointError (never an
    # OverflowError from a shard), and the warning names the field
    with pytest.raises(sw.CheckpointError, match="no usable checkpoint"):
        _sim_train(d, steps=40, resume=True)
    assert str(e.value) in caplog.text


def test_a_huge_version_resumed_on_the_local_runtime_is_a_checkpoint_error(tmp_path, no_leaks):
    d = tmp_path / "ckpt"
    _sim_train(d)
    path = _one_ckpt(d)
    _rewrite(path, lambda m: m["shards"][0]["values"].update(version=2**70))
    job = sw.Job(_params(), optimizer=sw.optim.sgd(0.1))
    with pytest.raises(sw.CheckpointError, match="no usable checkpoint"):
        job.train(
            _loss_and_grad,
            data=[[0]],
            workers=1,
            steps=40,
            checkpoints=sw.Checkpoints(d, resume=True),
            timeouts=sw.Timeouts(total=60),
        )


# -- a checkpoint that cannot be written ---------------------------------------------------

BIG = 50_000  # float32 parameters: a 200 kB shard file, well past the file size limit
LIMIT = 32 * 1024


@contextlib.contextmanager
def file_size_limit():
    """``lower()`` sets RLIMIT_FSIZE to LIMIT bytes for this process; the old limit is
    restored on exit whatever happens. Root cannot write past it either."""
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN  # CPython's default
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    state = {"lowered": False}

    def lower() -> None:
        if not state["lowered"]:
            resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, hard))
            state["lowered"] = True

    try:
        yield lower, state
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def _big_job():
    return sw.Job({"w": np.zeros(BIG, np.float32)}, optimizer=sw.optim.sgd(0.1))


def _big_loss_and_grad(p, batch):
    g = p["w"] - 1.0
    return float((g * g).mean()), {"w": g}


def _check_failed_run(result, d, caught, first_pushes):
    events = [e for e in result.failures if "checkpoint" in e]
    assert events, result.failures
    assert all(e["checkpoint"] == str(d) for e in events)
    assert all("too large" in e["cause"] for e in events), events
    assert all(e["action"] == f"kept ckpt-{first_pushes:09d}" for e in events), events
    assert events[-1]["final"] and not any(e["final"] for e in events[:-1])
    # warned: the first failure of the run, then the final one; the end counts them all
    messages = [str(w.message) for w in caught if issubclass(w.category, sw.FailureWarning)]
    first = [m for m in messages if m.startswith("a checkpoint could not be written")]
    final = [m for m in messages if m.startswith("the final checkpoint could not be written")]
    assert len(first) == 1 and len(final) == 1, messages
    assert all(f"to {d}: " in m and "File too large" in m for m in first + final), messages
    assert f"kept ckpt-{first_pushes:09d}" not in final[0]  # said in words:
    assert f"the previous checkpoint, ckpt-{first_pushes:09d}, is kept" in final[0]
    assert any(m.startswith("checkpoint failures this run") for m in messages), messages
    # the result is whole, and the previous checkpoint is still there and loadable
    np.testing.assert_array_equal(result.params["w"], result.flat)
    kept = checkpoint.load(d)
    assert result.stats["version"] > kept.version
    assert kept.step["pushes"] == first_pushes and kept.path.name == f"ckpt-{first_pushes:09d}"
    assert sw.load_params(d)["w"].shape == (BIG,)
    assert not [p for p in d.iterdir() if p.name.startswith(".tmp-")]
    return events


def test_sim_checkpoints_that_cannot_be_written_cost_nothing(tmp_path):
    d = tmp_path / "ckpt"
    with file_size_limit() as (lower, state), pytest.warns(sw.FailureWarning) as caught:

        def loss_and_grad(p, batch):  # the sim runs it here: the limit falls after a checkpoint
            if checkpoint.exists(d):
                lower()
            return _big_loss_and_grad(p, batch)

        result = _big_job().train(
            loss_and_grad,
            data=[[0], [0]],
            workers=2,
            steps=100,
            runtime=sw.Simulation(seed=1),
            checkpoints=sw.Checkpoints(d, every=10),
            timeouts=sw.Timeouts(total=120),
        )
    assert state["lowered"]
    first = checkpoint.load(d).step["pushes"]  # those in flight at 10 are not in it
    assert 9 <= first <= 10
    events = _check_failed_run(result, d, caught, first_pushes=first)
    # a failed periodic checkpoint is retried a period later, not at every step
    assert 3 <= len(events) <= 100 // 10 + 1, events


def test_sim_final_checkpoint_into_a_path_taken_by_a_file(tmp_path):
    blocker = tmp_path / "taken"
    blocker.write_text("a regular file where the checkpoint folder's parent should be")
    d = blocker / "ckpt"
    with pytest.warns(sw.FailureWarning, match="the final checkpoint could not be written"):
        result = _big_job().train(
            _big_loss_and_grad,
            data=[[0]],
            workers=1,
            steps=5,
            runtime="sim",
            checkpoints=sw.Checkpoints(d),
        )
    (event,) = [e for e in result.failures if "checkpoint" in e]
    assert event["final"] and event["action"] == "kept none" and "Not a directory" in event["cause"]
    assert result.pushes == 5 and result.params["w"].shape == (BIG,)


def test_local_checkpoints_that_cannot_be_written_cost_nothing(tmp_path, no_leaks):
    d = tmp_path / "ckpt"

    def on_record(record):  # in the parent, which writes the checkpoints
        if len(list(d.glob("ckpt-*"))) >= 2:  # the start's and a periodic one
            lower()

    with file_size_limit() as (lower, state), pytest.warns(sw.FailureWarning) as caught:
        result = _big_job().train(
            _big_loss_and_grad,
            data=[[0], [0]],
            workers=2,
            steps=400,
            emulation=sw.Emulation(delays={0: 0.002, 1: 0.002}),
            metrics=sw.Metrics(every=0.02, on_record=on_record),
            checkpoints=sw.Checkpoints(d, every=40),
            timeouts=sw.Timeouts(total=120),
        )
    assert state["lowered"]
    first = checkpoint.load(d).step["pushes"]
    assert first >= 40
    events = _check_failed_run(result, d, caught, first_pushes=first)
    assert len(events) <= 400 // 40 + 1


def test_cli_exits_nonzero_when_the_last_checkpoint_is_lost(tmp_path, capsys):
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        textwrap.dedent(
            """
            [task]
            name = "least-squares"
            args = { n = 64, d = 8 }

            [optimizer]
            name = "sgd"
            lr = 0.05

            [run]
            workers = 2
            steps = 40
            """
        )
    )
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("a regular file where the checkpoints go")
    code = main(["train", str(cfg), "--out", str(out), "--runtime", "sim", "-q"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith("stalewise: the final checkpoint could not be written to ")
    assert "File exists" in err[-1] and "metrics.jsonl" in err[-1]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records and records[-1]["pushes"] >= 40


def test_a_save_that_fails_at_its_last_step_leaves_the_folder_as_it_was(tmp_path):
    """``latest`` cannot be replaced (a non-empty folder took its name: rename fails for
    root too): the new checkpoint is taken out again, and one of the same version that it
    was replacing is put back."""
    job = sw.Job({"w": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1))
    states = _trained_states(job, pushes=1, workers=1)

    def save(states):
        return checkpoint.save(
            tmp_path,
            states,
            spec=job.config.spec,
            config_info=checkpoint.config_info(job.config),
            step_info={"pushes": states[0]["version"]},
        )

    first = save(states)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    (tmp_path / "latest").unlink()
    (tmp_path / "latest" / "x").mkdir(parents=True)
    for again in (
        _trained_states(job, pushes=2, workers=1),
        states,
    ):  # a new version, then the same
        with pytest.raises(OSError):
            save(again)
        assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, "latest"]
        assert {p.name: p.read_bytes() for p in first.iterdir()} == before
        assert checkpoint.load(tmp_path).version == 1


# -- checkpoint files that are not what they claim ------------------------------------------
#
# A checkpoint folder holds regular files only, read without following a symlink, a FIFO or
# a device is refused without blocking on it, every read is bounded (a shard file by the
# size its manifest declares, the manifest by MAX_MANIFEST_BYTES), and each array must have
# the dtype and shape its manifest declares. Each refusal is one CheckpointError naming the
# file, and loading a folder of checkpoints (so resuming) falls back to the previous one, as
# for a bad checksum. A load that could hang, or read /dev/zero until memory runs out, runs
# in a child with a timeout and an address-space limit, so a regression fails, never hangs:
# one child loads every case in turn, each case's stdout and stderr (file descriptors 1
# and 2) captured on their own, and an exception of one case recorded, not fatal to others.

_LOAD_CHILD = """
import json, logging, os, sys, tempfile, traceback
from stalewise import checkpoint
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")


def load(newest, root):
    try:
        checkpoint.load(newest)
        print("loaded")
    except checkpoint.CheckpointError as e:
        print("CheckpointError:", e)
    print("fallback:", checkpoint.load(root).path.name)


for case, newest, root in json.loads(sys.argv[1]):
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush(), sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            load(newest, root)
            ok = True
        except BaseException:
            traceback.print_exc()
            ok = False
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
        out.seek(0), err.seek(0)
        print(json.dumps({"case": case, "ok": ok, "stdout": out.read(), "stderr": err.read()}))
"""


class _Loaded(NamedTuple):
    ok: bool  # no exception escaped the case's loads
    stdout: str
    stderr: str


def _load_in_child(cases: dict[str, tuple[Path, Path]]) -> dict[str, _Loaded]:
    """Loads each case's ``(newest, root)`` in one child: what each printed."""

    def limit_memory():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    jobs = json.dumps([[case, str(newest), str(root)] for case, (newest, root) in cases.items()])
    child = subprocess.run(
        [sys.executable, "-c", _LOAD_CHILD, jobs],
        capture_output=True,
        text=True,
        timeout=120,  # today's code hangs here (or reads /dev/zero): TimeoutExpired; 120 s for a loaded machine's imports
        preexec_fn=limit_memory,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
    )
    assert child.returncode == 0, child.stderr[-2000:]
    found = {r["case"]: _Loaded(r["ok"], r["stdout"], r["stderr"])
             for r in map(json.loads, child.stdout.splitlines())}  # fmt: skip
    assert list(found) == list(cases), child.stdout
    return found


def _two_ckpts(d: Path) -> tuple[Path, Path]:
    """The older and the newer checkpoint of one short run."""
    _sim_train(d, steps=20, every=10)
    older, newer = sorted(d.glob("ckpt-*"))
    return older, newer


def _replace(path: Path, make) -> None:
    path.unlink()
    make(path)


def _folder_elsewhere(newer: Path) -> None:
    """The checkpoint folder is a symlink to a (valid) copy outside the checkpoint folder."""
    elsewhere = newer.parent.parent / "elsewhere"
    shutil.copytree(newer, elsewhere)
    shutil.rmtree(newer)
    newer.symlink_to(elsewhere, target_is_directory=True)


def _huge_manifest(newer: Path) -> None:
    """A valid manifest padded with whitespace past the cap, its checksum recomputed."""
    text = (newer / "manifest.json").read_text()
    text += " " * (checkpoint.store.MAX_MANIFEST_BYTES + 1 - len(text))
    (newer / "manifest.json").write_text(text)
    (newer / "manifest.sha256").write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")


NOT_WHAT_THEY_CLAIM = {
    "shard-symlink-to-dev-zero": (
        lambda p: _replace(p / "shard-0.safetensors", lambda f: f.symlink_to("/dev/zero")),
        r"shard-0\.safetensors: a symbolic link",
    ),
    "manifest-fifo": (
        lambda p: _replace(p / "manifest.json", os.mkfifo),
        r"manifest\.json: a FIFO, not a regular file",
    ),
    "manifest-symlink-to-dev-urandom": (
        lambda p: _replace(p / "manifest.json", lambda f: f.symlink_to("/dev/urandom")),
        r"manifest\.json: a symbolic link",
    ),
    "manifest-symlink-to-dev-zero": (
        lambda p: _replace(p / "manifest.json", lambda f: f.symlink_to("/dev/zero")),
        r"manifest\.json: a symbolic link",
    ),
    "checksum-symlink-to-dev-zero": (
        lambda p: _replace(p / "manifest.sha256", lambda f: f.symlink_to("/dev/zero")),
        r"manifest\.sha256: a symbolic link",
    ),
    "folder-symlink-outside": (_folder_elsewhere, r"ckpt-000000020: a symbolic link"),
    "manifest-past-the-cap": (
        _huge_manifest,
        r"manifest\.json: \d+ bytes, more than \d+ \(MAX_MANIFEST_BYTES\)",
    ),
}


@pytest.fixture(scope="module")
def loaded_in_child(tmp_path_factory) -> dict[str, tuple[Path, Path, _Loaded]]:
    """Each case of NOT_WHAT_THEY_CLAIM, and a ``latest`` pointer that is a FIFO, made in
    a folder of two checkpoints, then loaded in one child: (older, newer, what it printed)."""
    cases = {}
    for case, (make, _) in NOT_WHAT_THEY_CLAIM.items():
        d = tmp_path_factory.mktemp("case") / "ckpt"
        cases[case] = (d, *_two_ckpts(d))
        make(cases[case][2])
    d = tmp_path_factory.mktemp("latest") / "ckpt"
    cases["latest-fifo"] = (d, *_two_ckpts(d))
    _replace(d / "latest", os.mkfifo)
    found = _load_in_child({case: (newer, d) for case, (d, _, newer) in cases.items()})
    return {case: (older, newer, found[case]) for case, (_, older, newer) in cases.items()}


@pytest.mark.parametrize("case", list(NOT_WHAT_THEY_CLAIM))
def test_a_checkpoint_file_that_is_not_a_regular_file_is_refused_without_hanging(
    loaded_in_child, case
):
    message = NOT_WHAT_THEY_CLAIM[case][1]
    older, newer, child = loaded_in_child[case]
    lines = child.stdout.splitlines()
    assert child.ok and len(lines) == 2, (child.stdout, child.stderr[-2000:])
    assert lines[0].startswith(f"CheckpointError: {newer}"), lines
    assert re.search(message, lines[0]), lines
    assert lines[1] == f"fallback: {older.name}"  # as after a bad checksum
    assert f"using {older.name} instead of {newer.name}" in child.stderr


def test_a_latest_pointer_that_is_a_fifo_is_ignored_without_hanging(loaded_in_child):
    _, newer, child = loaded_in_child["latest-fifo"]
    assert child.ok, child.stderr
    assert child.stdout.splitlines() == ["loaded", f"fallback: {newer.name}"], child.stderr


def _rewrite_array(ckpt_dir: Path, key: str, change) -> None:
    """Rewrites ``key`` of shard 0's file with ``change(array)`` and updates what the
    manifest says of the file (its checksum, and its size where it declares one), so the
    array's dtype or shape is the checkpoint's only defect."""
    file = ckpt_dir / "shard-0.safetensors"
    arrays = safetensors.numpy.load_file(str(file))
    arrays[key] = np.ascontiguousarray(change(arrays[key]))
    safetensors.numpy.save_file(arrays, str(file))
    data = file.read_bytes()

    def edit(m):
        m["sha256"][file.name] = hashlib.sha256(data).hexdigest()
        if file.name in m.get("files", {}):
            m["files"][file.name]["bytes"] = len(data)

    _rewrite(ckpt_dir, edit)


WRONG_ARRAYS = {
    "params-int8": ("params", lambda a: a.astype(np.int8), "int8 of shape \\(9,\\)"),
    "params-float16": ("params", lambda a: a.astype(np.float16), "float16 of shape \\(9,\\)"),
    "params-2d": ("params", lambda a: a.reshape(3, 3), "float32 of shape \\(3, 3\\)"),
    "params-one-more": ("params", lambda a: np.append(a, a[:1]), "float32 of shape \\(10,\\)"),
    "clocks-int8": ("clocks", lambda a: a.astype(np.int8), "int8 of shape \\(1,\\)"),
    "pace-shape": ("pace", lambda a: np.tile(a, 2), "float64 of shape \\(2,\\)"),
}


@pytest.mark.parametrize("case", list(WRONG_ARRAYS))
def test_an_array_of_the_wrong_dtype_or_shape_is_refused_and_resume_falls_back(
    tmp_path, caplog, case
):
    key, change, got = WRONG_ARRAYS[case]
    d = tmp_path / "ckpt"
    older, newer = _two_ckpts(d)
    want = sw.load_params(older)
    _rewrite_array(newer, key, change)
    # named: refused in one line naming the file, the key and both dtypes and shapes
    with pytest.raises(sw.CheckpointError) as e:
        checkpoint.load(newer)
    assert str(e.value).startswith(f"{newer / 'shard-0.safetensors'}: {key!r} is ")
    assert re.search(f"{key!r} is {got}, the manifest says", str(e.value)), e.value
    assert "\n" not in str(e.value)
    with pytest.raises(sw.CheckpointError, match=re.escape(str(e.value))):
        sw.load_params(newer)  # never cast
    # a folder of checkpoints: the previous one, as after a bad checksum
    with caplog.at_level(logging.WARNING, logger="stalewise.checkpoint"):
        back = sw.load_params(d)
    np.testing.assert_array_equal(tree.flatten(back)[0], tree.flatten(want)[0])
    assert f"using {older.name} instead of {newer.name}" in caplog.text
    # resuming: the same fallback, and the run goes on from the older checkpoint
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="stalewise.checkpoint"):
        result = _sim_train(d, steps=30, resume=True)
    assert str(e.value) in caplog.text
    assert f"using {older.name} instead of {newer.name}" in caplog.text
    assert result.stats["version"] == 30


def test_a_manifest_past_the_cap_is_not_written(tmp_path, monkeypatch):
    """Save refuses what load would refuse, as a failed write (EFBIG): a run's Saver warns
    and goes on, and the folder stays as it was."""
    job = sw.Job(_params(), optimizer=sw.optim.sgd(0.1))
    states = _trained_states(job, pushes=1, workers=1)
    monkeypatch.setattr(checkpoint.store, "MAX_MANIFEST_BYTES", 1000)
    with pytest.raises(OSError, match=r"manifest.json would be \d+ bytes, more than the 1000 "):
        checkpoint.save(
            tmp_path,
            states,
            spec=job.config.spec,
            config_info=checkpoint.config_info(job.config),
            step_info={"pushes": 1},
        )
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_replaced_while_it_is_read_is_read_whole(tmp_path):
    """A save of the same pushes (a resume's start, a run's end) replaces the folder: the
    old one renamed away, the new one in. A reader across that once mixed the two (a
    manifest of one, a shard file of the other) and refused both; it reads again."""
    import threading

    job = sw.Job({"w": np.zeros(2000, np.float32)}, optimizer=sw.optim.adam(0.1))
    config, stop, errors, loads = job.config, threading.Event(), [], 0

    def state(n):
        shard = config.build_shard(0, np.full(2000, n, np.float32), workers=1)
        return [shard.state_dict()]

    def save(n):
        store.save(tmp_path, state(n), spec=config.spec,
                   config_info=sw.checkpoint.config_info(config, workers=1),
                   step_info={"pushes": 0, "time": float(n)})  # fmt: skip

    def writer():
        n = 0
        while not stop.is_set():
            n += 1
            save(n)

    save(0)
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        end = time.monotonic() + 3
        while time.monotonic() < end:
            try:
                ckpt = store.load(tmp_path)
                loads += 1
                assert ckpt.states[0]["params"][0] == ckpt.step["time"]  # one save, whole
            except store.CheckpointError as e:
                errors.append(str(e))
    finally:
        stop.set()
        thread.join(30)
    assert loads > 10 and not errors, errors[:1]
