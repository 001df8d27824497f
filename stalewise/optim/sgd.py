"""Stochastic gradient descent with momentum, as ``torch.optim.SGD``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stalewise._lazy import Lazy
from stalewise.optim._leaves import DecayTable
from stalewise.optim._validate import (
    check_count,
    check_learning_rate,
    check_number,
    compile_patterns,
)
from stalewise.optim.base import LearningRate, Moments, Optimizer, learning_rate, state_type

_kernels = Lazy("stalewise.optim._kernels")  # numba: imported at the first step


# the velocity, like params (empty when momentum is 0); Masked: with exclusions
SgdState = state_type("SgdState", __name__, ("momentum",))
MaskedSgdState = state_type("MaskedSgdState", __name__, ("momentum",), DecayTable)


@dataclass(frozen=True)
class _Sgd(Moments):
    where, State, Masked = "sgd", SgdState, MaskedSgdState
    fused_checks = True  # run() takes check= (Rule.apply_checked)
    lr: LearningRate
    momentum: float
    nesterov: bool
    weight_decay: float
    exclude_from_weight_decay: tuple[str, ...] = ()

    def moments(self) -> tuple[str, ...]:
        return ("momentum",) if self.momentum else ()

    def written(self, state, params: np.ndarray) -> tuple[np.ndarray, ...]:
        return (params, state.momentum)

    def bound(self, state, scale: float, g: float, maxima: tuple) -> tuple[float, ...]:
        """Bounds of :meth:`maxima` after the next step of an update of norm ``g``."""
        lr = learning_rate(self.lr, check_count(self.where, state.count)) * float(scale)
        p, b = maxima
        d = g + abs(self.weight_decay) * p
        b = self.momentum * b + d if self.momentum else 0.0
        u = (d + self.momentum * b if self.nesterov else b) if self.momentum else d
        return p + lr * u, b

    def run(self, grads, state, params, scale, into_params, check=None, undo=None, done=None):
        count, lr, table = self.begin(grads, state, params, scale, into_params)
        dt = params.dtype.type
        _kernels.sgd(grads, state.momentum, params, *table, lr, dt(self.momentum),
                     self.nesterov, dt(self.weight_decay), into_params,
                     params[:0] if check is None else check,
                     *(undo or (params[:0],) * 2),
                     _kernels.NO_DONE if done is None else done)  # fmt: skip
        state.count[...] = count + 1


def sgd(
    lr: LearningRate,
    momentum: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    exclude_from_weight_decay: Sequence[str] = (),
) -> Optimizer:
    """SGD with optional (Nesterov) momentum and L2 weight decay, as ``torch.optim.SGD``.

    ``g' = g + weight_decay * p``; with momentum ``buf = momentum * buf + g'`` and the direction
    is ``buf`` (Nesterov: ``g' + momentum * buf``); ``p -= lr * scale * direction``.
    ``exclude_from_weight_decay``: regexes (``re.search``) on leaf names that get no L2 term.

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
