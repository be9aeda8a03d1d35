"""fasthealth: fused, sync-free health checks for training large models.

The public names of the contract (docs/spec.md); see README.md for a tour.
"""

from .activations import ActivationMonitor
from .checks import (
    check_grads,
    check_params,
    check_tensor_health,
    multi_tensor_stats,
    tensor_stats,
)
from .integrations.watch import watch
from .monitor import (
    ActOptions,
    Analyser,
    CauseConfig,
    DetectOptions,
    Event,
    Incident,
    IncidentConfig,
    LogOptions,
    MeasureOptions,
    Monitor,
    NonFiniteError,
    Observation,
    PrecursorOptions,
    ReplayResult,
    RollbackBudgetError,
    RollbackConfig,
    replay,
    skip_quarantined,
)
from .ops import available_backends
from .ops.layout import FIELDS
from .optim import OptimizerHealth, check_optimizer
from .stats import MultiTensorStats, RangeStats, TensorStats

__version__ = "0.1.0"

__all__ = [
    "FIELDS",
    "ActOptions",
    "ActivationMonitor",
    "Analyser",
    "CauseConfig",
    "DetectOptions",
    "Event",
    "Incident",
    "IncidentConfig",
    "LogOptions",
    "MeasureOptions",
    "Monitor",
    "MultiTensorStats",
    "NonFiniteError",
    "Observation",
    "OptimizerHealth",
    "PrecursorOptions",
    "RangeStats",
    "ReplayResult",
    "RollbackBudgetError",
    "RollbackConfig",
    "TensorStats",
    "available_backends",
    "check_grads",
    "check_optimizer",
    "check_params",
    "check_tensor_health",
    "multi_tensor_stats",
    "replay",
    "skip_quarantined",
    "tensor_stats",
    "watch",
]
