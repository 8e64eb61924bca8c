"""The sequence-mixer seam (NOTE [Sequence mixers] in passes/sequence/sequence_mixers.py): a mixer in the
registry is asked for the ops it owns, an op no mixer owns is refused, the config's two spellings
of a strategy are one spec, and the exchange costs in cost_models/sequence.py."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.fx as fx

import zerofx
from tests.support import sequence_parallel_workers as workers
from zerofx.common.errors import CaptureError, ConfigError, SequenceParallelError
from zerofx.config import options, parse_config  # imported before any test patches the registry: the schema reads it once
from zerofx.cost_models.comm import CommSpec
from zerofx.cost_models.sequence import AttentionDims, ring_exchange_bytes, ring_exchange_s, ulysses_exchange_bytes, ulysses_exchange_s
from zerofx.passes.sequence import mixer_custom, sequence_parallel
from zerofx.passes.meta import is_all_to_all
from zerofx.passes.sequence.mixer_attention import ATTENTION, AttentionShape
from zerofx.passes.sequence.sequence_mixers import MixerCheck, MixerRewrite, all_to_all, bytes_by_strategy
from zerofx.passes.plan.sequence import SequenceParallelSpec

aten = torch.ops.aten


class PrefixSumMixer:
    """``cumsum`` along the sequence by gathering it: every rank sends its slice to every rank
    (one all-to-all of S copies), sums the whole sequence, and keeps its own positions."""

    name = "prefix_sum"
    strategies = ("gather",)
    doc = "a running sum along the sequence, gathered whole on every rank"
    supports = "cumsum along the sequence"
    runs_zigzag = False  # the gathered slices are put back in rank order as contiguous ones

    def matches(self, node: fx.Node) -> bool:
        return node.op == "call_function" and node.target is aten.cumsum.default

    def check(self, node: fx.Node, ctx: MixerCheck) -> int:
        x, dim = node.args[:2]
        if ctx.analysis.sdim.get(x) != dim % x.meta["val"].dim():
            raise SequenceParallelError(f"aten.cumsum in module {ctx.module!r} runs along another axis than the sequence")
        return x.meta["val"].numel() * x.meta["val"].element_size()  # the site: bytes of the whole input

    def exchange_bytes(self, site: int, strategy: str, size: int) -> float:
        return 2 * (size - 1) / size * site

    def choose(self, sites: Sequence[int], size: int) -> tuple[str, str]:
        return "gather", "prefix sums: gather, the only strategy"

    def accept(self, sites: Sequence[int], strategy: str, size: int) -> None:
        pass

    def describe(self, sites: Sequence[int], strategy: str, size: int, seq_len: int) -> str:
        return f"{len(sites)} prefix sum(s), each one all-to-all gathering the sequence"

    def zigzag_balances(self, graph: fx.Graph, strategy: str) -> bool:
        return False

    def rewrite(self, node: fx.Node, args: tuple, kwargs: dict, ctx: MixerRewrite) -> torch.Tensor:
        x, dim, *rest = args  # (B, T/S, d), dim 1
        copies = x.unsqueeze(0).expand(ctx.size, *x.shape).contiguous()  # (S, B, T/S, d): one copy to each rank
        gathered = all_to_all(copies, ctx.size, ctx.group_name, grad=True)  # chunk j is rank j's slice, in rank order
        whole = gathered.movedim(0, dim).flatten(dim, dim + 1)  # (B, T, d): contiguous slices
        summed = node.target(whole, dim, *rest, **kwargs)
        return torch.index_select(summed, dim, ctx.positions(summed))

    def op_exchanges(self, node: fx.Node) -> tuple[tuple[str, int], ...]:
        return ()


class PrefixSumLM(torch.nn.Module):
    """A running sum (or product) along the sequence between a projection and the head, its loss over reshaped logits."""

    def __init__(self, product: bool = False) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(workers.CONFIG.vocab_size, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, workers.CONFIG.vocab_size)
        self.product = product

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.mix(self.embed(ids))
        x = x.cumprod(dim=1) if self.product else x.cumsum(dim=1)  # (B, T, d): position t sums (multiplies) positions <= t
        return torch.nn.functional.cross_entropy(self.head(x).reshape(-1, workers.CONFIG.vocab_size), labels.reshape(-1))


def _compile(model: torch.nn.Module, section: dict) -> zerofx.Program:
    ids = torch.randint(0, workers.CONFIG.vocab_size, (2, 16))
    config = {"zerofx": {"sequence_parallel": section, "plan_cache": False}}  # the plan cache does not key on a patched registry
    return zerofx.compile(model, world_size=2, stage=3, example_inputs=(ids, ids), config=config)


def _registry(monkeypatch: pytest.MonkeyPatch, *mixers: object) -> None:
    """``MIXERS`` as given, for the plan, and as the config's ``MIXER_KEYS`` for its spec (which names every mixer), and no
    declared mixer."""
    monkeypatch.setattr(sequence_parallel, "MIXERS", mixers)
    monkeypatch.setattr(mixer_custom, "_DECLARED", {})
    monkeypatch.setattr(options, "MIXER_KEYS", mixers)


def test_a_registered_mixer_is_asked_and_its_rewrite_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the toy mixer in the registry in place of the bundled ones, the cumsum is planned by
    it, its decision recorded, and its all-to-all traced into the forward."""
    _registry(monkeypatch, ATTENTION, PrefixSumMixer())
    program = _compile(PrefixSumLM(), {"size": 2})
    decision = next(d for d in program.plan.decisions if d.startswith("sequence parallelism ("))
    assert decision.startswith("sequence parallelism (gather) over 2 ranks: 16 tokens -> 8 per rank, 1 prefix sum(s)"), decision
    assert program.plan.sequence_parallel.strategies == (("prefix_sum", "gather"),)
    forward = program.graph_modules(0)["forward"]
    exchanged = [tuple(n.args[0].meta["val"].shape) for n in forward.graph.nodes if is_all_to_all(n)]
    assert exchanged == [(2,), (2, 2, 8, 16), (2, 2)]  # the rank's position; the gathered copies; the loss's sum and count
    assert any(n.target is aten.cumsum.default and n.args[0].meta["val"].shape[1] == 16 for n in forward.graph.nodes)


def test_an_op_no_mixer_owns_is_refused_by_op_and_module() -> None:
    with pytest.raises(CaptureError) as err:
        _compile(PrefixSumLM(product=True), {"size": 2})
    text = str(err.value)
    assert "cannot shard aten.cumprod" in text and "in module 'mix'" in text and "reads the sequence axis across positions" in text
    assert "Supported are" in text and "scaled_dot_product_attention" in text


def test_the_refusal_lists_every_registered_mixers_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cumprod the toy mixer does not own is refused; what is supported names the toy's ops beside attention's."""
    _registry(monkeypatch, ATTENTION, PrefixSumMixer())
    with pytest.raises(CaptureError) as err:
        _compile(PrefixSumLM(product=True), {"size": 2})
    text = str(err.value)
    assert "cannot shard aten.cumprod" in text and "in module 'mix'" in text
    assert f"{ATTENTION.supports}, cumsum along the sequence, and cross_entropy" in text


def test_the_attention_mixer_reports_each_strategys_cost_model() -> None:
    """``exchange_bytes`` by strategy name is cost_models/sequence.py's formula of that strategy,
    and ``bytes_by_strategy`` sums it over the sites, in the mixer's order of strategies."""
    dims = AttentionShape(batch=2, seq_len=16, q_heads=8, kv_heads=2, qk_dim=8, v_dim=8, itemsize=4, ulysses_refusal=None)
    sent = bytes_by_strategy(ATTENTION, [dims, dims], 4)
    assert list(sent) == ["ulysses", "ring"]
    assert sent == {"ulysses": 2 * ulysses_exchange_bytes(dims, 4), "ring": 2 * ring_exchange_bytes(dims, 4)}
    assert sent["ulysses"] != sent["ring"]  # so a swapped mapping shows


def test_old_and_new_spellings_are_one_spec() -> None:
    def spec(section: dict) -> SequenceParallelSpec:
        found = parse_config({"zerofx": {"sequence_parallel": section}}, world_size=4).sequence_parallel
        assert found is not None
        return found

    for strategy in ("ulysses", "ring", "auto"):
        old, new = spec({"size": 2, "attention": strategy}), spec({"size": 2, "mixers": {"attention": strategy}})
        assert old == new == spec({"size": 2, "attention": strategy, "mixers": {"attention": strategy}})
        assert old.strategy(ATTENTION) == strategy
    assert spec({"size": 2}) == spec({"size": 2, "attention": "ulysses"}) == spec({"size": 2, "mixers": {}})
    # Ranks that spell the one setting differently agree (NOTE [What ranks must agree on]).
    fields = [parse_config({"zerofx": {"sequence_parallel": section}}, world_size=4).fingerprint_fields()
              for section in ({"size": 2, "attention": "ring"}, {"size": 2, "mixers": {"attention": "ring"}})]
    assert fields[0] == fields[1]


@pytest.mark.parametrize("section, words", [
    ({"size": 2, "mixers": {"conv": "halo"}}, ["'zerofx.sequence_parallel.mixers.conv'", "accepted keys here: attention"]),
    ({"size": 2, "mixers": {"attention": "sideways"}}, ["'zerofx.sequence_parallel.mixers.attention'", "'sideways'",
                                                        '"ulysses", "ring", "auto"']),
    ({"size": 2, "attention": "sideways"}, ["'zerofx.sequence_parallel.attention'", "'sideways'", '"ulysses", "ring", "auto"']),
    ({"size": 2, "attention": "ring", "mixers": {"attention": "ulysses"}}, ["'zerofx.sequence_parallel.attention' ('ring')",
                                                                            "'zerofx.sequence_parallel.mixers.attention' ('ulysses')",
                                                                            "disagree"]),
])
def test_bad_strategies_are_refused_naming_the_accepted_ones(section: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"zerofx": {"sequence_parallel": section}}, world_size=4)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("mixers, words", [
    ((("conv", "halo"),), ["no mixer for op class 'conv'", "accepted: attention"]),
    ((("attention", "sideways"),), ["cannot run attention by 'sideways'", "accepted: 'ulysses', 'ring', 'auto'"]),
])
def test_a_spec_built_by_hand_is_refused_as_the_config_is(mixers: tuple, words: list[str]) -> None:
    gm = fx.symbolic_trace(workers.TokenLM())  # never analysed: the spec is refused first
    with pytest.raises(SequenceParallelError) as err:
        sequence_parallel.plan_sequence_parallel(gm, SequenceParallelSpec(size=2, mixers=mixers))
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("q_heads, kv_heads, size", [(4, 4, 2), (8, 2, 4), (6, 6, 4), (4, 2, 2)])
def test_exchange_seconds_are_the_bytes_over_the_bandwidth_without_latency(q_heads: int, kv_heads: int, size: int) -> None:
    """On one node with no per-step latency, each exchange takes its bytes over the link's bandwidth;
    a latency adds one alpha per send (ring) or per peer and all-to-all (Ulysses)."""
    dims = AttentionDims(batch=2, seq_len=16, q_heads=q_heads, kv_heads=kv_heads, qk_dim=8, v_dim=8, itemsize=2)
    bandwidth = 1e9
    free = CommSpec("test", 0.0, bandwidth, 0.0, bandwidth, ranks_per_node=8)
    assert ulysses_exchange_s(dims, size, free) == pytest.approx(ulysses_exchange_bytes(dims, size) / bandwidth)
    assert ring_exchange_s(dims, size, free) == pytest.approx(ring_exchange_bytes(dims, size) / bandwidth)
    slow = CommSpec("test", 1e-3, bandwidth, 1e-3, bandwidth, ranks_per_node=8)
    assert ring_exchange_s(dims, size, slow) == pytest.approx(ring_exchange_s(dims, size, free) + (3 * size - 2) * 1e-3)
    assert ulysses_exchange_s(dims, size, slow) == pytest.approx(ulysses_exchange_s(dims, size, free) + 4 * (size - 1) * 1e-3)
