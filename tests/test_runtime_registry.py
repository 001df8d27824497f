"""The runtime registry: Job.train, Job.serve, the config and the CLI look runtimes up in it
when they run, so a runtime registered after import is known to all of them."""

import dataclasses

import numpy as np
import pytest

import stalewise as sw
from stalewise import cli, config, runtime


class Ran(Exception):
    """Raised by the test runtime's runner and server with what they were given."""


def runner(cfg, strategy, options):
    raise Ran(cfg, strategy, options)


def server(cfg, workers, *, join_timeout):
    raise Ran(cfg, workers, join_timeout)


@pytest.fixture
def registry(monkeypatch):
    """The registry, restored after the test."""
    monkeypatch.setattr(runtime, "_RUNTIMES", dict(runtime._RUNTIMES))
    return runtime


def job():
    return sw.Job({"x": np.zeros(4, np.float32)}, optimizer=sw.optim.sgd(0.1))


def test_the_built_in_runtimes_and_the_ones_with_a_server():
    assert runtime.names() == ("local", "sim", "ray")
    assert runtime.names("server") == ("local", "ray")
    from stalewise.runtime.local.server import LocalServer

    assert runtime.server("local") is LocalServer
    assert runtime.server("ray").__name__ == "RayServer"


def test_one_description_of_each_runtime():
    local, sim, ray = map(runtime.describe, ("local", "sim", "ray"))
    assert (local.max_workers, sim.max_workers, ray.max_workers) == (4096, 16384, 4096)
    assert runtime.names("attach") == runtime.names("launch") == ("local", "ray")
    assert runtime.names("elastic_train") == ("ray",)
    assert runtime.names("delta_pulls") == ("sim", "ray")
    assert (local.resumes_from, sim.resumes_from, ray.resumes_from) == (None, "sim", None)
    assert (local.needs, sim.needs, ray.needs) == (None, None, "ray")
    assert config.max_workers("sim") == 16384
    with pytest.raises(ValueError, match=r"^runtime 'sim' has no attach; runtimes with one: "):
        sim.load("attach")
    with pytest.raises(dataclasses.FrozenInstanceError):
        sim.max_workers = 1


def test_what_a_runtime_can_do_is_its_descriptors_and_no_module_compares_its_name(registry):
    assert runtime.names("connect") == ("ray",) and runtime.names("simulated") == ("sim",)
    assert runtime.names("transport") == runtime.names("saves_served") == ("local",)
    assert runtime.names("watches_ranks") == ("local",)
    assert runtime.names("calibrates") == ("local", "ray")
    kw = {"loss_and_grad": lambda p, b: (0.0, p), "data": [[None]], "workers": 1, "steps": 1}
    options = sw.RunOptions(**kw, transport=0.5)
    with pytest.raises(ValueError, match="transport is emulated by runtime local only, not 'sim'"):
        options.check_runtime("sim")
    runtime.register("wire", runner, transport=True)  # a runtime that emulates it too
    options.check_runtime("wire")
    with pytest.raises(ValueError, match="by runtime local or wire only, not 'sim'"):
        options.check_runtime("sim")
    # the facts are read from the registry: no module outside it compares a runtime's name
    import ast
    from pathlib import Path

    names, found = set(runtime.names()), []
    for path in sorted(Path(runtime.__file__).parents[1].rglob("*.py")):
        if path == Path(runtime.__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            strings = {n.value for s in sides for n in ast.walk(s) if isinstance(n, ast.Constant)}
            if strings & names and "runtime" in ast.unparse(node):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "runtime names compared outside the registry:\n" + "\n".join(found)


def test_a_registered_runtime_is_described_to_attach_and_pulls(registry):
    registry.register("mine", runner, attach=lambda name, **kw: ("mine", name, kw))
    assert sw.attach("job", runtime="mine") == ("mine", "job", {"worker": None, "timeout": 30.0})
    assert "use runtime 'sim' or 'ray'" in registry.pull_refusal("int8", "mine")
    assert "'mine' does not send delta pulls" in registry.pull_refusal("int8", "mine")
    with pytest.raises(sw.AttachError, match=r"^runtime 'sim': a process attaches to 'local' "):
        sw.attach("job", runtime="sim")


def test_serve_refuses_a_runtime_without_a_server_or_an_unknown_one():
    with pytest.raises(
        ValueError,
        match=r"^runtime 'sim' has no server for a loop you own; runtimes with one: local, ray$",
    ):
        job().serve(workers=1, runtime="sim")
    with pytest.raises(ValueError, match=r"^unknown runtime 'nope'; known: local, sim, ray$"):
        job().serve(workers=1, runtime="nope")


def test_a_registered_runtime_is_known_to_train_serve_the_config_and_the_cli(registry):
    with pytest.raises(config.ConfigError, match="unknown runtime 'mine'"):
        cli._check_runtime("mine")
    registry.register("mine", runner, server=server)
    assert registry.names() == ("local", "sim", "ray", "mine")
    assert registry.names("server") == ("local", "ray", "mine")
    cli._check_runtime("mine")  # no longer refused
    j = job()
    with pytest.raises(Ran) as ran:
        j.train(lambda p, b: (0.0, p), data=[[None]], workers=1, steps=1, runtime="mine")
    cfg, strategy, options = ran.value.args
    assert cfg is j.config and strategy == sw.strategies.gradients() and options.steps == 1
    with pytest.raises(Ran) as ran:
        j.serve(workers=3, runtime="mine", timeouts=sw.Timeouts(join=5.0))
    assert ran.value.args == (j.config, 3, 5.0)
    registry.register("mine", "stalewise.runtime.sim:run")  # again, by path, without a server
    assert registry.get("mine") is registry.get("sim")
    assert registry.names("server") == ("local", "ray")


@pytest.mark.parametrize(
    ("name", "runner_", "server_", "message"),
    [
        ("", runner, None, r"^a runtime needs a non-empty name, got ''$"),
        ("x", None, None, r"^runtime 'x': runner must be a callable or a 'module:name' string"),
        ("x", "no colon", None, r"^runtime 'x': runner must be a callable or a 'module:name'"),
        ("x", runner, 42, r"^runtime 'x': server must be a callable or a 'module:name' string"),
    ],
)
def test_register_refuses_what_it_could_not_call(registry, name, runner_, server_, message):
    with pytest.raises(ValueError, match=message):
        registry.register(name, runner_, server=server_)
    assert registry.names() == ("local", "sim", "ray")  # unharmed
