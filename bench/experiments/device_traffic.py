"""What one SafeBits step on a GPU costs in host-device crossings, counted on the CPU: the CUDA backend's
orchestration under the fake CUDA backend of the tests (``tests/fake_cuda.py``), through ``safebits_hvd.codec.host``'s
public seam, for a model's gradients (``bench/suites/model_shapes.py``) at the GPU's default fusion groups. Horovod's
order: every ``compress`` (backward's order), then every ``decompress``; one process, allgather path.

    .venv/bin/python -m bench.experiments.device_traffic --models resnet18 resnet50 --steps 3
"""

from __future__ import annotations

import argparse

import torch

import safebits_hvd as sb
from safebits_hvd.codec import host
from tests.fake_cuda import fake_cuda
from tests.helpers import random_grads

from ..suites.model_shapes import MODELS, numel


def traffic(model: str, steps: int, fusion_bytes: int) -> list[tuple[host.Traffic, host.Traffic]]:
    """(send, receive) traffic of each step after the first (which copies the tables to the device once)."""
    params = [(name, torch.nn.Parameter(torch.zeros(numel(shape)))) for name, shape in MODELS[model]()]
    compressor = sb.SafeBits(params, budget_bits=4.4, collective="allgather", fusion_bytes=fusion_bytes)
    rows = []
    with fake_cuda():
        for step in range(steps + 1):
            random_grads(params, step)
            with host.counting() as send:
                pending = [compressor.compress(p.grad) for _, p in reversed(params)]
            with host.counting() as receive:
                for _, ctx in pending:
                    compressor.decompress(torch.ones(1), ctx)
            if step:
                rows.append((send.traffic, receive.traffic))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["resnet18"], choices=sorted(MODELS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fusion-bytes", type=int, default=sb.comm.collectives.DEVICE_FUSION_BYTES)
    args = parser.parse_args()
    print("| model | tensors | groups | send: reads, launches, pinned, pageable | receive: reads, launches, pinned, "
          "pageable |")
    print("| --- | --- | --- | --- | --- |")
    for model in args.models:
        shapes = MODELS[model]()
        sizes = torch.tensor([numel(s) for _, s in shapes]).numpy()
        groups = len(sb.comm.collectives.fusion_groups(sizes, args.fusion_bytes // 4))
        for send, receive in traffic(model, args.steps, args.fusion_bytes):
            print(f"| {model} | {len(shapes)} | {groups} | {send.reads}, {send.launches}, {send.pinned_uploads}, "
                  f"{send.pageable_uploads} | {receive.reads}, {receive.launches}, {receive.pinned_uploads}, "
                  f"{receive.pageable_uploads} |")


if __name__ == "__main__":
    main()
