"""The decoder shell the bundled genomic models share: embedding, a stack of blocks, a final
RMSNorm, a head tied to the embedding when the config says so, the init and the loss. Each
model supplies its blocks and runs them in its own ``forward``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn as nn

from zerofx.common.errors import ZeroFXError
from zerofx.models.dna_lm import DNALMOutput, RMSNorm
from zerofx.models.long_conv import init_genomic_module, lm_loss


class GenomicDecoder(nn.Module):
    """``cfg`` needs ``vocab_size``, ``dim``, ``num_layers``, ``norm_eps``, ``tie_embeddings``,
    ``max_seq_len`` and ``is_causal``. ``make_blocks`` is called between the embedding and the
    norm, so modules are created, and the global RNG drawn, in the order embed, blocks, norm,
    head, and ``reset_parameters`` then initializes them in that order."""

    def __init__(self, cfg: Any, make_blocks: Callable[[], Iterable[nn.Module]]) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(make_blocks())
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialize every parameter from the global RNG, module by module."""
        for m in self.modules():
            self._init_weights(m)

    def _init_weights(self, module: nn.Module) -> None:
        """Initialize ``module``'s own tensors (``init_genomic_module``); ``zerofx.initialize``
        calls it one module at a time on a model built on the meta device."""
        init_genomic_module(module, self.cfg.num_layers)

    def check_length(self, input_ids: torch.Tensor) -> int:
        """The sequence length; ``ZeroFXError`` beyond ``max_seq_len``."""
        t = input_ids.shape[1]
        if t > self.cfg.max_seq_len:
            raise ZeroFXError(f"sequence length {t} exceeds max_seq_len={self.cfg.max_seq_len}")
        return t

    def output(self, x: torch.Tensor, labels: torch.Tensor | None) -> DNALMOutput:
        """Logits of the blocks' output ``x`` (B, T, d), and the loss when ``labels`` are given."""
        logits = self.head(self.norm(x))  # (B, T, V)
        loss = None if labels is None else lm_loss(logits, labels, causal=self.cfg.is_causal)
        return DNALMOutput(loss=loss, logits=logits)
