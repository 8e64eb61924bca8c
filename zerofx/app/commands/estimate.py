"""``zerofx estimate``: model-state memory per device for each ZeRO stage with the ZeRO paper's
accounting, the activation peak of a ``--model`` from the memory model, and ZeRO-Infinity's
tiers (``zerofx.app.estimate``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from zerofx.app.commands.common import CONFIG_ARG, MODEL_HELP, bytes_arg, float_arg, freeze_imports, int_arg
from zerofx.app.estimate import add_infinity_arguments
from zerofx.common.errors import UsageError
from zerofx.common.limits import MAX_WORLD_SIZE, check_positive, check_stage
from zerofx.common.units import format_bytes
from zerofx.cost_models.tiers import NO_OFFLOAD, PLACEMENT_CHOICES

# `zerofx estimate --params`: 10**15, about a thousand times any model trained so far; its 16
# bytes per parameter stay far inside a float.
MAX_PARAMS = 1e15


def add_parser(sub: Any) -> None:
    p = sub.add_parser("estimate", help="model-state memory per device per ZeRO stage (the ZeRO paper's accounting)",
                       description="Per-device bytes of parameters, gradients and optimizer states for mixed-precision "
                                   "Adam (2 + 2 + 12 bytes per parameter), per ZeRO stage; with --model, also the "
                                   "activation peak from the memory model.")
    p.add_argument("model", metavar="MODEL_SPEC", nargs="?", help=MODEL_HELP)
    p.add_argument("--params", type=float_arg(0, MAX_PARAMS, low_inclusive=False),
                   help=f"number of parameters, e.g. 7.5e9, above 0 and at most {MAX_PARAMS:g} (instead of MODEL_SPEC)")
    p.add_argument("--world-size", type=int_arg(1, MAX_WORLD_SIZE), required=True, help=f"number of ranks, 1..{MAX_WORLD_SIZE}")
    p.add_argument("--stage", type=int, help="only this ZeRO stage (default: all of 0, 1, 2, 3)")
    p.add_argument("--offload", choices=PLACEMENT_CHOICES, default=NO_OFFLOAD,
                   help="where optimizer states live (default: none); auto: the planner places them by bandwidth")
    p.add_argument("--offload-param", choices=PLACEMENT_CHOICES, default=NO_OFFLOAD,
                   help="where stage-3 parameter shards live (default: none); auto: the planner places them by bandwidth")
    p.add_argument("--config", type=CONFIG_ARG, help="DeepSpeed-style JSON config, for the --model activation estimate")
    p.add_argument("--format", choices=("table", "json"), default="table", help="output format (default: table)")
    add_infinity_arguments(p, int_arg=int_arg, float_arg=float_arg, bytes_arg=bytes_arg)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
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
        from zerofx.app.model_spec import load_model, running_model_code
        from zerofx.compiler.program import plan_program, resolve
        from zerofx.config.compile_options import compile_options

        from zerofx.config import parse_config

        config = parse_config(args.config)  # once (NOTE [Options are parsed once]); each stage below reconciles it
        freeze_imports(args)
        spec = load_model(args.model, batch_size=None, seq_len=None, config=config)
        # Capture does not depend on the stage, only planning does: one capture serves every stage.
        with running_model_code(spec.label):
            captured = zerofx.capture_step(spec.model, spec.args, spec.kwargs)
        for s in stages:
            cfg = resolve(config, stage=s, world_size=args.world_size)
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
