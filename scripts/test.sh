#!/usr/bin/env bash
# Set up a virtual environment (once) with the test, docs and lint tools, then run every
# check CI runs: the test suite, ruff, mypy, and the documentation build (warnings fail).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

# The suite runs every store test on a throwaway PostgreSQL cluster too, the full-disk
# tests mount a small tmpfs in a mount namespace of their own, and the dashboard's tests
# run a real browser: bring what a fresh Debian machine lacks (apt-get as root; otherwise
# say which packages to install).
need=()
if [ -z "${ASYNCPLANE_TEST_POSTGRES_URL:-}" ] && ! command -v initdb >/dev/null 2>&1 \
    && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  need+=(postgresql)
fi
command -v unshare >/dev/null 2>&1 || need+=(util-linux)
# Debian's python3 makes a virtual environment only with python3-venv (its ensurepip).
if ! .venv/bin/python -m pip --version >/dev/null 2>&1 \
    && ! "$PYTHON" -c 'import ensurepip, venv' >/dev/null 2>&1; then
  need+=(python3-venv)
fi
# The dashboard's browser tests drive the system's headless Chromium through its driver
# (nothing downloads a browser); fonts so that the screenshots they save show text.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  need+=(chromium chromium-driver fonts-dejavu-core)
fi
if [ "${#need[@]}" -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${need[*]} (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    echo "the tests need these Debian packages: ${need[*]} (sudo apt-get install ${need[*]})" >&2
    exit 1
  fi
fi

. scripts/_venv.sh
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
.venv/bin/python -m pytest "$@"
.venv/bin/ruff check src tests examples benchmarks
.venv/bin/ruff format --check src tests examples benchmarks
.venv/bin/mypy
site_dir="$(mktemp -d)"
trap 'rm -rf "$site_dir"' EXIT
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet --site-dir "$site_dir"
echo "all checks passed"
