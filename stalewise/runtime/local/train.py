"""``Job.train`` on the local runtime: one OS process per worker, driven by the parent.

The parent starts the shards (:class:`~stalewise.runtime.local.LocalServer`) and
one spawned process per worker, releases them together, then watches: it
evaluates the parameters every ``eval_interval`` seconds as an observer, writes
metrics records, drives the progress bar, and stops the job at the step budget,
the stop condition, an error in user code or Ctrl-C. Whatever happens, every
process it started is stopped and the shared memory is freed.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import signal
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import connection
from typing import Any

from stalewise import tree
from stalewise.protocol import ServerConfig
from stalewise.runtime.base import (
    Recorder,
    TrainResult,
    WorkerError,
    batch_iterator,
    check_run,
    merge_stats,
)
from stalewise.runtime.local.client import Client, PushRejected
from stalewise.runtime.local.server import LocalServer, thread_budget
from stalewise.strategies import Strategy

log = logging.getLogger(__name__)

_STOP, _DONE0 = 0, 1  # control slots: stop flag, then pushes done per worker, then last loss


def _worker_main(
    client: Client,
    strategy: Strategy,
    loss_and_grad: Callable,
    data: Any,
    steps: int,
    slowdown: float,
    delay: float,
    results: connection.Connection,
) -> None:
    """Body of a worker process: pull, compute, push until the budget is spent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent coordinates shutdown
    w, workers = client.worker, client._layout.workers
    try:
        ctrl = client._layout.control(client._attach())
        batches = batch_iterator(data, w, workers)
        first = next(batches)
        # Set-up, not training: load the data and run one step whose result is thrown
        # away, so a JIT compile of the user's function (JAX, numba) happens before the clock.
        loss_and_grad(client.pull(copy=False), first)
        batches = itertools.chain([first], batches)
        results.send(("ready", w))
        if results.recv() != "go":
            return
        done_slot, loss_slot = _DONE0 + w, _DONE0 + workers + w
        while not ctrl[_STOP] and ctrl[_DONE0 : _DONE0 + workers].sum() < steps:
            try:
                client.pull_flat()
            except PushRejected as e:  # the pull is complete; the refused push is counted
                log.warning("worker %d: %s", w, e)
            params = client.last_pull(copy=False)
            t0 = time.perf_counter()
            update, loss = strategy.worker_step(params, loss_and_grad, batches)
            compute = time.perf_counter() - t0
            emulated = (compute + delay) * slowdown - compute  # a straggler is slow at everything
            if emulated > 0:
                time.sleep(emulated)
            try:
                client.push(update)  # sent even if the previous push was refused
            except PushRejected as e:
                log.warning("worker %d: %s", w, e)
            ctrl[done_slot] += 1
            ctrl[loss_slot] = loss
        try:
            client.wait(timeout=60)
        except PushRejected as e:
            log.warning("worker %d: %s", w, e)
        client.close()
        results.send(("done", w))
    except BaseException:
        with contextlib.suppress(OSError):  # the parent may be gone already
            results.send(("error", w, traceback.format_exc()))


def _result(conn: connection.Connection, proc: Any, w: int, timeout: float | None = None) -> tuple:
    """A worker's next message; a worker that died without one reads as an error."""
    if timeout is not None and not conn.poll(timeout):
        return ("error", w, f"worker did not start within {timeout} s")
    try:
        return conn.recv()
    except (EOFError, OSError):
        proc.join(1)
        return ("error", w, f"worker process died without a word (exit code {proc.exitcode})")


def _check_picklable(name: str, obj: Any) -> None:
    try:
        pickle.dumps(obj)
    except Exception as e:
        raise TypeError(
            f"{name} must be picklable to reach the worker processes (use a module-level "
            f"function or object, not a lambda or closure): {e}"
        ) from None


def train(
    config: ServerConfig,
    loss_and_grad: Callable,
    *,
    data: Any,
    workers: int,
    steps: int,
    strategy: Strategy,
    evaluate: Callable[[Any], Mapping[str, float]] | None = None,
    eval_interval: float = 0.5,
    stragglers: Mapping[int, float] | Sequence[float] | None = None,
    delays: Mapping[int, float] | None = None,
    stop_at: Mapping[str, float] | None = None,
    run: str = "run",
    on_record: Callable[[dict], None] | None = None,
    progress: bool = False,
    timeout: float | None = None,
) -> TrainResult:
    """Trains with ``workers`` local processes until ``steps`` pushes in all (see Job.train)."""
    factors, extra = check_run(workers, steps, data, stragglers, delays)
    for name, obj in (("loss_and_grad", loss_and_grad), ("data", data)):
        _check_picklable(name, obj)
    recorder = None
    with LocalServer(config, workers) as server:
        ctx, procs, results = server._ctx, [], []
        try:
            for w in range(workers):
                mine, theirs = ctx.Pipe()
                args = (
                    server.client(w),
                    strategy,
                    loss_and_grad,
                    data,
                    steps,
                    factors[w],
                    extra[w],
                    theirs,
                )
                p = ctx.Process(
                    target=_worker_main, args=args, name=f"stalewise-worker-{w}", daemon=True
                )
                with thread_budget((os.cpu_count() or 1) // workers):
                    p.start()
                server.release(w)  # if the worker dies, its shards now see its pipes close
                theirs.close()
                procs.append(p)
                results.append(mine)
            for w, c in enumerate(results):
                msg = _result(c, procs[w], w, timeout=300)
                if msg[0] == "error":
                    raise WorkerError(f"worker {w} failed:\n{msg[2]}")
            server.unlink()  # every process has mapped the block: nothing can leak now
            ctrl = server.control
            losses = ctrl[_DONE0 + workers : _DONE0 + 2 * workers]
            if evaluate is not None:  # the first call may load data or compile: not training time
                evaluate(server.pull())
            recorder = Recorder(run, steps, stop_at=stop_at, on_record=on_record, progress=progress)
            for c in results:
                c.send("go")
            t0 = time.perf_counter()
            live = set(range(workers))
            last_eval = -float("inf")
            while live:
                for c in connection.wait([results[w] for w in live], timeout=0.05):
                    w = results.index(c)
                    msg = _result(c, procs[w], w)
                    if msg[0] == "error":
                        raise WorkerError(f"worker {msg[1]} failed:\n{msg[2]}")
                    live.discard(msg[1])
                now = time.perf_counter() - t0
                pushes = int(ctrl[_DONE0 : _DONE0 + workers].sum())
                recorder.progress(pushes)
                if now - last_eval >= eval_interval or not live:
                    last_eval = now
                    stats = merge_stats(server.stats())
                    if recorder.record(
                        now, pushes, stats, float(losses.mean()), evaluate, server.pull
                    ):
                        ctrl[_STOP] = 1
                if timeout is not None and now > timeout:
                    raise TimeoutError(f"training did not finish within {timeout} s")
            elapsed = time.perf_counter() - t0
            stats = merge_stats(server.stats())
        finally:
            if recorder is not None:
                recorder.close()
            if server.control is not None:
                server.control[_STOP] = 1
            for c in results:
                c.close()
            for p in procs:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join()
    flat = server.final_params
    params = tree.unflatten(flat, config.spec, copy=True)
    return TrainResult(params, flat, recorder.records, stats, elapsed, pushes)
