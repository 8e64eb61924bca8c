"""Model specs for ``zerofx train --model`` (and ``zerofx plan``): Hugging Face models built from
local configs with random weights, nothing downloaded. Each function takes no arguments and
returns ``(model, example_inputs)``; the model is built on the meta device, and ``zerofx train``
initializes it on each rank from ``--seed`` (the model's own ``_init_weights``).

    zerofx train --model examples/own_models.py:esm_mlm --objective mlm --kmer 6 --seq-len 64
    zerofx train --model examples/own_models.py:llama_clm --kmer 6 --seq-len 64

Both vocabularies are the Nucleotide Transformer's 6-mer one, 4,107 ids (``KmerTokenizer(6)``),
so they take ``--kmer`` 1 to 6 and the bundled 5-token vocabulary alike: the embedding needs at
least as many rows as the run's vocabulary has ids (docs/training.md).
"""

from __future__ import annotations

import torch

from zerofx.data.tokenizers import MASK_ID, PAD_ID, KmerTokenizer

NT_6MER_VOCAB_SIZE = KmerTokenizer(6).vocab_size  # 4107


def esm_mlm():
    """A small ESM encoder with a masked-LM head, shaped like the Nucleotide Transformer v2
    (rotary positions, no token dropout) but 2 layers of width 64."""
    from transformers import EsmConfig, EsmForMaskedLM

    cfg = EsmConfig(vocab_size=NT_6MER_VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=256, max_position_embeddings=2050, position_embedding_type="rotary",
                    pad_token_id=PAD_ID, mask_token_id=MASK_ID, token_dropout=False,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with torch.device("meta"):
        model = EsmForMaskedLM(cfg)
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def llama_clm():
    """A small Llama decoder for next-token prediction (Hugging Face shifts the labels)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=NT_6MER_VOCAB_SIZE, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.zeros(2, 64, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}
