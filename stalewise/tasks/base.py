"""The task interface and the data plumbing shared by the built-in tasks.

A task bundles a model, its data and its loss so that a runtime can train it
without knowing anything about either. Tasks are plain, picklable objects:
runtimes send them to worker processes, where each worker calls
:meth:`Task.batches` once and then alternates pulls, :meth:`Task.loss_and_grad`
and pushes. Tasks never sleep, log progress or emulate slow hardware; that
belongs to the runtime.

Sharding contract: for a fixed task, ``batches(w, W, seed)`` for
``w = 0 .. W-1`` draw from pairwise disjoint subsets of the training data whose
union is the whole training set. Each epoch over a shard is reshuffled with a
generator seeded by ``(seed, worker, epoch)``, so a run is reproducible and
workers do not walk their shards in lock-step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["Task", "shard_batches", "shard_indices"]


@runtime_checkable
class Task(Protocol):
    """What a runtime needs from a task.

    Implementations must be picklable and cheap to construct. ``params`` and
    ``grads`` are pytrees (nested dicts of arrays) of the task's backend; the
    gradient pytree has the structure, backend and dtype of ``params``.

    Threading contract: methods do not mutate the task except to fill private
    caches, so one task object may serve many workers of a single-threaded
    simulator; use one task per thread if the backend is not thread-safe.

    Example:
        >>> from stalewise import tasks
        >>> task = tasks.get("least-squares", n=64, d=4)
        >>> isinstance(task, tasks.Task)
        True
        >>> params = task.init_params()
        >>> loss, grads = task.loss_and_grad(params, next(task.batches(0, 2)))
        >>> sorted(grads), grads["x"].shape
        (['x'], (4,))
    """

    name: str

    def init_params(self, seed: int = 0) -> Any:
        """Returns freshly initialised parameters, deterministic by ``seed``."""
        ...

    def loss_and_grad(self, params: Any, batch: Any) -> tuple[float, Any]:
        """Returns the minibatch loss and its gradient with respect to ``params``."""
        ...

    def batches(self, worker: int, workers: int, seed: int = 0) -> Iterator[Any]:
        """Returns an endless iterator over minibatches of ``worker``'s shard."""
        ...

    def evaluate(self, params: Any) -> dict[str, float]:
        """Returns held-out metrics: at least ``"loss"``."""
        ...


def shard_indices(n: int, worker: int, workers: int) -> np.ndarray:
    """Returns the indices of ``worker``'s shard of ``n`` examples.

    Shards are strided (``worker, worker + workers, ...``), so they are
    disjoint, cover ``range(n)`` and differ in size by at most one. Tasks
    store their training data in a random order, which makes strided shards
    statistically alike.

    Args:
        n: number of training examples.
        worker: this worker's index, ``0 <= worker < workers``.
        workers: total number of workers, at most ``n``.

    Returns:
        A sorted int64 array of indices.

    Raises:
        ValueError: if ``worker`` is out of range or ``workers > n``.

    Example:
        >>> shard_indices(10, 1, 3).tolist()
        [1, 4, 7]
    """
    if workers < 1 or not 0 <= worker < workers:
        raise ValueError(f"need 0 <= worker < workers, got worker={worker}, workers={workers}")
    if workers > n:
        raise ValueError(f"{workers} workers but only {n} training examples")
    return np.arange(worker, n, workers, dtype=np.int64)


def shard_batches(
    n: int, batch_size: int, worker: int, workers: int, seed: int = 0
) -> Iterator[np.ndarray]:
    """Yields index minibatches of ``worker``'s shard, forever.

    Every batch has the same size (``min(batch_size, shard size)``) so that
    compiled backends see one shape; the remainder of an epoch is dropped and
    the shard is reshuffled for the next one.

    Args:
        n: number of training examples.
        batch_size: requested minibatch size.
        worker: this worker's index.
        workers: total number of workers.
        seed: run seed; shuffling uses ``(seed, worker, epoch)``.

    Yields:
        int64 index arrays into the training set.

    Example:
        >>> it = shard_batches(10, 2, worker=0, workers=2, seed=0)
        >>> batch = next(it)
        >>> len(batch), set(batch.tolist()) <= {0, 2, 4, 6, 8}
        (2, True)
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    shard = shard_indices(n, worker, workers)
    size = min(batch_size, len(shard))
    per_epoch = len(shard) // size
    epoch = 0
    while True:
        rng = np.random.default_rng([seed, worker, epoch])
        order = rng.permutation(shard)
        for i in range(per_epoch):
            yield order[i * size : (i + 1) * size]
        epoch += 1
