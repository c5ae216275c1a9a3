#!/usr/bin/env bash
# Benchmark the last N first-parent commits of main (default 8; BRANCH=name for another
# branch) and publish the HTML history report, ready to browse offline.
#
#   asv_bench/history.sh [N] [extra asv run args...]
#   asv_bench/history.sh 8 -b '^ratios\.' -b '^mlp\.'    # what docs/performance-history.md shows
#   asv_bench/preview.sh                                   # serve it on http://127.0.0.1:8080
#
# Each commit is built into asv's virtualenv (torch pinned to 2.13.0, see asv.conf.json: on a
# CPU-only Linux machine export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# first, or pip installs PyPI's CUDA build); commits already benchmarked on this machine are
# skipped, so re-running after a merge only measures the new ones. Results go to asv_bench/results, the site to
# asv_bench/html (both git-ignored). Extra arguments go to `asv run` (`-b REGEX` selects
# benchmarks). `--quick` is refused: one sample per benchmark is a smoke test, and its
# numbers in a published history look like regressions that are only noise. The run is
# `nice`d (NICE=0 to turn that off) so that others sharing the machine keep their share.
set -euo pipefail
n="${1:-8}"
shift || true
case "$n" in ''|*[!0-9]*) echo "history.sh: N must be a positive integer, got '$n'" >&2; exit 2;; esac
if [ "$n" -lt 1 ]; then echo "history.sh: N must be at least 1, got $n" >&2; exit 2; fi
for a in "$@"; do
    case "$a" in
        --quick|-q)
            echo "history.sh: --quick takes one sample per benchmark: never publish it as history" >&2
            echo "            (smoke-test the suite with .ci/asv_check.sh instead)" >&2
            exit 2 ;;
    esac
done

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
asv="${ASV:-asv}"
"$asv" machine --yes >/dev/null
# The last N first-parent commits of main (each merge counts once; works however short the
# history is); --skip-existing-commits keeps reruns incremental.
hashes="$(mktemp)"
trap 'rm -f "$hashes"' EXIT
git rev-list --first-parent -n "$n" "${BRANCH:-main}" > "$hashes"
echo "history.sh: benchmarking $(wc -l < "$hashes") commit(s) of ${BRANCH:-main}; load average: $(cut -d' ' -f1-3 /proc/loadavg)"
nice -n "${NICE:-10}" "$asv" run --skip-existing-commits --show-stderr "$@" "HASHFILE:$hashes" || {
    # asv exits non-zero when some benchmark failed; the others still land in the report.
    echo "history.sh: asv run reported failures (see above); publishing what was measured" >&2
}
echo "history.sh: done; load average: $(cut -d' ' -f1-3 /proc/loadavg)"
"$asv" publish
"$here/preview.sh" --no-serve
echo "history.sh: published $here/html; browse it offline with: $here/preview.sh"
