"""Reproduce torch's gloo completion race without zerofx (NOTE [gloo's completion race] in
passes/zero/gather_into_buffers.py), and show that the all-gather zerofx's graphs run avoids it.

Each trial starts two gloo ranks that, per iteration, put four all-gathers and four
reduce-scatters of a few floats in flight and then wait for them all, until TRIAL_SECONDS pass
or a rank dies. Two forms of the all-gather, run in alternating trials:

- ``functional``: ``_c10d_functional.all_gather_into_tensor``, which gloo runs as
  ``allgather_into_tensor_coalesced`` (op type ``ALLGATHER_COALESCED``);
- ``into``: ``_c10d_functional.all_gather_into_tensor_out``, which gloo runs as
  ``_allgather_base`` (``_ALLGATHER_BASE``): what zerofx's lowered graphs issue.

    python benchmarks/gloo_completion_race.py [--trials 4] [--trial-seconds 180]

Prints one line per trial (crashed with which signal, after how long, or clean) and a summary.
On a 2-core machine the functional form crashes within a few minutes; outside CI.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import socket
import subprocess
import sys
import time

VARIANTS = ("functional", "into")


def _rank(rank: int, variant: str, port: int, seconds: float) -> None:
    import torch
    import torch.distributed as dist

    functional = torch.ops._c10d_functional
    faulthandler.enable()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.group.WORLD.group_name
    deadline = time.monotonic() + seconds
    stop = torch.zeros(1)
    iteration = 0
    while True:
        iteration += 1
        in_flight = []
        for k in range(4):
            shard = torch.full((4,), float(k))
            if variant == "functional":
                in_flight.append(functional.all_gather_into_tensor.default(shard, 2, group))
            else:
                in_flight.append(functional.all_gather_into_tensor_out.default(shard, 2, group, out=torch.empty(8)))
            in_flight.append(functional.reduce_scatter_tensor.default(torch.ones(8), "sum", 2, group))
        for tensor in in_flight:
            functional.wait_tensor.default(tensor)
        if iteration % 500 == 0:  # both ranks stop at the same iteration; rarely, not to slow the loop
            stop.fill_(float(time.monotonic() > deadline))
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                break
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _outcome(procs: list[subprocess.Popen]) -> str:
    """How the trial ended: a rank killed by a signal (the race), another failure with the last
    line its rank wrote, or clean. ``procs`` are the ranks that ended by themselves."""
    codes = [p.returncode for p in procs]
    signals = [signal.Signals(-c).name for c in codes if c is not None and c < 0]
    if signals:
        return f"crashed ({', '.join(signals)})"
    for p in procs:
        if p.returncode:
            lines = p.stderr.read().decode(errors="replace").strip().splitlines() if p.stderr else []
            return f"failed (exit {p.returncode}: {lines[-1] if lines else 'no output'})"
    return "clean"


def trial(variant: str, seconds: float) -> tuple[str, float]:
    """(how the trial ended, seconds it ran)."""
    port = _free_port()
    start = time.monotonic()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--variant", variant, "--port", str(port),
                               "--trial-seconds", str(seconds)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for r in range(2)]
    hung = False
    while any(p.poll() is None for p in procs):
        if any(p.returncode not in (None, 0) for p in procs):
            time.sleep(2.0)  # let the peer notice and exit, so a signal is told from its echo
            break
        if time.monotonic() - start > seconds + 60:
            hung = True
            break
        time.sleep(0.2)
    elapsed = time.monotonic() - start
    ended = [p for p in procs if p.poll() is not None]
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    return ("hung" if hung else _outcome(ended)), elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=4, help="trials of each variant, alternating (default 4)")
    parser.add_argument("--trial-seconds", type=float, default=180.0, help="how long a trial runs if nothing crashes (default 180)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="which all-gather forms to run")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not (args.trials >= 1 and 1.0 <= args.trial_seconds <= 86400.0):
        parser.error(f"--trials must be >= 1 and --trial-seconds in [1, 86400]; got {args.trials} and {args.trial_seconds}")
    if args.rank is not None:
        _rank(args.rank, args.variant, args.port, args.trial_seconds)
        return 0
    results: dict[str, list[tuple[str, float]]] = {v: [] for v in args.variants}
    for t in range(1, args.trials + 1):
        for variant in args.variants:
            outcome, elapsed = trial(variant, args.trial_seconds)
            results[variant].append((outcome, elapsed))
            print(f"trial {t} {variant}: {outcome} after {elapsed:.0f} s", flush=True)
    for variant, rows in results.items():
        crashes = [e for o, e in rows if o.startswith("crashed")]
        total = sum(e for _, e in rows)
        print(f"{variant}: {len(crashes)} of {len(rows)} trials crashed, {total:.0f} s run in all", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
