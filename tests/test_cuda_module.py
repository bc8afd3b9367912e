"""knnconv.cuda is the native kernels' module-level API under its design's name."""

import knnconv.cuda
import knnconv.ops.cuda


def test_knnconv_cuda_gives_the_native_modules_public_names():
    assert set(knnconv.cuda.__all__) == set(knnconv.ops.cuda.__all__)
    for name in knnconv.cuda.__all__:
        assert getattr(knnconv.cuda, name) is getattr(knnconv.ops.cuda, name)
    for name in ("forward", "grad_input", "grad_weight", "backward_combined", "CudaOps",
                 "KernelConfig", "default_config", "default_grad_weight_ksplit",
                 "clear_kernel_cache"):
        assert name in knnconv.cuda.__all__
