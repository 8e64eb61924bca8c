"""Ops zerofx cannot know, defined here with ``torch.library`` (a kernel, a fake kernel and an
autograd formula, as a CUDA causal-conv1d ships them; the formula is
examples/custom_op_sp.py's, so parity checks the example's too), their sequence sharding declared with
``zerofx.register_sequence_mixer`` (NOTE [Declared sequence mixers] in passes/sequence/mixer_custom.py),
and what each rank runs in tests/test_sp_custom_ops.py. The ops and declarations exist in any
process that imports this module, the pool's ranks included."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

import zerofx
from zerofx.passes.meta import is_all_to_all

SGD = {"type": "SGD", "params": {"lr": 0.1}}
VOCAB, SEQ, BATCH, CHANNELS, TAPS = 8, 16, 2, 4, 3
EXCHANGES = ("halo", "channels", "gather")


def causal_conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv of x (B, C, T) by w (C, 1, K), zeros before the sequence."""
    return F.conv1d(F.pad(x, (w.shape[-1] - 1, 0)), w, groups=x.shape[1])


def _example() -> ModuleType:
    """examples/custom_op_sp.py, loaded once per process (it registers its own op)."""
    if EXAMPLE_MODULE not in sys.modules:
        spec = importlib.util.spec_from_file_location(EXAMPLE_MODULE, Path(__file__).resolve().parents[2] / "examples" / "custom_op_sp.py")
        module = sys.modules[EXAMPLE_MODULE] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[EXAMPLE_MODULE]


EXAMPLE_MODULE = "zerofx_examples_custom_op_sp"
EXAMPLE = _example()


def _define(exchange: str) -> torch.library.CustomOpDef:
    """``zerofx_test::causal_conv_<exchange>``: ``causal_conv`` as one op, with the example's gradients."""

    @torch.library.custom_op(f"zerofx_test::causal_conv_{exchange}", mutates_args=())
    def op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return causal_conv(x, w)

    op.register_fake(lambda x, w: torch.empty_like(x))
    op.register_autograd(EXAMPLE.causal_conv_backward, setup_context=EXAMPLE.save_inputs)
    return op


OPS = {exchange: _define(exchange) for exchange in EXCHANGES}
zerofx.register_sequence_mixer(zerofx.OpSequenceMixer(OPS["halo"], "halo", seq_dim=-1, halo=lambda x, w: w.shape[-1] - 1))
zerofx.register_sequence_mixer(zerofx.OpSequenceMixer(OPS["channels"], "channels", seq_dim=-1, channel_dim=1, per_channel={1: 0}))
zerofx.register_sequence_mixer(zerofx.OpSequenceMixer(OPS["gather"], "gather", seq_dim=-1))


class ConvOpsLM(torch.nn.Module):
    """An embedding, the ops of ``kinds`` in turn over (B, C, T), each with its own taps, and a head;
    ``plain``: ``causal_conv`` in plain PyTorch in place of each op (the reference)."""

    def __init__(self, kinds: tuple[str, ...] = EXCHANGES, plain: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kinds, self.plain = kinds, plain
        self.embed = torch.nn.Embedding(VOCAB, CHANNELS)
        self.taps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(CHANNELS, 1, TAPS) / TAPS) for _ in kinds])
        self.head = torch.nn.Linear(CHANNELS, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        u = self.embed(ids).transpose(1, 2)  # (B, C, T)
        for kind, w in zip(self.kinds, self.taps):
            u = u + torch.tanh(causal_conv(u, w) if self.plain else OPS[kind](u, w))
        return F.cross_entropy(self.head(u.transpose(1, 2)).reshape(-1, VOCAB), labels.reshape(-1))


def batches(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (steps, BATCH, SEQ), generator=gen)
    return ids, torch.roll(ids, -1, dims=-1)


def reference(steps: int) -> dict:
    """Plain PyTorch (``causal_conv`` written out, no custom op) on the whole batch, SGD."""
    net = ConvOpsLM(plain=True)
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


def train(rank: int, world_size: int, stages: list[int], steps: int) -> dict:
    """For each ZeRO stage: ``steps`` SGD steps of ``ConvOpsLM`` over one sequence group of
    ``world_size`` ranks; the full state, the losses, the forward's all-to-alls and the plan's decisions."""
    out = {}
    ids, labels = batches(steps)
    for stage in stages:
        config = {"zero_optimization": {"stage": stage}, "optimizer": SGD,
                  "zerofx": {"sequence_parallel": {"size": world_size}, "plan_cache": False}}
        engine = zerofx.initialize(ConvOpsLM(), config, example_inputs=(ids[0],), example_kwargs={"labels": labels[0]})
        losses = []
        for step in range(steps):
            loss = engine(ids[step], labels=labels[step])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        forward = engine.graph_modules()["forward"]
        out[stage] = {"state": engine.full_state_dict(), "losses": losses,
                      "all_to_alls": sum(1 for n in forward.graph.nodes if is_all_to_all(n)),
                      "decisions": engine.program.plan.decisions}
        engine.close()
    return out
