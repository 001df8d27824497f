"""A loop you own, on Ray: a client of a served job's shard actors, attached by name.

``job.serve(runtime="ray", workers=(1, 8), name="gpt")`` starts the job's shard
actors and a *door* actor, named in the ``stalewise`` namespace
(:mod:`stalewise.runtime.ray.server`); any driver, task or actor of the cluster
then calls ``sw.attach("gpt")`` (:func:`attach`): the door chooses the worker id
and a new incarnation of it, every shard admits it (a late joiner at the slowest
live clock, :attr:`RayClient.joined_at`), and the client gets the shards' handles.

:class:`RayClient` has the local runtime's client's calls and meaning: ``pull``
(read-your-writes unless ``own=False``; :attr:`~RayClient.pull_has_own`),
``push``, ``wait``, ``close``, the budget (:attr:`~RayClient.job_pushes`,
:meth:`~RayClient.may_begin`) and :attr:`~RayClient.stopping`. Its pushes go
through the worker actors' :class:`~stalewise.runtime.ray.outbox.Outbox`; one
is in flight at a time. :meth:`~RayClient.close` has the door apply the commit
rule (:func:`stalewise.runtime.ray.cluster.depart`), so the last push is on
every shard or on none. A small *lease* actor owned by the attaching process
dies with it (Ray's fate-sharing), and the door then departs the worker the
same way and frees its id.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import numpy as np

from stalewise.protocol import PushResult, ServerConfig, budget, pipeline
from stalewise.runtime.base import PullsIntoTrees
from stalewise.runtime.errors import BudgetSpent, ServerClosed, ShardError
from stalewise.runtime.ray import import_ray
from stalewise.runtime.ray.outbox import Outbox

log = logging.getLogger(__name__)

NAMESPACE = "stalewise"  # the Ray namespace of every served job's named actors
CLOSE_WAIT = 30.0  # seconds close() waits for the last push's acks and the door


def door_name(name: str) -> str:
    """The Ray actor name of the door of the job served as ``name``."""
    return f"stalewise:{name}"


class Lease:
    """An actor owned by the attached process: it dies with that process (Ray's
    fate-sharing), which the door sees as its :meth:`watch` failing."""

    async def watch(self) -> None:
        import asyncio

        await asyncio.get_running_loop().create_future()


class RayClient(PullsIntoTrees):
    """One incarnation of a worker id of a job served on Ray; see the module docstring.

    Made by :func:`attach` (or ``server.client()``); belongs to one thread of the
    process that made it. Every blocking call takes a ``timeout`` in seconds.
    """

    def __init__(
        self,
        name: str,
        door: Any,
        lease: Any,
        info: dict,
    ):
        self.name = name
        self.worker: int = info["worker"]
        self.incarnation: int = info["incarnation"]
        #: the clock the shards started this incarnation at (a late joiner's is the job's)
        self.joined_at: int = info["joined_at"]
        self.workers: int = info["workers"]  # the worker ids the job has room for
        self._expected: int = info["expected"] or self.workers  # those expected from the start
        config: ServerConfig = info["config"]
        self._rounds = config.consistency.averages_rounds
        self._door, self._lease = door, lease
        self._shards = list(info["shards"])
        self._spec = config.spec
        self._gated = pipeline.exact_pulls(config)
        # the protocol's sending side; with error feedback, from the residual the id's
        # last incarnation left with (None: zeros)
        self._out = Outbox(config, self._shards, self.worker, residual=info["residual"], buffers=1)
        self._pull_buf = np.empty(self._spec.size, self._spec.dtype)
        self._pending: tuple[int, list] | None = None  # (seq, ack refs) of the last push
        self._acked = 0  # pushes of this incarnation every shard acknowledged
        self._own: list[int] | None = None  # versions of the last push's acks
        self._handled = 0  # shard 0's count of pushes, as last heard
        self._results: list[PushResult] = []
        self._closed_by: str | None = None
        self._stopping = False
        self.last_result: PushResult | None = None
        #: whether the last pull includes this worker's last push (see :meth:`pull`'s ``own``)
        self.pull_has_own = True
        #: the job's budget of pushes refused at commit (None: none), as the local client's
        self.budget: int | None = None
        self.budget_refused = 0
        self._granted = False  # may_begin said yes since the last push
        self._round = self.joined_at  # under BSP: this worker's clock as it knows it
        self._shard_round = 0  # under BSP: shard 0's round under way, as last heard
        self.watch: Any = None  # a loop the user owns: its protocol.loop.Watch

    # -- the job ----------------------------------------------------------------------

    @property
    def job_pushes(self) -> int:
        """Pushes committed by all the job's workers so far (shard 0's count, asked now)."""
        self._count()
        return self._handled

    def may_begin(self, steps: int) -> bool:
        """The budget rule (:mod:`stalewise.protocol.budget`): whether this worker may begin
        another step of a job of ``steps`` pushes. Its push in flight is its step in
        progress; while the rule refuses with it in flight, the client waits for its acks
        and asks again. The other workers' steps are not seen: a job may commit up to
        ``workers - 1`` pushes beyond ``steps``. Under BSP it counts whole rounds
        (:func:`~stalewise.protocol.budget.may_begin_round`) of the shards' round
        (:func:`~stalewise.protocol.budget.round_of`). A yes grants the next push past
        :attr:`budget`'s check at commit (under BSP it is asked again)."""
        self._granted = self._may_begin(steps)
        return self._granted

    def _may_begin(self, steps: int, *, ask: bool = True) -> bool:
        """The rule; ``ask``: under BSP, asks shard 0 for its round (else: as last heard,
        at commit, after this push's pull)."""
        if self._rounds:
            if ask:
                self._count()
            round_ = budget.round_of(self._round, self._shard_round)
            return budget.may_begin_round(round_, self._expected, steps)
        self._count()
        flying = int(self._pending is not None)
        if budget.settle_first(self._handled, flying, steps):
            self.wait()
            self._count()
            flying = int(self._pending is not None)
        return budget.may_begin(self._handled, flying, steps)

    @property
    def stopping(self) -> bool:
        """Whether the job is ending (the server stopped its shards)."""
        if not self._stopping and self._closed_by is None:
            self._count()
        return self._stopping

    def _count(self) -> None:
        ray = import_ray()
        try:
            handled, stopped, round_ = ray.get(self._shards[0].count.remote(), timeout=CLOSE_WAIT)
        except ray.exceptions.RayActorError:
            raise ShardError(f"job {self.name!r}: shard 0's actor died") from None
        self._handled = max(self._handled, int(handled))
        self._shard_round = max(self._shard_round, int(round_))
        self._stopping = self._stopping or bool(stopped)

    # -- pulls ------------------------------------------------------------------------

    def pull_flat(self, *, timeout: float | None = None, own: bool = True) -> np.ndarray:
        """Like :meth:`pull` but returns the flat pull buffer itself (no copy)."""
        self._check_open()
        if self.watch is not None:
            self.watch.pulled = True
        if own:
            self.wait(timeout=timeout)
        # a gated pull waits at every shard until this worker's pushes have arrived
        self.pull_has_own = self._pending is None or self._gated
        w, inc, sender = self.worker, self.incarnation, self._out.sender
        # answered when the gate lets this worker start (at once under ASP), with a
        # snapshot that holds this worker's last acknowledged push (read-your-writes)
        fresh = [0] * len(self._shards) if self._own is None or not own else self._own
        refs = [s.pull.remote(w, inc, sender.seq, 0, fresh[k]) for k, s in enumerate(self._shards)]
        replies = self._get(refs, timeout, "pull")
        kinds = {r[0] for r in replies}
        if "stop" in kinds:
            self._stopping = True
            self._close_with("the job is stopping: its shards answer no more pulls")
        if kinds != {"ok"}:
            self._close_with(f"worker {w}'s incarnation {inc} was cut off by the shards")
        slices = self._get([r[2] for r in replies], timeout, "pull")
        for k, ((lo, hi), piece, r) in enumerate(
            zip(self._out.config.ranges, slices, replies, strict=True)
        ):
            self._pull_buf[lo:hi] = piece
            sender.pulled(k, r[1])
        self._handled = max(self._handled, int(replies[0][3]))
        self._round = max(self._round, int(replies[0][4]))  # this worker's clock
        return self._pull_buf

    # -- pushes -----------------------------------------------------------------------

    def push(self, update: Any, loss: float = math.nan) -> None:
        """Commits ``update`` (the job's structure: gradients, or a strategy's update) and
        sends it to every shard; returns at once (its acks are read by :meth:`wait`, or by
        the next pull or push). ``loss``: this step's loss, recorded by the shards."""
        self._check_open()
        self.wait()  # one push in flight: the next waits for the last one's acks
        granted, self._granted = self._granted, False
        ask = lambda steps: self._may_begin(steps, ask=False)  # noqa: E731
        if budget.refuses(self.budget, granted, ask, rounds=self._rounds):
            self.budget_refused += 1
            raise BudgetSpent(self.budget)
        if self.watch is not None:
            self.watch.pushing()
        out = self._out
        sent, seq, bases, verdict, residual = out.prepare(update, out.free[0])
        refs = out.send(sent, self.incarnation, seq, bases, verdict, loss, self._acked, residual)
        self._pending = (seq, refs)
        self._round += 1

    def wait(self, timeout: float | None = None) -> PushResult | None:
        """Waits for the acks of the last push; returns what happened to it (None before
        the first push)."""
        if self._pending is None:
            return self.last_result
        seq, refs = self._pending
        try:
            result, handled = self._out.collect(refs, seq, timeout)
        except import_ray().exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None
        self._pending = None
        if result is None:
            self._close_with(f"worker {self.worker}'s push {seq} was cut off or lost")
        self._acked, self._handled = seq + 1, max(self._handled, handled)
        self._own = list(result.versions)
        self.last_result = result
        self._results.append(result)
        if self.watch is not None:
            self.watch.result(result)
        return result

    def take_results(self) -> list[PushResult]:
        """The results of the pushes acknowledged since the last call."""
        out, self._results = self._results, []
        return out

    @property
    def residual(self) -> np.ndarray | None:
        """This worker's error-feedback residual after its last committed push (None when
        the codec keeps no feedback)."""
        return self._out.sender.residual

    # -- leaving ----------------------------------------------------------------------

    def close(self) -> None:
        """Leaves the job: the last push's acks are awaited, then the door applies the
        commit rule (the push on every shard or on none) and frees the worker id. Calling
        it again does nothing."""
        ray = import_ray()
        if self._door is None:
            return
        door, self._door = self._door, None
        try:
            if self._pending is not None and self._closed_by is None:
                self.wait(timeout=CLOSE_WAIT)
        except (TimeoutError, ServerClosed, ShardError, ray.exceptions.RayError) as e:
            log.warning("worker %d: its last push was not acknowledged (%s)", self.worker, e)
        # the residual of the last push, if it was acknowledged (else it may be torn off
        # with the push: the next incarnation starts from zeros)
        residual = self.residual if self._pending is None else None
        self._pending = None
        self._closed_by = self._closed_by or "this client was closed"
        try:
            leave = door.detach.remote(self.worker, self.incarnation, residual)
            ray.get(leave, timeout=CLOSE_WAIT)
        except (ray.exceptions.RayError, TimeoutError) as e:  # the job is gone already
            log.debug("worker %d: the door did not answer its leaving (%s)", self.worker, e)
        if self._lease is not None:
            ray.kill(self._lease, no_restart=True)
            self._lease = None

    def __enter__(self) -> RayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed_by is not None:
            raise ServerClosed(f"job {self.name!r}: {self._closed_by}")

    def _close_with(self, why: str) -> None:
        self._closed_by = why
        raise ServerClosed(f"job {self.name!r}: {why}")

    def _get(self, refs: list, timeout: float | None, what: str) -> list:
        ray = import_ray()
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"job {self.name!r}: no answer to {what} within {timeout} s"
            ) from None
        except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None
        except ray.exceptions.RayError as e:
            raise ShardError(
                f"job {self.name!r}: a shard's actor died ({type(e).__name__})"
            ) from None


def attach(name: str, *, worker: int | None = None, timeout: float | None = 30.0) -> RayClient:
    """A client for a worker of the job served on Ray under ``name`` (see the module
    docstring). Connects to Ray first if this process is not (``RAY_ADDRESS``, else
    ``"auto"``: the cluster ``ray start`` recorded on this machine, if the record is yours).

    Raises:
        AttachError: no job of that name is served on the cluster, or the door refused.
    """
    from stalewise.runtime.attach import AttachError
    from stalewise.runtime.ray import connect

    ray = import_ray()
    # a cluster to join, never a new instance of its own (it would serve no job)
    address = os.environ.get("RAY_ADDRESS")
    joined = ray.is_initialized()
    try:
        connect("auto" if address in (None, "", "local") else address)
    except ConnectionError as e:
        raise AttachError(f"job {name!r}: this process cannot reach a Ray cluster ({e})") from None
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        door = ray.get_actor(door_name(name), namespace=NAMESPACE)
    except ValueError:
        if not joined:  # the connection was this call's: leave as it found the process
            ray.shutdown()
        raise AttachError(f"no job named {name!r} is served on this Ray cluster") from None
    # on this node: a lease on a node that fails would take a live client with it
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
    lease = ray.remote(Lease).options(num_cpus=0, max_restarts=0, scheduling_strategy=here).remote()
    try:
        info = ray.get(door.attach.remote(worker, lease), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        ray.kill(lease)
        raise AttachError(f"job {name!r}: no answer from its door within {timeout} s") from None
    except ray.exceptions.RayTaskError as e:
        ray.kill(lease)
        cause = e.cause if e.cause is not None else e
        raise AttachError(f"job {name!r}: {cause}") from None
    except ray.exceptions.RayActorError:
        ray.kill(lease)
        raise AttachError(f"job {name!r}: its door is gone (the job ended)") from None
    return RayClient(name, door, lease, info)
