"""``zerofx plan``: its flags, and the plan of a model at one world size (the whole model, or
folded from cuts of its repeated blocks), at each of several (``--sweep``), or the whole job's
search (``--auto``, ``zerofx.app.commands.plan_auto``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerofx.app.commands.common import (
    CONFIG_ARG,
    MODEL_HELP,
    bytes_arg,
    check_output_file,
    float_arg,
    freeze_imports,
    int_arg,
    load_profile_arg,
)
from zerofx.app.commands.plan_auto import plan_auto
from zerofx.app.commands.plan_output import DEFAULT_PROFILE
from zerofx.common.errors import UsageError
from zerofx.common.limits import AUTO_FOLD_MIN_BLOCKS, MAX_WORLD_SIZE, check_positive, check_stage
from zerofx.common.units import format_bytes, parse_bytes
from zerofx.models.sizes import model_config

if TYPE_CHECKING:
    from zerofx.planner.folding import RepeatedBlocks
    from zerofx.planner.solve import ModelSpec


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="print the plan, communication schedule and memory per rank, before anything runs",
                       description="Capture and plan a model on the meta device (no parameter memory): the sharding, one row "
                                   "per collective, memory per rank with a fits verdict, and the estimated step time.")
    p.add_argument("model", metavar="MODEL_SPEC", help=MODEL_HELP)
    p.add_argument("--world-size", type=int_arg(1, MAX_WORLD_SIZE),
                   help=f"number of ranks to plan for, 1..{MAX_WORLD_SIZE} (required unless the config implies it)")
    p.add_argument("--stage", type=int, help="ZeRO stage 0, 1, 2 or 3 (required unless the config sets it)")
    p.add_argument("--config", type=CONFIG_ARG, help="DeepSpeed-style JSON config (ds_config.json)")
    p.add_argument("--seq-len", type=int_arg(2),
                   help="tokens per sequence in a bundled model's example batch, 2..max_seq_len (default: min(512, max_seq_len))")
    p.add_argument("--batch-size", type=int_arg(1),
                   help="sequences in a bundled model's example batch, >= 1 (default: the --config's train_micro_batch_size_per_gpu, "
                        "else 1); with --auto, the sequences per rank per step without sequence parallelism")
    p.add_argument("--format", choices=("table", "json"), default="table", help="output format (default: table)")
    p.add_argument("--budget", type=bytes_arg,
                   help="memory per rank to fit in, e.g. 80GiB (units B, KB..TB, KiB..TiB): adds a fits / doesn't-fit verdict")
    p.add_argument("--margin", type=margin_arg, default=None,
                   help="share of --budget held back for the memory model's error, from 0 up to 1 (zerofx.memory_margin; "
                        "default 0): the planner, recompute \"auto\" and --auto fit the predicted peak to the budget times (1 - margin)")
    p.add_argument("--solve", choices=("seq_len", "batch_size"),
                   help="answer the longest sequence (at the example's batch size) or the largest batch (at its "
                        "sequence length) that fits --budget, from the memory model symbolic in both; with "
                        "zerofx.sequence_parallel.size S in --config, per rank at that S (a multiple of S)")
    p.add_argument("--max-seq-len", type=int_arg(1), default=1 << 20,
                   help="upper bound for --solve seq_len when the model states none, >= 1 (default: 1048576)")
    p.add_argument("--max-batch-size", type=int_arg(1), default=1 << 16, help="upper bound for --solve batch_size, >= 1 (default: 65536)")
    p.add_argument("--plot", type=Path, help="draw the memory timeline and a compute/communication Gantt chart, on one time "
                        "axis, to this PNG (its folder must exist and be writable; checked before planning; needs matplotlib "
                        "and --fold off for models that fold)")
    p.add_argument("--profile", default=None,
                   help="hardware the times are estimated for: cpu (one core per rank, gloo), h100 or h200 (DGX: 8 GPUs per node, "
                        f"NVLink and 8 x 400 Gb/s InfiniBand), or a file from zerofx calibrate (default: the --config's "
                        f"zerofx.profile where it sets one, else {DEFAULT_PROFILE})")
    p.add_argument("--verbose", action="store_true",
                   help="also print the FX node names the schedule rows and the peak refer to (issued after, waited at)")
    p.add_argument("--rank", type=int_arg(0), default=0,
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
    p.add_argument("--time-limit", type=float_arg(0, low_inclusive=False), metavar="SECONDS",
                   help="with --auto: start no candidate after this many seconds and print the best found so far, marked as "
                        "stopped early (Ctrl-C does the same, then exits 130; default: search to the end)")
    p.add_argument("--sweep", metavar="world-size=N1,N2,...",
                   help="weak scaling: at each world size, the plan the planner chooses (shard group size, prefetch, buckets) "
                        "and the flat stage-3 plan side by side, with predicted step time, efficiency relative to the smallest "
                        "size and memory per rank, for --profile (default stage 3; --plot draws it; docs/scaling.md)")
    p.set_defaults(func=run)


def margin_arg(text: str) -> float:
    """An argparse ``type=`` for --margin: a share of the budget, 0 <= margin < 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; accepted: a share of --budget from 0 up to, not including, 1, e.g. 0.1") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range; accepted: a share of --budget from 0 up to, not including, 1, e.g. 0.1")
    return value


def run(args: argparse.Namespace) -> int:
    """Print the ZeRO plan, the communication schedule, memory per rank and a summary."""
    if ":" not in args.model:
        model_config(args.model)
    from zerofx.config import parse_config

    profile_flag = args.profile
    if profile_flag is not None:
        load_profile_arg(profile_flag)  # a bad --profile is named as the flag's, not as a config key
    budget_flag = parse_bytes(args.budget) if args.budget is not None else None
    config_file = args.config
    # NOTE [Options are parsed once] (zerofx/config/__init__.py): --config, with the flags that
    # override its keys (--budget and --margin as zerofx.memory_budget and memory_margin, the
    # planner fitting the prefetch distance to them; --profile as zerofx.profile, sizing buckets
    # and prefetch), is parsed here, once; from here on args.config is the ZeroConfig.
    keys: dict[str, Any] = {}
    if budget_flag is not None:
        keys["zerofx.memory_budget"] = budget_flag
        if args.margin is not None:
            keys["zerofx.memory_margin"] = args.margin
    if profile_flag not in (None, DEFAULT_PROFILE):
        keys["zerofx.profile"] = profile_flag
    args.config = parse_config(config_file, keys=keys)
    # The times are for the hardware the plan is sized for: a config's zerofx.profile sizes its
    # buckets, prefetch and recompute, so without --profile it prices them too.
    args.profile = profile_flag or (args.config.profile if args.config.profile_is_explicit else None) or DEFAULT_PROFILE
    if args.sweep is not None:
        return _plan_sweep(args, budget_flag)
    if args.world_size is not None:
        check_positive("--world-size", args.world_size)
    check_stage(args.stage)
    if args.world_size is None and args.config.config_world_size is None:
        raise UsageError("--world-size is required (or give --config with zerofx.world_size or batch sizes)")
    if args.auto or args.config.auto is not None:
        return plan_auto(args)
    if args.time_limit is not None:
        raise UsageError("--time-limit bounds the search of --auto; add --auto (with --budget), or leave it out")
    _check_margin_has_budget(args.margin, budget_flag)
    # The verdict, --solve and folding fit what the planner fits: the budget less the margin.
    budget = args.config.schedule.memory_budget_bytes if budget_flag is not None else None
    # --solve samples the config as the file gives it: each sample must plan the same prefetch.
    user_config = config_file
    if args.solve is not None and budget is None:
        raise UsageError(f"--solve {args.solve} needs --budget, the memory per rank to fit in (e.g. 80GiB)")
    if args.plot is not None:
        check_output_file("--plot", args.plot)
    # What planning runs, loaded before the freeze (NOTE [Freezing the imports]).
    import zerofx.planner.folded_plan  # noqa: F401
    import zerofx.runtime.offload  # noqa: F401
    from zerofx.app.model_spec import load_model, running_model_code

    freeze_imports(args)
    comm, device = load_profile_arg(args.profile)
    spec = load_model(args.model, batch_size=args.batch_size, seq_len=args.seq_len, config=args.config)
    with running_model_code(spec.label):  # a sys.exit in the spec's forward is an error, not exit 0
        return _plan_spec(args, spec, budget, user_config, comm, device)


def _check_margin_has_budget(margin: float | None, budget: float | None) -> None:
    if margin is not None and budget is None:
        raise UsageError(f"--margin {margin} needs --budget: it is the share of the budget held back for the memory model's error")


def _plan_sweep(args: argparse.Namespace, budget_flag: float | None) -> int:
    """``zerofx plan MODEL --sweep world-size=...``: the chosen and the flat plan at each world
    size, from one capture (``zerofx.planner.sweep``)."""
    from zerofx.planner.sweep import parse_sweep

    try:
        sizes = parse_sweep(args.sweep)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if max(sizes) > MAX_WORLD_SIZE:
        raise UsageError(f"--sweep {args.sweep!r}: world sizes must be at most {MAX_WORLD_SIZE}")
    if args.world_size is not None or args.solve is not None or args.fold == "on":
        raise UsageError("--sweep plans its own world sizes and folds nothing: leave out --world-size, --solve and --fold on")
    check_stage(args.stage)
    _check_margin_has_budget(args.margin, budget_flag)
    if args.plot is not None:
        check_output_file("--plot", args.plot)
    from zerofx.app.model_spec import load_model, running_model_code

    freeze_imports(args)
    comm, device = load_profile_arg(args.profile)
    spec = load_model(args.model, batch_size=args.batch_size, seq_len=args.seq_len, config=args.config)
    from zerofx.compiler.program import resolve
    from zerofx.planner.sweep import format_sweep, plot_sweep, sweep_world_sizes

    stage = 3 if args.stage is None and args.config.config_stage is None else args.stage
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
    """``zerofx plan`` once the arguments are checked and the model is loaded: capture, plan, print."""
    import zerofx
    from zerofx.app.commands.plan_output import plot_report, plot_title, rank_runtime_bytes, report_json, shapes, step_note
    from zerofx.app.estimate import format_plan_tiers, plan_tier_bytes
    from zerofx.compiler.program import resolve
    from zerofx.cost_models.memory import estimate_process_peak_bytes
    from zerofx.passes.analysis.analyze_schedule import format_report
    from zerofx.planner.folded_plan import blocks_to_fold
    from zerofx.planner.solve import solve_memory
    from zerofx.runtime.offload import plan_for_program

    # NOTE [Budgets of the cut models] (zerofx/planner/autoplan.py): recompute "auto" recomputes
    # until the whole model's peak fits the budget, which the cut models are planned without.
    recompute_auto = args.config.schedule.recompute == "auto"
    blocks, note = blocks_to_fold(spec.model, args.fold, label=spec.label, recompute_auto=recompute_auto)
    if note is not None:
        print(note, file=sys.stderr)
    if blocks is not None:
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
    print(f"model {spec.label}: {type(spec.model).__name__}, example inputs {shapes(spec)}; profile {comm.name} / {device.name}")
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


def _plan_folded(args: argparse.Namespace, spec: ModelSpec, blocks: RepeatedBlocks, comm: Any, device: Any,
                 budget: float | None) -> int:
    """``zerofx plan`` from captures of the model cut to 2 and 3 blocks (``zerofx.planner.folded_plan``), printed."""
    from zerofx.app.commands.plan_output import folded_explanation, rank_runtime_bytes, shapes, step_note
    from zerofx.compiler.program import resolve
    from zerofx.cost_models.memory import estimate_process_peak_bytes
    from zerofx.planner.folded_plan import plan_model_folded
    from zerofx.planner.folding import folded_json, format_folded

    if args.solve is not None or args.plot is not None:
        raise UsageError("--solve and --plot need the whole model's timeline: add --fold off")
    planned = plan_model_folded(spec.model, spec.args, spec.kwargs, blocks, world_size=args.world_size, stage=args.stage,
                                config=args.config, rank=args.rank, comm=comm, device=device, budget_bytes=budget)
    folded, sample, decisions = planned.folded, planned.program, planned.decisions
    cfg = resolve(args.config, stage=args.stage, world_size=args.world_size)
    micro_batches = cfg.gradient_accumulation_steps
    if args.format == "json":
        plan_json = json.loads(sample.plan.to_json())
        plan_json["decisions"] = [*plan_json.get("decisions", []), *decisions]
        data = folded_json(folded, plan_json, budget, micro_batches=micro_batches)
        data["memory"]["process_peak_bytes"] = estimate_process_peak_bytes(
            folded.peak_bytes, rank_runtime_bytes(device, cfg))
        print(json.dumps(data, indent=1, default=list))
        return 0
    num_params = sum(p.numel() for p in spec.model.parameters())
    block_params = sum(p.numel() for p in spec.model.get_submodule(blocks.path)[0].parameters())
    print(f"model {spec.label}: {type(spec.model).__name__}, {num_params:,} parameters, example inputs {shapes(spec)}; "
          f"profile {comm.name} / {device.name}")
    print(folded_explanation(folded, block_params=block_params, num_params=num_params))
    print(sample.plan)
    for d in decisions:
        print(f"decision: {d}")
    print(format_folded(folded, budget_bytes=budget, verbose=args.verbose, step_note=step_note(args.profile, comm, device),
                        micro_batches=micro_batches))
    return 0
