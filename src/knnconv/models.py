"""Example foveated networks built from knnconv layers, and image-to-sensor sampling.

The networks take sensor samples x [B, 3, Nsensor] on the first layout of
``foveated_stack(resolution, a)`` (``model.sensor_coords``); :func:`sample_images` turns an
image batch into such samples. Layer sizes follow fovi's KNN AlexNet and ResNet-18: each
stride-2 step of the image networks becomes one step down the foveated stack (~4x fewer
points), and a 3x3 / 5x5 / 7x7 / 11x11 kernel becomes k = 9 / 25 / 49 / 121 neighbours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._checks import check_tensor
from .geometry import as_coords, foveated_stack
from .layers import KNNConv
from .pool import KNNPool


def sample_images(images: torch.Tensor, coords) -> torch.Tensor:
    """Bilinear samples [B, C, N] of images [B, C, H, W] at sensor points coords [N, 2].

    A point is (x, y) with x along the image width and y along its height (row 0 at y = -1),
    the orientation KNNConv's kernel cells and ``load_conv2d_weights`` use; [-1, 1] spans the
    images' outer pixel edges. Points on the edge take the edge pixels' values rather than
    fading into a zero border.
    """
    check_tensor("images", images)
    if images.dim() != 4:
        raise ValueError(f"images must be 4-D [B, C, H, W], got shape {tuple(images.shape)}")
    points = as_coords(coords, "coords").to(images)
    grid = points.view(1, 1, -1, 2).expand(images.shape[0], 1, -1, 2)
    samples = F.grid_sample(images, grid, mode="bilinear", padding_mode="border",
                            align_corners=False)
    return samples[:, :, 0, :]


def conv_norm_relu(in_channels: int, out_channels: int, in_coords, out_coords, k: int, *,
                   backend: str = "auto") -> nn.Sequential:
    """KNNConv (no bias: the BatchNorm after it has one), BatchNorm1d, ReLU."""
    return nn.Sequential(
        KNNConv.from_coords(in_channels, out_channels, in_coords, out_coords, k, bias=False,
                            backend=backend),
        nn.BatchNorm1d(out_channels),
        nn.ReLU(inplace=True),
    )


class FoveatedClassifier(nn.Module):
    """``features``, then the average over the nodes of its last layout, then a linear layer.

    ``sensor_coords`` [Nsensor, 2] is kept as a non-persistent buffer so that
    ``sample_images(images, model.sensor_coords)`` works on whatever device the model is on.
    """

    sensor_coords: torch.Tensor

    def __init__(self, features: nn.Module, feature_channels: int, num_classes: int,
                 sensor_coords) -> None:
        super().__init__()
        self.features = features
        self.classifier = nn.Linear(feature_channels, num_classes)
        self.register_buffer("sensor_coords", as_coords(sensor_coords, "sensor_coords").float(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).mean(dim=2))


class KNNBasicBlock(nn.Module):
    """ResNet basic block on KNN layouts: two k-neighbour convs with BatchNorm and a shortcut.

    The first conv maps in_coords to out_coords. When the layout or the channel count changes
    the shortcut is a k = 1 KNNConv (each output point takes its nearest input point) with
    BatchNorm, the analogue of ResNet's strided 1x1 downsample; otherwise it is the identity.
    """

    def __init__(self, in_channels: int, out_channels: int, in_coords, out_coords, *,
                 k: int = 9, backend: str = "auto") -> None:
        super().__init__()
        self.conv1 = KNNConv.from_coords(in_channels, out_channels, in_coords, out_coords, k,
                                         bias=False, backend=backend)
        self.norm1 = nn.BatchNorm1d(out_channels)
        self.conv2 = KNNConv.from_coords(out_channels, out_channels, out_coords, out_coords, k,
                                         bias=False, backend=backend)
        self.norm2 = nn.BatchNorm1d(out_channels)
        in_points = as_coords(in_coords, "in_coords")
        out_points = as_coords(out_coords, "out_coords")
        same_layout = in_points.shape == out_points.shape and torch.equal(in_points, out_points)
        if same_layout and in_channels == out_channels:
            self.shortcut = nn.Identity()
        else:
            self.shortcut = nn.Sequential(
                KNNConv.from_coords(in_channels, out_channels, in_points, out_points, 1,
                                    bias=False, backend=backend),
                nn.BatchNorm1d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


def foveated_alexnet(num_classes: int, resolution: int = 64, a: float = 0.5,
                     backend: str = "auto") -> FoveatedClassifier:
    """AlexNet-sized KNN network on a 5-level foveated stack (3321 -> 846 -> 244 -> 67 -> 14
    points with the defaults): five convs (k = 121, 25, 9, 9, 9; 96, 256, 384, 384, 256
    channels) with BatchNorm and ReLU, three k = 9 max-pools, global average, linear."""
    sensor, level1, level2, level3, level4 = foveated_stack(resolution, a, levels=5)
    features = nn.Sequential(
        conv_norm_relu(3, 96, sensor, level1, 121, backend=backend),
        KNNPool.from_coords(level1, level2, 9, mode="max"),
        conv_norm_relu(96, 256, level2, level2, 25, backend=backend),
        KNNPool.from_coords(level2, level3, 9, mode="max"),
        conv_norm_relu(256, 384, level3, level3, 9, backend=backend),
        conv_norm_relu(384, 384, level3, level3, 9, backend=backend),
        conv_norm_relu(384, 256, level3, level3, 9, backend=backend),
        KNNPool.from_coords(level3, level4, 9, mode="max"),
    )
    return FoveatedClassifier(features, 256, num_classes, sensor)


def foveated_resnet18(num_classes: int, resolution: int = 64, a: float = 0.5,
                      backend: str = "auto") -> FoveatedClassifier:
    """ResNet-18 on a 6-level foveated stack (3321 -> 846 -> 244 -> 67 -> 14 -> 5 points with
    the defaults): a k = 49 stem conv to level 1, a k = 9 max-pool to level 2, then four stages
    of two basic blocks (64, 128, 256, 512 channels, k = 9), each stage after the first
    starting one level coarser; global average, linear. Its parameter count equals
    torchvision's resnet18 with the same number of classes."""
    sensor, stem, pooled, *coarser = foveated_stack(resolution, a, levels=6)
    layers: list[nn.Module] = [
        conv_norm_relu(3, 64, sensor, stem, 49, backend=backend),
        KNNPool.from_coords(stem, pooled, 9, mode="max"),
    ]
    channels, coords = 64, pooled
    for width, stage_coords in zip((64, 128, 256, 512), (pooled, *coarser), strict=True):
        layers.append(KNNBasicBlock(channels, width, coords, stage_coords, backend=backend))
        layers.append(KNNBasicBlock(width, width, stage_coords, stage_coords, backend=backend))
        channels, coords = width, stage_coords
    return FoveatedClassifier(nn.Sequential(*layers), channels, num_classes, sensor)
