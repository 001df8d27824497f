"""Containers :mod:`stalewise.tree` does not know, split one level at a time by the pytree registry
of a framework already imported into a :class:`Level` (:func:`rebuild` turns it back)."""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

__all__ = ["Level", "is_static", "model_view", "rebuild", "split"]


class Level(NamedTuple):
    """One level of a registered container."""

    via: str  # "jax" | "torch" | "tf": the registry that split it
    cls: type  # the container's type
    keys: tuple  # one per child: ("item", key), ("attr", name) or ("hidden", name)
    children: tuple
    template: Any  # what rebuild needs besides the children (picklable)
    buffer: bool = False  # the children are buffers (an nnx Variable other than Param)
    holder: Any = None  # the children are written through it (an nnx Variable)


def split(x: Any) -> Level | None:
    """``x`` split one level by the first registry that knows its type, else None."""
    for how in (_split_jax, _split_torch, _split_tf):
        level = how(x)
        if level is not None:
            return level
    return None


def rebuild(via: str, cls: type, template: Any, children: tuple) -> Any:
    """A container like the one :func:`split` made ``template`` from, around ``children``."""
    if via == "jax":
        import jax

        tu = jax.tree_util
        treedef = template
        if not isinstance(template, tu.PyTreeDef):
            treedef = tu.tree_structure(template, is_leaf=lambda y: y is not template)
        return tu.tree_unflatten(treedef, list(children))
    if via == "torch":
        from torch.utils import _pytree

        return _pytree.SUPPORTED_NODES[cls].unflatten_fn(list(children), template)
    return cls.__tf_unflatten__(template, tuple(children))


def model_view(x: Any) -> Any | None:
    """What a flax nnx ``Module`` shares: its ``nnx.State`` without RNG state; else None."""
    nnx = sys.modules.get("flax.nnx")
    if nnx is None or not isinstance(x, nnx.Module):
        return None
    return nnx.state(x, nnx.Not(nnx.RngState))


def is_static(x: Any) -> bool:
    """Whether ``x`` is structure, not data: a flax nnx ``GraphDef`` (``nnx.split``'s first part)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(x, nnx.GraphDef)


def _split_jax(x: Any) -> Level | None:
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    tu = jax.tree_util
    found, treedef = tu.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    if tu.treedef_is_leaf(treedef):
        return None
    nnx = sys.modules.get("flax.nnx")
    variable = nnx is not None and isinstance(x, nnx.Variable)
    keys = tuple(_jax_key(path[0], hidden=variable) for path, _ in found)
    try:  # a copy holding no arrays: a PyTreeDef of some classes does not survive pickling
        template = tu.tree_unflatten(treedef, [None] * len(found))
    except Exception:
        template = treedef
    return Level(
        "jax",
        type(x),
        keys,
        tuple(child for _, child in found),
        template,
        buffer=variable and not isinstance(x, nnx.Param),
        holder=x if variable else None,
    )


def _jax_key(k: Any, hidden: bool) -> tuple[str, Any]:
    for attr, kind in (("key", "item"), ("idx", "item"), ("name", "attr")):
        if hasattr(k, attr):
            value = getattr(k, attr)
            return ("hidden" if hidden and kind == "attr" else kind), value
    return "item", str(k)


def _split_torch(x: Any) -> Level | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    from torch.utils import _pytree

    node = _pytree.SUPPORTED_NODES.get(type(x))
    if node is None:
        return None
    if node.flatten_with_keys_fn is not None:
        pairs, context = node.flatten_with_keys_fn(x)
        keys = tuple(_torch_key(k) for k, _ in pairs)
        children = tuple(c for _, c in pairs)
    else:
        children, context = node.flatten_fn(x)
        keys = tuple(("item", i) for i in range(len(children)))
    return Level("torch", type(x), keys, tuple(children), context)


def _torch_key(k: Any) -> tuple[str, Any]:
    if hasattr(k, "name"):
        return "attr", k.name
    return "item", getattr(k, "key", getattr(k, "idx", k))


def _split_tf(x: Any) -> Level | None:
    if "tensorflow" not in sys.modules or not hasattr(type(x), "__tf_flatten__"):
        return None
    metadata, components = x.__tf_flatten__()
    keys = tuple(("item", i) for i in range(len(components)))
    return Level("tf", type(x), keys, tuple(components), metadata)
