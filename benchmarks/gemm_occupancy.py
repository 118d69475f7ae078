"""How many clusters of each gemm instantiation the GPU holds at once (prints a table; not a test).

`ops.gemm` launches a persistent grid of min(units, SMs / cluster, co-resident clusters)
clusters: clusters must fit inside one GPC, and a GPC with an odd number of free SMs strands
one, so the driver may hold fewer than SMs / cluster at once, and a grid of more would run its
last clusters as a second wave. This asks the driver (`Kernel.max_active_clusters`, or blocks
per SM x SMs for cluster 1) for every gemm instantiation of a manifest, beside the grid that
`ops.gemm` launches for a large problem (plan() capped at that count). On the H200 (2026-12-02)
all 66 clusters of 2 fit in one wave; of 4, 30 (not 33).

  PYTHONPATH=. python benchmarks/gemm_occupancy.py --manifest bazel-bin/kernels/manifest.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout without installing cubinstore

import cubinstore  # noqa: E402
from cubinstore.internals import cuda as _cuda, device as _device, gemm_launch as gemm  # noqa: E402
from cubinstore.manifest import Manifest  # noqa: E402
from cubinstore.store import DirectorySource, LocalLayer, Store  # noqa: E402

SHAPE = (8192, 8192, 8192)  # enough tiles that every instantiation fills the GPU


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args()

    manifest = Path(args.manifest)
    home = tempfile.mkdtemp(prefix="gemm-occupancy-")
    # The blobs come from the directory the manifest sits in (as after a local build).
    lib = cubinstore.open(Manifest.from_path(manifest), Store([LocalLayer(home), DirectorySource(manifest.parent)]))
    drv = _cuda.driver()
    sms = _device.sm_count(args.device)
    ids = sorted(spec.id for spec in lib.manifest.kernels if spec.id.startswith("gemm/"))
    print(f"device {args.device}: {sms} SMs; grid for {SHAPE[0]}x{SHAPE[1]}x{SHAPE[2]}, splits 1")
    print(f"{'instantiation':44} {'cluster':>7} {'smem KiB':>8} {'grid CTAs':>9} {'max clusters':>12} "
          f"{'co-resident CTAs':>16} {'waves':>5}")
    for kernel_id in ids:
        cfg = gemm.config_of(kernel_id)
        kernel = lib.kernel(kernel_id, device=args.device)
        if cfg.cluster > 1:
            # The cluster shape is compiled in (__cluster_dims__), so the query leaves it unset.
            clusters = kernel.max_active_clusters(gemm.ENTRY, grid=(cfg.cluster, 1, 1), block=(cfg.threads, 1, 1),
                                                  shared_mem=cfg.smem_bytes)
        else:  # not a cluster launch: the driver counts no clusters, so count blocks per SM
            # prepare raises the function's shared-memory limit, which the query needs.
            kernel.prepare(gemm.ENTRY, grid=(1, 1, 1), block=(cfg.threads, 1, 1), shared_mem=cfg.smem_bytes,
                           args=(None, None, None, None, 1, 1, 1, None, None, 1))
            with _cuda.on_device(args.device):  # the query needs a current context
                per_sm = _cuda.check(drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    drv.CUfunction(kernel._function(gemm.ENTRY).handle), cfg.threads, cfg.smem_bytes),
                    f"cuOccupancyMaxActiveBlocksPerMultiprocessor for {kernel_id}")
            clusters = per_sm * sms
        launch = gemm.plan(*SHAPE, sms, kernel_id, 1, max_clusters=clusters if cfg.cluster > 1 and clusters else None)
        resident = clusters * cfg.cluster
        waves = -(-launch.grid // resident) if resident else float("inf")
        print(f"{kernel_id:44} {cfg.cluster:>7} {cfg.smem_bytes / 1024:>8.1f} {launch.grid:>9} {clusters:>12} "
              f"{resident:>16} {waves:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
