"""Starlark mirror of the ABI facts the rules need at analysis time.

The definitions live in `cubinstore/_core/abi.py` (imported by the runtime and by the manifest
tool); Starlark cannot import Python, so the few facts the rules check or use before any
action runs are repeated here, and `tests/core/test_abi.py` checks that both copies agree:
the parameter types, the arch grammar, nvcc's default flags and how copts override them,
and the module anchor text.
"""

# Scalar kernel parameter types and their (size, alignment) in bytes; structs are spelled
# `struct:<size>:<align>`.
PARAM_TYPES = {
    "i8": (1, 1),
    "u8": (1, 1),
    "i16": (2, 2),
    "u16": (2, 2),
    "i32": (4, 4),
    "u32": (4, 4),
    "i64": (8, 8),
    "u64": (8, 8),
    "f16": (2, 2),
    "bf16": (2, 2),
    "f32": (4, 4),
    "f64": (8, 8),
    "ptr": (8, 8),
    "tensormap": (128, 128),
}

STRUCT_ALIGNS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
MAX_STRUCT_BYTES = 4096

# Every instantiation gets these unless its copts set the same option.
DEFAULT_NVCC_FLAGS = ["-std=c++17", "-O3", "--expt-relaxed-constexpr"]

def _flag_option(flag):
    name = flag.lstrip("-")
    if name.startswith("O"):
        return "O"
    return name.split("=", 1)[0]

def merge_flags(copts):
    """The default flags that `copts` do not override, then `copts`.

    Args:
      copts: a family's extra nvcc flags.

    Returns:
      The flag list.
    """
    overridden = {_flag_option(f): True for f in copts}
    return [f for f in DEFAULT_NVCC_FLAGS if _flag_option(f) not in overridden] + copts

def module_anchor(source_path):
    """The header force-included before a TU so its CUBIN bytes are reproducible.

    See `module_anchor` in cubinstore/_core/abi.py for why.

    Args:
      source_path: the TU's workspace-relative path.

    Returns:
      The header's text.
    """
    name = "".join([c if c.isalnum() else "_" for c in source_path.elems()])
    return "// cubinstore: pins the module id of {}\nvoid __cubinstore_module_anchor_{}(void) {{}}\n".format(source_path, name)

def _is_digits(text, first_nonzero):
    return text.isdigit() and not (first_nonzero and text.startswith("0"))

def is_arch(arch):
    """Whether `arch` is `sm_<major><minor>` with an optional `a` or `f` suffix.

    Args:
      arch: the text to check.

    Returns:
      True or False.
    """
    if not arch.startswith("sm_"):
        return False
    digits = arch[3:]
    if digits.endswith("a") or digits.endswith("f"):
        digits = digits[:-1]
    return len(digits) in (2, 3) and _is_digits(digits, True)

def is_ptx_arch(arch):
    """Whether `arch` is a PTX target, `compute_` and the digits and suffix of an SM arch.

    Mirrors `PtxArch` in cubinstore/manifest/ptx.py: the SM grammar after `compute_`.

    Args:
      arch: the text to check.

    Returns:
      True or False.
    """
    return arch.startswith("compute_") and is_arch("sm_" + arch[len("compute_"):])

def check_ptx_arch(label, arch):
    """Fails unless `arch` is a PTX target (`compute_90`, `compute_90a`, `compute_100f`).

    Args:
      label: the target, or the macro, for the error message.
      arch: the value.
    """
    if not is_ptx_arch(arch):
        fail("{}: PTX arch must look like 'compute_80', 'compute_90a' or 'compute_100f', got '{}'".format(label, arch))

def check_arch(label, arch):
    """Fails unless `arch` follows the arch grammar.

    Args:
      label: the target, for the error message.
      arch: the value of its `arch` attribute.
    """
    if not is_arch(arch):
        fail("{}: attribute 'arch' must look like 'sm_80', 'sm_90a' or 'sm_100f', got '{}'".format(label, arch))

def is_param_type(name):
    """Whether `name` is a scalar type or `struct:<size>:<align>`.

    Args:
      name: the declared type.

    Returns:
      True or False.
    """
    if name in PARAM_TYPES:
        return True
    parts = name.split(":")
    if len(parts) != 3 or parts[0] != "struct" or not _is_digits(parts[1], True) or not _is_digits(parts[2], True):
        return False
    size, align = int(parts[1]), int(parts[2])
    return align in STRUCT_ALIGNS and size <= MAX_STRUCT_BYTES and size % align == 0

def check_entries(label, entries):
    """Fails unless every entry has a name and known parameter types.

    An entry is named by its symbol (`axpy_f32`, `_ZN...`) or by its C++ name
    (`ns::gemm<128, 256>`); the manifest action resolves C++ names in the CUBIN.

    Args:
      label: the target, for the error message.
      entries: the value of its `entries` attribute.
    """
    if not entries:
        fail("{}: attribute 'entries' must name at least one entry".format(label))
    for name, types in entries.items():
        if not name or "{" in name or "}" in name or "\n" in name:
            fail("{}: entry '{}' in attribute 'entries' is empty or has an unfilled placeholder".format(label, name))
        for t in types:
            if not is_param_type(t):
                fail("{}: entry '{}' has parameter type '{}'; allowed: {}, struct:<size>:<align>".format(
                    label,
                    name,
                    t,
                    " ".join(PARAM_TYPES.keys()),
                ))
