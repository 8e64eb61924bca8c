"""Planner (reads only): which attention ops, sequence regions and losses to tile, and with which
block sizes, from the activation-memory estimate and the budget.

Expects the pre-autograd forward graph (see ``seq_regions``) with ``zerofx_role`` on its
placeholders. Returns a frozen ``TilingPlan``; ``tile_forward_pass`` applies it without
re-running any estimate. The plan is part of the ZeRO ``Plan`` (``Plan.tiling``), so it is
fingerprinted and compared across ranks like the rest.

NOTE [What the estimates mean]
Bytes are the activations an op keeps alive for backward, or its largest transient, untiled vs
tiled; they are functions of ``meta['val']`` only.
- attention: untiled, the (B, H, Tq, Tk) score matrix an unfused implementation saves (the
  explicit softmax pattern really does; PyTorch's fused CPU kernel does not, so for SDPA this
  is an upper bound); tiled, one (B, H, block, block) block.
- region: untiled, every token-wise output of the region (what autograd saves, at most); tiled,
  the region's outputs plus one chunk of everything else (recomputed per chunk in backward).
- loss: untiled, the (N, V) fp32 logits and their gradient; tiled, one chunk of each.
``auto`` tiles the candidates that save the most until the estimate fits the budget (default
``DEFAULT_BUDGET_BYTES``); ``true`` tiles every candidate, ``false`` none.

NOTE [Block size from the budget]
Each chunk of a region costs time (a few more, smaller ops, each over fewer rows), and a
region's tiled estimate falls only with the chunk's share of it. The graphs do not grow with the
chunks: a region is one loop over one body (NOTE [One body per tiled region] in
``chunk_loop``). So without a configured ``block_size`` the planner tries the sequence in 2, 4,
8, ... even chunks (at least ``MIN_AUTO_BLOCK`` tokens, at most ``MAX_AUTO_CHUNKS`` chunks) and
keeps the fewest whose estimate fits the budget; when none fits it keeps the smallest and logs
that it does not fit. The chunk count is capped because what chunking saves stops falling once
the region's outputs, which stay whole, dominate: at 32 chunks one chunk's share is 3% of the
region's intermediates. A configured ``block_size`` is taken as given.

NOTE [Convolutions recomputed in backward]
The fifth kind is a convolution span (``conv_spans``): a direct conv1d with the causal pad that
feeds it, or an FFT convolution's ``rfft``s, the product of the spectra, the ``irfft`` and the
slice of its first T outputs, along the sequence. Autograd saves the padded input and the output
of a conv1d, and both spectra (complex, T + 1 bins each) of an FFT convolution. A chosen span's
nodes are tagged for recompute, as a chunk of a region is, so the partitioner saves the span's
inputs only (the token-wise signal and the filter) and runs the span again just before its
backward: a depthwise conv or an FFT is cheap next to the projections around it. Untiled, its
bytes are the span's outputs; tiled, its inputs that depend on the sequence. The span never
holds a collective: under sequence parallelism a halo's or an all-to-all's output is an input
of the span and stays saved, so recompute adds no communication.

NOTE [Long convolutions in channel chunks]
A depthwise FFT convolution is independent per channel, and its working set, the padded signal
and two complex spectra of 2T points per channel, is several times the signal. A chosen FFT span
whose ops keep a (..., C, L) layout (``channel_chunks_allowed``: FFTs along the last dim,
products, casts, slices of the last dim) runs in channel chunks: a loop over one body, the
span over one chunk of its inputs' dim -2, whose outputs are joined along dim -2 (NOTE [One
body per tiled region] in ``chunk_loop``). The loop is tagged for recompute, so its outputs are
made again before their backward rather than saved, and its backward recomputes one chunk at a
time, so backward too holds one chunk's spectra at a time. The planner gives it as many chunks as the regions have sequence chunks (at most C), so one
chunk's share of the working set is the same fraction in both. Under sequence parallelism this
runs on each rank's C/S channels of the whole sequence, after the all-to-all.

NOTE [Weight tiles]
The fourth kind tiles a linear's weight along its output features (rows), for stage 3, where
the weight is gathered before use: a weight of more than ``weight_tile_bytes`` is gathered and
used one tile at a time (NOTE [One weight tile at a time] in ``tile_weights``), in
ceil(bytes / weight_tile_bytes) tiles. Its bytes are the gathered weight, whole vs one tile,
not activations: weights are chosen apart from the activation budget, every candidate whose
kind is on. A candidate is a ``linear`` whose weight is a parameter read directly (not through a
cast or view) and bigger than ``weight_tile_bytes``. It is left alone, with the reason, where a
chosen region contains it (each chunk would gather every tile again) or a chosen loss owns it.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.fx as fx

from zerofx.passes import meta
from zerofx.passes.sequence import seq_regions
from zerofx.passes.plan.tiling import DEFAULT_BUDGET_BYTES, DEFAULT_WEIGHT_TILE_BYTES, KINDS, SkippedOp, TiledOp, TilingOptions, TilingPlan
from zerofx.passes.sequence.seq_regions import SeqAnalysis
from zerofx.passes.sequence.sequence_parallel import mixer_of, whole_args

log = logging.getLogger("zerofx.tiling")

DEFAULT_BLOCK_SIZE = 1024  # tokens per chunk when the sequence is too short to split into MIN_AUTO_BLOCK pieces
MIN_AUTO_BLOCK = 256  # the smallest block the planner picks itself: smaller chunks make (B·block, d) matmuls inefficient on CPU
MAX_AUTO_CHUNKS = 32  # the most chunks per region the planner picks itself (NOTE [Block size from the budget])
DEFAULT_ATTENTION_BLOCK = 512  # query and key block; the (B, H, 512, 512) score block is 1 MiB per head in fp32


def _nbytes(node: fx.Node) -> int:
    v = node.meta.get("val")
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (tuple, list)):
        return sum(x.numel() * x.element_size() for x in v if isinstance(x, torch.Tensor))
    return 0


def estimate_attention_bytes(match: seq_regions.AttentionMatch, block: int) -> tuple[int, int, tuple[int, ...]]:
    q, k = match.q.meta["val"], match.k.meta["val"]
    b, h, tq, _ = q.shape
    tk = k.shape[-2]
    item = 4  # scores are computed and saved in fp32
    return b * h * tq * tk * item, b * h * min(block, tq) * min(block, tk) * item, tuple(q.shape)


def estimate_region_bytes(analysis: SeqAnalysis, index: int, block: int) -> tuple[int, int]:
    region = analysis.regions[index]
    total = sum(_nbytes(n) for n in region)
    # An attention-input region's outputs are recomputed too (NOTE [Attention inputs are recomputed, not saved]).
    out_bytes = 0 if analysis.feeds_attention[index] else sum(_nbytes(n) for n in analysis.region_outputs(region))
    frac = min(1.0, block / analysis.seq_len)
    return total, out_bytes + math.ceil((total - out_bytes) * frac)


def estimate_loss_bytes(match: seq_regions.LossMatch, block: int) -> tuple[int, int, tuple[int, ...]]:
    logits = match.output.args[0].meta["val"]
    n, v = logits.shape
    return 2 * n * v * 4, 2 * min(block, n) * v * 4, (n, v)


def block_choices(seq_len: int, options: TilingOptions) -> list[int]:
    """Region and loss block sizes to try, largest first: the configured one, else the sequence in
    2, 4, 8, ... even chunks (rounded up to 64 tokens) down to ``MIN_AUTO_BLOCK``, at most ``MAX_AUTO_CHUNKS``."""
    if options.block_size is not None:
        return [options.block_size]
    blocks, parts = [], 2
    while True:
        block = -(-seq_len // parts)  # ceil
        block = -(-block // 64) * 64
        if block < MIN_AUTO_BLOCK or parts > MAX_AUTO_CHUNKS:
            return blocks or [DEFAULT_BLOCK_SIZE]
        blocks.append(block)
        parts *= 2


def _candidates(analysis: SeqAnalysis, block: int, ablock: int) -> tuple[list[TiledOp], list[SkippedOp]]:
    seq_len = analysis.seq_len
    candidates: list[TiledOp] = []
    skipped: list[SkippedOp] = []
    for i, m in enumerate(analysis.attention):
        what = f"{m.pattern} attention{' causal' if m.is_causal else ''}{' masked' if m.mask is not None else ''}"
        if m.reason:
            skipped.append(SkippedOp("attention", i, what, m.reason))
            continue
        untiled, tiled, shape = estimate_attention_bytes(m, ablock)
        candidates.append(TiledOp("attention", i, what, shape, ablock, untiled, tiled))
    for i, region in enumerate(analysis.regions):
        num_linear = sum(1 for n in region if seq_regions.op_packet(n) in (torch.ops.aten.linear, torch.ops.aten.matmul))
        what = f"token-wise region: {len(region)} ops, {num_linear} linear{', attention inputs' if analysis.feeds_attention[i] else ''}"
        if block >= seq_len:
            skipped.append(SkippedOp("region", i, what, f"block_size {block} >= sequence length {seq_len}: one chunk"))
            continue
        untiled, tiled = estimate_region_bytes(analysis, i, block)
        shape = tuple(region[0].meta["val"].shape) if isinstance(region[0].meta.get("val"), torch.Tensor) else ()
        candidates.append(TiledOp("region", i, what, shape, block, untiled, tiled))
    for i, span in enumerate(analysis.conv_spans):
        kinds = sorted({str(seq_regions.op_packet(n)).removeprefix("aten.") for n in span if seq_regions.op_packet(n) in _CONV_SEEDS})
        untiled, tiled = estimate_conv_bytes(span)
        shape = next((tuple(n.meta["val"].shape) for n in span if isinstance(n.meta.get("val"), torch.Tensor)), ())
        # An FFT convolution runs in as many channel chunks as the regions have sequence chunks
        # (NOTE [Long convolutions in channel chunks]); a direct conv is recomputed whole.
        channels = channel_chunks_allowed(span)
        chunks = min(channels, -(-seq_len // block)) if channels and block < seq_len else 1
        what = f"{' + '.join(kinds)}: {len(span)} ops recomputed in backward" + (f", in {chunks} channel chunks" if chunks > 1 else "")
        candidates.append(TiledOp("conv", i, what, shape, chunks, untiled, min(tiled, untiled)))
    for i, m in enumerate(analysis.losses):
        what = "linear + cross_entropy"
        if m.reason:
            skipped.append(SkippedOp("loss", i, what, m.reason))
            continue
        untiled, tiled, shape = estimate_loss_bytes(m, block)
        candidates.append(TiledOp("loss", i, what, shape, block, untiled, tiled))
    return candidates, skipped


def weight_linears(gm: fx.GraphModule, tile_bytes: int) -> list[tuple[fx.Node, str]]:
    """The ``linear`` nodes whose weight is a parameter placeholder (read directly) of more than
    ``tile_bytes``, with its FQN, in graph order: the weight candidates (NOTE [Weight tiles])."""
    found = []
    for n in gm.graph.nodes:
        if seq_regions.op_packet(n) is not torch.ops.aten.linear or len(n.args) < 2:
            continue
        w = n.args[1]
        if not (isinstance(w, fx.Node) and w.op == "placeholder" and w.meta.get(meta.ROLE) is meta.Role.PARAM):
            continue
        if _nbytes(w) > tile_bytes and w.meta["val"].dim() == 2:
            found.append((n, w.meta[meta.FQN]))
    return found


def _weight_candidates(gm: fx.GraphModule, analysis: SeqAnalysis, chosen: list[TiledOp], options: TilingOptions,
                       tile_bytes: int) -> tuple[list[TiledOp], list[SkippedOp]]:
    region_of = {n: op.index for op in chosen if op.kind == "region" for n in analysis.regions[op.index]}
    loss_linears = {analysis.losses[op.index].linear for op in chosen if op.kind == "loss"}
    ops: list[TiledOp] = []
    skipped: list[SkippedOp] = []
    for i, (node, fqn) in enumerate(weight_linears(gm, tile_bytes)):
        out_features, in_features = node.args[1].meta["val"].shape
        size = _nbytes(node.args[1])
        what = f"linear {fqn}"
        if "weight" not in options.kinds:
            skipped.append(SkippedOp("weight", i, what, "this kind is turned off in zerofx.tiling"))
        elif node in region_of:
            skipped.append(SkippedOp("weight", i, what, f"inside token-wise region #{region_of[node]}, which runs in chunks: "
                                                         "each chunk would gather every tile again"))
        elif node in loss_linears:
            skipped.append(SkippedOp("weight", i, what, "the vocabulary projection of the chunked loss"))
        else:
            tiles = min(-(-size // tile_bytes), out_features)
            ops.append(TiledOp("weight", i, what, (out_features, in_features), tiles, size, -(-size // tiles), param=fqn))
    return ops, skipped


def _choose(candidates: list[TiledOp], options: TilingOptions, budget: int) -> tuple[list[TiledOp], int]:
    """The tiled ops and the activation estimate with them: all allowed (``enabled: true``), or
    the biggest savings first until the estimate fits ``budget`` (``auto``)."""
    allowed = [c for c in candidates if c.kind in options.kinds]
    if options.enabled is True:
        chosen = allowed
    else:
        chosen, estimate = [], sum(c.bytes_untiled for c in candidates)
        for c in sorted(allowed, key=lambda c: c.bytes_untiled - c.bytes_tiled, reverse=True):
            if estimate <= budget:
                break
            chosen.append(c)
            estimate -= c.bytes_untiled - c.bytes_tiled
    return chosen, sum(c.bytes_untiled for c in candidates) - sum(c.bytes_untiled - c.bytes_tiled for c in chosen)


def analyze_for_tiling(gm: fx.GraphModule, seq_len: int) -> SeqAnalysis:
    """The sequence analysis the planner and the rewrite share: the ops of sequence parallelism's
    mixer registry are barriers that keep the axis (NOTE [Mixers as tiling barriers])."""
    analysis = seq_regions.analyze(gm, seq_len, mixes=lambda n: mixer_of(n) is not None, mixer_lengths=True, whole_args=whole_args)
    analysis.conv_spans = conv_spans(gm, analysis)
    # What only feeds a convolution (a Hyena block's norm and in-projection) is recomputed from
    # the residual stream with it, as attention's inputs are.
    seq_regions.split_regions(gm, analysis, {n for span in analysis.conv_spans for n in span})
    return analysis


_aten = torch.ops.aten
_CONV_SEEDS = {_aten.conv1d, _aten.convolution, _aten.fft_rfft, _aten.fft_irfft}
_PADS = {_aten.constant_pad_nd, _aten.pad}
# What a span grows through after its seeds: the spectra's product, slices, views, casts.
_SPAN_OPS = {_aten.mul, _aten.add, _aten.sub, _aten.div, _aten.slice, _aten.narrow, _aten.view, _aten.reshape, _aten._unsafe_view,
             _aten.transpose, _aten.permute, _aten.unsqueeze, _aten.squeeze, _aten.contiguous, _aten.clone, _aten.to, _aten._to_copy,
             _aten.alias, _aten.conj, _aten._conj}


def conv_spans(gm: fx.GraphModule, analysis: SeqAnalysis) -> list[list[fx.Node]]:
    """The convolution spans along the sequence, in graph order (NOTE [Convolutions recomputed in
    backward]): the connected groups of conv1d and FFT nodes that read the sequence, the pads
    whose every user is such a conv, and the products, slices and views computed from them alone
    (parameters and constants aside)."""
    sd, tok = analysis.sdim, analysis.tokenwise
    dep: set[fx.Node] = set()  # nodes computed from the sequence
    for n in gm.graph.nodes:
        if n in tok or sd.get(n) is not None or any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    member: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function" or n in tok or n not in dep:
            continue
        pk = seq_regions.op_packet(n)
        grows = pk in _SPAN_OPS and n.all_input_nodes and all(a in member or a not in dep for a in n.all_input_nodes)
        if pk in _CONV_SEEDS or grows:
            member.add(n)
    for n in gm.graph.nodes:  # a pad is recomputed with its conv; it runs before it in graph order
        if seq_regions.op_packet(n) in _PADS and n not in tok and n.users and all(u in member for u in n.users):
            member.add(n)
    union = seq_regions.NodeUnion(member)
    for n in member:
        for a in n.all_input_nodes:
            if a in member:
                union.join(a, n)
    groups = union.parts(n for n in gm.graph.nodes if n in member)
    return [g for g in groups.values() if any(seq_regions.op_packet(x) in _CONV_SEEDS for x in g)]


# What a span chunked over channels may hold: ops that keep the (..., C, L) layout.
_CHANNEL_OPS = {_aten.fft_rfft, _aten.fft_irfft, _aten.mul, _aten.add, _aten.sub, _aten.slice, _aten.conj, _aten._conj, _aten.to,
                _aten._to_copy, _aten.clone, _aten.contiguous}


def channel_chunks_allowed(span: list[fx.Node]) -> int:
    """The channels C an FFT convolution span can be cut into pieces of, or 0 when it cannot
    (NOTE [Long convolutions in channel chunks]): every node an FFT, a product, a cast or a slice
    of the last dim; every tensor (..., C, L) or (..., 1, L) at dim -2; its outputs used after
    all of it."""
    if not any(seq_regions.op_packet(n) in (_aten.fft_rfft, _aten.fft_irfft) for n in span):
        return 0
    inside, channels = set(span), set()
    for n in span:
        if seq_regions.op_packet(n) not in _CHANNEL_OPS:
            return 0
        if seq_regions.op_packet(n) is _aten.slice:
            v = n.meta.get("val")
            if not isinstance(v, torch.Tensor) or (n.args[1] if len(n.args) > 1 else 0) % v.dim() != v.dim() - 1:
                return 0
        if seq_regions.op_packet(n) in (_aten.fft_rfft, _aten.fft_irfft):
            dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", -1)
            if dim not in (-1, n.args[0].meta["val"].dim() - 1):
                return 0
        for x in [n, *n.all_input_nodes]:
            v = x.meta.get("val")
            if not isinstance(v, torch.Tensor) or v.dim() < 2:
                return 0
            if v.shape[-2] != 1:
                channels.add(v.shape[-2])
    if len(channels) != 1:
        return 0
    position = {n: i for i, n in enumerate(span[0].graph.nodes)}
    last = max(position[n] for n in span)
    users = [u for n in span for u in n.users if u not in inside]
    if any(position[u] < last for u in users):
        return 0
    return channels.pop()


def estimate_conv_bytes(span: list[fx.Node]) -> tuple[int, int]:
    """A span's saved bytes, untiled (its nodes' outputs, at most) and recomputed (its inputs
    other than parameters and buffers, which stay saved)."""
    inside = set(span)
    inputs = {a for n in span for a in n.all_input_nodes if a not in inside}
    kept = [a for a in inputs if a.op != "get_attr" and a.meta.get(meta.ROLE) not in (meta.Role.PARAM, meta.Role.BUFFER)]
    return sum(_nbytes(n) for n in span), sum(_nbytes(a) for a in kept)


def plan_tiling(gm: fx.GraphModule, options: TilingOptions, *, seq_len: int | None = None) -> TilingPlan | None:
    """The tiling decisions for ``gm``; None when ``options.enabled`` is False or the graph has no
    sequence axis (no integer input). See NOTE [Block size from the budget]."""
    if options.enabled is False:
        return None
    seq_len = seq_len or seq_regions.sequence_length(gm)
    if seq_len is None:
        log.info("tiling: no integer (token id) input, so no sequence axis; nothing tiled")
        return None
    analysis = analyze_for_tiling(gm, seq_len)
    ablock = options.attention_block_size or DEFAULT_ATTENTION_BLOCK
    budget = options.budget_bytes if options.budget_bytes is not None else DEFAULT_BUDGET_BYTES
    bound = options.estimate_budget_bytes if options.estimate_budget_bytes is not None else budget
    for block in block_choices(seq_len, options):  # largest first: the first that fits the budget
        candidates, skipped = _candidates(analysis, block, ablock)
        chosen, tiled_total = _choose(candidates, options, bound)
        if tiled_total <= bound:
            break
    else:
        log.info("tiling: the activation estimate %d bytes exceeds the budget %d bytes even with %d-token blocks", tiled_total, bound, block)
    skipped += [SkippedOp(c.kind, c.index, c.what, "this kind is turned off in zerofx.tiling") for c in candidates if c.kind not in options.kinds]
    tile_bytes = options.weight_tile_bytes or DEFAULT_WEIGHT_TILE_BYTES
    weights, weights_skipped = _weight_candidates(gm, analysis, chosen, options, tile_bytes)
    chosen = chosen + weights
    skipped += weights_skipped
    order = {k: i for i, k in enumerate(KINDS)}
    chosen = sorted(chosen, key=lambda c: (order[c.kind], c.index))
    for s in skipped:
        log.info("tiling: %s #%d (%s) not tiled: %s", s.kind, s.index, s.what, s.reason)
    return TilingPlan(
        seq_len=seq_len,
        num_candidates=(len(analysis.attention), len(analysis.regions), len(analysis.losses), len(weights) + len(weights_skipped),
                        len(analysis.conv_spans)),
        ops=tuple(chosen),
        skipped=tuple(skipped),
        budget_bytes=budget,
        estimate_untiled_bytes=sum(c.bytes_untiled for c in candidates),
        estimate_tiled_bytes=tiled_total,
        weight_tile_bytes=tile_bytes,
    )
