#!/usr/bin/env bash
# Benchmark the last N commits of main (default 5; BRANCH=name for another branch) and publish the HTML history report.
#
#   asv_bench/history.sh [N] [extra asv run args...]
#   (cd asv_bench && asv preview)        # serve asv_bench/html on http://127.0.0.1:8080
#
# Each commit is built into asv's virtualenv (torch pinned to 2.13.0 from the local wheel,
# see asv.conf.json); commits already benchmarked on this machine are skipped, so re-running
# after a merge only measures the new ones. Results go to asv_bench/results, the site to
# asv_bench/html (both git-ignored). Extra arguments go to `asv run`, e.g. `--quick` or
# `-b matmul`.
set -euo pipefail
n="${1:-5}"
shift || true
case "$n" in ''|*[!0-9]*) echo "history.sh: N must be a positive integer, got '$n'" >&2; exit 2;; esac
if [ "$n" -lt 1 ]; then echo "history.sh: N must be at least 1, got $n" >&2; exit 2; fi

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
asv="${ASV:-asv}"
"$asv" machine --yes >/dev/null
# The last N first-parent commits of main (each merge counts once; works however short the
# history is); --skip-existing-commits keeps reruns incremental.
hashes="$(mktemp)"
trap 'rm -f "$hashes"' EXIT
git rev-list --first-parent -n "$n" "${BRANCH:-main}" > "$hashes"
echo "history.sh: benchmarking $(wc -l < "$hashes") commit(s) of ${BRANCH:-main}"
"$asv" run --skip-existing-commits --show-stderr "$@" "HASHFILE:$hashes" || {
    # asv exits non-zero when some benchmark failed; the others still land in the report.
    echo "history.sh: asv run reported failures (see above); publishing what was measured" >&2
}
"$asv" publish
echo "history.sh: published $(pwd)/html; browse it with: (cd $here && $asv preview)"
