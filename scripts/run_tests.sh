#!/usr/bin/env bash
# Installs the package with its test dependencies (torch's CPU build on these machines, fovi for
# the drop-in tests) and runs the linter and the test suite. GPU tests skip without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet "torch==2.13.0" -e ".[dev,fovi]"
# fovi and timm go in last, without their own requirements (fovi's pull CUDA-only wheels and
# torchvision; the fovi extra holds what fovi.models imports). After an install pip checks the
# requirements of what it installed and of what depends on that, so with fovi already in place
# the extras' install would report fovi's unmet ones as an error; --no-deps skips that check.
# The import then says whether fovi.models has what it needs.
python3 -m pip install --quiet --no-deps "fovi==2.4.0" "timm==1.0.31"
python3 -c "import fovi.models"
echo "run_tests: fovi 2.4.0 and timm 1.0.31 installed without their own requirements;" \
  "fovi.models imports"
ruff check src tests scripts examples
python3 -m pytest -q -p no:cacheprovider "$@"
