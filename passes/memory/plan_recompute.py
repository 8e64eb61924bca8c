"""Planner and rewrite: selective activation recompute, chosen by bytes freed per second.

``recompute_candidates`` reads the captured joint graph and lists the activations the partition
saves for backward that could be recomputed instead, each with its bytes and the seconds
recomputing it costs (the device profile's estimate of its ops), best ratio first, in rounds
(NOTE [Recompute in rounds]).
``plan_recompute`` takes the first ``count`` of them as a ``RecomputePlan``: the plan's record
of what is recomputed. ``recompute_activations_pass`` is the rewrite, the first of the joint
passes: it tags the planned nodes ``MUST_RECOMPUTE``, and the min-cut partitioner then leaves
them out of what the forward saves and computes them again in backward. How many to take is
the budget search's choice (``fit_recompute`` in zerofx/compiler/search.py).

NOTE [Selective activation recompute]
After the min-cut partitioner has done its own choosing (it already recomputes cheap
elementwise chains and saves what is costly to redo: matrix products, attention, reductions),
what the forward saves is the step's activation memory. Under ``zerofx.recompute: "auto"`` and
a memory budget the step's peak exceeds, each saved activation is a candidate, ranked by the
bytes it frees per second of extra compute (``estimate_node_s`` on the device profile, summed
over the ops it takes to rebuild it from what stays saved): a normalization's output or a
projection of a narrow input comes before an attention output, whose rebuild is quadratic in
the sequence. Under Inductor (``"compile": "inductor"``) an elementwise op or reduction rebuilt
in backward is generated into the backward kernel that reads it, so it costs only the reading of
its inputs (``rebuild_seconds``), and such candidates rank ahead of rebuilt products. The budget
search takes the fewest best-ranked candidates whose lowered graphs'
peak fits, so nothing is recomputed when the step fits already, and the partitioner's own
choice stands. A candidate is left out when recomputing it would be wrong or pointless:
- its rebuild reaches a random op (dropout would draw a different mask), a collective (the
  backward would communicate again), or an op outside ATen (a custom op may not be pure);
- it is computed from parameters and buffers alone (at stage 3 those are gathered again in
  backward anyway, NOTE [Why the gather is tagged for recompute]), or its rebuild reads a
  parameter the backward does not read otherwise (the embedding table: stage 3 would gather it
  once more);
- another pass has tagged it already (tiling's chunks and recomputed spans).
A saved view is taken together with the views up to its base, whose bytes it holds. In fp32 the
recomputed ops are the same ops on the same inputs, so the step's values are bitwise those of
the unrecomputed one.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import networkx as nx
import torch
import torch.fx as fx

from zerofx.common.errors import PlanError
from zerofx.cost_models.compute import DeviceSpec, rebuild_seconds, value_bytes
from zerofx.passes import _compat, meta
from zerofx.passes.partition import partition_joint
from zerofx.passes.plan.recompute import RecomputedActivation, RecomputeMode, RecomputePlan

aten = torch.ops.aten


_VIEW_OPS = frozenset({aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default, aten.transpose.int,
                       aten.permute.default, aten.expand.default, aten.slice.Tensor, aten.select.int, aten.unsqueeze.default,
                       aten.squeeze.dim, aten.squeeze.dims, aten.alias.default, aten.as_strided.default, aten.unflatten.int,
                       aten.flatten.using_ints, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
                       aten.unbind.int, aten.view_as_real.default, aten.view_as_complex.default, aten.diagonal.default})


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _VIEW_OPS


def _may_recompute(node: fx.Node) -> bool:
    """Whether the partitioner may run ``node`` again in backward with the same result."""
    target = node.target
    if node.op != "call_function":
        return False
    if target is operator.getitem:
        return True
    if getattr(target, "namespace", None) not in ("aten", "prims"):
        return False  # collectives (_c10d_functional), custom ops: not known to be pure
    return torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ())


# NOTE [The spine stays saved]
# A value every path from a step input to the loss passes through (a transformer's residual stream
# between its sub-blocks, the embedding's output) is read again by every later block. Recomputed,
# its rebuild reaches back through all earlier blocks, and the partitioner computes each value
# once, so the whole chain is rebuilt at the start of backward and stays live until each block's
# backward: on the 25m DNA LM at 2x1024 tokens, three rounds with the residual stream among the
# candidates saved 65 MiB for backward instead of the first round's 277 MiB, and peaked at 915 MiB
# in backward against the first round's 567 MiB. So the spine is never a candidate,
# and once anything is recomputed it is tagged MUST_SAVE: a rebuild then stops at the nearest
# spine value before it, as checkpointing each block stops at the block's input. The spine is
# found as the dominators of the loss from each step input, over the forward's data flow.
def spine_values(graph: fx.Graph) -> set[fx.Node]:
    """The forward values that every path from one of the step's inputs to the loss passes
    through (NOTE [The spine stays saved])."""
    backward = meta.backward_region(graph)
    outputs = meta.output_node(graph).args[0]
    loss = outputs[0] if isinstance(outputs, (list, tuple)) else outputs
    if not isinstance(loss, fx.Node):
        return set()
    edges = nx.DiGraph()
    for node in graph.nodes:
        if node.op == "call_function" and node not in backward:
            for a in node.all_input_nodes:
                edges.add_edge(a, node)
    spine: set[fx.Node] = set()
    for source in meta.placeholders(graph, meta.Role.INPUT):
        if source not in edges:
            continue
        reach = edges.subgraph(nx.descendants(edges, source) | {source})
        if loss not in reach:
            continue
        dominators = nx.immediate_dominators(reach, source)
        node = dominators[loss]
        while node is not source:
            spine.add(node)
            node = dominators[node]
    return {n for n in spine if n.op == "call_function"}


def saved_for_backward(joint: fx.GraphModule, tagged: frozenset[str] = frozenset()) -> list[str]:
    """The names of the joint graph's nodes the partition saves for backward, with the nodes named
    in ``tagged`` recomputed (none: the default partition)."""
    joint = meta.clone_graph_module(joint)
    if tagged:
        _tag(joint, tagged)
    forward, _ = partition_joint(joint)
    return [a.name for a in meta.output_node(forward.graph).args[0][1:] if isinstance(a, fx.Node)]


# NOTE [Recompute in rounds]
# Recomputing a saved value makes the partitioner save what rebuilds it instead, and those values
# were not saved before, so they were not candidates: with every first-round candidate recomputed,
# the 25m DNA LM at 2x1024 tokens still saved 293 MiB of its 555 MiB, among them the attention's
# q/k/v projection (12 MiB a block) that the recomputed rotary and split read. So the candidates
# come in rounds: round k+1 partitions the joint graph with every candidate of rounds 1..k
# recomputed, and the values it saves that may be recomputed join the list, ranked among
# themselves after round k's (a prefix of the list is always a set the partitioner can honour:
# a later round's candidate is only saved once the earlier rounds are recomputed). Each round
# costs one partition (0.4 s at that size). The rounds stop when one adds nothing, or after
# RECOMPUTE_ROUNDS, which is enough to leave a transformer block's saved values at its input,
# its attention's output and statistics (the attention op is tagged as drawing random numbers, for
# its dropout, so it is never rebuilt) and the projections the matrix products recompute from:
# 141 MiB there. What a plan frees is what the lowered forward saves without it less what it
# saves with it (``ScheduleReport.saved_bytes``, ``zerofx plan``'s memory line), not the sum of
# its candidates' sizes, which counts bytes that their rebuilds then save.
RECOMPUTE_ROUNDS = 4


def recompute_candidates(joint: fx.GraphModule, device: DeviceSpec, saved: Sequence[str] | None = None, *,
                         rounds: int | None = None, fused: bool = False) -> tuple[list[RecomputedActivation], int]:
    """The activations of ``joint`` that may be recomputed, in rounds (NOTE [Recompute in rounds]),
    each round best bytes per second first, and the bytes the default partition saves (NOTE
    [Selective activation recompute]). ``saved`` (names) skips the first partition when the
    caller has it; ``rounds`` defaults to RECOMPUTE_ROUNDS; ``fused``: the graphs run compiled
    by Inductor, which rebuilds fused ops inside the backward's kernels (``rebuild_seconds``)."""
    rounds = RECOMPUTE_ROUNDS if rounds is None else rounds
    saved_names = list(saved) if saved is not None else saved_for_backward(joint)
    counted: set[str] = set()  # ops the candidates so far rebuild: each is priced once
    spine = frozenset(n.name for n in spine_values(joint.graph))
    candidates, all_bytes = _round_candidates(joint, device, saved_names, counted=counted, skip=spine, round_number=1, fused=fused)
    tagged = frozenset(n for c in candidates for n in c.tagged)
    for round_number in range(2, rounds + 1):
        if not candidates:
            break
        more, _ = _round_candidates(joint, device, saved_for_backward(joint, tagged), counted=counted, skip=tagged | spine,
                                    round_number=round_number, fused=fused)
        if not more:
            break
        candidates += more
        tagged |= {n for c in more for n in c.tagged}
    return candidates, all_bytes


def _round_candidates(joint: fx.GraphModule, device: DeviceSpec, saved_names: Sequence[str], *, counted: set[str],
                      skip: frozenset[str], round_number: int, fused: bool) -> tuple[list[RecomputedActivation], int]:
    """One round of ``recompute_candidates``: the values ``saved_names`` that may be recomputed,
    none named in ``skip``; ops named in ``counted`` are rebuilt by earlier candidates already, and
    this round's rebuilds are added to it."""
    graph = joint.graph
    by_name = {n.name: n for n in graph.nodes}
    saved_nodes = [by_name[s] for s in saved_names if s in by_name]
    saved_set = set(saved_nodes)
    order = {n: i for i, n in enumerate(graph.nodes)}
    inputs = set(meta.placeholders(graph, meta.Role.INPUT))
    from_input: set[fx.Node] = set()
    for node in graph.nodes:  # topological: what depends on the step's inputs
        if node in inputs or any(a in from_input for a in node.all_input_nodes):
            from_input.add(node)

    def base_chain(node: fx.Node) -> list[fx.Node]:
        chain = [node]
        while _is_view(chain[-1]) and chain[-1].args and isinstance(chain[-1].args[0], fx.Node):
            chain.append(chain[-1].args[0])
        if chain[-1].target is operator.getitem and isinstance(chain[-1].args[0], fx.Node):
            chain.append(chain[-1].args[0])
        return chain

    # Parameters and buffers the backward reads (directly or through views of them alone): a rebuild
    # reading another one would make stage 3 gather it once more.
    backward = meta.backward_region(graph)
    read_in_backward: set[fx.Node] = set()
    for ph in meta.placeholders(graph, meta.Role.PARAM) + meta.placeholders(graph, meta.Role.BUFFER):
        frontier, seen = [ph], set()
        while frontier:
            n = frontier.pop()
            for user in n.users:
                if user in backward:
                    read_in_backward.add(ph)
                    frontier = []
                    break
                if _is_view(user) and user not in seen:
                    seen.add(user)
                    frontier.append(user)
    weights = {n for n in graph.nodes if n.op == "placeholder" and n.meta.get(meta.ROLE) in (meta.Role.PARAM, meta.Role.BUFFER)}

    ranked: list[tuple[float, int, fx.Node, str, tuple[str, ...], int, dict[fx.Node, float]]] = []
    all_bytes = 0
    for node in saved_nodes:
        if node.op != "call_function" or node not in from_input:
            continue
        size = value_bytes(node.meta.get("val"))
        all_bytes += size
        chain = base_chain(node)
        if any(n.op != "call_function" or n.meta.get("recompute") is not None or n.name in skip for n in chain):
            continue
        # What rebuilding takes: the chain and its unsaved forward ancestors, up to what stays saved.
        rebuild, stack, ok = set(), list(chain), True
        while stack and ok:
            n = stack.pop()
            if n in rebuild:
                continue
            if not _may_recompute(n):
                ok = False
                break
            rebuild.add(n)
            if any(a in weights and a not in read_in_backward for a in n.all_input_nodes):
                ok = False
                break
            stack += [a for a in n.all_input_nodes if a.op != "placeholder" and a not in saved_set and a not in rebuild]
        if not ok or size == 0:
            continue
        base = chain[-1] if chain[-1].target is not operator.getitem else chain[-2]
        shape = tuple(node.meta["val"].shape) if isinstance(node.meta.get("val"), torch.Tensor) else ()
        what = f"{getattr(base.target, '__name__', str(base.target))} {'x'.join(map(str, shape))}"
        # In graph order, not the set's (node hashes are addresses): the sum's rounding decides
        # the order of candidates that tie, and with it the plan, which must not vary by process.
        seconds = rebuild_seconds(sorted(rebuild, key=order.__getitem__), device, fused=fused)
        ranked.append((size / max(sum(seconds.values()), 1e-12), order[node], node, what, tuple(n.name for n in chain), size, seconds))
    ranked.sort(key=lambda r: (-r[0], r[1]))
    candidates = []
    for _, _, node, what, tagged, size, seconds in ranked:
        added = sum(s for n, s in seconds.items() if n.name not in counted)
        counted.update(n.name for n in seconds)
        candidates.append(RecomputedActivation(name=node.name, what=what, tagged=tagged, bytes=size, alone_s=sum(seconds.values()),
                                               recompute_s=added, round=round_number))
    return candidates, all_bytes


def plan_recompute(candidates: Sequence[RecomputedActivation], count: int, *, mode: RecomputeMode, saved_bytes: int) -> RecomputePlan:
    """The first ``count`` candidates as the plan's recompute."""
    assert 0 <= count <= len(candidates), (count, len(candidates))
    return RecomputePlan(mode=mode.value, activations=tuple(candidates[:count]), candidates=len(candidates), saved_bytes=saved_bytes)


def recompute_activations_pass(gm: fx.GraphModule, plan: RecomputePlan | None) -> fx.GraphModule:
    """Tag ``plan``'s nodes ``MUST_RECOMPUTE`` (NOTE [Selective activation recompute]); unchanged
    without a plan. The first joint pass, so the names are the captured joint graph's."""
    if plan is None or not plan.activations:
        return gm
    _tag(gm, plan.tagged())
    return gm


def _tag(gm: fx.GraphModule, tagged: frozenset[str]) -> None:
    found = 0
    for node in gm.graph.nodes:
        if node.name in tagged:
            node.meta["recompute"] = _compat.CheckpointPolicy.MUST_RECOMPUTE
            found += 1
    for node in spine_values(gm.graph):  # NOTE [The spine stays saved]
        if node.meta.get("recompute") is None:
            node.meta["recompute"] = _compat.CheckpointPolicy.MUST_SAVE
    if found != len(tagged):
        missing = sorted(tagged - {n.name for n in gm.graph.nodes})
        raise PlanError(f"the recompute plan names nodes the joint graph lacks: {missing[:5]}; the plan was made for another capture")
