"""Genome-scale data: prepare speed, windows drawn per second per rank, startup and resume, RSS.

    python -m benchmarks.bench_genome_data --mbp 300 --out benchmarks/results/genome_data.json

Writes a synthetic assembly of ``--mbp`` million bases (records of ``--record-mbp`` that start
with 100 kb of N, as assembled chromosomes do, soft-masked lowercase stretches, IUPAC codes, one
record on a single line), gzipped with ``--gzip``; then, each in a fresh process so that
resident memory is its own:

- prepare: ``prepare_genome`` over the file; MB/s of the file read, and peak RSS;
- startup: ``open_prepared``, the training sampler and the first batch, as a rank does before
  its first step; seconds and peak RSS;
- draw: windows per second one rank draws (``--seq-len``, ``--batch-size``), against what a step
  consumes;
- resume: the first batch at a late step (``--resume-step``) at world size 2: seconds.

The table goes to ``OUT.md`` beside ``OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

N_PREFIX = 100_000


def write_assembly(path: Path, mbp: float, record_mbp: float, seed: int = 0) -> int:
    """The synthetic FASTA; returns its size in bytes."""
    rng = random.Random(seed)
    unit = "".join(rng.choice("ACGT") for _ in range(1 << 20))  # 1 MiB of sequence, tiled
    num_records = max(1, round(mbp / record_mbp))
    length = int(record_mbp * 1e6)
    with open(path, "w") as f:
        for r in range(num_records):
            body = (unit * (length // len(unit) + 1))[r * 7919 % len(unit) :][: length - N_PREFIX]
            body = body[:5000] + body[5000:9000].lower() + "RYKM" + body[9004:]
            seq = "N" * N_PREFIX + body
            f.write(f">chr{r} synthetic\n")
            if r == 0:
                f.write(seq + "\n")  # one record on a single line
            else:
                f.write("\n".join(seq[i : i + 60] for i in range(0, len(seq), 60)) + "\n")
    return path.stat().st_size


def _child(stage: str, args: argparse.Namespace) -> dict:
    """Run ``stage`` in a fresh interpreter and return its JSON result."""
    cmd = [sys.executable, "-m", "benchmarks.bench_genome_data", "--stage", stage, "--work", str(args.work),
           "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--resume-step", str(args.resume_step)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _stage(stage: str, args: argparse.Namespace) -> dict:
    from zerofx.common.rss import peak_rss_bytes
    from zerofx.data.prepared import Source, open_prepared, prepare_genome
    from zerofx.data.sampling import WindowSampler, split_regions

    fasta, prepared = args.work / "genome.fa", args.work / "prepared"
    if stage == "prepare":
        t0 = time.perf_counter()
        prepare_genome([Source(fasta)], prepared)
        seconds = time.perf_counter() - t0
        return {"prepare_s": seconds, "prepare_mb_s": fasta.stat().st_size / seconds / 1e6, "prepare_peak_rss": peak_rss_bytes()}
    t0 = time.perf_counter()
    genome = open_prepared(prepared)
    train, _ = split_regions(genome)
    draw = WindowSampler(genome, train, window_bases=args.seq_len, seed=0, split="train")
    first = draw.batch(0, args.batch_size)
    startup = time.perf_counter() - t0
    if stage == "startup":
        n_share = float((first == 4).float().mean())
        return {"startup_s": startup, "startup_peak_rss": peak_rss_bytes(), "first_batch_n_share": n_share}
    if stage == "draw":
        count, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 5:
            draw.batch(count, args.batch_size)
            count += args.batch_size
        return {"windows_per_s": count / (time.perf_counter() - t0), "draw_peak_rss": peak_rss_bytes()}
    assert stage == "resume"
    t0 = time.perf_counter()
    draw.batch(args.resume_step * args.batch_size * 2 + args.batch_size, args.batch_size)  # rank 1 of 2 at the late step
    return {"resume_s": startup + time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mbp", type=float, default=300, help="million bases in the synthetic genome (default: 300)")
    parser.add_argument("--record-mbp", type=float, default=6, help="million bases per record (default: 6)")
    parser.add_argument("--seq-len", type=int, default=1024, help="bases per window (default: 1024)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per rank per step (default: 8)")
    parser.add_argument("--resume-step", type=int, default=100_000, help="the late step a resume starts at (default: 100000)")
    parser.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage:
        print(json.dumps(_stage(args.stage, args)))
        return
    with tempfile.TemporaryDirectory(prefix="zerofx-genome-bench-") as work:
        args.work = Path(work)
        t0 = time.perf_counter()
        size = write_assembly(args.work / "genome.fa", args.mbp, args.record_mbp)
        result = {"mbp": args.mbp, "fasta_bytes": size, "write_s": time.perf_counter() - t0, "seq_len": args.seq_len,
                  "batch_size": args.batch_size, "resume_step": args.resume_step}
        for stage in ("prepare", "startup", "draw", "resume"):
            result.update(_child(stage, args))
    rows = [
        ("FASTA", f"{args.mbp:g} Mbp, {size / 1e6:,.0f} MB, records of {args.record_mbp:g} Mbp starting with 100 kb of N"),
        ("prepare", f"{result['prepare_s']:.1f} s, {result['prepare_mb_s']:.0f} MB/s, peak RSS {result['prepare_peak_rss'] / 2**20:.0f} MiB"),
        ("startup to the first batch", f"{result['startup_s'] * 1e3:.0f} ms, peak RSS {result['startup_peak_rss'] / 2**20:.0f} MiB, "
                                       f"N share of the first batch {result['first_batch_n_share']:.1%}"),
        ("windows drawn per second, one rank", f"{result['windows_per_s']:,.0f} ({args.seq_len} bases; a step takes "
                                               f"{args.batch_size}), peak RSS {result['draw_peak_rss'] / 2**20:.0f} MiB"),
        (f"resume at step {args.resume_step:,}, world size 2", f"{result['resume_s'] * 1e3:.0f} ms to the first batch"),
    ]
    table = "| what | measured |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)
    print(table)
    if args.out is not None:
        args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
        command = f"python -m benchmarks.bench_genome_data --mbp {args.mbp:g} --out {args.out}"
        args.out.with_suffix(".md").write_text(f"# Genome data\n\n`{command}`\n\n{table}\n")


if __name__ == "__main__":
    main()
