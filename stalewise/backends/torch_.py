"""The PyTorch backend: ``torch.Tensor`` leaves and ``nn.Module`` models (docs/models.md)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from stalewise.backends.base import Backend, ModelState


def _torch() -> Any:
    import torch

    return torch


def _as_source(a: np.ndarray) -> Any:
    """A CPU tensor over ``a`` (shared memory unless ``a`` is read-only or has no torch dtype)."""
    torch = _torch()
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    if not a.flags.writeable:
        a = a.copy()  # torch.from_numpy warns on read-only arrays
    return torch.from_numpy(a)


class TorchBackend(Backend):
    """``torch.Tensor`` leaves and ``torch.nn.Module`` models."""

    name = "torch"
    roots = ("torch",)

    def is_leaf(self, x: Any) -> bool:
        return isinstance(x, _torch().Tensor)

    def dtype(self, x: Any) -> str:
        return str(x.dtype).removeprefix("torch.")

    def to_numpy(self, x: Any) -> np.ndarray:
        torch = _torch()
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype == torch.bfloat16:
            try:
                import ml_dtypes
            except ImportError:  # pragma: no cover - ml_dtypes ships with jax and tensorflow
                return t.float().numpy()
            return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    def copy_into(self, x: Any, out: np.ndarray) -> None:
        # copy_ casts and moves across devices without a temporary on our side.
        _torch().from_numpy(out).copy_(x.detach())

    def from_numpy(self, a: np.ndarray, dtype: str, like: Any = None, *, copy: bool = True) -> Any:
        torch = _torch()
        target = getattr(torch, dtype)
        shared = a.flags.writeable and a.dtype.name != "bfloat16"
        t = _as_source(a)
        if t.dtype != target:
            t = t.to(target)
        elif copy and shared:
            t = t.clone()
        if like is not None and like.device != t.device:
            t = t.to(like.device)
        return t

    def is_writable(self, x: Any) -> bool:
        return True

    def assign(self, x: Any, a: np.ndarray) -> None:
        torch = _torch()
        with torch.no_grad():
            x.copy_(_as_source(a))

    def identity(self, x: Any) -> Hashable | None:
        if x.numel() == 0 or x.layout != _torch().strided or x.device.type == "meta":
            return None
        return (
            str(x.device),
            x.untyped_storage().data_ptr(),
            x.storage_offset(),
            tuple(x.shape),
            x.stride(),
            x.dtype,
        )

    def model_state(self, x: Any) -> ModelState | None:
        torch = _torch()
        if not isinstance(x, torch.nn.Module):
            return None
        leaves, buffers, local = {}, set(), set()
        for name, t in x.state_dict(keep_vars=True).items():  # tied weights under each name
            if not isinstance(t, torch.Tensor):
                local.add(name)  # extra state of a module
            elif isinstance(t, torch.nn.Parameter):
                if t.requires_grad:
                    leaves[name] = t
                else:
                    local.add(name)  # frozen
            elif t.is_floating_point():
                leaves[name] = t
                buffers.add(name)
            else:
                local.add(name)  # integer buffers
        local.update(n for n, _ in x.named_buffers(remove_duplicate=False) if n not in leaves)
        return ModelState(leaves, frozenset(buffers), frozenset(local))
