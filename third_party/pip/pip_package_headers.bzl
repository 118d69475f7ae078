"""Repository rule for the headers an installed Python package ships, found by the package's name.

    pip_package_headers(name = "pip_mylib_include", package = "mylib", subdir = "include")

exposes `<the package's folder>/<subdir>` as `@<name>//:headers`, a `cuda_headers` target whose
include directory is `include`. `cubinstore warmset export --nvcc` declares one for each include
root of a library's JIT that lies in a `site-packages/<package>/` folder, so CI compiles against
the library as pip installed it there, wherever that is.

The package's folder is found by asking a Python `importlib.util.find_spec(package)`, with the
client's `$PYTHONPATH`, in this order:
  1. `$CUBINSTORE_PIP_PYTHON` (the interpreter of the environment the library is installed in,
     e.g. the serving virtualenv's `bin/python`),
  2. the workspace's `.venv/bin/python3`,
  3. `python3` on `$PATH`.
The first Python that finds the package and whose folder holds `<subdir>` wins; for a namespace
package, the first of its folders that holds `<subdir>`. One variable names the interpreter for
every package (rather than one variable per package) because a repository rule declares the
variables it reads in a fixed list. `cubinstore warmset publish --nvcc` finds the folder the
same way and checks each call's files against it before publishing. The headers are
content-hashed inputs: the folder's path never reaches an action.
"""

_FIND_PACKAGE = """
import importlib.util, sys
spec = importlib.util.find_spec(sys.argv[1])
if spec is None:
    sys.exit("package %s is not installed" % sys.argv[1])
if not spec.submodule_search_locations:
    sys.exit("%s is a module, not a package folder" % sys.argv[1])
print("\\n".join(spec.submodule_search_locations))
"""

_IDENT_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_"
_SAFE_PART = _IDENT_CHARS + ".+-"

def _check_attrs(rctx):
    package = rctx.attr.package
    if not package or package[0].isdigit() or [c for c in package.elems() if c not in _IDENT_CHARS]:
        fail("pip_package_headers {}: attribute 'package' must be a Python identifier (an import name), got '{}'".format(rctx.name, package))
    subdir = rctx.attr.subdir
    for part in subdir.split("/") if subdir else []:
        if part in ("", ".", "..") or [c for c in part.elems() if c not in _SAFE_PART]:
            fail("pip_package_headers {}: attribute 'subdir' must be a relative path of names made of {}, got '{}'".format(
                rctx.name,
                _SAFE_PART,
                subdir,
            ))

def _run(rctx, argv):
    """Runs one Python; returns struct(ok, out, why) (why: the exit code and what it printed)."""
    result = rctx.execute(argv, environment = {"PYTHONPATH": rctx.os.environ.get("PYTHONPATH", "")}, timeout = 60)
    if result.return_code == 0:
        return struct(ok = True, out = result.stdout, why = "")
    return struct(ok = False, out = "", why = "exit {}: {}".format(result.return_code, (result.stderr or result.stdout).strip()))

def _detect(rctx):
    """Finds the package's folder holding `subdir`. Returns struct(path, source, tried)."""
    package, subdir = rctx.attr.package, rctx.attr.subdir
    tried = []

    # (python, source); python None: nothing to run, `source` says why. In search order.
    candidates = []
    explicit = rctx.os.environ.get("CUBINSTORE_PIP_PYTHON", "")
    candidates.append((explicit or None, "$CUBINSTORE_PIP_PYTHON" if explicit else "$CUBINSTORE_PIP_PYTHON (unset)"))

    # BUILD.bazel, not WORKSPACE: under bzlmod the workspace may have no WORKSPACE.
    workspace = rctx.path(Label("//:BUILD.bazel")).dirname
    candidates.append((str(workspace) + "/.venv/bin/python3", "the workspace's .venv"))
    python3 = rctx.which("python3")
    candidates.append((str(python3) if python3 else None, "python3 on $PATH" if python3 else "python3 on $PATH (not found)"))
    for python, source in candidates:
        if python == None:
            tried.append(source)
            continue
        if not rctx.path(python).exists:
            tried.append("{} (no {})".format(source, python))
            continue
        result = _run(rctx, [python, "-c", _FIND_PACKAGE, package])
        if not result.ok:
            tried.append("{} {} ({})".format(source, python, result.why))
            continue
        folders = [line.strip() for line in result.out.splitlines() if line.strip()]
        for folder in folders:
            path = folder + ("/" + subdir if subdir else "")
            if rctx.path(path).exists:
                return struct(path = path, source = "{} {}".format(source, python), tried = tried)
        tried.append("{} {} (found {} in {}, without {})".format(source, python, package, ", ".join(folders), subdir))
    fail("pip_package_headers {}: no installed package '{}' with a folder '{}'. Tried, in order: {}. Install the library into the Python the build sees, or set CUBINSTORE_PIP_PYTHON to the interpreter of the environment it is installed in.".format(
        rctx.name,
        package,
        subdir,
        "; ".join(tried),
    ))

def _pip_package_headers_impl(rctx):
    _check_attrs(rctx)
    found = _detect(rctx)
    rctx.symlink(found.path, "include")
    rctx.file("WORKSPACE", "workspace(name = {})\n".format(repr(rctx.name)))
    rctx.file("FOUND", "{}\nfound by {}\n".format(found.path, found.source))
    rctx.file("BUILD.bazel", "\n".join([
        "# Generated by pip_package_headers (@cubinstore//third_party/pip:pip_package_headers.bzl).",
        "load(\"@cubinstore//tools:defs.bzl\", \"cuda_headers\")",
        "",
        "package(default_visibility = [\"//visibility:public\"])",
        "",
        "cuda_headers(",
        "    name = \"headers\",",
        "    hdrs = glob(",
        "        [\"include/**\"],",
        "        exclude = [\"include/**/__pycache__/**\"],",
        "    ),",
        "    includes = [\"include\"],",
        ")",
        "",
    ]))

pip_package_headers = repository_rule(
    implementation = _pip_package_headers_impl,
    doc = "Exposes `subdir` of an installed Python package's folder, found by the package's name, as `@<name>//:headers` (see the module docstring).",
    environ = ["CUBINSTORE_PIP_PYTHON", "PYTHONPATH", "PATH"],
    local = True,
    attrs = {
        "package": attr.string(mandatory = True, doc = "The package's import name, e.g. 'deep_gemm'."),
        "subdir": attr.string(doc = "The folder below the package's to expose, e.g. 'include'; empty: the package's folder."),
    },
)
