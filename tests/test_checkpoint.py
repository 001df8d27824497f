"""Checkpoints: the on-disk format, checksums and fallback, and resume in both runtimes."""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import numpy as np
import pytest

import stalewise as sw
from stalewise import checkpoint, tasks
from stalewise.protocol import PushHeader
from stalewise.runtime.options import RunOptions
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import Fixed


class Pair(NamedTuple):
    w: np.ndarray
    b: np.ndarray


def _job(params=None, **kw):
    params = {"x": np.zeros(6, np.float32)} if params is None else params
    kw.setdefault("optimizer", sw.optim.adam(0.1))
    return sw.Job(params, **kw)


def _trained_states(job, pushes=3, workers=2):
    """Shard states after a few real pushes (optimizer moments, clocks, stats all non-trivial)."""
    config = job.config
    flat = config.init.copy()
    shards = [
        config.build_shard(k, flat[lo:hi], workers) for k, (lo, hi) in enumerate(config.ranges)
    ]
    for shard in shards:
        shard.join(0, incarnation=1)
    for seq in range(pushes):
        for shard in shards:
            update = np.full(shard.params.size, seq + 1.0, shard.params.dtype)
            assert shard.push(PushHeader(0, seq, shard.version, 1), update).ok
    return [shard.state_dict() for shard in shards]


def _save(d, job, states, **kw):
    return checkpoint.save(
        d,
        states,
        spec=job.config.spec,
        config_info=checkpoint.config_info(job.config),
        step_info={"pushes": states[0]["version"]},
        **kw,
    )


def _assert_same_state(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for key in a:
        if isinstance(a[key], np.ndarray):
            assert isinstance(b[key], np.ndarray), key
            assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
        else:
            assert a[key] == b[key], key


# -- the format ---------------------------------------------------------------------------


def test_save_load_round_trip_is_exact(tmp_path):
    job = _job({"x": np.zeros(6, np.float32), "y": np.ones(3, np.float32)}, shards=2)
    states = _trained_states(job)
    path = _save(tmp_path, job, states)
    assert path.name == "ckpt-000000003"
    assert sorted(os.listdir(path)) == [
        "manifest.json",
        "manifest.sha256",
        "shard-0.safetensors",
        "shard-1.safetensors",
    ]
    assert (tmp_path / "latest").read_text().strip() == path.name
    ckpt = checkpoint.load(tmp_path)
    assert ckpt.path == path and ckpt.version == 3
    assert ckpt.manifest["config"]["ranges"] == [list(r) for r in job.config.ranges]
    for saved, loaded in zip(states, ckpt.states, strict=True):
        _assert_same_state(saved, loaded)
    lo, hi = job.config.ranges[1]
    fresh = job.config.build_shard(1, np.zeros(hi - lo, np.float32), 2)  # takes it as loaded
    fresh.load_state_dict(ckpt.states[1])
    assert fresh.version == 3 and fresh.state_dict()["opt_structure"] == "AdamState(count, mu, nu)"


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "manifest"])
def test_damaged_checkpoint_is_refused_and_the_previous_one_used(tmp_path, caplog, damage):
    job = _job()
    older = _save(tmp_path, job, _trained_states(job, pushes=2))
    newer = _save(tmp_path, job, _trained_states(job, pushes=4))
    bad = newer / ("manifest.json" if damage == "manifest" else "shard-0.safetensors")
    data = bytearray(bad.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data[-3] ^= 0xFF
    bad.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="stalewise.checkpoint"):
        ckpt = checkpoint.load(tmp_path)
    assert ckpt.path == older and ckpt.version == 2
    text = caplog.text
    assert str(bad) in text and "checksum mismatch" in text
    assert f"using {older.name} instead of {newer.name}" in text
    # a named checkpoint folder has no fallback
    with pytest.raises(sw.CheckpointError, match="checksum mismatch"):
        checkpoint.load(newer)
    # nothing usable: one line
    (older / "shard-0.safetensors").write_bytes(b"")
    with pytest.raises(sw.CheckpointError, match="no usable checkpoint") as e:
        checkpoint.load(tmp_path)
    assert "\n" not in str(e.value)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(sw.CheckpointError, match="no checkpoint in"):
        checkpoint.load(empty)


def test_leftover_temp_folder_is_ignored_and_cleaned(tmp_path):
    job = _job()
    first = _save(tmp_path, job, _trained_states(job, pushes=1))
    crash = tmp_path / ".tmp-ckpt-000000009-deadbeef"  # a save that died before its rename
    crash.mkdir()
    (crash / "shard-0.safetensors").write_bytes(b"half")
    (tmp_path / ".tmp-latest-deadbeef").write_text("ckpt-000000009\n")
    assert checkpoint.load(tmp_path).path == first
    second = _save(tmp_path, job, _trained_states(job, pushes=2))
    assert not crash.exists() and not (tmp_path / ".tmp-latest-deadbeef").exists()
    assert sorted(os.listdir(tmp_path)) == [first.name, second.name, "latest"]
    # saving the same version again replaces it in one rename
    again = _save(tmp_path, job, _trained_states(job, pushes=2))
    assert again == second and checkpoint.load(tmp_path).version == 2
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


def test_keep_deletes_older_checkpoints(tmp_path):
    job = _job()
    for pushes in (1, 2, 3, 4):
        _save(tmp_path, job, _trained_states(job, pushes=pushes), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000003", "ckpt-000000004", "latest"]
    assert checkpoint.load(tmp_path).version == 4
    _save(tmp_path, job, _trained_states(job, pushes=5), keep=1)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000000005", "latest"]


def test_sw_load_returns_the_users_structure(tmp_path):
    params = {
        "layer": {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float16)},
        "pair": Pair(np.arange(2, dtype=np.float32), np.ones(1, np.float32)),
        "none": None,
        "list": [np.full(2, 5.0, np.float32)],
    }
    job = _job(params, optimizer=sw.optim.sgd(0.1), shards=2)
    _save(tmp_path, job, _trained_states(job, pushes=1))
    back = sw.load_params(tmp_path, like=params)  # the user's classes come from like=
    assert back["none"] is None and isinstance(back["pair"], Pair)
    assert back["layer"]["w"].shape == (2, 3) and back["layer"]["b"].dtype == np.float16
    # sgd(0.1) of one push of ones: every leaf moved by -0.1 from its start
    np.testing.assert_allclose(back["layer"]["w"], np.full((2, 3), 0.9), rtol=1e-6)
    np.testing.assert_allclose(back["pair"].w, [-0.1, 0.9], rtol=1e-6)
    np.testing.assert_allclose(back["list"][0], [4.9, 4.9], rtol=1e-6)
    plain = sw.load_params(tmp_path)  # without like=: plain data, the namedtuple as a dict
    assert type(plain["pair"]) is dict and sorted(plain["pair"]) == ["b", "w"]
    assert plain["none"] is None and type(plain["list"]) is list
    np.testing.assert_array_equal(plain["pair"]["w"], back["pair"].w)
    np.testing.assert_array_equal(plain["layer"]["b"], back["layer"]["b"])


def test_sw_load_of_a_torch_model_gives_its_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    job = _job(model, optimizer=sw.optim.sgd(0.1))
    _save(tmp_path, job, _trained_states(job, pushes=1))
    back = sw.load_params(tmp_path)
    want = model.state_dict()
    assert list(back) == sorted(want)
    for name, tensor in back.items():
        assert isinstance(tensor, torch.Tensor)
        assert tensor.shape == want[name].shape and tensor.dtype == want[name].dtype
    np.testing.assert_allclose(back["0.bias"].numpy(), want["0.bias"].numpy() - 0.1, rtol=1e-5)
    as_numpy = sw.load_params(tmp_path, backend="numpy")
    assert isinstance(as_numpy["0.weight"], np.ndarray)


def test_run_options_check_the_checkpoint_fields(tmp_path):
    base = {"loss_and_grad": lambda p, b: (0.0, p), "data": [[0]], "workers": 1, "steps": 1}
    cases = [
        ({"checkpoint_every": 0, "checkpoint_dir": tmp_path}, "checkpoint_every"),
        ({"checkpoint_seconds": -1.0, "checkpoint_dir": tmp_path}, "checkpoint_seconds"),
        ({"checkpoint_every": 5}, "checkpoint_every needs checkpoint_dir"),
        ({"resume": True}, "resume needs checkpoint_dir"),
        ({"resume": "yes", "checkpoint_dir": tmp_path}, "resume must be"),
        ({"checkpoint_dir": 3}, "checkpoint_dir must be a path"),
    ]
    for extra, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            RunOptions(**base, **extra)


# -- the local runtime --------------------------------------------------------------------


def test_local_checkpoints_and_resume(tmp_path, no_leaks):
    task = tasks.get("least-squares", n=64, d=4)
    d = tmp_path / "ckpt"

    def train(steps, **kw):
        job = sw.Job(task.init_params(), optimizer=sw.optim.adam(0.05))
        records = []
        result = job.train(
            task.loss_and_grad,
            data=task.batches,
            workers=2,
            steps=steps,
            emulation=sw.Emulation(delays={0: 0.005, 1: 0.005}),
            metrics=sw.Metrics(every=0.05, on_record=records.append),
            timeouts=sw.Timeouts(total=60),
            **kw,
        )
        return result, records

    first, _ = train(60, checkpoints=sw.Checkpoints(d, every=10, keep=10))
    saved = sorted(p for p in os.listdir(d) if p.startswith("ckpt-"))
    assert len(saved) >= 3, saved  # periodic ones, then the end of the run
    end = checkpoint.load(d)
    assert end.version == first.stats["version"] and end.step["pushes"] == first.pushes
    np.testing.assert_array_equal(sw.load_params(d)["x"], first.params["x"])

    resumed, records = train(120, checkpoints=sw.Checkpoints(d, resume=True))
    assert records[0]["updates"] >= end.version  # it starts at the saved version
    assert resumed.stats["version"] >= 120 > end.version
    assert resumed.pushes >= 120  # steps is the job's total, the pushes before included
    fresh, _ = train(120)
    assert not np.array_equal(resumed.flat, fresh.flat)
    assert checkpoint.load(d).version == resumed.stats["version"]

    other = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.05))
    with pytest.raises(sw.CheckpointError, match="optimizer"):
        other.train(
            task.loss_and_grad,
            data=task.batches,
            workers=2,
            steps=10,
            checkpoints=sw.Checkpoints(d, resume=True),
        )


def test_local_server_load_then_join(no_leaks):
    job = _job()
    states = _trained_states(job, pushes=2, workers=1)
    states[0]["incarnation"][:] = 5  # a checkpoint of a worker restarted a few times
    with job.serve(workers=1) as server:
        assert server.load_state_dicts(states) == [2]
        client = server.client(0)
        assert client.incarnation == 6
        np.testing.assert_array_equal(client.pull()["x"], states[0]["params"])
        client.push({"x": np.ones(6, np.float32)})
        result = client.wait(timeout=10)
        assert result.status == "applied" and result.versions == (3,)
        with pytest.raises(ValueError, match="load before they do"):
            server.load_state_dicts(states)


# -- the simulator ------------------------------------------------------------------------


# Cut at a BSP round's end, a run resumes bit-identically. An ASP run has no such point
# since the simulated worker pulls as the local one does (protocol/pipeline.py: its next
# pull reads the newest published snapshots, overlapping its push, so what a step starts
# from depends on the order of same-time events, which a checkpoint does not keep); its
# lockstep case was dropped with that change.
@pytest.mark.parametrize(
    ("consistency", "sim"),
    [
        (sw.BSP(), SimConfig()),  # random compute times, latency, bandwidth
        (sw.BSP(), SimConfig(compute=Fixed(0.01))),
    ],
    ids=["bsp-random", "bsp-fixed"],
)
def test_sim_interrupted_and_resumed_is_bit_identical(tmp_path, consistency, sim):
    task = tasks.get("least-squares", n=64, d=4, exact=True)

    def train(steps, **kw):
        job = sw.Job(
            task.init_params(), optimizer=sw.optim.adam(0.05), consistency=consistency, shards=2
        )
        records = []
        result = job.train(
            task.loss_and_grad,
            data=task.batches,
            workers=4,
            steps=steps,
            runtime=sw.Simulation(sim, seed=3),
            metrics=sw.Metrics(on_record=records.append),
            **kw,
        )
        return result, records

    whole, _ = train(100)
    cut, _ = train(
        40, checkpoints=sw.Checkpoints(tmp_path)
    )  # interrupted by its budget (a BSP round's end)
    resumed, records = train(100, checkpoints=sw.Checkpoints(tmp_path, resume=True))
    assert records[0]["updates"] == cut.stats["version"] > 0
    assert resumed.pushes == whole.pushes == 100
    assert resumed.stats["version"] == whole.stats["version"]
    assert resumed.flat.tobytes() == whole.flat.tobytes()
    assert not np.array_equal(cut.flat, whole.flat)


def test_the_simulator_resumes_only_its_own_checkpoints(tmp_path):
    """A checkpoint without the simulator's clock (another runtime's) is refused on one
    line; the rule is the runtime registry's (``resumes_from``), asked by the driver."""
    task = tasks.get("least-squares", n=64, d=4, exact=True)
    job = sw.Job(task.init_params(), optimizer=sw.optim.adam(0.05))
    shard = job.config.build_shard(0, job.config.init.copy(), workers=2)
    info = checkpoint.config_info(job.config, runtime="local")
    checkpoint.save(tmp_path, [shard.state_dict()], spec=job.config.spec, config_info=info,
                    step_info={"pushes": 0})  # fmt: skip
    with pytest.raises(sw.CheckpointError, match=r"not written by runtime 'sim' \(runtime "
                       r"'local'\); it resumes only its own"):  # fmt: skip
        job.train(task.loss_and_grad, data=task.batches, workers=2, steps=4, runtime="sim",
                  checkpoints=sw.Checkpoints(tmp_path, resume=True))  # fmt: skip


# -- the push-log writer (checkpoint.store.LogWriter), both runtimes' --


@pytest.mark.parametrize(("fsync", "fsync_end", "synced"), [(0, 0, 0), (1, 0, 2), (0, 1, 1)])
def test_a_push_log_is_fsynced_at_its_end_only_if_asked(
    tmp_path, monkeypatch, fsync, fsync_end, synced
):
    """``fsync``: each sync and the end; ``end(fsync=True)`` (the local runtime's): the end."""
    from stalewise.checkpoint.store import LogWriter

    log = LogWriter("shard 0")
    assert log.begin(str(tmp_path / "log"), fsync=bool(fsync))
    calls: list = []
    monkeypatch.setattr(os, "fsync", calls.append)
    monkeypatch.setattr(os, "fdatasync", calls.append)
    log.write([b"an ", b"entry"])
    assert log.sync()
    log.end(fsync=bool(fsync_end))
    assert len(calls) == synced and (tmp_path / "log").read_bytes() == b"an entry"


class _Full:
    """A push log's file on a full disk."""

    def __init__(self, file):
        self.file = file

    def writelines(self, _):
        raise OSError(28, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.file, name)


@pytest.mark.parametrize("runtime", ["local", "ray"])
def test_a_shard_whose_push_log_failed_journals_no_more(tmp_path, caplog, runtime):
    """The log is removed (a replay stops before it) and, with no backup, the shard stops
    encoding journal entries nobody takes."""
    from stalewise.runtime.local.shard_proc import ShardProcess
    from stalewise.runtime.ray.shard import ShardActor

    task = tasks.get("least-squares", n=64, d=4)
    config = sw.Job(task.init_params(0), optimizer=sw.optim.sgd(0.05), shards=1).config
    if runtime == "ray":
        shard = ShardActor(config, 0, 1, 0.02)
    else:
        shard = ShardProcess.__new__(ShardProcess)
        shard.primary, shard.unsynced, shard.unsent = None, False, 0
        shard.shard = config.build_shard(0, config.init.copy(), 1, None)
        shard.log = checkpoint.store.LogWriter("shard 0")
    path = tmp_path / "log-shard-0"
    shard.begin_log(str(path))
    assert shard.shard.journal is not None
    shard.log.file = _Full(shard.log.file)
    shard.shard.admit(0, 1)  # a journaled call
    if runtime == "local":
        shard.sync()  # the turn's end
    assert shard.shard.journal is None and not path.exists()
    assert "push log" in caplog.text and "No space left" in caplog.text
