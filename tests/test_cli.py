"""The stalewise command and its TOML configs, run for real."""

import json
import os
import re
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

import stalewise as sw
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
        (("workers = 2", 'workers = "two"'), "run.workers: expected an integer, got 'two'"),
        (("workers = 2", "workers = 0"), "run.workers: must be >= 1, got 0"),
        (("shards = 2", "shards = 2\nreplica = 2"), "server.replica: unknown option"),
        (("shards = 2", "shards = 2\nreplicas = 3"), "server.replicas: must be 1 or 2, got 3"),
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


@pytest.mark.slow
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


# ------------------------------------------------------------ a newcomer's user errors


def _one_error_line(capsys, key):
    """The stderr of a failed command: exactly one line, naming ``key``, no traceback."""
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"stalewise: {key}: "), lines[0]
    assert "Traceback" not in captured.err + captured.out
    return lines[0]


DIGITS_TASK = 'name = "digits"\nargs = { hidden = "64" }'
LS_TASK = 'name = "least-squares"\nargs = { n = 256, d = 16 }'
LR_LINE = 'schedule = { name = "warmup_cosine", peak = 0.05, warmup = 10, total = 300 }'


@pytest.mark.parametrize(
    ("edit", "argv", "key", "problem"),
    [
        pytest.param(
            ("stragglers = { 1 = 2.0 }", "stragglers = [1.0, 4.0]"),
            ["train"],
            "run.stragglers",
            "expected a table of worker = slowdown factor, such as { 1 = 4 } for [1.0, 4.0]",
            id="stragglers-list",
        ),
        pytest.param(
            ("delay = 0.001", "delay = 0.001\nstop_at = 0.95"),
            ["train"],
            "run.stop_at",
            "expected a table of metric = value to reach",
            id="stop_at-number",
        ),
        pytest.param(
            (LS_TASK, DIGITS_TASK),
            ["train"],
            "task.args.hidden",
            "expected an integer, got '64'",
            id="task-args-type",
        ),
        pytest.param(
            (LR_LINE, 'lr = "0.01"'),
            ["train"],
            "optimizer.lr",
            "expected a number, got '0.01'",
            id="lr-string",
        ),
        pytest.param(
            None,
            ["sim", "--values", "1,2", "--target", "0.9", "--metric", "acc"],
            "--metric",
            "expected a metric of the task's evaluate() (loss, distance), got 'acc'",
            id="sim-metric",
        ),
        pytest.param(
            None,
            ["sim", "--values", "asp,ssp4", "--target", "0.9"],
            "--values",
            "expected worker counts such as 1,4,16, got 'asp'",
            id="sim-values-workers",
        ),
        pytest.param(
            None,
            ["sim", "--over", "consistency", "--values", "asp,ssp4", "--target", "0.9"],
            "--values",
            "expected consistency models such as asp,ssp:4,bsp, got 'ssp4'",
            id="sim-values-consistency",
        ),
        pytest.param(
            None, ["demo", "--workers", "0"], "--workers", "must be >= 1, got 0", id="demo"
        ),
        # more of the same kind
        pytest.param(
            None, ["demo", "--workers", "two"], "--workers", "invalid int value", id="demo-int"
        ),
        pytest.param(
            None, ["demo", "--slowdown", "0.5"], "--slowdown", "got 0.5", id="demo-slowdown"
        ),
        pytest.param(
            None,
            ["sim", "--values", "1", "--target", "nan"],
            "--target",
            "expected a finite number, got nan",
            id="sim-target",
        ),
        pytest.param(
            None, ["train", "--runtime", "mpi"], "--runtime", "unknown runtime 'mpi'", id="runtime"
        ),
        pytest.param(
            ("shards = 2", "shards = 2\nmax_staleness = -1"),
            ["train"],
            "server.max_staleness",
            "must be >= 0, got -1",
            id="library-value-error",
        ),
        pytest.param(
            ("eval_interval = 0.05", "eval_interval = 0.05\nworker = 3"),
            ["train"],
            "run.worker",
            "unknown option (known: address, delay, diverge_after, eval_interval, max_restarts, "
            "on_worker_failure, runtime, steps, stop_at, stragglers, worker_timeout, workers)",
            id="unknown-key",
        ),
        pytest.param(
            ('name = "adam"', 'name = "adam"\nb1 = 1.5'),
            ["train"],
            "optimizer.b1",
            "must be in [0, 1), got 1.5",
            id="optimizer-range",
        ),
        pytest.param(
            ("[run]", '[sim]\nfailures = [{ worker = "a", time = 1.0 }]\n\n[run]'),
            ["train"],
            "sim.failures[0].worker",
            "must be a worker id (an integer >= 0), got 'a'",
            id="sim-table",
        ),
    ],
)
def test_user_errors_are_one_line_naming_the_key(tmp_path, capsys, edit, argv, key, problem):
    cfg = write(tmp_path, LS_CONFIG.replace(*edit, 1) if edit else LS_CONFIG)
    assert edit is None or edit[0] in LS_CONFIG
    out = tmp_path / "run"
    command, *flags = argv
    if command != "demo":
        flags = [str(cfg), *flags]
    assert main([command, *flags, "--out", str(out), "-q"]) == 2
    line = _one_error_line(capsys, key)
    assert problem in line, line
    assert "config error" in line or "--help" in line
    assert not out.exists(), "nothing may start before the flags and the config are checked"


@pytest.mark.parametrize(
    ("edit", "argv", "key", "problem"),
    [
        (
            ("workers = 2", "workers = 5000"),
            [],
            "run.workers",
            "at most 4096 workers on runtime 'local'",
        ),
        (
            ("workers = 2", 'workers = 20000\nruntime = "sim"'),
            [],
            "run.workers",
            "at most 16384 workers on runtime 'sim'",
        ),
        (("shards = 2", "shards = 5000"), [], "server.shards", "must be <= 1024, got 5000"),
        (("steps = 300", "steps = 10_000_000_000"), [], "run.steps", "must be <= 1000000000"),
        (("delay = 0.001", "delay = 1e9"), [], "run.delay", "must be <= 3600"),
        (None, ["--values", "1,100000"], "--values", "worker counts must be in 1..16384"),
    ],
)
def test_absurd_sizes_are_refused_before_anything_is_made(
    tmp_path, capsys, monkeypatch, edit, argv, key, problem
):
    def nothing_may_be_made(*args, **kwargs):
        raise AssertionError("made before the sizes were checked")

    monkeypatch.setattr(config, "Job", nothing_may_be_made)
    monkeypatch.setattr(config.tasks, "task_class", nothing_may_be_made)
    cfg = write(tmp_path, LS_CONFIG.replace(*edit, 1) if edit else LS_CONFIG)
    command = ["sim", str(cfg), *argv, "--target", "1"] if argv else ["train", str(cfg)]
    assert main([*command, "--out", str(tmp_path / "run"), "-q"]) == 2
    assert problem in _one_error_line(capsys, key)


def test_sizes_that_need_the_task_are_refused_by_key(tmp_path, capsys):
    cfg = write(tmp_path, LS_CONFIG.replace("shards = 2", "shards = 17"))  # d = 16 parameters
    assert main(["train", str(cfg), "-q"]) == 2
    line = _one_error_line(capsys, "server.shards")
    assert "at most the number of parameters (16), got 17" in line
    cfg = write(tmp_path, LS_CONFIG.replace("workers = 2", "workers = 300"))  # n = 256 examples
    assert main(["train", str(cfg), "-q"]) == 2
    assert "300 workers but only 256 training examples" in _one_error_line(capsys, "run.workers")
    assert main(["demo", "--workers", "100000", "-q"]) == 2
    assert "at most" in _one_error_line(capsys, "--workers")


# ------------------------------------------------------- task factories next to the config

# A task written to the documented contract: batches(worker, workers, seed) has no
# default for seed, so any caller that passes two arguments fails.
FACTORY_MODULE = """
import numpy as np


class Quadratic:
    name = "quadratic"

    def __init__(self, d: int = 8, origin: str = "{origin}"):
        self.d, self.origin = d, origin

    def init_params(self, seed):
        return {{"x": np.zeros(self.d, np.float32)}}

    def loss_and_grad(self, params, batch):
        diff = params["x"] - batch
        return float(0.5 * (diff**2).mean()), {{"x": diff}}

    def batches(self, worker, workers, seed):
        rng = np.random.default_rng([seed, worker])
        while True:
            yield (1.0 + 0.01 * rng.standard_normal(self.d)).astype(np.float32) + 0 * seed

    def evaluate(self, params):
        return {{"loss": float(0.5 * ((params["x"] - 1.0) ** 2).mean()), "seed_seen": -1.0}}


def make(d: int = 8):
    return Quadratic(d)
"""

FACTORY_CONFIG = """
[task]
factory = "{module}:make"
args = {{ d = 4 }}
seed = 7

[optimizer]
name = "sgd"
lr = 0.1  # stable at the staleness of a few that two fast workers see

[run]
workers = 2
steps = 200
eval_interval = 0.05
stop_at = {{ loss = 1e-3 }}
runtime = "local"
"""


@pytest.fixture
def fresh_modules():
    """Names of user modules a test imports; they are dropped from sys.modules afterwards."""
    names = []
    yield names
    for name in names:
        sys.modules.pop(name, None)


def _factory(folder, module, origin):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(FACTORY_MODULE.format(origin=origin))


def test_factory_next_to_the_config_trains_on_local_workers(
    tmp_path, monkeypatch, capsys, fresh_modules, no_leaks
):
    module = "stalewise_test_task_cfgdir"
    fresh_modules.append(module)
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    _factory(project, module, "config folder")
    cfg = write(project, FACTORY_CONFIG.format(module=module))
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    path_before = list(sys.path)
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out), "-q"]) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # the spawned workers trained: the loss at the initial x = 0 is 0.5
    assert records[-1]["pushes"] >= 20 and records[-1]["loss"] < 0.05
    assert sys.path == path_before and "PYTHONPATH" not in os.environ  # both restored


def test_factory_in_the_cwd_and_the_seed_contract(tmp_path, monkeypatch, capsys, fresh_modules):
    module = "stalewise_test_task_cwd"
    fresh_modules.append(module)
    monkeypatch.chdir(tmp_path)
    _factory(tmp_path, module, "cwd")
    (tmp_path / "configs").mkdir()
    cfg = write(tmp_path / "configs", FACTORY_CONFIG.format(module=module))
    path_before = list(sys.path)
    loaded = config.load(cfg)
    assert loaded.task.origin == "cwd" and loaded.paths == (str(tmp_path.resolve()),)
    assert sys.path == path_before
    # the contract: stalewise calls batches(worker, workers, seed), seed = task.seed
    expected = next(loaded.task.batches(1, 2, 7))
    np.testing.assert_array_equal(next(loaded.data(1, 2)), expected)
    assert main(["train", str(cfg), "--runtime", "sim", "--out", str(tmp_path / "r1"), "-q"]) == 0
    argv = ["sim", str(cfg), "--values", "1,2", "--target", "1e-3", "--out", str(tmp_path / "r2")]
    assert main([*argv, "-q"]) == 0
    assert "P=2" in capsys.readouterr().out
    assert sys.path == path_before


def test_the_config_folder_comes_before_the_cwd(tmp_path, monkeypatch, fresh_modules):
    module = "stalewise_test_task_both"
    fresh_modules.append(module)
    _factory(tmp_path / "project", module, "config folder")
    _factory(tmp_path / "cwd", module, "cwd")
    monkeypatch.chdir(tmp_path / "cwd")
    cfg = write(tmp_path / "project", FACTORY_CONFIG.format(module=module))
    assert config.load(cfg).task.origin == "config folder"


@pytest.mark.parametrize(
    ("source", "factory", "key", "problem"),
    [
        (
            "",
            "stalewise_test_nothing_here:make",
            "task.factory",
            "cannot load 'stalewise_test_nothing_here:make': No module named",
        ),
        (
            "def make(d):\n    return object()\n",
            "{module}:make",
            "task.factory",
            "without the task method(s) init_params, loss_and_grad, batches, evaluate",
        ),
        ("def make(d):\n    return 3\n", "{module}:nope", "task.factory", "has no 'nope'"),
        (
            FACTORY_MODULE.format(origin="x").replace(
                "def batches(self, worker, workers, seed)", "def batches(self, worker, workers)"
            ),
            "{module}:make",
            "task.factory",
            "cannot be called as batches(worker, workers, seed)",
        ),
        ("def make():\n    pass\n", "{module}:make", "task.args.d", "unknown option"),
        (
            "def make(d):\n    raise ValueError(f'd={d} is too small')\n",
            "{module}:make",
            "task.args.d",
            "{module}:make raised ValueError: d=4 is too small",
        ),
        (
            "def make(d):\n    return open('/no/such/folder/data.csv')\n",
            "{module}:make",
            "task.factory",
            "{module}:make raised FileNotFoundError",
        ),
    ],
)
def test_bad_factories_are_reported_by_key(
    tmp_path, capsys, fresh_modules, source, factory, key, problem
):
    module = f"stalewise_test_bad_{zlib.crc32(source.encode())}"
    fresh_modules.append(module)
    if source:
        (tmp_path / f"{module}.py").write_text(source)
    text = FACTORY_CONFIG.replace("{module}:make", factory).format(module=module)
    cfg = write(tmp_path, text)
    assert main(["train", str(cfg), "-q"]) == 2
    assert problem.format(module=module) in _one_error_line(capsys, key)


# ------------------------------------------------------------------ the [strategy] table

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_digits_diloco_example_trains_in_the_simulator(tmp_path, capsys):
    out = tmp_path / "run"
    started = time.perf_counter()
    argv = ["train", str(EXAMPLES / "digits_diloco.toml"), "--runtime", "sim", "--out", str(out)]
    assert main([*argv, "-q"]) == 0
    assert time.perf_counter() - started < 60
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["accuracy"] >= 0.96 and records[-1]["pushes"] <= 100
    cfg = config.load(EXAMPLES / "digits_diloco.toml")
    assert cfg.job.strategy == sw.strategies.diloco(local_steps=20, inner=sw.optim.adamw(3e-3))
    outer = cfg.job.config.optimizer.apply.__self__  # no [optimizer]: DiLoCo's recommendation
    assert (outer.lr, outer.momentum, outer.nesterov) == (0.7, 0.9, True)
    assert "digits_diloco" in capsys.readouterr().out


DIGITS = {"name": "digits", "args": {"hidden": 8}}


def test_strategy_table_builds_the_strategy_and_the_server_optimizer():
    inner = {"name": "lamb", "lr": 0.01, "max_trust_ratio": 5.0}
    cfg = config.parse(
        {"task": DIGITS, "strategy": {"name": "local_sgd", "local_steps": 4, "inner": inner}}
    )
    assert cfg.job.strategy == sw.strategies.local_sgd(
        local_steps=4, inner=sw.optim.lamb(0.01, max_trust_ratio=5.0)
    )
    assert cfg.job.config.optimizer.apply.__self__.lr == 1.0  # sgd(1.0)
    async_diloco = {"name": "diloco", "local_steps": 8, "asynchronous": True}
    cfg = config.parse({"task": DIGITS, "strategy": async_diloco, "run": {"workers": 3}})
    assert cfg.job.config.optimizer.apply.__self__.every == 3  # run.workers
    cfg = config.parse({"task": DIGITS, "strategy": {**async_diloco, "every": 5}})
    assert cfg.job.config.optimizer.apply.__self__.every == 5
    sgd = {"name": "sgd", "lr": 0.5}  # an [optimizer] table overrides the recommendation
    cfg = config.parse({"task": DIGITS, "strategy": async_diloco, "optimizer": sgd})
    assert cfg.job.config.optimizer.apply.__self__.lr == 0.5
    schedule = {"name": "fixed", "local_steps": 3}
    adaptive = {"name": "adaptive", "outer": "diloco", "schedule": schedule, "smoothing": 0.5}
    bsp = {"consistency": "bsp"}  # synchronous DiLoCo's recommendation is for BSP
    cfg = config.parse({"task": DIGITS, "strategy": adaptive, "server": bsp})
    assert cfg.job.strategy == sw.strategies.adaptive(
        outer="diloco", schedule=sw.strategies.fixed(3), smoothing=0.5
    )
    easgd = {"name": "easgd", "alpha": 0.25, "local_steps": 2, "inner": sgd}
    assert config.parse({"task": DIGITS, "strategy": easgd}).job.strategy.alpha == 0.25
    plain = config.parse({"task": DIGITS, "strategy": {"name": "gradients"}, "optimizer": sgd})
    assert plain.job.strategy == sw.strategies.gradients()


@pytest.mark.parametrize(
    ("strategy", "key", "problem"),
    [
        ('name = "dilocco"', "strategy.name", "unknown strategy 'dilocco' (known: gradients,"),
        ("local_steps = 4", "strategy.name", "missing: name the strategy"),
        ('name = "diloco"\nstepz = 4', "strategy.stepz", "unknown option for diloco (known:"),
        (
            'name = "diloco"\nlocal_steps = 0',
            "strategy.local_steps",
            "must be an integer >= 1, got 0",
        ),
        (
            'name = "diloco"\nlocal_steps = "4"',
            "strategy.local_steps",
            "expected an integer, got '4'",
        ),
        (
            'name = "diloco"\nsteps = 4\nlocal_steps = 4',
            "strategy.steps",
            "unknown option for diloco (known: local_steps,",
        ),
        ('name = "diloco"\nevery = 4', "strategy.every", "it needs asynchronous=True"),
        ('name = "diloco"\nouter_momentum = 1.0', "strategy.outer_momentum", "[0, 1), got 1.0"),
        ('name = "diloco"\ninner = "adamw"', "strategy.inner", "expected an optimizer table"),
        (
            'name = "diloco"\ninner = { name = "adamw", lr = "0.01" }',
            "strategy.inner.lr",
            "expected a number, got '0.01'",
        ),
        (
            'name = "diloco"\ninner = { name = "adamw" }',
            "strategy.inner.lr",
            "missing: adamw needs strategy.inner.lr (or strategy.inner.schedule)",
        ),
        (
            'name = "diloco"\ninner = { name = "adagrad", lr = 0.1 }',
            "strategy.inner.name",
            "unknown optimizer 'adagrad'",
        ),
        (
            'name = "diloco"\ninner = { name = "adam", lr = 0.1, b3 = 1 }',
            "strategy.inner.b3",
            "unknown option for adam",
        ),
        ('name = "local_sgd"\nlocal_steps = 4', "strategy.inner", "missing: local_sgd needs"),
        (
            'name = "gradients"\nlocal_steps = 4',
            "strategy.local_steps",
            "unknown option for gradients",
        ),
        (
            'name = "easgd"\nalpha = 2.0\nlocal_steps = 2\ninner = { name = "sgd", lr = 0.1 }',
            "strategy.alpha",
            "must be in (0, 1], got 2.0",
        ),
        ('name = "adaptive"\nouter = "fedavg"', "strategy.outer", "got 'fedavg'"),
        (
            'name = "adaptive"\nouter = "diloco"\nschedule = { name = "adacomm", begin = 3 }',
            "strategy.schedule.begin",
            "unknown option for adacomm",
        ),
        ('name = "diloco"\ndynamic = true', "strategy.dynamic", "needs period=seconds"),
        (
            'name = "adaptive"\nschedule = { name = "comm_budget", fraction = 1.5 }',
            "strategy.schedule.fraction",
            "1.5",
        ),
    ],
)
def test_bad_strategy_tables_are_one_line_naming_the_key(
    tmp_path, capsys, monkeypatch, strategy, key, problem
):
    def nothing_may_be_made(*args, **kwargs):
        raise AssertionError("made before the [strategy] table was checked")

    monkeypatch.setattr(config.tasks, "task_class", nothing_may_be_made)
    cfg = write(tmp_path, LS_CONFIG.replace("[run]", f"[strategy]\n{strategy}\n\n[run]", 1))
    out = tmp_path / "run"
    assert main(["train", str(cfg), "--out", str(out), "-q"]) == 2
    line = _one_error_line(capsys, key)
    assert problem in line and "config error" in line, line
    assert not out.exists()


def test_optimizer_table_is_required_only_without_a_recommendation(tmp_path, capsys):
    no_optimizer = LS_CONFIG.replace('[optimizer]\nname = "adam"\n' + LR_LINE + "\n", "")
    assert "[optimizer]" not in no_optimizer
    cfg = write(tmp_path, no_optimizer)
    assert main(["train", str(cfg), "-q"]) == 2
    assert "optimizer.lr: missing" in _one_error_line(capsys, "optimizer.lr")
    cfg = write(tmp_path, no_optimizer + '\n[strategy]\nname = "gradients"\n')
    assert main(["train", str(cfg), "-q"]) == 2
    line = _one_error_line(capsys, "optimizer")
    assert "strategy 'gradients' recommends no server optimizer" in line
    bsp = no_optimizer.replace('consistency = "ssp"\nbound = 2', 'consistency = "bsp"')
    cfg = write(tmp_path, bsp + '\n[strategy]\nname = "diloco"\nlocal_steps = 5\n')  # DiLoCo: BSP
    assert config.load(cfg).job.config.optimizer.apply.__self__.nesterov


def test_sim_sweeps_over_strategies(tmp_path, capsys):
    cfg = write(
        tmp_path,
        LS_CONFIG
        + '\n[strategy]\nname = "local_sgd"\nlocal_steps = 4\ninner = { name = "sgd", lr = 0.05 }\n',
    )
    out = tmp_path / "sweep"
    argv = ["sim", str(cfg), "--over", "strategy", "--target", "1e-2", "--out", str(out), "-q"]
    assert main([*argv, "--values", "gradients,local_sgd:8,diloco:20,easgd:4"]) == 2
    assert "'easgd:4': strategy.alpha: missing" in _one_error_line(capsys, "--values")
    assert main([*argv, "--values", "gradients,local_sgd:8,diloco:20"]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in ("gradients", "local_sgd:8", "diloco:20"))
    runs = {json.loads(line)["run"] for line in (out / "metrics.jsonl").read_text().splitlines()}
    assert runs == {"gradients", "local_sgd:8", "diloco:20"}
    assert (out / "sweep.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ("gradients,fedavg", "expected strategies such as gradients,local_sgd:8,diloco:20"),
        ("gradients:4", "gradients takes no number of local steps"),
        ("diloco:x", "expected diloco:H with H local steps, an integer >= 1, got 'x'"),
        ("diloco:0", "an integer >= 1, got '0'"),
        ("diloco:4,diloco:4", "'diloco:4' is given twice"),
    ],
)
def test_bad_strategy_values_are_one_line(tmp_path, capsys, values, problem):
    cfg = write(tmp_path, LS_CONFIG)
    argv = ["sim", str(cfg), "--over", "strategy", "--values", values, "--target", "1"]
    assert main([*argv, "--out", str(tmp_path / "run"), "-q"]) == 2
    assert problem in _one_error_line(capsys, "--values")
    assert not (tmp_path / "run").exists()


def test_train_resumes_a_run_from_its_checkpoint(tmp_path, capsys, no_leaks):
    first = write(tmp_path, LS_CONFIG.replace("steps = 300", "steps = 100"), "first.toml")
    out = tmp_path / "run"
    assert main(["train", str(first), "--out", str(out), "--runtime", "sim", "-q"]) == 0
    assert (out / "checkpoints" / "latest").is_file()
    saved = sw.load_params(out / "checkpoints")
    more = write(tmp_path, LS_CONFIG.replace("steps = 300", "steps = 250"), "more.toml")
    assert main(["train", str(more), "--resume", str(out), "--runtime", "sim", "-q"]) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in records if r["updates"] > 0]
    assert records[-1]["pushes"] >= 250 and resumed[-1]["updates"] >= 250
    assert not np.array_equal(sw.load_params(out / "checkpoints")["x"], saved["x"])
    assert main(["train", str(more), "--resume", str(tmp_path / "nowhere"), "-q"]) == 2
    assert "--resume" in capsys.readouterr().err


# ---------------------------------------- run results and sizes that deserve one line


def _command(tmp_path, *argv, timeout=300):
    """``python -m stalewise ARGV`` in a process of its own, in ``tmp_path``."""
    return subprocess.run(
        [sys.executable, "-m", "stalewise", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )


@pytest.mark.parametrize("runtime", ["local", "sim"])
def test_a_diverged_run_is_one_line_at_the_cli(tmp_path, runtime):
    """``lr = 1e308``: every push overflows and every worker diverges. The command says so
    in one line with the hint (the run's log of refused pushes stays, as WARNING lines)
    and exits 1, with no DivergedError traceback (it was 46 lines)."""
    cfg = write(
        tmp_path,
        f"""
        [task]
        name = "least-squares"
        args = {{ n = 256, d = 16 }}

        [optimizer]
        name = "sgd"
        lr = 1e308

        [run]
        runtime = "{runtime}"
        workers = 2
        steps = 200
        """,
    )
    proc = _command(tmp_path, "train", str(cfg), "--out", str(tmp_path / "run"), "-q")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "WARNING" not in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("stalewise: training diverged: worker(s) 0, 1 stopped")
    assert errors[0].endswith("lower the learning rate or clip the gradients.")


def test_a_task_too_large_for_memory_is_refused_by_key(tmp_path):
    """``d = 300000000``: least squares' 2.5 TB matrix is refused before anything is
    allocated, in one line naming the key, the value and the bytes (it died in NumPy's
    ArrayMemoryError)."""
    cfg = write(tmp_path, LS_CONFIG.replace("n = 256, d = 16", "n = 2048, d = 300000000", 1))
    proc = _command(tmp_path, "train", str(cfg), "--out", str(tmp_path / "run"), "-q")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    line = proc.stderr
    assert line.startswith("stalewise: task.args.d: d = 300000000: least-squares would "), line
    assert re.search(r"allocate about 2\.4\de\+12 bytes \(2\.4\d TB\), more than", line), line
    assert "more than the memory available" in line and f"(config error in {cfg})" in line
