"""Mamba-1's selective scan in plain PyTorch, chunk by chunk, as one custom op.

    h[t] = exp(delta[t] A) h[t-1] + delta[t] B[t] x[t]        h: (E, N) per sequence
    y[t] = C[t] . h[t] + D x[t]

NOTE [Scan chunk length]
The sequence is cut into chunks of ``chunk_len`` steps (the last one shorter when it does not
divide T) and the chunks run one after another, carrying the state h (B, E, N) from each to the
next. Inside a chunk the recurrence is solved in closed form: with S[t] = sum_{s <= t} delta[s] A
(the log of the decay from the chunk's start, <= 0),

    h[t] = exp(S[t]) h[start] + sum_{s <= t} exp(S[t] - S[s]) delta[s] B[s] x[s]

and every exponent there is <= 0, whatever delta and A are. Two forms compute it:
- the cumulative form, ``exp(S[t]) (h[start] + cumsum_s(exp(-S[s]) u[s]))``: a handful of
  (B, L, E, N) elementwise ops and two ``cumsum``s, O(B E N L) memory. It splits
  exp(S[t] - S[s]) into exp(S[t]) exp(-S[s]), and exp(-S) overflows fp32 past exp(88.7), so it
  runs only on a chunk whose decay range, max |S| = max over (B, E) of max_n |A| · sum delta,
  is at most ``CUMULATIVE_LOG_RANGE`` (60: exp(60) ~ 1e26 leaves 12 orders of magnitude of
  fp32's range for the sum of a chunk's u). With Mamba's init (delta <= 0.1, |A| <= N = 16)
  one step is at most 1.6, so every chunk of 32 steps takes this form;
- the segment-sum form, as Mamba-2's SSD writes it: the exponents S[t] - S[s] as (B, L, L, E, N)
  sums of delta A over s < r <= t (masked cumsums, so no difference of large numbers loses
  precision), -inf above the diagonal. It never overflows, and costs L times the memory and
  compute of the cumulative form; it runs on the chunks whose range is past the bound (a
  trained checkpoint whose deltas grew to several units, where one step alone can decay by
  exp(-100)).
The form is chosen per chunk from the data, once per call (one reduction of delta over T, then
one read of the T / L ranges), in the forward and again in the backward's recomputation, which
therefore takes the same forms. The scan runs in fp32 whatever the model's dtype. The chunks run
one after another, T / L of them, each a few kernels: the time bound on L.
``chunk_len`` does not change the result (up to rounding): tests/test_genomic_models.py checks
it against a step-by-step scan, for small deltas and for deltas past the cumulative form's range.

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
- matching: sequence parallelism owns the node whole (passes/sequence/mixer_scan.py), and h0 and h_last
  are what it passes between ranks (NOTE [Scan by state passing] there).
The op is pure maths on its inputs (no collective), so opcheck and AOTAutograd see an ordinary
function; the gradients equal those of the unrolled scan up to rounding.
"""

from __future__ import annotations

import functools

import torch

Tensor = torch.Tensor


def scan_dtype(x: Tensor) -> torch.dtype:
    """The dtype the scan computes and keeps its state in: x's, and fp32 at least."""
    return torch.promote_types(x.dtype, torch.float32)


CUMULATIVE_LOG_RANGE = 60.0  # NOTE [Scan chunk length]: the largest decay range the cumulative form takes


def _chunk(x: Tensor, delta: Tensor, a: Tensor, b: Tensor, c: Tensor, h: Tensor, segsum: bool = False) -> tuple[Tensor, Tensor]:
    """One chunk in closed form (NOTE [Scan chunk length]): x, delta (B, L, E); a (E, N); b, c
    (B, L, N); h (B, E, N) the state before the chunk; all in the scan's dtype. ``segsum``: the
    segment-sum form, finite for any decay. Returns the chunk's C . h[t] (B, L, E) and its last
    state (B, E, N)."""
    da = delta[..., None] * a  # (B, L, E, N), <= 0
    log_decay = torch.cumsum(da, dim=1)  # (B, L, E, N), S[t] <= 0
    u = (delta * x)[..., None] * b[:, :, None, :]  # (B, L, E, N)
    if segsum:
        length = x.shape[1]
        after = torch.ones(length, length, dtype=torch.bool, device=x.device).tril(-1)  # (L_r, L_s): r > s
        seg = torch.cumsum(da[:, :, None] * after[None, :, :, None, None], dim=1)  # (B, L_t, L_s, E, N): S[t] - S[s]
        seg = seg.masked_fill(after.T[None, :, :, None, None], float("-inf"))  # s > t: no contribution
        states = torch.exp(log_decay) * h[:, None] + (torch.exp(seg) * u[:, None]).sum(dim=2)  # (B, L, E, N)
    else:
        states = torch.exp(log_decay) * (h[:, None] + torch.cumsum(torch.exp(-log_decay) * u, dim=1))  # (B, L, E, N)
    return torch.einsum("blen,bln->ble", states, c), states[:, -1]


def _segsum_chunks(delta: Tensor, a: Tensor, chunk_len: int) -> list[bool]:
    """For each chunk, whether its decay range is past the cumulative form's (NOTE [Scan chunk
    length]): max over (B, E) of max_n |A| times the chunk's sum of delta. One read of T / L values."""
    bsz, t, e = delta.shape
    rate = delta * a.abs().amax(dim=1)  # (B, T, E): the fastest decay of each channel per step
    pad = -t % chunk_len
    rate = torch.nn.functional.pad(rate, (0, 0, 0, pad)).view(bsz, -1, chunk_len, e)  # (B, T/L, L, E)
    ranges = rate.sum(dim=2).amax(dim=(0, 2))  # (T/L,)
    return (~(ranges <= CUMULATIVE_LOG_RANGE)).tolist()  # NaN deltas take the segment-sum form too


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
    forms = _segsum_chunks(delta32, a32, chunk_len)
    for start, segsum in zip(range(0, x.shape[1], chunk_len), forms):
        part = slice(start, start + chunk_len)
        y, h = _chunk(x32[:, part], delta32[:, part], a32, b32[:, part], c32[:, part], h, segsum)
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
    forms = _segsum_chunks(delta32, a32, chunk_len)  # the forward's forms, from the same delta
    h = h0.to(x32.dtype)
    entry = []  # the state before each chunk: (B, E, N) each
    with torch.no_grad():
        for start, segsum in zip(starts, forms):
            entry.append(h)
            part = slice(start, start + chunk_len)
            _, h = _chunk(x32[:, part], delta32[:, part], a32, b32[:, part], c32[:, part], h, segsum)
    gx, gdelta, gb, gc = (torch.empty_like(v) for v in (x32, delta32, b32, c32))
    ga = torch.zeros_like(a32)
    gh = grad_h_last.to(x32.dtype)
    for start, h_in, segsum in zip(reversed(starts), reversed(entry), reversed(forms)):
        part = slice(start, start + chunk_len)
        # torch.func.vjp, not torch.autograd.grad: inside an op's kernel the dispatcher runs below autograd.
        _, vjp = torch.func.vjp(functools.partial(_chunk, segsum=segsum), x32[:, part], delta32[:, part], a32, b32[:, part],
                                c32[:, part], h_in)
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
