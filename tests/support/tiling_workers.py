"""What each spawned rank runs in the tiling tests: one SGD step, tiled and untiled."""

from __future__ import annotations


import zerofx
from tests.support.tiling_models import dna_lm, tokens

TILING = {"enabled": True, "block_size": 16, "attention_block_size": 16}
# Attention tiled, regions not, and every linear weight over 4 KiB (qkv, the MLP) in tiles of at
# most 4 KiB: at stage 3 gathered and reduced one tile at a time.
WEIGHT_TILING = {"enabled": True, "attention_block_size": 16, "region": False, "weight_tile_bytes": 4096}


def tiled_vs_untiled(rank: int, world_size: int, stages: list[int]) -> dict:
    """Per stage and rank: the full state after one SGD step (lr 1, so the change is the averaged
    gradient) and the loss, with and without tiling, plus the tiled plan's fingerprint and ops."""
    return {stage: _one_stage(rank, stage) for stage in stages}


def _one_stage(rank: int, stage: int) -> dict:
    out = {}
    ids = tokens(seed=10 + rank)
    variants = [("tiled", TILING, {}), ("weights", WEIGHT_TILING, {}), ("untiled", {"enabled": False}, {})]
    if stage == 3:  # the tiled weights' shards in host memory, fetched by the graphs (fetch_params_pass)
        variants.append(("weights_offloaded", WEIGHT_TILING, {"offload_param": {"device": "cpu"}}))
    for name, tiling, zero in variants:
        model = dna_lm()
        cfg = {"zero_optimization": {"stage": stage, **zero}, "optimizer": {"type": "SGD", "params": {"lr": 1.0}},
               "zerofx": {"tiling": tiling}}
        engine = zerofx.initialize(model, cfg, example_inputs=(ids,), example_kwargs={"labels": ids})
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        plan = engine.program.plan
        out[name] = {
            "loss": loss.detach().clone(),
            "state": engine.full_state_dict(),
            "tiled_ops": [(op.kind, op.block_size) for op in plan.tiling.ops] if plan.tiling else [],
            "fingerprint": plan.fingerprint(),
            "tile_gathered": list(plan.tile_gathered),
        }
    return out
