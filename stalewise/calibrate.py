"""Calibration: measure on this machine what the simulator needs, and write its ``[sim]`` table.

:func:`calibrate` (``Job.calibrate``, ``stalewise calibrate CONFIG``) times compute, apply,
pulls, pushes, contention and the worker loop into a :class:`Calibration`; docs/calibrate.md.

Example:
    >>> from stalewise.calibrate import table_toml
    >>> print(table_toml({"compute": "fixed", "step_time": 0.002, "latency": 5e-05}), end="")
    [sim]
    compute = "fixed"
    step_time = 0.002
    latency = 5e-05
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import numpy as np

from stalewise import runtime as runtime_lib
from stalewise import tree
from stalewise.options import Metrics, Timeouts
from stalewise.protocol import PushHeader, ServerConfig, pipeline
from stalewise.runtime.base import MAX_DELAY
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import MAX_SECONDS, MIN_BYTES_PER_S, Contention

__all__ = ["Calibration", "Fit", "Interval", "Spread", "busy_warnings", "calibrate", "table_toml"]

log = logging.getLogger(__name__)

Steps = tuple[tuple[float, ...], ...]  # each worker's step times, seconds

#: How far apart (either way) a worker's median step must be from the others' for a ``speeds`` entry.
SPEED_FACTOR = 2.0
FIXED_BELOW = 0.01  #: A tail's mean below this fraction of the shift: compute ``"fixed"``.
REPEATS = 30  #: Timed repeats of one measurement, the default.
#: The fewest and the most timed repeats (``repeats``, ``stalewise calibrate --repeats``).
MIN_REPEATS, MAX_REPEATS = 3, 10_000
MAX_TIMEOUT = 86_400.0  #: The most seconds the compute processes may take (``timeout``): a day.
MIN_SIZE = 4096  #: The smallest parameter count of the two transport and apply sizes.
#: A copy of the larger size this long (s) or more: the shard's CPU per push gives the apply's copies.
SHARD_COPY = 1e-3
#: Busy seconds of each step of the worker-loop measurement, and its steps.
LOOP_COMPUTE, LOOP_STEPS = 0.002, 300
LOOP_WINDOW = 10  #: The fewest pushes a window of the worker-loop measurement holds.
#: Step times whose interquartile range exceeds this fraction of their median are warned about.
SPREAD_LIMIT = 0.5
#: Seconds the contention measurement times steps at each count of runnable processes
#: (the apply and the sleeps: half as long); and the most processes it counts to.
CONTENTION_SECONDS, MOST_PROCESSES = 0.2, 16
#: Seconds a process must not run to count as idle: a stage's CPU is timed with none beside it.
SETTLE = 0.005
WAKE_SLEEP = 0.002  #: Seconds of the contention measurement's sleep after a step (no delay given).
#: The bounds :meth:`Calibration.sim_config` takes: measured (None), 25th or 75th percentile.
BOUNDS = (None, "low", "high")
#: What a Ray calibration times elsewhere, said in its summary and logged.
ON_RAY = (
    "runtime ray: pulls, pushes, the shard's time per push (its actor's: the apply and the "
    "snapshots it published, the object store's copy) and the worker loop are timed on Ray; "
    "the compute and the contention for the cores in processes of this machine, not in Ray "
    "actors (a local Ray cluster's actors share these cores; another machine's are not measured)"
)


@dataclass(frozen=True)
class Spread:
    """The spread of one measured figure over its repeats, seconds.

    Example:
        >>> s = Spread.of([1.0, 2.0, 3.0, 4.0, 5.0])
        >>> s.low, s.median, s.high, s.min, s.max, s.relative
        (2.0, 3.0, 4.0, 1.0, 5.0, 0.6666666666666666)
    """

    low: float  # the 25th percentile
    median: float
    high: float  # the 75th percentile
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, xs: Sequence[float]) -> Spread:
        a = np.asarray(xs, dtype=float)
        if a.size == 0:
            raise ValueError("Spread.of: no values")
        q25, q50, q75 = (float(q) for q in np.quantile(a, [0.25, 0.5, 0.75]))
        return cls(q25, q50, q75, float(a.min()), float(a.max()), int(a.size))

    @property
    def relative(self) -> float:
        """The interquartile range over the median (0 for a median of 0)."""
        return (self.high - self.low) / self.median if self.median > 0 else 0.0

    def at(self, bound: str | None) -> float:
        """The median (None), the 25th percentile ("low") or the 75th ("high")."""
        return {None: self.median, "low": self.low, "high": self.high}[bound]

    def text(self, scale: float = 1e6, unit: str = "us") -> str:
        """``median [25th, 75th] unit (min .., max .., n repeats)``."""
        return (
            f"{self.median * scale:.4g} [{self.low * scale:.4g}, {self.high * scale:.4g}] {unit} "
            f"(min {self.min * scale:.4g}, max {self.max * scale:.4g}, {self.n} repeats)"
        )


class Interval(NamedTuple):
    """A prediction and its interval: :meth:`Calibration.interval`'s answer.

    Example:
        >>> str(Interval(176.2, 150.0, 205.4))
        '176.2 [150, 205.4]'
    """

    point: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.point:.4g} [{self.low:.4g}, {self.high:.4g}]"


def busy_warnings(
    step_times: Sequence[Sequence[float]],
    load: Sequence[float],
    load_end: Sequence[float] | None = None,
    cores: int | None = None,
    limit: float = SPREAD_LIMIT,
) -> list[str]:
    """Why the machine was too busy for a stable figure, one sentence each: the 1-minute load
    average (``load``, ``load_end``) above ``cores``, or a worker's step times whose interquartile
    range exceeds ``limit`` times their median.

    Example:
        >>> busy_warnings([[0.010, 0.011, 0.010, 0.012]], load=(0.5, 0.5, 0.5), cores=2)
        []
        >>> busy_warnings([[0.010, 0.030, 0.010, 0.030]], load=(3.0, 1, 1), cores=2)[0]
        'the load average was 3.00 on 2 cores: other processes took CPU time from the measurement'
    """
    cores = cores or os.cpu_count() or 1
    out = []
    peak = max(load[0], load_end[0] if load_end is not None else 0.0)
    if peak > cores:
        out.append(
            f"the load average was {peak:.2f} on {cores} cores: other processes took CPU "
            "time from the measurement"
        )
    for w, t in enumerate(step_times):
        s = Spread.of(t)
        if s.relative > limit:
            out.append(
                f"worker {w}'s step times spread {s.relative:.0%} of their median (25th-75th "
                f"percentile {s.low * 1e3:.3g}-{s.high * 1e3:.3g} ms, above {limit:.0%}): "
                "the compute time is not a stable figure"
            )
    return out


@dataclass(frozen=True)
class Fit:
    """``seconds = intercept + slope * bytes``, fitted to medians measured at some sizes."""

    intercept: float
    slope: float
    points: tuple[tuple[int, float], ...] = ()  # (bytes, median seconds)

    @classmethod
    def of(cls, points: Sequence[tuple[int, float]]) -> Fit:
        """The least-squares line through ``points`` (bytes, seconds), slope and intercept >= 0."""
        x = np.array([p[0] for p in points], dtype=float)
        y = np.array([p[1] for p in points], dtype=float)
        slope = max(float(np.polyfit(x, y, 1)[0]), 0.0) if len(set(x.tolist())) > 1 else 0.0
        intercept = float(y.mean() - slope * x.mean())
        if intercept < 0:
            intercept, slope = 0.0, float((x * y).sum() / (x * x).sum())
        return cls(intercept, slope, tuple((int(b), float(s)) for b, s in points))

    def __call__(self, nbytes: float) -> float:
        return self.intercept + self.slope * nbytes


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate` measured, and the ``[sim]`` table it makes of it (docs/calibrate.md).

    Attributes (None: not measured):
        workers, threads: the processes that computed at once, and each one's thread cap.
        step_times, cpu_times: each worker's timed steps, wall-clock and CPU seconds.
        apply, pull, push, send: bytes -> seconds of the shard's apply per push, a pull, a
            push's round trip and the part of it the worker waits for.
        message: ``send + pull`` (less ``2 * apply`` for a pull served by the shard), fitted.
        served: whether the measured pull was a request served behind the push.
        model_bytes, optimizer: the job's parameter bytes and server optimizer (text).
        load, load_end: the load averages when it started and ended.
        evaluated: seconds between evaluations while the compute was timed.
        loop: a worker's own seconds per push besides compute, inner updates, send and pull.
        inner: a strategy's seconds per local step besides the gradient.
        own_read: the share of pushes the next pull already held.
        spreads: each timed figure's :class:`Spread` over its repeats, by name.
        contention: the factors and a sleep's lateness with 1, 2, ... processes runnable.
        runtime: the runtime transport, shard and worker loop were timed on.
        copy: one copy's seconds by bytes (the table then charges bytes as copies).
        bus: the copies at once the memory bus moves with every core copying, and the cores.
        cpu: CPU seconds by bytes of the ``"pull"``, the ``"send"`` and a local ``"shard"``'s push.
    """

    workers: int
    threads: int
    step_times: Steps
    apply: Fit
    pull: Fit
    push: Fit
    message: Fit
    model_bytes: int
    optimizer: str = ""
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    send: Fit | None = None
    served: bool = False
    evaluated: float | None = None
    loop: float | None = None
    own_read: float | None = None
    inner: float | None = None
    spreads: tuple[tuple[str, Spread], ...] = ()
    load_end: tuple[float, float, float] | None = None
    contention: Contention | None = None
    cpu_times: Steps = ()
    wall_spread: bool = False
    runtime: str = "local"
    copy: Fit | None = None
    cpu: dict[str, Fit] | None = None
    bus: tuple[float, int] | None = None

    # -- the compute model -------------------------------------------------------------

    @property
    def compute_times(self) -> Steps:
        """The step times the compute model is fitted to: CPU with :attr:`contention`, else wall."""
        if self.contention is None or not self.cpu_times:
            return self.step_times
        if not self.wall_spread:
            return self.cpu_times
        return tuple(tuple(x * sum(c) / sum(w) for x in w)
                     for w, c in zip(self.step_times, self.cpu_times, strict=True))  # fmt: skip

    @property
    def shift(self) -> float:
        """The fastest step of any worker (:attr:`compute_times`), seconds."""
        return min(min(t) for t in self.compute_times)

    @property
    def mean(self) -> float:
        """The mean step time over all workers (:attr:`compute_times`), seconds."""
        return float(np.mean([x for t in self.compute_times for x in t]))

    def speeds(self) -> tuple[float, ...] | None:
        """Each worker's speed relative to the others, by medians; None when no worker is
        :data:`SPEED_FACTOR` apart from the others and outside their interquartile range."""
        means = [float(np.median(t)) for t in self.compute_times]
        overall = float(np.median([x for t in self.compute_times for x in t]))
        if len(means) < 2 or not any(self._apart(w, m) for w, m in enumerate(means)):
            return None
        return tuple(round(overall / m, 4) for m in means)

    def _apart(self, w: int, median: float) -> bool:
        """Whether worker ``w``'s median step is set apart from the other workers' steps."""
        others = [x for i, t in enumerate(self.compute_times) if i != w for x in t]
        low, mid, high = np.quantile(others, [0.25, 0.5, 0.75])
        if 1 / SPEED_FACTOR < median / mid < SPEED_FACTOR:
            return False
        return bool(median < low or median > high)

    def table(self) -> dict[str, Any]:
        """The ``[sim]`` table, as :meth:`SimConfig.from_dict` reads it."""
        t: dict[str, Any] = {}
        shift, tail = self.shift, self.mean - self.shift
        inner = self.inner or 0.0  # a strategy's own work: every local step has it
        if tail <= FIXED_BELOW * shift:
            t |= {"compute": "fixed", "step_time": _sig(self.mean + inner)}
        else:
            t |= {"compute": "exponential", "shift": _sig(shift + inner), "rate": _sig(1.0 / tail)}
        if self.loop:  # the worker loop's own time: once a push, at no worker's pace
            t["loop"] = _sig(self.loop)
        speeds = self.speeds()
        if speeds is not None:
            t["speeds"] = list(speeds)
        # with a copy measured, bytes cost copies on the cores, not link or service rates
        copies = self.copy is not None and self.copy.slope > 0
        cpu = self.cpu if copies and self.cpu else None
        fixed = 0.0 if cpu is None else cpu["pull"].intercept + cpu["send"].intercept
        t["latency"] = _sig(min(max(0.0, self.message.intercept - fixed) / 2, MAX_SECONDS))
        t["bandwidth"] = math.inf if copies else _rate(self.message.slope)
        apply = (self.shard_apply if copies else None) or self.apply  # a local shard's CPU
        t["service_time"] = _sig(min(apply.intercept, MAX_SECONDS))
        t["service_rate"] = math.inf if copies else _rate(self.apply.slope)
        if self.contention is not None:
            t["contention_step"] = list(self.contention.step)
            t["contention_apply"] = list(self.contention.apply)
            if self.contention.wake:
                t["contention_wake"] = list(self.contention.wake)
        if self.own_read is not None:
            t["own_read"] = round(self.own_read, 3)
        if copies:
            per = self.copy.slope
            t["copy_rate"] = _rate(per)
            if self.bus is not None:  # the stages' CPU was timed alone: they share the bus here
                t["copy_bus"], t["copy_cores"] = _sig(t["copy_rate"] * self.bus[0]), self.bus[1]
            pull, push = (
                (self.pull, self.send or self.push) if cpu is None else (cpu["pull"], cpu["send"])
            )
            for key, fit in (("pull", pull), ("push", push), ("apply", apply)):
                t[f"copy_{key}"] = _sig(min(fit.slope / per, 1e6))
            if cpu is not None:
                t["copy_pull_time"] = _sig(min(cpu["pull"].intercept, MAX_SECONDS))
                t["copy_push_time"] = _sig(min(cpu["send"].intercept, MAX_SECONDS))
        return t

    @property
    def shard_apply(self) -> Fit | None:
        """The shard process's CPU per push, when it gives the apply's copies (:data:`SHARD_COPY`)."""
        copy = self.copy.points if self.copy is not None else ()
        return (self.cpu or {}).get("shard") if copy and max(copy)[1] >= SHARD_COPY else None

    def sim_config(self, bound: str | None = None) -> SimConfig:
        """The table as the simulator reads it; ``bound="low"`` (``"high"``): every measured
        time at its 25th (75th) percentile over the repeats."""
        return SimConfig.from_dict(self.bounded(bound).table())

    def spread(self, name: str) -> Spread | None:
        """The :class:`Spread` of the figure ``name`` (a key of :attr:`spreads`), or None."""
        return dict(self.spreads).get(name)

    def bounded(self, bound: str | None) -> Calibration:
        """This calibration at ``bound`` (see :meth:`sim_config`; None: itself)."""
        if bound not in BOUNDS:
            raise ValueError(f"bound = {bound!r}: must be one of {BOUNDS}")
        if bound is None:
            return self

        def scaled(times: Steps) -> Steps:
            if not times:
                return times
            pooled = Spread.of([x for t in times for x in t])
            f = pooled.at(bound) / pooled.median if pooled.median > 0 else 1.0
            return tuple(tuple(x * f for x in t) for t in times)

        def fit(name: str, measured: Fit) -> Fit:
            spreads = [self.spread(_key(name, b)) for b, _ in measured.points]
            if not measured.points or any(s is None for s in spreads):
                return measured
            pts = [(b, s.at(bound)) for (b, _), s in zip(measured.points, spreads, strict=True)]
            return Fit.of(pts)

        loop = self.spread("worker loop")
        return replace(
            self,
            step_times=scaled(self.step_times),
            cpu_times=scaled(self.cpu_times),
            apply=fit("apply", self.apply),
            message=fit("message", self.message),
            loop=self.loop if loop is None else loop.at(bound),
        )

    def interval(self, predict: Callable[[SimConfig], Any]) -> Any:
        """``predict`` (``SimConfig -> number``, or a dict of numbers) on the measured table and on
        the low and high ones (:meth:`sim_config`), as an :class:`Interval` (or a dict of them)
        spanning all three; None if a value is None on any table (docs/calibrate.md)."""
        point, low, high = (predict(self.sim_config(b)) for b in BOUNDS)
        if isinstance(point, dict):
            return {k: _interval(point[k], low.get(k), high.get(k)) for k in point}
        return _interval(point, low, high)

    def warnings(self, cores: int | None = None) -> list[str]:
        """:func:`busy_warnings` of this calibration's step times and load averages."""
        return busy_warnings(self.step_times, self.load, self.load_end, cores)

    def summary(self) -> str:
        """What was measured, in lines of text."""
        us = 1e6
        beside = "" if self.evaluated is None else f", evaluated every {self.evaluated:g} s beside"
        lines = [
            f"compute: {self.workers} worker process(es) at once, {self.threads} math "
            f"thread(s) each{beside}; load average {self.load[0]:.2f} {self.load[1]:.2f} "
            f"{self.load[2]:.2f} on {os.cpu_count()} cores"
        ]
        for w, t in enumerate(self.step_times):
            a = np.asarray(t)
            cpu = f", CPU mean {np.mean(self.cpu_times[w]) * 1e3:.3f} ms" if self.cpu_times else ""
            lines.append(
                f"  worker {w}: {len(a)} steps, mean {a.mean() * 1e3:.3f} ms, min "
                f"{a.min() * 1e3:.3f} ms, p90 {np.quantile(a, 0.9) * 1e3:.3f} ms{cpu}"
            )
        on_cluster = _on_cluster(self.runtime)
        if on_cluster:
            lines.append(ON_RAY)
        shard = "shard actor's time a push" if on_cluster else "shard apply"
        pull = "pull (served behind the push)" if self.served else "pull (snapshot read)"
        fits = [(f"{shard} ({self.optimizer})", self.apply), (pull, self.pull)]
        fits += [("push round trip", self.push), ("push send", self.send)]
        for name, fit in fits:
            if fit is not None:
                points = ", ".join(f"{b:,} B {s * us:.1f} us" for b, s in fit.points)
                rate = f"{fit.intercept * us:.1f} us + bytes / {_rate(fit.slope):.3g} B/s"
                lines.append(f"{name}: {points} -> {rate}")
        if self.loop is not None:
            lines.append(
                f"worker loop: {self.loop * us:.1f} us a push besides compute, send and pull "
                f"(one {self.runtime} worker, local steps of {LOOP_COMPUTE * 1e3:g} ms), "
                "charged once a push"
            )
        if self.inner is not None:
            lines.append(
                f"strategy: {self.inner * us:.1f} us a local step besides the gradient (its "
                "inner update, timed in this process), added to the compute"
            )
        if self.own_read is not None:
            lines.append(
                f"own push read: {self.own_read:.0%} of that worker's snapshot reads right "
                "after a push already held it"
            )
        lines.append(
            f"per pull besides the shard: {self.message.intercept * us:.1f} us + bytes / "
            f"{_rate(self.message.slope):.3g} B/s (latency = half the fixed part); "
            f"this job's model: {self.model_bytes:,} B"
        )
        t = self.table()
        if "copy_rate" in t:  # a copy measured, and bytes charged as copies
            lines.append(
                f"copies: one process copies {_rate(self.copy.slope):.3g} B/s; a pull costs "
                f"{t.get('copy_pull')} copies of its bytes, a send {t.get('copy_push')}, an apply "
                f"{t.get('copy_apply')}{' with its publish' * (self.shard_apply is not None)}, "
                "each timed alone, charged to the cores"
                + (f" and a bus of {t['copy_bus']:.3g} B/s" if "copy_bus" in t else "")
            )
        if self.contention is not None:
            c = self.contention
            lines.append(
                f"contention: with 1, 2, ... {len(c.step)} processes runnable, a step takes "
                f"{list(c.step)}x and an apply {list(c.apply)}x its CPU time, a sleep ends "
                f"{list(c.wake)} s late; the table's compute is the steps' CPU time"
            )
        if self.spreads or self.step_times:
            lines.append("spread over the repeats: median [25th, 75th percentile] (min, max)")
            for w, t in enumerate(self.step_times):
                lines.append(f"  step time, worker {w}: {Spread.of(t).text(1e3, 'ms')}")
            for name, s in self.spreads:
                lines.append(f"  {name}: {s.text()}")
        if self.load_end is not None:
            lines.append(
                f"load average at the end {self.load_end[0]:.2f} {self.load_end[1]:.2f} "
                f"{self.load_end[2]:.2f}"
            )
        lines.extend(f"WARNING: {w}" for w in self.warnings())
        return "\n".join(lines)

    def toml(self, comment: bool = True) -> str:
        """The ``[sim]`` table as TOML, with :meth:`summary` as comments above it."""
        head = ""
        if comment:
            head = "".join(f"# {line}\n" for line in self.summary().splitlines())
            head = "# measured by stalewise calibrate\n" + head
        return head + table_toml(self.table())


def table_toml(table: dict[str, Any]) -> str:
    """A flat ``[sim]`` table of numbers, strings and lists of numbers, as TOML."""
    lines = ["[sim]"]
    for key, value in table.items():
        lines.append(f"{key} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    return repr(v)


def _key(name: str, nbytes: int) -> str:
    """The :attr:`Calibration.spreads` key of figure ``name`` timed at ``nbytes``."""
    return f"{name} {nbytes:,} B"


def _interval(point: Any, low: Any, high: Any) -> Interval | None:
    if point is None or low is None or high is None:
        return None
    values = [float(point), float(low), float(high)]
    return Interval(float(point), min(values), max(values))


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (the measurements hold no more)."""
    return float(f"{x:.4g}")


def _rate(slope: float) -> float:
    """Bytes per second of a fitted seconds-per-byte slope (inf for 0), within the bounds."""
    if slope <= 0:
        return math.inf
    return max(_sig(1.0 / slope), MIN_BYTES_PER_S)


# -- compute --------------------------------------------------------------------------


def _compute_main(
    loss_and_grad, data, spec, init, w, workers, repeats, warmup, delay, conn, contend=False
):
    """A compute process: times worker ``w``'s steps; with ``contend``, answers ``("time", s)``."""
    from stalewise.runtime.base import batch_iterator
    from stalewise.runtime.local.procs import die_with_parent

    die_with_parent()
    try:
        flat = np.array(init, copy=True)  # the worker's pull buffer
        batches = batch_iterator(data, w, workers)
        out = np.empty(spec.size, init.dtype)

        def step(batch: Any) -> None:  # as the worker loop: on its pull buffer
            grads = loss_and_grad(tree.unflatten(flat, spec, copy=False), batch)[1]
            tree.flatten(grads, spec=spec, out=out)

        for _ in range(warmup):  # a JIT compile, the data's first load: not a step
            step(next(batches))
        conn.send(("ready", w))
        if conn.recv() != "go":  # every worker is warmed up: the timed steps run together
            return
        walls, cpus = [], []
        for _ in range(repeats):
            batch = next(batches)  # drawing a batch is part of a worker's step too
            t, c = time.perf_counter(), time.process_time()
            step(batch)
            if delay > 0:  # as the local worker sleeps an emulated delay
                time.sleep(delay)
            cpus.append(time.process_time() - c)
            walls.append(time.perf_counter() - t - delay)
        conn.send(("times", (walls, cpus)))
        while contend and (msg := conn.recv())[0] == "time":
            n, t, c = 0, time.perf_counter(), time.process_time()
            end = t + msg[1]
            while n < 3 or time.perf_counter() < end:
                step(next(batches))
                n += 1
            wall, cpu, late = time.perf_counter() - t, time.process_time() - c, []
            end, nap = time.perf_counter() + msg[1] / 2, delay or WAKE_SLEEP
            while len(late) < 3 or time.perf_counter() < end:  # a step, then a sleep: its end
                step(next(batches))
                s = time.perf_counter()
                time.sleep(nap)
                late.append(max(time.perf_counter() - s - nap, 0.0))
            conn.send(("mean", wall / n, cpu / n, statistics.median(late)))
    except BaseException as e:  # reported in the parent, one line
        conn.send(("error", f"worker {w}: {type(e).__name__}: {e}"))


def measure_compute(
    config: ServerConfig,
    loss_and_grad: Callable,
    data: Any,
    workers: int,
    repeats: int,
    warmup: int = 2,
    timeout: float = 600.0,
    delays: Sequence[float] | None = None,
    evaluate: Callable | None = None,
    eval_interval: float | None = None,
    contention: int = 0,
) -> tuple[Steps, Steps, int, Contention | None]:
    """Each worker's step times, wall-clock and CPU, timed in ``workers`` processes at once;
    their thread cap; and with ``contention`` > 0, the :class:`Contention` for 1 to that
    many runnable processes (else None). ``delays``, ``evaluate``: as :func:`calibrate`'s."""
    from stalewise.runtime.local.procs import Capped, thread_budget, thread_share

    ctx = multiprocessing.get_context("spawn")
    threads = thread_share(workers)
    procs, conns = [], []
    with thread_budget(threads):
        for w in range(workers):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(
                target=_compute_main,
                args=(loss_and_grad, data, config.spec, config.init, w, workers, repeats, warmup,
                      0.0 if delays is None else float(delays[w]), theirs,
                      w == 0 and contention > 0),
                name=f"stalewise-calibrate-{w}",
                daemon=True,
            )  # fmt: skip
            p.start()
            theirs.close()
            procs.append(p)
            conns.append(mine)
    try:
        deadline = time.monotonic() + timeout
        params = None if evaluate is None else tree.unflatten(config.init, config.spec)
        evaluate = None if evaluate is None else Capped(evaluate, threads)  # as the runtime's
        beside = 0.0
        for kind in ("ready", "times"):
            if kind == "times":
                if evaluate is not None:
                    evaluate(params)  # its first call may load data or compile: not timed
                for c in conns:
                    c.send("go")
                if evaluate is not None:
                    beside = _observe(conns, evaluate, params, eval_interval, deadline)
            got = [_recv(c, deadline, p)[1] for c, p in zip(conns, procs, strict=True)]
        measured = None
        if contention > 0:
            for p in procs[1:]:  # done: they must not be runnable while it is measured
                p.join(max(0.0, deadline - time.monotonic()))
            measured = measure_contention(config, contention, conns[0], deadline, beside)
        walls, cpus = (tuple(tuple(w[i]) for w in got) for i in (0, 1))
        return walls, cpus, threads, measured
    finally:
        if contention > 0:
            with contextlib.suppress(OSError):
                conns[0].send(("stop",))  # worker 0 waits for commands until then
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        for c in conns:
            c.close()


def _observe(
    conns: list, evaluate: Callable, params: Any, interval: float, deadline: float
) -> float:
    """Evaluates ``params`` every ``interval`` seconds until the times come; its share of a core."""
    from multiprocessing import connection

    t0, k, c0 = time.monotonic(), 0, time.process_time()
    while time.monotonic() < deadline and not all(c.poll(0) for c in conns):
        evaluate(params)
        now = time.monotonic()
        k = max(k + 1, math.floor((now - t0) / interval) + 1)
        while (left := t0 + k * interval - time.monotonic()) > 0:
            if all(c.poll(0) for c in conns):
                break
            connection.wait(conns, min(left, 0.01))
    return (time.process_time() - c0) / max(time.monotonic() - t0, 1e-9)


# -- the shard's apply time -----------------------------------------------------------


def _synthetic_job(job: Any, size: int, shards: int) -> Any:
    """A job like ``job`` over one leaf of ``size`` floats."""
    config = job.config
    return type(job)({"w": np.zeros(size, np.float32)}, optimizer=config.optimizer, shards=shards,
                     consistency=config.consistency, staleness=config.staleness,
                     codec=config.codec)  # fmt: skip


def apply_times(config: ServerConfig, size: int, repeats: int) -> list[float]:
    """Seconds one shard takes to handle a push of ``size`` floats (undo copy included)."""
    push = _pusher(config, size)
    times = []
    for i in range(repeats + 2):
        t = time.perf_counter()
        push()
        if i >= 2:  # the first two warm the caches
            times.append(time.perf_counter() - t)
    return times


def _pusher(config: ServerConfig, size: int) -> Callable[[], None]:
    """A call that makes one shard of ``config`` over ``size`` floats handle a push."""
    flat, spec = tree.flatten({"w": np.zeros(size, np.float32)})  # as _synthetic_job's
    cfg = replace(config, spec=spec, init=flat, shards=1, pull_codec=None)
    shard = cfg.build_shard(0, cfg.init.copy(), 1)
    shard.warm_up()
    shard.join(0, 1)
    grad = np.random.default_rng(0).normal(scale=1e-3, size=size).astype(np.float32)
    comp = cfg.compressor()
    payload: Any = grad
    if comp is not None:
        payload = [bytearray(comp.nbytes(0, grad.dtype))]
        comp.encode_into(grad, payload, comp.init(grad.dtype))
        payload = payload[0]
    seq = itertools.count()

    def push() -> None:
        ack = shard.push(PushHeader(0, next(seq), shard.version, 1), payload)
        shard.prepare()
        if not ack.ok:
            raise RuntimeError(f"calibrate: the shard refused a push: {ack.reason}")

    return push


# -- copies ----------------------------------------------------------------------------


def copy_times(nbytes: int, repeats: int) -> list[float]:
    """CPU seconds of one warm ``np.copyto`` of ``nbytes`` (the mean of those in 1 MB)."""
    src, dst, n = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8), max(1, 2**20 // nbytes)
    times = []
    for i in range(repeats + 2):
        t = time.thread_time()
        for _ in range(n):
            np.copyto(dst, src)
        if i >= 2:  # the first two fault the pages in and warm the caches
            times.append((time.thread_time() - t) / n)
    return times


def bus_copies(nbytes: int, cores: int, rounds: int = 5) -> float:
    """Copies of ``nbytes`` the memory bus moves at once with ``cores`` threads copying (1:
    they take turns, ``cores``: unshared), in copies of one alone; the median of ``rounds``."""
    bufs = [(np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)) for _ in range(cores)]
    took, ratios = [0.0] * cores, []

    def copy(i: int, n: int) -> None:  # np.copyto lets go of the GIL
        t = time.perf_counter()
        for _ in range(n):
            np.copyto(bufs[i][1], bufs[i][0])
        took[i] = (time.perf_counter() - t) / n

    copy(0, 2)  # the pages faulted in; then 20 ms or more of copies a thread
    n = max(2, int(0.02 / max(took[0], 1e-9)))
    for _ in range(rounds if cores > 1 else 0):
        copy(0, n)
        alone, threads = took[0], [threading.Thread(target=copy, args=(i, n)) for i in range(cores)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ratios.append(cores * alone / max(took))
    return min(max(statistics.median(ratios or [1.0]), 1.0), float(cores))


# -- contention ------------------------------------------------------------------------


#: A busy process of :func:`measure_contention` (at most 10 minutes).
_SPIN = (
    "import os, time\np, end = os.getppid(), time.monotonic() + 600\n"
    "while os.getppid() == p and time.monotonic() < end:\n    for _ in range(100000): pass"
)


def measure_contention(
    config: ServerConfig, most: int, stepper: Any, deadline: float = math.inf, beside: float = 0
) -> Contention:
    """Wall over CPU time of a step (at the other end of ``stepper``) and of an apply, and a
    sleep's lateness there, with 1 to ``most`` runnable plus ``beside`` (the evaluation's)."""
    shards = min(config.shards, config.spec.size)
    push = _pusher(config, -(-config.spec.size // shards))
    push()
    push()  # the first ones warm the caches
    steps, applies, wakes, spinners = [], [], [], []
    try:
        for k in range(1, most + 1):
            if k > 1:
                spinners.append(subprocess.Popen([sys.executable, "-S", "-c", _SPIN]))
            stepper.send(("time", CONTENTION_SECONDS))
            msg = _recv(stepper, deadline)
            steps.append(msg[1] / msg[2] if msg[2] > 0 else 1.0)
            wakes.append(msg[3])
            n, t, c = 0, time.perf_counter(), time.thread_time()
            end = t + CONTENTION_SECONDS / 2
            while n < 3 or time.perf_counter() < end:
                push()
                n += 1
            cpu = time.thread_time() - c
            applies.append((time.perf_counter() - t) / cpu if cpu > 0 else 1.0)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    log.debug("calibrate: contention, wall over CPU time, step %s, apply %s; a sleep late %s s; "
              "evaluation beside: %.3g of a core", steps, applies, wakes, beside)  # fmt: skip
    return Contention(*(_factors(x, beside) for x in (steps, applies, wakes)))


def _factors(ratios: Sequence[float], beside: float = 0.0) -> tuple[float, ...]:
    """Each ratio (or lateness) at least the one before; at ``n``, the one for ``n + beside``."""
    at = Contention((1.0,), (1.0,), tuple(itertools.accumulate(ratios, max))).wake_at
    return tuple(_sig(at(n + beside)) for n in range(1, len(ratios) + 1))


def _recv(conn: Any, deadline: float, proc: Any = None) -> Any:
    """The next message of a compute process (``proc``, if given), or a one-line error."""
    name = "the contention measurement's step" if proc is None else f"process {proc.name}"
    if not conn.poll(max(0.0, deadline - time.monotonic())):
        raise TimeoutError(f"calibrate: {name} did not answer in time")
    try:
        msg = conn.recv()
    except EOFError:
        code = getattr(proc, "exitcode", None)
        raise RuntimeError(f"calibrate: {name} died (exit code {code})") from None
    if msg[0] == "error":
        raise RuntimeError(f"calibrate: {msg[1]}")
    return msg


# -- pulls and pushes -----------------------------------------------------------------


def transport_times(job: Any, size: int, repeats: int, runtime: str = "local",
                    shard: list | None = None, cpu: list | None = None,
                    ) -> tuple[list[float], list[float], list[float]]:  # fmt: skip
    """Seconds of a pull, of a push until its acknowledgement, and of its send alone,
    ``repeats`` times each, through a ``runtime`` server of ``size`` floats. Lists ``shard``
    and ``cpu`` get shard 0's actor's seconds per push on Ray, and each repeat's ``(pull, send,
    shard)`` CPU seconds, each timed alone (this thread's; a local shard's on average, None on
    Ray)."""
    shards = min(job.config.shards, size)
    job = _synthetic_job(job, size, shards)
    update = {"w": np.random.default_rng(0).normal(scale=1e-3, size=size).astype(np.float32)}
    pulls, pushes, sends = [], [], []

    def busy() -> float:  # shard 0's actor on Ray: its seconds of pushes, publishing, pulls
        return sum(server.stats()[0]["busy"].values())

    others = {p.pid for p in multiprocessing.active_children()}
    with job.serve(workers=1, runtime=runtime) as server:
        client = server.client(0)
        spent = busy() if shard is not None else 0.0
        started = {p.pid for p in multiprocessing.active_children()} - others  # the shards
        procs = [] if _on_cluster(runtime) else sorted(started)
        for i in range(repeats + 2):
            # as the local worker loop: the pull follows the push at once, the ack is read later
            t0 = time.perf_counter()
            client.push(update)
            t1 = time.perf_counter()
            client.pull_flat(own=False, timeout=60.0)  # a server that hangs: TimeoutError
            t2 = time.perf_counter()
            client.wait(60.0)
            t3 = time.perf_counter()
            if shard is not None:
                spent, before = busy(), spent
            if i >= 2:
                pulls.append(t2 - t1)
                pushes.append((t1 - t0) + (t3 - t2))
                sends.append(t1 - t0)
                if shard is not None:
                    shard.append(spent - before)
            if cpu is not None:  # each stage's CPU alone, the shards settled: the bus is the sim's
                _settle(procs)
                was, c0 = _on_cpu(procs), time.thread_time()
                client.push(update)
                c1 = time.thread_time()
                client.wait(60.0)
                _settle(procs)  # the shard's apply and publish, with no copy beside them
                now, c2 = _on_cpu(procs), time.thread_time()
                client.pull_flat(own=False, timeout=60.0)
                if i >= 2:
                    on = None if None in (now, was) else (now - was) / shards
                    cpu.append((time.thread_time() - c2, c1 - c0, on))
                spent = busy() if shard is not None else spent
        client.close()
    return pulls, pushes, sends


def _settle(pids: Sequence[int], quiet: float = SETTLE) -> None:
    """Returns once processes ``pids`` have neither run nor waited for a core for ``quiet``
    seconds (at most 200 x)."""
    last, end = None, time.monotonic() + 200 * quiet
    while ((now := _on_cpu(pids)) != last or _runnable(pids)) and time.monotonic() < end:
        last = now
        time.sleep(quiet)


def _threads(pids: Sequence[int], name: str) -> Iterator[bytes]:
    """Each thread's ``/proc`` file ``name`` of processes ``pids`` (its first 512 bytes)."""
    for pid in pids:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/{name}", "rb") as f:
                yield f.read(512)


def _on_cpu(pids: Sequence[int]) -> float | None:
    """The CPU seconds of processes ``pids`` (Linux's schedstat; None: unreadable)."""
    try:
        total = sum(int(x.split()[0]) for x in _threads(pids, "schedstat"))
    except (OSError, ValueError, IndexError):
        return None
    return total / 1e9 if pids else None


def _runnable(pids: Sequence[int]) -> bool:
    """Whether a thread of processes ``pids`` runs or waits for a core (state R)."""
    try:
        return any(x.rpartition(b")")[2].split()[0] == b"R" for x in _threads(pids, "stat"))
    except (OSError, IndexError):
        return False


@dataclass(frozen=True)
class _BusyStep:
    """:data:`LOOP_COMPUTE` seconds of busy compute, then ``grads``."""

    grads: Any

    def __call__(self, params: Any, batch: Any) -> tuple[float, Any]:
        end = time.perf_counter() + LOOP_COMPUTE
        while time.perf_counter() < end:
            pass
        return 0.0, self.grads


class LoopTimes(NamedTuple):
    """What :func:`loop_times` measures."""

    per_push: float  # seconds a push besides its computes and strategy work, the whole run's
    windows: list[float]  # the same over windows of LOOP_WINDOW pushes or more (its spread)
    own_read: float | None  # the share of pushes the next read held (None: not measured)
    steps: float  # local steps a push (strategy_steps)
    inner: float  # seconds of the strategy's own work a local step (0: gradient pushes)


def strategy_steps(job: Any, pushes: int = 3) -> tuple[float, float]:
    """The mean local steps of a push of ``job``'s strategy (1 for gradients), and the
    seconds of its own work a local step, timed over ``pushes`` pushes here."""
    strategy, config = job.strategy, job.config
    params, zeros = (tree.unflatten(x, config.spec) for x in (config.init, 0 * config.init))
    state, batches = strategy.init(params), itertools.repeat(None)

    def push() -> int:
        return strategy.step(state, params, lambda p, b: (0.0, zeros), batches).local_steps

    push()  # the first allocates the state's buffers
    t = time.perf_counter()
    steps = sum(push() for _ in range(pushes))
    return steps / pushes, (time.perf_counter() - t) / max(steps, 1)


def loop_times(job: Any, size: int, runtime: str = "local") -> LoopTimes:
    """Seconds a worker's push takes besides its computes and strategy work (send and pull
    included), from a run of one worker on ``runtime``; and ``own_read`` when measurable."""
    h, inner = strategy_steps(job)
    if h == 1:  # gradient pushes: the synthetic job, no strategy work
        job, inner = _synthetic_job(job, size, min(job.config.shards, size)), 0.0
    busy = _BusyStep(tree.unflatten(0 * job.config.init, job.config.spec))
    result = job.train(busy, data=[[None]], workers=1,
                       steps=max(6 * LOOP_WINDOW, int(LOOP_STEPS / h)), runtime=runtime,
                       metrics=Metrics(every=0.05), timeouts=Timeouts(total=120))  # fmt: skip
    whole, windows = push_times(result.records)
    if not windows:
        raise RuntimeError(f"calibrate: the worker-loop run made too few records ({result!r})")
    extra = h * (LOOP_COMPUTE + inner)
    counts = {int(t): int(n) for t, n in result.stats.get("staleness_counts", {}).items()}
    later = sum(counts.values()) - 1  # the first push has nothing in flight before it
    own = None if served_pull(job.config) or later < 1 else (counts.get(0, 0) - 1) / later
    return LoopTimes(whole - extra, [t - extra for t in windows], own, h, inner)


def push_times(records: Sequence[dict], pushes: int = LOOP_WINDOW) -> tuple[float, list[float]]:
    """Seconds a push over the whole run, and over windows of consecutive records holding
    ``pushes`` pushes or more (their spread). A record's push count is whole: over single
    record intervals of 2 or 3 pushes (DiLoCo's of 8 local steps) the median jumped by a
    third of a push between runs."""
    recs = [r for r in records if r["pushes"] > 0]
    if len(recs) < 2 or recs[-1]["pushes"] == recs[0]["pushes"]:
        return math.nan, []
    out, a = [], recs[0]
    for b in recs[1:]:
        if b["pushes"] - a["pushes"] >= pushes:
            out.append((b["time"] - a["time"]) / (b["pushes"] - a["pushes"]))
            a = b
    first, last = recs[0], recs[-1]
    return (last["time"] - first["time"]) / (last["pushes"] - first["pushes"]), out


def served_pull(config: ServerConfig) -> bool:
    """Whether the pull :func:`transport_times` times is served behind the push."""
    shards = min(config.shards, config.spec.size)
    snapshot = pipeline.reads_snapshots(config, incarnation=1, joined_at=0)
    return not (snapshot and pipeline.may_read(config.consistency, 1, [0] * shards))


# -- the whole ------------------------------------------------------------------------


def calibrate(
    job: Any,
    loss_and_grad: Callable,
    data: Any,
    *,
    workers: int,
    repeats: int = REPEATS,
    sizes: Sequence[int] | None = None,
    delays: Any = None,
    evaluate: Callable | None = None,
    eval_interval: float | None = None,
    timeout: float = 600.0,
    contention: bool = True,
    runtime: str = "local",
) -> Calibration:
    """Measures compute, apply, pull and push times here; ValueError names a bad argument.

    Args:
        loss_and_grad, data, workers: as :meth:`stalewise.Job.train` takes them; the
            ``workers`` compute at once.
        repeats: timed steps per worker, and timed pushes per size.
        sizes: the parameter counts transport and apply are timed at (two or more; default:
            the job's, at least :data:`MIN_SIZE`, and 4x it).
        delays, evaluate, eval_interval: the run's (``sw.Emulation(delays=)``, ``Job.train``'s).
        timeout: seconds the compute processes may take in all.
        contention: measure the contention model and fit the compute to CPU times.
        runtime: where pulls, pushes, shard and worker loop are timed (``"local"`` or
            ``"ray"``); compute is timed locally."""
    config = job.config
    if not _int_in(workers, 1, sys.maxsize):
        raise ValueError(f"workers = {workers!r}: must be an integer >= 1")
    if not _int_in(repeats, MIN_REPEATS, MAX_REPEATS):
        raise ValueError(
            f"repeats = {repeats!r}: must be an integer in {MIN_REPEATS}..{MAX_REPEATS}"
        )
    n = max(config.spec.size, MIN_SIZE)
    sizes = tuple((n, 4 * n) if sizes is None else sizes)
    if len(set(sizes)) < 2 or any(not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"sizes = {sizes!r}: must be two or more different integers >= 1")
    if not (_number_in(timeout, 0, MAX_TIMEOUT) and timeout > 0):
        raise ValueError(
            f"timeout = {timeout!r}: must be a number of seconds in (0, {MAX_TIMEOUT:g}]"
        )
    able = runtime_lib.names("calibrates")
    if runtime not in able:
        raise ValueError(f"runtime = {runtime!r}: calibrate measures one of {able}")
    per_worker = _delays(delays, workers)
    if evaluate is not None:
        if not callable(evaluate):
            raise ValueError(f"evaluate = {evaluate!r}: must be a callable evaluate(params)")
        if not (_number_in(eval_interval, 0, math.inf) and eval_interval > 0):
            raise ValueError(
                f"eval_interval = {eval_interval!r}: must be a finite number of seconds > 0 "
                "with evaluate"
            )
    load = os.getloadavg()
    t0 = time.perf_counter()
    most = min(workers + min(config.shards, config.spec.size) + 1, MOST_PROCESSES)
    step_times, cpu_times, threads, contended = measure_compute(
        config, loss_and_grad, data, workers, repeats, timeout=timeout, delays=per_worker,
        evaluate=evaluate, eval_interval=eval_interval, contention=most if contention else 0,
    )  # fmt: skip
    itemsize = config.init.dtype.itemsize
    served = served_pull(config)
    series: dict[str, list[tuple[int, list[float]]]] = {}  # name -> (bytes, seconds) a size
    spreads: list[tuple[str, Spread]] = []
    msg_pts = []
    with _connected(runtime):
        for n in sizes:
            nbytes, shards = n * itemsize, min(config.shards, n)
            actor: list[float] = []  # on Ray: shard 0's actor's own time per push
            cpu: list[tuple[float, float]] = []  # the pull's and the send's CPU time
            pulls, pushes, sends = transport_times(
                job, n, repeats, runtime, shard=actor if _on_cluster(runtime) else None, cpu=cpu
            )
            if actor:  # the apply as the shard actor times it, at its slice's size
                a_times, nbytes_a = actor, -(-n // shards) * itemsize
            else:  # the apply timed in this process, on one shard of the whole size
                a_times, nbytes_a = apply_times(config, n, repeats), nbytes
            sliced = shards == 1 or actor
            a_slice = statistics.median(
                a_times if sliced else apply_times(config, -(-n // shards), repeats)
            )
            # what a simulated step waits for besides compute and the shard: see the docstring
            less = 2 * a_slice if served else 0.0
            pull, send = statistics.median(pulls), statistics.median(sends)
            msg_pts.append((nbytes, max(0.0, send + pull - less)))
            msgs = [max(0.0, s + p - less) for s, p in zip(sends, pulls, strict=True)]
            timed = [("copy", nbytes, copy_times(nbytes, repeats))]
            for j, name in enumerate(("pull CPU", "send CPU")):  # CPU times: what costs copies
                timed.append((name, nbytes, [c[j] for c in cpu] or [0.0]))
            if cpu and all(c[2] is not None for c in cpu):  # a local shard's, per push
                timed.append(("shard CPU", -(-n // shards) * itemsize, [c[2] for c in cpu]))
            timed += [("apply", nbytes_a, a_times), ("pull", nbytes, pulls)]
            timed += [("send", nbytes, sends), ("push", nbytes, pushes), ("message", nbytes, msgs)]
            for name, b, xs in timed:
                series.setdefault(name, []).append((b, xs))
                spreads.append((_key(name, b), Spread.of(xs)))
        cores = os.cpu_count() or 1
        bus = (bus_copies(max(sizes) * itemsize, cores), cores)
        fixed = statistics.median(series["send"][0][1]) + statistics.median(series["pull"][0][1])
        looped = loop_times(job, sizes[0], runtime)
    loop_s = max(0.0, looped.per_push - fixed)
    spreads.append(("worker loop", Spread.of([max(0.0, x - fixed) for x in looped.windows])))
    load_end = os.getloadavg()
    log.info("calibrate: measured in %.1f s", time.perf_counter() - t0)

    def fit(name: str) -> Fit:
        return Fit.of([(b, statistics.median(xs)) for b, xs in series[name]])

    owner = getattr(getattr(config.optimizer, "init", None), "__qualname__", "").split(".")[0]

    cpu = {k: fit(f"{k} CPU") for k in ("pull", "send", "shard")
           if len(series.get(f"{k} CPU", ())) == len(sizes)}  # fmt: skip
    cal = Calibration(
        workers=workers,
        threads=threads,
        step_times=step_times,
        apply=fit("apply"),
        pull=fit("pull"),
        push=fit("push"),
        message=Fit.of(msg_pts),
        model_bytes=int(config.spec.size * itemsize),
        optimizer=owner.lstrip("_").lower() or type(config.optimizer).__name__,  # sgd, adam..
        load=tuple(round(x, 2) for x in load),
        send=fit("send"),
        served=served,
        evaluated=None if evaluate is None else float(eval_interval),
        loop=loop_s,
        own_read=looped.own_read,
        inner=looped.inner or None,
        spreads=tuple(spreads),
        load_end=tuple(round(x, 2) for x in load_end),
        contention=contended,
        cpu_times=cpu_times,
        runtime=runtime,
        copy=fit("copy"),
        bus=bus,
        cpu=cpu,  # the shard's only when measured at every size
    )
    for w in cal.warnings():
        log.warning("calibrate: the machine was too busy for a stable figure: %s", w)
    return cal


@contextlib.contextmanager
def _connected(runtime: str) -> Iterator[None]:
    """On Ray: this process connected to Ray meanwhile (an instance it started is shut down)."""
    if not _on_cluster(runtime):
        yield
        return
    from stalewise.runtime.ray import import_ray

    log.info("calibrate: %s", ON_RAY)
    started = runtime_lib.describe(runtime).load("connect")()
    try:
        yield
    finally:
        if started:
            import_ray().shutdown()


def _on_cluster(runtime: str) -> bool:
    """Whether ``runtime``'s shards are actors of a cluster it connects to (Ray's)."""
    return runtime_lib.describe(runtime).connect is not None


def _int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _number_in(value: Any, low: float, high: float) -> bool:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return ok and math.isfinite(value) and low <= value <= high


def _delays(delays: Any, workers: int) -> list[float]:
    """``delays`` (None, a number, or {worker: seconds}) as one number per worker, checked."""
    if delays is None:
        return [0.0] * workers
    items = delays.items() if isinstance(delays, dict) else ((w, delays) for w in range(workers))
    out = [0.0] * workers
    for w, d in items:
        if not isinstance(w, int) or not 0 <= w < workers:
            raise ValueError(f"delays[{w!r}]: not a worker of this run (0..{workers - 1})")
        if not _number_in(d, 0, MAX_DELAY):
            raise ValueError(
                f"delays[{w}] = {d!r}: must be a number of seconds in [0, {MAX_DELAY:g}]"
            )
        out[w] = float(d)
    return out


def with_table(
    sim: SimConfig | None, calibration: Calibration, bound: str | None = None
) -> SimConfig:
    """``sim`` with the calibrated timing models (:meth:`Calibration.sim_config`) as its own."""
    cal = calibration.sim_config(bound)
    if sim is None:
        return cal
    return replace(sim, compute=cal.compute, speeds=cal.speeds, network=cal.network,
                   service=cal.service, contention=cal.contention, copies=cal.copies)  # fmt: skip
