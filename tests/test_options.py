"""Job.train's option groups (stalewise/options.py): a first run's keywords, the rest in
small frozen objects read by Job.train, Job.serve, the config and the sweep."""

import dataclasses
import inspect
import tomllib
import warnings

import numpy as np
import pytest

import stalewise as sw
from stalewise import config, options, tasks
from stalewise import sweep as sweep_lib
from stalewise.runtime.options import DEFAULTS, OptionError
from stalewise.runtime.sim.config import SimConfig
from stalewise.runtime.sim.models import Fixed


def _quadratic(params, batch):
    return float((params["x"] ** 2).sum()), {"x": 2 * params["x"]}


def _job():
    return sw.Job({"x": np.ones(3, np.float32)}, optimizer=sw.optim.sgd(0.1))


KW = {"data": [[None], [None]], "workers": 2, "steps": 40}


def test_job_train_takes_twelve_keywords_and_no_catch_all():
    params = inspect.signature(sw.Job.train).parameters
    names = [n for n in params if n != "self"]
    assert names == ["loss_and_grad", "data", "workers", "steps", "runtime", "evaluate",
                     "stop_at", "metrics", "checkpoints", "failures", "timeouts", "emulation"]  # fmt: skip
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_every_group_field_is_a_run_option_with_its_default():
    for group in options.GROUPS:
        made = group("ckpt") if group is sw.Checkpoints else group()
        assert dataclasses.is_dataclass(made)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(made, next(iter(group.FIELDS)), None)
        for name, option in group.FIELDS.items():
            if option != "checkpoint_dir":
                assert getattr(made, name) == DEFAULTS[option], (group.__name__, name)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: sw.Failures("retry"), "Failures.policy must be one of 'restart', 'drop', 'fail'"),
        (lambda: sw.Failures(max_restarts=-1), "Failures.max_restarts must be an integer >= 0"),
        (lambda: sw.Failures(worker_timeout=0.01), "Failures.worker_timeout must be >= 0.1 s"),
        (lambda: sw.Failures(diverge_after=0), "Failures.diverge_after must be an integer >= 1"),
        (lambda: sw.Checkpoints(None), "Checkpoints.dir must be a path"),
        (lambda: sw.Checkpoints(3), "Checkpoints.dir must be a path"),
        (lambda: sw.Checkpoints("d", every=0), "Checkpoints.every must be an integer >= 1"),
        (lambda: sw.Checkpoints("d", seconds=-1), "Checkpoints.seconds must be a finite number"),
        (lambda: sw.Checkpoints("d", keep=0), "Checkpoints.keep must be an integer >= 1"),
        (lambda: sw.Checkpoints("d", resume="yes"), "Checkpoints.resume must be True or False"),
        (lambda: sw.Timeouts(total=-1), "Timeouts.total must be a number of seconds"),
        (lambda: sw.Timeouts(join=float("nan")), "Timeouts.join must be a number of seconds"),
        (lambda: sw.Metrics(every=0), "Metrics.every must be a finite number of seconds > 0"),
        (lambda: sw.Metrics(on_record=3), "Metrics.on_record must be a function"),
        (lambda: sw.Simulation(seed=-1), "Simulation.seed must be an integer >= 0"),
        (lambda: sw.Simulation("fast"), "Simulation.config must be a SimConfig or None"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_group_and_field(make, message):
    with pytest.raises(OptionError) as e:
        make()
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
    assert e.value.option == message.split()[0]


def test_a_group_of_the_wrong_kind_is_refused_naming_the_keyword():
    with pytest.raises(TypeError, match=r"^failures must be a sw.Failures\(...\) or None, got"):
        _job().train(_quadratic, runtime="sim", failures=sw.Timeouts(), **KW)
    with pytest.raises(TypeError, match="unexpected keyword argument 'stragler'"):
        _job().train(_quadratic, runtime="sim", stragler={0: 2.0}, **KW)


def test_the_groups_reach_the_run():
    sim = SimConfig(compute=Fixed(0.01))
    new = _job().train(
        _quadratic,
        runtime=sw.Simulation(sim, seed=3),
        metrics=sw.Metrics(every=0.05, name="grouped"),
        emulation=sw.Emulation(stragglers={1: 3.0}, delays={0: 0.01}),
        **KW,
    )
    assert {r["run"] for r in new.records} == {"grouped"}
    plain = _job().train(_quadratic, runtime=sw.Simulation(sim, seed=3), **KW)
    assert plain.time < new.time  # the emulation reached the run


def test_the_removed_seed_keywords_are_gone():
    with pytest.raises(TypeError, match="unexpected keyword argument 'seed'"):
        _job().train(_quadratic, runtime="sim", seed=1, **KW)
    task = tasks.get("least-squares", n=64, d=4)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1))
    with pytest.raises(TypeError, match="'seed'"):
        sweep_lib.sweep(job, task, over="workers", values=[1], steps=10, target=1.0, seed=1)


def test_serve_takes_timeouts(no_leaks):
    assert "join_timeout" not in inspect.signature(sw.Job.serve).parameters
    with pytest.raises(OptionError, match=r"^Timeouts\.join must be"):
        _job().serve(workers=1, timeouts=sw.Timeouts(join=-1))
    with _job().serve(workers=1, timeouts=sw.Timeouts(join=5.0)):
        pass


def test_sweep_takes_a_simulation():
    task = tasks.get("least-squares", n=64, d=4)
    job = sw.Job(task.init_params(), optimizer=sw.optim.sgd(0.1))
    kw = dict(over="workers", values=[2], steps=40, target=1e-9, stop_at_target=False)
    sim = SimConfig(compute=Fixed(0.01))
    new = sweep_lib.sweep(job, task, sim=sw.Simulation(sim, seed=2), **kw)
    again = sweep_lib.sweep(job, task, sim=sw.Simulation(sim, seed=2), **kw)
    assert new == [dict(row, wall_s=new[0]["wall_s"]) for row in again]
    for bad in ("fast", sim):  # a bare SimConfig too: sw.Simulation(config) is its one form
        with pytest.raises(TypeError, match=r"sim must be a sw\.Simulation"):
            sweep_lib.sweep(job, task, sim=bad, **kw)


def test_the_config_builds_the_groups_from_their_one_definition():
    raw = tomllib.loads(
        """
        [task]
        name = "least-squares"
        args = { n = 64, d = 4 }
        [optimizer]
        name = "sgd"
        lr = 0.1
        [run]
        workers = 2
        delay = 0.01
        stragglers = { 1 = 2.0 }
        eval_interval = 0.25
        on_worker_failure = "drop"
        max_restarts = false
        """
    )
    cfg = config.parse(raw)
    assert cfg.train["failures"] == sw.Failures("drop", max_restarts=None)
    assert cfg.train["metrics"] == sw.Metrics(every=0.25)
    assert cfg.train["emulation"] == sw.Emulation({1: 2.0}, {0: 0.01, 1: 0.01})
    assert set(sw.Failures.FIELDS.values()) <= config.TABLES["run"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the config speaks the new spelling
        result = cfg.run("sim", timeouts=sw.Timeouts(total=120))
    assert result.pushes >= 1000 and {r["run"] for r in result.records} == {"run"}


def test_serve_and_init_take_the_checkpoints_group_too(tmp_path, no_leaks):
    from stalewise import checkpoint

    job = _job()
    with job.serve(workers=1, checkpoints=sw.Checkpoints(tmp_path, every=2)) as server:
        client = server.client(0)
        for _ in range(3):
            client.pull(timeout=30)
            client.push({"x": np.ones(3, np.float32)})
            assert client.wait(timeout=30).status == "applied"
        client.close()
    assert checkpoint.load(tmp_path).version == 3  # the last one, written as the server closed
    with job.serve(workers=1, checkpoints=sw.Checkpoints(tmp_path, resume=True)) as server:
        np.testing.assert_allclose(server.pull()["x"], 1 - 3 * 0.1, rtol=1e-6)
    with pytest.raises(TypeError, match="unexpected keyword argument 'checkpoint_every'"):
        job.serve(workers=1, checkpoints=sw.Checkpoints(tmp_path), checkpoint_every=2)
    with pytest.raises(OptionError, match=r"^Checkpoints\.seconds is for Job\.train"):
        job.serve(workers=1, checkpoints=sw.Checkpoints(tmp_path, seconds=5.0))
    with pytest.raises(TypeError, match=r"^checkpoints must be a sw\.Checkpoints"):
        job.serve(workers=1, checkpoints=str(tmp_path))
    # sw.init refuses a bad group before it does anything (it may be called once only)
    with pytest.raises(
        OptionError, match=r"^Checkpoints\.seconds is for Job\.train; sw\.init saves"
    ):
        sw.init(job, checkpoints=sw.Checkpoints(tmp_path, seconds=5.0))
