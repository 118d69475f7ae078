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

`cuda` declares the CUDA toolkit every compile runs (cubinstore's `@local_cuda`):

    cuda = use_extension("@cubinstore//tools:extensions.bzl", "cuda")
    cuda.toolkit(path = "/usr/local/cuda-13.0")   # this toolkit and no other
    cuda.toolkit(version = "13.0")                # or: the search's first toolkit of CUDA 13.0

No `use_repo` is needed: the declaration reaches `@local_cuda` through cubinstore's own
`@cuda_toolkit_choice` (third_party/cuda/toolkit_choice.bzl). `path` is the only candidate;
`version` keeps the search (`$CUDA_PATH`, `$CUDA_HOME`, then `/usr/local/cuda-<version>`,
`/usr/local/cuda`, `nvcc` on `PATH`) and passes over a toolkit of another version, so each host
finds its own install of the version the workspace names. The root module's tag wins; a
dependency's counts only where the root declares none (two that differ fail). With no tag the
search alone decides, as before, and every action key is unchanged: the toolkit's content, not
its path, is in the keys either way.
"""

load("//third_party/cuda:toolkit_choice.bzl", "check_choice", "cuda_toolkit_choice")
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

_toolkit = tag_class(
    doc = "The CUDA toolkit cubinstore's compiles run: by path, by version, or both (see the module docstring).",
    attrs = {
        "path": attr.string(doc = "The toolkit's root (absolute), holding bin/nvcc and nvvm/bin/cicc."),
        "version": attr.string(doc = "MAJOR.MINOR, e.g. '13.0', as the toolkit's include/cuda.h says."),
    },
)

def _describe(declared):
    return ", ".join(["{} = '{}'".format(k, v) for k, v in (("path", declared.path), ("version", declared.version)) if v])

def _declared_toolkit(mctx):
    """The toolkit tag that decides: struct(module, path, version), or None where no module declares one."""
    root = None
    others = []
    for module in mctx.modules:
        name = module.name or "<root>"
        tags = module.tags.toolkit
        if len(tags) > 1:
            fail("cubinstore cuda: module '{}' declares cuda.toolkit {} times; declare it once".format(name, len(tags)))
        for tag in tags:
            check_choice("cuda.toolkit in module '{}'".format(name), tag.path, tag.version)
            declared = struct(module = name, path = tag.path, version = tag.version)
            if module.is_root:
                root = declared
            else:
                others.append(declared)
    if root != None:
        return root
    for other in others[1:]:
        if (other.path, other.version) != (others[0].path, others[0].version):
            fail("cubinstore cuda: modules '{}' and '{}' declare different toolkits ({} and {}); the root module must choose one".format(
                others[0].module,
                other.module,
                _describe(others[0]),
                _describe(other),
            ))
    return others[0] if others else None

def _cuda_impl(mctx):
    declared = _declared_toolkit(mctx)
    cuda_toolkit_choice(
        name = "cuda_toolkit_choice",
        module = declared.module if declared else "",
        path = declared.path if declared else "",
        version = declared.version if declared else "",
    )

cuda = module_extension(
    implementation = _cuda_impl,
    doc = "The CUDA toolkit of cubinstore's compiles (see the module docstring).",
    tag_classes = {"toolkit": _toolkit},
)
