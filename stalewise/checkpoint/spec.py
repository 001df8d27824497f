"""The tree spec of a checkpoint's parameters as JSON: plain data only.

Nothing in a manifest is unpickled or imported. A node of the tree is {"kind", "keys",
"children"} with kind from :data:`KINDS`, plus "leaf" (an alias: the stored leaf it
names), "ordered" (an OrderedDict) or "type" (a namedtuple's, dataclass's or registered
container's class, "module.QualName": for people reading it, never imported). A key is
[kind, value]: "str", "int", "attr" (a field), "hidden" (a field left out of leaf names),
or "repr" (any other key, as its repr; it comes back as that string).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import numpy as np

from stalewise import tree as tree_lib

KINDS = ("leaf", "alias", "const", "none", "dict", "list", "tuple")
KINDS += ("namedtuple", "dataclass", "registry")
_KEY_KINDS = ("str", "int", "attr", "hidden", "repr")
MAX_COUNT = 2**62  # counts and sizes in a manifest are ints in [0, 2**62)
_MAX_DEPTH = 256  # nesting of the tree


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a message stays one short line)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_count(value: Any, limit: int = MAX_COUNT) -> bool:
    return type(value) is int and 0 <= value < limit


def spec_to_json(spec: tree_lib.FlatSpec) -> dict[str, Any]:
    """A FlatSpec as plain JSON data (no pickles, no import paths to follow)."""
    return {
        "dtype": spec.dtype.name,
        "size": int(spec.size),
        "leaves": [
            {
                "path": [_key_to_json(k) for k in leaf.path],
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
        "tree": _treedef_to_json(spec.treedef),
    }


def spec_from_json(data: Any, where: str = "spec") -> tree_lib.FlatSpec:
    """The FlatSpec of :func:`spec_to_json`'s data, of plain containers only (see
    :func:`stalewise.checkpoint.load_params`); every field checked. Imports and
    unpickles nothing.

    Raises:
        ValueError: one line naming the bad field (a CheckpointError when loading).
    """

    def bad(what: str) -> ValueError:
        return ValueError(f"{where}: {what}")

    from stalewise.backends import FLOAT_DTYPES, get_backend

    if not isinstance(data, dict):
        raise bad(f"expected an object, got {short(data)}")
    dtype = data.get("dtype")
    if dtype not in ("float32", "float64"):
        raise bad(f"dtype is {short(dtype)}, expected 'float32' or 'float64'")
    raw = data.get("leaves")
    if not isinstance(raw, list):
        raise bad(f"leaves is {short(raw)}, expected a list")
    leaves, offset = [], 0
    for i, leaf in enumerate(raw):
        at = f"leaf {i}"
        if not isinstance(leaf, dict):
            raise bad(f"{at} is {short(leaf)}, expected an object")
        path = leaf.get("path")
        if not isinstance(path, list) or len(path) > _MAX_DEPTH:
            raise bad(f"{at}: path is {short(path)}, expected a list of keys")
        keys = tuple(_key_from_json(k, f"{where}: {at}: path") for k in path)
        name, shape = leaf.get("name"), leaf.get("shape")
        if not isinstance(name, str):
            raise bad(f"{at}: name is {short(name)}, expected a string")
        at = f"leaf {name!r}"
        if not isinstance(shape, list) or len(shape) > 64 or not all(map(is_count, shape)):
            raise bad(f"{at}: shape is {short(shape)}, expected a list of counts")
        if leaf.get("dtype") not in FLOAT_DTYPES:
            raise bad(f"{at}: dtype is {short(leaf.get('dtype'))}, expected one of {FLOAT_DTYPES}")
        backend = leaf.get("backend")
        try:
            get_backend(backend) if isinstance(backend, str) else get_backend("")
        except ValueError:
            raise bad(f"{at}: unknown backend {short(backend)}") from None
        size = math.prod(shape)
        if leaf.get("size") != size or size >= MAX_COUNT:
            raise bad(f"{at}: size is {short(leaf.get('size'))}, its shape {shape} says {size}")
        if leaf.get("offset") != offset:
            raise bad(f"{at}: offset is {short(leaf.get('offset'))}, expected {offset}")
        buffer = leaf.get("buffer", False)
        if not isinstance(buffer, bool):
            raise bad(f"{at}: buffer is {short(buffer)}, expected true or false")
        leaves.append(
            tree_lib.LeafSpec(
                keys, name, tuple(shape), leaf["dtype"], backend, offset, size, buffer
            )
        )
        offset += size
        if offset >= MAX_COUNT:
            raise bad(f"{at}: the leaves hold 2**62 elements or more")
    if data.get("size") != offset:
        raise bad(f"size is {short(data.get('size'))}, its leaves hold {offset} elements")
    counted = 0  # the stored leaves the tree's nodes name

    def node(data: Any, depth: int) -> tree_lib.TreeDef:
        """A node of plain containers (see :func:`stalewise.checkpoint.load_params`)."""
        nonlocal counted
        if depth > _MAX_DEPTH:
            raise bad(f"the tree is nested more than {_MAX_DEPTH} levels deep")
        if not isinstance(data, dict):
            raise bad(f"a tree node is {short(data)}, expected an object")
        kind, keys, children = data.get("kind"), data.get("keys", []), data.get("children", [])
        if kind not in KINDS:
            raise bad(f"unknown tree node kind {short(kind)} (known: {', '.join(KINDS)})")
        if not (
            isinstance(keys, list) and isinstance(children, list) and len(keys) == len(children)
        ):
            raise bad(f"a {kind} node's keys and children are not two lists of one length")
        if kind in ("leaf", "alias", "const", "none") and keys:
            raise bad(f"a {kind} node has children")
        if kind == "leaf":
            counted += 1
            return tree_lib.TreeDef("leaf")
        if kind == "alias":
            index = data.get("leaf")
            if not is_count(index, len(leaves)):
                raise bad(f"an alias names leaf {short(index)}, there are {len(leaves)}")
            return tree_lib.TreeDef("alias", static=(("leaf", index),))
        if kind == "const":  # not stored: the value is the job's own (from like=), else None
            return tree_lib.TreeDef("const", static=(("value", None),))
        if kind == "none":
            return tree_lib.TreeDef("none")
        keys = tuple(_key_from_json(k, f"{where}: a {kind} node") for k in keys)
        kids = tuple(node(c, depth + 1) for c in children)
        if kind in ("list", "tuple"):
            if keys != tuple(range(len(kids))):
                raise bad(f"a {kind} node's keys are not 0..{len(kids) - 1}")
            return tree_lib.TreeDef(kind, keys, kids)
        # a dict, or a user's container as a dict of its field names
        plain = tuple(str(k) if isinstance(k, str) else k for k in keys)
        if len(set(plain)) != len(plain):
            raise bad(f"a {kind} node has a key twice: {short(list(plain))}")
        ordered = kind == "dict" and data.get("ordered") is True
        return tree_lib.TreeDef("dict", plain, kids, OrderedDict if ordered else dict)

    treedef = node(data.get("tree"), 0)
    if counted != len(leaves):
        raise bad(f"the tree holds {counted} leaves, the leaf table {len(leaves)}")
    return tree_lib.FlatSpec(tuple(leaves), treedef, np.dtype(dtype), offset)


def _key_to_json(k: Any) -> list:
    if isinstance(k, tree_lib.HiddenKey):
        return ["hidden", str(k)]
    if isinstance(k, tree_lib.AttrKey):
        return ["attr", str(k)]
    if isinstance(k, str):
        return ["str", str(k)]
    if isinstance(k, int) and not isinstance(k, bool):
        return ["int", int(k)]
    return ["repr", repr(k)]


def _key_from_json(k: Any, where: str) -> Any:
    if not (isinstance(k, list) and len(k) == 2 and k[0] in _KEY_KINDS):
        raise ValueError(f"{where}: key {short(k)} is not one of [{'|'.join(_KEY_KINDS)}, x]")
    kind, value = k
    if kind == "int":
        if type(value) is not int:
            raise ValueError(f"{where}: key {short(k)}: expected an integer")
        return value
    if not isinstance(value, str):
        raise ValueError(f"{where}: key {short(k)}: expected a string")
    if kind == "hidden":
        return tree_lib.HiddenKey(value)
    if kind == "attr":
        return tree_lib.AttrKey(value)
    return value


def _treedef_to_json(node: tree_lib.TreeDef) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": node.kind,
        "keys": [_key_to_json(k) for k in node.keys],
        "children": [_treedef_to_json(c) for c in node.children],
    }
    if node.kind == "alias":
        out["leaf"] = int(dict(node.static)["leaf"])
    elif node.kind == "dict" and node.cls is OrderedDict:
        out["ordered"] = True
    elif node.kind in ("namedtuple", "dataclass", "registry") and node.cls is not None:
        out["type"] = f"{node.cls.__module__}.{node.cls.__qualname__}"  # never imported
    return out
