"""Handwritten digits: a small MLP classifier on scikit-learn's bundled digits.

``64 -> hidden -> 10`` on ``sklearn.datasets.load_digits``, standardised, softmax cross-entropy;
NumPy with manual backprop (``digits_torch`` and ``digits_jax`` start from the same numbers)."""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from stalewise.tasks.base import check_int, check_memory, check_number, fields_repr, shard_batches

logger = logging.getLogger(__name__)

__all__ = ["Digits", "DigitsData", "init_mlp", "load_digits_split"]

NUM_FEATURES = 64
NUM_CLASSES = 10
_ACTIVATIONS = ("tanh", "relu")
#: A log-probability below this (a probability under 1e-20) is 0 in the gradient: left
#: subnormal, it made the backward's matrix products 5-15x slower.
_FLUSH = -46.0


class DigitsData(NamedTuple):
    """A standardised, split copy of the digits data (arrays are read-only)."""

    x_train: np.ndarray  # (n_train, 64) float32, standardised, in random order
    y_train: np.ndarray  # (n_train,) int64 class labels
    x_test: np.ndarray  # (n_test, 64) float32, standardised with training statistics
    y_test: np.ndarray  # (n_test,) int64 class labels


@functools.lru_cache(maxsize=8)
def load_digits_split(seed: int = 0, test_fraction: float = 0.2) -> DigitsData:
    """The digits split by class (``test_fraction`` held out), read-only, cached, by ``seed``."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    # scikit-learn's bundled file, read directly: importing sklearn.datasets costs a process ~2 s
    spec = importlib.util.find_spec("sklearn")
    path = spec and Path(spec.submodule_search_locations[0], "datasets/data/digits.csv.gz")
    if path and path.is_file():
        data = np.loadtxt(path, delimiter=",")
        x, y = data[:, :-1], data[:, -1]
    else:  # another layout, or none: the public call
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
    x, y = x.astype(np.float64), y.astype(np.int64)
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in range(NUM_CLASSES):
        members = rng.permutation(np.flatnonzero(y == c))
        n_test = round(test_fraction * len(members))
        test.append(members[:n_test])
        train.append(members[n_test:])
    train_idx = rng.permutation(np.concatenate(train))
    test_idx = np.sort(np.concatenate(test))
    mean = x[train_idx].mean(axis=0)
    std = x[train_idx].std(axis=0)
    std[std == 0.0] = 1.0  # border pixels that are blank in every training image
    arrays = (
        ((x[train_idx] - mean) / std).astype(np.float32),
        y[train_idx],
        ((x[test_idx] - mean) / std).astype(np.float32),
        y[test_idx],
    )
    for a in arrays:
        a.setflags(write=False)
    logger.debug("digits split seed=%d: %d train, %d test", seed, len(train_idx), len(test_idx))
    return DigitsData(*arrays)


def init_mlp(hidden: int = 64, activation: str = "tanh", seed: int = 0) -> dict:
    """NumPy float32 parameters of the digits MLP (Glorot for ``"tanh"``, He for ``"relu"``)."""
    _check_activation(activation)
    rng = np.random.default_rng(seed)
    params = {}
    for name, (fan_in, fan_out) in {
        "layer1": (NUM_FEATURES, hidden),
        "layer2": (hidden, NUM_CLASSES),
    }.items():
        if activation == "relu":
            w = rng.normal(0.0, np.sqrt(2.0 / fan_in), size=(fan_in, fan_out))
        else:
            limit = np.sqrt(6.0 / (fan_in + fan_out))
            w = rng.uniform(-limit, limit, size=(fan_in, fan_out))
        params[name] = {"w": w.astype(np.float32), "b": np.zeros(fan_out, np.float32)}
    return params


def _check_activation(activation: str) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")


def _forward(params: dict, x: np.ndarray, activation: str) -> tuple[np.ndarray, np.ndarray]:
    """Returns (hidden activations, logits)."""
    l1, l2 = params["layer1"], params["layer2"]
    z = x @ l1["w"] + l1["b"]
    h = np.tanh(z) if activation == "tanh" else np.maximum(z, 0)
    return h, h @ l2["w"] + l2["b"]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


class Digits:
    """Digits MLP classifier with NumPy arrays; batches are ``(x float32, y int64)``, the
    maths in the parameters' dtype; ``split_seed`` fixes the train/test split."""

    name = "digits"

    def __init__(
        self,
        hidden: int = 64,
        activation: str = "tanh",
        batch_size: int = 32,
        test_fraction: float = 0.2,
        split_seed: int = 0,
    ) -> None:
        _check_activation(activation)
        hidden, batch_size = check_int("hidden", hidden), check_int("batch_size", batch_size)
        check_number("test_fraction", test_fraction, 0.0, 1.0, open_="both")
        split_seed = check_int("split_seed", split_seed, low=0)
        check_memory(
            self.name,
            self.memory_bytes(hidden, batch_size, test_fraction),
            {"hidden": (hidden, 64)},
        )
        self.hidden, self.activation, self.batch_size = hidden, activation, batch_size
        self.test_fraction, self.split_seed = test_fraction, split_seed

    @staticmethod
    def memory_bytes(hidden: int, batch_size: int = 32, test_fraction: float = 0.2) -> int:
        """The bytes one process allocates for the task (data, parameters, activations)."""
        total = 1797  # the digits images
        rows = max(round(total * test_fraction), min(batch_size, total))
        fan = NUM_FEATURES + NUM_CLASSES + 1
        return 3 * total * NUM_FEATURES * 4 + hidden * fan * (8 + 3 * 4) + 4 * 4 * rows * hidden

    def __repr__(self) -> str:
        return fields_repr(
            self, "hidden", "activation", "batch_size", "test_fraction", "split_seed"
        )

    @property
    def data(self) -> DigitsData:
        """The split data (loaded on first use, cached per process, never pickled)."""
        return load_digits_split(self.split_seed, self.test_fraction)

    @property
    def num_train(self) -> int:
        """Number of training examples shared among the workers."""
        return len(self.data.y_train)

    def init_params(self, seed: int = 0) -> Any:
        """Returns fresh parameters in this task's backend, deterministic by ``seed``."""
        return self._from_numpy(init_mlp(self.hidden, self.activation, seed))

    def batches(self, worker: int, workers: int, seed: int = 0) -> Iterator[Any]:
        """Yields ``worker``'s ``(x, y)`` minibatches forever (:func:`shard_batches`)."""
        data = self.data
        for idx in shard_batches(len(data.y_train), self.batch_size, worker, workers, seed):
            yield self._batch(data.x_train[idx], data.y_train[idx])

    def evaluate(self, params: Any) -> dict[str, float]:
        """Returns the held-out ``loss`` (mean cross-entropy) and ``accuracy``."""
        p = self._to_numpy(params)
        data = self.data
        _, logits = _forward(p, data.x_test.astype(p["layer1"]["w"].dtype), self.activation)
        logp = _log_softmax(logits)
        loss = -logp[np.arange(len(data.y_test)), data.y_test].mean()
        accuracy = (logits.argmax(axis=1) == data.y_test).mean()
        return {"loss": float(loss), "accuracy": float(accuracy)}

    def loss_and_grad(self, params: dict, batch: tuple[np.ndarray, np.ndarray]) -> tuple:
        """Returns the mean cross-entropy of ``batch`` and its gradient."""
        x, y = batch
        dtype = params["layer1"]["w"].dtype
        x = np.asarray(x, dtype=dtype)
        h, logits = _forward(params, x, self.activation)
        logp = _log_softmax(logits)
        rows = np.arange(len(y))
        loss = -logp[rows, y].mean()
        dlogits = np.exp(logp)
        dlogits[logp < _FLUSH] = 0.0
        dlogits[rows, y] -= 1.0
        dlogits /= len(y)
        w2 = params["layer2"]["w"]
        dh = dlogits @ w2.T
        dz = dh * (1.0 - h * h) if self.activation == "tanh" else dh * (h > 0)
        grads = {
            "layer1": {"w": x.T @ dz, "b": dz.sum(axis=0)},
            "layer2": {"w": h.T @ dlogits, "b": dlogits.sum(axis=0)},
        }
        return float(loss), grads

    def _from_numpy(self, tree: dict) -> Any:
        return tree

    def _to_numpy(self, tree: Any) -> dict:
        return tree

    def _batch(self, x: np.ndarray, y: np.ndarray) -> Any:
        return x, y
