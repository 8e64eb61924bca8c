"""A decoder-only language model over DNA: rotary positions, RMSNorm and SwiGLU, in the family
of current genomic foundation models. Sized by config from tiny (tests) to billions of
parameters (planning, built on the meta device)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerofx.models.sizes import DNA_LM_SIZES, DNALMConfig  # noqa: F401  (re-exported: zerofx.models.dna_lm names them)
from zerofx.common.errors import ZeroFXError


@dataclass
class DNALMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The statistics in fp32: in fp16, eps underflows and rsqrt's gradient overflows.
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, nh, T, hd); rotate pairs (x1, x2) of the two halves
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DNALMConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.out.residual_init = True  # a projection into the residual stream: scaled init

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 3 x (B, nh, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, cfg: DNALMConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.down.residual_init = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: DNALMConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class DNADecoderLM(nn.Module):
    """Next-nucleotide prediction. ``forward(input_ids, labels=None) -> DNALMOutput``; with
    ``labels`` the loss is the mean next-token cross-entropy (labels shifted by one inside)."""

    def __init__(self, cfg: DNALMConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or DNALMConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize every parameter and buffer from the global RNG, module by module."""
        for m in self.modules():
            self._init_weights(m)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Initialize ``module``'s own tensors (not its children's): N(0, 0.02) for linears and
        the embedding, GPT-2's N(0, 0.02 / sqrt(2 L)) for projections into the residual stream,
        ones for RMSNorm, and the rotary tables for the model itself. ``zerofx.initialize``
        calls it one module at a time on a model built on the meta device."""
        std = 0.02
        if isinstance(module, (nn.Linear, nn.Embedding)):
            scaled = getattr(module, "residual_init", False)
            nn.init.normal_(module.weight, std=std / math.sqrt(2 * self.cfg.num_layers) if scaled else std)
        elif isinstance(module, RMSNorm):
            module.reset_parameters()
        elif isinstance(module, DNADecoderLM):
            cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta)
            module.rope_cos.copy_(cos)
            module.rope_sin.copy_(sin)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> DNALMOutput:
        t = input_ids.shape[1]
        if t > self.cfg.max_seq_len:
            raise ZeroFXError(f"sequence length {t} exceeds max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]  # (T, hd/2)
        x = self.embed(input_ids)  # (B, T, d)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        logits = self.head(self.norm(x))  # (B, T, V)
        loss = None
        if labels is not None:
            # In fp32 even when the model runs in 16 bits: the softmax over the vocabulary and the
            # fp16 loss scale both need the range.
            loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return DNALMOutput(loss=loss, logits=logits)
