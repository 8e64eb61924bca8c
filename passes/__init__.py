"""Graph passes: planners (``plan_*``, read only) and rewrites (``*_pass``), one per file."""

from zerofx.passes.param_sync import build_param_sync
from zerofx.passes.partition import partition_joint
from zerofx.passes.plan import Collective, CommKind, ParamPlacement, Plan, ZeroStage
from zerofx.passes.plan.offload import OffloadPlan
from zerofx.passes.plan_offload import plan_offload
from zerofx.passes.plan_sharding import plan_sharding
from zerofx.passes.reduce_grads import reduce_grads_pass
from zerofx.passes.shard_params import shard_params_pass

__all__ = [
    "Collective",
    "CommKind",
    "OffloadPlan",
    "ParamPlacement",
    "Plan",
    "ZeroStage",
    "build_param_sync",
    "partition_joint",
    "plan_offload",
    "plan_sharding",
    "reduce_grads_pass",
    "shard_params_pass",
]
