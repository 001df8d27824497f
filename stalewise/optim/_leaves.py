"""The per-leaf table kept in the state of LAMB and LARS.

``update`` and ``apply`` do not receive the segment table, so the optimizers
that work leaf by leaf copy what they need of it into their state at ``init``:
offsets, sizes, which leaves get weight decay and which are adapted by the
trust ratio. The table is checked before every update, because the kernels
index the vectors with it and do no bounds checks of their own.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from stalewise.segments import Segments

logger = logging.getLogger(__name__)


class LeafTable(NamedTuple):
    offsets: np.ndarray  # int64 start of each leaf in the flat vector
    sizes: np.ndarray  # int64 length of each leaf
    decay: np.ndarray  # bool per leaf: weight decay applies
    adapt: np.ndarray  # bool per leaf: the trust ratio applies (else it is fixed at 1)
    trust_ratio: np.ndarray  # float64 per leaf: the ratio used by the last update


def build(
    segments: Segments,
    exclude_from_weight_decay: Sequence[str],
    exclude_from_adaptation: Sequence[str],
) -> LeafTable:
    """The table for ``segments``, with the exclusions matched on leaf names."""
    no_decay = segments.mask(exclude_from_weight_decay)
    no_adapt = segments.mask(exclude_from_adaptation)
    if logger.isEnabledFor(logging.DEBUG):
        names = np.array(segments.names, dtype=object)
        logger.debug(
            "%d leaves; excluded from weight decay: %s; from adaptation: %s",
            len(segments),
            list(names[no_decay]),
            list(names[no_adapt]),
        )
    return LeafTable(
        offsets=np.array(segments.offsets, dtype=np.int64),
        sizes=np.array(segments.sizes, dtype=np.int64),
        decay=~no_decay,
        adapt=~no_adapt,
        trust_ratio=np.ones(len(segments), dtype=np.float64),
    )


def check(where: str, table: object, size: int) -> None:
    """Raises ``ValueError`` unless ``table`` (a state with the fields of :class:`LeafTable`)
    describes leaves inside ``[0, size)``.
    """
    expected = (
        ("offsets", np.int64),
        ("sizes", np.int64),
        ("decay", np.bool_),
        ("adapt", np.bool_),
        ("trust_ratio", np.float64),
    )
    offsets, sizes = table.offsets, table.sizes  # type: ignore[attr-defined]
    n = np.shape(offsets)
    for name, dtype in expected:
        arr = getattr(table, name)
        if not isinstance(arr, np.ndarray) or arr.dtype != dtype or arr.shape != n or n == ():
            raise ValueError(
                f"{where}: state.{name} must be a {np.dtype(dtype)} vector of shape {n}"
            )
    if n[0] and (offsets.min() < 0 or sizes.min() < 0 or (offsets + sizes).max() > size):
        raise ValueError(f"{where}: state describes leaves outside the {size} parameters")
