"""A stand-in for the buildozer module's `buildozer_binary` extension, written for this registry.

Bazel 7's `@bazel_tools` MODULE.bazel uses the extension and `use_repo`s `buildozer_binary`, so
every `bazel mod` command loads this file and may evaluate it. Only `bazel mod tidy` runs
buildozer; the stub repository's `buildozer.exe` says buildozer is not available offline
instead of downloading a prebuilt binary.
"""

_UNAVAILABLE = """#!/bin/sh
echo "buildozer is not available: the offline registry (third_party/registry) stubs it; edit the use_repo lines of MODULE.bazel by hand" >&2
exit 1
"""

def _buildozer_stub_repository_impl(repository_ctx):
    repository_ctx.file("buildozer.exe", _UNAVAILABLE, executable = True)
    repository_ctx.file("BUILD.bazel", 'exports_files(["buildozer.exe"])\n')

_buildozer_stub_repository = repository_rule(
    implementation = _buildozer_stub_repository_impl,
    doc = "A repository whose `buildozer.exe` fails, saying buildozer is stubbed.",
)

def _buildozer_binary_impl(module_ctx):
    _buildozer_stub_repository(name = "buildozer_binary")
    return module_ctx.extension_metadata(reproducible = True)

buildozer_binary = module_extension(
    implementation = _buildozer_binary_impl,
    doc = "Makes the `buildozer_binary` repository that `@bazel_tools` asks for (a stub).",
)
