"""Training-step benchmark: zerofx stages 1-3 against plain PyTorch, DDP, FSDP2 and (when it is
installed) DeepSpeed ZeRO 1-3, on the bundled DNA decoder LM, in one run.

    python -m benchmarks.bench_step                                  # 25m, W=2, the default systems
    python -m benchmarks.bench_step --sizes small --world-sizes 1,2,4  # a scaling sweep
    python -m benchmarks.bench_step --smoke                          # tiny, correctness only (CI)

Every system trains the same model from the same seed on the same data: rank r's micro-batch
at step s is the same tensor for every system, and ``single`` (one process, no process group)
trains on all ranks' micro-batches stacked, which is the data-parallel step computed whole. The
same number of steps runs everywhere; the first ``--warmup`` are left out of the timing. One
compute thread per rank; gloo on CPU, NCCL when CUDA is available.

``local`` (optional, ``--systems ...,local``) is not a competitor: each rank trains on its own
micro-batch with no communication at all, so its step time is one rank's compute floor under
the same load. It does not average gradients, so it has no parity column.

When all systems' ranks do not fit in memory together, they run in chunks, each beside its own
FSDP2 run (NOTE [Interleaving within a memory budget] in ``benchmarks/rounds.py``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.report import markdown_table, sweep_table
from benchmarks.rounds import BenchOptions, run_benchmark
from benchmarks.systems import DEFAULT_LR, DEFAULT_SYSTEMS, SYSTEMS, split_system
from zerofx.models import DNA_LM_SIZES

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def default_systems() -> tuple[str, ...]:
    extra = ("deepspeed1", "deepspeed2", "deepspeed3") if deepspeed_installed() else ()
    return DEFAULT_SYSTEMS + extra


def smoke_options(**overrides: Any) -> BenchOptions:
    """The CI smoke run: tiny model, 2 ranks, 2 SGD steps (parity is then tight), correctness
    columns only, every system in one set of processes (so it starts in seconds)."""
    base = {"sizes": ("tiny",), "world_sizes": (2,), "systems": DEFAULT_SYSTEMS, "steps": 2, "warmup": 0,
            "seq_len": 64, "optimizer": "SGD", "lr": DEFAULT_LR["SGD"], "correctness_only": True, "shared_processes": True}
    return BenchOptions(**{**base, **overrides})


def render(result: dict[str, Any], command: str | None = None) -> str:
    """The markdown report: machine, command, one table per configuration, and a sweep table."""
    opts = result["options"]
    m = result["machine"]
    backend = "NCCL on " + ", ".join(m["gpus"]) if m.get("gpus") else "gloo on CPU"
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB; torch {m['torch']}, {backend}, one thread per rank."]
    if command:
        lines.append(f"Command: `{command}`")
    for c in result["configs"]:
        spec = c["spec"]
        title = (f"**{c['size']}** ({c['num_params'] / 1e6:.2f}M parameters), W={c['world_size']}, "
                 f"{spec['batch_per_rank']}×{spec['seq_len']} tokens per rank, fp32 {spec['optimizer']} "
                 f"lr {spec['lr']:g}, {opts['steps']} measured steps after {opts['warmup']} warm-up, data: {spec['data']}")
        if c.get("load_1min"):
            title += f"; load average (1 min) over the rounds from {min(c['load_1min']):.1f} to {max(c['load_1min']):.1f}"
        lines += ["", title, "", markdown_table(c["rows"], optimizer=spec["optimizer"], correctness_only=opts["correctness_only"])]
        if len(c.get("chunks", ())) > 1:
            lines.append("")
            lines += [(f"Chunk {k + 1} ({', '.join(ch['systems'])}) ran beside its own FSDP2 run, median "
                       f"{ch['fsdp2_step_s']:.3f} s; its × fsdp2 is against that run.") for k, ch in enumerate(c["chunks"])
                      if ch.get("fsdp2_step_s")]
        if "max_param_update" in c:
            lines += ["", f"Training moved the weights by up to {c['max_param_update']:.2e} from their initial values."]
    if len(result["configs"]) > 1 and not opts["correctness_only"]:
        lines += ["", "Sweep:", "", sweep_table(result["configs"])]
    return "\n".join(lines) + "\n"


def _csv(kind: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    return lambda text: tuple(kind(x.strip()) for x in text.split(",") if x.strip())


def _systems(text: str) -> tuple[str, ...]:
    names: list[str] = []
    for name in _csv(str)(text):
        expanded = {"all": default_systems(), "deepspeed": ("deepspeed1", "deepspeed2", "deepspeed3"),
                    "zerofx": ("zerofx1", "zerofx2", "zerofx3")}.get(name, (name,))
        for n in expanded:
            try:
                base, _ = split_system(n)
            except ValueError as exc:
                raise argparse.ArgumentTypeError(f"{exc}; or all, zerofx, deepspeed") from None
            if base.startswith("deepspeed") and not deepspeed_installed():
                raise argparse.ArgumentTypeError(
                    f"{n} needs DeepSpeed: DS_BUILD_OPS=0 DS_ACCELERATOR=cpu pip install deepspeed")
            if n not in names:
                names.append(n)
    return tuple(names)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_step", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=_csv(str), default=None, help=f"model sizes, from {', '.join(DNA_LM_SIZES)} (default 25m)")
    p.add_argument("--world-sizes", type=_csv(int), default=None, help="ranks per run, e.g. 1,2,4 (default 2)")
    p.add_argument("--systems", type=_systems, default=None,
                   help=f"comma-separated, from {', '.join(SYSTEMS)} (default: all but local; deepspeed* only when "
                        "installed); NAME@SGD or NAME@AdamW runs one system with its own optimizer, without parity")
    p.add_argument("--steps", type=int, default=None, help="measured steps per system (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="steps run first and left out of the timing (default 2)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 512)")
    p.add_argument("--batch-per-rank", type=int, default=None, help="sequences per rank per step (default 2)")
    p.add_argument("--optimizer", choices=sorted(DEFAULT_LR), default=None, help="fp32 AdamW (default) or SGD")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-3 for AdamW, 0.1 for SGD)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--data", choices=("genome", "random"), default=None, help="lambda phage windows (default) or random tokens")
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 ranks, 2 SGD steps, correctness columns only")
    p.add_argument("--shared-processes", action="store_true", default=None,
                   help="run every system in one set of ranks (fast start; RSS and timings no longer per system)")
    p.add_argument("--memory-budget-gib", type=float, default=None,
                   help="memory the ranks may use together; systems beyond it run in later chunks (default: available - 3 GiB)")
    p.add_argument("--zerofx-config", default=None,
                   help='JSON merged into the zerofx systems\' config, e.g. \'{"zero_optimization": {"reduce_bucket_size": 4e6}}\'')
    p.add_argument("--reference", default=None,
                   help="also compare every system with this one round by round (one of --systems), e.g. fsdp2_compile")
    p.add_argument("--out", type=Path, help="write the JSON result here")
    p.add_argument("--markdown", type=Path, help="write the markdown tables here")
    return p


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    given = {k: v for k, v in {
        "sizes": args.sizes, "world_sizes": args.world_sizes, "systems": args.systems, "steps": args.steps,
        "warmup": args.warmup, "seq_len": args.seq_len, "batch_per_rank": args.batch_per_rank,
        "optimizer": args.optimizer, "lr": args.lr, "seed": args.seed, "data": args.data,
        "shared_processes": args.shared_processes, "zerofx_config": args.zerofx_config, "reference": args.reference,
    }.items() if v is not None}
    if args.memory_budget_gib is not None:
        given["memory_budget_bytes"] = int(args.memory_budget_gib * 2**30)
    if args.smoke:
        opts = smoke_options(**given)
    else:
        given.setdefault("systems", default_systems())
        opts = BenchOptions(**given)
    if args.lr is None:
        opts = replace(opts, lr=DEFAULT_LR[opts.optimizer])
    for size in opts.sizes:
        if size not in DNA_LM_SIZES:
            raise ValueError(f"unknown size {size!r}; accepted: {', '.join(DNA_LM_SIZES)}")
        if not 2 <= opts.seq_len <= DNA_LM_SIZES[size].max_seq_len:
            raise ValueError(f"--seq-len {opts.seq_len} does not fit {size} (max_seq_len {DNA_LM_SIZES[size].max_seq_len})")
    if opts.reference is not None and opts.reference not in opts.systems:
        raise ValueError(f"--reference {opts.reference} is not among --systems ({', '.join(opts.systems)})")
    if opts.steps < 1 or opts.warmup < 0 or opts.batch_per_rank < 1 or min(opts.world_sizes) < 1:
        raise ValueError("--steps, --batch-per-rank and --world-sizes need integers >= 1, --warmup >= 0")
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        opts = options_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    command = "python -m benchmarks.bench_step " + shlex.join(sys.argv[1:] if argv is None else list(argv))
    result = run_benchmark(opts, _stderr)
    result["command"] = command.strip()
    text = render(result, result["command"])
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
