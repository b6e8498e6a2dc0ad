#!/usr/bin/env bash
# One-call GPU check of sinklens (see benchmarks/gpu_check.py and docs/gpu.md).
#   benchmarks/gpu_check.sh [--wheels DIR] [--authors DIR] [--out FILE] ...   # on the GPU machine
#   benchmarks/gpu_check.sh --fetch-wheels DIR [PY_VERSION]                    # on a machine with network:
# fills DIR with the wheels a stock CUDA PyTorch image (x86-64; Python 3.12 unless PY_VERSION) lacks
# beyond torch, transformers, numpy, scipy, matplotlib, einops, jaxtyping, tqdm, safetensors, pytest.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [[ "${1:-}" == "--fetch-wheels" ]]; then
  dir=${2:?usage: gpu_check.sh --fetch-wheels DIR [PY_VERSION]}; mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${3:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" \
    transformer-lens==4.3.0 tyro docstring-parser gguf typeguard beartype fancy-einsum datasets dill multiprocess \
    better-abc pytest-xdist execnet
  ls "$dir"; exit 0
fi
exec python3 "$here/gpu_check.py" "$@"
