"""A pip-installed kernel library whose JIT drives nvcc the way DeepGEMM's does (issue 29).

``install_library`` lays the library out as pip would (``<prefix>/lib/pythonX.Y/site-packages/
mylib/include``: a bundled copy of CuTe/CUTLASS beside the library's own ``mylib/*.cuh``).
``INSTANTIATIONS`` are the 41 kernels its JIT compiles at start-up (as many as DeepGEMM's sm90
start-up did), each with its mangled symbol, cubinstore entry types and a pure-Python reference.
``LibraryJit`` is the JIT: the facts of DeepGEMM's ``csrc/jit/compiler.hpp`` (``nvcc --version``
parsed with ``release (\\d+\\.\\d+)``, a cache key over name, compiler signature, flags and TU
text, the TU written to ``<cache>/tmp/<uuid4>/kernel.cu``, nvcc run from ``<cache>/tmp``, the
directory renamed into ``<cache>/cache/kernel.<name>.<hash>``). Its key holds ``-I<include
root>``, as DeepGEMM's did when the seed measured 41/41 recompiles after a prefix change, so a
relocated install misses its own cache and calls nvcc again: the calls cubinstore-nvcc must serve.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

from helpers.jit import counting_toolkit, real_toolkit

# Where pip puts a pure package under a prefix (the scheme of a venv or `pip install --prefix`).
SITE_PACKAGES = Path("lib") / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
INCLUDE_UNDER_PREFIX = SITE_PACKAGES / "mylib" / "include"
# Where a symlinked install keeps its one real copy of the bundled headers.
SHARED_HEADERS_UNDER_PREFIX = Path("share") / "mylib-third-party" / "include"
BUNDLED = ("cute", "cutlass")

ARCH = "sm_90a"
# The library's own headers. Only light CuTe/CUTLASS headers: each compile stays under a second
# (about 0.9 s on the 2-core host) while every TU still reads bundled CuTe and CUTLASS files.
TYPES_CUH = """// mylib: the element types the kernels take
#pragma once
#include <cute/config.hpp>
#include <cute/numeric/int.hpp>
#include <cutlass/numeric_types.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
"""
AFFINE_CUH = """// mylib: y[i] = alpha * x[i] + beta for i < n, kVec elements a thread
#pragma once
#include "mylib/types.cuh"

namespace mylib {

template <typename T, int kBlock, int kVec>
__global__ void __launch_bounds__(kBlock) affine(T* y, const T* x, float alpha, float beta, int n) {
  const cute::int64_t first = (cute::int64_t(blockIdx.x) * kBlock + threadIdx.x) * kVec;
#pragma unroll
  for (int v = 0; v < kVec; ++v) {
    const cute::int64_t i = first + v;
    if (i < n) y[i] = T(alpha * float(x[i]) + beta);
  }
}

}  // namespace mylib
"""
UNUSED_CUH = "// mylib: shipped, included by no kernel\n#pragma once\n"
LIBRARY_HEADERS = {"mylib/types.cuh": TYPES_CUH, "mylib/affine.cuh": AFFINE_CUH, "mylib/unused.cuh": UNUSED_CUH}
PACKAGE_INIT = '"""mylib: a kernel library with a JIT (a test fixture of cubinstore)."""\n__version__ = "1.0.0"\n'


# -- the instantiations -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ElementType:
    """An element type of the kernel: its label, C++ spelling, Itanium mangling and storage type."""

    label: str
    cxx: str
    mangled: str
    substitutions: int  # substitution candidates its mangling adds (names T_'s index in the symbol)
    storage: str  # cubinstore's element type (f32, f16, bf16, f64): what the buffers hold


ELEMENT_TYPES = (
    ElementType("f32", "float", "f", 0, "f32"),
    ElementType("f16", "__half", "6__half", 1, "f16"),
    ElementType("bf16", "__nv_bfloat16", "13__nv_bfloat16", 1, "bf16"),
    ElementType("cutlass_f16", "cutlass::half_t", "N7cutlass6half_tE", 2, "f16"),
    ElementType("cutlass_bf16", "cutlass::bfloat16_t", "N7cutlass10bfloat16_tE", 2, "bf16"),
    ElementType("f64", "double", "d", 0, "f64"),
)
BLOCKS = (64, 128, 256, 512)
VECS = (1, 2)
ENTRY_TYPES = ("ptr", "ptr", "f32", "f32", "i32")  # (T* y, const T* x, float alpha, float beta, int n)
# Relative error a correct result stays within: the float32 arithmetic, then the storage rounding.
RTOL = {"f32": 2.0**-22, "f64": 2.0**-22, "f16": 2.0**-10, "bf16": 2.0**-7}


@dataclass(frozen=True)
class Instantiation:
    """One kernel the library JIT-compiles: ``mylib::affine<T, block, vec>`` for sm_90a."""

    dtype: ElementType
    block: int
    vec: int

    @property
    def name(self) -> str:
        """Stable name (the JIT's cache directory and file names use it)."""
        return f"affine_{self.dtype.label}_b{self.block}_v{self.vec}"

    @property
    def cxx_name(self) -> str:
        """The readable C++ name of the specialization."""
        return f"mylib::affine<{self.dtype.cxx}, {self.block}, {self.vec}>"

    @property
    def symbol(self) -> str:
        """The mangled ``__global__`` symbol in the CUBIN (the tests check it against nvcc's)."""
        t_ref = f"S{1 + self.dtype.substitutions}_"
        return f"_ZN5mylib6affineI{self.dtype.mangled}Li{self.block}ELi{self.vec}EEEvPT_PK{t_ref}ffi"

    @property
    def entry_types(self) -> tuple[str, ...]:
        return ENTRY_TYPES

    @property
    def entries(self) -> dict[str, list[str]]:
        """``{symbol: types}``, as cubinstore.jit's ``entries=`` takes them."""
        return {self.symbol: list(ENTRY_TYPES)}

    def grid(self, n: int) -> int:
        """Blocks a launch over ``n`` elements needs (``block`` threads, ``vec`` elements each)."""
        per_block = self.block * self.vec
        return max(1, -(-n // per_block))

    def reference(self, x: Sequence[float], alpha: float, beta: float) -> list[float]:
        """What the kernel writes to ``y`` for ``x`` (values as the buffer holds them)."""
        a, b = _to_f32(alpha), _to_f32(beta)
        out = []
        for value in x:
            held = round_to(self.dtype.storage, value)
            exact = Fraction(a) * Fraction(held) + Fraction(b)  # nvcc contracts this into one FMA
            out.append(round_to(self.dtype.storage, _to_f32(float(exact))))
        return out

    @property
    def rtol(self) -> float:
        return RTOL[self.dtype.storage]

    def tu(self) -> str:
        """The generated TU: includes the library, instantiates one kernel by taking its address
        in a host function (DeepGEMM's generated code does the same)."""
        return (
            "#include <mylib/affine.cuh>\n\n"
            "using namespace mylib;\n\n"
            "static void __instantiate_kernel() {\n"
            f"    auto ptr = reinterpret_cast<void*>(&affine<{self.dtype.cxx}, {self.block}, {self.vec}>);\n"
            "};\n"
        )


def _grid() -> tuple[Instantiation, ...]:
    points = [Instantiation(t, b, v) for b in BLOCKS for v in VECS for t in ELEMENT_TYPES]
    return tuple(points[:41])  # the first 41 of the 48-point grid; every element type appears


INSTANTIATIONS: tuple[Instantiation, ...] = _grid()
BY_NAME: Mapping[str, Instantiation] = {inst.name: inst for inst in INSTANTIATIONS}


def _to_f32(value: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", value))[0])


def round_to(storage: str, value: float) -> float:
    """``value`` rounded to the storage type (round to nearest even, as the device converts)."""
    if storage == "f64":
        return float(value)
    if storage == "f32":
        return _to_f32(value)
    if storage == "f16":
        return float(struct.unpack("<e", struct.pack("<e", _to_f32(value)))[0])
    if storage == "bf16":
        (bits,) = struct.unpack("<I", struct.pack("<f", _to_f32(value)))
        if math.isnan(value):
            return value
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return float(struct.unpack("<f", struct.pack("<I", bits))[0])
    raise ValueError(f"unknown storage type {storage!r}: expected f32, f64, f16 or bf16")


# -- installing the library -------------------------------------------------------------------------

def bundled_headers_source() -> Path:
    """The CuTe/CUTLASS headers the library bundles: the project's one lookup (the nvidia-cutlass
    wheel this Python sees, or $CUBINSTORE_CUTLASS_INCLUDE)."""
    from cubinstore.internals import cutlass_include

    return cutlass_include()


def include_root(prefix: Path) -> Path:
    """The library's include root under ``prefix`` (what its JIT passes as ``-I``)."""
    return prefix / INCLUDE_UNDER_PREFIX


def install_library(prefix: Path, *, symlinked: bool = False) -> Path:
    """Install the library at ``prefix`` as pip would; returns its include root.

    ``symlinked``: the include root's ``cute`` and ``cutlass`` are relative symlinks to one real
    copy under ``<prefix>/share/`` (a symlinked tree; ``copy_install`` keeps it intact)."""
    root = include_root(prefix)
    if root.exists():
        raise FileExistsError(f"{root}: the library is already installed at {prefix}")
    source = bundled_headers_source()
    package = root.parent
    (root / "mylib").mkdir(parents=True)
    (package / "__init__.py").write_text(PACKAGE_INIT)
    for relative, text in LIBRARY_HEADERS.items():
        (root / relative).write_text(text)
    for name in BUNDLED:
        if symlinked:
            shared = prefix / SHARED_HEADERS_UNDER_PREFIX / name
            shutil.copytree(source / name, shared)
            (root / name).symlink_to(os.path.relpath(shared, root))
        else:
            shutil.copytree(source / name, root / name)
    return root


def copy_install(src_prefix: Path, dst_prefix: Path) -> Path:
    """The install at ``src_prefix`` copied to ``dst_prefix`` (symlinks kept as links); returns
    the copy's include root. Relocating a venv or a container layer does the same."""
    if not include_root(src_prefix).is_dir():
        raise FileNotFoundError(f"{src_prefix}: no library installed there (no {INCLUDE_UNDER_PREFIX})")
    shutil.copytree(src_prefix, dst_prefix, symlinks=True)
    return include_root(dst_prefix)


# -- nvcc programs ----------------------------------------------------------------------------------

def real_nvcc() -> Path:
    """The real nvcc of the toolkit the project finds."""
    return real_toolkit() / "bin" / "nvcc"


def counting_nvcc(dest_dir: Path, log: Path) -> Path:
    """An nvcc that appends one line (``<pid> <args>``) to ``log`` per run, then execs the real
    one with the same argv. It sits in a toolkit-shaped tree (``helpers.jit.counting_toolkit``)
    so a caller that derives the toolkit from nvcc's location still finds one."""
    return counting_toolkit(dest_dir, log) / "bin" / "nvcc"


def count_runs(log: Path) -> int:
    """Runs a ``counting_nvcc`` logged so far, ``--version`` included (0 when it never ran)."""
    return len(log.read_text().splitlines()) if log.exists() else 0


def count_compiles(log: Path) -> int:
    """Runs a ``counting_nvcc`` logged so far that were not ``nvcc --version``."""
    lines = log.read_text().splitlines() if log.exists() else []
    return sum(1 for line in lines if line.split(" ", 1)[-1] != "--version")


def sccache_nvcc(dest: Path, sccache: Path, nvcc: Path | None = None) -> Path:
    """The two-line script a user sets as the library's compiler to put sccache under it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(f'#!/bin/sh\nexec "{sccache}" "{nvcc or real_nvcc()}" "$@"\n')
    dest.chmod(0o755)
    return dest


# -- the library's JIT ------------------------------------------------------------------------------

class LibraryJitError(RuntimeError):
    """The fixture JIT failed: the message names the kernel or the nvcc program and has its output."""


@dataclass(frozen=True)
class BuildRecord:
    """One ``LibraryJit.build`` call."""

    name: str
    nvcc_ran: bool  # False: the library's own cache had the kernel
    seconds: float  # wall time of the whole build call
    cubin: Path
    argv: tuple[str, ...] = ()  # the nvcc command (empty on a library-cache hit)
    stdout: str = ""
    stderr: str = ""
    returncode: int | None = None
    compiler_seconds: float = 0.0  # wall time of the nvcc process alone (0.0 on a library-cache hit)

    @property
    def output(self) -> str:
        """stdout then stderr, as DeepGEMM reads its compiler's output."""
        return self.stdout + self.stderr


_RELEASE_RE = re.compile(r"release (\d+\.\d+)")
_PTXAS_VERBOSE_RE = re.compile(r"Used \d+ registers")
_LOCAL_MEMORY_RE = re.compile(r"Local memory used")


@dataclass
class LibraryJit:
    """The library's JIT, as DeepGEMM's ``NVCCCompiler`` does it.

    ``nvcc``: any program (the real nvcc, cubinstore-nvcc, an sccache script). ``verbose`` adds
    DeepGEMM's ``--ptxas-options=--verbose,--warn-on-local-memory-usage`` (DG_JIT_PTXAS_VERBOSE)
    and then requires ptxas's per-kernel report ("Used N registers") in the output, so a cache
    that does not replay the compiler's output fails here; ``ptxas_check`` refuses output that
    says "Local memory used" (DG_JIT_PTXAS_CHECK). ``key_has_include_root=False`` models newer
    DeepGEMM, which strips ``-I<include root>`` from its key. ``env``: the environment of every
    nvcc run (default: this process's).
    """

    include_root: Path
    cache_dir: Path
    nvcc: Path
    verbose: bool = False
    ptxas_check: bool = False
    key_has_include_root: bool = True
    env: Mapping[str, str] | None = None
    records: list[BuildRecord] = field(default_factory=list)
    version: str = ""
    version_output: str = ""

    def __post_init__(self) -> None:
        self.nvcc = Path(self.nvcc)
        self.include_root = Path(self.include_root)
        self.cache_dir = Path(self.cache_dir)
        proc = subprocess.run([str(self.nvcc), "--version"], capture_output=True, text=True,
                              env=self._env(), timeout=120)
        self.version_output = proc.stdout + proc.stderr
        match = _RELEASE_RE.search(self.version_output)
        if proc.returncode != 0 or match is None:
            raise LibraryJitError(
                f"{self.nvcc} --version: expected exit 0 and 'release X.Y' in its output, got exit "
                f"{proc.returncode} and {self.version_output[-2000:]!r}"
            )
        self.version = match.group(1)

    def _env(self) -> dict[str, str] | None:
        return dict(self.env) if self.env is not None else None

    @property
    def signature(self) -> str:
        return f"NVCC{self.version}"

    def flags(self) -> list[str]:
        """The flags after ``-cubin -o <out>``, in DeepGEMM's order."""
        flags = ["-std=c++20", "--diag-suppress=39,161,174,177,186,940", "--ptxas-options=--register-usage-level=10"]
        if self.verbose:
            flags.append("--ptxas-options=--verbose,--warn-on-local-memory-usage")
        return flags + [
            f"-I{self.include_root}",
            f"--gpu-architecture={ARCH}",
            "--compiler-options=-fPIC,-O3,-fconcepts,-Wno-deprecated-declarations,-Wno-abi",
            "-O3",
            "--expt-relaxed-constexpr",
            "--expt-extended-lambda",
        ]

    def key(self, inst: Instantiation) -> str:
        """The library's own cache key: name, compiler signature, flags (with ``-I<include root>``
        unless ``key_has_include_root`` is off) and the TU text."""
        flags = self.flags()
        if not self.key_has_include_root:
            flags = [f for f in flags if f != f"-I{self.include_root}"]
        signature = f"{inst.name}$${self.signature}$${' '.join(flags)}$${inst.tu()}"
        return hashlib.sha256(signature.encode()).hexdigest()[:32]

    def cache_path(self, inst: Instantiation) -> Path:
        return self.cache_dir / "cache" / f"kernel.{inst.name}.{self.key(inst)}"

    def build(self, inst: Instantiation) -> Path:
        """The CUBIN of ``inst``: from the library's cache, else compiled by ``nvcc``."""
        start = time.perf_counter()
        final = self.cache_path(inst)
        if (final / "kernel.cubin").is_file():
            self.records.append(BuildRecord(inst.name, False, time.perf_counter() - start, final / "kernel.cubin"))
            return final / "kernel.cubin"
        tmp_root = self.cache_dir / "tmp"
        work = tmp_root / str(uuid.uuid4())
        work.mkdir(parents=True)
        code = work / "kernel.cu"
        code.write_text(inst.tu())
        argv = [str(self.nvcc), str(code), "-cubin", "-o", str(work / "kernel.cubin"), *self.flags()]
        # From <cache>/tmp: files in the caller's directory must not shadow standard headers.
        started = time.perf_counter()
        proc = subprocess.run(argv, cwd=tmp_root, capture_output=True, text=True, env=self._env(), timeout=600)
        compiler_seconds = time.perf_counter() - started
        output = proc.stdout + proc.stderr
        if proc.returncode != 0:
            raise LibraryJitError(f"{inst.name}: nvcc {self.nvcc} exited {proc.returncode}: {output[-4000:]}")
        if not (work / "kernel.cubin").is_file():
            raise LibraryJitError(f"{inst.name}: nvcc {self.nvcc} exited 0 but wrote no {work / 'kernel.cubin'}")
        if self.verbose and not _PTXAS_VERBOSE_RE.search(output):
            raise LibraryJitError(f"{inst.name}: --ptxas-options=--verbose gave no ptxas report: {output[-2000:]!r}")
        if self.ptxas_check and _LOCAL_MEMORY_RE.search(output):
            raise LibraryJitError(f"{inst.name}: ptxas reports local memory use: {output[-2000:]}")
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            work.rename(final)
        except OSError:
            # Another process (rank) renamed first: keep its directory, drop ours.
            shutil.rmtree(work, ignore_errors=True)
        self.records.append(BuildRecord(inst.name, True, time.perf_counter() - start, final / "kernel.cubin",
                                        tuple(argv), proc.stdout, proc.stderr, proc.returncode, compiler_seconds))
        return final / "kernel.cubin"

    def nvcc_runs(self) -> int:
        """Build calls that ran nvcc (misses of the library's own cache)."""
        return sum(1 for r in self.records if r.nvcc_ran)
