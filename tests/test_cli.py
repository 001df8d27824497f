"""The stalewise command and its TOML configs, run for real."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from stalewise import config
from stalewise.cli import main

LS_CONFIG = """
[task]
name = "least-squares"
args = { n = 256, d = 16 }

[optimizer]
name = "adam"
schedule = { name = "warmup_cosine", peak = 0.05, warmup = 10, total = 300 }

[server]
consistency = "ssp"
bound = 2
staleness = "polynomial"
staleness_param = 0.5
shards = 2

[run]
workers = 2
steps = 300
stragglers = { 1 = 2.0 }
delay = 0.001
eval_interval = 0.05
"""


def write(tmp_path, text, name="job.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_train_runs_a_config_and_writes_metrics_and_plot(tmp_path, capsys, no_leaks):
    cfg = write(tmp_path, LS_CONFIG)
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out), "-q"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records and records[-1]["pushes"] >= 300
    assert records[-1]["loss"] < records[0]["loss"] / 10
    assert (out / "train.png").stat().st_size > 10_000
    assert "staleness_mean" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("[run]", "[runn]"), "runn: unknown table"),
        (('name = "adam"', 'name = "adam"\nb3 = 0.1'), "optimizer.b3: unknown option for adam"),
        (('name = "adam"', 'name = "adagrad"'), "optimizer.name: unknown optimizer 'adagrad'"),
        (("workers = 2", 'workers = "two"'), "run.workers: expected int, got 'two'"),
        (("workers = 2", "workers = 0"), "run.workers: must be >= 1, got 0"),
        (("shards = 2", "shards = 2\nreplicas = 3"), "server.replicas: unknown option"),
        (
            ('consistency = "ssp"', 'consistency = "eventual"'),
            "server.consistency: unknown consistency model",
        ),
        (
            ('staleness = "polynomial"', 'staleness = "harmonic"'),
            "server.staleness: unknown staleness rule",
        ),
        (
            ('name = "warmup_cosine"', 'name = "linear"'),
            "optimizer.schedule.name: unknown schedule 'linear'",
        ),
        (("stragglers = { 1 = 2.0 }", "stragglers = { 7 = 2.0 }"), "stragglers: unknown worker 7"),
        (
            ('name = "least-squares"', 'factory = "no.such.module:make"'),
            "task.factory: cannot load",
        ),
        (('name = "least-squares"', 'name = "imagenet"'), "task.name: unknown task 'imagenet'"),
    ],
)
def test_bad_configs_are_reported_by_key(tmp_path, capsys, edit, message):
    cfg = write(tmp_path, LS_CONFIG.replace(*edit, 1))
    assert main(["train", str(cfg), "--out", str(tmp_path / "run"), "-q"]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and message in err, err


def test_missing_and_invalid_files(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.toml")]) == 2
    assert "nope.toml: no such config file" in capsys.readouterr().err
    bad = write(tmp_path, "[task\n")
    assert main(["train", str(bad)]) == 2
    assert "not valid TOML" in capsys.readouterr().err


def test_task_factory_from_a_user_module(tmp_path, monkeypatch):
    (tmp_path / "myjobs.py").write_text(
        "from stalewise import tasks\n\ndef make(d=8):\n    return tasks.get('least-squares', n=64, d=d)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config.parse(
        {
            "task": {"factory": "myjobs:make", "args": {"d": 5}},
            "optimizer": {"name": "sgd", "lr": 0.1},
        }
    )
    assert cfg.job.config.spec.size == 5
    with pytest.raises(config.ConfigError, match=r"task: give exactly one of task\.name"):
        config.parse({"task": {"factory": "myjobs:make", "name": "digits"}})


def test_demo_runs_end_to_end(tmp_path):
    """The README's first command, minus the install: both runs, the table, the files."""
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "stalewise.cli", "demo", "--out", str(out), "-q"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "BSP (synchronous)" in proc.stdout and "ASP + inverse staleness" in proc.stdout
    assert "time_to_95%" in proc.stdout
    runs = {json.loads(line)["run"] for line in (out / "metrics.jsonl").read_text().splitlines()}
    assert len(runs) == 2
    assert (out / "demo.png").stat().st_size > 10_000


def test_train_in_the_simulator_and_sweep(tmp_path, capsys):
    cfg = write(tmp_path, LS_CONFIG + '\n[sim]\ncompute = "exponential"\nlatency = 0.0001\n')
    assert (
        main(["train", str(cfg), "--runtime", "sim", "--out", str(tmp_path / "simrun"), "-q"]) == 0
    )
    records = [
        json.loads(line)
        for line in (tmp_path / "simrun" / "metrics.jsonl").read_text().splitlines()
    ]
    assert records[-1]["pushes"] == 300 and records[-1]["loss"] < records[0]["loss"] / 10
    out = tmp_path / "sweep"
    argv = [
        "sim",
        str(cfg),
        "--over",
        "consistency",
        "--values",
        "asp,ssp:1,bsp",
        "--target",
        "1e-2",
    ]
    assert main([*argv, "--out", str(out), "-q"]) == 0
    table = capsys.readouterr().out
    assert "ASP" in table and "SSP(1)" in table and "BSP" in table
    assert (out / "sweep.png").stat().st_size > 10_000
    assert main(["train", str(cfg), "--runtime", "cluster", "-q"]) == 2
    assert "unknown runtime 'cluster'" in capsys.readouterr().err
    bad = write(tmp_path, LS_CONFIG + "\n[sim]\nlatncy = 0.1\n", "bad.toml")
    assert main(["sim", str(bad), "--values", "1,2", "--target", "1"]) == 2
    assert "sim.latncy" in capsys.readouterr().err


def test_version_and_python_dash_m():
    import stalewise

    bindir = os.path.dirname(sys.executable)
    for cmd in ([sys.executable, "-m", "stalewise"], [os.path.join(bindir, "stalewise")]):
        proc = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip() == f"stalewise {stalewise.__version__}"
