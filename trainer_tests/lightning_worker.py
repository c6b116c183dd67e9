"""Lightning worker: SafeBits' DDP hook under ``lightning.Trainer`` (DDPStrategy, Gloo, CPU, 2 ranks).

Run as ``python trainer_tests/lightning_worker.py --out DIR``: the script is the launcher (``devices=2``: Lightning
starts rank 1 by running this script again), as a user runs a Lightning script. Every rank builds the trainer
before the process group exists, so ``SafeBitsState`` is built lazily (see its docstring) from the
LightningModule's ``named_parameters()``. After ``fit`` each rank writes ``DIR/rank<r>.json``: the loss on the
whole data set before and after, its parameters' SHA-256 and SafeBits' figures; a bad registration writes the
error instead (``--wrong-model``).

``--register`` chooses how the hook reaches DDP:

* ``callback`` (the recipe): a ``Callback`` registers it in ``on_fit_start``, on the DDP model Lightning built.
* ``strategy``: ``DDPStrategy(ddp_comm_state=state, ddp_comm_hook=safebits_hook)`` alone. Lightning 2.6 hands
  these to DDP only on CUDA (``DDPStrategy._register_ddp_hooks``): on this CPU run the hook never runs, which the
  test's checks catch.
* ``none``: no hook (the mutation check).
"""

import argparse
import json
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader
from workload import BUDGET_BITS, STEPS, digits, full_loss, mlp, params_digest

from safebits_hvd import ddp as sbddp
from safebits_hvd.frontends.launch import exit_without_finalization


class DigitsModule(L.LightningModule):
    """A small MLP classifier; the layers exist at construction, so SafeBitsState can be built from them."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class SafeBitsHook(L.Callback):
    """Registers SafeBits on the DDP model the strategy built (``trainer.strategy.model``): ``on_fit_start`` runs
    after DDP wraps the module and before the first backward, on every device type."""

    def __init__(self, state: sbddp.SafeBitsState) -> None:
        self.state = state

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.strategy.model.register_comm_hook(self.state, sbddp.safebits_hook)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--register", choices=("callback", "strategy", "none"), default="callback")
    parser.add_argument("--wrong-model", action="store_true",
                        help="build the state from another module's parameters (a clear error is expected)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    data = digits()
    module = DigitsModule()
    # Built before the process group exists: the state checks it at the first hook call.
    source = mlp() if args.wrong_model else module
    state = sbddp.SafeBitsState(source.named_parameters(), budget_bits=BUDGET_BITS)
    strategy = (DDPStrategy(process_group_backend="gloo", ddp_comm_state=state, ddp_comm_hook=sbddp.safebits_hook)
                if args.register == "strategy" else DDPStrategy(process_group_backend="gloo"))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=STEPS,
                        callbacks=[SafeBitsHook(state)] if args.register == "callback" else [],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    loss_before = full_loss(module, data)
    loader = DataLoader(data, batch_size=32, shuffle=True)       # Lightning shards it (DistributedSampler)
    report: dict[str, Any] = {"loss_before": loss_before}
    try:
        trainer.fit(module, loader)
    except ValueError as exc:                   # --wrong-model: raised by the hook on every rank
        report["error"] = str(exc)
    rank = trainer.global_rank
    if "error" not in report:
        assert dist.get_backend() == "gloo", dist.get_backend()
        record = state.last_step
        report.update(
            loss_after=full_loss(module, data), digest=params_digest(module), world_size=trainer.world_size,
            global_step=trainer.global_step, safebits_steps=state.step, records=len(state.history),
            elements=sum(p.numel() for p in module.parameters()),
            last_step=None if record is None else {
                "step": record.step, "wire_bytes": record.wire_bytes, "collective": record.collective,
                "modeled_compression_ratio": record.modeled_compression_ratio, "violation": record.violation})
    out = args.out / f"rank{rank}.json"
    out.write_text(json.dumps(report, indent=1))
    print(f"rank {rank} wrote {out}", flush=True)
    if dist.is_initialized():
        dist.barrier()          # both reports written before either rank leaves
    exit_without_finalization(0)


if __name__ == "__main__":
    main()
