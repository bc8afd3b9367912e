"""The re-layouts' index arithmetic (x into xt, dx restored from its staging), run on a CPU
emulation of the transpose kernels: every address inside a registered tensor, no element
written twice."""

from __future__ import annotations

import math

import pytest
import torch

from knnconv.ops.cuda import gemm, launch, relayout
from knnconv.ops.cuda.launch_plan import MAX_GRID_YZ


class StubKernel:
    def __init__(self, name: str) -> None:
        self.name = name

    def allow_shared_memory(self, size: int) -> None:
        pass


class EmulatedDevice:
    """transpose_pad and transpose_pairs (knn_relayout.cu) run on CPU tensors by address:
    dst[z*dst_sz + c*dst_sc + a] = src[z*src_sz + a*src_sa + c*src_sc] for z < gridDim.z,
    a < dst_a, c < dst_c, zero past the source extents; and cudaMemsetAsync. Every address must
    lie in a registered tensor's storage, every write inside it, no element written twice."""

    def __init__(self) -> None:
        self.storages: list[torch.Tensor] = []
        self.launches: list[tuple[str, int]] = []  # (kernel or "memset", source address)

    def register(self, *tensors: torch.Tensor) -> None:
        for tensor in tensors:
            storage = tensor.untyped_storage()
            self.storages.append(torch.empty(0, dtype=tensor.dtype).set_(storage))

    def _element(self, address: int) -> tuple[torch.Tensor, int]:
        for flat in self.storages:
            start = flat.data_ptr()
            if start <= address < start + flat.numel() * flat.itemsize:
                offset, misalignment = divmod(address - start, flat.itemsize)
                assert misalignment == 0
                return flat, offset
        raise AssertionError(f"address {address:#x} is in no registered tensor")

    def launch(self, kernel, device_index, grid, block, shared, args) -> None:
        pairs = "transpose_pairs" in kernel.name
        if pairs:  # its source is contiguous along c
            src, dst, src_z, src_a, src_c, sz, sa, dst_a, dst_c, dsz, dsc, z_sums = args
            sc = 1
        else:
            src, dst, src_z, src_a, src_c, sz, sa, sc, dst_a, dst_c, dsz, dsc, z_sums, _ = args
        assert z_sums == 0
        self.launches.append((kernel.name, src))
        z, a, c = torch.meshgrid(torch.arange(grid[2]), torch.arange(dst_a),
                                 torch.arange(dst_c), indexing="ij")
        inside = (z < src_z) & (a < src_a) & (c < src_c)
        src_flat, src_at = self._element(src)
        read = (src_at + z * sz + a * sa + c * sc)[inside]
        assert read.min() >= 0 and read.max() < src_flat.numel(), "read past the source"
        values = torch.zeros(z.shape)
        values[inside] = src_flat[read].float()
        dst_flat, dst_at = self._element(dst)
        written = (dst_at + z * dsz + c * dsc + a).reshape(-1)
        assert written.min() >= 0 and written.max() < dst_flat.numel(), "wrote past the buffer"
        assert written.unique().numel() == written.numel(), "wrote an element twice"
        dst_flat[written] = values.reshape(-1).to(dst_flat.dtype)

    def zero(self, pointer: int, nbytes: int, device_index: int) -> None:
        flat, at = self._element(pointer)
        assert nbytes % flat.itemsize == 0 and at + nbytes // flat.itemsize <= flat.numel()
        self.launches.append(("memset", pointer))
        flat[at: at + nbytes // flat.itemsize] = 0


@pytest.fixture
def device(monkeypatch):
    emulated = EmulatedDevice()
    monkeypatch.setattr(launch, "get_kernel", lambda name, index, **target: StubKernel(name))
    monkeypatch.setattr(launch, "shared_memory_limit", lambda index: 227 * 1024)
    monkeypatch.setattr(launch, "multiprocessors", lambda index: 132)
    monkeypatch.setattr(launch, "capability", lambda index: (9, 0))
    monkeypatch.setattr(launch, "launch_kernel", emulated.launch)
    monkeypatch.setattr(relayout, "memset_zero", emulated.zero)
    transpose = launch.Transpose.__call__

    def registering_the_source(self, src, *args):  # a copy made on the way (x.contiguous())
        emulated.register(src)
        transpose(self, src, *args)

    monkeypatch.setattr(launch.Transpose, "__call__", registering_the_source)
    return emulated


def channels_last(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2).contiguous().transpose(1, 2)


MANY_NODES = MAX_GRID_YZ + 6  # more input nodes than a grid has CTA layers


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("storage", ["contiguous", "channels_last", "channels_last_batch_slice"])
@pytest.mark.parametrize("batch,cin,nin,bpad", [
    (17, 70, 9, 32), (1, 3, 40, 16), (129, 8, 5, 192), (64, 64, 3, 64), (3, 1, 40, 16),
    (5, 8, 1, 16), (3, 2, MANY_NODES, 16)])
def test_x_is_relaid_out_from_its_own_storage_with_padding_and_zero_row(
        device, dtype, storage, batch, cin, nin, bpad):
    x = torch.randn(batch + 2, cin, nin).to(dtype)
    x = {"contiguous": x[:batch], "channels_last": channels_last(x[:batch]),
         "channels_last_batch_slice": channels_last(x)[1: batch + 1]}[storage]
    layout = relayout.InputLayout(batch, cin, nin, bpad, dtype, dtype, 0)
    xt = torch.full(layout.shape, math.nan, dtype=dtype)
    device.register(x, xt)
    layout.write(x, xt.data_ptr())
    rows = cin * nin
    expected = torch.zeros(layout.shape, dtype=dtype)
    expected[:rows, :batch] = x.reshape(batch, rows).t()
    assert torch.equal(xt, expected)
    by_node = storage != "contiguous" and cin > 1 and 1 < nin <= MAX_GRID_YZ
    if by_node:  # one transpose reading x itself, and the zero row's memset
        (kernel, source), zeroed = device.launches
        assert kernel.startswith("knnconv::transpose") and source == x.data_ptr()
        assert zeroed == ("memset", xt.data_ptr() + rows * bpad * xt.itemsize)
    else:
        assert len(device.launches) == 1 and "memset" not in device.launches[0][0]


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("algorithm", ["gather", "scatter"])
@pytest.mark.parametrize("dx_channels_last", [False, True])
@pytest.mark.parametrize("batch,cin,nin", [
    (17, 3, 70), (1, 8, 5), (64, 40, 33), (17, 1, 70), (5, 8, 1), (3, 2, MANY_NODES)])
def test_dx_is_restored_from_its_staging_in_the_storage_asked_for(
        device, grad_dtype, algorithm, dx_channels_last, batch, cin, nin):
    backward = gemm.BackwardLaunch(
        batch=batch, cin=cin, nin=nin, cout=24, nout=7, q=cin * 9, p64=-(-cin * 9 // 64) * 64,
        dtype=torch.float16, device=torch.device("cuda", 0), need_weight=False,
        algorithm=algorithm, grad_dtypes=(grad_dtype, torch.float32, torch.float32),
        dx_channels_last=dx_channels_last)
    dx_values = torch.randn(batch, cin, nin).to(backward.staging_dtype)
    rows = cin * nin
    if algorithm == "gather":  # as the kernel stores it: [B, Nin, Cin]
        staging = dx_values.transpose(1, 2).contiguous()
    else:  # [Cin*Nin, bpad], batch fastest; the padding columns are never read
        staging = torch.full((rows, backward.bpad), math.nan)
        staging[:, :batch] = dx_values.reshape(batch, rows).t()
    dx = torch.empty_strided((batch, cin, nin), backward.dx_strides, dtype=grad_dtype)
    dx.fill_(math.nan)
    device.register(staging, dx)
    backward.restore_dx.launch_raw(staging.data_ptr(), dx.data_ptr(), backward.restore_dx_strides)
    assert len(device.launches) == 1
    assert torch.equal(dx, dx_values.to(grad_dtype))
    assert dx.transpose(1, 2).is_contiguous() if dx_channels_last else dx.is_contiguous()
    if dx_channels_last and cin > 1:
        assert dx.stride() == (rows, 1, cin)


@pytest.mark.parametrize("source_dtype", [torch.float32, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("layout", ["transposed", "by_cell", "by_cell_transposed"])
@pytest.mark.parametrize("cout,cin,v", [(24, 16, 9), (40, 8, 1), (64, 64, 36), (3, 5, 2)])
def test_the_weight_is_laid_out_cast_and_padded_from_any_dtype(device, source_dtype, layout,
                                                               cout, cin, v):
    """Each weight re-layout writes the documented layout in the compute dtype from a weight
    of any float dtype, zero past Cout (and Cin), reading the weight along its rows (its
    innermost source stride is the weight's column stride)."""
    weight = torch.randn(cout + 1, cin * v).to(source_dtype)[1:]  # not at the storage's start
    pad, cinpad = cout + 8, cin + 8
    build, shape, expected = {
        "transposed": (lambda: relayout.weight_transposed(cout, cin * v, pad, torch.float16, 0),
                       (cin * v, pad), lambda w: w.t()),
        "by_cell": (lambda: relayout.weight_by_cell(cout, cin, v, pad, cinpad, torch.float16, 0),
                    (v, pad, cinpad), lambda w: w.view(cout, cin, v).permute(2, 0, 1)),
        "by_cell_transposed": (
            lambda: relayout.weight_by_cell_transposed(cout, cin, v, pad, torch.float16, 0),
            (v, cin, pad), lambda w: w.view(cout, cin, v).permute(2, 1, 0)),
    }[layout]
    weight_layout = build()
    assert weight_layout.source_strides(*weight.stride())[2] == weight.stride(1)
    laid_out = torch.full(shape, math.nan, dtype=torch.float16)
    device.register(weight, laid_out)
    weight_layout(weight, laid_out.data_ptr())
    wanted = torch.zeros(shape, dtype=torch.float16)
    cells = expected(weight.to(torch.float16))
    wanted[tuple(slice(0, n) for n in cells.shape)] = cells
    assert torch.equal(laid_out, wanted)
