"""bench/link.py's pure helpers: rate parsing, tbf burst size, derived figures and the markdown tables."""

from __future__ import annotations

import importlib.util
import math
import os
from pathlib import Path
from typing import Any

import pytest

_PATH = Path(__file__).resolve().parent.parent / "bench" / "link.py"
_spec = importlib.util.spec_from_file_location("link_bench", _PATH)
link = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(link)


@pytest.mark.parametrize("text,bps", [("100mbit", 10**8), ("1gbit", 10**9), ("10gbit", 10**10),
                                      ("2.5gbit", 2_500_000_000), ("64kbit", 64_000), (" 1GBIT ", 10**9),
                                      ("unlimited", None)])
def test_parse_rate(text: str, bps: int | None) -> None:
    assert link.parse_rate(text) == bps


@pytest.mark.parametrize("text", ["", "1gb", "gbit", "1 gbps", "-1gbit", "0bit", "fast"])
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        link.parse_rate(text)


def test_every_accepted_rate_parses() -> None:
    assert [link.parse_rate(r) for r in link.RATES] == [10**8, 10**9, 10**10, None]


def test_burst_is_one_millisecond_with_a_floor_above_the_loopback_mtu() -> None:
    assert link.burst_bytes(10**10) == 1_250_000            # 1 ms at 10 Gbit/s
    assert link.burst_bytes(10**9) == 131_072               # 1 ms would be 125,000 bytes: the floor wins
    assert link.burst_bytes(10**8) == 2 * link.LO_MTU
    assert link.burst_bytes(8 * 10**9 + 1) == 1_000_001     # rounded up, never below the rate's millisecond
    for bps in (10**6, 10**8, 10**9, 10**10):
        assert link.burst_bytes(bps) > link.LO_MTU + 14     # a full frame plus its header always fits
    with pytest.raises(ValueError):
        link.burst_bytes(0)


def test_tbf_command() -> None:
    cmd = link.tbf_command(10**9)
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
    rows = {(r["rate"], r["compressor"]): r for r in link.summarize(fake_runs())}
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


def test_rounds_are_pooled_per_compressor() -> None:
    first = case("cnn", "safebits@4.4", [0.5, 0.7], 3_000, 1000.0, wire=2000.0)
    second = case("cnn", "safebits@4.4", [0.6, 0.9, 0.8], 6_000, 1100.0, wire=3000.0)
    other = case("cnn", "none", [1.0], 100, 8000.0)
    merged = link.merge_rounds([first, other, second, case("cnn", "none", [3.0], 300, 8000.0)])
    assert [c["compressor"] for c in merged] == ["safebits@4.4", "none"]      # order of first appearance
    sb, none = merged
    assert sb["step_times_s"] == [0.5, 0.7, 0.6, 0.9, 0.8] and sb["round_step_s"] == [0.6, 0.8]
    assert sb["steps"] == 5 and sb["link_bytes"] == 9_000 and sb["wire_bytes_total"] == 5000.0
    assert sb["modeled_bytes_per_step"] == pytest.approx((2 * 1000.0 + 3 * 1100.0) / 5)
    assert none["round_step_s"] == [1.0, 3.0] and none["wire_bytes_total"] is None
    assert first["step_times_s"] == [0.5, 0.7]                                # the raw cases are not modified
    rows = {r["compressor"]: r for r in link.summarize({"1gbit": [first, other, second]})}
    assert rows["safebits@4.4"]["step_time_s"] == 0.7 and rows["safebits@4.4"]["rounds"] == 2
    assert rows["safebits@4.4"]["link_bytes_per_step"] == pytest.approx(9_000 / 5)
    assert rows["safebits@4.4"]["ratio_to_none"] == pytest.approx(1.0 / 0.7)
    # a compressor missing the wire figure in one round has none overall
    assert link.merge_rounds([first, case("cnn", "safebits@4.4", [0.5], 10, 1.0)])[0]["wire_bytes_total"] is None


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
    (row,) = link.summarize(runs)
    assert row["vs_limit"] is None and row["ratio_to_none"] is None and row["ratio_to_fp16"] is None


def test_summarize_compares_ddp_rows_with_ddp_baselines() -> None:
    runs = fake_runs()
    runs["1gbit"] += [case("cnn", "ddp:none", [1.0], 100, 8000.0), case("cnn", "ddp:fp16", [0.8], 50, 4000.0),
                      case("cnn", "ddp:safebits@4.4", [0.4], 10, 1100.0, wire=1100.0)]
    runs["unlimited"].append(case("cnn", "ddp:none", [0.25], 100, 8000.0))
    rows = {(r["rate"], r["compressor"]): r for r in link.summarize(runs)}
    sb = rows["1gbit", "ddp:safebits@4.4"]
    assert sb["ratio_to_none"] == pytest.approx(2.5) and sb["ratio_to_fp16"] == pytest.approx(2.0)
    assert sb["vs_limit"] == pytest.approx(0.4 / (0.25 + 1100.0 * 8 / 1e9))
    assert rows["1gbit", "safebits@4.4"]["ratio_to_none"] == pytest.approx(4.0)     # Horovod's rows unchanged


def test_quality_table() -> None:
    md = link.quality_table([{"compressor": "ddp:powersgd4", "steps": 10, "link_bytes": 20_000_000,
                              "modeled_bytes_per_step": 1_500_000.0, "train_loss_first": 2.5,
                              "train_loss_last5": 1.25, "held_out_loss": 1.5, "held_out_accuracy": 0.5}])
    assert "| ddp:powersgd4 | 2.00 | 1.50 | 2.500 | 1.250 | 1.500 | 0.500 |" in md


def test_build_tables() -> None:
    runs = fake_runs()
    runs["1gbit"].append(case("lm", "none", [0.1], 100, 8.0, params=10))
    md = link.build_tables(link.summarize(runs))
    assert "### cnn (1,000 parameters)" in md and "### lm (10 parameters)" in md
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
    assert link.format_value(None, ".2f") == "-" and link.format_value(math.nan, ".2f") == "-"
    assert link.format_value(1.234, ".1f", "x") == "1.2x"
