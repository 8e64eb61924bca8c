"""Rewrite (last, on gloo): each reduce-scatter becomes an all-to-all and a local sum.

    reduced = wait_tensor(reduce_scatter_tensor(x, "sum", K, group))      x: (K * n, ...)
becomes
    received = wait_tensor(all_to_all_single(x, [n] * K, [n] * K, group))  (K * n, ...): chunk r from rank r
    reduced = sum(view(received, [K, n, ...]), 0)                         (n, ...)

The all-to-all stays where the reduce-scatter was issued and its wait where the wait was (after
``sink_reduce_waits_pass``), so the overlap does not change; the sum follows the wait. The
bucket's metadata (its parameters, bytes, group, weight-tile marks) moves to the all-to-all,
which is marked ``REDUCE_SCATTER_BY_ALL_TO_ALL`` so that reports still count it as the bucket's
reduce-scatter.

NOTE [gloo's reduce-scatter as an all-to-all]
gloo has no reduce-scatter of its own: torch's ``ProcessGroupGloo`` runs
``reduce_scatter_tensor`` as an all-reduce of a copy of the whole input, then copies this rank's
chunk out (the op type it records is ``ALLREDUCE``). An all-reduce moves twice the bytes of a
reduce-scatter over a ring (NOTE [Ring collectives] in cost_models/comm.py). An all-to-all
sends each rank only its own chunk, (K - 1) / K of the input per rank, what a ring
reduce-scatter sends, and the sum of the K received chunks is one pass over memory. Measured
with torch 2.13 between 2 gloo ranks on this project's 2-core machine (``dist`` calls back to
back, reused buffers, 10 calls per trial, 3 trials): a 12 MB message took 14-18 ms as a
reduce-scatter and 7-9 ms as an all-to-all and sum, with 9-14 ms of the process's CPU against
5-6; 100 MB 118-124 ms against 69-75; between 4 ranks, 12 MB 27-33 ms against 12-15
(``benchmarks/gloo_reduce_scatter.py`` reruns it). Memory is the same: the all-to-all's receive
buffer is the input's size, as gloo's copy of the input is (one 64 MiB call grows a rank's
resident set by 97 MiB either way, with the 32 MiB shard; the timeline counts the buffer as the
all-to-all's output, and the copy where the profile says ``collective_copies``). The
rewrite applies where ``Plan.reduce_scatter_by_all_to_all`` says (the engine sets it for a
gloo group; a plan without a group follows its comm profile's backend). NCCL has a ring
reduce-scatter and keeps it. The sum's order over ranks differs from gloo's all-reduce, so
results match the reduce-scatter's to rounding, and exactly with 2 ranks (one addition).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.passes import _compat, meta

aten = torch.ops.aten


def reduce_scatter_by_all_to_all_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every reduce-scatter in ``gm`` with an all-to-all whose wait is followed by a sum
    over the received chunks (NOTE [gloo's reduce-scatter as an all-to-all]); in place."""
    graph = gm.graph
    for node in list(graph.nodes):
        if not meta.is_reduce_scatter(node):
            continue
        x, op, group_size, group_name = node.args
        assert op == "sum", f"only sum reduce-scatters are rewritten, found {op!r}"
        k = int(group_size)
        shape = list(x.meta["val"].shape)
        assert shape[0] % k == 0, f"a reduce-scatter's first dim {shape[0]} is not a multiple of its group's size {k}"
        splits = [shape[0] // k] * k
        waits = [u for u in node.users if meta.is_wait(u)]
        assert len(waits) == 1 and len(node.users) == 1, f"reduce-scatter {node.name} has users other than its one wait"
        (wait,) = waits
        with graph.inserting_before(node):
            exchange = meta.add_call(graph, _compat.ALL_TO_ALL, (x, splits, splits, group_name))
        exchange.meta.update({key: v for key, v in node.meta.items() if key != "val"})
        exchange.meta[meta.REDUCE_SCATTER_BY_ALL_TO_ALL] = True
        with graph.inserting_before(wait):
            received = meta.add_call(graph, _compat.WAIT, (exchange,))
        with graph.inserting_after(received):
            chunks = meta.add_call(graph, aten.view.default, (received, [k, *splits[:1], *shape[1:]]))
        with graph.inserting_after(chunks):
            reduced = meta.add_call(graph, aten.sum.dim_IntList, (chunks, [0]))
        wait.replace_all_uses_with(reduced)
        graph.erase_node(wait)
        graph.erase_node(node)
    gm.recompile()
    return gm
