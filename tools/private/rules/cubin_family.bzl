"""cubin_family: the instantiations of one kernel family, for cubin_manifest."""

load("//tools/private:providers.bzl", "CubinInfo", "CubinSetInfo")

def _cubin_family_impl(ctx):
    instances = [dep[CubinInfo] for dep in ctx.attr.instances]
    templates = [f for f in ctx.files.jit_template if not f.basename.endswith(".sources.json")]
    return [
        # The source bundle is built with the family, so it reaches the cache CI fills.
        DefaultInfo(files = depset([i.cubin for i in instances] + ctx.files.jit_template)),
        CubinSetInfo(instances = instances, jit_templates = templates),
    ]

cubin_family = rule(
    implementation = _cubin_family_impl,
    doc = "Groups cuda_cubin targets (and the family's JIT template, if any); builds them all.",
    attrs = {
        "instances": attr.label_list(providers = [CubinInfo], mandatory = True, doc = "cuda_cubin targets."),
        "jit_template": attr.label(allow_files = True, doc = "The family's cubin_jit_template, which the manifest embeds."),
    },
)
