"""The training systems the benchmark compares, one class each, behind one small interface.

Every runner is built inside one rank of an initialized process group (``single`` needs none)
from a freshly seeded ``DNADecoderLM``, and then answers:

- ``step(ids) -> float``: one optimizer step on this rank's micro-batch ``ids`` (B, T); the
  loss is the model's own mean next-token cross-entropy, and the return value is its float;
- ``full_state() -> dict``: the full, unsharded ``model.state_dict()`` values on every rank
  (a collective for the sharded systems: every rank calls it);
- ``memory() -> dict``: the bytes of model state this rank holds, measured on real tensors.

NOTE [How model-state bytes are measured]
Bytes are the storages of the tensors a system keeps between steps, deduplicated by storage,
so that views into one flat buffer count once and with their padding:
- plain PyTorch and DDP: parameters, ``.grad`` and the optimizer's state tensors. DDP runs with
  ``gradient_as_bucket_view=True``, so its gradient buckets *are* the ``.grad`` storages; with
  DDP's default the buckets would be a second, uncounted 4P bytes;
- FSDP2: the same, on the local shards of the DTensors (``to_local()``), which are views into
  FSDP2's padded flat shard;
- zerofx: ``engine.memory()``, which measures the engine's own tensors;
- DeepSpeed: the model's parameters (their ``ds_tensor`` partitions at stage 3) and ``.grad``;
  the fp32 master partitions its inner torch optimizer steps, their gradients, and that
  optimizer's state. Its reduce buckets (``reduce_bucket_size`` elements, allocated once and
  mostly untouched on CPU) are scratch space and are not counted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.profiler import record_function

from zerofx.models import DNA_LM_SIZES, DNADecoderLM

SYSTEMS = (
    "single", "local", "ddp", "fsdp2", "fsdp2_ac", "fsdp2_noreshard", "fsdp2_compile", "fsdp2_fused", "zerofx1", "zerofx2",
    "zerofx3", "zerofx3_meta", "zerofx3_fused", "zerofx3_gloo_rs", "zerofx3_inductor", "zerofx3_wtiles", "deepspeed1", "deepspeed2", "deepspeed3",
)
DEFAULT_SYSTEMS = ("single", "ddp", "fsdp2", "fsdp2_noreshard", "zerofx1", "zerofx2", "zerofx3", "zerofx3_meta")
# zerofx variants: (stage, build on the meta device, extra "zerofx" config section).
ZEROFX_VARIANTS: dict[str, tuple[int, bool, dict[str, Any]]] = {
    "zerofx1": (1, False, {}),
    "zerofx2": (2, False, {}),
    "zerofx3": (3, False, {}),
    # Built on the meta device: each rank initializes only its shard (zerofx.compiler.materialize).
    "zerofx3_meta": (3, True, {}),
    # gloo's own reduce-scatter (an all-reduce) instead of the all-to-all and sum zerofx issues on
    # gloo (NOTE [gloo's reduce-scatter as an all-to-all] in passes/zero/reduce_scatter_all_to_all.py).
    "zerofx3_gloo_rs": (3, False, {"reduce_scatter_by_all_to_all": False}),
    # Fused AdamW (one kernel over the rank's flat shards); compare with fsdp2_fused.
    "zerofx3_fused": (3, False, {"fused_optimizer": True}),
    # Also: forward and backward graphs compiled by Inductor, fused AdamW over the shards.
    "zerofx3_inductor": (3, True, {"compile": "inductor", "fused_optimizer": True}),
    # Also: every linear weight over 8 MiB gathered, used and reduced in tiles of at most 8 MiB
    # (NOTE [One weight tile at a time] in passes/zero/tile_weights.py); no sequence tiling.
    "zerofx3_wtiles": (3, True, {"tiling": {"enabled": True, "attention": False, "region": False, "loss": False,
                                            "weight_tile_bytes": "8MiB"}}),
}
# Systems that hold the full model and need no process group.
NO_GROUP = frozenset({"single"})
# Systems that do not average gradients across ranks: excluded from the parity check.
NO_PARITY = frozenset({"local"})
OPTIMIZERS = ("AdamW", "SGD")
DEFAULT_LR = {"AdamW": 1e-3, "SGD": 0.1}


def split_system(name: str) -> tuple[str, str | None]:
    """``"zerofx3@AdamW"`` -> ``("zerofx3", "AdamW")``: a system run with its own optimizer (at its
    default learning rate) instead of the run's. ``"zerofx3"`` -> ``("zerofx3", None)``."""
    base, _, optimizer = name.partition("@")
    if base not in SYSTEMS or (optimizer and optimizer not in OPTIMIZERS):
        raise ValueError(f"unknown system {name!r}; accepted: one of {', '.join(SYSTEMS)}, optionally "
                         f"followed by @ and one of {', '.join(OPTIMIZERS)}")
    return base, optimizer or None


def needs_group(name: str) -> bool:
    return split_system(name)[0] not in NO_GROUP


def build_model(size: str, seed: int, device: torch.device) -> DNADecoderLM:
    """The same initial weights in every process, and the ones a meta-built zerofx run starts
    from: the model's own init, module by module from ``seed`` (``zerofx.init_weights_``)."""
    from zerofx.compiler.materialize import init_weights_

    torch.manual_seed(seed)
    return init_weights_(DNADecoderLM(DNA_LM_SIZES[size]), seed=seed).to(device)


def make_optimizer(kind: str, lr: float, params: Iterable[nn.Parameter], **kwargs: Any) -> torch.optim.Optimizer:
    assert kind in OPTIMIZERS, kind
    cls = {"AdamW": torch.optim.AdamW, "SGD": torch.optim.SGD}[kind]
    return cls(list(params), lr=lr, **kwargs)


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors count their local shard)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optim.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def _loss_of(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.loss


def _engine_step(engine: Any, ids: torch.Tensor) -> float:
    """One step of an engine with DeepSpeed's interface (``engine(...)``, ``.backward``, ``.step``),
    each phase labelled for the profiler; zerofx's and DeepSpeed's runners share it."""
    with record_function("bench::forward"):
        loss = _loss_of(engine(ids, labels=ids))
    with record_function("bench::backward"):
        engine.backward(loss)
    with record_function("bench::optimizer"):
        engine.step()
    return loss.item()


class EagerRunner:
    """Plain PyTorch around a module (``single``, ``local``) or a wrapper of it (DDP, FSDP2)."""

    def __init__(self, model: nn.Module, wrapped: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.wrapped, self.optim = model, wrapped, optim

    def step(self, ids: torch.Tensor) -> float:
        self.optim.zero_grad(set_to_none=True)
        with record_function("bench::forward"):
            loss = _loss_of(self.wrapped(ids, labels=ids))
        with record_function("bench::backward"):
            loss.backward()
        with record_function("bench::optimizer"):
            self.optim.step()
        return loss.item()

    def full_state(self) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor

        out = {}
        for key, value in self.model.state_dict().items():  # same order on every rank
            value = value.full_tensor() if isinstance(value, DTensor) else value
            out[key] = value.detach().to("cpu", copy=True)
        return out

    def memory(self) -> dict[str, int]:
        params = list(self.model.parameters())
        return {
            "params": storage_bytes(params),
            "grads": storage_bytes(p.grad for p in params),
            "optimizer_states": storage_bytes(optimizer_state_tensors(self.optim)),
        }


def _merged(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), dict) else value
    return out


class ZeroFXRunner:
    def __init__(self, model: nn.Module, stage: int, optim_kind: str, lr: float, example: torch.Tensor,
                 extra_config: Mapping[str, Any] | None = None, *, init_seed: int = 0) -> None:
        import zerofx

        config = {"zero_optimization": {"stage": stage}, "optimizer": {"type": optim_kind, "params": {"lr": lr}}}
        config = _merged(config, extra_config or {})
        # init_seed applies to a meta-built model only (the others arrive initialized).
        seed = {"init_seed": init_seed} if any(p.is_meta for p in model.parameters()) else {}
        self.engine = zerofx.initialize(model, config, example_inputs=(example,), example_kwargs={"labels": example}, **seed)

    def compile_s(self) -> float:
        return self.engine.compile_s

    def step(self, ids: torch.Tensor) -> float:
        return _engine_step(self.engine, ids)

    def full_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.engine.full_state_dict().items()}

    def memory(self) -> dict[str, int]:
        return dict(self.engine.memory())


class DeepSpeedRunner:
    def __init__(self, model: nn.Module, stage: int, optim_kind: str, lr: float, micro_batch: int, world_size: int) -> None:
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        config = {
            "train_micro_batch_size_per_gpu": micro_batch,
            "gradient_accumulation_steps": 1,
            "train_batch_size": micro_batch * world_size,
            "zero_optimization": {"stage": stage},
            # DeepSpeed clips at 1.0 unless told otherwise; the other systems do not clip.
            "gradient_clipping": 0.0,
            # The same torch optimizer object as every other system, passed in as a client optimizer.
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
        }
        optim = make_optimizer(optim_kind, lr, model.parameters())
        self.model = model
        self.engine, self.optim, _, _ = deepspeed.initialize(model=model, optimizer=optim, config=config)
        self.stage = stage

    def step(self, ids: torch.Tensor) -> float:
        return _engine_step(self.engine, ids)

    def full_state(self) -> dict[str, torch.Tensor]:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters(list(self.model.parameters())) if self.stage == 3 else contextlib.nullcontext()
        with gather:
            return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def memory(self) -> dict[str, int]:
        inner = self.optim.optimizer  # the torch optimizer inside the ZeRO wrapper; it steps the fp32 partitions
        masters = [p for group in inner.param_groups for p in group["params"]]
        params = [getattr(p, "ds_tensor", None) if self.stage == 3 else p for p in self.model.parameters()]
        param_ptrs = {t.untyped_storage().data_ptr() for t in params if t is not None}
        return {
            "params": storage_bytes(params),
            "grads": storage_bytes([p.grad for p in self.model.parameters()] + [p.grad for p in masters]),
            # fp32 master partitions (a second copy even in fp32 training) and the optimizer's state.
            "optimizer_states": storage_bytes([p for p in masters if p.untyped_storage().data_ptr() not in param_ptrs]
                                              + optimizer_state_tensors(inner)),
        }


def shard_fsdp2(model: nn.Module, *, reshard: bool = True, compiled: bool = False, checkpoint: bool = False) -> nn.Module:
    """FSDP2 as torchtitan applies it: ``fully_shard`` on each decoder block, then on the root.

    ``checkpoint``: each block's activations are checkpointed first (``torch.distributed._composable
    .checkpoint``, torchtitan's full activation checkpointing): the forward keeps only each block's
    input, and the backward runs the block's forward again. ``compiled``: each block is
    ``torch.compile``d (Inductor) before it is sharded."""
    from torch.distributed._composable import checkpoint as checkpoint_module
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        if checkpoint:
            checkpoint_module(block)
        if compiled:
            # torchtitan's recipe: torch.compile each block (Inductor), then shard it. Blocks
            # share their code, so Dynamo compiles one graph; it runs on the first step.
            block.compile()
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    return model


def build_runner(
    system: str, *, size: str, seed: int, device: torch.device, optim_kind: str, lr: float, example: torch.Tensor,
    micro_batch: int, zerofx_config: str | None = None,
) -> tuple[Any, float, int]:
    """Build ``system`` on this rank; return (runner, setup seconds, number of parameters).

    Setup time covers what the system adds on top of building the model: wrapping and sharding
    (DDP, FSDP2, DeepSpeed) or capture, planning and rewriting (zerofx ``initialize``)."""
    system, own_optimizer = split_system(system)
    if own_optimizer is not None and own_optimizer != optim_kind:
        optim_kind, lr = own_optimizer, DEFAULT_LR[own_optimizer]
    on_meta = system in ZEROFX_VARIANTS and ZEROFX_VARIANTS[system][1]
    if on_meta:
        with torch.device("meta"):
            model = DNADecoderLM(DNA_LM_SIZES[size])
    else:
        model = build_model(size, seed, device)
    num_params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    runner: Any
    if system in ("single", "local"):
        runner = EagerRunner(model, model, make_optimizer(optim_kind, lr, model.parameters()))
    elif system == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, gradient_as_bucket_view=True)
        runner = EagerRunner(model, ddp, make_optimizer(optim_kind, lr, ddp.parameters()))
    elif system in ("fsdp2", "fsdp2_ac", "fsdp2_noreshard", "fsdp2_compile", "fsdp2_fused"):
        compiled = system == "fsdp2_compile"
        shard_fsdp2(model, reshard=system != "fsdp2_noreshard", compiled=compiled, checkpoint=system == "fsdp2_ac")
        fused = {"fused": True} if system in ("fsdp2_compile", "fsdp2_fused") and optim_kind == "AdamW" else {}
        runner = EagerRunner(model, model, make_optimizer(optim_kind, lr, model.parameters(), **fused))
    elif system in ZEROFX_VARIANTS:
        stage, _, own = ZEROFX_VARIANTS[system]
        extra = _merged({"zerofx": own} if own else {}, json.loads(zerofx_config or "{}"))
        runner = ZeroFXRunner(model, stage, optim_kind, lr, example, extra, init_seed=seed)
    elif system.startswith("deepspeed"):
        runner = DeepSpeedRunner(model, int(system[-1]), optim_kind, lr, micro_batch, dist.get_world_size())
    else:
        raise ValueError(f"unknown system {system!r}; accepted: {', '.join(SYSTEMS)}")
    return runner, time.perf_counter() - start, num_params


def synchronize(device: torch.device) -> Callable[[], None]:
    """A function that waits for ``device``'s queued work (a no-op on CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
