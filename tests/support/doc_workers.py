"""Rank functions for tests/test_doc_snippets.py: a documented ``zerofx train`` command's ranks."""

from __future__ import annotations

import os
import sys
import tempfile

from zerofx.app import training


def train_rank(rank: int, world_size: int, opts: training.TrainOptions, folder: str) -> str:
    """One rank of ``zerofx train``, as its spawned rank runs it (``training._train_rank`` in an
    initialized gloo group), in ``folder``, where the command's relative paths point. Returns
    what the rank wrote to its stdout and stderr, in the order written, processes it forked
    included (rank 0's search of ``"zerofx": {"auto": true}`` prints from a child)."""
    here = os.getcwd()
    with tempfile.TemporaryFile("w+") as out:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        os.chdir(folder)
        try:
            training._train_rank(rank, opts)
        except BaseException as exc:
            sys.stdout.flush()
            sys.stderr.flush()
            out.seek(0)
            raise RuntimeError(f"rank {rank} printed, before it failed:\n{out.read()[-3000:]}") from exc
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.chdir(here)
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        out.seek(0)
        return out.read()
