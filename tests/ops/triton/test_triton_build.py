"""Compile every tile of the triton backend's rules for Hopper and Blackwell on the CPU
(knnconv.tools.triton_build, no GPU needed) and hold what they compile to: no spills on
Hopper, shared memory within a block's, and pipelines that overlap the gather-GEMMs' box
loads with their MMAs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache

import pytest

from knnconv.ops.triton.configs import FAMILIES, rules
from knnconv.tools.triton_build import ARCHITECTURES, programs_per_sm

# the kernel each family's launch runs first, which every rule tile must compile
FIRST_KERNEL = {
    "forward": "knn_conv_forward_kernel", "grad_input": "knn_conv_grad_input_kernel",
    "grad_weight": "knn_conv_grad_weight_kernel", "stem_forward": "knn_stem_forward_kernel",
    "stem_grad_weight": "knn_stem_grad_weight_kernel",
    "stem_grad_input": "knn_stem_slot_grad_kernel",
    "depthwise_forward": "knn_depthwise_forward_kernel",
    "depthwise_grad_input": "knn_depthwise_grad_input_kernel",
    "depthwise_grad_weight": "knn_depthwise_grad_weight_kernel",
    "grad_bias": "grad_bias_partials_kernel"}
GATHER_GEMMS = ("forward", "grad_input", "grad_weight")


@cache
def compiled(arch: str, tmp_dir: str) -> list[dict]:
    """The tool's reports for ``arch``, from a process of its own (a compile-only driver, no
    interpreter)."""
    out = os.path.join(tmp_dir, f"{arch}.json")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    subprocess.run([sys.executable, "-m", "knnconv.tools.triton_build", "--arch", arch,
                    "--json", out], check=True, env=env, capture_output=True, timeout=600)
    with open(out) as file:
        return json.load(file)["reports"]


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("triton_build"))


def _tile(config) -> list[int]:
    return [config.block_m, config.block_n, config.block_k, config.warps, config.stages]


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_every_rule_tile_compiles_within_a_blocks_shared_memory(arch, build_dir):
    reports = compiled(arch, build_dir)
    for family in FAMILIES:
        for _, config in rules()[family]:
            found = [r for r in reports if r["family"] == family
                     and r["kernel"] == FIRST_KERNEL[family] and r["tile"] == _tile(config)]
            assert found, f"{arch}: {family} {config} did not compile"
    for report in reports:
        assert report["shared_bytes"] <= ARCHITECTURES[arch]["block_shared"], report
        assert report["programs_per_sm"] >= 1, report


def test_no_rule_tile_spills_on_hopper(build_dir):
    spilled = [r for r in compiled("sm_90", build_dir) if r["spilled_bytes"]]
    assert not spilled, spilled


def test_the_gather_gemms_overlap_box_loads_with_mma_on_hopper(build_dir):
    """At least two buffers in each gather-GEMM's ring: the next step's boxes load while this
    step's MMA runs (Triton gives a loop whose box coordinates are table loads about half its
    stages as buffers, tiles.json's "about" says)."""
    for report in compiled("sm_90", build_dir):
        if report["family"] in GATHER_GEMMS:
            assert report["buffers"] >= 2, report


def test_programs_per_sm_takes_the_tightest_limit():
    # 116 registers (rounded to 120) x 256 threads: 2 programs of 65,536 registers
    assert programs_per_sm("sm_90", registers=116, shared_bytes=65572, warps=8) == (
        2, "registers")
    # 98,360 bytes + 1 KiB reserved: 2 of 233,472
    assert programs_per_sm("sm_90", registers=32, shared_bytes=98360, warps=4) == (
        2, "shared memory")
    assert programs_per_sm("sm_90", registers=16, shared_bytes=0, warps=8) == (8, "warps")
    assert programs_per_sm("sm_90", registers=16, shared_bytes=0, warps=1) == (32, "blocks")
