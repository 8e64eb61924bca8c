"""The training app behind ``zerofx train``: options, checks, the per-rank loop and the launchers.

    train(TrainOptions(model="tiny", world_size=2, stage=3, steps=20))

``train`` checks the options in the calling process, before any process starts, then spawns
``world_size`` local gloo ranks (or, under torchrun, runs as one of torchrun's ranks). Each rank
builds the DNA LM, initializes a zerofx ``Engine`` from its first batch, resumes from the newest
complete checkpoint in ``output_dir`` if there is one, trains, saves, and evaluates on the
held-out slice of the genome. Rank 0 prints each step's loss averaged over ranks and appends it
to ``output_dir/train_log.jsonl``.

Errors: ``UsageError`` (a ``ZeroFXError``) for bad options, naming the ``zerofx train`` flag;
``RankFailedError`` when a spawned rank fails. ``zerofx.cli`` turns both into exit codes.
"""

from __future__ import annotations

import faulthandler
import itertools
import json
import math
import os
import socket
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

from zerofx.passes.meta import is_all_gather
from zerofx.passes.plan import format_bytes
from zerofx.checkpoint import latest_complete_tag, read_metadata
from zerofx.config import load_config, parse_config
from zerofx.data.genome import bundled_genome, genome_stats, genome_windows
from zerofx.engine import Engine, initialize
from zerofx.errors import UsageError, ZeroFXError, did_you_mean
from zerofx.models import DNA_LM_SIZES, DNADecoderLM, DNALMConfig
from zerofx.program import resolve
from zerofx.rss import peak_rss_bytes

DEFAULT_TRAIN_STAGE = 3
DEFAULT_TRAIN_BATCH = 2
# torch.manual_seed takes a 64-bit unsigned seed.
MAX_SEED = 2**64 - 1


class RankFailedError(RuntimeError):
    """A training rank exited with an error; ``exit_code`` is what the CLI returns."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def model_config(name: str) -> DNALMConfig:
    """The DNA LM config for a size name; ``UsageError`` naming the accepted sizes otherwise."""
    if name not in DNA_LM_SIZES:
        raise UsageError(
            f"unknown model size {name!r}{did_you_mean(name, DNA_LM_SIZES)}; accepted: {', '.join(DNA_LM_SIZES)}"
        )
    return DNA_LM_SIZES[name]


def check_positive(name: str, value: int) -> int:
    if value < 1:
        raise UsageError(f"{name} {value} is invalid; accepted: an integer >= 1")
    return value


def check_stage(stage: int | None) -> int | None:
    if stage is not None and stage not in (0, 1, 2, 3):
        raise UsageError(f"--stage {stage} is not a ZeRO stage; accepted: 0, 1, 2 or 3")
    return stage


@dataclass(frozen=True)
class TrainOptions:
    """Everything a training run needs; picklable, so each spawned rank gets a copy."""

    model: str = "tiny"
    fasta: Path | None = None  # None: the bundled lambda phage genome
    world_size: int = 2
    stage: int | None = None  # None: the config's stage, else DEFAULT_TRAIN_STAGE
    config: Path | None = None
    steps: int = 20
    seq_len: int = 128
    batch_size: int | None = None  # None: the config's train_micro_batch_size_per_gpu, else 2
    lr: float = 3e-3
    seed: int = 0
    print_graph: bool = False
    output_dir: Path | None = None  # checkpoints and train_log.jsonl go here; a run resumes from its newest complete one
    eval_batches: int = 8  # held-out batches per rank evaluated after training
    save_every: int | None = None  # None: save only after the last step (when output_dir is set)
    keep_last: int | None = None  # None: keep every checkpoint; K: delete the oldest beyond the newest K
    collective_timeout_s: float | None = None  # None: the config's zerofx.collective_timeout_s (default 300)


def _free_port() -> int:
    """A TCP port free right now on 127.0.0.1, for the gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine_config(opts: TrainOptions) -> str | Path | Mapping[str, Any]:
    raw: dict[str, Any]
    if opts.config is not None:
        if opts.collective_timeout_s is None:
            return opts.config
        raw = load_config(opts.config)
    else:
        raw = {"zero_optimization": {"stage": opts.stage}, "optimizer": {"type": "AdamW", "params": {"lr": opts.lr}}}
    if opts.collective_timeout_s is not None:  # the flag wins over the config, on every rank alike
        raw.setdefault("zerofx", {})["collective_timeout_s"] = opts.collective_timeout_s
    return raw


def _collective_timeout(opts: TrainOptions) -> timedelta:
    """The process group's timeout: --collective-timeout, else the config's (NOTE [The collective timeout])."""
    return timedelta(seconds=parse_config(_engine_config(opts)).collective_timeout_s)


def _config_micro_batch(opts: TrainOptions) -> tuple[int, str] | None:
    """The micro-batch per rank the config states or implies, and where it comes from, after
    checking DeepSpeed's rule train_batch_size = train_micro_batch_size_per_gpu x
    gradient_accumulation_steps x world size. With only train_batch_size, the micro-batch is what
    the rule leaves, as DeepSpeed derives it; with neither, None."""
    if opts.config is None:
        return None
    cfg = parse_config(opts.config)
    total, micro = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu
    accumulate, world = cfg.gradient_accumulation_steps, opts.world_size
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
    cfg = model_config(opts.model)
    check_stage(opts.stage)
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
    if not 2 <= opts.seq_len <= cfg.max_seq_len:
        raise UsageError(f"--seq-len {opts.seq_len} is invalid for model {opts.model}; accepted: 2..{cfg.max_seq_len}")
    if not (isinstance(opts.lr, (int, float)) and math.isfinite(opts.lr) and opts.lr >= 0):
        raise UsageError(f"--lr {opts.lr} is invalid; accepted: a finite number >= 0")
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
    if opts.collective_timeout_s is not None and not (
            isinstance(opts.collective_timeout_s, (int, float)) and math.isfinite(opts.collective_timeout_s) and opts.collective_timeout_s > 0):
        raise UsageError(f"--collective-timeout {opts.collective_timeout_s} is invalid; accepted: a finite number of seconds > 0")
    if opts.output_dir is not None and Path(opts.output_dir).exists() and not Path(opts.output_dir).is_dir():
        raise UsageError(f"--output-dir {str(opts.output_dir)!r} is a file; accepted: a directory (created if missing)")
    stage = opts.stage
    if stage is None:
        file_stage = parse_config(opts.config).stage if opts.config is not None else None
        stage = DEFAULT_TRAIN_STAGE if file_stage is None else file_stage
    fasta = bundled_genome() if opts.fasta is None else Path(opts.fasta)
    # The last rank's first batch needs batch_size whole groups of windows: reading that far
    # (unshuffled, so no buffer fills) checks the file and its length before any process starts.
    next(genome_windows(fasta, opts.seq_len, rank=opts.world_size - 1, world_size=opts.world_size,
                        batch_size=opts.batch_size, shuffle_windows=0))
    opts = replace(opts, stage=stage, fasta=fasta)
    resolve(opts.config, stage=stage, world_size=opts.world_size)  # the config, and that it agrees
    return opts


def _cycle_batches(opts: TrainOptions, rank: int) -> Iterator[torch.Tensor]:
    """This rank's batches forever: each pass over the genome reshuffles with the next seed."""
    epoch = 0
    while True:
        assert opts.fasta is not None
        yield from genome_windows(
            opts.fasta, opts.seq_len, rank=rank, world_size=opts.world_size, batch_size=opts.batch_size,
            seed=opts.seed + epoch, split="train",
        )
        epoch += 1


def _print_graph(engine: Engine) -> None:
    modules = engine.graph_modules()
    print(f"# rank {engine.rank} ZeRO stage {int(engine.stage)} forward graph")
    print(modules["forward"].code.strip())
    counts = {g: sum(1 for n in modules[g].graph.nodes if is_all_gather(n)) for g in ("forward", "backward")}
    print(f"all_gather_into_tensor nodes: forward {counts['forward']}, backward {counts['backward']}", flush=True)


def _resume(engine: Engine, opts: TrainOptions, rank: int) -> tuple[int, int]:
    """Load the newest complete checkpoint in ``opts.output_dir``, if there is one; return the
    training step it was saved after and how many batches this rank's stream had consumed."""
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
            f"resuming from checkpoint {Path(opts.output_dir) / tag}: step {step}, saved at world size "
            f"{meta['world_size']} and ZeRO stage {meta['stage']}",
            flush=True,
        )
        if meta["world_size"] != engine.world_size:
            # Windows are dealt to ranks by world size (NOTE [How windows are assigned to ranks]).
            print(f"note: the genome's windows are now split over {engine.world_size} ranks; the data order differs from "
                  f"an uninterrupted run at world size {meta['world_size']}", flush=True)
    return step, int(client.get("batches_consumed", step))


def _train_rank(rank: int, opts: TrainOptions) -> None:
    """One rank's training loop; runs inside an initialized process group."""
    world_size = dist.get_world_size()
    torch.manual_seed(opts.seed)
    device = _device()
    model = DNADecoderLM(DNA_LM_SIZES[opts.model]).to(device)
    batches = (b.to(device) for b in _cycle_batches(opts, rank))
    first = next(batches)  # (B, T)
    engine = initialize(
        model, config=_engine_config(opts), stage=opts.stage, example_inputs=(first,), example_kwargs={"labels": first}
    )
    if rank == 0:
        print(
            f"training {opts.model} ({engine.program.plan.num_params:,} parameters) at ZeRO stage {opts.stage} on "
            f"{world_size} gloo ranks, batch {opts.batch_size}x{opts.seq_len} per rank, genome {Path(opts.fasta).name}",
            flush=True,
        )
        if opts.print_graph:
            _print_graph(engine)
    stream = itertools.chain([first], batches)
    start, consumed = _resume(engine, opts, rank) if opts.output_dir is not None else (0, 0)
    for _ in range(consumed):  # the data position: skip what the checkpointed steps trained on
        next(stream)
    if start >= opts.steps and rank == 0:
        print(f"the checkpoint is at step {start}: --steps {opts.steps} already reached, nothing to train", flush=True)
    log = _JsonlLog(Path(opts.output_dir) / "train_log.jsonl" if opts.output_dir is not None and rank == 0 else None)
    tokens_per_step = opts.batch_size * opts.seq_len * world_size
    bar = tqdm(total=opts.steps, initial=start, desc="train", unit="step", disable=rank != 0 or not sys.stderr.isatty())
    accumulate = engine.gradient_accumulation_steps  # micro-batches per optimizer step
    tokens_per_step *= accumulate
    for step in range(start + 1, opts.steps + 1):
        t0 = time.perf_counter()
        micro_losses = []
        for _ in range(accumulate):
            batch = next(stream)
            loss = engine(batch, labels=batch)
            engine.backward(loss)
            engine.step()  # steps the optimizer at the accumulation boundary only
            micro_losses.append(loss.detach().float())
        elapsed = time.perf_counter() - t0
        mean_loss = torch.stack(micro_losses).mean()
        dist.all_reduce(mean_loss)  # every rank must join the collective, not only the printer
        mean = mean_loss.item() / world_size
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
            engine.save_checkpoint(opts.output_dir, tag, client_state={"step": step, "batches_consumed": consumed + (step - start) * accumulate},
                                   keep_last=opts.keep_last)
            if rank == 0:
                bar.write(f"saved checkpoint {Path(opts.output_dir) / tag}")
    bar.close()
    _evaluate(engine, opts, rank, log)


class _JsonlLog:
    """One JSON object per line (rank 0 only): appended and flushed as training goes, so a crash
    loses nothing already logged."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, **record: Any) -> None:
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps({"time": time.time(), **record}) + "\n")


def _evaluate(engine: Engine, opts: TrainOptions, rank: int, log: _JsonlLog) -> None:
    """Perplexity on the held-out slice of the genome (every 10th group of windows, never trained on)."""
    assert opts.fasta is not None
    total, count = torch.zeros(2), 0
    try:
        for batch in itertools.islice(genome_windows(opts.fasta, opts.seq_len, rank=rank, world_size=opts.world_size,
                                                     batch_size=opts.batch_size, split="eval", shuffle_windows=0), opts.eval_batches):
            total[0] += engine(batch, labels=batch).detach().float().item()
            count += 1
    except ZeroFXError:  # a genome too short to hold out one batch per rank: nothing to evaluate
        count = 0
    total[1] = count
    dist.all_reduce(total)
    if total[1] == 0:
        if rank == 0:
            print("eval: the held-out slice has no full batch at this world size; skipped", flush=True)
        return
    loss = (total[0] / total[1]).item()
    if rank == 0:
        print(f"eval on held-out windows ({int(total[1])} batches over {opts.world_size} ranks): loss {loss:.4f}, "
              f"perplexity {math.exp(loss):.3f}, {loss / math.log(2):.3f} bits per token", flush=True)
        log.write(eval_loss=loss, eval_perplexity=math.exp(loss), eval_batches=int(total[1]))


def _train_worker(rank: int, opts: TrainOptions, port: int) -> None:
    """Entry point of one spawned rank: join the gloo group, train, report a user error in one line."""
    faulthandler.enable()  # a rank killed by a signal prints every thread's Python stack to stderr
    # Ranks share this machine's cores; more threads than cores per rank slows every rank down.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // opts.world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=opts.world_size,
                            timeout=_collective_timeout(opts))
    try:
        _train_rank(rank, opts)
    except ZeroFXError as exc:
        print(f"zerofx: error: rank {rank}: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)  # SystemExit passes through mp.spawn's wrapper as this exit code
    finally:
        dist.destroy_process_group()


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
    if torch.cuda.is_available():
        torch.cuda.set_device(_device())
    if int(os.environ["RANK"]) == 0:
        print(genome_stats(opts.fasta).summary(), flush=True)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=_collective_timeout(opts))
    try:
        _train_rank(dist.get_rank(), opts)
    finally:
        dist.destroy_process_group()


def train(opts: TrainOptions) -> None:
    """Train ``opts.model`` on ``opts.world_size`` local gloo (CPU) ranks; rank 0 prints each
    step's loss averaged over ranks. Raises ``ZeroFXError`` for bad options before starting any
    process, and ``RankFailedError`` when a rank fails (its traceback printed to stderr).

    Under torchrun (``torchrun --nproc-per-node N -m zerofx.cli train ...``), this process is
    one rank of torchrun's job instead, on one or many nodes, and ``--world-size`` is torchrun's.
    """
    if under_torchrun():
        _train_under_torchrun(opts)
        return
    opts = check_train_options(opts)
    print(genome_stats(opts.fasta).summary(), flush=True)
    try:
        mp.spawn(_train_worker, args=(opts, _free_port()), nprocs=opts.world_size, join=True)
    except mp.ProcessRaisedException as exc:
        print(str(exc).strip(), file=sys.stderr)
        last = str(exc).strip().splitlines()[-1]
        raise RankFailedError(f"rank {exc.error_index} failed: {last}") from None
    except mp.ProcessExitedException as exc:
        raise RankFailedError(
            f"rank {exc.error_index} exited with code {exc.exit_code}", exit_code=2 if exc.exit_code == 2 else 1
        ) from None
