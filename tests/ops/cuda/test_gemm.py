"""The re-laying-out launch classes (gemm.ForwardLaunch, BackwardLaunch) built without a GPU,
kernel builds and device queries stubbed: what they stage dx in, the workspace they use, and
the kernels CudaOps verifies. The planners they take their plans from are tested in
test_launch_plan.py."""

from __future__ import annotations

import pytest
import torch

from conftest import random_geometry
from knnconv.ops.cuda import configs, gemm, launch
from knnconv.ops.cuda.backend import CudaOps


class UnbuiltKernel:
    def allow_shared_memory(self, size: int) -> None:
        pass


def stub_device(monkeypatch, shared_memory_limit: int = 227 * 1024) -> None:
    """Kernels never built, and an H200's limits for every device query."""
    monkeypatch.setattr(launch, "get_kernel", lambda name, index, **target: UnbuiltKernel())
    monkeypatch.setattr(launch, "shared_memory_limit", lambda index: shared_memory_limit)
    monkeypatch.setattr(launch, "multiprocessors", lambda index: 132)
    monkeypatch.setattr(launch, "capability", lambda index: (9, 0))


@pytest.fixture
def plans(monkeypatch):
    stub_device(monkeypatch)

    def backward(algorithm, cin, grad_dtype, need_weight=True, batch_padding=None):
        return gemm.BackwardLaunch(
            batch=17, cin=cin, nin=70, cout=65, nout=31, q=cin * 9, p64=-(-cin * 9 // 64) * 64,
            dtype=torch.float16, device=torch.device("cuda", 0), need_weight=need_weight,
            algorithm=algorithm, grad_dtypes=(grad_dtype, torch.float32, torch.float32),
            batch_padding=batch_padding)
    return backward


@pytest.mark.parametrize("algorithm", ["gather", "scatter"])
def test_the_workspace_holds_x_relayout_unless_a_forward_kept_one(plans, algorithm):
    cin = 40 if algorithm == "gather" else 3
    fresh = plans(algorithm, cin, torch.float16)
    # before the zeroed accumulators: poisoned on first use, then written whole
    assert fresh.workspace.xt is not None and fresh.workspace.xt < fresh.workspace.zero_from
    kept = plans(algorithm, cin, torch.float16, batch_padding=fresh.bpad)
    assert kept.workspace.xt is None
    assert fresh.workspace.size - kept.workspace.size >= (cin * 70 + 1) * fresh.bpad * 2
    assert plans(algorithm, cin, torch.float16, need_weight=False).workspace.size < (
        kept.workspace.size)


def test_a_gathered_dx_is_staged_in_its_own_dtype_when_that_is_the_compute_dtype(plans):
    own, wide = plans("gather", 40, torch.float16), plans("gather", 40, torch.float32)
    assert own.staging_dtype == torch.float16 and wide.staging_dtype == torch.float32
    # the workspace shrinks by exactly the bytes the narrower staging saves (up to alignment)
    saved = wide.workspace.size - own.workspace.size
    assert 17 * 70 * 40 * 2 <= saved < 17 * 70 * 40 * 2 + 2 * 256
    assert own.kernel_keys["input"][-1] == torch.float16
    assert wide.kernel_keys["input"][-1] == torch.float32


def test_a_scattered_dx_is_summed_in_float32_whatever_its_dtype(plans):
    for grad_dtype in (torch.float16, torch.float32):
        assert plans("scatter", 3, grad_dtype).staging_dtype == torch.float32


def test_only_the_needed_kernels_are_verified(plans):
    assert set(plans("gather", 40, torch.float16).kernel_keys) == {"input", "weight"}
    with_bias = gemm.BackwardLaunch(
        batch=17, cin=40, nin=70, cout=65, nout=31, q=360, p64=384, dtype=torch.float16,
        device=torch.device("cuda", 0), need_bias=True)
    assert set(with_bias.kernel_keys) == {"input", "weight", "bias"}
    only_input = plans("gather", 40, torch.float16, need_weight=False)
    assert set(only_input.kernel_keys) == {"input"}
    family, dtype, _, device, stores_chunks, stored = only_input.kernel_keys["input"]
    assert (family, dtype, device, stored) == ("grad_input", torch.float16,
                                               torch.device("cuda", 0), torch.float16)
    assert stores_chunks  # Cin = 40: the gather stores 8-wide chunks


def test_the_dx_keys_name_the_path_the_kernel_takes_at_run_time(plans):
    # the gather: 16-byte stores where Cin % 8 == 0, element stores otherwise
    assert plans("gather", 40, torch.float16).kernel_keys["input"][4] is True
    assert plans("gather", 36, torch.float16).kernel_keys["input"][4] is False
    # the scatter: walking several nodes per CTA or one, in the same kernel
    walking, one = (gemm.BackwardLaunch(
        batch=17, cin=3, nin=70, cout=65, nout=31, q=27, p64=64, dtype=torch.float16,
        device=torch.device("cuda", 0), algorithm="scatter", nodes_per_cta=nodes)
        for nodes in (4, 1))
    assert walking.kernel_keys["input"][:4] == one.kernel_keys["input"][:4]
    assert (walking.kernel_keys["input"][4], one.kernel_keys["input"][4]) == (True, False)


def test_the_forward_keys_each_way_it_reads_the_bias(plans):
    forward = gemm.ForwardLaunch(batch=17, cin=40, nin=70, cout=65, nout=31, q=360, p64=384,
                                 dtype=torch.float16, device=torch.device("cuda", 0))
    absent, as_fp32, as_x = (forward.kernel_key(bias) for bias in (
        None, torch.zeros(65), torch.zeros(65, dtype=torch.float16)))
    assert len({absent, as_fp32, as_x}) == 3
    # a bias the kernel cannot read in its own dtype is read as fp32, so it is that path
    for converted in (torch.float64, torch.bfloat16):
        bias = torch.zeros(65, dtype=converted)
        assert launch.bias_read_dtype(bias, torch.float16) == torch.float32
        assert forward.kernel_key(bias) == as_fp32
    family, dtype, _, device, walks, vector_stores, _ = absent
    assert (family, dtype, device, vector_stores) == ("forward", torch.float16,
                                                      torch.device("cuda", 0), False)
    assert walks == (forward.nodes_per_cta > 1)


@pytest.mark.parametrize("batch", [17, 128, 512])
def test_a_few_node_forward_pads_the_batch_as_its_default_backward_does(plans, batch):
    # resnet18 layer4.0.conv1: the tiles fall through to small ones for few nodes, in both
    # directions; the backward reuses the forward's re-layout of x only if the paddings agree
    sizes = {"batch": batch, "cin": 256, "nin": 16, "cout": 512, "nout": 2, "q": 256 * 9,
             "p64": 2304, "dtype": torch.float16, "device": torch.device("cuda", 0)}
    forward = gemm.ForwardLaunch(**sizes)
    backward = gemm.BackwardLaunch(**sizes)
    assert forward.bpad == backward.bpad
    if batch == 128:
        assert forward.cfg.tile_m == 32 and backward.kernel_keys["input"][2].tile_m == 64


@pytest.mark.parametrize("nout,batch", [(2, 130), (2, 2048), (300, 129)])
def test_the_layout_compile_traces_for_a_kept_relayout_is_the_one_the_forward_builds(
        plans, nout, batch):
    # torch.compile allocates the saved re-layout from CudaOps.saved_layout (fake impl): it
    # must be the shape of the launch plan the real forward builds, here computed from the
    # same sizes (with Nout 2 at B = 130 the few-node tiles pad the batch to 192, the large
    # ones to 256)
    plan = random_geometry(torch.Generator().manual_seed(nout), nin=8, nout=nout,
                           k=5).plan(cin=256, cout=512)
    forward = gemm.ForwardLaunch(batch=batch, cin=plan.cin, nin=plan.nin, cout=plan.cout,
                                 nout=plan.nout, q=plan.q, p64=plan.p64, dtype=torch.float16,
                                 device=torch.device("cuda", 0))
    x = torch.empty(batch, plan.cin, plan.nin, dtype=torch.float16, device="meta")
    assert CudaOps().saved_layout(plan, x, torch.float16) == (plan.cin * plan.nin + 1,
                                                              forward.bpad)


@pytest.mark.parametrize("need_input", [False, True])
@pytest.mark.parametrize("batch,nin", [(150, 8), (300, 8)])
def test_a_backward_handed_a_kept_relayout_pads_the_batch_as_it_is_padded(plans, batch, nin,
                                                                          need_input):
    # alone, a backward at B = 150 pads to 160 (weight only) or 192 and the forward to 256 (at
    # B = 300: 320 and 384); handed the forward's padding it lays x out exactly as the kept
    # re-layout is, so it takes it as is
    sizes = {"batch": batch, "cin": 128, "nin": nin, "cout": 64, "nout": 16, "q": 128 * 9,
             "p64": 1152, "dtype": torch.float16, "device": torch.device("cuda", 0)}
    forward = gemm.ForwardLaunch(**sizes)
    alone = gemm.BackwardLaunch(**sizes, need_input=need_input)
    handed = gemm.BackwardLaunch(**sizes, need_input=need_input, batch_padding=forward.bpad)
    assert alone.bpad != forward.bpad
    assert handed.bpad == forward.bpad
    assert handed.input_layout.shape == forward.input_layout.shape
    # a padding the tiles cannot take is not used
    odd = gemm.BackwardLaunch(**sizes, need_input=need_input, batch_padding=forward.bpad + 1)
    assert odd.bpad == alone.bpad


@pytest.mark.parametrize("ksplit", [0, 64])
def test_an_explicit_split_beyond_the_batch_k_steps_is_refused(monkeypatch, ksplit):
    stub_device(monkeypatch)
    # B = 17 pads to a few k-steps at most: 64 splits cannot each get one
    sizes = {"batch": 17, "cin": 8, "nin": 70, "cout": 64, "nout": 31, "q": 72, "p64": 128,
             "dtype": torch.float16, "device": torch.device("cuda", 0), "need_input": False}
    assert gemm.BackwardLaunch(**sizes, ksplit=1).per_split >= 1
    with pytest.raises(ValueError, match="cannot be honoured"):
        gemm.BackwardLaunch(**sizes, ksplit=ksplit)
    with pytest.raises(TypeError, match="ksplit must be an int"):
        gemm.BackwardLaunch(**sizes, ksplit=2.0)


def test_the_forward_key_names_its_column_pair_or_element_stores(plans):
    keys = [gemm.ForwardLaunch(batch=17, cin=3, nin=70, cout=cout, nout=31, q=27, p64=64,
                               dtype=torch.float16, device=torch.device("cuda", 0))
            .kernel_key(None) for cout in (70, 71)]
    assert keys[0][:5] == keys[1][:5]
    assert (keys[0][5], keys[1][5]) == (True, False)


@pytest.mark.parametrize("slots,expected", [(None, 192), (147, 192), (27, 64)])
def test_the_forward_runs_each_nodes_real_slots_rounded_to_its_k_tile(plans, slots, expected):
    forward = gemm.ForwardLaunch(batch=2048, cin=3, nin=4085, cout=64, nout=964, q=588,
                                 p64=192, dtype=torch.float16,
                                 device=torch.device("cuda", 0), slots=slots)
    assert forward.cfg.bk == 64 and forward.slots == expected
    with pytest.raises(ValueError, match="slots must be in"):
        gemm.ForwardLaunch(batch=2048, cin=3, nin=4085, cout=64, nout=964, q=588, p64=192,
                           dtype=torch.float16, device=torch.device("cuda", 0), slots=193)


def test_a_forward_walk_is_shortened_where_its_slot_tables_would_not_fit(plans, monkeypatch):
    sizes = dict(batch=2048, cin=3, nin=4085, cout=64, nout=964, q=588, p64=192,
                 dtype=torch.float16, device=torch.device("cuda", 0))
    roomy = gemm.ForwardLaunch(**sizes)
    assert roomy.nodes_per_cta == 8
    tiles_alone = configs.shared_memory_bytes("forward", roomy.cfg)
    # room for the tiles and the tables of two nodes, not of eight
    room = tiles_alone + 2 * roomy.slots * 2 * configs.TABLE_BYTES
    stub_device(monkeypatch, shared_memory_limit=room)
    assert gemm.ForwardLaunch(**sizes).nodes_per_cta == 2
    with pytest.raises(ValueError, match="more than the device's"):
        gemm.ForwardLaunch(**sizes, nodes_per_cta=8)


def test_an_image_layers_weight_gradient_plan_reads_grad_y_in_place(plans):
    sizes = dict(batch=17, cin=3, nin=70, cout=64, nout=31, q=27, p64=64, dtype=torch.float16,
                 device=torch.device("cuda", 0), need_input=False, need_bias=True)
    in_place = gemm.BackwardLaunch(**sizes, grad_y_in_place=True)
    relaid = gemm.BackwardLaunch(**sizes)
    assert in_place.workspace.gt is None and relaid.workspace.gt is not None
    assert relaid.workspace.size - in_place.workspace.size >= 31 * 64 * 17 * 2
    assert in_place.kernel_keys["weight"][-1] is True
    assert relaid.kernel_keys["weight"][-1] is False
    with pytest.raises(ValueError, match="dW and the bias gradient alone"):
        gemm.BackwardLaunch(**{**sizes, "need_input": True}, grad_y_in_place=True)
    with pytest.raises(ValueError, match="multiple of 8"):
        gemm.BackwardLaunch(**{**sizes, "cout": 70}, grad_y_in_place=True)


def test_a_sixteen_warp_forward_tile_is_refused_a_walk_of_nodes(plans):
    wide = configs.KernelConfig(64, 256, 64, 2, 4, 4, 2, True, 8)
    sizes = dict(batch=256, cin=3, nin=70, cout=256, nout=31, q=27, p64=64,
                 dtype=torch.float16, device=torch.device("cuda", 0), config=wide)
    assert gemm.ForwardLaunch(**sizes).nodes_per_cta == 1
    with pytest.raises(ValueError, match="1 for tiles of more than"):
        gemm.ForwardLaunch(**sizes, nodes_per_cta=2)
