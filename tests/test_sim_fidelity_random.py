"""benchmarks/sim_fidelity.py --random: the drawing (deterministic, covering the stated
space's bounds) and that every drawn setting makes a valid job; no timing assertions."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import stalewise as sw
from stalewise import calibrate
from stalewise.runtime.sim.models import Contention

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))  # the script imports _report as a sibling
_spec = importlib.util.spec_from_file_location(
    "sim_fidelity", ROOT / "benchmarks" / "sim_fidelity.py"
)
fid = importlib.util.module_from_spec(_spec)
sys.modules["sim_fidelity"] = fid  # dataclasses look their module up
_spec.loader.exec_module(fid)


def test_the_draw_is_deterministic_for_a_seed():
    assert fid.draw(10, 1) == fid.draw(10, 1)
    assert fid.draw(10, 1) != fid.draw(10, 2)
    assert fid.draw(3, 1) == fid.draw(10, 1)[:3]  # a longer draw extends a shorter one


def test_the_draw_covers_the_space_and_stays_inside_it():
    drawn = fid.draw(400, 0)
    space = fid.SPACE

    def span(values):
        return min(values), max(values)

    assert span([d.workers for d in drawn]) == space["workers"]
    assert span([d.shards for d in drawn]) == space["shards"]
    assert {d.consistency for d in drawn} == set(space["consistency"])
    assert span([d.bound for d in drawn if d.consistency == "SSP"]) == space["ssp_bound"]
    assert span([len(d.stragglers) for d in drawn]) == space["stragglers"]
    slow = [f for d in drawn for _, f in d.stragglers]
    low, high = space["slowdown"]
    assert low <= min(slow) < low + 0.1 and high - 0.1 < max(slow) <= high
    for d in drawn:
        assert len(d.stragglers) < d.workers  # at least one worker at full speed
        assert [w for w, _ in d.stragglers] == list(range(d.workers - len(d.stragglers), d.workers))
    p_low, p_high = space["parameters"]
    params = [d.parameters for d in drawn]
    assert all(p_low - 75 <= p <= p_high + 75 for p in params)
    assert min(params) < 1.2 * p_low and max(params) > p_high / 1.2  # log-uniform: both ends
    assert {d.codec for d in drawn} == set(space["codec"])
    assert {d.strategy for d in drawn} == set(space["strategy"])
    assert span([d.local_steps for d in drawn if d.strategy == "diloco"]) == space["local_steps"]
    assert all(d.local_steps == 1 for d in drawn if d.strategy == "gradients")
    delays = [d.delay for d in drawn]
    assert 0 <= min(delays) < 0.001 and 0.019 < max(delays) <= 0.020
    for d in drawn:
        assert d.parameters == 75 * d.hidden + 10 and 0.05 <= d.eval_interval <= 0.25


def _small(d):
    """``d`` with its MLP narrowed (the job's kind unchanged), for a fast test."""
    import dataclasses

    return dataclasses.replace(d, hidden=8, parameters=75 * 8 + 10)


@pytest.mark.parametrize("i", range(10))
def test_every_drawn_setting_builds_a_valid_job(i):
    d = fid.draw(10, 1)[i]
    task = fid.drawn_task(d)
    job = fid.drawn_job(d, task)
    assert job.config.shards == d.shards and job.config.spec.size == d.parameters
    assert job.config.consistency.kind == d.consistency.lower()
    assert (job.strategy.name != "gradients") == (d.strategy == "diloco")
    opts = fid.drawn_run(d, steps=100)
    assert opts["workers"] == d.workers
    assert opts["emulation"].stragglers == (dict(d.stragglers) or None)


def test_drawn_settings_run_in_the_simulator_with_an_interval():
    """Each kind of drawn setting (every consistency model, both strategies, a codec and
    stragglers among them), narrowed, runs in the simulator on a hand-made calibration's
    three tables; the interval brackets the point."""
    steps = ((0.002, 0.0025, 0.003, 0.004),) * 8
    flat = calibrate.Fit.of([(4096, 5e-5), (16384, 6e-5)])
    spreads = tuple(
        (calibrate._key(k, b), calibrate.Spread.of([4e-5, 5e-5, 7e-5]))
        for k in ("apply", "message") for b in (4096, 16384)
    )  # fmt: skip
    drawn = fid.draw(40, 3)
    kinds = {}
    for d in drawn:
        kinds.setdefault((d.consistency, d.strategy), d)
    assert len(kinds) == 8
    for d in kinds.values():
        d = _small(d)
        task = fid.drawn_task(d)
        job = fid.drawn_job(d, task)
        cal = calibrate.Calibration(d.workers, 1, steps[: d.workers], flat, flat, flat, flat,
                                    4096, spreads=spreads)  # fmt: skip

        def predict(sim, d=d, task=task, job=job):
            opts = fid.drawn_run(d, steps=6 * d.workers)
            r = job.train(task.loss_and_grad, runtime=sw.Simulation(sim), **opts)
            return fid.figures(r, "loss", math.inf, "min")

        got = cal.interval(predict)
        for key in ("updates/s", "staleness", "time_to_target"):
            iv = got[key]
            assert iv is not None and iv.low <= iv.point <= iv.high, (d.name, key)


def test_halfway_target_and_errors():
    recs = [{"time": 0, "loss": 2.0}, {"time": 1, "loss": 1.0}, {"time": 2, "loss": 1.5}]
    assert fid.halfway_target(recs) == 1.5
    assert fid.halfway_target([{"time": 0, "loss": 2.0}, {"time": 1, "loss": 2.5}]) is None
    assert fid._error("updates/s", 110.0, 100.0) == pytest.approx(0.1)
    assert fid._error("staleness", 0.5, 0.4) == pytest.approx(0.1)  # absolute below 1 version
    assert fid._error("time_to_target", None, 1.0) is None


def test_each_setting_is_simulated_with_and_without_the_contention_model():
    flat = calibrate.Fit.of([(4096, 5e-5), (16384, 6e-5)])
    con = Contention(step=(1.0, 2.0), apply=(1.0, 1.5))
    walls, cpus = ((0.004, 0.005, 0.006),) * 2, ((0.002, 0.0025, 0.003),) * 2
    cal = calibrate.Calibration(2, 1, walls, flat, flat, flat, flat, 4096, contention=con,
                                cpu_times=cpus)  # fmt: skip
    (a, measured), (b, spread), (c, plain) = fid.tables(cal)
    assert (a, b, c) == ("", fid.WALL, fid.PLAIN) and measured is cal
    assert measured.sim_config().contention == spread.sim_config().contention == con
    assert plain.sim_config().contention is None
    assert measured.sim_config().compute.shift == 0.002  # the CPU times, stretched by con
    assert spread.sim_config().compute.shift == 0.002  # the wall times at the CPU times' mean
    assert plain.sim_config().compute.shift == 0.004  # the wall-clock times


@pytest.mark.parametrize("missed, code", [(2, 0), (3, 1)])
def test_seeds_from_the_clock_each_run_once_and_recorded(tmp_path, monkeypatch, missed, code):
    """--random 10 --seeds 2: two seeds drawn from the clock, each seed's 10 settings run
    once (the run of a setting stubbed: this checks the bookkeeping), all in one JSON, a bar
    per seed: 8 of 10. The settings' figures are the real benchmark's business."""
    ran = []

    def run_drawn(i, d):
        ran.append(d)
        return {"#": i, "setting": d.name, "ok": i >= missed}

    monkeypatch.setattr(fid, "run_drawn", run_drawn)
    monkeypatch.setattr(sys, "argv", ["sim_fidelity.py", "--random", "10", "--seeds", "2",
                                      "--check", "--json", str(tmp_path / "f.json")])  # fmt: skip
    assert fid.main() == code
    doc = json.loads((tmp_path / "f.json").read_text())
    seeds = doc["figures"]["seeds"]
    assert len(seeds) == 2 and seeds[0] != seeds[1] and all(0 <= s < 2**32 for s in seeds)
    assert [r["seed"] for r in doc["figures"]["runs"]] == seeds
    assert ran == fid.draw(10, seeds[0]) + fid.draw(10, seeds[1])  # each seed's draw, once
    assert [len(r["rows"]) for r in doc["figures"]["runs"]] == [10, 10]
    assert [b["met"] for b in doc["bars"]] == [code == 0] * 2
    assert [b["value"] for b in doc["bars"]] == [10 - missed] * 2


def test_seeds_and_a_seed_do_not_go_together(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["sim_fidelity.py", "--random", "10", "--seeds", "2",
                                      "--seed", "1"])  # fmt: skip
    with pytest.raises(SystemExit):
        fid.main()
    assert "--seeds 2: expected an integer >= 1, with --random, without --seed" in (
        capsys.readouterr().err
    )


def test_evaluations_place_an_outer_update_within_one_record():
    """Records every RECORD_EVERY s of a model evaluated every 4 records: still parameters
    repeat the last figures, a change after a still record is evaluated at once, other
    changes wait for the interval (no loss in between); time_to then finds a jump
    within one record of where it happened."""
    calls = []

    def evaluate(p):
        calls.append(float(p["w"][0]))
        return {"loss": 10.0 - float(p["w"][0])}

    ev = fid.Evaluations(evaluate, 4 * fid.RECORD_EVERY)
    values = [0, 0, 0, 1, 2, 3, 4, 5, 6, 6, 7]
    got = [ev({"w": np.full(3, v, np.float32)}) for v in values]
    assert calls == [0, 1, 5, 6, 7]  # the first; after a still record; the interval; still
    assert [g.get("loss") for g in got] == [10, 10, 10, 9, None, None, None, 5, None, 4, 3]
    records = [{"time": i * fid.RECORD_EVERY, **g} for i, g in enumerate(got)]
    assert fid.time_to(records, "loss", 9.5, "min") == pytest.approx(2.5 * fid.RECORD_EVERY)


@pytest.mark.parametrize("warm_up", [False, True])
def test_the_first_change_of_a_run_is_evaluated_at_once_after_a_warm_up_or_none(warm_up):
    """The local run's driver evaluates once before its clock starts (a warm-up), the
    simulator does not: the first record whose parameters moved is evaluated at once in
    both (without the warm-up it waited for the interval: 0.2 s for the widest MLPs)."""
    calls = []
    ev = fid.Evaluations(lambda p: calls.append(float(p["w"][0])) or {"loss": 1.0}, 0.2)
    if warm_up:
        ev({"w": np.zeros(3, np.float32)})
    got = [ev({"w": np.full(3, v, np.float32)}) for v in (0, 1, 2)]
    assert calls == [0, 1] and [g.get("loss") for g in got] == [1.0, 1.0, None]
