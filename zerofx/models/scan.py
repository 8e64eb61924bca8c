"""Mamba-1's selective scan in plain PyTorch, chunk by chunk, as one custom op.

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
- time: the chunks run one after another, T / L of them, each a few kernels.
``chunk_len`` does not change the result (up to rounding): tests/test_genomic_models.py checks
it against a step-by-step scan.

NOTE [The selective scan op]
The scan is one op in the captured graph, ``zerofx::selective_scan(x, delta, a, b, c, d, h0,
chunk_len) -> (y, h_last)``, h0 the state before the first step and h_last the state after the
last, both (B, E, N) in the scan's dtype (fp32 at least). One op, not T / L chunks of ten ops
each, for two reasons:
- memory: autograd saves the op's inputs only, O(B T (E + N)). Its backward,
  ``zerofx::selective_scan_backward``, recomputes: a forward pass keeping only the state at each
  chunk's start (T / L states of (B, E, N)), then the chunks in reverse, each chunk's maths
  (``_chunk``) differentiated by ``torch.func.vjp`` (autograd is off inside an op's kernel) from
  the gradient of y on the chunk and of the state it hands on, which gives the gradient of the
  state it started from, handed on to the chunk before. The peak is one chunk's (B, L, E, N) intermediates and their gradients,
  instead of every chunk's (what the partitioner keeps of an unrolled scan);
- matching: sequence parallelism owns the node whole (passes/mixer_scan.py), and h0 and h_last
  are what it passes between ranks (NOTE [Scan by state passing] there).
The op is pure maths on its inputs (no collective), so opcheck and AOTAutograd see an ordinary
function; the gradients equal those of the unrolled scan up to rounding.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def scan_dtype(x: Tensor) -> torch.dtype:
    """The dtype the scan computes and keeps its state in: x's, and fp32 at least."""
    return torch.promote_types(x.dtype, torch.float32)


def _chunk(x: Tensor, delta: Tensor, a: Tensor, b: Tensor, c: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
    """One chunk in closed form (NOTE [Scan chunk length]): x, delta (B, L, E); a (E, N); b, c
    (B, L, N); h (B, E, N) the state before the chunk; all in the scan's dtype. Returns the
    chunk's C . h[t] (B, L, E) and its last state (B, E, N)."""
    log_decay = torch.cumsum(delta[..., None] * a, dim=1)  # (B, L, E, N), S[t] <= 0
    u = (delta * x)[..., None] * b[:, :, None, :]  # (B, L, E, N)
    states = torch.exp(log_decay) * (h[:, None] + torch.cumsum(torch.exp(-log_decay) * u, dim=1))  # (B, L, E, N)
    return torch.einsum("blen,bln->ble", states, c), states[:, -1]


def _cast(x: Tensor, delta: Tensor, a: Tensor, b: Tensor, c: Tensor) -> tuple[Tensor, ...]:
    dtype = scan_dtype(x)
    return tuple(v.to(dtype) for v in (x, delta, a, b, c))


@torch.library.custom_op("zerofx::selective_scan", mutates_args=())
def selective_scan_op(x: Tensor, delta: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor, h0: Tensor,
                      chunk_len: int) -> tuple[Tensor, Tensor]:
    """(y, h_last) of the scan from state h0 (NOTE [The selective scan op]): y (B, T, E) in x's
    dtype, h_last (B, E, N) in the scan's dtype."""
    x32, delta32, a32, b32, c32 = _cast(x, delta, a, b, c)
    h = h0.to(x32.dtype)
    ys = []
    for start in range(0, x.shape[1], chunk_len):
        part = slice(start, start + chunk_len)
        y, h = _chunk(x32[:, part], delta32[:, part], a32, b32[:, part], c32[:, part], h)
        ys.append(y)
    y = torch.cat(ys, dim=1) + x32 * d.to(x32.dtype)  # (B, T, E)
    return y.to(x.dtype), h.clone()


@selective_scan_op.register_fake
def _(x: Tensor, delta: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor, h0: Tensor, chunk_len: int) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty((x.shape[0], x.shape[2], a.shape[1]), dtype=scan_dtype(x))


@torch.library.custom_op("zerofx::selective_scan_backward", mutates_args=())
def selective_scan_backward(grad_y: Tensor, grad_h_last: Tensor, x: Tensor, delta: Tensor, a: Tensor, b: Tensor, c: Tensor,
                            d: Tensor, h0: Tensor, chunk_len: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of ``selective_scan`` for x, delta, a, b, c, d and h0, chunk by chunk in
    reverse from the recomputed chunk-start states (NOTE [The selective scan op])."""
    x32, delta32, a32, b32, c32 = _cast(x, delta, a, b, c)
    gy32 = grad_y.to(x32.dtype)
    t = x.shape[1]
    starts = list(range(0, t, chunk_len))
    h = h0.to(x32.dtype)
    entry = []  # the state before each chunk: (B, E, N) each
    with torch.no_grad():
        for start in starts:
            entry.append(h)
            part = slice(start, start + chunk_len)
            _, h = _chunk(x32[:, part], delta32[:, part], a32, b32[:, part], c32[:, part], h)
    gx, gdelta, gb, gc = (torch.empty_like(v) for v in (x32, delta32, b32, c32))
    ga = torch.zeros_like(a32)
    gh = grad_h_last.to(x32.dtype)
    for start, h_in in zip(reversed(starts), reversed(entry)):
        part = slice(start, start + chunk_len)
        # torch.func.vjp, not torch.autograd.grad: inside an op's kernel the dispatcher runs below autograd.
        _, vjp = torch.func.vjp(_chunk, x32[:, part], delta32[:, part], a32, b32[:, part], c32[:, part], h_in)
        g = vjp((gy32[:, part], gh))
        gx[:, part], gdelta[:, part], gb[:, part], gc[:, part] = g[0], g[1], g[3], g[4]
        ga += g[2]
        gh = g[5]
    d32 = d.to(x32.dtype)
    gx += gy32 * d32  # the skip D x
    gd = (gy32 * x32).sum(dim=(0, 1))  # (E,)
    return (gx.to(x.dtype), gdelta.to(delta.dtype), ga.to(a.dtype), gb.to(b.dtype), gc.to(c.dtype), gd.to(d.dtype),
            gh.to(h0.dtype))


@selective_scan_backward.register_fake
def _(grad_y: Tensor, grad_h_last: Tensor, x: Tensor, delta: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor, h0: Tensor,
      chunk_len: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    return tuple(v.new_empty(v.shape) for v in (x, delta, a, b, c, d, h0))


def _setup(ctx, inputs, output) -> None:
    *tensors, chunk_len = inputs
    ctx.save_for_backward(*tensors)  # the inputs only: O(B T (E + N)), the states are recomputed
    ctx.chunk_len = chunk_len


def _backward(ctx, grad_y: Tensor | None, grad_h_last: Tensor | None):
    x, delta, a, b, c, d, h0 = ctx.saved_tensors
    if grad_y is None:
        grad_y = torch.zeros_like(x)
    if grad_h_last is None:
        grad_h_last = torch.zeros_like(h0)
    grads = torch.ops.zerofx.selective_scan_backward(grad_y, grad_h_last, x, delta, a, b, c, d, h0, ctx.chunk_len)
    return (*grads, None)


selective_scan_op.register_autograd(_backward, setup_context=_setup)


def selective_scan_with_state(x: Tensor, delta: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor, h0: Tensor | None = None, *,
                              chunk_len: int) -> tuple[Tensor, Tensor]:
    """(y, h_last): the scan from state h0 (B, E, N) (zero when None), one ``zerofx::selective_scan`` op."""
    assert chunk_len >= 1, chunk_len
    if h0 is None:
        h0 = torch.zeros((x.shape[0], x.shape[2], a.shape[1]), dtype=scan_dtype(x), device=x.device)  # (B, E, N)
    return torch.ops.zerofx.selective_scan(x, delta, a, b, c, d, h0, chunk_len)


def selective_scan(x: Tensor, delta: Tensor, a: Tensor, b: Tensor, c: Tensor, d: Tensor, *, chunk_len: int) -> Tensor:
    """x, delta: (B, T, E); a: (E, N), negative; b, c: (B, T, N); d: (E,). Returns y (B, T, E)
    in x's dtype, the state starting at zero (NOTE [Scan chunk length], NOTE [The selective scan op])."""
    y, _ = selective_scan_with_state(x, delta, a, b, c, d, chunk_len=chunk_len)
    return y
