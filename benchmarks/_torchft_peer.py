"""torchft's DiLoCo and Streaming DiLoCo on the language-model task: the peer rows of
``benchmarks/lm.py``.

Each worker is one torchft replica group of one process (CPU, gloo): its own
``TCPStore`` and ``Manager`` (``use_async_quorum=False``, as DiLoCo needs, and
``min_replica_size`` = all workers, so every sync waits for everyone, as
synchronous DiLoCo does), joined through a lighthouse that this process runs on
loopback. The model is ``stalewise.tasks.lm``'s GPT (the same parameters, the
same ``logits``) held in a ``torch.nn.Module``; the data are the task's shards
(``task.batches(worker, workers)``). Inner optimizer: ``torch.optim.AdamW``
with ``sw.optim.adamw``'s defaults (betas 0.9/0.999, eps 1e-8, weight decay
0.01); outer: SGD with Nesterov momentum (lr 0.7, momentum 0.9 unless
``outer=(lr, momentum)``), as ``sw.strategies.diloco``; ``sync_every=H``.

Straggler emulation as stalewise's local runtime: after each step's compute,
a worker sleeps ``(compute + delay) * slowdown - compute``.

Records: after each committed sync, replica 0 sends its model (the new global
model) and the time; this process evaluates them after the run, off the clock.
A sync's tokens are ``workers * H * batch_size * context``. Bytes: torchft
all-reduces each worker's float32 pseudo-gradient (``4 * params`` bytes per
worker per sync; a ring all-reduce puts ``2 (n-1)/n`` times that on each
worker's link), counted here as ``4 * params`` per sync so that it compares with
a stalewise DiLoCo push of the same delta.

Streaming (``fragments=``, lists of leaf names, e.g. stalewise's
``fragment_runs``): ``torchft.local_sgd.DiLoCo`` with one ``nn.Module`` per
fragment (the model's own parameters), ``sync_every=H``,
``fragment_sync_delay=delay``, ``fragment_update_alpha=alpha`` and
``should_quantize``. torchft syncs fragment ``step % P`` every ``H / P`` inner
steps: its all-reduce starts ``delay`` steps before and is merged (``lerp``
with ``alpha``) at the sync, so the fragments are given in the order stalewise
pushes them. A record is the *global* model (each fragment's outer-stepped
values, torchft's ``original_parameters``), as stalewise evaluates the shards'
parameters; its tokens are ``workers * H / P * batch_size * context`` per sync.
On CPU torchft's quantized all-reduce (Triton, a GPU) is not used: a push is
the fragment's float32 pseudo-gradient (``quantized`` in the row says which).
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
from datetime import timedelta


def _module(tree: dict):
    import torch

    mod = torch.nn.Module()
    for k, v in tree.items():
        if isinstance(v, dict):
            mod.add_module(k, _module(v))
        else:
            mod.register_parameter(k, torch.nn.Parameter(v.detach().clone()))
    return mod


def _tree(mod) -> dict:
    out = {k: p for k, p in mod.named_parameters(recurse=False)}
    out.update({k: _tree(m) for k, m in mod.named_children()})
    return out


def _worker(w, workers, lighthouse, task, lr, outer, h, syncs, delay, slowdown, ready, go, out,
            log, stream):  # fmt: skip
    import os

    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 2)  # torchft's logs and warnings go to a file, shown if the run fails
    os.dup2(fd, 1)
    os.environ["RUST_LOG"] = "warn"
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchft import Manager, ProcessGroupGloo
    from torchft import manager as ft_manager
    from torchft.local_sgd import DiLoCo

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        model = _module(task.init_params(0))
        parts, kw = [model], {}
        if stream is not None:  # one module per fragment, holding the model's own parameters
            named = dict(model.named_parameters())
            parts = []
            for names in stream["fragments"]:
                part = torch.nn.Module()
                for n in names:
                    part.register_parameter(n.replace(".", "__"), named[n])
                parts.append(part)
            kw = dict(fragment_sync_delay=stream["delay"], fragment_update_alpha=stream["alpha"],
                      should_quantize=stream["quantize"])  # fmt: skip
        inner = torch.optim.AdamW(
            model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01
        )
        outer_opt = torch.optim.SGD(  # torch's Nesterov needs a momentum > 0
            model.parameters(), lr=outer[0], momentum=outer[1], nesterov=outer[1] > 0
        )
        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=120)),
            load_state_dict=lambda sd: (
                model.load_state_dict(sd["model"]),
                inner.load_state_dict(sd["inner"]),
            ),
            state_dict=lambda: {"model": model.state_dict(), "inner": inner.state_dict()},
            min_replica_size=workers,
            use_async_quorum=False,
            replica_id=f"lm{w}",
            store_addr="localhost",
            store_port=store.port,
            rank=0,
            world_size=1,
            lighthouse_addr=lighthouse,
            hostname="localhost",
            timeout=timedelta(seconds=120),
            quorum_timeout=timedelta(seconds=600),
            connect_timeout=timedelta(seconds=60),
        )
        batches = task.batches(w, workers)

        def loss_of(batch):
            logits = task.logits(_tree(model), batch[:, :-1])
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

        loss_of(next(batches)).backward()  # warm-up, off the clock; thrown away
        model.zero_grad()
        drawn = 0
        ready.put(w)
        go.wait()
        with DiLoCo(manager, parts, inner, outer_opt, sync_every=h, pin_memory=False,
                    **kw) as diloco:  # fmt: skip
            while manager.current_step() < syncs:
                t = time.perf_counter()
                inner.zero_grad()
                loss_of(next(batches)).backward()
                drawn += 1
                compute = time.perf_counter() - t
                emulated = (compute + delay) * slowdown - compute
                if emulated > 0:
                    time.sleep(emulated)
                before = manager.current_step()
                inner.step()  # DiLoCo syncs in this step's hook every h steps
                if w == 0 and manager.current_step() != before:
                    if stream is None:
                        state = {
                            k: v.detach().numpy().copy() for k, v in model.state_dict().items()
                        }
                    else:  # the global model: each fragment's outer-stepped values
                        state = {k.replace("__", "."): v.detach().numpy().copy()
                                 for f in diloco._fragments
                                 for k, v in f.original_parameters.items()}  # fmt: skip
                    out.put(("record", time.monotonic(), manager.current_step(), state))
        quantized = bool(stream and stream["quantize"] and ft_manager.IS_TRITON_AVAILABLE)
        out.put(("done", w, time.monotonic(), drawn, quantized))
        manager.shutdown(wait=False)
    except BaseException as e:  # the parent reports it
        out.put(("failed", w, f"{type(e).__name__}: {e}"))


def _tail(logs: str, w: int) -> str:
    try:
        with open(os.path.join(logs, f"worker{w}.log"), errors="replace") as f:
            return "log: " + " | ".join(f.read().strip().splitlines()[-3:])
    except OSError as e:
        return f"no log: {e}"


def _failed(msg: tuple, logs: str) -> None:
    if msg[0] == "failed":
        raise RuntimeError(f"torchft worker {msg[1]}: {msg[2]} ({_tail(logs, msg[1])})")


def _check(out, procs, logs: str, deadline: float, timeout: float, lr: float) -> None:
    """Raises if a worker said it failed (on ``out``, when given), died, or the run is late."""
    if out is not None:
        with contextlib.suppress(queue.Empty):
            _failed(out.get_nowait(), logs)
    if time.monotonic() > deadline:
        raise TimeoutError(f"torchft run (lr={lr}) passed {timeout:g} s")
    dead = [p.pid for p in procs if p.exitcode not in (None, 0)]
    if dead:
        raise RuntimeError(f"torchft worker processes {dead} died")


def run(task, lr: float, h: int, syncs: int, workers: int, delay: float,
        slowdowns: list[float], timeout: float = 900.0, outer=(0.7, 0.9), fragments=None,
        tau: int = 0, alpha: float = 0.0, quantize: bool = False, keep=None) -> dict:  # fmt: skip
    """One torchft DiLoCo run of ``syncs`` syncs (fragment syncs when ``fragments``, lists
    of leaf names in the order they sync, makes it Streaming DiLoCo with ``tau`` and
    ``alpha``); returns the fields of a benchmark row. ``keep``: a list that receives each
    record's model (leaf name -> array)."""
    import torch
    from torchft.coordination import LighthouseServer

    ctx = mp.get_context("spawn")
    logs = tempfile.mkdtemp(prefix="torchft-peer-")
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=workers)
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(
            target=_worker,
            args=(
                w,
                workers,
                lighthouse.address(),
                task,
                lr,
                tuple(outer),
                h,
                syncs,
                delay,
                slowdowns[w],
                ready,
                go,
                out,
                os.path.join(logs, f"worker{w}.log"),
                None
                if fragments is None
                else dict(
                    fragments=[list(f) for f in fragments],
                    delay=tau,
                    alpha=alpha,
                    quantize=quantize,
                ),
            ),
            daemon=True,
        )
        for w in range(workers)
    ]
    raw, done = [], {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        waiting = workers
        while waiting:  # a worker that fails before it is ready says so on `out`
            try:
                ready.get(timeout=1.0)
                waiting -= 1
            except queue.Empty:
                _check(out, procs, logs, deadline, timeout, lr)
        t0 = time.monotonic()
        go.set()
        while len(done) < workers:
            try:
                msg = out.get(timeout=max(min(deadline - time.monotonic(), 5.0), 0.1))
            except queue.Empty:
                _check(None, procs, logs, deadline, timeout, lr)
                continue
            _failed(msg, logs)
            if msg[0] == "record":
                raw.append(msg[1:])
            else:
                done[msg[1]] = msg[2:]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        lighthouse.shutdown()
        shutil.rmtree(logs, ignore_errors=True)
    per_sync = workers * h * task.tokens_per_batch // (1 if fragments is None else len(fragments))
    model = _module(task.init_params(0))
    records = [{"time": 0.0, "tokens": 0, "pushes": 0,
                "loss": task.evaluate(task.init_params(0))["loss"]}]  # fmt: skip
    for t, step, state in raw:
        if keep is not None:
            keep.append(state)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
        with torch.no_grad():
            loss = task.evaluate(_tree(model))["loss"]
        records.append({"time": t - t0, "tokens": step * per_sync, "pushes": step * workers,
                        "loss": loss})  # fmt: skip
    end = max(t for t, *_ in done.values()) - t0
    drawn = sum(d for _, d, _ in done.values()) * task.tokens_per_batch
    params = task.num_params() / (1 if fragments is None else len(fragments))  # per push
    return {
        "lr": lr,
        "outer_lr": outer[0],
        "outer_momentum": outer[1],
        "pushes": records[-1]["pushes"],
        "bytes_per_push": 4.0 * params,
        "quantized": any(q for *_, q in done.values()),
        "time": end,
        "tokens": records[-1]["tokens"],
        "tokens_per_s": drawn / end,
        "final_loss": records[-1]["loss"] if len(records) > 1 else math.nan,
        "records": records,
    }
