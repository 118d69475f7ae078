"""GPU: kernels the library fixture compiled through cubinstore-nvcc launch through cubinstore and
compute what the library says they compute. ``tools/stage_device.sh`` builds them on the CPU host
(``tools/stage_nvcc.py``: every instantiation of ``helpers.kernel_library`` through
``cubinstore-nvcc``) into ``.device/nvcc``; on the GPU host: ``python3 -m pytest -m gpu tests/nvcc``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch", reason="the GPU tests use torch tensors")

from helpers.kernel_library import BY_NAME  # noqa: E402

import cubinstore  # noqa: E402
from cubinstore import Digest  # noqa: E402
from cubinstore.manifest import KernelSpec, Manifest  # noqa: E402
from cubinstore.store import LocalLayer, MemoryLayer, Store  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STAGED = Path(os.environ.get("CUBINSTORE_TEST_NVCC_DIR", REPO / ".device" / "nvcc"))
DTYPES = {"f32": torch.float32, "f64": torch.float64, "f16": torch.float16, "bf16": torch.bfloat16}


def _staged() -> dict[str, str]:
    listing = STAGED / "kernels.json"
    if not listing.is_file():
        return {}
    return json.loads(listing.read_text())


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory):
    staged = _staged()
    if not staged:
        pytest.skip(f"no kernels staged in {STAGED} (tools/stage_device.sh)")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU (sm_90a)")
    local = LocalLayer(tmp_path_factory.mktemp("nvccgpu") / "home")
    specs = []
    for name, file in sorted(staged.items()):
        data = (STAGED / file).read_bytes()
        digest = Digest.of(data)
        local.write(digest, data)
        inst = BY_NAME[name]
        specs.append(KernelSpec(id=f"mylib/{name}/sm_90a", family="mylib", params={"name": name}, arch="sm_90a",
                                digest=digest, size=len(data), entries=inst.entries, target=f"//mylib:{name}"))
    return cubinstore.open(Manifest.build(specs, source="cubinstore-nvcc fixture"), Store([MemoryLayer(1 << 26), local]))


@pytest.mark.parametrize("name", sorted(_staged()) or ["none-staged"])
def test_a_kernel_compiled_through_cubinstore_nvcc_is_correct(library, name: str) -> None:
    inst = BY_NAME[name]
    dtype = DTYPES[inst.dtype.storage]
    n = 3 * inst.block * inst.vec + 17  # a tail in the last block
    torch.manual_seed(0)
    x = torch.randn(n, device="cuda", dtype=torch.float32).to(dtype)
    y = torch.full((n,), float("nan"), device="cuda", dtype=dtype)
    alpha, beta = 1.5, -0.25
    kernel = library.kernel(f"mylib/{name}/sm_90a")
    kernel.launch(inst.symbol, grid=(inst.grid(n), 1, 1), block=(inst.block, 1, 1), args=[y, x, alpha, beta, n])
    torch.cuda.synchronize()
    want = torch.tensor(inst.reference(x.cpu().tolist(), alpha, beta), dtype=dtype)
    torch.testing.assert_close(y.cpu(), want, rtol=inst.rtol, atol=0.0)
