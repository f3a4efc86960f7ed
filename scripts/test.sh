#!/usr/bin/env bash
# Set up a virtual environment (once) with the test, docs and lint tools, then run every
# check CI runs: the test suite, ruff, mypy, and the documentation build (warnings fail).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
.venv/bin/python -m pytest "$@"
.venv/bin/ruff check src tests examples benchmarks
.venv/bin/ruff format --check src tests examples benchmarks
.venv/bin/mypy
site_dir="$(mktemp -d)"
trap 'rm -rf "$site_dir"' EXIT
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site_dir"
echo "all checks passed"
