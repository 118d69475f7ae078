"""Helpers of the JIT tests: a tiny kernel library tree, toolkits that differ on purpose, child processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

TWICE_H = "// a bundled header of the tiny library\ntemplate <typename T> __device__ T twice(T x) { return x + x; }\n"
UNUSED_H = "// reachable but not included\n#pragma once\n"

# A generated TU like a kernel library's: includes the library, one extern "C" entry.
TU = """#include "mylib/twice.cuh"
#ifndef FACTOR
#define FACTOR 1
#endif
extern "C" __global__ void scale(int n, float a, float* x) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) x[i] = twice(x[i]) * a * FACTOR;
}
"""
ENTRIES = {"scale": ["i32", "f32", "ptr"]}


def make_library(prefix: Path) -> Path:
    """The library installed under ``prefix``; returns its include root (``prefix/include``)."""
    include = prefix / "include"
    (include / "mylib").mkdir(parents=True)
    (include / "mylib" / "twice.cuh").write_text(TWICE_H)
    (include / "mylib" / "unused.cuh").write_text(UNUSED_H)
    return include


def real_toolkit() -> Path:
    from cubinstore.internals import locate_toolkit

    return locate_toolkit()[0]


def counting_toolkit(dest: Path, log: Path) -> Path:
    """A toolkit whose nvcc appends a line to ``log`` before running the real one (counts nvcc runs)."""
    real = real_toolkit()
    (dest / "bin").mkdir(parents=True)
    for name in ("nvcc.profile", "cudafe++", "ptxas", "fatbinary"):
        if (real / "bin" / name).exists():
            (dest / "bin" / name).symlink_to(real / "bin" / name)
    nvcc = dest / "bin" / "nvcc"
    nvcc.write_text(f'#!/bin/sh\necho "$$ $*" >> "{log}"\nexec "{real}/bin/nvcc" "$@"\n')
    nvcc.chmod(0o755)
    (dest / "nvvm").symlink_to(real / "nvvm")
    (dest / "include").symlink_to(real / "include")
    return dest


def toolkit_copy_with_changed_header(dest: Path, header: str = "cuda_fp16.h") -> Path:
    """The toolkit's binaries linked, its include tree copied with one header changed."""
    real = real_toolkit()
    (dest / "bin").mkdir(parents=True)
    for item in (real / "bin").iterdir():
        (dest / "bin" / item.name).symlink_to(item)
    (dest / "nvvm").symlink_to(real / "nvvm")
    shutil.copytree(real / "include", dest / "include", symlinks=False)
    with open(dest / "include" / header, "a") as f:
        f.write("\n// changed by a test\n")
    return dest


def child_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUBINSTORE_")}
    env["CUBINSTORE_HOME"] = str(home)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_child(code: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)



def toolkit_copy(dest: Path) -> Path:
    """A toolkit that compiles with its own headers: nvcc and its profile and the include tree
    copied (nvcc finds its include tree from where its binary really is), the rest linked.
    Copies, not hard links: a link to the real toolkit's files would move their ctime and so
    every stat cache of the real toolkit."""
    real = real_toolkit()
    (dest / "bin").mkdir(parents=True)
    for item in (real / "bin").iterdir():
        if item.name in ("nvcc", "nvcc.profile"):
            shutil.copy2(item, dest / "bin" / item.name)
        else:
            (dest / "bin" / item.name).symlink_to(item)
    (dest / "nvvm").symlink_to(real / "nvvm")
    shutil.copytree(os.path.realpath(real / "include"), dest / "include")
    if (real / "targets" / "x86_64-linux" / "include").is_dir():  # where nvcc.profile's -I points
        (dest / "targets" / "x86_64-linux").mkdir(parents=True)
        (dest / "targets" / "x86_64-linux" / "include").symlink_to("../../include")
    return dest
