"""Compute cost: FLOPs and bytes per ATen op, turned into seconds with a device profile.

Pure: a function of ``node.meta['val']`` shapes and a frozen ``DeviceSpec``. Matrix products
and attention are FLOP-bound; everything else is modelled as memory-bound (bytes read and
written over memory bandwidth).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten


@dataclass(frozen=True)
class DeviceSpec:
    """The rates one rank computes at (what the model assumes it reaches, not the datasheet's
    peak), and its memory (None: not stated; planners then take the budget from the config)."""

    name: str
    matmul_flops_per_s: float
    memory_bytes_per_s: float
    memory_capacity_bytes: float | None = None


# One CPU core of this project's machine, one thread per rank, measured with `zerofx calibrate`:
# a 512x512 fp32 matmul and a 64 MiB copy.
CPU_CORE = DeviceSpec("cpu-core", 74e9, 2.2e9)

# The share of the datasheet's dense bf16 peak a transformer's matrix products reach: ~60%, the
# model FLOPs utilization large-model training reports on H100 (e.g. ~50-60% MFU in Meta's
# Llama 3 paper, 400 TFLOP/s per GPU of 989) rounded up for the matmuls alone.
MATMUL_EFFICIENCY = 0.6
# The share of the HBM peak a streaming kernel reaches (~90% in STREAM-like copies on H100).
MEMORY_EFFICIENCY = 0.9
# H100 SXM5: 989.4 TFLOP/s dense BF16 (1,979 with sparsity), 80 GB HBM3 at 3.35 TB/s
# (NVIDIA H100 Tensor Core GPU datasheet).
H100_PEAK_BF16_FLOPS = 989.4e12
H100 = DeviceSpec("h100", H100_PEAK_BF16_FLOPS * MATMUL_EFFICIENCY, 3.35e12 * MEMORY_EFFICIENCY, 80e9)
# H200 SXM: the same Hopper tensor cores (989.4 TFLOP/s dense BF16), 141 GB HBM3e at 4.8 TB/s
# (NVIDIA H200 Tensor Core GPU datasheet).
H200_PEAK_BF16_FLOPS = 989.4e12
H200 = DeviceSpec("h200", H200_PEAK_BF16_FLOPS * MATMUL_EFFICIENCY, 4.8e12 * MEMORY_EFFICIENCY, 141e9)

DEVICES = {spec.name: spec for spec in (CPU_CORE, H100, H200)}


def _numel(val: object) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel()
    if isinstance(val, (list, tuple)):
        return sum(_numel(v) for v in val)
    return 0


def value_bytes(val: object) -> int:
    """Bytes of a node's value: a tensor, or a tuple/list of them (multi-output ops)."""
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(value_bytes(v) for v in val)
    return 0


def _shape(node: object) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape) if isinstance(node, fx.Node) else ()


def estimate_flops(node: fx.Node) -> int:
    """Floating-point operations of one node (2 per multiply-add)."""
    t = node.target
    if t is aten.mm.default:
        (m, k), (_, n) = _shape(node.args[0]), _shape(node.args[1])
        return 2 * m * k * n
    if t is aten.addmm.default:
        (m, k), (_, n) = _shape(node.args[1]), _shape(node.args[2])
        return 2 * m * k * n
    if t in (aten.bmm.default, aten.baddbmm.default):
        a, b = (node.args[0], node.args[1]) if t is aten.bmm.default else (node.args[1], node.args[2])
        (bs, m, k), (_, _, n) = _shape(a), _shape(b)
        return 2 * bs * m * k * n
    name = getattr(t, "__name__", "")
    if "scaled_dot_product" in name:
        q, k = _shape(node.args[0] if "backward" not in name else node.args[1]), _shape(node.args[1] if "backward" not in name else node.args[2])
        batch = math.prod(q[:-2])
        qk_and_pv = 2 * 2 * batch * q[-2] * k[-2] * q[-1]
        return qk_and_pv * (2 if "backward" in name else 1)
    return _numel(node.meta.get("val"))


def is_matmul_like(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", "")
    return node.target in (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default) or "scaled_dot_product" in name


def estimate_node_s(node: fx.Node, spec: DeviceSpec) -> float:
    """Seconds one node takes: FLOP-bound for matrix products and attention, else memory-bound."""
    if node.op != "call_function" or node.target is operator.getitem:
        return 0.0
    if is_matmul_like(node):
        return estimate_flops(node) / spec.matmul_flops_per_s
    moved = value_bytes(node.meta.get("val")) + sum(value_bytes(a.meta.get("val")) for a in node.all_input_nodes)
    return moved / spec.memory_bytes_per_s
