"""Runtimes host the protocol's shards and worker loop; they are looked up by name.

A runtime is a function ``run(config, strategy, options) -> TrainResult``
(``config`` a :class:`~stalewise.protocol.ServerConfig`, ``options`` a
:class:`~stalewise.runtime.options.RunOptions`). Built in: ``"local"`` (OS
processes on this machine), ``"sim"`` (the deterministic simulator) and ``"ray"``
(Ray actors, on a cluster; needs ``pip install stalewise[ray]``).
:func:`register` adds one; its module is imported only when it is used.

Example:
    >>> from stalewise import runtime
    >>> runtime.names()
    ('local', 'sim', 'ray')
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

_REGISTRY: dict[str, str | Callable[..., Any]] = {
    "local": "stalewise.runtime.local.train:run",
    "sim": "stalewise.runtime.sim:run",
    "ray": "stalewise.runtime.ray.train:run",
}


def register(name: str, runner: str | Callable[..., Any]) -> None:
    """Registers a runtime: a ``run(config, strategy, options)`` function or its ``"module:name"``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a runtime needs a non-empty name, got {name!r}")
    _REGISTRY[name] = runner


def names() -> tuple[str, ...]:
    """The names of the known runtimes."""
    return tuple(_REGISTRY)


def get(name: str) -> Callable[..., Any]:
    """The ``run`` function of the runtime called ``name``."""
    try:
        runner = _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown runtime {name!r}; known: {', '.join(_REGISTRY)}") from None
    if isinstance(runner, str):
        module, _, attr = runner.partition(":")
        runner = getattr(importlib.import_module(module), attr)
    return runner
