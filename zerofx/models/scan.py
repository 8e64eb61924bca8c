"""Mamba-1's selective scan in plain PyTorch, chunk by chunk.

    h[t] = exp(delta[t] A) h[t-1] + delta[t] B[t] x[t]        h: (E, N) per sequence
    y[t] = C[t] . h[t] + D x[t]

NOTE [Scan chunk length]
The sequence is cut into chunks of ``chunk_len`` steps (the last one shorter when it does not
divide T) and the chunks run one after another, carrying the state h (B, E, N) from each to the
next. Inside a chunk the recurrence is solved in closed form by cumulative sums: with
S[t] = sum_{s <= t} delta[s] A (the log of the decay from the chunk's start, <= 0),

    h[t] = exp(S[t]) (h[start] + sum_{s <= t} exp(-S[s]) delta[s] B[s] x[s])

so a chunk is a handful of (B, L, E, N) elementwise ops and two ``cumsum``s, and the working
set is O(B E N L), not the O(B E N T) of materializing every state at once: at T = 1M the
scan's intermediates are those of one chunk. Two things bound L:
- range: exp(-S) grows along the chunk by exp(delta |A|) per step, and overflows fp32 past
  exp(88); with Mamba's init (delta <= 0.1, |A| <= N = 16) one step is at most exp(1.6), so 32
  steps stay below exp(52). The scan runs in fp32 whatever the model's dtype;
- graph size: capture unrolls the loop over chunks, T / L iterations of about ten ops each.
What autograd saves for backward is the partitioner's choice; it may keep a chunk's
(B, L, E, N) intermediates for every chunk. ``chunk_len`` does not change the result (up to
rounding): tests/test_genomic_models.py checks it against a step-by-step scan.

Under ``make_fx`` (pre-dispatch) a chunk is ``aten.slice`` of the inputs, ``aten.mul``,
``aten.cumsum`` (twice), ``aten.exp`` (twice), ``aten.add``, an ``aten.einsum`` for C . h
and an ``aten.select`` of the last state; the chunks' outputs meet in one ``aten.cat``. After
the compile the einsum is an ``aten.bmm``, and a cumsum's backward is flip, cumsum, flip.
"""

from __future__ import annotations

import torch


def selective_scan(x: torch.Tensor, delta: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   d: torch.Tensor, *, chunk_len: int) -> torch.Tensor:
    """x, delta: (B, T, E); a: (E, N), negative; b, c: (B, T, N); d: (E,). Returns y (B, T, E)
    in x's dtype, the state starting at zero (NOTE [Scan chunk length])."""
    assert chunk_len >= 1, chunk_len
    bsz, t, e = x.shape
    n = a.shape[1]
    dtype = torch.promote_types(x.dtype, torch.float32)
    x32, delta32, a32, b32, c32 = (v.to(dtype) for v in (x, delta, a, b, c))
    h = x32.new_zeros(bsz, e, n)  # (B, E, N)
    ys = []
    for start in range(0, t, chunk_len):
        stop = min(start + chunk_len, t)
        dt = delta32[:, start:stop]  # (B, L, E)
        log_decay = torch.cumsum(dt[..., None] * a32, dim=1)  # (B, L, E, N), S[t] <= 0
        u = (dt * x32[:, start:stop])[..., None] * b32[:, start:stop, None, :]  # (B, L, E, N)
        states = torch.exp(log_decay) * (h[:, None] + torch.cumsum(torch.exp(-log_decay) * u, dim=1))  # (B, L, E, N)
        ys.append(torch.einsum("blen,bln->ble", states, c32[:, start:stop]))  # (B, L, E)
        h = states[:, -1]
    y = torch.cat(ys, dim=1) + x32 * d.to(dtype)  # (B, T, E)
    return y.to(x.dtype)
