"""A worker as a Ray actor: the protocol's loop, pulls (ASP: a follow thread), a sender thread."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from stalewise import tree
from stalewise.codecs import PayloadError
from stalewise.protocol import PushResult, ServerConfig, budget, loop, pipeline, pulls
from stalewise.runtime.base import batch_iterator
from stalewise.runtime.logs import child_logging
from stalewise.runtime.options import RunOptions
from stalewise.runtime.ray.outbox import Outbox
from stalewise.strategies import Strategy

log = logging.getLogger(__name__)

RETRY_EVERY = 0.05  # seconds between tries while a shard is restarting
POLL = 0.2  # seconds: how often the receiver thread looks whether the run is over


class WorkerActor:
    """Worker ``w``'s incarnation ``inc`` over the shard actors ``shards``, in order."""

    def __init__(
        self,
        config: ServerConfig,
        strategy: Strategy,
        options: RunOptions,
        w: int,
        inc: int,
        shards: list,
        residual: np.ndarray | None = None,
        keeper: Any = None,
        drawn: int = 0,
    ):
        child_logging(f"worker {w}")
        self.config, self.strategy, self.o = config, strategy, options
        self.w, self.inc, self.shards = w, inc, list(shards)
        self.S = len(self.shards)
        self.spec = config.spec
        # delta pulls (config.pull_codec): this incarnation's copy of the params
        self.replica = None if config.pull_codec is None else pulls.Replica.for_job(config)
        numpy_only = all(leaf.backend == "numpy" for leaf in self.spec.leaves)
        self.views = self.S == 1 and numpy_only and self.replica is None  # the snapshot itself
        self.pull_buf = None if self.views else np.empty(self.spec.size, self.spec.dtype)
        self.out = Outbox(
            config,
            self.shards,
            w,
            residual=residual,
            keeper=keeper,
            buffers=pipeline.IN_FLIGHT,
            ack_timeout=options.ack_timeout,
        )
        self.following = not pipeline.exact_pulls(config)  # ASP: no pull requests
        self.settled: tuple[int, list] | None = None  # (incarnation, versions) to read
        self.params: Any = None
        self.snapshots: list = []  # the pulled slices (kept alive while the params view them)
        self.batches: Any = None
        self.times = dict.fromkeys(("pull", "push", "acks", "compute", "send"), 0.0)
        self.beats = 0  # the loop's progress, read by the driver (progress())
        self.drawn = {w: drawn}  # batches this worker id has drawn, earlier lives' too
        # shared with the sender and receiver threads, under `cond`
        self.cond = threading.Condition()
        self.latest: list = [None] * self.S  # (version, slice): the newest snapshots (ASP)
        self.handled = 0  # shard 0's count of pushes, as last heard
        self.news: tuple | None = None  # ("stop",) or ("gone",) from a shard
        self.moved_to = inc  # the newest incarnation the shards announced
        self.jobs: deque = deque()  # the pushes committed and not yet acked, oldest first
        self.acked = 0  # pushes of this incarnation every shard has acknowledged
        self.results: list[PushResult] = []  # of the pushes acknowledged, not yet reported
        self.error: BaseException | None = None  # raised in a thread
        self.closing = False

    def prepare(self) -> dict:
        """Loads the data and runs one discarded step (JIT warm-up); ``{"node", "pid"}``."""
        batches = batch_iterator(self.o.data, self.w, self.o.room, drawn=self.drawn)
        first = next(batches)
        params = tree.unflatten(self.config.init, self.spec, copy=True)
        self.o.loss_and_grad(params, first)
        self.strategy.warm_up(params)  # an inner optimizer's kernels, likewise
        if self.out.compressor is not None:
            self.out.compressor.warm_up()  # its kernels load now, not at the first push
        self.batches = self._beating(itertools.chain([first], batches))
        return {"node": self.where(), "pid": os.getpid()}

    def progress(self) -> tuple[bool, int, int]:
        """``(prepared, beats, batches drawn)``; called on the ``"beat"`` group beside :meth:`run`."""
        return self.batches is not None, self.beats, self.drawn[self.w]

    def where(self) -> str:
        """This actor's node id (on the ``"beat"`` group)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def _beating(self, batches: Any) -> Any:
        for batch in batches:
            self.beats += 1
            yield batch

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.beats += 1
            time.sleep(min(left, POLL))

    def run(self) -> dict:
        """The worker loop, then leaves the shards; its ``steps``, ``outcomes``, ``diverged``,
        ``times``, ``drawn`` and ``feedback`` (``(incarnation, pushes, residual)``)."""
        import ray

        if self.batches is None:
            self.prepare()
        threads = [self._start(self._send_loop)]
        if self.following:
            threads.append(self._start(self._receive_loop))
        ended: dict[str, Any] = {"times": self.times}  # and, at the end, "drawn"
        try:
            lp = loop.worker_loop(
                self.strategy,
                self.o.loss_and_grad,
                self.batches,
                worker=self.w,
                diverge_after=self.o.diverge_after,
            )
            try:
                stats = loop.run(lp, self._answerer())
                loop.report(self._results(wait=True), stats, self.w)
                ended |= {"steps": stats.steps, "outcomes": dict(stats.outcomes)}
            except loop.Diverged as e:  # it leaves; the driver does not restart it
                self._results(wait=True)
                ended |= {"steps": self.out.sender.seq, "outcomes": {}, "diverged": str(e)}
            ended["feedback"] = (self.inc, self.out.sender.seq, self.out.sender.residual)
            ended["drawn"] = self.drawn[self.w]
        finally:
            with self.cond:
                self.closing = True
                self.cond.notify_all()
            for t in threads:
                t.join(timeout=POLL * 5)
            self.params, self.snapshots = None, []
        try:
            self._get([s.leave.remote(self.w, self.inc) for s in self.shards], POLL * 25)
        except ray.exceptions.RayError:  # a shard is down: the driver's restore drops it
            log.warning("worker %d: could not leave every shard", self.w)
        return ended

    def _answerer(self) -> Callable[[Any], Any]:
        slowdown, delay = self.o.slowdowns[self.w], self.o.extra_delays[self.w]
        times, clock = self.times, time.perf_counter

        def answer(request: Any) -> Any:
            self.beats += 1
            if request is loop.BEGIN:
                t = clock()
                go = self._begin()
                times["pull"] += clock() - t
                return go
            if request is loop.PULL:
                return self.params
            if request is loop.CLOCK:  # a strategy pacing itself asks the runtime's clock
                return time.monotonic()
            emulated = loop.emulated(request, slowdown, delay)
            if emulated > 0:
                self._sleep(emulated)
            times["compute"] += emulated + request.compute
            t = clock()
            self._push(request.update, request.loss)
            times["push"] += clock() - t
            if not request.settle:
                return self._results()
            out = self._results(wait=True)  # read-your-writes: acked, and the next
            with self.cond:  # step's snapshots hold what the acks say
                self.settled = (self.inc, list(self.out.sender.known))
            return out

        return answer

    def _begin(self) -> bool:
        """Fetches the next step's parameters; False: the job stops or the budget is spent."""
        got = self._newest() if self.following else self._pull()
        if got is None:
            return False
        versions, slices = got
        for k, v in enumerate(versions):
            self.out.sender.pulled(k, v)
        self.params, self.snapshots = None, slices or []
        if not self.views and slices is not None:  # None: delta pulls, already in pull_buf
            for (lo, hi), piece in zip(self.config.ranges, slices, strict=True):
                self.pull_buf[lo:hi] = piece
        flat = slices[0] if self.views else self.pull_buf
        self.params = tree.unflatten(flat, self.spec, copy=False)
        return True

    def _newest(self) -> tuple[list, list] | None:
        with self.cond:
            while True:
                self._check()
                if self.news is not None:
                    return None
                if self.moved_to > self.inc:
                    self._become(self.moved_to)
                if self._whole():
                    if self._budget_spent():
                        return None
                    if self._whole():  # the budget's wait lets a restore clear the snapshots
                        break
                    continue
                self._wait()
            if self.replica is not None:  # the receiver applies the deltas: copy it whole
                np.copyto(self.pull_buf, self.replica.params)
                return [v for v, _ in self.latest], None
            return [v for v, _ in self.latest], [a for _, a in self.latest]

    def _whole(self) -> bool:
        """Whether a snapshot of every shard is in, holding this worker's settled pushes."""
        if any(s is None for s in self.latest):
            return False
        if self.settled is None or self.settled[0] != self.inc:  # none, or shards restored
            return True
        return all(s[0] >= v for s, v in zip(self.latest, self.settled[1], strict=True))

    def _pull(self) -> tuple[list, list] | None:
        import ray

        failed_at = None
        while True:
            refs = [
                s.pull.remote(self.w, self.inc, self.out.sender.seq, self._have(k))
                for k, s in enumerate(self.shards)
            ]
            try:
                replies = self._get(refs)
                if all(r[0] == "ok" for r in replies):
                    if self.replica is None:
                        slices = self._get([r[2] for r in replies])
                        break
                    if all(self._apply(k, r[2]) for k, r in enumerate(replies)):
                        np.copyto(self.pull_buf, self.replica.params)
                        slices = None
                        break
                    continue  # a payload was refused: pull again (a full pull there)
            except ray.exceptions.RayTaskError:
                raise
            except ray.exceptions.RayError as e:  # a shard died: the driver restores it
                failed_at = self._retry(failed_at, e)
                continue
            kinds = {r[0] for r in replies}
            if "stop" in kinds or "gone" in kinds:
                return None
            moved = [r[1] for r in replies if r[0] == "moved"]
            if moved:
                self._become(max(moved))
        with self.cond:
            self.handled = max(self.handled, replies[0][3])
            if self._budget_spent(round_=replies[0][4]):
                return None
        return [r[1] for r in replies], slices

    def _budget_spent(self, *, round_: int | None = None) -> bool:
        """The budget rule on shard 0's count (under BSP, on ``round_``); ``cond`` held."""
        steps = self.o.steps
        if round_ is not None and self.config.consistency.averages_rounds:
            return not budget.may_begin_round(round_, self.o.expected, steps)
        while True:
            flying = len(self.jobs)
            if not budget.settle_first(self.handled, flying, steps):
                return not budget.may_begin(self.handled, flying, steps)
            self._wait()

    def _have(self, k: int) -> int:
        return 0 if self.replica is None else self.replica.have(k)

    def _apply(self, k: int, payload: Any) -> bool:
        """Applies shard ``k``'s delta payload; False if refused (the next pull is full)."""
        try:
            self.replica.apply(k, payload)
        except PayloadError as e:
            log.warning("worker %d: refused a pull (%s); the next one is full", self.w, e)
            return False
        return True

    def _become(self, inc: int) -> None:
        log.warning(
            "worker %d: continuing as incarnation %d (the shards were restored)", self.w, inc
        )
        self.inc, self.acked = inc, 0
        self.out.sender = self.out.sender.successor()  # on the same residual buffers
        if self.replica is not None:
            self.replica.reset()
        self.moved_to = max(self.moved_to, inc)

    def _retry(self, failed_at: float | None, error: Exception) -> float:
        failed_at = failed_at or time.monotonic()
        if time.monotonic() - failed_at > self.o.shard_start_timeout:
            raise RuntimeError(
                f"worker {self.w}: a shard did not come back within "
                f"{self.o.shard_start_timeout} s (shard_start_timeout): {error}"
            )
        self._sleep(RETRY_EVERY)
        return failed_at

    def _get(self, refs: list, timeout: float | None = None) -> list:
        import ray

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = POLL if deadline is None else max(min(POLL, deadline - time.monotonic()), 0)
            try:
                return ray.get(refs, timeout=step)
            except ray.exceptions.GetTimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
            self.beats += 1

    def _push(self, update: Any, loss: float) -> None:
        """Commits the update and queues it for the sender (at most ``IN_FLIGHT``)."""
        t = time.perf_counter()
        with self.cond:
            while len(self.jobs) >= pipeline.IN_FLIGHT:
                self._wait()
            buf = self.out.free.pop()  # one per push in flight: free once its acks are in
        self.times["acks"] += time.perf_counter() - t
        sent, seq, bases, verdict, residual = self.out.prepare(update, buf)
        with self.cond:
            self.jobs.append((sent, self.inc, seq, bases, verdict, loss, residual))
            self.cond.notify_all()

    def _results(self, wait: bool = False) -> list[PushResult]:
        """The results acknowledged since the last call (``wait``: of every push)."""
        with self.cond:
            while wait and self.jobs:
                self._wait()
            self._check()
            out, self.results = self.results, []
        return out

    def _start(self, body: Callable[[], None]) -> threading.Thread:
        """Starts a thread running ``body``; what it raises, the loop raises (:meth:`_check`)."""

        def guarded() -> None:
            try:
                body()
            except BaseException as e:
                with self.cond:
                    self.error = e
                    self.cond.notify_all()

        thread = threading.Thread(target=guarded, daemon=True)
        thread.start()
        return thread

    def _wait(self) -> None:
        self._check()
        self.cond.wait(POLL)
        self.beats += 1

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"worker {self.w}: {self.error}") from self.error

    def _send_loop(self) -> None:
        """The sender thread: sends each queued push and reads its acks, in order."""
        while True:
            with self.cond:
                while not self.closing and not self.jobs:
                    self.cond.wait()
                if not self.jobs:
                    return
                flat, inc, seq, bases, verdict, loss, residual = self.jobs[0]
                acked = self.acked if inc == self.inc else 0
            t = time.perf_counter()
            refs = self.out.send(flat, inc, seq, bases, verdict, loss, acked, residual)
            self.times["send"] += time.perf_counter() - t
            try:
                result, handled = self.out.collect(refs, seq, self.o.ack_timeout)
            except TimeoutError:
                raise TimeoutError(
                    f"worker {self.w}: no acks within {self.o.ack_timeout} s (ack_timeout)"
                ) from None
            with self.cond:
                if result is not None:
                    self.results.append(result)
                    self.acked = max(self.acked, seq + 1)
                    self.handled = max(self.handled, handled)
                self.out.free.append(flat)
                self.jobs.popleft()
                self.cond.notify_all()

    def _receive_loop(self) -> None:
        """The receiver thread (ASP): a standing :meth:`ShardActor.follow` at every shard."""
        import ray

        seen, inc = [-1] * self.S, self.inc
        pending: dict[Any, tuple[int, int]] = {}  # ref -> (shard, incarnation asked as)
        failed_at = None

        def ask(k: int) -> None:
            with self.cond:
                have = self._have(k)
            pending[self.shards[k].follow.remote(self.w, inc, seen[k], have)] = (k, inc)

        for k in range(self.S):
            ask(k)
        while not self.closing and pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=POLL)
            for ref in done:
                k, asked = pending.pop(ref)
                try:
                    reply = ray.get(ref)
                    piece = None  # a snapshot; a delta pull's payload is in the reply
                    if reply[0] == "ok" and self.replica is None:
                        piece = ray.get(reply[2])
                except ray.exceptions.RayTaskError:
                    raise
                except ray.exceptions.RayError as e:
                    failed_at = self._retry(failed_at, e)
                    ask(k)
                    continue
                failed_at = None
                with self.cond:
                    if reply[0] == "moved" and reply[1] > inc:
                        inc = self.moved_to = reply[1]
                        seen = [-1] * self.S
                        self.latest = [None] * self.S
                        if self.replica is not None:
                            self.replica.reset()
                    elif reply[0] == "ok" and asked == inc:
                        # a delta goes into the copy; one refused is repaired by the next pull
                        if self.replica is None or self._apply(k, reply[2]):
                            seen[k] = reply[1]
                            self.latest[k] = (reply[1], piece)
                        if k == 0:
                            self.handled = reply[3]
                    elif reply[0] in ("stop", "gone"):
                        self.news = reply
                    self.cond.notify_all()
                if reply[0] in ("ok", "moved"):
                    ask(k)
