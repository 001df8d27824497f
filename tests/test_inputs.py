"""Inputs that used to hang or mislead: absurd times and rates, NaN parameters, deep
configs, a file size limit below the shared block. Each is refused at once, on one line
that names the option (its TOML key when it comes from a config)."""

import dataclasses
import math
import subprocess
import sys
import textwrap
import time
import tomllib
from unittest import mock

import numpy as np
import pytest

import stalewise as sw
from stalewise import codecs, optim, staleness, strategies, tasks
from stalewise.cli import main
from stalewise.runtime.options import OptionError, RunOptions
from stalewise.runtime.sim import config as sim_config
from stalewise.runtime.sim.config import SimConfig, TooLongError
from stalewise.runtime.sim.models import (
    Failure,
    Fixed,
    Join,
    Network,
    Service,
    ShiftedExponential,
    Slowdown,
    Stragglers,
)

NAN, INF = math.nan, math.inf


def _loss_and_grad(params, batch):
    return 0.0, params


def _options(**kw):
    base = {"loss_and_grad": _loss_and_grad, "data": lambda w, n: iter(()), "workers": 2}
    return RunOptions(**base, steps=10, **kw)


# -- times and rates of a run ----------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "name"),
    [
        ({"eval_interval": 1e-300}, "eval_interval must be >= 0.001 s"),
        ({"eval_interval": 0.0}, "eval_interval"),
        ({"eval_interval": NAN}, "eval_interval"),
        ({"eval_interval": INF}, "eval_interval"),
        ({"eval_interval": True}, "eval_interval"),
        ({"eval_interval": "1"}, "eval_interval"),
        ({"timeout": NAN}, "timeout must be a number of seconds"),
        ({"timeout": INF}, "timeout"),
        ({"timeout": -1}, "timeout"),
        ({"start_timeout": 1e300}, "start_timeout"),
        ({"shard_start_timeout": INF}, "shard_start_timeout"),
        ({"join_timeout": NAN}, "join_timeout"),
        ({"ack_timeout": True}, "ack_timeout"),
        ({"stop_timeout": -0.5}, "stop_timeout"),
        ({"worker_timeout": 1e-300}, "worker_timeout must be >= 0.1 s"),
        ({"worker_timeout": 1e300}, "worker_timeout"),
        ({"worker_timeout": NAN}, "worker_timeout"),
        ({"checkpoint_seconds": 1e-300, "checkpoint_dir": "ck"}, "checkpoint_seconds must be >="),
        ({"checkpoint_seconds": NAN, "checkpoint_dir": "ck"}, "checkpoint_seconds"),
        ({"stragglers": {0: INF}}, r"stragglers\[0\]"),
        ({"stragglers": {1: 1e300}}, r"stragglers\[1\]"),
        ({"stragglers": {0: NAN}}, r"stragglers\[0\]"),
        ({"stragglers": [1.0, True]}, r"stragglers\[1\]"),
        ({"delays": {0: INF}}, r"delays\[0\]"),
        ({"delays": {1: 1e9}}, r"delays\[1\]"),
        ({"delays": {0: NAN}}, r"delays\[0\]"),
        ({"delays": {0: True}}, r"delays\[0\]"),
    ],
)
def test_run_options_refuse_absurd_times(kw, name):
    with pytest.raises(ValueError, match=name) as info:
        _options(**kw)
    assert "\n" not in str(info.value)


def test_run_options_keep_sane_times():
    o = _options(
        eval_interval=1e-3,
        timeout=None,
        worker_timeout=0.1,
        stragglers={0: 1e4},
        delays={1: 3600},
        checkpoint_seconds=1e-3,
        checkpoint_dir="ck",
    )
    assert o.slowdowns == (1e4, 1.0) and o.extra_delays == (0.0, 3600.0)
    assert _options(eval_interval=np.float32(0.5), worker_timeout=None).eval_interval == 0.5


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: Network(bandwidth=1e-300), "Network.bandwidth"),
        (lambda: Network(bandwidth=0.5), "Network.bandwidth"),
        (lambda: Network(worker_bandwidth=1e-9), "Network.worker_bandwidth"),
        (lambda: Network(shard_bandwidth=NAN), "Network.shard_bandwidth"),
        (lambda: Network(latency=1e300), "Network.latency"),
        (lambda: Network(latency=INF), "Network.latency"),
        (lambda: Service(time=1e300), "Service.time"),
        (lambda: Service(rate=1e-300), "Service.rate"),
        (lambda: Fixed(1e300), "Fixed.time"),
        (lambda: Fixed(NAN), "Fixed.time"),
        (lambda: ShiftedExponential(shift=1e300), "ShiftedExponential.shift"),
        (lambda: ShiftedExponential(rate=1e-300), "ShiftedExponential.rate"),
        (lambda: Stragglers(1, 1e300), "Stragglers.slowdown"),
        (lambda: Stragglers(1, INF), "Stragglers.slowdown"),
        (lambda: Slowdown(0, 1e-300, 1.0), "Slowdown.factor"),
        (lambda: Slowdown(0, 1e300, 1.0), "Slowdown.factor"),
        (lambda: Slowdown(0, 2.0, 1e300), "Slowdown.start"),
        (lambda: Slowdown(0, 2.0, 1.0, 1e300), "Slowdown.end"),
        (lambda: Slowdown(0, 2.0, 1.0, NAN), "Slowdown.end"),
        (lambda: Failure(0, 1e300), "Failure.time"),
        (lambda: Join(0, NAN), "Join.time"),
        (lambda: SimConfig(speeds=(1.0, 1e-300)), r"SimConfig.speeds\[1\]"),
        (lambda: SimConfig(speeds=(1e300,)), r"SimConfig.speeds\[0\]"),
        (lambda: SimConfig(restart_delay=1e300), "SimConfig.restart_delay"),
        (lambda: SimConfig(model_bytes=10**30), "SimConfig.model_bytes"),
    ],
)
def test_sim_models_refuse_absurd_times_and_rates(make, field):
    with pytest.raises(ValueError, match=rf"^{field} = ") as info:
        make()
    assert "\n" not in str(info.value)


def test_sim_models_keep_free_links_and_open_slowdowns():
    net = Network(latency=0.0, bandwidth=INF, worker_bandwidth=1.0)
    assert net.shard_bw == INF and net.worker_bw == 1.0
    assert Service(time=0.0, rate=INF).seconds(1e9) == 0.0
    assert Slowdown(0, 1e-6, 0.0).end == INF
    assert SimConfig(restart_delay=1e7, speeds=(1e6, 1e-6), model_bytes=10**15).speeds == (
        1e6,
        1e-6,
    )


def test_sim_stops_a_run_too_long_to_record():
    """Only evaluations left (the one worker fails, and comes back in 9e6 virtual seconds):
    the run stops after MAX_RECORDS records, naming eval_interval, instead of growing."""
    task = tasks.get("least-squares", n=64, d=4)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1))
    sim = SimConfig(compute=Fixed(0.01), failures=[Failure(0, 0.05)], joins=[Join(0, 9e6)])
    seen = []
    t0 = time.perf_counter()
    with pytest.raises(TooLongError, match="would record more than 100000 times") as info:
        job.train(
            task.loss_and_grad,
            data=task.batches,
            workers=1,
            steps=100,
            runtime=sw.Simulation(sim),
            metrics=sw.Metrics(every=1.0, on_record=seen.append),
            # wall seconds: a TimeoutError here would mean the cap is gone
            timeouts=sw.Timeouts(total=300),
        )
    assert sim_config.MAX_RECORDS == 100_000
    assert len(seen) == sim_config.MAX_RECORDS + 1  # the start's, one per interval, the stop
    assert info.value.now == pytest.approx(100_001.0) and "eval_interval = 1 s" in str(info.value)
    assert time.perf_counter() - t0 < 300


def test_sim_timeout_holds_while_only_evaluations_run():
    """The wall-clock timeout is checked between evaluations too (it was only checked
    between other events, so a run of evaluations alone never timed out)."""
    task = tasks.get("least-squares", n=64, d=4)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1))
    sim = SimConfig(compute=Fixed(0.01), failures=[Failure(0, 0.05)], joins=[Join(0, 9e6)])
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="did not finish within the timeout"):
        job.train(
            task.loss_and_grad,
            data=task.batches,
            workers=1,
            steps=100,
            runtime=sw.Simulation(sim),
            metrics=sw.Metrics(every=0.5),
            timeouts=sw.Timeouts(total=0.2),
        )
    assert time.perf_counter() - t0 < 30  # MAX_RECORDS evaluations take 10 s and more


# -- NaN and friends in the public constructors ----------------------------------------

BAD_REAL = [NAN, INF, -INF, True, "0.5", None]


def _bad(name, make, values):
    return [pytest.param(make, v, id=f"{name}={v!r}") for v in values]


CONSTRUCTORS = [
    *_bad("SSP", sw.SSP, [NAN, -1, 2.5, -INF, True, "4", None]),
    *_bad("Hybrid", sw.Hybrid, [NAN, INF, 1.0, 0.5, True, "2", None]),
    *[
        p
        for rule in (staleness.constant, staleness.inverse)
        for p in _bad(
            f"{rule.__name__}.max_staleness",
            lambda v, rule=rule: rule(max_staleness=v),
            [NAN, -INF, -1, 2.5, True, "3"],
        )
    ],
    *_bad("inverse.dc_lambda", lambda v: staleness.inverse(dc_lambda=v), [*BAD_REAL, -1.0]),
    *_bad("exponential.base", staleness.exponential, [*BAD_REAL, 0.0, 1.5]),
    *_bad("polynomial.power", staleness.polynomial, [*BAD_REAL, -1.0]),
    *_bad("exponential.max_staleness", lambda v: staleness.exponential(max_staleness=v), [NAN]),
    *_bad("topk", codecs.topk, [*BAD_REAL, 0.0, 2.0]),
    *_bad("int8.block", codecs.int8, [*BAD_REAL, 3, 0]),
    *_bad("parse", codecs.parse, ["topk:nan", "topk:inf", "topk:-1"]),
    *_bad("sgd.lr", optim.sgd, [*BAD_REAL, -1.0]),
    *_bad("sgd.momentum", lambda v: optim.sgd(0.1, momentum=v), [*BAD_REAL, 1.0]),
    *_bad("sgd.weight_decay", lambda v: optim.sgd(0.1, weight_decay=v), BAD_REAL),
    *_bad("adam.b1", lambda v: optim.adam(0.1, b1=v), BAD_REAL),
    *_bad("adam.b2", lambda v: optim.adam(0.1, b2=v), BAD_REAL),
    *_bad("adam.eps", lambda v: optim.adam(0.1, eps=v), [*BAD_REAL, 0.0]),
    *_bad("adamw.weight_decay", lambda v: optim.adamw(0.1, weight_decay=v), BAD_REAL),
    *_bad("lamb.max_trust_ratio", lambda v: optim.lamb(0.1, max_trust_ratio=v), [NAN, True]),
    *_bad("lars.trust_coefficient", lambda v: optim.lars(0.1, trust_coefficient=v), BAD_REAL),
    *_bad("clip_by_global_norm", optim.clip_by_global_norm, [*BAD_REAL, 0.0]),
    *_bad("delayed_nesterov.momentum", lambda v: optim.delayed_nesterov(momentum=v), BAD_REAL),
    *_bad("warmup_cosine.peak", lambda v: optim.schedules.warmup_cosine(v, 1, 10), BAD_REAL),
    *_bad("step_decay.gamma", lambda v: optim.schedules.step_decay(0.1, 10, v), BAD_REAL),
    *_bad(
        "local_sgd.period",
        lambda v: strategies.local_sgd(4, optim.sgd(0.1), dynamic=True, period=v),
        [NAN, INF, 0.0, True],
    ),
    *_bad("comm_budget.fraction", strategies.comm_budget, [*BAD_REAL, 0.0, 1.0]),
    *_bad("comm_budget.memory", lambda v: strategies.comm_budget(memory=v), BAD_REAL),
    *_bad(
        "easgd.alpha",
        lambda v: strategies.easgd(v, local_steps=2, inner=optim.sgd(0.1)),
        [NAN, INF, -INF, True, None],
    ),
]


@pytest.mark.parametrize(("make", "value"), CONSTRUCTORS)
def test_public_constructors_refuse_nan_and_non_numbers(make, value):
    with pytest.raises((ValueError, TypeError)) as info:
        make(value)
    text = str(info.value)
    assert text and "\n" not in text


@pytest.mark.parametrize(
    "make",
    [
        lambda: sw.SSP(0),
        lambda: sw.SSP(INF),
        lambda: sw.SSP(np.int64(3)),
        lambda: sw.SSP(4.0),
        lambda: sw.Hybrid(np.float32(1.5)),
        lambda: staleness.constant(max_staleness=None),
        lambda: staleness.constant(max_staleness=INF),
        lambda: staleness.inverse(max_staleness=np.int64(8), dc_lambda=np.float32(0.1)),
        lambda: staleness.exponential(np.float64(0.5), max_staleness=8.0),
        lambda: staleness.polynomial(0),
        lambda: optim.sgd(np.float32(0.1), momentum=np.float64(0.9)),
        lambda: codecs.topk(np.float64(0.5)),
    ],
)
def test_public_constructors_keep_numpy_numbers_and_limits(make):
    make()


def test_max_staleness_is_an_integer_or_inf():
    rule = staleness.inverse(max_staleness=np.int64(2))
    assert rule.max_staleness == 2.0 and rule.accepts(2) and not rule.accepts(3)
    assert staleness.constant().max_staleness == INF
    with pytest.raises(ValueError, match=r"max_staleness must be .* got nan"):
        staleness.constant(max_staleness=NAN)


# -- configs through the command ---------------------------------------------------------

BASE = """
[task]
name = "least-squares"
args = { n = 64, d = 4 }

[optimizer]
name = "sgd"
lr = 0.1
"""


def _write(tmp_path, text, name="job.toml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(BASE) + textwrap.dedent(text))
    return path


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        ('[run]\nruntime = "sim"\neval_interval = 1e-300\n', "run.eval_interval", ">= 0.001"),
        ("[run]\nworker_timeout = 1e-300\n", "run.worker_timeout", ">= 0.1"),
        ('[run]\nruntime = "sim"\n[sim]\nbandwidth = 1e-300\n', "sim.bandwidth", ">= 1"),
        ('[run]\nruntime = "sim"\n[sim]\nlatency = 1e300\n', "sim.latency", "<= 1e+07"),
        ('[run]\nruntime = "sim"\n[sim]\nservice_rate = 0\n', "sim.service_rate", ">= 1"),
        ('[run]\nruntime = "sim"\n[sim]\nrate = 1e-300\n', "sim.rate", ">= 1e-07"),
        (
            '[run]\nruntime = "sim"\n[sim]\nmodel_bytes = 1000000000000000000000000000000\n',
            "sim.model_bytes",
            "<= 1e+15",
        ),
        (
            '[run]\nruntime = "sim"\n[sim]\nfailures = [{ worker = 0, time = 1e300 }]\n',
            r"sim.failures[0].time",
            "<= 1e+07",
        ),
        ('[run]\nruntime = "sim"\n[sim]\nlatency = "x"\n', "sim.latency", "got 'x'"),
        (
            "[run]\nstragglers = { 1 = 1e300 }\n",
            "run.stragglers.1",
            "a number in [1, 10000], got 1e+300",
        ),
        ('[server]\nconsistency = "ssp"\nmax_staleness = nan\n', "server.max_staleness", "nan"),
        ("[server]\ndc_lambda = nan\n", "server.dc_lambda", "nan"),
        ('[server]\nconsistency = "ssp"\nbound = nan\n', "server.bound", "nan"),
        ('[server]\nconsistency = "hybrid"\ntolerance = inf\n', "server.tolerance", "inf"),
        ("[run]\nworkers = 1000000000000000000000000000000\n", "run.workers", "at most"),
        ("[run]\nsteps = 1e300\n", "run.steps", "expected an integer"),
        ("[run]\nsteps = 1000000000000000000000000000000\n", "run.steps", "<= 1000000000"),
        ('[run]\nworkers = "four"\n', "run.workers", "expected an integer"),
        ('[run]\ndelay = "1"\n', "run.delay", "expected a number"),
        ("[run]\ndelay = 1e300\n", "run.delay", "<= 3600"),
        ("[run]\nstop_at = " + "[" * 40 + "]" * 40 + "\n", "run.stop_at", "nested more than 32"),
        ("[run]\nx = " + "{ a = " * 40 + "1" + " }" * 40 + "\n", "run.x", "nested more than 32"),
    ],
)
def test_absurd_configs_get_one_line_naming_the_key(tmp_path, capsys, text, key, problem):
    cfg = _write(tmp_path, text)
    assert main(["train", str(cfg), "--out", str(tmp_path / "run"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"stalewise: {key}: "), err
    assert problem in err and f"(config error in {cfg})" in err


@pytest.mark.parametrize(
    "text",
    ["[run]\nx = " + "[" * 3000 + "]" * 3000, "x = " + "{ a = " * 3000 + "1" + " }" * 3000],
    ids=["arrays", "inline-tables"],
)
def test_deeply_nested_toml_is_one_line_without_traceback(tmp_path, text):
    """tomllib recurses once per level: 3000 levels raised RecursionError (3000 lines)."""
    cfg = tmp_path / "deep.toml"
    cfg.write_text(text + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "stalewise", "train", str(cfg), "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"stalewise: {cfg}: not a config: ")
    assert "nest more than 32 levels deep" in proc.stderr


_CLI_LIMIT = """
import sys
from stalewise.runtime.sim import engine
engine.MAX_RECORDS = 1000  # the real limit's 100000 records take a minute through the CLI
from stalewise.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["train", "sim"])
def test_a_simulated_run_too_long_to_record_is_a_config_error(tmp_path, command):
    """Through the command, in a process of its own: one line naming [sim], no traceback;
    the records written up to the limit are kept. ``stalewise sim`` (a sweep) too."""
    cfg = _write(
        tmp_path,
        """
        [run]
        runtime = "sim"
        workers = 1
        steps = 100
        eval_interval = 1.0

        [sim]
        compute = "fixed"
        step_time = 0.01
        failures = [{ worker = 0, time = 0.05 }]
        joins = [{ worker = 0, time = 9e6 }]
        """,
    )
    out = tmp_path / "run"
    args = ["--values", "1", "--target", "1e-3"] if command == "sim" else []
    proc = subprocess.run(
        [sys.executable, "-c", _CLI_LIMIT, command, str(cfg), *args, "--out", str(out), "-q"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr
    assert err.count("\n") == 1 and err.startswith("stalewise: sim: the simulated run reached"), err
    assert "would record more than 1000 times" in err and f"(config error in {cfg})" in err
    if command == "train":
        assert "(eval_interval = 1 s)" in err
        assert len((out / "metrics.jsonl").read_text().splitlines()) == 1001


# -- a file size limit below the shared block -------------------------------------------

_FSIZE = """
import errno, os, resource, sys
from stalewise.runtime.local import shm
shm.USE_MEMFD = sys.argv[1] == "memfd"
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    shm.SharedBlock.create(100_000)
except OSError as e:
    assert e.errno == errno.EFBIG, e.errno
    print(e)
block = shm.SharedBlock.create(4096)  # at the limit: made
print(block.size)
block.unlink()
block.close()
print([b for b in shm.leaked_blocks() if b.startswith(f"stalewise-{os.getpid()}-")])
"""


@pytest.mark.parametrize("kind", ["memfd", "named"])
def test_file_size_limit_below_the_block_says_shared_memory(kind):
    proc = subprocess.run(
        [sys.executable, "-c", _FSIZE, kind], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    error, size, leaked = proc.stdout.splitlines()
    where = "an anonymous memory file" if kind == "memfd" else "/dev/shm"
    assert error == (
        f"[Errno 27] cannot create the shared-memory block of 100000 bytes in {where}: "
        "the file size limit (ulimit -f) is 4096 bytes; raise it (ulimit -f unlimited)"
    )
    assert size == "4096" and leaked == "[]"  # the refused named block left no file


_NOFILE = """
import os, resource, sys
from stalewise.runtime.local import shm
shm.USE_MEMFD = sys.argv[1] == "memfd"
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
fds = []
try:
    while True:
        fds.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
try:
    shm.SharedBlock.create(100)
except OSError as e:
    print(e)
"""


@pytest.mark.parametrize("kind", ["memfd", "named"])
def test_an_os_error_creating_the_block_says_shared_memory(kind):
    proc = subprocess.run(
        [sys.executable, "-c", _NOFILE, kind], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    where = "an anonymous memory file" if kind == "memfd" else "/dev/shm"
    assert proc.stdout.strip() == (
        f"[Errno 24] cannot create the shared-memory block of 100 bytes in {where}: "
        "too many open files (ulimit -n)"
    )


_TRAIN = """
import resource
import stalewise as sw
from stalewise import tasks
if __name__ == "__main__":
    task = tasks.get("least-squares", n=64, d=4000)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
    try:
        job.train(task.loss_and_grad, data=task.batches, workers=2, steps=10, runtime="local")
    except OSError as e:
        print(e)
"""


def test_local_run_under_a_file_size_limit_names_the_shared_block(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_TRAIN)
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert line.startswith("[Errno 27] cannot create the shared-memory block of "), line
    assert "the file size limit (ulimit -f) is 4096 bytes" in line


def test_run_option_defaults_are_stated_once_in_run_options():
    """The option groups' (Job.train's, Job.serve's, the config's [run], the sweep's)
    defaults are RunOptions's, and Job.train takes no catch-all."""
    import inspect

    from stalewise import config, options, sweep
    from stalewise.runtime.options import DEFAULTS

    train = inspect.signature(sw.Job.train).parameters
    assert len(train) - 1 <= 12 and not any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in train.values()
    )
    fields = {f.name for f in dataclasses.fields(sw.RunOptions) if f.init}
    grouped = {name for g in options.GROUPS for name in g.FIELDS.values()}
    # every run option is a keyword of Job.train or a field of one of its groups
    assert fields - {"on_record"} <= set(train) | grouped
    for group in options.GROUPS:
        made = group() if group is not sw.Checkpoints else group("ckpt")
        for name, option in group.FIELDS.items():
            if option != "checkpoint_dir":
                assert getattr(made, name) == DEFAULTS[option], (group, name)
    assert sw.Metrics().on_record is DEFAULTS["on_record"]
    assert inspect.signature(sweep.sweep).parameters["progress"].default == DEFAULTS["progress"]
    task = {"name": "least-squares", "args": {"n": 64, "d": 4}}
    parsed = config.parse({"task": task, "optimizer": {"name": "sgd", "lr": 0.1}}).train
    assert parsed["failures"] == sw.Failures() and parsed["metrics"] == sw.Metrics()
    # a changed default reaches the config through DEFAULTS (nothing restates it)
    changed = dict(DEFAULTS, max_restarts=7, worker_timeout=11.0)
    with mock.patch.dict(DEFAULTS, changed):
        parsed = config.parse({"task": task, "optimizer": {"name": "sgd", "lr": 0.1}}).train
    assert (parsed["failures"].max_restarts, parsed["failures"].worker_timeout) == (7, 11.0)


@pytest.mark.parametrize(
    ("run", "key", "problem"),
    [
        ("max_restarts = -1", "run.max_restarts", "must be an integer >= 0 or false, got -1"),
        ("max_restarts = 1.5", "run.max_restarts", "must be an integer >= 0 or false"),
        ('worker_timeout = "60"', "run.worker_timeout", "or false, got '60'"),
        ("diverge_after = 0", "run.diverge_after", "must be an integer >= 1 or false, got 0"),
        ('on_worker_failure = "retry"', "run.on_worker_failure", "'restart', 'drop', 'fail'"),
        ("eval_interval = -1", "run.eval_interval", "must be a finite number of seconds > 0"),
    ],
)
def test_config_run_options_are_checked_by_run_options_under_their_toml_key(run, key, problem):
    """The config checks [run] options with RunOptions.check and names the TOML key."""
    from stalewise import config

    raw = tomllib.loads(f"[run]\n{run}\n")
    with pytest.raises(config.ConfigError) as e:
        config.parse({"task": {"name": "least-squares"}, "optimizer": {"name": "sgd"}, **raw})
    assert e.value.key == key and problem in e.value.problem, str(e.value)
    assert "\n" not in str(e.value)
    name = key.removeprefix("run.")
    with pytest.raises(OptionError) as direct:  # the same check, alone
        sw.RunOptions.check(name, tomllib.loads(f"{run}\n")[name])
    assert direct.value.option == name


def test_config_false_means_never_for_max_restarts_worker_timeout_and_diverge_after():
    from stalewise import config

    raw = {"max_restarts": False, "worker_timeout": False, "diverge_after": False}
    task = {"name": "least-squares", "args": {"n": 64, "d": 4}}
    parsed = config.parse({"task": task, "optimizer": {"name": "sgd", "lr": 0.1}, "run": raw})
    assert [getattr(parsed.train["failures"], k) for k in raw] == [None, None, None]


def test_the_simulators_seed_is_simulations():
    job = sw.Job({"x": np.ones(3, np.float32)}, optimizer=sw.optim.sgd(0.1))
    kw = {"data": lambda w, n: iter([None] * 1000), "workers": 2, "steps": 20}
    new = job.train(_quadratic, runtime=sw.Simulation(seed=5), **kw)
    again = job.train(_quadratic, runtime=sw.Simulation(seed=5), **kw)
    other = job.train(_quadratic, runtime=sw.Simulation(seed=6), **kw)
    assert new.time == again.time and new.time != other.time
    assert _options(sim_seed=4).sim_seed == 4  # RunOptions(seed=) is gone
    with pytest.raises(TypeError, match="unexpected keyword argument 'seed'"):
        job.train(_quadratic, runtime="sim", seed=5, **kw)  # removed after its release
    with pytest.raises(TypeError, match="unexpected keyword argument 'sim_seed'"):
        job.train(_quadratic, runtime=sw.Simulation(seed=5), sim_seed=6, **kw)
    with pytest.raises(ValueError, match=r"Simulation\.seed must be an integer >= 0"):
        sw.Simulation(seed=-1)


def _quadratic(params, batch):
    return float((params["x"] ** 2).sum()), {"x": 2 * params["x"]}


# -- tasks too large for memory ------------------------------------------------------------


def test_available_memory_is_this_machines():
    import os

    from stalewise.tasks import base

    available = base.available_memory()
    assert isinstance(available, int) and available > 0
    assert available <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize(
    "name, kwargs, key",
    [
        ("least-squares", {"n": 512, "d": 300_000_000}, "d = 300000000 (with n = 512)"),
        ("least-squares", {"n": 10**10, "d": 64}, "n = 10000000000"),
        ("digits", {"hidden": 10**9}, "hidden = 1000000000"),
        ("lm", {"dim": 10**6, "heads": 1}, "dim = 1000000 (with heads = 1)"),
        ("lm", {"context": 10**7}, "context = 10000000"),
    ],
)
def test_a_task_too_large_for_memory_is_refused_when_made(name, kwargs, key):
    """Each built-in task estimates what one process allocates and refuses first: a
    ValueError naming the key, the value and the bytes, before any array is made."""
    if name == "lm":
        pytest.importorskip("torch")
    with pytest.raises(ValueError) as e:
        tasks.get(name, **kwargs)
    message = str(e.value)
    assert message.startswith(f"{key}: {name} would allocate about "), message
    assert "bytes" in message and "more than the memory available" in message


def test_the_memory_estimate_is_checked_against_what_is_available(monkeypatch):
    from stalewise.tasks import base

    need = tasks.task_class("least-squares").memory_bytes(2048, 64)
    monkeypatch.setattr(base, "available_memory", lambda: need)
    tasks.get("least-squares")  # exactly fits
    with pytest.raises(ValueError, match=r"^n = 4096: least-squares would allocate about"):
        tasks.get("least-squares", n=4096)
    monkeypatch.setattr(base, "available_memory", lambda: None)  # unknown: nothing refused
    tasks.get("least-squares", n=4096)


def test_a_config_too_large_for_memory_names_its_key(monkeypatch):
    from stalewise import config

    raw = {
        "task": {"name": "least-squares", "args": {"n": 64, "d": 300_000_000}},
        "optimizer": {"name": "sgd", "lr": 0.1},
    }
    with pytest.raises(config.ConfigError) as e:
        config.parse(raw)
    assert e.value.key == "task.args.d"
    assert e.value.problem.startswith("d = 300000000 (with n = 64): least-squares would")
    # a factory's task that fails with a MemoryError is one line naming the task too
    fits = {"name": "least-squares", "args": {"n": 64, "d": 4}}

    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 572. GiB")

    monkeypatch.setattr(tasks.task_class("least-squares"), "_data", no_memory)
    with pytest.raises(config.ConfigError) as e:
        config.parse({**raw, "task": fits})
    assert e.value.key == "task.args" and "do not fit in memory: Unable to allocate" in (
        e.value.problem
    )
