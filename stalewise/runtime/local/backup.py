"""The body of a shard's backup process (``replicas=2``): a private copy of the shard that
applies its primary's entries (:class:`~stalewise.protocol.replica.Backup`) as they come
over its link, and answers each :class:`~stalewise.protocol.replica.Forward` with what it
holds. The parent asks it for its ``state`` (a restart of its primary) and ``stop``\\ s it.
Why and the order of a turn: ``docs/design-notes.md`` ("Local runtime")."""

from __future__ import annotations

import logging
import signal

import numpy as np

from stalewise.protocol import ServerConfig, pushlog, replica
from stalewise.runtime.local import wire
from stalewise.runtime.local.layout import Layout
from stalewise.runtime.local.shard_proc import digest
from stalewise.runtime.logs import child_logging

log = logging.getLogger(__name__)


def backup_main(config: ServerConfig, k: int, layout: Layout, link, control) -> None:
    """Follows the primary on ``link`` until the parent says stop on ``control``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent coordinates shutdown
    child_logging(f"backup {k}")
    lo, hi = config.ranges[k]
    shard = config.build_shard(k, np.array(config.init[lo:hi]), layout.workers, layout.expected)
    backup, held = None, ("", 0)  # the push log and its bytes that the state is after
    bound = 8 * shard.params.nbytes * (layout.workers + 2) + (1 << 24)  # a turn's entries
    control.send_bytes(wire.ready(k))
    while True:
        for c in wire.readable([control, *([link] if link else [])], None):
            if c is control:
                try:
                    kind = wire.decode_control(control.recv_bytes())[0]
                except (EOFError, OSError):
                    return
                if kind == "state":
                    control.send_bytes(wire.state_reply(shard.state_dict() | {"held": held}))
                else:  # stop
                    control.send_bytes(wire.stopped({"digest": digest(shard)}))
                    return
                continue
            try:
                msg = wire.decode_link(link.recv_bytes(bound))
            except (EOFError, OSError):  # the primary died: the parent asks for the state
                link.close()
                link = None
                continue
            if msg[0] == "catch_up":
                backup, held = replica.Backup(shard, msg[1]), msg[2:]
                reply = replica.Held(backup.view, backup.entries)
            else:
                fwd, path, at = msg[1:]
                try:
                    reply = backup.receive(fwd)
                except pushlog.LogError as e:  # a bug: said loudly; the primary serves alone
                    log.error("backup of shard %d: %s; it stops", k, e)
                    return
                if reply is not None:
                    held = (path, at + sum(map(len, fwd.entries[: backup.entries - fwd.first])))
            try:
                if reply is not None:
                    link.send_bytes(wire.held(reply))
            except OSError:
                link.close()
                link = None
