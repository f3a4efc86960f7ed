#!/usr/bin/env bash
# Set up a virtual environment (once) and run the fleet demo on an embedded SQLite file.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
. scripts/_venv.sh
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e .
exec .venv/bin/python examples/fleet.py "$@"
