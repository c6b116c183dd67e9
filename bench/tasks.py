"""Every task the end-to-end harnesses train: the models, their data and optimizers, shared by ``bench.hvd_worker``
(Horovod: the demo and the link benchmark) and ``bench.ddp_worker`` (DDP). Plain torch, nothing downloaded.

The link benchmark's models (:class:`Workload`, synthetic batches):

* ``resnet18``: a CIFAR-style ResNet-18 (3x3 stride-1 stem, no max-pool; stages of 64/128/256/512 channels, 2
  basic blocks each; adaptive average pooling, so any image size works: 32 by default, e.g. 224 for ImageNet-size
  inputs). 11,173,962 parameters in 62 tensors at every image size; without the ImageNet stem's 4x downsampling,
  224x224 inputs cost (224/32)^2 = 49 times the compute of 32x32 ones. Synthetic images ``randn(B, 3, S, S)``, 10
  classes, cross-entropy; SGD with momentum.
* ``gpt2_small``: a GPT-2-shaped decoder (:class:`GPT2`): 12 pre-LayerNorm blocks, width 256, 4 heads, vocabulary
  8,192, context 128, learned position embeddings, LM head tied to the token embedding; 11,607,552 parameters in
  148 tensors. Synthetic token ids from the rank's seeded generator, next-token cross-entropy over 128 positions
  (129 ids drawn per sequence); AdamW.

* ``bytes_lm``: the demo's byte-level LM (below), timed like the others.

The demo's tasks (:func:`make_task`: data, model, optimizer, learning-rate schedule and metric):

* ``digits_cnn``: a small CNN on scikit-learn's bundled 8x8 digits (SGD with momentum); metric: validation
  accuracy.
* ``bytes_lm``: a byte-level causal transformer on CPython standard-library sources found on this machine
  (Adam); metric: validation bits per byte.
* ``bytes_lm_large``: the same LM at width 256 (1.2M parameters) on about 2 MB of the same sources.

The race's text task (:class:`TextGPT`, ``bench.race``): the GPT-2-shaped decoder at 4 layers of width 192 over bytes
(1,853,568 parameters in 52 tensors) on about 2 MB of the same sources, AdamW with warm-up and cosine decay.
"""

from __future__ import annotations

import glob
import math
import os
import sysconfig
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

RESNET_CLASSES = 10
DEFAULT_IMAGE_SIZE = 32
SCHEDULES = ("cosine", "constant")
"""Learning-rate schedules of the demo's tasks (:class:`Task`); the first is the demo's, and the threshold
sweep's."""


# ---------------------------------------------------------------------------------------------- ResNet-18
class BasicBlock(torch.nn.Module):
    """Two 3x3 conv + batch-norm layers with an identity (or 1x1 strided) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(cout)
        self.conv2 = torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(cout)
        self.shortcut: torch.nn.Module = torch.nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 1, stride, bias=False),
                                                torch.nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(torch.nn.Module):
    """CIFAR-style ResNet-18 (3x3 stem, no max-pool; stages of 64/128/256/512 channels, 2 blocks each). Built for
    32x32 inputs; adaptive average pooling before the classifier makes it run at any size (e.g. 224x224)."""

    def __init__(self, classes: int = RESNET_CLASSES) -> None:
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, 1, 1, bias=False), torch.nn.BatchNorm2d(64),
                                        torch.nn.ReLU())
        layers: list[torch.nn.Module] = []
        cin = 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = torch.nn.Sequential(*layers)
        self.fc = torch.nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


def image_batch(batch: int, image_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic images ``(batch, 3, image_size, image_size)`` and labels in ``[0, 10)`` from ``gen``."""
    x = torch.randn(batch, 3, image_size, image_size, generator=gen)
    return x, torch.randint(RESNET_CLASSES, (batch,), generator=gen)


# ---------------------------------------------------------------------------------------------- GPT-2-shaped
@dataclass(frozen=True)
class GPTConfig:
    layers: int = 12
    width: int = 256
    heads: int = 4
    vocab: int = 8192
    context: int = 128
    mlp: int = 1024


class CausalSelfAttention(torch.nn.Module):
    """Multi-head causal self-attention: one fused qkv Linear, scaled-dot-product attention, an output Linear."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.width % cfg.heads:
            raise ValueError(f"width {cfg.width} is not a multiple of heads {cfg.heads}")
        self.heads = cfg.heads
        self.qkv = torch.nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = torch.nn.Linear(cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)        # (b, heads, t, c / heads)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(torch.nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x)) with a GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = torch.nn.LayerNorm(cfg.width)
        self.fc = torch.nn.Linear(cfg.width, cfg.mlp)
        self.out = torch.nn.Linear(cfg.mlp, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT2(torch.nn.Module):
    """GPT-2-shaped decoder: token + learned position embeddings, pre-LN blocks, final LayerNorm, LM head tied to
    the token embedding (no bias). Weights drawn as GPT-2 does: normal(0, 0.02), the residual projections scaled
    by 1 / sqrt(2 layers); biases zero."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg = cfg or GPTConfig()
        self.tok = torch.nn.Embedding(cfg.vocab, cfg.width)
        self.pos = torch.nn.Embedding(cfg.context, cfg.width)
        self.blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = torch.nn.LayerNorm(cfg.width)
        self.apply(self._init)
        for block in self.blocks:
            for residual in (block.attn.proj, block.out):
                torch.nn.init.normal_(residual.weight, std=0.02 / (2 * cfg.layers) ** 0.5)

    @staticmethod
    def _init(module: torch.nn.Module) -> None:
        if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits ``(batch, t, vocab)`` of token ids ``(batch, t)``, ``t <= context``."""
        t = ids.shape[1]
        if t > self.cfg.context:
            raise ValueError(f"sequence of {t} tokens exceeds the context of {self.cfg.context}")
        h = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for block in self.blocks:
            h = block(h)
        return F.linear(self.ln_f(h), self.tok.weight)                    # tied LM head



def next_token_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of ``ids`` ``(batch, t + 1)``: predict ``ids[:, 1:]`` from ``ids[:, :-1]``
    (``model``: a :class:`GPT2` or a wrapper of one, e.g. DDP, whose forward gives the logits)."""
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def token_batch(batch: int, gen: torch.Generator, cfg: GPTConfig | None = None) -> torch.Tensor:
    """Synthetic token ids ``(batch, context + 1)``, uniform over the vocabulary, from ``gen``."""
    cfg = cfg or GPTConfig()
    return torch.randint(cfg.vocab, (batch, cfg.context + 1), generator=gen)


# ---------------------------------------------------------------------------------------------- shared
def model_facts(model: torch.nn.Module) -> dict[str, int]:
    """Trainable parameters and parameter tensors (shared tensors, e.g. a tied LM head, counted once)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return {"parameters": sum(p.numel() for p in params), "tensors": len(params)}


# ---------------------------------------------------------------------------------------------- the demo's tasks
class DigitsCNN(torch.nn.Module):
    """Two 3x3 conv layers (16, 32 channels) with 2x2 max-pooling, then a 64-unit MLP head: 13,706 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 2 * 2, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class ByteLM(torch.nn.Module):
    """Pre-norm causal transformer over bytes: vocabulary 256, ``width`` channels, ``layers`` blocks."""

    def __init__(self, context: int, width: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, width)
        self.position = torch.nn.Parameter(torch.randn(context, width) * 0.02)
        block = torch.nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True,
                                                 norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 256)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x) + self.position[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


LM_SHAPES = {"bytes_lm": (64, 400_000, 3e-3), "bytes_lm_large": (256, 2_000_000, 1e-3)}
"""LM task -> (width, corpus bytes, Adam learning rate): the demo's LM (104,192 parameters) and a larger one
(1,202,432 parameters; 2 layers and 4 heads both). At width 256, 1e-3 ended 160 steps of fp32 training slightly
lower than 3e-3 (3.221 against 3.230 validation bits per byte, one process, batch 32)."""


@dataclass
class Task:
    """Data, model factory, optimizer, learning-rate schedule and metric of one task."""

    name: str
    metric_name: str
    steps: int
    lr: float
    batch: int = 0          # examples (CNN) or 64-byte windows (LM) per rank and step; 0: the task's default
    # The learning rate over the steps (one of SCHEDULES): "cosine" decays from lr towards 0 at the last step, so
    # the final evaluation reads a settled model, not the last noisy iterate of a constant rate, where one seed's
    # validation loss of a near-lossless compressor strayed 30% from fp32's (docs/RESULTS.md, section 2).
    schedule: str = SCHEDULES[0]

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown learning-rate schedule {self.schedule!r}; known: {SCHEDULES}")
        if self.name == "digits_cnn":
            from sklearn.datasets import load_digits

            digits = load_digits()
            x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
            y = torch.tensor(digits.target, dtype=torch.int64)
            order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
            x, y = x[order], y[order]
            self.train_x, self.train_y = x[300:], y[300:]
            self.val_x, self.val_y = x[:300], y[:300]
            self.batch = self.batch or 32
        else:
            self.context = 64
            self.batch = self.batch or 16
            self.width, corpus_bytes, _ = LM_SHAPES[self.name]
            self.corpus_files = corpus_files(corpus_bytes)
            data = load_corpus(self.corpus_files)
            split = int(len(data) * 0.9)
            self.train_bytes, self.val_bytes = data[:split], data[split:]
            starts = torch.linspace(0, len(self.val_bytes) - self.context - 2, 256).long()
            self.val_windows = torch.stack([self.val_bytes[s:s + self.context + 1] for s in starts])

    def model(self) -> torch.nn.Module:
        return DigitsCNN() if self.name == "digits_cnn" else ByteLM(self.context, self.width)

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        if self.name == "digits_cnn":
            return torch.optim.SGD(model.parameters(), lr=self.lr, momentum=0.9)
        return torch.optim.Adam(model.parameters(), lr=self.lr)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based, of :attr:`steps`) under :attr:`schedule`."""
        if self.schedule == "cosine":
            return self.lr * 0.5 * (1.0 + math.cos(math.pi * step / self.steps))
        return self.lr

    def set_lr(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Give every parameter group of ``optimizer`` the learning rate of step ``step``."""
        for group in optimizer.param_groups:
            group["lr"] = self.lr_at(step)

    def batch_loss(self, model: torch.nn.Module, gen: torch.Generator) -> torch.Tensor:
        if self.name == "digits_cnn":
            idx = torch.randint(len(self.train_y), (self.batch,), generator=gen)
            return F.cross_entropy(model(self.train_x[idx]), self.train_y[idx])
        starts = torch.randint(len(self.train_bytes) - self.context - 1, (self.batch,), generator=gen)
        windows = torch.stack([self.train_bytes[s:s + self.context + 1] for s in starts])
        logits = model(windows[:, :-1])
        return F.cross_entropy(logits.reshape(-1, 256), windows[:, 1:].reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> tuple[float, float]:
        """(validation loss in nats, metric): accuracy for the CNN, bits per byte for the LM."""
        model.eval()
        try:
            if self.name == "digits_cnn":
                logits = model(self.val_x)
                loss = float(F.cross_entropy(logits, self.val_y))
                return loss, float((logits.argmax(1) == self.val_y).float().mean())
            logits = model(self.val_windows[:, :-1])
            loss = float(F.cross_entropy(logits.reshape(-1, 256), self.val_windows[:, 1:].reshape(-1)))
            return loss, loss / math.log(2)
        finally:
            model.train()


TASK_NAMES = ("digits_cnn", *LM_SHAPES)
CNN_LEARNING_RATE = 0.1     # SGD with momentum 0.9 (the LMs' Adam rates are in LM_SHAPES)


def make_task(name: str, steps: int, batch: int = 0, schedule: str = SCHEDULES[0]) -> Task:
    """Task ``name`` (one of :data:`TASK_NAMES`) with the demo's metric, learning rate and schedule (``batch`` 0:
    the task's default, 32 digits or 16 windows per rank)."""
    if name == "digits_cnn":
        return Task(name, "val_accuracy", steps, lr=CNN_LEARNING_RATE, batch=batch, schedule=schedule)
    if name in LM_SHAPES:
        return Task(name, "val_bits_per_byte", steps, lr=LM_SHAPES[name][2], batch=batch, schedule=schedule)
    raise ValueError(f"unknown task {name!r}; known: {TASK_NAMES}")


def corpus_files(target_bytes: int = LM_SHAPES["bytes_lm"][1]) -> list[str]:
    """CPython standard-library ``.py`` files of this interpreter, in sorted name order, until ``target_bytes``."""
    stdlib = sysconfig.get_paths()["stdlib"]
    chosen, total = [], 0
    for path in sorted(glob.glob(os.path.join(stdlib, "*.py"))):
        size = os.path.getsize(path)
        if size < 2_000 or size > 120_000:   # skip stubs and the very largest modules
            continue
        chosen.append(path)
        total += size
        if total >= target_bytes:
            break
    return chosen


def load_corpus(files: list[str]) -> torch.Tensor:
    """The corpus (``files``, from :func:`corpus_files`) as a uint8 -> int64 tensor of bytes."""
    raw = b"".join(open(p, "rb").read() for p in files)  # noqa: SIM115 - read-and-close
    return torch.tensor(np.frombuffer(raw, dtype=np.uint8).astype(np.int64))


class Workload:
    """A model factory, its optimizer and the loss of one batch, for the link benchmark's models (``resnet18``,
    ``gpt2_small``: both workers; ``bytes_lm``: the demo's LM and corpus, Horovod only); ``loss`` takes the bare
    model or its DDP wrapper. ``unit`` and ``unit_per_sample``: what the throughput counts (images, tokens: 128 per
    sequence, or ``bytes_lm``'s sequences)."""

    NAMES = ("resnet18", "gpt2_small", "bytes_lm")
    DDP_NAMES = ("resnet18", "gpt2_small")

    def __init__(self, name: str, batch: int, image_size: int = DEFAULT_IMAGE_SIZE) -> None:
        if name not in self.NAMES:
            raise ValueError(f"unknown model {name!r}; known: {self.NAMES}")
        if batch < 1 or image_size < 1:
            raise ValueError(f"batch and image size must be >= 1, got {batch} and {image_size}")
        self.name, self.batch, self.image_size = name, batch, image_size
        self.gpt = GPTConfig()
        self.lm: Task | None = make_task("bytes_lm", steps=0, batch=batch) if name == "bytes_lm" else None
        self.unit, self.unit_per_sample = {"resnet18": ("images", 1), "gpt2_small": ("tokens", self.gpt.context),
                                           "bytes_lm": ("sequences", 1)}[name]

    def model(self) -> torch.nn.Module:
        if self.lm is not None:
            return self.lm.model()
        return ResNet18() if self.name == "resnet18" else GPT2(self.gpt)

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        if self.lm is not None:
            return self.lm.optimizer(model)
        if self.name == "resnet18":
            return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)

    def loss(self, model: torch.nn.Module, gen: torch.Generator) -> torch.Tensor:
        if self.lm is not None:
            return self.lm.batch_loss(model, gen)
        if self.name == "resnet18":
            x, y = image_batch(self.batch, self.image_size, gen)
            return F.cross_entropy(model(x), y)
        return next_token_loss(model, token_batch(self.batch, gen, self.gpt))

    def facts(self) -> dict[str, Any]:
        """What the results record about the workload (beyond :func:`model_facts`)."""
        return {"unit": self.unit, "unit_per_sample": self.unit_per_sample,
                "image_size": self.image_size if self.name == "resnet18" else None,
                "seq_len": self.gpt.context if self.name == "gpt2_small" else None,
                "vocab": self.gpt.vocab if self.name == "gpt2_small" else None}


class TextGPT:
    """The race's text task: :class:`GPT2` (4 layers, width 192, 4 heads, byte vocabulary, context 128) trained on
    CPython's sources (:func:`corpus_files`, about 2 MB, 90% for training) with AdamW, a linear warm-up over the
    first tenth of the steps, then cosine decay to zero; ``batch`` windows of 129 bytes per rank and step.
    Validation: the mean next-byte cross-entropy (nats per byte) over 64 fixed windows of the held-out tenth. The
    same methods as :class:`Task` (``model``, ``optimizer``, ``set_lr``, ``batch_loss``, ``evaluate``)."""

    name = "gpt2_text"
    metric_name = "val_bits_per_byte"
    CONFIG = GPTConfig(layers=4, width=192, heads=4, vocab=256, context=128, mlp=768)
    CORPUS_BYTES = 2_000_000

    def __init__(self, steps: int, batch: int = 8, lr: float = 1e-3, weight_decay: float = 0.01) -> None:
        self.steps, self.batch, self.lr, self.weight_decay = steps, batch, lr, weight_decay
        self.warmup = max(1, steps // 10)
        self.corpus_files = corpus_files(self.CORPUS_BYTES)
        data = load_corpus(self.corpus_files)
        split = int(len(data) * 0.9)
        self.train_bytes, self.val_bytes = data[:split], data[split:]
        window = self.CONFIG.context + 1
        starts = torch.linspace(0, len(self.val_bytes) - window - 1, 64).long()
        self.val_windows = torch.stack([self.val_bytes[s:s + window] for s in starts])

    def model(self) -> torch.nn.Module:
        return GPT2(self.CONFIG)

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * progress))

    def set_lr(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        for group in optimizer.param_groups:
            group["lr"] = self.lr_at(step)

    def batch_loss(self, model: torch.nn.Module, gen: torch.Generator) -> torch.Tensor:
        window = self.CONFIG.context + 1
        starts = torch.randint(len(self.train_bytes) - window, (self.batch,), generator=gen)
        return next_token_loss(model, torch.stack([self.train_bytes[s:s + window] for s in starts]))

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> tuple[float, float]:
        """(validation loss in nats per byte, the same in bits per byte)."""
        model.eval()
        try:
            loss = float(next_token_loss(model, self.val_windows))
            return loss, loss / math.log(2)
        finally:
            model.train()
