"""cuda_cubin: one kernel instantiation compiled by nvcc to one .cubin."""

load("@local_cuda//:defs.bzl", "HOST_CC")
load("//third_party/cuda:header_sets.bzl", "ALL", "TOOLKIT_HEADER_SETS", "resolve_header_sets")
load("//tools/private:providers.bzl", "CubinInfo", "CudaHeadersInfo")
load("//tools/private:types.bzl", "check_arch", "check_entries", "merge_flags", "module_anchor")
load("//tools/private/actions:compile.bzl", "cubin_compile_args")

# Actions see a fixed environment: nothing from the shell that runs Bazel.
ACTION_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}

def _toolkit_inputs(ctx):
    """The toolkit's files this compile declares, a list of depsets.

    The compiler, the core headers, and the header sets `toolkit_headers` names.
    """
    wanted = resolve_header_sets(ctx.label, ctx.attr.toolkit_headers)
    sets = {t.label.name[len("headers_"):]: t for t in ctx.attr._toolkit_header_sets}
    return [ctx.attr._toolkit_compiler[DefaultInfo].files, ctx.attr._toolkit_core_headers[DefaultInfo].files] + [
        sets[name][DefaultInfo].files
        for name in wanted
    ]

def _cuda_cubin_impl(ctx):
    check_arch(ctx.label, ctx.attr.arch)
    check_entries(ctx.label, ctx.attr.entries)
    if len(ctx.files.srcs) != 1:
        fail("{}: attribute 'srcs' must hold exactly one .cu file, got {}".format(ctx.label, len(ctx.files.srcs)))
    src = ctx.files.srcs[0]
    cubin = ctx.actions.declare_file(ctx.label.name + ".cubin")
    headers = depset(ctx.files.hdrs, transitive = [d[CudaHeadersInfo].headers for d in ctx.attr.deps])
    toolkit = _toolkit_inputs(ctx)
    includes = depset(transitive = [d[CudaHeadersInfo].includes for d in ctx.attr.deps])

    # The workspace-relative path (a generated TU's too, without bazel-out/<config>/bin)
    # names the TU in the CUBIN, so its bytes depend on neither checkout nor configuration.
    source_path = src.short_path
    anchor = ctx.actions.declare_file(ctx.label.name + ".anchor.h")
    ctx.actions.write(anchor, module_anchor(source_path))

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
    )

    ctx.actions.run(
        executable = ctx.executable._nvcc,
        arguments = [args],
        inputs = depset(
            [src, anchor, ctx.file._host_compiler_id],
            transitive = [headers] + toolkit,
        ),
        outputs = [cubin],
        env = ACTION_ENV,
        mnemonic = "CubinCompile",
        progress_message = "Compiling CUBIN {} ({})".format(ctx.attr.id, ctx.attr.arch),
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

cuda_cubin = rule(
    implementation = _cuda_cubin_impl,
    doc = "Compiles one .cu translation unit to one CUBIN for one architecture (mnemonic CubinCompile).",
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"], mandatory = True, doc = "The one .cu file (or a cubin_tu target)."),
        "hdrs": attr.label_list(allow_files = True, doc = "Headers the source includes."),
        "deps": attr.label_list(providers = [CudaHeadersInfo], doc = "cuda_headers targets, e.g. @cutlass//:cute."),
        "defines": attr.string_list(doc = "Preprocessor defines, without -D."),
        "copts": attr.string_list(doc = "Extra nvcc flags, spelled relative to the workspace; one that sets a default option (-std=, -O) replaces the default."),
        "arch": attr.string(mandatory = True, doc = "Target architecture, e.g. 'sm_90a'."),
        "entries": attr.string_list_dict(mandatory = True, doc = "Entry (symbol or C++ name) -> parameter types (i8 ... tensormap, struct:<size>:<align>)."),
        "launch_json": attr.string(default = "{}", doc = "JSON object: entry -> launch geometry (block, shared_mem, cluster, grid)."),
        "family": attr.string(mandatory = True, doc = "Kernel family, e.g. 'axpy'."),
        "id": attr.string(mandatory = True, doc = "Manifest id: <family>/<param values>/<arch>."),
        "params_json": attr.string(default = "{}", doc = "The instantiation's parameters as a JSON object."),
        "_nvcc": attr.label(default = "@local_cuda//:bin/nvcc", executable = True, allow_single_file = True, cfg = "exec"),
        "toolkit_headers": attr.string_list(
            default = [ALL],
            doc = "The toolkit's optional header sets the source may include, besides the core headers every compile gets " +
                  "(cuda_runtime.h and the toolkit's own headers): " +
                  ", ".join(["'{}' ({})".format(n, s.doc) for n, s in TOOLKIT_HEADER_SETS.items()]) +
                  "; a set brings the sets it includes. '{}' (the default): the whole include tree. ".format(ALL) +
                  "Fewer files make the sandbox cheaper; a header outside the sets is missing in the sandbox and fails the compile.",
        ),
        "_toolkit_compiler": attr.label(default = "@local_cuda//:compiler"),
        "_toolkit_core_headers": attr.label(default = "@local_cuda//:headers_core"),
        "_toolkit_header_sets": attr.label_list(default = ["@local_cuda//:headers_" + n for n in TOOLKIT_HEADER_SETS]),
        "_host_compiler_id": attr.label(default = "@local_cuda//:host_compiler.id", allow_single_file = True),
    },
)
