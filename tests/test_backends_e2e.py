"""End to end: real local processes train each backend's model to a stated bar.

The digits tasks (NumPy, PyTorch, JAX) must reach ACCURACY held-out accuracy;
the runs stop early (``stop_at``) at STOP_AT, above the bar, so a run normally
ends long before its push budget. The TensorFlow run is a noise-free least
squares whose ``loss_and_grad`` uses ``tf.GradientTape`` on the pulled tensors.
The NumPy digits job is also trained by the simulator: one Job, two runtimes.
"""

import mp_helpers
import numpy as np
import pytest

import stalewise as sw
from stalewise import tasks

ACCURACY = 0.93  # held-out accuracy every digits run must reach
STOP_AT = {"accuracy": 0.95}  # stop once a record gets here (margin over ACCURACY)
BUDGET = 1500  # pushes; the runs reach STOP_AT after about 150-400
TIMEOUT = 300.0  # wall seconds before a run is declared hung


def _leaf_type(backend):
    if backend == "torch":
        import torch

        return torch.Tensor
    if backend == "jax":
        import jax

        return jax.Array
    return np.ndarray


def _check_digits(task, result, backend):
    assert result.pushes >= 1 and result.stats["applied"] >= 1
    assert result.records and "accuracy" in result.records[-1]
    assert sorted(result.params) == ["layer1", "layer2"]
    for layer in ("layer1", "layer2"):
        for name in ("w", "b"):
            leaf = result.params[layer][name]
            assert isinstance(leaf, _leaf_type(backend)), (layer, name, type(leaf))
            assert str(leaf.dtype).removeprefix("torch.") == "float32"
    final = task.evaluate(result.params)
    assert final["accuracy"] >= ACCURACY, (final, result.records[-1], result.pushes)


def test_digits_numpy_job_reaches_the_bar_in_local_and_sim_runtimes(no_leaks):
    """3 workers, SSP(2), LAMB: the same Job object, trained by each runtime."""
    task = tasks.get("digits")
    job = sw.Job(
        task.init_params(0),
        optimizer=sw.optim.lamb(0.004, weight_decay=1e-4, exclude_from_weight_decay=["b$"]),
        consistency=sw.SSP(2),
        staleness=sw.staleness.inverse(),
    )
    for runtime in ("local", "sim"):
        result = job.train(
            task.loss_and_grad,
            data=task.batches,
            workers=3,
            steps=BUDGET,
            runtime=runtime,
            evaluate=task.evaluate,
            stop_at=STOP_AT,
            metrics=sw.Metrics(every=0.1),
            timeouts=sw.Timeouts(total=TIMEOUT),
        )
        _check_digits(task, result, "numpy")


@pytest.mark.parametrize(
    "name, workers, consistency, optimizer, shards",
    [
        ("digits-torch", 2, sw.ASP(), sw.optim.adam(0.003), 1),
        ("digits-jax", 3, sw.SSP(3), sw.optim.lamb(0.004), 2),
    ],
    ids=["torch-asp-adam", "jax-ssp-lamb-2shards"],
)
def test_digits_backend_reaches_the_bar_locally(
    no_leaks, name, workers, consistency, optimizer, shards
):
    backend = name.removeprefix("digits-")
    pytest.importorskip(backend)
    task = tasks.get(name)
    job = sw.Job(task.init_params(0), optimizer=optimizer, consistency=consistency, shards=shards)
    result = job.train(
        task.loss_and_grad,
        data=task.batches,
        workers=workers,
        steps=BUDGET,
        evaluate=task.evaluate,
        stop_at=STOP_AT,
        metrics=sw.Metrics(every=0.1),
        timeouts=sw.Timeouts(total=TIMEOUT),
    )
    _check_digits(task, result, backend)


def test_tensorflow_least_squares_reaches_the_optimum_locally(no_leaks):
    """2 workers push tf.GradientTape gradients for tf.Variable params; SGD on the server."""
    tf = pytest.importorskip("tensorflow")
    params = mp_helpers.tf_linear_init()
    job = sw.Job(params, optimizer=sw.optim.sgd(0.1, momentum=0.5))
    result = job.train(
        mp_helpers.tf_linear_loss_and_grad,
        data=mp_helpers.tf_linear_data,
        workers=2,
        steps=400,
        evaluate=mp_helpers.tf_linear_evaluate,
        metrics=sw.Metrics(every=0.1),
        timeouts=sw.Timeouts(total=TIMEOUT),
    )
    assert result.pushes >= 400
    assert isinstance(result.params["w"], tf.Tensor) and result.params["w"].shape == (8,)
    assert isinstance(result.params["b"], tf.Tensor) and result.params["b"].shape == ()
    assert result.params["w"].dtype == tf.float32
    final = mp_helpers.tf_linear_evaluate(result.params)
    assert final["distance"] <= 1e-3, final  # from 1.0 at the zero start
    assert final["loss"] <= 1e-6, final
    np.testing.assert_array_equal(params["w"].numpy(), np.zeros(8))  # the job copied them
