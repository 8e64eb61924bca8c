"""Model specs for the tests of ``zerofx train --model`` (tests/test_own_data.py): tiny Hugging
Face models from local configs, random weights, nothing downloaded."""

from __future__ import annotations

import torch

from zerofx.data.tokenizers import MASK_ID, PAD_ID, KmerTokenizer


def build_esm():
    """ESM with a masked-LM head over the Nucleotide Transformer's 1-mer vocabulary (15 ids):
    hidden 32, 2 layers, 2 heads, built on the meta device."""
    from transformers import EsmConfig, EsmForMaskedLM

    cfg = EsmConfig(vocab_size=KmerTokenizer(1).vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                    intermediate_size=64, max_position_embeddings=1026, position_embedding_type="rotary",
                    pad_token_id=PAD_ID, mask_token_id=MASK_ID, token_dropout=False,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with torch.device("meta"):
        model = EsmForMaskedLM(cfg)
    ids = torch.zeros(1, 64, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}


def build_esm_too_small():
    """The same ESM with 10 embedding rows: too few for the 15 ids of the 1-mer vocabulary."""
    from transformers import EsmConfig, EsmForMaskedLM

    cfg = EsmConfig(vocab_size=10, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                    position_embedding_type="rotary", pad_token_id=PAD_ID, mask_token_id=MASK_ID)
    with torch.device("meta"):
        model = EsmForMaskedLM(cfg)
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids}
