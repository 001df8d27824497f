"""Argument and array checks shared by the optimizers: each failure is a ``ValueError`` naming
the argument and the bad value, raised before any state or parameter is touched."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

import numpy as np

from stalewise.segments import Segments

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def check_number(
    where: str,
    name: str,
    value: object,
    lo: float,
    hi: float = math.inf,
    *,
    lo_open: bool = False,
    hi_open: bool = True,
) -> float:
    """``value`` as a float if in ``[lo, hi)`` (``lo_open``, ``hi_open``: open), else ValueError."""
    try:
        if isinstance(value, bool | str | bytes):  # float() takes them: True, "0.1"
            raise TypeError
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {name} must be a number, got {value!r}") from None
    below = x <= lo if lo_open else x < lo
    above = x >= hi if hi_open else x > hi
    if math.isnan(x) or below or above:
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise ValueError(f"{where}: {name} must be in {interval}, got {value!r}")
    return x


def check_int(where: str, name: str, value: object, lo: int) -> int:
    """Returns ``value`` as an int if it is a whole number >= ``lo``, else raises ``ValueError``."""
    x = check_number(where, name, value, lo)
    if not x.is_integer():
        raise ValueError(f"{where}: {name} must be a whole number, got {value!r}")
    return int(x)


def check_integer(name: str, value: object, low: int = 1) -> int:
    """``value`` as an int if it is an integer (not a bool) >= ``low``, else ValueError."""
    if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


def check_learning_rate(where: str, lr: object) -> None:
    if not callable(lr):
        check_number(where, "lr", lr, 0.0)


def compile_patterns(where: str, name: str, patterns: Iterable[str] | str) -> tuple[str, ...]:
    """Checks that ``patterns`` is a collection of valid regexes and returns it as a tuple."""
    if isinstance(patterns, str):
        patterns = (patterns,)
    out = tuple(patterns)
    for p in out:
        try:
            re.compile(p)
        except (TypeError, re.error) as e:
            raise ValueError(f"{where}: {name} has an invalid pattern {p!r}: {e}") from None
    return out


def check_params(params: np.ndarray, segments: Segments | None) -> Segments:
    """Checks a parameter vector and its segment table; returns the table (one leaf if None)."""
    if not isinstance(params, np.ndarray) or params.ndim != 1:
        raise ValueError(f"params must be a 1-D numpy array, got {_describe(params)}")
    if params.dtype not in FLOAT_DTYPES:
        raise ValueError(f"params must be float32 or float64, got {params.dtype}")
    if not params.flags.c_contiguous:
        raise ValueError("params must be C-contiguous")
    if segments is None:
        return Segments.single(params.size)
    if segments.total != params.size:
        raise ValueError(f"segments cover {segments.total} elements but params has {params.size}")
    return segments


def check_vectors(
    grads: np.ndarray, params: np.ndarray, *, write_grads: bool, write_params: bool
) -> None:
    """Checks that ``grads`` matches ``params`` (length, dtype, layout) before an update, that the
    vectors it writes are writeable, and that a written ``grads`` does not overlap ``params``."""
    if not isinstance(params, np.ndarray) or params.ndim != 1 or params.dtype not in FLOAT_DTYPES:
        raise ValueError(f"params must be a 1-D float32 or float64 array, got {_describe(params)}")
    if not isinstance(grads, np.ndarray) or grads.shape != params.shape:
        raise ValueError(
            f"grads must be a vector of length {params.size} like params, got {_describe(grads)}"
        )
    if grads.dtype != params.dtype:
        raise ValueError(f"grads must have the dtype of params ({params.dtype}), got {grads.dtype}")
    if not (grads.flags.c_contiguous and params.flags.c_contiguous):
        raise ValueError("grads and params must be C-contiguous")
    if write_grads and not grads.flags.writeable:
        raise ValueError("grads must be writeable: the in-place update uses it as scratch")
    if write_params and not params.flags.writeable:
        raise ValueError("params must be writeable for an in-place update")
    if write_grads and np.may_share_memory(grads, params):
        raise ValueError("grads and params must not share memory")


def check_buffers(where: str, params: np.ndarray, **buffers: np.ndarray) -> None:
    """Checks that state buffers are contiguous, with the length and dtype of ``params``."""
    for name, buf in buffers.items():
        if not isinstance(buf, np.ndarray):
            raise ValueError(f"{where}: state.{name} must be a numpy array, got {_describe(buf)}")
        if buf.dtype != params.dtype or buf.shape != params.shape or not buf.flags.c_contiguous:
            raise ValueError(
                f"{where}: state.{name} is {buf.dtype} of shape {buf.shape}, "
                f"params are {params.dtype} of shape {params.shape}"
            )


def check_scale(scale: object) -> float:
    return check_number("update", "scale", scale, 0.0)


def check_count(where: str, count: object) -> int:
    """The step counter of a state is a 0-d int64 array >= 0; returns its value."""
    if not (isinstance(count, np.ndarray) and count.shape == () and count.dtype == np.int64):
        raise ValueError(f"{where}: state.count must be a 0-d int64 array, got {_describe(count)}")
    if count < 0:
        raise ValueError(f"{where}: state.count must be >= 0, got {int(count)}")
    return int(count)


def _describe(x: object) -> str:
    if isinstance(x, np.ndarray):
        return f"{x.dtype} array of shape {x.shape}"
    return type(x).__name__
