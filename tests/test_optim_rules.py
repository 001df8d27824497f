"""stalewise.optim on its own terms: each LAMB rule pinned by a hand computation,
update/apply agreement, allocation-free apply, checkpoint/restore, staleness
scale, argument validation, pickling and the docstring examples."""

from __future__ import annotations

import doctest
import importlib
import io
import math
import pickle
import tracemalloc

import numpy as np
import pytest
from numpy.testing import assert_allclose, assert_array_equal

from stalewise import optim
from stalewise.optim import LambState
from stalewise.segments import Segments

SEG = Segments.from_sizes(["enc.weight", "enc.bias", "dec.weight", "dec.bias"], [40, 8, 24, 3])

OPTIMIZERS = {
    "sgd": lambda: optim.sgd(0.1),
    "sgd-nesterov-wd": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda: optim.adam(0.01, weight_decay=0.01),
    "adamw": lambda: optim.adamw(optim.warmup_cosine(0.01, 2, 10)),
    "sgd-masked": lambda: optim.sgd(
        0.1, momentum=0.9, weight_decay=0.01, exclude_from_weight_decay=["bias$"]
    ),
    "adam-masked": lambda: optim.adam(0.01, weight_decay=0.01, exclude_from_weight_decay=["bias"]),
    "adamw-masked": lambda: optim.adamw(0.01, weight_decay=0.1, exclude_from_weight_decay=["bias"]),
    "lamb": lambda: optim.lamb(
        0.01,
        weight_decay=0.01,
        min_trust_ratio=0.1,
        exclude_from_weight_decay=["bias"],
        exclude_from_adaptation=["^dec.bias$"],
    ),
    "lars": lambda: optim.lars(0.1, weight_decay=1e-4, exclude_from_adaptation=["bias"]),
    "clip": lambda: optim.clip_by_global_norm(0.5),
    "chain": lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.lamb(0.01)),
}


def vectors(seed: int, dtype=np.float32, seg: Segments = SEG) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    params = rng.normal(size=seg.total).astype(dtype)
    params[seg.offsets[1] : seg.offsets[1] + seg.sizes[1]] = 0.0  # zero-initialised bias
    return params, rng.normal(size=seg.total).astype(dtype)


def state_arrays(state) -> list[np.ndarray]:
    if isinstance(state, np.ndarray):
        return [state]
    return [a for part in state for a in state_arrays(part)]


def assert_states_equal(a, b) -> None:
    for x, y in zip(state_arrays(a), state_arrays(b), strict=True):
        assert_array_equal(x, y)


# --- every optimizer ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_update_and_apply_agree_bit_for_bit(name, dtype):
    opt = OPTIMIZERS[name]()
    p_pure, _ = vectors(0, dtype)
    p_inplace = p_pure.copy()
    s_pure, s_inplace = opt.init(p_pure, SEG), opt.init(p_inplace, SEG)
    for step in range(5):
        _, g = vectors(step + 1, dtype)
        before = (g.copy(), p_pure.copy(), [a.copy() for a in state_arrays(s_pure)])
        updates, new_state = opt.update(g, s_pure, p_pure, scale=0.5)
        assert_array_equal(g, before[0])  # update is pure
        assert_array_equal(p_pure, before[1])
        assert_states_equal(s_pure, before[2])
        assert updates.dtype == dtype
        p_pure, s_pure = p_pure + updates, new_state
        opt.apply(g, s_inplace, p_inplace, scale=0.5)
        assert_array_equal(p_inplace, p_pure)
        assert_states_equal(s_inplace, s_pure)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_update_takes_read_only_inputs(name):
    opt = OPTIMIZERS[name]()
    params, g = vectors(12)
    state = opt.init(params, SEG)
    params.flags.writeable = g.flags.writeable = False
    updates, _ = opt.update(g, state, params)
    assert updates.shape == params.shape
    with pytest.raises(ValueError, match="params must be writeable"):
        opt.apply(g.copy(), state, params)
    with pytest.raises(ValueError, match="grads must be writeable"):
        opt.apply(g, state, params.copy())


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_apply_allocates_nothing_parameter_sized(name):
    seg = Segments.from_sizes([f"layer{i}.weight" for i in range(10)], [100_000] * 10)
    opt = OPTIMIZERS[name]()
    params, grads = vectors(0, seg=seg)
    state = opt.init(params, seg)
    opt.apply(grads.copy(), state, params)  # warm-up: JIT and caches
    g = grads.copy()
    tracemalloc.start()
    try:
        for _ in range(3):
            opt.apply(g, state, params)
        _, peak_apply = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        opt.update(grads, state, params)  # shows that numpy buffers are traced
        _, peak_update = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_update >= params.nbytes
    assert peak_apply < params.nbytes / 100


@pytest.mark.parametrize("name", ["sgd-nesterov-wd", "adam", "adamw", "lamb", "lars", "chain"])
def test_scale_scales_the_step_not_the_moments(name):
    opt = OPTIMIZERS[name]()
    params, g = vectors(1)
    state = opt.init(params, SEG)
    opt.apply(vectors(2)[1], state, params)  # non-trivial moments
    full, s_full = opt.update(g, state, params, scale=1.0)
    quarter, s_quarter = opt.update(g, state, params, scale=0.25)
    assert_array_equal(quarter, 0.25 * full)  # exact: a power of two
    assert_states_equal(s_quarter, s_full)
    none, s_none = opt.update(g, state, params, scale=0.0)
    assert not none.any()
    assert_states_equal(s_none, s_full)  # count and moments advance all the same


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_pickles(name):
    opt = OPTIMIZERS[name]()
    clone = pickle.loads(pickle.dumps(opt))
    p1, g = vectors(3)
    p2 = p1.copy()
    s1, s2 = opt.init(p1, SEG), clone.init(p2, SEG)
    for _ in range(3):
        opt.apply(g.copy(), s1, p1)
        clone.apply(g.copy(), s2, p2)
    assert_array_equal(p1, p2)


# --- weight decay masks of SGD and Adam(W) -----------------------------------------


def _reference_steps(kind: str, p, grads, lr, wd, decay, momentum=0.9, b1=0.9, b2=0.99, eps=1e-8):
    """Hand-written steps of ``kind`` in float64; ``decay`` is 1.0 where weight decay applies."""
    p = p.copy()
    buf, m, v = np.zeros_like(p), np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        if kind == "sgd":
            buf = momentum * buf + g + wd * decay * p
            p = p - lr * buf
            continue
        g = g + (wd * decay * p if kind == "adam" else 0.0)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        direction = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        p = p - lr * (direction + (wd * decay * p if kind == "adamw" else 0.0))
    return p


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_weight_decay_mask_by_hand(kind):
    # nanoGPT's configure_optimizers: 2-D weights decay, 1-D biases and norms do not.
    seg = Segments.from_sizes(
        ["h.attn.weight", "h.attn.bias", "h.ln_1.weight", "head.weight"], [12, 4, 4, 6]
    )
    rng = np.random.default_rng(5)
    p0 = rng.uniform(1.0, 2.0, size=seg.total)
    grads = rng.normal(size=(3, seg.total))
    decay = np.repeat([1.0, 0.0, 0.0, 1.0], seg.sizes)
    lr, wd = 0.1, 0.5
    common = {"weight_decay": wd, "exclude_from_weight_decay": ["bias$", r"^h\.ln_"]}
    opt = {
        "sgd": lambda: optim.sgd(lr, momentum=0.9, **common),
        "adam": lambda: optim.adam(lr, b2=0.99, **common),
        "adamw": lambda: optim.adamw(lr, b2=0.99, **common),
    }[kind]()
    params = p0.copy()
    state = opt.init(params, seg)
    assert state.decay.tolist() == [True, False, False, True]
    for g in grads:
        opt.apply(g.copy(), state, params)
    assert_allclose(params, _reference_steps(kind, p0, grads, lr, wd, decay), rtol=1e-13)
    # the mask matters: without it the biases and the norm would move differently
    everywhere = _reference_steps(kind, p0, grads, lr, wd, np.ones(seg.total))
    moved = ~np.isclose(params, everywhere, rtol=1e-6)
    assert moved.tolist() == (decay == 0).tolist()


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_weight_decay_mask_that_matches_nothing_changes_nothing(kind):
    make = getattr(optim, kind)
    plain, masked = (
        make(0.1, weight_decay=0.1),
        make(0.1, weight_decay=0.1, exclude_from_weight_decay=["nothing"]),
    )
    p1, g = vectors(12)
    p2 = p1.copy()
    s1, s2 = plain.init(p1, SEG), masked.init(p2, SEG)
    for _ in range(3):
        plain.apply(g.copy(), s1, p1)
        masked.apply(g.copy(), s2, p2)
    assert_array_equal(p1, p2)
    name = {"sgd": "Sgd", "adam": "Adam", "adamw": "Adam"}[kind]
    assert type(s1) is getattr(optim, f"{name}State")
    assert type(s2) is getattr(optim, f"Masked{name}State")


# --- LAMB, rule by rule ----------------------------------------------------------


def test_lamb_zero_initialised_leaf_moves_on_step_one():
    opt = optim.lamb(0.01, weight_decay=0.1)
    params, g = vectors(4)
    bias = slice(SEG.offsets[1], SEG.offsets[1] + SEG.sizes[1])
    state = opt.init(params, SEG)
    opt.apply(g.copy(), state, params)
    # step 1: m_hat = g, v_hat = g^2, wd * 0 = 0, and r = 1 since ||p|| = 0
    assert_allclose(params[bias], -0.01 * g[bias] / (np.abs(g[bias]) + 1e-6), rtol=1e-6)
    assert state.trust_ratio[1] == 1.0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "no_decay, no_adapt", [((), ()), (["b"], ()), ((), ["b"]), (["b"], ["b"]), (["w", "b"], ["w"])]
)
def test_lamb_exclusions_by_hand(no_decay, no_adapt, dtype):
    seg = Segments.from_sizes(["w", "b"], [3, 2])
    p = np.array([3.0, -4.0, 12.0, 0.5, -0.25])
    g = np.array([1.0, -2.0, 0.5, 4.0, -1.0])
    lr, wd, eps = 0.1, 0.5, 1e-6
    expected = p.copy()
    for name, leaf in (("w", slice(0, 3)), ("b", slice(3, 5))):
        u = g[leaf] / (np.abs(g[leaf]) + eps)  # step 1: m_hat = g and v_hat = g^2
        if name not in no_decay:
            u += wd * p[leaf]
        r = 1.0 if name in no_adapt else np.linalg.norm(p[leaf]) / np.linalg.norm(u)
        expected[leaf] -= lr * r * u
    opt = optim.lamb(
        lr,
        weight_decay=wd,
        eps=eps,
        exclude_from_weight_decay=no_decay,
        exclude_from_adaptation=no_adapt,
    )
    params = p.astype(dtype)
    opt.apply(g.astype(dtype), opt.init(params, seg), params)
    assert_allclose(params, expected, rtol=1e-6 if dtype == np.float32 else 1e-13)


def test_lamb_clips_the_trust_ratio():
    seg = Segments.from_sizes(["big", "small"], [4, 4])
    p = np.array([100.0, -100.0, 100.0, 100.0, 1e-3, 1e-3, -1e-3, 1e-3], np.float32)
    g = np.array([1.0, 1.0, -1.0, 1.0, 1.0, -1.0, 1.0, 1.0], np.float32)
    opt = optim.lamb(0.01, min_trust_ratio=0.5, max_trust_ratio=10.0)
    state = opt.init(p, seg)
    updates, state = opt.update(g, state, p)
    assert state.trust_ratio.tolist() == [10.0, 0.5]  # unclipped: 100 and 0.001
    direction = g / (np.abs(g) + 1e-6)
    assert_allclose(updates, -0.01 * np.repeat([10.0, 0.5], 4) * direction, rtol=1e-6)


def test_lamb_weight_decay_is_part_of_the_applied_step():
    seg = Segments.from_sizes(["adapted", "fixed"], [3, 3])
    p = np.array([1.0, -2.0, 3.0, 1.0, -2.0, 3.0])
    opt = optim.lamb(0.1, weight_decay=0.5, exclude_from_adaptation=["fixed"])
    updates, _ = opt.update(np.zeros(6), opt.init(p, seg), p)  # no gradient: u = wd * p
    # adapted: r = ||p|| / ||0.5 p|| = 2, so the step is 0.1 * 2 * 0.5 * p; fixed: r = 1
    assert_allclose(updates, np.concatenate([-0.1 * p[:3], -0.05 * p[3:]]), rtol=1e-12)


def test_lamb_restored_state_continues_bias_correction():
    opt = optim.lamb(0.01, weight_decay=0.01)
    params, _ = vectors(5)
    state = opt.init(params, SEG)
    grads = [vectors(10 + t)[1] for t in range(10)]
    for g in grads[:5]:
        opt.apply(g.copy(), state, params)
    buf = io.BytesIO()  # a checkpoint: the state's arrays, as saved to disk
    np.savez(buf, params=params, **state._asdict())
    for g in grads[5:]:
        opt.apply(g.copy(), state, params)

    buf.seek(0)
    saved = np.load(buf)
    restored = LambState(**{k: saved[k] for k in LambState._fields})
    resumed = saved["params"].copy()
    assert restored.count.shape == () and int(restored.count) == 5
    reset = optim.copy_state(restored)._replace(count=np.zeros((), np.int64))
    not_resumed = resumed.copy()
    for g in grads[5:]:
        opt.apply(g.copy(), restored, resumed)
        opt.apply(g.copy(), reset, not_resumed)
    assert_array_equal(resumed, params)
    assert_states_equal(restored, state)
    assert not np.array_equal(not_resumed, params)  # the count matters


def test_lars_zero_initialised_leaf_moves_on_step_one():
    opt = optim.lars(0.1, momentum=0.9)
    params, g = vectors(6)
    state = opt.init(params, SEG)
    opt.apply(g.copy(), state, params)
    bias = slice(SEG.offsets[1], SEG.offsets[1] + SEG.sizes[1])
    assert_allclose(params[bias], -0.1 * vectors(6)[1][bias], rtol=1e-6)
    assert state.trust_ratio[1] == 1.0 and state.trust_ratio[0] < 0.01


# --- clipping and chain ------------------------------------------------------------


def test_clip_by_global_norm():
    clip = optim.clip_by_global_norm(2.0)
    params, g = vectors(7)
    g *= 10.0 / np.linalg.norm(g.astype(np.float64))
    clipped, _ = clip.update(g, clip.init(params), params)
    assert_allclose(np.linalg.norm(clipped.astype(np.float64)), 2.0, rtol=1e-6)
    assert_allclose(clipped, g / 5.0, rtol=1e-6)
    small = g / 10.0
    unclipped, _ = clip.update(small, clip.init(params), params)
    assert_array_equal(unclipped, small)


def test_chain_state_is_a_tuple_of_states():
    opt = OPTIMIZERS["chain"]()
    params, g = vectors(8)
    state = opt.init(params, SEG)
    assert isinstance(state, tuple) and isinstance(state[1], LambState)
    opt.apply(g, state, params)
    assert int(state[1].count) == 1


# --- validation --------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: optim.sgd(-0.1), r"lr .* got -0\.1"),
        (lambda: optim.adam(0.1, b1=1.0), r"b1 .* got 1\.0"),
        (lambda: optim.adamw(0.1, b1=-0.5), r"b1 .* got -0\.5"),
        (lambda: optim.lamb(0.1, b2=1.5), r"b2 .* got 1\.5"),
        (lambda: optim.adam(0.1, eps=0.0), r"eps .* got 0\.0"),
        (lambda: optim.lamb(0.1, eps=-1e-6), r"eps .* got -1e-06"),
        (
            lambda: optim.lamb(0.1, min_trust_ratio=2.0, max_trust_ratio=1.0),
            r"max_trust_ratio .* 1\.0",
        ),
        (lambda: optim.lamb(0.1, weight_decay=float("nan")), r"weight_decay .* nan"),
        (lambda: optim.lamb(0.1, exclude_from_weight_decay=["("]), r"exclude_from_weight_decay"),
        (lambda: optim.adamw(0.1, exclude_from_weight_decay=["("]), r"exclude_from_weight_decay"),
        (lambda: optim.sgd(0.1, exclude_from_weight_decay=["("]), r"exclude_from_weight_decay"),
        (lambda: optim.sgd(0.1, momentum=1.0), r"momentum .* got 1\.0"),
        (lambda: optim.sgd(0.1, nesterov=True), r"nesterov"),
        (lambda: optim.lars(0.1, trust_coefficient=0.0), r"trust_coefficient .* got 0\.0"),
        (lambda: optim.clip_by_global_norm(0.0), r"max_norm .* got 0\.0"),
        (lambda: optim.warmup_cosine(1.0, warmup=10, total=5), r"total .* got 5"),
        (lambda: optim.warmup_cosine(1.0, 1, 5, floor=2.0), r"floor .* got 2\.0"),
        (lambda: optim.step_decay(1.0, every=0, gamma=0.5), r"every .* got 0"),
        (lambda: optim.step_decay(1.0, every=2.5, gamma=0.5), r"every .* got 2\.5"),
        (lambda: optim.chain(), r"at least one"),
    ],
)
def test_bad_arguments_raise(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_bad_vectors_raise_before_touching_state(name):
    opt = OPTIMIZERS[name]()
    params, g = vectors(9)
    state = opt.init(params, SEG)
    before = [a.copy() for a in state_arrays(state)]
    for bad, message in [
        (
            g[:-1].copy(),
            r"grads must be a vector of length 75 .*, got float32 array of shape \(74,\)",
        ),
        (g.astype(np.float64), r"grads must have the dtype of params \(float32\), got float64"),
        (g.reshape(3, 25), r"grads .* shape \(3, 25\)"),
        (params, r"share memory"),
    ]:
        with pytest.raises(ValueError, match=message):
            opt.apply(bad, state, params)
    with pytest.raises(ValueError, match=r"scale .* got -1\.0"):
        opt.apply(g, state, params, scale=-1.0)
    with pytest.raises(ValueError, match="segments cover 75 elements but params has 74"):
        opt.init(params[:-1].copy(), SEG)
    assert_states_equal(state, before)


def test_schedule_values_are_checked():
    opt = optim.sgd(lambda n: 0.1 - 0.1 * n)
    params, g = vectors(10)
    state = opt.init(params, SEG)
    opt.apply(g.copy(), state, params)
    opt.apply(g.copy(), state, params)  # lr(1) == 0 is fine
    with pytest.raises(ValueError, match=r"lr at count 2 .* got -0\.1"):
        opt.apply(g.copy(), state, params)


def test_corrupted_state_raises():
    opt = optim.lamb(0.1)
    params, g = vectors(11)
    state = opt.init(params, SEG)
    with pytest.raises(ValueError, match="outside the 75 parameters"):
        opt.apply(g, state._replace(sizes=state.sizes * 2), params)
    with pytest.raises(ValueError, match="count must be a 0-d int64"):
        opt.apply(g, state._replace(count=np.zeros(1, np.int64)), params)
    masked = optim.adamw(0.1, exclude_from_weight_decay=["bias"])
    state = masked.init(params, SEG)
    with pytest.raises(ValueError, match="outside the 75 parameters"):
        masked.apply(g, state._replace(offsets=state.offsets + 10), params)
    with pytest.raises(ValueError, match="no leaf table"):
        masked.apply(g, optim.adamw(0.1).init(params, SEG), params)


# --- docs --------------------------------------------------------------------------


@pytest.mark.parametrize("module", ["__init__", "base", "schedules", "sgd", "adam", "lamb", "lars"])
def test_docstring_examples_run(module):
    name = "stalewise.optim" if module == "__init__" else f"stalewise.optim.{module}"
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_public_names():
    assert math.isclose(optim.constant(2.0)(5), 2.0)
    assert not hasattr(optim, "step")  # step_decay's old alias, removed
    assert {"lamb", "lars", "sgd", "adam", "adamw", "chain", "clip_by_global_norm"} <= set(
        optim.__all__
    )
