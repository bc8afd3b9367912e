"""Shared helpers: seeded random geometries, random inputs, an independent oracle, rel_err."""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass

import pytest
import torch

# Without a GPU, the triton backend's kernels run in Triton's CPU interpreter (read when the
# kernels are defined, so before knnconv is imported): tests/ops/triton checks them there.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from knnconv import KNNConvPlan, available_backends, context, get_ops, make_plan
from knnconv.ops import TorchCompactOps


@dataclass(frozen=True)
class Geometry:
    """Raw tables of one layer geometry, before any package code has looked at them."""

    knn_indices: torch.Tensor  # int64 [K, Nout], Nin marks padding
    rf_index: torch.Tensor  # int64 [Nout, K]
    nin: int
    v: int

    @property
    def k(self) -> int:
        return self.knn_indices.shape[0]

    @property
    def nout(self) -> int:
        return self.knn_indices.shape[1]

    def plan(self, cin: int, cout: int) -> KNNConvPlan:
        return make_plan(self.knn_indices, self.rf_index, nin=self.nin, v=self.v, cin=cin,
                         cout=cout)


def random_geometry(generator: torch.Generator, *, nin: int = 13, nout: int = 7, k: int = 4,
                    v: int | None = None, padding: float = 0.0,
                    collisions: bool = False) -> Geometry:
    """A random geometry with distinct real neighbours per node, like a true KNN table.

    ``padding``: the exact fraction of table entries replaced by the padding neighbour (and
    all slots past Nin when k > nin). ``collisions``: draw bins with replacement from at most
    two cells and force slots 0 and 1 of every node into one cell; otherwise every node's
    neighbours land in distinct cells, which needs ``v >= k``. ``v`` defaults to ``k``.
    """
    v = k if v is None else v
    real = min(k, nin)
    order = torch.rand(nout, nin, generator=generator).argsort(dim=1)
    knn = torch.full((k, nout), nin, dtype=torch.int64)
    knn[:real] = order[:, :real].t()
    padded = torch.randperm(k * nout, generator=generator)[: round(padding * k * nout)]
    knn.view(-1)[padded] = nin
    if collisions:
        rf = torch.randint(0, min(2, v), (nout, k), generator=generator)
        if k >= 2:
            rf[:, 1] = rf[:, 0]
    else:
        if v < k:
            raise ValueError("distinct cells per node need v >= k")
        rf = torch.rand(nout, v, generator=generator).argsort(dim=1)[:, :k]
    return Geometry(knn, rf.contiguous(), nin, v)


EDGE_GEOMETRIES = {
    "plain": {},
    "padding": {"padding": 0.3},
    "mostly_padding": {"padding": 0.8},
    "collisions": {"collisions": True, "padding": 0.1},
    "v_gt_k": {"k": 4, "v": 25},
    "k1": {"k": 1},
    "nout1": {"nout": 1, "k": 5},
    "k_gt_nin": {"nin": 3, "k": 6, "v": 9},
}


def with_all_padding_node(geometry: Geometry) -> torch.Tensor:
    """The geometry's table with its last node's neighbours all replaced by padding."""
    knn_indices = geometry.knn_indices.clone()
    knn_indices[:, -1] = geometry.nin
    return knn_indices


@pytest.fixture(autouse=True)
def _default_settings(monkeypatch):
    """Every test starts from knnconv's default settings whatever the user's environment sets
    (tests/ops/test_autotune.py turns autotuning on where it means to), and leaves them so."""
    for variable in context.ENVIRONMENT.values():
        monkeypatch.delenv(variable, raising=False)
    context.reset()
    yield
    context.reset()


@pytest.fixture
def rng(request) -> torch.Generator:
    """A generator seeded from the test id: reproducible per test, different across tests."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=list(EDGE_GEOMETRIES.values()), ids=list(EDGE_GEOMETRIES))
def edge_geometry(request, rng) -> Geometry:
    return random_geometry(rng, **request.param)


def random_inputs(generator: torch.Generator, plan: KNNConvPlan, batch: int, *,
                  dtype: torch.dtype = torch.float64, bias: bool = True):
    """x [B, Cin, Nin], weight [Cout, Cin*V], bias [Cout] or None, and a grad_y [B, Cout, Nout]."""
    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    return (normal(batch, plan.cin, plan.nin), normal(plan.cout, plan.q),
            normal(plan.cout) if bias else None, normal(batch, plan.cout, plan.nout))


def oracle_knn_conv(x, weight, bias, geometry: Geometry) -> torch.Tensor:
    """y[b, o, n] = bias[o] + sum_{c,k} x[b, c, knn[k, n]] * weight[o, c*V + rf[n, k]], in float64.

    Written from the formula with explicit loops over nodes and slots, independently of every
    backend; differentiable through autograd.
    """
    x, weight = x.double(), weight.double()
    batch, cin, nin = x.shape
    kernel = weight.reshape(weight.shape[0], cin, geometry.v)  # [Cout, Cin, V]
    columns = []
    for node in range(geometry.nout):
        column = x.new_zeros(batch, weight.shape[0])
        for slot in range(geometry.k):
            neighbour = int(geometry.knn_indices[slot, node])
            if neighbour == nin:
                continue
            cell = int(geometry.rf_index[node, slot])
            column = column + torch.einsum("bc,oc->bo", x[:, :, neighbour], kernel[:, :, cell])
        columns.append(column)
    y = torch.stack(columns, dim=2)
    return y if bias is None else y + bias.double()[None, :, None]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in float64, written apart from the library's own
    relative_error (which tests/test_bench.py checks on known values); NaN anywhere gives
    NaN, which fails every `< tolerance`."""
    actual, expected = actual.detach().double(), expected.detach().double()
    if torch.isnan(actual).any() or torch.isnan(expected).any():
        return float("nan")
    scale = expected.norm().item()
    error = (actual.cpu() - expected.cpu()).norm().item()
    return error / scale if scale > 0 else error


@dataclass
class KeptCopy:
    tensor: torch.Tensor


class CopyKeepingOps(TorchCompactOps):
    """torch_compact keeping its own copy of x from the forward for the backward (an object,
    with a tensor form under torch.compile), as the cuda backend keeps its re-layout of x; it
    records what each backward receives as x and which gradients it is asked for."""

    name = "copy_keeping"

    def __init__(self) -> None:
        super().__init__()
        self.received, self.needs = [], []

    def forward_saving(self, plan, x, weight, bias):
        return self.forward(plan, x, weight, bias), KeptCopy(x.clone())

    def saved_layout(self, plan, x, dtype):
        return (x.shape[0], plan.cin, plan.nin)

    def saved_tensor(self, saved_x):
        return saved_x.tensor

    def saved_input(self, saved, plan, batch):
        return KeptCopy(saved)

    def gradients(self, plan, grad_y, x, weight, needs, dtypes, *, dx_channels_last=False):
        self.received.append(x)
        self.needs.append(needs)
        x = x.tensor if isinstance(x, KeptCopy) else x
        return super().gradients(plan, grad_y, x, weight, needs, dtypes,
                                 dx_channels_last=dx_channels_last)


def _serves_cpu(name: str) -> bool:
    ops = get_ops(name)
    probe = random_geometry(torch.Generator().manual_seed(0)).plan(cin=1, cout=1)
    return ops.unsupported_reason(probe, torch.device("cpu"), torch.float64) is None


CPU_BACKENDS = [name for name in available_backends() if _serves_cpu(name)]


def all_outputs(ops, plan, x, weight, bias, grad_y):
    """Every primitive of ``ops``: forward, grad_input, grad_weight, backward_combined."""
    return {
        "forward": ops.forward(plan, x, weight, bias),
        "grad_input": ops.grad_input(plan, grad_y, weight),
        "grad_weight": ops.grad_weight(plan, grad_y, x),
        **dict(zip(("combined_grad_input", "combined_grad_weight"),
                   ops.backward_combined(plan, grad_y, x, weight), strict=True)),
    }


def assert_close_to_reference(actual, plan, inputs, tolerance):
    """Every output of all_outputs within ``tolerance`` of the reference's in float64."""
    operands = (t if t is None else t.double() for t in inputs)
    expected = all_outputs(get_ops("reference"), plan, *operands)
    for key, value in expected.items():
        assert actual[key].shape == value.shape, key
        error = rel_err(actual[key], value)
        assert error < tolerance, f"{key}: rel err {error:.2e} >= {tolerance:.0e}"
