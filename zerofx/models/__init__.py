"""Models bundled with zerofx: a decoder LM with attention for DNA, and the long-context
genomic models (Hyena, StripedHyena 2, Mamba and BiMamba; docs/models.md).

The sizes and the configs import without torch (``zerofx.models.sizes``,
``zerofx.models.genomic_sizes``); the model classes and ``build_model`` load their modules, and
with them torch, when first named (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import Any

from zerofx.models.genomic_sizes import HYENA_SIZES, MAMBA_SIZES, STRIPED_HYENA_SIZES, BlockKind, HyenaConfig, MambaConfig, StripedHyenaConfig
from zerofx.models.sizes import DNA_LM_SIZES, MODEL_SIZES, DNALMConfig, model_config

_LAZY = {
    "DNALMOutput": "zerofx.models.dna_lm",
    "DNADecoderLM": "zerofx.models.dna_lm",
    "HyenaDecoderLM": "zerofx.models.hyena",
    "StripedHyenaLM": "zerofx.models.striped_hyena",
    "MambaLM": "zerofx.models.mamba",
    "build_model": "zerofx.models.registry",
    "model_class": "zerofx.models.registry",
}

__all__ = [
    "DNA_LM_SIZES", "HYENA_SIZES", "MAMBA_SIZES", "MODEL_SIZES", "STRIPED_HYENA_SIZES", "BlockKind", "DNALMConfig",
    "HyenaConfig", "MambaConfig", "StripedHyenaConfig", "model_config", *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = globals()[name] = getattr(importlib.import_module(_LAZY[name]), name)
        return value
    raise AttributeError(f"module 'zerofx.models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
