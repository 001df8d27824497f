"""Synthetic linear least squares with a known solution.

``b = A x* + noise`` for a seeded Gaussian ``A``; batches are ``(A_rows, b_rows)`` of disjoint
row shards, or with ``exact=True`` ``None`` for the full-data gradient."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

from stalewise.tasks.base import check_int, check_memory, check_number, fields_repr, shard_batches

logger = logging.getLogger(__name__)

__all__ = ["LeastSquares"]

_MAX_GRAM_DIM = 2048


class LeastSquares:
    """Linear regression ``min_x 0.5 * mean((A x - b) ** 2)`` with known ``x*``; ``noise``: the
    standard deviation added to ``b``, ``condition``: the condition number of ``A^T A``."""

    name = "least-squares"

    def __init__(
        self,
        n: int = 2048,
        d: int = 64,
        noise: float = 0.0,
        condition: float = 1.0,
        batch_size: int = 32,
        exact: bool = False,
        seed: int = 0,
    ) -> None:
        n, d, batch_size = check_int("n", n), check_int("d", d), check_int("batch_size", batch_size)
        check_number("noise", noise, 0.0)
        check_number("condition", condition, 1.0)
        if not isinstance(exact, bool | np.bool_):
            raise ValueError(f"exact must be true or false, got {exact!r}")
        seed = check_int("seed", seed, low=0)
        check_memory(
            self.name, self.memory_bytes(n, d, noise, exact), {"n": (n, 2048), "d": (d, 64)}
        )
        self.n, self.d, self.noise, self.condition = n, d, noise, condition
        self.batch_size, self.exact, self.seed = batch_size, exact, seed
        self._cache: dict[str, Any] = {}

    @staticmethod
    def memory_bytes(n: int, d: int, noise: float = 0.0, exact: bool = False) -> int:
        """The bytes one process allocates for the task (data, vectors, the Gram matrix)."""
        nbytes = 4 * n * d + 4 * n + 8 * 4 * d
        if exact and d <= min(n, _MAX_GRAM_DIM):
            nbytes += 4 * d * d
            if noise > 0 or n < d:
                nbytes += 16 * n * d
        return nbytes

    def __repr__(self) -> str:
        return fields_repr(self, "n", "d", "noise", "condition", "batch_size", "exact", "seed")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = {}
        return state

    def _data(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Returns ``(A, b, x*)``, generating them on first use."""
        if "A" not in self._cache:
            rng = np.random.default_rng(self.seed)
            a = rng.standard_normal((self.n, self.d), dtype=np.float32)
            if self.condition > 1 and self.d > 1:
                exponents = np.arange(self.d) / (2.0 * (self.d - 1))
                a *= (self.condition**-exponents).astype(np.float32)
            x_star = rng.standard_normal(self.d, dtype=np.float32)
            b = a @ x_star
            if self.noise > 0:
                b += (self.noise * rng.standard_normal(self.n)).astype(np.float32)
            for arr in (a, b, x_star):
                arr.setflags(write=False)
            self._cache.update(A=a, b=b, x_star=x_star)
            logger.debug("generated least-squares data n=%d d=%d", self.n, self.d)
        return self._cache["A"], self._cache["b"], self._cache["x_star"]

    @property
    def x_star(self) -> np.ndarray:
        """The planted solution ``x*`` (``b = A x* + noise``)."""
        return self._data()[2]

    def optimum(self) -> np.ndarray:
        """A minimiser of the full-data loss (float32): ``x*``, or the minimum-norm solution."""
        if "optimum" not in self._cache:
            a, b, x_star = self._data()
            if self.noise == 0 and self.n >= self.d:
                x_opt = x_star
            else:
                x64 = np.linalg.lstsq(a.astype(np.float64), b.astype(np.float64), rcond=None)[0]
                x_opt = x64.astype(np.float32)
                x_opt.setflags(write=False)
            self._cache["optimum"] = x_opt
        return self._cache["optimum"]

    @property
    def optimal_loss(self) -> float:
        """The full-data loss at :meth:`optimum` (0 without noise when ``n >= d``)."""
        if "optimal_loss" not in self._cache:
            if self.noise == 0 and self.n >= self.d:
                self._cache["optimal_loss"] = 0.0
            else:
                a, b, _ = self._data()
                x_opt = self.optimum().astype(np.float64)
                r = a.astype(np.float64) @ x_opt - b
                self._cache["optimal_loss"] = float(0.5 * np.mean(r * r))
        return self._cache["optimal_loss"]

    def init_params(self, seed: int = 0) -> dict[str, np.ndarray]:
        """Returns ``{"x": zeros(d)}`` (``seed`` is accepted for the interface and unused)."""
        del seed
        return {"x": np.zeros(self.d, np.float32)}

    def batches(self, worker: int, workers: int, seed: int = 0) -> Iterator[Any]:
        """Yields ``(A_rows, b_rows)`` of ``worker``'s row shard forever (``exact``: None)."""
        if self.exact:
            if workers < 1 or not 0 <= worker < workers:
                raise ValueError(f"need 0 <= worker < workers, got {worker}, {workers}")
            return itertools.repeat(None)
        return self._minibatches(worker, workers, seed)

    def _minibatches(self, worker: int, workers: int, seed: int) -> Iterator[Any]:
        a, b, _ = self._data()
        for idx in shard_batches(self.n, self.batch_size, worker, workers, seed):
            yield a[idx], b[idx]

    def loss_and_grad(self, params: dict[str, np.ndarray], batch: Any) -> tuple:
        """Returns the loss and gradient on ``batch`` (``None`` = all the data)."""
        x = params["x"]
        if batch is not None:
            a, b = batch
            r = a @ x - b
            return float(0.5 * np.mean(np.square(r, dtype=np.float64))), {"x": (a.T @ r) / len(b)}
        if self.d > min(self.n, _MAX_GRAM_DIM):
            a, b, _ = self._data()
            r = a @ x.astype(np.float32) - b
            g = (a.T @ r) / self.n
            return float(0.5 * np.mean(np.square(r, dtype=np.float64))), {"x": g.astype(x.dtype)}
        if "gram" not in self._cache:
            a, _, _ = self._data()
            self._cache["gram"] = (a.T @ a) / np.float32(self.n)
        # grad = A^T (A x - b) / n = G (x - x_opt) because A^T (A x_opt - b) = 0.
        e = x - self.optimum()
        g = self._cache["gram"] @ e
        loss = 0.5 * float(np.dot(e.astype(np.float64), g)) + self.optimal_loss
        return loss, {"x": g.astype(x.dtype, copy=False)}

    def evaluate(self, params: dict[str, np.ndarray]) -> dict[str, float]:
        """Returns the full-data ``loss`` and ``distance = ||x - x*|| / ||x*||``."""
        a, b, x_star = self._data()
        x = np.asarray(params["x"], dtype=np.float32)
        r = a @ x - b
        loss = 0.5 * np.mean(np.square(r, dtype=np.float64))
        distance = np.linalg.norm(x - x_star) / np.linalg.norm(x_star)
        return {"loss": float(loss), "distance": float(distance)}
