"""A Mamba-1 model, causal (next-token) or bidirectional (Caduceus' BiMamba, masked LM): each
block is RMSNorm and a selective-scan mixer, residual, with no MLP (Mamba's layout). The scan is
``zerofx.models.scan.selective_scan``, chunked (NOTE [Scan chunk length] there).
docs/models.md describes it."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerofx.common.errors import ZeroFXError
from zerofx.models.dna_lm import DNALMOutput, RMSNorm
from zerofx.models.decoder import GenomicDecoder
from zerofx.models.genomic_sizes import MambaConfig
from zerofx.models.long_conv import OwnInit, ShortConv
from zerofx.models.scan import selective_scan


class DeltaProjection(OwnInit, nn.Linear):
    """Mamba's dt projection, with its init: weights U(+-1/sqrt(rank)), and the bias the
    inverse softplus of a step size log-uniform in [dt_min, dt_max], so delta starts there."""

    def __init__(self, rank: int, width: int, dt_min: float, dt_max: float) -> None:
        self.dt_min, self.dt_max = dt_min, dt_max
        super().__init__(rank, width)

    def reset_parameters(self) -> None:
        bound = self.in_features ** -0.5
        nn.init.uniform_(self.weight, -bound, bound)
        with torch.no_grad():
            dt = torch.exp(torch.rand(self.out_features) * (math.log(self.dt_max) - math.log(self.dt_min)) + math.log(self.dt_min))
            self.bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)


class SelectiveSSM(OwnInit, nn.Module):
    """One direction's scan: conv, SiLU, the input-dependent delta, B and C, the diagonal
    A = -exp(A_log) and the skip D. ``forward`` maps the mixer's inner stream (B, T, E) to the
    scan's output (B, T, E)."""

    def __init__(self, cfg: MambaConfig) -> None:
        super().__init__()
        e, n, r = cfg.inner_dim, cfg.state_dim, cfg.delta_rank
        self.state_dim, self.delta_rank, self.chunk_len = n, r, cfg.chunk_len
        self.conv = ShortConv(e, cfg.conv_len)
        self.x_proj = nn.Linear(e, r + 2 * n, bias=False)
        self.dt_proj = DeltaProjection(r, e, cfg.dt_min, cfg.dt_max)
        self.A_log = nn.Parameter(torch.empty(e, n))
        self.D = nn.Parameter(torch.empty(e))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        e, n = self.A_log.shape
        with torch.no_grad():  # S4D-real: A[:, k] = -(k + 1)
            self.A_log.copy_(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).expand(e, n))
        nn.init.ones_(self.D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, E) -> (B, T, E)
        x = F.silu(self.conv(x.transpose(1, 2)).transpose(1, 2))  # (B, T, E)
        dt_raw, b, c = self.x_proj(x).split((self.delta_rank, self.state_dim, self.state_dim), dim=-1)
        delta = F.softplus(self.dt_proj(dt_raw).float())  # (B, T, E), > 0
        a = -torch.exp(self.A_log.float())  # (E, N), < 0
        return selective_scan(x, delta, a, b, c, self.D, chunk_len=self.chunk_len)


class MambaMixer(nn.Module):
    """``out(ssm(x) * silu(z))`` with (x, z) the input projection's two halves. Bidirectional:
    ``out((ssm(x) + flip(ssm_rev(flip(x)))) * silu(z))``, the second scan over the reversed
    sequence, sharing the projections (Caduceus' BiMamba with its in/out weights tied)."""

    def __init__(self, cfg: MambaConfig) -> None:
        super().__init__()
        self.inner_dim = cfg.inner_dim
        self.in_proj = nn.Linear(cfg.dim, 2 * cfg.inner_dim, bias=False)
        self.ssm = SelectiveSSM(cfg)
        self.ssm_rev = SelectiveSSM(cfg) if cfg.bidirectional else None
        self.out_proj = nn.Linear(cfg.inner_dim, cfg.dim, bias=False)
        self.out_proj.residual_init = True

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        x, z = self.in_proj(hidden).split(self.inner_dim, dim=-1)  # 2 x (B, T, E)
        y = self.ssm(x)
        if self.ssm_rev is not None:
            y = y + self.ssm_rev(x.flip(1)).flip(1)
        return self.out_proj(y * F.silu(z))


class MambaBlock(nn.Module):
    def __init__(self, cfg: MambaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mixer = MambaMixer(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))


class MambaLM(GenomicDecoder):
    """``forward(input_ids, labels=None) -> DNALMOutput``. Causal: the loss is the mean
    next-token cross-entropy (labels shifted by one inside). Bidirectional: the masked-LM loss,
    the mean cross-entropy over positions whose label is not -100 (no shift)."""

    def __init__(self, cfg: MambaConfig | None = None) -> None:
        cfg = cfg or MambaConfig()
        if cfg.chunk_len < 1:
            raise ZeroFXError(f"chunk_len {cfg.chunk_len} is invalid; accepted: an integer >= 1")
        super().__init__(cfg, lambda: (MambaBlock(cfg) for _ in range(cfg.num_layers)))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> DNALMOutput:
        self.check_length(input_ids)
        x = self.embed(input_ids)  # (B, T, d)
        for blk in self.blocks:
            x = blk(x)
        return self.output(x, labels)
