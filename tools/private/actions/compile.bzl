"""The CubinCompile command line, expanded from the one table of its shape.

`CUBIN_ARGV` and `LIST_SLOTS` mirror `cubinstore/_core/nvcc.py` (the JIT expands the same
table); `tests/core/test_nvcc_argv.py` checks that the two are equal.
"""

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

def cubin_compile_args(ctx, values, lists):
    """An `Args` holding the command after nvcc itself (the executable is run separately).

    Args:
      ctx: the rule context.
      values: slot -> str or File, for the single-word slots other than `nvcc`.
      lists: slot -> list or depset of str, for the slots of `LIST_SLOTS`.

    Returns:
      The `Args`.
    """
    args = ctx.actions.args()
    for word in CUBIN_ARGV[1:]:
        slot = word[1:-1] if word.startswith("{") and word.endswith("}") else None
        if slot in LIST_SLOTS:
            fmt = LIST_SLOTS[slot].replace("{}", "%s")
            args.add_all(lists[slot], format_each = fmt)
        elif slot != None:
            args.add(values[slot])
        elif "{" in word:
            # a word with a slot inside it, e.g. -arch={arch}
            start = word.index("{")
            end = word.index("}")
            args.add(word[:start] + values[word[start + 1:end]] + word[end + 1:])
        else:
            args.add(word)
    return args
