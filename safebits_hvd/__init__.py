"""SafeBits: Safety-Constrained Global Bit Budgeting with Error Feedback (SCGB-EF) for Horovod and PyTorch.

    compression = safebits_hvd.SafeBits(model.named_parameters(), budget_bits=4.0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)

Where each idea lives: :mod:`.actions` (menu and modeled bits), :mod:`.rng` (counter-based RNG),
:mod:`.kernels` (fused screen / quantize / EF passes, CPU and CUDA), :mod:`.screen` (admissibility),
:mod:`.allocator` (global knapsack), :mod:`.memory` (error feedback), :mod:`.sync` (rank agreement),
:mod:`.compressor` (the Horovod compressor), :mod:`.telemetry` (step records), :mod:`.schedules` (budgets),
:mod:`.baselines` (the compressors we compare with).
"""

from .actions import ACTIONS, BF16, DEFAULT_MENU, FP16, FP32, Action, ActionKind, Menu, make_menu
from .compressor import SafeBits
from .errors import SafeBitsConsistencyError, SafeBitsError, SafeBitsNonFiniteError
from .schedules import BandwidthAware, Constant, ConvergenceRamp, SNRAware
from .telemetry import StepRecord

__all__ = [
    "ACTIONS", "BF16", "DEFAULT_MENU", "FP16", "FP32", "Action", "ActionKind", "BandwidthAware", "Constant",
    "ConvergenceRamp", "Menu", "SNRAware", "SafeBits", "SafeBitsConsistencyError", "SafeBitsError",
    "SafeBitsNonFiniteError", "StepRecord", "make_menu",
]
__version__ = "0.1.0"
