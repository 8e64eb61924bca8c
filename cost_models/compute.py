"""Compute cost: FLOPs and bytes per ATen op, turned into seconds with a device profile.

Pure: a function of ``node.meta['val']`` shapes and a frozen ``DeviceSpec``. Matrix products
and attention are FLOP-bound; everything else is modelled as memory-bound (bytes read and
written over memory bandwidth).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

aten = torch.ops.aten


# The names CPU device profiles take: the built-in one and those ``zerofx calibrate`` writes.
CPU_PROFILE_PREFIXES = ("cpu", "calibrated-cpu")


@dataclass(frozen=True)
class DeviceSpec:
    """The rates one rank computes at (what the model assumes it reaches, not the datasheet's
    peak), and its memory (None: not stated; planners then take the budget from the config).

    ``memory_curve``: (bytes moved, bytes/s) of copies of several sizes repeated over the same
    tensors, ascending, where measured: the rate of kernels whose operands are still in cache,
    as the optimizer update's are (NOTE [Bandwidth by working-set size]); empty:
    ``memory_bytes_per_s`` for those too.
    ``cores``: the compute units the ranks on one host share, where a rank is a process on a
    CPU core rather than a device of its own (None: every rank has its own device); the rates
    are one core's (NOTE [Ranks sharing cores]). ``runtime_bytes``: the resident memory of a
    rank before it holds any model state (NOTE [What a rank's resident memory holds] in
    cost_models/memory.py); 0 where unmeasured. ``fresh_s_per_byte``: the extra seconds per byte
    of a new tensor of at least ``fresh_min_bytes`` whose pages the kernel writing it faults in
    first (NOTE [New tensors' pages]); 0 where unmeasured. ``update_s_per_element_pass``: torch's
    default AdamW update timed, per element and per pass of ``OPTIMIZER_PASSES`` (NOTE [The
    optimizer update's time]); 0 where unmeasured. ``inductor_bytes``: the memory a rank keeps
    after Inductor has compiled its graphs, beyond ``runtime_bytes`` (NOTE [What Inductor keeps
    resident] in cost_models/memory.py); None where unmeasured, and then the whole-job search
    does not price ``"compile": "inductor"``."""

    name: str
    matmul_flops_per_s: float
    memory_bytes_per_s: float
    memory_capacity_bytes: float | None = None
    memory_curve: tuple[tuple[float, float], ...] = ()
    cores: int | None = None
    runtime_bytes: float = 0.0
    fresh_s_per_byte: float = 0.0
    fresh_min_bytes: float = 0.0
    update_s_per_element_pass: float = 0.0
    inductor_bytes: float | None = None

    def __post_init__(self) -> None:
        # A profile file gives lists; the spec keeps tuples (frozen, hashable, equal on reload).
        object.__setattr__(self, "memory_curve", tuple((float(b), float(r)) for b, r in self.memory_curve))
        assert all(a[0] < b[0] for a, b in zip(self.memory_curve, self.memory_curve[1:])), self.memory_curve

    @property
    def memory_is_host(self) -> bool:
        """Whether a rank's memory is host memory: a CPU profile, built in (``cpu``) or from
        ``zerofx calibrate``. There, what is offloaded to host memory stays in the rank's memory
        (NOTE [Host offload on a CPU rank] in cost_models/offload.py)."""
        return self.name.startswith(CPU_PROFILE_PREFIXES)


# NOTE [Bandwidth by working-set size]
# A kernel that streams tensors a kernel just before it touched reads them from cache, not DRAM.
# The optimizer update is such a sequence: about 8 kernels in a row over the same 3-4 tensors of
# one parameter (NOTE [The optimizer update's time]), a working set of a few MiB per parameter.
# ``zerofx calibrate`` times a copy repeated over the same source at several sizes
# (``memory_curve``), which is that access pattern; on this project's machine (1 MiB L2 per core,
# 32 MiB L3 shared) copies up to 32 MiB run at 40-50 GB/s, 128 MiB at under 2 GB/s. A kernel
# moving B bytes runs at the rate measured for the smallest size at or above B (the largest's
# beyond it): the slower neighbour, never an extrapolation. The graph's ops keep
# ``memory_bytes_per_s``, the DRAM rate: their operands are the step's activations, produced and
# consumed across a layer, and with the cache rate the 25m DNA LM's step at 256 tokens per rank
# estimated a third of the measured step (``benchmarks/bench_predictions.py``).
# A profile that holds a measured update (``update_s_per_element_pass``) prices the update from it
# instead (NOTE [The optimizer update's time]).
def memory_rate(spec: DeviceSpec, moved_bytes: float) -> float:
    """Bytes/s of a kernel that moves ``moved_bytes`` of tensors still in cache (NOTE [Bandwidth
    by working-set size])."""
    for size, rate in spec.memory_curve:
        if moved_bytes <= size:
            return rate
    return spec.memory_curve[-1][1] if spec.memory_curve else spec.memory_bytes_per_s


# One CPU core of this project's machine, one thread per rank, measured with `zerofx calibrate`:
# a 512x512 fp32 matmul and a 64 MiB copy.
CPU_CORE = DeviceSpec("cpu-core", 74e9, 2.2e9)

# The share of the datasheet's dense bf16 peak a transformer's matrix products reach: ~60%, the
# model FLOPs utilization large-model training reports on H100 (e.g. ~50-60% MFU in Meta's
# Llama 3 paper, 400 TFLOP/s per GPU of 989) rounded up for the matmuls alone.
MATMUL_EFFICIENCY = 0.6
# The share of the HBM peak a streaming kernel reaches (~90% in STREAM-like copies on H100).
MEMORY_EFFICIENCY = 0.9
# H100 SXM5: 989.4 TFLOP/s dense BF16 (1,979 with sparsity), 80 GB HBM3 at 3.35 TB/s
# (NVIDIA H100 Tensor Core GPU datasheet).
H100_PEAK_BF16_FLOPS = 989.4e12
H100 = DeviceSpec("h100", H100_PEAK_BF16_FLOPS * MATMUL_EFFICIENCY, 3.35e12 * MEMORY_EFFICIENCY, 80e9)
# H200 SXM: the same Hopper tensor cores (989.4 TFLOP/s dense BF16), 141 GB HBM3e at 4.8 TB/s
# (NVIDIA H200 Tensor Core GPU datasheet).
H200_PEAK_BF16_FLOPS = 989.4e12
H200 = DeviceSpec("h200", H200_PEAK_BF16_FLOPS * MATMUL_EFFICIENCY, 4.8e12 * MEMORY_EFFICIENCY, 141e9)

DEVICES = {spec.name: spec for spec in (CPU_CORE, H100, H200)}


# NOTE [Ranks sharing cores]
# On a CPU host each rank is a process with one compute thread, and the profile's rates are one
# core's (``zerofx calibrate`` times them with every core busy, one rank each). When more ranks
# than cores run on one host, the OS time-slices them: each rank computes at ``cores / ranks`` of
# a core's rate, and its compute takes ``ranks / cores`` times as long. 4 gloo ranks on this
# project's 2 cores measure each rank's matmuls at half the 2-rank rate. Every per-core cost
# stretches alike: a new tensor's page faults (``fresh_s_per_byte``, the kernel zeroing pages on
# the same core) and the timed optimizer update, besides the rates. Left at one core's cost, the
# faults of 4 ranks on 2 cores were priced at half what they take, and their steps predicted at
# 0.69-0.80 of the measured (with ``MALLOC_MMAP_THRESHOLD_`` at 256 KiB, where every activation
# faults); 0.80-0.92 with them stretched. Ranks no more than the cores, and devices of their own
# (``cores`` None), run at the full rate.
def rank_device(spec: DeviceSpec, ranks_on_host: int) -> DeviceSpec:
    """The rates one of ``ranks_on_host`` ranks on one host computes at (NOTE [Ranks sharing cores])."""
    assert ranks_on_host >= 1, ranks_on_host
    if spec.cores is None or ranks_on_host <= spec.cores:
        return spec
    share = spec.cores / ranks_on_host
    return replace(spec, matmul_flops_per_s=spec.matmul_flops_per_s * share, memory_bytes_per_s=spec.memory_bytes_per_s * share,
                   memory_curve=tuple((size, rate * share) for size, rate in spec.memory_curve),
                   fresh_s_per_byte=spec.fresh_s_per_byte / share, update_s_per_element_pass=spec.update_s_per_element_pass / share)


def _numel(val: object) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel()
    if isinstance(val, (list, tuple)):
        return sum(_numel(v) for v in val)
    return 0


def value_bytes(val: object) -> int:
    """Bytes of a node's value: a tensor, or a tuple/list of them (multi-output ops)."""
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(value_bytes(v) for v in val)
    return 0


def _shape(node: object) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape) if isinstance(node, fx.Node) else ()


def estimate_flops(node: fx.Node) -> int:
    """Floating-point operations of one node (2 per multiply-add)."""
    t = node.target
    if t is aten.mm.default:
        (m, k), (_, n) = _shape(node.args[0]), _shape(node.args[1])
        return 2 * m * k * n
    if t is aten.addmm.default:
        (m, k), (_, n) = _shape(node.args[1]), _shape(node.args[2])
        return 2 * m * k * n
    if t in (aten.bmm.default, aten.baddbmm.default):
        a, b = (node.args[0], node.args[1]) if t is aten.bmm.default else (node.args[1], node.args[2])
        (bs, m, k), (_, _, n) = _shape(a), _shape(b)
        return 2 * bs * m * k * n
    name = getattr(t, "__name__", "")
    if "scaled_dot_product" in name:
        q, k = _shape(node.args[0] if "backward" not in name else node.args[1]), _shape(node.args[1] if "backward" not in name else node.args[2])
        return _attention_flops(q, k[-2], backward="backward" in name)
    custom = _custom_flops(node)
    if custom is not None:
        return custom
    return _numel(node.meta.get("val"))


def _attention_flops(q: tuple[int, ...], keys: int, *, backward: bool) -> int:
    """QK^T and PV over ``keys`` keys for queries ``q`` (B, H, T, D); the backward twice that."""
    qk_and_pv = 2 * 2 * math.prod(q[:-2]) * q[-2] * keys * q[-1]
    return qk_and_pv * (2 if backward else 1)


# NOTE [Custom ops' FLOPs]
# zerofx's own kernels (passes/tiled_kernels.py, passes/sequence/ring_attention.py) are custom ops, opaque
# to the graph: priced as every unknown op, by the bytes they read and write, a tiled attention
# (``zerofx::blocked_attention``, which calls the CPU flash kernel that SDPA calls) cost 0.025 s
# per step where the profiler measured 0.72 s, and the 25m DNA LM's step at 2x1024 tokens with
# tiling was predicted at 0.67 of the measured. So the ones that multiply matrices are counted
# as the ATen ops they run: attention as SDPA (a ring attention over every rank's keys), a
# feature-tiled linear as its product, the chunked loss as the head's product (the backward
# computes the logits again: three products); the roofline then applies as to ``mm``. Their
# names are matched as strings: cost models import nothing from the passes.
_ATTENTION_OPS = {"zerofx::blocked_attention": False, "zerofx::blocked_attention_backward": True,
                  "zerofx::ring_attention": False, "zerofx::ring_attention_backward": True}
_LINEAR_OPS = {"zerofx::feature_tiled_linear": 1, "zerofx::feature_tiled_linear_backward": 2,
               "zerofx::chunked_linear_cross_entropy": 1, "zerofx::chunked_linear_cross_entropy_backward": 3}


def _custom_op_name(node: fx.Node) -> str:
    return getattr(getattr(node.target, "_schema", None), "name", "")


def _custom_flops(node: fx.Node) -> int | None:
    """FLOPs of one of zerofx's custom ops that multiply matrices (NOTE [Custom ops' FLOPs]); None for any other node."""
    name = _custom_op_name(node)
    if name in _ATTENTION_OPS:
        backward = _ATTENTION_OPS[name]
        q, k = _shape(node.args[1 if backward else 0]), _shape(node.args[2 if backward else 1])
        ring = 1
        if "ring" in name:  # the ring's size: ring_attention's 8th argument, its backward's 11th
            position = 10 if backward else 7
            ring = node.args[position] if len(node.args) > position else node.kwargs["size"]
        return _attention_flops(q, k[-2] * int(ring), backward=backward)
    if name in _LINEAR_OPS:
        # (x or grad, ...) then the weight (N, K): x's rows times K times N per product.
        x_arg = 1 if name.endswith("_backward") else 0
        x, w = _shape(node.args[x_arg]), _shape(node.args[x_arg + 1])
        return 2 * (math.prod(x) // x[-1]) * w[1] * w[0] * _LINEAR_OPS[name]
    return None


def is_matmul_like(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", "")
    return (node.target in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default) or "scaled_dot_product" in name
            or _custom_op_name(node) in _ATTENTION_OPS or _custom_op_name(node) in _LINEAR_OPS)


# NOTE [Views move nothing]
# A view (``view``, ``t``, ``permute``, ``slice``, ``expand``, ``split``, ...; an ATen op whose
# schema returns an alias of its input) makes a new tensor header over the same storage: it reads
# and writes no element. Costing it as memory-bound at its output's bytes counted stage 3's
# per-parameter views of every gathered bucket, and every transpose of a weight, as copies.
# ``_unsafe_view`` is a view whose schema does not say so (it returns a fresh tensor over the
# input's storage after a copy that the graph already holds as its own node).
def writes_in_place(node: fx.Node) -> bool:
    """Whether ``node`` writes into a tensor it was given (``copy_``, ``add_``, an ``out=``
    collective) instead of allocating its output (NOTE [New tensors' pages])."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def is_view_op(node: fx.Node) -> bool:
    """Whether ``node`` aliases its input instead of computing (NOTE [Views move nothing])."""
    return bool(getattr(node.target, "is_view", False)) or node.target is aten._unsafe_view.default


# NOTE [A matmul is bound by its bytes too]
# The roofline: a matrix product takes the longer of its FLOPs at the matmul rate and its
# operands and output at the memory rate. Its FLOPs per byte are 2 * M * K * N over
# 4 * (M * K + K * N + M * N): with few tokens per rank (M small) and a wide weight, reading the
# weight from memory takes longer than the multiply-adds. The 100m DNA LM at 128 tokens per rank
# multiplies (128, 768) by (768, 2048): 0.40 GFLOP over 7.7 MB, memory-bound on this project's
# CPU (106 GFLOP/s, 1.8 GB/s); at 256 tokens the 25m's (256, 512) by (512, 1536) is FLOP-bound.
# NOTE [A loop is its body, per chunk]
# A tiled region runs as one loop node over one body subgraph (``map_impl`` in forward, ``scan``
# in backward; NOTE [One body per tiled region] in passes/tiling/chunk_loop.py). Its time is
# its body's, each node priced as any other, times the chunks it runs over (the first dim of its
# mapped inputs); the memory timeline adds the body's peak at the loop node.
LOOP_TARGETS = (torch.ops.higher_order.map_impl, torch.ops.higher_order.scan)


def loop_body(node: fx.Node) -> tuple[fx.GraphModule, int] | None:
    """A loop node's body and the number of chunks it runs it on; None for any other node (NOTE
    [A loop is its body, per chunk])."""
    if node.op != "call_function" or node.target not in LOOP_TARGETS:
        return None
    body_node, mapped = node.args[0], node.args[1] if node.target is LOOP_TARGETS[0] else node.args[2]
    owner = node.graph.owning_module
    if owner is None or not isinstance(body_node, fx.Node) or not mapped:
        return None
    body = getattr(owner, body_node.target)
    return body, int(mapped[0].meta["val"].shape[0])


def estimate_node_s(node: fx.Node, spec: DeviceSpec) -> float:
    """Seconds one node takes: FLOP-bound for matrix products and attention, nothing for views,
    a loop its body's time per chunk, else memory-bound."""
    if node.op != "call_function" or node.target is operator.getitem or is_view_op(node):
        return 0.0
    loop = loop_body(node)
    if loop is not None:
        body, chunks = loop
        return chunks * sum(estimate_node_s(n, spec) for n in body.graph.nodes)
    produced = value_bytes(node.meta.get("val"))
    moved = produced + sum(value_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    fresh = (produced * spec.fresh_s_per_byte
             if spec.fresh_s_per_byte and produced >= spec.fresh_min_bytes and not writes_in_place(node) else 0.0)
    if is_matmul_like(node):
        # The roofline (NOTE [A matmul is bound by its bytes too]).
        return max(estimate_flops(node) / spec.matmul_flops_per_s, moved / spec.memory_bytes_per_s) + fresh
    return moved / spec.memory_bytes_per_s + fresh


# NOTE [New tensors' pages]
# Every non-view op of a graph allocates its output. Where the allocator maps a large block fresh
# from the OS (glibc above ``M_MMAP_THRESHOLD``, which the memory benchmarks set to 256 KiB so
# that freed tensors leave the resident set), the kernel writing it first takes a page fault per
# 4 KiB page: on this project's machine 0.41 s per GB more than writing memory already mapped,
# against 0.06 s per GB under glibc's default, which keeps freed blocks for reuse. The bandwidth
# terms price bytes moved through mapped memory only, so ``zerofx calibrate`` measures that extra
# cost (an 8 MiB tensor allocated and filled, against the same fill of a kept one) as
# ``fresh_s_per_byte``, with ``fresh_min_bytes`` the process's ``MALLOC_MMAP_THRESHOLD_`` (8 MiB,
# the size measured, where it is not set), and each output at least that large pays it. An op
# that writes into a tensor it was given (``copy_`` into a parameter, an ``out=`` collective)
# allocates nothing and pays none.


# NOTE [The optimizer update's time]
# The step's optimizer update runs between backward (with its reductions) and the next forward,
# on the elements a rank owns (all of them at stage 0, its shard from stage 1). torch's
# single-tensor update is a sequence of elementwise kernels, each reading and writing whole
# state-sized tensors, so it is memory-bound: its time is the element passes it makes, times 4
# bytes (fp32 state), over memory bandwidth. Counted from torch/optim/adam.py (``_single_tensor_adam``,
# the CPU default), in tensors read plus tensors written per kernel:
#   AdamW: decoupled weight decay param.mul_ (2), exp_avg.lerp_(grad) (3),
#          exp_avg_sq.mul_ (2) and .addcmul_(grad, grad) (3), denom = sqrt (2), / (2), add_ (2),
#          param.addcdiv_(exp_avg, denom) (4): 20 passes, 80 bytes per element;
#   Adam (no weight decay by default): 18 passes; SGD: param.add_(grad) (3);
#   SGD with momentum: buf.mul_ (2), buf.add_(grad) (3), param.add_(buf) (3): 8 passes.
# Where the profile holds a measured update (``zerofx calibrate`` times torch's default AdamW
# over a shard-like set of tensors: ``update_s_per_element_pass``), the update takes that per
# element and pass, scaled by the passes: the pass count alone misses what the kernels add to
# their bytes (the foreach path's temporaries are new tensors whose pages fault in, the sqrt and
# the division allocate), and on this project's machine torch's AdamW steps 12.7M elements in
# 0.074 s where the memory curve of in-place copies predicts 0.02 s and of new copies 0.19 s.
# torch's fused Adam and AdamW (``fused=True``, config key ``zerofx.fused_optimizer``) run one
# kernel over every tensor: each element's parameter, gradient and two moments read once and
# the parameter and moments written once, 7 passes, priced at the same per-pass rate.
OPTIMIZER_PASSES = {"AdamW": 20, "Adam": 18, "SGD": 3, "SGD+momentum": 8}
FUSED_OPTIMIZER_PASSES = {"AdamW": 7, "Adam": 7}
STATE_ITEMSIZE = 4  # optimizer state and the updated master elements are fp32


def estimate_optimizer_step_s(owned_numels: Iterable[int], optimizer: str, spec: DeviceSpec, *, fused: bool = False) -> float:
    """Seconds of one optimizer update over parameter tensors of ``owned_numels`` elements
    each (NOTE [The optimizer update's time]); ``fused``: torch's fused kernel where the
    optimizer has one."""
    passes = OPTIMIZER_PASSES.get(optimizer, OPTIMIZER_PASSES["AdamW"])
    if fused:
        passes = FUSED_OPTIMIZER_PASSES.get(optimizer, passes)
    if spec.update_s_per_element_pass > 0:
        return passes * sum(owned_numels) * spec.update_s_per_element_pass
    total = 0.0
    for numel in owned_numels:
        # Each kernel streams 3-4 tensors of the parameter's size: that is its working set.
        tensor_bytes = numel * STATE_ITEMSIZE
        total += passes * tensor_bytes / memory_rate(spec, 3 * tensor_bytes) if numel else 0.0
    return total


# NOTE [Fused kernels under Inductor]
# With ``"zerofx": {"compile": "inductor"}`` each rank graph runs as Inductor's generated code:
# the matrix products, attention, convolutions and zerofx's own ops stay library calls, and every
# connected run of the other ATen ops between them (pointwise ops, reductions, the views among
# them) becomes a few generated loops that keep their intermediates in registers and cache. Such
# a run reads what it takes from outside once and writes only what is used outside it, so the
# schedule prices it as one memory-bound kernel over those bytes (and the pages of its new
# outputs, NOTE [New tensors' pages]), charged at its last node; the library calls keep
# ``estimate_node_s``. This counts the bytes of a perfect fusion: Inductor splits a run where a
# reduction's shape differs from its neighbours' (a layer norm's statistics, then the normalized
# output) and reads the shared input again, so it is a lower bound on the run's traffic.
# Collectives (``_c10d_functional``) and custom ops are not ATen ops, so a run never crosses
# them. The optimizer update is a separate matter (NOTE [The optimizer update's time]).
_LIBRARY_OPS = frozenset({"aten::convolution", "aten::convolution_backward", "aten::_fft_r2c", "aten::_fft_c2r", "aten::_fft_c2c",
                          "aten::sort", "aten::topk", "aten::randperm"})


def _runs_fused(node: fx.Node) -> bool:
    """Whether Inductor generates ``node``'s code as part of a fused run (NOTE [Fused kernels under Inductor])."""
    if node.op != "call_function" or node.target is operator.getitem or is_matmul_like(node):
        return False
    name = _custom_op_name(node)
    return name.startswith(("aten::", "prims::")) and name not in _LIBRARY_OPS


def _source(node: fx.Node) -> fx.Node:
    """The tensor a chain of views ends at: what a fused run reads for it."""
    while is_view_op(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def fused_node_seconds(graph: fx.Graph, spec: DeviceSpec) -> dict[fx.Node, float]:
    """Seconds of each node of ``graph`` as Inductor runs it (NOTE [Fused kernels under Inductor]):
    a fused run's time at its last node and 0 at the others, ``estimate_node_s`` for the rest."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    parent: dict[fx.Node, fx.Node] = {}

    def find(n: fx.Node) -> fx.Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    fused = [n for n in graph.nodes if _runs_fused(n) and not is_view_op(n)]
    for n in fused:
        parent[n] = n
    for n in fused:
        for a in n.all_input_nodes:
            s = _source(a)
            if s in parent:
                parent[find(s)] = find(n)
    runs: dict[fx.Node, list[fx.Node]] = {}
    for n in fused:
        runs.setdefault(find(n), []).append(n)
    seconds = {n: estimate_node_s(n, spec) for n in graph.nodes if n not in parent}
    for members in runs.values():
        inside = set(members)
        read: dict[fx.Node, int] = {}
        written = 0.0
        for n in members:
            for a in n.all_input_nodes:
                s = _source(a)
                if s not in inside:
                    read[s] = max(read.get(s, 0), value_bytes(a.meta.get("val")))
            if _used_outside(n, inside):
                produced = value_bytes(n.meta.get("val"))
                written += produced
                if spec.fresh_s_per_byte and produced >= spec.fresh_min_bytes and not writes_in_place(n):
                    written += produced * spec.fresh_s_per_byte * spec.memory_bytes_per_s
        for n in members:
            seconds[n] = 0.0
        seconds[max(members, key=order.__getitem__)] = (sum(read.values()) + written) / spec.memory_bytes_per_s
    return seconds


def _used_outside(node: fx.Node, inside: set[fx.Node]) -> bool:
    """Whether ``node``'s value is read by anything outside ``inside``, through views, or is an output."""
    for user in node.users:
        if is_view_op(user):
            if _used_outside(user, inside):
                return True
        elif user not in inside:
            return True
    return False


def rebuild_seconds(nodes: Sequence[fx.Node], spec: DeviceSpec, *, fused: bool = False) -> dict[fx.Node, float]:
    """Seconds each of ``nodes`` takes when backward computes it again to rebuild a recomputed
    activation: ``estimate_node_s``, or under Inductor (``fused``), for an op it fuses, only the
    reading of what it takes from outside ``nodes``: the rebuilt run is generated into the
    backward kernel that reads the activation, so its output is never written (NOTE [Fused
    kernels under Inductor])."""
    if not fused:
        return {n: estimate_node_s(n, spec) for n in nodes}
    inside = set(nodes)
    out: dict[fx.Node, float] = {}
    for n in nodes:
        if _runs_fused(n):
            read = sum(value_bytes(a.meta.get("val")) for a in n.all_input_nodes if _source(a) not in inside)
            out[n] = 0.0 if is_view_op(n) else read / spec.memory_bytes_per_s
        else:
            out[n] = estimate_node_s(n, spec)
    return out
