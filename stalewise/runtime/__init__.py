"""Runtimes host the protocol's shards and worker loop; each is described once, by name.

Built in: ``"local"``, ``"sim"`` and ``"ray"``; :func:`register` adds a :class:`Runtime`."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

Target = str | Callable[..., Any]  # a callable, or its "module:name"
_CALLABLES = ("run", "server", "attach", "serves", "launch", "connect")


@dataclasses.dataclass(frozen=True)
class Runtime:
    """One runtime: its functions (callables or ``"module:name"``) and what it can do."""

    name: str
    run: Target  # run(config, strategy, options) -> TrainResult
    server: Target | None = None  # server(config, workers, *, join_timeout, name=None)
    attach: Target | None = None  # attach(name, *, worker, timeout) -> a client (sw.attach)
    serves: Target | None = None  # serves(name) -> None if it may serve job name, else why not
    launch: Target | None = None  # launch(job, launch) -> exit status (stalewise run)
    connect: Target | None = None  # connect(address=None) -> True if it started the cluster
    elastic_train: bool = False  # Job.train takes workers=(min, max) or "auto"
    delta_pulls: bool = False  # it sends pulls compressed by the job's pull_codec
    replicas: bool = False  # it hosts replicated shards (replicas=2)
    no_delta_pulls: str = ""  # why not, when it does not (one phrase)
    max_workers: int = 4096  # the most workers a run may have
    resumes_from: str | None = None  # a key a checkpoint's step must carry (None: any)
    needs: str | None = None  # a module it needs, installed with pip install stalewise[NEEDS]
    simulated: bool = False  # its time is virtual (the [sim] table, sw.Simulation)
    transport: bool = False  # it emulates a push's transit (sw.Emulation(transport=))
    saves_served: bool = False  # job.serve and stalewise run save checkpoints on it
    watches_ranks: bool = False  # stalewise run's --rank-timeout watches its ranks
    calibrates: bool = False  # Job.calibrate measures its transport and worker loop
    logs_pushes: bool = False  # its shards write push logs: a resume replays them

    def missing(self) -> str | None:
        """Why this runtime cannot run here (what to install), or None."""
        if self.needs is None or importlib.util.find_spec(self.needs) is not None:
            return None
        return f"runtime {self.name!r} needs {self.needs}: pip install 'stalewise[{self.needs}]'"

    def load(self, what: str) -> Callable[..., Any]:
        """The function ``what`` (``"run"``, ``"server"``, ...), imported if given by path."""
        target = getattr(self, what)
        if target is None:
            raise ValueError(
                f"runtime {self.name!r} has no {what}; runtimes with one: "
                f"{', '.join(names(what)) or 'none'}"
            )
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            target = getattr(importlib.import_module(module), attr)
        return target


_RUNTIMES: dict[str, Runtime] = {}


def register(name: str, run: Target, **facts: Any) -> Runtime:
    """Registers (or replaces) the runtime ``name``: the fields of :class:`Runtime` as keywords."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a runtime needs a non-empty name, got {name!r}")
    runtime = Runtime(name, run, **facts)
    for what in _CALLABLES:
        value = getattr(runtime, what)
        path = isinstance(value, str) and value.count(":") == 1 and all(value.split(":"))
        if (value is not None or what == "run") and not (callable(value) or path):
            what = "runner" if what == "run" else what
            raise ValueError(
                f"runtime {name!r}: {what} must be a callable or a 'module:name' string, "
                f"got {value!r}"
            )
    _RUNTIMES[name] = runtime
    return runtime


register(
    "local",
    "stalewise.runtime.local.train:run",
    server="stalewise.runtime.local.server:LocalServer",
    attach="stalewise.runtime.local.attach:attach",
    serves="stalewise.runtime.local.attach:serves",
    launch="stalewise.launch:_serve_workers",
    transport=True,
    saves_served=True,
    watches_ranks=True,
    calibrates=True,
    logs_pushes=True,
    replicas=True,
    no_delta_pulls="the local runtime's pulls read a shared-memory snapshot (a memcpy, no "
    "network), so a delta pull would only add work",
)
register("sim", "stalewise.runtime.sim:run", delta_pulls=True, max_workers=16384,
         resumes_from="sim", simulated=True, replicas=True)  # fmt: skip
register(
    "ray",
    "stalewise.runtime.ray.train:run",
    server="stalewise.runtime.ray.server:RayServer",
    attach="stalewise.runtime.ray.client:attach",
    serves="stalewise.runtime.ray:serves",
    launch="stalewise.launch.ray:serve_workers",
    connect="stalewise.runtime.ray:connect",
    calibrates=True,
    elastic_train=True,
    delta_pulls=True,
    replicas=True,
    needs="ray",
    logs_pushes=True,
)


def names(able: str | None = None) -> tuple[str, ...]:
    """The known runtimes' names; with ``able`` (a :class:`Runtime` field), those that have it."""
    return tuple(n for n, r in _RUNTIMES.items() if able is None or getattr(r, able))


def describe(name: Any) -> Runtime:
    """The :class:`Runtime` called ``name``."""
    if not isinstance(name, str) or name not in _RUNTIMES:
        raise ValueError(f"unknown runtime {name!r}; known: {', '.join(_RUNTIMES)}")
    return _RUNTIMES[name]


def get(name: str) -> Callable[..., Any]:
    return describe(name).load("run")


def server(name: str) -> Callable[..., Any]:
    """The server factory of the runtime called ``name``."""
    runtime = describe(name)
    if runtime.server is None:
        raise ValueError(
            f"runtime {name!r} has no server for a loop you own; runtimes with one: "
            f"{', '.join(names('server')) or 'none'}"
        )
    return runtime.load("server")


def able(what: str) -> str:
    """The runtimes that have ``what`` (a field of :class:`Runtime`), as ``"local or ray"``."""
    return " or ".join(names(what)) or "none"


def replica_refusal(replicas: int, name: str) -> str | None:
    """Why runtime ``name`` refuses ``replicas`` copies of each shard, in one line; None if not."""
    if replicas == 1 or describe(name).replicas:
        return None
    able = " or ".join(map(repr, names("replicas")))
    return f"replicas={replicas}: runtime {name!r} does not host replicated shards yet; use {able}"


def pull_refusal(pull_codec: Any, name: str) -> str | None:
    """Why runtime ``name`` refuses delta pulls (a ``pull_codec``), in one line (None: it does not)."""
    runtime = describe(name)
    if pull_codec is None or runtime.delta_pulls:
        return None
    why = runtime.no_delta_pulls or f"runtime {name!r} does not send delta pulls yet"
    able = " or ".join(map(repr, names("delta_pulls")))
    return f"pull_codec={pull_codec!r}: {why}; use runtime {able}, or leave it unset"
