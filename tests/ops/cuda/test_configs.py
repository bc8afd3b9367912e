"""Tile rules and the node-walk heuristic (CPU: pure functions of the sizes)."""

from __future__ import annotations

import pytest

from knnconv.ops.cuda.configs import (
    MAX_NODES_PER_CTA,
    KernelConfig,
    default_config,
    default_grad_weight_config,
    default_nodes_per_cta,
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
