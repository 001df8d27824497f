"""Checkpoint folders written and read as data, each manifest field checked, each file read by
:func:`_read_file`: a regular file, no symlink followed, never more than it may hold."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import errno
import hashlib
import itertools
import json
import logging
import math
import os
import re
import shutil
import stat
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stalewise import tree as tree_lib
from stalewise.checkpoint import spec as _spec
from stalewise.checkpoint.spec import MAX_COUNT, is_count, short, spec_from_json, spec_to_json

log = logging.getLogger(__name__)

FORMAT = 3  # the manifest's layout (3: it declares each file's size and arrays)
MANIFEST = "manifest.json"
# the cap on manifest.json (~70,000 leaves); save refuses to write a larger one (EFBIG)
MAX_MANIFEST_BYTES = 32 << 20
_MAX_SMALL_FILE = 4096  # the cap on manifest.sha256 and the latest pointer
FEEDBACK = "feedback.safetensors"  # the workers' error-feedback residuals
RANKS = "ranks.safetensors"  # the arrays of each rank's ctx.state (a loop you own)
LATEST = "latest"  # the pointer file naming the newest checkpoint folder
_NAME = re.compile(r"^ckpt-(\d{9,})$")  # a checkpoint folder
LOG = re.compile(r"^(log-shard-\d{1,6}-[0-9a-f]{8})-(\d{6})$")  # a push log: its chain, its place
_TMP = ".tmp-"  # what a save writes before renaming it into place


class CheckpointError(RuntimeError):
    """No usable checkpoint (missing, corrupt, or not of this job)."""


@dataclasses.dataclass
class Checkpoint:
    """A loaded checkpoint: ``states[k]`` is what ``Shard.load_state_dict`` takes for shard ``k``."""

    states: list[dict[str, Any]]
    manifest: dict[str, Any]
    path: Path
    residuals: list[np.ndarray] | None = None  # each worker's error-feedback residual
    spec: tree_lib.FlatSpec | None = None  # the manifest's spec, of plain containers
    ranks: list[dict[str, Any]] | None = None  # each rank's ctx.state (a loop you own)

    @property
    def version(self) -> int:
        return int(self.manifest["version"])

    @property
    def step(self) -> dict[str, Any]:
        return self.manifest.get("step", {})

    def flat(self) -> np.ndarray:
        """The whole flat parameter vector (the shards' slices in order)."""
        return np.concatenate([s["params"] for s in self.states])


def save(
    directory: str | os.PathLike,
    shard_states: Sequence[dict[str, Any]],
    *,
    spec: tree_lib.FlatSpec,
    config_info: dict[str, Any],
    step_info: dict[str, Any],
    keep: int = 2,
    residuals: Sequence[np.ndarray] | None = None,
    ranks: Sequence[dict[str, Any]] | None = None,
) -> Path:
    """Writes one checkpoint atomically into ``ckpt-<step_info["pushes"]>`` (replacing one of the
    same pushes) and returns it; keeps the newest ``keep``. ``residuals``: each worker's
    error-feedback residual (None: none); ``ranks``: each rank's state (:func:`flat_state`)."""
    if not shard_states:
        raise ValueError("save: no shard states")
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
    root = Path(directory)
    # 0755 (and files 0644) whatever the umask: loading refuses what others can write
    root.mkdir(0o755, parents=True, exist_ok=True)
    for p in root.glob(f"{_TMP}*"):  # left by an interrupted save (one writer per directory)
        log.info("checkpoint: removing %s, left by an interrupted save", p)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    version = int(shard_states[0]["version"])
    final = root / f"ckpt-{int(step_info['pushes']):09d}"
    tmp = root / f"{_TMP}{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(0o755)
    try:
        from safetensors.numpy import save_file

        manifest: dict[str, Any] = {
            "format": FORMAT,
            "created": datetime.datetime.now(datetime.UTC).isoformat(),
            "version": version,
            "shards": [],
            "config": config_info,
            "spec": spec_to_json(spec),
            "step": step_info,
            "sha256": {},
            "files": {},
        }  # then "feedback" and "ranks", if saved

        def write(name: str, arrays: dict[str, np.ndarray]) -> None:
            save_file(arrays, str(tmp / name))
            os.chmod(tmp / name, 0o644)
            _fsync(tmp / name)
            with open(tmp / name, "rb") as f:
                manifest["sha256"][name] = hashlib.file_digest(f, "sha256").hexdigest()
            layout = {key: [a.dtype.name, list(a.shape)] for key, a in sorted(arrays.items())}
            manifest["files"][name] = {"bytes": (tmp / name).stat().st_size, "arrays": layout}

        for k, state in enumerate(shard_states):
            arrays = {key: _contiguous(v) for key, v in state.items() if isinstance(v, np.ndarray)}
            values = {key: v for key, v in state.items() if key not in arrays}
            name = f"shard-{k}.safetensors"
            write(name, arrays)
            manifest["shards"].append({"file": name, "arrays": sorted(arrays), "values": values})
        if residuals is not None:
            arrays = {f"worker-{w}": _contiguous(np.asarray(r)) for w, r in enumerate(residuals)}
            write(FEEDBACK, arrays)
            manifest["feedback"] = {"file": FEEDBACK, "workers": len(arrays)}
        if ranks is not None:
            arrays, values = {}, []
            for r, state in enumerate(ranks):
                flat_arrays, flat_values = flat_state(state, f"rank {r}'s state")
                arrays.update({f"rank-{r}/{k}": _contiguous(a) for k, a in flat_arrays.items()})
                values.append(flat_values)
            write(RANKS, arrays)
            manifest["ranks"] = {"file": RANKS, "values": values}
        text = json.dumps(manifest, indent=1, allow_nan=True)  # ASCII: len(text) is its size
        if len(text) > MAX_MANIFEST_BYTES:  # loading would refuse it
            raise OSError(
                errno.EFBIG,
                f"{MANIFEST} would be {len(text)} bytes, more than the "
                f"{MAX_MANIFEST_BYTES} (MAX_MANIFEST_BYTES) that loading reads",
            )
        _write(tmp / MANIFEST, text)
        _write(tmp / "manifest.sha256", hashlib.sha256(text.encode()).hexdigest() + "\n")
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # into place: until ``latest`` names it, a failure puts back what was there
    replaced = None
    try:
        if final.exists() and _exchange(tmp, final):  # the same pushes again: swapped at once
            replaced = tmp
        elif final.exists():  # (without renameat2) the old one away, then the new one in
            replaced = root / f"{_TMP}old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, replaced)
        if replaced is not tmp:
            os.rename(tmp, final)
        _fsync_dir(root)
        _write_atomic(root / LATEST, final.name + "\n")
    except BaseException:
        if replaced is tmp:  # swapped: swap back
            _exchange(tmp, final)
            replaced = None
        elif not tmp.exists() and final.exists():  # renamed into place: take it out again
            with contextlib.suppress(OSError):
                os.rename(final, tmp)
        if replaced is not None:
            with contextlib.suppress(OSError):
                os.rename(replaced, final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    for old in _complete(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    _prune_logs(root)
    log.info("checkpoint: wrote %s", final)
    return final


def _exchange(a: Path, b: Path) -> bool:
    """Swaps folders ``a`` and ``b`` in one step (Linux ``renameat2``); False: not done."""
    rename = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if rename is None:
        return False
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    return rename(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0


def _prune_logs(root: Path) -> None:
    """Removes the push logs that no kept checkpoint begins at or is followed by."""
    first: dict[str, int] = {}  # chain -> the first file a checkpoint needs
    for path in _complete(root):
        with contextlib.suppress(CheckpointError, ValueError, TypeError, AttributeError):
            step = json.loads(_read_file(path, MANIFEST, MAX_MANIFEST_BYTES))["step"]
            for chain, n in (LOG.match(name).groups() for name in step.get("logs") or ()):
                first[chain] = min(first.get(chain, int(n)), int(n))
    for p in root.iterdir():
        m = LOG.match(p.name)
        if m and int(m[2]) < first.get(m[1], math.inf):
            p.unlink(missing_ok=True)


def flat_state(state: Any, what: str = "ctx.state") -> tuple[dict[str, np.ndarray], dict]:
    """A rank's state as data: ``(arrays, values)`` by path (nested dict keys joined by ``/``),
    numpy arrays and JSON values; ValueError names the path of a value that is not data."""
    arrays: dict[str, np.ndarray] = {}
    values: dict[str, Any] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict) and (node or not path):
            for key, value in node.items():
                if not isinstance(key, str) or not key or "/" in key:
                    raise ValueError(
                        f"{what}: key {key!r} at {path or '/'} is not a name without '/'"
                    )
                walk(value, f"{path}/{key}" if path else key)
            return
        if isinstance(node, np.ndarray):
            if node.dtype.name not in _DTYPES:
                raise ValueError(f"{what}[{path!r}]: a {node.dtype} array, not of {_DTYPES}")
            arrays[path] = node
            return
        if isinstance(node, np.generic):
            node = node.item()
        try:
            json.dumps(node, allow_nan=True)
        except (TypeError, ValueError, RecursionError):
            raise ValueError(
                f"{what}[{path!r}]: a {type(node).__name__}, not data (numbers, strings, "
                "lists, dicts, numpy arrays)"
            ) from None
        values[path] = node

    if not isinstance(state, dict):
        raise ValueError(f"{what} must be a dict, got {type(state).__name__}")
    walk(state, "")
    return arrays, values


def _nested(flat: dict[str, Any]) -> dict[str, Any]:
    """The dict :func:`flat_state` flattened, from its paths."""
    out: dict[str, Any] = {}
    for path, value in sorted(flat.items()):
        *parents, leaf = path.split("/")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise CheckpointError(f"ranks: {path!r} lies under a value, not a dict")
        node[leaf] = value
    return out


def _contiguous(a: np.ndarray) -> np.ndarray:
    """``a`` in C order, keeping its shape (``np.ascontiguousarray`` makes 0-d arrays 1-d)."""
    return a if a.flags.c_contiguous else a.copy(order="C")


def _write(path: Path, text: str) -> None:
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{_TMP}{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        _write(tmp, text)
        os.rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
        _fsync(path)


def _complete(root: Path) -> list[Path]:
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)), reverse=True)


def candidates(root: Path) -> list[Path]:
    """``root``'s checkpoint folders in loading's order: ``latest``'s (if any), then the newest."""
    found = _complete(root)
    with contextlib.suppress(CheckpointError):
        named = root / _read_text(root, LATEST, folder_may_be_a_link=True)
        if named in found:
            found.remove(named)
            found.insert(0, named)
    return found


def exists(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds any checkpoint folder (usable or not)."""
    root = Path(directory)
    return root.is_dir() and bool(_complete(root))


def _read_steady(path: Path) -> Checkpoint:
    """:func:`_read`, once more if the folder was replaced meanwhile (a save of the same pushes)."""
    inode = _inode(path)
    try:
        return _read(path)
    except CheckpointError:
        if _inode(path) == inode:
            raise
    return _read(path)


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def load(directory: str | os.PathLike, check: Any = None) -> Checkpoint:
    """The newest usable checkpoint of ``directory`` (or the folder itself), whole; a refused
    one (also by ``check(ckpt)``) is logged and the next newest used; CheckpointError if none."""
    root = Path(directory)
    if _NAME.match(root.name) and os.path.lexists(root / MANIFEST):
        ckpt = _read(root)  # one checkpoint, named: no fallback
        if check is not None:
            check(ckpt)
        return ckpt
    try:  # the user's folder may be a symlink; where it leads must be trusted
        problem = untrusted(os.stat(root))
    except OSError as e:
        problem = e.strerror or str(e)
    if problem:
        raise CheckpointError(f"no checkpoint: {root}: {problem}")
    refused, newest = [], None
    for path in candidates(root):
        try:
            ckpt = _read_steady(path)
            if check is not None:
                check(ckpt)
        except CheckpointError as e:
            refused.append(path.name)
            newest = newest or e
            log.warning("checkpoint: refused %s", e)
            continue
        if refused:
            log.warning("checkpoint: using %s instead of %s", path.name, ", ".join(refused))
        return ckpt
    if refused:
        raise CheckpointError(
            f"no usable checkpoint in {root}: {', '.join(refused)} failed their checks "
            f"(the first: {newest})"
        )
    raise CheckpointError(f"no checkpoint in {root}")


def _read(path: Path) -> Checkpoint:
    """One checkpoint folder via :func:`_read_file`: checksums, sizes, dtypes, shapes checked."""
    raw = _read_file(path, MANIFEST, MAX_MANIFEST_BYTES, "MAX_MANIFEST_BYTES")
    if hashlib.sha256(raw).hexdigest() != _read_text(path, "manifest.sha256"):
        raise CheckpointError(f"{path / MANIFEST}: checksum mismatch (truncated or corrupt)")
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path / MANIFEST}: not JSON: {short(str(e), 80)}") from None
    try:
        spec = _checked_manifest(manifest, f"{path / MANIFEST}")
    except _spec.NotData as e:
        raise CheckpointError(str(e)) from None
    from safetensors import SafetensorError
    from safetensors.numpy import load as from_bytes

    def arrays_of(name: str) -> dict[str, np.ndarray]:
        file, declared = path / name, manifest["files"][name]
        data = _read_file(path, name, declared["bytes"], "the size the manifest declares")
        if hashlib.sha256(data).hexdigest() != manifest["sha256"][name]:
            raise CheckpointError(f"{file}: checksum mismatch (truncated or corrupt)")
        try:  # from the bytes read above: safetensors never opens the path itself
            arrays = from_bytes(data)
        except (SafetensorError, ValueError, TypeError) as e:
            raise CheckpointError(f"{file}: unreadable: {short(str(e), 120)}") from None
        layout = declared["arrays"]
        if sorted(arrays) != sorted(layout):
            raise CheckpointError(
                f"{file}: holds {short(sorted(arrays))}, expected {short(sorted(layout))}"
            )
        for key, a in arrays.items():
            dtype, shape = layout[key]
            if a.dtype.name != dtype or list(a.shape) != shape:  # exactly: nothing is cast
                raise CheckpointError(
                    f"{file}: {key!r} is {a.dtype.name} of shape {a.shape}, the manifest "
                    f"says {dtype} of shape {tuple(shape)}"
                )
            if a.dtype.kind in "iu" and a.size and int(a.max()) >= MAX_COUNT:  # counters
                raise CheckpointError(f"{file}: {key!r} holds {int(a.max())}, not below 2**62")
        return arrays

    states = [{**shard["values"], **arrays_of(shard["file"])} for shard in manifest["shards"]]
    residuals = None
    if "feedback" in manifest:  # absent: a job without feedback
        arrays = arrays_of(FEEDBACK)
        residuals = [arrays[f"worker-{w}"] for w in range(manifest["feedback"]["workers"])]
    ranks = None
    if "ranks" in manifest:  # a loop you own: each rank's ctx.state
        arrays, ranks = arrays_of(RANKS), []
        for r, flat in enumerate(manifest["ranks"]["values"]):
            mine = {k.split("/", 1)[1]: a for k, a in arrays.items() if k.startswith(f"rank-{r}/")}
            ranks.append(_nested({**flat, **mine}))
    return Checkpoint(states, manifest, path, residuals, spec, ranks)


def open_file(
    folder: Path, name: str, *, folder_may_be_a_link: bool = False
) -> tuple[int, os.stat_result]:
    """A descriptor and stat of regular file ``folder/name``, opened not following a symlink nor
    blocking, in a ``folder`` no symlink (unless ``folder_may_be_a_link``); CheckpointError: why."""
    file = folder / name
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NOFOLLOW
    folder_flags = flags | os.O_DIRECTORY
    if folder_may_be_a_link:
        folder_flags &= ~os.O_NOFOLLOW
    try:
        top = os.open(folder, folder_flags)
    except OSError as e:
        raise CheckpointError(f"{folder}: {_open_problem(e, folder)}") from None
    try:
        if problem := untrusted(os.fstat(top)):
            raise CheckpointError(f"{folder}: {problem}")
        fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=top)
    except OSError as e:
        raise CheckpointError(f"{file}: {_open_problem(e, file)}") from None
    finally:
        os.close(top)
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise CheckpointError(f"{file}: cannot read: {e.strerror or e}") from None
    if problem := untrusted(st, stat.S_IFREG):
        os.close(fd)
        raise CheckpointError(f"{file}: {problem}")
    return fd, st


def _read_file(
    folder: Path, name: str, limit: int, bound: str = "", *, folder_may_be_a_link: bool = False
) -> bytes:
    """The bytes of ``folder/name`` (:func:`open_file`), at most ``limit`` (``bound``: whence)."""
    file = folder / name
    fd, st = open_file(folder, name, folder_may_be_a_link=folder_may_be_a_link)
    size = st.st_size
    try:
        chunks, got = [], 0
        while size <= limit and (chunk := os.read(fd, min(limit + 1 - got, 1 << 30))):
            chunks.append(chunk)  # up to one byte past the limit: a file that grows is seen
            got += len(chunk)
            if got > limit:
                break
        if max(got, size) > limit:
            raise CheckpointError(f"{file}: {max(got, size)} bytes, more than {limit} ({bound})")
        return b"".join(chunks)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)


def _read_text(folder: Path, name: str, *, folder_may_be_a_link: bool = False) -> str:
    """A small text file of a checkpoint (its manifest's checksum, the latest pointer)."""
    data = _read_file(
        folder, name, _MAX_SMALL_FILE, "a small file", folder_may_be_a_link=folder_may_be_a_link
    )
    return data.decode("utf-8", "replace").strip()


_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFREG: "a regular file",
    stat.S_IFLNK: "a symlink",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def untrusted(st: os.stat_result, kind: int = stat.S_IFDIR) -> str | None:
    """Why ``st`` is untrusted (None: a ``kind``, this user's, writable by no one else)."""
    got, me = stat.S_IFMT(st.st_mode), os.getuid()
    if got != kind:
        return f"{_KINDS.get(got, 'a special file')}, not {_KINDS[kind]}"
    if st.st_uid != me:
        return f"belongs to uid {st.st_uid}, not to you (uid {me})"
    if st.st_mode & 0o022:
        return f"writable by others (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def create_file(path: str | os.PathLike, at: int | None = None) -> int:
    """A descriptor of new file ``path`` (0644, ``O_EXCL``) to write, in a folder :func:`untrusted`
    passes (``at``: the file, cut there). OSError: untrusted, or exists (missing, with ``at``)."""
    folder, name = os.path.split(os.fspath(path))
    top = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if problem := untrusted(os.fstat(top)):
            raise PermissionError(errno.EPERM, f"{folder}: {problem}")
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        if at is None:
            return os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=top)
        fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=top)  # a FIFO does not block
    finally:
        os.close(top)
    try:
        if problem := untrusted(os.fstat(fd), stat.S_IFREG):
            raise PermissionError(errno.EPERM, f"{path}: {problem}")
        os.ftruncate(fd, at)
        os.lseek(fd, at, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


class LogWriter:
    """A shard's push log (``who``: in warnings; rules: docs/design-notes.md, "On Ray")."""

    def __init__(self, who: str):
        self.who, self.file, self.path, self.at, self.fsync = who, None, "", 0, False

    def begin(self, path: str, at: int | None = None, fsync: bool = False) -> bool:
        """Ends the log, begins ``path`` (``at``: goes on with it, cut there); False: none (warned)."""
        self.end()
        try:
            self.file = open(create_file(path, at), "wb", buffering=1 << 16)  # noqa: SIM115
        except OSError as e:
            log.warning("%s: no push log: %s: %s", self.who, path, e.strerror or e)
        self.path, self.at, self.fsync = path, at or 0, fsync
        return self.file is not None

    def write(self, entry: list) -> int:
        """Appends ``entry``'s buffers (to the OS at :meth:`sync`); returns their bytes."""
        size = sum(memoryview(b).nbytes for b in entry)
        try:
            if self.file is not None:
                self.file.writelines(entry)
                self.at += size
        except OSError as e:
            self.end(e)
        return size

    def sync(self) -> bool:
        """Whether the log is still open, its entries flushed (with ``fsync``: on the disk)."""
        try:
            if self.file is not None:
                self.file.flush()
                if self.fsync:
                    os.fdatasync(self.file.fileno())
        except OSError as e:
            self.end(e)
        return self.file is not None

    def where(self, unsent: int = 0) -> tuple[str, int]:
        """``(path, bytes)`` of the log before its last ``unsent`` bytes (``("", 0)``: none)."""
        return (self.path, self.at - unsent) if self.file is not None else ("", 0)

    def end(self, error: OSError | None = None, fsync: bool = False) -> None:
        """Closes the log, flushed, fsynced with ``fsync`` or its own set (removed after ``error``)."""
        if (f := self.file) is None:
            return
        self.file = None
        try:
            if error is None:
                f.flush()
                if self.fsync or fsync:
                    os.fsync(f.fileno())
        except OSError as e:
            error = e
        with contextlib.suppress(OSError):
            f.close()
        if error is not None:
            log.warning("%s: push log %s removed: %s", self.who, self.path, error)
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def _open_problem(e: OSError, path: Path) -> str:
    """What an ``os.open`` (O_NOFOLLOW) of a checkpoint's folder or file failing says."""
    if e.errno in (errno.ELOOP, errno.ENOTDIR) and path.is_symlink():
        return "a symbolic link, never followed in a checkpoint"
    if e.errno == errno.ENOENT:
        return "missing"
    return f"cannot open: {e.strerror or e}"


_SHARD_FILE = re.compile(r"^shard-(\d{1,6})\.safetensors$")
_MAX_WORKERS = 1 << 20


def _checked_manifest(m: Any, where: str) -> tree_lib.FlatSpec:
    """Checks every manifest field that loading reads; returns its spec (CheckpointError)."""

    def need(ok: Any, field: str, value: Any, want: str) -> None:
        _spec.need(ok, where, field, value, want)

    count = "an integer in [0, 2**62)"
    need(isinstance(m, dict), "the manifest", m, "a JSON object")
    if (fmt := m.get("format")) != FORMAT:
        old = {
            1: "kept parts of the tree as pickles, which are never loaded",
            2: "declared neither its files' sizes nor its arrays' dtypes and shapes",
        }.get(fmt)
        old = f" (format {fmt} {old}: resume or sw.load_params it with the stalewise that wrote it)"
        raise CheckpointError(f"{where}: unknown format {short(fmt)}, expected {FORMAT}"
                              f"{old if fmt in (1, 2) else ''}")  # fmt: skip
    need(is_count(m.get("version")), "version", m.get("version"), count)
    shards = m.get("shards")
    ok = isinstance(shards, list) and 1 <= len(shards) <= _MAX_WORKERS
    need(ok, "shards", shards, "a non-empty list")
    files = set()
    for k, shard in enumerate(shards):
        need(isinstance(shard, dict), f"shards[{k}]", shard, "an object")
        file, arrays, values = shard.get("file"), shard.get("arrays"), shard.get("values")
        ok = isinstance(file, str) and _SHARD_FILE.match(file) and file not in files
        need(ok, f"shards[{k}].file", file, "a distinct shard-<k>.safetensors")
        files.add(file)
        ok = isinstance(arrays, list) and all(isinstance(a, str) for a in arrays)
        need(ok, f"shards[{k}].arrays", arrays, "a list of names")
        need(isinstance(values, dict), f"shards[{k}].values", values, "an object")
        for key, value in values.items():
            problem = _plain_problem(value, 0)
            need(problem is None, f"shards[{k}].values[{key!r}]", value, problem)
        if k == 0:
            version = values.get("version")
            need(version == m["version"], "shards[0].values['version']", version, f"{m['version']}")
    sums = m.get("sha256")
    ok = isinstance(sums, dict) and all(
        isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) for v in sums.values()
    )
    need(ok, "sha256", sums, "an object of file -> hex digest")
    need(isinstance(m.get("config"), dict), "config", m.get("config"), "an object")
    step = m.get("step")
    need(isinstance(step, dict), "step", step, "an object")
    need(is_count(step.get("pushes")), "step.pushes", step.get("pushes"), count)
    t = step.get("time", 0.0)
    ok = type(t) in (int, float) and math.isfinite(t) and t >= 0
    need(ok, "step.time", t, "a finite number of seconds >= 0")
    drawn = step.get("drawn")
    ok = drawn is None or (
        isinstance(drawn, list) and len(drawn) <= _MAX_WORKERS and all(map(is_count, drawn))
    )
    need(ok, "step.drawn", drawn, "a list of counts in [0, 2**62)")
    logs = step.get("logs")
    ok = logs is None or (
        isinstance(logs, list)
        and len(logs) == len(shards)
        and all(isinstance(x, str) and LOG.match(x) for x in logs)
    )
    need(ok, "step.logs", logs, "a push log name (log-shard-K-TAG-N) per shard")
    sim = step.get("sim")
    if sim is not None:
        need(isinstance(sim, dict), "step.sim", sim, "an object")
        for key in ("pushes", "events"):
            need(is_count(sim.get(key)), f"step.sim.{key}", sim.get(key), count)
        now = sim.get("now")
        ok = type(now) in (int, float) and math.isfinite(now) and now >= 0
        need(ok, "step.sim.now", now, "a finite time >= 0")
        consumed = sim.get("consumed")
        ok = isinstance(consumed, list) and all(map(is_count, consumed))
        need(ok, "step.sim.consumed", consumed, "a list of counts in [0, 2**62)")
    feedback = m.get("feedback")
    if feedback is not None:
        ok = isinstance(feedback, dict) and feedback.get("file") == FEEDBACK
        need(ok, "feedback", feedback, f'{{"file": "{FEEDBACK}", "workers": n}}')
        workers = feedback.get("workers")
        need(is_count(workers, _MAX_WORKERS), "feedback.workers", workers, "a worker count")
    ranked = m.get("ranks")
    if ranked is not None:
        values = ranked.get("values") if isinstance(ranked, dict) else None
        ok = (
            isinstance(ranked, dict)
            and ranked.get("file") == RANKS
            and isinstance(values, list)
            and len(values) <= _MAX_WORKERS
            and all(isinstance(v, dict) for v in values)
        )
        need(ok, "ranks", ranked, f'{{"file": "{RANKS}", "values": [{{...}} per rank]}}')
    spec = spec_from_json(m.get("spec"), f"{where}: spec")
    # what each file must hold, checked exactly on reading
    expected = {shard["file"]: shard["arrays"] for shard in shards}
    if feedback is not None:
        expected[FEEDBACK] = [f"worker-{w}" for w in range(feedback["workers"])]
    if ranked is not None:  # its arrays' names are the file's own (checked when read)
        entry = (m.get("files") or {}).get(RANKS)
        names = entry.get("arrays") if isinstance(entry, dict) else None
        ok = isinstance(names, dict) and all(
            isinstance(k, str)
            and (r := re.fullmatch(r"rank-(\d{1,7})/[^/].*", k))
            and int(r.group(1)) < len(ranked["values"])
            for k in names
        )
        need(ok, f"files[{RANKS!r}].arrays", names, "rank-<r>/<path> names")
        expected[RANKS] = list(names)
    files = m.get("files")
    ok = isinstance(files, dict) and sorted(files) == sorted(expected)
    need(ok, "files", files, f"an object describing {short(sorted(expected))}")
    params, dtype = 0, spec.dtype.name
    for name, arrays in expected.items():
        entry, at = files[name], f"files[{name!r}]"
        need(name in sums, f"sha256[{name!r}]", None, "a hex digest")
        ok = isinstance(entry, dict) and is_count(entry.get("bytes"))
        need(ok, f"{at}.bytes", entry, "a size in bytes")
        layout = entry.get("arrays")
        ok = isinstance(layout, dict) and sorted(layout) == sorted(arrays)
        need(ok, f"{at}.arrays", layout, f"[dtype, shape] of {short(sorted(arrays))}")
        ok = name in (FEEDBACK, RANKS) or "params" in layout
        need(ok, f"{at}.arrays", sorted(layout), "a shard's, with its params")
        for key, described in layout.items():
            ok = (
                isinstance(described, list)
                and len(described) == 2
                and described[0] in _DTYPES
                and isinstance(described[1], list)
                and len(described[1]) <= 64
                and all(map(is_count, described[1]))
            )
            need(ok, f"{at}.arrays[{key!r}]", described, "[dtype, shape]")
            if name != RANKS and (key == "params" or name == FEEDBACK):
                size = spec.size if name == FEEDBACK else described[1][0] if described[1] else -1
                ok = described == [dtype, [size]]
                need(ok, f"{at}.arrays[{key!r}]", described, f"[{dtype!r}, [n]] (the spec's)")
                params += size if key == "params" else 0
    need(params == spec.size, "the shards' params", params, f"{spec.size} elements, as the spec")
    return spec


# the dtypes a checkpoint's arrays may have (what shard states and residuals hold)
_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_DTYPES += ("float16", "float32", "float64")


def _plain_problem(value: Any, depth: int) -> str | None:
    """What is wrong with a JSON value of a shard's state (None: nothing)."""
    if value is None or isinstance(value, bool | str):
        return None
    if isinstance(value, int | float):  # a shard's state counts: no floats there
        return None if is_count(value) else "integers in [0, 2**62)"
    if depth < 4 and isinstance(value, list | dict):
        items = value.values() if isinstance(value, dict) else value
        for item in items:
            problem = _plain_problem(item, depth + 1)
            if problem is not None:
                return problem
        return None
    return "plain JSON values (counts, strings, shallow lists and objects)"


def load_params(path: str | os.PathLike, *, like: Any = None, backend: str | None = None) -> Any:
    """The parameters of a checkpoint (``sw.load_params``).

    ``path``: a checkpoint directory (its newest usable checkpoint) or one ``ckpt-*`` folder.
    With ``like=`` (the job's params, a model, a ``TrainResult.params``), what
    ``TrainResult.params`` gives for a job of ``like``; without it, plain data (no checkpoint code
    runs). Leaves come back in the backend they were saved from (``backend="numpy"``: NumPy).
    CheckpointError: no usable checkpoint, or ``like`` differs (naming the first leaf)."""
    if backend is not None:
        from stalewise.backends import get_backend

        get_backend(backend)  # ValueError naming the known ones
    ckpt = load(path)  # its shards hold as many parameters as its spec: load checked that
    spec = ckpt.spec if like is None else _like_spec(like, ckpt.spec, ckpt.path.name)
    if backend is not None:
        leaves = tuple(dataclasses.replace(leaf, backend=backend) for leaf in spec.leaves)
        spec = dataclasses.replace(spec, leaves=leaves)
    return tree_lib.unflatten(ckpt.flat().astype(spec.dtype, copy=False), spec, copy=True)


def _like_spec(like: Any, saved: tree_lib.FlatSpec, where: str) -> tree_lib.FlatSpec:
    """The spec of ``like`` (as ``sw.Job`` makes it), checked against a checkpoint's."""
    _, want = tree_lib.flatten(like, keep_integers=True)

    def shown(leaf: tree_lib.LeafSpec) -> str:
        return f"{leaf.name!r} ({leaf.dtype}, shape {leaf.shape})"

    for i, (a, b) in enumerate(itertools.zip_longest(saved.leaves, want.leaves)):
        if a is None:
            raise CheckpointError(
                f"{where}: like has more leaves than the checkpoint's {len(saved.leaves)}, "
                f"from {shown(b)}"
            )
        if b is None:
            raise CheckpointError(
                f"{where}: like has {len(want.leaves)} leaves, the checkpoint "
                f"{len(saved.leaves)}; the first missing is {shown(a)}"
            )
        if (a.name, a.shape, a.dtype) != (b.name, b.shape, b.dtype):
            raise CheckpointError(
                f"{where}: leaf {i} is {shown(a)} in the checkpoint, {shown(b)} in like"
            )
    return want
