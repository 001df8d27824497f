"""``job.serve(runtime="ray")``: a job's shard actors for loops you own, and its :class:`Door`
actor for ``sw.attach(NAME)``, named after the job in the ``stalewise`` namespace."""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
from typing import Any

import numpy as np

from stalewise import tree
from stalewise.protocol import ServerConfig
from stalewise.protocol.pipeline import PUBLISH_EVERY
from stalewise.runtime.attach import check_name
from stalewise.runtime.base import worker_range
from stalewise.runtime.logs import child_logging
from stalewise.runtime.ray import cluster, connect, import_ray
from stalewise.runtime.ray.client import NAMESPACE, RayClient, attach, door_name
from stalewise.runtime.ray.shard import ShardActor

log = logging.getLogger(__name__)

WATCH_EVERY = 0.5  # seconds between two looks of the door's watcher at its list of leases
DEPART_TIMEOUT = 60.0  # seconds the shards may take to let a worker go
DOOR_THREADS = 1000  # the door's calls at once (rendezvous calls wait, one per worker)


class Door:
    """The served job's door (a threaded actor): worker ids, incarnations, leases."""

    def __init__(
        self,
        name: str,
        config: ServerConfig,
        shards: list,
        workers: int,
        expected: int,
        join_timeout: float,
    ):
        child_logging(f"door {name}")
        self.name, self.config, self.shards = name, config, list(shards)
        self.workers, self.expected = workers, expected
        self.incs = [0] * workers  # the newest incarnation of each worker id
        self.held: dict[int, int] = {}  # worker id -> its attached incarnation
        # error feedback: the residual each worker id closed with, for its next incarnation
        self.residuals: dict[int, Any] = {}
        self.leases: dict[Any, tuple[int, int]] = {}  # a lease's watch ref -> (w, inc)
        self.lock = threading.RLock()
        self.changed = threading.Event()  # a lease was added: the watcher looks again
        self.arrived = 0
        self.arrival = threading.Event()
        self.aborted = False
        threading.Thread(target=self._watch, daemon=True).start()
        if expected:
            timer = threading.Timer(join_timeout, self._expire, (join_timeout,))
            timer.daemon = True
            timer.start()

    def ready(self) -> bool:
        return True

    def _expire(self, join_timeout: float) -> None:
        import ray

        gone = ray.get([s.expire_unstarted.remote() for s in self.shards])[0]
        if gone:
            why = "did not join within join_timeout=%g s; the gates stop waiting for them"
            ids = ", ".join(map(str, gone))
            log.warning("job %r: worker(s) %s " + why, self.name, ids, join_timeout)

    def attach(self, want: int | None, lease: Any) -> dict:
        """Admits a new incarnation of ``want`` (None: the lowest free id); its client's parts."""
        import ray

        with self.lock:
            w = self._free(want)
            self.incs[w] += 1
            inc = self.incs[w]
            clocks = ray.get([s.join.remote(w, inc) for s in self.shards])
            self.held[w] = inc
            self.leases[lease.watch.remote()] = (w, inc)
            self.changed.set()
        log.info("job %r: worker %d attached (incarnation %d)", self.name, w, inc)
        return {
            "worker": w,
            "incarnation": inc,
            "joined_at": int(max(clocks)),
            "workers": self.workers,
            "expected": self.expected,
            "shards": self.shards,
            "config": self.config,
            "residual": self.residuals.pop(w, None),
        }

    def _free(self, want: int | None) -> int:
        if want is not None:
            if isinstance(want, bool) or not isinstance(want, int) or not 0 <= want < self.workers:
                raise ValueError(
                    f"unknown worker {want!r}: this job has workers 0..{self.workers - 1}"
                )
            if want in self.held:
                raise ValueError(f"worker {want} is held by an attached process")
            return want
        for w in range(self.workers):
            if w not in self.held:
                return w
        raise ValueError(
            f"the job is full: its {self.workers} worker ids are taken (serve it with "
            "workers=(min, max) for room to join)"
        )

    def _watch(self) -> None:
        """The watcher thread: departs the worker whose lease ended, if it holds its id."""
        import ray

        while True:
            with self.lock:
                refs = list(self.leases)
                self.changed.clear()
            if not refs:
                self.changed.wait(WATCH_EVERY)
                continue
            done, _ = ray.wait(refs, num_returns=1, timeout=WATCH_EVERY)
            for ref in done:
                with self.lock:
                    w, inc = self.leases.pop(ref)
                    if self.held.get(w) == inc:
                        log.warning(
                            "job %r: worker %d's process died; its id is free", self.name, w
                        )
                        self._depart(w, inc)

    def detach(self, w: int, inc: int, residual: Any = None) -> None:
        """``w``'s incarnation ``inc`` leaves (``residual``: for its id's next incarnation)."""
        with self.lock:
            if self.held.get(w) == inc:
                self._depart(w, inc)
                if residual is not None:
                    self.residuals[w] = residual
                log.info("job %r: worker %d left", self.name, w)

    def _depart(self, w: int, inc: int) -> None:
        import ray

        ray.get(cluster.depart(self.shards, w, inc, DEPART_TIMEOUT), timeout=DEPART_TIMEOUT)
        self.held.pop(w, None)

    def attached(self) -> list[int]:
        with self.lock:
            return sorted(self.held)

    def rendezvous(self, n: int, timeout: float) -> bool:
        """Waits for ``n`` callers (False: timed out or aborted)."""
        with self.lock:
            self.arrived += 1
            if self.arrived >= n:
                self.arrival.set()
        return self.arrival.wait(timeout) and not self.aborted

    def abort(self) -> None:
        self.aborted = True
        self.arrival.set()


class RayServer:
    """A job's shards on Ray for loops you own; a context manager. ``name``: the job's (or new)."""

    runtime = "ray"

    def __init__(
        self,
        config: ServerConfig,
        workers: int | tuple[int, int],
        *,
        join_timeout: float = 300.0,
        name: str | None = None,
        start_timeout: float = 120.0,
    ):
        if config.pull_codec is not None:
            raise ValueError(
                "pull_codec: a job served on Ray sends full pulls; delta pulls are for "
                "Job.train (runtime='ray' or 'sim')"
            )
        if config.replicas != 1:
            raise ValueError("replicas=2: a job served on Ray has one copy of each shard; "
                             "replicated shards are for Job.train")  # fmt: skip
        self.expected, self.workers = worker_range(workers)
        self.name = check_name(name) if name is not None else f"job-{uuid.uuid4().hex[:8]}"
        self.config, self.timeout = config, start_timeout
        self.ray = ray = import_ray()
        self._started = connect()  # before any call of Ray's, which would join its default
        try:
            ray.get_actor(door_name(self.name), namespace=NAMESPACE)
        except ValueError:
            pass
        else:
            raise ValueError(f"a job named {self.name!r} is already served on this Ray cluster")
        self.shards: list = []
        self.door: Any = None
        try:
            self._start(join_timeout)
        except BaseException:
            self.close()
            raise

    def _start(self, join_timeout: float) -> None:
        ray, config, name = self.ray, self.config, door_name(self.name)
        small = dataclasses.replace(config, init=config.init[:0])  # init goes with load()
        named = {"namespace": NAMESPACE, "num_cpus": 0, "max_restarts": 0}
        shard = ray.remote(ShardActor)
        self.shards = [
            shard.options(name=f"{name}:shard-{k}", scheduling_strategy="SPREAD", **named).remote(
                small, k, self.workers, PUBLISH_EVERY, self.expected
            )
            for k in range(config.shards)
        ]
        ray.get([s.ready.remote() for s in self.shards], timeout=self.timeout)
        inits = [config.init[lo:hi] for lo, hi in config.ranges]
        loads = [s.load.remote(None, 0, {}, [], init=inits[k]) for k, s in enumerate(self.shards)]
        ray.get(loads, timeout=self.timeout)
        door = ray.remote(Door).options(name=name, max_concurrency=DOOR_THREADS, **named)
        args = (self.name, small, self.shards, self.workers, self.expected, join_timeout)
        self.door = door.remote(*args)
        ray.get(self.door.ready.remote(), timeout=self.timeout)

    def __enter__(self) -> RayServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def client(self, worker: int | None = None) -> RayClient:
        """:func:`sw.attach(name) <stalewise.attach>` in this process."""
        return attach(self.name, worker=worker, timeout=self.timeout)

    def release(self, worker: int) -> None:
        """Nothing to do on Ray (the door watches every client's process)."""

    def attached(self) -> set[int]:
        """The worker ids held by attached clients now."""
        return set(self.ray.get(self.door.attached.remote(), timeout=self.timeout))

    @property
    def job_pushes(self) -> int:
        """Pushes committed by all the job's workers so far (shard 0's count)."""
        return int(self.ray.get(self.shards[0].count.remote(), timeout=self.timeout)[0])

    def pull(self, *, copy: bool = True, into: Any = None, timeout: float | None = 60.0) -> Any:
        """The current parameters, as an observer (never gated)."""
        ray = self.ray
        replies = ray.get([s.observe.remote() for s in self.shards], timeout=timeout)
        slices = ray.get([r[1] for r in replies], timeout=timeout)
        flat = np.concatenate(slices) if len(slices) > 1 else np.array(slices[0])
        if into is not None:
            tree.unflatten_into(into, flat, self.config.spec)
            return into
        return tree.unflatten(flat, self.config.spec, copy=copy)

    def stats(self, timeout: float | None = 60.0) -> list[dict]:
        return self.ray.get([s.stats.remote() for s in self.shards], timeout=timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Stops the shards, then ends every actor of the job."""
        ray = self.ray
        if self.shards:
            try:
                ray.get([s.stop.remote() for s in self.shards], timeout=timeout)
            except (ray.exceptions.RayError, TimeoutError) as e:
                log.debug("ray server %r: the shards did not stop (%s)", self.name, e)
        for a in (self.door, *self.shards):
            if a is not None:
                ray.kill(a, no_restart=True)
        self.door, self.shards = None, []
        if self._started:
            ray.shutdown()
            self._started = False
