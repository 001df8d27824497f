"""The run skeleton (stalewise.runtime.driver) over a tiny host of pure Python.

The host is a real one, only small: one protocol shard (``ServerConfig.build_shard``),
a clock of whole time units, and workers that push the gradient of a quadratic on
a fixed schedule (worker ``w`` every ``period[w]`` units). It runs event-driven
(``virtual``: RECORD, CHECKPOINT and END, like the simulator) or one unit per
``advance`` (``TICK``, like the local and Ray runtimes).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

import stalewise as sw
from stalewise import checkpoint
from stalewise.protocol import PushHeader
from stalewise.runtime import driver
from stalewise.runtime.errors import DivergedError, WorkerError
from stalewise.runtime.options import RunOptions

TARGET = np.array([1.0, -2.0, 3.0])


def _data(worker: int, workers: int):  # never drawn: the host computes the gradient itself
    while True:
        yield None


def _loss_and_grad(params, batch):  # the host's workers compute the same, inline
    return 0.0, params


class Host:
    """Workers on a schedule of whole time units, pushing ``params - TARGET`` to one shard."""

    runtime = "tiny"

    def __init__(self, config, *, periods=(1, 2), virtual=True, fail_at=None, lose=False):
        self.config, self.periods, self.virtual = config, periods, virtual
        self.checkpoint_info = {"host": "tiny"}
        self.fail_at = fail_at  # (time, worker): that worker raises then
        self.lose = lose  # every worker is dropped at t=3
        self.shard = config.build_shard(0, np.array(config.init, copy=True), len(periods))
        self.t, self.count, self.seq = 0, 0, [0] * len(periods)
        self.loss = [math.nan] * len(periods)
        self.calls: list[str] = []
        self.stopped = self.closed = False
        self.snapshots: list[tuple[float, bool]] = []

    def start(self, run):
        self.run, self.steps = run, run.options.steps
        if run.resume is not None:
            self.shard.load_state_dict(run.resume.states[0])
            self.t, self.count = int(run.resume.step["time"]), run.pushes_at_start
        for w in range(len(self.periods)):
            self.shard.join(w, int(self.shard.incarnation[w]) + 1)

    def go(self):
        self.calls.append("go")

    def _step(self):
        """One time unit: each worker due pushes, while the budget lasts."""
        self.t += 1
        if self.lose and self.t == 3:
            for w in range(len(self.periods)):
                self.run.failures.worker(w, "lost", time=self.t)  # the policy: "drop"
            self.periods = ()
        for w, period in enumerate(self.periods):
            if self.fail_at == (self.t, w):
                self.run.failures.worker(w, "raised", time=self.t)  # raises under "fail"
            if self.t % period or self.count >= self.steps:
                continue
            params = np.empty(self.config.spec.size, self.config.init.dtype)
            base = self.shard.pull(w, params)
            self.loss[w] = float(np.sum((params - TARGET) ** 2))
            inc = int(self.shard.incarnation[w])
            self.shard.push(PushHeader(w, self.seq[w], base, inc), params - TARGET)
            self.seq[w] += 1
            self.count += 1

    def over(self):
        return self.count >= self.steps or self.stopped or not self.periods

    def advance(self, until, due):
        self.calls.append(f"advance {until:g}")
        if not self.virtual:
            self._step()
            return driver.END if self.over() else driver.TICK
        if until <= self.t:
            return driver.RECORD
        while self.t + 1 <= until:
            self._step()
            if self.over():
                return driver.END
            if due is not None and due():
                return driver.CHECKPOINT
        return driver.RECORD

    def now(self):
        return float(self.t)

    def pushes(self):
        return self.count

    def stats(self, *, settled=False):
        return self.shard.stats.as_dict() | {"version": self.shard.version}

    def losses(self):
        return self.loss

    def params(self):
        flat = np.empty(self.config.spec.size, self.config.init.dtype)
        self.shard.pull(None, flat)
        return sw.tree.unflatten(flat, self.config.spec)

    def stop(self):
        self.stopped = True
        return self.virtual

    def snapshot(self, now, *, failure=False):
        self.snapshots.append((now, failure))
        step = {"pushes": self.count, "time": now}
        return driver.Snapshot([self.shard.state_dict()], step, None)

    def budget_spent(self):
        return False  # every push counts: pushes >= steps says it

    def diverged(self):
        return []

    def finish(self, stats):
        stats["tiny"] = {"time_units": self.t}
        flat = np.empty(self.config.spec.size, self.config.init.dtype)
        self.shard.pull(None, flat)
        return flat

    def close(self):
        self.closed = True


def _job():
    return sw.Job({"x": np.zeros(3)}, optimizer=sw.optim.sgd(0.1))


def _options(**kw):
    kw = {"workers": 2, "steps": 20, "eval_interval": 3.0} | kw
    return RunOptions(loss_and_grad=_loss_and_grad, data=_data, **kw)


def _drive(host_kw=None, job=None, **kw):
    job = job or _job()
    host = Host(job.config, **(host_kw or {}))
    result = driver.drive(host, job.config, job.strategy, _options(**kw))
    return host, result


def _pushes_at(t: int, periods=(1, 2), steps=20) -> int:
    return min(steps, sum(t // p for p in periods))


def test_an_event_driven_host_records_at_the_start_every_interval_and_at_the_end():
    host, result = _drive()
    times = [r["time"] for r in result.records]
    # 20 pushes: 1 + 2 per two units, spent at t=14 (13 + 6 = 19 at t=13)
    assert times == [0.0, 3.0, 6.0, 9.0, 12.0, 14.0]
    assert [r["pushes"] for r in result.records] == [_pushes_at(int(t)) for t in times]
    assert result.pushes == 20 and result.time == 14.0 and host.closed
    assert result.stop_reason == "the budget of 20 pushes is spent" and result.ended == "budget"
    assert result.stats["tiny"] == {"time_units": 14} and result.stats["applied"] == 20
    # the driver asks for the next grid point each time, not a time that drifts
    assert host.calls[:4] == ["go", "advance 0", "advance 3", "advance 6"]
    np.testing.assert_array_equal(result.params["x"], result.flat)
    assert np.abs(result.flat - TARGET).max() < np.abs(TARGET).max()  # it trained


def test_a_real_time_host_records_on_the_grid_after_its_ticks_and_warms_up_evaluate():
    evaluated = []

    def evaluate(params):
        evaluated.append(params["x"].copy())
        return {"loss": float(np.sum((params["x"] - TARGET) ** 2))}

    _host, result = _drive({"virtual": False}, evaluate=evaluate)
    times = [r["time"] for r in result.records]
    assert times == [1.0, 3.0, 6.0, 9.0, 12.0, 14.0]  # the first tick, the grid, the end
    assert len(evaluated) == len(times) + 1  # one call before the clock starts
    np.testing.assert_array_equal(evaluated[0], np.zeros(3))


def test_an_event_driven_host_evaluates_no_warm_up_call():
    calls = []
    _drive(evaluate=lambda p: calls.append(1) or {"loss": 0.0})
    assert len(calls) == 6  # one per record


def test_checkpoints_are_taken_when_due_after_an_event_and_at_the_end(tmp_path):
    host, result = _drive(checkpoint_dir=tmp_path, checkpoint_every=5, checkpoint_keep=100)
    taken = [t for t, failure in host.snapshots if not failure]
    # the job's pushes pass a multiple of 5: 6 at t=4, 10 at t=7, 15 at t=10; the end at t=14
    assert taken == [4.0, 7.0, 10.0, 14.0]
    numbers = sorted(int(p.name.split("-")[1]) for p in tmp_path.glob("ckpt-*"))
    assert numbers == [6, 10, 15, 20]  # folders numbered by the job's pushes
    ckpt = checkpoint.load(tmp_path)
    assert ckpt.step["pushes"] == 20 and ckpt.manifest["config"]["host"] == "tiny"
    assert ckpt.manifest["config"]["runtime"] == "tiny"
    # records are still at their times: a checkpoint return is no record
    assert [r["time"] for r in result.records] == [0.0, 3.0, 6.0, 9.0, 12.0, 14.0]


def test_a_resumed_run_starts_at_the_checkpoint_and_ends_where_one_run_would(tmp_path):
    _, whole = _drive(steps=20)
    _drive(steps=10, checkpoint_dir=tmp_path)  # 10 pushes: spent at t=7
    _host, resumed = _drive(steps=20, checkpoint_dir=tmp_path, resume=True)
    assert resumed.records[0]["time"] == 7.0 and resumed.records[0]["pushes"] == 10
    assert [r["time"] for r in resumed.records] == [7.0, 9.0, 12.0, 14.0]
    assert resumed.pushes == 20 and resumed.time == whole.time == 14.0
    assert resumed.flat.tobytes() == whole.flat.tobytes()


def test_resume_refuses_a_checkpoint_of_another_job(tmp_path):
    _drive(steps=4, checkpoint_dir=tmp_path)
    other = sw.Job({"x": np.zeros(3)}, optimizer=sw.optim.adam(0.1))
    with pytest.raises(checkpoint.CheckpointError, match="another job: optimizer"):
        _drive(job=other, checkpoint_dir=tmp_path, resume=True)


def test_stop_at_ends_an_event_driven_run_at_that_record():
    host, result = _drive(steps=1000, stop_at={"loss": 1.0})
    assert host.stopped and result.stop_reason == "loss <= 1 reached"
    assert result.ended == "stop_at"
    assert result.records[-1]["loss"] <= 1.0 < result.records[-2]["loss"]
    assert result.time == result.records[-1]["time"] and result.pushes < 1000


def test_stop_at_lets_a_real_time_host_run_on_until_its_workers_end():
    host, result = _drive({"virtual": False}, steps=1000, stop_at={"loss": 1.0})
    assert host.stopped and result.stop_reason == "loss <= 1 reached"
    assert result.records[-1]["time"] == result.time  # the end's record, a tick later


def test_a_run_whose_workers_are_all_dropped_says_so():
    _host, result = _drive({"lose": True}, on_worker_failure="drop")
    assert (
        result.stop_reason == "every worker failed and was dropped, after 3 of 20 pushes"
    )  # at t=3
    assert result.ended == "no_workers"
    assert [e["action"] for e in result.failures] == ["dropped", "dropped"]


def test_a_worker_error_takes_a_checkpoint_to_resume_from_and_closes_the_host(tmp_path):
    job = _job()
    host = Host(job.config, fail_at=(5, 1))
    opts = _options(on_worker_failure="fail", checkpoint_dir=tmp_path)
    with pytest.raises(WorkerError, match=r"worker 1 failed: raised(.|\n)*resume=True"):
        driver.drive(host, job.config, job.strategy, opts)
    assert host.snapshots == [(5.0, True)] and host.closed
    assert checkpoint.load(tmp_path).step["pushes"] == _pushes_at(4) + 1  # worker 0's at t=5


def test_diverged_workers_with_no_one_left_raise_diverged_error():
    class Diverging(Host):
        def advance(self, until, due):
            if self.t == 0:
                for w in (0, 1):
                    self.run.failures.diverged(w, f"worker {w} diverged", time=0.0)
                return driver.END
            return super().advance(until, due)

        def diverged(self):
            return [0, 1]

    job = _job()
    with pytest.raises(DivergedError, match=r"worker\(s\) 0, 1 stopped .* after 0 of 20"):
        driver.drive(Diverging(job.config), job.config, job.strategy, _options())


def test_the_wall_clock_timeout_stops_a_run_that_goes_on():
    class Slow(Host):
        def advance(self, until, due):
            time.sleep(0.01)
            return driver.TICK

    job = _job()
    host = Slow(job.config, virtual=False)
    with pytest.raises(TimeoutError, match="did not finish within the timeout"):
        driver.drive(host, job.config, job.strategy, _options(timeout=0.1))
    assert host.closed
