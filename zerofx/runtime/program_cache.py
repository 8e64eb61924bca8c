"""The engine's compiled programs: one per input signature, the least recently used dropped first.

A call whose input signature (structure, shapes, dtypes, devices of its arguments) is new gets a
program captured, planned and lowered for it; at most ``zerofx.program_cache_size`` are kept,
since each holds its graphs (about 5 MiB for a small model). A new program is built once per job
(rank 0 builds it, or loads it from the plan cache, and sends it to the others: NOTE [One build
per job] in ``zerofx.runtime.rank_agreement``), and every rank checks it plans and lowers the
same collectives before its first graph runs. Every lookup first checks, with one small
collective, that all ranks call with the same signature.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from zerofx.common.errors import CaptureError, CollectiveTimeoutError, ZeroFXError
from zerofx.compiler import plan_cache
from zerofx.compiler.capture import LossFn, TensorInfo, split_loss_kwargs
from zerofx.compiler.pipeline import StepCapture
from zerofx.compiler.program import Program, capture_and_plan
from zerofx.config import ZeroConfig
from zerofx.config.compile_options import CompileOptions
from zerofx.passes._compat import pytree
from zerofx.passes.plan.offload import ParamOffloadPlan
from zerofx.runtime import rank_agreement


def misplaced_input(args: tuple[Any, ...], kwargs: Mapping[str, Any], device: torch.device) -> str | None:
    """What is wrong with the first tensor argument not on ``device`` (a meta tensor has no data
    to run on), naming it by position or keyword; None when all are there."""
    named = [(f"positional argument {i}", a) for i, a in enumerate(args)] + [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    for name, value in named:
        for path, leaf in pytree.tree_flatten_with_path(value)[0]:
            if not isinstance(leaf, torch.Tensor) or (leaf.device == device and not leaf.is_meta):
                continue
            where = f"{name}{pytree.keystr(path)}"
            if leaf.is_meta:
                return (f"{where} is on device meta, which holds no data; the engine runs on {device}: pass real tensors "
                        "(meta tensors are for zerofx.compile and for initialize's example_inputs)")
            return f"{where} is on device {leaf.device}, but the engine runs on {device}: move it there first (.to({str(device)!r}))"
    return None


class ProgramCache:
    """This rank's programs by input signature, least recently used first."""

    def __init__(
        self,
        model: nn.Module,
        cfg: ZeroConfig,
        *,
        loss_fn: LossFn | None,
        param_infos: tuple[TensorInfo, ...],
        device: torch.device,
        compute_dtype: torch.dtype | None,
        compile_options: CompileOptions,
        group: dist.ProcessGroup,
        rank: int,
        world_size: int,
        timeout_s: float,
        group_name: str,
        replicate_group_name: str,
        param_offload: ParamOffloadPlan | None,
        on_comm_failure: Callable[[str, BaseException], CollectiveTimeoutError],
    ) -> None:
        self.model, self.cfg, self.loss_fn = model, cfg, loss_fn
        self.param_infos, self.device, self.compute_dtype = param_infos, device, compute_dtype
        # The config's options for this world size, resolved once by the engine (zerofx.config.compile_options).
        self.compile_options = compile_options
        self.sequence_parallel = compile_options.sequence_parallel
        self.group, self.rank, self.world_size, self.timeout_s = group, rank, world_size, timeout_s
        self._on_comm_failure = on_comm_failure
        self._plan_cache_dir = cfg.plan_cache_dir  # None: the plan cache is off
        # The keyword arguments this rank's programs are built with (``capture_and_plan``,
        # ``Program``): the groups their collectives name and the parameter-offload placement.
        self.program_options: dict[str, Any] = {"group_name": group_name, "param_offload": param_offload,
                                                "replicate_group_name": replicate_group_name}
        self._programs: OrderedDict[Any, Program] = OrderedDict()

    def signature(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        model_kw, loss_kw = split_loss_kwargs(self.model, kwargs, self.loss_fn)
        leaves, spec = pytree.tree_flatten((tuple(args), model_kw, loss_kw))
        # A tensor on the engine's device, or on meta (an example input, captured on the engine's
        # device), counts as "engine": ranks on cuda:0 and cuda:1 have the same signature.
        key = tuple((tuple(x.shape), x.dtype, "engine" if x.is_meta or x.device == self.device else str(x.device))
                    if isinstance(x, torch.Tensor) else ("const", repr(x)) for x in leaves)
        return (repr(spec), key)

    def program_for(self, args: tuple[Any, ...], kwargs: Mapping[str, Any], *, misplaced: str | None = None) -> Program:
        """The program for this call's input signature, captured now if new. ``misplaced`` (from
        ``misplaced_input``) is raised as a ``ZeroFXError`` once ranks agree on it, before any graph runs."""
        sig = self.signature(args, kwargs)
        rank_agreement.agree_on_inputs(sig, misplaced, group=self.group, world_size=self.world_size, device=self.device,
                                       on_comm_failure=self._on_comm_failure)
        if misplaced is not None:
            raise ZeroFXError(misplaced)
        program = self._programs.get(sig)
        if program is not None:
            self._programs.move_to_end(sig)
            return program
        program = self._build_once(sig, lambda: self._load_or_build(sig, args, kwargs))
        rank_agreement.check_same_plan(program, self.rank, self.group, self.world_size)
        self._programs[sig] = program
        while len(self._programs) > self.cfg.program_cache_size:
            self._programs.popitem(last=False)  # the least recently used; a pending backward keeps its own
        return program

    def _build_once(self, sig: Any, build: Callable[[], Program]) -> Program:
        """``build()`` on rank 0, its program sent to the others (NOTE [One build per job])."""
        key = plan_cache.cache_key(model=self.model, input_signature=sig, loss_fn=self.loss_fn, cfg=self.cfg,
                                   world_size=self.world_size, rank=0, backend=str(dist.get_backend(self.group)),
                                   device=self.device, program_options=self.program_options)
        return rank_agreement.build_once(build, key=key, rank=self.rank, group=self.group, world_size=self.world_size,
                                         timeout_s=self.timeout_s, program_options=self.program_options,
                                         in_child=self.device.type == "cpu")  # NOTE [Rank 0 builds in a child]

    def _load_or_build(self, sig: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Program:
        """The program for this call: read from the plan cache when an entry has its key, else
        captured, planned and lowered (and stored there)."""
        capture = StepCapture(self.model, args, kwargs, loss_fn=self.loss_fn, param_infos=self.param_infos, device=self.device,
                              compute_dtype=self.compute_dtype, sequence_parallel=self.sequence_parallel)
        start = time.perf_counter()
        key = self.plan_cache_key(sig, capture)
        key_s = time.perf_counter() - start
        program = plan_cache.load_or_build(
            # A second launch with the same key loads the lowered graphs (zerofx.compiler.plan_cache).
            self._plan_cache_dir if key else None, key,
            lambda: capture_and_plan(capture, self.cfg, self.compile_options, **self.program_options),
            rank=self.rank, program_options=self.program_options, trust=self.cfg.plan_cache_trust,
            key_file=self.cfg.plan_cache_key_file)
        # Recording the step for the key is part of reading the entry on a hit, and of capturing on a miss.
        phase = "cache" if "cache" in program.setup_times else "capture"
        if key and phase in program.setup_times:
            program.setup_times[phase] += key_s
        return program

    def plan_cache_key(self, sig: Any, capture: StepCapture) -> dict[str, Any]:
        """What this rank's program for input signature ``sig`` depends on (NOTE [What a
        plan-cache key covers] in zerofx/compiler/plan_cache.py), the step ``capture`` records
        included (NOTE [The recorded forward is in the key]); empty when the cache is off or the
        step cannot be recorded before autograd (then it is built without the cache)."""
        if self._plan_cache_dir is None:
            return {}
        try:
            forward = plan_cache.graph_digest(capture.forward_record())
        except CaptureError:
            return {}
        return plan_cache.cache_key(model=self.model, input_signature=sig, loss_fn=self.loss_fn, cfg=self.cfg, world_size=self.world_size,
                                    rank=self.rank, backend=str(dist.get_backend(self.group)), device=self.device,
                                    program_options=self.program_options, forward=forward)

    @property
    def latest(self) -> Program | None:
        """The most recently used program; None before the first capture."""
        return next(reversed(self._programs.values()), None)

    def __iter__(self) -> Iterator[Program]:
        return iter(self._programs.values())

    def __len__(self) -> int:
        return len(self._programs)
