"""Modules imported when first used (:class:`Lazy`): the numba kernels cost every worker 0.3 s.

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
