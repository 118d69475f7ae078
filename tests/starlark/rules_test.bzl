"""Analysis tests of cubinstore's public rules (Bazel 7, bazel_skylib's analysistest).

What is checked, without building anything: the command line and environment of a
CubinCompile action and of a PtxCompile one, the spec a cubin_manifest hands its tool, the target names and ids the
cubin_instantiations macro makes, and the messages of the rules' fail() calls.
"""

load("@bazel_skylib//lib:unittest.bzl", "analysistest", "asserts")
load("//tools:defs.bzl", "CubinSetInfo")

def _compile_command_test_impl(ctx):
    env = analysistest.begin(ctx)
    actions = [a for a in analysistest.target_actions(env) if a.mnemonic == "CubinCompile"]
    asserts.equals(env, 1, len(actions), "CubinCompile actions of the target")
    action = actions[0]
    argv = action.argv
    asserts.true(env, argv[0].startswith("external/") and argv[0].endswith("local_cuda/bin/nvcc"), "nvcc is the toolkit repository's: " + argv[0])
    for flag in ["-cubin", "-arch=sm_90a", "-I.", "-DPROBE_VALUE=7", "-lineinfo"]:
        asserts.true(env, flag in argv, "'{}' is missing from {}".format(flag, argv))
    cubin = action.outputs.to_list()
    asserts.equals(env, ["probe_compile.cubin"], [f.basename for f in cubin])
    asserts.equals(env, cubin[0].path, argv[argv.index("-o") + 1])
    asserts.equals(env, "tests/starlark/probe.cu", argv[-1])

    # cicc gets the workspace-relative source path, never the sandbox's absolute one.
    pinned = [argv[i + 2] for i in range(len(argv) - 2) if argv[i] == "--orig_src_path_name"]
    asserts.equals(env, 1, len(pinned), "one --orig_src_path_name")
    asserts.equals(env, "-Xcicc", argv[argv.index("--orig_src_path_name") + 1])
    asserts.false(env, pinned[0].startswith("/"), "pinned source path is relative: " + pinned[0])
    for arg in argv:
        asserts.false(env, arg.startswith("/") or arg.startswith("-I/"), "absolute argument '{}'".format(arg))
    asserts.equals(env, {"LC_ALL": "C", "PATH": "/usr/bin:/bin"}, action.env)
    inputs = [f.path for f in action.inputs.to_list()]
    asserts.true(env, "tests/starlark/probe.cu" in inputs, "the source is an input")
    asserts.true(env, len([p for p in inputs if p.endswith("local_cuda/host_compiler.id")]) == 1, "host_compiler.id is an input")
    return analysistest.end(env)

compile_command_test = analysistest.make(_compile_command_test_impl)

def _ptx_compile_command_test_impl(ctx):
    env = analysistest.begin(ctx)
    actions = analysistest.target_actions(env)
    asserts.equals(env, [], [a for a in actions if a.mnemonic == "CubinCompile"], "no CUBIN compile")
    ptx = [a for a in actions if a.mnemonic == "PtxCompile"]
    asserts.equals(env, 1, len(ptx), "PtxCompile actions of the target")
    argv = ptx[0].argv
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
