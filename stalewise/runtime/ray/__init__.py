"""The Ray runtime: shards, workers as actors on the Ray connected or :func:`cluster_address`."""

from __future__ import annotations

import errno
import os
import stat
import sys
from typing import Any

__all__ = ["cluster_address", "connect"]


def connect(address: str | None = None, **init_kwargs: Any) -> bool:
    """Connects this process to Ray at ``address`` (:func:`cluster_address`) unless it already
    is; True if this call connected. ConnectionError if no cluster of yours is there."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    ray.init(address=cluster_address(address), include_dashboard=False, **init_kwargs)
    return True


def cluster_address(address: str | None = None) -> str:
    """Where :func:`connect` goes: ``address``, else ``RAY_ADDRESS``, else ``"local"``."""
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    if address != "auto":
        return address
    base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    record = os.path.join(base, "ray", "ray_current_cluster")
    try:
        fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        why = "a symlink" if e.errno == errno.ELOOP else e.strerror
        raise ConnectionError(f"address 'auto': {record}: {why}; give HOST:PORT") from None
    with os.fdopen(fd) as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise ConnectionError(
                f"address 'auto': {record} is not a file of yours (its owner is uid "
                f"{st.st_uid}, you are uid {os.getuid()}): give HOST:PORT of your cluster"
            )
        found = f.read(1024).strip()
    if not found:
        raise ConnectionError(f"address 'auto': {record} is empty; give HOST:PORT")
    return found


def import_ray() -> Any:
    """The ``ray`` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            f"the Ray runtime needs Ray: pip install 'stalewise[ray]' ({e})"
        ) from None
    return ray


def serves(name: str) -> str | None:
    """None if a job may be served on Ray (connected, or ``RAY_ADDRESS``), else why not."""
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        return None
    if os.environ.get("RAY_ADDRESS") not in (None, "", "local"):  # "local": a new one
        return None
    return "this process is not connected to Ray (ray.init() or RAY_ADDRESS names a cluster)"
