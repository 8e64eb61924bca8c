"""What each rank runs in tests/test_sequence_parallel.py, and the single-process reference."""

from __future__ import annotations

import torch

import zerofx
from zerofx.common.errors import RankDivergenceError
from zerofx.models.dna_lm import DNADecoderLM, DNALMConfig
from zerofx.passes.meta import is_all_to_all
from zerofx.passes.sequence.ring_attention import is_ring_attention, ring_exchanges

CONFIG = DNALMConfig(dim=32, num_layers=2, num_heads=4, ffn_dim=88, max_seq_len=64)
SGD = {"type": "SGD", "params": {"lr": 0.1}}
# What a parity case adds to its config: the features sequence parallelism composes with.
FEATURES: dict[str, dict] = {
    "fp32": {},
    "offload": {"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
                "zerofx": {"offload_gradients": {"device": "cpu"}}},
    "bf16": {"bf16": {"enabled": True}},
    "fp16": {"fp16": {"enabled": True}},
    "shard2": {"zerofx": {"shard_group_size": 2}},  # hierarchical sharding: shard groups of 2 ranks
    "contiguous": {"zerofx": {"sequence_parallel": {"load_balance": False}}},  # causal ring without the zigzag layout
    # Tiling of each rank's slice (T/S = 8 positions here) in chunks of 4, attention in blocks of 4.
    "tiled": {"zerofx": {"tiling": {"enabled": True, "block_size": 4, "attention_block_size": 4}}},
}
IGNORE = -100
ESM_VOCAB, ESM_PAD, ESM_MASK = CONFIG.vocab_size + 2, CONFIG.vocab_size, CONFIG.vocab_size + 1


def model(kind: str = "dna") -> torch.nn.Module:
    """The bundled DNA LM, a Hugging Face Llama (rotary, grouped-query attention: 4 query heads,
    2 key/value heads; SDPA), or a Hugging Face ESM masked LM (bidirectional, rotary, as the
    Nucleotide Transformer v2 configures it: no token dropout, no embedding norm), from small
    configs with random weights."""
    torch.manual_seed(0)
    if kind == "dna":
        return DNADecoderLM(CONFIG)
    if kind == "esm":
        from transformers import EsmConfig, EsmForMaskedLM

        cfg = EsmConfig(vocab_size=ESM_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=64, position_embedding_type="rotary", token_dropout=False, emb_layer_norm_before=False,
                        pad_token_id=ESM_PAD, mask_token_id=ESM_MASK, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        attn_implementation="sdpa")
        return EsmForMaskedLM(cfg)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=CONFIG.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def batches(num_groups: int, steps: int, batch: int = 2, seq_len: int = 16, kind: str = "dna") -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and labels of shape (steps, groups, batch, seq_len). For the causal LMs, labels
    are the ids with ignored positions spread unevenly: all in the first half of each sequence,
    more in some rows. For ESM (masked LM), a few positions per row are masked in the ids and
    predicted, more in some rows and none in the last quarter (where ``attention_mask`` pads);
    every other label is ignored."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG.vocab_size, (steps, num_groups, batch, seq_len), generator=gen)
    labels = ids.clone()
    if kind == "esm":
        predicted = torch.rand(ids.shape, generator=gen) < torch.linspace(0.5, 0.15, batch).view(1, 1, batch, 1)
        predicted[..., 0] = True
        predicted[..., seq_len * 3 // 4:] = False
        labels[~predicted] = IGNORE
        ids[predicted] = ESM_MASK
        return ids, labels
    ignored = torch.rand(ids.shape, generator=gen) < torch.linspace(0.6, 0.1, batch).view(1, 1, batch, 1)
    ignored[..., seq_len // 2:] = False
    labels[ignored] = IGNORE
    return ids, labels


def attention_mask(kind: str, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """ESM's keyword: padding at the end of the last row (its labels are ignored there); none for the causal LMs."""
    if kind != "esm":
        return {}
    mask = torch.ones_like(ids)
    mask[..., -1, -2:] = 0
    return {"attention_mask": mask}


def reference(num_groups: int, steps: int, kind: str = "dna", batch: int = 2) -> dict:
    """Plain PyTorch on the whole global batch: the mean over data groups of each group's loss
    (what data parallelism averages), SGD."""
    net = model(kind)
    opt = torch.optim.SGD(net.parameters(), lr=SGD["params"]["lr"])
    ids, labels = batches(num_groups, steps, batch, kind=kind)
    losses = []
    for step in range(steps):
        group_losses = [net(ids[step, g], labels=labels[step, g], **attention_mask(kind, ids[step, g])).loss for g in range(num_groups)]
        loss = torch.stack(group_losses).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append([x.item() for x in group_losses])
    return {"state": {k: v.detach().clone() for k, v in net.state_dict().items()}, "losses": losses}


def train(rank: int, world_size: int, cases: list[tuple[str, int, int, str, str]], steps: int, checkpoint_dir: str | None = None,
          batch: int = 2) -> dict:
    """For each (model kind, stage, sequence-parallel size, attention, feature): ``steps`` SGD
    steps, every rank of a sequence group on its group's whole batch, with ``FEATURES[feature]``
    in the config; the full state (in mixed precision also the fp32 masters, gathered), this
    rank's losses and the exchanges in each graph. With ``checkpoint_dir``, the first case's
    engine then saves, takes one more step and loads (whether loading restored the saved state),
    and is called with a different batch on each rank of a group."""
    out = {}
    for case in cases:
        kind, stage, size, attention, feature = case
        group = rank // size
        ids, labels = batches(world_size // size, steps, batch, kind=kind)
        extra = FEATURES[feature]
        own = extra.get("zerofx", {})
        own = {**own, "sequence_parallel": {"size": size, "attention": attention, **own.get("sequence_parallel", {})}}
        config = {**extra, "zero_optimization": {"stage": stage, **extra.get("zero_optimization", {})}, "optimizer": SGD, "zerofx": own}
        engine = zerofx.initialize(model(kind), config, example_inputs=(ids[0, group],),
                                   example_kwargs={"labels": labels[0, group], **attention_mask(kind, ids[0, group])})
        losses = []
        for step in range(steps):
            loss = engine(ids[step, group], labels=labels[step, group], **attention_mask(kind, ids[step, group]))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        gms = engine.graph_modules()
        out[case] = {
            "state": engine.full_state_dict(),
            "masters": full_masters(engine),
            "losses": losses,
            "all_to_alls": {name: sum(1 for n in gm.graph.nodes if is_all_to_all(n)) for name, gm in gms.items()},
            "ring_ops": {name: sum(1 for n in gm.graph.nodes if is_ring_attention(n)) for name, gm in gms.items()},
            "ring_sends": {name: sum(len(ring_exchanges(n)) for n in gm.graph.nodes) for name, gm in gms.items()},
            "decisions": engine.program.plan.decisions,
            "tiled": sorted(op.kind for op in engine.program.captured.tiling.ops) if engine.program.captured.tiling else [],
        }
        if checkpoint_dir is not None and len(out) == 1:
            engine.save_checkpoint(checkpoint_dir, "sp")
            loss = engine(ids[0, group], labels=labels[0, group])
            engine.backward(loss)
            engine.step()
            moved = engine.full_state_dict()
            engine.load_checkpoint(checkpoint_dir, "sp")
            restored = engine.full_state_dict()
            saved = out[case]["state"]
            out["checkpoint"] = {"moved": any(not torch.equal(moved[k], saved[k]) for k in saved),
                                 "restored": all(torch.equal(restored[k], saved[k]) for k in saved)}
            try:  # a rank of the group passes another batch
                engine((ids[0, group] + rank % size) % CONFIG.vocab_size, labels=labels[0, group])
                out["mismatch"] = None
            except RankDivergenceError as exc:
                out["mismatch"] = str(exc)
        engine.close()
    return out


def full_masters(engine: zerofx.Engine) -> dict[str, torch.Tensor] | None:
    """Each parameter's fp32 master, gathered from the ranks' shards (a collective at stages
    1-3); None without mixed precision, where the parameters are the fp32 state."""
    from zerofx.passes import _compat

    if not engine.storage.master:
        return None
    out = {}
    for fqn, shard in engine.storage.master.items():
        p = engine.placements[fqn]
        flat = torch.empty(p.padded_numel, dtype=shard.dtype)
        _compat.all_gather_flat(flat, shard, group=engine.shard_group)
        out[fqn] = flat[: p.numel].view(p.shape)
    return out


class TokenLM(torch.nn.Module):
    """Causal attention (2 heads) and a cross-entropy over the logits in the compute dtype (no upcast)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(CONFIG.vocab_size, 16)
        self.head = torch.nn.Linear(16, CONFIG.vocab_size)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.embed(ids).view(b, t, 2, 8).transpose(1, 2)  # (B, 2 heads, T, 8)
        x = torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True).transpose(1, 2).reshape(b, t, 16)
        return torch.nn.functional.cross_entropy(self.head(x).reshape(-1, CONFIG.vocab_size), labels.reshape(-1))


class CumprodLM(torch.nn.Module):
    """Mixes positions with a running product along the sequence, which no mixer owns: what the rewrite must refuse."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(CONFIG.vocab_size, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, CONFIG.vocab_size)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.mix(self.embed(ids)).cumprod(dim=1)  # (B, T, d): position t multiplies positions <= t
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class PoolLM(torch.nn.Module):
    """An average pool along the sequence, which no mixer owns (the convolutions' are passes/sequence/mixer_conv.py's)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(CONFIG.vocab_size, 16)
        self.filter = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, CONFIG.vocab_size)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.filter(self.embed(ids)).transpose(1, 2)  # (B, d, T)
        x = torch.nn.functional.avg_pool1d(x, 3, stride=1, padding=1).transpose(1, 2)  # (B, T, d)
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _recording_shapes(saved: list[tuple[int, ...]]):
    """A saved-tensors pack hook that records each saved tensor's shape in ``saved``."""
    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(x.shape))
        return x
    return pack


def ring_attention_errors(rank: int, world_size: int) -> dict[str, dict]:
    """``ring_attention`` over the whole world as one ring against fp32 SDPA on the whole
    sequence, per case (causal; bidirectional with grouped-query heads; an additive mask; a
    boolean mask with a row masked everywhere and keys masked in some blocks only; causal with
    grouped-query heads in bf16 and in fp16, against SDPA on the same rounded inputs; causal in
    the zigzag layout with grouped-query heads; a boolean mask cut to the zigzag layout's rows and
    columns): the
    largest difference in the output and in dq, dk, dv of this rank's slice, their dtypes, the
    whole shapes (B, H, Hkv, T, D), and the shapes of the tensors autograd saved for the backward."""
    import torch.distributed as dist

    from zerofx.passes import _compat
    from zerofx.passes.sequence.ring_attention import ring_attention, zigzag_chunks

    _compat.register_group_name("zerofx_test_ring", dist.group.WORLD)
    gen = torch.Generator().manual_seed(2)
    b, h, local, d = 2, 4, 4, 8
    t = local * world_size
    contiguous = torch.arange(rank * local, (rank + 1) * local)
    zigzag = torch.cat([torch.arange(c * local // 2, (c + 1) * local // 2) for c in zigzag_chunks(rank, world_size)])
    out_by_case = {}
    for case in ("causal", "gqa", "additive", "boolean", "bf16", "fp16", "zigzag_gqa", "zigzag_boolean"):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(case, torch.float32)
        causal, gqa = case in ("causal", "bf16", "fp16", "zigzag_gqa"), case in ("gqa", "bf16", "fp16", "zigzag_gqa")
        mine = zigzag if case.startswith("zigzag") else contiguous
        kv_heads = h // 2 if gqa else h
        q, k, v = (torch.randn(b, n, t, d, generator=gen).to(dtype).float() for n in (h, kv_heads, kv_heads))
        grad = torch.randn(b, h, t, d, generator=gen)
        mask = None
        if case == "additive":
            mask = torch.randn(b, 1, t, t, generator=gen)
        elif case in ("boolean", "zigzag_boolean"):
            mask = torch.rand(1, 1, t, t, generator=gen) > 0.5
            mask[..., : local // 2] = False
            mask[..., 0, :] = False  # a query that attends to nothing: output 0
        whole = [x.clone().requires_grad_(True) for x in (q, k, v)]
        ref = torch.nn.functional.scaled_dot_product_attention(*whole, attn_mask=mask, is_causal=causal, enable_gqa=gqa)
        ref = torch.nan_to_num(ref)
        (ref * grad).sum().backward()
        part = [x[:, :, mine].to(dtype).requires_grad_(True) for x in (q, k, v)]
        saved: list[tuple[int, ...]] = []
        with torch.autograd.graph.saved_tensors_hooks(_recording_shapes(saved), lambda x: x):
            out = ring_attention(*part, mask, is_causal=causal, scale=d ** -0.5, size=world_size, group_name="zerofx_test_ring",
                                 zigzag=case.startswith("zigzag"))
        (out * grad[:, :, mine].to(dtype)).sum().backward()
        diffs = [(out.float() - ref[:, :, mine]).abs().max()] + [(p.grad.float() - w.grad[:, :, mine]).abs().max() for p, w in zip(part, whole)]
        out_by_case[case] = {"error": max(x.item() for x in diffs), "dtypes": {x.dtype for x in (out, *(p.grad for p in part))} - {dtype},
                             "shape": (b, h, kv_heads, t, d), "saved": saved}
    return out_by_case
