"""The simulator's failure policy and divergence: the local runtime's rules on a virtual clock.

A scripted ``Failure`` or an error in the user's code is handled by
``on_worker_failure`` (restart after ``SimConfig.restart_delay``, drop, fail),
up to ``max_restarts``; a failure that a scripted ``Join`` answers keeps the
worker away until that join. ``diverge_after`` stops workers whose pushes keep
being refused. Fixed step times and a free network make every instant exact.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
import tomllib

import numpy as np
import pytest

import stalewise as sw
from stalewise import config as config_lib
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.engine import Simulation
from stalewise.runtime.sim.models import (
    Failure,
    Fixed,
    Join,
    Network,
    Service,
    ShiftedExponential,
    WorkerTiming,
)

FREE = {
    "network": Network(latency=0.0, bandwidth=math.inf),
    "service": Service(time=0.0, rate=math.inf),
}
TARGET = np.arange(4, dtype=np.float32)
SCRIPTED = "scripted failure (SimConfig.failures)"


def tagged(worker, workers):
    """Batches ``(worker, i)``: who drew which batch of its stream."""
    return ((worker, i) for i in itertools.count())


class Quadratic:
    """0.5 * ||x - TARGET||^2, recording the batches it is called with; ``boom(w, i)``
    says whether the step of worker ``w`` on its batch ``i`` raises."""

    def __init__(self, boom=lambda w, i: False):
        self.seen, self.boom = [], boom

    def __call__(self, params, batch):
        self.seen.append(batch)
        if self.boom(*batch):
            raise ValueError(f"boom at batch {batch[1]}")
        diff = params["x"] - TARGET
        return float(0.5 * (diff**2).sum()), {"x": diff}

    def batches(self, worker):
        return [i for w, i in self.seen if w == worker]


def nan_grads(params, batch):
    return math.nan, {"x": np.full(4, np.nan, np.float32)}


def job(**kw):
    return sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1), **kw)


def train(loss, *, sim=None, steps=40, workers=2, shards=1, **policy):
    """A simulated run; ``policy``: the fields of sw.Failures."""
    sim = sim if sim is not None else SimConfig(compute=Fixed(1.0), **FREE)
    return job(shards=shards).train(
        loss,
        data=tagged,
        workers=workers,
        steps=steps,
        runtime=sw.Simulation(sim),
        failures=sw.Failures(**policy),
    )


def scripted(*events, **kw):
    return SimConfig(
        compute=Fixed(1.0),
        failures=[e for e in events if isinstance(e, Failure)],
        joins=[e for e in events if isinstance(e, Join)],
        **FREE,
        **kw,
    )


# -- scripted failures under the policy --------------------------------------------------


def test_a_scripted_failure_is_restarted_after_restart_delay_by_default():
    loss = Quadratic()
    r = train(loss, sim=scripted(Failure(1, 5.5), restart_delay=2.0))
    # worker 1 pushed at t=1..5 and was computing on its batch 5 when it failed
    assert r.failures == [
        {"worker": 1, "time": 5.5, "cause": SCRIPTED, "action": "restarted", "recovered": 7.5}
    ]
    assert r.restarts == 1
    assert r.pushes == 40 and r.stats["applied"] == 40
    assert r.stop_reason == "the budget of 40 pushes is spent" and r.ended == "budget"
    # the new incarnation continues its id's stream after the batch it died on
    assert loss.batches(1)[:9] == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    # worker 0 started steps at t=0..20, worker 1 at 0..4 and 7.5..20.5: the 40th at 20.5
    assert r.time == 21.5
    np.testing.assert_allclose(r.params["x"], TARGET, atol=0.05)


def test_restarts_beyond_max_restarts_fail_the_job_naming_the_worker_and_cause():
    failures = [Failure(1, t) for t in (2.5, 5.5, 8.5, 11.5)]  # each after the last restart
    with pytest.raises(
        sw.WorkerError,
        match=r"^worker 1 failed 4 times, more than max_restarts=3 allows; the last time: "
        r"scripted failure \(SimConfig.failures\)$",
    ):
        train(Quadratic(), sim=scripted(*failures), steps=1000)
    r = train(Quadratic(), sim=scripted(*failures), steps=1000, max_restarts=None)
    assert r.restarts == 4 and r.pushes == 1000


def test_drop_lets_the_others_spend_the_budget():
    loss = Quadratic()
    r = train(loss, sim=scripted(Failure(1, 5.5)), policy="drop")
    assert [(e["worker"], e["action"]) for e in r.failures] == [(1, "dropped")]
    assert r.restarts == 0 and r.pushes == 40
    assert loss.batches(1) == [0, 1, 2, 3, 4, 5]  # never back
    assert r.time == 35.0  # worker 0 made the other 35 pushes, one a second


def test_fail_stops_the_job_at_once():
    with pytest.raises(sw.WorkerError, match=r"^worker 1 failed: scripted failure"):
        train(Quadratic(), sim=scripted(Failure(1, 5.5)), policy="fail")


@pytest.mark.parametrize("policy", ["restart", "drop", "fail"])
def test_a_failure_answered_by_a_scripted_join_keeps_the_worker_away_until_it(policy):
    loss = Quadratic()
    cfg = scripted(Failure(1, 5.5), Join(1, 20.0))
    r = train(loss, sim=cfg, steps=60, policy=policy, max_restarts=0)
    assert r.failures == [
        {
            "worker": 1,
            "time": 5.5,
            "cause": SCRIPTED,
            "action": "left",
            "rejoin": 20.0,
            "recovered": 20.0,
        }
    ]
    assert r.restarts == 0 and r.pushes == 60
    # away from 5.5 to 20; after its join it goes on with its stream of batches
    assert loss.batches(1)[:8] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert loss.seen.index((1, 6)) > loss.seen.index((0, 19))  # nothing from it before t=20


# -- errors in the user's code ----------------------------------------------------------


def test_an_error_in_user_code_is_restarted_like_a_failed_process():
    once = {"armed": True}

    def boom(w, i):
        if w == 1 and i == 7 and once["armed"]:
            once["armed"] = False
            return True
        return False

    loss = Quadratic(boom)
    r = train(loss)
    (event,) = r.failures
    assert event == {
        "worker": 1,
        "time": 7.0,
        "cause": "raised ValueError: boom at batch 7",
        "action": "restarted",
        "recovered": 8.0,  # the default restart_delay: 1 virtual second
    }
    assert r.pushes == 40 and r.stats["applied"] == 40 and r.restarts == 1
    assert loss.batches(1)[:10] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]  # its stream goes on


def test_a_persistent_error_fails_the_job_after_max_restarts_with_its_traceback():
    loss = Quadratic(lambda w, i: w == 1 and i >= 3)
    with pytest.raises(
        sw.WorkerError,
        match=r"(?s)^worker 1 failed 3 times, more than max_restarts=2 allows; the last time: "
        r"raised ValueError: boom at batch 5\nTraceback.*ValueError: boom at batch 5",
    ):
        train(loss, steps=1000, max_restarts=2)
    assert loss.batches(1) == [0, 1, 2, 3, 4, 5]  # three incarnations, each after the last


def test_a_batch_that_always_raises_costs_one_restart_not_the_job():
    loss = Quadratic(lambda w, i: w == 1 and i == 3)
    r = train(loss, max_restarts=1)
    assert [(e["worker"], e["action"]) for e in r.failures] == [(1, "restarted")]
    assert r.pushes == 40 and r.stats["applied"] == 40
    assert loss.batches(1)[:6] == [0, 1, 2, 3, 4, 5]  # batch 3 is not drawn again


def test_a_persistent_error_under_drop_leaves_the_budget_to_the_others():
    loss = Quadratic(lambda w, i: w == 1 and i == 3)
    r = train(loss, policy="drop")
    assert [(e["worker"], e["action"], e["cause"]) for e in r.failures] == [
        (1, "dropped", "raised ValueError: boom at batch 3")
    ]
    assert r.pushes == 40 and loss.batches(1) == [0, 1, 2, 3]


@pytest.mark.parametrize("policy", ["restart", "drop"])
def test_an_error_in_the_first_step_fails_the_job_whatever_the_policy(policy):
    # the local runtime's warm-up step finds such a bug before its clock starts
    loss = Quadratic(lambda w, i: w == 1)
    with pytest.raises(
        sw.WorkerError,
        match=r"(?s)^worker 1 failed: ValueError: boom at batch 0\nTraceback.*boom at batch 0",
    ):
        train(loss, policy=policy, max_restarts=None)


# -- determinism and checkpoints ---------------------------------------------------------


def _faulty_run(seed):
    once = {"armed": True}

    def boom(w, i):
        if w == 2 and i == 30 and once["armed"]:
            once["armed"] = False
            return True
        return False

    cfg = SimConfig(
        compute=ShiftedExponential(shift=0.2, rate=5.0),
        network=Network(latency=0.01, bandwidth=1e7),
        model_bytes=1_000_000,
        failures=[Failure(0, 3.1), Failure(1, 4.7), Failure(0, 9.3)],
        joins=[Join(1, 6.0)],
        restart_delay=0.7,
    )
    return job(shards=2).train(
        Quadratic(boom), data=tagged, workers=3, steps=300, runtime=sw.Simulation(cfg, seed=seed)
    )


def test_runs_with_failures_and_restarts_are_deterministic():
    a, b, other = _faulty_run(3), _faulty_run(3), _faulty_run(4)
    assert [e["action"] for e in a.failures] == ["restarted", "left", "restarted", "restarted"]
    assert a.flat.tobytes() == b.flat.tobytes()
    assert a.failures == b.failures and a.time == b.time and a.records == b.records
    # the seed does matter (its compute times); the final params may not: both reach the optimum
    assert a.time != other.time and a.records != other.records
    shards = a.stats["sim"]["shards"]
    assert shards[0] == shards[1] and shards[0]["applied"] == a.pushes == 300


def test_a_checkpoint_while_a_worker_waits_for_its_restart_restarts_it_on_resume():
    cfg = scripted(Failure(1, 5.5), restart_delay=3.0)
    j = job()
    taken = []

    def checkpointer(s):
        if s.restarting(1) and not taken:
            taken.append(([sh.state_dict() for sh in s.shards], s.checkpoint_state()))

    state = Simulation(
        j.config, (Quadratic(), tagged, j.strategy), 2, 40, cfg, WorkerTiming(cfg, 2)
    )
    state.checkpointer = checkpointer
    state.run(lambda: False, 1e9, math.inf)
    [(shards, saved)] = taken
    assert saved["phase"] == ["live", "live"] and not saved["quiescent"]
    again = Simulation(
        j.config, (Quadratic(), tagged, j.strategy), 2, 40, cfg, WorkerTiming(cfg, 2)
    )
    starts = again.restore(shards, saved)
    assert starts == [(saved["now"], 0), (saved["now"], 1)]
    assert saved["consumed"][1] == 6  # batches 0-5: its restart continues after them


# -- divergence ------------------------------------------------------------------------------


def test_every_push_refused_with_diverge_after_3_stops_with_diverged_error_at_once(caplog):
    t0 = time.perf_counter()
    with (
        caplog.at_level(logging.WARNING),
        pytest.raises(
            sw.DivergedError,
            match=r"^training diverged: worker\(s\) 0, 1 stopped because their pushes kept being "
            r"refused \(worker \d diverged: its last 3 pushes were refused.*\); no worker is left, "
            r"after 8 of 1000000 pushes",
        ),
    ):
        train(nan_grads, shards=2, steps=1_000_000, diverge_after=3)
    # a hang guard; "after 8 of" says it stopped at once: a gradient push is pipelined
    # (stalewise.protocol.pipeline), so a worker learns its 3rd refusal after its 4th push
    assert time.perf_counter() - t0 < 60.0
    assert sum("diverged and stopped" in m for m in caplog.messages) == 2  # once per worker


def test_diverge_after_none_runs_to_the_budget_and_says_every_push_was_refused(caplog):
    with caplog.at_level(logging.WARNING):
        r = train(nan_grads, steps=50, diverge_after=None)
    assert r.pushes == 50
    assert r.stats["applied"] == 0 and r.stats["rejected"] == {"not_finite": 50}
    assert r.stop_reason == (
        "the budget of 50 pushes is spent; no push was applied, every one was refused "
        "({'not_finite': 50})"
    )
    assert any("no push was applied" in m for m in caplog.messages)
    assert not r.failures
    assert np.array_equal(r.flat, np.zeros(4, np.float32))


def test_a_diverged_worker_is_not_restarted_and_the_others_finish():
    def half_nan(params, batch):
        w, _ = batch
        value = np.nan if w == 0 else 0.1
        return 1.0, {"x": np.full(4, value, np.float32)}

    r = train(half_nan, steps=40, diverge_after=4)
    assert [(e["worker"], e["action"]) for e in r.failures] == [(0, "diverged")]
    assert "its last 4 pushes" in r.failures[0]["cause"]
    assert r.restarts == 0 and r.pushes == 40
    # its 4th refusal is learned once its 5th push is committed (pipelined): 5 refused
    assert r.stats["rejected"] == {"not_finite": 5} and r.stats["applied"] == 35


# -- options ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_bad_diverge_after_is_refused_naming_it(bad):
    with pytest.raises(
        ValueError, match=r"Failures.diverge_after must be an integer >= 1 or None, got "
    ):
        train(Quadratic(), diverge_after=bad)


def test_restart_delay_is_checked_and_read_from_the_sim_table():
    assert SimConfig().restart_delay == 1.0
    assert SimConfig.from_dict({"restart_delay": 2.5}).restart_delay == 2.5
    for bad in (-1.0, math.inf, "1"):
        with pytest.raises(ValueError, match=r"SimConfig.restart_delay = .*: must be a finite"):
            SimConfig(restart_delay=bad)
    with pytest.raises(ValueError, match=r"^sim: SimConfig.restart_delay = -2"):
        SimConfig.from_dict({"restart_delay": -2})
    head = '[task]\nname = "least-squares"\n[optimizer]\nname = "sgd"\nlr = 0.1\n[sim]\n'
    cfg = config_lib.parse(tomllib.loads(head + "restart_delay = 0.25"), runtime="sim")
    assert cfg.sim.restart_delay == 0.25
    with pytest.raises(
        config_lib.ConfigError, match=r"^sim\.restart_delay: must be a finite number >= 0, got -1"
    ):
        config_lib.parse(tomllib.loads(head + "restart_delay = -1"), runtime="sim")
