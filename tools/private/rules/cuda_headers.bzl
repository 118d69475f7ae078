"""cuda_headers: headers and their include directories, for cuda_cubin's deps."""

load("//tools/private:providers.bzl", "CudaHeadersInfo")

def _cuda_headers_impl(ctx):
    root = ctx.label.workspace_root
    includes = []
    for include in ctx.attr.includes:
        if include.startswith("/") or ".." in include.split("/"):
            fail("{}: attribute 'includes' must be package-relative, got '{}'".format(ctx.label, include))
        parts = [p for p in [root, ctx.label.package, include] if p]
        includes.append("/".join(parts))
    headers = depset(ctx.files.hdrs, transitive = [d[CudaHeadersInfo].headers for d in ctx.attr.deps])
    return [
        DefaultInfo(files = headers),
        CudaHeadersInfo(
            headers = headers,
            includes = depset(includes, transitive = [d[CudaHeadersInfo].includes for d in ctx.attr.deps]),
        ),
    ]

cuda_headers = rule(
    implementation = _cuda_headers_impl,
    doc = "Headers plus the include directories (relative to this package) that reach them.",
    attrs = {
        "hdrs": attr.label_list(allow_files = True, doc = "Header files."),
        "includes": attr.string_list(doc = "Include directories relative to this package, e.g. 'include'."),
        "deps": attr.label_list(providers = [CudaHeadersInfo], doc = "Other cuda_headers."),
    },
)
