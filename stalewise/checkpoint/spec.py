"""A parameter tree's spec as JSON, plain data only: for checkpoints and the attach door.

A node is {"kind", "keys", "children"} with kind from :data:`KINDS`, plus "leaf" (an alias),
"ordered" (an OrderedDict) or "type" ("module.QualName", never imported). A key is [kind,
value]: "str", "int", "attr" (a field), "hidden" (a field left out of leaf names) or "repr".
``live`` (the door): keys and static values are tagged data (:func:`_data`), "type" is
[module, qualname], looked up among the modules already imported."""

from __future__ import annotations

import base64
import dataclasses
import math
import sys
from collections import OrderedDict
from typing import Any

import numpy as np

from stalewise import tree as tree_lib

KINDS = ("leaf", "alias", "const", "none", "dict", "list", "tuple")
KINDS += ("namedtuple", "dataclass", "registry")
_KEY_KINDS = ("str", "int", "attr", "hidden", "repr")
MAX_COUNT = 2**62  # counts and sizes in a manifest are ints in [0, 2**62)
_MAX_DEPTH = 256  # nesting of the tree


class NotData(ValueError):
    """What cannot travel as data, or a document no writer writes (says what)."""


class NotImported(NotData):
    """A class of the tree's structure that this process has not imported."""


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a message stays one short line)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_count(value: Any, limit: int = MAX_COUNT) -> bool:
    return type(value) is int and 0 <= value < limit


def need(ok: Any, where: str, field: str, value: Any, want: str) -> None:
    """The one check of a manifest, a spec and a shard's saved values: unless ``ok``,
    NotData "``where``: ``field`` is ``value``, expected ``want``" (one line)."""
    if not ok:
        raise NotData(f"{where}: {field} is {short(value)}, expected {want}")


def spec_to_json(spec: tree_lib.FlatSpec, *, live: bool = False) -> dict[str, Any]:
    """A FlatSpec as plain JSON data (no pickles); ``live``: for the door (raises NotData)."""
    key = _data if live else _key_to_json
    return {
        "dtype": spec.dtype.name,
        "size": int(spec.size),
        "leaves": [
            {
                "path": [key(k) for k in leaf.path],
                "name": leaf.name,
                "shape": [int(n) for n in leaf.shape],
                "dtype": leaf.dtype,
                "backend": leaf.backend,
                "offset": int(leaf.offset),
                "size": int(leaf.size),
                "buffer": bool(leaf.buffer),
            }
            for leaf in spec.leaves
        ],
        "tree": _treedef_to_json(spec.treedef, live),
    }


def spec_from_json(data: Any, where: str = "spec", *, live: bool = False) -> tree_lib.FlatSpec:
    """The FlatSpec of :func:`spec_to_json`'s data (``live`` as written), every field
    checked; imports and unpickles nothing. NotData (CheckpointError on load): a bad field."""

    def bad(what: str) -> NotData:
        return NotData(f"{where}: {what}")

    def key(k: Any, at: str) -> Any:
        return _value(k) if live else _key_from_json(k, f"{where}: {at}")

    from stalewise.backends import FLOAT_DTYPES, get_backend

    if not isinstance(data, dict):
        raise bad(f"expected an object, got {short(data)}")
    dtype, raw = data.get("dtype"), data.get("leaves")
    need(dtype in ("float32", "float64"), where, "dtype", dtype, "'float32' or 'float64'")
    need(isinstance(raw, list), where, "leaves", raw, "a list")
    leaves, offset = [], 0
    for i, leaf in enumerate(raw):
        need(isinstance(leaf, dict), where, f"leaf {i}", leaf, "an object")
        path, name, shape = leaf.get("path"), leaf.get("name"), leaf.get("shape")
        ok = isinstance(path, list) and len(path) <= _MAX_DEPTH
        need(ok, where, f"leaf {i}: path", path, "a list of keys")
        keys = tuple(key(k, f"leaf {i}: path") for k in path)
        need(isinstance(name, str), where, f"leaf {i}: name", name, "a string")
        at = f"leaf {name!r}"
        ok = isinstance(shape, list) and len(shape) <= 64 and all(map(is_count, shape))
        need(ok, where, f"{at}: shape", shape, "a list of counts")
        need(leaf.get("dtype") in FLOAT_DTYPES, where, f"{at}: dtype", leaf.get("dtype"),
             f"one of {FLOAT_DTYPES}")  # fmt: skip
        backend = leaf.get("backend")
        try:
            get_backend(backend) if isinstance(backend, str) else get_backend("")
        except ValueError:
            raise bad(f"{at}: unknown backend {short(backend)}") from None
        size, buffer = math.prod(shape), leaf.get("buffer", False)
        ok = leaf.get("size") == size < MAX_COUNT
        need(ok, where, f"{at}: size", leaf.get("size"), f"{size}, as its shape {shape} says")
        need(leaf.get("offset") == offset, where, f"{at}: offset", leaf.get("offset"), offset)
        need(isinstance(buffer, bool), where, f"{at}: buffer", buffer, "true or false")
        leaves.append(
            tree_lib.LeafSpec(
                keys, name, tuple(shape), leaf["dtype"], backend, offset, size, buffer
            )
        )
        offset += size
        if offset >= MAX_COUNT:
            raise bad(f"{at}: the leaves hold 2**62 elements or more")
    need(data.get("size") == offset, where, "size", data.get("size"), f"{offset}, as its leaves")
    counted = 0  # the stored leaves the tree's nodes name

    def node(data: Any, depth: int) -> tree_lib.TreeDef:
        """A node of plain containers (see :func:`stalewise.checkpoint.load_params`)."""
        nonlocal counted
        if depth > _MAX_DEPTH:
            raise bad(f"the tree is nested more than {_MAX_DEPTH} levels deep")
        need(isinstance(data, dict), where, "a tree node", data, "an object")
        kind, keys, children = data.get("kind"), data.get("keys", []), data.get("children", [])
        if kind not in KINDS:
            raise bad(f"unknown tree node kind {short(kind)} (known: {', '.join(KINDS)})")
        if not (
            isinstance(keys, list) and isinstance(children, list) and len(keys) == len(children)
        ):
            raise bad(f"a {kind} node's keys and children are not two lists of one length")
        if kind in ("leaf", "alias", "const", "none") and keys:
            raise bad(f"a {kind} node has children")
        static = data.get("static", []) if live else []
        need(isinstance(static, list), where, f"a {kind} node's static", static, "a list")
        static = tuple(_pair(p) for p in static)
        if live and kind == "alias":
            data = {"leaf": dict(static).get("leaf")}
        if kind == "leaf":
            counted += 1
            return tree_lib.TreeDef("leaf")
        if kind == "alias":
            index = data.get("leaf")
            if not is_count(index, len(leaves)):
                raise bad(f"an alias names leaf {short(index)}, there are {len(leaves)}")
            return tree_lib.TreeDef("alias", static=(("leaf", index),))
        if kind == "const":  # a checkpoint's is the job's own (from like=), else None
            return tree_lib.TreeDef("const", static=static or (("value", None),))
        if kind == "none":
            return tree_lib.TreeDef("none")
        keys = tuple(key(k, f"a {kind} node") for k in keys)
        kids = tuple(node(c, depth + 1) for c in children)
        if kind in ("list", "tuple"):
            if keys != tuple(range(len(kids))):
                raise bad(f"a {kind} node's keys are not 0..{len(kids) - 1}")
            return tree_lib.TreeDef(kind, keys, kids, None, static)
        ordered = kind == "dict" and data.get("ordered") is True
        if live and kind != "dict":
            return tree_lib.TreeDef(kind, keys, kids, _class(kind, data.get("type")), static)
        if live:
            return tree_lib.TreeDef(kind, keys, kids, OrderedDict if ordered else dict, static)
        # a dict, or a user's container as a dict of its field names
        plain = tuple(str(k) if isinstance(k, str) else k for k in keys)
        if len(set(plain)) != len(plain):
            raise bad(f"a {kind} node has a key twice: {short(list(plain))}")
        return tree_lib.TreeDef("dict", plain, kids, OrderedDict if ordered else dict)

    treedef = node(data.get("tree"), 0)
    if counted != len(leaves):
        raise bad(f"the tree holds {counted} leaves, the leaf table {len(leaves)}")
    return tree_lib.FlatSpec(tuple(leaves), treedef, np.dtype(dtype), offset)


def _key_to_json(k: Any) -> list:
    for cls, kind in ((tree_lib.HiddenKey, "hidden"), (tree_lib.AttrKey, "attr"), (str, "str")):
        if isinstance(k, cls):
            return [kind, str(k)]
    return ["int", int(k)] if isinstance(k, int) and not isinstance(k, bool) else ["repr", repr(k)]


def _key_from_json(k: Any, where: str) -> Any:
    if not (isinstance(k, list) and len(k) == 2 and k[0] in _KEY_KINDS):
        raise NotData(f"{where}: key {short(k)} is not one of [{'|'.join(_KEY_KINDS)}, x]")
    kind, value = k
    if type(value) is not (int if kind == "int" else str):
        raise NotData(
            f"{where}: key {short(k)}: expected {'an integer' if kind == 'int' else 'a string'}"
        )
    return {"hidden": tree_lib.HiddenKey, "attr": tree_lib.AttrKey}.get(kind, lambda v: v)(value)


def _treedef_to_json(node: tree_lib.TreeDef, live: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": node.kind,
        "keys": [_data(k) if live else _key_to_json(k) for k in node.keys],
        "children": [_treedef_to_json(c, live) for c in node.children],
    }
    if live:  # the door: every static value, and a class the reader looks up
        if node.kind == "registry":
            raise NotData(f"a registry container of type {node.cls.__qualname__}")
        out["static"] = [[name, _data(value)] for name, value in node.static]
    if node.kind == "alias" and not live:
        out["leaf"] = int(dict(node.static)["leaf"])
    elif node.kind == "dict" and node.cls is OrderedDict:
        out["ordered"] = True
    elif live and node.kind in ("namedtuple", "dataclass"):
        out["type"] = [node.cls.__module__, node.cls.__qualname__]
    elif node.kind in ("namedtuple", "dataclass", "registry") and node.cls is not None:
        out["type"] = f"{node.cls.__module__}.{node.cls.__qualname__}"  # never imported
    return out


def _data(x: Any) -> Any:
    """``x`` as JSON, tagged where JSON would lose its type; :func:`_value` reads it back."""
    if x is None or type(x) in (bool, int, float, str):
        return x
    if isinstance(x, tree_lib.HiddenKey | tree_lib.AttrKey):
        return {"hidden" if isinstance(x, tree_lib.HiddenKey) else "attr": str(x)}
    if type(x) in (tuple, list):
        return {type(x).__name__: [_data(v) for v in x]}
    if isinstance(x, np.ndarray | np.generic) and x.dtype.kind in "biuf":
        a = np.ascontiguousarray(x)
        data = base64.b64encode(a.tobytes()).decode()
        return {"array": a.dtype.str, "shape": list(a.shape), "data": data,
                "scalar": isinstance(x, np.generic)}  # fmt: skip
    raise NotData(f"a constant of type {type(x).__qualname__}")


def _value(x: Any) -> Any:
    if x is None or type(x) in (bool, int, float, str):
        return x
    tag = next(iter(x), None) if isinstance(x, dict) else None
    if len(x or ()) == 1 and tag in ("hidden", "attr") and isinstance(x[tag], str):
        return (tree_lib.HiddenKey if tag == "hidden" else tree_lib.AttrKey)(x[tag])
    if len(x or ()) == 1 and tag in ("tuple", "list") and isinstance(x[tag], list):
        items = [_value(v) for v in x[tag]]
        return tuple(items) if tag == "tuple" else items
    if tag is not None and sorted(x) == ["array", "data", "scalar", "shape"]:
        dtype, shape, data = np.dtype(str(x["array"])), x["shape"], x["data"]
        if dtype.kind not in "biuf" or not isinstance(shape, list) or not all(map(is_count, shape)):
            raise NotData(f"an array of dtype {dtype} and shape {short(shape)}")
        a = np.frombuffer(base64.b64decode(str(data), validate=True), dtype).reshape(shape)
        return a.copy()[()] if x["scalar"] is True else a.copy()
    raise NotData(f"a value {short(x)}")


def _pair(v: Any) -> tuple[str, Any]:
    if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)):
        raise NotData(f"a static field {short(v)}")
    return v[0], _value(v[1])


def _class(kind: str, cls: Any) -> type:
    """The namedtuple or dataclass ``cls`` ([module, qualname]) names, among modules imported."""
    if not (kind in ("namedtuple", "dataclass") and isinstance(cls, list) and len(cls) == 2):
        raise NotData(f"a {kind} of class {short(cls)}")
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
