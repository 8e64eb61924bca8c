"""Train the tiny DNA language model with ZeRO stage 3 on two CPU ranks.

Run it from the repository root:

    python examples/train_dna.py

It spawns 2 local processes joined by a gloo process group, shards the model's parameters,
gradients and AdamW states across them (ZeRO stage 3), and trains for 20 steps on windows of
the bundled lambda phage genome (48,502 bp). Before training, rank 0 prints its graphs:
every parameter enters as this rank's shard (``primals_*``) and is all-gathered
(``all_gather_into_tensor`` + ``wait_tensor``) just before its first use. Then rank 0 prints
each step's loss, averaged over both ranks; it starts near ln(5) = 1.61, the loss of a uniform
guess over A, C, G, T, N, and falls as the model learns the genome's base composition.

The same run from the command line: ``zerofx train --world-size 2 --stage 3 --print-graph-code``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# So the example runs from a checkout without `pip install -e .`.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zerofx.app.training import TrainOptions, train


def main() -> None:
    options = TrainOptions(
        model="tiny",  # 25k parameters: 2 layers, width 32
        fasta=None,  # the bundled lambda phage genome
        world_size=2,
        stage=3,
        steps=20,
        seq_len=128,
        batch_size=2,  # per rank, so 4 windows of 128 bases per step
        lr=3e-3,
        print_graph_code=True,  # the graphs' code, after their collective counts
    )
    train(options)


# Each spawned rank re-imports this file; only the parent process may start training.
if __name__ == "__main__":
    main()
