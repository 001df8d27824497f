"""Module-level functions for tests that start worker processes (spawned children import them)."""

import multiprocessing as mp
import os
import time
import warnings
from concurrent.futures import ProcessPoolExecutor

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


def slowed(loss_and_grad, seconds, params, batch):
    """``loss_and_grad(params, batch)`` after ``seconds`` of sleep (use with functools.partial)."""
    time.sleep(seconds)
    return loss_and_grad(params, batch)


def uniform_pusher(client, pushes):
    """Pushes vectors of ones; with sgd(lr=1) every shard stays uniform at every version."""
    for _ in range(pushes):
        client.pull(copy=False)
        client.push({"x": np.ones(client.spec.size, np.float32)})
    client.wait(timeout=60)
    client.close()


# TensorFlow least squares for tests/test_backends_e2e.py: y = x @ w* + b*, no noise.
TF_DIM = 8
TF_W_STAR = np.linspace(-1.0, 1.0, TF_DIM).astype(np.float32)
TF_B_STAR = np.float32(0.5)


def tf_linear_init():
    """The initial params: ``tf.Variable`` leaves (a vector and a 0-d bias), all zero."""
    import tensorflow as tf

    return {"w": tf.Variable(tf.zeros(TF_DIM)), "b": tf.Variable(0.0)}


def tf_linear_loss_and_grad(params, batch):
    """0.5 * mean((x @ w + b - y)^2) and its gradient by ``tf.GradientTape``; TF in, TF out."""
    import tensorflow as tf

    x, y = batch
    with tf.GradientTape() as tape:
        tape.watch(params)  # pulled params are tf.Tensor, not Variables
        residual = tf.linalg.matvec(x, params["w"]) + params["b"] - y
        loss = 0.5 * tf.reduce_mean(tf.square(residual))
    return float(loss), tape.gradient(loss, params)


def tf_linear_data(worker, workers):
    """Endless (x, y) batches of tf tensors, a different stream per worker."""
    import tensorflow as tf

    rng = np.random.default_rng(1000 + worker)
    while True:
        x = rng.normal(size=(32, TF_DIM)).astype(np.float32)
        yield tf.constant(x), tf.constant(x @ TF_W_STAR + TF_B_STAR)


def tf_linear_evaluate(params):
    """Held-out loss and relative distance of (w, b) to (w*, b*)."""
    x = np.random.default_rng(7).normal(size=(256, TF_DIM)).astype(np.float32)
    w, b = np.asarray(params["w"], np.float64), float(np.asarray(params["b"]))
    residual = x @ w + b - (x @ TF_W_STAR + TF_B_STAR)
    star = np.append(TF_W_STAR, TF_B_STAR).astype(np.float64)
    distance = np.linalg.norm(np.append(w, b) - star) / np.linalg.norm(star)
    return {"loss": float(0.5 * np.mean(residual**2)), "distance": float(distance)}


def push_once_and_die(client):
    """Pushes once, then the process dies without leaving (no close, no goodbye)."""
    import os

    client.pull()
    client.push({"x": np.ones(client.spec.size, np.float32)})
    client.wait(timeout=30)
    os._exit(1)


def nan_once_loss_and_grad(params, batch):
    """Quadratic loss whose gradient is NaN for batch 3 only."""
    loss, grads = quadratic_loss_and_grad(params, np.zeros(8, np.float32))
    if batch == 3:
        grads = {"x": np.full(8, np.nan, np.float32)}
    return loss, grads


def dying_loss_and_grad(params, batch):
    """The worker process vanishes at every batch from 3 on, as on a segfault or a kill
    (a restarted worker goes on after the batch it died on)."""
    import os

    if batch >= 3:
        os._exit(3)
    return quadratic_loss_and_grad(params, np.zeros(8, np.float32))


def push_forever(client, ready):
    """Pushes ones as fast as it can until killed; signals once it is pushing."""
    client.pull(copy=False)
    ones = {k: np.ones_like(v) for k, v in client.last_pull(copy=True).items()}
    client.push(ones)
    client.wait(timeout=60)
    ready.set()
    while True:
        client.push(ones)


def tagged_pids(tag):
    """The pids of live processes whose environment holds STALEWISE_TEST_TAG=tag."""
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if f"STALEWISE_TEST_TAG={tag}".encode() in f.read():
                        pids.append(int(d))
            except OSError:
                pass
    return pids


def per_worker(records) -> dict[int, list[int]]:
    """``{worker: [value, ...]}`` from ``(worker, value)`` records, in their order."""
    out: dict[int, list[int]] = {}
    for w, x in records:
        out.setdefault(int(w), []).append(int(x))
    return out


def read_records(path) -> dict[int, list[int]]:
    """``{worker: [value, ...]}`` from a file of ``"worker value"`` lines, which worker
    processes append to (the batches they draw, the H of their rounds)."""
    with open(path) as f:
        return per_worker(line.split() for line in f if line.strip())


def report_torch_threads(queue):
    """A worker process of a loop you own: reports its thread settings, torch's among them."""
    import torch

    queue.put((os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()))


def _warn_as(filters):
    warnings.filters[:] = filters


def in_two(fn, *args):
    """``fn(*args, 0)`` here and ``fn(*args, 1)`` at once in a spawned process (a CPU-bound
    sweep split over two cores), the child under this process's warning filters (pytest's
    "error" included); returns both results."""
    spawn = mp.get_context("spawn")
    with ProcessPoolExecutor(1, spawn, initializer=_warn_as, initargs=(warnings.filters,)) as pool:
        other = pool.submit(fn, *args, 1)
        return fn(*args, 0), other.result()
