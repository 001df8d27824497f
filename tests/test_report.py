"""Tests for stalewise.report: metrics files, time-to-target, plots and tables."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from stalewise.report import MetricsWriter, format_table, plot_runs, read_metrics, time_to_target


def _curve(run: str, speed: float, n: int = 20) -> list[dict]:
    return [
        {
            "run": run,
            "time": 0.5 * i,
            "updates": 10 * i,
            "loss": 2.0 * math.exp(-speed * i),
            "accuracy": 1.0 - 0.9 * math.exp(-speed * i),
            "staleness_mean": 1.5,
            "staleness_max": 4,
        }
        for i in range(n)
    ]


# ----------------------------------------------------------------------------- files


def test_round_trip_appends_and_converts_numpy(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    with MetricsWriter(path) as w:
        w.write({"run": "a", "time": np.float32(0.5), "updates": np.int64(3), "loss": 1.25})
        w.write({"run": "a", "time": 1.0, "loss": float("nan"), "hist": np.arange(3)})
    with MetricsWriter(path) as w:  # reopening appends
        w.write({"run": "b", "time": 0.0, "updates": 0, "loss": 2.0, "accuracy": None})
    records = read_metrics(path)
    assert len(records) == 3
    assert records[0] == {"run": "a", "time": 0.5, "updates": 3, "loss": 1.25}
    assert isinstance(records[0]["updates"], int)
    assert math.isnan(records[1]["loss"]) and records[1]["hist"] == [0, 1, 2]
    assert records[2]["accuracy"] is None
    assert path.read_text().count("\n") == 3


def test_records_are_flushed_before_close(tmp_path):
    path = tmp_path / "m.jsonl"
    w = MetricsWriter(path)
    w.write({"run": "a", "time": 0.0, "loss": 1.0})
    assert read_metrics(path) == [{"run": "a", "time": 0.0, "loss": 1.0}]
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.write({"run": "a"})


def test_writer_rejects_unserialisable_values(tmp_path):
    with MetricsWriter(tmp_path / "m.jsonl") as w, pytest.raises(TypeError):
        w.write({"run": "a", "bad": object()})


def test_read_skips_blank_and_truncated_last_lines(tmp_path, caplog):
    path = tmp_path / "m.jsonl"
    path.write_text('{"run": "a", "time": 0}\n\n{"run": "a", "time": 1}\n{"run": "a", "ti')
    with caplog.at_level(logging.WARNING, logger="stalewise.report"):
        records = read_metrics(path)
    assert [r["time"] for r in records] == [0, 1]
    assert "truncated" in caplog.text


def test_read_rejects_malformed_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"run": "a"}\nnot json\n{"run": "b"}\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2"):
        read_metrics(path)
    path.write_text('[1, 2]\n{"run": "b"}\n')
    with pytest.raises(ValueError, match="JSON object"):
        read_metrics(path)


# ----------------------------------------------------------------------------- time to target


def test_time_to_target_max_and_min():
    records = _curve("asp", speed=0.3)
    t_acc = time_to_target(records, "accuracy", 0.9)
    first = next(r for r in records if r["accuracy"] >= 0.9)
    assert t_acc == first["time"] and t_acc > 0
    t_loss = time_to_target(records, "loss", 0.1, mode="min")
    assert t_loss == next(r["time"] for r in records if r["loss"] <= 0.1)
    assert time_to_target(records, "loss", 0.1, mode="min", x="updates") == 20 * t_loss
    assert time_to_target(records, "accuracy", 0.999) is None
    assert time_to_target(records, "missing", 0.5, mode="max") is None
    assert time_to_target([], "loss", 0.5) is None


def test_time_to_target_selects_runs_and_orders_by_time():
    records = _curve("fast", 0.5) + _curve("slow", 0.1)
    with pytest.raises(ValueError, match="several runs"):
        time_to_target(records, "accuracy", 0.9)
    with pytest.raises(ValueError, match="no run 'other'"):
        time_to_target(records, "accuracy", 0.9, run="other")
    fast = time_to_target(records, "accuracy", 0.8, run="fast")
    slow = time_to_target(records, "accuracy", 0.8, run="slow")
    assert fast is not None and slow is not None and fast < slow
    shuffled = list(reversed(_curve("fast", 0.5)))
    assert time_to_target(shuffled, "accuracy", 0.8) == fast
    with pytest.raises(ValueError, match="mode"):
        time_to_target(records, "accuracy", 0.9, mode="up", run="fast")


def test_time_to_target_ignores_missing_and_nan_values():
    records = [
        {"run": "a", "time": 0.0, "loss": float("nan")},
        {"run": "a", "time": 1.0},
        {"run": "a", "time": 2.0, "loss": None},
        {"run": "a", "time": 3.0, "loss": 0.01},
    ]
    assert time_to_target(records, "loss", 0.1, mode="min") == 3.0


# ----------------------------------------------------------------------------- plots


def _is_png(path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_runs_writes_a_png(tmp_path):
    records = _curve("asp", 0.3) + _curve("ssp", 0.2)
    out = plot_runs(
        records,
        tmp_path / "plots" / "runs.png",
        title="digits, 4 workers",
        targets={"accuracy": 0.95},
    )
    assert out == tmp_path / "plots" / "runs.png"
    assert _is_png(out) and out.stat().st_size > 10_000


def test_plot_runs_skips_absent_keys_and_plots_against_updates(tmp_path):
    records = [{"run": "ls", "time": t, "updates": 5 * t, "loss": 10.0**-t} for t in range(6)]
    out = plot_runs(records, tmp_path / "ls.png", x="updates", keys=("accuracy", "loss"))
    assert _is_png(out) and out.stat().st_size > 5_000
    with pytest.raises(ValueError, match="none of the keys"):
        plot_runs(records, tmp_path / "none.png", keys=("accuracy",))
    assert not (tmp_path / "none.png").exists()


# ----------------------------------------------------------------------------- tables


def test_format_table_aligns_and_formats():
    rows = [
        {"run": "asp", "workers": 4, "accuracy": 0.96123, "time": 12.3456, "lr": 1e-4},
        {"run": "ssp-bound-4", "workers": 16, "accuracy": None, "time": 1234.5, "lr": 0.05},
        {"run": "bsp", "workers": 128, "time": float("nan"), "lr": 2_500_000.0},
    ]
    table = format_table(rows, ["run", "workers", "accuracy", "time", "lr"])
    lines = table.split("\n")
    assert len(lines) == 5
    assert lines[0].split() == ["run", "workers", "accuracy", "time", "lr"]
    assert set(lines[1].replace(" ", "")) == {"-"}
    assert lines[2].split() == ["asp", "4", "0.9612", "12.35", "1.000e-04"]
    assert lines[3].split() == ["ssp-bound-4", "16", "—", "1234.5", "0.05"]
    assert lines[4].split() == ["bsp", "128", "—", "nan", "2.500e+06"]
    assert lines[2].startswith("asp ")  # text left-aligned
    col_end = lines[0].index("workers") + len("workers")
    assert all(line[col_end - 1] != " " for line in lines[2:])  # numbers right-aligned
    assert len({len(line) for line in lines[:2]}) == 1


def test_format_table_handles_numpy_bools_and_empty_rows():
    table = format_table([{"a": np.float32(0.5), "b": np.int64(7), "c": True}], ["a", "b", "c"])
    assert table.split("\n")[2].split() == ["0.5", "7", "True"]
    assert format_table([], ["run", "loss"]).split("\n") == ["run  loss", "---  ----"]
