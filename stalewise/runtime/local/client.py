"""A worker's handle on the local runtime's shards: pull, push, wait.

Threading contract: a :class:`Client` belongs to one thread of one process.
Every blocking call takes a ``timeout`` in seconds (None waits forever).
See :mod:`stalewise.runtime.local` for how pulls and pushes move.
"""

from __future__ import annotations

import math
import time
from multiprocessing import connection
from typing import Any

import numpy as np

from stalewise import tree
from stalewise.protocol import Ack, PushHeader, ServerConfig
from stalewise.runtime.local.layout import Layout, Snapshots
from stalewise.runtime.local.shm import SharedBlock


class PushRejected(RuntimeError):
    """A shard refused a push; the message says which shard and why."""


class ServerClosed(ConnectionError):
    """The shards have stopped (the job ended or a shard process died)."""


def recv_reply(conn: connection.Connection, timeout: float | None, what: str) -> Any:
    if not conn.poll(timeout):
        raise TimeoutError(f"no answer to {what} within {timeout} s")
    try:
        return conn.recv()
    except (EOFError, OSError):
        raise ServerClosed(f"shard closed the connection while waiting for {what}") from None


class Client:
    """A worker's handle on the shards: ``pull()`` params, ``push()`` updates.

    Made by :meth:`LocalServer.client`; picklable until first used, so it can be
    handed to a ``multiprocessing`` process (spawn or fork).
    """

    def __init__(
        self,
        worker: int | None,
        block_name: str,
        layout: Layout,
        config: ServerConfig,
        conns: list,
        block: SharedBlock | None = None,
    ):
        self.worker = worker
        self._block_name = block_name
        self._layout = layout
        self._spec = config.spec
        self._ranges = config.ranges
        self._consistency = config.consistency
        self._direct = not config.staleness.dc_lambda  # DC-ASGD needs served pulls
        self._conns = conns
        self._block: SharedBlock | None = None
        self._snapshots: Snapshots | None = None  # set on attach (workers only)
        if worker is None:  # the server's own observer shares its mapping
            assert block is not None
            self._block = block
            self._pull_buf = layout.observer(block)
        self._seq = 0
        self._base = [0] * len(conns)
        self._acks_due = [False] * len(conns)  # shard k still owes an ack for the last push
        self._pulls_due = [False] * len(conns)  # shard k still owes a served pull (after a timeout)
        self._acks: list[Any] = [None] * len(conns)
        self._inbox: list[list] = [[] for _ in conns]  # replies read while waiting for another kind
        self.last_acks: list[Ack] = []

    def __getstate__(self) -> dict:
        if self._block is not None:
            raise RuntimeError("a Client can be sent to another process only before its first use")
        return self.__dict__.copy()

    def _attach(self) -> SharedBlock:
        if self._block is None:  # a worker's client, first used in its own process
            self._block = SharedBlock.attach(self._block_name)
            self._pull_buf = self._layout.pull_buffer(self._block, self.worker)
            self._push_buf = self._layout.push_buffer(self._block, self.worker)
            self._snapshots = Snapshots(self._layout, self._block, self._ranges)
        return self._block

    def pull(self, *, copy: bool = True, into: Any = None, timeout: float | None = None) -> Any:
        """Blocks until the consistency model lets this worker start, then returns the params.

        Args:
            copy: False returns leaves that view the pull buffer (valid until the next pull).
            into: an existing tree or model (e.g. a ``torch.nn.Module``) to copy the
                values into, in place; it is returned.
            timeout: seconds to wait for the shards (None: forever).

        Returns:
            The parameters in the structure and backend the job was made with.
        """
        self.pull_flat(timeout=timeout)
        return self.last_pull(copy=copy, into=into)

    def last_pull(self, *, copy: bool = True, into: Any = None) -> Any:
        """The parameters of the last completed pull, as :meth:`pull` returns them."""
        if into is not None:
            tree.unflatten_into(into, self._pull_buf, self._spec)
            return into
        return tree.unflatten(self._pull_buf, self._spec, copy=copy)

    def pull_flat(self, *, timeout: float | None = None) -> np.ndarray:
        """Like :meth:`pull` but returns the flat pull buffer itself (no copy)."""
        self._attach()
        shards = range(len(self._ranges))
        snaps = self._snapshots  # None for the observer: its pulls are served
        if (
            snaps is not None
            and self._direct
            and not any(self._pulls_due)
            and all(self._consistency.may_start(self._seq, snaps.min_clock(k)) for k in shards)
        ):
            for k in shards:
                # read-your-writes: once an ack is in, wait for the snapshot that holds it
                seen = (
                    self._acks[k].version
                    if self._acks[k] is not None and not self._acks_due[k]
                    else 0
                )
                deadline = None if timeout is None else time.monotonic() + timeout
                while (version := snaps.read(k, self._pull_buf)) < seen:
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(
                            f"shard {k} did not publish version {seen} within {timeout} s"
                        )
                    time.sleep(0.0001)
                self._base[k] = version
            return self._pull_buf
        if not any(self._pulls_due):
            for c in self._conns:  # sent before reading the last push's acks: saves a round trip
                c.send(("pull",))
            self._pulls_due = [True] * len(self._conns)
        rejected = None
        try:
            self.wait(timeout=timeout)
        except PushRejected as e:
            rejected = e
        for k in shards:
            if self._pulls_due[k]:
                self._base[k] = self._take(k, "pulled", timeout)[1]
                self._pulls_due[k] = False
        if rejected is not None:  # the pull itself is complete; report the refused push
            raise rejected
        return self._pull_buf

    def _take(self, k: int, kind: str, timeout: float | None) -> Any:
        """The next reply of ``kind`` from shard ``k``, keeping replies of other kinds."""
        for i, msg in enumerate(self._inbox[k]):
            if msg[0] == kind:
                return self._inbox[k].pop(i)
        while True:
            msg = recv_reply(self._conns[k], timeout, f"{kind} from shard {k}")
            if msg[0] == kind:
                return msg
            self._inbox[k].append(msg)

    def push(self, update: Any, *, timeout: float | None = None) -> None:
        """Sends an update (same structure as the params) to every shard; returns at once.

        The previous push must have been acknowledged first; this waits for that.
        Raises PushRejected (for the previous push) if a shard refused it.
        """
        if self.worker is None:
            raise ValueError("an observer client cannot push")
        self._attach()
        rejected = None
        try:
            self.wait(timeout=timeout)  # a timeout propagates: the shards may still read the buffer
        except PushRejected as e:  # a refused previous push must not cost this one
            rejected = e
        tree.flatten(update, spec=self._spec, out=self._push_buf)
        self.push_flat_sent()
        if rejected is not None:
            raise rejected

    def push_flat_sent(self) -> None:
        """Announces the update already written into :attr:`push_buffer` to every shard."""
        refusal = None
        if len(self._conns) > 1 and not math.isfinite(np.dot(self._push_buf, self._push_buf)):
            # Each shard sees only its slice: decide for all of them, or some would
            # apply a push that another one refuses.
            bad = int(np.flatnonzero(~np.isfinite(self._push_buf))[0])
            leaf = self._spec.segments.names[
                int(np.searchsorted(self._spec.segments.offsets, bad, "right")) - 1
            ]
            refusal = (
                "not_finite",
                f"payload has NaN or Inf (first at element {bad}, leaf {leaf!r})",
            )
        for k, c in enumerate(self._conns):
            c.send(("push", PushHeader(self.worker, self._seq, self._base[k]), refusal))
        self._seq += 1
        self._acks_due = [True] * len(self._conns)

    @property
    def push_buffer(self) -> np.ndarray:
        """The flat push buffer (write an update here, then call :meth:`push_flat_sent`)."""
        self._attach()
        self.wait()
        return self._push_buf

    def wait(self, timeout: float | None = None) -> list[Ack]:
        """Waits for the acknowledgements of the last push; raises PushRejected if refused."""
        if not any(self._acks_due):
            return self.last_acks
        for k, due in enumerate(self._acks_due):
            if due:  # progress survives a timeout: the next call waits for the rest
                self._acks[k] = self._take(k, "ack", timeout)[1]
                self._acks_due[k] = False
        acks = self.last_acks = list(self._acks)
        bad = [(k, a) for k, a in enumerate(acks) if not a.ok]
        if bad:
            raise PushRejected(
                "; ".join(f"shard {k} rejected push {a.seq}: {a.reason}" for k, a in bad)
            )
        return acks

    def close(self) -> None:
        """Leaves the job (gates stop waiting for this worker) and closes the pipes."""
        try:
            if self.worker is not None:
                if any(self._acks_due):
                    self.wait(timeout=30)
                for c in self._conns:
                    c.send(("leave",))
        except (OSError, ServerClosed, PushRejected, TimeoutError):
            pass
        for c in self._conns:
            c.close()
        self._pull_buf = self._push_buf = None  # type: ignore[assignment]
        if self._block is not None:
            self._block.close()
