"""``zerofx plan MODEL --auto --budget B``: the whole-job search (``zerofx.planner.autoplan``) over
what the flags and the config leave open, and its result as a table or JSON (docs/autoplan.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from zerofx.app.commands.common import freeze_imports, load_profile_arg
from zerofx.app.commands.plan_output import DEFAULT_PROFILE
from zerofx.common.errors import UsageError
from zerofx.common.units import format_bytes, format_seconds, parse_bytes


def plan_auto(args: argparse.Namespace) -> int:
    """``zerofx plan MODEL --auto --budget B``: the search over the whole job's configuration
    (``zerofx.planner.autoplan``), formatted."""
    cfg = args.config  # the ZeroConfig ``zerofx plan`` parsed (NOTE [Options are parsed once])
    if args.budget is None and cfg.schedule.memory_budget_bytes is None:
        raise UsageError("--auto needs --budget, the memory per rank the chosen configuration must fit (e.g. 2GiB): the search "
                         "keeps the candidates whose predicted peak fits it (or zerofx.memory_budget in --config)")
    if args.solve is not None or args.plot is not None:
        raise UsageError("--auto searches configurations and draws nothing: leave out --solve and --plot")
    keys: dict[str, Any] = {"zerofx.auto": True}
    if args.budget is not None:
        given = parse_bytes(args.budget)
        keys["zerofx.memory_budget"] = int(given) if float(given).is_integer() else given
    if args.margin is not None:
        keys["zerofx.memory_margin"] = args.margin
    if args.profile != DEFAULT_PROFILE:
        keys["zerofx.profile"] = args.profile
    if args.stage is not None:  # --stage fixes the stage, as the config's would
        if cfg.config_stage is not None and cfg.config_stage != args.stage:
            raise UsageError(f"--stage {args.stage} disagrees with the config's zero_optimization.stage={cfg.config_stage}; "
                             "give one or make them equal")
        keys["zero_optimization.stage"] = args.stage
    cfg = cfg.with_keys(keys)
    budget = cfg.schedule.memory_budget_bytes  # less the margin (NOTE [The memory margin])
    from zerofx.app.model_spec import load_model, running_model_code
    from zerofx.planner.autoplan import search_config

    freeze_imports(args)
    load_profile_arg(args.profile)
    spec = load_model(args.model, batch_size=args.batch_size, seq_len=args.seq_len, config=args.config)
    with running_model_code(spec.label):
        result = search_config(spec.model, spec.args, spec.kwargs, cfg, world_size=args.world_size, budget_bytes=budget, fold=args.fold,
                               time_limit_s=args.time_limit,
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
    if result.stopped:  # NOTE [A search answers anytime] in zerofx/planner/autoplan.py
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
