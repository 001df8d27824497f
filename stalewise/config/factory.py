"""The [task] table: a built-in task or a factory's (running its module's code), checked."""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import os
import re
import sys
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from stalewise import tasks
from stalewise.config.build import call, signature
from stalewise.config.schema import ConfigError, one_of

#: The task methods a factory's object must have, with the arguments stalewise passes.
TASK_METHODS = {
    "init_params": ("seed",),
    "loss_and_grad": ("params", "batch"),
    "batches": ("worker", "workers", "seed"),
    "evaluate": ("params",),
}


def check_task_table(t: dict) -> None:
    if ("name" in t) == ("factory" in t):
        raise ConfigError(
            "task", "give exactly one of task.name (built-in) or task.factory (module:function)"
        )
    if "name" in t and not isinstance(t["name"], str):
        raise ConfigError("task.name", f"expected a string, got {t['name']!r}")
    if "name" in t:
        one_of(t["name"], tasks.names(), "task.name", "task")
    if "factory" in t:
        target = t["factory"]
        module, _, func = target.partition(":") if isinstance(target, str) else ("", "", "")
        dotted = r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*"
        if not (re.fullmatch(dotted, module) and re.fullmatch(dotted, func)):
            raise ConfigError(
                "task.factory", f"expected 'module:function' such as 'mytask:make', got {target!r}"
            )
    if not isinstance(t.get("args", {}), dict):
        raise ConfigError("task.args", f"must be a table, got {t['args']!r}")


def task(t: dict, base: str | os.PathLike[str] | None) -> tuple[Any, tuple[str, ...]]:
    """Builds the task; returns it and the folders its factory's module was found in."""
    args = t.get("args", {})
    if "name" in t:
        try:
            cls = tasks.task_class(t["name"])
        except ImportError as e:
            raise ConfigError(
                "task.name", f"task {t['name']!r} needs a package that is not installed: {e}"
            ) from None
        return call(cls, args, "task.args", f"task {t['name']!r}"), ()
    target = t["factory"]
    factory, paths = _load_factory(target, base)
    if not callable(factory):
        raise ConfigError("task.factory", f"{target} is a {type(factory).__name__}, not a function")
    with on_path(paths):
        task = call(factory, args, "task.args", target, user_code=True)
    _check_task_object(task, target)
    return task, paths


def _load_factory(target: str, base: str | os.PathLike[str] | None) -> tuple[Any, tuple[str, ...]]:
    module, _, func = target.partition(":")
    top = module.split(".")[0]
    folders = list(dict.fromkeys(str(Path(d).resolve()) for d in (base, os.getcwd()) if d))
    importlib.invalidate_caches()  # the module may have been written after start-up
    found = next(
        (d for d in folders if importlib.machinery.PathFinder.find_spec(top, [d]) is not None),
        None,
    )
    paths = (found,) if found else ()
    loaded = sys.modules.get(top)
    if found and loaded is not None and not _is_under(loaded, found):
        where = getattr(loaded, "__file__", None) or "a built-in module"
        raise ConfigError(
            "task.factory",
            f"cannot load {target!r} from {found}: a module named {top!r} is already "
            f"imported from {where}; rename your module",
        )
    try:
        with on_path(paths):
            obj = importlib.import_module(module)
    except (ImportError, SyntaxError) as e:
        looked = ", ".join([*folders, "sys.path"])
        raise ConfigError(
            "task.factory", f"cannot load {target!r}: {e} (looked in {looked})"
        ) from None
    for part in func.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigError(
                "task.factory", f"cannot load {target!r}: {module} has no {func!r}"
            ) from None
    return obj, paths


def _is_under(module: types.ModuleType, folder: str) -> bool:
    places = [getattr(module, "__file__", None), *getattr(module, "__path__", [])]
    return any(p and Path(p).resolve().is_relative_to(folder) for p in places)


@contextlib.contextmanager
def on_path(paths: Sequence[str], *, env: bool = False) -> Iterator[None]:
    """Puts ``paths`` first on ``sys.path`` (and ``PYTHONPATH`` if ``env``) within the block."""
    if not paths:
        yield
        return
    added = [p for p in paths if p not in sys.path]
    sys.path[:0] = added
    old = os.environ.get("PYTHONPATH")
    if env:
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *([old] if old else [])])
    try:
        yield
    finally:
        for p in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(p)
        if env:
            if old is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old


def _check_task_object(task: Any, target: str) -> None:
    """A factory's object has the task methods, taking the arguments stalewise passes."""
    missing = [m for m in TASK_METHODS if not callable(getattr(task, m, None))]
    if missing:
        raise ConfigError(
            "task.factory",
            f"{target} returned {type(task).__name__}, without the task method(s) "
            f"{', '.join(missing)} (see stalewise.tasks.Task)",
        )
    for method, arg_names in TASK_METHODS.items():
        sig = signature(getattr(task, method))
        if sig is None:
            continue
        try:
            sig.bind(*range(len(arg_names)))
        except TypeError as e:
            raise ConfigError(
                "task.factory",
                f"{target} returned a task whose {method}() cannot be called as "
                f"{method}({', '.join(arg_names)}): {e}",
            ) from None


def check_batches(task: Any, workers: int, seed: int, key: str) -> None:
    """The task gives the last of ``workers`` workers a batch (stalewise's call, with the seed)."""
    w = workers - 1
    try:
        next(iter(task.batches(w, workers, seed)))
        return
    except StopIteration:
        problem = "gave no batches"
    except (TypeError, ValueError) as e:
        problem = f"failed: {e}"
    call = f"task.batches({w}, {workers}, {seed})"
    if workers > 1:
        try:
            next(iter(task.batches(0, 1, seed)))
        except (StopIteration, TypeError, ValueError):
            pass
        else:  # one worker is fine: the count is the problem
            raise ConfigError(key, f"the task cannot feed {workers} workers: {call} {problem}")
    raise ConfigError("task", f"{call} {problem}")


def metric_names(task: Any, params: Any) -> tuple[str, ...]:
    metrics = task.evaluate(params)
    if not isinstance(metrics, Mapping):
        raise ConfigError(
            "task", f"evaluate(params) must return a dict of metrics, got {type(metrics).__name__}"
        )
    return tuple(metrics)
