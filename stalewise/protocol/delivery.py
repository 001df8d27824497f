"""The commit rule across shards a sender reaches one call at a time (Ray; design notes, "The
commit rule on Ray"): each shard keeps what repairs the others if the sender dies between calls
(:class:`Ledger`, :func:`departure`); a :class:`Cut` brings all to the same pushes for a copy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Ledger:
    """A shard's record of each worker's pushes not yet acknowledged by every shard; a backup
    starts from a copy of its primary's (``kept``), then replays its :attr:`changes`."""

    def __init__(self, kept: dict | None = None) -> None:
        self.kept = {w: dict(v) for w, v in (kept or {}).items()}  # w -> {seq: (inc, entry)}
        self.changes: list[tuple] | None = None  # since last taken (None: not recorded)

    def keep(self, w: int, inc: int, seq: int, *, acked: int, entry: Any) -> None:
        """Keeps push ``seq`` of ``w``'s incarnation ``inc``; forgets that incarnation's
        pushes below ``acked`` (every shard has them) and every other incarnation's."""
        window = self.kept.setdefault(w, {})
        for old in [n for n, (i, _) in window.items() if n < acked or i != inc]:
            del window[old]
        window[seq] = (inc, entry)
        if self.changes is not None:
            self.changes.append((w, inc, seq, acked, entry))

    def between(self, w: int, inc: int, start: int, stop: int) -> list | None:
        """The entries of pushes ``start .. stop - 1`` of ``w``'s ``inc``, in order (or None)."""
        window = self.kept.get(w, {})
        got = [window[n][1] for n in range(start, stop) if window.get(n, (None,))[0] == inc]
        return got if len(got) == stop - start else None

    def forget(self, w: int | None = None) -> None:
        """Forgets worker ``w``'s pushes (None: every worker's)."""
        if w is None:
            self.kept.clear()
        else:
            self.kept.pop(w, None)
        if self.changes is not None:
            self.changes.append((w,))

    def replay(self, changes: Sequence[tuple]) -> None:
        """Makes ``changes`` (another ledger's :attr:`changes`), in order."""
        for c in changes:
            if len(c) == 1:
                self.forget(c[0])
            else:
                self.keep(*c[:3], acked=c[3], entry=c[4])


def departure(counts: Sequence[int | None]) -> tuple[int | None, dict[int, tuple[int, int]]]:
    """Where a gone incarnation's pushes are repaired from, given ``counts[k]`` handled by shard
    ``k`` (None: unknown there): the shard that handled the most (None: none) and, for each
    that knows the incarnation and handled fewer, the ``(start, stop)`` it lacks."""
    top = committed(counts)
    if not top:
        return None, {}
    return counts.index(top), {
        k: (n, top) for k, n in enumerate(counts) if n is not None and n < top
    }


def committed(counts: Sequence[int | None]) -> int | None:
    """How many of a gone incarnation's pushes each shard knowing it has once departed (or None)."""
    return max((n for n in counts if n is not None), default=None)


def targets(progress: Sequence[Sequence[tuple[int, int]]]) -> dict[int, tuple[int, int]]:
    """A consistent cut's target from ``progress[k][w]``, shard ``k``'s ``(incarnation, pushes
    handled)`` of worker ``w``: its newest incarnation and the furthest any shard got with it."""
    out = {}
    for w in range(len(progress[0])):
        inc = max(p[w][0] for p in progress)
        out[w] = (inc, max(p[w][1] for p in progress if p[w][0] == inc))
    return out


class Cut:
    """One shard's side of a consistent cut: frozen, it holds each push not below its target."""

    def __init__(self) -> None:
        self.frozen = False
        self.targets: dict[int, tuple[int, int]] = {}

    def freeze(self, shard: Any) -> list[tuple[int, int]]:
        """Holds every push from now on; returns each worker's (incarnation, pushes handled)."""
        self.frozen, self.targets = True, {}
        return [(int(shard.incarnation[w]), int(shard.next_seq[w])) for w in range(shard.workers)]

    def aim(self, targets: dict[int, tuple[int, int]]) -> None:
        """Lets the held pushes below ``targets`` (worker -> (incarnation, seq)) through."""
        self.targets = dict(targets)

    def holds(self, w: int, inc: int, seq: int) -> bool:
        """Whether push ``seq`` of ``w``'s incarnation ``inc`` waits (frozen, not below target)."""
        target = self.targets.get(w)
        return self.frozen and not (target is not None and target[0] == inc and seq < target[1])

    def waits(self, shard: Any, w: int, inc: int, seq: int) -> bool:
        """Whether push ``seq`` of ``w``'s admitted ``inc`` waits: held, or an earlier is not in."""
        return bool(shard.admitted[w] == inc) and (
            self.holds(w, inc, seq) or (seq > shard.next_seq[w] and shard.incarnation[w] == inc)
        )

    def reached(self, shard: Any) -> bool:
        """Whether ``shard`` has handled every push below the targets."""
        return all(
            shard.incarnation[w] != inc or not shard.live[w] or shard.next_seq[w] >= seq
            for w, (inc, seq) in self.targets.items()
        )

    def thaw(self) -> None:
        """Lets every held push through."""
        self.frozen, self.targets = False, {}
