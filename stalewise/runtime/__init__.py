"""Runtimes host the protocol's shards and worker loop; they are looked up by name.

A runtime is a function ``run(config, strategy, options) -> TrainResult``
(``config`` a :class:`~stalewise.protocol.ServerConfig`, ``options`` a
:class:`~stalewise.runtime.options.RunOptions`), and optionally a *server*: a
factory ``server(config, workers, *, join_timeout)`` whose result starts the
shards for a loop the user owns (what :meth:`stalewise.Job.serve` returns).
Built in: ``"local"`` (OS processes on this machine; it has a server), ``"sim"``
(the deterministic simulator) and ``"ray"`` (Ray actors, on a cluster; it has a
server too; needs ``pip install stalewise[ray]``). :func:`register` adds one; its module is
imported only when it is used. Everything that lists or checks runtime names
(``Job.train``, ``Job.serve``, the config file, the CLI) reads this registry when
it runs, so a runtime registered later is known to all of them.

Example:
    >>> from stalewise import runtime
    >>> runtime.names()
    ('local', 'sim', 'ray')
    >>> runtime.servers()
    ('local', 'ray')
    >>> runtime.get("nowhere")
    Traceback (most recent call last):
    ...
    ValueError: unknown runtime 'nowhere'; known: local, sim, ray
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

_RUNNERS: dict[str, str | Callable[..., Any]] = {
    "local": "stalewise.runtime.local.train:run",
    "sim": "stalewise.runtime.sim:run",
    "ray": "stalewise.runtime.ray.train:run",
}
_SERVERS: dict[str, str | Callable[..., Any]] = {
    "local": "stalewise.runtime.local.server:LocalServer",
    "ray": "stalewise.runtime.ray.server:RayServer",
}


def register(
    name: str,
    runner: str | Callable[..., Any],
    *,
    server: str | Callable[..., Any] | None = None,
) -> None:
    """Registers a runtime: its ``run(config, strategy, options)`` function and, optionally,
    its ``server(config, workers, *, join_timeout)`` factory, each a callable or its
    ``"module:name"``. Registering a name again replaces it (its server too)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a runtime needs a non-empty name, got {name!r}")
    for what, value in (("runner", runner), ("server", server)):
        if (value is not None or what == "runner") and not (callable(value) or _is_path(value)):
            raise ValueError(
                f"runtime {name!r}: {what} must be a callable or a 'module:name' string, "
                f"got {value!r}"
            )
    _RUNNERS[name] = runner
    if server is None:
        _SERVERS.pop(name, None)
    else:
        _SERVERS[name] = server


def names() -> tuple[str, ...]:
    """The names of the known runtimes."""
    return tuple(_RUNNERS)


def servers() -> tuple[str, ...]:
    """The names of the runtimes that have a server (see :meth:`stalewise.Job.serve`)."""
    return tuple(n for n in _RUNNERS if n in _SERVERS)


def get(name: str) -> Callable[..., Any]:
    """The ``run`` function of the runtime called ``name``."""
    return _resolve(_RUNNERS[_known(name)])


def server(name: str) -> Callable[..., Any]:
    """The server factory of the runtime called ``name``."""
    if _known(name) not in _SERVERS:
        raise ValueError(
            f"runtime {name!r} has no server for a loop you own; runtimes with one: "
            f"{', '.join(servers()) or 'none'}"
        )
    return _resolve(_SERVERS[name])


def _known(name: Any) -> str:
    if not isinstance(name, str) or name not in _RUNNERS:
        raise ValueError(f"unknown runtime {name!r}; known: {', '.join(_RUNNERS)}")
    return name


def _is_path(value: Any) -> bool:
    return isinstance(value, str) and value.count(":") == 1 and all(value.split(":"))


def _resolve(target: str | Callable[..., Any]) -> Callable[..., Any]:
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        target = getattr(importlib.import_module(module), attr)
    return target
