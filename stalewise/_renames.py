"""Old keyword spellings kept for one release: each still works, with a DeprecationWarning
naming the new one (see "Names" in docs/design-notes.md)."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


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


_UNSET = object()


def renames(where: str | None = None, **old_to_new: str) -> Callable[[F], F]:
    """A decorator: the function still takes each old keyword ``old=``, as ``new=``, with a
    DeprecationWarning naming the new one (:func:`renamed`). Its signature shows only the
    new names; ``fn.renamed`` maps old -> new (the config file reads it to accept old keys).

    Example:
        >>> @renames(steps="local_steps")
        ... def f(local_steps):
        ...     return local_steps
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as w:
        ...     warnings.simplefilter("always")
        ...     f(steps=3), str(w[0].message)
        (3, 'f: steps= is now local_steps=; the old name will be removed in the next release')
    """

    def wrap(fn: F) -> F:
        name = where or fn.__name__

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            for old, new in old_to_new.items():
                if old in kwargs:
                    value = kwargs.pop(old)
                    given = kwargs.get(new, _UNSET)
                    kwargs[new] = renamed(name, old, new, value, given, unset=_UNSET)
            return fn(*args, **kwargs)

        call.renamed = dict(old_to_new)  # type: ignore[attr-defined]
        return call  # type: ignore[return-value]

    return wrap
