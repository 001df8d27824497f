"""The NumPy backend: ``np.ndarray`` leaves (and NumPy scalars, as 0-d leaves)."""

from __future__ import annotations

from typing import Any

import numpy as np

from stalewise.backends.base import Backend, numpy_dtype


class NumpyBackend(Backend):
    """``np.ndarray`` and ``np.generic`` leaves; new leaves are arrays (0-d for scalars)."""

    name = "numpy"
    roots = ("numpy",)

    def is_leaf(self, x: Any) -> bool:
        return isinstance(x, np.ndarray | np.generic)

    def shape(self, x: Any) -> tuple[int, ...]:
        return tuple(np.shape(x))

    def from_numpy(self, a: np.ndarray, dtype: str, like: Any = None, *, copy: bool = True) -> Any:
        target = numpy_dtype(dtype)
        if a.dtype != target:
            return a.astype(target)
        return a.copy() if copy else a

    def identity(self, x: Any) -> Any:
        return id(x) if isinstance(x, np.ndarray) else None  # the same array object

    def is_writable(self, x: Any) -> bool:
        return isinstance(x, np.ndarray) and x.flags.writeable

    def assign(self, x: Any, a: np.ndarray) -> None:
        if not self.is_writable(x):
            raise TypeError("read-only NumPy array or NumPy scalar cannot be written in place")
        np.copyto(x, a, casting="unsafe")
