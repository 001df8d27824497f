"""Checkpoints of a job's shards on disk: atomic, checksummed, with fallback.

A checkpoint is one folder ``<directory>/ckpt-<version:09d>/`` (``version``:
shard 0's update count) holding

- ``shard-<k>.safetensors``: the numpy arrays of shard ``k``'s
  :meth:`~stalewise.protocol.Shard.state_dict` (params, clocks, optimizer
  state, ...), written with :func:`safetensors.numpy.save_file`;
- ``manifest.json``: ``format``, ``created`` (UTC, ISO 8601), ``version``,
  ``shards`` (per shard: its file, the names of its arrays and the JSON-able
  values of its state dict), ``files`` (per file: its size in ``bytes`` and its
  arrays' ``[dtype, shape]``), ``config`` (the job: optimizer, consistency and
  staleness reprs, shard ranges, ...), ``spec`` (the parameters' leaves: key
  paths, names, shapes, dtypes, backends, offsets; and the tree's structure as
  container kinds from a closed list, see :func:`spec_to_json`), ``step`` (what
  the runtime reports: pushes, time, and the simulator's own state) and
  ``sha256`` of every shard file. The manifest's own checksum is in
  ``manifest.sha256``;
- ``feedback.safetensors`` (a job whose codec keeps error feedback): each
  worker's error-feedback residual, ``worker-<w>``, a vector of the params' size
  and dtype: what its codec has not sent yet (see
  :mod:`stalewise.protocol.compress`). The manifest names it under ``feedback``
  (``{"file", "workers"}``) and checks it like a shard file. A checkpoint
  without it (older, or of a job without feedback) resumes with zero residuals.
- ``ranks.safetensors`` (a loop you own, ``stalewise run --checkpoint-dir``): each
  rank's ``ctx.state`` as data, its numpy arrays as ``rank-<r>/<path>`` (a path of
  nested dict keys joined by ``/``); the manifest's ``ranks`` holds ``{"file",
  "values"}``, ``values[r]`` the JSON values of rank ``r``'s state by path, and the
  file is checked like a shard file (see :func:`flat_state`).

Writes are atomic: everything goes into ``.tmp-ckpt-...`` next to the final
folder, files and folder are fsynced, then the folder is renamed into place
and the ``latest`` pointer file (a checkpoint's folder name) is replaced the
same way. A crash leaves either the old state or the new one; a leftover
temporary folder is ignored by :func:`load` and removed by the next
:func:`save`. One writer per directory.

Loading verifies every checksum and every field of the manifest (counts are
ints in [0, 2**62), times finite, file names the ones :func:`save` writes), reads
every file through :func:`_read_file` (a regular file in a checkpoint folder that
is no symlink, never followed through one, never a FIFO or device, at most the
size the manifest declares; the manifest at most :data:`MAX_MANIFEST_BYTES`),
checks each array's dtype and shape exactly against the manifest (nothing is
cast), and refuses a truncated, corrupt, ill-formed or mislabelled checkpoint
with a one-line :class:`CheckpointError` naming the file, logged as a warning,
then falls back to the previous complete one. Loading runs no code from a
checkpoint: nothing is unpickled and nothing is imported by name (a checkpoint
is a file people pass around); the user's own classes come back only from the
structure the caller passes (``sw.load_params(path, like=...)``), and a resumed run
uses its own job's spec. Checkpoints of format 1 (which pickled parts of the
tree) and 2 (which declared neither sizes nor dtypes and shapes) are refused.

Example:
    >>> import numpy as np, tempfile, stalewise as sw
    >>> from stalewise.protocol import Shard
    >>> from stalewise import segments
    >>> job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(0.1))
    >>> shard = job.config.build_shard(0, job.config.init.copy(), workers=1)
    >>> d = tempfile.mkdtemp()
    >>> path = save(d, [shard.state_dict()], spec=job.config.spec,
    ...             config_info=config_info(job.config), step_info={"pushes": 0})
    >>> path.name, load(d).states[0]["version"], sw.load_params(d)["w"].tolist()
    ('ckpt-000000000', 0, [0.0, 0.0, 0.0])
"""

from __future__ import annotations

import contextlib
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
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stalewise import runtime as runtime_lib
from stalewise import tree as tree_lib

log = logging.getLogger(__name__)

FORMAT = 3  # the manifest's layout (3: it declares each file's size and arrays; 2 did not;
# 1 pickled parts of the tree)
MANIFEST = "manifest.json"
# the cap on manifest.json, read whole and parsed: its leaf table takes ~460 bytes a leaf,
# so 32 MiB holds ~70,000 leaves; save refuses to write a larger one (EFBIG)
MAX_MANIFEST_BYTES = 32 << 20
_MAX_SMALL_FILE = 4096  # the cap on manifest.sha256 and the latest pointer
FEEDBACK = "feedback.safetensors"  # the workers' error-feedback residuals
RANKS = "ranks.safetensors"  # the arrays of each rank's ctx.state (a loop you own)
LATEST = "latest"
_NAME = re.compile(r"^ckpt-(\d{9,})$")
_TMP = ".tmp-"


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


# -- saving ----------------------------------------------------------------------------


def config_info(config: Any, **extra: Any) -> dict[str, Any]:
    """The job facts a checkpoint records (and :func:`check_compatible` compares)."""
    from stalewise.strategies import config_key

    return {
        # by configuration: the Optimizer's own repr holds function addresses, which
        # differ from process to process (a resume in a new process was refused)
        "optimizer": repr(config_key(config.optimizer)),
        "consistency": repr(config.consistency),
        "staleness": repr(config.staleness),
        "shards": int(config.shards),
        "ranges": [[int(lo), int(hi)] for lo, hi in config.ranges],
        "size": int(config.spec.size),
        "dtype": config.spec.dtype.name,
        **extra,
    }


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
    """Writes one checkpoint atomically; returns its folder. Keeps the newest ``keep``.

    A checkpoint of a version that already exists replaces it. ``residuals``:
    each worker's error-feedback residual (worker ``w``'s at index ``w``), saved
    in ``feedback.safetensors``; None saves none. ``ranks``: each rank's state
    (``ctx.state`` of a loop you own, see :func:`flat_state`), in ``ranks.safetensors``.
    """
    if not shard_states:
        raise ValueError("save: no shard states")
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    _clean_tmp(root)
    version = int(shard_states[0]["version"])
    final = root / f"ckpt-{version:09d}"
    tmp = root / f"{_TMP}{final.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        from safetensors.numpy import save_file

        shards, sums, files = [], {}, {}

        def write(name: str, arrays: dict[str, np.ndarray]) -> None:
            save_file(arrays, str(tmp / name))
            _fsync(tmp / name)
            sums[name] = _sha256(tmp / name)
            layout = {key: [a.dtype.name, list(a.shape)] for key, a in sorted(arrays.items())}
            files[name] = {"bytes": (tmp / name).stat().st_size, "arrays": layout}

        for k, state in enumerate(shard_states):
            arrays = {key: _contiguous(v) for key, v in state.items() if _is_array(v)}
            values = {key: v for key, v in state.items() if not _is_array(v)}
            name = f"shard-{k}.safetensors"
            write(name, arrays)
            shards.append({"file": name, "arrays": sorted(arrays), "values": values})
        feedback = None
        if residuals is not None:
            arrays = {f"worker-{w}": _contiguous(np.asarray(r)) for w, r in enumerate(residuals)}
            write(FEEDBACK, arrays)
            feedback = {"file": FEEDBACK, "workers": len(arrays)}
        ranked = None
        if ranks is not None:
            arrays, values = {}, []
            for r, state in enumerate(ranks):
                flat_arrays, flat_values = flat_state(state, f"rank {r}'s state")
                arrays.update({f"rank-{r}/{k}": _contiguous(a) for k, a in flat_arrays.items()})
                values.append(flat_values)
            write(RANKS, arrays)
            ranked = {"file": RANKS, "values": values}
        manifest = {
            "format": FORMAT,
            "created": datetime.datetime.now(datetime.UTC).isoformat(),
            "version": version,
            "shards": shards,
            "config": config_info,
            "spec": spec_to_json(spec),
            "step": step_info,
            "sha256": sums,
            "files": files,
            **({} if feedback is None else {"feedback": feedback}),
            **({} if ranked is None else {"ranks": ranked}),
        }
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
    # Into place. Until ``latest`` names it, a failure puts back what was there, so a
    # checkpoint that could not be written in full leaves the directory as it was.
    replaced = None
    try:
        if final.exists():  # the same version again (e.g. the end of a run): replace it
            replaced = root / f"{_TMP}old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, replaced)
        os.rename(tmp, final)
        _fsync_dir(root)
        _write_atomic(root / LATEST, final.name + "\n")
    except BaseException:
        if not tmp.exists() and final.exists():  # renamed into place: take it out again
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
    log.info("checkpoint: wrote %s", final)
    return final


def flat_state(state: Any, what: str = "ctx.state") -> tuple[dict[str, np.ndarray], dict]:
    """A rank's state as data: ``(arrays, values)`` by path (nested dict keys joined by
    ``/``). A dict nests; a numpy array (of a dtype safetensors keeps) is an array; any
    other value must be JSON (numbers, strings, bools, None, lists and objects of them;
    a numpy scalar counts as its Python number). Nothing else is kept: no pickle.

    Raises:
        ValueError: one line naming the path of a value that is not data.
    """
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


def _is_array(v: Any) -> bool:
    return isinstance(v, np.ndarray)


def _contiguous(a: np.ndarray) -> np.ndarray:
    """``a`` in C order, keeping its shape (``np.ascontiguousarray`` makes 0-d arrays 1-d)."""
    return a if a.flags.c_contiguous else a.copy(order="C")


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _clean_tmp(root: Path) -> None:
    """Removes what an interrupted save left behind (one writer per directory)."""
    for p in root.glob(f"{_TMP}*"):
        log.info("checkpoint: removing %s, left by an interrupted save", p)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _complete(root: Path) -> list[Path]:
    """The checkpoint folders of ``root``, newest (highest version) first."""
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)), reverse=True)


# -- loading ---------------------------------------------------------------------------


def exists(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds any checkpoint folder (usable or not)."""
    root = Path(directory)
    return root.is_dir() and bool(_complete(root))


def load(directory: str | os.PathLike) -> Checkpoint:
    """The newest usable checkpoint of ``directory`` (or the checkpoint folder itself), whole:
    its shards' state, feedback and manifest, what ``resume`` reads. Users who want the
    parameters call :func:`load_params` (``sw.load_params``).

    The one ``latest`` names is tried first, then the others, newest first; a
    refused one is logged (a warning naming the bad file) and the next is used.

    Raises:
        CheckpointError: none is usable.
    """
    root = Path(directory)
    if _NAME.match(root.name) and os.path.lexists(root / MANIFEST):
        return _read(root)  # one checkpoint, named: no fallback
    if not root.is_dir():
        raise CheckpointError(f"no checkpoint: {root} is not a directory")
    candidates = _complete(root)
    with contextlib.suppress(CheckpointError):
        named = root / _read_text(root, LATEST, folder_may_be_a_link=True)
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
    refused, newest = [], None
    for path in candidates:
        try:
            ckpt = _read(path)
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
    """One checkpoint folder, every file read through :func:`_read_file`, every checksum,
    size, dtype and shape verified."""
    raw = _read_file(path, MANIFEST, MAX_MANIFEST_BYTES, "MAX_MANIFEST_BYTES")
    if hashlib.sha256(raw).hexdigest() != _read_text(path, "manifest.sha256"):
        raise CheckpointError(f"{path / MANIFEST}: checksum mismatch (truncated or corrupt)")
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path / MANIFEST}: not JSON: {_short(str(e), 80)}") from None
    spec = _checked_manifest(manifest, f"{path / MANIFEST}")
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
            raise CheckpointError(f"{file}: unreadable: {_short(str(e), 120)}") from None
        layout = declared["arrays"]
        if sorted(arrays) != sorted(layout):
            raise CheckpointError(
                f"{file}: holds {_short(sorted(arrays))}, expected {_short(sorted(layout))}"
            )
        for key, a in arrays.items():
            dtype, shape = layout[key]
            if a.dtype.name != dtype or list(a.shape) != shape:  # exactly: nothing is cast
                raise CheckpointError(
                    f"{file}: {key!r} is {a.dtype.name} of shape {a.shape}, the manifest "
                    f"says {dtype} of shape {tuple(shape)}"
                )
            if a.dtype.kind in "iu" and a.size and int(a.max()) >= _MAX_COUNT:  # counters
                raise CheckpointError(f"{file}: {key!r} holds {int(a.max())}, not below 2**62")
        return arrays

    states = [{**shard["values"], **arrays_of(shard["file"])} for shard in manifest["shards"]]
    residuals = None
    if "feedback" in manifest:  # absent: a job without feedback
        arrays = arrays_of(FEEDBACK)
        residuals = [arrays[f"worker-{w}"] for w in range(manifest["feedback"]["workers"])]
    ranks = None
    if "ranks" in manifest:  # a loop you own: each rank's ctx.state
        arrays, values = arrays_of(RANKS), manifest["ranks"]["values"]
        ranks = []
        for r, flat in enumerate(values):
            mine = {
                k.split("/", 1)[1]: a for k, a in arrays.items() if k.split("/")[0] == f"rank-{r}"
            }
            ranks.append(_nested({**flat, **mine}))
    return Checkpoint(states, manifest, path, residuals, spec, ranks)


def _read_file(
    folder: Path, name: str, limit: int, bound: str = "", *, folder_may_be_a_link: bool = False
) -> bytes:
    """The bytes of ``folder/name``, at most ``limit`` of them: how every checkpoint file is
    read. The file must be a regular file, opened without following a symlink (and
    without blocking: a FIFO is refused, not waited on), inside ``folder``, which must
    not be a symlink either (unless ``folder_may_be_a_link``: the user's directory of
    checkpoints, for ``latest``). ``bound`` names where ``limit`` comes from.

    Raises:
        CheckpointError: one line naming the file and what is wrong with it.
    """
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
        fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=top)
    except OSError as e:
        raise CheckpointError(f"{file}: {_open_problem(e, file)}") from None
    finally:
        os.close(top)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _FILE_KINDS.get(stat.S_IFMT(st.st_mode), "a special file")
            raise CheckpointError(f"{file}: {kind}, not a regular file")
        chunks, got = [], 0
        while st.st_size <= limit and (chunk := os.read(fd, min(limit + 1 - got, 1 << 30))):
            chunks.append(chunk)  # up to one byte past the limit: a file that grows is seen
            got += len(chunk)
            if got > limit:
                break
        if max(got, st.st_size) > limit:
            size = max(got, st.st_size)
            raise CheckpointError(f"{file}: {size} bytes, more than {limit} ({bound})")
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


_FILE_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def _open_problem(e: OSError, path: Path) -> str:
    """What an ``os.open`` of a checkpoint's folder or file with O_NOFOLLOW says (a folder
    is opened with O_DIRECTORY too, for which a symlink is ENOTDIR)."""
    if e.errno in (errno.ELOOP, errno.ENOTDIR) and path.is_symlink():
        return "a symbolic link, never followed in a checkpoint"
    if e.errno == errno.ENOENT:
        return "missing"
    return f"cannot open: {e.strerror or e}"


_SHARD_FILE = re.compile(r"^shard-(\d{1,6})\.safetensors$")
_MAX_WORKERS = 1 << 20


def _checked_manifest(m: Any, where: str) -> tree_lib.FlatSpec:
    """Checks every field of a manifest that loading or resuming reads, in one place;
    returns its spec. Counts must be ints in [0, 2**62), times finite and >= 0, files
    the names :func:`save` writes, so nothing later fails half-way or overflows.

    Raises:
        CheckpointError: one line naming the manifest and the field.
    """

    def bad(field: str, value: Any, want: str) -> CheckpointError:
        return CheckpointError(f"{where}: {field} is {_short(value)}, expected {want}")

    if not isinstance(m, dict):
        raise bad("the manifest", m, "a JSON object")
    if m.get("format") != FORMAT:
        fmt = m.get("format")
        old = {
            1: "kept parts of the tree as pickles, which are never loaded",
            2: "declared neither its files' sizes nor its arrays' dtypes and shapes",
        }.get(fmt)
        old = (
            f" (format {fmt} {old}: resume or sw.load_params it with the stalewise that wrote it)"
            if old
            else ""
        )
        raise CheckpointError(f"{where}: unknown format {_short(fmt)}, expected {FORMAT}{old}")
    if not _is_count(m.get("version")):
        raise bad("version", m.get("version"), "an integer in [0, 2**62)")
    shards = m.get("shards")
    if not isinstance(shards, list) or not 1 <= len(shards) <= _MAX_WORKERS:
        raise bad("shards", shards, "a non-empty list")
    files = set()
    for k, shard in enumerate(shards):
        if not isinstance(shard, dict):
            raise bad(f"shards[{k}]", shard, "an object")
        file, arrays, values = shard.get("file"), shard.get("arrays"), shard.get("values")
        if not (isinstance(file, str) and _SHARD_FILE.match(file)) or file in files:
            raise bad(f"shards[{k}].file", file, "a distinct shard-<k>.safetensors")
        files.add(file)
        if not isinstance(arrays, list) or not all(isinstance(a, str) for a in arrays):
            raise bad(f"shards[{k}].arrays", arrays, "a list of names")
        if not isinstance(values, dict):
            raise bad(f"shards[{k}].values", values, "an object")
        for key, value in values.items():
            problem = _plain_problem(value, 0)
            if problem is not None:
                raise bad(f"shards[{k}].values[{key!r}]", value, problem)
        if k == 0 and values.get("version") != m["version"]:
            raise bad("shards[0].values['version']", values.get("version"), f"{m['version']}")
    sums = m.get("sha256")
    if not isinstance(sums, dict) or not all(
        isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v) for v in sums.values()
    ):
        raise bad("sha256", sums, "an object of file -> hex digest")
    if not isinstance(m.get("config"), dict):
        raise bad("config", m.get("config"), "an object")
    step = m.get("step")
    if not isinstance(step, dict):
        raise bad("step", step, "an object")
    if not _is_count(step.get("pushes")):
        raise bad("step.pushes", step.get("pushes"), "an integer in [0, 2**62)")
    t = step.get("time", 0.0)
    if type(t) not in (int, float) or not math.isfinite(t) or t < 0:
        raise bad("step.time", t, "a finite number of seconds >= 0")
    drawn = step.get("drawn")
    if drawn is not None and not (
        isinstance(drawn, list) and len(drawn) <= _MAX_WORKERS and all(map(_is_count, drawn))
    ):
        raise bad("step.drawn", drawn, "a list of counts in [0, 2**62)")
    sim = step.get("sim")
    if sim is not None:
        if not isinstance(sim, dict):
            raise bad("step.sim", sim, "an object")
        for key in ("pushes", "events"):
            if not _is_count(sim.get(key)):
                raise bad(f"step.sim.{key}", sim.get(key), "an integer in [0, 2**62)")
        now = sim.get("now")
        if type(now) not in (int, float) or not math.isfinite(now) or now < 0:
            raise bad("step.sim.now", now, "a finite time >= 0")
        consumed = sim.get("consumed")
        if not (isinstance(consumed, list) and all(map(_is_count, consumed))):
            raise bad("step.sim.consumed", consumed, "a list of counts in [0, 2**62)")
    feedback = m.get("feedback")
    if feedback is not None:
        if not isinstance(feedback, dict) or feedback.get("file") != FEEDBACK:
            raise bad("feedback", feedback, f'{{"file": "{FEEDBACK}", "workers": n}}')
        if not _is_count(feedback.get("workers"), _MAX_WORKERS):
            raise bad("feedback.workers", feedback.get("workers"), "a worker count")
    ranked = m.get("ranks")
    if ranked is not None:
        values = ranked.get("values") if isinstance(ranked, dict) else None
        if (
            ranked.get("file") != RANKS
            or not isinstance(values, list)
            or len(values) > _MAX_WORKERS
            or not all(isinstance(v, dict) for v in values)
        ):
            raise bad("ranks", ranked, f'{{"file": "{RANKS}", "values": [{{...}} per rank]}}')
    spec = spec_from_json(m.get("spec"), f"{where}: spec")
    # what each file must hold: its size bounds the read, its arrays' dtypes and shapes are
    # checked exactly on reading; the parameters' and residuals' must be the spec's
    expected = {shard["file"]: shard["arrays"] for shard in shards}
    if feedback is not None:
        expected[FEEDBACK] = [f"worker-{w}" for w in range(feedback["workers"])]
    if ranked is not None:  # its arrays' names are the file's own (checked when read)
        entry = (m.get("files") or {}).get(RANKS)
        names = entry.get("arrays") if isinstance(entry, dict) else None
        if not isinstance(names, dict) or not all(
            isinstance(k, str) and re.fullmatch(r"rank-(\d{1,7})/[^/].*", k) for k in names
        ):
            raise bad(f"files[{RANKS!r}].arrays", names, "rank-<r>/<path> names")
        expected[RANKS] = list(names)
    files = m.get("files")
    if not isinstance(files, dict) or sorted(files) != sorted(expected):
        raise bad("files", files, f"an object describing {_short(sorted(expected))}")
    params, dtype = 0, spec.dtype.name
    for name, arrays in expected.items():
        entry, at = files[name], f"files[{name!r}]"
        if name not in sums:
            raise bad(f"sha256[{name!r}]", None, "a hex digest")
        if not isinstance(entry, dict) or not _is_count(entry.get("bytes")):
            raise bad(f"{at}.bytes", entry, "a size in bytes")
        layout = entry.get("arrays")
        if not isinstance(layout, dict) or sorted(layout) != sorted(arrays):
            raise bad(f"{at}.arrays", layout, f"[dtype, shape] of {_short(sorted(arrays))}")
        if name not in (FEEDBACK, RANKS) and "params" not in layout:
            raise bad(f"{at}.arrays", sorted(layout), "a shard's, with its params")
        for key, described in layout.items():
            if not (
                isinstance(described, list)
                and len(described) == 2
                and described[0] in _DTYPES
                and isinstance(described[1], list)
                and len(described[1]) <= 64
                and all(map(_is_count, described[1]))
            ):
                raise bad(f"{at}.arrays[{key!r}]", described, "[dtype, shape]")
            if name != RANKS and (key == "params" or name == FEEDBACK):
                size = spec.size if name == FEEDBACK else described[1][0] if described[1] else -1
                if described != [dtype, [size]]:
                    raise bad(f"{at}.arrays[{key!r}]", described, f"[{dtype!r}, [n]] (the spec's)")
                params += size if key == "params" else 0
    if params != spec.size:
        raise bad("the shards' params", params, f"{spec.size} elements, as the spec")
    return spec


# the dtypes a checkpoint's arrays may have (what shard states and residuals hold)
_DTYPES = ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
_DTYPES += ("float16", "float32", "float64")


def _plain_problem(value: Any, depth: int) -> str | None:
    """What is wrong with a JSON value of a shard's state (None: nothing): its numbers
    must be counts (ints in [0, 2**62)), its nesting shallow."""
    if value is None or isinstance(value, bool | str):
        return None
    if isinstance(value, int | float):  # a shard's state counts: no floats there
        return None if _is_count(value) else "integers in [0, 2**62)"
    if depth < 4 and isinstance(value, list | dict):
        items = value.values() if isinstance(value, dict) else value
        for item in items:
            problem = _plain_problem(item, depth + 1)
            if problem is not None:
                return problem
        return None
    return "plain JSON values (counts, strings, shallow lists and objects)"


def check_compatible(ckpt: Checkpoint, config: Any, workers: int | None = None) -> None:
    """Raises CheckpointError (one line) unless ``ckpt`` was made by a job like ``config``."""
    info = config_info(config)
    saved = ckpt.manifest["config"]
    for key in ("shards", "ranges", "size", "dtype", "optimizer", "consistency", "staleness"):
        if saved.get(key) != info[key]:
            raise CheckpointError(
                f"{ckpt.path.name} is of another job: {key} is {saved.get(key)!r} there, "
                f"{info[key]!r} here"
            )
    names = [leaf["name"] for leaf in ckpt.manifest["spec"]["leaves"]]
    if names != [leaf.name for leaf in config.spec.leaves]:
        raise CheckpointError(f"{ckpt.path.name} is of another job: its leaves are {names}")
    if workers is not None and ckpt.states[0]["workers"] != workers:
        raise CheckpointError(
            f"{ckpt.path.name} is of a run with {ckpt.states[0]['workers']} workers, "
            f"this one has {workers}"
        )
    if ckpt.residuals is not None:
        if workers is not None and len(ckpt.residuals) != workers:
            raise CheckpointError(
                f"{ckpt.path.name} holds the error-feedback residuals of "
                f"{len(ckpt.residuals)} workers, this run has {workers}"
            )
        want, dtype = (int(config.spec.size),), np.dtype(config.spec.dtype)
        for w, r in enumerate(ckpt.residuals):
            if r.shape != want or r.dtype != dtype:
                raise CheckpointError(
                    f"{ckpt.path.name}: worker {w}'s error-feedback residual is {r.dtype} of "
                    f"shape {r.shape}, this job's parameters are {dtype} of shape {want}"
                )
    drawn = ckpt.step.get("drawn")
    if drawn is not None:
        if not isinstance(drawn, list) or (workers is not None and len(drawn) != workers):
            raise CheckpointError(
                f"{ckpt.path.name}: 'drawn' must list the batches each of this run's "
                f"{workers} workers drew, got {drawn!r}"
            )
        for w, n in enumerate(drawn):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise CheckpointError(
                    f"{ckpt.path.name}: worker {w}'s count of batches drawn is {n!r}, "
                    "not an integer >= 0"
                )


# -- a run's checkpoints (both runtimes) --------------------------------------------------


def resume_point(config: Any, options: Any, *, runtime: str) -> Checkpoint | None:
    """The checkpoint a run with ``options.resume`` continues from (None: start afresh).

    Refuses a checkpoint of another job, and one without the step key the runtime
    resumes from (its :class:`~stalewise.runtime.Runtime`'s ``resumes_from``: the
    simulator resumes only from its own checkpoints, which carry its virtual clock).
    """
    if not options.resume:
        return None
    if not exists(options.checkpoint_dir):
        log.warning(
            "%s: resume: no checkpoint in %s yet; starting from the start",
            runtime,
            options.checkpoint_dir,
        )
        return None
    ckpt = load(options.checkpoint_dir)
    check_compatible(ckpt, config, options.room)
    # a host outside the registry (a test's, a user's own driver) has no such rule
    own = runtime_lib.describe(runtime).resumes_from if runtime in runtime_lib.names() else None
    if own is not None and own not in ckpt.step:
        raise CheckpointError(
            f"{ckpt.path.name} was not written by runtime {runtime!r} (runtime "
            f"{ckpt.manifest['config'].get('runtime')!r}); it resumes only its own"
        )
    return ckpt


def feedback_of(ckpt: Checkpoint | None, config: Any, workers: int) -> list[Any] | None:
    """Each worker's error-feedback state (a ``compress.Feedback``) for a run of ``config``
    resumed from ``ckpt``, worker ``w``'s at index ``w``; None when this job's codec keeps
    no feedback.

    A checkpoint without residuals (older, or of a job without feedback) gives zero
    residuals; the values of leaves whose codec keeps no feedback here are zeroed
    (:meth:`~stalewise.protocol.compress.Compressor.adopt`). Call it after
    :func:`check_compatible`, which refuses residuals of another shape or worker count.
    """
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
    """How many batches each worker id had drawn at ``ckpt``: a resumed worker's new
    stream skips them (:func:`~stalewise.runtime.base.batch_iterator`). Zeros without
    a checkpoint or with an older one, which did not count them. Call it after
    :func:`check_compatible`, which refuses counts of another worker count."""
    drawn = None if ckpt is None else ckpt.step.get("drawn")
    return [0] * workers if drawn is None else list(drawn)


class Saver:
    """A run's checkpoints into ``options.checkpoint_dir``: when :meth:`due` says so
    (every ``checkpoint_every`` updates of shard 0 and/or ``checkpoint_seconds``
    seconds, virtual in the simulator), and at the end of the run.

    A checkpoint that cannot be written (disk full, a read-only folder, ...) never
    costs the run: :meth:`save` warns (:class:`~stalewise.runtime.base.FailureWarning`,
    naming the folder and the OS error), logs it, records it in ``failures`` (the
    run's :class:`~stalewise.runtime.base.Failures`, so ``TrainResult.failures``),
    leaves the previous checkpoint as it was, and returns None; the run goes on and
    the next one is tried a period later. :attr:`failed`: whether the last attempt
    failed.
    """

    def __init__(
        self,
        config: Any,
        strategy: Any,
        options: Any,
        *,
        runtime: str,
        version: int,
        now: float = 0.0,
        failures: Any = None,
        **info: Any,
    ):
        self.config, self.options, self.failures = config, options, failures
        self.info = config_info(
            config, workers=options.room, strategy=repr(strategy), runtime=runtime, **info
        )
        self.version, self.time = int(version), float(now)  # of the last checkpoint (attempt)
        self.last: Path | None = None  # the last checkpoint this saver wrote
        self.failed = False

    @property
    def periodic(self) -> bool:
        """Whether checkpoints are taken during the run, not only at its end."""
        o = self.options
        return o.checkpoint_every is not None or o.checkpoint_seconds is not None

    def due(self, version: int, now: float) -> bool:
        """Whether a periodic checkpoint is due at shard 0's ``version`` and time ``now``."""
        o = self.options
        return (
            o.checkpoint_every is not None and version - self.version >= o.checkpoint_every
        ) or (o.checkpoint_seconds is not None and now - self.time >= o.checkpoint_seconds)

    def save(
        self,
        states: Sequence[dict[str, Any]],
        step: dict[str, Any],
        residuals: Sequence[np.ndarray] | None = None,
        *,
        final: bool = False,
        ranks: Sequence[dict[str, Any]] | None = None,
    ) -> Path | None:
        """Writes the shards' ``states`` and the workers' error-feedback ``residuals``
        (None: the job keeps none); ``step`` holds at least ``pushes`` and ``time``.
        ``final``: the run's last checkpoint. Returns its folder, or None if it could
        not be written (see the class)."""
        from safetensors import SafetensorError

        # the next periodic one is due a period after this attempt, written or not
        self.version, self.time = int(states[0]["version"]), float(step["time"])
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
        except (OSError, SafetensorError) as e:
            self._failed(directory, e, self.time, final)
            return None
        self.last, self.failed = path, False
        return path

    def _failed(self, directory: Path, error: BaseException, now: float, final: bool) -> None:
        from stalewise.runtime.base import warn_user

        self.failed = True
        cause = " ".join(str(error).split()) or type(error).__name__
        cause = cause if len(cause) <= 300 else cause[:297] + "..."
        kept = self.last.name if self.last is not None else _newest_name(directory)
        action = f"kept {kept or 'none'}"
        if self.failures is not None:
            self.failures.checkpoint(str(directory), cause, time=now, action=action, final=final)
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


def _newest_name(directory: Path) -> str | None:
    """The name of the checkpoint :func:`load` would try first in ``directory``, if any."""
    try:
        found = _complete(directory)
    except OSError:
        return None
    with contextlib.suppress(CheckpointError):
        named = _read_text(directory, LATEST, folder_may_be_a_link=True)
        if directory / named in found:
            return named
    return found[0].name if found else None


def load_params(path: str | os.PathLike, *, like: Any = None, backend: str | None = None) -> Any:
    """The parameters of a checkpoint (``sw.load_params``).

    ``path`` is a checkpoint directory (its newest usable checkpoint is read)
    or one ``ckpt-*`` folder. Loading runs no code from the checkpoint: the
    manifest's tree is plain data (key paths, shapes, dtypes and container
    kinds), so the user's own classes come back only from ``like``:

    - ``like=`` a tree of the job's structure (the params the job was made
      with, a model, or a ``TrainResult.params``): the result is what
      ``TrainResult.params`` gives for a job of ``like`` (its namedtuples,
      dataclasses, registered containers, backends; a model as a dict of name
      -> tensor). Its leaves must be the checkpoint's, in order, with the same
      names, shapes and dtypes, else a one-line :class:`CheckpointError` names
      the first that differs.
    - without ``like``: plain data. Dicts (``OrderedDict`` kept), lists, tuples
      and ``None`` as saved; a namedtuple, a dataclass or a registered container
      (flax, equinox, ...) as a dict of its field names; a model as a dict of
      name -> tensor; a constant of the job's tree (an integer buffer, a static
      field, a filtered-out non-array) as ``None``.

    Leaves come back in the backend they were saved from (a torch job's as
    tensors); ``backend="numpy"`` gives NumPy arrays whatever the job used.

    Raises:
        CheckpointError: no usable checkpoint, or ``like`` differs from it.

    Example:
        >>> import stalewise as sw
        >>> params = sw.load_params("checkpoints/", like=model)  # doctest: +SKIP
    """
    if backend is not None:
        from stalewise.backends import get_backend

        get_backend(backend)  # ValueError naming the known ones
    ckpt = load(path)
    spec = ckpt.spec
    flat = ckpt.flat()
    where = ckpt.path.name
    if flat.size != spec.size:
        raise CheckpointError(
            f"{where}: the shards hold {flat.size} parameters, its spec {spec.size}"
        )
    if like is not None:
        spec = _like_spec(like, spec, where)
    if backend is not None:
        leaves = tuple(dataclasses.replace(leaf, backend=backend) for leaf in spec.leaves)
        spec = dataclasses.replace(spec, leaves=leaves)
    return tree_lib.unflatten(flat.astype(spec.dtype, copy=False), spec, copy=True)


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


# -- the spec as JSON ------------------------------------------------------------------
#
# Plain data only: nothing in a manifest is unpickled or imported. A node of the tree is
# {"kind", "keys", "children"} with kind from _KINDS, plus "leaf" (an alias: the stored
# leaf it names), "ordered" (an OrderedDict) or "type" (a namedtuple's, dataclass's or
# registered container's class, "module.QualName": for people reading it, never imported).
# A key is [kind, value]: "str", "int", "attr" (a field), "hidden" (a field left out of
# leaf names), or "repr" (any other key, as its repr; it comes back as that string).

_KINDS = ("leaf", "alias", "const", "none", "dict", "list", "tuple")
_KINDS += ("namedtuple", "dataclass", "registry")
_KEY_KINDS = ("str", "int", "attr", "hidden", "repr")
_MAX_COUNT = 2**62  # counts and sizes in a manifest are ints in [0, 2**62)
_MAX_DEPTH = 256  # nesting of the tree


def spec_to_json(spec: tree_lib.FlatSpec) -> dict[str, Any]:
    """A FlatSpec as plain JSON data (no pickles, no import paths to follow)."""
    return {
        "dtype": spec.dtype.name,
        "size": int(spec.size),
        "leaves": [
            {
                "path": [_key_to_json(k) for k in leaf.path],
                "name": leaf.name,
                "shape": [int(n) for n in leaf.shape],
                "dtype": leaf.dtype,
                "backend": leaf.backend,
                "offset": int(leaf.offset),
                "size": int(leaf.size),
                "buffer": bool(leaf.buffer),
            }
            for leaf in spec.leaves
        ],
        "tree": _treedef_to_json(spec.treedef),
    }


def spec_from_json(data: Any, where: str = "spec") -> tree_lib.FlatSpec:
    """The FlatSpec of :func:`spec_to_json`'s data, of plain containers only (see
    :func:`load_params`); every field checked. Imports and unpickles nothing.

    Raises:
        CheckpointError: one line naming the bad field.
    """

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: {what}")

    from stalewise.backends import FLOAT_DTYPES, get_backend

    if not isinstance(data, dict):
        raise bad(f"expected an object, got {_short(data)}")
    dtype = data.get("dtype")
    if dtype not in ("float32", "float64"):
        raise bad(f"dtype is {_short(dtype)}, expected 'float32' or 'float64'")
    raw = data.get("leaves")
    if not isinstance(raw, list):
        raise bad(f"leaves is {_short(raw)}, expected a list")
    leaves, offset = [], 0
    for i, leaf in enumerate(raw):
        at = f"leaf {i}"
        if not isinstance(leaf, dict):
            raise bad(f"{at} is {_short(leaf)}, expected an object")
        path = leaf.get("path")
        if not isinstance(path, list) or len(path) > _MAX_DEPTH:
            raise bad(f"{at}: path is {_short(path)}, expected a list of keys")
        keys = tuple(_key_from_json(k, f"{where}: {at}: path") for k in path)
        name, shape = leaf.get("name"), leaf.get("shape")
        if not isinstance(name, str):
            raise bad(f"{at}: name is {_short(name)}, expected a string")
        at = f"leaf {name!r}"
        if not isinstance(shape, list) or len(shape) > 64 or not all(map(_is_count, shape)):
            raise bad(f"{at}: shape is {_short(shape)}, expected a list of counts")
        if leaf.get("dtype") not in FLOAT_DTYPES:
            raise bad(f"{at}: dtype is {_short(leaf.get('dtype'))}, expected one of {FLOAT_DTYPES}")
        backend = leaf.get("backend")
        try:
            get_backend(backend) if isinstance(backend, str) else get_backend("")
        except ValueError:
            raise bad(f"{at}: unknown backend {_short(backend)}") from None
        size = math.prod(shape)
        if leaf.get("size") != size or size >= _MAX_COUNT:
            raise bad(f"{at}: size is {_short(leaf.get('size'))}, its shape {shape} says {size}")
        if leaf.get("offset") != offset:
            raise bad(f"{at}: offset is {_short(leaf.get('offset'))}, expected {offset}")
        buffer = leaf.get("buffer", False)
        if not isinstance(buffer, bool):
            raise bad(f"{at}: buffer is {_short(buffer)}, expected true or false")
        leaves.append(
            tree_lib.LeafSpec(
                keys, name, tuple(shape), leaf["dtype"], backend, offset, size, buffer
            )
        )
        offset += size
        if offset >= _MAX_COUNT:
            raise bad(f"{at}: the leaves hold 2**62 elements or more")
    if data.get("size") != offset:
        raise bad(f"size is {_short(data.get('size'))}, its leaves hold {offset} elements")
    counted = [0]
    treedef = _treedef_from_json(data.get("tree"), where, len(leaves), counted, 0)
    if counted[0] != len(leaves):
        raise bad(f"the tree holds {counted[0]} leaves, the leaf table {len(leaves)}")
    return tree_lib.FlatSpec(tuple(leaves), treedef, np.dtype(dtype), offset)


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters (a message stays one short line)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _is_count(value: Any, limit: int = _MAX_COUNT) -> bool:
    return type(value) is int and 0 <= value < limit


def _key_to_json(k: Any) -> list:
    if isinstance(k, tree_lib.HiddenKey):
        return ["hidden", str(k)]
    if isinstance(k, tree_lib.AttrKey):
        return ["attr", str(k)]
    if isinstance(k, str):
        return ["str", str(k)]
    if isinstance(k, int) and not isinstance(k, bool):
        return ["int", int(k)]
    return ["repr", repr(k)]


def _key_from_json(k: Any, where: str) -> Any:
    if not (isinstance(k, list) and len(k) == 2 and k[0] in _KEY_KINDS):
        raise CheckpointError(f"{where}: key {_short(k)} is not one of [{'|'.join(_KEY_KINDS)}, x]")
    kind, value = k
    if kind == "int":
        if type(value) is not int:
            raise CheckpointError(f"{where}: key {_short(k)}: expected an integer")
        return value
    if not isinstance(value, str):
        raise CheckpointError(f"{where}: key {_short(k)}: expected a string")
    if kind == "hidden":
        return tree_lib.HiddenKey(value)
    if kind == "attr":
        return tree_lib.AttrKey(value)
    return value


def _treedef_to_json(node: tree_lib.TreeDef) -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": node.kind,
        "keys": [_key_to_json(k) for k in node.keys],
        "children": [_treedef_to_json(c) for c in node.children],
    }
    if node.kind == "alias":
        out["leaf"] = int(dict(node.static)["leaf"])
    elif node.kind == "dict" and node.cls is OrderedDict:
        out["ordered"] = True
    elif node.kind in ("namedtuple", "dataclass", "registry") and node.cls is not None:
        out["type"] = f"{node.cls.__module__}.{node.cls.__qualname__}"  # never imported
    return out


def _treedef_from_json(
    data: Any, where: str, leaves: int, counted: list[int], depth: int
) -> tree_lib.TreeDef:
    """A node of plain containers (see :func:`load_params`); ``counted[0]`` counts the
    stored leaves met, ``leaves`` is how many there are."""

    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: {what}")

    if depth > _MAX_DEPTH:
        raise bad(f"the tree is nested more than {_MAX_DEPTH} levels deep")
    if not isinstance(data, dict):
        raise bad(f"a tree node is {_short(data)}, expected an object")
    kind, keys, children = data.get("kind"), data.get("keys", []), data.get("children", [])
    if kind not in _KINDS:
        raise bad(f"unknown tree node kind {_short(kind)} (known: {', '.join(_KINDS)})")
    if not (isinstance(keys, list) and isinstance(children, list) and len(keys) == len(children)):
        raise bad(f"a {kind} node's keys and children are not two lists of one length")
    if kind in ("leaf", "alias", "const", "none") and keys:
        raise bad(f"a {kind} node has children")
    if kind == "leaf":
        counted[0] += 1
        return tree_lib.TreeDef("leaf")
    if kind == "alias":
        index = data.get("leaf")
        if not _is_count(index, leaves):
            raise bad(f"an alias names leaf {_short(index)}, there are {leaves}")
        return tree_lib.TreeDef("alias", static=(("leaf", index),))
    if kind == "const":  # not stored: the value is the job's own (from like=), else None
        return tree_lib.TreeDef("const", static=(("value", None),))
    if kind == "none":
        return tree_lib.TreeDef("none")
    keys = tuple(_key_from_json(k, f"{where}: a {kind} node") for k in keys)
    kids = tuple(_treedef_from_json(c, where, leaves, counted, depth + 1) for c in children)
    if kind in ("list", "tuple"):
        if keys != tuple(range(len(kids))):
            raise bad(f"a {kind} node's keys are not 0..{len(kids) - 1}")
        return tree_lib.TreeDef(kind, keys, kids)
    # a dict, or a user's container as a dict of its field names
    plain = tuple(str(k) if isinstance(k, str) else k for k in keys)
    if len(set(plain)) != len(plain):
        raise bad(f"a {kind} node has a key twice: {_short(list(plain))}")
    ordered = kind == "dict" and data.get("ordered") is True
    return tree_lib.TreeDef("dict", plain, kids, OrderedDict if ordered else dict)
