"""The per-leaf table kept in the state of LAMB and LARS, and of SGD and Adam(W) with exclusions,
checked before every update (the kernels do no bounds checks)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from stalewise.segments import Segments

logger = logging.getLogger(__name__)


class DecayTable(NamedTuple):
    offsets: np.ndarray  # int64 start of each leaf in the flat vector
    sizes: np.ndarray  # int64 length of each leaf
    decay: np.ndarray  # bool per leaf: weight decay applies


class LeafTable(NamedTuple):
    offsets: np.ndarray  # int64 start of each leaf in the flat vector
    sizes: np.ndarray  # int64 length of each leaf
    decay: np.ndarray  # bool per leaf: weight decay applies
    adapt: np.ndarray  # bool per leaf: the trust ratio applies (else it is fixed at 1)
    trust_ratio: np.ndarray  # float64 per leaf: the ratio used by the last update


def decay_table(segments: Segments, exclude_from_weight_decay: Sequence[str]) -> DecayTable:
    """The leaves of ``segments`` and whether each gets weight decay (no pattern matches its name)."""
    no_decay = segments.mask(exclude_from_weight_decay)
    _log("weight decay", segments, no_decay)
    return DecayTable(
        offsets=np.array(segments.offsets, dtype=np.int64),
        sizes=np.array(segments.sizes, dtype=np.int64),
        decay=~no_decay,
    )


def build(
    segments: Segments,
    exclude_from_weight_decay: Sequence[str],
    exclude_from_adaptation: Sequence[str],
) -> LeafTable:
    """The table for ``segments``, with the exclusions matched on leaf names."""
    no_adapt = segments.mask(exclude_from_adaptation)
    _log("adaptation", segments, no_adapt)
    return LeafTable(
        *decay_table(segments, exclude_from_weight_decay),
        adapt=~no_adapt,
        trust_ratio=np.ones(len(segments), dtype=np.float64),
    )


def unmatched(optimizer: Any, segments: Segments) -> list[tuple[str, str]]:
    """The ``(field, pattern)`` exclusions of ``optimizer`` that match no leaf of ``segments``."""
    rule = getattr(optimizer.init, "__self__", None)
    out = [hit for part in getattr(rule, "parts", ()) for hit in unmatched(part, segments)]
    for field in ("exclude_from_weight_decay", "exclude_from_adaptation"):
        out += [(field, p) for p in getattr(rule, field, ()) if not segments.mask([p]).any()]
    return out


def _log(what: str, segments: Segments, excluded: np.ndarray) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        names = np.array(segments.names, dtype=object)
        logger.debug("%d leaves; excluded from %s: %s", len(segments), what, list(names[excluded]))


_DTYPES = {
    "offsets": np.int64,
    "sizes": np.int64,
    "decay": np.bool_,
    "adapt": np.bool_,
    "trust_ratio": np.float64,
}


def check(where: str, table: NamedTuple, size: int) -> None:
    """Raises ``ValueError`` unless ``table`` (a state with the fields of :class:`DecayTable`,
    and maybe of :class:`LeafTable`) describes leaves inside ``[0, size)``."""
    offsets, sizes = table.offsets, table.sizes  # type: ignore[attr-defined]
    n = np.shape(offsets)
    for name in (f for f in table._fields if f in _DTYPES):
        dtype, arr = _DTYPES[name], getattr(table, name)
        if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.shape != n or n == ():
            raise ValueError(
                f"{where}: state.{name} must be a {np.dtype(dtype)} vector of shape {n}"
            )
    if n[0] and (offsets.min() < 0 or sizes.min() < 0 or (offsets + sizes).max() > size):
        raise ValueError(f"{where}: state describes leaves outside the {size} parameters")


_WHOLE = DecayTable(np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.bool_))


def decay_of(where: str, state: NamedTuple, size: int, masked: bool) -> DecayTable:
    """The table an SGD or Adam kernel reads: the state's own with exclusions, else an empty one."""
    if not masked:
        return _WHOLE
    if "decay" not in getattr(state, "_fields", ()):
        raise ValueError(f"{where}: the state has no leaf table: init it with this optimizer")
    check(where, state, size)
    return DecayTable(state.offsets, state.sizes, state.decay)  # type: ignore[attr-defined]
