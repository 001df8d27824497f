"""Metrics files, time-to-target, plots and text tables.

Runtimes append one JSON object per line to a metrics file (JSON Lines, UTF-8,
flushed after every record, so a crashed or still-running job leaves a
readable file). Every record describes one evaluation of one run:

| key              | type           | meaning                                                  |
| ---------------- | -------------- | -------------------------------------------------------- |
| `run`            | str            | run label; one file may hold several runs                |
| `time`           | float          | seconds since the run started (wall clock or virtual)    |
| `updates`        | int            | updates applied by the server(s) so far                  |
| `loss`           | float          | held-out loss (NaN if training diverged)                 |
| `accuracy`       | float          | held-out accuracy in [0, 1] (classifiers only, optional) |
| `staleness_mean` | float          | mean staleness of the pushes applied since the last record |
| `staleness_max`  | int            | largest staleness seen since the last record             |

Any other key (``"distance"``, ``"workers"``, ``"lr"``, ...) is allowed and
kept. NumPy scalars and arrays are converted to plain JSON numbers and lists;
non-finite floats are written as ``NaN``/``Infinity``, which Python's
``json`` module reads back.

Plots use Matplotlib's object-oriented API on an Agg canvas: no window, no
global ``pyplot`` state, safe in worker threads.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from stalewise import targets

logger = logging.getLogger(__name__)

__all__ = ["MetricsWriter", "format_table", "plot_runs", "read_metrics", "time_to_target"]

_LABELS = {
    "time": "time (s)",
    "updates": "applied updates",
    "loss": "evaluation loss",
    "accuracy": "held-out accuracy (fraction)",
    "distance": "relative distance to x* (||x - x*|| / ||x*||)",
    "staleness_mean": "mean staleness (updates)",
    "staleness_max": "max staleness (updates)",
}


def _to_json(value: Any) -> Any:
    """``json.dumps`` fallback for NumPy (and other array-library) values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to a metrics file")


class MetricsWriter:
    """Appends metric records to a JSON Lines file.

    Opening appends to an existing file (resuming a job keeps its history);
    parent directories are created. Each :meth:`write` is one flushed
    ``write`` call of one line, guarded by a lock, so threads may share a
    writer; separate processes should write separate files.

    Args:
        path: the metrics file, conventionally ``*.jsonl``.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
        >>> with MetricsWriter(path) as w:
        ...     w.write({"run": "asp", "time": 0.5, "updates": 10, "loss": 1.2})
        >>> read_metrics(path)[0]["updates"]
        10
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: Mapping[str, Any]) -> None:
        """Appends one record (a mapping with string keys) and flushes it."""
        line = json.dumps(dict(record), default=_to_json, separators=(",", ":"))
        with self._lock:
            if self._file.closed:
                raise ValueError(f"MetricsWriter for {self.path} is closed")
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        """Closes the file; further writes raise ValueError."""
        with self._lock:
            self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Reads all records of a metrics file, in file order.

    Blank lines are skipped. A truncated last line (a writer killed mid-write)
    is skipped with a logged warning; a malformed line elsewhere raises.

    Args:
        path: a file written by :class:`MetricsWriter`.

    Returns:
        The records as dicts.

    Raises:
        ValueError: on a malformed line that is not the last one.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), "m.jsonl")
        >>> with MetricsWriter(path) as w:
        ...     w.write({"run": "a", "time": 1.0, "loss": 0.5})
        >>> read_metrics(path)
        [{'run': 'a', 'time': 1.0, 'loss': 0.5}]
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if number == len(lines):
                logger.warning("%s: skipping truncated last line %d", path, number)
                continue
            raise ValueError(f"{path}:{number}: not a JSON record: {err}") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {line[:40]!r}")
        records.append(record)
    return records


def _runs(records: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """Groups records by ``run`` in order of first appearance."""
    runs: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        runs.setdefault(str(r.get("run", "")), []).append(r)
    return runs


def _finite(value: Any) -> bool:
    return isinstance(value, numbers.Real) and math.isfinite(value)


def time_to_target(
    records: Iterable[Mapping[str, Any]],
    key: str,
    target: float,
    mode: Literal["max", "min"] | None = None,
    *,
    run: str | None = None,
    x: str = "time",
) -> float | None:
    """Returns the first ``x`` at which a run's metric reaches ``target``.

    A shorthand for :func:`stalewise.targets.time_to_target` with
    ``Target(key, target, mode)``.

    Args:
        records: metric records (see the module docstring).
        key: the metric, e.g. ``"accuracy"``.
        target: the value to reach.
        mode: ``"max"`` if larger is better (reached when ``value >= target``),
            ``"min"`` if smaller is better (reached when ``value <= target``);
            None (default) infers it from ``key`` (see :func:`stalewise.targets.infer_mode`).
        run: the run to look at; may be omitted when the records hold one run.
        x: the clock to report, ``"time"`` (default) or e.g. ``"updates"``.

    Returns:
        The ``x`` of the first such record (records are ordered by ``x``), or
        None if the target is never reached.

    Raises:
        ValueError: on a bad ``mode``, or none given for a ``key`` whose name tells
            no direction, or if ``run`` is None but the records hold several runs,
            or ``run`` is not among them.

    Example:
        >>> recs = [{"run": "a", "time": t, "loss": 1 / (1 + t)} for t in range(10)]
        >>> time_to_target(recs, "loss", 0.2)
        4
        >>> time_to_target(recs, "loss", 0.01, mode="min") is None
        True
    """
    return targets.time_to_target(records, targets.Target(key, target, mode), run, x=x)


def plot_runs(
    records: Iterable[Mapping[str, Any]],
    path: str | os.PathLike[str],
    *,
    x: str = "time",
    keys: Sequence[str] = ("accuracy", "loss"),
    title: str | None = None,
    targets: Mapping[str, float] | None = None,
    xlabel: str | None = None,
) -> Path:
    """Plots metrics against ``x``: one subplot per key, one line per run.

    Keys that no record has are left out (``"accuracy"`` for a regression
    task); a key whose positive values span more than two decades (a loss,
    usually) gets a log scale.

    Args:
        records: metric records (see the module docstring).
        path: the PNG to write; parent directories are created.
        x: the horizontal axis, ``"time"`` or ``"updates"`` (or any numeric key).
        keys: the metrics to plot, one subplot each.
        title: the figure title.
        targets: optional ``{key: value}`` drawn as dashed horizontal lines.
        xlabel: the horizontal axis's label (e.g. ``"virtual time (s)"`` for a
            simulated run); default from ``x``.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: if none of ``keys`` occurs in the records.

    Example:
        >>> import tempfile, os
        >>> recs = [{"run": "asp", "time": t, "loss": 2.0 / (t + 1)} for t in range(5)]
        >>> out = plot_runs(recs, os.path.join(tempfile.mkdtemp(), "p.png"), keys=["loss"])
        >>> out.stat().st_size > 1000
        True
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = _runs(records)
    present = [k for k in keys if any(_finite(r.get(k)) for rs in runs.values() for r in rs)]
    if not present:
        raise ValueError(f"none of the keys {list(keys)} occurs in the records")
    targets = dict(targets or {})

    fig = Figure(figsize=(5.0 * len(present), 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(present), squeeze=False)[0]
    for ax, key in zip(axes, present, strict=True):
        values = []
        for name, rs in runs.items():
            points = sorted((r[x], r[key]) for r in rs if _finite(r.get(x)) and _finite(r.get(key)))
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, label=name or "run", linewidth=1.5)
                values.extend(ys)
        if key in targets:
            ax.axhline(targets[key], color="0.3", linestyle="--", linewidth=1.0, label="target")
        positive = [v for v in values if v > 0]
        if positive and len(positive) == len(values) and max(positive) > 100 * min(positive):
            ax.set_yscale("log")
        ax.set_xlabel(xlabel or _LABELS.get(x, x))
        ax.set_ylabel(_LABELS.get(key, key))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    logger.debug("wrote plot %s (%d runs, keys %s)", out, len(runs), present)
    return out


def _format_cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, numbers.Number):
        return str(value)
    if isinstance(value, numbers.Integral):
        return f"{int(value):d}"
    if not isinstance(value, numbers.Real):
        return str(value)
    v = float(value)
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a == 0:
        return "0"
    if a >= 1e6 or a < 1e-3:
        return f"{v:.3e}"
    if a >= 100:
        return f"{v:.1f}"
    return f"{v:.4g}"


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> str:
    """Formats rows as a plain, aligned text table.

    Numbers are right-aligned (integers in full, floats to about four
    significant digits, very large or small ones in scientific notation),
    other values left-aligned; missing values and None show as ``—``.

    Args:
        rows: one mapping per row.
        columns: the keys to show, in order; they are also the headers.

    Returns:
        The table, lines joined with ``\\n``, no trailing newline.

    Example:
        >>> print(format_table([{"run": "asp", "loss": 0.123456, "updates": 1200},
        ...                     {"run": "ssp", "loss": None, "updates": 980}],
        ...                    ["run", "updates", "loss"]))
        run  updates    loss
        ---  -------  ------
        asp     1200  0.1235
        ssp      980       —
    """
    cells = [[_format_cell(row.get(c)) for c in columns] for row in rows]
    numeric = [
        all(
            isinstance(row.get(c), numbers.Number) and not isinstance(row.get(c), bool)
            for row in rows
            if row.get(c) is not None
        )
        for c in columns
    ]
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]

    def fmt(line: Sequence[str]) -> str:
        parts = [
            s.rjust(w) if num else s.ljust(w)
            for s, w, num in zip(line, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    out = [fmt(list(columns)), fmt(["-" * w for w in widths])]
    out.extend(fmt(line) for line in cells)
    return "\n".join(out)
