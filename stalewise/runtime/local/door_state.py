"""What a job's door tells an attaching process, as JSON data: nothing is unpickled.

:func:`encode` writes the worker id, incarnation, shared block and layout and what
the job's :class:`~stalewise.protocol.ServerConfig` says a worker needs as one JSON
document; :func:`decode` checks every field and builds the
:class:`~stalewise.runtime.local.client.Client`. A tree's structure travels as
plain data; a namedtuple or dataclass is looked up only among the modules the
attaching process has imported, and anything else (a flax ``State``, a constant
that is not plain data) makes the door refuse the attach, naming it."""

from __future__ import annotations

import base64
import dataclasses
import json
import math
import sys
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from stalewise import codecs, tree
from stalewise.backends import FLOAT_DTYPES
from stalewise.consistency import Consistency
from stalewise.protocol import ServerConfig
from stalewise.runtime.local.layout import Layout
from stalewise.staleness import Staleness

if TYPE_CHECKING:
    from stalewise.runtime.local.client import Client

#: The longest state a door sends, in bytes (an attaching process reads no more).
MAX_STATE = 1 << 24

_KINDS = ("leaf", "alias", "const", "none", "dict", "list", "tuple", "namedtuple", "dataclass")
_BACKENDS = ("numpy", "torch", "jax", "tensorflow")
_CONSISTENCY = ("asp", "ssp", "bsp", "hybrid")
_STALENESS = ("constant", "inverse", "exponential", "polynomial")


class NotData(ValueError):
    """Something that cannot travel through the door as data (says what)."""


class NotImported(NotData):
    """A class of the parameters' structure that the attaching process has not imported."""


# -- the server's side --------------------------------------------------------------------


def encode(config: ServerConfig, client: Client, workers: int) -> bytes:
    """The JSON document that lets an attaching process build ``client`` (raises NotData)."""
    spec = config.spec
    state = {
        "worker": client.worker,
        "incarnation": client.incarnation,
        "joined_at": client.joined_at,
        "block": client._block_name,
        "workers": workers,
        "layout": dataclasses.asdict(client._layout),
        "spec": {
            "dtype": spec.dtype.name,
            "size": spec.size,
            "leaves": [_leaf(leaf) for leaf in spec.leaves],
            "treedef": _treedef(spec.treedef),
        },
        "shards": config.shards,
        "consistency": list(config.consistency),
        "staleness": list(config.staleness),
        "codec": _codec(config.codec),
    }
    body = json.dumps({"client": state}).encode()
    if len(body) > MAX_STATE:
        raise NotData(f"the job's state is {len(body)} bytes, over the door's {MAX_STATE}")
    return body


def _leaf(leaf: tree.LeafSpec) -> list:
    path = [_data(p) for p in leaf.path]
    return [
        path,
        leaf.name,
        list(leaf.shape),
        leaf.dtype,
        leaf.backend,
        leaf.offset,
        leaf.size,
        leaf.buffer,
    ]


def _treedef(node: tree.TreeDef) -> list:
    if node.cls is None or node.cls in (dict, OrderedDict):
        cls = None if node.cls is None else node.cls.__name__
    elif node.kind in ("namedtuple", "dataclass"):
        cls = [node.cls.__module__, node.cls.__qualname__]
    else:
        raise NotData(f"a {node.kind} container of type {node.cls.__qualname__}")
    if node.kind not in _KINDS:
        raise NotData(f"a {node.kind} container")
    static = [[name, _data(value)] for name, value in node.static]
    return [
        node.kind,
        [_data(k) for k in node.keys],
        [_treedef(c) for c in node.children],
        cls,
        static,
    ]


def _data(x: Any) -> Any:
    """``x`` as JSON, tagged where JSON alone would lose its type."""
    if x is None or type(x) in (bool, int, float, str):
        return x
    if isinstance(x, tree.HiddenKey):
        return {"hidden": str(x)}
    if isinstance(x, tree.AttrKey):
        return {"attr": str(x)}
    if type(x) in (tuple, list):
        return {type(x).__name__: [_data(v) for v in x]}
    if isinstance(x, np.ndarray | np.generic) and x.dtype.kind in "biuf":
        a = np.ascontiguousarray(x)
        data = base64.b64encode(a.tobytes()).decode()
        return {
            "array": a.dtype.str,
            "shape": list(a.shape),
            "data": data,
            "scalar": isinstance(x, np.generic),
        }
    raise NotData(f"a constant of type {type(x).__qualname__}")


def _codec(policy: codecs.Policy) -> dict:
    """The table :func:`stalewise.codecs.parse` reads back as ``policy``."""
    if isinstance(policy, codecs.SizeAdaptive):
        return {
            "name": "size_adaptive",
            "threshold": policy.threshold,
            "small": _codec(policy.small),
            "large": _codec(policy.large),
        }
    fields = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    return {"name": policy.name, **fields}


# -- the attaching process's side ----------------------------------------------------------


def decode(body: bytes) -> tuple[str | None, Plan | None]:
    """What a door sent: ``(its refusal, None)`` or ``(None, the plan of the client)``.

    Raises:
        NotData: the document is not one a door writes (says what is wrong).
    """
    try:
        doc = json.loads(body)
        if isinstance(doc, dict) and list(doc) == ["error"]:
            return str(_get(doc, "error", str)), None
        state = _get(doc, "client", dict)
        spec = _spec(_get(state, "spec", dict))
        config = ServerConfig(
            spec=spec,
            init=np.empty(0, spec.dtype),  # a worker's client needs neither
            optimizer=None,
            consistency=_consistency(_get(state, "consistency", list)),
            staleness=_staleness(_get(state, "staleness", list)),
            shards=_count(_get(state, "shards", int), 1),
            codec=codecs.parse(_get(state, "codec", dict)),
        )
        layout = _layout(_get(state, "layout", dict))
        if layout.shards != config.shards or layout.size != spec.size:
            raise NotData(f"a layout of {layout.shards} shards, {layout.size} values")
        plan = Plan(
            _count(_get(state, "worker", int)),
            _get(state, "block", str),
            layout,
            config,
            _count(_get(state, "incarnation", int), 1),
            _count(_get(state, "joined_at", int)),
            _count(_get(state, "workers", int), 1),
        )
        return None, plan
    except NotData:
        raise
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise NotData(str(e) or type(e).__name__) from None


@dataclasses.dataclass(frozen=True)
class Plan:
    """An attaching process's client, as its door described it (:meth:`make` builds it)."""

    worker: int
    block: str
    layout: Layout
    config: ServerConfig
    incarnation: int
    joined_at: int
    workers: int  # the job's worker ids

    def make(self, conns: list) -> Client:
        """The client, over its pipes to the shards (one a shard)."""
        from stalewise.runtime.local.client import Client

        try:
            return Client(
                self.worker,
                self.block,
                self.layout,
                self.config,
                conns,
                incarnation=self.incarnation,
                joined_at=self.joined_at,
            )
        except (ValueError, TypeError) as e:  # e.g. a codec's plan that does not fit the spec
            raise NotData(str(e)) from None


def _get(d: Any, key: str, kind: type) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise NotData(f"no {key!r}")
    value = d[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise NotData(f"{key!r} is not a {kind.__name__}: {value!r:.80}")
    return value


def _count(n: int, least: int = 0) -> int:
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= least):
        raise NotData(f"expected an integer >= {least}, got {n!r:.80}")
    return n


def _real(x: Any) -> float:
    if isinstance(x, bool) or not isinstance(x, int | float):
        raise NotData(f"expected a number, got {x!r:.80}")
    return float(x)


def _layout(d: dict) -> Layout:
    names = [f.name for f in dataclasses.fields(Layout)]
    if sorted(d) != sorted(names):
        raise NotData(f"a layout with fields {sorted(d)}")
    payloads = _get(d, "payloads", list)
    expected = d["expected"]
    if d["dtype"] not in ("float32", "float64") or not isinstance(d["feedback"], bool):
        raise NotData(f"a layout of dtype {d['dtype']!r:.40}")
    return Layout(
        _count(d["size"]),
        d["dtype"],
        _count(d["workers"], 1),
        _count(d["shards"], 1),
        tuple(_count(p) for p in payloads),
        d["feedback"],
        None if expected is None else _count(expected),
    )


def _consistency(v: list) -> Consistency:
    if len(v) != 3 or v[0] not in _CONSISTENCY:
        raise NotData(f"consistency {v!r:.80}")
    return Consistency(v[0], _real(v[1]), _real(v[2]))


def _staleness(v: list) -> Staleness:
    if len(v) != 4 or v[0] not in _STALENESS:
        raise NotData(f"staleness {v!r:.80}")
    return Staleness(v[0], *(_real(x) for x in v[1:]))


def _spec(d: dict) -> tree.FlatSpec:
    dtype = _get(d, "dtype", str)
    if dtype not in ("float32", "float64"):
        raise NotData(f"a flat vector of dtype {dtype!r:.40}")
    leaves = tuple(_leaf_spec(x) for x in _get(d, "leaves", list))
    size = _count(_get(d, "size", int))
    if sum(leaf.size for leaf in leaves) != size:
        raise NotData(f"leaves that do not add up to the size {size}")
    treedef = _node(_get(d, "treedef", list))
    return tree.FlatSpec(leaves, treedef, np.dtype(dtype), size)


def _leaf_spec(v: Any) -> tree.LeafSpec:
    if not (isinstance(v, list) and len(v) == 8):
        raise NotData(f"a leaf {v!r:.80}")
    path, name, shape, dtype, backend, offset, size, buffer = v
    shape = tuple(_count(n) for n in _get({"shape": shape}, "shape", list))
    if dtype not in FLOAT_DTYPES or backend not in _BACKENDS or not isinstance(buffer, bool):
        raise NotData(f"a leaf {v!r:.80}")
    if math.prod(shape) != _count(size):
        raise NotData(f"a leaf of shape {shape} and size {size}")
    path = tuple(_value(p) for p in _get({"path": path}, "path", list))
    return tree.LeafSpec(
        path, _get({"name": name}, "name", str), shape, dtype, backend, _count(offset), size, buffer
    )


def _node(v: Any) -> tree.TreeDef:
    if not (isinstance(v, list) and len(v) == 5 and v[0] in _KINDS):
        raise NotData(f"a tree node {v!r:.80}")
    kind, keys, children, cls, static = v
    keys = tuple(_value(k) for k in _get({"keys": keys}, "keys", list))
    children = tuple(_node(c) for c in _get({"children": children}, "children", list))
    static = tuple(_pair(p) for p in _get({"static": static}, "static", list))
    return tree.TreeDef(kind, keys, children, _class(kind, cls), static)


def _pair(v: Any) -> tuple[str, Any]:
    if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)):
        raise NotData(f"a static field {v!r:.80}")
    return v[0], _value(v[1])


def _class(kind: str, cls: Any) -> type | None:
    if cls is None or (kind == "dict" and cls in ("dict", "OrderedDict")):
        return {None: None, "dict": dict, "OrderedDict": OrderedDict}[cls]
    if not (kind in ("namedtuple", "dataclass") and isinstance(cls, list) and len(cls) == 2):
        raise NotData(f"a {kind} of class {cls!r:.80}")
    module, qualname = cls
    found = sys.modules.get(module) if isinstance(module, str) else None
    for part in qualname.split(".") if isinstance(qualname, str) and found is not None else ():
        found = getattr(found, part, None)
    is_kind = isinstance(found, type) and (
        issubclass(found, tuple) and hasattr(found, "_fields")
        if kind == "namedtuple"
        else dataclasses.is_dataclass(found)
    )
    if not is_kind:
        raise NotImported(
            f"the parameters hold a {kind} of class {module}.{qualname}, which this process has "
            "not imported: import its module before attaching"
        )
    return found


def _value(x: Any) -> Any:
    """What :func:`_data` wrote, back."""
    if x is None or type(x) in (bool, int, float, str):
        return x
    if not (isinstance(x, dict) and x):
        raise NotData(f"a value {x!r:.80}")
    tag = next(iter(x))
    if len(x) == 1 and tag in ("hidden", "attr"):
        cls = tree.HiddenKey if tag == "hidden" else tree.AttrKey
        return cls(_get(x, tag, str))
    if len(x) == 1 and tag in ("tuple", "list"):
        items = [_value(v) for v in _get(x, tag, list)]
        return tuple(items) if tag == "tuple" else items
    if sorted(x) == ["array", "data", "scalar", "shape"]:
        dtype = np.dtype(_get(x, "array", str))
        shape = tuple(_count(n) for n in _get(x, "shape", list))
        if dtype.kind not in "biuf":
            raise NotData(f"an array of dtype {dtype}")
        data = base64.b64decode(_get(x, "data", str), validate=True)
        a = np.frombuffer(data, dtype).reshape(shape).copy()
        return a[()] if _get(x, "scalar", bool) else a
    raise NotData(f"a value {x!r:.80}")
