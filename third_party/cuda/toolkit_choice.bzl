"""The CUDA toolkit a workspace declares in MODULE.bazel, carried to `cuda_toolkit`.

The `cuda` module extension (tools/extensions.bzl) makes one repository of this rule,
`@cuda_toolkit_choice`, holding `choice.json`: the declared `path` and `version` ("" where
not declared) and the module that declared them. cubinstore's `@local_cuda` (`cuda_toolkit`)
reads it through its `choice` attribute. `@local_cuda` itself stays a repository of
cubinstore's MODULE.bazel, so its canonical name, hence every action's command line and
input paths, is the same whether or not a toolkit is declared.

`check_choice` is the one check of a declaration (the extension runs it on each tag; the
repository rule on what it reads back).
"""

CHOICE_SCHEMA = 1

def _is_version(text):
    parts = text.split(".")
    return len(parts) == 2 and all([p.isdigit() and len(p) <= 3 for p in parts])

def check_choice(where, path, version):
    """Fails unless `path` is "" or absolute and `version` is "" or MAJOR.MINOR.

    Args:
      where: what declared them, for the error (e.g. "cuda.toolkit in module 'app'").
      path: the declared toolkit root, or "".
      version: the declared version, e.g. "13.0", or "".
    """
    if path and (not path.startswith("/") or "\n" in path):
        fail("{}: attribute 'path' must be an absolute path, got '{}'".format(where, path))
    if version and not _is_version(version):
        fail("{}: attribute 'version' must be MAJOR.MINOR (e.g. '13.0'), got '{}'".format(where, version))
    if not path and not version:
        fail("{}: give 'path' (the toolkit's root) or 'version' (e.g. '13.0'), or both".format(where))

def _cuda_toolkit_choice_impl(rctx):
    rctx.file("choice.json", json.encode({
        "schema": CHOICE_SCHEMA,
        "module": rctx.attr.module,
        "path": rctx.attr.path,
        "version": rctx.attr.version,
    }) + "\n")
    rctx.file("BUILD.bazel", "exports_files([\"choice.json\"])\n")

cuda_toolkit_choice = repository_rule(
    implementation = _cuda_toolkit_choice_impl,
    doc = "Holds the toolkit a module declared with `cuda.toolkit` (see the module docstring).",
    attrs = {
        "module": attr.string(doc = "The module whose tag declared the toolkit; '' if none did."),
        "path": attr.string(doc = "The declared toolkit root (absolute), or ''."),
        "version": attr.string(doc = "The declared version, MAJOR.MINOR, or ''."),
    },
)
