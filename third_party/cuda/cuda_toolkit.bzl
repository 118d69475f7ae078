"""Repository rule that exposes a local CUDA toolkit as content-hashed inputs.

The toolkit is looked for, in this order:
  1. `$CUDA_PATH`, 2. `$CUDA_HOME`, 3. `/usr/local/cuda`, 4. the toolkit of `nvcc` on `$PATH`.
The first candidate holding both `bin/nvcc` and `nvvm/bin/cicc` wins. Under bzlmod a module can
declare it instead (`cuda.toolkit` of tools/extensions.bzl, read from `choice`): a `path` is
the only candidate; a `version` (MAJOR.MINOR, read from `include/cuda.h`) keeps the search,
adds `/usr/local/cuda-<version>` before `/usr/local/cuda`, and passes over a toolkit of
another version. Nothing declared: the search above, unchanged. What nvcc -cubin runs
(header_sets.bzl's COMPILER_FILES) and the include tree are symlinked into the repository and
declared as inputs, so Bazel keys actions on the files' content: the toolkit's install path
never reaches an action. Which headers a compile declares is header_sets.bzl's business.

The host compiler nvcc preprocesses with (`$CUBINSTORE_HOST_CC`, default `gcc`, a command
name looked up on the actions' fixed PATH `/usr/bin:/bin`) is not an input; its identity
(its `--version` output, the sha256 of its binary and of gcc's `cc1plus`) is written to
`host_compiler.id`, which every compile action takes as an input.

The demangler the manifest action resolves C++ entry names with: the toolkit's `bin/cu++filt`
when it has one (symlinked, so its content is an input), else `$CUBINSTORE_CXXFILT` (default
binutils' `c++filt`, a command name on the actions' PATH), whose identity is written to
`demangler.id` the same way.
"""

load("//third_party/cuda:header_sets.bzl", "COMPILER_DIRS", "COMPILER_FILES")
load("//third_party/cuda:toolkit_choice.bzl", "CHOICE_SCHEMA", "check_choice")

ACTION_PATH = "/usr/bin:/bin"

def _run(rctx, argv):
    """Runs one external command; fails with the command, exit code and output."""
    result = rctx.execute(argv)
    if result.return_code != 0:
        fail("cuda_toolkit: command {} exited with {}:\n{}{}".format(
            argv,
            result.return_code,
            result.stdout,
            result.stderr,
        ))
    return result.stdout

def _is_toolkit(rctx, root):
    return rctx.path(root + "/bin/nvcc").exists and rctx.path(root + "/nvvm/bin/cicc").exists

def _realpath(rctx, path):
    return _run(rctx, ["realpath", "-e", path]).strip()

def _read_choice(rctx):
    """What a module declared (`cuda.toolkit`): struct(declared_by, path, version); all "" if none."""
    if rctx.attr.choice == None:  # WORKSPACE: no module extension
        return struct(declared_by = "", path = "", version = "")
    data = json.decode(rctx.read(rctx.attr.choice))
    if type(data) != "dict" or data.get("schema") != CHOICE_SCHEMA:
        fail("cuda_toolkit: {} is not a toolkit choice of schema {}".format(rctx.attr.choice, CHOICE_SCHEMA))
    choice = struct(declared_by = data["module"], path = data["path"], version = data["version"])
    if choice.declared_by:
        check_choice("cuda.toolkit in module '{}'".format(choice.declared_by), choice.path, choice.version)
    return choice

def _toolkit_version(rctx, root):
    """MAJOR.MINOR from the toolkit's `include/cuda.h` (`#define CUDA_VERSION 13050` -> 13.5), or None."""
    header = rctx.path(root + "/include/cuda.h")
    if not header.exists:
        return None
    for line in rctx.read(header).split("\n"):
        words = [w for w in line.replace("\t", " ").split(" ") if w]
        if len(words) >= 3 and words[0] == "#define" and words[1] == "CUDA_VERSION" and words[2].isdigit():
            number = int(words[2])
            return "{}.{}".format(number // 1000, (number % 1000) // 10)
    return None

def _candidates(rctx, choice):
    """(root, source) pairs in search order; root None: nothing to look at, `source` says why."""
    if choice.path:
        return [(choice.path, "cuda.toolkit(path) in module '{}'".format(choice.declared_by))]
    candidates = []
    for var in ["CUDA_PATH", "CUDA_HOME"]:
        value = rctx.os.environ.get(var, "")
        if value:
            candidates.append((value, "$" + var))
        else:
            candidates.append((None, "${} (unset)".format(var)))
    if choice.version:
        candidates.append(("/usr/local/cuda-" + choice.version, "default location of CUDA " + choice.version))
    candidates.append(("/usr/local/cuda", "default location"))
    nvcc = rctx.which("nvcc")
    if nvcc:
        # Follow a symlinked or wrapped nvcc to its toolkit: bin/nvcc -> <root>.
        candidates.append((str(rctx.path(_realpath(rctx, str(nvcc))).dirname.dirname), "nvcc on $PATH"))
    else:
        candidates.append((None, "nvcc on $PATH (not found)"))
    return candidates

def _detect_toolkit(rctx, choice):
    """Finds the toolkit root. Returns struct(root, source, tried)."""
    tried = []

    # Kept in search order so the error lists the candidates in the order they were tried.
    for root, source in _candidates(rctx, choice):
        if root == None:
            tried.append(source)
            continue
        if not _is_toolkit(rctx, root):
            tried.append("{} from {} (no bin/nvcc and nvvm/bin/cicc)".format(root, source))
            continue
        if choice.version:
            found = _toolkit_version(rctx, root)
            if found != choice.version:
                tried.append("{} from {} (CUDA {}, not {})".format(
                    root,
                    source,
                    found or "of unknown version: no CUDA_VERSION in include/cuda.h",
                    choice.version,
                ))
                continue
        return struct(root = _realpath(rctx, root), source = source, tried = tried)
    if not choice.declared_by:
        fail("cuda_toolkit: no CUDA toolkit found. Tried, in order: {}. Set CUDA_PATH to the toolkit's root.".format(
            "; ".join(tried),
        ))
    wanted = "of version {} ".format(choice.version) if choice.version else ""
    fix = "Set CUDA_PATH to a CUDA {} toolkit's root, or change".format(choice.version) if not choice.path else "Change"
    fail("cuda_toolkit: no CUDA toolkit {}found for cuda.toolkit in module '{}'. Tried, in order: {}. {} cuda.toolkit in that module's MODULE.bazel.".format(
        wanted,
        choice.declared_by,
        "; ".join(tried),
        fix,
    ))

def _detect_host_compiler(rctx):
    """Finds the host compiler nvcc will run. Returns struct(name, binary)."""
    name = rctx.os.environ.get("CUBINSTORE_HOST_CC", "gcc")
    if "/" in name or not name:
        fail("cuda_toolkit: CUBINSTORE_HOST_CC must be a command name on {}, got '{}'".format(ACTION_PATH, name))
    for directory in ACTION_PATH.split(":"):
        candidate = directory + "/" + name
        if rctx.path(candidate).exists:
            return struct(name = name, binary = _realpath(rctx, candidate))
    fail("cuda_toolkit: host compiler '{}' (CUBINSTORE_HOST_CC) not found on {}".format(name, ACTION_PATH))

def _sha256(rctx, path):
    return _run(rctx, ["sha256sum", path]).split(" ")[0]

def _host_identity(rctx, host):
    """The host compiler's identity: what can change its output but is not an input.

    The driver's digest and version, plus the digest of gcc's C++ front end (cc1plus),
    which does the preprocessing nvcc asks for and is a separate binary.
    """
    lines = [
        "name: {}".format(host.name),
        "sha256: {}".format(_sha256(rctx, host.binary)),
    ]
    front_end = rctx.execute([host.binary, "-print-prog-name=cc1plus"]).stdout.strip()
    if front_end.startswith("/") and rctx.path(front_end).exists:
        lines.append("cc1plus sha256: {}".format(_sha256(rctx, _realpath(rctx, front_end))))
    lines.append("version:")
    lines.append(_run(rctx, [host.binary, "--version"]))
    return "\n".join(lines)

def _detect_demangler(rctx, toolkit):
    """The demangler: struct(command, identity); command is the repo path or a name on PATH."""
    if rctx.path(toolkit.root + "/bin/cu++filt").exists:
        rctx.symlink(toolkit.root + "/bin/cu++filt", "bin/cu++filt")
        return struct(command = "", identity = "the toolkit's bin/cu++filt (an input)\n")
    name = rctx.os.environ.get("CUBINSTORE_CXXFILT", "c++filt")
    if "/" in name or not name:
        fail("cuda_toolkit: CUBINSTORE_CXXFILT must be a command name on {}, got '{}'".format(ACTION_PATH, name))
    for directory in ACTION_PATH.split(":"):
        candidate = directory + "/" + name
        if rctx.path(candidate).exists:
            binary = _realpath(rctx, candidate)
            version = _run(rctx, [binary, "--version"]).split("\n")[0]
            return struct(command = name, identity = "name: {}\nsha256: {}\nversion: {}\n".format(
                name,
                _sha256(rctx, binary),
                version,
            ))
    fail("cuda_toolkit: no demangler: the toolkit has no bin/cu++filt and '{}' (CUBINSTORE_CXXFILT) is not on {}".format(
        name,
        ACTION_PATH,
    ))

def _cuda_toolkit_impl(rctx):
    toolkit = _detect_toolkit(rctx, _read_choice(rctx))
    host = _detect_host_compiler(rctx)
    demangler = _detect_demangler(rctx, toolkit)
    for f in COMPILER_FILES + COMPILER_DIRS:
        if rctx.path(toolkit.root + "/" + f).exists:
            rctx.symlink(toolkit.root + "/" + f, f)
    rctx.symlink(toolkit.root + "/include", "include")
    rctx.file("host_compiler.id", _host_identity(rctx, host))
    rctx.file("demangler.id", demangler.identity)
    rctx.file("defs.bzl", "HOST_CC = {}\nDEMANGLER = {}\n".format(repr(host.name), repr(demangler.command)))
    rctx.file("WORKSPACE", "workspace(name = {})\n".format(repr(rctx.name)))
    rctx.template("BUILD.bazel", rctx.attr._build_template)

cuda_toolkit = repository_rule(
    implementation = _cuda_toolkit_impl,
    doc = "Exposes the local CUDA toolkit (see the module docstring for the search order).",
    environ = ["CUDA_PATH", "CUDA_HOME", "PATH", "CUBINSTORE_HOST_CC", "CUBINSTORE_CXXFILT"],
    local = True,
    attrs = {
        "choice": attr.label(
            doc = "The `choice.json` of `@cuda_toolkit_choice` (the `cuda` module extension); " +
                  "None (WORKSPACE) or nothing declared: the search order alone.",
        ),
        "_build_template": attr.label(default = Label("//third_party/cuda:toolkit.BUILD")),
    },
)
