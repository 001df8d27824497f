"""Heartbeats on Ray: whether each worker actor makes progress (``liveness.Silence``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from stalewise.protocol.liveness import Silence, late_start
from stalewise.runtime.ray import import_ray

GROUP = "beat"  # the worker actors' concurrency group for progress()


@dataclass
class _Watch:
    actor: Any
    since: float  # when its run() was sent
    ready: bool  # set up (prepare() done)
    beats: int = -1  # the count last heard
    moved: float = 0.0  # when the count last moved (or the watch began)
    asked: float = -1.0  # when the question in flight (or the last one) was asked
    ref: Any = None  # the question in flight
    seen: float = -1.0  # when the last answer's question was asked
    silence: Silence | None = None  # its rhythm: when its count moved (None: no timeout)


class Liveness:
    def __init__(self, worker_timeout: float | None, start_timeout: float):
        self.timeout, self.start_timeout = worker_timeout, start_timeout
        self.every = 1.0 if worker_timeout is None else min(1.0, worker_timeout / 4)
        self.watched: dict[int, _Watch] = {}
        self.drawn: dict[int, int] = {}  # the batches each worker id had drawn, as last heard

    def watch(self, w: int, actor: Any, *, ready: bool, now: float | None = None) -> None:
        """Watches ``w``'s actor, just sent ``run()`` (``ready``: it is set up)."""
        now = time.monotonic() if now is None else now
        silence = None if self.timeout is None else Silence(self.timeout)
        if silence is not None:
            silence.start(now)
        self.watched[w] = _Watch(actor, now, ready, moved=now, silence=silence)

    def heard(self, w: int, drawn: int) -> None:
        """Worker ``w``'s id has drawn ``drawn`` batches (counts only grow)."""
        self.drawn[w] = max(drawn, self.drawn.get(w, 0))

    def forget(self, w: int) -> None:
        """Worker ``w`` is no longer watched (its loop ended, or it failed)."""
        self.watched.pop(w, None)

    def check(self, now: float | None = None) -> list[tuple[int, str]]:
        """Reads the answers, asks again where due; returns each ``(worker, cause)`` to fail."""
        ray = import_ray()
        now = time.monotonic() if now is None else now
        pending = [x.ref for x in self.watched.values() if x.ref is not None]
        done = set(ray.wait(pending, num_returns=len(pending), timeout=0)[0]) if pending else ()
        out = []
        for w, x in self.watched.items():
            if x.ref is not None and x.ref in done:
                try:
                    ready, beats, drawn = ray.get(x.ref)
                except ray.exceptions.RayError:  # its actor died: its run() says so
                    ready, beats = x.ready, x.beats
                else:
                    if beats != x.beats or ready != x.ready:
                        x.moved = now
                        if x.silence is not None:
                            x.silence.beat(x.asked)  # it had moved by the time it was asked
                    x.ready, x.beats, x.seen = ready, beats, x.asked
                    self.heard(w, drawn)
                x.ref = None
            if x.ref is None and now - x.asked >= self.every:
                x.ref = x.actor.progress.options(concurrency_group=GROUP).remote()
                x.asked = now
            if not x.ready:
                if (late := late_start(x.since, now, self.start_timeout)) is not None:
                    out.append((w, late))
            elif x.silence is not None:
                cause = x.silence.hung(x.seen)
                if cause is None and x.ref is not None and now - x.asked > self.timeout:
                    cause = (  # it cannot even answer
                        f"no heartbeat for {now - x.moved:.1f} s (worker_timeout="
                        f"{self.timeout:g} s): hung or stopped"
                    )
                if cause is not None:
                    out.append((w, f"{cause}, so it was killed"))
        return out
