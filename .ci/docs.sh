#!/usr/bin/env bash
# CI for the documentation: run the Quickstart's code, check every docstring as the API
# reference parses it, then build the site with warnings as errors. Installs nothing: needs
# the `docs` extra (mkdocs, mkdocs-material, mkdocstrings, ruff) and blockdiag's
# dependencies in $PYTHON (default: python). Exits non-zero on any failure:
#   - the Quickstart example fails;
#   - griffe warns about any docstring of the package (docs/griffe_docstrings.py: a
#     malformed Args/Returns/Raises section, a parameter that is not in the signature),
#     rendered on a page or not;
#   - `mkdocs build --strict` warns (broken links, missing pages, a generated section whose
#     results file is missing), or its log has a griffe WARNING line or says that signatures
#     could not be formatted (ruff or black missing).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python}"
cd "$root"
PYTHONPATH="$root" "$py" docs/quickstart_example.py
PYTHONPATH="$root" "$py" docs/griffe_docstrings.py
site="$(mktemp -d)"
log="$(mktemp)"
trap 'rm -rf "$site" "$log"' EXIT
# (NO_MKDOCS_2_WARNING: mkdocs-material prints a banner about its successor on every build.)
status=0
NO_MKDOCS_2_WARNING=1 "$py" -m mkdocs build --strict --site-dir "$site" >"$log" 2>&1 || status=$?
cat "$log"
if [ "$status" -ne 0 ]; then
    echo "docs: mkdocs build --strict failed" >&2
    exit "$status"
fi
if grep -E "WARNING.*griffe|griffe.*WARNING" "$log" >/dev/null; then
    echo "docs: griffe warnings in the build (above)" >&2
    exit 1
fi
if grep -F "Formatting signatures requires" "$log" >/dev/null; then
    echo "docs: signatures are not formatted: install the docs extra (ruff)" >&2
    exit 1
fi
echo "docs: ok ($(find "$site" -name '*.html' | wc -l) HTML pages)"
