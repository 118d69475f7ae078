"""The CubinScan action: the headers one translation unit includes, as a tree artifact.

A family with `header_closure = True` compiles each TU from its tree instead of from every
declared header, so a header the TU never includes is no input of its compile and changing it
re-keys nothing (docs/header-closure.md). `closure_compile` says how the compile's command
changes: the tree's root for `-I.`, the tree's copy of each include root and of the source,
and a prefix map that gives `__FILE__` the paths a compile without the tree sees.
"""

load("//tools/private:providers.bzl", "PyToolInfo")
load("//tools/private/actions:compile.bzl", "ACTION_ENV")

def scan_header_closure(ctx, src, headers, includes, label):
    """Declares `<name>.hdrs` and the CubinScan action that fills it.

    Args:
      ctx: the context of a rule with `_scan_tool`.
      src: the .cu File.
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
    args.add("--root", ".")
    args.add_all(includes, before_each = "--root")
    args.add_all(headers)
    ctx.actions.run(
        executable = ctx.executable._scan_tool,
        arguments = [args],
        inputs = depset([src], transitive = [headers, ctx.attr._scan_tool[PyToolInfo].srcs]),
        outputs = [tree],
        env = ACTION_ENV,
        mnemonic = "CubinScan",
        progress_message = "Scanning the headers of {}".format(label),
    )
    return tree

def closure_compile(tree, src, includes, flags):
    """The compile's words that change where it reads `tree`: struct(root, source, includes, flags)."""
    return struct(
        root = tree.path,
        source = tree.path + "/" + src.path,
        includes = [tree.path + "/" + i for i in includes.to_list()],
        flags = flags + ["-Xcompiler", "-ffile-prefix-map={}/=".format(tree.path)],
    )
