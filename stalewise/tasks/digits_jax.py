"""The digits MLP (:class:`stalewise.tasks.digits.Digits`) on JAX: float32 ``jax.Array``
leaves, batches ``(x float32, y int32)``, a jitted ``jax.value_and_grad``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from stalewise.tasks.digits import Digits

__all__ = ["DigitsJax"]


def _loss(params: dict, x: jax.Array, y: jax.Array, activation: str) -> jax.Array:
    l1, l2 = params["layer1"], params["layer2"]
    z = x.astype(l1["w"].dtype) @ l1["w"] + l1["b"]
    h = jnp.tanh(z) if activation == "tanh" else jax.nn.relu(z)
    logp = jax.nn.log_softmax(h @ l2["w"] + l2["b"], axis=-1)
    return -jnp.take_along_axis(logp, y[:, None], axis=1).mean()


_value_and_grad = jax.jit(jax.value_and_grad(_loss), static_argnames="activation")


class DigitsJax(Digits):
    """Digits MLP classifier on JAX (see :class:`~stalewise.tasks.digits.Digits`)."""

    name = "digits-jax"

    def loss_and_grad(self, params: dict, batch: tuple[jax.Array, jax.Array]) -> tuple:
        """Returns the mean cross-entropy of ``batch`` and its gradient (jitted)."""
        x, y = batch
        loss, grads = _value_and_grad(params, x, y, activation=self.activation)
        return float(loss), grads

    def _from_numpy(self, tree: dict) -> dict:
        return jax.tree_util.tree_map(jnp.asarray, tree)

    def _to_numpy(self, tree: dict) -> dict:
        return jax.tree_util.tree_map(np.asarray, tree)

    def _batch(self, x: np.ndarray, y: np.ndarray) -> tuple[jax.Array, jax.Array]:
        return jnp.asarray(x), jnp.asarray(y.astype(np.int32))
