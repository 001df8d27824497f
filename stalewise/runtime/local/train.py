"""``Job.train`` on the local runtime: one OS process per worker, none outliving the parent."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing import connection, get_context
from typing import Any

import numpy as np

from stalewise import checkpoint
from stalewise import runtime as runtime_lib
from stalewise.checkpoint.resume import Positions
from stalewise.protocol import ServerConfig, loop, pipeline
from stalewise.protocol.liveness import Silence, late_start
from stalewise.runtime import driver
from stalewise.runtime.base import batch_iterator
from stalewise.runtime.errors import ShardError, WorkerError, worker_failed
from stalewise.runtime.local import wire
from stalewise.runtime.local.client import Client, Rejoin
from stalewise.runtime.local.procs import (
    Capped,
    describe_exit,
    die_with_parent,
    thread_budget,
    thread_share,
)
from stalewise.runtime.local.server import LocalServer
from stalewise.runtime.logs import child_logging
from stalewise.runtime.options import RunOptions
from stalewise.runtime.result import TrainResult, merge_stats
from stalewise.strategies import Strategy

log = logging.getLogger(__name__)

# control slots: stop flag, then per worker: pushes done, last loss, batches drawn (by its id)
_STOP, _DONE0 = 0, 1


def _drawn(workers: int) -> slice:
    """The control slots counting the batches each worker id has drawn."""
    return slice(_DONE0 + 2 * workers, _DONE0 + 3 * workers)


class _Heartbeat:
    """A worker's heartbeat to the parent: sent when called, at most every ``every`` seconds."""

    def __init__(self, conn: connection.Connection, worker: int, timeout: float | None):
        self.conn, self.worker = conn, worker
        self.every = None if timeout is None else min(1.0, timeout / 4)
        self.last = -math.inf

    def __call__(self) -> None:
        if self.every is not None:
            now = time.monotonic()
            if now - self.last >= self.every:
                self.conn.send_bytes(wire.beat(self.worker, now))
                self.last = now

    def batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches``, beating for each one drawn."""
        for batch in batches:
            self()
            yield batch

    def wait(self, call: Callable[[float | None], Any], total: float | None = None) -> Any:
        """``call(timeout)`` until it returns, beating between tries (TimeoutError after ``total``)."""
        deadline = None if total is None else time.monotonic() + total
        while True:
            self()
            step = self.every
            if deadline is not None:
                left = max(0.0, deadline - time.monotonic())
                step = left if step is None else min(step, left)
            try:
                return call(step)
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    def sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self()
            time.sleep(left if self.every is None else min(left, self.every))


def _worker_main(
    client: Client,
    strategy: Strategy,
    options: RunOptions,
    results: connection.Connection,
) -> None:
    """Body of a worker process: the protocol's worker loop, answered with blocking calls."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent coordinates shutdown
    w, workers = client.worker, client._layout.workers
    child_logging(f"worker {w}")
    slowdown, delay = options.slowdowns[w], options.extra_delays[w]
    diverged = getattr(loop, "Diverged", None)  # raised by the worker loop, where it exists
    beat = _Heartbeat(results, w, options.worker_timeout)
    wait = options.shard_start_timeout + options.ack_timeout
    client.rejoin = Rejoin(results, wait, client, beat)
    positions = None  # its data position at each push (checkpoint.Positions)
    try:
        ctrl = client._layout.control(client._attach())
        # counted in shared memory: the parent saves it, the next incarnation skips as many
        drawn = ctrl[_drawn(workers)]
        batches = batch_iterator(options.data, w, workers, drawn=drawn)
        if options.checkpoint_dir is not None:  # a resume from the push logs goes on from them
            try:
                positions = Positions(options.checkpoint_dir, w, client.incarnation)
                positions.write(-1, int(drawn[w]))
            except OSError as e:  # a folder not to be trusted: the shards log nothing there
                positions = None
                log.warning("worker %d: no data positions in %s: %s", w, options.checkpoint_dir, e)
        first = next(batches)
        # set-up: one step thrown away, so a JIT compile (JAX, numba) happens before the clock
        params = client.peek()
        options.loss_and_grad(params, first)
        strategy.warm_up(params)  # an inner optimizer's kernels, likewise
        batches = beat.batches(itertools.chain([first], batches))
        results.send_bytes(wire.worker_ready(w))
        if results.recv_bytes(wire.MAX_RESULT) != wire.go():
            return
        beat.last = time.monotonic()  # the parent counts "go" as a beat
        loss_slot = _DONE0 + workers + w
        transit: list = []  # a push in transit (options.transport): [arrival, update, drawn]
        settle = False  # an overlapped push the next pull must hold

        def land(by: float = math.inf) -> None:
            """The push in transit reaches the shards, if it arrives by ``by``."""
            if transit and transit[0] <= by:
                beat.sleep(transit[0] - time.monotonic())
                if positions is not None:  # the previous push is acknowledged: held at resume
                    positions.write(client._sender.seq, transit[2])
                client.push(transit[1])  # the client counts it toward the budget
                transit.clear()

        def answer(request: Any) -> Any:
            nonlocal settle
            beat()
            if request is loop.BEGIN:
                land()  # the budget counts it
                return not client.stopping and client.may_begin(options.steps)
            if request is loop.PULL:
                # the pipelining rule: the pull does not wait for the last push's acks
                land()
                if settle:  # read-your-writes, as for a settled push
                    beat.wait(lambda t: client.wait(timeout=t))
                settle = False
                beat.wait(lambda t: client.pull_flat(timeout=t, own=False))
                return client.last_pull(copy=False)
            if request is loop.CLOCK:  # a strategy pacing itself asks the runtime's clock
                return time.monotonic()
            # a Push or an Ahead: emulate the compute time; a straggler is slow at everything
            end = time.monotonic() + loop.emulated(request, slowdown, delay)
            land(end)  # an overlapped push lands during the steps taken ahead
            beat.sleep(end - time.monotonic())
            if isinstance(request, loop.Ahead):
                return client.take_results()
            beat.wait(lambda t: client.wait(timeout=t))  # the previous push's acks (IN_FLIGHT)
            ctrl[loss_slot] = request.loss
            transit[:] = [time.monotonic() + options.transport, request.update, int(drawn[w])]
            if request.overlap:
                settle = True
                return client.take_results()
            land()
            if pipeline.answer_at_acks(request):  # read-your-writes: the next pull holds it
                beat.wait(lambda t: client.wait(timeout=t))
            return client.take_results()

        stats = loop.run(
            loop.worker_loop(
                strategy,
                options.loss_and_grad,
                batches,
                worker=w,
                diverge_after=options.diverge_after,
                overlap=True,
            ),
            answer,
        )
        land()
        beat.wait(lambda t: client.wait(timeout=t), total=options.ack_timeout)
        loop.report(client.take_results(), stats, w)
        client.close()
        results.send_bytes(wire.done(w))
    except BaseException as e:
        if diverged is not None and isinstance(e, diverged):
            msg = wire.diverged(w, str(e))
        else:
            msg = wire.failed(w, traceback.format_exc(), f"{type(e).__name__}: {e}")
        with contextlib.suppress(OSError):  # the parent may be gone already
            results.send_bytes(msg)


def _check_picklable(name: str, obj: Any) -> None:
    try:
        pickle.dumps(obj)
    except Exception as e:
        raise TypeError(
            f"{name} must be picklable to reach the worker processes (use a module-level "
            f"function or object, not a lambda or closure): {e}"
        ) from None


_LIVE = ("starting", "running")
READ_CHUNK = 1 << 16  # bytes read from a worker's result pipe at a time


def _malformed(e: Exception) -> str:
    """The failure cause of a worker whose result pipe carried bytes that are no message."""
    return f"sent a malformed message on its result pipe ({e}); nothing of it was unpickled"


@dataclass
class _Worker:
    """The parent's view of one worker id (its current incarnation)."""

    proc: Any
    conn: Any  # the worker's result pipe: ready, beats, done or error (wire.decode_result)
    state: str = "starting"  # starting | running | done | dropped | diverged | down
    since: float = field(default_factory=time.monotonic)  # when it was started
    beat: float = field(default_factory=time.monotonic)  # its last heartbeat
    silence: Silence | None = None  # its rhythm, judging a hang (None: no worker_timeout)
    pending: list = field(default_factory=list)  # failure events it recovers from
    # its result pipe's bytes, split into frames as they arrive (never a blocking read)
    frames: wire.FrameReader = field(default_factory=lambda: wire.FrameReader(wire.MAX_RESULT))


class _Host:
    """The local runtime as a :class:`~stalewise.runtime.driver.Host` of one run."""

    runtime, virtual, checkpoint_info = "local", False, {}

    def __init__(self, config: ServerConfig, strategy: Strategy, o: RunOptions):
        self.config, self.strategy, self.o = config, strategy, o
        self.worker_options = o.for_workers()
        self.workers: list[_Worker] = []
        self.server: LocalServer | None = None
        self.run: driver.Run | None = None
        self.t0: float | None = None

    def now(self) -> float:
        return 0.0 if self.t0 is None else time.perf_counter() - self.t0

    def spawn(self, w: int) -> None:
        """Starts a process for a new incarnation of worker ``w``."""
        mine, theirs = connection.Pipe()
        args = (self.server.client(w), self.strategy, self.worker_options, theirs)
        p = get_context("spawn").Process(  # spawned: it gets thread_budget's and your variables
            target=_worker_main, args=args, name=f"stalewise-worker-{w}", daemon=True
        )
        with thread_budget(thread_share(self.o.workers)):
            p.start()
        self.server.release(w)  # if the worker dies, its shards now see its pipes close
        theirs.close()
        worker = _Worker(p, mine)
        if w < len(self.workers):
            worker.pending = self.workers[w].pending
            self.workers[w] = worker
        else:
            self.workers.append(worker)

    def reap(self, w: int) -> None:
        """Makes sure worker ``w``'s process has exited (killing it if need be)."""
        wk = self.workers[w]
        wk.proc.join(0.5)
        if wk.proc.is_alive():
            wk.proc.kill()
            wk.proc.join()
        wk.conn.close()

    def _silent_death(self, w: int) -> str:
        return (
            f"worker process died without a word ({describe_exit(self.workers[w].proc.exitcode)})"
        )

    def poll(self, timeout: float) -> None:
        """Handles what the workers said, then any shard or worker that failed meanwhile."""
        self.check_shards()
        live = [w for w, wk in enumerate(self.workers) if wk.state in _LIVE]
        ready = connection.wait([self.workers[w].conn for w in live], timeout=timeout)
        for w in live:
            if self.workers[w].conn in ready:
                self.read(w)
        self.check_hung()

    def receive(self, w: int) -> list[tuple] | None:
        """The messages on worker ``w``'s result pipe now, decoded (nothing is unpickled); []
        while a message is incomplete, None at the pipe's end. WireError: bytes no message."""
        wk = self.workers[w]
        try:
            data = os.read(wk.conn.fileno(), READ_CHUNK)
        except OSError:
            return None
        if not data:
            return None
        bodies = wk.frames.feed(data)
        if wk.frames.error is not None:
            raise wire.WireError(wk.frames.error)
        return [wire.decode_result(body, w) for body in bodies]

    def read(self, w: int) -> None:
        """Handles worker ``w``'s messages (its pipe's end is its death, garbage its failure)."""
        wk = self.workers[w]
        while wk.state in _LIVE and wk.conn.poll():
            try:
                msgs = self.receive(w)
            except wire.WireError as e:
                self.failed(w, _malformed(e))
                return
            if msgs is None:
                self.reap(w)
                self.failed(w, self._silent_death(w).removeprefix("worker process "))
                return
            for msg in msgs:
                if wk.state not in _LIVE:
                    return
                self.handle(w, msg)

    def handle(self, w: int, msg: tuple) -> None:
        """One message of worker ``w`` (decoded)."""
        wk = self.workers[w]
        if msg[0] == "beat":
            wk.beat = max(wk.beat, msg[2])
            if wk.silence is not None:
                wk.silence.beat(msg[2])
        elif msg[0] == "ready":  # a restarted incarnation: it joins the run at once
            with contextlib.suppress(OSError):  # died meanwhile: its pipe's end says so
                wk.conn.send_bytes(wire.go())
            self.running(wk)
            for event in wk.pending:
                event["recovered"] = max(event.get("recovered", 0.0), self.now())
            wk.pending = []
        elif msg[0] == "done":  # its process exits by itself; stop() joins it
            wk.state = "done"
        elif msg[0] == "diverged":
            wk.state = "diverged"
            self.run.failures.diverged(w, msg[2], time=self.now())
        else:  # "error": user code raised
            self.failed(w, f"raised {msg[3]}", msg[2])

    def running(self, wk: _Worker) -> None:
        """``wk`` runs from now on: its silence counts from here."""
        wk.state, wk.beat = "running", time.monotonic()
        if self.o.worker_timeout is not None:  # None: no beats are sent, none judged
            wk.silence = Silence(self.o.worker_timeout)
            wk.silence.start(wk.beat)

    def check_hung(self) -> None:
        now, o = time.monotonic(), self.o
        for w, wk in enumerate(self.workers):
            if wk.state == "running" and wk.silence is not None:
                cause = wk.silence.hung(now)  # its own rhythm; worker_timeout at the most
                if cause is not None:
                    wk.proc.kill()  # SIGKILL works on a stopped process too
                    self.failed(w, f"{cause}, so it was killed")
            elif wk.state == "starting" and (late := late_start(wk.since, now, o.start_timeout)):
                wk.proc.kill()
                self.failed(w, late)

    def failed(self, w: int, cause: str, detail: str = "") -> None:
        """Worker ``w`` failed: stop its process, then apply the policy."""
        self.workers[w].state = "down"
        self.reap(w)
        # a worker whose shard died fails too: then the shard's recovery restarts it
        connection.wait(self.server.shard_sentinels(), timeout=0.2)
        if self.check_shards():
            return
        action = self.run.failures.worker(w, cause, time=self.now(), detail=detail)
        if action == "restart":
            self.workers[w].pending.append(self.run.failures.events[-1])
            self.spawn(w)
        else:
            self.workers[w].state = "dropped"

    def check_shards(self) -> bool:
        """Restarts the shards whose process died (or raises); the running workers carry on
        if the shards come back from their backups or push logs (:meth:`rejoin`), else restart."""
        dead = self.server.dead_shards()
        if not dead:
            return False
        events = []
        for k in dead:
            self.run.failures.shard(k, self.server.shard_exit(k), time=self.now())
            events.append(self.run.failures.events[-1])
        logged = self.server.logged
        seats = logged or self.server.replicated  # kept, unless a restart falls back
        carry = [w for w, wk in enumerate(self.workers) if seats and wk.state == "running"]
        again = self.kill([w for w, wk in enumerate(self.workers)
                           if wk.state in (*_LIVE, "down") and w not in carry])  # fmt: skip
        bases = None if logged else self.checkpoint_states()  # logged: unused
        for k, event in zip(dead, events, strict=True):
            base = bases[k] if bases else None
            info = self.server.restart_shard(k, base, self.o.ack_timeout, keep=tuple(carry))
            self.run.failures.shard_restarted(
                event, version=info["version"], lost=info["lost"], source=info["source"]
            )
            event["serving"] = self.now()  # the shard is back (its workers follow)
            if info["source"] not in ("push log", "backup"):  # no seats kept: new incarnations
                again, carry = again + self.kill(carry), []
            for w in carry:
                self.rejoin(w, k)
            event["recovered"] = self.now()  # or a restarted worker's ready, later
            log.warning("shard %d restarted at version %d from its %s (%s updates of its slice "
                        "lost); workers %s carry on, %s restart as new incarnations", k,
                        info["version"], info["source"], "unknown" if info["lost"] is None
                        else info["lost"], carry, again)  # fmt: skip
        for w in again:
            self.workers[w].pending.extend(events)
            self.spawn(w)
        return True

    def kill(self, ws: list[int]) -> list[int]:
        """Stops workers ``ws``'s processes (their pipes to a dead shard are gone); returns ``ws``."""
        for w in ws:
            if self.workers[w].state != "down":
                self.workers[w].proc.kill()
            self.reap(w)
        return ws

    def rejoin(self, w: int, k: int) -> None:
        """Hands running worker ``w`` a new pipe to restarted shard ``k`` (its seat there)."""
        with contextlib.suppress(OSError):  # it died meanwhile: poll() finds its pipe closed
            self.server.rejoin(k, w, self.workers[w].conn, self.workers[w].proc.pid)

    def checkpoint_states(self) -> list[dict] | None:
        """The shard states of this run's last checkpoint (written or resumed), if any."""
        run = self.run
        if run.resume is None and (run.saver is None or run.saver.last is None):
            return None
        try:
            return checkpoint.load(self.o.checkpoint_dir).states
        except checkpoint.CheckpointError as e:
            log.warning("cannot use the last checkpoint to restart a shard: %s", e)
            return None

    def _retrying(self, call: Callable[[], Any]) -> Any:
        """``call()`` (a call to the shards); if a shard died meanwhile, it and the
        workers are restarted (or ShardError raised by the policy) and it is made again."""
        try:
            return call()
        except ShardError:
            if not self.check_shards():
                raise
            return call()

    def start(self, run: driver.Run) -> None:
        """Starts the shards (at the resumed checkpoint) and every worker, until all are
        ready (a failure here fails the job)."""
        o, self.run = self.o, run  # (heals=False: it restarts shards its own way)
        self.server = server = LocalServer(
            self.config, o.workers, start_timeout=o.shard_start_timeout,
            join_timeout=o.join_timeout, backup_timeout=min(o.ack_timeout / 4, 5.0), heals=False,
        )  # fmt: skip
        if run.resume is not None:
            server.load_state_dicts(run.resume.states)
            if run.feedback is not None:  # each worker id continues with its saved residual
                server.load_residuals([f.residual for f in run.feedback])
            server.control[_DONE0] = run.pushes_at_start  # the job's total budget
            server.control[_drawn(o.workers)] = run.drawn
        if o.checkpoint_dir is not None:  # its workers write their positions there
            os.makedirs(o.checkpoint_dir, 0o755, exist_ok=True)
        for w in range(o.workers):
            self.spawn(w)
        deadline = time.monotonic() + o.start_timeout
        while waiting := [w for w, wk in enumerate(self.workers) if wk.state == "starting"]:
            server.check()
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(
                    f"worker {waiting[0]} did not start within {o.start_timeout} s (start_timeout)"
                )
            for c in connection.wait([self.workers[w].conn for w in waiting], min(left, 0.1)):
                w = next(i for i in waiting if self.workers[i].conn is c)
                try:
                    msgs = self.receive(w)
                except wire.WireError as e:
                    self.reap(w)
                    msgs = [("error", w, "", _malformed(e))]
                if msgs is None:
                    self.reap(w)
                    msgs = [("error", w, self._silent_death(w))]
                msg = next((m for m in msgs if m[0] != "beat"), None)
                if msg is None:  # beats, or a part of a message: the rest comes later
                    continue
                if msg[0] == "ready":
                    self.workers[w].state = "ready"
                else:
                    raise worker_failed(w, msg[2], msg[3] if len(msg) > 3 else "")

    def go(self) -> None:
        self.t0 = time.perf_counter()
        for wk in self.workers:
            with contextlib.suppress(OSError):  # died meanwhile: poll() finds its pipe closed
                wk.conn.send_bytes(wire.go())
            self.running(wk)

    def advance(self, until: float, due: Any) -> str:
        self.poll(driver.wait_for(until, self.now(), 0.05))
        return driver.TICK if any(wk.state in _LIVE for wk in self.workers) else driver.END

    def pushes(self) -> int:
        return self.server.observer.job_pushes  # as the workers' budget counts them

    def stats(self, *, settled: bool = False) -> dict:
        return merge_stats(self._retrying(self.server.stats), settled=settled)

    def losses(self) -> Any:
        return self.server.losses()

    def params(self) -> Any:
        return self._retrying(self.server.pull)

    def stop(self) -> bool:
        self.server.control[_STOP] = 1
        return False  # the workers see it at their next step

    def snapshot(self, now: float, *, failure: bool = False) -> driver.Snapshot | None:
        """One consistent cut (:meth:`LocalServer.checkpoint_parts`); the pushes in flight
        then are lost to a resumed run (its workers are new incarnations)."""
        server = self.server
        if failure and server.dead_shards():
            return None

        def take() -> driver.Snapshot:
            o = self.o  # the push logs begin at these states
            states, step, residuals = server.checkpoint_parts(
                log_dir=o.checkpoint_dir, fsync=o.checkpoint_fsync
            )
            drawn = [int(n) for n in server.control[_drawn(self.o.workers)]]
            if self.t0 is None:  # before go: the warm-up's batch is the first step's
                drawn = self.run.drawn
            return driver.Snapshot(states, step | {"time": now, "drawn": drawn}, residuals)

        return take() if failure else self._retrying(take)

    def budget_spent(self) -> bool:
        return any(wk.state == "done" for wk in self.workers)

    def diverged(self) -> list[int]:
        return [w for w, wk in enumerate(self.workers) if wk.state == "diverged"]

    def finish(self, stats: dict) -> np.ndarray:
        self.close()
        return self.server.final_params

    def close(self) -> None:
        """Stops every worker process (politely, then by force), the pipes, then the shards."""
        server = self.server
        if server is None:
            return
        if server.control is not None:
            server.control[_STOP] = 1
        for wk in self.workers:
            wk.conn.close()
        for wk in self.workers:
            wk.proc.join(self.o.stop_timeout)
            if wk.proc.is_alive():
                wk.proc.kill()
                wk.proc.join()
        server.close()


def run(config: ServerConfig, strategy: Strategy, options: RunOptions) -> TrainResult:
    """Trains with ``options.workers`` local processes (the ``"local"`` runtime; see Job.train)."""
    o = options
    why = runtime_lib.pull_refusal(config.pull_codec, "local")  # shared-memory reads here
    if why is not None:
        raise ValueError(why)
    for name, obj in (("loss_and_grad", o.loss_and_grad), ("data", o.data), ("strategy", strategy)):
        _check_picklable(name, obj)
    if o.evaluate is not None:  # it runs beside the workers, with a worker's share of cores
        o = dataclasses.replace(o, evaluate=Capped(o.evaluate, thread_share(o.workers)))
    return driver.drive(_Host(config, strategy, o), config, strategy, o)
