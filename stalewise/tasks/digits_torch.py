"""The digits MLP on PyTorch: CPU float32 tensors, batches ``(x float32, y int64)``, autograd."""

from __future__ import annotations

import numpy as np
import torch

from stalewise.tasks.base import dict_leaves, map_dict
from stalewise.tasks.digits import Digits

__all__ = ["DigitsTorch"]


class DigitsTorch(Digits):
    """Digits MLP classifier on PyTorch (see :class:`~stalewise.tasks.digits.Digits`)."""

    name = "digits-torch"

    def loss_and_grad(self, params: dict, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple:
        """Returns the mean cross-entropy of ``batch`` and its gradient (autograd)."""
        x, y = batch
        leaves = map_dict(lambda t: t.detach().requires_grad_(True), params)
        l1, l2 = leaves["layer1"], leaves["layer2"]
        z = x.to(l1["w"].dtype) @ l1["w"] + l1["b"]
        h = torch.tanh(z) if self.activation == "tanh" else torch.relu(z)
        loss = torch.nn.functional.cross_entropy(h @ l2["w"] + l2["b"], y)
        grads = iter(torch.autograd.grad(loss, dict_leaves(leaves)))
        return float(loss.detach()), map_dict(lambda _: next(grads), leaves)

    def _from_numpy(self, tree: dict) -> dict:
        return map_dict(torch.from_numpy, tree)

    def _to_numpy(self, tree: dict) -> dict:
        return map_dict(lambda t: t.detach().cpu().numpy(), tree)

    def _batch(self, x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(x), torch.from_numpy(y)
