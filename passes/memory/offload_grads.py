"""Rewrite (stages 2-3, ``zerofx.offload_gradients``): each reduced gradient shard leaves the
backward graph as soon as its bucket's reduction is waited for, instead of being a graph output.

Expects a backward graph from ``partition_joint`` after ``reduce_grads_pass`` and the overlap
passes: its outputs are one gradient (or None) per primal, the parameters first in
``plan.params`` order, and each trainable parameter's output is this rank's reduced shard
``[shard_numel]``, computed from its bucket's reduction (``zerofx_comm_fqns`` on it).

After it, for each such output:
- ``zerofx::offload_grad(shard, fqn)`` is inserted right after the node that makes the shard
  (the division after the bucket's last wait, or the slice of it that is this parameter's), and
  carries ``zerofx_offload_fqn``;
- the output is None: the engine gets nothing back for that parameter.

Outputs that are None already (frozen parameters, or a graph rewritten before) are skipped, so
a second run changes nothing. Below stage 2 the graph is returned unchanged (gradients are
whole there, and the config refuses gradient offload).

NOTE [Gradients leave at their bucket's wait]
A graph output lives until the graph returns, so with every reduced shard an output the device
held all of them at the end of the backward: the rank's whole gradient, 2 bytes per parameter
over N in bf16, on top of the backward's own peak. The hand-off op makes the shard's last use
the hand-off itself: the graph's Python drops it right after (FX frees each value after its last
use), and the bucket's storage goes once its last shard is handed off. The reductions' tails
(wait, division, slices) sit right before the next reduction is issued
(``sink_reduce_waits_pass``), so a bucket leaves before the next one is reduced and the device
holds at most ``REDUCTIONS_IN_FLIGHT`` + 1 reduced buckets at a time. The memory timeline
(``cost_models.memory_timeline``) sees the same: a shard that is no output is freed at its last
use.

The op only names the parameter; where the shard goes belongs to the runtime. The engine runs
the backward graph inside ``grad_sink(store.add)`` (a context variable, so two engines in one
process, or a graph run on another thread, each reach their own store), and the op's kernel
calls the sink of the thread that runs it. Nothing in the graph names a store, so the lowered
graph is the same on every rank and in every process: rank 0's build and the plan cache
(``zerofx.compiler.plan_cache`` stores the op by its qualified name) carry it unchanged, and this module
imports no runtime. The op returns nothing and mutates nothing visible to the graph, so it is
registered as having a side effect (``torch.fx.node.has_side_effect``): dead-code elimination,
FX's or Inductor's, keeps it. The sink must copy what it keeps beyond the call: a compiled
graph may reuse the shard's memory right after its last use.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
import torch.fx as fx
from torch.fx.node import has_side_effect

from zerofx.passes import meta
from zerofx.passes.plan import Plan, ZeroStage
from zerofx.common.errors import EngineStateError

OFFLOAD_FQN = "zerofx_offload_fqn"  # str: on offload_grad nodes, the parameter whose shard leaves

GradSink = Callable[[str, torch.Tensor], None]
_SINK: ContextVar[GradSink | None] = ContextVar("zerofx_grad_sink", default=None)


@contextlib.contextmanager
def grad_sink(sink: GradSink | None) -> Iterator[None]:
    """Run graphs whose ``zerofx::offload_grad`` hands each shard to ``sink(fqn, shard)``
    (NOTE [Gradients leave at their bucket's wait])."""
    token = _SINK.set(sink)
    try:
        yield
    finally:
        _SINK.reset(token)


@torch.library.custom_op("zerofx::offload_grad", mutates_args=())
def offload_grad(grad: torch.Tensor, fqn: str) -> None:
    """Hand this rank's reduced gradient shard of ``fqn`` to the gradient sink of this thread."""
    sink = _SINK.get()
    if sink is None:
        raise EngineStateError(
            f"zerofx::offload_grad({fqn!r}) ran with no gradient store: gradient-offload graphs run inside a zerofx Engine's backward"
        )
    sink(fqn, grad)


@offload_grad.register_fake
def _(grad: torch.Tensor, fqn: str) -> None:
    return None


OFFLOAD = torch.ops.zerofx.offload_grad.default
has_side_effect(OFFLOAD)


def is_offload(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is OFFLOAD


def offload_order(gm: fx.GraphModule) -> list[str]:
    """The FQNs a rewritten backward graph hands off, in the order it hands them off."""
    return [n.meta[OFFLOAD_FQN] for n in gm.graph.nodes if is_offload(n)]


def offload_grads_pass(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    if plan.stage < ZeroStage.TWO:
        return gm
    graph = gm.graph
    assert meta.placeholders(graph, meta.Role.TANGENT), "offload_grads_pass rewrites the backward graph"
    out = meta.output_node(graph)
    outputs = list(out.args[0])
    changed = False
    for i, p in enumerate(plan.params):
        shard = outputs[i]
        if shard is None:
            continue
        assert isinstance(shard, fx.Node) and p.fqn in shard.meta.get(meta.COMM_FQNS, ()), (
            f"backward output {i} should be the reduced shard of {p.fqn}, got {shard}"
        )
        with graph.inserting_after(shard):
            node = graph.call_function(OFFLOAD, (shard, p.fqn))
        node.meta["val"] = None
        node.meta[OFFLOAD_FQN] = p.fqn
        outputs[i] = None
        changed = True
    if not changed:
        return gm
    out.args = (outputs,)
    if "val" in out.meta:
        out.meta["val"] = [o.meta.get("val") if isinstance(o, fx.Node) else o for o in outputs]
    graph.lint()
    gm.recompile()
    return gm
