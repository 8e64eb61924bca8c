"""zerofx: ZeRO-style sharded training, written as a compiler pass over torch.fx graphs.

    program = zerofx.compile(model, world_size=8, stage=3)  # graphs: example_inputs= here or to graph_modules
    engine = zerofx.initialize(model, config="ds_config.json", example_inputs=(batch,))
"""

from zerofx.passes import Plan, ZeroStage
from zerofx.capture import CapturedStep, capture_step
from zerofx.checkpoint import CheckpointError, consolidate
from zerofx.config import ZeroConfig, parse_config
from zerofx.engine import Engine, initialize
from zerofx.errors import CaptureError, ConfigError, MissingExampleInputsError, RankDivergenceError, ZeroFXError
from zerofx.materialize import init_weights_
from zerofx.program import Program, compile

from zerofx._version import __version__

__all__ = [
    "CaptureError",
    "CheckpointError",
    "CapturedStep",
    "ConfigError",
    "Engine",
    "MissingExampleInputsError",
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
]
