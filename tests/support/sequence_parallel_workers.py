"""What each rank runs in tests/test_sequence_parallel.py, and the single-process reference."""

from __future__ import annotations

import torch

import zerofx
from zerofx.errors import RankDivergenceError
from zerofx.models.dna_lm import DNADecoderLM, DNALMConfig

CONFIG = DNALMConfig(dim=32, num_layers=2, num_heads=4, ffn_dim=88, max_seq_len=64)
SGD = {"type": "SGD", "params": {"lr": 0.1}}
IGNORE = -100


def model(kind: str = "dna") -> torch.nn.Module:
    """The bundled DNA LM, or a Hugging Face Llama (rotary, grouped-query attention: 4 query heads,
    2 key/value heads; SDPA) from a small config with random weights."""
    torch.manual_seed(0)
    if kind == "dna":
        return DNADecoderLM(CONFIG)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=CONFIG.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def batches(num_groups: int, steps: int, batch: int = 2, seq_len: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels of shape (steps, groups, batch, seq_len). Labels are the ids with
    ignored positions spread unevenly: all in the first half of each sequence, more in some rows."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (steps, num_groups, batch, seq_len), generator=gen)
    labels = ids.clone()
    ignored = torch.rand(ids.shape, generator=gen) < torch.linspace(0.6, 0.1, batch).view(1, 1, batch, 1)
    ignored[..., seq_len // 2:] = False
    labels[ignored] = IGNORE
    return ids, labels


def reference(num_groups: int, steps: int, kind: str = "dna") -> dict:
    """Plain PyTorch on the whole global batch: the mean over data groups of each group's loss
    (what data parallelism averages), SGD."""
    net = model(kind)
    opt = torch.optim.SGD(net.parameters(), lr=SGD["params"]["lr"])
    ids, labels = batches(num_groups, steps)
    losses = []
    for step in range(steps):
        group_losses = [net(ids[step, g], labels=labels[step, g]).loss for g in range(num_groups)]
        loss = torch.stack(group_losses).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append([x.item() for x in group_losses])
    return {"state": {k: v.detach().clone() for k, v in net.state_dict().items()}, "losses": losses}


def train(rank: int, world_size: int, cases: list[tuple[str, int, int]], steps: int, checkpoint_dir: str | None = None) -> dict:
    """For each (model kind, stage, sequence-parallel size): ``steps`` SGD steps, every rank of a
    sequence group on its group's whole batch; the full state and this rank's losses. With
    ``checkpoint_dir``, the first case's engine then saves, takes one more step and loads (whether
    loading restored the saved state), and is called with a different batch on each rank of a group."""
    out = {}
    for kind, stage, size in cases:
        group = rank // size
        ids, labels = batches(world_size // size, steps)
        engine = zerofx.initialize(
            model(kind), {"zero_optimization": {"stage": stage}, "optimizer": SGD, "zerofx": {"sequence_parallel": {"size": size}}},
            example_inputs=(ids[0, group],), example_kwargs={"labels": labels[0, group]},
        )
        losses = []
        for step in range(steps):
            loss = engine(ids[step, group], labels=labels[step, group])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        gms = engine.graph_modules()
        out[(kind, stage, size)] = {
            "state": engine.full_state_dict(),
            "losses": losses,
            "all_to_alls": {name: sum(1 for n in gm.graph.nodes if n.op == "call_function" and "all_to_all" in str(n.target))
                            for name, gm in gms.items()},
            "decisions": engine.program.plan.decisions,
        }
        if checkpoint_dir is not None and len(out) == 1:
            engine.save_checkpoint(checkpoint_dir, "sp")
            loss = engine(ids[0, group], labels=labels[0, group])
            engine.backward(loss)
            engine.step()
            moved = engine.full_state_dict()
            engine.load_checkpoint(checkpoint_dir, "sp")
            restored = engine.full_state_dict()
            saved = out[(kind, stage, size)]["state"]
            out["checkpoint"] = {"moved": any(not torch.equal(moved[k], saved[k]) for k in saved),
                                 "restored": all(torch.equal(restored[k], saved[k]) for k in saved)}
            try:  # a rank of the group passes another batch
                engine((ids[0, group] + rank % size) % CONFIG.vocab_size, labels=labels[0, group])
                out["mismatch"] = None
            except RankDivergenceError as exc:
                out["mismatch"] = str(exc)
    return out


class CumsumLM(torch.nn.Module):
    """Mixes positions with a running sum along the sequence: what the rewrite must refuse."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(CONFIG.vocab_size, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, CONFIG.vocab_size)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.mix(self.embed(ids)).cumsum(dim=1)  # (B, T, d): position t sums positions <= t
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class LongConvLM(torch.nn.Module):
    """A causal convolution along the sequence (a Hyena-style long filter, short here)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(CONFIG.vocab_size, 16)
        self.filter = torch.nn.Conv1d(16, 16, kernel_size=4, padding=3, groups=16)
        self.head = torch.nn.Linear(16, CONFIG.vocab_size)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids).transpose(1, 2)  # (B, d, T)
        x = self.filter(x)[..., : ids.shape[1]].transpose(1, 2)  # (B, T, d)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())
