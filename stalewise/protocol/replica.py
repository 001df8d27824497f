"""A shard kept on two processes, as pure objects (no I/O): the rules every runtime follows.

A :class:`Primary` serves and forwards its journal's entries to a :class:`Backup`, promoted when
it dies. Rules, costs and an example: ``docs/design-notes.md`` ("Replicated shards")."""

from __future__ import annotations

import hashlib
import json
from collections import deque
from typing import Any, NamedTuple

import numpy as np

from stalewise.protocol import pushlog


class Forward(NamedTuple):
    """Journal entries ``first, first + 1, ...`` of the primary of ``view``, encoded."""

    view: int
    first: int
    entries: tuple[bytes, ...]


class Held(NamedTuple):
    """The backup of ``view`` holds (has in memory) the first ``entries`` entries."""

    view: int
    entries: int


class CatchUp(NamedTuple):
    """A new backup's start: the primary's ``state_dict()`` after its first ``entries``."""

    view: int
    entries: int
    state: dict[str, Any]


class Primary:
    """The serving copy of a shard: numbers its entries, holds replies until the backup does."""

    def __init__(self, shard: Any, *, entries: int = 0, view: int = 0):
        self.shard, self.entries, self.view = shard, entries, view
        self.backed = False  # a backup is attached
        self.acked = entries  # entries the backup holds
        self._unsent: list[bytes] = []
        self._waiting: deque[tuple[int, Any]] = deque()
        shard.journal = self._record

    def _record(self, buffers: list[bytes]) -> None:
        self._unsent.append(b"".join(buffers))
        self.entries += 1

    def join(self, worker: int, incarnation: int) -> None:
        """``shard.join`` of a newer incarnation; a resent one changes nothing."""
        if incarnation > self.shard.incarnation[worker]:
            self.shard.join(worker, incarnation)

    def reply(self, message: Any) -> list[Any]:
        """Queues ``message`` until the backup holds every entry so far; returns those now free."""
        self._waiting.append((self.entries, message))
        return self._free()

    def forward(self) -> Forward | None:
        """The entries made since the last call (None: none): for the backup, if any, and a log."""
        if not self._unsent:
            return None
        entries, self._unsent = tuple(self._unsent), []
        return Forward(self.view, self.entries - len(entries), entries)

    def held(self, held: Held | None) -> list[Any]:
        """The backup's :class:`Held`; returns the replies it frees."""
        if held is not None and held.view == self.view and self.backed:
            self.acked = max(self.acked, held.entries)
        return self._free()

    def detach(self) -> list[Any]:
        """The backup is gone (dead, not only given up on): serve alone; returns the replies."""
        self.backed = False
        return self._free()

    def attach(self, after: int = -1) -> CatchUp:
        """Starts a new backup in a view newer than ``after`` too (the view the backup followed,
        which a dead primary may have used): the state now; the entries after it follow."""
        self.view = max(self.view, after) + 1
        self.backed, self.acked = True, self.entries
        return CatchUp(self.view, self.entries, self.shard.state_dict())

    def _free(self) -> list[Any]:
        free = []
        while self._waiting and (not self.backed or self._waiting[0][0] <= self.acked):
            free.append(self._waiting.popleft()[1])
        return free


class Backup:
    """A copy of a shard replaying its primary's entries in order (``shard``: built as the primary's
    was; ``start``: :meth:`Primary.attach`'s); it holds each (:meth:`hold`), then applies it."""

    def __init__(self, shard: Any, start: CatchUp):
        shard.load_state_dict(start.state)
        self.shard, self.entries, self.view = shard, start.entries, start.view
        self.pending: deque[list] = deque()  # held (decoded), not applied yet

    def receive(self, forward: Forward | None) -> Held | None:
        held = self.hold(forward)
        self.apply()
        return held

    def hold(self, forward: Forward | None) -> Held | None:
        """Keeps the entries not held yet, decoded and checked; returns what it holds (None: a
        forward of another view, ignored). pushlog.LogError: a gap, a garbled entry (none held)."""
        if forward is None or forward.view != self.view:
            return None
        at = f"shard {self.shard.shard_id}, view {self.view}, entry {self.entries}"
        if forward.first > self.entries:
            raise pushlog.LogError(f"{at}: entry {forward.first} arrived first (a gap)")
        try:
            new = [pushlog.decode(d) for d in forward.entries[self.entries - forward.first :]]
        except pushlog.LogError as e:
            raise pushlog.LogError(f"{at}: {e}") from None
        self.pending.extend(new)
        self.entries += len(new)
        return Held(self.view, self.entries)

    def apply(self) -> None:
        """Applies the held entries in order (before the state is read or served); pushlog.LogError:
        an entry the shard refuses (it and those after are dropped)."""
        while self.pending:
            try:
                pushlog.replay(self.shard, self.pending[0])
            except pushlog.LogError as e:
                self.entries -= len(self.pending)
                self.pending.clear()
                at = f"shard {self.shard.shard_id}, view {self.view}, entry {self.entries}"
                raise pushlog.LogError(f"{at}: {e}") from None
            self.pending.popleft()

    def promote(self) -> Primary:
        """The primary died: this copy serves (alone), in a new view."""
        self.apply()
        return Primary(self.shard, entries=self.entries, view=self.view + 1)


def stale(seen: tuple | None, view: int, version: int, handled: int | None = None) -> str | None:
    """Why a backup of ``view``, at ``version`` after ``handled`` pushes (None: not counted),
    may lack what its dead primary let out (acks, snapshots) as last ``seen``: ``(view, backed:
    its backup held all, version, handled)`` (None: it holds all, or nothing was seen)."""
    if seen is None or view > seen[0]:
        return None
    alone = "" if seen[1] else ", alone"
    if view < seen[0] or alone:
        return f"it follows view {view}; its primary served view {seen[0]}{alone}"
    n, m = ("", "") if handled is None else (f" after {handled} pushes", f" after {seen[3]}")
    if version < seen[2] or (handled is not None and handled < seen[3]):
        return f"it is at version {version}{n}; its primary let out version {seen[2]}{m}"
    return None


class Outstanding:
    """A worker's requests (push, pull, join) a shard's primary left unanswered, to resend."""

    def __init__(self, shards: int):
        self._sent: list[dict[Any, Any]] = [{} for _ in range(shards)]

    def sent(self, k: int, key: Any, request: Any) -> None:
        self._sent[k][key] = request

    def answered(self, k: int, key: Any) -> bool:
        """Whether ``key`` was outstanding at shard ``k`` (False: a late second answer)."""
        return self._sent[k].pop(key, None) is not None

    def resend(self, k: int) -> list[Any]:
        """What to send the new primary of shard ``k``, in the order first sent."""
        return list(self._sent[k].values())


def digest(state: dict[str, Any]) -> str:
    """A sha256 of a ``Shard.state_dict()``: a backup's state equals its primary's when these do."""
    h = hashlib.sha256()
    for key, v in sorted(state.items()):
        h.update(
            key.encode() + (v.tobytes() if isinstance(v, np.ndarray) else json.dumps(v).encode())
        )
    return h.hexdigest()
