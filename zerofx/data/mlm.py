"""Masked language modelling: BERT's masking of a batch of token ids, reproducible from a seed.

    masking = MlmMasking(mask_id=tok.mask_id, random_ids=tok.sequence_ids)
    inputs, labels = mask_tokens(batch, masking, seed=mask_seed(run_seed, rank, batch_index))

NOTE [Masking is a function of the seed, the rank and the batch]
Each eligible position is chosen with probability ``mask_fraction`` (15%, BERT's and the
Nucleotide Transformer's). A chosen position becomes ``<mask>`` with probability 0.8, a random
token with probability 0.1, and stays as it is otherwise (BERT's 80/10/10). Its label is the
original token; every other label is -100, the ``ignore_index`` of ``torch.nn.CrossEntropyLoss``
and the Hugging Face convention, so the loss counts the chosen positions only.

- Eligible: every position except the special tokens (``<unk>``, ``<pad>``, ``<mask>``,
  ``<cls>``, ``<eos>``, ``<bos>``), as Hugging Face's ``DataCollatorForLanguageModeling``
  excludes them. The random token is drawn uniformly from the tokenizer's sequence tokens
  (k-mers, single nucleotides, N), never a special one.
- At least one position is chosen per batch: a batch with none would make the loss 0/0 = NaN,
  and one NaN step ruins the weights. With 15% of 2 x 128 tokens this almost never happens
  (0.85**256 ~ 1e-18); with two tokens a batch it is one batch in two. The forced position is
  drawn from the same generator, among the eligible ones, or among all when none is eligible.
- The draws come from a ``torch.Generator`` seeded with ``mask_seed(seed, rank, index)``, a
  hash of the run's seed, the rank and the batch's index in that rank's stream. A batch is
  masked the same way whenever it is drawn: a run resumed from a checkpoint, which skips the
  batches already trained on, masks the rest exactly as the uninterrupted run did.
- Training windows drawn from a prepared genome are numbered across the whole run (sample j is
  the same window whichever rank draws it, at any world size), and each is masked by itself
  with ``sample_mask_seed(seed, j)`` (``mask_samples``), so a run resumed at another world size
  masks each window as the uninterrupted run did too. The at-least-one rule then holds per
  window.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from zerofx.data.tokenizers import SPECIAL_TOKENS
from zerofx.common.errors import ZeroFXError

IGNORE_INDEX = -100  # torch.nn.CrossEntropyLoss's default ignore_index; Hugging Face's label convention


@dataclass(frozen=True)
class MlmMasking:
    """What ``mask_tokens`` does: the fractions, and the ids it writes."""

    mask_id: int
    random_ids: range  # the ids a random replacement is drawn from
    mask_fraction: float = 0.15
    mask_token_fraction: float = 0.8  # of the chosen positions: <mask>
    random_token_fraction: float = 0.1  # of the chosen positions: a random token; the rest stay as they are
    num_special: int = len(SPECIAL_TOKENS)  # ids below this are special: never chosen

    def __post_init__(self) -> None:
        if not 0 < self.mask_fraction <= 1:
            raise ZeroFXError(f"mask_fraction={self.mask_fraction!r} is invalid; accepted: a number in (0, 1]")
        if not (0 <= self.mask_token_fraction and 0 <= self.random_token_fraction
                and self.mask_token_fraction + self.random_token_fraction <= 1):
            raise ZeroFXError(
                f"mask_token_fraction={self.mask_token_fraction!r} and random_token_fraction={self.random_token_fraction!r} "
                "are invalid; accepted: numbers >= 0 whose sum is at most 1"
            )
        if len(self.random_ids) == 0:
            raise ZeroFXError("random_ids is empty; accepted: a non-empty range of token ids")


def mask_seed(seed: int, rank: int, index: int, *, split: str = "train") -> int:
    """The generator seed of one batch: a 63-bit hash of the run's seed, the rank, the batch's
    index in the rank's stream and the stream's name (``split``: training and evaluation draw
    apart) (NOTE [Masking is a function of the seed, the rank and the batch])."""
    digest = hashlib.sha256(f"zerofx-mlm:{seed}:{rank}:{split}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def sample_mask_seed(seed: int, sample: int, *, split: str = "train") -> int:
    """The generator seed of one window, by its index among the run's samples (NOTE [Masking is
    a function of the seed, the rank and the batch])."""
    return mask_seed(seed, -1, sample, split=split)


def mask_samples(tokens: torch.Tensor, masking: MlmMasking, *, seed: int, first_sample: int,
                 split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """``mask_tokens`` for a batch ``(B, T)`` of consecutive samples from ``first_sample`` on,
    each row masked by its own sample's seed."""
    rows = [mask_tokens(row, masking, seed=sample_mask_seed(seed, first_sample + i, split=split)) for i, row in enumerate(tokens)]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


def mask_tokens(tokens: torch.Tensor, masking: MlmMasking, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, labels)`` for a batch of token ids (any shape, integer dtype): inputs with the
    chosen positions replaced, labels holding the original ids there and -100 elsewhere. The
    same ``seed`` gives the same result. ``tokens`` is not modified."""
    if tokens.numel() == 0:
        raise ZeroFXError("cannot mask an empty batch")
    gen = torch.Generator().manual_seed(seed)
    flat = tokens.reshape(-1).long()  # (N,)
    eligible = flat >= masking.num_special
    chosen = (torch.rand(flat.shape, generator=gen) < masking.mask_fraction) & eligible
    if not bool(chosen.any()):  # NOTE [Masking is a function of the seed, the rank and the batch]: at least one
        candidates = eligible.nonzero().flatten() if bool(eligible.any()) else torch.arange(flat.numel())
        chosen[candidates[torch.randint(len(candidates), (1,), generator=gen)]] = True
    action = torch.rand(flat.shape, generator=gen)  # < 0.8: <mask>; < 0.9: random; else unchanged
    random_tokens = torch.randint(masking.random_ids.start, masking.random_ids.stop, flat.shape, generator=gen)
    to_mask = chosen & (action < masking.mask_token_fraction)
    to_random = chosen & (action >= masking.mask_token_fraction) & (action < masking.mask_token_fraction + masking.random_token_fraction)
    inputs = torch.where(to_mask, masking.mask_id, torch.where(to_random, random_tokens, flat))
    labels = torch.where(chosen, flat, IGNORE_INDEX)
    return inputs.reshape(tokens.shape), labels.reshape(tokens.shape)
