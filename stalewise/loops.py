"""Local SGD / DiLoCo for a training loop you own: the worker side, as a wrapper (each push's
result kept in ``results``; ``examples/torch_local_sgd.py``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from stalewise import tree
from stalewise.optim._validate import check_integer
from stalewise.protocol import PushResult

__all__ = ["LocalSGD", "LocalSGDOptax"]

#: What leaving the ``with`` block does with the steps since the last sync.
REMAINDERS = ("drop", "push")


class _Averager:
    """The shared part: the pulled parameters (flat), the step count, push and pull."""

    def __init__(self, client: Any, local_steps: int, timeout: float | None, remainder: str):
        self.client = client
        self.local_steps = check_integer(f"{type(self).__name__}: local_steps", local_steps)  # H
        self.timeout = timeout
        if remainder not in REMAINDERS:
            raise ValueError(
                f"{type(self).__name__}: remainder must be one of {', '.join(REMAINDERS)}, "
                f"got {remainder!r}"
            )
        self.remainder = remainder  # what __exit__ does with a partial last round
        self.steps = 0  #: optimizer steps seen
        self.pending = 0  #: local steps since the last pull
        self.results: list[PushResult | None] = []  #: what became of each push, in order
        self._spec: tree.FlatSpec = client.spec  # the job's layout
        self._pulled: np.ndarray | None = None  # the last pulled parameters, flat

    @property
    def pushes(self) -> int:
        return len(self.results)

    def _pull_flat(self) -> np.ndarray:
        flat = self.client.pull_flat(timeout=self.timeout)
        if self._pulled is None:
            self._pulled = flat.copy()
        else:
            np.copyto(self._pulled, flat)
        self.pending = 0
        return self._pulled

    def _push(self, local: Any) -> None:
        """Pushes ``pulled - local`` and waits for its acknowledgement."""
        if self._pulled is None:
            raise RuntimeError("push before the first pull: enter the with block first")
        buf = self.client.push_buffer  # waits for the previous push's acks
        tree.flatten(local, spec=self._spec, out=buf)
        values = tree.take_buffers(buf, self._spec)  # a buffer's slot carries its value
        np.subtract(self._pulled, buf, out=buf)  # the pseudo-gradient
        tree.put_buffers(buf, values, self._spec)
        self.client.push_flat_sent()
        # waiting here makes the next pull see this push (read-your-writes)
        self.results.append(self.client.wait(timeout=self.timeout))
        self.pending = 0


class LocalSGD(_Averager):
    """Local SGD / DiLoCo for a PyTorch loop: push and pull every ``local_steps`` optimizer steps.

    ``optimizer.step()`` is hooked while the ``with`` block runs; ``model`` must match the
    Job's params; ``timeout`` bounds each pull and push; ``remainder``: :data:`REMAINDERS`."""

    def __init__(
        self,
        client: Any,
        model: Any,
        optimizer: Any,
        *,
        local_steps: int,
        timeout: float | None = None,
        remainder: str = "drop",
    ):
        if not callable(getattr(optimizer, "register_step_post_hook", None)):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer (torch >= 2.0, for "
                f"register_step_post_hook), got {type(optimizer).__name__}"
            )
        super().__init__(client, local_steps, timeout, remainder)
        self.model = model
        self.optimizer = optimizer
        self._handle: Any = None
        tree.flatten(model, spec=self._spec)  # a mismatch fails here, naming the key path

    def __enter__(self) -> LocalSGD:
        if self._handle is not None:
            raise RuntimeError("this LocalSGD is already active")
        self.pull()
        self._handle = self.optimizer.register_step_post_hook(self._after_step)
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        try:
            if kind is None and self.pending and self.remainder == "push":
                self._push(self.model)
        finally:
            self._handle.remove()
            self._handle = None

    def pull(self) -> None:
        """Copies the global parameters into the model (in place)."""
        self._pull_flat()
        self.client.last_pull(into=self.model)

    def sync(self) -> None:
        """Pushes ``pulled - model`` now, then pulls into the model."""
        self._push(self.model)
        self.pull()

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        self.pending += 1
        if self.pending >= self.local_steps:
            self.sync()


class LocalSGDOptax(_Averager):
    """Local SGD / DiLoCo for a functional loop (JAX + optax, NumPy): ``params = sync.after_step(params)``.

    ``timeout`` and ``remainder`` as for :class:`LocalSGD`; :meth:`finish` pushes at once."""

    def __init__(
        self,
        client: Any,
        *,
        local_steps: int,
        timeout: float | None = None,
        remainder: str = "drop",
    ):
        super().__init__(client, local_steps, timeout, remainder)
        self.params: Any = None  #: the params last pulled or passed to after_step

    def __enter__(self) -> LocalSGDOptax:
        self.pull()
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is None and self.remainder == "push":
            self.finish()

    def pull(self) -> Any:
        """Pulls the global params; returns them (also kept in :attr:`params`)."""
        self._pull_flat()
        self.params = self.client.last_pull(copy=True)
        return self.params

    def after_step(self, params: Any) -> Any:
        """Counts one step; returns ``params``, or the new global params after a sync."""
        self.steps += 1
        self.pending += 1
        self.params = params
        if self.pending >= self.local_steps:
            self._push(params)
            return self.pull()
        return params

    def finish(self, params: Any = None) -> None:
        """Pushes the pending steps (``params``, default the last seen), if any, and waits."""
        if params is not None:
            self.params = params
        if self.pending:
            self._push(self.params)
