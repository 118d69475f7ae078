"""cubin_manifest: a manifest mapping every instantiation to the sha256 of its CUBIN."""

load("@local_cuda//:defs.bzl", "DEMANGLER")
load("//tools/private:providers.bzl", "CubinSetInfo", "PyToolInfo")
load("//tools/private/rules:cuda_cubin.bzl", "ACTION_ENV")

def _cubin_manifest_impl(ctx):
    instances = []
    templates = []
    for family in ctx.attr.families:
        instances.extend(family[CubinSetInfo].instances)
        templates.extend(family[CubinSetInfo].jit_templates)
    demangler_files = [f for f in ctx.files._demangler if f.basename != "demangler.id"]
    spec = ctx.actions.declare_file(ctx.label.name + ".spec.json")
    ctx.actions.write(spec, json.encode({
        "demangler": demangler_files[0].path if demangler_files else DEMANGLER,
        "jit_templates": [t.path for t in templates],
        "kernels": [
            {
                "id": i.id,
                "family": i.family,
                "params": json.decode(i.params_json),
                "arch": i.arch,
                "entries": json.decode(i.entries_json),
                "launch": json.decode(i.launch_json),
                "target": i.target,
                "cubin": i.cubin.path,
            }
            for i in instances
        ],
    }))
    manifest = ctx.actions.declare_file(ctx.attr.out or ctx.label.name + ".json")
    ctx.actions.run(
        executable = ctx.executable._tool,
        arguments = [spec.path, manifest.path],
        inputs = depset(
            [spec] + [i.cubin for i in instances] + templates + ctx.files._demangler,
            transitive = [ctx.attr._tool[PyToolInfo].srcs],
        ),
        outputs = [manifest],
        env = ACTION_ENV,
        mnemonic = "CubinManifest",
        progress_message = "Writing {} ({} kernels)".format(manifest.short_path, len(instances)),
    )
    return [DefaultInfo(files = depset([manifest]))]

cubin_manifest = rule(
    implementation = _cubin_manifest_impl,
    doc = "Writes a manifest (schema cubinstore/manifest/v2) by reading the built CUBINs (mnemonic CubinManifest).",
    attrs = {
        "families": attr.label_list(providers = [CubinSetInfo], mandatory = True, doc = "cubin_family targets."),
        "out": attr.string(doc = "Output file name; default `<name>.json`, so several manifests fit in one package."),
        "_tool": attr.label(default = "//tools:manifest_tool", executable = True, cfg = "exec", providers = [PyToolInfo]),
        "_demangler": attr.label(default = "@local_cuda//:demangler", allow_files = True),
    },
)
