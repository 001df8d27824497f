"""Checkpoints of a job's shards on disk: atomic, checksummed; loading runs no code from one and
refuses a bad one (:class:`CheckpointError`), falling back. Layout: docs/design-notes.md."""

from stalewise.checkpoint.resume import Saver, config_info, drawn_of, feedback_of, resume_point
from stalewise.checkpoint.store import Checkpoint, CheckpointError, exists, load, load_params, save

__all__ = ["Checkpoint", "CheckpointError", "Saver", "config_info", "drawn_of", "exists"]
__all__ += ["feedback_of", "load", "load_params", "resume_point", "save"]
