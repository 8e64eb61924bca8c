"""One benchmark configuration (model size, world size): start the systems, step them in
interleaved rounds, collect the rows.

NOTE [Interleaving within a memory budget]
Systems are stepped round-robin, one step each per round, rotating who goes first, so that a
noisy minute on this shared machine hits every system alike. That needs every system's ranks
alive at once, and each rank holds a torch runtime, a full model (every system builds the full
model before it shards it) and its activations: about 1.2 GiB per rank for the 25m model. When
they do not all fit in the memory available, the systems are split into chunks that do, run
one chunk after another, and the reference system (FSDP2 with reshard) runs in *every* chunk.
Each system's ratio to FSDP2 is then taken against the FSDP2 that ran beside it. FSDP2's own row
is from the first chunk; each chunk's FSDP2 median is printed under the table and recorded in
the JSON output.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from benchmarks.pool import BenchSpec, RankPool
from benchmarks.report import REFERENCE_SYSTEM, machine, max_param_diff, ratios_by_round, summarize
from benchmarks.systems import (
    DEFAULT_SYSTEMS,
    NO_PARITY,
    build_model,
    needs_group,
    split_system,
)
from zerofx.models import DNA_LM_SIZES, DNADecoderLM

GIB = 2**30
RUNTIME_BYTES_PER_RANK = GIB // 2  # python + torch + zerofx imported, a process group joined: ~0.4 GiB measured
RESERVE_BYTES = 3 * GIB  # left free for the parent, the OS and whatever else shares the machine
Log = Callable[[str], None]


@dataclass(frozen=True)
class BenchOptions:
    sizes: tuple[str, ...] = ("25m",)
    world_sizes: tuple[int, ...] = (2,)
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    steps: int = 10
    warmup: int = 2
    seq_len: int = 512
    batch_per_rank: int = 2
    optimizer: str = "AdamW"
    lr: float = 1e-3
    seed: int = 0
    data: str = "genome"
    correctness_only: bool = False
    # All systems in one set of W processes: starts in a fraction of the time, but peak RSS
    # and timings are then shared between systems. For the correctness-only smoke run.
    shared_processes: bool = False
    memory_budget_bytes: int | None = None  # None: what /proc/meminfo calls available, less RESERVE_BYTES
    zerofx_config: str | None = None  # JSON merged into every zerofx system's config
    # A second system every row is also compared with, round by round (report.ratios_by_round).
    reference: str | None = None


def num_parameters(size: str) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in DNADecoderLM(DNA_LM_SIZES[size]).parameters())


def estimate_rank_bytes(system: str, spec: BenchSpec, num_params: int) -> int:
    """A generous peak RSS of one rank of ``system``: the runtime, the full fp32 model with its
    gradients and AdamW states (built whole before any sharding), and the activations of the
    micro-batch (the whole global batch for ``single``)."""
    cfg = DNA_LM_SIZES[spec.size]
    sequences = spec.batch_per_rank * (1 if needs_group(system) else spec.world_size)
    # Per token and layer, the forward keeps about 14 d-wide and 4 ffn-wide fp32 tensors for backward.
    activations = sequences * spec.seq_len * cfg.num_layers * (14 * cfg.dim + 4 * cfg.ffn_dim) * 4
    return RUNTIME_BYTES_PER_RANK + 16 * num_params + activations


def available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def plan_chunks(systems: tuple[str, ...], spec: BenchSpec, num_params: int, budget_bytes: int | None) -> list[tuple[str, ...]]:
    """Consecutive chunks of ``systems`` whose ranks fit in ``budget_bytes`` together; each
    chunk also holds the reference system, when it is among ``systems``."""
    def cost(s: str) -> int:
        return estimate_rank_bytes(s, spec, num_params) * (spec.world_size if needs_group(s) else 1)

    if budget_bytes is None or sum(map(cost, systems)) <= budget_bytes:
        return [systems]
    anchor = (REFERENCE_SYSTEM,) if REFERENCE_SYSTEM in systems else ()
    chunks: list[tuple[str, ...]] = []
    current: list[str] = []
    for s in (s for s in systems if s not in anchor):
        if current and sum(map(cost, (*anchor, *current, s))) > budget_bytes:
            chunks.append((*anchor, *current))
            current = []
        current.append(s)
    chunks.append((*anchor, *current))
    return chunks


def _run_chunk(
    chunk: tuple[str, ...], spec: BenchSpec, opts: BenchOptions, reference: dict[str, torch.Tensor] | None, tag: str, log: Log,
    loads: list[float],
) -> tuple[dict[str, dict[str, Any]], dict[str, list[Any]], dict[str, torch.Tensor] | None, int]:
    """Start, step round-robin and finish the systems of one chunk: (rows, steps, reference, P).
    Appends the machine's 1-minute load average after each round to ``loads``."""
    pools: dict[str, RankPool] = {}
    rows: dict[str, dict[str, Any]] = {}
    num_params = 0
    try:
        setup_s: dict[str, float] = {}
        setup_rss: dict[str, int] = {}
        for systems in [chunk] if opts.shared_processes else [(s,) for s in chunk]:
            start = time.perf_counter()
            pool = RankPool(systems, spec)
            pools.update(dict.fromkeys(systems, pool))
            setup_s.update(pool.setup_s)
            setup_rss.update(pool.setup_rss_bytes)
            num_params = pool.num_params
            setups = ", ".join(f"{s} {pool.setup_s[s]:.2f} s" for s in systems)
            log(f"{tag} {pool.label}: ready in {time.perf_counter() - start:.1f} s (setup {setups})")
        steps: dict[str, list[Any]] = {s: [] for s in chunk}
        for i in range(spec.num_steps):
            rotation = chunk[i % len(chunk):] + chunk[: i % len(chunk)]
            for system in rotation:
                steps[system].append(pools[system].step(system, i))
            times = "  ".join(f"{s} {max(r[0] for r in steps[s][-1]):.2f}" for s in chunk)
            loads.append(os.getloadavg()[0])
            log(f"{tag} step {i + 1}/{spec.num_steps}{' (warm-up)' if i < opts.warmup else ''}: {times}  (load {loads[-1]:.2f})")
        # The reference first, then one system at a time; a pool's memory goes once its systems are done.
        for system in sorted(chunk, key=lambda s: s != "single"):
            base, own_optimizer = split_system(system)
            optimizer = own_optimizer or opts.optimizer
            # Parity needs the same training: gradients averaged over ranks, and the run's optimizer.
            want_state = (reference is not None or "single" in chunk) and base not in NO_PARITY and optimizer == opts.optimizer
            pool = pools.pop(system)
            finish = pool.finish(system, want_state=want_state)
            if pool not in pools.values():
                pool.close()
            state = torch.load(io.BytesIO(finish[0].pop("state")), weights_only=True) if want_state else None
            row = summarize(system, setup_s=setup_s[system], setup_rss_bytes=setup_rss[system], steps=steps[system], warmup=opts.warmup, finish=finish,
                            num_params=num_params, world_size=spec.world_size, optimizer=optimizer)
            if system == "single":
                reference = state
            elif state is not None:
                assert reference is not None
                row["max_param_diff"] = max_param_diff(state, reference)
            del state
            rows[system] = row
    finally:
        for pool in set(pools.values()):
            pool.close()
    return rows, steps, reference, num_params


def run_config(size: str, world_size: int, opts: BenchOptions, log: Log) -> dict[str, Any]:
    """Every system of ``opts`` on one (size, world size); see NOTE [Interleaving within a memory budget]."""
    spec = BenchSpec(size=size, world_size=world_size, seq_len=opts.seq_len, batch_per_rank=opts.batch_per_rank,
                     num_steps=opts.warmup + opts.steps, optimizer=opts.optimizer, lr=opts.lr, seed=opts.seed, data=opts.data,
                     zerofx_config=opts.zerofx_config)
    num_params = num_parameters(size)
    budget = opts.memory_budget_bytes
    if budget is None and not opts.shared_processes:
        avail = available_bytes()
        budget = None if avail is None else avail - RESERVE_BYTES
    systems = tuple(sorted(opts.systems, key=lambda s: s != "single"))  # the parity reference runs in the first chunk
    chunks = plan_chunks(systems, spec, num_params, budget)
    rows: dict[str, dict[str, Any]] = {}
    chunk_log = []
    loads: list[float] = []
    reference = None
    for k, chunk in enumerate(chunks):
        tag = f"[{size} W={world_size}" + (f" chunk {k + 1}/{len(chunks)}]" if len(chunks) > 1 else "]")
        chunk_rows, _, reference, num_params = _run_chunk(chunk, spec, opts, reference, tag, log, loads)
        anchor = chunk_rows.get(REFERENCE_SYSTEM)
        for system, row in chunk_rows.items():
            row["vs_fsdp2"] = row["step_s"] / anchor["step_s"] if anchor else None
            if opts.reference is not None and opts.reference in chunk_rows:
                row["vs_reference"] = ratios_by_round(row, chunk_rows[opts.reference])
            if system == REFERENCE_SYSTEM and system in rows:
                continue  # FSDP2's row is its first chunk's; the others' medians are in "chunks"
            rows[system] = row
        chunk_log.append({"systems": list(chunk), REFERENCE_SYSTEM + "_step_s": anchor["step_s"] if anchor else None})
    out: dict[str, Any] = {"size": size, "world_size": world_size, "num_params": num_params, "spec": asdict(spec),
                           "rows": [rows[s] for s in opts.systems], "chunks": chunk_log, "load_1min": loads}
    if reference is not None:
        # How far training moved the weights: the parity column means something only well below this.
        initial = {k: v.detach() for k, v in build_model(size, spec.seed, torch.device("cpu")).state_dict().items()}
        out["max_param_update"] = max_param_diff(reference, initial)
    return out


def run_benchmark(opts: BenchOptions, log: Log) -> dict[str, Any]:
    """Every (size, world size) in ``opts``; the JSON-ready result."""
    configs = [run_config(size, w, opts, log) for size in opts.sizes for w in opts.world_sizes]
    return {"machine": machine(), "options": asdict(opts), "configs": configs}
