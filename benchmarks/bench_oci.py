"""A release through an OCI registry against the same release through the HTTP CAS, and skopeo's copy.

    python benchmarks/bench_oci.py [--manifest bazel-bin/kernels/manifest.json] [--sizes 250,500,1000,2000]

Starts on loopback (tools/local_services.py, the servers the tests use) one docker-registry and
one nginx WebDAV CAS, then prints, side by side in one run:
  1. the whole release (--manifest, its blobs found in its build tree): `cubinstore publish` to
     the registry (cold, then again with every blob present: HEADs only) and to the HTTP CAS;
     `cubinstore prefetch` of it into an empty store from each; `skopeo copy` of the artifact to a
     second repository and to an `oci:` layout directory (the peer floor: a Go client moving
     the same blobs, verifying digests too);
  2. synthetic releases of --sizes small blobs (4 KiB each): publish and prefetch through the
     registry, with the time per blob, so linear growth shows as a flat per-blob column.
Each command is a fresh `python -m cubinstore` process, as a person or CI runs it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

import local_services  # noqa: E402


def run(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return elapsed, proc.stdout


def cli(args: list[str], env: dict[str, str]) -> tuple[float, str]:
    return run([sys.executable, "-m", "cubinstore", *args], env)


def synthetic(directory: Path, n: int, size: int = 4096) -> Path:
    """A manifest of ``n`` kernels of ``size`` random bytes each, blobs in a build tree beside it."""
    from cubinstore.manifest import kernel_id

    rng = random.Random(n)
    tree = directory / "bazel-bin" / "kernels"
    tree.mkdir(parents=True)
    kernels = []
    for i in range(n):
        data = b"\x7fELF\x02\x01\x01" + rng.randbytes(size - 7)
        (tree / f"k{i}.cubin").write_bytes(data)
        params = {"dtype": "f32", "vec": i + 1}
        kernels.append({"id": kernel_id("axpy", params, "sm_90a"), "family": "axpy", "params": params, "arch": "sm_90a",
                        "digest": "sha256:" + hashlib.sha256(data).hexdigest(), "size": size,
                        "entries": {"axpy_f32": ["i32", "f32", "ptr", "ptr"]}, "target": f"//kernels/axpy:k{i}"})
    doc = {"schema": "cubinstore/manifest/v1", "kernels": sorted(kernels, key=lambda k: k["id"])}
    path = tree / "manifest.json"
    path.write_bytes(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode() + b"\n")
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifest", default="bazel-bin/kernels/manifest.json")
    parser.add_argument("--sizes", default="250,500,1000,2000")
    args = parser.parse_args()
    registry_bin, nginx_bin, skopeo = (local_services.find_registry(), local_services.find_nginx(),
                                       local_services.find_skopeo())
    if registry_bin is None or nginx_bin is None or skopeo is None:
        raise SystemExit("needs docker-registry, nginx and skopeo (tools/bootstrap.sh installs them)")
    work = Path(tempfile.mkdtemp(prefix="bench-oci-"))
    registry = local_services.Registry(work / "registry", registry_bin)
    nginx = local_services.NginxCache(work / "nginx", nginx_bin)
    registry.start()
    nginx.start()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("CUBINSTORE_")}
    base_env["PYTHONPATH"] = str(ROOT)
    try:
        manifest = Path(args.manifest)
        ci = dict(base_env, CUBINSTORE_HOME=str(work / "ci-home"))
        if manifest.is_file():
            probe = subprocess.run([sys.executable, "-m", "cubinstore", "publish", str(manifest), "--to",
                                    f"oci://{registry.host}/bench/probe"], env=ci, capture_output=True, text=True,
                                   timeout=1800, cwd=ROOT)
            if probe.returncode != 0:
                print(f"# {manifest}: not every blob is in its build tree ({probe.stderr.strip().splitlines()[-1]}); "
                      "using a synthetic release of 200 blobs of 32 KiB instead")
                manifest = synthetic(work / "release", 200, 32 * 1024)
                shutil.rmtree(work / "ci-home", ignore_errors=True)
        if manifest.is_file():
            from cubinstore.manifest import Manifest

            m = Manifest.from_path(manifest)
            total = sum(size for _, size in m.blobs)
            print(f"# 1. the whole release: {manifest} ({len(m.blobs)} blobs, {total / 1e6:.1f} MB)")
            repo = f"oci://{registry.host}/bench/release"
            rows = []
            t, out = cli(["publish", str(manifest), "--to", f"{repo}:v1"], ci)
            pinned = out.strip().splitlines()[-1]
            rows.append(("publish -> registry (cold)", t))
            t, _ = cli(["publish", str(manifest), "--to", f"{repo}:v1"], ci)
            rows.append(("publish -> registry (every blob there)", t))
            t, _ = cli(["publish", str(manifest), "--to", f"{nginx.url}/bench"], ci)
            rows.append(("publish -> HTTP CAS (nginx)", t))
            t, _ = cli(["prefetch", pinned], dict(base_env, CUBINSTORE_HOME=str(work / "p-oci")))
            rows.append(("prefetch <- registry, empty store", t))
            t, _ = cli(["prefetch", str(m.digest), "--remote", f"{nginx.url}/bench"],
                       dict(base_env, CUBINSTORE_HOME=str(work / "p-http")))
            rows.append(("prefetch <- HTTP CAS, empty store", t))
            docker = "docker://" + pinned.split("://", 1)[1]
            t, _ = run([str(skopeo), "--insecure-policy", "copy", "--src-tls-verify=false", "--dest-tls-verify=false",
                        docker, f"docker://{registry.host}/bench/copy:v1"], base_env)
            rows.append(("skopeo copy registry -> registry (peer floor)", t))
            t, _ = run([str(skopeo), "--insecure-policy", "copy", "--src-tls-verify=false", docker,
                        f"oci:{work / 'layout'}:v1"], base_env)
            rows.append(("skopeo copy registry -> oci: layout (peer floor)", t))
            width = max(len(r[0]) for r in rows)
            for label, seconds in rows:
                print(f"  {label:<{width}}  {seconds:7.2f} s")
        else:
            print(f"# 1. skipped: no {manifest} (build //kernels:all first)")

        print("# 2. synthetic releases of 4 KiB blobs through the registry (fresh process each)")
        print(f"  {'blobs':>6}  {'publish s':>9}  {'ms/blob':>7}  {'prefetch s':>10}  {'ms/blob':>7}")
        for n in (int(x) for x in args.sizes.split(",")):
            path = synthetic(work / f"syn{n}", n)
            env = dict(base_env, CUBINSTORE_HOME=str(work / f"syn{n}-ci"))
            t_pub, out = cli(["publish", str(path), "--to", f"oci://{registry.host}/bench/syn{n}"], env)
            pinned = out.strip().splitlines()[-1]
            t_pre, _ = cli(["prefetch", pinned], dict(base_env, CUBINSTORE_HOME=str(work / f"syn{n}-p")))
            print(f"  {n:>6}  {t_pub:>9.2f}  {1000 * t_pub / n:>7.2f}  {t_pre:>10.2f}  {1000 * t_pre / n:>7.2f}")
    finally:
        registry.stop()
        nginx.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
