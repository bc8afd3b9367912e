import pytest
import torch

from knnconv import KNNConv, KNNPool
from knnconv.geometry import foveated_stack
from knnconv.models import (
    FoveatedClassifier,
    KNNBasicBlock,
    foveated_alexnet,
    foveated_resnet18,
    sample_images,
)

# torchvision's resnet18(num_classes=10): 11,176,512 parameters before the classifier, plus
# 512 * 10 + 10. The KNN version matches it because k = 49 / 9 / 1 give 7x7 / 3x3 / 1x1 grids.
TORCHVISION_RESNET18_10_CLASSES = 11_181_642


def parameter_count(model):
    return sum(parameter.numel() for parameter in model.parameters())


def geometry_of(model):
    """(kind, nin, nout, k) of every KNN layer, in order."""
    rows = []
    for module in model.modules():
        if isinstance(module, KNNConv):
            rows.append(("conv", module.plan.nin, module.plan.nout, module.plan.k))
        elif isinstance(module, KNNPool):
            rows.append(("pool", module.nin, module.knn_indices.shape[1],
                         module.knn_indices.shape[0]))
    return rows


def test_sample_images_is_bilinear_with_row_zero_at_y_minus_one():
    height, width = 4, 6
    rows = torch.arange(height, dtype=torch.float64)[:, None].expand(height, width)
    columns = torch.arange(width, dtype=torch.float64)[None, :].expand(height, width)
    images = torch.stack([columns + 1, rows + 1])[None]  # [1, 2, H, W]: column, row, both +1
    # Pixel centres sit at -1 + (2i + 1) / side; points between them interpolate linearly.
    column_at = torch.tensor([0.0, 0.25, 2.5, 5.0], dtype=torch.float64)
    row_at = torch.tensor([0.0, 3.0, 1.75, 0.5], dtype=torch.float64)
    coords = torch.stack([-1 + (2 * column_at + 1) / width, -1 + (2 * row_at + 1) / height], 1)

    samples = sample_images(images, coords)

    assert samples.shape == (1, 2, 4)
    torch.testing.assert_close(samples[0, 0], column_at + 1)
    torch.testing.assert_close(samples[0, 1], row_at + 1)


def test_sample_images_clamps_to_the_edge_pixels():
    images = torch.ones(2, 1, 5, 5)

    samples = sample_images(images, torch.tensor([[-1.0, -1.0], [1.0, 0.0], [0.0, 1.0]]))

    assert torch.equal(samples, torch.ones(2, 1, 3))


@pytest.mark.parametrize(("images", "coords", "error", "message"), [
    (torch.ones(1, 4, 4), torch.zeros(3, 2), ValueError, "images must be 4-D"),
    (torch.ones(1, 1, 4, 4, dtype=torch.int64), torch.zeros(3, 2), TypeError, "images must"),
    (torch.ones(1, 1, 4, 4), torch.zeros(3, 3), ValueError, "coords must have shape"),
])
def test_sample_images_names_invalid_arguments(images, coords, error, message):
    with pytest.raises(error, match=message):
        sample_images(images, coords)


def test_alexnet_follows_fovi_layer_sizes():
    model = foveated_alexnet(10)

    assert geometry_of(model) == [
        ("conv", 3321, 846, 121), ("pool", 846, 244, 9), ("conv", 244, 244, 25),
        ("pool", 244, 67, 9), ("conv", 67, 67, 9), ("conv", 67, 67, 9), ("conv", 67, 67, 9),
        ("pool", 67, 14, 9),
    ]
    convs = [(3, 96, 121), (96, 256, 25), (256, 384, 9), (384, 384, 9), (384, 256, 9)]
    kernels = sum(cin * cout * k for cin, cout, k in convs)
    norms = 2 * sum(cout for _, cout, _ in convs)
    assert parameter_count(model) == kernels + norms + 256 * 10 + 10


def test_resnet18_has_torchvision_parameter_count_and_fovi_layer_sizes():
    model = foveated_resnet18(10)

    assert parameter_count(model) == TORCHVISION_RESNET18_10_CLASSES
    layers = geometry_of(model)
    assert layers[:2] == [("conv", 3321, 846, 49), ("pool", 846, 244, 9)]
    # The first conv of each stage after the first, and its k = 1 shortcut, go one level down.
    strided = [row for row in layers[2:] if row[1] != row[2]]
    assert strided == [("conv", 244, 67, 9), ("conv", 244, 67, 1), ("conv", 67, 14, 9),
                       ("conv", 67, 14, 1), ("conv", 14, 5, 9), ("conv", 14, 5, 1)]


@pytest.mark.parametrize("build", [foveated_alexnet, foveated_resnet18])
def test_forward_backward_on_sampled_images(build):
    torch.manual_seed(0)
    model = build(7, resolution=16)
    images = torch.rand(2, 3, 16, 16)

    logits = model(sample_images(images, model.sensor_coords))
    logits.sum().backward()

    assert logits.shape == (2, 7)
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
    model.eval()
    with torch.no_grad():
        assert model(sample_images(images, model.sensor_coords)).shape == (2, 7)


def test_sensor_coords_follow_the_model_but_stay_out_of_the_state_dict():
    model = foveated_alexnet(3, resolution=16)

    assert torch.equal(model.sensor_coords, foveated_stack(16, levels=1)[0].float())
    assert not any(key.startswith("sensor_coords") for key in model.state_dict())
    assert model.double().sensor_coords.dtype == torch.float64


def test_basic_block_shortcut_is_identity_only_on_the_same_layout_and_width():
    fine, coarse = foveated_stack(resolution=12, levels=2)

    same = KNNBasicBlock(8, 8, fine, fine.clone())
    wider = KNNBasicBlock(8, 16, fine, fine)
    strided = KNNBasicBlock(8, 8, fine, coarse)

    assert isinstance(same.shortcut, torch.nn.Identity)
    assert wider.shortcut[0].plan.k == 1 and wider.shortcut[0].plan.nout == len(fine)
    assert strided.shortcut[0].plan.nout == len(coarse)
    x = torch.randn(2, 8, len(fine))
    assert same(x).shape == (2, 8, len(fine))
    assert wider(x).shape == (2, 16, len(fine))
    assert strided(x).shape == (2, 8, len(coarse))
    assert (strided(x) >= 0).all()


def test_classifier_averages_over_the_last_layout():
    model = FoveatedClassifier(torch.nn.Identity(), 3, 2, torch.zeros(5, 2))
    x = torch.randn(4, 3, 5)

    expected = model.classifier(x.mean(dim=2))
    torch.testing.assert_close(model(x), expected)
