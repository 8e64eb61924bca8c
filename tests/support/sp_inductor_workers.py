"""What each rank runs in tests/test_sp_inductor.py, and the single-process reference: one small
model that holds every sequence mixer (causal attention, a short causal depthwise conv, an FFT
long conv, a cumsum, a selective scan, and a second scan over the flipped sequence, flipped
back), trained sequence-parallel with its graphs compiled by Inductor against plain PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import zerofx
from tests.support.scan_mixer_workers import ScanSSM
from zerofx.models.long_conv import ModalFilter, causal_depthwise_conv, lm_loss
from zerofx.passes.meta import is_all_to_all
from zerofx.passes.sequence.ring_attention import is_ring_attention

SGD = {"type": "SGD", "params": {"lr": 0.1}}
VOCAB, IGNORE, SEQ, BATCH = 5, -100, 32, 2


class MixersLM(torch.nn.Module):
    """One layer of each mixer, on a residual stream of width ``dim``:

    - attention: causal SDPA over ``heads`` heads (Ulysses or ring);
    - a short causal depthwise conv of ``taps`` taps (the halo), then an FFT conv whose filter,
      computed from the positions, is as long as the sequence (channels);
    - a running mean by cumsum (prefix);
    - a selective scan (state passing), and one over the flipped sequence, flipped back (flip).
    """

    def __init__(self, dim: int = 8, heads: int = 2, taps: int = 3, seq_len: int = SEQ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.short = torch.nn.Parameter(torch.randn(dim, taps) / taps)  # (C, K) by lag
        self.long = ModalFilter(dim, 2, seq_len)  # Evo 2's Hyena-LI filter, from positions
        self.mix = torch.nn.Linear(dim, dim)
        self.ssm = ScanSSM(dim, 4, 8)
        self.ssm_rev = ScanSSM(dim, 4, 8)
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.embed(ids)  # (B, T, C)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # each (B, H, T, D)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        u = causal_depthwise_conv(x.transpose(1, 2), self.short)  # (B, C, T)
        x = x + self.long(u).transpose(1, 2)
        x = x + self.mix(x).cumsum(dim=1) / t  # position t adds the sum of positions <= t
        x = x + self.ssm(x) + self.ssm_rev(x.flip(1)).flip(1)  # (B, T, C)
        return lm_loss(self.head(x), labels, causal=True)


def batches(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and labels (steps, BATCH, SEQ); a fifth of the labels ignored, more of them in the
    first row and the first half, so the ranks' token counts differ."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (steps, BATCH, SEQ), generator=gen)
    ignored = torch.rand(ids.shape, generator=gen) < torch.linspace(0.4, 0.1, BATCH).view(1, BATCH, 1)
    ignored[..., SEQ // 2:] = False
    return ids, ids.masked_fill(ignored, IGNORE)


def reference(steps: int) -> dict:
    """Plain single-process PyTorch on the same batches, SGD: the final state and each step's loss."""
    net = MixersLM()
    opt = torch.optim.SGD(net.parameters(), lr=SGD["params"]["lr"])
    ids, labels = batches(steps)
    losses = []
    for step in range(steps):
        loss = net(ids[step], labels[step])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"state": {k: v.detach().clone() for k, v in net.state_dict().items()}, "losses": losses}


# Tiling of each rank's slice in chunks of 8 (NOTE [Tiling a sequence-parallel forward]).
TILED = {"enabled": True, "block_size": 8, "attention_block_size": 8}


def train(rank: int, world_size: int, cases: list[tuple[int, str, bool]], steps: int) -> dict:
    """Per (stage, attention strategy, tiled): ``steps`` SGD steps of ``MixersLM``
    sequence-parallel over all ranks with ``"compile": "inductor"``; the full state, the losses,
    the graphs Inductor compiled and the cache counters of this rank's own compiles, the plan's
    decisions, the tiled ops, and the all-to-alls and ring attention ops of each graph."""
    from torch._dynamo.utils import counters

    out = {}
    ids, labels = batches(steps)
    for stage, attention, tiled in cases:
        own = {"compile": "inductor", "sequence_parallel": {"size": world_size, "attention": attention}}
        config = {"zero_optimization": {"stage": stage}, "optimizer": SGD, "zerofx": own | ({"tiling": TILED} if tiled else {})}
        counters.clear()
        engine = zerofx.initialize(MixersLM(), config, example_inputs=(ids[0],), example_kwargs={"labels": labels[0]})
        losses = []
        for step in range(steps):
            loss = engine(ids[step], labels=labels[step])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        graphs = {name: gm for name, gm in engine.graph_modules().items() if name in ("forward", "backward")}
        out[(stage, attention, tiled)] = {
            "state": engine.full_state_dict(), "losses": losses, "compiled": sorted(engine.program.compiled_graphs),
            "cache": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
            "decisions": engine.program.plan.decisions,
            "tiled": sorted(op.kind for op in engine.program.captured.tiling.ops) if engine.program.captured.tiling else [],
            "all_to_alls": {name: sum(1 for n in gm.graph.nodes if is_all_to_all(n)) for name, gm in graphs.items()},
            "rings": {name: sum(1 for n in gm.graph.nodes if is_ring_attention(n)) for name, gm in graphs.items()},
        }
        engine.close()
    return out
