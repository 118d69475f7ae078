"""Analysis tests of cubinstore's public rules (Bazel 7, bazel_skylib's analysistest).

What is checked, without building anything: the command line and environment of a
CubinCompile action and of a PtxCompile one, the spec a cubin_manifest hands its tool, the target names and ids the
cubin_instantiations macro makes, and the messages of the rules' fail() calls.
"""

load("@bazel_skylib//lib:unittest.bzl", "analysistest", "asserts")
load("//tools:defs.bzl", "CubinSetInfo")

def _nvcc_argv(env, action):
    """nvcc's argv as a compile in the execution root has it, and the closure's tree (or None).

    A header closure's compile is `in_tree.sh TREE <up>nvcc ...`, its output `<up>out`, where <up>
    climbs out of the tree: the other words are the same as without the tree.
    """
    argv = action.argv
    if not argv[0].endswith("tools/private/in_tree.sh"):
        return argv, None
    tree, up = argv[1], "../" * len(argv[1].split("/"))
    nvcc = argv[2:]
    asserts.true(env, nvcc[0].startswith(up), "nvcc climbs out of the tree: " + nvcc[0])
    out = nvcc.index("-o") + 1
    asserts.true(env, nvcc[out].startswith(up), "the output climbs out of the tree: " + nvcc[out])
    return [nvcc[0][len(up):]] + nvcc[1:out] + [nvcc[out][len(up):]] + nvcc[out + 1:], tree

def _compile_command_test_impl(ctx):
    env = analysistest.begin(ctx)
    actions = analysistest.target_actions(env)
    compiles = [a for a in actions if a.mnemonic == "CubinCompile"]
    asserts.equals(env, 1, len(compiles), "CubinCompile actions of the target")
    action = compiles[0]
    argv, tree = _nvcc_argv(env, action)
    asserts.true(env, argv[0].startswith("external/") and argv[0].endswith("local_cuda/bin/nvcc"), "nvcc is the toolkit repository's: " + argv[0])
    for flag in ["-cubin", "-arch=sm_90a", "-I.", "-DPROBE_VALUE=7", "-lineinfo"]:
        asserts.true(env, flag in argv, "'{}' is missing from {}".format(flag, argv))
    cubin = action.outputs.to_list()
    asserts.equals(env, ["probe_compile.cubin" if ctx.attr.closure else "probe_declared_compile.cubin"], [f.basename for f in cubin])
    asserts.equals(env, cubin[0].path, argv[argv.index("-o") + 1])
    asserts.equals(env, "tests/starlark/probe.cu", argv[-1])

    # cicc gets the workspace-relative source path, never the sandbox's absolute one.
    pinned = [argv[i + 2] for i in range(len(argv) - 2) if argv[i] == "--orig_src_path_name"]
    asserts.equals(env, 1, len(pinned), "one --orig_src_path_name")
    asserts.equals(env, "-Xcicc", argv[argv.index("--orig_src_path_name") + 1])
    asserts.false(env, pinned[0].startswith("/"), "pinned source path is relative: " + pinned[0])
    for arg in action.argv:
        asserts.false(env, arg.startswith("/") or arg.startswith("-I/"), "absolute argument '{}'".format(arg))
    asserts.equals(env, {"LC_ALL": "C", "PATH": "/usr/bin:/bin"}, action.env)
    inputs = [f.path for f in action.inputs.to_list()]
    asserts.true(env, len([p for p in inputs if p.endswith("local_cuda/host_compiler.id")]) == 1, "host_compiler.id is an input")
    scans = [a for a in actions if a.mnemonic == "CubinScan"]
    if ctx.attr.closure:
        # The source and the headers reach the compile only through the scan's tree.
        asserts.true(env, tree != None and tree.endswith("tests/starlark/probe_compile.hdrs"), "the tree: {}".format(tree))
        asserts.true(env, tree in inputs and "tests/starlark/probe.cu" not in inputs, "only the tree is an input: {}".format(inputs))
        asserts.equals(env, 1, len(scans), "one CubinScan action")
        asserts.true(env, "tests/starlark/probe.cu" in [f.path for f in scans[0].inputs.to_list()], "the scan reads the source")
        asserts.equals(env, [tree], [f.path for f in scans[0].outputs.to_list()])
    else:
        asserts.equals(env, None, tree)
        asserts.equals(env, [], scans, "no scan with header_closure = False")
        asserts.true(env, "tests/starlark/probe.cu" in inputs, "the source is an input")
    return analysistest.end(env)

compile_command_test = analysistest.make(
    _compile_command_test_impl,
    attrs = {"closure": attr.bool(default = True)},
)

def _ptx_compile_command_test_impl(ctx):
    env = analysistest.begin(ctx)
    actions = analysistest.target_actions(env)
    asserts.equals(env, [], [a for a in actions if a.mnemonic == "CubinCompile"], "no CUBIN compile")
    ptx = [a for a in actions if a.mnemonic == "PtxCompile"]
    asserts.equals(env, 1, len(ptx), "PtxCompile actions of the target")
    argv, _tree = _nvcc_argv(env, ptx[0])
    for flag in ["-ptx", "-arch=compute_90", "-I.", "-DPROBE_VALUE=7", "--orig_src_path_name"]:
        asserts.true(env, flag in argv, "'{}' is missing from {}".format(flag, argv))
    asserts.false(env, "-cubin" in argv, "-cubin in a PTX compile: {}".format(argv))
    outputs = ptx[0].outputs.to_list()
    asserts.equals(env, ["probe_ptx_compile.ptx"], [f.basename for f in outputs])
    asserts.equals(env, outputs[0].path, argv[argv.index("-o") + 1])
    asserts.equals(env, {"LC_ALL": "C", "PATH": "/usr/bin:/bin"}, ptx[0].env)
    return analysistest.end(env)

ptx_compile_command_test = analysistest.make(_ptx_compile_command_test_impl)

def _manifest_spec_test_impl(ctx):
    env = analysistest.begin(ctx)
    writes = [a for a in analysistest.target_actions(env) if a.mnemonic == "FileWrite"]
    specs = [a for a in writes if a.outputs.to_list()[0].basename == "probe_manifest.spec.json"]
    asserts.equals(env, 1, len(specs), "the spec file action")
    spec = json.decode(specs[0].content)
    kernels = {k["id"]: k for k in spec["kernels"]}
    asserts.equals(env, sorted(ctx.attr.expected_ids), sorted(kernels.keys()))
    one = kernels["probe/f32/vec4/sm_90a"]
    asserts.equals(env, "//tests/starlark:probe_f32_vec4_sm_90a", one["target"])
    asserts.equals(env, {"dtype": "f32", "vec": 4}, one["params"])
    asserts.equals(env, "sm_90a", one["arch"])
    asserts.equals(env, "probe", one["family"])
    asserts.true(env, one["cubin"].endswith("tests/starlark/probe_f32_vec4_sm_90a.cubin"), one["cubin"])
    asserts.equals(env, {"probe_f32": ["i32", "f32", "ptr"]}, one["entries"])
    runs = [a for a in analysistest.target_actions(env) if a.mnemonic == "CubinManifest"]
    asserts.equals(env, 1, len(runs), "one CubinManifest action")
    cubins = [f.basename for f in runs[0].inputs.to_list() if f.extension == "cubin"]
    asserts.equals(env, len(ctx.attr.expected_ids), len(cubins), "every CUBIN is an input of the manifest action")
    return analysistest.end(env)

manifest_spec_test = analysistest.make(
    _manifest_spec_test_impl,
    attrs = {"expected_ids": attr.string_list()},
)

def _macro_names_test_impl(ctx):
    env = analysistest.begin(ctx)
    instances = analysistest.target_under_test(env)[CubinSetInfo].instances
    asserts.equals(env, sorted(ctx.attr.expected_targets), sorted([i.target for i in instances]))
    asserts.equals(env, sorted(ctx.attr.expected_ids), sorted([i.id for i in instances]))
    return analysistest.end(env)

macro_names_test = analysistest.make(
    _macro_names_test_impl,
    attrs = {
        "expected_ids": attr.string_list(),
        "expected_targets": attr.string_list(),
    },
)

def _fails_with_test_impl(ctx):
    env = analysistest.begin(ctx)
    asserts.expect_failure(env, ctx.attr.message)
    return analysistest.end(env)

fails_with_test = analysistest.make(
    _fails_with_test_impl,
    expect_failure = True,
    attrs = {"message": attr.string()},
)
