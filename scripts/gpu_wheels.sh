#!/usr/bin/env bash
# Wheels for the GPU device machine (its image lacks our pure-Python dependencies): cp312
# manylinux wheels into .whl/ (ignored by git), nixl's CUDA 13 wheel trimmed to its UCX backend.
# Run once here before a device call that carries .whl; scripts/gpu_check.sh unpacks them there.
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_wheels.py "$@"
