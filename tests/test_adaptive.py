"""Adaptive local SGD / DiLoCo (``sw.strategies.adaptive``): the schedules, the worker's round, runs.

Also the pacing by the runtime's clock (``stalewise.pacing``, the loop's CLOCK
request) that the default schedule and dynamic local updates use. The
simulated runs use float64 least squares, as in test_averaging.py.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass

import mp_helpers
import numpy as np
import pacing_helpers as ph
import pytest
from numpy.testing import assert_allclose
from test_averaging import same_rule

import stalewise as sw
from stalewise import tasks
from stalewise.pacing import RoundCost
from stalewise.protocol import loop
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import Fixed, Network
from stalewise.strategies import adacomm, adaptive, comm_budget, diloco, fixed, local_sgd
from stalewise.strategies.adaptive import AdaCommState, Adaptive, AdaptiveState, CommBudgetState
from stalewise.strategies.averaging import LocalSGDStrategy

TASK = tasks.get("least-squares", n=512, d=16, batch_size=32, noise=0.1)


def _sim(job: sw.Job, workers: int, steps: int, *, stragglers=None, sim=None, sim_seed=0):
    return job.train(
        TASK.loss_and_grad,
        data=TASK.batches,
        workers=workers,
        steps=steps,
        runtime=sw.Simulation(sim, seed=sim_seed),
        emulation=sw.Emulation(stragglers=stragglers),
    )


# -- schedules ---------------------------------------------------------------------------


def test_adacomm_rule_on_a_hand_computed_loss_sequence():
    sched = adacomm(local_steps=32, min_steps=2)
    state = sched.init()
    assert math.isnan(state.initial) and state.steps == 32
    # F_0 = 4 (the first finite loss); H = ceil(sqrt(F / 4) * 32) within [2, 32]
    want = [
        (math.nan, 32),  # nothing seen yet: the start
        (4.0, 32),  # F_0: sqrt(1) * 32
        (9.0, 32),  # above F_0: 48, capped at the start
        (2.25, 24),  # sqrt(0.5625) = 0.75
        (1.0, 16),  # sqrt(0.25) = 0.5
        (math.inf, 16),  # not finite: keeps the period
        (0.04, 4),  # sqrt(0.01) * 32 = 3.2: ceil, not round
        (0.25, 8),  # the loss went back up: so does H
        (1e-6, 2),  # 0.016: the floor
        (0.0, 2),
        (-1.0, 2),  # below 0 counts as 0
    ]
    seen = []
    for loss, _ in want:
        h, state = sched.next(state, loss)
        assert isinstance(h, int) and state.steps == h
        seen.append((loss, h))
    assert [h for _, h in seen] == [h for _, h in want]
    assert state.initial == 4.0


def test_adacomm_needs_a_positive_first_loss():
    sched = adacomm(local_steps=8)
    for bad in (0.0, -2.0):
        with pytest.raises(ValueError, match="needs losses bounded below by 0"):
            sched.next(sched.init(), bad)


def test_fixed_schedule():
    sched = fixed(7)
    state = sched.init()
    for loss in (10.0, 1.0, math.nan):
        h, state = sched.next(state, loss)
        assert h == 7


def test_round_cost_fits_c_and_s_and_falls_back_when_it_cannot():
    assert RoundCost().fit() is None
    cost = RoundCost()
    for h in (4, 16, 5, 12, 4):
        cost = cost.add(h, 0.3 + 0.02 * h)
    assert_allclose(cost.fit(), (0.3, 0.02), rtol=1e-9)
    same = RoundCost().add(8, 2.0).add(8, 1.0)  # H never varied: all charged to the steps
    assert same.fit() == (0.0, pytest.approx((0.9 * 2.0 + 1.0) / 1.9 / 8))
    flat = RoundCost().add(2, 5.0).add(20, 5.0)  # longer rounds were no slower
    assert flat.fit() == (5.0, 0.0)
    negative = RoundCost().add(2, 0.1).add(20, 2.0)  # c < 0: charged to the steps
    assert negative.fit()[0] == 0.0
    assert RoundCost().add(4, math.nan).add(0, 1.0).rounds == 0  # rounds that say nothing
    follows = RoundCost()
    for k in range(120):  # the step gets 3x slower at round 20: the fit follows
        follows = follows.add(4 + 4 * (k % 2), 0.5 + (0.01 if k < 20 else 0.03) * (4 + 4 * (k % 2)))
    assert_allclose(follows.fit(), (0.5, 0.03), rtol=1e-3)


def _rounds(schedule, c: float, s: float, n: int) -> list[int]:
    """The H of ``n`` rounds of ``c + s * H`` seconds each, as the worker loop runs them."""
    state, periods = schedule.init(), []
    for _ in range(n):
        h, state = schedule.next(state, math.nan)
        periods.append(h)
        state = schedule.observe(state, h, c + s * h)
    return periods


def test_comm_budget_rule_on_hand_computed_rounds():
    # 4 (not timed), probes 4 and 16; then H = ceil(c * 0.9 / (0.1 * s)), halved at rounds
    # 6, 10, ... (doubled when half is below min_steps)
    assert _rounds(comm_budget(), 0.1, 0.25, 8) == [4, 4, 16, 4, 4, 4, 2, 4]  # 3.6 -> 4
    assert _rounds(comm_budget(), 0.02, 0.25, 8) == [4, 4, 16, 1, 1, 1, 2, 1]  # 0.72 -> 1
    assert _rounds(comm_budget(), 0.5, 0.1, 8) == [4, 4, 16, 45, 45, 45, 22, 45]
    # communication-bound: 4x the last H at most, up to max_steps
    assert _rounds(comm_budget(), 400.0, 0.2, 11) == [4, 4, 16, 64, 64, 64, 32, 64, 64, 64, 32]
    assert _rounds(comm_budget(max_steps=100), 1.0, 0.0, 8) == [4, 4, 16, 64, 100, 100, 50, 100]
    # fraction 0.5: communication as long as the steps
    assert _rounds(comm_budget(fraction=0.5, local_steps=2), 0.3, 0.01, 8) == [
        2,
        2,
        8,
        30,
        30,
        30,
        15,
        30,
    ]
    # a start too close to max_steps probes a quarter of it; min_steps is the floor
    low = comm_budget(local_steps=40, max_steps=64, min_steps=3)
    assert _rounds(low, 0.01, 1.0, 8) == [40, 40, 10, 3, 3, 3, 6, 3]
    assert _rounds(comm_budget(local_steps=5, min_steps=5, max_steps=5), 1.0, 0.1, 8) == [5] * 8
    # the first round is not timed: it includes the job's start-up
    sched = comm_budget()
    h, state = sched.next(sched.init(), math.nan)
    assert sched.observe(state, h, 99.0) == state
    # the loss is ignored, and a state pickles and compares by value
    a = sched.next(sched.init(), 1.0)
    assert a == sched.next(sched.init(), math.nan) and pickle.loads(pickle.dumps(a)) == a


def test_comm_budget_checks_its_arguments():
    for kw, problem in (
        ({"fraction": 0.0}, r"fraction must be in \(0, 1\), got 0.0"),
        ({"fraction": 1}, r"fraction must be in \(0, 1\), got 1"),
        ({"fraction": "0.1"}, "fraction must be a number"),
        ({"local_steps": 0}, "local_steps must be an integer >= 1, got 0"),
        ({"max_steps": 2.5}, "max_steps must be an integer >= 1"),
        ({"local_steps": 8, "max_steps": 4}, "need min_steps <= local_steps <= max_steps"),
        (
            {"min_steps": 8},
            "need min_steps <= local_steps <= max_steps, got min_steps=8, local_steps=4",
        ),
        ({"memory": 1.0}, r"memory must be in \[0, 1\)"),
    ):
        with pytest.raises(ValueError, match=problem):
            comm_budget(**kw)
    assert repr(comm_budget(0.2, local_steps=2)) == (
        "comm_budget(fraction=0.2, local_steps=2, min_steps=1, max_steps=64, memory=0.9)"
    )


# -- the worker's round, by hand -------------------------------------------------------


@dataclass(frozen=True)
class Scripted:
    """A custom schedule: the given periods in turn; its state records the losses it saw."""

    periods: tuple[int, ...]

    def init(self) -> tuple[int, tuple[float, ...]]:
        return 0, ()

    def next(self, state, loss):
        k, seen = state
        return self.periods[k % len(self.periods)], (k + 1, (*seen, loss))


def test_a_custom_schedule_plugs_in_and_sees_the_smoothed_loss_after_each_first_step():
    # the loss of each local step comes from a script; the gradient is x, so sgd(0.5)
    # halves the local parameters at every local step
    script = iter([8.0, 4.0, math.nan, 2.0, 0.0, 1.0])

    def lg(p, _):
        return next(script), {"x": p["x"].copy()}

    strat = adaptive(sw.optim.sgd(0.5), schedule=Scripted((3, 1, 2)), smoothing=0.5)
    state = strat.init({"x": np.ones(2)})
    assert isinstance(state, AdaptiveState) and state.schedule == (0, ())
    steps = []
    for pulled in (1.0, 4.0, 8.0):
        step = strat.step(state, {"x": np.full(2, pulled)}, lg, iter(lambda: None, 1))
        h = step.local_steps
        steps.append(h)
        assert state.local_steps == h and state.pushes == len(steps)
        assert_allclose(step.update["x"], pulled - pulled * 0.5**h)  # H local steps from the pull
    assert steps == [3, 1, 2]
    assert next(script, None) is None  # exactly 3 + 1 + 2 local steps
    # F, an EMA over local steps (decay 0.5), at each round's first step:
    # round 0: 8 -> F=8 (asked: 8); 4 -> 6; nan skipped.  round 1: 2 -> F=4 (asked: 4).
    # round 2: 0 -> F=2 (asked: 2); 1 -> 1.5
    assert state.schedule == (3, (8.0, 4.0, 2.0))
    assert state.loss == 1.5
    assert step.loss == 0.5  # the round's mean loss: (0 + 1) / 2


def test_the_schedule_must_return_a_positive_integer():
    strat = adaptive(sw.optim.sgd(0.1), schedule=Scripted((0,)))
    state = strat.init({"x": np.ones(2)})

    def lg(p, _):
        return 1.0, {"x": p["x"]}

    with pytest.raises(ValueError, match=r"schedule Scripted.*H must be an integer >= 1, got 0"):
        strat.step(state, {"x": np.ones(2)}, lg, iter(lambda: None, 1))


def test_h_of_one_is_one_step_and_the_first_push_runs_the_start():
    strat = adaptive(sw.optim.sgd(0.5), schedule=fixed(1))
    state = strat.init({"x": np.ones(1)})
    step = strat.step(state, {"x": np.ones(1)}, lambda p, _: (3.0, {"x": p["x"]}), iter([None]))
    assert (step.local_steps, step.loss, step.update["x"].tolist()) == (1, 3.0, [0.5])
    strat = adaptive(sw.optim.sgd(0.5), schedule=adacomm(6))
    state = strat.init({"x": np.ones(1)})
    step = strat.step(state, {"x": np.ones(1)}, lambda p, _: (3.0, {"x": p["x"]}), iter([None] * 6))
    assert step.local_steps == 6 and state.schedule == AdaCommState(3.0, 6)
    strat = adaptive(sw.optim.sgd(0.5), local_steps=6)  # the default schedule: comm_budget
    state = strat.init({"x": np.ones(1)})
    step = strat.step(state, {"x": np.ones(1)}, lambda p, _: (3.0, {"x": p["x"]}), iter([None] * 6))
    assert step.local_steps == 6 and state.schedule == CommBudgetState(RoundCost(), 6, 1, 6)


# -- simulated runs ----------------------------------------------------------------------

_RECORDED: list[tuple[int, int]] = []  # (id of the worker's state, H) per push, in order


class _Recording(Adaptive):
    """Records the ``H`` of every push (module level: the sim shares this process)."""

    def step(self, state, params, loss_and_grad, batches):
        step = super().step(state, params, loss_and_grad, batches)
        _RECORDED.append((id(state), step.local_steps))
        return step


def test_h_shrinks_as_the_loss_falls_in_a_simulated_run():
    _RECORDED.clear()
    strat = _Recording(adacomm(local_steps=32), local_sgd(1, sw.optim.sgd(0.05)))
    job = sw.Job(TASK.init_params(), strategy=strat)
    start = TASK.evaluate(TASK.init_params())["loss"]
    result = _sim(job, 4, 120, stragglers={3: 2.0})
    assert TASK.evaluate(result.params)["loss"] < 0.05 * start
    per_worker = mp_helpers.per_worker(_RECORDED)  # by worker state
    assert len(per_worker) == 4 and sum(map(len, per_worker.values())) == result.pushes
    for hs in per_worker.values():
        assert hs[0] == 32  # the first period is the start
        assert all(1 <= h <= 32 for h in hs)
        assert hs[-1] <= 8  # the loss fell by far more than 16x
        half = len(hs) // 2
        assert np.mean(hs[half:]) < 0.5 * np.mean(hs[:half])


@pytest.mark.parametrize(
    "outer, consistency",
    [("local_sgd", sw.ASP()), ("diloco", sw.BSP()), ("diloco_async", sw.ASP())],
    ids=["local_sgd-asp", "diloco-bsp", "diloco_async-asp"],
)
def test_fixed_schedule_is_local_sgd_bit_for_bit_in_the_simulator(outer, consistency):
    h = 5
    inner = sw.optim.sgd(0.05) if outer == "local_sgd" else sw.optim.adamw(0.01)
    if outer == "local_sgd":
        ours, theirs = adaptive(inner, schedule=fixed(h)), local_sgd(h, inner)
    elif outer == "diloco":
        ours, theirs = adaptive(inner, schedule=fixed(h), outer="diloco"), diloco(h, inner)
    else:
        ours = adaptive(inner, schedule=fixed(h), outer="diloco", asynchronous=True, every=3)
        theirs = diloco(h, inner, asynchronous=True, every=3)
    runs = []
    for strat in (ours, theirs):
        job = sw.Job(TASK.init_params(), consistency=consistency, strategy=strat)
        runs.append(_sim(job, 3, 45, stragglers={2: 1.7}, sim_seed=3))
    a, b = runs
    assert np.abs(a.flat - TASK.init_params()["x"]).max() > 0.1  # it moved
    assert np.array_equal(a.flat, b.flat)
    assert (a.time, a.pushes, a.stats["version"]) == (b.time, b.pushes, b.stats["version"])
    assert a.stats["staleness_mean"] == b.stats["staleness_mean"]


def _trainer(outer: str, consistency) -> Adaptive:
    if outer == "local_sgd":
        return adaptive(sw.optim.sgd(0.05))
    if consistency.kind == "bsp":
        return adaptive(sw.optim.adamw(0.005), outer="diloco")
    return adaptive(sw.optim.adamw(0.005), outer="diloco", asynchronous=True, every=4)


@pytest.mark.parametrize("consistency", [sw.ASP(), sw.BSP()], ids=str)
@pytest.mark.parametrize("outer", ["local_sgd", "diloco"])
def test_adaptive_trains_least_squares(outer, consistency):
    start = TASK.evaluate(TASK.init_params())["loss"]
    job = sw.Job(TASK.init_params(), consistency=consistency, strategy=_trainer(outer, consistency))
    # 10 ms steps, ~8 ms of communication a round: comm_budget runs periods of about 8
    sim = SimConfig(compute=Fixed(0.01), network=Network(latency=0.002))
    result = _sim(job, 4, 160, stragglers={3: 2.0}, sim=sim)
    assert result.pushes >= 160
    assert TASK.evaluate(result.params)["loss"] < 0.05 * start


def test_adaptive_trains_in_the_local_runtime(no_leaks):
    start = TASK.evaluate(TASK.init_params())["loss"]
    strategy = adaptive(sw.optim.sgd(0.05), local_steps=16, min_steps=2)
    job = sw.Job(
        TASK.init_params(), strategy=strategy, consistency=sw.BSP()
    )  # pickled; BSP: timing-free
    result = job.train(
        TASK.loss_and_grad, data=TASK.batches, workers=2, steps=60, timeouts=sw.Timeouts(total=120)
    )
    assert result.pushes >= 60
    assert TASK.evaluate(result.params)["loss"] < 0.1 * start


# -- configuration ---------------------------------------------------------------------


def test_recommended_server_optimizers():
    params = {"x": np.zeros(4)}
    job = sw.Job(params, strategy=adaptive(sw.optim.sgd(0.1)))
    assert same_rule(job.config.optimizer, sw.optim.sgd(1.0))
    bsp = sw.BSP()  # synchronous DiLoCo's recommendation is for BSP
    job = sw.Job(params, strategy=adaptive(outer="diloco"), consistency=bsp)
    assert same_rule(job.config.optimizer, sw.optim.sgd(0.7, momentum=0.9, nesterov=True))
    strategy = adaptive(outer="diloco", outer_lr=0.5, outer_momentum=0.8)
    job = sw.Job(params, strategy=strategy, consistency=bsp)
    assert same_rule(job.config.optimizer, sw.optim.sgd(0.5, momentum=0.8, nesterov=True))
    job = sw.Job(params, strategy=adaptive(outer="diloco", asynchronous=True, every=3))
    assert same_rule(job.config.optimizer, sw.optim.delayed_nesterov(0.7, 0.9, every=3))
    lazy = adaptive(outer="diloco", asynchronous=True)
    assert lazy.server_optimizer(workers=5).apply.__self__.every == 5
    with pytest.raises(TypeError, match=r"every=<workers>\s+to adaptive\(\).*optimizer="):
        sw.Job(params, strategy=lazy)


def test_diloco_outer_pairings_with_consistency_are_checked_as_for_diloco():
    params = {"x": np.zeros(4)}
    with pytest.raises(ValueError, match=r"^adaptive\(outer='diloco'\) recommends Nesterov SGD"):
        sw.Job(params, strategy=adaptive(outer="diloco"))  # ASP, the default
    with pytest.raises(ValueError, match=r"^adaptive\(outer='diloco'\) with asynchronous=True is"):
        sw.Job(params, strategy=adaptive(outer="diloco", asynchronous=True, every=2),
               consistency=sw.BSP())  # fmt: skip
    assert sw.Job(params, strategy=adaptive(sw.optim.sgd(0.1)))  # local SGD: any consistency


def test_adaptive_pickles_and_compares_by_configuration():
    for strat in (
        adaptive(sw.optim.sgd(0.1), local_steps=64, min_steps=4),
        adaptive(sw.optim.lamb(1e-3), schedule=fixed(3), reset_inner=True, smoothing=0.0),
        adaptive(outer="diloco", asynchronous=True, every=4, schedule=Scripted((4, 2))),
    ):
        assert pickle.loads(pickle.dumps(strat)) == strat
        assert hash(pickle.loads(pickle.dumps(strat))) == hash(strat)
        assert repr(strat).startswith("adaptive(schedule=")
    sgd = sw.optim.sgd(0.1)
    assert adaptive(sgd, local_steps=8) == adaptive(sgd, schedule=comm_budget(local_steps=8))
    assert adaptive(sgd, local_steps=100).schedule == comm_budget(local_steps=100, max_steps=100)
    assert adaptive(sgd, schedule=adacomm(8)) != adaptive(sgd, schedule=comm_budget(local_steps=8))
    assert adaptive(sgd, local_steps=8) != adaptive(sgd, local_steps=9)
    assert adaptive(sgd, local_steps=8) != adaptive(sgd, local_steps=8, smoothing=0.5)
    assert adaptive(sgd, schedule=fixed(2)) != local_sgd(2, sgd)
    assert repr(adaptive(sgd, schedule=fixed(2), smoothing=0.5)) == (
        "adaptive(schedule=fixed(2), inner=_Sgd(lr=0.1, momentum=0.0, nesterov=False, "
        "weight_decay=0.0, exclude_from_weight_decay=()), outer='local_sgd', smoothing=0.5)"
    )


def test_constructors_check_their_arguments():
    sgd = sw.optim.sgd(0.1)
    with pytest.raises(ValueError, match="local_steps must be an integer >= 1"):
        adacomm(local_steps=0)
    with pytest.raises(ValueError, match="min_steps=5 exceeds local_steps=4"):
        adacomm(local_steps=4, min_steps=5)
    with pytest.raises(ValueError, match="fixed: local_steps must be an integer >= 1"):
        fixed(1.5)
    with pytest.raises(TypeError, match=r"schedule must have init\(\)"):
        adaptive(sgd, schedule=lambda loss: 4)
    with pytest.raises(ValueError, match="configure the default comm_budget schedule"):
        adaptive(sgd, schedule=fixed(2), local_steps=4)
    with pytest.raises(TypeError, match="inner= is required with outer='local_sgd'"):
        adaptive()
    with pytest.raises(ValueError, match="outer_lr, asynchronous configure DiLoCo"):
        adaptive(sgd, outer_lr=0.5, asynchronous=True)
    with pytest.raises(ValueError, match="outer must be 'local_sgd' or 'diloco'"):
        adaptive(sgd, outer="easgd")
    with pytest.raises(ValueError, match=r"smoothing must be in \[0, 1\)"):
        adaptive(sgd, smoothing=1.0)
    with pytest.raises(TypeError, match="inner must be a stalewise optimizer"):
        adaptive("adam")
    assert sw.strategies.adaptive is adaptive and sw.strategies.fixed is fixed


# -- pacing by the runtime's clock ------------------------------------------------------


def test_the_loop_asks_the_runtime_clock_only_for_timed_strategies():
    asked = []

    def answerer(clock):
        budget = iter([True, True, True, False])

        def answer(request):
            asked.append(request)
            if request is loop.BEGIN:
                return next(budget)
            if request is loop.PULL:
                return {"x": np.zeros(8)}
            if request is loop.CLOCK:
                return next(clock)
            return []

        return answer

    lg = ph.tagged_loss_and_grad
    data = ph.tagged_data(0, 1)
    timed = adaptive(sw.optim.sgd(0.1), local_steps=2)
    assert timed.timed and not adaptive(sw.optim.sgd(0.1), schedule=adacomm(2)).timed
    assert not sw.strategies.gradients().timed and not local_sgd(2, sw.optim.sgd(0.1)).timed
    assert LocalSGDStrategy(2, sw.optim.sgd(0.1), dynamic=True, period=1.0).timed
    seen = []

    class Spy(Adaptive):
        def started(self, state, now):
            super().started(state, now)
            seen.append((now, state.schedule.cost.rounds))

    spy = Spy(comm_budget(local_steps=2), local_sgd(1, sw.optim.sgd(0.1)))
    loop.run(loop.worker_loop(spy, lg, data), answerer(iter([10.0, 12.5, 20.0])))
    assert asked[:4] == [loop.BEGIN, loop.PULL, loop.CLOCK, asked[3]]  # then the Push
    assert isinstance(asked[3], loop.Push) and asked.count(loop.CLOCK) == 3
    # each round timed from pull to pull; the schedule does not count the first (start-up)
    assert seen == [(10.0, 0), (12.5, 0), (20.0, 1)]
    asked.clear()
    loop.run(loop.worker_loop(adaptive(sw.optim.sgd(0.1), schedule=adacomm(2)), lg, data),
             answerer(iter([])))  # fmt: skip
    assert loop.CLOCK not in asked
    with pytest.raises(
        TypeError, match=r"worker 7: the runtime answered the loop's CLOCK .*'soon'"
    ):
        loop.run(loop.worker_loop(timed, lg, data, worker=7), answerer(iter(["soon"])))


def test_adaptive_observes_its_rounds_by_the_clock_it_is_given():
    strat = adaptive(sw.optim.sgd(0.1), schedule=comm_budget(fraction=0.5, local_steps=2))
    state = strat.init({"x": np.zeros(8)})
    data, periods = ph.tagged_data(0, 1), []
    now = 100.0
    for _ in range(6):  # rounds of 1 s plus 0.1 s a local step, by a made-up clock
        strat.started(state, now)
        h = strat.step(state, {"x": np.zeros(8)}, ph.tagged_loss_and_grad, data).local_steps
        periods.append(h)
        now += 1.0 + 0.1 * h
    assert periods == [2, 2, 8, 10, 10, 10]  # 2 (not timed), probes 2 and 8, then c / s = 10
    assert_allclose(state.schedule.cost.fit(), (1.0, 0.1), rtol=1e-9)
    # called directly, with no clock: the schedule never learns a cost and keeps the start
    plain = strat.init({"x": np.zeros(8)})
    taken = [strat.step(plain, {"x": np.zeros(8)}, ph.tagged_loss_and_grad, data).local_steps
             for _ in range(3)]  # fmt: skip
    assert taken == [2, 2, 2]


def _paced_sim(strategy, consistency):
    ph.RECORDED.clear()
    job = sw.Job({"x": np.zeros(8)}, strategy=strategy, consistency=consistency)
    sim = SimConfig(compute=Fixed(0.01), network=Network(latency=0.025))
    result = job.train(
        ph.tagged_loss_and_grad,
        data=ph.tagged_data,
        workers=4,
        steps=60,
        runtime=sw.Simulation(sim),
        emulation=sw.Emulation(stragglers={3: 4.0}),
    )
    return result, mp_helpers.per_worker(ph.RECORDED)


@pytest.mark.parametrize("kind", ["comm_budget", "dynamic"])
def test_a_simulated_straggler_paces_itself_by_virtual_time_deterministically(kind):
    # 10 ms a step (40 ms for worker 3), about 0.1 s of latency per round
    if kind == "comm_budget":  # fraction 0.5: H = c / s

        def make():
            return ph.RecordingAdaptive(comm_budget(fraction=0.5), local_sgd(1, sw.optim.sgd(0.1)))
    else:  # rounds of 0.3 s: H = (0.3 - c) / s

        def make():
            return ph.RecordingLocalSGD(1000, sw.optim.sgd(0.1), dynamic=True, period=0.3)

    a, hs = _paced_sim(make(), sw.ASP())
    b, again = _paced_sim(make(), sw.ASP())
    assert hs == again and np.array_equal(a.flat, b.flat) and a.time == b.time  # deterministic
    assert sorted(hs) == [0, 1, 2, 3]
    settled = {w: float(np.median(h[4:])) for w, h in hs.items()}  # after the probes
    fast = [settled[w] for w in (0, 1, 2)]
    assert min(fast) == max(fast) >= 8, settled  # the three alike, long periods
    assert 0.15 <= settled[3] / fast[0] <= 0.45, settled  # the straggler: about a quarter
    if kind == "dynamic":  # about one push per 0.3 s each, the straggler included
        assert abs(len(hs[3]) - len(hs[0])) <= 0.25 * len(hs[0]), {w: len(h) for w, h in hs.items()}


def test_the_local_runtime_clock_paces_dynamic_local_updates(no_leaks, tmp_path):
    # wall time: 20 ms a step emulated for both workers, worker 1 4x slower at everything
    path = tmp_path / "rounds.txt"
    strategy = ph.RecordingLocalSGD(
        1000, sw.optim.sgd(0.1), dynamic=True, period=0.6, path=str(path)
    )
    job = sw.Job({"x": np.zeros(8)}, strategy=strategy, consistency=sw.ASP())
    job.train(
        ph.tagged_loss_and_grad,
        data=ph.tagged_data,
        workers=2,
        steps=24,
        timeouts=sw.Timeouts(total=120),
        emulation=sw.Emulation(stragglers={1: 4.0}, delays={0: 0.02, 1: 0.02}),
    )
    hs = mp_helpers.read_records(path)
    assert sorted(hs) == [0, 1] and min(map(len, hs.values())) >= 5, hs
    fast, slow = (float(np.median(hs[w][3:])) for w in (0, 1))
    assert hs[0][0] == hs[1][0] == 1  # the first round measures one step
    # about 30 and 7 steps on an idle machine (4x a round at most); a loaded one slows both
    assert fast >= 6 and slow <= 0.6 * fast, hs
