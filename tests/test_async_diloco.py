"""Asynchronous DiLoCo through ``Job.train`` against the same algorithm written out by hand.

The reference (:func:`_reference`) runs the algorithm sequentially: ``N``
workers of equal speed, each runs ``H`` inner AdamW steps (its inner state kept
across rounds) from the parameters it pulled, and its pseudo-gradient is applied
on arrival by delayed Nesterov; a worker pulls again once its push is applied
(read-your-writes), so each push is ``N - 1`` updates old. Tokens are equal:
``pushes * H`` minibatches on both sides.

Issue 19: through ``Job.train`` (local runtime) the worker pulled right after
pushing, before its own push was applied, so every round restarted from
parameters that missed the worker's last pseudo-gradient; it redid that
progress and the outer Nesterov applied it again (val loss 1.39-1.91 against
1.23-1.26 in a loop of one's own). The worker loop now settles a model-averaging
push (``Push.settle``) before the next pull.
"""

from __future__ import annotations

import pytest
from numpy.testing import assert_allclose

import stalewise as sw
from stalewise import tasks, tree
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import Fixed
from stalewise.strategies import diloco

TASK = tasks.get("least-squares", n=512, d=64, batch_size=16, noise=0.1)
INNER = sw.optim.adamw(0.02)


def _reference(workers: int, pushes: int, h: int) -> float:
    """Asynchronous DiLoCo by hand (see the module docstring); returns the final loss."""
    flat, spec = tree.flatten(TASK.init_params())
    flat = flat.copy()
    outer = sw.optim.delayed_nesterov(0.7, 0.9, every=workers)
    outer_state = outer.init(flat)
    batches = [TASK.batches(w, workers) for w in range(workers)]
    inner = [INNER.init(flat, spec.segments) for _ in range(workers)]
    pulled = [flat.copy() for _ in range(workers)]
    for r in range(pushes):
        w = r % workers  # equal speeds: the workers push in turn
        local = pulled[w].copy()
        for _ in range(h):
            _, g = TASK.loss_and_grad(tree.unflatten(local, spec), next(batches[w]))
            INNER.apply(tree.flatten(g, spec=spec)[0].copy(), inner[w], local)
        outer.apply(pulled[w] - local, outer_state, flat)
        pulled[w] = flat.copy()  # read-your-writes: the next round starts from it
    return TASK.evaluate(tree.unflatten(flat, spec))["loss"]


def _job(workers: int, h: int) -> sw.Job:
    strategy = diloco(local_steps=h, inner=INNER, asynchronous=True, every=workers)
    return sw.Job(TASK.init_params(), strategy=strategy)


def test_one_worker_in_the_local_runtime_is_the_reference_run(no_leaks):
    """Failed before: the pull missed the worker's own last push (staleness 1 with one
    worker, loss about 1.5x the reference's)."""
    pushes, h = 40, 5
    result = _job(1, h).train(
        TASK.loss_and_grad,
        data=TASK.batches,
        workers=1,
        steps=pushes,
        timeouts=sw.Timeouts(total=120),
    )
    assert result.pushes == pushes
    # every round started from the parameters holding the worker's last push
    assert result.stats["staleness_counts"] == {0: pushes}
    loss = TASK.evaluate(result.params)["loss"]
    assert_allclose(loss, _reference(1, pushes, h), rtol=1e-4)


def test_two_workers_in_the_local_runtime_read_their_own_pushes(no_leaks):
    """Each step is paced (10 ms), so the two workers keep about equal speed: a push is
    about one update old (the other worker's), as in the reference. Before the fix each
    pull also missed the worker's own last push, so pushes were about two updates old.
    The mean, not the maximum: a loaded machine may hold one worker back now and then."""
    pushes, h = 40, 5
    result = _job(2, h).train(
        TASK.loss_and_grad,
        data=TASK.batches,
        workers=2,
        steps=pushes,
        emulation=sw.Emulation(delays={0: 0.01, 1: 0.01}),
        timeouts=sw.Timeouts(total=120),
    )
    assert result.pushes >= pushes
    assert result.stats["staleness_mean"] < 1.5, result.stats["staleness_counts"]
    assert TASK.evaluate(result.params)["loss"] < 1.1 * _reference(2, pushes, h)


@pytest.mark.parametrize("workers", [2, 4])
def test_the_simulator_matches_the_reference_at_equal_tokens(workers):
    """Equal speeds (a fixed step time), as in the reference: the workers run in lockstep,
    so no push is more than ``N - 1`` updates old (the others' pushes of one round), and
    none misses its own worker's last push."""
    pushes, h = 20 * workers, 5
    result = _job(workers, h).train(
        TASK.loss_and_grad,
        data=TASK.batches,
        workers=workers,
        steps=pushes,
        runtime=sw.Simulation(SimConfig(compute=Fixed(0.01))),
    )
    assert result.pushes == pushes
    assert max(result.stats["staleness_counts"]) <= workers - 1, result.stats
    loss = TASK.evaluate(result.params)["loss"]
    assert loss < 1.1 * _reference(workers, pushes, h)
