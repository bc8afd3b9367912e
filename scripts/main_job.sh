#!/usr/bin/env bash
# The main job on a fresh machine: installs knnconv with the demo's dependencies and, where
# torch sees an NVIDIA GPU, the CuPy build for torch's CUDA major version (the native kernels
# compile through it), then trains the demo network. Arguments go to `knnconv demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
# Without an NVIDIA GPU, torch's CPU build: the default index's Linux wheel brings gigabytes of
# CUDA libraries that a CPU cannot use. Where PyTorch's CPU index cannot serve it (unreachable,
# offline; one retry and a short timeout, so that this takes seconds), the default index's torch
# installs below.
cpu_index=https://download.pytorch.org/whl/cpu
if ! nvidia-smi > /dev/null 2>&1; then
  if python3 -m pip install --quiet --retries 1 --timeout 30 --index-url "$cpu_index" \
      "torch==2.13.0" > /dev/null 2>&1; then
    echo "main_job: no NVIDIA GPU: torch's CPU build, from $cpu_index"
  else
    echo "main_job: no NVIDIA GPU, $cpu_index unreachable: torch from the default index"
  fi
fi
python3 -m pip install --quiet "torch==2.13.0" -e ".[demo]"
cuda_extra=$(python3 -c "import torch
print('cuda' + torch.version.cuda.split('.')[0] if torch.cuda.is_available() else '')")
if [ -n "$cuda_extra" ]; then
  python3 -m pip install --quiet -e ".[demo,$cuda_extra]"
fi
exec knnconv demo "$@"
