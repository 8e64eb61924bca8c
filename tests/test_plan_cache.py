"""The plan cache (zerofx.compiler.plan_cache): a hit trains bit for bit as the cold build does, every
part of the key misses when it changes, and a corrupt, truncated or stale entry is rebuilt."""

from __future__ import annotations

import threading
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import zerofx
from tests.support.dist_utils import run_ranks
from tests.support.models import TINY, dna_lm, reference
from tests.support.plan_cache_workers import build_fails, lowered_tiny_lm, built_in_child, cold_and_cached, fork_with_an_uncollected_group
from zerofx.compiler import cache_trust, plan_cache
from zerofx.config.options import CacheTrust
from zerofx.config import parse_config
from zerofx.models import DNADecoderLM

SGD = {"type": "SGD", "params": {"lr": 0.1}}
CONFIG = {"optimizer": SGD, "zerofx": {"prefetch_distance": 1}}


def _key(**changes) -> dict:
    args = {"model": dna_lm(), "input_signature": ("spec", (((2, 16), torch.int64, "engine"),)), "loss_fn": None,
            "cfg": parse_config(CONFIG, stage=3), "world_size": 2, "rank": 0, "backend": "gloo",
            "device": torch.device("cpu"), "program_options": {"group_name": "0", "param_offload": None}}
    args.update(changes)
    return plan_cache.cache_key(**args)


def test_every_part_of_the_key_misses_when_it_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    base = plan_cache.key_digest(_key())
    assert plan_cache.key_digest(_key()) == base  # a fresh model built the same way: the same key
    # The same parameter shapes with other heads lower other graphs: the module's attributes are in the key.
    torch.manual_seed(0)
    other_heads = DNADecoderLM(replace(TINY, num_heads=5))
    changed = {
        "config": _key(cfg=parse_config({**CONFIG, "zerofx": {"prefetch_distance": 2}}, stage=3)),
        "stage": _key(cfg=parse_config(CONFIG, stage=2)),
        "input shape": _key(input_signature=("spec", (((2, 32), torch.int64, "engine"),))),
        "world size": _key(world_size=4),
        "rank": _key(rank=1),
        "process group": _key(program_options={"group_name": "1", "param_offload": None}),
        "model attributes": _key(model=other_heads),
        "frozen parameter": _key(model=dna_lm(frozen=False)),
        "loss function": _key(loss_fn=lambda out, labels: out.loss),
    }
    for what, key in changed.items():
        assert plan_cache.key_digest(key) != base, what
    now = plan_cache.versions()
    for name, value in (("torch", "0.0.1"), ("zerofx", "0.0.1"), ("zerofx_code", "edited")):
        monkeypatch.setattr(plan_cache, "versions", lambda name=name, value=value: {**now, name: value})
        assert plan_cache.key_digest(_key()) != base, name
        monkeypatch.undo()
    # the directory is no part of the key: a moved cache still hits
    assert plan_cache.key_digest(_key(cfg=parse_config({**CONFIG, "zerofx": {"prefetch_distance": 1, "plan_cache": "/x"}}, stage=3))) == base


@pytest.fixture(scope="module")
def program() -> zerofx.Program:
    return lowered_tiny_lm(CONFIG)


def _load(directory: Path, key: dict, program: zerofx.Program) -> tuple[zerofx.Program, int]:
    builds = []

    def build() -> zerofx.Program:
        builds.append(1)
        return program

    loaded = plan_cache.load_or_build(directory, key, build, rank=0, program_options={"group_name": program.group_name})
    return loaded, len(builds)


def test_a_hit_rebuilds_the_lowered_graphs_with_their_meta(tmp_path: Path, program: zerofx.Program) -> None:
    key = _key()
    assert _load(tmp_path, key, program)[1] == 1
    loaded, builds = _load(tmp_path, key, program)
    assert builds == 0 and loaded is not program and set(loaded.setup_times) == {"cache"}
    assert loaded.plan == program.plan and loaded.plan.fingerprint() == program.plan.fingerprint()
    cold, warm = program.graph_modules(0), loaded.graph_modules(0)
    assert sorted(cold) == sorted(warm) == ["backward", "forward"]
    for name in cold:
        assert warm[name].code == cold[name].code, name
        for a, b in zip(cold[name].graph.nodes, warm[name].graph.nodes):
            val_a, val_b = a.meta.get("val"), b.meta.get("val")
            if isinstance(val_a, torch.Tensor):
                assert (val_b.shape, val_b.stride(), val_b.dtype, val_b.device) == (val_a.shape, val_a.stride(), val_a.dtype, val_a.device)
                assert type(val_b).__name__ == "FakeTensor"
            assert {k: v for k, v in b.meta.items() if k.startswith("zerofx_")} == {k: v for k, v in a.meta.items() if k.startswith("zerofx_")}
    # The schedule report reads the meta of the loaded graphs as of the built ones.
    assert loaded.report(0) == program.report(0)
    # The joint graph is rebuilt only when read, with as many nodes.
    assert len(loaded.captured.joint.graph.nodes) == len(program.captured.joint.graph.nodes)
    assert loaded.captured.params == program.captured.params and loaded.captured.input_spec == program.captured.input_spec


def test_a_tiled_program_keeps_its_loop_bodies(tmp_path: Path) -> None:
    """A tiled region is a loop over a body subgraph (NOTE [One body per tiled region]): the entry
    keeps each body node by node, with the values Inductor and the memory timeline read."""
    tiling = {"enabled": True, "block_size": 8, "attention_block_size": 8}
    program = lowered_tiny_lm({**CONFIG, "zerofx": {**CONFIG["zerofx"], "tiling": tiling}})
    key = _key()
    _load(tmp_path, key, program)
    loaded, builds = _load(tmp_path, key, program)
    assert builds == 0 and loaded.report(0) == program.report(0)
    cold, warm = program.graph_modules(0), loaded.graph_modules(0)
    for name in ("forward", "backward"):
        bodies = {k: m for k, m in cold[name].named_children() if isinstance(m, torch.fx.GraphModule)}
        assert bodies and sorted(bodies) == sorted(k for k, _ in warm[name].named_children())
        for k, body in bodies.items():
            assert getattr(warm[name], k).code == body.code
            assert all(type(n.meta["val"]).__name__ == "FakeTensor" for n in getattr(warm[name], k).graph.find_nodes(op="placeholder"))


def _secret() -> bytes:
    return cache_trust.load_secret(None, CacheTrust.PRIVATE)


def _damage(path: Path, how: str, key: dict) -> None:
    raw = path.read_bytes()
    if how == "flipped byte":
        path.write_bytes(raw[:-100] + bytes([raw[-100] ^ 0xFF]) + raw[-99:])
    elif how == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif how == "other versions":  # this user's own entry from another torch: signed, and still not used
        payload = raw.split(b"\n", 2)[2]
        plan_cache._write_entry(path, {**key, "versions": {**key["versions"], "torch": "0.0.1"}}, payload, _secret())
    else:
        path.write_bytes(b"not an entry")


@pytest.mark.parametrize("how,why", [("flipped byte", "SHA-256"), ("truncated", "truncated"), ("other versions", "other versions"),
                                     ("garbage", "no header")])
def test_a_damaged_entry_is_rebuilt_with_a_warning(tmp_path: Path, program: zerofx.Program, how: str, why: str) -> None:
    key = _key()
    _load(tmp_path, key, program)
    path = plan_cache.entry_path(tmp_path, key)
    _damage(path, how, key)
    with pytest.warns(plan_cache.PlanCacheWarning, match=why):
        loaded, builds = _load(tmp_path, key, program)
    assert builds == 1 and loaded is program
    with warnings.catch_warnings():
        warnings.simplefilter("error", plan_cache.PlanCacheWarning)
        assert _load(tmp_path, key, program)[1] == 0  # rewritten whole


def test_concurrent_writers_leave_one_whole_entry(tmp_path: Path) -> None:
    key = _key()
    path = plan_cache.entry_path(tmp_path, key)
    payloads = [bytes([i]) * (200_000 + i) for i in range(6)]
    secret = _secret()
    threads = [threading.Thread(target=lambda p=p: [plan_cache._write_entry(path, key, p, secret) for _ in range(5)]) for p in payloads]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    payload, why = plan_cache._read_entry(path, key, secret)
    assert why is None and payload in payloads
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left


def test_the_config_key_and_its_off_switch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ZEROFX_PLAN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert parse_config(CONFIG).plan_cache_dir == tmp_path / "zerofx" / "plans"
    monkeypatch.setenv("ZEROFX_PLAN_CACHE", str(tmp_path / "env"))
    assert parse_config(CONFIG).plan_cache_dir == tmp_path / "env"
    assert parse_config({"zerofx": {"plan_cache": str(tmp_path / "cfg")}}).plan_cache_dir == tmp_path / "cfg"
    assert parse_config({"zerofx": {"plan_cache": False}}).plan_cache_dir is None
    monkeypatch.setenv("ZEROFX_PLAN_CACHE", "off")
    assert parse_config(CONFIG).plan_cache_dir is None
    with pytest.raises(zerofx.ConfigError, match="plan_cache"):
        parse_config({"zerofx": {"plan_cache": True}})


@pytest.mark.multiprocess
def test_a_hit_trains_bit_for_bit_as_the_cold_build(tmp_path: Path) -> None:
    """Two gloo ranks, stages 1 (with its param_sync graph) and 3: the cached run's losses,
    gradients and parameters equal the cold run's exactly, and both match single-process PyTorch.
    Rank 0 builds (or loads) the program and rank 1 receives it (NOTE [One build per job])."""
    steps = 2
    results = run_ranks(2, cold_and_cached, str(tmp_path), [1, 3], steps, SGD)
    expected = reference("dna", 2, steps, SGD)
    entries = set()
    for rank, by_stage in enumerate(results):
        for stage, runs in by_stage.items():
            cold, cached = runs["cold"], runs["cached"]
            if rank == 0:
                assert cold["phases"] == ["capture", "lower", "plan"] and cached["phases"] == ["cache"], stage
                assert cached["entry"] == cold["entry"]
                entries.add(cold["entry"])
            else:
                assert cold["phases"] == cached["phases"] == ["from rank 0"], stage
                assert cold["entry"] == cached["entry"] == "None"
            for a, b in zip(cold["losses"], cached["losses"]):
                assert torch.equal(a, b)
            for a, b in zip(cold["grads"], cached["grads"]):
                assert a.keys() == b.keys() and all(torch.equal(a[f], b[f]) for f in a)
            for name, value in cold["state"].items():
                assert torch.equal(value, cached["state"][name]), name
                torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-5)
    # one entry per stage, written by rank 0, and nothing else in the directory
    assert len(entries) == 2 and sorted(p.name for p in tmp_path.iterdir()) == sorted(Path(e).name for e in entries)


@pytest.mark.multiprocess
def test_a_build_that_fails_on_rank_0_fails_on_every_rank() -> None:
    """Rank 0's build error reaches the rank waiting for its program, as the same zerofx error,
    instead of a hang."""
    first, second = run_ranks(2, build_fails)
    assert first == second
    assert first["capture"].startswith("CaptureError") and "branch" in first["capture"].lower()
    assert first["loss"].startswith("CaptureError") and "RuntimeError: the loss function is broken" in first["loss"]


@pytest.mark.multiprocess
def test_rank_0_builds_in_a_child_where_the_fork_is_safe() -> None:
    """NOTE [Rank 0 builds in a child]: with one intra-op thread rank 0 builds in a forked child
    and reads the program back from its bytes, as rank 1 does; with two it builds in its own
    process. Both runs lower the same graphs, code for code, and train alike: the same loss, and
    parameters equal to within the rounding of a reduction split over one thread or two (rank 0
    steps with one or two intra-op threads, which sum a gradient in another order on some CPUs)."""
    forked = run_ranks(2, built_in_child, 1)
    own = run_ranks(2, built_in_child, 2)
    assert forked[0]["phases"] == ["capture", "lower", "plan", "read back from the build process"]
    assert own[0]["phases"] == ["capture", "lower", "plan"]
    assert forked[1]["phases"] == own[1]["phases"] == ["from rank 0"]
    for rank in range(2):
        assert forked[rank]["code"] == own[rank]["code"]
        assert torch.equal(forked[rank]["loss"], own[rank]["loss"])
        for name, value in forked[rank]["state"].items():
            torch.testing.assert_close(value, own[rank]["state"][name], rtol=0, atol=1e-7)


@pytest.mark.multiprocess
def test_a_forked_child_never_collects_the_parents_process_groups() -> None:
    """NOTE [Work in a forked child]: a gloo group the parent has dropped but not collected would
    wait in its destructor, in the child, for threads only the parent has."""
    assert run_ranks(2, fork_with_an_uncollected_group) == [True, True]



# NOTE [The recorded forward is in the key]: what the model's classes and attributes cannot show.
_MODEL_FILE = '''
import torch
from torch import nn
{imports}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 8)
        self.head = nn.Linear(8, 5)

    def forward(self, ids, labels):
        logits = self.head({activation}(self.embed(ids)))
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

def build():
    ids = torch.zeros(2, 8, dtype=torch.long)
    return Net(), ((ids,), {{"labels": ids}})
'''


def _spec_key(spec) -> dict:
    """The key the engine and ``zerofx plan`` read an entry under for this model spec."""
    from zerofx.compiler.capture import StepTracer

    forward = plan_cache.graph_digest(StepTracer(spec.model, spec.args, spec.kwargs).record())
    return _key(model=spec.model, forward=forward)


def test_a_model_file_loaded_by_path_misses_when_its_code_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``FILE.py:CALLABLE`` model (not importable by name) with its activation changed, or a
    helper in another file that ``forward`` calls changed: another key, so the stale program is
    never loaded."""
    import importlib
    import sys

    from zerofx.app.model_spec import load_model_spec

    model_file, helper_file = tmp_path / "my_models.py", tmp_path / "my_helpers.py"
    monkeypatch.syspath_prepend(str(tmp_path))

    def key(activation: str, helper_body: str = "torch.relu(x)") -> dict:
        helper_file.write_text(f"import torch\ndef act(x):\n    return {helper_body}\n")
        sys.modules.pop("my_helpers", None)  # a new launch imports the file as it is now
        importlib.invalidate_caches()
        model_file.write_text(_MODEL_FILE.format(imports="import my_helpers", activation=activation))
        spec = load_model_spec(f"{model_file}:build")
        assert "no source file" not in "\n".join(plan_cache.describe_model(spec.model))
        return _spec_key(spec)

    relu = plan_cache.key_digest(key("torch.relu"))
    assert plan_cache.key_digest(key("torch.relu")) == relu  # the same file again: a hit
    assert plan_cache.key_digest(key("torch.tanh")) != relu
    helper = plan_cache.key_digest(key("my_helpers.act"))
    assert plan_cache.key_digest(key("my_helpers.act", "torch.sigmoid(x)")) != helper


def test_a_model_adapted_with_another_chunk_length_misses() -> None:
    """``use_zerofx_scan`` makes a class with the chunk length baked in: chunk 4 after chunk 32
    is another key."""
    from transformers import MambaConfig, MambaForCausalLM

    from zerofx.planner.solve import ModelSpec
    from zerofx.models.hf_mamba import use_zerofx_scan

    ids = torch.zeros(1, 16, dtype=torch.long)

    def key(chunk_len: int) -> str:
        torch.manual_seed(0)
        model = use_zerofx_scan(MambaForCausalLM(MambaConfig(vocab_size=8, hidden_size=16, state_size=4, num_hidden_layers=1)),
                                chunk_len=chunk_len)
        return plan_cache.key_digest(_spec_key(ModelSpec(model, (ids,), {"labels": ids}, "mamba")))

    assert key(32) == key(32) != key(4)


def test_a_solve_sample_of_an_edited_model_file_is_captured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole path: ``zerofx plan``'s cached samples of a ``FILE.py:CALLABLE`` model; after
    the file changes, the next sample is captured, not read."""
    from zerofx.app.model_spec import load_model_spec
    from zerofx.planner.solve import sample_program

    monkeypatch.setenv("ZEROFX_PLAN_CACHE", str(tmp_path / "cache"))
    model_file = tmp_path / "net.py"
    phases = []
    for activation in ("torch.relu", "torch.relu", "torch.tanh"):
        model_file.write_text(_MODEL_FILE.format(imports="", activation=activation))
        spec = load_model_spec(f"{model_file}:build")
        program = sample_program(spec.model, spec.args, spec.kwargs, world_size=2, stage=3, config=CONFIG)
        phases.append(sorted(program.setup_times))
    assert phases == [["capture", "lower", "plan"], ["cache"], ["capture", "lower", "plan"]]
