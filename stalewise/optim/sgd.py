"""Stochastic gradient descent with momentum, as ``torch.optim.SGD``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from stalewise._lazy import Lazy
from stalewise.optim import _leaves
from stalewise.optim._validate import (
    check_buffers,
    check_count,
    check_learning_rate,
    check_number,
    check_params,
    check_scale,
    check_vectors,
    compile_patterns,
)
from stalewise.optim.base import LearningRate, Optimizer, Rule, learning_rate, new_count
from stalewise.segments import Segments

_kernels = Lazy("stalewise.optim._kernels")  # numba: imported at the first step


class SgdState(NamedTuple):
    count: np.ndarray  # 0-d int64: updates applied so far
    momentum: np.ndarray  # velocity, like params (empty when momentum is 0)


class MaskedSgdState(NamedTuple):
    """The state of :func:`sgd` given ``exclude_from_weight_decay``."""

    count: np.ndarray  # 0-d int64: updates applied so far
    momentum: np.ndarray  # velocity, like params (empty when momentum is 0)
    offsets: np.ndarray  # int64 start of each leaf
    sizes: np.ndarray  # int64 length of each leaf
    decay: np.ndarray  # bool per leaf: weight decay applies


@dataclass(frozen=True)
class _Sgd(Rule):
    fused_checks = True  # run() takes check= (Rule.apply_checked)
    lr: LearningRate
    momentum: float
    nesterov: bool
    weight_decay: float
    exclude_from_weight_decay: tuple[str, ...] = ()

    def init(
        self, params: np.ndarray, segments: Segments | None = None
    ) -> SgdState | MaskedSgdState:
        segments = check_params(params, segments)
        size = params.size if self.momentum else 0
        velocity = (new_count(), np.zeros(size, dtype=params.dtype))
        if not self.exclude_from_weight_decay:
            return SgdState(*velocity)
        return MaskedSgdState(
            *velocity, *_leaves.decay_table(segments, self.exclude_from_weight_decay)
        )

    def written(self, state, params: np.ndarray) -> tuple[np.ndarray, ...]:
        return (params, state.momentum)

    def maxima(self, state, params: np.ndarray) -> tuple[float, float]:
        """Bounds of the largest magnitudes in ``params`` and the momentum: their norms."""
        return math.sqrt(_kernels.sumsq(params)), math.sqrt(_kernels.sumsq(state.momentum))

    def bound(
        self, state, scale: float, g: float, maxima: tuple[float, float]
    ) -> tuple[float, float]:
        """Bounds of :meth:`maxima` after the next step of an update of norm ``g``."""
        lr = learning_rate(self.lr, check_count("sgd", state.count)) * float(scale)
        p, b = maxima
        d = g + abs(self.weight_decay) * p
        b = self.momentum * b + d if self.momentum else 0.0
        u = (d + self.momentum * b if self.nesterov else b) if self.momentum else d
        return p + lr * u, b

    def run(
        self,
        grads: np.ndarray,
        state: SgdState | MaskedSgdState,
        params: np.ndarray,
        scale: float,
        into_params: bool,
        check: np.ndarray | None = None,
        undo: tuple[np.ndarray, ...] | None = None,
    ) -> None:
        check_vectors(grads, params, write_grads=True, write_params=into_params)
        if self.momentum:
            check_buffers("sgd", params, momentum=state.momentum)
        table = _leaves.decay_of("sgd", state, params.size, bool(self.exclude_from_weight_decay))
        count = check_count("sgd", state.count)
        lr = learning_rate(self.lr, count) * check_scale(scale)
        dt = params.dtype.type
        _kernels.sgd(
            grads,
            state.momentum,
            params,
            *table,
            lr,
            dt(self.momentum),
            self.nesterov,
            dt(self.weight_decay),
            into_params,
            params[:0] if check is None else check,
            *(undo or (params[:0],) * 2),
        )
        state.count[...] = count + 1


def sgd(
    lr: LearningRate,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    exclude_from_weight_decay: Sequence[str] = (),
) -> Optimizer:
    """SGD with optional (Nesterov) momentum and L2 weight decay, as ``torch.optim.SGD``.

    ``g' = g + weight_decay * p``; with momentum ``buf = momentum * buf + g'``
    and the step direction is ``buf`` (or ``g' + momentum * buf`` with
    Nesterov); ``p -= lr * scale * direction``. The learning rate sits outside
    the velocity, so a schedule or a staleness ``scale`` changes the step only.

    Args:
        lr: learning rate, a float >= 0 or a schedule (see :mod:`.schedules`).
        momentum: velocity decay in ``[0, 1)``; 0 keeps no velocity buffer.
        nesterov: use Nesterov momentum (needs ``momentum > 0``).
        weight_decay: coefficient of the L2 term added to the gradient, >= 0.
        exclude_from_weight_decay: regexes (``re.search``) on leaf names that
            get no L2 term, as a parameter group with ``weight_decay=0`` in torch.

    Example:
        >>> opt = sgd(0.1, momentum=0.9)
        >>> params = np.array([1.0, -2.0], np.float32)
        >>> state = opt.init(params)
        >>> opt.apply(np.array([1.0, 1.0], np.float32), state, params)
        >>> params.tolist(), int(state.count)
        ([0.8999999761581421, -2.0999999046325684], 1)
    """
    check_learning_rate("sgd", lr)
    momentum = check_number("sgd", "momentum", momentum, 0.0, 1.0)
    weight_decay = check_number("sgd", "weight_decay", weight_decay, 0.0)
    if nesterov and momentum == 0:
        raise ValueError(f"sgd: nesterov=True needs momentum > 0, got momentum={momentum!r}")
    no_decay = compile_patterns("sgd", "exclude_from_weight_decay", exclude_from_weight_decay)
    return _Sgd(lr, momentum, bool(nesterov), weight_decay, no_decay).optimizer()
