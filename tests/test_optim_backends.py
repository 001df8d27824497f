"""Every optimizer x every backend keeps structure and dtypes.

A nested tree (dict, list, tuple) of float32 / float16 / bfloat16 / float64
leaves of one backend is flattened, a few optimizer steps are applied to the
flat vector with gradients of the same backend flattened against the spec, and
the tree is rebuilt: every leaf keeps its place, type, dtype and shape, equals
its slice of the flat vector, has moved and is finite. The flat vector is the
default float64 (there is a float64 leaf) or forced float32, the common case.
"""

import contextlib

import numpy as np
import pytest

from stalewise import optim, tree
from stalewise.backends import numpy_dtype

# path -> (dtype, shape); the nesting is built by _nest.
LEAVES = {
    ("dense", "w"): ("float32", (3, 2)),
    ("dense", "bias"): ("float16", (2,)),
    ("blocks", 0): ("bfloat16", (4,)),
    ("blocks", 1, 0): ("float64", (2, 2)),
    ("blocks", 1, 1): ("float32", ()),
    ("norm", "scale"): ("bfloat16", (3,)),
    ("head",): ("float16", (2, 1, 2)),
}
STEPS = 3

OPTIMIZERS = {
    "sgd": lambda: optim.sgd(0.1),
    "sgd-nesterov": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda: optim.adam(0.05),
    "adamw": lambda: optim.adamw(0.05, weight_decay=0.01),
    "lamb-exclusions": lambda: optim.lamb(
        0.05,
        weight_decay=0.01,
        exclude_from_weight_decay=("bias", "norm"),
        exclude_from_adaptation=("bias",),
    ),
    # trust_coefficient large enough that a step is visible in bfloat16
    "lars": lambda: optim.lars(1.0, momentum=0.9, trust_coefficient=0.1, weight_decay=1e-3),
    "clip-lamb": lambda: optim.chain(optim.clip_by_global_norm(0.5), optim.lamb(0.05)),
}
BACKENDS = ["numpy", "torch", "jax", "tensorflow"]


def _nest(leaves):
    """{path: leaf} -> {"dense": {...}, "blocks": [bf16, (f64, f32)], "norm": {...}, "head": x}."""
    return {
        "dense": {"w": leaves[("dense", "w")], "bias": leaves[("dense", "bias")]},
        "blocks": [
            leaves[("blocks", 0)],
            (leaves[("blocks", 1, 0)], leaves[("blocks", 1, 1)]),
        ],
        "norm": {"scale": leaves[("norm", "scale")]},
        "head": leaves[("head",)],
    }


def _get(t, path):
    for key in path:
        t = t[key]
    return t


def _make(backend, values, dtype):
    """A leaf of ``backend`` with dtype name ``dtype`` holding ``values`` (float64 NumPy)."""
    if backend == "numpy":
        return values.astype(numpy_dtype(dtype))
    if backend == "torch":
        import torch

        return torch.from_numpy(values.copy()).to(getattr(torch, dtype))
    if backend == "jax":
        import jax.numpy as jnp

        return jnp.asarray(values).astype(dtype)
    import tensorflow as tf

    return tf.cast(tf.constant(values), getattr(tf, dtype))


def _leaf_type(backend):
    if backend == "numpy":
        return np.ndarray
    if backend == "torch":
        import torch

        return torch.Tensor
    if backend == "jax":
        import jax

        return jax.Array
    import tensorflow as tf

    return tf.Tensor


def _dtype_name(backend, x):
    if backend == "torch":
        return str(x.dtype).removeprefix("torch.")
    return x.dtype.name


def _to_numpy(backend, x):
    """The values of ``x`` as NumPy in their own dtype (bfloat16 via ml_dtypes)."""
    if backend == "torch":
        import torch

        if x.dtype == torch.bfloat16:
            return x.float().numpy().astype(numpy_dtype("bfloat16"))
        return x.numpy()
    if backend == "tensorflow":
        return x.numpy()
    return np.asarray(x)


def _random_tree(backend, rng):
    leaves = {
        path: _make(backend, rng.normal(size=shape), dtype)
        for path, (dtype, shape) in LEAVES.items()
    }
    return _nest(leaves)


def _x64(backend):
    """float64 JAX leaves need x64 (see stalewise.backends.jax_); elsewhere a no-op."""
    if backend == "jax":
        import jax

        return jax.enable_x64(True)
    return contextlib.nullcontext()


@pytest.mark.parametrize("flat_dtype", [None, "float32"], ids=["flat-auto", "flat-float32"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_steps_keep_structure_backend_and_dtypes(name, backend, flat_dtype):
    pytest.importorskip({"numpy": "numpy", "tensorflow": "tensorflow"}.get(backend, backend))
    rng = np.random.default_rng(0)
    with _x64(backend):
        params = _random_tree(backend, rng)
        flat, spec = tree.flatten(params, dtype=flat_dtype)
        # one float64 leaf makes the flat vector float64 unless float32 is forced
        assert flat.dtype == np.dtype(flat_dtype or np.float64)
        assert [leaf.backend for leaf in spec.leaves] == [backend] * len(LEAVES)
        start = flat.copy()
        opt = OPTIMIZERS[name]()
        state = opt.init(flat, spec.segments)
        for _ in range(STEPS):
            grads = _random_tree(backend, rng)
            g, same = tree.flatten(grads, spec=spec)
            assert same is spec
            opt.apply(g, state, flat)
        assert np.isfinite(flat).all()
        out = tree.unflatten(flat, spec, copy=True)

    assert isinstance(out, dict) and sorted(out) == ["blocks", "dense", "head", "norm"]
    assert isinstance(out["blocks"], list) and len(out["blocks"]) == 2
    assert isinstance(out["blocks"][1], tuple) and len(out["blocks"][1]) == 2
    assert sorted(out["dense"]) == ["bias", "w"] and list(out["norm"]) == ["scale"]
    by_name = {leaf.name: leaf for leaf in spec.leaves}
    for path, (dtype, shape) in LEAVES.items():
        where = f"{name}/{backend}/{flat.dtype} leaf {path}"
        leaf = _get(out, path)
        assert isinstance(leaf, _leaf_type(backend)), f"{where}: {type(leaf)}"
        assert _dtype_name(backend, leaf) == dtype, where
        assert tuple(leaf.shape) == shape, where
        got = _to_numpy(backend, leaf)
        assert got.dtype == numpy_dtype(dtype), where
        before = _to_numpy(backend, _get(params, path))
        seg = by_name[".".join(str(k) for k in path)]
        sl = slice(seg.offset, seg.offset + seg.size)
        want = flat[sl].reshape(shape).astype(numpy_dtype(dtype))
        np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64), where)
        assert np.isfinite(got.astype(np.float64)).all(), where
        assert not np.array_equal(got, before), f"{where}: did not change"
        assert not np.array_equal(flat[sl], start[sl]), f"{where}: flat slice did not change"
    if name == "lamb-exclusions":
        names = list(spec.segments.names)
        ratios = dict(zip(names, state.trust_ratio.tolist(), strict=True))
        assert ratios["dense.bias"] == 1.0  # excluded from adaptation by name
        assert ratios["dense.w"] != 1.0
