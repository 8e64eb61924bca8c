"""What each rank runs in tests/test_sp_scan_mixer.py, and the single-process reference: models
whose only ops that mix positions are selective scans and flips along the sequence (the scan and
flip mixers, passes/sequence/mixer_scan.py and passes/sequence/mixer_flip.py), and the bundled Mamba models."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import zerofx
from zerofx.compiler.materialize import init_weights_
from zerofx.models import build_model, model_config
from zerofx.models.long_conv import lm_loss
from zerofx.models.scan import selective_scan
from zerofx.passes.meta import is_all_to_all

SGD = {"type": "SGD", "params": {"lr": 0.1}}
VOCAB, IGNORE, MASK_ID, SEED = 5, -100, 4, 0
SCAN_MODELS = ("scan", "biscan")  # the conv-free models below; any other kind is a bundled size


class ScanSSM(torch.nn.Module):
    """One direction of a Mamba mixer without its conv: delta, B and C from x, A = -exp(A_log), D."""

    def __init__(self, e: int, n: int, chunk_len: int) -> None:
        super().__init__()
        self.n, self.chunk_len = n, chunk_len
        self.x_proj = torch.nn.Linear(e, 1 + 2 * n)
        self.dt_proj = torch.nn.Linear(1, e)
        self.A_log = torch.nn.Parameter(torch.log(torch.arange(1, n + 1, dtype=torch.float32)).repeat(e, 1))
        self.D = torch.nn.Parameter(torch.ones(e))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, E) -> (B, T, E)
        dt, b, c = self.x_proj(x).split((1, self.n, self.n), dim=-1)
        delta = F.softplus(self.dt_proj(dt) - 2.0)  # (B, T, E), about 0.1
        return selective_scan(x, delta, -torch.exp(self.A_log), b, c, self.D, chunk_len=self.chunk_len)


class ScanLM(torch.nn.Module):
    """Embedding, in projection, a scan (and with ``bidirectional`` a second over the flipped
    sequence, flipped back), head; the loss causal (shifted) or masked-LM (not shifted)."""

    def __init__(self, bidirectional: bool, e: int = 16, n: int = 4, chunk_len: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, e)
        self.ssm = ScanSSM(e, n, chunk_len)
        self.ssm_rev = ScanSSM(e, n, chunk_len) if bidirectional else None
        self.head = torch.nn.Linear(e, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, T, E)
        y = self.ssm(x)
        if self.ssm_rev is not None:
            y = y + self.ssm_rev(x.flip(1)).flip(1)
        return lm_loss(self.head(y), labels, causal=self.ssm_rev is None)


def _causal(kind: str) -> bool:
    return kind == "scan" if kind in SCAN_MODELS else model_config(kind).is_causal


def batches(kind: str, num_groups: int, steps: int, seq_len: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """ids and labels (steps, groups, batch, T). Causal: the ids, a few labels ignored (more in the
    first half and in the first row). Masked LM: a quarter of the positions masked and labelled,
    the rest -100."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MASK_ID, (steps, num_groups, batch, seq_len), generator=g)
    if _causal(kind):
        ignored = torch.rand(ids.shape, generator=g) < torch.linspace(0.4, 0.1, batch).view(1, 1, batch, 1)
        ignored[..., seq_len // 2:] &= torch.rand(ids[..., seq_len // 2:].shape, generator=g) < 0.2
        return ids, ids.masked_fill(ignored, IGNORE)
    masked = torch.rand(ids.shape, generator=g) < 0.25
    return ids.masked_fill(masked, MASK_ID), ids.masked_fill(~masked, IGNORE)


def _model(kind: str, device: str | None = None) -> torch.nn.Module:
    if kind in SCAN_MODELS:
        return ScanLM(bidirectional=kind == "biscan")
    if device == "meta":
        return build_model(kind, device="meta")
    return init_weights_(build_model(kind), seed=SEED)


def _loss(net: torch.nn.Module, kind: str, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    out = net(ids, labels=labels)
    return out if kind in SCAN_MODELS else out.loss


def reference(kind: str, num_groups: int, steps: int, seq_len: int, batch: int = 2) -> dict:
    """Plain PyTorch on the whole global batch: each step the mean over data groups of each group's loss, SGD."""
    net = _model(kind)
    opt = torch.optim.SGD(net.parameters(), lr=SGD["params"]["lr"])
    ids, labels = batches(kind, num_groups, steps, seq_len, batch)
    losses = []
    for step in range(steps):
        group_losses = [_loss(net, kind, ids[step, g], labels[step, g]) for g in range(num_groups)]
        opt.zero_grad()
        torch.stack(group_losses).mean().backward()
        opt.step()
        losses.append([x.item() for x in group_losses])
    return {"state": {k: v.detach().clone() for k, v in net.state_dict().items()}, "losses": losses}


def train(rank: int, world_size: int, cases: list[tuple[str, int, int, int]], steps: int, batch: int = 2) -> dict:
    """For each (kind, stage, sequence-parallel size, T): ``steps`` SGD steps, every rank of a
    sequence group on its group's whole batch of ``batch`` sequences; the full state, this
    rank's losses, the plan's decisions and the all-to-alls of the forward."""
    out = {}
    for case in cases:
        kind, stage, size, seq_len = case
        group = rank // size
        ids, labels = batches(kind, world_size // size, steps, seq_len, batch)
        config = {"zero_optimization": {"stage": stage}, "optimizer": SGD, "zerofx": {"sequence_parallel": {"size": size}}}
        init = {} if kind in SCAN_MODELS else {"init_seed": SEED}
        engine = zerofx.initialize(_model(kind, device="meta"), config, example_inputs=(ids[0, group],),
                                   example_kwargs={"labels": labels[0, group]}, **init)
        losses = []
        for step in range(steps):
            loss = engine(ids[step, group], labels=labels[step, group])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        forward = engine.graph_modules()["forward"]
        out[case] = {"state": engine.full_state_dict(), "losses": losses, "decisions": engine.program.plan.decisions,
                     "all_to_alls": sum(1 for n in forward.graph.nodes if is_all_to_all(n))}
        engine.close()
    return out
