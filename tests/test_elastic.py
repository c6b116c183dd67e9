"""Elastic training's pieces in one process (the horovodrun test, ``mpi_tests/test_elastic.py``, kills a worker):
the handler's commit and restore, a world-size change moving second-hop residuals into first-hop ones, and the
errors that replace silent loss."""

from __future__ import annotations

import pytest
import torch

import safebits_hvd as sb
from safebits_hvd.frontends.elastic import SafeBitsStateHandler
from safebits_hvd.step import world

from .helpers import many_tensor_params, random_grads, run_steps
from .test_collectives import run_ranks


def steps_together(c: sb.SafeBits, params, steps: int, seed: int) -> None:
    """Every gradient compressed, then every one decompressed, as Horovod's optimizer does (several ranks)."""
    for step in range(steps):
        random_grads(params, step, seed)
        pending = [c.compress(p.grad) for _, p in reversed(params)]
        for wire, ctx in pending:
            c.decompress(torch.ones(1) if ctx.handle.packed else wire, ctx)


def test_torchstate_saves_and_restores_safebits() -> None:
    """``hvd.elastic.TorchState(compression=SafeBits(...))`` saves and restores SafeBits' state (Horovod would
    otherwise treat it as a plain object and broadcast it whole)."""
    from horovod.torch.elastic.state import TorchState

    params = many_tensor_params()
    c = sb.SafeBits(params)
    state = TorchState(compression=c, batch=0)
    run_steps(c, params, 2)
    state.restore()
    assert c.step == 0 and c.last_step is None and not c.state_dict()["residuals"]
    run_steps(c, params, 1)
    state.save()
    run_steps(c, params, 1)
    state.restore()
    assert c.step == 1


def test_restore_drops_the_failed_step_and_returns_to_the_commit() -> None:
    """A step that fails half-way (some gradients compressed, none decompressed) is dropped by restore: the state
    is bitwise the commit's, the records of undone steps are gone, and training goes on as from the commit."""
    params = many_tensor_params()
    c = sb.SafeBits(params, budget_bits=2.0)
    run_steps(c, params, 3)
    handler = SafeBitsStateHandler(c)                 # commits at construction, as TorchState's handlers do
    committed = c.state_dict()
    run_steps(c, params, 2, seed=5)                   # two steps that will be undone
    random_grads(params, 9)
    for _, p in params[:3]:
        c.compress(p.grad)                           # the failed step: its collectives never finished
    handler.restore()
    restored = c.state_dict()
    assert restored["step"] == committed["step"] == 3 and c.last_step.step == 2
    assert [r.step for r in c.history] == [0, 1, 2]
    for name, e in committed["residuals"].items():
        assert torch.equal(restored["residuals"][name], e), name

    twin_params = many_tensor_params()
    twin = sb.SafeBits(twin_params, budget_bits=2.0)
    twin.load_state_dict(committed)
    run_steps(c, params, 2, seed=7)
    run_steps(twin, twin_params, 2, seed=7)
    for name, e in c.state_dict()["residuals"].items():
        assert torch.equal(twin.state_dict()["residuals"][name], e), name


def test_a_new_world_size_moves_second_hop_residuals_into_first_hop_ones() -> None:
    """Three ranks train two-phase; two survive and continue at two ranks. A survivor's second-hop residual whose
    segment moved is added into its first-hop residual over the same elements: per survivor, nothing is lost."""
    def first_world(rank: int, exchange, transport) -> dict:
        params = many_tensor_params()
        c = sb.SafeBits(params, budget_bits=2.0, collective="two_phase", exchange=exchange, transport=transport)
        steps_together(c, params, 3, seed=1 + rank)
        return c.state_dict()

    saved = run_ranks(3, first_world)

    def second_world(rank: int, exchange, transport) -> tuple[dict, dict]:
        params = many_tensor_params()
        c = sb.SafeBits(params, budget_bits=2.0, collective="two_phase", exchange=exchange, transport=transport)
        steps_together(c, params, 1, seed=9)         # the transport is known: loading then checks the segments
        c.load_state_dict(saved[rank])
        return c.state_dict(), saved[rank]

    for after, before in run_ranks(2, second_world):
        assert after["step"] == before["step"]
        for name, e in before["residuals"].items():
            expected = e.clone()
            if name in before["second_hop_residuals"] and name not in after["second_hop_residuals"]:
                start, stop = before["second_hop_ranges"][name]
                expected[start:stop] += before["second_hop_residuals"][name]
            else:           # kept: its segment did not move
                assert torch.equal(after["second_hop_residuals"][name], before["second_hop_residuals"][name])
            assert torch.equal(after["residuals"][name], expected), name
        moved = set(before["second_hop_residuals"]) - set(after["second_hop_residuals"])
        assert moved, "no segment moved from 3 ranks to 2: the test checks nothing"


def test_residuals_of_another_size_are_an_error_not_a_silent_reset() -> None:
    params = many_tensor_params()
    c = sb.SafeBits(params)
    run_steps(c, params, 1)
    with pytest.raises(ValueError, match="holds 7 elements, not 8"):
        c.memory.residual("p0", 8, torch.device("cpu"))
    state = c.state_dict()
    state["residuals"]["p1"] = torch.zeros(299)
    with pytest.raises(ValueError, match="residual of 'p1' has 299 elements"):
        sb.SafeBits(many_tensor_params()).load_state_dict(state)


def test_leave_world_needs_factories_and_a_step_boundary() -> None:
    params = many_tensor_params()
    c = sb.SafeBits(params)
    run_steps(c, params, 1)
    world.leave_world(c.core)                              # built from factories: rebuilt at the next step
    assert c.core.transport is None
    run_steps(c, params, 1)
    assert c.step == 2 and c.core.transport is not None
    random_grads(params, 3)
    c.compress(params[0][1].grad)
    with pytest.raises(RuntimeError, match="between steps"):
        world.leave_world(c.core)


def test_leave_world_between_a_steps_last_send_and_its_end_is_an_error() -> None:
    """A step closed (every gradient sent) but not ended (its reduced tensors not all taken) is mid-step; once it has
    ended, its exchange in flight belongs to the old world and leave_world may drop it."""
    from .test_compressor import PairExchange

    params = many_tensor_params()
    c = sb.SafeBits(params, exchange=PairExchange())   # not local: the step stays pending until it ends
    random_grads(params, 0)
    pending = [c.compress(p.grad) for _, p in reversed(params)]
    assert not c.core.between_steps and not c.core.in_step
    with pytest.raises(RuntimeError, match="between steps"):
        world.leave_world(c.core)
    for sent, ctx in pending:
        c.decompress(sent, ctx)
    assert c.core.closing.ended and c.core.between_steps
    with pytest.raises(ValueError, match="as an object"):     # ended: only the exchange given as an object stops it
        world.leave_world(c.core)
