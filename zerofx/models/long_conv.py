"""The convolutions and filters the Hyena models share: a causal depthwise conv applied
directly (short and medium filters) or by FFT (long filters), the featurizer conv, the two
implicit long filters (HyenaDNA's MLP over positions, Evo 2's sum of decaying exponentials), and
the init and loss the genomic models have in common.

Shapes: ``(B, C, T)`` for a signal (channels before time, as ``conv1d`` takes it), ``(C, K)``
for a filter indexed by lag: ``y[t] = sum_s h[s] u[t - s]``.

Under ``make_fx`` (pre-dispatch, what zerofx's capture records) a direct conv is one
``aten.conv1d`` after an ``aten.pad`` of K - 1 zeros on the left; an FFT conv is
``aten.fft_rfft`` of the signal and the filter, a complex ``aten.mul``, ``aten.fft_irfft`` and
a slice to the first T outputs.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerofx.models.dna_lm import RMSNorm


def causal_depthwise_conv(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``y[b, c, t] = sum_{s < K} h[c, s] u[b, c, t - s]`` (zero before the start), directly.
    u: (B, C, T); h: (C, K) by lag. The output is (B, C, T), in u's dtype."""
    k = h.shape[-1]
    # conv1d correlates (weight index j meets u[t - K + 1 + j]), so the lag-0 tap goes last.
    weight = h.flip(-1).unsqueeze(1).to(u.dtype)  # (C, 1, K)
    return F.conv1d(F.pad(u, (k - 1, 0)), weight, groups=u.shape[1])


def fft_causal_conv(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """The same causal convolution by FFT, for filters as long as the sequence: u (B, C, T),
    h (C, L) by lag with L <= T (a longer filter is cut to T). Both are zero-padded to 2T, so
    the circular convolution the FFT computes equals the linear one on the first T outputs and
    nothing wraps from the end to the start. Computed in fp32 at least (the FFT has no 16-bit
    CPU kernel, and its sums need the range); returned in u's dtype."""
    t = u.shape[-1]
    h = h[..., :t]
    dtype = torch.promote_types(u.dtype, torch.float32)
    n = 2 * t
    u_f = torch.fft.rfft(u.to(dtype), n=n)  # (B, C, T + 1) complex
    h_f = torch.fft.rfft(h.to(dtype), n=n)  # (C, T + 1) complex
    y = torch.fft.irfft(u_f * h_f, n=n)[..., :t]  # (B, C, T)
    return y.to(u.dtype)


class OwnInit:
    """A module whose ``reset_parameters()`` sets all of its own direct tensors (and only them):
    ``init_genomic_module`` calls it (NOTE [The init scheme] in zerofx/compiler/materialize.py)."""

    def reset_parameters(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError


class ShortConv(OwnInit, nn.Module):
    """The featurizer: a depthwise causal conv with a bias, ``nn.Conv1d(groups=C)``'s init."""

    def __init__(self, channels: int, length: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, length))  # (C, K) by lag
        self.bias = nn.Parameter(torch.empty(channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.weight.shape[1])  # Conv1d's bound: fan-in is K for a depthwise conv
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, u: torch.Tensor) -> torch.Tensor:  # (B, C, T) -> (B, C, T)
        return causal_depthwise_conv(u, self.weight) + self.bias.to(u.dtype)[:, None]


def filter_dtype(param: torch.Tensor) -> torch.dtype:
    """The dtype a filter is computed in: its parameters', and fp32 at least."""
    return torch.promote_types(param.dtype, torch.float32)


def positions(seq_len: int, scale: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Token offsets 0..seq_len-1 divided by ``scale`` (a config's max_seq_len): (T,).
    Normalizing by the config, not by T, makes a filter's tap s the same whatever T is."""
    return torch.arange(seq_len, dtype=dtype, device=device) / scale


class Sine(OwnInit, nn.Module):
    """``sin(freq * x)``, the implicit filter's activation, with a learned frequency per unit."""

    def __init__(self, width: int, freq: float) -> None:
        super().__init__()
        self.init_freq = freq
        self.freq = nn.Parameter(torch.empty(1, width))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.freq, self.init_freq)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.freq * x)


class MLPFilter(OwnInit, nn.Module):
    """HyenaDNA's implicit filter: an MLP with sine activations over positional features
    ``[t, cos(2 pi f t), sin(2 pi f t)]``, times an exponential window that decays each channel
    at its own rate, plus a skip ``D``: ``y = (h * u) + D u``."""

    def __init__(self, channels: int, *, max_seq_len: int, num_bands: int, hidden: int, sine_freq: float,
                 decay_target: float, fast_decay_fraction: float, slow_decay_fraction: float) -> None:
        super().__init__()
        self.max_seq_len, self.num_bands = max_seq_len, num_bands
        # The window's rates: the fastest channel reaches decay_target at fast_decay_fraction of
        # the context, the slowest at slow_decay_fraction (positions are in units of the context).
        self.fast_rate = -math.log(decay_target) / fast_decay_fraction
        self.slow_rate = -math.log(decay_target) / slow_decay_fraction
        features = 1 + 2 * num_bands
        self.mlp = nn.Sequential(
            nn.Linear(features, hidden), Sine(hidden, sine_freq),
            nn.Linear(hidden, hidden), Sine(hidden, sine_freq),
            nn.Linear(hidden, channels, bias=False),
        )
        self.skip = nn.Parameter(torch.empty(channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.skip)

    def filter(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """The long filter, (C, T) by lag, in fp32 at least."""
        dtype = filter_dtype(self.skip)
        t = positions(seq_len, self.max_seq_len, dtype, device)[:, None]  # (T, 1)
        bands = torch.arange(1, self.num_bands + 1, dtype=dtype, device=device)  # (F,)
        angle = 2 * math.pi * t * bands  # (T, F)
        z = torch.cat((t, angle.cos(), angle.sin()), dim=-1)  # (T, 1 + 2F)
        h = self.mlp(z.to(self.skip.dtype)).to(dtype)  # (T, C)
        rates = torch.linspace(self.slow_rate, self.fast_rate, h.shape[-1], dtype=dtype, device=device)  # (C,)
        return (h * torch.exp(-t * rates)).transpose(0, 1)  # (C, T)

    def forward(self, u: torch.Tensor) -> torch.Tensor:  # (B, C, T) -> (B, C, T)
        h = self.filter(u.shape[-1], u.device)
        return fft_causal_conv(u, h) + u * self.skip.to(u.dtype)[:, None]


class ModalFilter(OwnInit, nn.Module):
    """Evo 2's Hyena-LI filter: per channel a sum of decaying real exponentials,
    ``h[c, s] = sum_n R[c, n] r[c, n] exp(-r[c, n] s)`` with rates ``r = exp(log_rate)`` > 0, so
    each mode carries mass R whatever its rate; applied by FFT, plus a skip ``D``."""

    def __init__(self, channels: int, num_modes: int, max_seq_len: int) -> None:
        super().__init__()
        self.max_seq_len = max_seq_len
        self.residue = nn.Parameter(torch.empty(channels, num_modes))
        self.log_rate = nn.Parameter(torch.empty(channels, num_modes))
        self.skip = nn.Parameter(torch.empty(channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        c, n = self.log_rate.shape
        nn.init.normal_(self.residue, std=1.0 / math.sqrt(n))
        # Memories from one token to the whole context: rates log-spaced in [1 / max_seq_len, 1].
        lo, hi = -math.log(self.max_seq_len), 0.0
        with torch.no_grad():
            self.log_rate.copy_(lo + (hi - lo) * torch.rand(c, n))
        nn.init.normal_(self.skip)

    def filter(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """The long filter, (C, T) by lag, in fp32 at least. Memory: C x modes x T for the terms."""
        dtype = filter_dtype(self.log_rate)
        s = torch.arange(seq_len, dtype=dtype, device=device)  # (T,)
        rate = self.log_rate.to(dtype).exp()[..., None]  # (C, N, 1)
        terms = self.residue.to(dtype)[..., None] * rate * torch.exp(-rate * s)  # (C, N, T)
        return terms.sum(1)  # (C, T)

    def forward(self, u: torch.Tensor) -> torch.Tensor:  # (B, C, T) -> (B, C, T)
        return fft_causal_conv(u, self.filter(u.shape[-1], u.device)) + u * self.skip.to(u.dtype)[:, None]


class ExplicitFilter(OwnInit, nn.Module):
    """Evo 2's Hyena-SE and -MR filters: K learned taps per channel, applied directly. With a
    ``decay`` > 0 (MR) the taps are windowed by ``exp(-decay s / K)``, which keeps the far taps
    small as Evo 2's MR regularization does; plus a skip ``D``."""

    def __init__(self, channels: int, length: int, decay: float) -> None:
        super().__init__()
        self.decay = decay
        self.taps = nn.Parameter(torch.empty(channels, length))  # (C, K) by lag
        self.skip = nn.Parameter(torch.empty(channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.taps, std=1.0 / math.sqrt(self.taps.shape[1]))
        nn.init.normal_(self.skip)

    def forward(self, u: torch.Tensor) -> torch.Tensor:  # (B, C, T) -> (B, C, T)
        h = self.taps
        if self.decay > 0:
            k = h.shape[-1]
            h = h * torch.exp(-self.decay * torch.arange(k, dtype=h.dtype, device=h.device) / k)
        return causal_depthwise_conv(u, h) + u * self.skip.to(u.dtype)[:, None]


@torch.no_grad()
def init_genomic_module(module: nn.Module, num_layers: int) -> None:
    """Initialize ``module``'s own tensors (not its children's), as the DNA LM does: modules
    with ``OwnInit`` by their ``reset_parameters()``, then N(0, 0.02) for linears and embeddings
    (GPT-2's 0.02 / sqrt(2 L) for those marked ``residual_init``; zero biases) and ones for
    RMSNorm. The root models call it from ``_init_weights``, which ``zerofx.initialize`` calls
    one module at a time on a model built on the meta device."""
    std = 0.02
    if isinstance(module, OwnInit):
        module.reset_parameters()
    elif isinstance(module, (nn.Linear, nn.Embedding)):
        scaled = getattr(module, "residual_init", False)
        nn.init.normal_(module.weight, std=std / math.sqrt(2 * num_layers) if scaled else std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, RMSNorm):
        module.reset_parameters()


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """The mean cross-entropy in fp32: of the next token for a causal model (labels shifted by
    one inside, as the DNA LM does), of the token itself for a masked LM (labels -100 where
    nothing was masked, as ``zerofx.data.mlm`` makes them)."""
    if causal:
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
