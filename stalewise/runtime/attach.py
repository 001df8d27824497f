"""``sw.attach(name)``: a client for a loop you own, of a job served under a name.

A job served with a name (``job.serve(workers=..., name="gpt")``, locally or with
``runtime="ray"``) is found by that name: on this machine through its door
(:mod:`stalewise.runtime.local.attach`), or on the Ray cluster this process is
connected to through its door actor (:mod:`stalewise.runtime.ray.client`).
``runtime=None`` picks the one that serves the name: a local door of that name
first, else Ray when this process is connected to Ray (``ray.init``, or inside a
Ray task or actor) or ``RAY_ADDRESS`` names a cluster. ``import stalewise`` does
not import Ray, and attaching to a local job never does.
"""

from __future__ import annotations

import os
import re
import sys
from typing import Any

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

RUNTIMES = ("local", "ray")  # the runtimes a process can attach to


class AttachError(RuntimeError):
    """A process could not attach to a served job (one line says why)."""


def check_name(name: Any) -> str:
    """``name`` if it can name a served job (letters, digits, ``_.-``; at most 64)."""
    if not (isinstance(name, str) and _NAME.fullmatch(name)):
        raise ValueError(
            f"job name {name!r}: use 1-64 letters, digits, '_', '.' or '-', starting with a "
            "letter or digit"
        )
    return name


def _ray_reachable() -> bool:
    """Whether this process is connected to Ray, or ``RAY_ADDRESS`` names a cluster."""
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        return True
    return os.environ.get("RAY_ADDRESS") not in (None, "", "local")  # "local": a new one


def attach(
    name: str,
    *,
    worker: int | None = None,
    timeout: float | None = 30.0,
    runtime: str | None = None,
) -> Any:
    """A client for a worker of the job served under ``name``.

    Args:
        name: the ``name=`` the job was served with (:meth:`stalewise.Job.serve`).
        worker: the worker id to take (a new incarnation of it); None: the lowest free one.
        timeout: seconds to wait for the job's door (None: no limit).
        runtime: ``"local"`` or ``"ray"``; None: the one that serves ``name`` (see the
            module docstring).

    Returns:
        A client whose ``worker`` and ``incarnation`` say who it is: the local
        runtime's :class:`~stalewise.runtime.local.client.Client`, or a
        :class:`~stalewise.runtime.ray.client.RayClient`. Closing it (or the end of
        this process) gives its worker id back.

    Raises:
        AttachError: no job of that name is served, or its door refused (why).
    """
    from stalewise.runtime.local import attach as local

    check_name(name)
    if runtime is not None and runtime not in RUNTIMES:
        raise AttachError(f"runtime {runtime!r}: a process attaches to 'local' or 'ray'")
    if runtime is None:
        try:
            here = os.path.lexists(local.door_path(name))
        except AttachError:  # an attach folder stalewise will not use: none served here
            if not _ray_reachable():
                raise
            here = False
        if here:
            runtime = "local"
        elif _ray_reachable():
            runtime = "ray"
        else:
            raise AttachError(
                f"no job named {name!r} is served on this machine ({local.door_path(name)} "
                "is missing), and this process is not connected to Ray (ray.init() or "
                "RAY_ADDRESS, for a job served on a Ray cluster)"
            )
    if runtime == "local":
        return local.attach(name, worker=worker, timeout=timeout)
    from stalewise.runtime.ray.client import attach as ray_attach

    return ray_attach(name, worker=worker, timeout=timeout)
