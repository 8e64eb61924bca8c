"""The arithmetic of a training step over this rank's shards: gradient accumulation, the fp16
loss scale, the overflow check, clipping, the learning-rate schedule and the optimizer update.

The engine sequences a step (graphs, collectives of its programs, monitors, ``param_sync``) and
asks ``OptimizerStep`` for the numbers: the backward's seed, whether a ``step()`` call is an
accumulation boundary, and at the boundary the update itself, which returns whether the shards
changed. The overflow check and the gradient norm are collectives over the engine's group, so
every rank takes the same branch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerofx.config import OptimizerSpec, ZeroConfig, torch_optimizer_class
from zerofx.cost_models.memory import OPTIMIZERS
from zerofx.cost_models.tiers import Tier
from zerofx.runtime.engine_storage import EngineStorage, storage_bytes
from zerofx.runtime.loss_scaling import LossScaler
from zerofx.runtime.offload import OffloadedOptimizer
from zerofx.runtime.offload.grads import OffloadedGrads
from zerofx.runtime.schedulers import lr_at
from zerofx.runtime.train_state import StepCounters


def build_optimizer(spec: OptimizerSpec, params: list[torch.Tensor], *, fused: bool = False) -> torch.optim.Optimizer:
    kw = dict(spec.params)
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    if fused and OPTIMIZERS[spec.type].fusable:  # config key zerofx.fused_optimizer
        kw["fused"] = True
    cls = torch_optimizer_class(spec.type)
    return cls(params, **kw)


@dataclass(frozen=True)
class StepOutcome:
    """What an optimizer step at an accumulation boundary did."""

    updated: bool  # the shards changed (False: an overflow skip, or a delayed update still in flight)
    grad_norm: float | torch.Tensor | None  # before clipping; None when neither clipping nor monitors ask


class OptimizerStep:
    """The optimizer over this rank's shards (``storage.optimizer_params``), the fp16 loss scaler
    and the step's arithmetic. ``counters`` is the engine's: it reads ``global_steps`` and
    ``micro_steps`` and counts micro-steps and skipped steps."""

    def __init__(self, cfg: ZeroConfig, storage: EngineStorage, counters: StepCounters, *, group: dist.ProcessGroup,
                 num_shard_groups: int) -> None:
        self.cfg, self.storage, self.counters = cfg, storage, counters
        self.group, self.device = group, storage.device
        # Every shard group holds the same shards (NOTE [Shard groups of consecutive ranks]): a sum
        # over all ranks counts each element once per group.
        self.num_shard_groups = num_shard_groups
        self.optimizer: torch.optim.Optimizer
        if storage.offload_store is not None:
            self.optimizer = OffloadedOptimizer(storage.optimizer_params, storage.offload_store, cfg.optimizer.type, cfg.optimizer.params,
                                                param_store=storage.param_store, grad_store=storage.grad_store)
        else:
            self.optimizer = build_optimizer(cfg.optimizer, list(storage.optimizer_params.values()), fused=cfg.fused_optimizer)
        self.base_lrs = [g["lr"] for g in self.optimizer.param_groups]
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self.loss_scaler = LossScaler.from_options(cfg.loss_scaling) if cfg.loss_scaling is not None else None

    # ----------------------------------------------------------------- accumulation
    def is_boundary(self) -> bool:
        """Whether the coming ``step()`` call ends a gradient accumulation."""
        return (self.counters.micro_steps + 1) % self.gradient_accumulation_steps == 0

    def advance_micro_step(self) -> bool:
        """Count one ``step()`` call; return whether it ends a gradient accumulation."""
        boundary = self.is_boundary()
        self.counters.micro_steps += 1
        return boundary

    def grad_seed(self) -> float:
        """d(loss)/d(loss) for the backward: 1 over the accumulation steps (DeepSpeed averages
        micro-batches), times the fp16 loss scale."""
        return (self.loss_scaler.scale if self.loss_scaler else 1.0) / self.gradient_accumulation_steps

    # ----------------------------------------------------------------- the update
    def run(self) -> StepOutcome:
        """At an accumulation boundary, with the gradients reduced: unscale them, skip the step on
        every rank if any overflowed (fp16), else clip, set the scheduled learning rate and
        update this rank's shards. Collectives: the overflow check and the gradient norm."""
        # Gradients of what the optimizer steps, unscaled (in mixed precision fp32 copies).
        grads = self.storage.optimizer_grads(1.0 / self.loss_scaler.scale if self.loss_scaler else 1.0)
        if self.loss_scaler is not None and not self._finite(grads):
            self.loss_scaler.update(overflow=True)
            self.counters.skipped_steps += 1
            return StepOutcome(updated=False, grad_norm=None)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=False)
        grad_norm: float | torch.Tensor | None = None
        if self.cfg.gradient_clipping > 0:
            grad_norm = self._clip(grads, self.cfg.gradient_clipping)
        elif self.cfg.monitors.enabled:
            # On every rank: a collective (NOTE [Monitors: rank 0 writes, every rank joins the norm]).
            grad_norm = self._grad_norm(grads)
        schedule = self.cfg.scheduler
        if schedule is not None:
            for group, base in zip(self.optimizer.param_groups, self.base_lrs):
                group["lr"] = lr_at(schedule, self.counters.global_steps, base)
        if isinstance(self.optimizer, OffloadedOptimizer):
            applied = self.optimizer.finish()  # delayed update: the previous step's, now
            self.optimizer.step(grads=grads)
            return StepOutcome(updated=applied or not self.optimizer.delayed, grad_norm=grad_norm)
        self.optimizer.step()
        return StepOutcome(updated=True, grad_norm=grad_norm)

    def _finite(self, grads: Mapping[str, torch.Tensor]) -> bool:
        bad = torch.zeros(1, device=self.device)
        for f, g in grads.items():
            if not torch.isfinite(self.storage.owned(f, g)).all():
                bad.fill_(1)
                break
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)  # every rank skips together
        return bad.item() == 0

    def _grad_norm(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The global L2 norm of the gradients over all ranks' shards, in fp64 (shape (1,)): each
        element read once, then one 8-byte all-reduce (a collective)."""
        squares = torch.zeros(1, dtype=torch.float64, device=self.device)
        for f, g in grads.items():
            squares += self.storage.owned(f, g).double().pow(2).sum()
        dist.all_reduce(squares, group=self.group)
        return (squares / self.num_shard_groups).sqrt()

    def _clip(self, grads: Mapping[str, torch.Tensor], max_norm: float) -> float:
        """Scale gradients so their global L2 norm (over all ranks' shards) is at most ``max_norm``;
        return the norm before clipping."""
        norm = self._grad_norm(grads).item()
        coef = max_norm / (norm + 1e-6)
        if coef < 1:
            if isinstance(grads, OffloadedGrads):
                grads.scale_(coef)  # applied as each is read from its tier (NOTE [Offloaded gradients])
            else:
                for g in grads.values():
                    g.mul_(coef)
        return norm

    # ----------------------------------------------------------------- reporting
    def memory(self) -> dict[str, int]:
        """Bytes of the optimizer states (the fp32 masters count with them, as in ZeRO): on the
        device, and with offload on each other tier, in the offload windows and staging."""
        out: dict[str, int] = {}
        storage = self.storage
        if isinstance(self.optimizer, OffloadedOptimizer):
            store = storage.offload_store
            assert store is not None
            steps = [r.step for r in store.records.values()] if OPTIMIZERS[self.cfg.optimizer.type].step else []
            out["optimizer_states"] = store.resident_bytes(Tier.DEVICE) + sum(t.untyped_storage().nbytes() for t in steps)
            out["offload_cpu_bytes"] = store.resident_bytes(Tier.CPU)
            out["offload_nvme_bytes"] = store.nvme_bytes()
            out["offload_window_bytes"] = store.window_bytes()
            out["offload_staging_bytes"] = self.optimizer.staging_bytes()
            if storage.param_store is not None:
                ps = storage.param_store
                out["offload_param_cpu_bytes"] = ps.cpu_bytes()
                out["offload_param_nvme_bytes"] = ps.nvme_bytes()
                out["offload_param_window_bytes"] = ps.window_bytes()
            gs = storage.grad_store
            if gs is not None:  # NOTE [Offloaded gradients]: ``grads`` (on the device) is 0
                out["offload_grad_cpu_bytes"] = gs.cpu_bytes()
                out["offload_grad_nvme_bytes"] = gs.nvme_bytes()
                out["offload_grad_window_bytes"] = gs.window_bytes()
            return out
        states = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        states += list(storage.master.values())  # the fp32 master copy counts with the optimizer states, as in ZeRO
        out["optimizer_states"] = storage_bytes(states)
        return out
