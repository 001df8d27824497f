"""Adaptive local SGD / DiLoCo (``sw.strategies.adaptive``): the schedules, the worker's round, runs.

The simulated runs use float64 least squares, as in test_averaging.py.
"""

from __future__ import annotations

import math
import pickle
from dataclasses import dataclass

import numpy as np
import pytest
from numpy.testing import assert_allclose
from test_averaging import same_rule

import stalewise as sw
from stalewise import tasks
from stalewise.adaptive import AdaCommState, Adaptive, AdaptiveState
from stalewise.strategies import adacomm, adaptive, diloco, fixed, local_sgd

TASK = tasks.get("least-squares", n=512, d=16, batch_size=32, noise=0.1)


def _sim(job: sw.Job, workers: int, steps: int, **kw):
    return job.train(
        TASK.loss_and_grad, data=TASK.batches, workers=workers, steps=steps, runtime="sim", **kw
    )


# -- schedules ---------------------------------------------------------------------------


def test_adacomm_rule_on_a_hand_computed_loss_sequence():
    sched = adacomm(start=32, min_steps=2)
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
    sched = adacomm(start=8)
    for bad in (0.0, -2.0):
        with pytest.raises(ValueError, match="needs losses bounded below by 0"):
            sched.next(sched.init(), bad)


def test_fixed_schedule():
    sched = fixed(7)
    state = sched.init()
    for loss in (10.0, 1.0, math.nan):
        h, state = sched.next(state, loss)
        assert h == 7


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
    strat = adaptive(sw.optim.sgd(0.5), start=6)
    state = strat.init({"x": np.ones(1)})
    step = strat.step(state, {"x": np.ones(1)}, lambda p, _: (3.0, {"x": p["x"]}), iter([None] * 6))
    assert step.local_steps == 6 and state.schedule == AdaCommState(3.0, 6)


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
    strat = _Recording(adacomm(start=32), local_sgd(1, sw.optim.sgd(0.05)))
    job = sw.Job(TASK.init_params(), strategy=strat)
    start = TASK.evaluate(TASK.init_params())["loss"]
    result = _sim(job, 4, 120, stragglers={3: 2.0})
    assert TASK.evaluate(result.params)["loss"] < 0.05 * start
    per_worker: dict[int, list[int]] = {}
    for key, h in _RECORDED:
        per_worker.setdefault(key, []).append(h)
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
        runs.append(_sim(job, 3, 45, stragglers={2: 1.7}, seed=3))
    a, b = runs
    assert np.abs(a.flat - TASK.init_params()["x"]).max() > 0.1  # it moved
    assert np.array_equal(a.flat, b.flat)
    assert (a.time, a.pushes, a.stats["version"]) == (b.time, b.pushes, b.stats["version"])
    assert a.stats["staleness_mean"] == b.stats["staleness_mean"]


def _trainer(outer: str, consistency) -> Adaptive:
    if outer == "local_sgd":
        return adaptive(sw.optim.sgd(0.05), start=16)
    if consistency.kind == "bsp":
        return adaptive(sw.optim.adamw(0.005), start=16, outer="diloco")
    return adaptive(sw.optim.adamw(0.005), start=16, outer="diloco", asynchronous=True, every=4)


@pytest.mark.parametrize("consistency", [sw.ASP(), sw.BSP()], ids=str)
@pytest.mark.parametrize("outer", ["local_sgd", "diloco"])
def test_adaptive_trains_least_squares(outer, consistency):
    start = TASK.evaluate(TASK.init_params())["loss"]
    job = sw.Job(TASK.init_params(), consistency=consistency, strategy=_trainer(outer, consistency))
    result = _sim(job, 4, 160, stragglers={3: 2.0})
    assert result.pushes >= 160
    assert TASK.evaluate(result.params)["loss"] < 0.05 * start


def test_adaptive_trains_in_the_local_runtime(no_leaks):
    start = TASK.evaluate(TASK.init_params())["loss"]
    strategy = adaptive(sw.optim.sgd(0.05), start=16, min_steps=2)
    job = sw.Job(
        TASK.init_params(), strategy=strategy, consistency=sw.BSP()
    )  # pickled; BSP: timing-free
    result = job.train(TASK.loss_and_grad, data=TASK.batches, workers=2, steps=60, timeout=120)
    assert result.pushes >= 60
    assert TASK.evaluate(result.params)["loss"] < 0.1 * start


# -- configuration ---------------------------------------------------------------------


def test_recommended_server_optimizers():
    params = {"x": np.zeros(4)}
    job = sw.Job(params, strategy=adaptive(sw.optim.sgd(0.1)))
    assert same_rule(job.config.optimizer, sw.optim.sgd(1.0))
    job = sw.Job(params, strategy=adaptive(outer="diloco"))
    assert same_rule(job.config.optimizer, sw.optim.sgd(0.7, momentum=0.9, nesterov=True))
    job = sw.Job(params, strategy=adaptive(outer="diloco", outer_lr=0.5, outer_momentum=0.8))
    assert same_rule(job.config.optimizer, sw.optim.sgd(0.5, momentum=0.8, nesterov=True))
    job = sw.Job(params, strategy=adaptive(outer="diloco", asynchronous=True, every=3))
    assert same_rule(job.config.optimizer, sw.optim.delayed_nesterov(0.7, 0.9, every=3))
    lazy = adaptive(outer="diloco", asynchronous=True)
    assert lazy.server_optimizer(workers=5).apply.__self__.every == 5
    with pytest.raises(TypeError, match=r"every=<workers>\s+to adaptive\(\).*optimizer="):
        sw.Job(params, strategy=lazy)


def test_adaptive_pickles_and_compares_by_configuration():
    for strat in (
        adaptive(sw.optim.sgd(0.1), start=64, min_steps=4),
        adaptive(sw.optim.lamb(1e-3), schedule=fixed(3), reset_inner=True, smoothing=0.0),
        adaptive(outer="diloco", asynchronous=True, every=4, schedule=Scripted((4, 2))),
    ):
        assert pickle.loads(pickle.dumps(strat)) == strat
        assert hash(pickle.loads(pickle.dumps(strat))) == hash(strat)
        assert repr(strat).startswith("adaptive(schedule=")
    sgd = sw.optim.sgd(0.1)
    assert adaptive(sgd, start=8) == adaptive(sgd, schedule=adacomm(8))
    assert adaptive(sgd, start=8) != adaptive(sgd, start=9)
    assert adaptive(sgd, start=8) != adaptive(sgd, start=8, smoothing=0.5)
    assert adaptive(sgd, schedule=fixed(2)) != local_sgd(2, sgd)
    assert repr(adaptive(sgd, schedule=fixed(2), smoothing=0.5)) == (
        "adaptive(schedule=fixed(2), inner=_Sgd(lr=0.1, momentum=0.0, nesterov=False, "
        "weight_decay=0.0), outer='local_sgd', smoothing=0.5)"
    )


def test_constructors_check_their_arguments():
    sgd = sw.optim.sgd(0.1)
    with pytest.raises(ValueError, match="start must be an integer >= 1"):
        adacomm(start=0)
    with pytest.raises(ValueError, match="min_steps=5 exceeds start=4"):
        adacomm(start=4, min_steps=5)
    with pytest.raises(ValueError, match="fixed: steps must be an integer >= 1"):
        fixed(1.5)
    with pytest.raises(TypeError, match=r"schedule must have init\(\)"):
        adaptive(sgd, schedule=lambda loss: 4)
    with pytest.raises(ValueError, match="configure the default adacomm schedule"):
        adaptive(sgd, schedule=fixed(2), start=4)
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
