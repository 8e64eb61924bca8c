"""A HyenaDNA-style decoder: attention-free, each block's mixer an order-2 Hyena operator whose
long filter is implicit (an MLP over positions) and applied by FFT, so a block costs
O(T log T) and no T x T score matrix exists. docs/models.md describes it."""

from __future__ import annotations

import torch
import torch.nn as nn

from zerofx.models.dna_lm import DNALMConfig, DNALMOutput, RMSNorm, SwiGLU
from zerofx.models.decoder import GenomicDecoder
from zerofx.models.genomic_sizes import HyenaConfig
from zerofx.models.long_conv import MLPFilter, ShortConv


class HyenaOperator(nn.Module):
    """``y = out(x0 * (h * (x1 * v) + D (x1 * v)))`` with (x0, x1, v) the three streams of the
    input projection after a short causal conv, and h the implicit long filter."""

    def __init__(self, cfg: HyenaConfig) -> None:
        super().__init__()
        self.dim = cfg.dim
        self.in_proj = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.short_conv = ShortConv(3 * cfg.dim, cfg.short_filter_len)
        self.long_filter = MLPFilter(
            cfg.dim, max_seq_len=cfg.max_seq_len, num_bands=cfg.filter_num_bands, hidden=cfg.filter_hidden,
            sine_freq=cfg.filter_sine_freq, decay_target=cfg.decay_target, fast_decay_fraction=cfg.fast_decay_fraction,
            slow_decay_fraction=cfg.slow_decay_fraction,
        )
        self.out_proj = nn.Linear(cfg.dim, cfg.dim)
        self.out_proj.residual_init = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        z = self.short_conv(self.in_proj(x).transpose(1, 2))  # (B, 3d, T)
        x0, x1, v = z.split(self.dim, dim=1)  # 3 x (B, d, T)
        y = x0 * self.long_filter(x1 * v)  # (B, d, T)
        return self.out_proj(y.transpose(1, 2))


class HyenaBlock(nn.Module):
    def __init__(self, cfg: HyenaConfig) -> None:
        super().__init__()
        self.mixer_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mixer = HyenaOperator(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = SwiGLU(DNALMConfig(dim=cfg.dim, ffn_dim=cfg.ffn_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.mixer_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class HyenaDecoderLM(GenomicDecoder):
    """Next-nucleotide prediction. ``forward(input_ids, labels=None) -> DNALMOutput``; with
    ``labels`` the loss is the mean next-token cross-entropy (labels shifted by one inside)."""

    def __init__(self, cfg: HyenaConfig | None = None) -> None:
        cfg = cfg or HyenaConfig()
        super().__init__(cfg, lambda: (HyenaBlock(cfg) for _ in range(cfg.num_layers)))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> DNALMOutput:
        self.check_length(input_ids)
        x = self.embed(input_ids)  # (B, T, d)
        for blk in self.blocks:
            x = blk(x)
        return self.output(x, labels)
