"""Tests for stalewise.targets: one notion of "target reached", used everywhere."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from stalewise import config, report
from stalewise import sweep as sweep_lib
from stalewise.cli import main
from stalewise.runtime.result import Recorder
from stalewise.targets import Target, all_reached, infer_mode, parse, time_to_target

ROOT = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------- direction


@pytest.mark.parametrize(
    ("metric", "mode"),
    [
        ("loss", "min"),
        ("train_loss", "min"),
        ("val_loss", "min"),
        ("valLoss", "min"),
        ("valloss", "min"),
        ("accumulated_loss", "min"),  # "acc" inside a word is not an accuracy
        ("error", "min"),
        ("error_rate", "min"),
        ("top1_err", "min"),
        ("top1err", "min"),
        ("perplexity", "min"),
        ("test/ppl", "min"),
        ("mse", "min"),
        ("RMSE", "min"),
        ("mae", "min"),
        ("nll", "min"),
        ("time", "min"),
        ("wall_time", "min"),
        ("time_to_target", "min"),
        ("distance", "min"),
        ("accuracy", "max"),
        ("top5_accuracy", "max"),
        ("acc", "max"),
        ("val_acc", "max"),
        ("acc1", "max"),
        ("valAccuracy", "max"),
        ("f1", "max"),
        ("macro-f1", "max"),
        ("f1_score", "max"),
        ("auc", "max"),
        ("roc_auc", "max"),
        ("precision", "max"),
        ("recall@10", "max"),
        ("score", "max"),
        ("bleu", "max"),
        ("r2", "max"),
        ("episode_reward", "max"),
        ("neg_log_loss", "max"),  # scikit-learn's negated losses go up
        ("neg_mean_squared_error", "max"),
    ],
)
def test_direction_is_inferred_from_the_name(metric, mode):
    assert infer_mode(metric) == mode
    assert Target(metric, 0.5).mode == mode


@pytest.mark.parametrize(
    "metric", ["progress", "lr", "staleness_mean", "layer2", "uptime", "accumulated"]
)
def test_unknown_metric_names_raise_and_say_how_to_fix_it(metric):
    with pytest.raises(ValueError, match=rf"{metric!r}.*mode='min'.*mode='max'"):
        Target(metric, 1.0)


def test_a_name_pointing_both_ways_is_ambiguous():
    with pytest.raises(ValueError, match=r"'time_to_accuracy' is ambiguous.*mode='min'"):
        infer_mode("time_to_accuracy")
    assert Target("time_to_accuracy", 10.0, mode="min").mode == "min"


def test_mode_overrides_the_name():
    assert Target("loss", 0.5, mode="max").mode == "max"
    assert Target("accuracy", 0.5, "min").reached(0.1)
    assert Target("progress", 0.5, "max").reached(0.7)
    assert Target("loss", 0.5) == Target("loss", 0.5, "min")  # the inferred mode is stored
    with pytest.raises(ValueError, match="mode must be 'min' or 'max', got 'up'"):
        Target("loss", 0.5, "up")  # type: ignore[arg-type]


def test_reached_and_str():
    loss, acc = Target("loss", 1e-3), Target("accuracy", 0.95)
    assert str(loss) == "loss <= 0.001" and str(acc) == "accuracy >= 0.95"
    assert loss.reached(1e-3) and loss.reached(1e-4) and not loss.reached(0.5)
    assert acc.reached(0.95) and acc.reached(np.float32(0.99)) and not acc.reached(0.9)
    for bad in (math.nan, math.inf, -math.inf, None, "0.99", True):
        assert not loss.reached(bad) and not acc.reached(bad)


@pytest.mark.parametrize(
    ("metric", "value", "message"),
    [
        ("", 1.0, "non-empty name"),
        ("  ", 1.0, "non-empty name"),
        (None, 1.0, "non-empty name"),
        ("loss", "0.1", "finite number, got '0.1'"),
        ("loss", True, "finite number, got True"),
        ("loss", math.nan, "finite number, got nan"),
    ],
)
def test_bad_targets_are_rejected(metric, value, message):
    with pytest.raises(ValueError, match=message):
        Target(metric, value)


def test_targets_are_frozen_values():
    t = Target("loss", 1)
    assert isinstance(t.value, float) and hash(t) == hash(Target("loss", 1.0, "min"))
    with pytest.raises(AttributeError):
        t.value = 2.0  # type: ignore[misc]


# ----------------------------------------------------------------------------- parse


def test_parse_accepts_every_form():
    loss, acc = Target("loss", 1e-3), Target("accuracy", 0.9)
    assert parse(None) == () and parse({}) == ()
    assert parse(acc) == (acc,)
    assert parse([loss, acc]) == (loss, acc) and parse((acc,)) == (acc,)
    assert parse({"loss": 1e-3, "accuracy": 0.9}) == (loss, acc)
    assert parse({"progress": (0.5, "max")}) == (Target("progress", 0.5, "max"),)
    assert parse({"progress": [0.5, "min"]}) == (Target("progress", 0.5, "min"),)
    assert parse({"progress": {"value": 2, "mode": "max"}}) == (Target("progress", 2.0, "max"),)
    assert parse({"loss": {"value": 0.1}}) == (Target("loss", 0.1, "min"),)
    assert parse({"accuracy": (0.9, None)}) == (acc,)
    assert parse({"accuracy": np.float64(0.9)}) == (acc,)


@pytest.mark.parametrize(
    ("stop_at", "error", "message"),
    [
        (0.95, TypeError, r"stop_at=0\.95: expected a mapping"),
        ("accuracy", TypeError, r"stop_at='accuracy': expected a mapping"),
        ({"accuracy": "high"}, ValueError, r"stop_at\.accuracy: .*must be a number, got 'high'"),
        ({"accuracy": True}, ValueError, r"stop_at\.accuracy: .*must be a number, got True"),
        ({"accuracy": None}, ValueError, r"stop_at\.accuracy: .*must be a number, got None"),
        ({"accuracy": (0.9, "max", 1)}, TypeError, r"stop_at\.accuracy: expected"),
        ({"accuracy": {"value": 0.9, "dir": "up"}}, TypeError, r"stop_at\.accuracy: expected"),
        ({"accuracy": (0.9, "up")}, ValueError, r"stop_at\.accuracy: .*mode must be"),
        ({"accuracy": math.inf}, ValueError, r"stop_at\.accuracy: .*finite number"),
        ({"": 0.9}, ValueError, r"stop_at: metric names must be non-empty strings, got ''"),
        ({1: 0.9}, ValueError, r"stop_at: metric names must be non-empty strings, got 1"),
        ({"progress": 0.5}, ValueError, r"stop_at\.progress: cannot tell.*mode='min'"),
        ([Target("loss", 0.1), {"accuracy": 0.9}], TypeError, r"stop_at\[1\]: expected a Target"),
    ],
)
def test_parse_rejects_bad_forms_naming_the_entry(stop_at, error, message):
    with pytest.raises(error, match=message):
        parse(stop_at)


def test_parse_names_the_setting_and_asks_for_a_direction_it_cannot_infer():
    with pytest.raises(ValueError, match=r"^run\.stop_at\.loss: "):
        parse({"loss": "low"}, where="run.stop_at")
    with pytest.raises(ValueError, match=r"^stop_at\.progress: .*mode='min'.*mode='max'"):
        parse({"progress": -0.1})
    assert parse({"progress": (-0.1, "max")}) == (Target("progress", -0.1, "max"),)


def test_all_reached():
    ts = parse({"loss": 0.1, "accuracy": 0.9})
    assert all_reached(ts, {"loss": 0.05, "accuracy": 0.95})
    assert not all_reached(ts, {"loss": 0.5, "accuracy": 0.95})
    assert not all_reached(ts, {"loss": 0.05, "accuracy": 0.5})
    assert not all_reached(ts, {"loss": 0.05})  # a missing metric is not reached
    assert not all_reached(ts, {"loss": math.nan, "accuracy": 0.95})
    assert not all_reached((), {"loss": 0.0})  # nothing to reach: never stop


# ----------------------------------------------------------------------------- Recorder


_STATS = {"version": 1, "staleness_mean": 0.0, "staleness_max": 0}


def _record(rec: Recorder, **metrics) -> bool:
    return rec.record(1.0, 1, _STATS, 0.0, lambda params: metrics, dict)


def test_recorder_stops_at_a_loss_target_when_it_drops_to_it():
    rec = Recorder("run", 100, stop_at={"loss": 1e-3})
    assert not _record(rec, loss=0.5)
    assert not _record(rec, loss=math.nan)
    assert _record(rec, loss=1e-4)


def test_recorder_stops_at_an_accuracy_target_when_it_climbs_to_it():
    rec = Recorder("run", 100, stop_at={"accuracy": 0.9})
    assert not _record(rec, accuracy=0.5, loss=0.01)
    assert _record(rec, accuracy=0.95, loss=2.0)
    both = Recorder("run", 100, stop_at=[Target("loss", 0.1), Target("accuracy", 0.9)])
    assert not _record(both, loss=0.05, accuracy=0.5)
    assert not _record(both, loss=0.5, accuracy=0.95)
    assert _record(both, loss=0.05, accuracy=0.95)


def test_recorder_without_targets_never_stops_and_rejects_bad_ones():
    assert not _record(Recorder("run", 100), loss=0.0)
    assert not _record(Recorder("run", 100, stop_at={}), loss=0.0)
    with pytest.raises(TypeError, match=r"stop_at=0\.95"):
        Recorder("run", 100, stop_at=0.95)


def test_recorder_follows_an_explicit_direction():
    rec = Recorder("run", 100, stop_at={"progress": (-0.1, "max")})
    assert not _record(rec, progress=-0.5)
    assert _record(rec, progress=-0.05)
    with pytest.raises(ValueError, match=r"stop_at\.progress"):
        Recorder("run", 100, stop_at={"progress": -0.1})


# ----------------------------------------------------------------------------- time to target


def _curve(run: str = "a") -> list[dict]:
    return [
        {"run": run, "time": 0.5 * i, "updates": 10 * i, "loss": 1 / (1 + i), "accuracy": i / 10}
        for i in range(10)
    ]


def test_time_to_target_min_and_max():
    recs = _curve()
    assert time_to_target(recs, Target("loss", 0.2)) == 2.0  # 1 / (1 + 4) at i = 4
    assert time_to_target(recs, Target("loss", 0.2), x="updates") == 40
    assert time_to_target(recs, Target("accuracy", 0.75)) == 4.0  # 0.8 at i = 8
    assert time_to_target(recs, Target("loss", 1e-3)) is None
    assert time_to_target(recs, Target("accuracy", 1.5)) is None
    assert time_to_target(recs, Target("loss", 0.2, mode="max")) == 0.0
    assert time_to_target(list(reversed(recs)), Target("accuracy", 0.75)) == 4.0
    assert time_to_target([], Target("loss", 0.1)) is None


def test_time_to_target_picks_the_run_and_skips_nan():
    recs = _curve("a") + _curve("b")
    with pytest.raises(ValueError, match="several runs"):
        time_to_target(recs, Target("loss", 0.2))
    with pytest.raises(ValueError, match="no run 'c'"):
        time_to_target(recs, Target("loss", 0.2), run="c")
    assert time_to_target(recs, Target("loss", 0.2), run="b") == 2.0
    nan = [{"time": 0.0, "loss": math.nan}, {"time": 1.0, "loss": 0.01}]
    assert time_to_target(nan, Target("loss", 0.1)) == 1.0
    with pytest.raises(TypeError, match="must be a Target"):
        time_to_target(recs, {"loss": 0.2}, run="a")  # type: ignore[arg-type]


def test_report_time_to_target_delegates_and_infers_the_mode():
    recs = _curve()
    assert report.time_to_target(recs, "loss", 0.2) == time_to_target(recs, Target("loss", 0.2))
    assert report.time_to_target(recs, "loss", 0.2, mode="min") == 2.0
    assert report.time_to_target(recs, "accuracy", 0.75) == 4.0
    assert report.time_to_target(recs, "loss", 0.2, "max", x="updates") == 0
    with pytest.raises(ValueError, match=r"'progress'.*mode='min'"):
        report.time_to_target(recs, "progress", 0.5)


# ----------------------------------------------------------------------------- config and CLI


def test_config_stop_at_is_parsed_to_targets_and_errors_name_the_key():
    task = {"name": "least-squares", "args": {"n": 32, "d": 4}}
    opt = {"name": "sgd", "lr": 0.1}
    cfg = config.parse({"task": task, "optimizer": opt, "run": {"stop_at": {"loss": 1e-3}}})
    assert cfg.train["stop_at"] == (Target("loss", 1e-3, "min"),)
    cfg = config.parse(
        {"task": task, "optimizer": opt, "run": {"stop_at": {"distance": [0.1, "min"]}}}
    )
    assert cfg.train["stop_at"] == (Target("distance", 0.1, "min"),)
    assert config.parse({"task": task, "optimizer": opt}).train["stop_at"] is None
    with pytest.raises(config.ConfigError, match=r"run\.stop_at\.loss: .*got 'low'"):
        config.parse({"task": task, "optimizer": opt, "run": {"stop_at": {"loss": "low"}}})
    with pytest.raises(config.ConfigError, match=r"run\.stop_at=0\.5"):
        config.parse({"task": task, "optimizer": opt, "run": {"stop_at": 0.5}})
    with pytest.raises(config.ConfigError, match=r"run\.stop_at\.loss: .*mode must be"):
        config.parse(
            {
                "task": task,
                "optimizer": opt,
                "run": {"stop_at": {"loss": {"value": 1, "mode": "down"}}},
            }
        )


def test_sim_cli_infers_max_for_an_accuracy_target(tmp_path, capsys, monkeypatch):
    """Regression: ``--metric accuracy --target 0.9`` kept ``--mode min``: every time was 0."""
    rows = []
    run_sweep = sweep_lib.sweep

    def spy(*args, **kwargs):
        rows.extend(run_sweep(*args, **kwargs))
        return rows

    monkeypatch.setattr(sweep_lib, "sweep", spy)
    argv = ["sim", str(ROOT / "examples" / "digits.toml"), "--values", "1,2"]
    argv += ["--metric", "accuracy", "--target", "0.9", "--out", str(tmp_path), "-q"]
    assert main(argv) == 0
    assert [r["workers"] for r in rows] == [1, 2]
    times = [r["time_to_target"] for r in rows]
    assert any(t is not None and t > 0 for t in times), times
    for r in rows:  # each run stopped at (or ran out before) its first accuracy >= 0.9
        assert r["time_to_target"] is None or r["final"] >= 0.9
    assert "time_to_target" in capsys.readouterr().out


def test_sim_cli_reports_a_metric_without_a_direction(capsys):
    argv = ["sim", str(ROOT / "examples" / "digits.toml"), "--values", "1"]
    assert main([*argv, "--metric", "progress", "--target", "0.9", "-q"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and "'progress'" in err and "mode='max'" in err


def test_sweep_infers_the_direction_and_checks_the_mode():
    class NoTask:  # the mode is checked before anything runs
        pass

    with pytest.raises(ValueError, match="mode must be 'min' or 'max'"):
        sweep_lib.sweep(None, NoTask(), over="workers", values=[1], steps=1, target=1, mode="up")
    with pytest.raises(ValueError, match=r"'progress'.*mode='min'"):
        sweep_lib.sweep(
            None, NoTask(), over="workers", values=[1], steps=1, target=1.0, metric="progress"
        )


def test_progress_says_why_a_run_stopped_in_plain_lines_when_not_a_terminal(capsys):
    """Output that is not a terminal gets a few plain lines, not a redrawn bar."""
    import stalewise as sw
    from stalewise import tasks

    task = tasks.get("least-squares", n=64, d=4)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1))
    run = job.train(
        task.loss_and_grad,
        data=task.batches,
        evaluate=task.evaluate,
        workers=4,
        steps=5000,
        runtime="sim",
        stop_at={"loss": 1e-2},
        metrics=sw.Metrics(every=0.05, progress=True),
    )
    err = capsys.readouterr().err  # pytest's capture is not a terminal
    lines = err.strip().splitlines()
    assert "\r" not in err and len(lines) <= 5, lines
    assert lines[-1] == f"run: stopped after {run.pushes} pushes: loss <= 0.01 reached"
    sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1)).train(
        task.loss_and_grad,
        data=task.batches,
        workers=2,
        steps=30,
        runtime="sim",
        metrics=sw.Metrics(progress=True),
    )
    assert (
        capsys.readouterr()
        .err.strip()
        .splitlines()[-1]
        .endswith("stopped after 30 pushes: the budget of 30 pushes is spent")
    )
