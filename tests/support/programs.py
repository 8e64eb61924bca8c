"""Programs planned from meta-built models: one capture per model, planned again per test.

Capture is most of a small program's setup (about 60%: the joint graph traced twice by
AOTAutograd); the plan, lowering and report are the rest. Structural tests plan the same
model at several stages, world sizes and bucket sizes, so they share one capture per model
(``Program.replan``, NOTE [Planning again from one capture] in zerofx/compiler/program.py) and each
still plans and lowers its own program.
"""

from __future__ import annotations

import functools

import torch

import zerofx
from tests.support.models import BATCH, SEQ, TINY
from zerofx.models import DNADecoderLM, DNALMConfig

# Buckets of at most 3000 elements split the tiny model into several buckets of each kind.
SMALL_BUCKETS = {"stage3_prefetch_bucket_size": 3000, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000}


@functools.cache
def _captured(cfg: DNALMConfig, frozen: bool) -> zerofx.Program:
    with torch.device("meta"):
        model = DNADecoderLM(cfg)
    if frozen:
        model.blocks[0].attn_norm.weight.requires_grad_(False)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    return zerofx.compile(model, world_size=1, stage=0, example_inputs=(ids,), example_kwargs={"labels": ids})


def meta_program(stage: int, world_size: int, cfg: DNALMConfig = TINY, frozen: bool = True, *, own: dict | None = None,
                 **zero: object) -> zerofx.Program:
    """The meta-built DNA LM (``frozen``: one frozen norm weight) planned at ``stage`` for
    ``world_size`` ranks with ``zero_optimization`` keys ``zero`` and ``zerofx`` keys ``own``."""
    return _captured(cfg, frozen).replan({"zero_optimization": {"stage": stage, **zero}, "zerofx": own or {}}, world_size=world_size)


def saved_views_of_inputs_bytes(program: zerofx.Program) -> int:
    """Bytes of the values ``program``'s forward saves for backward as views of its inputs and
    buffers (parameters aside), which the memory timeline does not count (NOTE [A saved view of
    an input is that input]). A sequence-parallel rank saves copies of its slices instead: the
    activations of S ranks at T tokens and of one at T/S differ by at most this."""
    from zerofx.cost_models.memory_timeline import aliases_of_inputs
    from zerofx.passes import meta

    forward = program.graph_modules(0)["forward"]
    aliases = aliases_of_inputs(forward)
    return sum(a.meta["val"].numel() * a.meta["val"].element_size() for a in meta.output_node(forward.graph).args[0][1:]
               if isinstance(a, torch.fx.Node) and a.name in aliases and a.meta.get(meta.ROLE) is not meta.Role.PARAM)
