"""The JAX backend: ``jax.Array`` leaves, immutable, so always copied; float64 needs x64 enabled."""

from __future__ import annotations

from typing import Any

import numpy as np

from stalewise.backends.base import Backend, numpy_dtype


class JaxBackend(Backend):
    """``jax.Array`` leaves."""

    name = "jax"
    roots = ("jax", "jaxlib")

    def is_leaf(self, x: Any) -> bool:
        import jax

        return isinstance(x, jax.Array)

    def from_numpy(self, a: np.ndarray, dtype: str, like: Any = None, *, copy: bool = True) -> Any:
        import jax.numpy as jnp

        return jnp.array(a, dtype=numpy_dtype(dtype), copy=True)
