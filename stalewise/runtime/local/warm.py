"""Imported by the local runtime's forkserver only (:func:`procs.shard_context`): it dies with its
starter and runs each kernel on tiny arrays, so the shards it forks start warm (design notes)."""

import contextlib
import os
import sys
import time

import numpy as np

from stalewise import codecs, optim
from stalewise.optim import _kernels
from stalewise.protocol import compress
from stalewise.runtime.local import procs, server  # noqa: F401
from stalewise.segments import Segments

procs.kill_me_with_parent()
_server, _hook = os.getpid(), sys.excepthook  # a child fails to start: it prints the error...


def _quiet(*error: object) -> None:  # ...unless its parent died meanwhile (procs._QUIET_ENTRY)
    time.sleep(0.2)  # the parent's death kills the forkserver, which makes init the child's parent
    if os.getppid() == _server:
        _hook(*error)  # type: ignore[arg-type]


sys.excepthook = _quiet
with contextlib.suppress(Exception):  # a kernel not loaded here loads in the shard, as before
    rules = (optim.sgd(0.1, momentum=0.9), optim.adam(0.1), optim.lamb(0.1), optim.lars(0.1))
    for dtype in (np.float32, np.float64):
        p = np.ones(64, dtype)
        for opt in rules:
            opt.apply(p.copy(), opt.init(p, Segments.from_sizes(["w"], [64])), p, scale=1.0)
        _kernels.sumsq(p)
    makers = (codecs.fp16, codecs.bf16, codecs.int8, codecs.int4, codecs.sign)
    compress.warm_up([compress.Piece("w", 0, 1, c()) for c in (*makers, lambda: codecs.topk(0.1))])
