"""Names that say one thing (issue 18): ``local_steps`` is H everywhere, ``sim_seed`` the
simulator's seed, ``sw.load_params`` the params of a checkpoint, ``sw.LocalSGD`` the loop
wrapper. The old keywords for H still work for one release, with a DeprecationWarning
naming the new one; their signature shows only the new name. The old names ``sw.load``,
``strategies.LocalSGD``, ``stalewise.averaging``/``adaptive`` and ``RunOptions(seed=)``
are gone (issue 30), and ``dir(sw)`` shows only the public names."""

import importlib
import inspect

import numpy as np
import pytest

import stalewise as sw
from stalewise import checkpoint, config, strategies
from stalewise.strategies import averaging
from stalewise.strategies.adaptive import AdaComm, CommBudget, Fixed

SGD = sw.optim.sgd(0.1)

# (old call, new call, the old keyword, the function's name in the warning)
RENAMED = [
    (lambda: strategies.local_sgd(steps=4, inner=SGD),
     lambda: strategies.local_sgd(local_steps=4, inner=SGD), "steps", "local_sgd"),
    (lambda: strategies.diloco(steps=7), lambda: strategies.diloco(local_steps=7), "steps",
     "diloco"),
    (lambda: strategies.easgd(0.5, every=3, inner=SGD),
     lambda: strategies.easgd(0.5, local_steps=3, inner=SGD), "every", "easgd"),
    (lambda: strategies.adaptive(SGD, start=8), lambda: strategies.adaptive(SGD, local_steps=8),
     "start", "adaptive"),
    (lambda: strategies.comm_budget(start=2), lambda: strategies.comm_budget(local_steps=2),
     "start", "comm_budget"),
    (lambda: strategies.adacomm(start=16), lambda: strategies.adacomm(local_steps=16), "start",
     "adacomm"),
    (lambda: strategies.fixed(steps=5), lambda: strategies.fixed(local_steps=5), "steps",
     "fixed"),
    (lambda: AdaComm(start=16), lambda: AdaComm(local_steps=16), "start",
     "AdaComm"),
    (lambda: CommBudget(start=2), lambda: CommBudget(local_steps=2), "start",
     "CommBudget"),
    (lambda: Fixed(steps=5), lambda: Fixed(local_steps=5), "steps", "Fixed"),
]  # fmt: skip


@pytest.mark.parametrize(("old", "new", "keyword", "where"), RENAMED)
def test_an_old_keyword_for_h_warns_naming_local_steps_and_builds_the_same(
    old, new, keyword, where
):
    with pytest.warns(DeprecationWarning, match=rf"^{where}: {keyword}= is now local_steps="):
        built = old()
    assert repr(built) == repr(new())
    if hasattr(built, "__eq__") and type(built).__eq__ is not object.__eq__:
        assert built == new()


def test_h_is_local_steps_in_every_signature_and_the_old_name_in_none():
    for fn in (strategies.local_sgd, strategies.diloco, strategies.easgd, strategies.adaptive,
               strategies.comm_budget, strategies.adacomm, strategies.fixed,
               averaging.LocalSGDStrategy, averaging.EASGD, AdaComm,
               CommBudget, Fixed, sw.LocalSGD, sw.LocalSGDOptax):  # fmt: skip
        params = inspect.signature(fn).parameters
        assert "local_steps" in params, fn
        assert not {"start", "steps"} & set(params), fn
    # every= is left only to delayed Nesterov's N (pushes per momentum step), never H
    assert "every" not in inspect.signature(strategies.easgd).parameters
    assert "every" in inspect.signature(strategies.diloco).parameters
    assert "every" in inspect.signature(sw.optim.delayed_nesterov).parameters
    # period= is only seconds, the budget of a dynamic round
    with pytest.raises(ValueError, match="period= is the budget of dynamic=True"):
        strategies.local_sgd(local_steps=4, inner=SGD, period=4)


def test_the_attribute_is_local_steps_too():
    assert strategies.local_sgd(3, SGD).local_steps == 3
    assert strategies.easgd(0.5, local_steps=2, inner=SGD).local_steps == 2
    assert strategies.fixed(4).local_steps == strategies.adacomm(9).local_steps - 5


def test_old_and_new_keyword_together_is_an_error():
    with pytest.raises(TypeError, match=r"local_sgd: pass local_steps= only \(steps= is its old"):
        strategies.local_sgd(local_steps=4, steps=4, inner=SGD)
    with pytest.raises(TypeError, match="easgd: pass local_steps= only"):
        strategies.easgd(0.5, local_steps=2, every=2, inner=SGD)


def test_loop_wrappers_take_local_steps_and_warn_on_every(no_leaks):
    job = sw.Job({"w": np.zeros(2, np.float32)}, optimizer=sw.optim.sgd(1.0))
    with job.serve(workers=1) as server:
        client = server.client(0)
        with pytest.warns(DeprecationWarning, match="^LocalSGDOptax: every= is now local_steps="):
            sync = sw.LocalSGDOptax(client, every=2)
        assert sync.local_steps == 2
        params = sync.pull()
        for _ in range(2):
            params = sync.after_step({"w": params["w"] + 1.0})
        assert sync.pushes == 1 and server.pull()["w"].tolist() == [2.0, 2.0]
        client.close()


def test_strategy_classes_have_one_public_name_each():
    assert sw.LocalSGD.__module__ == "stalewise.loops"
    assert "LocalSGD" not in strategies.__all__ and "LocalSGDStrategy" in strategies.__all__
    assert not hasattr(strategies, "LocalSGD")  # the old name, removed
    assert not hasattr(averaging, "LocalSGD")  # and its module's alias
    assert strategies.LocalSGDStrategy is averaging.LocalSGDStrategy
    assert type(strategies.diloco()) is strategies.LocalSGDStrategy


def test_sw_load_params_is_the_one_public_name(tmp_path):
    job = sw.Job({"x": np.arange(4, dtype=np.float32)}, optimizer=sw.optim.sgd(0.1))
    job.train(
        lambda p, b: (0.0, {"x": np.ones_like(p["x"])}),
        data=[[None]],
        workers=1,
        steps=3,
        runtime="sim",
        checkpoints=sw.Checkpoints(tmp_path),
    )
    assert "load_params" in sw.__all__ and "load" not in sw.__all__
    params = sw.load_params(tmp_path)
    assert not hasattr(sw, "load")  # the old name, removed
    assert sw.load_params is checkpoint.load_params
    assert params["x"].shape == (4,)
    # checkpoint.load reads the whole checkpoint, a different thing with its own name
    assert checkpoint.load(tmp_path).version == 3


def test_the_old_name_sw_load_says_the_new_one_in_one_line():
    new = r"^module 'stalewise' has no attribute 'load': it is now sw.load_params$"
    with pytest.raises(AttributeError, match=new):
        sw.load  # noqa: B018
    with pytest.raises(AttributeError, match=r"^module 'stalewise' has no attribute 'lod'$"):
        sw.lod  # noqa: B018


def test_dir_of_the_package_shows_only_its_public_names():
    shown = {name for name in dir(sw) if not name.startswith("__")}
    assert shown == set(sw.__all__)
    assert all(hasattr(sw, name) for name in sw.__all__)
    assert not {"Any", "annotations", "logging", "warnings"} & set(dir(sw))


@pytest.mark.parametrize("old", ["stalewise.averaging", "stalewise.adaptive"])
def test_the_old_module_paths_are_gone(old):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


def test_run_options_have_no_seed():
    kw = {"loss_and_grad": lambda p, b: (0.0, p), "data": lambda w, n: iter(()), "workers": 1}
    kw["steps"] = 5
    assert sw.RunOptions(**kw, sim_seed=3).sim_seed == 3
    assert not hasattr(sw.RunOptions(**kw), "seed")
    with pytest.raises(TypeError, match="seed"):
        sw.RunOptions(**kw, seed=3)


@pytest.mark.parametrize(
    ("table", "old", "new"),
    [
        ({"name": "diloco", "steps": 4}, "strategy.steps", "strategy.local_steps"),
        ({"name": "easgd", "alpha": 0.5, "every": 2, "inner": {"name": "sgd", "lr": 0.1}},
         "strategy.every", "strategy.local_steps"),
        ({"name": "adaptive", "start": 8, "inner": {"name": "sgd", "lr": 0.1}},
         "strategy.start", "strategy.local_steps"),
        ({"name": "adaptive", "inner": {"name": "sgd", "lr": 0.1},
          "schedule": {"name": "adacomm", "start": 8}},
         "strategy.schedule.start", "strategy.schedule.local_steps"),
    ],
)  # fmt: skip
def test_old_strategy_keys_of_a_config_warn_naming_the_new_key(table, old, new):
    task = {"name": "least-squares", "args": {"n": 64, "d": 4}}
    raw = {"task": task, "strategy": table, "server": {"consistency": "bsp"}}
    with pytest.warns(DeprecationWarning, match=rf"^{old} is now {new} "):
        cfg = config.parse(raw)
    key = new.rpartition(".")[2]
    renamed = dict(table)
    if "schedule" in table:
        renamed["schedule"] = {"name": "adacomm", key: table["schedule"]["start"]}
    else:
        renamed[key] = renamed.pop(old.rpartition(".")[2])
    assert repr(config.parse({**raw, "strategy": renamed}).job.strategy) == repr(cfg.job.strategy)
