"""Tiling the genomic models within one process: the mixers' ops (convolutions, FFTs, cumsum,
the scan, flips) are barriers that keep the sequence axis, so the token-wise regions between
them run in chunks, and the convolution spans are recomputed in backward (NOTE [Mixers as
tiling barriers], NOTE [Convolutions recomputed in backward]). Parity against eager PyTorch,
and what the forward graph saves for backward."""

from __future__ import annotations

import pytest
import torch

from zerofx.models import build_model
from zerofx.passes.plan.tiling import TilingOptions
import zerofx
from tests.test_tiling import assert_parity, graph_nodes, run_partitioned

SEQ = 64
ON = TilingOptions(enabled=True, block_size=16)
OFF = TilingOptions(enabled=False)
# Per model: the convolution spans tiling finds (featurizer and filter convs, FFT convolutions).
SPANS = {"hyena-tiny": 4, "striped-tiny": 6, "mamba-tiny": 2, "bimamba-tiny": 4}


def _batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 5, (2, SEQ), generator=g)
    labels = ids.clone()
    if name.startswith("bimamba"):  # masked LM: only some positions carry a label
        labels[torch.rand(ids.shape, generator=g) < 0.7] = -100
    else:
        labels[0, -5:] = -100  # ignored tokens
    return ids, labels


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(name)


def saved_bytes(graphs) -> int:
    """Activation bytes the partitioned forward hands to backward (its outputs after the loss,
    the parameters aside)."""
    fw = graphs[0]
    out = next(n for n in fw.graph.nodes if n.op == "output").args[0]
    vals = [a.meta.get("val") for a in out[1:] if hasattr(a, "meta") and a.op != "placeholder"]
    return sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("name", sorted(SPANS))
def test_genomic_model_tiled_matches_eager_and_saves_less(name: str) -> None:
    model = _model(name)
    ids, labels = _batch(name)
    cap, graphs = assert_parity(model, (ids,), {"labels": labels}, ON)
    plan = cap.tiling
    kinds = [op.kind for op in plan.ops]
    assert plan.num_candidates[4] == SPANS[name], plan.num_candidates
    assert kinds.count("conv") == SPANS[name] and kinds.count("region") >= 2 * model.cfg.num_layers, kinds
    # Every recomputed span's conv and FFT nodes carry the tag into the joint graph; none saves a
    # padded input or a spectrum.
    _, _, _, untiled = run_partitioned(_model(name), (ids,), {"labels": labels}, OFF)
    # The scan op keeps its inputs (x, delta, B, C) whatever tiling does; the rest is chunked.
    assert saved_bytes(graphs) < 0.6 * saved_bytes(untiled), (saved_bytes(graphs), saved_bytes(untiled))
    fw = graphs[0]
    out = next(n for n in fw.graph.nodes if n.op == "output").args[0]
    saved_complex = [a.name for a in out[1:] if hasattr(a, "meta") and getattr(a.meta.get("val"), "is_complex", lambda: False)()]
    assert not saved_complex, saved_complex
    # Each FFT convolution runs in channel chunks (NOTE [Long convolutions in channel chunks]):
    # SEQ / block = 4 chunks, one loop over one body that holds the FFTs (NOTE [One body per tiled
    # region]), in forward (and recomputed in backward) and in backward.
    ffts = [op for op in plan.ops if op.kind == "conv" and "fft" in op.what]
    assert all(op.block_size == 4 and "4 channel chunks" in op.what for op in ffts), ffts
    assert not [n for n in fw.graph.nodes if "fft" in str(n.target)]
    assert bool([n for n in untiled[0].graph.nodes if "fft" in str(n.target)]) == bool(ffts)
    assert sorted(_fft_loop_chunks(fw)) == [4] * len(ffts)


def _fft_loop_chunks(gm: torch.fx.GraphModule) -> list[int]:
    """The chunks each loop of ``gm`` whose body holds an FFT runs over."""
    loops = gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.map_impl)
    return [n.args[1][0].meta["val"].shape[0] for n in loops if any("fft" in str(b.target) for b in getattr(gm, n.args[0].target).graph.nodes)]


def _tiled_graph_sizes(seq: int) -> dict[str, int]:
    """Nodes of the rank's forward and backward graphs, loop bodies included, for a one-layer
    StripedHyena at ``seq`` tokens tiled in chunks of 16."""
    from zerofx.models import StripedHyenaLM
    from zerofx.models.genomic_sizes import StripedHyenaConfig, parse_block_pattern

    torch.manual_seed(0)
    cfg = StripedHyenaConfig(dim=16, block_pattern=parse_block_pattern("H*"), num_heads=2, ffn_dim=24, max_seq_len=256, li_num_modes=4)
    ids = torch.randint(0, 5, (1, seq))
    program = zerofx.compile(StripedHyenaLM(cfg), world_size=1, stage=0, example_inputs=(ids,), example_kwargs={"labels": ids},
                             config={"zerofx": {"tiling": {"enabled": True, "block_size": 16, "attention_block_size": 16}}})
    graphs = program.graph_modules(0)
    assert sorted({op.kind for op in program.plan.tiling.ops}) == ["attention", "conv", "loss", "region"]
    assert _fft_loop_chunks(graphs["forward"]) == [seq // 16]  # the channels in as many chunks as the sequence
    loops = graphs["forward"].graph.find_nodes(op="call_function", target=torch.ops.higher_order.map_impl)
    assert {n.args[1][0].meta["val"].shape[0] for n in loops} == {seq // 16}
    return {name: len(graph_nodes(graphs[name])) for name in ("forward", "backward")}


def test_graphs_keep_their_size_as_the_context_grows() -> None:
    """A one-layer StripedHyena (an FFT convolution in channel chunks, attention, token-wise
    regions, the chunked loss) tiled in chunks of 16 tokens: the rank's forward and backward
    graphs, loop bodies included, have as many nodes at 256 tokens (16 chunks) as at 64 (4):
    each tiled region and each channel-chunked convolution is one loop over one body (NOTE [One
    body per tiled region])."""
    assert _tiled_graph_sizes(64) == _tiled_graph_sizes(256)


def test_conv_kind_can_be_switched_off() -> None:
    model = _model("striped-tiny")
    ids, labels = _batch("striped-tiny")
    kinds = ("attention", "region", "loss", "weight")
    cap, _ = assert_parity(model, (ids,), {"labels": labels}, TilingOptions(enabled=True, block_size=16, kinds=kinds))
    assert "conv" not in {op.kind for op in cap.tiling.ops}
    assert any(s.kind == "conv" for s in cap.tiling.skipped) or cap.tiling.num_candidates[4] == SPANS["striped-tiny"]


@pytest.mark.parametrize("name,sp", [("hyena-tiny", 1), ("hyena-tiny", 2), ("mamba-tiny", 1)])
def test_cut_models_tile_every_block_alike(name: str, sp: int) -> None:
    """NOTE [One region per connected part]: a Hyena block's implicit filter is token-wise over
    the positions, at level 0 beside the embedding, in every block; one region per level put
    every block's filter in one region that grew with the model, so cut models could not fold.
    Each connected part is a region: the 2- and 3-block cuts of a 4-block model tile per block,
    also under sequence parallelism, where the rank's positions feed every block's filter."""
    from dataclasses import replace
    from types import SimpleNamespace

    from zerofx.planner.folding import find_repeated_blocks, same_tiling_per_block, with_num_blocks
    from zerofx.compiler.pipeline import StepCapture
    from zerofx.models.registry import model_class
    from zerofx.models.sizes import model_config

    cfg = model_config(name)
    with torch.device("meta"):
        model = model_class(cfg)(replace(cfg, num_layers=4))
    blocks = find_repeated_blocks(model)
    assert blocks is not None and blocks.count >= 3, blocks
    ids = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    spec = None
    if sp > 1:
        from zerofx.compiler.program import resolve
        from zerofx.config.compile_options import compile_options

        cfg = resolve({"zerofx": {"sequence_parallel": {"size": sp, "attention": "auto"}}}, stage=3, world_size=sp)
        spec = compile_options(cfg, sp).sequence_parallel
    plans = {n: StepCapture(with_num_blocks(model, blocks, n), (ids,), {"labels": ids}, sequence_parallel=spec).tiling_plan(ON)
             for n in (2, 3)}
    assert plans[2].ops and same_tiling_per_block(*(SimpleNamespace(tiling=plans[n]) for n in (2, 3)), blocks, (2, 3))
    # Every region of the larger cut is one the smaller has, or one more block's worth of them.
    assert plans[3].num_candidates[1] > plans[2].num_candidates[1]
