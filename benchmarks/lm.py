"""Language-model benchmark: gradient pushes against DiLoCo on a small GPT, one worker 3x slower.

The task is ``tasks.get("lm")`` (a byte-level GPT on the Python standard
library's source, see ``docs/lm.md``): 4 local worker processes, worker 3
three times slower (``stragglers={3: 3.0}``), and every step padded with
``DELAY`` seconds of emulated accelerator time (scaled by the slowdown too), so
that the 2 cores of a small machine are not what is measured. Methods:

* ``sync gradients``: synchronous data-parallel Adam (BSP, the mean of 4 pushes per round);
* ``ASP gradients``: the same pushes applied on arrival;
* ``DiLoCo H=20`` / ``DiLoCo H=50``: inner AdamW, outer SGD at each setting of ``OUTER``, BSP;
* ``async DiLoCo``: ``diloco(asynchronous=True, dynamic=True)`` under ASP: delayed
  Nesterov and a round of about ``period`` seconds for every worker (the straggler
  runs about a third of the fast workers' ``H``);
* ``DiLoCo H=20 + int8``: DiLoCo H=20 with ``sw.codecs.int8()`` on its pushes
  (``--codec topk`` for ``topk(0.01)``);
* ``streaming DiLoCo + int4`` (BSP) and ``async streaming DiLoCo + int4`` (ASP,
  delayed Nesterov per leaf): ``streaming_diloco(local_steps=20, fragments=FRAGMENTS,
  delay=TAU, alpha=ALPHA)`` with ``sw.codecs.int4()`` segment pushes (each push
  carries its fragment only).

Each method runs at every learning rate of a small grid (the server Adam's
for gradients, the inner AdamW's for DiLoCo), every DiLoCo row (torchft's too)
also at each outer learning rate and Nesterov momentum of ``OUTER`` (the paper's
0.7/0.9, 0.7/0.3, and 1/0, plain averaging of the workers' models: with this
few outer steps 0.9 overshoots, see ``docs/design-notes.md``), and is reported
at its best: the
lowest held-out loss at the equal-token budget ``B`` (the tokens that the
synchronous baseline's ``steps`` local steps consume). Every run stops at
``EXTRA`` x ``B`` tokens (``stop_at`` on the records' ``tokens``; its push
budget is only a cap), so that a method slightly behind per token can still
reach the target; the baseline stops at ``B``, past which nothing reads it. A
best point at the edge of its grid is flagged
(``lr_at_edge``). A record's tokens are those of the local steps its workers
have pushed (``batch_size * context`` bytes a step; a DiLoCo round's count once
it is sent, so work still inside a round, or in its emulated compute time, does
not count; a BSP round's first pushes count before the straggler's push lets the
round apply, by at most a round). Figures (all measured in this run):

* val loss at ``B`` tokens, and at equal wall time (the shortest run's duration);
* tokens/s (minibatches drawn over the run's wall time);
* time, and bytes pushed per worker, to the target: the synchronous
  baseline's val loss at ``B`` tokens (bytes per push are the shards'
  ``bytes_in`` over the pushes, so a codec's size counts);
* the streaming row again in the simulator (its best point, the same straggler
  and emulated time, on a calibration of this machine made right after the row:
  ``job.calibrate`` with the LM's steps): its bytes per second per worker
  against the run's, a bar of issue #32 (within 10%), and whether the bytes are
  the same.

Bars (issue #20), ratios against the synchronous baseline of the same run:

* async DiLoCo reaches the target in <= 0.6x the baseline's wall time;
* async DiLoCo's val loss at ``B`` tokens is within 2% of the baseline's;
* DiLoCo (the best of its rows) sends >= 50x fewer bytes per worker to the
  target than synchronous gradients.

torchft's DiLoCo is the peer named in the issue (``torchft DiLoCo H=20``, see
``benchmarks/_torchft_peer.py``): 4 replica groups of one CPU process each
(gloo, a lighthouse on loopback), the same GPT, data shards, inner AdamW grid,
outer Nesterov SGD, straggler and emulated step time; it is run only if
``torchft`` imports (``pip install 'stalewise[peers]'``), otherwise the
benchmark says it was skipped and why. It is not in the bars. ``torchft
streaming DiLoCo`` is torchft's Streaming DiLoCo with the streaming rows'
fragments (in the order they are pushed), H, tau, alpha and 4-bit flag (not
applied on CPU); the streaming row must be at least as good at equal tokens and
at equal wall time.

    .venv/bin/python benchmarks/lm.py [--quick | --medium] [--codec int8|topk] [--json PATH]
                                      [--methods NAME,...] [--resume] [--check]
    .venv/bin/python benchmarks/lm.py --markdown PATH   # the README's table from a --json file
    .venv/bin/python benchmarks/lm.py --medium --resume --simulate --json PATH  # the sim again

``--quick`` (a tiny model, a short budget, three or four learning rates per
method, three outer settings per DiLoCo row) took about 26 minutes on 2 quiet
cores before the streaming rows (each adds 9 runs); ``--medium`` (a 1.23 M
parameter GPT at batch 8, 600 local steps per worker: 30 outer rounds at H=20,
one learning rate per method and the outer 0.7/0.3) runs the rows issue #32's
bars compare (``MODES["medium"]["rows"]`` and the baseline) in about 25 minutes on
2 quiet cores (``docs/lm.md``: the time per row); the full mode
(the small model, 4x the quick tokens, the quick grids) is for a quiet machine.
``--methods`` runs only the named rows (the synchronous baseline always runs, or
is kept; a bar whose rows did not run is left out). The ``--json`` file is written after
every row; with ``--resume`` the rows it already holds (same mode, setting and
commit; each row records its own time, commit and load average) are kept and
only the missing ones run, so a mode can run in pieces. Wall-time figures on a
shared machine are noisy.

``--gpt124 [DIM,LAYERS,HEADS]`` runs only DiLoCo H=20 (BSP, inner ``--inner`` at the
first of ``--inner-lrs``, outer the first of ``--outer``, default 0.7/0.3) through
``Job.train`` on a GPT of nanoGPT's GPT-2-small shape (768, 12, 12; vocab ``--vocab``,
context 64, batch 4, no straggler, no emulated time) for ``--rounds`` outer rounds,
and records each process's peak memory (issue 44; ``docs/design-notes.md``, "Memory
per process"):

    nice -n 19 .venv/bin/python benchmarks/lm.py --gpt124 --rounds 2 --json PATH
"""

from __future__ import annotations

import argparse
import importlib.metadata
import itertools
import json
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import _report
import numpy as np
import torch

import stalewise as sw
from stalewise import report, tasks

WORKERS, SLOW, SLOWDOWN = 4, 3, 3.0
EXTRA = 1.3  # every run but the baseline may draw this many times the equal-token budget
BASELINE = "sync gradients"
STREAM, ASYNC_STREAM = "streaming DiLoCo + int4", "async streaming DiLoCo + int4"
PEER, PEER_STREAM = "torchft DiLoCo H=20", "torchft streaming DiLoCo"
PEERS = (PEER, PEER_STREAM)
# DiLoCo's outer (Nesterov SGD) learning rate and momentum: the paper's (and the library's
# default), a lower momentum, and plain averaging of the workers' models (lr 1, no momentum)
OUTER = ((0.7, 0.9), (0.7, 0.3), (1.0, 0.0))
# rows: those a mode runs without --methods (None: every row); the medium mode's are the
# ones issue #32's bars compare, beside the baseline that sets their target
MODES = {
    "quick": dict(size="tiny", context=32, batch_size=16, steps=150, delay=0.02,
                  grad_lrs=(3e-4, 1e-3, 3e-3, 1e-2), inner_lrs=(3e-3, 1e-2, 2e-2), eval_interval=0.5,
                  outer=OUTER, rows=None, timeout=1800),
    "medium": dict(size="medium", context=64, batch_size=8, steps=600, delay=0.03,
                   grad_lrs=(2e-3,), inner_lrs=(5e-3,), eval_interval=5.0, outer=OUTER[1:2],
                   rows=("DiLoCo H=20", STREAM, ASYNC_STREAM, PEER_STREAM), timeout=3600),
    "full": dict(size="small", context=64, batch_size=16, steps=600, delay=0.03,
                 grad_lrs=(3e-4, 1e-3, 3e-3, 1e-2), inner_lrs=(3e-3, 1e-2, 2e-2), eval_interval=1.0,
                 outer=OUTER, rows=None, timeout=1800),
}  # fmt: skip
ASYNC_H = 20  # async DiLoCo's cap on H; its period is about 1.25 H fast steps
# streaming DiLoCo: fragments (equal slices at leaf boundaries), the merge delay tau in inner
# steps and the merge's local weight alpha (the paper's overlap: tau > 0, alpha 0.5)
FRAGMENTS, TAU, ALPHA = 4, 2, 0.5


_PROCESS: dict = {}  # in a worker process: its worker id and the counts file


class CountedBatches:
    """``data(worker, workers)`` that counts, in a small memory-mapped file, the
    minibatches each worker draws (row 0), those of its sent pushes (row 1) and those
    of its last step, not yet sent (row 2; see :func:`counting`); the parent reads it."""

    def __init__(self, task, path: str) -> None:
        self.task, self.path = task, path

    def __call__(self, worker: int, workers: int):
        counts = np.memmap(self.path, dtype=np.int64, mode="r+", shape=(3, workers))
        _PROCESS.update(worker=worker, counts=counts)
        for batch in self.task.batches(worker, workers):
            counts[0, worker] += 1
            yield batch


def _begin() -> None:
    """A step begins: the worker's previous step has been pushed (the runtime answers
    the push, then the next pull, before it), so its local steps count now."""
    counts = _PROCESS.get("counts")
    if counts is not None:
        w = _PROCESS["worker"]
        counts[1, w] += counts[2, w]
        counts[2, w] = 0


def _pending(step, ahead: int = 0):
    counts = _PROCESS.get("counts")
    if counts is not None:
        counts[2, _PROCESS["worker"]] = step.local_steps + ahead
    return step


class CountingGradients(type(sw.strategies.gradients())):
    def step(self, state, params, loss_and_grad, batches):
        _begin()
        return _pending(super().step(state, params, loss_and_grad, batches))


class CountingLocalSGD(type(sw.strategies.diloco())):
    def step(self, state, params, loss_and_grad, batches):
        _begin()
        return _pending(super().step(state, params, loss_and_grad, batches))


class CountingStreaming(sw.strategies.StreamingDiLoCo):
    def ahead(self, state, loss_and_grad, batches):  # steps taken while a push is in flight
        n = super().ahead(state, loss_and_grad, batches)
        _PROCESS["ahead"] = _PROCESS.get("ahead", 0) + n  # they go out with the next push
        return n

    def step(self, state, params, loss_and_grad, batches):
        _begin()
        step = super().step(state, params, loss_and_grad, batches)
        return _pending(step, _PROCESS.pop("ahead", 0))


def counting(strategy):
    """The same strategy, counting the local steps of each step once it has been pushed
    (when the worker begins its next step): the tokens a record's model has seen, a
    round's tokens counting once it is sent, not while the emulated compute of its
    steps (slept before the push) still runs. The last push of each worker is counted
    at the end of the run."""
    counters = (CountingGradients, CountingLocalSGD, CountingStreaming)
    cls = {c.__base__: c for c in counters}[type(strategy)]
    new = cls.__new__(cls)
    new.__dict__.update(vars(strategy))
    return new


def methods(m: dict, codec: str) -> list[tuple[str, tuple, tuple, object, float]]:
    """(name, lr grid, outer grid, make(lr[, (outer_lr, outer_momentum)]) -> Job keywords,
    local steps per push for the budget). Gradient rows have no outer grid (``(None,)``)."""
    bsp, asp, dl, adamw = sw.BSP(), sw.ASP(), sw.strategies.diloco, sw.optim.adamw
    sdl, int4 = sw.strategies.streaming_diloco, sw.codecs.int4()
    stream = dict(local_steps=20, fragments=FRAGMENTS, delay=TAU, alpha=ALPHA)
    step = m["delay"] + m["compute"]
    period = 1.25 * ASYNC_H * step
    # A round is `period` seconds of the clock, so the steps per push depend on the
    # machine's load (on an idle machine about 16.7 on average; 3 on a loaded one, where a
    # budget counted in pushes at H = ASYNC_H / SLOWDOWN ran out at 61% of B): the pushes'
    # budget assumes one step per push, and the run stops at EXTRA x B tokens (run_one).
    h_async = 1
    grads = sw.strategies.gradients()
    push_codec = sw.codecs.int8() if codec == "int8" else sw.codecs.topk(0.01)
    none, outs = (None,), m["outer"]
    return [
        (BASELINE, m["grad_lrs"], none,
         lambda lr: dict(optimizer=sw.optim.adam(lr), consistency=bsp, strategy=grads), 1),
        ("ASP gradients", m["grad_lrs"], none,
         lambda lr: dict(optimizer=sw.optim.adam(lr), consistency=asp, strategy=grads), 1),
        ("DiLoCo H=20", m["inner_lrs"], outs,
         lambda lr, o: dict(strategy=dl(local_steps=20, inner=adamw(lr), outer_lr=o[0],
                                        outer_momentum=o[1]),
                            consistency=bsp), 20),
        ("DiLoCo H=50", m["inner_lrs"], outs,
         lambda lr, o: dict(strategy=dl(local_steps=50, inner=adamw(lr), outer_lr=o[0],
                                        outer_momentum=o[1]),
                            consistency=bsp), 50),
        ("async DiLoCo", m["inner_lrs"], outs,
         lambda lr, o: dict(strategy=dl(local_steps=ASYNC_H, inner=adamw(lr), asynchronous=True,
                                        every=WORKERS, dynamic=True, period=period,
                                        outer_lr=o[0], outer_momentum=o[1]),
                            consistency=asp), h_async),
        (f"DiLoCo H=20 + {codec}", m["inner_lrs"], outs,
         lambda lr, o: dict(strategy=dl(local_steps=20, inner=adamw(lr), outer_lr=o[0],
                                        outer_momentum=o[1]),
                            consistency=bsp, codec=push_codec), 20),
        (STREAM, m["inner_lrs"], outs,
         lambda lr, o: dict(strategy=sdl(**stream, inner=adamw(lr), outer_lr=o[0],
                                         outer_momentum=o[1]),
                            consistency=bsp, codec=int4), 20 / FRAGMENTS),
        (ASYNC_STREAM, m["inner_lrs"], outs,
         lambda lr, o: dict(strategy=sdl(**stream, inner=adamw(lr), asynchronous=True,
                                         every=WORKERS, outer_lr=o[0], outer_momentum=o[1]),
                            consistency=asp, codec=int4), 20 / FRAGMENTS),
    ]  # fmt: skip


def emulation(m: dict) -> sw.Emulation:
    """Worker SLOW SLOWDOWN times slower, every step padded with the mode's emulated time."""
    delays = dict.fromkeys(range(WORKERS), m["delay"])
    return sw.Emulation(stragglers={SLOW: SLOWDOWN}, delays=delays)


def run_one(task, m: dict, name: str, lr: float, make, h: float, outer=None,
            extra: float = EXTRA) -> dict:  # fmt: skip
    """One training run (``make(lr)``, or ``make(lr, outer)`` for DiLoCo's outer
    ``(lr, momentum)``), stopped at ``extra`` x B tokens; its records carry ``tokens``."""
    budget_steps = math.ceil(extra * WORKERS * m["steps"])  # local steps of all workers
    pushes = max(math.ceil(budget_steps / h), WORKERS)  # at most; the run stops at the tokens
    per_batch = task.tokens_per_batch
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "counts")
        np.zeros((3, WORKERS), np.int64).tofile(path)
        counts = np.memmap(path, dtype=np.int64, mode="r", shape=(3, WORKERS))
        records: list[dict] = []

        def on_record(rec: dict) -> None:
            drawn, pushed, _ = counts.sum(axis=1) * per_batch
            # into the record itself, which stop_at reads after this call
            rec.update(tokens=int(pushed), tokens_drawn=int(drawn))
            records.append(dict(rec))

        kw = make(lr) if outer is None else make(lr, outer)
        kw["strategy"] = counting(kw["strategy"])
        job = sw.Job(task.init_params(0), **kw)
        result = job.train(
            task.loss_and_grad,
            data=CountedBatches(task, path),
            evaluate=task.evaluate,
            workers=WORKERS,
            steps=pushes,
            stop_at={"tokens": (budget_steps * per_batch, "max")},
            metrics=sw.Metrics(every=m["eval_interval"], name=name, on_record=on_record),
            emulation=emulation(m),
            timeouts=sw.Timeouts(total=m.get("timeout", 1800)),
        )
        drawn, sent, last = (int(x) for x in counts.sum(axis=1) * per_batch)
        pushed = sent + last  # every worker's last push too
    if records and records[-1].get("pushes") == result.pushes:
        # the run's last record holds every push, each worker's last round too (no step
        # began after it to count it): without this, its loss would stand at fewer tokens
        records[-1]["tokens"] = pushed
    evals = [r for r in records if math.isfinite(r.get("loss", math.nan))]
    return {
        "method": name,
        "lr": lr,
        **outer_keys(outer),
        "pushes": result.pushes,
        "bytes_in": result.stats["bytes_in"],
        "bytes_per_push": result.stats["bytes_in"] / max(result.pushes, 1),
        "time": result.time,
        "tokens": pushed,
        "tokens_per_s": drawn / result.time,
        "final_loss": evals[-1]["loss"] if evals else math.nan,
        "records": [{k: r[k] for k in ("time", "tokens", "tokens_drawn", "pushes", "loss")
                     if k in r}
                    for r in evals],
    }  # fmt: skip


def outer_keys(outer) -> dict:
    """A run's DiLoCo outer ``(lr, momentum)`` as its row's keys (None for gradients)."""
    lr, mo = (None, None) if outer is None else outer
    return {"outer_lr": lr, "outer_momentum": mo}


def outer_text(row: dict) -> str:
    """A row's outer lr/momentum, as printed."""
    lr = row.get("outer_lr")
    return "-" if lr is None else f"{lr:g}/{row['outer_momentum']:g}"


def at(records: list[dict], x: str, value: float) -> float | None:
    """The loss at ``x == value``, linearly interpolated; None past the last record."""
    xs = [r[x] for r in records]
    if not xs or value > xs[-1]:
        return None
    return float(np.interp(value, xs, [r["loss"] for r in records]))


def first_reaching(records: list[dict], target: float, key: str) -> float | None:
    return report.time_to_target(records, "loss", target, x=key)


def fmt(x, spec=".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def stream_fragments(task) -> list[list[str]]:
    """The leaf names of each fragment of the streaming rows, in the order they are pushed."""
    s = sw.strategies.streaming_diloco(local_steps=20, fragments=FRAGMENTS, delay=TAU)
    state = s.init(task.init_params(0))
    seg = state.spec.segments
    order, t = [], 0
    for _ in range(FRAGMENTS):
        t, f = s.schedule(t)
        order.append(f)
    return [[n for n, o in zip(seg.names, seg.offsets, strict=True)
             if any(a <= o < b for a, b in state.runs[f])] for f in order]  # fmt: skip


def torchft_peer(task, m: dict, name: str = PEER):
    """How to run torchft's DiLoCo (H=20), or its Streaming DiLoCo with the streaming rows'
    fragments, tau, alpha and 4-bit flag (``name``), on the same model and data:
    ``(run(lr, outer) -> row, torchft's version)``, or ``(None, why)`` when torchft does not
    import."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's lighthouse logs every quorum tick
    try:
        import _torchft_peer
        import torchft  # noqa: F401
    except ImportError as e:
        return None, f"torchft is not installed ({e}); `pip install 'stalewise[peers]'` adds it"
    h, kw = 20, {}
    if name == PEER_STREAM:
        kw = dict(fragments=stream_fragments(task), tau=TAU, alpha=ALPHA, quantize=True)
    syncs = math.ceil(EXTRA * m["steps"] / (h / len(kw.get("fragments", [0]))))  # per worker
    slow = [SLOWDOWN if w == SLOW else 1.0 for w in range(WORKERS)]

    def run(lr: float, outer) -> dict:
        return _torchft_peer.run(task, lr, h, syncs, WORKERS, m["delay"], slow, outer=outer,
                                 timeout=m.get("timeout", 1800), **kw)  # fmt: skip

    return run, importlib.metadata.version("torchft")


def simulate(task, m: dict, make, run: dict) -> dict:
    """A run of the streaming row again in the simulator, to see whether it predicts the
    run's bytes per second (issue #32): the same job (``make`` at the run's learning rate
    and outer setting), workers, straggler and emulated time, the run's pushes as the
    budget, no evaluations, on this machine's calibration (``job.calibrate``: the LM's
    steps in 4 processes beside the parent's evaluations, the contention for the cores,
    the worker loop with the strategy's inner updates, the transport). The bytes are
    deterministic (the same segment pushes); the time is the simulator's model of the
    run."""
    kw = make(run["lr"], (run["outer_lr"], run["outer_momentum"]))
    job = sw.Job(task.init_params(0), **kw)
    load, t0 = os.getloadavg(), time.perf_counter()
    cal = job.calibrate(task.loss_and_grad, task.batches, workers=WORKERS, repeats=5,
                        delays=m["delay"], evaluate=task.evaluate,
                        eval_interval=m["eval_interval"])  # fmt: skip
    calibrate_s = time.perf_counter() - t0
    result = job.train(
        task.loss_and_grad,
        data=task.batches,
        workers=WORKERS,
        steps=run["pushes"],
        runtime=sw.Simulation(cal.sim_config()),
        metrics=sw.Metrics(every=m["eval_interval"], name=f"{run['method']} (sim)"),
        emulation=emulation(m),
        timeouts=sw.Timeouts(total=m.get("timeout", 1800)),
    )
    commit, dirty = _report._git()
    return {"pushes": result.pushes, "bytes_in": result.stats["bytes_in"], "time": result.time,
            "table": cal.table(), "calibrate_s": round(calibrate_s, 1),
            "warnings": cal.warnings(), "load_start": load, "load_end": os.getloadavg(),
            "commit": commit, "dirty": dirty,
            "wall_s": result.stats["sim"]["wall_time"]}  # fmt: skip


RUN_KEYS = ("lr", "pushes", "bytes_per_push", "time", "tokens", "tokens_per_s", "final_loss",
            "loss_at_B")  # fmt: skip


def load_text(run: dict) -> str | None:
    """A run's 1-minute load average at its start and end, "0.4-1.9" (None: not recorded)."""
    a, b = run.get("load_start"), run.get("load_end")
    return None if a is None or b is None else f"{a[0]:.1f}-{b[0]:.1f}"


def best_of(runs: list[dict]) -> dict:
    """A row's best point: reached B tokens first, then the lowest loss there (else the
    lowest final loss)."""

    def key(r: dict):
        loss = r["final_loss"] if r["loss_at_B"] is None else r["loss_at_B"]
        return r["loss_at_B"] is None, loss if loss is not None and loss == loss else math.inf

    return min(runs, key=key)


def plain(x):
    """``x`` as it reads back from a --json file."""
    return json.loads(json.dumps(_report._clean(x)))


def setting_of(task, m: dict, codec: str) -> dict:
    """What makes a run's rows comparable, and must match for --resume to keep them."""
    return {
        "task": repr(task), "params": task.num_params(), "corpus_sha256": task.corpus_sha256,
        "python": sys.version.split()[0], "workers": WORKERS, "stragglers": {SLOW: SLOWDOWN},
        "delay_s": m["delay"], "equal_tokens": WORKERS * m["steps"] * task.tokens_per_batch,
        "extra": EXTRA, "codec": codec, "grad_lrs": m["grad_lrs"], "inner_lrs": m["inner_lrs"],
        "outer": m["outer"],
    }  # fmt: skip


def earlier(
    path: Path, mode: str, setting: dict, commit: str | None, known, any_commit: bool = False
) -> dict:
    """The figures of an earlier piece of this run, whose rows ``--resume`` keeps: what
    ``path`` holds, if it is of the same mode, setting (all but the timed step) and commit,
    each row well formed (``any_commit``: of any commit); ``{}`` when there is no such
    file. Raises ValueError, one line naming what does not match, before anything runs or
    is written."""
    if not path.exists():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"cannot read it: {e}") from None
    fig = doc.get("figures") if isinstance(doc, dict) else None
    if not isinstance(fig, dict) or not isinstance(fig.get("runs"), dict):
        raise ValueError("it holds no rows to resume (no figures.runs)")
    if fig.get("mode") != mode:
        raise ValueError(f"it holds a --{fig.get('mode')} run, not --{mode}")
    if commit is None and not any_commit:
        raise ValueError("this checkout's commit is unknown (no git), so no row can match it")
    have = fig.get("setting") if isinstance(fig.get("setting"), dict) else {}
    if not isinstance(have.get("compute_s_per_step"), float):
        raise ValueError("its setting has no compute_s_per_step (the timed step)")
    for key, value in plain(setting).items():
        if key != "compute_s_per_step" and have.get(key) != value:
            raise ValueError(f"its setting {key} is {have.get(key)!r}, this run's is {value!r}")
    for name, runs in fig["runs"].items():
        if name not in known:
            raise ValueError(f"it holds an unknown row {name!r}")
        if not isinstance(runs, list) or not runs or not all(isinstance(r, dict) for r in runs):
            raise ValueError(f"its row {name!r} is not a list of runs")
        for r in runs:
            if r.get("commit") != commit and not any_commit:
                raise ValueError(f"its row {name!r} ran at commit {r.get('commit')}, this "
                                 f"checkout is at {commit}")  # fmt: skip
            missing = [k for k in RUN_KEYS if k not in r]
            if missing:
                raise ValueError(f"its row {name!r} has a run without {missing[0]!r}")
        if not isinstance(best_of(runs).get("records"), list):
            raise ValueError(f"its row {name!r} has no records for its best point")
    return fig


def summary(out: dict, order: list[str], budget: int) -> list[dict]:
    """Each row's best point (``out["runs"]``, this piece's and an earlier one's alike), the
    table and the bars, into ``out`` (``best``, ``target_loss``, ``equal_time_s``,
    ``bars``); returns the report's bars."""
    best: dict[str, dict] = {}
    for name in order:
        runs = out["runs"].get(name)
        if runs:
            grid = sorted({r["lr"] for r in runs})
            b = best[name] = dict(best_of(runs), grid=grid)
            b["edge"] = len(grid) > 1 and b["lr"] in (min(grid), max(grid))
    base = best[BASELINE]
    target = base["loss_at_B"]
    t_eq = min(r["time"] for r in best.values())
    base_time = first_reaching(base["records"], target, "time")
    base_pushes = first_reaching(base["records"], target, "pushes")
    base_bytes = None if base_pushes is None else base_pushes * base["bytes_per_push"] / WORKERS
    out["best"] = {}
    for name, r in best.items():
        t = first_reaching(r["records"], target, "time")
        p = first_reaching(r["records"], target, "pushes")
        b = None if p is None else p * r["bytes_per_push"] / WORKERS
        row = {
            "method": name,
            "best_lr": r["lr"],
            "lr_at_edge": r["edge"],
            "outer_lr": r.get("outer_lr"),
            "outer_momentum": r.get("outer_momentum"),
            "loss_at_B": r["loss_at_B"],
            f"loss_at_{t_eq:.0f}s": at(r["records"], "time", t_eq),
            "tokens_per_s": r["tokens_per_s"],
            "time_to_target_s": t,
            "time_vs_sync": None if t is None or not base_time else t / base_time,
            "MB_per_worker_to_target": None if b is None else b / 1e6,
            "bytes_fewer_than_sync": None if b is None or not base_bytes else base_bytes / b,
            "load": load_text(r),
        }
        out["best"][name] = dict(row, pushes=r["pushes"], time=r["time"], tokens=r["tokens"],
                                 bytes_per_push=r["bytes_per_push"], lr_grid=r["grid"],
                                 records=r["records"], sim=r.get("sim"),
                                 time_utc=r.get("time_utc"))  # fmt: skip
    out["target_loss"], out["equal_time_s"] = target, t_eq

    bars, report_bars = [], []

    def bar(name: str, value, op: str, limit: float, detail: str) -> None:
        ok = value is not None and (value <= limit if op == "<=" else value >= limit)
        bars.append({"bar": name, "pass": ok, "detail": detail})
        report_bars.append(_report.bar(name, value, op, limit))

    def pct(x, y):
        return None if x is None or y is None else 100 * (x / y - 1)

    def loss_bar(name: str, loss, ref, ref_name: str, limit: float) -> None:
        rel = pct(loss, ref)
        bar(f"{name} val loss at B vs {ref_name}, % above", rel, "<=", limit,
            f"{fmt(loss, '.4f')} vs {fmt(ref, '.4f')}: {fmt(rel, '+.2f')}% (<= +{limit:g}%)")  # fmt: skip

    best_rows = out["best"]
    if "async DiLoCo" in best_rows:
        a = best_rows["async DiLoCo"]
        r = a["time_vs_sync"]
        bar("async DiLoCo / sync gradients, wall time to the target", r, "<=", 0.6,
            f"{fmt(r, '.2f')} (<= 0.6)")  # fmt: skip
        loss_bar("async DiLoCo", a["loss_at_B"], target, "sync gradients", 2.0)
    dil = {k: v for k, v in best_rows.items() if "DiLoCo" in k and k not in PEERS}
    if dil:
        k = max(dil, key=lambda k: dil[k]["bytes_fewer_than_sync"] or 0.0)
        f = dil[k]["bytes_fewer_than_sync"]
        each = ", ".join(f"{n}: {fmt(v['bytes_fewer_than_sync'], '.1f')}x" for n, v in dil.items())
        bar("DiLoCo bytes per worker to the target, x fewer than sync gradients", f, ">=", 50,
            f"{fmt(f, '.1f')}x, best {k} (>= 50; {each})")  # fmt: skip
    d = best_rows.get("DiLoCo H=20")
    if d is not None and STREAM in best_rows:
        st = best_rows[STREAM]
        loss_bar(STREAM, st["loss_at_B"], d["loss_at_B"], "DiLoCo H=20", 1.0)
        # peak bandwidth: a push must cross the wire within its overlap window (a few inner
        # steps in both), so the peak rate goes with the largest push
        x = d["bytes_per_push"] / st["bytes_per_push"] if st["bytes_per_push"] else None
        bar(f"{STREAM} peak bytes per push (per worker), x fewer than DiLoCo H=20", x, ">=",
            5.0, f"{fmt(x, '.1f')}x: {st['bytes_per_push']:.0f} vs {d['bytes_per_push']:.0f} B "
            "(>= 5)")  # fmt: skip
        f = st["bytes_fewer_than_sync"]
        bar(f"{STREAM} bytes per worker to the target, x fewer than sync gradients", f, ">=",
            200, f"{fmt(f, '.1f')}x (>= 200)")  # fmt: skip
    sim = (best_rows.get(STREAM) or {}).get("sim")
    sent = best.get(STREAM, {}).get("bytes_in")
    if sim and "error" not in sim and sent:
        st = best_rows[STREAM]
        ours, predicted = sent / WORKERS / st["time"], sim["bytes_in"] / WORKERS / sim["time"]
        off = 100 * abs(predicted / ours - 1)
        if sim["pushes"] == st["pushes"]:
            same = "equal" if sim["bytes_in"] == sent else "differ"
            sizes = f"bytes {same}: {sim['bytes_in']} vs {sent}"
        else:  # a BSP budget is whole rounds, and a run stopped by its tokens may end in one
            sizes = (
                f"bytes per push {sim['bytes_in'] / sim['pushes']:.1f} vs {sent / st['pushes']:.1f}"
            )
        bar(f"simulator's bytes/s per worker for {STREAM}, % off the run's", off, "<=", 10.0,
            f"{predicted:.0f} vs {ours:.0f} B/s: {off:.1f}% (<= 10%; {sim['time']:.1f} virtual s "
            f"vs {st['time']:.1f} s, {sim['pushes']} vs {st['pushes']} pushes); {sizes}")  # fmt: skip
    if d is not None and ASYNC_STREAM in best_rows:
        st = best_rows[ASYNC_STREAM]
        loss_bar(ASYNC_STREAM, st["loss_at_B"], d["loss_at_B"], "DiLoCo H=20", 3.0)
        t, td = st["time_to_target_s"], d["time_to_target_s"]
        x = None if t is None or not td else t / td
        bar(f"{ASYNC_STREAM} / DiLoCo H=20, wall time to the target", x, "<=", 0.6,
            f"{fmt(t, '.1f')} s vs {fmt(td, '.1f')} s: {fmt(x, '.2f')} (<= 0.6)")  # fmt: skip
    if STREAM in best_rows and PEER_STREAM in best_rows:
        st, ft = best_rows[STREAM], best_rows[PEER_STREAM]
        loss_bar(STREAM, st["loss_at_B"], ft["loss_at_B"], PEER_STREAM, 0.0)
        key = f"loss_at_{t_eq:.0f}s"
        rel = pct(st[key], ft[key])
        bar(
            f"{STREAM} val loss at {t_eq:.0f} s vs {PEER_STREAM}, % above",
            rel,
            "<=",
            0.0,
            f"{fmt(st[key], '.4f')} vs {fmt(ft[key], '.4f')}: {fmt(rel, '+.2f')}% (<= +0%)",
        )
    out["bars"] = bars
    return report_bars


def markdown(out: dict) -> str:
    """The README's "Language model" table and bars, from the JSON of a run."""
    cols = [("method", "method", "s"), ("best lr", "best_lr", "g"), ("lr grid", "lr_at_edge", ""),
            ("outer lr", "outer_lr", "g"), ("outer momentum", "outer_momentum", "g"),
            ("val loss at B", "loss_at_B", ".3f"),
            (f"val loss at {out['equal_time_s']:.0f} s", f"loss_at_{out['equal_time_s']:.0f}s", ".3f"),
            ("tokens/s", "tokens_per_s", ".0f"), ("s to target", "time_to_target_s", ".1f"),
            ("x sync time", "time_vs_sync", ".2f"),
            ("MB/worker to target", "MB_per_worker_to_target", ".3f"),
            ("x fewer bytes", "bytes_fewer_than_sync", ".1f"), ("load", "load", "s")]  # fmt: skip
    lines = ["| " + " | ".join(c[0] for c in cols) + " |", "|" + " --- |" * len(cols)]
    for row in out["best"].values():
        cells = [{True: "edge", False: ""}.get(row.get(k), fmt(row.get(k), f)) if k == "lr_at_edge"
                 else fmt(row.get(k), f) for _, k, f in cols]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += [
        f"- {'PASS' if b['pass'] else 'FAIL'}: {b['bar']}: {b['detail']}" for b in out["bars"]
    ]
    return "\n".join(lines)


DETAIL = ("pushes", "time", "tokens", "bytes_per_push", "lr_grid", "records", "sim", "time_utc")


# --gpt124: nanoGPT's GPT-2-small shape (n_layer 12, n_head 12, n_embd 768, vocab 50304)
GPT124 = dict(context=64, batch_size=4, eval_windows=16)


def _descendants(root: int) -> dict[int, tuple[int, str]]:
    """``root``'s live descendant processes: pid -> (start time in ticks, command line)."""
    from scale import children

    out, todo = {}, [root]
    while todo:
        for pid in children(todo.pop()):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    start = int(f.read().rsplit(")", 1)[1].split()[19])
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            out[pid] = (start, cmd)
            todo.append(pid)
    return out


def _memory(pid: int | str) -> dict[str, int]:
    """A process's peak resident bytes (``VmHWM``), and its private (``RssAnon``) and
    shared-memory (``RssShmem``: the job's block) resident bytes now ({} if it is gone)."""
    keys = {"VmHWM:": "peak", "RssAnon:": "private", "RssShmem:": "shared"}
    try:
        with open(f"/proc/{pid}/status") as f:
            return {keys[w[0]]: int(w[1]) * 1024 for w in map(str.split, f) if w[0] in keys}
    except OSError:
        return {}


def gpt124(shape: tuple, vocab: int, rounds: int, inner: str, lr: float, outer) -> dict:
    """DiLoCo H=20 (BSP, 4 workers, one shard) of a GPT through ``Job.train``: each
    process's peak resident memory (``VmHWM``) and the peaks of its private and shared
    bytes (read every second while it lives), the wall time, the outer rounds done and
    the held-out loss after each."""
    dim, layers, heads = shape
    task = tasks.get("lm", dim=dim, layers=layers, heads=heads, vocab=vocab, **GPT124)
    nbytes = 4 * task.num_params()
    seen: dict[int, tuple[int, str]] = {}
    peaks: dict[int | str, dict[str, int]] = {}
    done = threading.Event()

    def watch() -> None:
        while True:
            for pid, info in [*_descendants(os.getpid()).items(), ("self", None)]:
                seen.setdefault(pid, info)
                old = peaks.setdefault(pid, {})
                old |= {k: max(v, old.get(k, 0)) for k, v in _memory(pid).items()}
            if done.wait(1.0):
                return

    threading.Thread(target=watch, daemon=True).start()
    records: list[dict] = []
    opt = {"adamw": sw.optim.adamw, "sgd": sw.optim.sgd}[inner](lr)
    strategy = sw.strategies.diloco(20, inner=opt, outer_lr=outer[0], outer_momentum=outer[1])
    load, t0 = [os.getloadavg()], time.monotonic()
    job = sw.Job(task.init_params(0), strategy=strategy, consistency=sw.BSP())
    result = job.train(
        task.loss_and_grad,
        data=task.batches,
        evaluate=task.evaluate,
        workers=WORKERS,
        steps=WORKERS * rounds,
        metrics=sw.Metrics(every=60.0, name="gpt124", on_record=records.append),
        timeouts=sw.Timeouts(total=7200, start=1800, shard_start=1200),  # a loaded machine
    )
    wall = time.monotonic() - t0
    done.set()
    load.append(os.getloadavg())
    # spawned in order: the shard, then the workers (a resource tracker, if any, is named)
    kids = [p for p in seen if p != "self" and "resource_tracker" not in seen[p][1]]
    roles = ["shard 0"] + [f"worker {w}" for w in range(WORKERS)]
    procs = {"launcher": peaks["self"]} | {
        (roles[i] if i < len(roles) else f"pid {p}"): peaks[p]
        for i, p in enumerate(sorted(kids, key=seen.get))
    }
    by_round: dict[int, dict] = {}
    for r in records:  # the first record at each server version: the model after that round
        if math.isfinite(r.get("loss", math.nan)):
            by_round.setdefault(r["updates"], r)
    return {
        "task": repr(task),
        "params": nbytes // 4,
        "param_bytes": nbytes,
        "inner": f"{inner}({lr:g})",
        "outer_lr": outer[0],
        "outer_momentum": outer[1],
        "rounds": result.stats["version"],
        "pushes": result.pushes,
        "wall_s": wall,
        "train_s": result.time,
        "load": load,
        "gib": {k: {m: v / 2**30 for m, v in p.items()} for k, p in procs.items()},
        "x_params": {k: {m: v / nbytes for m, v in p.items()} for k, p in procs.items()},
        "loss_by_round": [
            {"round": k, "val_loss": r["loss"], "train_loss": r["train_loss"], "time": r["time"]}
            for k, r in sorted(by_round.items())
        ],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="tiny model, short budget")
    size.add_argument("--medium", action="store_true", help="a 1.23 M parameter GPT, 30 rounds")
    size.add_argument("--gpt124", nargs="?", const="768,12,12", metavar="DIM,LAYERS,HEADS",
                      help="only DiLoCo H=20 of a 124M GPT (or this shape), each process's "
                           "peak memory")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=3, help="--gpt124: outer rounds")
    ap.add_argument("--inner", choices=("adamw", "sgd"), default="adamw", help="--gpt124's")
    ap.add_argument("--vocab", type=int, default=50304, help="--gpt124's (256: one per byte)")
    ap.add_argument("--methods", help="comma-separated rows to run (and the baseline)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows the --json file holds (same mode, setting and commit) "
                         "and run only the missing ones")  # fmt: skip
    ap.add_argument("--grad-lrs", help="comma-separated: the gradient rows' learning rates")
    ap.add_argument("--inner-lrs", help="comma-separated: the DiLoCo rows' inner learning rates")
    ap.add_argument("--outer", help="comma-separated outer lr/momentum pairs, e.g. 1/0,0.7/0.3")
    ap.add_argument("--codec", choices=("int8", "topk"), default="int8")
    ap.add_argument("--steps", type=int, help="local steps per worker of the budget B")
    ap.add_argument("--simulate", action="store_true",
                    help="with --resume: run no row, simulate the streaming row the --json "
                         "file holds (of any commit) again on a fresh calibration")  # fmt: skip
    _report.add_json_arg(ap)
    ap.add_argument("--check", action="store_true", help="exit 1 if a bar is missed")
    ap.add_argument(
        "--markdown",
        metavar="JSON",
        help="print the README's table and bars from a --json file, run nothing",
    )
    args = ap.parse_args()  # fmt: skip
    if args.markdown:
        doc = json.loads(Path(args.markdown).read_text())
        print(markdown(doc.get("figures", doc)))
        return 0
    json_out = _report.json_path(ap, args, "lm")
    if args.gpt124:
        shape = tuple(int(x) for x in args.gpt124.split(","))
        lr = float(args.inner_lrs.split(",")[0]) if args.inner_lrs else 1e-3
        outer = tuple(float(y) for y in (args.outer or "0.7/0.3").split(",")[0].split("/"))
        torch.set_num_threads(1)
        row = gpt124(shape, args.vocab, args.rounds, args.inner, lr, outer)
        print(json.dumps(row, indent=1), flush=True)
        _report.write(json_out, figures=row)
        return 0
    if args.resume and json_out is None:
        ap.error("--resume needs --json PATH (the file whose rows it keeps)")
    if args.simulate and not args.resume:
        ap.error(
            "--simulate needs --resume --json PATH (the file whose streaming row it simulates)"
        )
    mode = "quick" if args.quick else "medium" if args.medium else "full"
    m = dict(MODES[mode])
    if args.steps:
        m["steps"] = args.steps
    try:  # a smaller grid than the mode's (a busy machine)
        for key, value in (("grad_lrs", args.grad_lrs), ("inner_lrs", args.inner_lrs)):
            if value:
                m[key] = tuple(float(x) for x in value.split(","))
        if args.outer:
            m["outer"] = tuple(tuple(float(y) for y in x.split("/")) for x in args.outer.split(","))
    except ValueError as e:
        ap.error(f"--grad-lrs/--inner-lrs/--outer: {e}")
    torch.set_num_threads(1)  # the parent evaluates; the workers are capped by the runtime
    task = tasks.get("lm", size=m["size"], context=m["context"], batch_size=m["batch_size"])
    budget = WORKERS * m["steps"] * task.tokens_per_batch  # B: equal-token budget
    setting = setting_of(task, m, args.codec)
    rows_all = methods(dict(m, compute=0.0), args.codec)  # names only, before the timed step
    known = [r[0] for r in rows_all] + list(PEERS)
    wanted = set(m["rows"] or known) if not args.methods else {
        n.strip() for n in args.methods.split(",")}  # fmt: skip
    if wanted - set(known):
        ap.error(f"--methods: unknown {sorted(wanted - set(known))} (known: {', '.join(known)})")
    wanted.add(BASELINE)
    commit, dirty = _report._git()
    kept = {}
    if args.resume:
        try:
            kept = earlier(json_out, mode, setting, commit, known, any_commit=args.simulate)
        except ValueError as e:
            ap.error(f"--resume: {json_out}: {e}")
        if not kept:
            print(f"--resume: {json_out} does not exist yet: every row runs", flush=True)
    if kept:  # the rows of an earlier piece: the same timed step, so the same async period
        setting["compute_s_per_step"] = kept["setting"]["compute_s_per_step"]
    else:
        probe_it, probe = task.batches(0, 1), task.init_params(0)
        task.loss_and_grad(probe, next(probe_it))
        times = []  # the fastest of 3 x 5 steps: the machine may be busy
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(5):
                task.loss_and_grad(probe, next(probe_it))
            times.append((time.perf_counter() - t0) / 5)
        setting["compute_s_per_step"] = min(times)
    m["compute"] = setting["compute_s_per_step"]
    rows_all = methods(m, args.codec)
    out: dict = {
        "mode": mode, "setting": setting, "runs": dict(kept.get("runs", {})),
        "torchft": dict(kept.get("torchft", {})), "failed": list(kept.get("failed", [])),
        "best": {}, "bars": [],
    }  # fmt: skip
    print(
        f"lm benchmark ({mode}): {task!r}, {task.num_params()} parameters, corpus sha256 "
        f"{task.corpus_sha256[:12]}; {WORKERS} workers, worker {SLOW} {SLOWDOWN:g}x slower, "
        f"{m['delay'] * 1e3:g} ms emulated + {m['compute'] * 1e3:.1f} ms measured compute per "
        f"step; B = {budget} tokens ({m['steps']} local steps per worker)",
        flush=True,
    )
    for name, runs in out["runs"].items():
        b = best_of(runs)
        print(f"  {name:22s} kept from {json_out} ({b.get('time_utc')}, load {load_text(b)}): "
              f"loss@B {fmt(b['loss_at_B'])}", flush=True)  # fmt: skip

    def point(name: str, lr: float, o, run) -> dict | None:
        """One point of a row, stamped with its load, time and commit (None: it failed)."""
        load, when = os.getloadavg(), time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        try:
            r = run(lr, o)
        except Exception as e:  # a failed point is reported and left out of the best
            print(f"  {name:22s} lr={lr:<7g} outer={outer_text(outer_keys(o))} FAILED: "
                  f"{type(e).__name__}: {e}", flush=True)  # fmt: skip
            out["failed"].append({"method": name, "lr": lr, **outer_keys(o),
                                  "error": f"{type(e).__name__}: {e}"})  # fmt: skip
            return None
        r.update(method=name, load_start=load, load_end=os.getloadavg(), time_utc=when,
                 commit=commit, dirty=dirty, loss_at_B=at(r["records"], "tokens", budget))  # fmt: skip
        print(
            f"  {name:22s} lr={r['lr']:<7g} outer={outer_text(r):<7s} "
            f"loss@B {fmt(r['loss_at_B'])}  final "
            f"{fmt(r['final_loss'])}  {r['tokens']} tokens in {r['time']:.1f} s "
            f"({r['tokens_per_s']:.0f} tok/s, {r['pushes']} pushes, load {load[0]:.1f})",
            flush=True,
        )
        return r

    def save() -> list[dict]:
        report_bars = summary(out, known, budget) if BASELINE in out["runs"] else []
        _report.write(json_out, figures=out, bars=report_bars)
        return report_bars

    def simulated(b: dict, make) -> None:
        try:
            b["sim"] = simulate(task, m, make, b)
        except Exception as e:  # reported in the row; no bar
            b["sim"] = {"error": f"{type(e).__name__}: {e}"}
        print(f"  {STREAM:22s} simulated: {b['sim']}", flush=True)

    plan = rows_all + [(name, m["inner_lrs"], m["outer"], None, None) for name in PEERS]
    whole = True  # no row whose every point failed
    if args.simulate:
        if STREAM not in out["runs"]:
            ap.error(f"--simulate: {json_out} has no {STREAM!r} row")
        simulated(best_of(out["runs"][STREAM]), next(r[3] for r in plan if r[0] == STREAM))
        plan = []
    for name, lrs, outers, make, h in plan:
        if name not in wanted or name in out["runs"]:
            continue
        if make is None:  # torchft's
            run, version = torchft_peer(task, m, name)
            out["torchft"][name] = {"version": version} if run else {"skipped": version}
            if run is None:
                print(f"  {name}: skipped: {version}", flush=True)
                continue
        else:
            extra = 1.0 if name == BASELINE else EXTRA  # nothing reads the baseline past B

            def run(lr, o, name=name, make=make, h=h, extra=extra):
                return run_one(task, m, name, lr, make, h, outer=o, extra=extra)

        out["failed"] = [f for f in out["failed"] if f["method"] != name]
        runs = [r for o, lr in itertools.product(outers, lrs) if (r := point(name, lr, o, run))]
        if not runs:
            print(f"  {name}: every point failed", flush=True)
            whole = False
            continue
        b = best_of(runs)
        if name == STREAM:  # does the simulator predict its bytes per second?
            simulated(b, make)
        out["runs"][name] = [r if r is b else {k: v for k, v in r.items() if k != "records"}
                             for r in runs]  # fmt: skip
        save()
    if BASELINE not in out["runs"]:
        print(f"no {BASELINE} row: no table and no bars", flush=True)
        _report.write(json_out, figures=out)
        return 1
    report_bars = save()
    print(f"\nat best lr (lowest loss at B = {budget} tokens); target = {BASELINE}'s loss at B = "
          f"{fmt(out['target_loss'], '.4f')}; equal wall time = {out['equal_time_s']:.1f} s "
          "(the shortest run)")  # fmt: skip
    table = [{k: v for k, v in r.items() if k not in DETAIL} for r in out["best"].values()]
    print(report.format_table(table, list(table[0])))
    for name, r in out["best"].items():
        if r["lr_at_edge"]:
            print(f"  {name}: the best lr {r['best_lr']:g} is at the grid's edge")
    for b in out["bars"]:
        print(f"{'PASS' if b['pass'] else 'FAIL'}: {b['bar']}: {b['detail']}")
    missed = args.check and not all(b["met"] for b in report_bars)
    return 0 if whole and not missed else 1


if __name__ == "__main__":
    sys.exit(main())
