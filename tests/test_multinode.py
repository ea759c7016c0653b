"""Two torchrun agents on localhost as two "nodes" of 2 ranks: the same script, 2 replicas x 2 stages, c10d rendezvous."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from _runtime_common import check_data_parallel

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SPEC = "gpt:size=tiny,batch=8"

SCRIPT = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    from _runtime_common import data_parallel_worker
    # torchrun's environment only: smp.partition joins the group it describes (gloo on CPU)
    data_parallel_worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), spec={spec!r}, stages=2,
                         schedule="1f1b", out={out!r})
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_agents_train_two_replicas_of_two_stages(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(HERE), spec=SPEC, out=str(tmp_path)))
    endpoint = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
         "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "smp-test", "--max-restarts", "0",
         str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for _ in range(2)]
    outputs = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=300)
            outputs.append(out)
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, 9)
    for agent, out in zip(agents, outputs):
        assert agent.returncode == 0, out[-4000:]
    ranks = [torch.load(tmp_path / f"dp-{r}.pt", weights_only=False) for r in range(4)]
    check_data_parallel(ranks, SPEC, replicas=2)
