"""Tile geometry: KernelConfig, its validation, and the default choices (loaded from tiles.json).

One KernelConfig describes a CTA of every kernel family as an (M, N, K) tile:

=============  ===================  ===================  ==========================
family         M = bm * rb          N = bn               K step = bk
=============  ===================  ===================  ==========================
forward        batch rows           output channels      slots p
grad_input     batch rows           input channels       (output node, cell) x Cout
grad_input_    batch rows           slots p              output channels
scatter
grad_weight    slots p              output channels      batch rows
=============  ===================  ===================  ==========================

The channels-last families read x and grad_y where the layers keep them ([B, N, C], channels
contiguous), with no re-layout; their K steps are channels of one neighbour (``bk`` must
divide the contracted width):

=============  ===================  ===================  ==========================
gather_cl      batch rows           produced channels    channels of one entry:
               (forward: Cout; dx: Cin)                  Cin (forward), Cout (dx)
grad_weight_   input channels of    output channels      batch rows
cl             one entry (divides Cin)
=============  ===================  ===================  ==========================

On Hopper (compute capability 9.0) gather_cl has a warpgroup-MMA variant, gather_cl_wgmma
(kernels/knn_gemm_channels_last_sm90.cu, built for sm_90a), warp-specialised: ``rb``
consumer warpgroups of four warps each own ``bm`` = 64 batch rows (so ``wm`` = 4 * rb,
``wn`` = 1) and one more
warpgroup stages the tiles (:func:`block_threads` counts it); ``bn`` is 64, 128 or 256 (one
wgmma's N), and ``ksteps`` >= 3 stages, staged ksteps - 2 tiles ahead. tiles.json's
``gather_cl_wgmma`` rules are tried first there when knnconv.context's ``warpgroup_mma`` is
on (off by default); a layer no rule fits takes gather_cl (the choice:
launch_plan.choose_gather_kernel).

grad_input runs a gather over the reversed graph (each input node gathers the
output nodes that read it), so every dx element is written once, without atomics; layers
with few input channels use grad_input_scatter instead (slot gradients scattered with fp32
atomics), since the gather's N = Cin tile would be mostly padding there.

``rb`` batch sub-tiles of ``bm`` rows share one staged weight tile (the CTA's M extent is
bm*rb); ``wm`` x ``wn`` warps split the tile, each warp owning (M/wm) x (N/wn) in 16x16
fragments; ``ksteps`` is the number of shared-memory pipeline stages; ``async_copy`` stages
with cp.async; ``vec`` is the staging chunk in elements (8: one 16-byte chunk of fp16/bf16).
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path
from typing import NamedTuple

from ...plan import SLOT_ALIGN

FAMILIES = ("forward", "grad_input", "grad_input_scatter", "grad_weight")
CHANNELS_LAST_FAMILIES = ("gather_cl", "grad_weight_cl")
# variants for one architecture: family -> the compute capability it runs on
ARCHITECTURE_FAMILIES = {"gather_cl_wgmma": (9, 0)}
WGMMA_TILE_N = (64, 128, 256)  # the wgmma shapes knn_gemm_channels_last_sm90.cu instantiates
# warp-specialised families: a warpgroup beyond the tile's wm x wn warps stages the operands
STAGING_WARPGROUP_FAMILIES = ("gather_cl_wgmma",)
ELEMENT_BYTES = 2
CHUNK_ELEMENTS = 8
SHARED_PAD = 8  # must match kPad in kernels/knn_common.cuh
TABLE_BYTES = 4  # an int32 slot-table entry


class KernelConfig(NamedTuple):
    bm: int
    bn: int
    bk: int
    rb: int
    wm: int
    wn: int
    ksteps: int
    async_copy: bool
    vec: int

    @property
    def tile_m(self) -> int:
        return self.bm * self.rb

    @property
    def threads(self) -> int:
        return self.wm * self.wn * 32

    def template_args(self) -> str:
        """The template arguments after the scalar type, as the kernels declare them."""
        return (f"{self.tile_m}, {self.bn}, {self.bk}, {self.wm}, {self.wn}, {self.ksteps}, "
                f"{'true' if self.async_copy else 'false'}")


def shared_memory_bytes(family: str, cfg: KernelConfig, *, grad_in_place: bool = False,
                        staged_slots: int = 0) -> int:
    """Dynamic shared memory of one CTA: the staged A and B tiles times stages, and behind
    them the scratch of the wmma kernels or the fp32 bias columns of those storing from
    registers (forward, gather_cl), the forward's after its ``staged_slots`` slot-table
    entries; grad_weight also stages its slot tile's tables.
    ``grad_in_place``: grad_weight's B tile staged from channels-last grad_y (batch rows of
    Cout) rather than its re-layout (Cout rows of batch)."""
    m, n, k = cfg.tile_m, cfg.bn, cfg.bk
    a_rows, a_width, b_rows, b_width = {
        "grad_weight": (m, k, k, n) if grad_in_place else (m, k, n, k),
        "grad_input_scatter": (k, m, n, k), "gather_cl": (m, k, k, n)}.get(family, (k, m, k, n))
    staged = cfg.ksteps * (a_rows * (a_width + SHARED_PAD) + b_rows * (b_width + SHARED_PAD))
    # the kernels storing from registers (forward, gather_cl) need no scratch
    if family == "forward":
        return staged * ELEMENT_BYTES + staged_slots * 2 * TABLE_BYTES + n * 4
    if family == "gather_cl":
        return staged * ELEMENT_BYTES + n * 4
    if family == "gather_cl_wgmma":  # core-matrix tiles (no row padding), two mbarriers a stage
        return cfg.ksteps * ((m * k + k * n) * ELEMENT_BYTES + 2 * 8) + n * 4
    tables = m * 2 * TABLE_BYTES if family == "grad_weight" else 0
    return staged * ELEMENT_BYTES + cfg.wm * cfg.wn * 16 * 16 * 4 + tables


def block_threads(family: str, cfg: KernelConfig) -> int:
    """Threads of one CTA: the warps that multiply, and the staging warpgroup of the
    warp-specialised kernels."""
    return cfg.threads + (128 if family in STAGING_WARPGROUP_FAMILIES else 0)


def _channel_tile(family: str, cfg: KernelConfig) -> int | None:
    """The channels of one entry a channels-last family's tile takes (None for the others)."""
    return {"gather_cl": cfg.bk, "gather_cl_wgmma": cfg.bk,
            "grad_weight_cl": cfg.tile_m}.get(family)


def check_config(family: str, cfg: KernelConfig, *, p64: int | None = None,
                 width: int | None = None, max_shared_bytes: int = 227 * 1024,
                 grad_in_place: bool = False) -> KernelConfig:
    """Raise ValueError unless ``cfg`` is a geometry the ``family`` kernel can run (on P64
    slots, when ``p64`` is given; for a channels-last family, on ``width`` channels per
    entry: the contracted width of gather_cl, Cin for grad_weight_cl; ``grad_in_place``: see
    :func:`shared_memory_bytes`)."""
    known = FAMILIES + CHANNELS_LAST_FAMILIES + tuple(ARCHITECTURE_FAMILIES)
    if family not in known:
        raise ValueError(f"unknown kernel family {family!r}; expected one of {known}")
    cfg = KernelConfig(*cfg)
    problems = []
    if cfg.vec != CHUNK_ELEMENTS:
        problems.append(f"vec must be {CHUNK_ELEMENTS} (16-byte chunks of a 2-byte type)")
    if cfg.bk % 16 or cfg.bk < 16:
        problems.append("bk must be a positive multiple of 16")
    if min(cfg.bm, cfg.rb, cfg.wm, cfg.wn, cfg.bn) < 1:
        problems.append("bm, bn, rb, wm, wn must be >= 1")
    elif cfg.tile_m % (16 * cfg.wm) or cfg.bn % (16 * cfg.wn):
        problems.append("bm*rb must be a multiple of 16*wm and bn a multiple of 16*wn")
    if cfg.ksteps < 2:
        problems.append("ksteps (pipeline stages) must be >= 2")
    if block_threads(family, cfg) > 1024:
        problems.append("a CTA's threads (wm*wn*32, and a staging warpgroup) must not exceed "
                        "1024")
    if family == "gather_cl_wgmma" and (cfg.bm != 64 or cfg.wm != 4 * cfg.rb or cfg.wn != 1
                                        or cfg.bn not in WGMMA_TILE_N or cfg.ksteps < 3
                                        or not cfg.async_copy):
        problems.append(f"a warpgroup-MMA tile has bm 64, wm 4*rb, wn 1, bn one of "
                        f"{WGMMA_TILE_N}, ksteps >= 3 and async_copy")
    # the forward steps through a node's slots bk at a time (a partial step would be dropped)
    slot_tile = {"forward": cfg.bk, "grad_weight": cfg.tile_m,
                 "grad_input_scatter": cfg.bn}.get(family)
    if slot_tile is not None and p64 is not None and p64 % slot_tile:
        problems.append(f"the slot tile ({slot_tile}) must divide P64 ({p64})")
    # a channels-last tile takes channels of one entry: it must divide the entry's channels
    channel_tile = _channel_tile(family, cfg)
    if channel_tile is not None and width is not None and width % channel_tile:
        problems.append(f"the channel tile ({channel_tile}) must divide the {width} channels "
                        "of an entry")
    shared = 0 if problems else shared_memory_bytes(family, cfg, grad_in_place=grad_in_place)
    if shared > max_shared_bytes:
        problems.append(f"needs {shared} B of shared memory, over the device's "
                        f"{max_shared_bytes} B")
    if problems:
        raise ValueError(f"invalid {family} KernelConfig {tuple(cfg)}: " + "; ".join(problems))
    return cfg


@cache
def tile_rules() -> dict:
    """tiles.json: each family's rules (the first that fits is chosen) and scatter_below_cin."""
    return json.loads((Path(__file__).with_name("tiles.json")).read_text())


def _ctas(cfg: KernelConfig, batch: int, n: int, nodes: int) -> int:
    """CTAs of a node-per-CTA grid: nodes x N tiles x batch tiles."""
    return nodes * -(-n // cfg.bn) * -(-batch // cfg.tile_m)


def choose_config(family: str, batch: int, n: int, p64: int, nodes: int | None = None,
                  width: int | None = None) -> KernelConfig:
    """The first rule of ``family`` whose conditions hold; for the channels-last families
    also the implicit one that the rule's channel tile divides ``width`` (see check_config)."""
    for rule in tile_rules()[family]:
        if batch > rule.get("max_batch", math.inf) or n > rule.get("max_n", math.inf):
            continue
        if batch < rule.get("min_batch", 0):
            continue
        if p64 % rule.get("p64_multiple_of", 1) or n % rule.get("n_multiple_of", 1):
            continue
        config = KernelConfig(*rule["config"])
        if nodes is not None and _ctas(config, batch, n, nodes) < rule.get("min_ctas", 0):
            continue
        channel_tile = _channel_tile(family, config)
        if channel_tile is not None and width % channel_tile:
            continue
        return config
    raise LookupError(f"tiles.json has no {family} rule for batch={batch}, n={n}")


def default_config(batch, cout, p64, dtype=None, nout=None) -> KernelConfig:
    """Forward geometry: the minimal 16-row tile with synchronous staging for small batches,
    128 batch rows per CTA (weight-tile reuse) and cp.async for large ones; given ``nout``,
    smaller tiles where the large ones would launch fewer CTAs than a rule's ``min_ctas``
    (layers with a few nodes). ``dtype`` does not change the choice (knnconv.cuda's API takes
    it)."""
    return choose_config("forward", batch, cout, p64, nout)


def default_grad_input_config(batch, cin, nin=None) -> KernelConfig:
    """grad_input geometry: batch-tiled like the forward, the N tile sized to Cin (this dx
    kernel tiles input channels, not slots); given
    ``nin`` (its grid has one CTA row per input node), smaller tiles for few-node layers."""
    return choose_config("grad_input", batch, cin, SLOT_ALIGN, nin)


def default_grad_input_algorithm(cin: int) -> str:
    """'scatter' (grad_input_scatter) below tiles.json's scatter_below_cin, else 'gather'."""
    return "scatter" if cin < tile_rules()["scatter_below_cin"] else "gather"


def default_grad_input_scatter_config(batch) -> KernelConfig:
    """grad_input_scatter geometry: batch-tiled like the forward, slot tile 64."""
    return choose_config("grad_input_scatter", batch, SLOT_ALIGN, SLOT_ALIGN)


def default_grad_weight_config(batch, cout, p64) -> KernelConfig:
    """grad_weight geometry (tiles.json): for Cout <= 64, 192 slots x 64 at B >= 1024 where
    P64 allows (three-channel first layers), else 64 x 64; wider layers take 128 slots where
    P64 allows, with a Cout tile of 256 where Cout is a multiple of it, else 128; else 64
    slots by 128."""
    return choose_config("grad_weight", batch, cout, p64)


@cache  # asked on every call of the hot path
def channels_last_width_multiple() -> int:
    """The channel counts the channels-last kernels serve are multiples of this (the smallest
    channel tile of their rules; fewer channels per entry take the re-laying-out kernels)."""
    rules = tile_rules()
    return min(min(KernelConfig(*r["config"]).bk for r in rules["gather_cl"]),
               min(KernelConfig(*r["config"]).tile_m for r in rules["grad_weight_cl"]))


def channels_last_serves(cin: int, cout: int) -> bool:
    """Whether a layer's channel counts suit the channels-last kernels' tiles: multiples of
    :func:`channels_last_width_multiple` (every layer of the published fovi models past the
    first)."""
    multiple = channels_last_width_multiple()
    return cin % multiple == 0 and cout % multiple == 0


def default_gather_cl_config(batch: int, n: int, width: int, nodes: int) -> KernelConfig:
    """gather_cl geometry for ``n`` produced channels over entries of ``width`` channels on
    ``nodes`` nodes (forward: Cout over Cin, Nout; dx: Cin over Cout, Nin)."""
    return choose_config("gather_cl", batch, n, SLOT_ALIGN, nodes, width)


def default_gather_cl_wgmma_config(batch: int, n: int, width: int, nodes: int) -> KernelConfig:
    """gather_cl_wgmma geometry, as :func:`default_gather_cl_config`'s; LookupError where no
    rule fits (the layer then takes gather_cl)."""
    return choose_config("gather_cl_wgmma", batch, n, SLOT_ALIGN, nodes, width)


def default_grad_weight_cl_config(batch: int, cout: int, cin: int) -> KernelConfig:
    """grad_weight_cl geometry: a channel tile that divides Cin, Cout tiled by bn."""
    return choose_config("grad_weight_cl", batch, cout, SLOT_ALIGN, None, cin)


def default_grad_weight_cl_ksplit(cfg: KernelConfig, batch: int, ctas: int,
                                  multiprocessors: int) -> int:
    """Batch slices of grad_weight_cl: enough for about two CTAs per SM (each slice is one
    more atomic pass over its tile), never more than there are batch steps."""
    batch_steps = max(1, -(-batch // cfg.bk))
    return max(1, min(batch_steps, math.ceil(2 * multiprocessors / max(1, ctas))))


def default_grad_weight_ksplit(cfg, bpad, cpad, p64, nout, device_index=None, *,
                               multiprocessors: int | None = None) -> int:
    """Split-K-over-batch factor for grad_weight: enough slices for about two CTAs per SM.

    Small-Nout layers cannot fill the GPU with (node, slot tile, Cout tile) CTAs alone; each
    slice costs one more fp32 atomic pass over its tile, so no more are made than needed, and
    never more than there are batch steps.
    """
    if multiprocessors is None:
        import torch

        multiprocessors = torch.cuda.get_device_properties(device_index).multi_processor_count
    ctas = nout * (p64 // cfg.tile_m) * (cpad // cfg.bn)
    batch_steps = max(1, bpad // cfg.bk)
    return max(1, min(batch_steps, math.ceil(2 * multiprocessors / ctas)))


def checked_ksplit(ksplit, k_tiles: int, batch: int, bk: int) -> int:
    """A requested split of dW's batch contraction, as an int in [1, k_tiles]: each slice
    needs at least one k-step of ``bk`` batch rows, so a split finer than the batch's k-steps
    cannot be honoured and is refused rather than quietly coarsened."""
    if isinstance(ksplit, bool) or not isinstance(ksplit, int):
        raise TypeError(f"ksplit must be an int or None, got {type(ksplit).__name__}")
    if not 1 <= ksplit <= k_tiles:
        raise ValueError(
            f"ksplit={ksplit} cannot be honoured: a batch of {batch} (padded to {k_tiles * bk}) "
            f"has {k_tiles} k-step(s) of {bk} rows, and each split needs at least one; "
            f"use 1 <= ksplit <= {k_tiles}, or None for the heuristic")
    return ksplit


# A CTA of knn_forward / knn_grad_input_scatter walks several nodes in one pipeline until it
# has at least this many contraction tiles, so layers with few slots (or channels) per node
# keep loads in flight across node boundaries instead of paying each CTA's start-up latency.
MIN_TILES_PER_CTA = 32  # scripts/tune_tiles.py: 8 nodes beat 4 on conv1 and alexnet layers.0
MAX_NODES_PER_CTA = 8
# 16-warp tiles serve layers with many slots per node, which need no walk: one node per CTA
WALKING_MAX_THREADS = 256


def default_nodes_per_cta(cfg: KernelConfig, k_tiles: int, ctas_per_node: int, nout: int,
                          multiprocessors: int) -> int:
    """Nodes per CTA: doubled while a CTA has fewer than MIN_TILES_PER_CTA tiles and the grid
    keeps at least four CTAs per SM."""
    if cfg.threads > WALKING_MAX_THREADS:
        return 1
    nodes = 1
    while (nodes < MAX_NODES_PER_CTA and k_tiles * nodes < MIN_TILES_PER_CTA
           and -(-nout // (2 * nodes)) * ctas_per_node >= 4 * multiprocessors):
        nodes *= 2
    return nodes
