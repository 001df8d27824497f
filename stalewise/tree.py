"""Pytrees of NumPy, PyTorch, JAX or TensorFlow arrays <-> one flat vector.

The server and the optimizers work on one contiguous NumPy vector; users work
with the structure they trained with. :func:`flatten` turns a tree into the
vector and a :class:`FlatSpec` (key paths, shapes, dtypes, offsets, and the
structure), :func:`unflatten` builds the tree back, :func:`unflatten_into`
writes a vector into an existing tree in place.

Rules:

- Containers: ``dict`` (keys in the order of sorted ``str(key)``, so the layout
  does not depend on insertion order; ``OrderedDict`` is kept, other mappings
  come back as ``dict``), ``list``, ``tuple``, namedtuples, dataclass
  instances (their fields in declaration order; fields with
  ``metadata={"static": True}`` are kept in the structure, not flattened) and
  ``None`` (no leaves, restored as ``None``).
- Models: a ``torch.nn.Module`` contributes its parameters that require grad,
  a Keras model or ``tf.Module`` its ``trainable_variables``; each is treated
  as a ``dict`` of name -> leaf, so :func:`unflatten` returns that dict and a
  dict of gradients validates against the model's spec.
- Leaves: NumPy arrays and NumPy scalars (0-d leaves, restored as 0-d
  arrays), torch tensors (detached, copied to the CPU), JAX arrays, TensorFlow
  tensors and variables. Python scalars are refused (they cannot be written
  in place); use ``np.float32(...)`` or a static dataclass field.
- Only floating leaves are trainable: float16, bfloat16, float32, float64.
  Integer, bool and complex leaves are refused with a TypeError naming the
  key path and dtype.
- The flat vector is float32, or float64 when some leaf is float64, so the
  round trip is exact. ``dtype=`` forces float32 or float64; a forced float32
  rounds float64 leaves.
- Order is depth first. Leaf names (for :class:`~stalewise.segments.Segments`
  and exclusion regexes) are the key path joined by dots, e.g. ``"layer1.w"``.
- Zero-copy: ``unflatten(copy=False)`` returns NumPy leaves that are views of
  the flat vector and CPU torch tensors sharing its memory when the leaf
  dtype equals the flat dtype; other leaves are copies (JAX arrays always).
  ``flatten(out=buf)`` fills ``buf`` without a parameter-sized temporary for
  NumPy and CPU torch leaves of the flat dtype.
- With ``spec=``, the tree must match the spec (structure, shapes, dtypes;
  the backend may differ, e.g. JAX gradients for NumPy parameters); errors
  name the key path: ``params['layer1']['w']: expected shape (64, 32), got (32, 64)``.

Example:
    >>> import numpy as np
    >>> params = {"w": np.ones((2, 3), np.float32), "b": [np.zeros(3, np.float16), None]}
    >>> flat, spec = flatten(params)
    >>> flat.shape, flat.dtype.name, spec.segments.names
    ((9,), 'float32', ('b.0', 'w'))
    >>> back = unflatten(flat, spec)
    >>> back["b"][0].dtype.name, back["b"][1], np.shares_memory(back["w"], flat)
    ('float16', None, True)
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from stalewise.backends import FLOAT_DTYPES, Backend, backend_of, get_backend
from stalewise.segments import Segments

logger = logging.getLogger(__name__)

__all__ = ["AttrKey", "FlatSpec", "LeafSpec", "TreeDef"]
__all__ += ["flatten", "path_str", "unflatten", "unflatten_into"]


class AttrKey(str):
    """A key path entry that is an attribute (namedtuple or dataclass field), shown as ``.name``."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"AttrKey({str(self)!r})"


def path_str(path: tuple, root: str = "params") -> str:
    """A key path as Python-like access syntax, for error messages.

    Example:
        >>> path_str(("layer1", "w"))
        "params['layer1']['w']"
        >>> path_str((0, AttrKey("bias")), root="grads")
        'grads[0].bias'
    """
    return root + "".join(f".{e}" if isinstance(e, AttrKey) else f"[{e!r}]" for e in path)


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """Where one trainable leaf lives in the flat vector.

    Example:
        >>> import numpy as np
        >>> _, spec = flatten({"layer1": {"w": np.zeros((4, 2), np.float16)}})
        >>> leaf = spec.leaves[0]
        >>> leaf.name, leaf.shape, leaf.dtype, leaf.backend, leaf.offset, leaf.size
        ('layer1.w', (4, 2), 'float16', 'numpy', 0, 8)
    """

    path: tuple  # key path entries, e.g. ("layer1", "w") or (0, AttrKey("bias"))
    name: str  # dotted name, e.g. "layer1.w" ("params" for a tree that is one leaf)
    shape: tuple[int, ...]
    dtype: str  # "float16" | "bfloat16" | "float32" | "float64"
    backend: str  # "numpy" | "torch" | "jax" | "tensorflow"
    offset: int  # start in the flat vector
    size: int  # number of elements


class TreeDef(NamedTuple):
    """The structure of a tree without its leaves (opaque; picklable when its classes are)."""

    kind: str  # "leaf" | "none" | "dict" | "list" | "tuple" | "namedtuple" | "dataclass"
    keys: tuple = ()  # dict keys in flattening order, field names, or list/tuple indices
    children: tuple[TreeDef, ...] = ()
    cls: type | None = None  # dict or OrderedDict, the namedtuple or the dataclass type
    static: tuple = ()  # (field name, value) of static dataclass fields


_LEAF = TreeDef("leaf")
_NONE = TreeDef("none")


@dataclasses.dataclass(frozen=True, repr=False)
class FlatSpec:
    """Everything needed to rebuild a tree from its flat vector; picklable.

    Example:
        >>> import numpy as np
        >>> _, spec = flatten([np.zeros(3), np.zeros((2, 2), np.float32)])
        >>> spec.size, spec.dtype.name, spec.nbytes, spec.segments.names
        (7, 'float64', 56, ('0', '1'))
    """

    leaves: tuple[LeafSpec, ...]
    treedef: TreeDef
    dtype: np.dtype  # dtype of the flat vector
    size: int  # total number of elements

    @functools.cached_property
    def segments(self) -> Segments:
        """The per-leaf segment table (names, offsets, sizes)."""
        return Segments.from_sizes([x.name for x in self.leaves], [x.size for x in self.leaves])

    @property
    def nbytes(self) -> int:
        """Bytes of the flat vector."""
        return self.size * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"FlatSpec({len(self.leaves)} leaves, size={self.size}, dtype={self.dtype.name})"


_Found = tuple[tuple, Any, Backend]  # (key path, leaf, its backend)


def _split(x: Any, path: tuple) -> tuple[str, type | None, tuple, tuple, tuple]:
    """One level of a container: (kind, cls, keys, children, static fields)."""
    if x is None:
        return "none", None, (), (), ()
    if isinstance(x, dict):
        keys = sorted(x, key=str)
        if len({str(k) for k in keys}) != len(keys):
            raise ValueError(f"{path_str(path)}: dict keys {keys} are not distinct as strings")
        cls = type(x) if type(x) in (dict, OrderedDict) else dict
        return "dict", cls, tuple(keys), tuple(x[k] for k in keys), ()
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):
        return "namedtuple", type(x), tuple(AttrKey(f) for f in x._fields), tuple(x), ()
    if isinstance(x, list | tuple):
        return type(x).__name__, None, tuple(range(len(x))), tuple(x), ()
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        keys, values, static = [], [], []
        for f in dataclasses.fields(x):
            if f.metadata.get("static"):
                static.append((f.name, getattr(x, f.name)))
            else:
                keys.append(AttrKey(f.name))
                values.append(getattr(x, f.name))
        return "dataclass", type(x), tuple(keys), tuple(values), tuple(static)
    if isinstance(x, bool | int | float | complex):
        raise TypeError(
            f"{path_str(path)}: python {type(x).__name__} is not an array leaf; use a 0-d "
            "array such as np.float32(x), or a static dataclass field for constants"
        )
    raise TypeError(
        f"{path_str(path)}: cannot flatten {type(x).__qualname__}; containers are dict, list, "
        "tuple, namedtuple, dataclass and None, leaves NumPy/torch/JAX/TensorFlow arrays"
    )


def _as_leaf_or_node(x: Any) -> tuple[Backend | None, Any]:
    """(backend, x) for a leaf; (None, x or the model's named leaves) otherwise."""
    backend = None if x is None else backend_of(x)
    if backend is None:
        return None, x
    if backend.is_leaf(x):
        return backend, x
    named = backend.named_params(x)
    return None, x if named is None else named


def _build(x: Any, path: tuple, found: list[_Found]) -> TreeDef:
    backend, x = _as_leaf_or_node(x)
    if backend is not None:
        found.append((path, x, backend))
        return _LEAF
    kind, cls, keys, values, static = _split(x, path)
    if kind == "none":
        return _NONE
    children = tuple(_build(v, (*path, k), found) for k, v in zip(keys, values, strict=True))
    return TreeDef(kind, keys, children, cls, static)


def _describe(node: TreeDef) -> str:
    if node.kind == "leaf":
        return "an array leaf"
    if node.kind == "none":
        return "None"
    if node.cls is not None and node.kind != "dict":
        return f"{node.kind} {node.cls.__qualname__}"
    return node.kind


def _match(x: Any, path: tuple, node: TreeDef, found: list[_Found]) -> None:
    """Collects the leaves of ``x``, checking that its structure is ``node``."""
    backend, x = _as_leaf_or_node(x)
    if backend is not None or node.kind == "leaf":
        if backend is None or node.kind != "leaf":
            got = "an array leaf" if backend is not None else type(x).__qualname__
            raise ValueError(f"{path_str(path)}: expected {_describe(node)}, got {got}")
        found.append((path, x, backend))
        return
    kind, cls, keys, values, _ = _split(x, path)
    if kind != node.kind or (kind in ("namedtuple", "dataclass") and cls is not node.cls):
        got = type(x).__qualname__
        raise ValueError(f"{path_str(path)}: expected {_describe(node)}, got {got}")
    if kind == "dict" and keys != node.keys:
        got, want = set(keys), set(node.keys)
        missing = [k for k in node.keys if k not in got]
        extra = [k for k in keys if k not in want]
        problems = [_keys_msg("missing", missing), _keys_msg("unexpected", extra)]
        raise ValueError(f"{path_str(path)}: " + "; ".join(p for p in problems if p))
    if len(values) != len(node.children):
        want = f"{kind} of length {len(node.children)}"
        raise ValueError(f"{path_str(path)}: expected {want}, got length {len(values)}")
    for k, v, child in zip(node.keys, values, node.children, strict=True):
        _match(v, (*path, k), child, found)


def _keys_msg(what: str, keys: list) -> str:
    plural = "s" if len(keys) > 1 else ""
    return f"{what} key{plural} " + ", ".join(repr(k) for k in keys) if keys else ""


def _leaf_dtype(path: tuple, x: Any, backend: Backend) -> str:
    dtype = backend.dtype(x)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{path_str(path)}: leaf has dtype {dtype}; only floating leaves "
            f"({', '.join(FLOAT_DTYPES)}) are trainable, integer, bool and complex ones are not"
        )
    return dtype


def _check_leaves(found: list[_Found], spec: FlatSpec) -> None:
    for (path, x, backend), leaf in zip(found, spec.leaves, strict=True):
        shape = backend.shape(x)
        if shape != leaf.shape:
            raise ValueError(f"{path_str(path)}: expected shape {leaf.shape}, got {shape}")
        dtype = _leaf_dtype(path, x, backend)
        if dtype != leaf.dtype:
            raise TypeError(f"{path_str(path)}: expected dtype {leaf.dtype}, got {dtype}")


def _flat_dtype(dtype: Any, leaf_dtypes: list[str]) -> np.dtype:
    if dtype is None:
        return np.dtype(np.float64 if "float64" in leaf_dtypes else np.float32)
    forced = np.dtype(dtype)
    if forced not in (np.float32, np.float64):
        raise ValueError(f"flat dtype must be float32 or float64, got {forced}")
    return forced


def _make_spec(found: list[_Found], treedef: TreeDef, dtype: Any) -> FlatSpec:
    leaves, offset = [], 0
    for path, x, backend in found:
        shape = backend.shape(x)
        size = math.prod(shape)
        name = ".".join(str(e) for e in path) if path else "params"
        leaf_dtype = _leaf_dtype(path, x, backend)
        leaves.append(LeafSpec(path, name, shape, leaf_dtype, backend.name, offset, size))
        offset += size
    flat_dtype = _flat_dtype(dtype, [leaf.dtype for leaf in leaves])
    logger.debug("flat spec: %d leaves, %d elements, %s", len(leaves), offset, flat_dtype)
    return FlatSpec(tuple(leaves), treedef, flat_dtype, offset)


def _segment(flat: np.ndarray, leaf: LeafSpec) -> np.ndarray:
    return flat[leaf.offset : leaf.offset + leaf.size].reshape(leaf.shape)


def _check_flat(flat: Any, spec: FlatSpec) -> np.ndarray:
    flat = np.asarray(flat)
    if flat.ndim != 1:
        raise ValueError(f"flat vector must be 1-D, got shape {flat.shape}")
    if flat.size != spec.size:
        raise ValueError(f"flat vector has {flat.size} elements, spec expects {spec.size}")
    if flat.dtype.name not in FLOAT_DTYPES:
        raise TypeError(f"flat vector has dtype {flat.dtype}, expected {spec.dtype}")
    return flat


def _out_buffer(out: np.ndarray | None, spec: FlatSpec) -> np.ndarray:
    if out is None:
        return np.empty(spec.size, spec.dtype)
    if not isinstance(out, np.ndarray) or out.shape != (spec.size,):
        raise ValueError(f"out has shape {np.shape(out)}, expected ({spec.size},)")
    if out.dtype != spec.dtype:
        raise TypeError(f"out has dtype {out.dtype}, expected {spec.dtype}")
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("out must be a writable C-contiguous array")
    return out


def flatten(
    tree: Any,
    *,
    spec: FlatSpec | None = None,
    out: np.ndarray | None = None,
    dtype: Any = None,
) -> tuple[np.ndarray, FlatSpec]:
    """Copies the leaves of ``tree`` into one flat vector.

    Args:
      tree: a pytree of arrays of any backend, or a torch / Keras / ``tf.Module`` model.
      spec: an existing spec that ``tree`` must match (e.g. gradients against
        the parameters' spec); it is returned unchanged.
      out: a C-contiguous vector of ``spec.size`` elements and the flat dtype
        to fill instead of allocating one.
      dtype: force the flat dtype (float32 or float64); by default float32, or
        float64 when some leaf is float64.

    Returns:
      ``(flat, spec)``.

    Raises:
      TypeError: a leaf is not floating, an object is not a container or leaf,
        or a leaf's dtype differs from ``spec``.
      ValueError: the structure or a shape differs from ``spec``.

    Example:
        >>> import numpy as np
        >>> flat, spec = flatten({"b": np.ones(2), "a": np.zeros((1, 2))})
        >>> flat.tolist(), [leaf.name for leaf in spec.leaves]
        ([0.0, 0.0, 1.0, 1.0], ['a', 'b'])
        >>> grads = {"a": np.full((1, 2), 3.0), "b": np.ones(2)}
        >>> flatten(grads, spec=spec, out=flat)[0] is flat
        True
    """
    found: list[_Found] = []
    if spec is None:
        spec = _make_spec(found, _build(tree, (), found), dtype)
    else:
        if dtype is not None and np.dtype(dtype) != spec.dtype:
            raise ValueError(f"dtype {np.dtype(dtype)} differs from the spec's {spec.dtype}")
        _match(tree, (), spec.treedef, found)
        _check_leaves(found, spec)
    flat = _out_buffer(out, spec)
    for (_, x, backend), leaf in zip(found, spec.leaves, strict=True):
        backend.copy_into(x, _segment(flat, leaf))
    return flat, spec


def _rebuild(node: TreeDef, leaves: Iterator[Any]) -> Any:
    if node.kind == "leaf":
        return next(leaves)
    if node.kind == "none":
        return None
    children = [_rebuild(child, leaves) for child in node.children]
    if node.kind == "dict":
        return node.cls(zip(node.keys, children, strict=True))
    if node.kind == "list":
        return children
    if node.kind == "tuple":
        return tuple(children)
    if node.kind == "namedtuple":
        return node.cls(*children)
    obj = object.__new__(node.cls)  # fields as they were, without re-running __init__
    for name, value in (*zip(node.keys, children, strict=True), *node.static):
        object.__setattr__(obj, name, value)
    return obj


def unflatten(flat: np.ndarray, spec: FlatSpec, *, copy: bool = False) -> Any:
    """Builds a tree with the structure, backends and dtypes of ``spec`` from ``flat``.

    Models come back as a dict of name -> tensor; ``tf.Variable`` and
    ``nn.Parameter`` leaves as plain tensors.

    Args:
      flat: a 1-D floating vector of ``spec.size`` elements.
      spec: from :func:`flatten`.
      copy: if False, NumPy leaves are views of ``flat`` and CPU torch leaves
        share its memory whenever the leaf dtype equals ``flat``'s dtype, so
        later writes to ``flat`` show in them. If True, every leaf is a copy.

    Example:
        >>> import numpy as np
        >>> flat, spec = flatten({"w": np.zeros(2, np.float32)})
        >>> tree = unflatten(np.array([1.0, 2.0], np.float32), spec)
        >>> tree["w"].tolist()
        [1.0, 2.0]
    """
    flat = _check_flat(flat, spec)
    leaves = [
        get_backend(leaf.backend).from_numpy(_segment(flat, leaf), leaf.dtype, copy=copy)
        for leaf in spec.leaves
    ]
    return _rebuild(spec.treedef, iter(leaves))


def unflatten_into(target: Any, flat: np.ndarray, spec: FlatSpec) -> None:
    """Copies ``flat`` into the leaves of ``target`` in place.

    ``target`` must match ``spec`` like a tree passed to ``flatten(spec=...)``
    and its leaves must be mutable: NumPy arrays, torch tensors (written under
    ``torch.no_grad``), ``tf.Variable`` or Keras variables. Nothing is written
    unless every leaf is.

    Example:
        >>> import numpy as np
        >>> params = {"w": np.zeros(2, np.float32)}
        >>> _, spec = flatten(params)
        >>> unflatten_into(params, np.array([3.0, 4.0], np.float32), spec)
        >>> params["w"].tolist()
        [3.0, 4.0]
    """
    flat = _check_flat(flat, spec)
    found: list[_Found] = []
    _match(target, (), spec.treedef, found)
    _check_leaves(found, spec)
    for path, x, backend in found:
        if not backend.is_writable(x):
            raise TypeError(
                f"{path_str(path)}: {type(x).__qualname__} cannot be written in place; "
                "use unflatten() to build new arrays"
            )
    for (_, x, backend), leaf in zip(found, spec.leaves, strict=True):
        backend.assign(x, _segment(flat, leaf))
