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
from stalewise.tree import (
    AttrKey,
    FlatSpec,
    copy_buffers,
    flatten,
    flatten_measured,
    mark_buffers,
    path_str,
    put_buffers,
    take_buffers,
    unflatten,
    unflatten_into,
)

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
    d = a.copy()  # the same array object under two names would be one tied leaf
    flat1, spec1 = flatten({"b": b, "a": a, "c": {"z": c, 1: d}})
    flat2, spec2 = flatten({"c": {1: d, "z": c}, "a": a, "b": b})
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


# --- buffers and per-worker state ---------------------------------------------------------


class BNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(3, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


def test_torch_module_shares_float_buffers_and_keeps_integer_ones_per_worker() -> None:
    torch.manual_seed(0)
    model = BNNet()
    _, spec = flatten(model)
    assert spec.segments.names == (
        "bn.bias",
        "bn.running_mean",
        "bn.running_var",
        "bn.weight",
        "fc.bias",
        "fc.weight",
    )
    assert spec.buffers == ("bn.running_mean", "bn.running_var")
    assert [leaf.buffer for leaf in spec.leaves] == [False, True, True, False, False, False]
    assert "buffers" in repr(spec)
    model.train()
    model(torch.randn(8, 3)).sum().backward()
    # the torch contract: parameters' gradients and every buffer's value, integers included
    update = {n: p.grad for n, p in model.named_parameters()} | dict(model.named_buffers())
    got, _ = flatten(update, spec=spec)
    leaf = spec.leaves[1]
    np.testing.assert_array_equal(got[leaf.offset : leaf.offset + 4], model.bn.running_mean)
    with pytest.raises(
        ValueError,
        match=r"^params: missing keys 'bn.running_mean', 'bn.running_var' \(buffers: an update "
        r"carries their values after the step\)$",
    ):
        flatten({n: p.grad for n, p in model.named_parameters()}, spec=spec)
    other = BNNet()
    unflatten_into(other, got, spec)
    assert torch.equal(other.bn.running_mean, model.bn.running_mean)
    assert int(other.bn.num_batches_tracked) == 0 and int(model.bn.num_batches_tracked) == 1
    pflat, pspec = flatten(dict(model.named_parameters()))  # a job of the parameters only
    unflatten_into(other, pflat, pspec)  # the model's buffers stay its own
    assert torch.equal(other.bn.running_mean, model.bn.running_mean)


def test_integer_leaves_are_constants_with_keep_integers() -> None:
    sd = BNNet().state_dict()  # plain tensors, num_batches_tracked among them
    with pytest.raises(
        TypeError, match=r"params\['bn.num_batches_tracked'\]: leaf has dtype int64"
    ):
        flatten(sd)
    flat, spec = flatten(sd, keep_integers=True)
    assert "bn.num_batches_tracked" not in spec.segments.names and spec.size == 3 * 4 + 4 + 4 * 4
    back = unflatten(flat, spec)
    assert back["bn.num_batches_tracked"] is sd["bn.num_batches_tracked"]  # as it was
    grads = {k: torch.ones_like(v) for k, v in sd.items() if v.is_floating_point()}
    assert flatten(grads, spec=spec)[0].sum() == spec.size  # may be missing from an update ...
    grads["bn.num_batches_tracked"] = torch.tensor(7)
    assert flatten(grads, spec=spec)[0].sum() == spec.size  # ... or hold anything: not read
    target = BNNet().state_dict()
    target["bn.num_batches_tracked"] += 5
    unflatten_into(target, flat * 2, spec)
    assert int(target["bn.num_batches_tracked"]) == 5  # left alone
    with pytest.raises(TypeError, match="leaf has dtype complex64"):
        flatten({"z": np.zeros(2, np.complex64)}, keep_integers=True)


def test_mark_buffers_and_the_buffer_slots() -> None:
    params = {"w": np.ones(3, np.float32), "bn": {"mean": np.zeros(2, np.float32)}}
    _, spec = flatten(params)
    marked = mark_buffers(spec, [r"\.mean$"])
    assert marked.buffers == ("bn.mean",) and spec.buffers == ()
    with pytest.raises(
        ValueError, match=r"buffers: 'running' matches no leaf \(leaves: bn.mean, w\)"
    ):
        mark_buffers(spec, "running")
    with pytest.raises(ValueError, match=r"buffers: '\(' is not a valid regex"):
        mark_buffers(spec, "(")
    with pytest.raises(TypeError, match="expected regexes"):
        mark_buffers(spec, [3])
    flat = np.arange(5, dtype=np.float32)  # bn.mean (2), then w (3)
    values = take_buffers(flat, marked)
    assert values.tolist() == [0.0, 1.0] and flat.tolist() == [0.0, 0.0, 2.0, 3.0, 4.0]
    put_buffers(flat, values + 10, marked)
    assert flat.tolist() == [10.0, 11.0, 2.0, 3.0, 4.0]
    dst = np.zeros(5, np.float32)
    copy_buffers(dst, flat, marked)
    assert dst.tolist() == [10.0, 11.0, 0.0, 0.0, 0.0]
    assert take_buffers(flat, spec) is None


def test_a_tree_made_by_unflatten_flattens_back_to_its_spec() -> None:
    flat, spec = flatten(BNNet())
    back = unflatten(flat, spec)  # a plain dict: buffers are not visible in it
    again, spec2 = flatten(back)
    assert spec2 is spec and spec2.buffers == ("bn.running_mean", "bn.running_var")
    np.testing.assert_array_equal(again, flat)
    back["extra"] = torch.zeros(1)  # changed since: a spec of its own
    assert flatten(back)[1].buffers == ()


# --- tied leaves ------------------------------------------------------------------------------


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_tied_torch_weights_are_stored_once_and_stay_tied() -> None:
    model = TiedLM()
    flat, spec = flatten(model)
    assert spec.size == 15 and spec.segments.names == ("embed.weight",) and spec.tied == {0}
    _, sd_spec = flatten(model.state_dict())  # two detached tensors on one storage
    assert sd_spec.size == 15 and sd_spec.segments.names == ("embed.weight",)
    back = unflatten(flat, spec)
    assert back["head.weight"] is back["embed.weight"]
    model(torch.tensor([1, 2])).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}  # one name only
    assert list(grads) == ["embed.weight"]
    g, _ = flatten(grads, spec=spec)
    np.testing.assert_array_equal(g, model.embed.weight.grad.numpy().ravel())
    # the same tensor under both names counts once
    g2, _ = flatten(
        {"embed.weight": grads["embed.weight"], "head.weight": grads["embed.weight"]}, spec=spec
    )
    np.testing.assert_array_equal(g2, g)
    other = TiedLM()
    unflatten_into(other, flat + 1, spec)
    assert other.head.weight is other.embed.weight
    np.testing.assert_allclose(other.head.weight.detach().numpy().ravel(), flat + 1)
    with pytest.raises(ValueError, match=r"params\['embed.weight'\]: missing \(a tied leaf"):
        flatten({}, spec=spec)


def test_tied_numpy_arrays_and_jax_values() -> None:
    w = np.ones(3, np.float32)
    _, spec = flatten({"a": w, "b": w, "c": np.ones(3, np.float32)})
    assert spec.segments.names == ("a", "c") and spec.size == 6
    # different arrays under the names of one tied leaf: one gradient per use, added
    g, _ = flatten(
        {"a": np.ones(3, np.float32), "b": np.full(3, 2.0, np.float32), "c": w}, spec=spec
    )
    assert g.tolist() == [3.0] * 3 + [1.0] * 3
    j = jnp.ones(3)
    _, jspec = flatten({"a": j, "b": j})  # an immutable value in two places: two leaves
    assert jspec.segments.names == ("a", "b")


# --- every ecosystem's containers ---------------------------------------------------------------


def test_flax_nnx_module_and_state() -> None:
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self) -> None:
            rngs = nnx.Rngs(0)
            self.linear = nnx.Linear(3, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            return self.drop(self.bn(self.linear(x)))

    model = Net()
    flat, spec = flatten(model)  # its State, without the Dropout's RNG state
    assert spec.segments.names == (
        "bn.bias",
        "bn.mean",
        "bn.scale",
        "bn.var",
        "linear.bias",
        "linear.kernel",
    )
    assert spec.buffers == ("bn.mean", "bn.var")
    assert pickle.loads(pickle.dumps(spec)).segments.names == spec.segments.names
    back = unflatten(flat, spec)
    assert isinstance(back, nnx.State) and isinstance(back["bn"]["mean"], nnx.BatchStat)

    def loss_fn(m: Any) -> Any:
        return (m(jnp.ones((2, 3))) ** 2).mean()

    grads = nnx.grad(loss_fn)(model)  # the Params only
    with pytest.raises(ValueError, match=r"params\['bn'\]: missing keys 'mean', 'var' \(buffers"):
        flatten(grads, spec=spec)
    update = nnx.merge_state(grads, nnx.state(model, nnx.BatchStat))
    g, _ = flatten(update, spec=spec)
    assert np.isfinite(g).all()
    unflatten_into(model, flat + 1, spec)  # through the module's own Variables
    np.testing.assert_array_equal(np.asarray(model.linear.bias.get_value()), np.ones(4))
    _, sspec = flatten(nnx.state(model))  # a State with RNG state: its counts are constants
    assert sspec.segments.names == spec.segments.names
    # nnx.split's (graphdef, state): the graphdef is a constant
    split_flat, split_spec = flatten(nnx.split(model))
    graphdef, state = unflatten(split_flat, split_spec)
    assert isinstance(nnx.merge(graphdef, state), Net) and split_spec.size == spec.size


def test_equinox_module_keeps_its_arrays() -> None:
    import equinox as eqx

    model = eqx.nn.MLP(3, 2, 4, 1, activation=jax.nn.relu, key=jax.random.PRNGKey(0))
    flat, spec = flatten(model)  # the activation functions are filtered out
    assert spec.segments.names == (
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
    )
    spec = pickle.loads(pickle.dumps(spec))
    back = unflatten(flat, spec)
    assert isinstance(back, eqx.nn.MLP) and back.activation is None
    rebuilt = eqx.combine(back, eqx.filter(model, eqx.is_array, inverse=True))
    np.testing.assert_allclose(rebuilt(jnp.ones(3)), model(jnp.ones(3)))
    grads = eqx.filter_grad(lambda m: m(jnp.ones(3)).sum())(model)
    assert flatten(grads, spec=spec)[0].shape == (spec.size,)
    assert flatten(eqx.filter(model, eqx.is_array), spec=spec)[0].tolist() == flat.tolist()


def test_flax_struct_keeps_static_fields() -> None:
    from flax import struct

    @struct.dataclass
    class Params:
        w: Any
        scale: float = struct.field(pytree_node=False, default=2.0)

    flat, spec = flatten(Params(jnp.ones(2)))
    assert spec.segments.names == ("w",)
    back = unflatten(flat + 1, spec)
    assert isinstance(back, Params) and back.scale == 2.0 and back.w.tolist() == [2.0, 2.0]


class Box:
    """A container known to torch's pytree registry only."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner


torch.utils._pytree.register_pytree_node(
    Box, lambda b: ([b.inner], None), lambda children, _: Box(children[0])
)


class Pairs:
    """A container known to TensorFlow's nest protocol only."""

    def __init__(self, a: Any, b: Any) -> None:
        self.a, self.b = a, b

    def __tf_flatten__(self) -> tuple:
        return None, (self.a, self.b)

    @classmethod
    def __tf_unflatten__(cls, metadata: Any, components: tuple) -> Pairs:
        return cls(*components)


def test_torch_and_tensorflow_registries() -> None:
    flat, spec = flatten({"box": Box(torch.ones(2)), "pairs": Pairs(tf.ones(1), tf.zeros(2))})
    assert spec.segments.names == ("box.0", "pairs.0", "pairs.1")
    back = unflatten(flat, spec)
    assert isinstance(back["box"], Box) and back["box"].inner.tolist() == [1.0, 1.0]
    assert isinstance(back["pairs"], Pairs) and back["pairs"].b.numpy().tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match=r"params\['box'\]: expected Box, got list"):
        flatten({"box": [torch.ones(2)], "pairs": back["pairs"]}, spec=spec)


def test_keras_buffers_list_updates_and_variable_lists() -> None:
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, name="h"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dropout(0.1),  # an integer seed state: per worker
            keras.layers.Dense(2, name="o"),
        ],
        name="net",
    )
    _, spec = flatten(model)
    assert spec.buffers == ("bn/moving_mean", "bn/moving_variance")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(np.ones((4, 3), np.float32), training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    with pytest.raises(ValueError, match="followed by its 3 non_trainable_variables"):
        flatten(grads, spec=spec)
    g, _ = flatten(grads + model.non_trainable_variables, spec=spec)  # the Keras contract
    mean = spec.leaves[spec.segments.names.index("bn/moving_mean")]
    np.testing.assert_array_equal(
        g[mean.offset : mean.offset + 4], model.layers[1].moving_mean.numpy()
    )
    vflat, vspec = flatten(model.trainable_variables)  # a list of variables, named by path
    assert vspec.segments.names[:2] == ("net/h/kernel", "net/h/bias")
    assert isinstance(unflatten(vflat, vspec), list)
    assert flatten(grads, spec=vspec)[0].shape == (vspec.size,)
    emb = keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(5, 3)])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(emb(np.array([[1, 1]])))
    (sparse,) = tape.gradient(loss, emb.trainable_variables)
    assert isinstance(sparse, tf.IndexedSlices)
    assert flatten([sparse], spec=flatten(emb.trainable_variables)[1])[0][3:6].tolist() == [2.0] * 3


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


@pytest.mark.parametrize("stream", [False, True])
def test_flatten_sumsq_is_each_ranges_sum_of_squares_across_leaves(monkeypatch, stream):
    import stalewise.tree as tree_mod

    monkeypatch.setattr(tree_mod, "BLOCK", 11)  # blocks that end inside a range
    monkeypatch.setattr(tree_mod, "STREAM", 0 if stream else 1 << 40)
    rng = np.random.default_rng(0)
    shared = torch.tensor(rng.standard_normal(20), dtype=torch.float32)
    params = {
        "a": rng.standard_normal((5, 9)).astype(np.float32),  # a view of a numpy array
        "b": torch.tensor(rng.standard_normal(40), dtype=torch.float32),  # a CPU tensor's view
        "c": rng.standard_normal((9, 6)).astype(np.float32).T,  # not C-contiguous: copied first
        "d": rng.standard_normal(30).astype(np.float16),  # cast: measured once written
        "e": jnp.asarray(rng.standard_normal(25), dtype=jnp.float32),  # another backend
        "t": shared,
        "u": shared,  # tied: its uses summed, then measured
    }
    spec = flatten(params)[1]
    ranges = [(0, 44), (44, 45), (45, 101), (101, spec.size)]  # across leaf boundaries
    out = np.zeros(spec.size, np.float32)
    flat, spec2, sums = flatten_measured(params, ranges, spec=spec, out=out)
    assert flat is out and spec2 is spec
    np.testing.assert_array_equal(flat, flatten(params, spec=spec)[0])
    f64 = flat.astype(np.float64)
    want = [float(f64[lo:hi] @ f64[lo:hi]) for lo, hi in ranges]
    assert sums == pytest.approx(want, rel=1e-6)
    assert flatten_measured(params, [], spec=spec, out=out)[2] == []
    before = out.copy()
    with pytest.raises(ValueError, match=rf"sumsq: \(lo, hi\) ranges within 0..{spec.size}"):
        flatten_measured(params, [(0, 44), (44, spec.size + 1)], spec=spec, out=out)
    np.testing.assert_array_equal(out, before)  # nothing written
    params["b"][3] = np.nan  # element 45 + 3: the third range only
    sums = flatten_measured(params, ranges, spec=spec, out=out)[2]
    assert [np.isnan(s) for s in sums] == [False, False, True, False]
    params["b"][3] = 1e30  # finite, but its square overflows float32
    sums = flatten_measured(params, ranges, spec=spec, out=out)[2]
    assert [np.isinf(s) for s in sums] == [False, False, True, False]
