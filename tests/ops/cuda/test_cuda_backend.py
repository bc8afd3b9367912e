"""The native CUDA backend on a GPU (marker: gpu): its entry points against the reference
computed in float64 from the same (rounded) inputs, with outputs NaN-poisoned before the
kernels run; and its behaviour under CUDA graphs, torch.compile, deterministic mode and the
first-use checks.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._dynamo.utils import counters

import knnconv
from conftest import EDGE_GEOMETRIES, random_geometry, rel_err
from knnconv.ops.cuda import configs

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
cupy = pytest.importorskip("cupy")

from knnconv.ops import cuda as knn_cuda  # noqa: E402

DTYPES = (torch.float16, torch.bfloat16)
FORWARD_TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
GRAD_TOLERANCE = 1e-3  # fp32 accumulation of exactly representable products
DEVICE = torch.device("cuda")


def make_case(seed, *, batch, cin, cout, dtype, **geometry_knobs):
    generator = torch.Generator().manual_seed(seed)
    geometry = random_geometry(generator, **geometry_knobs)
    plan = geometry.plan(cin=cin, cout=cout)

    def normal(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)

    x, weight, bias = normal(batch, cin, plan.nin), normal(cout, plan.q), normal(cout)
    grad_y = normal(batch, cout, plan.nout)
    return plan, x, weight, bias, grad_y


def reference(plan, x, weight, bias, grad_y):
    """y, dx, dW in float64 through the reference backend (itself checked against an oracle)."""
    ops = knnconv.get_ops("reference")
    x64, w64, b64, g64 = (t.double() for t in (x, weight, bias, grad_y))
    y = ops.forward(plan, x64, w64, b64)
    dx, dw = ops.backward_combined(plan, g64, x64, w64)
    return y, dx, dw


def check_all_entries(plan, x, weight, bias, grad_y, *, forward_cfg=None, input_cfg=None,
                      weight_cfg=None, ksplit=None, algorithm="gather"):
    tables = plan.on(DEVICE)
    il, wl = tables.input_linear, tables.weight_linear
    reverse = knn_cuda.reverse_tables(tables.knn_indices, tables.rf_index, plan.nin)
    y_ref, dx_ref, dw_ref = reference(plan, x, weight, bias, grad_y)
    y, saved = knn_cuda.forward(x, weight, bias, il, wl, forward_cfg, poison_output=True,
                                return_transposed=True)
    gather = algorithm == "gather"
    scatter_cfg = input_cfg if not gather else None
    gather_cfg = input_cfg if gather else None
    # Seed-style entries (dx scattered), then the reversed-graph gather.
    dx = knn_cuda.grad_input(grad_y, weight, il, wl, plan.cin, plan.nin, scatter_cfg)
    dw = knn_cuda.grad_weight(grad_y, x, il, wl, plan.q, weight_cfg, ksplit)
    dx2, dw2 = knn_cuda.backward_combined(grad_y, x, weight, il, wl, plan.cin, plan.nin, plan.q,
                                          gather_cfg, weight_cfg, ksplit, reverse=reverse)
    # The forward's re-laid-out input, and grad_y in the transposed layout y itself has.
    strided_grad = grad_y.transpose(1, 2).contiguous().transpose(1, 2)
    dx3, dw3 = knn_cuda.backward(strided_grad, saved, weight, il, wl, reverse, plan.cin, plan.nin,
                                 plan.q, input_algorithm=algorithm, input_config=input_cfg,
                                 weight_config=weight_cfg, ksplit=ksplit, poison_outputs=True)
    tol = FORWARD_TOLERANCE[x.dtype]
    assert y.shape == (x.shape[0], plan.cout, plan.nout) and y.dtype == x.dtype
    assert not torch.isnan(y).any(), "unwritten (poisoned) forward outputs"
    assert rel_err(y, y_ref) < tol
    assert torch.equal(saved.original(), x)
    for value, expected in ((dx, dx_ref), (dx2, dx_ref), (dx3, dx_ref), (dw, dw_ref),
                            (dw2, dw_ref), (dw3, dw_ref)):
        assert value.dtype == torch.float32
        assert torch.isfinite(value).all()
        assert rel_err(value, expected) < GRAD_TOLERANCE


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gathered_dx_staged_in_its_own_dtype_equals_rounded_float32_staging(dtype):
    # The training path stages a gathered dx in dx's dtype when it is the compute dtype; the
    # same fp32 accumulators are rounded once either way, so the two must agree bit for bit.
    from knnconv.ops.cuda.gemm import BackwardLaunch

    plan, x, weight, bias, grad_y = make_case(11, batch=17, cin=40, cout=65, dtype=dtype,
                                              nin=70, nout=31, k=9, padding=0.2)
    tables = plan.on(DEVICE)
    reverse = knn_cuda.reverse_tables(tables.knn_indices, tables.rf_index, plan.nin)
    dx = {}
    for grad_dtype in (torch.float32, dtype):
        launch = BackwardLaunch(batch=17, cin=plan.cin, nin=plan.nin, cout=plan.cout,
                                nout=plan.nout, q=plan.q, p64=plan.p64, dtype=dtype,
                                device=grad_y.device, need_weight=False, algorithm="gather",
                                grad_dtypes=(grad_dtype, torch.float32, torch.float32))
        assert launch.staging_dtype == grad_dtype
        dx[grad_dtype] = launch.run(grad_y, None, weight, tables.input_linear,
                                    tables.weight_linear, reverse)[0]
    assert dx[dtype].dtype == dtype
    assert torch.equal(dx[dtype], dx[torch.float32].to(dtype))
    assert rel_err(dx[torch.float32], reference(plan, x, weight, bias, grad_y)[1]) < GRAD_TOLERANCE


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("nodes_per_cta", (2, 3, 8))
def test_ctas_walking_several_nodes_match_reference(dtype, nodes_per_cta):
    # Nout = 37 leaves a ragged last CTA for every walk length; one slot tile per node.
    plan, x, weight, bias, grad_y = make_case(40 + nodes_per_cta, batch=33, cin=3, cout=65,
                                              dtype=dtype, nin=90, nout=37, k=9, padding=0.1)
    tables = plan.on(DEVICE)
    il, wl = tables.input_linear, tables.weight_linear
    y_ref, dx_ref, dw_ref = reference(plan, x, weight, bias, grad_y)
    y = knn_cuda.forward(x, weight, bias, il, wl, poison_output=True,
                         nodes_per_cta=nodes_per_cta)
    dx, _ = knn_cuda.backward(grad_y, x, weight, il, wl, None, plan.cin, plan.nin, plan.q,
                              need_weight=False, input_algorithm="scatter",
                              nodes_per_cta=nodes_per_cta)
    assert not torch.isnan(y).any(), "unwritten (poisoned) forward outputs"
    assert rel_err(y, y_ref) < FORWARD_TOLERANCE[dtype]
    assert rel_err(dx, dx_ref) < GRAD_TOLERANCE


SIZES = list(itertools.product((1, 15, 17, 129, 513), (1, 63, 65, 130)))
SLOT_COUNTS = ((3, 9), (20, 9), (64, 9), (7, 25))  # (Cin, K): P64 = 64, 192, 576, 192


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch,cout", SIZES)
def test_entries_match_reference_over_sizes(dtype, batch, cout):
    cin, k = SLOT_COUNTS[(batch + cout) % len(SLOT_COUNTS)]
    case = make_case(batch * 1000 + cout, batch=batch, cin=cin, cout=cout, dtype=dtype,
                     nin=40, nout=23, k=k, padding=0.15)
    check_all_entries(*case)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_few_node_layers_take_their_small_default_tiles_and_match_reference(dtype):
    # Nout 2, Nin 8: the large default tiles would launch 8 forward and 32 grad_input CTAs,
    # so both fall through to the last rules (tiles.json min_ctas), on the entry points and
    # through autograd (forward re-layout reused by the backward).
    case = make_case(2, batch=129, cin=130, cout=130, dtype=dtype, nin=8, nout=2, k=5,
                     padding=0.2)
    plan, x, weight, bias, grad_y = case
    forward_rules, input_rules = configs.tile_rules()["forward"], configs.tile_rules()["grad_input"]
    assert configs.default_config(129, 130, plan.p64, nout=2) == configs.KernelConfig(
        *forward_rules[-1]["config"])
    assert configs.default_grad_input_config(129, 130, nin=8) == configs.KernelConfig(
        *input_rules[-1]["config"])
    check_all_entries(*case)
    x64 = x.double().requires_grad_()
    w64, b64 = weight.double().requires_grad_(), bias.double().requires_grad_()
    knnconv.knn_conv(x64, w64, b64, plan, "reference").backward(grad_y.double())
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    y = knnconv.knn_conv(*leaves, plan, "cuda")
    y.backward(grad_y)
    for leaf, expected in zip(leaves, (x64, w64, b64), strict=True):
        assert rel_err(leaf.grad, expected.grad) < FORWARD_TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("knobs", list(EDGE_GEOMETRIES.values()), ids=list(EDGE_GEOMETRIES))
@pytest.mark.parametrize("batch", (1, 17, 129))
@pytest.mark.parametrize("algorithm", ("gather", "scatter"))
def test_entries_match_reference_on_edge_geometries(dtype, knobs, batch, algorithm):
    case = make_case(batch + len(str(knobs)), batch=batch, cin=5, cout=33, dtype=dtype, **knobs)
    check_all_entries(*case, algorithm=algorithm)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("algorithm", ("gather", "scatter"))
def test_entries_match_reference_where_relayouts_take_two_element_accesses(dtype, algorithm,
                                                                           monkeypatch):
    # Every size above has an odd batch, so no re-layout there meets transpose_pairs' even
    # strides; an even batch of 64 and 96 nodes takes it for x, grad_y and the scatter's dx.
    from knnconv.ops.cuda.launch import Transpose

    took_pairs, uses_pairs = [], Transpose.uses_pairs
    monkeypatch.setattr(Transpose, "uses_pairs", lambda self, *args: (
        took_pairs.append(uses_pairs(self, *args)) or took_pairs[-1]))
    case = make_case(64096, batch=64, cin=8, cout=34, dtype=dtype, nin=200, nout=96, k=9,
                     padding=0.2)
    check_all_entries(*case, algorithm=algorithm)
    assert any(took_pairs)


EXPLICIT = {
    "forward": [configs.KernelConfig(16, 32, 16, 2, 2, 1, 3, True, 8),
                configs.KernelConfig(32, 64, 64, 1, 2, 2, 2, False, 8)],
    "grad_input": [configs.KernelConfig(32, 32, 64, 1, 2, 2, 3, True, 8),
                   configs.KernelConfig(16, 16, 16, 1, 1, 1, 2, False, 8)],
    "grad_input_scatter": [configs.KernelConfig(32, 32, 64, 1, 2, 2, 3, True, 8),
                           configs.KernelConfig(16, 16, 16, 1, 1, 1, 2, False, 8)],
    "grad_weight": [configs.KernelConfig(32, 32, 64, 1, 2, 2, 3, True, 8),
                    configs.KernelConfig(16, 64, 16, 1, 1, 2, 2, False, 8)],
}


def every_config(family):
    rules = [configs.KernelConfig(*rule["config"]) for rule in configs.tile_rules()[family]]
    return rules + EXPLICIT[family]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("family", configs.FAMILIES)
def test_every_config_matches_reference(dtype, family):
    for index, cfg in enumerate(every_config(family)):
        # Cin*K = 384 slots: a multiple of every slot tile (64, 128, 192), so no config is
        # left out.
        case = make_case(index, batch=70, cin=12, cout=70, dtype=dtype, nin=50, nout=9, k=32,
                         padding=0.2, collisions=True, v=16)
        plan = case[0]
        if family in ("grad_weight", "grad_input_scatter"):
            slot_tile = cfg.tile_m if family == "grad_weight" else cfg.bn
            assert plan.p64 % slot_tile == 0, (cfg, plan.p64)
        chosen = {"forward": "forward_cfg", "grad_input": "input_cfg",
                  "grad_input_scatter": "input_cfg", "grad_weight": "weight_cfg"}[family]
        algorithm = "scatter" if family == "grad_input_scatter" else "gather"
        check_all_entries(*case, algorithm=algorithm, **{chosen: cfg})


def test_a_strided_expanded_or_other_dtype_bias_is_read_as_its_values():
    plan, x, weight, bias, _ = make_case(5, batch=20, cin=8, cout=24, dtype=torch.float16,
                                         nin=30, nout=12, k=9, padding=0.1)
    tables = plan.on(DEVICE)
    strided = torch.stack([bias, -bias], dim=1)[:, 0]  # stride 2
    expanded = bias[:1].expand(plan.cout)  # stride 0
    # neither dtype the kernel reads (converted to fp32), strided, expanded, strided fp32
    for odd_bias in (bias.double(), bias.bfloat16(), strided, expanded, strided.float()):
        y = knn_cuda.forward(x, weight, odd_bias, tables.input_linear, tables.weight_linear,
                             poison_output=True)
        expected = reference(plan, x, weight, odd_bias.to(x.dtype), x.new_zeros(
            x.shape[0], plan.cout, plan.nout))[0]
        assert rel_err(y, expected) < FORWARD_TOLERANCE[x.dtype]


def test_the_weight_gradient_refuses_an_x_it_would_misread():
    plan, x, _, _, grad_y = make_case(6, batch=20, cin=8, cout=24, dtype=torch.float16,
                                      nin=30, nout=12, k=9)
    tables = plan.on(DEVICE)
    with pytest.raises(TypeError, match="x has dtype"):
        knn_cuda.grad_weight(grad_y, x.float(), tables.input_linear, tables.weight_linear,
                             plan.q)
    with pytest.raises(ValueError, match="x has sizes"):
        knn_cuda.backward(grad_y, x[:10], None, tables.input_linear, tables.weight_linear,
                          None, plan.cin, plan.nin, plan.q, need_input=False)


@pytest.mark.parametrize("ksplit", (1, 2, 3))
def test_grad_weight_split_k_matches_reference(ksplit):
    check_all_entries(*make_case(ksplit, batch=200, cin=8, cout=64, dtype=torch.float16, nin=30,
                                 nout=5, k=9, padding=0.1), ksplit=ksplit)


@pytest.mark.parametrize("ksplit", (0, 64, 100))
def test_a_split_finer_than_the_batch_k_steps_is_refused(ksplit):
    plan, x, weight, bias, grad_y = make_case(4, batch=40, cin=8, cout=64, dtype=torch.float16,
                                              nin=30, nout=5, k=9)
    tables = plan.on(DEVICE)
    with pytest.raises(ValueError, match="cannot be honoured"):
        knn_cuda.grad_weight(grad_y, x, tables.input_linear, tables.weight_linear, plan.q,
                             ksplit=ksplit)


@pytest.mark.parametrize("broken", ["forward", "backward"])
def test_a_first_use_that_disagrees_with_the_oracle_raises(monkeypatch, broken):
    from knnconv.ops.cuda import CudaOps
    from knnconv.ops.cuda.gemm import BackwardLaunch, ForwardLaunch

    plan, x, weight, bias, grad_y = make_case(8, batch=20, cin=16, cout=24,
                                              dtype=torch.float16, nin=30, nout=12, k=9)
    launch_class = ForwardLaunch if broken == "forward" else BackwardLaunch
    run = launch_class.run

    def off_by_ten_percent(self, *args, **kwargs):
        result = run(self, *args, **kwargs)
        first = result[0] * 1.1
        return (first, *result[1:])

    monkeypatch.setattr(launch_class, "run", off_by_ten_percent)
    ops = CudaOps()  # nothing verified yet
    with pytest.raises(RuntimeError, match="first-use check"):
        if broken == "forward":
            ops.forward(plan, x, weight, bias)
        else:
            ops.gradients(plan, grad_y, x, weight, (True, True, False), (torch.float32,) * 3)


def test_gathered_grad_input_is_bitwise_repeatable_and_right():
    # the gather (reversed graph, no atomics) serves deterministic mode; the scatter path
    # accumulates with atomics and is not claimed to repeat bit for bit
    plan, x, weight, bias, grad_y = make_case(3, batch=64, cin=16, cout=40,
                                              dtype=torch.float16, nin=30, nout=30, k=9,
                                              padding=0.1)
    tables = plan.on(DEVICE)
    reverse = knn_cuda.reverse_tables(tables.knn_indices, tables.rf_index, plan.nin)
    runs = [knn_cuda.grad_input(grad_y, weight, tables.input_linear, tables.weight_linear,
                                plan.cin, plan.nin, reverse=reverse) for _ in range(3)]
    assert all(torch.equal(runs[0], run) for run in runs[1:])
    assert rel_err(runs[0], reference(plan, x, weight, bias, grad_y)[1]) < GRAD_TOLERANCE


def test_deterministic_mode_refuses_cuda_and_auto_gives_identical_gradients(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode
    plan, x, weight, bias, grad_y = make_case(4, batch=65, cin=16, cout=40, dtype=torch.float16,
                                              nin=50, nout=30, k=9, padding=0.1)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(ValueError, match="torch_compact"):
            knnconv.knn_conv(x, weight.clone().requires_grad_(), bias, plan, backend="cuda")
        # a forward that no backward follows has no atomics: cuda serves it, run after run
        with torch.no_grad():
            outputs = [knnconv.knn_conv_with_backend(x, weight, bias, plan, backend="auto")
                       for _ in range(2)]
        assert [ran for _, ran in outputs] == ["cuda", "cuda"]
        assert torch.equal(outputs[0][0], outputs[1][0])
        runs = []
        for _ in range(2):
            leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
            y, ran = knnconv.knn_conv_with_backend(*leaves, plan, backend="auto")
            y.backward(grad_y)
            runs.append([leaf.grad for leaf in leaves])
    finally:
        torch.use_deterministic_algorithms(previous)
    assert ran == "torch_compact"
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


@pytest.mark.parametrize("update", ["in_place", "through_data", "data_assignment"])
def test_weight_updates_are_seen(update):
    case = make_case(4, batch=20, cin=4, cout=24, dtype=torch.float16, nin=30, nout=12, k=9)
    plan, x, weight, bias, _ = case
    conv = knnconv.KNNConv(4, 24, plan.knn_indices, plan.rf_index, nin=plan.nin, v=plan.v)
    conv = conv.to(DEVICE, torch.float16)
    conv.weight.data.copy_(weight)
    conv.bias.data.copy_(bias)
    conv(x)
    {"in_place": lambda: conv.weight.detach().mul_(2),
     "through_data": lambda: conv.weight.data.mul_(2),
     "data_assignment": lambda: setattr(conv.weight, "data", 2 * weight)}[update]()
    expected = reference(plan, x, 2 * weight, bias, case[4])[0]
    assert rel_err(conv(x), expected) < FORWARD_TOLERANCE[torch.float16]


def test_inference_mode_under_autocast():
    plan, x, weight, bias, grad_y = make_case(6, batch=9, cin=4, cout=24, dtype=torch.float32,
                                              nin=30, nout=12, k=9)
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16):
        y, ran = knnconv.knn_conv_with_backend(x, weight, bias, plan)
    expected = reference(plan, *(t.half() for t in (x, weight, bias, grad_y)))[0]
    assert ran == "cuda" and rel_err(y, expected) < FORWARD_TOLERANCE[torch.float16]


def test_auto_policy_and_visible_backend():
    geometry = random_geometry(torch.Generator().manual_seed(1), nin=20, nout=6, k=5)
    conv = knnconv.KNNConv(4, 8, geometry.knn_indices, geometry.rf_index, nin=20,
                           v=geometry.v).to(DEVICE)
    x = torch.randn(3, 4, 20, device=DEVICE)
    conv.half()(x.half())
    assert conv.last_backend == "cuda"
    conv.float()(x)
    assert conv.last_backend == "torch_compact"
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = conv(x)
    assert conv.last_backend == "cuda" and y.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="float16/bfloat16"):
        knnconv.knn_conv(x, conv.weight, conv.bias, conv.plan, backend="cuda")


def test_autograd_under_autocast_matches_reference_and_keeps_fp32_grads():
    plan, x, weight, bias, grad_y = make_case(5, batch=33, cin=6, cout=20, dtype=torch.float32,
                                              nin=60, nout=25, k=9, padding=0.1)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    with torch.autocast("cuda", dtype=torch.float16):
        y, ran = knnconv.knn_conv_with_backend(*leaves, plan, backend="auto")
    assert ran == "cuda" and y.dtype == torch.float16
    y.backward(grad_y.half())
    y_ref, dx_ref, dw_ref = reference(plan, *(t.half() for t in (x, weight, bias, grad_y)))
    assert rel_err(y, y_ref) < FORWARD_TOLERANCE[torch.float16]
    for leaf, expected in zip(leaves[:2], (dx_ref, dw_ref), strict=True):
        assert leaf.grad.dtype == torch.float32
        assert rel_err(leaf.grad, expected) < GRAD_TOLERANCE
    assert rel_err(leaves[2].grad, grad_y.half().double().sum((0, 2))) < GRAD_TOLERANCE



@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("storage", ["channels_last", "contiguous"])
@pytest.mark.parametrize("wide_weight", [torch.float32, torch.float64], ids=str)
def test_wide_parameters_under_autocast_train_as_their_casts_do(dtype, storage, wide_weight):
    """The weight's re-layout casts it (CudaOps.casts_weight; a float64 weight is cast by
    torch first): y is that of the weight cast beforehand, bit for bit, on the in-place
    kernels (channels-last x) and the re-laying-out ones (contiguous x), and so are dx and
    dW up to the order of their float32 atomics; dW comes back in the weight's dtype."""
    plan, x, weight, bias, grad_y = make_case(6, batch=17, cin=16, cout=24, dtype=dtype,
                                              nin=60, nout=25, k=9, padding=0.1)
    if storage == "contiguous":
        x, grad_y = x.contiguous(), grad_y.contiguous()
    results = {}
    for name, w in (("wide under autocast", weight.to(wide_weight)), ("cast", weight)):
        xi, wi = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
        with torch.autocast("cuda", dtype=dtype, enabled=w.dtype == wide_weight):
            y, ran = knnconv.knn_conv_with_backend(xi, wi, bias, plan, backend="cuda")
        y.backward(grad_y)
        assert ran == "cuda" and y.dtype == dtype
        results[name] = (y, xi.grad, wi.grad)
    (y_wide, dx_wide, dw_wide), (y_cast, dx_cast, dw_cast) = results.values()
    assert torch.equal(y_wide, y_cast)
    assert rel_err(dx_wide, dx_cast) < GRAD_TOLERANCE
    assert dw_wide.dtype == wide_weight
    # dw_cast is rounded to the compute dtype: compared rounded alike
    assert rel_err(dw_wide.to(dtype), dw_cast) < FORWARD_TOLERANCE[dtype]

def test_small_network_trains_under_amp_like_reference():
    generator = torch.Generator().manual_seed(7)
    first = random_geometry(generator, nin=200, nout=60, k=9, padding=0.05)
    second = random_geometry(generator, nin=60, nout=16, k=9, padding=0.05)
    images = torch.randn(256, 3, 200, generator=generator)
    labels = (images[:, 0, :100].sum(1) > images[:, 1, 100:].sum(1)).long()

    def train(backend):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            knnconv.KNNConv(3, 16, first.knn_indices, first.rf_index, nin=200, v=9,
                            backend=backend),
            torch.nn.ReLU(),
            knnconv.KNNConv(16, 32, second.knn_indices, second.rf_index, nin=60, v=9,
                            backend=backend),
            torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(32 * 16, 2),
        ).to(DEVICE)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        scaler = torch.amp.GradScaler("cuda")
        losses = []
        for step in range(60):
            batch = slice((step * 64) % 256, (step * 64) % 256 + 64)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(images[batch].to(DEVICE)),
                                                         labels[batch].to(DEVICE))
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            losses.append(loss.item())
        return losses

    cuda_losses, reference_losses = train("cuda"), train("reference")
    assert sum(cuda_losses[-10:]) < 0.6 * sum(cuda_losses[:10])
    assert abs(sum(cuda_losses[-10:]) - sum(reference_losses[-10:])) < 0.1 * sum(
        reference_losses[-10:]) + 0.05


def test_training_step_replays_as_a_cuda_graph():
    generator = torch.Generator().manual_seed(11)
    first = random_geometry(generator, nin=120, nout=40, k=9, padding=0.05)
    second = random_geometry(generator, nin=40, nout=12, k=9)
    images = torch.randn(4, 64, 3, 120, generator=generator).to(DEVICE)

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            knnconv.KNNConv(3, 16, first.knn_indices, first.rf_index, nin=120, v=9),
            torch.nn.ReLU(),
            knnconv.KNNConv(16, 8, second.knn_indices, second.rf_index, nin=40, v=9),
        ).to(DEVICE)
        return model, torch.optim.SGD(model.parameters(), lr=0.01)

    def step(model, optimizer, x):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(x).float().square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return loss

    eager_model, eager_optimizer = build()
    eager_losses = [step(eager_model, eager_optimizer, images[i % 4]).item() for i in range(8)]

    model, optimizer = build()
    static_x = images[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles, verifies and builds tables eagerly
        warm = [step(model, optimizer, images[i]).item() for i in range(3)]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(model, optimizer, static_x)
    losses = warm
    for i in range(3, 8):
        static_x.copy_(images[i % 4])
        graph.replay()
        losses.append(static_loss.item())
    assert model[0].last_backend == "cuda"
    for got, expected in zip(losses, eager_losses, strict=True):
        assert abs(got - expected) <= 2e-2 * abs(expected) + 1e-4


def test_make_graphed_callables_replays_layers_forward_and_backward():
    # torch.cuda.make_graphed_callables captures a module's forward and backward as two CUDA
    # graphs (its own warm-up runs eagerly first), taking the host path out of each step.
    generator = torch.Generator().manual_seed(13)
    geometry = random_geometry(generator, nin=90, nout=30, k=9, padding=0.05)

    def layer():
        torch.manual_seed(0)
        return knnconv.KNNConv(16, 24, geometry.knn_indices, geometry.rf_index, nin=90,
                               v=9).to(DEVICE, torch.float16)

    eager, graphed_layer = layer(), layer()
    sample = torch.randn(17, 16, 90, generator=generator).to(DEVICE, torch.float16)
    graphed = torch.cuda.make_graphed_callables(graphed_layer, (sample.requires_grad_(),))
    for _ in range(3):
        x = torch.randn(17, 16, 90, generator=generator).to(DEVICE, torch.float16)
        grad = torch.randn(17, 24, 30, generator=generator).to(DEVICE, torch.float16)
        results = []
        for module in (eager, graphed):
            leaf = x.clone().requires_grad_()
            for parameter in (eager.weight, eager.bias, graphed_layer.weight, graphed_layer.bias):
                parameter.grad = None
            y = module(leaf)
            y.backward(grad)
            own = eager if module is eager else graphed_layer
            results.append((y.detach(), leaf.grad, own.weight.grad, own.bias.grad))
        for got, expected in zip(results[1], results[0], strict=True):
            assert rel_err(got, expected) < 1e-3
    assert graphed_layer.last_backend == "cuda"


def test_reduce_overhead_compiled_training_follows_eager():
    # torch.compile(mode="reduce-overhead") records the compiled forward and backward as CUDA
    # graphs (CUDA-graph trees) after an eager warm-up run: the custom ops must be capturable
    # there, and replays must train as eager does, with a new batch every step.
    generator = torch.Generator().manual_seed(14)
    geometry = random_geometry(generator, nin=60, nout=20, k=9, padding=0.1)
    images = [torch.randn(17, 8, 60, generator=generator).to(DEVICE) for _ in range(4)]
    targets = [torch.randn(17, 16, 20, generator=generator).to(DEVICE) for _ in range(4)]

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            knnconv.KNNConv(8, 16, geometry.knn_indices, geometry.rf_index, nin=60, v=9,
                            backend="cuda"), torch.nn.GELU()).to(DEVICE)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def train(forward, model, optimizer):
        losses = []
        for i in range(8):
            torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(forward(images[i % 4]).float(),
                                                    targets[i % 4])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses, model[0].weight.detach().clone()

    model, optimizer = build()
    eager_losses, eager_weight = train(model, model, optimizer)
    torch.compiler.reset()
    model, optimizer = build()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)
    counters.clear()
    losses, weight = train(compiled, model, optimizer)
    torch.compiler.reset()
    # the steps were replayed as CUDA graphs, not run as a compiled graph inductor declined
    # to record
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert model[0].last_backend == "cuda"
    for got, expected in zip(losses, eager_losses, strict=True):
        assert abs(got - expected) <= 2e-2 * abs(expected) + 1e-4
    assert rel_err(weight, eager_weight) < 1e-3
    assert losses[-1] < losses[0]  # it trained


@pytest.mark.parametrize("keep_relayout", [True, False])
def test_compiled_network_on_the_gpu_matches_eager(keep_relayout):
    with knnconv.keep_input_relayout(keep_relayout):
        check_compiled_network_matches_eager()


def check_compiled_network_matches_eager():
    generator = torch.Generator().manual_seed(12)
    geometry = random_geometry(generator, nin=60, nout=20, k=9, padding=0.1)
    model = torch.nn.Sequential(
        knnconv.KNNConv(8, 16, geometry.knn_indices, geometry.rf_index, nin=60, v=9),
        torch.nn.GELU()).to(DEVICE, torch.float16)
    x = torch.randn(33, 8, 60, generator=generator).to(DEVICE, torch.float16)
    grad = torch.randn(33, 16, 20, generator=generator).to(DEVICE, torch.float16)

    def step(module):
        leaf = x.clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        y = module(leaf)
        y.backward(grad)
        return [y.detach(), leaf.grad, model[0].weight.grad.clone(), model[0].bias.grad.clone()]

    eager = step(model)
    compiled = step(torch.compile(model, fullgraph=True, backend="aot_eager"))
    # the backward reads the kept re-layout (or x) the compiled forward saved
    for got, expected in zip(compiled, eager, strict=True):
        assert rel_err(got, expected) < 1e-3


@pytest.mark.parametrize("nout,batch", [(2, 130), (31, 17)])
def test_a_kept_relayout_has_the_shape_compile_allocates_for_it(nout, batch):
    # torch.compile allocates the saved re-layout from CudaOps.saved_layout (the fake impl);
    # inductor asserts the real one has that shape
    plan = random_geometry(torch.Generator().manual_seed(nout), nin=8, nout=nout,
                           k=5).plan(cin=256, cout=512)
    x = torch.randn(batch, plan.cin, plan.nin, device=DEVICE, dtype=torch.float16)
    weight = torch.randn(plan.cout, plan.q, device=DEVICE, dtype=torch.float16)
    ops = knn_cuda.CudaOps()
    saved = ops.forward_saving(plan, x, weight, None)[1]
    assert tuple(saved.xt.shape) == ops.saved_layout(plan, x, torch.float16)


def channels_last(t: torch.Tensor) -> torch.Tensor:
    """t [B, C, N] as the view of a contiguous [B, N, C] buffer (as the kernels return y)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", (1, 17, 129))
@pytest.mark.parametrize("cin", (1, 3, 8, 70))
@pytest.mark.parametrize("cout", (64, 70))
def test_a_channels_last_x_gives_the_contiguous_results_and_a_channels_last_dx(dtype, batch,
                                                                              cin, cout):
    plan, x, weight, bias, grad_y = make_case(batch * 1000 + cin * 10 + cout % 7, batch=batch,
                                              cin=cin, cout=cout, dtype=dtype, nin=40, nout=23,
                                              k=9, padding=0.15)
    y_ref, dx_ref, dw_ref = reference(plan, x, weight, bias, grad_y)
    ops = knn_cuda.CudaOps()
    needs, dtypes = (True, True, True), (dtype, torch.float32, torch.float32)
    # channels-last first: every kernel's first use (NaN-poisoned, checked) is on it
    x_last, grad_last = channels_last(x), channels_last(grad_y)
    y_last, saved_last = ops.forward_saving(plan, x_last, weight, bias)
    from_saved = ops.gradients(plan, grad_last, saved_last, weight, needs, dtypes,
                               dx_channels_last=True)
    # handed x itself (no kept re-layout), the backward re-lays the channels-last x out
    from_x = ops.gradients(plan, grad_last, x_last, weight, needs, dtypes, dx_channels_last=True)
    y, saved = ops.forward_saving(plan, x, weight, bias)
    dx, dw, db = ops.gradients(plan, grad_y, saved, weight, needs, dtypes)

    assert torch.equal(saved_last.xt, saved.xt)  # batch padding and zero row included
    assert torch.equal(saved_last.original(), x)
    assert torch.equal(y_last, y)
    assert rel_err(y, y_ref) < FORWARD_TOLERANCE[dtype]
    assert dx.is_contiguous()
    assert rel_err(dx, dx_ref) < FORWARD_TOLERANCE[dtype]
    assert rel_err(dw, dw_ref) < GRAD_TOLERANCE
    assert rel_err(db, grad_y.double().sum((0, 2))) < GRAD_TOLERANCE
    gathered = configs.default_grad_input_algorithm(cin) == "gather"
    for dx_last, dw_last, db_last in (from_saved, from_x):
        assert dx_last.dtype == dtype and dx_last.transpose(1, 2).is_contiguous()
        if cin > 1:
            assert dx_last.stride() == (cin * plan.nin, 1, cin)
        if gathered:  # written once per element from the same sums
            assert torch.equal(dx_last, dx)
        else:  # summed by atomics in another order
            assert rel_err(dx_last, dx) < GRAD_TOLERANCE
        assert rel_err(dw_last, dw) < GRAD_TOLERANCE
        assert rel_err(db_last, db) < GRAD_TOLERANCE


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("algorithm", ("gather", "scatter"))
@pytest.mark.parametrize("batch,cin,nin", [
    (17, 3, 40), (129, 70, 40), (1, 8, 40),
    (3, 3, 65_541)])  # more input nodes than a grid has CTA layers
def test_either_dx_algorithm_writes_all_of_a_channels_last_dx(dtype, algorithm, batch, cin,
                                                              nin):
    plan, x, weight, bias, grad_y = make_case(batch + cin + nin, batch=batch, cin=cin, cout=70,
                                              dtype=dtype, nin=nin, nout=23, k=9, padding=0.15)
    tables = plan.on(DEVICE)
    il, wl = tables.input_linear, tables.weight_linear
    reverse = knn_cuda.reverse_tables(tables.knn_indices, tables.rf_index, plan.nin)
    y_ref, dx_ref, dw_ref = reference(plan, x, weight, bias, grad_y)
    y, saved = knn_cuda.forward(channels_last(x), weight, bias, il, wl, poison_output=True,
                                return_transposed=True)
    assert torch.equal(saved.original(), x)
    assert rel_err(y, y_ref) < FORWARD_TOLERANCE[dtype]
    dx_last, dw_last = knn_cuda.backward(channels_last(grad_y), saved, weight, il, wl, reverse,
                                         cin, nin, plan.q, input_algorithm=algorithm,
                                         poison_outputs=True, dx_channels_last=True)
    dx, dw = knn_cuda.backward(grad_y, x, weight, il, wl, reverse, cin, nin, plan.q,
                               input_algorithm=algorithm, poison_outputs=True)
    assert dx_last.transpose(1, 2).is_contiguous() and dx_last.stride(1) == 1
    assert dx.is_contiguous()
    for value, expected in ((dx_last, dx_ref), (dx, dx_ref), (dw_last, dw_ref), (dw, dw_ref)):
        assert rel_err(value, expected) < GRAD_TOLERANCE  # NaN (an unwritten entry) fails
    if algorithm == "gather":
        assert torch.equal(dx_last, dx)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_channels_last_grad_y_is_transposed_node_by_node_with_its_bias_gradient(dtype):
    # three input channels keep the re-laying-out kernels; grad_y in the storage y has takes
    # the per-node transpose and a separate bias sum, a contiguous one the summing transpose
    from knnconv.ops.cuda.gemm import BackwardLaunch

    plan, x, weight, bias, grad_y = make_case(12, batch=33, cin=3, cout=70, dtype=dtype,
                                              nin=60, nout=29, k=9, padding=0.2)
    tables = plan.on(DEVICE)
    launch = BackwardLaunch(batch=33, cin=plan.cin, nin=plan.nin, cout=plan.cout,
                            nout=plan.nout, q=plan.q, p64=plan.p64, dtype=dtype,
                            device=torch.device("cuda", torch.cuda.current_device()),
                            need_input=False, need_bias=True)
    assert launch.to_gt_by_node is not None
    _, dx_ref, dw_ref = reference(plan, x, weight, bias, grad_y)
    db_ref = grad_y.double().sum(dim=(0, 2))
    for storage in (grad_y.contiguous(), grad_y.transpose(1, 2).contiguous().transpose(1, 2)):
        _, dw, db = launch.run(storage, x, weight, tables.input_linear, tables.weight_linear,
                               None, poison=True)
        assert rel_err(dw, dw_ref) < GRAD_TOLERANCE
        assert not torch.isnan(db).any() and rel_err(db, db_ref) < GRAD_TOLERANCE


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cfg", every_config("forward"), ids=str)
@pytest.mark.parametrize("nodes_per_cta", (1, 3, 8))
def test_the_forward_runs_each_nodes_real_slots_from_its_staged_tables(dtype, cfg,
                                                                       nodes_per_cta):
    # Cin*K = 69 real slots of P64 = 128: each node runs 69 rounded up to the K tile, reading
    # its slot tables from shared memory; a walk of several nodes (and the last CTA's shorter
    # walk: Nout = 29) reads each node's own tables. bin collisions and padding included.
    from knnconv.ops.cuda.gemm import ForwardLaunch

    plan, x, weight, bias, grad_y = make_case(nodes_per_cta, batch=37, cin=3, cout=80,
                                              dtype=dtype, nin=60, nout=29, k=23, padding=0.2,
                                              collisions=True, v=9)
    assert plan.p64 == 128 and plan.cin * plan.k == 69
    tables = plan.on(DEVICE)
    sizes = dict(batch=37, cin=3, nin=plan.nin, cout=80, nout=plan.nout, q=plan.q,
                 p64=plan.p64, dtype=dtype,
                 device=torch.device("cuda", torch.cuda.current_device()), config=cfg,
                 nodes_per_cta=nodes_per_cta, slots=69)
    if nodes_per_cta > 1 and cfg.threads > configs.WALKING_MAX_THREADS:
        with pytest.raises(ValueError, match="1 for tiles of more than"):
            ForwardLaunch(**sizes)  # 16-warp tiles run one node per CTA
        return
    launch = ForwardLaunch(**sizes)
    assert launch.slots == -(-69 // cfg.bk) * cfg.bk
    y, _ = launch.run(x, weight, bias, tables.input_linear, tables.weight_linear,
                      poison_output=True)
    y_ref = reference(plan, x, weight, bias, grad_y)[0]
    assert not torch.isnan(y).any(), "unwritten (poisoned) forward outputs"
    assert rel_err(y, y_ref) < FORWARD_TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", (1, 17, 129))
@pytest.mark.parametrize("cout", (8, 80, 144))
@pytest.mark.parametrize("ksplit", (1, 2))
def test_an_image_layers_weight_gradient_reads_channels_last_grad_y_in_place(dtype, batch,
                                                                            cout, ksplit):
    # x without a gradient (the image): dW reads grad_y where it lies, rows past the batch and
    # channels past Cout as zeros; grad_y a batch slice of a wider buffer (its batch stride is
    # not Cout*Nout). The bias gradient is summed from the same storage.
    from knnconv.ops.cuda.gemm import BackwardLaunch

    plan, x, weight, bias, grad_y = make_case(batch + cout, batch=batch, cin=3, cout=cout,
                                              dtype=dtype, nin=50, nout=31, k=25, padding=0.2,
                                              collisions=True, v=16)
    tables = plan.on(DEVICE)
    device = torch.device("cuda", torch.cuda.current_device())
    wider = torch.randn(batch + 3, plan.nout, cout, device=DEVICE).to(dtype)
    wider[1:batch + 1] = grad_y.transpose(1, 2)
    grad_slice = wider[1:batch + 1].transpose(1, 2)
    assert grad_slice.stride(0) == plan.nout * cout and grad_slice.storage_offset() > 0
    _, _, dw_ref = reference(plan, x, weight, bias, grad_y)
    db_ref = grad_y.double().sum(dim=(0, 2))
    launch = BackwardLaunch(batch=batch, cin=3, nin=plan.nin, cout=cout, nout=plan.nout,
                            q=plan.q, p64=plan.p64, dtype=dtype, device=device,
                            need_input=False, need_bias=True, ksplit=min(ksplit, 1 + batch // 64),
                            grad_y_in_place=True)
    assert launch.workspace.gt is None  # no re-layout of grad_y
    _, dw, db = launch.run(grad_slice, x, None, tables.input_linear, tables.weight_linear, None,
                           poison=True)
    assert rel_err(dw, dw_ref) < GRAD_TOLERANCE  # NaN (an unwritten entry) fails
    assert rel_err(db, db_ref) < GRAD_TOLERANCE
    # the ops take this path for an x without a gradient and channels-last grad_y
    ops = knn_cuda.CudaOps()
    _, dw_ops, db_ops = ops.gradients(plan, grad_slice, x, weight, (False, True, True),
                                      (None, torch.float32, torch.float32))
    launches = plan.derived(DEVICE, "cuda.launches", lambda tables: None)
    assert any(key[0] == "backward" and key[-1] for key in launches._plans)
    assert rel_err(dw_ops, dw_ref) < GRAD_TOLERANCE
    assert rel_err(db_ops, db_ref) < GRAD_TOLERANCE


def test_reading_grad_y_in_place_is_refused_where_it_cannot_serve():
    from knnconv.ops.cuda.gemm import BackwardLaunch

    plan, x, weight, _, grad_y = make_case(3, batch=9, cin=3, cout=80, dtype=torch.float16,
                                           nin=30, nout=12, k=9)
    device = torch.device("cuda", torch.cuda.current_device())
    common = dict(batch=9, cin=3, nin=plan.nin, nout=plan.nout, q=plan.q, p64=plan.p64,
                  dtype=torch.float16, device=device, grad_y_in_place=True)
    with pytest.raises(ValueError, match="dW and the bias gradient alone"):
        BackwardLaunch(cout=80, need_input=True, **common)
    with pytest.raises(ValueError, match="multiple of 8"):
        BackwardLaunch(cout=70, need_input=False, **common)
    launch = BackwardLaunch(cout=80, need_input=False, **common)
    tables = plan.on(DEVICE)
    with pytest.raises(ValueError, match="channels-last storage"):
        launch.run(grad_y.contiguous(), x, None, tables.input_linear, tables.weight_linear,
                   None)
