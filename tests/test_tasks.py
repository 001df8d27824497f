"""Tests for the built-in tasks (stalewise.tasks)."""

from __future__ import annotations

import itertools
import pickle
import tracemalloc

import numpy as np
import pytest

from stalewise import tasks
from stalewise.tasks.base import shard_batches, shard_indices
from stalewise.tasks.digits import Digits, init_mlp, load_digits_split
from stalewise.tasks.least_squares import LeastSquares


def _leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _numpy(tree: dict) -> dict[str, np.ndarray]:
    return {
        k: (v.detach().numpy() if hasattr(v, "detach") else np.asarray(v))
        for k, v in _leaves(tree).items()
    }


# ----------------------------------------------------------------------------- registry


def test_get_builds_every_registered_task():
    assert tasks.names() == ["digits", "digits-jax", "digits-torch", "least-squares", "lm"]
    for name in tasks.names():
        task = tasks.get(name)
        assert task.name == name
        assert isinstance(task, tasks.Task)


def test_get_passes_kwargs_and_rejects_unknown_names():
    assert tasks.get("least-squares", d=7).init_params()["x"].shape == (7,)
    with pytest.raises(ValueError, match="digits, digits-jax, digits-torch, least-squares"):
        tasks.get("mnist")
    with pytest.raises(TypeError):
        tasks.get("digits", no_such_option=1)


# ----------------------------------------------------------------------------- sharding


@pytest.mark.parametrize("n,workers", [(10, 3), (1437, 4), (5, 5), (7, 1)])
def test_shards_are_disjoint_and_cover_the_data(n, workers):
    shards = [shard_indices(n, w, workers) for w in range(workers)]
    joined = np.concatenate(shards)
    assert sorted(joined.tolist()) == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_shard_batches_reshuffle_each_epoch_deterministically():
    def epochs(seed, worker=1):
        it = shard_batches(40, 4, worker=worker, workers=2, seed=seed)
        batches = [next(it) for _ in range(15)]  # 5 batches per epoch, 3 epochs
        return [np.concatenate(batches[i : i + 5]) for i in (0, 5, 10)]

    first = epochs(seed=0)
    shard = set(range(1, 40, 2))
    for epoch in first:
        assert set(epoch.tolist()) == shard and len(epoch) == 20
    assert not np.array_equal(first[0], first[1])
    assert all(np.array_equal(a, b) for a, b in zip(first, epochs(seed=0), strict=True))
    assert not np.array_equal(first[0], epochs(seed=1)[0])


def test_shard_batches_have_a_constant_size():
    it = shard_batches(10, 4, worker=0, workers=3, seed=0)  # shard of 4
    assert {len(b) for b in itertools.islice(it, 10)} == {4}
    it = shard_batches(10, 32, worker=0, workers=3, seed=0)  # batch larger than the shard
    assert {len(b) for b in itertools.islice(it, 3)} == {4}


@pytest.mark.parametrize("worker,workers", [(-1, 2), (2, 2), (0, 0), (0, 11)])
def test_bad_worker_indices_raise(worker, workers):
    with pytest.raises(ValueError):
        next(shard_batches(10, 2, worker, workers))


# ----------------------------------------------------------------------------- digits


def test_digits_split_is_stratified_and_standardised():
    data = load_digits_split(seed=0)
    assert len(data.y_train) + len(data.y_test) == 1797
    train_counts = np.bincount(data.y_train, minlength=10)
    test_counts = np.bincount(data.y_test, minlength=10)
    np.testing.assert_allclose(test_counts / (train_counts + test_counts), 0.2, atol=0.01)
    assert data.x_train.dtype == np.float32 and data.y_train.dtype == np.int64
    std = data.x_train.std(axis=0)
    varying = std > 0
    np.testing.assert_allclose(data.x_train.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(std[varying], 1.0, atol=1e-4)
    assert not data.x_train.flags.writeable
    other = load_digits_split(seed=1)
    assert not np.array_equal(other.y_test, data.y_test)


@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_digits_init(activation):
    p = init_mlp(hidden=128, activation=activation, seed=0)
    shapes = {k: v.shape for k, v in _leaves(p).items()}
    assert shapes == {
        "layer1/w": (64, 128),
        "layer1/b": (128,),
        "layer2/w": (128, 10),
        "layer2/b": (10,),
    }
    assert all(v.dtype == np.float32 for v in _leaves(p).values())
    assert not p["layer1"]["b"].any() and not p["layer2"]["b"].any()
    expected_var = 2 / 64 if activation == "relu" else 2 / (64 + 128)
    assert p["layer1"]["w"].var() == pytest.approx(expected_var, rel=0.1)
    same, other = init_mlp(128, activation, seed=0), init_mlp(128, activation, seed=1)
    assert np.array_equal(same["layer1"]["w"], p["layer1"]["w"])
    assert not np.array_equal(other["layer1"]["w"], p["layer1"]["w"])


@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_digits_gradient_matches_finite_differences(activation):
    task = Digits(hidden=16, activation=activation)
    params = {
        k: {kk: vv.astype(np.float64) for kk, vv in v.items()}
        for k, v in task.init_params(seed=1).items()
    }
    params["layer1"]["b"] += 0.1  # nonzero biases exercise their gradient path
    x, y = next(task.batches(0, 1, seed=0))
    batch = (x.astype(np.float64), y)
    loss, grads = task.loss_and_grad(params, batch)
    assert grads["layer1"]["w"].dtype == np.float64
    rng = np.random.default_rng(0)
    eps = 1e-6
    for layer, key in itertools.product(("layer1", "layer2"), ("w", "b")):
        arr = params[layer][key]
        for flat in rng.choice(arr.size, size=min(arr.size, 40), replace=False):
            idx = np.unravel_index(flat, arr.shape)
            orig = arr[idx]
            arr[idx] = orig + eps
            up, _ = task.loss_and_grad(params, batch)
            arr[idx] = orig - eps
            down, _ = task.loss_and_grad(params, batch)
            arr[idx] = orig
            numeric = (up - down) / (2 * eps)
            assert grads[layer][key][idx] == pytest.approx(numeric, rel=1e-5, abs=1e-8)
    assert loss == pytest.approx(task.loss_and_grad(params, batch)[0])


@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_digits_gradient_of_a_saturated_model_holds_no_subnormal_number(activation):
    """A model sure of its batch's class (the others' probabilities about 1e-41, subnormal in
    float32): the gradient is the float64 one within float32's rounding, with no subnormal
    number (they made the backward's products 5-15x slower late in a DiLoCo run)."""
    task = Digits(hidden=64, activation=activation)
    params = task.init_params(seed=1)
    data = load_digits_split()
    c = int(data.y_train[0])
    x, y = data.x_train[data.y_train == c][:16], data.y_train[data.y_train == c][:16]
    params["layer2"]["w"] *= 1e-3
    params["layer2"]["b"][:] = 0.0
    params["layer2"]["b"][c] = 95.0
    _, grads = task.loss_and_grad(params, (x, y))
    wide = {k: {kk: vv.astype(np.float64) for kk, vv in v.items()} for k, v in params.items()}
    _, exact = task.loss_and_grad(wide, (x.astype(np.float64), y))
    tiny = np.finfo(np.float32).tiny
    for layer, key in itertools.product(("layer1", "layer2"), ("w", "b")):
        g = grads[layer][key]
        assert not np.any((g != 0) & (np.abs(g) < tiny)), f"{layer}.{key}"
        np.testing.assert_allclose(g, exact[layer][key], rtol=1e-3, atol=1e-30)


def test_digits_batches_are_the_workers_shard():
    task = Digits(batch_size=8)
    data = task.data
    x, y = next(task.batches(2, 3, seed=4))
    idx = next(shard_batches(task.num_train, 8, 2, 3, seed=4))
    np.testing.assert_array_equal(x, data.x_train[idx])
    np.testing.assert_array_equal(y, data.y_train[idx])


STEPS_TO_95 = 250  # Adam lr 3e-3 on digits, seed 0: 125 steps measured (accuracy read every 25)


def test_single_worker_adam_reaches_95_percent_quickly():
    task = tasks.get("digits")
    params = task.init_params(seed=0)
    m = {k: np.zeros_like(v) for k, v in _leaves(params).items()}
    v = {k: np.zeros_like(a) for k, a in _leaves(params).items()}
    lr, b1, b2 = 3e-3, 0.9, 0.999
    batches = task.batches(0, 1, seed=0)
    accuracy, step = 0.0, 0
    while accuracy < 0.95 and step < 2000:
        step += 1
        _, grads = task.loss_and_grad(params, next(batches))
        for path, g in _leaves(grads).items():
            layer, key = path.split("/")
            m[path] = b1 * m[path] + (1 - b1) * g
            v[path] = b2 * v[path] + (1 - b2) * g * g
            update = (m[path] / (1 - b1**step)) / (np.sqrt(v[path] / (1 - b2**step)) + 1e-8)
            params[layer][key] = params[layer][key] - lr * update
        if step % 25 == 0:
            accuracy = task.evaluate(params)["accuracy"]
    # "quickly" in steps, not seconds (a loaded machine); seed 0 gets there in STEPS_TO_95
    assert accuracy >= 0.95 and step <= STEPS_TO_95, f"{accuracy:.3f} after {step} steps"
    assert params["layer1"]["w"].dtype == np.float32


def test_single_worker_sgd_reaches_95_percent():
    task = tasks.get("digits", activation="relu")
    params = task.init_params(seed=2)
    batches = task.batches(0, 1, seed=2)
    accuracy = 0.0
    for step in range(1, 3001):
        _, grads = task.loss_and_grad(params, next(batches))
        for layer in params:
            for key in params[layer]:
                params[layer][key] = params[layer][key] - 0.05 * grads[layer][key]
        if step % 50 == 0:
            accuracy = task.evaluate(params)["accuracy"]
            if accuracy >= 0.95:
                break
    assert accuracy >= 0.95


@pytest.mark.parametrize("activation", ["tanh", "relu"])
def test_backends_agree(activation):
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    backends = [tasks.get(n, hidden=32, activation=activation) for n in tasks.names()[:3]]
    params = [t.init_params(seed=3) for t in backends]
    batches = [next(t.batches(1, 3, seed=5)) for t in backends]
    assert isinstance(params[1]["layer1"]["w"], jax.Array)
    assert isinstance(params[2]["layer1"]["w"], torch.Tensor)
    reference = _numpy(params[0])
    for p in params[1:]:
        for k, arr in _numpy(p).items():
            np.testing.assert_array_equal(arr, reference[k])
    results = [t.loss_and_grad(p, b) for t, p, b in zip(backends, params, batches, strict=True)]
    loss0, grads0 = results[0]
    for (loss, grads), p in zip(results[1:], params[1:], strict=True):
        assert isinstance(loss, float)
        assert loss == pytest.approx(loss0, rel=1e-4)
        assert type(grads["layer2"]["w"]) is type(p["layer2"]["w"])
        assert str(grads["layer2"]["w"].dtype).endswith("float32")
        g0 = _numpy(grads0)
        for k, g in _numpy(grads).items():
            np.testing.assert_allclose(g, g0[k], rtol=1e-4, atol=1e-6)
    metrics = [t.evaluate(p) for t, p in zip(backends, params, strict=True)]
    for m in metrics[1:]:
        assert m["accuracy"] == metrics[0]["accuracy"]
        assert m["loss"] == pytest.approx(metrics[0]["loss"], rel=1e-5)


@pytest.mark.parametrize("name", ["digits", "digits-torch", "digits-jax", "least-squares"])
def test_tasks_pickle_small_and_equivalent(name):
    task = tasks.get(name)
    params = task.init_params(seed=0)
    batch = next(task.batches(0, 2, seed=0))
    blob = pickle.dumps(task)
    assert len(blob) < 2000  # configuration only: data are rebuilt in the worker
    clone = pickle.loads(blob)
    assert repr(clone) == repr(task)
    assert clone.loss_and_grad(params, batch)[0] == task.loss_and_grad(params, batch)[0]


# ----------------------------------------------------------------------------- least squares


def test_least_squares_minibatch_gradient_and_metrics():
    task = LeastSquares(n=256, d=16, batch_size=8)
    a, b = next(task.batches(1, 4, seed=0))
    assert a.shape == (8, 16) and b.shape == (8,)
    x = np.random.default_rng(0).standard_normal(16).astype(np.float32)
    loss, grads = task.loss_and_grad({"x": x}, (a, b))
    r = a.astype(np.float64) @ x - b
    assert loss == pytest.approx(0.5 * np.mean(r**2), rel=1e-5)
    np.testing.assert_allclose(grads["x"], a.T.astype(np.float64) @ r / 8, rtol=1e-4, atol=1e-5)
    assert grads["x"].dtype == np.float32
    assert task.evaluate(task.init_params())["distance"] == pytest.approx(1.0)
    at_opt = task.evaluate({"x": task.x_star})
    assert at_opt["distance"] == 0.0 and at_opt["loss"] < 1e-10
    assert task.optimal_loss == 0.0


def test_least_squares_with_noise_has_a_least_squares_optimum():
    task = LeastSquares(n=300, d=10, noise=0.5, seed=3)
    x_opt = task.optimum()
    assert not np.array_equal(x_opt, task.x_star)
    _, grads = task.loss_and_grad({"x": x_opt}, None)
    assert np.abs(grads["x"]).max() < 1e-5
    assert task.evaluate({"x": x_opt})["loss"] == pytest.approx(task.optimal_loss, rel=1e-4)
    assert task.optimal_loss == pytest.approx(0.5 * 0.25 * (300 - 10) / 300, rel=0.25)
    assert task.evaluate({"x": task.x_star})["loss"] > task.optimal_loss


@pytest.mark.parametrize("n,d,noise", [(512, 32, 0.0), (512, 32, 0.1), (64, 300, 0.0)])
def test_least_squares_exact_gradient_is_the_full_gradient(n, d, noise):
    task = LeastSquares(n=n, d=d, noise=noise, exact=True)
    assert next(task.batches(4999, 5000)) is None  # any number of workers
    x = np.random.default_rng(1).standard_normal(d).astype(np.float32)
    loss, grads = task.loss_and_grad({"x": x}, next(task.batches(0, 1)))
    a, b, _ = task._data()
    r = a.astype(np.float64) @ x - b
    assert loss == pytest.approx(0.5 * np.mean(r**2), rel=1e-4)
    expected = a.T.astype(np.float64) @ r / n
    np.testing.assert_allclose(grads["x"], expected, rtol=1e-3, atol=1e-4 * np.abs(expected).max())
    assert loss == pytest.approx(task.evaluate({"x": x})["loss"], rel=1e-4)


def test_least_squares_gradient_descent_converges():
    task = LeastSquares(n=1024, d=32, exact=True)
    params = task.init_params()
    for _ in range(60):
        _, g = task.loss_and_grad(params, None)
        params = {"x": params["x"] - 0.7 * g["x"]}
    assert task.evaluate(params)["distance"] < 1e-4


def test_least_squares_minibatch_sgd_converges():
    task = LeastSquares(n=1024, d=16, batch_size=32)
    params = task.init_params()
    it = task.batches(0, 2, seed=0)
    for _ in range(300):
        _, g = task.loss_and_grad(params, next(it))
        params = {"x": params["x"] - 0.3 * g["x"]}
    assert task.evaluate(params)["distance"] < 1e-3


def test_least_squares_condition_number():
    a, _, _ = LeastSquares(n=4000, d=20, condition=100.0)._data()
    eig = np.linalg.eigvalsh(a.T.astype(np.float64) @ a / 4000)
    assert 40 < eig[-1] / eig[0] < 250


def test_least_squares_large_d_is_cheap_and_deterministic():
    # cheap in memory (traced by numpy's allocator), not wall time: A is 256 x 10_000
    # float32 (10 MB); no d x d Gram matrix (400 MB) is built for d > 2048
    tracemalloc.start()
    try:
        task = LeastSquares(n=256, d=10_000, seed=7)
        params = task.init_params()
        loss, grads = task.loss_and_grad(params, next(task.batches(0, 8)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert grads["x"].shape == (10_000,) and np.isfinite(loss)
    assert peak < 64e6, f"{peak / 1e6:.0f} MB"
    clone = pickle.loads(pickle.dumps(task))
    np.testing.assert_array_equal(clone.x_star, task.x_star)


def test_least_squares_rejects_bad_arguments():
    with pytest.raises(ValueError):
        LeastSquares(d=0)
    with pytest.raises(ValueError):
        LeastSquares(condition=0.5)
    with pytest.raises(ValueError):
        next(LeastSquares(n=4).batches(0, 5))
    with pytest.raises(ValueError):
        LeastSquares(exact=True).batches(3, 3)
