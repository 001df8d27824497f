"""Checkpoints of a job's shards on disk: atomic, checksummed, with fallback.

A checkpoint is one folder ``<directory>/ckpt-<version:09d>/`` (``version``:
shard 0's update count) holding

- ``shard-<k>.safetensors``: the numpy arrays of shard ``k``'s
  :meth:`~stalewise.protocol.Shard.state_dict` (params, clocks, optimizer
  state, ...), written with :func:`safetensors.numpy.save_file`;
- ``manifest.json``: ``format``, ``created`` (UTC, ISO 8601), ``version``,
  ``shards`` (per shard: its file, the names of its arrays and the JSON-able
  values of its state dict), ``config`` (the job: optimizer, consistency and
  staleness reprs, shard ranges, ...), ``spec`` (the parameters' leaves, names,
  shapes, dtypes, backends, offsets, and the tree structure in plain JSON, so
  :func:`load_params` rebuilds the user's tree), ``step`` (what the runtime
  reports: pushes, time, and the simulator's own state) and ``sha256`` of every
  shard file. The manifest's own checksum is in ``manifest.sha256``;
- ``feedback.safetensors`` (a job whose codec keeps error feedback): each
  worker's error-feedback residual, ``worker-<w>``, a vector of the params' size
  and dtype: what its codec has not sent yet (see
  :mod:`stalewise.protocol.compress`). The manifest names it under ``feedback``
  (``{"file", "workers"}``) and checks it like a shard file. A checkpoint
  without it (older, or of a job without feedback) resumes with zero residuals.

Writes are atomic: everything goes into ``.tmp-ckpt-...`` next to the final
folder, files and folder are fsynced, then the folder is renamed into place
and the ``latest`` pointer file (a checkpoint's folder name) is replaced the
same way. A crash leaves either the old state or the new one; a leftover
temporary folder is ignored by :func:`load` and removed by the next
:func:`save`. One writer per directory.

Loading verifies every checksum and refuses a truncated or corrupt checkpoint
with a warning naming the file, then falls back to the previous complete one.

Example:
    >>> import numpy as np, tempfile, stalewise as sw
    >>> from stalewise.protocol import Shard
    >>> from stalewise import segments
    >>> job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(0.1))
    >>> shard = job.config.build_shard(0, job.config.init.copy(), workers=1)
    >>> d = tempfile.mkdtemp()
    >>> path = save(d, [shard.state_dict()], spec=job.config.spec,
    ...             config_info=config_info(job.config), step_info={"pushes": 0})
    >>> path.name, load(d).states[0]["version"], sw.load(d)["w"].tolist()
    ('ckpt-000000000', 0, [0.0, 0.0, 0.0])
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime
import hashlib
import importlib
import json
import logging
import os
import pickle
import re
import shutil
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from stalewise import tree as tree_lib

log = logging.getLogger(__name__)

FORMAT = 1  # the manifest's layout
MANIFEST = "manifest.json"
FEEDBACK = "feedback.safetensors"  # the workers' error-feedback residuals
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
) -> Path:
    """Writes one checkpoint atomically; returns its folder. Keeps the newest ``keep``.

    A checkpoint of a version that already exists replaces it. ``residuals``:
    each worker's error-feedback residual (worker ``w``'s at index ``w``), saved
    in ``feedback.safetensors``; None saves none.
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

        shards, sums = [], {}
        for k, state in enumerate(shard_states):
            arrays = {key: _contiguous(v) for key, v in state.items() if _is_array(v)}
            values = {key: v for key, v in state.items() if not _is_array(v)}
            name = f"shard-{k}.safetensors"
            save_file(arrays, str(tmp / name))
            _fsync(tmp / name)
            sums[name] = _sha256(tmp / name)
            shards.append({"file": name, "arrays": sorted(arrays), "values": values})
        feedback = None
        if residuals is not None:
            arrays = {f"worker-{w}": _contiguous(np.asarray(r)) for w, r in enumerate(residuals)}
            save_file(arrays, str(tmp / FEEDBACK))
            _fsync(tmp / FEEDBACK)
            sums[FEEDBACK] = _sha256(tmp / FEEDBACK)
            feedback = {"file": FEEDBACK, "workers": len(arrays)}
        manifest = {
            "format": FORMAT,
            "created": datetime.datetime.now(datetime.UTC).isoformat(),
            "version": version,
            "shards": shards,
            "config": config_info,
            "spec": spec_to_json(spec),
            "step": step_info,
            "sha256": sums,
            **({} if feedback is None else {"feedback": feedback}),
        }
        text = json.dumps(manifest, indent=1, allow_nan=True)
        _write(tmp / MANIFEST, text)
        _write(tmp / "manifest.sha256", hashlib.sha256(text.encode()).hexdigest() + "\n")
        _fsync_dir(tmp)
        if final.exists():  # the same version again (e.g. the end of a run): replace it
            old = root / f"{_TMP}old-{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _write_atomic(root / LATEST, final.name + "\n")
    for old in _complete(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    log.info("checkpoint: wrote %s", final)
    return final


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
    _write(tmp, text)
    os.rename(tmp, path)
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
    """The newest usable checkpoint of ``directory`` (or the checkpoint folder itself).

    The one ``latest`` names is tried first, then the others, newest first; a
    refused one is logged (a warning naming the bad file) and the next is used.

    Raises:
        CheckpointError: none is usable.
    """
    root = Path(directory)
    if _NAME.match(root.name) and (root / MANIFEST).exists():
        return _read(root)  # one checkpoint, named: no fallback
    if not root.is_dir():
        raise CheckpointError(f"no checkpoint: {root} is not a directory")
    candidates = _complete(root)
    with contextlib.suppress(OSError):
        named = root / (root / LATEST).read_text().strip()
        if named in candidates:
            candidates.remove(named)
            candidates.insert(0, named)
    refused = []
    for path in candidates:
        try:
            ckpt = _read(path)
        except CheckpointError as e:
            refused.append(path.name)
            log.warning("checkpoint: refused %s", e)
            continue
        if refused:
            log.warning("checkpoint: using %s instead of %s", path.name, ", ".join(refused))
        return ckpt
    if refused:
        raise CheckpointError(
            f"no usable checkpoint in {root}: {', '.join(refused)} failed their checks"
        )
    raise CheckpointError(f"no checkpoint in {root}")


def _read(path: Path) -> Checkpoint:
    """One checkpoint folder, every checksum verified."""
    try:
        raw = (path / MANIFEST).read_bytes()
    except OSError as e:
        raise CheckpointError(f"{path / MANIFEST}: cannot read: {e.strerror or e}") from None
    try:
        want = (path / "manifest.sha256").read_text().strip()
    except OSError:
        raise CheckpointError(f"{path / 'manifest.sha256'}: missing") from None
    if hashlib.sha256(raw).hexdigest() != want:
        raise CheckpointError(f"{path / MANIFEST}: checksum mismatch (truncated or corrupt)")
    try:
        manifest = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"{path / MANIFEST}: not JSON: {e}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"{path / MANIFEST}: unknown format {manifest.get('format')!r}, expected {FORMAT}"
        )
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    def arrays_of(name: str, expected: list[str]) -> dict[str, np.ndarray]:
        file = path / name
        if not file.exists():
            raise CheckpointError(f"{file}: missing")
        if _sha256(file) != manifest["sha256"].get(name):
            raise CheckpointError(f"{file}: checksum mismatch (truncated or corrupt)")
        try:
            arrays = load_file(str(file))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{file}: unreadable: {e}") from None
        if sorted(arrays) != sorted(expected):
            raise CheckpointError(f"{file}: holds {sorted(arrays)}, expected {sorted(expected)}")
        return arrays

    states = []
    for shard in manifest["shards"]:
        states.append({**shard["values"], **arrays_of(shard["file"], shard["arrays"])})
    residuals = None
    if "feedback" in manifest:  # absent: an older checkpoint, or a job without feedback
        n = int(manifest["feedback"]["workers"])
        arrays = arrays_of(manifest["feedback"]["file"], [f"worker-{w}" for w in range(n)])
        residuals = [arrays[f"worker-{w}"] for w in range(n)]
    return Checkpoint(states, manifest, path, residuals)


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

    Refuses a checkpoint of another job; the simulator resumes only from its own
    checkpoints, which carry its virtual clock.
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
    check_compatible(ckpt, config, options.workers)
    if runtime == "sim" and "sim" not in ckpt.step:
        raise CheckpointError(
            f"{ckpt.path.name} was not written by the simulator (runtime "
            f"{ckpt.manifest['config'].get('runtime')!r}); the sim resumes only its own"
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
        **info: Any,
    ):
        self.config, self.options = config, options
        self.info = config_info(
            config, workers=options.workers, strategy=repr(strategy), runtime=runtime, **info
        )
        self.version, self.time = int(version), float(now)  # of the last checkpoint

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
    ) -> Path:
        """Writes the shards' ``states`` and the workers' error-feedback ``residuals``
        (None: the job keeps none); ``step`` holds at least ``pushes`` and ``time``."""
        path = save(
            self.options.checkpoint_dir,
            states,
            spec=self.config.spec,
            config_info=self.info,
            step_info={**step, "run": self.options.run},
            keep=self.options.checkpoint_keep,
            residuals=residuals,
        )
        self.version, self.time = int(states[0]["version"]), float(step["time"])
        return path


def load_params(path: str | os.PathLike, *, backend: str | None = None) -> Any:
    """The parameters of a checkpoint in the user's structure and backend (``sw.load``).

    ``path`` is a checkpoint directory (its newest usable checkpoint is read)
    or one ``ckpt-*`` folder. A torch job's params come back as tensors (a
    model as a ``state_dict``-like dict of name -> tensor, its trainable
    parameters); ``backend="numpy"`` gives NumPy arrays whatever the job used.

    Example:
        >>> import stalewise as sw
        >>> params = sw.load("checkpoints/")  # doctest: +SKIP
    """
    ckpt = load(path)
    spec = spec_from_json(ckpt.manifest["spec"])
    if backend is not None:
        leaves = tuple(dataclasses.replace(leaf, backend=backend) for leaf in spec.leaves)
        spec = dataclasses.replace(spec, leaves=leaves)
    return tree_lib.unflatten(ckpt.flat().astype(spec.dtype, copy=False), spec, copy=True)


# -- the spec as JSON ------------------------------------------------------------------


def spec_to_json(spec: tree_lib.FlatSpec) -> dict[str, Any]:
    """A FlatSpec as plain JSON (classes by import path; exotic keys and statics pickled)."""
    return {
        "dtype": spec.dtype.name,
        "size": int(spec.size),
        "leaves": [
            {
                "path": [_key_to_json(k) for k in leaf.path],
                "name": leaf.name,
                "shape": list(leaf.shape),
                "dtype": leaf.dtype,
                "backend": leaf.backend,
                "offset": int(leaf.offset),
                "size": int(leaf.size),
            }
            for leaf in spec.leaves
        ],
        "tree": _treedef_to_json(spec.treedef),
    }


def spec_from_json(data: dict[str, Any]) -> tree_lib.FlatSpec:
    leaves = tuple(
        tree_lib.LeafSpec(
            tuple(_key_from_json(k) for k in leaf["path"]),
            leaf["name"],
            tuple(leaf["shape"]),
            leaf["dtype"],
            leaf["backend"],
            leaf["offset"],
            leaf["size"],
        )
        for leaf in data["leaves"]
    )
    return tree_lib.FlatSpec(
        leaves, _treedef_from_json(data["tree"]), np.dtype(data["dtype"]), data["size"]
    )


def _pickled(x: Any) -> list:
    return ["pickle", base64.b64encode(pickle.dumps(x)).decode()]


def _key_to_json(k: Any) -> list:
    if isinstance(k, tree_lib.AttrKey):
        return ["attr", str(k)]
    if type(k) is str:
        return ["str", k]
    if type(k) is int:
        return ["int", k]
    return _pickled(k)


def _key_from_json(k: list) -> Any:
    kind, value = k
    if kind == "attr":
        return tree_lib.AttrKey(value)
    if kind == "pickle":
        return pickle.loads(base64.b64decode(value))
    return value


def _cls_to_json(cls: type | None) -> str | None:
    if cls is None:
        return None
    return f"{cls.__module__}:{cls.__qualname__}"


def _cls_from_json(name: str | None, kind: str) -> type | None:
    if name is None:
        return None
    if name == "collections:OrderedDict":
        return OrderedDict
    if name == "builtins:dict":
        return dict
    module, _, qualname = name.partition(":")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj
    except (ImportError, AttributeError):
        log.warning("checkpoint: cannot import %s; its %s comes back as a dict", name, kind)
        return None


def _treedef_to_json(node: tree_lib.TreeDef) -> dict[str, Any]:
    return {
        "kind": node.kind,
        "keys": [_key_to_json(k) for k in node.keys],
        "children": [_treedef_to_json(c) for c in node.children],
        "cls": _cls_to_json(node.cls),
        "static": [[name, _pickled(value)] for name, value in node.static],
    }


def _treedef_from_json(data: dict[str, Any]) -> tree_lib.TreeDef:
    kind = data["kind"]
    keys = tuple(_key_from_json(k) for k in data["keys"])
    children = tuple(_treedef_from_json(c) for c in data["children"])
    cls = _cls_from_json(data["cls"], kind)
    if kind in ("namedtuple", "dataclass") and cls is None:  # the class is gone: a dict
        return tree_lib.TreeDef("dict", tuple(str(k) for k in keys), children, dict)
    static = tuple((name, _key_from_json(v)) for name, v in data["static"])
    return tree_lib.TreeDef(kind, keys, children, cls, static)
