"""knnconv: fast KNN convolution on irregular, foveated sensor layouts."""

from . import context
from ._version import __version__
from .context import keep_input_relayout, set_keep_input_relayout
from .depthwise import KNNDepthwiseConv, KNNDepthwiseSeparableConv
from .functional import KNNConvFunction, knn_conv, knn_conv_with_backend
from .layers import KNNConv
from .ops import available_backends, get_ops, register_ops
from .plan import KNNConvPlan, compact_tables, make_plan
from .pool import KNNPool, knn_pool
from .prepare import warm_up

__all__ = [
    "KNNConv", "KNNConvFunction", "KNNConvPlan", "KNNDepthwiseConv", "KNNDepthwiseSeparableConv",
    "KNNPool", "__version__", "available_backends", "compact_tables", "context", "get_ops",
    "keep_input_relayout", "knn_conv", "knn_conv_with_backend", "knn_pool", "make_plan",
    "register_ops", "set_keep_input_relayout", "warm_up",
]
