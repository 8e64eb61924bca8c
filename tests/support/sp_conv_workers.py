"""What each rank runs in tests/test_sp_conv_mixers.py, and the single-process reference: the
Hyena models (short convs, FFT long convs, striped attention), a small model with
``nn.Conv1d(padding=K-1)`` sliced to T and a cumsum, and one with long convolutions written as
direct ``conv1d``, sequence-parallel against plain PyTorch."""

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


class LongDirectConvLM(torch.nn.Module):
    """Long causal depthwise convolutions written as direct ``conv1d``: a filter of T taps per
    channel (a parameter) after ``pad(u, (T-1, 0))``, then ``nn.Conv1d(padding=K-1)`` of K = 40
    taps sliced to T. At S = 2 and 4 both reach past the left neighbour's slice."""

    def __init__(self, dim: int = 8, taps: int = 40) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.filter = torch.nn.Parameter(torch.randn(dim, 1, SEQ) / SEQ)  # (C, 1, T)
        self.conv = torch.nn.Conv1d(dim, dim, kernel_size=taps, padding=taps - 1, groups=dim)
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        u = self.embed(ids).transpose(1, 2)  # (B, C, T)
        k = self.filter.shape[-1]
        y = F.conv1d(F.pad(u, (k - 1, 0)), self.filter, groups=u.shape[1])  # (B, C, T)
        y = self.conv(torch.tanh(y) + u)[..., :t]  # (B, C, T)
        return F.cross_entropy(self.head(y.transpose(1, 2)).reshape(-1, VOCAB), labels.reshape(-1))


def model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "convsum":
        return ConvCumsumLM()
    if kind == "longconv":
        return LongDirectConvLM()
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


# Tiling of each rank's slice in chunks of 8 (NOTE [Tiling a sequence-parallel forward]).
TILED = {"enabled": True, "block_size": 8, "attention_block_size": 8}


def train(rank: int, world_size: int, cases: list[tuple], steps: int) -> dict:
    """Per (model kind, stage, sequence-parallel size, attention strategy[, "tiled"]): ``steps``
    SGD steps on the group's whole batch; the full state, this rank's losses, the all-to-alls of
    each graph, the plan's decisions and the tiled ops."""
    out = {}
    for case in cases:
        kind, stage, size, attention = case[:4]
        group = rank // size
        ids, labels = batches(world_size // size, steps)
        own = {"sequence_parallel": {"size": size, "attention": attention}} | ({"tiling": TILED} if "tiled" in case[4:] else {})
        config = {"zero_optimization": {"stage": stage}, "optimizer": SGD, "zerofx": own}
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
            "tiled": sorted(op.kind for op in engine.program.captured.tiling.ops) if engine.program.captured.tiling else [],
        }
        engine.close()
    return out


def cumsum_errors(rank: int, world_size: int) -> dict[str, dict]:
    """The cumsum mixer's rewrite by itself over the whole world: per dtype, this rank's slice
    of the output and of the input's gradient against the whole sequence's cumsum in fp64, and
    the output's dtype, and one rounding to the dtype at the largest value. Inputs in [0.5, 1.5)
    over 512 positions: sums grow to about 500, where bf16's steps are 2 to 4, so adding the
    lower ranks' total in bf16 (a second rounding) shows."""
    import torch.distributed as dist
    import torch.fx as fx

    from zerofx.passes import _compat
    from zerofx.passes.sequence.mixer_conv import CUMSUM
    from zerofx.passes.sequence.sequence_mixers import MixerRewrite

    _compat.register_group_name("zerofx_test_cumsum", dist.group.WORLD)
    b, t, d = 2, 512, 4
    local = t // world_size
    mine = torch.arange(rank * local, (rank + 1) * local)
    graph = fx.Graph()
    x_node = graph.placeholder("x")
    node = graph.call_function(torch.ops.aten.cumsum.default, (x_node, 1))
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        gen = torch.Generator().manual_seed(3)
        x = (torch.rand(b, t, d, generator=gen) + 0.5).to(dtype)
        grad = torch.randn(b, t, d, generator=gen).to(dtype)
        x_node.meta["val"] = x
        ctx = MixerRewrite("prefix", world_size, "zerofx_test_cumsum", False, lambda n: None, lambda like: mine.to(like.device))
        part = x[:, mine].clone().requires_grad_(True)
        y = CUMSUM.rewrite(node, (part, 1), {}, ctx)
        (y.float() * grad[:, mine].float()).sum().backward()
        whole = x.double().cumsum(1)
        whole_grad = grad.double().flip(1).cumsum(1).flip(1)  # d/dx_s of sum_t g_t y_t = sum_{t >= s} g_t
        out[str(dtype)] = {"error": (y.double() - whole[:, mine]).abs().max().item(),
                           "grad_error": (part.grad.double() - whole_grad[:, mine]).abs().max().item(),
                           # one rounding to the dtype of a value v is at most eps/2 * |v|
                           "dtype": y.dtype, "rounding": torch.finfo(dtype).eps / 2 * whole.abs().max().item(),
                           "grad_rounding": torch.finfo(dtype).eps / 2 * whole_grad.abs().max().item()}
    return out
