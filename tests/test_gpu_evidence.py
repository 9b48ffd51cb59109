"""``scripts/gpu_evidence.sh --device cpu``: the script a lent GPU runs, on small shapes, so it
cannot rot. It writes both reports, and what they hold is checked:

- the stand-in (the debug job as rank 0 of 4 on one CPU process under a fake group): its measured
  peak within the planner's CPU accuracy of the plan (5%, as ``tests/test_planner.py`` requires of
  real gloo ranks), finite losses, and time in every category the step-time model prices;
- the kernel rates at the step's shapes;
- ``gpu_check``'s parity rows (every built-in style within 1.5x of the unsharded bf16 model's
  error) and its own step beside the planner's prediction, on 2 CPU processes.

On a GPU the same script runs the 8B recipes, 2 and 4 ranks sharing the GPU, and CP degree 1
(docs/gpu.md); ``tests/gpu/`` checks ``gpu_check`` on every visible GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
STYLES = {"UPipe (U = C)", "Ulysses", "ring", "FPDT (4 chunks)", "UPipe x FPDT (4 chunks)"}


def test_gpu_evidence_script_on_cpu_writes_both_reports(tmp_path: Path) -> None:
    out = tmp_path / "evidence"
    env = os.environ | {"PYTHON": sys.executable}
    run = subprocess.run(
        ["bash", "scripts/gpu_evidence.sh", "--device", "cpu", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert (out / "report.md").is_file() and (out / "report.json").is_file(), run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    parts = report["parts"]
    statuses = {name: part["status"] for name, part in parts.items()}
    assert run.returncode == 0 and set(statuses.values()) == {"ok"}, (
        statuses,
        (out / "report.md").read_text()[-4000:],
    )
    env_fields = report["environment"]
    assert {"date", "commit", "torch", "python", "device"} <= env_fields.keys()

    stand_in = parts["stand-in"]["result"]
    assert (stand_in["world_size"], stand_in["rank"], stand_in["device"]) == (4, 0, "CPU")
    peak = next(row for row in stand_in["memory"] if row["what"] == "peak allocated")
    ratio = peak["measured_bytes"] / peak["planned_bytes"]
    assert abs(ratio - 1) <= 0.05, peak
    assert stand_in["finite"] and stand_in["mean_step_s"] > 0
    measured = stand_in["measured_by_category_s"]
    assert all(measured[kind] > 0 for kind in ("matmul", "attention forward", "optimizer"))
    assert measured["attention backward"] > 0 and measured["memory-bound ops"] > 0

    rates = parts["rates"]["result"]["rates"]
    assert {r["kind"] for r in rates} == {
        "matmul", "attention forward", "attention backward", "memory-bound",
    }  # fmt: skip
    assert all(r["rate"] > 0 and r["verdict"] == "n/a" for r in rates)  # no CPU ranges

    numerics = parts["numerics-2"]["result"]
    rows = numerics["parity"]
    assert {row["style"] for row in rows} == STYLES and not any(row["failed"] for row in rows)
    assert all(row["ratio"] <= 1.5 for row in rows), rows
    assert numerics["step"]["job"].startswith("llama3 debugmodel, 256 tokens, UPipe (U = 2)")

    markdown = (out / "report.md").read_text()
    assert all(f"## {name}: ok" in markdown for name in parts)
    assert "peak allocated" in markdown and "| ring | sdpa |" in markdown
