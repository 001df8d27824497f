"""A shard's journal: every call that changed its state, in order, as bytes (no pickle);
:func:`replay` on the state it began at gives the same shard, bit for bit (see the design notes)."""

from __future__ import annotations

import functools
import inspect
import io
import itertools
import json
import logging
import math
import os
import struct
import zlib
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from stalewise.protocol.commit import Verdict
from stalewise.protocol.messages import PushHeader
from stalewise.targets import _is_int as _int

log = logging.getLogger(__name__)

MAGIC = b"SWJ2"  # SWJ1: before an expected worker's first join kept its seat
_PREFIX = struct.Struct("<4sII")
MAX_HEADER = 4096  # bytes of an entry's JSON header


class LogError(ValueError):
    """A journal that does not decode, or does not fit the shard replaying it (one line)."""


class Entry(NamedTuple):
    """One journaled call: its method, its arguments (JSON values) and its payload."""

    op: str
    fields: dict[str, Any]
    payload: Any = None  # an array, bytes or None


def _ints(n: int) -> Callable[[Any], bool]:
    return lambda x: x is None or (isinstance(x, list) and len(x) == n and all(map(_int, x)))


_opt_int = lambda x: x is None or _int(x)  # noqa: E731
_time = lambda x: x is None or (isinstance(x, int | float) and not isinstance(x, bool))  # noqa: E731
_COMMITTED = {"committed": lambda x: isinstance(x, bool), "header": _ints(4), "verdict": _ints(2)}
# each journaled method's fields and their checks (a payload's fields come on top)
FIELDS: dict[str, dict[str, Callable[[Any], bool]]] = {
    "push": {"header": _ints(4), "verdict": _ints(2), "now": _time},
    "pull": {"worker": _opt_int, "out": lambda x: isinstance(x, bool), "now": _time},
    "served": {"nbytes": lambda x: _int(x) and x >= 0},
    "leave": {"worker": _int},
    "join": {"worker": _int, "incarnation": _int},
    "admit": {"worker": _int, "incarnation": _int},
    "retire": {"worker": _int, "incarnation": _opt_int},
    "depart": {"worker": _int, "incarnation": _int, **_COMMITTED},
    "deliver": {"worker": _int, "incarnation": _int, **_COMMITTED},
    "resume": {},
    "expire_unstarted": {},
}


def journaled(method: Callable) -> Callable:
    """Makes a :class:`Shard` method hand its calls to ``shard.journal`` (when not None)."""
    op, signature = method.__name__, inspect.signature(method)
    assert op in FIELDS, op

    @functools.wraps(method)
    def call(shard: Any, *args: Any, **kwargs: Any) -> Any:
        journal = shard.journal
        if journal is None:
            return method(shard, *args, **kwargs)
        bound = signature.bind(shard, *args, **kwargs)
        bound.apply_defaults()
        entry = encode(op, bound.arguments)  # before: DC-ASGD changes a payload in place
        shard.journal = None  # the calls it makes are part of this one
        try:
            result = method(shard, *args, **kwargs)
        finally:
            shard.journal = journal
        journal(entry)
        return result

    return call


def encode(op: str, arguments: dict[str, Any]) -> list[bytes]:
    """The buffers of one entry for a call of ``op`` with ``arguments`` (by parameter name)."""
    a = {k: int(v) if isinstance(v, np.integer) else v for k, v in arguments.items()}
    a.pop("self")
    a.pop("sumsq", None)  # a push's sender-measured norm: a replay measures it again
    payload, committed = a.pop("payload", None), a.pop("committed", 0)
    if committed != 0:  # depart, deliver
        a["committed"] = committed is not None
        if committed is not None:
            a["header"], payload, a["verdict"] = committed
    if "out" in a:
        a["out"] = a["out"] is not None
    if "header" in a:  # a push header as JSON (None: malformed, which replays as malformed)
        h = a["header"]
        ok = isinstance(h, tuple) and len(h) == 4
        ok = ok and all(isinstance(x, int | np.integer) and not isinstance(x, bool) for x in h)
        a["header"] = [int(x) for x in h] if ok else None
    if a.get("verdict") is not None:
        a["verdict"] = [int(a["verdict"][0]), int(a["verdict"][1])]
    if a.get("now") is not None:
        a["now"] = float(a["now"])
    data = b""
    if isinstance(payload, bytes | bytearray | memoryview):
        a["dtype"], data = "bytes", bytes(payload)
    elif isinstance(payload, np.ndarray) and payload.dtype.kind in "biuf":
        a.update(dtype=payload.dtype.str, shape=list(payload.shape))
        data = payload.tobytes()
    if "dtype" in a:  # else none, or one of no such type: replayed as None
        a.update(n=len(data), sum=_sum(data))
    header = json.dumps({"op": op, **a}, separators=(",", ":"), default=repr).encode()
    return [_PREFIX.pack(MAGIC, len(header), zlib.crc32(header)), header, data]


def _sum(data: Any) -> int:
    """The payload's 64-bit words summed mod 2**64 (a CRC of a 4 MB payload costs 1 ms)."""
    mv = memoryview(data).cast("B")
    whole = len(mv) // 8 * 8
    total = int(np.frombuffer(mv[:whole], np.uint64).sum(dtype=np.uint64)) if whole else 0
    return (total + int.from_bytes(mv[whole:], "little")) % 2**64


def read(
    stream: BinaryIO,
    *,
    max_payload: int,
    where: str = "journal",
    last: bool = True,
    payloads: bool = True,
) -> Iterator[Entry]:
    """The entries of a journal, each checked as read (a payload at most ``max_payload`` bytes).
    A torn last entry is logged and dropped, or with ``last`` False refused. Without
    ``payloads``, each is skipped (None). LogError names ``where``, entry, offset and field."""
    offset = 0
    for i in itertools.count():
        at = f"{where}: entry {i} at byte {offset}"
        prefix = stream.read(_PREFIX.size)
        if not prefix:
            return
        if len(prefix) < _PREFIX.size:
            return _torn(at, last, payloads)
        magic, size, crc = _PREFIX.unpack(prefix)
        if magic != MAGIC:
            old = " of an earlier stalewise, whose joins replay otherwise" * (magic == b"SWJ1")
            raise LogError(f"{at}: not a journal entry{old} (magic {magic!r})")
        if size > MAX_HEADER:
            raise LogError(f"{at}: header of {size} bytes, more than {MAX_HEADER}")
        raw = stream.read(size)
        if len(raw) < size:
            return _torn(at, last, payloads)
        if zlib.crc32(raw) != crc:
            raise LogError(f"{at}: header checksum mismatch (garbled)")
        fields = _fields(raw, at)
        payload, n = None, fields.pop("n", None)
        if n is not None:
            if n > max_payload:
                raise LogError(f"{at}: 'n': a payload of {n} bytes, more than {max_payload}")
            if not payloads:
                if stream.seek(0, os.SEEK_END) < (end := offset + _PREFIX.size + size + n):
                    return _torn(at, last, payloads)
                stream.seek(end)
            else:
                buf = bytearray(n)
                if stream.readinto(buf) < n:
                    return _torn(at, last, payloads)
                if _sum(buf) != fields.pop("sum"):
                    raise LogError(f"{at}: 'sum': the payload's checksum does not match (garbled)")
                payload = _array(buf, fields.pop("dtype"), fields.pop("shape", None), at)
        offset += _PREFIX.size + size + (n or 0)
        yield Entry(fields.pop("op"), fields, payload)


def decode(data: bytes, *, max_payload: int = 2**40, where: str = "journal") -> list[Entry]:
    """The entries of a journal held in memory (:func:`read`)."""
    return list(read(io.BytesIO(data), max_payload=max_payload, where=where))


def _torn(at: str, last: bool, loud: bool = True) -> None:
    if not last:
        raise LogError(f"{at}: torn, though a later log follows it")
    if loud:  # the read with payloads says it (a read without them comes first)
        log.warning("%s: torn (a crash while it was written); dropped", at)


def _fields(raw: bytes, at: str) -> dict[str, Any]:
    """An entry's header, every field checked."""
    try:
        fields = json.loads(raw)
    except (ValueError, RecursionError):
        raise LogError(f"{at}: the header is not JSON") from None
    if not isinstance(fields, dict) or fields.get("op") not in FIELDS:
        raise LogError(f"{at}: 'op': expected one of {', '.join(FIELDS)}")
    checks = dict(FIELDS[fields["op"]])
    if "n" in fields:
        checks.update(n=lambda x: _int(x) and x >= 0, sum=_int, dtype=_dtype)
        if fields.get("dtype") != "bytes":
            checks["shape"] = lambda x: isinstance(x, list) and len(x) <= 8 and all(map(_int, x))
    for key, ok in checks.items():
        if key not in fields and not (key in ("header", "verdict") and not fields.get("committed")):
            raise LogError(f"{at}: {key!r}: missing")
        if key in fields and not ok(fields[key]):
            raise LogError(f"{at}: {key!r}: {str(fields[key])[:60]} is not valid here")
    unknown = set(fields) - set(checks) - {"op"}
    if unknown:
        raise LogError(f"{at}: {sorted(unknown)[0]!r}: unknown field")
    return fields


def _dtype(x: Any) -> bool:
    """Whether ``x`` names a payload's dtype: ``bytes`` or a number's (``<f4``, ``|u1``)."""
    try:
        return x == "bytes" or (isinstance(x, str) and np.dtype(x).kind in "biuf" and len(x) < 8)
    except (TypeError, ValueError):
        return False


def _array(buf: bytearray, dtype: str, shape: list[int] | None, at: str) -> np.ndarray:
    """A payload's values, writable (DC-ASGD compensates a push in place)."""
    if dtype == "bytes":
        return bytes(buf)
    a = np.frombuffer(buf, np.dtype(dtype)) if len(buf) % np.dtype(dtype).itemsize == 0 else None
    if a is None or any(s < 0 for s in shape) or math.prod(shape) != a.size:
        raise LogError(f"{at}: 'shape': {shape} does not hold {len(buf)} bytes of {dtype}")
    return a.reshape(shape)


def replay(shard: Any, entries: Any, where: str = "journal") -> list[Any]:
    """Makes each entry's call on ``shard`` (loaded with the state its journal began at);
    returns the calls' results in order. LogError: an entry the shard refuses."""
    scratch = None
    results = []
    for i, (op, f, payload) in enumerate(entries):
        try:
            h, v = f.get("header"), f.get("verdict")
            h, v = h and PushHeader(*h), v and Verdict(*v)  # None stays None
            if op == "push":
                args, kwargs = (h, payload), {"verdict": v, "now": f["now"]}
            elif op == "pull":
                if f["out"] and scratch is None:
                    scratch = np.empty_like(shard.params)
                args, kwargs = (f["worker"], scratch if f["out"] else None), {"now": f["now"]}
            elif op in ("depart", "deliver"):
                committed = (h, payload, v) if f["committed"] else None
                args, kwargs = (f["worker"], f["incarnation"], committed), {}
            else:
                args, kwargs = tuple(f[key] for key in FIELDS[op]), {}
            results.append(getattr(shard, op)(*args, **kwargs))
        except (ValueError, TypeError, KeyError) as e:
            raise LogError(f"{where}: entry {i} ({op}): {e}") from None
    return results
