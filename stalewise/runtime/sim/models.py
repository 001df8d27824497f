"""Timing, network and fault models of the simulator, and their per-run state.

Per run, :class:`WorkerTiming` answers "when does this step end", :class:`Links` "when
is this message in" and :class:`Service` "how long does this request take". What each
charges: docs/calibrate.md ("What the simulator models").

Example:
    >>> ShiftedExponential(shift=0.0, rate=1.0).mean, Service(time=0.5, rate=2.0).seconds(1.0)
    (1.0, 1.0)
    >>> Network(latency=-1.0)
    Traceback (most recent call last):
    ...
    stalewise.runtime.sim.models.SimConfigError: Network.latency = -1.0: must be a finite number >= 0
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # sim_config builds on these models; only the annotations point back
    from stalewise.runtime.sim.config import SimConfig

log = logging.getLogger(__name__)

_STREAM = 0x51A1E  # separates the simulator's random streams from the tasks' data streams


class SimConfigError(ValueError):
    """A bad simulator setting: ``key`` of model ``owner`` is ``value``, must be ``need``."""

    def __init__(self, owner: str, key: str, value: Any, need: str, where: str = "", path=None):
        self.owner, self.key, self.value, self.need, self.where = owner, key, value, need, where
        self.path = key if path is None else path
        name = f"{owner}.{key}" if owner else key
        if value is ...:
            super().__init__(".".join(filter(None, (where, key))) + f": {need}")
        else:
            super().__init__(f"{where}: " * bool(where) + f"{name} = {value!r}: {need}")

    @property
    def problem(self) -> str:
        """What is wrong, as a config error says it after the key."""
        return self.need if self.value is ... else f"{self.need}, got {self.value!r}"

    def __reduce__(self) -> tuple:
        return type(self), (self.owner, self.key, self.value, self.need, self.where, self.path)


_bad = SimConfigError


#: The longest virtual time a model may give or name, in seconds (about 116 days): a step,
#: a latency, a request, a restart, a scripted event.
MAX_SECONDS = 1e7
MIN_BYTES_PER_S = 1.0  #: The slowest link or shard, in bytes per second (math.inf: free).
MAX_FACTOR = 1e6  #: The widest speed-up or slow-down of a worker (speeds, stragglers, slowdowns).


def _number(owner: str, name: str, value: Any, low: float = 0.0, inf_ok: bool = False,
            high: float = math.inf, why: str = "") -> float:  # fmt: skip
    ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
    v = float(value) if ok else math.nan
    if math.isnan(v) or (math.isinf(v) and not inf_ok) or v < low:
        kind = "number" if inf_ok else "finite number"
        raise _bad(owner, name, value, f"must be a {kind} >= {low:g}")
    if v > high and not (inf_ok and math.isinf(v)):
        raise _bad(owner, name, value, f"must be <= {high:g}{why}")
    return v


def _seconds(owner: str, name: str, value: Any) -> float:
    return _number(owner, name, value, high=MAX_SECONDS, why=" (virtual seconds)")


def _bytes_per_s(owner: str, name: str, value: Any) -> float:
    return _number(owner, name, value, low=MIN_BYTES_PER_S, inf_ok=True, why=" (bytes per second)")


def _factor(owner: str, name: str, value: Any, low: float = 1 / MAX_FACTOR) -> float:
    return _number(owner, name, value, low=low, high=MAX_FACTOR)


def _worker_id(owner: str, name: str, value: Any) -> int:
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 0:
        raise _bad(owner, name, value, "must be a worker id (an integer >= 0)")
    return int(value)


# -- compute-time models ---------------------------------------------------------------


@dataclass(frozen=True)
class Fixed:
    """Every step takes exactly ``time`` virtual seconds (before speeds and slowdowns)."""

    time: float = 0.01

    def __post_init__(self) -> None:
        _seconds("Fixed", "time", self.time)

    @property
    def mean(self) -> float:
        return self.time


@dataclass(frozen=True)
class ShiftedExponential:
    """A step takes ``shift + Exp(rate)`` seconds (Dutta et al., 2018)."""

    shift: float = 0.008
    rate: float = 500.0

    def __post_init__(self) -> None:
        _seconds("ShiftedExponential", "shift", self.shift)
        # the tail's mean, 1 / rate, is a step time too: at most MAX_SECONDS
        _number("ShiftedExponential", "rate", self.rate, low=1 / MAX_SECONDS, why=" (per second)")

    @property
    def mean(self) -> float:
        return self.shift + 1.0 / self.rate

    def sample(self, rng: np.random.Generator) -> float:
        return self.shift + float(rng.exponential(1.0 / self.rate))


@dataclass(frozen=True)
class Stragglers:
    """Persistent stragglers: the last ``count`` workers are ``slowdown`` times slower."""

    count: int = 1
    slowdown: float = 4.0

    def __post_init__(self) -> None:
        if not isinstance(self.count, int) or isinstance(self.count, bool) or self.count < 0:
            raise _bad("Stragglers", "count", self.count, "must be an integer >= 0")
        _factor("Stragglers", "slowdown", self.slowdown, low=1.0)


@dataclass(frozen=True)
class Slowdown:
    """A transient slowdown: ``worker`` is ``factor`` times slower during ``[start, end)``."""

    worker: int
    factor: float
    start: float
    end: float = math.inf

    def __post_init__(self) -> None:
        _worker_id("Slowdown", "worker", self.worker)
        _factor("Slowdown", "factor", self.factor, low=1 / MAX_FACTOR)
        _seconds("Slowdown", "start", self.start)
        end = self.end
        ok = isinstance(end, int | float | np.integer | np.floating) and not isinstance(end, bool)
        if not (ok and end > self.start and (end <= MAX_SECONDS or end == math.inf)):
            need = f"must be a time > start ({self.start}), <= {MAX_SECONDS:g} or inf"
            raise _bad("Slowdown", "end", self.end, need)


@dataclass(frozen=True)
class _Scripted:
    """A scripted event of ``worker`` at virtual ``time`` (:class:`Failure`, :class:`Join`)."""

    worker: int
    time: float

    def __post_init__(self) -> None:
        _worker_id(type(self).__name__, "worker", self.worker)
        _seconds(type(self).__name__, "time", self.time)


@dataclass(frozen=True)
class Failure(_Scripted):
    """``worker`` fails at virtual ``time``: its unfinished work is lost (a push it had
    committed is still applied), and the job's failure policy decides what follows,
    unless a later :class:`Join` of the same worker answers it (no restart counted)."""


@dataclass(frozen=True)
class Join(_Scripted):
    """``worker`` (re)joins at virtual ``time`` as a new incarnation (absent until a first join)."""


# -- network and server models ---------------------------------------------------------


@dataclass(frozen=True)
class Network:
    """Per-message latency and per-link bandwidth (bytes per second; 1.25e9 is 10 Gbit/s);
    ``worker_bandwidth`` and ``shard_bandwidth`` override ``bandwidth``."""

    latency: float = 50e-6
    bandwidth: float = 1.25e9
    worker_bandwidth: float | None = None
    shard_bandwidth: float | None = None

    def __post_init__(self) -> None:
        _seconds("Network", "latency", self.latency)
        _bytes_per_s("Network", "bandwidth", self.bandwidth)
        for name in ("worker_bandwidth", "shard_bandwidth"):
            if getattr(self, name) is not None:
                _bytes_per_s("Network", name, getattr(self, name))

    @property
    def worker_bw(self) -> float:
        return self.bandwidth if self.worker_bandwidth is None else float(self.worker_bandwidth)

    @property
    def shard_bw(self) -> float:
        return self.bandwidth if self.shard_bandwidth is None else float(self.shard_bandwidth)


@dataclass(frozen=True)
class Service:
    """A shard serves one request at a time, FIFO: ``time + bytes / rate`` seconds each."""

    time: float = 10e-6
    rate: float = 10e9

    def __post_init__(self) -> None:
        _seconds("Service", "time", self.time)
        _bytes_per_s("Service", "rate", self.rate)

    def seconds(self, nbytes: float) -> float:
        """Service time of a request that reads or writes ``nbytes`` of parameters."""
        return self.time + nbytes / self.rate


_FACTORS = "must be a non-empty list of factors"
_CONTENTION = (("step", _factor, _FACTORS), ("apply", _factor, _FACTORS),
               ("wake", _seconds, "must be a list of seconds"))  # fmt: skip


@dataclass(frozen=True)
class Contention:
    """How much slower a worker's compute (``step``) and a shard's apply (``apply``) run, and how
    late a sleep ends (``wake``, seconds), with ``n`` processes runnable: ``step[n - 1]`` is the
    one with ``n``, linear between entries and beyond the last on its slope (calibrate measures).

    Example:
        >>> c = Contention(step=(1.0, 1.0, 1.5, 2.0), apply=(1.0, 1.5), wake=(0.0, 1e-3))
        >>> c.step_at(1), c.step_at(3), c.step_at(3.5), c.step_at(6), c.apply_at(4), c.wake_at(3)
        (1.0, 1.5, 1.75, 3.0, 2.5, 0.002)
    """

    step: tuple[float, ...]
    apply: tuple[float, ...]
    wake: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name, check, need in _CONTENTION:
            v = getattr(self, name)
            listed = isinstance(v, Sequence | np.ndarray) and not isinstance(v, str | bytes)
            if not listed or not (len(v) or check is _seconds):
                raise _bad("Contention", name, v, need)
            v = tuple(check("Contention", f"{name}[{i}]", x) for i, x in enumerate(v))
            object.__setattr__(self, name, v)  # a tuple of floats: hashable

    def step_at(self, n: float) -> float:
        """The compute's factor with ``n`` processes runnable."""
        return _along(self.step, n)

    def apply_at(self, n: float) -> float:
        """The apply's factor with ``n`` processes runnable."""
        return _along(self.apply, n)

    def wake_at(self, n: float) -> float:
        """The seconds a sleep ends late with ``n`` processes runnable (0 unmeasured)."""
        return _along(self.wake, n) if self.wake else 0.0


@dataclass(frozen=True)
class Copies:
    """The CPU cost of copying the parameters' bytes, charged to the process that copies:
    ``rate`` bytes/s a core, ``bus`` in all on ``cores`` cores at once; ``pull``, ``push``,
    ``apply``: copies of each slice, ``pull_time``, ``push_time``: CPU seconds besides
    (docs/calibrate.md, "Copies on the cores").

    Example:
        >>> Copies(rate=1e9, bus=1.5e9, cores=2).seconds(2.0, 1.5e6, copying=3)  # 0.75 GB/s
        0.004
    """

    rate: float
    bus: float = math.inf
    pull: float = 1.0
    push: float = 1.0
    apply: float = 1.5
    pull_time: float = 0.0
    push_time: float = 0.0
    cores: float = math.inf

    def __post_init__(self) -> None:
        _number("Copies", "cores", self.cores, low=1, inf_ok=True)
        _bytes_per_s("Copies", "rate", self.rate)
        _bytes_per_s("Copies", "bus", self.bus)
        _seconds("Copies", "pull_time", self.pull_time)
        _seconds("Copies", "push_time", self.push_time)
        for name in ("pull", "push", "apply"):
            _number("Copies", name, getattr(self, name), high=MAX_FACTOR)

    def seconds(self, copies: float, nbytes: float, copying: int = 1) -> float:
        """Seconds of ``copies`` copies of ``nbytes`` with ``copying`` processes copying."""
        return copies * nbytes / min(self.rate, self.bus / min(max(copying, 1), self.cores))


def _along(table: tuple[float, ...], n: float) -> float:
    i, last = max(0.0, n - 1), len(table) - 1
    if i >= last:
        slope = max(0.0, table[-1] - table[-2]) if last else 0.0
        return min(table[-1] + slope * (i - last), MAX_FACTOR)
    j = int(i)
    return table[j] + (table[j + 1] - table[j]) * (i - j)


# -- the per-run timing state ----------------------------------------------------------


class WorkerTiming:
    """Step durations of one run: O(1) per step. ``factors``: extra per-worker slowdowns
    (``train(stragglers=...)``); ``delays``: extra seconds of every step, one per worker;
    worker ``w`` draws from ``default_rng([seed, w, _STREAM])``.

    Example:
        >>> from stalewise.runtime.sim.config import SimConfig
        >>> timing = WorkerTiming(SimConfig(compute=Fixed(1.0),
        ...     slowdowns=[Slowdown(worker=0, factor=2.0, start=0.5, end=1.0)]), workers=2)
        >>> timing.finish(0, 0.0), timing.finish(1, 0.0), timing.finish(1, 0.0, local_steps=4)
        (1.25, 1.0, 4.0)
    """

    def __init__(self, sim: SimConfig, workers: int, *, factors: Sequence[float] | None = None,
                 delays: Sequence[float] | None = None, seed: int = 0):  # fmt: skip
        sim.check_workers(workers)
        self.compute, self.loop = sim.compute, sim.loop
        scale = np.ones(workers)
        if factors is not None:
            scale *= np.asarray(factors, dtype=float)
        if sim.speeds is not None:
            scale /= np.asarray(sim.speeds, dtype=float)
        if sim.stragglers is not None and sim.stragglers.count:
            scale[workers - sim.stragglers.count :] *= sim.stragglers.slowdown
        speeds = [1.0] * workers if sim.speeds is None else sim.speeds
        delays = [0.0] * workers if delays is None else delays
        self.paces = [  # one record per worker
            _Pace(x, 1.0 / speeds[w], float(delays[w])) for w, x in enumerate(scale.tolist())
        ]
        if not isinstance(sim.compute, Fixed):
            for w, p in enumerate(self.paces):
                p.rng = np.random.default_rng([seed, w, _STREAM])
        for s in sim.slowdowns:
            self.paces[s.worker].slowdowns.append(s)
        for p in self.paces:  # an end may be inf, a start may not
            p.points = sorted({t for s in p.slowdowns for t in (s.start, s.end)} - {math.inf})

    def rng_states(self) -> list[dict] | None:
        """Each worker's random stream state, for a checkpoint (None: fixed step times)."""
        fixed = isinstance(self.compute, Fixed)
        return None if fixed else [p.rng.bit_generator.state for p in self.paces]

    def load_rng_states(self, states: list[dict] | None) -> None:
        """Sets each worker's random stream state from :meth:`rng_states`'s list."""
        if states is not None and not isinstance(self.compute, Fixed):
            for p, state in zip(self.paces, states, strict=True):
                p.rng.bit_generator.state = state

    def draw(self, worker: int, local_steps: int = 1) -> float:
        """The sum of ``local_steps`` sampled compute times of ``worker`` (not stretched)."""
        p = self.paces[worker]
        if p.rng is None:  # Fixed
            return self.compute.time * local_steps
        return sum(self.compute.sample(p.rng) for _ in range(local_steps))  # in order

    def cpu_work(self, worker: int, base: float) -> float:
        """The CPU seconds of a step of ``base`` sampled compute: the loop's time is too."""
        return base * self.paces[worker].cpu + self.loop

    def rest(self, worker: int, base: float, local_steps: int, stretch: float, wake: float):
        """Seconds a step of ``base`` compute, stretched, sleeps after it (the one sleep a
        push: a delay, a straggler's; ``wake`` late)."""
        p = self.paces[worker]
        late = wake if p.delay or p.scale != p.cpu else 0.0
        return base * stretch * (p.scale - p.cpu) + p.delay * local_steps * p.scale + late

    def finish(self, worker: int, start: float, local_steps: int = 1, work=None) -> float:
        """When a step of ``worker`` started at ``start`` ends, through its slowdowns:
        ``local_steps`` sampled step times, its delays and the loop's time (or ``work`` s)."""
        p = self.paces[worker]
        if work is None:  # the worker loop's own time: once a push, at no worker's pace
            work = (self.draw(worker, local_steps) + p.delay * local_steps) * p.scale + self.loop
        if not p.slowdowns:
            return start + work
        points, t = p.points, start
        i = bisect.bisect_right(points, t)
        while True:
            f = math.prod(s.factor for s in p.slowdowns if s.start <= t < s.end)
            nxt = points[i] if i < len(points) else math.inf
            if work * f <= nxt - t:
                return t + work * f
            work -= (nxt - t) / f
            t, i = nxt, i + 1


@dataclass(slots=True, eq=False)
class _Pace:
    """One worker's share of :class:`WorkerTiming`."""

    scale: float  # its step time's factor: stragglers (the run's and the config's) / speed
    cpu: float  # the share of a step that is compute, not sleep (a straggler's, a delay)
    delay: float  # extra seconds a local step
    rng: np.random.Generator | None = None  # its stream of step times (None: Fixed)
    slowdowns: list[Slowdown] = field(default_factory=list)  # its transient slowdowns
    points: list[float] = field(default_factory=list)  # their finite starts and ends, sorted


class Links:
    """The links of one run: when each node's egress and ingress link is next free
    (nodes ``0 .. workers-1`` are the workers, ``workers + k`` shard ``k``).

    Example:
        >>> links = Links(Network(latency=0.1, bandwidth=10.0), workers=2, shards=1)
        >>> head, tail = links.send(0, 2, 10.0, now=0.0)   # worker 0 -> shard 0, 10 bytes
        >>> head, tail, links.receive(2, 10.0, now=head, tail=tail)
        (0.1, 1.1, 1.1)
    """

    def __init__(self, net: Network, workers: int, shards: int):
        self.latency = net.latency
        self.bw = [net.worker_bw] * workers + [net.shard_bw] * shards
        self.egress = [0.0] * (workers + shards)
        self.ingress = [0.0] * (workers + shards)

    def send(self, src: int, dst: int, nbytes: float, now: float) -> tuple[float, float]:
        """Queues ``nbytes`` on ``src``'s egress; returns when its head and tail reach ``dst``."""
        del dst
        start = max(now, self.egress[src])
        self.egress[src] = end = start + nbytes / self.bw[src]
        return start + self.latency, end + self.latency

    def instant(self, dst: int, nbytes: float, head: float, tail: float) -> bool:
        """True when the message takes no time at ``dst`` (free links): no ingress step needed."""
        return tail <= head and nbytes / self.bw[dst] == 0.0 and self.ingress[dst] <= head

    def receive(self, dst: int, nbytes: float, now: float, tail: float) -> float:
        """Queues a message whose head reached ``dst`` at ``now``; returns when it is all in."""
        start = max(now, self.ingress[dst])
        self.ingress[dst] = done = max(start + nbytes / self.bw[dst], tail)
        return done
