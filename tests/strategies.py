"""Random layer calls for property tests and the GPU fuzzer (scripts/fuzz_gpu.py).

A :class:`LayerCase` is a handful of sizes, flags and a seed: every table and tensor of the
call is drawn from them, so a case is reproducible from its JSON alone. :func:`layer_cases`
is the hypothesis strategy over them; :func:`outside_tolerance` runs one case through a
backend and returns the outputs that disagree with the float64 reference backend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from hypothesis import strategies as st

from knnconv import get_ops, knn_conv, make_plan

# Relative error allowed per compute dtype; float16's is the same multiple (about 15) of its
# unit roundoff as bfloat16's.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 8e-3,
             torch.bfloat16: 3e-2}


@dataclasses.dataclass(frozen=True)
class LayerCase:
    """One knn_conv call with its backward: sizes, table shape knobs, dtype and a seed."""

    nin: int
    nout: int
    k: int
    v: int
    cin: int
    cout: int
    batch: int
    padding: float  # fraction of table entries replaced by the padding neighbour Nin
    repeats: bool  # neighbours drawn with replacement: a node may read one input twice
    bias: bool
    dtype: str  # a torch dtype name, e.g. "bfloat16"
    seed: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """knn [K, Nout] and rf [Nout, K]. A node has at most Nin real neighbours (slots past
        Nin are padding); bins are drawn with replacement, so cells collide."""
        generator = torch.Generator().manual_seed(self.seed)
        real = min(self.k, self.nin)
        if self.repeats:
            neighbours = torch.randint(0, self.nin, (self.nout, real), generator=generator)
        else:
            order = torch.rand(self.nout, self.nin, generator=generator).argsort(dim=1)
            neighbours = order[:, :real]
        knn = torch.full((self.k, self.nout), self.nin, dtype=torch.int64)
        knn[:real] = neighbours.t()
        padded = torch.randperm(self.k * self.nout, generator=generator)
        knn.view(-1)[padded[: round(self.padding * self.k * self.nout)]] = self.nin
        rf = torch.randint(0, self.v, (self.nout, self.k), generator=generator)
        return knn, rf

    def plan(self):
        knn, rf = self.tables()
        return make_plan(knn, rf, nin=self.nin, v=self.v, cin=self.cin, cout=self.cout)

    def inputs(self, device: torch.device | str = "cpu"):
        """x [B, Cin, Nin], weight [Cout, Cin*V], bias [Cout] or None and grad_y [B, Cout, Nout]
        in the case's dtype: standard normals rounded from float64."""
        generator = torch.Generator().manual_seed(self.seed + 1)

        def normal(*shape):
            values = torch.randn(*shape, generator=generator, dtype=torch.float64)
            return values.to(device=device, dtype=self.torch_dtype)

        return (normal(self.batch, self.cin, self.nin), normal(self.cout, self.cin * self.v),
                normal(self.cout) if self.bias else None,
                normal(self.batch, self.cout, self.nout))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layer_cases(dtypes: Sequence[torch.dtype]) -> st.SearchStrategy[LayerCase]:
    """Cases over the sizes knnconv must serve, shrinking towards the smallest layer."""
    return st.builds(
        LayerCase,
        nin=st.integers(1, 60), nout=st.integers(1, 40), k=st.integers(1, 12),
        v=st.integers(1, 30), cin=st.integers(1, 9), cout=st.integers(1, 70),
        batch=st.integers(0, 20),
        padding=st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0)),
        repeats=st.booleans(), bias=st.booleans(),
        dtype=st.sampled_from([dtype_name(d) for d in dtypes]),
        seed=st.integers(0, 2**32 - 1),
    )


def _reference_outputs(plan, x, weight, bias, grad_y) -> dict[str, torch.Tensor]:
    ops = get_ops("reference")
    grad_x, grad_weight = ops.backward_combined(plan, grad_y, x, weight)
    outputs = {"y": ops.forward(plan, x, weight, bias), "grad_x": grad_x,
               "grad_weight": grad_weight}
    if bias is not None:
        outputs["grad_bias"] = grad_y.sum(dim=(0, 2))
    return outputs


def _error(actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor) -> float:
    """||actual - expected|| over the norm of the sum of |terms| (the reference run on absolute
    values): relative error, but cancellation in a short sum cannot inflate it."""
    scale = magnitude.norm().item()
    error = (actual.double() - expected).norm().item()
    return error / scale if scale > 0 else error


def outside_tolerance(case: LayerCase, backend: str,
                      device: torch.device | str = "cpu") -> dict[str, float]:
    """The outputs (y and the gradients) of ``backend`` whose error against the float64
    reference exceeds the case dtype's tolerance, with their errors (NaN never passes).

    Raises AssertionError when an output has the wrong shape or dtype.
    """
    plan = case.plan()
    x, weight, bias, grad_y = case.inputs(device)
    leaves = [None if t is None else t.clone().requires_grad_() for t in (x, weight, bias)]
    y = knn_conv(*leaves, plan, backend=backend)
    y.backward(grad_y)
    actual = {"y": y, "grad_x": leaves[0].grad, "grad_weight": leaves[1].grad}
    if bias is not None:
        actual["grad_bias"] = leaves[2].grad
    operands = [None if t is None else t.double() for t in (x, weight, bias, grad_y)]
    expected = _reference_outputs(plan, *operands)
    magnitude = _reference_outputs(plan, *(None if t is None else t.abs() for t in operands))
    tolerance = TOLERANCE[case.torch_dtype]
    errors = {}
    for name, value in actual.items():
        if value.shape != expected[name].shape or value.dtype != case.torch_dtype:
            raise AssertionError(f"{name}: got {value.dtype} {tuple(value.shape)}, expected "
                                 f"{case.torch_dtype} {tuple(expected[name].shape)}")
        error = _error(value, expected[name], magnitude[name])
        if not error <= tolerance:
            errors[name] = error
    return errors


# Gradient scales a training run meets: unscaled fp16 losses give |grad_y| near 1e-7, a
# GradScaler's early scales reach 1e4 and beyond.
GRAD_SCALES = (1e-8, 1e-6, 1e-4, 1e-2, 1.0, 1e2, 1e4)


def rounding_allowance(dtype: torch.dtype) -> float:
    """Max-norm relative error allowed in an output of ``dtype``: four unit roundoffs
    (2e-3 for float16), and at least what float32 accumulation costs."""
    return max(4 * torch.finfo(dtype).eps / 2, 1e-5)


def magnitude_outputs(case: LayerCase, backend: str, grad_scale: float,
                      device: torch.device | str = "cpu", x_dtype: torch.dtype | None = None
                      ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A layer call as a network makes it: float32 weight and bias under autocast to the
    case's (half) dtype, x in ``x_dtype`` (the case's dtype if None, as a layer's input is
    inside a network; float32 as the image entering the first layer is), grad_y standard
    normals times ``grad_scale`` rounded to the case's dtype. Returns each output (y and the
    gradients) with float64 computed on the same rounded operands."""
    plan = case.plan()
    dtype = case.torch_dtype
    generator = torch.Generator().manual_seed(case.seed + 2)
    x = torch.randn(case.batch, case.cin, case.nin, generator=generator).to(x_dtype or dtype)
    weight = torch.randn(case.cout, plan.q, generator=generator) / max(plan.p, 1) ** 0.5
    bias = torch.randn(case.cout, generator=generator) if case.bias else None
    grad_y = (torch.randn(case.batch, case.cout, case.nout, generator=generator,
                          dtype=torch.float64) * grad_scale).to(dtype)
    leaves = [None if t is None else t.to(device).clone().requires_grad_()
              for t in (x, weight, bias)]
    with torch.autocast(torch.device(device).type, dtype=dtype):
        y = knn_conv(*leaves, plan, backend=backend)
    y.backward(grad_y.to(device))
    # the operands as the backend saw them: autocast rounds x and the weight to dtype, and
    # the backends add a float32 bias unrounded
    rounded = [x.to(dtype).double(), weight.to(dtype).double(),
               None if bias is None else bias.double()]
    rounded = [None if t is None else t.requires_grad_() for t in rounded]
    expected_y = knn_conv(*rounded, plan, backend="reference")
    expected_y.backward(grad_y.double())
    outputs = {"y": (y, expected_y)}
    for name, leaf, reference in zip(("grad_x", "grad_weight", "grad_bias"), leaves, rounded,
                                     strict=True):
        if leaf is not None:
            outputs[name] = (leaf.grad, reference.grad)
    return outputs


def neighbourhood_outputs(layer: str, backend: str, dtype: torch.dtype, grad_scale: float,
                          device: torch.device | str = "cpu"
                          ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """KNNPool (``layer``: max, avg or sum) or KNNDepthwiseConv ("depthwise") on ``backend``:
    x in ``dtype``, float32 parameters under autocast; each output with the same layer's
    float64 result on the same operands."""
    from knnconv import KNNDepthwiseConv, KNNPool

    generator = torch.Generator().manual_seed(11)
    inputs, outputs = torch.rand(80, 2, generator=generator), torch.rand(30, 2, generator=generator)
    channels = 12

    def build(on: str):
        torch.manual_seed(0)  # the same depthwise weights for both
        if layer == "depthwise":
            return KNNDepthwiseConv.from_coords(channels, inputs, outputs, 9, backend=on)
        return KNNPool.from_coords(inputs, outputs, 9, mode=layer, backend=on)

    module, reference = build(backend), build("torch_compact").double()
    x = torch.randn(4, channels, 80, generator=generator).to(dtype)
    grad_y = (torch.randn(4, channels, 30, generator=generator, dtype=torch.float64)
              * grad_scale).to(dtype)
    leaf64 = x.double().requires_grad_()
    y64 = reference(leaf64)
    y64.backward(grad_y.double())
    module.to(device)
    leaf = x.to(device).clone().requires_grad_()
    with torch.autocast(torch.device(device).type, dtype=dtype):
        y = module(leaf)
    y.backward(grad_y.to(device))
    pairs = {"y": (y, y64), "grad_x": (leaf.grad, leaf64.grad)}
    if layer == "depthwise":
        pairs["grad_weight"] = (module.weight.grad, reference.weight.grad)
    return pairs


def failures(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """The outputs of ``pairs`` outside :func:`max_error_beyond_rounding`, with their errors."""
    errors = {name: max_error_beyond_rounding(value, reference)
              for name, (value, reference) in pairs.items()}
    return {name: error for name, error in errors.items() if error is not None}


def magnitude_failures(case: LayerCase, backend: str, grad_scale: float,
                       device: torch.device | str = "cpu") -> dict[str, float]:
    """The outputs of :func:`magnitude_outputs` whose error exceeds the rounding of their
    dtype."""
    return failures(magnitude_outputs(case, backend, grad_scale, device))


def max_error_beyond_rounding(value: torch.Tensor, reference: torch.Tensor) -> float | None:
    """None when ``value`` is within :func:`rounding_allowance` of its dtype of the float64
    ``reference`` (max-norm, relative to max|reference|, plus the dtype's smallest subnormal:
    an output in the subnormal range cannot round closer), and equals inf wherever the
    reference lies beyond the dtype's range; else that relative error (inf for a wrong
    overflow)."""
    if reference.numel() == 0:
        return None
    dtype_info = torch.finfo(value.dtype)
    allowance = rounding_allowance(value.dtype)
    rounded = reference.detach().to(value.dtype).cpu()
    beyond = torch.isinf(rounded)
    value, reference = value.detach().cpu(), reference.detach().cpu()
    if not torch.equal(value[beyond], rounded[beyond]):
        return float("inf")
    value, reference = value[~beyond].double(), reference[~beyond]
    if reference.numel() == 0:
        return None
    scale = reference.abs().max().item()
    error = (value - reference).abs().max().item()
    subnormal = dtype_info.smallest_normal * dtype_info.eps
    if error <= allowance * scale + subnormal:
        return None
    return error / scale if scale > 0 else error
