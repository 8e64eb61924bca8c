"""The plan cache: one rank's captured, planned and lowered program, stored on disk and loaded
again by the next launch with the same model, inputs, config and world layout.

Capture, planning and lowering take seconds per rank (about 8 s for the 25m DNA LM on one CPU
core) and give the same graphs every time for the same inputs, so a second launch, or an elastic
restart, loads them instead (NOTE [What a plan-cache key covers]). Directory: ``zerofx.compiler.plan_cache``
in the config, else the environment variable ``ZEROFX_PLAN_CACHE``, else
``$XDG_CACHE_HOME/zerofx/plans`` (``~/.cache/zerofx/plans``); ``false`` or ``off`` turns it off
(``ZeroConfig.plan_cache_dir``).

An entry is one file, ``<key hash>.zfxplan``: a signature line (an HMAC-SHA256 with this user's
secret), a header line (format, torch and zerofx versions, the key, the payload's length and
SHA-256) and the payload, written to a temporary file in the same directory and renamed over
the entry, so a reader sees a whole entry or none, and ranks or jobs writing the same entry at
once each rename a complete file. An entry whose signature, header, hash, length, key or
versions do not match, or that fails to load, is rebuilt with a ``PlanCacheWarning`` and never
used (NOTE [Stale entries are rebuilt, never used]). Payloads are pickles, so an entry is
unpickled only when this user wrote it (NOTE [Who the plan cache trusts] in
zerofx/compiler/cache_trust.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import inspect
import io
import json
import os
import pickle
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Mapping
from enum import Enum
from functools import lru_cache, reduce
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from zerofx import _version
from zerofx.common.errors import ZeroFXError
from zerofx.compiler.capture import CapturedStep
from zerofx.compiler import cache_trust
from zerofx.config import ZeroConfig
from zerofx.config.options import CacheTrust
from zerofx.passes import _compat
from zerofx.passes.sequence.mixer_custom import declared_cache_keys
from zerofx.compiler.program import Program

FORMAT = "zerofx-plan-cache/2"
SUFFIX = ".zfxplan"


class PlanCacheWarning(UserWarning):
    """A plan-cache entry could not be used (corrupt, truncated, stale) or written; the program
    is built from the model instead."""


# NOTE [What a plan-cache key covers]
# The graphs one rank runs are a function of: the model's code and structure (each module's
# class and the file that defines it, each module's plain attributes such as a config data
# class or a head count, and every parameter's and buffer's name, shape, dtype and
# requires_grad, ties included), the call's input structure, shapes, dtypes and constants, the
# loss function (by name and source file), the settings that change collectives or numerics
# (``ZeroConfig.fingerprint_fields``, plus the whole ``zerofx`` section), the parameter-offload
# placement, the world size, the rank, the process group's name and backend, the device, and
# the code that captures and lowers: torch's version, Python's, and a hash of every source file
# of zerofx (``zerofx``, ``zerofx.passes``, ``zerofx.cost_models``), so an edited pass misses in
# a development checkout as a new release would. A loss closure's captured values and defaults
# count when they are plain data. Above all, the key holds a digest of the step as recorded
# before autograd (NOTE [The recorded forward is in the key]), so what the description of the
# model cannot see (a helper in another file, a global read in ``forward``, a class made at run
# time) still misses when it changes what runs.

_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, Enum)
_MODULE_INTERNALS = frozenset({"training", "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"})


def _plain(value: Any) -> str | None:
    """A stable text for a plain attribute value (numbers, strings, dtypes, enums, data classes,
    tuples and lists and dicts of them); None for anything else, which the key leaves out."""
    if isinstance(value, _PLAIN):
        return repr(value)
    if isinstance(value, (tuple, list)):
        items = [_plain(v) for v in value]
        return None if any(i is None for i in items) else f"{type(value).__name__}({', '.join(items)})"  # type: ignore[arg-type]
    if isinstance(value, Mapping):
        items = [(_plain(k), _plain(v)) for k, v in value.items()]
        return None if any(k is None or v is None for k, v in items) else "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if hasattr(type(value), "__dataclass_fields__") and not isinstance(value, type):
        return repr(value)
    return None


@lru_cache(maxsize=1024)
def _digest_of(path: str, mtime_ns: int, size: int) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError:
        return "unreadable"


def _file_digest(path: str) -> str:
    """The file's SHA-256, read again whenever its modification time or size changes (a model
    file edited in a running notebook)."""
    try:
        stat = os.stat(path)
    except OSError:
        return "unreadable"
    return _digest_of(path, stat.st_mtime_ns, stat.st_size)


def _code_files(obj: Any) -> list[str]:
    """The files the code of ``obj`` (a function, or a class's own methods) was compiled from:
    what ``inspect`` cannot name for a class whose module is not in ``sys.modules`` (a model
    file loaded by path)."""
    functions = [obj] if not isinstance(obj, type) else [v for v in vars(obj).values() if callable(v)]
    files = {getattr(getattr(inspect.unwrap(f), "__code__", None), "co_filename", None) for f in functions}
    return sorted(f for f in files if f and not f.startswith("<"))


def _source_digest(obj: Any) -> str:
    """The SHA-256 of the file that defines ``obj`` (a class or function), or of the files its
    methods' code comes from; "no source file" when there is none (defined in an interactive
    session)."""
    try:
        path = inspect.getsourcefile(obj)
    except TypeError:
        path = None
    files = [path] if path else _code_files(obj)
    return " ".join(_file_digest(f) for f in files) if files else "no source file"


def _class_attributes(cls: type) -> str:
    """The plain class attributes of ``cls`` and its bases up to ``nn.Module`` (a class made
    at run time with a value baked in, as ``use_zerofx_scan``'s chunk length is)."""
    shown = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("torch.") or klass is object:
            continue
        for name, value in vars(klass).items():
            text = None if name.startswith("__") else _plain(value)
            if text is not None:
                shown[name] = text
    return ", ".join(f"{k}={v}" for k, v in sorted(shown.items()))


UNKEYED = "<not plain data>"


def captured_values(fn: Callable[..., Any]) -> str:
    """What ``fn`` carries besides its code: the values its closure captured and its default
    arguments, as plain-data text (``UNKEYED`` for a value that is not plain data), so a loss
    closing over another scale is another key."""
    cells = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # a cell not bound yet
            continue
        if value is not fn:
            cells.append(value)
    defaults = list(getattr(fn, "__defaults__", None) or ()) + list((getattr(fn, "__kwdefaults__", None) or {}).values())
    texts = [_plain(v) for v in cells + defaults]
    return "(" + ", ".join(UNKEYED if t is None else t for t in texts) + ")"


def describe_model(model: nn.Module) -> list[str]:
    """Each module's class, source file hash and plain attributes, then every parameter and
    buffer (ties included): what the key knows of the model."""
    lines = []
    for name, module in model.named_modules(remove_duplicate=False):
        cls = type(module)
        attrs = {k: _plain(v) for k, v in sorted(vars(module).items()) if k not in _MODULE_INTERNALS and not k.startswith("_")}
        shown = ", ".join(f"{k}={v}" for k, v in attrs.items() if v is not None)
        lines.append(f"module {name or '.'} {cls.__module__}.{cls.__qualname__} [{_source_digest(cls)}] ({_class_attributes(cls)}) "
                     f"training={module.training} {shown}")
    lines += [f"parameter {n} {list(p.shape)} {p.dtype} requires_grad={p.requires_grad} id={id(p)}"
              for n, p in model.named_parameters(remove_duplicate=False)]
    # ids only say which names share a tensor; replace them by the first name that has it
    first: dict[str, str] = {}
    out = []
    for line in lines:
        if " id=" in line:
            head, ident = line.rsplit(" id=", 1)
            line = f"{head} same_as={first.setdefault(ident, head.split()[1])}"
        out.append(line)
    out += [f"buffer {n} {list(b.shape)} {b.dtype}" for n, b in model.named_buffers(remove_duplicate=False)]
    return out


@lru_cache(maxsize=1)
def code_digest() -> str:
    """A hash of every Python source file of zerofx, its passes and its cost models."""
    # Found by spec, not imported: zerofx.passes and zerofx.cost_models lie beside zerofx/ in a
    # checkout (an editable install) and inside it when installed.
    digest = hashlib.sha256()
    roots = {Path(importlib.util.find_spec(name).origin).resolve().parent for name in ("zerofx", "zerofx.passes", "zerofx.cost_models")}
    for root in sorted(roots):
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def versions() -> dict[str, str]:
    """The versions an entry is valid for: a mismatch misses."""
    return {"format": FORMAT, "torch": torch.__version__, "zerofx": _version.__version__, "zerofx_code": code_digest(),
            "python": sys.version.split()[0]}


def cache_key(*, model: nn.Module, input_signature: Any, loss_fn: Callable[..., Any] | None, cfg: ZeroConfig, world_size: int,
              rank: int, backend: str, device: torch.device, program_options: Mapping[str, Any],
              forward: str | None = None) -> dict[str, Any]:
    """Everything one rank's program depends on (NOTE [What a plan-cache key covers]), as a
    JSON-ready dict. ``program_options`` are the keyword arguments the engine builds its
    programs with (process group names, the parameter-offload placement); ``forward`` is the
    ``graph_digest`` of the step recorded before autograd (NOTE [The recorded forward is in the
    key]), which every key an entry is read or written under has; None only for keys that are
    compared, never stored (the ranks' agreement on one build)."""
    loss = None if loss_fn is None else f"{getattr(loss_fn, '__module__', '?')}.{getattr(loss_fn, '__qualname__', repr(type(loss_fn)))} " \
                                        f"[{_source_digest(loss_fn)}] {captured_values(loss_fn)}"
    return {
        "versions": versions(),
        "model": hashlib.sha256("\n".join(describe_model(model)).encode()).hexdigest(),
        "inputs": repr(input_signature),
        "loss_fn": loss,
        "config": cfg.fingerprint_fields(),
        "zerofx_section": json.loads(json.dumps(cfg.zerofx_section, sort_keys=True, default=repr)),
        "program_options": {k: repr(v) for k, v in sorted(program_options.items())},
        "world": {"world_size": world_size, "rank": rank, "backend": backend, "device": str(device)},
        "forward": forward,
        "sequence_mixers": declared_cache_keys(),  # NOTE [Declared sequence mixers] in passes/sequence/mixer_custom.py
    }


# NOTE [The recorded forward is in the key]
# The key's description of the model (its classes, their files, their plain attributes) cannot
# see everything that changes what runs: a helper function in another file called from
# ``forward``, a class made at run time with a value baked in (``use_zerofx_scan``'s chunk
# length), a global read in ``forward``, a model file loaded by path that ``inspect`` cannot
# find. What runs is the step recorded before autograd (``StepTracer.record``, a fraction of a
# build: about 0.3 s of the 25m DNA LM's 4 s), so the key also holds a digest of that graph: each
# node's op, target, arguments and the constants it reads. Whatever changes the recorded step
# misses; what leaves it equal builds the same backward and the same lowered graphs, since those
# are functions of the recorded step, the config and the world, all in the key. A step that
# cannot be recorded this way is built without the cache.


def _target_text(target: Any) -> str:
    address = _compat.op_address(target)
    if address is not None:
        return "::".join(str(a) for a in address)
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


def _arg_text(value: Any, index: Mapping[fx.Node, int]) -> str:
    if isinstance(value, fx.Node):
        return f"%{index[value]}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(_arg_text(v, index) for v in value)})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_arg_text(v, index)}" for k, v in value.items()) + "}"
    if isinstance(value, slice):
        return f"slice({_arg_text(value.start, index)}, {_arg_text(value.stop, index)}, {_arg_text(value.step, index)})"
    if callable(value) and not isinstance(value, (torch.dtype, torch.device)):
        return _target_text(value)
    return repr(value)


def graph_digest(gm: fx.GraphModule) -> str:
    """A SHA-256 of what ``gm`` computes: every node's op, target and arguments in order, and the
    attributes it reads (tensors by dtype, shape and bytes; subgraphs by their own digest)
    (NOTE [The recorded forward is in the key])."""
    digest = hashlib.sha256()
    index: dict[fx.Node, int] = {}
    for i, node in enumerate(gm.graph.nodes):
        index[node] = i
        digest.update(f"{node.op} {_target_text(node.target)} {_arg_text(node.args, index)} {_arg_text(node.kwargs, index)}\n".encode())
        if node.op == "get_attr":
            value = reduce(getattr, node.target.split("."), gm)
            if isinstance(value, fx.GraphModule):
                digest.update(graph_digest(value).encode())
            elif isinstance(value, _compat.FakeTensor):
                digest.update(f"fake {value.dtype} {tuple(value.shape)}".encode())
            elif isinstance(value, torch.Tensor):
                data = value.detach().cpu().contiguous()
                digest.update(f"{data.dtype} {tuple(data.shape)}".encode())
                digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
            else:
                digest.update(repr(value).encode())
    return digest.hexdigest()


def key_digest(key: Mapping[str, Any]) -> str:
    """The SHA-256 of ``key``'s canonical JSON: the entry's file name."""
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=repr).encode()).hexdigest()


# ------------------------------------------------------------------ graphs on disk

# NOTE [What a cached graph keeps]
# A GraphModule pickles as its Python code and traces that code again when loaded: slow (half a
# second for the 25m model's forward) and without ``node.meta``. The runtime reads meta after
# lowering: ``val`` (the collectives' sizes the ranks compare, the memory timeline of
# ``program.report``), the ``zerofx_*`` keys (parameter names, bucket contents, fetched shards),
# ``recompute`` and ``partitioner_tag`` (the min-cut partitioner's inputs), ``tensor_meta`` and
# ``original_aten``. So a graph is stored node by node, with those meta keys, and rebuilt node by
# node. Fake tensors are stored as (shape, stride, offset, dtype, device) and rebuilt under one
# fresh ``FakeTensorMode`` per entry, one per distinct layout (the runtime reads them, never
# writes them); ops as their qualified names. Other meta keys (stack
# traces, source-module stacks) are dropped.
_KEPT_META = frozenset({"val", "tensor_meta", "original_aten", "recompute", "partitioner_tag", "autograd_backward", "seq_nr",
                        "is_gradient_acc"})


class _NodeRef:
    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> Any:
        return (_NodeRef, (self.index,))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if callable(obj) and not isinstance(obj, type):
            address = _compat.op_address(obj)
            if address is not None:
                return ("op", *address)
        if isinstance(obj, _compat.FakeTensor):
            return ("fake", tuple(obj.shape), tuple(obj.stride()), obj.storage_offset(), obj.dtype, str(obj.device), obj.requires_grad)
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, fake_mode: Any) -> None:
        super().__init__(file)
        self.fake_mode = fake_mode
        self._devices: dict[str, torch.device] = {}
        self._fakes: dict[Any, torch.Tensor] = {}

    def _device(self, name: str) -> torch.device:
        if name not in self._devices:
            self._devices[name] = torch.device(name)
        return self._devices[name]

    def persistent_load(self, pid: Any) -> Any:
        kind = pid[0]
        if kind == "op":
            return _compat.op_at(*pid[1:])
        if kind == "fake":
            # Nodes with the same layout share one fake value: values are read, never written,
            # after lowering, and a 25m graph has a few hundred layouts over thousands of nodes.
            if pid not in self._fakes:
                _, shape, stride, offset, dtype, device, requires_grad = pid
                t = _compat.fake_tensor(self.fake_mode, shape, stride, offset, dtype, self._device(device))
                self._fakes[pid] = t.requires_grad_(requires_grad) if requires_grad else t
            return self._fakes[pid]
        raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")


class UncacheableGraphError(ZeroFXError):
    """A graph the cache cannot keep (one with ``call_module`` nodes): the program is built as
    usual and not cached."""


def graph_record(gm: fx.GraphModule) -> dict[str, Any]:
    """``gm`` as plain data: its nodes in order (op, name, target, args with node references as
    indices, kept meta), its codegen and its attributes (NOTE [What a cached graph keeps])."""
    index: dict[fx.Node, int] = {}
    nodes = []
    attrs: dict[str, Any] = {}
    for i, node in enumerate(gm.graph.nodes):
        if node.op == "call_module":
            raise UncacheableGraphError("graphs with call_module nodes are not cached")
        if node.op == "get_attr":
            attr = reduce(getattr, node.target.split("."), gm)
            # A loop's body (NOTE [One body per tiled region] in passes/tiling/chunk_loop.py) is
            # kept node by node too: Inductor reads its values.
            attrs[node.target] = _Subgraph(graph_record(attr)) if isinstance(attr, fx.GraphModule) else attr
        index[node] = i
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: _NodeRef(index[n]))
        meta = {k: v for k, v in node.meta.items() if k in _KEPT_META or k.startswith("zerofx_")}
        nodes.append((node.op, node.name, node.target, tuple(args), dict(kwargs), meta))
    return {"nodes": nodes, "codegen": _compat.graph_codegen(gm.graph), "attrs": attrs}


def graph_from_record(record: Mapping[str, Any]) -> fx.GraphModule:
    """The GraphModule ``graph_record`` described; its Python is written on first use (NOTE [Code
    written on first use] in passes/_compat.py)."""
    graph = fx.Graph()
    made: list[fx.Node] = []

    def resolve(a: Any) -> Any:
        return made[a.index] if isinstance(a, _NodeRef) else a

    for op, name, target, args, kwargs, meta in record["nodes"]:
        args, kwargs = fx.node.map_aggregate((args, kwargs), resolve)
        node = graph.create_node(op, target, tuple(args), dict(kwargs), name=name)
        assert node.name == name, (node.name, name)
        node.meta.update(meta)
        made.append(node)
    graph.set_codegen(record["codegen"])
    attrs = {k: graph_from_record(v.record) if isinstance(v, _Subgraph) else v for k, v in record["attrs"].items()}
    return _compat.make_graph_module(attrs, graph)


class _Subgraph:
    """A graph module held by a graph (a ``get_attr`` target), as ``graph_record`` describes it."""

    __slots__ = ("record",)

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    def __reduce__(self) -> Any:
        return (_Subgraph, (self.record,))


class _CachedCapture(CapturedStep):
    """A ``CapturedStep`` whose joint graph is rebuilt only when read: a cache hit runs the
    lowered graphs and needs the joint graph only for its size or a new lowering."""

    def __init__(self, joint_record: Callable[[], Mapping[str, Any]], fields: Mapping[str, Any]) -> None:
        self._joint_record = joint_record
        self._joint: fx.GraphModule | None = None
        super().__init__(joint=None, **fields)  # type: ignore[arg-type]

    @property  # type: ignore[override]
    def joint(self) -> fx.GraphModule:
        if self._joint is None:
            self._joint = graph_from_record(self._joint_record())
        return self._joint

    @joint.setter
    def joint(self, value: fx.GraphModule | None) -> None:
        if value is not None:
            self._joint = value


# Every field of a CapturedStep but its joint graph, which is kept as a graph record: a field
# the capture gains is cached with no change here.
_CAPTURE_FIELDS = tuple(f.name for f in dataclasses.fields(CapturedStep) if f.name != "joint")


def _payload(program: Program, rank: int) -> bytes:
    captured = program.captured
    data = {
        "captured": {f: getattr(captured, f) for f in _CAPTURE_FIELDS},
        "joint": _dumps(graph_record(captured.joint)),  # unpickled only when read (_CachedCapture)
        "plan": program.plan,
        "modules": {name: graph_record(gm) for name, gm in program.graph_modules(rank).items()},
        "setup_times": dict(program.setup_times),
    }
    data["captured"]["tied"] = dict(data["captured"]["tied"])
    return _dumps(data)


def program_bytes(program: Program, rank: int) -> bytes:
    """``program``, lowered for ``rank``, as bytes ``program_from_bytes`` reads back: what a cache
    entry holds, and what rank 0 sends the other ranks (NOTE [One build per job] in zerofx/runtime/rank_agreement.py)."""
    return _payload(program, rank)


def program_from_bytes(payload: bytes, program_options: Mapping[str, Any]) -> Program:
    """The program ``program_bytes`` wrote, made with ``program_options`` (``Program``'s keyword arguments)."""
    return _program_from_payload(payload, program_options)


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _loads(data: bytes, fake_mode: Any) -> Any:
    with warnings.catch_warnings():
        # torch's TreeSpec unpickles through a deprecated isinstance check of its own
        warnings.simplefilter("ignore", FutureWarning)
        return _Unpickler(io.BytesIO(data), fake_mode).load()


def _program_from_payload(payload: bytes, program_options: Mapping[str, Any]) -> Program:
    fake_mode = _compat.FakeTensorMode(allow_non_fake_inputs=True)
    data = _loads(payload, fake_mode)
    captured = _CachedCapture(lambda: _loads(data["joint"], fake_mode), data["captured"])
    modules = {name: graph_from_record(record) for name, record in data["modules"].items()}
    # The build's options name the shard placement (param_offload) the key was made with; the
    # cached plan carries it, so the program takes only the group names.
    groups = {k: v for k, v in program_options.items() if k != "param_offload"}
    return Program.from_lowered(captured, data["plan"], modules, **groups)


# ------------------------------------------------------------------ entries

# NOTE [Stale entries are rebuilt, never used]
# An entry is used only when the file is one this user may trust (NOTE [Who the plan cache
# trusts] in zerofx/compiler/cache_trust.py), its signature line and header parse, the header
# names this format, the payload that follows has the length and SHA-256 the header states,
# the signature over header and payload verifies with this user's secret, the header names this
# torch, zerofx (and the hash of its code) and Python and carries exactly this key, and the
# payload unpickles into graphs. Anything else (a truncated write from a killed process, a
# flipped byte, another version, a forged or foreign entry) warns once with the reason and the
# path, and the program is built from the model and written over the entry. Nothing in an entry
# is unpickled before its signature verifies.


def entry_path(directory: Path, key: Mapping[str, Any]) -> Path:
    """Where the entry for ``key`` lives in ``directory``."""
    return Path(directory) / f"{key_digest(key)[:40]}{SUFFIX}"


def _read_entry(path: Path, key: Mapping[str, Any], secret: bytes,
                trust: CacheTrust = CacheTrust.PRIVATE) -> tuple[bytes | None, str | None]:
    """(payload, None) when the entry at ``path`` is whole, signed with ``secret`` and for
    ``key``; (None, why) when it is not; (None, None) when there is no entry."""
    try:
        raw = cache_trust.read_entry_file(path, trust)
    except FileNotFoundError:
        return None, None
    except cache_trust.UntrustedCacheError as exc:
        return None, f"it may not be trusted: {exc}"
    except OSError as exc:
        return None, f"unreadable ({exc})"
    mac, sep, rest = raw.partition(b"\n")
    head, sep2, payload = rest.partition(b"\n")
    if not (sep and sep2):
        return None, "no header line (truncated)"
    try:
        header = json.loads(head)
    except ValueError:
        return None, "the header is not JSON (corrupt, or another format)"
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        return None, "another format"
    if len(payload) != header.get("payload_bytes"):
        return None, f"{len(payload)} payload bytes where the header says {header.get('payload_bytes')} (truncated)"
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        return None, "the payload's SHA-256 differs from the header's (corrupt)"
    if not cache_trust.verify(secret, head, payload, mac):
        return None, "its signature does not verify with this user's plan-cache key (forged, or written with another key)"
    stored_key = header.get("key", {})
    if stored_key.get("versions") != key["versions"]:
        return None, f"written by other versions ({stored_key.get('versions')}; now {key['versions']})"
    if json.dumps(stored_key, sort_keys=True, default=repr) != json.dumps(key, sort_keys=True, default=repr):
        return None, "written for another key"
    return payload, None


def _write_entry(path: Path, key: Mapping[str, Any], payload: bytes, secret: bytes, trust: CacheTrust = CacheTrust.PRIVATE) -> None:
    """Write the entry atomically: a temporary file in the same directory (0600, 0640 in a team
    cache), flushed, then renamed. Its first line is the signature of the rest."""
    header = {"format": FORMAT, "key": key, "payload_bytes": len(payload), "payload_sha256": hashlib.sha256(payload).hexdigest()}
    head = json.dumps(header, sort_keys=True, default=repr).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            if trust is CacheTrust.GROUP:
                os.fchmod(f.fileno(), 0o640)
            f.write(cache_trust.signature(secret, head, payload).encode() + b"\n" + head + b"\n")
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_or_build(directory: Path | None, key: Mapping[str, Any], build: Callable[[], Program], *, rank: int,
                  program_options: Mapping[str, Any], trust: CacheTrust = CacheTrust.PRIVATE, key_file: Path | None = None) -> Program:
    """The program stored under ``key`` in ``directory``, else ``build()``'s, stored there; a
    loaded one is made with ``program_options`` (``Program``'s keyword arguments, which ``build``
    uses too and ``key`` covers). With ``directory`` None, just ``build()``; with a directory or
    secret that may not be trusted (NOTE [Who the plan cache trusts]), ``build()`` with a warning
    that says why. A hit's ``setup_times`` has one phase, ``cache``: the seconds to read and
    rebuild the graphs."""
    if directory is None:
        return build()
    start = time.perf_counter()
    try:
        directory = cache_trust.check_directory(directory, trust)
        secret = cache_trust.load_secret(key_file, trust)
    except (cache_trust.UntrustedCacheError, OSError) as exc:
        warnings.warn(PlanCacheWarning(f"the plan cache in {directory} is not used: {exc}; building without it "
                                       f"(docs/plan-cache.md#whom-the-cache-trusts)"), stacklevel=3)
        return build()
    path = entry_path(directory, key)
    payload, why = _read_entry(path, key, secret, trust)
    if payload is not None:
        try:
            program = _program_from_payload(payload, program_options)
        except Exception as exc:  # an entry that does not load is rebuilt, whatever the reason
            why = f"it does not load ({type(exc).__name__}: {exc})"
        else:
            program.setup_times = {"cache": time.perf_counter() - start}
            program.cache_entry = path
            return program
    if why is not None:
        warnings.warn(PlanCacheWarning(f"plan cache entry {path} is not used: {why}; capturing and lowering again"), stacklevel=3)
    program = build()
    try:
        _write_entry(path, key, _payload(program, rank), secret, trust)
    except (OSError, ValueError, pickle.PicklingError, TypeError, AttributeError) as exc:
        warnings.warn(PlanCacheWarning(f"plan cache entry {path} not written: {type(exc).__name__}: {exc}"), stacklevel=3)
    else:
        program.cache_entry = path
    return program
