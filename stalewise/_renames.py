"""Old keyword spellings kept for one release: each still works, with a DeprecationWarning
naming the new one (see "Names" in docs/design-notes.md)."""

from __future__ import annotations

import warnings
from typing import Any


def renamed(where: str, old: str, new: str, old_value: Any, new_value: Any, *,
            unset: Any = None, stacklevel: int = 3) -> Any:  # fmt: skip
    """The value of keyword ``new``, whose old name is ``old``.

    ``old_value`` (when not ``unset``) is used, with a DeprecationWarning naming
    ``new``; giving both is a TypeError.

    Example:
        >>> renamed("f", "steps", "local_steps", None, 4)
        4
    """
    if old_value is unset:
        return new_value
    if new_value is not unset:
        raise TypeError(f"{where}: pass {new}= only ({old}= is its old name)")
    warnings.warn(
        f"{where}: {old}= is now {new}=; the old name will be removed in the next release",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return old_value
