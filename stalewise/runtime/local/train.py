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
from multiprocessing import connection
from typing import Any

from stalewise import checkpoint, tree
from stalewise.protocol import ServerConfig, loop
from stalewise.runtime.base import (
    Recorder,
    TrainResult,
    WorkerError,
    batch_iterator,
    mean_loss,
    merge_stats,
)
from stalewise.runtime.local.client import Client
from stalewise.runtime.local.procs import child_logging, thread_budget
from stalewise.runtime.local.server import LocalServer
from stalewise.runtime.options import RunOptions
from stalewise.strategies import Strategy

log = logging.getLogger(__name__)

_STOP, _DONE0 = 0, 1  # control slots: stop flag, then pushes done per worker, then last loss


def _worker_main(
    client: Client,
    strategy: Strategy,
    options: RunOptions,
    results: connection.Connection,
) -> None:
    """Body of a worker process: the protocol's worker loop, answered with blocking calls."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent coordinates shutdown
    w, workers = client.worker, client._layout.workers
    child_logging(f"worker {w}")
    slowdown, delay = options.slowdowns[w], options.extra_delays[w]
    try:
        ctrl = client._layout.control(client._attach())
        batches = batch_iterator(options.data, w, workers)
        first = next(batches)
        # Set-up, not training: load the data and run one step whose result is thrown
        # away, so a JIT compile of the user's function (JAX, numba) happens before the clock.
        options.loss_and_grad(client.pull(copy=False), first)
        batches = itertools.chain([first], batches)
        results.send(("ready", w))
        if results.recv() != "go":
            return
        done_slot, loss_slot = _DONE0 + w, _DONE0 + workers + w

        def answer(request: Any) -> Any:
            if request is loop.BEGIN:
                return not ctrl[_STOP] and ctrl[_DONE0 : _DONE0 + workers].sum() < options.steps
            if request is loop.PULL:
                client.pull_flat()
                return client.last_pull(copy=False)
            # a Push: emulate the compute time, then push; a straggler is slow at everything
            emulated = (request.compute + delay * request.local_steps) * slowdown - request.compute
            if emulated > 0:
                time.sleep(emulated)
            client.push(request.update)
            ctrl[done_slot] += 1
            ctrl[loss_slot] = request.loss
            return client.take_results()

        stats = loop.run(
            loop.worker_loop(strategy, options.loss_and_grad, batches, worker=w), answer
        )
        client.wait(timeout=options.ack_timeout)
        loop.report(client.take_results(), stats, w)
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


def run(config: ServerConfig, strategy: Strategy, options: RunOptions) -> TrainResult:
    """Trains with ``options.workers`` local processes (the ``"local"`` runtime; see Job.train)."""
    o = options
    workers, steps, evaluate = o.workers, o.steps, o.evaluate
    for name, obj in (("loss_and_grad", o.loss_and_grad), ("data", o.data), ("strategy", strategy)):
        _check_picklable(name, obj)
    recorder = None
    worker_options = o.for_workers()
    resumed = checkpoint.resume_point(config, o, runtime="local")
    with LocalServer(
        config, workers, start_timeout=o.shard_start_timeout, join_timeout=o.join_timeout
    ) as server:
        ctx, procs, results = server._ctx, [], []
        saver = None
        try:
            base_pushes = 0
            if resumed is not None:
                server.load_state_dicts(resumed.states)
                base_pushes = int(resumed.step.get("pushes", 0))
                server.control[_DONE0] = base_pushes  # steps is the job's total budget
                log.info("resumed from %s (version %d)", resumed.path, resumed.version)
            for w in range(workers):
                mine, theirs = ctx.Pipe()
                args = (server.client(w), strategy, worker_options, theirs)
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
                msg = _result(c, procs[w], w, timeout=o.start_timeout)
                if msg[0] == "error":
                    raise WorkerError(f"worker {w} failed:\n{msg[2]}")
            server.unlink()  # every process has mapped the block: nothing can leak now
            ctrl = server.control
            losses = ctrl[_DONE0 + workers : _DONE0 + 2 * workers]
            if evaluate is not None:  # the first call may load data or compile: not training time
                evaluate(server.pull())
            recorder = Recorder(
                o.run, steps, stop_at=o.stop_at, on_record=o.on_record, progress=o.progress
            )
            for c in results:
                c.send("go")
            t0 = time.perf_counter()
            if o.checkpoint_dir is not None:
                # consistent per shard; across shards the states can differ by the pushes
                # in flight, which a resumed run loses (its workers are new incarnations)
                saver = checkpoint.Saver(
                    config, strategy, o, runtime="local", version=server.published_version()
                )
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
                if now - last_eval >= o.eval_interval or not live:
                    last_eval = now
                    stats = merge_stats(server.stats())
                    if recorder.record(
                        now, pushes, stats, mean_loss(losses), evaluate, server.pull
                    ):
                        ctrl[_STOP] = 1
                if saver is not None and live and saver.due(server.published_version(), now):
                    saver.save(server.state_dicts(), {"pushes": pushes, "time": now})
                if o.timeout is not None and now > o.timeout:
                    raise TimeoutError(f"training did not finish within {o.timeout} s")
            elapsed = time.perf_counter() - t0
            recorder.finish(recorder.stop_reason or f"the budget of {steps} pushes is spent")
            stats = merge_stats(server.stats(), settled=True)
            if saver is not None:  # the end of the run: every worker has left
                saver.save(server.state_dicts(), {"pushes": pushes, "time": elapsed})
        finally:
            if recorder is not None:
                recorder.close()
            if server.control is not None:
                server.control[_STOP] = 1
            for c in results:
                c.close()
            for p in procs:
                p.join(o.stop_timeout)
                if p.is_alive():
                    p.kill()
                    p.join()
    flat = server.final_params
    params = tree.unflatten(flat, config.spec, copy=True)
    return TrainResult(params, flat, recorder.records, stats, elapsed, pushes)
