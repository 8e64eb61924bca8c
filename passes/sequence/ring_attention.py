"""Ring attention for sequence parallelism: the custom op the attention mixer (passes/sequence/mixer_attention.py)
traces in place of each ``scaled_dot_product_attention`` under the ``"ring"`` strategy, the
sequence layout it reads, and what the schedule reads off it.

Used while tracing the pre-autograd forward (NOTE [Sequence parallelism as a rewrite] in
passes/sequence/sequence_parallel.py); AOTAutograd differentiates the result, and the op's registered
autograd formula gives its backward: one ``zerofx::ring_attention_backward`` op. Reads and writes
no node meta.

NOTE [Ring attention]
Each rank r of a sequence group of S ranks keeps its query slice q: (B, H, T/S, D), and its key
and value slices k, v: (B, Hkv, T/S, D) travel around the group's ring inside one custom op,
``zerofx::ring_attention(q, k, v, mask, is_causal, scale, group_name, S, zigzag) -> (out, lse)``. At step
i (0 <= i < S) rank r holds the block of source rank j = (r - i) mod S; for i < S - 1 it posts the
send of that block to rank r + 1 and the receive of the next from rank r - 1 (``isend``/``irecv``
through ``batch_isend_irecv`` on the group registered under ``group_name``), attends to the block
while they are in flight (``zerofx::blocked_attention``, FlashAttention's kernel returning the
block's output o_j and log-sum-exp lse_j), then waits. The blocks are combined by an online
softmax in fp32: ``lse = logaddexp(lse, lse_j)`` and ``acc = exp(lse_old - lse) acc + exp(lse_j - lse) o_j``;
the output is ``acc``, the softmax over all T keys exactly, and the op also returns lse, the
log-sum-exp over all T keys (+inf for a query that attends to no key; lse gets no gradient).

Causal attention (top-left, query t attends keys <= t): with contiguous slices, block j against
own slice r is the diagonal block at step 0 (j = r, causal within the block), wholly visible
when j < r, and wholly masked when j > r; in the zigzag layout each step attends half a block
(``_blocks``, NOTE [Zigzag layout for causal rings] in passes/sequence/sequence_parallel.py). Inside the
op the rank is a Python int, so a masked block is not computed; it is still received and passed
on, so every rank sends and receives at every step and the pattern stays symmetric. A mask
``attn_mask`` (boolean, True = attend, or additive) broadcastable to (B, H, T, T) is cut to the
positions of the rank's query rows and of the source's key columns of each block. Rows whose keys are all masked in a block
contribute nothing; a row masked in every block gets output 0, as blocked attention gives it.
Grouped-query heads (Hkv | H) pass to the kernel as they are; key/value heads are repeated
only inside it.

Backward (``zerofx::ring_attention_backward``): with the global out and lse, the FlashAttention
backward of one block (``zerofx::blocked_attention_backward``: ``p = exp(s - lse)``,
``Δ = rowsum(do ⊙ out)``) is exactly that block's share of dq, dk_j and dv_j. So k and v travel
the ring again, S - 1 sends as in the forward, and each block's dk, dv accumulator (fp32)
travels one step behind it: at step i rank r adds its share to the accumulator that arrived for
block j (posted by rank r - 1 at step i - 1, received while this step's block was computed)
and posts it on to rank r + 1, which holds block j at step i + 1. After S steps, S sends of the
accumulators, each has visited every rank and is back on the rank that owns the block. dq
accumulates locally in fp32. Masked causal blocks are skipped here too; their accumulators are
passed on unchanged.

Memory: autograd saves only the op's inputs and outputs: q, this rank's k and v, out, lse and
the mask, so per attention and rank the saved activations hold T/S keys, values and queries
(the whole mask, when there is one, comes from the inputs). Transient inside the op: the
block in flight (a second k and v block) and, in the backward, two fp32 key/value
accumulators; no rank gathers the sequence's keys and values, and no (T/S) x T score matrix
exists. Communication per attention and rank: the forward sends k and v S - 1 times (2 · B ·
Hkv · T/S · D elements each time); the backward sends k and v S - 1 times and their fp32
gradients S times. ``ring_exchanges`` lists those sends for the schedule (NOTE [The overlap
model] in passes/analysis/analyze_schedule.py); ``ring_exchange_bytes`` in cost_models/sequence.py counts them for ``"auto"``
(``choose_attention`` in passes/sequence/mixer_attention.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from zerofx.passes import _compat, tiled_kernels  # noqa: F401  (registers zerofx::blocked_attention)

Tensor = torch.Tensor


# --------------------------------------------------------------------------- the ring
def zigzag_chunks(rank: Tensor | int, size: int) -> tuple[Tensor | int, Tensor | int]:
    """The two chunks of 2·S equal chunks of the sequence that rank r holds under the zigzag
    layout, in order: r and 2S - 1 - r (NOTE [Zigzag layout for causal rings])."""
    return rank, 2 * size - 1 - rank


def rank_positions(rank: Tensor | int, size: int, local_len: int, zigzag: bool, device: torch.device) -> Tensor:
    """The sequence positions rank ``rank`` (an int, or a 0-d tensor inside a traced graph) holds,
    in local order: one contiguous slice, or the zigzag layout's two chunks. The one definition
    of the layout: the sequence-parallel rewrite cuts its sources by it, the ring op its masks."""
    if not zigzag:
        return torch.arange(local_len, dtype=torch.int64, device=device) + rank * local_len
    half = local_len // 2
    within = torch.arange(half, dtype=torch.int64, device=device)
    return torch.cat([within + chunk * half for chunk in zigzag_chunks(rank, size)])


def _blocks(rank: int, source: int, local_len: int, is_causal: bool, zigzag: bool) -> list[tuple[slice, slice, bool]]:
    """The (query rows, key rows, causal within) pairs of this rank's slice against ``source``'s
    that attend to anything, in local positions (NOTE [Ring attention], NOTE [Zigzag layout for
    causal rings]). The own block is causal within; the others are wholly visible or skipped."""
    whole = slice(0, local_len)
    if not is_causal:
        return [(whole, whole, False)]
    if source == rank:
        return [(whole, whole, True)]  # positions ascend in local order in both layouts
    if not zigzag:
        return [(whole, whole, False)] if source < rank else []
    half = local_len // 2
    if source < rank:  # both of this rank's chunks come after the source's first chunk, before its second
        return [(whole, slice(0, half), False)]
    return [(slice(half, local_len), whole, False)]  # only this rank's second chunk comes after both of the source's


def _block_mask(mask: Tensor | None, rows: Tensor, cols: Tensor, seq_len: int) -> Tensor | None:
    """``mask`` (broadcastable to (B, H, T, T)) cut to the query positions ``rows`` and key positions ``cols``."""
    if mask is None:
        return None
    if mask.dim() >= 2 and mask.size(-2) == seq_len:
        mask = mask.index_select(-2, rows.to(mask.device))
    if mask.size(-1) == seq_len:
        mask = mask.index_select(-1, cols.to(mask.device))
    return mask


class _Exchange:
    """Tensors sent to rank r + 1 of the ring and received from rank r - 1, in flight."""

    def __init__(self, tensors: list[Tensor], group: dist.ProcessGroup, tag: int) -> None:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        after, before = dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)
        self.received = [torch.empty_like(x, memory_format=torch.contiguous_format) for x in tensors]
        self.sent = [x.contiguous() for x in tensors]  # held until the sends complete
        ops = [dist.P2POp(dist.isend, x, after, group, tag + i) for i, x in enumerate(self.sent)]
        ops += [dist.P2POp(dist.irecv, y, before, group, tag + i) for i, y in enumerate(self.received)]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[Tensor]:
        for work in self.works:
            work.wait()
        return self.received


def _group(group_name: str, size: int) -> tuple[dist.ProcessGroup, int]:
    group = _compat.resolve_group_name(group_name)
    actual = dist.get_world_size(group)
    assert actual == size, f"ring attention planned for {size} ranks runs on group {group_name!r} of {actual}"
    return group, dist.get_rank(group)


@torch.library.custom_op("zerofx::ring_attention", mutates_args=())
def ring_attention_op(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float, group_name: str,
                      size: int, zigzag: bool) -> tuple[Tensor, Tensor]:
    """(out, lse) of this rank's queries q: (B, H, T/S, D) over the whole sequence, whose key and
    value slices k, v: (B, Hkv, T/S, D) are spread over the ``size`` ranks of ``group_name``
    (NOTE [Ring attention]); ``zigzag``: each rank holds the chunks of ``zigzag_chunks``, else
    one contiguous slice. lse: (B, H, T/S) fp32, +inf for a query that attends to no key."""
    group, rank = _group(group_name, size)
    local_len = q.size(-2)
    rows = rank_positions(rank, size, local_len, zigzag, q.device)
    acc = torch.zeros((*q.shape[:-1], v.size(-1)), dtype=torch.float32, device=q.device)  # Σ exp(lse_i - lse) o_i
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    block = [k, v]
    for step in range(size):
        exchange = _Exchange(block, group, 0) if step < size - 1 else None  # the next block arrives while this one is used
        source = (rank - step) % size
        cols = rank_positions(source, size, local_len, zigzag, q.device)
        for qs, ks, causal in _blocks(rank, source, local_len, is_causal, zigzag):
            mask_j = _block_mask(mask, rows[qs], cols[ks], local_len * size)
            kb, vb = (x[:, :, ks] for x in block)
            out_j, lse_j = torch.ops.zerofx.blocked_attention(q[:, :, qs], kb, vb, mask_j, causal, scale, local_len, local_len)
            keep = torch.isfinite(lse_j)  # a row whose keys in this block are all masked contributes nothing
            lse_j = torch.where(keep, lse_j, float("-inf"))
            lse_old = lse[:, :, qs]
            lse_new = torch.logaddexp(lse_old, lse_j)
            lse_safe = torch.where(torch.isinf(lse_new), 0.0, lse_new)  # -inf: no key so far
            out_j = torch.where(keep.unsqueeze(-1), out_j.float(), 0.0)
            acc[:, :, qs] = torch.exp(lse_old - lse_safe).unsqueeze(-1) * acc[:, :, qs] + torch.exp(lse_j - lse_safe).unsqueeze(-1) * out_j
            lse[:, :, qs] = lse_new
        if exchange is not None:
            block = exchange.wait()
    # A row masked everywhere: output 0 and lse +inf, so its backward's exp(s - lse) is 0 (as blocked_attention's).
    return acc.to(q.dtype), torch.where(torch.isneginf(lse), float("inf"), lse)


@ring_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float, group_name: str,
      size: int, zigzag: bool) -> tuple[Tensor, Tensor]:
    return q.new_empty((*q.shape[:-1], v.size(-1))), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("zerofx::ring_attention_backward", mutates_args=())
def ring_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Tensor | None,
                            is_causal: bool, scale: float, group_name: str, size: int, zigzag: bool) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of ``ring_attention``: k and v travel the ring again, each with the fp32
    gradient accumulated for it so far, which ends on its own rank (NOTE [Ring attention])."""
    group, rank = _group(group_name, size)
    local_len = q.size(-2)
    rows = rank_positions(rank, size, local_len, zigzag, q.device)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    block, incoming = [k, v], None
    for step in range(size):
        exchange = _Exchange(block, group, 0) if step < size - 1 else None
        source = (rank - step) % size
        cols = rank_positions(source, size, local_len, zigzag, q.device)
        mine = None
        for qs, ks, causal in _blocks(rank, source, local_len, is_causal, zigzag):
            mask_j = _block_mask(mask, rows[qs], cols[ks], local_len * size)
            kb, vb = (x[:, :, ks] for x in block)
            # With the global out and lse, a block's FlashAttention backward is its share of the gradients.
            dq_j, dk_j, dv_j = torch.ops.zerofx.blocked_attention_backward(grad_out[:, :, qs], q[:, :, qs], kb, vb, out[:, :, qs],
                                                                          lse[:, :, qs], mask_j, causal, scale, local_len, local_len)
            dq[:, :, qs] += dq_j.float()
            if mine is None:
                mine = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in block]
            mine[0][:, :, ks] += dk_j.float()
            mine[1][:, :, ks] += dv_j.float()
        theirs = incoming.wait() if incoming is not None else None  # this block's gradients from the ranks it visited before
        if mine is None:
            grads = theirs or [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in block]
        else:
            grads = mine if theirs is None else [a + b for a, b in zip(mine, theirs)]
        incoming = _Exchange(grads, group, 2)  # on to rank r + 1, which holds this block next
        if exchange is not None:
            block = exchange.wait()
    dk, dv = incoming.wait()  # this rank's own block, back from every rank of the group
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@ring_attention_backward.register_fake
def _(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Tensor | None,
      is_causal: bool, scale: float, group_name: str, size: int, zigzag: bool) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(x.new_empty(x.shape) for x in (q, k, v))


def _ring_setup(ctx, inputs, output) -> None:
    q, k, v, mask, is_causal, scale, group_name, size, zigzag = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask)  # k and v: this rank's T/S positions only
    ctx.args = (is_causal, scale, group_name, size, zigzag)
    ctx.mark_non_differentiable(lse)


def _ring_backward(ctx, grad_out: Tensor, _grad_lse: Tensor):
    q, k, v, out, lse, mask = ctx.saved_tensors
    dq, dk, dv = torch.ops.zerofx.ring_attention_backward(grad_out, q, k, v, out, lse, mask, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


ring_attention_op.register_autograd(_ring_backward, setup_context=_ring_setup)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, is_causal: bool, scale: float, size: int,
                   group_name: str, zigzag: bool = False) -> Tensor:
    """Attention of this rank's queries q: (B, H, T/S, D) over the whole sequence, one
    ``zerofx::ring_attention`` op: (B, H, T/S, Dv). ``zigzag``: the ranks hold the sequence in
    the zigzag layout (NOTE [Zigzag layout for causal rings]), T/S even."""
    out, _ = torch.ops.zerofx.ring_attention(q, k, v, mask, is_causal, scale, group_name, size, zigzag)
    return out


# --------------------------------------------------------------------------- what the planner sees
def is_ring_attention(node: fx.Node) -> bool:
    """The forward op or its backward."""
    return node.op == "call_function" and node.target in (torch.ops.zerofx.ring_attention.default,
                                                          torch.ops.zerofx.ring_attention_backward.default)


def ring_exchanges(node: fx.Node) -> tuple[int, ...]:
    """Bytes of each block one rank sends to its neighbour inside a ring attention node, in order
    (NOTE [Ring attention]); () for any other node. Forward: k and v, S - 1 times. Backward: k and
    v S - 1 times, and the fp32 gradients of k and v S times."""
    if not is_ring_attention(node):
        return ()
    backward = node.target is torch.ops.zerofx.ring_attention_backward.default
    size = node.args[10 if backward else 7]
    k, v = (a.meta["val"] for a in (node.args[2:4] if backward else node.args[1:3]))
    sent: list[int] = []
    for step in range(size):
        if step < size - 1:
            sent += [x.numel() * x.element_size() for x in (k, v)]
        if backward:
            sent += [x.numel() * 4 for x in (k, v)]  # fp32 accumulators
    return tuple(sent)
