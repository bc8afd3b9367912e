"""``knnconv demo``: train a small foveated KNN network on scikit-learn's handwritten digits.

Each 8x8 digit is upsampled to a 32x32 image and read by a foveated sensor (the first layout
of ``foveated_stack(resolution=32)``, 846 points, dense at the centre); two KNN conv stages
with max-pooling, a global average and a linear layer classify it. The run shows a progress
bar, prints the loss and accuracies of every epoch, writes a PNG (the sensor's sampling
pattern, one digit as the sensor sees it, and the loss and accuracy curves) and ends with the
line ``test accuracy: 0.xxx``.

On a GPU the training runs under float16 autocast, where backend "auto" picks the native
kernels when they are installed. scikit-learn and matplotlib come with the ``demo`` extra,
as does tqdm, whose progress bar replaces the plain one printed here otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..geometry import foveated_stack
from ..models import FoveatedClassifier, conv_norm_relu, sample_images
from ..pool import KNNPool

DEFAULT_EPOCHS = 10
DEFAULT_BATCH_SIZE = 64
IMAGE_SIDE = 32
FOVEA_A = 0.5
TEST_FRACTION = 0.2
CLASSES = 10
# A stratified split needs at least one test digit per class.
MIN_DIGITS = round(CLASSES / TEST_FRACTION)
PEAK_LEARNING_RATE = 1e-2
SENSOR_TICKS = (-1.0, -0.5, 0.0, 0.5, 1.0)  # foveated_stack's sensor fills the unit disc


@dataclass
class SensorDigits:
    """The digits as the sensor reads them, and a stratified train/test split."""

    images: torch.Tensor  # [N, 1, IMAGE_SIDE, IMAGE_SIDE], intensities in [0, 1]
    samples: torch.Tensor  # [N, 1, Nsensor], standardised with the training set's statistics
    labels: torch.Tensor  # int64 [N]
    train: torch.Tensor  # int64 indices
    test: torch.Tensor  # int64 indices


@dataclass
class History:
    loss: list[float] = field(default_factory=list)
    train_accuracy: list[float] = field(default_factory=list)
    test_accuracy: list[float] = field(default_factory=list)


def require(module: str, package: str):
    """Import an optional dependency of the demo, or exit saying how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise SystemExit(f"knnconv demo needs {package}: pip install 'knnconv[demo]' "
                         f"({error})") from error


def load_sensor_digits(sensor: torch.Tensor, *, limit: int | None, seed: int) -> SensorDigits:
    """The first ``limit`` digits (all 1797 when None), upsampled and read by ``sensor``."""
    datasets = require("sklearn.datasets", "scikit-learn")
    model_selection = require("sklearn.model_selection", "scikit-learn")
    digits = datasets.load_digits()
    count = len(digits.target) if limit is None else min(limit, len(digits.target))
    raw = torch.tensor(digits.images[:count], dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(raw, size=(IMAGE_SIDE, IMAGE_SIDE), mode="bilinear",
                           align_corners=False)
    labels = torch.tensor(digits.target[:count], dtype=torch.int64)
    train, test = model_selection.train_test_split(
        torch.arange(count).numpy(), test_size=TEST_FRACTION, stratify=labels.numpy(),
        random_state=seed)
    train, test = torch.from_numpy(train), torch.from_numpy(test)
    samples = sample_images(images, sensor)
    mean, std = samples[train].mean(), samples[train].std()
    return SensorDigits(images, (samples - mean) / std, labels, train, test)


def digits_network(stack: list[torch.Tensor]) -> FoveatedClassifier:
    """846 -> 244 points (k = 25 conv, 32 channels), max-pool to 67, k = 9 conv (64 channels),
    max-pool to 14, global average, linear."""
    sensor, level1, level2, level3 = stack
    features = nn.Sequential(
        conv_norm_relu(1, 32, sensor, level1, 25),
        KNNPool.from_coords(level1, level2, 9, mode="max"),
        conv_norm_relu(32, 64, level2, level2, 9),
        KNNPool.from_coords(level2, level3, 9, mode="max"),
    )
    return FoveatedClassifier(features, 64, CLASSES, sensor)


class TextProgress:
    """A one-line progress bar on stderr, the stand-in for tqdm when it is not installed.

    It redraws only when the bar gains a percent or the status text changes, so a log that
    captures stderr stays short.
    """

    def __init__(self, total: int, desc: str, width: int = 30) -> None:
        self.total, self.desc, self.width = total, desc, width
        self.done, self.status, self.drawn_percent = 0, "", -1

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.done * 100 // self.total != self.drawn_percent:
            self.draw()

    def set_postfix_str(self, status: str) -> None:
        self.status = status
        self.draw()

    def draw(self) -> None:
        self.drawn_percent = self.done * 100 // self.total
        filled = self.done * self.width // self.total
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r{self.desc} [{bar}] {self.drawn_percent:3d}% {self.status}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


def progress_bar(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return TextProgress(total, desc)
    return tqdm(total=total, desc=desc, file=sys.stderr)


def accuracy(model: nn.Module, samples: torch.Tensor, labels: torch.Tensor, batch_size: int,
             amp: bool) -> float:
    model.eval()
    correct = 0
    with torch.no_grad(), torch.autocast(samples.device.type, dtype=torch.float16, enabled=amp):
        for batch in torch.arange(len(labels), device=samples.device).split(batch_size):
            correct += int((model(samples[batch]).argmax(dim=1) == labels[batch]).sum())
    return correct / len(labels)


def train(model: nn.Module, data: SensorDigits, *, epochs: int, batch_size: int, seed: int,
          device: torch.device) -> History:
    """Adam with a one-cycle learning-rate schedule; float16 autocast on a GPU."""
    amp = device.type == "cuda"
    samples, labels = data.samples.to(device), data.labels.to(device)
    train_index, test_index = data.train.to(device), data.test.to(device)
    optimizer = torch.optim.Adam(model.parameters())
    steps_per_epoch = -(-len(train_index) // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=PEAK_LEARNING_RATE,
                                                   total_steps=epochs * steps_per_epoch)
    scaler = torch.amp.GradScaler(device.type, enabled=amp)
    shuffle = torch.Generator().manual_seed(seed)
    history = History()
    bar = progress_bar(epochs * steps_per_epoch, "training")
    for epoch in range(epochs):
        model.train()
        loss_sum, correct = 0.0, 0
        order = train_index[torch.randperm(len(train_index), generator=shuffle).to(device)]
        for batch in order.split(batch_size):
            with torch.autocast(device.type, dtype=torch.float16, enabled=amp):
                logits = model(samples[batch])
                loss = F.cross_entropy(logits, labels[batch])
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            schedule.step()
            loss_sum += loss.item() * len(batch)
            correct += int((logits.argmax(dim=1) == labels[batch]).sum())
            bar.update(1)
        history.loss.append(loss_sum / len(train_index))
        history.train_accuracy.append(correct / len(train_index))
        history.test_accuracy.append(accuracy(model, samples[test_index], labels[test_index],
                                              batch_size, amp))
        bar.set_postfix_str(f"epoch {epoch + 1}/{epochs} loss {history.loss[-1]:.3f} "
                            f"test accuracy {history.test_accuracy[-1]:.3f}")
    bar.close()
    return history


def plot(path: Path, sensor: torch.Tensor, data: SensorDigits, shown: int,
         predicted: int, history: History) -> None:
    backend_agg = require("matplotlib.backends.backend_agg", "matplotlib")
    figure_module = require("matplotlib.figure", "matplotlib")
    figure = figure_module.Figure(figsize=(15, 4.6), layout="constrained")
    backend_agg.FigureCanvasAgg(figure)
    pattern, view, curves = figure.subplots(1, 3)
    x, y = sensor[:, 0].numpy(), sensor[:, 1].numpy()
    intensities = sample_images(data.images[shown:shown + 1], sensor)[0, 0].numpy()
    for axes in (pattern, view):
        axes.set_aspect("equal")
        # Ticks every 0.5 over the unit field of view: matplotlib's default 0.25 steps print
        # labels wider than their spacing at this panel size, and they run together.
        axes.set_xticks(SENSOR_TICKS)
        axes.set_yticks(SENSOR_TICKS)
        axes.invert_yaxis()  # y grows down the image rows, as sample_images reads them
        axes.set_xlabel("x")
        axes.set_ylabel("y")
    pattern.scatter(x, y, s=3, color="tab:blue")
    pattern.set_title(f"foveated sensor: {len(sensor)} points (a = {FOVEA_A})")
    view.set_facecolor("#d8dee6")  # so that the sensor's blank (white) points stay visible
    points = view.scatter(x, y, c=intensities, s=9, cmap="gray_r", vmin=0.0, vmax=1.0)
    figure.colorbar(points, ax=view, label="sampled intensity")
    view.set_title(f"a test digit through the sensor: label {int(data.labels[shown])}, "
                   f"predicted {predicted}")
    epochs = range(1, len(history.loss) + 1)
    curves.plot(epochs, history.loss, "o-", color="tab:red", label="training loss")
    curves.set_xlabel("epoch")
    curves.xaxis.get_major_locator().set_params(integer=True)  # no fractional epochs
    curves.set_ylabel("training loss")
    accuracy_axes = curves.twinx()
    accuracy_axes.plot(epochs, history.train_accuracy, "s-", color="tab:green",
                       label="train accuracy")
    accuracy_axes.plot(epochs, history.test_accuracy, "^-", color="tab:blue",
                       label="test accuracy")
    accuracy_axes.set_ylabel("accuracy")
    accuracy_axes.set_ylim(0.0, 1.02)
    lines = curves.get_lines() + accuracy_axes.get_lines()
    curves.legend(lines, [line.get_label() for line in lines], loc="center right")
    curves.set_title("training")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def run(args: argparse.Namespace, device: torch.device) -> int:
    """The demo, with the options of ``knnconv demo`` (see cli.py); returns the exit status."""
    torch.manual_seed(args.seed)
    stack = foveated_stack(IMAGE_SIDE, FOVEA_A, levels=4)
    sensor = stack[0]
    data = load_sensor_digits(sensor, limit=args.limit, seed=args.seed)
    print(f"knnconv demo: {len(data.train)} training and {len(data.test)} test digits, "
          f"{IMAGE_SIDE}x{IMAGE_SIDE} images read by a {len(sensor)}-point foveated sensor, "
          f"on {device}")
    model = digits_network(stack).to(device)
    history = train(model, data, epochs=args.epochs, batch_size=args.batch_size, seed=args.seed,
                    device=device)
    backend = model.features[0][0].last_backend  # before a float32 forward can change it
    for epoch, (loss, train_accuracy, test_accuracy) in enumerate(
            zip(history.loss, history.train_accuracy, history.test_accuracy, strict=True), 1):
        print(f"epoch {epoch:3d}: loss {loss:.4f}, train accuracy {train_accuracy:.3f}, "
              f"test accuracy {test_accuracy:.3f}")
    print(f"KNNConv backend: {backend}")
    shown = int(data.test[0])
    model.eval()
    with torch.no_grad():
        predicted = int(model(data.samples[shown:shown + 1].to(device)).argmax())
    plot(args.out, sensor.float(), data, shown, predicted, history)
    print(f"wrote {args.out}")
    print(f"test accuracy: {history.test_accuracy[-1]:.3f}")
    return 0
