"""What each rank runs in tests/test_sp_conv_mixers.py, and the single-process reference: the
Hyena models (short convs, FFT long convs, striped attention) and a small model with
``nn.Conv1d(padding=K-1)`` sliced to T and a cumsum, sequence-parallel against plain PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import zerofx
from zerofx.compiler.materialize import init_weights_
from zerofx.models import build_model
from zerofx.passes.meta import is_all_to_all

SGD = {"type": "SGD", "params": {"lr": 0.1}}
SEQ, BATCH, VOCAB, IGNORE = 64, 2, 4, -100


class ConvCumsumLM(torch.nn.Module):
    """``nn.Conv1d(padding=K-1)[..., :T]`` (Hugging Face Mamba's PyTorch path) and a running mean
    by cumsum along the sequence, then a loss over every position (no shift)."""

    def __init__(self, dim: int = 16, taps: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.conv = torch.nn.Conv1d(dim, dim, kernel_size=taps, padding=taps - 1, groups=dim)
        self.mix = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.conv(self.embed(ids).transpose(1, 2))[..., :t].transpose(1, 2)  # (B, T, d)
        x = x + self.mix(x).cumsum(dim=1) / t  # position t adds the sum of positions <= t
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), labels.reshape(-1))


def model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "convsum":
        return ConvCumsumLM()
    return init_weights_(build_model({"hyena": "hyena-tiny", "striped": "striped-tiny"}[kind]), seed=0)


def loss_of(net: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    out = net(ids, labels=labels)
    return out if isinstance(out, torch.Tensor) else out.loss


def batches(num_groups: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and labels (steps, groups, batch, T); a fifth of the labels ignored, more of them in
    the first row and in the first half of each sequence, so the ranks' token counts differ."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (steps, num_groups, BATCH, SEQ), generator=gen)
    labels = ids.clone()
    ignored = torch.rand(ids.shape, generator=gen) < torch.linspace(0.4, 0.1, BATCH).view(1, 1, BATCH, 1)
    ignored[..., SEQ // 2:] = False
    labels[ignored] = IGNORE
    return ids, labels


def reference(kind: str, num_groups: int, steps: int) -> dict:
    """Plain PyTorch on the global batch: the mean of the groups' losses, SGD."""
    net = model(kind)
    opt = torch.optim.SGD(net.parameters(), lr=SGD["params"]["lr"])
    ids, labels = batches(num_groups, steps)
    losses = []
    for step in range(steps):
        group_losses = [loss_of(net, ids[step, g], labels[step, g]) for g in range(num_groups)]
        opt.zero_grad()
        torch.stack(group_losses).mean().backward()
        opt.step()
        losses.append([x.item() for x in group_losses])
    return {"state": {k: v.detach().clone() for k, v in net.state_dict().items()}, "losses": losses}


def train(rank: int, world_size: int, cases: list[tuple[str, int, int, str]], steps: int) -> dict:
    """Per (model kind, stage, sequence-parallel size, attention strategy): ``steps`` SGD steps on
    the group's whole batch; the full state, this rank's losses, the all-to-alls of each graph and
    the plan's decisions."""
    out = {}
    for case in cases:
        kind, stage, size, attention = case
        group = rank // size
        ids, labels = batches(world_size // size, steps)
        config = {"zero_optimization": {"stage": stage}, "optimizer": SGD,
                  "zerofx": {"sequence_parallel": {"size": size, "attention": attention}}}
        engine = zerofx.initialize(model(kind), config, example_inputs=(ids[0, group],), example_kwargs={"labels": labels[0, group]})
        losses = []
        for step in range(steps):
            loss = engine(ids[step, group], labels=labels[step, group])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[case] = {
            "state": engine.full_state_dict(),
            "losses": losses,
            "all_to_alls": {name: sum(1 for n in gm.graph.nodes if is_all_to_all(n)) for name, gm in engine.graph_modules().items()},
            "decisions": engine.program.plan.decisions,
        }
        engine.close()
    return out
