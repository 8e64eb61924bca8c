"""Initial values of a model's parameters and buffers, one module at a time, the same at every
world size: how ``zerofx.initialize`` starts a model built on the meta device.

    with torch.device("meta"):
        model = DNADecoderLM(cfg)                 # no parameter memory
    engine = zerofx.initialize(model, config, example_inputs=(ids,), init_seed=0)

NOTE [The init scheme]
Modules are visited in ``model.named_modules()`` order. A module is initialized when it holds
directly (``recurse=False``) a parameter or buffer that no earlier module held; a tied
parameter belongs to the first module that holds it (``embed`` before ``head`` in the DNA LM).
For such a module:
1. its direct parameters and buffers are replaced, in a shallow copy of the module (the user's
   module is never modified), by fresh CPU tensors of the same shape and dtype; floating ones
   are filled with NaN;
2. the global RNG is forked (``torch.random.fork_rng``) and seeded with
   ``module_seed(seed, module_fqn)``, a hash of the seed and the module's name, so each
   module's values depend on neither the others' nor the world size;
3. one init function runs on the copy, the first that exists of: the ``init_fn=`` argument
   (called as ``init_fn(module)``), the root model's ``_init_weights(module)`` (the Hugging Face
   convention), the module's own ``reset_parameters()``;
4. a floating tensor still holding a NaN was not initialized: that raises ``ZeroFXError``
   naming it (e.g. a non-persistent buffer computed in ``__init__``, which the meta device
   loses), rather than training from garbage.

The tensors of one module are then handed out, and the caller keeps what it owns and drops
the rest: at most one module's full tensors are alive at a time beyond what the caller keeps.
Init runs on CPU, so the values do not depend on the device either.

``init_weights_(model, seed)`` applies the same scheme in place to a materialized model: a
model built normally and passed through ``init_weights_`` trains exactly as the same model
built on the meta device and started by ``zerofx.initialize(..., init_seed=seed)``.

An init function must write only the module's own direct tensors (``reset_parameters``'s
contract in ``torch.nn``, and what FSDP's ``to_empty`` + ``reset_parameters`` recipe relies on).
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from zerofx.common.errors import ZeroFXError

InitFn = Callable[[nn.Module], None]


@dataclass(frozen=True)
class InitialTensor:
    """One parameter's or buffer's initial value, under its canonical name."""

    fqn: str
    value: torch.Tensor  # on CPU, detached
    is_param: bool


def module_seed(seed: int, module_fqn: str) -> int:
    """The RNG seed of one module: a 63-bit hash of the run's seed and the module's name."""
    digest = hashlib.sha256(f"{seed}:{module_fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def check_all_meta_or_none(model: nn.Module) -> bool:
    """True when every parameter and buffer is on the meta device, False when none is; a mix
    raises, naming a tensor of each kind."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    meta = [n for n, t in tensors if t.is_meta]
    real = [n for n, t in tensors if not t.is_meta]
    if meta and real:
        raise ZeroFXError(
            f"the model mixes meta and materialized tensors (e.g. {meta[0]!r} is on the meta device, {real[0]!r} is not); "
            "build it whole on the meta device, or materialize it whole"
        )
    return bool(meta)


def _init_function(model: nn.Module, module: nn.Module, init_fn: InitFn | None) -> InitFn | None:
    if init_fn is not None:
        return init_fn
    own = getattr(type(model), "_init_weights", None)
    if callable(own):
        return lambda m: own(model, m)
    reset = getattr(type(module), "reset_parameters", None)
    if callable(reset):
        return lambda m: reset(m)
    return None


def _stand_in(module: nn.Module, params: dict[str, nn.Parameter], buffers: dict[str, torch.Tensor]) -> nn.Module:
    """A shallow copy of ``module`` whose direct parameters and buffers are fresh CPU tensors
    (NaN where floating); its children are the original's."""
    clone = copy.copy(module)
    # A parameter or buffer slot set to None (Linear(bias=False)'s bias) stays, as None: init
    # functions test it (Hugging Face's ``if module.bias is not None``).
    fresh: dict[str, nn.Parameter | None] = {n: None for n, p in module._parameters.items() if p is None}
    for name, p in params.items():
        t = torch.empty(p.shape, dtype=p.dtype, device="cpu")
        if t.is_floating_point():
            t.fill_(float("nan"))
        fresh[name] = nn.Parameter(t, requires_grad=p.requires_grad)
    clone.__dict__["_parameters"] = fresh
    new_buffers: dict[str, torch.Tensor | None] = {n: None for n, b in module._buffers.items() if b is None}
    for name, b in buffers.items():
        t = torch.empty(b.shape, dtype=b.dtype, device="cpu")
        if t.is_floating_point():
            t.fill_(float("nan"))
        new_buffers[name] = t
    clone.__dict__["_buffers"] = new_buffers
    return clone


def iter_initial_state(model: nn.Module, *, seed: int = 0, init_fn: InitFn | None = None) -> Iterator[InitialTensor]:
    """Every parameter and buffer of ``model`` (canonical names: ``named_parameters()`` and
    ``named_buffers()``), initialized per NOTE [The init scheme], one module at a time.

    ``model`` itself is not modified and may be on the meta device."""
    param_names = {id(p): n for n, p in model.named_parameters()}
    buffer_names = {id(b): n for n, b in model.named_buffers()}
    done: set[int] = set()
    for module_fqn, module in model.named_modules():
        params = {n: p for n, p in module._parameters.items() if p is not None}
        buffers = {n: b for n, b in module._buffers.items() if b is not None}
        new = [t for t in (*params.values(), *buffers.values()) if id(t) not in done]
        if not new:
            continue
        fn = _init_function(model, module, init_fn)
        where = module_fqn or "the root module"
        if fn is None:
            raise ZeroFXError(
                f"cannot initialize {where} ({type(module).__name__}) from the meta device: it has no reset_parameters(), "
                f"the model has no _init_weights(module), and no init_fn= was given; pass init_fn=, a function that "
                f"initializes one module's own parameters and buffers in place"
            )
        stand_in = _stand_in(module, params, buffers)
        with torch.random.fork_rng(devices=[]), torch.no_grad(), torch.device("cpu"):
            torch.manual_seed(module_seed(seed, module_fqn))
            fn(stand_in)
        for kind, originals, names in (("parameter", params, param_names), ("buffer", buffers, buffer_names)):
            values = stand_in._parameters if kind == "parameter" else stand_in._buffers
            for local, original in originals.items():
                if id(original) in done:
                    continue
                done.add(id(original))
                value = values.get(local)
                fqn = names[id(original)]
                if value is None or tuple(value.shape) != tuple(original.shape) or value.dtype != original.dtype:
                    raise ZeroFXError(
                        f"the init of {where} replaced {kind} {fqn!r} with something of another shape or dtype; "
                        f"an init function must write the module's tensors in place"
                    )
                if value.is_floating_point() and torch.isnan(value).any():
                    raise ZeroFXError(
                        f"{kind} {fqn!r} of {where} ({type(module).__name__}) is not (fully) set by its init function; "
                        "give the module a reset_parameters() that sets it (non-persistent buffers computed in __init__ "
                        "are lost on the meta device), or pass init_fn="
                    )
                yield InitialTensor(fqn, value.detach(), kind == "parameter")
        del stand_in


def init_weights_(model: nn.Module, *, seed: int = 0, init_fn: InitFn | None = None) -> nn.Module:
    """Set a materialized model's parameters and buffers in place per NOTE [The init scheme]:
    the values ``zerofx.initialize(..., init_seed=seed)`` starts a meta-built model from."""
    if check_all_meta_or_none(model):
        raise ZeroFXError("init_weights_ needs a materialized model; a meta-device model is initialized by zerofx.initialize")
    targets = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    with torch.no_grad():
        for item in iter_initial_state(model, seed=seed, init_fn=init_fn):
            targets[item.fqn].copy_(item.value)
    return model
