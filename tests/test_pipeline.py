"""The compile spine (zerofx/compiler/pipeline.py): the stages in order, the runner's errors and
switches, and the plan stage's candidates built through one callback."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from zerofx.common.errors import CompileStageError, ZeroFXError
from zerofx.compiler import pipeline
from zerofx.compiler.pipeline import STAGES, capture_step, plan_step, run_passes, run_stage
from zerofx.config import parse_config
from zerofx.config.compile_options import compile_options

DOCS = Path(__file__).resolve().parents[1] / "docs" / "design.md"


def test_the_docs_table_lists_the_stages_in_the_spines_order() -> None:
    text = DOCS.read_text()
    table = text[text.index("## The compile spine"):text.index("## Capture")]
    rows = re.findall(r"^\| ([a-z_]+) \|", table, flags=re.M)
    assert tuple(rows[1:]) == STAGES  # after the header row


def test_a_failure_names_its_stage_and_those_before_it() -> None:
    def broken() -> None:
        raise RuntimeError("boom")

    with pytest.raises(CompileStageError, match=r"compile stage plan failed \(after \['capture', 'autograd'\]\): RuntimeError: boom"):
        run_stage("plan", broken, done=("capture", "autograd"))
    with pytest.raises(ZeroFXError, match="named already") as info:
        run_stage("joint", lambda: (_ for _ in ()).throw(ZeroFXError("named already")))
    assert type(info.value) is ZeroFXError  # a user error passes through as it is


def test_passes_run_in_order_are_linted_and_can_be_disabled() -> None:
    gm = fx.symbolic_trace(nn.ReLU())
    seen: list[str] = []

    def record(name: str):
        def run(g: fx.GraphModule) -> fx.GraphModule:
            seen.append(name)
            return g
        return run

    run_passes(gm, [("a", record("a")), ("b", record("b")), ("c", record("c"))], disabled=("b",))
    assert seen == ["a", "c"]
    with pytest.raises(CompileStageError, match=r"pass bad failed \(after \['a'\]\)"):
        run_passes(gm, [("a", record("a")), ("bad", lambda g: 1 / 0)])


def test_the_plan_stage_builds_every_candidate_through_the_callback() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(4, 8)
    captured = capture_step(model, (x,), loss_fn=lambda out: out.sum())
    cfg = parse_config({"zero_optimization": {"stage": 3}}, world_size=2)
    made = []

    class Candidate:
        def __init__(self, plan):
            self.plan, self.setup_times = plan, {}

        def with_decision(self, why: str) -> Candidate:
            return self

    def make(c, plan):
        assert c is captured
        made.append(plan)
        return Candidate(plan)

    chosen = plan_step(captured, cfg, compile_options(cfg, 2), make)
    assert made and chosen.plan is made[-1] and chosen.plan.world_size == 2

    def broken(c, plan):
        raise RuntimeError("no candidate")

    with pytest.raises(CompileStageError, match="compile stage plan failed"):
        plan_step(captured, cfg, compile_options(cfg, 2), broken)
    assert pipeline.STAGES.index("plan") == pipeline.STAGES.index("autograd") + 1
