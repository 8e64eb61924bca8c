"""Shard groups (``zerofx.shard_group_size``, NOTE [Shard groups of consecutive ranks]) and the
2 Psi traffic of stages 1 and 2 (NOTE [Stages 1 and 2 move 2 Psi]).

One spawn of 4 gloo ranks as 2 groups x 2 trains stages 1-3 (stage 1 with two micro-batches per
step) against plain single-process PyTorch; planning-only checks count the bytes each step's
collectives move in the rewritten graphs; config errors need neither.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zerofx
from tests.support.dist_utils import run_ranks
from tests.support.hierarchical_workers import reference, train_grouped
from tests.support.models import BATCH, SEQ, TINY
from zerofx.config import ConfigError, parse_config
from zerofx.models import DNADecoderLM
from zerofx.passes import meta
from zerofx.passes.plan import REPLICATE, SHARD, Plan
from zerofx.passes.zero.plan_sharding import place_param
from zerofx.compiler.program import PLANNING_GROUP, PLANNING_REPLICATE_GROUP

SGD = {"type": "SGD", "params": {"lr": 0.1}}
SMALL_BUCKETS = {"stage3_prefetch_bucket_size": 3000, "reduce_bucket_size": 3000, "allgather_bucket_size": 3000}
STEPS = 2
RUNS = [(1, 2), (2, 1), (3, 1)]  # (stage, micro-batches per optimizer step)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def test_two_groups_of_two_match_single_process_at_stages_1_to_3(tmp_path: Path) -> None:
    results = run_ranks(4, train_grouped, RUNS, 2, STEPS, SGD, SMALL_BUCKETS, str(tmp_path))
    expected = {gas: reference(4, STEPS, gas, SGD) for gas in (1, 2)}
    assert max_diff(expected[1], reference(4, 0, 1, SGD)) > 1e-3  # training moved the weights
    # Group 0 wrote every slice once, as a 2-rank save; every rank wrote its client file.
    saved = tmp_path / "grouped"
    assert sorted(f.name for f in saved.glob("rank-*")) == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    assert len(list(saved.glob("client-*-of-00004.pt"))) == 4
    assert json.loads((saved / "metadata.json").read_text())["num_shards"] == 2
    chosen = {by_run.pop("auto") for by_run in results}
    assert len(chosen) == 1  # every rank chose the same K
    engine_k, plan_k, decision = chosen.pop()
    assert engine_k == plan_k and 4 % engine_k == 0 and "shard group" in decision
    for rank, by_run in enumerate(results):
        loaded = by_run.pop("loaded")
        for layout, state in loaded.items():  # the stage-3 run, resumed flat and in groups of 2
            assert max_diff(state, by_run[RUNS[-1]]["state"]) == 0.0, (rank, layout)
        for (stage, gas), res in by_run.items():
            assert max_diff(res["state"], expected[gas]) < 1e-5, (rank, stage)
            assert res["memory"] == res["planned"], (rank, stage)
            # Groups of consecutive ranks; the replicate group is the ranks at the same shard index.
            assert res["shard_ranks"] == [rank // 2 * 2, rank // 2 * 2 + 1]
            assert res["replicate_ranks"] == [rank % 2, rank % 2 + 2]
            plan = Plan.from_json(res["plan"])
            assert (plan.shard_group_size, plan.num_shard_groups, plan.shard_index(rank)) == (2, 2, rank % 2)
            by_group: dict[str, set[str]] = {}
            for _graph, op, group, _ in res["collectives"]:
                by_group.setdefault(op, set()).add(group)
            # Gathers and reduce-scatters stay in the group; only the shard's all-reduce crosses groups.
            assert by_group["all_gather_into_tensor"] == {"zerofx_shard_2of4"}, (stage, by_group)
            assert by_group["reduce_scatter_tensor"] == {"zerofx_shard_2of4"}
            assert by_group["all_reduce"] == {"zerofx_replicate_2of4"}
            grads = {g for g, op, _, _ in res["collectives"] if op == "reduce_scatter_tensor"}
            assert grads == ({"grad_sync"} if stage == 1 else {"backward"})
            # Every planned collective is issued, with its group.
            issued = sorted((g, op, grp, b) for g, op, grp, b in res["collectives"])
            planned = sorted((c.graph, {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
                                        "all_reduce": "all_reduce"}[c.kind.value],
                              {SHARD: "zerofx_shard_2of4", REPLICATE: "zerofx_replicate_2of4"}[c.group], c.bytes_per_rank)
                             for c in plan.schedule)
            assert issued == planned


def _program(stage: int, shard_group_size: int | None) -> zerofx.Program:
    with torch.device("meta"):
        model = DNADecoderLM(TINY)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    config = {"zero_optimization": {"stage": stage, **SMALL_BUCKETS}}
    if shard_group_size is not None:
        config["zerofx"] = {"shard_group_size": shard_group_size}
    return zerofx.compile(model, world_size=4, config=config, example_inputs=(ids,), example_kwargs={"labels": ids})


@pytest.mark.parametrize(("stage", "shard_group_size"), [(1, None), (1, 2), (2, 2)])
def test_stages_1_and_2_move_two_psi_per_step(stage: int, shard_group_size: int | None) -> None:
    """Per optimizer step each rank reduce-scatters its padded gradients once (Psi bytes in) and
    gathers the updated parameters once (Psi bytes out): 2 Psi, as data parallelism. With shard
    groups, the shard's all-reduce across groups adds Psi / K."""
    program = _program(stage, shard_group_size)
    plan = program.plan
    k = plan.shard_group_size
    psi = sum(p.padded_numel * p.itemsize for p in plan.params if p.requires_grad)  # padded, bytes
    moved = {"reduce_scatter": 0, "all_gather": 0, "all_reduce": 0}
    groups: dict[str, set[str]] = {kind: set() for kind in moved}
    for gm in program.graph_modules(0).values():
        for n in gm.graph.nodes:
            if not meta.is_collective(n):
                continue
            inp = n.args[0].meta["val"]
            nbytes = inp.numel() * inp.element_size()
            if meta.is_all_gather(n):
                moved["all_gather"] += nbytes * int(n.args[1])  # what the gather writes: the padded parameters
                groups["all_gather"].add(n.args[2])
            elif meta.is_reduce_scatter(n):
                moved["reduce_scatter"] += nbytes
                groups["reduce_scatter"].add(n.args[3])
            else:
                moved["all_reduce"] += nbytes
                groups["all_reduce"].add(n.args[2])
    assert moved["reduce_scatter"] == psi and moved["all_gather"] == psi
    assert groups["reduce_scatter"] == groups["all_gather"] == {PLANNING_GROUP}
    if k == plan.world_size:
        assert moved["all_reduce"] == 0  # the old stage 1 all-reduced the gradients: 3 Psi
    else:
        assert moved["all_reduce"] == psi // k and groups["all_reduce"] == {PLANNING_REPLICATE_GROUP}
    assert {c.graph for c in plan.schedule if c.kind.value == "reduce_scatter"} == {"grad_sync" if stage == 1 else "backward"}
    # 16P / K per rank: every sharded quantity is padded / K.
    assert all(p.padded_numel == k * p.shard_numel and p.padded_numel % k == 0 for p in plan.params)


def test_shard_group_size_config() -> None:
    with pytest.raises(ConfigError, match=r"'zerofx.shard_group_size' got 3, which does not divide the world size 4"):
        parse_config({"zerofx": {"shard_group_size": 3}}, stage=1, world_size=4)
    with pytest.raises(ConfigError, match=r"'zerofx.shard_group_size' got 2 at ZeRO stage 0"):
        parse_config({"zerofx": {"shard_group_size": 2}}, stage=0, world_size=4)
    for bad in (0, "two", 1.5, True):
        with pytest.raises(ConfigError, match="zerofx.shard_group_size"):
            parse_config({"zerofx": {"shard_group_size": bad}})
    assert parse_config({"zerofx": {"shard_group_size": 2}}, stage=2, world_size=4).shard_group_size == 2
    assert parse_config({"zerofx": {"shard_group_size": "auto"}}).shard_group_size == "auto"
    assert parse_config({}).shard_group_size is None
    # Known only when compiling: the world size given there is checked too.
    with torch.device("meta"):
        model = DNADecoderLM(TINY)
    with pytest.raises(ConfigError, match="does not divide the world size 6"):
        zerofx.compile(model, world_size=6, stage=3, config={"zerofx": {"shard_group_size": 4}})
    grouped = zerofx.compile(model, world_size=8, stage=3, config={"zerofx": {"shard_group_size": 2}}).plan
    assert grouped.shard_group_size == 2 and "shard groups: 4 groups of 2" in str(grouped)
    assert Plan.from_json(grouped.to_json()) == grouped and json.loads(grouped.to_json())["shard_group_size"] == 2
    assert grouped.fingerprint() != zerofx.compile(model, world_size=8, stage=3).plan.fingerprint()
    # 30 elements over groups of 4: padded to 32, shards of 8.
    norm = place_param("norm.weight", (30,), torch.float32, True, world_size=8, shard_group_size=4)
    assert (norm.padded_numel, norm.shard_numel, norm.owned_range(3)) == (32, 8, (24, 30))
