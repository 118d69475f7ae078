#!/usr/bin/env bash
# Stage, into the git-ignored .device/, what a GPU host without Bazel needs for the GPU tests
# and benchmarks: the CUBINs, manifests and JIT source lists of `bazel build //kernels:all`,
# and CUTLASS's headers (the JIT tests compile against them). Then carry `.device` to the
# GPU host and run tools/device_run.sh there.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ ! -f bazel-bin/kernels/manifest.json ]]; then
  echo "stage_device: no bazel-bin/kernels/manifest.json: run 'npx bazelisk build //kernels:all' first" >&2
  exit 1
fi
# The headers the JIT would use: cubinstore/_jit/family.py's cutlass_include() is the one lookup.
cutlass_include="$(.venv/bin/python -c '
import sys
from cubinstore.internals import cutlass_include
from cubinstore.errors import BadArgumentError
try:
    print(cutlass_include())
except BadArgumentError as exc:
    sys.exit(f"stage_device: {exc}")
')"

rm -rf .device
mkdir -p .device/kernels
# -L: bazel-bin holds links into the output base; the GPU host gets the bytes. The PTX of families
# built with `ptx = [...]` too: the manifest names it, and the PTX tests load it.
dest="$PWD/.device/kernels"  # bazel-bin is a link: a relative path from inside it leads elsewhere
(cd bazel-bin/kernels && find -L . -type f \( -name '*.cubin' -o -name '*.ptx' -o -name '*.json' \) -print0 |
  while IFS= read -r -d '' f; do mkdir -p "$dest/$(dirname "$f")"; cp -L "$f" "$dest/$f"; done)
cp -rL "$cutlass_include" .device/cutlass_include
echo "staged $(find .device/kernels -name '*.cubin' | wc -l) CUBINs, $(find .device/kernels -name '*.ptx' | wc -l) PTX files and CUTLASS headers in .device ($(du -sh .device | cut -f1))"
# The kernel library fixture's kernels, compiled through cubinstore-nvcc (tests/nvcc/test_nvcc_gpu.py).
.venv/bin/python tests/nvcc/stage_gpu.py .device/nvcc
# The split-protocol variants of benchmarks/gemm_split_cost.py (tools/device_run.sh splitcost).
.venv/bin/python benchmarks/gemm_split_cost.py build --out .device/split_cost
