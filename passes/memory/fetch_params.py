"""Rewrite (stage 3, ``offload_param``): offloaded parameter shards are fetched inside the graph,
right before the all-gather of their bucket, instead of being graph inputs.

Expects a forward or backward graph from ``partition_joint`` after ``prefetch_gathers_pass``:
parameter placeholders (``zerofx_role`` PARAM, ``zerofx_fqn``) hold this rank's flat shard
(``meta['val']`` of shape ``[shard_numel]``) and feed only the pack (``cat``) of their bucket's
all-gather, or the gather itself, and, in forward, the output (saved for backward).

After it, for each placeholder whose FQN ``plan.offloaded`` names:
- the placeholder is a *token*: an int64 tensor of shape ``[1]`` on the CPU that names the
  engine's parameter store (``meta['val']`` is rewritten to match). Forward still returns it as
  a saved tensor and backward still takes it: the signatures do not change, and what is saved
  between them is 8 bytes instead of a shard;
- ``zerofx::fetch_shard(token, fqn, numel, dtype, device) -> [numel]`` is inserted right before
  the pack (or gather) of its bucket and replaces the placeholder there. The gather of bucket k
  is issued right after the wait of bucket k - d (``prefetch_gathers_pass``), so its fetches are
  too: they run while buckets k - d .. k - 1 compute. The fetched tensor dies after the pack
  copies it (or after the gather's wait, for a bucket of one), so a shard is resident from its
  fetch to its gather only.

The fetch node carries ``zerofx_fetch_fqn``. Placeholders already rewritten are skipped, so a
second run changes nothing; a graph with no offloaded placeholder is returned unchanged.

NOTE [Why a token and a custom op]
The shard must not be a graph input: inputs are alive for the whole call, so every offloaded
shard would be resident at once. A custom op (``torch.library.custom_op``, public API) lets
the graph ask for one shard where it needs it. Its fake kernel makes an empty tensor of the
shard's shape, so capture, the memory timeline and Inductor all see a plain tensor producer.
The real kernel belongs to the runtime (``zerofx.runtime.offload.params`` registers it for the CPU token): the
op only names the store (the token's value) and the shard (its FQN), so this pass imports no
runtime. The store reads ahead in schedule order, so the op usually returns a shard that is
already in memory.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from zerofx.passes import meta
from zerofx.passes._compat import pytree
from zerofx.passes.plan.offload import ParamOffloadPlan
from zerofx.common.errors import EngineStateError

FETCH_FQN = "zerofx_fetch_fqn"  # str: on fetch_shard nodes, the parameter fetched


@torch.library.custom_op("zerofx::fetch_shard", mutates_args=())
def fetch_shard(token: torch.Tensor, fqn: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This rank's shard of ``fqn`` from the parameter store that ``token`` names."""
    raise EngineStateError(
        f"zerofx::fetch_shard({fqn!r}) ran with no parameter store: offload_param graphs run inside a zerofx Engine"
    )


@fetch_shard.register_fake
def _(token: torch.Tensor, fqn: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, device=device)


FETCH = torch.ops.zerofx.fetch_shard.default


def is_fetch(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is FETCH


def fetch_order(gm: fx.GraphModule) -> list[str]:
    """The FQNs a rewritten graph fetches, in the order it fetches them."""
    return [n.meta[FETCH_FQN] for n in gm.graph.nodes if is_fetch(n)]


def fetch_params_pass(gm: fx.GraphModule, plan: ParamOffloadPlan) -> fx.GraphModule:
    graph = gm.graph
    offloaded = plan.offloaded
    todo = [
        ph for ph in meta.placeholders(graph, meta.Role.PARAM)
        if ph.meta.get(meta.FQN) in offloaded and meta.COMM_FQNS in ph.meta and not _is_token(ph)
    ]
    if not todo:
        return gm
    position = {n: i for i, n in enumerate(graph.nodes)}
    for ph in todo:
        shard = ph.meta["val"]  # (shard_numel,)
        users = [u for u in ph.users if u.op != "output"]
        assert users and all(u.op == "call_function" for u in users), f"{ph} should feed its bucket's pack or gather"
        # The pack and gather move together (prefetch_gathers_pass): the earliest user is where
        # the bucket's message is built, and the fetch goes right before it.
        first = min(users, key=position.__getitem__)
        with graph.inserting_before(first):
            node = graph.call_function(FETCH, (ph, ph.meta[meta.FQN], shard.numel(), shard.dtype, shard.device))
        node.meta["val"] = shard
        node.meta[FETCH_FQN] = ph.meta[meta.FQN]
        for user in users:
            user.replace_input_with(ph, node)
        with shard.fake_mode:
            ph.meta["val"] = torch.empty(1, dtype=torch.int64, device="cpu")
    _refresh_output_vals(graph)
    graph.lint()
    gm.recompile()
    return gm


def _is_token(ph: fx.Node) -> bool:
    return any(is_fetch(u) for u in ph.users)


def _refresh_output_vals(graph: fx.Graph) -> None:
    """The output's ``meta['val']`` (where present) follows the tokens it now returns."""
    out = meta.output_node(graph)
    if "val" in out.meta:
        out.meta["val"] = pytree.tree_map_only(fx.Node, lambda n: n.meta.get("val"), out.args[0])
