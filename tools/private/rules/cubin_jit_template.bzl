"""cubin_jit_template: a family's JIT template and source bundle, for points no release has."""

load("//tools/private:providers.bzl", "CudaHeadersInfo", "PyToolInfo")
load("//tools/private/rules:cuda_cubin.bzl", "ACTION_ENV")

# External repositories a template may include from; the runtime finds each one itself.
_EXTERNAL_ROOTS = {"cutlass": "cutlass"}

def _external_roots(ctx):
    roots = []
    for dep in ctx.attr.deps:
        # Under bzlmod the name is canonical (Bazel 7 `_main~_repo_rules~cutlass`, 8 `+...+cutlass`).
        workspace = dep.label.workspace_name.split("~")[-1].split("+")[-1]
        if workspace not in _EXTERNAL_ROOTS:
            fail("{}: attribute 'deps' has '{}'; a JIT template can name headers of {} only (put the others in 'hdrs')".format(
                ctx.label,
                dep.label,
                ", ".join(["@" + w for w in _EXTERNAL_ROOTS]),
            ))
        if _EXTERNAL_ROOTS[workspace] not in roots:
            roots.append(_EXTERNAL_ROOTS[workspace])
    return roots

def _cubin_jit_template_impl(ctx):
    files = [ctx.file.src] + ctx.files.hdrs
    for f in files:
        if not f.is_source:
            fail("{}: '{}' is generated; a JIT template bundles source files only".format(ctx.label, f.short_path))
    template = ctx.actions.declare_file(ctx.label.name + ".json")
    bundle = ctx.actions.declare_file(ctx.label.name + ".sources.json")
    spec = ctx.actions.declare_file(ctx.label.name + ".spec.json")
    ctx.actions.write(spec, json.encode({
        "family": ctx.attr.family,
        "grid_keys": ctx.attr.grid_keys,
        "source": ctx.file.src.path,
        "files": [f.path for f in files],
        "defines": ctx.attr.defines,
        "copts": ctx.attr.copts,
        "includes": _external_roots(ctx),
        "entries": {name: types for name, types in ctx.attr.entries.items()},
        "archs": ctx.attr.archs,
        "package": ctx.label.package,
    }))
    ctx.actions.run(
        executable = ctx.executable._tool,
        arguments = [spec.path, template.path, bundle.path],
        inputs = depset([spec] + files, transitive = [ctx.attr._tool[PyToolInfo].srcs]),
        outputs = [template, bundle],
        env = ACTION_ENV,
        mnemonic = "CubinJitTemplate",
        progress_message = "Writing the JIT template of {}".format(ctx.attr.family),
    )
    return [DefaultInfo(files = depset([template, bundle]))]

cubin_jit_template = rule(
    implementation = _cubin_jit_template_impl,
    doc = "Writes `<name>.json` (a cubinstore/jit-family/v1 template) and `<name>.sources.json` (the source bundle it names by sha256), so the runtime can compile points of the family that no manifest has (mnemonic CubinJitTemplate).",
    attrs = {
        "family": attr.string(mandatory = True, doc = "Kernel family, e.g. 'axpy'."),
        "grid_keys": attr.string_list(mandatory = True, doc = "Parameter names in id order, e.g. ['dtype', 'vec']."),
        "src": attr.label(allow_single_file = True, mandatory = True, doc = "The family's .cu, or its TU template ({param} placeholders)."),
        "hdrs": attr.label_list(allow_files = True, doc = "Headers the TU includes, bundled by workspace path."),
        "deps": attr.label_list(providers = [CudaHeadersInfo], doc = "External headers found at run time: @cutlass//:cute."),
        "defines": attr.string_list(doc = "Preprocessor defines, without -D; {param} placeholders filled per point."),
        "copts": attr.string_list(doc = "Extra nvcc flags; {param} placeholders filled per point."),
        "entries": attr.string_list_dict(mandatory = True, doc = "Entry symbol -> parameter types, placeholders allowed."),
        "archs": attr.string_list(doc = "Archs a run-time point may be compiled for; empty: any."),
        "_tool": attr.label(default = "//tools:jit_template_tool", executable = True, cfg = "exec", providers = [PyToolInfo]),
    },
)
