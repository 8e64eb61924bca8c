"""The ``zerofx`` command line: plan, estimate and train the bundled DNA models (docs/models.md).

    zerofx plan 1b --world-size 1024 --stage 3      # the plan, on the meta device: no real memory
    zerofx estimate 7b --world-size 64               # model-state GiB per rank, stages 0-3
    zerofx train --world-size 2 --stage 3 --steps 20 # real training, gloo ranks on this CPU
    zerofx train --output-dir run1 --save-every 5    # checkpoints; resumes from run1's latest
    zerofx consolidate run1 model.safetensors        # one file for load_state_dict, streamed

``main(argv)`` returns the exit code: 0 on success, 2 for bad input (a one-line message on
stderr, no traceback), 1 when a training rank fails, 130 when Ctrl-C stops a command (for
``train``, one line naming the step and the checkpoint to resume from). The training loop itself is
``zerofx.app.training.train(TrainOptions(...))``, for scripts such as ``examples/train_dna.py``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

# NOTE [A command line that answers at once]
# `zerofx --help`, every subcommand's --help and `zerofx estimate --params` answer in a fraction
# of a second because nothing here imports torch and the compiler (5-6 s of CPU on a 2-core
# machine; docs/benchmarks.md, CLI start-up) before the arguments are parsed: the module level
# imports only torch-free modules (zerofx.common.limits for the bounds the validators check,
# zerofx.models.sizes for the size names, zerofx.common.units for --budget), `import zerofx` itself is
# light (PEP 562 lazy names in zerofx/__init__.py), and each command imports what it runs inside
# its function.
# tests/test_plan_output.py checks that `zerofx estimate --params` leaves torch unimported;
# benchmarks/cli_startup.py times the commands.
from zerofx._version import __version__
from zerofx.common.errors import RankFailedError, TrainingInterrupted, UsageError, ZeroFXError
from zerofx.app.estimate import add_infinity_arguments
from zerofx.cost_models.tiers import NO_OFFLOAD, PLACEMENT_CHOICES
from zerofx.common.limits import (
    AUTO_FOLD_MIN_BLOCKS,
    DEFAULT_TRAIN_STAGE,
    MAX_FOREIGN_FRACTION,
    MAX_SEED,
    MAX_WORLD_SIZE,
    check_positive,
    check_stage,
)
from zerofx.models.sizes import MODEL_SIZES, model_config
from zerofx.common.paths import probe_writable
from zerofx.common.units import format_bytes, format_seconds, parse_bytes

if TYPE_CHECKING:
    import torch

    import torch.nn as nn

    from zerofx.compiler.folding import FoldedReport, RepeatedBlocks
    from zerofx.app.planning import ModelSpec
    from zerofx.compiler.program import Program


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``UsageError``), not usage plus a message."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def _meta_example(name: str, batch_size: int, seq_len: int | None) -> tuple[nn.Module, torch.Tensor]:
    """The bundled model of size ``name`` and a (B, T) batch of input ids on the meta device:
    shapes only, no memory."""
    import torch

    from zerofx.models.registry import build_model

    cfg = model_config(name)
    t = min(512, cfg.max_seq_len) if seq_len is None else seq_len
    check_positive("--batch-size", batch_size)
    if not 2 <= t <= cfg.max_seq_len:
        raise UsageError(f"--seq-len {t} is invalid for this model; accepted: 2..{cfg.max_seq_len}")
    model = build_model(name, device="meta")
    ids = torch.zeros(batch_size, t, dtype=torch.long, device="meta")  # (B, T)
    return model, ids


# NOTE [Freezing the imports]
# Importing torch and the Dynamo stack leaves about 320,000 GC-tracked objects. gc.freeze
# (Python's documented API for this) moves them out of the cyclic collector's reach, so the full
# collections that capture's allocations trigger, and the interpreter's exit, stop rescanning
# them: 1.5-2.5 s of `zerofx plan`'s 10 s budget on the 20B model. It also keeps the forked
# 2-block capture (NOTE [Planning the two captures in parallel]) from touching, and so copying,
# their pages. The commands import torch after parsing (NOTE [A command line that answers at
# once]), so the freeze comes where a command has made its imports, not at start-up. Only as the
# program (argv from sys.argv): a caller that runs main() in its own process, as the tests do,
# keeps its collector as it was.
def _freeze_imports(args: argparse.Namespace) -> None:
    """Freeze the collector's view of what a command imported, when running as the program."""
    if getattr(args, "as_program", False):
        gc.freeze()


# --------------------------------------------------------------------------- plan, estimate
def _load_model(args: argparse.Namespace) -> ModelSpec:
    """A bundled model size (built on the meta device) or a FILE.py:CALLABLE / MODULE:CALLABLE spec."""
    from zerofx.app.planning import ModelSpec, load_model_spec

    if ":" in args.model:
        return load_model_spec(args.model)
    batch = getattr(args, "batch_size", None)
    if batch is None:  # the config's micro-batch, so that a config zerofx plan --auto printed plans as it was chosen
        from zerofx.config import load_config

        config = getattr(args, "config", None)
        batch = 1 if config is None else load_config(config).get("train_micro_batch_size_per_gpu", 1)
    model, ids = _meta_example(args.model, batch, getattr(args, "seq_len", None))
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
        probe_writable(folder)
    except OSError as exc:
        raise UsageError(f"{flag} {str(path)!r}: cannot create a file in folder {str(folder)!r} ({exc.strerror}); "
                         "accepted: a path in a writable folder") from exc
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {str(path)!r} exists and is read-only; accepted: a writable file or a new path")


def _profile(args: argparse.Namespace) -> tuple[Any, Any]:
    from zerofx.cost_models.profiles import load_profile

    try:
        return load_profile(args.profile)
    except ValueError as exc:
        raise UsageError(f"--profile: {exc}") from exc


# The hardware a plan's times are for, after "estimated step N ms". The default profile models
# one CPU core per rank over gloo, which a reader planning for GPUs would not guess.
DEFAULT_PROFILE = "cpu"


def step_note(profile: str, comm: Any, device: Any) -> str:
    """What follows the summary's step time: the hardware it is for, and, for the default CPU
    profile, how to pick another."""
    if profile == DEFAULT_PROFILE:
        return (f" for CPU gloo, one core per rank (the default profile, {comm.name} / {device.name}; "
                "--profile h100 or a file from zerofx calibrate estimates other hardware)")
    return f" for profile {comm.name} / {device.name}"


def _shapes(spec: ModelSpec) -> str:
    import torch

    return ", ".join(str(tuple(t.shape)) for t in [*spec.args, *spec.kwargs.values()] if isinstance(t, torch.Tensor))


def plot_title(label: str, *, world_size: int, stage: int, profile: str) -> str:
    """The plot's title: what was planned, for how many ranks, at which stage, on which hardware."""
    return f"zerofx plan {label}: ZeRO stage {stage}, world size {world_size}, profile {profile}"


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the ZeRO plan, the communication schedule, memory per rank and a summary."""
    if ":" not in args.model:
        model_config(args.model)
    # The times are for the hardware the plan is sized for: a config's zerofx.profile sizes its
    # buckets, prefetch and recompute, so without --profile it prices them too.
    args.profile = args.profile or _config_profile(args.config) or DEFAULT_PROFILE
    if args.sweep is not None:
        return _plan_sweep(args)
    if args.world_size is not None:
        check_positive("--world-size", args.world_size)
    check_stage(args.stage)
    if args.world_size is None and args.config is None:
        raise UsageError("--world-size is required (or give --config with zerofx.world_size or batch sizes)")
    if args.auto or _config_asks_auto(args.config):
        return _plan_auto(args)
    if args.time_limit is not None:
        raise UsageError("--time-limit bounds the search of --auto; add --auto (with --budget), or leave it out")
    budget = parse_bytes(args.budget) if args.budget is not None else None
    user_config = args.config
    _check_margin_has_budget(args.margin, budget)
    if budget is not None:  # the planner fits the prefetch distance to it (zerofx.memory_budget)
        args.config = _with_memory_budget(args.config, budget, args.margin)
        budget = _planned_budget(args.config)  # the verdict, --solve and folding fit what the planner fits
    if args.profile != DEFAULT_PROFILE:  # the plan's buckets and prefetch are sized for it (zerofx.profile)
        args.config = _with_zerofx_key(args.config, "profile", args.profile)
    if args.solve is not None and budget is None:
        raise UsageError(f"--solve {args.solve} needs --budget, the memory per rank to fit in (e.g. 80GiB)")
    if args.plot is not None:
        _check_output_file("--plot", args.plot)
    # What planning runs, loaded before the freeze (NOTE [Freezing the imports]).
    import zerofx.compiler.folding  # noqa: F401
    import zerofx.runtime.offload  # noqa: F401
    from zerofx.app.planning import running_model_code

    _freeze_imports(args)
    comm, device = _profile(args)
    spec = _load_model(args)
    with running_model_code(spec.label):  # a sys.exit in the spec's forward is an error, not exit 0
        return _plan_spec(args, spec, budget, user_config, comm, device)


def _config_profile(config: Path | None) -> str | None:
    """The config file's ``zerofx.profile``, or None."""
    if config is None:
        return None
    from zerofx.config import load_config

    profile = load_config(config).get("zerofx", {}).get("profile")
    return str(profile) if profile else None


def _config_asks_auto(config: Path | None) -> bool:
    """Whether the config file sets ``zerofx.auto``: then ``zerofx plan`` runs the search, as
    ``initialize`` would."""
    if config is None:
        return False
    from zerofx.config import load_config

    return bool(load_config(config).get("zerofx", {}).get("auto", False))


def _plan_auto(args: argparse.Namespace) -> int:
    """``zerofx plan MODEL --auto --budget B``: the search over the whole job's configuration
    (``zerofx.compiler.autoplan``), formatted."""
    from zerofx.config import load_config
    from zerofx.config.options import planned_budget_bytes

    raw = dict(load_config(args.config)) if args.config is not None else {}
    in_config = raw.get("zerofx", {}).get("memory_budget")
    if args.budget is None and in_config is None:
        raise UsageError("--auto needs --budget, the memory per rank the chosen configuration must fit (e.g. 2GiB): the search "
                         "keeps the candidates whose predicted peak fits it (or zerofx.memory_budget in --config)")
    if args.solve is not None or args.plot is not None:
        raise UsageError("--auto searches configurations and draws nothing: leave out --solve and --plot")
    given = parse_bytes(args.budget if args.budget is not None else in_config)
    own = {**raw.get("zerofx", {}), "auto": True, "memory_budget": int(given) if float(given).is_integer() else given}
    if args.margin is not None:
        own["memory_margin"] = args.margin
    budget = planned_budget_bytes(own)  # NOTE [The memory margin]
    if args.profile != DEFAULT_PROFILE:
        own["profile"] = args.profile
    raw["zerofx"] = own
    if args.stage is not None:  # --stage fixes the stage, as the config's would
        given = raw.get("zero_optimization", {}).get("stage")
        if given is not None and given != args.stage:
            raise UsageError(f"--stage {args.stage} disagrees with the config's zero_optimization.stage={given}; give one or make them equal")
        raw["zero_optimization"] = {**raw.get("zero_optimization", {}), "stage": args.stage}
    from zerofx.app.planning import running_model_code

    _freeze_imports(args)
    _profile(args)
    spec = _load_model(args)
    from zerofx.compiler.autoplan import example_shape, resize_inputs, search, search_space
    from zerofx.config import parse_config

    cfg = parse_config(raw, world_size=args.world_size)
    world_size = args.world_size if args.world_size is not None else cfg.world_size
    batch, seq_len = example_shape(spec.args, spec.kwargs)
    assert cfg.auto is not None
    space = search_space(cfg, cfg.auto, world_size=world_size, seq_len=seq_len, batch=batch)
    with running_model_code(spec.label):
        result = search(spec.model, resize_inputs(spec.args, spec.kwargs), raw, world_size=world_size, seq_len=seq_len, batch=batch,
                        budget_bytes=budget, space=space, fixed=cfg.auto.fixed, fold=args.fold, time_limit_s=args.time_limit,
                        progress=lambda line: print(f"zerofx plan --auto: {line}", file=sys.stderr, flush=True))
    if args.format == "json":
        data = json.loads(result.to_json())
        data["model"] = spec.label
        print(json.dumps(data, indent=1))
        return 0
    print(format_auto_plan(result, label=spec.label))
    return 130 if result.stopped.startswith("Ctrl-C") else 0


# Rows of the ranked candidates ``zerofx plan --auto`` prints after the chosen one (--format json lists all).
AUTO_ROWS = 8


def format_auto_plan(result: Any, *, label: str) -> str:
    """The search's result as ``zerofx plan --auto`` prints it: what was searched, the choice and
    its config block, the runners-up and why each lost, and, when nothing fits, what would."""
    from tabulate import tabulate

    kept = f"; kept as the config sets them: {', '.join(result.fixed)}" if result.fixed else ""
    lines = [f"zerofx plan {label} --auto: world size {result.world_size}, seq_len {result.seq_len}, global batch "
             f"{result.global_batch} sequences per step, budget {result.budget_text()} per rank, profile {result.profile}",
             f"searched {len(result.ranked)} candidates ({result.num_lowered} planned and lowered, {result.num_captures} "
             f"capture{'' if result.num_captures == 1 else 's'}) "
             f"in {result.search_s:.1f} s{kept}"]
    if result.stopped:  # NOTE [A search answers anytime] in zerofx/compiler/autoplan.py
        lines.append(f"stopped early by {result.stopped}: the best of the {len(result.ranked)} candidates tried; more may fit or "
                     "be faster (a longer --time-limit, or a narrower search in --config, finishes)")
    for what, why in result.not_candidates:
        lines.append(f"not a candidate: {what}: {why}")
    chosen = result.chosen
    if chosen is not None:
        lines.append(f"chosen: {chosen.label()}: predicted step {format_seconds(chosen.step_s)}, {chosen.tokens_per_s:,.0f} "
                     f"tokens/s, peak {format_bytes(chosen.peak_bytes)} per rank (model state {format_bytes(chosen.model_state_bytes)})")
        if result.unchecked:
            lines.append(f"note: {result.unchecked}")
    elif result.stopped:
        lines.append(f"nothing tried so far fits {result.budget_text()} per rank")
    else:
        lines.append(f"nothing fits {result.budget_text()} per rank. To fit, it would take:")
        lines += [f"  - {x}" for x in result.to_fit]
    rows = []
    for i, e in enumerate(result.ranked[:AUTO_ROWS + 1]):
        rows.append([i + 1, e.label(), f"{e.tokens_per_s:,.0f}" if e.lowered else "-",
                     format_seconds(e.step_s) if e.lowered else "-", format_bytes(e.peak_bytes) + ("" if e.lowered else " or more"),
                     e.why or "chosen"])
    lines.append(tabulate(rows, headers=["#", "candidate", "tokens/s", "step", "peak/rank", "why not"], disable_numparse=True))
    if len(result.ranked) > AUTO_ROWS + 1:
        lines.append(f"... {len(result.ranked) - AUTO_ROWS - 1} more (--format json lists every candidate)")
    if result.config is not None:
        lines.append("config (zerofx plan --config FILE plans it; zerofx.initialize and zerofx train take it as it is):")
        lines.append(json.dumps(result.config, indent=1))
    return "\n".join(lines)


def _plan_sweep(args: argparse.Namespace) -> int:
    """``zerofx plan MODEL --sweep world-size=...``: the chosen and the flat plan at each world
    size, from one capture (``zerofx.app.sweep``)."""
    from zerofx.app.sweep import parse_sweep

    try:
        sizes = parse_sweep(args.sweep)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if max(sizes) > MAX_WORLD_SIZE:
        raise UsageError(f"--sweep {args.sweep!r}: world sizes must be at most {MAX_WORLD_SIZE}")
    if args.world_size is not None or args.solve is not None or args.fold == "on":
        raise UsageError("--sweep plans its own world sizes and folds nothing: leave out --world-size, --solve and --fold on")
    check_stage(args.stage)
    budget = parse_bytes(args.budget) if args.budget is not None else None
    _check_margin_has_budget(args.margin, budget)
    if budget is not None:
        args.config = _with_memory_budget(args.config, budget, args.margin)
        budget = _planned_budget(args.config)
    if args.plot is not None:
        _check_output_file("--plot", args.plot)
    from zerofx.app.planning import running_model_code

    _freeze_imports(args)
    comm, device = _profile(args)
    spec = _load_model(args)
    from zerofx.compiler.program import resolve
    from zerofx.app.sweep import format_sweep, plot_sweep, sweep_world_sizes

    stage = 3 if args.stage is None and args.config is None else args.stage
    cfg = resolve(args.config, stage=stage, world_size=sizes[0])
    with running_model_code(spec.label):
        sweep = sweep_world_sizes(spec.model, spec.args, spec.kwargs, label=spec.label, cfg=cfg, world_sizes=sizes, comm=comm,
                                  device=device, profile=args.profile)
    if args.plot is not None:
        plot_sweep(sweep, args.plot)
    if args.format == "json":
        print(sweep.to_json())
        return 0
    print(format_sweep(sweep))
    if args.plot is not None:
        print(f"wrote {args.plot}")
    return 0


def _plan_spec(args: argparse.Namespace, spec: ModelSpec, budget: float | None, user_config: Path | None, comm: Any,
               device: Any) -> int:
    """``cmd_plan`` once the arguments are checked and the model is loaded: capture, plan, print."""
    import zerofx
    from zerofx.compiler.folding import FOLD_BLOCKS, find_repeated_blocks
    from zerofx.app.estimate import format_plan_tiers, plan_tier_bytes
    from zerofx.runtime.offload import plan_for_program
    from zerofx.passes.analyze_schedule import format_report
    from zerofx.app.planning import plot_report, report_json, solve_memory
    from zerofx.cost_models.memory import estimate_process_peak_bytes
    from zerofx.compiler.program import resolve
    from zerofx.config import load_config

    blocks = find_repeated_blocks(spec.model)
    fold = args.fold == "on" or (args.fold == "auto" and blocks is not None and blocks.count >= AUTO_FOLD_MIN_BLOCKS)
    # NOTE [Budgets of the cut models] (zerofx/compiler/autoplan.py): recompute "auto" recomputes
    # until the whole model's peak fits the budget, which the cut models are planned without.
    recompute_auto = args.config is not None and load_config(args.config).get("zerofx", {}).get("recompute") == "auto"
    if recompute_auto and args.fold == "on":
        raise UsageError("--fold on cannot plan zerofx.recompute \"auto\": it recomputes until the whole model's peak fits the "
                         "budget, and the cut models are planned without one; use --fold off or auto (or zerofx.recompute true or false)")
    if recompute_auto and fold:
        print(f"zerofx plan: planning all {blocks.count} blocks of {blocks.path!r}, not folded: zerofx.recompute \"auto\" "
              "recomputes until the whole model's peak fits the budget", file=sys.stderr)
        fold = False
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
        title = plot_title(spec.label, world_size=program.world_size, stage=int(program.stage), profile=f"{comm.name} / {device.name}")
        plot_report(report, args.plot, title=title, budget_bytes=budget)
    cfg = resolve(args.config, stage=args.stage, world_size=args.world_size)
    offload = plan_for_program(program.plan, cfg.offload, cfg.param_offload, mixed_precision=cfg.compute_dtype is not None,
                               device_is_cpu=device.memory_is_host, compute_s=report.compute_s)
    tiers = None
    if offload is not None or cfg.grad_offload is not None:
        grad_itemsize = cfg.compute_dtype.itemsize if cfg.compute_dtype is not None else 4
        grad_bytes = sum(p.shard_numel for p in program.plan.params if p.requires_grad) * grad_itemsize
        tiers = plan_tier_bytes(report.peak.live_bytes, offload, grad_bytes=grad_bytes,
                                grad_tier=None if cfg.grad_offload is None else cfg.grad_offload.device.value, memory_is_host=device.memory_is_host)
    if args.format == "json":
        data = json.loads(report_json(program, report, budget, device_peak_bytes=None if tiers is None else tiers["device"],
                                      micro_batches=cfg.gradient_accumulation_steps))
        # A rank's resident memory with the runtime's (NOTE [What a rank's resident memory holds]).
        data["memory"]["process_peak_bytes"] = estimate_process_peak_bytes(report.peak.live_bytes, rank_runtime_bytes(device, cfg))
        if offload is not None:
            data["offload"] = json.loads(offload.to_json())
        if tiers is not None:
            data["tiers_per_rank_bytes"] = tiers
        if solved is not None:
            data["solve"] = {solved.variable: solved.value, "peak_bytes_expr": str(solved.peak_expr), "peak_at": solved.peak_node,
                             "samples": [list(x) for x in solved.samples], "sequence_parallel_size": solved.sequence_parallel,
                             "captured_peak_bytes": {"at": solved.peak_at_value, "one_past": solved.peak_past_value}}
        print(json.dumps(data, indent=1))
        return 0
    print(f"model {spec.label}: {type(spec.model).__name__}, example inputs {_shapes(spec)}; profile {comm.name} / {device.name}")
    print(program.plan)
    if offload is not None:
        print(offload)
    if tiers is not None:
        print(format_plan_tiers(tiers))
    print(format_report(report, budget_bytes=budget, verbose=args.verbose, step_note=step_note(args.profile, comm, device),
                        device_peak_bytes=None if tiers is None else tiers["device"], micro_batches=cfg.gradient_accumulation_steps))
    if solved is not None:
        what = "longest sequence" if solved.variable == "seq_len" else "largest batch"
        if solved.sequence_parallel > 1:  # NOTE [Solving for the context under sequence parallelism]
            what += f" with sequence parallelism over {solved.sequence_parallel} ranks"
        symbols = {str(x) for x in solved.peak_expr.free_symbols}
        exact_in = "B (batch) and T (tokens)" if "B" in symbols else "T (tokens) at the example's batch"
        print(f"{what} that fits {format_bytes(budget)} per rank: {solved.variable} = {solved.value} "
              f"(peak bytes = {solved.peak_expr} at {solved.peak_node}, exact in {exact_in} "
              f"from captures at (B, T) = {', '.join(map(str, solved.samples))})")
        step = solved.sequence_parallel if solved.variable == "seq_len" else 1
        confirmed = [f"at {n} the peak is {peak:,} bytes ({'fits' if peak <= budget else 'over'})"
                     for n, peak in ((solved.value, solved.peak_at_value), (solved.value + step, solved.peak_past_value)) if peak is not None]
        if confirmed:
            print(f"confirmed by capture against {int(budget):,} bytes: {'; '.join(confirmed)}")
    if args.plot is not None:
        print(f"wrote {args.plot}")
    return 0


def _with_zerofx_key(config: Path | Mapping[str, Any] | None, key: str, value: Any) -> dict[str, Any]:
    from zerofx.config import load_config

    raw = dict(load_config(config)) if config is not None else {}
    raw["zerofx"] = {**raw.get("zerofx", {}), key: value}
    return raw


def _check_margin_has_budget(margin: float | None, budget: float | None) -> None:
    if margin is not None and budget is None:
        raise UsageError(f"--margin {margin} needs --budget: it is the share of the budget held back for the memory model's error")


def _planned_budget(config: Mapping[str, Any]) -> float:
    """The budget the planners fit: ``zerofx.memory_budget`` less ``zerofx.memory_margin`` (NOTE [The memory margin])."""
    from zerofx.config.options import planned_budget_bytes

    budget = planned_budget_bytes(config.get("zerofx", {}))
    assert budget is not None
    return budget


def _with_memory_budget(config: Path | Mapping[str, Any] | None, budget_bytes: float, margin: float | None = None) -> dict[str, Any]:
    from zerofx.config import load_config

    raw = dict(load_config(config)) if config is not None else {}
    raw["zerofx"] = {**raw.get("zerofx", {}), "memory_budget": budget_bytes, **({"memory_margin": margin} if margin is not None else {})}
    return raw


def folded_explanation(folded: FoldedReport, *, block_params: int, num_params: int) -> str:
    """One line saying what folding did, so that the whole model's parameter count and the smaller
    one of the plan printed after it (the larger cut's) read together."""
    blocks, (low, high) = folded.blocks, folded.cuts
    if folded.planned_whole:
        return (f"folded: {blocks.path!r} holds {blocks.count} identical blocks of {block_params:,} parameters; {folded.whole_because} "
                f"(docs/planner.md#layer-folding-planning-a-20b-model-in-seconds), so zerofx planned all {blocks.count}:")
    return (f"folded: {blocks.path!r} holds {blocks.count} identical blocks of {block_params:,} parameters; zerofx planned "
            f"copies of the model cut to {low} and {high} blocks, and the whole model's figures are the {high}-block copy's "
            f"plus {blocks.count - high} times what one more block adds (--fold off plans all {blocks.count}). "
            f"The plan below is the {high}-block copy's:")


def rank_runtime_bytes(device: Any, cfg: Any) -> float:
    """What a rank holds besides the step's tensors: the runtime's baseline, and what Inductor keeps
    resident where the config compiles with it (NOTE [What Inductor keeps resident] in cost_models/memory.py)."""
    from zerofx.config.options import GraphCompiler
    from zerofx.cost_models.memory import inductor_resident_bytes

    compiled = inductor_resident_bytes(device) if cfg.graph_compiler is GraphCompiler.INDUCTOR else 0.0
    return device.runtime_bytes + compiled


def _plan_folded(args: argparse.Namespace, spec: ModelSpec, blocks: RepeatedBlocks, comm: Any, device: Any,
                 budget: float | None) -> int:
    """``zerofx plan`` from captures of the model cut to 2 and 3 blocks (``zerofx.compiler.folding``)."""
    import zerofx
    from zerofx.config import load_config
    from zerofx.config.options import BUDGET_KEYS
    from zerofx.compiler.folded_tiling import model_estimates, pinned_on
    from zerofx.compiler.folding import folded_json, format_folded, plan_folded
    from zerofx.compiler.search import lower_prefetch_distance
    from zerofx.cost_models.memory import estimate_process_peak_bytes
    from zerofx.compiler.program import resolve

    if args.solve is not None or args.plot is not None:
        raise UsageError("--solve and --plot need the whole model's timeline: add --fold off")
    programs: dict[int, Program] = {}  # by the number of blocks of the cut model

    def report_for(model: torch.nn.Module, config: Mapping[str, Any]) -> Any:
        program = zerofx.compile(model, world_size=args.world_size, stage=args.stage, config=config,
                                 example_inputs=spec.args, example_kwargs=spec.kwargs)
        programs[len(model.get_submodule(blocks.path))] = program
        return program.report(args.rank, comm=comm, device=device), program.plan

    # The cut models' peaks are smaller than the whole model's, so the planner cannot fit the
    # prefetch distance to the budget on them (NOTE [Prefetch under a memory budget]): folding
    # does it here, on the extrapolated peak.
    config = dict(load_config(args.config)) if args.config is not None else {}
    own = {k: v for k, v in config.get("zerofx", {}).items() if k not in BUDGET_KEYS}

    def fold(zerofx_section: Mapping[str, Any]) -> tuple[FoldedReport, Program]:
        folded = plan_folded(spec.model, blocks, lambda m: report_for(m, {**config, "zerofx": zerofx_section}), parallel=True)
        # The 2-block capture may run in a forked child (NOTE [Planning the two captures in
        # parallel]); the larger cut always runs here, so its plan is the one printed.
        return folded, programs[folded.cuts[1]]

    def fold_at(distance: int) -> tuple[tuple[FoldedReport, Program], int, float]:
        folded, sample = fold({**own, "prefetch_distance": distance})
        return (folded, sample), distance, folded.peak_bytes

    decisions: list[str] = []
    tiling = resolve(args.config, stage=args.stage, world_size=args.world_size).tiling
    if tiling is not None and tiling.enabled is True and tiling.block_size is None:
        # NOTE [One tiling for every cut]: each cut would take the largest block its own smaller
        # estimate fits; the whole model's block, pinned, tiles every cut as the whole model.
        estimates = model_estimates(spec.model, blocks, spec.args, spec.kwargs or {},
                                    resolve(config, stage=args.stage, world_size=args.world_size), args.world_size)
        if estimates is not None:
            block = pinned_on(estimates, tiling).block_size
            own = {**own, "tiling": {**own.get("tiling", {}), "block_size": block}}
            decisions.append(f"tiling block size {block} tokens, the whole model's from its estimate (the cut models, planned with "
                             "this block, fold to it; NOTE [One tiling for every cut])")
    folded, sample = fold(own)
    distance = _whole_prefetch_distance(args, spec, blocks, {**config, "zerofx": own}, folded, programs)
    if distance is not None and distance != sample.plan.prefetch_distance:
        decisions.append(f"prefetch distance {distance} bucket(s) ahead, the whole model's from the profile (the cut models' own "
                         f"was {sample.plan.prefetch_distance}; NOTE [The whole model's prefetch distance])")
        own = {**own, "prefetch_distance": distance}
        folded, sample = fold(own)
    micro_batches = resolve(args.config, stage=args.stage, world_size=args.world_size).gradient_accumulation_steps
    if budget is not None:
        search = lower_prefetch_distance((folded, sample), sample.plan.prefetch_distance, folded.peak_bytes, budget, fold_at)
        folded, sample = search.result
        if search.lowered:
            decisions.append(search.decision(f"extrapolated peak {format_bytes(folded.peak_bytes)}"))
    if args.format == "json":
        plan_json = json.loads(sample.plan.to_json())
        plan_json["decisions"] = [*plan_json.get("decisions", []), *decisions]
        data = folded_json(folded, plan_json, budget, micro_batches=micro_batches)
        data["memory"]["process_peak_bytes"] = estimate_process_peak_bytes(
            folded.peak_bytes, rank_runtime_bytes(device, resolve(config, stage=args.stage, world_size=args.world_size)))
        print(json.dumps(data, indent=1, default=list))
        return 0
    num_params = sum(p.numel() for p in spec.model.parameters())
    block_params = sum(p.numel() for p in spec.model.get_submodule(blocks.path)[0].parameters())
    print(f"model {spec.label}: {type(spec.model).__name__}, {num_params:,} parameters, example inputs {_shapes(spec)}; "
          f"profile {comm.name} / {device.name}")
    print(folded_explanation(folded, block_params=block_params, num_params=num_params))
    print(sample.plan)
    for d in decisions:
        print(f"decision: {d}")
    print(format_folded(folded, budget_bytes=budget, verbose=args.verbose, step_note=step_note(args.profile, comm, device),
                        micro_batches=micro_batches))
    return 0


def _whole_prefetch_distance(args: argparse.Namespace, spec: ModelSpec, blocks: RepeatedBlocks, config: Mapping[str, Any],
                             folded: Any, programs: Mapping[int, Program]) -> int | None:
    """Stage 3 on an explicit profile with no prefetch distance configured: the distance the
    planner takes from the profile for the whole model, from its parameters' shapes and its
    compute extrapolated from the cut models' captures (NOTE [The whole model's prefetch
    distance] in zerofx/compiler/autoplan.py); None otherwise."""
    import zerofx
    from zerofx.compiler.folding import extrapolate, with_num_blocks
    from zerofx.compiler.program import prefetch_from_the_profile, resolve, whole_prefetch_distance
    from zerofx.cost_models.profiles import load_profile
    from zerofx.passes.plan_shard_groups import estimate_compute_s

    cfg = resolve(config, stage=args.stage, world_size=args.world_size)
    low, high = folded.cuts
    if low == high or not prefetch_from_the_profile(cfg):
        return None  # planned whole, or the distance is not the profile's
    device = load_profile(cfg.profile)[1]

    def compute_at(n: int) -> float:
        program = programs.get(n)
        if program is None:  # captured in the forked child (NOTE [Planning the two captures in parallel])
            program = zerofx.compile(with_num_blocks(spec.model, blocks, n), world_size=args.world_size, stage=args.stage, config=config,
                                     example_inputs=spec.args, example_kwargs=spec.kwargs)
        return estimate_compute_s(program.captured.joint, device)

    return whole_prefetch_distance(spec.model, cfg, args.world_size, extrapolate(compute_at(low), compute_at(high), blocks.count, (low, high)))


def cmd_estimate(args: argparse.Namespace) -> int:
    """Model-state memory per device with the ZeRO paper's accounting, for each stage."""
    from tabulate import tabulate

    from zerofx.cost_models.memory import paper_breakdown
    from zerofx.app.estimate import infinity_section, wants_infinity

    check_positive("--world-size", args.world_size)
    check_stage(args.stage)
    if (args.params is None) == (args.model is None):
        raise UsageError("give exactly one of --params P and --model MODEL")
    stages = [args.stage] if args.stage is not None else [0, 1, 2, 3]
    activations: dict[int, float] = {}
    if args.params is not None:
        if args.params <= 0:
            raise UsageError(f"--params {args.params} is invalid; accepted: a number > 0 (e.g. 7.5e9)")
        num_params, label = float(args.params), f"{args.params:g} parameters"
    else:
        import zerofx
        from zerofx.app.planning import running_model_code
        from zerofx.compiler.program import plan_program, resolve
        from zerofx.config.compile_options import compile_options

        _freeze_imports(args)
        spec = _load_model(args)
        # Capture does not depend on the stage, only planning does: one capture serves every stage.
        with running_model_code(spec.label):
            captured = zerofx.capture_step(spec.model, spec.args, spec.kwargs)
        for s in stages:
            cfg = resolve(args.config, stage=s, world_size=args.world_size)
            program = plan_program(captured, cfg, compile_options(cfg, args.world_size))
            report = program.report(0)
            activations[s] = report.peak.live_bytes - report.persistent_bytes
        num_params = float(sum(p.numel for p in captured.params))
        label = f"{spec.label}: {int(num_params):,} parameters"
    rows, per_stage = [], {}
    for s in stages:
        b = paper_breakdown(num_params, stage=s, world_size=args.world_size, offload=args.offload, offload_param=args.offload_param,
                            offload_grad=args.offload_grad)
        per_stage[s] = {**b, **({"activation_peak_bytes": activations[s]} if s in activations else {})}
        row = [s, b["params_bytes"], b["grads_bytes"], b["optimizer_states_bytes"], b["per_device_bytes"]]
        if args.offload != "none":
            row.append(b["offloaded_bytes"])
        if args.offload_param != "none":
            row.append(b["offloaded_param_bytes"])
        if args.offload_grad != "none":
            row.append(b["offloaded_grad_bytes"])
        if activations:
            row.append(activations[s])
        rows.append([row[0], *map(format_bytes, row[1:])])
    tiers = infinity_section(args, num_params) if wants_infinity(args, stages) else None
    if args.format == "json":
        print(json.dumps({"params": num_params, "world_size": args.world_size, "offload": args.offload,
                          "per_device_bytes": {str(s): per_stage[s]["per_device_bytes"] for s in stages},
                          "stages": {str(s): v for s, v in per_stage.items()},
                          **({"tiers": tiers[1]} if tiers is not None else {})}, indent=1))
        return 0
    headers = ["stage", "params", "grads", "optimizer states", "per device"]
    if args.offload != "none":
        headers.append(f"on {args.offload}")
    if args.offload_param != "none":
        headers.append(f"params on {args.offload_param} (stage 3)")
    if args.offload_grad != "none":
        headers.append(f"grads on {args.offload_grad} (stages 2-3)")
    if activations:
        headers.append("activation peak (fp32, memory model)")
    print(f"{label}, world size {args.world_size}, mixed-precision Adam (ZeRO paper: 2 + 2 + 12 bytes per parameter)"
          + (f", optimizer states offloaded to {args.offload}" if args.offload != "none" else "") + "; sizes per device")
    print(tabulate(rows, headers=headers, tablefmt="simple", colalign=("right",) * len(headers), disable_numparse=True))
    if tiers is not None:
        print(tiers[0])
    return 0


def cmd_config_schema(args: argparse.Namespace) -> int:
    """Print every config key zerofx knows, generated from ``zerofx.config.schema.SCHEMA``."""
    from tabulate import tabulate

    from zerofx.config.schema import schema_rows

    rows = schema_rows()
    if args.format == "json":
        print(json.dumps([dict(zip(("key", "type", "accepted", "acted_on", "meaning"), r)) for r in rows], indent=1))
    else:
        print(tabulate(rows, headers=["key", "type", "accepted", "acted on", "meaning"], tablefmt="github"))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure collectives and compute on local gloo ranks; write a profile for ``plan --profile``."""
    check_positive("--world-size", args.world_size)
    check_positive("--repeats", args.repeats)
    _check_output_file("--out", args.out)  # before about 11 s of measuring, not after
    from zerofx.app.calibrate import calibrate, calibrate_across_nodes, is_multi_node

    if is_multi_node(os.environ):  # under torchrun across nodes: the two links measured apart
        result = calibrate_across_nodes(args.out, repeats=args.repeats)
        if result is None:  # not rank 0: rank 0 writes and reports
            return 0
        comm, device = result
        print(f"wrote {args.out}: within a node {comm.intra_alpha_s * 1e6:.1f} us per ring step, {comm.intra_bandwidth / 1e9:.3g} GB/s; "
              f"across nodes {comm.inter_alpha_s * 1e6:.1f} us, {comm.inter_bandwidth / 1e9:.3g} GB/s ({comm.ranks_per_node} ranks per node)")
        return 0
    comm, device = calibrate(args.out, world_size=args.world_size, repeats=args.repeats)
    from zerofx.cost_models.compute import OPTIMIZER_PASSES

    factors = ", ".join(f"{c.replace('_', '-')} x{f:.2f}" for c, f in comm.collective_scale)
    print(f"wrote {args.out}: ring latency {comm.intra_alpha_s * 1e6:.0f} us per step, bus bandwidth "
          f"{comm.intra_bandwidth / 1e9:.3g} GB/s" + (f" (each collective's time over that model: {factors})" if factors else "")
          + f", {comm.base_latency_s * 1e3:.2f} ms more per collective after compute; "
          f"matmul {device.matmul_flops_per_s / 1e9:.3g} GFLOP/s, memory {device.memory_bytes_per_s / 1e9:.3g} GB/s, "
          f"optimizer update {device.update_s_per_element_pass * OPTIMIZER_PASSES['AdamW'] * 1e9:.2f} ns per AdamW element per rank")
    return 0


# --------------------------------------------------------------------------- train
def cmd_train(args: argparse.Namespace) -> int:
    """Train a bundled DNA model or a model spec with the parsed flags (``zerofx.app.training.train``)."""
    from zerofx.app.training import Objective, TrainOptions, train

    _freeze_imports(args)  # under torchrun this process is a rank (NOTE [Freezing the imports])
    world_size = args.world_size
    if world_size is None:  # the config may state it (a sequence-parallel example needs its 4 ranks)
        from zerofx.config import parse_config

        world_size = (parse_config(args.config).world_size if args.config is not None else None) or 2
    train(
        TrainOptions(
            model=args.model, fasta=args.fasta, world_size=world_size, stage=args.stage, config=args.config,
            steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
            print_graph=args.print_graph, print_graph_code=args.print_graph_code, output_dir=args.output_dir, save_every=args.save_every,
            keep_last=args.keep_last, collective_timeout_s=args.collective_timeout_s, schedule_steps=args.schedule_steps,
            objective=Objective(args.objective), kmer=args.kmer, data=args.data, bed=args.bed,
            holdout_records=tuple(r for r in (args.holdout_records or "").split(",") if r), holdout_bed=args.holdout_bed,
            max_n_fraction=args.max_n_fraction, reverse_complement=args.reverse_complement,
        )
    )
    return 0


# --------------------------------------------------------------------------- data prepare
def cmd_data_prepare(args: argparse.Namespace) -> int:
    """Prepare FASTA files (or a manifest's) once for random access (``zerofx.data.prepared``)."""
    import time

    from tqdm import tqdm

    from zerofx.data.prepared import Source, is_manifest, open_prepared, prepare_genome, read_manifest, verify_prepared

    sources = [s for path in args.inputs for s in (read_manifest(path) if is_manifest(path) else [Source(path)])]
    total = sum(s.path.stat().st_size for s in sources if s.path.is_file())
    t0 = time.perf_counter()
    with tqdm(total=total, unit="B", unit_scale=True, desc="prepare", file=sys.stderr, disable=args.quiet) as bar:
        out = prepare_genome(sources, args.out, progress=bar.update)
    elapsed = time.perf_counter() - t0
    genome = open_prepared(out)
    if args.verify:
        verify_prepared(out)
    for line in genome.summaries():
        print(line)
    print(f"wrote {out}: {genome.num_records:,} records, {int(genome.lengths.sum()):,} tokens, {len(genome.n_runs):,} runs of N; "
          f"read {format_bytes(total)} in {elapsed:.1f} s ({total / max(elapsed, 1e-9) / 1e6:,.1f} MB/s); train with "
          f"zerofx train --data {out}")
    return 0


# --------------------------------------------------------------------------- consolidate
def cmd_consolidate(args: argparse.Namespace) -> int:
    """Write a sharded checkpoint as one safetensors file, streaming tensor by tensor."""
    from zerofx.runtime.checkpoint import consolidate, read_metadata, resolve_tag

    tag = resolve_tag(args.ckpt_dir, args.tag).name  # one tag for the metadata and the data, even if a save lands now
    meta = read_metadata(args.ckpt_dir, tag)
    out = consolidate(args.ckpt_dir, args.out, tag=tag, dtype=args.dtype)
    print(
        f"wrote {out} ({format_bytes(out.stat().st_size)}, {args.dtype}): {len(meta['state_dict_keys'])} tensors of "
        f"{meta['model_class']} at step {meta['step']}, from {meta['world_size']} rank files of {Path(args.ckpt_dir) / tag}"
    )
    return 0


# --------------------------------------------------------------------------- parser
# The largest world size zerofx plans for is zerofx.common.limits.MAX_WORLD_SIZE (2**20 ranks), far
# beyond the largest clusters built and far inside the int64 group size the functional
# collectives take (2**63 fails in C++); a bound that catches a typo (an extra 0) costs nothing.
# Local ranks (train, calibrate) are processes on this machine, each with torch loaded (a few
# hundred MiB) and cpu_count / world_size threads: beyond 256 they only contend. torchrun's
# world size is not bounded by this.
MAX_LOCAL_RANKS = 256
# `zerofx estimate --params`: 10**15, about a thousand times any model trained so far; its 16
# bytes per parameter stay far inside a float.
MAX_PARAMS = 1e15


def _existing(what: str, accepted: str, *, folder: bool = False) -> Callable[[str], Path]:
    """An argparse ``type=``: a path that exists as a file (or, with ``folder``, a folder),
    checked when the arguments are read, before a command imports torch (seconds, more on a
    loaded machine); argparse names the flag in the error."""

    def parse(text: str) -> Path:
        path = Path(text)
        if not path.exists():
            raise argparse.ArgumentTypeError(f"{what} {text!r} does not exist; accepted: {accepted}")
        if path.is_dir() != folder:
            raise argparse.ArgumentTypeError(f"{what} {text!r} is a {'file' if folder else 'folder'}; accepted: {accepted}")
        return path

    return parse


_FASTA_ARG = _existing("genome file", "a FASTA file (.fa, .fasta, optionally .gz)")
_CONFIG_ARG = _existing("config file", "a DeepSpeed-style JSON file")
_BED_ARG = _existing("BED file", "a BED file (record, 0-based start, end per line)")


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
    """An argparse ``type=`` for --budget: a size such as 80GiB or "10 GiB", finite and above 0."""
    negative = text.strip().startswith("-")  # a size with a sign is out of range, not unreadable
    try:
        value = parse_bytes(text.strip()[1:] if negative else text)
    except ZeroFXError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if negative or not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is out of range; accepted: a finite size above 0, e.g. 80GiB")
    return value


def _margin_arg(text: str) -> float:
    """An argparse ``type=`` for --margin: a share of the budget, 0 <= margin < 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; accepted: a share of --budget from 0 up to, not including, 1, e.g. 0.1") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range; accepted: a share of --budget from 0 up to, not including, 1, e.g. 0.1")
    return value


def build_parser() -> argparse.ArgumentParser:
    sizes = ", ".join(MODEL_SIZES)
    parser = _Parser(prog="zerofx", description="ZeRO-style sharded training as torch.fx compiler passes.")
    parser.add_argument("--version", action="version", version=f"zerofx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                help="one of these; zerofx COMMAND --help lists its options")

    model_help = f"a bundled model size ({sizes}; docs/models.md) or FILE.py:CALLABLE / MODULE:CALLABLE returning (model, example_inputs)"
    p = sub.add_parser("plan", help="print the plan, communication schedule and memory per rank, before anything runs",
                       description="Capture and plan a model on the meta device (no parameter memory): the sharding, one row "
                                   "per collective, memory per rank with a fits verdict, and the estimated step time.")
    p.add_argument("model", metavar="MODEL_SPEC", help=model_help)
    p.add_argument("--world-size", type=_int_arg(1, MAX_WORLD_SIZE),
                   help=f"number of ranks to plan for, 1..{MAX_WORLD_SIZE} (required unless the config implies it)")
    p.add_argument("--stage", type=int, help="ZeRO stage 0, 1, 2 or 3 (required unless the config sets it)")
    p.add_argument("--config", type=_CONFIG_ARG, help="DeepSpeed-style JSON config (ds_config.json)")
    p.add_argument("--seq-len", type=_int_arg(2),
                   help="tokens per sequence in a bundled model's example batch, 2..max_seq_len (default: min(512, max_seq_len))")
    p.add_argument("--batch-size", type=_int_arg(1),
                   help="sequences in a bundled model's example batch, >= 1 (default: the --config's train_micro_batch_size_per_gpu, "
                        "else 1); with --auto, the sequences per rank per step without sequence parallelism")
    p.add_argument("--format", choices=("table", "json"), default="table", help="output format (default: table)")
    p.add_argument("--budget", type=_bytes_arg,
                   help="memory per rank to fit in, e.g. 80GiB (units B, KB..TB, KiB..TiB): adds a fits / doesn't-fit verdict")
    p.add_argument("--margin", type=_margin_arg, default=None,
                   help="share of --budget held back for the memory model's error, from 0 up to 1 (zerofx.memory_margin; "
                        "default 0): the planner, recompute \"auto\" and --auto fit the predicted peak to the budget times (1 - margin)")
    p.add_argument("--solve", choices=("seq_len", "batch_size"),
                   help="answer the longest sequence (at the example's batch size) or the largest batch (at its "
                        "sequence length) that fits --budget, from the memory model symbolic in both; with "
                        "zerofx.sequence_parallel.size S in --config, per rank at that S (a multiple of S)")
    p.add_argument("--max-seq-len", type=_int_arg(1), default=1 << 20,
                   help="upper bound for --solve seq_len when the model states none, >= 1 (default: 1048576)")
    p.add_argument("--max-batch-size", type=_int_arg(1), default=1 << 16, help="upper bound for --solve batch_size, >= 1 (default: 65536)")
    p.add_argument("--plot", type=Path, help="draw the memory timeline and a compute/communication Gantt chart, on one time "
                        "axis, to this PNG (its folder must exist and be writable; checked before planning; needs matplotlib "
                        "and --fold off for models that fold)")
    p.add_argument("--profile", default=None,
                   help="hardware the times are estimated for: cpu (one core per rank, gloo), h100 or h200 (DGX: 8 GPUs per node, "
                        f"NVLink and 8 x 400 Gb/s InfiniBand), or a file from zerofx calibrate (default: the --config's "
                        f"zerofx.profile where it sets one, else {DEFAULT_PROFILE})")
    p.add_argument("--verbose", action="store_true",
                   help="also print the FX node names the schedule rows and the peak refer to (issued after, waited at)")
    p.add_argument("--rank", type=_int_arg(0), default=0,
                   help="the rank to report, 0..world size - 1 (every rank runs the same graphs; default: 0)")
    p.add_argument("--fold", choices=("auto", "on", "off"), default="auto",
                   help="plan a model of N identical blocks from captures of 2 and 3 of them and extrapolate (fast; "
                        f"auto: when N >= {AUTO_FOLD_MIN_BLOCKS}); off plans every block (exact rows)")
    p.add_argument("--auto", action="store_true",
                   help="search the ZeRO stage, sequence-parallel size, shard group size, optimizer offload, tiling, activation recompute and micro-batch "
                        "(gradient accumulation keeping the global batch of --batch-size x world size) for the most predicted "
                        "tokens/s whose peak fits --budget (required); --stage and the --config's own keys are kept; prints the "
                        "chosen config block, the runners-up and why each lost, or what would have to change to fit; --fold applies to "
                        "each candidate (docs/autoplan.md)")
    p.add_argument("--time-limit", type=_float_arg(0, low_inclusive=False), metavar="SECONDS",
                   help="with --auto: start no candidate after this many seconds and print the best found so far, marked as "
                        "stopped early (Ctrl-C does the same, then exits 130; default: search to the end)")
    p.add_argument("--sweep", metavar="world-size=N1,N2,...",
                   help="weak scaling: at each world size, the plan the planner chooses (shard group size, prefetch, buckets) "
                        "and the flat stage-3 plan side by side, with predicted step time, efficiency relative to the smallest "
                        "size and memory per rank, for --profile (default stage 3; --plot draws it; docs/scaling.md)")
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
    p.add_argument("--offload", choices=PLACEMENT_CHOICES, default=NO_OFFLOAD,
                   help="where optimizer states live (default: none); auto: the planner places them by bandwidth")
    p.add_argument("--offload-param", choices=PLACEMENT_CHOICES, default=NO_OFFLOAD,
                   help="where stage-3 parameter shards live (default: none); auto: the planner places them by bandwidth")
    p.add_argument("--config", type=_CONFIG_ARG, help="DeepSpeed-style JSON config, for the --model activation estimate")
    p.add_argument("--format", choices=("table", "json"), default="table", help="output format (default: table)")
    add_infinity_arguments(p, int_arg=_int_arg, float_arg=_float_arg, bytes_arg=_bytes_arg)
    p.set_defaults(func=cmd_estimate)

    p = sub.add_parser("config-schema", help="list every DeepSpeed/zerofx config key, its type and accepted values",
                       description="The config's documentation, generated from the schema zerofx validates against.")
    p.add_argument("--format", choices=("markdown", "json"), default="markdown", help="output format (default: markdown)")
    p.set_defaults(func=cmd_config_schema)

    p = sub.add_parser("calibrate", help="measure this machine's collectives and compute into a planner profile",
                       description="Time all-gather, reduce-scatter, all-reduce and all-to-all on local gloo ranks (and a "
                                   "collective after compute), and a matmul, copies and the AdamW update on one core; fit the "
                                   "alpha-beta model; write a profile for zerofx plan --profile. Calibrate at the world size the "
                                   "job runs at. Under torchrun across nodes, the intra- and inter-node links are measured apart.")
    p.add_argument("--world-size", type=_int_arg(1, MAX_LOCAL_RANKS), default=2,
                   help=f"local ranks to measure with, 1..{MAX_LOCAL_RANKS} (default: 2)")
    p.add_argument("--out", type=Path, default=Path("zerofx_profile.json"),
                   help="profile file to write, in an existing writable folder (checked before measuring; "
                        "default: zerofx_profile.json)")
    p.add_argument("--repeats", type=_int_arg(1), default=5, help="timed repeats per measurement, >= 1 (default: 5)")
    p.set_defaults(func=cmd_calibrate)

    p = sub.add_parser("train", help="train a DNA model on local gloo (CPU) ranks, or as torchrun's ranks (NCCL on GPUs)",
                       description="Spawn local gloo ranks and train a DNA model with zerofx on a FASTA genome; under torchrun (one or "
                                   "many nodes), run as one of its ranks instead, over NCCL where there are GPUs.")
    p.add_argument("--model", default="tiny", metavar="MODEL_SPEC",
                   help=f"a bundled model size ({sizes}; docs/models.md), or FILE.py:CALLABLE / MODULE:CALLABLE returning (model, "
                        "example_inputs) as for zerofx plan: any nn.Module called as model(input_ids, labels=labels) that "
                        "returns the loss or an output with .loss (a Hugging Face model from a local config works); its "
                        "input embedding needs at least the vocabulary's rows (default: tiny; docs/training.md)")
    p.add_argument("--fasta", type=_FASTA_ARG,
                   help="FASTA genome, plain or .gz, one or more records (default: the bundled lambda phage genome): IUPAC "
                        f"nucleotide codes; refused when empty, headers only, corrupt, or over {MAX_FOREIGN_FRACTION * 100:g}%% "
                        "of its symbols are not nucleotide codes (a protein FASTA; the error names the first one's record and "
                        "offset)")
    p.add_argument("--data", type=_existing("prepared genome", "a folder written by zerofx data prepare", folder=True), metavar="DIR",
                   help="a genome prepared by zerofx data prepare (instead of --fasta, which is prepared into the data "
                        "cache, $ZEROFX_DATA_CACHE or ~/.cache/zerofx/genomes, on first use); refused when a source file "
                        "changed since it was prepared")
    p.add_argument("--bed", type=_BED_ARG,
                   help="draw training windows only inside this BED file's intervals (record, 0-based start, end); "
                        "default: every record, less the held-out regions")
    p.add_argument("--holdout-records", metavar="NAME[,NAME...]",
                   help="hold out these records (chromosomes) whole for evaluation, e.g. chr20,chr21 (default: the last "
                        "10%% of every record)")
    p.add_argument("--holdout-bed", type=_BED_ARG, help="hold out this BED file's intervals for evaluation instead")
    p.add_argument("--max-n-fraction", type=_float_arg(0, 1), default=0.1,
                   help="skip windows whose share of N is above this, 0..1 (default: 0.1)")
    p.add_argument("--reverse-complement", action="store_true",
                   help="read half the training windows, drawn at random, on the reverse strand")
    p.add_argument("--objective", choices=("clm", "mlm"), default="clm",
                   help="clm: next-token prediction, model(ids, labels=ids); mlm: masked LM, 15%% of tokens chosen, 80/10/10 "
                        "<mask>/random/unchanged, model(masked_ids, labels=labels) with labels -100 where nothing was masked, "
                        "masks reproducible from --seed; needs a bidirectional model, a bimamba size or a --model spec, and those "
                        "sizes train only with it (default: clm)")
    p.add_argument("--kmer", type=_int_arg(1), metavar="K",
                   help="tokenize into non-overlapping K-mers, 1..8, in the Nucleotide Transformer's vocabulary (<unk> <pad> "
                        "<mask> <cls> <eos> <bos>, the 4**K K-mers, A T C G N: 4,107 ids for K=6); --seq-len counts K-mers "
                        "(default: single bases A C G T N for clm, K=1 in that vocabulary for mlm)")
    p.add_argument("--world-size", type=_int_arg(1, MAX_LOCAL_RANKS),
                   help=f"number of local ranks to spawn, 1..{MAX_LOCAL_RANKS} (default: the config's zerofx.world_size, else 2; "
                        "under torchrun, torchrun's)")
    p.add_argument("--stage", type=int, help=f"ZeRO stage 0-3 (default: the config's, else {DEFAULT_TRAIN_STAGE})")
    p.add_argument("--config", type=_CONFIG_ARG, help="DeepSpeed-style JSON config; replaces the default AdamW and --lr")
    p.add_argument("--steps", type=_int_arg(1), default=20,
                   help="optimizer steps, >= 1; each takes the config's gradient_accumulation_steps micro-batches (default: 20)")
    p.add_argument("--seq-len", type=_int_arg(2), default=128,
                   help="tokens per window (K-mers with --kmer), 2..a bundled model's max_seq_len, >= 2 for a spec (default: 128)")
    p.add_argument("--batch-size", type=_int_arg(1),
                   help="windows per rank per micro-step, >= 1 (default: the config's train_micro_batch_size_per_gpu, or "
                        "train_batch_size / (gradient_accumulation_steps x world size), else 2); with a config, it must agree")
    p.add_argument("--lr", type=_float_arg(0), default=3e-3,
                   help="AdamW learning rate when no --config, a finite number >= 0 (default: 3e-3)")
    p.add_argument("--seed", type=_int_arg(0, MAX_SEED), default=0,
                   help="seed for the model init, the data shuffle and the mlm masks, 0..2**64-1 (default: 0)")
    p.add_argument("--print-graph", action="store_true",
                   help="before training, print rank 0's graphs with their counts of all-gathers, reduce-scatters, all-reduces and waits")
    p.add_argument("--print-graph-code", action="store_true", help="as --print-graph, and print each graph's code too (long)")
    p.add_argument("--output-dir", type=Path,
                   help="save sharded checkpoints here, and resume from its newest complete one (default: no checkpoints)")
    p.add_argument("--save-every", type=_int_arg(1), help="save every K >= 1 training steps (default: only after the last step)")
    p.add_argument("--keep-last", type=_int_arg(1),
                   help="after each save, delete the oldest step-N checkpoints beyond the newest K >= 1 (default: keep all)")
    p.add_argument("--schedule-steps", type=_int_arg(1),
                   help="the learning-rate scheduler's total_num_steps, over the config's: continue a finished run with more "
                        "--steps and a decay stretched over them (default: the config's)")
    p.add_argument("--collective-timeout", dest="collective_timeout_s", type=_float_arg(0, low_inclusive=False),
                   help="seconds a collective waits for a dead or stalled peer before the run fails, > 0 (default: the "
                        "config's zerofx.collective_timeout_s, else 300)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("data", help="prepare genomes once for training (zerofx data prepare)",
                       description="Genome data for zerofx train.")
    data_sub = p.add_subparsers(dest="data_command", metavar="DATA_COMMAND", required=True, help="prepare")
    p = data_sub.add_parser("prepare", help="read FASTA files once into a random-access folder for zerofx train --data",
                            description="Read one or more FASTA files (plain, gzip or BGZF) in one pass and write a folder "
                                        "of memory-mapped tokens, record offsets and names, the runs of N and the source files' "
                                        "identity and checksums; zerofx train --data reads it without reading the genome again "
                                        "(docs/training.md).")
    p.add_argument("inputs", metavar="FASTA_OR_MANIFEST", type=_existing("input", "a FASTA file or a manifest"), nargs="+",
                   help="FASTA files (.fa, .fasta, optionally .gz), or a manifest (*.tsv or *.txt) with one 'PATH [WEIGHT]' "
                        "per line: windows are drawn from each source in proportion to its weight, a finite number > 0 "
                        "(default 1; relative paths are relative to the manifest)")
    p.add_argument("--out", type=Path, required=True,
                   help="the folder to write: new, empty, or one this command wrote before (replaced whole once the new "
                        "one is complete)")
    p.add_argument("--verify", action="store_true", help="after writing, read the tokens back and check their SHA-256")
    p.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=cmd_data_prepare)

    p = sub.add_parser("consolidate", help="write a sharded checkpoint as one safetensors file",
                       description="Stream a sharded zerofx checkpoint into one safetensors file with the model's "
                                   "state_dict keys, tensor by tensor: memory stays bounded whatever the model's size.")
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", type=_existing("checkpoint directory", "the save_dir of engine.save_checkpoint",
                                                                   folder=True), help="the checkpoint directory (engine.save_checkpoint's save_dir)")
    p.add_argument("out", metavar="OUT.safetensors", type=Path, help="the file to write")
    p.add_argument("--tag", help="which checkpoint (default: the newest complete one)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="floating-point dtype of the output (default: fp32)")
    p.set_defaults(func=cmd_consolidate)
    return parser


def _attach_negative_values(argv: Sequence[str]) -> list[str]:
    """``--flag -5GiB`` as ``--flag=-5GiB``. argparse takes a token that starts with "-" and is
    not a plain number for another flag, and would answer "expected one argument"; attached, the
    value reaches the flag's own check, which names it and what is accepted."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and len(token) > 1 and token[0] == "-" and (token[1].isdigit() or token[1] == "."):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``zerofx`` command line; return the exit code (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(_attach_negative_values(sys.argv[1:] if argv is None else argv))
        args.as_program = argv is None  # NOTE [Freezing the imports]
        return args.func(args)
    except SystemExit as exc:  # --help and --version exit through argparse
        return exc.code if isinstance(exc.code, int) else 0
    except TrainingInterrupted as exc:  # NOTE [Ctrl-C stops every rank at one step] (zerofx/app/launch.py)
        print(f"zerofx: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C before any rank started, or in another command
        print("zerofx: stopped by Ctrl-C", file=sys.stderr)
        return 130
    except RankFailedError as exc:
        print(f"zerofx: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ZeroFXError as exc:
        print(f"zerofx: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
