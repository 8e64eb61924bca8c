"""ZeRO-Infinity's memory per rank and tier, and the I/O per step each tier costs, from the number
of parameters and the layer shape: what ``zerofx estimate`` prints in its per-tier table.

Pure: a function of the parameter count, a ``LayerShape``, where each model state may live and a
frozen ``NodeSpec``. Mixed-precision Adam at stage 3, the ZeRO paper's accounting: 2 bytes of
fp16 parameter, 2 of fp16 gradient and 12 of fp32 master, momentum and variance per parameter,
each sharded over the ranks.

NOTE [The Infinity working set]
With parameters, gradients and optimizer states off the device, the device holds what one step
needs at once, whatever the model's size (all in fp16, bytes per rank):

- gathered parameters: the largest operator, the MLP's ``h x 4h`` linear (``4 h^2`` elements),
  whole on every rank while it computes, plus the ``prefetch`` operators gathered ahead of it;
  with memory-centric tiling in ``tile_factor`` tiles, one tile of each;
- its gradient before the reduce-scatter, one tile's worth;
- the fetch buffers: ``buffer_count`` shards of that operator (``4 h^2 / N / tile_factor``
  elements) arriving from host memory before their all-gather;
- the activation checkpoints: one ``(micro_batch, seq_len, h)`` layer input per layer, kept for
  the recomputation in backward (with ``checkpoints="cpu"`` they go to host memory instead, as
  ZeRO-Infinity does for its largest models, and cross the host link once each way per step);
- the activation working memory: one layer's activations while it is recomputed and
  differentiated, ``micro_batch * seq_len * h * (34 + 5 * heads * seq_len / h)`` bytes (Korthikanti
  et al., 2022, "Reducing Activation Recomputation in Large Transformer Models", fp16, no tensor
  or sequence parallelism).

Host memory holds the states placed there and the NVMe staging buffers: zerofx reads and writes
each record whole (NOTE [NVMe I/O]), so ``buffer_count`` of the largest operator's records (16
bytes per owned element: its parameter, gradient and optimizer state). NVMe holds the rest.

NOTE [Placing model states by bandwidth]
Every byte of a model state crosses its tier's link a fixed number of times per step: an fp16
parameter shard is read twice (forward and backward gather it) and written once (after the
update); a gradient shard is written once (after its reduce-scatter) and read once (by the
optimizer); the optimizer state is read and written once. The NVMe seconds a byte of host memory
saves are then ``reads / nvme_read + writes / nvme_write`` for its kind, and ``place_states``
fills each rank's share of host memory with the kinds the user left to the planner ("auto"),
most saved per byte first (parameters, then gradients, then optimizer states; the last two move
the same bytes, so the order between them is a tie), the rest on NVMe. A kind the user placed
("device", "cpu" or "nvme") stays there. At stage 3 each rank moves only its own shard, over its
own share of the node's links, so the aggregate bandwidth grows with the number of nodes while
the bytes per rank fall as 1/N (the ZeRO-Infinity paper's bandwidth-centric partitioning): the
I/O seconds per step are ``bytes per rank * ranks per node / node bandwidth``. They are set
against the step's compute, ``8 * P * tokens`` floating-point operations per rank for its own
micro-batch (2 forward, 4 backward, 2 recomputation per parameter and token), which the I/O can
hide behind.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from zerofx.common.errors import PlanError
from zerofx.common.units import format_bytes
from zerofx.cost_models.tiers import NO_OFFLOAD, PLACEMENT_CHOICES, Tier

FP16_BYTES = 2
# Bytes per parameter of each model state, mixed-precision Adam (the ZeRO paper's 2 + 2 + 12).
STATE_BYTES_PER_PARAM = {"params": 2, "grads": 2, "optimizer_states": 12}
# Reads and writes of each state's bytes per step on an offload tier (NOTE [Placing model states by bandwidth]).
STATE_TRANSFERS = {"params": (2, 1), "grads": (1, 1), "optimizer_states": (1, 1)}
TIERS = tuple(t.value for t in Tier)  # the columns of the placement table, the device first
# Parameters per layer of a transformer block with a 4h MLP: 4 h^2 attention + 8 h^2 MLP.
PARAMS_PER_LAYER_PER_H2 = 12
DEFAULT_HEAD_DIM = 128
# hidden / layers when neither is given: GPT-3 175B's shape (12288 / 96).
DEFAULT_ASPECT = 128


@dataclass(frozen=True)
class LayerShape:
    """A decoder stack of ``layers`` blocks of width ``hidden``, and what one rank feeds it per step."""

    hidden: int
    layers: int
    heads: int
    seq_len: int
    micro_batch: int

    @property
    def num_params(self) -> int:
        return PARAMS_PER_LAYER_PER_H2 * self.layers * self.hidden**2

    @property
    def largest_op_numel(self) -> int:
        """The MLP's ``h x 4h`` weight, the largest operator."""
        return 4 * self.hidden**2


def layer_shape(
    num_params: float, *, hidden: int | None = None, layers: int | None = None, seq_len: int = 1024, micro_batch: int = 1,
    head_dim: int = DEFAULT_HEAD_DIM, aspect: float = DEFAULT_ASPECT,
) -> LayerShape:
    """The shape of a ``num_params`` model (``12 * layers * hidden^2``): both given, as given; one
    given, the other solved for (hidden rounded to a multiple of ``head_dim``); neither,
    ``hidden = aspect * layers``."""
    for name, value in (("hidden", hidden), ("layers", layers), ("seq_len", seq_len), ("micro_batch", micro_batch)):
        if value is not None and value < 1:
            raise PlanError(f"{name}={value}; accepted: an integer >= 1")
    if hidden is None and layers is None:
        layers = max(1, round((num_params / (PARAMS_PER_LAYER_PER_H2 * aspect**2)) ** (1 / 3)))
    if hidden is None:
        assert layers is not None
        hidden = max(head_dim, round(math.sqrt(num_params / (PARAMS_PER_LAYER_PER_H2 * layers)) / head_dim) * head_dim)
    if layers is None:
        layers = max(1, round(num_params / (PARAMS_PER_LAYER_PER_H2 * hidden**2)))
    return LayerShape(hidden=hidden, layers=layers, heads=max(1, hidden // head_dim), seq_len=seq_len, micro_batch=micro_batch)


@dataclass(frozen=True)
class NodeSpec:
    """One node: its ranks, its host memory and NVMe (bytes), and the bandwidths (bytes/s) its
    ranks share: NVMe read and write for the node, host <-> device per rank; and each device's
    sustained floating-point rate."""

    ranks_per_node: int
    host_bytes: float
    nvme_bytes: float
    nvme_read_bytes_per_s: float
    nvme_write_bytes_per_s: float
    host_link_bytes_per_s: float
    device_flops_per_s: float


@dataclass(frozen=True)
class InfinityEstimate:
    """Bytes per rank on each tier, what makes them up, and the I/O seconds per step."""

    shape: LayerShape
    world_size: int
    placement: Mapping[str, Mapping[str, float]]  # state -> tier -> bytes per rank
    working_set: Mapping[str, float]  # NOTE [The Infinity working set], bytes per rank
    host_buffer_bytes: float
    checkpoint_host_bytes: float  # activation checkpoints in host memory (``checkpoints="cpu"``)
    tier_bytes: Mapping[str, float]  # per rank
    io_s: Mapping[str, float]  # seconds per step per rank: "host_link", "nvme"
    compute_s: float

    @property
    def exposed_io_s(self) -> float:
        """What the I/O outlasts the compute by, if it overlaps perfectly (a lower bound)."""
        return max(max(self.io_s.values(), default=0.0) - self.compute_s, 0.0)


def estimate_working_set_bytes(shape: LayerShape, *, world_size: int, prefetch: int = 1, tile_factor: int = 1,
                               buffer_count: int = 4) -> dict[str, float]:
    """The device's working set per rank, in bytes; see NOTE [The Infinity working set]."""
    if prefetch < 0 or tile_factor < 1 or buffer_count < 1:
        raise PlanError(f"prefetch={prefetch}, tile_factor={tile_factor}, buffer_count={buffer_count}; accepted: "
                         "prefetch >= 0, tile_factor >= 1, buffer_count >= 1")
    tile = shape.largest_op_numel / tile_factor
    h, s, b = shape.hidden, shape.seq_len, shape.micro_batch
    return {
        "gathered_params": (1 + prefetch) * tile * FP16_BYTES,
        "gathered_grads": tile * FP16_BYTES,
        "fetch_buffers": buffer_count * math.ceil(tile / world_size) * FP16_BYTES,
        "activation_checkpoints": FP16_BYTES * b * s * h * shape.layers,
        "activation_working": b * s * h * (34 + 5 * shape.heads * s / h),
    }


def place_states(num_params: float, *, world_size: int, choices: Mapping[str, str], host_budget_bytes: float,
                 node: NodeSpec) -> dict[str, dict[str, float]]:
    """Bytes per rank of each model state on each tier; see NOTE [Placing model states by bandwidth].
    ``choices`` maps each state to one of ``PLACEMENT_CHOICES``; ``host_budget_bytes`` is this
    rank's host memory for "auto" states after the explicit "cpu" ones."""
    share = node.ranks_per_node  # ranks sharing the node's NVMe bandwidth
    out: dict[str, dict[str, float]] = {}
    auto: list[tuple[float, int, str]] = []
    for order, (state, per_param) in enumerate(STATE_BYTES_PER_PARAM.items()):
        choice = choices.get(state, NO_OFFLOAD)
        if choice not in PLACEMENT_CHOICES:
            raise PlanError(f"{state}={choice!r}; accepted: {', '.join(PLACEMENT_CHOICES)}")
        nbytes = per_param * num_params / world_size
        out[state] = dict.fromkeys(TIERS, 0.0)
        if choice == "auto":
            reads, writes = STATE_TRANSFERS[state]
            saved_s_per_byte = share * (reads / node.nvme_read_bytes_per_s + writes / node.nvme_write_bytes_per_s)
            auto.append((saved_s_per_byte, order, state))
        else:
            out[state][Tier.DEVICE.value if choice == NO_OFFLOAD else choice] = nbytes
    left = max(host_budget_bytes, 0.0)
    for _, _, state in sorted(auto, key=lambda a: (-a[0], a[1])):
        nbytes = STATE_BYTES_PER_PARAM[state] * num_params / world_size
        on_host = min(nbytes, left)
        left -= on_host
        out[state]["cpu"], out[state]["nvme"] = on_host, nbytes - on_host
    return out


def estimate_infinity(
    num_params: float, shape: LayerShape, *, world_size: int, choices: Mapping[str, str], node: NodeSpec, prefetch: int = 1,
    tile_factor: int = 1, buffer_count: int = 4, checkpoints: str = "device",
) -> InfinityEstimate:
    """Per-rank bytes on the device, in host memory and on NVMe at stage 3, and the I/O seconds
    per step against the compute (NOTE [The Infinity working set], NOTE [Placing model states by
    bandwidth])."""
    if checkpoints not in ("device", "cpu"):
        raise PlanError(f"checkpoints={checkpoints!r}; accepted: device, cpu")
    working = estimate_working_set_bytes(shape, world_size=world_size, prefetch=prefetch, tile_factor=tile_factor,
                                         buffer_count=buffer_count)
    checkpoint_bytes = working["activation_checkpoints"] if checkpoints == "cpu" else 0.0
    if checkpoints == "cpu":
        working["activation_checkpoints"] = 0.0
    owned_largest = math.ceil(shape.largest_op_numel / world_size)
    any_nvme = any(c in ("nvme", "auto") for c in choices.values())
    host_buffers = buffer_count * owned_largest * sum(STATE_BYTES_PER_PARAM.values()) if any_nvme else 0.0
    host_per_rank = node.host_bytes / node.ranks_per_node
    explicit_cpu = sum(STATE_BYTES_PER_PARAM[s] * num_params / world_size for s, c in choices.items() if c == "cpu")
    placement = place_states(num_params, world_size=world_size, choices=choices,
                             host_budget_bytes=host_per_rank - host_buffers - explicit_cpu - checkpoint_bytes, node=node)
    tier_bytes = {t: sum(p[t] for p in placement.values()) for t in TIERS}
    tier_bytes["device"] += sum(working.values())
    tier_bytes["cpu"] += host_buffers + checkpoint_bytes
    share = node.ranks_per_node
    nvme_s = sum(
        placement[s]["nvme"] * share * (r / node.nvme_read_bytes_per_s + w / node.nvme_write_bytes_per_s)
        for s, (r, w) in STATE_TRANSFERS.items()
    )
    # Off the device, every parameter shard crosses the host link twice (forward and backward
    # fetches) and every gradient shard once; the optimizer runs in host memory.
    off_device = {s: placement[s]["cpu"] + placement[s]["nvme"] for s in placement}
    link_s = (2 * off_device["params"] + off_device["grads"] + 2 * checkpoint_bytes) / node.host_link_bytes_per_s
    tokens = shape.micro_batch * shape.seq_len
    compute_s = 8 * num_params * tokens / node.device_flops_per_s
    return InfinityEstimate(shape=shape, world_size=world_size, placement=placement, working_set=working,
                            host_buffer_bytes=host_buffers, checkpoint_host_bytes=checkpoint_bytes,
                            tier_bytes=tier_bytes, io_s={"host_link": link_s, "nvme": nvme_s},
                            compute_s=compute_s)


_STATE_LABELS = {"params": "parameters (fp16)", "grads": "gradients (fp16)", "optimizer_states": "optimizer states (fp32 master, Adam)"}
_WORKING_LABELS = {
    "gathered_params": "working set: gathered parameters",
    "gathered_grads": "working set: gradient before reduce-scatter",
    "fetch_buffers": "working set: fetch buffers",
    "activation_checkpoints": "activation checkpoints",
    "activation_working": "working set: one layer's activations",
}


def node_fits(e: InfinityEstimate, node: NodeSpec, device_bytes: float | None) -> dict[str, bool | None]:
    """Whether each tier's bytes fit: the device per rank (None without ``device_bytes``), host
    memory and NVMe per node."""
    return {
        "device": None if device_bytes is None else e.tier_bytes["device"] <= device_bytes,
        "cpu": e.tier_bytes["cpu"] * node.ranks_per_node <= node.host_bytes,
        "nvme": e.tier_bytes["nvme"] * node.ranks_per_node <= node.nvme_bytes,
    }


def infinity_json(e: InfinityEstimate, node: NodeSpec, device_bytes: float | None) -> dict[str, object]:
    """The estimate as JSON-ready data (bytes per rank, seconds per step)."""
    return {
        "shape": {"hidden": e.shape.hidden, "layers": e.shape.layers, "heads": e.shape.heads, "seq_len": e.shape.seq_len,
                  "micro_batch": e.shape.micro_batch},
        "node": {k: getattr(node, k) for k in NodeSpec.__dataclass_fields__},
        "placement_bytes": {s: dict(t) for s, t in e.placement.items()},
        "working_set_bytes": dict(e.working_set),
        "host_buffer_bytes": e.host_buffer_bytes,
        "checkpoint_host_bytes": e.checkpoint_host_bytes,
        "per_rank_bytes": dict(e.tier_bytes),
        "per_node_bytes": {t: b * node.ranks_per_node for t, b in e.tier_bytes.items()},
        "fits": node_fits(e, node, device_bytes),
        "io_s": dict(e.io_s),
        "compute_s": e.compute_s,
        "exposed_io_s": e.exposed_io_s,
    }


def format_infinity(e: InfinityEstimate, node: NodeSpec, *, choices: Mapping[str, str], device_bytes: float | None) -> str:
    """The per-tier table ``zerofx estimate`` prints, with the placement decisions and the I/O
    seconds per step."""
    from tabulate import tabulate

    s = e.shape
    rows = [[_STATE_LABELS[k], *(format_bytes(v[t]) for t in TIERS)] for k, v in e.placement.items()]
    for k, v in e.working_set.items():
        if v:
            rows.append([_WORKING_LABELS[k], format_bytes(v), "-", "-"])
    if e.checkpoint_host_bytes:
        rows.append(["activation checkpoints", "-", format_bytes(e.checkpoint_host_bytes), "-"])
    if e.host_buffer_bytes:
        rows.append(["NVMe staging buffers", "-", format_bytes(e.host_buffer_bytes), "-"])
    rows.append(["per rank", *(format_bytes(e.tier_bytes[t]) for t in TIERS)])
    rows.append([f"per node ({node.ranks_per_node} ranks)", *(format_bytes(e.tier_bytes[t] * node.ranks_per_node) for t in TIERS)])
    fits = node_fits(e, node, device_bytes)
    verdict = {True: "fits", False: "DOES NOT FIT", None: "-"}
    rows.append(["capacity", "-" if device_bytes is None else f"{format_bytes(device_bytes)} per rank", f"{format_bytes(node.host_bytes)} per node",
                 f"{format_bytes(node.nvme_bytes)} per node"])
    rows.append(["", *(verdict[fits[t]] for t in TIERS)])
    nodes = math.ceil(e.world_size / node.ranks_per_node)
    lines = [
        f"stage 3, every tier, per rank: layer shape {s.layers} layers x hidden {s.hidden}, {s.heads} heads "
        f"(12 * layers * hidden^2 = {s.num_params:.3g} parameters); micro-batch {s.micro_batch} x {s.seq_len} tokens per rank, "
        "activation checkpoint at every layer",
        tabulate(rows, headers=["", "device", "host memory", "NVMe"], tablefmt="simple", disable_numparse=True,
                 colalign=("left", "right", "right", "right")),
    ]
    auto = [state for state, choice in choices.items() if choice == "auto"]
    if auto:
        share = node.ranks_per_node
        saved_s = sum(
            e.placement[st]["cpu"] * share * (r / node.nvme_read_bytes_per_s + w / node.nvme_write_bytes_per_s)
            for st, (r, w) in STATE_TRANSFERS.items() if st in auto
        )
        placed = "; ".join(f"{st.replace('_', ' ')} {format_bytes(e.placement[st]['cpu'])} in host memory, {format_bytes(e.placement[st]['nvme'])} "
                           "on NVMe" for st in auto)
        lines.append(f"placement by bandwidth (host memory first to what moves most per byte each step: parameters, read twice "
                     f"and written once, then gradients and optimizer states, read and written once): {placed} per rank; "
                     f"saves {saved_s:.3g} s of NVMe I/O per step against all of them on NVMe")
    lines.append(
        f"I/O per step per rank: host link {e.io_s['host_link']:.3g} s at {node.host_link_bytes_per_s / 1e9:.3g} GB/s; NVMe "
        f"{e.io_s['nvme']:.3g} s at {node.nvme_read_bytes_per_s / 1e9:.3g} GB/s read and {node.nvme_write_bytes_per_s / 1e9:.3g} GB/s "
        f"write per node shared by {node.ranks_per_node} rank(s) (aggregate over {nodes} node(s): "
        f"{nodes * node.nvme_read_bytes_per_s / 1e9:.3g} GB/s read); compute {e.compute_s:.3g} s at "
        f"{node.device_flops_per_s / 1e12:.3g} TFLOP/s per device; I/O not hidden by compute: at least {e.exposed_io_s:.3g} s"
    )
    return "\n".join(lines)
