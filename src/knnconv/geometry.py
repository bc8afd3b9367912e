"""Neighbour tables and foveated sensor layouts for KNN convolution.

A KNN convolution layer maps features on ``Nin`` input points to ``Nout`` output
points. Each output point gathers its ``K`` nearest inputs and weights each of them
with the kernel cell (one of ``V = side * side`` cells of a reference grid) that the
neighbour's normalised offset falls into. :func:`knn_geometry` builds those tables;
:func:`foveated_coords` and :func:`foveated_stack` build retina-like point layouts to
run them on.
"""

from __future__ import annotations

import math
import warnings

import torch

from ._checks import check_positive

__all__ = ["foveated_coords", "foveated_stack", "knn_geometry"]

# Caps the [chunk, Nin] distance matrix at 2**24 float64 entries (128 MiB; its [chunk, Nin, 2]
# coordinate differences take twice that), whatever the layout size.
_DISTANCE_ELEMENTS_PER_CHUNK = 1 << 24


def knn_geometry(in_coords, out_coords, k, *, ref_side=None):
    """Build the neighbour table and kernel-cell table of a KNN convolution.

    Args:
        in_coords: input point coordinates, shape ``[Nin, 2]`` (tensor or array-like).
        out_coords: output point coordinates, shape ``[Nout, 2]``.
        k: number of neighbours ``K`` gathered per output point (``>= 1``). When
            ``k > Nin`` the last ``k - Nin`` slots are padding.
        ref_side: side of the square reference grid of kernel cells; defaults to
            ``ceil(sqrt(k))`` so that there are at least as many cells as neighbours.

    Returns:
        ``(knn_indices, rf_index, v)`` where

        * ``knn_indices`` is int64 ``[K, Nout]``: column ``n`` lists the inputs nearest
          to output ``n``, nearest first, ties broken by lower input index. Padding
          slots hold ``Nin``, so a consumer can append one zero row to its input features
          and gather without masking.
        * ``rf_index`` is int64 ``[Nout, K]``: the kernel cell ``row * side + col`` of
          each neighbour (row from y, col from x); padding slots get cell 0.
        * ``v`` is the number of kernel cells, ``side * side``.

    Each neighbourhood's offsets (input minus output coordinate) are divided by their
    largest absolute component, which maps the neighbourhood onto ``[-1, 1]^2`` whatever
    the local sample spacing; a neighbour then goes to the cell whose centre
    ``-1 + (2i + 1) / side`` is nearest along each axis (an offset exactly on a cell
    border goes to the higher cell).
    """
    in_points = as_coords(in_coords, "in_coords")
    out_points = as_coords(out_coords, "out_coords")
    k = check_positive("k", k)
    side = math.isqrt(k - 1) + 1 if ref_side is None else check_positive("ref_side", ref_side)

    n_in = in_points.shape[0]
    n_real = min(k, n_in)
    if k > n_in:
        warnings.warn(f"k={k} is more than the {n_in} input points: the last {k - n_in} "
                      "neighbour slots of every output point are padding", stacklevel=2)
    nearest = torch.cat(
        [
            _nearest_inputs(in_points, out_chunk, n_real)
            for out_chunk in out_points.split(max(1, _DISTANCE_ELEMENTS_PER_CHUNK // n_in))
        ]
    )

    offsets = in_points[nearest] - out_points[:, None, :]
    scale = offsets.abs().amax(dim=(1, 2), keepdim=True)
    # A zero extent only happens when every real neighbour coincides with the output
    # point; all offsets are then zero and any non-zero scale puts them in the middle.
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    cell = _cell_along_axis(offsets / scale, side)
    rf_real = cell[..., 1] * side + cell[..., 0]

    n_out = out_points.shape[0]
    knn_indices = torch.full((k, n_out), n_in, dtype=torch.int64)
    knn_indices[:n_real] = nearest.T
    rf_index = torch.zeros((n_out, k), dtype=torch.int64)
    rf_index[:, :n_real] = rf_real
    return knn_indices, rf_index, side * side


def foveated_coords(n_rings, *, a=0.5, fov_radius=1.0):
    """Concentric-ring sample layout with density set by cortical magnification.

    Sampling follows the magnification ``M(r) = 1 / (r + a)``: in the warped radius
    ``w = log(r + a)`` samples are uniformly spaced, so spacing in the visual field grows
    linearly with eccentricity, from ``~a * dw`` at the centre to ``~(fov_radius + a) * dw``
    at the edge. ``a`` sets the size of the fovea: a smaller ``a`` concentrates more
    samples at the centre.

    Args:
        n_rings: number of rings including the centre point (``>= 1``). Ring ``j`` lies
            at radius ``exp(log(a) + j * dw) - a`` with ``dw = log((fov_radius + a) / a)
            / (n_rings - 1)``, so ring 0 is the centre and the last ring is the edge of
            the field of view. The point count grows roughly as ``n_rings ** 2``.
        a: magnification offset, ``> 0``, in the units of ``fov_radius``.
        fov_radius: radius of the circular field of view, ``> 0``.

    Returns:
        float64 tensor ``[N, 2]`` of ``(x, y)`` points, ring by ring from the centre
        outwards, counter-clockwise within a ring. Each ring holds
        ``round(2 * pi * r / ((r + a) * dw))`` points, which makes the spacing along the
        ring equal the radial spacing ``(r + a) * dw``; the centre ring holds one point.
        Odd rings are rotated by half their angular step so that neighbouring rings
        interleave instead of lining up into spokes.
    """
    radii, counts = _ring_layout(n_rings, a, fov_radius)
    rings = []
    for ring, (radius, count) in enumerate(zip(radii, counts, strict=True)):
        step = 2.0 * math.pi / count
        angles = (torch.arange(count, dtype=torch.float64) + 0.5 * (ring % 2)) * step
        rings.append(radius * torch.stack([torch.cos(angles), torch.sin(angles)], dim=1))
    return torch.cat(rings)


def foveated_stack(resolution=64, a=0.5, levels=5):
    """Coordinate sets of a foveated layer stack, sensor first, each level ~4x coarser.

    Level 0 is a :func:`foveated_coords` layout on the unit field of view with the
    fewest rings that give at least ``pi / 4 * resolution ** 2`` points, the pixel count
    of the disc inscribed in a ``resolution x resolution`` image, so the sensor has as
    many samples as the image it replaces. Each next level is a stride-2 layout of the
    previous one: level ``l`` has ``round(intervals_0 / 2 ** l)`` ring intervals (at least
    one, unless the sensor itself is a single point) between the centre and the edge, hence
    about 4x fewer points per level and never more than the level before.

    With the defaults the sizes are 3321, 846, 244, 67, 14 points (39, 20, 11, 6, 3 rings).

    Args:
        resolution: side in pixels of the image the sensor stands in for (``>= 1``).
        a: magnification offset passed to :func:`foveated_coords` (``> 0``).
        levels: number of coordinate sets returned (``>= 1``).

    Returns:
        list of ``levels`` float64 tensors ``[N_l, 2]``.
    """
    resolution = check_positive("resolution", resolution)
    levels = check_positive("levels", levels)
    target_points = math.pi / 4.0 * resolution**2
    n_rings = 1
    while sum(_ring_layout(n_rings, a, 1.0)[1]) < target_points:
        n_rings += 1

    # Rounding from the sensor's interval count, not level to level, keeps rounding errors
    # from compounding down the stack.
    sensor_intervals = n_rings - 1
    fewest = min(1, sensor_intervals)
    return [
        foveated_coords(1 + max(fewest, round(sensor_intervals / 2**level)), a=a,
                        fov_radius=1.0)
        for level in range(levels)
    ]


def _ring_layout(n_rings, a, fov_radius):
    """Radii and point counts of the rings of :func:`foveated_coords`."""
    n_rings = check_positive("n_rings", n_rings)
    a = _positive_float(a, "a")
    fov_radius = _positive_float(fov_radius, "fov_radius")
    if n_rings == 1:
        return [0.0], [1]
    dw = math.log((fov_radius + a) / a) / (n_rings - 1)
    # exp(log(a) + j * dw) - a, written to stay exact at j = 0.
    radii = [a * math.expm1(j * dw) for j in range(n_rings)]
    counts = [max(1, round(2.0 * math.pi * r / ((r + a) * dw))) for r in radii]
    return radii, counts


def _nearest_inputs(in_points, out_points, n_nearest):
    """Indices [len(out_points), n_nearest] of the nearest inputs, ties to lower index."""
    # Direct differences, not |p|^2 + |q|^2 - 2 p.q: the expansion's rounding error can
    # break exact ties (e.g. on grids) differently from one output to the next.
    distances = (out_points[:, None, :] - in_points[None, :, :]).square().sum(dim=2)
    # A stable sort keeps equal distances in input order; topk gives no such guarantee.
    return distances.sort(dim=1, stable=True).indices[:, :n_nearest]


def _cell_along_axis(normalised_offsets, side):
    """Index of the nearest of ``side`` cell centres on [-1, 1], per coordinate."""
    cell = torch.floor((normalised_offsets + 1.0) * (side / 2.0)).to(torch.int64)
    # An offset of exactly +1 lands on the outer border of the last cell.
    return cell.clamp_(0, side - 1)


def as_coords(coords, name: str) -> torch.Tensor:
    """``coords`` as a float64 CPU tensor [N, 2], checked: numeric, two columns, at least one
    point, finite; ``name`` names it in the errors."""
    try:
        points = torch.as_tensor(coords).detach().to(device="cpu", dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{name} must be a numeric array of shape [N, 2]: {error}") from error
    if points.dim() != 2 or points.shape[1] != 2:
        raise ValueError(f"{name} must have shape [N, 2], got {tuple(points.shape)}")
    if points.shape[0] == 0:
        raise ValueError(f"{name} must contain at least one point, got shape [0, 2]")
    if not torch.isfinite(points).all():
        raise ValueError(f"{name} must contain only finite coordinates")
    return points


def _positive_float(value, name):
    try:
        as_float = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(as_float) or as_float <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return as_float
