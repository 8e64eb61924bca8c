"""The training app behind ``zerofx train``: options, checks, the per-rank loop and the launchers.

    train(TrainOptions(model="tiny", world_size=2, stage=3, steps=20))

``train`` checks the options in the calling process, before any process starts, then spawns
``world_size`` local gloo ranks (or, under torchrun, runs as one of torchrun's ranks). Each rank
builds the model (a bundled size, docs/models.md, or a model spec's: docs/training.md), tokenizes its windows
of the genome (masking them for ``Objective.MLM``), initializes a zerofx ``Engine`` from its
first batch, resumes from the newest complete checkpoint in ``output_dir`` if there is one,
trains, saves, and evaluates on the held-out slice of the genome. Rank 0 prints each step's
loss averaged over ranks and appends it to ``output_dir/train_log.jsonl``.

Errors: ``UsageError`` (a ``ZeroFXError``) for bad options, naming the ``zerofx train`` flag;
``RankFailedError`` when a spawned rank fails (naming the stalled rank when a collective timed
out), ``TrainingInterrupted`` after Ctrl-C (``zerofx.app.launch``). ``zerofx.app.cli`` turns
them into exit codes.
"""

from __future__ import annotations

import faulthandler
import itertools
import json
import math
import os
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from tqdm import tqdm

from zerofx.passes.meta import is_all_gather, is_all_reduce, is_all_to_all, is_reduce_scatter, is_wait
from zerofx.common.paths import probe_writable
from zerofx.common.units import format_bytes
from zerofx.runtime.checkpoint import describe_layout, latest_complete_tag, read_metadata, saved_layout
from zerofx.config import ZeroConfig, parse_config
from zerofx.data.genome import bundled_genome
from zerofx.data.prepared import open_prepared
from zerofx.app.train_data import batch_starts, check_data, resolve_data, sample_batches, sampler
from zerofx.data.mlm import MlmMasking, mask_samples, mask_seed, mask_tokens
from zerofx.data.tokenizers import MAX_KMER, KmerTokenizer
from zerofx.runtime.engine import Engine, ScheduleEndWarning, initialize
from zerofx.runtime import rank_agreement
from zerofx.app.launch import COMM_FAILURE_EXIT_CODE, RankChannel, install_stop_handler, launch_ranks, stop_requested
from zerofx.common.errors import CollectiveTimeoutError, UsageError, ZeroFXError
from zerofx.common.limits import DEFAULT_TRAIN_STAGE, MAX_SEED, check_positive, check_stage
from zerofx.models.registry import build_model as build_bundled_model
from zerofx.models.sizes import model_config
from zerofx.common.vocab import DNA_VOCAB
from zerofx.compiler.program import resolve
from zerofx.common.rss import peak_rss_bytes
from zerofx.runtime.schedulers import lr_at

DEFAULT_TRAIN_BATCH = 2


class Objective(str, Enum):
    """What the model learns; how the batch reaches it is in docs/training.md."""

    CLM = "clm"  # causal LM: model(ids, labels=ids), the model shifts the labels by one
    MLM = "mlm"  # masked LM: model(masked_ids, labels=labels), labels -100 where nothing was masked


@dataclass(frozen=True)
class TrainOptions:
    """Everything a training run needs; picklable, so each spawned rank gets a copy."""

    model: str = "tiny"  # a bundled model size (zerofx.models.MODEL_SIZES), or a model spec FILE.py:CALLABLE / MODULE:CALLABLE
    fasta: Path | None = None  # None: the bundled lambda phage genome
    world_size: int | None = 2  # None: the config's (zerofx.world_size or its batch sizes), else 2
    stage: int | None = None  # None: the config's stage, else DEFAULT_TRAIN_STAGE
    config: Path | None = None
    steps: int = 20
    seq_len: int = 128
    batch_size: int | None = None  # None: the config's train_micro_batch_size_per_gpu, else 2
    lr: float = 3e-3
    seed: int = 0
    print_graph: bool = False  # rank 0 prints each graph's collectives before training
    print_graph_code: bool = False  # ... and each graph's code
    output_dir: Path | None = None  # checkpoints and train_log.jsonl go here; a run resumes from its newest complete one
    eval_batches: int = 8  # held-out batches per rank evaluated after training
    save_every: int | None = None  # None: save only after the last step (when output_dir is set)
    keep_last: int | None = None  # None: keep every checkpoint; K: delete the oldest beyond the newest K
    collective_timeout_s: float | None = None  # None: the config's zerofx.collective_timeout_s (default 300)
    # The scheduler's total_num_steps, over the config's: a finished run continued with more --steps
    # decays its learning rate over the longer run instead of staying at the final value.
    schedule_steps: int | None = None
    objective: Objective = Objective.CLM
    kmer: int | None = None  # None: the bundled 5-token vocabulary for clm, 1-mers in NT's layout for mlm
    data: Path | None = None  # a prepared genome (zerofx data prepare); None: fasta, prepared into the data cache
    bed: Path | None = None  # None: training windows from every record (less the held-out regions)
    holdout_records: tuple[str, ...] = ()  # records held out whole; with holdout_bed empty, the last 10% of each record
    holdout_bed: Path | None = None
    max_n_fraction: float = 0.1  # windows with a larger share of N are skipped
    reverse_complement: bool = False  # half the training windows read on the reverse strand
    # The config parsed once, by ``check_train_options``, with the flags that override it
    # (--collective-timeout, --schedule-steps; without --config, --stage and --lr) written in
    # before the parse: what every rank initializes with (NOTE [Options are parsed once]).
    engine_config: ZeroConfig | None = None


def _free_port() -> int:
    """A TCP port free right now on 127.0.0.1, for the gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parse_run_config(opts: TrainOptions) -> ZeroConfig:
    """The run's one parse (NOTE [Options are parsed once] in zerofx/config/__init__.py): the
    --config file, or without one the config the flags describe (AdamW at --lr; the stage is
    left to ``check_train_options``), with --collective-timeout and --schedule-steps applied to
    the typed options. The flags win over the file, on every rank alike."""
    flags = {"optimizer": {"type": "AdamW", "params": {"lr": opts.lr}}}
    cfg = parse_config(opts.config if opts.config is not None else flags)  # the world size is checked last, with the stage
    if opts.collective_timeout_s is not None:
        cfg = replace(cfg, collective_timeout_s=float(opts.collective_timeout_s))
    if opts.schedule_steps is not None:
        if cfg.scheduler is None:
            raise UsageError("--schedule-steps sets the config's scheduler.params.total_num_steps; this run has no scheduler "
                             "(a --config with a scheduler section, e.g. examples/dna_lm_zero3.json)")
        cfg = replace(cfg, scheduler=replace(cfg.scheduler, total_num_steps=opts.schedule_steps))  # checked as the file's would be
    return cfg


def _engine_config(opts: TrainOptions) -> ZeroConfig:
    """The run's options, parsed once by ``check_train_options``."""
    if opts.engine_config is None:
        raise ZeroFXError("TrainOptions.engine_config is not set: pass the options through check_train_options first")
    return opts.engine_config


def _collective_timeout(opts: TrainOptions) -> timedelta:
    """The process group's timeout: --collective-timeout, else the config's (NOTE [The collective timeout])."""
    return timedelta(seconds=_engine_config(opts).collective_timeout_s)


def data_layout(opts: TrainOptions, rank: int) -> tuple[int, int]:
    """(this rank's data-parallel index, the number of data-parallel groups). Without sequence
    parallelism every rank is its own group; with it, the ranks of a sequence group (r // S,
    NOTE [Sequence groups] in zerofx/runtime/rank_groups.py) get the same windows, and the groups different ones."""
    spec = _engine_config(opts).sequence_parallel
    size = 1 if spec is None else spec.size
    return rank // size, opts.world_size // size


def _batch_phrase(opts: TrainOptions) -> str:
    """The batch each rank trains on, in the banner: with sequence parallelism, each sequence
    group of S ranks shares one batch of windows, and each rank holds T/S positions of it."""
    groups, = data_layout(opts, 0)[1:]
    size = opts.world_size // groups
    if size == 1:
        return f"batch {opts.batch_size}x{opts.seq_len} tokens per rank"
    return (f"batch {opts.batch_size}x{opts.seq_len} tokens per sequence group ({groups} data x {size} sequence ranks, "
            f"{opts.batch_size}x{opts.seq_len // size} positions per rank)")


def _config_micro_batch(opts: TrainOptions) -> tuple[int, str] | None:
    """The micro-batch per rank the config states or implies, and where it comes from, after
    checking DeepSpeed's rule train_batch_size = train_micro_batch_size_per_gpu x
    gradient_accumulation_steps x world size. With only train_batch_size, the micro-batch is what
    the rule leaves, as DeepSpeed derives it; with neither, None."""
    if opts.config is None:
        return None
    cfg = _engine_config(opts)
    total, micro = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu
    accumulate, world = cfg.gradient_accumulation_steps, data_layout(opts, 0)[1]  # ranks of a sequence group share a batch
    if total is None:
        return None if micro is None else (micro, f"train_micro_batch_size_per_gpu={micro}")
    if micro is not None:
        if total != micro * accumulate * world:
            raise UsageError(
                f"the config's train_batch_size={total} is not train_micro_batch_size_per_gpu={micro} x "
                f"gradient_accumulation_steps={accumulate} x world size {world} = {micro * accumulate * world} "
                "(DeepSpeed's rule); change one of them"
            )
        return micro, f"train_micro_batch_size_per_gpu={micro}"
    if total % (accumulate * world):
        raise UsageError(
            f"the config's train_batch_size={total} is not divisible by gradient_accumulation_steps={accumulate} x "
            f"world size {world}, so no micro-batch per rank fits DeepSpeed's rule; change one of them"
        )
    micro = total // (accumulate * world)
    return micro, f"train_batch_size={total} / (gradient_accumulation_steps={accumulate} x world size {world}) = {micro}"


def check_train_options(opts: TrainOptions) -> TrainOptions:
    """Validate in the parent, before any process starts; return the options with stage, batch
    size and genome resolved. Raises ``ZeroFXError`` subclasses naming the bad value."""
    opts = _check_model_and_objective(opts)
    check_stage(opts.stage)
    if opts.schedule_steps is not None:
        check_positive("--schedule-steps", opts.schedule_steps)
    if opts.collective_timeout_s is not None and not (
            isinstance(opts.collective_timeout_s, (int, float)) and math.isfinite(opts.collective_timeout_s) and opts.collective_timeout_s > 0):
        raise UsageError(f"--collective-timeout {opts.collective_timeout_s} is invalid; accepted: a finite number of seconds > 0")
    if not (isinstance(opts.lr, (int, float)) and math.isfinite(opts.lr) and opts.lr >= 0):
        raise UsageError(f"--lr {opts.lr} is invalid; accepted: a finite number >= 0")
    # NOTE [Options are parsed once] (zerofx/config/__init__.py): the run's one parse; the ranks get the result.
    opts = replace(opts, engine_config=_parse_run_config(opts))
    if opts.world_size is None:  # the config may state it (a sequence-parallel example needs its 4 ranks)
        opts = replace(opts, world_size=opts.engine_config.config_world_size or 2)
    for name, value in (("--world-size", opts.world_size), ("--steps", opts.steps)):
        check_positive(name, value)
    if opts.batch_size is not None:
        check_positive("--batch-size", opts.batch_size)
    from_config = _config_micro_batch(opts)
    if opts.batch_size is None:
        opts = replace(opts, batch_size=DEFAULT_TRAIN_BATCH if from_config is None else from_config[0])
    elif from_config is not None and opts.batch_size != from_config[0]:
        # An error, not an override: the config's train_batch_size (and the lr tuned for it) assume its micro-batch.
        raise UsageError(
            f"--batch-size {opts.batch_size} disagrees with the config's micro-batch per rank, {from_config[1]}; "
            "leave out --batch-size or make them equal"
        )
    max_seq_len = None if is_model_spec(opts.model) else model_config(opts.model).max_seq_len
    if opts.seq_len < 2 or (max_seq_len is not None and opts.seq_len > max_seq_len):
        accepted = "an integer >= 2" if max_seq_len is None else f"2..{max_seq_len}"
        raise UsageError(f"--seq-len {opts.seq_len} is invalid for model {opts.model}; accepted: {accepted}")
    sequence = _engine_config(opts).sequence_parallel
    if sequence is not None and opts.seq_len % sequence.size:  # else each rank fails at capture, after spawning
        raise UsageError(f"--seq-len {opts.seq_len} is not divisible by the config's zerofx.sequence_parallel.size={sequence.size} "
                         f"(each of its ranks holds seq_len / size positions); accepted: a multiple of {sequence.size}, "
                         f"e.g. {opts.seq_len - opts.seq_len % sequence.size or sequence.size}")
    if not 0 <= opts.seed <= MAX_SEED:
        raise UsageError(f"--seed {opts.seed} is invalid; accepted: an integer in 0..{MAX_SEED}")
    if opts.save_every is not None:
        check_positive("--save-every", opts.save_every)
        if opts.output_dir is None:
            raise UsageError("--save-every needs --output-dir, the directory the checkpoints go to")
    if opts.keep_last is not None:
        check_positive("--keep-last", opts.keep_last)
        if opts.output_dir is None:
            raise UsageError("--keep-last needs --output-dir, the directory the checkpoints go to")
    if opts.output_dir is not None:
        check_output_dir(Path(opts.output_dir))
    stage = opts.stage
    cfg = _engine_config(opts)
    auto = cfg.auto is not None  # zerofx.auto chooses the stage at initialize
    if stage is None and not auto:
        stage = DEFAULT_TRAIN_STAGE if cfg.stage is None else cfg.stage
    if opts.data is not None and opts.fasta is not None:
        raise UsageError("--fasta and --data were both given; accepted: one of them (--data is a prepared --fasta)")
    if not (0 <= opts.max_n_fraction <= 1):
        raise UsageError(f"--max-n-fraction {opts.max_n_fraction} is invalid; accepted: a number in 0..1")
    fasta = None if opts.data is not None else bundled_genome() if opts.fasta is None else Path(opts.fasta)
    # Prepared once (the cache's entry, or --data checked against its sources), then one window
    # drawn: the regions and the window length are checked before any process starts.
    data = resolve_data(fasta, opts.data)
    check_data(opts, data, train_tokenizer(opts))
    if is_model_spec(opts.model):  # last: it runs the user's code and builds the model
        check_vocabulary(load_spec_model(opts.model), opts)
    # The stage resolved, and checked against the config's (resolve: present unless the search chooses it).
    cfg = cfg.for_run(stage=stage, world_size=opts.world_size) if auto else resolve(cfg, stage=stage, world_size=opts.world_size)
    return replace(opts, stage=stage, fasta=fasta, data=data, engine_config=cfg)


def check_output_dir(path: Path) -> None:
    """Create ``path`` (and its parents) and check that it takes a new file, before any rank
    starts; ``UsageError`` naming it otherwise."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"--output-dir {str(path)!r} is a file; accepted: a directory (created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe_writable(path)
    except OSError as exc:
        raise UsageError(f"--output-dir {str(path)!r} cannot be created or written ({exc.strerror}: {exc.filename}); "
                         "accepted: a directory you can write, created if missing") from None


def is_model_spec(model: str) -> bool:
    """True for FILE.py:CALLABLE / MODULE:CALLABLE, False for a bundled size name."""
    return ":" in model


def _check_model_and_objective(opts: TrainOptions) -> TrainOptions:
    """The checks of --model, --objective and --kmer that need no model built; the options with
    ``objective`` as an ``Objective``."""
    try:
        objective = Objective(opts.objective)
    except ValueError:
        raise UsageError(f"--objective {opts.objective!r} is invalid; accepted: {', '.join(o.value for o in Objective)}") from None
    if opts.kmer is not None and (isinstance(opts.kmer, bool) or not isinstance(opts.kmer, int) or not 1 <= opts.kmer <= MAX_KMER):
        raise UsageError(f"--kmer {opts.kmer!r} is invalid; accepted: an integer in 1..{MAX_KMER} (the Nucleotide Transformer uses 6)")
    if not is_model_spec(opts.model):
        causal = model_config(opts.model).is_causal
        if objective is Objective.MLM and causal:
            raise UsageError(
                f"--objective mlm needs a bidirectional model with a masked-LM head; the bundled {opts.model} is a causal "
                "decoder. Pass a bimamba size or --model FILE.py:CALLABLE, e.g. examples/own_models.py:esm_mlm (docs/training.md)"
            )
        if objective is Objective.CLM and not causal:
            raise UsageError(
                f"the bundled {opts.model} is bidirectional: every position sees the token it would predict under "
                "--objective clm; train it with --objective mlm (docs/models.md)"
            )
    return replace(opts, objective=objective)


def train_tokenizer(opts: TrainOptions) -> KmerTokenizer | None:
    """The Nucleotide Transformer's k-mer tokenizer when --kmer is given or the objective is mlm
    (k = --kmer, else 1); None for the bundled 5-token vocabulary (A C G T N), clm's default.
    The bundled vocabulary has no <mask>, and existing runs and checkpoints use it."""
    if opts.kmer is None and Objective(opts.objective) is Objective.CLM:
        return None
    return KmerTokenizer(1 if opts.kmer is None else opts.kmer)


def vocabulary_size(opts: TrainOptions) -> int:
    tokenizer = train_tokenizer(opts)
    return len(DNA_VOCAB) if tokenizer is None else tokenizer.vocab_size


def describe_vocabulary(opts: TrainOptions) -> str:
    """One phrase for the run's first line, e.g. "6-mers in the Nucleotide Transformer's vocabulary (4,107 ids)"."""
    tokenizer = train_tokenizer(opts)
    if tokenizer is None:
        return f"single bases ({' '.join(DNA_VOCAB)}, {len(DNA_VOCAB)} ids)"
    return f"{tokenizer.k}-mers in the Nucleotide Transformer's vocabulary ({tokenizer.vocab_size:,} ids)"


def load_spec_model(spec: str) -> nn.Module:
    """The model of a model spec (``zerofx.app.model_spec.load_model_spec``; its example inputs are
    not used: training captures on its first real batch)."""
    from zerofx.app.model_spec import load_model_spec  # sympy and the planner's imports, for specs only

    return load_model_spec(spec).model


def input_embedding_rows(model: nn.Module) -> int | None:
    """Rows of the model's token embedding: Hugging Face's ``get_input_embeddings()``, else the
    first ``nn.Embedding`` in ``named_modules`` order; None when it has none."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        embedding = get() if callable(get) else None
    except NotImplementedError:  # transformers' default for models without one
        embedding = None
    if not isinstance(embedding, nn.Embedding):
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return None if embedding is None else embedding.num_embeddings


def check_vocabulary(model: nn.Module, opts: TrainOptions) -> None:
    """``UsageError`` when the model's token embedding has fewer rows than the run's vocabulary:
    an id past its end would fail inside the first step (or read garbage on a GPU)."""
    rows, needed = input_embedding_rows(model), vocabulary_size(opts)
    if rows is not None and rows < needed:
        raise UsageError(
            f"model {opts.model}: its input embedding has {rows:,} rows, but the run's vocabulary, "
            f"{describe_vocabulary(opts)}, has ids up to {needed - 1:,}; build the model with vocab_size >= {needed:,} "
            "(docs/training.md, the vocabulary)"
        )


def build_model(opts: TrainOptions, device: torch.device) -> nn.Module:
    """This rank's model: a bundled size with the run's vocabulary size, or the spec's model.
    A model built on the meta device stays there (``initialize`` materializes it from the seed);
    any other moves to ``device``."""
    if is_model_spec(opts.model):
        model = load_spec_model(opts.model)
        check_vocabulary(model, opts)
    else:
        model = build_bundled_model(opts.model, vocab_size=vocabulary_size(opts))
    on_meta = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
    return model if on_meta else model.to(device)


def _objective_batches(opts: TrainOptions, rank: int, batches: Iterator[torch.Tensor], split: str,
                       starts: Iterator[int] | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(inputs, labels)`` per batch of token ids: the ids twice for clm, masked ids and their
    labels for mlm (NOTE [Masking is a function of the seed, the rank and the batch] in
    ``zerofx.data.mlm``): with ``starts`` (each batch's first sample index), each window by its
    sample's seed; else each batch by (seed, rank, split, batch index)."""
    if Objective(opts.objective) is Objective.CLM:
        for batch in batches:
            yield batch, batch
        return
    tokenizer = train_tokenizer(opts)
    assert tokenizer is not None
    masking = MlmMasking(mask_id=tokenizer.mask_id, random_ids=tokenizer.sequence_ids)
    if starts is not None:
        for first, batch in zip(starts, batches):
            yield mask_samples(batch, masking, seed=opts.seed, first_sample=first, split=split)
        return
    for index, batch in enumerate(batches):
        yield mask_tokens(batch, masking, seed=mask_seed(opts.seed, rank, index, split=split))


def _cycle_batches(opts: TrainOptions, rank: int, first_sample: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's ``(inputs, labels)`` batches forever, drawn from the whole genome
    (``zerofx.app.train_data``). The n-th batch is a function of the seed, ``first_sample`` and
    the data layout, so a resumed run starts at its samples consumed and goes on with the
    uninterrupted run's data, at any world size, without reading what came before."""
    rank, data_groups = data_layout(opts, rank)
    assert opts.data is not None and opts.batch_size is not None
    draw = sampler(opts, opts.data, "train", train_tokenizer(opts))
    layout = {"first": first_sample, "group": rank, "groups": data_groups, "batch_size": opts.batch_size}
    return _objective_batches(opts, rank, sample_batches(draw, **layout), "train", starts=batch_starts(**layout))


def _collective_counts(gm: torch.fx.GraphModule) -> dict[str, int]:
    """How many of each collective, and of their waits, a graph issues."""
    nodes = list(gm.graph.nodes)
    counts = {what: sum(1 for n in nodes if is_kind(n)) for what, is_kind in
              (("all-gathers", is_all_gather), ("reduce-scatters", is_reduce_scatter), ("all-reduces", is_all_reduce),
               ("all-to-alls", is_all_to_all), ("waits", is_wait))}
    if not counts["all-to-alls"]:  # sequence parallelism's only
        del counts["all-to-alls"]
    return counts


def _print_graph(engine: Engine, *, code: bool) -> None:
    """Rank ``engine.rank``'s collectives per graph; with ``code``, each graph's Python as well."""
    modules = engine.graph_modules()
    print(f"rank {engine.rank} graphs at ZeRO stage {int(engine.stage)} (collectives per graph; --print-graph-code prints the code):")
    for name, gm in modules.items():
        counts = ", ".join(f"{count} {what}" for what, count in _collective_counts(gm).items())
        print(f"  {name:<10} {len(gm.graph.nodes):>5} nodes: {counts}")
    if code:
        for name, gm in modules.items():
            print(f"# rank {engine.rank} ZeRO stage {int(engine.stage)} {name} graph")
            print(gm.code.strip())
    sys.stdout.flush()


def _print_setup(engine: Engine, opts: TrainOptions) -> None:
    """Rank 0's lines before the first step: each setup phase with its time (``engine.setup_times``),
    then where the log and the checkpoints go."""
    program, times = engine.program, engine.setup_times
    assert program is not None
    plan, modules = program.plan, engine.graph_modules()
    ops = ", ".join(f"{name} {len(gm.graph.nodes):,}" for name, gm in modules.items())
    # What the stage shards of each parameter tensor: nothing at stage 0, its optimizer state at 1, with its gradient at 2, all at 3.
    held = ("parameter tensors, each replicated on", "parameter tensors with their optimizer states sharded over",
            "parameter tensors with their gradients and optimizer states sharded over", "parameter tensors sharded over")[int(plan.stage)]
    plan_line = (f"{len(plan.params)} {held} {plan.world_size} ranks; {len(plan.gather_buckets)} gather, "
                 f"{len(plan.reduce_buckets)} reduce buckets; prefetch {plan.prefetch_distance} ahead")
    if "cache" in times:  # loaded from the plan cache (zerofx.compiler.plan_cache): nothing captured or lowered
        phases = {"cache": f"this rank's lowered graphs (nodes: {ops}) from {program.cache_entry}; {plan_line}"}
    else:
        phases = {
            "capture": f"the joint forward+backward ATen graph, {len(program.captured.joint.graph.nodes):,} nodes, traced on fake tensors",
            "plan": plan_line,
            "lower": f"rewrite passes and the split into this rank's graphs (nodes: {ops})",
        }
    for phase, what in phases.items():
        print(f"{phase:<11} {times.get(phase, 0.0):6.2f} s  {what}")
    if opts.output_dir is None:
        print("no --output-dir: no train_log.jsonl and no checkpoints")
    else:
        out = Path(opts.output_dir)
        when = f"every {opts.save_every} steps and after step {opts.steps}" if opts.save_every else f"after step {opts.steps}"
        keep = f", keeping the newest {opts.keep_last}" if opts.keep_last else ""
        print(f"{'log':<11} {out / 'train_log.jsonl'} (one JSON object per step, then the eval)")
        print(f"{'checkpoints':<11} {out}/step-NNNNNNNN, {when}{keep}; the same command again resumes from the newest")
    sys.stdout.flush()


def _schedule_end_warning(engine: Engine, steps: int) -> str | None:
    """A warning when ``--steps`` goes past the scheduler's ``total_num_steps``, naming both."""
    schedule = engine.cfg.scheduler
    total = None if schedule is None else schedule.total_num_steps
    if schedule is None or total is None or steps <= total:
        return None
    final = lr_at(schedule, total, float(engine.cfg.optimizer.resolved_params()["lr"]))
    return f"warning: --steps {steps} is past the scheduler's total_num_steps {total}: lr stays at its final value {final:.3g} after step {total}"


def _finished_message(opts: TrainOptions) -> str | None:
    """What to change when ``opts.output_dir``'s newest complete checkpoint is already at
    ``--steps`` or beyond (nothing to train); None otherwise. Read before any rank starts."""
    if opts.output_dir is None:
        return None
    tag = latest_complete_tag(opts.output_dir)
    if tag is None:
        return None
    return _finished_line(opts, int(read_metadata(opts.output_dir, tag)["step"]))


def _finished_line(opts: TrainOptions, step: int) -> str | None:
    if step < opts.steps:
        return None
    where = "=" if step == opts.steps else "past"
    more = step + opts.steps
    schedule = _engine_config(opts).scheduler
    total = None if schedule is None else schedule.total_num_steps
    if total is not None and more > total:  # past its end the lr stays at its final value: the hint raises it
        return (f"{opts.output_dir} is at step {step} {where} --steps {opts.steps}: nothing to train. Pass --steps {more} "
                f"--schedule-steps {more} to train {opts.steps} more with the scheduler's decay stretched over all {more} steps "
                f"(the learning rate rises from its final value to the one the longer schedule has at step {step + 1}), or a new "
                "--output-dir to start over")
    return (f"{opts.output_dir} is at step {step} {where} --steps {opts.steps}: nothing to train. Pass --steps {more} "
            f"to train {opts.steps} more, or a new --output-dir to start over")


def _resume(engine: Engine, opts: TrainOptions, rank: int) -> tuple[int, int]:
    """Load the newest complete checkpoint in ``opts.output_dir``, if there is one; return the
    training step it was saved after and how many samples the run had consumed."""
    assert opts.output_dir is not None
    tag = latest_complete_tag(opts.output_dir)
    if tag is None:
        return 0, 0
    meta = read_metadata(opts.output_dir, tag)
    client = engine.load_checkpoint(opts.output_dir, tag)
    # A checkpoint saved outside ``zerofx train`` has no data position: count one batch per step.
    step = int(client.get("step", engine.global_steps))
    if rank == 0:
        print(
            f"resuming from checkpoint {Path(opts.output_dir) / tag}: step {step}, saved at "
            f"{describe_layout(saved_layout(meta))} and ZeRO stage {meta['stage']}",
            flush=True,
        )
        note = data_order_note(meta, opts)
        if note is not None:
            print(note, flush=True)
    if "samples_consumed" in client:
        return step, int(client["samples_consumed"])
    # Saved without it: batches_consumed of the checkpoint's own data layout.
    return step, int(client.get("batches_consumed", step)) * opts.batch_size * saved_layout(meta)["data_parallel_size"]


def data_order_note(meta: Mapping[str, Any], opts: TrainOptions) -> str | None:
    """How a resume from checkpoint ``meta`` groups its samples otherwise than the uninterrupted
    run, or None. Samples go on in the uninterrupted run's order (NOTE [A window is a function of
    its index] in zerofx/data/sampling.py; the ranks of a sequence group share them), and a step
    takes batch size x data groups of them, so the steps hold the same samples exactly when the
    number of data groups is the same (NOTE [Checkpoints across rank layouts] in zerofx/runtime/checkpoint.py)."""
    saved = saved_layout(meta)
    groups = data_layout(opts, 0)[1]
    if saved["data_parallel_size"] == groups:
        return None
    plural = "s" if groups != 1 else ""
    return (f"note: the genome's windows are now split over {groups} data-parallel group{plural} (world size {opts.world_size}); "
            f"the windows go on in the uninterrupted run's order, {groups * opts.batch_size} a micro-step instead of "
            f"{saved['data_parallel_size'] * opts.batch_size} in the checkpoint's layout, {describe_layout(saved)}")


_OBJECTIVE_PHRASES = {Objective.CLM: "next-token prediction (clm)", Objective.MLM: "masked-token prediction (mlm, 15% masked, 80/10/10)"}


def _train_rank(rank: int, opts: TrainOptions, channel: RankChannel | None = None) -> None:
    """One rank's training loop; runs inside an initialized process group. ``channel`` (local
    ranks) tells the launcher the last step every rank completed."""
    world_size = dist.get_world_size()
    torch.manual_seed(opts.seed)
    device = _device()
    model = build_model(opts, device)
    first = tuple(t.to(device) for t in next(_cycle_batches(opts, rank)))  # (inputs, labels), each (B, T): the capture's example
    engine = initialize(
        model, config=_engine_config(opts), example_inputs=(first[0],), example_kwargs={"labels": first[1]},
        # A materialized model took its values from torch.manual_seed(opts.seed) above; init_seed is for a meta-built one.
        init_seed=opts.seed if any(t.is_meta for t in model.parameters()) else 0,
    )
    if rank == 0:
        print(
            f"training {opts.model} ({engine.program.plan.num_params:,} parameters) at ZeRO stage {int(engine.stage)} on "
            f"{world_size} {dist.get_backend()} ranks: {_OBJECTIVE_PHRASES[Objective(opts.objective)]} on genome "
            f"{_genome_name(opts)}, {_batch_phrase(opts)}, {describe_vocabulary(opts)}",
            flush=True,
        )
        _print_setup(engine, opts)
        if opts.print_graph or opts.print_graph_code:
            _print_graph(engine, code=opts.print_graph_code)
    start, consumed = _resume(engine, opts, rank) if opts.output_dir is not None else (0, 0)
    # The data position: the samples the checkpointed steps consumed, skipped in O(1).
    stream = ((x.to(device), y.to(device)) for x, y in _cycle_batches(opts, rank, consumed))
    if channel is not None and rank == 0:
        channel.record_step(start)
    finished = _finished_line(opts, start)
    if finished is not None:  # train() checks before starting ranks; a checkpoint saved since lands here
        if rank == 0:
            print(finished, flush=True)
        return
    warning = _schedule_end_warning(engine, opts.steps)
    if warning is not None and rank == 0:
        print(warning, flush=True)
    log = _JsonlLog(Path(opts.output_dir) / "train_log.jsonl" if opts.output_dir is not None and rank == 0 else None)
    log.drop_after(start)  # steps a stopped run logged past its newest checkpoint are trained again now
    tokens_per_step = opts.batch_size * opts.seq_len * data_layout(opts, rank)[1]
    bar = tqdm(total=opts.steps, initial=start, desc="train", unit="step", disable=rank != 0 or not sys.stderr.isatty())
    accumulate = engine.gradient_accumulation_steps  # micro-batches per optimizer step
    tokens_per_step *= accumulate
    samples_per_step = accumulate * opts.batch_size * data_layout(opts, rank)[1]  # windows all ranks take per optimizer step
    # The warning above said it once, with the flag's name; the engine's own would repeat it per rank.
    warnings.filterwarnings("ignore", category=ScheduleEndWarning)
    for step in range(start + 1, opts.steps + 1):
        t0 = time.perf_counter()
        micro_losses = []
        for _ in range(accumulate):
            inputs, labels = next(stream)
            loss = engine(inputs, labels=labels)
            engine.backward(loss)
            engine.step()  # steps the optimizer at the accumulation boundary only
            micro_losses.append(loss.detach().float())
        elapsed = time.perf_counter() - t0
        # The loss, and whether any rank was asked to stop (NOTE [Ctrl-C stops every rank at one step]).
        reduced = torch.stack([torch.stack(micro_losses).mean(), torch.tensor(float(stop_requested()))])
        try:
            dist.all_reduce(reduced)  # every rank must join the collective, not only the printer
        except RuntimeError as exc:
            if not rank_agreement.is_comm_failure(exc):
                raise
            raise rank_agreement.comm_failure(rank, engine.collective_timeout_s, f"the all-reduce of step {step}'s loss", exc) from exc
        mean, stop = reduced[0].item() / world_size, reduced[1].item() > 0
        state_bytes = sum(engine.memory().values())
        if rank == 0:
            rss = peak_rss_bytes()
            bar.set_postfix(loss=f"{mean:.4f}", tok_s=f"{tokens_per_step / elapsed:,.0f}", state=format_bytes(state_bytes), rss=format_bytes(rss))
            bar.update(1)
            bar.write(f"step {step}/{opts.steps} loss {mean:.4f} ({elapsed:.3f} s/step, {tokens_per_step / elapsed:,.0f} tokens/s)")
            log.write(step=step, loss=mean, lr=engine.optimizer.param_groups[0]["lr"], step_s=elapsed,
                      tokens_per_s=tokens_per_step / elapsed, model_state_bytes_per_rank=state_bytes, peak_rss_bytes=rss)
        if opts.output_dir is not None and (step == opts.steps or (opts.save_every and step % opts.save_every == 0)):
            tag = f"step-{step:08d}"
            engine.save_checkpoint(opts.output_dir, tag, client_state={"step": step, "samples_consumed": consumed + (step - start) * samples_per_step},
                                   keep_last=opts.keep_last)
            if rank == 0:
                bar.write(f"saved checkpoint {Path(opts.output_dir) / tag}")
        if channel is not None and rank == 0:
            channel.record_step(step)
        if stop:
            bar.close()
            return
    bar.close()
    _evaluate(engine, opts, rank, log)


class _JsonlLog:
    """One JSON object per line (rank 0 only): appended and flushed as training goes, so a crash
    loses nothing already logged."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def drop_after(self, step: int) -> None:
        """Keep the records before the first one past ``step`` (and before a line a crash cut
        short); replaces the file at once, so a crash now leaves the old or the new one."""
        if self.path is None or not self.path.exists():
            return
        kept = []
        for line in self.path.read_text().splitlines(keepends=True):
            try:
                record = json.loads(line)
            except ValueError:
                break
            if not line.endswith("\n") or record.get("step", -1) > step:
                break
            kept.append(line)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.path)

    def write(self, **record: Any) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps({"time": time.time(), **record}) + "\n")


def _genome_name(opts: TrainOptions) -> str:
    """The run's FASTA file names, from the prepared index (several for a manifest's sources)."""
    assert opts.data is not None
    return ", ".join(Path(s["path"]).name for s in open_prepared(opts.data).sources)


def _genome_summary(opts: TrainOptions) -> str:
    """The genome's line (a line per source), from the prepared index: no pass over the genome."""
    assert opts.data is not None
    return "\n".join(open_prepared(opts.data).summaries())


def _evaluate(engine: Engine, opts: TrainOptions, rank: int, log: _JsonlLog) -> None:
    """Perplexity on windows drawn across the held-out regions (NOTE [Held-out regions] in
    zerofx/data/sampling.py, never trained on); for mlm, on the masked tokens of those windows,
    masked with their own seeds."""
    assert opts.data is not None and opts.batch_size is not None
    total, count = torch.zeros(2), 0
    data_rank, data_groups = data_layout(opts, rank)
    try:
        draw = sampler(opts, opts.data, "eval", train_tokenizer(opts))
        layout = {"first": 0, "group": data_rank, "groups": data_groups, "batch_size": opts.batch_size}
        batches = _objective_batches(opts, data_rank, sample_batches(draw, **layout), "eval", starts=batch_starts(**layout))
        for inputs, labels in itertools.islice(batches, opts.eval_batches):
            total[0] += engine(inputs.to(engine.device), labels=labels.to(engine.device)).detach().float().item()
            count += 1
    except ZeroFXError:  # no held-out region holds a window: nothing to evaluate
        count = 0
    total[1] = count
    dist.all_reduce(total)
    if total[1] == 0:
        if rank == 0:
            print("eval: no held-out region holds a whole window; skipped", flush=True)
        return
    loss = (total[0] / total[1]).item()
    if rank == 0:
        tokens = "masked tokens of held-out windows" if Objective(opts.objective) is Objective.MLM else "held-out windows"
        print(f"eval on {tokens} ({int(total[1])} batches over {opts.world_size} ranks): loss {loss:.4f}, "
              f"perplexity {math.exp(loss):.3f}, {loss / math.log(2):.3f} bits per token", flush=True)
        log.write(eval_loss=loss, eval_perplexity=math.exp(loss), eval_batches=int(total[1]))


def _train_worker(rank: int, opts: TrainOptions, port: int, channel: RankChannel) -> None:
    """Entry point of one spawned rank: join the gloo group, train, report a user error in one
    line and a failed collective to the launcher, which names the stalled rank."""
    install_stop_handler()  # NOTE [Ctrl-C stops every rank at one step]
    # A thread lock for the progress bar, not tqdm's default multiprocessing one: the semaphore of
    # a rank the launcher had to kill would be reported leaked when the launcher exits.
    tqdm.set_lock(threading.RLock())
    faulthandler.enable()  # a rank killed by a signal prints every thread's Python stack to stderr
    # Ranks share this machine's cores; more threads than cores per rank slows every rank down.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // opts.world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=opts.world_size,
                            timeout=_collective_timeout(opts))
    try:
        try:
            _train_rank(rank, opts, channel)
        except RuntimeError as exc:  # one outside the graphs and the loss (a checkpoint's, initialize's): named where it ran
            if isinstance(exc, ZeroFXError) or not rank_agreement.is_comm_failure(exc):
                raise
            raise rank_agreement.comm_failure(rank, _collective_timeout(opts).total_seconds(), _zerofx_frame(exc), exc) from exc
    except CollectiveTimeoutError as exc:
        channel.report_comm_failure(rank, exc)
        # The peer may never answer again: the group's teardown and the interpreter's exit would wait on it.
        os._exit(COMM_FAILURE_EXIT_CODE)
    except ZeroFXError as exc:
        print(f"zerofx: error: rank {rank}: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)  # SystemExit passes through mp.spawn's wrapper as this exit code
    finally:
        dist.destroy_process_group()


def _zerofx_frame(exc: BaseException) -> str:
    """Where in zerofx ``exc`` was raised: the innermost zerofx function, its file and line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f"{os.sep}zerofx{os.sep}" in f.filename]
    if not frames:
        return "a collective"
    return f"a collective in {frames[-1].name} ({Path(frames[-1].filename).name}:{frames[-1].lineno})"


def _device() -> torch.device:
    """CUDA (this process's local GPU) when there is one, else the CPU: the same code runs NCCL or gloo."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def under_torchrun() -> bool:
    """True inside a process torchrun (torch.distributed.run) started: it sets these variables."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"))


def _train_under_torchrun(opts: TrainOptions) -> None:
    """torchrun is the launcher (single- or multi-node): join its process group and train this rank."""
    world_size = int(os.environ["WORLD_SIZE"])
    opts = check_train_options(replace(opts, world_size=world_size))
    finished = _finished_message(opts)
    if finished is not None:  # every rank reads the same checkpoint, so every rank stops here
        if int(os.environ["RANK"]) == 0:
            print(finished, flush=True)
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(_device())
    if int(os.environ["RANK"]) == 0:
        print(_genome_summary(opts), flush=True)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=_collective_timeout(opts))
    try:
        _train_rank(dist.get_rank(), opts)
    finally:
        dist.destroy_process_group()


def train(opts: TrainOptions) -> None:
    """Train ``opts.model`` on ``opts.world_size`` local gloo (CPU) ranks; rank 0 prints each
    step's loss averaged over ranks. Raises ``ZeroFXError`` for bad options before starting any
    process, and ``RankFailedError`` when a rank fails (its traceback printed to stderr).

    Under torchrun (``torchrun --nproc-per-node N -m zerofx.app.cli train ...``), this process is
    one rank of torchrun's job instead, on one or many nodes, and ``--world-size`` is torchrun's.
    """
    if under_torchrun():
        _train_under_torchrun(opts)
        return
    opts = check_train_options(opts)
    finished = _finished_message(opts)
    if finished is not None:  # before any rank starts: nothing to set up for
        print(finished, flush=True)
        return
    print(_genome_summary(opts), flush=True)
    launch_ranks(_train_worker, (opts, _free_port()), nprocs=opts.world_size, on_interrupt=lambda step: stopped_message(opts, step))


def stopped_message(opts: TrainOptions, step: int) -> str:
    """What ``zerofx train`` prints after Ctrl-C: the last step every rank completed (-1: none
    started), the newest complete checkpoint and how to resume."""
    at = "before the first step" if step < 0 else f"at step {step} of {opts.steps}"
    if opts.output_dir is None:
        return f"stopped {at} by Ctrl-C; no --output-dir, so nothing was saved"
    tag = latest_complete_tag(opts.output_dir)
    if tag is None:
        return f"stopped {at} by Ctrl-C; no complete checkpoint in {opts.output_dir} yet: the same command starts over"
    return (f"stopped {at} by Ctrl-C; the newest complete checkpoint is {Path(opts.output_dir) / tag}: "
            "run the same command again to resume from it")
