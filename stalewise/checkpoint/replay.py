"""``stalewise replay``: a checkpoint and the push logs written after it, replayed into the
parameters the run's shards reached (:mod:`stalewise.protocol.pushlog`).

A checkpoint names, per shard, the log its shard began at that state (``step.logs``,
``log-shard-K-TAG-N``); the log's chain goes on in ``...-N+1``, ``...-N+2`` (each begun at
a later checkpoint) until a file is missing. Every file is read as checkpoints are: a
regular file of this user's, no symlink followed, every length bounded."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np

from stalewise.checkpoint.resume import check_compatible
from stalewise.checkpoint.store import LOG, Checkpoint, CheckpointError, load, open_file
from stalewise.protocol import pushlog


def replay(directory: str | os.PathLike, config: Any, start: str | None = None) -> tuple:
    """The flat parameters the checkpoint ``start`` (default: the newest) of ``directory``
    and the push logs after it give, with that checkpoint and the logs read.

    Raises:
        CheckpointError: one line: no usable checkpoint, one of another job or without
            logs, or a log that is garbled, not ours, or does not fit its shard."""
    root = Path(directory)
    ckpt = load(root / start if start else root)
    check_compatible(ckpt, config)
    if not ckpt.step.get("logs"):
        raise CheckpointError(f"{ckpt.path.name} names no push logs (a run that wrote none)")
    states, read, _, _ = _advance(ckpt, config)
    return np.concatenate([s["params"] for s in states]), ckpt, read


def logged(ckpt: Checkpoint, config: Any) -> Checkpoint:
    """``ckpt`` advanced by the push logs its shards wrote after it: each shard replayed to
    the end of its chain, less the pushes some shard logged and another did not (torn by a
    death: never acknowledged). Its ``step`` counts the pushes replayed in ``pushes``,
    ``pushed`` (per worker id) and ``replayed``, and lists the ``torn`` ones as ``[worker,
    incarnation, seq]``; ``ckpt`` itself when it names no logs.

    Raises:
        CheckpointError: a log that is garbled, not ours, or does not fit its shard."""
    if not ckpt.step.get("logs"):
        return ckpt
    states, _, torn, common = _advance(ckpt, config)
    pushed = list(ckpt.step.get("pushed") or [0] * len(states[0]["next_seq"]))
    before = ckpt.states[0]
    held = list(zip(np.asarray(before["incarnation"]), np.asarray(before["next_seq"]), strict=True))
    for w, inc, seq in common:  # those the checkpoint did not hold yet
        pushed[w] = int(pushed[w]) + bool(
            inc > held[w][0] or (inc == held[w][0] and seq >= held[w][1])
        )
    added = sum(pushed) - sum(ckpt.step.get("pushed") or [0])
    step = ckpt.step | {"pushes": ckpt.step.get("pushes", 0) + added, "pushed": pushed,
                        "replayed": added, "torn": sorted(map(list, torn))}  # fmt: skip
    return dataclasses.replace(ckpt, states=states, manifest=ckpt.manifest | {"step": step})


def _advance(ckpt: Checkpoint, config: Any) -> tuple[list[dict], list[str], set, set]:
    """The shards' states replayed from ``ckpt`` to the ends of their chains less the torn
    pushes, the files read, the torn pushes and those every shard logged."""
    names, folder, keys = ckpt.step["logs"], ckpt.path.parent, []
    for state, name in zip(ckpt.states, names, strict=True):
        entries = chain_entries(folder, name, np.asarray(state["params"]).nbytes)
        keys.append({key for e in entries if (key := _pushed(e)) is not None})
    torn = set.union(*keys) - set.intersection(*keys)
    states, read = [], []
    for k, (state, name) in enumerate(zip(ckpt.states, names, strict=True)):
        shard = config.build_shard(k, np.array(state["params"]), int(state["workers"]))
        shard.load_state_dict(state)
        read += replay_chain(shard, folder, name, leave_out=torn)[0]
        states.append(shard.state_dict())
    return states, read, torn, set.intersection(*keys)


def _pushed(entry: pushlog.Entry) -> tuple[int, int, int] | None:
    """The ``(worker, incarnation, seq)`` of the push an entry hands its shard, if any."""
    h = entry.fields.get("header")
    if entry.op == "push" or (entry.op in ("depart", "deliver") and entry.fields["committed"]):
        return None if h is None else (h[0], h[3], h[1])
    return None


def chain_entries(folder: Path, name: str, nbytes: int) -> Any:
    """The entries of log ``name`` and the rest of its chain, in order, their payloads
    skipped (:func:`replay_chain` reads and checks them)."""
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


def replay_chain(shard: Any, folder: Path, name: str, leave_out: Any = ()) -> tuple[list[str], int]:
    """Replays into ``shard`` (loaded with the state log ``name`` began at) that log and the
    rest of its chain, without the pushes ``leave_out`` names (``(worker, incarnation,
    seq)``); returns the files read and the bytes of whole entries in the last (a torn last
    entry is dropped).

    Raises:
        CheckpointError: a log that is garbled, not ours, or does not fit its shard."""
    read, end = [], 0

    def entries(f: Any, where: str, last: bool) -> Any:
        nonlocal end
        end = 0
        for entry in _read(f, shard.params.nbytes, where, last):
            if _pushed(entry) in leave_out:
                if entry.op == "push":
                    continue
                entry = pushlog.Entry(entry.op, entry.fields | {"committed": False})
            yield entry
            end = f.tell()  # once it is replayed

    for file, f, where, last in _chain(folder, name):
        with f:
            try:
                pushlog.replay(shard, entries(f, where, last), where)
            except pushlog.LogError as e:
                raise CheckpointError(str(e)) from None
        read.append(file)
    return read, end


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
