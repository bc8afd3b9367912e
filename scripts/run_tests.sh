#!/usr/bin/env bash
# Installs the package with its test dependencies (torch's CPU build on these machines, fovi for
# the drop-in tests) and runs the linter and the test suite. GPU tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --no-deps "fovi==2.4.0" "timm==1.0.31"
python3 -m pip install --quiet "torch==2.13.0" -e ".[dev,fovi]"
ruff check src tests scripts examples
python3 -m pytest -q -p no:cacheprovider "$@"
