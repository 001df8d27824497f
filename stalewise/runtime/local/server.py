"""The local runtime's server: shards (and their backups) as OS processes on one machine;
after a shard exits early, every client's next call raises a ShardError (see the design notes)."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
import time
import uuid
from multiprocessing import connection, reduction
from pathlib import Path
from typing import Any

import numpy as np

from stalewise.checkpoint.replay import continued
from stalewise.checkpoint.store import CheckpointError
from stalewise.protocol import ServerConfig, budget, delivery
from stalewise.runtime.base import worker_range
from stalewise.runtime.errors import ShardError
from stalewise.runtime.local import layout as layout_lib
from stalewise.runtime.local import wire
from stalewise.runtime.local.attach import Door, closed
from stalewise.runtime.local.client import REJOIN_TIMEOUT, Client, Rejoin, ServerClosed, recv_reply
from stalewise.runtime.local.layout import Layout, Residuals, Snapshots
from stalewise.runtime.local.procs import (
    describe_exit,
    die_with_parent,
    refers_to_main,
    shard_context,
    stalewise_main,
    thread_budget,
    thread_share,
)
from stalewise.runtime.local.shard_proc import backup_main, shard_main
from stalewise.runtime.local.shm import SharedBlock

log = logging.getLogger(__name__)


# the counters every shard keeps alike under the commit rule (see merge_stats)
_PER_PUSH_STATS = (
    "stats.applied",
    "stats.rounds",
    "stats.rejected",
    "stats.duplicates",
    "stats.staleness",
)


#: Seconds a server call whose pipe to a shard ended waits for that shard's exit to show.
SHARD_EXIT_WAIT = 5.0
LINK_TRIES = 5  # backups started for a shard in a row before it serves alone


def _shard_entry(config: ServerConfig, k: int, handle: str, main: bool, *args: Any) -> None:
    """A shard process: dies with its parent (unlinking a named block first), then serves;
    ``main``: started by the main thread (else not killed when the thread that started it ends)."""
    cleanup = (lambda: os.unlink(handle)) if not handle.startswith("/proc/") else None
    die_with_parent(cleanup=cleanup or (None if main else lambda: None))
    shard_main(config, k, handle, *args)


def _locked(method: Any) -> Any:
    """Runs ``method`` holding the server's lock (the observer's pipes, the worker table)."""

    @functools.wraps(method)
    def locked(self: LocalServer, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class LocalServer:
    """The shards of a job, running as local processes; a context manager (``job.serve``'s)."""

    def __init__(
        self,
        config: ServerConfig,
        workers: int | tuple[int, int],
        *,
        start_timeout: float = 120.0,
        join_timeout: float = 300.0,
        name: str | None = None,
        backup_timeout: float = 5.0,
        heals: bool = True,
    ):
        expected, workers = worker_range(workers)
        if name is not None:
            Door.check(name)  # a refused name or folder before any shard starts
        self.config = config
        self.workers = workers  # the worker ids this server has room for
        self.expected = expected  # the first ids, which gates wait for from the start
        self.start_timeout = start_timeout
        self.layout = Layout.of(config, workers, expected)  # push regions sized by the codec
        self._ctx = shard_context()  # the shards fork from a warm forkserver (Linux)
        # the shards start without the user's __main__ unless the config needs it
        self._needs_main = refers_to_main(config)
        self._block = SharedBlock.create(self.layout.nbytes)
        self._procs: list = []
        self._tags: dict[int, str] = {}  # each shard process's push logs (state_dicts), and
        self._log_n = 0  # the last logs' N ("log-shard-K-TAG-N")
        self._based = None  # the last logged cut: (states, their logs' names, folder, fsync)
        self._cuts = 0  # consistent cuts begun: a shard's replies to one name it
        self._controls: list = []
        self._incarnations = [0] * workers  # the newest incarnation of each worker id
        self._clients = [0] * workers  # clients made for each worker id by this server
        self._worker_ends: list[list] = [[] for _ in range(workers)]  # until release(w)
        self.heals = heals and config.replicas == 2  # dead primaries come back by themselves
        self._rejoins: dict[int, Any] = {}  # this end of each client(w)'s rejoin pipe (heal)
        self._snapshots: Snapshots | None = None  # the parent's view, for published_version
        self.join_timeout, self.backup_timeout = join_timeout, backup_timeout
        self.replicated = config.replicas == 2  # each shard has a backup process
        self._backups: list = [None] * config.shards  # (process, control) while linked
        self._spawning: set = set()  # backup processes not linked yet (close stops them)
        # the observer's pipes and the worker table: one caller at a time (the door's thread too)
        self._lock = threading.RLock()
        self._door = None  # attach by name (see .attach), when served with a name
        self._attached: set[int] = set()  # worker ids ever given to an attached process
        # the thread that writes each shard's exit into shared memory
        self._closing = threading.Event()
        self._procs_lock = threading.Lock()  # self._procs[k] is replaced by restart_shard
        self._watcher = threading.Thread(
            target=self._watch_shards, name="stalewise-shard-watch", daemon=True
        )
        try:
            self.layout.params(self._block)[:] = config.init
            self.control = self.layout.control(self._block)
            self.control[self.layout.losses] = np.nan  # last loss per worker: none yet
            self.control[self.layout.shard_exits] = np.nan  # every shard runs
            self._residuals: Residuals | None = None
            if self.layout.feedback:  # zero residuals, in buffer 1 (Residuals.put)
                self._residuals = Residuals(self.layout, self._block)
                self._residuals.tags[:, 0] = -1
            for k in range(config.shards):
                p, control = self._start_shard(k)
                self._procs.append(p)
                self._controls.append(control)
            backups = [self._start_backup(k) for k in range(config.shards * self.replicated)]
            for k in range(config.shards):
                self._wait_ready(k)
            for k, started in enumerate(backups):
                self._link_backup(k, self._procs[k], started)
            self.observer = self._observer()
            self._watcher.start()
            # processes your own loop starts meanwhile get a share of the cores each
            self._threads = contextlib.ExitStack()
            self._threads.enter_context(thread_budget(thread_share(workers), hold=False))
            if name is not None:
                self._door = Door(self, name)
        except BaseException:
            self.close()
            raise

    def _start_shard(self, k: int) -> tuple[Any, Any]:
        self._tags.setdefault(k, uuid.uuid4().hex[:8])  # its push logs' chain
        mine, theirs = self._ctx.Pipe()  # control messages are binary records (runtime.local.wire)
        main = threading.current_thread() is threading.main_thread()
        args = (self.config, k, self._block.handle, main, self.layout, theirs, self.join_timeout)
        return self._spawn(_shard_entry, f"stalewise-shard-{k}", *args), mine

    def _start_backup(self, k: int) -> tuple:
        """Starts shard ``k``'s backup: ``(process, its control, the primary's end of its link)``."""
        (link, theirs), (control, their_control) = self._ctx.Pipe(), self._ctx.Pipe()
        p = self._spawn(backup_main, f"stalewise-backup-{k}", self.config, k, self._block.handle,
                        self.layout, theirs, their_control, self.join_timeout)  # fmt: skip
        with self._procs_lock:
            self._spawning.add(p)
        return p, control, link

    def _spawn(self, target: Any, name: str, *args: Any) -> Any:
        """Starts process ``name`` running ``target(*args)``; closes the pipe ends in ``args``."""
        p = self._ctx.Process(target=target, args=args, name=name, daemon=True)
        with thread_budget(1), stalewise_main(self._needs_main):
            p.start()
        for end in args:
            if isinstance(end, connection.Connection):
                end.close()
        return p

    def _link_backup(self, k: int, primary: Any, started: tuple | None = None) -> None:
        """Hands backup ``started`` (else a new one), once ready, to shard ``k``'s ``primary``;
        one that fails to start is replaced (``LINK_TRIES``) while that primary needs one."""
        needed = lambda: not (self._closing.is_set() or self._procs[k] is not primary  # noqa: E731
                              or self._backups[k])  # fmt: skip
        for attempt in range(LINK_TRIES):
            time.sleep(0.5 * attempt)
            with self._procs_lock:
                if not needed() or not primary.is_alive():
                    return
            p, control, link = started or self._start_backup(k)
            started = None
            try:
                reply = recv_reply(control, self.start_timeout, f"start of shard {k}'s backup")
                with self._lock, self._procs_lock:
                    if not needed():
                        raise ShardError(f"shard {k}'s backup was not needed")
                    if reply[0] != "ready":
                        raise ShardError(f"shard {k}'s backup did not start: {reply!r}")
                    self._controls[k].send_bytes(wire.backup(p.pid, self.backup_timeout))
                    reduction.send_handle(self._controls[k], link.fileno(), primary.pid)
                    self._backups[k] = (p, control)
                    log.info("shard %d: backup %d linked", k, p.pid)
                    return
            except (ShardError, ServerClosed, TimeoutError, OSError) as e:
                quiet = self._closing.is_set() or not primary.is_alive()
                (log.debug if quiet else log.warning)("shard %d: no backup: %s", k, e)
                p.kill()
                p.join()
                control.close()
            finally:
                link.close()  # the primary holds its own copy: its EOF is the backup's death
                with self._procs_lock:
                    self._spawning.discard(p)
        if not self._closing.is_set():
            log.error("shard %d: no backup in %d tries; it serves alone", k, LINK_TRIES)

    def _wait_ready(self, k: int) -> None:
        try:
            reply = recv_reply(self._controls[k], self.start_timeout, f"start of shard {k}")
        except ServerClosed:
            self._procs[k].join(1)
            raise ShardError(
                f"shard {k} died while starting ({describe_exit(self._procs[k].exitcode)})"
            ) from None
        if reply != ("ready", k):
            raise ShardError(f"shard {k} failed to start: {reply!r}")

    def _watch_shards(self) -> None:
        """The watcher thread: writes each shard process's early exit into its control word."""
        exits = self.control[self.layout.shard_exits]
        while not self._closing.is_set():
            with self._procs_lock:
                running = {
                    p.sentinel: (k, p) for k, p in enumerate(self._procs) if math.isnan(exits[k])
                }
                backups = {b[0].sentinel: (k, b) for k, b in enumerate(self._backups) if b}
            for sentinel in connection.wait([*running, *backups], timeout=0.1):
                if sentinel in backups:
                    self._backup_ended(*backups[sentinel])
                    continue
                k, p = running[sentinel]
                p.join(1)  # its exit code, once reaped (here or by another thread)
                code = p.exitcode
                with self._procs_lock:
                    if self._closing.is_set() or self._procs[k] is not p:
                        continue  # closing (exits are expected), or restarted meanwhile
                    exits[k] = math.inf if code is None else code
                log.debug("shard %d's process ended (%s)", k, describe_exit(code))
                if self.heals:
                    threading.Thread(target=self.heal, args=(k,), daemon=True).start()

    def _backup_ended(self, k: int, b: tuple) -> None:
        """Backup ``b`` of shard ``k`` ended: a new one is started (its primary serves alone)."""
        with self._procs_lock:
            if self._closing.is_set() or self._backups[k] is not b:
                return  # closing, or dropped by a restart of its primary
            self._backups[k] = None
        b[0].join(1)
        b[1].close()
        log.warning("shard %d's backup ended (%s); starting a new one", k,
                    describe_exit(b[0].exitcode))  # fmt: skip
        threading.Thread(target=self._link_backup, args=(k, self._procs[k]), daemon=True).start()

    def _observer(self) -> Client:
        handle = self._block.handle
        return Client(None, handle, self.layout, self.config, self._controls, self._block)

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def client(self, worker: int | None = None) -> Client:
        """A client for a new incarnation of ``worker`` (None: the lowest id without a client);
        a later call for an id restarts it once its old process has exited (its pipes are cut)."""
        with self._lock:
            if worker is None:
                worker = self.free_worker(
                    None, taken=self._door.attached(True) if self._door else set()
                )
            self._attached.discard(worker)  # yours now: its liveness is yours to watch
            return self._client(worker, self.heals)

    def _client(self, worker: int, rejoins: bool = False) -> Client:
        if type(worker) is not int or not 0 <= worker < self.workers:
            raise ValueError(
                f"unknown worker {worker!r}: this server has workers 0..{self.workers - 1}"
            )
        self._cut(worker)  # the old incarnation's pipes
        self.check()
        if self._residuals is not None:  # the successor takes over the residual not yet sent
            self._residuals.hand_over(worker, self._incarnations[worker])
        self._incarnations[worker] += 1
        self._clients[worker] += 1
        inc = self._incarnations[worker]
        with self._naming_dead_shards():
            joins = [self._join(k, worker, inc) for k in range(len(self._controls))]
        self._worker_ends[worker] = ends = [end for end, _ in joins]
        client = Client(worker, self._block.handle, self.layout, self.config, ends,
                        incarnation=inc, joined_at=max(clock for _, clock in joins))  # fmt: skip
        if rejoins:  # its end travels with the client, as its shard pipes do
            theirs, self._rejoins[worker] = self._ctx.Pipe()
            self._worker_ends[worker] = [*ends, theirs]
            client.rejoin = Rejoin(theirs, REJOIN_TIMEOUT, client)
        return client

    def _join(self, k: int, worker: int, inc: int) -> tuple[Any, int]:
        """Joins ``worker``'s ``inc`` to shard ``k`` on a new pipe: the worker's end, its clock."""
        mine, theirs = self._ctx.Pipe()
        self._controls[k].send_bytes(wire.join(worker, inc))
        reduction.send_handle(self._controls[k], theirs.fileno(), self._procs[k].pid)
        theirs.close()  # shard k holds its own copy now
        reply = self.observer._take(k, "joined", self.start_timeout)
        assert reply[1:3] == (worker, inc), reply
        return mine, reply[3]

    @_locked
    def rejoin(self, k: int, worker: int, to: Any = None, pid: int = 0) -> Any:
        """A new pipe between restarted shard ``k`` and ``worker``'s incarnation, kept there
        (:meth:`restart_shard`): the worker's end, for the caller to pass on and close, or
        sent now over ``to``, a pipe or socket of process ``pid`` (:class:`~.client.Rejoin`)."""
        with self._naming_dead_shards():
            end = self._join(k, worker, self._incarnations[worker])[0]
        if to is None:
            return end
        with end:
            to.send_bytes(wire.rejoin(k))
            reduction.send_handle(to, end.fileno(), pid)

    def free_worker(self, want: int | None, *, taken: set[int]) -> int:
        """The worker id a joining process gets: ``want`` if not ``taken``, else the lowest free
        one; ValueError: ``want`` is out of range or taken, or every id is (the job is full)."""
        if want is not None:
            if type(want) is int and want in taken:
                raise ValueError(f"worker {want} is held by an attached process")
            return want  # checked by _client
        for w in range(self.workers):
            if w not in taken and (self._clients[w] == 0 or w in self._attached):
                return w
        raise ValueError(
            f"the job is full: its {self.workers} worker ids are taken (serve it with "
            "workers=(min, max) for room to join)"
        )

    def attach_client(self, want: int | None, *, taken: set[int]) -> tuple[Client, list]:
        """A client for a process attaching by name (:meth:`free_worker`, then :meth:`client`;
        its socket is its rejoin channel) and this process's pipe ends, the caller's to close."""
        with self._lock:
            w = self.free_worker(want, taken=taken)
            client = self._client(w)
            self._attached.add(w)
            ends, self._worker_ends[w] = self._worker_ends[w], []
            return client, ends

    def incarnation(self, worker: int) -> int:
        """The newest incarnation of ``worker`` (0: none yet)."""
        return self._incarnations[worker]

    def attached(self) -> set[int]:
        """The worker ids held by processes attached by name (:func:`stalewise.attach`)."""
        return set() if self._door is None else self._door.attached()

    def release(self, worker: int) -> None:
        """Closes this process's copies of ``worker``'s pipes (call it after starting its
        process, so that the shards see them close if it dies)."""
        for c in self._worker_ends[worker]:
            c.handed_on = True  # the client here says so if used (Client._attach)
        self._cut(worker, ending=False)

    def _cut(self, worker: int, ending: bool = True) -> None:
        """Closes this process's ends of ``worker``'s pipes (``ending``: its rejoin pipe too)."""
        ends, self._worker_ends[worker] = self._worker_ends[worker], []
        if ending and worker in self._rejoins:
            ends.append(self._rejoins.pop(worker))
        for c in ends:
            c.close()

    def heal(self, k: int) -> None:
        """Restarts dead shard ``k`` (from its backup, else its push logs) and sends each live
        worker its new pipe: an attached process's over its socket, a :meth:`client`'s over
        its rejoin pipe (:class:`~.client.Rejoin`); one that cannot carry on loses that channel."""
        with self._lock:
            if self._closing.is_set() or k not in self.dead_shards():
                return
            leases = {} if self._door is None else self._door.reap()
            for w in [w for w, c in self._rejoins.items() if closed(c)]:  # its process ended
                self._rejoins.pop(w).close()
            keep, carried = {**leases, **self._rejoins}, []
            try:
                source = self.restart_shard(k, keep=tuple(keep))["source"]
            except Exception as e:  # its workers' calls name the shard, as without replicas
                log.error("shard %d could not be restarted: %s", k, e)
                source = None
            for w, to in sorted(keep.items()) if source in ("backup", "push log") else ():
                try:  # pid: unused on Unix sockets
                    self.rejoin(k, w, to, pid=0)
                    carried.append(w)
                except Exception as e:  # it has gone, or the shard died again
                    log.warning("worker %d: no new pipe to shard %d: %s", w, k, e)
            for w in keep.keys() - set(carried):
                (leases if w in leases else self._rejoins).pop(w).close()
            if source is not None:
                log.warning("shard %d restarted from its %s; workers %s carry on", k, source,
                            carried)  # fmt: skip

    @property
    def job_pushes(self) -> int:
        """Pushes committed by all the job's workers so far (each id over its incarnations)."""
        return int(self.control[self.layout.pushes_done].sum())

    @_locked
    def pull(self, *, copy: bool = True, into: Any = None, timeout: float | None = 60.0) -> Any:
        """The current parameters, as an observer; ShardError: a shard's process died."""
        self.check()
        with self._naming_dead_shards():
            return self.observer.pull(copy=copy, into=into, timeout=timeout)

    def losses(self) -> np.ndarray:
        """Each worker id's last training loss, as its client published it (NaN: none)."""
        return self.control[self.layout.losses]

    @_locked
    def stats(self, timeout: float | None = 60.0) -> list[dict]:
        """Each shard's counters (applied, rejected, staleness, bytes, version)."""
        self._send_all([wire.stats()] * len(self._controls))
        with self._naming_dead_shards():
            return [self.observer._take(k, "stats", timeout)[1] for k in range(len(self._controls))]

    @_locked
    def state_dicts(
        self, timeout: float | None = 60.0, log_dir: str | None = None, fsync: bool = False
    ) -> list[dict]:
        """Each shard's whole state (:meth:`Shard.state_dict`), all as of the same pushes (a
        consistent cut: :class:`~stalewise.protocol.delivery.Cut`); with ``log_dir``, each shard
        begins a push log there at that state (``fsync``: each turn's entries are fsynced before
        its acks); a cut that fails thaws every shard."""
        self._cuts += 1
        n, cut, names = len(self._controls), self._cuts, None
        try:
            self._send_all([wire.cut(cut, None)] * n)
            targets = delivery.targets(self._cut_replies(cut, timeout))
            paths = [""] * n
            if log_dir is not None:
                with contextlib.suppress(OSError):  # else the shards say why they write none
                    os.makedirs(log_dir, 0o755, exist_ok=True)
                names = [f"log-shard-{k}-{t}-{self._log_n + 1:06d}" for k, t in self._tags.items()]
                paths = [os.path.join(log_dir, name) for name in names]
            self._send_all([wire.cut(cut, targets, p, fsync) for p in paths], names is not None)
            states = self._cut_replies(cut, timeout)
        except BaseException:
            for c in self._controls:  # no reply: the next cut drops this one's
                with contextlib.suppress(OSError):
                    c.send_bytes(wire.thaw())
            raise
        if names is not None:
            self._based = (states, names, log_dir, fsync)
        return states

    def _send_all(self, bodies: list[bytes], logs: bool = False) -> None:
        """Sends ``bodies[k]`` to each live shard ``k``, even if another's pipe is broken;
        ``logs``: they name push log N, which each live shard then begins: N is taken."""
        self.check()
        broken = None
        for c, body in zip(self._controls, bodies, strict=True):
            try:
                c.send_bytes(body)
            except OSError as e:
                broken = e
        self._log_n += int(logs)  # (at the cut, or where it gives it up: a chain has no gap)
        if broken is not None:
            with self._naming_dead_shards():
                raise broken

    def _cut_replies(self, cut: int, timeout: float | None) -> list:
        """Each shard's reply to cut number ``cut`` (earlier cuts', given up, are dropped);
        TimeoutError if one gave it up (``CUT_LIMIT``) or did not reply in ``timeout`` s."""
        out = []
        with self._naming_dead_shards():
            for k in range(len(self._controls)):
                while (reply := self.observer._take(k, "cut", timeout)[1])[0] != cut:
                    continue  # its reply to an earlier cut, given up
                if reply[2] is not None:
                    raise TimeoutError(reply[2])
                out.append(reply[1])
        return out

    def residuals(self, timeout: float = 10.0) -> list[np.ndarray] | None:
        """Each worker's residual after its last committed push (None: the codec keeps none)."""
        if self._residuals is None:
            return None
        out = []
        for w in range(self.workers):
            r = np.empty(self.layout.size, self.layout.dtype)
            self._residuals.read(w, self._incarnations[w], r, timeout)
            out.append(r)
        return out

    def load_residuals(self, residuals: list[np.ndarray]) -> None:
        """Sets each worker's error-feedback residual for its first incarnation (before
        :meth:`client`; ignored when the codec keeps none); ValueError: a wrong count or shape."""
        if self._residuals is None:
            return
        if len(residuals) != self.workers:
            raise ValueError(f"{len(residuals)} residuals for {self.workers} workers")
        want = (self.layout.size,)
        for w, r in enumerate(residuals):
            if np.shape(r) != want:
                raise ValueError(f"worker {w}'s residual has shape {np.shape(r)}, not {want}")
        for w in range(self.workers):
            if self._clients[w]:
                raise ValueError(f"worker {w} has a client: load residuals before it does")
        for w, r in enumerate(residuals):
            self._residuals.put(w, r)

    def dead_shards(self) -> list[int]:
        """The shards whose process has exited (asks the OS; no message is sent)."""
        # reaped once its sentinel is ready: the OS reports its exit a moment later otherwise
        ended = connection.wait(self.shard_sentinels(), 0)
        for p in self._procs:
            if p.sentinel in ended:
                p.join(5)
        return [k for k, p in enumerate(self._procs) if not p.is_alive()]

    def shard_exit(self, k: int) -> str:
        """How shard ``k``'s process ended, for messages (``killed by SIGKILL``)."""
        return describe_exit(self._procs[k].exitcode)

    def shard_sentinels(self) -> list:
        """Each shard process's sentinel (ready once it has exited), for ``connection.wait``."""
        return [p.sentinel for p in self._procs]

    def check(self) -> None:
        """Raises :class:`ShardError` naming every shard whose process has died."""
        dead = self.dead_shards()
        if dead:
            raise ShardError(
                "; ".join(f"shard {k} has died ({self.shard_exit(k)})" for k in dead)
                + " (LocalServer.restart_shard restarts one; its workers must then rejoin)"
            )

    @contextlib.contextmanager
    def _naming_dead_shards(self):
        """Turns a broken pipe to a shard that died meanwhile into a ShardError naming it."""
        try:
            yield
        except TimeoutError:
            raise
        except (OSError, ServerClosed):
            # the pipes close a moment (over 0.5 s when loaded) before the OS reports the exit
            deadline = time.monotonic() + SHARD_EXIT_WAIT
            while not self.dead_shards() and time.monotonic() < deadline:
                connection.wait(self.shard_sentinels(), 0.05)
            self.check()
            raise

    @_locked
    def load_state_dicts(self, states: list[dict], timeout: float | None = 60.0) -> list[int]:
        """Loads one :meth:`Shard.state_dict` into each shard before any worker joins; returns
        the versions. ValueError: a shard refused its state (naming the shard and the key)."""
        if len(states) != len(self._controls):
            raise ValueError(f"{len(states)} shard states for {len(self._controls)} shards")
        for c, state in zip(self._controls, states, strict=True):
            c.send_bytes(wire.load(state))
        replies = [self.observer._take(k, "loaded", timeout) for k in range(len(self._controls))]
        errors = [f"shard {k}: {msg[2]}" for k, msg in enumerate(replies) if msg[2] is not None]
        if errors:
            raise ValueError("; ".join(errors))
        for state in states:
            for w, inc in enumerate(np.asarray(state["incarnation"]).tolist()[: self.workers]):
                self._incarnations[w] = max(self._incarnations[w], int(inc))
        return [int(msg[1]) for msg in replies]

    def resume(self, ckpt: Any) -> None:
        """Puts a :class:`~stalewise.checkpoint.Checkpoint` of this job into the shards first."""
        from stalewise import checkpoint

        self.load_state_dicts(ckpt.states)
        feedback = checkpoint.feedback_of(ckpt, self.config, self.workers)
        if feedback is not None:
            self.load_residuals([f.residual for f in feedback])
        pushed = ckpt.step.get("pushed")
        counts = self.control[self.layout.pushes_done]
        if (
            isinstance(pushed, list)
            and len(pushed) == self.workers
            and all(type(n) is int and 0 <= n < 2**62 for n in pushed)
        ):
            counts[:] = pushed  # each worker id's own count (the liveness rule reads them)
        else:  # the job's total: what a budget of steps counts
            counts[0] = int(ckpt.step.get("pushes", 0))

    @_locked
    def checkpoint_parts(
        self, timeout: float | None = 60.0, log_dir: str | None = None, fsync: bool = False
    ) -> tuple[list, dict, Any]:
        """What a checkpoint of this server holds: ``(states, step, residuals)``; pushes in
        flight count as not made (:func:`~stalewise.protocol.budget.held`)."""
        states = self.state_dicts(timeout, log_dir, fsync)
        records, counts = self.layout.records(self._block), self.control[self.layout.pushes_done]
        pushed = []
        for w in range(self.workers):
            n = -1
            while n != int(counts[w]):  # the count and the record of the same commit
                n, rec = int(counts[w]), records[w].copy()
            # the commit word is seq + 1, or 0 while the next push's record is written
            committed = int(rec[layout_lib.R_COMMIT]) or int(rec[layout_lib.R_SEQ])
            seats = ((int(s["incarnation"][w]), int(s["next_seq"][w])) for s in states)
            handled = budget.handled(int(rec[layout_lib.R_INC]), committed, seats)
            pushed.append(budget.held(n, committed, handled))
        step = {"pushes": sum(pushed), "pushed": pushed}
        if log_dir:
            step["logs"] = self._based[1]
        return states, step, self.residuals()

    def published_version(self, k: int = 0) -> int:
        """Shard ``k``'s version as last published for pulls (shared memory: asks no one)."""
        if self._snapshots is None:
            self._snapshots = Snapshots(self.layout, self._block, self.config.ranges)
        return self._snapshots.version(k)

    @_locked
    def restart_shard(
        self, k: int, base: dict | None = None, timeout: float = 60.0, keep: tuple = ()
    ) -> dict:
        """Brings back shard ``k``, whose process has died: its live backup, else a new process
        restored from its push logs (workers ``keep`` keep their seats), else from the last
        snapshot and ``base`` (its :meth:`state_dict`) or fresh. Other workers must rejoin.
        Returns ``{"shard", "version", "lost", "source"}`` (``lost``: None when unknown)."""
        p = self._procs[k]
        p.join(1)
        if p.is_alive():
            raise ValueError(f"shard {k} is alive; restart_shard replaces a shard that died")
        self._controls[k].close()
        snapshots = Snapshots(self.layout, self._block, self.config.ranges)
        # the dead shard may have been writing its other snapshot buffer: make its sequence even
        row = snapshots.table[k]
        for i in (0, 1):
            row[layout_lib._SEQ + i] += row[layout_lib._SEQ + i] & 1
        survivors = [j for j in range(len(self._procs)) if j != k and self._procs[j].is_alive()]
        # drop the replies an observer that gave up left unread, and start a new observer
        for j in survivors:
            while self._controls[j].poll(0.05):
                self._controls[j].recv_bytes()
        self.observer = self._observer()
        with self._procs_lock:
            backup, self._backups[k] = self._backups[k], None
        if backup is not None:
            try:
                return self._promote(k, backup, timeout, snapshots.version(k), keep)
            except (ServerClosed, TimeoutError, OSError, CheckpointError, ShardError) as e:
                log.warning("shard %d: its backup's state is not used: %s", k, e)
            backup[1].close()
            backup[0].kill()
            backup[0].join()
        replayed, source, why = None, "push log", "no checkpoint folder"
        if self._based is not None:
            try:
                replayed, why = self._replayed(k), "it broke: behind what the shard published"
            except CheckpointError as e:
                why = str(e)
        if replayed is not None and replayed[0]["version"] >= snapshots.version(k):
            (state, logged), lost = replayed, 0
        else:
            log.warning("shard %d: no push log (%s): restarting it from its last published "
                        "snapshot; its later updates are lost", k, why)  # fmt: skip
            self._tags[k] = uuid.uuid4().hex[:8]  # a new chain
            state, lost, source = self._unlogged(k, base, snapshots, survivors, timeout)
            logged = None
        proc, self._controls[k] = self._start_shard(k)
        with self._procs_lock:  # the watcher now watches the new process
            self._procs[k] = proc
            self.control[self.layout.shard_exits][k] = np.nan
        self._wait_ready(k)
        self._controls[k].send_bytes(wire.load(state, logged, keep))
        reply = self.observer._take(k, "loaded", timeout)
        if reply[2] is not None:
            raise ShardError(f"shard {k} refused its recovered state: {reply[2]}")
        if self.replicated:
            threading.Thread(target=self._link_backup, args=(k, proc), daemon=True).start()
        return {"shard": k, "version": int(reply[1]), "lost": lost, "source": source}

    @property
    def logged(self) -> bool:
        """Whether the shards write push logs, from which a dead one is rebuilt."""
        return self._based is not None

    def _promote(self, k: int, backup: tuple, timeout: float, published: int, keep: tuple) -> dict:
        """Dead shard ``k``'s ``backup`` (process, control) serves in its place, its log the
        chain's newest cut it holds (none: a new chain); CheckpointError if behind ``published``."""
        from stalewise.protocol.replica import stale

        p, control = backup
        control.send_bytes(wire.stats())
        held = recv_reply(control, timeout, f"shard {k}'s backup's state", trusted=True)[1]
        if why := stale((0, True, published, 0), 0, held["version"]):  # one view, no counts
            raise CheckpointError(why)
        (path, at), logged = held["held"], ("", None, False)  # no log: the state alone
        if self._based is not None:
            name = f"log-shard-{k}-{self._tags[k]}-{self._log_n:06d}"
            newest = os.path.join(self._based[2], name)
            if (at := continued(newest, path, at)) is None:  # its backup's state is not in it
                self._tags[k] = uuid.uuid4().hex[:8]
            else:
                log.info("shard %d: its backup's state: %s at byte %d", k, newest, at)
                logged = (newest, at, self._based[3])
        control.send_bytes(wire.load(None, logged, keep))
        reply = recv_reply(control, timeout, f"shard {k}'s backup's promotion")
        if reply[0] != "loaded" or reply[2] is not None:
            raise ShardError(f"shard {k}'s backup refused to serve: {reply!r}")
        p.name = f"stalewise-shard-{k}"
        with self._procs_lock:  # the watcher now watches it as the primary
            self._procs[k], self._controls[k] = p, control
            self.control[self.layout.shard_exits][k] = np.nan
        self.observer = self._observer()
        threading.Thread(target=self._link_backup, args=(k, p), daemon=True).start()
        return {"shard": k, "version": int(reply[1]), "lost": 0, "source": "backup"}

    def _replayed(self, k: int) -> tuple[dict, tuple]:
        """Shard ``k``'s state when it died (the last logged cut's and its log chain), and
        the log it goes on with: ``(path, at, fsync)`` (ShardProcess.begin_log)."""
        from stalewise.checkpoint.replay import replay_chain

        states, names, folder, fsync = self._based
        shard = self.config.build_shard(k, np.array(states[k]["params"]), self.workers)
        shard.load_state_dict(states[k])
        read, end = replay_chain(shard, Path(folder), names[k])
        name = f"log-shard-{k}-{self._tags[k]}-{self._log_n:06d}"  # the chain's newest number
        log.info("shard %d: replayed %s to version %d", k, ", ".join(read), shard.version)
        at = end if read and read[-1] == name else None  # None: it had not begun it
        return shard.state_dict(), (os.path.join(folder, name), at, fsync)

    def _unlogged(self, k: int, base: dict | None, snapshots: Snapshots, survivors: list,
                  timeout: float) -> tuple[dict, int | None, str]:  # fmt: skip
        """Shard ``k``'s state without a log, the updates lost and their source."""
        lo, hi = self.config.ranges[k]
        snap = np.empty(self.config.spec.size, self.config.init.dtype)
        published = snapshots.read(k, snap)
        shard = self.config.build_shard(k, snap[lo:hi].copy(), self.workers)
        source = "published snapshot"
        if base is not None:
            try:
                shard.load_state_dict(base)
            except ValueError as e:
                raise ValueError(f"shard {k}: {e}") from None
            if shard.version > published:
                source = "checkpoint"
        if source != "checkpoint":
            np.copyto(shard.params, snap[lo:hi])
            shard.version = published
        for w in range(self.workers):  # every worker rejoins as a new incarnation
            if shard.live[w]:
                shard.leave(w)
        state, lost = shard.state_dict(), None
        if survivors:
            j = survivors[0]
            self._controls[j].send_bytes(wire.state())
            other = self.observer._take(j, "state", timeout)[1]
            lost = max(0, int(other["version"]) - state["version"])
            state["version"] = other["version"]
            state.update({key: other[key] for key in _PER_PUSH_STATS})
        return state, lost, source

    def unlink(self) -> None:
        """Removes the shared-memory name early, if it has one (later workers cannot join)."""
        self._block.unlink()

    @_locked
    def close(self, timeout: float = 10.0) -> list[dict]:
        """Stops the shards and frees the shared memory; returns one stats dict per shard (a
        dead shard's is ``{"shard": k, "dead": "killed by SIGKILL"}``)."""
        if self._block is None:
            return []
        if self._door is not None:
            self._door.close()  # no process attaches from here on
        for w in list(self._rejoins):
            self._rejoins.pop(w).close()
        if hasattr(self, "_threads"):
            self._threads.close()  # the environment as it was
        self._closing.set()  # the shards' exits from here on are expected
        if self._watcher.is_alive():
            self._watcher.join()
        if hasattr(self, "control"):
            self.control[0] = 1  # the stop flag: a client whose pipe ends sees the server closed
        final: list[dict] = []
        # a fresh observer (the old one gives up once a shard died; its pulled arrays go now)
        observer = self.observer = self._observer() if hasattr(self, "observer") else None
        for k, c in enumerate(self._controls):
            if not self._procs[k].is_alive():
                log.error("shard %d had died (%s) before the server closed", k, self.shard_exit(k))
                final.append({"shard": k, "dead": self.shard_exit(k)})
                continue
            try:
                c.send_bytes(wire.stop())
                if observer is not None:
                    final.append(observer._take(k, "stopped", timeout)[1])
            except (OSError, ServerClosed, TimeoutError):
                final.append({"shard": k, "dead": self.shard_exit(k)})
        for k, (_, c) in [(k, b) for k, b in enumerate(self._backups) if b]:
            with contextlib.suppress(OSError, ServerClosed, TimeoutError, IndexError), c:
                c.send_bytes(wire.stop())
                mine = recv_reply(c, timeout, "a backup's stop", trusted=True)[1]["digest"]
                same = mine == final[k].get("digest")
                final[k]["backup"] = "equal" if same else "differs"
                log.log(logging.INFO if same else logging.ERROR, "shard %d: its backup's state %s "
                        "its primary's", k, "equals" if same else "differs from")  # fmt: skip
        with self._procs_lock:
            for p in self._spawning:  # not linked: not needed
                p.kill()
            others = [b[0] for b in self._backups if b] + list(self._spawning)
        for p in self._procs + others:
            p.join(timeout)
            if p.is_alive():
                log.warning("shard process %s did not stop; killing it", p.pid)
                p.kill()
                p.join()
        self._procs = []
        self.final_params = np.array(self.layout.params(self._block))  # copy out before unmapping
        self._block.unlink()
        self.control = None  # type: ignore[assignment]
        self._snapshots = None
        self._block.close()
        self._block = None  # type: ignore[assignment]
        return final
