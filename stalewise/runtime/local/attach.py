"""Attach a process you started to a job served on this machine, by the job's name.

``job.serve(workers=(1, 8), name="gpt")`` opens a door beside its shards: a
Unix socket ``stalewise-<uid>/gpt.sock`` in the runtime directory
(``$XDG_RUNTIME_DIR``, else the temporary directory), readable by this user
only, and a key file beside it. Any process of the same user then calls
``client = sw.attach("gpt")``: the server chooses the worker id (the lowest
one free) and the incarnation, makes that incarnation's pipes to every shard
(:meth:`LocalServer.client <stalewise.runtime.local.server.LocalServer.client>`)
and passes them over the socket (file-descriptor passing), with what a client
needs to map the job's shared memory. ``sw.attach("gpt", worker=3)`` asks for
worker id 3 (a new incarnation of it, if it ran before).

The socket stays open for as long as the attached client lives: the server
sees it close when the process exits or calls ``client.close()``, and its worker
id is free again for the next process that attaches. Its pipes to the shards
close at the same moment, so the shards drop it from the gates and BSP rounds
(a push it had committed is delivered first, as for every worker that leaves).

The socket is authenticated with the key (``multiprocessing.connection``'s
handshake); the server reads only a small JSON request from an attaching
process and unpickles nothing it sends.

Each attaching process is handled on a thread of its own, and its handshake
(authentication, request, taking the pipes) has :data:`HANDSHAKE_TIMEOUT`
seconds: the socket is shut down when they pass. The server's lock is held
only to choose the id and make the client, never while waiting for the
attaching process, so one that connects and stays silent delays no server call
and no other attach.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import tempfile
import threading
from multiprocessing import connection, reduction
from pathlib import Path
from typing import TYPE_CHECKING

from stalewise.runtime.attach import AttachError, check_name

if TYPE_CHECKING:
    from stalewise.runtime.local.client import Client
    from stalewise.runtime.local.server import LocalServer

log = logging.getLogger(__name__)

#: Seconds an attaching process has for its whole handshake with the door.
HANDSHAKE_TIMEOUT = 30.0


def door_dir() -> Path:
    """The folder of this user's doors (made, mode 0700, if missing)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = Path(base) / f"stalewise-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def door_path(name: str) -> Path:
    """The socket of the door of the job served locally as ``name``."""
    return _paths(name)[0]


def _paths(name: str) -> tuple[Path, Path]:
    d = door_dir()
    return d / f"{name}.sock", d / f"{name}.key"


def _in_use(sock: Path) -> bool:
    """Whether a server still listens on ``sock`` (a socket file may outlive a killed one)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(sock))
        except OSError:
            return False
    return True


class Door:
    """The server side: a thread that accepts attaching processes for ``server``."""

    def __init__(self, server: LocalServer, name: str):
        self.server, self.name = server, check_name(name)
        self.sock, self.keyfile = _paths(name)
        if self.sock.exists():
            if _in_use(self.sock):
                raise ValueError(f"a job named {name!r} is already served ({self.sock})")
            self.sock.unlink()  # left by a server that was killed
        key = secrets.token_bytes(32)
        fd = os.open(self.keyfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        self.key = key
        # no authkey here: each connection is authenticated on its own thread (_handshake),
        # under a deadline, so a silent one holds up neither the door nor the server
        self.listener = connection.Listener(str(self.sock), family="AF_UNIX")
        self.leases: dict[int, connection.Connection] = {}  # worker id -> its open socket
        self.pending: set[int] = set()  # worker ids whose pipes are being handed over
        # the server's own lock: the door's threads take it to make a client, and the
        # server's caller takes it to read the leases (two locks taken in both orders
        # could deadlock); it is never held while waiting for an attaching process
        self.lock = server._lock
        self.closed = threading.Event()
        self.thread = threading.Thread(
            target=self._serve, name=f"stalewise-door-{name}", daemon=True
        )
        self.thread.start()

    def attached(self) -> set[int]:
        """The worker ids held by attached processes that are still connected."""
        with self.lock:
            self._reap()
            return set(self.leases)

    def taken(self) -> set[int]:
        """The worker ids held by attached processes or being handed to one."""
        with self.lock:
            self._reap()
            return set(self.leases) | self.pending

    def _reap(self) -> None:
        gone = [w for w, c in self.leases.items() if _closed(c)]
        for w in gone:
            self.leases.pop(w).close()
            log.info("job %r: worker %d detached", self.name, w)

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                conn = self.listener.accept()
            except OSError as e:
                if self.closed.is_set():
                    return
                log.warning("job %r: an attach failed to connect (%s)", self.name, e)
                continue
            threading.Thread(
                target=self._handshake,
                args=(conn,),
                name=f"stalewise-door-{self.name}-attach",
                daemon=True,
            ).start()

    def _handshake(self, conn: connection.Connection) -> None:
        """One attaching process, on a thread of its own, within HANDSHAKE_TIMEOUT."""
        deadline = _Deadline(conn, HANDSHAKE_TIMEOUT)
        leased = False
        try:
            try:
                connection.deliver_challenge(conn, self.key)
                connection.answer_challenge(conn, self.key)
            except (OSError, EOFError, connection.AuthenticationError) as e:
                why = f"no answer within {HANDSHAKE_TIMEOUT} s" if deadline.expired else e
                log.warning("job %r: an attach failed its handshake (%s)", self.name, why)
                return
            try:
                leased = self._admit(conn, deadline)
            except Exception as e:  # the attacher hears why; the door stays open
                if deadline.expired:
                    e = AttachError(f"the handshake took over {HANDSHAKE_TIMEOUT} s ({e})")
                log.warning("job %r: an attach was refused: %s", self.name, e)
                with contextlib.suppress(OSError):
                    conn.send(("error", str(e)))
        finally:
            deadline.cancel()
            if not leased:
                conn.close()

    def _admit(self, conn: connection.Connection, deadline: _Deadline) -> bool:
        """Hands a worker's pipes to an authenticated process; True once it holds them."""
        request = json.loads(conn.recv_bytes(256))
        want, pid = request.get("worker"), request.get("pid")
        if not isinstance(pid, int):
            raise AttachError(f"a request without its process id: {request!r}")
        with self.lock:  # only to choose the id and make its pipes: no waiting on the attacher
            if self.closed.is_set():
                raise AttachError("the job is closing")
            self._reap()
            client = self.server.attach_client(want, taken=set(self.leases) | self.pending)
            w, inc = client.worker, client.incarnation
            ends = self.server.take_ends(w)  # this thread's to send, then close
            self.pending.add(w)
        ok = False
        try:
            state = client.__getstate__()
            del state["_conns"]  # they travel as file descriptors, below
            state["_workers"] = self.server.workers
            conn.send(("client", state))
            for end in ends:
                reduction.send_handle(conn, end.fileno(), pid)
            if conn.recv_bytes(16) != b"ok":
                raise AttachError(f"process {pid} did not take worker {w}'s pipes")
            ok = True
        finally:
            for end in ends:  # its pipes are the attached process's alone now
                end.close()
            deadline.cancel()
            with self.lock:
                self.pending.discard(w)
                if ok and deadline.expired:
                    ok = False  # its socket was shut down: it cannot serve as the lease
                if ok and (self.closed.is_set() or self.server.incarnation(w) != inc):
                    ok = False  # the job closed, or a new incarnation of w took over meanwhile
                if ok:
                    self.leases[w] = conn
        if ok:
            with contextlib.suppress(OSError):  # attach() returns once the lease is counted
                conn.send_bytes(b"leased")
            log.info("job %r: process %d attached as worker %d", self.name, pid, w)
        return ok

    def close(self) -> None:
        self.closed.set()
        with contextlib.suppress(OSError):
            self.listener.close()
        with contextlib.suppress(OSError):
            self.keyfile.unlink()
        with self.lock:
            for c in self.leases.values():
                c.close()
            self.leases.clear()


class _Deadline:
    """Shuts ``conn``'s socket down after ``seconds`` unless cancelled first: a blocked
    read or write on it then fails at once (EOFError, OSError)."""

    def __init__(self, conn: connection.Connection, seconds: float | None):
        # a duplicate descriptor of our own: shutting it down acts on the socket itself,
        # and it cannot be reused by another file once conn is closed
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        self._lock = threading.Lock()
        self._done = False
        self.expired = False
        self._timer = None if seconds is None else threading.Timer(seconds, self._expire)
        if self._timer is not None:  # None: no deadline
            self._timer.daemon = True
            self._timer.start()

    def _expire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.expired = True
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    def cancel(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        if self._timer is not None:
            self._timer.cancel()
        self._sock.close()


def _closed(conn: connection.Connection) -> bool:
    """Whether the other end of an attached process's socket has closed."""
    try:
        if not conn.poll(0):
            return False
        conn.recv_bytes(16)  # an attached client sends nothing more: data means nothing
        return False
    except (EOFError, OSError):
        return True


def attach(name: str, *, worker: int | None = None, timeout: float | None = 30.0) -> Client:
    """A client for a worker of the job served under ``name`` on this machine.

    Args:
        name: the ``name=`` the job was served with (:meth:`stalewise.Job.serve`).
        worker: the worker id to take (a new incarnation of it); None: the lowest free one.
        timeout: seconds the whole handshake with the server may take (None: no limit).

    Returns:
        A :class:`~stalewise.runtime.local.client.Client` of this process, as
        ``server.client(w)`` gives; its ``worker`` and ``incarnation`` say who it is.
        Closing it (or the end of this process) gives its worker id back.

    Raises:
        AttachError: no job of that name is served, or the server refused (why).
    """
    from stalewise.runtime.local.client import Client
    from stalewise.runtime.local.procs import cap_threads_here

    sock, keyfile = _paths(check_name(name))
    if not sock.exists():
        raise AttachError(f"no job named {name!r} is served on this machine ({sock} is missing)")
    try:
        key = keyfile.read_bytes()
        conn = connection.Client(str(sock), family="AF_UNIX")
    except OSError as e:
        raise AttachError(f"job {name!r}: cannot connect to {sock} ({e})") from None
    deadline = _Deadline(conn, timeout)  # the whole handshake, however the server stalls
    conns: list[connection.Connection] = []
    try:
        connection.answer_challenge(conn, key)
        connection.deliver_challenge(conn, key)
        conn.send_bytes(json.dumps({"worker": worker, "pid": os.getpid()}).encode())
        kind, body = conn.recv()
        if kind == "error":
            raise AttachError(f"job {name!r}: {body}")
        for _ in body["_ranges"]:
            conns.append(connection.Connection(reduction.recv_handle(conn)))
        conn.send_bytes(b"ok")
        if conn.recv_bytes(16) != b"leased":
            raise EOFError("no lease")
        deadline.cancel()
        if deadline.expired:
            raise EOFError("the socket was shut down")
    except BaseException as e:
        deadline.cancel()
        for c in [*conns, conn]:
            c.close()
        if not isinstance(e, OSError | EOFError | connection.AuthenticationError):
            raise
        if deadline.expired:
            raise AttachError(f"job {name!r}: no answer within {timeout} s") from None
        raise AttachError(f"job {name!r}: the server went away while attaching ({e})") from None
    cap_threads_here(body.pop("_workers"))
    client = Client.__new__(Client)
    client.__dict__.update(body)
    client._conns = conns
    client._lease = conn  # closed with the client, or by the OS with this process
    return client
