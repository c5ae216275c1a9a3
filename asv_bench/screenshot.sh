#!/usr/bin/env bash
# Screenshot the published asv site (asv_bench/html) in headless Chromium, as the docs show it.
#
#   asv_bench/screenshot.sh OUT.png [PAGE] [WIDTHxHEIGHT]
#   e.g. asv_bench/screenshot.sh docs/img/asv-forum.png '#ratios.ForumMLPRatio.track_grouped_over_loop'
#
# Makes the site work offline first (preview.sh --no-serve: the vendored JavaScript), then
# serves it on a loopback port for the duration (asv's pages load their data with requests
# that file:// URLs refuse). Needs Debian's `chromium` package.
set -euo pipefail
out="$(realpath -m "$1")"
page="${2:-}"
size="${3:-1400x900}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
"$here/preview.sh" --no-serve >/dev/null
port="${PORT:-8765}"
python3 -m http.server "$port" --bind 127.0.0.1 --directory "$here/html" >/dev/null 2>&1 &
server=$!
trap 'kill "$server"' EXIT
sleep 1
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --window-size="${size/x/,}" --virtual-time-budget=15000 \
    --screenshot="$out" "http://127.0.0.1:$port/index.html$page" 2>/dev/null
echo "screenshot.sh: wrote $out"
