"""stalewise.calibrate on the Ray runtime: the pulls, pushes, the shard actor's time per push
and the worker loop timed on Ray (the suite's shared cluster, ``ray_cluster`` in
conftest.py), and a simulation on the table it makes."""

import math

import pytest

import stalewise as sw
from stalewise import calibrate, tasks


def tiny(shards=1):
    task = tasks.get("least-squares", n=256, d=16)
    return task, sw.Job(task.init_params(0), optimizer=sw.optim.sgd(0.05), shards=shards)


def test_a_runtime_calibrate_does_not_measure_is_refused_before_measuring():
    task, job = tiny()
    with pytest.raises(ValueError, match=r"^runtime = 'sim': calibrate measures one of"):
        job.calibrate(task.loss_and_grad, task.batches, workers=1, runtime="sim")


def test_a_ray_calibration_times_ray_and_its_table_simulates(ray_cluster, monkeypatch):
    ray = pytest.importorskip("ray")
    # the worker loop's Ray run: 60 steps, not 300 (a step on Ray took 20-35 ms at load 15)
    monkeypatch.setattr(calibrate, "LOOP_STEPS", 60)
    task, job = tiny(shards=2)
    cal = job.calibrate(
        task.loss_and_grad, task.batches, workers=1, repeats=3, sizes=(256, 1024),
        contention=False, timeout=60, runtime="ray",
    )  # fmt: skip
    assert cal.runtime == "ray" and calibrate.ON_RAY in cal.summary()
    # every figure timed on Ray is finite and positive, at both sizes; the apply is shard
    # 0's actor's own time per push, at its slice's bytes (a local calibration times one
    # shard of the whole size in this process)
    assert [b for b, _ in cal.apply.points] == [128 * 4, 512 * 4]
    for fit in (cal.pull, cal.push, cal.send):
        assert [b for b, _ in fit.points] == [256 * 4, 1024 * 4]
    for fit in (cal.apply, cal.pull, cal.push, cal.send):
        assert all(math.isfinite(s) and s > 0 for _, s in fit.points), fit
    for name, s in cal.spreads:
        assert math.isfinite(s.max) and s.min >= 0, name
    assert cal.loop is not None and math.isfinite(cal.loop) and cal.loop >= 0
    table = cal.table()
    assert all(math.isfinite(table[k]) and table[k] >= 0 for k in ("latency", "service_time"))
    # the calibration used this process's connection, and left it connected
    assert ray.is_initialized()
    assert ray.get_runtime_context().gcs_address == ray_cluster.address
    # a tiny job simulated on the Ray-calibrated table runs
    r = job.train(task.loss_and_grad, data=task.batches, workers=2, steps=20,
                  runtime=sw.Simulation(cal.sim_config()))  # fmt: skip
    assert r.pushes == 20 and r.time > 0
