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
  container kinds from a closed list, see :mod:`~stalewise.checkpoint.spec`), ``step`` (what
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
  file is checked like a shard file (see :func:`~stalewise.checkpoint.store.flat_state`).

Writes are atomic (:func:`save`): everything goes into ``.tmp-ckpt-...`` beside the
final folder, fsynced, renamed into place, then the ``latest`` pointer file is replaced
the same way. One writer per directory.

Loading (:func:`load`) runs no code from a checkpoint, a file people pass around:
nothing is unpickled or imported by name (the user's classes come back only from
``sw.load_params(path, like=...)``). Every file is read by the folder rules of
:mod:`~stalewise.checkpoint.store` (no symlink followed, no FIFO or device, bounded
reads), every checksum and manifest field is checked, each array's dtype and shape
must be exactly the manifest's, and a checkpoint that fails is refused with a one-line
:class:`CheckpointError` naming the file; the previous one is used. The tree spec's
JSON: :mod:`~stalewise.checkpoint.spec`; a run's resume and :class:`Saver`:
:mod:`~stalewise.checkpoint.resume`.

Example:
    >>> import numpy as np, tempfile, stalewise as sw
    >>> from stalewise.checkpoint import config_info, load, save
    >>> job = sw.Job({"w": np.zeros(3, np.float32)}, optimizer=sw.optim.sgd(0.1))
    >>> shard = job.config.build_shard(0, job.config.init.copy(), workers=1)
    >>> d = tempfile.mkdtemp()
    >>> path = save(d, [shard.state_dict()], spec=job.config.spec,
    ...             config_info=config_info(job.config), step_info={"pushes": 0})
    >>> path.name, load(d).states[0]["version"], sw.load_params(d)["w"].tolist()
    ('ckpt-000000000', 0, [0.0, 0.0, 0.0])
"""

from stalewise.checkpoint.resume import Saver, config_info, drawn_of, feedback_of, resume_point
from stalewise.checkpoint.store import Checkpoint, CheckpointError, exists, load, load_params, save

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "Saver",
    "config_info",
    "drawn_of",
    "exists",
    "feedback_of",
    "load",
    "load_params",
    "resume_point",
    "save",
]
