"""The engine on CUDA with NCCL, one rank: stages 0-3 against plain PyTorch on the same GPU,
bf16, a model built on the meta device, a Hugging Face Llama, and Inductor-compiled rank graphs.
Runs only where a CUDA device exists (``python -m pytest -q tests/test_cuda.py`` on a GPU
machine); the gloo tests cover the same code on the CPU with more ranks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import zerofx
from tests.support.dist_utils import free_port
from tests.support.models import BUILDERS, VOCAB, batches, loss_of, make_optimizer

SGD = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def nccl() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _reference(kind: str, steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = BUILDERS[kind]().cuda()
    optim = make_optimizer(SGD, list(model.parameters()))
    data = batches(1, steps, VOCAB[kind]).cuda()
    for step in range(steps):
        optim.zero_grad()
        loss_of(model, data[step, 0]).backward()
        optim.step()
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def _zerofx(kind: str, steps: int, config: dict) -> tuple[dict[str, torch.Tensor], zerofx.Engine]:
    torch.manual_seed(0)
    model = BUILDERS[kind]().cuda()
    data = batches(1, steps, VOCAB[kind]).cuda()
    engine = zerofx.initialize(model, {"optimizer": SGD, **config}, example_inputs=(data[0, 0],), example_kwargs={"labels": data[0, 0]})
    for step in range(steps):
        loss = engine(data[step, 0], labels=data[step, 0])
        assert loss.is_cuda
        engine.backward(loss)
        engine.step()
    return {k: v.detach().float().cpu() for k, v in engine.full_state_dict().items()}, engine


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("kind", ["dna", "llama"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_cuda_nccl_stages_match_plain_pytorch(nccl: None, kind: str, stage: int) -> None:
    expected = _reference(kind, 3)
    state, engine = _zerofx(kind, 3, {"zero_optimization": {"stage": stage}})
    assert engine.device.type == "cuda"
    assert _max_diff(state, expected) < 1e-5
    assert engine.memory() == engine.program.memory(0)


def test_cuda_bf16_and_inductor(nccl: None) -> None:
    expected = _reference("dna", 3)
    bf16, _ = _zerofx("dna", 3, {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})
    assert _max_diff(bf16, expected) < 5e-2  # bf16 compute, fp32 masters
    compiled, engine = _zerofx("dna", 3, {"zero_optimization": {"stage": 3}, "zerofx": {"compile": "inductor"}})
    assert _max_diff(compiled, expected) < 1e-4 and engine.compile_s > 0


def test_cuda_meta_built_model_keeps_only_its_shard(nccl: None) -> None:
    from zerofx.models import DNA_LM_SIZES, DNADecoderLM

    with torch.device("meta"):
        model = DNADecoderLM(DNA_LM_SIZES["tiny"])
    ids = torch.randint(0, 5, (2, 64), device="cuda")
    engine = zerofx.initialize(model, {"zero_optimization": {"stage": 3}, "optimizer": SGD}, example_inputs=(ids,),
                               example_kwargs={"labels": ids}, init_seed=0)
    assert engine.device.type == "cuda" and all(t.is_cuda for t in engine.storage.shards.values())
    losses = []
    for _ in range(3):
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
