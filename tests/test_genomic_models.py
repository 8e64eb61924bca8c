"""The long-context genomic models (zerofx/models/hyena.py, striped_hyena.py, mamba.py; docs/models.md):
causality, the FFT convolution and the chunked scan against their direct forms, BiMamba's two
directions, capture on the meta device, the init scheme, 2-rank stage-3 parity with plain
PyTorch, and the command line's sizes."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import zerofx
from tests.support.dist_utils import run_ranks
from tests.support.genomic_workers import reference, train_stage3
from zerofx.app.cli import main
from zerofx.app.training import Objective, TrainOptions, check_train_options, vocabulary_size
from zerofx.app.training import build_model as build_train_model
from zerofx.common.errors import UsageError
from zerofx.compiler.materialize import init_weights_, iter_initial_state
from zerofx.models import MODEL_SIZES, MambaConfig, build_model, model_config
from zerofx.models.genomic_sizes import parse_block_pattern
from zerofx.models.long_conv import causal_depthwise_conv, fft_causal_conv
from zerofx.models.mamba import MambaMixer
from zerofx.models.scan import selective_scan, selective_scan_with_state

ROOT = Path(__file__).resolve().parents[1]
CAUSAL = ["hyena-tiny", "striped-tiny", "mamba-tiny"]
TINY = [*CAUSAL, "bimamba-tiny"]
SEQ = 40  # longer than mamba-tiny's chunk (8) and striped-tiny's MR filter (16), not a multiple of either


def _ids(seed: int, seq_len: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 5, (2, seq_len), generator=torch.Generator().manual_seed(seed))  # (B, T)


def _model(size: str, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    return init_weights_(build_model(size), seed=0).to(dtype).eval()


# --------------------------------------------------------------------------- what each position sees
@pytest.mark.parametrize("size", CAUSAL)
def test_causal_models_do_not_see_later_tokens(size: str) -> None:
    model = _model(size)
    ids = _ids(0)
    with torch.no_grad():
        logits = model(ids).logits  # (B, T, V)
        for t in (0, 7, 8, 23, SEQ - 2):
            changed = ids.clone()
            changed[:, t + 1:] = (changed[:, t + 1:] + 1 + torch.arange(SEQ - t - 1) % 3) % 5
            other = model(changed).logits
            assert torch.allclose(other[:, : t + 1], logits[:, : t + 1], atol=1e-12, rtol=0), (size, t)
            # ... and the change is seen after t, so the check above is not vacuous.
            assert (other[:, t + 1:] - logits[:, t + 1:]).abs().max() > 1e-6, (size, t)


def test_bimamba_sees_both_ways_and_is_two_scans() -> None:
    model = _model("bimamba-tiny")
    ids = _ids(1)
    with torch.no_grad():
        logits = model(ids).logits
        changed = ids.clone()
        changed[:, 30:] = (changed[:, 30:] + 1) % 5
        assert (model(changed).logits[:, :30] - logits[:, :30]).abs().max() > 1e-6  # the future reaches the past

        # BiMamba is a causal mixer plus a causal mixer over the reversed sequence, sharing the
        # input and output projections: the out projection is linear, so their outputs add.
        cfg = model.cfg
        bi = model.blocks[0].mixer
        causal = MambaConfig(**{**cfg.__dict__, "bidirectional": False})
        forward_mixer, reverse_mixer = MambaMixer(causal).double(), MambaMixer(causal).double()
        for mixer, ssm in ((forward_mixer, bi.ssm), (reverse_mixer, bi.ssm_rev)):
            mixer.in_proj, mixer.out_proj, mixer.ssm = bi.in_proj, bi.out_proj, ssm
        hidden = torch.randn(2, SEQ, cfg.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        expected = forward_mixer(hidden) + reverse_mixer(hidden.flip(1)).flip(1)
        torch.testing.assert_close(bi(hidden), expected, atol=1e-12, rtol=1e-10)


# --------------------------------------------------------------------------- the convolutions and the scan
def _direct_conv(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """y[b, c, t] = sum_s h[c, s] u[b, c, t - s], by loops."""
    y = torch.zeros_like(u)
    for t in range(u.shape[-1]):
        for s in range(min(t + 1, h.shape[-1])):
            y[..., t] += h[:, s] * u[..., t - s]
    return y


@pytest.mark.parametrize("filter_len", [1, 7, 37, 50])
def test_fft_conv_equals_the_direct_causal_conv(filter_len: int) -> None:
    g = torch.Generator().manual_seed(3)
    u = torch.randn(2, 3, 37, dtype=torch.float64, generator=g)  # (B, C, T)
    h = torch.randn(3, filter_len, dtype=torch.float64, generator=g)  # (C, L) by lag
    expected = _direct_conv(u, h)
    torch.testing.assert_close(fft_causal_conv(u, h), expected, atol=1e-12, rtol=1e-10)
    if filter_len <= u.shape[-1]:
        torch.testing.assert_close(causal_depthwise_conv(u, h), expected, atol=1e-12, rtol=1e-10)


def _sequential_scan(x, delta, a, b, c, d, h0=None):  # the recurrence, one step at a time: (y, h_last)
    h = x.new_zeros(x.shape[0], x.shape[2], a.shape[1]) if h0 is None else h0  # (B, E, N)
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(delta[:, t, :, None] * a) * h + (delta[:, t] * x[:, t])[..., None] * b[:, t, None, :]
        ys.append((h * c[:, t, None, :]).sum(-1) + d * x[:, t])
    return torch.stack(ys, dim=1), h


def _scan_inputs(seed: int, t: int = 23, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, ...]:
    """x, delta, a, b, c, d, h0 of a (B, T, E, N) = (2, t, 5, 4) scan, all requiring grad."""
    g = torch.Generator().manual_seed(seed)
    bsz, e, n = 2, 5, 4
    x = torch.randn(bsz, t, e, dtype=dtype, generator=g)
    delta = F.softplus(torch.randn(bsz, t, e, dtype=dtype, generator=g))
    a = -torch.rand(e, n, dtype=dtype, generator=g).mul(4).add(0.5)
    b, c = (torch.randn(bsz, t, n, dtype=dtype, generator=g) for _ in range(2))
    d = torch.randn(e, dtype=dtype, generator=g)
    h0 = torch.randn(bsz, e, n, dtype=dtype, generator=g)
    return tuple(v.requires_grad_() for v in (x, delta, a, b, c, d, h0))


@pytest.mark.parametrize("chunk_len", [1, 3, 7, 16, 23, 64])
def test_chunked_scan_equals_the_sequential_scan(chunk_len: int) -> None:
    """y and h_last, from a zero state and from a given h0, and the gradients of all seven
    inputs (h0's included) through the op's own backward, against the step-by-step recurrence."""
    *inputs, h0 = _scan_inputs(4)
    g = torch.Generator().manual_seed(5)
    got = selective_scan(*inputs, chunk_len=chunk_len)
    expected, _ = _sequential_scan(*inputs)
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=1e-10)
    got_y, got_h = selective_scan_with_state(*inputs, h0, chunk_len=chunk_len)
    expected_y, expected_h = _sequential_scan(*inputs, h0)
    torch.testing.assert_close(got_y, expected_y, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got_h, expected_h, atol=1e-10, rtol=1e-10)
    assert (got_y - got).abs().max() > 1e-3  # h0 reaches the output, so the check above is not the zero-state one again
    wy, wh = torch.randn(got_y.shape, dtype=torch.float64, generator=g), torch.randn(got_h.shape, dtype=torch.float64, generator=g)
    everything = (*inputs, h0)
    grads = torch.autograd.grad((got_y * wy).sum() + (got_h * wh).sum(), everything)
    expected_grads = torch.autograd.grad((expected_y * wy).sum() + (expected_h * wh).sum(), everything)
    for got_grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(got_grad, expected_grad, atol=1e-9, rtol=1e-9)


def test_the_scan_stays_finite_for_any_delta() -> None:
    """fp32, deltas 0.5 to 10 and |A| up to 16 (a step alone can decay by exp(-160), a chunk of 32
    by exp(-5000): past the cumulative form's range, NOTE [Scan chunk length]), chunks of 32 and of
    1, a given h0: y, h_last and every gradient finite and equal to the float64 step-by-step
    recurrence within fp32 rounding. The delta mixes small steps in, so chunks of both forms run
    in one call."""
    *inputs, h0 = (v.detach() for v in _scan_inputs(7, t=70))
    g = torch.Generator().manual_seed(8)
    inputs[1] = torch.empty(inputs[1].shape, dtype=torch.float64).uniform_(0.5, 10, generator=g)  # delta
    inputs[1][:, :32] = 0.01  # the first chunk of 32 stays within the cumulative form's range
    inputs[2] = torch.tensor([-1.0, -5.0, -9.0, -16.0], dtype=torch.float64).expand(5, 4).contiguous()  # A (E, N)
    expected = [v.requires_grad_() for v in (*inputs, h0)]
    exp_y, exp_h = _sequential_scan(*expected)
    w = torch.randn(exp_y.shape, dtype=torch.float64, generator=g)
    exp_grads = torch.autograd.grad((exp_y * w).sum() + exp_h.sum(), expected)
    for chunk_len in (32, 1):
        got = [v.detach().float().requires_grad_() for v in (*inputs, h0)]
        y, h = selective_scan_with_state(*got[:6], got[6], chunk_len=chunk_len)
        grads = torch.autograd.grad((y * w.float()).sum() + h.sum(), got)
        torch.testing.assert_close(y.double(), exp_y, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(h.double(), exp_h, atol=1e-4, rtol=1e-4)
        for name, got_grad, exp_grad in zip("x delta a b c d h0".split(), grads, exp_grads):
            assert torch.isfinite(got_grad).all(), (chunk_len, name)
            scale = exp_grad.abs().max().item()
            assert (got_grad.double() - exp_grad).abs().max().item() <= 1e-4 * scale, (chunk_len, name)


def test_the_scan_is_one_op_that_opcheck_accepts() -> None:
    """zerofx::selective_scan passes torch.library.opcheck (schema, fake kernel, autograd
    registration, AOT dispatch), and its float32 output, as the models run it, matches the float64
    recurrence; the graph holds one scan op, not the chunks' ops."""
    inputs = _scan_inputs(6, t=19)
    torch.library.opcheck(torch.ops.zerofx.selective_scan.default, (*inputs, 5))
    y32, h32 = selective_scan_with_state(*(v.detach().float() for v in inputs[:6]), inputs[6].detach().float(), chunk_len=5)
    y64, h64 = _sequential_scan(*(v.detach() for v in inputs))
    torch.testing.assert_close(y32.double(), y64, atol=1e-5, rtol=1e-5)
    assert h32.dtype == torch.float32 and h32.shape == h64.shape
    gm = make_fx(lambda *a: selective_scan(*a, chunk_len=5))(*(v.detach().float() for v in inputs[:6]))
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.zerofx.selective_scan.default) == 1 and torch.ops.aten.cumsum.default not in targets


# --------------------------------------------------------------------------- capture, init, sizes
OPS = {  # what each family's graphs must hold (post-dispatch ATen, as the compiled program runs them)
    "hyena-tiny": ("_fft_r2c", "_fft_c2r", "convolution"),
    "striped-tiny": ("_fft_r2c", "convolution", "_scaled_dot_product"),
    "mamba-tiny": ("selective_scan", "convolution"),
    "bimamba-tiny": ("selective_scan", "flip"),
}


@pytest.mark.parametrize("size", TINY)
def test_models_capture_on_the_meta_device_at_stage_3(size: str) -> None:
    model = build_model(size, device="meta")
    assert all(p.is_meta for p in model.parameters())
    ids = torch.zeros(2, SEQ, dtype=torch.long, device="meta")  # (B, T)
    program = zerofx.compile(model, world_size=2, stage=3, example_inputs=(ids,), example_kwargs={"labels": ids})
    graphs = program.graph_modules(0)
    assert {"forward", "backward"} <= graphs.keys()
    forward = " ".join(str(n.target) for n in graphs["forward"].graph.nodes if n.op == "call_function")
    for op in OPS[size]:
        assert op in forward, (size, op)
    assert "all_gather_into_tensor" in forward


@pytest.mark.parametrize("size", TINY)
def test_meta_init_matches_init_weights(size: str) -> None:
    meta = {t.fqn: t.value for t in iter_initial_state(build_model(size, device="meta"), seed=5)}
    model = init_weights_(build_model(size), seed=5)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert meta.keys() == state.keys() - {"head.weight"}  # tied to the embedding
    for fqn, value in meta.items():
        assert torch.equal(value, state[fqn].detach()), fqn
        assert torch.isfinite(value).all(), fqn
    # Another seed gives other values.
    other = next(iter(iter_initial_state(build_model(size, device="meta"), seed=6)))
    assert not torch.equal(other.value, meta[other.fqn])


def test_documented_parameter_counts_and_the_registry() -> None:
    rows = re.findall(r"^\| `([\w-]+)` \|.*\| ([\d,]+) \|$", (ROOT / "docs" / "models.md").read_text(), re.M)
    documented = {name: int(count.replace(",", "")) for name, count in rows}
    genomic = [name for name, cfg in MODEL_SIZES.items() if type(cfg).__name__ != "DNALMConfig"]
    assert sorted(documented) == sorted(genomic)
    for name in genomic:
        assert sum(p.numel() for p in build_model(name, device="meta").parameters()) == documented[name], name
    assert build_model("mamba-tiny", vocab_size=15).embed.num_embeddings == 15
    with pytest.raises(UsageError, match=r"unknown model size 'hyena-tinny' \(did you mean hyena-tiny\?\); accepted: tiny, "):
        model_config("hyena-tinny")
    assert parse_block_pattern("SDH*")[3].name == "ATTENTION"


def test_cli_plan_striped_small(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "striped-small", "--world-size", "8", "--stage", "3", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "model striped-small: StripedHyenaLM, example inputs (1, 4096)" in out
    assert "ZeRO stage 3, world size 8" in out and "8,861,184 parameters" in out
    assert "all_gather" in out and "reduce_scatter" in out and "estimated step" in out


def test_training_takes_each_model_with_its_objective() -> None:
    mlm = check_train_options(TrainOptions(model="bimamba-tiny", objective="mlm", seq_len=64))  # type: ignore[arg-type]
    assert vocabulary_size(mlm) == 15
    assert build_train_model(mlm, torch.device("cpu")).embed.num_embeddings == 15
    assert check_train_options(TrainOptions(model="striped-tiny", seq_len=64)).objective is Objective.CLM
    with pytest.raises(UsageError, match="bimamba-tiny is bidirectional: .* train it with --objective mlm"):
        check_train_options(TrainOptions(model="bimamba-tiny", seq_len=64))
    with pytest.raises(UsageError, match="--objective mlm needs a bidirectional model .* hyena-tiny is a causal decoder"):
        check_train_options(TrainOptions(model="hyena-tiny", objective="mlm", seq_len=64))  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="--seq-len 2000 is invalid for model hyena-tiny; accepted: 2..1024"):
        check_train_options(TrainOptions(model="hyena-tiny", seq_len=2000))


# --------------------------------------------------------------------------- real ranks
def test_stage3_on_two_ranks_matches_plain_pytorch_sgd() -> None:
    sizes, steps = TINY, 3
    results = run_ranks(2, train_stage3, sizes, steps)
    for size in sizes:
        expected = reference(size, 2, steps)
        initial = reference(size, 2, 0)
        assert max((expected[k] - initial[k]).abs().max().item() for k in expected) > 1e-3, size  # training moved
        for rank, by_size in enumerate(results):
            state = by_size[size]
            assert state.keys() == expected.keys(), (size, rank)
            diff = max((state[k].double() - expected[k].double()).abs().max().item() for k in expected)
            assert diff < 1e-5, (size, rank, diff)


def test_cli_trains_striped_tiny_under_sequence_parallelism_and_bimamba_tiny(capfd: pytest.CaptureFixture[str],
                                                                             tmp_path: Path) -> None:
    """striped-tiny on the bundled genome over 4 ranks, data 2 x sequence 2 (halo, channel
    all-to-all and attention exchanges), and bimamba-tiny's masked LM on 2 ranks, at stage 3."""
    sp = tmp_path / "sp.json"
    sp.write_text('{"zero_optimization": {"stage": 3}, "zerofx": {"world_size": 4, "sequence_parallel": {"size": 2}}}')
    runs = ((["--model", "striped-tiny", "--config", str(sp)], 5, "(2 data x 2 sequence ranks, 2x32 positions per rank)"),
            (["--model", "bimamba-tiny", "--objective", "mlm", "--world-size", "2", "--stage", "3"], 15, "tokens per rank"))
    for argv, vocabulary, layout in runs:
        assert main(["train", *argv, "--steps", "3", "--seq-len", "64", "--collective-timeout", "60"]) == 0
        out = capfd.readouterr().out
        assert layout in out, out
        losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step ")]
        assert len(losses) == 3 and "step 3/3 loss" in out, out
        # Untrained, the model guesses about uniformly over the vocabulary; three steps lower the loss.
        assert abs(losses[0] - math.log(vocabulary)) < 0.1 and losses[-1] < losses[0], losses
