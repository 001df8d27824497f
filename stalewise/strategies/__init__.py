"""What a worker computes and pushes between two pulls: a (pseudo-)gradient for the server."""

from stalewise.strategies.adaptive import (
    AdaComm,
    AdaCommState,
    Adaptive,
    AdaptiveState,
    CommBudget,
    CommBudgetState,
    Fixed,
    adacomm,
    adaptive,
    comm_budget,
    fixed,
)
from stalewise.strategies.averaging import (
    EASGD,
    AveragingState,
    LocalSGDStrategy,
    diloco,
    easgd,
    local_sgd,
)
from stalewise.strategies.base import Gradients, LossAndGrad, Step, Strategy, config_key, gradients
from stalewise.strategies.streaming import (
    LazyLeaves,
    StreamingDiLoCo,
    StreamingState,
    lazy_leaves,
    streaming_diloco,
)

__all__ = ["EASGD", "AdaComm", "AdaCommState", "Adaptive", "AdaptiveState", "AveragingState"]
__all__ += ["CommBudget", "CommBudgetState", "Fixed", "Gradients", "LazyLeaves", "LocalSGDStrategy"]
__all__ += ["LossAndGrad", "Step", "Strategy", "StreamingDiLoCo", "StreamingState", "adacomm"]
__all__ += ["adaptive", "comm_budget", "config_key", "diloco", "easgd", "fixed", "gradients"]
__all__ += ["lazy_leaves", "local_sgd", "streaming_diloco"]
