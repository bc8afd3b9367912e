"""Command-line helpers shared by the benchmarks: list and bounded-int option types, and the
device's name as an output file stem."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import Any

import torch


def default_name(device: torch.device) -> str:
    """'h200' for an NVIDIA H200, 'cpu' on the CPU: the GPU model as a file-name slug."""
    if device.type != "cuda":
        return "cpu"
    model = torch.cuda.get_device_name(device).lower().removeprefix("nvidia")
    return re.sub(r"[^a-z0-9]+", "-", model).strip("-") or "cuda"


def comma_list(convert: Callable[[str], Any], choices=None) -> Callable[[str], list]:
    def parse(text: str) -> list:
        items = [convert(item.strip()) for item in text.split(",") if item.strip()]
        bad = [item for item in items if choices is not None and item not in choices]
        if not items or bad:
            allowed = f" (choose from {', '.join(choices)})" if choices is not None else ""
            raise argparse.ArgumentTypeError(f"bad list {text!r}{allowed}")
        return items
    return parse


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int no smaller than ``minimum``."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse
