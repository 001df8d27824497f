"""The TensorFlow backend: ``tf.Tensor`` / ``tf.Variable`` / Keras leaves and models."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from stalewise.backends.base import FLOAT_DTYPES, Backend, ModelState


def _tf() -> Any:
    import tensorflow as tf

    return tf


def _is_keras_variable(x: Any) -> bool:
    import sys

    keras = sys.modules.get("keras")
    return keras is not None and isinstance(x, keras.Variable)


class TensorFlowBackend(Backend):
    """``tf.Tensor``, ``tf.Variable`` and Keras variable leaves; Keras and ``tf.Module`` models."""

    name = "tensorflow"
    roots = ("tensorflow", "keras", "tf_keras")

    def is_leaf(self, x: Any) -> bool:
        tf = _tf()
        return isinstance(x, tf.Tensor | tf.Variable | tf.IndexedSlices) or _is_keras_variable(x)

    def dtype(self, x: Any) -> str:
        d = x.dtype
        return d if isinstance(d, str) else d.name

    def to_numpy(self, x: Any) -> np.ndarray:
        tf = _tf()
        if isinstance(x, tf.IndexedSlices):
            x = tf.convert_to_tensor(x)
        return np.asarray(x.numpy())

    def from_numpy(self, a: np.ndarray, dtype: str, like: Any = None, *, copy: bool = True) -> Any:
        tf = _tf()
        target = tf.as_dtype(dtype)
        t = tf.constant(a.copy())  # a private copy: tf may alias the NumPy memory it is given
        return t if t.dtype == target else tf.cast(t, target)

    def is_writable(self, x: Any) -> bool:
        return isinstance(x, _tf().Variable) or _is_keras_variable(x)

    def assign(self, x: Any, a: np.ndarray) -> None:
        if not self.is_writable(x):
            raise TypeError("tf.Tensor leaves are immutable")
        x.assign(self.from_numpy(a, self.dtype(x)))

    def identity(self, x: Any) -> Any:
        return id(x) if self.is_writable(x) else None  # the same variable; tensors are values

    def label(self, x: Any) -> str | None:
        if isinstance(x, _tf().Variable) or _is_keras_variable(x):
            return _variable_name(x)
        return None

    def model_state(self, x: Any) -> ModelState | None:
        tf = _tf()
        buffers, local = set(), set()
        if _is_keras(x) and hasattr(x, "trainable_variables"):
            prefix = f"{getattr(x, 'name', '')}/"
            pairs = [(_variable_name(v).removeprefix(prefix), v) for v in x.trainable_variables]
            rest = [(_variable_name(v).removeprefix(prefix), v) for v in x.non_trainable_variables]
            for name, v in rest:
                (buffers if self.dtype(v) in FLOAT_DTYPES else local).add(name)
            order = tuple(name for name, _ in pairs + rest)
            pairs += [(name, v) for name, v in rest if name in buffers]
        elif isinstance(x, tf.Module):
            found = x._flatten(
                predicate=lambda v: isinstance(v, tf.Variable) and v.trainable, with_path=True
            )
            pairs = [(".".join(str(p) for p in path), v) for path, v in found]
            order = ()
        else:
            return None
        named = dict(pairs)
        if len(named) != len(pairs):
            dupes = sorted({n for n, _ in pairs if sum(m == n for m, _ in pairs) > 1})
            raise ValueError(f"variables with the same name {dupes}; give them unique names")
        return ModelState(named, frozenset(buffers), frozenset(local), order)


def _is_keras(x: Any) -> bool:
    return any(k.__module__.partition(".")[0] in ("keras", "tf_keras") for k in type(x).__mro__)


def _variable_name(v: Any) -> str:
    return getattr(v, "path", None) or re.sub(r":\d+$", "", v.name)
