"""Build the library fixture's kernels through cubinstore-nvcc into ``<out>`` for the GPU host
(``tests/nvcc/test_nvcc_gpu.py``): ``python tests/nvcc/stage_gpu.py .device/nvcc``, run by
``tools/stage_device.sh``. A fresh store and library install under ``<out>/work``; the CUBINs the
library's JIT got are copied to ``<out>/<name>.cubin`` and listed in ``<out>/kernels.json``."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.jit import child_env  # noqa: E402
from helpers.kernel_library import INSTANTIATIONS, LibraryJit, install_library  # noqa: E402


def main(out: Path) -> None:
    work = out / "work"
    shutil.rmtree(out, ignore_errors=True)
    work.mkdir(parents=True)
    include = install_library(work / "venv")
    env = child_env(work / "home")
    lib = LibraryJit(include, work / "cache", Path(sys.executable).with_name("cubinstore-nvcc"), env=env)
    listing = {}
    for inst in INSTANTIATIONS:
        shutil.copyfile(lib.build(inst), out / f"{inst.name}.cubin")
        listing[inst.name] = f"{inst.name}.cubin"
    (out / "kernels.json").write_text(json.dumps(listing, indent=1, sort_keys=True) + "\n")
    shutil.rmtree(work)
    print(f"staged {len(listing)} kernels compiled through cubinstore-nvcc in {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
