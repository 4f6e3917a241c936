#!/usr/bin/env bash
# Unpacks gzip-compressed binaries carried to the GPU machine (gpu-bin/*/NAME.gz -> NAME), so that
# several builds fit in the device tool's 64 MiB carry: bash scripts/gpu_unpack.sh [DIR]
set -euo pipefail
for f in $(find "${1:-gpu-bin}" -name '*.gz'); do
  gunzip -c "$f" > "${f%.gz}" && chmod +x "${f%.gz}" && rm -f "$f"
done
