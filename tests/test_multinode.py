"""A real multi-node launch on one machine: two torchrun agents (``--nnodes 2``, c10d rendezvous on
127.0.0.1) run a 2D job (cp 4 = a ring of 2 x 2 head ranks). Each agent's ranks (from torchrun's
own rendezvous log) form one head group, every ring group joins the two agents (from the
trainer's start-up mesh line), and the losses equal one agent running all 4 ranks."""

from __future__ import annotations

import ast
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
STEPS = 3


def _job(dump: Path) -> list[str]:
    return [
        "train.py",
        "--config",
        "train_configs/debug_model.toml",
        "--parallelism.context_parallel_degree",
        "4",
        "--parallelism.ring_degree",
        "2",
        "--training.seq_len",
        "256",
        "--training.local_batch_size",
        "2",
        "--training.steps",
        str(STEPS),
        "--job.dump_folder",
        str(dump),
        "--checkpoint.enable",
        "false",
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.log_freq",
        "1",
    ]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _start(launcher: list[str], job: list[str]) -> subprocess.Popen:
    """A torchrun agent in its own process group; LOGLEVEL=INFO makes it log its rendezvous."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launcher, *job],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO"},
        start_new_session=True,
    )


def _finish(agents: list[subprocess.Popen], timeout: float = 300) -> list[tuple[str, str]]:
    """Every agent's (stdout, stderr) once all exited 0; on a timeout all are killed whole."""
    outputs = []
    try:
        for agent in agents:
            stdout, stderr = agent.communicate(timeout=timeout)
            assert agent.returncode == 0, stderr[-3000:]
            outputs.append((stdout, stderr))
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    return outputs


def _losses(stdout: str) -> list[str]:
    return re.findall(r"^step\s+\d+ \| loss (\S+)", stdout, re.MULTILINE)


def test_two_agents_form_head_groups_per_node_and_match_one_agent(tmp_path: Path) -> None:
    single = _finish([_start(["--standalone", "--nproc_per_node=4"], _job(tmp_path / "one"))])
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = [
        _start(
            [
                "--nnodes=2",
                f"--node_rank={node}",
                "--nproc_per_node=2",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint={endpoint}",
                "--rdzv_id=two-agents",
                f"--rdzv_conf=is_host={int(node == 0)}",  # both are local: one hosts the store
            ],
            _job(tmp_path / "two"),
        )
        for node in (0, 1)
    ]
    nodes = _finish(agents)

    # c10d numbers the agents in the order they join: read which global ranks each one got.
    node_ranks = [
        set(ast.literal_eval(re.search(r"global_ranks=(\[.*?\])", stderr)[1]))
        for _, stderr in nodes
    ]
    assert sorted(map(sorted, node_ranks)) == [[0, 1], [2, 3]]
    stdout = "".join(out for out, _ in nodes)
    layout = re.search(
        r"head groups \(all-to-all, inside a node\) (\[.*?\]\]), ring groups "
        r"\(across nodes\) (\[.*?\]\])",
        stdout,
    )
    assert layout, stdout[-3000:]
    heads, rings = (ast.literal_eval(group) for group in layout.groups())
    assert sorted(map(set, heads), key=min) == sorted(node_ranks, key=min)
    for ring in rings:  # one rank on each node
        assert sorted(
            i for rank in ring for i, ranks in enumerate(node_ranks) if rank in ranks
        ) == [0, 1]

    two_agents, one_agent = _losses(stdout), _losses(single[0][0])
    assert len(one_agent) == STEPS and two_agents == one_agent, (two_agents, one_agent)
    print(f"2 agents x 2 ranks: head groups {heads}, ring groups {rings}; losses {two_agents}")
