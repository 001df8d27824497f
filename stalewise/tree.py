"""Pytrees of NumPy, PyTorch, JAX or TensorFlow arrays <-> one flat vector (:func:`flatten`,
:func:`unflatten`, :func:`unflatten_into`); containers, models, leaves, dtypes: docs/models.md."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import itertools
import logging
import math
import platform
import re
import sys
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from stalewise.backends import (
    FLOAT_DTYPES,
    Backend,
    ModelState,
    backend_of,
    containers,
    get_backend,
)
from stalewise.backends.base import dtype_name
from stalewise.segments import Segments

logger = logging.getLogger(__name__)

BLOCK = 1 << 20  # elements measured by one dot product (float32 sums of 1M: 2e-6 relative)
STREAM = 2 << 20  # bytes of a flat vector from which a measured copy streams past the cache

__all__ = ["AttrKey", "FlatSpec", "HiddenKey", "LeafSpec", "TreeDef"]
__all__ += ["copy_buffers", "flatten", "flatten_measured", "mark_buffers", "path_str"]
__all__ += ["put_buffers", "take_buffers", "unflatten", "unflatten_into", "views_into"]


class AttrKey(str):
    """A key path entry that is an attribute (namedtuple or dataclass field), shown as ``.name``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


class HiddenKey(AttrKey):
    """An attribute left out of leaf names (the ``value`` of a flax nnx Variable)."""

    __slots__ = ()


def path_str(path: tuple, root: str = "params") -> str:
    """A key path as Python-like access syntax, e.g. ``params['layer1'].bias``, for error messages."""
    return root + "".join(f".{e}" if isinstance(e, AttrKey) else f"[{e!r}]" for e in path)


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """Where one stored leaf lives in the flat vector."""

    path: tuple  # key path entries, e.g. ("layer1", "w") or (0, AttrKey("bias"))
    name: str  # dotted name, e.g. "layer1.w" ("params" for a tree that is one leaf)
    shape: tuple[int, ...]
    dtype: str  # "float16" | "bfloat16" | "float32" | "float64"
    backend: str  # "numpy" | "torch" | "jax" | "tensorflow"
    offset: int  # start in the flat vector
    size: int  # number of elements
    buffer: bool = False  # non-trainable state: an update carries its value, not a gradient


class TreeDef(NamedTuple):
    """The structure of a tree without its leaves (opaque; picklable when its classes are)."""

    kind: str
    keys: tuple = ()  # dict keys in flattening order, field names, or list/tuple indices
    children: tuple[TreeDef, ...] = ()
    cls: type | None = None  # dict or OrderedDict, the namedtuple, dataclass or registered type
    static: tuple = ()  # (name, value) pairs: static dataclass fields, or what the kind needs


_LEAF = TreeDef("leaf")
_NONE = TreeDef("none")


def _static(node: TreeDef, name: str, default: Any = None) -> Any:
    return dict(node.static).get(name, default)


def _walk(node: TreeDef) -> Iterator[TreeDef]:
    yield node
    for child in node.children:
        yield from _walk(child)


@dataclasses.dataclass(frozen=True, repr=False)
class FlatSpec:
    """Everything needed to rebuild a tree from its flat vector; picklable."""

    leaves: tuple[LeafSpec, ...]
    treedef: TreeDef
    dtype: np.dtype  # dtype of the flat vector
    size: int  # total number of elements

    @functools.cached_property
    def segments(self) -> Segments:
        """The per-leaf segment table (names, offsets, sizes)."""
        return Segments.from_sizes([x.name for x in self.leaves], [x.size for x in self.leaves])

    @functools.cached_property
    def buffers(self) -> tuple[str, ...]:
        """The names of the buffer leaves, in order."""
        return tuple(leaf.name for leaf in self.leaves if leaf.buffer)

    @functools.cached_property
    def tied(self) -> frozenset[int]:
        """The indices of the leaves stored once for several names."""
        return frozenset(_static(n, "leaf") for n in _walk(self.treedef) if n.kind == "alias")

    @functools.cached_property
    def _buffer_slices(self) -> tuple[slice, ...]:
        return tuple(slice(x.offset, x.offset + x.size) for x in self.leaves if x.buffer)

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __repr__(self) -> str:
        extra = f", {len(self.buffers)} buffers" if self.buffers else ""
        return (
            f"FlatSpec({len(self.leaves)} leaves, size={self.size}, dtype={self.dtype.name}{extra})"
        )


class _Leaf(NamedTuple):
    path: tuple
    x: Any
    backend: Backend
    buffer: bool = False
    label: str | None = None  # its name, when not the dotted key path
    holder: Any = None  # an nnx Variable to write it through


class _Split(NamedTuple):
    kind: str
    cls: type | None
    keys: tuple
    children: tuple
    static: tuple = ()
    level: containers.Level | None = None  # for a registered container


def _view(x: Any) -> tuple[Backend | None, Any, ModelState | None]:
    """(backend, x, None) for a leaf, (None, x, its state) for a model, (None, x, None) else."""
    backend = None if x is None else backend_of(x)
    if backend is not None:
        if backend.is_leaf(x):
            return backend, x, None
        return None, x, backend.model_state(x)
    view = containers.model_view(x)
    return None, x if view is None else view, None


def _key(entry: tuple[str, Any]) -> Any:
    kind, value = entry
    if kind == "hidden":
        return HiddenKey(value)
    return AttrKey(value) if kind == "attr" else value


def _split(x: Any, path: tuple) -> _Split:
    """One level of a container: its kind, class, keys, children and static fields."""
    if x is None:
        return _Split("none", None, (), ())
    if isinstance(x, dict):
        keys = sorted(x, key=str)
        if len({str(k) for k in keys}) != len(keys):
            raise ValueError(f"{path_str(path)}: dict keys {keys} are not distinct as strings")
        cls = type(x) if type(x) in (dict, OrderedDict) else dict
        return _Split("dict", cls, tuple(keys), tuple(x[k] for k in keys))
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):
        return _Split("namedtuple", type(x), tuple(AttrKey(f) for f in x._fields), tuple(x))
    if isinstance(x, list | tuple):
        return _Split(type(x).__name__, None, tuple(range(len(x))), tuple(x))
    level = containers.split(x)
    if level is not None:
        static = (("via", level.via), ("template", level.template))
        keys = tuple(_key(k) for k in level.keys)
        return _Split("registry", level.cls, keys, level.children, static, level)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        keys, values, static = [], [], []
        for f in dataclasses.fields(x):
            if f.metadata.get("static"):
                static.append((f.name, getattr(x, f.name)))
            else:
                keys.append(AttrKey(f.name))
                values.append(getattr(x, f.name))
        return _Split("dataclass", type(x), tuple(keys), tuple(values), tuple(static))
    if isinstance(x, bool | int | float | complex):
        raise TypeError(
            f"{path_str(path)}: python {type(x).__name__} is not an array leaf; use a 0-d "
            "array such as np.float32(x), or a static dataclass field for constants"
        )
    raise TypeError(
        f"{path_str(path)}: cannot flatten {type(x).__qualname__}; containers are dict, list, "
        "tuple, namedtuple, dataclass, None and those registered with JAX, torch or tf.nest; "
        "leaves NumPy/torch/JAX/TensorFlow arrays"
    )


class _Builder:
    def __init__(self) -> None:
        self.found: list[_Leaf] = []
        self.seen: dict[Any, int] = {}  # identity of a mutable leaf -> its index in found
        self.nonfloat: list[tuple[tuple, str]] = []  # (path, dtype) in built-in containers


def _build(
    x: Any,
    path: tuple,
    b: _Builder,
    *,
    lenient: bool = False,
    buffer: bool = False,
    holder: Any = None,
    label: str | None = None,
) -> TreeDef:
    """The treedef of ``x``; stored leaves go to ``b`` (``lenient``: in a registered container)."""
    backend, x, model = _view(x)
    if backend is not None and (dtype := backend.dtype(x)) not in FLOAT_DTYPES:
        if not lenient:
            b.nonfloat.append((path, dtype))
        return TreeDef("const", static=(("value", x),))
    if backend is not None:
        key, index = backend.identity(x), len(b.found)
        if key is not None and b.seen.setdefault(key, index) != index:
            return TreeDef("alias", static=(("leaf", b.seen[key]),))
        b.found.append(_Leaf(path, x, backend, buffer, label, holder))
        return _LEAF
    if containers.is_static(x):
        return TreeDef("const", static=(("value", x),))
    if model is not None:
        keys = tuple(sorted(model.leaves, key=str))
        children = tuple(
            _build(model.leaves[k], (*path, k), b, buffer=k in model.buffers) for k in keys
        )
        static = (
            ("local", tuple(sorted(model.local))),
            ("order", model.order),
            ("buffers", tuple(sorted(model.buffers))),
        )
        return TreeDef("dict", keys, children, dict, static)
    try:
        node = _split(x, path)
    except TypeError:
        if lenient:  # not an array: filtered out, as eqx.filter(tree, eqx.is_array) does
            return TreeDef("const", static=(("value", None),))
        raise
    if node.kind == "none":
        return _NONE
    # a list of TensorFlow variables: their own names, if every one has a distinct one
    kids = node.children if node.kind in ("list", "tuple") else ()
    labels = [None if (bk := backend_of(v)) is None else bk.label(v) for v in kids]
    if None in labels or len(set(labels)) < len(labels):
        labels = None
    level = node.level
    children = tuple(
        _build(
            v,
            (*path, k),
            b,
            lenient=lenient or level is not None,
            buffer=level is not None and level.buffer,
            holder=None if level is None else level.holder,
            label=labels[i] if labels else None,
        )
        for i, (k, v) in enumerate(zip(node.keys, node.children, strict=True))
    )
    return TreeDef(node.kind, node.keys, children, node.cls, node.static)


def _nonfloat_error(path: tuple, dtype: str) -> TypeError:
    return TypeError(
        f"{path_str(path)}: leaf has dtype {dtype}; only floating leaves "
        f"({', '.join(FLOAT_DTYPES)}) are trainable, integer, bool and complex ones are not"
    )


class _Matcher:
    def __init__(self, spec: FlatSpec) -> None:
        self.spec = spec
        self.leaves: list[list[_Leaf]] = [[] for _ in spec.leaves]
        self.next = 0  # the index of the next stored leaf in order


def _describe(node: TreeDef) -> str:
    if node.kind in ("leaf", "alias"):
        return "an array leaf"
    if node.kind == "none":
        return "None"
    if node.cls is not None and node.kind == "registry":
        return node.cls.__qualname__
    if node.cls is not None and node.kind != "dict":
        return f"{node.kind} {node.cls.__qualname__}"
    return node.kind


def _count(node: TreeDef) -> int:
    if node.kind == "leaf":
        return 1
    return sum(_count(c) for c in node.children)


def _match(x: Any, path: tuple, node: TreeDef, m: _Matcher, holder: Any = None) -> None:
    """Collects the leaves of ``x`` into ``m``, checking that its structure is ``node``."""
    if node.kind == "const":
        return  # per-worker state: whatever the tree holds there is not read
    backend, x, model = _view(x)
    if node.kind in ("leaf", "alias"):
        if backend is None:
            got = "a model" if model is not None else type(x).__qualname__
            raise ValueError(f"{path_str(path)}: expected an array leaf, got {got}")
        if node.kind == "alias":
            index = _static(node, "leaf")
        else:
            index, m.next = m.next, m.next + 1
        m.leaves[index].append(_Leaf(path, x, backend, holder=holder))
        return
    if backend is not None:
        raise ValueError(f"{path_str(path)}: expected {_describe(node)}, got an array leaf")
    if model is not None:
        if node.kind != "dict":
            raise ValueError(f"{path_str(path)}: expected {_describe(node)}, got a model")
        # a model's buffers that the spec does not share (a job of its parameters) are its own
        _match_keyed(model.leaves, path, node, m, None, model.local | model.buffers)
        return
    if node.kind == "dict" and _static(node, "order") and isinstance(x, list | tuple):
        x = _by_order(x, path, node)
    split = _split(x, path)
    if split.kind != node.kind or (
        node.kind in ("namedtuple", "dataclass", "registry") and split.cls is not node.cls
    ):
        got = type(x).__qualname__
        raise ValueError(f"{path_str(path)}: expected {_describe(node)}, got {got}")
    if node.kind in ("dict", "registry"):
        inner = None if split.level is None else split.level.holder
        _match_keyed(dict(zip(split.keys, split.children, strict=True)), path, node, m, inner)
        return
    if len(split.children) != len(node.children):
        want = f"{node.kind} of length {len(node.children)}"
        raise ValueError(f"{path_str(path)}: expected {want}, got length {len(split.children)}")
    for k, v, child in zip(node.keys, split.children, node.children, strict=True):
        _match(v, (*path, k), child, m)


def _match_keyed(
    items: dict, path: tuple, node: TreeDef, m: _Matcher, holder: Any, local: Iterable = ()
) -> None:
    """Matches a mapping by key; tied leaves, constants and ``local`` keys are optional."""
    if len(items) == len(node.keys) and all(k in items for k in node.keys):  # the usual case
        for k, child in zip(node.keys, node.children, strict=True):
            _match(items[k], (*path, k), child, m, holder)
        return
    ignored = {str(k) for k in local} | set(_static(node, "local", ()))
    wanted = set(node.keys)
    extra = [k for k in items if k not in wanted and str(k) not in ignored]
    missing, buffers, start = [], False, m.next
    for k, child in zip(node.keys, node.children, strict=True):
        optional = child.kind in ("const", "alias") or (
            child.kind == "leaf" and start in m.spec.tied
        )
        count = _count(child)
        if k not in items and not optional:
            missing.append(k)
            buffers |= any(x.buffer for x in m.spec.leaves[start : start + count])
        start += count
    if missing or extra:
        problems = [_keys_msg("missing", missing), _keys_msg("unexpected", extra)]
        hint = " (buffers: an update carries their values after the step)" if buffers else ""
        raise ValueError(f"{path_str(path)}: " + "; ".join(p for p in problems if p) + hint)
    for k, child in zip(node.keys, node.children, strict=True):
        if k in items:
            _match(items[k], (*path, k), child, m, holder)
        else:
            m.next += _count(child)


def _by_order(values: list | tuple, path: tuple, node: TreeDef) -> dict:
    """A model's update given as a list (Keras), by name."""
    order, local = _static(node, "order"), set(_static(node, "local", ()))
    buffers = set(_static(node, "buffers", ()))
    trainable = [n for n in order if n not in local and n not in buffers]
    if len(values) == len(order):
        names = order
    elif len(values) == len(trainable) and not buffers:
        names = trainable
    else:
        then = (
            f" followed by its {len(order) - len(trainable)} non_trainable_variables "
            "(the buffers' values after the step)"
            if buffers
            else ""
        )
        raise ValueError(
            f"{path_str(path)}: a list for this model holds the gradients of its "
            f"{len(trainable)} trainable_variables{then}; got {len(values)} items"
        )
    return {n: v for n, v in zip(names, values, strict=True) if n not in local}


def _keys_msg(what: str, keys: list) -> str:
    plural = "s" if len(keys) > 1 else ""
    return f"{what} key{plural} " + ", ".join(repr(k) for k in keys) if keys else ""


def _collect(tree: Any, spec: FlatSpec) -> list[list[_Leaf]]:
    """The values ``tree`` holds for each stored leaf of ``spec`` (each array once), checked."""
    m = _Matcher(spec)
    _match(tree, (), spec.treedef, m)
    out = []
    for leaf, found in zip(spec.leaves, m.leaves, strict=True):
        if not found:
            raise ValueError(
                f"{path_str(leaf.path)}: missing (a tied leaf: give it under any name)"
            )
        keys = [f.backend.identity(f.x) for f in found] if len(found) > 1 else [None]
        # a tied leaf under several names: each array once
        unique = [f for i, f in enumerate(found) if keys[i] is None or keys[i] not in keys[:i]]
        for f in unique:
            shape, dtype = f.backend.shape(f.x), f.backend.dtype(f.x)
            if shape != leaf.shape:
                raise ValueError(f"{path_str(f.path)}: expected shape {leaf.shape}, got {shape}")
            if dtype not in FLOAT_DTYPES:
                raise _nonfloat_error(f.path, dtype)
            if dtype != leaf.dtype:
                raise TypeError(f"{path_str(f.path)}: expected dtype {leaf.dtype}, got {dtype}")
        out.append(unique)
    return out


# -- a tree made by unflatten remembers its spec ------------------------------------------

_MADE: dict[int, tuple[weakref.ref, FlatSpec]] = {}  # id of a tree's first leaf -> its spec


def _forget(key: int, ref: weakref.ref) -> None:
    if _MADE.get(key, (None,))[0] is ref:
        del _MADE[key]


# -- the public functions ------------------------------------------------------------------


def _segment(flat: np.ndarray, leaf: LeafSpec) -> np.ndarray:
    return flat[leaf.offset : leaf.offset + leaf.size].reshape(leaf.shape)


def _check_flat(flat: Any, spec: FlatSpec) -> np.ndarray:
    flat = np.asarray(flat)
    if flat.ndim != 1:
        raise ValueError(f"flat vector must be 1-D, got shape {flat.shape}")
    if flat.size != spec.size:
        raise ValueError(f"flat vector has {flat.size} elements, spec expects {spec.size}")
    if dtype_name(flat.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"flat vector has dtype {flat.dtype}, expected {spec.dtype}")
    return flat


def _new_spec(tree: Any, dtype: Any, keep_integers: bool) -> tuple[FlatSpec, list[list[_Leaf]]]:
    b = _Builder()
    treedef = _build(tree, (), b)
    entry = _MADE.get(id(b.found[0].x)) if b.found else None  # a tree unflatten made
    made = None if entry is None or entry[0]() is not b.found[0].x else entry[1]
    if made is not None and (dtype is None or np.dtype(dtype) == made.dtype):
        with contextlib.suppress(TypeError, ValueError):  # changed since: a spec of its own
            return made, _collect(tree, made)
    for path, leaf_dtype in b.nonfloat:
        if not keep_integers or leaf_dtype.startswith("complex"):
            raise _nonfloat_error(path, leaf_dtype)
    if dtype is not None and np.dtype(dtype) not in (np.float32, np.float64):
        raise ValueError(f"flat dtype must be float32 or float64, got {np.dtype(dtype)}")
    leaves, offset = [], 0
    for f in b.found:
        shape = f.backend.shape(f.x)
        name = f.label or ".".join(str(e) for e in f.path if not isinstance(e, HiddenKey))
        leaves.append(LeafSpec(f.path, name or "params", shape, f.backend.dtype(f.x),
                               f.backend.name, offset, math.prod(shape), f.buffer))  # fmt: skip
        offset += leaves[-1].size
    wide = any(leaf.dtype == "float64" for leaf in leaves)
    flat_dtype = np.dtype(dtype if dtype is not None else np.float64 if wide else np.float32)
    logger.debug("flat spec: %d leaves, %d elements, %s", len(leaves), offset, flat_dtype)
    return FlatSpec(tuple(leaves), treedef, flat_dtype, offset), [[f] for f in b.found]


def flatten(
    tree: Any,
    *,
    spec: FlatSpec | None = None,
    out: np.ndarray | None = None,
    dtype: Any = None,
    keep_integers: bool = False,
) -> tuple[np.ndarray, FlatSpec]:
    """``(flat, spec)``: the leaves of ``tree`` (any backend's pytree, or a model) in one vector.

    ``spec``: one ``tree`` must match, returned as is; ``out``: a vector to fill; ``dtype``:
    force float32 or float64; ``keep_integers``: keep integer leaves as constants."""
    return _flatten(tree, spec, out, dtype, keep_integers, None)[:2]


def flatten_measured(
    tree: Any, sumsq: list[tuple[int, int]], *, spec: FlatSpec | None = None, out: Any = None
) -> tuple[np.ndarray, FlatSpec, list[float]]:
    """:func:`flatten`'s ``(flat, spec)`` and each ``(lo, hi)`` range of ``flat``'s sum of
    squares, taken as it copies (NaN or Inf when a value is, or the sum overflows the dtype)."""
    return _flatten(tree, spec, out, None, False, sumsq)


def _flatten(tree: Any, spec: Any, out: Any, dtype: Any, keep_integers: bool, sumsq: Any) -> Any:
    if spec is None:
        spec, found = _new_spec(tree, dtype, keep_integers)
    else:
        if dtype is not None and np.dtype(dtype) != spec.dtype:
            raise ValueError(f"dtype {np.dtype(dtype)} differs from the spec's {spec.dtype}")
        found = _collect(tree, spec)
    if out is None:
        out = np.empty(spec.size, spec.dtype)
    elif not isinstance(out, np.ndarray) or out.shape != (spec.size,):
        raise ValueError(f"out has shape {np.shape(out)}, expected ({spec.size},)")
    elif out.dtype != spec.dtype:
        raise TypeError(f"out has dtype {out.dtype}, expected {spec.dtype}")
    elif not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("out must be a writable C-contiguous array")
    if sumsq is not None and not all(0 <= lo <= hi <= spec.size for lo, hi in sumsq):
        raise ValueError(f"sumsq: (lo, hi) ranges within 0..{spec.size} expected, got {sumsq}")
    flat, sums = out, None if sumsq is None else [0.0] * len(sumsq)
    stream = bool(sums) and flat.nbytes >= STREAM  # CPU leaves: copied as measured
    for values, leaf in zip(found, spec.leaves, strict=True):
        segment, (first, *more), src = _segment(flat, leaf), values, None
        cpu = stream and not more and str(getattr(first.x, "device", "cpu")) == "cpu"
        if cpu and first.backend.name in ("numpy", "torch"):
            x = first.backend.to_numpy(first.x)
            src = x.reshape(-1) if x.dtype == flat.dtype and x.flags.c_contiguous else None
        if src is None:
            first.backend.copy_into(first.x, segment)
        for f in more:  # a tied leaf given under several names: one gradient per use
            np.add(segment, f.backend.to_numpy(f.x), out=segment, casting="unsafe")
        if sums is None:
            continue
        a, b = leaf.offset, leaf.offset + leaf.size
        cuts = sorted({a, b, *(c for r in sumsq for c in r if a < c < b)})
        for lo, hi in itertools.pairwise(cuts):  # pieces in or out of each range
            into = [k for k, (rlo, rhi) in enumerate(sumsq) if rlo <= lo and hi <= rhi]
            if src is not None:  # one pass, its stores streaming (docs/design-notes.md)
                s = _copy_sumsq(flat[lo:hi], src[lo - a : hi - a])
            elif into:  # written: read again
                blocks = np.split(flat[lo:hi], range(BLOCK, hi - lo, BLOCK))
                with np.errstate(over="ignore", invalid="ignore"):
                    s = sum(float(np.dot(c, c)) for c in blocks)
            for k in into:
                sums[k] += s
    if sums is not None:  # a sum past the flat dtype's range overflows
        sums = [math.inf if s > float(np.finfo(flat.dtype).max) else s for s in sums]
    return flat, spec, sums


def _copy_sumsq(dst: np.ndarray, src: np.ndarray) -> float:
    """``dst[:] = src`` with non-temporal stores, in one pass that returns its sum of squares."""
    ok = dst.dtype == src.dtype and dst.dtype.name in ("float32", "float64")
    if not (ok and dst.shape == src.shape and dst.flags.c_contiguous and src.flags.c_contiguous):
        raise ValueError(f"cannot copy {src.dtype} {src.shape} into {dst.dtype} {dst.shape} here")
    n, size, (d, s) = src.size, src.itemsize, (x.ctypes.data for x in (dst, src))
    head = n if d % size else min(n, -d % 32 // size)  # elements before dst's 32-byte line
    m = (n - head) // 16 * 16
    total = _streamer(dst.dtype.name)[1](d + head * size, s + head * size, m) if m else 0.0
    for lo, hi in ((0, head), (head + m, n)):  # the unaligned head, the tail
        dst[lo:hi] = src[lo:hi]
        total += sum(x * x for x in src[lo:hi].tolist())
    return total


def warm_copy(flat: np.ndarray) -> None:
    """Compiles the streaming measured copy now if a push of ``flat`` (a push buffer) streams."""
    if flat.nbytes >= STREAM:
        _streamer(flat.dtype.name)


@functools.cache
def _streamer(dtype: str) -> tuple[Any, Any]:
    """(engine, f): ``f(dst, src, n)`` copies ``n`` (a multiple of 16) elements to ``dst``
    (32-byte aligned) with non-temporal stores and a fence; returns their sum of squares."""
    import llvmlite.binding as llvm
    from llvmlite import ir

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    i64, f64s = ir.IntType(64), ir.VectorType(ir.DoubleType(), 8)
    vec = ir.VectorType(ir.FloatType() if dtype == "float32" else ir.DoubleType(), 8)
    module = ir.Module()
    f = ir.Function(module, ir.FunctionType(ir.DoubleType(), [vec.as_pointer()] * 2 + [i64]), "f")
    entry, loop, done = (f.append_basic_block(x) for x in ("entry", "loop", "done"))
    ir.IRBuilder(entry).branch(loop)
    b = ir.IRBuilder(loop)
    i, accs, sums = b.phi(i64), [b.phi(f64s), b.phi(f64s)], []  # two chains of adds
    nontemporal = module.add_metadata([ir.IntType(32)(1)])
    for j, acc in enumerate(accs):
        k = b.add(b.mul(i, i64(2)), i64(j))
        v = b.load(b.gep(f.args[1], [k]), align=4)
        b.store(v, b.gep(f.args[0], [k]), align=32).set_metadata("nontemporal", nontemporal)
        w = v if dtype == "float64" else b.fpext(v, f64s)  # a float32's square is exact
        sums.append(b.fadd(acc, b.fmul(w, w, flags=["contract"]), flags=["contract"]))
        acc.add_incoming(f64s(None), entry)
        acc.add_incoming(sums[-1], loop)
    i.add_incoming(i64(0), entry)
    i.add_incoming(after := b.add(i, i64(1)), loop)
    b.cbranch(b.icmp_unsigned("<", after, b.udiv(f.args[2], i64(16))), loop, done)
    b.position_at_end(done)
    if platform.machine().lower() in ("x86_64", "amd64"):  # the stores drain before later ones
        b.call(ir.Function(module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse.sfence"), [])
    else:
        b.fence("seq_cst")
    lanes = b.fadd(*sums)
    b.ret(functools.reduce(b.fadd, (b.extract_element(lanes, i64(x)) for x in range(8))))
    cpu, features = llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()
    machine = llvm.Target.from_default_triple().create_target_machine(cpu, features, opt=3)
    engine = llvm.create_mcjit_compiler(llvm.parse_assembly(str(module)), machine)
    engine.finalize_object()
    kind = ctypes.CFUNCTYPE(ctypes.c_double, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    return engine, kind(engine.get_function_address("f"))


def _rebuild(node: TreeDef, leaves: Iterator[Any], stored: list) -> Any:
    kind = node.kind
    if kind == "leaf":
        return next(leaves)
    if kind == "alias":
        return stored[_static(node, "leaf")]
    if kind == "const":
        return _static(node, "value")
    if kind == "none":
        return None
    children = [_rebuild(child, leaves, stored) for child in node.children]
    if kind == "dict":
        return node.cls(zip(node.keys, children, strict=True))
    if kind == "list":
        return children
    if kind == "tuple":
        return tuple(children)
    if kind == "namedtuple":
        return node.cls(*children)
    if kind == "registry":
        template = _static(node, "template")
        return containers.rebuild(_static(node, "via"), node.cls, template, tuple(children))
    obj = object.__new__(node.cls)  # fields as they were, without re-running __init__
    for name, value in (*zip(node.keys, children, strict=True), *node.static):
        object.__setattr__(obj, name, value)
    return obj


def unflatten(flat: np.ndarray, spec: FlatSpec, *, copy: bool = False) -> Any:
    """Builds a tree with the structure, backends and dtypes of ``spec`` from ``flat`` (models
    as a dict of name -> tensor); ``copy=False``: leaves may share ``flat``'s memory."""
    flat = _check_flat(flat, spec)
    leaves = [
        get_backend(leaf.backend).from_numpy(_segment(flat, leaf), leaf.dtype, copy=copy)
        for leaf in spec.leaves
    ]
    with contextlib.suppress(IndexError, TypeError):  # no leaf, or none with weak references
        key = id(leaves[0])
        _MADE[key] = (weakref.ref(leaves[0], functools.partial(_forget, key)), spec)
    return _rebuild(spec.treedef, iter(leaves), leaves)


def unflatten_into(target: Any, flat: np.ndarray, spec: FlatSpec) -> None:
    """Copies ``flat`` into the mutable leaves of ``target`` in place, all or nothing."""
    flat = _check_flat(flat, spec)
    found = _collect(target, spec)
    for f in itertools.chain.from_iterable(found):
        if f.holder is None and not f.backend.is_writable(f.x):
            raise TypeError(
                f"{path_str(f.path)}: {type(f.x).__qualname__} cannot be written in place; "
                "use unflatten() to build new arrays"
            )
    for values, leaf in zip(found, spec.leaves, strict=True):
        segment = _segment(flat, leaf)
        for f in values:
            if f.holder is not None:
                f.holder.set_value(f.backend.from_numpy(segment, leaf.dtype))  # an nnx Variable
            else:
                f.backend.assign(f.x, segment)


def views_into(target: Any, spec: FlatSpec) -> list[tuple[int, np.ndarray]] | None:
    """``(offset, flat view)`` of each leaf of ``target`` for a copy straight into it, or None
    unless each is a writeable C-contiguous NumPy array or CPU torch tensor of the flat dtype."""
    views = []
    for values, leaf in zip(_collect(target, spec), spec.leaves, strict=True):
        f = values[0]
        x = f.x if f.backend.name == "numpy" else None
        if f.backend.name == "torch" and f.x.device.type == "cpu":
            with contextlib.suppress(TypeError, RuntimeError):  # sparse, conjugate...
                x = f.x.detach().numpy()  # shares the tensor's memory
                sys.modules["torch"].autograd.graph.increment_version(f.x)  # a write, to autograd
        if len(values) > 1 or f.holder is not None or leaf.dtype != dtype_name(spec.dtype):
            return None
        if not (isinstance(x, np.ndarray) and x.flags.writeable and x.flags.c_contiguous):
            return None
        views.append((leaf.offset, x.reshape(-1)))
    return views


def mark_buffers(spec: FlatSpec, patterns: str | Iterable[str]) -> FlatSpec:
    """The spec with the leaves whose names match a regex (``re.search``) marked as buffers;
    ValueError if a pattern is not a valid regex or matches no leaf."""
    pats = [patterns] if isinstance(patterns, str) else list(patterns)
    compiled = []
    for p in pats:
        if not isinstance(p, str):
            raise TypeError(f"buffers: expected regexes of leaf names, got {p!r}")
        try:
            compiled.append(re.compile(p))
        except re.error as e:
            raise ValueError(f"buffers: {p!r} is not a valid regex: {e}") from None
    names = [leaf.name for leaf in spec.leaves]
    for p in compiled:
        if not any(p.search(n) for n in names):
            shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise ValueError(f"buffers: {p.pattern!r} matches no leaf (leaves: {shown})")
    marked = [leaf.buffer or any(p.search(leaf.name) for p in compiled) for leaf in spec.leaves]
    leaves = tuple(
        dataclasses.replace(x, buffer=m) for x, m in zip(spec.leaves, marked, strict=True)
    )
    return dataclasses.replace(spec, leaves=leaves)


def take_buffers(flat: np.ndarray, spec: FlatSpec) -> np.ndarray | None:
    """The buffers' slots of ``flat`` (a copy, in order), zeroed there; None without buffers."""
    slices = spec._buffer_slices
    if not slices:
        return None
    values = np.concatenate([flat[s] for s in slices])
    for s in slices:
        flat[s] = 0
    return values


def put_buffers(flat: np.ndarray, values: np.ndarray | None, spec: FlatSpec) -> None:
    """Writes what :func:`take_buffers` returned into the buffers' slots of ``flat``."""
    if values is None:
        return
    start = 0
    for s in spec._buffer_slices:
        n = s.stop - s.start
        flat[s] = values[start : start + n]
        start += n


def copy_buffers(dst: np.ndarray, src: np.ndarray, spec: FlatSpec) -> None:
    """Copies the buffers' slots of ``src`` into ``dst`` (say, into a pseudo-gradient)."""
    for s in spec._buffer_slices:
        dst[s] = src[s]
