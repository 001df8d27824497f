"""The Ray runtime's cluster-wide steps: CPU shares, placement, consistent cuts, departures."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from stalewise.protocol import delivery
from stalewise.runtime.ray import import_ray

log = logging.getLogger(__name__)

POLL = 0.05  # seconds between two looks while the shards reach a consistent cut


def cpu_share(cpus: list[float], actors: int) -> float:
    """CPUs per actor: 1 if every actor can have one, else the largest share of which the
    nodes (``cpus``: each node's CPUs) hold ``actors`` whole (to 1/1000)."""

    def fits(share: float) -> bool:
        return sum(math.floor(c / share + 1e-9) for c in cpus) >= actors

    if fits(1.0):
        return 1.0
    shares = {math.floor(c / m * 1000) / 1000 for c in cpus for m in range(1, actors + 1)}
    for share in sorted(shares, reverse=True):
        if share > 0 and fits(share):
            return share
    raise RuntimeError(f"the Ray cluster's CPUs ({cpus}) cannot be shared by {actors} actors")


def node_cpus() -> list[float]:
    """The CPUs of each live node of the cluster."""
    ray = import_ray()
    return [float(n["Resources"].get("CPU", 0.0)) for n in ray.nodes() if n["Alive"]]


def place(n: int, share: float, timeout: float, what: str, *, apart: bool = False) -> Any:
    """A placed placement group of ``n`` bundles of ``share`` CPU, spread (``apart``: by node)."""
    from ray.util.placement_group import placement_group

    ray = import_ray()
    strict = apart and n <= sum(c >= share for c in node_cpus())
    pg = placement_group([{"CPU": share}] * n, strategy="STRICT_SPREAD" if strict else "SPREAD")
    try:
        ray.get(pg.ready(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(
            f"Ray could not place {n} {what} of {share:g} CPU within {timeout} s "
            f"(shard_start_timeout); are other jobs holding the cluster's CPUs ({node_cpus()})?"
        ) from None
    return pg


def consistent_states(
    shards: list, runs: list, timeout: float, limit: float, logs: Any = None
) -> tuple[list, int, dict] | None:
    """A consistent cut (:class:`~stalewise.protocol.delivery.Cut`): ``(states, pushes handled on
    shard 0, targets)``; None if one of ``runs`` ends meanwhile, or after ``limit`` seconds.
    ``logs()``: each shard's ``(path, fsync)`` of the push log it begins at the cut."""
    ray = import_ray()
    try:
        targets = delivery.targets(ray.get([s.freeze.remote() for s in shards], timeout=timeout))
        paths = logs() if logs is not None else [None] * len(shards)
        refs = [s.snapshot.remote(targets, p) for s, p in zip(shards, paths, strict=True)]
        deadline = time.monotonic() + limit
        while len(ray.wait(refs, num_returns=len(refs), timeout=POLL)[0]) < len(refs):
            if (runs and ray.wait(runs, timeout=0)[0]) or time.monotonic() > deadline:
                log.info("ray: state copy skipped (a worker ended while the shards froze)")
                return None
        replies = ray.get(refs, timeout=timeout)
    finally:
        for s in shards:
            s.thaw.remote()
    return [state for state, _ in replies], replies[0][1], targets


def depart(shards: list, w: int, inc: int, timeout: float | None = 60.0, wait: Any = None) -> list:
    """The commit rule for ``w``'s gone incarnation ``inc``: each shard's count of its pushes
    (``wait(refs)``: returns once they are done, or raises; default: up to ``timeout``)."""
    ray = import_ray()
    cuts = [s.cut.remote(w, inc) for s in shards]
    if wait is not None:
        wait(cuts)
    wait = wait or (lambda r: ray.wait(r, num_returns=len(r), timeout=timeout, fetch_local=False))
    source, lacking = delivery.departure(ray.get(cuts, timeout=timeout))
    missing: list = [None] * len(shards)
    for k, (start, stop) in lacking.items():  # read before the source departs (and forgets)
        missing[k] = shards[source].committed.remote(w, inc, start, stop)
        log.warning(
            "worker %d's pushes %d..%d reached shard %d but not shard %d when it failed: "
            "delivering them",
            *(w, start, stop - 1, source, k),
        )
    # Ray does not order an async actor's calls: read them before the source departs
    reading = [m for m in missing if m is not None]
    if reading:
        wait(reading)
    return [s.depart.remote(w, inc, missing[k]) for k, s in enumerate(shards)]
