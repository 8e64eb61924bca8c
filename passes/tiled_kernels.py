"""Custom ops the tiling rewrite inserts: blocked attention, the chunked vocabulary loss and the
feature-tiled linear.

Each op is registered with ``torch.library.custom_op`` (public API) and has a fake kernel
(``register_fake``), so zerofx captures it on fake tensors, and an autograd formula
(``register_autograd``) whose backward is itself one custom op. AOTAutograd therefore sees one
node in forward and one in backward per op, never an unrolled loop, and the min-cut partitioner
can save only what the op saves: its inputs and a few O(n) statistics.

NOTE [Blocked attention]
``blocked_attention(q, k, v, mask, is_causal, scale, q_block, kv_block) -> (out, lse)`` is
FlashAttention-2 on plain tensor ops. q: (B, H, Tq, D), k and v: (B, H, Tk, D); ``mask`` is
``None``, a boolean mask (True = attend) or an additive float mask, broadcastable to
(B, H, Tq, Tk). k and v may have fewer heads than q, dividing them (grouped-query attention, Hkv | H): each
key/value head serves H / Hkv consecutive query heads, as SDPA's ``enable_gqa`` and transformers'
``repeat_kv``; the repeated k and v exist only inside the op (forward and backward), and the
gradients are summed back per group. ``is_causal`` uses the top-left alignment of ``scaled_dot_product_attention``
(query i attends to keys j <= i). Forward visits (query block, key block) pairs with an online
softmax and keeps only ``out`` and the log-sum-exp ``lse`` (B, H, Tq). Backward recomputes the
scores of one pair at a time from q, k and lse. Peak extra memory is O(q_block * kv_block) per
head, never O(Tq * Tk). Key blocks wholly above the causal diagonal are skipped. A query row whose
keys are all masked gets output 0 and gradient 0.

NOTE [Chunked linear cross-entropy]
``chunked_linear_cross_entropy(h, w, b, target, ignore_index, chunk) -> loss_sum`` computes
``sum_i CE(float(h_i @ w.T + b), target_i)`` over rows whose target is not ``ignore_index``,
``chunk`` rows at a time. h: (N, D), w: (V, D), target: (N,). Only h (and the weights) are saved;
backward recomputes each chunk's logits. The (N, V) logits are never materialized.

NOTE [Feature-tiled linear]
``feature_tiled_linear(x, w, b, tiles) -> y`` is ``F.linear(x, w, b)`` computed in ``tiles``
blocks of output features (rows of w, split by ``tile_bounds``); its backward op computes dx,
dw and db tile by tile too. On a whole weight this changes nothing but the order of the
work: the op exists so that stage 3 can find the linear in the joint graph and gather its
weight one tile at a time (NOTE [One weight tile at a time] in ``passes/zero/tile_weights.py``),
where the min-cut partitioner and the rewrite see one node in forward and one in backward.
Below stage 3, or where the weight cannot be tile-gathered, these kernels run as they are.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from zerofx.passes import _compat
from zerofx.common.errors import PlanError

Tensor = torch.Tensor


def _mask_block(mask: Tensor | None, qs: int, qe: int, ks: int, ke: int) -> Tensor | None:
    if mask is None:
        return None
    m = mask
    if m.size(-2) != 1:
        m = m[..., qs:qe, :]
    if m.size(-1) != 1:
        m = m[..., ks:ke]
    return m


def _scores(q: Tensor, k: Tensor, mask: Tensor | None, is_causal: bool, scale: float, qs: int, ks: int) -> Tensor:
    """Masked, scaled scores of one (query block, key block) pair: (B, H, bq, bk), fp32 math in q's dtype."""
    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, bq, bk)
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, float("-inf"))
        else:
            s = s + mask
    if is_causal:
        rows = torch.arange(qs, qs + q.size(-2), device=q.device).unsqueeze(-1)
        cols = torch.arange(ks, ks + k.size(-2), device=q.device).unsqueeze(0)
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def _expand_mask(mask: Tensor | None) -> Tensor | None:
    if mask is None:
        return None
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask


def _empty_bthd(like: Tensor, head_dim: int) -> Tensor:
    """An empty (B, H, T, head_dim) tensor laid out as (B, T, H, head_dim): see NOTE [Layout at the op boundary]."""
    b, h, t, _ = like.shape
    return like.new_empty((b, t, h, head_dim)).transpose(1, 2)


def _bthd(x: Tensor) -> Tensor:
    """NOTE [Layout at the op boundary]
    The op's outputs (out, dq, dk, dv) are (B, H, T, D) tensors laid out as (B, T, H, D), in the
    fake kernels too: the layout the fused CPU kernel writes its gradients in and is fastest
    reading (about 20% faster backward than (B, H, T, D)-contiguous inputs, measured), and the one
    in which the model's ``y.transpose(1, 2).reshape(B, T, H·D)`` is a view rather than a copy.
    Returns ``x`` when it already is, else a copy."""
    return x if x.transpose(1, 2).is_contiguous() else x.transpose(1, 2).contiguous().transpose(1, 2)


def _repeat_kv(x: Tensor, num_heads: int) -> Tensor:
    """(B, Hkv, T, D) -> (B, num_heads, T, D): each key/value head serves num_heads / Hkv query
    heads in a row, as ``repeat_kv`` in transformers and SDPA's ``enable_gqa``."""
    return x if x.size(1) == num_heads else x.repeat_interleave(num_heads // x.size(1), dim=1)


def _sum_groups(grad: Tensor, num_kv_heads: int) -> Tensor:
    """The gradient of ``_repeat_kv``: (B, H, T, D) summed over each group -> (B, Hkv, T, D), contiguous."""
    b, h, t, d = grad.shape
    if h == num_kv_heads:
        return grad.contiguous()
    return grad.reshape(b, num_kv_heads, h // num_kv_heads, t, d).sum(2)


def _kv_stop(is_causal: bool, qe: int, tk: int) -> int:
    return min(qe, tk) if is_causal else tk


def _use_fused(q: Tensor, mask: Tensor | None) -> bool:
    """NOTE [The fused CPU kernel]
    On CPU, PyTorch's own flash-attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu``,
    what SDPA dispatches to) is this same algorithm, query- and key-blocked with an online
    softmax, returning (out, lse), and its backward recomputes per block; it is 10-25x faster than
    the loops below. We call it for fp32/bf16 CPU tensors with an additive float mask or none,
    and run the plain-tensor loops otherwise (other devices, boolean masks)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16) and (mask is None or mask.dtype == q.dtype)


@torch.library.custom_op("zerofx::blocked_attention", mutates_args=())
def blocked_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float, q_block: int, kv_block: int
) -> tuple[Tensor, Tensor]:
    k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
    if _use_fused(q, mask):
        out, lse = _compat.CPU_FLASH_ATTENTION(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
        if mask is not None:  # the kernel gives lse 0 to a row whose keys are all -inf: +inf, as the loops below give it
            lse = torch.where(torch.isneginf(mask).all(-1).expand(lse.shape), float("inf"), lse)
        return _bthd(out), lse.contiguous()
    mask = _expand_mask(mask)
    b, h, tq, d = q.shape
    tk = k.size(-2)
    out = _empty_bthd(q, v.size(-1))
    lse = torch.empty((b, h, tq), dtype=torch.float32, device=q.device)
    for qs in range(0, tq, q_block):
        qe = min(qs + q_block, tq)
        qb = q[:, :, qs:qe]  # (B, H, bq, D)
        m = torch.full((b, h, qe - qs), float("-inf"), dtype=torch.float32, device=q.device)
        row_sum = torch.zeros((b, h, qe - qs), dtype=torch.float32, device=q.device)
        acc = torch.zeros((b, h, qe - qs, v.size(-1)), dtype=torch.float32, device=q.device)
        for ks in range(0, _kv_stop(is_causal, qe, tk), kv_block):
            ke = min(ks + kv_block, tk)
            s = _scores(qb, k[:, :, ks:ke], _mask_block(mask, qs, qe, ks, ke), is_causal, scale, qs, ks).float()
            m_new = torch.maximum(m, s.amax(-1))
            m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # all masked so far
            p = torch.exp(s - m_safe.unsqueeze(-1))  # (B, H, bq, bk)
            alpha = torch.exp(m - m_safe)
            row_sum = alpha * row_sum + p.sum(-1)
            acc = alpha.unsqueeze(-1) * acc + torch.matmul(p.to(v.dtype), v[:, :, ks:ke]).float()
            m = m_new
        row_sum_safe = torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
        out[:, :, qs:qe] = (acc / row_sum_safe.unsqueeze(-1)).to(q.dtype)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        lse[:, :, qs:qe] = torch.where(row_sum == 0, torch.full_like(row_sum, float("inf")), m_safe + torch.log(row_sum_safe))
    return out, lse


@blocked_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, is_causal: bool, scale: float, q_block: int, kv_block: int) -> tuple[Tensor, Tensor]:
    return _empty_bthd(q, v.size(-1)), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("zerofx::blocked_attention_backward", mutates_args=())
def blocked_attention_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Tensor | None,
    is_causal: bool, scale: float, q_block: int, kv_block: int,
) -> tuple[Tensor, Tensor, Tensor]:
    num_kv_heads = k.size(1)
    k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
    if _use_fused(q, mask):
        grads = list(_compat.CPU_FLASH_ATTENTION_BACKWARD(grad_out, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale))
        del k, v
        for i in range(3):  # the kernel's (B, T, H, D) strides are kept; grouped heads are summed one at a time
            grads[i] = _bthd(grads[i] if i == 0 else _sum_groups(grads[i], num_kv_heads))
        return tuple(grads)
    mask = _expand_mask(mask)
    tq, tk = q.size(-2), k.size(-2)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)
    delta = (grad_out.float() * out.float()).sum(-1)  # (B, H, Tq)
    for qs in range(0, tq, q_block):
        qe = min(qs + q_block, tq)
        qb, go = q[:, :, qs:qe], grad_out[:, :, qs:qe].float()
        lse_b = lse[:, :, qs:qe].unsqueeze(-1)
        for ks in range(0, _kv_stop(is_causal, qe, tk), kv_block):
            ke = min(ks + kv_block, tk)
            kb, vb = k[:, :, ks:ke], v[:, :, ks:ke]
            s = _scores(qb, kb, _mask_block(mask, qs, qe, ks, ke), is_causal, scale, qs, ks).float()
            p = torch.exp(s - lse_b)  # (B, H, bq, bk); exp(-inf) = 0 for masked entries and empty rows
            dv[:, :, ks:ke] += torch.matmul(p.transpose(-2, -1), go)
            dp = torch.matmul(go, vb.float().transpose(-2, -1))
            ds = p * (dp - delta[:, :, qs:qe].unsqueeze(-1)) * scale
            dq[:, :, qs:qe] += torch.matmul(ds, kb.float())
            dk[:, :, ks:ke] += torch.matmul(ds.transpose(-2, -1), qb.float())
    return _bthd(dq.to(q.dtype)), _bthd(_sum_groups(dk, num_kv_heads).to(k.dtype)), _bthd(_sum_groups(dv, num_kv_heads).to(v.dtype))


@blocked_attention_backward.register_fake
def _(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Tensor | None,
      is_causal: bool, scale: float, q_block: int, kv_block: int) -> tuple[Tensor, Tensor, Tensor]:
    return _empty_bthd(q, q.size(-1)), _empty_bthd(k, k.size(-1)), _empty_bthd(v, v.size(-1))


def _attention_setup(ctx, inputs, output) -> None:
    q, k, v, mask, is_causal, scale, q_block, kv_block = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask)
    ctx.args = (is_causal, scale, q_block, kv_block)


def _attention_backward(ctx, grad_out: Tensor, _grad_lse: Tensor):
    q, k, v, out, lse, mask = ctx.saved_tensors
    dq, dk, dv = torch.ops.zerofx.blocked_attention_backward(grad_out, q, k, v, out, lse, mask, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


blocked_attention.register_autograd(_attention_backward, setup_context=_attention_setup)


# --------------------------------------------------------------------------- the loss
@torch.library.custom_op("zerofx::chunked_linear_cross_entropy", mutates_args=())
def chunked_linear_cross_entropy(h: Tensor, w: Tensor, b: Tensor | None, target: Tensor, ignore_index: int, chunk: int) -> Tensor:
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for s in range(0, h.size(0), chunk):
        logits = F.linear(h[s : s + chunk], w, b).float()  # (c, V)
        total = total + F.cross_entropy(logits, target[s : s + chunk], ignore_index=ignore_index, reduction="sum")
    return total


@chunked_linear_cross_entropy.register_fake
def _(h: Tensor, w: Tensor, b: Tensor | None, target: Tensor, ignore_index: int, chunk: int) -> Tensor:
    return h.new_empty((), dtype=torch.float32)


@torch.library.custom_op("zerofx::chunked_linear_cross_entropy_backward", mutates_args=())
def chunked_linear_cross_entropy_backward(
    grad: Tensor, h: Tensor, w: Tensor, b: Tensor | None, target: Tensor, ignore_index: int, chunk: int
) -> tuple[Tensor, Tensor, Tensor]:
    dh = torch.empty_like(h)
    dw = torch.zeros_like(w, dtype=torch.float32)
    db = torch.zeros(w.size(0), dtype=torch.float32, device=w.device)
    for s in range(0, h.size(0), chunk):
        hc, tc = h[s : s + chunk], target[s : s + chunk]
        logits = F.linear(hc, w, b).float()  # (c, V)
        g = torch.softmax(logits, dim=-1)
        keep = tc != ignore_index
        g[torch.arange(tc.size(0), device=tc.device), tc.clamp(0, w.size(0) - 1)] -= 1.0
        g = g * (keep.unsqueeze(-1) * grad.float())  # (c, V)
        dh[s : s + chunk] = torch.matmul(g.to(h.dtype), w)
        dw += torch.matmul(g.transpose(0, 1), hc.float())
        db += g.sum(0)
    return dh, dw.to(w.dtype), db.to(w.dtype)


@chunked_linear_cross_entropy_backward.register_fake
def _(grad: Tensor, h: Tensor, w: Tensor, b: Tensor | None, target: Tensor, ignore_index: int, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(h), torch.empty_like(w), w.new_empty((w.size(0),))


def _ce_setup(ctx, inputs, output) -> None:
    h, w, b, target, ignore_index, chunk = inputs
    ctx.save_for_backward(h, w, b, target)
    ctx.args = (ignore_index, chunk)
    ctx.has_bias = b is not None


def _ce_backward(ctx, grad: Tensor):
    h, w, b, target = ctx.saved_tensors
    dh, dw, db = torch.ops.zerofx.chunked_linear_cross_entropy_backward(grad, h, w, b, target, *ctx.args)
    return dh, dw, (db if ctx.has_bias else None), None, None, None


chunked_linear_cross_entropy.register_autograd(_ce_backward, setup_context=_ce_setup)


# --------------------------------------------------------------------------- weight tiles
def tile_bounds(rows: int, tiles: int) -> list[int]:
    """Row offsets ``[0, ..., rows]`` splitting ``rows`` into ``tiles`` near-even tiles, the
    larger first (NOTE [Feature-tiled linear])."""
    if isinstance(tiles, bool) or not isinstance(tiles, int) or not 1 <= tiles <= rows:
        raise PlanError(f"tiles={tiles!r} cannot split {rows} rows; accepted: an integer from 1 to {rows}")
    base, extra = divmod(rows, tiles)
    bounds = [0]
    for t in range(tiles):
        bounds.append(bounds[-1] + base + (t < extra))
    return bounds


@torch.library.custom_op("zerofx::feature_tiled_linear", mutates_args=())
def feature_tiled_linear(x: Tensor, w: Tensor, b: Tensor | None, tiles: int) -> Tensor:
    bounds = tile_bounds(w.size(0), tiles)
    y = x.new_empty((*x.shape[:-1], w.size(0)))
    for a, e in itertools.pairwise(bounds):
        y[..., a:e] = F.linear(x, w[a:e], None if b is None else b[a:e])
    return y


@feature_tiled_linear.register_fake
def _(x: Tensor, w: Tensor, b: Tensor | None, tiles: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], w.size(0)))


@torch.library.custom_op("zerofx::feature_tiled_linear_backward", mutates_args=())
def feature_tiled_linear_backward(grad: Tensor, x: Tensor, w: Tensor, tiles: int, with_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    bounds = tile_bounds(w.size(0), tiles)
    x2 = x.reshape(-1, x.size(-1))
    g2 = grad.reshape(-1, w.size(0))
    # The tiles' shares of dx are summed in fp32 at least, as one matmul would accumulate them.
    dx = torch.zeros_like(x2, dtype=torch.promote_types(x2.dtype, torch.float32))
    dw = torch.empty_like(w)
    for a, e in itertools.pairwise(bounds):
        dx += g2[:, a:e] @ w[a:e]
        dw[a:e] = g2[:, a:e].t() @ x2
    db = g2.sum(0) if with_bias else g2.new_empty((0,))
    return dx.to(x.dtype).view(x.shape), dw, db


@feature_tiled_linear_backward.register_fake
def _(grad: Tensor, x: Tensor, w: Tensor, tiles: int, with_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(w), grad.new_empty((w.size(0) if with_bias else 0,))


def _linear_setup(ctx, inputs, output) -> None:
    x, w, b, tiles = inputs
    ctx.save_for_backward(x, w)
    ctx.tiles = tiles
    ctx.has_bias = b is not None


def _linear_backward(ctx, grad: Tensor):
    x, w = ctx.saved_tensors
    dx, dw, db = torch.ops.zerofx.feature_tiled_linear_backward(grad, x, w, ctx.tiles, ctx.has_bias)
    return dx, dw, (db if ctx.has_bias else None), None


feature_tiled_linear.register_autograd(_linear_backward, setup_context=_linear_setup)


