"""Checkpoints of a shard: :meth:`Shard.state_dict` and :meth:`Shard.load_state_dict`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from stalewise.protocol.stats import _ClockTracker

if TYPE_CHECKING:
    from stalewise.protocol.shard import Shard

STATE_FORMAT = 2  # the layout of Shard.state_dict(); bump it when keys change meaning
_STAT_COUNTS = ("applied", "rounds", "duplicates", "bytes_in", "bytes_out", "mode_switches")
_STATE_KEYS = (
    "format",
    "workers",
    "params",
    "version",
    "clocks",
    "next_seq",
    "incarnation",
    "live",
    "round.sum",
    "round.done",
    "round.count",
    "round.waiting",
    "synchronous",
    "pace",
    "pulled.workers",
    "pulled.params",
    "opt_structure",
    *(f"stats.{key}" for key in (*_STAT_COUNTS, "rejected", "staleness")),
)


_OPTIONAL = ("counted", "resumed", "round.floor", "pace.since")  # see save()


def save(shard: Shard) -> dict[str, Any]:
    """All a shard needs to continue exactly, as a flat dict of copies (arrays, JSON values)."""
    structure, opt_arrays = _flatten_state(shard.opt_state)
    pulled = sorted(shard._pulled)
    timing = shard._pace is not None and not np.isnan(shard._pace._since).all()
    pulled_params = np.empty((len(pulled), shard.params.size), dtype=shard.params.dtype)
    for row, w in zip(pulled_params, pulled, strict=True):
        np.copyto(row, shard._pulled[w])
    stats = shard.stats
    return {
        "format": STATE_FORMAT,
        "workers": int(shard.workers),
        "params": shard.params.copy(),
        "version": int(shard.version),
        "clocks": shard.clocks.copy(),
        "next_seq": shard.next_seq.copy(),
        "incarnation": shard.incarnation.copy(),
        "live": shard.live.copy(),
        # only while a joiner has not pulled or pushed yet (the gates do not count it)
        **({"counted": shard.counted.copy()} if (shard.live & ~shard.counted).any() else {}),
        # only while a resumed job's seat waits for its worker's next incarnation
        **({"resumed": shard._resumed.copy()} if shard._resumed.any() else {}),
        # only once every counted worker has left (where a joiner starts: Shard.min_clock)
        **({"round.floor": int(shard._floor)} if shard._floor else {}),
        "round.sum": (
            np.empty(0, shard.params.dtype) if shard._round_sum is None else shard._round_sum.copy()
        ),
        "round.done": shard._round_done.copy(),
        "round.count": int(shard._round_count),
        "round.waiting": int(shard._round_waiting),
        "synchronous": bool(shard.synchronous),
        "pace": (
            shard._pace.state() if shard._pace is not None else np.full(shard.workers, np.nan)
        ),
        # hybrid, only while a served pull awaits its push (replaying a journal times it)
        **({"pace.since": shard._pace._since.copy()} if timing else {}),
        "pulled.workers": np.array(pulled, dtype=np.int64),
        "pulled.params": pulled_params,
        "opt_structure": structure,
        **{key: np.array(value, copy=True) for key, value in opt_arrays.items()},
        "stats.applied": int(stats.applied),
        "stats.rounds": int(stats.rounds),
        "stats.rejected": {str(k): int(n) for k, n in sorted(stats.rejected.items())},
        "stats.duplicates": int(stats.duplicates),
        "stats.staleness": [[int(t), int(n)] for t, n in sorted(stats.staleness.items())],
        "stats.bytes_in": int(stats.bytes_in),
        "stats.bytes_out": int(stats.bytes_out),
        "stats.mode_switches": int(stats.mode_switches),
    }


def load(shard: Shard, state: Mapping[str, Any]) -> None:
    """Restores a :meth:`state_dict` in place, after checking all of it (a ValueError names a
    bad key, the shard unchanged); the shard must be built as the one that made ``state``."""
    opt_state, pulled, round_sum, stats = _checked(shard, state)
    # Everything is checked: from here on nothing can fail half-way.
    np.copyto(shard.params, state["params"])
    shard.opt_state = opt_state
    shard.version = int(state["version"])
    for key, array in _worker_arrays(shard).items():
        np.copyto(array, state[key])
    np.copyto(shard.counted, _counted(state, shard.workers))
    np.copyto(shard._resumed, state.get("resumed", False))
    shard._clocks = _ClockTracker.of(shard.clocks, shard.counted)
    if round_sum is None or shard._round_sum is None:
        shard._round_sum = round_sum
    else:
        np.copyto(shard._round_sum, round_sum)
    shard._round_count = int(state["round.count"])
    shard._round_waiting = int(state["round.waiting"])
    shard._floor = int(state.get("round.floor", 0))  # checked by _checked
    shard.synchronous = bool(state["synchronous"])
    if shard._pace is not None:
        shard._pace.load(state["pace"], state.get("pace.since"))
    shard._pulled = pulled
    vars(shard.stats).update(stats)  # the same object: a runtime may hold it


def _counted(state: Mapping[str, Any], workers: int) -> np.ndarray:
    """The live workers the gates count: the state's ``counted`` (checked), else every one."""
    live = state["live"]
    if "counted" not in state:
        return live
    counted = _array(state, "counted", np.bool_, (workers,))
    if (counted & ~live).any():
        first = int(np.flatnonzero(counted & ~live)[0])
        raise _bad("counted", f"worker {first} counts for the gates but is not live")
    return counted


def _worker_arrays(shard: Shard) -> dict[str, np.ndarray]:
    return {
        "clocks": shard.clocks,
        "next_seq": shard.next_seq,
        "incarnation": shard.incarnation,
        "live": shard.live,
        "round.done": shard._round_done,
    }


def _checked(shard: Shard, state: Any) -> tuple[Any, dict, np.ndarray | None, dict]:
    """Checks a state dict against this shard, changing nothing; returns what :func:`load` sets."""
    if not isinstance(state, Mapping):
        raise ValueError(
            f"Shard.load_state_dict: expected a dict from state_dict(), got {type(state).__name__}"
        )
    for key in ("format", "opt_structure"):
        if key not in state:
            raise _bad(key, "missing key")
    fmt = state["format"]
    if isinstance(fmt, bool) or not isinstance(fmt, int) or fmt != STATE_FORMAT:
        raise _bad("format", f"unknown format {fmt!r}, expected {STATE_FORMAT}")
    opt_state = shard.optimizer.init(shard.params, shard.segments)
    structure, opt_arrays = _flatten_state(opt_state)
    if not isinstance(state["opt_structure"], str) or state["opt_structure"] != structure:
        raise _bad(
            "opt_structure",
            f"the state is of an optimizer with state {state['opt_structure']!r}, "
            f"this shard's optimizer has {structure!r}",
        )
    expected = [*_STATE_KEYS, *opt_arrays]
    for key in state:
        if key not in expected and key not in _OPTIONAL:
            raise _bad(key, "unknown key")
    for key in expected:
        if key not in state:
            raise _bad(key, "missing key")
    if not shard.params.flags.writeable:
        raise _bad("params", "this shard's params array is read-only")

    n, dtype, workers = shard.params.size, shard.params.dtype, shard.workers
    if _count(state, "workers") != workers:
        raise _bad(
            "workers", f"the state is of {state['workers']} workers, this shard has {workers}"
        )
    _array(state, "params", dtype, (n,))
    _count(state, "version")
    for key, array in _worker_arrays(shard).items():
        value = _array(state, key, array.dtype, (workers,))
        if value.dtype != np.bool_ and value.min() < 0:
            raise _bad(key, f"negative entry {int(value.min())}")
    done = state["round.done"]
    counted = _counted(state, workers)
    waiting = int(np.count_nonzero(counted & ~done))
    if _count(state, "round.waiting") != waiting:
        raise _bad(
            "round.waiting",
            f"{state['round.waiting']} does not match the {waiting} counted workers "
            "that have not pushed in this round",
        )
    if "round.floor" in state:
        _count(state, "round.floor")
    if (
        "resumed" in state
        and (_array(state, "resumed", np.bool_, (workers,)) & ~state["live"]).any()
    ):
        raise _bad("resumed", "a seat kept for a worker that is not live")
    round_count = _count(state, "round.count")
    round_sum = state["round.sum"]
    empty = isinstance(round_sum, np.ndarray) and round_sum.shape == (0,)
    _array(state, "round.sum", dtype, (0,) if empty else (n,))
    if round_count and not (shard.synchronous or shard.hybrid):
        raise _bad(
            "round.count",
            f"{round_count} pushes of an open BSP round, but this shard is {shard.consistency}",
        )
    synchronous = state["synchronous"]
    if not isinstance(synchronous, bool | np.bool_):
        raise _bad("synchronous", f"expected a bool, got {synchronous!r}")
    if bool(synchronous) != shard.synchronous and not shard.hybrid:
        raise _bad("synchronous", f"{synchronous!r} does not fit {shard.consistency}")
    if round_count and not synchronous:
        raise _bad("round.count", f"{round_count} pushes of a round, but the round is asynchronous")
    _array(state, "pace", np.float64, (workers,))
    if "pace.since" in state:  # optional: save()
        _array(state, "pace.since", np.float64, (workers,))
    if round_count and not round_sum.size:
        raise _bad("round.sum", f"empty, but round.count is {round_count}")

    ids = _array(state, "pulled.workers", np.int64, (np.size(state["pulled.workers"]),))
    if len(set(ids.tolist())) != ids.size or not all(0 <= w < workers for w in ids.tolist()):
        raise _bad(
            "pulled.workers",
            f"expected distinct worker ids in 0..{workers - 1}, got {ids.tolist()}",
        )
    _array(state, "pulled.params", dtype, (ids.size, n))

    for key, array in opt_arrays.items():
        np.copyto(array, _array(state, key, array.dtype, array.shape))

    stats = {key: _count(state, f"stats.{key}") for key in _STAT_COUNTS}
    rejected = state["stats.rejected"]
    if not (isinstance(rejected, Mapping) and all(isinstance(k, str) for k in rejected)):
        raise _bad("stats.rejected", f"expected a dict of kind -> count, got {rejected!r}")
    stats["rejected"] = Counter({k: _count(rejected, k, "stats.rejected") for k in rejected})
    pairs = state["stats.staleness"]
    if not (
        isinstance(pairs, list | tuple)
        and all(isinstance(p, list | tuple) and len(p) == 2 for p in pairs)
    ):
        raise _bad("stats.staleness", f"expected a list of [tau, count] pairs, got {pairs!r}")
    stats["staleness"] = Counter()
    for pair in pairs:
        tau, count = (_count(pair, i, "stats.staleness") for i in range(2))
        if tau in stats["staleness"]:
            raise _bad("stats.staleness", f"tau {tau} appears twice")
        stats["staleness"][tau] = count

    pulled = {int(w): row.copy() for w, row in zip(ids, state["pulled.params"], strict=True)}
    return opt_state, pulled, (round_sum.copy() if round_sum.size else None), stats


def _bad(key: str, problem: str) -> ValueError:
    return ValueError(f"Shard.load_state_dict: {key!r}: {problem}")


def _array(state: Mapping[str, Any], key: str, dtype: Any, shape: tuple[int, ...]) -> np.ndarray:
    value = state[key]
    if not (isinstance(value, np.ndarray) and value.dtype == dtype and value.shape == shape):
        got = (
            f"{value.dtype} array of shape {value.shape}"
            if isinstance(value, np.ndarray)
            else type(value).__name__
        )
        raise _bad(key, f"expected a {np.dtype(dtype)} array of shape {shape}, got {got}")
    return value


def _count(container: Any, key: Any, name: str | None = None) -> int:
    value = container[key]
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
        raise _bad(name or key, f"expected an integer >= 0, got {value!r}")
    return int(value)


def _flatten_state(state: Any) -> tuple[str, dict[str, np.ndarray]]:
    """The structure signature of an optimizer state (``"(EmptyState(), AdamState(count, mu,
    nu))"``) and its arrays by key (``opt.1.count``, ...; not copied)."""
    arrays: dict[str, np.ndarray] = {}

    def walk(node: Any, path: str) -> str | None:  # None: an array
        if isinstance(node, np.ndarray):
            arrays[path] = node
            return None
        if not isinstance(node, tuple):
            raise TypeError(
                f"optimizer state leaf {path!r} is a {type(node).__name__}; "
                "state_dict supports numpy arrays in (named) tuples only"
            )
        fields = getattr(node, "_fields", None)
        names = fields if fields is not None else [str(k) for k in range(len(node))]
        subs = [walk(x, f"{path}.{name}") for name, x in zip(names, node, strict=True)]
        if fields is None:
            items = ["array" if sub is None else sub for sub in subs]
            return f"({', '.join(items)}{',' if len(items) == 1 else ''})"
        items = [f if sub is None else f"{f}={sub}" for f, sub in zip(fields, subs, strict=True)]
        return f"{type(node).__name__}({', '.join(items)})"

    structure = walk(state, "opt")
    return ("array" if structure is None else structure), arrays
