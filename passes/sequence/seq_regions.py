"""Analysis (reads only): where the sequence axis runs through a pre-autograd forward graph, and
which ops can be tiled along it.

Expects the pre-autograd ATen forward that ``make_fx(..., pre_dispatch=True)`` records (composite
ops such as ``aten.linear``, ``aten.scaled_dot_product_attention`` and
``aten.cross_entropy_loss`` are still whole), with ``meta['val']`` on every node. Used by the
planner (``plan_tiling``) and the rewrite (``tile_forward_pass``), which must agree; it changes
nothing.

NOTE [Sequence dimension propagation]
Every node gets ``sdim``: the dimension of its output that is the sequence axis (length
``seq_len``), or None. Sources are the user's inputs with a dimension of that length,
``arange(seq_len)``, a ``slice(table, d, 0, seq_len)`` of a sequence-free tensor (rotary
tables) and an ``index_select`` of seq_len positions of one (a sequence-parallel rank's slice of
an input or table, NOTE [Tiling a sequence-parallel forward] in zerofx/compiler/pipeline.py). A node is
*token-wise* when its output at position t depends only on its inputs at t; each op kind has a
rule (elementwise with broadcasting, reductions and normalizations over other dims, linear over
the last dim, views that keep the axis whole, a gather ``index_select(x, d, positions)`` by
token-wise positions, an ``outer`` of the positions with a vector (rotary angles), ...). Anything else that reads the axis (attention, the loss, a shifted
slice) is a *barrier*; so is a node a rewrite marked with its sequence dim
(``meta.SEQUENCE_DIM``), whose output is the axis again.

NOTE [Regions and levels]
A token-wise node's level counts the barriers on its longest path from the inputs. The
token-wise nodes of one level form a region. A region is convex: a path that leaves it through a
barrier comes back only at a higher level. So the region can run in sequence chunks, all
chunks of it before any of its users, each chunk from slices of the region's inputs. In a
transformer the regions are the embedding with the first norm and QKV projection, then per
layer "output projection, residual, norm, MLP, residual, next norm, next QKV", then the final
norm.

NOTE [Attention inputs are recomputed, not saved]
In each region, the nodes that feed only attention (the pre-attention norm, the QKV projection,
rotary embedding: every user is another such node or the attention op) are split off into a
region of their own, after the rest (``SeqAnalysis.feeds_attention``). Tiled, its outputs (q, k,
v: 3·d per token per layer) are tagged for recompute too, so the partitioner saves the residual
stream it starts from (d per token) and recomputes q, k and v just before the attention's
backward. In a transformer that halves what each layer keeps for backward.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from zerofx.passes import meta, tiled_kernels  # noqa: F401  (registers the zerofx:: ops)
from zerofx.passes.sequence.seq_merged import merged_tokenwise_sdim

aten = torch.ops.aten


def op_packet(node: fx.Node) -> object | None:
    return getattr(node.target, "overloadpacket", None) if node.op == "call_function" else None


_ELEMENTWISE = {
    aten.add, aten.sub, aten.mul, aten.div, aten.pow, aten.rsqrt, aten.sqrt, aten.silu, aten.gelu, aten.relu,
    aten.neg, aten.exp, aten.log, aten.tanh, aten.sigmoid, aten.cos, aten.sin, aten.to, aten._to_copy, aten.alias,
    aten.clone, aten.contiguous, aten.where, aten.masked_fill, aten.abs, aten.square, aten.reciprocal, aten.erf,
    aten.detach, aten.type_as, aten.clamp, aten.maximum, aten.minimum, aten.ones_like, aten.zeros_like,
    aten.full_like, aten.rsub, aten.dropout, aten.leaky_relu, aten.softplus, aten.mish,
    aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.logical_not, aten.logical_and, aten.logical_or,
}
_REDUCE = {aten.mean, aten.sum, aten.amax, aten.amin, aten.var, aten.std}
_VIEWS = {aten.view, aten.reshape, aten._unsafe_view}
_LOSSES = {aten.cross_entropy_loss}
_LOSS_CHAIN = {aten.view, aten.reshape, aten._unsafe_view, aten.to, aten._to_copy, aten.contiguous, aten.clone, aten.alias, aten.slice}


def is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is aten.scaled_dot_product_attention.default


def is_blocked_attention(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.zerofx.blocked_attention.default


def _val(node: object) -> object:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _rank(node: fx.Node) -> int | None:
    v = _val(node)
    return v.dim() if isinstance(v, torch.Tensor) else None


def _norm(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _int(x: object) -> object:
    """A conv's per-dimension argument: an int, or the int of a one-element list."""
    return x[0] if isinstance(x, (list, tuple)) and len(x) == 1 else x


def is_pointwise_conv1d(node: fx.Node) -> bool:
    """A ``conv1d`` whose output at position t reads its input at t alone: one tap, stride 1, no
    padding (``padding=0``, ``"valid"`` or ``"same"``). A 1-tap conv (Hugging Face Mamba's
    ``conv_kernel=1``) is token-wise, not a mixer (NOTE [Convolutions along the sequence] in
    passes/sequence/mixer_conv.py)."""
    if op_packet(node) is not aten.conv1d or len(node.args) < 2:
        return False
    w = _val(node.args[1])
    stride = node.args[3] if len(node.args) > 3 else node.kwargs.get("stride", 1)
    padding = node.args[4] if len(node.args) > 4 else node.kwargs.get("padding", 0)
    return (isinstance(w, torch.Tensor) and w.dim() == 3 and w.shape[-1] == 1 and _int(stride) == 1
            and _int(padding) in (0, "valid", "same"))


def is_empty_pad(node: fx.Node) -> bool:
    """A constant pad of zero widths on every side: a copy."""
    return (op_packet(node) in (aten.pad, aten.constant_pad_nd) and len(node.args) > 1
            and all(w == 0 for w in node.args[1]))


@dataclass(frozen=True)
class AttentionMatch:
    """``softmax(q kᵀ · scale + mask) v`` found in the graph: ``output`` is the node to replace."""

    output: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    mask: fx.Node | None
    is_causal: bool
    scale: float
    pattern: str  # "sdpa" or "softmax"
    reason: str | None = None  # why it cannot be tiled, or None
    scores: fx.Node | None = None  # the softmax pattern's ``matmul(q, kᵀ)``


@dataclass(frozen=True)
class LossMatch:
    """``cross_entropy(chain(linear(h, w, b)), target)``: ``chain`` is the views and casts between."""

    output: fx.Node
    linear: fx.Node
    chain: tuple[fx.Node, ...]
    target: fx.Node
    reduction: int
    ignore_index: int
    reason: str | None = None


@dataclass
class SeqAnalysis:
    seq_len: int
    sdim: dict[fx.Node, int | None] = field(default_factory=dict)
    tokenwise: set[fx.Node] = field(default_factory=set)
    level: dict[fx.Node, int] = field(default_factory=dict)
    regions: list[list[fx.Node]] = field(default_factory=list)  # by level, graph order
    feeds_attention: list[bool] = field(default_factory=list)  # per region: it only computes attention inputs
    attention: list[AttentionMatch] = field(default_factory=list)
    losses: list[LossMatch] = field(default_factory=list)
    conv_spans: list[list[fx.Node]] = field(default_factory=list)  # tiling's (NOTE [Convolutions recomputed in backward])
    outer: dict[fx.Node, int] = field(default_factory=dict)  # merged axes outside the sequence in its dim (NOTE [The sequence axis merged with the batch])

    def region_inputs(self, region: Sequence[fx.Node]) -> list[fx.Node]:
        inside = set(region)
        seen: dict[fx.Node, None] = {}
        for n in region:
            for a in n.all_input_nodes:
                if a not in inside:
                    seen[a] = None
        return list(seen)

    def region_outputs(self, region: Sequence[fx.Node]) -> list[fx.Node]:
        inside = set(region)
        return [n for n in region if any(u not in inside for u in n.users)]


def sequence_length(gm: fx.GraphModule) -> int | None:
    """The sequence length: the last dimension of the first integer user input (token ids)."""
    for ph in meta.placeholders(gm.graph, meta.Role.INPUT):
        v = _val(ph)
        if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dim() >= 1:
            return int(v.shape[-1])
    return None


def _tokenwise_sdim(node: fx.Node, sd: dict[fx.Node, int | None], t: int) -> int | None:
    """The output's sequence dim if ``node`` is token-wise given its inputs' ``sd``, else None."""
    pk, args = op_packet(node), node.args
    out = _val(node)
    x = args[0] if args else None
    s = sd.get(x) if isinstance(x, fx.Node) else None
    rank = _rank(x) if isinstance(x, fx.Node) else None
    if pk in _ELEMENTWISE:
        if pk is aten.dropout and args[1] != 0 and args[2]:
            return None  # random per call: a recomputed chunk would draw a different mask
        if not isinstance(out, torch.Tensor):
            return None
        r_out, found = out.dim(), set()
        tensors = [a for a in [*args, *node.kwargs.values()] if isinstance(a, fx.Node) and isinstance(_val(a), torch.Tensor)]
        for a in tensors:
            if sd.get(a) is not None:
                found.add(sd[a] + r_out - _val(a).dim())
        if len(found) != 1:
            return None
        so = found.pop()
        for a in tensors:
            if sd.get(a) is None:
                pos = so - (r_out - _val(a).dim())
                if 0 <= pos < _val(a).dim() and _val(a).shape[pos] != 1:
                    return None  # a full-length operand we cannot slice
        return so
    if pk is aten.embedding:
        return sd.get(args[1])
    if pk is aten.gather and isinstance(args[2], fx.Node) and sd.get(args[2]) is not None and sd.get(args[0]) is None:
        return sd[args[2]]  # a table read at each position's index (a token-type buffer by position ids): the index's shape
    if (pk is aten.index and sd.get(args[0]) is None and len(args[1]) == 1 and isinstance(args[1][0], fx.Node)
            and sd.get(args[1][0]) is not None):
        return sd[args[1][0]]  # table[ids]: a row per index (an expert's weights per token), the index's shape first
    if pk is aten.bmm and isinstance(args[1], fx.Node) and sd.get(x) == 0 and sd.get(args[1]) == 0:
        return 0  # one product per token (a token times its expert's gathered weights)
    if pk is aten.index_select and isinstance(args[2], fx.Node) and sd.get(args[2]) == 0 and sd.get(args[0]) is None:
        return _norm(args[1], _rank(args[0]))  # a gather by positions: output t reads the source at index[t]
    if pk is aten.cat and isinstance(out, torch.Tensor):
        d = _norm(args[1] if len(args) > 1 else node.kwargs.get("dim", 0), out.dim())
        # Empty pieces (an empty key/value cache) do not take part; with one piece left, the cat
        # is a copy of it, even along the sequence (a key/value cache's update in training).
        pieces = [a for a in args[0] if not (isinstance(_val(a), torch.Tensor) and _val(a).numel() == 0)]
        if len(pieces) == 1:
            return sd.get(pieces[0])
        sds = {sd.get(a) for a in pieces}
        s = sds.pop() if len(sds) == 1 else None
        return s if s is not None and d != s else None
    if pk is aten.stack and isinstance(out, torch.Tensor):  # along a new dim: the pieces' axis moves past it or stays
        d = _norm(args[1] if len(args) > 1 else node.kwargs.get("dim", 0), out.dim())
        sds = {sd.get(a) for a in args[0]}
        s = sds.pop() if len(sds) == 1 else None
        return None if s is None else s + (d <= s)
    if pk is aten.outer:  # (len(a), len(b)): the axis of whichever vector carries it (rotary angles)
        sa, sb = sd.get(args[0]), sd.get(args[1])
        return 0 if sa == 0 and sb is None else 1 if sb == 0 and sa is None else None
    if s is None or rank is None:
        return None
    if pk in _REDUCE:
        dims = args[1] if len(args) > 1 else node.kwargs.get("dim")
        if dims is None:
            return None
        dims = [_norm(d, rank) for d in ([dims] if isinstance(dims, int) else dims)]
        keep = args[2] if len(args) > 2 else node.kwargs.get("keepdim", False)
        return None if s in dims else (s if keep else s - sum(d < s for d in dims))
    if pk in (aten.softmax, aten.log_softmax):
        return None if _norm(args[1], rank) == s else s
    if pk in (aten.layer_norm, aten.rms_norm):
        return s if s < rank - len(args[1]) else None
    if pk is aten.linear:
        return s if s < rank - 1 else None
    if pk is aten.conv1d:  # (B, C, T): one tap reads its own position
        return s if s == rank - 1 and is_pointwise_conv1d(node) and sd.get(args[1]) is None else None
    if is_empty_pad(node):
        return s
    if pk is aten.matmul:
        w = args[1]
        ok = isinstance(w, fx.Node) and sd.get(w) is None and _rank(w) in (1, 2) and s < rank - 1
        return s if ok else None
    if pk in _VIEWS:
        shape_in, shape_out = list(_val(x).shape), list(out.shape)
        prefix = math.prod(shape_in[:s])
        for j in range(len(shape_out)):
            if math.prod(shape_out[:j]) == prefix and shape_out[j] == t:
                return j
        return None
    if pk is aten.transpose:
        a, b = _norm(args[1], rank), _norm(args[2], rank)
        return b if s == a else a if s == b else s
    if pk is aten.permute:
        return [_norm(d, rank) for d in args[1]].index(s)
    if pk is aten.unsqueeze:
        d = _norm(args[1], rank + 1)
        return s + 1 if d <= s else s
    if pk in (aten.select, aten.unbind):
        d = _norm(args[1] if len(args) > 1 else 0, rank)
        return None if d == s else s - (d < s)
    if pk in (aten.slice, aten.narrow):
        d = _norm(args[1] if len(args) > 1 else 0, rank)
        if d != s:
            return s
        return s if out.shape[d] == t else None  # a full slice keeps the axis; a shift does not
    if pk in (aten.chunk, aten.split, aten.split_with_sizes, aten.tensor_split):  # pieces along another dim keep the axis
        d = _norm(args[2] if len(args) > 2 else node.kwargs.get("dim", 0), rank)
        return None if d == s else s
    if pk is aten.repeat_interleave and len(args) > 2 and isinstance(args[2], int):  # along another dim (GPT-J's rotary tables)
        return None if _norm(args[2], rank) == s else s
    if pk is aten.topk:  # the k largest along another dim (a router's experts per token): values and indices keep the axis
        d = _norm(args[2] if len(args) > 2 else node.kwargs.get("dim", -1), rank)
        return None if d == s else s
    if pk is aten.expand:
        so = s + out.dim() - rank
        return so if out.shape[so] == t else None
    return None


def _source_sdim(node: fx.Node, t: int) -> int | None:
    """The sequence dim of a source: a user input, ``arange(seq_len)``, a prefix slice of a table."""
    v = _val(node)
    if not isinstance(v, torch.Tensor):
        return None
    if node.op == "placeholder" and node.meta.get(meta.ROLE) is meta.Role.INPUT:
        dims = [d for d, n in enumerate(v.shape) if n == t]
        return dims[-1] if dims else None
    pk = op_packet(node)
    if pk is aten.arange and v.dim() == 1 and v.shape[0] == t:
        return 0
    if pk is aten.index_select and v.shape[_norm(node.args[1], v.dim())] == t:
        return _norm(node.args[1], v.dim())  # a source cut to a rank's positions (sequence parallelism's slices)
    if pk is aten.slice and v.dim() >= 1:
        d = _norm(node.args[1], v.dim())
        start = node.args[2] if len(node.args) > 2 else 0
        if start in (0, None) and v.shape[d] == t:
            return d
    return None


def analyze(gm: fx.GraphModule, seq_len: int, mixes: Callable[[fx.Node], bool] | None = None, *,
            mixer_lengths: bool = False, merged: bool = False,
            whole_args: Callable[[fx.Node], Sequence[fx.Node]] | None = None) -> SeqAnalysis:
    """Sequence dims, token-wise nodes, regions by level, attention and loss matches. ``mixes``:
    the other ops whose output runs along their first argument's sequence axis, as attention's
    does (sequence parallelism's mixers, NOTE [Sequence mixers] in passes/sequence/sequence_mixers.py).
    With ``mixer_lengths`` (tiling), a mixer's node keeps the axis only where its output has
    ``seq_len`` positions there (NOTE [Mixers as tiling barriers]). With ``merged`` (sequence
    parallelism), the axis also runs through views that merge it with other axes (NOTE [The
    sequence axis merged with the batch] in passes/sequence/seq_merged.py). ``whole_args``: the
    arguments of a mixer's node that it reads without the sequence (a scan's A, D and initial
    state); a prefix slice whose axis reaches one of them is no source (NOTE [Prefix slices
    read along the sequence])."""
    not_sources: set[fx.Node] = set()
    while True:
        res, prefixes = _propagate(gm, seq_len, mixes, mixer_lengths, merged, not_sources)
        refuted = _prefixes_read_whole(gm, res, prefixes, whole_args) if whole_args is not None else set()
        if not refuted:
            break
        not_sources |= refuted
    split_regions(gm, res)
    res.losses = _find_losses(gm)
    return res


# NOTE [Prefix slices read along the sequence]
# A first-T slice ``slice(table, d, 0, T)`` of a sequence-free value is a source of the axis
# (rotary tables, a filter of the longest context cut to T) only where its sliced axis is the
# sequence. A slice of T channels is not: Mamba-2 scans each group of heads apart, with the
# group's channels ``A[:E/G]`` and ``D[:E/G]``, which at T = E/G are T long. The analysis
# follows each prefix slice's axis through the token-wise ops it reaches (``origins``: the
# prefix slices each node's axis comes from); where that axis reaches an argument a mixer reads
# without the sequence (the scan's A, D and initial state, ``whole_args``) and no other source's
# axis meets it on the way, the slice is no source, and the analysis runs again without it. The
# length alone does not decide; the data flow into the mixer does.
def _prefixes_read_whole(gm: fx.GraphModule, res: SeqAnalysis, prefixes: set[fx.Node],
                         whole_args: Callable[[fx.Node], Sequence[fx.Node]]) -> set[fx.Node]:
    """The prefix slices whose axis reaches, alone, an argument a mixer reads without the sequence."""
    if not prefixes:
        return set()
    origins: dict[fx.Node, frozenset[fx.Node] | None] = {}  # None: some other source's axis meets it
    for node in gm.graph.nodes:
        if node in prefixes:
            origins[node] = frozenset((node,))
        elif node in res.tokenwise:
            seq_in = [origins.get(a) for a in node.all_input_nodes if res.sdim.get(a) is not None]  # no entry: another source
            origins[node] = None if not seq_in or any(o is None for o in seq_in) else frozenset().union(*seq_in)
    refuted: set[fx.Node] = set()
    for node in gm.graph.nodes:
        for arg in whole_args(node):
            if isinstance(arg, fx.Node) and res.sdim.get(arg) is not None and origins.get(arg):
                refuted |= origins[arg]
    return refuted


def _propagate(gm: fx.GraphModule, seq_len: int, mixes: Callable[[fx.Node], bool] | None, mixer_lengths: bool, merged: bool,
               not_sources: set[fx.Node]) -> tuple[SeqAnalysis, set[fx.Node]]:
    """Sequence dims, token-wise nodes and levels; the prefix slices taken as sources."""
    res = SeqAnalysis(seq_len=seq_len)
    prefixes: set[fx.Node] = set()
    sd, tok, dep, level = res.sdim, res.tokenwise, {}, res.level
    res.attention = _find_attention(gm)
    # An attention's output runs along the query's sequence axis, whatever ops compute it.
    attention_out = {m.output: m.q for m in res.attention}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        inputs = node.all_input_nodes
        seq_in = [a for a in inputs if sd.get(a) is not None]
        if node.op == "call_function" and node.target is operator.getitem and node.args[0] in tok:
            sd[node] = sd[node.args[0]]
            tok.add(node)
            if node.args[0] in res.outer:
                res.outer[node] = res.outer[node.args[0]]
        elif node.op == "call_function" and seq_in and op_packet(node) not in _LOSSES:
            if merged:
                sd[node] = merged_tokenwise_sdim(node, sd, res.outer, seq_len, _tokenwise_sdim)
            else:
                sd[node] = _tokenwise_sdim(node, sd, seq_len)
            if sd[node] is not None:
                tok.add(node)
        if node not in tok:
            if meta.marked_sequence_dim(node) is not None:  # an attention output of a sequence-parallel rank's slice
                sd[node] = meta.marked_sequence_dim(node)
            elif is_sdpa(node) or is_blocked_attention(node):
                sd[node] = sd.get(node.args[0])
            elif mixes is not None and mixes(node):
                sd[node] = _mixer_sdim(node, sd, seq_len, mixes) if mixer_lengths else sd.get(node.args[0])
            elif mixer_lengths and mixes is not None and (s := _mixer_prefix_sdim(node, sd, seq_len, mixes)) is not None:
                sd[node] = s
            elif node in attention_out:
                sd[node] = sd.get(attention_out[node])
            elif node.op == "call_function" and node.target is operator.getitem and is_blocked_attention(node.args[0]):
                sd[node] = sd.get(node.args[0])  # out (B, H, Tq, D) and lse (B, H, Tq): both dim 2
            elif not any(dep.get(a) for a in inputs):
                sd[node] = _source_sdim(node, seq_len) if not seq_in and node not in not_sources else None
                if sd[node] is not None and op_packet(node) is aten.slice:
                    prefixes.add(node)
            else:
                sd.setdefault(node, None)
        dep[node] = node in tok or any(dep.get(a) for a in inputs)
        if node in tok:
            level[node] = max([0] + [level[a] + (0 if a in tok or not dep[a] else 1) for a in inputs])
        else:
            level[node] = max([0] + [level[a] for a in inputs]) if dep[node] else 0
    return res, prefixes


def split_regions(gm: fx.GraphModule, res: SeqAnalysis, mixers: set[fx.Node] = frozenset()) -> None:
    """``res.regions`` and ``res.feeds_attention`` from the token-wise nodes by level, each level
    split into the rest and what only computes the inputs of attention or of ``mixers`` (NOTE
    [Attention inputs are recomputed, not saved])."""
    by_level: dict[int, list[fx.Node]] = {}
    live = _live_nodes(gm.graph)  # dead code is no region: a rewrite's dead-code elimination would drop it
    for node in gm.graph.nodes:
        if node in res.tokenwise and node in live:
            by_level.setdefault(res.level[node], []).append(node)
    consumers = {m.output for m in res.attention} | {m.scores for m in res.attention if m.scores is not None}
    consumers |= {n for n in gm.graph.nodes if is_sdpa(n) or is_blocked_attention(n)} | set(mixers)
    res.regions, res.feeds_attention = [], []
    for k in sorted(by_level):
        rest, attn_in = _split_attention_inputs(by_level[k], consumers)
        for part, feeds in ((rest, False), (attn_in, True)):
            for component in _components(part):  # NOTE [One region per connected part]
                res.regions.append(component)
                res.feeds_attention.append(feeds)


def _live_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes the graph's output depends on, and those with side effects."""
    live: set[fx.Node] = set()
    stack = [n for n in graph.nodes if n.op == "output" or n.is_impure()]
    while stack:
        n = stack.pop()
        if n not in live:
            live.add(n)
            stack.extend(n.all_input_nodes)
    return live


# NOTE [One region per connected part]
# The token-wise nodes of one level can be several unconnected parts: a Hyena block's implicit
# filter (an MLP over the positions, computed from parameters alone) sits at level 0 in every
# block, beside the embedding's region. Taken as one region, the level-0 region of a model with
# N blocks holds N filters (the hyena-1m model cut to 2 blocks: 55 ops, cut to 3: 78), so no
# region matches from one block to the next and a plan folded from cut models cannot
# extrapolate (NOTE [Tiling the same in every cut] in zerofx/compiler/folding.py). Each
# weakly connected part is its own region. A part of a convex set is convex (a path between two
# nodes of one part that crossed into another would connect them), so each part is chunked as a
# region is, and the parts, being unconnected, run in any order. A source node of the level (no
# input inside it) read by several parts would join them all: under sequence parallelism the
# rank's positions (``arange`` plus its offset) feed the embedding's gather and every block's
# filter. Where two of the parts a source feeds are copies of one part (the same ops in the same
# order: one per block), the source is a region of its own, upstream of them; otherwise it joins
# the parts it feeds into one region (the DNA LM's positions feed its embedding's
# gather and the labels' gather, which stay one region).
def _components(region: list[fx.Node]) -> list[list[fx.Node]]:
    """``region``'s weakly connected parts (edges between its own nodes), each in graph order,
    ordered by their first node."""
    inside = set(region)
    union = NodeUnion(region)
    sources = [n for n in region if not any(a in inside for a in n.all_input_nodes)]
    peeled = set(sources)
    for n in region:
        for a in n.all_input_nodes:
            if a in inside and a not in peeled:
                union.join(a, n)
    members = union.parts(n for n in region if n not in peeled)

    def signature(root: fx.Node) -> tuple[str, ...]:
        return tuple(str(n.target) for n in members.get(root, ()))

    for source in sources:  # joins the parts it feeds, unless two of them are copies of one part
        users = {union.find(u) for u in source.users if u in inside}
        signatures = [signature(root) for root in users]
        if len(set(signatures)) < len(signatures):
            continue  # a region of its own: NOTE [One region per connected part]
        for root in users:
            union.join(root, source)
    return list(union.parts(region).values())


class NodeUnion:
    """Union-find over FX nodes: which of ``nodes`` are joined into one part."""

    def __init__(self, nodes: Iterable[fx.Node]) -> None:
        self._parent = {n: n for n in nodes}

    def find(self, n: fx.Node) -> fx.Node:
        """The root of ``n``'s part."""
        parent = self._parent
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def join(self, a: fx.Node, b: fx.Node) -> None:
        self._parent[self.find(a)] = self.find(b)

    def parts(self, nodes: Iterable[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
        """``nodes`` by the root of their part, each part in the order given."""
        out: dict[fx.Node, list[fx.Node]] = {}
        for n in nodes:
            out.setdefault(self.find(n), []).append(n)
        return out


def _mixer_sdim(node: fx.Node, sd: dict[fx.Node, int | None], t: int, mixes: Callable[[fx.Node], bool]) -> int | None:
    """NOTE [Mixers as tiling barriers]
    Tiling without sequence parallelism reads the same registry of ops that mix positions
    (convolutions, FFTs, cumsum, scans, flips) as barriers between regions, so the token-wise
    ops between two of them (a Hyena block's projections, gates and MLP) form a region and are
    chunked, as between two attentions. A barrier must hand the axis on with its true length:
    the region after it is sliced by chunks of ``seq_len`` positions. A mixer's node takes the
    axis of the first input along the chain of mixer nodes it reads (a causal pad before its
    conv, the scan op before its ``y``) and keeps it only where its own output has ``seq_len``
    positions there: an ``rfft(u, n=2T)`` (T + 1 bins) or a padded input (T + K - 1) has none,
    and neither have the products of bins after it. The axis comes back at the first-T prefix
    ``slice(x, d, 0, T)`` of a mixer's longer output (``_mixer_prefix_sdim``: the FFT
    convolution's ``irfft(...)[..., :T]``, the ``Conv1d(padding=K - 1)`` output's ``[..., :T]``).
    The chunked ops never include a mixer's own nodes, which run whole; what else runs along
    the axis without a mixer is still a barrier that drops it, as before."""
    cur = node
    while True:
        src = cur.args[0] if cur.args else None
        if not isinstance(src, fx.Node):
            return None
        if sd.get(src) is not None:
            break
        if not mixes(src):
            return None
        cur = src
    s, out = sd[src], _val(node)
    return s if isinstance(out, torch.Tensor) and s < out.dim() and out.shape[s] == t else None


def _mixer_prefix_sdim(node: fx.Node, sd: dict[fx.Node, int | None], t: int, mixes: Callable[[fx.Node], bool]) -> int | None:
    """The axis of ``slice(x, d, 0, T)`` of a mixer's output ``x`` that has no axis of its own
    (NOTE [Mixers as tiling barriers])."""
    if op_packet(node) is not aten.slice or not isinstance(node.args[0], fx.Node):
        return None
    x, out = node.args[0], _val(node)
    if not mixes(x) or sd.get(x) is not None or not isinstance(out, torch.Tensor):
        return None
    d = _norm(node.args[1] if len(node.args) > 1 else 0, out.dim())
    start = node.args[2] if len(node.args) > 2 else 0
    step = node.args[4] if len(node.args) > 4 else 1
    return d if start in (0, None) and step == 1 and out.shape[d] == t else None


def _split_attention_inputs(region: list[fx.Node], consumers: set[fx.Node]) -> tuple[list[fx.Node], list[fx.Node]]:
    """``region`` as (the rest, the nodes whose every user is an attention op or another such
    node); see NOTE [Attention inputs are recomputed, not saved]. The rest never reads the second
    part, so both stay convex and the rest runs first."""
    inside, only = set(region), set()
    for n in reversed(region):
        if n.users and all(u in consumers or u in only for u in n.users):
            only.add(n)
    # A tuple's item stays with the tuple: a region's outputs are tensors.
    only -= {n for n in only if n.target is operator.getitem and n.args[0] not in only}
    if not only or len(only) == len(region):
        return region, []
    return [n for n in region if n not in only], [n for n in region if n in only and n in inside]


# --------------------------------------------------------------------------- attention
def _single_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _attention_reason(q: fx.Node, k: fx.Node, v: fx.Node, mask: fx.Node | None) -> str | None:
    qv, kv, vv = _val(q), _val(k), _val(v)
    if not all(isinstance(x, torch.Tensor) and x.dim() == 4 for x in (qv, kv, vv)):
        return "q, k and v must be 4-d (batch, heads, sequence, head_dim)"
    if kv.shape[1] != vv.shape[1] or qv.shape[1] % kv.shape[1] != 0:
        return f"query heads {qv.shape[1]} are not a multiple of key/value heads {kv.shape[1]}, {vv.shape[1]}"
    if mask is not None and getattr(_val(mask), "requires_grad", False):
        return "the attention mask requires grad"
    return None


def _find_attention(gm: fx.GraphModule) -> list[AttentionMatch]:
    found = []
    for node in gm.graph.nodes:
        if is_sdpa(node):
            q, k, v = node.args[:3]

            def get(i: int, name: str, default: object, node: fx.Node = node) -> object:  # node bound: called in this iteration only
                return node.args[i] if len(node.args) > i else node.kwargs.get(name, default)

            mask, dropout, causal = get(3, "attn_mask", None), get(4, "dropout_p", 0.0), get(5, "is_causal", False)
            scale = node.kwargs.get("scale") or 1.0 / math.sqrt(_val(q).shape[-1])
            reason = _attention_reason(q, k, v, mask)
            if dropout:
                reason = f"dropout_p={dropout}; only dropout-free attention is tiled (accepted: 0.0)"
            if not node.kwargs.get("enable_gqa") and reason is None and _val(q).shape[1] != _val(k).shape[1]:
                reason = f"query heads {_val(q).shape[1]} differ from key/value heads {_val(k).shape[1]} without enable_gqa"
            found.append(AttentionMatch(node, q, k, v, mask, bool(causal), float(scale), "sdpa", reason))
        elif op_packet(node) is aten.matmul:
            m = match_softmax_attention(node)
            if m is not None:
                found.append(m)
    return found


def match_softmax_attention(scores: fx.Node) -> AttentionMatch | None:
    """``matmul(q, kᵀ) [* c | / c]* [+ mask] -> softmax(-1) [-> to] [-> dropout(p=0)] -> matmul(., v)``; a scale
    after the mask is not SDPA's order, and is not matched."""
    q, kt = scores.args[:2]
    if not isinstance(kt, fx.Node) or op_packet(kt) is not aten.transpose or _rank(kt) != 4:
        return None
    if {_norm(kt.args[1], 4), _norm(kt.args[2], 4)} != {2, 3}:
        return None
    k, scale, mask, cur = kt.args[0], 1.0, None, scores
    while (nxt := _single_user(cur)) is not None:
        pk = op_packet(nxt)
        if pk in (aten.mul, aten.div) and nxt.args[0] is cur and isinstance(nxt.args[1], (int, float)) and mask is None:
            scale = scale * nxt.args[1] if pk is aten.mul else scale / nxt.args[1]
        elif pk is aten.add and cur in nxt.args[:2] and mask is None and len(nxt.args) == 2:
            mask = nxt.args[1] if nxt.args[0] is cur else nxt.args[0]  # scores + mask or mask + scores
            if not isinstance(mask, fx.Node):
                return None
        else:
            break
        cur = nxt
    sm = _single_user(cur)
    if sm is None or op_packet(sm) is not aten.softmax or _norm(sm.args[1], 4) != 3:
        return None
    cur = sm
    while (nxt := _single_user(cur)) is not None and op_packet(nxt) in (aten.to, aten._to_copy, aten.dropout):
        if op_packet(nxt) is aten.dropout and nxt.args[1] != 0 and nxt.args[2]:
            return None
        cur = nxt
    out = _single_user(cur)
    if out is None or op_packet(out) is not aten.matmul or out.args[0] is not cur:
        return None
    v = out.args[1]
    if mask is not None and _val(mask).dtype == torch.bool:
        return None
    return AttentionMatch(out, q, k, v, mask, False, float(scale), "softmax", _attention_reason(q, k, v, mask), scores)


# --------------------------------------------------------------------------- loss
def _find_losses(gm: fx.GraphModule) -> list[LossMatch]:
    found = []
    for node in gm.graph.nodes:
        if op_packet(node) not in _LOSSES:
            continue
        args = list(node.args) + [None] * 6
        logits, target = args[0], args[1]
        weight = args[2] if args[2] is not None else node.kwargs.get("weight")
        reduction = args[3] if args[3] is not None else node.kwargs.get("reduction", 1)
        ignore = args[4] if args[4] is not None else node.kwargs.get("ignore_index", -100)
        smoothing = args[5] if args[5] is not None else node.kwargs.get("label_smoothing", 0.0)
        chain, cur = [], logits
        while isinstance(cur, fx.Node) and op_packet(cur) in _LOSS_CHAIN and len(cur.users) == 1:
            if op_packet(cur) is aten.slice and _norm(cur.args[1], _rank(cur)) == _rank(cur) - 1:
                break
            chain.append(cur)
            cur = cur.args[0]
        if not (isinstance(cur, fx.Node) and op_packet(cur) is aten.linear and len(cur.users) == 1):
            continue
        reason = None
        if weight is not None or smoothing:
            reason = "class weights or label smoothing"
        elif reduction not in (1, 2):
            reason = f"reduction={reduction}; tiled are mean (1) and sum (2)"
        elif _rank(logits) != 2 or _rank(target) != 1:
            reason = "logits must be (N, V) and the target (N,)"
        found.append(LossMatch(node, cur, tuple(reversed(chain)), target, int(reduction), int(ignore), reason))
    return found
