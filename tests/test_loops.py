"""sw.LocalSGD and sw.LocalSGDOptax: local SGD / DiLoCo for loops the user owns."""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import stalewise as sw

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HALF = 0.5  # server sgd(0.5): the global params move half way to the worker's local ones


def _torch_setup():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 3), torch.randn(16, 2)

    def step():
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()

    return torch, model, opt, step


def _flat(model):
    return np.concatenate([p.detach().numpy().ravel() for _, p in sorted(model.named_parameters())])


def test_torch_wrapper_pushes_every_h_steps_and_pulls_the_global_params(no_leaks):
    torch, model, opt, step = _torch_setup()
    job = sw.Job(model, optimizer=sw.optim.sgd(HALF))
    start = _flat(model)
    before_sync = []  # the worker's local params after each step, before the wrapper syncs
    watch = opt.register_step_post_hook(lambda *a: before_sync.append(_flat(model)))
    with job.serve(workers=1) as server:
        client = server.client(0)
        with torch.no_grad():  # local edits are overwritten by the pull at enter
            for p in model.parameters():
                p.add_(1.0)
        with sw.LocalSGD(client, model, opt, local_steps=3, remainder="push") as sync:
            np.testing.assert_array_equal(_flat(model), start)  # pulled at enter
            glob = start
            for i in range(1, 8):
                step()
                if i % 3 == 0:  # synced: the model holds the new global params
                    local = before_sync[-1]
                    glob = glob - HALF * (glob - local)
                    np.testing.assert_allclose(_flat(model), glob, rtol=1e-6)
                    np.testing.assert_array_equal(_flat(model), _server_flat(server, model))
                    assert sync.pushes == i // 3 and sync.pending == 0
                else:
                    np.testing.assert_array_equal(_flat(model), before_sync[-1])
                    assert sync.pending == i % 3
            assert sync.steps == 7 and sync.pushes == 2
            local = _flat(model)
        assert sync.pushes == 3  # the remaining step was pushed at exit ...
        assert [r.status for r in sync.results] == ["applied"] * 3
        np.testing.assert_allclose(_server_flat(server, model), glob - HALF * (glob - local))
        np.testing.assert_array_equal(_flat(model), local)  # ... and not pulled
        assert sum(s["applied"] for s in server.stats()) == 3
        step()  # the hook is gone: nothing more is pushed
        assert sync.steps == 7 and sync.pushes == 3
        assert list(opt._optimizer_step_post_hooks) == [watch.id]
        client.close()
    watch.remove()


def _server_flat(server, model):
    pulled = server.pull()  # a dict name -> tensor, as the Job was made from a module
    return np.concatenate([pulled[n].numpy().ravel() for n, _ in sorted(model.named_parameters())])


def test_torch_wrapper_pushes_nothing_after_an_error_but_removes_its_hook(no_leaks):
    _, model, opt, step = _torch_setup()
    job = sw.Job(model, optimizer=sw.optim.sgd(1.0))
    with job.serve(workers=1) as server:
        client = server.client(0)
        with (
            pytest.raises(RuntimeError, match="boom"),
            sw.LocalSGD(client, model, opt, local_steps=4),
        ):
            step()
            raise RuntimeError("boom")
        assert not opt._optimizer_step_post_hooks
        with sw.LocalSGD(client, model, opt, local_steps=4) as sync:  # exact multiple: no remainder
            for _ in range(4):
                step()
        assert sync.pushes == 1 and not opt._optimizer_step_post_hooks
        assert sum(s["applied"] for s in server.stats()) == 1
        client.close()


@pytest.mark.parametrize("wrapper", ["torch", "optax"])
def test_a_partial_last_round_is_dropped_by_default(no_leaks, wrapper):
    """Issue 19: leaving the block with fewer than ``every`` steps since the last sync
    pushed them, and DiLoCo's outer Nesterov made a full outer step of them (a small
    GPT's val loss rose 0.05-0.10). Now the global params stay those of the last full
    round, exactly; ``remainder="push"`` still pushes them (tested above)."""
    _, model, opt, step = _torch_setup()
    job = sw.Job(model, optimizer=sw.optim.sgd(0.7, momentum=0.9, nesterov=True))
    with job.serve(workers=1) as server:
        client = server.client(0)
        if wrapper == "torch":
            with sw.LocalSGD(client, model, opt, local_steps=4) as sync:
                for i in range(1, 11):  # 2 rounds and 2 steps
                    step()
                    if i == 8:
                        after_rounds = _server_flat(server, model)
        else:
            with sw.LocalSGDOptax(client, local_steps=4) as sync:
                params = sync.params
                for i in range(1, 11):
                    params = sync.after_step({k: v - 0.01 for k, v in params.items()})
                    if i == 8:
                        after_rounds = _server_flat(server, model)
        assert sync.pushes == 2 and sync.steps == 10 and sync.pending == 2
        np.testing.assert_array_equal(_server_flat(server, model), after_rounds)
        assert sum(s["applied"] for s in server.stats()) == 2
        with pytest.raises(ValueError, match=r"remainder must be one of drop, push, got 'keep'"):
            sw.LocalSGD(client, model, opt, local_steps=4, remainder="keep")
        client.close()


def test_torch_wrapper_takes_a_job_made_from_named_parameters_and_checks_its_arguments():
    torch, model, opt, _ = _torch_setup()
    job = sw.Job(dict(model.named_parameters()), optimizer=sw.optim.sgd(1.0))
    with job.serve(workers=1) as server:
        client = server.client(0)
        sw.LocalSGD(client, model, opt, local_steps=2)  # the same layout
        with pytest.raises(ValueError, match="local_steps must be an integer >= 1"):
            sw.LocalSGD(client, model, opt, local_steps=0)
        with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
            sw.LocalSGD(client, model, object(), local_steps=2)
        other = torch.nn.Linear(3, 2)
        with pytest.raises(ValueError, match="missing key"):
            sw.LocalSGD(client, other, torch.optim.SGD(other.parameters(), lr=0.1), local_steps=2)
        client.close()


def test_optax_wrapper_pushes_every_h_steps_and_returns_the_pulled_params(no_leaks):
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    jnp = jax.numpy
    params = {"w": jnp.arange(4.0, dtype=jnp.float32), "b": jnp.zeros(2, jnp.float32)}
    job = sw.Job(params, optimizer=sw.optim.sgd(HALF))
    opt = optax.sgd(0.1)
    grad = jax.grad(lambda p: (p["w"] ** 2).sum() + ((p["b"] - 1.0) ** 2).sum())
    with job.serve(workers=1) as server:
        client = server.client(0)
        with sw.LocalSGDOptax(client, local_steps=2, remainder="push") as sync:
            p = sync.params
            assert isinstance(p["w"], jax.Array)
            glob = {k: np.asarray(v) for k, v in params.items()}
            state = opt.init(p)
            for i in range(1, 6):
                updates, state = opt.update(grad(p), state)
                local = optax.apply_updates(p, updates)
                p = sync.after_step(local)
                if i % 2 == 0:
                    glob = {k: glob[k] - HALF * (glob[k] - np.asarray(local[k])) for k in glob}
                    pulled = server.pull()
                    for k in glob:
                        np.testing.assert_allclose(np.asarray(p[k]), glob[k], rtol=1e-6)
                        np.testing.assert_array_equal(np.asarray(pulled[k]), np.asarray(p[k]))
                    assert sync.pushes == i // 2
                else:
                    assert p is local
            assert sync.pushes == 2 and sync.pending == 1
        assert sync.pushes == 3 and sync.pending == 0
        assert [r.status for r in sync.results] == ["applied"] * 3
        final = server.pull()
        for k in glob:
            expected = glob[k] - HALF * (glob[k] - np.asarray(local[k]))
            np.testing.assert_allclose(np.asarray(final[k]), expected, rtol=1e-6)
        assert sum(s["applied"] for s in server.stats()) == 3
        client.close()


def test_optax_wrapper_without_with_and_on_numpy_params():
    job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(1.0))
    with job.serve(workers=1) as server:
        client = server.client(0)
        sync = sw.LocalSGDOptax(client, local_steps=3)
        sync.after_step({"w": np.ones(3, np.float32)})
        with pytest.raises(RuntimeError, match="push before the first pull"):
            sync.finish()
        params = sync.pull()
        for _ in range(3):
            params = sync.after_step({"w": params["w"] + 1.0})
        assert params["w"].tolist() == [3.0, 3.0, 3.0] and sync.pushes == 1
        sync.finish()  # nothing pending: no push
        assert sync.pushes == 1
        sync.finish({"w": params["w"] - 1.0})  # nothing pending still: no push
        assert sync.pushes == 1
        params = sync.after_step({"w": params["w"] - 1.0})
        sync.finish()
        assert sync.pushes == 2 and server.pull()["w"].tolist() == [2.0, 2.0, 2.0]
        client.close()


@pytest.mark.slow
def test_torch_local_sgd_example_trains():
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "torch_local_sgd.py")],
        cwd=EXAMPLES.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == 0, out
    assert re.search(r"^plain loop:\s+training accuracy \d\.\d+$", proc.stdout, re.M), out
    found = re.findall(r"^4 local-SGD workers: training accuracy (\d\.\d+)$", proc.stdout, re.M)
    assert len(found) == 1 and float(found[0]) >= 0.9, out
