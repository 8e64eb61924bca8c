"""The genomic models' parity runs (tests/test_genomic_models.py): plain single-process SGD, and
what each gloo rank runs, from the same init and the same batches."""

from __future__ import annotations

import torch

import zerofx
from zerofx.compiler.materialize import init_weights_
from zerofx.models import build_model, model_config

SGD = {"type": "SGD", "params": {"lr": 0.1}}
SEQ, BATCH, SEED = 24, 2, 0
MASK_ID = 4  # N: the bundled vocabulary has no <mask>, and any id the model embeds will do here


def batches(size: str, world_size: int, steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``[step][rank] -> (inputs, labels)``: the ids twice for a causal model; for a
    bidirectional one, a quarter of the positions masked in the inputs and labelled, the rest
    labelled -100 (the masked-LM layout of ``zerofx.data.mlm``)."""
    g = torch.Generator().manual_seed(1)
    causal = model_config(size).is_causal
    out = []
    for _ in range(steps):
        row = []
        for _ in range(world_size):
            ids = torch.randint(0, 4, (BATCH, SEQ), generator=g)
            if causal:
                row.append((ids, ids))
            else:
                masked = torch.rand(BATCH, SEQ, generator=g) < 0.25
                row.append((ids.masked_fill(masked, MASK_ID), ids.masked_fill(~masked, -100)))
        out.append(row)
    return out


def reference(size: str, world_size: int, steps: int) -> dict[str, torch.Tensor]:
    """Plain PyTorch: each step averages the per-rank losses, as data parallel averages gradients."""
    model = init_weights_(build_model(size), seed=SEED)
    optim = torch.optim.SGD(model.parameters(), **SGD["params"])
    for row in batches(size, world_size, steps):
        optim.zero_grad()
        loss = sum(model(inputs, labels=labels).loss for inputs, labels in row) / world_size
        loss.backward()
        optim.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_stage3(rank: int, world_size: int, sizes: list[str], steps: int) -> dict[str, dict[str, torch.Tensor]]:
    """Per size: the model built on the meta device, started by ``zerofx.initialize`` from the
    seed, trained ``steps`` SGD steps at stage 3; its full state dict."""
    out = {}
    for size in sizes:
        data = batches(size, world_size, steps)
        inputs, labels = data[0][rank]
        engine = zerofx.initialize(
            build_model(size, device="meta"), {"zero_optimization": {"stage": 3}, "optimizer": SGD},
            example_inputs=(inputs,), example_kwargs={"labels": labels}, init_seed=SEED,
        )
        for row in data:
            inputs, labels = row[rank]
            loss = engine(inputs, labels=labels)
            engine.backward(loss)
            engine.step()
        out[size] = engine.full_state_dict()
    return out
