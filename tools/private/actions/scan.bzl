"""The CubinScan action: the headers one translation unit includes, as a tree artifact.

A compile (`header_closure`, the default) runs inside this tree instead of declaring every
header, so a header the TU never includes is no input of its compile and changing it re-keys
nothing (docs/header-closure.md). In the tree the source, the anchor and each header sit at
their execution-root paths, so every word of nvcc's command but the output's and nvcc's own is
the one a compile in the execution root has (`cubin_compile` in compile.bzl), and so is every
path the preprocessor writes into line markers (which `__FILE__` and glibc's `__builtin_FILE()`
assert messages read).
"""

load("//tools/private:providers.bzl", "PyToolInfo")
load("//tools/private/actions:compile.bzl", "ACTION_ENV")

def scan_header_closure(ctx, src, anchor, headers, includes, label):
    """Declares `<name>.hdrs` and the CubinScan action that fills it.

    Args:
      ctx: the context of a rule with `_scan_tool`.
      src: the .cu File.
      anchor: the File the compile force-includes (copied as it is).
      headers: a depset of every declared header File (besides the toolkit's).
      includes: a depset of the include roots (exec paths), in the compile's `-I` order.
      label: what the progress message names (the manifest id).

    Returns:
      The tree artifact (a directory File).
    """
    tree = ctx.actions.declare_directory(ctx.label.name + ".hdrs")
    args = ctx.actions.args()
    args.use_param_file("@%s", use_always = True)
    args.set_param_file_format("multiline")
    args.add("--out", tree.path)
    args.add("--src", src)
    args.add("--copy", anchor)
    args.add("--root", ".")
    args.add_all(includes, before_each = "--root")
    args.add_all(headers)
    ctx.actions.run(
        executable = ctx.executable._scan_tool,
        arguments = [args],
        inputs = depset([src, anchor], transitive = [headers, ctx.attr._scan_tool[PyToolInfo].srcs]),
        outputs = [tree],
        env = ACTION_ENV,
        mnemonic = "CubinScan",
        progress_message = "Scanning the headers of {}".format(label),
    )
    return tree
