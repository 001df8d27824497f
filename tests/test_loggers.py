"""Loggers: records in real TensorBoard event files, read back; failing loggers; the CLI flag."""

import itertools
import logging
import math
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

import stalewise as sw
from stalewise import report, tasks
from stalewise.cli import main
from stalewise.loggers import TensorBoardLogger

DOCS = Path(__file__).resolve().parent.parent / "docs" / "loggers.md"

SMALL_CONFIG = """
[task]
name = "least-squares"
args = { n = 128, d = 8 }

[optimizer]
name = "sgd"
lr = 0.05

[server]
consistency = "asp"

[run]
workers = 2
steps = 150
delay = 0.002
eval_interval = 0.05
"""


def read_events(logdir):
    """Every event file in ``logdir`` parsed as TFRecords, checksums checked.

    Returns ``({tag: [(step, value), ...] in file order}, {tag: (step, HistogramProto)})``.
    """
    scalars, histograms = {}, {}
    files = sorted(Path(logdir).glob("events.out.tfevents.*"))
    assert files, f"no event file in {logdir}"
    for path in files:
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            header = data[pos : pos + 8]
            (n,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == masked_crc32c(header)
            body = data[pos + 12 : pos + 12 + n]
            assert struct.unpack("<I", data[pos + 12 + n : pos + 16 + n])[0] == masked_crc32c(body)
            pos += 16 + n
            event = event_pb2.Event.FromString(body)
            for value in event.summary.value:
                if value.HasField("histo"):
                    histograms[value.tag] = (event.step, value.histo)
                else:
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars, histograms


def expected_scalars(records):
    """What a TensorBoardLogger should have written for these records, per tag in order."""
    out = {}
    for r in records:
        for k, v in r.items():
            if k not in ("run", "pushes") and math.isfinite(v):
                out.setdefault(k, []).append((r["pushes"], v))
    out["pushes_per_s"] = [
        (b["pushes"], (b["pushes"] - a["pushes"]) / (b["time"] - a["time"]))
        for a, b in itertools.pairwise(records)
        if b["time"] > a["time"]
    ]
    return out


def assert_matches(scalars, records):
    expected = expected_scalars(records)
    assert set(scalars) == set(expected)
    for tag, points in expected.items():
        assert [s for s, _ in scalars[tag]] == [s for s, _ in points], tag
        # TensorBoard stores float32
        assert [v for _, v in scalars[tag]] == pytest.approx([v for _, v in points], rel=1e-6), tag


def assert_histogram_matches(histogram, stats):
    """The staleness histogram holds every applied push once, at its staleness."""
    h = histogram
    assert h.num == sum(h.bucket) == stats["applied"]
    assert list(h.bucket_limit) == [t + 0.5 for t in range(len(h.bucket))]
    assert {t: int(c) for t, c in enumerate(h.bucket) if c} == stats["staleness_counts"]
    assert h.max == stats["staleness_max"]
    assert h.sum / h.num == pytest.approx(stats["staleness_mean"])


def test_scalars_and_staleness_histogram_match_the_records_in_the_simulator(tmp_path):
    task = tasks.get("digits", hidden=16)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1))
    with report.MetricsWriter(tmp_path / "metrics.jsonl") as writer:
        result = job.train(
            task.loss_and_grad,
            data=task.batches,
            evaluate=task.evaluate,
            workers=4,
            steps=300,
            runtime="sim",
            # one logger need not be in a list
            metrics=sw.Metrics(
                0.05, on_record=writer.write, loggers=TensorBoardLogger(tmp_path / "tb")
            ),
        )
    records = report.read_metrics(tmp_path / "metrics.jsonl")
    assert len(records) == len(result.records) >= 5
    scalars, histograms = read_events(tmp_path / "tb")
    assert {"loss", "accuracy", "pushes_per_s", "staleness_mean", "train_loss"} <= set(scalars)
    assert_matches(scalars, records)
    step, histogram = histograms["staleness"]
    assert step == result.pushes == 300
    assert_histogram_matches(histogram, result.stats)
    assert histogram.max >= 1  # 4 asynchronous workers: some pushes were stale


class Exploding:
    """A logger whose dashboard is down."""

    def __init__(self):
        self.calls = 0
        self.closed = False

    def log(self, record):
        self.calls += 1
        raise RuntimeError("dashboard down")

    def close(self):
        self.closed = True


def test_a_failing_logger_is_dropped_with_one_warning_and_training_goes_on(
    tmp_path, caplog, no_leaks
):
    task = tasks.get("least-squares", n=64, d=4)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.05))
    bad, seen = Exploding(), []
    with caplog.at_level(logging.WARNING, logger="stalewise.loggers"):
        result = job.train(
            task.loss_and_grad,
            data=task.batches,
            workers=2,
            steps=200,
            emulation=sw.Emulation(delays={0: 0.002, 1: 0.002}),
            metrics=sw.Metrics(
                every=0.02, loggers=[bad, seen.append, TensorBoardLogger(tmp_path / "tb")]
            ),
            timeouts=sw.Timeouts(total=120),
        )
    assert result.pushes >= 200
    assert bad.calls == 1 and bad.closed  # left out after the first failure, closed at the end
    warnings = [r.getMessage() for r in caplog.records if "Exploding" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "RuntimeError: dashboard down" in warnings[0] and "left out" in warnings[0]
    assert seen == result.records and len(seen) >= 2  # the loggers after it got every record
    scalars, histograms = read_events(tmp_path / "tb")
    assert_matches(scalars, result.records)
    assert_histogram_matches(histograms["staleness"][1], result.stats)


def _fails(params, batch):
    raise ValueError("bad batch")


class Recording:
    def __init__(self):
        self.events = []

    def log(self, record):
        self.events.append("log")

    def finish(self, result):
        self.events.append(("finish", result.pushes))

    def close(self):
        self.events.append("close")


def test_finish_after_a_run_close_however_it_ends():
    task = tasks.get("least-squares", n=64, d=4)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.05))
    kw = dict(data=task.batches, workers=2, steps=20, runtime="sim")
    ok = Recording()
    job.train(task.loss_and_grad, metrics=sw.Metrics(loggers=[ok]), **kw)
    assert ok.events[-2:] == [("finish", 20), "close"] and "log" in ok.events
    failed = Recording()
    with pytest.raises(sw.WorkerError, match="bad batch"):
        job.train(_fails, metrics=sw.Metrics(loggers=[failed]), **kw)
    assert failed.events[-1] == "close" and not any(isinstance(e, tuple) for e in failed.events)


def test_bad_loggers_are_refused_by_index(tmp_path):
    task = tasks.get("least-squares", n=64, d=4)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.05))
    kw = dict(data=task.batches, workers=1, steps=5, runtime="sim")
    with pytest.raises(TypeError, match=r"loggers\[1\]: expected a function f\(record\) .*int 3"):
        job.train(task.loss_and_grad, metrics=sw.Metrics(loggers=[print, 3]), **kw)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="logdir: cannot make the folder"):
        TensorBoardLogger(tmp_path / "file")
    with pytest.raises(ValueError, match="flush_secs must be"):
        TensorBoardLogger(tmp_path / "tb", flush_secs=0)


def test_cli_tensorboard_writes_the_metrics_records(tmp_path, capsys, no_leaks):
    cfg = tmp_path / "small.toml"
    cfg.write_text(textwrap.dedent(SMALL_CONFIG))
    out, board = tmp_path / "run", tmp_path / "tb"
    assert main(["train", str(cfg), "--out", str(out), "--tensorboard", str(board), "-q"]) == 0
    assert f"tensorboard: {board / 'run'} (tensorboard --logdir {board})" in capsys.readouterr().out
    records = report.read_metrics(out / "metrics.jsonl")
    assert len(records) >= 2 and records[-1]["pushes"] >= 150
    scalars, histograms = read_events(board / "run")  # one TensorBoard run per run folder
    assert_matches(scalars, records)
    last = records[-1]
    step, histogram = histograms["staleness"]
    assert step == last["pushes"] and histogram.num == last["updates"]  # ASP: one update a push
    assert histogram.max == last["staleness_max"]
    assert histogram.sum / histogram.num == pytest.approx(last["staleness_mean"])


def _one_error_line(capsys):
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("stalewise: --tensorboard: "), lines[0]
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


def test_cli_tensorboard_errors_are_one_line_before_anything_starts(tmp_path, capsys, monkeypatch):
    cfg = tmp_path / "small.toml"
    cfg.write_text(textwrap.dedent(SMALL_CONFIG))
    out = tmp_path / "run"
    (tmp_path / "file").write_text("")
    argv = ["train", str(cfg), "--out", str(out), "-q", "--tensorboard"]
    assert main([*argv, str(tmp_path / "file" / "tb")]) == 2
    assert "cannot make the folder" in _one_error_line(capsys)
    assert main([*argv, " "]) == 2
    assert "expected a folder path" in _one_error_line(capsys)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if it were not installed
    assert main([*argv, str(tmp_path / "tb")]) == 2
    assert "pip install 'stalewise[tensorboard]'" in _one_error_line(capsys)
    assert not out.exists() and not (tmp_path / "tb").exists()


def test_docs_snippet_runs_as_pasted(tmp_path):
    (snippet,) = re.findall(r"```python\n(.*?)```", DOCS.read_text(), re.S)
    script = tmp_path / "snippet.py"
    script.write_text(snippet)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    printed = [line.split() for line in proc.stdout.splitlines()]
    assert printed and int(printed[-1][0]) >= 600 and float(printed[-1][1]) > 0.8, proc.stdout
    scalars, histograms = read_events(tmp_path / "runs" / "tb" / "digits")
    assert [step for step, _ in scalars["accuracy"]] == [int(p[0]) for p in printed]
    assert "staleness" in histograms


def test_docstring_examples_run():
    import doctest

    from stalewise import loggers

    result = doctest.testmod(loggers)
    assert result.attempted > 0 and result.failed == 0
