#!/usr/bin/env bash
# The Python wheels the lent GPU machine lacks (Python 3.12, x86-64, no network; the device tool's
# notes list what it has), downloaded here into .whl/ for the device call to carry
# (carry [".whl", ".gpu_plans"]; scripts/gpu_evidence.sh installs them there). torchtitan 0.2.2
# and what it imports that the machine does not have: the versions this project's CPU install
# resolves to. Then a check that every requirement of the set is met by the set itself or by a
# package the machine has (as far as its published package list tells: most of its versions are
# not listed, and those are reported as unchecked).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
mkdir -p .whl
wheels=(
    torchtitan==0.2.2
    torchdata==0.11.0
    datasets==5.2.0
    dill==0.4.1
    multiprocess==0.70.19
    tyro==1.0.17
    docstring-parser==0.18.0
    typeguard==4.6.1
    tomli==2.5.0
)
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64; do
    platforms+=(--platform "$tag")
done
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "${wheels[@]}"
"$python" - .whl <<'PY'
"""Check the carried set against itself and the GPU machine's packages."""
import re
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

# The GPU machine's packages (the device tool's KINDS.md, read 2026-11-17; versions where its
# pip list gives them, None where it names the package only). Only the names the set can need.
MACHINE = {
    "torch": "2.11.0", "triton": "3.6.0", "numpy": "2.5.2", "huggingface-hub": "1.33.0",
    "tokenizers": "0.23.2", "safetensors": "0.8.0", "transformers": "5.17.0",
    "tensorboard": None, "pyarrow": None, "pandas": None, "xxhash": None, "fsspec": None,
    "filelock": None, "requests": None, "tqdm": None, "pyyaml": None, "packaging": None,
    "typing-extensions": None, "urllib3": None, "einops": None, "pillow": None, "aiohttp": None,
    "httpx": None, "psutil": None, "jinja2": None, "networkx": None, "sympy": None,
}
env = default_environment() | {"python_version": "3.12", "python_full_version": "3.12.3",
                                "sys_platform": "linux", "platform_machine": "x86_64"}
carried = {}
for wheel in Path(sys.argv[1]).glob("*.whl"):
    name, version = wheel.name.split("-")[:2]
    carried[canonicalize_name(name)] = (Version(version), wheel)
problems, unchecked = [], []
for name, (version, wheel) in sorted(carried.items()):
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(meta).decode().splitlines()
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(env | {"extra": ""}):
            continue
        need = canonicalize_name(req.name)
        if need in carried:
            if not req.specifier.contains(carried[need][0], prereleases=True):
                problems.append(f"{name} needs {req}; carried {carried[need][0]}")
        elif need in MACHINE:
            have = MACHINE[need]
            if have is None:
                unchecked.append(f"{name} needs {req}: the machine has {need}, version unlisted")
            elif not req.specifier.contains(Version(have), prereleases=True):
                problems.append(f"{name} needs {req}; the machine has {have}")
        else:
            problems.append(f"{name} needs {req}: neither carried nor on the machine")
size = sum(w.stat().st_size for _, w in carried.values()) / 2**20
print(f"{len(carried)} wheels, {size:.1f} MiB in .whl/ (the device call carries at most 64 MiB)")
for line in unchecked:
    print("unchecked:", line)
for line in problems:
    print("PROBLEM:", line)
sys.exit(1 if problems else 0)
PY
