"""What every array backend is: :class:`Backend`, :class:`ModelState` and the dtype names."""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
"""Dtype names of trainable leaves, narrowest first."""


@functools.cache
def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, remembered (NumPy works it out in Python each time: 2 us)."""
    return dtype.name


class ModelState(NamedTuple):
    """What a model object shares, by name (a tied tensor under each of its names)."""

    leaves: dict[str, Any]  # name -> trainable parameter or float buffer
    buffers: frozenset[str] = frozenset()  # names in ``leaves`` that are buffers
    local: frozenset[str] = frozenset()  # the model's other state: kept by each worker
    order: tuple[str, ...] = ()  # the model's own order, for updates given as a list (Keras)


class Backend:
    """The operations :mod:`stalewise.tree` needs from one array framework (imported lazily)."""

    name: str = ""
    roots: tuple[str, ...] = ()  # top-level module names whose classes this backend owns

    def is_leaf(self, x: Any) -> bool:
        """Whether ``x`` is an array of this backend (as opposed to a model or container)."""
        raise NotImplementedError

    def shape(self, x: Any) -> tuple[int, ...]:
        """The shape of leaf ``x`` as a tuple of ints."""
        return tuple(int(d) for d in x.shape)

    def dtype(self, x: Any) -> str:
        """The dtype name of leaf ``x``, e.g. ``"float32"`` or ``"bfloat16"``."""
        return dtype_name(x.dtype)

    def to_numpy(self, x: Any) -> np.ndarray:
        """Leaf ``x`` as a NumPy array (a view when the framework allows; do not write to it)."""
        return np.asarray(x)

    def copy_into(self, x: Any, out: np.ndarray) -> None:
        """Copies leaf ``x`` into ``out`` (same shape, any float dtype), casting as needed."""
        np.copyto(out, self.to_numpy(x), casting="unsafe")

    def from_numpy(self, a: np.ndarray, dtype: str, like: Any = None, *, copy: bool = True) -> Any:
        """A leaf of ``a`` as ``dtype``, placed as ``like`` (``copy=False``: maybe sharing ``a``)."""
        raise NotImplementedError

    def is_writable(self, x: Any) -> bool:
        """Whether :meth:`assign` can write into leaf ``x`` in place."""
        return False

    def assign(self, x: Any, a: np.ndarray) -> None:
        """Writes the values of ``a`` (same shape) into the mutable leaf ``x``."""
        raise TypeError(f"{type(x).__qualname__} leaves are immutable")

    def model_state(self, x: Any) -> ModelState | None:
        """What the model object ``x`` shares, or None if ``x`` is no model."""
        return None

    def identity(self, x: Any) -> Hashable | None:
        """Equal for two leaves that are the same mutable array (tied weights), else None."""
        return None

    def label(self, x: Any) -> str | None:
        """A leaf's own name (a TensorFlow variable's path), or None."""
        return None

    def __repr__(self) -> str:
        return f"<Backend {self.name}>"


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype for a dtype name; ``"bfloat16"`` needs ``ml_dtypes``."""
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as e:  # pragma: no cover - ml_dtypes ships with jax and tensorflow
            raise ImportError("bfloat16 leaves need the ml_dtypes package") from e
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
