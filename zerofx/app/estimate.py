"""``zerofx estimate``'s per-tier section: at stage 3 with model states off the device
(ZeRO-Infinity), bytes per rank on the device, in host memory and on NVMe, from the parameter
count, a layer shape and a node (``cost_models.infinity``). The flags and their defaults live
here; ``zerofx.app.commands.estimate`` adds them to the ``estimate`` parser and prints what
``infinity_section`` returns. Imports no torch (NOTE [A command line that answers at once] in ``zerofx/app/cli.py``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from zerofx.cost_models.offload import estimate_device_freed_bytes
from zerofx.cost_models.tiers import NO_OFFLOAD, PLACEMENT_CHOICES, Tier
from zerofx.cost_models.infinity import (
    DEFAULT_ASPECT,
    NodeSpec,
    estimate_infinity,
    format_infinity,
    infinity_json,
    layer_shape,
)

# The node assumed when no flag says otherwise (stated in --help and docs/infinity.md): host
# memory and NVMe of a DGX-2 (1.5 TB, 8 x 3.84 TB drives), each drive at zerofx's default NVMe
# bandwidths (3 GB/s read, 1.5 GB/s write), a PCIe 4 x16 link per device (zerofx's default host
# copy rate) and 50 TFLOP/s sustained per device.
DEFAULT_RANKS_PER_NODE = 8
DEFAULT_HOST_BYTES = 1.5e12
DEFAULT_NVME_BYTES = 30e12
DEFAULT_NVME_READ_BYTES_PER_S = 8 * 3e9
DEFAULT_NVME_WRITE_BYTES_PER_S = 8 * 1.5e9
DEFAULT_HOST_LINK_BYTES_PER_S = 12e9
DEFAULT_DEVICE_FLOPS_PER_S = 50e12
SHAPE_FLAGS = ("hidden", "layers")


def add_infinity_arguments(p: argparse.ArgumentParser, *, int_arg: Callable[..., Callable[[str], int]],
                           float_arg: Callable[..., Callable[[str], float]], bytes_arg: Callable[[str], float]) -> None:
    """The per-tier flags, as one argument group of ``p``; the type helpers are the CLI's."""
    g = p.add_argument_group(
        "per-tier estimate (stage 3, ZeRO-Infinity)",
        "Printed at stage 3 when any state is offloaded or a layer shape is given: bytes per rank on the device (the "
        "working set: largest gathered operator, prefetch, activation checkpoints, I/O buffers), in host memory and on "
        "NVMe, and the I/O seconds per step against the compute. The layer shape is a decoder of LAYERS blocks of width "
        "HIDDEN with a 4*HIDDEN MLP (12 * LAYERS * HIDDEN^2 parameters): give one and the other is solved from the "
        f"parameter count; give neither and HIDDEN = {DEFAULT_ASPECT} * LAYERS (GPT-3 175B's aspect).",
    )
    g.add_argument("--offload-grad", choices=PLACEMENT_CHOICES, default=NO_OFFLOAD,
                   help="where stage 2-3 gradient shards live (default: none); auto: the planner places them by bandwidth")
    g.add_argument("--hidden", type=int_arg(1), help="hidden size (default: solved from --params and --layers)")
    g.add_argument("--layers", type=int_arg(1), help="number of layers (default: solved from --params and --hidden)")
    g.add_argument("--seq-len", type=int_arg(1), default=1024, help="tokens per sequence (default: 1024)")
    g.add_argument("--micro-batch", type=int_arg(1), default=1, help="sequences per rank per step (default: 1)")
    g.add_argument("--prefetch", type=int_arg(0), default=1, help="operators gathered ahead of the one computing (default: 1)")
    g.add_argument("--tile-factor", type=int_arg(1), default=1, help="memory-centric tiling: tiles per large operator (default: 1)")
    g.add_argument("--buffer-count", type=int_arg(1), default=4, help="NVMe and fetch buffers in flight (default: 4)")
    g.add_argument("--checkpoints", choices=("device", "cpu"), default="device",
                   help="where the per-layer activation checkpoints live (default: device)")
    g.add_argument("--ranks-per-node", type=int_arg(1), help=f"ranks sharing a node's host memory and NVMe (default: min(world size, "
                   f"{DEFAULT_RANKS_PER_NODE}))")
    g.add_argument("--host-memory", type=bytes_arg, default=DEFAULT_HOST_BYTES, help="host memory per node (default: 1.5TB, a DGX-2)")
    g.add_argument("--nvme-capacity", type=bytes_arg, default=DEFAULT_NVME_BYTES, help="NVMe per node (default: 30TB, a DGX-2)")
    g.add_argument("--nvme-read-bw", type=float_arg(0, low_inclusive=False), default=DEFAULT_NVME_READ_BYTES_PER_S,
                   help="NVMe read bytes/s per node (default: 2.4e10, 8 drives at 3 GB/s)")
    g.add_argument("--nvme-write-bw", type=float_arg(0, low_inclusive=False), default=DEFAULT_NVME_WRITE_BYTES_PER_S,
                   help="NVMe write bytes/s per node (default: 1.2e10, 8 drives at 1.5 GB/s)")
    g.add_argument("--host-link-bw", type=float_arg(0, low_inclusive=False), default=DEFAULT_HOST_LINK_BYTES_PER_S,
                   help="host <-> device bytes/s per rank (default: 1.2e10, PCIe 4 x16)")
    g.add_argument("--device-flops", type=float_arg(0, low_inclusive=False), default=DEFAULT_DEVICE_FLOPS_PER_S,
                   help="sustained FLOP/s per device, for the compute the I/O hides behind (default: 5e13)")
    g.add_argument("--device-memory", type=bytes_arg, help="device memory per rank, for a fits verdict (e.g. 80GB)")


def wants_infinity(args: argparse.Namespace, stages: list[int]) -> bool:
    """Whether ``estimate`` prints the per-tier section: stage 3 is shown and a state is
    offloaded or a layer shape is given."""
    offloaded = any(v != "none" for v in (args.offload, args.offload_param, args.offload_grad))
    return 3 in stages and (offloaded or any(getattr(args, f) is not None for f in SHAPE_FLAGS))


def node_spec(args: argparse.Namespace) -> NodeSpec:
    return NodeSpec(
        ranks_per_node=args.ranks_per_node or min(args.world_size, DEFAULT_RANKS_PER_NODE),
        host_bytes=args.host_memory, nvme_bytes=args.nvme_capacity, nvme_read_bytes_per_s=args.nvme_read_bw,
        nvme_write_bytes_per_s=args.nvme_write_bw, host_link_bytes_per_s=args.host_link_bw, device_flops_per_s=args.device_flops,
    )


def infinity_section(args: argparse.Namespace, num_params: float) -> tuple[str, dict[str, Any]]:
    """The per-tier table and its JSON for the parsed ``estimate`` arguments."""
    shape = layer_shape(num_params, hidden=args.hidden, layers=args.layers, seq_len=args.seq_len, micro_batch=args.micro_batch)
    node = node_spec(args)
    choices = {"params": args.offload_param, "grads": args.offload_grad, "optimizer_states": args.offload}
    e = estimate_infinity(num_params, shape, world_size=args.world_size, choices=choices, node=node, prefetch=args.prefetch,
                          tile_factor=args.tile_factor, buffer_count=args.buffer_count, checkpoints=args.checkpoints)
    return (format_infinity(e, node, choices=choices, device_bytes=args.device_memory),
            infinity_json(e, node, args.device_memory))


def plan_tier_bytes(peak_bytes: float, offload: Any, *, grad_bytes: float = 0.0, grad_tier: str | None = None,
                    memory_is_host: bool = False) -> dict[str, float]:
    """Bytes per rank per tier for ``zerofx plan`` with offload: host memory and NVMe from the
    offload plans (optimizer-state records, parameter shards), the device from the memory
    model's peak less what those plans take off it, which on a CPU rank (``memory_is_host``) is
    only what goes to NVMe (NOTE [Host offload on a CPU rank]). Offloaded gradient shards
    (``grad_bytes`` on ``grad_tier``, "cpu" or "nvme") add to their tier only: the memory model
    already leaves them off the device (NOTE [Gradients leave at their bucket's wait])."""
    plans = [p for p in (getattr(offload, name, None) for name in ("optimizer", "params")) if p is not None]
    host = float(sum(p.bytes_on(Tier.CPU) for p in plans))
    nvme = float(sum(p.bytes_on(Tier.NVME) for p in plans))
    device = max(peak_bytes - estimate_device_freed_bytes(host, nvme, memory_is_host=memory_is_host), 0.0)
    if grad_tier == "cpu":
        host += grad_bytes
    elif grad_tier == "nvme":
        nvme += grad_bytes
    return {"device": device, "cpu": host, "nvme": nvme}


def format_plan_tiers(tiers: dict[str, float]) -> str:
    from zerofx.common.units import format_bytes

    return (f"per rank per tier: device {format_bytes(tiers['device'])} at the peak (the memory model's peak less what "
            f"offloading takes off the device), host memory {format_bytes(tiers['cpu'])}, NVMe {format_bytes(tiers['nvme'])}")
