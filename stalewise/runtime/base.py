"""What every runtime shares: the training result, worker errors, straggler settings."""

from __future__ import annotations

import itertools
import logging
import math
import os
import sys
import time as _time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stalewise import targets, tree

log = logging.getLogger(__name__)

#: The environment variables that cap a process's math-library threads (read when the
#: library loads); every runtime's launcher sets them for its workers unless the user did.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def batch_iterator(data: Any, worker: int, workers: int, drawn: Any = None) -> Iterator[Any]:
    """A worker's batches: ``data(worker, workers)`` if callable, else ``data[worker]`` cycled.

    ``drawn``: the count of batches each worker id has drawn (anything indexed by
    worker id). The stream then skips ``drawn[worker]`` batches and adds one to it
    for each batch it yields. Every runtime continues a worker id's stream this
    way: a new incarnation (a restart, a resumed run) starts a new stream and skips
    what its worker id has drawn, including a batch it died on, so a batch that
    makes the user's code raise is not drawn again.
    """
    batches = iter(data(worker, workers)) if callable(data) else itertools.cycle(data[worker])
    if drawn is None:
        return batches
    if drawn[worker]:
        next(itertools.islice(batches, int(drawn[worker]) - 1, None), None)  # skips exactly that
    return _counting(batches, drawn, worker)


def _counting(batches: Iterator[Any], drawn: Any, worker: int) -> Iterator[Any]:
    for batch in batches:
        drawn[worker] += 1
        yield batch


def mean_loss(last_losses: Any) -> float:
    """The train loss of a record: the mean of each worker's last loss, over workers that pushed.

    A worker that has not pushed yet has NaN there and does not count (as 0 it
    would pull the mean down); NaN when no worker has pushed.
    """
    seen = np.asarray(last_losses, dtype=np.float64)
    seen = seen[~np.isnan(seen)]
    return float(seen.mean()) if seen.size else math.nan


class WorkerError(RuntimeError):
    """A worker failed and the job's failure policy stopped the job.

    User code raised (the message carries the worker's traceback), or the
    worker's process died or hung (the message says how); the worker is named.
    """


def worker_failed(w: int, detail: str, what: str = "") -> WorkerError:
    """The error of worker ``w`` failing before the job has started: its first line says how
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
    """A client's job has ended (its shards stopped) or a shard cut this client off; a
    shard whose process died is a :class:`ShardError` instead. Raised by the clients of
    every runtime (``server.client(w)``, ``sw.attach``, ``sw.init``)."""


class BudgetSpent(ServerClosed):
    """A push refused at its commit because the job's budget of pushes is spent (nothing
    was sent): raised by a client given a budget (``client.budget``, set by ``sw.init``
    and ``stalewise run``) for a push its ``may_begin`` did not grant
    (:mod:`stalewise.protocol.budget`). A :class:`ServerClosed`, so a loop that ends on
    that ends on this too. ``steps`` is the budget."""

    def __init__(self, steps: int):
        super().__init__(
            f"the job's budget of {steps} pushes is spent: this push was refused (nothing "
            "was sent); end the loop when ctx.should_stop() (or client.may_begin) is false"
        )
        self.steps = steps


class PullsIntoTrees:
    """The part of a worker's client that every runtime shares: a pull fills the flat
    ``_pull_buf`` (the runtime's :meth:`pull_flat`), and the parameters come back in the
    structure and backend the job was made with (``_spec``)."""

    _pull_buf: np.ndarray
    _spec: tree.FlatSpec

    @property
    def spec(self) -> tree.FlatSpec:
        """The job's parameter layout (the structure pushes must have)."""
        return self._spec

    def pull_flat(self, *, timeout: float | None = None, own: bool = True) -> np.ndarray:
        raise NotImplementedError

    def pull(
        self,
        *,
        copy: bool = True,
        into: Any = None,
        timeout: float | None = None,
        own: bool = True,
    ) -> Any:
        """Blocks until the consistency model lets this worker start, then returns the params.

        Read-your-writes: the parameters include this worker's last push, if the
        shards applied it (a refused push changed nothing): the pull first waits
        for that push's acknowledgement, then for a snapshot that holds it.
        ``own=False`` does not wait: the push may still be in flight, and
        ``pull_has_own`` then says whether the pull includes it (a pipelined loop
        that overlaps its push with its next step).

        Args:
            copy: False returns leaves that view the pull buffer (valid until the next pull).
            into: an existing tree or model (e.g. a ``torch.nn.Module``) to copy the
                values into, in place; it is returned.
            timeout: seconds to wait for the shards (None: forever).
            own: wait for this worker's last push to be acknowledged (default).

        Returns:
            The parameters in the structure and backend the job was made with.
        """
        self.pull_flat(timeout=timeout, own=own)
        return self.last_pull(copy=copy, into=into)

    def last_pull(self, *, copy: bool = True, into: Any = None) -> Any:
        """The parameters of the last completed pull, as :meth:`pull` returns them."""
        if into is not None:
            tree.unflatten_into(into, self._pull_buf, self._spec)
            return into
        return tree.unflatten(self._pull_buf, self._spec, copy=copy)


class DivergedError(RuntimeError):
    """Training diverged: every worker stopped because its pushes kept being refused."""


class FailureWarning(UserWarning):
    """Something failed during a run and changed its result (a worker or shard restarted,
    updates lost, a checkpoint not written); the event is also in ``TrainResult.failures``."""


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn_user(message: str) -> None:
    """Warns ``message`` as a :class:`FailureWarning`, attributed to the first caller outside
    stalewise (the user's ``Job.train`` call), so Python users see it, not only the log."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, FailureWarning, stacklevel=level)


def failure_kind(event: Mapping[str, Any]) -> str | None:
    """The kind of a ``TrainResult.failures`` event, as warnings count them: ``"worker"``
    (restarted, dropped or failed), ``"diverged"``, ``"shard"``, ``"checkpoint"``...;
    None for a scripted departure (the simulator's ``"left"``), which is no failure."""
    if event.get("action") == "left":
        return None
    if event.get("action") == "diverged":
        return "diverged"
    return next(iter(event), None)


_KIND_NAMES = {"diverged": "workers that diverged"}


def warn_summary(events: Sequence[Mapping[str, Any]]) -> None:
    """At the end of a run: one :class:`FailureWarning` per kind of failure that happened
    more than once, with the counts (the first of each kind warned when it happened).

    ``Job.train`` calls it for every runtime, with ``TrainResult.failures``.

    Example:
        >>> import warnings
        >>> events = [{"worker": 1, "action": "restarted"}, {"worker": 2, "action": "dropped"}]
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_summary(events)
        >>> str(caught[0].message)
        'worker failures this run: 2 (restarted 1, dropped 1); see result.failures'
    """
    kinds: dict[str, Counter] = {}
    lost: Counter = Counter()
    for e in events:
        kind = failure_kind(e)
        if kind is not None:
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
        name = _KIND_NAMES.get(kind, f"{kind} failures")
        warn_user(f"{name} this run: {n}{f' ({what})' if what else ''}; see result.failures")


FAILURE_POLICIES = ("restart", "drop", "fail")


class Failures:
    """A job's failure policy, and the log of what it did (``TrainResult.failures``).

    ``policy`` says what happens to a worker that fails (its process dies, it
    hangs, or user code raises):

    * ``"restart"``: it starts again as a new incarnation at the current
      parameters, up to ``max_restarts`` times per worker id (None: no limit);
      one more failure stops the job with :class:`WorkerError`;
    * ``"drop"``: it leaves; the others carry on;
    * ``"fail"``: the job stops with :class:`WorkerError`.

    A shard that fails is restarted under ``"restart"`` and ``"drop"`` (up to
    ``max_restarts`` times per shard) and stops the job under ``"fail"``
    (:class:`ShardError`). A worker that diverged is never restarted. Every
    event is logged as a warning and kept in :attr:`events`; the first event of
    each kind in a run (a worker failure, a shard restart, a divergence) is also
    warned as a :class:`FailureWarning`, and :func:`warn_summary` counts the
    rest at the end of the run. ``hint`` ends the
    message of an error that stops the job (e.g. how to resume it).

    Example:
        >>> f = Failures("restart", max_restarts=1)
        >>> f.worker(2, "killed by SIGKILL", time=1.5)
        'restart'
        >>> f.worker(2, "killed by SIGKILL", time=2.0)
        Traceback (most recent call last):
        stalewise.runtime.base.WorkerError: worker 2 failed 2 times, more than max_restarts=1 allows; the last time: killed by SIGKILL
        >>> f.restarts, [e["action"] for e in f.events]
        (1, ['restarted', 'failed'])
    """

    def __init__(self, policy: str = "restart", max_restarts: int | None = 3, *, hint: str = ""):
        if policy not in FAILURE_POLICIES:
            raise ValueError(
                f"on_worker_failure must be one of {', '.join(map(repr, FAILURE_POLICIES))}, "
                f"got {policy!r}"
            )
        self.policy, self.max_restarts, self.hint = policy, max_restarts, hint
        self.events: list[dict[str, Any]] = []
        self._restarts: Counter = Counter()  # ("worker" | "shard", id) -> restarts so far
        self._warned: set[str] = set()  # the kinds of event warned this run

    def warn_once(self, kind: str, message: str) -> None:
        """Warns ``message`` (a :class:`FailureWarning`) if it is the first event of ``kind``
        in this run; :func:`warn_summary` counts the later ones at the end of the run."""
        if kind not in self._warned:
            self._warned.add(kind)
            warn_user(message + "; later failures of this kind are counted at the end of the run")

    @property
    def restarts(self) -> int:
        """Restarts so far, of workers and shards."""
        return sum(self._restarts.values())

    def _event(self, kind: str, i: int, cause: str, time: float, action: str) -> None:
        self.events.append({kind: i, "time": time, "cause": cause, "action": action})

    def _budget_left(self, key: tuple[str, int]) -> bool:
        return self.max_restarts is None or self._restarts[key] < self.max_restarts

    def _fatal(self, what: str, cause: str, key: tuple[str, int], detail: str) -> str:
        n = self._restarts[key] + 1
        head = (
            f"{what} failed: {cause}"
            if self.policy == "fail"
            else f"{what} failed {'once' if n == 1 else f'{n} times'}, more than "
            f"max_restarts={self.max_restarts} allows; the last time: {cause}"
        )
        return head + (f"\n{detail.rstrip()}" if detail else "") + self.hint

    def worker(self, w: int, cause: str, *, time: float, detail: str = "") -> str:
        """Worker ``w`` failed (``cause``: how; ``detail``: its traceback, if any).

        Returns ``"restart"`` or ``"drop"``; raises :class:`WorkerError` when the
        policy is ``"fail"`` or the restart budget is spent.
        """
        key = ("worker", w)
        if self.policy == "fail" or (self.policy == "restart" and not self._budget_left(key)):
            self._event("worker", w, cause, time, "failed")
            raise WorkerError(self._fatal(f"worker {w}", cause, key, detail))
        if self.policy == "drop":
            self._event("worker", w, cause, time, "dropped")
            log.warning("worker %d failed (%s); dropped, the other workers carry on", w, cause)
            self.warn_once("worker", f"worker {w} failed ({cause}); dropped, the others carry on")
            return "drop"
        self._restarts[key] += 1
        self._event("worker", w, cause, time, "restarted")
        log.warning(
            "worker %d failed (%s); restarting it (restart %d%s)",
            w,
            cause,
            self._restarts[key],
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
        key = ("shard", k)
        if self.policy == "fail" or not self._budget_left(key):
            self._event("shard", k, cause, time, "failed")
            raise ShardError(self._fatal(f"shard {k}", cause, key, ""))
        self._restarts[key] += 1
        self._event("shard", k, cause, time, "restarted")
        log.warning("shard %d failed (%s); restarting it", k, cause)

    def shard_restarted(
        self, event: dict[str, Any], *, version: int | None = None, lost: int | None = None
    ) -> None:
        """The shard of ``event`` (:meth:`shard`'s) is back at ``version``, ``lost`` updates
        of its slice lost (None: unknown); the first shard restart of a run is warned."""
        event.update(lost=lost, version=version)
        at = "" if version is None else f" at version {version}"
        self.warn_once(
            "shard",
            f"shard {event['shard']} failed ({event['cause']}); restarted{at}, "
            f"{'an unknown number of' if lost is None else lost} updates of its slice lost, "
            "the workers restarted",
        )

    def left(self, w: int, cause: str, *, time: float) -> None:
        """Worker ``w`` left the job without failing (e.g. its node left an elastic Ray
        run): its id is free for a worker to come; no restart is counted."""
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
        """A checkpoint could not be written into ``directory`` (``cause``: the OS error;
        ``action``: what was kept; ``final``: the run's last one). The run goes on; the
        caller (:class:`stalewise.checkpoint.Saver`) has warned."""
        self.events.append(
            {"checkpoint": directory, "time": time, "cause": cause, "action": action}
            | {"final": final}
        )


#: How a run can end (:attr:`TrainResult.ended`): its budget of pushes spent, its
#: ``stop_at`` targets reached, or every worker failed and dropped (a run whose
#: workers all diverged raises :class:`DivergedError` instead).
ENDINGS = ("budget", "stop_at", "no_workers")


@dataclass
class TrainResult:
    """What :meth:`stalewise.Job.train` returns.

    ``ended`` says how the run ended in one word of :data:`ENDINGS`, for code
    (``result.ended == "budget"``); ``stop_reason`` says it in words, with what
    went wrong on the way (no push applied, a loss that is not finite at the end).
    """

    params: Any  # final parameters, in the structure and backend the job was made with
    flat: np.ndarray  # the same, as the flat vector
    records: list[dict] = field(default_factory=list)  # metrics records (see stalewise.report)
    stats: dict = field(default_factory=dict)  # shard counters merged (see merge_stats)
    time: float = 0.0  # seconds (wall clock, or virtual in the simulator)
    pushes: int = 0  # updates pushed by all workers
    failures: list[dict] = field(default_factory=list)  # what failed and what was done (Failures)
    stop_reason: str = ""  # why the run ended, in words
    ended: str = ""  # how, in one word (ENDINGS): "budget", "stop_at" or "no_workers"

    @property
    def restarts(self) -> int:
        """How many times a worker or shard was restarted during the run."""
        return sum(e["action"] == "restarted" for e in self.failures)

    def __repr__(self) -> str:
        """One line: pushes, updates, time and the last record's metrics (not the parameters)."""
        last = self.records[-1] if self.records else {}
        metrics = ", ".join(
            f"{k}={last[k]:.4g}" for k in ("loss", "accuracy") if isinstance(last.get(k), float)
        )
        return (
            f"TrainResult(pushes={self.pushes}, updates={self.stats.get('version', '?')}, "
            f"time={self.time:.4g}s, {self.flat.size} parameters"
            + (f", {metrics}" if metrics else "")
            + f", {len(self.records)} records)"
        )


def merge_stats(per_shard: Sequence[Mapping[str, Any]], *, settled: bool = False) -> dict[str, Any]:
    """Merges the shards' counters: per-push counters from shard 0, bytes summed.

    Under the commit rule (:mod:`stalewise.protocol.commit`) a push is applied
    by every shard or by none, so the per-push counters (``applied``,
    ``rejected`` by kind, ``duplicates``) are the same on every shard and are
    taken from shard 0, as are the version and the staleness; a push refused
    for NaN counts once, not once per shard. Bytes are per shard and add up.

    Mid-run, a push may have reached some shards and not yet the others, so
    their counters may differ for a moment. ``settled=True`` says no push is in
    flight (the run is over): then shards whose per-push counters differ from
    shard 0's are named in a warning, as that would be a torn push (a bug).

    Example:
        >>> s = {"applied": 3, "rejected": {"not_finite": 1}, "duplicates": 0,
        ...      "staleness_mean": 0.5, "staleness_max": 1, "bytes_in": 8, "bytes_out": 4}
        >>> m = merge_stats([s, s], settled=True)
        >>> m["applied"], m["rejected"], m["bytes_in"], m["shards"]
        (3, {'not_finite': 1}, 16, 2)
    """
    if not per_shard:
        return {}
    first = per_shard[0]

    def per_push(s: Mapping[str, Any]) -> tuple:
        # a Counter compares a missing kind equal to a zero count
        return s["applied"], Counter(s.get("rejected", {})), s.get("duplicates", 0)

    if settled:
        mine = per_push(first)
        torn = [k for k, s in enumerate(per_shard) if k and per_push(s) != mine]
        if torn:
            counts = "; ".join(
                f"shard {k}: applied {a}, rejected {dict(r)}, duplicates {d}"
                for k, (a, r, d) in ((k, per_push(per_shard[k])) for k in (0, *torn))
            )
            log.warning(
                "shard(s) %s disagree with shard 0 on the per-push counters, which the "
                "commit rule keeps equal (a torn push?): %s",
                ", ".join(map(str, torn)),
                counts,
            )
    return {
        "applied": first["applied"],
        "version": first.get("version", first.get("rounds", 0)),
        "rejected": dict(first.get("rejected", {})),
        "duplicates": first.get("duplicates", 0),
        "staleness_mean": first["staleness_mean"],
        "staleness_max": first["staleness_max"],
        "staleness_counts": dict(first.get("staleness_counts", {})),  # tau -> applied pushes
        "mode_switches": first.get("mode_switches", 0),  # hybrid consistency
        "bytes_in": sum(s["bytes_in"] for s in per_shard),
        "bytes_out": sum(s["bytes_out"] for s in per_shard),
        "shards": len(per_shard),
    }


def slowdowns(
    stragglers: Mapping[int, float] | Sequence[float] | None, workers: int
) -> list[float]:
    """Normalises a straggler setting to one slowdown factor (>= 1) per worker.

    ``{3: 4.0}`` makes worker 3 four times slower; a list gives every worker's factor.
    """
    factors = [1.0] * workers
    if stragglers is None:
        return factors
    items = stragglers.items() if isinstance(stragglers, Mapping) else enumerate(stragglers)
    if not isinstance(stragglers, Mapping) and len(stragglers) != workers:
        raise ValueError(f"stragglers lists {len(stragglers)} factors for {workers} workers")
    for w, f in items:
        if not (isinstance(w, int) and 0 <= w < workers):
            raise ValueError(f"stragglers: unknown worker {w!r} (workers are 0..{workers - 1})")
        if not (isinstance(f, int | float) and not isinstance(f, bool) and 1 <= f <= MAX_SLOWDOWN):
            raise ValueError(
                f"stragglers[{w}]: slowdown factor must be a number in [1, {MAX_SLOWDOWN:g}], "
                f"got {f!r}"
            )
        factors[w] = float(f)
    return factors


#: The largest straggler factor (``train(stragglers=...)``): a worker this many times slower.
MAX_SLOWDOWN = 1e4
#: The longest extra delay per step (``train(delays=...)``), in seconds.
MAX_DELAY = 3600.0


def check_run(
    workers: Any, steps: Any, data: Any, stragglers: Any, delays: Mapping[int, float] | None
) -> tuple[list[float], list[float]]:
    """Checks the arguments every runtime's ``train`` shares.

    Returns:
        ``(slowdown factor per worker, extra delay in seconds per worker)``.
    """
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1, got {workers!r}")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if not callable(data) and len(data) != workers:
        raise ValueError(f"data has {len(data)} per-worker shards for {workers} workers")
    extra = [0.0] * workers
    for w, d in (delays or {}).items():
        if not (isinstance(w, int) and 0 <= w < workers) or not (
            isinstance(d, int | float) and not isinstance(d, bool) and 0 <= d <= MAX_DELAY
        ):
            raise ValueError(
                f"delays[{w!r}] = {d!r}: need a worker id in 0..{workers - 1} and seconds "
                f"in [0, {MAX_DELAY:g}]"
            )
        extra[w] = float(d)
    return slowdowns(stragglers, workers), extra


PLAIN_EVERY = 10.0  # seconds between progress lines when output is not a terminal


def end_reason(
    recorder: Recorder,
    failures: Failures,
    *,
    pushes: int,
    steps: int,
    budget_spent: bool,
    diverged: Sequence[int],
    stats: dict,
    version: int | None = None,
    run: str = "",
) -> tuple[str, str]:
    """How and why a run ended, in every runtime: ``(ended, reason)``, ``ended`` one of
    :data:`ENDINGS` (:attr:`TrainResult.ended`), ``reason`` in words.

    The recorder's reason (``stop_at`` reached), else the budget of ``steps``
    pushes (``budget_spent``: a worker's loop ended with it), else, when no worker
    is left: :class:`DivergedError` if some diverged (the last cause in
    ``failures``), or every worker failed and was dropped. A run that pushed but
    had no push applied (the merged shard ``stats``), or whose last record has a
    loss that is not finite (NaN, inf), says so in the reason and with a
    :class:`FailureWarning`: it is not a silent success.
    """
    if recorder.stop_reason:
        ended, reason = "stop_at", recorder.stop_reason
    elif pushes >= steps or budget_spent:
        ended, reason = "budget", f"the budget of {steps} pushes is spent"
    elif diverged:
        last = next(e["cause"] for e in reversed(failures.events) if e["action"] == "diverged")
        at = f" (version {version})" if version is not None else ""
        raise DivergedError(
            f"training diverged: worker(s) {', '.join(map(str, sorted(diverged)))} stopped because "
            f"their pushes kept being refused ({last}); no worker is left, after {pushes} of "
            f"{steps} pushes. The parameters are unchanged by refused pushes{at}; lower the "
            "learning rate or clip the gradients."
        )
    else:
        ended = "no_workers"
        reason = f"every worker failed and was dropped, after {pushes} of {steps} pushes"
        log.error("%s: %s", run, reason)
    if pushes and not stats["applied"]:  # diverge_after=None lets such a run reach its end
        reason += f"; no push was applied, every one was refused ({stats['rejected']})"
        log.warning("%s: %s", run, reason)
        warn_user(f"{run}: {reason}")
        return ended, reason
    last = recorder.records[-1] if recorder.records else {}
    bad = [k for k in ("loss", "train_loss") if isinstance(last.get(k), float)]
    bad = [k for k in bad if not math.isfinite(last[k])][:1]
    if bad:  # refusals do not catch a NaN loss whose pushes are finite, nor diverge_after=None
        reason += (
            f"; the {bad[0].replace('_', ' ')} at the end is {last[bad[0]]}: training diverged "
            "(lower the learning rate or clip the gradients)"
        )
        log.warning("%s: %s", run, reason)
        warn_user(f"{run}: {reason}")
    return ended, reason


class Recorder:
    """A run's metrics records: builds them, shows progress, says when to stop.

    Every runtime records the same schema (see :mod:`stalewise.report`), so a
    simulated run and a real one of the same job compare line by line.

    ``stop_at`` is anything :func:`stalewise.targets.parse` accepts; the run stops
    at the first record that reaches every target. A runtime calls
    :meth:`finish` with why the run ended, which the progress output says.
    Progress is a tqdm bar on a terminal, and one plain line every
    ``PLAIN_EVERY`` seconds otherwise (logs are not flooded with redraws).

    Example:
        >>> r = Recorder("run", 10, stop_at={"loss": 1e-3})
        >>> stats = {"version": 1, "staleness_mean": 0.0, "staleness_max": 0}
        >>> r.record(0.1, 1, stats, 0.5, None, dict), r.record(0.2, 2, stats, 1e-4, None, dict)
        (False, True)
    """

    def __init__(
        self,
        run: str,
        steps: int,
        *,
        stop_at: targets.StopAt = None,
        on_record: Callable[[dict], None] | None = None,
        progress: bool = False,
    ):
        self.run = run
        self.steps = steps
        self.stop_at = targets.parse(stop_at)
        self.on_record = on_record
        self.records: list[dict] = []
        self.stop_reason: str | None = None  # set when stop_at is reached
        self.bar = None
        self.plain = progress and not sys.stderr.isatty()  # one line now and then, no bar
        self._printed_at = -math.inf
        self._pushes = 0
        if progress and not self.plain:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=steps, desc=run, unit="push", leave=True)

    def progress(self, pushes: int) -> None:
        self._pushes = pushes
        if self.bar is not None:
            self.bar.update(min(pushes, self.steps) - self.bar.n)
        elif self.plain and _time.monotonic() - self._printed_at >= PLAIN_EVERY:
            self._printed_at = _time.monotonic()
            last = self.records[-1] if self.records else {}
            metrics = "".join(
                f", {k} {last[k]:.4g}"
                for k in ("loss", "accuracy")
                if isinstance(last.get(k), float)
            )
            print(f"{self.run}: {pushes}/{self.steps} pushes{metrics}", file=sys.stderr, flush=True)

    def finish(self, reason: str) -> None:
        """Says why the run ended (after the last record), on the progress output and the log."""
        line = f"{self.run}: stopped after {self._pushes} pushes: {reason}"
        log.info("%s", line)
        if self.bar is not None:
            self.bar.close()
            self.bar.write(line, file=sys.stderr)
        elif self.plain:
            print(line, file=sys.stderr, flush=True)

    def record(
        self,
        time: float,
        pushes: int,
        stats: Mapping[str, Any],
        train_loss: float,
        evaluate: Callable[[Any], Mapping[str, float]] | None,
        params: Callable[[], Any],
    ) -> bool:
        """Makes and keeps one record; returns True when ``stop_at`` is reached."""
        rec: dict[str, Any] = {
            "run": self.run,
            "time": time,
            "updates": stats["version"],
            "pushes": pushes,
            "train_loss": train_loss,
            "staleness_mean": stats["staleness_mean"],
            "staleness_max": stats["staleness_max"],
        }
        if "workers" in stats:  # the live workers, from a runtime whose count may change
            rec["workers"] = stats["workers"]
        if evaluate is not None:
            rec.update({k: float(v) for k, v in evaluate(params()).items()})
        else:
            rec["loss"] = train_loss
        self.records.append(rec)
        if self.on_record:
            self.on_record(rec)
        self.progress(pushes)
        if self.bar is not None:
            self.bar.set_postfix({k: f"{rec[k]:.3g}" for k in ("loss", "accuracy") if k in rec})
        if targets.all_reached(self.stop_at, rec):
            self.stop_reason = " and ".join(map(str, self.stop_at)) + " reached"
            return True
        return False

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def worker_range(workers: Any) -> tuple[int, int]:
    """``(expected, room)`` from ``workers=N`` (N of N) or ``workers=(min, max)``."""
    if isinstance(workers, tuple | list) and len(workers) == 2:
        lo, hi = workers
    else:
        lo = hi = workers
    ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (lo, hi))
    if not (ok and 0 <= lo <= hi and hi >= 1):
        raise ValueError(
            f"workers must be an int >= 1 or (min, max) with 0 <= min <= max, max >= 1; "
            f"got {workers!r}"
        )
    return lo, hi
