"""Which of the CUDA toolkit's files a CubinCompile action declares: defined once, here.

The generated `@local_cuda//:BUILD.bazel` (toolkit.BUILD) makes one filegroup of each part;
cuda_cubin picks the parts a compile gets from its `toolkit_headers` attribute. A compile's
sandbox holds only what it declares, so a header outside its sets is missing there and the
compile fails naming it (nvcc runs the toolkit by paths relative to its own `bin/`, inside
the sandbox); a change to a file in its sets changes its key.

- `compiler`: what `nvcc -cubin` runs and reads besides headers (nvcc, its profile, cicc,
  ptxas, libdevice); nvcc -cubin runs no cudafe++, fatbinary, nvlink or bin2c.
- `core` headers: every file under `include/` outside the optional sets: cuda_runtime.h,
  which nvcc force-includes, and what it includes (crt/, nv/), the fp16/bf16/fp8 types,
  cooperative groups, ... Every compile gets them.
- optional sets (TOOLKIT_HEADER_SETS): CCCL's libraries, the bulk of include/ (about 1,700 of
  1,900 files in CUDA 13). CUDA 13 keeps them under `include/cccl/`, CUDA 12 directly under
  `include/`; a set names both.
"""

# What nvcc -cubin runs and reads, other than headers (paths in the toolkit repository).
COMPILER_FILES = [
    "bin/nvcc",
    "bin/nvcc.profile",
    "bin/ptxas",
    "nvvm/bin/cicc",
]
COMPILER_DIRS = ["nvvm/libdevice"]

# name -> struct(dirs: directories under include/, implies: sets its headers include, doc).
TOOLKIT_HEADER_SETS = {
    "libcudacxx": struct(
        dirs = ["cccl/cuda", "cccl/nv", "cuda"],
        implies = [],
        doc = "libcu++: <cuda/std/...>, <cuda/...> (CuTe includes <cuda/std/...>)",
    ),
    "cub": struct(
        dirs = ["cccl/cub", "cub"],
        implies = ["libcudacxx"],
        doc = "<cub/...>",
    ),
    "thrust": struct(
        dirs = ["cccl/thrust", "thrust"],
        implies = ["cub", "libcudacxx"],
        doc = "<thrust/...>",
    ),
}

# The value meaning every set: the whole include/ tree (the default).
ALL = "all"

def header_set_globs(name):
    """The glob patterns of optional set `name`, relative to the toolkit repository."""
    return ["include/{}/**".format(d) for d in TOOLKIT_HEADER_SETS[name].dirs]

def core_header_excludes():
    """What the core headers leave out: every optional set."""
    return [p for name in TOOLKIT_HEADER_SETS for p in header_set_globs(name)]

def resolve_header_sets(label, names):
    """The optional header sets a compile declaring `names` gets.

    Args:
      label: the compiling target, for the error.
      names: the target's `toolkit_headers`: set names or "all".

    Returns:
      The sets, implied ones added, in TOOLKIT_HEADER_SETS order. An unknown name fails,
      naming the target, the attribute, the value and the allowed values.
    """
    if ALL in names:
        return list(TOOLKIT_HEADER_SETS)
    wanted = {}
    for name in names:
        if name not in TOOLKIT_HEADER_SETS:
            fail("{}: attribute 'toolkit_headers' has '{}'; allowed: {} (the toolkit's core headers are always there)".format(
                label,
                name,
                ", ".join(["'{}'".format(n) for n in [ALL] + list(TOOLKIT_HEADER_SETS)]),
            ))
        wanted[name] = True
        for implied in TOOLKIT_HEADER_SETS[name].implies:
            wanted[implied] = True
    return [n for n in TOOLKIT_HEADER_SETS if n in wanted]
