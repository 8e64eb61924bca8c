"""Graph passes: planners (``plan_*``, read only) and rewrites (``*_pass``), one per file, in one
folder per feature (``zero``, ``sequence``, ``tiling``, ``memory``, ``analysis``) over the types
of the plans they hand off (``plan``); what every feature shares (metadata keys, the
forward/backward split, the custom ops, the private torch imports) sits here at the root."""

from zerofx.passes.zero.param_sync import build_param_sync
from zerofx.passes.partition import partition_joint
from zerofx.passes.plan import Collective, CommKind, ParamPlacement, Plan, ZeroStage
from zerofx.passes.plan.offload import OffloadPlan
from zerofx.passes.memory.plan_offload import plan_offload
from zerofx.passes.zero.plan_sharding import plan_sharding
from zerofx.passes.zero.reduce_grads import reduce_grads_pass
from zerofx.passes.zero.shard_params import shard_params_pass

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
