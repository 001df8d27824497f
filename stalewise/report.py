"""Metrics files (JSON Lines), time-to-target, plots (Matplotlib's Agg canvas), text tables."""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from stalewise import targets
from stalewise.targets import by_run, finite

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
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"cannot write {type(value).__name__} to a metrics file")


class MetricsWriter:
    """Appends flushed records to the JSON Lines ``path``; threads, not processes, may share it."""

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

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a metrics file, in order. Blank lines and a truncated last line (logged)
    are skipped; a malformed line elsewhere raises ValueError naming it."""
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


def time_to_target(
    records: Iterable[Mapping[str, Any]],
    key: str,
    target: float,
    mode: Literal["max", "min"] | None = None,
    *,
    run: str | None = None,
    x: str = "time",
) -> float | None:
    """:func:`stalewise.targets.time_to_target` with ``Target(key, target, mode)``."""
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
    """Plots metrics against ``x`` into the PNG ``path`` (returned), a subplot per key."""
    runs = by_run(records)
    present = [k for k in keys if any(finite(r.get(k)) for rs in runs.values() for r in rs)]
    if not present:
        raise ValueError(f"none of the keys {list(keys)} occurs in the records")
    targets = dict(targets or {})
    fig, axes = figure(5.0 * len(present), 3.8, len(present))
    for ax, key in zip(axes, present, strict=True):
        draw(ax, runs, x, key, targets.get(key), xlabel or _LABELS.get(x, x), _LABELS.get(key, key))
    if title:
        fig.suptitle(title)
    logger.debug("wrote plot %s (%d runs, keys %s)", path, len(runs), present)
    return save(fig, path)


def figure(width: float, height: float, columns: int) -> tuple[Any, Any]:
    """A Matplotlib figure on the Agg canvas and its row of ``columns`` axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, columns, squeeze=False)[0]


def draw(ax: Any, runs: Mapping, x: str, key: str, target: Any, xlabel: str, ylabel: str) -> None:
    """``key`` against ``x``, a line per run (``{name: records}``) and ``target`` (if not None)
    dashed; a log scale for positive values spanning more than two decades."""
    values = []
    for name, rs in runs.items():
        points = sorted((r[x], r[key]) for r in rs if finite(r.get(x)) and finite(r.get(key)))
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, label=name or "run", linewidth=1.5)
            values.extend(ys)
    if target is not None:
        ax.axhline(target, color="0.3", linestyle="--", linewidth=1.0, label="target")
    positive = [v for v in values if v > 0]
    if positive and len(positive) == len(values) and max(positive) > 100 * min(positive):
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def save(fig: Any, path: str | os.PathLike[str]) -> Path:
    """Writes ``fig`` as the PNG ``path`` (its folder created); the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out


def _format_cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    if isinstance(value, numbers.Integral):
        return f"{int(value):d}"
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
    """Rows (mappings) as an aligned text table of ``columns``, missing values as ``—``."""
    cells = [[_format_cell(row.get(c)) for c in columns] for row in rows]

    def number(v: Any) -> bool:
        return isinstance(v, numbers.Number) and not isinstance(v, bool)

    numeric = [all(number(r[c]) for r in rows if r.get(c) is not None) for c in columns]
    widths = [max([len(c)] + [len(line[i]) for line in cells]) for i, c in enumerate(columns)]

    def fmt(line: Sequence[str]) -> str:
        triples = zip(line, widths, numeric, strict=True)
        return "  ".join(s.rjust(w) if num else s.ljust(w) for s, w, num in triples).rstrip()

    out = [fmt(list(columns)), fmt(["-" * w for w in widths])]
    out.extend(fmt(line) for line in cells)
    return "\n".join(out)
