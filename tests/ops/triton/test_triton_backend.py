"""The triton backend (knnconv.ops.triton) without a GPU: its kernels in Triton's CPU
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where no GPU is seen), every output
against the float64 oracle at odd sizes, with padding, bin collisions and all-padding nodes,
outputs NaN-poisoned before the kernels run, also on layers of few input channels (image
stems: their own forward, dx and dW kernels); its tables, tiles and refusals.

The interpreter computes float16 dots correctly but not bfloat16 ones (Triton 3.9's interpreter
turns bfloat16 dot operands into garbage), so bfloat16 is checked on the GPU only
(tests/ops/triton/test_triton_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

import knnconv
from conftest import oracle_knn_conv, random_geometry, rel_err, with_all_padding_node
from knnconv.ops import get_ops
from knnconv.ops.triton import backend, configs

if backend.launch is None:
    pytest.skip(f"triton backend unavailable: {backend.MISSING}", allow_module_level=True)
if torch.cuda.is_available():
    pytest.skip("the GPU runs tests/ops/triton/test_triton_gpu.py", allow_module_level=True)

from knnconv.ops.triton import launch  # noqa: E402

TOLERANCE = 2e-3  # fp16 operands and outputs, fp32 accumulation
CPU = torch.device("cpu")

CASES = {  # name: (batch, cin, cout, geometry knobs)
    "b1_plain": (1, 16, 16, {}),
    "b17_padding": (17, 32, 48, {"padding": 0.3}),
    "b17_collisions": (17, 16, 80, {"collisions": True, "padding": 0.1}),
    "b3_v_gt_k": (3, 48, 16, {"k": 4, "v": 25}),
    "b5_nout1": (5, 16, 32, {"nout": 1, "k": 5}),
    "b2_mostly_padding": (2, 16, 16, {"padding": 0.8}),
}


def make_case(seed: int, batch: int, cin: int, cout: int, *, all_padding_node: bool = True,
              **knobs):
    generator = torch.Generator().manual_seed(seed)
    geometry = random_geometry(generator, **knobs)
    knn = with_all_padding_node(geometry) if all_padding_node else geometry.knn_indices
    geometry = type(geometry)(knn, geometry.rf_index, geometry.nin, geometry.v)
    plan = geometry.plan(cin, cout)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    return geometry, plan, (normal(batch, cin, plan.nin), normal(cout, plan.q), normal(cout),
                            normal(batch, cout, plan.nout))


def channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("name", list(CASES))
def test_every_output_against_float64_with_poisoned_outputs(name):
    batch, cin, cout, knobs = CASES[name]
    geometry, plan, (x, w, b, gy) = make_case(len(name), batch, cin, cout, **knobs)
    xh, wh, bh, gyh = (channels_last(x.half()), w.half(), b.half(), channels_last(gy.half()))
    tables = get_ops("triton").tables(plan, CPU)
    y = launch.forward(xh, wh, bh, tables, nout=plan.nout, v=plan.v,
                       tile=launch.forward_tile(batch, cin, cout, plan.nout), poison=True)
    dx = launch.grad_input(gyh, wh, tables, nin=plan.nin, v=plan.v,
                           tile=launch.grad_input_tile(batch, cin, cout, plan.nin),
                           dtype=torch.float16, poison=True)
    # three node shares by two batch-chunk groups into two sums: every window's turn is
    # walked, and the sums are added
    dw = launch.grad_weight(gyh, xh, tables, get_ops("triton").share_starts(plan, CPU, 3),
                            v=plan.v, tile=configs.TileConfig(16, 16, 16, 4, 2),
                            windows=launch.Windows(3, 2, 2), poison=True)

    x64, w64, b64 = (t.half().double().requires_grad_() for t in (x, w, b))
    y64 = oracle_knn_conv(x64, w64, b64, geometry)
    y64.backward(gy.half().double())
    # a layer whose only node is all padding reads no input: dx and dW are zeros
    grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in (x64, w64)]
    for label, got, want in (("y", y, y64), ("dx", dx, grads[0]), ("dw", dw, grads[1])):
        assert got.shape == want.shape, label
        assert rel_err(got, want) < TOLERANCE, label
    assert y.transpose(1, 2).is_contiguous() and dx.transpose(1, 2).is_contiguous()
    assert dw.dtype == torch.float32


@pytest.mark.parametrize("batch, channels, nout, storage, dtype", [
    (1, 1, 1, "contiguous", torch.float32),
    (17, 70, 9, "channels_last", torch.float16),
    (129, 16, 3, "contiguous", torch.float16),
    (5, 200, 31, "channels_last", torch.float32),
])
def test_the_bias_gradient_against_float64_in_many_partials(batch, channels, nout, storage,
                                                            dtype):
    generator = torch.Generator().manual_seed(batch + channels)
    grad_y = torch.randn(batch, channels, nout, generator=generator, dtype=torch.float64)
    # values near float16's largest: their sum overflows unless it is carried in float32
    grad_y[:, 0] = 6e4
    stored = grad_y.to(dtype)
    if storage == "channels_last":
        stored = channels_last(stored)
    tile = configs.TileConfig(16, 64, 16, 4, 1)  # several column tiles, rows in 16s
    got = launch.grad_bias(stored, tile=tile, processors=64, poison=True)
    want = stored.double().sum(dim=(0, 2))
    assert got.dtype == torch.float32 and got.shape == (channels,)
    assert rel_err(got, want) < 1e-6
    assert torch.equal(got, launch.grad_bias(stored, tile=tile, processors=64))


def test_the_bias_gradient_is_split_into_whole_row_blocks():
    # 129 * 31 rows are 250 blocks of 16 rows: 62 programs' worth of four blocks, rounded to
    # 50 programs of five blocks, the last one short; every row counted once
    grad_y = torch.ones(129, 16, 31, dtype=torch.float16)
    tile = configs.TileConfig(16, 16, 16, 4, 1)
    assert torch.equal(launch.grad_bias(grad_y, tile=tile, processors=132, poison=True),
                       torch.full((16,), 129.0 * 31))


STEM_CASES = {  # name: (batch, cin, cout, geometry knobs), the few-channel kernels
    "b17_cin3_padding": (17, 3, 64, {"nin": 40, "nout": 9, "k": 11, "v": 14, "padding": 0.2}),
    "b1_cin1_nout1": (1, 1, 16, {"nout": 1, "k": 5}),
    "b5_cin3_collisions": (5, 3, 48, {"nin": 30, "nout": 7, "k": 9, "v": 4,
                                      "collisions": True, "padding": 0.1}),
    "b3_cin5_v_gt_k": (3, 5, 16, {"k": 4, "v": 25}),
}


def plan_has_nodes(knobs: dict) -> bool:
    """Whether a case can spare a node to make all padding (a one-node layer cannot)."""
    return knobs.get("nout", 7) > 1


@pytest.mark.parametrize("name", list(STEM_CASES))
def test_few_channel_kernels_against_float64_with_poisoned_outputs(name):
    batch, cin, cout, knobs = STEM_CASES[name]
    geometry, plan, (x, w, b, gy) = make_case(len(name), batch, cin, cout,
                                              all_padding_node=plan_has_nodes(knobs), **knobs)
    gyh = channels_last(gy.half())
    tables = get_ops("triton").stem_tables(plan, CPU)
    # small tiles, so that several steps, row tiles and column tiles are walked
    y = launch.stem_forward(x.half(), w.half(), b.half(), tables, nin=plan.nin, nout=plan.nout,
                            v=plan.v, tile=configs.TileConfig(32, 16, 16, 4, 2), poison=True)
    dw = launch.stem_grad_weight(gyh, x.half(), tables, nin=plan.nin, v=plan.v,
                                 tile=configs.TileConfig(16, 16, 16, 4, 2), poison=True)
    # a workspace of one 16-row batch tile: the batch walked in chunks, the last one partial
    dx = launch.stem_grad_input(gyh, w.half(), tables, nin=plan.nin, v=plan.v,
                                tile=launch.stem_grad_input_tile(batch, cout), poison=True,
                                dtype=torch.float16,
                                workspace_bytes=4 * plan.nout * plan.k * cin * 16)
    x64, w64, b64 = (t.half().double().requires_grad_() for t in (x, w, b))
    y64 = oracle_knn_conv(x64, w64, b64, geometry)
    y64.backward(gy.half().double())
    dx64, dw64 = (torch.zeros_like(t) if t.grad is None else t.grad for t in (x64, w64))
    for label, got, want in (("y", y, y64), ("dx", dx, dx64), ("dw", dw, dw64)):
        assert got.shape == want.shape, label
        assert rel_err(got, want) < TOLERANCE, label
    assert y.transpose(1, 2).is_contiguous() and dw.dtype == torch.float32
    assert dx.dtype == torch.float16


def test_the_few_channel_gradients_are_bit_identical_from_run_to_run():
    _, plan, (x, w, _, gy) = make_case(3, 33, 3, 32, nin=50, nout=20, k=9, padding=0.2)
    tables = get_ops("triton").stem_tables(plan, CPU)
    gyh = channels_last(gy.half())
    runs = [(launch.stem_grad_weight(gyh, x.half(), tables, nin=plan.nin, v=plan.v,
                                     tile=configs.TileConfig(16, 16, 16, 4, 2)),
             launch.stem_grad_input(gyh, w.half(), tables, nin=plan.nin, v=plan.v,
                                    tile=launch.stem_grad_input_tile(33, 32),
                                    dtype=torch.float32))
            for _ in range(3)]
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(run, runs[0], strict=True))


def test_the_weight_gradient_is_the_same_however_the_pairs_are_windowed():
    # more shares than nodes leave some empty; 40 rows make three 16-row chunks
    _, plan, (x, w, _, gy) = make_case(7, 40, 16, 32, padding=0.2)
    xh, gyh = channels_last(x.half()), channels_last(gy.half())
    ops = get_ops("triton")
    tables = ops.tables(plan, CPU)
    tile = configs.TileConfig(16, 16, 16, 4, 2)
    results = [launch.grad_weight(gyh, xh, tables, ops.share_starts(plan, CPU, shares),
                                  v=plan.v, tile=tile,
                                  windows=launch.Windows(shares, groups, sums), poison=True)
               for shares, groups, sums in ((1, 1, 1), (2, 1, 1), (1, 3, 2), (5, 2, 1),
                                            (5, 2, 3), (9, 3, 27))]
    for other in results[1:]:
        assert rel_err(other, results[0]) < 1e-6


def test_share_starts_bound_each_cells_pairs_by_output_node():
    _, plan, _ = make_case(4, 1, 16, 16, nout=11, k=5, padding=0.3)
    ops = get_ops("triton")
    t = ops.tables(plan, CPU)
    starts = ops.share_starts(plan, CPU, 3)
    bounds = [0, 11 // 3, 22 // 3, 11]
    for cell in range(plan.v):
        nodes = [int(t.cell_gy[e]) // 16
                 for e in range(int(t.cell_start[cell]), int(t.cell_start[cell + 1]))]
        assert nodes == sorted(nodes)
        for share in range(3):
            first, end = int(starts[cell, share]), int(starts[cell, share + 1])
            expected = [n for n in nodes if bounds[share] <= n < bounds[share + 1]]
            assert [int(t.cell_gy[e]) // 16 for e in range(first, end)] == expected
    assert int(starts[-1, -1]) == plan.entry_count


@pytest.mark.parametrize("cin", [32, 3, 24], ids=["cin32", "stem_cin3_padded", "cin24_padded"])
@pytest.mark.parametrize("storage", ["channels_last", "contiguous"])
def test_training_through_knn_conv_in_either_storage(storage, cin):
    geometry, plan, (x, w, b, gy) = make_case(11 + cin, 17, cin, 16, padding=0.3)
    xh = x.half() if storage == "contiguous" else channels_last(x.half())
    xh.requires_grad_()
    wh, bh = w.half().requires_grad_(), b.float().requires_grad_()
    knnconv.get_ops("triton")._verified.clear()  # every kernel's first-use check runs
    y, ran = knnconv.knn_conv_with_backend(xh, wh, bh.half(), plan, "triton")
    y.backward(gy.half())
    assert ran == "triton"
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (xh, wh, bh.half()))
    y64 = oracle_knn_conv(x64, w64, b64, geometry)
    y64.backward(gy.half().double())
    assert rel_err(y, y64) < TOLERANCE
    assert rel_err(xh.grad, x64.grad) < TOLERANCE and rel_err(wh.grad, w64.grad) < TOLERANCE
    assert xh.grad.stride() == xh.stride(), "dx comes back in x's storage"


def test_tables_hold_every_real_entry_once_and_no_padding():
    generator = torch.Generator().manual_seed(3)
    geometry = random_geometry(generator, nin=11, nout=6, k=5, v=7, padding=0.3)
    plan = geometry.plan(16, 32)
    t = get_ops("triton").tables(plan, CPU)
    knn, rf = geometry.knn_indices, geometry.rf_index
    expected = sorted((int(knn[k, n]), n, int(rf[n, k])) for n in range(plan.nout)
                      for k in range(plan.k) if knn[k, n] != plan.nin)
    forward = sorted((int(t.entry_x[n, j]) // 16, n, int(t.entry_w[n, j]) // 16)
                     for n in range(plan.nout) for j in range(int(t.count[n])))
    by_input = sorted((m, int(t.pair_gy[e]) // 32, int(t.pair_w[e]) // 32)
                      for m in range(plan.nin)
                      for e in range(int(t.pair_start[m]), int(t.pair_start[m + 1])))
    by_cell = sorted((int(t.cell_x[e]) // 16, int(t.cell_gy[e]) // 32, v)
                     for v in range(plan.v)
                     for e in range(int(t.cell_start[v]), int(t.cell_start[v + 1])))
    assert forward == by_input == by_cell == expected
    assert int(t.pair_start[-1]) == int(t.cell_start[-1]) == plan.entry_count


def test_tiles_fit_the_layer():
    assert configs.tile_config("forward", batch=4, n=16, contracted_channels=48).block_k == 16
    assert configs.tile_config("forward", batch=4, n=16, contracted_channels=96).block_k == 32
    assert configs.tile_config("forward", batch=512, n=40, contracted_channels=64).block_n == 64
    assert configs.tile_config("grad_weight", batch=512, n=64, rows=16).block_m == 16
    # a layer of few nodes takes a smaller tile that gives the GPU enough programs
    wide = configs.tile_config("forward", batch=2048, n=256, nodes=500, contracted_channels=64)
    few = configs.tile_config("forward", batch=2048, n=256, nodes=4, contracted_channels=64)
    assert (wide.block_m, wide.block_n) == (128, 256)
    assert few.block_m * few.block_n < wide.block_m * wide.block_n
    # 384 columns take 128-wide tiles: a 256-wide one would leave a third of its columns empty
    for family in ("forward", "grad_input"):
        assert configs.tile_config(family, batch=2048, n=384, nodes=500,
                                   contracted_channels=64).block_n == 128
    # dW of 128 columns or more contracts 64 batch rows a step, of fewer, 128
    assert configs.tile_config("grad_weight", batch=2048, n=256, rows=96).block_k == 64
    assert configs.tile_config("grad_weight", batch=2048, n=64, rows=64).block_k == 128
    with pytest.raises(ValueError, match="multiple of 16"):
        configs.tile_config("forward", batch=4, n=16, contracted_channels=24)
    for family, rules in configs.rules().items():
        assert rules and not rules[-1][0], family


def test_bad_tiles_are_refused():
    with pytest.raises(ValueError, match="power of two"):
        configs.TileConfig(block_m=48, block_n=64, block_k=64, warps=4, stages=3)
    with pytest.raises(ValueError, match="warps"):
        configs.TileConfig(block_m=64, block_n=64, block_k=64, warps=2, stages=3)


def test_windows_keep_their_rows_within_the_l2_share_and_fill_the_processors():
    tile = configs.TileConfig(128, 256, 128, 8, 2)
    sizes = dict(batch=2048, cin=128, cout=256, nin=1469, nout=1469, v=100, entries=36_000,
                 processors=132)
    # a 128-row chunk of every row is 128 * 2 * 1469 * 384 bytes = 144.4 MB: 23 shares keep a
    # window within a fifth of 30 MiB (6.29 MB), one chunk a window
    # 368 windows would want 23 sums of chains of 16, but 32 MiB hold two of 12.5 MiB
    windows = launch.grad_weight_windows(tile, **sizes, l2_bytes=30 * 2**20)
    assert windows == launch.Windows(23, 16, 2)
    chunk_bytes = 128 * 2 * 1469 * (256 + 128)
    assert chunk_bytes / windows.shares <= 30 * 2**20 / launch.WINDOW_L2_FRACTION
    # a larger L2 takes fewer shares; without one, windows only fill the GPU
    assert launch.grad_weight_windows(tile, **sizes, l2_bytes=300 * 2**20).shares == 3
    assert launch.grad_weight_windows(tile, **sizes, l2_bytes=None) == launch.Windows(1, 11)
    small = configs.TileConfig(64, 64, 64, 4, 3)
    # 9 cells of one tile want 118 windows (8 programs per SM), 1000 pairs of one chunk give
    few = dict(batch=64, cin=64, cout=64, nin=900, nout=1000, v=9, entries=9 * 1000,
               processors=132, l2_bytes=None)
    # windows of at least 16 steps: 62, in four sums (chains of at most 16 windows)
    assert launch.grad_weight_windows(small, **few) == launch.Windows(62, 1, 4)
    assert launch.grad_weight_windows(small, **few, chain_links=64).sums == 1
    # 16 pairs a cell over 2 batch chunks: 32 steps, two windows of 16
    assert launch.grad_weight_windows(small, **{**few, "batch": 128, "entries": 9 * 16}
                                      ).count == 2


@pytest.mark.parametrize("dtype, cin, cout, match", [
    (torch.float32, 16, 16, "float16/bfloat16"),
    (torch.bfloat16, 16, 16, "bfloat16 on the GPU only"),
    (torch.float16, 16, 24, "a multiple of 16"),
    (torch.float16, 3, 8, "a multiple of 16"),
])
def test_calls_it_cannot_serve_are_refused_by_name(dtype, cin, cout, match):
    _, plan, (x, w, b, _) = make_case(1, 2, cin, cout)
    with pytest.raises(ValueError, match=match):
        knnconv.knn_conv(x.to(dtype), w.to(dtype), b.to(dtype), plan, backend="triton")


def test_input_channels_are_padded_to_whole_chunks_with_zeros():
    assert [launch.padded_channels(c) for c in (3, 16, 24, 32)] == [16, 16, 32, 32]
    assert [configs.few_channels(c) for c in (3, 15, 16, 24)] == [True, True, False, False]
    assert [launch.channel_slots(c) for c in (1, 3, 4, 5)] == [1, 4, 4, 8]
    x = torch.randn(2, 3, 5, dtype=torch.float16)
    padded = launch.with_padded_channels(x, 16)
    assert padded.shape == (2, 16, 5) and launch.boxable(padded)
    assert torch.equal(padded[:, :3], x) and not padded[:, 3:].any()
    w = torch.randn(4, 3 * 7)
    wide = launch.weight_with_padded_channels(w, 16, 7)
    assert wide.shape == (4, 16 * 7)
    assert torch.equal(wide[:, :21], w) and not wide[:, 21:].any()


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    _, plan, _ = make_case(1, 2, 16, 16)
    ops = get_ops("triton")
    assert ops.unsupported_reason(plan, CPU, torch.float16) is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert "needs CUDA tensors" in ops.unsupported_reason(plan, CPU, torch.float16)


def test_auto_never_takes_it_on_the_cpu():
    _, plan, (x, w, b, _) = make_case(1, 2, 16, 16)
    _, ran = knnconv.knn_conv_with_backend(x.half(), w.half(), b.half(), plan, "auto")
    assert ran != "triton"


@pytest.mark.parametrize("cin", [32, 3], ids=["cin32", "stem_cin3"])
def test_float32_parameters_under_autocast_train_as_their_float16_casts_do(cin):
    """The backend casts a float32 weight as it lays it out (TritonOps.casts_weight): y and dx
    are those of the weight cast beforehand, bit for bit, and dW comes back in float32."""
    geometry, plan, (x, w, b, gy) = make_case(5 + cin, 17, cin, 16, padding=0.3)
    xh, gyh = x.half(), gy.half()
    w32 = w.float().requires_grad_()
    results = {}
    for name, weight in (("float32 under autocast", w32), ("float16", w.float().half())):
        xi = xh.clone().requires_grad_()
        weight = weight.detach().requires_grad_()
        with torch.autocast("cpu", dtype=torch.float16, enabled=weight.dtype == torch.float32):
            y, ran = knnconv.knn_conv_with_backend(xi, weight, b.half(), plan, "triton")
        y.backward(gyh)
        assert ran == "triton" and y.dtype == torch.float16
        results[name] = (y, xi.grad, weight.grad)
    (y32, dx32, dw32), (y16, dx16, dw16) = results.values()
    assert torch.equal(y32, y16) and torch.equal(dx32, dx16)
    assert dw32.dtype == torch.float32
    assert torch.equal(dw32.half(), dw16)
