"""The link benchmark's pure helpers (bench.netns: rate parsing, tbf burst size; bench.link_stats and
bench.link_report: derived figures, the markdown tables; bench.link: the workers' arguments), bench.specs' parser
and bench.tasks' models (no launch)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import link, link_phases, link_report, link_stats, netns, protocol, specs
from bench import tasks as models


@pytest.mark.parametrize("text,bps", [("100mbit", 10**8), ("1gbit", 10**9), ("10gbit", 10**10),
                                      ("2.5gbit", 2_500_000_000), ("64kbit", 64_000), (" 1GBIT ", 10**9),
                                      ("unlimited", None)])
def test_parse_rate(text: str, bps: int | None) -> None:
    assert netns.parse_rate(text) == bps


@pytest.mark.parametrize("text", ["", "1gb", "gbit", "1 gbps", "-1gbit", "0bit", "fast"])
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        netns.parse_rate(text)


def test_every_accepted_rate_parses() -> None:
    assert [netns.parse_rate(r) for r in link.RATES] == [10**8, 10**9, 10**10, None]


def test_burst_is_one_millisecond_with_a_floor_above_the_loopback_mtu() -> None:
    assert netns.burst_bytes(10**10) == 1_250_000            # 1 ms at 10 Gbit/s
    assert netns.burst_bytes(10**9) == 131_072               # 1 ms would be 125,000 bytes: the floor wins
    assert netns.burst_bytes(10**8) == 2 * netns.LO_MTU
    assert netns.burst_bytes(8 * 10**9 + 1) == 1_000_001     # rounded up, never below the rate's millisecond
    for bps in (10**6, 10**8, 10**9, 10**10):
        assert netns.burst_bytes(bps) > netns.LO_MTU + 14     # a full frame plus its header always fits
    with pytest.raises(ValueError):
        netns.burst_bytes(0)


def test_tbf_command() -> None:
    cmd = netns.tbf_command(10**9)
    assert cmd[:7] == ["tc", "qdisc", "replace", "dev", "lo", "root", "tbf"]
    assert cmd[cmd.index("rate") + 1] == "1000000000bit"
    assert cmd[cmd.index("burst") + 1] == "131072"
    assert cmd[cmd.index("latency") + 1] == "100ms"


def test_quick_flag() -> None:
    args = link.parse_args(["--quick", "--rates", "100mbit", "unlimited"])
    assert args.rates == ["100mbit"] and args.steps == 2 and args.models == ["resnet18"]
    assert args.compressors == link.QUICK_COMPRESSORS and len(args.compressors) == 3
    assert link.parse_args([]).rates == ["1gbit"] and link.parse_args([]).compressors == link.COMPRESSORS
    assert args.ddp_compressors == link.QUICK_DDP_COMPRESSORS and args.quality_steps == 0
    assert link.parse_args([]).ddp_compressors == link.DDP_COMPRESSORS
    with pytest.raises(SystemExit):
        link.parse_args(["--ddp-compressors", "safebits@4.4"])      # DDP rows are named ddp:...
    with pytest.raises(SystemExit):
        link.parse_args(["--rates", "5gbit"])


def test_a_relative_out_dir_is_made_absolute() -> None:
    """The workers run in the repository root, so a directory relative to the caller's must not reach them."""
    assert link.parse_args(["--out-dir", "some/dir"]).out_dir == os.path.abspath("some/dir")


def case(model: str, compressor: str, step_times: list[float], link_bytes: int, modeled: float,
         wire: float | None = None, params: int = 1000) -> dict[str, Any]:
    return {"model": model, "compressor": compressor, "parameters": params, "batch_per_rank": 16, "ranks": 2,
            "warmup": 1, "steps": len(step_times), "step_times_s": step_times, "elapsed_s": sum(step_times),
            "link_bytes": link_bytes, "wire_bytes_total": wire, "modeled_bytes_per_step": modeled,
            "collective": None if wire is None else "allgather", "violations": 0}


def fake_runs() -> dict[str, list[dict[str, Any]]]:
    return {
        "1gbit": [case("cnn", "none", [2.0, 1.0, 9.0], 24_000_000, 8000.0),
                  case("cnn", "fp16", [1.0, 1.0, 1.0], 12_000_000, 4000.0),
                  case("cnn", "safebits@4.4", [0.5, 0.5, 0.4], 3_000_000, 1100.0, wire=3300.0)],
        "unlimited": [case("cnn", "none", [0.5, 0.5], 16_000_000, 8000.0),
                      case("cnn", "fp16", [0.4, 0.4], 8_000_000, 4000.0)],
    }


def test_summarize() -> None:
    rows = {(r["rate"], r["compressor"]): r for r in link_stats.summarize(fake_runs())}
    none, fp16, sb = rows["1gbit", "none"], rows["1gbit", "fp16"], rows["1gbit", "safebits@4.4"]
    assert none["step_time_s"] == 2.0                         # median, not mean (one slow outlier)
    assert none["samples_per_s"] == pytest.approx(2 * 16 / 2.0)
    assert none["link_bytes_per_step"] == pytest.approx(8e6)
    assert none["wire_bytes_per_step"] is None
    assert sb["wire_bytes_per_step"] == pytest.approx(1100.0)
    assert sb["ratio_to_none"] == pytest.approx(4.0) and sb["ratio_to_fp16"] == pytest.approx(2.0)
    assert none["ratio_to_none"] == pytest.approx(1.0) and fp16["ratio_to_none"] == pytest.approx(2.0)
    # vs_limit: step / (none's unlimited step + modeled bytes * 8 / rate)
    assert sb["vs_limit"] == pytest.approx(0.5 / (0.5 + 1100.0 * 8 / 1e9))
    assert rows["unlimited", "none"]["vs_limit"] == pytest.approx(1.0)
    assert rows["unlimited", "fp16"]["vs_limit"] == pytest.approx(0.8)


def test_auto_is_compared_with_the_best_fixed_choice_of_its_front_end() -> None:
    """``ratio_to_best``: auto's throughput over the best fixed compressor's on the same model, rate and front end
    (DDP's auto against DDP's rows only); the budgets of its timed steps in bits per parameter, in runs."""
    runs = fake_runs()
    auto = case("cnn", "safebits@auto", [1.0, 0.5, 0.5], 3_000_000, 1100.0, wire=3300.0)
    auto["budget_bits_per_rank"] = [32.0 * 1000, 2.0 * 1000, 2.0 * 1000]      # 1,000 parameters
    ddp_auto = case("cnn", "ddp:safebits@auto", [0.25, 0.25], 3_000_000, 1100.0, wire=3300.0)
    runs["1gbit"] += [auto, ddp_auto, case("cnn", "ddp:none", [0.5, 0.5], 24_000_000, 8000.0)]
    rows = {(r["rate"], r["compressor"]): r for r in link_stats.summarize(runs)}
    hvd, ddp = rows["1gbit", "safebits@auto"], rows["1gbit", "ddp:safebits@auto"]
    assert hvd["best_fixed"] == "safebits@4.4" and hvd["ratio_to_best"] == pytest.approx(0.5 / 0.5)
    assert ddp["best_fixed"] == "ddp:none" and ddp["ratio_to_best"] == pytest.approx(0.5 / 0.25)
    assert hvd["budget_bits_per_step"] == [32.0, 2.0, 2.0]
    assert hvd["steps_at_best_budget"] == [0, 3]               # none of its steps at the best's 4.4 bits
    assert ddp["steps_at_best_budget"] is None                 # no budgets recorded for DDP's auto here
    assert "safebits@4.4" not in [r.get("best_fixed") for r in rows.values() if r["compressor"] == "none"]
    table = link_report.auto_table(list(rows.values()))
    assert "| cnn | 1gbit | safebits@auto | safebits@4.4 |" in table and "32 x1, 2 x2" in table
    assert "| cnn | 1gbit | ddp:safebits@auto | ddp:none |" in table and "2.00x (2.00-2.00)" in table
    assert hvd["ratio_to_none_interval"][0] <= hvd["ratio_to_none"] <= hvd["ratio_to_none_interval"][1]
    assert "| 0/3 | 32 x1, 2 x2 |" in table
    assert link_report.auto_table([r for r in rows.values() if "auto" not in r["compressor"]]) == ""


def test_fixed_budget_is_what_auto_would_choose_for_that_row() -> None:
    budgets = [link_stats.fixed_budget(c) for c in ("none", "ddp:none", "safebits@4.4", "ddp:safebits@2")]
    assert budgets == [32, 32, 4.4, 2]
    assert [link_stats.fixed_budget(c) for c in ("fp16", "ddp:fp16", "safebits@auto", "topk1_ef", "unscreened@2",
                                           "ddp:powersgd4")] == [None] * 6
    with pytest.raises(ValueError, match="unknown compressor"):
        link_stats.fixed_budget("topk")                               # the benchmarks' one spec parser says why


def test_ratio_interval_pairs_steps_and_chooses_the_best_in_every_resample() -> None:
    """Side by side, step *i* of every row ran at the same time: resampled together, a drift that slows the rows
    alike cancels in the ratio; rows of different lengths are resampled each on its own (a wider interval). The
    best of several rows is chosen in every resample: two rows as fast as auto, each noisy, make an interval lower
    than one of them alone gives (the luck of the pick)."""
    drift = [1.0, 3.0, 1.5, 4.0, 2.0, 1.2, 3.5, 2.5, 1.1, 2.2]
    auto = [2 * x for x in drift]                     # half the throughput, step by step
    assert link_stats.ratio_interval(auto, [drift]) == pytest.approx((0.5, 0.5))
    low, high = link_stats.ratio_interval(auto, [drift[:-1]])
    assert low < 0.5 < high and high - low > 0.2
    assert link_stats.ratio_interval(auto, [drift[:-1]]) == (low, high)      # seeded: the same figures, the same one
    flat = [1.0] * 10
    noisy = [0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 0.75, 1.25, 1.05]
    one = link_stats.ratio_interval(flat, [noisy])
    both = link_stats.ratio_interval(flat, [noisy, [1.05, 0.7, 1.25, 0.9, 1.3, 0.8, 1.0, 1.2, 0.75, 1.1]])
    assert one[0] < 1 < one[1] and both[0] <= one[0] and both[1] < one[1] - 0.05


def test_rounds_are_pooled_per_compressor() -> None:
    first = case("cnn", "safebits@4.4", [0.5, 0.7], 3_000, 1000.0, wire=2000.0)
    second = case("cnn", "safebits@4.4", [0.6, 0.9, 0.8], 6_000, 1100.0, wire=3000.0)
    first["budget_bits_per_rank"], second["budget_bits_per_rank"] = [32.0, 2.0], [2.0, 2.0, 32.0]
    other = case("cnn", "none", [1.0], 100, 8000.0)
    merged = link_stats.merge_rounds([first, other, second, case("cnn", "none", [3.0], 300, 8000.0)])
    assert [c["compressor"] for c in merged] == ["safebits@4.4", "none"]      # order of first appearance
    sb, none = merged
    assert sb["step_times_s"] == [0.5, 0.7, 0.6, 0.9, 0.8] and sb["round_step_s"] == [0.6, 0.8]
    assert sb["budget_bits_per_rank"] == [32.0, 2.0, 2.0, 2.0, 32.0] and first["budget_bits_per_rank"] == [32.0, 2.0]
    assert sb["steps"] == 5 and sb["link_bytes"] == 9_000 and sb["wire_bytes_total"] == 5000.0
    assert sb["modeled_bytes_per_step"] == pytest.approx((2 * 1000.0 + 3 * 1100.0) / 5)
    assert none["round_step_s"] == [1.0, 3.0] and none["wire_bytes_total"] is None
    assert first["step_times_s"] == [0.5, 0.7]                                # the raw cases are not modified
    rows = {r["compressor"]: r for r in link_stats.summarize({"1gbit": [first, other, second]})}
    assert rows["safebits@4.4"]["step_time_s"] == 0.7 and rows["safebits@4.4"]["rounds"] == 2
    assert rows["safebits@4.4"]["link_bytes_per_step"] == pytest.approx(9_000 / 5)
    assert rows["safebits@4.4"]["ratio_to_none"] == pytest.approx(1.0 / 0.7)
    # a compressor missing the wire figure in one round has none overall
    assert link_stats.merge_rounds([first, case("cnn", "safebits@4.4", [0.5], 10, 1.0)])[0]["wire_bytes_total"] is None


def test_rounds_reach_both_workers() -> None:
    args = link.parse_args(["--rounds", "3", "--quality-steps", "5"])
    assert args.rounds == 3 and link.parse_args([]).rounds == 1
    worker = link.worker_args(args, "out.json")
    assert worker[worker.index("--rounds") + 1] == "3"
    ddp = link.ddp_worker_args(args, "out.json")
    assert ddp[ddp.index("--rounds") + 1] == "3"
    quality = link.ddp_worker_args(args, "out.json", quality=True)
    assert quality[quality.index("--rounds") + 1] == "1"                     # the training run is not repeated
    with pytest.raises(SystemExit):
        link.parse_args(["--rounds", "0"])


def test_summarize_without_unlimited_or_baselines() -> None:
    runs = {"1gbit": [case("cnn", "safebits@2", [1.0], 10, 5.0)]}
    (row,) = link_stats.summarize(runs)
    assert row["vs_limit"] is None and row["ratio_to_none"] is None and row["ratio_to_fp16"] is None


def test_summarize_compares_ddp_rows_with_ddp_baselines() -> None:
    runs = fake_runs()
    runs["1gbit"] += [case("cnn", "ddp:none", [1.0], 100, 8000.0), case("cnn", "ddp:fp16", [0.8], 50, 4000.0),
                      case("cnn", "ddp:safebits@4.4", [0.4], 10, 1100.0, wire=1100.0)]
    runs["unlimited"].append(case("cnn", "ddp:none", [0.25], 100, 8000.0))
    rows = {(r["rate"], r["compressor"]): r for r in link_stats.summarize(runs)}
    sb = rows["1gbit", "ddp:safebits@4.4"]
    assert sb["ratio_to_none"] == pytest.approx(2.5) and sb["ratio_to_fp16"] == pytest.approx(2.0)
    assert sb["vs_limit"] == pytest.approx(0.4 / (0.25 + 1100.0 * 8 / 1e9))
    assert rows["1gbit", "safebits@4.4"]["ratio_to_none"] == pytest.approx(4.0)     # Horovod's rows unchanged


def test_quality_table() -> None:
    md = link_report.quality_table([{"compressor": "ddp:powersgd4", "steps": 10, "link_bytes": 20_000_000,
                              "modeled_bytes_per_step": 1_500_000.0, "train_loss_first": 2.5,
                              "train_loss_last5": 1.25, "held_out_loss": 1.5, "held_out_accuracy": 0.5}])
    assert "| ddp:powersgd4 | 2.00 | 1.50 | 2.500 | 1.250 | 1.500 | 0.500 |" in md


def test_build_tables() -> None:
    runs = fake_runs()
    runs["1gbit"].append(case("lm", "none", [0.1], 100, 8.0, params=10))
    md = link_report.build_tables(link_stats.summarize(runs))
    assert "### cnn (1,000 parameters; batch 16 per rank)" in md and "### lm (10 parameters; batch 16 per rank)" in md
    cnn = md.split("### cnn")[1].split("###")[0]
    header = next(line for line in cnn.splitlines() if line.startswith("| compressor"))
    assert header.count("samples/s") == 2 and header.index("1gbit") < header.index("unlimited")
    cells = {line.split(" | ")[0][2:]: [c.strip() for c in line.strip(" |").split("|")]
             for line in cnn.splitlines() if line.startswith("| ") and not line.startswith(("| compressor", "| ---"))}
    assert set(cells) == {"none", "fp16", "safebits@4.4"}
    sb = cells["safebits@4.4"]
    assert len(sb) == 1 + 2 * 7
    # 1gbit: samples/s, x none, x fp16, link MB, wire MB, modeled MB, vs limit
    assert sb[1:8] == ["64.0", "4.00x", "2.00x", "1.00", "0.00", "0.00", f"{0.5 / (0.5 + 8800 / 1e9):.2f}"]
    assert sb[8:] == ["-"] * 7                                # not run on the unlimited link
    assert cells["none"][4] == "8.00" and cells["none"][5] == "-"    # link MB/step; no wire figure
    lm = md.split("### lm")[1]
    assert "| none | 320.0 | 1.00x | - |" in lm               # no fp16 run for the LM


def test_fmt_handles_missing_values() -> None:
    assert link_report.format_value(None, ".2f") == "-" and link_report.format_value(math.nan, ".2f") == "-"
    assert link_report.format_value(1.234, ".1f", "x") == "1.2x"


# ---------------------------------------------------------------------------------------------- the models
def test_gpt2_small_has_the_gpt2_shape() -> None:
    model = models.GPT2()
    facts = models.model_facts(model)
    names = [n for n, _ in model.named_parameters()]
    assert facts["tensors"] == 148 == len(names)               # 12 x 12 + token + position + final LN (2)
    assert facts["parameters"] == 11_607_552
    assert abs(facts["parameters"] / 11.6e6 - 1) < 0.01
    assert sum(n.startswith("blocks.0.") for n in names) == 12
    assert model.pos.weight.shape == (128, 256) and model.tok.weight.shape == (8192, 256)
    assert model.blocks[0].attn.qkv.weight.shape == (768, 256) and model.blocks[0].fc.weight.shape == (1024, 256)
    assert len(model.blocks) == 12 and model.blocks[0].attn.heads == 4


def test_gpt2_small_forward_backward_at_init() -> None:
    torch.manual_seed(0)
    model = models.GPT2()
    ids = models.token_batch(2, torch.Generator().manual_seed(1))
    assert ids.shape == (2, 129) and int(ids.max()) < 8192
    assert model(ids[:, :-1]).shape == (2, 128, 8192)
    loss = models.next_token_loss(model, ids)
    assert abs(float(loss.detach()) - math.log(8192)) < 0.2            # uniform-ish predictions at init
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    assert float(model.tok.weight.grad.abs().sum()) > 0         # embedding and tied head both feed it
    with pytest.raises(ValueError):
        model(torch.zeros(1, 129, dtype=torch.long))            # longer than the context


def test_gpt2_attention_is_causal() -> None:
    """Changing the last token leaves every earlier position's logits unchanged (and changes the last one)."""
    torch.manual_seed(0)
    model = models.GPT2(models.GPTConfig(layers=2, vocab=64, context=16)).eval()
    ids = torch.randint(64, (1, 16), generator=torch.Generator().manual_seed(2))
    other = ids.clone()
    other[0, -1] = (ids[0, -1] + 1) % 64
    with torch.no_grad():
        a, b = model(ids), model(other)
    assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-6)
    assert not torch.allclose(a[:, -1], b[:, -1], atol=1e-4)


def test_resnet18_runs_at_imagenet_size() -> None:
    model = models.ResNet18()
    assert models.model_facts(model) == {"parameters": 11_173_962, "tensors": 62}   # the same at every size
    x, y = models.image_batch(1, 224, torch.Generator().manual_seed(0))
    assert x.shape == (1, 3, 224, 224) and y.shape == (1,)
    with torch.no_grad():
        assert model.eval()(x).shape == (1, 10)


def test_workloads() -> None:
    gpt = models.Workload("gpt2_small", 2)
    assert gpt.facts() == {"unit": "tokens", "unit_per_sample": 128, "image_size": None, "seq_len": 128,
                           "vocab": 8192}
    cnn = models.Workload("resnet18", 2, image_size=64)
    assert cnn.facts()["unit"] == "images" and cnn.facts()["image_size"] == 64
    model = cnn.model()
    assert isinstance(cnn.optimizer(model), torch.optim.SGD)
    assert isinstance(gpt.optimizer(gpt.model()), torch.optim.AdamW)
    assert cnn.loss(model, torch.Generator().manual_seed(0)).shape == ()
    lm = models.Workload("bytes_lm", 3)                      # the demo's LM and corpus, timed like the others
    assert lm.facts()["unit"] == "sequences" and isinstance(lm.optimizer(lm.model()), torch.optim.Adam)
    assert lm.loss(lm.model(), torch.Generator().manual_seed(0)).shape == ()
    assert set(models.Workload.DDP_NAMES) < set(models.Workload.NAMES)
    with pytest.raises(ValueError):
        models.Workload("gpt3", 2)
    with pytest.raises(ValueError):
        models.Workload("resnet18", 2, image_size=0)


# ---------------------------------------------------------------------------------------------- specs
@pytest.mark.parametrize("text,name,bits,ddp", [
    ("none", "none", None, False), ("fp16", "fp16", None, False), ("fp32", "fp32", None, False),
    ("qsgd4", "qsgd4", None, False), ("safebits@4.4", "safebits", 4.4, False),
    ("safebits@auto", "safebits", "auto", False),
    ("unscreened_quantizers@1", "unscreened_quantizers", 1.0, False), ("ddp:none", "none", None, True),
    ("ddp:powersgd4", "powersgd4", None, True), ("ddp:safebits@2", "safebits", 2.0, True),
    ("ddp:safebits@auto", "safebits", "auto", True)])
def test_one_parser_reads_every_compressor_spec(text: str, name: str, bits: float | str | None, ddp: bool) -> None:
    spec = specs.parse(text)
    assert (spec.text, spec.name, spec.budget_bits, spec.ddp) == (text, name, bits, ddp)
    assert spec.budgeted == (bits is not None)


@pytest.mark.parametrize("text,message", [
    ("safebits", "take @BITS"), ("fp32@4", "take no @budget"), ("safebits@0", "> 0"), ("safebits@x", "a number"),
    ("nope", "unknown compressor"), ("ddp:qsgd4", "unknown DDP"), ("ddp:powersgd0", "unknown DDP"),
    ("ddp:safebits", "take @BITS")])
def test_a_bad_spec_says_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        specs.parse(text)


# ---------------------------------------------------------------------------------------------- plumbing
def test_image_size_and_gpt_model_reach_both_workers() -> None:
    args = link.parse_args(["--models", "resnet18", "gpt2_small", "bytes_lm", "--image-size", "224",
                            "--gpt-batch", "4", "--cnn-batch", "2"])
    worker = link.worker_args(args, "out.json")
    assert worker[worker.index("--image-size") + 1] == "224" and worker[worker.index("--gpt-batch") + 1] == "4"
    assert worker[worker.index("--models") + 1:worker.index("--compressors")] == ["resnet18", "gpt2_small",
                                                                                  "bytes_lm"]
    ddp = link.ddp_worker_args(args, "out.json")
    assert ddp[ddp.index("--models") + 1:ddp.index("--compressors")] == ["resnet18", "gpt2_small"]  # no bytes_lm
    assert ddp[ddp.index("--image-size") + 1] == "224" and ddp[ddp.index("--gpt-batch") + 1] == "4"
    assert ddp[ddp.index("--cnn-batch") + 1] == "2"
    quality = link.ddp_worker_args(args, "out.json", quality=True)
    assert quality[quality.index("--models") + 1:quality.index("--compressors")] == ["resnet18"]
    defaults = link.parse_args([])
    assert defaults.image_size == 32 and defaults.models == link.DEFAULT_MODELS and "gpt2_small" in link.MODELS
    assert link.ddp_models(defaults) == ["resnet18"]
    assert link.ddp_models(link.parse_args(["--models", "bytes_lm"])) == []          # no DDP launch
    assert link.ddp_models(link.parse_args(["--models", "gpt2_small"])) == ["gpt2_small"]
    assert link.parse_args(["--quick", "--models", "gpt2_small"]).models == ["gpt2_small"]
    for bad in (["--models", "gpt3"], ["--image-size", "0"], ["--gpt-batch", "0"]):
        with pytest.raises(SystemExit):
            link.parse_args(bad)


def test_tables_say_the_unit_the_batch_and_the_image_size() -> None:
    gpt = {**case("gpt2_small", "none", [2.0], 100, 8.0, params=11_607_552), "tensors": 148, "unit": "tokens",
           "unit_per_sample": 128, "seq_len": 128, "vocab": 8192, "batch_per_rank": 8}
    cnn = {**case("resnet18", "none", [4.0], 100, 8.0, params=11_173_962), "tensors": 62, "unit": "images",
           "unit_per_sample": 1, "image_size": 224, "batch_per_rank": 4}
    ddp = {**gpt, "compressor": "ddp:none", "step_times_s": [1.0]}
    rows = link_stats.summarize({"1gbit": [gpt, cnn, ddp]})
    by = {(r["model"], r["compressor"]): r for r in rows}
    assert by["gpt2_small", "none"]["samples_per_s"] == pytest.approx(2 * 8 / 2.0)
    assert by["gpt2_small", "none"]["throughput_per_s"] == pytest.approx(2 * 8 * 128 / 2.0)
    assert by["gpt2_small", "none"]["throughput_unit"] == "tokens/s"
    assert by["resnet18", "none"]["throughput_per_s"] == pytest.approx(2.0)
    assert by["resnet18", "none"]["image_size"] == 224 and by["resnet18", "none"]["tensors"] == 62
    md = link_report.build_tables(rows)
    assert "### gpt2_small (11,607,552 parameters in 148 tensors; batch 8 sequences of 128 tokens per rank)" in md
    assert "### resnet18 (11,173,962 parameters in 62 tensors; batch 4 images of 3x224x224 per rank)" in md
    gpt_table = md.split("### gpt2_small")[1].split("###")[0]
    assert "| compressor | 1gbit tokens/s |" in gpt_table
    assert "| none | 1024.0 | 1.00x |" in gpt_table and "| ddp:none | 2048.0 | 1.00x |" in gpt_table
    assert "| compressor | 1gbit images/s |" in md.split("### resnet18")[1]
    assert "| none | 2.00 | 1.00x |" in md.split("### resnet18")[1]              # 3 significant digits below 10
    facts = link_stats.model_facts(rows)
    assert facts["gpt2_small"]["tensors"] == 148 and facts["gpt2_small"]["seq_len"] == 128
    assert facts["resnet18"] == {"parameters": 11_173_962, "tensors": 62, "batch_per_rank": 4, "unit": "images",
                                 "unit_per_sample": 1, "image_size": 224, "seq_len": None, "vocab": None}


# ---------------------------------------------------------------------------------------------- changing link
def test_phases_parse_and_place_every_step() -> None:
    phases = [link_phases.parse_phase(t) for t in ("unlimited:3", "100mbit:2", "1gbit:1")]
    assert phases == [("unlimited", 3), ("100mbit", 2), ("1gbit", 1)]
    assert [link_phases.phase_of(i, phases) for i in (-1, 0, 2, 3, 4, 5)] == [0, 0, 0, 1, 1, 2]
    for bad in ("100mbit", "100mbit:0", "100mbit:x"):
        with pytest.raises(ValueError, match="RATE:STEPS"):
            link_phases.parse_phase(bad)
    with pytest.raises(SystemExit):
        link.parse_args(["--phases", "fast:10"])             # not a rate


def test_the_changer_sets_the_rate_of_the_step_rank_0_is_about_to_run(tmp_path: Path) -> None:
    step_file = str(tmp_path / "step")
    set_to: list[str] = []
    changer = link_phases.LinkChanger(step_file, [("unlimited", 2), ("100mbit", 2)], set_to.append, poll_s=0.001)
    changer.start()
    report = protocol.step_reporter(step_file, case_id=0, rank=0)
    assert report is not None and protocol.step_reporter(step_file, 0, rank=1) is None
    for case in (0, 1):
        report = protocol.step_reporter(step_file, case_id=case, rank=0)
        for step in (-1, 0, 1, 2, 3):
            report(step)
            time.sleep(0.03)
    changer.stop()
    assert set_to == ["unlimited", "100mbit", "unlimited", "100mbit"]        # a new case starts at the first rate


def phase_case(compressor: str, times: list[float], bits: list[float | None]) -> dict[str, Any]:
    return {"model": "m", "compressor": compressor, "ranks": 2, "batch_per_rank": 4, "unit_per_sample": 1,
            "parameters": 10, "step_times_s": times, "budget_bits_per_rank": bits,
            "pass_through": [b == 320 for b in bits]}


def test_auto_is_measured_against_the_fastest_fixed_choice_of_each_phase() -> None:
    phases = [("unlimited", 4), ("100mbit", 4)]
    cases = [phase_case("none", [1, 1, 1, 1, 9, 9, 9, 9], [None] * 8),
             phase_case("safebits@4.4", [2, 2, 2, 2, 3, 3, 3, 3], [44] * 8),
             phase_case("safebits@auto", [1, 1, 1, 1, 9, 5, 3, 3], [320] * 4 + [320, 60, 44, 44])]
    summary = link_phases.summarize(cases, phases)
    auto = next(r for r in summary["rows"] if r["adaptive"])
    assert summary["oracle"]["m/hvd"] == {"total_s": 16, "choice": ["none", "safebits@4.4"]}
    assert auto["total_s"] == 24 and auto["vs_oracle"] == 1.5
    assert auto["settle_steps"] == [0, None]                    # only two settled steps in the second phase
    assert auto["phases"][1]["budget_bits"] == [32.0, 6.0, 4.4, 4.4]
    md = link_phases.table(summary, phases)
    assert "| m | safebits@auto |" in md and "1.50x" in md and "pass pass pass pass pass 6 4.4 4.4" in md


def _record(step: int) -> Any:
    import safebits_hvd as sb

    return sb.StepRecord(step=step, budget_bits_total=100.0 + step, modeled_bits_total=90 + step,
                         modeled_compression_ratio=1.0, violation=step == 4, excess_bits=0.0, escalations=[],
                         actions={}, distortion={}, cosine={}, allocation_digest="0", wire_bytes=10 * step,
                         timing={"span_s": 0.1 * step}, timing_step=step, pass_through=step % 2 == 0)


def test_the_protocol_reads_the_records_once_after_the_timed_steps() -> None:
    """Reading a record waits for its step's statistics exchange, which otherwise overlaps the next step: the
    protocol reads the history once, after the timed steps, and takes the last ``steps`` records as theirs."""
    done: list[int] = []
    reads: list[int] = []

    def history() -> list[Any]:
        reads.append(len(done))
        return [_record(s) for s in done]

    [measured] = protocol.measure_cases([protocol.Case(lambda: done.append(len(done)), history, None, warmup=2)],
                                        lambda: None, steps=3)
    assert reads == [5] and len(measured["step_times_s"]) == 3
    assert measured["budget_bits_per_rank"] == [102.0, 103.0, 104.0]
    assert measured["modeled_bits_per_rank"] == [92.0, 93.0, 94.0]
    assert measured["pass_through"] == [True, False, True] and measured["violations"] == 1
    assert measured["wire_bytes"] == 90.0
    assert [t["span_s"] for t in measured["timing"]] == pytest.approx([0.2, 0.3, 0.4])
    [without] = protocol.measure_cases([protocol.Case(lambda: None, lambda: None, 32.0, warmup=1)], lambda: None,
                                       steps=2)
    assert without["modeled_bits_per_rank"] == [32.0, 32.0] and without["wire_bytes"] is None
    with pytest.raises(RuntimeError, match="max_history"):
        protocol.measure_cases([protocol.Case(lambda: None, lambda: [_record(0)], None, warmup=0)], lambda: None,
                               steps=2)


def test_interleaved_cases_alternate_their_timed_steps_and_each_counts_its_own_link_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``measure_cases``: every case's warm-up first, then timed step ``i`` of every case, the order reversed every
    other step; each case's loopback bytes are the deltas over its own steps (case k sends k + 1 bytes a step), and
    ``on_step`` hears the run's step, not each case's."""
    sent = [0]
    monkeypatch.setattr(protocol, "read_tx_bytes", lambda: sent[0])
    ran: list[str] = []
    told: list[int] = []

    def stepper(name: str, size: int) -> protocol.Case:
        def step() -> None:
            ran.append(name)
            sent[0] += size
        return protocol.Case(step, lambda: None, 32.0, warmup=1 if name != "c" else 2)

    cases = [stepper("a", 1), stepper("b", 2), stepper("c", 3)]
    measured = protocol.measure_cases(cases, lambda: ran.append("|"), steps=3, on_step=told.append)
    assert ran == ["a", "b", "c", "c", "|", "a", "b", "c", "c", "b", "a", "a", "b", "c", "|"]
    assert told == [-1, 0, 1, 2]
    assert [m["link_bytes"] for m in measured] == [3, 6, 9]
    assert all(len(m["step_times_s"]) == 3 and m["modeled_bits_per_rank"] == [32.0] * 3 for m in measured)


def test_a_model_runs_its_cases_one_by_one_or_side_by_side() -> None:
    """``run_model``: rounds x compressors cases with ids from ``first_id``; alone in turn, or all in one group."""
    compressors = [specs.parse("none"), specs.parse("safebits@auto")]
    for interleave, groups in ((False, [[(5, "none")], [(6, "safebits@auto")], [(7, "none")],
                                        [(8, "safebits@auto")]]),
                               (True, [[(5, "none"), (6, "safebits@auto"), (7, "none"), (8, "safebits@auto")]])):
        seen: list[list[tuple[int, str]]] = []

        def run(group: list[tuple[int, specs.Spec]], seen: list[list[tuple[int, str]]] = seen) -> list[dict[str, Any]]:
            seen.append([(i, spec.text) for i, spec in group])
            return [{"case": i} for i, _ in group]

        results = protocol.run_model("cnn", compressors, 2, interleave, 5, run, report=False)
        assert seen == groups
        assert [(r["case"], r["round"]) for r in results] == [(5, 0), (6, 0), (7, 1), (8, 1)]


def test_interleave_reaches_both_workers_but_not_the_training_run() -> None:
    args = link.parse_args(["--interleave", "--quality-steps", "5"])
    assert "--interleave" in link.worker_args(args, "out.json")
    assert "--interleave" in link.ddp_worker_args(args, "out.json")
    assert "--interleave" not in link.ddp_worker_args(args, "out.json", quality=True)
    assert "--interleave" not in link.worker_args(link.parse_args([]), "out.json")


def test_a_group_sums_each_case_s_wire_bytes_over_ranks_by_its_case_id() -> None:
    """``run_group``: one record per built case, its wire bytes handed to the front end's sum with its case id (none
    for a compressor without records), and the workload's facts, the ranks and the nominal warm-up in each record."""

    class Work:
        name, batch = "cnn", 4

        def facts(self) -> dict[str, Any]:
            return {"unit": "images", "unit_per_sample": 1}

    done: list[int] = []
    summed: list[tuple[float, int]] = []
    with_records = protocol.Case(lambda: done.append(len(done)), lambda: [_record(s) for s in done], None, warmup=1)
    without = protocol.Case(lambda: None, lambda: None, 32.0, warmup=3)
    built = [(7, specs.parse("safebits@2"), {"parameters": 10}, with_records),
             (8, specs.parse("none"), {"parameters": 10}, without)]
    results = protocol.run_group(Work(), built, lambda: None, 2, 2, None, 2,
                                 lambda value, case_id: summed.append((value, case_id)) or 2 * value)
    assert summed == [(30.0, 7)]                  # records of steps 1 and 2: 10 + 20 wire bytes on this rank
    assert [r["wire_bytes_total"] for r in results] == [60.0, None]
    assert [r["compressor"] for r in results] == ["safebits@2", "none"]
    assert all(r["ranks"] == 2 and r["warmup"] == 2 and r["unit"] == "images" for r in results)


def test_from_json_prints_an_earlier_launchs_tables_again(tmp_path: Any, capsys: Any) -> None:
    """``--from-json``: nothing measured, no namespace made; the tables derived afresh from the raw cases."""
    runs = fake_runs()
    auto = case("cnn", "safebits@auto", [1.0, 0.5, 0.5], 3_000_000, 1100.0, wire=3300.0)
    auto["budget_bits_per_rank"] = [32.0 * 1000, 2.0 * 1000, 2.0 * 1000]
    runs["1gbit"].append(auto)
    path = tmp_path / "link.json"
    path.write_text(json.dumps({"raw": runs}))
    assert link.main(["--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| cnn | 1gbit | safebits@auto | safebits@4.4 |" in out and "x best (90%)" in out


@pytest.mark.parametrize(("env", "local_rank", "expected_share"), [
    ({"HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2"}, 1, True),       # horovodrun
    ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, 0, True),                  # torchrun
    ({}, 0, False),                                                           # no launcher: left alone
])
def test_each_rank_binds_itself_to_its_share_of_the_cores(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                                          local_rank: int, expected_share: bool) -> None:
    cores = sorted(os.sched_getaffinity(0))
    for name in ("HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(protocol.PIN_ENV, "0")
    assert protocol.pin_rank() is None                                    # --no-pin
    monkeypatch.setenv(protocol.PIN_ENV, "1")
    try:
        mine = protocol.pin_rank()
        if not expected_share or len(cores) < 2:
            assert mine is None and sorted(os.sched_getaffinity(0)) == cores
        else:
            half = len(cores) // 2
            assert mine == (cores[:half] if local_rank == 0 else cores[half:])
            assert sorted(os.sched_getaffinity(0)) == mine
    finally:
        os.sched_setaffinity(0, cores)


def test_the_link_benchmark_binds_horovods_ranks_unless_told_not_to() -> None:
    default, unbound = link.parse_args(["--rates", "1gbit"]), link.parse_args(["--rates", "1gbit", "--no-pin"])
    assert link.launch_env(default, horovod=True)[protocol.PIN_ENV] == "1"
    assert link.launch_env(unbound, horovod=True)[protocol.PIN_ENV] == "0"
    assert link.launch_env(default, horovod=False)[protocol.PIN_ENV] == "0"     # torchrun's ranks: never bound
    assert link.binding(default) == {"horovod": True, "ddp": False}
    assert link.binding_text(default) == "Horovod ranks bound to their own cores; DDP ranks unbound"
