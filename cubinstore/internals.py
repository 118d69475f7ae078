"""The one door to cubinstore's internals for its own tests, benchmarks and build tools.

Nothing here is a stable API: names come and go as the modules behind them change. Applications
use the public API (``cubinstore``, ``cubinstore.store``, ``.manifest``, ``.launch``, ``.jit``,
``.ops``, ``.tensormap``, ``.errors`` and the ``cubinstore`` command line, ``cubinstore.cli``).
A name belongs here only when the public API does not already give it and a test, a benchmark or
a build tool uses it; tests/project/test_internals.py checks that they import cubinstore's
private modules through this module alone and that no package module imports it.

A private module is re-exported under its own name without the underscore (``_jit.key`` is
``key``; ``ops._gemm``, the launch, is ``gemm_launch``, apart from the public ``ops.gemm``).
Importing this loads neither torch nor the CUDA driver (both load on first use, as in the package).
The Bazel actions' tools (tools/manifest_tool.py, tools/jit_template_tool.py) import the few
``_core``/``_jit`` modules they need directly instead: they run under the host's ``python3``
without this module's third-party imports (xxhash, through the JIT and cubinstore-nvcc).
"""

from __future__ import annotations

# _core: the facts every layer shares (ABI, id and flag grammar, digests, ELF, environment knobs).
from cubinstore._core import abi, geometry, knobs, native, nvcc
from cubinstore._core.abi import DEFAULT_NVCC_FLAGS, Arch, param_layout, param_type, render_param
from cubinstore._core.cubin import CubinImage, header_is, header_problem, header_sm
from cubinstore._core.cxxnames import function_name, names_entry, normalize_name
from cubinstore._core.digest import EMPTY_SHA256_HEX
from cubinstore._core.mangled import MAX_SYMBOL_CHARS, MangledParam, decode_params, type_problem

# _driver: the CUDA driver calls and the per-device cache (a test's fake driver goes in via device.use).
from cubinstore._driver import cuda, device

# _release: bundles, maintenance, prefetch, OCI and manifest references, the warm set.
from cubinstore._release import bundle, warmset
from cubinstore._release.bundle import pack, unpack
from cubinstore._release.maint import gc, pin, unpin, verify_store
from cubinstore._release.oci import release_artifact
from cubinstore._release.prefetch import fetch_blobs
from cubinstore._release.refs import OCI_PREFIXES, load_manifest

# _jit: the compiler below cubinstore.jit, its keys, index, family templates and demangler.
from cubinstore._jit import compiler, demangle, direct, family, key
from cubinstore._jit.explain import explain_key
from cubinstore._jit.family import cutlass_include, make_bundle, template_for_sources
from cubinstore._jit.index import JitIndex
from cubinstore._jit.key import ACTION_ENV, locate_toolkit

# _args and _loader: argument packing and CUBIN loading below cubinstore.launch.
from cubinstore import _args as args
from cubinstore import _loader as loader
from cubinstore._args import ArgBuffer, PackedArgs, ParamSlot, check_layout, dlpack_data_pointer, expected_layout, pack_args

# _nvcc: cubinstore-nvcc's argv parser, call records, remote records and warm-set export.
from cubinstore._nvcc import calls, export, remote, warm
from cubinstore._nvcc.argv import Call, PassThrough
from cubinstore._nvcc.argv import parse as parse_nvcc_argv

# ops: the gemm operator's launch, configurations, selection model, calibration and staging.
from cubinstore.ops import _gemm as gemm_launch
from cubinstore.ops import _gemm_calibration as gemm_calibration
from cubinstore.ops import _gemm_model as gemm_model
from cubinstore.ops import _gemm_op as gemm_op
from cubinstore.ops import _gemm_staging as gemm_staging
from cubinstore.ops import _gemm_tuning as gemm_tuning
from cubinstore.ops import _library as ops_library
from cubinstore.ops._gemm_config import Operand, check_operands
from cubinstore.ops._gemm_inductor import CALL as INDUCTOR_CALL
from cubinstore.ops._gemm_model import ClusterSlots, MachineCosts, Model, TileCosts
from cubinstore.ops._gemm_staging import Feed, Staging, padded, reads_in_place, staging, writes_in_place
from cubinstore.ops._timing import host_us_per_call

__all__ = [
    "ACTION_ENV", "DEFAULT_NVCC_FLAGS", "EMPTY_SHA256_HEX", "INDUCTOR_CALL", "MAX_SYMBOL_CHARS", "OCI_PREFIXES",
    "ArgBuffer", "Arch", "Call", "ClusterSlots", "CubinImage", "header_is", "header_problem", "header_sm", "Feed", "JitIndex", "MachineCosts",
    "MangledParam", "Model", "Operand", "PackedArgs", "ParamSlot", "PassThrough", "Staging", "TileCosts",
    "abi", "args", "bundle", "calls", "check_layout", "check_operands", "compiler", "cuda", "cutlass_include",
    "decode_params", "demangle", "device", "direct", "dlpack_data_pointer", "expected_layout", "explain_key",
    "export", "family", "fetch_blobs", "function_name", "gc", "gemm_calibration", "gemm_launch", "gemm_model",
    "gemm_op", "gemm_staging", "gemm_tuning", "geometry", "host_us_per_call", "key", "knobs", "load_manifest",
    "loader", "locate_toolkit", "make_bundle", "names_entry", "native", "normalize_name", "nvcc", "ops_library",
    "pack", "pack_args", "padded", "param_layout", "param_type", "parse_nvcc_argv", "pin", "reads_in_place",
    "release_artifact", "remote", "render_param", "staging", "template_for_sources", "type_problem", "unpack",
    "unpin", "verify_store", "warm", "warmset", "writes_in_place",
]
