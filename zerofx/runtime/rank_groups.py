"""The process groups an engine runs over besides its own: sequence groups (sequence
parallelism) and shard groups (hierarchical sharding). Each is created once per layout and
process, and registered under a name every rank shares, so every rank lowers the same graphs.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from zerofx.config.compile_options import CompileOptions
from zerofx.common.errors import ZeroFXError
from zerofx.passes import _compat


_SEQUENCE_GROUPS: dict[tuple[Any, int, int], dist.ProcessGroup] = {}


def sequence_group(options: CompileOptions, group: dist.ProcessGroup, timeout: timedelta) -> dist.ProcessGroup | None:
    """This rank's sequence group, registered under the name ``options.sequence_parallel``
    carries; None without sequence parallelism. A collective when set: every rank creates every
    group.

    NOTE [Sequence groups]
    With ``zerofx.sequence_parallel.size`` S, ranks r with the same r // S form one sequence
    group: consecutive ranks, as a node's ranks usually are, since its all-to-alls move
    activations every layer. There are D = N / S groups, data-parallel to each other. Every
    rank of a group is given the same batch and runs its 1/S of each sequence (NOTE [Sequence
    parallelism as a rewrite] in passes/sequence/sequence_parallel.py). ZeRO is unchanged: model state is
    sharded over all N ranks and gradients are reduced over all N of them. Each rank registers
    its own group under the shared name ``zerofx_sequence_SofN`` (``sequence_group_name`` in
    zerofx/config/compile_options.py), so every rank lowers the same graph code. Each forward
    first compares a checksum of the inputs over the group (one small all-reduce): ranks of a
    group that pass different batches raise ``RankDivergenceError`` instead of training on a mix
    of slices.
    """
    spec, world_size = options.sequence_parallel, options.world_size
    if spec is None:
        return None
    if group is not dist.group.WORLD and dist.get_world_size() != world_size:
        raise ZeroFXError("zerofx.sequence_parallel needs the engine to run on the default process group; drop group= or "
                          "the sequence_parallel section")
    size = spec.size
    key = (dist.group.WORLD, world_size, size)
    for stale in [k for k in _SEQUENCE_GROUPS if k[0] is not dist.group.WORLD]:  # of a process group since destroyed
        del _SEQUENCE_GROUPS[stale]
    if key not in _SEQUENCE_GROUPS:
        rank = dist.get_rank()
        for first in range(0, world_size, size):
            members = list(range(first, first + size))
            g = dist.new_group(members, timeout=timeout)
            if rank in members:
                _compat.register_group_name(spec.group_name, g)
                _SEQUENCE_GROUPS[key] = g
    return _SEQUENCE_GROUPS[key]


def shard_group_names(shard_group_size: int, world_size: int) -> tuple[str, str]:
    """The names every rank registers its shard and replicate groups under (NOTE [Shard groups
    of consecutive ranks]): what the graphs' collectives name."""
    return f"zerofx_shard_{shard_group_size}of{world_size}", f"zerofx_replicate_{shard_group_size}of{world_size}"


def shard_groups(group: dist.ProcessGroup, world_size: int, shard_group_size: int,
                 timeout: timedelta) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """(this rank's shard group, its replicate group or None when sharding is flat). A collective
    when shard groups are set: every rank builds the device mesh.

    NOTE [Shard groups of consecutive ranks]
    With ``zerofx.shard_group_size`` K below the world size N, the ranks form a 2-D device mesh
    of shape (N / K, K), dims ("replicate", "shard"), laid out row by row: row g is ranks
    gK .. gK + K - 1, one shard group of consecutive ranks (on a cluster, ranks of one node), and
    column i is the ranks at shard index i = rank % K in every group. Every parameter is padded
    to a multiple of K and the rank at shard index i owns elements [i S, (i + 1) S), S = padded
    / K (``place_param``, ``Plan.shard_index``), so each group holds one whole sharded copy of
    the ZeRO state (16P/K bytes per rank in fp32 with Adam) and the N / K groups hold the same
    copy. Gathers (stage-3 parameters, ``param_sync``) and reduce-scatters run over the shard
    group; each reduce-scatter's shard is then all-reduced over the replicate group, the ranks
    that own the same shard, so every replica steps with the mean over all N ranks. torch names
    each sub-group differently; each rank registers its own two groups under two shared names
    (``zerofx_shard_KofN``, ``zerofx_replicate_KofN``), so every rank lowers the same graph code
    and the engine's check that ranks lowered the same graphs holds. Checkpoints store each shard
    once (group 0 writes the tensors), as a flat K-rank layout.
    """
    if shard_group_size == world_size:
        return group, None
    key = (dist.group.WORLD, world_size, shard_group_size)
    for stale in [k for k in _SHARD_GROUPS if k[0] is not dist.group.WORLD]:  # of a process group since destroyed
        del _SHARD_GROUPS[stale]
    if key in _SHARD_GROUPS:  # one mesh per layout and process: engines built later reuse its groups
        return _SHARD_GROUPS[key]
    if group is not dist.group.WORLD and dist.get_world_size() != world_size:
        raise ZeroFXError(f"zerofx.shard_group_size {shard_group_size} needs the engine to run on the default process group "
                          "(the device mesh spans every rank); drop group= or the shard group size")
    device_type = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    mesh = init_device_mesh(device_type, (world_size // shard_group_size, shard_group_size), mesh_dim_names=("replicate", "shard"))
    shard, replicate = mesh.get_group("shard"), mesh.get_group("replicate")
    for g, name in zip((shard, replicate), shard_group_names(shard_group_size, world_size)):
        _compat.set_group_timeout(g, timeout)
        _compat.register_group_name(name, g)
    _SHARD_GROUPS[key] = shard, replicate
    return shard, replicate


_SHARD_GROUPS: dict[tuple[Any, int, int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}
