"""Model-state memory per rank: parameters, gradients and optimizer states, in bytes.

Pure: a function of per-parameter sizes, the stage, the world size and the optimizer. It is
what ``Program.memory(rank)`` reports and what the engine's real tensors are checked against.

NOTE [What each stage holds, fp32 training, Adam]
Each parameter of ``numel`` elements is padded to ``padded = ceil(numel / N) * N`` and rank r
owns elements ``[r * shard, (r + 1) * shard)`` of the padded flat, ``shard = padded / N``.

    stage | params   | grads          | optimizer states (Adam: exp_avg, exp_avg_sq, step)
    0     | padded   | padded         | 2 * padded + step
    1     | padded   | padded         | 2 * shard + step
    2     | padded   | shard          | 2 * shard + step
    3     | shard    | shard          | 2 * shard + step

At stage 3 the total is 4 + 4 + 8 = 16 bytes per parameter over N: the fp32 equivalent of the
ZeRO paper's 16P/N. In mixed precision (bf16/fp16 parameters and gradients) it is the paper's
2 + 2 + 12: the optimizer states add an fp32 master copy of the owned elements. ``step`` is the one fp32 scalar torch's Adam keeps per parameter tensor.
Frozen parameters hold no gradient and no optimizer state.

With gradient offload (``zerofx.offload_gradients``, stages 2-3) the grads column is 0 on the
device (``device_model_state_bytes``): there is no gradient buffer, and a reduced bucket is on
the device only from its reduction's wait to its hand-off, a transient that the memory timeline
counts (NOTE [Gradients leave at their bucket's wait] in passes/memory/offload_grads.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from zerofx.common.errors import PlanError
from zerofx.cost_models.tiers import NO_OFFLOAD, PLACEMENT_CHOICES

if TYPE_CHECKING:  # compute imports torch, which `zerofx estimate` and --help never load
    from zerofx.cost_models.compute import DeviceSpec


@dataclass(frozen=True)
class OptimizerKind:
    """One optimizer as zerofx builds and accounts for it: a row of ``OPTIMIZERS``."""

    type: str  # the config's ``optimizer.type``
    torch_class: str  # its class in ``torch.optim``, looked up by name where it is built
    params: tuple[str, ...]  # the ``optimizer.params`` keys it takes (torch's argument names)
    state: tuple[str, ...]  # the parameter-sized state tensors torch keeps per parameter (torch's names)
    step: bool  # torch keeps a float32 ``step`` tensor per parameter tensor (Adam's)
    fusable: bool  # takes ``fused=True`` (``zerofx.fused_optimizer``)


_ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay")
_SGD_PARAMS = ("lr", "momentum", "dampening", "weight_decay", "nesterov")

# NOTE [One optimizer table]
# Every optimizer zerofx accepts, keyed by kind: the config's type, except that SGD with
# momentum is its own kind, since it keeps a momentum buffer per parameter and plain SGD keeps
# nothing. The schema's accepted types, the parameters each takes, the torch class the engine
# builds, the state an offloaded record holds and the model-state bytes all come from here.
OPTIMIZERS: dict[str, OptimizerKind] = {
    "AdamW": OptimizerKind("AdamW", "AdamW", _ADAM_PARAMS, ("exp_avg", "exp_avg_sq"), step=True, fusable=True),
    "Adam": OptimizerKind("Adam", "Adam", _ADAM_PARAMS, ("exp_avg", "exp_avg_sq"), step=True, fusable=True),
    "SGD": OptimizerKind("SGD", "SGD", _SGD_PARAMS, (), step=False, fusable=False),
    "SGD+momentum": OptimizerKind("SGD", "SGD", _SGD_PARAMS, ("momentum_buffer",), step=False, fusable=False),
}
# The config's ``optimizer.type`` values, in the table's order.
OPTIMIZER_TYPES = tuple(dict.fromkeys(kind.type for kind in OPTIMIZERS.values()))
STEP_BYTES = 4  # Adam's float32 ``step``, one per parameter tensor


class ParamSizes(Protocol):
    fqn: str
    numel: int
    shard_numel: int
    padded_numel: int
    itemsize: int
    requires_grad: bool


def optimizer_kind(opt_type: str, params: Mapping[str, Any]) -> str:
    """The key into ``OPTIMIZERS`` for an optimizer type and its arguments."""
    if opt_type == "SGD" and params.get("momentum", 0):
        return "SGD+momentum"
    return opt_type


def estimate_model_state_bytes(
    params: Iterable[ParamSizes], *, stage: int, optimizer: str = "AdamW", persistent: Iterable[str] = ()
) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer states one rank holds between steps.
    ``persistent`` names stage-3 parameters kept whole (below the persistence threshold)."""
    keep_whole = set(persistent)
    out = {"params": 0, "grads": 0, "optimizer_states": 0}
    for p in params:
        full, shard = p.padded_numel * p.itemsize, p.shard_numel * p.itemsize
        out["params"] += shard if stage >= 3 and p.fqn not in keep_whole else full
        if not p.requires_grad:
            continue
        out["grads"] += shard if stage >= 2 else full
        owned = full if stage == 0 else shard
        # Optimizer states are fp32 whatever the parameter dtype (ZeRO's accounting), and 16-bit
        # parameters keep an fp32 master copy of the owned elements: 2 + 2 + 12 bytes for Adam.
        owned_numel = owned // p.itemsize
        kind = OPTIMIZERS[optimizer]
        out["optimizer_states"] += len(kind.state) * owned_numel * 4
        if p.itemsize < 4:
            out["optimizer_states"] += owned_numel * 4
        out["optimizer_states"] += STEP_BYTES if kind.step else 0
    return out


def device_model_state_bytes(estimates: Mapping[str, int], *, stage: int, grads_offloaded: bool) -> dict[str, int]:
    """``estimate_model_state_bytes``' result as the device holds it between steps: with
    ``grads_offloaded`` at stages 2-3 no gradient bytes (see the NOTE above)."""
    out = dict(estimates)
    if grads_offloaded and stage >= 2:
        out["grads"] = 0
    return out


def zero_paper_bytes(num_params: int, *, stage: int, world_size: int) -> float:
    """The ZeRO paper's per-rank model-state bytes for mixed-precision Adam (2 + 2 + 12 bytes)."""
    p, n = num_params, world_size
    return {0: 16 * p, 1: 4 * p + 12 * p / n, 2: 2 * p + 14 * p / n, 3: 16 * p / n}[stage]


def paper_breakdown(num_params: float, *, stage: int, world_size: int, offload: str = NO_OFFLOAD,
                    offload_param: str = NO_OFFLOAD, offload_grad: str = NO_OFFLOAD) -> dict[str, float]:
    """The ZeRO paper's per-device accounting for mixed-precision Adam: fp16 parameters (2 bytes),
    fp16 gradients (2) and fp32 master weights + momentum + variance (12), sharded per stage.
    With ``offload`` = "cpu", "nvme" or "auto" (ZeRO-Offload/Infinity; "auto": the planner picks
    the tier), the optimizer states leave the device: they are reported as ``offloaded_bytes``.
    With ``offload_param`` (stage 3 only: the parameter shards) the shards leave it too:
    ``offloaded_param_bytes``; with ``offload_grad`` (stages 2 and 3: the reduced gradient
    shards), the gradients: ``offloaded_grad_bytes``."""
    for name, value in (("offload", offload), ("offload_param", offload_param), ("offload_grad", offload_grad)):
        if value not in PLACEMENT_CHOICES:
            raise PlanError(f"{name}={value!r}; accepted: {', '.join(PLACEMENT_CHOICES)}")
    p, n = float(num_params), world_size
    params = 2 * p / n if stage >= 3 else 2 * p
    grads = 2 * p / n if stage >= 2 else 2 * p
    states = 12 * p / n if stage >= 1 else 12 * p
    params_away = offload_param != NO_OFFLOAD and stage >= 3
    grads_away = offload_grad != NO_OFFLOAD and stage >= 2
    on_device = (0.0 if params_away else params) + (0.0 if grads_away else grads) + (states if offload == NO_OFFLOAD else 0.0)
    return {
        "params_bytes": params,
        "grads_bytes": grads,
        "optimizer_states_bytes": states,
        "per_device_bytes": on_device,
        "offloaded_bytes": 0.0 if offload == NO_OFFLOAD else states,
        "offloaded_param_bytes": params if params_away else 0.0,
        "offloaded_grad_bytes": grads if grads_away else 0.0,
    }


# NOTE [What a rank's resident memory holds]
# The memory timeline counts the tensors of the step: model state, gathered parameters,
# activations, gradients and collective buffers. A rank's process holds more than those: the
# interpreter, torch's and zerofx's code and their import-time objects, the process group's
# buffers and threads, and what capturing a step imports and keeps (AOTAutograd, the
# partitioner, their caches: 24 MiB on this project's machine, which a rank that loads its graphs
# from the plan cache does not hold). That baseline does not depend on the model, so ``zerofx
# calibrate`` measures it once, as the resident set of an idle rank after its imports,
# process-group start-up and the capture of a tiny model on the meta device, and writes it into
# the profile (``DeviceSpec.runtime_bytes``). Where a rank's memory
# is its process's (a CPU rank), its peak resident set is the timeline's peak plus that baseline;
# on a GPU the timeline's peak is the device's and the baseline is host memory.
def estimate_process_peak_bytes(timeline_peak_bytes: float, runtime_bytes: float) -> float:
    """A rank's peak resident memory: the step's peak live bytes and the runtime's baseline
    (NOTE [What a rank's resident memory holds])."""
    return timeline_peak_bytes + runtime_bytes


# NOTE [What Inductor keeps resident]
# A rank whose graphs Inductor compiled (``"zerofx": {"compile": "inductor"}``) holds more than
# the runtime baseline: Inductor's modules (importing compile_fx is 25 MiB), the compiled
# kernels loaded into the process and their Python wrappers, and what compiling leaves in
# CPython's arenas. A rank compiles its graphs from Inductor's on-disk cache after a forked
# child compiled them (NOTE [Inductor compiles first in a child] in zerofx/compiler/program.py),
# so what stays is a cache hit's: 28-31 MiB for the tiny model's graphs on this project's
# machine, against 54-67 MiB compiled in the rank itself, where lowering 25m's 8-block graphs
# left about 30 MiB more than the tiny model's 2 blocks. ``zerofx calibrate`` measures it once,
# as a rank does it, as the resident memory the tiny model's compiled rank graphs add
# (``DeviceSpec.inductor_bytes``). Where the rank's memory is its device's (a CPU rank), it
# counts against the memory budget: the planners that fit the budget (prefetch, recompute,
# tiling, the whole-job search) fit the step to the budget less it. On a GPU it is host memory
# and does not count (a profile that states no host cores); ``zerofx calibrate`` under torchrun
# does not measure it, so the whole-job search leaves Inductor out there.
def inductor_resident_bytes(device: DeviceSpec) -> float:
    """Device memory a rank keeps once Inductor has compiled its graphs (NOTE [What Inductor keeps resident])."""
    return 0.0 if device.cores is None else float(device.inductor_bytes or 0.0)
