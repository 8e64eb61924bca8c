"""What each rank runs in tests/test_sp_checkpoint.py, and the single-process reference.

Every layout trains on the same global batch per step, ``global_batch(step)``: GLOBAL_BATCH
sequences that the D = N / S data groups split evenly, every rank of a sequence group passing
its group's rows whole (NOTE [Sequence groups] in zerofx/runtime/rank_groups.py). Labels are the ids, so
every row has the same number of predicted tokens and the mean over data groups of each group's
loss is the loss of the whole global batch: plain PyTorch on it is the uninterrupted run, in any
layout.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import zerofx
from tests.support.checkpoint_workers import ADAMW, full_optimizer_state
from tests.support.models import SEQ, VOCAB, dna_lm, make_optimizer

GLOBAL_BATCH = 4  # sequences per step, split over the data groups
SAVED_STEPS = 2  # the checkpoints hold the state after steps 1..2
TOTAL_STEPS = 4  # a resumed run trains steps 3..4
# TINY has 3 heads: Ulysses needs S to divide them, so these runs use ring attention ("auto" picks it).
SAVE_D2_X_S2 = "d2xs2"  # world 4: data 2 x sequence 2 in shard groups of 2 (each one sequence group), stage 3
SAVE_S2 = "s2"  # world 2: sequence 2 (data 1), stage 2


def global_batch(step: int) -> torch.Tensor:
    """(GLOBAL_BATCH, SEQ) token ids of step ``step`` (from 1), the same in every layout."""
    g = torch.Generator().manual_seed(1_000 + step)
    return torch.randint(0, VOCAB["dna"], (GLOBAL_BATCH, SEQ), generator=g)


def group_rows(step: int, rank: int, world_size: int, size: int) -> torch.Tensor:
    """The rows of ``global_batch(step)`` that rank ``rank``'s data group (rank // size) trains on."""
    groups = world_size // size
    rows = GLOBAL_BATCH // groups
    g = rank // size
    return global_batch(step)[g * rows : (g + 1) * rows]


def config(stage: int, size: int, attention: str, shard_group_size: int | None = None) -> dict[str, Any]:
    own: dict[str, Any] = {} if shard_group_size is None else {"shard_group_size": shard_group_size}
    if size > 1:
        own["sequence_parallel"] = {"size": size, "attention": attention}
    return {"zero_optimization": {"stage": stage}, "optimizer": ADAMW, **({"zerofx": own} if own else {})}


def make_engine(stage: int, size: int, attention: str = "ring", group: dist.ProcessGroup | None = None,
                shard_group_size: int | None = None) -> zerofx.Engine:
    """The tiny DNA LM (tied embeddings, a frozen norm weight, sizes that pad) with AdamW."""
    ids = group_rows(1, dist.get_rank(group), dist.get_world_size(group), size)
    return zerofx.initialize(dna_lm(), config(stage, size, attention, shard_group_size), example_inputs=(ids,),
                             example_kwargs={"labels": ids}, group=group)


def train(engine: zerofx.Engine, size: int, first: int, last: int) -> list[float]:
    """Steps ``first..last``; this rank's losses (its data group's)."""
    losses = []
    for step in range(first, last + 1):
        ids = group_rows(step, engine.rank, engine.world_size, size)
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def snapshot(engine: zerofx.Engine) -> dict[str, Any]:
    """Full parameters and AdamW states (gathered: a collective) and the counters."""
    return {
        "state": engine.full_state_dict(),
        "optim": full_optimizer_state(engine),
        "counters": {"global_steps": engine.global_steps, "global_samples": engine.global_samples, "micro_steps": engine.micro_steps},
    }


def resume(root: str, tag: str, stage: int, size: int, attention: str = "ring", group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """A fresh engine in this layout (flat sharding) loads ``tag``, then trains steps
    SAVED_STEPS+1..TOTAL_STEPS."""
    engine = make_engine(stage, size, attention, group)
    client = engine.load_checkpoint(root, tag)
    loaded = snapshot(engine)
    losses = train(engine, size, SAVED_STEPS + 1, TOTAL_STEPS)
    out = {"client": client, "loaded": loaded, "losses": losses, "final": snapshot(engine)}
    engine.close()
    return out


def save_data2_x_seq2_resume_seq4(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """World 4. Data 2 x sequence 2 at stage 3, in shard groups of 2, trains 2 steps, saves, and
    trains on to step 4 (the uninterrupted run); sequence 4 at stage 1 ("auto" attention, flat
    sharding) resumes from the save."""
    assert world_size == 4
    engine = make_engine(3, 2, "ring", shard_group_size=2)
    losses = train(engine, 2, 1, SAVED_STEPS)
    saved = snapshot(engine)
    engine.save_checkpoint(root, SAVE_D2_X_S2, client_state={"rank": rank, "batches_consumed": SAVED_STEPS})
    losses += train(engine, 2, SAVED_STEPS + 1, TOTAL_STEPS)
    out = {"saved": saved, "losses": losses, "final": snapshot(engine)}
    engine.close()
    out["seq4"] = resume(root, SAVE_D2_X_S2, 1, 4, "auto")
    return out


def save_seq2_resume_elsewhere(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """World 2. Sequence 2 at stage 2 trains 2 steps and saves; that checkpoint resumes as data 2
    (no sequence parallelism, stage 1) and on rank 0 alone (world 1, stage 0). The world-4 data 2
    x sequence 2 checkpoint resumes here as sequence 2 at stage 3."""
    assert world_size == 2
    solo = dist.new_group([0])  # every rank takes part in creating it
    engine = make_engine(2, 2, "ring")
    train(engine, 2, 1, SAVED_STEPS)
    saved = snapshot(engine)
    engine.save_checkpoint(root, SAVE_S2, client_state={"rank": rank, "batches_consumed": SAVED_STEPS})
    engine.close()
    out = {"saved": saved, "data2": resume(root, SAVE_S2, 1, 1), "seq2_from_world4": resume(root, SAVE_D2_X_S2, 3, 2)}
    dist.barrier()
    if rank == 0:
        out["world1"] = resume(root, SAVE_S2, 0, 1, group=solo)
    return out


def reference() -> dict[str, Any]:
    """Plain PyTorch in one process on every step's whole global batch: the losses, and the state
    and AdamW states after step SAVED_STEPS and after step TOTAL_STEPS."""
    model = dna_lm()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optim = make_optimizer(ADAMW, list(params.values()))
    out: dict[str, Any] = {"losses": []}
    for step in range(1, TOTAL_STEPS + 1):
        ids = global_batch(step)
        loss = model(ids, labels=ids).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        out["losses"].append(loss.item())
        if step in (SAVED_STEPS, TOTAL_STEPS):
            out[step] = {
                "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "optim": {n: {k: v.detach().clone().reshape(-1) if v.dim() else v.clone() for k, v in optim.state[p].items()}
                          for n, p in params.items()},
            }
    return out
