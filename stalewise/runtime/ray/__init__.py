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

Where it runs: the Ray instance this process is connected to (call
:func:`connect` or ``ray.init`` first, e.g. ``connect("auto")`` on a node of a
cluster started with ``ray start``); if there is none, ``ray.init()`` decides
(``RAY_ADDRESS``, else the cluster last started on this machine, else a new
local instance, which is shut down when the run ends). Each shard goes on a
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
the worker copies the slices into its pull buffer). Pushes are pipelined: up
to :data:`~stalewise.runtime.ray.shard.IN_FLIGHT` unacknowledged per worker.

Codecs (``Job(..., codec=...)``): the worker encodes each update with the
protocol's :class:`~stalewise.protocol.compress.Compressor` into one payload
per shard and puts the payloads, back to back, into the object store once;
each shard hands its own bytes to its protocol shard, which decodes and
validates them (a corrupt or truncated payload is refused and changes
nothing). With several shards the sender's verdict judges the payloads
decoded back. The shards' ``bytes_in`` counts the payloads' bytes.

The codec's error-feedback residual is worker state that outlives an actor
(:mod:`~stalewise.runtime.ray.keeper`): the worker encodes push ``s`` from the
residual of push ``s - 1`` into a second buffer, and hands the new residual
to its worker id's keeper actor before any shard can have the push.
Checkpoints save each worker's residual after the last of its pushes in the
shards' consistent copy (exact, even mid-run), a resumed run gives each
worker id its saved one (:func:`stalewise.checkpoint.feedback_of`), and a
worker's next incarnation starts from the residual of the last push its dead
predecessor committed (or, for a worker whose loop ended, its last push); a
dropped worker's residual stays with its id, in every checkpoint.

Delta pulls (``Job(..., pull_codec=...)``, :mod:`stalewise.protocol.pulls`):
each shard actor keeps a :class:`~stalewise.protocol.pulls.PullServer` beside
its shard and each worker actor a :class:`~stalewise.protocol.pulls.Replica`
(a new one per incarnation). A pull request names the reference the worker
holds; the shard answers with that worker's own payload (the delta against
it, or the full slice) instead of the shared snapshot, and the worker checks
it whole before it changes its copy: a corrupt one is refused, logged, and
the next pull from that shard is full. Under ASP the standing requests carry
the deltas, computed when the shard marks a new version for its followers.
Without a pull codec pulls are the object-store snapshots above, unchanged.

Guarantees (the commit rule, :mod:`stalewise.protocol.commit`): the sender
judges the whole push once and every shard follows that verdict. A push is
*committed* once the first shard has handled it: each shard keeps a view of a
worker's pushes that not every shard has acknowledged yet, and when a
worker's actor dies the driver cuts its connection on every shard (nothing it
sent is handled after that), then delivers the pushes some shard handled to
the shards that lack them (:meth:`Shard.depart
<stalewise.protocol.Shard.depart>` applies a push only if it is the next
one). So a push whose sender dies at any instant is applied by every shard or
by none, exactly once.

Copies of the shards' states (checkpoints, and the driver's backups every
``BACKUP_EVERY`` seconds) are consistent cuts: every shard is frozen and
brought to the same pushes of every worker before it is copied, so no push is
in one shard's copy and not in another's.

Faults, under the job's failure policy (``on_worker_failure``, ``max_restarts``;
see :class:`stalewise.runtime.base.Failures`):

* a worker whose actor dies or whose code raises is restarted as a new
  incarnation at the current parameters, dropped, or stops the job;
* so is a worker that makes no progress (no step, no batch drawn, no wait on
  the shards) for ``worker_timeout`` seconds: the driver asks each worker
  actor for its progress count about every ``min(1, worker_timeout / 4)``
  seconds, on a concurrency group of its own (:mod:`~stalewise.runtime.ray.liveness`),
  and kills (``ray.kill``) one whose count stands still, or that does not
  answer, for that long. One call of the user's ``loss_and_grad`` must take less
  than ``worker_timeout``. A restarted worker must load its data and run its
  warm-up step within ``start_timeout``;
* a shard whose actor dies is restarted by Ray (``max_restarts``) and every
  shard is rolled back to the driver's newest copy (the last checkpoint or
  backup): the pushes applied since that copy are lost on every shard, the
  push count goes back with them, and every live worker carries on as a new
  incarnation. The copy lives in the driver, so it survives the loss of the
  shard's node;
* ``ray stop`` ends the run (Ray ends a driver whose node stops); with
  ``checkpoint_every`` or ``checkpoint_seconds`` the newest checkpoint resumes
  it (``resume=True``, ``stalewise train CONFIG --resume RUN_DIR``).

Not exact: when the shards are rolled back, each live worker keeps its own
residual (the pushes lost with the rollback lose what they sent, not what
they held back), and checkpoints wait until it has pushed again; a residual
whose keeper died with its node is lost (the worker's next incarnation starts
from zero, with a warning).
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["connect"]


def connect(address: str | None = None, **init_kwargs: Any) -> bool:
    """Connects this process to Ray unless it already is; True if this call connected.

    Args:
        address: ``"auto"`` (the cluster this machine is part of, started with
            ``ray start``), ``"HOST:PORT"`` of a head node, ``"ray://HOST:PORT"``
            (Ray Client), ``"local"`` (a new local instance), or None: Ray's
            own rule (``RAY_ADDRESS``, else the cluster last started on this
            machine, else a new local instance).
        **init_kwargs: more arguments of ``ray.init`` (``num_cpus``,
            ``runtime_env``, ...).

    Raises:
        ImportError: Ray is not installed.
        ConnectionError: no cluster at ``address``.

    Example:
        >>> from stalewise.runtime import ray as ray_runtime
        >>> ray_runtime.connect("auto")  # doctest: +SKIP
        True
    """
    ray = import_ray()
    if ray.is_initialized():
        return False
    ray.init(address=address, include_dashboard=False, **init_kwargs)
    return True


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
