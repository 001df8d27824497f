"""Array backends: how a leaf of NumPy, PyTorch, JAX or TensorFlow is read and written; a leaf's
:class:`Backend` is found by :func:`backend_of` without importing any framework."""

from __future__ import annotations

import functools
from typing import Any

from stalewise.backends.base import FLOAT_DTYPES, Backend, ModelState, numpy_dtype
from stalewise.backends.jax_ import JaxBackend
from stalewise.backends.numpy_ import NumpyBackend
from stalewise.backends.tensorflow_ import TensorFlowBackend
from stalewise.backends.torch_ import TorchBackend

_BACKENDS: dict[str, Backend] = {}
_BY_ROOT: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Adds a backend to the registry (replacing one of the same name) and returns it."""
    _BACKENDS[backend.name] = backend
    for root in backend.roots:
        _BY_ROOT[root] = backend
    _backend_of_type.cache_clear()
    return backend


def get_backend(name: str) -> Backend:
    """The registered backend called ``name``."""
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
    """The backend owning ``x`` (a leaf or a model, by the modules of its classes), or None."""
    return _backend_of_type(type(x))


for _b in (NumpyBackend(), TorchBackend(), JaxBackend(), TensorFlowBackend()):
    register(_b)
del _b

__all__ = ["FLOAT_DTYPES", "Backend", "JaxBackend", "ModelState", "NumpyBackend"]
__all__ += ["TensorFlowBackend", "TorchBackend", "backend_of", "get_backend", "numpy_dtype"]
__all__ += ["register"]
