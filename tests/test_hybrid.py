"""The hybrid consistency model: synchronous rounds while workers keep pace, else asynchronous."""

from __future__ import annotations

import numpy as np
import pytest

import stalewise as sw
from stalewise import config as config_lib
from stalewise import optim, report, segments, sweep, tasks
from stalewise.protocol import PushHeader, Shard
from stalewise.protocol.hybrid import Pace
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import Fixed, Slowdown, Stragglers


def make_shard(workers: int = 3, tolerance: float = 2.0) -> Shard:
    shard = Shard(
        np.zeros(2, np.float32),
        segments.Segments.single(2),
        optim.sgd(1.0),
        workers=workers,
        consistency=sw.Hybrid(tolerance),
    )
    for w in range(workers):
        shard.join(w, incarnation=1)
    return shard


def round_of(shard: Shard, took: list[float], start: float, seqs: list[int]) -> float:
    """Every worker pulls at ``start`` and pushes ones after its ``took`` seconds."""
    for w in range(len(took)):
        assert shard.may_start(w)
        shard.pull(w, now=start)
    for w in sorted(range(len(took)), key=lambda w: took[w]):
        ack = shard.push(
            PushHeader(w, seqs[w], shard.version, 1), np.ones(2, np.float32), now=start + took[w]
        )
        assert ack.ok
        seqs[w] += 1
    return start + max(took)


def test_pace_flags_a_worker_over_tolerance_times_the_median():
    pace = Pace(workers=4)
    for w, took in enumerate([1.0, 1.0, 1.2, 2.5]):
        pace.pulled(w, 10.0)
        pace.pushed(w, 10.0 + took)
    live = [True] * 4
    assert pace.straggling(live, tolerance=2.0)
    assert not pace.straggling(live, tolerance=3.0)
    assert pace.decide(True, live, 2.0) is False  # a straggler: asynchronous next
    # the slowest is 2.27x the median (1.1 s): within tolerance 2.6, so a synchronous
    # shard stays synchronous, but an asynchronous one stays asynchronous until it is
    # below 2.6 / 1.25 = 2.08x (hysteresis)
    assert pace.decide(True, live, 2.6) is True
    assert pace.decide(False, live, 2.6) is False
    pace.forget(3)
    assert pace.decide(False, live, 2.0) is True


def test_a_synchronous_round_gates_each_worker_once_and_applies_the_mean():
    shard = make_shard()
    shard.pull(0, now=0.0)
    shard.push(PushHeader(0, 0, 0, 1), np.ones(2, np.float32), now=1.0)
    assert not shard.may_start(0)  # pushed in this round: waits for the others
    assert shard.may_start(1) and shard.version == 0
    for w in (1, 2):
        shard.pull(w, now=0.0)
        shard.push(PushHeader(w, 0, 0, 1), np.full(2, 4.0, np.float32), now=1.1)
    assert shard.version == 1 and shard.synchronous
    np.testing.assert_allclose(shard.params, -3.0)  # sgd(1.0) of the mean (1 + 4 + 4) / 3
    assert all(shard.may_start(w) for w in range(3))


def test_a_straggler_switches_to_asynchronous_updates_and_back():
    shard = make_shard()
    seqs = [0, 0, 0]
    t = round_of(shard, [1.0, 1.0, 1.1], 0.0, seqs)
    assert shard.synchronous and shard.stats.mode_switches == 0
    t = round_of(shard, [1.0, 1.0, 5.0], t, seqs)  # worker 2 is 5x slower
    assert not shard.synchronous and shard.stats.mode_switches == 1
    version = shard.version
    shard.pull(0, now=t)
    shard.push(PushHeader(0, seqs[0], shard.version, 1), np.ones(2, np.float32), now=t + 1)
    seqs[0] += 1
    assert shard.version == version + 1  # applied on arrival
    assert shard.may_start(0)  # no gate while asynchronous
    for _ in range(4):  # the straggler recovers: paces converge, rounds come back
        t = round_of(shard, [1.0, 1.0, 1.0], t + 1, seqs)
    assert shard.synchronous and shard.stats.mode_switches == 2


def test_the_mode_and_paces_survive_a_state_dict_round_trip():
    shard = make_shard()
    seqs = [0, 0, 0]
    t = round_of(shard, [1.0, 1.0, 5.0], 0.0, seqs)
    assert not shard.synchronous
    state = shard.state_dict()
    other = make_shard()
    other.load_state_dict(state)
    assert not other.synchronous
    np.testing.assert_array_equal(other._pace.pace, shard._pace.pace)
    assert other.stats.mode_switches == 1
    bsp = Shard(
        np.zeros(2, np.float32),
        segments.Segments.single(2),
        optim.sgd(1.0),
        workers=3,
        consistency=sw.BSP(),
    )
    with pytest.raises(ValueError, match="synchronous"):
        bsp.load_state_dict(state)  # an asynchronous round does not fit BSP
    del t


def test_a_resumed_shard_measures_no_pace_against_the_stopped_process_clock():
    shard = make_shard()
    shard.pull(0, now=1000.0)  # a pull the stopped process's clock timed
    other = make_shard()
    other.load_state_dict(shard.state_dict())
    other.resume()  # a new process: its clock starts near 0
    other.push(PushHeader(0, 0, 0, 1), np.ones(2, np.float32), now=2.0)
    assert np.isnan(other._pace.pace[0])  # not measured (was 0.0: 2.0 - 1000.0, clipped)
    shard.push(PushHeader(0, 0, 0, 1), np.ones(2, np.float32), now=1001.5)
    assert shard._pace.pace[0] == 1.5  # the live shard still measures it


def train(consistency, sim: SimConfig, steps: int = 600, lr: float = 0.1, **kw):
    task = tasks.get("digits", hidden=32)
    job = sw.Job(
        task.init_params(0),
        optimizer=sw.optim.sgd(lr, momentum=0.9),
        consistency=consistency,
        staleness=sw.staleness.inverse(),
    )
    return job.train(
        task.loss_and_grad,
        data=task.batches,
        evaluate=task.evaluate,
        workers=4,
        steps=steps,
        runtime=sw.Simulation(sim),
        metrics=sw.Metrics(every=0.02),
        **kw,
    )


def test_balanced_workers_train_exactly_as_bsp_in_the_simulator():
    sim = SimConfig(compute=Fixed(0.008))
    hybrid, bsp = train(sw.Hybrid(), sim), train(sw.BSP(), sim)
    assert hybrid.stats["mode_switches"] == 0
    h, b = sw.tree.flatten(hybrid.params)[0], sw.tree.flatten(bsp.params)[0]
    np.testing.assert_array_equal(h, b)


def test_a_straggler_makes_the_simulated_run_as_fast_as_asp():
    sim = SimConfig(compute=Fixed(0.008), stragglers=Stragglers(1, 4.0))
    times = {}
    for c in (sw.Hybrid(), sw.BSP(), sw.ASP()):  # each at its best of two learning rates
        # a run stops at the target: the simulator's records up to it are the same
        runs = [train(c, sim, steps=1200, lr=lr, stop_at={"accuracy": 0.95}) for lr in (0.1, 0.3)]
        reached = [report.time_to_target(r.records, "accuracy", 0.95) for r in runs]
        assert None not in reached, (c, reached)
        times[str(c)] = min(reached)
    # the first round is synchronous: it measures the paces
    assert times["Hybrid(2)"] <= 0.5 * times["BSP"], times
    assert times["Hybrid(2)"] <= 1.25 * times["ASP"], times


def test_a_transient_straggler_goes_asynchronous_then_back():
    sim = SimConfig(compute=Fixed(0.008), slowdowns=(Slowdown(3, 5.0, 0.5, 1.0),))
    result = train(sw.Hybrid(), sim, steps=1000)
    assert result.stats["mode_switches"] >= 2


def parse_server(**server):
    return config_lib.parse(
        {"task": {"name": "digits"}, "optimizer": {"name": "sgd", "lr": 0.1}, "server": server}
    )


def test_config_and_cli_spell_hybrid():
    cfg = parse_server(consistency="hybrid", tolerance=3.0)
    assert str(cfg.job.config.consistency) == "Hybrid(3)"
    with pytest.raises(config_lib.ConfigError, match=r"server\.tolerance"):
        parse_server(tolerance=3.0)
    with pytest.raises(config_lib.ConfigError, match=r"server\.tolerance"):
        parse_server(consistency="hybrid", tolerance=1.0)
    assert str(sweep.parse_consistency("hybrid:3")) == "Hybrid(3)"
    with pytest.raises(ValueError, match="tolerance"):
        sw.Hybrid(0.5)
