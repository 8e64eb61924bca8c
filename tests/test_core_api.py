"""The public API's contract: capture of real model code, loss extraction, and clear errors for
bad input. Planning only: no process group."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import zerofx
from zerofx.passes import meta
from tests.support.models import BATCH, SEQ, TINY, llama
from zerofx.models import DNADecoderLM

IDS = torch.zeros(BATCH, SEQ, dtype=torch.long)


def dna() -> DNADecoderLM:
    with torch.device("meta"):
        return DNADecoderLM(TINY)


def test_huggingface_llama_captures_and_plans() -> None:
    """HF's Llama: keyword arguments, a ModelOutput data class, tied weights, rotary buffers.
    torch.fx.symbolic_trace cannot trace it; zerofx captures it whole."""
    model = llama()
    # ValueError: fx cannot patch forward's **kwargs ("co_varnames is too small"); fx's TraceError
    # (data-dependent control flow) is a ValueError too.
    with pytest.raises(ValueError):
        torch.fx.symbolic_trace(model)
    program = zerofx.compile(model, world_size=8, stage=3, example_inputs=(IDS,), example_kwargs={"labels": IDS})
    fqns = {p.fqn for p in program.plan.params}
    assert "model.embed_tokens.weight" in fqns and "lm_head.weight" not in fqns  # tied
    assert program.captured.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    assert any(b.fqn.endswith("inv_freq") for b in program.captured.buffers)
    # Without labels a Hugging Face model returns logits and no loss: the error says to pass labels.
    with pytest.raises(zerofx.CaptureError, match=r"logits but no loss.*pass labels.*example_kwargs"):
        zerofx.compile(model, world_size=8, stage=3, example_inputs=(IDS,))
    fw = program.graph_modules(rank=3)["forward"]
    gathers = [n for n in fw.graph.nodes if meta.is_all_gather(n)]
    assert len(gathers) == len(program.plan.gather_buckets)
    assert {f for g in gathers for f in g.meta[meta.COMM_FQNS]} == fqns


@dataclasses.dataclass
class Out:
    loss: torch.Tensor
    hidden: torch.Tensor


class Styles(nn.Module):
    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0):
        h = self.lin(x) * scale
        loss = h.pow(2).mean()
        return {"scalar": loss, "dict": {"loss": loss, "h": h}, "dataclass": Out(loss, h), "raw": h}[self.style]


@pytest.mark.parametrize("style", ["scalar", "dict", "dataclass"])
def test_loss_found_in_output(style: str) -> None:
    program = zerofx.compile(Styles(style), world_size=2, stage=2, example_inputs=(torch.ones(2, 4),), example_kwargs={"scale": 2.0})
    assert program.plan.reduce_order == ("lin.bias", "lin.weight") or set(program.plan.reduce_order) == {"lin.weight", "lin.bias"}


def test_loss_fn_gets_kwargs_the_model_does_not_take() -> None:
    seen = {}

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen["target"] = target.shape
        return (out - target).pow(2).mean()

    program = zerofx.compile(
        Styles("raw"), world_size=2, stage=1, example_inputs=(torch.ones(2, 4),),
        example_kwargs={"target": torch.zeros(2, 3)}, loss_fn=loss_fn,
    )
    assert seen["target"] == (2, 3)
    assert program.captured.inputs[-1].shape == (2, 3)


def test_no_loss_is_a_clear_error() -> None:
    with pytest.raises(zerofx.CaptureError, match="cannot find the loss.*loss_fn="):
        zerofx.compile(Styles("raw"), world_size=2, stage=1, example_inputs=(torch.ones(2, 4),))


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:  # Python branch on a tensor's value: a graph break
            h = h * 2
        return h.mean()


class MutatesBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x).pow(2).mean()


def test_uncapturable_models_name_the_reason() -> None:
    with pytest.raises(zerofx.CaptureError, match="depends on a tensor's values"):
        zerofx.compile(DataDependent(), world_size=2, stage=3, example_inputs=(torch.ones(2, 4),))
    with pytest.raises(zerofx.CaptureError, match="mutates its inputs or buffers"):
        zerofx.compile(MutatesBuffer(), world_size=2, stage=3, example_inputs=(torch.ones(2, 4),))
    frozen = Styles("scalar").requires_grad_(False)
    with pytest.raises(zerofx.CaptureError, match="no trainable parameters"):
        zerofx.compile(frozen, world_size=2, stage=3, example_inputs=(torch.ones(2, 4),))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world_size": 2, "stage": 4}, r"stage=4 .*accepted: 0, 1, 2 or 3"),
        ({"world_size": 2, "stage": "3"}, r"stage='3' .*accepted: 0, 1, 2 or 3"),
        ({"world_size": 0, "stage": 3}, r"world_size=0 .*integer in 1\.\.1048576"),
        ({"world_size": 2}, r"no ZeRO stage given"),
        ({"stage": 3}, r"no world size given"),
        ({"world_size": 2, "stage": 3, "config": {"optimizer": {"type": "Lamb"}}}, r"optimizer.type.*'Lamb'.*AdamW, Adam, SGD"),
        ({"world_size": 2, "stage": 3, "config": {"zero_optimisation": {"stage": 3}}}, r"did you mean zero_optimization\?"),
        ({"world_size": 2, "stage": 3, "config": {"zero_optimization": {"stage": 2}}}, r"stage=3 disagrees .*stage=2"),
        ({"world_size": 2, "stage": 3, "config": {"zerofx": {"world_size": 4}}}, r"world_size=2 disagrees"),
        ({"world_size": 2, "stage": 3, "config": {"optimizer": {"type": "SGD", "params": {"lr": "fast"}}}}, r"optimizer.params.lr.*'fast'"),
        ({"world_size": 2, "stage": 3, "config": {"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}}}, r"\['betas'\] do not apply"),
        ({"world_size": 2, "stage": 3, "config": {"train_batch_size": 6, "train_micro_batch_size_per_gpu": 4}}, r"train_batch_size=6"),
        ({"world_size": 2, "stage": 3, "config": "/no/such/ds_config.json"}, r"does not exist"),
    ],
)
def test_bad_input_names_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(zerofx.ZeroFXError, match=message):
        zerofx.compile(dna(), example_inputs=(IDS,), example_kwargs={"labels": IDS}, **kwargs)


def test_missing_example_inputs_and_bad_rank() -> None:
    with pytest.raises(zerofx.ZeroFXError, match="example_inputs is missing"):
        zerofx.compile(dna(), world_size=2, stage=3, example_kwargs={"labels": IDS})
    program = zerofx.compile(dna(), world_size=2, stage=3, example_inputs=(IDS,), example_kwargs={"labels": IDS})
    with pytest.raises(zerofx.ZeroFXError, match=r"rank=2 .*accepted: 0..1"):
        program.graph_modules(rank=2)


def test_config_file_and_unacted_keys_warn(tmp_path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text('{"zero_optimization": {"stage": 2, "contiguous_gradients": true}, "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}')
    zerofx.config._WARNED.discard("zero_optimization.contiguous_gradients")  # warned once per process
    with pytest.warns(UserWarning, match="zero_optimization.contiguous_gradients"):
        program = zerofx.compile(dna(), config=str(path), example_inputs=(IDS,), example_kwargs={"labels": IDS})
    assert program.world_size == 4 and int(program.stage) == 2  # world size implied by the batch sizes


def test_initialize_without_process_group_is_a_clear_error() -> None:
    with pytest.raises(zerofx.ZeroFXError, match="initialized torch.distributed process group"):
        zerofx.initialize(DNADecoderLM(TINY), {"zero_optimization": {"stage": 3}}, example_inputs=(IDS,))
