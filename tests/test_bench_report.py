"""benchmarks/_report.py: where a benchmark's --check / --json figures go."""

import argparse
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("_report", ROOT / "benchmarks" / "_report.py")
_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_report)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench")
    ap.add_argument("--check", action="store_true")
    _report.add_json_arg(ap)
    return ap


def test_no_file_unless_asked_and_check_defaults_to_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ap = parser()
    assert _report.json_path(ap, ap.parse_args([]), "x") is None
    assert _report.write(None, {"a": 1}) is None
    path = _report.json_path(ap, ap.parse_args(["--check"]), "x")
    assert path == Path("runs") / "bench-x.json" and (tmp_path / "runs").is_dir()
    given = tmp_path / "deep" / "er" / "f.json"
    assert _report.json_path(ap, ap.parse_args(["--json", str(given)]), "x") == given
    assert given.parent.is_dir()


def test_writes_plain_json_with_provenance(tmp_path, capsys):
    path = tmp_path / "out.json"
    figures = {"rate": np.float32(1.5), "n": np.int64(3), "nan": math.nan, "t": (1, np.inf)}
    bars = [_report.bar("ratio", 0.5, "<=", 0.6), _report.bar("rate", 0.5, ">=", 0.9)]
    assert _report.write(path, figures, bars=bars) == path
    doc = json.loads(path.read_text())  # strict JSON: no NaN tokens
    assert doc["figures"] == {"rate": 1.5, "n": 3, "nan": None, "t": [1, None]}
    assert [(b["name"], b["bar"], b["met"]) for b in doc["bars"]] == [
        ("ratio", "<= 0.6", True),
        ("rate", ">= 0.9", False),
    ]
    assert doc["cpus"] >= 1 and "argv" in doc and "time_utc" in doc
    assert str(path) in capsys.readouterr().out
    assert not list(tmp_path.glob("*.tmp"))


def test_a_bar_with_no_value_is_missed_and_a_bad_op_is_refused():
    assert not _report.bar("t", None, "<=", 1)["met"]
    assert not _report.bar("t", math.nan, ">=", 1)["met"]
    with pytest.raises(ValueError, match="op must be"):
        _report.bar("t", 1.0, "<", 1)


def test_unwritable_paths_are_usage_errors_naming_the_path(tmp_path, capsys):
    ap = parser()
    afile = tmp_path / "afile"
    afile.write_text("")
    for arg, words in ((str(tmp_path), "is a folder"), (str(afile / "x.json"), "is not a folder")):
        with pytest.raises(SystemExit) as e:
            _report.json_path(ap, ap.parse_args(["--json", arg]), "x")
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "--json" in err and words in err
