"""stalewise.config as a package (schema, build, factory): its public names, and the [sim]
table read from one definition, whose errors carry their key from where they are raised."""

import copy
import pickle
import tomllib

import pytest

import stalewise.config as config
from stalewise.runtime.sim.config import TOML_KEYS, TOML_LISTS, SimConfig
from stalewise.runtime.sim.models import SimConfigError

HEAD = '[task]\nname = "least-squares"\n[optimizer]\nname = "sgd"\nlr = 0.1\n'


def test_the_public_names_are_where_they_were():
    from stalewise.config import (  # noqa: F401  (what cli.py, demo.py and the tests import)
        MAX_DELAY,
        TABLES,
        ConfigError,
        RunConfig,
        load,
        max_workers,
        parse,
        parse_strategy_value,
        strategy_from_table,
    )

    assert config.max_workers("sim") == 16384 and "sim" in config.TABLES
    assert config.parse_strategy_value("diloco:20") == ("diloco", 20)


def test_every_sim_key_is_read_from_the_one_definition():
    table = {
        "compute": "exponential",
        "shift": 0.01,
        "rate": 200.0,
        "speeds": [1.0, 2.0],
        "stragglers": {"count": 1, "slowdown": 3.0},
        "slowdowns": [{"worker": 0, "factor": 2.0, "start": 1.0, "end": 2.0}],
        "failures": [{"worker": 1, "time": 3.0}],
        "joins": [{"worker": 1, "time": 4.0}],
        "latency": 1e-4,
        "bandwidth": 1e9,
        "worker_bandwidth": 2e9,
        "shard_bandwidth": 3e9,
        "service_time": 2e-5,
        "service_rate": 5e9,
        "model_bytes": 1000,
        "restart_delay": 0.5,
        "contention_step": [1.0, 1.5],
        "contention_apply": [1.0, 1.2],
        "contention_wake": [0.0, 1e-3],
        "loop": 3e-4,
        "own_read": 0.4,
        "copy_rate": 4e10,
        "copy_bus": 8e10,
        "copy_pull": 2.0,
        "copy_push": 1.5,
        "copy_apply": 1.25,
        "copy_pull_time": 1e-5,
        "copy_push_time": 2e-5,
        "copy_cores": 2,
    }
    assert set(table) | {"step_time"} == TOML_KEYS  # step_time is compute = "fixed"'s
    cfg = SimConfig.from_dict(table)
    assert (cfg.compute.shift, cfg.network.shard_bandwidth, cfg.service.rate) == (0.01, 3e9, 5e9)
    assert (cfg.contention.apply, cfg.restart_delay, cfg.joins[0].time) == ((1.0, 1.2), 0.5, 4.0)
    assert cfg.contention.wake == (0.0, 1e-3)
    assert (cfg.loop, cfg.own_read) == (3e-4, 0.4)
    copies = cfg.copies
    assert (copies.rate, copies.bus, copies.pull, copies.push, copies.apply) == (
        4e10, 8e10, 2.0, 1.5, 1.25)  # fmt: skip
    assert (copies.pull_time, copies.push_time, copies.cores) == (1e-5, 2e-5, 2)
    assert SimConfig.from_dict({"compute": "fixed", "step_time": 0.2}).compute.time == 0.2
    assert set(TOML_LISTS) <= TOML_KEYS


@pytest.mark.parametrize(
    ("table", "path", "problem"),
    [
        ({"failures": [{"worker": 0, "time": 1}, {"worker": 1, "time": -3}]}, "failures[1].time",
         "must be a finite number >= 0, got -3"),
        ({"stragglers": {"count": 1, "slowdown": 0.5}}, "stragglers.slowdown", "got 0.5"),
        ({"compute": "fixed", "step_time": -1}, "step_time", "got -1"),
        ({"service_time": "x"}, "service_time", "got 'x'"),
        ({"contention_step": [1, -2], "contention_apply": [1]}, "contention_step", "got -2"),
        ({"joins": [{"worker": 1, "time": 2, "when": 3}]}, "joins[0].when", "unknown option"),
        ({"slowdowns": {"worker": 1}}, "slowdowns", "expected a list of tables"),
        ({"joins": [{"worker": 1}]}, "joins[0]", "missing 1 required positional argument"),
        ({"model_bytes": 0}, "model_bytes", "integer > 0, got 0"),
        ({"lateness": 1}, "lateness", "unknown option (known: bandwidth, compute,"),
    ],
)  # fmt: skip
def test_a_sim_error_carries_its_key_from_where_it_is_raised(table, path, problem):
    before = copy.deepcopy(table)
    with pytest.raises(SimConfigError) as e:
        SimConfig.from_dict(table)
    assert e.value.path == path and problem in e.value.problem
    assert table == before  # the caller's table is left as it was
    again = pickle.loads(pickle.dumps(e.value))
    assert (again.path, again.problem, str(again)) == (path, e.value.problem, str(e.value))
    with pytest.raises(config.ConfigError) as c:
        config.parse({**tomllib.loads(HEAD), "sim": table})
    assert c.value.key == f"sim.{path}" and problem in c.value.problem


def test_a_config_names_the_sim_key_with_the_workers_it_was_checked_for():
    sim = "[run]\nworkers = 2\n[sim]\nfailures = [{ worker = 0, time = 1.0 }, { worker = 2, time = 2.0 }]\n"
    raw = tomllib.loads(HEAD + sim)
    assert config.parse(raw).sim.failures[1].worker == 2  # checked for the local runtime's run
    with pytest.raises(config.ConfigError) as e:
        config.parse(raw, runtime="sim")
    assert e.value.key == "sim.failures[1].worker"
    assert e.value.problem == "not a worker of this run (0..1), got 2 (with run.workers = 2)"
    cfg = config.parse(raw)
    with pytest.raises(
        config.ConfigError, match=r"^sim\.failures\[1\]\.worker: .*run\.workers = 2"
    ):
        cfg.train_kwargs("sim")
    with pytest.raises(config.ConfigError, match=r"^--runtime: unknown runtime 'gpu' \(known: "):
        cfg.train_kwargs("gpu")
