"""``"zerofx": {"compile": "inductor"}``: each rank's forward and backward graphs (functional
collectives included) compiled by TorchInductor train like the FX graphs run op by op."""

from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_ranks
from tests.meta_workers import eager_vs_inductor

# Inductor fuses elementwise chains and reductions (RMSNorm, softmax, SwiGLU), which reorders
# fp32 sums: ulp-level differences, grown over 3 SGD steps at lr 0.1 to about 1e-6 here. A
# gradient averaged twice or not at all moves parameters by ~1e-2 per step on this model.
TOL = 2e-5


@pytest.mark.inductor
def test_inductor_graphs_match_fx_graphs_at_two_ranks() -> None:
    for res in run_ranks(2, eager_vs_inductor, "tiny", 3, 3):
        fx_run, compiled = res["none"], res["inductor"]
        assert fx_run["compiled"] == [] and fx_run["compile_s"] == 0
        assert compiled["compiled"] == ["backward", "forward"] and compiled["compile_s"] > 0
        assert compiled["losses"] == pytest.approx(fx_run["losses"], abs=TOL)
        for key, value in fx_run["state"].items():
            torch.testing.assert_close(compiled["state"][key], value, atol=TOL, rtol=0, msg=key)
        assert fx_run["losses"][-1] < fx_run["losses"][0]


def test_compile_and_fused_optimizer_config_keys() -> None:
    from zerofx.config import GraphCompiler, parse_config
    from zerofx.engine import build_optimizer
    from zerofx.errors import ConfigError

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
