#!/usr/bin/env bash
# The main job on a fresh machine: installs knnconv with the demo's dependencies and, where
# torch sees an NVIDIA GPU, the CuPy build for torch's CUDA major version (the native kernels
# compile through it), then trains the demo network. Arguments go to `knnconv demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet "torch==2.13.0" -e ".[demo]"
cuda_extra=$(python3 -c "import torch
print('cuda' + torch.version.cuda.split('.')[0] if torch.cuda.is_available() else '')")
if [ -n "$cuda_extra" ]; then
  python3 -m pip install --quiet -e ".[demo,$cuda_extra]"
fi
exec knnconv demo "$@"
