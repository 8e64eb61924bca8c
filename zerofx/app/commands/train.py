"""``zerofx train``: its flags, parsed into ``TrainOptions`` for ``zerofx.app.training.train``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from zerofx.app.commands.common import CONFIG_ARG, MAX_LOCAL_RANKS, SIZES, existing, float_arg, freeze_imports, int_arg
from zerofx.common.limits import DEFAULT_TRAIN_STAGE, MAX_FOREIGN_FRACTION, MAX_SEED

FASTA_ARG = existing("genome file", "a FASTA file (.fa, .fasta, optionally .gz)")
BED_ARG = existing("BED file", "a BED file (record, 0-based start, end per line)")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="train a DNA model on local gloo (CPU) ranks, or as torchrun's ranks (NCCL on GPUs)",
                       description="Spawn local gloo ranks and train a DNA model with zerofx on a FASTA genome; under torchrun (one or "
                                   "many nodes), run as one of its ranks instead, over NCCL where there are GPUs.")
    p.add_argument("--model", default="tiny", metavar="MODEL_SPEC",
                   help=f"a bundled model size ({SIZES}; docs/models.md), or FILE.py:CALLABLE / MODULE:CALLABLE returning (model, "
                        "example_inputs) as for zerofx plan: any nn.Module called as model(input_ids, labels=labels) that "
                        "returns the loss or an output with .loss (a Hugging Face model from a local config works); its "
                        "input embedding needs at least the vocabulary's rows (default: tiny; docs/training.md)")
    p.add_argument("--fasta", type=FASTA_ARG,
                   help="FASTA genome, plain or .gz, one or more records (default: the bundled lambda phage genome): IUPAC "
                        f"nucleotide codes; refused when empty, headers only, corrupt, or over {MAX_FOREIGN_FRACTION * 100:g}%% "
                        "of its symbols are not nucleotide codes (a protein FASTA; the error names the first one's record and "
                        "offset)")
    p.add_argument("--data", type=existing("prepared genome", "a folder written by zerofx data prepare", folder=True), metavar="DIR",
                   help="a genome prepared by zerofx data prepare (instead of --fasta, which is prepared into the data "
                        "cache, $ZEROFX_DATA_CACHE or ~/.cache/zerofx/genomes, on first use); refused when a source file "
                        "changed since it was prepared")
    p.add_argument("--bed", type=BED_ARG,
                   help="draw training windows only inside this BED file's intervals (record, 0-based start, end); "
                        "default: every record, less the held-out regions")
    p.add_argument("--holdout-records", metavar="NAME[,NAME...]",
                   help="hold out these records (chromosomes) whole for evaluation, e.g. chr20,chr21 (default: the last "
                        "10%% of every record)")
    p.add_argument("--holdout-bed", type=BED_ARG, help="hold out this BED file's intervals for evaluation instead")
    p.add_argument("--max-n-fraction", type=float_arg(0, 1), default=0.1,
                   help="skip windows whose share of N is above this, 0..1 (default: 0.1)")
    p.add_argument("--reverse-complement", action="store_true",
                   help="read half the training windows, drawn at random, on the reverse strand")
    p.add_argument("--objective", choices=("clm", "mlm"), default="clm",
                   help="clm: next-token prediction, model(ids, labels=ids); mlm: masked LM, 15%% of tokens chosen, 80/10/10 "
                        "<mask>/random/unchanged, model(masked_ids, labels=labels) with labels -100 where nothing was masked, "
                        "masks reproducible from --seed; needs a bidirectional model, a bimamba size or a --model spec, and those "
                        "sizes train only with it (default: clm)")
    p.add_argument("--kmer", type=int_arg(1), metavar="K",
                   help="tokenize into non-overlapping K-mers, 1..8, in the Nucleotide Transformer's vocabulary (<unk> <pad> "
                        "<mask> <cls> <eos> <bos>, the 4**K K-mers, A T C G N: 4,107 ids for K=6); --seq-len counts K-mers "
                        "(default: single bases A C G T N for clm, K=1 in that vocabulary for mlm)")
    p.add_argument("--world-size", type=int_arg(1, MAX_LOCAL_RANKS),
                   help=f"number of local ranks to spawn, 1..{MAX_LOCAL_RANKS} (default: the config's zerofx.world_size, else 2; "
                        "under torchrun, torchrun's)")
    p.add_argument("--stage", type=int, help=f"ZeRO stage 0-3 (default: the config's, else {DEFAULT_TRAIN_STAGE})")
    p.add_argument("--config", type=CONFIG_ARG, help="DeepSpeed-style JSON config; replaces the default AdamW and --lr")
    p.add_argument("--steps", type=int_arg(1), default=20,
                   help="optimizer steps, >= 1; each takes the config's gradient_accumulation_steps micro-batches (default: 20)")
    p.add_argument("--seq-len", type=int_arg(2), default=128,
                   help="tokens per window (K-mers with --kmer), 2..a bundled model's max_seq_len, >= 2 for a spec (default: 128)")
    p.add_argument("--batch-size", type=int_arg(1),
                   help="windows per rank per micro-step, >= 1 (default: the config's train_micro_batch_size_per_gpu, or "
                        "train_batch_size / (gradient_accumulation_steps x world size), else 2); with a config, it must agree")
    p.add_argument("--lr", type=float_arg(0), default=3e-3,
                   help="AdamW learning rate when no --config, a finite number >= 0 (default: 3e-3)")
    p.add_argument("--seed", type=int_arg(0, MAX_SEED), default=0,
                   help="seed for the model init, the data shuffle and the mlm masks, 0..2**64-1 (default: 0)")
    p.add_argument("--print-graph", action="store_true",
                   help="before training, print rank 0's graphs with their counts of all-gathers, reduce-scatters, all-reduces and waits")
    p.add_argument("--print-graph-code", action="store_true", help="as --print-graph, and print each graph's code too (long)")
    p.add_argument("--output-dir", type=Path,
                   help="save sharded checkpoints here, and resume from its newest complete one (default: no checkpoints)")
    p.add_argument("--save-every", type=int_arg(1), help="save every K >= 1 training steps (default: only after the last step)")
    p.add_argument("--keep-last", type=int_arg(1),
                   help="after each save, delete the oldest step-N checkpoints beyond the newest K >= 1 (default: keep all)")
    p.add_argument("--schedule-steps", type=int_arg(1),
                   help="the learning-rate scheduler's total_num_steps, over the config's: continue a finished run with more "
                        "--steps and a decay stretched over them (default: the config's)")
    p.add_argument("--collective-timeout", dest="collective_timeout_s", type=float_arg(0, low_inclusive=False),
                   help="seconds a collective waits for a dead or stalled peer before the run fails, > 0 (default: the "
                        "config's zerofx.collective_timeout_s, else 300)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Train a bundled DNA model or a model spec with the parsed flags (``zerofx.app.training.train``)."""
    from zerofx.app.training import Objective, TrainOptions, train

    freeze_imports(args)  # under torchrun this process is a rank (NOTE [Freezing the imports])
    train(
        TrainOptions(
            model=args.model, fasta=args.fasta, world_size=args.world_size, stage=args.stage, config=args.config,
            steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
            print_graph=args.print_graph, print_graph_code=args.print_graph_code, output_dir=args.output_dir, save_every=args.save_every,
            keep_last=args.keep_last, collective_timeout_s=args.collective_timeout_s, schedule_steps=args.schedule_steps,
            objective=Objective(args.objective), kmer=args.kmer, data=args.data, bed=args.bed,
            holdout_records=tuple(r for r in (args.holdout_records or "").split(",") if r), holdout_bed=args.holdout_bed,
            max_n_fraction=args.max_n_fraction, reverse_complement=args.reverse_complement,
        )
    )
    return 0
