"""The simulator's contention model: the steps' CPU times share the cores at the factor for
the processes runnable, a shard's apply stretched by the factor when it starts
(SimConfig.contention), and the table stalewise calibrate makes of its measurement."""

from __future__ import annotations

import math
import tomllib

import numpy as np
import pytest

import stalewise as sw
from stalewise import calibrate, tasks
from stalewise.runtime import sim as sim_rt
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import (
    Contention,
    Fixed,
    Network,
    Service,
    SimConfigError,
    WorkerTiming,
)

FREE = {
    "network": Network(latency=0.0, bandwidth=math.inf),
    "service": Service(time=0.0, rate=math.inf),
}


def _run(sim, workers=4, steps=400, consistency=None, seed=0, **options):
    task = tasks.get("least-squares", n=64, d=4, exact=True)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.05),
                 consistency=consistency or sw.ASP())  # fmt: skip
    return sim_rt.train(job.config, task.loss_and_grad, data=task.batches, workers=workers,
                        steps=steps, strategy=job.strategy, sim=sim, sim_seed=seed,
                        evaluate=None, **options)  # fmt: skip


def test_contention_factors_interpolate_extrapolate_and_name_bad_values():
    c = Contention(step=[1, 1, 1.5, 2], apply=[1.0])
    assert c.step == (1.0, 1.0, 1.5, 2.0) and c.apply_at(50) == 1.0  # one entry: flat
    assert c.step_at(0) == c.step_at(1) == 1.0 and c.step_at(2.5) == 1.25 and c.step_at(5) == 2.5
    with pytest.raises(SimConfigError, match=r"Contention.step\[1\] = -2"):
        Contention(step=[1, -2], apply=[1])
    with pytest.raises(SimConfigError, match=r"Contention.apply = \(\): must be a non-empty"):
        Contention(step=[1], apply=())
    with pytest.raises(SimConfigError, match=r"SimConfig\.contention = 2"):
        SimConfig(contention=2)
    with pytest.raises(ValueError, match="sim: contention_step needs contention_apply too"):
        SimConfig.from_dict({"contention_step": [1, 2]})
    got = SimConfig.from_dict({"contention_step": [1, 2], "contention_apply": [1, 1.5]})
    assert got.contention == Contention(step=(1.0, 2.0), apply=(1.0, 1.5))


def test_no_contention_and_a_flat_one_give_the_same_bits():
    """A table of ones takes the contention model's every path and changes nothing."""
    base = SimConfig(compute=Fixed(0.01), **FREE)
    flat = SimConfig(compute=Fixed(0.01), contention=Contention((1.0,) * 4, (1.0,) * 4), **FREE)
    for cons in (sw.ASP(), sw.BSP()):
        a, b = _run(base, consistency=cons), _run(flat, consistency=cons)
        assert a.time == b.time and a.records == b.records and _timed(a) == _timed(b)


def _timed(result) -> dict:
    """The run's stats but the simulator's own wall time."""
    sim = {k: v for k, v in result.stats["sim"].items() if k not in ("wall_time", "events_per_s")}
    return result.stats | {"sim": sim}


def test_a_step_stretches_by_the_factor_for_the_runnable_processes():
    """4 workers of 10 ms fixed steps: with 2 or more runnable a step takes 2x (the table's
    last segment is flat), so the run takes about twice as long; alone 1x, so 1 worker
    (whose shard serves in no time, before its next step starts) is not slowed."""
    table = Contention(step=(1.0, 2.0, 2.0), apply=(1.0,))
    free = _run(SimConfig(compute=Fixed(0.01), **FREE))
    busy = _run(SimConfig(compute=Fixed(0.01), contention=table, **FREE))
    assert busy.pushes == free.pushes == 400
    assert 1.9 < busy.time / free.time <= 2.0
    again = _run(SimConfig(compute=Fixed(0.01), contention=table, **FREE))
    assert again.records == busy.records and again.time == busy.time  # deterministic
    one = SimConfig(compute=Fixed(0.01), contention=table, **FREE)
    assert _run(one, workers=1, steps=50).time == _run(SimConfig(compute=Fixed(0.01), **FREE),
                                                       workers=1, steps=50).time  # fmt: skip


def test_a_shards_apply_stretches_with_the_workers_computing():
    """BSP, service 5 ms a request: the applies while workers compute take the apply's
    factor; with a table that slows only the apply, the run is slower, not its steps."""
    slow_apply = Contention(step=(1.0,), apply=(1.0, 3.0))
    net = Network(latency=0.0, bandwidth=math.inf)
    plain = SimConfig(compute=Fixed(0.01), network=net, service=Service(time=0.005))
    stretched = SimConfig(compute=Fixed(0.01), network=net, service=Service(time=0.005),
                          contention=slow_apply)  # fmt: skip
    a = _run(plain, consistency=sw.ASP(), steps=200)
    b = _run(stretched, consistency=sw.ASP(), steps=200)
    assert b.time > a.time
    assert b.stats["sim"]["compute_time_mean"] == pytest.approx(0.01)  # steps as long
    assert a.stats["sim"]["compute_time_mean"] == pytest.approx(0.01)


def test_the_table_is_the_steps_cpu_time_and_carries_the_factors():
    """Calibrated with the contention model, the table's step is the steps' CPU time (the
    factors, wall-clock over CPU time, stretch it); the factors go into the [sim] table."""
    steps = tuple((0.012,) * 10 for _ in range(4))
    cpus = tuple((0.004,) * 10 for _ in range(4))
    flat = calibrate.Fit.of([(4096, 1e-5), (16384, 1e-5)])
    c = Contention(step=(1.0, 1.0, 2.0, 3.0), apply=(1.0, 1.0, 1.5, 2.0))
    cal = calibrate.Calibration(4, 1, steps, flat, flat, flat, flat, 4096, contention=c,
                                cpu_times=cpus)  # fmt: skip
    t = cal.table()
    assert t["compute"] == "fixed" and t["step_time"] == pytest.approx(0.004)
    assert t["contention_step"] == [1.0, 1.0, 2.0, 3.0] and t["contention_apply"][-1] == 2.0
    assert tomllib.loads(calibrate.table_toml(t))["sim"] == t
    assert cal.sim_config().contention == c and cal.sim_config("high").contention == c
    assert calibrate.with_table(SimConfig(), cal).contention == c
    assert "contention: with 1, 2, ... 4 processes runnable" in cal.summary()
    # not measured: the wall-clock step, no contention keys
    plain = calibrate.Calibration(4, 1, steps, flat, flat, flat, flat, 4096).table()
    assert plain["step_time"] == 0.012 and "contention_step" not in plain


def test_factors_are_monotone():
    assert calibrate._factors([2.0, 1.8, 3.0, 2.9, 5.0]) == (2.0, 2.0, 3.0, 3.0, 5.0)


def test_a_step_that_sleeps_ends_late_by_the_wake_and_one_that_does_not_on_time():
    """A sleep (an emulated delay, a straggler's) ends ``contention_wake`` late: once a push,
    whatever its local steps; a step that only computes is not late."""
    timing = WorkerTiming(SimConfig(compute=Fixed(0.01)), 3, factors=[1, 2, 1],
                          delays=[0, 0, 0.005])  # fmt: skip
    assert timing.rest(0, 0.01, 1, 1.0, wake=0.002) == 0.0  # computes only: on time
    assert timing.rest(1, 0.01, 1, 1.0, wake=0.002) == pytest.approx(0.012)
    assert timing.rest(2, 0.03, 3, 1.0, wake=0.002) == pytest.approx(0.017)  # once a push
    c = Contention(step=(1.0,), apply=(1.0,), wake=(1e-4, 1e-3, 3e-3))
    assert c.wake_at(1) == 1e-4 and c.wake_at(2.5) == 2e-3 and c.wake_at(5) == pytest.approx(7e-3)
    assert Contention(step=(1.0,), apply=(1.0,)).wake_at(8) == 0.0  # unmeasured
    with pytest.raises(SimConfigError, match=r"Contention.wake\[1\] = -1"):
        Contention(step=[1], apply=[1], wake=[0, -1])
    got = SimConfig.from_dict({"contention_step": [1], "contention_apply": [1],
                               "contention_wake": [0, 1e-3]})  # fmt: skip
    assert got.contention.wake == (0.0, 1e-3)
    # in a run: 4 workers of 10 ms with 5 ms delays, 1 ms late with 2 or more runnable (flat)
    delayed = dict(compute=Fixed(0.01), **FREE)
    plain = Contention(step=(1.0,), apply=(1.0,))
    late = Contention(step=(1.0,), apply=(1.0,), wake=(0.0, 1e-3, 1e-3))
    a = _delayed(SimConfig(contention=plain, **delayed))
    b = _delayed(SimConfig(contention=late, **delayed))
    assert b.pushes == a.pushes and 1.02 < b.time / a.time <= 1.0 + 0.001 / 0.015 + 1e-9
    assert _delayed(SimConfig(contention=late, **delayed)).records == b.records  # deterministic


def _delayed(sim):
    task = tasks.get("least-squares", n=64, d=4, exact=True)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.05))
    return sim_rt.train(job.config, task.loss_and_grad, data=task.batches, workers=4, steps=200,
                        strategy=job.strategy, sim=sim, evaluate=None,
                        delays=dict.fromkeys(range(4), 0.005))  # fmt: skip


class _Clock:
    """A fake ``time`` for calibrate: a step takes 2 ms; a sleep ends ``late`` s late."""

    def __init__(self, late: float):
        self.t, self.late, self.events = 0.0, late, []

    def perf_counter(self) -> float:
        return self.t

    process_time = perf_counter

    def sleep(self, s: float) -> None:
        self.events.append(s)
        self.t += s + self.late

    def step(self, params, batch):
        self.events.append("step")
        self.t += 0.002
        return 0.0, params


@pytest.mark.parametrize("delay", [0.0, 0.005])
def test_the_contention_measurement_times_the_sleep_after_a_step(monkeypatch, delay):
    """As a worker lives it: each timed sleep (the emulated delay, else ``WAKE_SLEEP``) comes
    right after a step, which leaves the process no credit for having been idle."""
    import multiprocessing

    from stalewise import tree
    from stalewise.runtime.local import procs

    clock = _Clock(late=0.001)
    monkeypatch.setattr(calibrate, "time", clock)
    monkeypatch.setattr(procs, "die_with_parent", lambda: None)
    flat, spec = tree.flatten({"w": np.zeros(4, np.float32)})
    mine, theirs = multiprocessing.Pipe()
    for msg in ("go", ("time", 0.0), ("stop",)):
        mine.send(msg)
    calibrate._compute_main(clock.step, [[None]], spec, flat, 0, 1, 1, 0, delay, theirs, True)
    got = [mine.recv() for _ in range(3)]
    nap = delay or calibrate.WAKE_SLEEP
    assert got[0] == ("ready", 0) and got[1][0] == "times"
    assert got[2] == ("mean", pytest.approx(0.002), pytest.approx(0.002), pytest.approx(0.001))
    assert clock.events[-9:] == ["step"] * 3 + ["step", nap] * 3


def test_the_wake_goes_into_the_table_with_the_evaluations_share():
    steps = tuple((0.012,) * 10 for _ in range(2))
    flat = calibrate.Fit.of([(4096, 1e-5), (16384, 1e-5)])
    c = Contention(step=(1.0, 2.0), apply=(1.0, 2.0), wake=(1e-4, 2e-3))
    cal = calibrate.Calibration(2, 1, steps, flat, flat, flat, flat, 4096, contention=c,
                                cpu_times=steps)  # fmt: skip
    t = cal.table()
    assert t["contention_wake"] == [1e-4, 2e-3]
    assert SimConfig.from_dict(tomllib.loads(calibrate.table_toml(t))["sim"]).contention == c
    assert calibrate._factors([1e-4, 5e-5, 2e-3], beside=0.5) == (1e-4, 1.05e-3, 2.95e-3)


def test_steps_that_start_together_share_the_cores_from_the_start():
    """4 workers of 10 ms start at once with 4 runnable (factor 4): none is done before
    40 ms, and all 4 are then (the first to start is not faster for being first); later
    steps are stretched alike."""
    table = Contention(step=(1.0, 2.0, 3.0, 4.0), apply=(1.0,))
    got = _run(SimConfig(compute=Fixed(0.01), contention=table, **FREE), steps=4,
               eval_interval=0.005)  # fmt: skip
    at = {round(r["time"], 3): r["updates"] for r in got.records}
    assert at[0.035] == 0 and got.pushes == 4 and got.time == pytest.approx(0.04)
    again = _run(SimConfig(compute=Fixed(0.01), contention=table, **FREE), steps=400)
    assert again.time == pytest.approx(4.0)  # 100 rounds of 4 steps sharing the cores


def test_a_compute_speeds_up_when_the_others_are_done_and_sleeps_after():
    """Worker 1 is a 3x straggler (its sleep: twice its compute, after it): both compute
    10 ms at factor 2 (20 ms), worker 0 pushes; worker 1 then sleeps 2 x 10 ms x 2 = 40 ms.
    Worker 0's next step runs alone (factor 1) while worker 1 sleeps: 10 ms."""
    timing = WorkerTiming(SimConfig(compute=Fixed(0.01)), 2, factors=[1, 3])
    assert timing.rest(0, 0.01, 1, 2.0, 0.001) == 0.0  # no sleep: not late
    assert timing.rest(1, 0.01, 1, 2.0, 0.001) == pytest.approx(0.041)  # a sleep: late
    table = Contention(step=(1.0, 2.0), apply=(1.0,))
    got = _run(SimConfig(compute=Fixed(0.01), contention=table, **FREE), workers=2, steps=3,
               eval_interval=0.005, stragglers=[1, 3])  # fmt: skip
    at = {round(r["time"], 3): r["updates"] for r in got.records}
    assert at[0.015] == 0 and at[0.025] == 1 and at[0.035] == 2 and got.time == pytest.approx(0.06)
