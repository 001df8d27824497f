"""Module-level helpers for the pacing tests of test_adaptive.py (spawned workers import them).

Batches are tagged with their worker's id, and the recording strategies note
``(worker, H)`` of every round: in a list when they run in this process (the
simulator), appended to a file when they run in worker processes.
"""

import itertools

import numpy as np

from stalewise.strategies.adaptive import Adaptive
from stalewise.strategies.averaging import LocalSGDStrategy

RECORDED: list[tuple[int, int]] = []  # (worker, H) of every round run in this process


def tagged_data(worker, workers):
    """Endless ``(worker, batch)`` of a noisy quadratic's targets, a stream per worker."""
    rng = np.random.default_rng(worker)
    while True:
        yield worker, (np.arange(8.0) + rng.normal(scale=0.01, size=8))


def tagged_loss_and_grad(params, batch):
    """0.5 * ||x - target||^2 of a tagged batch."""
    diff = params["x"] - batch[1]
    return float(0.5 * (diff**2).sum()), {"x": diff}


class _Recording:
    """Records the ``H`` of every round of the strategy it is mixed into (to ``path``, if
    given, else to RECORDED)."""

    def __init__(self, *args, path=None, **kw):
        super().__init__(*args, **kw)
        self.path = path

    def step(self, state, params, loss_and_grad, batches):
        first = next(batches)  # the round's first batch names the worker
        out = super().step(state, params, loss_and_grad, itertools.chain([first], batches))
        if self.path is None:
            RECORDED.append((first[0], out.local_steps))
        else:
            with open(self.path, "a") as f:
                f.write(f"{first[0]} {out.local_steps}\n")
        return out


class RecordingAdaptive(_Recording, Adaptive):
    """:class:`Adaptive` that records the ``H`` of every round."""


class RecordingLocalSGD(_Recording, LocalSGDStrategy):
    """:class:`~stalewise.strategies.averaging.LocalSGDStrategy` that records the ``H`` of every round."""
