#!/usr/bin/env bash
# Screenshot the published asv site (asv_bench/html) in headless Chromium, as the docs show it.
#
#   asv_bench/screenshot.sh OUT.png [PAGE] [WIDTHxHEIGHT]
#   e.g. asv_bench/screenshot.sh docs/img/asv-mlp.png '#mlp.ForumMLP.time_train_step'
#
# Serves the site on a loopback port for the duration (asv's pages load their data with
# requests that file:// URLs refuse). Needs Debian's `chromium` package.
#
# asv's pages load jQuery, flot and bootstrap from public CDNs. On a machine without internet
# (only package registries), set ASV_OFFLINE_JS=1: the same releases are fetched once with
# `npm pack` into ~/.cache/blockdiag/asv-js and a copy of the site is pointed at them.
set -euo pipefail
out="$(realpath -m "$1")"
page="${2:-}"
size="${3:-1400x900}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ -f "$here/html/index.html" ] || { echo "screenshot.sh: run history.sh (asv publish) first" >&2; exit 1; }
site="$here/html"
tmp="$(mktemp -d)"
server=""
trap '[ -n "$server" ] && kill "$server"; rm -rf "$tmp"' EXIT

if [ "${ASV_OFFLINE_JS:-0}" = 1 ]; then
    vendor="${XDG_CACHE_HOME:-$HOME/.cache}/blockdiag/asv-js"
    if [ ! -f "$vendor/.complete" ]; then
        mkdir -p "$vendor/pkg"
        (cd "$vendor/pkg" && npm pack --silent jquery@3.3.1 flot@0.8.3 flot-orderbars@1.0.0 \
            blueimp-md5@2.19.0 bootstrap@3.1.1 stupid-table-plugin@1.1.3 >/dev/null)
        for f in "$vendor"/pkg/*.tgz; do d="${f%.tgz}"; mkdir -p "$d"; tar xzf "$f" -C "$d"; done
        p="$vendor/pkg"
        # Named as the CDN files are, so the page only needs its host part rewritten.
        cp "$p/jquery-3.3.1/package/dist/jquery.min.js" "$vendor/jquery-3.3.1.min.js"
        for m in "" .time .selection .categories; do
            cp "$p/flot-0.8.3/package/jquery.flot$m.js" "$vendor/jquery.flot$m.min.js"
        done
        cp "$p/flot-orderbars-1.0.0/package/js/jquery.flot.orderBars.js" "$vendor/"
        cp "$p/stupid-table-plugin-1.1.3/package/stupidtable.min.js" "$vendor/"
        cp "$p/blueimp-md5-2.19.0/package/js/md5.min.js" "$vendor/"
        cp "$p/bootstrap-3.1.1/package/dist/js/bootstrap.min.js" "$vendor/"
        cp "$p/bootstrap-3.1.1/package/dist/css/bootstrap.min.css" "$vendor/"
        touch "$vendor/.complete"
    fi
    cp -r "$here/html/." "$tmp/"
    mkdir -p "$tmp/vendor"
    cp "$vendor"/*.js "$vendor"/*.css "$tmp/vendor/"
    # Same releases, but not byte-identical builds (npm ships flot unminified): drop the
    # subresource-integrity hashes along with the CDN hosts.
    sed -i -E -e 's#"https://(code\.jquery\.com|cdnjs\.cloudflare\.com|cdn\.jsdelivr\.net)/([^"]*/)?([^/"]+)"#"vendor/\3"#g' \
        -e 's# integrity="[^"]*"##g' "$tmp"/*.html
    site="$tmp"
fi

port="${PORT:-8765}"
python3 -m http.server "$port" --bind 127.0.0.1 --directory "$site" >/dev/null 2>&1 &
server=$!
sleep 1
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --window-size="${size/x/,}" --virtual-time-budget=15000 \
    --screenshot="$out" "http://127.0.0.1:$port/index.html$page" 2>/dev/null
echo "screenshot.sh: wrote $out"
