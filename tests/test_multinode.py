"""Multi-node for real on this machine: two torchrun agents, as two nodes of two ranks each, meet
through a c10d rendezvous on 127.0.0.1 and run one ``zerofx train`` job; its losses match plain
single-process PyTorch on the four ranks' batches, and both agents exit cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.dist_utils import free_port
from zerofx.app.training import TrainOptions, _cycle_batches, build_model, check_train_options

ROOT = Path(__file__).resolve().parents[1]
NODES, RANKS_PER_NODE, STEPS = 2, 2, 3
SGD = {"type": "SGD", "params": {"lr": 0.1}}


def _session_members(session_ids: set[int]) -> list[str]:
    """Processes still alive in these sessions (an agent and everything it started share one)."""
    left = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited while we looked
        if fields[0] != "Z" and int(fields[3]) in session_ids:  # state, ppid, pgrp, session
            left.append(stat.parent.name)
    return left


def _reference_losses(opts: TrainOptions) -> list[float]:
    """Plain PyTorch in this process: each step averages the four ranks' losses on the batches
    ``zerofx train`` deals them, then steps SGD."""
    torch.manual_seed(opts.seed)
    model = build_model(opts, torch.device("cpu"))
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], **SGD["params"])
    streams = [_cycle_batches(opts, rank) for rank in range(opts.world_size)]
    losses = []
    for _ in range(STEPS):
        optim.zero_grad()
        loss = sum(model(*(x := next(s))[:1], labels=x[1]).loss for s in streams) / opts.world_size
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


@pytest.mark.multiprocess
def test_two_torchrun_agents_train_one_job_with_a_shard_group_per_node(tmp_path: Path) -> None:
    config = tmp_path / "ds.json"
    # One shard group per node (K = ranks per node): ZeRO state sharded within a node, replicated across nodes.
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}, "optimizer": SGD, "zerofx": {"shard_group_size": RANKS_PER_NODE}}))
    out = tmp_path / "run"
    train = ["-m", "zerofx.app.cli", "train", "--config", str(config), "--steps", str(STEPS), "--seq-len", "32",
             "--output-dir", str(out)]
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ZEROFX_PLAN_CACHE": "off"}
    agents = [
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node", str(RANKS_PER_NODE),
                          "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "zerofx-multinode-test",
                          "--max-restarts", "0", "--node-rank", str(node), *train],
                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for node in range(NODES)
    ]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=300))
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    for agent, (_, stderr) in zip(agents, outputs):
        assert agent.returncode == 0, stderr[-3000:]
    assert _session_members({a.pid for a in agents}) == [], "an agent left a worker behind"
    stdout = "".join(o for o, _ in outputs)
    # c10d rendezvous may give either agent the first group rank; rank 0's lines are in one of them.
    assert f"on {NODES * RANKS_PER_NODE} gloo ranks" in stdout and f"step {STEPS}/{STEPS} loss" in stdout, stdout[-2000:]
    assert "perplexity" in stdout  # the eval after the last step
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r.get("step") for r in log if "step" in r] == list(range(1, STEPS + 1)) and "eval_perplexity" in log[-1]
    losses = [r["loss"] for r in log if "step" in r]
    opts = check_train_options(TrainOptions(world_size=NODES * RANKS_PER_NODE, config=config, steps=STEPS, seq_len=32))
    torch.testing.assert_close(losses, _reference_losses(opts), rtol=1e-5, atol=1e-5)
    assert len(losses) == STEPS and losses[-1] < losses[0]
    # Sharded within a node of 2, not over all 4 ranks: each rank holds half of the fp32 parameters
    # and gradients (SGD keeps no state), up to each tensor's padding to a multiple of 2.
    torch.manual_seed(opts.seed)
    num_params = sum(p.numel() for p in build_model(opts, torch.device("cpu")).parameters())
    held = [r["model_state_bytes_per_rank"] for r in log if "step" in r][-1]
    assert 2 * 4 * num_params / RANKS_PER_NODE <= held <= 1.01 * 2 * 4 * num_params / RANKS_PER_NODE, (held, num_params)
