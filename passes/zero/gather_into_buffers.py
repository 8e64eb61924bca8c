"""Rewrite (last, on every lowered graph): each all-gather writes into a buffer the graph
allocates, through ``all_gather_into_tensor_out``, instead of the functional
``all_gather_into_tensor``.

    gathered = all_gather_into_tensor(shard, N, group)
becomes
    buffer = new_empty(shard, [N * S, ...])
    gathered = all_gather_into_tensor_out(shard, N, group, out=buffer)

The wait, the bytes and the bucket stay as they were: the out variant registers its work on
``buffer`` and returns it, so the ``wait_tensor`` that follows waits for the same collective.
The buffer is allocated where the functional op allocated its output, so the graph's memory
does not change.

NOTE [gloo's completion race]
Long stage-3 runs on gloo died with ``malloc(): unaligned tcache chunk detected`` (SIGABRT) or
SIGSEGV, after hundreds to thousands of steps, more often when the machine was loaded. The
cause is in torch, not in zerofx's buffers:

- gloo runs collectives on two worker threads (``ProcessGroupGloo`` ``threads`` = 2). When a
  worker finishes one, ``ProcessGroupGloo::runLoop`` records it with
  ``pgStatus_->lastCompletedWorkName = opTypeToString(work->opType_)``, after it has released
  ``workMutex_``. Two workers that finish at the same moment assign that one ``std::string``
  concurrently.
- A name of up to 15 characters fits inside the string (the small-string buffer), and a racing
  assignment only garbles the text. A longer name lives on the heap, and a move-assignment
  frees the string's previous heap buffer. The other worker then writes its name into the freed
  block, or frees it a second time.
- The functional ``all_gather_into_tensor`` runs, on gloo, as ``allgather_into_tensor_coalesced``,
  whose op type is ``ALLGATHER_COALESCED`` (19 characters). At stage 3 with overlap, an
  all-gather and a reduce-scatter (``ALLREDUCE``) are in flight together, so they sometimes
  finish together.
- The core dump of a crashed rank shows exactly this. The aborting thread is a gloo worker in
  ``malloc``; the head of its 32-byte tcache bin decodes (safe-linking XOR with the chunk's
  address) to the bytes ``"ALLREDUC"``: the other worker wrote ``"ALLREDUCE"`` into a block
  the first had freed.
- ``benchmarks/gloo_completion_race.py`` reproduces it without zerofx: with four all-gathers
  and four reduce-scatters in flight per iteration, 6 of 13 trials of 180 s crashed with the
  functional all-gather and 0 of 9 with the out variant (docs/failure-modes.md).

``all_gather_into_tensor_out`` runs as ``_allgather_base`` (``_ALLGATHER_BASE``, 15 characters),
so every collective zerofx issues on gloo has a name that fits in the string: the reduce-scatter
runs as ``ALLREDUCE``, all-reduces as ``ALLREDUCE``. ``tests/test_core_passes.py`` checks that
lowered graphs hold no functional all-gather, and ``tests/test_engine_faults.py`` that a
stage-3 step issues only the short-named gloo ops. NCCL takes the same op (its
``_allgather_base``, the all-gather FSDP2 issues).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.passes import _compat, meta

aten = torch.ops.aten


def gather_into_buffers_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every functional all-gather in ``gm`` with ``new_empty`` plus
    ``all_gather_into_tensor_out`` (NOTE [gloo's completion race]); in place."""
    graph = gm.graph
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is _compat.ALL_GATHER):
            continue
        shard, group_size, group_name = node.args
        with graph.inserting_before(node):
            buffer = meta.add_call(graph, aten.new_empty.default, (shard, list(node.meta["val"].shape)))
            gathered = meta.add_call(graph, _compat.ALL_GATHER_INTO, (shard, group_size, group_name), {"out": buffer})
        gathered.meta.update({k: v for k, v in node.meta.items() if k != "val"})  # bucket, bytes, tile marks
        node.replace_all_uses_with(gathered)
        graph.erase_node(node)
    gm.recompile()
    return gm
