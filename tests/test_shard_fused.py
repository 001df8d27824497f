"""A shard's step with fused checks (SGD, Adam): the payload's and the result's values are
checked in the step's own pass, block by block, and a push that fails either is refused
as the separate checks refused it, with the params and the optimizer state bit for bit
as they were, wherever in the slice the bad value sits."""

import numpy as np
import pytest

from stalewise import optim
from stalewise.optim import _kernels
from stalewise.protocol import PushHeader, Shard
from stalewise.protocol.state import _flatten_state
from stalewise.segments import Segments

N = 3 * _kernels.CHECK_BLOCK + 77  # three blocks and a tail
SEG = Segments.from_sizes(["a.w", "a.b", "c.w"], [1000, 5, N - 1005])
OPTIMIZERS = {
    "sgd": lambda: optim.sgd(0.1),
    "momentum": lambda: optim.sgd(
        0.1, momentum=0.9, weight_decay=0.01, exclude_from_weight_decay=[r"\.b$"]
    ),
    "adamw": lambda: optim.adamw(1e-2, exclude_from_weight_decay=[r"\.b$"]),
}


def frozen(shard):
    arrays = _flatten_state(shard.opt_state)[1]
    return shard.params.tobytes(), {k: a.tobytes() for k, a in arrays.items()}, shard.version


def started(name, dtype=np.float32, fused=True):
    rng = np.random.default_rng(1)
    shard = Shard(rng.normal(size=N).astype(dtype), SEG, OPTIMIZERS[name](), workers=1)
    assert shard._fused is not None
    if not fused:
        shard._fused = shard._bounds = None  # the separate passes: the reference
    shard.join(0, 1)
    for seq in range(3):  # moments that are not trivial
        assert shard.push(PushHeader(0, seq, shard.version, 1), rng.normal(size=N).astype(dtype)).ok
    return shard


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_fused_step_takes_the_step_the_separate_passes_take(name, dtype):
    fused, plain = started(name, dtype), started(name, dtype, fused=False)
    assert frozen(fused) == frozen(plain)


@pytest.mark.parametrize("prepared", [False, True])  # the undo copy: made idle, or by the step
@pytest.mark.parametrize("where", [0, _kernels.CHECK_BLOCK + 3, N - 1])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_non_finite_payload_is_refused_wherever_it_sits_and_changes_nothing(
    name, where, prepared
):
    shard = started(name)
    before = frozen(shard)
    for seq, bad in enumerate((np.nan, np.inf, -np.inf), start=3):
        if prepared:
            shard.prepare()
        else:
            shard._undo_fresh = False  # as after a checkpoint's load: the step copies
        payload = np.ones(N, np.float32)
        payload[where] = bad
        ack = shard.push(PushHeader(0, seq, shard.version, 1), payload)
        assert not ack.ok and ack.kind == "not_finite", ack
        assert f"first at element {where}," in ack.reason
        assert frozen(shard) == before
    huge = np.zeros(N, np.float32)
    huge[where] = 2e19  # finite, but its square overflows float32: the norm rule
    ack = shard.push(PushHeader(0, 6, shard.version, 1), huge)
    assert ack.kind == "overflow" and "overflows the dtype" in ack.reason
    assert frozen(shard) == before
    ack = shard.push(PushHeader(0, 7, shard.version, 1), np.ones(N, np.float32))
    assert ack.ok and shard.version == before[2] + 1


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_step_that_overflows_in_the_last_block_only_is_undone(name):
    """A modest push, one parameter near float32's limit in the tail and a huge step
    size: the blocks before it were stepped already, and are restored bit for bit."""
    opt = {
        "sgd": optim.sgd(1e38),
        "momentum": optim.sgd(1e38, momentum=0.9),
        "adamw": optim.adamw(1e38),
    }
    params = np.random.default_rng(2).normal(size=N).astype(np.float32)
    params[N - 2] = 3e38
    shard = Shard(params, SEG, opt[name], workers=1)
    shard.join(0, 1)
    before = frozen(shard)
    ack = shard.push(PushHeader(0, 0, 0, 1), -np.ones(N, np.float32))
    assert not ack.ok and ack.kind == "overflow", ack
    assert f"would make parameter {N - 2} (leaf 'c.w') non-finite" in ack.reason
    assert frozen(shard) == before and shard.clocks[0] == 1  # still the worker's step


def test_a_checked_step_refuses_undo_copies_that_do_not_fit():
    rule = optim.adamw(1e-3).apply.__self__
    params = np.ones(10, np.float32)
    state = rule.init(params)
    with pytest.raises(ValueError, match=r"undo must be 3 writeable contiguous copies"):
        rule.apply_checked(
            np.ones(10, np.float32), state, params, undo=(np.empty(10, np.float32),) * 2
        )
    with pytest.raises(ValueError, match=r"undo must be 3"):
        rule.apply_checked(
            np.ones(10, np.float32), state, params, undo=(np.empty(9, np.float32),) * 3
        )
    assert int(state.count) == 0 and np.all(params == 1)  # nothing taken


@pytest.mark.parametrize("name", ["sgd", "momentum", "adamw"])
def test_a_step_within_its_bound_takes_no_undo_copy(name):
    """SGD and Adam bound what their step can write from the largest magnitudes of the
    update, the params and the state: a step well within the dtype's range is taken in
    place with no undo copy at all (none is ever made, idle or not), as the reference
    takes it."""
    shard, plain = started(name), started(name, fused=False)
    rng = np.random.default_rng(3)
    for seq in range(3, 8):
        shard.prepare()  # what a runtime does while idle
        g = rng.normal(size=N).astype(np.float32)
        assert shard.push(PushHeader(0, seq, shard.version, 1), g.copy()).ok
        assert plain.push(PushHeader(0, seq, plain.version, 1), g).ok
    assert shard._undo[1] == [] and not shard._undo_fresh  # no undo buffer was ever made
    assert frozen(shard) == frozen(plain)


def test_a_step_near_the_dtypes_limit_is_not_bounded_and_is_undone_when_it_overflows():
    """Params within a quarter of float32's limit: the bound does not clear the step, which
    then keeps its undo copy; the one that overflows is refused and changes nothing, and
    one that does not is taken (the bounds are measured again after it)."""
    params = np.zeros(N, np.float32)
    params[5] = 1e38
    shard = Shard(params, SEG, optim.sgd(1e30), workers=1)
    shard.join(0, 1)
    before = frozen(shard)
    g = np.zeros(N, np.float32)
    g[5] = -3e8  # 1e38 + 3e38 overflows
    ack = shard.push(PushHeader(0, 0, 0, 1), g)
    assert ack.kind == "overflow" and frozen(shard) == before
    g[5] = 1e8
    assert shard.push(PushHeader(0, 1, 0, 1), g).ok and shard.params[5] == 0.0
    assert shard._maxima is None and shard._undo[1]  # the undo path was taken
    shard.prepare()
    assert shard._maxima[1] == (0.0, 0.0)  # measured again: the next step is bounded


BOUNDED = {
    **OPTIMIZERS,
    "adam_l2": lambda: optim.adam(1e-3, weight_decay=0.1),
    "lamb": lambda: optim.lamb(1e-2, weight_decay=0.01, min_trust_ratio=0.5),
}


@pytest.mark.parametrize("name", sorted(BOUNDED))
def test_a_rules_bounds_hold_after_its_step(name):
    """What a step writes stays within the bounds its rule gave before it (the norms of
    the params and of each moment), over magnitudes from 1e-3 to 1e3, staleness weights
    and steps taken before; a float32 rounding may pass a bound by a few ulps (the shard
    keeps a factor of 4 below the dtype's limit)."""
    rule = BOUNDED[name]().apply.__self__
    rng = np.random.default_rng(7)
    for trial in range(12):
        size = 10 ** rng.uniform(-3, 3)
        params = (rng.normal(size=N) * size).astype(np.float32)
        state = rule.init(params, SEG)
        for _ in range(trial % 3):
            rule.apply((rng.normal(size=N) * size).astype(np.float32), state, params)
        g = (rng.normal(size=N) * 10 ** rng.uniform(-3, 3)).astype(np.float32)
        scale = float(rng.uniform(0.1, 1.0))
        bounds = rule.bound(state, scale, float(np.linalg.norm(g.astype(np.float64))),
                            rule.maxima(state, params))  # fmt: skip
        rule.apply(g, state, params, scale=scale)
        after = rule.maxima(state, params)
        assert all(a <= b * (1 + 1e-5) for a, b in zip(after, bounds, strict=False)), (
            trial,
            after,
            bounds,
        )


def test_a_lamb_step_within_its_bound_takes_no_undo_copy():
    """LAMB (no fused checks) is bounded as Adam is: no undo copy, the reference's steps."""
    rng = np.random.default_rng(2)
    init, shards = rng.normal(size=N).astype(np.float32), []
    for bounded in (True, False):
        shard = Shard(init.copy(), SEG, BOUNDED["lamb"](), workers=1)
        if not bounded:
            shard._bounds = None
        shard.join(0, 1)
        shards.append(shard)
    for seq in range(4):
        g = rng.normal(size=N).astype(np.float32)
        for shard in shards:
            shard.prepare()
            assert shard.push(PushHeader(0, seq, shard.version, 1), g.copy()).ok
    assert shards[0]._undo[1] == [] and shards[1]._undo[1]
    assert frozen(shards[0]) == frozen(shards[1])
