#!/usr/bin/env bash
# Serve the published asv site (asv_bench/html) offline, with the vendored JavaScript.
#
#   asv_bench/preview.sh [PORT]      # http://127.0.0.1:PORT/ (default 8080); Ctrl-C stops it
#   asv_bench/preview.sh --no-serve  # only make asv_bench/html work offline, then exit
#
# asv's pages load jQuery, flot and bootstrap from public CDNs and show only "Can not
# determine continental origin of swallow" without internet. This copies the same releases
# from asv_bench/vendor/ (MIT; see vendor/README.md) into html/vendor/ and points the pages
# at them (the CDN hosts and their subresource-integrity hashes dropped). It rewrites the
# published site in place: it is git-ignored and `asv publish` rewrites it anyway, so run
# this again after every publish (history.sh does). After it, `asv preview` works offline too.
# The site is served on the loopback address only.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
site="$here/html"
serve=1
port="${PORT:-8080}"
for a in "$@"; do
    case "$a" in
        --no-serve) serve=0 ;;
        -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}"; exit 0 ;;
        ''|*[!0-9]*) echo "preview.sh: unknown argument '$a' (PORT or --no-serve)" >&2; exit 2 ;;
        *) port="$a" ;;
    esac
done
[ -f "$site/index.html" ] || {
    echo "preview.sh: no published site in $site: run asv_bench/history.sh (or asv publish) first" >&2
    exit 1
}

mkdir -p "$site/vendor"
cp "$here"/vendor/*.js "$here"/vendor/*.css "$here/vendor/LICENSES.txt" "$site/vendor/"
# https://<cdn host>/<path>/<file> -> vendor/<file>; the vendored copies are the same releases
# but not byte-identical builds, so the integrity hashes go too.
sed -i -E \
    -e 's#"https://(code\.jquery\.com|cdnjs\.cloudflare\.com|cdn\.jsdelivr\.net)/([^"]*/)?([^/"]+)"#"vendor/\3"#g' \
    -e 's# integrity="[^"]*"##g' \
    "$site"/*.html
# Fail loudly if a newer asv loads something this script does not know about.
left="$(grep -ohE '"https?://[^"]+\.(js|css)"' "$site"/*.html | sort -u || true)"
if [ -n "$left" ]; then
    echo "preview.sh: the site still loads these from the internet (vendor them):" >&2
    echo "$left" >&2
    exit 1
fi
missing=""
for f in $(grep -ohE '"vendor/[^"]+"' "$site"/*.html | tr -d '"' | sort -u); do
    [ -f "$site/$f" ] || missing="$missing $f"
done
if [ -n "$missing" ]; then
    echo "preview.sh: referenced but not vendored:$missing (see asv_bench/vendor/fetch.sh)" >&2
    exit 1
fi
if [ "$serve" = 0 ]; then
    echo "preview.sh: $site works offline"
    exit 0
fi
echo "preview.sh: serving $site on http://127.0.0.1:$port/ (Ctrl-C stops)"
exec python3 -m http.server "$port" --bind 127.0.0.1 --directory "$site"
