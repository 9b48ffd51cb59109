"""A lent GPU's minutes turned into evidence: every check of this package that one GPU can run,
each with its own time limit, and one report whatever fails.

    scripts/gpu_evidence.sh OUTDIR             # on the GPU machine (installs carried wheels first)
    scripts/gpu_evidence.sh --device cpu OUTDIR  # the same parts on small shapes (CI)

The parts, in the order of their value (each a separate process, so a crash, a hang or an
out-of-memory ends only its own part; a part that runs out of its time is stopped and reported):

1. ``stand-in``: the 8B 128K recipe's rank 0 of 8 on this GPU (``gpu_check --stand-in``),
   measured peak memory and step time beside its plan;
2. ``rates``: the same step's kernels timed alone beside the step-time model's ranges
   (``gpu_check --rates``);
3. ``numerics-2``, ``numerics-4``: ``gpu_check``'s bf16 parity rows of every style with 2 and 4
   ranks sharing the GPU over gloo, and ``numerics-1``, CP degree 1 on NCCL, the fallback when
   the 2 ranks failed;
4. ``stand-in-long``: a longer recipe (8B 256K), with what time is left.

On CPU (``--device cpu``) the same parts run the debug model (rank 0 of 4 for the stand-in and the
rates, 2 ranks for the numerics, whose CPU run also measures gpu_check's own step); that is what
CI runs, so the script cannot rot. Plans made beforehand (``scripts/gpu_plans.sh``, in
``.gpu_plans/``) are used when they match the job; otherwise the stand-in plans on the machine.

OUTDIR gets ``report.md`` (each part's own printout), ``report.json`` (each part's status,
seconds, command and structured result) and ``evidence.log`` (everything every part wrote).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLANS = REPO / ".gpu_plans"
"""Plans made beforehand (``scripts/gpu_plans.sh``) and the commit they were made at."""
LOG_TAIL = 40
"""Lines of a failed part's output quoted in the report."""


@dataclasses.dataclass(frozen=True)
class Part:
    """One check: its command (``{json}`` stands for the file its result goes to), its time
    limit, and the least time worth starting it with."""

    name: str
    what: str
    command: tuple[str, ...]
    limit_s: float
    least_s: float = 30.0
    env: tuple[tuple[str, str], ...] = ()
    fallback_for: str = ""
    """Run only when that part did not pass (CP degree 1 when ranks sharing the GPU fail)."""


def _python(args: str) -> tuple[str, ...]:
    return (sys.executable, "-m", *shlex.split(args))


def _torchrun(ranks: int, args: str) -> tuple[str, ...]:
    return _python(f"torch.distributed.run --standalone --nproc_per_node {ranks} {args}")


CHECK = "upipe_dtensor.gpu_check"
DEBUG = (
    "--config train_configs/debug_model.toml --parallelism.context_parallel_degree 4 "
    "--training.local_batch_size 1"
)
"""The CPU parts' job: the debug model as rank 0 of 4, one sequence per step."""
ONE_THREAD = (("OMP_NUM_THREADS", "1"),)
"""A CPU part's process gets one thread, as torchrun gives each CPU rank."""


def parts(device: str) -> list[Part]:
    """The parts for ``device`` (module docstring); limits are seconds of wall time, the GPU's
    estimated for one H100 (docs/gpu.md)."""
    if device == "cpu":
        return [
            Part(
                "stand-in",
                "the debug model's rank 0 of 4 on CPU, beside its CPU plan",
                _python(f"{CHECK} --stand-in --device cpu {DEBUG} --steps 1 --json {{json}}"),
                180,
                env=ONE_THREAD,
            ),
            Part(
                "rates",
                "the debug step's kernels timed alone",
                _python(f"{CHECK} --rates --device cpu {DEBUG} --json {{json}}"),
                90,
                env=ONE_THREAD,
            ),
            Part(
                "numerics-2",
                "every style's parity on 2 CPU ranks, and gpu_check's own step",
                _torchrun(
                    2,
                    f"-m {CHECK} --device cpu --flavor debugmodel --tokens-per-gpu 128 "
                    "--json {json}",
                ),
                480,  # its step compiles the debug model with inductor: C++ on CPU
            ),
        ]
    plans = f"--plan {shlex.quote(str(PLANS))}"
    return [
        Part(
            "stand-in",
            "Llama3-8B 128K: rank 0 of 8 on this GPU, beside its plan",
            _python(
                f"{CHECK} --stand-in --config recipes/llama3_8b_128K.toml {plans} --json {{json}}"
            ),
            210,
            120,
        ),
        Part(
            "rates",
            "the 8B 128K step's kernels timed alone, beside the model's ranges",
            _python(f"{CHECK} --rates --config recipes/llama3_8b_128K.toml --json {{json}}"),
            60,
        ),
        *(
            Part(
                f"numerics-{ranks}",
                f"every style's bf16 parity, {ranks} ranks sharing the GPU over gloo",
                _torchrun(ranks, f"-m {CHECK} --no-step --json {{json}}"),
                limit,
            )
            for ranks, limit in ((2, 75), (4, 90))
        ),
        Part(
            "numerics-1",
            "every style at CP degree 1 on NCCL, run when 2 ranks sharing the GPU failed",
            _torchrun(1, f"-m {CHECK} --no-step --json {{json}}"),
            45,
            fallback_for="numerics-2",
        ),
        Part(
            "stand-in-long",
            "Llama3-8B 256K: rank 0 of 8 on this GPU, one timed step",
            _python(
                f"{CHECK} --stand-in --config recipes/llama3_8b_256K.toml {plans} --steps 1 "
                "--json {json}"
            ),
            240,
            150,
        ),
    ]


def _commit() -> str:
    """The commit this tree is at (git, else the one ``scripts/gpu_plans.sh`` recorded)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode == 0:
            dirty = subprocess.run(
                ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True, text=True, timeout=10,
            ).stdout.strip()  # fmt: skip
            return head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    recorded = PLANS / "commit.txt"
    if recorded.is_file():
        return recorded.read_text().strip() + " (recorded by scripts/gpu_plans.sh)"
    return "unknown"


def environment(device: str) -> dict:
    """What ran the parts: date, machine, GPU and driver, torch and its CUDA and cuDNN, commit."""
    import torch

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
        "device": device,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device == "cuda" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env |= {
            "gpu": torch.cuda.get_device_name(0),
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "gpu_count": torch.cuda.device_count(),
            "cudnn": torch.backends.cudnn.version(),
        }
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        env["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
    return env


def _stop(process: subprocess.Popen) -> None:
    """End a part that ran out of time: its whole process group (torchrun and its ranks)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def run_part(part: Part, limit_s: float, scratch: Path, log) -> dict:
    """Run one part within ``limit_s`` seconds; its status, time, output and result."""
    result_file = scratch / f"{part.name}.json"
    command = [arg.replace("{json}", str(result_file)) for arg in part.command]
    out_file, err_file = scratch / f"{part.name}.out", scratch / f"{part.name}.err"
    log.write(f"\n===== {part.name}: {shlex.join(command)} (limit {limit_s:.0f} s)\n")
    log.flush()
    began = time.monotonic()
    with out_file.open("w") as out, err_file.open("w") as err:
        env = os.environ | {"PYTHONUNBUFFERED": "1"} | dict(part.env)
        process = subprocess.Popen(
            command, cwd=REPO, stdout=out, stderr=err, start_new_session=True, env=env
        )
        try:
            returncode = process.wait(timeout=limit_s)
            status = "ok" if returncode == 0 else f"failed (exit {returncode})"
        except subprocess.TimeoutExpired:
            _stop(process)
            status = f"stopped at its time limit ({limit_s:.0f} s)"
    seconds = time.monotonic() - began
    stdout, stderr = out_file.read_text(errors="replace"), err_file.read_text(errors="replace")
    log.write(stdout + stderr)
    log.write(f"===== {part.name}: {status} in {seconds:.1f} s\n")
    log.flush()
    entry = {
        "what": part.what,
        "status": status,
        "seconds": round(seconds, 1),
        "command": shlex.join(command),
        "output": stdout,
    }
    if result_file.is_file():
        entry["result"] = json.loads(result_file.read_text())
    if status != "ok":
        entry["error_tail"] = "\n".join((stdout + stderr).splitlines()[-LOG_TAIL:])
    return entry


def render(report: dict) -> str:
    """report.md: the environment, a summary of the parts, and each part's own printout."""
    env = report["environment"]
    lines = [
        f"# upipe-dtensor evidence: {env.get('gpu', 'CPU')}, {env['date']}",
        "",
        "| | |",
        "|---|---|",
        *(f"| {key} | {value} |" for key, value in env.items()),
        f"| total | {report['total_s']:.0f} s of a {report['budget_s']:.0f} s budget |",
        "",
        "| part | what | status | seconds |",
        "|---|---|---|---:|",
        *(
            f"| {name} | {part['what']} | {part['status']} | {part.get('seconds', 0):.0f} |"
            for name, part in report["parts"].items()
        ),
    ]
    for name, part in report["parts"].items():
        lines += ["", f"## {name}: {part['status']}", "", f"`{part.get('command', '')}`", ""]
        shown = part.get("output", "").strip() or "(no output)"
        lines += ["```", shown, "```"]
        if part.get("error_tail"):
            lines += [
                "",
                "Last lines of its output and errors:",
                "",
                "```",
                part["error_tail"],
                "```",
            ]
    return "\n".join(lines) + "\n"


def run(device: str, outdir: Path, budget_s: float, only: list[str] | None = None) -> dict:
    """Every part within ``budget_s`` in all; writes OUTDIR/report.{md,json} after each part, so
    they exist whatever ends the run."""
    outdir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    report = {"environment": environment(device), "budget_s": budget_s, "total_s": 0.0, "parts": {}}
    chosen = [part for part in parts(device) if not only or part.name in only]
    with (
        tempfile.TemporaryDirectory(prefix="evidence-") as scratch,
        (outdir / "evidence.log").open("w") as log,
    ):
        for part in chosen:
            left = budget_s - (time.monotonic() - began)
            failed = report["parts"].get(part.fallback_for, {}).get("status", "not run")
            if part.fallback_for and failed == "ok":
                report["parts"][part.name] = {
                    "what": part.what,
                    "status": f"not needed ({part.fallback_for} passed)",
                }
            elif left < part.least_s:
                report["parts"][part.name] = {
                    "what": part.what,
                    "status": f"skipped ({left:.0f} s left, {part.least_s:.0f} needed)",
                }
            else:
                report["parts"][part.name] = run_part(
                    part, min(part.limit_s, left), Path(scratch), log
                )
            report["total_s"] = time.monotonic() - began
            (outdir / "report.json").write_text(json.dumps(report, indent=1))
            (outdir / "report.md").write_text(render(report))
    print(render(report), flush=True)  # the command's output: report.md, also on stdout
    return report


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for all parts (default: 450 on a GPU, 900 on CPU)",
    )
    parser.add_argument("--only", default=None, help="comma-separated part names to run")
    args = parser.parse_args(argv)
    budget = args.budget or (450.0 if args.device == "cuda" else 900.0)
    report = run(args.device, args.outdir, budget, args.only.split(",") if args.only else None)
    passed = all(
        part["status"] == "ok" or part["status"].startswith("not needed")
        for part in report["parts"].values()
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
