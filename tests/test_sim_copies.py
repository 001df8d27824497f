"""The simulator charges a pull's, a push's and an apply's copies of the parameters' bytes
to the process that copies, on the cores and the memory bus (SimConfig.copies), and the
table stalewise calibrate makes of a copy's measured cost."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

import stalewise as sw
from stalewise import calibrate, tasks
from stalewise.protocol import pipeline
from stalewise.runtime import sim as sim_rt
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import Contention, Copies, Fixed, Network, Service

FREE = {
    "network": Network(latency=0.0, bandwidth=math.inf),
    "service": Service(time=0.0, rate=math.inf),
}
ONE_CORE = Contention(step=(1.0, 2.0, 3.0), apply=(1.0, 2.0, 3.0))


def _run(workers: int, model_bytes: int, copies=None, contention=None, shards=1, codec=None,
         d=4, links=FREE):  # fmt: skip
    """An ASP job of 1 ms steps whose bytes are ``model_bytes``, simulated (``links``: the
    network and the shards' service)."""
    task = tasks.get("least-squares", n=64, d=d, exact=True)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.05), consistency=sw.ASP(),
                 shards=shards, codec=codec)  # fmt: skip
    sim = SimConfig(compute=Fixed(0.001), model_bytes=model_bytes, copies=copies,
                    contention=contention, **links)  # fmt: skip
    return sim_rt.train(job.config, task.loss_and_grad, data=task.batches, workers=workers,
                        steps=200, strategy=job.strategy, sim=sim, evaluate=None)  # fmt: skip


def _rate(*args, **kwargs) -> float:
    """Updates a virtual second of :func:`_run`'s job."""
    r = _run(*args, **kwargs)
    return r.pushes / r.time


def test_more_bytes_a_push_is_slower_through_the_cores_and_copies_on_one_core_serialize():
    """Links free (as calibrated on one machine): without copies the bytes cost nothing;
    with them 4x the bytes is about 4x slower, and two workers' copies on one core take
    turns (no faster than one worker), while on two cores they overlap."""
    assert _rate(2, 10**6) == _rate(2, 4 * 10**6)  # links and shards free: bytes are free
    c = Copies(rate=1e9)
    small, big = _rate(1, 10**6, c, ONE_CORE), _rate(1, 4 * 10**6, c, ONE_CORE)
    assert 3.0 < small / big <= 4.0
    two = _rate(2, 10**6, c, ONE_CORE)
    assert two == pytest.approx(small, rel=0.05)  # one core: serialized
    assert _rate(2, 10**6, c) > 1.6 * _rate(1, 10**6, c)  # cores unshared: overlapped
    assert _rate(2, 10**6, c, ONE_CORE) == two  # deterministic
    # a pull's and a push's CPU time besides their copies take the core likewise
    cpu = Copies(rate=math.inf, pull_time=0.001, push_time=0.002)
    assert _rate(2, 10**6, cpu, ONE_CORE) == pytest.approx(_rate(1, 10**6, cpu, ONE_CORE), rel=0.05)


def test_the_bus_caps_copies_at_once_on_as_many_cores():
    """Two workers on two cores copying at once share a bus of one copy's rate; copies
    beyond the cores wait for a core (the contention model's), not for the bus too."""
    free, capped = Copies(rate=1e9), Copies(rate=1e9, bus=1e9)
    assert _rate(2, 4 * 10**6, capped) < 0.8 * _rate(2, 4 * 10**6, free)
    assert Copies(rate=1e9, bus=1.5e9).seconds(1.0, 1.5e6, copying=3) == pytest.approx(3e-3)
    assert Copies(rate=1e9, bus=1.5e9, cores=2).seconds(1.0, 1.5e6, copying=3) == 2e-3
    cores = Contention(step=(1.0, 1.0, 1.5, 2.0), apply=(1.0, 1.0, 1.5, 2.0))  # two cores
    two = Copies(rate=1e9, bus=1e9, cores=2)
    assert _rate(3, 4 * 10**6, two, cores) > 1.15 * _rate(3, 4 * 10**6, capped, cores)
    with pytest.raises(ValueError, match=r"Copies.cores = 0.5: must be a number >= 1"):
        Copies(rate=1e9, cores=0.5)


def test_copy_keys_in_a_table_name_what_is_wrong():
    got = SimConfig.from_dict({"copy_rate": 2e9, "copy_bus": 3e9, "copy_apply": 2.5,
                               "copy_cores": 2})  # fmt: skip
    assert got.copies == Copies(rate=2e9, bus=3e9, pull=1.0, push=1.0, apply=2.5, cores=2)
    assert SimConfig.from_dict({}).copies is None
    with pytest.raises(ValueError, match="sim: copy_pull needs copy_rate too"):
        SimConfig.from_dict({"copy_pull": 1.0})
    with pytest.raises(ValueError, match=r"Copies.push = -1: must be a finite number >= 0"):
        SimConfig.from_dict({"copy_rate": 1e9, "copy_push": -1})
    with pytest.raises(ValueError, match=r"SimConfig.copies = 3: must be None or a Copies"):
        SimConfig(copies=3)


def test_a_workers_copies_to_several_shards_are_one_process_running():
    """A worker copies its slices one after another: one runnable process, however many
    shards. Copies dominate (4 ms of bytes, 1 ms steps, the apply free): 1, 2 and 3 shards
    give the same rate (counted once a slice, they gave 111, 77 and 59 updates/s)."""
    copies = Copies(rate=1e9, apply=0.0)
    for workers in (1, 2):
        rates = [_rate(workers, 4 * 10**6, copies, ONE_CORE, shards=s) for s in (1, 2, 3)]
        assert rates == pytest.approx([rates[0]] * 3, rel=1e-6), (workers, rates)


@pytest.mark.parametrize("codec", ["topk", "int8"])
def test_a_push_copies_its_parameters_bytes_whatever_the_codec_sends(codec):
    """calibrate counts a push's copies in the parameters' bytes (it encodes all of them), so
    a codec that sends fewer bytes is charged the same copies (charged on the bytes sent,
    top-k's rate came out 4.2x the raw one's, int8's 3.5x)."""
    copies = Copies(rate=1e9, pull=0.0, push=5.0, apply=0.0)
    c = sw.codecs.topk(0.1) if codec == "topk" else sw.codecs.int8()
    raw = _rate(1, 4 * 10**6, copies, d=1000)
    assert _rate(1, 4 * 10**6, copies, codec=c, d=1000) == pytest.approx(raw, rel=1e-6)


def test_a_measured_copy_puts_the_bytes_on_the_cores_not_on_links():
    """A copy of 1 us per kB: a pull of 2 us per kB is 2 copies, the send 1, the apply 1.5;
    the links and the shard's rate are then free (their bytes are the copies), and so is the
    bus: each stage was timed beside the others' copies, its share of the bus is in it."""
    steps = tuple((0.004,) * 10 for _ in range(2))
    per = 1e-9
    pull, send = calibrate.Fit(5e-5, 2 * per), calibrate.Fit(2e-5, per)
    apply = calibrate.Fit(1e-5, 1.5 * per)
    cal = calibrate.Calibration(2, 1, steps, apply, pull, send, calibrate.Fit(7e-5, 3 * per),
                                4096, send=send, copy=calibrate.Fit(1e-6, per))  # fmt: skip
    t = cal.table()
    assert t["copy_rate"] == 1e9 and "copy_bus" not in t and cal.sim_config().copies.bus == math.inf
    assert (t["copy_pull"], t["copy_push"], t["copy_apply"]) == (2.0, 1.0, 1.5)
    assert t["bandwidth"] == t["service_rate"] == math.inf and t["latency"] == 3.5e-5
    assert tomllib.loads(calibrate.table_toml(t))["sim"] == t
    assert cal.sim_config().copies == Copies(1e9, math.inf, 2.0, 1.0, 1.5)
    assert calibrate.with_table(SimConfig(), cal).copies == cal.sim_config().copies
    assert "a pull costs 2.0 copies of its bytes" in cal.summary()
    # the worker's CPU times, when measured, say the copies: not its waits
    cpu = {"pull": calibrate.Fit(1e-5, per), "send": calibrate.Fit(1e-5, 0.5 * per)}
    t = dataclasses.replace(cal, cpu=cpu).table()
    assert (t["copy_pull"], t["copy_push"], t["copy_apply"]) == (1.0, 0.5, 1.5)
    assert t["copy_pull_time"] == t["copy_push_time"] == 1e-5  # on the cores: out of latency
    assert t["latency"] == 2.5e-5
    # a local shard process's CPU time per push is the apply's copies (and its fixed part the
    # service time) where a copy of the larger size takes SHARD_COPY or more; below, the
    # apply timed in-process
    cpu["shard"] = calibrate.Fit(3e-5, 2.5 * per)
    for took, copies, fixed in ((calibrate.SHARD_COPY, 2.5, 3e-5),
                                (0.9 * calibrate.SHARD_COPY, 1.5, 1e-5)):  # fmt: skip
        copy = calibrate.Fit(1e-6, per, ((4096, took / 4), (16384, took)))
        cal = dataclasses.replace(cal, cpu=cpu, copy=copy)
        assert cal.table()["copy_apply"] == copies and cal.table()["service_time"] == fixed
        assert ("with its publish" in cal.summary()) == (copies == 2.5)


def test_stages_timed_alone_share_the_measured_bus():
    """A calibration that measured the bus (1.5 copies at once on 2 cores) charges it: two
    copies at once each run at 0.75 of a copy alone; a lone copy at a core's rate."""
    per, steps = 1e-9, tuple((0.004,) * 10 for _ in range(2))
    fit = calibrate.Fit(1e-5, per)
    cal = calibrate.Calibration(2, 1, steps, fit, fit, fit, fit, 4096, send=fit, copy=fit,
                                bus=(1.5, 2))  # fmt: skip
    t = cal.table()
    assert (t["copy_rate"], t["copy_bus"], t["copy_cores"]) == (1e9, 1.5e9, 2)
    assert tomllib.loads(calibrate.table_toml(t))["sim"] == t
    c = cal.sim_config().copies
    assert c.seconds(1.0, 1.5e6, copying=1) == pytest.approx(1.5e-3)
    assert c.seconds(1.0, 1.5e6, copying=2) == pytest.approx(2e-3)
    assert "a bus of 1.5e+09 B/s" in cal.summary()
    # two workers' copies on two cores: slower with the bus shared than on free cores
    unshared = dataclasses.replace(c, bus=math.inf)
    assert _rate(2, 4 * 10**6, c) < 0.95 * _rate(2, 4 * 10**6, unshared)


def test_the_bus_is_measured_in_copies_at_once_within_the_cores():
    assert calibrate.bus_copies(1 << 20, 1) == 1.0  # one core: no copy beside another
    assert 1.0 <= calibrate.bus_copies(1 << 20, 2, rounds=1) <= 2.0


@pytest.mark.parametrize("crowded", [False, True], ids=["alone", "crowded"])
def test_settle_waits_until_a_process_stops_running(crowded):
    """A child that spins 0.05 CPU seconds then sleeps: settled, its CPU time holds still.
    Crowded, it shares one core with 3 busy processes: it waits for the core (runnable)
    longer than the settle's quiet time, and that is not a stop."""
    spin = ("import time\nc = time.process_time()\nprint(flush=True)\n"
            "while time.process_time() - c < 0.05: pass\ntime.sleep(60)")  # fmt: skip
    busy = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass"
    procs = [subprocess.Popen([sys.executable, "-S", "-c", busy]) for _ in range(3 * crowded)]
    p = subprocess.Popen([sys.executable, "-S", "-c", spin], stdout=subprocess.PIPE)
    try:
        for q in (*procs, p):
            os.sched_setaffinity(q.pid, {min(os.sched_getaffinity(0))})
        p.stdout.readline()
        calibrate._settle([p.pid])
        ran = calibrate._on_cpu([p.pid])
        assert ran >= 0.05
        time.sleep(2 * calibrate.SETTLE)
        assert calibrate._on_cpu([p.pid]) == ran
    finally:
        for q in (*procs, p):
            q.kill()
            q.wait(10)
        p.stdout.close()


def test_copy_times_time_one_copy():
    times = calibrate.copy_times(1 << 20, 5)
    assert len(times) == 5 and min(times) > 0


def test_with_a_bus_on_the_cores_contention_charges_a_copy_only_its_wait_for_a_core():
    """What copies on the cores cost each other is the bus's (measured with every core
    copying): a factor of 1.5 with 2 runnable on 2 cores is not charged again to a copy, only
    the wait beyond them (3 runnable: 2.25 / 1.5). Without the bus the factor is charged."""
    step = (1.0, 1.0, 1.0)
    smt, clean = Contention(step, (1.0, 1.5, 2.25)), Contention(step, (1.0, 1.0, 1.5))
    bus = Copies(rate=1e9, bus=1.5e9, cores=2)
    assert _rate(3, 4 * 10**6, bus, smt) == _rate(3, 4 * 10**6, bus, clean)
    free = Copies(rate=1e9)
    assert _rate(3, 4 * 10**6, free, smt) < 0.95 * _rate(3, 4 * 10**6, free, clean)


def test_the_recorded_quiet_scale_run_is_predicted_within_15_percent_with_the_bus_shared():
    """benchmarks/results/scale-sim-alone.json (10M and 100M floats, stages timed alone, the
    bus measured) re-simulated: within 15% of the own loop; without its bus, more than 15%
    over at both sizes (the stages' copies, timed alone, would overlap for free)."""
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "benchmarks"))  # scale.py imports its siblings
    scale = pytest.importorskip("scale")
    recorded = str(root / "benchmarks" / "results" / "scale-sim-alone.json")
    now = scale.resimulate(recorded)
    assert [r["params"] for r in now] == [10_000_000, 100_000_000]
    assert all(abs(r["sim/real"] - 1) <= 0.15 for r in now), now
    assert all(r["sim/real"] > 1.15 for r in scale.resimulate(recorded, ("copy_bus",)))


def test_with_a_bus_a_stage_s_fixed_cpu_still_pays_the_whole_contention_factor():
    """Only copies share the bus: a pull's and a push's CPU besides them (1 ms each, the bytes
    next to nothing) is stretched by the whole factor, so the two contentions differ."""
    step = (1.0, 1.0, 1.0)
    smt, clean = Contention(step, (1.0, 1.5, 2.25)), Contention(step, (1.0, 1.0, 1.5))
    bus = Copies(rate=1e9, bus=1.5e9, cores=2, pull_time=1e-3, push_time=1e-3)
    assert _rate(3, 4000, bus, smt) < 0.95 * _rate(3, 4000, bus, clean)


def _staleness(workers: int, shards: int, copies=None, service=0.0, latency=0.0) -> float:
    """Mean staleness of :func:`_run`'s job of 1 MB (links of ``latency`` s and free
    bandwidth, ``service`` s an apply)."""
    links = {"network": Network(latency=latency, bandwidth=math.inf),
             "service": Service(time=service, rate=math.inf)}  # fmt: skip
    return _run(workers, 10**6, copies, shards=shards, links=links).stats["staleness_mean"]


def test_a_pushs_slices_leave_once_the_worker_has_copied_them_all():
    """As the local client notifies its shards once the whole update is in, the shards a push
    is split across do not change when each gets it: 2 workers are as stale on 3 shards as on 2
    (a slice sent as soon as it was copied reached the first shards early: 1.49 against 2.48)."""
    c, kw = Copies(rate=1e9), {"service": 1e-4, "latency": 1e-4}  # a 1 MB copy: 1 ms
    assert _staleness(2, 3, c, **kw) == pytest.approx(_staleness(2, 2, c, **kw), rel=0.02)


def test_a_busy_shard_publishes_its_snapshot_at_most_every_publish_every(monkeypatch):
    """The local shard's rule (``pipeline.publish_due``): with requests waiting it copies its
    params out for snapshot reads only every PUBLISH_EVERY s or when its slowest clock moves,
    so the reads are staler than with a publish after every turn (by less than the pushes
    it applies in PUBLISH_EVERY / 2: the slowest clock moves too)."""
    busy = _staleness(8, 1, service=4e-4)  # 8 workers of 1 ms steps: always a push waiting
    monkeypatch.setattr(pipeline, "PUBLISH_EVERY", 0.0)
    every_turn = _staleness(8, 1, service=4e-4)
    assert 1.0 < busy - every_turn < 0.5 * 0.02 / 4e-4
