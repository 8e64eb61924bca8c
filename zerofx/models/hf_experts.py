"""Hugging Face mixture-of-experts layers as a capture records them: ``experts_traceable(model)``.

NOTE [Hugging Face experts under fake tensors]
transformers (5.x) runs the experts of its MoE layers (Jamba, Mixtral, Qwen-MoE, ...) by
``config._experts_implementation``, ``"grouped_mm"`` by default: ``torch._grouped_mm`` over the
tokens sorted by expert. Its CPU kernel takes fp32, but its fake (meta) kernel checks the
inputs as the CUDA kernel does and takes bf16 only, so a capture, which records on fake tensors,
fails with "Expected inputs of BF16 type but got mat_a.dtype=torch.float32" for any fp32 or
fp16 model, Jamba with ``use_mamba_kernels=False`` among them. While the capture records, each
config that asks for ``"grouped_mm"`` in a model whose experts hold weights other than bf16 asks
for ``"batched_mm"`` instead: the same function (each token times its experts' weights, the
same sum over its top k), written as a gather of each token's expert weights and a batched
matmul, which records on fake tensors in any dtype. It holds (tokens · k, in, out) of gathered
weights per projection, more than the grouped kernel, so bf16 models keep ``"grouped_mm"``. The
config is given its own setting back afterwards, also when the capture raises.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch

GROUPED, BATCHED = "grouped_mm", "batched_mm"


def _grouped_configs(model: torch.nn.Module) -> list[object]:
    """The distinct configs of ``model``'s modules that ask for grouped experts, where those modules hold non-bf16 weights."""
    found: dict[int, object] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or getattr(config, "_experts_implementation", None) != GROUPED or id(config) in found:
            continue
        if not hasattr(module, "has_gate"):  # transformers' ``use_experts_implementation`` sets it on each experts module
            continue
        if any(p.dtype != torch.bfloat16 for p in module.parameters(recurse=False)):
            found[id(config)] = config
    return list(found.values())


@contextlib.contextmanager
def experts_traceable(model: torch.nn.Module) -> Iterator[None]:
    """Within it, ``model``'s non-bf16 Hugging Face experts run by ``"batched_mm"`` (NOTE [Hugging
    Face experts under fake tensors])."""
    configs = _grouped_configs(model) if "transformers" in sys.modules else []
    for config in configs:
        config._experts_implementation = BATCHED
    try:
        yield
    finally:
        for config in configs:
            config._experts_implementation = GROUPED
