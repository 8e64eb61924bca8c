"""Weight tiles and sequence chunks against untiled runs beyond the test suite: bf16 and
Inductor-compiled rank graphs.

``python -m benchmarks.check_weight_tiles`` runs the tiny DNA LM on 2 gloo ranks at stage 3 for
2 SGD steps (lr 1, so parameter differences are gradient differences), untiled and with every
linear weight over 4 KiB gathered one tile at a time (NOTE [One weight tile at a time] in
``passes/zero/tile_weights.py``), in fp32, bf16 and with ``"compile": "inductor"``; and compiled
by Inductor with attention, the token-wise regions (loops over one body, NOTE [One body per
tiled region] in ``passes/tiling/chunk_loop.py``; 40 tokens in chunks of 16, 16 and 8) and the
loss tiled. It prints, per rank, each pair's loss and largest parameter difference. Kept out of
the suite for CI time.
"""

from __future__ import annotations

from typing import Any

import zerofx
from tests.support.dist_utils import run_ranks
from tests.support.tiling_models import dna_lm, tokens

WEIGHT_TILES = {"enabled": True, "attention": False, "region": False, "loss": False, "weight_tile_bytes": 4096}
CHUNKS = {"enabled": True, "block_size": 16, "attention_block_size": 16}
VARIANTS = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "bf16_tiles": {"bf16": {"enabled": True}, "zerofx": {"tiling": WEIGHT_TILES}},
    "inductor": {"zerofx": {"compile": "inductor"}},
    "inductor_tiles": {"zerofx": {"compile": "inductor", "tiling": WEIGHT_TILES}},
    "inductor_chunks": {"zerofx": {"compile": "inductor", "tiling": CHUNKS}},
}
PAIRS = (("fp32", "bf16"), ("fp32", "bf16_tiles"), ("bf16", "bf16_tiles"), ("inductor", "inductor_tiles"), ("fp32", "inductor_chunks"))


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    out = {}
    ids = tokens(seed=10 + rank)
    for name, extra in VARIANTS.items():
        cfg = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "SGD", "params": {"lr": 1.0}}, **extra}
        engine = zerofx.initialize(dna_lm(), cfg, example_inputs=(ids,), example_kwargs={"labels": ids})
        for _ in range(2):
            loss = engine(ids, labels=ids)
            engine.backward(loss)
            engine.step()
        state = {k: v.float() for k, v in engine.full_state_dict().items()}
        out[name] = (loss.float().item(), state, len(engine.program.plan.tile_gathered))
    return out


def main() -> None:
    for rank, res in enumerate(run_ranks(2, _worker)):
        for a, b in PAIRS:
            (loss_a, state_a, _), (loss_b, state_b, tiled) = res[a], res[b]
            diff = max((state_a[k] - state_b[k]).abs().max().item() for k in state_a)
            print(f"rank {rank}: {a} vs {b} ({tiled} weights tiled): loss {loss_a:.6f} vs {loss_b:.6f}, "
                  f"largest parameter difference {diff:.3g}")


if __name__ == "__main__":
    main()
