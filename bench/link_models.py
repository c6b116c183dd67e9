"""The link benchmark's models and synthetic batches, shared by ``bench/link_worker.py`` (Horovod) and
``bench/link_ddp_worker.py`` (DDP). Plain torch, nothing downloaded.

* ``resnet18``: a CIFAR-style ResNet-18 (3x3 stride-1 stem, no max-pool; stages of 64/128/256/512 channels, 2
  basic blocks each; adaptive average pooling, so any image size works: 32 by default, e.g. 224 for ImageNet-size
  inputs). 11,173,962 parameters in 62 tensors at every image size; without the ImageNet stem's 4x downsampling,
  224x224 inputs cost (224/32)^2 = 49 times the compute of 32x32 ones. Synthetic images ``randn(B, 3, S, S)``, 10
  classes, cross-entropy; SGD with momentum.
* ``gpt2_small``: a GPT-2-shaped decoder (:class:`GPT2`): 12 pre-LayerNorm blocks, width 256, 4 heads, vocabulary
  8,192, context 128, learned position embeddings, LM head tied to the token embedding; 11,607,552 parameters in
  148 tensors. Synthetic token ids from the rank's seeded generator, next-token cross-entropy over 128 positions
  (129 ids drawn per sequence); AdamW.

(``bytes_lm``, the demo's byte-level LM on a real corpus, stays in ``bench/demo_worker.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

RESNET_CLASSES = 10
DEFAULT_IMAGE_SIZE = 32


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


class SharedWorkload:
    """A model factory, its optimizer and the loss of one synthetic batch, for the models both workers run
    (``resnet18``, ``gpt2_small``); ``loss`` takes the bare model or its DDP wrapper. ``unit`` and
    ``unit_per_sample``: what the throughput counts (images, or tokens: 128 per sequence)."""

    NAMES = ("resnet18", "gpt2_small")

    def __init__(self, name: str, batch: int, image_size: int = DEFAULT_IMAGE_SIZE) -> None:
        if name not in self.NAMES:
            raise ValueError(f"unknown model {name!r}; known: {self.NAMES}")
        if batch < 1 or image_size < 1:
            raise ValueError(f"batch and image size must be >= 1, got {batch} and {image_size}")
        self.name, self.batch, self.image_size = name, batch, image_size
        self.gpt = GPTConfig()
        self.unit, self.unit_per_sample = ("images", 1) if name == "resnet18" else ("tokens", self.gpt.context)

    def model(self) -> torch.nn.Module:
        return ResNet18() if self.name == "resnet18" else GPT2(self.gpt)

    def optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        if self.name == "resnet18":
            return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)

    def loss(self, model: torch.nn.Module, gen: torch.Generator) -> torch.Tensor:
        if self.name == "resnet18":
            x, y = image_batch(self.batch, self.image_size, gen)
            return F.cross_entropy(model(x), y)
        return next_token_loss(model, token_batch(self.batch, gen, self.gpt))

    def facts(self) -> dict[str, int | str | None]:
        """What the results record about the workload (beyond :func:`model_facts`)."""
        return {"unit": self.unit, "unit_per_sample": self.unit_per_sample,
                "image_size": self.image_size if self.name == "resnet18" else None,
                "seq_len": self.gpt.context if self.name == "gpt2_small" else None,
                "vocab": self.gpt.vocab if self.name == "gpt2_small" else None}
