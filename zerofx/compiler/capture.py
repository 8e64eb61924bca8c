"""The mechanics of capture: one training step of a model traced on fake tensors, before autograd
(``StepTracer.record``) and as a joint forward+backward ATen FX graph (``StepTracer.differentiate``).
The order of the stages, and the rewrites between them, are the compile spine's
(``zerofx.compiler.pipeline``, NOTE [The compile spine]).

NOTE [How capture works]
The model is called through ``torch.func.functional_call`` inside a function whose flat
inputs are (parameters, buffers, tensor leaves of the user's inputs) and whose one output is
the scalar loss. AOTAutograd (``functorch.compile.aot_function``, the machinery a
``torch.compile`` backend built with ``aot_autograd`` runs) traces it on fake tensors and hands
its partition function the joint graph: placeholders ``primals_*`` in that flat order plus one
``tangents_1``, outputs ``[loss, grad(primal_1), ...]``. We keep that joint graph and stop;
nothing is executed and no parameter memory is allocated, so a model built on the meta device
captures the same way as a real one.

Tracing runs the model's Python (make_fx, like non-strict ``torch.export``), so code that
``torch.fx.symbolic_trace`` rejects (data classes as outputs, keyword arguments, Hugging Face
models) captures. Python control flow that depends on tensor *values* cannot be captured: that
raises ``CaptureError`` naming the reason. There is no fallback to eager.
"""

from __future__ import annotations

import contextlib
import copy
import os
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.func import functional_call

from zerofx.common.errors import CaptureError, InputMismatchError, MissingLossError
from zerofx.models.hf_experts import experts_traceable
from zerofx.models.hf_mamba import scan_adapted
from zerofx.passes import _compat, meta
from zerofx.passes._compat import pytree
from zerofx.passes.plan.tiling import TilingPlan
from zerofx.passes.plan.sequence import SequenceParallelPlan

LossFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class TensorInfo:
    """Name, shape and dtype of one captured input (parameter, buffer or user input)."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class CapturedStep:
    """A captured training step: the joint graph and what each of its placeholders is.

    ``joint`` placeholders, in order: ``params``, ``buffers``, then the tensor leaves of the
    user's inputs (``inputs``), then one tangent. Outputs: ``[loss, *grads]`` with one grad
    (or None) per primal.
    """

    joint: fx.GraphModule
    params: tuple[TensorInfo, ...]
    buffers: tuple[TensorInfo, ...]
    inputs: tuple[TensorInfo, ...]
    input_spec: pytree.TreeSpec
    input_constants: tuple[Any, ...]  # the non-tensor leaves, None where a tensor goes
    tied: Mapping[str, str]  # alias FQN -> the FQN it shares storage with
    model_class: str
    tiling: TilingPlan | None = None  # what tile_forward_pass did to the forward before autograd
    sequence_parallel: SequenceParallelPlan | None = None  # what sequence_parallel_pass did to it

class _CaptureDone(Exception):
    """Raised from the partition hook to stop AOTAutograd once the joint graph is in hand."""

    def __init__(self, joint: fx.GraphModule, num_fwd_outputs: int) -> None:
        super().__init__("capture done")
        self.joint = joint
        self.num_fwd_outputs = num_fwd_outputs


def cast_info(info: TensorInfo, dtype: torch.dtype) -> TensorInfo:
    """``info`` in ``dtype`` if it is floating point, else unchanged."""
    return TensorInfo(info.fqn, info.shape, dtype, info.requires_grad) if info.dtype.is_floating_point else info


def traced_param_infos(model: nn.Module, param_infos: Sequence[TensorInfo] | None = None,
                       compute_dtype: torch.dtype | None = None) -> list[TensorInfo]:
    """The parameters as capture traces them: ``param_infos``, else the model's (a tied one once,
    under its first name), floating ones in ``compute_dtype`` when given (mixed precision).
    Raises ``CaptureError`` when none is trainable."""
    if param_infos is None:
        param_infos = [TensorInfo(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()]
    infos = [cast_info(i, compute_dtype) for i in param_infos] if compute_dtype is not None else list(param_infos)
    if not any(i.requires_grad for i in infos):
        raise CaptureError(f"{type(model).__name__} has no trainable parameters (requires_grad=True); nothing to train")
    return infos


def extract_loss(output: Any, loss_fn: LossFn | None, loss_kwargs: Mapping[str, Any]) -> torch.Tensor:
    """The step's loss: ``loss_fn(output, **loss_kwargs)`` if given, else the output itself if it
    is a scalar tensor, else its ``.loss`` attribute or ``"loss"`` key (Hugging Face style)."""
    if loss_fn is not None:
        return loss_fn(output, **loss_kwargs)
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    has_logits = isinstance(getattr(output, "logits", None), torch.Tensor) or (
        isinstance(output, Mapping) and isinstance(output.get("logits"), torch.Tensor))
    hint = (" The output has logits but no loss: a Hugging Face model computes its loss only when called with "
            "labels, so pass labels (for example example_kwargs={'labels': input_ids}).") if has_logits else ""
    # A tensor is named by its shape: under tracing its type is one of torch's internal wrappers.
    what = f"a tensor of shape {tuple(output.shape)}" if isinstance(output, torch.Tensor) else f"a {type(output).__name__}"
    raise MissingLossError(
        f"cannot find the loss in the model's output ({what}): accepted are a scalar "
        "tensor, an object with a tensor .loss attribute, a mapping with a 'loss' key, or pass loss_fn=." + hint
    )


def split_loss_kwargs(model: nn.Module, kwargs: Mapping[str, Any], loss_fn: LossFn | None) -> tuple[dict, dict]:
    """Split call kwargs into (model kwargs, loss_fn kwargs): with a ``loss_fn``, keyword
    arguments that ``model.forward`` does not accept go to the loss function."""
    if loss_fn is None:
        return dict(kwargs), {}
    sig = inspect.signature(model.forward)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return dict(kwargs), {}
    model_kw = {k: v for k, v in kwargs.items() if k in sig.parameters}
    return model_kw, {k: v for k, v in kwargs.items() if k not in sig.parameters}


def _tied_aliases(model: nn.Module) -> dict[str, str]:
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _explain(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    lower = text.lower()
    if "data-dependent" in lower or "datadependent" in lower or "guardondatadependent" in lower:
        reason = "Python control flow or a shape depends on a tensor's values (a graph break under torch.compile)"
    elif "unsupported" in lower or "dynamicoutputshape" in lower or "no fake" in lower:
        reason = "an operator has no shape rule (an unsupported op)"
    else:
        reason = "tracing failed"
    first_lines = "\n".join(text.splitlines()[:6])
    return f"{reason}.\n  {first_lines}"


@contextlib.contextmanager
def module_state_kept(model: nn.Module) -> Iterator[None]:
    """NOTE [Module state across a trace]
    A model may keep state on its modules during ``forward``: a rotary table or a time vector
    built on the first call and cached as a plain attribute, not a buffer (``self.cos_cached =
    freqs.cos()``), or appended to a list it holds. Recorded on fake tensors, such a cache would
    keep a tensor of the trace: the next trace of the same model (AOTAutograd's after the
    record, a capture with other tiling options, another rank's) would read it as a constant of
    another trace and fail, and so would the user's own eager call afterwards. So every trace of
    the step starts from the modules as the user left them and gives them back so: each module's
    attributes are put back after the call, an attribute the call added is removed, and a list,
    dict or set attribute the call changed in place gets its items back (the same object, so
    what else holds it sees them too). The cache is built again inside every trace, as the
    model's first call builds it, and the graph computes it from its sources (``arange``, a
    plain tensor attribute as a constant). What the user cached before the capture (an eager
    call's table) is used as it is, a constant of the graph."""
    saved = []
    for module in model.modules():
        attrs = dict(module.__dict__)
        items = {key: copy.copy(v) for key, v in attrs.items() if isinstance(v, (list, dict, set)) and key not in _MODULE_INTERNALS}
        saved.append((module, attrs, items))
    try:
        yield
    finally:
        for module, attrs, items in saved:
            for key in [k for k in module.__dict__ if k not in attrs]:
                del module.__dict__[key]
            module.__dict__.update(attrs)
            for key, was in items.items():
                held = attrs[key]
                held.clear()
                if isinstance(held, list):
                    held.extend(was)
                else:
                    held.update(was)


_MODULE_INTERNALS = frozenset(nn.Module().__dict__)  # parameters, buffers, submodules, hooks: torch.func restores them itself


class StepTracer:
    """One model call, traced: the fake inputs built once, the step recorded before autograd
    (``record``) and differentiated into the joint graph (``differentiate``)."""

    def __init__(
        self,
        model: nn.Module,
        example_args: Sequence[Any],
        example_kwargs: Mapping[str, Any] | None = None,
        *,
        loss_fn: LossFn | None = None,
        param_infos: Sequence[TensorInfo] | None = None,
        device: torch.device | str | None = None,
        compute_dtype: torch.dtype | None = None,
        adapt_scans: bool = False,
    ) -> None:
        example_kwargs = dict(example_kwargs or {})
        self.model, self.loss_fn = model, loss_fn
        self.adapt_scans = adapt_scans  # Hugging Face's Mamba mixers recorded through the scan op (sequence parallelism)
        self.param_infos = traced_param_infos(model, param_infos, compute_dtype)
        self.buffer_infos = [TensorInfo(n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()]
        if compute_dtype is not None:  # mixed precision: floating buffers compute in it
            self.buffer_infos = [cast_info(i, compute_dtype) for i in self.buffer_infos]
        if device is None:
            first = next(model.parameters(), None)
            device = "cpu" if first is None or first.device.type == "meta" else first.device

        model_kwargs, loss_kwargs = split_loss_kwargs(model, example_kwargs, loss_fn)
        self.leaves, self.spec = pytree.tree_flatten((tuple(example_args), model_kwargs, loss_kwargs))
        self.tensor_positions = [i for i, leaf in enumerate(self.leaves) if isinstance(leaf, torch.Tensor)]
        self.constants = tuple(None if isinstance(leaf, torch.Tensor) else leaf for leaf in self.leaves)

        fake_mode = _compat.FakeTensorMode(allow_non_fake_inputs=True)

        def fake_like(shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool, on: torch.device | str) -> torch.Tensor:
            with fake_mode:
                out = torch.empty(shape, dtype=dtype, device=on)
            return out.requires_grad_(requires_grad)

        leaves = self.leaves
        self.flat_fakes = [
            *(fake_like(p.shape, p.dtype, p.requires_grad, device) for p in self.param_infos),
            *(fake_like(b.shape, b.dtype, False, device) for b in self.buffer_infos),
            *(fake_like(tuple(leaves[i].shape), leaves[i].dtype, False, device if leaves[i].is_meta else leaves[i].device)
              for i in self.tensor_positions),
        ]
        self.param_names, self.buffer_names = [p.fqn for p in self.param_infos], [b.fqn for b in self.buffer_infos]

    @property
    def model_name(self) -> str:
        return type(self.model).__name__

    def step_fn(self, *flat: torch.Tensor) -> torch.Tensor:
        """The step as one function of the flat inputs (parameters, buffers, tensor leaves): the
        model's call and its loss."""
        num_p, num_b = len(self.param_names), len(self.buffer_names)
        state = dict(zip(self.param_names, flat[:num_p]))
        state.update(zip(self.buffer_names, flat[num_p : num_p + num_b]))
        call_leaves = list(self.constants)
        for pos, t in zip(self.tensor_positions, flat[num_p + num_b :]):
            call_leaves[pos] = t
        args, kwargs, loss_kw = pytree.tree_unflatten(call_leaves, self.spec)
        with contextlib.ExitStack() as adapted:  # NOTE [Hugging Face experts under fake tensors], NOTE [The scan adapter while capturing]
            adapted.enter_context(module_state_kept(self.model))
            adapted.enter_context(experts_traceable(self.model))
            if self.adapt_scans:
                adapted.enter_context(scan_adapted(self.model))
            output = functional_call(self.model, state, args, kwargs, tie_weights=True, strict=False)
        loss = extract_loss(output, self.loss_fn, loss_kw)
        # The backward seed (the fp16 loss scale, up to 2**32) must not overflow: seed it in fp32.
        return loss.float() if isinstance(loss, torch.Tensor) and loss.is_floating_point() else loss

    def record(self) -> fx.GraphModule:
        """The step recorded before autograd (``make_fx(pre_dispatch=True)``, where
        ``aten.linear``, SDPA and ``cross_entropy_loss`` are still whole), its placeholders tagged."""
        try:
            forward = _compat.make_fx(self.step_fn, pre_dispatch=True)(*self.flat_fakes)
        except Exception as exc:
            raise CaptureError(f"cannot capture {self.model_name} whole: {_explain(exc)}") from exc
        _tag_placeholders(forward, self.param_names, self.buffer_names, len(self.tensor_positions), tangent=False)
        return forward

    def differentiate(self, forward: fx.GraphModule | None = None) -> CapturedStep:
        """The joint graph AOTAutograd derives from ``forward`` (a recorded, possibly rewritten
        step, run node by node so that the node metadata the rewrites set reaches the joint
        graph), or from the model's call itself when ``forward`` is None. The step's tiling and
        sequence-parallel plans are the spine's to fill in."""
        model_name = self.model_name
        step_fn = self.step_fn if forward is None else _interpreted(forward)

        def partition_hook(joint: fx.GraphModule, _joint_inputs: Any, *, num_fwd_outputs: int, **_: Any) -> Any:
            raise _CaptureDone(joint, num_fwd_outputs)

        traced = _compat.aot_function(
            step_fn,
            fw_compiler=lambda gm, _: _compat.make_boxed_func(gm.forward),
            bw_compiler=lambda gm, _: _compat.make_boxed_func(gm.forward),
            partition_fn=partition_hook,
            # AOTAutograd prints the joint graph into its log (about 5% of a capture) even when no
            # one reads it: only when torch's logs are asked for (TORCH_LOGS, TORCH_TRACE).
            enable_log=bool(os.environ.get("TORCH_LOGS") or os.environ.get("TORCH_TRACE")),
        )
        try:
            with _compat.lazy_graph_modules():  # NOTE [Code written on first use] in passes/_compat.py
                out = traced(*self.flat_fakes)
        except _CaptureDone as done:
            joint, num_fwd_outputs = done.joint, done.num_fwd_outputs
        except CaptureError:
            raise
        except Exception as exc:  # any tracing failure becomes one clear error; no eager fallback
            raise CaptureError(f"cannot capture {model_name} whole: {_explain(exc)}") from exc
        else:
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise CaptureError(f"the loss of {model_name} does not depend on any trainable parameter (loss: {shape})")

        if num_fwd_outputs != 1:
            raise CaptureError(
                f"{model_name}'s forward mutates its inputs or buffers in place (e.g. BatchNorm running "
                "statistics); zerofx captures functional forwards only"
            )
        loss_val = next(iter(joint.graph.find_nodes(op="output"))).args[0][0].meta["val"]
        if loss_val.dim() != 0:
            raise CaptureError(f"the loss must be a scalar tensor, got shape {tuple(loss_val.shape)}; reduce it or pass loss_fn=")

        _tag_placeholders(joint, self.param_names, self.buffer_names, len(self.tensor_positions))
        leaves = self.leaves
        return CapturedStep(
            joint=joint,
            params=tuple(self.param_infos),
            buffers=tuple(self.buffer_infos),
            inputs=tuple(TensorInfo(f"input[{i}]", tuple(leaves[i].shape), leaves[i].dtype) for i in self.tensor_positions),
            input_spec=self.spec,
            input_constants=self.constants,
            tied=_tied_aliases(self.model),
            model_class=type(self.model).__qualname__,
        )


def _interpreted(forward: fx.GraphModule) -> Callable[..., torch.Tensor]:
    """A step that runs ``forward`` node by node, for AOTAutograd to trace and differentiate."""
    def step_fn(*flat: torch.Tensor) -> torch.Tensor:
        with _compat.preserve_node_meta():
            return fx.Interpreter(forward).run(*flat)

    return step_fn


def _tag_placeholders(joint: fx.GraphModule, param_names: list[str], buffer_names: list[str], num_inputs: int, *, tangent: bool = True) -> None:
    roles = [(meta.Role.PARAM, n) for n in param_names] + [(meta.Role.BUFFER, n) for n in buffer_names]
    roles += [(meta.Role.INPUT, f"input[{i}]") for i in range(num_inputs)]
    nodes = meta.placeholders(joint.graph)
    assert len(nodes) == len(roles) + tangent, "the graph should have one placeholder per primal (plus one tangent in a joint graph)"
    for node, (role, name) in zip(nodes, roles + [(meta.Role.TANGENT, "loss")] * tangent):
        node.meta[meta.ROLE] = role
        node.meta[meta.FQN] = name


def flatten_call(captured: CapturedStep, model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any], loss_fn: LossFn | None) -> list[torch.Tensor]:
    """The tensor leaves of a call, checked against what was captured (shapes, dtypes, constants)."""
    model_kwargs, loss_kwargs = split_loss_kwargs(model, kwargs, loss_fn)
    leaves, spec = pytree.tree_flatten((tuple(args), model_kwargs, loss_kwargs))
    if spec != captured.input_spec:
        raise InputMismatchError(f"the call's arguments have structure {spec}, but the program was compiled for {captured.input_spec}")
    tensors = []
    for leaf, const in zip(leaves, captured.input_constants):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
        elif leaf != const:
            raise InputMismatchError(f"non-tensor argument {leaf!r} differs from the compiled example's {const!r}; compile again for it")
    for t, info in zip(tensors, captured.inputs):
        if tuple(t.shape) != info.shape or t.dtype != info.dtype:
            raise InputMismatchError(
                f"{info.fqn} has shape {tuple(t.shape)} and dtype {t.dtype}, but the program was compiled for "
                f"shape {info.shape} and dtype {info.dtype}; compile again with example_inputs of this shape"
            )
    return tensors
