"""knnconv: fast KNN convolution on irregular, foveated sensor layouts."""

from .functional import KNNConvFunction, knn_conv, knn_conv_with_backend
from .layers import KNNConv
from .ops import available_backends, get_ops, register_ops
from .plan import KNNConvPlan, compact_tables, make_plan

__version__ = "0.1.0"

__all__ = [
    "KNNConv", "KNNConvFunction", "KNNConvPlan", "available_backends", "compact_tables",
    "get_ops", "knn_conv", "knn_conv_with_backend", "make_plan", "register_ops",
]
