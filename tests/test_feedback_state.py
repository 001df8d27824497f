"""Error feedback is worker state: checkpoints save it, resumes and restarts continue it.

The simulator resumes a topk run bit for bit. In the local runtime the residual
lives in shared memory: a seqlock keeps a reader from ever copying a torn one,
and with a constant gradient and plain SGD every applied push moves the
params by exactly ``lr * C(g + e)``, so after any run

    params = init - lr * (applied * g - sum of the workers' residuals)

(the codec sends everything, only later). The saved residuals are checked
against it after a run, a resume and a crashed and restarted worker: a residual
lost or counted twice breaks it by far more than rounding.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import shutil
import time

import numpy as np
import pytest

import stalewise as sw
from stalewise import checkpoint, codecs, tasks
from stalewise.protocol import compress
from stalewise.runtime.local import layout as L
from stalewise.runtime.local.layout import Residuals
from stalewise.runtime.local.shm import SharedBlock
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import Failure, Fixed, Network

TOPK = codecs.topk(0.01)

# -- the simulator ------------------------------------------------------------------------


# A BSP round's end is a synchronisation point; an ASP run has none since the simulated
# worker's pull overlaps its push (protocol/pipeline.py; see test_checkpoint's resume test).
@pytest.mark.parametrize(
    ("consistency", "sim"),
    [(sw.BSP(), SimConfig(compute=Fixed(0.01)))],
    ids=["bsp-fixed"],
)
def test_sim_resume_with_topk_error_feedback_is_bit_identical(tmp_path, consistency, sim):
    """100 pushes straight = 48, checkpointed, then resumed to 100, with topk(0.01) and its
    error feedback; failed before the residuals were saved (a resumed worker started from 0)."""
    task = tasks.get("least-squares", n=256, d=2000, exact=True)

    def train(steps, **kw):
        job = sw.Job(
            task.init_params(),
            optimizer=sw.optim.adam(0.05),
            consistency=consistency,
            shards=2,
            codec=TOPK,
        )
        return job.train(
            task.loss_and_grad,
            data=task.batches,
            workers=4,
            steps=steps,
            runtime=sw.Simulation(sim, seed=3),
            metrics=sw.Metrics(every=1e9),
            timeouts=sw.Timeouts(total=120),
            **kw,
        )

    whole = train(100)
    cut = train(48, checkpoints=sw.Checkpoints(tmp_path))  # a BSP round's end (4 workers)
    saved = checkpoint.load(tmp_path)
    assert saved.step["pushes"] == 48 and len(saved.residuals) == 4
    for r in saved.residuals:  # what topk had not sent, from every worker
        assert r.dtype == np.float32 and r.shape == (2000,) and np.count_nonzero(r) > 1500
    resumed = train(100, checkpoints=sw.Checkpoints(tmp_path, resume=True))
    assert resumed.pushes == whole.pushes == 100
    assert not np.array_equal(cut.flat, whole.flat)
    assert resumed.flat.tobytes() == whole.flat.tobytes()


def _sim_job(**kw):
    return sw.Job({"x": np.zeros(2000, np.float32)}, optimizer=sw.optim.sgd(0.1), codec=TOPK, **kw)


def _sim_train(job, d, steps, resume=False):
    task = tasks.get("least-squares", n=64, d=2000, exact=True)
    return job.train(
        task.loss_and_grad,
        data=task.batches,
        workers=2,
        steps=steps,
        runtime=sw.Simulation(seed=1),
        metrics=sw.Metrics(every=1e9),
        checkpoints=sw.Checkpoints(d, resume=resume),
        timeouts=sw.Timeouts(total=120),
    )


def _rewrite_residuals(d, residuals):
    """Replaces the residuals of ``d``'s newest checkpoint (a new, checksummed checkpoint)."""
    ckpt = checkpoint.load(d)
    shutil.rmtree(ckpt.path)
    checkpoint.save(
        d,
        ckpt.states,
        spec=checkpoint.spec.spec_from_json(ckpt.manifest["spec"]),
        config_info=ckpt.manifest["config"],
        step_info=ckpt.step,
        residuals=residuals,
    )


@pytest.mark.parametrize(
    ("residuals", "message"),
    [
        (
            [np.zeros(2000, np.float32), np.zeros(1999, np.float32)],
            r"arrays\['worker-1'\] is \['float32', \[1999\]\], expected \['float32', \[n\]\]",
        ),
        (
            [np.zeros(2000, np.float64)] * 2,
            r"arrays\['worker-0'\] is \['float64', \[2000\]\], expected \['float32', \[n\]\]",
        ),
        (
            [np.zeros(2000, np.float32)] * 3,
            "the error-feedback residuals of 3 workers, this run has 2",
        ),
    ],
    ids=["shape", "dtype", "workers"],
)
def test_a_residual_of_another_shape_or_worker_count_is_refused(tmp_path, residuals, message):
    _sim_train(_sim_job(), tmp_path, 20)
    _rewrite_residuals(tmp_path, residuals)  # (its manifest declares the arrays as they are)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(sw.CheckpointError, match=message) as info:
        _sim_train(_sim_job(), tmp_path, 40, resume=True)
    assert "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing was written


def test_old_checkpoints_resume_with_zero_residuals_and_feedback_of(tmp_path):
    """A checkpoint without residuals (older, or of a job without feedback) resumes with
    zero ones; residuals are kept only where this job's codec keeps feedback."""
    _sim_train(_sim_job(), tmp_path, 20)
    saved = checkpoint.load(tmp_path)
    assert np.count_nonzero(saved.residuals[0]) > 1500
    _rewrite_residuals(tmp_path, None)
    old = checkpoint.load(tmp_path)
    assert old.residuals is None and "feedback" not in old.manifest
    assert not (old.path / checkpoint.store.FEEDBACK).exists()
    job = _sim_job()
    fb = checkpoint.feedback_of(old, job.config, 2)
    assert [f.residual.tolist() for f in fb] == [[0.0] * 2000] * 2
    resumed = _sim_train(job, tmp_path, 40, resume=True)
    assert resumed.pushes == 40 and resumed.stats["applied"] == 40
    again = checkpoint.load(tmp_path)
    assert again.residuals is not None and np.count_nonzero(again.residuals[1]) > 1500
    # the same residuals in a job whose codec keeps no feedback: not used
    plain = sw.Job({"x": np.zeros(2000, np.float32)}, optimizer=sw.optim.sgd(0.1))
    assert checkpoint.feedback_of(again, plain.config, 2) is None
    # a codec keeping feedback on some leaves only: the others' residual is zeroed
    two = sw.Job(
        {"b": np.zeros(8, np.float32), "w": np.zeros(1992, np.float32)},
        optimizer=sw.optim.sgd(0.1),
        codec=TOPK,  # b (8 values) travels as none(): no feedback there
    )
    fb = checkpoint.feedback_of(again, two.config, 2)
    np.testing.assert_array_equal(fb[1].residual[:8], 0)
    np.testing.assert_array_equal(fb[1].residual[8:], again.residuals[1][8:])


def test_a_corrupt_residual_file_is_refused_and_the_previous_checkpoint_used(tmp_path, caplog):
    _sim_train(_sim_job(), tmp_path, 20)
    _sim_train(_sim_job(), tmp_path, 40, resume=True)
    newest = checkpoint.load(tmp_path)
    with open(newest.path / checkpoint.store.FEEDBACK, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x00\x01\x02")
    with caplog.at_level("WARNING", logger="stalewise.checkpoint"):
        used = checkpoint.load(tmp_path)
    assert used.path != newest.path and used.step["pushes"] == 20
    assert f"{checkpoint.store.FEEDBACK}: checksum mismatch" in caplog.text


# -- the shared-memory residuals ----------------------------------------------------------

N = 100_000  # a residual big enough that a copy is not one store


def _writer(handle, layout, seconds):
    """A worker following Residuals' protocol for ``seconds``: push c writes a residual of
    all c's into the buffer the last committed one is not in, then commits its record."""
    block = SharedBlock.attach(handle)
    res = Residuals(layout, block)
    rec = layout.records(block)[0]
    cur, c, end = 1, 0, time.monotonic() + seconds
    while time.monotonic() < end:
        c += 1
        new = res.writing(0, 1 - cur)
        new[: N // 2] = c  # two stores at least: a reader racing it sees a torn vector
        new[N // 2 :] = c
        res.written(0, 1 - cur, c)
        rec[L.R_COMMIT] = 0
        rec[L.R_INC], rec[L.R_SEQ] = 1, c - 1
        rec[L.R_COMMIT] = c
        cur = 1 - cur
    block.close()


def test_residuals_are_read_whole_while_a_worker_rewrites_them(no_leaks):
    """A reader of the residual of the last committed push, racing a writer process, only
    ever gets one push's residual whole, never older than the commit it saw first."""
    layout = L.Layout(N, "float32", 1, 1, (1024,), feedback=True)
    block = SharedBlock.create(layout.nbytes)
    proc = None
    try:
        res = Residuals(layout, block)
        res.put(0, np.zeros(N, np.float32))
        rec = layout.records(block)[0]
        proc = mp.get_context("spawn").Process(target=_writer, args=(block.handle, layout, 1.5))
        proc.start()
        out = np.empty(N, np.float32)
        seen, reads = set(), 0
        while proc.is_alive() or reads < 10:
            committed = int(rec[L.R_COMMIT]) if int(rec[L.R_INC]) == 1 else 0
            tag = res.read(0, 1, out, timeout=10)
            assert out[0] == out[-1] == tag and (out == tag).all(), (tag, np.unique(out))
            assert tag >= committed  # never the residual of a push older than a committed one
            seen.add(tag)
            reads += 1
        proc.join(10)
        assert proc.exitcode == 0
        assert len(seen) > 3, seen  # it did race the writer
        last = int(rec[L.R_COMMIT])
        assert res.read(0, 1, out) == last and (out == last).all()
        # a push encoded but not committed does not count: its residual is not the one read
        res.writing(0, int(np.argmin(res.tags[0])))[:] = 7
        res.written(0, int(np.argmin(res.tags[0])), last + 1)
        assert res.read(0, 1, out) == last and (out == last).all()
        # the next incarnation takes the committed one over
        res.hand_over(0, 1)
        assert res.read(0, 2, out) == 0 and (out == last).all()
        assert list(res.tags[0]) == [-1, 0]
    finally:
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join()
        block.close()


# -- the local runtime --------------------------------------------------------------------

D = 3000  # parameters
LR = 0.01
G = np.random.default_rng(7).standard_normal(D)  # the constant gradient (float64)


def constant_grad(params, batch):
    """A constant gradient, whatever the params; raises once in worker 0's first incarnation
    after 20 calls when $FEEDBACK_MARK names a file that does not exist yet."""
    if batch[0] == 0 and batch[1] == 20:
        mark = os.environ.get("FEEDBACK_MARK")
        if mark and not os.path.exists(mark):
            open(mark, "w").close()
            raise RuntimeError("worker 0 fails once")
    return 1.0, {"x": G.copy()}


def worker_batches(worker, workers):
    return ((worker, i) for i in range(10**9))


def _local_job():
    return sw.Job({"x": np.zeros(D)}, optimizer=sw.optim.sgd(LR), codec=TOPK, shards=2)


def _train_local(d, steps, resume=False, **kw):
    return _local_job().train(
        constant_grad,
        data=worker_batches,
        workers=2,
        steps=steps,
        checkpoints=sw.Checkpoints(d, resume=resume),
        metrics=sw.Metrics(every=1e9, progress=False),
        timeouts=sw.Timeouts(total=120),
        **kw,
    )


def _assert_nothing_lost(params, applied, residuals):
    """params = -lr * (applied * g - sum of the residuals): what was not applied is held."""
    held = np.sum(residuals, axis=0)
    assert np.count_nonzero(held) > D // 2
    expected = -LR * (applied * G - held)
    np.testing.assert_allclose(params, expected, rtol=0, atol=1e-9)
    # losing a residual would be off by at least this much
    assert min(np.abs(LR * r).max() for r in residuals) > 1e-4


def test_local_checkpoint_saves_the_residuals_and_a_resume_continues_them(tmp_path, no_leaks):
    first = _train_local(tmp_path, 60)
    saved = checkpoint.load(tmp_path)
    assert saved.step["pushes"] == first.pushes == first.stats["version"] >= 60
    assert first.stats["applied"] == first.stats["version"]  # each push applied once
    assert len(saved.residuals) == 2
    assert all(r.dtype == np.float64 and np.count_nonzero(r) > D // 2 for r in saved.residuals)
    _assert_nothing_lost(first.flat, first.stats["version"], saved.residuals)

    resumed = _train_local(tmp_path, 150, resume=True)
    end = checkpoint.load(tmp_path)
    assert resumed.stats["version"] >= 150 > first.stats["version"]
    # holds across the resume only if each worker continued with its saved residual
    _assert_nothing_lost(resumed.flat, resumed.stats["version"], end.residuals)
    assert not any(
        np.array_equal(a, b) for a, b in zip(saved.residuals, end.residuals, strict=True)
    )


def test_a_restarted_worker_continues_with_its_predecessors_residual(
    tmp_path, no_leaks, monkeypatch
):
    monkeypatch.setenv("FEEDBACK_MARK", str(tmp_path / "failed"))
    r = _train_local(tmp_path / "ckpt", 120, failures=sw.Failures("restart", max_restarts=1))
    assert (tmp_path / "failed").exists() and r.restarts == 1
    assert r.failures[0]["worker"] == 0 and "worker 0 fails once" in r.failures[0]["cause"]
    end = checkpoint.load(tmp_path / "ckpt")
    # with the crashed incarnation's residual dropped, this is off by lr * that residual
    assert r.stats["applied"] == r.stats["version"] >= 120
    _assert_nothing_lost(r.flat, r.stats["version"], end.residuals)


def test_sim_restarts_continue_the_residual_of_the_last_committed_push(tmp_path, monkeypatch):
    """Scripted failures in every phase (pulling, computing with the push encoded but not
    committed, pushing with it committed) and an error in user code, all restarted: the
    params still hold everything the residuals do not."""
    monkeypatch.setenv("FEEDBACK_MARK", str(tmp_path / "failed"))
    times = [0.1 + 0.0237 * i for i in range(16)]  # at every phase of a worker's step
    sim = SimConfig(
        compute=Fixed(0.01),
        network=Network(latency=0.002, bandwidth=math.inf),
        failures=tuple(Failure(worker=i % 2, time=t) for i, t in enumerate(times)),
        restart_delay=0.002,
    )
    r = _local_job().train(
        constant_grad,
        data=worker_batches,
        workers=2,
        steps=300,
        runtime=sw.Simulation(sim),
        failures=sw.Failures(policy="restart", max_restarts=None),
        checkpoints=sw.Checkpoints(tmp_path / "ckpt"),
        metrics=sw.Metrics(every=1e9),
        timeouts=sw.Timeouts(total=120),
    )
    assert (tmp_path / "failed").exists()
    assert r.restarts == 17 and any("fails once" in e["cause"] for e in r.failures)
    assert r.stats["applied"] == r.stats["version"] >= 250
    _assert_nothing_lost(r.flat, r.stats["version"], checkpoint.load(tmp_path / "ckpt").residuals)


def test_serve_residuals_are_what_the_worker_holds_and_load_before_join(no_leaks):
    """Job.serve: the residual the server reads is the one the worker's codec keeps (a
    Compressor run here, push by push); a loaded residual is the next incarnation's."""
    job = sw.Job({"x": np.zeros(D, np.float32)}, optimizer=sw.optim.sgd(1.0), codec=TOPK)
    comp = job.config.compressor()
    rng = np.random.default_rng(0)
    with job.serve(workers=2) as server:
        start = rng.standard_normal(D).astype(np.float32)
        with pytest.raises(ValueError, match=r"worker 1's residual has shape \(3,\)"):
            server.load_residuals([start, np.zeros(3, np.float32)])
        server.load_residuals([start, np.zeros(D, np.float32)])
        with pytest.raises(ValueError, match="1 residuals for 2 workers"):
            server.load_residuals([start])
        client = server.client(0)
        np.testing.assert_array_equal(client.residual, start)
        with pytest.raises(ValueError, match="worker 0 has a client"):
            server.load_residuals([start, start])
        mine = compress.Feedback(start.copy())
        for _ in range(3):
            g = rng.standard_normal(D).astype(np.float32)
            client.pull(timeout=10)
            client.push({"x": g}, timeout=10)
            assert client.wait(timeout=10).status == "applied"
            _, mine = comp.encode(g, mine)
            read = server.residuals()
            np.testing.assert_array_equal(read[0], mine.residual)
            np.testing.assert_array_equal(client.residual, mine.residual)
            np.testing.assert_array_equal(read[1], 0)
        client.close()
        again = server.client(0)  # a new incarnation takes the residual over
        np.testing.assert_array_equal(again.residual, mine.residual)
        np.testing.assert_array_equal(server.residuals()[0], mine.residual)
        again.close()
