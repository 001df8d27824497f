"""What workers and shards say to each other: push headers, acks, push results."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class PushHeader(NamedTuple):
    """What identifies a push: ``(worker, incarnation, seq)`` makes it exactly-once; a
    runtime fills ``worker`` and ``incarnation`` from the connection, never the sender."""

    worker: int  # id of the pushing worker, 0 <= worker < workers
    seq: int  # the incarnation's sequence number for this push (0, 1, 2, ...)
    base_version: int  # the shard version the update was computed from
    incarnation: int = 0  # which (re)start of the worker sent it


APPLIED, REFUSED, DUPLICATE, SPLIT = "applied", "refused", "duplicate", "split"


class Ack(NamedTuple):
    """One shard's answer to a push."""

    worker: int
    seq: int
    ok: bool  # False: refused, nothing changed; `reason` says why
    reason: str | None
    version: int  # shard version after handling the push
    staleness: int | None  # tau of the push (None when the header was unusable)
    duplicate: bool = False  # a replay of a push already handled: acknowledged, not applied
    kind: str | None = None  # the refusal's kind ("not_finite", "seq_gap", ...)

    @property
    def status(self) -> str:
        """``"applied"``, ``"refused"`` or ``"duplicate"``."""
        if not self.ok:
            return REFUSED
        return DUPLICATE if self.duplicate else APPLIED


class PushResult(NamedTuple):
    """One push's outcome on all shards; ``split``: some applied it, some refused (overflow)."""

    seq: int
    status: str  # "applied", "refused", "duplicate" or "split"
    reason: str | None  # why it was refused (None otherwise)
    kind: str | None  # the refusal's kind
    versions: tuple[int, ...]  # each shard's version after handling it
    staleness: int | None  # the largest staleness any shard saw

    @classmethod
    def of(cls, acks: Sequence[Ack]) -> PushResult:
        """Folds one push's per-shard acks: refused if any refused (``split``: some applied)."""
        refused = [(k, a) for k, a in enumerate(acks) if not a.ok]
        taus = [a.staleness for a in acks if a.staleness is not None]
        if refused:
            status = SPLIT if any(a.ok and not a.duplicate for a in acks) else REFUSED
            reason = "; ".join(f"shard {k}: {a.reason}" for k, a in refused)
            kind = refused[0][1].kind
        else:
            status = DUPLICATE if all(a.duplicate for a in acks) else APPLIED
            reason = kind = None
        versions = tuple(a.version for a in acks)
        return cls(acks[0].seq, status, reason, kind, versions, max(taus, default=None))

    @property
    def applied(self) -> bool:
        return self.status == APPLIED
