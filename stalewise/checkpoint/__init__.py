"""Checkpoints of a job's shards on disk: atomic, checksummed, with fallback.

A checkpoint is one folder ``<directory>/ckpt-<pushes:09d>/`` (the job's pushes) holding
``shard-<k>.safetensors`` (the arrays of shard ``k``'s
:meth:`~stalewise.protocol.Shard.state_dict`), ``manifest.json`` (``format``,
``created``, ``version``, ``shards``: each one's file, arrays and JSON values;
``files``: sizes, dtypes and shapes; ``config``; ``spec``: the parameters' leaves
and tree structure, :mod:`~stalewise.checkpoint.spec`; ``step``; ``sha256`` of
every file), ``manifest.sha256``, and optionally ``feedback.safetensors`` (each
worker's error-feedback residual, ``worker-<w>``) and ``ranks.safetensors`` (each
rank's ``ctx.state`` arrays as ``rank-<r>/<path>``, its JSON values in the
manifest's ``ranks``). :func:`save` writes into ``.tmp-ckpt-...``, fsyncs, renames
into place and then replaces the ``latest`` pointer; one writer per directory.
:func:`load` runs no code from a checkpoint (nothing unpickled or imported by
name), reads every file by the rules of :mod:`~stalewise.checkpoint.store`, checks
every checksum, field, dtype and shape, and refuses a bad checkpoint with a
one-line :class:`CheckpointError`, falling back to the previous one.

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
