"""py_tool: a Python script run as a build action, with the package sources it imports.

`py_binary` would need `@rules_cc` (for its launcher) on Bazel 4.2.3, which nothing here can
download. The script runs under the host's `python3` (`#!/usr/bin/env python3`, the actions'
fixed PATH); the sources it imports are action inputs at their workspace paths, and the
script puts the action's working directory (the execution root) first on `sys.path`.
"""

load("//tools/private:providers.bzl", "PyToolInfo")

def _py_tool_impl(ctx):
    executable = ctx.actions.declare_file(ctx.label.name)
    ctx.actions.symlink(output = executable, target_file = ctx.file.src, is_executable = True)
    srcs = depset(ctx.files.deps)
    return [
        DefaultInfo(executable = executable, runfiles = ctx.runfiles(transitive_files = srcs)),
        PyToolInfo(srcs = srcs),
    ]

py_tool = rule(
    implementation = _py_tool_impl,
    executable = True,
    doc = "A Python build tool: `src` plus the `.py` files it imports (`deps`), which actions running it must take as inputs (PyToolInfo).",
    attrs = {
        "src": attr.label(allow_single_file = [".py"], mandatory = True, doc = "The script."),
        "deps": attr.label_list(allow_files = [".py"], doc = "Python sources it imports, at their workspace paths."),
    },
)
