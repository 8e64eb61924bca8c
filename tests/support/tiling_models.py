"""Small models for the tiling tests, built the same way in the test process and in every rank."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerofx.models import DNADecoderLM, DNALMConfig

# Sequence 40 (and batch x sequence, 80) is no other dimension of these models; 40 is
# chunks of 16, 16 and 8, so the uneven last chunk is exercised.
SEQ, BATCH = 40, 2
DNA = DNALMConfig(dim=32, num_layers=2, num_heads=4, ffn_dim=88, max_seq_len=64)


def dna_lm(seed: int = 0) -> DNADecoderLM:
    torch.manual_seed(seed)
    return DNADecoderLM(DNA)


def tokens(vocab: int = 5, seed: int = 1, seq: int = SEQ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (BATCH, seq), generator=g)


class SoftmaxAttentionLM(nn.Module):
    """Attention written out as ``softmax(q kᵀ / sqrt(d) + mask) v`` with a padding mask, a GELU
    MLP and a LayerNorm: the pattern real model code writes by hand."""

    def __init__(self, vocab: int = 7, dim: int = 24, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.norm = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, t = input_ids.shape
        x = self.embed(input_ids)  # (B, T, d)
        mask = (1.0 - attention_mask[:, None, None, :].float()) * -1e9  # (B, 1, 1, T), additive
        for qkv, proj, norm, mlp in zip(self.qkv, self.proj, self.norm, self.mlp):
            q, k, v = qkv(norm(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # 3 x (B, nh, T, hs)
            scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask  # (B, nh, T, T)
            y = torch.softmax(scores, dim=-1) @ v  # (B, nh, T, hs)
            x = x + proj(y.transpose(1, 2).reshape(b, t, -1))
            x = x + mlp(norm(x))
        logits = self.head(x)  # (B, T, V)
        labels = labels.masked_fill(attention_mask == 0, -100)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def softmax_lm(seed: int = 0) -> SoftmaxAttentionLM:
    torch.manual_seed(seed)
    return SoftmaxAttentionLM()


def padding_mask(seed: int = 2) -> torch.Tensor:
    """(B, T) with 1 for real tokens: the second sequence is padded after 30 tokens."""
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 30:] = 0
    return mask


def llama(seed: int = 0, kv_heads: int = 4):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=16, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=kv_heads, max_position_embeddings=256, attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)
