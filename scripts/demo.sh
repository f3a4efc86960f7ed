#!/usr/bin/env bash
# Set up a virtual environment (once) and run the fleet demo on an embedded SQLite file.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# (A venv Debian's python3 made without python3-venv has a python but no pip: made again.)
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  "$PYTHON" -m venv --clear .venv || { rm -rf .venv; exit 1; }
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e .
exec .venv/bin/python examples/fleet.py "$@"
