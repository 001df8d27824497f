"""``sw.attach(name)``: a client for a loop you own, of a job served under a name: a local
door of that name first, else Ray when connected to Ray or ``RAY_ADDRESS`` names a cluster."""

from __future__ import annotations

import re
from typing import Any

from stalewise import runtime as runtime_lib

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


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
        runtime: ``"local"`` or ``"ray"``; None: the one that serves ``name``.

    Returns a client whose ``worker`` and ``incarnation`` say who it is; closing it gives its
    worker id back. AttachError: no job of that name is served, or its door refused (why)."""
    check_name(name)
    able = runtime_lib.names("attach")
    if runtime is not None and runtime not in able:
        raise AttachError(
            f"runtime {runtime!r}: a process attaches to {' or '.join(map(repr, able))}"
        )
    found = runtime_lib.describe(runtime or _serving(name, able))
    return found.load("attach")(name, worker=worker, timeout=timeout)


def _serving(name: str, able: tuple[str, ...]) -> str:
    """The first runtime of ``able`` that may serve ``name``, else an AttachError."""
    why_not, refused = [], None
    for runtime in map(runtime_lib.describe, able):
        if runtime.serves is None:  # attached to only when named
            continue
        try:
            why = runtime.load("serves")(name)
        except AttachError as e:  # e.g. an attach folder stalewise will not use
            refused = refused or e
            continue
        if why is None:
            return runtime.name
        why_not.append(why)
    if refused is not None:
        raise refused
    raise AttachError(f"no job named {name!r} is served {', and '.join(why_not)}")
