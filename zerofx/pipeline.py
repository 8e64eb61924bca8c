"""The one place that owns the order of passes, and the small runner that applies them.

    captured joint --tile_weights_pass--> --shard_params_pass--> --reduce_grads_pass--> partition_joint --> forward, backward
    forward, backward --prefetch_gathers_pass--> --sink_reduce_waits_pass--> (overlap)
        --fetch_params_pass--> (stage 3 with offload_param)
        backward --offload_grads_pass--> (stages 2-3 with offload_gradients)
    plan --build_grad_sync--> grad_sync (stage 1: NOTE [Stages 1 and 2 move 2 Psi])
    plan --build_param_sync--> param_sync (stages 1 and 2)
    every graph --gather_into_buffers_pass--> (last: NOTE [gloo's completion race])
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence

import torch.fx as fx

from zerofx.passes import Plan, _compat, build_param_sync, meta, partition_joint, reduce_grads_pass, shard_params_pass
from zerofx.passes.fetch_params import fetch_params_pass
from zerofx.passes.grad_sync import build_grad_sync
from zerofx.passes.gather_into_buffers import gather_into_buffers_pass
from zerofx.passes.offload_grads import offload_grads_pass
from zerofx.passes.plan_offload import ParamOffloadPlan
from zerofx.passes.schedule_overlap import prefetch_gathers_pass, sink_reduce_waits_pass
from zerofx.passes.tile_weights import tile_weights_pass

log = logging.getLogger("zerofx.pipeline")

Pass = Callable[[fx.GraphModule], fx.GraphModule]


def joint_passes(plan: Plan, *, group_name: str, replicate_group_name: str | None = None) -> list[tuple[str, Pass]]:
    """The rewrites applied to the captured joint graph, in order. ``group_name`` is the shard
    group's (the world's when sharding is flat), ``replicate_group_name`` the group across shard
    groups (NOTE [Shard groups of consecutive ranks])."""
    return [
        ("tile_weights_pass", functools.partial(tile_weights_pass, plan=plan, group_name=group_name)),
        ("shard_params_pass", functools.partial(shard_params_pass, plan=plan, group_name=group_name)),
        ("reduce_grads_pass", functools.partial(reduce_grads_pass, plan=plan, group_name=group_name,
                                                replicate_group_name=replicate_group_name)),
    ]


def graph_passes(plan: Plan, param_offload: ParamOffloadPlan | None = None, *, offload_grads: bool = False) -> list[tuple[str, Pass]]:
    """The rewrites applied to each partitioned forward and backward graph, in order. The
    fetches of offloaded shards go in last: they follow the gathers wherever prefetch put them.
    ``offload_grads`` (the backward's, with gradient offload) hands each reduced shard off
    right after its bucket's wait, wherever ``sink_reduce_waits_pass`` put it."""
    passes: list[tuple[str, Pass]] = [
        ("prefetch_gathers_pass", functools.partial(prefetch_gathers_pass, plan=plan)),
        ("sink_reduce_waits_pass", functools.partial(sink_reduce_waits_pass, plan=plan)),
    ]
    if param_offload is not None:
        passes.append(("fetch_params_pass", functools.partial(fetch_params_pass, plan=param_offload)))
    if offload_grads:
        passes.append(("offload_grads_pass", functools.partial(offload_grads_pass, plan=plan)))
    passes.append(("gather_into_buffers_pass", gather_into_buffers_pass))
    return passes


def run_passes(gm: fx.GraphModule, passes: Sequence[tuple[str, Pass]], *, disabled: Sequence[str] = ()) -> fx.GraphModule:
    """Apply ``passes`` in order: check each returns a linted GraphModule, log its time and the
    change in op count, and on error name the passes that already ran."""
    done: list[str] = []
    for name, fn in passes:
        if name in disabled:
            continue
        before = len(gm.graph.nodes)
        start = time.perf_counter()
        try:
            result = fn(gm)
        except Exception as exc:
            raise RuntimeError(f"pass {name} failed (after {done or 'no passes'}): {exc}") from exc
        assert isinstance(result, fx.GraphModule), f"pass {name} returned {type(result).__name__}, not a GraphModule"
        result.graph.lint()
        log.debug("%s: %.3fs, %+d nodes", name, time.perf_counter() - start, len(result.graph.nodes) - before)
        gm = result
        done.append(name)
    return gm


def lower(joint: fx.GraphModule, plan: Plan, *, group_name: str, disabled: Sequence[str] = (),
          param_offload: ParamOffloadPlan | None = None, replicate_group_name: str | None = None,
          offload_grads: bool = False) -> dict[str, fx.GraphModule]:
    """Rewrite a copy of the captured joint graph for ``plan`` (and ``param_offload``'s shard
    placement, and with ``offload_grads`` the hand-off of each reduced gradient shard) and split
    it into the graph modules one rank runs. ``joint`` itself is left alone."""
    rewritten = run_passes(meta.clone_graph_module(joint), joint_passes(plan, group_name=group_name, replicate_group_name=replicate_group_name),
                           disabled=disabled)
    with _compat.lazy_graph_modules():  # NOTE [Code written on first use] in passes/_compat.py
        forward, backward = partition_joint(rewritten)
    modules = {
        "forward": run_passes(forward, graph_passes(plan, param_offload), disabled=disabled),
        "backward": run_passes(backward, graph_passes(plan, param_offload, offload_grads=offload_grads), disabled=disabled),
    }
    grad_sync = build_grad_sync(plan, group_name=group_name, replicate_group_name=replicate_group_name)
    if grad_sync is not None:
        modules["grad_sync"] = run_passes(grad_sync, [("gather_into_buffers_pass", gather_into_buffers_pass)], disabled=disabled)
    sync = build_param_sync(plan, group_name=group_name)
    if sync is not None:
        modules["param_sync"] = run_passes(sync, [("gather_into_buffers_pass", gather_into_buffers_pass)], disabled=disabled)
    return modules
