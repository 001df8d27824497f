"""A worker's sending side on Ray (worker actor, attached client): a ``Sender`` with Ray's acks."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from stalewise import tree
from stalewise.protocol import PushResult, ServerConfig
from stalewise.protocol.sender import Sender
from stalewise.runtime.ray import import_ray
from stalewise.runtime.ray.shard import payload_spans

log = logging.getLogger(__name__)

RESEND_EVERY = 0.05  # seconds between two tries of a push at a restarting shard (replicas=2)


class Outbox:
    """Worker ``w``'s pushes to the shard actors ``shards``, from ``residual`` (None: zeros),
    with ``buffers`` push buffers and the residual keeper actor ``keeper`` (None: none)."""

    def __init__(
        self,
        config: ServerConfig,
        shards: list,
        w: int,
        *,
        residual: np.ndarray | None = None,
        keeper: Any = None,
        buffers: int = 2,
        ack_timeout: float | None = 60.0,
    ):
        self.config, self.shards, self.w = config, list(shards), w
        self.spec = config.spec
        self.compressor = config.compressor()
        self.sender = Sender(
            self.spec.segments,
            config.staleness,
            len(self.shards),
            self.compressor,
            residual=residual,
            dtype=config.init.dtype,
        )
        self.keeper, self.ack_timeout = keeper, ack_timeout
        self.spans = payload_spans(config)
        if self.spans is None:
            self.free = [np.empty(self.spec.size, self.spec.dtype) for _ in range(buffers)]
        else:  # the update is flattened here, then encoded into a free payload buffer
            self.free = [np.empty(self.spans[-1][1], np.uint8) for _ in range(buffers)]
            self.flat_buf = np.empty(self.spec.size, self.spec.dtype)

    def prepare(self, update: Any, buf: np.ndarray) -> tuple:
        """Flattens (encodes) ``update`` into ``buf``, judges and commits it, for :meth:`send`."""
        sender = self.sender
        if self.compressor is None:
            sent = flat = tree.flatten(update, spec=self.spec, out=buf)[0]
        else:  # every shard's payload into buf, the new residual into the sender's other buffer
            flat = tree.flatten(update, spec=self.spec, out=self.flat_buf)[0]
            sender.encode(flat, [buf[lo:hi] for lo, hi in self.spans])
            sent = buf
        seq, bases, verdict = sender.judge(flat)
        sender.committed()  # here: send() keeps its residual before any shard gets it
        return sent, seq, bases, tuple(verdict), sender.residual

    def send(
        self,
        sent: np.ndarray,
        inc: int,
        seq: int,
        bases: tuple,
        verdict: tuple,
        loss: float,
        acked: int,
        residual: np.ndarray | None,
    ) -> list:
        """Keeps the residual, sends the push to every shard; returns the acks' ObjectRefs."""
        ray = import_ray()
        if residual is not None and self.keeper is not None:  # kept before any shard has it
            try:
                kept = self.keeper.keep.remote(inc, seq + 1, residual, acked=acked)
                ray.get(kept, timeout=self.ack_timeout)
            except (ray.exceptions.RayError, TimeoutError) as e:
                log.warning(
                    "worker %d: its residual keeper failed (%s); going on without", self.w, e
                )
                self.keeper = None
        ref = ray.put(sent)  # the one copy; every shard reads its slice of it in place
        self.last = (inc, seq, bases, verdict, loss, acked, ref)  # to resend (replicas=2)
        return [s.push.remote(self.w, *self.last) for s in self.shards]

    def collect(
        self, refs: list, seq: int, timeout: float | None
    ) -> tuple[PushResult | None, int | None]:
        """``(result, shard 0's pushes handled)`` of push ``seq`` (``(None, None)``: lost or cut
        off; TimeoutError after ``timeout``); replicas=2: resent to a restarted shard."""
        ray = import_ray()
        refs, replies, start = list(refs), [], time.monotonic()
        while len(replies) < len(refs):
            left = None if timeout is None else max(start + timeout - time.monotonic(), 0)
            try:
                replies.append(ray.get(refs[len(replies)], timeout=left))
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(f"worker {self.w}: no acks within {timeout} s") from None
            except ray.exceptions.RayTaskError:
                raise
            except ray.exceptions.RayError:  # a shard died with it
                if self.config.replicas == 1 or left == 0:
                    log.warning("worker %d: push %d lost with a shard that failed", self.w, seq)
                    return None, None
                time.sleep(RESEND_EVERY)
                refs[len(replies)] = self.shards[len(replies)].push.remote(self.w, *self.last)
        if any(r is None for r in replies):  # this incarnation was cut off meanwhile
            return None, None
        return self.sender.result([ack for ack, _ in replies]), int(replies[0][1])
