"""One rank's parameter and gradient storage: the flat shard buffer, the full flats, the gradient
buffers and the fp32 masters, their allocation, initial values and views; and the offload stores
that hold what is not in them. The ``Engine`` holds one ``EngineStorage`` and runs the graphs and
collectives over it, and its ``OptimizerStep`` (``zerofx.runtime.optimizer_step``) updates it;
nothing here runs a graph or steps the optimizer.

NOTE [What the engine holds]
Parameters are laid out per ``ParamPlacement``: each flattened and padded to a multiple of the
world size. Stages 0-2 keep every full padded flat; stage 3 keeps only this rank's shards, in
one flat buffer, except parameters below ``stage3_param_persistence_threshold``, kept whole.
Gradient buffers accumulate across ``backward`` calls until ``step``: full padded flats at
stages 0-1, shards at stages 2-3 (at stages 0, 2 and 3 the first backward's reduced outputs
become them, NOTE [Reduced gradients become the buffers]). The optimizer is a plain
``torch.optim`` optimizer whose parameters are views of this rank's shards (the whole flat at
stage 0), so it updates the stored parameters in place. Where parameters are kept whole
(stages 1-2, persistent ones at stage 3) the ``param_sync`` graph then all-gathers the
updated shards. At stage 3 the engine takes the parameters' memory: each
model parameter's ``.data`` becomes an empty tensor; ``full_state_dict()`` gathers them.

NOTE [Meta-device models]
A model built on the meta device never had full parameters. The engine computes each
parameter's initial value on every rank, one module at a time (``zerofx.compiler.materialize``), keeps
what its stage holds (at stage 3, its shard) and drops the rest, so at most one module's full
tensors are alive beyond the stage's own storage. No broadcast is needed: every rank computes
the same values, at any world size. The model's own tensors stay on the meta device, and the
engine's storage lives on the CPU (gloo) or the current CUDA device (NCCL).

With ``zerofx.offload_gradients`` (stages 2-3) there are no gradient buffers either: a
``GradStore`` keeps the reduced gradient shards in host memory or on NVMe (NOTE [Offloaded
gradients] in ``zerofx.runtime.offload.grads``), and ``optimizer_grads`` reads them from there.

With ``offload_optimizer`` the fp32 masters and optimizer states are not laid out here: each
parameter's record goes to the tier ``plan_offload`` chose (device, host memory or NVMe), and the
optimizer is an ``OffloadedOptimizer`` over the shards themselves (see ``zerofx.runtime.offload``).

NOTE [offload_param]
At stage 3 with ``offload_param`` the sharded parameters ``plan_param_offload`` puts in host
memory or on NVMe are not in the engine's flat buffer either: a ``ParamStore`` holds them (NOTE
[The parameter store] in ``zerofx.runtime.offload``). The graphs take the store's 8-byte token in place
of each such shard and fetch the shard right before its bucket's all-gather
(``passes.memory.fetch_params``), so the rank never holds them all. ``shards`` has no entry for
them; ``optimizer_params`` holds a shape-only handle (no storage) per offloaded shard, and the
optimizer, always an ``OffloadedOptimizer`` then (its records on the device when
``offload_optimizer`` is off), takes each shard from the store to update it and writes it
back. ``param_shard``, ``full_state_dict`` and checkpoints read offloaded shards one at a time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from zerofx.passes import OffloadPlan, ParamPlacement, ZeroStage, _compat
from zerofx.passes.plan.offload import ParamOffloadPlan
from zerofx.passes.zero.plan_sharding import persistent_params
from zerofx.config import OptimizerSpec, ZeroConfig
from zerofx.common.errors import ZeroFXError
from zerofx.compiler.materialize import InitFn, iter_initial_state
from zerofx.runtime.offload import OffloadOptions, OffloadStore, ParamStore, plan_engine_offload, plan_engine_param_offload
from zerofx.runtime.offload.grads import GradStore


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each storage counted once (views share one)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class EngineStorage:
    """What one rank holds of the model's parameters, buffers and gradients, and the fp32 masters
    (NOTE [What the engine holds]). Building it initializes every parameter: from the model's own
    values, rank 0's broadcast to all, or for a meta-device model computed on every rank (NOTE
    [Meta-device models]); the broadcast is a collective."""

    def __init__(
        self,
        model: nn.Module,
        cfg: ZeroConfig,
        placements: Mapping[str, ParamPlacement],
        *,
        group: dist.ProcessGroup,
        device: torch.device,
        from_meta: bool,
        init_fn: InitFn | None = None,
        init_seed: int = 0,
        shard_index: int | None = None,
    ) -> None:
        self.placements = placements
        self.group = group
        self.rank = dist.get_rank(group)
        # Which shard of each parameter this rank owns: its rank, or with shard groups its place
        # in its group (NOTE [Shard groups of consecutive ranks] in zerofx/runtime/rank_groups.py).
        self.shard_index = self.rank if shard_index is None else shard_index
        self.stage = ZeroStage(cfg.stage)
        self.device = device
        self.compute_dtype = cfg.compute_dtype
        self._optimizer_spec: OptimizerSpec = cfg.optimizer
        self.buffers = {
            name: b.to(self.compute_dtype) if self.compute_dtype is not None and b.is_floating_point() else b
            for name, b in model.named_buffers()
        }
        self.offload_options = cfg.offload
        self.param_offload_options = cfg.param_offload
        if self.param_offload_options is not None:
            if self.stage is not ZeroStage.THREE:
                raise ZeroFXError(
                    f"zero_optimization.offload_param applies at ZeRO stage 3 (parameters are sharded only there), got stage "
                    f"{int(self.stage)}; set stage 3 or offload_param.device none"
                )
            if self.offload_options is None:  # NOTE [offload_param]: one optimizer streams the shards
                self.offload_options = OffloadOptions.on_device()
        self.grad_offload_options = cfg.grad_offload
        if self.grad_offload_options is not None:
            if self.stage < ZeroStage.TWO:
                raise ZeroFXError(
                    f"zerofx.offload_gradients applies at ZeRO stages 2-3 (gradients are sharded only there), got "
                    f"zero_optimization.stage {int(self.stage)}; set stage 2 or 3, or offload_gradients.device none"
                )
            if self.offload_options is None:  # NOTE [Offloaded gradients]: the offloaded optimizer reads them
                self.offload_options = OffloadOptions.on_device()
        self.offload_store: OffloadStore | None = None
        self.offload_plan: OffloadPlan | None = None
        self.param_store: ParamStore | None = None
        self.param_offload_plan: ParamOffloadPlan | None = None
        self.grad_store: GradStore | None = None
        self._init_storage(model, cfg.schedule.persistence_threshold, from_meta=from_meta, init_fn=init_fn, init_seed=init_seed)
        trainable = [f for f, p in self.placements.items() if p.requires_grad]
        # The tensors the optimizer steps: fp32 master copies of this rank's shards in mixed
        # precision, else the shards themselves (their gradients are the persistent buffers).
        # Offloaded, the masters live in the store and the optimizer steps the shards.
        self.optimizer_params = {f: self.master[f] if self.master else self._shard_or_handle(f) for f in trainable}
        if self.grad_offload_options is not None:
            assert self.offload_plan is not None and self.offload_options is not None
            self.grad_store = GradStore(
                self.grad_offload_options, {f: self.placements[f].shard_numel for f in trainable},
                {f: self.placements[f].torch_dtype for f in trainable}, order=list(self.offload_plan.update_order),
                generations=2 if self.offload_options.delayed_update else 1, device=self.device, rank=self.rank,
            )

    def _init_storage(self, model: nn.Module, persistence_threshold: int, *, from_meta: bool, init_fn: InitFn | None,
                      init_seed: int) -> None:
        self.persistent = persistent_params(list(self.placements.values()), self.stage, persistence_threshold)
        sharded = [f for f, p in self.placements.items() if p.is_sharded(self.stage, self.persistent)]
        self.full: dict[str, torch.Tensor] = {}
        self.shards: dict[str, torch.Tensor] = {}
        self._shard_flat: torch.Tensor | None = None
        self._offsets: dict[str, int] = {}
        self.master: dict[str, torch.Tensor] = {}
        self._master_offsets: dict[str, int] = {}
        if self.param_offload_options is not None and sharded:
            self.param_store = self._build_param_store(sharded)
            sharded = [f for f in sharded if f not in self.param_store]
        if self.offload_options is not None:
            self.offload_store = self._build_offload_store()
        elif self.compute_dtype is not None:
            total = 0
            for f, p in self.placements.items():
                if p.requires_grad:
                    self._master_offsets[f] = total
                    total += p.padded_numel if self.stage is ZeroStage.ZERO else p.shard_numel
            self._master_flat = torch.empty(total, dtype=torch.float32, device=self.device)
        if sharded:
            total = 0
            for f in sharded:
                self._offsets[f] = total
                total += self.placements[f].shard_numel
            self._shard_flat = torch.empty(total, dtype=self._flat_dtype(), device=self.device)
        if from_meta:
            # Every rank computes the same values (NOTE [The init scheme] in zerofx.compiler.materialize):
            # no broadcast, and one module's tensors alive at a time.
            stored: set[str] = set()
            for item in iter_initial_state(model, seed=init_seed, init_fn=init_fn):
                if item.is_param:
                    self._store_param(item.fqn, item.value, broadcast=False)
                    stored.add(item.fqn)
                else:
                    b = item.value.to(self.device)
                    self.buffers[item.fqn] = b.to(self.compute_dtype) if self.compute_dtype is not None and b.is_floating_point() else b
            assert stored == set(self.placements), f"parameters left uninitialized: {sorted(set(self.placements) - stored)}"
        else:
            params = dict(model.named_parameters())
            for fqn in self.placements:
                # Data parallel starts from one set of weights: rank 0's, as DDP does.
                self._store_param(fqn, params[fqn].detach(), broadcast=True)
            for b in self.buffers.values():
                dist.broadcast(b.data, src=0, group=self.group)
        if self.stage is ZeroStage.THREE and not from_meta:
            # The engine owns the parameters now: free the model's full copies.
            for prm in model.parameters():
                prm.data = torch.empty(0, dtype=prm.dtype, device=prm.device)

        # NOTE [Gradient buffers come with the first backward]
        # The persistent gradient buffers (a full flat per parameter at stages 0-1, this rank's
        # shard at 2-3) are allocated by the first backward, as FSDP2 allocates its sharded
        # gradients, not here: between initialize and the first step a rank holds only its
        # parameters (and the optimizer's masters), which is when a peer that builds the full
        # model on every rank has its peak. ``grads`` stays empty until then.
        self.grads: dict[str, torch.Tensor] = {}
        # Whether ``grads`` holds an ended accumulation's values that the next backward replaces
        # (NOTE [Reduced gradients become the buffers]); true until the first backward too.
        self._grads_stale = True

    def _store_param(self, fqn: str, source: torch.Tensor, *, broadcast: bool) -> None:
        """Keep what this rank holds of parameter ``fqn`` given its full value ``source``: the
        padded full flat where the stage keeps it whole, else only this rank's shard (and, in
        mixed precision, the fp32 master of what this rank owns). At most this one full
        parameter is alive beyond what the stage keeps."""
        p, r = self.placements[fqn], self.shard_index
        flat = torch.zeros(p.padded_numel, dtype=source.dtype, device=self.device)
        flat[: p.numel].copy_(source.reshape(-1))
        if broadcast:
            dist.broadcast(flat, src=0, group=self.group)
        if fqn in self._master_offsets:  # the fp32 master of what this rank owns, before rounding to 16 bits
            start = self._master_offsets[fqn]
            owned = flat if self.stage is ZeroStage.ZERO else flat[r * p.shard_numel : (r + 1) * p.shard_numel]
            self.master[fqn] = self._master_flat[start : start + owned.numel()]
            self.master[fqn].copy_(owned)
        elif self.offload_store is not None and p.requires_grad:  # one record at a time
            owned = flat if self.stage is ZeroStage.ZERO else flat[r * p.shard_numel : (r + 1) * p.shard_numel]
            self.offload_store.init_record(fqn, owned if self.compute_dtype is not None else None)
        flat = flat.to(p.torch_dtype)
        own = flat[r * p.shard_numel : (r + 1) * p.shard_numel]
        if self.param_store is not None and fqn in self.param_store:
            self.param_store.init_shard(fqn, own)
        elif fqn in self._offsets:
            self.shards[fqn] = self._shard_flat[self._offsets[fqn] : self._offsets[fqn] + p.shard_numel]
            self.shards[fqn].copy_(own)
        else:
            self.full[fqn] = flat
            self.shards[fqn] = flat if self.stage is ZeroStage.ZERO else own

    def _owned_numel(self, fqn: str) -> int:
        p = self.placements[fqn]
        return p.padded_numel if self.stage is ZeroStage.ZERO else p.shard_numel

    def _build_offload_store(self) -> OffloadStore:
        """Plan the tiers of the optimizer-state records and create them (empty; ``init_record``
        fills each). The plan is a function of the config and the shapes: the same on every rank."""
        assert self.offload_options is not None
        owned = {f: self._owned_numel(f) for f, p in self.placements.items() if p.requires_grad}
        kind = self._optimizer_spec.kind
        mixed = self.compute_dtype is not None
        self.offload_plan = plan_engine_offload(owned, self.offload_options, optimizer=kind, mixed_precision=mixed,
                                                device_is_cpu=self.device.type == "cpu")
        return OffloadStore(self.offload_plan, self.offload_options, owned, optimizer=kind, mixed_precision=mixed,
                            device=self.device, rank=self.rank)

    def _build_param_store(self, sharded: list[str]) -> ParamStore:
        """Plan the tiers of the sharded parameters (``offload_param``) and create their store;
        ``_store_param`` fills it. Like the optimizer plan, a function of the config and shapes."""
        assert self.param_offload_options is not None
        # The gather buckets are planned after capture; placement does not depend on them, only
        # the I/O estimate does, and the engine has no compute times to weigh it with anyway.
        buckets = [(f,) for f in sharded]
        shards = [(f, self.placements[f].shard_numel, self.placements[f].itemsize, self.placements[f].requires_grad) for f in sharded]
        self.param_offload_plan = plan_engine_param_offload(shards, buckets, self.param_offload_options,
                                                            device_is_cpu=self.device.type == "cpu")
        return ParamStore(self.param_offload_plan, self.param_offload_options, {f: n for f, n, _, _ in shards},
                          self._flat_dtype(), device=self.device, rank=self.rank)

    def _shard_or_handle(self, fqn: str) -> torch.Tensor:
        """The shard, or for an offloaded one a handle of its shape with no storage (NOTE [offload_param])."""
        if self.param_store is not None and fqn in self.param_store:
            p = self.placements[fqn]
            return torch.empty((), dtype=p.torch_dtype, device=self.device).expand(p.shard_numel)
        return self.shards[fqn]

    def param_shard(self, fqn: str) -> torch.Tensor:
        """This rank's shard of ``fqn`` (a copy read from the store when offloaded)."""
        if self.param_store is not None and fqn in self.param_store:
            return self.param_store.read_shard(fqn).to(self.device)
        return self.shards[fqn]

    def _flat_dtype(self) -> torch.dtype:
        dtypes = {p.torch_dtype for p in self.placements.values()}
        if len(dtypes) != 1:
            raise ZeroFXError(f"stage 3 needs parameters of one dtype, got {sorted(map(str, dtypes))}; cast the model first, e.g. model.float()")
        return dtypes.pop()

    def param_input(self, fqn: str) -> torch.Tensor:
        """What the forward graph takes for a parameter: its shard if sharded, else its full value."""
        p = self.placements[fqn]
        if self.param_store is not None and fqn in self.param_store:
            return self.param_store.token  # the graph fetches the shard itself (passes.memory.fetch_params)
        if fqn not in self.full:
            return self.shards[fqn]
        return self.full[fqn][: p.numel].view(p.shape)

    # ----------------------------------------------------------------- gradients
    def _allocate_grads(self) -> None:
        """The gradient buffers, zeroed (NOTE [Gradient buffers come with the first backward]).
        In fp32 they are the ``.grad`` of what the optimizer steps."""
        if self.grads or self.grad_store is not None:
            return  # offloaded gradients have no device buffer (NOTE [Offloaded gradients])
        for fqn, p in self.placements.items():
            if p.requires_grad:
                self.grads[fqn] = torch.zeros(self._grad_numel(fqn), dtype=p.torch_dtype, device=self.device)
        self._link_optimizer_grads()

    def _grad_numel(self, fqn: str) -> int:
        p = self.placements[fqn]
        return p.padded_numel if self.stage <= ZeroStage.ONE else p.shard_numel

    def _link_optimizer_grads(self) -> None:
        """In fp32 the gradient buffers are the ``.grad`` of what the optimizer steps."""
        if self.compute_dtype is None:
            for f, t in self.optimizer_params.items():
                t.grad = self._grad_shard(f)

    def accumulate_grads(self, fqns: Sequence[str], grads: Sequence[torch.Tensor | None]) -> None:
        """Add a backward graph's gradient outputs, one per parameter in ``fqns`` (None: no
        gradient), into the persistent buffers, allocating them on the first call. The first
        backward of an accumulation keeps the reduced outputs themselves as the buffers (NOTE
        [Reduced gradients become the buffers])."""
        if self.grad_store is not None:
            for fqn, g in zip(fqns, grads):
                if g is not None:
                    self.grad_store.add(fqn, g)  # NOTE [Offloaded gradients]
            return
        if self._grads_stale and self.stage is not ZeroStage.ONE:
            self._take_grads(fqns, grads)
        else:
            self._allocate_grads()
            for fqn, g in zip(fqns, grads):
                if g is not None:
                    self.grads[fqn].add_(g)
        self._grads_stale = False

    # NOTE [Reduced gradients become the buffers]
    # At stages 0, 2 and 3 every gradient the backward graph returns is this rank's part of a
    # collective's result: a slice of the all-reduced or reduce-scattered bucket after its
    # division by the world size, a tensor the graph allocated in this call and nobody else
    # holds. Adding it into buffers zeroed at the last step's end would read the zeros, the
    # output and write the sum: two passes over the rank's gradients (zero_ and add_, about 1%
    # of the 25m step) for values the output already holds. So the first backward of an
    # accumulation keeps the outputs as the buffers (and, in fp32, as the optimizer's ``.grad``),
    # the step's end only marks them stale, and later backwards of the same accumulation add
    # into them as before. FSDP2 does the same with a reduce-scatter's output when a
    # parameter's ``.grad`` is None. An output is taken only where it is exactly what a buffer
    # is (dtype, size, device, dense) and shares no memory with another taken output (a graph
    # may return one tensor for two parameters whose gradients CSE merged); otherwise a copy is
    # kept. A parameter without a gradient gets zeros. Memory is as before: the last step's
    # buffers are dropped when the new outputs replace them, after the graph has returned, where
    # the persistent buffers and the outputs were alive together before. Stage 1 keeps its
    # zeroed buffers: its outputs are local flats, which may be views of the graph's inputs,
    # and ``grad_sync`` writes the reduced shard into them in place.
    def _take_grads(self, fqns: Sequence[str], grads: Sequence[torch.Tensor | None]) -> None:
        held = {t.untyped_storage().data_ptr() for t in self._held_tensors()}
        taken: dict[str, torch.Tensor] = {}
        spans: list[tuple[int, int, str]] = []  # (first byte, end byte, fqn) of each output kept as it is
        for fqn, g in zip(fqns, grads):
            p = self.placements[fqn]
            if g is None or not p.requires_grad:
                continue
            if (g.dtype == p.torch_dtype and g.device == self.device and g.shape == (self._grad_numel(fqn),) and g.stride() == (1,)
                    and g.untyped_storage().data_ptr() not in held):
                start = g.untyped_storage().data_ptr() + g.storage_offset() * g.element_size()
                spans.append((start, start + g.numel() * g.element_size(), fqn))
                taken[fqn] = g
            else:
                taken[fqn] = g.reshape(-1).to(dtype=p.torch_dtype, device=self.device, memory_format=torch.contiguous_format, copy=True)
        reach = 0
        for start, end, fqn in sorted(spans):
            if start < reach:
                taken[fqn] = taken[fqn].clone()  # shares memory with another output
            reach = max(reach, end)
        for fqn, p in self.placements.items():
            if p.requires_grad and fqn not in taken:
                taken[fqn] = torch.zeros(self._grad_numel(fqn), dtype=p.torch_dtype, device=self.device)
        self.grads = taken
        self._link_optimizer_grads()

    def _held_tensors(self) -> list[torch.Tensor]:
        """The tensors this storage keeps between steps other than gradients: parameters, buffers, masters."""
        out = list(self.full.values()) + list(self.buffers.values()) + list(self.master.values())
        return out + [self._shard_flat] if self._shard_flat is not None else out

    def _grad_shard(self, fqn: str) -> torch.Tensor:
        """This rank's shard of ``fqn``'s gradient buffer: a view into the full buffer at stage 1
        (where ``grad_sync`` writes the reduced mean), the buffer itself at stages 2-3."""
        g, i, p = self.grads[fqn], self.shard_index, self.placements[fqn]
        if self.stage is ZeroStage.ONE:
            return g[i * p.shard_numel : (i + 1) * p.shard_numel]
        return g

    grad_shard = _grad_shard  # the engine hands these views to grad_sync

    def optimizer_grads(self, inv_scale: float) -> Mapping[str, torch.Tensor]:
        """Gradients of what the optimizer steps. In mixed precision, fp32 copies of this rank's
        16-bit gradient shards times ``inv_scale`` (1 over the loss scale); they live only
        through the step. Offloaded, a view that reads each from its tier when asked."""
        if self.grad_store is not None:
            return self.grad_store.view(to_fp32=self.compute_dtype is not None, inv_scale=inv_scale)
        if self.compute_dtype is None:
            return {f: t.grad for f, t in self.optimizer_params.items()}
        out = {}
        for f, t in self.optimizer_params.items():
            out[f] = self._grad_shard(f).to(torch.float32).mul_(inv_scale)
            if self.master:  # a torch optimizer over the masters reads .grad
                t.grad = out[f]
        return out

    def owned(self, fqn: str, grad: torch.Tensor) -> torch.Tensor:
        """The elements of ``grad`` this rank alone accounts for (stage 0 holds them all)."""
        if self.stage is ZeroStage.ZERO:
            p = self.placements[fqn]
            return grad[self.rank * p.shard_numel : (self.rank + 1) * p.shard_numel]
        return grad

    def end_step(self, *, updated: bool) -> None:
        """End the accumulation: the gradient buffers start again from zero (stage 1 zeroes them,
        the other stages' next backward replaces them); in mixed precision drop the
        masters' gradients and, when the optimizer ``updated`` them, round the new fp32 masters
        into the 16-bit shards the graphs read."""
        if self.stage is ZeroStage.ONE:
            for g in self.grads.values():
                g.zero_()
        else:
            self._grads_stale = True  # the next backward's outputs replace them (NOTE [Reduced gradients become the buffers])
        if self.grad_store is not None:
            self.grad_store.end_step()
        if self.master:
            for f, t in self.optimizer_params.items():
                t.grad = None
                if updated:
                    self.shards[f].copy_(t)

    def state_dict(self, state_keys: Sequence[tuple[str, str | None]], shard_group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
        """The model's state dict, keyed as ``state_keys`` lists it (each key with the parameter FQN
        it aliases, or None for a buffer), on every rank. Sharded parameters are all-gathered
        over ``shard_group``: a collective when any is sharded."""
        out: dict[str, torch.Tensor] = {}
        gathered: dict[str, torch.Tensor] = {}
        for key, owner in state_keys:
            if owner is None:
                out[key] = self.buffers[key].detach().clone()
                continue
            if owner not in gathered:
                p = self.placements[owner]
                if owner not in self.full:
                    flat = torch.empty(p.padded_numel, dtype=p.torch_dtype, device=self.device)
                    _compat.all_gather_flat(flat, self.param_shard(owner), group=shard_group)
                else:
                    flat = self.full[owner].clone()
                gathered[owner] = flat[: p.numel].view(p.shape)
            out[key] = gathered[owner]
        return out

    def memory(self) -> dict[str, int]:
        """Bytes of the parameter and gradient tensors this rank holds on the device."""
        params = list(self.full.values()) + ([self._shard_flat] if self._shard_flat is not None else [])
        return {"params": storage_bytes(params), "grads": storage_bytes(list(self.grads.values()))}
