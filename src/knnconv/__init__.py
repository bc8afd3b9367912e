"""knnconv: fast KNN convolution on irregular, foveated sensor layouts."""

from .depthwise import KNNDepthwiseConv, KNNDepthwiseSeparableConv
from .functional import (
    KNNConvFunction,
    keep_input_relayout,
    knn_conv,
    knn_conv_with_backend,
    set_keep_input_relayout,
)
from .layers import KNNConv
from .ops import available_backends, get_ops, register_ops
from .plan import KNNConvPlan, compact_tables, make_plan
from .pool import KNNPool, knn_pool
from .prepare import warm_up

__version__ = "0.1.0"

__all__ = [
    "KNNConv", "KNNConvFunction", "KNNConvPlan", "KNNDepthwiseConv", "KNNDepthwiseSeparableConv",
    "KNNPool", "available_backends", "compact_tables", "get_ops", "keep_input_relayout", "knn_conv",
    "knn_conv_with_backend", "knn_pool", "make_plan", "register_ops", "set_keep_input_relayout",
    "warm_up",
]
