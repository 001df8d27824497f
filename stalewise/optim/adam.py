"""Adam and AdamW, as ``torch.optim.Adam`` and ``torch.optim.AdamW``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from stalewise._lazy import Lazy
from stalewise.optim._leaves import DecayTable
from stalewise.optim._validate import check_learning_rate, check_number, compile_patterns
from stalewise.optim.base import LearningRate, Moments, Optimizer, state_type

_kernels = Lazy("stalewise.optim._kernels")  # numba: imported at the first step


# the gradient's first and second moments; Masked: with exclusions
AdamState = state_type("AdamState", __name__, ("mu", "nu"))
MaskedAdamState = state_type("MaskedAdamState", __name__, ("mu", "nu"), DecayTable)


@dataclass(frozen=True)
class _Adam(Moments):
    where, State, Masked = "adam", AdamState, MaskedAdamState
    fused_checks = True  # run() takes check= (Rule.apply_checked)
    lr: LearningRate
    b1: float
    b2: float
    eps: float
    l2: float  # coupled: added to the gradient before the moments (Adam)
    decay: float  # decoupled: part of the step, outside the moments (AdamW)
    exclude_from_weight_decay: tuple[str, ...] = ()

    def written(self, state, params: np.ndarray) -> tuple[np.ndarray, ...]:
        return (params, state.mu, state.nu)

    def bound(self, state, scale: float, g: float, maxima: tuple) -> tuple[float, ...]:
        """Bounds of :meth:`maxima` and the step's intermediates after an update of norm ``g``."""
        lr, p, m, v, q, d = self.adam_bounds(state, scale, g, maxima, self.l2)
        u = q + self.decay * p
        return p + lr * u, m, v, max(u, d * d)

    def run(self, grads, state, params, scale, into_params, check=None, undo=None, done=None):
        count, lr, table = self.begin(grads, state, params, scale, into_params)
        t = count + 1
        dt = params.dtype.type
        _kernels.adam(grads, state.mu, state.nu, params, *table, lr, dt(self.b1),
                      dt(1.0 - self.b1), dt(self.b2), dt(1.0 - self.b2),
                      dt(1.0 / (1.0 - self.b1**t)),
                      dt(1.0 / math.sqrt(1.0 - self.b2**t)), dt(self.eps),
                      dt(self.l2), dt(self.decay), into_params,
                      params[:0] if check is None else check,
                      *(undo or (params[:0],) * 3),
                      _kernels.NO_DONE if done is None else done)  # fmt: skip
        state.count[...] = t


def _make(
    where: str,
    lr: LearningRate,
    b1: float,
    b2: float,
    eps: float,
    wd: float,
    exclude_from_weight_decay: Sequence[str],
) -> Optimizer:
    check_learning_rate(where, lr)
    b1 = check_number(where, "b1", b1, 0.0, 1.0)
    b2 = check_number(where, "b2", b2, 0.0, 1.0)
    eps = check_number(where, "eps", eps, 0.0, lo_open=True)
    wd = check_number(where, "weight_decay", wd, 0.0)
    no_decay = compile_patterns(where, "exclude_from_weight_decay", exclude_from_weight_decay)
    l2, decay = (0.0, wd) if where == "adamw" else (wd, 0.0)
    return _Adam(lr, b1, b2, eps, l2, decay, no_decay).optimizer()


def adam(
    lr: LearningRate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    exclude_from_weight_decay: Sequence[str] = (),
) -> Optimizer:
    """Adam with L2 regularisation coupled to the gradient, as ``torch.optim.Adam``.

    ``g' = g + weight_decay * p``; ``m = b1*m + (1-b1)*g'``; ``v = b2*v + (1-b2)*g'^2``;
    ``p -= lr * scale * m_hat / (sqrt(v_hat) + eps)`` with ``m_hat = m / (1 - b1^t)``,
    ``v_hat = v / (1 - b2^t)`` at step ``t = count + 1``. ``exclude_from_weight_decay``: regexes
    (``re.search``) on leaf names that get no L2 term (a torch group with ``weight_decay=0``).

    Example:
        >>> opt = adam(0.1)
        >>> params = np.array([1.0, -1.0], np.float32)
        >>> state = opt.init(params)
        >>> updates, state = opt.update(np.array([0.5, -3.0], np.float32), state, params)
        >>> [round(float(u), 6) for u in updates]  # the first step is lr * sign(g)
        [-0.1, 0.1]
    """
    return _make("adam", lr, b1, b2, eps, weight_decay, exclude_from_weight_decay)


def adamw(
    lr: LearningRate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.01,
    exclude_from_weight_decay: Sequence[str] = (),
) -> Optimizer:
    """Adam with decoupled weight decay, as ``torch.optim.AdamW``.

    As :func:`adam` without the L2 term, and the step is
    ``p -= lr * scale * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)``.

    Example:
        >>> opt = adamw(0.1, weight_decay=0.5)
        >>> params = np.array([2.0], np.float32)
        >>> state = opt.init(params)
        >>> opt.apply(np.array([1.0], np.float32), state, params)
        >>> round(float(params[0]), 6)  # 2 - 0.1 * (1 + 0.5 * 2)
        1.8
    """
    return _make("adamw", lr, b1, b2, eps, weight_decay, exclude_from_weight_decay)
