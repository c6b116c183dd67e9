"""Parameter shapes of well-known models, generated layer by layer (no downloads, no torchvision needed).

* ResNet-18 / ResNet-50: torchvision's ImageNet definitions (``torchvision.models.resnet18/50``, 1000 classes):
  11,689,512 and 25,557,032 parameters (BatchNorm weight and bias count; running statistics are buffers).
* GPT-2 small: Hugging Face ``GPT2Model`` (12 layers, width 768, 12 heads, vocabulary 50257, context 1024, the
  LM head tied to ``wte``): 124,439,808 parameters.

Each function returns ``[(name, shape), ...]`` in the models' ``named_parameters()`` order.
"""

from __future__ import annotations

Shape = tuple[int, ...]


def _bn(prefix: str, channels: int) -> list[tuple[str, Shape]]:
    return [(f"{prefix}.weight", (channels,)), (f"{prefix}.bias", (channels,))]


def resnet(blocks: tuple[int, int, int, int], bottleneck: bool, classes: int = 1000) -> list[tuple[str, Shape]]:
    """torchvision ResNet: BasicBlock (expansion 1) or Bottleneck (expansion 4), stages of 64..512 planes."""
    shapes: list[tuple[str, Shape]] = [("conv1.weight", (64, 3, 7, 7)), *_bn("bn1", 64)]
    expansion = 4 if bottleneck else 1
    inplanes = 64
    for stage, (planes, count) in enumerate(zip((64, 128, 256, 512), blocks, strict=True), start=1):
        for b in range(count):
            p = f"layer{stage}.{b}"
            stride = 2 if (b == 0 and stage > 1) else 1
            if bottleneck:
                shapes += [(f"{p}.conv1.weight", (planes, inplanes, 1, 1)), *_bn(f"{p}.bn1", planes),
                           (f"{p}.conv2.weight", (planes, planes, 3, 3)), *_bn(f"{p}.bn2", planes),
                           (f"{p}.conv3.weight", (planes * 4, planes, 1, 1)), *_bn(f"{p}.bn3", planes * 4)]
            else:
                shapes += [(f"{p}.conv1.weight", (planes, inplanes, 3, 3)), *_bn(f"{p}.bn1", planes),
                           (f"{p}.conv2.weight", (planes, planes, 3, 3)), *_bn(f"{p}.bn2", planes)]
            if b == 0 and (stride != 1 or inplanes != planes * expansion):
                shapes += [(f"{p}.downsample.0.weight", (planes * expansion, inplanes, 1, 1)),
                           *_bn(f"{p}.downsample.1", planes * expansion)]
            inplanes = planes * expansion
    shapes += [("fc.weight", (classes, 512 * expansion)), ("fc.bias", (classes,))]
    return shapes


def resnet18() -> list[tuple[str, Shape]]:
    """ResNet-18: BasicBlocks (2, 2, 2, 2)."""
    return resnet((2, 2, 2, 2), bottleneck=False)


def resnet50() -> list[tuple[str, Shape]]:
    """ResNet-50: Bottlenecks (3, 4, 6, 3)."""
    return resnet((3, 4, 6, 3), bottleneck=True)


def gpt2_small(layers: int = 12, width: int = 768, vocab: int = 50257, context: int = 1024) -> list[tuple[str, Shape]]:
    """Hugging Face GPT2Model (Conv1D weights stored ``(in, out)``), LM head tied to ``wte``."""
    shapes: list[tuple[str, Shape]] = [("wte.weight", (vocab, width)), ("wpe.weight", (context, width))]
    for i in range(layers):
        p = f"h.{i}"
        shapes += [(f"{p}.ln_1.weight", (width,)), (f"{p}.ln_1.bias", (width,)),
                   (f"{p}.attn.c_attn.weight", (width, 3 * width)), (f"{p}.attn.c_attn.bias", (3 * width,)),
                   (f"{p}.attn.c_proj.weight", (width, width)), (f"{p}.attn.c_proj.bias", (width,)),
                   (f"{p}.ln_2.weight", (width,)), (f"{p}.ln_2.bias", (width,)),
                   (f"{p}.mlp.c_fc.weight", (width, 4 * width)), (f"{p}.mlp.c_fc.bias", (4 * width,)),
                   (f"{p}.mlp.c_proj.weight", (4 * width, width)), (f"{p}.mlp.c_proj.bias", (width,))]
    shapes += [("ln_f.weight", (width,)), ("ln_f.bias", (width,))]
    return shapes


MODELS = {"resnet18": resnet18, "resnet50": resnet50, "gpt2_small": gpt2_small}
"""Model name -> shape-list function."""

PARAMETER_COUNTS = {"resnet18": 11_689_512, "resnet50": 25_557_032, "gpt2_small": 124_439_808}
"""The published parameter counts the shape lists must reproduce."""


def numel(shape: Shape) -> int:
    """Elements of one shape."""
    n = 1
    for d in shape:
        n *= d
    return n
