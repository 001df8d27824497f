"""A run's checkpoints in every runtime: what it resumes from, and the :class:`Saver`."""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stalewise.checkpoint import store
from stalewise.checkpoint.store import Checkpoint, CheckpointError, candidates, exists, load, save
from stalewise.protocol import budget
from stalewise.protocol.notices import warn_user

log = logging.getLogger(__name__)


def config_info(config: Any, **extra: Any) -> dict[str, Any]:
    """The job facts a checkpoint records (and :func:`check_compatible` compares)."""
    from stalewise.strategies import config_key

    return {
        # by configuration: an Optimizer's repr holds function addresses, new in each process
        "optimizer": repr(config_key(config.optimizer)),
        "consistency": repr(config.consistency),
        "staleness": repr(config.staleness),
        "shards": int(config.shards),
        "ranges": [[int(lo), int(hi)] for lo, hi in config.ranges],
        "size": int(config.spec.size),
        "dtype": config.spec.dtype.name,
        **extra,
    }


def check_compatible(ckpt: Checkpoint, config: Any, workers: int | None = None) -> None:
    """Raises CheckpointError (one line) unless ``ckpt`` was made by a job like ``config``."""
    info, saved, name = config_info(config), ckpt.manifest["config"], ckpt.path.name
    for key in ("shards", "ranges", "size", "dtype", "optimizer", "consistency", "staleness"):
        if saved.get(key) != info[key]:
            raise CheckpointError(
                f"{name} is of another job: {key} is {saved.get(key)!r} there, {info[key]!r} here"
            )
    names = [leaf["name"] for leaf in ckpt.manifest["spec"]["leaves"]]
    if names != [leaf.name for leaf in config.spec.leaves]:
        raise CheckpointError(f"{name} is of another job: its leaves are {names}")
    had = ckpt.states[0].get("workers")
    if workers is not None and had != workers:
        raise CheckpointError(f"{name} is of a run with {had} workers, this one has {workers}")
    if ckpt.residuals is not None:
        if workers is not None and len(ckpt.residuals) != workers:
            raise CheckpointError(
                f"{name} holds the error-feedback residuals of {len(ckpt.residuals)} workers, "
                f"this run has {workers}"
            )
        want, dtype = (int(config.spec.size),), np.dtype(config.spec.dtype)
        for w, r in enumerate(ckpt.residuals):
            if r.shape != want or r.dtype != dtype:
                raise CheckpointError(
                    f"{name}: worker {w}'s error-feedback residual is {r.dtype} of shape "
                    f"{r.shape}, this job's parameters are {dtype} of shape {want}"
                )
    drawn = ckpt.step.get("drawn")
    if drawn is not None:
        if not isinstance(drawn, list) or (workers is not None and len(drawn) != workers):
            raise CheckpointError(
                f"{name}: 'drawn' must list the batches each of this run's {workers} workers "
                f"drew, got {drawn!r}"
            )
        for w, n in enumerate(drawn):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise CheckpointError(
                    f"{name}: worker {w}'s count of batches drawn is {n!r}, not an integer >= 0"
                )


def resume_point(
    config: Any, options: Any, *, runtime: str, resumes_from: str | None = None
) -> Checkpoint | None:
    """The checkpoint a run with ``options.resume`` continues from (None: start afresh); refuses
    one of another job, or without the runtime's step key ``resumes_from``."""
    if not options.resume:
        return None
    where = options.checkpoint_dir
    if not exists(where):
        log.warning("%s: resume: no checkpoint in %s yet; starting from the start", runtime, where)
        return None
    ckpt = load(where, check=lambda c: _states_fit(c, config, options.room))
    check_compatible(ckpt, config, options.room)
    if resumes_from is not None and resumes_from not in ckpt.step:
        raise CheckpointError(
            f"{ckpt.path.name} was not written by runtime {runtime!r} (runtime "
            f"{ckpt.manifest['config'].get('runtime')!r}); it resumes only its own"
        )
    return ckpt


def _states_fit(ckpt: Checkpoint, config: Any, workers: int) -> None:
    """Refuses (CheckpointError: loading falls back) shard states ``Shard.load_state_dict``
    refuses and ranks' states not one per worker; another job's is :func:`check_compatible`'s."""
    try:
        check_compatible(ckpt, config, workers)
    except CheckpointError:
        return
    if ckpt.ranks is not None and len(ckpt.ranks) != workers:
        raise CheckpointError(
            f"{ckpt.path.name} holds the ctx.state of {len(ckpt.ranks)} ranks, not {workers}"
        )
    for k, state in enumerate(ckpt.states):
        lo, hi = config.ranges[k]
        try:
            config.build_shard(k, config.init[lo:hi].copy(), workers).load_state_dict(state)
        except ValueError as e:
            raise CheckpointError(f"{ckpt.path.name}: shard {k}: {e}") from None


def feedback_of(ckpt: Checkpoint | None, config: Any, workers: int) -> list[Any] | None:
    """Each worker's error-feedback state for ``config`` resumed from ``ckpt`` (None: no feedback;
    no saved residuals: zeros); call it after :func:`check_compatible`."""
    comp = config.compressor()
    saved = None if ckpt is None else ckpt.residuals
    if comp is None or not comp.error_feedback:
        if saved is not None and any(np.any(r) for r in saved):
            log.warning(
                "%s holds error-feedback residuals, but this job's codec (%r) keeps none: "
                "they are not used",
                ckpt.path.name,
                config.codec,
            )
        return None
    dtype = config.init.dtype
    if saved is None:
        return [comp.init(dtype) for _ in range(workers)]
    try:
        return [comp.adopt(r, dtype, worker=w) for w, r in enumerate(saved)]
    except ValueError as e:
        raise CheckpointError(f"{ckpt.path.name}: {e}") from None


def drawn_of(ckpt: Checkpoint | None, workers: int) -> list[int]:
    """The batches each worker id had drawn at ``ckpt`` (zeros without one), advanced by its logs
    to after its last push held (:class:`Positions`); call it after :func:`check_compatible`."""
    drawn = None if ckpt is None else ckpt.step.get("drawn")
    drawn = [0] * workers if drawn is None else list(drawn)
    if ckpt is None or "replayed" not in ckpt.step:
        return drawn
    seats, missing = ckpt.states[0], []
    for w in range(workers):
        if inc := int(seats["incarnation"][w]):  # 0: it never joined
            at = _position(ckpt.path.parent, w, inc, int(seats["next_seq"][w]) - 1)
            if at is None:
                missing.append(w)
            else:
                drawn[w] = at
    if missing:
        log.warning("%s: no data position of worker(s) %s at their last push held: they go on "
                    "from the checkpoint's count of batches drawn", ckpt.path.name, missing)  # fmt: skip
    return drawn


POSITION = struct.Struct("<qqq")  # incarnation, seq (-1: at its start), batches drawn by then


class Positions:
    """An incarnation of ``worker`` writes its data position at each push, before its
    commit, into ``folder/drawn-worker-W`` (4 slots: 2 per incarnation parity; no fsync).
    OSError: the folder or file is not to be trusted (:func:`~.store.create_file`)."""

    def __init__(self, folder: str | os.PathLike, worker: int, incarnation: int):
        path = Path(folder) / f"drawn-worker-{worker}"
        try:
            self.fd = store.create_file(path)
        except FileExistsError:
            self.fd = store.create_file(path, at=4 * POSITION.size)
        self.incarnation = incarnation

    def write(self, seq: int, drawn: int) -> None:
        """Push ``seq`` (-1: none yet) is made of the batches before the ``drawn``-th."""
        slot = 2 * (self.incarnation % 2) + (seq + 1) % 2
        os.pwrite(self.fd, POSITION.pack(self.incarnation, seq, drawn), slot * POSITION.size)


def _position(folder: Path, worker: int, incarnation: int, seq: int) -> int | None:
    """The position :class:`Positions` wrote for that push (None: none found)."""
    try:
        fd, _ = store.open_file(folder, f"drawn-worker-{worker}", folder_may_be_a_link=True)
    except CheckpointError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(4 * POSITION.size)
    for entry in POSITION.iter_unpack(data[: len(data) // POSITION.size * POSITION.size]):
        if entry[:2] == (incarnation, seq) and entry[2] >= 0:
            return entry[2]
    return None


class Saver:
    """A run's checkpoints into ``options.checkpoint_dir``, when :meth:`due` says so and at the
    end. A write that fails warns, is recorded in ``failures`` and returns None (:attr:`failed`)."""

    def __init__(
        self,
        config: Any,
        strategy: Any,
        options: Any,
        *,
        runtime: str,
        pushes: int,
        now: float = 0.0,
        failures: Any = None,
        **info: Any,
    ):
        self.config, self.options, self.failures = config, options, failures
        self.info = config_info(
            config, workers=options.room, strategy=repr(strategy), runtime=runtime, **info
        )
        self.pushes, self.time = int(pushes), float(now)  # of the last checkpoint (attempt)
        self.asked = self.pushes  # the job's pushes at the last look (:meth:`due`)
        self.last: Path | None = None  # the last checkpoint this saver wrote
        self.failed = False

    @property
    def periodic(self) -> bool:
        """Whether checkpoints are taken during the run, not only at its end."""
        o = self.options
        return o.checkpoint_every is not None or o.checkpoint_seconds is not None

    def due(self, pushes: int, now: float) -> bool:
        """Whether a periodic checkpoint is due at the job's ``pushes`` and time ``now``."""
        o, every, self.asked = self.options, self.options.checkpoint_every, pushes
        return (every is not None and budget.checkpoint_due(pushes, self.pushes, every)) or (
            o.checkpoint_seconds is not None and now - self.time >= o.checkpoint_seconds
        )

    def save(
        self,
        states: Sequence[dict[str, Any]],
        step: dict[str, Any],
        residuals: Sequence[np.ndarray] | None = None,
        *,
        final: bool = False,
        ranks: Sequence[dict[str, Any]] | None = None,
    ) -> Path | None:
        """Writes the shards' ``states`` and the workers' ``residuals`` (None: none kept); ``step``
        holds at least ``pushes`` and ``time``. Returns its folder, or None (see the class)."""
        from safetensors import SafetensorError

        # the next is due a period after this attempt (written or not) and its pushes
        self.pushes, self.time = max(int(step["pushes"]), self.asked), float(step["time"])
        directory = Path(self.options.checkpoint_dir)
        try:
            path = save(
                directory,
                states,
                spec=self.config.spec,
                config_info=self.info,
                step_info={**step, "run": self.options.run},
                keep=self.options.checkpoint_keep,
                residuals=residuals,
                ranks=ranks,
            )
            self.last, self.failed = path, False
            return path
        except (OSError, SafetensorError) as e:  # warned, logged, recorded; returns None
            self.failed, cause = True, " ".join(str(e).split()) or type(e).__name__
        cause = cause if len(cause) <= 300 else cause[:297] + "..."
        kept = self.last.name if self.last is not None else None
        with contextlib.suppress(OSError, IndexError):  # the one load would try first
            kept = kept or candidates(directory)[0].name
        action = f"kept {kept or 'none'}"
        if self.failures is not None:
            self.failures.checkpoint(
                str(directory), cause, time=self.time, action=action, final=final
            )
        then = (
            "the run's result is returned without it"
            if final
            else "the run goes on; the next checkpoint is tried a period later"
        )
        previous = f"the previous checkpoint, {kept}, is kept" if kept else "no checkpoint kept"
        message = (
            f"{'the final' if final else 'a'} checkpoint could not be written to {directory}: "
            f"{cause}; {previous}; {then}"
        )
        log.warning("checkpoint: %s", message)
        if final or self.failures is None:
            warn_user(message)  # the run's last: always
        else:  # the first of a run; the end of the run counts the others
            self.failures.warn_once("checkpoint", message)
