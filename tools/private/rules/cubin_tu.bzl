"""cubin_tu: renders one translation unit from a template, as JIT libraries generate code."""

def _cubin_tu_impl(ctx):
    out = ctx.actions.declare_file(ctx.attr.out)
    ctx.actions.expand_template(
        template = ctx.file.template,
        output = out,
        substitutions = ctx.attr.substitutions,
    )
    return [DefaultInfo(files = depset([out]))]

cubin_tu = rule(
    implementation = _cubin_tu_impl,
    doc = "Writes `out` from `template`, replacing each key of `substitutions` (e.g. `{bm}`) literally.",
    attrs = {
        "template": attr.label(allow_single_file = True, mandatory = True, doc = "The TU template."),
        "substitutions": attr.string_dict(doc = "Literal text -> replacement, e.g. {'{bm}': '128'}."),
        "out": attr.string(mandatory = True, doc = "Output file name, ending in .cu."),
    },
)
