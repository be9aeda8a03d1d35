"""fasthealth: fused, sync-free health checks for training large models.

The public names of SPEC.md; see README.md for a tour.
"""

from .backends import available_backends
from .checks import check_grads, check_tensor_health, multi_tensor_stats, tensor_stats
from .stats import FIELDS, MultiTensorStats, TensorStats

__version__ = "0.1.0"

__all__ = [
    "FIELDS",
    "MultiTensorStats",
    "TensorStats",
    "available_backends",
    "check_grads",
    "check_tensor_health",
    "multi_tensor_stats",
    "tensor_stats",
]
