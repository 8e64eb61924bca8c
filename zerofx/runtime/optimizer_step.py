"""The arithmetic of a training step over this rank's shards: gradient accumulation, the fp16
loss scale, the overflow check, clipping, the learning-rate schedule and the optimizer update.

The engine sequences a step (graphs, collectives of its programs, monitors, ``param_sync``) and
asks ``OptimizerStep`` for the numbers: the backward's seed, whether a ``step()`` call is an
accumulation boundary, and at the boundary the update itself, which returns whether the shards
changed. The check for non-finite values and the gradient norm are one collective over the
engine's group, so every rank takes the same branch.

NOTE [Non-finite values]
A NaN or infinite loss or gradient is caught at the optimizer step where it first appears,
before it reaches the parameters: at each accumulation boundary every rank reduces what it
holds, the losses of the step's micro-batches and the gradient elements it accounts for (its
shard at stages 1-3, its 1/N of the whole gradient at stage 0; NOTE [What the engine holds]),
to one number: the sum of the magnitudes of each tensor's min and max (``aminmax``, one read of
each element and no copy; NaN and infinities propagate, and fp64 cannot overflow on fp32
values), or the sum of squares when the step computes the gradient norm anyway (clipping,
monitors). The ranks exchange whether theirs is finite in the all-reduce that already
carries the norm: one all-reduce of
1 + N float64 values (the sum of squares, then one flag per rank), so a step with clipping or
a monitor issues no collective more than before. Only when a flag is set do the ranks look
closer: each flagged rank names the first non-finite loss (by micro-batch) or else the first
parameter (by FQN, in the optimizer's order) holding a non-finite element of its part, with
the count, and the ranks exchange these lines (``all_gather_object``), so every rank reports
the same. Gradients are read after their reduction across ranks: a NaN born on one rank is in
every rank's reduced gradient, so the loss, checked first, is what points at the rank it came
from; a rank's own gradient is named by the shard that holds it. Then, by
``zerofx.nonfinite``:
- ``"error"`` (default): every rank raises ``NonFiniteError`` with the lines; the step's
  gradients are dropped and the parameters, optimizer state and step counters are unchanged;
- ``"skip"``: the step is skipped on every rank, as fp16 loss scaling skips an overflow
  (``skipped_steps`` counts it, rank 0 prints the lines), and training goes on;
- ``"off"``: no check and no collective for it.
With fp16 loss scaling the check is the overflow check, whatever the setting: a non-finite
step is skipped and the scale lowered (``LossScaler``, DeepSpeed's rules). Gradients offloaded
to host memory or NVMe (``zerofx.offload_gradients``) are read for the check only when the step
reads them anyway (clipping, monitors, fp16); otherwise the losses alone are checked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerofx.common.errors import NonFiniteError
from zerofx.config import OptimizerSpec, ZeroConfig, torch_optimizer_class
from zerofx.config.options import NonFinite
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
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self._losses: list[torch.Tensor] = []  # this accumulation's micro-batch losses (NOTE [Non-finite values])

    def record_loss(self, loss: torch.Tensor) -> None:
        """Keep a micro-batch's loss for the step's check (NOTE [Non-finite values])."""
        if self.loss_scaler is not None or self.cfg.nonfinite is not NonFinite.OFF:
            self._losses.append(loss.detach())

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
        """At an accumulation boundary, with the gradients reduced: unscale them, check the losses
        and gradients for NaN and infinity (NOTE [Non-finite values]: fp16 skips such a step and
        lowers the scale; else by ``zerofx.nonfinite``), clip, set the scheduled learning rate and
        update this rank's shards. Collectives: one all-reduce for the check and the gradient norm."""
        # Gradients of what the optimizer steps, unscaled (in mixed precision fp32 copies).
        grads = self.storage.optimizer_grads(1.0 / self.loss_scaler.scale if self.loss_scaler else 1.0)
        losses, self._losses = self._losses, []
        needs_norm = self.cfg.gradient_clipping > 0 or self.cfg.monitors.enabled
        squares, bad_ranks = self._reduce(grads, losses, norm=needs_norm)
        if self.loss_scaler is not None:
            self.loss_scaler.update(overflow=bool(bad_ranks))
        if bad_ranks:
            if self.loss_scaler is None:
                self._report(grads, losses, bad_ranks)
            self.counters.skipped_steps += 1
            return StepOutcome(updated=False, grad_norm=None)
        grad_norm: float | torch.Tensor | None = None
        if squares is not None:
            # On every rank: a collective (NOTE [Monitors: rank 0 writes, every rank joins the norm]).
            grad_norm = (squares / self.num_shard_groups).sqrt()
            if self.cfg.gradient_clipping > 0:
                grad_norm = self._clip(grads, grad_norm.item(), self.cfg.gradient_clipping)
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

    def _reduce(self, grads: Mapping[str, torch.Tensor], losses: Sequence[torch.Tensor], *,
                norm: bool) -> tuple[torch.Tensor | None, list[int]]:
        """One all-reduce of 1 + N float64 values (NOTE [Non-finite values]): the global sum of
        squares of the gradients over all ranks' shards (shape (1,); None unless ``norm``), each
        element read once, and the ranks whose losses or gradient elements are not all finite.
        No collective when neither the norm nor the check is asked for."""
        check = self.loss_scaler is not None or self.cfg.nonfinite is not NonFinite.OFF
        if not (norm or check):
            return None, []
        stats = torch.zeros(1 + self.world_size, dtype=torch.float64, device=self.device)
        local = torch.zeros((), dtype=torch.float64, device=self.device)
        if norm:
            for f, g in grads.items():
                local += self.storage.owned(f, g).double().pow(2).sum()
            stats[0] = local
        elif check and (self.loss_scaler is not None or not isinstance(grads, OffloadedGrads)):
            # Offloaded, one at a time as each comes from its tier; fp32/bf16 offloaded: the losses alone.
            for f, g in grads.items():
                if (t := self.storage.owned(f, g)).numel():
                    local = local + torch.stack(torch.aminmax(t)).double().abs().sum()  # NaN and infinities propagate
        if check:
            if losses:
                local = local + torch.stack([loss.double() for loss in losses]).abs().sum()
            stats[1 + self.rank] = (~torch.isfinite(local)).double()
        dist.all_reduce(stats, group=self.group)
        bad_ranks = stats[1:].nonzero().flatten().tolist() if check else []
        return (stats[:1] if norm else None), bad_ranks

    def _report(self, grads: Mapping[str, torch.Tensor], losses: Sequence[torch.Tensor], bad_ranks: list[int]) -> None:
        """Every rank's line for the non-finite step (a collective), then ``zerofx.nonfinite``'s
        action: raise ``NonFiniteError`` on every rank, or (``"skip"``) print on rank 0."""
        line = _first_nonfinite(grads, losses, self.storage) if self.rank in bad_ranks else None
        lines: list[str | None] = [None] * self.world_size
        dist.all_gather_object(lines, line, group=self.group)
        step = self.counters.global_steps + 1
        where = "; ".join(f"rank {r}: {lines[r]}" for r in bad_ranks)
        if self.cfg.nonfinite is NonFinite.SKIP:
            if self.rank == 0:
                print(f"[zerofx] optimizer step {step} skipped: non-finite values ({where}); zerofx.nonfinite is \"skip\"", flush=True)
            return
        self.storage.end_step(updated=False)  # drop the step's gradients: the engine stays usable
        raise NonFiniteError(
            f"optimizer step {step}: non-finite values, {where}. The parameters are unchanged and the step's gradients "
            "dropped. Gradients are checked after their reduction across ranks, so a NaN from one rank's backward shows on "
            "every rank; the loss points at its origin. To skip such steps instead, set zerofx.nonfinite to \"skip\" (as "
            "fp16 loss scaling skips an overflow); \"off\" stops checking (NOTE [Non-finite values])")

    def _clip(self, grads: Mapping[str, torch.Tensor], norm: float, max_norm: float) -> float:
        """Scale gradients so their global L2 norm ``norm`` (over all ranks' shards) is at most
        ``max_norm``; return the norm before clipping."""
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


def _first_nonfinite(grads: Mapping[str, torch.Tensor], losses: Sequence[torch.Tensor], storage: EngineStorage) -> str:
    """What this rank holds that is not finite: the first such micro-batch loss, else the first
    parameter (in the optimizer's order) whose part here holds a NaN or infinity, with the count."""
    for i, loss in enumerate(losses):
        if not torch.isfinite(loss).all():
            return f"the loss of micro-batch {i} is {loss.item()}"
    for f, g in grads.items():
        part = storage.owned(f, g)
        bad = ~torch.isfinite(part)
        if bad.any():
            kinds = "/".join(k for k, m in (("nan", part.isnan()), ("inf", part.isinf())) if m.any())
            return f"the gradient of {f!r} holds {int(bad.sum())} {kinds} of its {part.numel()} element(s) here"
    return "a non-finite value"
