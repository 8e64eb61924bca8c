"""User-facing errors. Each names the bad value and what would be accepted."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

import zerofx._checkout  # noqa: F401  (NOTE [A checkout that shadows the package]: a zerofx imported from the wrong folder)


class ZeroFXError(ValueError):
    """Base class for every error zerofx raises on bad user input."""


class UsageError(ZeroFXError):
    """A command-line argument or a ``zerofx train`` option is missing or malformed."""


class ConfigError(ZeroFXError):
    """A config key is unknown, misspelled, of the wrong type or out of range."""


class CaptureError(ZeroFXError):
    """The model could not be captured whole into forward and backward graphs."""


class MissingLossError(CaptureError):
    """The model's output holds no loss (for example a Hugging Face model called without labels)."""


# Every sequence-parallel refusal ends with it (NOTE [Declared sequence mixers] in passes/sequence/mixer_custom.py).
DECLARE_MIXER_HINT = ("an op zerofx does not know shards once declared with zerofx.register_sequence_mixer("
                      "zerofx.OpSequenceMixer(op, exchange=...)): docs/sequence-parallel.md, \"Ops zerofx cannot know\"")


class SequenceParallelError(CaptureError):
    """The graph has an op the sequence-parallel rewrite cannot shard; the message names the op
    and its module, and how to declare an op zerofx does not know (``DECLARE_MIXER_HINT``)."""

    def __init__(self, message: str) -> None:
        # Unpickled (a rank's error sent to another process) the message has the hint already.
        super().__init__(message if DECLARE_MIXER_HINT in message else f"{message} ({DECLARE_MIXER_HINT})")


class InputMismatchError(ZeroFXError):
    """A call's inputs differ from those the program was captured for (structure, a non-tensor
    argument, a shape or a dtype)."""


class PlanError(ZeroFXError):
    """A planner or cost model was asked for what it cannot plan: an argument out of range,
    state that fits no budget, a graph the plan was not made for."""


class CompileStageError(ZeroFXError, RuntimeError):
    """A stage of the compile spine failed; the message names it and the stages that ran
    (NOTE [The compile spine] in zerofx/compiler/pipeline.py)."""


class MissingExampleInputsError(ZeroFXError):
    """A program compiled without example inputs was asked for what needs its graphs."""


class RankDivergenceError(ZeroFXError):
    """Ranks planned different programs; running them would hang in a collective."""


class CollectiveTimeoutError(ZeroFXError, RuntimeError):
    """A collective did not complete within the process group's timeout: a peer is dead, stalled
    or issuing a different collective. The message names the rank, graph and collective;
    ``where`` is the graph and collective alone, ``timeout_s`` the timeout it waited."""

    def __init__(self, message: str, *, where: str = "", timeout_s: float | None = None) -> None:
        super().__init__(message)
        self.where = where
        self.timeout_s = timeout_s


class NonFiniteError(ZeroFXError, RuntimeError):
    """A loss or gradient of a step is NaN or infinite (``zerofx.nonfinite`` "error"). Raised on
    every rank alike; the message names the optimizer step, each rank that holds one and the
    loss or first parameter there."""


class EngineStateError(ZeroFXError, RuntimeError):
    """An engine method was called out of order (``forward`` -> ``backward`` -> ``step``)."""


class RankFailedError(RuntimeError):
    """A training rank exited with an error; ``exit_code`` is what the CLI returns. Here, not in
    zerofx.app.training, so the command line catches it without importing torch."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class TrainingInterrupted(RankFailedError):
    """``zerofx train`` was stopped by Ctrl-C (SIGINT); the message says at which step, the newest
    complete checkpoint and how to resume. The command line prints it without "error" and exits 130,
    the shell's code for a command ended by SIGINT."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=130)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """A ' (did you mean X?)' suffix when a close match exists, else ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""
