"""Functions each spawned rank runs in tests/test_meta_init.py."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

import zerofx
from zerofx.compiler.materialize import init_weights_
from zerofx.models import DNA_LM_SIZES, DNADecoderLM, DNALMConfig
from zerofx.common.rss import peak_rss_bytes


def _peak_rss_bytes() -> int:
    # A large pytest parent would hide what init adds here (NOTE [VmHWM, not ru_maxrss]).
    return peak_rss_bytes()


def _config(stage: int, extra: dict | None = None) -> dict:
    return {"zero_optimization": {"stage": stage}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, **(extra or {})}


def meta_vs_materialized(rank: int, world_size: int, size: str, stages: list[int], seed: int, extra: dict | None = None) -> dict:
    """Per stage: one engine from the model built normally and passed through ``init_weights_``,
    one from the same model built on the meta device with ``init_seed``; their state before
    and after one SGD step, the meta engine's shards and memory."""
    cfg = DNA_LM_SIZES[size]
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(100 + rank))
    out: dict[str, Any] = {}
    for stage in stages:
        reference = init_weights_(DNADecoderLM(cfg), seed=seed)
        materialized = zerofx.initialize(reference, _config(stage, extra), example_inputs=(ids,), example_kwargs={"labels": ids})
        with torch.device("meta"):
            model = DNADecoderLM(cfg)
        meta = zerofx.initialize(model, _config(stage, extra), example_inputs=(ids,), example_kwargs={"labels": ids}, init_seed=seed)
        res: dict[str, Any] = {
            "model_still_meta": all(p.is_meta for p in model.parameters()),
            "init": {"materialized": materialized.full_state_dict(), "meta": meta.full_state_dict()},
            "shards": {"materialized": {f: t.clone() for f, t in materialized.storage.shards.items()},
                       "meta": {f: t.clone() for f, t in meta.storage.shards.items()}},
            "buffers": {"materialized": dict(materialized.storage.buffers), "meta": dict(meta.storage.buffers)},
            "memory": meta.memory(),
            "shard_param_bytes": sum(p.shard_numel * p.torch_dtype.itemsize for p in meta.placements.values()),
        }
        losses = {}
        for name, engine in (("materialized", materialized), ("meta", meta)):
            loss = engine(ids, labels=ids)
            engine.backward(loss)
            engine.step()
            losses[name] = loss.item()
        res["loss"] = losses
        res["trained"] = {"materialized": materialized.full_state_dict(), "meta": meta.full_state_dict()}
        out[f"stage{stage}"] = res
    return out


def init_peak_rss(rank: int, world_size: int, size: str, on_meta: bool) -> dict:
    """Peak RSS added by building ``size`` (on the meta device or materialized) and sharding it
    at stage 3, against the peak before; capture is left for the first call (the example has
    no labels), so this is the parameters' memory alone."""
    cfg = DNA_LM_SIZES[size]
    ids = torch.zeros(1, 16, dtype=torch.long)
    initialize = zerofx.initialize  # imports the engine's modules (lazy in zerofx) before the baseline
    before = _peak_rss_bytes()
    if on_meta:
        with torch.device("meta"):
            model = DNADecoderLM(cfg)
    else:
        torch.manual_seed(0)
        model = DNADecoderLM(cfg)
    engine = initialize(model, _config(3), example_inputs=(ids,))
    after = _peak_rss_bytes()
    num_params = sum(p.numel for p in engine.placements.values())
    held = engine.memory()
    return {"added_bytes": after - before, "held_bytes": sum(held.values()), "grad_bytes": held["grads"],
            "param_bytes": held["params"], "full_fp32_bytes": 4 * num_params, "num_params": num_params}


def initialize_error(rank: int, world_size: int, size: str, kwargs: dict) -> str:
    """The message ``zerofx.initialize`` raises for a materialized model and ``kwargs``."""
    ids = torch.zeros(1, 8, dtype=torch.long)
    try:
        zerofx.initialize(DNADecoderLM(DNA_LM_SIZES[size]), _config(3), example_inputs=(ids,), **kwargs)
    except zerofx.ZeroFXError as exc:
        return str(exc)
    return "no error"


_ISSUED = ("_c10d_functional::all_gather_into_tensor_out", "_c10d_functional::all_to_all_single",
           "_c10d_functional::reduce_scatter_tensor", "_c10d_functional::wait_tensor")


def _collectives_issued(prof: Any) -> list[str]:
    """The functional collectives and waits a profiled step issued on this thread, in order."""
    events = [e for e in prof.events() if e.name in _ISSUED]
    main = min(events, key=lambda e: e.time_range.start).thread
    return [e.name.split("::")[1] for e in sorted(events, key=lambda e: e.time_range.start) if e.thread == main]


def eager_vs_inductor(rank: int, world_size: int, cfg: DNALMConfig, stage: int, steps: int) -> dict:
    """Train the DNA LM of ``cfg`` (meta-built, same init) for ``steps`` SGD steps with the graphs
    run as FX code and compiled by Inductor (``zerofx.compile``); losses and final full state of each."""
    g = torch.Generator().manual_seed(200 + rank)
    data = [torch.randint(0, cfg.vocab_size, (2, 32), generator=g) for _ in range(steps)]
    out: dict[str, Any] = {}
    for compiler in ("none", "inductor"):
        with torch.device("meta"):
            model = DNADecoderLM(cfg)
        engine = zerofx.initialize(model, _config(stage, {"zerofx": {"compile": compiler}}),
                                   example_inputs=(data[0],), example_kwargs={"labels": data[0]}, init_seed=1)
        losses = []
        for i, ids in enumerate(data):
            last = i == len(data) - 1
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if last else contextlib.nullcontext() as prof:
                loss = engine(ids, labels=ids)
                engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[compiler] = {"losses": losses, "state": engine.full_state_dict(), "compile_s": engine.compile_s,
                         "compiled": sorted(engine.program.compiled_graphs), "issued": _collectives_issued(prof)}
    return out


def inductor_cache_hits(rank: int, world_size: int, cfg: DNALMConfig, cache_dir: str) -> dict:
    """One step of the DNA LM of ``cfg`` compiled by Inductor into an empty on-disk cache
    (``cache_dir``): the cache counters of this rank's own compiles (NOTE [Inductor compiles
    first in a child]: a child compiled the graphs first, so the rank's are hits)."""
    import os

    from torch._dynamo.utils import counters

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    counters.clear()
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(rank))
    with torch.device("meta"):
        model = DNADecoderLM(cfg)
    engine = zerofx.initialize(model, _config(3, {"zerofx": {"compile": "inductor"}}), example_inputs=(ids,),
                               example_kwargs={"labels": ids}, init_seed=1)
    loss = engine(ids, labels=ids)
    engine.backward(loss)
    engine.step()
    return {"counters": dict(counters["inductor"]), "compiled": sorted(engine.program.compiled_graphs),
            "warmed": sorted(engine.program.warmed_ranks)}
