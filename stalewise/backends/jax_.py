"""The JAX backend: ``jax.Array`` leaves, immutable, so never written in place and always
copied; ``float64`` leaves need ``jax_enable_x64``."""

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
