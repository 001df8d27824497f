"""Streaming DiLoCo's overlap: a fragment's push in flight while the worker takes its next
inner steps (stalewise.protocol.loop's Ahead, the local runtime).

With ``delay >= 1`` the local runtime answers the push at once and the loop takes the
inner steps that need no pull before it pulls; ``overlap=False`` waits for the push and
its pull first. Under BSP the pushes, their values and the merges must be the same, and
the final parameters identical; with an emulated transport time
(``sw.Emulation(transport=)``) the overlapped pushes land while the worker computes.
"""

from __future__ import annotations

import numpy as np
import pytest
from numpy.testing import assert_array_equal
from test_streaming import TASK, init_params, loss_and_grad

import stalewise as sw
from stalewise.protocol import loop
from stalewise.strategies import streaming_diloco


def _strategy(delay: int, overlap: bool):
    return streaming_diloco(
        local_steps=4, inner=sw.optim.adamw(0.02), fragments=2, delay=delay, alpha=0.5,
        outer_lr=0.7, outer_momentum=0.3, overlap=overlap,
    )  # fmt: skip


def _requests(strategy, rounds: int) -> list:
    """The requests one worker's loop makes with ``overlap=True`` over ``rounds`` pushes,
    answered by a one-worker in-process server that applies each push as the mean."""
    server = init_params()
    gen = loop.worker_loop(strategy, loss_and_grad, TASK.batches(0, 1), overlap=True)
    seen, begins, request = [], iter([True] * rounds + [False]), next(gen)
    try:
        while True:
            seen.append(request)
            if request is loop.BEGIN:
                answer = next(begins)
            elif request is loop.PULL:
                answer = {k: v.copy() for k, v in server.items()}
            else:
                if isinstance(request, loop.Push):
                    for k in server:
                        server[k] = server[k] - request.update[k]
                answer = []
            request = gen.send(answer)
    except StopIteration:
        return seen


def test_the_loop_takes_the_steps_before_the_merge_while_the_push_is_in_flight():
    seen = _requests(_strategy(delay=1, overlap=True), rounds=4)
    kinds = [type(r).__name__ if isinstance(r, tuple) else repr(r) for r in seen]
    # push, then one step ahead (the merge is due 1 step after the push), then the pull
    assert kinds[:4] == ["BEGIN", "PULL", "Push", "Ahead"]
    pushes = [r for r in seen if isinstance(r, loop.Push)]
    aheads = [r for r in seen if isinstance(r, loop.Ahead)]
    assert all(p.overlap and p.settle for p in pushes)
    # 4 inner steps a period, 2 fragments: a push every 2 steps, 1 of them ahead (the
    # first push's step has no push before it: 2 steps)
    assert [p.local_steps for p in pushes] == [2, 1, 1, 1]
    assert [a.local_steps for a in aheads] == [1, 1, 1, 1]
    # without overlap (or delay 0) the loop makes no Ahead and every step's pushes settle
    for s in (_strategy(delay=1, overlap=False), _strategy(delay=0, overlap=True)):
        seen = _requests(s, rounds=4)
        assert not any(isinstance(r, loop.Ahead) for r in seen)
        assert [r.local_steps for r in seen if isinstance(r, loop.Push)] == [2, 2, 2, 2]


def _train(delay: int, overlap: bool, transport: float) -> sw.TrainResult:
    job = sw.Job(init_params(), strategy=_strategy(delay, overlap), consistency=sw.BSP())
    return job.train(
        loss_and_grad,
        data=TASK.batches,
        workers=2,
        steps=24,
        emulation=sw.Emulation(delays={0: 0.02, 1: 0.02}, transport=transport),
        timeouts=sw.Timeouts(total=120),
    )


@pytest.mark.parametrize("delay", [1, 2])
def test_overlapped_pushes_make_the_same_run_under_bsp(no_leaks, delay):
    # an emulated transit time a push spends before the shards see it: the overlapped
    # run's pushes land while its workers take their next steps
    base = _train(delay, overlap=False, transport=0.05)
    over = _train(delay, overlap=True, transport=0.05)
    assert base.pushes == over.pushes == 24
    for k in ("a", "b"):
        assert_array_equal(over.params[k], base.params[k])
    assert not np.array_equal(base.params["a"], init_params()["a"])


def test_transport_is_checked_and_emulated_by_the_local_runtime_only():
    with pytest.raises(ValueError, match=r"Emulation\.transport must be a number of seconds "
                                         r"in \[0, 60\], got -1"):  # fmt: skip
        sw.Emulation(transport=-1)
    job = sw.Job(init_params(), strategy=_strategy(1, True), consistency=sw.BSP())
    with pytest.raises(ValueError, match=r"transport is emulated by runtime local only, "
                       r"not 'sim'"):  # fmt: skip
        job.train(loss_and_grad, data=TASK.batches, workers=2, steps=4, runtime="sim",
                  emulation=sw.Emulation(transport=0.1))  # fmt: skip


def test_the_emulated_wait_is_one_rule_for_pushes_and_steps_ahead():
    """A straggler ``slowdown`` times slower with ``delay`` seconds more per local step: the
    real-time runtimes wait ``(compute + delay * local_steps) * slowdown - compute``."""
    ahead = loop.Ahead(local_steps=2, compute=1.0)
    assert loop.emulated(ahead, slowdown=3.0, delay=0.5) == 5.0
    push = loop.Push(update=None, loss=0.0, local_steps=4, compute=0.2)
    assert loop.emulated(push, slowdown=1.0, delay=0.25) == pytest.approx(1.0)
    assert loop.emulated(push, slowdown=1.0, delay=0.0) == 0.0  # no emulation: no wait
    import doctest

    assert doctest.testmod(loop, raise_on_error=True).failed == 0
