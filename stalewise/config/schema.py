"""The config's tables, keys and limits, its error, and the checks of single values."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from stalewise import runtime as runtime_lib
from stalewise import targets
from stalewise.options import Failures
from stalewise.runtime.base import MAX_SLOWDOWN
from stalewise.runtime.options import DEFAULTS, OptionError, RunOptions
from stalewise.targets import _is_int as is_int  # an int, not a bool

TABLES = {
    "task": {"name", "factory", "args", "seed"},
    "optimizer": None,  # checked against the chosen optimizer's signature
    "server": {"consistency", "bound", "tolerance", "staleness", "staleness_param"}
    | {"max_staleness", "dc_lambda", "shards", "codec", "pull_codec", "replicas"},
    "run": {"workers", "steps", "delay", "stragglers", "eval_interval", "stop_at", "runtime"}
    | {"address", *Failures.FIELDS.values()},  # on_worker_failure, max_restarts, ...
    "sim": None,  # checked by SimConfig.from_dict (its TOML_KEYS)
    "strategy": None,  # checked against the chosen strategy's signature
}
OPTIMIZERS = ("sgd", "adam", "adamw", "lamb", "lars")
SCHEDULES = ("constant", "warmup_cosine", "step_decay")
STRATEGIES = ("gradients", "local_sgd", "diloco", "streaming_diloco", "easgd", "adaptive")
PERIOD_SCHEDULES = ("comm_budget", "adacomm", "fixed")  # strategy.schedule of "adaptive"
#: The strategies a ``NAME:H`` value of ``stalewise sim --over strategy`` sets ``local_steps`` of.
LOCAL_STEPS = ("local_sgd", "diloco", "streaming_diloco", "easgd", "adaptive")
CONSISTENCY = ("asp", "ssp", "bsp", "hybrid")
STALENESS_PARAM = {"exponential": "base", "polynomial": "power"}  # server.staleness_param

MAX_SHARDS = 1024  #: The most parameter-server shards (and never more than the parameters).
MAX_STEPS = 10**9  #: The most pushes a run may be given.
MAX_DEPTH = 32  #: The deepest nesting of arrays and tables a config may have.


class ConfigError(ValueError):
    """A bad config key or value, or a bad command-line flag: ``key`` as the user spells it,
    ``problem`` what was expected and given, ``path`` the config file (None: none)."""

    def __init__(self, key: str, problem: str, path: str | os.PathLike[str] | None = None):
        self.key, self.problem, self.path = key, problem, path
        super().__init__(key, problem)

    def __str__(self) -> str:
        text = f"{self.key}: {self.problem}"
        return f"{text} (in {self.path})" if self.path is not None else text


def one_of(name: Any, known: Iterable[str], key: str, what: str) -> str:
    """``name`` if it is one of ``known``, else an error naming ``key``: ``unknown {what}``."""
    if not isinstance(name, str) or name not in known:
        raise ConfigError(key, f"unknown {what} {name!r} (known: {', '.join(known)})")
    return name


def max_workers(runtime: str) -> int:
    return runtime_lib.describe(runtime).max_workers


def check_depth(raw: Mapping[str, Any]) -> None:
    """Refuses values nested more than MAX_DEPTH levels (they would recurse past the limit)."""
    todo: list[tuple[str, Any, int]] = [(str(k), v, 1) for k, v in raw.items()]
    while todo:
        key, value, depth = todo.pop()
        if depth > MAX_DEPTH:
            top = ".".join(key.split("[")[0].split(".")[:2])  # run.stop_at, not its 33 levels
            raise ConfigError(top, f"nested more than {MAX_DEPTH} levels deep")
        if isinstance(value, Mapping):
            todo.extend((f"{key}.{k}", v, depth + 1) for k, v in value.items())
        elif isinstance(value, list | tuple):
            todo.extend((f"{key}[{i}]", v, depth + 1) for i, v in enumerate(value))


def describe(kinds: Sequence[str]) -> str:
    return " or ".join(dict.fromkeys(kinds))


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def get(
    table: dict,
    name: str,
    kind: type,
    default: Any,
    low: float | None = None,
    high: float | None = None,
) -> Any:
    """``table[key]`` (the last part of ``name``) checked: its type, finite, in range."""
    value = table.get(name.split(".")[-1], default)
    ok = {int: is_int, float: is_number, str: lambda v: isinstance(v, str)}[kind](value)
    if not ok:
        what = {int: "an integer", float: "a number", str: "a string"}[kind]
        raise ConfigError(name, f"expected {what}, got {value!r}")
    if kind is float and not math.isfinite(value):
        raise ConfigError(name, f"expected a finite number, got {value!r}")
    if low is not None and value < low:
        raise ConfigError(name, f"must be >= {low}, got {value!r}")
    if high is not None and value > high:
        raise ConfigError(name, f"must be <= {high}, got {value!r}")
    return kind(value)


#: [run] keys whose None (never) is spelled ``false`` in TOML, which has no None.
NEVER_IS_FALSE = ("max_restarts", "worker_timeout", "diverge_after")


def run_option(table: dict, name: str) -> Any:
    """``run.<name>`` (default: :data:`~stalewise.runtime.options.DEFAULTS`'s), checked by
    :meth:`RunOptions.check`, the check ``Job.train`` runs; an error names ``run.<name>``."""
    value = table.get(name, DEFAULTS[name])
    if value is False and name in NEVER_IS_FALSE:
        return None
    try:
        return RunOptions.check(name, value)
    except OptionError as e:
        problem = (
            e.problem.replace(" or None", " or false") if name in NEVER_IS_FALSE else e.problem
        )
        raise ConfigError(f"run.{name}", problem) from None


def check_runtime(name: str | None, key: str) -> None:
    """``name`` (if given) is a known runtime, its packages installed; errors name ``key``."""
    if name is not None:
        one_of(name, runtime_lib.names(), key, "runtime")
    missing = name and runtime_lib.describe(name).missing()
    if missing:
        raise ConfigError(key, missing)


def check_workers(workers: int, runtime: str, key: str) -> None:
    limit = max_workers(runtime)
    if workers > limit:
        what = f"workers on runtime {runtime!r}"
        most = max(runtime_lib.names(), key=max_workers)
        hint = f"; runtime {most!r} takes up to {max_workers(most)}" if most != runtime else ""
        raise ConfigError(key, f"at most {limit} {what}, got {workers}{hint}")


def stragglers(spec: Any, workers: int) -> dict[int, float]:
    """run.stragglers: a table {worker = slowdown factor}."""
    if spec is None:
        return {}
    if not isinstance(spec, dict):
        example = "{ 3 = 4.0 }"
        if isinstance(spec, list) and all(is_number(f) for f in spec):
            slow = [f"{w} = {f:g}" for w, f in enumerate(spec) if f != 1]
            example = f"{{ {', '.join(slow)} }} for {spec!r}" if slow else "{ 3 = 4.0 }"
        raise ConfigError(
            "run.stragglers",
            f"expected a table of worker = slowdown factor, such as {example}, got {spec!r}",
        )
    out = {}
    for w, f in spec.items():
        try:
            worker = int(w)
        except ValueError:
            raise ConfigError(
                "run.stragglers", f"expected worker ids (integers) as keys, got {w!r}"
            ) from None
        if not 0 <= worker < workers:
            raise ConfigError(
                "run.stragglers", f"unknown worker {worker} (workers are 0..{workers - 1})"
            )
        if not (is_number(f) and 1 <= f <= MAX_SLOWDOWN):  # NaN fails too
            raise ConfigError(
                f"run.stragglers.{w}",
                f"expected a slowdown factor, a number in [1, {MAX_SLOWDOWN:g}], got {f!r}",
            )
        out[worker] = float(f)
    return out


def stop_at(spec: Any) -> tuple[targets.Target, ...] | None:
    """run.stop_at as Targets (None if absent or empty); a bad entry names its key."""
    if spec is not None and not isinstance(spec, dict):
        raise ConfigError(
            "run.stop_at",
            f"expected a table of metric = value to reach such as stop_at = {{ accuracy = 0.95 }}; "
            f"run.stop_at={spec!r} names no metric",
        )
    try:
        found = targets.parse(spec, where="run.stop_at") or None
    except (TypeError, ValueError) as e:
        key, sep, problem = str(e).partition(": ")  # "key: problem", else the table's key
        if sep and re.fullmatch(r"[\w.\[\]-]+", key) and key.startswith("run.stop_at"):
            error = ConfigError(key, problem)
        else:
            error = ConfigError("run.stop_at", str(e))
        if "should go down or up" in error.problem:
            error.problem += (
                f' (write {error.key.rpartition(".")[2]} = [value, "min"] or [value, "max"])'
            )
        raise error from None
    return found


def parse_strategy_value(value: str) -> tuple[str, int | None]:
    """``"diloco:20"`` -> ``("diloco", 20)``, ``"gradients"`` -> ``("gradients", None)``."""
    name, sep, period = value.strip().partition(":")
    name = name.strip()
    if name not in STRATEGIES:
        raise ValueError(
            f"expected strategies such as gradients,local_sgd:8,diloco:20 "
            f"(known: {', '.join(STRATEGIES)}), got {value!r}"
        )
    if not sep:
        return name, None
    if name not in LOCAL_STEPS:
        raise ValueError(f"{value!r}: {name} takes no number of local steps")
    try:
        steps = int(period)
    except ValueError:
        steps = 0
    if steps < 1:
        raise ValueError(
            f"{value!r}: expected {name}:H with H local steps, an integer >= 1, got {period!r}"
        )
    return name, steps
