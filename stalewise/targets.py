"""Targets: "this metric reaches that value", going down or up (``mode``, else by the name)."""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

__all__ = ["Mode", "StopAt", "Target", "all_reached", "infer_mode", "parse", "time_to_target"]

Mode: TypeAlias = Literal["min", "max"]

#: Name parts of metrics that should go down (checked as whole words, see :func:`infer_mode`).
MIN_WORDS = frozenset({"loss", "error", "err", "perplexity", "ppl", "mse", "mae", "rmse", "nll"})
MIN_WORDS |= {"time", "distance", "dist", "cost", "regret"}
#: Name parts of metrics that should go up.
MAX_WORDS = frozenset({"acc", "accuracy", "f1", "auc", "precision", "recall", "score", "bleu"})
MAX_WORDS |= {"r2", "reward", "iou"}
# Also found ending a run-together word ("valloss"); not "time" ("uptime") nor "r2" ("layer2").
_SUFFIXES = tuple(
    (w, mode)
    for words, mode in ((MIN_WORDS, "min"), (MAX_WORDS, "max"))
    for w in sorted(words, key=len, reverse=True)
    if len(w) >= 3 and w != "time"
)
_NEGATED = frozenset({"neg", "negative"})  # scikit-learn's "neg_log_loss" goes up


def _word_mode(word: str) -> Mode | None:
    if word in MIN_WORDS:
        return "min"
    if word in MAX_WORDS:
        return "max"
    bare = word.rstrip("0123456789")  # "acc1", "loss2"
    if bare != word and len(bare) >= 3 and (bare in MIN_WORDS or bare in MAX_WORDS):
        return "min" if bare in MIN_WORDS else "max"
    return next((mode for w, mode in _SUFFIXES if bare.endswith(w)), None)


def infer_mode(metric: str) -> Mode:
    """The direction of a metric from the words of its name (:data:`MIN_WORDS`,
    :data:`MAX_WORDS`, ``neg`` flips); ValueError if none tells or they disagree."""
    words = re.findall(r"[a-z0-9]+", re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", metric).lower())
    negated = bool(words) and words[0] in _NEGATED
    found = {w: m for w in (words[1:] if negated else words) if (m := _word_mode(w)) is not None}
    modes = set(found.values())
    hint = "pass mode='min' (smaller is better) or mode='max' (larger is better)"
    if not modes:
        raise ValueError(f"cannot tell whether metric {metric!r} should go down or up: {hint}")
    if len(modes) > 1:
        down = [w for w, m in found.items() if m == "min"]
        up = [w for w, m in found.items() if m == "max"]
        raise ValueError(
            f"metric {metric!r} is ambiguous ({', '.join(down)} goes down, "
            f"{', '.join(up)} goes up): {hint}"
        )
    mode = modes.pop()
    if negated:
        return "max" if mode == "min" else "min"
    return mode


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def finite(value: Any) -> bool:
    """A finite real number (a bool is not one)."""
    return _is_number(value) and math.isfinite(value)


def by_run(records: Iterable[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """The records grouped by ``run``, in order of first appearance."""
    runs: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        runs.setdefault(str(r.get("run", "")), []).append(r)
    return runs


@dataclass(frozen=True)
class Target:
    """A metric and the value it should reach, going down (``"min"``) or up (``"max"``);
    ``mode=None`` infers the direction from the metric's name (see :func:`infer_mode`)."""

    metric: str
    value: float
    mode: Mode | None = None  # None: inferred, so never None on a built Target

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric.strip():
            raise ValueError(f"target metric must be a non-empty name, got {self.metric!r}")
        if not _is_number(self.value) or not math.isfinite(self.value):
            raise ValueError(
                f"target for {self.metric!r} must be a finite number, got {self.value!r}"
            )
        if self.mode not in (None, "min", "max"):
            raise ValueError(f"target mode must be 'min' or 'max', got {self.mode!r}")
        object.__setattr__(self, "value", float(self.value))
        object.__setattr__(self, "mode", self.mode or infer_mode(self.metric))

    @property
    def op(self) -> str:
        return "<=" if self.mode == "min" else ">="

    def reached(self, value: Any) -> bool:
        """True if ``value`` meets the target; NaN, infinities and non-numbers never do."""
        if not _is_number(value) or not math.isfinite(value):
            return False
        return value <= self.value if self.mode == "min" else value >= self.value

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.value:g}"


StopAt: TypeAlias = Target | Sequence[Target] | Mapping[str, Any] | None


def _entry(key: Any, spec: Any, where: str) -> Target:
    """One ``{metric: spec}`` entry of a mapping as a Target."""
    if not isinstance(key, str) or not key.strip():
        raise ValueError(f"{where}: metric names must be non-empty strings, got {key!r}")
    name = f"{where}.{key}"
    if isinstance(spec, tuple | list | Mapping):
        if isinstance(spec, tuple | list) and len(spec) == 2:
            value, mode = spec
        elif isinstance(spec, Mapping) and "value" in spec and set(spec) <= {"value", "mode"}:
            value, mode = spec["value"], spec.get("mode")
        else:
            raise TypeError(
                f"{name}: expected a number, a (value, mode) pair or "
                f"{{'value': ..., 'mode': ...}}, got {spec!r}"
            )
    else:
        value, mode = spec, None
    if not _is_number(value):
        raise ValueError(f"{name}: the value to reach must be a number, got {value!r}")
    try:  # Target infers a mode of None from the name
        return Target(key, value, mode)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def parse(stop_at: Any, *, where: str = "stop_at") -> tuple[Target, ...]:
    """Normalises a ``stop_at`` setting (None, Targets, or a mapping of metric name to the value,
    ``(value, mode)`` or ``{"value": v, "mode": m}``) to a tuple of Targets."""
    if stop_at is None:
        return ()
    if isinstance(stop_at, Target):
        return (stop_at,)
    if isinstance(stop_at, Mapping):
        return tuple(_entry(k, v, where) for k, v in stop_at.items())
    if isinstance(stop_at, list | tuple):
        for i, t in enumerate(stop_at):
            if not isinstance(t, Target):
                raise TypeError(f"{where}[{i}]: expected a Target, got {t!r}")
        return tuple(stop_at)
    raise TypeError(
        f"{where}={stop_at!r}: expected a mapping of metric to value such as "
        f"{{'accuracy': 0.95}}, a Target or a list of Targets"
    )


def all_reached(targets: Iterable[Target], record: Mapping[str, Any]) -> bool:
    """True if ``record`` meets every target (a missing metric does not); False if there are none."""
    found = False
    for t in targets:
        if not t.reached(record.get(t.metric)):
            return False
        found = True
    return found


def time_to_target(
    records: Iterable[Mapping[str, Any]], target: Target, run: str | None = None, *, x: str = "time"
) -> Any:
    """The first ``x`` at which a run's records reach ``target`` (None: never)."""
    if not isinstance(target, Target):
        raise TypeError(f"target must be a Target, got {target!r}")
    runs = by_run(records)
    if run is None:
        if len(runs) > 1:
            raise ValueError(f"records hold several runs, pass run= one of {list(runs)}")
        selected = next(iter(runs.values()), [])
    elif run in runs:
        selected = runs[run]
    else:
        raise ValueError(f"no run {run!r} in the records; runs: {list(runs)}")
    for r in sorted((r for r in selected if finite(r.get(x))), key=lambda r: r[x]):
        if target.reached(r.get(target.metric)):
            return r[x]
    return None
