"""The digits MLP with PyTorch tensors and autograd.

Same data, model and initial numbers as :class:`stalewise.tasks.digits.Digits`;
parameters and gradients are CPU float32 ``torch.Tensor`` leaves of the same
nested dict, batches are ``(x float32, y int64)`` tensor pairs.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from stalewise.tasks.digits import Digits

logger = logging.getLogger(__name__)

__all__ = ["DigitsTorch"]


def _map(fn: Any, tree: dict) -> dict:
    return {k: _map(fn, v) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


class DigitsTorch(Digits):
    """Digits MLP classifier on PyTorch (see :class:`~stalewise.tasks.digits.Digits`).

    Example:
        >>> task = DigitsTorch(hidden=32)
        >>> params = task.init_params(seed=0)
        >>> loss, grads = task.loss_and_grad(params, next(task.batches(0, 4)))
        >>> type(grads["layer2"]["b"]).__name__, grads["layer2"]["b"].dtype
        ('Tensor', torch.float32)
    """

    name = "digits-torch"

    def loss_and_grad(self, params: dict, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        """Returns the mean cross-entropy of ``batch`` and its gradient (autograd)."""
        x, y = batch
        leaves = _map(lambda t: t.detach().requires_grad_(True), params)
        l1, l2 = leaves["layer1"], leaves["layer2"]
        z = x.to(l1["w"].dtype) @ l1["w"] + l1["b"]
        h = torch.tanh(z) if self.activation == "tanh" else torch.relu(z)
        loss = torch.nn.functional.cross_entropy(h @ l2["w"] + l2["b"], y)
        flat = [l1["w"], l1["b"], l2["w"], l2["b"]]
        gw1, gb1, gw2, gb2 = torch.autograd.grad(loss, flat)
        grads = {"layer1": {"w": gw1, "b": gb1}, "layer2": {"w": gw2, "b": gb2}}
        return float(loss.detach()), grads

    def _from_numpy(self, tree: dict) -> dict:
        return _map(torch.from_numpy, tree)

    def _to_numpy(self, tree: dict) -> dict:
        return _map(lambda t: t.detach().cpu().numpy(), tree)

    def _batch(self, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(x), torch.from_numpy(y)
