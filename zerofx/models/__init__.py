"""Models bundled with zerofx: a decoder LM for DNA.

The sizes and the config import without torch (``zerofx.models.sizes``); the model classes load
``zerofx.models.dna_lm``, and with it torch, when first named (PEP 562).
"""

from __future__ import annotations

from typing import Any

from zerofx.models.sizes import DNA_LM_SIZES, DNALMConfig

__all__ = ["DNA_LM_SIZES", "DNALMConfig", "DNALMOutput", "DNADecoderLM"]

_FROM_DNA_LM = ("DNALMOutput", "DNADecoderLM")


def __getattr__(name: str) -> Any:
    if name in _FROM_DNA_LM:
        from zerofx.models import dna_lm

        value = globals()[name] = getattr(dna_lm, name)
        return value
    raise AttributeError(f"module 'zerofx.models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
