"""The native CUDA kernels' module-level API, under the name the design it implements gives
it (``knnconv.cuda``): :func:`forward`, :func:`grad_input`, :func:`grad_weight`,
:func:`backward_combined`, :class:`CudaOps`, :class:`KernelConfig`, the ``default_*`` tile
heuristics and :func:`clear_kernel_cache`.

The contract: float16/bfloat16 CUDA operands (fp32 accumulation), the persistent int32
``input_linear``/``weight_linear`` tables of :func:`knnconv.compact_tables`, outputs
[B, Cout, Nout] as a transposed view of a [B, Nout, Cout] buffer and float32 gradients; a
KernelConfig the device cannot run, or a ``ksplit`` finer than the batch's k-steps, is refused
with ValueError. The implementation lives in :mod:`knnconv.ops.cuda`.
"""

from .ops import cuda as _native
from .ops.cuda import *  # noqa: F403  (the names of _native.__all__)

__all__ = list(_native.__all__)
