"""What goes wrong in a run, in every runtime: the errors, and the failure policy with its log."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from stalewise.protocol.notices import warn_user

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker failed and the failure policy stopped the job; the message names it and how."""


def worker_failed(w: int, detail: str, what: str = "") -> WorkerError:
    r"""The error of worker ``w`` failing before the job has started: its first line says how
    (``what``, else ``detail``'s last line: the exception of a traceback), then ``detail``.

    Example:
        >>> tb = 'Traceback (most recent call last):\n  File "x.py"\nValueError: bad batch\n'
        >>> str(worker_failed(1, tb)).splitlines()[0]
        'worker 1 failed: ValueError: bad batch'
    """
    lines = [line for line in detail.splitlines() if line.strip()]
    head = what or (lines[-1].strip() if lines else "no reason given")
    rest = "" if lines == [head] else "\n" + detail.rstrip()
    return WorkerError(f"worker {w} failed: {head}{rest}")


class ShardError(RuntimeError):
    """A shard's process died and the job could not go on; the message names the shard."""


class ServerClosed(ConnectionError):
    """A client's job has ended or a shard cut this client off."""


class BudgetSpent(ServerClosed):
    """A push refused at its commit: the job's budget of ``steps`` pushes is spent (none sent)."""

    def __init__(self, steps: int):
        super().__init__(
            f"the job's budget of {steps} pushes is spent: this push was refused (nothing "
            "was sent); end the loop when ctx.should_stop() (or client.may_begin) is false"
        )
        self.steps = steps


class DivergedError(RuntimeError):
    """Training diverged: every worker stopped because its pushes kept being refused."""


def warn_summary(events: Sequence[Mapping[str, Any]]) -> None:
    """One :class:`FailureWarning` per kind of failure seen more than once in a run, with counts."""
    kinds: dict[str, Counter] = {}
    lost: Counter = Counter()
    for e in events:  # of kind "worker", "shard", "checkpoint"... (an event's first key)
        if e.get("action") == "left":  # a scripted departure (the simulator's): no failure
            continue
        kind = "diverged" if e.get("action") == "diverged" else next(iter(e), None)
        kinds.setdefault(kind, Counter())[e.get("action", "?")] += 1
        if isinstance(e.get("lost"), int):
            lost[kind] += e["lost"]
    for kind, actions in kinds.items():
        n = sum(actions.values())
        if n < 2:
            continue
        what = ", ".join(f"{a} {c}" for a, c in actions.items() if a != "diverged")
        if lost[kind]:
            what += f"{', ' if what else ''}{lost[kind]} updates lost"
        name = "workers that diverged" if kind == "diverged" else f"{kind} failures"
        warn_user(f"{name} this run: {n}{f' ({what})' if what else ''}; see result.failures")


FAILURE_POLICIES = ("restart", "drop", "fail")


class Failures:
    """A job's failure policy, and the log of what it did (``TrainResult.failures``).

    ``policy``: as :class:`stalewise.Failures`. Every event is kept in :attr:`events`, the
    first of each kind warned; ``hint`` ends a stopping error."""

    def __init__(self, policy: str = "restart", max_restarts: int | None = 3, *, hint: str = ""):
        self.policy, self.max_restarts, self.hint = policy, max_restarts, hint
        self.events: list[dict[str, Any]] = []
        self._restarts: Counter = Counter()  # ("worker" | "shard", id) -> restarts so far
        self._warned: set[str] = set()  # the kinds of event warned this run

    def warn_once(self, kind: str, message: str) -> None:
        """Warns ``message`` on the run's first ``kind`` event (later: :func:`warn_summary`)."""
        if kind not in self._warned:
            self._warned.add(kind)
            warn_user(message + "; later failures of this kind are counted at the end of the run")

    @property
    def restarts(self) -> int:
        return sum(self._restarts.values())

    def _event(self, kind: str, i: Any, cause: str, time: float, action: str) -> None:
        self.events.append({kind: i, "time": time, "cause": cause, "action": action})

    def _stop_or_count(self, kind: str, i: int, cause: str, time: float, detail: str) -> None:
        """Raises if the failure of ``kind`` ``i`` stops the job; else counts any restart."""
        key, restarts = (kind, i), kind == "shard" or self.policy == "restart"
        n = self._restarts[key] + 1
        over = self.max_restarts is not None and n > self.max_restarts
        if self.policy != "fail" and not (restarts and over):
            self._restarts[key] += int(restarts)
            return
        self._event(kind, i, cause, time, "failed")
        head = (
            f"{kind} {i} failed: {cause}"
            if self.policy == "fail"
            else f"{kind} {i} failed {'once' if n == 1 else f'{n} times'}, more than "
            f"max_restarts={self.max_restarts} allows; the last time: {cause}"
        )
        error = WorkerError if kind == "worker" else ShardError
        raise error(head + (f"\n{detail.rstrip()}" if detail else "") + self.hint)

    def worker(self, w: int, cause: str, *, time: float, detail: str = "") -> str:
        """Worker ``w`` failed (``cause``, ``detail``): ``"restart"``, ``"drop"`` or WorkerError."""
        self._stop_or_count("worker", w, cause, time, detail)
        if self.policy == "drop":
            self._event("worker", w, cause, time, "dropped")
            log.warning("worker %d failed (%s); dropped, the other workers carry on", w, cause)
            self.warn_once("worker", f"worker {w} failed ({cause}); dropped, the others carry on")
            return "drop"
        self._event("worker", w, cause, time, "restarted")
        log.warning(
            "worker %d failed (%s); restarting it (restart %d%s)",
            w,
            cause,
            self._restarts["worker", w],
            "" if self.max_restarts is None else f" of {self.max_restarts}",
        )
        self.warn_once(
            "worker",
            f"worker {w} failed ({cause}); restarted at the current parameters, its "
            "unfinished step lost",
        )
        return "restart"

    def shard(self, k: int, cause: str, *, time: float) -> None:
        """Shard ``k`` failed: returns if it is to be restarted, else raises :class:`ShardError`."""
        self._stop_or_count("shard", k, cause, time, "")
        self._event("shard", k, cause, time, "restarted")
        log.warning("shard %d failed (%s); restarting it", k, cause)

    def shard_restarted(
        self,
        event: dict[str, Any],
        *,
        version: int | None = None,
        lost: int | None = None,
        source: str | None = None,
    ) -> None:
        """The shard of ``event`` (:meth:`shard`'s) is back at ``version`` from ``source`` (None:
        a rollback of every shard), ``lost`` updates of its slice lost (None: unknown)."""
        event.update(lost=lost, version=version, **({"source": source} if source else {}))
        at = "" if version is None else f" at version {version}"
        self.warn_once(
            "shard",
            f"shard {event['shard']} failed ({event['cause']}); restarted{at}, "
            f"{'an unknown number of' if lost is None else lost} updates of its slice lost"
            + (f" (from its {source})" if source else "")
            + f", its workers {'carried on' if source in ('backup', 'push log') else 'rejoined'}",
        )

    def left(self, w: int, cause: str, *, time: float) -> None:
        """Worker ``w`` left without failing (e.g. an elastic Ray node left); no restart counted."""
        self._event("worker", w, cause, time, "left")
        log.warning("worker %d left the job (%s); the other workers carry on", w, cause)

    def diverged(self, w: int, message: str, *, time: float) -> None:
        """Worker ``w`` stopped because its pushes kept being refused; it is not restarted."""
        self._event("worker", w, message, time, "diverged")
        log.warning("worker %d diverged and stopped: %s", w, message)
        self.warn_once("diverged", f"worker {w} diverged and stopped: {message}")

    def checkpoint(
        self, directory: str, cause: str, *, time: float, action: str, final: bool
    ) -> None:
        """A checkpoint could not be written into ``directory``; the run goes on (caller warned)."""
        self._event("checkpoint", directory, cause, time, action)
        self.events[-1]["final"] = final
