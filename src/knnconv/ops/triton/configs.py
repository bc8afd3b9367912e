"""Tile configurations of the ``triton`` backend, as data: the rules of tiles.json, and how a
rule's tile is fitted to a layer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

FAMILIES = ("forward", "grad_input", "grad_weight", "stem_forward", "stem_grad_weight",
            "stem_grad_input", "depthwise_forward", "depthwise_grad_input",
            "depthwise_grad_weight", "grad_bias")
CONDITIONS = ("max_batch", "min_batch", "min_n", "n_multiple_of", "min_programs")
MIN_BLOCK = 16  # the smallest dot extent Triton takes, and a 16-byte TMA box row of fp16
MAX_BLOCK = 256  # the largest extent of a TMA box


def few_channels(cin: int) -> bool:
    """Whether a layer of ``cin`` input channels runs the few-channel kernels
    (knnconv.ops.triton.stem_kernels): fewer than a contraction chunk."""
    return cin < MIN_BLOCK


@dataclass(frozen=True)
class TileConfig:
    """block_m: batch rows (grad_weight: input channels); block_n: output columns; block_k:
    the contraction chunk (channels, or batch rows for grad_weight); warps; pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < MIN_BLOCK or value > MAX_BLOCK or value & (value - 1):
                raise ValueError(f"{name} must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}], "
                                 f"got {value}")
        if self.warps not in (4, 8) or not 1 <= self.stages <= 8:
            raise ValueError(f"warps must be 4 or 8 and stages in [1, 8], got {self}")


@cache
def rules() -> dict[str, list[tuple[dict, TileConfig]]]:
    """tiles.json's rules per family, checked: (conditions, tile) in order."""
    table = json.loads((Path(__file__).parent / "tiles.json").read_text())
    parsed = {}
    for family in FAMILIES:
        parsed[family] = []
        for rule in table[family]:
            unknown = set(rule) - set(CONDITIONS) - {"config"}
            if unknown:
                raise ValueError(f"tiles.json {family}: unknown conditions {sorted(unknown)}")
            conditions = {key: rule[key] for key in CONDITIONS if key in rule}
            parsed[family].append((conditions, TileConfig(**rule["config"])))
        if parsed[family][-1][0]:
            raise ValueError(f"tiles.json {family}: the last rule must have no conditions")
    return parsed


def _power_of_two_at_least(value: int) -> int:
    return max(MIN_BLOCK, 1 << (value - 1).bit_length())


def chunk(contracted: int, largest: int) -> int:
    """The largest power of two in [16, largest] dividing ``contracted`` channels (a
    contraction chunk must not cross into the next node's channels); 0 if none does."""
    size = largest
    while size >= MIN_BLOCK:
        if contracted % size == 0:
            return size
        size //= 2
    return 0


def fit(config: TileConfig, n: int, contracted_channels: int | None,
         rows: int | None) -> TileConfig:
    """``config`` fitted to a layer: block_n capped at the column extent ``n``, block_k at a
    chunk of ``contracted_channels``, block_m at the input channels ``rows`` (grad_weight)."""
    block_n = min(config.block_n, _power_of_two_at_least(n))
    block_m, block_k = config.block_m, config.block_k
    if contracted_channels is not None:
        block_k = chunk(contracted_channels, block_k)
    if rows is not None:
        block_m = min(block_m, _power_of_two_at_least(rows))
    return TileConfig(block_m, block_n, block_k or MIN_BLOCK, config.warps, config.stages)


def tile_config(family: str, *, batch: int, n: int, nodes: int | None = None,
                contracted_channels: int | None = None, rows: int | None = None) -> TileConfig:
    """The tile of ``family`` for a call: the first rule that holds, its block_n capped at the
    column extent ``n``, its block_k at a chunk of ``contracted_channels`` (forward,
    grad_input), and for grad_weight its block_m at the input channels ``rows``. A rule's
    min_programs holds where its fitted tile's grid (``nodes`` x batch tiles x column tiles)
    has at least that many programs."""
    if contracted_channels is not None and not chunk(contracted_channels, MAX_BLOCK):
        raise ValueError(f"{family}: {contracted_channels} contracted channels are not a "
                         f"multiple of {MIN_BLOCK}")
    for conditions, config in rules()[family]:
        tile = fit(config, n, contracted_channels, rows)
        programs = None if nodes is None else (
            nodes * -(-batch // tile.block_m) * -(-n // tile.block_n))
        if (batch <= conditions.get("max_batch", batch)
                and batch >= conditions.get("min_batch", batch)
                and n >= conditions.get("min_n", n)
                and n % conditions.get("n_multiple_of", 1) == 0
                and (programs is None or programs >= conditions.get("min_programs", 0))):
            return tile
    raise AssertionError("the last rule has no conditions")
