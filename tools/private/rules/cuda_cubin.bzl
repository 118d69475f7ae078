"""cuda_cubin: one kernel instantiation compiled by nvcc to one .cubin.

`compile_instance` and `CUDA_CUBIN_ATTRS` are shared with `cuda_ptx`, the same compile to PTX text.
"""

load("@local_cuda//:defs.bzl", "HOST_CC")
load("//tools/private:providers.bzl", "CubinInfo", "CudaHeadersInfo", "PyToolInfo")
load("//tools/private:types.bzl", "check_arch", "check_entries", "check_ptx_arch", "merge_flags", "module_anchor")
load("//tools/private/actions:compile.bzl", "COMPILE_ATTRS", "cubin_compile", "cubin_compile_args", _ACTION_ENV = "ACTION_ENV")
load("//tools/private/actions:scan.bzl", "scan_header_closure")

# Re-exported: cubin_manifest and cubin_jit_template run their actions in the same environment.
ACTION_ENV = _ACTION_ENV

def compile_instance(ctx, ptx):
    """The providers of a cuda_cubin (ptx False) or cuda_ptx (ptx True) target: one compile of its point.

    Args:
      ctx: the rule context (attributes `CUDA_CUBIN_ATTRS`).
      ptx: whether to write PTX text (a `compute_` arch) instead of a CUBIN.

    Returns:
      The target's providers.
    """
    if ptx:
        check_ptx_arch(ctx.label, ctx.attr.arch)
    else:
        check_arch(ctx.label, ctx.attr.arch)
    check_entries(ctx.label, ctx.attr.entries)
    if len(ctx.files.srcs) != 1:
        fail("{}: attribute 'srcs' must hold exactly one .cu file, got {}".format(ctx.label, len(ctx.files.srcs)))
    src = ctx.files.srcs[0]
    cubin = ctx.actions.declare_file(ctx.label.name + (".ptx" if ptx else ".cubin"))
    headers = depset(ctx.files.hdrs, transitive = [d[CudaHeadersInfo].headers for d in ctx.attr.deps])
    includes = depset(transitive = [d[CudaHeadersInfo].includes for d in ctx.attr.deps])

    # The workspace-relative path (a generated TU's too, without bazel-out/<config>/bin)
    # names the TU in the CUBIN, so its bytes depend on neither checkout nor configuration.
    source_path = src.short_path
    anchor = ctx.actions.declare_file(ctx.label.name + ".anchor.h")
    ctx.actions.write(anchor, module_anchor(source_path))

    # header_closure: the compile runs inside a tree of the headers its TU includes, copied
    # there by a CubinScan action, instead of declaring every header (actions/scan.bzl).
    tree = scan_header_closure(ctx, src, anchor, headers, includes, ctx.attr.id) if ctx.attr.header_closure else None

    # The command's shape is one table, shared with the JIT (tools/private/actions/compile.bzl).
    args = cubin_compile_args(
        ctx,
        values = {
            "anchor": anchor,
            "arch": ctx.attr.arch,
            "host_cc": HOST_CC,
            "output": cubin,
            "source": src,
            "source_name": source_path,
        },
        lists = {
            "defines": ctx.attr.defines,
            "extra": [],
            "flags": merge_flags(ctx.attr.copts),
            "includes": includes,
        },
        ptx = ptx,
        tree = tree,
    )

    cubin_compile(
        ctx,
        src = src,
        anchor = anchor,
        output = cubin,
        args = args,
        headers = headers,
        progress_message = "Compiling {} {} ({})".format("PTX" if ptx else "CUBIN", ctx.attr.id, ctx.attr.arch),
        mnemonic = "PtxCompile" if ptx else "CubinCompile",
        tree = tree,
    )
    return [
        DefaultInfo(files = depset([cubin])),
        CubinInfo(
            cubin = cubin,
            id = ctx.attr.id,
            family = ctx.attr.family,
            params_json = ctx.attr.params_json,
            arch = ctx.attr.arch,
            entries_json = json.encode({name: types for name, types in ctx.attr.entries.items()}),
            launch_json = ctx.attr.launch_json,
            target = "//{}:{}".format(ctx.label.package, ctx.label.name),
        ),
    ]

def _cuda_cubin_impl(ctx):
    return compile_instance(ctx, ptx = False)

CUDA_CUBIN_ATTRS = dict(COMPILE_ATTRS, **{
    "srcs": attr.label_list(allow_files = [".cu"], mandatory = True, doc = "The one .cu file (or a cubin_tu target)."),
    "hdrs": attr.label_list(allow_files = True, doc = "Headers the source includes."),
    "deps": attr.label_list(providers = [CudaHeadersInfo], doc = "cuda_headers targets, e.g. @cutlass//:cute."),
    "defines": attr.string_list(doc = "Preprocessor defines, without -D."),
    "copts": attr.string_list(doc = "Extra nvcc flags, spelled relative to the workspace; one that sets a default option (-std=, -O) replaces the default."),
    "arch": attr.string(mandatory = True, doc = "Target architecture, e.g. 'sm_90a' (cuda_ptx: 'compute_90')."),
    "entries": attr.string_list_dict(mandatory = True, doc = "Entry (symbol or C++ name) -> parameter types (i8 ... tensormap, struct:<size>:<align>)."),
    "launch_json": attr.string(default = "{}", doc = "JSON object: entry -> launch geometry (block, shared_mem, cluster, grid)."),
    "family": attr.string(mandatory = True, doc = "Kernel family, e.g. 'axpy'."),
    "id": attr.string(mandatory = True, doc = "Manifest id: <family>/<param values>/<arch>."),
    "params_json": attr.string(default = "{}", doc = "The instantiation's parameters as a JSON object."),
    "header_closure": attr.bool(
        default = True,
        doc = "Compile from the headers the source includes (a CubinScan action copies them into a tree artifact " +
              "and nvcc runs inside it) instead of declaring every header of hdrs and deps, so a header the source " +
              "never includes re-keys nothing. False: every declared header is an input. The CUBIN's bytes are " +
              "the same either way.",
    ),
    "_in_tree": attr.label(default = "//tools/private:in_tree.sh", executable = True, allow_single_file = True, cfg = "exec"),
    "_scan_tool": attr.label(default = "//tools/private:header_closure_tool", executable = True, cfg = "exec", providers = [PyToolInfo]),
})

cuda_cubin = rule(
    implementation = _cuda_cubin_impl,
    doc = "Compiles one .cu translation unit to one CUBIN for one architecture (mnemonic CubinCompile).",
    attrs = CUDA_CUBIN_ATTRS,
)
