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
import faulthandler
import gc
import itertools
import json
import math
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tabulate import tabulate
from tqdm import tqdm

import zerofx
from zerofx.cost_models.memory import paper_breakdown
from zerofx.cost_models.profiles import load_profile
from zerofx.passes.analyze_schedule import format_report
from zerofx.passes.meta import is_all_gather
from zerofx.passes.plan import format_bytes
from zerofx.checkpoint import (
    consolidate,
    latest_complete_tag,
    read_metadata,
    resolve_tag,
)
from zerofx.config import load_config, parse_bytes, parse_config
from zerofx.data.genome import MAX_FOREIGN_FRACTION, bundled_genome, genome_stats, genome_windows
from zerofx.errors import ZeroFXError, did_you_mean
from zerofx.folding import (
    AUTO_FOLD_MIN_BLOCKS,
    FOLD_BLOCKS,
    RepeatedBlocks,
    find_repeated_blocks,
    folded_json,
    format_folded,
    plan_folded,
)
from zerofx.models import DNA_LM_SIZES, DNADecoderLM, DNALMConfig
from zerofx.offload_plan import plan_for_program
from zerofx.planning import (
    ModelSpec,
    load_model_spec,
    plot_report,
    report_json,
    running_model_code,
    solve_memory,
)
from zerofx.program import MAX_WORLD_SIZE, Program, plan_program, resolve
from zerofx.rss import peak_rss_bytes

DEFAULT_TRAIN_STAGE = 3
DEFAULT_TRAIN_BATCH = 2


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
def _load_model(args: argparse.Namespace) -> ModelSpec:
    """A bundled DNA LM size (built on the meta device) or a FILE.py:CALLABLE / MODULE:CALLABLE spec."""
    if ":" in args.model:
        return load_model_spec(args.model)
    cfg = model_config(args.model)
    model, ids = _meta_example(cfg, getattr(args, "batch_size", 1), getattr(args, "seq_len", None))
    return ModelSpec(model, (ids,), {"labels": ids}, args.model)


def _check_output_file(flag: str, path: Path) -> None:
    """Raise ``UsageError`` unless ``path`` can be written: not a folder, in an existing folder
    that accepts a new file. Commands call it before their slow work (capture, measuring), so a
    typo in the folder costs nothing. The probe is a real file created and removed, since
    ``os.access`` answers yes to root on a read-only mount or folder."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{flag} {str(path)!r} is a folder; accepted: a file path in an existing, writable folder")
    folder = path.parent
    if not folder.is_dir():
        raise UsageError(f"{flag} {str(path)!r}: folder {str(folder)!r} does not exist; create it or give a path in an existing folder")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".zerofx-write-check-")
    except OSError as exc:
        raise UsageError(f"{flag} {str(path)!r}: cannot create a file in folder {str(folder)!r} ({exc.strerror}); "
                         "accepted: a path in a writable folder") from exc
    os.close(fd)
    os.unlink(probe)
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {str(path)!r} exists and is read-only; accepted: a writable file or a new path")


def _profile(args: argparse.Namespace) -> tuple[Any, Any]:
    try:
        return load_profile(args.profile)
    except ValueError as exc:
        raise UsageError(f"--profile: {exc}") from exc


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the ZeRO plan, the communication schedule, memory per rank and a summary."""
    if ":" not in args.model:
        model_config(args.model)
    if args.world_size is not None:
        _check_positive("--world-size", args.world_size)
    _check_stage(args.stage)
    if args.world_size is None and args.config is None:
        raise UsageError("--world-size is required (or give --config with zerofx.world_size or batch sizes)")
    budget = parse_bytes(args.budget) if args.budget is not None else None
    user_config = args.config
    if budget is not None:  # the planner fits the prefetch distance to it (zerofx.memory_budget)
        args.config = _with_memory_budget(args.config, budget)
    if args.solve is not None and budget is None:
        raise UsageError(f"--solve {args.solve} needs --budget, the memory per rank to fit in (e.g. 80GiB)")
    if args.plot is not None:
        _check_output_file("--plot", args.plot)
    comm, device = _profile(args)
    spec = _load_model(args)
    with running_model_code(spec.label):  # a sys.exit in the spec's forward is an error, not exit 0
        return _plan_spec(args, spec, budget, user_config, comm, device)


def _plan_spec(args: argparse.Namespace, spec: ModelSpec, budget: float | None, user_config: Path | None, comm: Any,
               device: Any) -> int:
    """``cmd_plan`` once the arguments are checked and the model is loaded: capture, plan, print."""
    blocks = find_repeated_blocks(spec.model)
    fold = args.fold == "on" or (args.fold == "auto" and blocks is not None and blocks.count >= AUTO_FOLD_MIN_BLOCKS)
    if args.fold == "on" and blocks is None:
        raise UsageError(f"--fold on: {spec.label} has no nn.ModuleList/nn.Sequential of identical blocks to fold; use --fold off")
    if args.fold == "on" and blocks.count < FOLD_BLOCKS[1]:
        raise UsageError(f"--fold on: {spec.label}'s {blocks.path!r} holds {blocks.count} blocks; folding needs at least "
                         f"{FOLD_BLOCKS[1]} (it captures {FOLD_BLOCKS[0]} and {FOLD_BLOCKS[1]}); use --fold off")
    if fold:
        return _plan_folded(args, spec, blocks, comm, device, budget)
    program = zerofx.compile(spec.model, world_size=args.world_size, stage=args.stage, config=args.config,
                             example_inputs=spec.args, example_kwargs=spec.kwargs)
    report = program.report(args.rank, comm=comm, device=device)
    solved = None
    if args.solve is not None:
        if args.solve == "seq_len":
            upper = getattr(getattr(spec.model, "cfg", None), "max_seq_len", None) or args.max_seq_len
        else:
            upper = args.max_batch_size
        # The user's config: each sample must plan the same prefetch, or their nodes would not align.
        solved = solve_memory(spec, args.solve, world_size=program.world_size, stage=int(program.stage), config=user_config,
                              budget_bytes=budget, upper=upper, rank=args.rank)
    if args.plot is not None:
        plot_report(report, args.plot, title=spec.label, budget_bytes=budget)
    cfg = resolve(args.config, stage=args.stage, world_size=args.world_size)
    offload = plan_for_program(program.plan, cfg.offload, cfg.param_offload, mixed_precision=cfg.compute_dtype is not None,
                               device_is_cpu=device.name.startswith("cpu"), compute_s=report.compute_s)
    if args.format == "json":
        data = json.loads(report_json(program, report, budget))
        if offload is not None:
            data["offload"] = json.loads(offload.to_json())
        if solved is not None:
            data["solve"] = {solved.variable: solved.value, "peak_bytes_expr": str(solved.peak_expr), "peak_at": solved.peak_node,
                             "samples": [list(x) for x in solved.samples]}
        print(json.dumps(data, indent=1))
        return 0
    shapes = ", ".join(str(tuple(t.shape)) for t in [*spec.args, *spec.kwargs.values()] if isinstance(t, torch.Tensor))
    print(f"model {spec.label}: {type(spec.model).__name__}, example inputs {shapes}; profile {comm.name} / {device.name}")
    print(program.plan)
    if offload is not None:
        print(offload)
    print(format_report(report, budget_bytes=budget))
    if solved is not None:
        what = "longest sequence" if solved.variable == "seq_len" else "largest batch"
        print(f"{what} that fits {format_bytes(budget)} per rank: {solved.variable} = {solved.value} "
              f"(peak bytes = {solved.peak_expr} at {solved.peak_node}, exact in B (batch) and T (tokens) "
              f"from captures at (B, T) = {', '.join(map(str, solved.samples))})")
    if args.plot is not None:
        print(f"wrote {args.plot}")
    return 0


def _with_memory_budget(config: Path | Mapping[str, Any] | None, budget_bytes: float) -> dict[str, Any]:
    raw = dict(load_config(config)) if config is not None else {}
    raw["zerofx"] = {**raw.get("zerofx", {}), "memory_budget": budget_bytes}
    return raw


def _plan_folded(args: argparse.Namespace, spec: ModelSpec, blocks: RepeatedBlocks, comm: Any, device: Any,
                 budget: float | None) -> int:
    """``zerofx plan`` from captures of the model cut to 2 and 3 blocks (``zerofx.folding``)."""
    if args.solve is not None or args.plot is not None:
        raise UsageError("--solve and --plot need the whole model's timeline: add --fold off")
    programs: list[Program] = []

    def report_for(model: torch.nn.Module, config: Mapping[str, Any]) -> Any:
        program = zerofx.compile(model, world_size=args.world_size, stage=args.stage, config=config,
                                 example_inputs=spec.args, example_kwargs=spec.kwargs)
        programs.append(program)
        return program.report(args.rank, comm=comm, device=device)

    # The cut models' peaks are smaller than the whole model's, so the planner cannot fit the
    # prefetch distance to the budget on them (NOTE [Prefetch under a memory budget]): folding
    # does it here, on the extrapolated peak.
    config = dict(load_config(args.config)) if args.config is not None else {}
    own = {k: v for k, v in config.get("zerofx", {}).items() if k != "memory_budget"}
    folded = plan_folded(spec.model, blocks, lambda m: report_for(m, {**config, "zerofx": own}), parallel=True)
    sample = programs[-1]
    first_distance = distance = sample.plan.prefetch_distance
    while budget is not None and folded.peak_bytes > budget and distance > 0:
        distance -= 1
        folded = plan_folded(spec.model, blocks, lambda m, d=distance: report_for(m, {**config, "zerofx": {**own, "prefetch_distance": d}}),
                             parallel=True)
        sample = programs[-1]
    decisions = [] if distance == first_distance else [
        f"prefetch distance lowered from {first_distance} to {distance} for the memory budget {format_bytes(budget)} "
        f"(extrapolated peak {format_bytes(folded.peak_bytes)})"]
    if args.format == "json":
        plan_json = json.loads(sample.plan.to_json())
        plan_json["decisions"] = [*plan_json.get("decisions", []), *decisions]
        print(json.dumps(folded_json(folded, plan_json, budget), indent=1, default=list))
        return 0
    shapes = ", ".join(str(tuple(t.shape)) for t in [*spec.args, *spec.kwargs.values()] if isinstance(t, torch.Tensor))
    num_params = sum(p.numel() for p in spec.model.parameters())
    print(f"model {spec.label}: {type(spec.model).__name__}, {num_params:,} parameters, example inputs {shapes}; "
          f"profile {comm.name} / {device.name}")
    print(f"plan of the 2-block capture (the whole model's {blocks.count} blocks plan the same way block by block):")
    print(sample.plan)
    for d in decisions:
        print(f"decision: {d}")
    print(format_folded(folded, budget_bytes=budget))
    return 0


def cmd_estimate(args: argparse.Namespace) -> int:
    """Model-state memory per device with the ZeRO paper's accounting, for each stage."""
    _check_positive("--world-size", args.world_size)
    _check_stage(args.stage)
    if (args.params is None) == (args.model is None):
        raise UsageError("give exactly one of --params P and --model MODEL")
    stages = [args.stage] if args.stage is not None else [0, 1, 2, 3]
    activations: dict[int, float] = {}
    if args.params is not None:
        if args.params <= 0:
            raise UsageError(f"--params {args.params} is invalid; accepted: a number > 0 (e.g. 7.5e9)")
        num_params, label = float(args.params), f"{args.params:g} parameters"
    else:
        spec = _load_model(args)
        # Capture does not depend on the stage, only planning does: one capture serves every stage.
        with running_model_code(spec.label):
            captured = zerofx.capture_step(spec.model, spec.args, spec.kwargs)
        for s in stages:
            program = plan_program(captured, resolve(args.config, stage=s, world_size=args.world_size), args.world_size)
            report = program.report(0)
            activations[s] = report.peak.live_bytes - report.persistent_bytes
        num_params = float(sum(p.numel for p in captured.params))
        label = f"{spec.label}: {int(num_params):,} parameters"
    rows, per_stage = [], {}
    for s in stages:
        b = paper_breakdown(num_params, stage=s, world_size=args.world_size, offload=args.offload, offload_param=args.offload_param)
        per_stage[s] = {**b, **({"activation_peak_bytes": activations[s]} if s in activations else {})}
        row = [s, b["params_bytes"] / 1e9, b["grads_bytes"] / 1e9, b["optimizer_states_bytes"] / 1e9, b["per_device_bytes"] / 1e9]
        if args.offload != "none":
            row.append(b["offloaded_bytes"] / 1e9)
        if args.offload_param != "none":
            row.append(b["offloaded_param_bytes"] / 1e9)
        if activations:
            row.append(activations[s] / 1e9)
        rows.append(row)
    if args.format == "json":
        print(json.dumps({"params": num_params, "world_size": args.world_size, "offload": args.offload,
                          "per_device_bytes": {str(s): per_stage[s]["per_device_bytes"] for s in stages},
                          "stages": {str(s): v for s, v in per_stage.items()}}, indent=1))
        return 0
    headers = ["stage", "params GB", "grads GB", "optimizer states GB", "per device GB"]
    if args.offload != "none":
        headers.append(f"on {args.offload} GB")
    if args.offload_param != "none":
        headers.append(f"params on {args.offload_param} GB (stage 3)")
    if activations:
        headers.append("activation peak GB (fp32, memory model)")
    print(f"{label}, world size {args.world_size}, mixed-precision Adam (ZeRO paper: 2 + 2 + 12 bytes per parameter)"
          + (f", optimizer states offloaded to {args.offload}" if args.offload != "none" else ""))
    print(tabulate(rows, headers=headers, tablefmt="simple", floatfmt=".4g"))
    return 0


def cmd_config_schema(args: argparse.Namespace) -> int:
    """Print every config key zerofx knows, generated from ``zerofx.config.SCHEMA``."""
    from zerofx.config import schema_rows

    rows = schema_rows()
    if args.format == "json":
        print(json.dumps([dict(zip(("key", "type", "accepted", "acted_on", "meaning"), r)) for r in rows], indent=1))
    else:
        print(tabulate(rows, headers=["key", "type", "accepted", "acted on", "meaning"], tablefmt="github"))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure collectives and compute on local gloo ranks; write a profile for ``plan --profile``."""
    _check_positive("--world-size", args.world_size)
    _check_positive("--repeats", args.repeats)
    _check_output_file("--out", args.out)  # before about 11 s of measuring, not after
    from zerofx.calibrate import calibrate

    comm, device = calibrate(args.out, world_size=args.world_size, repeats=args.repeats)
    print(f"wrote {args.out}: all-gather latency {comm.intra_alpha_s * 1e6:.0f} us per ring step, bus bandwidth "
          f"{comm.intra_bandwidth / 1e9:.3g} GB/s; matmul {device.matmul_flops_per_s / 1e9:.3g} GFLOP/s, "
          f"memory {device.memory_bytes_per_s / 1e9:.3g} GB/s per rank")
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
    batch_size: int | None = None  # None: the config's train_micro_batch_size_per_gpu, else 2
    lr: float = 3e-3
    seed: int = 0
    print_graph: bool = False
    output_dir: Path | None = None  # checkpoints and train_log.jsonl go here; a run resumes from its newest complete one
    eval_batches: int = 8  # held-out batches per rank evaluated after training
    save_every: int | None = None  # None: save only after the last step (when output_dir is set)
    keep_last: int | None = None  # None: keep every checkpoint; K: delete the oldest beyond the newest K
    collective_timeout_s: float | None = None  # None: the config's zerofx.collective_timeout_s (default 300)


def _free_port() -> int:
    """A TCP port free right now on 127.0.0.1, for the gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_config(opts: TrainOptions) -> str | Path | Mapping[str, Any]:
    raw: dict[str, Any]
    if opts.config is not None:
        if opts.collective_timeout_s is None:
            return opts.config
        raw = load_config(opts.config)
    else:
        raw = {"zero_optimization": {"stage": opts.stage}, "optimizer": {"type": "AdamW", "params": {"lr": opts.lr}}}
    if opts.collective_timeout_s is not None:  # the flag wins over the config, on every rank alike
        raw.setdefault("zerofx", {})["collective_timeout_s"] = opts.collective_timeout_s
    return raw


def _collective_timeout(opts: TrainOptions) -> timedelta:
    """The process group's timeout: --collective-timeout, else the config's (NOTE [The collective timeout])."""
    return timedelta(seconds=parse_config(_engine_config(opts)).collective_timeout_s)


def _config_micro_batch(opts: TrainOptions) -> tuple[int, str] | None:
    """The micro-batch per rank the config states or implies, and where it comes from, after
    checking DeepSpeed's rule train_batch_size = train_micro_batch_size_per_gpu x
    gradient_accumulation_steps x world size. With only train_batch_size, the micro-batch is what
    the rule leaves, as DeepSpeed derives it; with neither, None."""
    if opts.config is None:
        return None
    raw = parse_config(opts.config).raw
    total, micro = raw.get("train_batch_size"), raw.get("train_micro_batch_size_per_gpu")
    accumulate, world = raw.get("gradient_accumulation_steps", 1), opts.world_size
    if total is None:
        return None if micro is None else (micro, f"train_micro_batch_size_per_gpu={micro}")
    if micro is not None:
        if total != micro * accumulate * world:
            raise UsageError(
                f"the config's train_batch_size={total} is not train_micro_batch_size_per_gpu={micro} x "
                f"gradient_accumulation_steps={accumulate} x world size {world} = {micro * accumulate * world} "
                "(DeepSpeed's rule); change one of them"
            )
        return micro, f"train_micro_batch_size_per_gpu={micro}"
    if total % (accumulate * world):
        raise UsageError(
            f"the config's train_batch_size={total} is not divisible by gradient_accumulation_steps={accumulate} x "
            f"world size {world}, so no micro-batch per rank fits DeepSpeed's rule; change one of them"
        )
    micro = total // (accumulate * world)
    return micro, f"train_batch_size={total} / (gradient_accumulation_steps={accumulate} x world size {world}) = {micro}"


def _check_train_options(opts: TrainOptions) -> TrainOptions:
    """Validate in the parent, before any process starts; return the options with stage, batch
    size and genome resolved. Raises ``ZeroFXError`` subclasses naming the bad value."""
    cfg = model_config(opts.model)
    _check_stage(opts.stage)
    for name, value in (("--world-size", opts.world_size), ("--steps", opts.steps)):
        _check_positive(name, value)
    if opts.batch_size is not None:
        _check_positive("--batch-size", opts.batch_size)
    from_config = _config_micro_batch(opts)
    if opts.batch_size is None:
        opts = replace(opts, batch_size=DEFAULT_TRAIN_BATCH if from_config is None else from_config[0])
    elif from_config is not None and opts.batch_size != from_config[0]:
        # An error, not an override: the config's train_batch_size (and the lr tuned for it) assume its micro-batch.
        raise UsageError(
            f"--batch-size {opts.batch_size} disagrees with the config's micro-batch per rank, {from_config[1]}; "
            "leave out --batch-size or make them equal"
        )
    if not 2 <= opts.seq_len <= cfg.max_seq_len:
        raise UsageError(f"--seq-len {opts.seq_len} is invalid for model {opts.model}; accepted: 2..{cfg.max_seq_len}")
    if not (isinstance(opts.lr, (int, float)) and math.isfinite(opts.lr) and opts.lr >= 0):
        raise UsageError(f"--lr {opts.lr} is invalid; accepted: a finite number >= 0")
    if not 0 <= opts.seed <= MAX_SEED:
        raise UsageError(f"--seed {opts.seed} is invalid; accepted: an integer in 0..{MAX_SEED}")
    if opts.save_every is not None:
        _check_positive("--save-every", opts.save_every)
        if opts.output_dir is None:
            raise UsageError("--save-every needs --output-dir, the directory the checkpoints go to")
    if opts.keep_last is not None:
        _check_positive("--keep-last", opts.keep_last)
        if opts.output_dir is None:
            raise UsageError("--keep-last needs --output-dir, the directory the checkpoints go to")
    if opts.collective_timeout_s is not None and not (
            isinstance(opts.collective_timeout_s, (int, float)) and math.isfinite(opts.collective_timeout_s) and opts.collective_timeout_s > 0):
        raise UsageError(f"--collective-timeout {opts.collective_timeout_s} is invalid; accepted: a finite number of seconds > 0")
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
            opts.fasta, opts.seq_len, rank=rank, world_size=opts.world_size, batch_size=opts.batch_size,
            seed=opts.seed + epoch, split="train",
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
    device = _device()
    model = DNADecoderLM(DNA_LM_SIZES[opts.model]).to(device)
    batches = (b.to(device) for b in _cycle_batches(opts, rank))
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
    log = _JsonlLog(Path(opts.output_dir) / "train_log.jsonl" if opts.output_dir is not None and rank == 0 else None)
    tokens_per_step = opts.batch_size * opts.seq_len * world_size
    bar = tqdm(total=opts.steps, initial=start, desc="train", unit="step", disable=rank != 0 or not sys.stderr.isatty())
    accumulate = engine.gradient_accumulation_steps  # micro-batches per optimizer step
    tokens_per_step *= accumulate
    for step in range(start + 1, opts.steps + 1):
        t0 = time.perf_counter()
        micro_losses = []
        for _ in range(accumulate):
            batch = next(stream)
            loss = engine(batch, labels=batch)
            engine.backward(loss)
            engine.step()  # steps the optimizer at the accumulation boundary only
            micro_losses.append(loss.detach().float())
        elapsed = time.perf_counter() - t0
        mean_loss = torch.stack(micro_losses).mean()
        dist.all_reduce(mean_loss)  # every rank must join the collective, not only the printer
        mean = mean_loss.item() / world_size
        state_bytes = sum(engine.memory().values())
        if rank == 0:
            rss = peak_rss_bytes()
            bar.set_postfix(loss=f"{mean:.4f}", tok_s=f"{tokens_per_step / elapsed:,.0f}", state=format_bytes(state_bytes), rss=format_bytes(rss))
            bar.update(1)
            bar.write(f"step {step}/{opts.steps} loss {mean:.4f} ({elapsed:.3f} s/step, {tokens_per_step / elapsed:,.0f} tokens/s)")
            log.write(step=step, loss=mean, lr=engine.optimizer.param_groups[0]["lr"], step_s=elapsed,
                      tokens_per_s=tokens_per_step / elapsed, model_state_bytes_per_rank=state_bytes, peak_rss_bytes=rss)
        if opts.output_dir is not None and (step == opts.steps or (opts.save_every and step % opts.save_every == 0)):
            tag = f"step-{step:08d}"
            engine.save_checkpoint(opts.output_dir, tag, client_state={"step": step, "batches_consumed": consumed + (step - start) * accumulate},
                                   keep_last=opts.keep_last)
            if rank == 0:
                bar.write(f"saved checkpoint {Path(opts.output_dir) / tag}")
    bar.close()
    _evaluate(engine, opts, rank, log)


class _JsonlLog:
    """One JSON object per line (rank 0 only): appended and flushed as training goes, so a crash
    loses nothing already logged."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, **record: Any) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps({"time": time.time(), **record}) + "\n")


def _evaluate(engine: zerofx.Engine, opts: TrainOptions, rank: int, log: _JsonlLog) -> None:
    """Perplexity on the held-out slice of the genome (every 10th group of windows, never trained on)."""
    assert opts.fasta is not None
    total, count = torch.zeros(2), 0
    try:
        for batch in itertools.islice(genome_windows(opts.fasta, opts.seq_len, rank=rank, world_size=opts.world_size,
                                                     batch_size=opts.batch_size, split="eval", shuffle_windows=0), opts.eval_batches):
            total[0] += engine(batch, labels=batch).detach().float().item()
            count += 1
    except ZeroFXError:  # a genome too short to hold out one batch per rank: nothing to evaluate
        count = 0
    total[1] = count
    dist.all_reduce(total)
    if total[1] == 0:
        if rank == 0:
            print("eval: the held-out slice has no full batch at this world size; skipped", flush=True)
        return
    loss = (total[0] / total[1]).item()
    if rank == 0:
        print(f"eval on held-out windows ({int(total[1])} batches over {opts.world_size} ranks): loss {loss:.4f}, "
              f"perplexity {math.exp(loss):.3f}, {loss / math.log(2):.3f} bits per token", flush=True)
        log.write(eval_loss=loss, eval_perplexity=math.exp(loss), eval_batches=int(total[1]))


def _train_worker(rank: int, opts: TrainOptions, port: int) -> None:
    """Entry point of one spawned rank: join the gloo group, train, report a user error in one line."""
    faulthandler.enable()  # a rank killed by a signal prints every thread's Python stack to stderr
    # Ranks share this machine's cores; more threads than cores per rank slows every rank down.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // opts.world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=opts.world_size,
                            timeout=_collective_timeout(opts))
    try:
        _train_rank(rank, opts)
    except ZeroFXError as exc:
        print(f"zerofx: error: rank {rank}: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)  # SystemExit passes through mp.spawn's wrapper as this exit code
    finally:
        dist.destroy_process_group()


def _device() -> torch.device:
    """CUDA (this process's local GPU) when there is one, else the CPU: the same code runs NCCL or gloo."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def under_torchrun() -> bool:
    """True inside a process torchrun (torch.distributed.run) started: it sets these variables."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def _train_under_torchrun(opts: TrainOptions) -> None:
    """torchrun is the launcher (single- or multi-node): join its process group and train this rank."""
    world_size = int(os.environ["WORLD_SIZE"])
    opts = _check_train_options(replace(opts, world_size=world_size))
    if torch.cuda.is_available():
        torch.cuda.set_device(_device())
    if int(os.environ["RANK"]) == 0:
        print(genome_stats(opts.fasta).summary(), flush=True)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=_collective_timeout(opts))
    try:
        _train_rank(dist.get_rank(), opts)
    finally:
        dist.destroy_process_group()


def train(opts: TrainOptions) -> None:
    """Train ``opts.model`` on ``opts.world_size`` local gloo (CPU) ranks; rank 0 prints each
    step's loss averaged over ranks. Raises ``ZeroFXError`` for bad options before starting any
    process, and ``RankFailedError`` when a rank fails (its traceback printed to stderr).

    Under torchrun (``torchrun --nproc-per-node N -m zerofx.cli train ...``), this process is
    one rank of torchrun's job instead, on one or many nodes, and ``--world-size`` is torchrun's.
    """
    if under_torchrun():
        _train_under_torchrun(opts)
        return
    opts = _check_train_options(opts)
    print(genome_stats(opts.fasta).summary(), flush=True)
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
            keep_last=args.keep_last, collective_timeout_s=args.collective_timeout_s,
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
# The largest world size zerofx plans for is zerofx.program.MAX_WORLD_SIZE (2**20 ranks), far
# beyond today's largest clusters and far inside the int64 group size the functional
# collectives take (2**63 fails in C++); a bound that catches a typo (an extra 0) costs nothing.
# Local ranks (train, calibrate) are processes on this machine, each with torch loaded (a few
# hundred MiB) and cpu_count / world_size threads: beyond 256 they only contend. torchrun's
# world size is not bounded by this.
MAX_LOCAL_RANKS = 256
# `zerofx estimate --params`: 10**15, about a thousand times any model trained so far; its 16
# bytes per parameter stay far inside a float.
MAX_PARAMS = 1e15
# torch.manual_seed takes a 64-bit unsigned seed.
MAX_SEED = 2**64 - 1


def _int_arg(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type=``: an integer in low..high; argparse names the flag in the error."""
    accepted = f"an integer >= {low}" if high is None else f"an integer in {low}..{high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}; accepted: {accepted}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is out of range; accepted: {accepted}")
        return value

    return parse


def _float_arg(low: float, high: float | None = None, *, low_inclusive: bool = True) -> Callable[[str], float]:
    """An argparse ``type=``: a finite number in range (float() alone takes 'nan', 'inf', '1e999')."""
    accepted = f"a finite number {'>=' if low_inclusive else '>'} {low:g}" + ("" if high is None else f" and <= {high:g}")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number: {text!r}; accepted: {accepted}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number; accepted: {accepted}")
        if not (value >= low if low_inclusive else value > low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text} is out of range; accepted: {accepted}")
        return value

    return parse


def _bytes_arg(text: str) -> float:
    """An argparse ``type=`` for --budget: a size such as 80GiB, finite and above 0."""
    try:
        value = parse_bytes(text)
    except ZeroFXError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is out of range; accepted: a finite size above 0, e.g. 80GiB")
    return value


def build_parser() -> argparse.ArgumentParser:
    sizes = ", ".join(DNA_LM_SIZES)
    parser = _Parser(prog="zerofx", description="ZeRO-style sharded training as torch.fx compiler passes.")
    parser.add_argument("--version", action="version", version=f"zerofx {zerofx.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                help="one of these; zerofx COMMAND --help lists its options")

    model_help = f"a DNA LM size ({sizes}) or FILE.py:CALLABLE / MODULE:CALLABLE returning (model, example_inputs)"
    p = sub.add_parser("plan", help="print the plan, communication schedule and memory per rank, before anything runs",
                       description="Capture and plan a model on the meta device (no parameter memory): the sharding, one row "
                                   "per collective, memory per rank with a fits verdict, and the estimated step time.")
    p.add_argument("model", metavar="MODEL_SPEC", help=model_help)
    p.add_argument("--world-size", type=_int_arg(1, MAX_WORLD_SIZE),
                   help=f"number of ranks to plan for, 1..{MAX_WORLD_SIZE} (required unless the config implies it)")
    p.add_argument("--stage", type=int, help="ZeRO stage 0, 1, 2 or 3 (required unless the config sets it)")
    p.add_argument("--config", type=Path, help="DeepSpeed-style JSON config (ds_config.json)")
    p.add_argument("--seq-len", type=_int_arg(2),
                   help="tokens per sequence in a bundled model's example batch, 2..max_seq_len (default: min(512, max_seq_len))")
    p.add_argument("--batch-size", type=_int_arg(1), default=1, help="sequences in a bundled model's example batch, >= 1 (default: 1)")
    p.add_argument("--format", choices=("table", "json"), default="table", help="output format (default: table)")
    p.add_argument("--budget", type=_bytes_arg,
                   help="memory per rank to fit in, e.g. 80GiB (units B, KB..TB, KiB..TiB): adds a fits / doesn't-fit verdict")
    p.add_argument("--solve", choices=("seq_len", "batch_size"),
                   help="answer the longest sequence (at the example's batch size) or the largest batch (at its "
                        "sequence length) that fits --budget, from the memory model symbolic in both")
    p.add_argument("--max-seq-len", type=_int_arg(1), default=1 << 20,
                   help="upper bound for --solve seq_len when the model states none, >= 1 (default: 1048576)")
    p.add_argument("--max-batch-size", type=_int_arg(1), default=1 << 16, help="upper bound for --solve batch_size, >= 1 (default: 65536)")
    p.add_argument("--plot", type=Path, help="draw the memory timeline and a compute/communication Gantt chart to this PNG "
                        "(its folder must exist and be writable; checked before planning)")
    p.add_argument("--profile", default="cpu", help="hardware profile: cpu, h100, or a file from zerofx calibrate (default: cpu)")
    p.add_argument("--rank", type=_int_arg(0), default=0,
                   help="the rank to report, 0..world size - 1 (every rank runs the same graphs; default: 0)")
    p.add_argument("--fold", choices=("auto", "on", "off"), default="auto",
                   help="plan a model of N identical blocks from captures of 2 and 3 of them and extrapolate (fast; "
                        f"auto: when N >= {AUTO_FOLD_MIN_BLOCKS}); off plans every block (exact rows)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("estimate", help="model-state memory per device per ZeRO stage (the ZeRO paper's accounting)",
                       description="Per-device bytes of parameters, gradients and optimizer states for mixed-precision "
                                   "Adam (2 + 2 + 12 bytes per parameter), per ZeRO stage; with --model, also the "
                                   "activation peak from the memory model.")
    p.add_argument("model", metavar="MODEL_SPEC", nargs="?", help=model_help)
    p.add_argument("--params", type=_float_arg(0, MAX_PARAMS, low_inclusive=False),
                   help=f"number of parameters, e.g. 7.5e9, above 0 and at most {MAX_PARAMS:g} (instead of MODEL_SPEC)")
    p.add_argument("--world-size", type=_int_arg(1, MAX_WORLD_SIZE), required=True, help=f"number of ranks, 1..{MAX_WORLD_SIZE}")
    p.add_argument("--stage", type=int, help="only this ZeRO stage (default: all of 0, 1, 2, 3)")
    p.add_argument("--offload", choices=("none", "cpu", "nvme"), default="none", help="where optimizer states live (default: none)")
    p.add_argument("--offload-param", choices=("none", "cpu", "nvme"), default="none",
                   help="where stage-3 parameter shards live (default: none)")
    p.add_argument("--config", type=Path, help="DeepSpeed-style JSON config, for the --model activation estimate")
    p.add_argument("--format", choices=("table", "json"), default="table", help="output format (default: table)")
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("config-schema", help="list every DeepSpeed/zerofx config key, its type and accepted values",
                       description="The config's documentation, generated from the schema zerofx validates against.")
    p.add_argument("--format", choices=("markdown", "json"), default="markdown", help="output format (default: markdown)")
    p.set_defaults(func=cmd_config_schema)

    p = sub.add_parser("calibrate", help="measure this machine's collectives and compute into a planner profile",
                       description="Time all-gathers on local gloo ranks and a matmul and a copy on one core; fit the "
                                   "alpha-beta model; write a profile for zerofx plan --profile.")
    p.add_argument("--world-size", type=_int_arg(1, MAX_LOCAL_RANKS), default=2,
                   help=f"local ranks to measure with, 1..{MAX_LOCAL_RANKS} (default: 2)")
    p.add_argument("--out", type=Path, default=Path("zerofx_profile.json"),
                   help="profile file to write, in an existing writable folder (checked before measuring; "
                        "default: zerofx_profile.json)")
    p.add_argument("--repeats", type=_int_arg(1), default=5, help="timed repeats per measurement, >= 1 (default: 5)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("train", help="train a DNA LM on local gloo (CPU) ranks",
                       description="Spawn local gloo ranks and train a DNA LM with zerofx on a FASTA genome.")
    p.add_argument("--model", default="tiny", help=f"DNA LM size: {sizes} (default: tiny)")
    p.add_argument("--fasta", type=Path,
                   help="FASTA genome, plain or .gz (default: the bundled lambda phage genome): IUPAC nucleotide codes, "
                        f"ambiguity codes read as N; refused when over {MAX_FOREIGN_FRACTION * 100:g}%% of its symbols are not "
                        "nucleotide codes (a protein FASTA)")
    p.add_argument("--world-size", type=_int_arg(1, MAX_LOCAL_RANKS), default=2,
                   help=f"number of local ranks to spawn, 1..{MAX_LOCAL_RANKS} (default: 2; under torchrun, torchrun's)")
    p.add_argument("--stage", type=int, help=f"ZeRO stage 0-3 (default: the config's, else {DEFAULT_TRAIN_STAGE})")
    p.add_argument("--config", type=Path, help="DeepSpeed-style JSON config; replaces the default AdamW and --lr")
    p.add_argument("--steps", type=_int_arg(1), default=20,
                   help="optimizer steps, >= 1; each takes the config's gradient_accumulation_steps micro-batches (default: 20)")
    p.add_argument("--seq-len", type=_int_arg(2), default=128, help="tokens per window, 2..the model's max_seq_len (default: 128)")
    p.add_argument("--batch-size", type=_int_arg(1),
                   help="windows per rank per micro-step, >= 1 (default: the config's train_micro_batch_size_per_gpu, or "
                        "train_batch_size / (gradient_accumulation_steps x world size), else 2); with a config, it must agree")
    p.add_argument("--lr", type=_float_arg(0), default=3e-3,
                   help="AdamW learning rate when no --config, a finite number >= 0 (default: 3e-3)")
    p.add_argument("--seed", type=_int_arg(0, MAX_SEED), default=0,
                   help="seed for the model init and the data shuffle, 0..2**64-1 (default: 0)")
    p.add_argument("--print-graph", action="store_true", help="print rank 0's forward graph and its all-gather counts")
    p.add_argument("--output-dir", type=Path,
                   help="save sharded checkpoints here, and resume from its newest complete one (default: no checkpoints)")
    p.add_argument("--save-every", type=_int_arg(1), help="save every K >= 1 training steps (default: only after the last step)")
    p.add_argument("--keep-last", type=_int_arg(1),
                   help="after each save, delete the oldest step-N checkpoints beyond the newest K >= 1 (default: keep all)")
    p.add_argument("--collective-timeout", dest="collective_timeout_s", type=_float_arg(0, low_inclusive=False),
                   help="seconds a collective waits for a dead or stalled peer before the run fails, > 0 (default: the "
                        "config's zerofx.collective_timeout_s, else 300)")
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
    # The imports leave about 320,000 GC-tracked objects (torch, the Dynamo stack). gc.freeze
    # (Python's documented API for this) moves them out of the cyclic collector's reach, so the
    # full collections that capture's allocations trigger, and the interpreter's exit, stop
    # rescanning them: 1.5-2.5 s of `zerofx plan`'s 10 s budget on the 20B model. It also keeps
    # the forked 2-block capture (NOTE [Planning the two captures in parallel]) from touching,
    # and so copying, their pages. Only as the program (argv from sys.argv): a caller that runs
    # main() in its own process, as the tests do, keeps its collector as it was.
    if argv is None:
        gc.freeze()
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
