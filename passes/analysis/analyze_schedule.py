"""Planner (read only): where a rank's step spends its time and memory, from the lowered graphs.

Expects one rank's graph modules (``forward``, ``backward``, optionally ``param_sync``) as
``zerofx.compiler.pipeline.lower`` makes them, and the Plan they came from. Changes nothing. Reads
``zerofx_fqn`` / ``zerofx_role`` on placeholders and ``zerofx_comm_fqns`` on collectives.

NOTE [The overlap model]
A small discrete-event simulation. Compute runs node by node in graph order, each taking
``estimate_node_s``. Collectives run one at a time on a communication channel, in the order
they are issued; each starts when it is issued and the channel is free, and takes its
alpha-beta time. A ``wait_tensor`` blocks compute until its collective is done: the time it
blocks is *exposed* communication. The rest is hidden behind compute. The sends inside a ring
attention op (NOTE [Ring attention] in passes/sequence/ring_attention.py) are modelled as blocking: compute
waits for all of each: an upper bound, since the op receives the next block while it attends to the
current one.

NOTE [Naming a node by its module]
The schedule names layers, not FX nodes. Capture (AOTAutograd over ``functional_call``) leaves no
``nn_module_stack`` on the nodes, and the backward's ``fwd_nn_module_stack`` is empty, so a node
is named from the parameters it reads. A parameter is a placeholder holding it whole
(``zerofx_fqn``: stages 0-2, and stage 3's persistent parameters) or, at stage 3, its columns of
a waited all-gather (NOTE [Bucket layout]: the column slice at offset o_i is the bucket's i-th
parameter; the whole bucket when the columns are not separated yet); anything computed from one
parameter alone (a view, a cast, a transpose) is that parameter too. A node that reads
parameters belongs to their module: the FQN without its last component (``blocks.3.attn`` for
``blocks.3.attn.qkv.weight``), the longest common prefix when it reads several. A node that
reads none (an activation, a softmax, a gradient) belongs to the module of the last node before
it that did. Graph order is execution order, so a collective is "issued after" the module whose
compute ran last before it and "waited at" the module whose compute comes first after its wait.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from zerofx.cost_models.comm import CommSpec, estimate_all_gather_s, estimate_all_reduce_s, estimate_reduce_scatter_s
from zerofx.cost_models.compute import (DeviceSpec, estimate_node_s, estimate_optimizer_step_s, fused_node_seconds, rank_device, value_bytes,
                                        writes_in_place)
from zerofx.cost_models.memory_timeline import TimelinePoint, collective_copy_bytes, peak, saved_activations, step_timeline
from zerofx.passes import meta
from zerofx.passes.analysis.check_collectives import GRAPH_ORDER
from zerofx.passes.plan import REPLICATE, Plan
from zerofx.passes.sequence.sequence_parallel import all_mixers
from zerofx.common.units import format_bytes

aten = torch.ops.aten
# Where a graph has no compute before a collective, or none after its wait.
START, END = "(start)", "(end)"
# torch's autograd sequence number, which AOTAutograd records on the joint graph's nodes: a
# backward node carries the number of the forward op it differentiates.
SEQ_NR = "seq_nr"


@dataclass(frozen=True)
class CollectiveRow:
    order: int
    graph: str
    op: str
    bucket: tuple[str, ...]
    bytes_per_rank: int
    issued_after: str  # the node after which it is issued
    waited_at: str  # the wait node
    overlap_compute_s: float  # compute that runs between issue and wait
    comm_s: float
    exposed_s: float
    start_s: float  # when the channel starts it, from the step's start (simulated)
    end_s: float
    # NOTE [Naming a node by its module]: the module whose compute ran last before the issue, and
    # the one whose compute comes first after the wait; START / END at a graph's ends.
    issued_after_module: str = ""
    waited_at_module: str = ""
    bucket_label: str = ""  # the bucket's module, or its first and last parameter


@dataclass(frozen=True)
class Span:
    """A stretch of one graph's execution on the compute timeline (simulated)."""

    graph: str
    start_s: float
    end_s: float


# NOTE [An optimizer step of several micro-batches]
# A report simulates one pass through the graphs: forward, backward, then what runs once per
# optimizer step (stage 1's gradient reduce-scatter, the update, stage 1-2's parameter
# all-gather). With gradient accumulation the first two run once per micro-batch, collectives
# they hold included (stage 2's reduce-scatters, stage 3's gathers), and the rest once, so an
# optimizer step of N micro-batches takes ``step_s + (N - 1) * micro_batch_s``. ``zerofx plan``
# reports both; the search prices candidates the same way.
MICRO_BATCH_GRAPHS = ("forward", "backward")


def optimizer_step_s(report: ScheduleReport | Any, micro_batches: int) -> float:
    """An optimizer step's seconds with ``micro_batches`` micro-batches (NOTE [An optimizer step
    of several micro-batches])."""
    return report.step_s + (micro_batches - 1) * report.micro_batch_s


@dataclass(frozen=True)
class ScheduleReport:
    rows: tuple[CollectiveRow, ...]
    spans: tuple[Span, ...]
    compute_s: Mapping[str, float]
    exposed_s: float
    step_s: float
    persistent_bytes: int
    peak: TimelinePoint
    timeline: tuple[TimelinePoint, ...]
    peak_module: str = ""  # the module the peak's node belongs to (NOTE [Naming a node by its module])
    timeline_s: tuple[float, ...] = ()  # when each timeline point's node is done, from the step's start (simulated)
    saved_bytes: int = 0  # the activations the forward saves for backward (NOTE [Recompute in rounds])

    @property
    def comm_s(self) -> float:
        return sum(r.comm_s for r in self.rows)

    @property
    def micro_batch_s(self) -> float:
        """The part of ``step_s`` each micro-batch repeats (NOTE [An optimizer step of several micro-batches])."""
        return sum(s.end_s - s.start_s for s in self.spans if s.graph in MICRO_BATCH_GRAPHS)

    @property
    def bytes_moved_per_rank(self) -> int:
        return sum(r.bytes_per_rank for r in self.rows)


def _owner(fqn: str) -> str:
    """The module that holds parameter ``fqn`` (a root parameter names itself)."""
    return fqn.rpartition(".")[0] or fqn


def module_label(fqns: Sequence[str]) -> str:
    """The module that owns parameters ``fqns``: the longest common module path, else the
    modules themselves (``embed + norm``; ``a … z`` for more than two)."""
    owners = list(dict.fromkeys(_owner(f) for f in fqns))
    if len(owners) <= 1:
        return owners[0] if owners else ""
    common: list[str] = []
    for parts in zip(*(o.split(".") for o in owners)):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    if common:
        return ".".join(common)
    return " + ".join(owners) if len(owners) == 2 else f"{owners[0]} … {owners[-1]}"


def bucket_label(bucket: Sequence[str], all_fqns: Sequence[str]) -> str:
    """A bucket in module terms: its one parameter; the module when the bucket holds exactly that
    module's parameters (``blocks.3 (7 tensors)``); else its first and last parameter, inside
    their common module when they have one (``blocks.3: attn_norm.weight … mlp.up.weight (6 tensors)``)."""
    if len(bucket) <= 1:
        return bucket[0] if bucket else ""
    owner = module_label(bucket)
    if owner and " " in owner:  # no common module
        owner = ""
    if owner and set(bucket) == {f for f in all_fqns if f.startswith(owner + ".")}:
        return f"{owner} ({len(bucket)} tensors)"
    first, last = (f.removeprefix(owner + ".") for f in (bucket[0], bucket[-1]))
    return f"{owner + ': ' if owner else ''}{first} … {last} ({len(bucket)} tensors)"


def _is_compute(node: fx.Node) -> bool:
    return node.op == "call_function" and not meta.is_collective(node) and not meta.is_wait(node)


def _bucket_columns(wait: fx.Node, bucket: tuple[str, ...], plan: Plan) -> dict[fx.Node, tuple[str, ...]]:
    """The column slices of a waited, gathered bucket, each with the parameter it holds (NOTE
    [Bucket layout]: parameter i starts at the sum of the shard sizes before it)."""
    fqn_at, offset = {}, 0
    for f in bucket:
        fqn_at[offset] = f
        try:
            offset += plan.param(f).shard_numel
        except KeyError:  # not a planned parameter: leave the bucket whole
            return {}
    columns: dict[fx.Node, tuple[str, ...]] = {}
    for grid in wait.users:  # the (N, S) view
        for col in grid.users:
            if (col.op == "call_function" and col.target is aten.slice.Tensor and len(col.args) >= 3 and col.args[0] is grid
                    and col.args[1] == 1 and col.args[2] in fqn_at):
                columns[col] = (fqn_at[col.args[2]],)
    return columns


def _parameter_reads(graph: fx.Graph, plan: Plan) -> dict[fx.Node, tuple[str, ...]]:
    """The nodes that are parameters, with the FQNs each may be (NOTE [Naming a node by its module])."""
    sources: dict[fx.Node, tuple[str, ...]] = {}
    for ph in meta.placeholders(graph, meta.Role.PARAM):
        if meta.COMM_FQNS not in ph.meta and meta.FQN in ph.meta:  # held whole (a shard's placeholder has COMM_FQNS)
            sources[ph] = (ph.meta[meta.FQN],)
    for wait in graph.nodes:
        collective = wait.args[0] if meta.is_wait(wait) else None
        if isinstance(collective, fx.Node) and meta.is_all_gather(collective) and collective.meta.get(meta.COMM_FQNS):
            bucket = tuple(collective.meta[meta.COMM_FQNS])
            sources[wait] = bucket
            if len(bucket) > 1:
                sources.update(_bucket_columns(wait, bucket, plan))
    reads: dict[fx.Node, tuple[str, ...]] = {}
    for source, chain in meta.derived_only_from(graph, list(sources), set()).items():
        for node in chain:
            reads[node] = sources[source]
    return reads


def _between(before: str, after: str) -> str:
    """The module of a node that reads no parameter, between nodes of modules ``before`` and
    ``after``: their parent when they are siblings (``blocks.0.attn`` for the attention between
    ``blocks.0.attn.qkv`` and ``blocks.0.attn.out``), else ``before``."""
    parent = before.rpartition(".")[0]
    return parent if parent and after.rpartition(".")[0] == parent and after != before else before


def name_modules(gm: fx.GraphModule, plan: Plan, known: Mapping[int, str] | None = None) -> dict[fx.Node, str]:
    """Each node's module (NOTE [Naming a node by its module]); "" for the nodes that only feed a
    collective its message (a sharded bucket's pack and receive buffer) and before the first
    parameter. ``known`` maps autograd sequence numbers to the forward graph's modules: a backward
    node computes the gradient of the forward op with its number, in that op's module."""
    graph = gm.graph
    reads = _parameter_reads(graph, plan)
    message_only = {ph for ph in meta.placeholders(graph, meta.Role.PARAM) if meta.COMM_FQNS in ph.meta}  # the shards
    for node in graph.nodes:  # a bucket's pack and receive buffer are computed from its shards alone
        if _is_compute(node) and node.all_input_nodes and all(a in message_only for a in node.all_input_nodes):
            message_only.add(node)
    direct: dict[fx.Node, str] = {}  # nodes whose module is known from what they read or compute
    for node in graph.nodes:
        if node in reads:
            direct[node] = module_label(reads[node])
        elif node.op == "call_function" and node not in message_only and not meta.is_collective(node) and not meta.is_wait(node):
            seq = node.meta.get(SEQ_NR)
            used = [f for a in node.all_input_nodes if a in reads for f in reads[a]]
            if known is not None and seq in known:
                direct[node] = known[seq]
            elif used:
                direct[node] = module_label(used)
    nodes = list(graph.nodes)
    after: dict[fx.Node, str] = {}
    upcoming = ""
    for node in reversed(nodes):
        after[node] = upcoming
        upcoming = direct.get(node, upcoming)
    modules: dict[fx.Node, str] = {}
    current = ""
    for node in nodes:
        if node in message_only or node.op in ("placeholder", "output"):
            modules[node] = ""
        elif node in reads:  # a parameter being unpacked: its own module, wherever the schedule put it
            modules[node] = direct[node]
        elif node in direct:
            modules[node] = current = direct[node]
        else:  # before the first module's compute (the inputs' preparation) it belongs to none
            modules[node] = _between(current, after[node]) if current else ""
    return modules


def sequence_modules(gm: fx.GraphModule, modules: Mapping[fx.Node, str]) -> dict[int, str]:
    """Autograd sequence number -> module, from the forward graph's named nodes (the first name
    each number gets: an op decomposed into several nodes keeps one number)."""
    found: dict[int, str] = {}
    for node in gm.graph.nodes:
        seq = node.meta.get(SEQ_NR)
        if seq is not None and modules.get(node) and seq not in found:
            found[seq] = modules[node]
    return found


def _comm_s(node: fx.Node, plan: Plan, spec: CommSpec) -> float:
    val = node.args[0].meta["val"]
    nbytes = val.numel() * val.element_size()
    if meta.is_all_gather(node):  # over the shard group: its size is the op's argument
        return estimate_all_gather_s(nbytes * int(node.args[1]), int(node.args[1]), spec)
    if meta.is_all_to_all(node) or meta.is_reduce_scatter_by_all_to_all(node):
        # One split per rank: each rank sends (S-1)/S of it, as in this all-gather, at the
        # all-to-all's own factor (NOTE [Each collective's own factor] in cost_models/comm.py). A
        # reduce-scatter issued as an all-to-all is priced as the all-to-all it is; its sum is a node of its own.
        return estimate_all_gather_s(nbytes, len(node.args[1]), dataclasses.replace(spec, collective_scale=(("all_gather", spec.scale("all_to_all")),)))
    if meta.is_reduce_scatter(node):
        return estimate_reduce_scatter_s(nbytes, int(node.args[2]), spec)
    ranks = plan.num_shard_groups if node.meta.get(meta.COMM_GROUP) == REPLICATE else plan.world_size
    return estimate_all_reduce_s(nbytes, ranks, spec)


# NOTE [A collective's new buffers fault in]
# A functional collective allocates its output, and gloo its copy of the whole buffer (NOTE
# [gloo copies a collective's buffer] in cost_models/memory_timeline.py). Where the allocator
# maps such buffers fresh (``fresh_min_bytes``, NOTE [New tensors' pages] in
# cost_models/compute.py) their pages fault in as the collective writes them, on a core of the
# rank's host, and the calibrated collective times do not hold that: ``zerofx calibrate`` reuses
# its buffers. Measured between 2 gloo ranks on this project's machine with
# ``MALLOC_MMAP_THRESHOLD_`` at 256 KiB, a 4 MiB reduce-scatter takes 4.8 ms on reused buffers
# and 8.0 ms on new ones (1.0 ms of it filling the new input), a 4 MiB all-gather 3.5 ms and
# 6.4 ms. So each collective also takes its new bytes at ``fresh_s_per_byte``: its output unless
# it writes into a tensor it was given (``all_gather_into_tensor_out``), and gloo's copy where the
# profile says the backend makes one.
def collective_pages_s(node: fx.Node, device: DeviceSpec, comm: CommSpec) -> float:
    """Seconds the new buffers of collective ``node`` take to fault in (NOTE [A collective's new
    buffers fault in])."""
    if not device.fresh_s_per_byte:
        return 0.0
    new = [] if writes_in_place(node) else [value_bytes(node.meta.get("val"))]
    if comm.collective_copies:
        new.append(collective_copy_bytes(node))
    return sum(b for b in new if b >= device.fresh_min_bytes) * device.fresh_s_per_byte


# NOTE [Collectives on the ranks' cores]
# The overlap model runs collectives on a channel of their own, beside compute. On a GPU they
# do (NCCL's kernels, the NIC's DMA). On a CPU host whose ranks occupy every core, gloo moves and
# reduces the bytes with the CPU (loopback TCP is memcpy through the kernel, a reduction is a
# loop), on the same cores the ranks compute on: a collective's time is taken from compute, and
# nothing hides it. There, where the profile states the host's cores and the ranks on it are at
# least as many, the simulation issues each collective and lets compute wait for it whole.
def comm_takes_the_core(device: DeviceSpec, ranks_on_host: int) -> bool:
    """Whether collectives run on the cores the ranks compute on (NOTE [Collectives on the ranks' cores])."""
    return device.cores is not None and ranks_on_host >= device.cores


def _optimizer_update(plan: Plan, device: DeviceSpec, t: float, compute: dict[str, float], spans: list[Span], *, fused: bool) -> float:
    """Add the optimizer update over the elements this rank owns at ``t``; return when it ends
    (NOTE [The optimizer update's time] in cost_models/compute.py)."""
    owned = [p.padded_numel if int(plan.stage) == 0 else p.shard_numel for p in plan.params if p.requires_grad]
    dt = estimate_optimizer_step_s(owned, plan.optimizer, device, fused=fused)
    compute["optimizer"] = dt
    spans.append(Span("optimizer", t, t + dt))
    return t + dt


def analyze_schedule(modules: Mapping[str, fx.GraphModule], plan: Plan, *, comm: CommSpec, device: DeviceSpec,
                     fused: bool = False, fused_update: bool = False) -> ScheduleReport:
    """The simulated step of one rank running ``modules``. ``fused``: the forward and backward
    run compiled by Inductor (NOTE [Fused kernels under Inductor] in cost_models/compute.py);
    ``fused_update``: the optimizer update is torch's fused kernel (NOTE [The optimizer update's time])."""
    # The ranks of one node share its cores where the profile says it has fewer than them.
    ranks_on_host = min(plan.world_size, comm.ranks_per_node)
    serial = comm_takes_the_core(device, ranks_on_host)  # NOTE [Collectives on the ranks' cores]
    device = rank_device(device, ranks_on_host)  # NOTE [Ranks sharing cores]
    rows: list[CollectiveRow] = []
    compute: dict[str, float] = {}
    t = 0.0
    channel_free = 0.0
    exposed_total = 0.0
    issued = 0
    spans: list[Span] = []
    begins: dict[fx.Node, float] = {}
    all_fqns = [p.fqn for p in plan.params]
    module_of_node: dict[tuple[str, str], str] = {}  # (graph, node name) -> module
    done_at: dict[tuple[str, str], float] = {}  # (graph, node name) -> when compute passes it (simulated)
    forward_seq: dict[int, str] = {}
    for name in GRAPH_ORDER:
        if name == "param_sync":  # the optimizer update runs before the updated shards are gathered
            t = _optimizer_update(plan, device, t, compute, spans, fused=fused_update)
        gm = modules.get(name)
        if gm is None:
            continue
        # Only forward and backward are compiled; grad_sync and param_sync run as FX code.
        fused_s = fused_node_seconds(gm.graph, device) if fused and name in ("forward", "backward") else None
        node_module = name_modules(gm, plan, known=forward_seq if name != "forward" else None)
        if name == "forward":
            forward_seq = sequence_modules(gm, node_module)
        module_of_node.update(((name, n.name), m) for n, m in node_module.items())
        next_compute: dict[fx.Node, str] = {}  # node -> module of the first compute node after it
        upcoming = END
        for node in reversed(gm.graph.nodes):
            next_compute[node] = upcoming
            if _is_compute(node):
                upcoming = node_module[node] or upcoming
        graph_start = t
        start_compute = 0.0
        # collective -> (done, dur, compute at issue, issued after (node, module), issue #)
        pending: dict[fx.Node, tuple[float, float, float, tuple[str, str], int]] = {}
        previous, previous_module = "start", START
        for node in gm.graph.nodes:
            if meta.is_collective(node):
                dur = _comm_s(node, plan, comm) + collective_pages_s(node, device, comm)
                begin = max(t, channel_free)
                channel_free = begin + dur
                if serial:  # it runs on this rank's core: compute resumes when it is done
                    exposed_total += channel_free - t
                    t = channel_free
                pending[node] = (channel_free, dur, start_compute, (previous, previous_module), issued)
                begins[node] = begin
                issued += 1
            elif meta.is_wait(node) and node.args[0] in pending:
                coll = node.args[0]
                done, dur, compute_at_issue, (issued_after, issued_after_module), issue_index = pending.pop(coll)
                blocked = max(0.0, done - t)
                t += blocked
                exposed_total += blocked
                val = coll.args[0].meta["val"]
                bucket = tuple(coll.meta.get(meta.COMM_FQNS, ()))
                rows.append(
                    CollectiveRow(
                        order=issue_index, graph=name, op=meta.collective_name(coll), bucket=bucket,
                        bytes_per_rank=val.numel() * val.element_size(), issued_after=issued_after, waited_at=node.name,
                        overlap_compute_s=start_compute - compute_at_issue, comm_s=dur, exposed_s=blocked,
                        start_s=begins[coll], end_s=done, issued_after_module=issued_after_module,
                        waited_at_module=next_compute[node], bucket_label=bucket_label(bucket, all_fqns),
                    )
                )
            elif sends := [sent for mixer in all_mixers() for sent in mixer.op_exchanges(node)]:
                # each send blocking: issued and waited at once (NOTE [Sequence mixers], NOTE [Ring attention])
                for op, nbytes in sends:
                    dur = estimate_all_gather_s(2 * nbytes, 2, comm)  # one send to a neighbour: a 2-rank all-gather's one step
                    begin = max(t, channel_free)
                    channel_free = begin + dur
                    blocked = channel_free - t
                    t, exposed_total = channel_free, exposed_total + blocked
                    rows.append(CollectiveRow(
                        order=issued, graph=name, op=op, bucket=(), bytes_per_rank=nbytes, issued_after=previous,
                        waited_at=node.name, overlap_compute_s=0.0, comm_s=dur, exposed_s=blocked, start_s=begin, end_s=channel_free,
                        issued_after_module=previous_module, waited_at_module=next_compute[node]))
                    issued += 1
                dt = fused_s[node] if fused_s is not None else estimate_node_s(node, device)  # the blocks' attention, after the sends
                t += dt
                start_compute += dt
            else:
                dt = fused_s.get(node, 0.0) if fused_s is not None else estimate_node_s(node, device)
                t += dt
                start_compute += dt
                if _is_compute(node) and node_module[node]:
                    previous_module = node_module[node]
            if node.op != "placeholder":
                previous = node.name
            done_at[(name, node.name)] = t
        compute[name] = start_compute
        spans.append(Span(name, graph_start, t))
    rows.sort(key=lambda r: r.order)
    persistent = sum(plan.estimates.values())
    timeline = step_timeline(modules["forward"], modules["backward"], persistent_bytes=persistent, collective_copies=comm.collective_copies)
    top = peak(timeline)
    return ScheduleReport(
        rows=tuple(rows), spans=tuple(spans), compute_s=compute, exposed_s=exposed_total, step_s=t,
        persistent_bytes=persistent, peak=top, timeline=tuple(timeline), peak_module=module_of_node.get((top.graph, top.node), ""),
        timeline_s=tuple(done_at[(p.graph, p.node)] for p in timeline),
        saved_bytes=sum(value_bytes(a.meta.get("val")) for a in saved_activations(modules["forward"])),
    )


def _op_label(op: str) -> str:
    return op.replace("_into_tensor", "").replace("_tensor", "")


def schedule_table(rows: Sequence[CollectiveRow], *, verbose: bool = False, repeats: Mapping[int, int] | None = None) -> str:
    """One line per collective, in module terms (NOTE [Naming a node by its module]); ``verbose``
    adds the FX node names; ``repeats`` (row order -> count) adds a column for folded plans."""
    from tabulate import tabulate

    headers = ["#", "graph", "op", "bucket", "sent/rank", "issued after", "waited at", "overlaps compute", "comm", "exposed"]
    align = ["right", "left", "left", "left", "right", "left", "left", "right", "right", "right"]
    if verbose:
        headers += ["issued after node", "waited at node"]
        align += ["left", "left"]
    if repeats is not None:
        headers.append("repeats")
        align.append("right")
    table = []
    for r in rows:
        line = [r.order, r.graph, _op_label(r.op), r.bucket_label, format_bytes(r.bytes_per_rank), r.issued_after_module,
                r.waited_at_module, f"{r.overlap_compute_s * 1e3:.2f}", f"{r.comm_s * 1e3:.2f}", f"{r.exposed_s * 1e3:.2f}"]
        if verbose:
            line += [r.issued_after, r.waited_at]
        if repeats is not None:
            line.append(f"x{repeats.get(r.order, 1)}")
        table.append(line)
    return tabulate(table, headers=headers, colalign=align, disable_numparse=True)


def format_report(report: ScheduleReport, *, budget_bytes: float | None = None, verbose: bool = False, step_note: str = "",
                  device_peak_bytes: float | None = None, micro_batches: int = 1) -> str:
    """The schedule table, memory per rank and the summary line, as ``zerofx plan`` prints them.
    ``step_note`` follows the estimated step time (the CLI names the hardware profile there)."""
    where = f"in {report.peak.graph}" + (f" at {report.peak_module}" if report.peak_module else "")
    if verbose:
        where += f" (node {report.peak.node})"
    lines = [
        "communication schedule (one row per collective, in issue order; sizes per rank, times in ms, estimated; "
        + ("FX node names in the last two columns):" if verbose else "--verbose adds the FX node names):"),
        schedule_table(report.rows, verbose=verbose),
        "",
        f"memory per rank: persistent model state {format_bytes(report.persistent_bytes)}, "
        f"activations saved for backward {format_bytes(report.saved_bytes)}, peak {format_bytes(report.peak.live_bytes)} {where}",
    ]
    if budget_bytes is not None:
        # With offload the budget is the device's: the peak less what the offload plans hold on
        # host memory and NVMe (``device_peak_bytes``).
        held = report.peak.live_bytes if device_peak_bytes is None else device_peak_bytes
        verdict = "fits" if held <= budget_bytes else "does NOT fit"
        lines.append(f"budget {format_bytes(budget_bytes)}: {verdict}"
                     + ("" if device_peak_bytes is None else f" (device {format_bytes(held)} at the peak, with offload)"))
    lines.append(format_summary(report, "summary", step_note=step_note, micro_batches=micro_batches))
    return "\n".join(lines)


def format_summary(report: ScheduleReport | Any, label: str, *, step_note: str = "", micro_batches: int = 1) -> str:
    """The one-line step summary of a report, or of anything with the same summary fields
    (``zerofx.compiler.folding.FoldedReport``); with ``micro_batches`` > 1, also the optimizer
    step that accumulates them (NOTE [An optimizer step of several micro-batches])."""
    line = (
        f"{label}: {format_bytes(report.bytes_moved_per_rank)} sent in per rank per step; compute "
        + ", ".join(f"{g} {s * 1e3:.1f} ms" for g, s in report.compute_s.items())
        + f"; communication {report.comm_s * 1e3:.1f} ms of which exposed {report.exposed_s * 1e3:.1f} ms; "
        f"estimated step {report.step_s * 1e3:.1f} ms{step_note}"
    )
    if micro_batches > 1:
        line += (f"\noptimizer step of {micro_batches} micro-batches (gradient_accumulation_steps): forward and backward "
                 f"{report.micro_batch_s * 1e3:.1f} ms each, estimated {optimizer_step_s(report, micro_batches) * 1e3:.1f} ms")
    return line


def summary_json(report: ScheduleReport | Any, *, micro_batches: int = 1) -> dict[str, Any]:
    """The step summary as ``zerofx plan --format json`` writes it: ``step_s`` is one micro-batch's
    pass through the graphs, ``optimizer_step_s`` the step of ``micro_batches`` of them."""
    return {
        "bytes_moved_per_rank": report.bytes_moved_per_rank,
        "compute_s": dict(report.compute_s),
        "comm_s": report.comm_s,
        "exposed_comm_s": report.exposed_s,
        "step_s": report.step_s,
        "micro_batches": micro_batches,
        "micro_batch_s": report.micro_batch_s,
        "optimizer_step_s": optimizer_step_s(report, micro_batches),
    }
