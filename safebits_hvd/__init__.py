"""SafeBits: Safety-Constrained Global Bit Budgeting with Error Feedback (SCGB-EF) for Horovod and PyTorch.

    compression = safebits_hvd.SafeBits(model.named_parameters(), budget_bits=4.0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)

Where each idea lives (docs/DESIGN.md has the module map and the life of one step):

* the algorithm, framework-free: :mod:`.core` (the step and its state object), :mod:`.policy` (allocation, start
  policy, screen, escalation, fallback), :mod:`.allocator` (the global knapsack), :mod:`.screen` (admissibility),
  :mod:`.memory` (error feedback), :mod:`.statistics` (the exchanged statistics, defined once), :mod:`.exchange`
  (rank agreement: the transport seam), :mod:`.telemetry` (step records), :mod:`.checkpoint` (saved state),
  :mod:`.schedules` (budgets);
* quantization: :mod:`.actions` (menu and modeled bits), :mod:`.kernels` (fused screen / quantize / EF passes, CPU
  and CUDA), :mod:`.rng` (counter-based RNG);
* front ends: :mod:`.compressor` (the Horovod compressor), :mod:`.elastic` (its state in Horovod's elastic
  ``TorchState``, registered on import), :mod:`.baselines` (the compressors we compare with); :mod:`.launch`
  starts ``horovodrun`` for the tests, benchmarks and demo.
"""

from .actions import ACTIONS, BF16, DEFAULT_MENU, FP16, FP32, Action, ActionKind, Menu, make_menu
from .auto import Auto
from .compressor import SafeBits
from .elastic import register as _register_elastic_handler
from .errors import SafeBitsConsistencyError, SafeBitsError, SafeBitsNonFiniteError, SafeBitsTimeoutError
from .schedules import BandwidthAware, Constant, ConvergenceRamp, SNRAware
from .telemetry import StepRecord

__all__ = [
    "ACTIONS", "BF16", "DEFAULT_MENU", "FP16", "FP32", "Action", "ActionKind", "Auto", "BandwidthAware", "Constant",
    "ConvergenceRamp", "Menu", "SNRAware", "SafeBits", "SafeBitsConsistencyError", "SafeBitsError",
    "SafeBitsNonFiniteError", "SafeBitsTimeoutError", "StepRecord", "make_menu",
]
__version__ = "0.1.0"

_register_elastic_handler()      # hvd.elastic.TorchState(..., compression=SafeBits(...)) then handles its state
