#!/usr/bin/env bash
# CI smoke test of the asv suite: every benchmark imports, is well-formed, and runs once on a
# tiny grid (BLOCKDIAG_ASV_GRID=tiny) in the current Python, so a broken benchmark fails CI.
# Installs nothing: needs asv and blockdiag's dependencies in $PYTHON (default: python).
# About a minute on 2 cores (under 3 minutes on a busy machine); exits non-zero on any failure.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python}"
cd "$root/asv_bench"
# asv drops PYTHONPATH in the benchmark processes; ASV_PYTHONPATH is how it passes one on, so
# the checkout under test is benchmarked whatever blockdiag the interpreter has installed.
export ASV_PYTHONPATH="$root" BLOCKDIAG_ASV_GRID=tiny

# Benchmark parameter lists must be static across commits (see benchmarks/common.py).
PYTHONPATH="$root" "$py" - <<'PY'
import sys
sys.path.insert(0, ".")
from benchmarks.common import KNOWN_BACKENDS, list_backends
missing = [b.name for b in list_backends() if b.name not in KNOWN_BACKENDS]
if missing:
    sys.exit(f"asv_check: add {missing} to KNOWN_BACKENDS in asv_bench/benchmarks/common.py")
PY

"$py" -m asv machine --yes >/dev/null
"$py" -m asv check --python=same
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
# --dry-run: nothing is written to results/; the tiny grid must never mix with real numbers.
"$py" -m asv run --python=same --quick --dry-run --show-stderr 2>&1 | tee "$log"
# asv's exit status does not always reflect a failed benchmark; its report does.
if grep -qE "failed$|Traceback|asv: benchmark failed" "$log"; then
    echo "asv_check: a benchmark failed (see above)" >&2
    exit 1
fi
echo "asv_check: ok"
