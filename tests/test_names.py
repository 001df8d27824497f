"""Names that say one thing (issue 18): ``local_steps`` is H everywhere, ``sim_seed`` the
simulator's seed, ``sw.load_params`` the params of a checkpoint, ``sw.LocalSGD`` the loop
wrapper; the old keywords for H are gone (issue 43). The old names ``sw.load``,
``strategies.LocalSGD``, ``stalewise.averaging``/``adaptive`` and ``RunOptions(seed=)``
are gone (issue 30), and ``dir(sw)`` shows only the public names."""

import importlib
import inspect

import numpy as np
import pytest

import stalewise as sw
from stalewise import checkpoint, strategies
from stalewise.strategies import averaging
from stalewise.strategies.adaptive import AdaComm, CommBudget, Fixed

SGD = sw.optim.sgd(0.1)


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


def test_loop_wrappers_take_local_steps(no_leaks):
    job = sw.Job({"w": np.zeros(2, np.float32)}, optimizer=sw.optim.sgd(1.0))
    with job.serve(workers=1) as server:
        client = server.client(0)
        sync = sw.LocalSGDOptax(client, local_steps=2)
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
