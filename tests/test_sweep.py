"""``zerofx plan --sweep`` and the planner's use of the hardware profile: the shard group size
chosen under ``"auto"``, buckets sized for the profile's links, and the weak-scaling table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zerofx
from zerofx.app.cli import main
from zerofx.cost_models.comm import H100_NVLINK_IB, efficient_bucket_bytes
from zerofx.cost_models.hierarchy import model_state_bytes
from zerofx.cost_models.profiles import load_profile
from zerofx.models import DNA_LM_SIZES, DNADecoderLM
from zerofx.compiler.program import resolve
from zerofx.planner.sweep import parse_sweep, sweep_world_sizes

SIZES = [8, 64, 1024]


def _small() -> tuple[DNADecoderLM, torch.Tensor]:
    with torch.device("meta"):
        return DNADecoderLM(DNA_LM_SIZES["small"]), torch.zeros(1, 256, dtype=torch.long)


@pytest.fixture(scope="module")
def sweep():
    model, ids = _small()
    comm, device = load_profile("h100")
    cfg = resolve({"bf16": {"enabled": True}}, stage=3, world_size=SIZES[0])
    return model, sweep_world_sizes(model, (ids,), {"labels": ids}, label="small", cfg=cfg, world_sizes=SIZES, comm=comm, device=device,
                                    profile="h100")


def test_sweep_rows_compare_the_chosen_plan_with_the_flat_one(sweep) -> None:
    model, result = sweep
    assert [r.world_size for r in result.rows] == SIZES
    assert result.rows[0].chosen.efficiency == pytest.approx(1.0) and result.rows[0].flat.efficiency == pytest.approx(1.0)
    params = [(n, p.numel(), 2, True) for n, p in model.named_parameters()]  # bf16: 16 bytes per parameter over K
    for r in result.rows:
        assert r.flat.shard_group_size == r.world_size and r.world_size % r.chosen.shard_group_size == 0
        # The flat plan is a candidate, so the chosen one is never predicted slower.
        assert r.chosen.step_s <= r.flat.step_s
        assert r.chosen.efficiency == pytest.approx(result.rows[0].chosen.step_s / r.chosen.step_s)
        assert r.chosen.model_state_bytes == pytest.approx(model_state_bytes(params, shard_group_size=r.chosen.shard_group_size, stage=3))
        assert r.decision.startswith(f"shard group size {r.chosen.shard_group_size} ")
        assert r.chosen.prefetch_distance >= 1 and r.chosen.num_gather_buckets >= 1
    # At 1,024 ranks the flat ring pays ~1,000 latencies per collective: the chooser keeps shards
    # within a node, and the flat plan scales far worse.
    last = result.rows[-1]
    assert last.chosen.shard_group_size <= H100_NVLINK_IB.ranks_per_node
    assert last.flat.efficiency < last.chosen.efficiency
    assert last.chosen.cross_group_algorithm in ("ring", "tree") and last.flat.cross_group_algorithm == ""
    data = json.loads(result.to_json())
    assert [r["world_size"] for r in data["rows"]] == SIZES and data["profile"] == "h100"


def test_auto_shard_group_size_and_profile_reach_the_compiled_plan(sweep) -> None:
    _, result = sweep
    model, ids = _small()
    config = {"bf16": {"enabled": True}, "zerofx": {"shard_group_size": "auto", "profile": "h100"}}
    program = zerofx.compile(model, world_size=1024, stage=3, config=config, example_inputs=(ids,), example_kwargs={"labels": ids})
    plan = program.plan
    # The same chooser as the sweep's (the capture's buckets equal the shapes' for this model).
    assert plan.shard_group_size == result.rows[-1].chosen.shard_group_size
    assert plan.decisions[0] == result.rows[-1].decision
    # Buckets are capped for the shard group's ring on the profile's links, not for CPU gloo.
    cap = efficient_bucket_bytes(plan.shard_group_size, H100_NVLINK_IB)
    assert all(sum(plan.param(f).padded_numel * plan.param(f).itemsize for f in b) <= cap or len(b) == 1 for b in plan.gather_buckets)


def test_sweep_command_prints_the_table_and_draws_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "sweep.png"
    assert main(["plan", "tiny", "--sweep", "world-size=8,1024", "--profile", "h100", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "flat step ms" in out and "decision at 1024: shard group size" in out
    assert plot.stat().st_size > 10_000
    assert main(["plan", "tiny", "--sweep", "world-size=8,x"]) == 2
    assert "world sizes must be integers" in capsys.readouterr().err
    assert main(["plan", "tiny", "--sweep", "world-size=8", "--world-size", "8"]) == 2


def test_parse_sweep() -> None:
    assert parse_sweep("world-size=1024,8,64") == [8, 64, 1024]
    for bad in ("ranks=8", "world-size=", "world-size=0,8", "world-size=8,8"):
        with pytest.raises(ValueError):
            parse_sweep(bad)
