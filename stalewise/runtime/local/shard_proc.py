"""The body of a local shard process: one :class:`~stalewise.protocol.Shard` behind pipes.

The shard reads pushes from workers' push buffers in shared memory once their
record is committed (see :mod:`stalewise.runtime.local.layout`), publishes
snapshots for pulls, and answers control messages from the parent
(:class:`~stalewise.runtime.local.server.LocalServer`).
"""

from __future__ import annotations

import logging
import signal
import time
from multiprocessing import connection, reduction
from typing import Any

import numpy as np

from stalewise.protocol import PushHeader, ServerConfig, commit
from stalewise.runtime.local import layout as L
from stalewise.runtime.local.layout import Layout, Snapshots
from stalewise.runtime.local.procs import child_logging
from stalewise.runtime.local.shm import SharedBlock

log = logging.getLogger(__name__)


PUBLISH_EVERY = 0.02  # seconds: the longest a busy shard defers publishing a new version


def committed_push(
    layout: Layout, records: np.ndarray, pushes: list, w: int, k: int
) -> tuple[PushHeader, np.ndarray, commit.Verdict] | None:
    """Worker ``w``'s committed push as shard ``k`` reads it from its record, or None."""
    rec = records[w]
    seq_plus_one = int(rec[L.R_COMMIT])
    if not seq_plus_one or int(rec[L.R_SEQ]) != seq_plus_one - 1:
        return None  # nothing committed, or a record caught while being rewritten
    header = PushHeader(w, int(rec[L.R_SEQ]), int(rec[L.R_BASES + k]), int(rec[L.R_INC]))
    return header, pushes[w], commit.Verdict(int(rec[L.R_CODE]), int(rec[L.R_DETAIL]))


def shard_main(
    config: ServerConfig,
    k: int,
    block_name: str,
    layout: Layout,
    control,
    join_timeout: float,
) -> None:
    """Body of a shard process: serve pulls and pushes until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent coordinates shutdown
    child_logging(f"shard {k}")
    block = SharedBlock.attach(block_name)
    lo, hi = config.ranges[k]
    shard = config.build_shard(k, layout.params(block)[lo:hi], layout.workers)
    pulls = [layout.pull_buffer(block, w)[lo:hi] for w in range(layout.workers)]
    pushes = [layout.push_buffer(block, w)[lo:hi] for w in range(layout.workers)]
    records = layout.records(block)
    observer = layout.observer(block)[lo:hi]
    snapshots = Snapshots(layout, block, config.ranges)
    shard.warm_up()
    snapshots.publish(k, shard.params, shard.version, shard.min_clock())
    published, published_at = shard.version, time.monotonic()
    lease_ends = time.monotonic() + join_timeout

    def publish(busy: bool) -> None:
        """Copies the params out for pulls: when idle, or every PUBLISH_EVERY s under load.

        The clock never gets ahead of the published params (a worker the gate lets
        through must read the params of the round it waited for): alone only while
        the params are unchanged, else together with them, at once when it moved.
        """
        nonlocal published, published_at
        clock = shard.min_clock()
        if shard.version == published:
            snapshots.publish_clock(k, clock)
        elif (
            not busy
            or clock != snapshots.min_clock(k)
            or time.monotonic() - published_at > PUBLISH_EVERY
        ):
            snapshots.publish(k, shard.params, shard.version, clock)
            published, published_at = shard.version, time.monotonic()

    waiting: set[int] = set()  # workers whose pull waits on the gate
    conns: dict[Any, tuple[int, int]] = {}  # a worker incarnation's pipe -> (worker, incarnation)
    current: dict[int, Any] = {}  # worker -> the pipe of its current incarnation

    def depart(c: Any) -> None:
        """The pipe ``c`` is gone: deliver its committed push if this shard lacks it, leave."""
        w, inc = conns.pop(c)
        c.close()
        if current.get(w) is c:
            del current[w]
            waiting.discard(w)
        shard.depart(w, inc, committed_push(layout, records, pushes, w, k))

    def reply(c: Any, msg: tuple) -> None:
        try:
            c.send(msg)
        except OSError:  # the worker is gone: stop waiting for it
            if c in conns:
                depart(c)

    def push(c: Any, msg: tuple) -> None:
        w, inc = conns[c]
        got = committed_push(layout, records, pushes, w, k)
        if len(msg) != 2 or got is None or got[0].seq != msg[1] or got[0].incarnation != inc:
            log.warning(
                "shard %d: worker %d sent a push with no matching record: %r", k, w, msg[:2]
            )
            reply(c, ("error", f"push {msg[1:2]} has no committed record"))
            depart(c)
            return
        header, payload, verdict = got
        reply(c, ("ack", shard.push(header, payload, verdict=verdict)))

    def join(w: int, inc: int) -> None:
        fd = reduction.recv_handle(control)
        c = connection.Connection(fd)
        old = current.get(w)
        if old is not None:
            depart(old)  # the old incarnation's committed push first, then it leaves
        shard.join(w, inc)
        conns[c], current[w] = (w, inc), c
        control.send(("joined", w, inc))

    control.send(("ready", k))
    while True:
        timeout = None if lease_ends is None else max(0.0, lease_ends - time.monotonic())
        for c in connection.wait([control, *conns], timeout=timeout):
            if c is not control and c not in conns:
                continue  # departed while this batch was being handled
            try:
                msg = c.recv()
            except (EOFError, OSError):
                if c is control:
                    return
                depart(c)
                continue
            if c is control:
                kind = msg[0]
                if kind == "join":
                    join(msg[1], msg[2])
                elif kind == "pull":  # the observer: exact, never gated
                    c.send(("pulled", shard.pull(None, observer)))
                elif kind == "stats":
                    c.send(("stats", shard.stats.as_dict() | {"version": shard.version}))
                elif kind == "state":
                    c.send(("state", shard.state_dict()))
                elif kind == "load":  # a checkpoint, before any worker joins (resume)
                    if conns:
                        c.send(("loaded", None, "workers have joined; load before they do"))
                        continue
                    try:
                        shard.load_state_dict(msg[1])
                    except ValueError as e:
                        c.send(("loaded", None, str(e)))
                        continue
                    snapshots.publish(k, shard.params, shard.version, shard.min_clock())
                    published, published_at = shard.version, time.monotonic()
                    c.send(("loaded", shard.version, None))
                elif kind == "stop":
                    c.send(("stopped", shard.stats.as_dict() | {"version": shard.version}))
                    return
                continue
            kind = msg[0] if isinstance(msg, tuple) and msg else None
            w = conns[c][0]
            if kind == "push":
                push(c, msg)
            elif kind == "pull":
                waiting.add(w)
            elif kind == "leave":
                depart(c)
            else:
                log.warning("shard %d: worker %d sent an unknown message; disconnecting it", k, w)
                depart(c)
        if lease_ends is not None and time.monotonic() >= lease_ends:
            lease_ends = None
            gone = shard.expire_unstarted()
            if gone:
                log.error(
                    "shard %d: worker(s) %s did not start within %g s (join_timeout); "
                    "the gates no longer wait for them",
                    k,
                    ", ".join(map(str, gone)),
                    join_timeout,
                )
        # After the acks: a pusher's next pull waits for the version its ack named
        # (read-your-writes), and pushes queued behind this batch go first.
        publish(busy=any(c.poll() for c in conns))
        for w in sorted(waiting):
            if shard.live[w] and shard.may_start(w):
                waiting.discard(w)
                reply(current[w], ("pulled", shard.pull(w, pulls[w])))
