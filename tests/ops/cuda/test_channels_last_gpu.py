"""The channels-last kernels (knnconv.ops.cuda.channels_last) on a GPU (marker: gpu): every
output against the float64 reference on fresh random inputs, outputs NaN-poisoned before the
kernels run, at odd sizes (B = 1, 17, 129; channel counts not multiples of 64; Nout = 1),
with padding, all-padding nodes and bin collisions, for every tile rule; and the training
path taking them for channels-last activations.
"""

from __future__ import annotations

import pytest
import torch

import knnconv
from conftest import random_geometry, rel_err, with_all_padding_node
from knnconv.ops.cuda import configs

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
pytest.importorskip("cupy")

from knnconv.ops import cuda as knn_cuda  # noqa: E402
from knnconv.ops.cuda import channels_last, launch  # noqa: E402
from knnconv.ops.registry import channels_fastest  # noqa: E402

DTYPES = (torch.float16, torch.bfloat16)
FORWARD_TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
GRAD_TOLERANCE = 1e-3  # fp32 accumulation of products exact in fp32
DEVICE = torch.device("cuda")


def as_channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def make_case(seed, *, batch, cin, cout, dtype, all_padding_node=False, **geometry_knobs):
    generator = torch.Generator().manual_seed(seed)
    geometry = random_geometry(generator, **geometry_knobs)
    knn = with_all_padding_node(geometry) if all_padding_node else geometry.knn_indices
    plan = knnconv.make_plan(knn, geometry.rf_index, nin=geometry.nin, v=geometry.v, cin=cin,
                             cout=cout)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(DEVICE, dtype)

    x = as_channels_last(normal(batch, cin, plan.nin))
    grad_y = as_channels_last(normal(batch, cout, plan.nout))
    return plan, x, normal(cout, plan.q), normal(cout), grad_y


def reference(plan, x, weight, bias, grad_y):
    ops = knnconv.get_ops("reference")
    x64, w64, b64, g64 = (t.double() for t in (x, weight, bias, grad_y))
    y = ops.forward(plan, x64, w64, b64)
    dx, dw = ops.backward_combined(plan, g64, x64, w64)
    return y, dx, dw, g64.sum(dim=(0, 2))


def run_both(plan, x, weight, bias, grad_y, *, forward_cfg=None, input_cfg=None,
             weight_cfg=None, ksplit=None, nodes_per_cta=None,
             grad_dtypes=(torch.float32,) * 3, forward_family=None, input_family=None):
    """y, dx, dW, dbias from the channels-last launches, every output NaN-poisoned first."""
    entries = channels_last.entry_tables(*(t.to(DEVICE) for t in (plan.knn_indices,
                                                                 plan.rf_index)), plan.nin)
    assert entries.count == plan.entry_count
    reverse = knn_cuda.reverse_tables(plan.knn_indices.to(DEVICE), plan.rf_index.to(DEVICE),
                                      plan.nin)
    sizes = dict(batch=x.shape[0], cin=plan.cin, nin=plan.nin, cout=plan.cout, nout=plan.nout,
                 v=plan.v, entries=plan.entry_count, dtype=x.dtype, device=DEVICE)
    forward = channels_last.ChannelsLastForward(**sizes, config=forward_cfg,
                                                family=forward_family,
                                                nodes_per_cta=nodes_per_cta)
    assert forward_family is None or forward.family == forward_family
    y = forward.run(x, weight, bias, entries, poison_output=True)
    backward = channels_last.ChannelsLastBackward(
        **sizes, need_bias=True, grad_dtypes=grad_dtypes, input_config=input_cfg,
        input_family=input_family, weight_config=weight_cfg, ksplit=ksplit,
        nodes_per_cta=nodes_per_cta)
    assert input_family is None or backward.kernel_keys["input"][0] == input_family
    dx, dw, db = backward.run(grad_y, x, weight, entries, reverse, poison=True)
    return y, dx, dw, db


def check(plan, x, weight, bias, grad_y, **options):
    expected = reference(plan, x, weight, bias, grad_y)
    y, dx, dw, db = run_both(plan, x, weight, bias, grad_y, **options)
    assert y.shape == (x.shape[0], plan.cout, plan.nout) and y.dtype == x.dtype
    assert y.transpose(1, 2).is_contiguous(), "y comes in channels-last storage"
    assert dx.transpose(1, 2).is_contiguous(), "dx comes in channels-last storage"
    for name, value in (("y", y), ("dx", dx), ("dw", dw), ("db", db)):
        assert not torch.isnan(value).any(), f"unwritten (poisoned) {name} entries"
    assert rel_err(y, expected[0]) < FORWARD_TOLERANCE[x.dtype]
    for value, want in zip((dx, dw, db), expected[1:], strict=True):
        assert rel_err(value, want) < GRAD_TOLERANCE


CASES = {
    "plain": dict(batch=17, cin=64, cout=80, nin=70, nout=31, k=9),
    "batch1": dict(batch=1, cin=32, cout=48, nin=40, nout=12, k=9, padding=0.2),
    "batch129_padding": dict(batch=129, cin=48, cout=64, nin=60, nout=23, k=9, padding=0.3),
    "collisions": dict(batch=33, cin=16, cout=16, nin=50, nout=20, k=9, v=9, collisions=True,
                       padding=0.1),
    "nout1": dict(batch=17, cin=64, cout=144, nin=30, nout=1, k=7),
    "k1": dict(batch=65, cin=128, cout=64, nin=40, nout=40, k=1),
    "mostly_padding_all_padding_node": dict(batch=20, cin=32, cout=32, nin=25, nout=17, k=9,
                                            padding=0.8, all_padding_node=True),
    "k_gt_nin_v_gt_k": dict(batch=9, cin=16, cout=32, nin=3, nout=11, k=6, v=25),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_every_output_matches_float64(dtype, name):
    check(*make_case(len(name), dtype=dtype, **CASES[name]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_tile_rule_and_walk_length_matches_float64(dtype):
    # Cin = 384 suits every rule's channel tile (16 ... 128, and 96); Nout = 37 leaves a
    # ragged last CTA
    gather = [configs.KernelConfig(*r["config"]) for r in configs.tile_rules()["gather_cl"]]
    weight = [configs.KernelConfig(*r["config"]) for r in configs.tile_rules()["grad_weight_cl"]]
    for index in range(max(len(gather), len(weight))):
        case = make_case(100 + index, batch=70, cin=384, cout=128, dtype=dtype, nin=50,
                         nout=37, k=9, padding=0.2, collisions=True, v=16)
        check(*case, forward_cfg=gather[index % len(gather)],
              input_cfg=gather[(index + 1) % len(gather)],
              weight_cfg=weight[index % len(weight)], nodes_per_cta=1 + index % 3,
              ksplit=1 + index % 2)


WGMMA = "gather_cl_wgmma"
WGMMA_CASES = {
    "batch1": dict(batch=1, cin=64, cout=144, nin=40, nout=12, k=9, padding=0.2),
    "batch17_nout1": dict(batch=17, cin=128, cout=80, nin=30, nout=1, k=7),
    "batch129_collisions": dict(batch=129, cin=192, cout=128, nin=60, nout=23, k=9, v=9,
                                collisions=True, padding=0.3),
    "all_padding_node": dict(batch=70, cin=64, cout=64, nin=25, nout=17, k=9, padding=0.8,
                             all_padding_node=True),
}


@pytest.mark.skipif(torch.cuda.get_device_capability() != configs.ARCHITECTURE_FAMILIES[WGMMA],
                    reason="warpgroup MMA runs on compute capability 9.0 only")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(WGMMA_CASES))
def test_every_warpgroup_mma_rule_matches_float64(dtype, name):
    # every rule, as the forward and, where its channel tile divides Cout, as dx (stored in
    # float32), walking one to three nodes a CTA
    for index, rule in enumerate(configs.tile_rules()[WGMMA]):
        cfg = configs.KernelConfig(*rule["config"])
        case = WGMMA_CASES[name]
        dx_too = case["cout"] % cfg.bk == 0
        check(*make_case(index + len(name), dtype=dtype, **case), forward_cfg=cfg,
              forward_family=WGMMA, input_cfg=cfg if dx_too else None,
              input_family=WGMMA if dx_too else None, nodes_per_cta=1 + index % 3)


@pytest.mark.skipif(torch.cuda.get_device_capability() != configs.ARCHITECTURE_FAMILIES[WGMMA],
                    reason="warpgroup MMA runs on compute capability 9.0 only")
@pytest.mark.parametrize("setting", (False, True))
def test_hopper_takes_the_warpgroup_mma_gather_when_asked(setting):
    sizes = dict(batch=256, cin=128, nin=64, cout=128, nout=64, v=9, entries=576,
                 dtype=torch.float16, device=DEVICE)
    expected = WGMMA if setting else "gather_cl"
    assert channels_last.ChannelsLastForward(**sizes, warpgroup_mma=setting).family == expected
    backward = channels_last.ChannelsLastBackward(**sizes, need_weight=False,
                                                  warpgroup_mma=setting)
    assert backward.kernel_keys["input"][0] == expected


@pytest.mark.parametrize("grad_dtype", (torch.float32, torch.float16))
def test_gradients_come_in_the_dtypes_asked_for(grad_dtype):
    case = make_case(7, batch=17, cin=32, cout=64, dtype=torch.float16, nin=40, nout=20, k=9,
                     padding=0.1)
    y, dx, dw, db = run_both(*case, grad_dtypes=(grad_dtype, grad_dtype, torch.float32))
    assert (dx.dtype, dw.dtype, db.dtype) == (grad_dtype, grad_dtype, torch.float32)
    expected = reference(*case)
    assert rel_err(dx, expected[1]) < (GRAD_TOLERANCE if grad_dtype == torch.float32 else 2e-3)


def test_a_batch_slice_and_a_contiguous_grad_y_are_read_correctly():
    plan, x, weight, bias, grad_y = make_case(8, batch=40, cin=64, cout=64,
                                              dtype=torch.bfloat16, nin=50, nout=19, k=9)
    x_slice, grad_slice = x[8:29], grad_y[8:29]  # batch stride of the full buffer
    assert launch.readable(x_slice)
    expected = reference(plan, x_slice, weight, bias, grad_slice)
    y, dx, dw, db = run_both(plan, x_slice, weight, bias, grad_slice.contiguous())
    assert rel_err(y, expected[0]) < FORWARD_TOLERANCE[torch.bfloat16]
    for value, want in zip((dx, dw, db), expected[1:], strict=True):
        assert rel_err(value, want) < GRAD_TOLERANCE


@pytest.mark.parametrize("warpgroup_mma", (False, True))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_training_impls_take_the_channels_last_kernels(dtype, warpgroup_mma):
    # forward_impl / backward_impl, as the autograd Function and the custom ops run them, on
    # a channels-last activation: fp32 master weights cast to the compute dtype, dx in x's
    # storage; the gather on warpgroup MMA when the setting asks for it on Hopper
    plan, x, weight, bias, grad_y = make_case(9, batch=129, cin=64, cout=96, dtype=dtype,
                                              nin=80, nout=41, k=9, padding=0.1)
    ops = knn_cuda.CudaOps()
    x = x.requires_grad_()
    w32 = weight.float().requires_grad_()
    b32 = bias.float().requires_grad_()
    with knnconv.context.using(warpgroup_mma=warpgroup_mma):
        y = knnconv.ops.execute.forward_impl(plan, ops, x, w32, b32, dtype, False)[0]
        grads = knnconv.ops.execute.backward_impl(plan, ops, grad_y, x.detach(), w32.detach(),
                                                  (True, True, True),
                                                  (dtype, torch.float32, torch.float32), dtype,
                                                  dx_channels_last=True)
    families = {key[0] for key in ops._verified}
    hopper = torch.cuda.get_device_capability() == configs.ARCHITECTURE_FAMILIES[WGMMA]
    gather = WGMMA if warpgroup_mma and hopper else "gather_cl"
    assert {gather, "grad_weight_cl"} <= families and "forward" not in families
    expected = reference(plan, x.detach(), weight, bias.to(dtype), grad_y)
    assert rel_err(y, expected[0]) < FORWARD_TOLERANCE[dtype]
    assert grads[0].transpose(1, 2).is_contiguous() and grads[0].dtype == dtype
    assert grads[1].dtype == torch.float32 and grads[2].dtype == torch.float32
    assert rel_err(grads[0], expected[1]) < 2 * FORWARD_TOLERANCE[dtype]  # dx rounded to dtype
    assert rel_err(grads[1], expected[2]) < GRAD_TOLERANCE
    assert rel_err(grads[2], expected[3]) < GRAD_TOLERANCE


def test_an_unaligned_channels_last_x_is_served_and_the_backward_gets_x():
    plan, x, weight, bias, _ = make_case(10, batch=5, cin=32, cout=32, dtype=torch.float16,
                                         nin=20, nout=9, k=5)
    storage = torch.empty(5 * 20 * 32 + 1, dtype=torch.float16, device=DEVICE)
    shifted = storage[1:].view(5, 20, 32).transpose(1, 2)  # 2 bytes off 16-byte alignment
    shifted.copy_(x)
    assert channels_fastest(shifted) and not launch.readable(shifted)
    ops = knn_cuda.CudaOps()
    y, saved = ops.forward_saving(plan, shifted, weight, bias)
    assert saved is shifted
    assert ops.saved_layout(plan, shifted, torch.float16) is None
    assert rel_err(y, reference(plan, x, weight, bias, torch.zeros_like(y))[0]) < 2e-3
