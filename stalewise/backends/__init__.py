"""Array backends: how a leaf of NumPy, PyTorch, JAX or TensorFlow is read and written.

A :class:`Backend` knows one framework's arrays: whether an object is a leaf,
its shape and dtype, how to copy it into (a slice of) a NumPy buffer, how to
build a new array from NumPy data and how to write into an existing mutable
leaf. :func:`backend_of` finds the backend of an object from the modules of
its class hierarchy, without importing any framework: an object can only come
from PyTorch if PyTorch is already imported, so ``import stalewise`` stays
fast and works with NumPy alone.

Backends are stateless and thread-safe.

Example:
    >>> import numpy as np
    >>> b = backend_of(np.zeros((2, 3), np.float32))
    >>> b.name, b.shape(np.zeros((2, 3))), b.dtype(np.zeros(2, np.float16))
    ('numpy', (2, 3), 'float16')
    >>> backend_of([1.0]) is None
    True
"""

from __future__ import annotations

import functools
from collections.abc import Hashable
from typing import Any, NamedTuple

import numpy as np

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
"""Dtype names of trainable leaves, narrowest first."""


class ModelState(NamedTuple):
    """What a model object (``nn.Module``, Keras model, ``tf.Module``) shares, by name.

    Tied tensors appear under each of their names (the same object), so that
    :mod:`stalewise.tree` stores them once and writes every name back.
    """

    leaves: dict[str, Any]  # name -> trainable parameter or float buffer
    buffers: frozenset[str] = frozenset()  # names in ``leaves`` that are buffers
    local: frozenset[str] = frozenset()  # the model's other state: kept by each worker
    order: tuple[str, ...] = ()  # the model's own order, for updates given as a list (Keras)


class Backend:
    """The operations :mod:`stalewise.tree` needs from one array framework.

    Subclasses import their framework lazily, inside the methods, and only
    after :func:`backend_of` has matched an object from that framework.
    """

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
        raise NotImplementedError

    def to_numpy(self, x: Any) -> np.ndarray:
        """Leaf ``x`` as a NumPy array (a view when the framework allows; do not write to it)."""
        raise NotImplementedError

    def copy_into(self, x: Any, out: np.ndarray) -> None:
        """Copies leaf ``x`` into ``out`` (same shape, any float dtype), casting as needed."""
        np.copyto(out, self.to_numpy(x), casting="unsafe")

    def from_numpy(self, a: np.ndarray, dtype: str, like: Any = None, *, copy: bool = True) -> Any:
        """A leaf of this backend with the values of ``a`` and dtype ``dtype``.

        Args:
          a: the values.
          dtype: the dtype name of the result (one of :data:`FLOAT_DTYPES`).
          like: an existing leaf whose placement (e.g. torch device) the result takes.
          copy: if False, the result may share memory with ``a`` when the dtype
            already matches (NumPy and CPU torch only).
        """
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
        """Equal for two leaves that are the same mutable array (tied weights), else None.

        None (the default, and always for immutable arrays such as JAX's) means
        the leaf is tied to nothing: a value in two places is two leaves, as
        ``jax.grad`` sees it.
        """
        return None

    def label(self, x: Any) -> str | None:
        """A leaf's own name (a TensorFlow variable's path), or None."""
        return None

    def __repr__(self) -> str:
        return f"<Backend {self.name}>"


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype for a dtype name; ``"bfloat16"`` needs ``ml_dtypes``.

    Example:
        >>> numpy_dtype("float16")
        dtype('float16')
    """
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as e:  # pragma: no cover - ml_dtypes ships with jax and tensorflow
            raise ImportError("bfloat16 leaves need the ml_dtypes package") from e
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


_BACKENDS: dict[str, Backend] = {}
_BY_ROOT: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Adds a backend to the registry (replacing one of the same name) and returns it.

    Example:
        >>> register(get_backend("numpy")).name
        'numpy'
    """
    _BACKENDS[backend.name] = backend
    for root in backend.roots:
        _BY_ROOT[root] = backend
    _backend_of_type.cache_clear()
    return backend


def get_backend(name: str) -> Backend:
    """The registered backend called ``name``.

    Example:
        >>> get_backend("torch").name
        'torch'
    """
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(_BACKENDS)}") from None


@functools.lru_cache(maxsize=1024)
def _backend_of_type(cls: type) -> Backend | None:
    for klass in cls.__mro__:
        backend = _BY_ROOT.get(klass.__module__.partition(".")[0])
        if backend is not None:
            return backend
    return None


def backend_of(x: Any) -> Backend | None:
    """The backend owning ``x`` (a leaf or a model), or None for other objects.

    The match uses the modules of ``type(x)`` and its base classes, so a user's
    ``torch.nn.Module`` subclass belongs to torch; no framework is imported.

    Example:
        >>> import numpy as np
        >>> backend_of(np.float32(1.0)).name
        'numpy'
    """
    return _backend_of_type(type(x))


from stalewise.backends.jax_ import JaxBackend  # noqa: E402
from stalewise.backends.numpy_ import NumpyBackend  # noqa: E402
from stalewise.backends.tensorflow_ import TensorFlowBackend  # noqa: E402
from stalewise.backends.torch_ import TorchBackend  # noqa: E402

for _b in (NumpyBackend(), TorchBackend(), JaxBackend(), TensorFlowBackend()):
    register(_b)
del _b

__all__ = [
    "FLOAT_DTYPES",
    "Backend",
    "JaxBackend",
    "ModelState",
    "NumpyBackend",
    "TensorFlowBackend",
    "TorchBackend",
    "backend_of",
    "get_backend",
    "numpy_dtype",
    "register",
]
