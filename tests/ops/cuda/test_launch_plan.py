"""The launch planners (knnconv.ops.cuda.launch_plan): pure functions of sizes and device
limits, so every decision is checked here without a GPU."""

from __future__ import annotations

import pytest
import torch

from knnconv.ops.cuda.configs import (
    KernelConfig,
    check_config,
    shared_memory_bytes,
)
from knnconv.ops.cuda.launch_plan import (
    MAX_GRID_YZ,
    BackwardPath,
    DeviceLimits,
    ForwardPath,
    choose_gather_kernel,
    forward_batch_padding,
    kernel_name,
    plan_backward,
    plan_backward_path,
    plan_channels_last_backward,
    plan_channels_last_dw,
    plan_forward,
    plan_forward_path,
    plan_gather,
    reads_in_place,
)

H200 = DeviceLimits(multiprocessors=132, shared_memory_bytes=227 * 1024, capability=(9, 0))
A100 = DeviceLimits(multiprocessors=108, shared_memory_bytes=163 * 1024, capability=(8, 0))
FORWARD = dict(batch=512, cin=3, nin=4085, cout=64, nout=964, p64=192)


def test_a_forward_plan_is_whole_and_consistent():
    plan = plan_forward(**FORWARD, device=H200, slots=147)
    gemm, cfg = plan.gemm, plan.gemm.cfg
    assert plan.slots % cfg.bk == 0 and 147 <= plan.slots <= FORWARD["p64"]
    assert plan.bpad == forward_batch_padding(512, 3, 4085, 64, 964, 192, cfg)
    assert plan.cpad % cfg.bn == 0 and plan.cpad >= 64
    # batch tiles of a node group along x, Cout tiles along y
    walk = gemm.nodes_per_cta
    assert gemm.grid == (-(-964 // walk) * (plan.bpad // cfg.tile_m), plan.cpad // cfg.bn, 1)
    assert gemm.shared_bytes == shared_memory_bytes("forward", cfg,
                                                    staged_slots=walk * plan.slots)
    assert gemm.block == (cfg.threads, 1, 1)


def test_a_default_walk_is_shortened_to_fit_its_slot_tables_and_a_requested_one_refused():
    # two k-tiles a node: the default walk is long, and every node's tables are staged
    cfg = KernelConfig(32, 64, 32, 1, 2, 2, 3, True, 8)
    sizes = dict(FORWARD, p64=64)
    small = DeviceLimits(132, shared_memory_bytes("forward", cfg, staged_slots=2 * 64), (9, 0))
    roomy = plan_forward(**sizes, device=H200, config=cfg)
    tight = plan_forward(**sizes, device=small, config=cfg)
    assert roomy.gemm.nodes_per_cta > 2 and tight.gemm.nodes_per_cta == 2
    assert tight.gemm.shared_bytes == small.shared_memory_bytes
    with pytest.raises(ValueError, match="shared memory"):
        plan_forward(**sizes, device=small, config=cfg, nodes_per_cta=roomy.gemm.nodes_per_cta)


def test_a_backward_reuses_a_forward_padding_only_where_its_tiles_divide_it():
    sizes = dict(batch=17, cin=64, nin=230, cout=64, nout=230, q=576, p64=576, element_bytes=2,
                 device=H200)
    fresh = plan_backward(**sizes)
    kept = plan_backward(**sizes, batch_padding=fresh.bpad)
    assert kept.reuses_padding and kept.bpad == fresh.bpad
    odd = plan_backward(**sizes, batch_padding=fresh.bpad + 1)
    assert not odd.reuses_padding and odd.bpad == fresh.bpad
    assert fresh.algorithm == "gather" and fresh.input.grid[0] == 230  # one CTA row a node
    assert fresh.weight.grid[0] == 230 and fresh.per_split >= 1
    # x's re-layout is carved only where the forward's is not reused
    assert fresh.workspace.xt is not None and kept.workspace.xt is None
    assert fresh.workspace.size - kept.workspace.size >= (64 * 230 + 1) * fresh.bpad * 2
    image = plan_backward(**dict(sizes, cin=3, q=27, p64=64), need_input=False,
                          grad_y_in_place=True)
    assert image.input is None and image.weight.grad_in_place and image.workspace.gt is None
    assert image.weight.shared_bytes == shared_memory_bytes("grad_weight", image.weight.cfg,
                                                            grad_in_place=True)


@pytest.mark.parametrize("device, setting, family", [
    (H200, True, "gather_cl_wgmma"), (H200, False, "gather_cl"), (A100, True, "gather_cl")])
def test_the_gather_plan_takes_warpgroup_mma_on_hopper_when_asked(device, setting, family):
    plan = plan_gather(batch=512, n=128, width=128, nodes=60, entries=479, device=device,
                       warpgroup_mma=setting)
    gemm = plan.gemm
    assert gemm.family == family and plan.npad == 128
    assert gemm.grid == (-(-60 // gemm.nodes_per_cta), 128 // gemm.cfg.bn,
                         -(-512 // gemm.cfg.tile_m))
    staging = 128 if family == "gather_cl_wgmma" else 0  # the staging warpgroup
    assert gemm.block == (gemm.cfg.threads + staging, 1, 1)


def test_a_gather_batch_past_the_grid_limit_is_refused():
    with pytest.raises(ValueError, match="split the batch"):
        plan_gather(batch=64 * (MAX_GRID_YZ + 1), n=64, width=64, nodes=4, entries=36,
                    device=H200, warpgroup_mma=False,
                    config=KernelConfig(64, 64, 32, 1, 2, 2, 3, True, 8))


def test_the_channels_last_dw_plan_splits_the_batch_and_refuses_an_impossible_split():
    plan = plan_channels_last_dw(batch=2048, cin=256, cout=512, entries=13, device=H200)
    gemm = plan.gemm
    steps = -(-2048 // gemm.cfg.bk)
    assert gemm.grid == (13 * (256 // gemm.cfg.tile_m), plan.wpad // gemm.cfg.bn,
                         -(-steps // plan.per_split))
    with pytest.raises(ValueError, match="cannot be honoured"):
        plan_channels_last_dw(batch=32, cin=64, cout=64, entries=9, device=H200, ksplit=100)


@pytest.mark.parametrize("algorithm, in_compute_dtype, staged_bytes", [
    ("gather", True, 2), ("gather", False, 4), ("scatter", True, 4)])
def test_a_backward_workspace_zeroes_exactly_its_accumulators(algorithm, in_compute_dtype,
                                                              staged_bytes):
    cin = 40 if algorithm == "gather" else 3
    plan = plan_backward(batch=17, cin=cin, nin=70, cout=65, nout=31, q=cin * 9,
                         p64=-(-cin * 9 // 64) * 64, element_bytes=2, device=H200,
                         need_bias=True, algorithm=algorithm,
                         dx_in_compute_dtype=in_compute_dtype)
    at = plan.workspace
    written = [at.gt, at.xt, at.weight] + ([at.dx] if algorithm == "gather" else [])
    summed = [at.dw, at.db] + ([at.dx] if algorithm == "scatter" else [])
    assert max(written) < at.zero_from <= min(summed) and at.zero_bytes > 0
    assert all(offset % 256 == 0 for offset in written + summed)
    assert plan.dx_staged_in_compute_dtype == (staged_bytes == 2)
    dx_bytes = 17 * 70 * cin * staged_bytes if algorithm == "gather" else (
        cin * 70 * plan.bpad * staged_bytes)
    following = sorted(o for o in written + summed + [at.size] if o > at.dx)[0]
    assert following - at.dx >= dx_bytes


def test_a_channels_last_backward_workspace_holds_the_weight_by_cell_and_the_accumulator():
    plan = plan_channels_last_backward(batch=129, cin=64, nin=230, cout=128, v=9,
                                       entries=1992, element_bytes=2, device=H200,
                                       warpgroup_mma=False)
    at = plan.workspace
    assert at.weight == 0 and at.zero_from <= at.dw
    assert at.zero_bytes >= 9 * 64 * plan.weight.wpad * 4
    alone = plan_channels_last_backward(batch=129, cin=64, nin=230, cout=128, v=9,
                                        entries=1992, element_bytes=2, device=H200,
                                        warpgroup_mma=False, need_input=False)
    assert alone.input is None and alone.workspace.weight is None
    assert alone.workspace.zero_from == 0


@pytest.mark.parametrize("cin, x_channels_last, x_readable, expected", [
    (64, True, True, ForwardPath(channels_last=True, keeps_x=True)),
    # unaligned: re-laid out this once, but the backward gets x, as saved_layout promised
    (64, True, False, ForwardPath(channels_last=False, keeps_x=True)),
    (64, False, False, ForwardPath(channels_last=False, keeps_x=False)),
    # channel counts the channels-last kernels do not serve: re-laid out, the re-layout kept
    (24, True, True, ForwardPath(channels_last=False, keeps_x=False)),
])
def test_the_forward_reads_x_in_place_only_where_the_kernels_can(cin, x_channels_last,
                                                                  x_readable, expected):
    path = plan_forward_path(cin=cin, cout=32, x_channels_last=x_channels_last,
                             x_readable=x_readable)
    assert path == expected
    # what the forward keeps is decided by the storage alone (saved_layout has no address)
    assert path.keeps_x == reads_in_place(cin, 32, x_channels_last)


BACKWARD = dict(cin=64, cout=32, need_input=True, need_weight=True, dx_channels_last=True,
                x_readable=True, grad_y_readable=True)


@pytest.mark.parametrize("changed, expected", [
    ({}, BackwardPath(channels_last=True, grad_y_in_place=False)),
    # dx wanted contiguous: the channels-last kernels write no other storage
    ({"dx_channels_last": False}, BackwardPath(channels_last=False, grad_y_in_place=False)),
    ({"dx_channels_last": False, "need_input": False},
     BackwardPath(channels_last=True, grad_y_in_place=False)),
    # x is the forward's re-layout (or unaligned): dW cannot read it in place
    ({"x_readable": False}, BackwardPath(channels_last=False, grad_y_in_place=False)),
    ({"x_readable": False, "need_weight": False},
     BackwardPath(channels_last=True, grad_y_in_place=False)),
    # an image layer (Cin 3): dW alone reads channels-last grad_y where it lies
    ({"cin": 3, "need_input": False},
     BackwardPath(channels_last=False, grad_y_in_place=True)),
    ({"cin": 3, "need_input": False, "grad_y_readable": False},
     BackwardPath(channels_last=False, grad_y_in_place=False)),
    ({"cin": 3}, BackwardPath(channels_last=False, grad_y_in_place=False)),
])
def test_the_backward_takes_the_channels_last_kernels_only_where_they_serve_it(changed,
                                                                               expected):
    assert plan_backward_path(**{**BACKWARD, **changed}) == expected


@pytest.mark.parametrize("capability, setting, width, expected", [
    ((9, 0), True, 128, "gather_cl_wgmma"),
    ((9, 0), False, 128, "gather_cl"),   # the setting is off by default
    ((8, 0), True, 128, "gather_cl"),    # warpgroup MMA is Hopper's alone
    ((12, 0), True, 128, "gather_cl"),
    ((9, 0), True, 48, "gather_cl"),     # no warpgroup-MMA channel tile divides 48
])
def test_the_warpgroup_mma_gather_is_chosen_on_hopper_when_asked_for(capability, setting,
                                                                     width, expected):
    family, cfg = choose_gather_kernel(512, 128, width, 1000, capability,
                                       warpgroup_mma=setting)
    assert family == expected
    check_config(family, cfg, width=width)


def test_a_kernel_name_says_what_the_kernel_stores_and_reads():
    cfg = KernelConfig(64, 64, 32, 1, 2, 2, 3, True, 8)
    tiles = cfg.template_args()
    # by default the forward stores the compute dtype, grad_input stages dx in fp32
    assert kernel_name("forward", torch.float16, cfg) == (
        f"knnconv::knn_forward<__half, __half, {tiles}>")
    assert kernel_name("grad_input", torch.bfloat16, cfg) == (
        f"knnconv::knn_grad_input<__nv_bfloat16, float, {tiles}>")
    assert kernel_name("grad_input", torch.float16, cfg, torch.float16) == (
        f"knnconv::knn_grad_input<__half, __half, {tiles}>")
    assert kernel_name("grad_weight", torch.float16, cfg, grad_in_place=True) == (
        f"knnconv::knn_grad_weight<__half, {tiles}, true>")
    assert kernel_name("grad_weight_cl", torch.float16, cfg) == (
        f"knnconv::knn_grad_weight_cl<__half, {tiles}>")
    wgmma = KernelConfig(64, 128, 64, 2, 8, 1, 4, True, 8)
    assert kernel_name("gather_cl_wgmma", torch.float16, wgmma, torch.float32) == (
        "knnconv::knn_gather_cl_wgmma<__half, float, 128, 64, 2, 4>")
