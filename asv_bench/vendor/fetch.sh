#!/usr/bin/env bash
# Re-create this folder's files from their npm packages (needs npm and the npm registry).
#
#   asv_bench/vendor/fetch.sh
#
# asv's pages load jQuery, flot, bootstrap, md5 and stupidtable from public CDNs; these are
# the same releases, named as the CDN files are, so that preview.sh only rewrites the URLs'
# host part. npm ships flot 0.8.3 unminified: the jquery.flot*.min.js files here are the
# unminified sources under the CDN's names. stupidtable is 1.1.3 (the CDN's 1.0.1 is not on
# npm; the API asv uses is the same). Licenses: LICENSES.txt (all MIT).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent jquery@3.3.1 flot@0.8.3 flot-orderbars@1.0.0 \
    blueimp-md5@2.19.0 bootstrap@3.1.1 stupid-table-plugin@1.1.3 >/dev/null)
for f in "$tmp"/*.tgz; do d="${f%.tgz}"; mkdir -p "$d"; tar xzf "$f" -C "$d"; done
p="$tmp"
cp "$p/jquery-3.3.1/package/dist/jquery.min.js" "$here/jquery-3.3.1.min.js"
for m in "" .time .selection .categories; do
    cp "$p/flot-0.8.3/package/jquery.flot$m.js" "$here/jquery.flot$m.min.js"
done
cp "$p/flot-orderbars-1.0.0/package/js/jquery.flot.orderBars.js" "$here/"
cp "$p/stupid-table-plugin-1.1.3/package/stupidtable.min.js" "$here/"
cp "$p/blueimp-md5-2.19.0/package/js/md5.min.js" "$here/"
cp "$p/bootstrap-3.1.1/package/dist/js/bootstrap.min.js" "$here/"
cp "$p/bootstrap-3.1.1/package/dist/css/bootstrap.min.css" "$here/"
chmod 644 "$here"/*.js "$here"/*.css
echo "vendor/fetch.sh: refreshed $(ls "$here"/*.js "$here"/*.css | wc -l) files in $here"
