"""What each rank runs in tests/test_hf_mamba.py, and the single-process reference: Hugging Face
``MambaForCausalLM``, ``Mamba2ForCausalLM`` and ``JambaForCausalLM`` from tiny configs with
random weights, on their pure-PyTorch path, adapted by ``zerofx.models.hf_mamba.use_zerofx_scan``
or, under sequence parallelism, as Hugging Face builds them (the capture adapts them)."""

from __future__ import annotations

import torch

import zerofx
from zerofx.models.hf_mamba import use_zerofx_scan
from zerofx.passes.meta import is_all_to_all

SGD = {"type": "SGD", "params": {"lr": 0.1}}
VOCAB, IGNORE, BATCH, CHUNK_LEN = 8, -100, 2, 8


def hf_model(kind: str, dtype: torch.dtype = torch.float32, adapt: bool = True, conv_kernel: int = 4) -> torch.nn.Module:
    """Hidden 32, 2 layers, state 8, conv ``conv_kernel`` taps. Mamba-2: 4 heads of 16 channels in 2 groups
    (each group's B and C shared by 2 heads), Hugging Face's chunk 16. Seeded, so every call
    builds the same weights; ``adapt``: with ``use_zerofx_scan`` (chunks of 8)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    if kind == "jamba":  # attention (layer 1) and Mamba (layer 0), a 2-expert MoE in layer 1; Hugging Face's default grouped experts
        from transformers import JambaConfig, JambaForCausalLM

        net = JambaForCausalLM(JambaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1,
                                           expert_layer_period=2, expert_layer_offset=1, num_experts=2, num_experts_per_tok=1,
                                           mamba_d_state=8, mamba_d_conv=conv_kernel, mamba_expand=2, mamba_dt_rank=4,
                                           max_position_embeddings=64, use_mamba_kernels=False))
    elif kind == "mamba":
        net = MambaForCausalLM(MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                           conv_kernel=conv_kernel, use_cache=False))
    else:
        net = Mamba2ForCausalLM(Mamba2Config(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                             head_dim=16, num_heads=4, n_groups=2, conv_kernel=conv_kernel, chunk_size=16, use_cache=False))
    net = net.to(dtype)
    return use_zerofx_scan(net, chunk_len=CHUNK_LEN) if adapt else net  # Jamba: zerofx.compile adapts it under sequence parallelism


def batches(num_groups: int, steps: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, labels and the attention mask, (steps, groups, batch, T). Labels ignored unevenly
    (more in the first row and the first half); the last row padded in its last 3 positions
    (the mask 0, the labels ignored)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (steps, num_groups, BATCH, seq_len), generator=g)
    ignored = torch.rand(ids.shape, generator=g) < torch.linspace(0.4, 0.1, BATCH).view(1, 1, BATCH, 1)
    ignored[..., seq_len // 2:] &= torch.rand(ids[..., seq_len // 2:].shape, generator=g) < 0.2
    mask = torch.ones_like(ids)
    mask[..., -1, -3:] = 0
    ignored |= mask == 0
    return ids, ids.masked_fill(ignored, IGNORE), mask


def padding(mask: torch.Tensor, masked: bool) -> dict[str, torch.Tensor]:
    return {"attention_mask": mask} if masked else {}


def reference(kind: str, num_groups: int, steps: int, seq_len: int, masked: bool, conv_kernel: int = 4) -> dict:
    """Hugging Face's own forward (not adapted) on the whole global batch: each step the mean over
    data groups of each group's loss, SGD; ``masked``: with the attention mask."""
    net = hf_model(kind, adapt=False, conv_kernel=conv_kernel)
    opt = torch.optim.SGD(net.parameters(), lr=SGD["params"]["lr"])
    ids, labels, mask = batches(num_groups, steps, seq_len)
    losses = []
    for step in range(steps):
        group_losses = [net(ids[step, g], labels=labels[step, g], **padding(mask[step, g], masked)).loss for g in range(num_groups)]
        opt.zero_grad()
        torch.stack(group_losses).mean().backward()
        opt.step()
        losses.append([x.item() for x in group_losses])
    return {"state": {k: v.detach().clone() for k, v in net.state_dict().items()}, "losses": losses}


def train(rank: int, world_size: int, cases: list[tuple[str, int, int, int, bool, int]], steps: int) -> dict:
    """For each (kind, stage, sequence-parallel size, T, with the attention mask, conv taps): ``steps`` SGD steps of the adapted model,
    every rank of a sequence group on its group's whole batch (size 1: no sequence parallelism,
    each rank its own data group); the full state, this rank's losses, the plan's decisions and
    the forward's scan ops and all-to-alls."""
    out = {}
    for case in cases:
        kind, stage, size, seq_len, masked, conv_kernel = case
        group = rank // size
        ids, labels, mask = batches(world_size // size, steps, seq_len)
        config = {"zero_optimization": {"stage": stage}, "optimizer": SGD}
        if size > 1:
            config["zerofx"] = {"sequence_parallel": {"size": size}}
        # Under sequence parallelism the model as Hugging Face builds it: the capture adapts its mixers (NOTE [The scan adapter while capturing]).
        engine = zerofx.initialize(hf_model(kind, conv_kernel=conv_kernel, adapt=size == 1), config, example_inputs=(ids[0, group],),
                                   example_kwargs={"labels": labels[0, group], **padding(mask[0, group], masked)})
        losses = []
        for step in range(steps):
            loss = engine(ids[step, group], labels=labels[step, group], **padding(mask[step, group], masked))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        forward = engine.graph_modules()["forward"]
        out[case] = {"state": engine.full_state_dict(), "losses": losses, "decisions": engine.program.plan.decisions,
                     "scans": sum(1 for n in forward.graph.nodes if n.target is torch.ops.zerofx.selective_scan.default),
                     "all_to_alls": sum(1 for n in forward.graph.nodes if is_all_to_all(n))}
        engine.close()
    return out
