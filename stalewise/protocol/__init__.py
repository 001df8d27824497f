"""The protocol layer: the rules every runtime follows, with no I/O of its own."""

from stalewise.protocol.commit import Verdict, judge
from stalewise.protocol.config import ServerConfig
from stalewise.protocol.loop import Diverged
from stalewise.protocol.messages import Ack, PushHeader, PushResult
from stalewise.protocol.shard import Rejected, Shard, ShardStats

__all__ = ["Ack", "Diverged", "PushHeader", "PushResult", "Rejected", "ServerConfig", "Shard"]
__all__ += ["ShardStats", "Verdict", "judge"]
