"""``zerofx consolidate``: a sharded checkpoint as one safetensors file, streamed tensor by tensor."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from zerofx.app.commands.common import existing
from zerofx.common.units import format_bytes


def add_parser(sub: Any) -> None:
    p = sub.add_parser("consolidate", help="write a sharded checkpoint as one safetensors file",
                       description="Stream a sharded zerofx checkpoint into one safetensors file with the model's "
                                   "state_dict keys, tensor by tensor: memory stays bounded whatever the model's size.")
    p.add_argument("ckpt_dir", metavar="CKPT_DIR", type=existing("checkpoint directory", "the save_dir of engine.save_checkpoint",
                                                                   folder=True), help="the checkpoint directory (engine.save_checkpoint's save_dir)")
    p.add_argument("out", metavar="OUT.safetensors", type=Path, help="the file to write")
    p.add_argument("--tag", help="which checkpoint (default: the newest complete one)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="floating-point dtype of the output (default: fp32)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Write a sharded checkpoint as one safetensors file, streaming tensor by tensor."""
    from zerofx.runtime.checkpoint import consolidate, read_metadata, resolve_tag

    tag = resolve_tag(args.ckpt_dir, args.tag).name  # one tag for the metadata and the data, even if a save lands now
    meta = read_metadata(args.ckpt_dir, tag)
    out = consolidate(args.ckpt_dir, args.out, tag=tag, dtype=args.dtype)
    print(
        f"wrote {out} ({format_bytes(out.stat().st_size)}, {args.dtype}): {len(meta['state_dict_keys'])} tensors of "
        f"{meta['model_class']} at step {meta['step']}, from {meta['world_size']} rank files of {Path(args.ckpt_dir) / tag}"
    )
    return 0
