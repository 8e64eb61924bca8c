"""Models built on the meta device: ``zerofx.initialize`` computes each rank's shards from a
per-module seeded init (NOTE [The init scheme] in ``zerofx.compiler.materialize``), with the same values
as the materialized model passed through ``init_weights_``, at any world size, and without ever
holding the full model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from tests.support.dist_utils import run_ranks
from tests.support.meta_workers import init_peak_rss, initialize_error, meta_vs_materialized
from zerofx.common.errors import ZeroFXError
from zerofx.compiler.materialize import init_weights_, iter_initial_state
from zerofx.models import DNA_LM_SIZES, DNADecoderLM

TINY = DNA_LM_SIZES["tiny"]


def _meta_tiny() -> DNADecoderLM:
    with torch.device("meta"):
        return DNADecoderLM(TINY)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_scheme_gives_the_same_values_on_meta_and_materialized_models() -> None:
    meta = {t.fqn: t.value for t in iter_initial_state(_meta_tiny(), seed=3)}
    torch.manual_seed(12345)  # the global RNG does not matter: each module has its own seed
    model = init_weights_(DNADecoderLM(TINY), seed=3)
    expected = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert _equal(meta, {k: v.detach() for k, v in expected.items()})
    # The tied head is the embedding, initialized once (by embed, the first module holding it).
    assert "head.weight" not in meta and model.head.weight is model.embed.weight
    # The scheme is the model's: N(0, 0.02), residual projections scaled by 1/sqrt(2L), RMSNorm
    # ones, and the rotary tables recomputed (they are lost on the meta device).
    assert meta["blocks.0.attn_norm.weight"].eq(1).all()
    assert meta["embed.weight"].std().item() == pytest.approx(0.02, rel=0.3)
    assert meta["blocks.0.mlp.down.weight"].std().item() == pytest.approx(0.02 / math.sqrt(2 * TINY.num_layers), rel=0.2)
    fresh = DNADecoderLM(TINY)
    assert torch.equal(meta["rope_cos"], fresh.rope_cos) and torch.equal(meta["rope_sin"], fresh.rope_sin)


def test_seed_changes_values_and_modules_are_independent() -> None:
    a = {t.fqn: t.value for t in iter_initial_state(_meta_tiny(), seed=0)}
    b = {t.fqn: t.value for t in iter_initial_state(_meta_tiny(), seed=1)}
    assert not torch.equal(a["embed.weight"], b["embed.weight"])
    # Same shape, same init, different modules: different values (each module has its own seed).
    assert not torch.equal(a["blocks.0.mlp.gate.weight"], a["blocks.0.mlp.up.weight"])


class _NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))


class _ForgetsBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.arange(4.0), persistent=False)

    def reset_parameters(self) -> None:
        pass  # the buffer computed in __init__ is not recomputed


def test_clear_errors_for_modules_that_cannot_be_initialized() -> None:
    with torch.device("meta"):
        no_init, forgets = nn.Sequential(nn.Linear(2, 2), _NoInit()), _ForgetsBuffer()
    with pytest.raises(ZeroFXError, match=r"cannot initialize 1 \(_NoInit\).*init_fn="):
        list(iter_initial_state(no_init))
    with pytest.raises(ZeroFXError, match=r"buffer 'table' of the root module .*not \(fully\) set"):
        list(iter_initial_state(forgets))
    # An init_fn fixes both.
    def init_fn(m: nn.Module) -> None:
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            nn.init.constant_(t, 0.5)

    values = {t.fqn: t.value for t in iter_initial_state(forgets, init_fn=init_fn)}
    assert values["table"].eq(0.5).all() and values["lin.weight"].eq(0.5).all()
    with torch.device("meta"):
        mixed = nn.Linear(2, 2)
    mixed.bias = nn.Parameter(torch.zeros(2))
    with pytest.raises(ZeroFXError, match="mixes meta and materialized"):
        init_weights_(mixed)


@pytest.mark.parametrize("world_size", [1, 2])
def test_meta_built_engine_equals_materialized_engine(world_size: int) -> None:
    ranks = run_ranks(world_size, meta_vs_materialized, "tiny", [1, 3], 7)
    reference = {k: v for k, v in init_weights_(DNADecoderLM(TINY), seed=7).state_dict().items()}
    for r, res in enumerate(ranks):
        for stage, s in res.items():
            assert s["model_still_meta"], stage
            # Identical to the materialized model under the same scheme, at this world size...
            assert _equal(s["init"]["meta"], reference), (r, stage)
            assert _equal(s["init"]["materialized"], reference), (r, stage)
            assert _equal(s["shards"]["meta"], s["shards"]["materialized"]), (r, stage)
            assert _equal(s["buffers"]["meta"], s["buffers"]["materialized"]), (r, stage)
            # ...and trains the same, bit for bit.
            assert s["loss"]["meta"] == s["loss"]["materialized"]
            assert _equal(s["trained"]["meta"], s["trained"]["materialized"]), (r, stage)
            assert not _equal(s["trained"]["meta"], reference)
        # Stage 3 holds only its shards.
        s3 = res["stage3"]
        assert s3["memory"]["params"] == s3["shard_param_bytes"]
        assert s3["memory"]["params"] * world_size < 4 * sum(v.numel() for k, v in reference.items() if "rope" not in k) + 64 * world_size


def test_meta_init_with_bf16_keeps_fp32_masters_of_the_same_values() -> None:
    (r0, r1) = run_ranks(2, meta_vs_materialized, "tiny", [3], 2, {"bf16": {"enabled": True}})
    for res in (r0, r1):
        s = res["stage3"]
        assert _equal(s["init"]["meta"], s["init"]["materialized"])
        assert _equal(s["trained"]["meta"], s["trained"]["materialized"])
        assert next(iter(s["init"]["meta"].values())).dtype == torch.bfloat16


def test_initialize_rejects_init_arguments_for_a_materialized_model() -> None:
    (msg,) = run_ranks(1, initialize_error, "tiny", {"init_seed": 4})
    assert "init_seed= apply to a model built on the meta device" in msg


def test_meta_built_100m_model_never_holds_the_full_model_at_stage_3() -> None:
    """Peak RSS added by building the 99M-parameter DNA LM and initializing stage 3 at W=2.
    The engine keeps its parameter shards (half the fp32 model at W=2 under SGD; the gradient
    shards come with the first backward); beyond that, meta init adds one module at a time. The materialized build
    adds the full model on every rank (freed once sharded, but the peak keeps it): the same
    bound fails for it, which shows the measurement can tell the two apart."""
    meta = run_ranks(2, init_peak_rss, "100m", True, fresh=True)  # a process's own peak
    materialized = run_ranks(2, init_peak_rss, "100m", False, fresh=True)
    for m, full in zip(meta, materialized):
        assert m["num_params"] > 99e6 and m["held_bytes"] == full["held_bytes"]
        # NOTE [Gradient buffers come with the first backward]: nothing but the shards yet.
        assert m["grad_bytes"] == 0 and m["held_bytes"] == m["param_bytes"] > 0.45 * m["full_fp32_bytes"]
        extra_meta = m["added_bytes"] - m["held_bytes"]
        extra_full = full["added_bytes"] - full["held_bytes"]
        assert extra_meta < 0.25 * m["full_fp32_bytes"], (extra_meta, m)
        assert extra_full > 0.4 * m["full_fp32_bytes"], (extra_full, full)
