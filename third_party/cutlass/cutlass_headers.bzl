"""Repository rule for the CUTLASS/CuTe headers of the pinned `nvidia-cutlass` wheel (4.2.0.0).

The include directory is looked for, in this order:
  1. `$CUBINSTORE_CUTLASS_INCLUDE` (a directory holding `cute/` and `cutlass/`),
  2. the wheel in the workspace's `.venv` (`cutlass_library/source/include`),
  3. the wheel seen by `python3` on `$PATH`.
The headers are content-hashed inputs: a symlinked or a copied tree of the same
headers gives the same action keys.
"""

_EXPECTED_VERSION = (4, 2)

_FIND_WHEEL = """
import importlib.util, os, sys
spec = importlib.util.find_spec("cutlass_library")
if spec is None or not spec.submodule_search_locations:
    sys.exit("cutlass_library is not installed")
print(os.path.join(list(spec.submodule_search_locations)[0], "source", "include"))
"""

def _has_headers(rctx, path):
    return rctx.path(path + "/cute/tensor.hpp").exists and rctx.path(path + "/cutlass/version.h").exists

def _detect_include_dir(rctx):
    """Finds the include directory. Returns struct(path, source, tried)."""
    tried = []
    explicit = rctx.os.environ.get("CUBINSTORE_CUTLASS_INCLUDE", "")
    if explicit:
        if _has_headers(rctx, explicit):
            return struct(path = explicit, source = "$CUBINSTORE_CUTLASS_INCLUDE", tried = tried)
        fail("cutlass_headers: $CUBINSTORE_CUTLASS_INCLUDE='{}' holds no cute/tensor.hpp and cutlass/version.h".format(explicit))
    tried.append("$CUBINSTORE_CUTLASS_INCLUDE (unset)")

    # BUILD.bazel, not WORKSPACE: under bzlmod (Bazel 7) the workspace may have no WORKSPACE.
    workspace = rctx.path(Label("//:BUILD.bazel")).dirname
    pythons = [(str(workspace) + "/.venv/bin/python3", "the workspace's .venv")]
    python3 = rctx.which("python3")
    if python3:
        pythons.append((str(python3), "python3 on $PATH"))
    for python, source in pythons:
        if not rctx.path(python).exists:
            tried.append("{} (no {})".format(source, python))
            continue
        result = rctx.execute([python, "-c", _FIND_WHEEL])
        path = result.stdout.strip()
        if result.return_code == 0 and _has_headers(rctx, path):
            return struct(path = path, source = source, tried = tried)
        tried.append("{} ({})".format(source, (result.stderr or result.stdout).strip() or "no headers"))
    fail("cutlass_headers: CUTLASS headers not found. Tried, in order: {}. Run tools/bootstrap.sh (pip install nvidia-cutlass==4.2.0.0) or set CUBINSTORE_CUTLASS_INCLUDE.".format(
        "; ".join(tried),
    ))

def _check_version(rctx, include_dir):
    version_h = rctx.read(include_dir + "/cutlass/version.h")
    found = []
    for macro in ["CUTLASS_MAJOR", "CUTLASS_MINOR"]:
        for line in version_h.splitlines():
            parts = [p for p in line.replace("\t", " ").split(" ") if p]
            if len(parts) == 3 and parts[0] == "#define" and parts[1] == macro:
                found.append(int(parts[2]))
    if tuple(found) != _EXPECTED_VERSION:
        fail("cutlass_headers: {}/cutlass/version.h is CUTLASS {}, expected {}.{} (nvidia-cutlass==4.2.0.0)".format(
            include_dir,
            ".".join([str(v) for v in found]),
            _EXPECTED_VERSION[0],
            _EXPECTED_VERSION[1],
        ))

def _cutlass_headers_impl(rctx):
    found = _detect_include_dir(rctx)
    _check_version(rctx, found.path)
    rctx.symlink(found.path, "include")
    rctx.file("WORKSPACE", "workspace(name = {})\n".format(repr(rctx.name)))
    rctx.template("BUILD.bazel", rctx.attr._build_template)

cutlass_headers = repository_rule(
    implementation = _cutlass_headers_impl,
    doc = "Exposes the CUTLASS/CuTe headers of the nvidia-cutlass wheel (see the module docstring).",
    environ = ["CUBINSTORE_CUTLASS_INCLUDE", "PATH"],
    local = True,
    attrs = {
        "_build_template": attr.label(default = Label("//third_party/cutlass:cutlass.BUILD")),
    },
)
