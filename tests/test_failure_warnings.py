"""Failures that change a run's result reach Python users as ``sw.FailureWarning``.

The first event of each kind (a worker failure, a shard restart, a divergence)
warns at once, naming the worker or shard and the cause; later ones of that
kind are counted, and one summary per kind gives the counts at the end of the
run. The CLI, which shows the log, prints each event once. Also here: the first
line of a ``WorkerError``, the missing ``__main__`` guard, a torch optimizer
given as the server optimizer, and runs whose loss ends NaN.
"""

from __future__ import annotations

import functools
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

import stalewise as sw
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import Failure, Fixed, Network, Service

REPO = Path(__file__).resolve().parents[1]
TARGET = np.arange(4, dtype=np.float32)
FREE = {
    "network": Network(latency=0.0, bandwidth=math.inf),
    "service": Service(time=0.0, rate=math.inf),
}


# -- functions the worker processes import (module level, picklable) ----------------------


def quadratic(params, batch):
    """0.5 * ||x - TARGET||^2 (5 ms a step in the local runtime, so a kill finds a run)."""
    diff = params["x"] - TARGET
    return float(0.5 * (diff**2).sum()), {"x": diff}


def paced(params, batch):
    import time

    time.sleep(0.005)
    return quadratic(params, batch)


def raises_on_5_and_9(params, batch):
    """Worker 1 raises on its batches 5 and 9 (each costs a restart; the batch is skipped)."""
    w, i = batch
    if w == 1 and i in (5, 9):
        raise ValueError(f"bad batch {i}")
    return paced(params, batch)


def raises_at_once(params, batch):
    if batch[0] == 1:
        raise ValueError("bad batch")
    return quadratic(params, batch)


def nan_loss_after_5(params, batch):
    """Finite gradients (every push is applied) but a NaN loss from batch 5 on."""
    loss, grads = quadratic(params, batch)
    return (math.nan if batch[1] >= 5 else loss), grads


def nan_grads_after_5(params, batch):
    """All-NaN gradients (every push refused) from batch 5 on."""
    if batch[1] >= 5:
        return math.nan, {"x": np.full(4, np.nan, np.float32)}
    return quadratic(params, batch)


def tagged(worker, workers):
    return ((worker, i) for i in range(10**9))


# -- helpers -------------------------------------------------------------------------------


def job(**kw):
    return sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1), **kw)


def sim_train(loss, *, failures=(), steps=60, workers=2, **policy):
    """A simulated run with ``failures`` scripted; ``policy``: the fields of sw.Failures."""
    sim = SimConfig(compute=Fixed(1.0), failures=list(failures), **FREE)
    return job().train(
        loss,
        data=tagged,
        workers=workers,
        steps=steps,
        runtime=sw.Simulation(sim),
        failures=sw.Failures(**policy),
    )


def failure_warnings(run):
    """``run()``'s result and the FailureWarnings it raised, every one (none filtered)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = run()
    return result, [w for w in caught if issubclass(w.category, sw.FailureWarning)]


def child_pid(name):
    import multiprocessing as mp

    (p,) = [p for p in mp.active_children() if p.name == name]
    return p.pid


class KillOnce:
    """An ``on_record`` that SIGKILLs the child called ``name`` once the run has ``after`` pushes."""

    def __init__(self, name, after=40):
        self.name, self.after, self.pid = name, after, None

    def __call__(self, rec):
        if self.pid is None and rec["pushes"] >= self.after:
            self.pid = child_pid(self.name)
            os.kill(self.pid, signal.SIGKILL)


# -- warnings, once per kind, with a summary -------------------------------------------------


def test_the_first_worker_failure_warns_at_once_and_the_rest_are_counted_at_the_end():
    fails = [Failure(1, t) for t in (3.5, 10.5, 20.5)] + [Failure(0, 5.5)]
    with pytest.warns(sw.FailureWarning) as caught:  # every one of them
        r = sim_train(quadratic, failures=fails, max_restarts=None)
    assert [e["action"] for e in r.failures] == ["restarted"] * 4
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages  # not one per event
    assert messages[0].startswith("worker 1 failed (scripted failure (SimConfig.failures)); ")
    assert "restarted" in messages[0]
    assert messages[1] == "worker failures this run: 4 (restarted 4); see result.failures"
    assert {w.filename for w in caught} == {__file__}  # attributed to the caller, not stalewise


def test_one_event_warns_once_and_has_no_summary():
    r, caught = failure_warnings(
        lambda: sim_train(quadratic, failures=[Failure(1, 4.5)], policy="drop")
    )
    assert [(e["worker"], e["action"]) for e in r.failures] == [(1, "dropped")]
    (only,) = caught
    assert str(only.message).startswith("worker 1 failed (scripted failure")
    assert "dropped" in str(only.message)


def test_each_kind_warns_once_and_is_counted_apart():
    def worker_0_diverges(params, batch):
        if batch[0] == 0:
            return 1.0, {"x": np.full(4, np.nan, np.float32)}
        return quadratic(params, batch)

    fails = [Failure(2, 2.5), Failure(2, 6.5), Failure(1, 9.5)]
    r, caught = failure_warnings(
        lambda: sim_train(worker_0_diverges, failures=fails, workers=3, diverge_after=3)
    )
    kinds = [("diverged" if e["action"] == "diverged" else "worker") for e in r.failures]
    assert sorted(kinds) == ["diverged", "worker", "worker", "worker"]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 3, messages  # first worker failure, the divergence, one summary
    assert sum(m.startswith("worker 2 failed (scripted failure") for m in messages) == 1
    assert sum(m.startswith("worker 0 diverged and stopped") for m in messages) == 1
    assert "worker failures this run: 3 (restarted 3); see result.failures" in messages


def test_a_local_run_warns_of_a_killed_and_a_raising_worker_once_then_counts(no_leaks):
    kill = KillOnce("stalewise-worker-0")
    r, caught = failure_warnings(
        lambda: job().train(
            raises_on_5_and_9,
            data=tagged,
            workers=2,
            steps=200,
            metrics=sw.Metrics(every=0.05, on_record=kill),
            timeouts=sw.Timeouts(total=120),
        )
    )
    assert kill.pid is not None and r.pushes >= 200
    causes = sorted((e["worker"], e["cause"]) for e in r.failures)
    assert causes == [
        (0, "died without a word (killed by SIGKILL)"),
        (1, "raised ValueError: bad batch 5"),
        (1, "raised ValueError: bad batch 9"),
    ]
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    first = r.failures[0]
    assert messages[0].startswith(f"worker {first['worker']} failed ({first['cause']}); restarted")
    assert messages[1] == "worker failures this run: 3 (restarted 3); see result.failures"


def test_a_local_shard_restart_warns_how_many_updates_it_lost(no_leaks):
    kill = KillOnce("stalewise-shard-1")
    r, caught = failure_warnings(
        lambda: job(shards=2).train(
            paced,
            data=tagged,
            workers=2,
            steps=200,
            metrics=sw.Metrics(every=0.05, on_record=kill),
            timeouts=sw.Timeouts(total=120),
        )
    )
    (event,) = r.failures
    assert event["shard"] == 1 and isinstance(event["lost"], int)
    (only,) = caught
    assert str(only.message).startswith(
        f"shard 1 failed (killed by SIGKILL); restarted at version {event['version']}, "
        f"{event['lost']} updates of its slice lost"
    )


def test_the_cli_prints_each_failure_once_on_stderr(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        textwrap.dedent(
            """
            [task]
            name = "least-squares"
            args = { n = 64, d = 4 }

            [optimizer]
            name = "sgd"
            lr = 0.05

            [run]
            workers = 2
            steps = 200
            delay = 0.01
            max_restarts = 10

            [sim]
            compute = "fixed"
            restart_delay = 0.01
            failures = [{ worker = 1, time = 0.1 }, { worker = 1, time = 0.3 },
                        { worker = 0, time = 0.5 }]
            """
        )
    )
    argv = ["train", str(cfg), "--runtime", "sim", "--out", str(tmp_path / "out"), "-q"]
    done = subprocess.run(
        [sys.executable, "-m", "stalewise", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    events = [line for line in done.stderr.splitlines() if " failed (scripted failure" in line]
    assert len(events) == 3, done.stderr  # each event once, from the log
    assert "FailureWarning" not in done.stderr and "this run:" not in done.stderr


# -- what a failure says ---------------------------------------------------------------------


def test_a_worker_error_says_what_user_code_raised_on_its_first_line(no_leaks):
    with pytest.raises(sw.WorkerError) as caught:
        job().train(
            raises_at_once, data=tagged, workers=2, steps=20, timeouts=sw.Timeouts(total=120)
        )
    first, *rest = str(caught.value).splitlines()
    assert first == "worker 1 failed: ValueError: bad batch"
    assert rest[0] == "Traceback (most recent call last):" and rest[-1] == "ValueError: bad batch"


def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(
        textwrap.dedent(
            """
            import numpy as np
            import stalewise as sw

            def loss(params, batch):
                return 0.0, {"x": params["x"]}

            job = sw.Job({"x": np.zeros(2, np.float32)}, optimizer=sw.optim.sgd(0.1))
            job.train(loss, data=[[0], [0]], workers=2, steps=4)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    # shards start without the user's __main__ now: the first worker to import it dies
    assert re.match(r"stalewise\.runtime\.errors\.WorkerError: worker \d failed: ", last), last
    assert 'put the code that starts training under `if __name__ == "__main__":`' in last


@pytest.mark.parametrize("form", ["class", "partial", "instance", "optax"])
def test_a_torch_or_optax_optimizer_as_the_server_optimizer_says_where_it_goes(form):
    if form == "optax":
        optimizer = pytest.importorskip("optax").adam(1e-3)
    else:
        torch = pytest.importorskip("torch")
        optimizer = {
            "class": torch.optim.Adam,
            "partial": functools.partial(torch.optim.Adam, lr=1e-3),
            "instance": torch.optim.Adam([torch.zeros(2, requires_grad=True)]),
        }[form]
    with pytest.raises(TypeError) as caught:
        job_ = sw.Job({"x": np.zeros(4, np.float32)}, optimizer=optimizer)
        del job_
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("optimizer= is the server optimizer and must be a stalewise")
    assert "torch.optim.adam.Adam" in message or "optax" in message
    assert "inner= of a strategy, e.g. sw.strategies.diloco(inner=functools.partial(" in message


# -- runs whose loss ends NaN ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("loss", "diverge_after"),
    [(nan_loss_after_5, 20), (nan_loss_after_5, None), (nan_grads_after_5, None)],
)
def test_a_sim_run_whose_loss_ends_nan_warns_and_says_so(loss, diverge_after):
    with pytest.warns(sw.FailureWarning, match=r"the loss at the end is nan: training diverged"):
        r = sim_train(loss, diverge_after=diverge_after)
    assert math.isnan(r.records[-1]["loss"])
    assert r.stop_reason.endswith(
        "the loss at the end is nan: training diverged (lower the learning rate or clip the "
        "gradients)"
    )


def test_a_sim_run_with_no_push_applied_warns():
    def all_nan(params, batch):
        return math.nan, {"x": np.full(4, np.nan, np.float32)}

    with pytest.warns(sw.FailureWarning, match=r"no push was applied, every one was refused"):
        r = sim_train(all_nan, diverge_after=None)
    assert r.stats["applied"] == 0 and "no push was applied" in r.stop_reason


def test_a_local_run_whose_loss_ends_nan_warns_and_says_so(no_leaks):
    with pytest.warns(sw.FailureWarning, match=r"the loss at the end is nan: training diverged"):
        r = job().train(
            nan_loss_after_5, data=tagged, workers=2, steps=40, timeouts=sw.Timeouts(total=120)
        )
    assert r.stats["applied"] >= 40 and "training diverged" in r.stop_reason


def test_every_worker_diverging_still_raises_diverged_error():
    with (  # the warning first: it is checked only if nothing propagates through it
        pytest.warns(sw.FailureWarning, match="^worker . diverged and stopped"),
        pytest.raises(sw.DivergedError, match="training diverged"),
    ):
        sim_train(nan_grads_after_5, diverge_after=3)
