"""Control messages as fixed binary records: what goes over the pipes, byte for byte.

A message is one ``send_bytes`` frame (big-endian int32 length, body): a kind byte and that
kind's little-endian fields, a few with a UTF-8 tail or, on the parent's control pipe, a pickle::

    worker -> shard    push(seq), pull, leave                  fixed, <= MAX_WORKER_MESSAGE bytes
    shard  -> worker   ack, pulled(version), error(text)       at most MAX_REPLY bytes
    parent -> shard    join(worker, incarnation), pull, stats, state, stop, thaw, pickled: load,
                       cut, backup(pid, timeout) and a new backup's link (its fd)
    shard  -> parent   ready(k), joined(clock), pulled, loaded, pickled: stats, state, stopped, cut
    worker -> parent   worker_ready, beat(time), done, diverged(text),   at most MAX_RESULT bytes
                       failed(traceback, summary)
    parent -> worker   go, rejoin(k) and a restarted shard's new pipe (its fd)
    primary <-> backup forward, catch up (data only: safetensors and JSON), held

Nothing a worker writes is unpickled: any frame but the fixed records is a :class:`WireError`.

Example:
    >>> decode_from_worker(push(7))
    ('push', 7)
    >>> decode_reply(ack(Ack(0, 7, False, "too old", 3, 5, kind="too_stale")))
    ('ack', Ack(worker=0, seq=7, ok=False, reason='too old', version=3, staleness=5, duplicate=False, kind='too_stale'))
    >>> decode_from_worker(b"\\x80\\x04K\\x01.")  # a pickle is not a message
    Traceback (most recent call last):
    stalewise.runtime.local.wire.WireError: a message of unknown kind 0x80 (5 bytes)
"""

from __future__ import annotations

import json
import math
import pickle
import select
import struct
from typing import Any

from stalewise.checkpoint.store import _contiguous, _nested, flat_state
from stalewise.protocol.messages import Ack
from stalewise.protocol.replica import CatchUp, Forward, Held

MAX_WORKER_MESSAGE = 64  # bytes: the longest body a shard accepts from a worker
MAX_REPLY = 1 << 16  # bytes: the longest body a worker accepts from a shard
MAX_TEXT = 8192  # bytes of UTF-8 kept of a reason or an error (longer ones are cut)

# kinds, one byte. worker -> shard
_PUSH, _PULL, _LEAVE = 0x01, 0x02, 0x03
# shard -> worker (PULLED also to the parent)
_ACK, _PULLED, _ERROR = 0x11, 0x12, 0x13
# parent -> shard (PULL too: the observer's)
_JOIN, _STATS, _STATE, _LOAD, _STOP, _CUT, _THAW, _BACKUP = range(0x21, 0x29)
# shard -> parent
_READY, _JOINED, _STATS_REPLY, _STATE_REPLY, _LOADED, _STOPPED, _CUT_REPLY = range(0x31, 0x38)
# worker -> parent (the result pipe), and parent -> worker
_W_READY, _BEAT, _DONE, _DIVERGED, _FAILED, _GO = 0x41, 0x42, 0x43, 0x44, 0x45, 0x46
# primary <-> backup; _THREE: kind, view, entries (first), the log's bytes before; then frames
_FORWARD, _CATCH_UP, _HELD = 0x51, 0x52, 0x53
GIB = 1 << 30

_KIND = struct.Struct("<B")
_INT = struct.Struct("<Bq")  # kind, one int64
_TWO = struct.Struct("<Bqq")  # kind, two int64s
_THREE = struct.Struct("<Bqqq")  # kind, three int64s
# kind, worker, seq, flags, version, staleness, len(refusal kind); then that text, the reason
_ACK_HEAD = struct.Struct("<BqqBqqH")
_OK, _DUPLICATE, _HAS_TAU, _HAS_REASON, _HAS_KIND = 1, 2, 4, 8, 16
_LOADED_HEAD = struct.Struct("<BqB")  # kind, version, has error; then the error's text
_FRAME = struct.Struct("!i")  # multiprocessing's length header
_BEAT_REC = struct.Struct("<Bqd")  # kind, worker, the worker's time.monotonic()
_FAILED_HEAD = struct.Struct("<BqI")  # kind, worker, bytes of the traceback; then it, the summary

MAX_TRACEBACK = 1 << 15  # bytes of UTF-8 kept of a worker's traceback (its end, the newest frames)
MAX_RESULT = _FAILED_HEAD.size + MAX_TRACEBACK + MAX_TEXT  # the longest body of a result pipe


class WireError(ValueError):
    """Bytes that are not a message this reader accepts (the text says why)."""


def frame(body: bytes) -> bytes:
    """``body`` with the length header :meth:`Connection.recv_bytes` reads."""
    return _FRAME.pack(len(body)) + body


class FrameReader:
    """Splits a byte stream into frame bodies as the bytes arrive; never blocks.

    A length header that is negative or above ``max_size`` stops the stream (:attr:`error`).

    Example:
        >>> r = FrameReader(16)
        >>> r.feed(frame(b"ab") + frame(b"c")[:3]), r.pending
        ([b'ab'], 3)
        >>> r.feed(frame(b"c")[3:] + b"\\x00\\x00\\x10\\x00"), r.error
        ([b'c'], 'an oversize message (4096 bytes, the most is 16)')
    """

    def __init__(self, max_size: int):
        self.max_size = max_size
        self.error: str | None = None
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        """The bodies of the frames ``data`` completes (the stream's error set on a bad header)."""
        if self.error is not None:
            return []
        self._buf += data
        out = []
        while len(self._buf) >= _FRAME.size:
            (n,) = _FRAME.unpack_from(self._buf)
            if not 0 <= n <= self.max_size:
                self.error = (
                    f"an oversize message ({n} bytes, the most is {self.max_size})"
                    if n > 0
                    else f"a bad length header ({n})"
                )
                self._buf.clear()
                break
            if len(self._buf) < _FRAME.size + n:
                break
            out.append(bytes(self._buf[_FRAME.size : _FRAME.size + n]))
            del self._buf[: _FRAME.size + n]
        return out


def push(seq: int) -> bytes:
    """A worker's push number ``seq`` is committed (its record is in shared memory)."""
    return _INT.pack(_PUSH, seq)


def pull() -> bytes:
    """A served pull (a worker's, gated; or the observer's, on the control pipe)."""
    return _KIND.pack(_PULL)


def leave() -> bytes:
    """The worker leaves the job."""
    return _KIND.pack(_LEAVE)


def decode_from_worker(body: bytes) -> tuple:
    """``("push", seq)``, ``("pull",)`` or ``("leave",)``; anything else is a WireError."""
    kind = _kind_of(body)
    if kind == _PUSH and len(body) == _INT.size:
        return ("push", _INT.unpack(body)[1])
    if kind in (_PULL, _LEAVE) and len(body) == _KIND.size:
        return ("pull",) if kind == _PULL else ("leave",)
    if kind in (_PUSH, _PULL, _LEAVE):
        raise _wrong_size(kind, body)
    raise WireError(f"a message of unknown kind 0x{kind:02x} ({len(body)} bytes)")


def ack(a: Ack) -> bytes:
    """A shard's answer to a push."""
    kind = _text(a.kind)
    flags = (
        (_OK if a.ok else 0)
        | (_DUPLICATE if a.duplicate else 0)
        | (_HAS_TAU if a.staleness is not None else 0)
        | (_HAS_REASON if a.reason is not None else 0)
        | (_HAS_KIND if a.kind is not None else 0)
    )
    tau = -1 if a.staleness is None else a.staleness
    head = _ACK_HEAD.pack(_ACK, a.worker, a.seq, flags, a.version, tau, len(kind))
    return head + kind + _text(a.reason)


def pulled(version: int) -> bytes:
    """A served pull is done: the puller's buffer holds the shard's slice at ``version``."""
    return _INT.pack(_PULLED, version)


def error(text: str) -> bytes:
    """The shard refuses to go on with this connection (it closes it next)."""
    return _KIND.pack(_ERROR) + _text(text)


def ready(k: int) -> bytes:
    return _INT.pack(_READY, k)


def joined(worker: int, incarnation: int, clock: int) -> bytes:
    """The incarnation has joined, at ``clock`` (the pushes it counts as done, for gates)."""
    return _THREE.pack(_JOINED, worker, incarnation, clock)


def stats_reply(stats: dict) -> bytes:
    return _KIND.pack(_STATS_REPLY) + _pickle(stats)


def state_reply(state: dict) -> bytes:
    return _KIND.pack(_STATE_REPLY) + _pickle(state)


def cut_reply(n: int, payload: Any, err: str | None = None) -> bytes:
    """A shard's answer to cut ``n`` (:func:`cut`): its progress, its state, or why it failed."""
    return _KIND.pack(_CUT_REPLY) + _pickle((n, payload, err))


def loaded(version: int | None, err: str | None) -> bytes:
    head = _LOADED_HEAD.pack(_LOADED, -1 if version is None else version, err is not None)
    return head + _text(err)


def stopped(stats: dict) -> bytes:
    return _KIND.pack(_STOPPED) + _pickle(stats)


def decode_reply(body: bytes, *, trusted: bool = False) -> tuple:
    """A shard's message as the tuple it stands for (``("ack", Ack)``, ``("pulled", version)``,
    ...); the pickled ones (``stats``, ``state``, ``stopped``, ``cut``) only with ``trusted``."""
    kind = _kind_of(body)
    size = {_ACK: _ACK_HEAD.size, _LOADED: _LOADED_HEAD.size, _ERROR: _KIND.size}.get(kind)
    if size is not None and len(body) < size:
        raise _wrong_size(kind, body)
    if kind == _ACK:
        _, worker, seq, flags, version, tau, n = _ACK_HEAD.unpack_from(body)
        text = body[_ACK_HEAD.size :]
        if len(text) < n:
            raise _wrong_size(kind, body)
        a = Ack(
            worker,
            seq,
            bool(flags & _OK),
            text[n:].decode("utf-8", "replace") if flags & _HAS_REASON else None,
            version,
            tau if flags & _HAS_TAU else None,
            duplicate=bool(flags & _DUPLICATE),
            kind=text[:n].decode("utf-8", "replace") if flags & _HAS_KIND else None,
        )
        return ("ack", a)
    if kind == _ERROR:
        return ("error", body[_KIND.size :].decode("utf-8", "replace"))
    if kind == _LOADED:
        _, version, has_error = _LOADED_HEAD.unpack_from(body)
        err = body[_LOADED_HEAD.size :].decode("utf-8", "replace") if has_error else None
        return ("loaded", None if version < 0 else version, err)
    ints = {_PULLED: ("pulled", _INT), _READY: ("ready", _INT), _JOINED: ("joined", _THREE)}
    if kind in ints:
        name, record = ints[kind]
        if len(body) != record.size:
            raise _wrong_size(kind, body)
        return (name, *record.unpack(body)[1:])
    pickled = {_STATS_REPLY: "stats", _STATE_REPLY: "state", _STOPPED: "stopped", _CUT_REPLY: "cut"}
    if kind in pickled and trusted:
        return (pickled[kind], pickle.loads(body[_KIND.size :]))
    raise WireError(f"a reply of unknown kind 0x{kind:02x} ({len(body)} bytes)")


def worker_ready(worker: int) -> bytes:
    """The worker has set up (its data, one warm-up step) and waits for :func:`go`."""
    return _INT.pack(_W_READY, worker)


def beat(worker: int, now: float) -> bytes:
    """A heartbeat, at the worker's ``time.monotonic()`` ``now``."""
    return _BEAT_REC.pack(_BEAT, worker, now)


def done(worker: int) -> bytes:
    """The worker's loop ended normally."""
    return _INT.pack(_DONE, worker)


def diverged(worker: int, text: str) -> bytes:
    """The worker's pushes kept being refused: it stops (``text`` says why)."""
    return _INT.pack(_DIVERGED, worker) + _text(text)


def failed(worker: int, trace: str, summary: str) -> bytes:
    """User code raised in the worker: its traceback (its end, if long) and ``Type: message``."""
    tb = trace.encode("utf-8", "replace")
    if len(tb) > MAX_TRACEBACK:
        tb = b"...\n" + tb[len(tb) - MAX_TRACEBACK + 4 :]
    return _FAILED_HEAD.pack(_FAILED, worker, len(tb)) + tb + _text(summary)


def go() -> bytes:
    """The parent releases a worker that said :func:`worker_ready`."""
    return _KIND.pack(_GO)


def rejoin(k: int) -> bytes:
    """Shard ``k`` was restarted: its new pipe's file descriptor follows."""
    return _INT.pack(_GO, k)


def decode_rejoin(body: bytes) -> int:
    """The shard a :func:`rejoin` names."""
    if len(body) != _INT.size or body[0] != _GO:
        raise WireError(f"not a rejoin: {body[:16]!r}")
    return _INT.unpack(body)[1]


def decode_result(body: bytes, worker: int) -> tuple:
    """A message from worker ``worker``'s result pipe: ``("ready", w)``, ``("beat", w,
    time)``, ``("done", w)``, ``("diverged", w, text)`` or ``("error", w, traceback,
    summary)``; anything else (another worker's, a non-finite time) is a WireError.

    Example:
        >>> decode_result(beat(2, 1.5), 2)
        ('beat', 2, 1.5)
        >>> decode_result(done(1), 2)
        Traceback (most recent call last):
        stalewise.runtime.local.wire.WireError: a message naming worker 1 on worker 2's pipe
    """
    kind = _kind_of(body)
    sizes = {
        _W_READY: _INT.size,
        _DONE: _INT.size,
        _BEAT: _BEAT_REC.size,
        _DIVERGED: _INT.size,
        _FAILED: _FAILED_HEAD.size,
    }
    if kind not in sizes:
        raise WireError(f"a message of unknown kind 0x{kind:02x} ({len(body)} bytes)")
    fixed = kind in (_W_READY, _DONE, _BEAT)
    if len(body) < sizes[kind] or (fixed and len(body) != sizes[kind]) or len(body) > MAX_RESULT:
        raise _wrong_size(kind, body)
    (w,) = struct.unpack_from("<q", body, 1)
    if w != worker:
        raise WireError(f"a message naming worker {w} on worker {worker}'s pipe")
    if kind == _W_READY:
        return ("ready", w)
    if kind == _DONE:
        return ("done", w)
    if kind == _BEAT:
        now = _BEAT_REC.unpack(body)[2]
        if not math.isfinite(now):
            raise WireError(f"a heartbeat at a time that is not finite ({now})")
        return ("beat", w, now)
    if kind == _DIVERGED:
        return ("diverged", w, body[_INT.size :].decode("utf-8", "replace"))
    n = _FAILED_HEAD.unpack_from(body)[2]
    rest = body[_FAILED_HEAD.size :]
    if n > len(rest):
        raise _wrong_size(kind, body)
    return ("error", w, rest[:n].decode("utf-8", "replace"), rest[n:].decode("utf-8", "replace"))


def join(worker: int, incarnation: int) -> bytes:
    """A new incarnation joins; its pipe's file descriptor follows on the control pipe."""
    return _TWO.pack(_JOIN, worker, incarnation)


def stats() -> bytes:
    return _KIND.pack(_STATS)


def state() -> bytes:
    return _KIND.pack(_STATE)


def load(state_dict: dict, log: tuple | None = None, keep: tuple = ()) -> bytes:
    """A checkpoint's state for the shard (pickled: the control pipe only); ``log``: a restart's
    ``(path, at, fsync)`` of the push log it goes on with, ``keep``: the workers keeping seats."""
    return _KIND.pack(_LOAD) + _pickle((state_dict, log, tuple(keep)))


def stop() -> bytes:
    return _KIND.pack(_STOP)


def cut(n: int, targets: dict | None, log: str = "", fsync: bool = False) -> bytes:
    """Consistent cut number ``n`` (:class:`~stalewise.protocol.delivery.Cut`): None freezes
    the shard (it replies its progress); then ``targets`` (it replies its state there and
    begins the push ``log`` at it). Replies: :func:`cut_reply`, echoing ``n``."""
    return _KIND.pack(_CUT) + _pickle((n, targets, log, fsync))


def backup(pid: int, timeout: float) -> bytes:
    """A new backup, process ``pid`` (its link's fd follows); ``timeout``: each wait for it."""
    return _KIND.pack(_BACKUP) + _pickle((pid, timeout))


def thaw() -> bytes:
    """The parent gave the cut up: the shard thaws (no reply)."""
    return _KIND.pack(_THAW)


def decode_control(body: bytes) -> tuple:
    """A message from the parent: ``("join", worker, incarnation)``, ``("pull",)``,
    ``("stats",)``, ``("state",)``, ``("load", state, log, keep)``, ``("cut", n, targets,
    log, fsync)``, ``("backup", pid, timeout)`` (unpickled), ``("thaw",)`` or ``("stop",)``."""
    kind = _kind_of(body)
    if kind == _JOIN and len(body) == _TWO.size:
        return ("join", *_TWO.unpack(body)[1:])
    pickled = {_LOAD: "load", _CUT: "cut", _BACKUP: "backup"}
    if kind in pickled:
        return (pickled[kind], *pickle.loads(body[_KIND.size :]))
    simple = {_PULL: "pull", _STATS: "stats", _STATE: "state", _STOP: "stop", _THAW: "thaw"}
    if kind in simple and len(body) == _KIND.size:
        return (simple[kind],)
    raise WireError(f"a control message of unknown kind or size: 0x{kind:02x}, {len(body)} bytes")


def link(msg: Forward | CatchUp | Held, path: str = "", at: int = 0) -> bytes:
    """A message between a primary and its backup: a :class:`Forward` whose first entry (a
    :class:`CatchUp` whose state) is at byte ``at`` of push log ``path``, or a :class:`Held`."""
    kind = {Forward: _FORWARD, CatchUp: _CATCH_UP, Held: _HELD}[type(msg)]
    state = encode_state(msg.state) if kind == _CATCH_UP else b""  # in frames under 2 GiB
    blobs = (
        msg.entries if kind == _FORWARD else [state[i : i + GIB] for i in range(0, len(state), GIB)]
    )
    head = _THREE.pack(kind, msg.view, msg[1], at)
    return b"".join([head, *map(frame, [path.encode(), *blobs])])


def decode_link(body: bytes) -> tuple:
    """``(message, path, at)`` of :func:`link`; a torn or unknown one is a WireError."""
    if len(body) < _THREE.size or body[0] not in (_FORWARD, _CATCH_UP, _HELD):
        raise WireError(f"not a message between a shard's copies ({len(body)} bytes)")
    kind, view, n, at = _THREE.unpack_from(body)
    frames = FrameReader(len(body))
    path, *blobs = frames.feed(body[_THREE.size :]) or [b""]
    if frames.pending or frames.error:
        raise _wrong_size(kind, body)
    msg = Forward(view, n, tuple(blobs)) if kind == _FORWARD else Held(view, n)
    if kind == _CATCH_UP:
        msg = CatchUp(view, n, decode_state(b"".join(blobs)))
    return msg, path.decode("utf-8", "replace"), at


def encode_state(state: dict) -> bytes:
    """A shard's ``state_dict()`` as data: safetensors of its arrays, its values as JSON."""
    from safetensors.numpy import save

    arrays, values = flat_state(state, "state")
    return save({k: _contiguous(a) for k, a in arrays.items()}, {"values": json.dumps(values)})


def decode_state(body: bytes) -> dict:
    """:func:`encode_state`'s state (a WireError if it does not decode)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        head = json.loads(body[8 : 8 + int.from_bytes(body[:8], "little")])["__metadata__"]
        return _nested({k: a.copy() for k, a in load(body).items()} | json.loads(head["values"]))
    except (ValueError, TypeError, KeyError, SafetensorError) as e:
        raise WireError(f"a state that does not decode: {e}") from None


def _kind_of(body: bytes) -> int:
    if not body:
        raise WireError("an empty message")
    return body[0]


def _wrong_size(kind: int, body: bytes) -> WireError:
    return WireError(f"a message of kind 0x{kind:02x} with the wrong size ({len(body)} bytes)")


def _text(text: str | None) -> bytes:
    return b"" if text is None else text.encode("utf-8", "replace")[:MAX_TEXT]


def _pickle(value: Any) -> bytes:
    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def readable(ends, timeout: float | None) -> list:
    """``connection.wait`` without its selector: the ``ends`` readable within ``timeout``."""
    poller, by_fd = select.poll(), {}
    for end in ends:
        by_fd[end.fileno()] = end
        poller.register(end.fileno(), select.POLLIN)
    ms = -1 if timeout is None else max(0, math.ceil(timeout * 1000))
    return [by_fd[fd] for fd, _ in poller.poll(ms)]
