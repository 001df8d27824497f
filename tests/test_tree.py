"""Tests for stalewise.tree and stalewise.backends: pytrees <-> one flat vector."""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import subprocess
import sys
import tracemalloc
from collections import OrderedDict
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import keras
import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
import torch

from stalewise.backends import backend_of, get_backend, numpy_dtype
from stalewise.tree import AttrKey, FlatSpec, flatten, path_str, unflatten, unflatten_into

BACKENDS = ("numpy", "torch", "jax", "tensorflow")
DTYPES = ("float16", "bfloat16", "float32", "float64")


class Pair(NamedTuple):
    w: Any
    b: Any


@dataclasses.dataclass
class Layer:
    kernel: Any
    bias: Any
    act: str = dataclasses.field(default="relu", metadata={"static": True})


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: Any


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(3, 4)
        self.fc2 = torch.nn.Linear(4, 2)
        self.frozen = torch.nn.Parameter(torch.zeros(5), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def make_leaf(backend: str, values: np.ndarray, dtype: str) -> Any:
    """A leaf of ``backend`` holding ``values`` rounded to ``dtype``."""
    a = values.astype(numpy_dtype(dtype))
    if backend == "numpy":
        return a
    if backend == "torch":
        return torch.from_numpy(a.astype(np.float64)).to(getattr(torch, dtype))
    if backend == "jax":
        return jnp.asarray(a)
    return tf.constant(a)


def as_f64(x: Any) -> np.ndarray:
    return backend_of(x).to_numpy(x).astype(np.float64)


def x64(backend: str, dtype: str) -> contextlib.AbstractContextManager:
    if backend == "jax" and dtype == "float64":
        return jax.enable_x64(True)
    return contextlib.nullcontext()


# --- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_exact(backend: str, dtype: str) -> None:
    rng = np.random.default_rng(0)
    with x64(backend, dtype):
        tree = {
            "a": make_leaf(backend, rng.normal(size=(3, 4)), dtype),
            "b": [
                make_leaf(backend, rng.normal(size=5), dtype),
                make_leaf(backend, rng.normal(size=()), dtype),
            ],
        }
        flat, spec = flatten(tree)
        assert flat.dtype == (np.float64 if dtype == "float64" else np.float32)
        assert flat.shape == (18,) and spec.size == 18 and spec.nbytes == flat.nbytes
        for copy in (False, True):
            back = unflatten(flat, spec, copy=copy)
            for orig, new in ((tree["a"], back["a"]), *zip(tree["b"], back["b"], strict=True)):
                assert backend_of(new).name == backend
                assert backend_of(new).dtype(new) == dtype
                assert backend_of(new).shape(new) == backend_of(orig).shape(orig)
                np.testing.assert_array_equal(as_f64(new), as_f64(orig))
    assert [leaf.backend for leaf in spec.leaves] == [backend] * 3


def test_mixed_backends_in_one_tree() -> None:
    tree = {
        "np": np.ones(2, np.float32),
        "torch": torch.full((3,), 2.0),
        "jax": jnp.full((1, 2), 3.0),
        "tf": tf.fill((2,), 4.0),
    }
    flat, spec = flatten(tree)
    assert flat.tolist() == [3.0, 3.0, 1.0, 1.0, 4.0, 4.0, 2.0, 2.0, 2.0]
    back = unflatten(flat, spec)
    assert isinstance(back["np"], np.ndarray) and isinstance(back["torch"], torch.Tensor)
    assert isinstance(back["jax"], jax.Array) and isinstance(back["tf"], tf.Tensor)


def test_forced_dtype() -> None:
    tree = {"a": np.array([1 + 2**-40], np.float64), "b": np.ones(1, np.float16)}
    flat, spec = flatten(tree, dtype=np.float32)
    assert flat.dtype == np.float32 and spec.leaves[0].dtype == "float64"
    assert unflatten(flat, spec)["a"].tolist() == [1.0]  # rounded, as documented
    flat64, _ = flatten({"b": np.ones(1, np.float32)}, dtype="float64")
    assert flat64.dtype == np.float64
    with pytest.raises(ValueError, match="flat dtype must be float32 or float64, got float16"):
        flatten(tree, dtype=np.float16)


def test_empty_tree_and_scalar_leaf() -> None:
    flat, spec = flatten({"a": None, "b": []})
    assert flat.shape == (0,) and flat.dtype == np.float32 and spec.size == 0
    assert unflatten(flat, spec) == {"a": None, "b": []}
    flat, spec = flatten(np.float32(2.5))
    assert spec.leaves[0].name == "params" and spec.leaves[0].shape == ()
    back = unflatten(flat, spec)
    assert isinstance(back, np.ndarray) and back.shape == () and back == 2.5


# --- containers, order, names --------------------------------------------------------------


def test_every_container_kind() -> None:
    f = np.float32
    tree = {
        "dict": {"y": np.full(2, 1, f), "x": np.full(1, 2, f)},
        "list": [np.full(1, 3, f), None, (np.full(2, 4, f),)],
        "nt": Pair(w=np.full((2, 2), 5, f), b=np.full(1, 6, f)),
        "dc": Layer(kernel=np.full(3, 7, f), bias=np.full(1, 8, f), act="gelu"),
        "frozen": Frozen(x=np.full(1, 9, f)),
        "od": OrderedDict(b=np.full(1, 10, f)),
        "none": None,
    }
    flat, spec = flatten(tree)
    assert spec.segments.names == (
        "dc.kernel",
        "dc.bias",
        "dict.x",
        "dict.y",
        "frozen.x",
        "list.0",
        "list.2.0",
        "nt.w",
        "nt.b",
        "od.b",
    )
    assert spec.leaves[0].path == ("dc", AttrKey("kernel"))
    back = unflatten(flat, spec, copy=True)
    assert isinstance(back["nt"], Pair) and isinstance(back["dc"], Layer)
    assert isinstance(back["frozen"], Frozen) and isinstance(back["od"], OrderedDict)
    assert back["dc"].act == "gelu" and back["none"] is None
    assert back["list"][1] is None and isinstance(back["list"][2], tuple)
    flat2, _ = flatten(back, spec=spec)
    np.testing.assert_array_equal(flat2, flat)
    np.testing.assert_array_equal(back["dict"]["y"], tree["dict"]["y"])
    np.testing.assert_array_equal(back["nt"].w, tree["nt"].w)


def test_dict_order_does_not_depend_on_insertion() -> None:
    rng = np.random.default_rng(1)
    a, b, c = (rng.normal(size=n).astype(np.float32) for n in (2, 3, 4))
    flat1, spec1 = flatten({"b": b, "a": a, "c": {"z": c, 1: a}})
    flat2, spec2 = flatten({"c": {1: a, "z": c}, "a": a, "b": b})
    assert spec1 == spec2
    np.testing.assert_array_equal(flat1, flat2)
    assert spec1.segments.names == ("a", "b", "c.1", "c.z")
    assert list(spec1.segments.offsets) == [0, 2, 5, 7]


def test_path_str_and_names() -> None:
    assert path_str(("layer1", "w")) == "params['layer1']['w']"
    assert path_str((0, "bias")) == "params[0]['bias']"
    assert path_str(("enc", AttrKey("w"), 2), root="grads") == "grads['enc'].w[2]"
    _, spec = flatten([{"bias": np.zeros(1)}])
    assert spec.leaves[0].name == "0.bias" and spec.leaves[0].path == (0, "bias")


def test_spec_is_picklable() -> None:
    tree = {"nt": Pair(np.ones(2), np.ones(1)), "dc": Layer(np.ones(3), np.ones(1))}
    flat, spec = flatten(tree)
    _ = spec.segments  # a cached segment table pickles too
    spec2 = pickle.loads(pickle.dumps(spec))
    assert isinstance(spec2, FlatSpec) and spec2 == spec
    assert spec2.segments.names == spec.segments.names
    assert isinstance(unflatten(flat, spec2)["nt"], Pair)
    _, mspec = flatten(MLP())
    assert pickle.loads(pickle.dumps(mspec)) == mspec


# --- zero copy ------------------------------------------------------------------------------


def test_unflatten_views_share_memory() -> None:
    tree = {"w": np.ones((2, 3), np.float32), "h": np.ones(2, np.float16), "t": torch.ones(4)}
    flat, spec = flatten(tree)
    back = unflatten(flat, spec)
    assert np.shares_memory(back["w"], flat)
    assert not np.shares_memory(back["h"], flat)  # other dtype: a copy
    start = flat.ctypes.data
    assert start <= back["t"].data_ptr() < start + flat.nbytes
    flat[:] = 7.0
    assert back["w"][0, 0] == 7.0 and back["t"][0].item() == 7.0 and back["h"][0] == 1.0
    copied = unflatten(flat, spec, copy=True)
    assert not np.shares_memory(copied["w"], flat)
    assert not start <= copied["t"].data_ptr() < start + flat.nbytes


def test_unflatten_never_aliases_immutable_leaves() -> None:
    flat, spec = flatten({"j": jnp.ones(3), "t": tf.ones(3)})
    back = unflatten(flat, spec)
    flat[:] = 5.0
    assert float(back["j"][0]) == 1.0 and float(back["t"][0]) == 1.0


def test_torch_float64_view_and_read_only_flat() -> None:
    flat, spec = flatten({"t": torch.ones(3, dtype=torch.float64)})
    assert flat.dtype == np.float64
    assert unflatten(flat, spec)["t"].data_ptr() == flat.ctypes.data
    flat.flags.writeable = False  # e.g. a read-only shared-memory snapshot: copied, no warning
    t = unflatten(flat, spec)["t"]
    assert t.data_ptr() != flat.ctypes.data and t.tolist() == [1.0, 1.0, 1.0]


def test_flatten_into_out_reuses_buffer() -> None:
    params = {"w": np.ones((512, 512), np.float32), "b": np.ones(512, np.float32)}
    flat, spec = flatten(params)
    buf = np.empty_like(flat)
    grads = {"w": np.full((512, 512), 2.0, np.float32), "b": np.full(512, 3.0, np.float32)}
    tracemalloc.start()
    try:
        got, spec2 = flatten(grads, spec=spec, out=buf)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got is buf and spec2 is spec
    assert peak < spec.nbytes // 10, peak
    assert buf[0] == 3.0 and buf[-1] == 2.0


def test_flatten_out_torch_requires_grad() -> None:
    model = MLP()
    flat, spec = flatten(model)
    buf = np.zeros_like(flat)
    assert flatten(model, spec=spec, out=buf)[0] is buf
    np.testing.assert_array_equal(buf, flat)
    w = model.fc1.weight
    assert w.requires_grad
    leaf = spec.leaves[1]
    assert leaf.name == "fc1.weight"
    np.testing.assert_array_equal(buf[leaf.offset : leaf.offset + 12], w.detach().numpy().ravel())


def test_out_must_fit() -> None:
    _, spec = flatten({"a": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"out has shape \(4,\), expected \(3,\)"):
        flatten({"a": np.zeros(3, np.float32)}, spec=spec, out=np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="out has dtype float64, expected float32"):
        flatten({"a": np.zeros(3, np.float32)}, spec=spec, out=np.zeros(3))


# --- validation against a spec ---------------------------------------------------------------


@pytest.fixture
def spec() -> FlatSpec:
    params = {"layer1": {"w": np.zeros((64, 32), np.float32), "b": np.zeros(32, np.float32)}}
    return flatten(params)[1]


def test_shape_mismatch(spec: FlatSpec) -> None:
    grads = {"layer1": {"w": np.zeros((32, 64), np.float32), "b": np.zeros(32, np.float32)}}
    with pytest.raises(
        ValueError, match=r"params\['layer1'\]\['w'\]: expected shape \(64, 32\), got \(32, 64\)"
    ):
        flatten(grads, spec=spec)


def test_dtype_mismatch(spec: FlatSpec) -> None:
    grads = {"layer1": {"w": np.zeros((64, 32), np.float64), "b": np.zeros(32, np.float32)}}
    with pytest.raises(
        TypeError, match=r"params\['layer1'\]\['w'\]: expected dtype float32, got float64"
    ):
        flatten(grads, spec=spec)


def test_missing_and_unexpected_keys(spec: FlatSpec) -> None:
    with pytest.raises(ValueError, match=r"params\['layer1'\]: missing key 'b'$"):
        flatten({"layer1": {"w": np.zeros((64, 32), np.float32)}}, spec=spec)
    extra = {"w": np.zeros((64, 32), np.float32), "b": np.zeros(32, np.float32), "c": None}
    with pytest.raises(ValueError, match=r"params\['layer1'\]: unexpected key 'c'$"):
        flatten({"layer1": extra}, spec=spec)


def test_structure_mismatch(spec: FlatSpec) -> None:
    with pytest.raises(ValueError, match=r"params\['layer1'\]: expected dict, got list"):
        flatten({"layer1": [np.zeros(32, np.float32)]}, spec=spec)
    with pytest.raises(
        ValueError, match=r"params\['layer1'\]\['b'\]: expected an array leaf, got NoneType"
    ):
        flatten({"layer1": {"w": np.zeros((64, 32), np.float32), "b": None}}, spec=spec)
    _, lspec = flatten([np.zeros(1), Pair(np.zeros(1), np.zeros(1))])
    with pytest.raises(ValueError, match=r"params: expected list of length 2, got length 1"):
        flatten([np.zeros(1)], spec=lspec)
    with pytest.raises(ValueError, match=r"params\[1\]: expected namedtuple Pair, got tuple"):
        flatten([np.zeros(1), (np.zeros(1), np.zeros(1))], spec=lspec)
    with pytest.raises(ValueError, match=r"params\[1\]\.w: expected an array leaf, got dict"):
        flatten([np.zeros(1), Pair({}, np.zeros(1))], spec=lspec)


def test_gradients_of_another_backend_validate(spec: FlatSpec) -> None:
    grads = {"layer1": {"w": jnp.ones((64, 32)), "b": torch.ones(32)}}
    flat, _ = flatten(grads, spec=spec)
    assert flat.sum() == 64 * 32 + 32


@pytest.mark.parametrize(
    ("leaf", "dtype"),
    [
        (np.zeros(3, np.int64), "int64"),
        (np.zeros(3, bool), "bool"),
        (np.zeros(3, np.complex64), "complex64"),
        (torch.zeros(3, dtype=torch.int32), "int32"),
        (jnp.zeros(3, jnp.int32), "int32"),
        (tf.zeros(3, tf.int32), "int32"),
    ],
)
def test_non_floating_leaf_refused(leaf: Any, dtype: str) -> None:
    with pytest.raises(
        TypeError, match=rf"params\['step'\]: leaf has dtype {dtype}; only floating"
    ):
        flatten({"w": np.zeros(2, np.float32), "step": leaf})


def test_unsupported_objects_refused() -> None:
    with pytest.raises(TypeError, match=r"params\['lr'\]: python float is not an array leaf"):
        flatten({"lr": 0.1})
    with pytest.raises(TypeError, match=r"params\[0\]: cannot flatten str"):
        flatten(["relu"])
    with pytest.raises(ValueError, match="not distinct as strings"):
        flatten({1: np.zeros(1), "1": np.zeros(1)})


def test_wrong_flat_length(spec: FlatSpec) -> None:
    _, small = flatten({"a": np.zeros((3, 4), np.float32)})
    with pytest.raises(ValueError, match=r"^flat vector has 10 elements, spec expects 12$"):
        unflatten(np.zeros(10, np.float32), small)
    with pytest.raises(ValueError, match="flat vector has 10 elements, spec expects 12"):
        unflatten_into({"a": np.zeros((3, 4), np.float32)}, np.zeros(10, np.float32), small)
    with pytest.raises(ValueError, match="must be 1-D"):
        unflatten(np.zeros((3, 4), np.float32), small)


# --- in place -------------------------------------------------------------------------------


def test_unflatten_into_numpy_and_mixed() -> None:
    target = {
        "n": np.zeros(2, np.float32),
        "h": np.zeros(2, np.float16),
        "bf": np.zeros(2, ml_dtypes.bfloat16),
        "t": torch.zeros(2, dtype=torch.bfloat16, requires_grad=True),
        "v": tf.Variable(np.zeros(2, np.float32)),
    }
    _, spec = flatten(target)
    flat = np.arange(10, dtype=np.float32)
    unflatten_into(target, flat, spec)
    out, _ = flatten(target, spec=spec)
    np.testing.assert_array_equal(out, flat)
    assert target["t"].requires_grad


def test_unflatten_into_refuses_immutable_before_writing() -> None:
    target = {"a": np.zeros(2, np.float32), "b": jnp.zeros(2)}
    _, spec = flatten(target)
    with pytest.raises(TypeError, match=r"params\['b'\]: .* cannot be written in place"):
        unflatten_into(target, np.ones(4, np.float32), spec)
    assert target["a"].tolist() == [0.0, 0.0]
    with pytest.raises(TypeError, match=r"params\['b'\]: .* cannot be written in place"):
        unflatten_into(
            {"a": np.zeros(2, np.float32), "b": tf.zeros(2)}, np.ones(4, np.float32), spec
        )


# --- models ---------------------------------------------------------------------------------


def test_torch_module_round_trip_and_unflatten_into() -> None:
    torch.manual_seed(0)
    model = MLP()
    flat, spec = flatten(model)
    assert spec.segments.names == ("fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight")
    assert spec.size == 4 + 12 + 2 + 8  # the frozen parameter is not trainable
    back = unflatten(flat, spec)
    assert set(back) == {"fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"}
    assert torch.equal(back["fc2.weight"], model.fc2.weight.detach())

    model(torch.ones(1, 3)).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    gflat, _ = flatten(grads, spec=spec)
    new = flat - 0.1 * gflat
    unflatten_into(model, new, spec)
    np.testing.assert_array_equal(flatten(model, spec=spec)[0], new)
    assert model.fc1.weight.requires_grad and model.fc1.weight.grad is not None

    other = MLP()
    unflatten_into(other, new, spec)
    assert torch.equal(other.fc2.bias, model.fc2.bias)


def test_keras_model_round_trip_and_unflatten_into() -> None:
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, name="hidden"), keras.layers.Dense(2, name="out")]
    )
    flat, spec = flatten(model)
    assert spec.segments.names == ("hidden/bias", "hidden/kernel", "out/bias", "out/kernel")
    assert spec.size == 4 + 12 + 2 + 8
    back = unflatten(flat, spec)
    assert isinstance(back["hidden/kernel"], tf.Tensor)
    np.testing.assert_array_equal(back["out/kernel"].numpy(), model.layers[1].kernel.numpy())
    new = np.arange(spec.size, dtype=np.float32)
    unflatten_into(model, new, spec)
    np.testing.assert_array_equal(flatten(model, spec=spec)[0], new)
    assert model.layers[0].bias.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]


def test_tf_module_named_by_attribute_path() -> None:
    class Net(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = [tf.Variable(tf.ones((2, 2))), tf.Variable(tf.ones(2))]
            self.scale = tf.Variable(2.0, trainable=False)

    net = Net()
    flat, spec = flatten(net)
    assert spec.segments.names == ("layers.0", "layers.1")
    unflatten_into(net, flat * 3, spec)
    assert net.layers[1].numpy().tolist() == [3.0, 3.0]


# --- backends -------------------------------------------------------------------------------


def test_backend_of() -> None:
    assert backend_of(MLP()).name == "torch"
    assert backend_of(torch.nn.Parameter(torch.ones(1))).name == "torch"
    assert backend_of(jnp.ones(1)).name == "jax"
    assert backend_of(tf.Variable(1.0)).name == "tensorflow"
    assert backend_of({"a": 1}) is None and backend_of(Pair(1, 2)) is None
    with pytest.raises(ValueError, match="unknown backend 'mxnet'"):
        get_backend("mxnet")


def test_import_loads_no_framework() -> None:
    code = (
        "import sys, stalewise.tree, numpy as np; stalewise.tree.flatten({'a': np.ones(2)}); "
        "print(sorted(m for m in ('torch', 'jax', 'tensorflow', 'keras') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
