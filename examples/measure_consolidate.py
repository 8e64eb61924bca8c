"""Measure the peak memory of ``zerofx consolidate`` against the model's size.

Run it from the repository root (about a minute, and 2 GB of temporary disk for the default):

    python examples/measure_consolidate.py [--model 100m] [--world-size 2] [--dtype fp32]

1. Two gloo ranks train the bundled DNA LM (``--model``; ``100m`` has 99.1M parameters) for one
   AdamW step at ZeRO stage 3 and save a real sharded checkpoint (``engine.save_checkpoint``).
2. Fresh processes then each do one thing, and each one's peak resident set size
   (``ru_maxrss`` from ``os.wait4``, that child's own) is reported:
   - ``baseline``: import zerofx and safetensors, nothing else;
   - ``consolidate``: ``zerofx.runtime.checkpoint.consolidate`` into one safetensors file;
   - ``load whole``: what a consolidator that loads every rank file first needs (DeepSpeed's
     ``zero_to_fp32`` builds the whole state dict in RAM the same way), for comparison.

This driver imports no torch: on Linux a child's ``ru_maxrss`` starts from its parent's resident
set at fork, so a large driver would inflate every measurement.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20

# Each child runs one of these with ``python -c``; its argv[1:] are paths. BUILD runs as a file (mp.spawn needs one).
BASELINE = "import zerofx, zerofx.runtime.checkpoint, safetensors.torch"
CONSOLIDATE = """
import sys, zerofx.runtime.checkpoint
zerofx.runtime.checkpoint.consolidate(sys.argv[1], sys.argv[2], dtype=sys.argv[3])
"""
LOAD_WHOLE = """
import sys, torch
from safetensors.torch import load_file
from zerofx.runtime.checkpoint import read_metadata, resolve_tag
path = resolve_tag(sys.argv[1], None)
meta = read_metadata(sys.argv[1])
files = [load_file(str(path / f"rank-{r:05d}-of-{meta['world_size']:05d}.safetensors")) for r in range(meta["world_size"])]
state = {k: torch.cat([f[k] for f in files]) for k in files[0] if k.startswith("param/")}
"""
BUILD = """
import sys
import torch, torch.distributed as dist, torch.multiprocessing as mp
import zerofx
from zerofx.models import DNA_LM_SIZES, DNADecoderLM

def rank_main(rank, world_size, port, model, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    ids = torch.randint(0, 4, (1, 32))  # (B, T)
    engine = zerofx.initialize(DNADecoderLM(DNA_LM_SIZES[model]), {"zero_optimization": {"stage": 3}},
                               example_inputs=(ids,), example_kwargs={"labels": ids})
    engine.backward(engine(ids, labels=ids))
    engine.step()
    engine.save_checkpoint(out)
    dist.destroy_process_group()

if __name__ == "__main__":
    world_size, port, model, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    mp.spawn(rank_main, args=(world_size, port, model, out), nprocs=world_size)
"""


def run_child(*argv: str) -> float:
    """Run ``python argv``; return its peak RSS in MiB (``ru_maxrss`` is in KiB on Linux)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, *argv], env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"child failed: python {' '.join(argv)[:80]}")
    return usage.ru_maxrss / 1024


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="100m", help="bundled DNA LM size (default: 100m)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks that save the checkpoint (default: 2)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--dir", type=Path, help="where the checkpoint goes, reused when there (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        ckpt, out = work / "ckpt", work / "model.safetensors"
        if (ckpt / "latest").is_file():  # a --dir measured before: its checkpoint is reused
            print(f"reusing the checkpoint in {ckpt}", flush=True)
        else:
            print(f"saving a {args.model} checkpoint with {args.world_size} ranks in {ckpt} ...", flush=True)
            build_file = work / "build.py"
            build_file.write_text(BUILD)
            run_child(str(build_file), str(args.world_size), str(free_port()), args.model, str(ckpt))
        baseline = run_child("-c", BASELINE)
        consolidate = run_child("-c", CONSOLIDATE, str(ckpt), str(out), args.dtype)
        load_whole = run_child("-c", LOAD_WHOLE, str(ckpt))
        meta_code = (
            "import json, math, sys; from zerofx.runtime.checkpoint import read_metadata; m = read_metadata(sys.argv[1]); "
            "n = [math.prod(s) * 4 for _, s, _, _ in m['params']]; print(json.dumps([len(n), sum(n), max(n)]))"
        )
        sizes = subprocess.run([sys.executable, "-c", meta_code, str(ckpt)], capture_output=True, text=True, check=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}).stdout
        num_tensors, model_bytes, largest_bytes = (int(x) for x in sizes.strip().strip("[]").split(","))
        print(f"model: {args.model}, {num_tensors} parameter tensors, {model_bytes / MIB:.0f} MiB in fp32; "
              f"largest tensor {largest_bytes / MIB:.1f} MiB; output {out.stat().st_size / MIB:.0f} MiB ({args.dtype})")
        print(f"{'process':<14}{'peak RSS MiB':>14}{'above baseline MiB':>20}")
        for name, rss in (("baseline", baseline), ("consolidate", consolidate), ("load whole", load_whole)):
            print(f"{name:<14}{rss:>14.0f}{rss - baseline:>20.0f}")


if __name__ == "__main__":
    main()
