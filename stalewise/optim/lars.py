"""LARS: SGD with momentum and a layer-wise trust ratio (You et al., 2017)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stalewise._lazy import Lazy
from stalewise.optim._leaves import LeafTable
from stalewise.optim._validate import check_learning_rate, check_number, compile_patterns
from stalewise.optim.base import LearningRate, Moments, Optimizer, state_type

_kernels = Lazy("stalewise.optim._kernels")  # numba: imported at the first step


LarsState = state_type("LarsState", __name__, ("momentum",), LeafTable)


@dataclass(frozen=True)
class _Lars(Moments):
    where, State, Masked, per_leaf = "lars", LarsState, LarsState, True
    lr: LearningRate
    momentum: float
    weight_decay: float
    trust_coefficient: float
    eps: float
    exclude_from_weight_decay: tuple[str, ...]
    exclude_from_adaptation: tuple[str, ...]

    def run(self, grads, state, params, scale, into_params) -> None:
        count, lr, _ = self.begin(grads, state, params, scale, into_params)
        dt = params.dtype.type
        _kernels.lars(grads, state.momentum, params, state.offsets, state.sizes,
                      state.decay, state.adapt, state.trust_ratio, lr,
                      dt(self.momentum), dt(self.weight_decay),
                      self.trust_coefficient, self.eps, into_params)  # fmt: skip
        state.count[...] = count + 1


def lars(
    lr: LearningRate,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    trust_coefficient: float = 0.001,
    eps: float = 0.0,
    exclude_from_weight_decay: Sequence[str] = (),
    exclude_from_adaptation: Sequence[str] = (),
) -> Optimizer:
    """The LARS optimizer, leaf by leaf over the segments given to ``init``.

    For each leaf: ``u = g + weight_decay * p``, ``r = trust_coefficient * ||p|| / (||u|| + eps)``
    (1 when either norm is zero or the leaf is excluded from adaptation),
    ``buf = momentum*buf + r*u`` and ``p -= lr * scale * buf``: optax's ``lars`` with the learning
    rate outside the velocity. A leaf split across shards gets the ratio of its local part. The
    exclusions are regexes (``re.search``) on leaf names.

    Example:
        >>> import numpy as np
        >>> opt = lars(1.0, momentum=0.0, trust_coefficient=0.1)
        >>> params = np.array([3.0, 4.0], np.float32)  # ||p|| = 5
        >>> state = opt.init(params)
        >>> opt.apply(np.array([10.0, 0.0], np.float32), state, params)  # ||g|| = 10
        >>> params.tolist()  # r = 0.1 * 5 / 10 = 0.05
        [2.5, 4.0]
    """
    where = "lars"
    check_learning_rate(where, lr)
    momentum = check_number(where, "momentum", momentum, 0.0, 1.0)
    weight_decay = check_number(where, "weight_decay", weight_decay, 0.0)
    coefficient = check_number(where, "trust_coefficient", trust_coefficient, 0.0, lo_open=True)
    eps = check_number(where, "eps", eps, 0.0)
    no_decay = compile_patterns(where, "exclude_from_weight_decay", exclude_from_weight_decay)
    no_adapt = compile_patterns(where, "exclude_from_adaptation", exclude_from_adaptation)
    return _Lars(lr, momentum, weight_decay, coefficient, eps, no_decay, no_adapt).optimizer()
