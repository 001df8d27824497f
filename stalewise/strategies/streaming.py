"""Streaming DiLoCo (Douillard et al. 2025), synchronous and asynchronous.

The model is cut into ``P`` *fragments* (unions of whole leaves); fragment ``p`` is pushed
after inner steps ``t = offset_p (mod H)`` as its pseudo-gradient (zeros elsewhere) and,
``delay`` inner steps later, merged: ``local_p = alpha * local_p + (1 - alpha) * global_p``.
``fragments=1, delay=0`` is DiLoCo bit for bit. Why: docs/design-notes.md, "Streaming DiLoCo"."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from stalewise import optim, tree
from stalewise.optim.base import copy_state
from stalewise.segments import Segments
from stalewise.strategies.averaging import (
    AveragingState,
    LocalSGDStrategy,
    _describe_inner,
    _new_state,
    _run_local,
)
from stalewise.strategies.base import LossAndGrad, Step

__all__ = ["LazyLeaves", "StreamingDiLoCo", "StreamingState", "lazy_leaves", "streaming_diloco"]

Runs = list[tuple[int, int]]  # contiguous [start, stop) ranges of the flat vector


class LazyLeavesState(NamedTuple):
    """Per leaf: its ``bounds`` (int64 rows ``start, stop``) and its ``opt`` state (``leaves``)."""

    bounds: np.ndarray
    leaves: tuple


@dataclass(frozen=True)
class LazyLeaves:
    """``opt`` per leaf, stepping only the leaves a push touches; build it with :func:`lazy_leaves`."""

    opt: optim.Optimizer

    def init(self, params: np.ndarray, segments: Segments | None = None) -> LazyLeavesState:
        seg = Segments.single(params.size) if segments is None else segments
        pieces = [(int(o), int(o + s)) for o, s in zip(seg.offsets, seg.sizes, strict=True)]
        return LazyLeavesState(
            np.array(pieces, np.int64).reshape(-1, 2),
            tuple(self.opt.init(params[a:b], seg.slice(a, b)) for a, b in pieces),
        )

    def apply(
        self, grads: np.ndarray, state: LazyLeavesState, params: np.ndarray, *, scale: float = 1.0
    ) -> None:
        for (a, b), sub in zip(state.bounds.tolist(), state.leaves, strict=True):
            g = grads[a:b]
            if g.any():  # a leaf the push touches (NaN counts: the shard refuses those)
                self.opt.apply(g, sub, params[a:b], scale=scale)

    def update(
        self, grads: np.ndarray, state: LazyLeavesState, params: np.ndarray, *, scale: float = 1.0
    ) -> tuple[np.ndarray, LazyLeavesState]:
        new_state, new_params = copy_state(state), params.copy()
        self.apply(grads.copy(), new_state, new_params, scale=scale)
        return new_params - params, new_state

    def update_inplace(
        self, grads: np.ndarray, state: LazyLeavesState, params: np.ndarray, *, scale: float = 1.0
    ) -> None:
        moved = params.copy()
        self.apply(grads, state, moved, scale=scale)
        np.subtract(moved, params, out=grads)

    def optimizer(self) -> optim.Optimizer:
        return optim.Optimizer(self.init, self.update, self.apply, self.update_inplace)

    def __repr__(self) -> str:
        rule = getattr(self.opt.apply, "__self__", None)
        return f"lazy_leaves({rule!r})" if rule is not None else "lazy_leaves(...)"


def lazy_leaves(opt: optim.Optimizer) -> optim.Optimizer:
    """``opt`` with a state per leaf, stepping only the leaves an update touches; ``opt`` must
    keep a parameter-sized state (``sgd`` with momentum, ``delayed_nesterov``...)."""
    if not isinstance(opt, optim.Optimizer):
        raise TypeError(f"lazy_leaves: opt must be a stalewise optimizer, got {opt!r}")
    return LazyLeaves(opt).optimizer()


@dataclass(eq=False)
class StreamingState(AveragingState):
    """A worker's state for :func:`streaming_diloco`: :class:`AveragingState` and the fragments."""

    ref: np.ndarray = field(default_factory=lambda: np.empty(0))  # the pseudo-gradients' base
    runs: list[Runs] = field(default_factory=list)  # per fragment, its ranges of the vector
    t: int = 0  # inner steps taken since the start
    last: int | None = None  # the fragment pushed by the last step (None: none yet)
    pending: list[tuple[int, int, list[np.ndarray]]] = field(default_factory=list)  # to merge
    pushed: list[tuple[int, int]] = field(default_factory=list)  # (inner step, fragment) pushes
    early: list[tuple[int, float]] = field(default_factory=list)  # ahead's (steps, mean loss)


class StreamingDiLoCo(LocalSGDStrategy):
    """Streaming DiLoCo; build it with :func:`streaming_diloco` (see the module docstring)."""

    def __init__(
        self,
        local_steps: int,
        inner: Any,
        *,
        fragments: int | Sequence[str | Sequence[str]] = 1,
        offsets: Sequence[int] | None = None,
        delay: int = 0,
        alpha: float = 0.0,
        overlap: bool = True,
        **outer: Any,
    ):
        """``outer``: ``outer_lr``, ``outer_momentum``, ``asynchronous``, ``every``."""
        where = "streaming_diloco"
        super().__init__(local_steps, inner, name=where, **outer)
        h = self.local_steps
        self.fragments = _check_fragments(fragments)
        count = self.count
        if count > h:
            raise ValueError(
                f"{where}: fragments: {count} fragments need local_steps >= {count} (one sync "
                f"point each inside the period), got local_steps={h}"
            )
        if offsets is None:
            offsets = [round(p * h / count) for p in range(count)]
        self.offsets = _check_offsets(offsets, count, h)
        if isinstance(delay, bool) or not isinstance(delay, int | np.integer) or not 0 <= delay < h:
            raise ValueError(
                f"{where}: delay must be an integer in [0, local_steps={h}), got {delay!r}"
            )
        self.delay = int(delay)
        try:
            a = float(alpha)
        except (TypeError, ValueError):
            a = math.nan
        if isinstance(alpha, bool) or not 0.0 <= a <= 1.0:
            raise ValueError(f"{where}: alpha must be a number in [0, 1], got {alpha!r}")
        self.alpha = a
        if not isinstance(overlap, bool):
            raise ValueError(f"{where}: overlap must be True or False, got {overlap!r}")
        self.overlap = overlap

    @property
    def count(self) -> int:
        return self.fragments if isinstance(self.fragments, int) else len(self.fragments)

    def init(self, params: Any) -> StreamingState:
        base = _new_state(params, self._inner)
        state = StreamingState(**vars(base))
        state.ref = state.local.copy()
        state.runs = fragment_runs(state.spec.segments, self.fragments)
        return state

    def schedule(self, t: int) -> tuple[int, int]:
        """The next sync point after inner step ``t``: ``(inner step, fragment)``."""
        h = self.local_steps
        best = min(o + ((t - o) // h + 1) * h for o in self.offsets)  # t' > t, t' = o (mod H)
        return best, self.offsets.index(best % h)

    @property
    def overlaps(self) -> bool:
        """``overlap`` and ``delay >= 1``: the worker loop calls :meth:`ahead` before a pull."""
        return self.overlap and self.delay > 0

    def ahead(self, state: StreamingState, loss_and_grad: LossAndGrad, batches: Iterator) -> int:
        """Takes the inner steps that need no pull while the last push is in flight; how many."""
        if state.last is None:
            return 0
        end = min(state.pushed[-1][0] + self.delay, self.schedule(state.pushed[-1][0])[0])
        return self._advance(state, loss_and_grad, batches, end, state.early)

    def step(
        self, state: StreamingState, params: Any, loss_and_grad: LossAndGrad, batches: Iterator
    ) -> Step:
        pulled = tree.flatten(params, spec=state.spec, out=state.grads)[0]  # scratch till a step
        since = state.pushed[-1][0] if state.pushed else state.t  # the last push's inner step
        if not state.pushes:  # the first round: the pull is everything
            np.copyto(state.local, pulled)
            np.copyto(state.ref, pulled)
        elif state.last is not None:  # the global fragment of the last push, merged later
            values = [pulled[a:b].copy() for a, b in state.runs[state.last]]
            state.pending.append((since + self.delay, state.last, values))
        end, frag = self.schedule(since)
        losses, state.early = state.early, []
        steps = self._advance(state, loss_and_grad, batches, end, losses)
        delta = np.zeros_like(state.local)  # the push's own vector
        for a, b in state.runs[frag]:
            np.subtract(state.ref[a:b], state.local[a:b], out=delta[a:b])
        tree.copy_buffers(delta, state.local, state.spec)  # a buffer's slot: its value
        state.taken, state.last = sum(n for n, _ in losses), frag
        state.pushed.append((state.t, frag))
        state.pushes += 1
        loss = losses[0][1] if len(losses) == 1 else sum(n * x for n, x in losses) / state.taken
        return Step(tree.unflatten(delta, state.spec), steps, loss, state)

    def _advance(
        self,
        state: StreamingState,
        loss_and_grad: LossAndGrad,
        batches: Iterator,
        end: int,
        losses: list[tuple[int, float]],
    ) -> int:
        """Inner steps up to ``end``, merging as due; appends ``(steps, mean loss)`` to losses."""
        steps = 0
        while True:
            self._merge_due(state)
            stop = min([end, *(at for at, _, _ in state.pending)])
            if stop <= state.t:
                return steps
            n, loss = _run_local(self._inner, state, loss_and_grad, batches, stop - state.t, None)
            state.t += n
            steps += n
            losses.append((n, loss))

    def _merge_due(self, state: StreamingState) -> None:
        keep = []
        for at, frag, values in state.pending:
            if at > state.t:
                keep.append((at, frag, values))
                continue
            for (a, b), g in zip(state.runs[frag], values, strict=True):
                merge(state.local[a:b], g, self.alpha)
                np.copyto(state.ref[a:b], g)
        state.pending = keep

    def server_optimizer(self, workers: int | None = None) -> optim.Optimizer:
        """DiLoCo's for one fragment; for more, :func:`lazy_leaves` of it."""
        opt = super().server_optimizer(workers)
        return opt if self.count == 1 else lazy_leaves(opt)

    def __repr__(self) -> str:
        parts = [f"local_steps={self.local_steps}", f"fragments={self.fragments!r}"]
        parts += [f"offsets={list(self.offsets)}", f"delay={self.delay}", f"alpha={self.alpha:g}"]
        parts.append(f"inner={_describe_inner(self.inner)}")
        if self.asynchronous:
            parts.append(f"asynchronous=True, every={self.every}")
        if not self.overlap:
            parts.append("overlap=False")
        return f"streaming_diloco({', '.join(parts)})"


def merge(local: np.ndarray, global_: np.ndarray, alpha: float) -> None:
    """``local = alpha * local + (1 - alpha) * global_`` in place; ``alpha = 0`` copies."""
    if alpha == 0.0:
        np.copyto(local, global_)
    else:
        local *= alpha
        local += (1.0 - alpha) * global_


def fragment_runs(segments: Segments, fragments: int | tuple) -> list[Runs]:
    """Each fragment's ranges of the flat vector (``fragments`` as for :func:`streaming_diloco`);
    every leaf must belong to a fragment and every fragment hold one."""
    names, sizes = segments.names, [int(s) for s in segments.sizes]
    ends = np.cumsum(sizes)
    if isinstance(fragments, int):
        if len(names) < fragments:
            raise ValueError(
                f"streaming_diloco: fragments={fragments} cuts the model at leaf boundaries, "
                f"and the params have {len(names)} leaves"
            )
        total, cuts = segments.total, [0]
        for k in range(1, fragments):
            lo, hi = cuts[-1] + 1, len(names) - (fragments - k)  # leaves left for the rest
            j = min(range(lo, hi + 1), key=lambda j: abs(ends[j - 1] - k * total / fragments))
            cuts.append(j)
        cuts.append(len(names))
        owner = [k for k in range(fragments) for _ in range(cuts[k], cuts[k + 1])]
    else:
        compiled = [[re.compile(p) for p in group] for group in fragments]
        owner = []
        for name in names:
            hit = next((i for i, g in enumerate(compiled) if any(p.search(name) for p in g)), None)
            if hit is None:
                raise ValueError(
                    f"streaming_diloco: fragments: leaf {name!r} matches no fragment's pattern "
                    f"({list(fragments)})"
                )
            owner.append(hit)
    count = fragments if isinstance(fragments, int) else len(fragments)
    runs: list[Runs] = [[] for _ in range(count)]
    for i, k in enumerate(owner):
        a, b = int(segments.offsets[i]), int(segments.offsets[i]) + sizes[i]
        if runs[k] and runs[k][-1][1] == a:
            runs[k][-1] = (runs[k][-1][0], b)
        else:
            runs[k].append((a, b))
    empty = [k for k in range(count) if not runs[k]]
    if empty:
        raise ValueError(
            f"streaming_diloco: fragments: fragment {empty[0]} ({fragments[empty[0]]!r}) "
            "matches no leaf"
        )
    return runs


def _check_fragments(fragments: Any) -> int | tuple:
    where = "streaming_diloco: fragments"
    is_int = isinstance(fragments, int | np.integer) and not isinstance(fragments, bool)
    if is_int and fragments >= 1:
        return int(fragments)
    if is_int or isinstance(fragments, str) or not isinstance(fragments, Sequence) or not fragments:
        raise ValueError(
            f"{where} must be an integer >= 1 or a non-empty list of leaf-name patterns "
            f"(one per fragment, e.g. ['^layer0\\\\.', '^layer1\\\\.']), got {fragments!r}"
        )
    out = []
    for group in fragments:
        patterns = (group,) if isinstance(group, str) else group
        strings = isinstance(patterns, Sequence) and all(isinstance(p, str) for p in patterns)
        if not (strings and patterns):
            raise ValueError(
                f"{where}: each fragment is a pattern or a list of them, got {group!r}"
            )
        for p in patterns:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"{where}: bad pattern {p!r}: {e}") from None
        out.append(tuple(patterns))
    return tuple(out)


def _check_offsets(offsets: Any, count: int, h: int) -> tuple[int, ...]:
    where = "streaming_diloco: offsets"
    try:
        values = list(offsets)
    except TypeError:
        raise ValueError(f"{where} must be a list of {count} integers, got {offsets!r}") from None
    ok = all(isinstance(o, int | np.integer) and not isinstance(o, bool) for o in values)
    if not ok or len(values) != count:
        raise ValueError(f"{where} must be {count} integers (one per fragment), got {offsets!r}")
    if any(not 0 <= o < h for o in values) or len(set(values)) != count:
        raise ValueError(
            f"{where} must be distinct integers in [0, local_steps={h}) (one push per sync "
            f"point), got {list(values)}"
        )
    return tuple(int(o) for o in values)


def streaming_diloco(
    local_steps: int = 500,
    inner: Any = None,
    *,
    fragments: int | Sequence[str | Sequence[str]] = 1,
    offsets: Sequence[int] | None = None,
    delay: int = 0,
    alpha: float = 0.0,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    asynchronous: bool = False,
    every: int | None = None,
    overlap: bool = True,
) -> StreamingDiLoCo:
    """Streaming DiLoCo (Douillard et al. 2025), synchronous or asynchronous.

    Args:
        local_steps, inner, outer_lr, outer_momentum, asynchronous, every: as for
            :func:`diloco` (the server optimizer in :func:`lazy_leaves` when ``P > 1``).
        fragments: ``P``, the leaf order cut into ``P`` runs of about equal size, or one
            leaf-name regex (or list of them) per fragment, the first match taking a leaf.
        offsets: each fragment's distinct sync offset in ``[0, H)`` (default ``round(p * H / P)``).
        delay: ``tau``, inner steps from a fragment's push to its merge, in ``[0, H)``.
        alpha: the local weight of the merge, in ``[0, 1]``; 0 takes the global fragment.
        overlap: with ``delay >= 1``, take the steps before the merge while the push is
            in flight (local runtime); the pushes and merges are the same either way."""
    return StreamingDiLoCo(
        local_steps,
        optim.adamw(1e-3) if inner is None else inner,
        fragments=fragments,
        offsets=offsets,
        delay=delay,
        alpha=alpha,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        asynchronous=asynchronous,
        every=every,
        overlap=overlap,
    )
