"""Shared-memory blocks that cannot leak.

On Linux a ``memfd_create`` file, elsewhere a file in ``/dev/shm``; why: ``docs/design-notes.md``.

Example:
    >>> block = SharedBlock.create(1024)
    >>> a = block.array(np.float32, 0, 4)
    >>> a[:] = 1.5
    >>> other = SharedBlock.attach(block.handle)
    >>> float(other.array(np.float32, 0, 4).sum())
    6.0
    >>> other.close(); block.unlink(); block.close()
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import tempfile

import numpy as np

PREFIX = "stalewise-"
USE_MEMFD = True  # False forces named files (for tests of the fallback)
_memfd_works: bool | None = None  # probed once per process


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _memfd_available() -> bool:
    """Whether anonymous memory files work here and can be reopened through ``/proc``."""
    global _memfd_works
    if not USE_MEMFD or not hasattr(os, "memfd_create"):
        return False
    if _memfd_works is None:
        try:
            fd = os.memfd_create(f"{PREFIX}probe", os.MFD_CLOEXEC)
            try:
                os.close(os.open(f"/proc/{os.getpid()}/fd/{fd}", os.O_RDWR))
                _memfd_works = True
            finally:
                os.close(fd)
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                return True  # says nothing of memfd here: let create() fail and say why
            _memfd_works = False
    return _memfd_works


def _file_size_limit() -> int | None:
    """The process's file size limit in bytes (``ulimit -f``), None when unlimited."""
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY or soft < 0 else soft


def _create_error(
    size: int, where: str, code: int | None, limit: int | None, cause: OSError | None = None
) -> OSError:
    """One line: which block could not be made, and why."""
    if code == errno.EFBIG:
        why = (
            f"the file size limit (ulimit -f) is {limit} bytes; raise it (ulimit -f unlimited)"
            if limit is not None
            else "the file is too large for the system"
        )
    elif code == errno.ENOSPC:
        why = f"{where} is full; free space there or make it larger"
    elif code == errno.ENOMEM:
        why = "out of memory"
    elif code == errno.EMFILE:
        why = "too many open files (ulimit -n)"
    else:
        why = (cause.strerror or str(cause)) if cause is not None else os.strerror(code or 0)
    text = f"cannot create the shared-memory block of {size} bytes in {where}: {why}"
    return OSError(code, text) if code is not None else OSError(text)


class SharedBlock:
    """A mapping of a shared-memory file; numpy arrays view into it."""

    def __init__(self, name: str, path: str, mm: mmap.mmap, owner: bool, fd: int | None = None):
        self.name = name
        self.path = path
        self._mm: mmap.mmap | None = mm
        self.owner = owner
        self.size = len(mm)
        self._fd = fd  # an anonymous block's descriptor, kept open by its creator

    @property
    def anonymous(self) -> bool:
        """True for a memory file with no name in ``/dev/shm`` (nothing to unlink)."""
        return self.path.startswith("/proc/")

    @property
    def handle(self) -> str:
        """What :meth:`attach` takes in another process (valid while the creator lives)."""
        return self.path

    @classmethod
    def create(cls, nbytes: int) -> SharedBlock:
        """Creates a zero-filled block of ``nbytes`` bytes (OSError: one line saying why not)."""
        name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        size = max(nbytes, 1)
        memfd = _memfd_available()
        where = "an anonymous memory file" if memfd else _shm_dir()
        limit = _file_size_limit()
        if limit is not None and size > limit:  # before the OS sends SIGXFSZ (fatal unless ignored)
            raise _create_error(size, where, errno.EFBIG, limit)
        try:
            if memfd:
                fd = os.memfd_create(name, os.MFD_CLOEXEC)
                try:
                    os.ftruncate(fd, size)
                    mm = mmap.mmap(fd, size)
                except OSError:
                    os.close(fd)
                    raise
                return cls(name, f"/proc/{os.getpid()}/fd/{fd}", mm, owner=True, fd=fd)
            path = os.path.join(_shm_dir(), name)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)
                if hasattr(os, "posix_fallocate"):  # a full /dev/shm fails here, not with SIGBUS
                    try:
                        os.posix_fallocate(fd, 0, size)
                    except OSError as e:  # those three: the pages are found when first written
                        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                            raise
                mm = mmap.mmap(fd, size)
            except OSError:
                os.unlink(path)
                raise
            finally:
                os.close(fd)
            return cls(name, path, mm, owner=True)
        except OSError as e:
            raise _create_error(size, where, e.errno, limit, e) from None

    @classmethod
    def attach(cls, handle: str) -> SharedBlock:
        """Maps an existing block by its :attr:`handle` (or, for a named block, its name)."""
        path = handle if os.path.isabs(handle) else os.path.join(_shm_dir(), handle)
        name = os.path.basename(path)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"shared-memory block {handle} does not exist (the job that made it has ended)"
            ) from None
        try:
            if path.startswith("/proc/"):
                name = os.readlink(path).removeprefix("/memfd:").removesuffix(" (deleted)")
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
        """Removes a named block's name (mappings stay valid); safe to call twice."""
        if not self.anonymous:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def close(self) -> None:
        """Unmaps the block if no array still views it; no process can attach after that."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # arrays still export the buffer; dropped at process exit
                return
            self._mm = None


def leaked_blocks() -> list[str]:
    """Names of stalewise blocks still present in ``/dev/shm`` (for tests and diagnostics)."""
    return sorted(n for n in os.listdir(_shm_dir()) if n.startswith(PREFIX))


def held_blocks(pid: int) -> list[str]:
    """Names of the anonymous stalewise blocks process ``pid`` holds (Linux; [] if it is gone)."""
    names = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(f"/memfd:{PREFIX}"):
                    names.add(target.removeprefix("/memfd:").removesuffix(" (deleted)"))
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            _, _, path = line.partition("/memfd:")
            if path.startswith(PREFIX):
                names.add(path.split()[0])
    return sorted(names)
