"""Small models for tests, built the same way in the test process and in every rank."""

from __future__ import annotations

import torch
import torch.nn as nn

from zerofx.models import DNADecoderLM, DNALMConfig

# dim 30 and ffn 70: many parameters whose sizes do not divide by 3 or 4 (padding is exercised).
TINY = DNALMConfig(dim=30, num_layers=2, num_heads=3, ffn_dim=70, max_seq_len=64)
SEQ, BATCH = 16, 2


def dna_lm(seed: int = 0, frozen: bool = True) -> DNADecoderLM:
    """Tied embeddings, non-persistent rope buffers, and (with ``frozen``) one frozen norm weight."""
    torch.manual_seed(seed)
    model = DNADecoderLM(TINY)
    if frozen:
        model.blocks[0].attn_norm.weight.requires_grad_(False)
    return model


class Scaled(nn.Module):
    """A persistent buffer that takes part in the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = dna_lm(frozen=False)
        self.register_buffer("temperature", torch.tensor([1.5]))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = self.lm(input_ids, labels=labels)
        return out.loss * self.temperature[0]


def llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=8, hidden_size=30, intermediate_size=70, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


def batches(world_size: int, steps: int, vocab: int = 5, seed: int = 1) -> torch.Tensor:
    """(steps, world_size, BATCH, SEQ) token ids; rank r trains on [step, r]."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (steps, world_size, BATCH, SEQ), generator=g)


BUILDERS = {"dna": dna_lm, "scaled": Scaled, "llama": llama}
VOCAB = {"dna": 5, "scaled": 5, "llama": 8}


def reference(kind: str, world_size: int, steps: int, opt: dict) -> dict[str, torch.Tensor]:
    """Plain single-process PyTorch: each step averages the per-rank losses, as data parallel
    averages gradients, then steps the optimizer."""
    model = BUILDERS[kind]()
    optim = make_optimizer(opt, [p for p in model.parameters() if p.requires_grad])
    data = batches(world_size, steps, VOCAB[kind])
    for step in range(steps):
        optim.zero_grad()
        loss = sum(loss_of(model, data[step, r]) for r in range(world_size)) / world_size
        loss.backward()
        optim.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids, labels=ids)
    return out if isinstance(out, torch.Tensor) else out.loss


def make_optimizer(opt: dict, params: list) -> torch.optim.Optimizer:
    cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}[opt["type"]]
    return cls(params, **opt["params"])


def hyena_one_block() -> tuple[nn.Module, tuple, dict]:
    """A model spec for ``zerofx plan`` (FILE.py:CALLABLE): hyena-tiny with one block, on the
    meta device, and a (1, 64) example batch. Its block has every mixer op hyena-tiny's two
    have (the featurizer's short conv, the implicit filter, the FFT long conv), at half the
    capture time."""
    import dataclasses

    from zerofx.models import HYENA_SIZES, HyenaDecoderLM

    with torch.device("meta"):
        model = HyenaDecoderLM(dataclasses.replace(HYENA_SIZES["hyena-tiny"], num_layers=1))
    ids = torch.zeros(1, 64, dtype=torch.long, device="meta")
    return model, ((ids,), {"labels": ids})


def dna_one_block() -> tuple[nn.Module, tuple, dict]:
    """A model spec for ``zerofx plan``: the bundled tiny DNA LM with one block (its max_seq_len
    of 512), on the meta device, and a (1, 512) example batch."""
    import dataclasses

    from zerofx.models import DNA_LM_SIZES

    with torch.device("meta"):
        model = DNADecoderLM(dataclasses.replace(DNA_LM_SIZES["tiny"], num_layers=1))
    ids = torch.zeros(1, 512, dtype=torch.long, device="meta")
    return model, ((ids,), {"labels": ids})
