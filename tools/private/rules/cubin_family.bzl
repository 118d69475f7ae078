"""cubin_family: the instantiations of one kernel family, for cubin_manifest."""

load("//tools/private:providers.bzl", "CubinInfo", "CubinSetInfo")

def _cubin_family_impl(ctx):
    instances = [dep[CubinInfo] for dep in ctx.attr.instances]
    return [
        DefaultInfo(files = depset([i.cubin for i in instances])),
        CubinSetInfo(instances = instances),
    ]

cubin_family = rule(
    implementation = _cubin_family_impl,
    doc = "Groups cuda_cubin targets; builds them all.",
    attrs = {
        "instances": attr.label_list(providers = [CubinInfo], mandatory = True, doc = "cuda_cubin targets."),
    },
)
