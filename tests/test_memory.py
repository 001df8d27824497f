"""What a process allocates: a shard's warm-up loads every kernel its pushes run on a few
elements (no parameter-sized memory), a Job holds one flat copy of the params."""

import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np

import stalewise as sw
from stalewise import optim
from stalewise.protocol import Shard
from stalewise.runtime.local.server import LocalServer
from stalewise.segments import Segments


def traced_peak(call) -> int:
    """The most memory ``call()`` held at once that tracemalloc sees (NumPy's arrays)."""
    tracemalloc.start()
    try:
        call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_job_holds_one_flat_copy_of_its_params():
    params = {"w": np.ones(1 << 20, np.float32), "b": np.zeros(8, np.float32)}
    jobs = []
    peak = traced_peak(lambda: jobs.append(sw.Job(params, optimizer=optim.sgd(0.1))))
    init = jobs[0].config.init
    assert init.nbytes <= peak < 1.5 * init.nbytes, peak  # tree.flatten's vector, not a copy
    assert not np.shares_memory(init, params["w"])  # the user's tree is not the job's
    params["w"][:] = 2.0
    assert init.max() == 1.0 and init.sum() == 1 << 20


def test_a_closing_server_frees_the_observers_arrays_before_copying_the_params_out():
    job = sw.Job({"w": np.ones(1 << 20, np.float32)}, optimizer=optim.sgd(0.1))
    server = LocalServer(job.config, 1)
    try:

        def pull_then_close():
            assert server.pull()["w"][0] == 1.0  # into new memory the observer keeps for reuse
            server.close()

        peak = traced_peak(pull_then_close)
    finally:
        server.close()
    nbytes = job.config.init.nbytes
    assert nbytes <= peak < 1.5 * nbytes, peak  # final_params only
    assert server.final_params.tolist()[:2] == [1.0, 1.0]


def test_warm_up_allocates_no_parameter_sized_memory():
    n = 1 << 20
    seg = Segments.from_sizes(["a.w", "a.b", "c.w"], [1000, 24, n - 1024])
    shard = Shard(np.ones(n, np.float32), seg, optim.adamw(1e-3), workers=1)
    shard.warm_up()  # the kernels load (numba's own allocations are not measured)
    peak = traced_peak(shard.warm_up)
    assert peak < shard.params.nbytes / 50, peak  # a full-size scratch and Adam state: 4x


# run in a new process: there each kernel signature a push loads is one warm_up has not
PUSHES_COMPILE_NOTHING_NEW = """
import numba, numpy as np
from stalewise import optim
from stalewise.optim.buffers import with_buffers
from stalewise.optim import _kernels
from stalewise.protocol import PushHeader, Shard
from stalewise.segments import Segments

n = 3 * _kernels.CHECK_BLOCK + 77
seg = Segments.from_sizes(["a.w", "a.b", "c.w", "bn.mean"], [1000, 5, n - 1010, 5])
rules = {
    "sgd": optim.sgd(0.1),
    "nesterov": optim.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.1,
                          exclude_from_weight_decay=[r"\\.b$"]),
    "adam": optim.adam(1e-3, weight_decay=0.01),
    "adamw": optim.adamw(1e-3, exclude_from_weight_decay=[r"\\.b$"]),
    "lamb": optim.chain(optim.clip_by_global_norm(1.0), optim.lamb(1e-3)),
    "lars": optim.lars(0.1, exclude_from_adaptation=[r"\\.b$"]),
    "delayed_nesterov": optim.delayed_nesterov(0.7, 0.9, every=2),
    "buffers": with_buffers(optim.sgd(0.1, momentum=0.9), ["bn.mean"]),
}
kernels = [k for k in vars(_kernels).values() if isinstance(k, numba.core.dispatcher.Dispatcher)]
def signatures():
    return {k.py_func.__name__: len(k.signatures) for k in kernels}
rng = np.random.default_rng(0)
for dtype in (np.float32, np.float64):
    for name, opt in rules.items():
        for bounded in (True, False):  # False: the unbounded step (undo copy, checked step)
            shard = Shard(rng.normal(size=n).astype(dtype), seg, opt, workers=1)
            if not bounded:
                shard._bounds = None
            shard.warm_up()
            before = signatures()
            shard.join(0, 1)
            for seq in range(2):
                g = rng.normal(size=n).astype(dtype)
                assert shard.push(PushHeader(0, seq, shard.version, 1), g).ok
            new = {k: v - before[k] for k, v in signatures().items() if v != before[k]}
            assert not new, (name, np.dtype(dtype).name, bounded, new)
print("ok")
"""


def test_after_warm_up_a_shards_pushes_compile_no_kernel():
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PUSHES_COMPILE_NOTHING_NEW)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
