"""The whole-job search (zerofx/planner/autoplan.py, docs/autoplan.md): what it chooses as the
budget and the context change, what it says when nothing fits, the config block it prints
planning the same thing again, and ``"zerofx": {"auto": true}`` applied at initialize. Tiny
models on the meta device, small search spaces: seconds each."""

from __future__ import annotations

import collections
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import zerofx

from tests.support.autoplan_workers import MeanLM, auto_initialize
from tests.support.dist_utils import run_ranks
from zerofx.app.cli import main
from zerofx.app.commands.plan_auto import format_auto_plan
from zerofx.common.errors import ConfigError
from zerofx.common.units import format_bytes
from zerofx.planner import autoplan
from zerofx.planner.autoplan import AutoPlan, SearchSpace, candidate_config, resize_inputs, search
from zerofx.config import parse_config
from zerofx.models.registry import build_model
from zerofx.passes import Plan


def _search(seq_len: int, budget: float, space: SearchSpace, *, world_size: int = 2) -> AutoPlan:
    model = build_model("tiny", device="meta")
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")  # (B, T)
    return search(model, resize_inputs((ids,), {"labels": ids}), {"zerofx": {"memory_budget": budget}}, world_size=world_size,
                  seq_len=seq_len, batch=1, budget_bytes=budget, space=space)


STAGES = SearchSpace(stages=(0, 1, 2, 3), sequence_parallel=(1,), shard_group_sizes=None, offloads=("none", "cpu"), tilings=("off",), recomputes=("off",),
                     micro_batch=None, accumulation=None)


def test_a_tighter_budget_shards_more_or_offloads() -> None:
    """With room to spare the least sharded stage is fastest; a budget below its peak makes the
    search shard more (a higher stage) or move the optimizer state off the device, and what it
    chooses fits while every faster candidate does not."""
    loose = _search(128, 1e9, STAGES)
    assert loose.chosen is not None and loose.chosen.candidate.stage == 0 and loose.chosen.candidate.offload == "none"
    stage0_peak = loose.chosen.peak_bytes
    stage3_peak = next(e.peak_bytes for e in loose.ranked if e.candidate.stage == 3)
    tight = _search(128, (stage0_peak + stage3_peak) / 2, STAGES)
    chosen = tight.chosen
    assert chosen is not None and chosen.fits
    assert chosen.candidate.stage > 0 or chosen.candidate.offload == "cpu"
    assert chosen.peak_bytes <= tight.budget_bytes
    stage0 = next(e for e in tight.ranked if e.candidate.stage == 0 and e.candidate.offload == "none")
    assert not stage0.fits and stage0.why.startswith("over budget by ")
    assert chosen.tokens_per_s == max(e.tokens_per_s for e in tight.ranked if e.fits)
    assert all("slower" in e.why for e in tight.ranked if e.fits and e is not chosen)


def test_host_offload_on_a_cpu_rank_frees_nothing() -> None:
    """On a CPU profile host memory is the rank's memory (NOTE [Host offload on a CPU rank]): a
    candidate with its optimizer state offloaded there is predicted at the peak its own program
    reports, the peak of the same candidate without offload, and the search does not offer it.
    On the H100 profile it is offered, and its peak is less the records it takes off the device."""
    from zerofx.planner.autoplan import Candidate, _Search

    model = build_model("tiny", device="meta")
    ids = torch.zeros(1, 64, dtype=torch.long, device="meta")  # (B, T)
    peaks = {}
    for profile in ("cpu", "h100"):
        base = {"zerofx": {"memory_budget": 2**30, "profile": profile}}
        s = _Search(model, resize_inputs((ids,), {"labels": ids}), parse_config(base), world_size=2, seq_len=64, global_batch=2, budget_bytes=2**30,
                    fixed=frozenset(), loss_fn=None)
        plain, host = (s.evaluate(Candidate(0, 1, 2, offload, "off", 1, 1, "off")) for offload in ("none", "cpu"))
        peaks[profile] = (plain.peak_bytes, host.peak_bytes)
        if profile == "cpu":
            program = zerofx.compile(model, world_size=2, config=s.config(host.candidate), example_inputs=(ids,), example_kwargs={"labels": ids})
            assert host.peak_bytes == program.report(0).peak.live_bytes == plain.peak_bytes
            assert host.model_state_bytes == plain.model_state_bytes == s.model_state_bytes(host.candidate)
        cfg = parse_config({**base, "zerofx": {**base["zerofx"], "auto": True}})
        offloads = autoplan.search_space(cfg, cfg.auto, world_size=2, seq_len=64, batch=1).offloads
        assert offloads == (("none",) if profile == "cpu" else ("none", "cpu"))
    states = 2 * 4 * sum(p.numel() for p in model.parameters())  # Adam's two fp32 states per element, stage 0: every element
    assert peaks["h100"][0] - peaks["h100"][1] == pytest.approx(states, rel=0.01)


def test_a_search_lowers_each_plan_of_a_capture_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recompute "auto" starts from the plan with nothing recomputed, which the same candidate
    without recompute has lowered already, and a candidate that offloads its optimizer state
    plans what the one that does not plans: the search lowers each plan of a capture once (NOTE
    [One report per plan of a capture])."""
    from zerofx.compiler import pipeline, program

    lowered: collections.Counter[tuple[int, str]] = collections.Counter()
    real = pipeline.lower

    def counting(joint: torch.fx.GraphModule, plan: Plan, **kwargs: object) -> dict[str, torch.fx.GraphModule]:
        lowered[(id(joint), repr(replace(plan, decisions=())))] += 1
        return real(joint, plan, **kwargs)

    monkeypatch.setattr(pipeline, "lower", counting)
    monkeypatch.setattr(program, "lower", counting, raising=False)  # where Program called it by that name
    space = SearchSpace(stages=(0,), sequence_parallel=(1,), shard_group_sizes=None, offloads=("none", "cpu"), tilings=("off",),
                        recomputes=("off", "auto"), micro_batch=1, accumulation=1)
    loose = _search(128, 1e9, space)
    assert loose.chosen is not None and sum(lowered.values()) == 1
    tight = _search(128, 0.95 * loose.chosen.peak_bytes, space)
    assert max(lowered.values()) == 1
    recomputing = [e for e in tight.ranked if e.lowered and e.candidate.recompute == "auto"]
    assert {e.candidate.offload for e in recomputing} == {"none", "cpu"} and sum(lowered.values()) > len(recomputing) + 1
    assert tight.chosen is not None and tight.chosen.candidate.recompute == "auto" and tight.chosen.recomputed > 0


RECOMPUTE = SearchSpace(stages=(3,), sequence_parallel=(1,), shard_group_sizes=None, offloads=("none",), tilings=("off",),
                        recomputes=("off", "auto"), micro_batch=1, accumulation=1)


@pytest.fixture(scope="module")
def loose_recompute() -> AutoPlan:
    """RECOMPUTE at 512 tokens with room to spare, searched once: the recompute and margin tests
    set their budgets from its plain plan's peak."""
    return _search(512, 1e9, RECOMPUTE)


def test_a_tighter_budget_picks_recompute(loose_recompute: AutoPlan) -> None:
    """With room to spare nothing is recomputed (the recompute candidates are not even tried); a
    budget below the default min-cut's peak makes the search recompute the fewest saved
    activations that fit, at a small cost in predicted time, and the config block says so."""
    loose = loose_recompute
    assert loose.chosen is not None and loose.chosen.candidate.recompute == "off" and loose.chosen.recomputed == 0
    assert [e.candidate.recompute for e in loose.ranked] == ["off"]
    plain_peak = loose.chosen.peak_bytes
    tight = _search(512, 0.93 * plain_peak, RECOMPUTE)
    chosen = tight.chosen
    assert chosen is not None and chosen.fits and chosen.peak_bytes <= tight.budget_bytes
    assert chosen.candidate.recompute == "auto" and chosen.recomputed > 0
    plain = next(e for e in tight.ranked if e.candidate.recompute == "off")
    assert not plain.fits and plain.lowered
    # Within 1% above: once anything is recomputed the spine is saved (NOTE [The spine stays saved]),
    # so the partitioner no longer rebuilds the residual adds it recomputes by default.
    assert 0.9 * plain.tokens_per_s < chosen.tokens_per_s <= 1.01 * plain.tokens_per_s
    assert f"({chosen.recomputed} activation" in chosen.label() and "recomputed)" in chosen.label()
    assert tight.config is not None and tight.config["zerofx"]["recompute"] == "auto"
    # A tighter budget still recomputes more.
    tighter = _search(512, 0.86 * plain_peak, RECOMPUTE)
    assert tighter.chosen is not None and tighter.chosen.recomputed > chosen.recomputed


COMPILERS = SearchSpace(stages=(3,), sequence_parallel=(1,), shard_group_sizes=None, offloads=("none",), tilings=("off",),
                        recomputes=("off",), micro_batch=1, accumulation=1, compilers=("none", "inductor"))


def test_inductor_is_chosen_where_what_it_keeps_resident_fits(tmp_path: Path) -> None:
    """NOTE [Fused kernels under Inductor], NOTE [What Inductor keeps resident]: with a profile
    that measured Inductor's resident memory, the compiled step is predicted faster and chosen
    while the budget holds its peak plus that memory; a budget between the two peaks keeps the
    eager step. The chosen config compiles with the fused update, and planned again it fits the
    step to the budget less Inductor's memory, and says so."""
    import dataclasses

    from zerofx.cost_models.comm import CPU_GLOO
    from zerofx.cost_models.compute import CPU_CORE
    from zerofx.cost_models.profiles import save_profile

    resident = 2 * 2**20
    profile = tmp_path / "profile.json"
    save_profile(profile, CPU_GLOO, dataclasses.replace(CPU_CORE, cores=2, inductor_bytes=resident))
    model = build_model("tiny", device="meta")
    ids = torch.zeros(1, 512, dtype=torch.long, device="meta")  # (B, T)

    def run(budget: float) -> AutoPlan:
        return search(model, resize_inputs((ids,), {"labels": ids}), {"zerofx": {"memory_budget": budget, "profile": str(profile)}},
                      world_size=2, seq_len=512, batch=1, budget_bytes=budget, space=COMPILERS)

    loose = run(1e9)
    chosen = loose.chosen
    assert chosen is not None and chosen.candidate.compiler == "inductor" and "inductor" in chosen.label()
    # The eager step's compute alone is longer than the compiled step: it is not lowered.
    eager = next(e for e in loose.ranked if e.candidate.compiler == "none")
    assert not eager.lowered and eager.step_bound_s > chosen.step_s and "slower than" in eager.why
    assert loose.config is not None and loose.config["zerofx"]["compile"] == "inductor" and loose.config["zerofx"]["fused_optimizer"] is True
    tight = run(chosen.peak_bytes - resident / 2)
    assert tight.chosen is not None and tight.chosen.candidate.compiler == "none" and tight.chosen.step_s > chosen.step_s
    assert chosen.peak_bytes == pytest.approx(tight.chosen.peak_bytes + resident)
    over = next(e for e in tight.ranked if e.candidate.compiler == "inductor")
    assert not over.fits and over.why.startswith("over budget by ")
    # The search's choice planned again: the step is fitted to the budget less Inductor's memory.
    again = zerofx.compile(model, world_size=2, config=loose.config, example_inputs=(ids,), example_kwargs={"labels": ids})
    assert any("Inductor keeps resident" in d for d in again.plan.decisions)
    # A config that sets zerofx.compile keeps it; a profile that did not measure Inductor leaves it out.
    from zerofx.planner.autoplan import search_space

    for own, expected in (({"compile": "none", "profile": str(profile)}, ("config",)), ({"profile": str(profile)}, ("none", "inductor")),
                          ({}, ("none",))):
        cfg = parse_config({"zerofx": {"auto": True, "memory_budget": 1e9, **own}}, world_size=2)
        assert cfg.auto is not None
        assert search_space(cfg, cfg.auto, world_size=2, seq_len=512, batch=1).compilers == expected


def test_inductor_is_searched_with_sequence_parallelism(tmp_path: Path) -> None:
    """Inductor compiles sequence-parallel graphs (tests/test_sp_inductor.py), so at sequence
    parallel size 2 the search prices the compiled candidate beside the eager one and chooses it
    where it fits, and the config it prints plans."""
    import dataclasses

    from zerofx.cost_models.comm import CPU_GLOO
    from zerofx.cost_models.compute import CPU_CORE
    from zerofx.cost_models.profiles import save_profile

    profile = tmp_path / "profile.json"
    save_profile(profile, CPU_GLOO, dataclasses.replace(CPU_CORE, cores=2, inductor_bytes=2 * 2**20))
    model = build_model("tiny", device="meta")
    ids = torch.zeros(1, 512, dtype=torch.long, device="meta")  # (B, T)
    result = search(model, resize_inputs((ids,), {"labels": ids}), {"zerofx": {"memory_budget": 1e9, "profile": str(profile)}},
                    world_size=2, seq_len=512, batch=1, budget_bytes=1e9,
                    space=replace(COMPILERS, sequence_parallel=(2,), micro_batch=None, accumulation=None))
    assert {e.candidate.compiler for e in result.ranked} == {"inductor", "none"}
    chosen = result.chosen
    assert chosen is not None and (chosen.candidate.sequence_parallel, chosen.candidate.compiler) == (2, "inductor")
    assert result.config is not None and result.config["zerofx"]["compile"] == "inductor"
    again = zerofx.compile(model, world_size=2, config=result.config, example_inputs=(ids,), example_kwargs={"labels": ids})
    assert again.plan.sequence_parallel is not None and again.plan.sequence_parallel.size == 2


def test_a_memory_margin_keeps_the_choice_clear_of_the_budget(loose_recompute: AutoPlan) -> None:
    """NOTE [The memory margin]: with ``zerofx.memory_margin`` the search fits the predicted peak
    to the budget less the margin, so a budget the plain plan fits by 5% with a 10% margin needs
    recompute; the result says so, and its config block carries the margin, so the plan it
    describes fits the same figure when planned again."""
    from zerofx.config.options import planned_budget_bytes

    loose = loose_recompute
    assert loose.chosen is not None
    budget = 1.05 * loose.chosen.peak_bytes
    plain = _search(512, budget, RECOMPUTE)
    assert plain.chosen is not None and plain.chosen.recomputed == 0 and plain.memory_margin == 0
    own = {"memory_budget": budget, "memory_margin": 0.1}
    model = build_model("tiny", device="meta")
    ids = torch.zeros(1, 512, dtype=torch.long, device="meta")  # (B, T)
    held = search(model, resize_inputs((ids,), {"labels": ids}), {"zerofx": own}, world_size=2, seq_len=512, batch=1,
                  budget_bytes=planned_budget_bytes(own), space=RECOMPUTE)
    chosen = held.chosen
    assert chosen is not None and chosen.peak_bytes <= 0.9 * budget < loose.chosen.peak_bytes
    assert chosen.candidate.recompute == "auto" and chosen.recomputed > 0
    assert held.memory_margin == 0.1 and "less a 10% margin" in held.summary()
    assert held.config is not None and held.config["zerofx"]["memory_margin"] == 0.1
    again = parse_config(held.config, world_size=2)
    assert again.schedule.memory_budget_bytes == pytest.approx(held.budget_bytes)


def test_many_ranks_lower_one_or_two_shard_group_sizes_per_stage() -> None:
    """At 64 ranks on the H100 profile each stage has six shard group sizes. The search lowers
    them in the shard-group model's order up to the first that fits, so at most two per stage
    here, and still chooses what lowering all eighteen chooses. Every candidate's lowered step is
    at least the floor the search skips candidates by."""
    from zerofx.planner.autoplan import Candidate, _Search

    model = build_model("tiny", device="meta")  # 2 blocks: the 21 candidates lowered below cost half what "small"'s 4 do
    ids = torch.zeros(1, 256, dtype=torch.long, device="meta")  # (B, T)
    base = {"zerofx": {"memory_budget": 1e9, "profile": "h100"}}
    space = SearchSpace(stages=(1, 2, 3), sequence_parallel=(1,), shard_group_sizes=None, offloads=("none",), tilings=("off",),
                        recomputes=("off",), micro_batch=2, accumulation=1)
    inputs_at = resize_inputs((ids,), {"labels": ids})
    result = search(model, inputs_at, base, world_size=64, seq_len=256, batch=2, budget_bytes=1e9, space=space)
    assert result.chosen is not None and len(result.ranked) == 18
    lowered = [e for e in result.ranked if e.lowered]
    assert len(lowered) <= 6 and all(sum(e.candidate.stage == st for e in lowered) <= 2 for st in (1, 2, 3))
    assert all(e.step_s >= e.step_bound_s > 0 for e in lowered)
    assert all("behind" in e.why or "shard-group model, slower" in e.why for e in result.ranked if not e.lowered)
    every = _Search(model, inputs_at, parse_config(base), world_size=64, seq_len=256, global_batch=128, budget_bytes=1e9, fixed=frozenset(),
                    loss_fn=None)
    exhaustive = [every.evaluate(Candidate(st, 1, k, "none", "off", 2, 1)) for st in (1, 2, 3) for k in (2, 4, 8, 16, 32, 64)]
    best = max((e for e in exhaustive if e.fits), key=lambda e: e.tokens_per_s)
    assert all(e.step_s >= every.step_floor_s(e.candidate) for e in exhaustive)
    assert result.chosen.candidate == best.candidate and result.chosen.tokens_per_s == pytest.approx(best.tokens_per_s)


def test_the_memory_bound_holds_per_stage_and_shard_group_size() -> None:
    """NOTE [How the whole-job search prunes]: at 64 ranks and 32 tokens the gradients are most
    of the transient memory, and stage 0 holds them whole where stage 2 holds shards, so a bound
    taken from stage 0's transient would skip stage 2 K 8, the fastest that fits. Every
    candidate skipped by the memory bound peaks at least at its bound, and the search chooses
    what lowering every candidate chooses."""
    from zerofx.planner.autoplan import _Search

    model = build_model("small", device="meta")
    ids = torch.zeros(1, 32, dtype=torch.long, device="meta")  # (B, T)
    inputs_at = resize_inputs((ids,), {"labels": ids})
    budget = 8 * 2**20
    base = {"zerofx": {"memory_budget": budget, "profile": "h100"}}
    space = SearchSpace(stages=(0, 2), sequence_parallel=(1,), shard_group_sizes=(8, 64), offloads=("none", "cpu"), tilings=("off",),
                        recomputes=("off",), micro_batch=1, accumulation=1)
    result = search(model, inputs_at, base, world_size=64, seq_len=32, batch=1, budget_bytes=budget, space=space)
    every = _Search(model, inputs_at, parse_config(base), world_size=64, seq_len=32, global_batch=64, budget_bytes=budget, fixed=frozenset(), loss_fn=None)
    exhaustive = {e.candidate: every.evaluate(e.candidate) for e in result.ranked}
    bounded = [e for e in result.ranked if not e.lowered and "over budget by at least" in e.why]
    assert all(e.peak_bytes <= exhaustive[e.candidate].peak_bytes for e in bounded)
    best = max((e for e in exhaustive.values() if e.fits), key=lambda e: e.tokens_per_s)
    assert (best.candidate.stage, best.candidate.shard_group_size, best.candidate.offload) == (2, 8, "none")
    assert result.chosen is not None and result.chosen.candidate == best.candidate
    # The offloaded update is in the step floor: never above the lowered step.
    assert all(e.step_s >= every.step_floor_s(e.candidate) for e in exhaustive.values())
    assert any(e.candidate.offload == "cpu" and every.step_floor_s(e.candidate) > every.compute_s(e.candidate)
               for e in exhaustive.values())


def test_a_folded_search_chooses_and_predicts_what_the_whole_one_does() -> None:
    """Folded (captures of 2 and 3 of the 4 blocks, NOTE [Budgets of the cut models]), every
    candidate's step and peak are the whole model's, also under a budget that makes stage 3 fit
    its prefetch distance; the winner is captured whole, so its config plans the same plan
    (fingerprint) as the unfolded search's. With recompute to the budget both choose the same."""
    model = build_model("small", device="meta")
    ids = torch.zeros(1, 256, dtype=torch.long, device="meta")  # (B, T)

    def run(budget: float, fold: str, recomputes: tuple[str, ...], stages: tuple[int, ...] = (2, 3),
            shard_group_sizes: tuple[int, ...] | None = None) -> AutoPlan:
        space = SearchSpace(stages=stages, sequence_parallel=(1,), shard_group_sizes=shard_group_sizes, offloads=("none",),
                            tilings=("off",), recomputes=recomputes, micro_batch=1, accumulation=1)
        return search(model, resize_inputs((ids,), {"labels": ids}), {"zerofx": {"memory_budget": budget}}, world_size=4, seq_len=256,
                      batch=1, budget_bytes=budget, space=space, fold=fold)

    loose = run(1e9, "off", ("off",))
    assert loose.chosen is not None
    stage3 = next(e for e in loose.ranked if e.candidate.stage == 3)
    for budget in (1e9, 0.9 * stage3.peak_bytes):
        whole = loose if budget == 1e9 else run(budget, "off", ("off",))
        folded = run(budget, "on", ("off",))
        assert folded.chosen is not None and whole.chosen is not None
        assert folded.chosen.candidate == whole.chosen.candidate and folded.chosen.fingerprint == whole.chosen.fingerprint
        by_candidate = {e.candidate: e for e in whole.ranked if e.lowered}
        compared = [e for e in folded.ranked if e.lowered and e.candidate in by_candidate]
        assert compared
        for e in compared:
            assert e.step_s == pytest.approx(by_candidate[e.candidate].step_s, rel=1e-6)
            assert e.peak_bytes == pytest.approx(by_candidate[e.candidate].peak_bytes, rel=1e-6)
    # Recompute at stage 3 alone, flat (K 4): a recompute search plans its candidates whole, the
    # costly part; the choice between shard group sizes is the budgets' above.
    whole, folded = (run(0.7 * stage3.peak_bytes, fold, ("off", "auto"), (3,), (4,)) for fold in ("off", "on"))
    assert folded.chosen is not None and whole.chosen is not None
    assert folded.chosen.candidate == whole.chosen.candidate and folded.chosen.candidate.recompute == "auto"
    assert folded.chosen.recomputed == whole.chosen.recomputed > 0
    assert folded.chosen.fits and folded.chosen.fingerprint


def test_a_folded_recompute_candidate_is_not_planned_whole_where_nothing_recomputed_is_slower() -> None:
    """NOTE [Budgets of the cut models]: recompute only adds to the step, so a folded candidate
    that recomputes to the budget, planned with nothing recomputed, gives its step's floor; where
    that is slower than the best so far it is not captured and planned whole."""
    from zerofx.planner.autoplan import Candidate, Evaluated, _Search

    model = build_model("small", device="meta")
    ids = torch.zeros(1, 64, dtype=torch.long, device="meta")  # (B, T)
    inputs_at = resize_inputs((ids,), {"labels": ids})
    c = Candidate(3, 1, 2, "none", "off", 1, 1, "auto")

    s = _Search(model, inputs_at, parse_config({"zerofx": {"memory_budget": 1e9}}), world_size=2, seq_len=64, global_batch=2, budget_bytes=1e9,
                fixed=frozenset(), loss_fn=None, fold="on")
    faster = Evaluated(Candidate(2, 1, 2, "none", "off", 1, 1), 1e-9, 1.0, 0.0, 0.0, fits=True)
    e = s.evaluate(c, best=faster)
    assert not e.lowered and not e.fits and "not planned whole" in e.why and s.num_captures == 2  # cut to 2 and 3 blocks
    whole = s.evaluate(c, best=replace(faster, step_s=1e9))
    assert whole.lowered and whole.fits and s.num_captures == 3  # and whole
    assert whole.step_s >= e.step_bound_s > faster.step_s


@pytest.mark.slow
def test_a_folded_search_cuts_longer_where_the_prefetch_window_spans_blocks() -> None:
    """NOTE [A window that spans blocks]: with one gather bucket per block and a prefetch
    distance of 2 or 3 buckets, a candidate is lowered on cuts longer than 2 and 3 blocks, and
    its folded peak is the whole model's."""
    from zerofx.planner.autoplan import Candidate, _Search
    from zerofx.models import DNADecoderLM
    from zerofx.models.sizes import DNALMConfig

    with torch.device("meta"):
        model = DNADecoderLM(DNALMConfig(dim=64, num_layers=12, num_heads=4, ffn_dim=172, max_seq_len=256))
    ids = torch.zeros(1, 64, dtype=torch.long, device="meta")
    inputs_at = resize_inputs((ids,), {"labels": ids})
    one_bucket_per_block = sum(p.numel() for p in model.blocks[0].parameters()) + 1
    candidate = Candidate(3, 1, 4, "none", "off", 1, 1)
    for distance in (2, 3):
        base = {"zero_optimization": {"stage3_prefetch_bucket_size": one_bucket_per_block}, "zerofx": {"prefetch_distance": distance}}
        folded, whole = (_Search(model, inputs_at, parse_config(base), world_size=4, seq_len=64, global_batch=4, budget_bytes=1e9, fixed=frozenset(),
                                 loss_fn=None, fold=fold) for fold in ("on", "off"))
        f, w = folded.evaluate(candidate), whole.evaluate(candidate)
        assert folded.num_captures == 4  # cut to 2, 3, then 4 and 5 (distance 2) or 5 and 6 (distance 3) blocks
        assert f.peak_bytes == w.peak_bytes, distance
        assert f.step_s == pytest.approx(w.step_s, rel=0.05), distance


SEQUENCE = SearchSpace(stages=(3,), sequence_parallel=(1, 2), shard_group_sizes=None, offloads=("none",), tilings=("off",), recomputes=("off",),
                       micro_batch=None, accumulation=None)


@pytest.mark.slow
def test_cut_models_are_planned_at_the_whole_models_prefetch_distance() -> None:
    """NOTE [The whole model's prefetch distance]: at stage 3 on the H100 profile the distance
    the planner takes from the profile differs between the cut models (4 buckets ahead) and the
    whole one (3), so the cuts are planned at the whole model's, and the folded peak and step
    are the whole model's."""
    from zerofx.planner.autoplan import Candidate, _Search
    from zerofx.compiler.program import resolve
    from zerofx.models import DNADecoderLM
    from zerofx.models.sizes import DNA_LM_SIZES

    with torch.device("meta"):
        model = DNADecoderLM(replace(DNA_LM_SIZES["1b"], num_layers=12))
    ids = torch.zeros(1, 512, dtype=torch.long, device="meta")
    inputs_at = resize_inputs((ids,), {"labels": ids})
    base = {"zerofx": {"memory_budget": 8 * 2**30, "profile": "h100"}}
    folded, whole = (_Search(model, inputs_at, parse_config(base), world_size=1024, seq_len=512, global_batch=1024, budget_bytes=8 * 2**30,
                             fixed=frozenset(), loss_fn=None, fold=fold) for fold in ("on", "off"))
    c = Candidate(3, 1, 8, "none", "off", 1, 1)
    f, w = folded.evaluate(c), whole.evaluate(c)
    distance = folded.whole_prefetch_distance(c, resolve(folded.config(c), stage=None, world_size=1024))
    assert distance == whole.groups[c.capture_group].plan.prefetch_distance == 3
    assert folded.cut_program(c, folded.cut_config(folded.config(c)), 3).plan.prefetch_distance == 4  # the cut's own
    assert f.peak_bytes == pytest.approx(w.peak_bytes, rel=1e-9)
    assert f.step_s == pytest.approx(w.step_s, rel=0.01)


def test_a_longer_context_picks_sequence_parallelism() -> None:
    """At a short context every rank runs whole sequences; at 4x the context under the same
    budget only splitting each sequence over 2 ranks fits, one sequence per micro-step with 2
    micro-steps, so the global batch stays the same."""
    short = _search(128, 2.5e6, SEQUENCE)
    assert short.chosen is not None and short.chosen.candidate.sequence_parallel == 1
    assert all(e.candidate.sequence_parallel == 1 for e in short.ranked)  # everything fit: no larger size was tried
    long = _search(512, 2.5e6, SEQUENCE)
    assert long.chosen is not None
    c = long.chosen.candidate
    assert (c.sequence_parallel, c.micro_batch, c.accumulation) == (2, 1, 2)
    assert long.global_batch == short.global_batch == 2
    whole = next(e for e in long.ranked if e.candidate.sequence_parallel == 1)
    assert not whole.fits
    assert long.config is not None and long.config["zerofx"]["sequence_parallel"]["size"] == 2
    assert parse_config(long.config).world_size == 2  # the batch keys imply the world size


def test_a_model_sequence_parallelism_refuses_is_no_candidate_for_it() -> None:
    """The rewrite's SequenceParallelError makes a size no candidate, with the reason; the search
    goes on with the rest."""
    with torch.device("meta"):
        model = MeanLM()
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")  # (B, T)
    space = SearchSpace(stages=(3,), sequence_parallel=(1, 2), shard_group_sizes=None, offloads=("none",), tilings=("off",), recomputes=("off",),
                        micro_batch=None, accumulation=None)
    def run(budget: float) -> AutoPlan:
        return search(model, resize_inputs((ids,), {"labels": ids}), {}, world_size=2, seq_len=16, batch=1, budget_bytes=budget,
                      space=space)

    whole = run(1e9).chosen
    assert whole is not None
    # Over the budget by its activations alone, so splitting the sequence is worth trying.
    result = run((whole.model_state_bytes + whole.peak_bytes) / 2)
    assert [what for what, _ in result.not_candidates] == ["sequence parallelism over 2 ranks"]
    assert "cannot shard aten.mean.dim" in result.not_candidates[0][1]
    assert all(e.candidate.sequence_parallel == 1 for e in result.ranked) and result.chosen is None


def test_nothing_fits_says_what_would_have_to_change() -> None:
    space = SearchSpace(stages=(2, 3), sequence_parallel=(1,), shard_group_sizes=None, offloads=("none",), tilings=("off",), recomputes=("off",),
                        micro_batch=None, accumulation=None)
    result = _search(256, 1.0e6, space)
    assert result.chosen is None and result.config is None
    lean = min(e.peak_bytes for e in result.ranked)
    assert lean > 1.0e6
    assert result.to_fit[0].startswith("a budget of at least ")
    assert "leanest candidate" in result.to_fit[0]
    assert "or a sequence of 128 tokens" in result.to_fit[1] or "or a sequence of 64 tokens" in result.to_fit[1]
    assert "nothing fits" in result.summary()


def test_the_printed_config_plans_the_same_thing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """zerofx plan --auto --format json gives a config block; zerofx plan --config with it plans
    the same plan (fingerprint), peak and schedule."""
    fixed = tmp_path / "fixed.json"
    fixed.write_text(json.dumps({"zerofx": {"tiling": {"enabled": False}}}))
    assert main(["plan", "tiny", "--auto", "--world-size", "2", "--seq-len", "128", "--budget", "1.2MB", "--config", str(fixed),
                 "--format", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["fixed"] == ["tiling"] and result["config"]["zerofx"]["tiling"] == {"enabled": False}
    chosen = result["chosen"]
    block = tmp_path / "chosen.json"
    block.write_text(json.dumps(result["config"]))
    assert main(["plan", "tiny", "--config", str(block), "--seq-len", "128", "--format", "json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert Plan.from_json(json.dumps(planned["plan"])).fingerprint() == chosen["fingerprint"]
    assert planned["memory"]["budget_bytes"] is None or planned["memory"]["fits"]
    if chosen["candidate"]["offload"] == "none":
        assert planned["memory"]["peak_bytes"] == chosen["peak_bytes"]
        # The search prices a candidate's step as zerofx plan does, the update included (NOTE [An
        # optimizer step of several micro-batches], NOTE [The optimizer update's time]).
        assert planned["summary"]["optimizer_step_s"] == pytest.approx(chosen["step_s"], rel=1e-6)


def test_plan_auto_table_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "tiny", "--auto", "--world-size", "2"]) == 2
    assert "--auto needs --budget" in capsys.readouterr().err
    assert main(["plan", "tiny", "--auto", "--world-size", "2", "--budget", "1GiB", "--solve", "seq_len"]) == 2
    assert "leave out --solve" in capsys.readouterr().err
    assert main(["plan", "tiny", "--auto", "--world-size", "2", "--budget", "1GiB", "--margin", "1"]) == 2
    assert "--margin: '1' is out of range; accepted: a share of --budget from 0 up to, not including, 1" in capsys.readouterr().err
    assert main(["plan", "tiny", "--world-size", "2", "--margin", "0.1"]) == 2
    assert "--margin 0.1 needs --budget" in capsys.readouterr().err
    assert main(["plan", "tiny", "--auto", "--world-size", "2", "--stage", "3", "--seq-len", "64", "--budget", "1GiB", "--margin", "0.5"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "kept as the config sets them: stage" in out and "chosen: stage 3" in out
    # Progress, one line per candidate planned, on stderr: the table and config stay on stdout.
    progress = [line for line in captured.err.splitlines() if line.startswith("zerofx plan --auto: ")]
    assert progress and all(" lowered, " in line and "stage 3, K 2" in line for line in progress)
    assert "fits, " in progress[-1] and "zerofx plan --auto: " not in out
    assert '"stage": 3' in out and "why not" in out
    assert "budget 512 MiB (1 GiB less a 50% margin) per rank" in out and '"memory_margin": 0.5' in out


def test_auto_needs_a_memory_budget() -> None:
    with pytest.raises(ConfigError, match=r"'zerofx.auto' is true but 'zerofx.memory_budget' is missing"):
        parse_config({"zerofx": {"auto": True}})
    assert parse_config({"zerofx": {"auto": True, "memory_budget": "1GiB"}, "zero_optimization": {"stage": 2}}).auto.fixed == {"stage"}
    assert parse_config({"zerofx": {"auto": True, "memory_budget": "1GiB", "recompute": False}}).auto.fixed == {"recompute"}


def test_keys_the_config_sets_win() -> None:
    """A dimension the config sets is kept: the candidate's config keeps the user's value."""
    fixed = frozenset({"stage", "offload_optimizer"})
    base = {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}, "zerofx": {"auto": True, "memory_budget": 1}}
    from zerofx.planner.autoplan import Candidate

    out = candidate_config(parse_config(base), Candidate(3, 1, 2, "none", "off", 1, 1, "auto"), world_size=2, global_batch=2,
                           fixed=fixed).to_config_dict()
    assert out["zero_optimization"] == {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    assert "auto" not in out["zerofx"] and out["zerofx"]["recompute"] == "auto"
    kept = candidate_config(parse_config({**base, "zerofx": {**base["zerofx"], "recompute": True}}),
                            Candidate(3, 1, 2, "none", "off", 1, 1, "config"), world_size=2, global_batch=2,
                            fixed=fixed | {"recompute"}).to_config_dict()
    assert kept["zerofx"]["recompute"] is True


def test_auto_at_initialize_applies_the_choice_once() -> None:
    """Two gloo ranks: rank 0 searches, prints the choice once, and both ranks train with it.
    Rank 0 searches in a child (NOTE [Rank 0 searches in a child]): its resident high-water mark
    rises over initialize and two steps as rank 1's does, which never searches (searching in
    its own process, rank 0's rose 22 MiB more). Fresh ranks: a pooled rank reuses the memory
    earlier tests freed."""
    config = {"zerofx": {"auto": True, "memory_budget": "1GiB", "tiling": {"enabled": False}}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    first, second = run_ranks(2, auto_initialize, config, fresh=True)
    assert first["printed"].count("zerofx auto: chose ") == 1 and second["printed"] == ""
    assert first["stage"] == second["stage"] and first["raw"] == second["raw"]
    assert not first["auto"] and "auto" not in first["raw"].get("zerofx", {})
    assert f"stage {first['stage']}," in first["printed"]
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in (first, second))
    assert first["peak_growth_bytes"] < second["peak_growth_bytes"] + 8 * 2**20, (first["peak_growth_bytes"], second["peak_growth_bytes"])


def test_a_margin_survives_folding(capsys: pytest.CaptureFixture[str]) -> None:
    """The cut models of a folded plan are planned without the budget, and so without its margin
    (a margin alone is refused): folded ``zerofx plan`` and the folded search both take --margin."""
    argv = ["plan", "small", "--world-size", "2", "--seq-len", "64", "--budget", "1GiB", "--margin", "0.1", "--fold", "on"]
    assert main([*argv, "--stage", "3"]) == 0
    assert "budget 922 MiB: fits" in capsys.readouterr().out
    assert main([*argv, "--auto", "--stage", "3"]) == 0
    out = capsys.readouterr().out
    assert "budget 922 MiB (1 GiB less a 10% margin) per rank" in out and "chosen: stage 3" in out


TILINGS = SearchSpace(stages=(1, 3), sequence_parallel=(1,), shard_group_sizes=None, offloads=("none",), tilings=("off", "auto"),
                      recomputes=("off",), micro_batch=1, accumulation=1)


def test_a_winner_not_captured_from_its_own_config_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """An auto-tiled winner planned from another candidate's capture is captured again from its
    own config; one still planned from another capture once the search stops capturing again is
    reported with the caveat (NOTE [Budgets of the cut models])."""
    loose = _search(512, 1e9, TILINGS)
    untiled = next(e.peak_bytes for e in loose.ranked if e.candidate.stage == 3 and e.candidate.tiling == "off")
    checked = _search(512, 0.8 * untiled, TILINGS)
    assert checked.chosen is not None and checked.chosen.candidate.tiling == "auto" and checked.unchecked == ""
    assert "not captured" not in checked.summary()
    monkeypatch.setattr(autoplan, "MAX_RECAPTURES", 0)
    unchecked = _search(512, 0.8 * untiled, TILINGS)
    assert unchecked.chosen is not None and unchecked.chosen.candidate.tiling == "auto"
    assert unchecked.unchecked.startswith("not captured from its own config")
    assert unchecked.unchecked in unchecked.summary()
    assert f"note: {unchecked.unchecked}" in format_auto_plan(unchecked, label="tiny")


def test_a_folded_candidate_planned_whole_says_so_before_it_starts() -> None:
    """The whole model's plan is the longest step of a folded search: the progress says it is
    under way before it starts, and the candidate's figures are the whole model's."""
    from zerofx.planner.autoplan import Candidate, _Search
    from zerofx.models import DNADecoderLM
    from zerofx.models.sizes import DNALMConfig

    with torch.device("meta"):
        model = DNADecoderLM(DNALMConfig(dim=64, num_layers=4, num_heads=4, ffn_dim=172, max_seq_len=256))
    ids = torch.zeros(1, 64, dtype=torch.long, device="meta")
    one_bucket_per_block = sum(p.numel() for p in model.blocks[0].parameters()) + 1
    base = {"zero_optimization": {"stage3_prefetch_bucket_size": one_bucket_per_block}, "zerofx": {"prefetch_distance": 3}}
    said: list[str] = []
    folded = _Search(model, resize_inputs((ids,), {"labels": ids}), parse_config(base), world_size=4, seq_len=64, global_batch=4, budget_bytes=1e9,
                     fixed=frozenset(), loss_fn=None, fold="on", progress=said.append)
    candidate = Candidate(3, 1, 4, "none", "off", 1, 1)
    evaluated = folded.evaluate(candidate)
    whole = next(i for i, line in enumerate(said) if "planning all 4 blocks, its cut models do not extrapolate" in line)
    assert whole < len(said) - 1 and candidate.label() in said[whole] and f"peak {format_bytes(evaluated.peak_bytes)} (best so far" in said[-1]


def test_a_folded_search_pins_one_tiling_for_every_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [One tiling for every cut]: a folded capture group's tiling is written into its config
    (every kind on or off, one block size), so both cuts tile their blocks alike and fold, no
    candidate is planned whole, and the config plans the whole model to the folded figures.
    ``"auto"`` pins the least tiled setting whose folded timeline fits, or, when none does, one
    of those needing the least."""
    from zerofx.planner import folded_tiling
    from zerofx.planner.autoplan import Candidate, _Search
    from zerofx.compiler.pipeline import StepCapture
    from zerofx.compiler.program import compile, resolve
    from zerofx.models import DNADecoderLM
    from zerofx.models.sizes import DNALMConfig

    with torch.device("meta"):
        model = DNADecoderLM(DNALMConfig(dim=32, num_layers=4, num_heads=4, ffn_dim=88, max_seq_len=1024))
    ids = torch.zeros(1, 128, dtype=torch.long, device="meta")
    fits: list[list[tuple[object, float, float]]] = []

    def recorded(rungs, transient_of, budget):
        chosen, tried = folded_tiling.fit_pinned(rungs, transient_of, budget)
        fits.append([(r, t, budget) for r, t in tried])
        return chosen, tried

    monkeypatch.setattr(autoplan, "fit_pinned", recorded)
    # ``true``'s pin against the whole model's planner: tests/test_planning.py (the CLI's fold).
    for tiling, budget in (("auto", 1e9), ("auto", 1.0)):
        said: list[str] = []
        s = _Search(model, resize_inputs((ids,), {"labels": ids}), parse_config({"zerofx": {"memory_budget": budget}}), world_size=2, seq_len=128,
                    global_batch=2, budget_bytes=budget, fixed=frozenset(), loss_fn=None, fold="on", progress=said.append)
        c = Candidate(3, 1, 2, "none", tiling, 1, 1)
        e = s.evaluate(c)
        config = s.config(c)
        assert config.tiling is not None and config.tiling.enabled is True and isinstance(config.tiling.block_size, int)
        assert e.tiling and e.tiling in e.label()
        assert not any("planning all" in line for line in said)  # the cuts folded
        whole = compile(model, world_size=2, config=config, example_inputs=(ids,), example_kwargs={"labels": ids})
        measured = s.measure(c, whole, whole.report(0), resolve(config, stage=None, world_size=2))
        assert e.peak_bytes == measured.peak_bytes and e.model_state_bytes == measured.model_state_bytes
        assert e.step_s == pytest.approx(measured.step_s, rel=1e-6)
        tried = fits.pop()
        rungs = folded_tiling.ladder(folded_tiling.whole_estimates(
            lambda n, options, s=s: StepCapture(s.cut(n), (ids,), {"labels": ids}).tiling_plan(options), (2, 3), 4))
        assert len(rungs) > 1 and len(tried) <= len(rungs).bit_length()
        if budget == 1e9:  # the least tiled fits
            assert tried[0][0] == rungs[0] and tried[0][1] <= tried[0][2] and e.tiling == rungs[0].describe()
        else:  # nothing fits: among those needing the least, the least tiled
            assert all(t > b for _, t, b in tried)
            least = min(t for _, t, _ in tried)
            assert e.tiling == next(r for r, t, _ in tried if t <= least * 1.01).describe()


def test_a_folded_search_skips_tiling_on_where_auto_tried_it_for_nothing() -> None:
    """NOTE [How the whole-job search prunes]: folded, tiling ``true`` is not searched where
    ``"auto"`` at the same micro-batch and sequence-parallel size tried its pinned tiling and it
    needed no less memory than the less tiled one ``"auto"`` kept."""
    from zerofx.planner.autoplan import Candidate, _Search
    from zerofx.planner.folded_tiling import PinnedTiling

    s = _Search(build_model("small", device="meta"), resize_inputs((torch.zeros(1, 64, dtype=torch.long, device="meta"),), {}), parse_config({}),
                world_size=2, seq_len=64, global_batch=2, budget_bytes=1e9, fixed=frozenset(), loss_fn=None, fold="on")
    on = Candidate(3, 1, 2, "none", "on", 1, 1)
    auto = replace(on, tiling="auto")
    kept, every = PinnedTiling(("region",), 512), PinnedTiling(("attention", "region", "loss"), 256)
    s.pinned.update({auto.capture_group: kept, on.capture_group: every})
    for tried, skipped in (({kept: 100.0, every: 100.0}, True), ({kept: 100.0, every: 98.0}, False), ({kept: 100.0}, False)):
        s.tiling_tried[auto.capture_group] = tried
        why = s.needless_tiling(on)
        assert bool(why) is skipped and (not skipped or every.describe() in why)
    assert s.needless_tiling(auto) == "" and s.needless_tiling(replace(on, micro_batch=2)) == ""
