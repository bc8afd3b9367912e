"""Tile rules and the node-walk heuristic (CPU: pure functions of the sizes)."""

from __future__ import annotations

import pytest

from knnconv.ops.cuda.configs import (
    MAX_NODES_PER_CTA,
    KernelConfig,
    block_threads,
    channels_last_serves,
    channels_last_width_multiple,
    check_config,
    choose_config,
    default_config,
    default_grad_input_config,
    default_grad_weight_config,
    default_nodes_per_cta,
    shared_memory_bytes,
    tile_rules,
)


def test_batch_bounds_of_a_rule_select_the_192_slot_weight_tile_only_for_large_batches():
    assert default_grad_weight_config(2048, 64, 192).tile_m == 192
    assert default_grad_weight_config(512, 64, 192).tile_m != 192
    assert default_grad_weight_config(2048, 64, 256).tile_m != 192  # 192 must divide P64
    assert default_grad_weight_config(2048, 96, 192).tile_m != 192  # Cout over max_n


@pytest.mark.parametrize("k_tiles,expected", [(3, 8), (6, 8), (40, 1)])
def test_ctas_walk_nodes_until_they_have_enough_tiles(k_tiles, expected):
    cfg = default_config(2048, 64, 64 * k_tiles)
    assert default_nodes_per_cta(cfg, k_tiles, 16, 964, 132) == expected


def test_walks_keep_four_ctas_per_sm_and_skip_16_warp_tiles():
    cfg = default_config(2048, 64, 192)
    assert default_nodes_per_cta(cfg, 3, 1, 964, 132) == 1  # 964 CTAs: halving leaves < 528
    assert default_nodes_per_cta(cfg, 3, 4, 964, 132) == 4  # 8 would leave 484 CTAs
    sixteen_warps = KernelConfig(64, 256, 64, 2, 4, 4, 2, True, 8)
    assert default_nodes_per_cta(sixteen_warps, 1, 64, 10_000, 132) == 1
    assert default_nodes_per_cta(cfg, 1, 10_000, 10_000, 132) == MAX_NODES_PER_CTA


# resnet18 layer4.0.conv1's sizes (Nout 2, Nin 16, Cin 256, Cout 512, P64 2304): the large
# tiles would launch 4 forward CTAs at B = 128.
def test_few_node_layers_fall_through_to_tiles_that_launch_enough_ctas():
    assert default_config(128, 512, 2304) == default_config(128, 512, 2304, nout=964)
    assert default_config(128, 512, 2304, nout=2)[:7] == (32, 64, 32, 1, 2, 2, 3)
    assert default_config(512, 512, 2304, nout=2)[:7] == (64, 128, 64, 2, 2, 4, 3)
    assert default_config(2048, 512, 2304, nout=2) == default_config(2048, 512, 2304)
    assert default_grad_input_config(128, 512, nin=2)[:7] == (64, 64, 64, 1, 2, 2, 3)
    assert default_grad_input_config(2048, 256, nin=16) == default_grad_input_config(2048, 256)


@pytest.mark.parametrize("family,n,nodes", [("forward", 512, 2), ("forward", 256, 16),
                                            ("forward", 384, 60), ("grad_input", 512, 2),
                                            ("grad_input", 128, 60), ("grad_input", 384, 60)])
@pytest.mark.parametrize("batch", [65, 128, 512, 2048])
def test_a_rule_with_min_ctas_is_taken_only_when_its_grid_has_them(family, n, nodes, batch):
    rules = tile_rules()[family]
    chosen = choose_config(family, batch, n, 2304, nodes)
    [rule] = [r for r in rules if KernelConfig(*r["config"]) == chosen][:1]
    ctas = nodes * -(-n // chosen.bn) * -(-batch // chosen.tile_m)
    assert ctas >= rule.get("min_ctas", 0)
    # every earlier rule whose other conditions hold was skipped for too few CTAs
    for earlier in rules[:rules.index(rule)]:
        config = KernelConfig(*earlier["config"])
        if (batch <= earlier.get("max_batch", batch) and n <= earlier.get("max_n", n)
                and n % earlier.get("n_multiple_of", 1) == 0):
            assert nodes * -(-n // config.bn) * -(-batch // config.tile_m) < earlier["min_ctas"]


@pytest.mark.parametrize("bk,p64", [(128, 64), (48, 64), (128, 192)])
def test_a_forward_whose_slot_step_does_not_divide_p64_is_refused(bk, p64):
    # the kernel runs P64 / bk whole steps: 128 on 64 slots would compute nothing
    with pytest.raises(ValueError, match="must divide P64"):
        check_config("forward", KernelConfig(64, 64, bk, 1, 2, 2, 2, True, 8), p64=p64)


def test_a_grad_weight_tile_is_checked_with_the_b_stage_it_stages():
    # read in place, grad_y's B stage is bk rows of bn (+ pad), not bn rows of bk (+ pad):
    # for bk > bn the in-place variant needs more shared memory, and is held to that
    cfg = KernelConfig(64, 16, 64, 1, 4, 1, 4, True, 8)
    relaid = shared_memory_bytes("grad_weight", cfg)
    in_place = shared_memory_bytes("grad_weight", cfg, grad_in_place=True)
    assert in_place > relaid
    check_config("grad_weight", cfg, max_shared_bytes=relaid)
    with pytest.raises(ValueError, match="shared memory"):
        check_config("grad_weight", cfg, max_shared_bytes=relaid, grad_in_place=True)


WGMMA = "gather_cl_wgmma"


def test_a_warpgroup_mma_cta_counts_its_staging_warpgroup():
    cfg = KernelConfig(64, 128, 64, 2, 8, 1, 4, True, 8)
    assert block_threads(WGMMA, cfg) == 384 and block_threads("gather_cl", cfg) == 256
    # core-matrix tiles have no row padding; two 8-byte mbarriers a stage, the bias columns
    assert shared_memory_bytes(WGMMA, cfg) == 4 * ((128 * 64 + 64 * 128) * 2 + 16) + 128 * 4


@pytest.mark.parametrize("config, problem", [
    ((64, 96, 64, 2, 8, 1, 4, True, 8), "bn one of"),       # no m64n96 instantiation
    ((64, 128, 64, 2, 4, 2, 4, True, 8), "wm 4\\*rb, wn 1"),  # warps not in warpgroups
    ((32, 128, 64, 1, 2, 1, 4, True, 8), "bm 64"),
    ((64, 128, 64, 2, 8, 1, 2, True, 8), "ksteps >= 3"),    # staging runs a tile ahead
    ((64, 128, 64, 2, 8, 1, 4, False, 8), "async_copy"),
    ((64, 256, 64, 2, 8, 1, 6, True, 8), "shared memory"),
])
def test_warpgroup_mma_tiles_the_kernel_cannot_run_are_refused(config, problem):
    with pytest.raises(ValueError, match=problem):
        check_config(WGMMA, KernelConfig(*config))


def test_the_channels_last_kernels_serve_channel_counts_of_their_smallest_tile():
    assert channels_last_width_multiple() == 16
    assert channels_last_serves(64, 80) and channels_last_serves(16, 16)
    assert not channels_last_serves(3, 64) and not channels_last_serves(64, 70)
