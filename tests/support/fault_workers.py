"""Rank functions for the engine's fault tests: divergent inputs and configs, a stalled peer, and
calls out of order. Each catches the error it expects and returns what it saw, so one process
group checks several cases."""

from __future__ import annotations

import time
from typing import Any

import torch

import zerofx
from tests.support.models import TINY, batches, dna_lm
from zerofx.models import DNADecoderLM

SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _config(**zero: Any) -> dict:
    return {"zero_optimization": {"stage": 3}, **SGD, **zero}


def _outcome(fn: Any) -> dict:
    start = time.perf_counter()
    try:
        fn()
    except zerofx.ZeroFXError as exc:
        return {"error": type(exc).__name__, "message": str(exc), "elapsed_s": time.perf_counter() - start}
    return {"error": None, "elapsed_s": time.perf_counter() - start}


def _train_step(engine: zerofx.Engine, ids: torch.Tensor) -> float:
    loss = engine(ids, labels=ids)
    engine.backward(loss)
    engine.step()
    return loss.item()


def divergence_cases(rank: int, world_size: int) -> dict:
    """Per case, what this rank raised: inputs of other shapes on one rank, then configs (and a
    model) that differ between ranks."""
    data = batches(world_size, 3)
    ids = data[0, rank]
    out: dict[str, Any] = {}

    engine = zerofx.initialize(dna_lm(frozen=False), _config(), example_inputs=(ids,), example_kwargs={"labels": ids})
    _train_step(engine, ids)
    # An uneven last batch on rank 1 only: a shorter sequence while rank 0 reuses its program.
    mine = data[1, rank] if rank == 0 else data[1, rank][:, :9]
    out["uneven"] = _outcome(lambda: _train_step(engine, mine))
    # Every rank moving to the new shape together is fine; and the cache stays bounded.
    out["together"] = _outcome(lambda: _train_step(engine, data[2, rank][:, :9]))

    cached = zerofx.initialize(dna_lm(frozen=False), {**_config(), "zerofx": {"program_cache_size": 2}},
                               example_inputs=(ids,), example_kwargs={"labels": ids})
    for length in (16, 12, 8, 12):
        _train_step(cached, data[0, rank][:, :length])
    out["cache_size"] = len(cached._programs)

    clip = {"gradient_clipping": 1.0} if rank == 0 else {}
    out["clipping"] = _outcome(lambda: zerofx.initialize(dna_lm(frozen=False), {**_config(), **clip}, example_inputs=(ids,),
                                                         example_kwargs={"labels": ids}))
    lr = {"optimizer": {"type": "SGD", "params": {"lr": 1e-3 if rank == 0 else 1.0}}}
    out["lr"] = _outcome(lambda: zerofx.initialize(dna_lm(frozen=False), {**_config(), **lr}, example_inputs=(ids,),
                                                   example_kwargs={"labels": ids}))
    accumulate = {"gradient_accumulation_steps": 1 + rank}
    out["accumulation"] = _outcome(lambda: zerofx.initialize(dna_lm(frozen=False), {**_config(), **accumulate},
                                                             example_inputs=(ids,), example_kwargs={"labels": ids}))
    # Same parameter shapes, another number of heads (its rotary buffers differ).
    torch.manual_seed(0)
    heads = DNADecoderLM(TINY if rank == 0 else TINY.__class__(**{**TINY.__dict__, "num_heads": 5}))
    out["heads"] = _outcome(lambda: zerofx.initialize(heads, _config(), example_inputs=(ids,), example_kwargs={"labels": ids}))
    # Same model and config, another computation (a loss scaled on one rank): only the graphs differ.
    scale = 1.0 + rank
    out["graphs"] = _outcome(lambda: zerofx.initialize(dna_lm(frozen=False), _config(), example_inputs=(ids,), example_kwargs={"labels": ids},
                                                       loss_fn=lambda output, labels=None: output.loss * scale))
    # Still in step after all the refused starts: a plain step works.
    out["after"] = _outcome(lambda: _train_step(engine, data[2, rank][:, :9]))
    return out


def stalled_peer(rank: int, world_size: int, timeout_s: float, stall_s: float) -> dict:
    """Rank 1 stops answering (a sleep after its forward, as a SIGSTOP, a slow disk or a stuck
    data loader would); rank 0 must fail within about the collective timeout, naming the
    backward graph's collective it waited in."""
    ids = batches(world_size, 1)[0, rank]
    engine = zerofx.initialize(dna_lm(frozen=False), {**_config(), "zerofx": {"collective_timeout_s": timeout_s}},
                               example_inputs=(ids,), example_kwargs={"labels": ids})
    _train_step(engine, ids)
    loss = engine(ids, labels=ids)
    if rank == 1:  # stalls between its forward and backward
        time.sleep(stall_s)
        return {"stalled": True}
    return _outcome(lambda: engine.backward(loss))


def call_order(rank: int, world_size: int) -> dict:
    """What each out-of-order call raises, and that the engine still trains after each."""
    ids = batches(world_size, 1)[0, rank]
    engine = zerofx.initialize(dna_lm(frozen=False), _config(), example_inputs=(ids,), example_kwargs={"labels": ids})
    before = engine.full_state_dict()
    out: dict[str, Any] = {"step_first": _outcome(engine.step)}
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items())
    out["global_steps"] = engine.global_steps

    def forward_step_backward() -> None:
        loss = engine(ids, labels=ids)
        engine.step()  # no backward yet
        engine.backward(loss)

    out["forward_step"] = _outcome(forward_step_backward)

    def backward_twice() -> None:
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        loss2 = engine(ids, labels=ids)
        engine.backward(loss2)

    out["backward_twice"] = _outcome(backward_twice)
    out["recovers"] = _outcome(lambda: (engine.step(), _train_step(engine, ids)))
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    x = torch.zeros(2, 4)
    out["no_params"] = _outcome(lambda: zerofx.initialize(torch.nn.ReLU(), _config(), example_inputs=(x,), loss_fn=lambda y: y.sum()))
    out["all_frozen"] = _outcome(lambda: zerofx.initialize(frozen, _config(), example_inputs=(x,), loss_fn=lambda y: y.sum()))
    return out


def gloo_ops_of_a_step(rank: int, world_size: int, stage: int) -> list[str]:
    """The c10d ops a whole training step issues (initialize and the first step excluded), with
    overlap, prefetch and gradient clipping on: NOTE [gloo's completion race]."""
    from torch.profiler import profile

    ids = batches(world_size, 1)[0, rank]
    config = {"zero_optimization": {"stage": stage, "overlap_comm": True}, **SGD, "gradient_clipping": 1.0,
              "zerofx": {"prefetch_distance": 1}}
    engine = zerofx.initialize(dna_lm(frozen=False), config, example_inputs=(ids,), example_kwargs={"labels": ids})
    _train_step(engine, ids)
    with profile() as prof:
        _train_step(engine, ids)
    return sorted({e.name for e in prof.events() if e.name.startswith("c10d::")})


class SqrtModel(torch.nn.Module):
    """``mean(sqrt(w x) + (v x)^2)`` over x (B, 4): where x is 0, sqrt's gradient is infinite and
    w's gradient there NaN (inf · 0) while the loss stays finite; a NaN in x makes the loss NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4))
        self.v = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.sqrt(self.w * x) + (self.v * x) ** 2).mean()


def nonfinite_steps(rank: int, world_size: int, stage: int, policy: str | None, inject: str) -> dict:
    """Three steps of ``SqrtModel`` with SGD, all ranks on x = 1 but rank 1 at step 3: a zero in
    its last column (``inject="grad"``: w's last gradient element NaN, the loss finite) or a NaN
    (``"loss"``); ``policy``: ``zerofx.nonfinite`` (None: left out). Then one more clean step.
    What step 3 raised, the state before and after it, the skipped steps and the final state."""
    config = _config(zero_optimization={"stage": stage})
    if policy is not None:
        config["zerofx"] = {"nonfinite": policy}
    torch.manual_seed(0)
    engine = zerofx.initialize(SqrtModel(), config, example_inputs=(torch.ones(2, 4),))
    clean = torch.ones(2, 4)

    def step(x: torch.Tensor) -> None:
        engine.backward(engine(x))
        engine.step()

    step(clean)
    step(clean)
    before = engine.full_state_dict()
    bad = clean.clone()
    if rank == 1:
        bad[:, 3] = 0.0 if inject == "grad" else float("nan")
    out = _outcome(lambda: step(bad))
    out["before"], out["after"] = before, engine.full_state_dict()
    step(clean)
    out["final"], out["skipped"], out["global_steps"] = engine.full_state_dict(), engine.skipped_steps, engine.global_steps
    engine.close()
    return out
