#!/usr/bin/env bash
# Turn a lent GPU's minutes into evidence, in one call (upipe_dtensor/verify/evidence.py):
#
#   bash scripts/gpu_evidence.sh OUTDIR                 # on the GPU machine
#   bash scripts/gpu_evidence.sh --device cpu OUTDIR    # the same parts on small shapes (CI)
#
# Before the lease, here: `bash scripts/gpu_wheels.sh` (what the GPU machine lacks, into .whl/)
# and `bash scripts/gpu_plans.sh` (the plans the report compares with, into .gpu_plans/); the
# device call carries both folders. Extra arguments go to the Python driver (--budget SECONDS,
# --only stand-in,rates,...). OUTDIR gets report.md, report.json and evidence.log even when a
# part fails; the exit status is 0 only when every part passed.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
device=cuda
if [ "${1:-}" = "--device" ]; then
    device=${2:?--device needs cuda or cpu}
    shift 2
fi
out=${1:?usage: scripts/gpu_evidence.sh [--device cpu] OUTDIR [--budget SECONDS] [--only PARTS]}
shift
site=/tmp/upipe-evidence-site
pythonpath=$PWD
if [ "$device" = cuda ] && compgen -G ".whl/*.whl" >/dev/null; then
    # The lent GPU machine's Python 3.12 (gpu_wheels.sh checked the set against its packages): no
    # index, no dependency resolution, into a folder put first on the path. Not on CPU runs.
    if "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl; then
        pythonpath=$PWD:$site
    else
        echo "gpu_evidence: installing the carried wheels (.whl/) failed; going on without" >&2
    fi
fi
export PYTHONPATH=$pythonpath${PYTHONPATH:+:$PYTHONPATH}
exec "$python" -m upipe_dtensor.verify.evidence --device "$device" "$out" "$@"
