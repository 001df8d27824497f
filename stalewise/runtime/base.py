"""What every runtime's run shares: argument checks, a worker's batches, pulls into trees."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from stalewise import tree
from stalewise.targets import _is_int

#: What caps a process's math-library threads; each launcher sets them unless the user did.
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS")


def batch_iterator(data: Any, worker: int, workers: int, drawn: Any = None) -> Iterator[Any]:
    """A worker's batches: ``data(worker, workers)`` if callable, else ``data[worker]`` cycled;
    skips ``drawn[worker]`` batches and counts each one it yields in it."""
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


class PullsIntoTrees:
    """The part of a worker's client that every runtime shares: a pull fills the flat
    ``_pull_buf`` and comes back in the job's structure and backend; the budget rule's grant."""

    _pull_buf: np.ndarray
    _spec: tree.FlatSpec

    @property
    def spec(self) -> tree.FlatSpec:
        """The job's parameter layout (the structure pushes must have)."""
        return self._spec

    def pull_flat(self, *, timeout: float | None = None, own: bool = True) -> np.ndarray:
        raise NotImplementedError

    def pull(
        self, *, copy: bool = True, into: Any = None, timeout: float | None = None, own: bool = True
    ) -> Any:
        """Blocks until the consistency model lets this worker start, then returns the params.

        The parameters include this worker's last push if the shards applied it (read-your-writes;
        its result may be read later, by :meth:`wait` or the next push); ``own=False`` does not
        wait for it, and ``pull_has_own`` then says whether they do.

        Args:
            copy: False returns leaves that view the pull buffer (valid until the next pull).
            into: an existing tree or model (e.g. a ``torch.nn.Module``) to copy the values
                into, in place; it is returned.
            timeout: seconds to wait for the shards (None: forever).

        Returns the parameters in the structure and backend the job was made with."""
        self.pull_flat(timeout=timeout, own=own)
        return self.last_pull(copy=copy, into=into)

    def last_pull(self, *, copy: bool = True, into: Any = None) -> Any:
        """The parameters of the last completed pull, as :meth:`pull` returns them."""
        if into is not None:
            tree.unflatten_into(into, self._pull_buf, self._spec)
            return into
        return tree.unflatten(self._pull_buf, self._spec, copy=copy)

    def may_begin(self, steps: int) -> bool:
        """Whether this worker may begin another step of a job of ``steps`` pushes (the budget)."""
        self._granted = self._may_begin(steps)  # type: ignore[attr-defined]
        return self._granted

    def take_results(self) -> list:
        """The results of the pushes acknowledged since the last call."""
        out, self._results = self._results, []  # type: ignore[has-type]
        return out


#: The largest straggler factor (``train(stragglers=...)``): a worker this many times slower.
MAX_SLOWDOWN = 1e4
MAX_DELAY = 3600.0  #: The longest extra delay per step (``train(delays=...)``), in seconds.


def check_run(
    workers: Any, steps: Any, data: Any, stragglers: Any, delays: Mapping[int, float] | None
) -> tuple[list[float], list[float]]:
    """Checks the arguments all runtimes' ``train`` share; returns the slowdowns and delays."""
    if not _is_int(steps) or steps < 1:  # workers: checked
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
    factors, given = [1.0] * workers, {} if stragglers is None else stragglers
    if not isinstance(given, Mapping) and len(given) != workers:
        raise ValueError(f"stragglers lists {len(given)} factors for {workers} workers")
    for w, f in given.items() if isinstance(given, Mapping) else enumerate(given):
        if not (isinstance(w, int) and 0 <= w < workers):
            raise ValueError(f"stragglers: unknown worker {w!r} (workers are 0..{workers - 1})")
        if not (isinstance(f, int | float) and not isinstance(f, bool) and 1 <= f <= MAX_SLOWDOWN):
            raise ValueError(
                f"stragglers[{w}]: slowdown factor must be a number in [1, {MAX_SLOWDOWN:g}], "
                f"got {f!r}"
            )
        factors[w] = float(f)
    return factors, extra


def worker_range(workers: Any) -> tuple[int, int]:
    """``(expected, room)`` from ``workers=N`` (N of N) or ``workers=(min, max)``."""
    if isinstance(workers, tuple | list) and len(workers) == 2:
        lo, hi = workers
    else:
        lo = hi = workers
    ok = all(map(_is_int, (lo, hi)))
    if not (ok and 0 <= lo <= hi and hi >= 1):
        raise ValueError(
            f"workers must be an int >= 1 or (min, max) with 0 <= min <= max, max >= 1; "
            f"got {workers!r}"
        )
    return lo, hi
