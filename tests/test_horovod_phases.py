"""``bench.experiments.horovod_phases``: the time inside a method is summed per step, and the table gives medians and
the mean step."""

from __future__ import annotations

import time

from bench.experiments import horovod_phases as phases


def test_the_seconds_inside_a_method_are_summed_until_taken() -> None:
    class Compressor:
        def compress(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    timed = phases.Timed(Compressor, "compress")
    assert Compressor().compress(0.01) == 0.01 and Compressor().compress(0.02) == 0.02
    assert 0.03 <= timed.take() < 0.5
    assert timed.take() == 0.0


def test_the_table_has_one_row_of_medians_per_compressor() -> None:
    args = phases.parse_args(["--rate", "1gbit", "--model", "gpt2_small"])
    steps = [[0.1, 0.2, 0.3, 0.6, 0.05, 0.01, 0.5, 0.1], [0.3, 0.4, 0.5, 1.2, 0.07, 0.03, 1.0, 0.1],
             [0.2, 0.3, 0.4, 0.9, 0.06, 0.02, 0.8, 0.2]]
    text = phases.table(args, {"safebits@4.4": steps})
    assert "| safebits@4.4 | 200.0 | 300.0 | 400.0 | 900.0 | 60.0 | 20.0 | 800.0 | 100.0 | 900.0 |" in text
    slow = phases.table(args, {"auto": [[0.1, 0.2, 0.3, 0.6, 0, 0, 0, 0], [0.1, 0.2, 0.3, 0.6, 0, 0, 0, 0],
                                        [0, 0, 0, 1.5, 0, 0, 0, 0]]})
    assert slow.endswith("| 600.0 | 0.0 | 0.0 | 0.0 | 0.0 | 900.0 |")   # the median hides the slow step, the mean not
    assert text.startswith("gpt2_small, batch 4 per rank, link 1gbit, 14 timed steps")


def test_the_race_s_text_task_steps_as_a_workload() -> None:
    import torch

    work = phases.RaceText()
    model = work.model()
    loss = work.loss(model, torch.Generator().manual_seed(0))
    loss.backward()
    assert loss.ndim == 0 and torch.isfinite(loss) and next(model.parameters()).grad is not None
    assert isinstance(work.optimizer(model), torch.optim.Optimizer)
