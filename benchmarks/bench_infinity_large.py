"""ZeRO-Infinity on a model larger than the machine: the DNA LM at about 1.6B parameters (width
2048, 32 blocks), whose fp32 AdamW model states (4 + 4 + 8 = 16 bytes per parameter, ~26 GB)
exceed the machine's memory, trained for a few steps on 2 gloo ranks at ZeRO stage 3 with every
state on NVMe: parameters (``offload_param``), gradients (``zerofx.offload_gradients``) and
optimizer states (``offload_optimizer``).

    nice -n 5 python -m benchmarks.bench_infinity_large                          # 1.6b, 4 steps
    python -m benchmarks.bench_infinity_large --size tiny --steps 3 --reference  # CI's small version

The model is built on the meta device, so each rank materializes one module at a time and
keeps only its shards (NOTE [The init scheme] in ``zerofx/compiler/materialize.py``). Every rank trains
on one fixed batch, a window of the bundled lambda phage genome (rank r: window r), so the loss
falls visibly within a few steps. ``--reference`` trains the same config without offload in
the same processes afterwards; the losses and weights must agree exactly.

Per rank: peak RSS (``VmHWM``, ``zerofx.common.rss``), seconds and loss per step, the engine's ``memory()`` per tier,
NVMe bytes moved per step, and ``du`` of the NVMe folder after the last step. The main process
adds what ``zerofx estimate`` (per tier) and ``zerofx plan`` (fits, bytes per tier) predict for
the same config, and the load average before and after. Results go to
``benchmarks/results/infinity_large_<date>.{json,md}`` (``infinity_<size>_<date>`` for the
other sizes; ``--out`` names the stem).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from zerofx.models.sizes import DNA_LM_SIZES, DNALMConfig
from zerofx.common.rss import current_rss_bytes, peak_rss_bytes
from zerofx.common.units import format_bytes

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
# ~1.62B parameters: the bundled "1b" shape (width 2048, SwiGLU 5504) with 32 blocks instead of 20.
SHAPES: dict[str, DNALMConfig] = {
    "1.6b": DNALMConfig(dim=2048, num_layers=32, num_heads=16, ffn_dim=5504, max_seq_len=1024),
    "tiny": DNA_LM_SIZES["tiny"],
}
# Adam moves every weight by about lr in its first steps, and the blocks' changes add up in the
# residual stream: on this init the loss oscillates from lr 1e-5 at 2 blocks of width 2048 and falls
# steadily at 3e-6; 8 blocks fall alike at a quarter of that, so 32 blocks take 2e-7.
DEFAULT_LR = {"1.6b": 2e-7, "tiny": 1e-3}
DEFAULT_NVME = Path("/work/nvme-bench")


def train_config(nvme_path: Path | None, lr: float, buffer_count: int = 2) -> dict[str, Any]:
    """Stage 3, fp32 AdamW; with ``nvme_path`` every state on NVMe under it (one folder for all three)."""
    cfg: dict[str, Any] = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"lr": lr}}}
    if nvme_path is not None:
        nvme = {"device": "nvme", "nvme_path": str(nvme_path), "buffer_count": buffer_count}
        cfg["zero_optimization"]["offload_optimizer"] = dict(nvme)
        cfg["zero_optimization"]["offload_param"] = dict(nvme)
        cfg["zerofx"] = {"offload_gradients": dict(nvme)}
    return cfg


def fixed_batch(seq_len: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s batch (1, seq_len), the same every step: a window of the lambda phage genome."""
    from zerofx.data.genome import bundled_genome, genome_windows

    return next(iter(genome_windows(bundled_genome(), seq_len, rank=rank, world_size=world_size, batch_size=1, seed=0)))


def large_model() -> tuple[torch.nn.Module, tuple[tuple[torch.Tensor], dict[str, torch.Tensor]]]:
    """``zerofx plan benchmarks/bench_infinity_large.py:large_model``: the 1.6b shape on the meta
    device with a 1 x 128-token example batch."""
    from zerofx.models import DNADecoderLM

    with torch.device("meta"):
        model = DNADecoderLM(SHAPES["1.6b"])
    ids = torch.zeros(1, 128, dtype=torch.long)
    return model, ((ids,), {"labels": ids})


def _io_bytes(engine: Any) -> tuple[int, int]:
    """NVMe bytes (read, written) so far, over the optimizer, parameter and gradient stores."""
    stores = [s for s in (engine.storage.offload_store, engine.storage.param_store, engine.storage.grad_store) if s is not None]
    return sum(s.io_bytes()[0] for s in stores), sum(s.io_bytes()[1] for s in stores)


def du_bytes(path: Path) -> int:
    """Bytes the files under ``path`` occupy on disk (``du -sb``: apparent sizes)."""
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout
    return int(out.split()[0])


def train(rank: int, world_size: int, args: dict[str, Any], nvme_path: Path | None) -> dict[str, Any]:
    """Train the ``args["size"]`` shape from the meta device for ``args["steps"]`` steps on the
    fixed batch (a process group must be up); what it measured."""
    import zerofx
    from zerofx.models import DNADecoderLM

    with torch.device("meta"):
        model = DNADecoderLM(DNALMConfig(**args["shape"]))
    ids = fixed_batch(args["seq_len"], rank, world_size)
    start = time.perf_counter()
    engine = zerofx.initialize(model, train_config(nvme_path, args["lr"], args["buffer_count"]),
                               example_inputs=(ids,), example_kwargs={"labels": ids}, init_seed=0)
    out: dict[str, Any] = {"initialize_s": time.perf_counter() - start, "rss_after_initialize_bytes": current_rss_bytes(),
                           "peak_rss_after_initialize_bytes": peak_rss_bytes(), "losses": [], "step_s": [],
                           "read_bytes": [], "written_bytes": []}
    for _ in range(args["steps"]):
        before = _io_bytes(engine)
        dist.barrier()
        start = time.perf_counter()
        loss = engine(ids, labels=ids)
        engine.backward(loss)
        engine.step()
        dist.barrier()
        out["step_s"].append(time.perf_counter() - start)
        out["losses"].append(loss.item())
        after = _io_bytes(engine)
        out["read_bytes"].append(after[0] - before[0])
        out["written_bytes"].append(after[1] - before[1])
        print(f"[bench_infinity_large] rank {rank} step {len(out['losses'])}: loss {out['losses'][-1]:.4f}, "
              f"{out['step_s'][-1]:.1f} s, peak RSS {peak_rss_bytes() / 2**30:.2f} GiB", file=sys.stderr, flush=True)
    engine.flush()
    out["memory"] = engine.memory()
    dist.barrier()
    if nvme_path is not None:
        out["du_rank_bytes"] = du_bytes(nvme_path / f"rank-{rank:05d}") if (nvme_path / f"rank-{rank:05d}").exists() else None
        out["du_bytes"] = du_bytes(nvme_path) if rank == 0 else None
        out["param_peak_held_bytes"] = engine.storage.param_store.peak_held_bytes
        out["record_tiers"] = {t.value: n for t, n in _tier_counts(engine.storage.offload_plan.tiers).items()}
        out["param_tiers"] = {t.value: n for t, n in _tier_counts(engine.storage.param_offload_plan.tiers).items()}
    dist.barrier()
    if args.get("keep_state"):
        out["state"] = {k: v.clone() for k, v in engine.full_state_dict().items()}
    engine.close()
    out["peak_rss_bytes"] = peak_rss_bytes()
    out["end_rss_bytes"] = current_rss_bytes()
    return out


def _tier_counts(tiers: Any) -> dict[Any, int]:
    counts: dict[Any, int] = {}
    for _, tier in tiers:
        counts[tier] = counts.get(tier, 0) + 1
    return counts


def run_all(rank: int, world_size: int, args: dict[str, Any]) -> dict[str, Any]:
    """The offloaded run, then (``args["reference"]``) the same config without offload."""
    torch.set_num_threads(1)
    out = {"infinity": train(rank, world_size, args, Path(args["nvme_path"]))}
    if args.get("reference"):
        out["no-offload"] = train(rank, world_size, args, None)
    return out


def _rank(rank: int, world_size: int, port: int, args: dict[str, Any], queue: Any) -> None:
    """``run_config``'s target: a fresh process per rank, so its peak RSS is this run's own."""
    sys.path.insert(0, str(ROOT))
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        out = run_all(rank, world_size, args)
        for run in out.values():
            run.pop("state", None)
        queue.put((rank, "ok", out))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def num_params(shape: DNALMConfig) -> int:
    from zerofx.models import DNADecoderLM

    with torch.device("meta"):
        return sum(p.numel() for p in DNADecoderLM(shape).parameters())


def _cli_json(argv: list[str]) -> dict[str, Any]:
    from zerofx.app.cli import main as cli_main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cli_main(argv)
    if code != 0:
        raise RuntimeError(f"zerofx {' '.join(argv)} exited {code}")
    return json.loads(buf.getvalue())


def predictions(args: argparse.Namespace, cfg: DNALMConfig, params: int, nvme_path: Path, host_memory: int,
                bandwidth: tuple[float, float]) -> dict[str, Any]:
    """What ``zerofx estimate`` (per tier, with the disk's measured bandwidths) and ``zerofx plan``
    (bytes per tier and the budget verdict, at half the machine's memory per rank) say of this
    config; the plan only for the sizes as they are (``large_model`` is 1.6b at 128 tokens)."""
    est = _cli_json(["estimate", "--params", str(params), "--world-size", str(args.world_size), "--stage", "3", "--offload", "nvme",
                     "--offload-param", "nvme", "--offload-grad", "nvme", "--hidden", str(cfg.dim), "--layers", str(cfg.num_layers),
                     "--seq-len", str(args.seq_len), "--micro-batch", "1", "--buffer-count", str(args.buffer_count),
                     "--ranks-per-node", str(args.world_size), "--host-memory", str(host_memory),
                     "--nvme-capacity", str(shutil.disk_usage(nvme_path).free), "--nvme-read-bw", str(bandwidth[0]),
                     "--nvme-write-bw", str(bandwidth[1]), "--format", "json"])
    if args.layers is not None or (args.size == "1.6b" and args.seq_len != 128):
        return {"estimate": est["tiers"], "plan": None}
    config_file = nvme_path / "bench_config.json"
    config_file.write_text(json.dumps(train_config(nvme_path, args.lr, args.buffer_count)))
    try:
        spec = f"{Path(__file__).resolve()}:large_model" if args.size == "1.6b" else args.size
        # --fold off: a folded plan leaves offload out (it plans a 3-block copy).
        plan = _cli_json(["plan", spec, "--world-size", str(args.world_size), "--config", str(config_file), "--seq-len",
                          str(args.seq_len), "--budget", f"{host_memory // args.world_size}B", "--fold", "off", "--format", "json"])
    finally:
        config_file.unlink()
    return {"estimate": est["tiers"], "plan": {k: v for k, v in plan.items() if k in ("tiers_per_rank_bytes", "memory", "budget", "fits")},
            "plan_keys": sorted(plan)}


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def render(result: dict[str, Any]) -> str:
    shape = result["shape"]
    lines = [
        f"DNA LM {result['size']}: {result['num_params']:,} parameters (width {shape['dim']}, {shape['num_layers']} blocks, SwiGLU "
        f"{shape['ffn_dim']}), fp32 AdamW (lr {result['lr']:g}), {result['world_size']} gloo ranks, ZeRO stage 3, parameters, "
        f"gradients and optimizer states on NVMe ({result['nvme_path']}, buffer_count {result['buffer_count']}), one fixed batch of "
        f"1 x {result['seq_len']} tokens per rank (lambda phage window r for rank r), {result['steps']} steps. fp32 model states: "
        f"{16 * result['num_params'] / 1e9:.1f} GB; the machine: {result['machine']}. Run {result['date']}; load average "
        f"before {result['load_before']}, after {result['load_after']} (the machine is shared with other workers).",
        "",
        "| rank | initialize s | peak RSS GiB | RSS after GiB | step s (each) | loss (each step) | NVMe read GiB/step | "
        "NVMe written GiB/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r, out in enumerate(result["ranks"]):
        run = out["infinity"]
        lines.append(f"| {r} | {run['initialize_s']:.0f} | {_gib(run['peak_rss_bytes'])} | {_gib(run['end_rss_bytes'])} | "
                     f"{', '.join(f'{s:.0f}' for s in run['step_s'])} | {', '.join(f'{x:.4f}' for x in run['losses'])} | "
                     f"{_gib(sorted(run['read_bytes'])[len(run['read_bytes']) // 2])} | "
                     f"{_gib(sorted(run['written_bytes'])[len(run['written_bytes']) // 2])} |")
    runs = [out["infinity"] for out in result["ranks"]]
    mean_loss = [sum(r["losses"][i] for r in runs) / len(runs) for i in range(len(runs[0]["losses"]))]
    lines += ["", f"Loss averaged over the ranks (the global batch's loss), per step: {', '.join(f'{x:.4f}' for x in mean_loss)}."]
    run0 = runs[0]
    mem, est = run0["memory"], result["predicted"]["estimate"]
    measured = {  # (parameters, gradients, optimizer states) per tier
        "device": (mem["params"], mem["grads"], mem["optimizer_states"]),
        "cpu": (mem.get("offload_param_cpu_bytes", 0), mem.get("offload_grad_cpu_bytes", 0), mem.get("offload_cpu_bytes", 0)),
        "nvme": (mem.get("offload_param_nvme_bytes", 0), mem.get("offload_grad_nvme_bytes", 0), mem.get("offload_nvme_bytes", 0)),
    }
    windows = {"offload_window_bytes": "optimizer records", "offload_param_window_bytes": "parameter shards (bound)",
               "offload_grad_window_bytes": "gradient shards"}
    lines += ["", "Bytes per tier, rank 0: measured by the engine's `memory()` after the last step, and what `zerofx estimate` "
              "predicts for the same shape and bandwidths (it assumes mixed-precision Adam, 2 + 2 + 12 bytes per parameter, where "
              "this run holds fp32 parameters, gradients and Adam moments, 4 + 4 + 8):", "",
              "| tier | measured: parameters / gradients / optimizer states | measured total | estimate: parameters / gradients / "
              "optimizer states | estimate total (with the working set and staging buffers) |",
              "|---|---|---|---|---|"]
    names = {"device": "device (on this machine, CPU memory)", "cpu": "host memory", "nvme": "NVMe"}
    for tier, name in names.items():
        placed = [est["placement_bytes"][kind][tier] for kind in ("params", "grads", "optimizer_states")]
        lines.append(f"| {name} | {' / '.join(format_bytes(b) for b in measured[tier])} | {format_bytes(sum(measured[tier]))} | "
                     f"{' / '.join(format_bytes(b) for b in placed)} | {format_bytes(est['per_rank_bytes'][tier])} |")
    lines += ["", "Host-memory buffers the NVMe transfers pass through, rank 0: " + ", ".join(
        f"{what} {format_bytes(mem.get(key, 0))}" for key, what in windows.items())
        + f"; parameter shards read from NVMe and held at once, at the peak, {format_bytes(run0['param_peak_held_bytes'])}. "
        f"`du -sb` of the NVMe folder after the last step: {format_bytes(run0['du_bytes'])} for both ranks "
        f"(rank 0's folder {format_bytes(run0['du_rank_bytes'])})."]
    lines += ["", f"`zerofx estimate` per step and rank, at the disk's measured {est['node']['nvme_read_bytes_per_s'] / 1e9:.2f} GB/s read "
              f"and {est['node']['nvme_write_bytes_per_s'] / 1e9:.2f} GB/s write (shared by the {est['node']['ranks_per_node']} ranks): "
              f"NVMe I/O {est['io_s']['nvme']:.0f} s, against compute {est['compute_s']:.2f} s at its default device "
              f"({est['node']['device_flops_per_s'] / 1e12:g} TFLOP/s, an accelerator's, not this CPU's)."]
    plan = result["predicted"]["plan"]
    if plan is not None:
        tiers, memory = plan["tiers_per_rank_bytes"], plan["memory"]
        lines += ["", f"`zerofx plan` for the same config (`--fold off`), per rank: device {_gib(tiers['device'])} GiB at the peak "
                  f"(the memory model's peak less what the offload plans take off it), host memory {_gib(tiers['cpu'])} GiB, NVMe "
                  f"{_gib(tiers['nvme'])} GiB. Its budget verdict, as it printed it, against {_gib(memory['budget_bytes'])} GiB "
                  f"(half the machine's memory): {'fits' if memory['fits'] else 'does not fit'}. The memory model's peak without "
                  f"offload is {_gib(memory['peak_bytes'])} GiB, of which {_gib(memory['persistent_bytes'])} GiB persistent model state."]
    check = result.get("rss_check_2_blocks")  # added by hand to a result: the same config at 2 blocks, 6 steps, each malloc setting
    if check is not None:
        lines += ["", f"Peak RSS after each step, the same config at 2 blocks (`{check['command']}`), per rank: " + "; ".join(
            f"{name} ({run['date']}, load average {run['load_before'].split()[0]} to {run['load_after'].split()[0]}): "
            + ", ".join(f"rank {r} " + " ".join(f"{x:.2f}" for x in peaks) for r, peaks in run["peak_rss_gib_after_each_step"].items())
            + " GiB" for name, run in check["runs"].items())
            + ". With blocks above 128 KiB mapped and unmapped, the peak stays flat: the growth under glibc's defaults is freed "
              "memory malloc keeps resident."]
    if "no-offload" in result["ranks"][0]:
        ref = [out["no-offload"] for out in result["ranks"]]
        same = all(out["infinity"]["losses"] == out["no-offload"]["losses"] for out in result["ranks"])
        lines += ["", f"Without offload (same processes, afterwards): losses {', '.join(f'{x:.4f}' for x in ref[0]['losses'])} "
                  f"(rank 0), peak RSS {', '.join(_gib(r['peak_rss_bytes']) for r in ref)} GiB per rank; losses equal to the "
                  f"offloaded run's: {'yes' if same else 'NO'}."]
    return "\n".join(lines)


def _tier(est: dict[str, Any], tier: str) -> str:
    return _gib(est["per_rank_bytes"][tier])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SHAPES), default="1.6b")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=None, help="blocks instead of the size's own (a quick look at the cost per block)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=None, help="AdamW's learning rate (default: 2e-7 at 1.6b, 1e-3 at tiny)")
    parser.add_argument("--buffer-count", type=int, default=2)
    parser.add_argument("--nvme-path", type=Path, default=DEFAULT_NVME, help=f"NVMe folder, deleted afterwards (default {DEFAULT_NVME})")
    parser.add_argument("--reference", action="store_true", help="also train without offload and compare (small sizes only)")
    parser.add_argument("--out", default=None, help="results file stem under benchmarks/results (default infinity_large_<date> at 1.6b)")
    parser.add_argument("--timeout-s", type=float, default=4 * 3600)
    args = parser.parse_args(argv)
    if args.lr is None:
        args.lr = DEFAULT_LR[args.size] * (SHAPES[args.size].num_layers / args.layers if args.layers else 1)
    shape = SHAPES[args.size] if args.layers is None else dataclasses.replace(SHAPES[args.size], num_layers=args.layers)
    if args.nvme_path.exists():
        raise SystemExit(f"--nvme-path {args.nvme_path} exists; give a folder the benchmark may create and delete")
    args.nvme_path.mkdir(parents=True)
    host_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    params = num_params(shape)
    result: dict[str, Any] = {
        **{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "num_params": params,
        "shape": dataclasses.asdict(shape),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()}-core CPU, {host_memory / 2**30:.1f} GiB memory, no GPU, torch {torch.__version__}",
        "load_before": Path("/proc/loadavg").read_text().strip(),
    }
    from zerofx.runtime.offload import measure_nvme_bytes_per_s

    from benchmarks.bench_offload import run_config  # here: `zerofx plan` imports this file by path, without the package
    from benchmarks.report import write_result

    try:
        result["nvme_read_bytes_per_s"], result["nvme_write_bytes_per_s"] = bandwidth = measure_nvme_bytes_per_s(args.nvme_path)
        result["predicted"] = predictions(args, shape, params, args.nvme_path, host_memory, bandwidth)
        spec = {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "shape": dataclasses.asdict(shape)}
        result["ranks"] = run_config(spec, args.world_size, target=_rank, timeout_s=args.timeout_s)
    finally:
        shutil.rmtree(args.nvme_path, ignore_errors=True)
    result["load_after"] = Path("/proc/loadavg").read_text().strip()
    text = render(result)
    label = ("large" if args.size == "1.6b" else args.size) if args.layers is None else f"{args.size}_{args.layers}layers"
    write_result(RESULTS / (args.out or f"infinity_{label}_{time.strftime('%Y-%m-%d', time.gmtime())}"), result, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
