"""Hugging Face ``MambaForCausalLM``, ``Mamba2ForCausalLM`` and ``JambaForCausalLM`` through
``use_zerofx_scan`` (zerofx/models/hf_mamba.py, NOTE [Hugging Face Mamba through the scan op]),
which sequence parallelism applies by itself while it captures: the adapted forward against
Hugging Face's own, what the adapter refuses, and training with and without sequence
parallelism in real gloo groups against plain PyTorch."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zerofx
from tests.support import hf_mamba_workers as workers
from tests.support.dist_utils import run_ranks
from zerofx.common.errors import CaptureError, ZeroFXError
from zerofx.models.hf_mamba import is_zerofx_scan_mixer, use_zerofx_scan

STEPS = 3
SCAN = torch.ops.zerofx.selective_scan.default


def _loss_and_grads(net: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> tuple[float, dict]:
    loss = net(ids, labels=labels, attention_mask=mask).loss
    loss.backward()
    return loss.item(), {k: p.grad for k, p in net.named_parameters()}


def _compile_sp(net: torch.nn.Module, seq_len: int) -> zerofx.Program:
    ids, labels, _ = workers.batches(1, 1, seq_len)
    return zerofx.compile(net, world_size=2, stage=3, example_inputs=(ids[0, 0],), example_kwargs={"labels": labels[0, 0]},
                          config={"zerofx": {"sequence_parallel": {"size": 2}}})


# --------------------------------------------------------------------------- the adapter, single process
@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_the_adapted_forward_matches_hugging_face(kind: str) -> None:
    """Same weights, a padded batch with ignored labels, T 40 (5 scan chunks of 8; 2.5 of
    Mamba-2's SSD chunks of 16): the loss and every gradient of the adapted model match Hugging
    Face's own forward. fp32: within fp32 rounding of a different summation order (measured
    loss 2e-7, gradients 1.5e-6 of their largest entry). fp64: Hugging Face rounds the SSM's
    inputs to fp32 (Mamba-1's ``.float()``, Mamba-2's SSD in fp32) and returns fp32 logits, so
    the two agree to fp32 rounding there too (measured gradients 1e-7 and 1.3e-6)."""
    ids, labels, mask = (v[0, 0] for v in workers.batches(1, 1, 40))
    for dtype in (torch.float32, torch.float64):
        reference = workers.hf_model(kind, dtype, adapt=False)
        adapted = use_zerofx_scan(copy.deepcopy(reference), chunk_len=workers.CHUNK_LEN)
        assert all(is_zerofx_scan_mixer(layer.mixer) for layer in adapted.backbone.layers)
        assert not any(is_zerofx_scan_mixer(m) for m in reference.modules())
        assert adapted.state_dict().keys() == reference.state_dict().keys()
        ref_loss, ref_grads = _loss_and_grads(reference, ids, labels, mask)
        loss, grads = _loss_and_grads(adapted, ids, labels, mask)
        assert loss == pytest.approx(ref_loss, rel=1e-6), (dtype, loss, ref_loss)
        for name, g in ref_grads.items():
            assert g.abs().max() > 0, name
            err = ((grads[name] - g).abs().max() / g.abs().max()).item()
            assert err < 1e-5, (dtype, name, err)


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_time_steps_past_the_configs_bound_match_hugging_face(kind: str) -> None:
    """A checkpoint whose time steps grew far past the config's ``time_step_max`` (0.1): delta
    0.5 to 10 (dt_proj's or dt_bias's bias the inverse softplus of those), so one step alone
    decays by up to exp(-80) and a chunk of 32 by thousands, past fp32's exp range in the scan's
    cumulative form (NOTE [Scan chunk length]). With chunks of 32, the default, and of 8, the
    loss and every gradient are finite and match Hugging Face's own forward, as at init."""
    ids, labels, mask = (v[0, 0] for v in workers.batches(1, 1, 64))
    reference = workers.hf_model(kind, adapt=False)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in reference.backbone.layers:
            bias = layer.mixer.dt_proj.bias if kind == "mamba" else layer.mixer.dt_bias
            dt = torch.empty(bias.shape).uniform_(0.5, 10, generator=g)
            bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
            if kind == "mamba2":
                layer.mixer.time_step_limit = (0.0, float("inf"))
    ref_loss, ref_grads = _loss_and_grads(copy.deepcopy(reference), ids, labels, mask)
    for chunk_len in (32, 8):
        loss, grads = _loss_and_grads(use_zerofx_scan(copy.deepcopy(reference), chunk_len=chunk_len), ids, labels, mask)
        assert loss == pytest.approx(ref_loss, rel=1e-5), (chunk_len, loss, ref_loss)
        for name, ref in ref_grads.items():
            assert torch.isfinite(grads[name]).all(), (chunk_len, name)
            err = ((grads[name] - ref).abs().max() / ref.abs().max()).item()
            assert err < 1e-4, (chunk_len, name, err)


class _Ops(TorchDispatchMode):
    """The ops a call dispatches."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.seen.add(func)
        return func(*args, **(kwargs or {}))


def test_a_call_with_a_cache_runs_hugging_face_forward() -> None:
    """Generation's path (a cache, in eval mode) is Hugging Face's own, no scan op: the same
    logits, bit for bit. Without a cache the adapted forward runs the scan op."""
    ids = workers.batches(1, 1, 12)[0][0, 0]
    for kind in ("mamba", "mamba2"):
        reference = workers.hf_model(kind, adapt=False).eval()
        adapted = use_zerofx_scan(copy.deepcopy(reference)).eval()
        with torch.no_grad():
            with _Ops() as cached_ops:
                cached = adapted(ids, use_cache=True).logits
            with _Ops() as whole_ops:
                whole = adapted(ids, use_cache=False).logits
            assert torch.equal(cached, reference(ids, use_cache=True).logits), kind
            assert torch.allclose(whole, reference(ids, use_cache=False).logits, atol=1e-5), kind
        assert SCAN not in cached_ops.seen and SCAN in whole_ops.seen, kind


def test_what_the_adapter_refuses() -> None:
    """A model without a Mamba mixer (FalconMamba's mixer is a class of its own, which normalizes
    B, C and dt), a subclass of one (whose forward may differ), a chunk length that is not a
    positive int, and the keywords of packed sequences: each refused by name. Other keywords are
    ignored."""
    from transformers import FalconMambaConfig, FalconMambaForCausalLM
    from transformers.models.mamba.modeling_mamba import MambaMixer

    falcon = FalconMambaForCausalLM(FalconMambaConfig(vocab_size=8, hidden_size=16, state_size=4, num_hidden_layers=1))
    with pytest.raises(ZeroFXError, match="FalconMambaForCausalLM holds no MambaMixer, Mamba2Mixer or JambaMambaMixer"):
        use_zerofx_scan(falcon)

    class NormedMixer(MambaMixer):
        pass

    net = workers.hf_model("mamba", adapt=False)
    net.backbone.layers[1].mixer.__class__ = NormedMixer
    with pytest.raises(ZeroFXError, match=r"backbone.layers.1.mixer is a NormedMixer, a subclass of MambaMixer whose forward may differ"):
        use_zerofx_scan(net)
    assert not any(is_zerofx_scan_mixer(m) for m in net.modules())  # nothing adapted
    with pytest.raises(ZeroFXError, match="chunk_len must be a positive int, got 0"):
        use_zerofx_scan(workers.hf_model("mamba", adapt=False), chunk_len=0)
    mixer = workers.hf_model("mamba2").backbone.layers[0].mixer
    with pytest.raises(CaptureError, match="ZeroFXScanMamba2Mixer .use_zerofx_scan. does not take seq_idx"):
        mixer(torch.zeros(1, 4, 32), seq_idx=torch.zeros(1, 4, dtype=torch.int32))
    with pytest.raises(CaptureError, match="does not take cu_seq_lens_k, cu_seq_lens_q"):
        mixer(torch.zeros(1, 4, 32), cu_seq_lens_q=torch.tensor([0, 2, 4]), cu_seq_lens_k=torch.tensor([0, 2, 4]))
    assert mixer(torch.zeros(1, 4, 32), num_items_in_batch=3).shape == (1, 4, 32)  # the loss's keyword, ignored as Hugging Face does


@pytest.mark.parametrize("kind, scans", [("mamba", 2), ("mamba2", 4), ("jamba", 1)])
def test_sequence_parallelism_adapts_the_models_as_built_and_gives_them_back(kind: str, scans: int) -> None:
    """Without ``use_zerofx_scan`` each model plans by state passing (the capture records its
    mixers through the scan op, NOTE [The scan adapter while capturing]), and afterwards every
    module has its own class again: the user's model is not changed. Jamba's experts ask for
    ``grouped_mm`` before and after (NOTE [Hugging Face experts under fake tensors])."""
    net = workers.hf_model(kind, adapt=False)
    classes = {name: type(m) for name, m in net.named_modules()}
    decisions = "\n".join(_compile_sp(net, 16).plan.decisions)
    assert f"{scans} selective scan(s) by state passing" in decisions, decisions
    assert {name: type(m) for name, m in net.named_modules()} == classes
    assert not any(is_zerofx_scan_mixer(m) for m in net.modules())
    if kind == "jamba":
        assert net.config._experts_implementation == "grouped_mm"


def test_mamba2_at_a_length_of_one_groups_channels_shards_its_scans() -> None:
    """At T = E/G (64 channels in 2 groups: 32) each group's ``A[:E/G]`` and ``D[:E/G]`` are T
    long, slices of channels and not of positions (NOTE [Prefix slices read along the sequence]
    in passes/sequence/seq_regions.py): every scan shards by state passing, as at T = 16."""
    net = workers.hf_model("mamba2", adapt=False)
    mixer = net.backbone.layers[0].mixer
    seq_len = mixer.intermediate_size // mixer.n_groups
    assert seq_len == 32
    decisions = "\n".join(_compile_sp(net, seq_len).plan.decisions)
    assert "4 selective scan(s) by state passing" in decisions, decisions


def test_a_capture_that_raises_gives_the_classes_back() -> None:
    """A sequence length S does not divide is refused after the record: the mixers are Hugging Face's again."""
    net = workers.hf_model("mamba", adapt=False)
    with pytest.raises(CaptureError, match="not divisible by sequence_parallel.size=2"):
        _compile_sp(net, 15)
    assert not any(is_zerofx_scan_mixer(m) for m in net.modules())


def test_jamba_with_grouped_experts_captures_in_fp32() -> None:
    """transformers' default ``grouped_mm`` experts have a bf16-only fake kernel; the capture records
    them as ``batched_mm`` (the same function) and Jamba captures at ZeRO-3 without sequence parallelism."""
    net = workers.hf_model("jamba", adapt=False)
    assert net.config._experts_implementation == "grouped_mm"
    ids, labels, _ = workers.batches(1, 1, 16)
    program = zerofx.compile(net, world_size=2, stage=3, example_inputs=(ids[0, 0],), example_kwargs={"labels": labels[0, 0]},
                             config={"zerofx": {"plan_cache": False}})
    assert "forward" in program.graph_modules(rank=0) and net.config._experts_implementation == "grouped_mm"


def test_mamba2_with_a_mask_without_sequence_parallelism_is_refused_at_capture() -> None:
    """Hugging Face's ``create_recurrent_attention_mask`` tests ``all(mask == 1)`` unless it sees
    a traced tensor; AOTAutograd's are not, so the capture without a rewrite refuses the step
    (docs/sequence-parallel.md). Under sequence parallelism the parity run below passes the mask."""
    ids, labels, mask = (v[0, 0] for v in workers.batches(1, 1, 16))
    with pytest.raises(CaptureError, match="cannot capture Mamba2ForCausalLM whole: Python control flow or a shape depends on a tensor's"):
        zerofx.compile(workers.hf_model("mamba2"), world_size=2, stage=3, example_inputs=(ids,),
                       example_kwargs={"labels": labels, "attention_mask": mask})


class TensorSplitLM(torch.nn.Module):
    """``tensor_split`` of the channels, the pieces recombined (token-wise), then a cumsum along the
    sequence (sequence parallelism needs an op that mixes positions)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(workers.VOCAB, 16)
        self.head = torch.nn.Linear(8, workers.VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        a, b = torch.tensor_split(self.embed(ids), [8], dim=-1)  # (B, T, 8) each
        return torch.nn.functional.cross_entropy(self.head((a * b).cumsum(1)).reshape(-1, workers.VOCAB), labels.reshape(-1))


def test_tensor_split_of_another_dim_is_token_wise() -> None:
    """Not refused (it was, by op and module, before ``tensor_split`` had a token-wise rule)."""
    decisions = "\n".join(_compile_sp(TensorSplitLM(), 16).plan.decisions)
    assert "sequence parallelism (prefix) over 2 ranks: 16 tokens -> 8 per rank" in decisions, decisions


# --------------------------------------------------------------------------- parity in gloo groups
# The forward's scan ops and all-to-alls per case, with 2 layers. Under sequence parallelism each
# scan runs twice (from zero and from the passed state) and sends one all-to-all, each conv of
# more than one tap one halo all-to-all (a 1-tap conv is token-wise: none), and the rank's
# position and the loss's sum and count take 2 more: Mamba-1 has 2 scans and 2 convs (4 scan
# ops, 6 all-to-alls; 4 with 1-tap convs), Mamba-2 a scan per group of heads, 4 (8 scan ops,
# 2 + 2 + 4 all-to-alls). Without sequence parallelism: one op per scan, no all-to-all.
EXPECTED = {("mamba", 2, 4): (4, 6), ("mamba", 2, 1): (4, 4), ("mamba2", 2, 4): (8, 8), ("mamba", 1, 4): (2, 0),
            ("mamba2", 1, 4): (4, 0), ("jamba", 2, 4): (2, 6)}  # Jamba: 1 scan and 1 conv (4 all-to-alls), 1 attention (2 more)


@pytest.mark.multiprocess
def test_parity_sequence_2_and_stage_3_without_it() -> None:
    """World 2, SGD, fp32, 3 steps, ignored labels, against Hugging Face's own (unadapted)
    forward in plain PyTorch, within 1e-5: Mamba-1 at stage 0 and Mamba-2 at stage 3 over one
    sequence group of 2 (T 64, 32 per rank: 4 scan chunks), a padded row in the batch; Mamba-2
    at stage 0 over one sequence group of 2 at T 32, its E/G (each group's ``A[:E/G]`` as long
    as the sequence, NOTE [Prefix slices read along the sequence]), padded; Mamba-1
    with 1-tap convs (``conv_kernel=1``, token-wise) at stage 2 over one sequence group of 2
    (T 32); Jamba (attention, Mamba and a 2-expert MoE) at stage 3 over one sequence group of 2
    (T 32), padded; and Mamba and Mamba-2 at stage 3 without sequence parallelism over 2 data
    groups (T 32). Under sequence parallelism the models are Hugging Face's as built (no
    ``use_zerofx_scan``): the capture adapts them. Mamba-2
    without sequence parallelism runs unpadded (docs/sequence-parallel.md: its mask is tested by
    value in Hugging Face's ``create_recurrent_attention_mask``, which capture refuses)."""
    cases = [("mamba", 0, 2, 64, True, 4), ("mamba2", 3, 2, 64, True, 4), ("mamba2", 0, 2, 32, True, 4), ("mamba", 2, 2, 32, True, 1),
             ("mamba", 3, 1, 32, True, 4), ("mamba2", 3, 1, 32, False, 4), ("jamba", 3, 2, 32, True, 4)]
    results = run_ranks(2, workers.train, cases, STEPS)
    for case in cases:
        kind, _, size, seq_len, masked, taps = case
        expected = workers.reference(kind, 2 // size, STEPS, seq_len, masked, taps)
        initial = workers.reference(kind, 2 // size, 0, seq_len, masked, taps)
        assert max((expected["state"][k] - initial["state"][k]).abs().max().item() for k in initial["state"]) > 1e-3  # training moved
        for rank, by_case in enumerate(results):
            res = by_case[case]
            assert res["state"].keys() == expected["state"].keys(), (rank, case)
            diff = max((res["state"][k].double() - expected["state"][k].double()).abs().max().item() for k in res["state"])
            assert diff < 1e-5, (rank, case, diff)
            assert res["losses"] == pytest.approx([step[rank // size] for step in expected["losses"]], abs=1e-5), (rank, case)
            assert (res["scans"], res["all_to_alls"]) == EXPECTED[kind, size, taps], (rank, case)
            if size > 1:
                decisions = "\n".join(res["decisions"])
                scans = EXPECTED[kind, size, taps][0] // 2
                assert f"{scans} selective scan(s) by state passing" in decisions, decisions
                convs = 1 if kind == "jamba" else 2  # Jamba's one Mamba layer
                assert (f"{convs} short convolution(s) (4 taps)" in decisions) == (taps == 4), decisions
