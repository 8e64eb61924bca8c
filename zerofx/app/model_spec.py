"""The model a ``MODEL_SPEC`` argument names: a bundled size, built on the meta device with an
example batch, or the user's ``FILE.py:CALLABLE`` / ``MODULE:CALLABLE`` returning ``(model,
example_inputs)``. Every failure of the user's code is a one-line ``ZeroFXError`` naming the spec.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import site
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from zerofx import cost_models, passes
from zerofx.common.errors import UsageError, ZeroFXError
from zerofx.common.limits import check_positive
from zerofx.config import ZeroConfig
from zerofx.models.registry import build_model
from zerofx.models.sizes import model_config
from zerofx.planner.solve import ModelSpec


def load_model(model: str, *, batch_size: int | None, seq_len: int | None, config: ZeroConfig | None) -> ModelSpec:
    """A bundled model size (built on the meta device) or a FILE.py:CALLABLE / MODULE:CALLABLE spec.
    A bundled model's example batch has ``batch_size`` sequences, else the config's micro-batch
    (so that a config ``zerofx plan --auto`` printed plans as it was chosen), else 1."""
    if ":" in model:
        return load_model_spec(model)
    if batch_size is None:
        batch_size = (config.train_micro_batch_size_per_gpu if config is not None else None) or 1
    built, ids = _meta_example(model, batch_size, seq_len)
    return ModelSpec(built, (ids,), {"labels": ids}, model)


def _meta_example(name: str, batch_size: int, seq_len: int | None) -> tuple[nn.Module, torch.Tensor]:
    """The bundled model of size ``name`` and a (B, T) batch of input ids on the meta device:
    shapes only, no memory."""
    cfg = model_config(name)
    t = min(512, cfg.max_seq_len) if seq_len is None else seq_len
    check_positive("--batch-size", batch_size)
    if not 2 <= t <= cfg.max_seq_len:
        raise UsageError(f"--seq-len {t} is invalid for this model; accepted: 2..{cfg.max_seq_len}")
    built = build_model(name, device="meta")
    ids = torch.zeros(batch_size, t, dtype=torch.long, device="meta")  # (B, T)
    return built, ids


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
