"""What a GPU step costs in host-device crossings, proven on the CPU: the CUDA backend's orchestration driven by a
fake CUDA backend (``tests/fake_cuda.py``), its launches, uploads and reads counted through the public seam
(``safebits_hvd.codec.host.counting``), for buckets of 1, 62 and 1,000 members. A read, launch or pageable copy added
per member fails these (docs/DESIGN.md, "The batched step")."""

from __future__ import annotations

import ast
import collections
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import safebits_hvd as sb
from safebits_hvd.codec import host, kernels
from safebits_hvd.comm import collectives

from .fake_cuda import fake_cuda
from .helpers import random_grads

# The fake's kernels run nothing, so what the CUDA backend reads back under it is uninitialized memory (its values
# are discarded for the C backend's); slicing by such an offset warns.
pytestmark = pytest.mark.filterwarnings("ignore:Truncating the start/stop/step of slice")

SEND_LAUNCHES = 8
"""The send side of a bucket: NaN/Inf check, screen, its sums, choice and layout, staging, packing, its sums,
gather."""


def bucket_of(members: int) -> list[tuple[str, torch.nn.Parameter]]:
    rng = np.random.default_rng(members)
    sizes = [70_000] if members == 1 else rng.integers(1, 20_000, members).tolist()
    return [(f"p{i}", torch.nn.Parameter(torch.zeros(int(n)))) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("members", [1, 62, 1000])
def test_a_bucket_costs_a_fixed_number_of_launches_uploads_and_reads_whatever_its_member_count(members: int) -> None:
    """One bucket (``fusion_bytes`` above the model's size), screened exactly (every bucket sampled, so no member
    re-packs): the send is 8 launches, one pinned upload and ONE read; the receive two launches (locate, decode),
    one pinned upload and ONE read, of the device's verdicts and Horovod's reduced marker together, once the
    bucket is decoded (the first step reads the marker once more, to learn the op); after the first step (which
    copies the tables to the device once) no pageable copy. A step that makes the bucket's plan (the first, and the
    first screened) uploads its layout once more."""
    params = bucket_of(members)
    compressor = sb.SafeBits(params, budget_bits=4.4, collective="allgather", fusion_bytes=1 << 40,
                             sample_buckets=1 << 20)
    with fake_cuda() as fake:
        assert kernels.backend_name("cpu") == "cuda"
        for step in range(5):
            random_grads(params, step)
            fake.runtime.launches.clear()
            with host.counting() as send:
                pending = [compressor.compress(p.grad) for _, p in reversed(params)]
            sent_launches = [name for name, _ in fake.runtime.launches]
            with host.counting() as receive:
                for _, ctx in pending:
                    compressor.decompress(torch.ones(1), ctx)
            received_launches = [name for name, _ in fake.runtime.launches[len(sent_launches):]]
            assert compressor.last_step.collective == "allgather"
            assert send.traffic.reads == 1, (step, send.traffic)
            assert send.traffic.launches == len(sent_launches) == SEND_LAUNCHES, sent_launches
            assert send.traffic.pinned_uploads == 1 if step >= 2 else send.traffic.pinned_uploads <= 2, step
            assert receive.traffic.reads == 1 + (step == 0), (step, receive.traffic)
            assert received_launches == ["sb_group_locate_kernel", "sb_group_decode_kernel"], received_launches
            assert receive.traffic.launches == 2 and receive.traffic.pinned_uploads == 1, receive.traffic
            if step:
                assert send.traffic.pageable_uploads == receive.traffic.pageable_uploads == 0, step


class TorchOps(TorchDispatchMode):
    """Counts the torch operations that compute (on a GPU, a kernel each): not views, allocations or reads."""

    NOT_KERNELS: ClassVar[frozenset[str]] = frozenset(
        f"aten.{name}" for name in ("slice", "view", "select", "detach", "alias", "as_strided", "empty",
                                    "empty_strided", "lift_fresh", "_local_scalar_dense", "unsqueeze", "expand",
                                    "_reshape_alias", "split", "split_with_sizes", "unbind", "t", "reshape"))

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        if name not in self.NOT_KERNELS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def test_the_torch_operations_of_a_bucket_do_not_grow_with_its_members() -> None:
    """Besides SafeBits' kernels, the torch operations a step runs on its tensors (each a kernel on a GPU) are the
    same few for a bucket of 1, 62 or 1,000 members: nothing is done per member on the device."""
    counts = {}
    for members in (1, 62, 1000):
        params = bucket_of(members)
        compressor = sb.SafeBits(params, budget_bits=4.4, collective="allgather", fusion_bytes=1 << 40,
                                 sample_buckets=1 << 20)
        markers = [torch.ones(1) for _ in params]
        with fake_cuda():
            for step in range(2):
                random_grads(params, step)
                with TorchOps() as send:
                    pending = [compressor.compress(p.grad) for _, p in reversed(params)]
                with TorchOps() as receive:
                    for marker, (_, ctx) in zip(markers, pending, strict=True):
                        compressor.decompress(marker, ctx)
        counts[members] = (sum(send.ops.values()), sum(receive.ops.values()))
        assert max(counts[members]) <= 8, (members, send.ops, receive.ops)
    assert counts[1] == counts[62] == counts[1000], counts


class ManyTensors(torch.nn.Module):
    """A model of the listed parameters, each used by forward (so DDP reduces every one)."""

    def __init__(self, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList([p for _, p in params])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([(w * x).sum() for w in self.weights]).sum()


@pytest.mark.parametrize("members", [1, 62, 1000])
def test_a_ddp_bucket_costs_one_read_to_send_and_the_step_one_to_receive_whatever_its_member_count(
        members: int) -> None:
    """The DDP hook under the fake CUDA backend (world size 1 on Gloo: DDP still hands every bucket to the hook),
    whole buckets as one group (``chunk_bytes`` as on a GPU): each bucket DDP hands over costs one read to send, 10
    launches and 2 pinned uploads once its plan is made (the first steps make it), and the step one read of what
    every bucket received; nothing pageable after the first step."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from safebits_hvd.frontends import ddp as sbddp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        params = bucket_of(members)
        model = ManyTensors(params)
        wrapped = DistributedDataParallel(model, bucket_cap_mb=1024)
        state = sbddp.SafeBitsState(model.named_parameters(), budget_bits=4.4, collective="allgather",
                                    chunk_bytes=sbddp.DEVICE_CHUNK_BYTES, sample_buckets=1 << 20)
        buckets = []

        def hook(state, bucket):      # unannotated: DDP checks a hook's annotations against its own classes
            buckets.append(bucket.index())
            return sbddp.safebits_hook(state, bucket)

        wrapped.register_comm_hook(state, hook)
        x = torch.ones(1)
        with fake_cuda():
            for step in range(4):
                buckets.clear()
                with host.counting() as counted:
                    wrapped(x).backward()
                assert state.last_step.collective == "allgather" and state.step == step + 1
                traffic, count = counted.traffic, len(buckets)
                assert 1 <= count <= 2, buckets          # DDP's small first bucket, then the rest
                assert traffic.reads == count + 1, (step, traffic, count)
                assert traffic.launches == (SEND_LAUNCHES + 2) * count, traffic
                assert traffic.pinned_uploads <= (2 if step >= 2 else 3) * count, (step, traffic)
                if step:
                    assert traffic.pageable_uploads == 0, traffic
    finally:
        dist.destroy_process_group()


def test_the_counts_follow_the_fusion_groups() -> None:
    """The same 62 tensors in groups of at most 64 KiB of gradient: each group pays the bucket's costs once."""
    params = bucket_of(62)
    compressor = sb.SafeBits(params, budget_bits=4.4, collective="allgather", fusion_bytes=1 << 16,
                             sample_buckets=1 << 20)
    groups = len(collectives.fusion_groups(compressor.numels, (1 << 16) // 4))
    assert 1 < groups < 62
    with fake_cuda():
        for step in range(3):
            random_grads(params, step)
            with host.counting() as counted:
                pending = [compressor.compress(p.grad) for _, p in reversed(params)]
                for _, ctx in pending:
                    compressor.decompress(torch.ones(1), ctx)
            assert counted.traffic.reads == groups + 1 + (step == 0), counted.traffic
            assert counted.traffic.launches == (SEND_LAUNCHES + 2) * groups, counted.traffic


def test_fusion_bytes_default_by_device_and_checked() -> None:
    cpu = torch.device("cpu")
    assert collectives.fusion_bytes_for(cpu, 1000 * 16) == 4 * collectives.FUSION_ELEMENTS      # the floor
    assert collectives.fusion_bytes_for(cpu, 11_607_552) == 4 * (11_607_552 // 16)     # a sixteenth each
    assert collectives.fusion_bytes_for(cpu, 124_439_808) == 4 << 20                   # the ceiling
    assert collectives.fusion_bytes_for(torch.device("cuda")) == collectives.DEVICE_FUSION_BYTES
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(50_000))) for i in range(40)]     # 2M elements in all
    compressor = sb.SafeBits(params, budget_bits=4.4, collective="allgather")
    params[-1][1].grad = torch.ones(50_000)
    compressor.compress(params[-1][1].grad)
    assert compressor.core.allgather.fusion_bytes == 4 * 125_000                         # by the model's size
    with pytest.raises(ValueError, match="fusion_bytes"):
        sb.SafeBits(bucket_of(1), fusion_bytes=-1)
    with pytest.raises(ValueError, match="fusion_bytes"):
        sb.SafeBits(bucket_of(1), fusion_bytes=1.5)


def test_counting_measures_only_its_block() -> None:
    with host.counting() as outer:
        host.count(2)
        with host.counting() as inner:
            host.launched(3)
        host.to_host(torch.zeros(1))
    assert inner.traffic == host.Traffic(launches=3)
    assert outer.traffic == host.Traffic(reads=3, launches=3)
    uploaded = host.upload(torch.device("cpu"), {"a": np.arange(3), "b": np.array([[7, 8]])})
    assert uploaded["a"].tolist() == [0, 1, 2] and uploaded["b"].tolist() == [7, 8]


# ------------------------------------------------------------------------------------------- the static check
PACKAGE = Path(__file__).resolve().parent.parent / "safebits_hvd"
SEAM = PACKAGE / "codec" / "host.py"
# Modules off the step's hot path, where a read back is the point: checkpoints, the statistics exchange's host copy,
# the transports' size exchanges, launchers and the CPU/reference kernels (whose tensors are on the host).
OFF_THE_HOT_PATH = {"step/checkpoint.py", "frontends/launch.py", "policy/telemetry.py", "frontends/elastic.py",
                    "codec/kernels/reference.py", "codec/kernels/cpu.py", "codec/kernels/resources.py"}
SYNCING_METHODS = {"cpu", "item", "tolist", "numpy"}
HOST_MAKERS = {"torch.from_numpy", "torch.frombuffer", "torch.tensor", "torch.as_tensor"}
REDUCTIONS = {"all", "any", "min", "max", "sum", "mean", "norm", "prod"}


def _numpy_like(node: ast.AST, names: set[str], functions: set[str] | frozenset[str]) -> bool:
    """Whether ``node`` evidently holds NumPy values: ``np.`` calls, ``host.to_host``, calls of functions that
    return ``np.ndarray``, names and attributes known to hold NumPy values, and what is built from them
    (subscripts, methods, arithmetic, comparisons). Tensors in the package are never such names."""
    while isinstance(node, ast.Subscript | ast.Attribute | ast.UnaryOp):
        if isinstance(node, ast.Attribute) and node.attr in names:
            return True
        node = node.operand if isinstance(node, ast.UnaryOp) else node.value
    if isinstance(node, ast.BinOp):
        return _numpy_like(node.left, names, functions) or _numpy_like(node.right, names, functions)
    if isinstance(node, ast.Compare):
        return any(_numpy_like(x, names, functions) for x in (node.left, *node.comparators))
    if isinstance(node, ast.Call):
        func = ast.unparse(node.func)
        if func.startswith(("np.", "host.to_host")) or func.rsplit(".", 1)[-1] in functions:
            return True
        return isinstance(node.func, ast.Attribute) and _numpy_like(node.func.value, names, functions)
    return isinstance(node, ast.Name) and node.id in names


def _bind(assignments: list[ast.Assign], names: set[str], functions: frozenset[str], local: bool) -> None:
    """Add to ``names`` the targets of ``assignments`` bound to NumPy values, to a fixed point: attributes
    (``self.x = ...``), and plain names too when ``local``."""
    while True:
        before = len(names)
        for node in assignments:
            if _numpy_like(node.value, names, functions):
                for target in node.targets:
                    if isinstance(target, ast.Attribute):
                        names.add(target.attr)
                    elif local and isinstance(target, ast.Name):
                        names.add(target.id)
        if len(names) == before:
            return


def _numpy_annotated(trees: list[ast.AST]) -> tuple[set[str], set[str]]:
    """Names annotated ``np.ndarray`` (parameters, attributes), attributes bound to NumPy values, and functions
    that return one, across the package: what the static check takes for NumPy."""
    names: set[str] = {"np"}
    functions: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and node.annotation is not None and \
                    "np.ndarray" in ast.unparse(node.annotation):
                names.add(node.arg)
            elif isinstance(node, ast.AnnAssign) and "np.ndarray" in ast.unparse(node.annotation):
                target = node.target
                names.add(target.attr if isinstance(target, ast.Attribute) else ast.unparse(target))
            elif isinstance(node, ast.FunctionDef) and node.returns is not None and \
                    ast.unparse(node.returns).startswith("np.ndarray"):
                functions.add(node.name)
    _bind([n for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Assign)], names, frozenset(functions),
          local=False)
    return names, functions


def _host_syncs(tree: ast.AST, numpy_names: frozenset[str] = frozenset({"np"}),
                numpy_functions: frozenset[str] = frozenset()) -> list[tuple[int, str]]:
    """Calls that read a device tensor back outside the seam: ``x.cpu()``, ``x.numpy()``, ``t.item()`` or
    ``t.tolist()`` of a tensor, ``bool``/``int``/``float`` of a tensor's reduction (``t.all()``, ``t.max()``,
    ``t.sum()``...), a host-made tensor's ``.to(device)`` and ``torch.tensor(..., device=)``; "a tensor" is
    what :func:`_numpy_like` cannot show to be NumPy."""
    names = set(numpy_names)
    _bind([n for n in ast.walk(tree) if isinstance(n, ast.Assign)], names, numpy_functions, local=True)

    def numpy_like(node: ast.AST) -> bool:
        return _numpy_like(node, names, numpy_functions)

    def host_made(node: ast.AST) -> bool:
        """A tensor made from host data (its copy to a device is a pageable, synchronizing one)."""
        if isinstance(node, ast.Name):
            return node.id in host_tensors
        return isinstance(node, ast.Call) and ast.unparse(node.func) in HOST_MAKERS and not any(
            k.arg == "device" for k in node.keywords)

    host_tensors: set[str] = set()
    host_tensors.update(t.id for node in ast.walk(tree) if isinstance(node, ast.Assign) and host_made(node.value)
                        for t in node.targets if isinstance(t, ast.Name))

    def syncs(call: ast.Call) -> bool:
        func = call.func
        if isinstance(func, ast.Attribute) and func.attr in SYNCING_METHODS and not call.args:
            return func.attr in ("cpu", "numpy") or not numpy_like(func.value)
        if isinstance(func, ast.Name) and func.id in ("bool", "int", "float") and call.args:
            inner = call.args[0]      # bool(t.all()), int(t.max()), float(t.sum()): a tensor's reduction read back
            return (isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute)
                    and inner.func.attr in REDUCTIONS and not numpy_like(inner.func.value))
        if ast.unparse(func) in ("torch.tensor", "torch.as_tensor"):
            return any(k.arg == "device" for k in call.keywords)
        if isinstance(func, ast.Attribute) and func.attr == "copy_" and call.args:
            return host_made(call.args[0])        # x.copy_(host tensor): to a device tensor, a pageable copy
        return isinstance(func, ast.Attribute) and func.attr == "to" and host_made(func.value)

    found = [(node.lineno, ast.unparse(node)) for node in ast.walk(tree) if isinstance(node, ast.Call) and syncs(node)]
    return found


def test_the_hot_path_reads_back_only_through_the_host_seam() -> None:
    """No ``.cpu()``, ``.item()``, ``.numpy()``, ``.tolist()`` of a tensor, ``bool(tensor.all())`` or ``.to(device)``
    of a host-made tensor in the step's modules: each would be an uncounted synchronization on a GPU."""
    trees = {path.relative_to(PACKAGE).as_posix(): ast.parse(path.read_text())
             for path in sorted(PACKAGE.rglob("*.py"))}
    names, functions = _numpy_annotated(list(trees.values()))
    offenders = []
    for relative, tree in trees.items():
        if relative == SEAM.relative_to(PACKAGE).as_posix() or relative in OFF_THE_HOT_PATH:
            continue
        offenders += [f"{relative}:{line}: {code}"
                      for line, code in _host_syncs(tree, frozenset(names), frozenset(functions))]
    assert not offenders, "reads back outside safebits_hvd/codec/host.py:\n" + "\n".join(offenders)


def test_the_static_check_finds_what_it_forbids() -> None:
    code = """
x = t.cpu()
y = t.item()
z = bool((a == b).all())
w = torch.from_numpy(a).to(device)
v = t.tolist()
ok = np.arange(3)
fine = ok.tolist()
also = host.to_host(t)
fine2 = also[0].item()
u = torch.tensor([1, 2], dtype=torch.int64, device=device)
i = int(buckets.max())
f = float(np.abs(ok).max())
head = torch.frombuffer(raw, dtype=torch.uint8)
payload[:16].copy_(head)
moved = head.to(device)
"""
    assert [line for line, _ in _host_syncs(ast.parse(code))] == [2, 3, 4, 5, 6, 11, 12, 15, 16]
