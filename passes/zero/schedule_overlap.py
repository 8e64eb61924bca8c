"""Rewrites (after partitioning): overlap collectives with compute by moving them in the graph.

- ``prefetch_gathers_pass``: the all-gather of bucket k (and the pack feeding it) is issued
  right after bucket k - d's wait, d = ``plan.prefetch_distance``, so it runs while bucket
  k - d... k - 1 compute. Its wait stays right before the bucket's first use.
- ``sink_reduce_waits_pass``: each gradient reduction's wait (and the division and slicing
  after it) moves later, so the reduction runs while backward goes on: to just before the
  reduction ``REDUCTIONS_IN_FLIGHT`` places later is issued, or before the graph's output for
  the last ones (NOTE [A reduction holds its input until its wait]).
Neither moves the collectives of a weight's tiles (``zerofx_weight_tile``): each stays where
``tile_weights_pass`` put it, next to its use (NOTE [One weight tile at a time]).

NOTE [A reduction holds its input until its wait]
A functional collective's work object keeps its input (gloo even a clone of it) alive until
``wait_tensor`` releases the work, not until the transfer completes: measured on gloo, four
200 MB reduce-scatters issued without waits held 772 MiB more, and their waits gave back the
inputs. The input of a gradient reduction is the full, unsharded gradient of its bucket, so
sinking every wait to the end of backward kept the whole model's gradients alive at once, 4P
bytes per rank at any world size. So at most ``REDUCTIONS_IN_FLIGHT`` reductions are in flight:
each is waited for right before the next one is issued, which still overlaps it with the
backward of one bucket (what FSDP2 does), and the memory model
(``cost_models.memory_timeline``) counts a collective's input until its wait.

Both expect a forward or backward graph from ``partition_joint`` (or ``param_sync``), with
collectives as functional ops followed by ``wait_tensor``. They only move nodes: the graph
computes the same values. They return the graph unchanged when ``plan.overlap`` is off or there
is nothing to move, and running them twice changes nothing. The order in which collectives are
issued is the same on every rank, because every rank runs the same graph.
"""

from __future__ import annotations

import torch.fx as fx

from zerofx.passes import meta
from zerofx.passes.plan import REPLICATE, Plan
from zerofx.passes.zero.tile_weights import WEIGHT_TILE


# Gradient reductions issued and not yet waited for, at most (NOTE [A reduction holds its input
# until its wait]).
REDUCTIONS_IN_FLIGHT = 1


def _wait_of(node: fx.Node) -> fx.Node:
    waits = [u for u in node.users if meta.is_wait(u)]
    assert len(waits) == 1, f"{node} should have exactly one wait"
    return waits[0]


def prefetch_gathers_pass(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    distance = plan.prefetch_distance
    gathers = [n for n in gm.graph.nodes if meta.is_all_gather(n) and WEIGHT_TILE not in n.meta]
    if not plan.overlap or distance == 0 or len(gathers) < 2:
        return gm
    graph = gm.graph
    # Moving a chain earlier keeps the relative order of every node not moved yet, and a gather's
    # anchor (a wait) never moves: positions taken once stay valid for the comparisons below.
    position = {n: i for i, n in enumerate(graph.nodes)}
    changed = False
    for k, gather in enumerate(gathers):
        if k < distance:
            continue  # the first buckets have nothing earlier to overlap with
        anchor = _wait_of(gathers[k - distance])
        # The pack (a cat of shards) moves with its gather; its inputs are placeholders.
        chain = [a for a in gather.all_input_nodes if a.op != "placeholder"] + [gather]
        assert all(x.op == "placeholder" for c in chain[:-1] for x in c.all_input_nodes), "gather inputs must be shards"
        following, node = [], anchor.next
        for _ in chain:
            following.append(node)
            node = node.next
        if following == chain or position[chain[0]] < position[anchor]:
            continue  # already issued right after the anchor, or earlier still
        for node in reversed(chain):
            anchor.append(node)
        changed = True
    if not changed:
        return gm
    graph.lint()
    gm.recompile()
    return gm


def sink_reduce_waits_pass(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    # An all-reduce across shard groups reads its reduce-scatter's wait: it is part of that
    # reduction's tail and moves with it (NOTE [Shard groups of consecutive ranks]).
    reductions = [n for n in gm.graph.nodes if (meta.is_reduce_scatter(n) or meta.is_all_reduce(n)) and WEIGHT_TILE not in n.meta
                  and n.meta.get(meta.COMM_GROUP) != REPLICATE]
    if not plan.overlap or not reductions:
        return gm
    graph = gm.graph
    out = meta.output_node(graph)
    # Each reduction's wait and what is computed from it alone (div, slices) form its tail. It
    # goes right before the reduction REDUCTIONS_IN_FLIGHT later (or the output), after the
    # tails already there.
    waits = [_wait_of(c) for c in reductions]
    tails = meta.derived_only_from(graph, waits, set())
    sunk = {n for tail in tails.values() for n in tail}
    changed = False
    for i, wait in enumerate(waits):
        tail = tails[wait]
        later = i + REDUCTIONS_IN_FLIGHT
        before = reductions[later] if later < len(reductions) else out
        node = tail[0]
        while node is not before and node in sunk:
            node = node.next
        if node is before:
            continue  # only sunk tails between it and its place already
        for node in tail:
            before.prepend(node)
        changed = True
    if not changed:
        return gm
    graph.lint()
    gm.recompile()
    return gm
