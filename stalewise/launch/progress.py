"""The launcher's lines on stderr: progress while the ranks run, and how they ended."""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any

log = logging.getLogger(__name__)

PROGRESS_TTY = 2.0  #: Seconds between the launcher's progress lines when stderr is a terminal.
PROGRESS_EVERY = 10.0  #: Seconds between them otherwise (a log file, a pipe).


def progress_every() -> float:
    """Seconds between progress lines: ``STALEWISE_PROGRESS`` if set (0: none), else by tty."""
    text = os.environ.get("STALEWISE_PROGRESS", "").strip()
    if text:
        try:
            every = float(text)
        except ValueError:
            every = -1.0
        if math.isfinite(every) and every >= 0:
            return every
        log.warning("STALEWISE_PROGRESS=%r is not a number of seconds >= 0; ignored", text)
    isatty = getattr(sys.stderr, "isatty", None)
    return PROGRESS_TTY if isatty is not None and isatty() else PROGRESS_EVERY


class Progress:
    """The launcher's progress line: the job's pushes (applied, refused), their rate (a
    resumed job's restored pushes aside), the ranks' mean ``ctx.log`` loss, the ranks live."""

    def __init__(self, workers: int, server: Any):
        self.workers, self.server = workers, server
        self.every = progress_every()
        self.last = time.monotonic()
        self.pushes = server.job_pushes

    def tick(self, now: float, live: int) -> None:
        """Prints a line if the interval has passed since the last one (or the start)."""
        if not self.every or now - self.last < self.every:
            return
        applied, rejected, losses = _counts(self.server)
        pushes = self.server.job_pushes  # counted after the shard's: a push commits, then applies
        rate = (pushes - self.pushes) / max(now - self.last, 1e-9)
        self.last, self.pushes = now, pushes
        judged = (
            "" if applied is None else f" ({applied} applied, {sum(rejected.values())} refused)"
        )
        losses = [x for x in losses if math.isfinite(x)]
        loss = f", loss {sum(losses) / len(losses):.4g}" if losses else ""
        say(
            f"{pushes} pushes{judged}, {rate:.1f} pushes/s{loss}, {live} of {self.workers} ranks live"
        )


def end_lines(
    workers: int,
    failed: int,
    pushes: tuple[int, dict],
    steps: int | None,
    refused: int,
    where: str = "",
) -> None:
    """The launcher's last lines: the pushes refused past the budget, how the ranks ended and
    the job's pushes (``pushes``: :func:`pushes_of` the server; ``where``: `` on 2 Ray node(s)``)."""
    if refused and steps is not None:
        say(f"the budget of {steps} pushes is spent; {refused} pushes past it were refused")
    ended = f"{workers} workers done" if not failed else (
        f"{workers - failed} of {workers} workers done, {failed} failed")  # fmt: skip
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(pushes[1].items()) if n)
    say(f"{ended}{where}, {pushes[0]} pushes" + (f" ({kinds} refused)" if kinds else ""))


def pushes_of(server: Any) -> tuple[int, dict]:
    """The job's pushes, and those its shards refused by reason (``{"not_finite": 40}``)."""
    return server.job_pushes, _counts(server)[1]


def _counts(server: Any) -> tuple[int | None, dict, list[float]]:
    """The pushes shard 0 applied, refused by reason, and each rank's last loss."""
    try:
        shard = server.stats(timeout=10)[0]
        losses = shard["losses"] if "losses" in shard else server.losses()
    except Exception:  # the launcher's lines go on without them (the failure says more)
        return None, {}, []
    return shard["applied"], dict(shard.get("rejected", {})), list(losses)


def say(line: str) -> None:
    """One line of the launcher's on stderr: ``stalewise run: LINE``."""
    print(f"stalewise run: {line}", file=sys.stderr, flush=True)
