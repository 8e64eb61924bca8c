"""The DNA LM's config, and every bundled model's named size (``MODEL_SIZES``): torch-free, so
the command line names the sizes (``zerofx --help``, argument checks) without loading torch.
``zerofx.models.registry`` builds a model from a size name."""

from __future__ import annotations

from dataclasses import dataclass

from zerofx.common.errors import UsageError, did_you_mean
from zerofx.common.vocab import DNA_VOCAB
from zerofx.models.genomic_sizes import HYENA_SIZES, MAMBA_SIZES, STRIPED_HYENA_SIZES, HyenaConfig, MambaConfig, StripedHyenaConfig

@dataclass(frozen=True)
class DNALMConfig:
    vocab_size: int = len(DNA_VOCAB)
    dim: int = 64
    num_layers: int = 2
    num_heads: int = 4
    ffn_dim: int = 172  # ~ 8/3 * dim, SwiGLU's usual width
    max_seq_len: int = 1024
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def is_causal(self) -> bool:
        return True


# Named sizes for the CLI and benchmarks; the parameter counts are approximate.
DNA_LM_SIZES = {
    "tiny": DNALMConfig(dim=32, num_layers=2, num_heads=4, ffn_dim=88, max_seq_len=512),
    "small": DNALMConfig(dim=128, num_layers=4, num_heads=4, ffn_dim=344, max_seq_len=1024),
    "25m": DNALMConfig(dim=512, num_layers=8, num_heads=8, ffn_dim=1376, max_seq_len=4096),
    "100m": DNALMConfig(dim=768, num_layers=14, num_heads=12, ffn_dim=2048, max_seq_len=8192),
    "150m": DNALMConfig(dim=1024, num_layers=12, num_heads=16, ffn_dim=2816, max_seq_len=8192),
    "1b": DNALMConfig(dim=2048, num_layers=20, num_heads=16, ffn_dim=5504, max_seq_len=32768),
    "7b": DNALMConfig(dim=4096, num_layers=32, num_heads=32, ffn_dim=11008, max_seq_len=131072),
    # Few layers with a 16x-wide MLP: each MLP weight is 64 MiB in fp32, what weight tiling is for.
    "wide": DNALMConfig(dim=1024, num_layers=2, num_heads=16, ffn_dim=16384, max_seq_len=4096),
}


ModelConfig = DNALMConfig | HyenaConfig | StripedHyenaConfig | MambaConfig

# Every bundled size, the names ``zerofx train --model`` and ``zerofx plan`` accept.
MODEL_SIZES: dict[str, ModelConfig] = {**DNA_LM_SIZES, **HYENA_SIZES, **STRIPED_HYENA_SIZES, **MAMBA_SIZES}


def model_config(name: str) -> ModelConfig:
    """The config of a bundled size name; ``UsageError`` naming the accepted sizes otherwise."""
    if name not in MODEL_SIZES:
        raise UsageError(
            f"unknown model size {name!r}{did_you_mean(name, MODEL_SIZES)}; accepted: {', '.join(MODEL_SIZES)}"
        )
    return MODEL_SIZES[name]
