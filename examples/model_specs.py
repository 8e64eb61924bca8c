"""Model specs for ``zerofx plan`` / ``zerofx estimate --model``: each function takes no
arguments and returns ``(model, example_inputs)``, the model built on the meta device so that
planning allocates no parameter memory.

    zerofx plan examples/model_specs.py:dna_1b --world-size 512 --stage 3
    zerofx plan examples/model_specs.py:hf_llama_tiny --world-size 8 --stage 3
"""

from __future__ import annotations

import torch

from zerofx.models import DNA_LM_SIZES, DNADecoderLM


def _dna(size: str, seq_len: int):
    with torch.device("meta"):
        model = DNADecoderLM(DNA_LM_SIZES[size])
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    return model, ((ids,), {"labels": ids})


def dna_small():
    return _dna("small", 512)


def dna_25m():
    return _dna("25m", 512)


def dna_1b():
    return _dna("1b", 2048)


def hf_llama_tiny():
    """Hugging Face's Llama from a small config with random weights (nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.zeros(1, 256, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def decoder_20b():
    """A 20B-parameter decoder (44 layers, d6144): the planner's scale test, built on meta."""
    from zerofx.models.dna_lm import DNALMConfig

    with torch.device("meta"):
        model = DNADecoderLM(DNALMConfig(dim=6144, num_layers=44, num_heads=48, ffn_dim=16384, max_seq_len=2048))
    ids = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    return model, ((ids,), {"labels": ids})
