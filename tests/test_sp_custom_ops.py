"""Ops zerofx cannot know: a ``torch.library`` op with a fake kernel shards along the sequence as
its user declares with ``zerofx.register_sequence_mixer`` (NOTE [Declared sequence mixers] in
passes/sequence/mixer_custom.py): each exchange's rewrite on the graph, SGD parity with plain PyTorch in
real gloo process groups, bad declarations refused naming what is accepted, and every
sequence-parallel refusal naming the API."""

from __future__ import annotations

import pytest
import torch

import zerofx
from tests.support import custom_op_workers as workers
from tests.support.dist_utils import run_ranks
from zerofx.common.errors import DECLARE_MIXER_HINT, CaptureError, SequenceParallelError, ZeroFXError
from zerofx.passes.meta import is_all_to_all

STEPS = 3


@torch.library.custom_op("zerofx_test::undeclared_conv", mutates_args=())
def undeclared_conv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return workers.causal_conv(x, w)


@undeclared_conv.register_fake
def _(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class UndeclaredLM(workers.ConvOpsLM):
    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        u = self.embed(ids).transpose(1, 2)
        u = undeclared_conv(u, self.taps[0])
        return torch.nn.functional.cross_entropy(self.head(u.transpose(1, 2)).reshape(-1, workers.VOCAB), labels.reshape(-1))


def _compile(net: torch.nn.Module, size: int = 2) -> zerofx.Program:
    ids, labels = workers.batches(1)
    config = {"zerofx": {"sequence_parallel": {"size": size}, "plan_cache": False}}
    return zerofx.compile(net, world_size=size, stage=0, config=config, example_inputs=(ids[0],), example_kwargs={"labels": labels[0]})


def test_each_exchange_runs_its_op_on_what_it_declares() -> None:
    """On rank 0 of 2: the halo op reads T/S + K - 1 positions of all C channels, the channel op
    the whole T for C/S channels and its taps cut to them, the gather op the whole T; one
    all-to-all each for the halo and the gather, two for the channels, beside the rank's and the loss's."""
    program = _compile(workers.ConvOpsLM())
    forward = program.graph_modules(rank=0)["forward"]
    shapes = {n.target.name().removeprefix("zerofx_test::"): [tuple(a.meta["val"].shape) for a in n.args]
              for n in forward.graph.nodes if getattr(n.target, "namespace", None) == "zerofx_test"}
    c, t, k = workers.CHANNELS, workers.SEQ, workers.TAPS
    assert shapes == {"causal_conv_halo": [(2, c, t // 2 + k - 1), (c, 1, k)], "causal_conv_channels": [(2, c // 2, t), (c // 2, 1, k)],
                      "causal_conv_gather": [(2, c, t), (c, 1, k)]}, shapes
    assert sum(1 for n in forward.graph.nodes if is_all_to_all(n)) == 6
    decision = next(d for d in program.plan.decisions if d.startswith("sequence parallelism ("))
    assert decision.startswith("sequence parallelism (halo, channels, gather) over 2 ranks"), decision
    assert "1 zerofx_test::causal_conv_halo op(s) by halo as declared: 128 B" in decision  # 2 · (S-1) · (K-1) · B·C·4 bytes


def test_an_undeclared_op_is_refused_naming_the_api() -> None:
    with pytest.raises(CaptureError) as err:
        _compile(UndeclaredLM())
    text = str(err.value)
    assert "cannot shard zerofx_test::undeclared_conv in module 'taps'" in text, text
    assert text.endswith(f"({DECLARE_MIXER_HINT})"), text
    assert "zerofx_test::causal_conv_halo (halo, declared)" in text  # what is supported lists the declared ops


def test_every_sequence_parallel_refusal_names_the_api() -> None:
    """Raised anywhere (a mixer's check, the planner), and after a trip through pickle as a rank's error is sent."""
    import pickle

    err = SequenceParallelError("sequence length 15 is not divisible by sequence_parallel.size=2")
    assert str(err).endswith(f"({DECLARE_MIXER_HINT})") and "zerofx.register_sequence_mixer" in str(err)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)
    assert issubclass(SequenceParallelError, CaptureError)


def test_a_halo_wider_than_a_slice_is_refused() -> None:
    """At size 8 a slice is 2 positions; a halo of 4 would reach past the left neighbour."""
    mixer = zerofx.OpSequenceMixer(undeclared_conv, "halo", halo=4)
    zerofx.register_sequence_mixer(mixer)
    try:
        with pytest.raises(CaptureError, match=r"zerofx_test::undeclared_conv in module 'taps': a halo of 4 positions must be an int "
                                               r"in \[0, 2\]"):
            _compile(UndeclaredLM(), size=8)
    finally:
        zerofx.unregister_sequence_mixer(mixer.name)


@pytest.mark.parametrize("kwargs, words", [
    ({"op": torch.nn.functional.conv1d, "exchange": "halo"}, "op must be a torch.library op"),
    ({"op": undeclared_conv, "exchange": "sideways"}, "exchange 'sideways' is not one zerofx has; accepted: \"halo\", \"channels\", \"gather\""),
    ({"op": undeclared_conv, "exchange": "halo", "halo": -1}, "halo must be an int >= 0"),
    ({"op": undeclared_conv, "exchange": "gather", "per_channel": {1: 0}}, "per_channel applies to exchange \"channels\" only"),
])
def test_bad_declarations_are_refused_naming_what_is_accepted(kwargs: dict, words: str) -> None:
    with pytest.raises(ZeroFXError) as err:
        zerofx.OpSequenceMixer(**kwargs)
    assert words in str(err.value)


def test_register_refuses_what_is_not_a_mixer_and_unregister_an_unknown_name() -> None:
    with pytest.raises(ZeroFXError, match="is not a SequenceMixer .it lacks name.*zerofx.OpSequenceMixer"):
        zerofx.register_sequence_mixer(object())
    with pytest.raises(ZeroFXError, match="no declared mixer 'zerofx_test::nothing'; declared: .*zerofx_test::causal_conv_halo"):
        zerofx.unregister_sequence_mixer("zerofx_test::nothing")


def test_the_example_compiles_sequence_parallel() -> None:
    """examples/custom_op_sp.py declares its op and plans it by halo at sequence-parallel 2."""
    decisions = workers.EXAMPLE.main()
    assert any("1 example::causal_conv op(s) by halo as declared" in d for d in decisions), decisions


@pytest.mark.multiprocess
def test_parity_declared_ops_sequence_2() -> None:
    """World 2, sequence-parallel 2, one launch: the three declared ops (halo, channels, gather)
    in one model train at stages 0 and 3 within 1e-5 of plain PyTorch (the conv written out, no
    custom op) after 3 SGD steps."""
    stages = [0, 3]
    results = run_ranks(2, workers.train, stages, STEPS)
    expected = workers.reference(STEPS)
    for stage in stages:
        for rank, by_stage in enumerate(results):
            res = by_stage[stage]
            diff = max((res["state"][k].double() - v.double()).abs().max().item() for k, v in expected["state"].items())
            assert diff < 1e-5, (rank, stage, diff)
            assert res["losses"] == pytest.approx(expected["losses"], abs=1e-5), (rank, stage)
            assert res["all_to_alls"] == 6, (rank, stage)


def test_the_plan_cache_keys_on_each_declaration() -> None:
    """Declaring an op, or declaring it another way, misses a cached plan; the key's text holds no
    object address, so every process and rank computes the same key."""
    from zerofx.compiler import plan_cache
    from zerofx.config import parse_config

    args = {"model": workers.ConvOpsLM(), "input_signature": ("spec", (((2, 16), torch.int64, "engine"),)), "loss_fn": None,
            "cfg": parse_config({"optimizer": workers.SGD}, stage=0), "world_size": 2, "rank": 0, "backend": "gloo",
            "device": torch.device("cpu"), "program_options": {}}
    digests = [plan_cache.key_digest(plan_cache.cache_key(**args))]
    for mixer in (zerofx.OpSequenceMixer(undeclared_conv, "halo", halo=lambda x, w: 2), zerofx.OpSequenceMixer(undeclared_conv, "gather")):
        zerofx.register_sequence_mixer(mixer)
        key = plan_cache.cache_key(**args)
        digests.append(plan_cache.key_digest(key))
    zerofx.unregister_sequence_mixer("zerofx_test::undeclared_conv")
    assert plan_cache.key_digest(plan_cache.cache_key(**args)) == digests[0]
    assert len(set(digests)) == 3 and "0x" not in str(key["sequence_mixers"]), key["sequence_mixers"]
