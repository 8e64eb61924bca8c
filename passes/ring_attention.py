"""Ring attention for sequence parallelism: the custom ops it is made of and the tensor function
``sequence_parallel_pass`` traces in place of each ``scaled_dot_product_attention``.

Used while tracing the pre-autograd forward (NOTE [Sequence parallelism as a rewrite] in
passes/sequence_parallel.py); AOTAutograd differentiates the result, so the backward (reverse
shifts included) comes from the ops' registered autograd formulas. Reads and writes no node meta.

NOTE [Ring attention]
Each rank of a sequence group of S ranks keeps its query slice q: (B, H, T/S, D), and its key and
value slices k, v: (B, Hkv, T/S, D) travel around the group's ring: S - 1 times, every rank sends
the block it holds to rank r + 1 and receives the one of rank r - 1 (``zerofx::ring_shift``: one
``isend``/``irecv`` pair on the sequence group). At step i rank r holds the block of source rank
j = (r - i) mod S and attends to it (``zerofx::ring_block_attention``, FlashAttention's kernel
returning the block's output o_i and log-sum-exp lse_i). The blocks are combined by an online
softmax: with m a running maximum of the lse_i (detached: the result does not depend on it),
``acc = Σ exp(lse_i - m) o_i`` and ``l = Σ exp(lse_i - m)``, and the output is ``acc / l``: the
softmax over all T keys, exactly.

Causal attention (top-left, query t attends keys <= t): block j against own slice r is the
diagonal block at step 0 (j = r, causal within the block), wholly visible when j < r (steps
1..r), and wholly masked when j > r (steps > r). The rank r is a tensor, not a graph constant
(every rank runs the same graph), so masked blocks cannot be skipped by Python control flow:
they are computed unmasked and dropped (weight 0, lse -inf). With contiguous slices this does
not lengthen the step: rank S - 1 sees every block, every shift waits for all ranks, so the step
takes S block computations whichever blocks the others skip. A mask ``attn_mask`` (boolean,
True = attend, or additive) broadcastable to (B, H, T, T) is cut to the rank's query rows and to
the source's key columns of each block (by index, j being a tensor). Rows whose keys are all
masked in a block contribute nothing; a row masked in every block gets output 0, as blocked
attention gives it.

Gradients: the shift's backward is the shift the other way (the gradient of the block rank r - 1
sent goes back to it); the block op's backward takes the gradient of lse too, since the
combination weights depend on it: ∂lse/∂s = p, so ``ds = p ⊙ (dp - Δ) + p ⊙ dlse`` with
``Δ = rowsum(do ⊙ o)``. The first term is FlashAttention's backward; the second is
``dq += scale · dlse · (p k)`` (p k is attention with k as values) and
``dk += scale · pᵀ (dlse ⊙ q)`` (FlashAttention's value gradient for the gradient dlse ⊙ q), so
a block's backward costs two FlashAttention backwards and one forward.

Memory: the exchanges move one block at a time; no rank gathers the sequence's keys and values
into one tensor, and no (T/S) x T score matrix exists. Autograd keeps each step's block for its
backward (the backward of attention over T keys reads all T keys), so the saved activations hold
T keys and values per layer per rank, with q and each step's o_i, lse_i for T/S queries. Communication per attention per rank: S - 1 shifts of k and v, each
rank sending 2 · B · Hkv · T/S · D elements per shift, in the forward, and the same for the
gradients in the backward. The shift is a blocking call: it does not overlap the block's
computation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx

from zerofx.passes import _compat, tiled_kernels  # noqa: F401  (registers zerofx::blocked_attention)
from zerofx.units import format_bytes

Tensor = torch.Tensor


# --------------------------------------------------------------------------- the choice
class SequenceAttention(enum.Enum):
    ULYSSES = "ulysses"
    RING = "ring"
    AUTO = "auto"


@dataclass(frozen=True)
class AttentionShape:
    """One attention as the choice between Ulysses and ring sees it (whole sequence)."""

    batch: int
    seq_len: int
    q_heads: int
    kv_heads: int
    qk_dim: int
    v_dim: int
    itemsize: int
    ulysses_refusal: str | None  # why Ulysses cannot run it, or None


def estimate_exchange_bytes(h: AttentionShape, size: int) -> dict[SequenceAttention, float]:
    """Bytes one rank sends for one attention's forward (the backward sends as many): Ulysses
    sends (S-1)/S of q, k, v (key/value heads repeated to the query heads when S does not divide
    them) and of the output; ring sends its k and v block S - 1 times."""
    token_bytes = h.batch * (h.seq_len // size) * h.itemsize  # per head-dim element, of one rank's slice
    kv_heads = h.kv_heads if h.kv_heads % size == 0 else h.q_heads
    ulysses = (size - 1) / size * token_bytes * (h.q_heads * h.qk_dim + kv_heads * (h.qk_dim + h.v_dim) + h.q_heads * h.v_dim)
    ring = (size - 1) * token_bytes * h.kv_heads * (h.qk_dim + h.v_dim)
    return {SequenceAttention.ULYSSES: ulysses, SequenceAttention.RING: ring}


def choose_attention(heads: list[AttentionShape], size: int) -> tuple[SequenceAttention, str]:
    """``"auto"``: ring where Ulysses cannot run (S does not divide the query heads) or sends
    more bytes; Ulysses on a tie (two collectives per attention instead of 2(S-1) exchanges in a row)."""
    refused = next((h.ulysses_refusal for h in heads if h.ulysses_refusal), None)
    if refused:
        return SequenceAttention.RING, f"sequence parallelism: ring chosen ({refused})"
    sent = {kind: sum(estimate_exchange_bytes(h, size)[kind] for h in heads) for kind in (SequenceAttention.ULYSSES, SequenceAttention.RING)}
    kind = SequenceAttention.RING if sent[SequenceAttention.RING] < sent[SequenceAttention.ULYSSES] else SequenceAttention.ULYSSES
    q, kv = heads[0].q_heads, heads[0].kv_heads
    repeat = f", key/value heads repeated to {q} since {size} does not divide {kv}" if kv % size else ""
    return kind, (f"sequence parallelism: {kind.value} chosen for {q} query heads ({kv} key/value) over {size} ranks: one rank sends "
                  f"{format_bytes(sent[SequenceAttention.ULYSSES])} per forward with ulysses (all-to-all{repeat}), "
                  f"{format_bytes(sent[SequenceAttention.RING])} with ring; a tie goes to ulysses")


# --------------------------------------------------------------------------- the shift
@torch.library.custom_op("zerofx::ring_shift", mutates_args=())
def ring_shift(x: Tensor, group_name: str, reverse: bool) -> Tensor:
    """What rank r - 1 of the group ``group_name`` holds as ``x`` (rank r + 1 when ``reverse``);
    rank r's ``x`` goes to rank r + 1 (r - 1). Every rank of the group calls it together."""
    group = _compat.resolve_group_name(group_name)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    step = -1 if reverse else 1
    x = x.contiguous()
    received = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, dist.get_global_rank(group, (rank + step) % size), group),
           dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - step) % size), group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


@ring_shift.register_fake
def _(x: Tensor, group_name: str, reverse: bool) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _shift_setup(ctx, inputs, output) -> None:
    ctx.group_name, ctx.reverse = inputs[1], inputs[2]


def _shift_backward(ctx, grad: Tensor):
    return torch.ops.zerofx.ring_shift(grad, ctx.group_name, not ctx.reverse), None, None


ring_shift.register_autograd(_shift_backward, setup_context=_shift_setup)


def is_ring_shift(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.zerofx.ring_shift.default


# --------------------------------------------------------------------------- one block
@torch.library.custom_op("zerofx::ring_block_attention", mutates_args=())
def ring_block_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """(out, lse) of q: (B, H, Tq, D) attending to one block k, v: (B, Hkv, Tk, D), Hkv | H;
    ``zerofx::blocked_attention`` with one block (NOTE [Blocked attention] in passes/tiled_kernels.py)."""
    return torch.ops.zerofx.blocked_attention(q, k, v, mask, is_causal, scale, q.size(-2), k.size(-2))


@ring_block_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    return torch.ops.zerofx.blocked_attention(q, k, v, mask, is_causal, scale, q.size(-2), k.size(-2))


@torch.library.custom_op("zerofx::ring_block_attention_backward", mutates_args=())
def ring_block_attention_backward(grad_out: Tensor, grad_lse: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                  mask: Tensor | None, is_causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of ``ring_block_attention`` given the gradients of both its outputs (NOTE [Ring attention])."""
    tq, tk = q.size(-2), k.size(-2)
    backward = torch.ops.zerofx.blocked_attention_backward
    dq, dk, dv = backward(grad_out, q, k, v, out, lse, mask, is_causal, scale, tq, tk)
    g = grad_lse.float().unsqueeze(-1)  # (B, H, Tq, 1)
    p_k, _ = torch.ops.zerofx.blocked_attention(q, k, k, mask, is_causal, scale, tq, tk)  # p k: (B, H, Tq, D)
    # The value gradient of attention with values k and output gradient dlse·q is pᵀ (dlse ⊙ q);
    # ``out`` only enters the query and key gradients, which are not used.
    _, _, dk_lse = backward((g * q.float()).to(q.dtype), q, k, k, p_k, lse, mask, is_causal, scale, tq, tk)
    dq = (dq.float() + scale * g * p_k.float()).to(q.dtype)
    dk = (dk.float() + scale * dk_lse.float()).to(k.dtype)
    return dq, dk, dv


@ring_block_attention_backward.register_fake
def _(grad_out: Tensor, grad_lse: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
      mask: Tensor | None, is_causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _block_setup(ctx, inputs, output) -> None:
    q, k, v, mask, is_causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask)
    ctx.args = (is_causal, scale)


def _block_backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
    q, k, v, out, lse, mask = ctx.saved_tensors
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out
    grad_lse = torch.zeros_like(lse) if grad_lse is None else grad_lse
    dq, dk, dv = torch.ops.zerofx.ring_block_attention_backward(grad_out, grad_lse, q, k, v, out, lse, mask, *ctx.args)
    return dq, dk, dv, None, None, None


ring_block_attention.register_autograd(_block_backward, setup_context=_block_setup)


# --------------------------------------------------------------------------- the ring
def _block_mask(mask: Tensor | None, queries: Tensor, keys: Tensor, seq_len: int) -> Tensor | None:
    """``mask`` (broadcastable to (B, H, T, T)) cut to rows ``queries`` and columns ``keys``."""
    if mask is None:
        return None
    if mask.dim() >= 2 and mask.size(-2) == seq_len:
        mask = torch.index_select(mask, mask.dim() - 2, queries)
    if mask.size(-1) == seq_len:
        mask = torch.index_select(mask, mask.dim() - 1, keys)
    return mask


def ring_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, is_causal: bool, scale: float, rank: Tensor, size: int,
                   group_name: str) -> Tensor:
    """Attention of this rank's queries q: (B, H, T/S, D) over the whole sequence, whose key and
    value slices k, v: (B, Hkv, T/S, D) are spread over the ``size`` ranks of ``group_name``; ``rank``
    is this rank's index in its group as a 0-d integer tensor (NOTE [Ring attention])."""
    local_len = q.size(-2)
    seq_len = local_len * size
    offsets = torch.arange(local_len, dtype=torch.int64, device=q.device)
    queries = offsets + rank * local_len
    acc = l_sum = m = None
    for step in range(size):
        if step:
            k = torch.ops.zerofx.ring_shift(k, group_name, False)  # now source (rank - step) mod S's block
            v = torch.ops.zerofx.ring_shift(v, group_name, False)
        source = torch.remainder(rank - step, size)
        block_mask = _block_mask(mask, queries, offsets + source * local_len, seq_len)
        out, lse = torch.ops.zerofx.ring_block_attention(q, k, v, block_mask, is_causal and step == 0, scale)  # (B, H, T/S, D), (B, H, T/S)
        keep = torch.isfinite(lse)  # a row with every key of the block masked contributes nothing
        if is_causal and step:
            keep = keep & (rank >= step)  # source j < r: wholly visible; j > r: wholly masked
        lse = torch.where(keep, lse, float("-inf"))
        out = torch.where(keep.unsqueeze(-1), out, 0.0).float()
        m_new = lse.detach() if m is None else torch.maximum(m, lse.detach())
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # -inf: no key so far
        weight = torch.exp(lse - m_safe)  # (B, H, T/S)
        if acc is None:
            acc, l_sum = weight.unsqueeze(-1) * out, weight
        else:
            rescale = torch.exp(m - m_safe)
            acc = rescale.unsqueeze(-1) * acc + weight.unsqueeze(-1) * out
            l_sum = rescale * l_sum + weight
        m = m_new
    return (acc / torch.where(l_sum == 0, 1.0, l_sum).unsqueeze(-1)).to(q.dtype)  # (B, H, T/S, D)
