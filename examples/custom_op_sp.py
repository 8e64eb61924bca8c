"""An op zerofx cannot know, sharded along the sequence: a causal depthwise convolution registered
with ``torch.library`` (a kernel, a fake kernel, an autograd formula, as a CUDA or Triton
causal-conv1d ships them), declared to zerofx as an op that reads the K - 1 positions before each
output (``"halo"``), then planned sequence-parallel over 2 ranks in one process.

    python examples/custom_op_sp.py

Train it with ``zerofx.initialize(model, config, ...)`` and ``"sequence_parallel": {"size": 2}``
in the config, as any model (docs/sequence-parallel.md, "Ops zerofx cannot know").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import zerofx


@torch.library.custom_op("example::causal_conv", mutates_args=())
def causal_conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (B, C, T) by w (C, 1, K), zeros before the sequence: a stand-in for a fused kernel."""
    return F.conv1d(F.pad(x, (w.shape[-1] - 1, 0)), w, groups=x.shape[1])


@causal_conv.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def save_inputs(ctx: object, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def causal_conv_backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = ctx.saved_tensors
    k = w.shape[-1]
    grad_x = F.conv1d(F.pad(grad, (0, k - 1)), w.flip(-1), groups=x.shape[1])
    windows = F.pad(x, (k - 1, 0)).unfold(-1, k, 1)  # (B, C, T, K)
    return grad_x, torch.einsum("bct,bctk->ck", grad, windows).unsqueeze(1)


causal_conv.register_autograd(causal_conv_backward, setup_context=save_inputs)

# Output t reads inputs t - K + 1 .. t: a halo of K - 1 positions from the left neighbour.
zerofx.register_sequence_mixer(zerofx.OpSequenceMixer(causal_conv, "halo", seq_dim=-1, halo=lambda x, w: w.shape[-1] - 1))


class ConvLM(torch.nn.Module):
    def __init__(self, vocab: int = 8, channels: int = 16, taps: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, channels)
        self.taps = torch.nn.Parameter(torch.randn(channels, 1, taps) / taps)
        self.head = torch.nn.Linear(channels, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        u = self.embed(ids).transpose(1, 2)  # (B, C, T)
        u = u + torch.tanh(causal_conv(u, self.taps))
        logits = self.head(u.transpose(1, 2))  # (B, T, V)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def main() -> tuple[str, ...]:
    ids = torch.randint(0, 8, (2, 64))
    program = zerofx.compile(ConvLM(), world_size=2, stage=0, config={"zerofx": {"sequence_parallel": {"size": 2}}},
                             example_inputs=(ids,), example_kwargs={"labels": ids})
    for decision in program.plan.decisions:
        if decision.startswith("sequence"):
            print(decision)
    return program.plan.decisions


if __name__ == "__main__":
    main()
