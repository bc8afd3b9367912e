"""Run the KNN layers of a fovi model through knnconv: :func:`accelerate`.

fovi's KNN layers keep their geometry as tables that are knnconv's own: ``knn_indices_pad_token``
[K, Nout], in which ``knn_pad_token_val`` (= Nin) marks a padding neighbour, is knnconv's
``knn_indices``; the one-hot ``local_rf`` [Nout, K, V] assigns each neighbour one kernel cell,
and its argmax over V is knnconv's ``rf_index``; the conv weight [Cout, Cin*V] has knnconv's
layout. So each layer keeps its parameters and only its forward changes.

What is routed, and how:

- ``KNNConvLayer`` and the ViT patch embeddings (``KNNPatchEmbedding``,
  ``PartitioningPatchEmbedding``, ``KNNPartitioningPatchEmbedding``): one :func:`knn_conv`.
- ``KNNDepthwiseConvLayer`` and ``KNNDepthwiseSeparableConvLayer``: knnconv's depthwise
  convolution (the op of :class:`knnconv.KNNDepthwiseConv`) with the layer's kernel, each
  input channel repeated by the channel multiplier; ``p_conv`` then mixes as in fovi. fovi
  2.4.0's own forward of these two classes raises (its ``_apply_local_rf`` returns
  [B, N, C*V], which their einsum reads as [B, C, V, N]); the routed layers compute what that
  einsum spells out, the features of ``_apply_local_rf`` read as [B, N, C, V].
- ``KNNPoolingLayer`` in ``max``, ``avg`` and ``sum`` modes: :class:`knnconv.pool.KNNPool`;
  in ``gaussian`` mode (fovi's GaussianKNNGridSampler): knnconv's depthwise convolution with
  one kernel cell per neighbour, holding fovi's gaussian weight renormalised over the real
  neighbours (built once, kept on the layer as the non-persistent buffer
  ``knnconv_gaussian_weights``).
- An ``nn.ReLU`` whose output only a routed max pooling reads (the ``activation`` and ``pool``
  of fovi's KNNAlexNetBlock, the ``relu`` and ``maxpool`` of KNNResNet's stem, each running
  fovi's own forward): the pooling runs in mode ``max_relu`` (ReLU of the max, one pass that
  saves the ReLU's read and write of x and of its gradient), and the ReLU's forward passes x
  on. The report lists them under ``relus_fused``.
- LoRA-wrapped layers (fovi.utils.lora.apply_lora: a torch parametrization of ``weight``) like
  the layers they wrap: the routed forward reads ``layer.weight``, the parametrized weight.
- ``KNNBatchNorm`` (fovi's BatchNorm1d over [B, C, N]), to keep the storage knnconv's
  convolutions return, the transposed view of a contiguous [B, N, C], which BatchNorm1d copies
  to contiguous on CUDA: on that storage, torch's batch norm on the [B, C, N, 1] view, which is
  torch.channels_last; on any other, the layer's own forward. The report lists them apart
  (``batch_norms``; ``batch_norms_left``, with the reason, of which accelerate does not warn:
  such a layer costs a copy, not knnconv's kernels). Where fovi needs the contiguous storage
  of BatchNorm1d's output (a KNNResNet with a classifier flattens its last block's output,
  pooled or not, with ``view``), the batch norm that gives it returns its output contiguous,
  explicitly: BatchNorm1d's own forward does so eagerly, but under torch.compile its output
  keeps the input's strides, which that ``view`` cannot take. Plain
  BatchNorm1d layers are not routed: fovi's KNN backbones build each batch norm of theirs as a
  KNNBatchNorm, and a plain one may sit anywhere, before a consumer that needs contiguous
  storage.

Left as they are, and named in the report: ``KNNGetterLayer`` (it returns the neighbourhoods
themselves, a gather with no arithmetic for knnconv to compute) and any subclass that
overrides a method of fovi's forward path, whose meaning knnconv cannot know.

A forward set on an instance of the model (or of a module in it) that calls fovi KNN layers of
another model would run those instead of the ones accelerate routes. fovi's DINOv3 wrapper
sets one, a closure over the forward of the model it builds, which copy.deepcopy does not
copy: a copy calls its original. accelerate rebuilds such a forward around the model's own
modules (the report lists it under ``forwards_rebound``), and raises ValueError, before
changing anything, where it cannot (no module of the model has the outside module's
structure, or the forward reaches it through an object it cannot rebuild).

Routed layers compile with ``torch.compile(fullgraph=True)``: what they need besides the
layer's parameters is built before any call (the plan and the pooling table, when accelerate
routes the layer; the mask of the nodes whose neighbours are all padding, a buffer fovi builds
with the layer, applied by fovi's own ``_mask_invalid_outputs``), or is traceable. A batch
norm with ``momentum=None`` is the exception, as it is in torch: its cumulative average reads
num_batches_tracked as a Python number, a graph break.

For finite inputs the routed layers give fovi's outputs and gradients (the batch norms to
rounding: torch's channels-last kernels sum in another order). Where fovi differs:
its pooling (gaussian too) skips a NaN input as if it were padding (knnconv's propagates it),
and its max pooling sends the gradient of tied maxima to one of them (knnconv's shares it).
"""

from __future__ import annotations

import functools
import sys
import types
import warnings
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .. import context
from ..functional import knn_conv_with_backend, knn_depthwise_conv_with_backend
from ..ops import get_ops
from ..ops.registry import is_channels_last
from ..plan import KNNConvPlan, NeighbourhoodPlan, make_plan
from ..pool import POOL_MODES, KNNPool
from ..torch_ops import batch_norm_train_op

try:
    from fovi.arch import knn as fovi_knn
    from fovi.arch import norm as fovi_norm
except ImportError as error:
    raise ImportError(
        "knnconv.integrations.fovi needs fovi and the packages its KNN layers import: "
        "pip install --no-deps 'fovi==2.4.0' && pip install 'knnconv[fovi]'"
    ) from error

# The methods fovi's layer forwards run through (the routed forwards call _mask_invalid_outputs
# too); a subclass that overrides one of them computes something this module cannot know, so
# it is left as it is.
_FORWARD_PATH = ("forward", "_pad_and_gather_knns", "_apply_local_rf", "_mask_invalid_outputs")

class _Unroutable(Exception):
    """Why a layer cannot run through knnconv; accelerate reports it and leaves the layer."""


def _checked_plan(knn_indices, rf_index, *, nin: int, v: int, cin: int,
                  cout: int) -> KNNConvPlan:
    try:
        return make_plan(knn_indices, rf_index, nin=nin, v=v, cin=cin, cout=cout)
    except (TypeError, ValueError) as error:
        raise _Unroutable(f"knnconv rejects its tables: {error}") from error


def _knn_tables(layer) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """knnconv's knn_indices [K, Nout], rf_index [Nout, K], nin and v from a fovi conv layer."""
    local_rf = layer.local_rf.detach().cpu()
    binary = ((local_rf == 0) | (local_rf == 1)).all()
    if local_rf.dim() != 3 or not binary or not (local_rf.sum(dim=2) == 1).all():
        raise _Unroutable("its local_rf does not put each neighbour in exactly one kernel cell")
    knn_indices = layer.knn_indices_pad_token.detach().cpu()
    return knn_indices, local_rf.argmax(dim=2), int(layer.knn_pad_token_val), local_rf.shape[2]


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise _Unroutable(f"its {name} has shape {tuple(tensor.shape)}, expected {expected}")


class _Router:
    """A routed layer's forward, set as the layer's instance attribute ``forward``.

    It reads the layer's parameters at every call, so they stay the layer's own, and writes
    the name of the backend that ran to ``layer.last_backend``.
    """

    # The methods the layer's own forward runs through; a subclass that overrides one of them
    # is left as it is (see _FORWARD_PATH).
    forward_path: tuple[str, ...] = _FORWARD_PATH

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer

    @classmethod
    def for_layer(cls, layer: nn.Module) -> type[_Router]:
        """The router of this layer: this class, or one for a variant of the layer's class."""
        return cls

    def describe(self) -> str:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class _PlanRouter(_Router):
    """A router whose layer runs through :func:`knn_conv` over a plan built from its tables."""

    def __init__(self, layer: nn.Module, backend: str) -> None:
        super().__init__(layer)
        self.backend = backend
        self.plan = self._build_plan()

    def _build_plan(self) -> KNNConvPlan:
        raise NotImplementedError


class _ConvRouter(_PlanRouter):
    """fovi's KNNConvLayer: one knn_conv with the layer's weight and bias."""

    def _build_plan(self) -> KNNConvPlan:
        layer = self.layer
        knn_indices, rf_index, nin, v = _knn_tables(layer)
        _check_shape("weight", layer.weight, (layer.out_channels, layer.in_channels * v))
        return _checked_plan(knn_indices, rf_index, nin=nin, v=v, cin=layer.in_channels,
                             cout=layer.out_channels)

    def describe(self) -> str:
        return f"knn_conv, backend={self.backend!r}, {self.plan}"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        y, layer.last_backend = knn_conv_with_backend(x, layer.weight, layer.bias, self.plan,
                                                      self.backend)
        return layer._mask_invalid_outputs(y)


class _PatchEmbeddingRouter(_ConvRouter):
    """fovi's ViT patch embeddings: the conv on [B, C, N] or [B, C, H, W] input, whose tokens
    come out [B, N, D] unless the layer is ``transposed``."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        tokens = super().__call__(x.flatten(2) if x.dim() == 4 else x)
        return tokens if self.layer.transposed else tokens.transpose(1, 2)


class _DepthwiseRouter(_PlanRouter):
    """fovi's depthwise conv, y[b, c*G + g, n] = bias + sum_k x[b, c, knn[k, n]] W[c, rf[n, k], g].

    knnconv's depthwise convolution over the layer's tables, with the weight laid out
    [C*G, V] (row c*G + g holds W[c, :, g]); a multiplier G > 1 repeats each input channel G
    times first. The backend is the layer's where it has depthwise kernels, else 'auto';
    ``last_backend`` names the one that ran.
    """

    kernel_name = "weight"

    def __init__(self, layer: nn.Module, backend: str) -> None:
        self.multiplier = layer.out_channels // layer.in_channels  # _build_plan checks it
        super().__init__(layer, backend)
        self.depthwise_backend = (backend if backend == "auto"
                                  or get_ops(backend).serves_neighbourhood else "auto")

    def _build_plan(self) -> NeighbourhoodPlan:
        layer = self.layer
        knn_indices, rf_index, nin, v = _knn_tables(layer)
        _check_shape(self.kernel_name, getattr(layer, self.kernel_name),
                     (layer.in_channels, v, self.multiplier))
        try:
            return NeighbourhoodPlan(knn_indices, nin=nin, rf_index=rf_index, v=v)
        except (TypeError, ValueError) as error:
            raise _Unroutable(f"knnconv rejects its tables: {error}") from error

    def describe(self) -> str:
        return (f"knnconv's depthwise conv (multiplier {self.multiplier}), "
                f"backend={self.depthwise_backend!r}, {self.plan!r}")

    def _depthwise(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        layer, multiplier = self.layer, self.multiplier
        kernel = getattr(layer, self.kernel_name)  # [C, V, G]
        if multiplier > 1:
            x = x.repeat_interleave(multiplier, dim=1)
        weight = kernel.permute(0, 2, 1).reshape(-1, self.plan.v)
        y, layer.last_backend = knn_depthwise_conv_with_backend(x, weight, bias, self.plan,
                                                                self.depthwise_backend)
        return y

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer._mask_invalid_outputs(self._depthwise(x, self.layer.bias))


class _DepthwiseSeparableRouter(_DepthwiseRouter):
    """fovi's depthwise-separable conv: the depthwise step on ``dw_conv``, then ``p_conv`` mixes
    the channels (the layer's ``weight`` and ``bias`` take no part, as in fovi)."""

    kernel_name = "dw_conv"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        mixed = self.layer.p_conv(self._depthwise(x, None).transpose(1, 2)).transpose(1, 2)
        return self.layer._mask_invalid_outputs(mixed)


class _PoolRouter(_Router):
    """fovi's KNNPoolingLayer: knnconv's KNNPool over the layer's table, in the layer's mode
    (backend 'auto': the native kernels where they serve; ``backend`` names the convolution
    backends and does not apply to pooling)."""

    @classmethod
    def for_layer(cls, layer: nn.Module) -> type[_Router]:
        return _GaussianPoolRouter if layer.mode == "gaussian" else cls

    def __init__(self, layer: nn.Module, backend: str) -> None:
        super().__init__(layer)
        if layer.mode not in POOL_MODES:
            raise _Unroutable(f"knnconv's pooling has no {layer.mode!r} mode (it has "
                              f"{', '.join(POOL_MODES)})")
        try:
            self.pool = KNNPool(layer.knn_indices_pad_token.detach().cpu(),
                                nin=int(layer.knn_pad_token_val), mode=layer.mode)
        except (TypeError, ValueError) as error:
            raise _Unroutable(f"knnconv rejects its table: {error}") from error

    def describe(self) -> str:
        return f"KNNPool({self.pool.extra_repr()})"

    def fuse_relu(self) -> None:
        """Pool ReLU(x) (mode max_relu), for a max pooling whose input a ReLU computes."""
        self.pool.mode = "max_relu"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.pool(x)
        self.layer.last_backend = self.pool.last_backend
        return y


class _FusedRelu:
    """The forward of an nn.ReLU whose only consumer, a routed max pooling, now applies it
    (mode max_relu): x passes on unchanged."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _relu_pool_pairs(model: nn.Module) -> Iterator[tuple[str, nn.ReLU, str, nn.Module]]:
    """(ReLU name, ReLU, pooling name, pooling) for each nn.ReLU of the model whose output only
    a max pooling reads: fovi's KNNAlexNetBlock (activation, then pool) and KNNResNet's stem
    (relu, then maxpool), each running fovi's own forward, with a ReLU the model holds once."""
    blocks = []  # (class, ReLU attribute, pooling attribute) of fovi's forwards
    knnalexnet = sys.modules.get("fovi.models.knnalexnet")  # loaded by a model that holds one
    if knnalexnet is not None:
        blocks.append((knnalexnet.KNNAlexNetBlock, "activation", "pool"))
    knnresnet = sys.modules.get("fovi.models.knnresnet")
    if knnresnet is not None:
        blocks.append((knnresnet.KNNResNet, "relu", "maxpool"))
    if not blocks:
        return
    held = [module for _, module in model.named_modules(remove_duplicate=False)]
    for name, module in model.named_modules():
        for block_class, relu_name, pool_name in blocks:
            if not isinstance(module, block_class) or (type(module).forward
                                                       is not block_class.forward):
                continue
            relu, pool = getattr(module, relu_name, None), getattr(module, pool_name, None)
            # a ReLU fused by an earlier accelerate is taken again, with its pooling
            if (type(relu) is nn.ReLU and isinstance(vars(relu).get("forward"),
                                                     (type(None), _FusedRelu))
                    and isinstance(pool, fovi_knn.KNNPoolingLayer) and pool.mode == "max"
                    and sum(m is relu for m in held) == 1):
                prefix = f"{name}." if name else ""
                yield f"{prefix}{relu_name}", relu, f"{prefix}{pool_name}", pool


class _GaussianPoolRouter(_Router):
    """fovi's KNNPoolingLayer in ``gaussian`` mode (fovi's GaussianKNNGridSampler pools with
    it): each output node's mean of its real neighbours weighted by fovi's ``gaussian_weights``
    [K, Nout], renormalised over the real ones,

        y[b, c, n] = sum_k x[b, c, knn[k, n]] * w[k, n],
        w[k, n] = g[k, n] real[k, n] / (sum_j g[j, n] real[j, n] + 1e-8).

    knnconv's depthwise convolution computes that with one kernel cell per slot (rf[n, k] =
    n*K + k, V = K*Nout) whose weight, the same for every channel, is w[k, n]. For finite
    inputs fovi's forward computes the same w (only padding neighbours are left out) and the
    same sum; like knnconv's other poolings, a NaN input propagates where fovi would skip it.

    w depends on the table alone, so it is built once, in fovi's arithmetic (its dtype, its
    reduction over the slots of a [1, 1, K, Nout] tensor), and kept on the layer as the
    non-persistent buffer ``knnconv_gaussian_weights``: it moves with the layer to any
    device, stays out of the state_dict, and is a graph input under torch.compile. The
    backend is 'auto' as for the other poolings (``backend`` names the convolution backends):
    on the GPU the native kernels where they take V cells, else torch_compact.
    """

    WEIGHTS = "knnconv_gaussian_weights"

    def __init__(self, layer: nn.Module, backend: str) -> None:
        super().__init__(layer)
        knn_indices = layer.knn_indices_pad_token.detach()
        nin = int(layer.knn_pad_token_val)
        k, nout = knn_indices.shape
        gaussian = layer.gaussian_weights.detach()
        if tuple(gaussian.shape) != (k, nout):
            raise _Unroutable(f"its gaussian_weights has shape {tuple(gaussian.shape)}, "
                              f"expected {(k, nout)}")
        padding = (knn_indices == nin).to(gaussian.device)[None, None]
        weights = torch.where(padding, torch.zeros_like(gaussian), gaussian[None, None])
        weights = weights / (weights.sum(dim=2, keepdim=True) + 1e-8)
        try:
            self.plan = NeighbourhoodPlan(knn_indices.cpu(), nin=nin, v=k * nout,
                                          rf_index=torch.arange(k * nout).view(nout, k))
        except (TypeError, ValueError) as error:
            raise _Unroutable(f"knnconv rejects its table: {error}") from error
        # cell n*K + k holds w[k, n]; on the device of the layer's buffers (fovi's
        # gaussian_weights, a plain attribute, stays where the layer was built)
        device = layer._knn_output_valid_mask.device
        layer.register_buffer(self.WEIGHTS, weights[0, 0].t().reshape(1, k * nout).to(device),
                              persistent=False)

    def describe(self) -> str:
        return (f"knnconv's depthwise conv with one cell per neighbour, holding fovi's "
                f"renormalised gaussian weight; backend='auto', {self.plan!r}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        weights = getattr(layer, self.WEIGHTS).to(x.dtype).expand(x.shape[1], -1)
        # a pooling keeps x's dtype under autocast, as torch's poolings do
        autocast = (torch.autocast(x.device.type, enabled=False)
                    if torch.is_autocast_enabled(x.device.type) else nullcontext())
        with autocast:
            y, layer.last_backend = knn_depthwise_conv_with_backend(x, weights, None,
                                                                    self.plan, "auto")
        return layer._mask_invalid_outputs(y)


class _BatchNormRouter(_Router):
    """fovi's KNNBatchNorm on knnconv's channels-last storage.

    knnconv's convolutions return y [B, C, N] as the transposed view of a contiguous
    [B, N, C]. For BatchNorm1d that is a strided 3-D tensor: on CUDA it copies it to contiguous
    first, in the forward and in the backward, and its output is contiguous, so the layers
    after it see another storage. The 4-D view [B, C, N, 1] of such a tensor is
    torch.channels_last contiguous, for which torch's batch norm has NHWC kernels; the router
    runs the layer's batch norm on that view, whose output keeps the input's storage. Any
    other input goes to the layer's own forward.

    The view is taken with the strides torch.channels_last gives a contiguous tensor,
    (N*C, 1, C, C), as ``view`` gives them. ``x.unsqueeze(-1)`` gives its size-1 dim stride 1
    instead, and for such an input torch's CPU batch-norm backward (torch 2.13) returns wrong
    gradients when the incoming gradient is contiguous.
    """

    forward_path = ("forward", "_check_input_dim")  # torch's _BatchNorm.forward and its check
    CHANNELS_LAST = "channels_last"  # last_backend: the batch norm ran on the 4-D view
    OWN_FORWARD = "batch_norm1d"  # last_backend: BatchNorm1d's forward ran

    def __init__(self, layer: nn.Module, backend: str, *,
                 contiguous_output: bool = False) -> None:
        super().__init__(layer)  # backend names the convolution backends, not a batch norm's
        self.contiguous_output = contiguous_output

    def describe(self) -> str:
        if self.contiguous_output:
            return ("torch's batch norm on the channels_last [B, C, N, 1] view of channels-last "
                    "input, its output then made contiguous (fovi flattens it with view); "
                    "BatchNorm1d's forward, made contiguous, on other input")
        return ("torch's batch norm on the channels_last [B, C, N, 1] view of channels-last "
                "input, whose storage the output keeps; BatchNorm1d's forward on other input")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._normalised(x)
        return y.contiguous() if self.contiguous_output else y

    def _normalised(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.layer
        if x.dim() != 3 or not is_channels_last(x):
            layer.last_backend = self.OWN_FORWARD
            return type(layer).forward(layer, x)
        layer.last_backend = self.CHANNELS_LAST
        nhwc = x.view(*x.shape, 1)  # [B, C, N, 1], strides (N*C, 1, C, C): one view op
        # The [B, C, N] result is no view of the 4-D one for autograd, so fovi's in-place ReLU
        # on it is a plain in-place op: on a view, the backward would rebuild the gradient
        # through the 4-D base (three copies), with a stride of its size-1 dim that differs
        # between eager and compiled graphs, and the CPU kernel rounds each differently. Its
        # storage is the 4-D output's alone: the batch norm's backward does not keep it.
        return torch.ops.aten._unsafe_view(self._batch_norm(nhwc), x.shape)

    def _batch_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's batch norm by the rules of BatchNorm1d's forward: batch statistics in
        training, and in eval where it keeps no running statistics; the running statistics
        updated in training where it tracks them, by its momentum or, where that is None, as
        the cumulative average over num_batches_tracked."""
        layer = self.layer
        momentum = 0.0 if layer.momentum is None else layer.momentum
        if layer.training and layer.track_running_stats and layer.num_batches_tracked is not None:
            layer.num_batches_tracked.add_(1)
            if layer.momentum is None:
                momentum = 1.0 / float(layer.num_batches_tracked)
        batch_statistics = layer.training or (layer.running_mean is None
                                              and layer.running_var is None)
        running = not layer.training or layer.track_running_stats
        if (torch.compiler.is_compiling() and layer.training and layer.track_running_stats
                and layer.weight is not None and _opaque_batch_norm()):
            y, *_, running_mean, running_var = batch_norm_train_op(
                x, layer.weight, layer.bias, layer.running_mean, layer.running_var, momentum,
                layer.eps)
            with torch.no_grad():
                layer.running_mean.copy_(running_mean)
                layer.running_var.copy_(running_var)
            return y
        return F.batch_norm(x, layer.running_mean if running else None,
                            layer.running_var if running else None, layer.weight, layer.bias,
                            batch_statistics, momentum, layer.eps)


def _opaque_batch_norm() -> bool:
    """Whether a compiled training batch norm of the usual kind (affine, tracking its running
    statistics) is one opaque op (knnconv.torch_ops.batch_norm_train_op) running cuDNN's
    kernels: where the step is replayed as a CUDA graph (graph_replay), whose GPU time alone
    counts and cuDNN's kernels take a fraction of inductor's (a fovi ResNet-18's 20 at
    B = 2048: 2.5 against 9.1 ms, bench/NOTES.md 2026-12-02). In a step run call by call the
    op's calls cost more host time than inductor's fused kernels save: a fovi ResNet-18's
    default-mode step took 17.4 / 27.8 ms with every one opaque against 13.5 / 24.3 with
    inductor's at B = 512 / 2048 (scripts/compile_batch_norm.py, bench/NOTES.md
    2026-12-07)."""
    return context.settings().graph_replay


def _routers() -> dict[type, type[_Router]]:
    """The router of each fovi layer class, most derived classes matched first by the MRO."""
    routers: dict[type, type[_Router]] = {
        fovi_knn.KNNConvLayer: _ConvRouter,
        fovi_knn.KNNDepthwiseConvLayer: _DepthwiseRouter,
        fovi_knn.KNNDepthwiseSeparableConvLayer: _DepthwiseSeparableRouter,
        fovi_knn.KNNPoolingLayer: _PoolRouter,
        fovi_norm.KNNBatchNorm: _BatchNormRouter,
    }
    # fovi's ViT module imports transformers; a model that holds one of its patch embeddings
    # has imported it already, so only a loaded module is looked at.
    knnvit = sys.modules.get("fovi.models.knnvit")
    if knnvit is not None:
        routers[knnvit.KNNPatchEmbedding] = _PatchEmbeddingRouter
    return routers


def _router_class(layer: nn.Module, routers: dict[type, type[_Router]]) -> type[_Router]:
    layer_class = type(layer)
    fovi_class = next((c for c in layer_class.__mro__ if c in routers), None)
    if fovi_class is None:
        if isinstance(layer, fovi_knn.KNNGetterLayer):
            raise _Unroutable(
                "fovi's KNNGetterLayer returns the neighbourhoods themselves, [B, C, K, Nout] "
                "with NaN in the padding slots: a gather and no arithmetic, which its "
                "torch.gather already is (it compiles with fullgraph=True as it is), so "
                "knnconv has nothing to compute faster")
        raise _Unroutable(f"knnconv has no counterpart of fovi's {layer_class.__name__}")
    overridden = [name for name in routers[fovi_class].forward_path
                  if getattr(layer_class, name, None) is not getattr(fovi_class, name, None)]
    if overridden:
        raise _Unroutable(f"{layer_class.__name__} overrides {', '.join(overridden)} of fovi's "
                          f"{fovi_class.__name__}")
    own_forward = vars(layer).get("forward")
    if own_forward is not None and not isinstance(own_forward, _Router):
        raise _Unroutable("the layer already has a forward of its own, set on the instance")
    return routers[fovi_class].for_layer(layer)


def _flattened_by_view(model: nn.Module) -> set[nn.Module]:
    """The layers whose output fovi flattens with ``view``, which needs it in the contiguous
    storage of BatchNorm1d's own forward.

    fovi's KNNResNet with a classifier views the output of its last block, or of the output
    pooling after it, which keeps its input's storage; that block computes relu(last norm +
    identity), whose in-place add and ReLU keep the storage of the last norm's output. Of a
    block of another class, whose forward this module cannot know, every layer is taken: its
    batch norms return contiguous output, its other layers are left as they are.
    """
    knnresnet = sys.modules.get("fovi.models.knnresnet")  # loaded by a model that holds one
    if knnresnet is None:
        return set()
    last_norms = {knnresnet.KNNResNetBasicBlock: "norm2", knnresnet.KNNResNetBottleneck: "norm3"}
    flattened = set()
    for resnet in model.modules():
        if isinstance(resnet, knnresnet.KNNResNet) and resnet.num_classes is not None:
            block = resnet.layer4[-1]
            last_norm = last_norms.get(type(block))
            flattened.update([getattr(block, last_norm)] if last_norm else block.modules())
    return flattened


def _holds_other_fovi_layers(module: nn.Module, inside: set[int]) -> bool:
    """Whether ``module`` holds fovi KNN layers (or batch norms) that are not in the model
    (``inside``: the ids of its modules); a module the model is part of may hold only its."""
    return any(isinstance(m, (fovi_knn.KNNBaseLayer, fovi_norm.KNNBatchNorm))
               and id(m) not in inside for m in module.modules())


def _reachable_modules(obj, seen: set[int]) -> Iterator[nn.Module]:
    """The nn.Modules a forward set on an instance can call: through bound methods,
    functools.partial, the closures and default arguments of functions, tuples, lists, sets and
    dicts, and the attributes of a callable object; not through a function's globals."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, nn.Module):
        yield obj
        return
    if isinstance(obj, types.MethodType):
        parts = [obj.__self__, obj.__func__]
    elif isinstance(obj, functools.partial):
        parts = [obj.func, *obj.args, *obj.keywords.values()]
    elif isinstance(obj, types.FunctionType):
        parts = [*_cell_contents(obj), *(obj.__defaults__ or ()),
                 *(obj.__kwdefaults__ or {}).values()]
    elif isinstance(obj, (tuple, list, set, frozenset)):
        parts = list(obj)
    elif isinstance(obj, dict):
        parts = list(obj.values())
    elif callable(obj) and not isinstance(obj, type) and hasattr(obj, "__dict__"):
        parts = list(vars(obj).values())
    else:
        return
    for part in parts:
        yield from _reachable_modules(part, seen)


_EMPTY_CELL = object()


def _cell_contents(function: types.FunctionType) -> list:
    contents = []
    for cell in function.__closure__ or ():
        try:
            contents.append(cell.cell_contents)
        except ValueError:  # a free variable not yet assigned
            contents.append(_EMPTY_CELL)
    return contents


def _rebind(obj, twins: dict[int, nn.Module], memo: dict[int, object]):
    """obj with every module of ``twins`` it reaches replaced by its twin: bound methods,
    partials and functions are rebuilt around the twins (the functions share their code and
    globals), plain tuples too; any other object is kept as it is. An object that reaches none
    is returned itself."""
    if isinstance(obj, nn.Module):
        return twins.get(id(obj), obj)
    if id(obj) in memo:
        return memo[id(obj)]
    memo[id(obj)] = obj  # a cycle back to obj (a recursive closure) keeps obj

    def same(old, new) -> bool:
        return all(a is b for a, b in zip(old, new, strict=True))

    rebuilt = obj
    if isinstance(obj, types.MethodType):
        function, owner = (_rebind(part, twins, memo) for part in (obj.__func__, obj.__self__))
        if not same((obj.__func__, obj.__self__), (function, owner)):
            rebuilt = types.MethodType(function, owner)
    elif isinstance(obj, functools.partial):
        function, args = _rebind(obj.func, twins, memo), _rebind(obj.args, twins, memo)
        keywords = {key: _rebind(value, twins, memo) for key, value in obj.keywords.items()}
        if not same((obj.func, obj.args, *obj.keywords.values()),
                    (function, args, *keywords.values())):
            rebuilt = functools.partial(function, *args, **keywords)
    elif type(obj) is tuple:  # a plain one: a namedtuple is kept as it is
        items = tuple(_rebind(item, twins, memo) for item in obj)
        if not same(obj, items):
            rebuilt = items
    elif isinstance(obj, types.FunctionType):
        contents = _cell_contents(obj)
        new_contents = [_rebind(item, twins, memo) for item in contents]
        defaults = _rebind(obj.__defaults__, twins, memo)
        kwdefaults = obj.__kwdefaults__ or {}
        new_kwdefaults = {key: _rebind(value, twins, memo) for key, value in kwdefaults.items()}
        if not same((*contents, obj.__defaults__, *kwdefaults.values()),
                    (*new_contents, defaults, *new_kwdefaults.values())):
            cells = tuple(types.CellType() if item is _EMPTY_CELL else types.CellType(item)
                          for item in new_contents)
            rebuilt = types.FunctionType(obj.__code__, obj.__globals__, obj.__name__, defaults,
                                         cells or None)
            rebuilt.__kwdefaults__ = new_kwdefaults or None
            rebuilt.__qualname__, rebuilt.__doc__ = obj.__qualname__, obj.__doc__
            rebuilt.__module__ = obj.__module__
            rebuilt.__dict__.update(obj.__dict__)
    memo[id(obj)] = rebuilt
    return rebuilt


def _structure(module: nn.Module) -> tuple:
    """What a copy.deepcopy of a module keeps: its submodules' names and classes, and its
    parameters' and buffers' names and shapes."""
    return ([(name, type(m)) for name, m in module.named_modules()],
            [(name, p.shape) for name, p in module.named_parameters()],
            [(name, b.shape) for name, b in module.named_buffers()])


def _twin(model: nn.Module, owner: nn.Module, outsider: nn.Module) -> nn.Module | None:
    """The module of ``model`` that ``outsider`` is a copy of, or was copied from: ``owner``,
    whose forward reaches ``outsider``, if it has outsider's structure, else the one module of
    the model that has it (None when none or several do)."""
    structure = _structure(outsider)
    if type(owner) is type(outsider) and _structure(owner) == structure:
        return owner
    twins = [m for m in model.modules()
             if type(m) is type(outsider) and _structure(m) == structure]
    return twins[0] if len(twins) == 1 else None


def _rebound_forwards(model: nn.Module) -> list[tuple[nn.Module, object, LayerReport]]:
    """The forwards, set on instances of ``model``'s modules, that call fovi KNN layers of
    another model, each rebuilt to call the model's own: (module, new forward, report entry).

    Such a forward is a copy's, still bound to the module it was copied from: fovi's DINOv3
    wrapper (fovi.models.dinov3.build_fovi_dinov3) sets ``model.forward`` to a closure over
    ``model.forward`` bound to the model it builds, which copy.deepcopy does not copy, so a
    copy runs the original's layers. accelerate would route the copy's layers while calling
    the copy runs the original's. A forward whose outside modules have no twin in the model
    (a module with their structure) cannot be rebound: ValueError, before anything changes.
    """
    inside = {id(m) for m in model.modules()}

    def outside(callable_) -> list[nn.Module]:
        return [m for m in _reachable_modules(callable_, set())
                if id(m) not in inside and _holds_other_fovi_layers(m, inside)]

    rebound = []
    for name, module in model.named_modules():
        forward = vars(module).get("forward")
        # a router's layer is its own in a copy too (copy.deepcopy copies the router with it)
        if forward is None or isinstance(forward, _Router):
            continue
        outsiders = outside(forward)
        if not outsiders:
            continue
        where = "the model" if name == "" else repr(name)
        twins: dict[int, nn.Module] = {}
        targets = []
        for outsider in outsiders:
            twin = _twin(model, module, outsider)
            if twin is None:
                raise ValueError(
                    f"{where} ({type(module).__name__}) has a forward, set on the instance, "
                    f"that calls a {type(outsider).__name__} outside the model, which holds "
                    f"fovi KNN layers and is the twin of no module of the model: calling the "
                    f"model would run that module's layers, not the ones accelerate routes. "
                    f"Set a forward that calls the model's own modules (`del module.forward` "
                    f"restores its class's) and accelerate again.")
            twins.update((id(a), b) for a, b in zip(outsider.modules(), twin.modules(),
                                                    strict=True))
            target = next(n for n, m in model.named_modules() if m is twin)
            targets.append("the model" if target == "" else repr(target))
        new_forward = _rebind(forward, twins, {})
        if outside(new_forward):
            raise ValueError(
                f"{where} ({type(module).__name__}) has a forward, set on the instance, that "
                f"calls fovi KNN layers of another model through an object accelerate cannot "
                f"rebuild (a list, dict or callable object; it rebuilds bound methods, "
                f"functools.partial, closures and tuples): calling the model would run that "
                f"model's layers, not the ones accelerate routes. Set a forward that calls the "
                f"model's own modules (`del module.forward` restores its class's) and "
                f"accelerate again.")
        detail = (f"its forward, set on the instance, called the layers of another "
                  f"{'/'.join(sorted({type(m).__name__ for m in outsiders}))} (as a copy's "
                  f"forward still bound to its original does); rebound to "
                  f"{', '.join(dict.fromkeys(targets))} of this model")
        rebound.append((module, new_forward, LayerReport(name, type(module).__name__, detail)))
    return rebound


@dataclass(frozen=True)
class LayerReport:
    """One fovi KNN layer of the model: how it now runs, or why it was left as it is."""

    name: str  # its name in model.named_modules(); "" is the model itself
    layer_class: str
    detail: str

    def __str__(self) -> str:
        return f"{self.name or '<model>'} ({self.layer_class}): {self.detail}"


@dataclass
class AccelerationReport:
    """What :func:`accelerate_with_report` did to each fovi KNN layer of a model."""

    routed: list[LayerReport] = field(default_factory=list)
    left: list[LayerReport] = field(default_factory=list)
    # fovi's KNNBatchNorm layers, which now keep knnconv's channels-last storage, and those
    # left as they are, of which accelerate does not warn: they cost a copy, not knnconv's
    # kernels
    batch_norms: list[LayerReport] = field(default_factory=list)
    batch_norms_left: list[LayerReport] = field(default_factory=list)
    # modules whose forward, set on the instance, called fovi KNN layers of another model (a
    # copy's forward still bound to its original) and now calls the model's own
    forwards_rebound: list[LayerReport] = field(default_factory=list)
    # ReLUs whose max pooling now applies them (mode max_relu); their forward passes x on
    relus_fused: list[LayerReport] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"knnconv routed {len(self.routed)} fovi KNN layer(s) and left "
                 f"{len(self.left)} as they are; {len(self.batch_norms)} batch norm(s) keep "
                 f"its channels-last storage, {len(self.batch_norms_left)} left as they are"]
        lines += [f"  routed: {entry}" for entry in self.routed]
        lines += [f"  left: {entry}" for entry in self.left]
        lines += [f"  batch norm: {entry}" for entry in self.batch_norms]
        lines += [f"  batch norm left: {entry}" for entry in self.batch_norms_left]
        lines += [f"  forward rebound: {entry}" for entry in self.forwards_rebound]
        lines += [f"  ReLU fused: {entry}" for entry in self.relus_fused]
        return "\n".join(lines)


def accelerate_with_report(model: nn.Module,
                           backend: str = "auto") -> tuple[nn.Module, AccelerationReport]:
    """Like :func:`accelerate`, returning the model and the report instead of warning."""
    if backend != "auto":
        get_ops(backend)  # an unknown name raises here, before any layer has changed
    rebound = _rebound_forwards(model)  # raises, before anything changes, where it cannot
    report = AccelerationReport()
    for module, forward, entry in rebound:
        module.forward = forward
        report.forwards_rebound.append(entry)
    routers = _routers()
    flattened_by_view = _flattened_by_view(model)
    relus_before = {id(pool): (relu_name, relu)
                    for relu_name, relu, _, pool in _relu_pool_pairs(model)}
    for name, layer in model.named_modules():
        if not isinstance(layer, (fovi_knn.KNNBaseLayer, fovi_norm.KNNBatchNorm)):
            continue
        try:
            router_class = _router_class(layer, routers)
            if layer not in flattened_by_view:
                router = router_class(layer, backend)
            elif router_class is _BatchNormRouter:
                router = router_class(layer, backend, contiguous_output=True)
            else:  # a layer of a block this module does not know
                raise _Unroutable("fovi flattens its output with view, which needs the "
                                  "contiguous storage of its own forward")
        except _Unroutable as why:
            left = (report.batch_norms_left if isinstance(layer, fovi_norm.KNNBatchNorm)
                    else report.left)
            left.append(LayerReport(name, type(layer).__name__, str(why)))
            continue
        if isinstance(router, _PoolRouter) and id(layer) in relus_before:
            relu_name, relu = relus_before[id(layer)]
            router.fuse_relu()
            relu.forward = _FusedRelu()
            report.relus_fused.append(LayerReport(relu_name, "ReLU", f"applied by {name}"))
        layer.forward = router
        layer.last_backend = None
        routed = report.batch_norms if isinstance(router, _BatchNormRouter) else report.routed
        routed.append(LayerReport(name, type(layer).__name__, router.describe()))
    return model, report


def accelerate(model: nn.Module, backend: str = "auto") -> nn.Module:
    """Route every KNN layer of a fovi model through knnconv, in place; returns the model.

    Each routed layer stays the same object, with the same class, attributes, parameters and
    state_dict; it gets a new ``forward`` (an instance attribute: ``del layer.forward`` gives
    fovi's back, and of a max pooling that applies the ReLU before it, ``del relu.forward``
    too: see ``relus_fused``) and ``last_backend``, the name of the backend that ran its last
    call (of a batch norm: ``"channels_last"`` or ``"batch_norm1d"``, its own forward); a
    gaussian pooling also gets its weights as a non-persistent buffer. A forward set on an instance
    that calls fovi KNN layers of another model (a copy's, still bound to its original) is
    rebuilt to call the model's own, or, where it cannot be, accelerate raises ValueError
    before changing anything.
    ``backend`` is knnconv's (see :func:`knnconv.knn_conv`). Layers that cannot be routed are
    left as they are, and a warning lists them with the reason; so does a model with no fovi
    KNN layer. :func:`accelerate_with_report` returns the report instead.
    """
    model, report = accelerate_with_report(model, backend)
    if report.left or not report.routed:
        warnings.warn(str(report), stacklevel=2)
    return model
