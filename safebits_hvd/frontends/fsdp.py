"""The FSDP2 front end: SafeBits as the reduce-scatter of every ``fully_shard`` module (docs/DESIGN.md, "The life
of one step under FSDP2").

    from torch.distributed.fsdp import fully_shard
    from safebits_hvd import fsdp as sbfsdp
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = sbfsdp.compress(model, budget_bits=4.4)
    ...
    state.last_step        # the StepRecord of the last step, as with the other front ends

FSDP2 reduces each module's gradients in one flat buffer laid out by rank: row ``r`` holds, for every parameter of
the module in order, its dim-0 chunk ``r`` (padded to ``ceil(rows / P)`` rows). Every (parameter, row) is a member
of ONE core for the whole model (one budget, one statistics exchange, one :class:`~safebits_hvd.StepRecord` a step),
with its own action, screen and error-feedback residual: the residuals cover this rank's full local gradient. FSDP
calls a module's reduce-scatter once its gradients are ready (the last module of the forward first) and reads the
output as soon as the call returns, so each call is a whole collective of its own:

1. **Send**: the module's members, one group of the step on the reduce-scatter path, each owned by the rank of its
   row (one batched pass); before the step's first payload moves, every rank's allocation is compared
   (:class:`~safebits_hvd.comm.transports.AllocationCheck`).
2. **Scatter**: one alltoall sends row ``r``'s payloads to rank ``r``
   (:class:`~safebits_hvd.comm.reduce_scatter.ReduceScatterPath`).
3. **Sum**: this rank's row decoded and summed over ranks in rank order and divided as FSDP's op asks (``AVG``: by
   the rank count; ``SUM``: not at all; FSDP divides before and after itself where it uses ``SUM``): FSDP's
   output.
4. **Close**: after the step's last module the core ends the step: its statistics exchange runs during the
   optimizer step and the next forward, as under DDP.

``budget_bits=32``, and ``"auto"`` where compression does not pay, pass through: FSDP's own reduce-scatter runs on the
values (a residual of earlier steps added once; ``StepRecord.pass_through``).

**The inter-node hop only** (HSDP): shard each module over the GPUs of a node (``fully_shard(m,
mesh=mesh["shard"])``, a 1-D mesh: FSDP's own reduce-scatter stays inside the node) and pass the group across nodes,
``sbfsdp.compress(model, replicate_group=mesh["replicate"].get_group())``: SafeBits then all-reduces each module's
shard across the replicas (FSDP's all-reduce hook, run after its reduce-scatter), one member per parameter's row
of this rank's shard, the same steps 1-4 over the replicate group on the allgather path (every replica needs the
whole shard; ``AVG``: by its size; ``budget_bits`` a number or a schedule). FSDP's native HSDP (a 2-D mesh given to
``fully_shard``) runs its own all-reduce before any hook: refused.

Steps without gradient synchronization (``set_requires_gradient_sync(False)``) call no reduce-scatter: nothing is
sent, FSDP accumulates. A rank sends and receives ``(P - 1) / P`` of its payloads, as FSDP's own reduce-scatter
moves ``(P - 1) / P`` of the gradient: ``b / 32`` of its bytes at any rank count (docs/RESULTS.md 8.2).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..codec.actions import DEFAULT_MENU, Menu
from ..comm.exchange import DEFAULT_TIMEOUT
from ..comm.transports import over_process_group
from ..step.core import Grouping, Handle
from .shared import CoreView, build_core_over

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover - a torch without FSDP2
    FSDPModule = None
    ReduceScatter = object


NOT_SHARDED = ("the model holds no FSDP module with parameters: call fully_shard on it (and its blocks) before "
               "safebits_hvd.fsdp.compress")


@dataclass(frozen=True)
class ShardedModule:
    """One ``fully_shard`` module's buffer: its members' first core index, its parameters' names, the elements of
    each parameter's row (its padded dim-0 chunk) and the rows this rank sends (every row of the reduce-scatter's
    buffer; this rank's own across replicas)."""

    module: Any
    first: int              # core index of (parameter 0, rows[0]); (j, rows[k]) is first + k * len(names) + j
    names: tuple[str, ...]
    row_numels: tuple[int, ...]
    rows: tuple[int, ...]

    @property
    def row(self) -> int:
        """Elements of one rank's row of the buffer."""
        return sum(self.row_numels)

    @property
    def indices(self) -> list[int]:
        """The core indices of the module's members, row by row."""
        return list(range(self.first, self.first + len(self.rows) * len(self.names)))

    def indices_of(self, row: int) -> list[int]:
        """The core indices of row ``row``'s members."""
        first = self.first + self.rows.index(row) * len(self.names)
        return list(range(first, first + len(self.names)))


def _row_numel(size: torch.Size, ranks: int) -> int:
    """Elements of one rank's chunk of a parameter of ``size`` sharded on dim 0 (rows padded to a multiple of
    ``ranks``, as FSDP2 pads them)."""
    rows = -(-size[0] // ranks) if len(size) else 1
    rest = int(np.prod(size[1:])) if len(size) > 1 else 1
    return rows * rest


def sharded_modules(model: torch.nn.Module, ranks: int, rows: tuple[int, ...]) -> list[ShardedModule]:
    """The modules of ``model`` that ``fully_shard`` made FSDP modules with parameters (sharded over ``ranks``), in
    ``model.modules()`` order, and the layout of each one's buffer, of which this rank sends ``rows``.
    ``ValueError`` for what this front end cannot reduce: no FSDP module, a module with several parameter groups,
    or a parameter sharded on another dimension."""
    if FSDPModule is None:
        raise RuntimeError("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"compress takes the model fully_shard was applied to, got {type(model).__name__}")
    names_by_id = {id(p): n for n, p in model.named_parameters()}
    out: list[ShardedModule] = []
    first = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = module._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise ValueError(f"{type(module).__name__} has {len(groups)} FSDP parameter groups (a per-parameter "
                             f"mesh); SafeBits' reduce-scatter takes one group per module")
        params = [p for g in groups for p in g.fsdp_params]
        if not params:
            continue
        names, numels = [], []
        for p in params:
            if p.fsdp_placement.dim != 0:
                raise ValueError(f"parameter {names_by_id.get(id(p.sharded_param), '?')!r} is sharded on dimension "
                                 f"{p.fsdp_placement.dim}; SafeBits' reduce-scatter takes dimension 0 only")
            names.append(names_by_id.get(id(p.sharded_param), f"{type(module).__name__}.{len(names)}"))
            numels.append(_row_numel(p._orig_size, ranks))
        out.append(ShardedModule(module, first, tuple(names), tuple(numels), rows))
        first += len(rows) * len(names)
    if not out:
        raise ValueError(NOT_SHARDED)
    return out


class FSDPState(CoreView):
    """SafeBits' state for one FSDP2 model: one core over every module's reduce-scatter rows (see the module
    docstring). Made by :func:`compress`; ``last_step``, ``history``, ``memory``, ``state_dict`` and
    ``load_state_dict`` as on the other front ends (each rank saves its own residuals)."""

    def __init__(self, model: torch.nn.Module, process_group: Any, replicate_group: Any,
                 budget_bits: float | str | Callable[[int], float],
                 max_distortion: float, min_cosine: float, menu: Menu | Iterable[str], seed: int,
                 log_path: str | os.PathLike[str] | None, *, sample_buckets: int, consistency_check_every: int,
                 nonfinite: str, screen: bool, name: str, max_history: int, timeout: float | None,
                 residual_dtype: torch.dtype) -> None:
        if isinstance(budget_bits, str) and replicate_group is not None:
            raise ValueError(f"budget_bits={budget_bits!r}: across replicas (replicate_group=) the FSDP front end "
                             f"takes a number of bits or a schedule; 'auto' needs a pass-through all-reduce it does "
                             f"not have yet")
        self.process_group, self.replicate_group = process_group, replicate_group
        self.ranks = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        # The group SafeBits' collectives run on: the shard group's reduce-scatter, or the replicas' all-reduce.
        self.group = process_group if replicate_group is None else replicate_group
        self.group_size = dist.get_world_size(self.group)
        rows = tuple(range(self.ranks)) if replicate_group is None else (self.rank,)
        self.modules = sharded_modules(model, self.ranks, rows)
        names = [f"{n}#row{r}" for m in self.modules for r in m.rows for n in m.names]
        numels = np.array([k for m in self.modules for _ in m.rows for k in m.row_numels], dtype=np.int64)
        # Sharded: each row's members go to the rank that owns the row (the reduce-scatter path); across replicas
        # every replica needs the whole shard (allgather).
        owners = np.array([r for m in self.modules for r in m.rows for _ in m.names], dtype=np.int64)
        links = over_process_group(self.group)
        self.core = build_core_over(
            names, numels, budget_bits, max_distortion, min_cosine, menu, seed, log_path,
            sample_buckets=sample_buckets, consistency_check_every=consistency_check_every, nonfinite=nonfinite,
            screen=screen, name=name, max_history=max_history, timeout=timeout, exchange=links.exchange,
            transport=links.transport, fusion_bytes=0, residual_dtype=residual_dtype,
            **({"collective": "allgather"} if replicate_group is not None else
               {"collective": "reduce_scatter", "owners": owners}))
        if replicate_group is None:           # each rank gets back its shard of the mean: ||mean||^2 sums them
            self.core.noise.sum_over_shards = partial(_summed, group=self.group)
        self.names = self.core.names

    def reduce_scatter(self, module: ShardedModule, output: torch.Tensor, values: torch.Tensor, op: Any) -> None:
        """Steps 1-4 of the module docstring for one module's reduce-scatter buffer ``values`` (every row); this
        rank's row of the reduced buffer into ``output``."""
        if op == dist.ReduceOp.AVG:
            divisor = float(self.ranks)
        elif op == dist.ReduceOp.SUM:
            divisor = 1.0
        else:
            raise ValueError(f"FSDP asked for a reduce-scatter with {op}; SafeBits' takes AVG and SUM (leave "
                             f"set_gradient_divide_factor unset)")
        if values.numel() != self.ranks * module.row or output.numel() != module.row:
            raise ValueError(
                f"the reduce-scatter of {module.names[0]!r}... holds {values.numel()} elements for {self.ranks} rows "
                f"of {module.row}: SafeBits' FSDP reduce-scatter needs a gradient for every parameter of each FSDP "
                f"module every step (a parameter without one is left out of FSDP's buffer)")
        totals = self._reduce(module, values, divisor, output, op)
        if totals is not None:
            output.reshape(-1).copy_(torch.cat([t.reshape(-1) for t in totals]))

    def all_reduce(self, module: ShardedModule, shard: torch.Tensor) -> None:
        """Steps 1-4 for this rank's shard of one module across the replicas (FSDP's all-reduce hook): the mean
        over the replicate group, written over ``shard``."""
        if shard.numel() != module.row:
            raise ValueError(f"the all-reduce hook of {module.names[0]!r}... got {shard.numel()} elements for a "
                             f"shard of {module.row}: SafeBits needs a gradient for every parameter of each FSDP "
                             f"module every step")
        totals = self._reduce(module, shard, float(self.group_size))
        assert totals is not None
        if not (shard.dtype == torch.float32 and shard.is_contiguous()):
            shard.reshape(-1).copy_(torch.cat([t.reshape(-1) for t in totals]))

    def _reduce(self, module: ShardedModule, values: torch.Tensor, divisor: float, output: torch.Tensor | None = None,
                op: Any = None) -> list[torch.Tensor] | None:
        """Steps 1-4 over ``values`` (the module's rows this rank sends, back to back): the sums over
        :attr:`group` of this rank's row, divided by ``divisor``; in place where ``values`` is contiguous float32.
        A pass-through step (``budget_bits`` of 32, or ``"auto"`` where compression does not pay) runs FSDP's own
        reduce-scatter with ``op`` into ``output`` instead, of the values (a residual of earlier steps added once),
        and returns None."""
        core = self.core
        handle = core.begin(Grouping(0, "the FSDP modules' layout", "safebits_hvd.fsdp.compress"))
        # 1. Send (and 2): every member of the module; a contiguous float32 buffer is decoded back in place.
        indices = module.indices
        in_place = values.dtype == torch.float32 and values.is_contiguous()
        if not handle.packed:
            assert output is not None, "only a sharded state passes through"
            if not core.pass_through_unchanged(indices, values):        # a residual to add, or values to check
                work = values.reshape(-1) if in_place else values.reshape(-1).float()
                pieces = list(work.split(list(module.row_numels) * len(module.rows)))
                core.send_group(indices, pieces, pieces, close=False)
                values = work if in_place else work.to(values.dtype)
            core.close()
            # Waited as FSDP waits for its own (the process group's timeout): Gloo completes it only in wait().
            dist.reduce_scatter_tensor(output, values.reshape(-1), op=op, group=self.group)
            core.noise.reduced([output.reshape(-1)])
            return self._end(handle, None)
        pieces = list(values.reshape(-1).split(list(module.row_numels) * len(module.rows)))
        intos = pieces if in_place else [None] * len(pieces)
        # 2. Gather or scatter: the sizes at the allocated actions are the same on every rank, so nothing waits.
        core.send_group(indices, pieces, intos, close=False)
        core.close()
        # 3. Sum, in rank order: this rank's row.
        mine = module.indices_of(self.rank) if self.replicate_group is None else indices
        first = indices.index(mine[0])
        return self._end(handle, core.reduced_sums(mine, handle, intos[first:first + len(mine)], divisor=divisor))

    def _end(self, handle: Handle, totals: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """4. Close: the step's last module ends it."""
        if not self.core.in_step:
            self.core.end(handle.step)
        return totals


def _summed(value: torch.Tensor, group: Any) -> torch.Tensor:
    """``value`` summed over ``group`` (a shard's ||mean||^2, for the noise meter)."""
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value


class SafeBitsReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter for one module (``FSDPModule.set_custom_reduce_scatter``): SafeBits through the
    model's :class:`FSDPState`."""

    def __init__(self, state: FSDPState, module: ShardedModule) -> None:
        self.state, self.module = state, module

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> None:
        if dist.get_world_size(group) != self.state.ranks:
            raise ValueError(f"FSDP reduce-scatters over {dist.get_world_size(group)} ranks; safebits_hvd.fsdp."
                             f"compress was built for {self.state.ranks}")
        self.state.reduce_scatter(self.module, output_tensor, input_tensor, op)
        return None


def compress(model: torch.nn.Module, budget_bits: float | str | Callable[[int], float] = 4.4,
             max_distortion: float = 0.5,
             min_cosine: float = 0.7, menu: Menu | Iterable[str] = DEFAULT_MENU, seed: int = 0,
             log_path: str | os.PathLike[str] | None = None, *, sample_buckets: int = 16,
             consistency_check_every: int = 1, nonfinite: str = "propagate", screen: bool = True,
             name: str = "safebits.fsdp", max_history: int = 1000, timeout: float | None = DEFAULT_TIMEOUT,
             replicate_group: Any = None, residual_dtype: torch.dtype = torch.float32) -> FSDPState:
    """Install SafeBits as the reduce-scatter of every FSDP module of ``model`` (after ``fully_shard``); returns the
    model's :class:`FSDPState`. Options as :class:`~safebits_hvd.SafeBits` (``budget_bits``: a number of bits per
    parameter, ``"auto"`` or a schedule; with ``replicate_group`` not ``"auto"``). Call on every rank of the
    model's mesh, after ``torch.distributed`` is initialized.
    ``replicate_group``: compress only the hop across replicas (see the module docstring; the model sharded on a
    1-D mesh within each replica); None: compress FSDP's reduce-scatter. Native HSDP (a 2-D mesh) is refused.
    ``residual_dtype=torch.bfloat16`` stores the residuals, which cover this rank's full local gradient
    (``state.memory.nbytes``), in half the memory (:class:`~safebits_hvd.SafeBits`)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("safebits_hvd.fsdp.compress needs torch.distributed initialized and fully_shard applied")
    modules = [m for m in model.modules() if FSDPModule is not None and isinstance(m, FSDPModule)]
    groups = [g for m in modules for g in m._get_fsdp_state()._fsdp_param_groups]
    if not groups:
        raise ValueError(NOT_SHARDED)
    mesh_info = groups[0].mesh_info
    if getattr(mesh_info, "replicate_mesh_dim", None) is not None:
        raise ValueError("native HSDP (a 2-D mesh given to fully_shard) all-reduces across replicas itself, before "
                         "any hook: shard on the 1-D mesh of a replica and pass replicate_group= to compress only "
                         "that hop")
    process_group = mesh_info.shard_process_group
    if any(g.mesh_info.shard_process_group is not process_group for g in groups):
        raise ValueError("the model's FSDP modules are sharded over different meshes; SafeBits takes one mesh for "
                         "the whole model")
    state = FSDPState(model, process_group, replicate_group, budget_bits, max_distortion, min_cosine, menu, seed,
                      log_path, sample_buckets=sample_buckets, consistency_check_every=consistency_check_every,
                      nonfinite=nonfinite, screen=screen, name=name, max_history=max_history, timeout=timeout,
                      residual_dtype=residual_dtype)
    for module in state.modules:
        if replicate_group is None:
            module.module.set_custom_reduce_scatter(SafeBitsReduceScatter(state, module))
        else:
            module.module.set_all_reduce_hook(partial(state.all_reduce, module))
    return state


__all__ = ["FSDPState", "SafeBitsReduceScatter", "compress"]
