"""Named shared-memory blocks that cannot leak.

A block is a file in ``/dev/shm`` (a RAM file system) mapped into every process
that uses it. The creator unlinks the name as soon as every process has mapped
it (or when the job ends): the memory then lives exactly as long as the last
mapping, so a crash or a ``kill -9`` of any process leaves nothing behind.

We do not use :mod:`multiprocessing.shared_memory` because on Python 3.11 every
process that attaches a segment registers it with the resource tracker, which
then warns about, or unlinks, segments it does not own.

Example:
    >>> block = SharedBlock.create(1024)
    >>> a = block.array(np.float32, 0, 4)
    >>> a[:] = 1.5
    >>> other = SharedBlock.attach(block.name)
    >>> float(other.array(np.float32, 0, 4).sum())
    6.0
    >>> other.close(); block.unlink(); block.close()
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import tempfile

import numpy as np

PREFIX = "stalewise-"


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class SharedBlock:
    """A mapping of a named shared-memory file; numpy arrays view into it."""

    def __init__(self, name: str, path: str, mm: mmap.mmap, owner: bool):
        self.name = name
        self.path = path
        self._mm: mmap.mmap | None = mm
        self.owner = owner
        self.size = len(mm)

    @classmethod
    def create(cls, nbytes: int) -> SharedBlock:
        """Creates a zero-filled block of ``nbytes`` bytes with a fresh unique name."""
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        path = os.path.join(_shm_dir(), name)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            mm = mmap.mmap(fd, max(nbytes, 1))
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(name, path, mm, owner=True)

    @classmethod
    def attach(cls, name: str) -> SharedBlock:
        """Maps an existing block by name."""
        path = os.path.join(_shm_dir(), name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"shared-memory block {path} does not exist (the job that made it has ended)"
            ) from None
        try:
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        return cls(name, path, mm, owner=False)

    def array(self, dtype: np.dtype | type, offset: int, count: int) -> np.ndarray:
        """A 1-D array of ``count`` items of ``dtype`` starting at byte ``offset``."""
        if self._mm is None:
            raise ValueError(f"shared-memory block {self.name} is closed")
        return np.frombuffer(self._mm, dtype=dtype, count=count, offset=offset)

    def unlink(self) -> None:
        """Removes the name; mappings stay valid until closed. Safe to call twice."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def close(self) -> None:
        """Unmaps the block if no array still views it (else the OS unmaps at exit)."""
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # arrays still export the buffer; dropped at process exit
                return
            self._mm = None


def leaked_blocks() -> list[str]:
    """Names of stalewise blocks still present (for tests and diagnostics)."""
    return sorted(n for n in os.listdir(_shm_dir()) if n.startswith(PREFIX))
