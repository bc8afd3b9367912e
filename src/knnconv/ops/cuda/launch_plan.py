"""Launch planning: every decision a KNN convolution's kernel launches depend on, in one place.

Pure functions of the layer's sizes, the batch, the device's limits (:class:`DeviceLimits`)
and the operands' storage. A planner returns a direction's whole plan: the kernel family, its
tiles (from tiles.json through :mod:`.configs`, or the caller's), the padded extents, the walk
of nodes per CTA, the grid and shared memory of every gathered GEMM, a backward's workspace.

===================================  ===========================================================
function                             decides
===================================  ===========================================================
:func:`plan_forward_path`,           a call's path: the channels-last kernels reading x and
:func:`plan_backward_path`           grad_y in place, or the re-laying-out ones
:func:`choose_gather_kernel`         gather_cl, or on Hopper when asked its warpgroup-MMA variant
:func:`kernel_name`                  the NVRTC name of a gathered-GEMM kernel
:func:`plan_forward`                 knn_forward from the re-laid-out x
:func:`plan_backward`                dx (grad_input: reversed-graph gather, or
                                     grad_input_scatter) and dW (grad_weight), re-laid out
:func:`plan_gather`                  knn_gather_cl(_wgmma): the channels-last forward, or dx
:func:`plan_channels_last_backward`  dx (plan_gather) and dW (knn_grad_weight_cl:
                                     plan_channels_last_dw) from channels-last x and grad_y
===================================  ===========================================================

The launch classes (:mod:`.gemm`, :mod:`.channels_last`) build and run what a plan names;
nothing else chooses a tile or a kernel (the transposes of :mod:`.launch` shape their tiles
to their extents, the neighbourhood kernels take one thread per element).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .build import SCALAR_TYPES
from .configs import (
    ARCHITECTURE_FAMILIES,
    WALKING_MAX_THREADS,
    KernelConfig,
    block_threads,
    channels_last_serves,
    check_config,
    checked_ksplit,
    default_config,
    default_gather_cl_config,
    default_gather_cl_wgmma_config,
    default_grad_input_algorithm,
    default_grad_input_config,
    default_grad_input_scatter_config,
    default_grad_weight_cl_config,
    default_grad_weight_cl_ksplit,
    default_grad_weight_config,
    default_grad_weight_ksplit,
    default_nodes_per_cta,
    shared_memory_bytes,
)

MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z
# grad_weight reading channels-last grad_y stages 16-byte runs of its Cout channels
GRAD_IN_PLACE_COUT_MULTIPLE = 8


@dataclass(frozen=True)
class DeviceLimits:
    """What a plan needs to know of the device."""

    multiprocessors: int
    shared_memory_bytes: int  # the dynamic shared memory one block may opt in to
    capability: tuple[int, int]


@dataclass(frozen=True)
class GemmPlan:
    """One gathered-GEMM launch: its kernel family and tiles, grid, block and shared memory
    (``grad_in_place``: grad_weight reading channels-last grad_y; see shared_memory_bytes)."""

    family: str
    cfg: KernelConfig
    grid: tuple[int, int, int]
    shared_bytes: int
    nodes_per_cta: int = 1
    grad_in_place: bool = False

    @property
    def block(self) -> tuple[int, int, int]:
        return (block_threads(self.family, self.cfg), 1, 1)


@dataclass(frozen=True)
class ForwardPlan:
    """The forward from x re-laid out as xt [Cin*Nin + 1, bpad]: each node runs ``slots``
    slots (a multiple of the K tile); y's Cout is padded to ``cpad`` in the weight re-layout."""

    gemm: GemmPlan
    bpad: int
    cpad: int
    slots: int


class Carve:
    """Byte offsets of several buffers inside one allocation, each 256-byte aligned, so a
    call allocates once instead of once per temporary."""

    def __init__(self) -> None:
        self.size = 0

    def add(self, nbytes: int) -> int:
        offset = self.size
        self.size = round_up(offset + nbytes, 256)
        return offset


@dataclass(frozen=True)
class Workspace:
    """Where a backward's temporaries lie in its one allocation (None: not needed): grad_y
    re-laid out (gt), x re-laid out (xt), the weight re-laid out, dx's staging, and the fp32
    accumulators of dW and the bias gradient. Bytes [zero_from, size) are zeroed before the
    kernels run (the accumulators); those before it are written whole by a re-layout or a
    kernel."""

    size: int
    zero_from: int
    gt: int | None = None
    xt: int | None = None
    weight: int | None = None
    dx: int | None = None
    dw: int | None = None
    db: int | None = None

    @property
    def zero_bytes(self) -> int:
        return self.size - self.zero_from


@dataclass(frozen=True)
class BackwardPlan:
    """dx and dW from re-laid-out operands: the dx kernel (``input``, by ``algorithm``) and
    dW's (``weight``), each None when its gradient is not needed; the padded batch (``bpad``,
    ``reuses_padding`` when it is the forward's kept one), Cout padded to ``gpad``, Cin to
    ``cinpad`` (gathered dx), dW's batch steps ``per_split`` a slice over ``p_tiles`` slot
    tiles; dx staged in the compute dtype (a gather writing each element once, dx wanted in
    that dtype) or in fp32; the workspace."""

    algorithm: str
    input: GemmPlan | None
    weight: GemmPlan | None
    bpad: int
    gpad: int
    reuses_padding: bool
    dx_staged_in_compute_dtype: bool
    workspace: Workspace
    cinpad: int | None = None
    per_split: int | None = None
    p_tiles: int | None = None


@dataclass(frozen=True)
class GatherPlan:
    """A channels-last gather producing ``n`` channels padded to ``npad``."""

    gemm: GemmPlan
    npad: int


@dataclass(frozen=True)
class ChannelsLastWeightPlan:
    """dW by cell into an fp32 accumulator [V, Cin, wpad], the batch in slices of
    ``per_split`` steps."""

    gemm: GemmPlan
    wpad: int
    per_split: int


@dataclass(frozen=True)
class ChannelsLastBackwardPlan:
    """dx by the gather over the reversed graph, dW by cell (each None when not needed), and
    the workspace: the weight re-laid out by cell for dx, dW's fp32 accumulator."""

    input: GatherPlan | None
    weight: ChannelsLastWeightPlan | None
    workspace: Workspace


@dataclass(frozen=True)
class ForwardPath:
    """Which forward a call takes: the channels-last gather reading x in place, or the
    re-laying-out one; ``keeps_x``: the backward gets x itself, not the forward's re-layout."""

    channels_last: bool
    keeps_x: bool


@dataclass(frozen=True)
class BackwardPath:
    """Which backward a call takes: the channels-last kernels reading grad_y and x in place,
    or the re-laying-out ones (dW reading grad_y itself where ``grad_y_in_place``)."""

    channels_last: bool
    grad_y_in_place: bool


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def reads_in_place(cin: int, cout: int, x_channels_last: bool) -> bool:
    """Whether a call on x of this storage takes the channels-last kernels, which read x
    and grad_y in place (the backward then needs x itself, not a re-layout of it)."""
    return x_channels_last and channels_last_serves(cin, cout)


def plan_forward_path(*, cin: int, cout: int, x_channels_last: bool,
                      x_readable: bool) -> ForwardPath:
    """The forward's path for x of this storage (``x_readable``: see :func:`.launch.readable`).
    A channels-last x the kernels cannot read (unaligned) is re-laid out this once, but x is
    what the backward gets, as :func:`reads_in_place` promised the saved layout."""
    in_place = reads_in_place(cin, cout, x_channels_last)
    return ForwardPath(channels_last=in_place and x_readable, keeps_x=in_place)


def plan_backward_path(*, cin: int, cout: int, need_input: bool, need_weight: bool,
                       dx_channels_last: bool, x_readable: bool,
                       grad_y_readable: bool) -> BackwardPath:
    """The channels-last kernels where the layer suits them, dx is wanted in channels-last
    storage (they write no other) and x, for dW, is readable in place (a tensor, not a
    re-layout: see :func:`.launch.readable`); else the re-laying-out ones, whose dW reads a
    readable grad_y where it lies when dx is not needed (an image layer's)."""
    if (channels_last_serves(cin, cout) and (not need_input or dx_channels_last)
            and (not need_weight or x_readable)):
        return BackwardPath(channels_last=True, grad_y_in_place=False)
    return BackwardPath(channels_last=False,
                        grad_y_in_place=need_weight and not need_input and grad_y_readable)


def choose_gather_kernel(batch: int, n: int, width: int, nodes: int, capability: tuple[int, int],
                         *, warpgroup_mma: bool) -> tuple[str, KernelConfig]:
    """(family, geometry) of a channels-last gather on a device of this compute capability:
    with ``warpgroup_mma`` (knnconv.context's setting), the first gather_cl_wgmma rule that
    fits on Hopper; else gather_cl's (:func:`~.configs.default_gather_cl_config`)."""
    if warpgroup_mma and tuple(capability) == ARCHITECTURE_FAMILIES["gather_cl_wgmma"]:
        try:
            return "gather_cl_wgmma", default_gather_cl_wgmma_config(batch, n, width, nodes)
        except LookupError:
            pass
    return "gather_cl", default_gather_cl_config(batch, n, width, nodes)


def kernel_name(family: str, dtype: torch.dtype, cfg: KernelConfig,
                out_dtype: torch.dtype | None = None, *, grad_in_place: bool = False) -> str:
    """The NVRTC name expression of one gathered-GEMM instantiation. ``out_dtype``: what the
    forward-shaped kernels store (default: the compute dtype, but float32 for grad_input's dx
    staging). ``grad_in_place``: grad_weight reading channels-last grad_y itself instead of
    its batch-contiguous re-layout."""
    scalar, tiles = SCALAR_TYPES[dtype], cfg.template_args()
    if family == "grad_weight":
        return f"knnconv::knn_grad_weight<{scalar}, {tiles}, {str(grad_in_place).lower()}>"
    if family in ("grad_input_scatter", "grad_weight_cl"):
        return f"knnconv::knn_{family}<{scalar}, {tiles}>"
    out = SCALAR_TYPES[out_dtype or (torch.float32 if family == "grad_input" else dtype)]
    if family == "gather_cl_wgmma":  # its tile is set by bn, bk, warpgroups and stages alone
        tiles = f"{cfg.bn}, {cfg.bk}, {cfg.rb}, {cfg.ksteps}"
    return f"knnconv::knn_{family}<{scalar}, {out}, {tiles}>"


def walk_of_nodes(requested: int | None, cfg: KernelConfig, k_tiles: int, ctas_per_node: int,
                  nodes: int, device: DeviceLimits) -> int:
    """Nodes per CTA: the requested walk, checked, or the default one."""
    if requested is None:
        return default_nodes_per_cta(cfg, k_tiles, ctas_per_node, nodes, device.multiprocessors)
    if requested < 1 or (requested > 1 and cfg.threads > WALKING_MAX_THREADS):
        raise ValueError(f"nodes_per_cta must be >= 1, and 1 for tiles of more than "
                         f"{WALKING_MAX_THREADS} threads; got {requested} for {tuple(cfg)}")
    return requested


def _batch_multiple(*configs: tuple[str, KernelConfig]) -> int:
    """What the padded batch must be a multiple of: every given (family, config)'s batch tile."""
    return math.lcm(*(cfg.bk if family == "grad_weight" else cfg.tile_m
                      for family, cfg in configs))


def padded_batch(batch: int, *configs: tuple[str, KernelConfig]) -> int:
    """The batch padded so every given (family, config)'s batch tile divides it."""
    return round_up(batch, _batch_multiple(*configs))


def _default_backward_tiles(batch: int, cin: int, nin: int, cout: int, p64: int):
    """The (family, config) pairs a default backward of this call would run."""
    if default_grad_input_algorithm(cin) == "scatter":
        grad_input_tiles = ("grad_input_scatter", default_grad_input_scatter_config(batch))
    else:
        grad_input_tiles = ("grad_input", default_grad_input_config(batch, cin, nin))
    return grad_input_tiles, ("grad_weight", default_grad_weight_config(batch, cout, p64))


def forward_batch_padding(batch: int, cin: int, nin: int, cout: int, nout: int, p64: int,
                          cfg: KernelConfig | None = None) -> int:
    """The padded batch of a forward's xt (of its tile ``cfg``, default: the default tile): its
    own tile and the default backward's, so the backward can reuse xt."""
    cfg = cfg or default_config(batch, cout, p64, nout=nout)
    return padded_batch(batch, ("forward", cfg),
                        *_default_backward_tiles(batch, cin, nin, cout, p64))


def plan_forward(*, batch: int, cin: int, nin: int, cout: int, nout: int, p64: int,
                 device: DeviceLimits, config: KernelConfig | None = None,
                 nodes_per_cta: int | None = None, slots: int | None = None) -> ForwardPlan:
    """knn_forward's plan. The CTA's slot tables are staged in shared memory, so a default
    walk of nodes is shortened where its tables would not fit (a requested one is refused)."""
    limit = device.shared_memory_bytes
    cfg = check_config("forward", config or default_config(batch, cout, p64, nout=nout),
                       p64=p64, max_shared_bytes=limit)
    if slots is not None and not 1 <= slots <= p64:
        raise ValueError(f"slots must be in [1, P64 = {p64}], got {slots}")
    slots = round_up(slots or p64, cfg.bk)
    bpad = forward_batch_padding(batch, cin, nin, cout, nout, p64, cfg)
    cpad = round_up(cout, cfg.bn)
    grid_yz = (cpad // cfg.bn, bpad // cfg.tile_m)
    walk = walk_of_nodes(nodes_per_cta, cfg, slots // cfg.bk, grid_yz[0] * grid_yz[1], nout,
                         device)
    while shared_memory_bytes("forward", cfg, staged_slots=walk * slots) > limit:
        if walk == 1 or nodes_per_cta is not None:
            raise ValueError(
                f"the forward's slot tables ({walk} node(s) of {slots} slots) and tiles "
                f"{tuple(cfg)} need more than the device's {limit} B of shared memory; use "
                "smaller tiles or fewer nodes per CTA")
        walk //= 2
    # the batch tiles of a node group are consecutive CTAs along x (see knn_forward)
    gemm = GemmPlan("forward", cfg, (-(-nout // walk) * grid_yz[1], grid_yz[0], 1),
                    shared_memory_bytes("forward", cfg, staged_slots=walk * slots), walk)
    return ForwardPlan(gemm, bpad, cpad, slots)


def plan_backward(*, batch: int, cin: int, nin: int, cout: int, nout: int, q: int, p64: int,
                  element_bytes: int, device: DeviceLimits, need_input: bool = True,
                  need_weight: bool = True, need_bias: bool = False,
                  dx_in_compute_dtype: bool = False, algorithm: str | None = None,
                  input_config: KernelConfig | None = None,
                  weight_config: KernelConfig | None = None, ksplit: int | None = None,
                  nodes_per_cta: int | None = None, batch_padding: int | None = None,
                  grad_y_in_place: bool = False) -> BackwardPlan:
    """The re-laying-out backward's plan, for operands of ``element_bytes`` (the compute
    dtype's). ``dx_in_compute_dtype``: dx is wanted in the compute dtype; ``batch_padding``:
    the padded batch to use where the tiles allow it (that of a forward's kept re-layout of
    x, so the backward reuses it), else the smallest; ``grad_y_in_place``: dW reads
    channels-last grad_y itself (dW and the bias gradient alone, Cout a multiple of
    GRAD_IN_PLACE_COUT_MULTIPLE)."""
    if grad_y_in_place and (need_input or cout % GRAD_IN_PLACE_COUT_MULTIPLE):
        raise ValueError(
            "grad_y_in_place serves dW and the bias gradient alone, for Cout a multiple of "
            f"{GRAD_IN_PLACE_COUT_MULTIPLE}; got need_input={need_input}, Cout={cout}")
    algorithm = algorithm or default_grad_input_algorithm(cin)
    if algorithm not in ("gather", "scatter"):
        raise ValueError(f"algorithm must be 'gather' or 'scatter', got {algorithm!r}")
    input_family = "grad_input" if algorithm == "gather" else "grad_input_scatter"
    limit = device.shared_memory_bytes
    gi = check_config(input_family, input_config or (
        default_grad_input_config(batch, cin, nin) if algorithm == "gather"
        else default_grad_input_scatter_config(batch)), p64=p64, max_shared_bytes=limit)
    gw = check_config("grad_weight", weight_config or default_grad_weight_config(batch, cout, p64),
                      p64=p64, max_shared_bytes=limit, grad_in_place=grad_y_in_place)
    needed = [pair for pair, wanted in (((input_family, gi), need_input),
                                        (("grad_weight", gw), need_weight)) if wanted]
    multiple = _batch_multiple(*needed)
    reuses = batch_padding is not None and batch_padding >= batch and (
        batch_padding % multiple == 0)
    bpad = batch_padding if reuses else round_up(batch, multiple)
    gpad = round_up(cout, math.lcm(*(cfg.bn if family == "grad_weight" else cfg.bk
                                     for family, cfg in needed)))
    input_plan = weight_plan = cinpad = per_split = p_tiles = None
    if need_input and algorithm == "gather":
        cinpad = round_up(cin, gi.bn)
        input_plan = GemmPlan(input_family, gi, (nin, cinpad // gi.bn, bpad // gi.tile_m),
                              shared_memory_bytes(input_family, gi))
    elif need_input:
        grid_yz = (p64 // gi.bn, bpad // gi.tile_m)
        walk = walk_of_nodes(nodes_per_cta, gi, gpad // gi.bk, grid_yz[0] * grid_yz[1], nout,
                             device)
        input_plan = GemmPlan(input_family, gi, (-(-nout // walk), *grid_yz),
                              shared_memory_bytes(input_family, gi), walk)
    if need_weight:
        p_tiles, k_tiles = p64 // gw.tile_m, bpad // gw.bk
        if ksplit is None:
            ksplit = default_grad_weight_ksplit(gw, bpad, gpad, p64, nout,
                                                multiprocessors=device.multiprocessors)
        else:
            ksplit = checked_ksplit(ksplit, k_tiles, batch, gw.bk)
        per_split = -(-k_tiles // ksplit)
        splits = -(-k_tiles // per_split)
        weight_plan = GemmPlan("grad_weight", gw, (nout, p_tiles * splits, gpad // gw.bn),
                               shared_memory_bytes("grad_weight", gw,
                                                   grad_in_place=grad_y_in_place),
                               grad_in_place=grad_y_in_place)
    # dx is staged before its layout is restored: in float32 where atomics sum it (scatter),
    # in the compute dtype where dx is wanted in it and the gather writes each element once
    # from fp32 accumulators (rounding as a later conversion would, in half the bytes)
    gathered = need_input and algorithm == "gather"
    staged_in_compute = gathered and dx_in_compute_dtype
    staging_bytes = element_bytes if staged_in_compute else 4
    rows = cin * nin
    carve, at = Carve(), {}
    if not grad_y_in_place:
        at["gt"] = carve.add(nout * gpad * bpad * element_bytes)
    if need_weight and not reuses:  # a forward's kept re-layout of x is reused where it fits
        at["xt"] = carve.add((rows + 1) * bpad * element_bytes)
    if gathered:
        at["weight"] = carve.add((q // cin) * gpad * cinpad * element_bytes)
        at["dx"] = carve.add(batch * nin * cin * staging_bytes)
    elif need_input:
        at["weight"] = carve.add(q * gpad * element_bytes)
    zero_from = carve.size
    if need_input and not gathered:  # slot gradients summed with atomics
        at["dx"] = carve.add(rows * bpad * staging_bytes)
    if need_weight:
        at["dw"] = carve.add(q * gpad * 4)
    if need_bias:
        at["db"] = carve.add(cout * 4)
    return BackwardPlan(algorithm, input_plan, weight_plan, bpad, gpad, reuses,
                        staged_in_compute, Workspace(carve.size, zero_from, **at), cinpad,
                        per_split, p_tiles)


def _batch_tiles(batch: int, cfg: KernelConfig) -> int:
    """A channels-last kernel's CTAs along the batch (its grid's z extent)."""
    tiles = -(-batch // cfg.tile_m)
    if tiles > MAX_GRID_YZ:
        raise ValueError(f"a batch of {batch} exceeds CUDA's grid limit for tiles of "
                         f"{cfg.tile_m} rows; split the batch")
    return tiles


def plan_gather(*, batch: int, n: int, width: int, nodes: int, entries: int,
                device: DeviceLimits, warpgroup_mma: bool, family: str | None = None,
                config: KernelConfig | None = None,
                nodes_per_cta: int | None = None) -> GatherPlan:
    """The channels-last gather producing ``n`` channels from entries of ``width`` channels
    on ``nodes`` nodes with ``entries`` entries in all (forward: Cout from Cin over the output
    nodes' neighbours; dx: Cin from Cout over the input nodes' (output node, cell) pairs).
    ``config`` (of ``family``, gather_cl by default) or the device's default
    (:func:`choose_gather_kernel`, with knnconv.context's ``warpgroup_mma``)."""
    if config is None:
        family, config = choose_gather_kernel(batch, n, width, nodes, device.capability,
                                              warpgroup_mma=warpgroup_mma)
    family = family or "gather_cl"
    cfg = check_config(family, config, width=width, max_shared_bytes=device.shared_memory_bytes)
    npad = round_up(n, cfg.bn)
    grid_yz = (npad // cfg.bn, _batch_tiles(batch, cfg))
    mean_tiles = max(1, entries // max(1, nodes)) * (width // cfg.bk)
    walk = walk_of_nodes(nodes_per_cta, cfg, mean_tiles, grid_yz[0] * grid_yz[1], nodes, device)
    return GatherPlan(GemmPlan(family, cfg, (-(-nodes // walk), *grid_yz),
                               shared_memory_bytes(family, cfg), walk), npad)


def plan_channels_last_dw(*, batch: int, cin: int, cout: int, entries: int,
                          device: DeviceLimits, config: KernelConfig | None = None,
                          ksplit: int | None = None) -> ChannelsLastWeightPlan:
    """knn_grad_weight_cl's plan: a channel tile that divides Cin, Cout tiled by bn, the batch
    split in slices (enough for about two CTAs an SM by default)."""
    gw = check_config("grad_weight_cl", config or default_grad_weight_cl_config(batch, cout, cin),
                      width=cin, max_shared_bytes=device.shared_memory_bytes)
    wpad = round_up(cout, gw.bn)
    ctas = entries * (cin // gw.tile_m) * (wpad // gw.bn)
    k_steps = -(-batch // gw.bk)
    if ksplit is None:
        ksplit = default_grad_weight_cl_ksplit(gw, batch, ctas, device.multiprocessors)
    else:
        ksplit = checked_ksplit(ksplit, k_steps, batch, gw.bk)
    per_split = -(-k_steps // ksplit)
    splits = -(-k_steps // per_split)
    if splits > MAX_GRID_YZ:
        raise ValueError(f"{splits} batch slices exceed CUDA's grid limit")
    grid = (max(1, entries * (cin // gw.tile_m)), wpad // gw.bn, splits)
    return ChannelsLastWeightPlan(
        GemmPlan("grad_weight_cl", gw, grid, shared_memory_bytes("grad_weight_cl", gw)), wpad,
        per_split)


def plan_channels_last_backward(*, batch: int, cin: int, nin: int, cout: int, v: int,
                                entries: int, element_bytes: int, device: DeviceLimits,
                                warpgroup_mma: bool, need_input: bool = True,
                                need_weight: bool = True, input_family: str | None = None,
                                input_config: KernelConfig | None = None,
                                weight_config: KernelConfig | None = None,
                                ksplit: int | None = None,
                                nodes_per_cta: int | None = None) -> ChannelsLastBackwardPlan:
    """The channels-last backward's plan: dx by :func:`plan_gather` over the reversed graph
    (Cin produced from entries of Cout channels on the input nodes), dW by
    :func:`plan_channels_last_dw`, for operands of ``element_bytes``."""
    carve, at = Carve(), {}
    input_plan = weight_plan = None
    if need_input:
        input_plan = plan_gather(batch=batch, n=cin, width=cout, nodes=nin, entries=entries,
                                 device=device, warpgroup_mma=warpgroup_mma,
                                 family=input_family, config=input_config,
                                 nodes_per_cta=nodes_per_cta)
        at["weight"] = carve.add(v * cout * input_plan.npad * element_bytes)
    zero_from = carve.size
    if need_weight:
        weight_plan = plan_channels_last_dw(batch=batch, cin=cin, cout=cout, entries=entries,
                                            device=device, config=weight_config, ksplit=ksplit)
        at["dw"] = carve.add(v * cin * weight_plan.wpad * 4)
    return ChannelsLastBackwardPlan(input_plan, weight_plan,
                                    Workspace(carve.size, zero_from, **at))
