"""The Ray runtime: the job's shards and workers as Ray actors, on one machine or a cluster.

For a loop you own, ``job.serve(runtime="ray", name=...)`` serves the shards
and ``sw.attach(name)`` attaches from any driver, task or actor
(:mod:`~stalewise.runtime.ray.server`, :mod:`~stalewise.runtime.ray.client`), and
``stalewise run --runtime ray`` runs a script once per worker as Ray actors
(:mod:`~stalewise.runtime.ray.launch`). The rest of this docstring is about
``job.train(..., runtime="ray")`` (``stalewise train CONFIG --runtime ray``), which
hosts the same protocol objects as the local runtime: each shard is a
:class:`~stalewise.runtime.ray.shard.ShardActor` holding one
:class:`~stalewise.protocol.Shard`, each worker a
:class:`~stalewise.runtime.ray.worker.WorkerActor` running the one worker loop
with your ``loss_and_grad`` and data, and this process (the *driver*,
:mod:`~stalewise.runtime.ray.train`) evaluates, records, checkpoints and
stops the job as the local runtime's parent does. ``import stalewise`` does
not import Ray; this runtime imports it when it runs.

Where it runs: the Ray instance this process is connected to, else the one
:func:`connect` picks: the address you gave, else ``RAY_ADDRESS``, else a new
local instance (shut down when the run ends), never the cluster Ray's own
default would join (see :func:`cluster_address`). Each shard goes on a
node of its own when the cluster has enough nodes (a ``STRICT_SPREAD``
placement group; else ``SPREAD``), and the workers are spread too (a second one). Each actor asks for one CPU, or for the largest
equal share that the nodes' CPUs hold when there are fewer CPUs than actors.
Actors are named ``stalewise:RUN:TOKEN:shard-K`` and
``stalewise:RUN:TOKEN:worker-W.INCARNATION`` in the driver's namespace
(``ray.util.list_named_actors()``).

Bytes: a push is put into the object store once, by its sender, and every
shard copies its slice out of it in place (zero-copy on the same node; on
another node Ray moves the whole object there, so with shards on S nodes a
push crosses the network S times). Each shard puts its slice into the object
store once per version it publishes and every pull of that version reads it
(the user's tree views it when there is one shard and NumPy leaves; otherwise
the worker copies the slices into its pull buffer). A worker's next step
overlaps its push's acks; it commits its next push once they are in
(:data:`stalewise.protocol.pipeline.IN_FLIGHT`, as in every runtime).

Codecs (``Job(..., codec=...)``): the worker encodes each update into one
payload per shard (:mod:`stalewise.protocol.sender`), put back to back into the
object store once; each shard decodes and checks its own. The error-feedback
residual outlives the worker's actor: each worker id has a keeper actor, a
:class:`~stalewise.protocol.sender.History` that gets each push's residual
before any shard can have the push, so checkpoints, resumed runs and restarted
incarnations continue from the residual of the last push the shards applied.
Delta pulls (``Job(..., pull_codec=...)``): each shard actor keeps a
:class:`~stalewise.protocol.pulls.PullServer` beside its shard and each worker
actor a :class:`~stalewise.protocol.pulls.Replica` (a new one per
incarnation); a corrupt pull payload is refused and the next pull is full.
``docs/ray.md`` tells the whole of it.

Guarantees (the commit rule, :mod:`stalewise.protocol.commit`): the sender
judges the whole push once and every shard follows that verdict; a push that
reached some shards when its sender died is delivered to the others, exactly
once, and copies of the shards' states (checkpoints, the driver's backups every
``BACKUP_EVERY`` seconds) are consistent cuts (:mod:`stalewise.protocol.delivery`).

Faults, under the job's failure policy (``on_worker_failure``, ``max_restarts``;
see :class:`stalewise.runtime.errors.Failures`): a worker whose actor dies, whose
code raises or that makes no progress for ``worker_timeout`` seconds
(:mod:`~stalewise.runtime.ray.liveness`) is restarted as a new incarnation,
dropped, or stops the job; a shard whose actor dies is restarted by Ray and
every shard is rolled back to the driver's newest copy (the last checkpoint or
backup), every live worker carrying on as a new incarnation (``docs/ray.md``,
"Failures").

Not exact: when the shards are rolled back, each live worker keeps its own
residual (the pushes lost with the rollback lose what they sent, not what
they held back), and checkpoints wait until it has pushed again; a residual
whose keeper died with its node is lost (the worker's next incarnation starts
from zero, with a warning).
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from typing import Any

__all__ = ["cluster_address", "connect"]


def connect(address: str | None = None, **init_kwargs: Any) -> bool:
    """Connects this process to Ray unless it already is; True if this call connected.

    Args:
        address: ``"HOST:PORT"`` of a head node, ``"ray://HOST:PORT"`` (Ray Client),
            ``"auto"``, ``"local"`` (a new local instance) or None (see
            :func:`cluster_address`).
        **init_kwargs: more arguments of ``ray.init`` (``num_cpus``, ...).

    Raises:
        ImportError: Ray is not installed.
        ConnectionError: no cluster at ``address``, or "auto" and no cluster of yours.
    """
    ray = import_ray()
    if ray.is_initialized():
        return False
    ray.init(address=cluster_address(address), include_dashboard=False, **init_kwargs)
    return True


def cluster_address(address: str | None = None) -> str:
    """Where :func:`connect` goes: ``address``, else ``RAY_ADDRESS``, else ``"local"``, a
    new local instance. Never Ray's own default, the cluster last recorded in the file
    ``ray/ray_current_cluster`` of the temporary folder every user of the machine shares:
    it may be another user's, who would then run your functions and read your data.
    ``"auto"`` is the address ``ray start`` recorded there, only if the file is yours.
    """
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
    """None if a job called ``name`` may be served on Ray: this process is connected to Ray,
    or ``RAY_ADDRESS`` names a cluster (``sw.attach``); else why not. Imports no Ray."""
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        return None
    if os.environ.get("RAY_ADDRESS") not in (None, "", "local"):  # "local": a new one
        return None
    return (
        "this process is not connected to Ray (ray.init() or RAY_ADDRESS, for a job served "
        "on a Ray cluster)"
    )
