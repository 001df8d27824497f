"""A plain JAX + optax training loop, made a 4-worker asynchronous job.

``train_plain`` is ordinary JAX: a params pytree, ``jax.value_and_grad`` and an
optax optimizer. In ``train_async`` the lines marked ``# stalewise`` are what
changed: the optimizer moves to the parameter server, each worker pulls the
global params before a step and pushes its gradients after it.

    .venv/bin/python examples/jax_async.py
"""

import multiprocessing as mp

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import stalewise as sw

WORKERS, STEPS = 4, 300


def init_params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {
        "l1": {"w": jax.random.normal(k1, (64, 64)) / 8.0, "b": jnp.zeros(64)},
        "l2": {"w": jax.random.normal(k2, (64, 10)) / 8.0, "b": jnp.zeros(10)},
    }


def load_data():
    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    return jnp.asarray(x, jnp.float32), jnp.asarray(y)


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["l1"]["w"] + params["l1"]["b"])
    logits = h @ params["l2"]["w"] + params["l2"]["b"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


grad_fn = jax.jit(jax.value_and_grad(loss_fn))


def accuracy(params, x, y):
    h = jnp.tanh(x @ params["l1"]["w"] + params["l1"]["b"])
    return float(((h @ params["l2"]["w"] + params["l2"]["b"]).argmax(1) == y).mean())


def train_plain():
    params, (x, y) = init_params(), load_data()
    opt = optax.adam(1e-2)
    state = opt.init(params)
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        idx = rng.integers(len(x), size=32)
        _, grads = grad_fn(params, x[idx], y[idx])
        updates, state = opt.update(grads, state)
        params = optax.apply_updates(params, updates)
    return accuracy(params, x, y)


def worker(client, rank):  # the same loop, in one of 4 processes
    x, y = load_data()
    rng = np.random.default_rng(rank)
    for _ in range(STEPS // WORKERS):
        params = client.pull()  # stalewise: fetch the global params
        idx = rng.integers(len(x), size=32)
        _, grads = grad_fn(params, x[idx], y[idx])
        client.push(grads)  # stalewise: instead of opt.update + apply_updates
    client.close()


def train_async():
    x, y = load_data()
    job = sw.Job(init_params(), optimizer=sw.optim.adam(1e-2), consistency=sw.SSP(2))  # stalewise
    with job.serve(workers=WORKERS) as server:  # stalewise
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=worker, args=(server.client(r), r)) for r in range(WORKERS)]
        for r, p in enumerate(procs):
            p.start()
            server.release(r)  # stalewise: the shards now notice if this worker dies
        for p in procs:
            p.join()
        params = server.pull()  # stalewise: the trained params
    return accuracy(params, x, y)


if __name__ == "__main__":
    print(f"plain loop:          training accuracy {train_plain():.3f}")
    print(f"4 async workers:     training accuracy {train_async():.3f}")
