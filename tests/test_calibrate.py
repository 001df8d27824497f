"""stalewise.calibrate: the measured [sim] table, read by the simulator's own readers."""

import logging
import math
import os
import re
import statistics
import subprocess
import sys
import time
import tomllib
from dataclasses import replace

import numpy as np
import pytest

import stalewise as sw
from stalewise import calibrate, config, tasks
from stalewise.cli import main
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import (
    MAX_SECONDS,
    MIN_BYTES_PER_S,
    Contention,
    Fixed,
    ShiftedExponential,
)

CONFIG = """
[task]
name = "digits"
args = { hidden = 16 }

[optimizer]
name = "adam"
lr = 0.01

[run]
workers = 2
steps = 100
delay = 0.002
"""


def check_sane(sim: SimConfig, cal: calibrate.Calibration) -> None:
    """Each number of the table is the one the measured points give (to the table's 4
    significant digits), whatever this machine's speed: no bounds on host timings."""

    def close(a: float, b: float) -> bool:
        return a == b or math.isclose(a, b, rel_tol=1e-3)

    def rate(slope: float) -> float:  # bytes per second of a fitted slope, floored
        return math.inf if slope <= 0 else max(1 / slope, MIN_BYTES_PER_S)

    c, loop, inner = sim.compute, cal.loop or 0.0, cal.inner or 0.0
    # the compute model is the timed steps' (their mean and fastest): their CPU times with
    # the contention model (which stretches them), else their wall-clock times, plus a
    # strategy's inner update; the loop apart
    times = cal.step_times if cal.contention is None else cal.cpu_times
    assert cal.compute_times == times and len(times) == cal.workers
    assert cal.mean == np.mean([x for t in times for x in t]) and cal.mean > 0
    assert sim.contention == cal.contention
    if isinstance(c, Fixed):
        assert close(c.time, cal.mean + inner)
    else:
        assert isinstance(c, ShiftedExponential)
        assert close(c.shift, cal.shift + inner)
        assert close(1 / c.rate, cal.mean - cal.shift)
    net, service, copied = sim.network, sim.service, sim.copies
    if cal.copy is None or cal.copy.slope <= 0:  # the bytes go through links and the shard
        assert copied is None
        assert close(net.latency, min(cal.message.intercept / 2, MAX_SECONDS))
        assert close(net.bandwidth, rate(cal.message.slope))
        assert close(service.rate, rate(cal.apply.slope))
        assert close(service.time, min(cal.apply.intercept, MAX_SECONDS))
    else:  # the bytes are copies on the cores; the pull's and send's fixed CPU time too
        pull, send = cal.cpu["pull"], cal.cpu["send"]
        fixed = pull.intercept + send.intercept
        assert close(net.latency, max(0.0, cal.message.intercept - fixed) / 2)
        assert net.bandwidth == service.rate == math.inf
        assert close(copied.rate, rate(cal.copy.slope))
        # the stages were timed alone: their copies share the bus measured with every core
        copies_at_once, cores = cal.bus
        assert 1 <= copies_at_once <= cores == copied.cores == (os.cpu_count() or 1)
        assert close(copied.bus, copied.rate * copies_at_once)
        apply = cal.shard_apply or cal.apply  # a local shard process's, its publish in it
        for got, fit in ((copied.pull, pull), (copied.push, send), (copied.apply, apply)):
            assert close(got, fit.slope / cal.copy.slope)
        assert close(copied.pull_time, pull.intercept) and close(copied.push_time, send.intercept)
        assert close(service.time, min(apply.intercept, MAX_SECONDS))
    assert close(sim.loop, loop)
    assert sim.stragglers is None and not sim.failures and sim.model_bytes is None


def test_calibrate_measures_and_its_table_reads_back(tmp_path):
    task = tasks.get("digits", hidden=16)
    job = sw.Job(task.init_params(0), optimizer=sw.optim.sgd(0.1, momentum=0.9), shards=2)
    calls = []

    def evaluate(params):  # runs in this process, beside the timed steps
        calls.append(time.monotonic())
        return task.evaluate(params)

    cal = job.calibrate(
        task.loss_and_grad, task.batches, workers=2, repeats=4, sizes=(512, 4096), delays=0.002,
        evaluate=evaluate, eval_interval=0.001,
    )  # fmt: skip
    assert len(calls) >= 2 and cal.evaluated == 0.001  # a warm-up call, then while timing
    assert "evaluated every 0.001 s beside" in cal.summary()
    assert not cal.served and "pull (snapshot read)" in cal.summary()  # ASP: pipelined
    assert cal.send is not None and all(s > 0 for _, s in cal.send.points)
    # a real one-worker local run of 2 ms steps: the loop's own time, a fraction of a ms here
    assert cal.loop is not None and 0 <= cal.loop < 10 * calibrate.LOOP_COMPUTE
    assert "worker loop: " in cal.summary()
    # its pulls read the snapshots (ASP): how often one held the push just sent, in the table
    assert cal.own_read is not None and 0 <= cal.own_read <= 1
    assert cal.table()["own_read"] == round(cal.own_read, 3) and "own push read: " in cal.summary()
    # every timed figure's spread over its repeats, in the summary (the table's comments)
    assert {n.split()[0] for n, _ in cal.spreads} == {"apply", "pull", "send", "push", "message",
                                                      "worker", "copy", "shard"}  # fmt: skip
    # the shard processes' CPU time per push, at a slice's bytes (2 shards)
    assert [b for b, _ in cal.cpu["shard"].points] == [256 * 4, 2048 * 4]
    assert all(s > 0 for _, s in cal.cpu["shard"].points)
    assert cal.copy is not None  # a copy, by size
    assert all(s.min <= s.low <= s.median <= s.high <= s.max for _, s in cal.spreads)
    assert "spread over the repeats" in cal.summary() and cal.load_end is not None
    assert cal.workers == 2 and len(cal.step_times) == 2
    # contention: 1 .. workers + shards + 1 runnable processes, each factor (wall-clock time
    # over CPU time) >= the one before
    con = cal.contention
    assert con is not None and len(con.step) == len(con.apply) == 2 + 2 + 1
    assert list(con.step) == sorted(con.step) and list(con.apply) == sorted(con.apply)
    if (os.cpu_count() or 1) <= 2:  # 5 busy processes on 2 cores: a step waits for a core
        assert con.step[-1] > 1.2 and con.apply[-1] > 1.2
    assert "contention: with 1, 2, ... 5" in cal.summary() and "CPU mean" in cal.summary()
    assert all(len(t) == 4 and min(t) > 0 for t in cal.step_times + cal.cpu_times)
    # one math thread each: a step's CPU time is within its wall time (with its 2 ms delay)
    for walls, cpus in zip(cal.step_times, cal.cpu_times, strict=True):
        ok = cal.threads > 1 or all(c <= w + 0.002 + 1e-4 for w, c in zip(walls, cpus, strict=True))
        assert ok, (walls, cpus)
    assert [b for b, _ in cal.apply.points] == [512 * 4, 4096 * 4]
    assert all(s > 0 for fit in (cal.apply, cal.pull, cal.push) for _, s in fit.points)
    text = cal.toml()
    assert text.startswith("# measured by stalewise calibrate")
    assert tomllib.loads(text)["sim"] == cal.table()
    # the config reader takes it as a config's [sim] table
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG + "\n" + text)
    sim = config.load(cfg, runtime="sim").sim
    assert sim == cal.sim_config() == SimConfig.from_dict(cal.table())
    check_sane(sim, cal)
    # and the simulator runs with it
    r = job.train(
        task.loss_and_grad,
        data=task.batches,
        workers=2,
        steps=20,
        runtime=sw.Simulation(sim),
        emulation=sw.Emulation(delays={0: 0.002, 1: 0.002}),
    )
    assert r.pushes == 20 and r.time > 20 / 2 * 0.002


def _waits(params, batch):
    """A step that waits 20 ms (as a step waits for a core) and computes next to nothing."""
    time.sleep(0.02)
    return 0.0, {"w": np.zeros_like(params["w"])}


def test_a_steps_wait_is_wall_time_not_cpu_time():
    """The compute processes time each step on both clocks: a step that sleeps 20 ms, and
    then its emulated 10 ms delay, is 20 ms or more beyond its delay on the wall clock and
    nearly nothing on the CPU clock (the wait for a core after a sleep is not compute)."""
    job = sw.Job({"w": np.zeros(64, np.float32)}, optimizer=sw.optim.sgd(0.1))
    walls, cpus, threads, con = calibrate.measure_compute(
        job.config, _waits, [[None], [None]], workers=2, repeats=4, delays=[0.01, 0.01]
    )
    assert con is None and threads >= 1 and len(walls) == len(cpus) == 2
    assert all(len(w) == len(c) == 4 for w, c in zip(walls, cpus, strict=True))
    assert min(min(w) for w in walls) >= 0.02
    assert max(max(c) for c in cpus) < 0.01


def test_the_table_takes_cpu_times_with_the_contention_model_and_wall_times_without():
    flat = calibrate.Fit.of([(4096, 1e-4), (16384, 1e-4)])
    walls = ((0.010, 0.012, 0.011), (0.010, 0.013, 0.011))
    cpus = ((0.004, 0.005, 0.0045), (0.004, 0.0052, 0.0044))
    con = Contention(step=(1.1, 2.0, 3.0), apply=(1.0, 1.5, 2.0))
    cal = calibrate.Calibration(2, 1, walls, flat, flat, flat, flat, 4096, contention=con,
                                cpu_times=cpus)  # fmt: skip
    t = cal.table()
    assert t["shift"] == 0.004 and t["rate"] == pytest.approx(1 / (np.mean(cpus) - 0.004), 1e-3)
    assert t["contention_step"] == [1.1, 2.0, 3.0]
    # the wall clock's spread at the CPU clock's level: worker 0's 0.010-0.012 times 0.0135/0.033
    spread = replace(cal, wall_spread=True)
    assert spread.compute_times[0] == pytest.approx((0.0040909, 0.0049091, 0.0045), rel=1e-4)
    plain = replace(cal, contention=None).table()  # calibrate(contention=False)'s table
    assert plain["shift"] == 0.010 and "contention_step" not in plain
    assert plain["rate"] == pytest.approx(1 / (np.mean(walls) - 0.010), 1e-3)
    # the low and high tables scale both clocks' times
    assert cal.bounded("high").cpu_times[0][0] > 0.004
    assert cal.bounded("low").step_times[0][2] < 0.011
    # the factors start from the first, not from 1 (under 1: a step on more threads than one)
    assert calibrate._factors([0.5, 0.9]) == (0.5, 0.9)
    # the parent's evaluation took half a core: at n, the factor for n + 0.5 runnable
    assert calibrate._factors([1.0, 2.0, 3.0], beside=0.5) == (1.5, 2.5, 3.5)


def test_the_evaluation_beside_the_steps_is_measured_as_a_share_of_a_core():
    """_observe evaluates until the compute processes answer and returns the CPU time the
    evaluations took over the wall time: an evaluation that waits takes next to none."""
    import multiprocessing as mp
    import threading

    def share(evaluate):
        mine, theirs = mp.Pipe()
        timer = threading.Timer(0.3, theirs.send, args=(("times", []),))
        timer.start()
        try:
            return calibrate._observe([mine], evaluate, None, 0.02, time.monotonic() + 30)
        finally:
            timer.cancel()
            mine.close()
            theirs.close()

    waits = share(lambda params: time.sleep(0.01))
    burns = share(lambda params: sum(range(200_000)))
    assert 0 <= waits < 0.05 and burns > 2 * waits


def test_the_cli_prints_or_writes_the_table(tmp_path, capsys, monkeypatch):
    flat = calibrate.Fit.of([(4096, 1e-4), (16384, 1e-4)])
    steps = ((0.001, 0.0012, 0.0011), (0.001, 0.0011, 0.0013))
    fake = calibrate.Calibration(2, 1, steps, flat, flat, flat, flat, 4096)
    seen = {}

    def measured(self, loss_and_grad, data, *, workers, **options):
        seen.update(workers=workers, **options)
        return fake

    monkeypatch.setattr(sw.Job, "calibrate", measured)
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG)
    assert main(["calibrate", str(cfg), "--repeats", "3"]) == 0
    evaluate = seen.pop("evaluate")  # the task's, timed beside the compute
    assert callable(evaluate)
    # run.workers, run.delay and run.eval_interval (its default, 0.5 s)
    assert seen == {"workers": 2, "repeats": 3, "delays": 0.002, "eval_interval": 0.5,
                    "runtime": "local"}  # fmt: skip
    assert capsys.readouterr().out == fake.toml()
    out = tmp_path / "tables" / "sim.toml"
    assert main(["calibrate", str(cfg), "--out", str(out), "--workers", "3"]) == 0
    assert seen["workers"] == 3
    assert main(["calibrate", str(cfg), "--out", str(out), "--runtime", "ray"]) == 0
    assert seen["runtime"] == "ray"
    printed = capsys.readouterr().out
    assert "worker 1:" in printed and f"written to {out}" in printed
    assert out.read_text() == fake.toml()
    cfg.write_text(CONFIG + "\n" + out.read_text())
    assert config.load(cfg, runtime="sim").sim == fake.sim_config()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--repeats", "2"], "--repeats: expected an integer in 3..10000, got 2"),
        (["--repeats", "10001"], "--repeats: expected an integer in 3..10000, got 10001"),
        (["--workers", "0"], "--workers: expected an integer >= 1, got 0"),
        (["--workers", "5000"], "--workers: at most 4096"),
    ],
)
def test_cli_bad_flags_are_one_line(tmp_path, capsys, argv, message):
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG)
    assert main(["calibrate", str(cfg), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_cli_absurd_repeats_are_one_line_before_anything_is_measured(tmp_path):
    """``stalewise calibrate --repeats 1000000000000``, the real command: refused at once
    (it was accepted and ran until killed), one line naming the flag and the range."""
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG)
    proc = subprocess.run(
        [sys.executable, "-m", "stalewise", "calibrate", str(cfg), "--repeats", "1000000000000"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(
        "stalewise: --repeats: expected an integer in 3..10000, got 1000000000000"
    )
    assert proc.stdout == ""


def test_cli_missing_config_and_folder_out(tmp_path, capsys):
    assert main(["calibrate", str(tmp_path / "nope.toml")]) == 2
    assert "no such config file" in capsys.readouterr().err
    cfg = tmp_path / "job.toml"
    cfg.write_text(CONFIG)
    assert main(["calibrate", str(cfg), "--out", str(tmp_path)]) == 2
    assert "is a folder, expected a file name" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"workers": 0}, "workers = 0: must be an integer >= 1"),
        ({"workers": 1, "repeats": 1}, "repeats = 1: must be an integer in 3..10000"),
        ({"workers": 1, "repeats": 10**12}, "repeats = 1000000000000: must be an integer in 3.."),
        ({"workers": 1, "timeout": math.inf}, "timeout = inf: must be a number of seconds in (0,"),
        ({"workers": 1, "timeout": 0}, "timeout = 0: must be a number of seconds in (0, 86400]"),
        ({"workers": 1, "delays": 1e9}, "delays[0] = 1000000000.0: must be a number of seconds in"),
        ({"workers": 1, "sizes": (8, 8)}, "sizes = (8, 8): must be two or more different"),
        ({"workers": 1, "delays": {3: 0.1}}, "delays[3]: not a worker of this run (0..0)"),
        (
            {"workers": 1, "delays": -1.0},
            "delays[0] = -1.0: must be a number of seconds in [0, 3600]",
        ),
        ({"workers": 1, "evaluate": print, "eval_interval": 0}, "eval_interval = 0: must be"),
        ({"workers": 1, "evaluate": 3, "eval_interval": 1}, "evaluate = 3: must be a callable"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, message):
    task = tasks.get("least-squares", n=16, d=2)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1))
    with pytest.raises(ValueError, match=re.escape(message)):
        job.calibrate(task.loss_and_grad, task.batches, **kwargs)


def test_fit_and_table_rules():
    fit = calibrate.Fit.of([(1000, 2e-4), (4000, 5e-4)])
    assert fit.intercept == pytest.approx(1e-4) and fit.slope == pytest.approx(1e-7)
    assert calibrate.Fit.of([(1000, 3e-4), (4000, 1e-4)]).slope == 0.0  # noise: no slope
    flat = calibrate.Fit.of([(1000, 1e-4), (4000, 1e-4)])
    steps = ((0.010, 0.0101, 0.0100), (0.0101, 0.0100, 0.0100))  # tail < 1% of the shift
    cal = calibrate.Calibration(2, 1, steps, flat, flat, flat, flat, 4000)
    t = cal.table()
    assert t["compute"] == "fixed" and "speeds" not in t and t["bandwidth"] == math.inf
    assert t["latency"] == pytest.approx(5e-5)
    slow = ((0.01, 0.012, 0.011), (0.03, 0.031, 0.032))  # worker 1 is 3x slower
    t = calibrate.Calibration(2, 1, slow, flat, flat, flat, flat, 4000).table()
    assert t["compute"] == "exponential" and t["speeds"][0] > 1 > t["speeds"][1]
    # worker 0's median 6% under the median of all, inside worker 1's interquartile
    # range: noise (the other processes of a busy machine), no speeds
    noisy = ((0.008, 0.011, 0.012, 0.020), (0.008, 0.0125, 0.013, 0.021))
    assert "speeds" not in calibrate.Calibration(2, 1, noisy, flat, flat, flat, flat, 4000).table()
    # a worker 1.5x faster than the others, apart from their steps: still the scheduler's
    # noise for identical workers on shared cores (measured: up to 1.5x), no speeds
    third = ((0.0066, 0.0067, 0.0068), (0.0100, 0.0101, 0.0102), (0.0100, 0.0102, 0.0101))
    assert "speeds" not in calibrate.Calibration(3, 1, third, flat, flat, flat, flat, 4000).table()
    SimConfig.from_dict(tomllib.loads(calibrate.table_toml(t))["sim"]).check_workers(2)
    assert np.isfinite(t["shift"]) and t["rate"] > 0
    # the worker loop's own time is its own key (once a push, at no straggler's pace):
    # the compute model stays the steps'
    looped = calibrate.Calibration(2, 1, slow, flat, flat, flat, flat, 4000, loop=0.0005).table()
    assert looped["loop"] == 0.0005 and "loop" not in t
    assert looped["shift"] == t["shift"] and looped["rate"] == t["rate"]
    assert SimConfig.from_dict(looped).loop == 0.0005
    # a strategy's inner update is every local step's: it moves the shift
    inner = calibrate.Calibration(2, 1, slow, flat, flat, flat, flat, 4000, inner=0.001).table()
    assert inner["shift"] == pytest.approx(t["shift"] + 0.001) and inner["rate"] == t["rate"]


def test_module_examples():
    import doctest

    assert doctest.testmod(calibrate).failed == 0


def test_with_table_keeps_the_runs_scripts_and_takes_the_timing():
    from stalewise.runtime.sim.models import Failure, Stragglers

    flat = calibrate.Fit.of([(4096, 1e-4), (16384, 2e-4)])
    steps = ((0.002, 0.003, 0.0025), (0.002, 0.0031, 0.0024))
    cal = calibrate.Calibration(2, 1, steps, flat, flat, flat, flat, 4096)
    own = SimConfig(stragglers=Stragglers(1, 3.0), failures=[Failure(1, 2.0)], model_bytes=10**6)
    both = calibrate.with_table(own, cal)
    assert (both.stragglers, both.failures, both.model_bytes) == (
        own.stragglers, own.failures, own.model_bytes,
    )  # fmt: skip
    mine = cal.sim_config()
    assert (both.compute, both.network, both.service) == (mine.compute, mine.network, mine.service)
    assert both.network.latency == pytest.approx(flat.intercept / 2, rel=1e-3)
    assert calibrate.with_table(None, cal) == mine


@pytest.mark.parametrize(
    "consistency, staleness, served",
    [(sw.ASP(), None, False), (sw.SSP(1), None, False), (sw.SSP(0), None, True),
     (sw.BSP(), None, True), (sw.Hybrid(), None, True),
     (sw.ASP(), sw.staleness.constant(dc_lambda=0.1), True)],
)  # fmt: skip
def test_the_timed_pull_is_served_where_the_pipelining_rule_says(consistency, staleness, served):
    """A lone worker with its push in flight is one clock ahead: it reads the snapshots
    unless the gate holds it (bound 0, hybrid) or DC-ASGD has the shard keep its pull."""
    job = sw.Job({"w": np.zeros(8, np.float32)}, optimizer=sw.optim.sgd(0.1),
                 consistency=consistency, staleness=staleness)  # fmt: skip
    assert calibrate.served_pull(job.config) is served


def _spread_calibration(load=(0.1, 0.1, 0.1), wide=False) -> calibrate.Calibration:
    """A calibration made by hand, with a spread for each figure (no machine timings)."""
    scale = 3.0 if wide else 0.05  # the step times' spread, relative to their 4 ms
    even = np.linspace(0, 1, 21)  # interquartile range scale / 2, median 1 + scale / 2
    steps = tuple(tuple((0.004 * (1 + scale * even)).tolist()) for _ in range(2))
    sizes = (4096, 16384)
    apply = calibrate.Fit.of([(b, 1e-4) for b in sizes])
    msg = calibrate.Fit.of([(b, 6e-5) for b in sizes])
    spreads = []
    for b in sizes:
        spreads.append((calibrate._key("apply", b), calibrate.Spread.of([8e-5, 1e-4, 1.3e-4])))
        spreads.append((calibrate._key("message", b), calibrate.Spread.of([4e-5, 6e-5, 9e-5])))
    spreads.append(("worker loop", calibrate.Spread.of([1e-4, 2e-4, 4e-4])))
    return calibrate.Calibration(
        2, 1, steps, apply, msg, msg, msg, 4096, loop=2e-4, spreads=tuple(spreads),
        load=load, load_end=load,
    )  # fmt: skip


def test_busy_warnings_on_a_stated_condition():
    """Warned: the 1-minute load average (start or end) above the cores, or a worker's step
    times' interquartile range above SPREAD_LIMIT of their median; the figures are made
    here, not measured, so the machine's own load plays no part."""
    tight = [[0.010, 0.0102, 0.0101, 0.0103, 0.0099]]
    assert calibrate.busy_warnings(tight, load=(1.9, 0, 0), load_end=(1.5, 0, 0), cores=2) == []
    (w,) = calibrate.busy_warnings(tight, load=(0.5, 0, 0), load_end=(2.5, 0, 0), cores=2)
    assert "load average was 2.50 on 2 cores" in w
    wide = [[0.010, 0.0102, 0.0101], [0.005, 0.010, 0.020, 0.030]]  # worker 1: IQR > median
    (w,) = calibrate.busy_warnings(wide, load=(0.5, 0, 0), cores=2)
    assert w.startswith("worker 1's step times spread") and "above 50%" in w
    # just above and just below the limit
    assert calibrate.busy_warnings([[0.9, 1.0, 1.0, 1.1]], (0, 0, 0), cores=2, limit=0.1) == []
    assert calibrate.busy_warnings([[0.8, 1.0, 1.0, 1.2]], (0, 0, 0), cores=2, limit=0.1)
    # a calibration says it in its summary (which the CLI prints) and its warnings()
    busy = _spread_calibration(load=(9.0, 9.0, 9.0), wide=True)
    assert len(busy.warnings(cores=2)) == 3  # the load, and both workers' spread
    assert "WARNING: worker 0's step times spread" in busy.summary()
    quiet = _spread_calibration()
    assert quiet.warnings(cores=2) == [] and "WARNING" not in quiet.summary()
    assert "spread over the repeats" in quiet.summary() and "worker loop: " in quiet.summary()


def test_a_strategys_inner_updates_are_compute_and_the_loop_run_is_the_job_itself():
    """A DiLoCo worker's local step is a gradient and an inner optimizer update: the
    update is timed in the calibrating process and goes with the compute (a local
    straggler's emulation scales it, and H of them make a push), and the loop run, of the
    job itself (its strategy, its fragments), takes out as many computes and updates as
    the strategy's pushes take local steps."""
    from stalewise.strategies import streaming_diloco

    params = {k: np.zeros(75_000, np.float32) for k in "abcd"}
    plain = sw.Job(params, optimizer=sw.optim.sgd(0.1))
    local = sw.Job(params, consistency=sw.BSP(), strategy=sw.strategies.diloco(local_steps=4))
    stream = sw.Job(params, consistency=sw.BSP(), codec=sw.codecs.int4(),
                    strategy=streaming_diloco(local_steps=8, fragments=4, delay=1))  # fmt: skip
    (h0, grads), (h1, adamw), (h2, _) = (
        calibrate.strategy_steps(j) for j in (plain, local, stream)
    )
    assert (h0, h1, h2) == (1, 4, 2)
    # an AdamW update of 300k floats: about 1 ms here; a gradient push's step: nothing
    assert adamw > 1e-4 and adamw > 10 * grads
    looped = calibrate.loop_times(local, 300_000)
    assert looped.steps == 4 and looped.inner > 0
    # the 4 computes a push (8 ms) are out of the loop's time: what stays is the send, the
    # pull and the loop's own, 0.3-3 ms here (the updates, 2-4 ms, are out too, but they
    # are within that spread: no bound on them holds on a shared machine)
    assert looped.per_push < 4 * calibrate.LOOP_COMPUTE
    # a fragment a push, cut at the job's leaves (one synthetic leaf could not be cut)
    assert calibrate.loop_times(stream, 300_000).steps == 2


def test_calibrate_logs_its_busy_warnings(monkeypatch, caplog):
    """calibrate() logs each warning of busy_warnings (the measurement faked: a wide spread)."""
    task = tasks.get("least-squares", n=64, d=4)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1))
    wide = ((0.001, 0.002, 0.004, 0.008), (0.001, 0.002, 0.004, 0.008))
    monkeypatch.setattr(calibrate, "measure_compute", lambda *a, **k: (wide, wide, 1, None))
    monkeypatch.setattr(calibrate, "apply_times", lambda c, n, r: [1e-5] * r)
    monkeypatch.setattr(
        calibrate, "transport_times", lambda j, n, r, runtime, shard, cpu: ([2e-5] * r,) * 3
    )
    monkeypatch.setattr(
        calibrate,
        "loop_times",
        lambda j, n, runtime: calibrate.LoopTimes(3e-3, [3e-3] * 4, None, 1, 0),
    )
    with caplog.at_level(logging.WARNING, logger="stalewise.calibrate"):
        cal = job.calibrate(task.loss_and_grad, task.batches, workers=2, repeats=3)
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("too busy for a stable figure: worker" in m for m in msgs) == 2
    assert cal.spread("worker loop") is not None and cal.load_end is not None


def test_the_interval_brackets_the_point_prediction():
    cal = _spread_calibration(wide=True)
    low, point, high = (cal.sim_config(b) for b in ("low", None, "high"))
    assert low.compute.mean < point.compute.mean < high.compute.mean
    assert low.service.time < point.service.time < high.service.time
    assert low.network.latency < point.network.latency < high.network.latency
    with pytest.raises(ValueError, match="bound = 'middle'"):
        cal.sim_config("middle")
    task = tasks.get("least-squares", n=64, d=4)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.05), consistency=sw.SSP(2))

    def predict(sim):
        r = job.train(
            task.loss_and_grad,
            data=task.batches,
            workers=2,
            steps=60,
            runtime=sw.Simulation(sim),
            evaluate=None,
        )
        return {"updates/s": r.stats["version"] / r.time, "staleness": r.stats["staleness_mean"]}

    got = cal.interval(predict)
    for name, iv in got.items():
        assert iv.low <= iv.point <= iv.high, name
    ups = got["updates/s"]
    assert ups.low < ups.point < ups.high  # the slow table is slower, the fast one faster
    assert str(ups).count("[") == 1
    # a number-valued prediction, and with_table's bound
    iv = cal.interval(lambda sim: sim.compute.mean)
    assert iv == calibrate.Interval(point.compute.mean, low.compute.mean, high.compute.mean)
    assert calibrate.with_table(None, cal, "high") == high


def test_a_processs_time_on_the_cores_is_its_cpu_time_not_its_wall_time():
    """_on_cpu reads a process's seconds on a CPU (all its threads): a child that spins for
    0.3 CPU seconds and then sleeps has run 0.3-0.6 s, however long it waited for a core."""
    spin = ("import time\nc = time.process_time()\nwhile time.process_time() - c < 0.3: pass\n"
            "print(flush=True)\ntime.sleep(60)")  # fmt: skip
    p = subprocess.Popen([sys.executable, "-S", "-c", spin], stdout=subprocess.PIPE)
    try:
        p.stdout.readline()
        assert 0.3 <= calibrate._on_cpu([p.pid]) < 0.6
        assert calibrate._on_cpu([2**22 + 12345]) is None  # no such process: not measured
    finally:
        p.kill()
        p.wait(10)
        p.stdout.close()


def test_a_local_shards_cpu_per_push_holds_its_apply():
    """The shard process's CPU time per push (what the table's apply copies come from) holds
    at least the apply timed in this process on the same bytes, and more: pipes, a publish."""
    n = 1 << 20
    job = sw.Job({"w": np.zeros(n, np.float32)}, optimizer=sw.optim.sgd(0.01))
    cpu = []
    calibrate.transport_times(job, n, 7, cpu=cpu)
    applies = calibrate.apply_times(job.config, n, 7)
    shard = [c[2] for c in cpu]
    assert len(shard) == 7 and None not in shard
    # the applies are wall times, which a loaded machine stretches: the fastest is the apply
    assert np.median(shard) > 0.8 * min(applies), (shard, applies)


@pytest.mark.parametrize("seconds", [0.0175, 0.0191, 0.0031])
def test_a_push_s_time_is_measured_over_the_whole_run_not_record_by_record(seconds):
    """Records every 50 ms of a run whose pushes take ``seconds`` (DiLoCo's of 8 local steps
    about 19 ms: 2 or 3 pushes a record): the time a push is found within 2% over the whole
    run, within 10% over windows of 10 pushes. The median of single record intervals was
    16.7 ms for 17.5 and 19.1."""
    records = [{"time": 0.05 * i, "pushes": int(0.05 * i / seconds)} for i in range(1, 60)]
    whole, windows = calibrate.push_times(records)
    assert whole == pytest.approx(seconds, rel=0.02)
    assert len(windows) >= 3
    assert statistics.median(windows) == pytest.approx(seconds, rel=0.1)
