"""Ring attention for sequence parallelism: the custom op ``sequence_parallel_pass`` traces in place
of each ``scaled_dot_product_attention``, and what the planner reads off it.

Used while tracing the pre-autograd forward (NOTE [Sequence parallelism as a rewrite] in
passes/sequence_parallel.py); AOTAutograd differentiates the result, and the op's registered
autograd formula gives its backward: one ``zerofx::ring_attention_backward`` op. Reads and writes
no node meta.

NOTE [Ring attention]
Each rank r of a sequence group of S ranks keeps its query slice q: (B, H, T/S, D), and its key
and value slices k, v: (B, Hkv, T/S, D) travel around the group's ring inside one custom op,
``zerofx::ring_attention(q, k, v, mask, is_causal, scale, group_name, S) -> (out, lse)``. At step
i (0 <= i < S) rank r holds the block of source rank j = (r - i) mod S; for i < S - 1 it posts the
send of that block to rank r + 1 and the receive of the next from rank r - 1 (``isend``/``irecv``
through ``batch_isend_irecv`` on the group registered under ``group_name``), attends to the block
while they are in flight (``zerofx::blocked_attention``, FlashAttention's kernel returning the
block's output o_j and log-sum-exp lse_j), then waits. The blocks are combined by an online
softmax in fp32: ``lse = logaddexp(lse, lse_j)`` and ``acc = exp(lse_old - lse) acc + exp(lse_j - lse) o_j``;
the output is ``acc``, the softmax over all T keys exactly, and the op also returns lse, the
log-sum-exp over all T keys (+inf for a query that attends to no key; lse gets no gradient).

Causal attention (top-left, query t attends keys <= t): block j against own slice r is the
diagonal block at step 0 (j = r, causal within the block), wholly visible when j < r, and
wholly masked when j > r. Inside the op the rank is a Python int, so a masked block is not
computed; it is still received and passed on, so every rank sends and receives at every step
and the pattern stays symmetric. Skipping saves the lower ranks work, not time: rank S - 1
attends to every block and each exchange waits for the neighbours (contiguous slices; a zigzag
split of the sequence would balance the ranks). A mask ``attn_mask``
(boolean, True = attend, or additive) broadcastable to (B, H, T, T) is cut to the rank's query
rows and the source's key columns of each block. Rows whose keys are all masked in a block
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
model] in passes/analyze_schedule.py); ``estimate_exchange_bytes`` counts them for ``"auto"``.
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
    """Bytes one rank sends for one attention's forward and backward. Ulysses sends (S-1)/S of q,
    k, v (key/value heads repeated to the query heads when S does not divide them) and of the
    output in the forward, and as many gradients in the backward; ring sends its k and v block
    S - 1 times in the forward, and in the backward S - 1 times again and their fp32 gradients S
    times (NOTE [Ring attention])."""
    tokens = h.batch * (h.seq_len // size)  # of one rank's slice
    kv_heads = h.kv_heads if h.kv_heads % size == 0 else h.q_heads
    ulysses = 2 * (size - 1) / size * tokens * h.itemsize * (h.q_heads * h.qk_dim + kv_heads * (h.qk_dim + h.v_dim) + h.q_heads * h.v_dim)
    kv = tokens * h.kv_heads * (h.qk_dim + h.v_dim)  # elements of one k and v block
    ring = 2 * (size - 1) * kv * h.itemsize + size * kv * 4
    return {SequenceAttention.ULYSSES: ulysses, SequenceAttention.RING: ring}


def choose_attention(heads: list[AttentionShape], size: int) -> tuple[SequenceAttention, str]:
    """``"auto"``: ring where Ulysses cannot run (S does not divide the query heads) or sends
    more bytes per step; Ulysses on a tie (two collectives per attention and direction instead of
    S - 1 ring steps in a row)."""
    refused = next((h.ulysses_refusal for h in heads if h.ulysses_refusal), None)
    if refused:
        return SequenceAttention.RING, f"sequence parallelism: ring chosen ({refused})"
    sent = {kind: sum(estimate_exchange_bytes(h, size)[kind] for h in heads) for kind in (SequenceAttention.ULYSSES, SequenceAttention.RING)}
    kind = SequenceAttention.RING if sent[SequenceAttention.RING] < sent[SequenceAttention.ULYSSES] else SequenceAttention.ULYSSES
    q, kv = heads[0].q_heads, heads[0].kv_heads
    repeat = f", key/value heads repeated to {q} since {size} does not divide {kv}" if kv % size else ""
    return kind, (f"sequence parallelism: {kind.value} chosen for {q} query heads ({kv} key/value) over {size} ranks: one rank sends "
                  f"{format_bytes(sent[SequenceAttention.ULYSSES])} per step (forward and backward) with ulysses (all-to-all{repeat}), "
                  f"{format_bytes(sent[SequenceAttention.RING])} with ring; a tie goes to ulysses")


# --------------------------------------------------------------------------- the ring
def _block_mask(mask: Tensor | None, rank: int, source: int, local_len: int, seq_len: int) -> Tensor | None:
    """``mask`` (broadcastable to (B, H, T, T)) cut to the query rows of ``rank`` and the key columns of ``source``."""
    if mask is None:
        return None
    if mask.dim() >= 2 and mask.size(-2) == seq_len:
        mask = mask.narrow(-2, rank * local_len, local_len)
    if mask.size(-1) == seq_len:
        mask = mask.narrow(-1, source * local_len, local_len)
    return mask


def _visible(is_causal: bool, rank: int, source: int) -> bool:
    """Whether any query of ``rank`` attends to a key of ``source`` (causal: source <= rank)."""
    return not is_causal or source <= rank


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
                      size: int) -> tuple[Tensor, Tensor]:
    """(out, lse) of this rank's queries q: (B, H, T/S, D) over the whole sequence, whose key and
    value slices k, v: (B, Hkv, T/S, D) are spread over the ``size`` ranks of ``group_name``
    (NOTE [Ring attention]). lse: (B, H, T/S) fp32, +inf for a query that attends to no key."""
    group, rank = _group(group_name, size)
    local_len = q.size(-2)
    acc = torch.zeros((*q.shape[:-1], v.size(-1)), dtype=torch.float32, device=q.device)  # Σ exp(lse_i - lse) o_i
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    block = [k, v]
    for step in range(size):
        exchange = _Exchange(block, group, 0) if step < size - 1 else None  # the next block arrives while this one is used
        source = (rank - step) % size
        if _visible(is_causal, rank, source):
            mask_j = _block_mask(mask, rank, source, local_len, local_len * size)
            out_j, lse_j = torch.ops.zerofx.blocked_attention(q, *block, mask_j, is_causal and step == 0, scale, local_len, local_len)
            keep = torch.isfinite(lse_j)  # a row whose keys in this block are all masked contributes nothing
            lse_j = torch.where(keep, lse_j, float("-inf"))
            lse_new = torch.logaddexp(lse, lse_j)
            lse_safe = torch.where(torch.isinf(lse_new), 0.0, lse_new)  # -inf: no key so far
            out_j = torch.where(keep.unsqueeze(-1), out_j.float(), 0.0)
            acc = torch.exp(lse - lse_safe).unsqueeze(-1) * acc + torch.exp(lse_j - lse_safe).unsqueeze(-1) * out_j
            lse = lse_new
        if exchange is not None:
            block = exchange.wait()
    # A row masked everywhere: output 0 and lse +inf, so its backward's exp(s - lse) is 0 (as blocked_attention's).
    return acc.to(q.dtype), torch.where(torch.isneginf(lse), float("inf"), lse)


@ring_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float, group_name: str,
      size: int) -> tuple[Tensor, Tensor]:
    return q.new_empty((*q.shape[:-1], v.size(-1))), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("zerofx::ring_attention_backward", mutates_args=())
def ring_attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Tensor | None,
                            is_causal: bool, scale: float, group_name: str, size: int) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of ``ring_attention``: k and v travel the ring again, each with the fp32
    gradient accumulated for it so far, which ends on its own rank (NOTE [Ring attention])."""
    group, rank = _group(group_name, size)
    local_len = q.size(-2)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    block, incoming = [k, v], None
    for step in range(size):
        exchange = _Exchange(block, group, 0) if step < size - 1 else None
        source = (rank - step) % size
        if _visible(is_causal, rank, source):
            mask_j = _block_mask(mask, rank, source, local_len, local_len * size)
            # With the global out and lse, a block's FlashAttention backward is its share of the gradients.
            dq_j, dk_j, dv_j = torch.ops.zerofx.blocked_attention_backward(grad_out, q, *block, out, lse, mask_j, is_causal and step == 0,
                                                                          scale, local_len, local_len)
            dq += dq_j.float()
            mine = [dk_j.float(), dv_j.float()]
        else:
            mine = None
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
      is_causal: bool, scale: float, group_name: str, size: int) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(x.new_empty(x.shape) for x in (q, k, v))


def _ring_setup(ctx, inputs, output) -> None:
    q, k, v, mask, is_causal, scale, group_name, size = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask)  # k and v: this rank's T/S positions only
    ctx.args = (is_causal, scale, group_name, size)
    ctx.mark_non_differentiable(lse)


def _ring_backward(ctx, grad_out: Tensor, _grad_lse: Tensor):
    q, k, v, out, lse, mask = ctx.saved_tensors
    dq, dk, dv = torch.ops.zerofx.ring_attention_backward(grad_out, q, k, v, out, lse, mask, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


ring_attention_op.register_autograd(_ring_backward, setup_context=_ring_setup)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, is_causal: bool, scale: float, size: int,
                   group_name: str) -> Tensor:
    """Attention of this rank's queries q: (B, H, T/S, D) over the whole sequence, one
    ``zerofx::ring_attention`` op: (B, H, T/S, Dv)."""
    out, _ = torch.ops.zerofx.ring_attention(q, k, v, mask, is_causal, scale, group_name, size)
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
    size = node.args[-1]
    backward = node.target is torch.ops.zerofx.ring_attention_backward.default
    k, v = (a.meta["val"] for a in (node.args[2:4] if backward else node.args[1:3]))
    sent: list[int] = []
    for step in range(size):
        if step < size - 1:
            sent += [x.numel() * x.element_size() for x in (k, v)]
        if backward:
            sent += [x.numel() * 4 for x in (k, v)]  # fp32 accumulators
    return tuple(sent)
