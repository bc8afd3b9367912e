import math

import numpy as np
import pytest
import torch

from knnconv.geometry import foveated_coords, foveated_stack, knn_geometry

# Row-major 3x3 grid: point i sits at column i % 3 (x) and row i // 3 (y).
GRID_3X3 = [[x, y] for y in (-1.0, 0.0, 1.0) for x in (-1.0, 0.0, 1.0)]


def _brute_force_neighbours(in_points, out_points, k):
    """Nearest inputs by lexicographic (distance, index) order, computed independently."""
    in_np = np.asarray(in_points, dtype=np.float64)
    columns = []
    for point in np.asarray(out_points, dtype=np.float64):
        distances = ((in_np - point) ** 2).sum(axis=1)
        columns.append(np.lexsort((np.arange(len(in_np)), distances))[:k])
    return np.stack(columns, axis=1)


def test_grid_centre_gathers_whole_grid_with_its_own_cell_layout():
    knn_indices, rf_index, v = knn_geometry(GRID_3X3, [[0.0, 0.0]], 9)

    assert v == 9
    # Centre, then the four edge neighbours, then the four corners, each by index.
    assert knn_indices[:, 0].tolist() == [4, 1, 3, 5, 7, 0, 2, 6, 8]
    assert rf_index[0].tolist() == knn_indices[:, 0].tolist()


def test_points_on_a_line():
    inputs = [[float(x), 0.0] for x in range(5)]

    knn_indices, rf_index, v = knn_geometry(inputs, [[1.2, 0.0]], 3)

    assert knn_indices[:, 0].tolist() == [1, 2, 0]
    # Offsets -0.2, 0.8, -1.2 scale to -1/6, 2/3, -1 on a 2x2 grid; y = 0 is on the
    # border between the rows and goes to the upper one.
    assert v == 4
    assert rf_index[0].tolist() == [2, 3, 2]


def test_ties_go_to_lower_input_index():
    inputs = [[3.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [1.0, 0.0], [0.0, -1.0]]

    knn_indices, _, _ = knn_geometry(inputs, [[0.0, 0.0]], 5)

    assert knn_indices[:, 0].tolist() == [1, 2, 3, 4, 0]


def test_matches_brute_force_on_integer_lattice_with_many_ties():
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(-4, 5, (60, 2), generator=generator).double()
    outputs = torch.randint(-4, 5, (25, 2), generator=generator).double()

    knn_indices, _, _ = knn_geometry(inputs, outputs, 12)

    np.testing.assert_array_equal(knn_indices.numpy(), _brute_force_neighbours(inputs, outputs, 12))


def test_padding_when_k_exceeds_input_count():
    inputs = [[0.0, 0.0], [1.0, 0.0]]
    outputs = [[0.1, 0.0], [0.9, 0.0], [5.0, 5.0]]

    knn_indices, rf_index, v = knn_geometry(inputs, outputs, 5)

    assert knn_indices.shape == (5, 3)
    assert rf_index.shape == (3, 5)
    assert v == 9
    assert knn_indices[:2].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert (knn_indices[2:] == 2).all()
    assert (rf_index[:, 2:] == 0).all()
    # The padding must not take part in the normalisation: the farthest real neighbour of
    # output 0 (offset +0.9 in x, 0 in y) lands in the last column of the middle row.
    assert rf_index[0, 1].item() == 1 * 3 + 2


def test_k_equals_one_on_coincident_point_uses_unit_scale():
    knn_indices, rf_index, v = knn_geometry(GRID_3X3, [[1.0, 0.0]], 1)

    assert knn_indices.tolist() == [[5]]
    assert v == 1
    assert rf_index.tolist() == [[0]]

    _, rf_index, v = knn_geometry(GRID_3X3, [[1.0, 0.0]], 1, ref_side=3)
    assert v == 9
    assert rf_index.tolist() == [[4]]


def test_k_equals_one_off_grid_point():
    knn_indices, rf_index, v = knn_geometry(GRID_3X3, [[0.9, 0.8]], 1, ref_side=2)

    assert knn_indices.tolist() == [[8]]
    assert v == 4
    # Offset (0.1, 0.2) scales to (0.5, 1): upper row, right column.
    assert rf_index.tolist() == [[3]]


@pytest.mark.parametrize(("k", "side"), [(1, 1), (2, 2), (4, 2), (5, 3), (9, 3), (10, 4)])
def test_default_grid_side_is_ceil_sqrt_k(k, side):
    _, _, v = knn_geometry(GRID_3X3 + [[5.0, 5.0]], [[0.0, 0.0]], k)

    assert v == side * side


def test_ref_side_override_gives_more_cells_than_neighbours():
    knn_indices, rf_index, v = knn_geometry(GRID_3X3, [[0.0, 0.0]], 9, ref_side=5)

    assert v == 25
    # Offsets -1, 0, 1 fall in columns (and rows) 0, 2, 4 of the 5x5 grid.
    expected = [(2 * (i // 3)) * 5 + 2 * (i % 3) for i in knn_indices[:, 0].tolist()]
    assert rf_index[0].tolist() == expected


def test_ref_side_smaller_than_default_merges_cells():
    _, rf_index, v = knn_geometry(GRID_3X3, [[0.0, 0.0]], 9, ref_side=1)

    assert v == 1
    assert (rf_index == 0).all()


def test_tables_do_not_depend_on_scale_or_position_of_the_layout():
    inputs = torch.tensor(GRID_3X3 + [[0.5, -0.5], [2.0, 1.0]], dtype=torch.float64)
    outputs = torch.tensor([[0.0, 0.0], [0.5, 0.5], [1.0, -1.0]], dtype=torch.float64)
    reference = knn_geometry(inputs, outputs, 6)

    # A power-of-two scale and an integer shift keep every coordinate exact.
    moved = knn_geometry(inputs * 4.0 + 3.0, outputs * 4.0 + 3.0, 6)

    assert torch.equal(reference[0], moved[0])
    assert torch.equal(reference[1], moved[1])
    assert reference[2] == moved[2]


def test_shapes_dtypes_and_ranges_on_foveated_layers():
    sensor, strided = foveated_stack(resolution=32, levels=2)

    knn_indices, rf_index, v = knn_geometry(sensor, strided, 7)

    assert knn_indices.dtype == torch.int64
    assert rf_index.dtype == torch.int64
    assert isinstance(v, int)
    assert v == 9
    assert knn_indices.shape == (7, len(strided))
    assert rf_index.shape == (len(strided), 7)
    assert knn_indices.min() >= 0
    assert knn_indices.max() < len(sensor)
    assert rf_index.min() >= 0
    assert rf_index.max() < v
    distances = (sensor[knn_indices] - strided).norm(dim=2)
    assert (distances.diff(dim=0) >= 0).all()


def test_accepts_numpy_lists_integer_and_float32_coordinates():
    as_float64 = knn_geometry(GRID_3X3, [[0.0, 0.0]], 4)

    for inputs in (
        np.array(GRID_3X3, dtype=np.int64),
        np.array(GRID_3X3, dtype=np.float32),
        torch.tensor(GRID_3X3, dtype=torch.float32, requires_grad=True),
    ):
        result = knn_geometry(inputs, np.zeros((1, 2)), 4)
        assert torch.equal(result[0], as_float64[0])
        assert torch.equal(result[1], as_float64[1])


def test_deterministic():
    sensor, strided = foveated_stack(resolution=24, levels=2)

    first = knn_geometry(sensor, strided, 9)
    second = knn_geometry(sensor.clone(), strided.clone(), 9)

    assert torch.equal(first[0], second[0])
    assert torch.equal(first[1], second[1])
    assert torch.equal(foveated_stack(resolution=24)[0], sensor)


@pytest.mark.parametrize(
    ("in_coords", "out_coords", "k", "ref_side", "name"),
    [
        ([0.0, 1.0], [[0.0, 0.0]], 1, None, "in_coords"),
        ([[0.0, 1.0, 2.0]], [[0.0, 0.0]], 1, None, "in_coords"),
        ([[[0.0, 1.0]]], [[0.0, 0.0]], 1, None, "in_coords"),
        (np.zeros((0, 2)), [[0.0, 0.0]], 1, None, "in_coords"),
        ([[0.0, math.nan]], [[0.0, 0.0]], 1, None, "in_coords"),
        ([[math.inf, 0.0]], [[0.0, 0.0]], 1, None, "in_coords"),
        ([["a", "b"]], [[0.0, 0.0]], 1, None, "in_coords"),
        ([[0.0, 0.0]], [0.0, 0.0], 1, None, "out_coords"),
        ([[0.0, 0.0]], [[0.0, 0.0, 0.0]], 1, None, "out_coords"),
        ([[0.0, 0.0]], np.zeros((0, 2)), 1, None, "out_coords"),
        ([[0.0, 0.0]], [[-math.inf, 0.0]], 1, None, "out_coords"),
        ([[0.0, 0.0]], [[0.0, 0.0]], 0, None, "k"),
        ([[0.0, 0.0]], [[0.0, 0.0]], -3, None, "k"),
        ([[0.0, 0.0]], [[0.0, 0.0]], 2.5, None, "k"),
        ([[0.0, 0.0]], [[0.0, 0.0]], True, None, "k"),
        ([[0.0, 0.0]], [[0.0, 0.0]], 1, 0, "ref_side"),
        ([[0.0, 0.0]], [[0.0, 0.0]], 1, 1.5, "ref_side"),
    ],
)
def test_knn_geometry_validation_names_the_argument(in_coords, out_coords, k, ref_side, name):
    # a count that is not an int is a TypeError, as everywhere in knnconv; a bad value or
    # coordinate table a ValueError
    wrong_type = any(isinstance(value, (bool, float)) for value in (k, ref_side))
    with pytest.raises(TypeError if wrong_type else ValueError, match=rf"^{name}\b"):
        knn_geometry(in_coords, out_coords, k, ref_side=ref_side)


def test_foveated_coords_single_ring_is_the_centre():
    assert foveated_coords(1).tolist() == [[0.0, 0.0]]


def test_foveated_coords_ring_structure():
    a, fov_radius, n_rings = 0.3, 2.0, 12
    points = foveated_coords(n_rings, a=a, fov_radius=fov_radius)
    radii = points.norm(dim=1)

    assert points.dtype == torch.float64
    assert points[0].tolist() == [0.0, 0.0]
    ring_radii, counts = torch.unique_consecutive(radii.round(decimals=9), return_counts=True)
    assert len(ring_radii) == n_rings
    assert ring_radii[-1].item() == pytest.approx(fov_radius)
    # Rings are equally spaced in log(r + a) ...
    warped = torch.log(ring_radii + a)
    dw = math.log((fov_radius + a) / a) / (n_rings - 1)
    torch.testing.assert_close(warped.diff(), torch.full((n_rings - 1,), dw, dtype=torch.float64))
    # ... and the spacing along each ring matches the radial spacing up to rounding.
    along_ring = 2 * math.pi * ring_radii[1:] / counts[1:]
    radial = (ring_radii[1:] + a) * dw
    assert ((along_ring / radial - 1).abs() < 0.5 / counts[1:] * 1.01 + 1e-9).all()
    # No two points coincide.
    assert torch.pdist(points).min() > 1e-6


def test_foveated_coords_alternate_rings_are_staggered():
    points = foveated_coords(6)
    radii = points.norm(dim=1)
    ring_radii = torch.unique_consecutive(radii.round(decimals=9))
    first_angles = []
    for radius in ring_radii[1:3]:
        ring = points[(radii.round(decimals=9) == radius)]
        first_angles.append(math.atan2(ring[0, 1].item(), ring[0, 0].item()))
        step = 2 * math.pi / len(ring)
        first_angles[-1] /= step

    assert first_angles == pytest.approx([0.5, 0.0], abs=1e-9)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"n_rings": 0}, "n_rings"),
        ({"n_rings": 2.0}, "n_rings"),
        ({"n_rings": 5, "a": 0.0}, "a"),
        ({"n_rings": 5, "a": math.nan}, "a"),
        ({"n_rings": 5, "a": "wide"}, "a"),
        ({"n_rings": 5, "fov_radius": -1.0}, "fov_radius"),
        ({"n_rings": 5, "fov_radius": math.inf}, "fov_radius"),
    ],
)
def test_foveated_coords_validation_names_the_argument(kwargs, name):
    wrong_type = isinstance(kwargs["n_rings"], float)
    with pytest.raises(TypeError if wrong_type else ValueError, match=rf"^{name}\b"):
        foveated_coords(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"resolution": 0}, "resolution"),
        ({"resolution": 64.5}, "resolution"),
        ({"levels": 0}, "levels"),
        ({"a": -0.5}, "a"),
    ],
)
def test_foveated_stack_validation_names_the_argument(kwargs, name):
    wrong_type = isinstance(kwargs.get("resolution"), float)
    with pytest.raises(TypeError if wrong_type else ValueError, match=rf"^{name}\b"):
        foveated_stack(**kwargs)


def test_foveated_stack_sizes_follow_published_layers():
    stack = foveated_stack()
    sizes = [len(points) for points in stack]

    assert len(stack) == 5
    assert 3200 <= sizes[0] <= 4100
    for size, published in zip(sizes, [4085, 964, 230, 60, 16], strict=True):
        assert published / 1.5 <= size <= published * 1.5
    for finer, coarser in zip(sizes[:-1], sizes[1:], strict=True):
        assert 3.0 <= finer / coarser <= 5.0
    for points in stack:
        assert points.dtype == torch.float64
        assert points.shape[1] == 2
        assert points.norm(dim=1).max().item() == pytest.approx(1.0)


def test_foveated_stack_sensor_count_tracks_resolution():
    for resolution in (16, 48, 100):
        sensor_points = len(foveated_stack(resolution=resolution, levels=1)[0])
        target = math.pi / 4 * resolution**2
        assert target <= sensor_points <= 1.3 * target


def test_sensor_is_denser_at_the_centre_than_the_periphery():
    radii = foveated_stack()[0].norm(dim=1)
    centre_area = math.pi * 0.25**2
    inner, outer = 0.75, math.sqrt(0.75**2 + 0.25**2)  # annulus with the centre's area
    assert math.pi * (outer**2 - inner**2) == pytest.approx(centre_area)

    centre_count = (radii < 0.25).sum().item()
    annulus_count = ((radii >= inner) & (radii < outer)).sum().item()

    assert centre_count > 2 * annulus_count > 0


@pytest.mark.parametrize("resolution", [1, 2, 3, 5, 8, 13])
def test_foveated_stack_levels_never_grow_even_for_tiny_sensors(resolution):
    sizes = [len(points) for points in foveated_stack(resolution, levels=4)]
    assert sizes[0] >= math.pi / 4 * resolution**2
    assert all(later <= earlier for earlier, later in zip(sizes, sizes[1:], strict=False))
    if resolution == 1:
        assert sizes == [1, 1, 1, 1]


def test_more_neighbours_than_inputs_warns_and_pads():
    inputs = torch.rand(3, 2, dtype=torch.float64)
    outputs = torch.rand(2, 2, dtype=torch.float64)
    with pytest.warns(UserWarning, match="k=5 is more than the 3 input points"):
        knn, _, _ = knn_geometry(inputs, outputs, 5)
    assert (knn[3:] == 3).all()
