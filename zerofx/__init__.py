"""zerofx: ZeRO-style sharded training, written as a compiler pass over torch.fx graphs.

    program = zerofx.compile(model, world_size=8, stage=3)  # graphs: example_inputs= here or to graph_modules
    engine = zerofx.initialize(model, config="ds_config.json", example_inputs=(batch,))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# First: a checkout folder that shadows the installed package raises a clear ImportError here
# (NOTE [A checkout that shadows the package]), before a missing zerofx.passes would.
import zerofx._checkout  # noqa: F401
from zerofx._version import __version__
from zerofx.common.errors import CaptureError, ConfigError, MissingExampleInputsError, RankDivergenceError, ZeroFXError

if TYPE_CHECKING:
    from zerofx.passes import Plan, ZeroStage
    from zerofx.compiler.capture import CapturedStep
    from zerofx.compiler.pipeline import capture_step
    from zerofx.runtime.checkpoint import CheckpointError, consolidate
    from zerofx.config import ZeroConfig, parse_config
    from zerofx.runtime.engine import Engine, initialize
    from zerofx.compiler.materialize import init_weights_
    from zerofx.compiler.program import Program, compile
    from zerofx.passes.sequence.mixer_custom import OpSequenceMixer, register_sequence_mixer, unregister_sequence_mixer

# The names that need torch load their module when first used (PEP 562), so that `import zerofx`
# (and with it `zerofx --help`) stays light: NOTE [A command line that answers at once] in
# zerofx/app/cli.py. `zerofx.compile`, `from zerofx import Engine` and the rest work as before.
_LAZY = {
    "Plan": "zerofx.passes",
    "ZeroStage": "zerofx.passes",
    "CapturedStep": "zerofx.compiler.capture",
    "capture_step": "zerofx.compiler.pipeline",
    "CheckpointError": "zerofx.runtime.checkpoint",
    "consolidate": "zerofx.runtime.checkpoint",
    "ZeroConfig": "zerofx.config",
    "parse_config": "zerofx.config",
    "Engine": "zerofx.runtime.engine",
    "initialize": "zerofx.runtime.engine",
    "init_weights_": "zerofx.compiler.materialize",
    "Program": "zerofx.compiler.program",
    "compile": "zerofx.compiler.program",
    "OpSequenceMixer": "zerofx.passes.sequence.mixer_custom",
    "register_sequence_mixer": "zerofx.passes.sequence.mixer_custom",
    "unregister_sequence_mixer": "zerofx.passes.sequence.mixer_custom",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'zerofx' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(module), name)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "CaptureError",
    "CheckpointError",
    "CapturedStep",
    "ConfigError",
    "Engine",
    "MissingExampleInputsError",
    "OpSequenceMixer",
    "Plan",
    "Program",
    "RankDivergenceError",
    "ZeroConfig",
    "ZeroFXError",
    "ZeroStage",
    "__version__",
    "capture_step",
    "compile",
    "consolidate",
    "init_weights_",
    "initialize",
    "parse_config",
    "register_sequence_mixer",
    "unregister_sequence_mixer",
]
