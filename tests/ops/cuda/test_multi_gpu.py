"""Two GPUs (marker: gpu; skipped with fewer): layers used on both devices from one process,
models moved between devices, and a two-process NCCL DDP run following one process."""

from __future__ import annotations

import copy
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import knnconv
from conftest import random_geometry, rel_err

pytestmark = pytest.mark.gpu

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)
pytest.importorskip("cupy")

FIRST, SECOND = torch.device("cuda", 0), torch.device("cuda", 1)
EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "ddp_train.py"


def make_layer(seed: int) -> knnconv.KNNConv:
    geometry = random_geometry(torch.Generator().manual_seed(seed), nin=90, nout=35, k=9,
                               padding=0.05)
    return knnconv.KNNConv(12, 40, geometry.knn_indices, geometry.rf_index, nin=90, v=9)


def reference_step(layer, x):
    """y, dx, dW, db of one step in float64 through the reference backend, on the CPU."""
    leaves = [t.detach().cpu().double().requires_grad_() for t in
              (x, layer.weight, layer.bias)]
    y = knnconv.knn_conv(*leaves, layer.plan, backend="reference")
    y.square().sum().backward()
    return (y, *(leaf.grad for leaf in leaves))


def cuda_step(layer, x):
    x = x.detach().clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    y.float().square().sum().backward()
    assert layer.last_backend == "cuda"
    return y, x.grad, layer.weight.grad, layer.bias.grad


def assert_step_matches_reference(layer, x):
    for got, expected in zip(cuda_step(layer, x), reference_step(layer, x), strict=True):
        assert got.device == x.device
        assert rel_err(got.cpu(), expected) < 5e-3


def test_one_layer_on_two_devices_from_one_process_interleaved():
    layer = make_layer(1).to(FIRST, torch.float16)
    twin = copy.deepcopy(layer).to(SECOND)
    generator = torch.Generator().manual_seed(2)
    torch.cuda.set_device(FIRST)  # the second device's calls run while cuda:0 is current
    # B = 129 takes tiles of more than 48 KiB of shared memory, an attribute set per device
    for batch in (17, 64, 129, 17):
        x = torch.randn(batch, 12, 90, generator=generator).half()
        for module, device in ((layer, FIRST), (twin, SECOND)):
            assert_step_matches_reference(module, x.to(device))


def test_a_trained_model_moves_between_gpus_and_to_the_cpu():
    layer = make_layer(3).to(FIRST, torch.float16)
    x = torch.randn(33, 12, 90, generator=torch.Generator().manual_seed(4)).half()
    assert_step_matches_reference(layer, x.to(FIRST))
    layer.to(SECOND)
    assert_step_matches_reference(layer, x.to(SECOND))
    on_second = layer(x.to(SECOND))
    layer.to("cpu", torch.float32)
    with torch.no_grad():
        on_cpu = layer(x.float())
    assert layer.last_backend == "torch_binned"  # auto on the CPU with V <= K
    assert rel_err(on_cpu, on_second.float().cpu()) < 2e-3


def test_saved_on_one_gpu_loads_on_the_other():
    layer = make_layer(5).to(SECOND, torch.float16)
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    restored = make_layer(5).to(FIRST, torch.float16)
    with torch.no_grad():
        restored.weight.zero_()
    restored.load_state_dict(torch.load(buffer, map_location=FIRST))
    x = torch.randn(9, 12, 90, generator=torch.Generator().manual_seed(7)).half()
    with torch.no_grad():
        assert torch.equal(restored(x.to(FIRST)).cpu(), layer(x.to(SECOND)).cpu())


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on the PATH")
def test_two_gpu_ddp_follows_the_one_gpu_trajectory(tmp_path):
    def losses(command, name):
        out = tmp_path / f"{name}.json"
        subprocess.run([*command, str(EXAMPLE), "--device", "cuda", "--steps", "20",
                        "--out", str(out)], check=True, timeout=300)
        return json.loads(out.read_text())

    single = losses([sys.executable], "single")
    ddp = losses(["torchrun", "--standalone", "--nproc_per_node=2"], "ddp")
    assert ddp["world_size"] == 2 and single["world_size"] == 1
    assert ddp["backend_ran"] == single["backend_ran"] == "cuda"
    assert single["losses"][-1] < single["losses"][0]
    # fp16 autocast and fp32 atomics: the two runs sum the same terms in different orders.
    for a, b in zip(single["losses"], ddp["losses"], strict=True):
        assert abs(a - b) <= 1e-2 * abs(a) + 1e-3
