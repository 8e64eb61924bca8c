"""The ``zerofx`` command line: plan, estimate and train the bundled DNA models (docs/models.md).

    zerofx plan 1b --world-size 1024 --stage 3      # the plan, on the meta device: no real memory
    zerofx estimate 7b --world-size 64               # model-state GiB per rank, stages 0-3
    zerofx train --world-size 2 --stage 3 --steps 20 # real training, gloo ranks on this CPU
    zerofx train --output-dir run1 --save-every 5    # checkpoints; resumes from run1's latest
    zerofx consolidate run1 model.safetensors        # one file for load_state_dict, streamed

``main(argv)`` returns the exit code: 0 on success, 2 for bad input (a one-line message on
stderr, no traceback), 1 when a training rank fails, 130 when Ctrl-C stops a command (for
``train``, one line naming the step and the checkpoint to resume from). The training loop itself is
``zerofx.app.training.train(TrainOptions(...))``, for scripts such as ``examples/train_dna.py``.
Each subcommand is a module of ``zerofx/app/commands/``, holding its flags (``add_parser``) and
what it runs (``run``); this module builds the top-level parser from them and dispatches.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

# NOTE [A command line that answers at once]
# `zerofx --help`, every subcommand's --help and `zerofx estimate --params` answer in a fraction
# of a second because nothing here imports torch and the compiler (5-6 s of CPU on a 2-core
# machine; docs/benchmarks.md, CLI start-up) before the arguments are parsed: this module and the
# subcommands' modules (zerofx/app/commands/) import at module level only torch-free modules
# (zerofx.common.limits for the bounds the validators check, zerofx.models.sizes for the size
# names, zerofx.common.units for --budget), `import zerofx` itself is light (PEP 562 lazy names
# in zerofx/__init__.py), and each command imports what it runs inside its function.
# tests/test_plan_output.py checks that `zerofx estimate --params` leaves torch unimported;
# benchmarks/cli_startup.py times the commands.
from zerofx._version import __version__
from zerofx.app.commands import calibrate, config_schema, consolidate, data, estimate, plan, train
from zerofx.common.errors import RankFailedError, TrainingInterrupted, UsageError, ZeroFXError


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``UsageError``), not usage plus a message."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="zerofx", description="ZeRO-style sharded training as torch.fx compiler passes.")
    parser.add_argument("--version", action="version", version=f"zerofx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                help="one of these; zerofx COMMAND --help lists its options")
    for command in (plan, estimate, config_schema, calibrate, train, data, consolidate):  # in the order --help lists them
        command.add_parser(sub)
    return parser


def _attach_negative_values(argv: Sequence[str]) -> list[str]:
    """``--flag -5GiB`` as ``--flag=-5GiB``. argparse takes a token that starts with "-" and is
    not a plain number for another flag, and would answer "expected one argument"; attached, the
    value reaches the flag's own check, which names it and what is accepted."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and len(token) > 1 and token[0] == "-" and (token[1].isdigit() or token[1] == "."):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``zerofx`` command line; return the exit code (see the module docstring)."""
    parser = build_parser()
    try:
        args = parser.parse_args(_attach_negative_values(sys.argv[1:] if argv is None else argv))
        args.as_program = argv is None  # NOTE [Freezing the imports]
        return args.func(args)
    except SystemExit as exc:  # --help and --version exit through argparse
        return exc.code if isinstance(exc.code, int) else 0
    except TrainingInterrupted as exc:  # NOTE [Ctrl-C stops every rank at one step] (zerofx/app/launch.py)
        print(f"zerofx: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # Ctrl-C before any rank started, or in another command
        print("zerofx: stopped by Ctrl-C", file=sys.stderr)
        return 130
    except RankFailedError as exc:
        print(f"zerofx: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ZeroFXError as exc:
        print(f"zerofx: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
