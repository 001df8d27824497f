"""A loop you own, on Ray: :func:`attach` (``sw.attach(name)``) gets a worker id from the job's
door; :class:`RayClient` has the local client's calls, one push in flight (docs/ray.md)."""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import numpy as np

from stalewise.protocol import PushResult, ServerConfig, budget, pipeline
from stalewise.runtime.attach import AttachError
from stalewise.runtime.base import PullsIntoTrees
from stalewise.runtime.errors import BudgetSpent, ServerClosed, ShardError
from stalewise.runtime.ray import connect, import_ray
from stalewise.runtime.ray.outbox import Outbox

log = logging.getLogger(__name__)

NAMESPACE = "stalewise"  # the Ray namespace of every served job's named actors
CLOSE_WAIT = 30.0  # seconds close() waits for the last push's acks and the door


def door_name(name: str) -> str:
    return f"stalewise:{name}"


class Lease:
    """An actor owned by the attached process, dying with it (the door watches it)."""

    async def watch(self) -> None:
        import asyncio

        await asyncio.get_running_loop().create_future()


class RayClient(PullsIntoTrees):
    """One incarnation of a worker id of a job served on Ray (:func:`attach`); one thread's."""

    #: the job's budget of pushes this client refuses to pass at commit (None: none)
    budget = budget.Budget()

    def __init__(self, name: str, door: Any, lease: Any, info: dict):
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
        self.budget_refused = 0  # pushes refused past the budget
        self._granted = False  # may_begin said yes since the last push
        self._round = self.joined_at  # under BSP: this worker's clock as it knows it
        self._shard_round = 0  # under BSP: shard 0's round under way, as last heard
        self.watch: Any = None  # a loop the user owns: its protocol.loop.Watch
        self._loss = math.nan  # the last log_loss, carried by the next push

    @property
    def job_pushes(self) -> int:
        """Pushes committed by all the job's workers so far (shard 0's count, asked now)."""
        self._count()
        return self._handled

    def _may_begin(self, steps: int, *, ask: bool = True) -> bool:
        """``ask``: under BSP, asks shard 0 its round (else as last heard)."""
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
        ask = [self._shards[0].count.remote()]
        handled, stopped, round_ = self._get(ask, CLOSE_WAIT, "count")[0]
        self._handled = max(self._handled, int(handled))
        self._shard_round = max(self._shard_round, int(round_))
        self._stopping = self._stopping or bool(stopped)

    def pull_flat(self, *, timeout: float | None = None, own: bool = True) -> np.ndarray:
        """:meth:`pull`'s flat buffer itself (no copy)."""
        self._check_open()
        if self.watch is not None:
            self.watch.pulled = True
        if own:
            self.wait(timeout=timeout)
        # a gated pull waits at every shard until this worker's pushes have arrived
        self.pull_has_own = self._pending is None or self._gated
        w, inc, sender = self.worker, self.incarnation, self._out.sender
        # read-your-writes: a snapshot holding this worker's last acknowledged push
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

    def push(self, update: Any, loss: float = math.nan) -> None:
        """Commits ``update`` and sends it; returns at once. BudgetSpent past :attr:`budget`."""
        self._check_open()
        loss = self._loss if math.isnan(loss) else loss
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

    def log_loss(self, loss: float) -> None:
        """This worker's latest training loss, for the shards with its next push."""
        self._loss = loss

    def wait(self, timeout: float | None = None) -> PushResult | None:
        """The last push's result, once acknowledged (None before the first push)."""
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

    @property
    def residual(self) -> np.ndarray | None:
        """The error-feedback residual after the last committed push (None: no feedback)."""
        return self._out.sender.residual

    def close(self) -> None:
        """Leaves the job and frees the worker id; idempotent."""
        ray = import_ray()
        if self._door is None:
            return
        door, self._door = self._door, None
        try:
            if self._pending is not None and self._closed_by is None:
                self.wait(timeout=CLOSE_WAIT)
        except (TimeoutError, ServerClosed, ShardError, ray.exceptions.RayError) as e:
            log.warning("worker %d: its last push was not acknowledged (%s)", self.worker, e)
        # a push not acknowledged may be torn off: its residual is not kept
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
    """A client for a worker of the job served on Ray as ``name``, connecting first if
    needed (``RAY_ADDRESS``, else ``"auto"``); AttachError if no such job or refused."""
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
        return RayClient(name, door, lease, info)
    except ray.exceptions.GetTimeoutError:
        why = f"no answer from its door within {timeout} s"
    except ray.exceptions.RayTaskError as e:
        why = e.cause if e.cause is not None else e
    except ray.exceptions.RayActorError:
        why = "its door is gone (the job ended)"
    ray.kill(lease)
    raise AttachError(f"job {name!r}: {why}") from None
