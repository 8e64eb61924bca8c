"""An Evo 2-style StripedHyena 2 decoder: Hyena blocks of three filter lengths (SE, MR, LI)
with attention blocks striped in, in the order of the config's ``block_pattern``. Each block is
pre-norm residual: a mixer, then a SwiGLU MLP. The attention block is the DNA LM's (causal SDPA,
rotary positions). docs/models.md describes it."""

from __future__ import annotations

import torch
import torch.nn as nn

from zerofx.common.errors import ZeroFXError
from zerofx.models.dna_lm import Block, DNALMConfig, DNALMOutput, RMSNorm, SwiGLU
from zerofx.models.decoder import GenomicDecoder
from zerofx.models.genomic_sizes import BlockKind, StripedHyenaConfig
from zerofx.models.long_conv import ExplicitFilter, ModalFilter, ShortConv

# How far the MR window decays over its length: exp(-2) at the last tap.
MR_DECAY = 2.0


class StripedHyenaOperator(nn.Module):
    """``y = out(q * (h * (k v) + D k v))``: the input projected to three streams (q, k, v), a
    short causal conv on each (Evo 2's featurizer), k gating v, the block's filter h, q gating."""

    def __init__(self, cfg: StripedHyenaConfig, kind: BlockKind) -> None:
        super().__init__()
        self.dim = cfg.dim
        self.in_proj = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.short_conv = ShortConv(3 * cfg.dim, cfg.short_filter_len)
        if kind is BlockKind.SE:
            self.filter: nn.Module = ExplicitFilter(cfg.dim, cfg.se_filter_len, decay=0.0)
        elif kind is BlockKind.MR:
            self.filter = ExplicitFilter(cfg.dim, cfg.mr_filter_len, decay=MR_DECAY)
        else:
            assert kind is BlockKind.LI, kind
            self.filter = ModalFilter(cfg.dim, cfg.li_num_modes, cfg.max_seq_len)
        self.out_proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.out_proj.residual_init = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        z = self.short_conv(self.in_proj(x).transpose(1, 2))  # (B, 3d, T)
        q, k, v = z.split(self.dim, dim=1)  # 3 x (B, d, T)
        y = q * self.filter(k * v)  # (B, d, T)
        return self.out_proj(y.transpose(1, 2))


class HyenaBlock(nn.Module):
    def __init__(self, cfg: StripedHyenaConfig, kind: BlockKind) -> None:
        super().__init__()
        self.kind = kind
        self.mixer_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mixer = StripedHyenaOperator(cfg, kind)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(DNALMConfig(dim=cfg.dim, ffn_dim=cfg.ffn_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def attention_config(cfg: StripedHyenaConfig) -> DNALMConfig:
    """The DNA LM config whose ``Block`` is this model's attention block."""
    return DNALMConfig(vocab_size=cfg.vocab_size, dim=cfg.dim, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                       ffn_dim=cfg.ffn_dim, max_seq_len=cfg.max_seq_len, rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps)


def rope_tables(head_dim: int, seq_len: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary cos and sin tables, (T, hd/2) each, computed in the forward: no buffer of
    max_seq_len rows to hold (or to lose on the meta device) at a million tokens."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


class StripedHyenaLM(GenomicDecoder):
    """Next-nucleotide prediction. ``forward(input_ids, labels=None) -> DNALMOutput``; with
    ``labels`` the loss is the mean next-token cross-entropy (labels shifted by one inside)."""

    def __init__(self, cfg: StripedHyenaConfig | None = None) -> None:
        cfg = cfg or StripedHyenaConfig()
        if cfg.dim % cfg.num_heads or cfg.head_dim % 2:
            raise ZeroFXError(f"dim {cfg.dim} must split into {cfg.num_heads} heads of an even width")
        attn = attention_config(cfg)
        super().__init__(cfg, lambda: (Block(attn) if kind is BlockKind.ATTENTION else HyenaBlock(cfg, kind) for kind in cfg.block_pattern))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> DNALMOutput:
        t = self.check_length(input_ids)
        x = self.embed(input_ids)  # (B, T, d)
        # In the model's dtype, as the DNA LM's tables (buffers) are: fp32 tables would turn a
        # 16-bit model's q and k into fp32 beside a 16-bit v, which SDPA refuses.
        cos, sin = (table.to(x.dtype) for table in rope_tables(self.cfg.head_dim, t, self.cfg.rope_theta, input_ids.device))  # (T, hd/2)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        return self.output(x, labels)
