"""Rank functions for tests/test_autoplan.py: ``"zerofx": {"auto": true}`` at initialize."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import torch

import zerofx
from zerofx.common.rss import peak_rss_bytes, reset_peak_rss_bytes
from zerofx.models.registry import build_model


def auto_initialize(rank: int, world_size: int, config: dict[str, Any], size: str = "tiny", seq_len: int = 64) -> dict[str, Any]:
    """Initialize the DNA LM of ``size`` with ``config`` (``zerofx.auto`` on), take two steps, and
    return what was printed, the stage and offload applied, the losses, and how far this
    process's resident high-water mark rose over it all (VmHWM reset first)."""
    torch.manual_seed(0)
    model = build_model(size)
    ids = torch.randint(0, 5, (1, seq_len), generator=torch.Generator().manual_seed(rank))
    before = reset_peak_rss_bytes()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        engine = zerofx.initialize(model, config, example_inputs=(ids,), example_kwargs={"labels": ids})
    losses = []
    for _ in range(2):
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return {"printed": printed.getvalue(), "stage": int(engine.stage), "offload": engine.cfg.offload is not None,
            "auto": engine.cfg.auto is not None, "raw": dict(engine.cfg.raw), "losses": losses,
            "peak_growth_bytes": peak_rss_bytes() - before}


class MeanLM(torch.nn.Module):
    """A token LM with a mean over the sequence: no sequence mixer shards it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 16)
        self.head = torch.nn.Linear(16, 8)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)  # (B, T, 16)
        x = x - x.mean(dim=1, keepdim=True)  # reads every position
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())
