"""Built-in tasks, by name (:func:`get`): ``digits`` (NumPy MLP on 8x8 digits; evaluates loss,
accuracy), ``digits-torch`` and ``digits-jax`` (the same numbers), ``least-squares`` (NumPy
linear regression; loss, distance) and ``lm`` (PyTorch byte GPT; loss, perplexity)."""

from __future__ import annotations

import importlib
from typing import Any

from stalewise.tasks.base import SeededTask, Task, shard_batches, shard_indices, with_seed

__all__ = ["SeededTask", "Task", "get", "names", "shard_batches", "shard_indices", "task_class"]
__all__ += ["with_seed"]

_REGISTRY: dict[str, tuple[str, str]] = {
    "digits": ("stalewise.tasks.digits", "Digits"),
    "digits-torch": ("stalewise.tasks.digits_torch", "DigitsTorch"),
    "digits-jax": ("stalewise.tasks.digits_jax", "DigitsJax"),
    "least-squares": ("stalewise.tasks.least_squares", "LeastSquares"),
    "lm": ("stalewise.tasks.lm", "LanguageModel"),
}


def names() -> list[str]:
    return sorted(_REGISTRY)


def get(name: str, **kwargs: Any) -> Task:
    """A new built-in task ``name`` (:func:`names`; else ValueError) built with ``kwargs``."""
    return task_class(name)(**kwargs)


def task_class(name: str) -> type:
    """The class of a built-in task (importing its backend); ValueError if unknown."""
    try:
        module_name, class_name = _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(names())}") from None
    return getattr(importlib.import_module(module_name), class_name)
