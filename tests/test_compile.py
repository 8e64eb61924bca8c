"""``"zerofx": {"compile": "inductor"}``: each rank's forward and backward graphs (functional
collectives included) compiled by TorchInductor train like the FX graphs run op by op. And
``zerofx.compile`` without example inputs: the plan from the parameters' shapes, the graphs
captured from the first example inputs given."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import zerofx
from tests.support.dist_utils import run_ranks
from tests.support.meta_workers import eager_vs_inductor, inductor_cache_hits
from tests.support.models import BATCH, SEQ, dna_lm
from zerofx.models import DNA_LM_SIZES, DNADecoderLM

# Inductor fuses elementwise chains and reductions (RMSNorm, softmax, SwiGLU), which reorders
# fp32 sums: ulp-level differences, grown over 3 SGD steps at lr 0.1 to about 1e-6 here. A
# gradient averaged twice or not at all moves parameters by ~1e-2 per step on this model.
TOL = 2e-5
# Two blocks of the tiny LM: every op kind the compiled graphs hold (embedding, RMSNorm, rotary
# attention, SwiGLU, the tied head, each parameter's gather and reduce-scatter), and the block
# boundary where the collectives inserted after partitioning split the backward marks into runs
# (NOTE [Spent partitioner tags]): with one block Inductor took the graph even with the tags.
# Inductor's compile time grows with the graph; a third block only repeats the second.
TWO_BLOCKS = dataclasses.replace(DNA_LM_SIZES["tiny"], num_layers=2)


@pytest.mark.inductor
def test_inductor_graphs_match_fx_graphs_at_two_ranks() -> None:
    for res in run_ranks(2, eager_vs_inductor, TWO_BLOCKS, 3, 3):
        fx_run, compiled = res["none"], res["inductor"]
        assert fx_run["compiled"] == [] and fx_run["compile_s"] == 0
        assert compiled["compiled"] == ["backward", "forward"] and compiled["compile_s"] > 0
        assert compiled["losses"] == pytest.approx(fx_run["losses"], abs=TOL)
        for key, value in fx_run["state"].items():
            torch.testing.assert_close(compiled["state"][key], value, atol=TOL, rtol=0, msg=key)
        assert fx_run["losses"][-1] < fx_run["losses"][0]
        # NOTE [Inductor keeps the planned order]: the compiled graphs issue every collective and
        # wait where the FX graphs do (Inductor's own reordering put each wait right after its
        # collective).
        assert compiled["issued"] == fx_run["issued"] and fx_run["issued"].count("wait_tensor") >= 8


def test_compile_and_fused_optimizer_config_keys() -> None:
    from zerofx.config import parse_config
    from zerofx.config.options import GraphCompiler
    from zerofx.runtime.optimizer_step import build_optimizer
    from zerofx.common.errors import ConfigError

    cfg = parse_config({"zerofx": {"compile": "inductor", "fused_optimizer": True}})
    assert cfg.graph_compiler is GraphCompiler.INDUCTOR and cfg.fused_optimizer
    default = parse_config({})
    assert default.graph_compiler is GraphCompiler.NONE and not default.fused_optimizer
    with pytest.raises(ConfigError, match=r"'zerofx.compile' got 'tvm'; accepted: none, inductor"):
        parse_config({"zerofx": {"compile": "tvm"}})
    params = [torch.zeros(4, requires_grad=True)]
    assert build_optimizer(cfg.optimizer, params, fused=True).defaults["fused"] is True
    assert not build_optimizer(cfg.optimizer, params).defaults.get("fused")
    # SGD has no fused CPU kernel to ask for: the key leaves it alone.
    sgd = parse_config({"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}).optimizer
    assert not build_optimizer(sgd, params, fused=True).defaults.get("fused")


# --------------------------------------------------------------------------- compile without inputs
# NOTE [Capture on first need] in zerofx/compiler/program.py: the plan and memory from the parameters'
# shapes, the graphs from the first example inputs.
def _meta_dna(frozen: bool = True) -> DNADecoderLM:
    with torch.device("meta"):
        return dna_lm(frozen=frozen)


def _inputs() -> dict:
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    return {"example_inputs": (ids,), "example_kwargs": {"labels": ids}}


@pytest.mark.parametrize(
    ("stage", "config"),
    [
        (3, {"zero_optimization": {"stage3_param_persistence_threshold": 100, "stage3_prefetch_bucket_size": 2000}}),
        (2, {"bf16": {"enabled": True}, "zero_optimization": {"reduce_bucket_size": 3000}}),
        (1, {"optimizer": {"type": "SGD", "params": {"lr": 0.1}}}),
    ],
)
def test_the_plan_from_shapes_is_the_plan_from_a_capture(stage: int, config: dict) -> None:
    """The bundled LM uses its parameters in registration order, so the plan from shapes alone
    (NOTE [A plan from shapes alone]) is the capture's plan field for field: placements with a
    frozen norm and the tied head once, persistent parameters, buckets, schedule, bytes."""
    lazy = zerofx.compile(_meta_dna(), world_size=8, stage=stage, config=config)
    captured = zerofx.compile(_meta_dna(), world_size=8, stage=stage, config=config, **_inputs())
    assert lazy.plan.to_json() == captured.plan.to_json()
    assert lazy.memory(rank=7) == captured.memory(rank=7) == dict(captured.plan.estimates)
    assert not lazy.plan.param("blocks.0.attn_norm.weight").requires_grad
    assert "head.weight" not in {p.fqn for p in lazy.plan.params}
    assert len(lazy.plan.reduce_buckets) > 1 and (stage != 3 or lazy.plan.persistent)  # the config's caps and threshold act
    if stage == 2:
        assert {p.dtype for p in lazy.plan.params} == {"torch.bfloat16"}  # as capture traces them


def test_a_meta_model_compiles_without_inputs_and_captures_on_first_need() -> None:
    model = _meta_dna()
    program = zerofx.compile(model, world_size=8, stage=3)
    shapes_plan = program.plan
    assert program.memory(rank=0)["params"] > 0 and shapes_plan.world_size == 8
    for ask in (lambda: program.graph_modules(0), lambda: program.report(0), lambda: program.captured):
        with pytest.raises(zerofx.MissingExampleInputsError, match=r"compiled without example inputs; pass example_inputs.*"
                                                                   r"zerofx.compile, or to program.graph_modules\(rank, example_inputs="):
            ask()
    with pytest.raises(zerofx.ZeroFXError, match="example_inputs is missing"):
        program.graph_modules(0, example_kwargs={"labels": torch.zeros(BATCH, SEQ, dtype=torch.long)})
    gms = program.graph_modules(3, **_inputs())
    assert sorted(gms) == ["backward", "forward"]
    assert program.graph_modules(0)["forward"] is gms["forward"]  # captured once, kept
    assert program.graph_modules(5, **_inputs())["backward"] is gms["backward"]  # the same inputs again: the same graphs
    assert program.plan == shapes_plan  # replaced by the capture's plan, the same for this model
    assert program.report(0).peak.live_bytes > 0
    longer = torch.zeros(BATCH, 2 * SEQ, dtype=torch.long)
    with pytest.raises(zerofx.ZeroFXError, match=r"compiled for shape \(2, 16\).*compile again"):
        program.graph_modules(0, example_inputs=(longer,), example_kwargs={"labels": longer})
    assert all(p.is_meta for p in model.parameters())


@pytest.mark.parametrize(
    ("zerofx_section", "reason"),
    [({"prefetch_distance": 2, "memory_budget": "1KiB"}, "zerofx.memory_budget"), ({"tiling": {"enabled": True}}, "zerofx.tiling")],
)
def test_a_plan_chosen_on_the_memory_timeline_waits_for_the_capture(zerofx_section: dict, reason: str) -> None:
    program = zerofx.compile(_meta_dna(), world_size=4, stage=3, config={"zerofx": zerofx_section})
    with pytest.raises(zerofx.MissingExampleInputsError, match=rf"program.plan \({reason}.*pass example_inputs"):
        program.plan  # noqa: B018  (the property is what raises)
    memory = program.memory(rank=0)  # model state only: known from the shapes
    program.graph_modules(0, **_inputs())
    assert program.memory(rank=0) == memory
    if reason == "zerofx.memory_budget":  # the search ran on the captured timeline
        assert program.plan.prefetch_distance == 0 and "lowered from 2 to 0" in program.plan.decisions[0]
    else:
        assert program.plan.tiling is not None and program.plan.tiling.ops


class _OutOfOrder(nn.Module):
    """Registers its output layer first and uses it last."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(24, 1)
        self.body = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x).relu()).sum()


def test_the_capture_orders_buckets_by_first_use() -> None:
    """The shapes plan orders by registration; the capture's plan, which replaces it, by first
    use, over the same placements and bytes (NOTE [A plan from shapes alone])."""
    config = {"zero_optimization": {"stage3_prefetch_bucket_size": 1}}  # a bucket per parameter
    program = zerofx.compile(_OutOfOrder(), world_size=2, stage=3, config=config)
    shapes = program.plan
    program.graph_modules(0, example_inputs=(torch.ones(4, 8),))
    assert shapes.params == program.plan.params and shapes.estimates == program.plan.estimates
    assert shapes.gather_order == ("head.weight", "head.bias", "body.weight", "body.bias")
    assert program.plan.gather_order == ("body.weight", "body.bias", "head.weight", "head.bias")


def test_inductor_is_handed_graphs_without_the_partitioners_spent_tags() -> None:
    """NOTE [Spent partitioner tags]: the copy Inductor compiles has no recompute tag or backward
    mark, computes what the rank graph computes, and the rank graph keeps its tags."""
    from tests.support.programs import meta_program
    from zerofx.passes import _compat

    program = meta_program(3, 2, TWO_BLOCKS, own={"recompute": True})
    for name, gm in program.graph_modules(0).items():
        if name not in ("forward", "backward"):
            continue
        tags = lambda g: {t for n in g.graph.nodes for t in _compat.SPENT_PARTITIONER_TAGS if t in n.meta}  # noqa: E731
        before = [(n.name, n.target, n.args) for n in gm.graph.nodes]
        had = tags(gm)
        copy = _compat.without_partitioner_tags(gm)
        assert tags(copy) == set() and tags(gm) == had
        assert [(n.name, n.target, str(n.args)) for n in copy.graph.nodes] == [(a, t, str(b)) for a, t, b in before]
        assert copy.code == gm.code
        if name == "backward":
            assert "autograd_backward" in had, "the backward graph should carry AOTAutograd's marks"


@pytest.mark.inductor
def test_inductor_graphs_are_called_boxed() -> None:
    """NOTE [Inductor's graphs are called boxed]: the compiled graph is called through
    AOTAutograd's boxed wrapper, which empties the caller's list, so each input can be freed after
    its last use; the result equals the graph's."""
    from zerofx.passes import _compat

    def step(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
        return ((a * 2).sum() + (b * 3).sum(),)

    a, b = torch.randn(64), torch.randn(64)
    gm = _compat.make_fx(step)(a, b)
    compiled = _compat.inductor_compile(gm, [a, b])
    assert not getattr(compiled, "unboxed", False), "torch's wrappers changed: the compiled graphs hold their inputs to the end"
    args = [a.clone(), b.clone()]
    (out,) = compiled(args)
    assert args == []
    torch.testing.assert_close(out, step(a, b)[0])


@pytest.mark.inductor
def test_inductor_compiles_from_its_cache_fakes_and_real_tensors_alike(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NOTE [Inductor's cache needs a shape environment]: a graph compiled once is a cache hit
    the second time, whether compiled from real tensors or from fakes of their shapes."""
    from torch._dynamo.utils import counters

    from zerofx.passes import _compat

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def step(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
        return ((a.sin() * 2).sum() + (b * 3).cos().sum(),)

    a, b = torch.randn(64), torch.randn(64)
    gm = _compat.make_fx(step)(a, b)
    counters.clear()
    with _compat.FakeTensorMode() as other_mode:  # fakes of another mode, as the capture's are
        fakes = [other_mode.from_tensor(a), other_mode.from_tensor(b)]
    _compat.inductor_compile(gm, fakes)
    assert counters["inductor"]["fxgraph_cache_miss"] == 1 and counters["inductor"]["fxgraph_cache_hit"] == 0
    compiled = _compat.inductor_compile(gm, [a, b])
    assert counters["inductor"]["fxgraph_cache_hit"] == 1, dict(counters["inductor"])
    (out,) = compiled([a.clone(), b.clone()])
    torch.testing.assert_close(out, step(a, b)[0])


def test_strides_of_dimensions_of_size_1_key_the_cache_as_a_contiguous_tensors() -> None:
    """NOTE [Inductor's cache needs a shape environment]: a saved value's fake (an expand: stride 0
    in its dimension of size 1) and its real tensor (contiguous) key Inductor's cache alike; every
    other stride is kept."""
    from zerofx.passes import _compat

    fake_like = torch.empty_strided((2, 1, 32, 4), (128, 0, 4, 1))
    real = torch.empty(2, 1, 32, 4)
    assert _compat.cache_strides(fake_like) == _compat.cache_strides(real) == real.stride() == (128, 128, 4, 1)
    assert _compat.cache_strides(torch.empty(4, 32).t()) == (1, 32)
    assert _compat.cache_strides(torch.empty_strided((3, 1, 1), (1, 5, 9))) == (1, 1, 1)


@pytest.mark.inductor
def test_a_rank_compiles_its_graphs_from_what_a_child_compiled(tmp_path: Path) -> None:
    """NOTE [Inductor compiles first in a child]: into an empty cache, a rank's forward and backward
    compiles are both hits, the child having compiled them first."""
    for res in run_ranks(2, inductor_cache_hits, TWO_BLOCKS, str(tmp_path)):
        assert res["compiled"] == ["backward", "forward"] and res["warmed"]
        assert res["counters"].get("fxgraph_cache_hit") == 2 and not res["counters"].get("fxgraph_cache_miss"), res["counters"]
