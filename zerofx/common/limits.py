"""The bounds and defaults the command line checks its arguments against, and those checks.

Torch-free: ``zerofx --help``, every subcommand's ``--help`` and ``zerofx estimate --params``
answer without loading torch (NOTE [A command line that answers at once] in zerofx/app/cli.py). The
modules that enforce these bounds at run time (``zerofx.compiler.program``, ``zerofx.app.training``,
``zerofx.data.genome``, ``zerofx.planner.folding``) import them from here, so each has one definition.
The named model sizes and their check are ``zerofx.models.sizes``.
"""

from __future__ import annotations

from zerofx.common.errors import UsageError

# The largest world size planned: far beyond any cluster, small enough that per-rank sizes and
# the planner's tables stay exact.
MAX_WORLD_SIZE = 2**20

# `zerofx train`'s stage when neither --stage nor the config sets one.
DEFAULT_TRAIN_STAGE = 3
# torch.manual_seed takes a 64-bit unsigned seed.
MAX_SEED = 2**64 - 1

# NOTE [Which symbols a genome may hold] (zerofx/data/genome.py): at most 1% of the symbols may be
# foreign (not nucleotide codes). Assembled genomes have none; a protein FASTA has about 35%.
MAX_FOREIGN_FRACTION = 0.01

# ``zerofx plan --fold auto`` folds models with at least this many repeated blocks: below it a
# full capture takes seconds anyway, and its rows are exact.
AUTO_FOLD_MIN_BLOCKS = 12


def check_positive(name: str, value: int) -> int:
    if value < 1:
        raise UsageError(f"{name} {value} is invalid; accepted: an integer >= 1")
    return value


def check_stage(stage: int | None) -> int | None:
    if stage is not None and stage not in (0, 1, 2, 3):
        raise UsageError(f"--stage {stage} is not a ZeRO stage; accepted: 0, 1, 2 or 3")
    return stage
