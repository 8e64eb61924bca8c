"""Configs and named sizes of the long-context genomic models (Hyena, StripedHyena 2, Mamba):
torch-free, so the command line names them without loading torch. docs/models.md describes the
models and where each size comes from."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from zerofx.common.errors import ZeroFXError
from zerofx.common.vocab import DNA_VOCAB


@dataclass(frozen=True)
class HyenaConfig:
    """A HyenaDNA-style decoder: each block is an order-2 Hyena operator (three streams, a short
    depthwise conv, one implicit long filter per channel applied by FFT) and a SwiGLU MLP."""

    vocab_size: int = len(DNA_VOCAB)
    dim: int = 64
    num_layers: int = 2
    ffn_dim: int = 172
    max_seq_len: int = 1024  # positions are normalized by it, so the filter does not depend on T
    short_filter_len: int = 3
    filter_num_bands: int = 8  # positional features: t and cos/sin of this many frequencies
    filter_hidden: int = 64  # width of the filter MLP
    filter_sine_freq: float = 1.0  # initial frequency of the MLP's sine activations
    # The exponential window exp(-|delta_c| t / max_seq_len): the fastest channel decays to
    # decay_target by fast_decay_fraction of the context, the slowest by slow_decay_fraction.
    decay_target: float = 1e-2
    fast_decay_fraction: float = 0.3
    slow_decay_fraction: float = 1.5
    tie_embeddings: bool = True
    norm_eps: float = 1e-5

    @property
    def is_causal(self) -> bool:
        return True


class BlockKind(enum.Enum):
    """A StripedHyena 2 block. The letters are Evo 2's layout strings (``parse_block_pattern``)."""

    SE = "S"  # Hyena-SE: short explicit filter, direct depthwise conv
    MR = "D"  # Hyena-MR: medium explicit filter, direct depthwise conv
    LI = "H"  # Hyena-LI: long implicit filter, FFT convolution
    ATTENTION = "*"  # causal multi-head attention with rotary positions


def parse_block_pattern(letters: str) -> tuple[BlockKind, ...]:
    """Evo 2's layout string (``S`` SE, ``D`` MR, ``H`` LI, ``*`` attention) as block kinds."""
    by_letter = {k.value: k for k in BlockKind}
    bad = sorted({c for c in letters if c not in by_letter})
    if bad or not letters:
        raise ZeroFXError(f"block pattern {letters!r}: unknown letters {bad}; accepted: a non-empty string of S, D, H and *")
    return tuple(by_letter[c] for c in letters)


@dataclass(frozen=True)
class StripedHyenaConfig:
    """An Evo 2-style StripedHyena 2 decoder: one block per entry of ``block_pattern``, each a
    mixer (Hyena-SE, -MR, -LI or attention) and a SwiGLU MLP, pre-norm residual."""

    vocab_size: int = len(DNA_VOCAB)
    dim: int = 64
    block_pattern: tuple[BlockKind, ...] = parse_block_pattern("SDH*")
    num_heads: int = 4
    ffn_dim: int = 172
    max_seq_len: int = 8192
    short_filter_len: int = 3  # the featurizer conv on the three streams, in every Hyena block
    se_filter_len: int = 7
    mr_filter_len: int = 128
    li_num_modes: int = 16  # the LI filter is a sum of this many decaying exponentials per channel
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    norm_eps: float = 1e-5

    @property
    def num_layers(self) -> int:
        return len(self.block_pattern)

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def is_causal(self) -> bool:
        return True


@dataclass(frozen=True)
class MambaConfig:
    """A Mamba-1 model: each block is RMSNorm and a selective-scan mixer, residual; with
    ``bidirectional``, Caduceus' BiMamba (a second scan over the flipped sequence, projections
    shared) and a masked-LM objective."""

    vocab_size: int = len(DNA_VOCAB)
    dim: int = 64
    num_layers: int = 2
    state_dim: int = 16  # N
    expand: int = 2  # the mixer's inner width E = expand * dim
    conv_len: int = 4
    dt_rank: int = 0  # 0: ceil(dim / 16), Mamba's default
    dt_min: float = 1e-3
    dt_max: float = 1e-1
    # NOTE [Scan chunk length] in zerofx/models/scan.py: the working set is O(B E N chunk_len),
    # and the exponent range inside a chunk grows with it.
    chunk_len: int = 32
    bidirectional: bool = False
    max_seq_len: int = 1 << 20  # no positional table: only bounds --seq-len
    tie_embeddings: bool = True
    norm_eps: float = 1e-5

    @property
    def inner_dim(self) -> int:
        return self.expand * self.dim

    @property
    def delta_rank(self) -> int:
        return self.dt_rank or -(-self.dim // 16)

    @property
    def is_causal(self) -> bool:
        return not self.bidirectional


_EVO2_1B = "SDH*SDHSDH*SDHSDH*SDHSDH*"  # Evo 2 1B's 25 blocks, 4 of them attention

# Named sizes; docs/models.md lists their parameter counts (tests/test_genomic_models.py checks them).
HYENA_SIZES = {
    "hyena-tiny": HyenaConfig(dim=32, num_layers=2, ffn_dim=88, max_seq_len=1024, filter_hidden=16, filter_num_bands=4),
    # HyenaDNA's small-32k and large-1m shapes.
    "hyena-small": HyenaConfig(dim=256, num_layers=4, ffn_dim=688, max_seq_len=32768),
    "hyena-1m": HyenaConfig(dim=256, num_layers=8, ffn_dim=688, max_seq_len=1 << 20),
}
STRIPED_HYENA_SIZES = {
    "striped-tiny": StripedHyenaConfig(dim=32, block_pattern=parse_block_pattern("SDH*"), num_heads=4, ffn_dim=88,
                                       max_seq_len=1024, mr_filter_len=16, li_num_modes=4),
    "striped-small": StripedHyenaConfig(dim=256, block_pattern=parse_block_pattern("SDH*SDHSDH*"), num_heads=4, ffn_dim=688,
                                        max_seq_len=32768),
    # The genome-scale benchmark's model: Hyena-SE, -MR and -LI blocks at 1M tokens. No attention
    # block: causal attention over 1,048,576 positions is O(T^2) compute, hours on a CPU.
    "striped-1m": StripedHyenaConfig(dim=32, block_pattern=parse_block_pattern("SDHSDH"), num_heads=4, ffn_dim=88,
                                     max_seq_len=1 << 20),
    # Evo 2 1B's width, MLP and layout (1920 wide, 15 heads of 128, 5120-wide MLP), 8K context.
    "striped-1b": StripedHyenaConfig(dim=1920, block_pattern=parse_block_pattern(_EVO2_1B), num_heads=15, ffn_dim=5120,
                                     max_seq_len=8192),
}
MAMBA_SIZES = {
    "mamba-tiny": MambaConfig(dim=32, num_layers=2, state_dim=8, chunk_len=8),
    "mamba-small": MambaConfig(dim=256, num_layers=8, state_dim=16),
    "bimamba-tiny": MambaConfig(dim=32, num_layers=2, state_dim=8, chunk_len=8, bidirectional=True),
    # Caduceus' 131k shape: 16 BiMamba blocks of width 256.
    "bimamba-small": MambaConfig(dim=256, num_layers=16, state_dim=16, bidirectional=True),
}
