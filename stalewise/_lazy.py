"""Modules imported when first used.

The numba kernels (``optim/_kernels.py``, ``_codec_kernels.py``) cost about
0.3 s to import, most of ``import stalewise``. Every worker process pays for
the package's import, and most never run a kernel (the optimizer runs on the
shards; a codec only when the job has one), so the modules that call them hold
a :class:`Lazy` stand-in, which imports the real module at its first attribute.

Example:
    >>> json = Lazy("json")
    >>> json.dumps([1])
    '[1]'
"""

from __future__ import annotations

import importlib
from typing import Any


class Lazy:
    """Stands for the module ``name`` and imports it when an attribute is first read."""

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_module", None)

    def __getattr__(self, attr: str) -> Any:
        module = self._module
        if module is None:
            module = importlib.import_module(self._name)
            object.__setattr__(self, "_module", module)
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}>"
