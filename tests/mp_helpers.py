"""Module-level functions for tests that start worker processes (spawned children import them)."""

import time

import numpy as np


def quadratic_loss_and_grad(params, batch):
    """0.5 * ||x - target||^2 with the target as the batch; NumPy."""
    diff = params["x"] - batch
    return float(0.5 * (diff**2).sum()), {"x": diff}


def quadratic_data(worker, workers):
    rng = np.random.default_rng(worker)
    while True:
        yield (np.arange(8, dtype=np.float32) + rng.normal(scale=0.01, size=8)).astype(np.float32)


def failing_loss_and_grad(params, batch):
    if batch >= 3:
        raise ValueError(f"boom at batch {batch}")
    return quadratic_loss_and_grad(params, np.zeros(8, np.float32))


def counting_data(worker, workers):
    return iter(range(10**9))


def slow_loss_and_grad(params, batch):
    time.sleep(0.05)
    return quadratic_loss_and_grad(params, np.zeros(8, np.float32))


def uniform_pusher(client, pushes):
    """Pushes vectors of ones; with sgd(lr=1) every shard stays uniform at every version."""
    for _ in range(pushes):
        client.pull(copy=False)
        client.push({"x": np.ones(client._spec.size, np.float32)})
    client.wait(timeout=60)
    client.close()
