"""Temporary copies of the Bazel workspace, the Bazel commands run in them, and what the
tests read back: execution-log spawns (cache hit or not, per target) and the manifest.

Every copy gets its own output base and every build names its disk cache explicitly, so
nothing is shared with the developer's checkout unless a test asks for it. Bazel runs with
a fixed, minimal client environment: a variable reaches a repository rule only when a test
passes it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]

# What `bazel build //kernels:all` builds: the manifest and, through it, every instantiation.
ALL_TARGETS = ("//kernels:all",)
# The families the sensitivity matrix changes: small and quick to compile (no sm_90a GEMMs).
MATRIX_TARGETS = ("//kernels/axpy:all", "//kernels/transpose:all")

COMPILE = "CubinCompile"
PTX_COMPILE = "PtxCompile"  # a family's `ptx = [...]`: kernels of arch compute_...
MANIFEST = "CubinManifest"

# The PATH the rules give actions; the Bazel client gets the same (plus node for bazelisk).
ACTION_PATH = "/usr/bin:/bin"
# The .bazelrc default (`--disk_cache=~/...`): a seed for tests that only assert on a second build.
DEVELOPER_DISK_CACHE = Path("~/.cache/cubinstore/bazel-disk-cache").expanduser()

# No Bazel command of these tests should come near this; a hung one must not hang CI.
BAZEL_TIMEOUT_S = 1800
# Servers left behind by a killed test run go away on their own.
SERVER_IDLE_S = 900
# Set to a git revision (e.g. HEAD) to test that commit instead of the working tree: for a
# checkout shared with work in progress.
TREE_ENV = "CUBINSTORE_BAZEL_TEST_REV"

# Bazel 7: tools/bazel7 runs it in the Debian sid root that tools/bootstrap_bazel7.sh builds.
BAZEL7 = REPO_ROOT / "tools" / "bazel7"
SID_ROOT_ENV = "CUBINSTORE_SID_ROOT"
# Under bzlmod a repository made by MODULE.bazel's use_repo_rule has a canonical name.
BZLMOD_REPO_PREFIX = "_main~_repo_rules~"


class WorkspaceError(Exception):
    """A test workspace could not be set up (missing tool, copy failed)."""


class BazelError(Exception):
    """A Bazel command exited non-zero; carries its combined output."""

    def __init__(self, argv: Sequence[str], workspace: Path, returncode: int, output: str) -> None:
        self.argv = list(argv)
        self.workspace = workspace
        self.returncode = returncode
        self.output = output
        tail = "\n".join(output.splitlines()[-40:])
        super().__init__(
            f"bazel exited with {returncode} in {workspace}: {' '.join(self.argv)}\n{tail}")

    def fail_message(self) -> str:
        """The text of the first Starlark `fail()` in the output ('' if none)."""
        marker = "Error in fail: "
        for line in self.output.splitlines():
            if marker in line:
                return line.split(marker, 1)[1].strip()
        return ""


# -- finding the tools ------------------------------------------------------------------------------

def find_bazel() -> Path | None:
    """bazelisk from the checkout's node_modules (as the README runs it), else bazelisk/bazel on PATH."""
    local = REPO_ROOT / "node_modules" / ".bin" / "bazelisk"
    if local.exists():
        return local
    for name in ("bazelisk", "bazel"):
        found = shutil.which(name)
        if found:
            return Path(found)
    return None


def sid_root() -> Path:
    return Path(os.environ.get(SID_ROOT_ENV, "/var/lib/cubinstore/sid"))


def find_bazel7() -> Path | None:
    """tools/bazel7, where the sid root it needs is complete; else None."""
    root = sid_root()
    if (root / ".cubinstore-ready").exists() and (root / "usr" / "bin" / "bazel").exists():
        return BAZEL7
    return None


def sid_toolkit() -> Path:
    """The CUDA 13.5 toolkit of the sid root, as a path on this host (Bazel 4.2.3 can use it too)."""
    return sid_root() / "opt" / "cubinstore" / "site" / "nvidia" / "cu13"


def find_toolkit() -> Path | None:
    """The CUDA toolkit the repository rule would pick, in its order; None if there is none."""
    candidates = [os.environ.get("CUDA_PATH", ""), os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for root in filter(None, candidates):
        if (Path(root) / "bin" / "nvcc").exists() and (Path(root) / "nvvm" / "bin" / "cicc").exists():
            return Path(root).resolve()
    return None


def find_venv() -> Path | None:
    """The virtualenv whose nvidia-cutlass wheel the cutlass repository rule reads: the checkout's
    `.venv`, else the one running the tests."""
    for venv in (REPO_ROOT / ".venv", Path(sys.prefix)):
        if (venv / "bin" / "python3").exists() and list(venv.glob("lib/python3*/site-packages/cutlass_library")):
            return venv
    return None


def find_nginx() -> Path | None:
    found = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin:/usr/local/sbin")
    return Path(found) if found else None


def find_bgd() -> Path | None:
    """BuildGrid's CLI: the checkout's `.venv-buildgrid` (tools/bootstrap.sh), the test venv, or PATH."""
    for candidate in (REPO_ROOT / ".venv-buildgrid" / "bin" / "bgd", Path(sys.executable).parent / "bgd"):
        if candidate.exists():
            return candidate
    found = shutil.which("bgd")
    return Path(found) if found else None


def client_path() -> str:
    """PATH for the Bazel client: the actions' PATH plus node's directory (bazelisk is a node script)."""
    parts = ACTION_PATH.split(":")
    node = shutil.which("node")
    if node and str(Path(node).parent) not in parts:
        parts.append(str(Path(node).parent))
    return ":".join(parts)


def base_env() -> dict[str, str]:
    """The client environment every Bazel command starts from."""
    env = {"PATH": client_path(), "HOME": str(Path.home()), "LANG": "C.UTF-8"}
    # CUDA_PATH/CUDA_HOME say where this machine's toolkit is; every other variable a
    # repository rule reads (CUBINSTORE_*) comes only from the test that sets it.
    for name in ("USER", "LOGNAME", "TMPDIR", "USE_BAZEL_VERSION", "CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(name):
            env[name] = os.environ[name]
    return env


# -- copies of the workspace ------------------------------------------------------------------------

def workspace_files(source: Path = REPO_ROOT) -> list[str]:
    """The checkout's files as git sees them: tracked plus untracked-but-not-ignored, so bazel-*
    symlinks, .venv and other ignored outputs never travel."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=source, capture_output=True, check=True, timeout=60,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise WorkspaceError(f"cannot list the files of {source} with git: {exc}") from exc
    names = sorted({n for n in out.decode().split("\0") if n})
    # Deleted-but-tracked files are listed too; only what is on disk is the working tree.
    return [n for n in names if (source / n).is_file() or (source / n).is_symlink()]


def _extract_revision(source: Path, revision: str, dest: Path) -> None:
    git = subprocess.Popen(["git", "archive", "--format=tar", revision], cwd=source,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tar = subprocess.run(["tar", "-x", "-C", str(dest)], stdin=git.stdout, capture_output=True, timeout=120)
    assert git.stdout is not None and git.stderr is not None
    git.stdout.close()
    git_err = git.stderr.read().decode(errors="replace")
    if git.wait(timeout=120) != 0 or tar.returncode != 0:
        raise WorkspaceError(f"cannot copy revision '{revision}' of {source} ({TREE_ENV}): "
                             f"{git_err}{tar.stderr.decode(errors='replace')}")


def copy_workspace(dest: Path, source: Path = REPO_ROOT, venv: Path | None = None) -> Path:
    """Copies the checkout to `dest`: its working tree (modes kept: tools are executable), or
    the committed revision named by $CUBINSTORE_BAZEL_TEST_REV; plus the git-ignored
    `.bazeliskrc`. `.venv` becomes a symlink to `venv` so the cutlass repository rule finds the
    pinned wheel the way it does in a developer's checkout."""
    if dest.exists():
        raise WorkspaceError(f"copy destination {dest} already exists")
    dest.mkdir(parents=True)
    revision = os.environ.get(TREE_ENV, "")
    if revision:
        _extract_revision(source, revision, dest)
    else:
        for name in workspace_files(source):
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, target, follow_symlinks=False)
    if (source / ".bazeliskrc").is_file():
        shutil.copy2(source / ".bazeliskrc", dest / ".bazeliskrc")
    if venv is not None:
        (dest / ".venv").symlink_to(venv, target_is_directory=True)
    return dest


def _link_or_copy(src: str, dst: str) -> None:
    # Hard links are safe: Bazel writes cache entries to a temp file and renames it.
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def seed_disk_cache(dest: Path, source: Path = DEVELOPER_DISK_CACHE) -> bool:
    """Makes `dest` a disk cache holding `source`'s entries (hard links where possible).
    Returns whether anything was seeded; `dest` exists either way."""
    if source.is_dir():
        shutil.copytree(source, dest, copy_function=_link_or_copy, symlinks=True)
        return True
    dest.mkdir(parents=True, exist_ok=True)
    return False


# -- execution logs -----------------------------------------------------------------------------------

def output_label(path: str) -> str:
    """`bazel-out/k8-fastbuild/bin/kernels/axpy/axpy_f32_vec4_sm_90a.cubin` ->
    `//kernels/axpy:axpy_f32_vec4_sm_90a` (cuda_cubin names its output `<name>.cubin`)."""
    parts = path.split("/")
    if len(parts) < 4 or parts[0] != "bazel-out" or parts[2] != "bin":
        raise ValueError(f"not a bazel-out/<config>/bin/ path: '{path}'")
    package, name = "/".join(parts[3:-1]), parts[-1]
    return f"//{package}:{name.rsplit('.', 1)[0]}"


@dataclass(frozen=True)
class Spawn:
    """One process Bazel ran or took from a cache, from `--execution_log_json_file`."""

    mnemonic: str
    outputs: tuple[str, ...]
    cache_hit: bool
    runner: str
    arguments: tuple[str, ...]
    environment: tuple[tuple[str, str], ...]
    inputs: tuple[str, ...]

    @property
    def label(self) -> str:
        """The target that declared the spawn's first output."""
        return output_label(self.outputs[0])

    @property
    def program(self) -> str:
        """The program the spawn runs, as an execution-root path: nvcc itself for a compile that
        runs inside its header closure (`in_tree.sh TREE ../../nvcc ...`)."""
        if self.arguments[0].endswith("/in_tree.sh"):
            return os.path.normpath(os.path.join(self.arguments[1], self.arguments[2]))
        return self.arguments[0]


def read_execution_log(path: Path) -> list[Spawn]:
    """Bazel 4.2 writes one JSON object per spawn, concatenated (not a JSON array)."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    spawns: list[Spawn] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text):
            return spawns
        obj, pos = decoder.raw_decode(text, pos)
        spawns.append(Spawn(
            mnemonic=obj.get("mnemonic", ""),
            outputs=tuple(obj.get("listedOutputs", ())),
            # Bazel 4.2: remoteCacheHit; Bazel 7: cacheHit (remote or disk cache).
            cache_hit=bool(obj.get("remoteCacheHit", obj.get("cacheHit", False))),
            runner=obj.get("runner", ""),
            arguments=tuple(obj.get("commandArgs", ())),
            environment=tuple((e["name"], e.get("value", "")) for e in obj.get("environmentVariables", ())),
            inputs=tuple(i["path"] for i in obj.get("inputs", ())),
        ))


@dataclass
class BuildResult:
    """What one `bazel build` did."""

    seconds: float
    spawns: list[Spawn]
    output: str
    manifest: bytes | None = None
    log: Path | None = None

    def by_label(self, mnemonic: str = COMPILE) -> dict[str, bool]:
        """Label -> cache hit, for the spawns of `mnemonic` (one spawn per target)."""
        result: dict[str, bool] = {}
        for spawn in self.spawns:
            if spawn.mnemonic != mnemonic:
                continue
            if spawn.label in result:
                raise AssertionError(f"two {mnemonic} spawns for {spawn.label} in {self.log}")
            result[spawn.label] = spawn.cache_hit
        return result

    def hits(self, mnemonic: str = COMPILE) -> set[str]:
        return {label for label, hit in self.by_label(mnemonic).items() if hit}

    def misses(self, mnemonic: str = COMPILE) -> set[str]:
        return {label for label, hit in self.by_label(mnemonic).items() if not hit}

    def manifest_json(self) -> dict:
        if self.manifest is None:
            raise AssertionError("this build wrote no manifest")
        return json.loads(self.manifest)


@dataclass
class Workspace:
    """One copy of the workspace with its own output base (one Bazel server)."""

    root: Path
    output_base: Path
    bazel: Path
    env_defaults: dict[str, str] = field(default_factory=base_env)
    bzlmod: bool = False  # Bazel 7 through MODULE.bazel: canonical repository names
    _builds: int = 0

    @classmethod
    def create(cls, root: Path, output_base: Path, bazel: Path, venv: Path | None,
               bzlmod: bool = False) -> Workspace:
        copy_workspace(root, venv=venv)
        return cls(root=root, output_base=output_base, bazel=bazel, bzlmod=bzlmod)

    def repo_dir(self, repo: str) -> str:
        """The directory name of external repository `repo` (`local_cuda`, `cutlass`) under
        `external/`, in the output base and on action command lines."""
        return BZLMOD_REPO_PREFIX + repo if self.bzlmod else repo

    def external(self, repo: str) -> Path:
        return self.output_base / "external" / self.repo_dir(repo)

    @property
    def log_dir(self) -> Path:
        path = self.output_base.parent / f"{self.output_base.name}-logs"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def env(self, overrides: Mapping[str, str | None] | None = None) -> dict[str, str]:
        """The client environment: defaults, then `overrides` (None removes a variable)."""
        env = dict(self.env_defaults)
        for name, value in (overrides or {}).items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        return env

    @property
    def server_tmp(self) -> Path:
        path = self.output_base.parent / f"{self.output_base.name}-tmp"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def startup_options(self) -> list[str]:
        # --nohome_rc: a developer's ~/.bazelrc must not change what the tests measure.
        # java.io.tmpdir: Bazel 4.2 leaves the raw execution log (exec*.log, megabytes per build)
        # in the server's temp directory; keep it out of /tmp.
        return [f"--output_base={self.output_base}", "--nohome_rc", f"--max_idle_secs={SERVER_IDLE_S}",
                f"--host_jvm_args=-Djava.io.tmpdir={self.server_tmp}"]

    def run(self, command: str, args: Sequence[str] = (), env: Mapping[str, str | None] | None = None,
            timeout: float = BAZEL_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """Runs one Bazel command; raises BazelError on a non-zero exit."""
        argv = [str(self.bazel), *self.startup_options(), command, *args]
        logger.info("bazel %s in %s: %s", command, self.root, " ".join(args))
        proc = subprocess.run(argv, cwd=self.root, env=self.env(env), capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise BazelError(argv, self.root, proc.returncode, proc.stdout + proc.stderr)
        return proc

    def build(self, targets: Sequence[str] = ALL_TARGETS, *, disk_cache: Path | None,
              flags: Sequence[str] = (), env: Mapping[str, str | None] | None = None,
              clean: bool = True) -> BuildResult:
        """Builds `targets`; `clean` first empties the output tree and the local action cache so
        every action is either taken from a cache or run, and shows up in the execution log.
        `disk_cache=None` turns the disk cache off (the .bazelrc default would be used otherwise)."""
        if clean:
            self.run("clean", env=env)
        self._builds += 1
        log = self.log_dir / f"build{self._builds:02d}.exec.json"
        args = [
            "--color=no", "--curses=no", "--noshow_progress",
            f"--disk_cache={disk_cache if disk_cache is not None else ''}",
            f"--execution_log_json_file={log}",
            *flags, "--", *targets,
        ]
        start = time.monotonic()
        proc = self.run("build", args, env=env)
        seconds = time.monotonic() - start
        for leftover in self.server_tmp.glob("exec*.log"):
            leftover.unlink()
        manifest_path = self.root / "bazel-bin" / "kernels" / "manifest.json"
        builds_manifest = any(t in ("//kernels:all", "//kernels:manifest", "//kernels/...") for t in targets)
        manifest = manifest_path.read_bytes() if builds_manifest and manifest_path.exists() else None
        return BuildResult(seconds=seconds, spawns=read_execution_log(log), output=proc.stderr,
                           manifest=manifest, log=log)

    def aquery(self, expression: str, flags: Sequence[str] = ()) -> dict:
        proc = self.run("aquery", ["--color=no", "--curses=no", "--output=jsonproto", *flags, expression])
        return json.loads(proc.stdout) if proc.stdout.strip() else {}

    def fetch_repository(self, repo: str, env: Mapping[str, str | None] | None = None) -> Path:
        """Makes Bazel (re)evaluate external repository `repo` with `env`; returns its directory."""
        self.run("query", ["--color=no", "--curses=no", f"@{repo}//:all"], env=env)
        return self.external(repo)

    def shutdown(self) -> None:
        """Stops this output base's server (never raises: used at teardown)."""
        if not (self.output_base / "server").exists():
            return
        try:
            self.run("shutdown", timeout=120)
        except (BazelError, OSError, subprocess.TimeoutExpired) as exc:
            logger.warning("bazel shutdown in %s failed: %s", self.root, exc)

    @contextlib.contextmanager
    def edit(self, relpath: str, change: Callable[[str], str]) -> Iterator[Path]:
        """Rewrites one file of the copy with `change(text)`, restoring its bytes afterwards."""
        path = self.root / relpath
        original = path.read_bytes() if path.exists() else None
        text = original.decode("utf-8") if original is not None else ""
        new = change(text)
        if new == text:
            raise WorkspaceError(f"editing {relpath} changed nothing")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(new, encoding="utf-8")
        try:
            yield path
        finally:
            if original is None:
                path.unlink()
            else:
                path.write_bytes(original)


def replace_once(old: str, new: str) -> Callable[[str], str]:
    """An `edit` change replacing exactly one occurrence of `old` (fails if not exactly one)."""
    def change(text: str) -> str:
        count = text.count(old)
        if count != 1:
            raise WorkspaceError(f"expected exactly one {old!r} to replace, found {count}")
        return text.replace(old, new)
    return change


def append(line: str) -> Callable[[str], str]:
    return lambda text: text + ("" if text.endswith("\n") or not text else "\n") + line + "\n"


def symlink_farm(source: Path, dest: Path) -> Path:
    """A tree of real directories whose files are absolute symlinks into `source`."""
    for dirpath, _dirnames, filenames in os.walk(source):
        rel = Path(dirpath).relative_to(source)
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for name in filenames:
            (dest / rel / name).symlink_to(Path(dirpath, name).resolve())
    return dest


def replace_with_copy(path: Path, change: Callable[[str], str]) -> None:
    """Replaces `path` (a file or a symlink to one) by a new regular file holding the changed
    text; never writes through a symlink or hard link into the original."""
    text = path.read_text(encoding="utf-8")
    path.unlink()
    path.write_text(change(text), encoding="utf-8")


def compiled_targets(manifest: dict, mnemonic: str = COMPILE) -> set[str]:
    """The targets of the manifest's kernels that ``mnemonic`` builds: CUBINs (``CubinCompile``), or
    PTX (``PtxCompile``: the kernels whose arch is ``compute_...``)."""
    ptx = mnemonic == PTX_COMPILE
    return {k["target"] for k in manifest["kernels"] if k["arch"].startswith("compute_") == ptx}


def output_path(root: Path, kernel: dict) -> Path:
    """Where the build put a manifest kernel's bytes below the workspace ``root``: its .cubin or .ptx."""
    package, name = kernel["target"][2:].split(":")
    return root / "bazel-bin" / package / (name + (".ptx" if kernel["arch"].startswith("compute_") else ".cubin"))
