"""The protocol layer: the rules every runtime follows, with no I/O of its own.

A runtime (local processes, the simulator, Ray) only moves messages and bytes;
what a push means, when it is applied, who may send it and what a worker does
between two pulls are decided here.
"""

from stalewise.protocol.shard import Ack, PushHeader, Rejected, ServerConfig, Shard, ShardStats

__all__ = ["Ack", "PushHeader", "Rejected", "ServerConfig", "Shard", "ShardStats"]
