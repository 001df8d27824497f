"""LAMB: Adam directions scaled leaf by leaf by a trust ratio (You et al., 2020)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from stalewise._lazy import Lazy
from stalewise.optim._leaves import LeafTable
from stalewise.optim._validate import check_learning_rate, check_number, compile_patterns
from stalewise.optim.base import LearningRate, Moments, Optimizer, state_type

_kernels = Lazy("stalewise.optim._kernels")  # numba: imported at the first step


LambState = state_type("LambState", __name__, ("mu", "nu"), LeafTable)


@dataclass(frozen=True)
class _Lamb(Moments):
    where, State, Masked, per_leaf = "lamb", LambState, LambState, True
    lr: LearningRate
    b1: float
    b2: float
    eps: float
    weight_decay: float
    min_trust_ratio: float
    max_trust_ratio: float
    exclude_from_weight_decay: tuple[str, ...]
    exclude_from_adaptation: tuple[str, ...]

    def bound(self, state, scale: float, g: float, maxima: tuple) -> tuple[float, ...]:
        """As Adam's (:meth:`Moments.adam_bounds`); a leaf's step ``r * ||u||`` is at most
        ``||p||`` or ``max(1, min_trust_ratio) * ||u||``, and ``r`` at most the clip."""
        lr, p, m, v, q, d = self.adam_bounds(state, scale, g, maxima, 0.0)
        u = q + self.weight_decay * p
        ratio = lr * max(self.max_trust_ratio, 1.0)
        step = lr * (p + max(1.0, self.min_trust_ratio) * u)
        return p + step, m, v, max(u, d * d, p * p, u * u, ratio)

    def run(self, grads, state, params, scale, into_params) -> None:
        count, lr, _ = self.begin(grads, state, params, scale, into_params)
        t = count + 1
        dt = params.dtype.type
        _kernels.lamb(grads, state.mu, state.nu, params, state.offsets, state.sizes,
                      state.decay, state.adapt, state.trust_ratio, lr, dt(self.b1),
                      dt(1.0 - self.b1), dt(self.b2), dt(1.0 - self.b2),
                      dt(1.0 / (1.0 - self.b1**t)),
                      dt(1.0 / math.sqrt(1.0 - self.b2**t)), dt(self.eps),
                      dt(self.weight_decay), self.min_trust_ratio,
                      self.max_trust_ratio, into_params)  # fmt: skip
        state.count[...] = t


def lamb(
    lr: LearningRate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    min_trust_ratio: float = 0.0,
    max_trust_ratio: float = 10.0,
    exclude_from_weight_decay: Sequence[str] = (),
    exclude_from_adaptation: Sequence[str] = (),
) -> Optimizer:
    """The LAMB optimizer, leaf by leaf over the segments given to ``init``.

    For each leaf, with ``t = count + 1``: ``m = b1*m + (1-b1)*g``, ``v = b2*v + (1-b2)*g^2``, ``u =
    m_hat / (sqrt(v_hat) + eps) + weight_decay * p``, ``r = clip(||p|| / ||u||, min_trust_ratio,
    max_trust_ratio)`` (1 when either norm is zero or the leaf is excluded from adaptation), and ``p
    -= lr * scale * r * u``; the last ratios are kept in ``state.trust_ratio``. A leaf split across
    shards gets the ratio of its local part. ``max_trust_ratio=math.inf``: no clip, as optax. The
    exclusions are regexes (``re.search``) on leaf names.

    Example:
        >>> import numpy as np
        >>> from stalewise.segments import Segments
        >>> opt = lamb(0.01, weight_decay=0.01, exclude_from_weight_decay=["bias"])
        >>> params = np.array([1.0, 2.0, 0.0], np.float32)  # weights, then a zero bias
        >>> seg = Segments.from_sizes(["layer.weight", "layer.bias"], [2, 1])
        >>> state = opt.init(params, seg)
        >>> opt.apply(np.array([0.1, 0.2, 0.3], np.float32), state, params)
        >>> float(params[2]) != 0.0, state.trust_ratio.round(3).tolist()
        (True, [1.558, 1.0])
    """
    where = "lamb"
    check_learning_rate(where, lr)
    b1 = check_number(where, "b1", b1, 0.0, 1.0)
    b2 = check_number(where, "b2", b2, 0.0, 1.0)
    eps = check_number(where, "eps", eps, 0.0, lo_open=True)
    weight_decay = check_number(where, "weight_decay", weight_decay, 0.0)
    min_ratio = check_number(where, "min_trust_ratio", min_trust_ratio, 0.0)
    max_ratio = check_number(where, "max_trust_ratio", max_trust_ratio, min_ratio, hi_open=False)
    no_decay = compile_patterns(where, "exclude_from_weight_decay", exclude_from_weight_decay)
    no_adapt = compile_patterns(where, "exclude_from_adaptation", exclude_from_adaptation)
    return _Lamb(
        lr, b1, b2, eps, weight_decay, min_ratio, max_ratio, no_decay, no_adapt
    ).optimizer()
