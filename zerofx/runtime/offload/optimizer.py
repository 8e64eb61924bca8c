"""The offloaded optimizer: ``OffloadedOptimizer``, a ``torch.optim.Optimizer`` over the engine's
parameter shards whose state lives in an ``OffloadStore`` (``zerofx.runtime.offload.store``). It steps
each record where it lives, with torch's functional AdamW, Adam or SGD, and owns the one-step
delayed update.

The engine builds the ``OffloadStore`` (records and their tiers, per the ``OffloadPlan``) before
it lays out the parameters, writes each parameter's initial fp32 master into it one at a time,
then wraps it in an ``OffloadedOptimizer``, so learning-rate schedules, logging and checkpoints
see the usual API.

NOTE [Tiers on this machine and on an accelerator]
``Tier.DEVICE`` records are tensors on the engine's device; the update runs there. ``Tier.CPU``
records are host tensors (pinned when the device is CUDA and ``pin_memory`` is set): the update
runs on the CPU, with the gradient copied to the host and the new parameter copied back, on a
side stream (NOTE [Host copies on a side stream]). ``Tier.NVME`` records
are files; the update runs on the CPU in one of ``buffer_count`` host buffers. When the device
is the CPU, the copies are skipped: the CPU tier is then host memory that the engine reports
apart from the device's, and only the NVMe tier changes what the process holds.

NOTE [One-step delayed update]
With ``delayed_update`` the update computed from step t's gradients runs on a background
thread while step t+1's forward and backward run, and it is applied to the parameters when step
t+1's optimizer step begins (or when the engine's state is read: ``flush()``). So the gradients
of step t+1 are taken at parameters that lack step t's update: ZeRO-Offload's DPU. It changes
the numerics: training equals a run in which each gradient is applied one step late. The
gradients are copied before the next backward accumulates into the engine's buffers, and the
new parameters go to a staging copy of this rank's shards, which costs one shard of memory.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.adam import adam as adam_update
from torch.optim.adamw import adamw as adamw_update
from torch.optim.sgd import sgd as sgd_update

from zerofx.cost_models.memory import OPTIMIZERS
from zerofx.cost_models.tiers import Tier
from zerofx.config import torch_optimizer_class
from zerofx.common.errors import ConfigError, ZeroFXError
from zerofx.runtime.offload.copies import HostCopies
from zerofx.runtime.offload.grads import GradStore, OffloadedGrads
from zerofx.runtime.offload.store import OffloadStore, Record

if TYPE_CHECKING:
    from zerofx.runtime.offload.params import ParamStore


class _TieredState(Mapping):
    """``optimizer.state`` keyed by parameter, as torch's is; values are read from the tiers."""

    def __init__(self, opt: OffloadedOptimizer) -> None:
        self._opt = opt

    def __getitem__(self, param: torch.Tensor) -> dict[str, Any]:
        fqn = self._opt.fqn_of[id(param)]
        return self._opt.record_state(fqn)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter(self._opt.params_by_fqn.values())

    def __len__(self) -> int:
        return len(self._opt.params_by_fqn)


class OffloadedOptimizer(torch.optim.Optimizer):
    """AdamW, Adam or SGD over the engine's parameter shards, with their state in an
    ``OffloadStore``. Each record's update calls torch's own functional optimizer
    (``torch.optim.adamw.adamw`` and its siblings, public in their modules' ``__all__``) on whole tensors, so it matches the torch class
    bit for bit. ``step(grads=...)`` takes the fp32 gradients by FQN."""

    def __init__(
        self, params: Mapping[str, torch.Tensor], store: OffloadStore, optimizer_type: str, hyper: Mapping[str, Any],
        param_store: ParamStore | None = None, grad_store: GradStore | None = None,
    ) -> None:
        kw = dict(hyper)
        if "betas" in kw:
            kw["betas"] = tuple(kw["betas"])
        cls = torch_optimizer_class(optimizer_type)
        # torch's defaults for every hyperparameter the config leaves out, from the class itself.
        defaults = cls([torch.zeros(1)], **kw).defaults
        super().__init__(list(params.values()), defaults)
        self.state = _TieredState(self)  # type: ignore[assignment]
        self.optimizer_type, self.store = optimizer_type, store
        self.params_by_fqn = dict(params)
        self.fqn_of = {id(t): f for f, t in params.items()}
        self.delayed = store.options.delayed_update
        # NOTE [Stepping offloaded shards]
        # With offload_param, ``params`` holds shape-only handles for the offloaded shards (no
        # storage); each update takes the shard from the parameter store in host memory, right
        # next to its record, and hands it back to be written. One shard and one record are in
        # memory per update (plus the reads ahead). In fp32 the record holds no master: the shard
        # itself is what the optimizer steps, so the weights are stored once, in the shard's file.
        self.param_store = param_store
        self.grad_store = grad_store  # closed with the optimizer (NOTE [Offloaded gradients])
        if param_store is not None and self.delayed:
            raise ConfigError("zerofx.offload.delayed_update is not supported with offload_param (the staging copy would hold every shard)")
        self._staged: dict[str, torch.Tensor] = {}
        self._pending: Future | None = None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="zerofx-offload-step") if self.delayed else None
        on_host = any(r.tier is not Tier.DEVICE for r in store.records.values())
        self._copies = HostCopies(store.device) if store.device.type == "cuda" and on_host else None
        self._compute_stream: Any = None  # the stream the step was called on (CUDA only)
        # (start, end) ``time.perf_counter()`` of the last updates, on whichever thread ran them:
        # what benchmarks/bench_delayed_overlap.py lays against the forward and backward.
        self.update_spans: deque[tuple[float, float]] = deque(maxlen=64)

    # ------------------------------------------------------------- stepping
    @torch.no_grad()
    def step(self, closure: Any = None, *, grads: Mapping[str, torch.Tensor] | None = None) -> None:  # type: ignore[override]
        """Update every record with ``grads`` (fp32, this rank's owned elements). With the
        delayed update the work goes to a background thread; ``finish()`` applies it."""
        if closure is not None or grads is None:
            raise ZeroFXError("OffloadedOptimizer.step takes grads={fqn: gradient}; the engine calls it, closures are not supported")
        # The hyperparameters as they are now: a schedule may change them before a delayed update ends.
        hyper = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        if not self.delayed:
            self._after_copies(self._run(grads, self.params_by_fqn, hyper, self._begin()))
            return
        assert self._pending is None, "finish() the previous delayed update first"
        if isinstance(grads, OffloadedGrads):
            snapshot: Mapping[str, torch.Tensor] = grads  # bound to its generation; the next backward writes the other
        else:
            snapshot = {f: g.detach().clone() for f, g in grads.items()}  # the next backward reuses the buffers
        if not self._staged:
            self._staged = {f: torch.empty_like(t) for f, t in self.params_by_fqn.items()}
        for f, t in self.params_by_fqn.items():
            self._staged[f].copy_(t)
        self._pending = self._worker.submit(self._run, snapshot, self._staged, hyper, self._begin())

    def _begin(self) -> torch.cuda.Event | None:
        """CUDA: an event on the compute stream after the work that produced the gradients (the
        side stream's copies start behind it; NOTE [Host copies on a side stream])."""
        if self._copies is None:
            return None
        self._compute_stream = torch.cuda.current_stream(self.store.device)
        return self._compute_stream.record_event()

    def _after_copies(self, end: torch.cuda.Event | None) -> None:
        """The compute stream waits for the step's last copy to the device (the host does not)."""
        if end is not None:
            self._compute_stream.wait_event(end)

    def finish(self) -> bool:
        """Delayed update: wait for the update in flight and copy its parameters into the shards.
        True when parameters changed (the engine then re-gathers them where it keeps them whole)."""
        if self._pending is None:
            return False
        future, self._pending = self._pending, None
        self._after_copies(future.result())
        for f, t in self.params_by_fqn.items():
            t.copy_(self._staged[f])
        return True

    def staging_bytes(self) -> int:
        """Bytes of the delayed update's staging copy of the shards (0 until the first step),
        plus on CUDA the pinned host copy of the gradients stepped on the host."""
        copies = self._copies.staging_bytes() if self._copies is not None else 0
        return copies + sum(t.untyped_storage().nbytes() for t in self._staged.values())

    def prefetch(self) -> None:
        """Start reading the first NVMe records (the engine calls it as the last backward starts)."""
        if self._pending is None:
            self.store.prefetch()

    def _run(self, grads: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor], hyper: Mapping[str, Any],
             begin: torch.cuda.Event | None) -> torch.cuda.Event | None:
        """Step every record; on CUDA, the event after the last copy to the device (else None)."""
        store = self.store
        shards = self.param_store
        end = None
        start = time.perf_counter()
        try:
            host_side: dict[str, tuple[torch.Tensor, torch.Tensor | None, torch.cuda.Event]] = {}
            if self._copies is not None and not isinstance(grads, OffloadedGrads):  # offloaded ones are on the host already
                wanted = []
                for fqn in store.plan.update_order:
                    rec = store.records[fqn]
                    if rec.tier is Tier.DEVICE:
                        continue
                    offloaded = shards is not None and fqn in shards  # then the shard is on the host already
                    wanted.append((fqn, grads[fqn], None if "master" in rec.names or offloaded else targets[fqn]))
                host_side = self._copies.to_host(begin, wanted, pin=store._pin)
                if wanted:
                    end = host_side[wanted[-1][0]][2]
            for fqn in store.plan.update_order:
                flat, buf = store.acquire(fqn)
                offloaded = shards is not None and fqn in shards
                target = shards.acquire(fqn) if offloaded else targets[fqn]
                try:
                    sent = self._update(store.records[fqn], flat, target, grads[fqn], hyper, host_side.get(fqn))
                except BaseException:
                    if buf is not None:
                        store._free.append(buf)
                    raise
                end = sent or end
                store.release(fqn, buf, after=sent)
                if offloaded:
                    shards.release(fqn, target)
            store.end_step()
        except BaseException:
            store.drain_quietly()
            raise
        self.update_spans.append((start, time.perf_counter()))
        return end

    def _update(self, rec: Record, flat: torch.Tensor, target: torch.Tensor, grad: torch.Tensor, group: Mapping[str, Any],
                host: tuple[torch.Tensor, torch.Tensor | None, torch.cuda.Event] | None) -> torch.cuda.Event | None:
        """One record's update, where the record lives (NOTE [Tiers on this machine and on an
        accelerator]); the new parameter ends in ``target`` (the shard, or its staging copy).
        ``host``: the gradient (and parameter) already copied on the side stream, and the event
        to wait for; then the new parameter goes back on it too, and its event is returned."""
        seg = rec.views(flat)
        where = flat.device
        store_master = "master" in seg
        # State off the accelerator: the gradient comes to the host, and in fp32 training (no
        # master in the record) so does the parameter, unless it is an offloaded shard, already
        # on the host.
        param_crosses = where != target.device
        cuda = next((d for d in (target.device, grad.device, where) if d.type == "cuda"), None)
        if host is not None:
            grad, host_param, ready = host
            ready.synchronize()  # this record's copies only; the later ones are still in flight
            param = seg["master"] if store_master else (host_param if host_param is not None else target)
        else:
            grad_crosses = where != grad.device
            if grad_crosses:
                grad = grad.to(where, non_blocking=True)
            if store_master:
                param = seg["master"]
            else:
                param = target.to(where, non_blocking=True) if param_crosses else target
            if (grad_crosses or param_crosses) and cuda is not None:
                torch.cuda.current_stream(cuda).synchronize()  # the non_blocking copies have landed
        if self.optimizer_type in ("AdamW", "Adam"):
            fn = adamw_update if self.optimizer_type == "AdamW" else adam_update
            beta1, beta2 = group["betas"]
            fn(
                [param], [grad], [seg["exp_avg"]], [seg["exp_avg_sq"]], [], [rec.step],
                foreach=group["foreach"], capturable=group["capturable"], differentiable=False, fused=group["fused"],
                amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                eps=group["eps"], maximize=group["maximize"],
            )
        else:
            buffers: list[torch.Tensor | None] = [seg["momentum_buffer"] if rec.initialized else None] if "momentum_buffer" in seg else [None]
            sgd_update(
                [param], [grad], buffers, foreach=group["foreach"], fused=group["fused"],
                weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
                dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
            )
            if "momentum_buffer" in seg and not rec.initialized:
                seg["momentum_buffer"].copy_(buffers[0])  # torch made it from the first gradient
                rec.initialized = True
        if store_master or param is not target:
            if host is not None and target.device.type == "cuda":
                assert self._copies is not None
                return self._copies.to_device(target, param)
            target.copy_(param, non_blocking=param_crosses)
            if param_crosses and cuda is not None:
                torch.cuda.current_stream(cuda).synchronize()  # the host buffer is reused (or written to NVMe) next
        return None

    # ------------------------------------------------------------- state access (checkpoints)
    def record_state(self, fqn: str) -> dict[str, Any]:
        """The optimizer state of ``fqn`` as torch keeps it: tensors shaped like the parameter
        shard, plus Adam's ``step``. Read from its tier (a copy)."""
        rec = self.store.records[fqn]
        out: dict[str, Any] = {}
        if OPTIMIZERS[self.optimizer_type].step:
            out["step"] = rec.step.detach().clone()
        if rec.names == ("master",) or not (set(rec.names) - {"master"}):
            return out
        if self.optimizer_type.startswith("SGD") and not rec.initialized:
            return out
        segs = self.store.read_segments(fqn)
        out.update({k: v for k, v in segs.items() if k != "master"})
        return out

    def master_tensors(self) -> dict[str, torch.Tensor]:
        """FQN -> a host copy of its fp32 master (mixed precision only)."""
        if not self.store.mixed_precision:
            return {}
        return {f: self.store.read_segments(f)["master"] for f in self.store.records}

    def load_master(self, fqn: str, value: torch.Tensor) -> None:
        self.store.write_segments(fqn, {"master": value.to(torch.float32)})

    def state_dict(self) -> dict[str, Any]:
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": {index[id(p)]: self.record_state(f) for f, p in self.params_by_fqn.items()}, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore states into the tiers; the hyperparameters in ``param_groups`` are taken too."""
        self.finish()
        order = [self.fqn_of[id(p)] for g in self.param_groups for p in g["params"]]
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for index, entry in state_dict["state"].items():
            fqn = order[int(index)]
            rec = self.store.records[fqn]
            if "step" in entry:
                rec.step = torch.as_tensor(entry["step"], dtype=torch.float32).detach().clone().cpu()
            tensors = {k: v for k, v in entry.items() if k in rec.names and k != "master"}
            if tensors:
                self.store.write_segments(fqn, tensors)
                rec.initialized = True

    def close(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self.store.close()
        if self.param_store is not None:
            self.param_store.close()
        if self.grad_store is not None:
            self.grad_store.close()
