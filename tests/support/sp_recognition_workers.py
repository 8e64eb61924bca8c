"""What each rank runs in tests/test_sp_recognition.py, and the single-process reference: models
as users write them (attention spelled out as matmuls and softmax, ``nn.TransformerEncoderLayer``,
GPT-2's ``Conv1D`` over ``(B·T, C)``), sequence-parallel against plain PyTorch."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import zerofx
from zerofx.passes.meta import is_all_to_all
from zerofx.passes.sequence.ring_attention import is_ring_attention

SGD = {"type": "SGD", "params": {"lr": 0.1}}
VOCAB, SEQ, BATCH, IGNORE = 8, 16, 2, -100


class WrittenAttentionLM(torch.nn.Module):
    """Attention as a hand-written model spells it: q scaled before the product, ``q @ kᵀ`` plus a
    per-head ALiBi bias (slopes times the distance between positions, from ``arange``) and a
    causal mask filled with ``-inf`` by ``where``, softmax, ``@ v``."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, VOCAB)
        self.register_buffer("slopes", torch.tensor([2.0 ** -(i + 1) for i in range(heads)]).view(heads, 1, 1), persistent=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.embed(ids)  # (B, T, C)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, T, D)
        pos = torch.arange(t)
        distance = (pos.view(1, t) - pos.view(t, 1)).float()  # (T, T): key minus query position
        bias = torch.where(distance > 0, float("-inf"), self.slopes * distance)  # (H, T, T): ALiBi, causal
        scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1) + bias  # (B, H, T, T)
        y = scores.softmax(dim=-1) @ v  # (B, H, T, D)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), labels.reshape(-1))


ATTENTION_SPELLINGS = ("masked_fill", "fill_then_scale", "add_then_scale", "bmm")


class SpelledAttentionLM(torch.nn.Module):
    """One causal attention layer per spelling, each as hand-written code writes it, the causal
    mask ``triu(ones(T, T), diagonal=1).bool()``: ``masked_fill`` of the scaled scores with
    ``-inf``; the scores filled with the dtype's lowest value, then scaled; an additive ``-inf``
    mask, then divided by sqrt(d); and 3-d ``bmm`` over (B·H, T, d), scaled, filled with ``-inf``."""

    def __init__(self, spellings: tuple[str, ...], dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.spellings, self.heads = spellings, heads
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(dim, 3 * dim) for _ in spellings)
        self.proj = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in spellings)
        self.head = torch.nn.Linear(dim, VOCAB)

    def attend(self, spelling: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, h, t, d = q.shape  # (B, H, T, D)
        causal = torch.triu(torch.ones(t, t), diagonal=1).bool()  # (T, T): True above the diagonal
        if spelling == "masked_fill":
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(d)
            return scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        if spelling == "fill_then_scale":
            scores = (q @ k.transpose(-2, -1)).masked_fill(causal, torch.finfo(q.dtype).min) * d ** -0.5
            return scores.softmax(-1) @ v
        if spelling == "add_then_scale":
            mask = torch.zeros(t, t).masked_fill(causal, float("-inf"))
            return ((q @ k.transpose(-2, -1) + mask) / math.sqrt(d)).softmax(-1) @ v
        assert spelling == "bmm", spelling
        q3, k3, v3 = (x.reshape(b * h, t, d) for x in (q, k, v))  # (B·H, T, D)
        scores = torch.bmm(q3, k3.transpose(1, 2)) * d ** -0.5
        return torch.bmm(F.softmax(scores.masked_fill(causal, float("-inf")), dim=-1), v3).view(b, h, t, d)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.embed(ids)  # (B, T, C)
        for spelling, qkv, proj in zip(self.spellings, self.qkv, self.proj):
            q, k, v = qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, T, D)
            x = x + proj(self.attend(spelling, q, k, v).transpose(1, 2).reshape(b, t, -1))
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), labels.reshape(-1))


class MultiheadAttentionLM(torch.nn.Module):
    """``nn.MultiheadAttention`` called as its documentation shows, its weights returned
    (``need_weights=True``, the default) and dropped, with a causal float mask: inside, 3-d
    ``baddbmm(mask, q · c, kᵀ)`` over (B·H, T, d), softmax, ``bmm`` with v, and the weights
    averaged over the heads for a caller that does not read them."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.attn = torch.nn.MultiheadAttention(dim, 2, batch_first=True)
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, T, C)
        y, _ = self.attn(x, x, x, attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(ids.shape[1]))
        return F.cross_entropy(self.head(x + y).flatten(0, 1), labels.flatten())


class EncoderLM(torch.nn.Module):
    """``nn.TransformerEncoderLayer`` (``nn.MultiheadAttention`` inside), batch first, with or
    without a causal mask: its attention runs sequence-first, ``unflatten`` splits q, k and v
    from one projection, and the output projection runs over (T·B, C)."""

    def __init__(self, causal: bool, dim: int = 16) -> None:
        super().__init__()
        self.causal = causal
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.layer = torch.nn.TransformerEncoderLayer(dim, 2, 2 * dim, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        mask = torch.nn.Transformer.generate_square_subsequent_mask(t) if self.causal else None
        x = self.layer(self.embed(ids), src_mask=mask, is_causal=self.causal)  # (B, T, C)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class CachedRotaryLM(torch.nn.Module):
    """Rotary tables built on the first call and cached as plain attributes (not buffers), the
    frequencies a plain tensor attribute, and every call's sequence length appended to a list it
    holds: state kept on the module during ``forward``, as older Hugging Face rotary embeddings
    and implicit filters keep it."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.head = torch.nn.Linear(dim, VOCAB)
        half = dim // heads // 2
        self.inv_freq = 1.0 / 10000 ** (torch.arange(half) / half)  # a plain tensor, not a buffer
        self.cos_cached: torch.Tensor | None = None
        self.lengths: list[int] = []

    def rotary(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cos_cached is None or self.cos_cached.shape[0] < t:
            freqs = torch.outer(torch.arange(t, dtype=torch.float32), self.inv_freq)  # (T, D/2)
            self.cos_cached, self.sin_cached = freqs.cos(), freqs.sin()
        self.lengths.append(t)
        return self.cos_cached[:t], self.sin_cached[:t]

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.embed(ids)  # (B, T, C)
        cos, sin = self.rotary(t)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, T, D)

        def rotate(u: torch.Tensor) -> torch.Tensor:
            u1, u2 = u[..., ::2], u[..., 1::2]
            return torch.cat([u1 * cos - u2 * sin, u1 * sin + u2 * cos], dim=-1)

        y = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)  # (B, H, T, D)
        x = x + y.transpose(1, 2).reshape(b, t, -1)
        return F.cross_entropy(self.head(x).reshape(-1, VOCAB), labels.reshape(-1))


class FlatRowsLM(torch.nn.Module):
    """Token-wise work over (B·T, C) rows with position ids flattened the same way
    (``arange(T)`` repeated per sequence, (B·T,)), then causal SDPA over (B, H, T, D)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.positions = torch.nn.Embedding(SEQ, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.head = torch.nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        rows = self.embed(ids).reshape(b * t, -1) + self.positions(torch.arange(t).repeat(b))  # (B·T, C)
        q, k, v = self.qkv(rows).view(b, t, 3, 2, -1).permute(2, 0, 3, 1, 4).unbind(0)  # each (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b * t, -1)  # (B·T, C)
        return F.cross_entropy(self.head(rows + y), labels.reshape(-1))


class FFTConvLM(torch.nn.Module):
    """A gated long convolution as HyenaDNA's reference implementation spells it, re-created
    here: an implicit filter (an MLP with a sine over positional features cut from buffers to T,
    times a per-channel exponential decay), ``rfft(k, n=2T) / 2T`` against the signal's spectrum
    (the signal cast to the filter's dtype), ``irfft(..., norm="forward")`` cut to T, and a skip
    ``D · u``. ``spelling="ortho"`` writes every FFT with ``norm="ortho"`` and scales the output
    by sqrt(2T) instead; ``"long_filter"`` computes the filter over the buffers' whole 2T
    positions and cuts it to T before its FFT; ``"unsqueeze"`` multiplies the signal's spectrum
    by the filter's unsqueezed to (1, C, T + 1)."""

    def __init__(self, spelling: str, dim: int = 8, features: int = 3) -> None:
        super().__init__()
        self.spelling, self.dim = spelling, dim
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.in_proj = torch.nn.Linear(dim, 2 * dim)
        self.filter_mlp = torch.nn.Sequential(torch.nn.Linear(features, 16), torch.nn.Linear(16, dim))
        self.decay = torch.nn.Parameter(torch.linspace(0.5, 2.0, dim))
        self.skip = torch.nn.Parameter(torch.randn(dim))
        self.out_proj = torch.nn.Linear(dim, dim)
        self.head = torch.nn.Linear(dim, VOCAB)
        t = torch.linspace(0, 1, 2 * SEQ).view(1, 2 * SEQ, 1)  # positions over the longest context
        self.register_buffer("t", t, persistent=False)
        self.register_buffer("z", torch.cat([t, torch.cos(3.0 * t), torch.sin(3.0 * t)], dim=-1), persistent=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x, u = self.in_proj(self.embed(ids)).transpose(1, 2).split(self.dim, dim=1)  # (B, C, T) each
        length = 2 * SEQ if self.spelling == "long_filter" else t  # the filter's positions
        hidden = self.filter_mlp[0](self.z[:, :length])  # (1, L, 16)
        k = self.filter_mlp[1](torch.sin(hidden)) * torch.exp(-self.t[:, :length] * self.decay.abs())  # (1, L, C)
        k = k[0].transpose(0, 1)  # (C, L)
        if self.spelling == "long_filter":
            k = k[..., :t]  # (C, T): the filter of the longest context cut to T
        n = 2 * t
        if self.spelling == "ortho":
            y = torch.fft.irfft(torch.fft.rfft(u, n=n, norm="ortho") * torch.fft.rfft(k, n=n, norm="ortho"), n=n, norm="ortho")
            y = y[..., :t] * math.sqrt(n)
        elif self.spelling == "unsqueeze":
            k_f = torch.fft.rfft(k, n=n) / n  # (C, T + 1)
            y = torch.fft.irfft(torch.fft.rfft(u, n=n) * k_f.unsqueeze(0), n=n, norm="forward")[..., :t]
        else:
            k_f = torch.fft.rfft(k, n=n) / n
            u_f = torch.fft.rfft(u.to(dtype=k.dtype), n=n)
            y = torch.fft.irfft(u_f * k_f, n=n, norm="forward")[..., :t]
        y = x * (y + u * self.skip.unsqueeze(-1))  # (B, C, T)
        return F.cross_entropy(self.head(self.out_proj(y.transpose(1, 2))).reshape(-1, VOCAB), labels.reshape(-1))


_LAYERS = {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32, "intermediate_size": 64,
           "max_position_embeddings": 2 * SEQ}
_NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
# More Hugging Face architectures, each as its config builds it (its default attention), 2 layers
# of 4 heads and no dropout: (model class, config class, config keywords). The coverage matrix
# (benchmarks/coverage_matrix.py) plans each; the parity test trains those it names.
HF_CORPUS: dict[str, tuple[str, str, dict]] = {
    "mistral": ("MistralForCausalLM", "MistralConfig", {**_LAYERS, "num_key_value_heads": 2}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {**_LAYERS, "num_key_value_heads": 2}),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", {**_LAYERS, "num_key_value_heads": 1, "head_dim": 8}),
    "phi": ("PhiForCausalLM", "PhiConfig", {**_LAYERS, "resid_pdrop": 0.0, "embd_pdrop": 0.0}),
    "starcoder2": ("Starcoder2ForCausalLM", "Starcoder2Config", {**_LAYERS, "num_key_value_heads": 2, "residual_dropout": 0.0,
                                                                "embedding_dropout": 0.0}),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(_LAYERS)),
    "gptj": ("GPTJForCausalLM", "GPTJConfig", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 2 * SEQ, "rotary_dim": 4,
                                               "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "bigcode": ("GPTBigCodeForCausalLM", "GPTBigCodeConfig", {"n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 2 * SEQ,
                                                              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}),
    "mpt": ("MptForCausalLM", "MptConfig", {"d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 2 * SEQ}),
    "bloom": ("BloomForCausalLM", "BloomConfig", {"hidden_size": 32, "n_layer": 2, "n_head": 4, "hidden_dropout": 0.0,
                                                  "attention_dropout": 0.0}),
    "falcon": ("FalconForCausalLM", "FalconConfig", {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                                                     "hidden_dropout": 0.0, "attention_dropout": 0.0}),
    "opt": ("OPTForCausalLM", "OPTConfig", {"hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                            "max_position_embeddings": 2 * SEQ, "dropout": 0.0, "attention_dropout": 0.0,
                                            "word_embed_proj_dim": 32}),
    "roberta": ("RobertaForMaskedLM", "RobertaConfig", {**_LAYERS, **_NO_DROPOUT, "pad_token_id": 1}),
    "distilbert": ("DistilBertForMaskedLM", "DistilBertConfig", {"dim": 32, "hidden_dim": 64, "n_layers": 2, "n_heads": 4,
                                                                 "max_position_embeddings": 2 * SEQ, "dropout": 0.0,
                                                                 "attention_dropout": 0.0}),
    "electra": ("ElectraForMaskedLM", "ElectraConfig", {**_LAYERS, **_NO_DROPOUT, "embedding_size": 32}),
    "modernbert": ("ModernBertForMaskedLM", "ModernBertConfig", {**_LAYERS, "pad_token_id": 0}),
}


def model(kind: str) -> torch.nn.Module:
    """Small random-weight models: Hugging Face Llama in eager attention (grouped-query, rotary,
    its causal mask added to the scores), the hand-written attention above, Hugging Face GPT-2
    (``Conv1D``: ``addmm`` over (B·T, C)) in SDPA or eager attention,
    ``nn.TransformerEncoderLayer`` with and without a causal mask, the flat rows above, and the
    masked LMs with absolute positions: Hugging Face BERT (position ids and token types cut from
    buffers, DNABERT's shape) and ESM (positions by a cumsum over the padding, Nucleotide
    Transformer v1's shape), the FFT convolution above in HyenaDNA's spelling, in ortho norms,
    with a filter cut to T and with an unsqueezed spectrum, the attention spellings above,
    ``nn.MultiheadAttention`` returning its weights, the rotary model above that caches its
    tables on itself, and the architectures of ``HF_CORPUS``."""
    torch.manual_seed(0)
    if kind in HF_CORPUS:
        import transformers

        model_class, config_class, keywords = HF_CORPUS[kind]
        tokens = {"bos_token_id": 0, "eos_token_id": 0, "cls_token_id": 0, "sep_token_id": 0}  # within the small vocabulary
        return getattr(transformers, model_class)(getattr(transformers, config_class)(vocab_size=VOCAB, **tokens, **keywords))
    if kind.startswith("spelled"):  # "spelled": every spelling, a layer each; "spelled_<spelling>": one
        return SpelledAttentionLM(ATTENTION_SPELLINGS if kind == "spelled" else (kind.removeprefix("spelled_"),))
    if kind.startswith("fft_"):
        return FFTConvLM(kind.removeprefix("fft_"))
    if kind == "bert":
        from transformers import BertConfig, BertForMaskedLM

        cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         max_position_embeddings=2 * SEQ, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                         attn_implementation="sdpa")
        return BertForMaskedLM(cfg)
    if kind == "esm_absolute":
        from transformers import EsmConfig, EsmForMaskedLM

        cfg = EsmConfig(vocab_size=VOCAB + 2, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=2 * SEQ + 2, position_embedding_type="absolute", token_dropout=False,
                        emb_layer_norm_before=False, pad_token_id=VOCAB, mask_token_id=VOCAB + 1, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
        return EsmForMaskedLM(cfg)
    if kind == "cached_rotary":
        return CachedRotaryLM()
    if kind == "mha_weights":
        return MultiheadAttentionLM()
    if kind == "flat_rows":
        return FlatRowsLM()
    if kind.startswith("encoder"):
        return EncoderLM(causal=kind == "encoder_causal")
    if kind.startswith("gpt2"):
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ, resid_pdrop=0.0, embd_pdrop=0.0,
                         attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                         attn_implementation="eager" if kind == "gpt2_eager" else "sdpa")
        return GPT2LMHeadModel(cfg)
    if kind == "llama_eager":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=SEQ, attn_implementation="eager")
        return LlamaForCausalLM(cfg)
    assert kind == "written", kind
    return WrittenAttentionLM()


PADDED = ("bert", "esm_absolute")  # masked LMs that take an attention_mask: the last row padded


def keywords(kind: str, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """The labels, and for the padded kinds an ``attention_mask`` with the last row's last 3
    positions padded (their labels ignored; ESM's ids there are its pad token)."""
    if kind not in PADDED:
        return {"labels": labels}
    mask = torch.ones_like(ids)
    mask[-1, -3:] = 0
    return {"labels": labels.masked_fill(mask == 0, IGNORE), "attention_mask": mask}


def padded_ids(kind: str, ids: torch.Tensor) -> torch.Tensor:
    return ids.masked_fill(keywords(kind, ids, ids)["attention_mask"] == 0, VOCAB) if kind == "esm_absolute" else ids


def loss_of(net: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, kind: str = "") -> torch.Tensor:
    out = net(padded_ids(kind, ids), **keywords(kind, ids, labels))
    return out if isinstance(out, torch.Tensor) else out.loss


def batches(steps: int, group: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and labels (steps, B, T) of data group ``group``; a quarter of the labels ignored, in
    the first half of the sequence."""
    gen = torch.Generator().manual_seed(1 + group)
    ids = torch.randint(0, VOCAB, (steps, BATCH, SEQ), generator=gen)
    labels = ids.clone()
    ignored = torch.rand(ids.shape, generator=gen) < 0.25
    ignored[..., SEQ // 2:] = False
    labels[ignored] = IGNORE
    return ids, labels


def reference(kind: str, steps: int, groups: int = 1) -> dict:
    """Plain PyTorch on the whole global batch, SGD: the mean over data groups of each group's
    loss (what data parallelism averages); the losses per step, one per group."""
    net = model(kind)
    opt = torch.optim.SGD(net.parameters(), lr=SGD["params"]["lr"])
    data = [batches(steps, g) for g in range(groups)]
    losses = []
    for step in range(steps):
        group_losses = [loss_of(net, ids[step], labels[step], kind) for ids, labels in data]
        loss = torch.stack(group_losses).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append([x.item() for x in group_losses])
    return {"state": {k: v.detach().clone() for k, v in net.state_dict().items()}, "losses": losses}


def layout(case: tuple, world_size: int) -> tuple[int, str]:
    """A case's sequence-parallel size and attention strategy: (kind, stage, attention) runs one
    sequence group of all ranks, (kind, stage, size, attention) ``world_size // size`` groups."""
    return (world_size, case[2]) if len(case) == 3 else (case[2], case[3])


def train(rank: int, world_size: int, cases: list[tuple], steps: int) -> dict:
    """For each case (``layout``): ``steps`` SGD steps, every rank of a sequence group on its
    group's whole batch; the full state, the losses, the exchanges in the forward and the plan's
    decisions."""
    out = {}
    for case in cases:
        kind, stage = case[:2]
        size, attention = layout(case, world_size)
        ids, labels = batches(steps, rank // size)
        config = {"zero_optimization": {"stage": stage}, "optimizer": SGD,
                  "zerofx": {"sequence_parallel": {"size": size, "attention": attention}}}
        engine = zerofx.initialize(model(kind), config, example_inputs=(padded_ids(kind, ids[0]),),
                                   example_kwargs=keywords(kind, ids[0], labels[0]))
        losses = []
        for step in range(steps):
            loss = engine(padded_ids(kind, ids[step]), **keywords(kind, ids[step], labels[step]))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        forward = engine.graph_modules()["forward"]
        out[case] = {
            "state": engine.full_state_dict(),
            "losses": losses,
            "all_to_alls": sum(1 for n in forward.graph.nodes if is_all_to_all(n)),
            "ring_ops": sum(1 for n in forward.graph.nodes if is_ring_attention(n)),
            "decisions": engine.program.plan.decisions,
        }
        engine.close()
    return out
