"""The local runtime: shards and workers as OS processes on one machine."""
