"""``zerofx calibrate``: measure this machine's collectives and compute into a profile for
``zerofx plan --profile`` (``zerofx.app.calibrate``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from zerofx.app.commands.common import MAX_LOCAL_RANKS, check_output_file, int_arg
from zerofx.common.limits import check_positive


def add_parser(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="measure this machine's collectives and compute into a planner profile",
                       description="Time all-gather, reduce-scatter, all-reduce and all-to-all on local gloo ranks (and a "
                                   "collective after compute), and a matmul, copies and the AdamW update on one core; fit the "
                                   "alpha-beta model; write a profile for zerofx plan --profile. Calibrate at the world size the "
                                   "job runs at. Under torchrun across nodes, the intra- and inter-node links are measured apart.")
    p.add_argument("--world-size", type=int_arg(1, MAX_LOCAL_RANKS), default=2,
                   help=f"local ranks to measure with, 1..{MAX_LOCAL_RANKS} (default: 2)")
    p.add_argument("--out", type=Path, default=Path("zerofx_profile.json"),
                   help="profile file to write, in an existing writable folder (checked before measuring; "
                        "default: zerofx_profile.json)")
    p.add_argument("--repeats", type=int_arg(1), default=5, help="timed repeats per measurement, >= 1 (default: 5)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Measure collectives and compute on local gloo ranks; write a profile for ``plan --profile``."""
    check_positive("--world-size", args.world_size)
    check_positive("--repeats", args.repeats)
    check_output_file("--out", args.out)  # before about 11 s of measuring, not after
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
