#!/usr/bin/env bash
# CI for the documentation: run the Quickstart's code, then build the site with warnings as
# errors. Installs nothing: needs the `docs` extra (mkdocs, mkdocs-material, mkdocstrings)
# and blockdiag's dependencies in $PYTHON (default: python). Exits non-zero on any failure.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python}"
cd "$root"
PYTHONPATH="$root" "$py" docs/quickstart_example.py
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
# (NO_MKDOCS_2_WARNING: mkdocs-material prints a banner about its successor on every build.)
NO_MKDOCS_2_WARNING=1 "$py" -m mkdocs build --strict --site-dir "$site"
echo "docs: ok ($(find "$site" -name '*.html' | wc -l) HTML pages)"
