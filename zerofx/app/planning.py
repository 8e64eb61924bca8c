"""What ``zerofx plan`` does beyond ``zerofx.compile``: load a model spec, answer "the longest
sequence that fits", and draw the memory timeline and the compute/communication Gantt chart.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import site
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sympy
import torch
import torch.nn as nn

from zerofx.cost_models.memory_timeline import TimelinePoint
from zerofx.cost_models.symbolic import B, T, fit_timeline, fit_timeline_batch_seq, longest_fitting
from zerofx.passes.analyze_schedule import ScheduleReport, summary_json
from zerofx import cost_models, passes
from zerofx.compiler import plan_cache
from zerofx.common.errors import CaptureError, ZeroFXError
from zerofx.compiler.capture import StepTracer
from zerofx.passes._compat import pytree
from zerofx.compiler.program import Program, compile, resolve
from zerofx.common.units import binary_unit, format_bytes


@dataclass(frozen=True)
class ModelSpec:
    model: nn.Module
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    label: str


def _user_code_error(spec: str, doing: str, exc: BaseException, accepted: str) -> ZeroFXError:
    """One line for an exception (or ``sys.exit``) out of the user's model code, with where it came from."""
    if isinstance(exc, SystemExit):
        what = f"called sys.exit({exc.code!r})"
    else:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        what = f"raised {type(exc).__name__}" + (f": {first_line}" if first_line else "")
    frames = _user_frames(traceback.extract_tb(exc.__traceback__))
    if isinstance(exc, SyntaxError) and exc.filename:
        where = f" (at {Path(exc.filename).name}:{exc.lineno})"
    else:
        where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return ZeroFXError(f"model spec {spec!r} {what}{where} while {doing}; {accepted}")


def _user_frames(frames: traceback.StackSummary) -> list[traceback.FrameSummary]:
    """The frames of ``frames`` in the user's own code: not in an installed package nor in
    zerofx. A library can wrap ``sys.exit`` (wandb does, once ``wandb.init`` has run), or raise
    inside a call from the user's forward; the line to name is the user's. All frames where
    none is the user's."""
    # With a trailing separator, so a folder matches and a longer name beside it does not.
    outside = tuple(os.path.join(Path(p).resolve(), "") for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                                     sysconfig.get_paths()["stdlib"], site.getusersitepackages(),
                                                     Path(nn.__file__).resolve().parents[1], Path(__file__).resolve().parents[1],
                                                     Path(passes.__file__).resolve().parent, Path(cost_models.__file__).resolve().parent,
                                                     # packages another environment's folder provides (a .pth file's entry)
                                                     *(p for p in sys.path if Path(p).name in ("site-packages", "dist-packages"))})
    mine = [f for f in frames if not str(Path(f.filename).resolve()).startswith(outside)]
    return mine or list(frames)


_SPEC_CONTRACT = "a model spec's module imports, and its callable returns (model, example_inputs), without exiting or raising"


def _run_user_code(spec: str, doing: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, with any exception or ``sys.exit`` from it reported as a ``ZeroFXError`` naming
    the spec: a model spec is the user's code, and a SystemExit from it would otherwise end
    ``zerofx plan`` with its exit code (0 for ``sys.exit(0)``) and no output."""
    try:
        return fn()
    except ZeroFXError:
        raise
    except (Exception, SystemExit) as exc:  # not KeyboardInterrupt: Ctrl-C still stops the program
        raise _user_code_error(spec, doing, exc, _SPEC_CONTRACT) from exc


@contextlib.contextmanager
def running_model_code(label: str) -> Iterator[None]:
    """Around capture and planning of a spec's model, whose forward is the user's code: a
    ``sys.exit`` in it becomes a ``ZeroFXError`` naming ``label``. Other exceptions pass through
    (capture already reports them as ``CaptureError``)."""
    try:
        yield
    except SystemExit as exc:
        raise _user_code_error(label, "zerofx traced the model's forward", exc,
                               "a forward returns the loss (or an output holding it), not exit") from exc


def load_model_spec(spec: str) -> ModelSpec:
    """``path/to/file.py:callable`` or ``package.module:callable``. The callable takes no
    arguments and returns ``(model, example_inputs)``: a tuple of positional arguments, a dict of
    keyword arguments, or ``(args_tuple, kwargs_dict)``. Build the model on the meta device.

    Every failure is a one-line ``ZeroFXError`` naming the spec: a missing file or module, an
    exception or ``sys.exit`` while importing it or calling the callable, a wrong return value,
    and a model with no trainable parameters."""
    if ":" not in spec:
        raise ZeroFXError(f"model spec {spec!r} is not FILE.py:CALLABLE or MODULE:CALLABLE")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise ZeroFXError(f"model spec file {where!r} does not exist")
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        assert module_spec is not None and module_spec.loader is not None
        module = importlib.util.module_from_spec(module_spec)
        _run_user_code(spec, f"zerofx imported {where}", lambda: module_spec.loader.exec_module(module))
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise ZeroFXError(f"cannot import {where!r} from model spec {spec!r}: {exc}") from exc
        except (Exception, SystemExit) as exc:  # the module's own code failed as it ran
            raise _user_code_error(spec, f"zerofx imported {where}", exc, _SPEC_CONTRACT) from exc
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ZeroFXError(f"{where!r} has no callable {name!r} (model spec {spec!r})")
    result = _run_user_code(spec, f"zerofx called {name}()", factory)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise ZeroFXError(f"{spec} must return (model, example_inputs), got {type(result).__name__}")
    model, inputs = result
    if isinstance(inputs, Mapping):
        args, kwargs = (), dict(inputs)
    elif isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[0], tuple) and isinstance(inputs[1], Mapping):
        args, kwargs = inputs
    elif isinstance(inputs, tuple):
        args, kwargs = inputs, {}
    else:
        raise ZeroFXError(f"{spec}'s example_inputs must be a tuple, a dict, or (tuple, dict); got {type(inputs).__name__}")
    check_trainable(model, f"model spec {spec!r}")
    args, kwargs = tuple(args), dict(kwargs)
    if _takes_labels(model) and "labels" not in kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
        # The input ids alone: plan the call zerofx train makes, model(input_ids, labels=input_ids).
        kwargs["labels"] = args[0]
    return ModelSpec(model, args, kwargs, spec)


def _takes_labels(model: nn.Module) -> bool:
    """Whether ``model``'s forward has a ``labels`` parameter (Hugging Face style, and the call
    ``zerofx train`` makes)."""
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def check_trainable(model: nn.Module, label: str) -> None:
    """Raise ``ZeroFXError`` unless ``model`` has a parameter with requires_grad: without one
    there is nothing to shard or train (and torch's own errors, a StopIteration from
    ``next(model.parameters())`` or "optimizer got an empty parameter list", say neither)."""
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        found = "no parameters" if not params else f"{len(params)} parameters, all frozen (requires_grad=False)"
        raise ZeroFXError(f"{label}: {type(model).__name__} has {found}; zerofx needs at least one trainable parameter")


def with_seq_len(value: Any, old: int, new: int) -> Any:
    """``value`` with every tensor whose dim 1 is the sequence (``old``) resized to ``new``."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == old:
        shape = list(value.shape)
        shape[1] = new
        return torch.zeros(shape, dtype=value.dtype, device=value.device)
    if isinstance(value, tuple):
        return tuple(with_seq_len(v, old, new) for v in value)
    if isinstance(value, dict):
        return {k: with_seq_len(v, old, new) for k, v in value.items()}
    return value


def with_batch_size(value: Any, old: int, new: int) -> Any:
    """``value`` with every tensor whose dim 0 is the batch (``old``) resized to ``new``."""
    if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == old:
        return torch.zeros((new, *value.shape[1:]), dtype=value.dtype, device=value.device)
    if isinstance(value, tuple):
        return tuple(with_batch_size(v, old, new) for v in value)
    if isinstance(value, dict):
        return {k: with_batch_size(v, old, new) for k, v in value.items()}
    return value


SOLVABLE = {"seq_len": T, "batch_size": B}
# How far a sample may stray from the fitted polynomial (NOTE [Why a tolerance] in cost_models/symbolic.py).
SOLVE_REL_TOL = 1e-3
PEAK_REL_TOL = 0.05


@dataclass(frozen=True)
class SolveResult:
    variable: str  # "seq_len" or "batch_size"
    value: int  # the largest that fits; 0 when even the smallest does not
    peak_expr: sympy.Expr  # bytes at the peak node, a polynomial in B and T (in T alone where only the example's batch fits)
    peak_node: str
    samples: tuple[tuple[int, int], ...]  # the (batch, seq_len) points captured
    sequence_parallel: int = 1  # the config's sequence-parallel size S: seq_len is a multiple of it, per rank T/S
    # The confirming captures (NOTE [Why a tolerance] in cost_models/symbolic.py): the measured
    # peak at the answer, and at one unit past it (None where that was not captured: an answer
    # of 0, or one at the upper bound).
    peak_at_value: int | None = None
    peak_past_value: int | None = None

    @property
    def seq_len(self) -> int:
        assert self.variable == "seq_len"
        return self.value


# NOTE [Solving for the context under sequence parallelism]
# With zerofx.sequence_parallel.size S, every capture is of the rewritten step (passes/
# sequence_parallel.py), so the timeline is one rank's: token-wise activations of T/S
# positions, and attention as the rewrite runs it (Ulysses: (B, H/S, T, D), the same bytes as
# (B, H, T/S, D)). The fit and the answer are per rank at that S; model state is ZeRO's over all
# N ranks at any S. The rewrite refuses a length S does not divide, so the samples, the bound
# and the confirming captures are multiples of S, and the answer is the largest multiple of S
# that fits.
def sequence_parallel_size(config: Any, *, world_size: int, stage: int) -> int:
    """The config's ``zerofx.sequence_parallel.size``, 1 without it."""
    spec = resolve(config, stage=stage, world_size=world_size).sequence_parallel
    return 1 if spec is None else spec.size


# NOTE [Solve samples in the plan cache]
# A solve captures, plans and lowers its model at eleven or more (batch, length) points, seconds
# each. Each sample's lowered program goes into the plan cache (docs/plan-cache.md), keyed as the
# engine keys its programs (NOTE [What a plan-cache key covers] in zerofx/compiler/plan_cache.py) and
# marked as planned without a process group, so another solve of the same model, config and
# world (another budget, the other variable, a second run of ``zerofx plan --solve``) reads the
# samples it shares instead of capturing them again. A read program's memory timeline is the
# built one's, node for node (the plan cache's tests check its schedule report). With the
# cache off (``zerofx.compiler.plan_cache: false``, ``ZEROFX_PLAN_CACHE=off``) every sample is captured.
def sample_program(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], *, world_size: int, stage: int, config: Any,
                   rank: int = 0) -> Program:
    """``zerofx.compile(model, ...)`` with these example inputs, lowered for ``rank``, read from
    the plan cache when a solve stored it there before (NOTE [Solve samples in the plan cache])."""
    cfg = resolve(config, stage=stage, world_size=world_size)

    def build() -> Program:
        return compile(model, world_size=world_size, stage=stage, config=config, example_inputs=args, example_kwargs=kwargs)

    if cfg.plan_cache_dir is None:
        return build()
    try:  # NOTE [The recorded forward is in the key] in zerofx/compiler/plan_cache.py
        forward = plan_cache.graph_digest(StepTracer(model, args, kwargs).record())
    except CaptureError:
        return build()
    leaves, tree = pytree.tree_flatten((tuple(args), dict(kwargs)))
    signature = (repr(tree), tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("const", repr(x)) for x in leaves))
    key = plan_cache.cache_key(model=model, input_signature=signature, loss_fn=None, cfg=cfg, world_size=world_size, rank=rank,
                               backend="none", device=torch.device("cpu"), program_options={"planned by": "zerofx.compile"},
                               forward=forward)
    return plan_cache.load_or_build(cfg.plan_cache_dir, key, build, rank=rank, program_options={}, trust=cfg.plan_cache_trust,
                                    key_file=cfg.plan_cache_key_file)


def solve_memory(
    spec: ModelSpec, variable: str, *, world_size: int, stage: int, config: Any, budget_bytes: float, upper: int, rank: int = 0
) -> SolveResult:
    """The largest ``seq_len`` (at the example's batch size) or ``batch_size`` (at its sequence
    length) whose whole-step peak memory per rank fits ``budget_bytes``.

    Captures the step at four sequence lengths and two batch sizes, plus one more batch size as a
    check, fits each node's live bytes as a polynomial in B and T (``cost_models.symbolic``),
    solves against the budget, and confirms the answer by capturing at it and one past it. Where
    the partitioner saves different values at different sizes, nodes do not align across the
    samples and the step's peak is fitted instead (for ``seq_len``, first each node in T at the
    example's batch alone); the confirmation then searches from there. Under sequence
    parallelism the lengths are multiples of its size (NOTE [Solving for the context under
    sequence parallelism]).
    """
    if variable not in SOLVABLE:
        raise ZeroFXError(f"cannot solve for {variable!r}; accepted: {', '.join(SOLVABLE)}")
    example = [t for t in [*spec.args, *spec.kwargs.values()] if isinstance(t, torch.Tensor) and t.dim() >= 2]
    if not example:
        raise ZeroFXError(f"--solve {variable} needs an example input of shape (batch, seq_len, ...)")
    batch, seq = example[0].shape[0], example[0].shape[1]
    sp_size = sequence_parallel_size(config, world_size=world_size, stage=stage)
    base = -(-max(8, min(seq, 64)) // sp_size) * sp_size  # rounded up to a multiple of S
    samples = [(b, t) for b in (batch, 2 * batch) for t in (base, 2 * base, 3 * base, 4 * base)] + [(3 * batch, base)]

    def timeline(b: int, t: int) -> list[TimelinePoint]:
        args = with_batch_size(with_seq_len(spec.args, seq, t), batch, b)
        kwargs = with_batch_size(with_seq_len(dict(spec.kwargs), seq, t), batch, b)
        program = sample_program(spec.model, args, kwargs, world_size=world_size, stage=stage, config=config, rank=rank)
        return list(program.report(rank).timeline)

    timelines, names_at = {}, {}
    for b, t in samples:
        points = timeline(b, t)
        timelines[(b, t)] = [p.live_bytes for p in points]
        names_at[(b, t)] = [f"{p.graph}:{p.node}" for p in points]
    names = names_at[samples[-1]]
    exprs = None
    try:
        exprs = fit_timeline_batch_seq(timelines, rel_tol=SOLVE_REL_TOL)
    except ValueError:
        if variable == "seq_len":
            # The graphs at the example batch may differ from those at the others (at B = 1 a
            # permute can be contiguous already, so its copy is not made; Ulysses' exchange with
            # one head per rank is one): the answer needs each node in T at that batch alone.
            with contextlib.suppress(ValueError):
                exprs = fit_timeline({t: v for (b, t), v in timelines.items() if b == batch}, rel_tol=SOLVE_REL_TOL)
                names = names_at[(batch, base)]
    if exprs is None:
        # The partitioner saved different values at some sample, so nodes do not align across
        # samples: fit the step's peak itself instead (the answer is confirmed by capture below).
        peaks = {k: [max(v)] for k, v in timelines.items()}
        try:
            exprs = fit_timeline_batch_seq(peaks, rel_tol=PEAK_REL_TOL)
        except ValueError as exc:
            raise ZeroFXError(f"--solve {variable}: peak memory is not polynomial in batch and sequence length for this model ({exc})") from exc
        names = ["(the step's peak, wherever it is)"]
    unique = sorted(set(exprs), key=str)
    symbol = SOLVABLE[variable]
    fixed = {B: batch} if symbol is T else {T: seq}
    unit = sp_size if symbol is T else 1  # the answer and every capture are multiples of it
    best = longest_fitting(unique, budget_bytes, upper=upper, symbol=symbol, fixed=fixed) // unit
    top = upper // unit

    measured: dict[int, int] = {}

    def fits(x: int) -> bool:  # x in units: a sequence of x * S tokens
        b, t = (batch, x * unit) if symbol is T else (x, seq)
        measured[x] = max(p.live_bytes for p in timeline(b, t))
        return measured[x] <= budget_bytes

    # Confirm by capture (NOTE [Why a tolerance] in cost_models/symbolic.py): find lo that fits
    # and hi that does not around the estimate, galloping away from it, then bisect. When the
    # fit was right, two captures.
    lo, hi, step = best, best + 1, 1
    while lo > 0 and not fits(lo):
        hi, lo, step = lo, max(0, lo - step), step * 2
    while hi <= top and fits(hi):
        lo, hi, step = hi, min(top + 1, hi + step), step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    best = lo * unit
    at = {**fixed, symbol: max(best, 1)}
    peak_index = max(range(len(exprs)), key=lambda i: exprs[i].subs(at))
    return SolveResult(variable, best, exprs[peak_index], names[peak_index], tuple(samples), sp_size,
                       peak_at_value=measured.get(lo), peak_past_value=measured.get(hi))


def solve_seq_len(
    spec: ModelSpec, *, world_size: int, stage: int, config: Any, budget_bytes: float, max_seq_len: int, rank: int = 0
) -> SolveResult:
    """The longest sequence length that fits (``solve_memory(spec, "seq_len", ...)``)."""
    return solve_memory(spec, "seq_len", world_size=world_size, stage=stage, config=config, budget_bytes=budget_bytes,
                        upper=max_seq_len, rank=rank)


# The Gantt chart's colours: one per graph on the compute lane, one per collective kind.
_GRAPH_COLORS = {"forward": "tab:green", "backward": "tab:olive", "param_sync": "tab:cyan"}
_COMM_COLORS = {"all_gather_into_tensor": ("tab:blue", "all-gather"), "reduce_scatter_tensor": ("tab:orange", "reduce-scatter"),
                "all_reduce": ("tab:purple", "all-reduce")}


def plot_report(report: ScheduleReport, path: Path, *, title: str, budget_bytes: float | None = None) -> Any:
    """Two panels on one time axis (ms from the step's start, estimated): live memory per rank,
    with the peak marked and labelled, and a Gantt chart of compute (each graph, and the time
    compute waits on communication) and of the collectives. ``title`` heads the figure (the
    CLI's names the model, world size, stage and profile). Writes a PNG to ``path`` and returns
    the matplotlib Figure (closed: for reading, not showing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, (mem_ax, gantt_ax) = plt.subplots(2, 1, figsize=(12, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    ms = 1e3
    top = max([report.peak.live_bytes, *([budget_bytes] if budget_bytes is not None else [])])
    unit, scale = binary_unit(top)
    # Memory: the live bytes after each node, held until the next one (a step function of time).
    times = [x * ms for x in report.timeline_s] if report.timeline_s else list(range(len(report.timeline)))
    live = [p.live_bytes / scale for p in report.timeline]
    mem_ax.step(times, live, where="post", lw=1, color="tab:blue", label="live memory per rank")
    mem_ax.axhline(report.persistent_bytes / scale, color="gray", ls=":", label=f"persistent model state ({format_bytes(report.persistent_bytes)})")
    if budget_bytes is not None:
        mem_ax.axhline(budget_bytes / scale, color="red", ls="--", label=f"budget ({format_bytes(budget_bytes)})")
    at = report.timeline.index(report.peak)
    peak_x, peak_y = times[at], report.peak.live_bytes / scale
    where = f"{report.peak.graph}" + (f", {report.peak_module}" if report.peak_module else "")
    mem_ax.plot([peak_x], [peak_y], "o", color="red", ms=6, zorder=3)
    mem_ax.annotate(f"peak {format_bytes(report.peak.live_bytes)} ({where})", (peak_x, peak_y), xytext=(10, 10),
                    textcoords="offset points", va="bottom", fontsize=9, color="red",
                    bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "red", "alpha": 0.9})
    mem_ax.set_ylim(0, max(live + [top / scale]) * 1.3)
    mem_ax.set_ylabel(f"live memory per rank ({unit})")
    mem_ax.legend(loc="lower center", fontsize=8)
    mem_ax.grid(alpha=0.3)
    # Gantt: each graph's compute, the time it waits on a collective (exposed), the collectives.
    for span in report.spans:
        gantt_ax.barh("compute", (span.end_s - span.start_s) * ms, left=span.start_s * ms, color=_GRAPH_COLORS.get(span.graph, "tab:gray"),
                      edgecolor="white", height=0.6)
        gantt_ax.text((span.start_s + span.end_s) / 2 * ms, 0, span.graph, ha="center", va="center", fontsize=8)
        mem_ax.text((span.start_s + span.end_s) / 2 * ms, 0.97, span.graph, transform=mem_ax.get_xaxis_transform(), ha="center",
                    va="top", fontsize=9, color="dimgray")
        for ax in (mem_ax, gantt_ax):
            ax.axvline(span.start_s * ms, color="black", lw=0.5)
    for row in report.rows:
        if row.exposed_s > 0:
            gantt_ax.barh("compute", row.exposed_s * ms, left=(row.end_s - row.exposed_s) * ms, color="red", height=0.6)
        gantt_ax.barh("communication", (row.end_s - row.start_s) * ms, left=row.start_s * ms, color=_COMM_COLORS.get(row.op, ("gray", ""))[0],
                      linewidth=0, height=0.6)
    ops = {row.op for row in report.rows}
    handles = [Patch(color=c, label=label) for op, (c, label) in _COMM_COLORS.items() if op in ops]
    handles.append(Patch(color="red", label="compute waiting (exposed communication)"))
    gantt_ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=len(handles), fontsize=8, frameon=False)
    gantt_ax.set_xlabel("time from the step's start (ms, estimated)" if report.timeline_s else "node")
    gantt_ax.set_xlim(0, report.step_s * ms)
    gantt_ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"{title}\nstep {report.step_s * ms:.1f} ms; communication {report.comm_s * ms:.1f} ms, of which exposed "
                 f"{report.exposed_s * ms:.1f} ms; peak {format_bytes(report.peak.live_bytes)} per rank", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def report_json(program: Program, report: ScheduleReport, budget_bytes: float | None, *, device_peak_bytes: float | None = None,
                micro_batches: int = 1) -> str:
    plan = json.loads(program.plan.to_json())
    return json.dumps(
        {
            "plan": plan,
            "schedule": [r.__dict__ for r in report.rows],
            "memory": {
                "persistent_bytes": report.persistent_bytes,
                "peak_bytes": report.peak.live_bytes,
                "peak_at": f"{report.peak.graph}:{report.peak.node}",
                "peak_module": report.peak_module,
                "budget_bytes": budget_bytes,
                # With offload, the device's bytes: the peak less what host memory and NVMe hold.
                "fits": None if budget_bytes is None else (report.peak.live_bytes if device_peak_bytes is None else device_peak_bytes) <= budget_bytes,
            },
            "summary": summary_json(report, micro_batches=micro_batches),
        },
        indent=1,
        default=list,
    )
