"""The local runtime: shards and workers as OS processes on one machine.

Bytes move through one shared-memory block (see :mod:`stalewise.runtime.local.layout`);
only small control tuples go through pipes.

A pull normally asks no one: the worker copies each shard's latest published
snapshot (seqlocked, so never torn) into its pull buffer. When the worker's
clock is too far ahead for the consistency model by the published clocks, or
when DC-ASGD needs the shard to remember what the worker pulled, the pull is
served: the shard answers when the gate opens, copying its slice itself. The
server's own observer pull (evaluation, ``LocalServer.pull``) is always served,
so it sees every acknowledged push. A push writes the flattened update into
the worker's push buffer, commits its record (see
:mod:`stalewise.runtime.local.layout`) and sends ``("push", seq)`` to every
shard; the buffer is reused only after every shard acknowledged it.

Each incarnation of a worker gets its own pipes, made by
:meth:`LocalServer.client` and handed to the shard processes over their control
pipes (file-descriptor passing), so a shard knows who sent a message from the
pipe it came on. When a worker's pipe closes (it left, or its process died),
the shard delivers a push the worker committed but the shard has not handled,
then drops the worker. The worker's side is
:class:`stalewise.runtime.local.client.Client`; a shard process's body is
:mod:`stalewise.runtime.local.shard_proc`; this module holds
:class:`LocalServer`, which starts and stops them.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from multiprocessing import reduction
from typing import Any

import numpy as np

from stalewise.protocol import ServerConfig
from stalewise.runtime.local.client import Client, ServerClosed, recv_reply
from stalewise.runtime.local.layout import Layout, Snapshots
from stalewise.runtime.local.procs import thread_budget
from stalewise.runtime.local.shard_proc import shard_main
from stalewise.runtime.local.shm import SharedBlock

log = logging.getLogger(__name__)


class LocalServer:
    """The shards of a job, running as local processes; a context manager.

    Example:
        >>> with LocalServer(config, workers=2) as server:   # doctest: +SKIP
        ...     client = server.client(0)
        ...     params = client.pull()
        ...     client.push(grads)
    """

    def __init__(
        self,
        config: ServerConfig,
        workers: int,
        *,
        start_timeout: float = 120.0,
        join_timeout: float = 300.0,
    ):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.config = config
        self.workers = workers
        self.start_timeout = start_timeout
        self.layout = Layout(config.spec.size, str(config.init.dtype), workers, config.shards)
        self._ctx = mp.get_context("spawn")
        self._block = SharedBlock.create(self.layout.nbytes)
        self._procs: list = []
        self._controls: list = []
        self._incarnations = [0] * workers  # the newest incarnation of each worker id
        self._worker_ends: list[list] = [[] for _ in range(workers)]  # until release(w)
        self._snapshots: Snapshots | None = None  # the parent's view, for published_version
        try:
            self.layout.params(self._block)[:] = config.init
            self.control = self.layout.control(self._block)
            self.control[1 + workers :] = np.nan  # last loss per worker: none yet
            for k in range(config.shards):
                mine, theirs = self._ctx.Pipe()
                p = self._ctx.Process(
                    target=shard_main,
                    args=(config, k, self._block.name, self.layout, theirs, join_timeout),
                    name=f"stalewise-shard-{k}",
                    daemon=True,
                )
                with thread_budget(1):
                    p.start()
                self._procs.append(p)
                self._controls.append(mine)
                theirs.close()
            for k, c in enumerate(self._controls):
                if recv_reply(c, start_timeout, f"start of shard {k}") != ("ready", k):
                    raise RuntimeError(f"shard {k} failed to start")
            self.observer = Client(
                None, self._block.name, self.layout, config, self._controls, self._block
            )
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def client(self, worker: int) -> Client:
        """A client for a new incarnation of ``worker`` (0 <= worker < workers).

        The first call for an id starts that worker; a later call restarts it: the
        shards first finish the old incarnation (a push it committed is delivered
        everywhere) and drop it, then the new one starts from the current
        parameters with fresh sequence numbers, and the old one's pipes are cut.
        Restart a worker only once its old process has exited or been killed: both
        would write the same shared push buffer.
        """
        if not (isinstance(worker, int) and 0 <= worker < self.workers):
            raise ValueError(
                f"unknown worker {worker!r}: this server has workers 0..{self.workers - 1}"
            )
        self.release(worker)
        self._incarnations[worker] += 1
        inc = self._incarnations[worker]
        ends = []
        for k, control in enumerate(self._controls):
            mine, theirs = self._ctx.Pipe()
            control.send(("join", worker, inc))
            reduction.send_handle(control, theirs.fileno(), self._procs[k].pid)
            theirs.close()  # shard k holds its own copy now
            ends.append(mine)
        for k in range(len(self._controls)):
            reply = self.observer._take(k, "joined", self.start_timeout)
            assert reply[1:] == (worker, inc), reply
        self._worker_ends[worker] = ends
        return Client(worker, self._block.name, self.layout, self.config, ends, incarnation=inc)

    def release(self, worker: int) -> None:
        """Closes this process's copies of ``worker``'s pipes once its process holds them.

        Call it after starting the worker's process: then, if that process dies,
        the shards see its pipes close and stop waiting for it (gates, BSP rounds).
        """
        for c in self._worker_ends[worker]:
            c.close()
        self._worker_ends[worker] = []

    def pull(self, *, copy: bool = True, into: Any = None, timeout: float | None = 60.0) -> Any:
        """The current parameters (as an observer: never gated, not counted as a worker)."""
        return self.observer.pull(copy=copy, into=into, timeout=timeout)

    def stats(self, timeout: float | None = 60.0) -> list[dict]:
        """Each shard's counters (applied, rejected, staleness, bytes, version)."""
        for c in self._controls:
            c.send(("stats",))
        return [self.observer._take(k, "stats", timeout)[1] for k in range(len(self._controls))]

    def state_dicts(self, timeout: float | None = 60.0) -> list[dict]:
        """Each shard's whole state (:meth:`Shard.state_dict`), between two messages it handles."""
        for c in self._controls:
            c.send(("state",))
        return [self.observer._take(k, "state", timeout)[1] for k in range(len(self._controls))]

    def load_state_dicts(self, states: list[dict], timeout: float | None = 60.0) -> list[int]:
        """Loads one :meth:`Shard.state_dict` into each shard (a checkpoint); returns the versions.

        Call it before any worker joins. Every shard checks its state before
        changing anything (:meth:`Shard.load_state_dict`); a refusal raises
        ValueError naming the shard and the key. The loaded incarnation numbers
        are remembered, so :meth:`client` starts new incarnations above them.
        The loaded workers that were live count for the gates until their new
        incarnations join (which first makes the old ones leave).
        """
        if len(states) != len(self._controls):
            raise ValueError(f"{len(states)} shard states for {len(self._controls)} shards")
        for c, state in zip(self._controls, states, strict=True):
            c.send(("load", state))
        replies = [self.observer._take(k, "loaded", timeout) for k in range(len(self._controls))]
        errors = [f"shard {k}: {msg[2]}" for k, msg in enumerate(replies) if msg[2] is not None]
        if errors:
            raise ValueError("; ".join(errors))
        for state in states:
            for w, inc in enumerate(np.asarray(state["incarnation"]).tolist()[: self.workers]):
                self._incarnations[w] = max(self._incarnations[w], int(inc))
        return [int(msg[1]) for msg in replies]

    def published_version(self, k: int = 0) -> int:
        """Shard ``k``'s version as last published for pulls (shared memory: asks no one)."""
        if self._snapshots is None:
            self._snapshots = Snapshots(self.layout, self._block, self.config.ranges)
        return self._snapshots.version(k)

    def unlink(self) -> None:
        """Removes the shared-memory name early (every process has mapped it already)."""
        self._block.unlink()

    def close(self, timeout: float = 10.0) -> list[dict]:
        """Stops the shards and frees the shared memory; returns the shards' final stats."""
        if self._block is None:
            return []
        final: list[dict] = []
        for k, c in enumerate(self._controls):
            try:
                c.send(("stop",))
                if hasattr(self, "observer"):
                    final.append(self.observer._take(k, "stopped", timeout)[1])
            except (OSError, ServerClosed, TimeoutError):
                pass
        for p in self._procs:
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
