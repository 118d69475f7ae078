"""nvcc_cubin: one call of a library's JIT, rebuilt by Bazel as `cubinstore-nvcc` compiled it.

`cubinstore warmset export --nvcc` writes one per call it kept: the TU text, the arch, the
caller's flags as `copts`, and each include root of the call as a `cuda_headers` target (`deps`
for the `-I` roots, `system_deps` for the `-isystem` ones, each in the call's order). The
action is `cuda_cubin`'s (tools/private/actions/compile.bzl), so the command line is the one
the JIT runs: nvcc's default flags merged the same way, the root `-I.` first, then the roots.
`source_name` is the name the TU is compiled under (it salts internal-linkage symbols): the
export sets the JIT's, so the CUBIN's bytes can equal the one the library got.
"""

load("@local_cuda//:defs.bzl", "HOST_CC")
load("//tools/private:providers.bzl", "CudaHeadersInfo")
load("//tools/private:types.bzl", "check_arch", "merge_flags", "module_anchor")
load("//tools/private/actions:compile.bzl", "COMPILE_ATTRS", "cubin_compile", "cubin_compile_args")

def _ordered_includes(deps):
    """Each dep's include directories, in the order of `deps` (a depset would not keep it)."""
    out = []
    for dep in deps:
        for include in dep[CudaHeadersInfo].includes.to_list():
            if include not in out:
                out.append(include)
    return out

def _check_copts(label, copts):
    for copt in copts:
        if copt.startswith("/") or "=/" in copt or copt.startswith("-I") or copt.startswith("-isystem"):
            fail("{}: attribute 'copts' holds '{}'; include roots go in 'deps' or 'system_deps', and no copt may name an absolute path".format(label, copt))

def _nvcc_cubin_impl(ctx):
    check_arch(ctx.label, ctx.attr.arch)
    _check_copts(ctx.label, ctx.attr.copts)
    if len(ctx.files.srcs) != 1:
        fail("{}: attribute 'srcs' must hold exactly one .cu file, got {}".format(ctx.label, len(ctx.files.srcs)))
    src = ctx.files.srcs[0]
    source_name = ctx.attr.source_name or src.short_path
    if source_name.startswith("/") or ".." in source_name.split("/"):
        fail("{}: attribute 'source_name' must be a relative name, got '{}'".format(ctx.label, source_name))
    cubin = ctx.actions.declare_file(ctx.label.name + ".cubin")
    anchor = ctx.actions.declare_file(ctx.label.name + ".anchor.h")
    ctx.actions.write(anchor, module_anchor(source_name))
    deps = ctx.attr.deps + ctx.attr.system_deps
    headers = depset(transitive = [d[CudaHeadersInfo].headers for d in deps])
    system = []
    for include in _ordered_includes(ctx.attr.system_deps):
        system.extend(["-isystem", include])
    args = cubin_compile_args(
        ctx,
        values = {
            "anchor": anchor,
            "arch": ctx.attr.arch,
            "host_cc": HOST_CC,
            "output": cubin,
            "source": src,
            "source_name": source_name,
        },
        lists = {
            "defines": [],
            "extra": [],
            "flags": merge_flags(ctx.attr.copts) + system,
            "includes": _ordered_includes(ctx.attr.deps),
        },
    )
    cubin_compile(
        ctx,
        src = src,
        anchor = anchor,
        output = cubin,
        args = args,
        headers = headers,
        progress_message = "Compiling CUBIN {} ({})".format(ctx.label.name, ctx.attr.arch),
    )
    return [DefaultInfo(files = depset([cubin]))]

nvcc_cubin = rule(
    implementation = _nvcc_cubin_impl,
    doc = "Compiles one .cu to one CUBIN as cubinstore-nvcc compiled a library JIT's call (mnemonic CubinCompile); " +
          "written by `cubinstore warmset export --nvcc`. Its output is `<name>.cubin`.",
    attrs = dict(COMPILE_ATTRS, **{
        "srcs": attr.label_list(allow_files = [".cu"], mandatory = True, doc = "The one .cu file: the call's TU text."),
        "arch": attr.string(mandatory = True, doc = "Target architecture, e.g. 'sm_90a'."),
        "copts": attr.string_list(
            doc = "The caller's nvcc flags without include roots or paths; one that sets a default option (-std=, -O) replaces the default.",
        ),
        "deps": attr.label_list(
            providers = [CudaHeadersInfo],
            doc = "The call's -I roots as cuda_headers targets, in the call's order (the search order).",
        ),
        "system_deps": attr.label_list(
            providers = [CudaHeadersInfo],
            doc = "The call's -isystem roots as cuda_headers targets, in the call's order.",
        ),
        "source_name": attr.string(
            doc = "The name the TU is compiled under (salts internal-linkage symbols); default its workspace path.",
        ),
    }),
)
