"""The CubinCompile action: its command line, expanded from the one table of its shape, and the
one definition of the action every rule that compiles a CUBIN runs (`cuda_cubin`, `nvcc_cubin`).

`CUBIN_ARGV` and `LIST_SLOTS` mirror `cubinstore/_core/nvcc.py` (the JIT expands the same
table); `tests/core/test_nvcc_argv.py` checks that the two are equal. A rule fills the table's
slots (`cubin_compile_args`) and runs it with `cubin_compile`, taking the toolkit and the
attributes that select it from `COMPILE_ATTRS`.
"""

load("//third_party/cuda:header_sets.bzl", "ALL", "TOOLKIT_HEADER_SETS", "resolve_header_sets")

# Actions see a fixed environment: nothing from the shell that runs Bazel.
ACTION_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C"}

# The attributes of a rule that runs `cubin_compile`: the toolkit's parts and the header sets.
COMPILE_ATTRS = {
    "toolkit_headers": attr.string_list(
        default = [ALL],
        doc = "The toolkit's optional header sets the source may include, besides the core headers every compile gets " +
              "(cuda_runtime.h and the toolkit's own headers): " +
              ", ".join(["'{}' ({})".format(n, s.doc) for n, s in TOOLKIT_HEADER_SETS.items()]) +
              "; a set brings the sets it includes. '{}' (the default): the whole include tree. ".format(ALL) +
              "Fewer files make the sandbox cheaper; a header outside the sets is missing in the sandbox and fails the compile.",
    ),
    "_nvcc": attr.label(default = "@local_cuda//:bin/nvcc", executable = True, allow_single_file = True, cfg = "exec"),
    "_toolkit_compiler": attr.label(default = "@local_cuda//:compiler"),
    "_toolkit_core_headers": attr.label(default = "@local_cuda//:headers_core"),
    "_toolkit_header_sets": attr.label_list(default = ["@local_cuda//:headers_" + n for n in TOOLKIT_HEADER_SETS]),
    "_host_compiler_id": attr.label(default = "@local_cuda//:host_compiler.id", allow_single_file = True),
}

CUBIN_ARGV = [
    "{nvcc}",
    "-cubin",
    "-arch={arch}",
    "-ccbin",
    "{host_cc}",
    "{flags}",
    "-I.",
    "{includes}",
    "{defines}",
    "-include",
    "{anchor}",
    "-Xcicc",
    "--orig_src_path_name",
    "-Xcicc",
    "{source_name}",
    "{extra}",
    "-o",
    "{output}",
    "{source}",
]

LIST_SLOTS = {
    "defines": "-D{}",
    "extra": "{}",
    "flags": "{}",
    "includes": "-I{}",
}

def cubin_compile_args(ctx, values, lists, ptx = False, tree = None):
    """An `Args` holding the command after nvcc itself (the executable is run separately).

    Args:
      ctx: the rule context.
      values: slot -> str or File, for the single-word slots other than `nvcc`.
      lists: slot -> list or depset of str, for the slots of `LIST_SLOTS`.
      ptx: write PTX text (`-ptx`, with a `compute_` arch) instead of a CUBIN; every other word
        is the table's, and a CUBIN's command is the table exactly.
      tree: the header closure `cubin_compile` runs nvcc in (None: the execution root); the
        output File is then named from inside it, every other word stays as it is.

    Returns:
      The `Args`.
    """
    args = ctx.actions.args()
    for word in CUBIN_ARGV[1:]:
        slot = word[1:-1] if word.startswith("{") and word.endswith("}") else None
        if slot in LIST_SLOTS:
            fmt = LIST_SLOTS[slot].replace("{}", "%s")
            args.add_all(lists[slot], format_each = fmt)
        elif slot == "output" and tree != None:
            args.add(_up_from(tree) + values[slot].path)
        elif slot != None:
            args.add(values[slot])
        elif "{" in word:
            # a word with a slot inside it, e.g. -arch={arch}
            start = word.index("{")
            end = word.index("}")
            args.add(word[:start] + values[word[start + 1:end]] + word[end + 1:])
        elif ptx and word == "-cubin":
            args.add("-ptx")
        else:
            args.add(word)
    return args

def _toolkit_inputs(ctx):
    """The toolkit's files a compile declares, a list of depsets.

    The compiler, the core headers, and the header sets `toolkit_headers` names.
    """
    wanted = resolve_header_sets(ctx.label, ctx.attr.toolkit_headers)
    sets = {t.label.name[len("headers_"):]: t for t in ctx.attr._toolkit_header_sets}
    return [ctx.attr._toolkit_compiler[DefaultInfo].files, ctx.attr._toolkit_core_headers[DefaultInfo].files] + [
        sets[name][DefaultInfo].files
        for name in wanted
    ]

def header_hint(ctx):
    """Where a compile's headers come from, said in its progress message.

    Bazel prints an action's progress message in front of its failure, so a header the
    sandbox lacks (nvcc's bare `No such file or directory`) is reported beside the attributes
    that declare headers. The progress message is no part of the action key: no key changes.

    Args:
      ctx: the context of a rule with `COMPILE_ATTRS`.

    Returns:
      E.g. `[headers only from hdrs, deps and toolkit_headers: core + libcudacxx]`.
    """
    attrs = [a for a in ("hdrs", "deps", "system_deps") if hasattr(ctx.attr, a)]
    if ALL in ctx.attr.toolkit_headers:
        sets = ALL
    else:
        sets = " + ".join(["core"] + resolve_header_sets(ctx.label, ctx.attr.toolkit_headers))
    return "[headers only from {} and toolkit_headers: {}]".format(", ".join(attrs), sets)

def cubin_compile(ctx, src, anchor, output, args, headers, progress_message, mnemonic = "CubinCompile", tree = None):
    """Runs nvcc once (mnemonic `CubinCompile`, or `PtxCompile` for PTX): `src` to `output`.

    Args:
      ctx: the context of a rule with `COMPILE_ATTRS`.
      src: the .cu File.
      anchor: the File force-included before it (its module anchor).
      output: the .cubin File to write.
      args: the command after nvcc, from `cubin_compile_args`.
      headers: a depset of the header Files the source may read, besides the toolkit's.
      progress_message: what Bazel shows while it runs; `header_hint` is appended.
      mnemonic: `CubinCompile`, or `PtxCompile` for args made with `ptx = True`.
      tree: a header closure (`scan_header_closure`) holding the source, the anchor and the
        headers it reads, each at its execution-root path: nvcc then runs in it (through the
        rule's `_in_tree`), from these files only (`headers`, `src` and `anchor` are then no
        inputs); `args` must come from `cubin_compile_args` with the same `tree`.
    """
    toolkit = _toolkit_inputs(ctx)
    message = progress_message + " " + header_hint(ctx)
    if tree == None:
        executable, arguments, tools = ctx.executable._nvcc, [args], []
        inputs = depset([src, anchor, ctx.file._host_compiler_id], transitive = [headers] + toolkit)
    else:
        executable, tools = ctx.executable._in_tree, [ctx.executable._nvcc]
        arguments = [tree.path, _up_from(tree) + ctx.executable._nvcc.path, args]
        inputs = depset([tree, ctx.file._host_compiler_id], transitive = toolkit)
    ctx.actions.run(
        executable = executable,
        arguments = arguments,
        tools = tools,
        inputs = inputs,
        outputs = [output],
        env = ACTION_ENV,
        mnemonic = mnemonic,
        progress_message = message,
    )

def _up_from(tree):
    """The relative path from inside `tree` (a directory File) back to the execution root."""
    return "../" * len(tree.path.split("/"))
