"""cubin_manifest: manifest.json mapping every instantiation to the sha256 of its CUBIN."""

load("//tools/private:providers.bzl", "CubinSetInfo")
load("//tools/private/rules:cuda_cubin.bzl", "ACTION_ENV")

def _cubin_manifest_impl(ctx):
    instances = []
    for family in ctx.attr.families:
        instances.extend(family[CubinSetInfo].instances)
    spec = ctx.actions.declare_file(ctx.label.name + ".spec.json")
    ctx.actions.write(spec, json.encode({"kernels": [
        {
            "id": i.id,
            "family": i.family,
            "params": json.decode(i.params_json),
            "arch": i.arch,
            "entries": json.decode(i.entries_json),
            "target": i.target,
            "cubin": i.cubin.path,
        }
        for i in instances
    ]}))
    manifest = ctx.actions.declare_file(ctx.attr.out or "manifest.json")
    ctx.actions.run(
        executable = ctx.executable._tool,
        arguments = [spec.path, manifest.path],
        inputs = [spec] + [i.cubin for i in instances],
        outputs = [manifest],
        env = ACTION_ENV,
        mnemonic = "CubinManifest",
        progress_message = "Writing {} ({} kernels)".format(manifest.short_path, len(instances)),
    )
    return [DefaultInfo(files = depset([manifest]))]

cubin_manifest = rule(
    implementation = _cubin_manifest_impl,
    doc = "Writes manifest.json (schema cubinstore/manifest/v1) by hashing the built CUBINs (mnemonic CubinManifest).",
    attrs = {
        "families": attr.label_list(providers = [CubinSetInfo], mandatory = True, doc = "cubin_family targets."),
        "out": attr.string(doc = "Output file name; default manifest.json."),
        "_tool": attr.label(default = "//tools:manifest_tool.py", executable = True, allow_single_file = True, cfg = "exec"),
    },
)
