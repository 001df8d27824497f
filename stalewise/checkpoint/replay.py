"""``stalewise replay``: a checkpoint and the push logs after it, replayed into parameters."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from stalewise.checkpoint.resume import check_compatible
from stalewise.checkpoint.store import LOG, Checkpoint, CheckpointError, load, open_file
from stalewise.protocol import pushlog

log = logging.getLogger(__name__)


def replay(directory: str | os.PathLike, config: Any, start: str | None = None) -> tuple:
    """The flat parameters the checkpoint ``start`` (default: the newest) of ``directory``
    and the push logs after it give, with that checkpoint and the logs read. CheckpointError
    (one line): no usable checkpoint, one of another job or without logs, or a bad log."""
    root = Path(directory)
    ckpt = load(root / start if start else root)
    check_compatible(ckpt, config)
    if not ckpt.step.get("logs"):
        raise CheckpointError(f"{ckpt.path.name} names no push logs (a run that wrote none)")
    read: list[str] = []
    states = [_replayed(k, ckpt, config, None, read) for k in range(len(ckpt.states))]
    return np.concatenate([s["params"] for s in states]), ckpt, read


def logged(ckpt: Checkpoint, config: Any) -> Checkpoint:
    """``ckpt`` advanced by its shards' push logs through what every shard logged; its ``step``
    counts the pushes replayed and lists the ``torn`` ones; ``ckpt`` itself when it names no
    logs, or (warned) when they are not one run's cut short or cannot be read whole."""
    names = ckpt.step.get("logs")
    if not names:
        return ckpt
    folder, marks, states = ckpt.path.parent, [], None
    try:
        for state, name in zip(ckpt.states, names, strict=True):
            entries = chain_entries(folder, name, np.asarray(state["params"]).nbytes)
            marks.append(list(_marks(entries)))  # each entry's, for the replay's second pass
        seen = [{m for pair in shard for m in pair if m is not None} for shard in marks]
        common = set.intersection(*seen)
        torn = {m for m in set.union(*seen) - common if not isinstance(m[0], str)}
        why = _not_one_run(folder, names, torn, common)
        if not why:
            states = [_replayed(k, ckpt, config, (common, marks[k])) for k in range(len(names))]
    except CheckpointError as e:  # garbled, or not ours: as a refused checkpoint, a fallback
        why = str(e)
    if not why and len({str(_seats(s)) for s in states}) > 1:
        why = "the shards' replays hold different pushes or workers"
    if why:
        log.warning("%s: its push logs are not used (the pushes after it are lost): %s",
                    ckpt.path.name, why)  # fmt: skip
        return ckpt
    workers, before = len(states[0]["next_seq"]), _seats(ckpt.states[0])
    had = [int(n) for n in ckpt.step.get("pushed") or [0] * workers]
    pushed = list(had)
    for m in common:  # the pushes every shard logged that the checkpoint did not hold yet
        if not isinstance(m[0], str) and 0 <= m[0] < workers and m[1:] >= before[m[0]][:2]:
            pushed[m[0]] += 1
    step = ckpt.step | {"pushes": ckpt.step.get("pushes", 0) + sum(pushed) - sum(had),
                        "pushed": pushed, "replayed": sum(pushed) - sum(had),
                        "torn": sorted(map(list, torn))}  # fmt: skip
    residuals = ckpt.residuals  # one of fewer pushes than the logs add would send some twice
    if residuals is not None:
        changed = zip(residuals, pushed, had, strict=True)
        residuals = [r if n == m else np.zeros_like(r) for r, n, m in changed]
    return dataclasses.replace(
        ckpt, states=states, residuals=residuals, manifest=ckpt.manifest | {"step": step}
    )


#: the entries that change who is seated: replayed only where every shard logged them
SEATING = ("join", "admit", "retire", "leave", "depart", "expire_unstarted")


def _marks(entries: Any) -> Any:
    """Per entry, what every shard must agree on: ``(push, seating)``, a push's ``(worker,
    incarnation, seq)`` and the ``n``-th change of seats' ``(op, worker, incarnation, n)``."""
    count: Counter = Counter()
    for entry in entries:
        f, h = entry.fields, entry.fields.get("header")
        push = (h[0], h[3], h[1]) if h and (entry.op == "push" or f.get("committed")) else None
        seating = None
        if entry.op in SEATING:
            seating = (entry.op, f.get("worker"), f.get("incarnation"))
            count[seating] += 1
            seating += (count[seating],)
        yield push, seating


def _not_one_run(folder: Path, names: list[str], torn: set, common: set) -> str | None:
    """Why the logs are not those of one run cut short (None: they are): a shard's log
    missing, or a torn push not its incarnation's last (a worker has one push in flight)."""
    for name in names:
        if not os.path.lexists(folder / name):
            return f"{name} is missing (its shard could not write it)"
    pushes = [m for m in common | torn if not isinstance(m[0], str)]
    for w, inc, seq in sorted(torn):
        if any(m[:2] == (w, inc) and m[2] > seq for m in pushes):
            return f"push {seq} of worker {w} (incarnation {inc}) is in some shards' logs only"
    return None


def _seats(state: dict) -> list[tuple]:
    keys = ("incarnation", "next_seq", "live")
    return list(zip(*(np.asarray(state[key]).tolist() for key in keys), strict=True))


def _replayed(k: int, ckpt: Checkpoint, config: Any, agreed: Any, read: Any = None) -> dict:
    """Shard ``k``'s state replayed from ``ckpt`` through ``agreed``; files read into ``read``."""
    state = ckpt.states[k]
    shard = config.build_shard(k, np.array(state["params"]), int(state["workers"]))
    shard.load_state_dict(state)
    files, _ = replay_chain(shard, ckpt.path.parent, ckpt.step["logs"][k], agreed)
    if read is not None:
        read += files
    return shard.state_dict()


def chain_entries(folder: Path, name: str, nbytes: int) -> Any:
    """The entries of log ``name`` and the rest of its chain, in order, payloads skipped."""
    for _, f, where, last in _chain(folder, name):
        with f:
            try:
                yield from _read(f, nbytes, where, last, payloads=False)
            except pushlog.LogError as e:
                raise CheckpointError(str(e)) from None


def _chain(folder: Path, name: str) -> Any:
    """Each file of log ``name``'s chain: (name, open file, where, whether it is the last)."""
    chain, n = LOG.match(name).groups()
    n = int(n)
    while os.path.lexists(folder / (name := f"{chain}-{n:06d}")):
        fd, _ = open_file(folder, name, folder_may_be_a_link=True)  # as `latest`
        last = not os.path.lexists(folder / f"{chain}-{n + 1:06d}")
        yield name, os.fdopen(fd, "rb"), str(folder / name), last
        n += 1


def replay_chain(
    shard: Any, folder: Path, name: str, agreed: tuple[set, list] | None = None
) -> tuple[list[str], int]:
    """Replays into ``shard`` (loaded with the state log ``name`` began at) that log and the
    rest of its chain, leaving out what is not ``agreed``; returns the files read and the bytes
    of whole entries in the last. CheckpointError: a log garbled, not ours, or not its shard's."""
    read, end, left_out = [], 0, False

    def entries(f: Any, where: str, last: bool, marks: Any) -> Any:
        nonlocal end, left_out
        end = 0
        for entry in _read(f, shard.params.nbytes, where, last):
            if agreed is not None:
                push, seating = next(marks)
                entry, left = _agreed(entry, push in common, seating is None or seating in common)
                if left_out and entry is not None and entry.fields.get("header"):
                    h = entry.fields["header"]
                    h = [h[0], h[1], min(h[2], shard.version), h[3]]
                    entry = entry._replace(fields=entry.fields | {"header": h})
                left_out |= left
            if entry is not None:
                yield entry
            end = f.tell()  # once it is replayed

    common, marks = agreed if agreed is not None else (set(), [])
    marks = iter(marks)
    for file, f, where, last in _chain(folder, name):
        with f:
            try:
                pushlog.replay(shard, entries(f, where, last, marks), where)
            except pushlog.LogError as e:
                raise CheckpointError(str(e)) from None
        read.append(file)
    return read, end


def _agreed(entry: pushlog.Entry, push_ok: bool, seating_ok: bool) -> tuple[Any, bool]:
    """What of ``entry`` to replay (None: nothing) when every shard logged its push
    (``push_ok``) and its change of seats (``seating_ok``), and whether a part is left out."""
    pushes = entry.op == "push" or bool(entry.fields.get("committed"))
    if entry.op != "depart":
        ok = push_ok if pushes else seating_ok
        return (entry if ok else None), not ok
    if seating_ok and (push_ok or not pushes):
        return entry, False
    if seating_ok:  # its push some shard did not log: the departure alone
        return entry._replace(fields=entry.fields | {"committed": False}), True
    # a departure some shard did not log: its push alone, if every shard logged that
    return (entry._replace(op="deliver") if pushes and push_ok else None), True


def continued(newest: str, path: str, at: int) -> int | None:
    """The bytes of log ``newest`` (its chain's) a shard's state held at byte ``at`` of log
    ``path`` (a backup's) goes on from; None, with a warning, if ``newest`` lacks them."""
    at = at if path == newest else 0
    if os.path.isfile(newest) and os.path.getsize(newest) >= at:
        return at
    log.warning("a state held at byte %d of %s does not go on in %s: a new log chain begins at "
                "the next checkpoint", at, path or "no log", newest)  # fmt: skip
    return None


def _read(f: Any, nbytes: int, where: str, last: bool, payloads: bool = True) -> Any:
    """:func:`pushlog.read` of a log of a shard of ``nbytes`` bytes of params."""
    limit = 2 * nbytes + (1 << 20)  # a payload as sent, a codec's or not
    return pushlog.read(f, max_payload=limit, where=where, last=last, payloads=payloads)


def first_difference(flat: np.ndarray, ckpt: Checkpoint) -> str | None:
    """The first leaf whose values differ from ``ckpt``'s, bit for bit (None: identical)."""
    want = ckpt.flat()
    if flat.tobytes() == want.tobytes():
        return None
    for leaf in ckpt.spec.leaves:
        lo, hi = leaf.offset, leaf.offset + leaf.size
        if flat[lo:hi].tobytes() != want[lo:hi].tobytes():
            return leaf.name
    return "?"
