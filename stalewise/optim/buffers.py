"""Buffers on the server: non-trainable state (BatchNorm running statistics...) whose slot in
a push carries its *value*; :func:`with_buffers` (``sw.Job`` wraps its optimizer so) moves each
toward it as ``b <- b + rate * scale * (v - b)``. docs/models.md; why: docs/design-notes.md."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from stalewise.optim._validate import check_number, check_params, check_scale, check_vectors
from stalewise.optim.base import Optimizer, Rule, State
from stalewise.segments import Segments

__all__ = ["BufferState", "with_buffers"]


class BufferState(NamedTuple):
    inner: State  # the wrapped optimizer's state
    offsets: np.ndarray  # int64 start of each buffer segment of this shard
    sizes: np.ndarray  # int64 length of each
    reports: np.ndarray  # scratch: the values a push reports, one after the other
    before: np.ndarray  # scratch: the buffers' values before the step


@dataclass(frozen=True)
class _WithBuffers(Rule):
    inner: Optimizer
    names: tuple[str, ...]
    rate: float

    def init(self, params: np.ndarray, segments: Segments | None = None) -> BufferState:
        segments = check_params(params, segments)
        names = set(self.names)
        mine = np.array([n in names for n in segments.names], dtype=bool)
        sizes = np.asarray(segments.sizes[mine], dtype=np.int64)
        total = int(sizes.sum())
        return BufferState(
            self.inner.init(params, segments),
            np.asarray(segments.offsets[mine], dtype=np.int64),
            sizes,
            np.empty(total, params.dtype),
            np.empty(total, params.dtype),
        )

    def run(self, grads, state, params, scale, into_params) -> None:
        check_vectors(grads, params, write_grads=True, write_params=into_params)
        if state.reports.dtype != params.dtype or state.reports.size != int(state.sizes.sum()):
            raise ValueError("with_buffers: the state does not fit these params")
        slots, start = [], 0  # (its slice of params, its slice of reports), per buffer
        for offset, size in zip(state.offsets.tolist(), state.sizes.tolist(), strict=True):
            slots.append((slice(offset, offset + size), slice(start, start + size)))
            start += size
        for s, part in slots:  # the reports out of the optimizer's way
            state.reports[part] = grads[s]
            state.before[part] = params[s]
            grads[s] = 0
        step = self.inner.apply if into_params else self.inner.update_inplace
        step(grads, state.inner, params, scale=scale)
        weight = self.rate * check_scale(scale)
        for s, part in slots:
            move = state.reports[part]
            move -= state.before[part]
            move *= weight  # b <- b + rate * scale * (v - b)
            if into_params:
                np.add(state.before[part], move, out=params[s])
            else:
                grads[s] = move  # the update; params are untouched

    def __repr__(self) -> str:
        rule = getattr(self.inner.apply, "__self__", None)
        inner = repr(rule) if rule is not None else "Optimizer(...)"
        return f"with_buffers({inner}, {len(self.names)} buffers, rate={self.rate:g})"


def with_buffers(optimizer: Optimizer, names: Iterable[str], rate: float = 1.0) -> Optimizer:
    """``optimizer``, but the leaves ``names`` are buffers moved by ``rate`` in ``(0, 1]``."""
    rate = check_number("with_buffers", "rate", rate, 0.0, 1.0, lo_open=True, hi_open=False)
    rule = getattr(optimizer.apply, "__self__", None)
    if isinstance(rule, _WithBuffers):
        optimizer = rule.inner
    return _WithBuffers(optimizer, tuple(sorted(set(names))), rate).optimizer()
