"""From a size name to a model: each config type's model class, and ``build_model``, which the
command line and the training app both build the bundled models with."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from zerofx.models.dna_lm import DNADecoderLM
from zerofx.models.genomic_sizes import HyenaConfig, MambaConfig, StripedHyenaConfig
from zerofx.models.hyena import HyenaDecoderLM
from zerofx.models.mamba import MambaLM
from zerofx.models.sizes import DNALMConfig, ModelConfig, model_config
from zerofx.models.striped_hyena import StripedHyenaLM

MODEL_CLASSES: dict[type, type[nn.Module]] = {
    DNALMConfig: DNADecoderLM,
    HyenaConfig: HyenaDecoderLM,
    StripedHyenaConfig: StripedHyenaLM,
    MambaConfig: MambaLM,
}


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    """The class a bundled config builds."""
    return MODEL_CLASSES[type(cfg)]


def build_model(name: str, *, vocab_size: int | None = None, device: torch.device | str | None = None) -> nn.Module:
    """The bundled model of size ``name`` (``UsageError`` naming the sizes for another name), with
    ``vocab_size`` rows in its embedding when given, built on ``device`` (``"meta"``: shapes
    only, for planning or for ``zerofx.initialize`` to materialize), else the default device."""
    cfg = model_config(name)
    if vocab_size is not None:
        cfg = replace(cfg, vocab_size=vocab_size)
    if device is None:
        return model_class(cfg)(cfg)
    with torch.device(device):
        return model_class(cfg)(cfg)
