"""Module extensions for a workspace that `bazel_dep`s on cubinstore (bzlmod, Bazel 7).

`headers` declares the header libraries a consumer's kernels include, each a repository with a
`cuda_headers` target `:headers` to put in `deps`:

    headers = use_extension("@cubinstore//tools:extensions.bzl", "headers")
    headers.pip(name = "deep_gemm", package = "deep_gemm", subdir = "include")  # an installed Python package
    headers.local(name = "vendor", path = "/opt/vendor/include")                # a folder on this host
    use_repo(headers, "deep_gemm", "vendor")
    # BUILD.bazel: deps = ["@deep_gemm//:headers"]

`pip` finds the package's folder by name (third_party/pip/pip_package_headers.bzl: with
`$CUBINSTORE_PIP_PYTHON`, else cubinstore's `.venv`, else `python3` on `PATH`, and the client's
`$PYTHONPATH`), so another host finds its own install; `local` takes an absolute path
(third_party/local/local_headers.bzl). The bundled CUTLASS/CuTe needs no tag: it is
`@cubinstore//third_party/cutlass:cute`.
"""

load("//third_party/local:local_headers.bzl", "local_headers")
load("//third_party/pip:pip_package_headers.bzl", "pip_package_headers")

_pip = tag_class(
    doc = "A header folder of an installed Python package, found by the package's import name.",
    attrs = {
        "name": attr.string(mandatory = True, doc = "The repository's name (what use_repo lists)."),
        "package": attr.string(mandatory = True, doc = "The package's import name, e.g. 'deep_gemm'."),
        "subdir": attr.string(default = "include", doc = "The folder below the package's, e.g. 'include'."),
    },
)

_local = tag_class(
    doc = "A header folder on this host, by absolute path.",
    attrs = {
        "name": attr.string(mandatory = True, doc = "The repository's name (what use_repo lists)."),
        "path": attr.string(mandatory = True, doc = "The folder's absolute path."),
    },
)

def _headers_impl(mctx):
    seen = {}
    for module in mctx.modules:
        for tag in module.tags.pip + module.tags.local:
            if tag.name in seen:
                fail("cubinstore headers: repository '{}' is declared twice (by {} and {})".format(tag.name, seen[tag.name], module.name))
            seen[tag.name] = module.name
        for tag in module.tags.pip:
            pip_package_headers(name = tag.name, package = tag.package, subdir = tag.subdir)
        for tag in module.tags.local:
            local_headers(name = tag.name, path = tag.path)

headers = module_extension(
    implementation = _headers_impl,
    doc = "Header libraries for a consumer's kernels (see the module docstring).",
    tag_classes = {"pip": _pip, "local": _local},
)
