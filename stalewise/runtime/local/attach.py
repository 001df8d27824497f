"""Attach a process you started to a job served on this machine, by the job's name.

``job.serve(name="gpt")`` opens a door: a Unix socket ``stalewise-<uid>/gpt.sock`` with a key
file, in this user's 0700 folder (:func:`door_dir`). Threat model: ``docs/reliability.md``."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import socket
import stat
import tempfile
import threading
from collections import OrderedDict
from multiprocessing import connection, reduction
from pathlib import Path
from typing import TYPE_CHECKING

from stalewise.checkpoint.store import untrusted
from stalewise.runtime.attach import AttachError, check_name
from stalewise.runtime.local import door_state

if TYPE_CHECKING:
    from stalewise.runtime.local.client import Client
    from stalewise.runtime.local.server import LocalServer

log = logging.getLogger(__name__)

#: Seconds an attaching process has for its whole handshake with the door.
HANDSHAKE_TIMEOUT = 30.0
#: Handshakes the door runs at once (each on a thread, with the connection's descriptor).
MAX_HANDSHAKES = 16
#: The longest wait, in seconds, before the door tries to accept again after a failure.
ACCEPT_BACKOFF = 1.0
KEY_BYTES = 32  # the length of a door's key


def door_dir() -> Path:
    """The folder of this user's doors, made (mode 0700) if missing; else AttachError."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = Path(base) / f"stalewise-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    if problem := untrusted(st) or (mode != 0o700 and f"of mode {mode:04o}, not 0700"):
        mine = stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()
        fix = "remove it (as its owner or root), or set XDG_RUNTIME_DIR to a folder of yours"
        fix = f"run chmod 700 {path}" if mine else fix
        raise AttachError(f"the attach folder {path} is {problem}: {fix}")
    return path


def door_path(name: str) -> Path:
    """The socket of the door of the job served locally as ``name``."""
    return _paths(name)[0]


def serves(name: str) -> str | None:
    """None if a job called ``name`` may be served on this machine, else where it looked."""
    path = door_path(name)
    return None if os.path.lexists(path) else f"on this machine ({path} is missing)"


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


def _own(path: Path, kind: int) -> os.stat_result | None:
    """``path``'s lstat if it exists: a file of ``kind`` (``stat.S_IFREG``, ...) of this
    user's, else AttachError (stalewise never makes a symlink or another's file there)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if problem := untrusted(st, kind):
        raise AttachError(f"{path} is {problem}, which stalewise never makes: remove it")
    return st


def _read_key(keyfile: Path) -> bytes:
    """The door's key, read without following a symlink from a regular file of ours."""
    fd = os.open(keyfile, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise AttachError(f"{keyfile} is not a key file of yours (mode 0600): remove it")
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise AttachError(f"{keyfile} holds {len(key)} bytes, not a key: remove it")
    return key


class Door:
    """The server side: a thread that accepts attaching processes for ``server``."""

    @staticmethod
    def check(name: str) -> tuple[Path, Path]:
        """The door's socket and key paths, once the name, the folder and any file are checked."""
        sock, keyfile = _paths(check_name(name))
        if _own(sock, stat.S_IFSOCK) and _in_use(sock):
            raise ValueError(f"a job named {name!r} is already served ({sock})")
        _own(keyfile, stat.S_IFREG)
        return sock, keyfile

    def __init__(self, server: LocalServer, name: str):
        self.server, self.name = server, name
        self.sock, self.keyfile = self.check(name)
        if _own(self.sock, stat.S_IFSOCK):
            self.sock.unlink()  # left by a server that was killed
        if _own(self.keyfile, stat.S_IFREG):
            self.keyfile.unlink()  # the same
        key = secrets.token_bytes(KEY_BYTES)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.keyfile, flags, 0o600)
        except FileExistsError:  # made since: another server of this name is starting
            raise ValueError(f"a job named {name!r} is already served ({self.keyfile})") from None
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        self.key = key
        # no authkey: each connection authenticates on its own thread, under a deadline
        try:
            self.listener = connection.Listener(str(self.sock), family="AF_UNIX")
            os.chmod(self.sock, 0o600)  # in our 0700 folder: nothing but ours can be there
        except BaseException:
            self.keyfile.unlink(missing_ok=True)
            raise
        self.slots = threading.BoundedSemaphore(MAX_HANDSHAKES)  # handshakes running
        # handshakes not yet authenticated, oldest first (the ones a new connection cuts)
        self.waiting: OrderedDict[int, _Deadline] = OrderedDict()
        self.waiting_lock = threading.Lock()  # never held while waiting on a socket
        self.accept_failed = _Counted("accepting an attach failed")
        self.cut = _Counted(f"cut a silent attach (over {MAX_HANDSHAKES} at once)")
        self.leases: dict[int, connection.Connection] = {}  # worker id -> its open socket
        self.pending: set[int] = set()  # worker ids whose pipes are being handed over
        # the server's own (two locks would be taken in both orders); never held while waiting
        self.lock = server._lock
        self.closed = threading.Event()
        self.thread = threading.Thread(
            target=self._serve, name=f"stalewise-door-{name}", daemon=True
        )
        self.thread.start()

    def attached(self, pending: bool = False) -> set[int]:
        """The worker ids held by attached processes still connected (and being handed to one)."""
        with self.lock:
            self.reap()
            return set(self.leases) | (self.pending if pending else set())

    def reap(self) -> dict[int, connection.Connection]:
        """Drops the leases of processes gone; returns the others' (``self.leases``)."""
        for w in [w for w, c in self.leases.items() if closed(c)]:
            self.leases.pop(w).close()
            log.info("job %r: worker %d detached", self.name, w)
        return self.leases

    def _serve(self) -> None:
        wait = 0.0  # before the next accept, after failures (out of file descriptors)
        while not self.closed.is_set():
            try:
                conn = self.listener.accept()
            except OSError as e:
                if self.closed.is_set():
                    return
                self.accept_failed.add(self.name, e)
                wait = min(ACCEPT_BACKOFF, max(0.01, 2 * wait))
                self.closed.wait(wait)
                continue
            wait = 0.0
            self.accept_failed.done(self.name)
            if not self.slots.acquire(blocking=False):
                self._cut_oldest()  # its thread ends at once, and gives its slot back
                if not self.slots.acquire(timeout=1.0):  # all are handing pipes over
                    conn.close()
                    continue
            else:
                self.cut.done(self.name)
            try:
                threading.Thread(
                    target=self._handshake,
                    args=(conn,),
                    name=f"stalewise-door-{self.name}-attach",
                    daemon=True,
                ).start()
            except RuntimeError as e:  # no thread to be had
                self.slots.release()
                conn.close()
                self.accept_failed.add(self.name, e)

    def _cut_oldest(self) -> None:
        """Shuts down the oldest handshake not yet authenticated (a silent connection)."""
        with self.waiting_lock:
            if not self.waiting:
                return
            _, deadline = self.waiting.popitem(last=False)
        deadline.expire()
        self.cut.add(self.name, "the oldest connection that had not authenticated")

    def _handshake(self, conn: connection.Connection) -> None:
        """One attaching process, on a thread of its own, within HANDSHAKE_TIMEOUT."""
        deadline = _Deadline(conn, HANDSHAKE_TIMEOUT)
        key = id(deadline)
        with self.waiting_lock:
            self.waiting[key] = deadline
        leased = False
        try:
            try:
                connection.deliver_challenge(conn, self.key)
                connection.answer_challenge(conn, self.key)
            except (OSError, EOFError, connection.AuthenticationError) as e:
                with self.waiting_lock:
                    cut = self.waiting.pop(key, None) is None
                why = f"no answer within {HANDSHAKE_TIMEOUT} s" if deadline.expired else e
                if not cut:  # those cut for a newer connection are counted as such
                    log.warning("job %r: an attach failed its handshake (%s)", self.name, why)
                return
            with self.waiting_lock:
                if self.waiting.pop(key, None) is None:
                    return  # cut off just now, for a newer connection
            try:
                leased = self._admit(conn, deadline)
            except Exception as e:  # the attacher hears why; the door stays open
                if deadline.expired:
                    e = AttachError(f"the handshake took over {HANDSHAKE_TIMEOUT} s ({e})")
                log.warning("job %r: an attach was refused: %s", self.name, e)
                with contextlib.suppress(OSError):
                    conn.send_bytes(json.dumps({"error": str(e)}).encode())
        finally:
            deadline.cancel()
            if not leased:
                conn.close()
            self.slots.release()

    def _admit(self, conn: connection.Connection, deadline: _Deadline) -> bool:
        """Hands a worker's pipes to an authenticated process; True once it holds them."""
        request = json.loads(conn.recv_bytes(256))
        want, pid = request.get("worker"), request.get("pid")
        if type(pid) is not int or pid < 1:
            raise AttachError(f"a request without its process id: {request!r}")
        with self.lock:  # only to choose the id and make its pipes: no waiting on the attacher
            if self.closed.is_set():
                raise AttachError("the job is closing")
            self.reap()
            client, ends = self.server.attach_client(want, taken=set(self.leases) | self.pending)
            w, inc = client.worker, client.incarnation  # ends: this thread's to send, then close
            self.pending.add(w)
        ok = False
        try:
            try:  # the pipes travel as file descriptors, below
                state = door_state.encode(self.server.config, client, self.server.workers)
            except door_state.NotData as e:
                raise AttachError(
                    f"the job's parameters hold {e}, which cannot be sent as "
                    "data to an attaching process"
                ) from None
            conn.send_bytes(state)
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
    """Shuts ``conn``'s socket down after ``seconds`` unless cancelled (before closing ``conn``)."""

    def __init__(self, conn: connection.Connection, seconds: float | None):
        self._fd = conn.fileno()
        self._lock = threading.Lock()
        self._done = False
        self.expired = False
        self._timer = None if seconds is None else threading.Timer(seconds, self.expire)
        if self._timer is not None:  # None: no deadline
            self._timer.daemon = True
            self._timer.start()

    def expire(self) -> None:
        with self._lock:
            if self._done:
                return
            self.expired = True
            try:
                s = socket.socket(fileno=self._fd)  # conn's descriptor, not a new one
            except OSError:
                return
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.detach()

    def cancel(self) -> None:
        with self._lock:
            self._done = True
        if self._timer is not None:
            self._timer.cancel()


class _Counted:
    """A failure that may repeat fast: logged the first time, then counted (:meth:`done`)."""

    def __init__(self, what: str):
        self.what, self.count, self.lock = what, 0, threading.Lock()

    def add(self, name: str, why: object) -> None:
        with self.lock:
            self.count += 1
            first = self.count == 1
        if first:
            log.warning("job %r: %s (%s); counting until it stops", name, self.what, why)

    def done(self, name: str) -> None:
        with self.lock:
            count, self.count = self.count, 0
        if count > 1:
            log.warning("job %r: %s %d times in a row", name, self.what, count)


def closed(conn: connection.Connection) -> bool:
    """Whether the other end of a worker's socket (attached, or its rejoin pipe) has closed."""
    try:
        if not conn.poll(0):
            return False
        conn.recv_bytes(16)  # a client sends nothing more on it: data means nothing
        return False
    except (EOFError, OSError):
        return True


def attach(name: str, *, worker: int | None = None, timeout: float | None = 30.0) -> Client:
    """A client for a worker of the job served under ``name`` here, as :func:`stalewise.attach`."""
    from stalewise.runtime.local.client import REJOIN_TIMEOUT, Rejoin
    from stalewise.runtime.local.procs import cap_threads_here

    sock, keyfile = _paths(check_name(name))
    if not _own(sock, stat.S_IFSOCK):
        raise AttachError(f"no job named {name!r} is served on this machine ({sock} is missing)")
    try:
        key = _read_key(keyfile)
        conn = connection.Client(str(sock), family="AF_UNIX")
    except OSError as e:
        why = "a symlink" if e.errno == errno.ELOOP else e
        raise AttachError(f"job {name!r}: cannot use {keyfile} or {sock} ({why})") from None
    deadline = _Deadline(conn, timeout)  # the whole handshake, however the server stalls
    conns: list[connection.Connection] = []
    try:
        connection.answer_challenge(conn, key)
        connection.deliver_challenge(conn, key)
        conn.send_bytes(json.dumps({"worker": worker, "pid": os.getpid()}).encode())
        # JSON, read up to a bound: nothing the door sends is unpickled
        refused, plan = door_state.decode(conn.recv_bytes(door_state.MAX_STATE))
        if plan is None:
            raise AttachError(f"job {name!r}: {refused[:2000]}")
        for _ in range(plan.config.shards):
            conns.append(connection.Connection(reduction.recv_handle(conn)))
        client = plan.make(conns)
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
        if isinstance(e, door_state.NotImported):
            raise AttachError(f"job {name!r}: {e}") from None
        if isinstance(e, door_state.NotData):
            raise AttachError(f"job {name!r}: its door sent what no door sends ({e})") from None
        if not isinstance(e, OSError | EOFError | connection.AuthenticationError):
            raise
        if deadline.expired:
            raise AttachError(f"job {name!r}: no answer within {timeout} s") from None
        raise AttachError(f"job {name!r}: the server went away while attaching ({e})") from None
    cap_threads_here(plan.workers)
    client._lease = conn  # closed with the client, or by the OS with this process
    if plan.config.replicas == 2:  # a dead primary comes back from its backup (LocalServer.heal)
        client.rejoin = Rejoin(conn, REJOIN_TIMEOUT, client)
    return client
