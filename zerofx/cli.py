"""The ``zerofx`` command line: plan, estimate and train the bundled DNA language models.

    zerofx plan 1b --world-size 1024 --stage 3      # the plan, on the meta device: no real memory
    zerofx estimate 7b --world-size 64               # model-state GiB per rank, stages 0-3
    zerofx train --world-size 2 --stage 3 --steps 20 # real training, gloo ranks on this CPU
    zerofx train --output-dir run1 --save-every 5    # checkpoints; resumes from run1's latest
    zerofx consolidate run1 model.safetensors        # one file for load_state_dict, streamed

``main(argv)`` returns the exit code: 0 on success, 2 for bad input (a one-line message on
stderr, no traceback), 1 when a training rank fails. ``train(TrainOptions(...))`` is the
training loop itself, for scripts such as ``examples/train_dna.py``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import socket
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate

import zerofx
from cost_models.memory import zero_paper_bytes
from passes.meta import is_all_gather
from passes.plan import format_bytes
from zerofx.checkpoint import consolidate, latest_complete_tag, read_metadata, resolve_tag
from zerofx.config import parse_config
from zerofx.data.genome import bundled_genome, genome_windows
from zerofx.errors import ZeroFXError, did_you_mean
from zerofx.models import DNA_LM_SIZES, DNADecoderLM, DNALMConfig
from zerofx.program import plan_program, resolve

GIB = 2**30
DEFAULT_TRAIN_STAGE = 3


class UsageError(ZeroFXError):
    """A command-line argument is missing or malformed."""


class RankFailedError(RuntimeError):
    """A training rank exited with an error; ``exit_code`` is what the CLI returns."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``UsageError``), not usage plus a message."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def model_config(name: str) -> DNALMConfig:
    """The DNA LM config for a size name; ``UsageError`` naming the accepted sizes otherwise."""
    if name not in DNA_LM_SIZES:
        raise UsageError(
            f"unknown model size {name!r}{did_you_mean(name, DNA_LM_SIZES)}; accepted: {', '.join(DNA_LM_SIZES)}"
        )
    return DNA_LM_SIZES[name]


def _check_positive(name: str, value: int) -> int:
    if value < 1:
        raise UsageError(f"{name} {value} is invalid; accepted: an integer >= 1")
    return value


def _check_stage(stage: int | None) -> int | None:
    if stage is not None and stage not in (0, 1, 2, 3):
        raise UsageError(f"--stage {stage} is not a ZeRO stage; accepted: 0, 1, 2 or 3")
    return stage


def _check_common(args: argparse.Namespace) -> DNALMConfig:
    """Check the arguments every command shares, before any slow work; return the model config."""
    cfg = model_config(args.model)
    if args.world_size is not None:
        _check_positive("--world-size", args.world_size)
    _check_stage(args.stage)
    return cfg


def _meta_example(cfg: DNALMConfig, batch_size: int, seq_len: int | None) -> tuple[DNADecoderLM, torch.Tensor]:
    """The model and a (B, T) batch of input ids on the meta device: shapes only, no memory."""
    t = min(512, cfg.max_seq_len) if seq_len is None else seq_len
    _check_positive("--batch-size", batch_size)
    if not 2 <= t <= cfg.max_seq_len:
        raise UsageError(f"--seq-len {t} is invalid for this model; accepted: 2..{cfg.max_seq_len}")
    with torch.device("meta"):
        model = DNADecoderLM(cfg)
        ids = torch.zeros(batch_size, t, dtype=torch.long)  # (B, T)
    return model, ids


# --------------------------------------------------------------------------- plan, estimate
def cmd_plan(args: argparse.Namespace) -> int:
    """Print the ZeRO plan for a bundled model size, planned on the meta device."""
    cfg = _check_common(args)
    if args.world_size is None and args.config is None:
        raise UsageError("--world-size is required (or give --config with zerofx.world_size or batch sizes)")
    model, ids = _meta_example(cfg, args.batch_size, args.seq_len)
    program = zerofx.compile(
        model, world_size=args.world_size, stage=args.stage, example_inputs=(ids,), example_kwargs={"labels": ids}, config=args.config
    )
    plan = program.plan
    if args.format == "json":
        print(plan.to_json())
        return 0
    print(f"model {args.model}: DNADecoderLM, input_ids {tuple(ids.shape)}")
    print(plan)
    per_graph: dict[str, int] = {}
    for c in plan.schedule:
        per_graph[c.graph] = per_graph.get(c.graph, 0) + 1
    print("collectives per graph: " + (", ".join(f"{g} {n}" for g, n in per_graph.items()) or "none"))
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    """Print per-rank model-state memory for each stage next to the ZeRO paper's formula."""
    cfg = _check_common(args)
    stages = [args.stage] if args.stage is not None else [0, 1, 2, 3]
    # Validate every argument before capture, which takes seconds for the large sizes.
    resolved = [resolve(args.config, stage=s, world_size=args.world_size) for s in stages]
    # Model-state bytes do not depend on the batch's shape, so a short one keeps capture cheap.
    model, ids = _meta_example(cfg, 1, min(64, cfg.max_seq_len))
    # Capture does not depend on the stage, only planning does: one capture serves every stage.
    captured = zerofx.capture_step(model, (ids,), {"labels": ids})
    rows = []
    num_params = 0
    optimizer = ""
    for s, zcfg in zip(stages, resolved):
        program = plan_program(captured, zcfg, args.world_size)
        num_params, optimizer = program.plan.num_params, program.plan.optimizer
        mem = program.memory(0)
        parts = [mem.get(k, 0) for k in ("params", "grads", "optimizer_states")]
        paper = zero_paper_bytes(num_params, stage=s, world_size=args.world_size)
        rows.append((s, *(b / GIB for b in parts), sum(parts) / GIB, paper / GIB))
    print(f"model {args.model}: {num_params:,} parameters, world size {args.world_size}, optimizer {optimizer}")
    headers = ["stage", "params GiB", "grads GiB", "optimizer_states GiB", "total GiB", "ZeRO paper GiB"]
    # Four significant digits: fixed decimals would print a small model's shards as 0.0000.
    print(tabulate(rows, headers=headers, tablefmt="simple", floatfmt=".4g"))
    print(
        "note: zerofx trains in fp32 (4 B params + 4 B grads + 8 B Adam states per parameter, sharded per stage); "
        "the ZeRO paper column is its mixed-precision Adam formula (2 + 2 + 12 B per parameter)."
    )
    return 0


# --------------------------------------------------------------------------- train
@dataclass(frozen=True)
class TrainOptions:
    """Everything a training run needs; picklable, so each spawned rank gets a copy."""

    model: str = "tiny"
    fasta: Path | None = None  # None: the bundled lambda phage genome
    world_size: int = 2
    stage: int | None = None  # None: the config's stage, else DEFAULT_TRAIN_STAGE
    config: Path | None = None
    steps: int = 20
    seq_len: int = 128
    batch_size: int = 2
    lr: float = 3e-3
    seed: int = 0
    print_graph: bool = False
    output_dir: Path | None = None  # checkpoints go here; a run resumes from its newest complete one
    save_every: int | None = None  # None: save only after the last step (when output_dir is set)


def _free_port() -> int:
    """A TCP port free right now on 127.0.0.1, for the gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_config(opts: TrainOptions) -> str | Path | Mapping[str, Any]:
    if opts.config is not None:
        return opts.config
    return {"zero_optimization": {"stage": opts.stage}, "optimizer": {"type": "AdamW", "params": {"lr": opts.lr}}}


def _check_train_options(opts: TrainOptions) -> TrainOptions:
    """Validate in the parent, before any process starts; return the options with stage and
    genome resolved. Raises ``ZeroFXError`` subclasses naming the bad value."""
    cfg = model_config(opts.model)
    _check_stage(opts.stage)
    for name, value in (("--world-size", opts.world_size), ("--steps", opts.steps), ("--batch-size", opts.batch_size)):
        _check_positive(name, value)
    if not 2 <= opts.seq_len <= cfg.max_seq_len:
        raise UsageError(f"--seq-len {opts.seq_len} is invalid for model {opts.model}; accepted: 2..{cfg.max_seq_len}")
    if opts.lr < 0:
        raise UsageError(f"--lr {opts.lr} is invalid; accepted: a number >= 0")
    if opts.save_every is not None:
        _check_positive("--save-every", opts.save_every)
        if opts.output_dir is None:
            raise UsageError("--save-every needs --output-dir, the directory the checkpoints go to")
    if opts.output_dir is not None and Path(opts.output_dir).exists() and not Path(opts.output_dir).is_dir():
        raise UsageError(f"--output-dir {str(opts.output_dir)!r} is a file; accepted: a directory (created if missing)")
    stage = opts.stage
    if stage is None:
        file_stage = parse_config(opts.config).stage if opts.config is not None else None
        stage = DEFAULT_TRAIN_STAGE if file_stage is None else file_stage
    fasta = bundled_genome() if opts.fasta is None else Path(opts.fasta)
    # The last rank's first batch needs batch_size whole groups of windows: reading that far
    # (unshuffled, so no buffer fills) checks the file and its length before any process starts.
    next(genome_windows(fasta, opts.seq_len, rank=opts.world_size - 1, world_size=opts.world_size,
                        batch_size=opts.batch_size, shuffle_windows=0))
    opts = replace(opts, stage=stage, fasta=fasta)
    resolve(opts.config, stage=stage, world_size=opts.world_size)  # the config, and that it agrees
    return opts


def _cycle_batches(opts: TrainOptions, rank: int) -> Iterator[torch.Tensor]:
    """This rank's batches forever: each pass over the genome reshuffles with the next seed."""
    epoch = 0
    while True:
        assert opts.fasta is not None
        yield from genome_windows(
            opts.fasta, opts.seq_len, rank=rank, world_size=opts.world_size, batch_size=opts.batch_size, seed=opts.seed + epoch
        )
        epoch += 1


def _print_graph(engine: zerofx.Engine) -> None:
    modules = engine.graph_modules()
    print(f"# rank {engine.rank} ZeRO stage {int(engine.stage)} forward graph")
    print(modules["forward"].code.strip())
    counts = {g: sum(1 for n in modules[g].graph.nodes if is_all_gather(n)) for g in ("forward", "backward")}
    print(f"all_gather_into_tensor nodes: forward {counts['forward']}, backward {counts['backward']}", flush=True)


def _resume(engine: zerofx.Engine, opts: TrainOptions, rank: int) -> tuple[int, int]:
    """Load the newest complete checkpoint in ``opts.output_dir``, if there is one; return the
    training step it was saved after and how many batches this rank's stream had consumed."""
    assert opts.output_dir is not None
    tag = latest_complete_tag(opts.output_dir)
    if tag is None:
        return 0, 0
    meta = read_metadata(opts.output_dir, tag)
    client = engine.load_checkpoint(opts.output_dir, tag)
    # A checkpoint saved outside ``zerofx train`` has no data position: count one batch per step.
    step = int(client.get("step", engine.global_steps))
    if rank == 0:
        print(
            f"resuming from checkpoint {Path(opts.output_dir) / tag}: step {step}, saved at world size "
            f"{meta['world_size']} and ZeRO stage {meta['stage']}",
            flush=True,
        )
        if meta["world_size"] != engine.world_size:
            # Windows are dealt to ranks by world size (NOTE [How windows are assigned to ranks]).
            print(f"note: the genome's windows are now split over {engine.world_size} ranks; the data order differs from "
                  f"an uninterrupted run at world size {meta['world_size']}", flush=True)
    return step, int(client.get("batches_consumed", step))


def _train_rank(rank: int, opts: TrainOptions) -> None:
    """One rank's training loop; runs inside an initialized process group."""
    world_size = dist.get_world_size()
    torch.manual_seed(opts.seed)
    model = DNADecoderLM(DNA_LM_SIZES[opts.model])
    batches = _cycle_batches(opts, rank)
    first = next(batches)  # (B, T)
    engine = zerofx.initialize(
        model, config=_engine_config(opts), stage=opts.stage, example_inputs=(first,), example_kwargs={"labels": first}
    )
    if rank == 0:
        print(
            f"training {opts.model} ({engine.program.plan.num_params:,} parameters) at ZeRO stage {opts.stage} on "
            f"{world_size} gloo ranks, batch {opts.batch_size}x{opts.seq_len} per rank, genome {Path(opts.fasta).name}",
            flush=True,
        )
        if opts.print_graph:
            _print_graph(engine)
    stream = itertools.chain([first], batches)
    start, consumed = _resume(engine, opts, rank) if opts.output_dir is not None else (0, 0)
    for _ in range(consumed):  # the data position: skip what the checkpointed steps trained on
        next(stream)
    if start >= opts.steps and rank == 0:
        print(f"the checkpoint is at step {start}: --steps {opts.steps} already reached, nothing to train", flush=True)
    for step in range(start + 1, opts.steps + 1):
        batch = next(stream)
        t0 = time.perf_counter()
        loss = engine(batch, labels=batch)
        engine.backward(loss)
        engine.step()
        elapsed = time.perf_counter() - t0
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # every rank must join the collective, not only the printer
        if rank == 0:
            print(f"step {step}/{opts.steps} loss {mean_loss.item() / world_size:.4f} ({elapsed:.3f} s/step)", flush=True)
        if opts.output_dir is not None and (step == opts.steps or (opts.save_every and step % opts.save_every == 0)):
            tag = f"step-{step:08d}"
            engine.save_checkpoint(opts.output_dir, tag, client_state={"step": step, "batches_consumed": consumed + step - start})
            if rank == 0:
                print(f"saved checkpoint {Path(opts.output_dir) / tag}", flush=True)


def _train_worker(rank: int, opts: TrainOptions, port: int) -> None:
    """Entry point of one spawned rank: join the gloo group, train, report a user error in one line."""
    # Ranks share this machine's cores; more threads than cores per rank slows every rank down.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // opts.world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=opts.world_size)
    try:
        _train_rank(rank, opts)
    except ZeroFXError as exc:
        print(f"zerofx: error: rank {rank}: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)  # SystemExit passes through mp.spawn's wrapper as this exit code
    finally:
        dist.destroy_process_group()


def train(opts: TrainOptions) -> None:
    """Train ``opts.model`` on ``opts.world_size`` local gloo (CPU) ranks; rank 0 prints each
    step's loss averaged over ranks. Raises ``ZeroFXError`` for bad options before starting any
    process, and ``RankFailedError`` when a rank fails (its traceback printed to stderr)."""
    opts = _check_train_options(opts)
    try:
        mp.spawn(_train_worker, args=(opts, _free_port()), nprocs=opts.world_size, join=True)
    except mp.ProcessRaisedException as exc:
        print(str(exc).strip(), file=sys.stderr)
        last = str(exc).strip().splitlines()[-1]
        raise RankFailedError(f"rank {exc.error_index} failed: {last}") from None
    except mp.ProcessExitedException as exc:
        raise RankFailedError(
            f"rank {exc.error_index} exited with code {exc.exit_code}", exit_code=2 if exc.exit_code == 2 else 1
        ) from None


def cmd_train(args: argparse.Namespace) -> int:
    train(
        TrainOptions(
            model=args.model, fasta=args.fasta, world_size=args.world_size, stage=args.stage, config=args.config,
            steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
            print_graph=args.print_graph, output_dir=args.output_dir, save_every=args.save_every,
        )
    )
    return 0


# --------------------------------------------------------------------------- consolidate
def cmd_consolidate(args: argparse.Namespace) -> int:
    """Write a sharded checkpoint as one safetensors file, streaming tensor by tensor."""
    tag = resolve_tag(args.ckpt_dir, args.tag).name  # one tag for the metadata and the data, even if a save lands now
    meta = read_metadata(args.ckpt_dir, tag)
    out = consolidate(args.ckpt_dir, args.out, tag=tag, dtype=args.dtype)
    print(
        f"wrote {out} ({format_bytes(out.stat().st_size)}, {args.dtype}): {len(meta['state_dict_keys'])} tensors of "
        f"{meta['model_class']} at step {meta['step']}, from {meta['world_size']} rank files of {Path(args.ckpt_dir) / tag}"
    )
    return 0


# --------------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    sizes = ", ".join(DNA_LM_SIZES)
    parser = _Parser(prog="zerofx", description="ZeRO-style sharded training as torch.fx compiler passes.")
    parser.add_argument("--version", action="version", version=f"zerofx {zerofx.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("plan", help="print the ZeRO plan for a DNA LM size (planned on the meta device)",
                       description="Capture and plan a DNA LM on the meta device (no parameter memory) and print the plan.")
    p.add_argument("model", metavar="MODEL", help=f"DNA LM size: {sizes}")
    p.add_argument("--world-size", type=int, help="number of ranks to plan for (required unless the config implies it)")
    p.add_argument("--stage", type=int, help="ZeRO stage 0, 1, 2 or 3 (required unless the config sets it)")
    p.add_argument("--config", type=Path, help="DeepSpeed-style JSON config (ds_config.json)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence in the example batch (default: min(512, max_seq_len))")
    p.add_argument("--batch-size", type=int, default=1, help="sequences in the example batch (default: 1)")
    p.add_argument("--format", choices=("table", "json"), default="table", help="output format (default: table)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("estimate", help="per-rank model-state memory per ZeRO stage, vs the ZeRO paper",
                       description="Per-rank bytes of parameters, gradients and optimizer states for ZeRO stages 0-3.")
    p.add_argument("model", metavar="MODEL", help=f"DNA LM size: {sizes}")
    p.add_argument("--world-size", type=int, required=True, help="number of ranks")
    p.add_argument("--stage", type=int, help="only this ZeRO stage (default: all of 0, 1, 2, 3)")
    p.add_argument("--config", type=Path, help="DeepSpeed-style JSON config; its optimizer decides the state size")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("train", help="train a DNA LM on local gloo (CPU) ranks",
                       description="Spawn local gloo ranks and train a DNA LM with zerofx on a FASTA genome.")
    p.add_argument("--model", default="tiny", help=f"DNA LM size: {sizes} (default: tiny)")
    p.add_argument("--fasta", type=Path, help="FASTA genome, plain or .gz (default: the bundled lambda phage genome)")
    p.add_argument("--world-size", type=int, default=2, help="number of local ranks to spawn (default: 2)")
    p.add_argument("--stage", type=int, help=f"ZeRO stage 0-3 (default: the config's, else {DEFAULT_TRAIN_STAGE})")
    p.add_argument("--config", type=Path, help="DeepSpeed-style JSON config; replaces the default AdamW and --lr")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps (default: 20)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per window (default: 128)")
    p.add_argument("--batch-size", type=int, default=2, help="windows per rank per step (default: 2)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate when no --config (default: 3e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed for the model init and the data shuffle (default: 0)")
    p.add_argument("--print-graph", action="store_true", help="print rank 0's forward graph and its all-gather counts")
    p.add_argument("--output-dir", type=Path,
                   help="save sharded checkpoints here, and resume from its newest complete one (default: no checkpoints)")
    p.add_argument("--save-every", type=int, help="save every K training steps (default: only after the last step)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("consolidate", help="write a sharded checkpoint as one safetensors file",
                       description="Stream a sharded zerofx checkpoint into one safetensors file with the model's "
                                   "state_dict keys, tensor by tensor: memory stays bounded whatever the model's size.")
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", type=Path, help="the checkpoint directory (engine.save_checkpoint's save_dir)")
    p.add_argument("out", metavar="OUT.safetensors", type=Path, help="the file to write")
    p.add_argument("--tag", help="which checkpoint (default: the newest complete one)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="floating-point dtype of the output (default: fp32)")
    p.set_defaults(func=cmd_consolidate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``zerofx`` command line; return the exit code (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        return args.func(args)
    except SystemExit as exc:  # --help and --version exit through argparse
        return exc.code if isinstance(exc.code, int) else 0
    except RankFailedError as exc:
        print(f"zerofx: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ZeroFXError as exc:
        print(f"zerofx: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
