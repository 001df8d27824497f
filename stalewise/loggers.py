"""Loggers: metrics records sent where people look at them, such as TensorBoard.

A logger (``sw.Metrics(loggers=[...])``) is a function ``f(record)`` or an object with
``log(record)`` and optionally ``finish(result)`` and ``close()``; see docs/loggers.md.

Example:
    >>> seen = []
    >>> loggers = Loggers([lambda record: seen.append(record["pushes"])])
    >>> loggers.on_record({"pushes": 3})
    >>> seen
    [3]
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from stalewise.targets import finite

log = logging.getLogger(__name__)

__all__ = ["Loggers", "TensorBoardLogger"]

TENSORBOARD_MISSING = (
    "TensorBoard logging needs the tensorboardX package: pip install 'stalewise[tensorboard]'"
)


def _name(logger: Any) -> str:
    return getattr(logger, "__name__", None) or type(logger).__name__


class Loggers:
    """The loggers of one run, after its own ``on_record``: :attr:`on_record`, :meth:`finish`."""

    def __init__(self, loggers: Any = None, on_record: Callable[[dict], None] | None = None):
        if loggers is None:
            loggers = []
        elif not isinstance(loggers, list | tuple):
            loggers = [loggers]
        for i, logger in enumerate(loggers):
            if not (callable(logger) or callable(getattr(logger, "log", None))):
                raise TypeError(
                    f"loggers[{i}]: expected a function f(record) or an object with a "
                    f"log(record) method, got {type(logger).__name__} {logger!r}"
                )
        self.loggers = list(loggers)
        self.failed: set[int] = set()  # indices of loggers that raised and are left out
        self._user = on_record

    @property
    def on_record(self) -> Callable[[dict], None] | None:
        """The record callback for the run: ``on_record`` alone when there are no loggers."""
        return self._call if self.loggers else self._user

    def _call(self, record: dict) -> None:
        if self._user is not None:
            self._user(record)
        for i, logger in enumerate(self.loggers):
            if i not in self.failed:
                self._guard(i, "log", getattr(logger, "log", logger), record)

    def _guard(self, i: int, what: str, method: Callable, *args: Any) -> None:
        try:
            method(*args)
        except Exception as e:
            self.failed.add(i)
            log.warning(
                "logger %s failed in %s() and is left out for the rest of the run: %s: %s",
                _name(self.loggers[i]),
                what,
                type(e).__name__,
                e,
            )
            log.debug("logger %s failed", _name(self.loggers[i]), exc_info=True)

    def finish(self, result: Any) -> Any:
        """Calls each working logger's ``finish(result)``; returns ``result``."""
        for i, logger in enumerate(self.loggers):
            finish = getattr(logger, "finish", None)
            if i not in self.failed and callable(finish):
                self._guard(i, "finish", finish, result)
        return result

    def close(self) -> None:
        """Calls every logger's ``close()``, the failed ones' too (they may hold files)."""
        for i, logger in enumerate(self.loggers):
            close = getattr(logger, "close", None)
            if callable(close):
                self._guard(i, "close", close)

    def __enter__(self) -> Loggers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tensorboard_writer() -> type:
    """tensorboardX's ``SummaryWriter``; ImportError naming the pip command without it."""
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise ImportError(TENSORBOARD_MISSING) from None
    return SummaryWriter


class TensorBoardLogger:
    """Writes each record's finite numbers as TensorBoard scalars at step ``pushes`` (and
    ``pushes_per_s``) into ``logdir``, and the staleness histogram at the end (tensorboardX)."""

    def __init__(self, logdir: str | os.PathLike[str], *, flush_secs: float = 5.0):
        self._writer_class = tensorboard_writer()
        if not (finite(flush_secs) and flush_secs > 0):
            raise ValueError(f"flush_secs must be a number of seconds > 0, got {flush_secs!r}")
        self.flush_secs = flush_secs
        if not isinstance(logdir, str | os.PathLike) or not str(logdir):
            raise TypeError(f"logdir must be a folder path (str or os.PathLike), got {logdir!r}")
        self.logdir = Path(logdir)
        try:
            self.logdir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(
                f"logdir: cannot make the folder {str(self.logdir)!r}: {e.strerror or e}"
            ) from None
        self._writer: Any = None  # opened at the first record, so an unused logger holds nothing
        self._last: tuple[float, int] | None = None  # (time, pushes) of the previous record

    def _open(self) -> Any:
        if self._writer is None:
            self._writer = self._writer_class(str(self.logdir), flush_secs=self.flush_secs)
        return self._writer

    def log(self, record: Mapping[str, Any]) -> None:
        """Writes one record's numeric fields as scalars at step ``record["pushes"]``."""
        writer = self._open()
        step = int(record["pushes"])
        for key, value in record.items():
            if key != "pushes" and finite(value):
                writer.add_scalar(key, float(value), step)
        now = record.get("time")
        if finite(now):
            if self._last is not None and now > self._last[0]:
                rate = (step - self._last[1]) / (now - self._last[0])
                writer.add_scalar("pushes_per_s", rate, step)
            self._last = (float(now), step)

    def finish(self, result: Any) -> None:
        """Writes the ``staleness`` histogram of the run's applied pushes."""
        counts = {int(t): int(n) for t, n in result.stats.get("staleness_counts", {}).items()}
        if not counts or not sum(counts.values()):
            return
        writer = self._open()
        taus = range(max(counts) + 1)
        num = sum(counts.values())
        writer.add_histogram_raw(
            "staleness",
            min=min(counts),
            max=max(counts),
            num=num,
            sum=sum(t * n for t, n in counts.items()),
            sum_squares=sum(t * t * n for t, n in counts.items()),
            bucket_limits=[t + 0.5 for t in taus],  # bucket t holds staleness t
            bucket_counts=[counts.get(t, 0) for t in taus],
            global_step=int(result.pushes),
        )
        writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file; a later record opens a new one in ``logdir``."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._last = None
