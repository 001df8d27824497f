"""Building stalewise objects from config tables, each checked against the constructor it calls."""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from stalewise import codecs, optim, tree
from stalewise import consistency as consistency_lib
from stalewise import staleness as staleness_lib
from stalewise import strategies as strategies_lib
from stalewise.api import Job
from stalewise.config import schema
from stalewise.config.schema import ConfigError, describe, is_int, is_number, one_of
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import SimConfigError


def _kinds(annotation: Any) -> list[tuple[str, Callable[[Any], bool]]] | None:
    """What a TOML value may be for an annotation: (description, check) pairs; None: unchecked."""
    if annotation is inspect.Parameter.empty or annotation is Any or isinstance(annotation, str):
        return None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        found: list = []
        for a in args:
            k = _kinds(a)
            if k is None:
                return None
            found += k
        return found
    if origin is typing.Literal:
        return [(f"one of {', '.join(map(repr, args))}", lambda v: v in args)]
    if annotation is bool:
        return [("true or false", lambda v: isinstance(v, bool))]
    if annotation is int:
        return [("an integer", is_int)]
    if annotation is float:
        return [("a number", is_number)]
    if annotation is str:
        return [("a string", lambda v: isinstance(v, str))]
    if annotation in (list, tuple) or origin in (list, tuple, Sequence, Iterable):
        inner = [a for a in args if a is not Ellipsis]
        elem = _kinds(typing.Union[tuple(inner)]) if inner else None  # noqa: UP007
        if not elem:
            return [("a list", lambda v: isinstance(v, list))]
        names = describe([_PLURALS.get(d, "values") for d, _ in elem])

        def each(v: Any) -> bool:
            return isinstance(v, list) and all(any(c(x) for _, c in elem) for x in v)

        pairs = [(f"a list of {names}", each)]
        if str in inner and origin is not list:  # a str is a sequence of str too
            pairs.insert(0, ("a string", lambda v: isinstance(v, str)))
        return pairs
    if annotation is dict or origin in (dict, Mapping, typing.Mapping):
        return [("a table", lambda v: isinstance(v, dict))]
    return []


_PLURALS = {"a string": "strings", "a number": "numbers", "an integer": "integers"}


def signature(fn: Any) -> inspect.Signature | None:
    for kwargs in ({"eval_str": True}, {}):
        try:
            return inspect.signature(fn, **kwargs)
        except (TypeError, ValueError, NameError, SyntaxError):
            continue
    return None


def call(
    fn: Any,
    kwargs: dict[str, Any],
    where: str,
    label: str,
    *,
    keys: Mapping[str, str] | None = None,
    extra: Mapping[str, Any] | None = None,
    user_code: bool = False,
) -> Any:
    """Calls ``fn(**kwargs, **extra)`` after checking ``kwargs`` against its signature; every
    error (and a ``TypeError``, ``ValueError`` or ``OSError`` of the call) names ``where.key``."""
    keys = dict(keys or {})
    extra = dict(extra or {})

    def key_of(name: str) -> str:
        return keys.get(name, f"{where}.{name}")

    sig = signature(fn)
    if sig is not None:
        params = sig.parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        named = [
            n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        for key in kwargs:
            if key not in named and not takes_any:
                known = ", ".join(
                    keys.get(n, n).rpartition(".")[2] for n in named if n not in extra
                )
                known = f"known: {known}" if known else "it takes none"
                raise ConfigError(key_of(key), f"unknown option for {label} ({known})")
        missing = [
            n
            for n in named
            if params[n].default is inspect.Parameter.empty and n not in kwargs and n not in extra
        ]
        if missing:
            raise ConfigError(
                key_of(missing[0]), f"missing: {label} needs {', '.join(map(key_of, missing))}"
            )
        for key, value in kwargs.items():
            kinds = _kinds(params[key].annotation) if key in params else None
            if kinds and not any(check(value) for _, check in kinds):
                raise ConfigError(
                    key_of(key), f"expected {describe([d for d, _ in kinds])}, got {value!r}"
                )
    try:
        return fn(**kwargs, **extra)
    except (TypeError, ValueError, OSError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        message = re.sub(rf"^{re.escape(getattr(fn, '__name__', ''))}(\(\))?: ", "", message)
        mentioned = [
            (m.start(), name)
            for name in kwargs
            if (m := re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", message))
        ]
        if user_code:
            message = f"{label} raised {type(e).__name__}: {message}"
        if not mentioned:
            raise ConfigError("task.factory" if user_code else where, message) from None
        name = min(mentioned)[1]
        if not user_code and message.startswith(f"{name} must "):
            message = message[len(name) + 1 :]
        raise ConfigError(key_of(name), message) from None


def job(params: Any, **kwargs: Any) -> Job:
    try:
        return Job(params, **kwargs)
    except (TypeError, ValueError) as e:
        if str(e).startswith("replicas must be "):
            raise ConfigError("server.replicas", str(e)[len("replicas ") :]) from None
        if str(e).startswith("shards="):
            size = tree.flatten(params)[1].size
            raise ConfigError(
                "server.shards",
                f"must be at most the number of parameters ({size}), got {kwargs['shards']}",
            ) from None
        raise ConfigError(
            "task", f"init_params() gave parameters stalewise cannot use: {e}"
        ) from None


def _schedule(
    spec: Any, where: str, lib: Any = optim, known: Sequence[str] = schema.SCHEDULES
) -> Any:
    """A schedule table ``{ name = ..., ... }`` at ``where``: of the optimizers' learning rate
    (``schema.SCHEDULES``), or ``adaptive``'s period (``lib`` strategies, ``PERIOD_SCHEDULES``)."""
    if not isinstance(spec, dict) or "name" not in spec:
        example = (
            'name = "constant", value = 0.01'
            if lib is optim
            else 'name = "adacomm", local_steps = 32'
        )
        raise ConfigError(
            where, f"expected a table with a name, such as {{ {example} }}, got {spec!r}"
        )
    name = spec["name"]
    fn = getattr(lib, one_of(name, known, f"{where}.name", "schedule"))
    kwargs = {k: v for k, v in spec.items() if k != "name"}
    return call(fn, kwargs, where, name)


def _optimizer(o: dict, where: str = "optimizer") -> Any:
    """An [optimizer]-like table as a stalewise optimizer; errors name ``where.key``."""
    name = one_of(o.get("name", "sgd"), schema.OPTIMIZERS, f"{where}.name", "optimizer")
    kwargs = {k: v for k, v in o.items() if k not in ("name", "schedule")}
    extra = {}
    if "schedule" in o:
        if "lr" in o:
            raise ConfigError(where, f"give {where}.lr or {where}.schedule, not both")
        extra["lr"] = _schedule(o["schedule"], f"{where}.schedule")
    keys = {"lr": f"{where}.lr"}
    if "lr" not in o and "schedule" not in o:
        raise ConfigError(f"{where}.lr", f"missing: {name} needs {where}.lr (or {where}.schedule)")
    return call(getattr(optim, name), kwargs, where, name, keys=keys, extra=extra)


def server_optimizer(
    o: dict, given: bool, strategy: strategies_lib.Strategy | None, workers: int
) -> Any:
    """The [optimizer] table's optimizer, or the strategy's recommendation without one."""
    if given or strategy is None:
        return _optimizer(o)
    recommended = strategy.server_optimizer(workers)
    if recommended is None:
        raise ConfigError(
            "optimizer",
            f"missing: strategy {strategy.name!r} recommends no server optimizer; add an "
            '[optimizer] table, such as name = "sgd" and lr = 0.1',
        )
    return recommended


def strategy_from_table(
    table: Mapping[str, Any], where: str = "strategy"
) -> strategies_lib.Strategy | None:
    """The [strategy] table as a strategy (None for an absent or empty table); ``inner`` is
    an [optimizer]-like table, every other key an option of the strategy's constructor."""
    if not table:
        return None
    if not isinstance(table, Mapping):
        raise ConfigError(where, f"must be a table, got {table!r}")
    name = table.get("name")
    if name is None:
        raise ConfigError(
            f"{where}.name", f"missing: name the strategy ({', '.join(schema.STRATEGIES)})"
        )
    fn = getattr(strategies_lib, one_of(name, schema.STRATEGIES, f"{where}.name", "strategy"))
    sig = signature(fn)
    known = list(sig.parameters) if sig is not None else []
    for key in table:
        if key != "name" and key not in known:
            takes = f"known: {', '.join(known)}" if known else "it takes none"
            raise ConfigError(f"{where}.{key}", f"unknown option for {name} ({takes})")
    kwargs = {k: v for k, v in table.items() if k not in ("name", "inner", "schedule")}
    extra = {}
    if "inner" in table:
        inner = table["inner"]
        if not isinstance(inner, dict):
            raise ConfigError(
                f"{where}.inner",
                f'expected an optimizer table such as {{ name = "adamw", lr = 0.001 }}, '
                f"got {inner!r}",
            )
        extra["inner"] = _optimizer(inner, f"{where}.inner")
    if "schedule" in table:
        extra["schedule"] = _schedule(
            table["schedule"], f"{where}.schedule", strategies_lib, schema.PERIOD_SCHEDULES
        )
    for key in extra:  # passed unchecked by call: name them if the call fails on them
        kwargs.pop(key, None)
    return call(fn, kwargs, where, name, extra=extra)


def codec(spec: Any, key: str) -> codecs.Policy:
    """A codec from ``"int8"``, ``"topk:0.01"`` or a table (:func:`stalewise.codecs.parse`)."""
    if not isinstance(spec, str | dict):
        raise ConfigError(
            key, f"expected a codec name such as 'topk:0.01' or a table, got {spec!r}"
        )
    try:
        return codecs.parse(spec)
    except (TypeError, ValueError) as e:
        raise ConfigError(key, str(e)) from None


def pull_codec(spec: Any, key: str) -> codecs.Policy | None:
    """The pull codec: None (absent, or ``"full"``: full pulls) or a codec as for ``codec``."""
    if spec is None or (isinstance(spec, str) and spec.strip() == "full"):
        return None
    return codec(spec, key)


def consistency(s: dict) -> consistency_lib.Consistency:
    name = s.get("consistency", "asp")
    if not isinstance(name, str) or name.lower() not in schema.CONSISTENCY:
        raise ConfigError(
            "server.consistency",
            f"unknown consistency model {name!r} (known: {', '.join(schema.CONSISTENCY)})",
        )
    options = {
        "hybrid": (consistency_lib.Hybrid, "tolerance"),
        "ssp": (consistency_lib.SSP, "bound"),
    }
    for model, (_, key) in options.items():
        if key in s and name.lower() != model:
            raise ConfigError(
                f"server.{key}", f'only for consistency = "{model}", got consistency = {name!r}'
            )
    if name.lower() not in options:
        return consistency_lib.from_name(name)
    cls, key = options[name.lower()]
    kwargs = {key: s[key]} if key in s else {}
    return call(cls, kwargs, "server", f"consistency {name.lower()}")


def staleness(s: dict) -> staleness_lib.Staleness:
    rules = ("constant", "inverse", "exponential", "polynomial")
    name = one_of(s.get("staleness", "constant"), rules, "server.staleness", "staleness rule")
    kwargs = {k: s[k] for k in ("max_staleness", "dc_lambda") if k in s}
    keys = {k: f"server.{k}" for k in kwargs}
    if "staleness_param" in s:
        if name not in schema.STALENESS_PARAM:
            raise ConfigError(
                "server.staleness_param",
                f'only for staleness = "exponential" (its base) or "polynomial" (its power), '
                f"got staleness = {name!r}",
            )
        kwargs[schema.STALENESS_PARAM[name]] = s["staleness_param"]
        keys[schema.STALENESS_PARAM[name]] = "server.staleness_param"
    return call(getattr(staleness_lib, name), kwargs, "server", f"staleness {name!r}", keys=keys)


def sim(table: dict) -> SimConfig:
    """The [sim] table as a SimConfig; an error names the key (``sim.failures[0].worker``)."""
    try:
        return SimConfig.from_dict(table)
    except SimConfigError as e:
        raise ConfigError(f"sim.{e.path}".rstrip("."), e.problem) from None


def check_sim_workers(sim: SimConfig, workers: int, key: str) -> None:
    try:
        sim.check_workers(workers)
    except SimConfigError as e:
        raise ConfigError(f"sim.{e.path}", f"{e.problem} (with {key} = {workers})") from None
