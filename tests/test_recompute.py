"""Selective activation recompute (NOTE [Selective activation recompute], NOTE [Recompute under
a memory budget]): what the planner picks, what the lowered graphs then save and recompute, the
budget search, the config, and bitwise parity with no recompute through the engine on 2 gloo
ranks, on the bundled DNA LM and on Hugging Face Llama."""

from __future__ import annotations

import functools

import pytest
import torch

import zerofx
from tests.support.dist_utils import run_ranks
from tests.support.models import TINY
from tests.support.programs import _captured
from tests.support.recompute_workers import striped_sequence_parallel, with_and_without
from zerofx.common.errors import ConfigError
from zerofx.compiler import pipeline
from zerofx.config import parse_config
from zerofx.cost_models.compute import CPU_CORE
from zerofx.passes.memory import plan_recompute
from zerofx.passes.memory.plan_recompute import recompute_candidates, spine_values

aten = torch.ops.aten


def _saved_bytes(program) -> int:
    """Activation bytes the lowered forward hands to backward (parameters aside)."""
    fw = program.graph_modules(0)["forward"]
    out = next(n for n in fw.graph.nodes if n.op == "output").args[0]
    vals = [a.meta.get("val") for a in out[1:] if a.op != "placeholder"]
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def _backward_count(program, target) -> int:
    return len(program.graph_modules(0)["backward"].graph.find_nodes(op="call_function", target=target))


@functools.cache
def _replanned(stage: int, own: tuple) -> zerofx.Program:
    """The tiny DNA LM's one capture planned again at ``stage`` on 2 ranks with ``zerofx`` keys ``own``."""
    return _captured(TINY, True).replan({"zero_optimization": {"stage": stage}, "zerofx": dict(own)}, world_size=2)


def _programs(stage: int, **own: object):
    """Without recompute, and with the ``zerofx`` keys ``own``."""
    return _replanned(stage, ()), _replanned(stage, tuple(sorted(own.items())))


def test_candidates_are_ranked_by_bytes_per_second_and_exclude_what_cannot_be_rebuilt() -> None:
    joint = _captured(TINY, True).captured.joint
    candidates, saved = recompute_candidates(joint, CPU_CORE)
    first = [c for c in candidates if c.round == 1]
    assert first and saved >= sum(c.bytes for c in first)
    # Later rounds follow the first (NOTE [Recompute in rounds]), each ranked on its own.
    rounds = [c.round for c in candidates]
    assert rounds == sorted(rounds) and rounds[-1] > 1
    for r in set(rounds):
        ratios = [c.bytes_per_s for c in candidates if c.round == r]
        assert ratios == sorted(ratios, reverse=True)
    by_name = {n.name: n for n in joint.graph.nodes}
    for c in candidates:
        for name in c.tagged:
            node = by_name[name]
            assert node.op == "call_function" and node.meta.get("recompute") is None
            assert getattr(node.target, "namespace", "aten") == "aten"
    # The residual stream is the spine: never a candidate (NOTE [The spine stays saved]).
    spine = spine_values(joint.graph)
    assert sum(n.target is aten.add.Tensor for n in spine) >= 2 * TINY.num_layers
    assert not spine & {by_name[name] for c in candidates for name in c.tagged}
    # Matrix products are among them (the partitioner saves them; recompute is the only way to drop them).
    assert any(by_name[c.name].target is aten.mm.default for c in candidates)


@pytest.mark.parametrize("stage", [0, 3])
def test_recompute_all_saves_less_and_recomputes_the_products_in_backward(stage: int) -> None:
    plain, recomputed = _programs(stage, recompute=True)
    plan = recomputed.plan.recompute
    assert plain.plan.recompute is None and plan is not None and plan.mode == "all"
    assert len(plan.activations) == plan.candidates > 0
    assert _saved_bytes(recomputed) < 0.75 * _saved_bytes(plain), (_saved_bytes(recomputed), _saved_bytes(plain))
    assert _backward_count(recomputed, aten.mm.default) > _backward_count(plain, aten.mm.default)
    # The step's predicted compute grows by the recompute; the plan says what is recomputed.
    assert recomputed.report(0).compute_s["backward"] > plain.report(0).compute_s["backward"]
    assert recomputed.plan.fingerprint() != plain.plan.fingerprint()
    text = str(recomputed.plan)
    assert "recompute (all): " in text and "recomputed" in text and "held saved" in text
    # The report says what the lowered forward saves, and recomputing everything lowers the peak.
    assert 0 < recomputed.report(0).saved_bytes < plain.report(0).saved_bytes
    assert recomputed.report(0).peak.live_bytes <= plain.report(0).peak.live_bytes


def test_later_rounds_save_less_than_the_first_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Recomputing the first round's candidates makes the partitioner save what rebuilds them; the
    later rounds recompute those too, and the spine keeps the backward peak from rising (NOTE
    [Recompute in rounds], NOTE [The spine stays saved])."""
    _, every = _programs(3, recompute=True)
    monkeypatch.setattr(plan_recompute, "RECOMPUTE_ROUNDS", 1)
    first_only = _captured(TINY, True).replan({"zero_optimization": {"stage": 3}, "zerofx": {"recompute": True}}, world_size=2)
    assert every.plan.recompute.rounds > 1 and first_only.plan.recompute.rounds == 1
    assert every.report(0).saved_bytes < first_only.report(0).saved_bytes
    assert every.report(0).peak.live_bytes < first_only.report(0).peak.live_bytes


def test_the_candidates_are_found_once_per_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans of one capture share its recompute candidates (NOTE [Recompute candidates once per
    capture]); another capture, or another device profile, finds its own."""
    calls: list[str] = []
    found = pipeline.recompute_candidates

    def counted(joint, device, **kwargs):
        calls.append(device.name)
        return found(joint, device, **kwargs)

    monkeypatch.setattr(pipeline, "recompute_candidates", counted)
    captured = _captured.__wrapped__(TINY, False)  # a capture of its own, not the cached one
    plans = [captured.replan({"zero_optimization": {"stage": stage}, "zerofx": {"recompute": True}}, world_size=2) for stage in (1, 2, 3)]
    assert len(calls) == 1
    assert plans[0].plan.recompute.activations == plans[2].plan.recompute.activations
    captured.replan({"zero_optimization": {"stage": 2}, "zerofx": {"recompute": True, "profile": "h100"}}, world_size=2)
    assert len(calls) == 2 and calls[0] != calls[1]
    _captured.__wrapped__(TINY, False).replan({"zero_optimization": {"stage": 2}, "zerofx": {"recompute": True}}, world_size=2)
    assert len(calls) == 3


def test_auto_keeps_the_partition_when_the_budget_fits() -> None:
    plain, auto = _programs(0, recompute="auto", memory_budget="1GiB")
    assert auto.plan.recompute is None and not any("recompute" in d for d in auto.plan.decisions)
    assert _saved_bytes(auto) == _saved_bytes(plain)


def test_auto_recomputes_the_fewest_that_fit_a_tighter_budget() -> None:
    # Stage 1: at stage 0 the tiny model's peak is its full gradients late in backward, where no
    # saved activation is alive and recompute changes nothing; at stage 3 a lower prefetch
    # distance fits such a budget first.
    plain, every = _programs(1, recompute=True)
    low, high = every.report(0).peak.live_bytes, plain.report(0).peak.live_bytes
    assert low < high
    budget = (low + high) // 2
    _, auto = _programs(1, recompute="auto", memory_budget=budget)
    plan = auto.plan.recompute
    assert plan is not None and 0 < len(plan.activations) < plan.candidates
    assert auto.report(0).peak.live_bytes <= budget
    decision = next(d for d in auto.plan.decisions if d.startswith("recompute (auto)"))
    assert f"kept {len(plan.activations)}, which fit" in decision
    # The fewest: one fewer of the ranked candidates is over the budget (or none, at zero).
    count = len(plan.activations)
    tried = {int(part.rsplit(" with ", 1)[1]): part for part in decision.split(": estimated peak ")[1].split(" of ")[0].split(", ")}
    assert count - 1 in tried or count == 1
    # A budget nothing fits keeps every candidate, and says so.
    _, tight = _programs(1, recompute="auto", memory_budget=1000)
    assert len(tight.plan.recompute.activations) == tight.plan.recompute.candidates
    assert any("which do not fit" in d for d in tight.plan.decisions)


def test_config() -> None:
    with pytest.raises(ConfigError, match=r"'zerofx.recompute' is \"auto\" but 'zerofx.memory_budget' is missing"):
        parse_config({"zerofx": {"recompute": "auto"}})
    with pytest.raises(ConfigError, match=r"zerofx.recompute.*true, false or \"auto\""):
        parse_config({"zerofx": {"recompute": "yes"}})
    assert parse_config({"zerofx": {"recompute": True}}).schedule.recompute == "all"
    assert parse_config({}).schedule.recompute == "off"


@pytest.mark.multiprocess
def test_engine_parity_is_bitwise_on_the_dna_lm_hf_llama_and_striped_hyena_sequence_parallel() -> None:
    """fp32, 2 gloo ranks, two Adam steps: recomputing every candidate gives the same losses and
    the same parameters, bit for bit (the same ops on the same inputs)."""
    variants = {"off": {}, "all": {"recompute": True}}
    for kind, stage in (("dna", 3), ("llama", 2)):
        results = run_ranks(2, with_and_without, kind, stage, variants)
        for res in results:
            off, every = res["off"], res["all"]
            assert not off["recomputed"] and len(every["recomputed"]) > 4, (kind, every["recomputed"])
            assert every["losses"] == off["losses"], kind
            for key, value in off["state"].items():
                assert torch.equal(every["state"][key], value), (kind, key)
            assert every["peak"] < off["peak"], kind
    # Sequence parallel: StripedHyena's halo exchanges and all-to-alls are not recomputed; the rest
    # of what it saves may be, with the same result.
    for res in run_ranks(2, striped_sequence_parallel, variants):
        off, every = res["off"], res["all"]
        assert len(every["recomputed"]) > 4 and every["losses"] == off["losses"]
        for key, value in off["state"].items():
            assert torch.equal(every["state"][key], value), key
