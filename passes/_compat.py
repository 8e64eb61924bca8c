"""Every torch import that is not plain ``torch.*`` public API lives here.

Tested with torch 2.13.0 (the version pinned in the README). When torch moves one of
these, this is the only file to touch.

- ``functorch.compile``: AOTAutograd's documented entry points (``aot_function``, the
  partitioners, ``make_boxed_func``); the same machinery a ``torch.compile`` backend built
  with ``aot_autograd`` runs. ``torch._functorch.config``: its documented switches, patched
  for one call (``cse``, NOTE [Our own CSE instead of the partitioner's] in passes/cse.py;
  ``check_custom_op_aliasing``, NOTE [Custom ops in a compiled graph's first call]).
- ``torch._subclasses.fake_tensor.FakeTensorMode``: fake tensors, so planning a 1B-parameter
  model at world size 1024 allocates no parameter memory. ``FakeTensor(mode, meta_tensor,
  device)``, a private constructor, rebuilds a cached graph's fake values (``fake_tensor``).
- ``torch.ops._c10d_functional``: functional collectives (an op returns a tensor, a separate
  ``wait_tensor`` op waits for it), the form torch's own overlap tooling reads;
  ``torch.ops._c10d_functional_autograd.all_to_all_single``: the all-to-all with its gradient
  (another all-to-all), for sequence parallelism. ``torch._C._distributed_c10d._register_process_group``:
  the name a graph's collectives resolve their group by (``register_group_name``).
- ``torch.utils.checkpoint.CheckpointPolicy``: the recompute tag the min-cut partitioner honours.
- ``torch.utils._pytree``: flattening of nested call arguments (``tree_flatten`` and friends),
  re-exported as ``pytree`` for capture, the engine and the passes.
- ``torch.fx.experimental.proxy_tensor.make_fx`` (``pre_dispatch=True``): the forward before
  autograd, for tiling; ``torch.fx.traceback.preserve_node_meta``: carries a forward node's
  ``recompute`` tag onto the nodes AOTAutograd traces from it; ``torch.fx.traceback.annotate``
  (marked not backward-compatible): puts a dict into ``meta["custom"]`` of the nodes traced
  inside it, how the sequence-parallel rewrite marks its attention outputs for tiling.
- ``torch.fx.graph.CodeGen`` with ``Graph.set_codegen``: FX's hook for the Python a graph
  compiles to (documented on ``Graph.set_codegen``; marked not backward-compatible). We use it
  for a boxed calling convention (``boxed_graph_module``); FX's own ``_BoxedCodeGen`` is private.
- ``torch.fx._lazy_graph_module``: ``_LazyGraphModule``, the GraphModule torch's own
  compilers build (``torch._dynamo.config.use_lazy_graph_module``), which writes its Python
  code on first call or first read of ``.code`` instead of at every ``recompile()`` (NOTE [Code
  written on first use]).
- ``torch._inductor.compile``: Inductor's documented entry point for an FX graph captured
  without Dynamo ("Compile a given FX graph with TorchInductor"), imported on first use.
- ``torch.ops.higher_order.map_impl`` and ``torch.ops.higher_order.scan``: the control-flow
  operators behind ``torch._higher_order_ops.map`` and ``scan`` (prototype features), which hold
  one body subgraph and run it once per slice of their inputs' first dim. AOTAutograd,
  functionalization and fake tensors trace through them, the min-cut partitioner moves them,
  and Inductor lowers both to a ``while_loop`` (NOTE [One body per tiled region] in
  passes/tiling/chunk_loop.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from functorch.compile import (  # noqa: F401  (re-exported)
    aot_function,
    make_boxed_func,
    min_cut_rematerialization_partition,
)
from torch._guards import detect_fake_mode  # noqa: F401  (re-exported)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: F401  (re-exported)
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: F401  (re-exported)
from torch.fx.traceback import annotate, preserve_node_meta  # noqa: F401  (re-exported)
import torch.utils._pytree as pytree  # noqa: F401  (re-exported: torch's pytree utilities are private)
from torch.utils.checkpoint import CheckpointPolicy  # noqa: F401  (re-exported)


# NOTE [Code written on first use]
# Capture and lowering recompile the graphs about 17 times (each pass ends in ``recompile()``),
# and planning (``zerofx plan``, the budget searches, ``--solve``) never runs the result. A
# GraphModule writes and compiles its whole Python source at every recompile; a lazy one only
# marks it stale, and writes it when called or when ``.code`` is read, so what runs is always
# the current graph. For the `small` DNA LM at 4 ranks, stage 3, compile plus report fell from
# 3.6-4.9 to 3.0-3.7 CPU-seconds (three runs of three compiles each, interleaved).
def make_graph_module(root: torch.nn.Module | dict[str, Any], graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A GraphModule over ``graph`` whose Python code is written on first use."""
    return _LazyGraphModule(root, graph)


def lazy_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` as a GraphModule whose code is written on first use (``gm`` itself if it is one)."""
    return _LazyGraphModule.from_graphmodule(gm)


def lazy_graph_modules() -> Any:
    """A context in which torch's tracers and partitioners build lazy GraphModules too."""
    return _use_lazy_graph_module(True)


def min_cut_partition_without_cse(joint: torch.fx.GraphModule, inputs: Any, *, num_fwd_outputs: int) -> Any:
    """The min-cut partitioner with its own CSE off (``passes.cse`` has run instead)."""
    import torch._functorch.config as functorch_config

    with functorch_config.patch(cse=False):
        return min_cut_rematerialization_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs)

class _BoxedInputsCodeGen(torch.fx.graph.CodeGen):
    """Python for a graph called as ``gm(args_list)``: it unpacks the list into its
    placeholders and empties it, so each input's last reference is the graph's own local,
    which the generated code drops right after the input's last use."""

    def gen_fn_def(self, free_vars: list[str], maybe_return_annotation: str, **_: Any) -> str:
        names = [v.split(":")[0].split("=")[0].strip() for v in free_vars if v != "self"]
        fn_name = getattr(self, "_func_name", "forward")
        lines = [f"def {fn_name}(self, args_list){maybe_return_annotation}:"]
        if names:
            lines.append(f"    {', '.join(names)}, = args_list")  # a wrong count raises here
            lines.append("    args_list.clear()")
        return "\n".join(lines)


def boxed_graph_module(gm: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """A copy of ``gm`` called as ``copy(args_list)`` that empties ``args_list`` and frees each
    input after its last use (NOTE [Boxed graphs] in zerofx/compiler/program.py). None where ``gm`` has
    a custom codegen (pytree inputs) this cannot carry over."""
    if type(gm.graph._codegen) is not torch.fx.graph.CodeGen:
        return None
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph.set_codegen(_BoxedInputsCodeGen())
    return torch.fx.GraphModule(gm, graph, class_name=type(gm).__name__)


c10d_functional = torch.ops._c10d_functional
ALL_GATHER = c10d_functional.all_gather_into_tensor.default
# The same all-gather into a caller's buffer; what lowered graphs run (NOTE [gloo's completion
# race] in passes/zero/gather_into_buffers.py).
ALL_GATHER_INTO = c10d_functional.all_gather_into_tensor_out.default
REDUCE_SCATTER = c10d_functional.reduce_scatter_tensor.default
ALL_REDUCE = c10d_functional.all_reduce.default
WAIT = c10d_functional.wait_tensor.default

ALL_TO_ALL = c10d_functional.all_to_all_single.default
ALL_TO_ALL_AUTOGRAD = torch.ops._c10d_functional_autograd.all_to_all_single.default  # traced before autograd

COLLECTIVE_TARGETS = (ALL_GATHER, ALL_GATHER_INTO, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL, ALL_TO_ALL_AUTOGRAD)

# PyTorch's blocked (flash) attention kernel on CPU and its backward: what
# scaled_dot_product_attention dispatches to there. Used by zerofx::blocked_attention.
CPU_FLASH_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_FLASH_ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

# One body subgraph run per slice of the inputs' first dim: ``map_impl(body, xs, args)`` stacks
# the body's outputs; ``scan(body, init, xs, args)`` threads a carry through and stacks the rest.
MAP_LOOP = torch.ops.higher_order.map_impl
SCAN_LOOP = torch.ops.higher_order.scan
LOOP_TARGETS = (MAP_LOOP, SCAN_LOOP)


# NOTE [Spent partitioner tags]
# A rank graph is one side of a joint graph the min-cut partitioner has already split, and its
# nodes keep the tags that split read: ``recompute`` (the planner's MUST_RECOMPUTE) and the
# ``autograd_backward`` mark AOTAutograd puts on backward nodes. Inductor reads the same tags
# as a request: its remat pass for forward-loss-backward graphs (Dynamo's
# ``torch.autograd.grad`` inside one graph) takes each contiguous run of marked nodes as a
# backward region and refuses a graph with more than one region that holds recomputed
# inputs. Every node zerofx inserts after partitioning (gathers, reduce-scatters, the
# all-to-all and its sum, fetches, hand-offs) is unmarked and splits a run, so a backward
# graph of two blocks or more was refused. Inductor compiles a copy without those tags:
# the partition they asked for is done.
SPENT_PARTITIONER_TAGS = ("recompute", "ac_graph_id", "autograd_backward")


def without_partitioner_tags(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of ``gm`` (its nodes' ``meta`` dicts copied, values shared) without the
    partitioner's spent tags; ``gm`` is left as it is (NOTE [Spent partitioner tags])."""
    graph = torch.fx.Graph()
    value, old_output = graph.graph_copy(gm.graph, {}, return_output_node=True)  # node_copy copies each meta dict
    graph.output(value, type_expr=old_output.type).meta = dict(old_output.meta)
    graph._codegen = gm.graph._codegen  # how the graph is called (a CodeGen is stateless)
    for node in graph.nodes:
        for tag in SPENT_PARTITIONER_TAGS:
            node.meta.pop(tag, None)
    return torch.fx.GraphModule(gm, graph)


# NOTE [Inductor keeps the planned order]
# zerofx plans where each collective and each wait goes (prefetch distance, sunk waits) and
# predicts the step's overlap and peak memory from that order (the memory timeline, the
# overlap model). Inductor's scheduler reorders by default: ``reorder_for_peak_memory`` and
# ``reorder_for_locality`` moved every wait right after its collective in the 25m DNA LM's
# backward, so the main thread waited 0.20 s a step for communication the FX run hides
# (0.04 s). Both are turned off for the rank graphs: Inductor still fuses, and issues the
# kernels in the graph's order. Measured on 2 CPU cores, 3 interleaved rounds of fresh ranks at
# stage 3 (25m, 2x512 tokens a rank): under glibc's default allocator the planned order steps in
# 1.64 s against 1.70 s at a 50 MiB lower peak; under a 256 KiB mmap threshold, where every
# large tensor is a new mapping, Inductor's own order is faster (1.98 s against 2.18 s, and at
# stage 2 under a cap 3.9-4.0 s against 4.1-4.4 s) at a 6-20 MiB higher peak. With the graphs
# called boxed, the whole-job search's compiled choice under that cap (stage 2,
# micro-batch 1 x 2, 115 recomputed) steps 4-5% faster in Inductor's order but peaks 104 MiB
# higher (967 against 863 MiB; by hand with ``benchmarks.bench_capped.measure``, 3 interleaved
# rounds of fresh ranks; which values its schedule keeps longer is not examined). The planned order is what the cost model prices, and what a GPU's caching
# allocator makes cheap.
INDUCTOR_OPTIONS = {"reorder_for_peak_memory": False, "reorder_for_locality": False,
                    "unsafe_marked_cacheable_functions": {f"torch.ops.higher_order.{op.name()}": torch.__version__ for op in LOOP_TARGETS}}
# NOTE [Loops in Inductor's cache]
# Inductor's FX graph cache passes over ("bypass") any graph holding a higher-order operator
# that is not marked cacheable, and ``map_impl`` and ``scan`` are not: a tiled rank graph (NOTE
# [One body per tiled region] in passes/tiling/chunk_loop.py) would be compiled again by every
# rank, and the child's compile (NOTE [Inductor compiles first in a child] in
# zerofx/compiler/program.py) would be lost. The key the cache makes already holds each body:
# it pickles the graph module with its submodules, whose code is part of it. So both are marked
# cacheable (``unsafe_marked_cacheable_functions``, keyed by torch's version) for the rank
# graphs' compiles only, through the options of each call.


# NOTE [Inductor's graphs are called boxed]
# ``torch._inductor.compile`` returns AOTAutograd's ``forward(*args)``, which holds every input
# in its argument tuple until the compiled graph returns. For a backward graph those inputs are
# the saved activations, so none is freed before the whole backward ends, where the FX graphs
# free each after its last use (NOTE [Boxed graphs] in zerofx/compiler/program.py). Under that
# wrapper is AOTAutograd's boxed runtime wrapper, which takes the list, empties it, and lets
# Inductor's code free each input after its last use; the graphs are called through it. The
# unwrapping reads torch's own ``__wrapped__`` chain (``functools.wraps``): where it does not
# find a boxed function, or the graph module holds parameters the outer wrapper would have
# prepended, the unboxed call is kept (right, with the higher peak), and
# ``test_inductor_graphs_are_called_boxed`` fails.
_AOT_UNBOXED_FORWARD = "aot_module_simplified.<locals>.forward"


def _boxed(compiled: Callable[..., Any], gm: torch.fx.GraphModule) -> Callable[[list[Any]], Any] | None:
    if any(True for _ in gm.parameters()) or any(True for _ in gm.buffers()):
        return None
    fn: Any = compiled
    while getattr(fn, "__qualname__", "") == _AOT_UNBOXED_FORWARD and hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    if fn is compiled or not getattr(fn, "_boxed_call", False):
        return None
    return fn


def inductor_cache_enabled() -> bool:
    """Whether Inductor keeps what it compiles in its on-disk cache (``TORCHINDUCTOR_FX_GRAPH_CACHE``)."""
    import torch._inductor.config

    return bool(torch._inductor.config.fx_graph_cache)


def compile_in_this_process() -> None:
    """Inductor compiles in the calling process, with no pool of worker processes. Set on its
    config rather than through ``TORCHINDUCTOR_COMPILE_THREADS``, which Inductor reads when its
    config is imported: a rank forked from a server that imported it would not see the variable."""
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1


# NOTE [Inductor's cache needs a shape environment]
# Inductor keeps what it compiled in an on-disk cache (the FX graph cache) keyed by the graph,
# its inputs' shapes and strides and the options, but only where the fake-tensor mode it traces
# under has a shape environment; called with real tensors outside Dynamo it makes a mode
# without one and bypasses the cache ("No shape env"), so every rank of every run compiled its
# graphs from the start. Under a tracing context whose fake mode has a (static) shape
# environment the cache applies. Measured on the tiny model's stage-3 rank graphs (one process,
# a cache hit against the bypass): 2.4 s against 8.0-10.2 s to compile, and 31 MiB against
# 54-67 MiB left resident after it, since a hit skips the lowering whose objects partly stay in
# the process (NOTE [Inductor compiles first in a child] in zerofx/compiler/program.py makes
# the rank's own compile a hit). Every input, real or fake (the capture's fakes are of a mode
# without a shape environment), is made again as a fake of this mode: nothing is allocated,
# and the graph Inductor traces, whose code is part of the key, is the same from either (from
# real tensors its nodes were named otherwise, and a compile from fakes missed for real ones).
#
# The key holds every stride, also those of dimensions of size 1, which address nothing: a
# saved value whose fake is an ``expand`` (stride 0 there) and whose real tensor is contiguous
# (stride of the next dimension times its size) would key the child's compile from fakes and
# the rank's own from real tensors differently, and the rank would compile its backward again.
# Each such stride is keyed as a contiguous tensor's; the compiled code checks no stride of a
# dimension of size 1 (``assert_size_stride``), and an index into one is always 0.
def cache_strides(t: torch.Tensor) -> tuple[int, ...]:
    """``t``'s strides with each dimension of size 1 given a contiguous tensor's stride there
    (NOTE [Inductor's cache needs a shape environment])."""
    strides = list(t.stride())
    for dim in reversed(range(t.dim())):
        if t.shape[dim] == 1:
            strides[dim] = strides[dim + 1] * max(t.shape[dim + 1], 1) if dim + 1 < t.dim() else 1
    return tuple(strides)


def inductor_compile(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable[[list[Any]], Any]:
    """``gm`` compiled by TorchInductor for inputs like ``example_inputs``, in its own order
    (NOTE [Inductor keeps the planned order]), as a function of a list of inputs that it empties
    (NOTE [Inductor's graphs are called boxed])."""
    import torch._inductor
    from torch._guards import TracingContext, tracing
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # A fake mode with a shape environment, so Inductor's cache applies (NOTE [Inductor's cache needs a shape environment]).
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    with fake_mode:  # every input as a fake of this mode, nothing allocated: fakes and real tensors key the cache alike
        inputs = [torch.empty_strided(t.shape, cache_strides(t), dtype=t.dtype, device=t.device) if isinstance(t, torch.Tensor) else t
                  for t in example_inputs]
    with tracing(TracingContext(fake_mode)):
        compiled = torch._inductor.compile(without_partitioner_tags(gm), inputs, options=dict(INDUCTOR_OPTIONS))
    del inputs
    boxed = _boxed(compiled, gm)
    if boxed is None:
        def unboxed(args_list: list[Any]) -> Any:
            args = tuple(args_list)
            args_list.clear()
            return compiled(*args)

        unboxed.unboxed = True  # type: ignore[attr-defined]
    return _without_custom_op_check(boxed if boxed is not None else unboxed)


# NOTE [Custom ops in a compiled graph's first call]
# AOTAutograd's runtime wrapper runs the first call of each compiled graph under a
# TorchDispatchMode that checks every custom op's outputs for aliases of its inputs
# (``torch._functorch.config.check_custom_op_aliasing``). torch.func's transforms do not run
# under a dispatch mode ("Cannot access storage of TensorWrapper"), and a custom op's kernel
# runs below autograd, so a kernel that differentiates with ``torch.func.vjp`` (the selective
# scan's backward, ``zerofx::selective_scan_backward`` in zerofx/models/scan.py; a user's
# declared mixer may do the same) fails in the first call of a compiled graph that holds it,
# while the FX graphs, which AOTAutograd does not wrap, run it. The check is off for the rank
# graphs' calls: each op a zerofx graph calls returns new tensors (the scan clones its state),
# and the sequence-parallel parity run under Inductor (tests/test_sp_inductor.py) checks what
# they compute.
def _without_custom_op_check(fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    """``fn`` called with AOTAutograd's custom-op aliasing check off (NOTE [Custom ops in a
    compiled graph's first call]); ``fn``'s ``unboxed`` mark is kept."""
    import torch._functorch.config as functorch_config

    def call(args_list: list[Any]) -> Any:
        with functorch_config.patch(check_custom_op_aliasing=False):
            return fn(args_list)

    call.unboxed = getattr(fn, "unboxed", False)  # type: ignore[attr-defined]
    return call


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group: Any = None) -> None:
    """Every rank's ``shard`` concatenated into ``output`` (a blocking collective). torch 2.13
    names it ``dist.all_gather_single`` and deprecates ``all_gather_into_tensor``, the only
    name before; the CUDA machines run torch 2.11."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, shard, group=group)


def set_group_timeout(group: Any, timeout: Any) -> None:
    """Every later collective on ``group`` fails after ``timeout`` (a ``timedelta``) instead of the
    backend's default (30 minutes for gloo). torch's ``distributed_c10d._set_pg_timeout`` is
    private; without it (another torch) the group keeps the timeout it was created with."""
    import torch.distributed.distributed_c10d as c10d

    set_timeout = getattr(c10d, "_set_pg_timeout", None)
    if set_timeout is not None:
        set_timeout(timeout, group)


def register_group_name(name: str, group: Any) -> None:
    """Make ``name`` resolve to ``group`` in functional collectives on this rank. Each rank
    registers its own sub-group (its sequence group, its shard group) under one name that every
    rank shares, so every rank's graphs are the same code. torch names groups itself
    (``group.group_name``, different for each sub-group); the registry is private."""
    import torch._C._distributed_c10d as c10d_c

    try:
        c10d_c._unregister_process_group(name)
    except Exception:  # noqa: BLE001  (not registered yet)
        pass
    c10d_c._register_process_group(name, group)


def resolve_group_name(name: str) -> Any:
    """The process group registered under ``name`` on this rank (``register_group_name``, or
    torch's own name for a group), as functional collectives resolve it; the resolver is private."""
    import torch._C._distributed_c10d as c10d_c

    return c10d_c._resolve_process_group(name)


def fake_tensor(fake_mode: FakeTensorMode, shape: tuple[int, ...], stride: tuple[int, ...], storage_offset: int, dtype: torch.dtype,
                device: torch.device) -> FakeTensor:
    """A fake tensor of ``fake_mode`` with this layout, built directly around a meta tensor: about
    seven times faster than ``torch.empty_strided`` under the mode, which goes through its
    dispatch cache (``zerofx.compiler.plan_cache`` rebuilds thousands of ``meta['val']``). ``FakeTensor``'s
    constructor is private."""
    elem = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    if storage_offset:
        elem = elem.as_strided(shape, stride, storage_offset)
    return FakeTensor(fake_mode, elem, device)


def op_address(target: Any) -> tuple[str, str, str | None] | None:
    """(namespace, name, overload) of an operator overload, (namespace, name, None) of an
    operator packet, else None: how ``zerofx.compiler.plan_cache`` stores a graph's ops (``torch._ops``'
    classes are private), and finds them again with ``op_at``."""
    if isinstance(target, torch._ops.OpOverload):
        return (target.namespace, target._opname, target._overloadname)
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace, name = target._qualified_op_name.split("::")
        return (namespace, name, None)
    if isinstance(target, torch._ops.HigherOrderOperator) and getattr(torch.ops.higher_order, target.name(), None) is target:
        return ("higher_order", target.name(), None)
    return None


def op_at(namespace: str, name: str, overload: str | None) -> Any:
    """The operator ``op_address`` described (its library must be registered)."""
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


def graph_codegen(graph: torch.fx.Graph) -> torch.fx.graph.CodeGen:
    """The codegen a graph writes its Python with (``Graph.set_codegen`` sets it; reading it back
    has no public accessor)."""
    return graph._codegen


def fake_process_group(world_size: int, rank: int = 0) -> None:
    """Initialise torch.distributed with the fake backend, for planning and shape checks only.

    The fake backend returns wrong data on purpose; never train under it.
    """
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
