"""The task interface and the data plumbing shared by the built-in tasks.

A task is a picklable model, data and loss (no sleeping or logging: the runtime's business);
``batches(w, W, seed)`` draw from disjoint shards, each epoch reshuffled by ``(seed, w, epoch)``."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

from stalewise.optim._validate import check_integer as check_int  # noqa: F401 (the tasks')

logger = logging.getLogger(__name__)

__all__ = ["SeededTask", "Task", "available_memory", "check_memory", "shard_batches"]
__all__ += ["shard_indices", "with_seed"]


@runtime_checkable
class Task(Protocol):
    """What a runtime needs from a task: picklable, cheap to build, mutating nothing but
    private caches; ``grads`` have the structure, backend and dtype of ``params``."""

    name: str

    def init_params(self, seed: int = 0) -> Any:
        """Returns freshly initialised parameters, deterministic by ``seed``."""

    def loss_and_grad(self, params: Any, batch: Any) -> tuple[float, Any]:
        """Returns the minibatch loss and its gradient with respect to ``params``."""

    def batches(self, worker: int, workers: int, seed: int = 0) -> Iterator[Any]:
        """Returns an endless iterator over minibatches of ``worker``'s shard."""

    def evaluate(self, params: Any) -> dict[str, float]:
        """Returns held-out metrics: at least ``"loss"``."""


class SeededTask:
    """A task whose ``batches(worker, workers)`` passes a fixed ``seed``: see :func:`with_seed`."""

    def __init__(self, task: Any, seed: int = 0) -> None:
        self.task, self.seed = task, seed

    def __repr__(self) -> str:
        return f"with_seed({self.task!r}, {self.seed!r})"

    @property
    def name(self) -> str:
        return getattr(self.task, "name", type(self.task).__name__)

    @property
    def loss_and_grad(self) -> Any:
        return self.task.loss_and_grad

    @property
    def evaluate(self) -> Any:
        return self.task.evaluate

    def init_params(self, seed: int | None = None) -> Any:
        """The task's ``init_params``, with this seed unless another is given."""
        return self.task.init_params(self.seed if seed is None else seed)

    def batches(self, worker: int, workers: int, seed: int | None = None) -> Iterator[Any]:
        """The task's ``batches(worker, workers, seed)``, with this seed unless another is given."""
        return self.task.batches(worker, workers, self.seed if seed is None else seed)


def with_seed(task: Any, seed: int = 0) -> SeededTask:
    """The task with ``seed`` bound: its ``batches`` is the ``data(worker, workers)`` of ``Job.train``.

    Example:
        >>> from stalewise import tasks
        >>> task = tasks.get("least-squares", n=64, d=4)
        >>> seeded = with_seed(task, 3)
        >>> a, _ = next(seeded.batches(1, 2))
        >>> bool((a == next(task.batches(1, 2, 3))[0]).all())
        True
    """
    return SeededTask(task, seed)


def map_dict(fn: Any, tree: dict) -> dict:
    """``fn`` of every leaf of a nested dict, as a dict of the same structure."""
    return {k: map_dict(fn, v) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def dict_leaves(tree: dict) -> list:
    """The leaves of a nested dict, in order."""
    out = []
    for v in tree.values():
        out += dict_leaves(v) if isinstance(v, dict) else [v]
    return out


def fields_repr(obj: Any, *names: str) -> str:
    """``Type(name=value, ...)`` of ``obj``'s attributes ``names`` (strings quoted)."""
    shown = (f"{n}={v!r}" if isinstance(v := getattr(obj, n), str) else f"{n}={v}" for n in names)
    return f"{type(obj).__name__}({', '.join(shown)})"


def check_number(
    name: str, value: Any, low: float, high: float = np.inf, *, open_: str = ""
) -> float:
    """``value`` as a float if finite in ``[low, high]`` (``open_`` ends open), else ValueError."""
    lo_open, hi_open = open_ in ("low", "both"), open_ in ("high", "both")
    ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool)
    x = float(value) if ok else np.nan
    inside = (x > low if lo_open else x >= low) and (x < high if hi_open else x <= high)
    if not (np.isfinite(x) and inside):
        interval = f"{'(' if lo_open else '['}{low:g}, {high:g}{')' if hi_open else ']'}"
        if high == np.inf:
            interval = f"{'>' if lo_open else '>='} {low:g}"
            raise ValueError(f"{name} must be a finite number {interval}, got {value!r}")
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    return x


def available_memory() -> int | None:
    """Bytes this process may allocate (``MemAvailable``, else physical memory), or None."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo", "rb") as f:
        for line in f:
            if line.startswith(b"MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
    return pages * size if pages > 0 and size > 0 else None


def _size(nbytes: float) -> str:
    """``2457600000000`` -> ``'2.5 TB'``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def check_memory(task: str, nbytes: float, sizes: dict[str, tuple[Any, Any]]) -> None:
    """ValueError if ``nbytes`` exceeds :func:`available_memory`, naming the key of ``sizes``
    (``{key: (value, default)}``) furthest above its default.

    Example:
        >>> check_memory("least-squares", 1e18, {"n": (512, 2048), "d": (10**14, 64)})
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: d = 100000000000000 (with n = 512): least-squares would allocate about 1e+18 bytes (1e+06 TB), more than the memory available ...
    """
    available = available_memory()
    if available is None or nbytes <= available:
        return
    key = max(sizes, key=lambda k: float(sizes[k][0]) / max(float(sizes[k][1]), 1.0))
    others = ", ".join(f"{k} = {v!r}" for k, (v, d) in sizes.items() if k != key and v != d)
    raise ValueError(
        f"{key} = {sizes[key][0]!r}{f' (with {others})' if others else ''}: {task} would "
        f"allocate about {nbytes:.3g} bytes ({_size(nbytes)}), more than the memory available "
        f"({available} bytes, {_size(available)}); make {key} smaller"
    )


def shard_indices(n: int, worker: int, workers: int) -> np.ndarray:
    """The int64 indices ``worker, worker + workers, ...`` of ``worker``'s shard of ``n``."""
    if workers < 1 or not 0 <= worker < workers:
        raise ValueError(f"need 0 <= worker < workers, got worker={worker}, workers={workers}")
    if workers > n:
        raise ValueError(f"{workers} workers but only {n} training examples")
    return np.arange(worker, n, workers, dtype=np.int64)


def shard_batches(
    n: int, batch_size: int, worker: int, workers: int, seed: int = 0
) -> Iterator[np.ndarray]:
    """Yields index minibatches of ``worker``'s shard forever, each epoch reshuffled."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    shard = shard_indices(n, worker, workers)
    size = min(batch_size, len(shard))
    per_epoch = len(shard) // size
    epoch = 0
    while True:
        rng = np.random.default_rng([seed, worker, epoch])
        order = rng.permutation(shard)
        for i in range(per_epoch):
            yield order[i * size : (i + 1) * size]
        epoch += 1
