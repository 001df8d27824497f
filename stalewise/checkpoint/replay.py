"""``stalewise replay``: a checkpoint and the push logs written after it, replayed into the
parameters the run's shards reached (:mod:`stalewise.protocol.pushlog`).

A checkpoint names, per shard, the log its shard began at that state (``step.logs``,
``log-shard-K-TAG-N``); the log's chain goes on in ``...-N+1``, ``...-N+2`` (each begun at
a later checkpoint) until a file is missing. Every file is read as checkpoints are: a
regular file of this user's, no symlink followed, every length bounded."""

from __future__ import annotations

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
    names = ckpt.step.get("logs")
    if not names:
        raise CheckpointError(f"{ckpt.path.name} names no push logs (a run that wrote none)")
    flats, read = [], []
    for k, (state, name) in enumerate(zip(ckpt.states, names, strict=True)):
        shard = config.build_shard(k, np.array(state["params"]), int(state["workers"]))
        shard.load_state_dict(state)
        read += replay_chain(shard, ckpt.path.parent, name)[0]
        flats.append(shard.params)
    return np.concatenate(flats), ckpt, read


def replay_chain(shard: Any, folder: Path, name: str) -> tuple[list[str], int]:
    """Replays into ``shard`` (loaded with the state log ``name`` began at) that log and the
    rest of its chain; returns the files read and the bytes of whole entries in the last
    (a torn last entry is dropped).

    Raises:
        CheckpointError: a log that is garbled, not ours, or does not fit its shard."""
    chain, n = LOG.match(name).groups()
    limit = 2 * shard.params.nbytes + (1 << 20)  # a payload as sent, a codec's or not
    read, n, end = [], int(n), 0

    def entries(f: Any, where: str, last: bool) -> Any:
        nonlocal end
        end = 0
        for entry in pushlog.read(f, max_payload=limit, where=where, last=last):
            yield entry
            end = f.tell()  # once it is replayed

    while os.path.lexists(folder / (name := f"{chain}-{n:06d}")):
        fd, _ = open_file(folder, name, folder_may_be_a_link=True)  # as `latest`
        where, last = str(folder / name), not os.path.lexists(folder / f"{chain}-{n + 1:06d}")
        with os.fdopen(fd, "rb") as f:
            try:
                pushlog.replay(shard, entries(f, where, last), where)
            except pushlog.LogError as e:
                raise CheckpointError(str(e)) from None
        read.append(name)
        n += 1
    return read, end


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
