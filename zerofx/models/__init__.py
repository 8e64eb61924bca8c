"""Models bundled with zerofx: a decoder LM for DNA."""

from zerofx.models.dna_lm import DNA_LM_SIZES, DNALMConfig, DNALMOutput, DNADecoderLM

__all__ = ["DNA_LM_SIZES", "DNALMConfig", "DNALMOutput", "DNADecoderLM"]
