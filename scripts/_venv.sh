# Sourced by demo.sh and test.sh: make .venv here once (removed if that fails, half
# made); one without pip (made by Debian's python3 before python3-venv was installed, or
# by uv) is given pip, and otherwise left as it is.
if [ ! -e .venv ]; then
  "$PYTHON" -m venv .venv || { rm -rf .venv; exit 1; }
fi
if ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  .venv/bin/python -m ensurepip --upgrade >/dev/null 2>&1 || {
    echo ".venv has no pip, and ensurepip cannot give it one: install python3-venv" >&2
    exit 1
  }
fi
