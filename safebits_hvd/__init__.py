"""SafeBits: Safety-Constrained Global Bit Budgeting with Error Feedback (SCGB-EF) for Horovod and PyTorch.

    compression = safebits_hvd.SafeBits(model.named_parameters(), budget_bits=4.0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)

Where each idea lives (docs/DESIGN.md has the module map and the life of one step), by layer, top to bottom:

* :mod:`.frontends`: Horovod's compressor (``SafeBits``), its elastic state, DDP's hook (public as
  :mod:`safebits_hvd.ddp`), FSDP2's reduce-scatter (:mod:`safebits_hvd.fsdp`), the baselines and the launcher;
* :mod:`.step`: the framework-free step engine (``SafeBitsCore``), the send with its escalation, the close, error
  feedback, checkpoints;
* :mod:`.policy`: the allocation under the budget, the screen's rule, schedules and ``auto``, step records;
* :mod:`.comm`: the collective paths, transports, the statistics exchange, the step clock;
* :mod:`.codec`: the action menu, the wire format, the RNG, the kernels (CPU and CUDA) and the host seam.
"""

from .codec.actions import ACTIONS, BF16, DEFAULT_MENU, FP16, FP32, Action, ActionKind, Menu, make_menu
from .errors import SafeBitsConsistencyError, SafeBitsError, SafeBitsNonFiniteError, SafeBitsTimeoutError
from .frontends.elastic import register as _register_elastic_handler
from .frontends.horovod import SafeBits
from .policy.auto import Auto
from .policy.schedules import BandwidthAware, Constant, ConvergenceRamp, SNRAware
from .policy.telemetry import StepRecord

__all__ = [
    "ACTIONS", "BF16", "DEFAULT_MENU", "FP16", "FP32", "Action", "ActionKind", "Auto", "BandwidthAware", "Constant",
    "ConvergenceRamp", "Menu", "SNRAware", "SafeBits", "SafeBitsConsistencyError", "SafeBitsError",
    "SafeBitsNonFiniteError", "SafeBitsTimeoutError", "StepRecord", "make_menu",
]
__version__ = "0.1.0"

_register_elastic_handler()      # hvd.elastic.TorchState(..., compression=SafeBits(...)) then handles its state
