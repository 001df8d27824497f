"""Checkpoints of a job's shards on disk: atomic, checksummed, with fallback; loading runs no
code from a checkpoint and refuses a bad one with a one-line :class:`CheckpointError`, falling
back to the previous one. The folder layout: ``docs/design-notes.md`` ("Checkpoints")."""

from stalewise.checkpoint.resume import Saver, config_info, drawn_of, feedback_of, resume_point
from stalewise.checkpoint.store import Checkpoint, CheckpointError, exists, load, load_params, save

__all__ = ["Checkpoint", "CheckpointError", "Saver", "config_info", "drawn_of", "exists"]
__all__ += ["feedback_of", "load", "load_params", "resume_point", "save"]
