"""Registry of built-in workloads: a model, its input shape and its loss, all randomly initialised.

Nothing is downloaded: torchvision models are built with ``weights=None`` and the GPT-2-style
language model is written here in plain ``torch.nn``. A :class:`WorkloadSpec` is frozen; derive a
variant with :func:`dataclasses.replace` (e.g. a shorter sequence for an LM:
``replace(spec, input_shape=(256,))``) and ``build()`` honours the new fields.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from gpulens.errors import UsageError

logger = logging.getLogger(__name__)

IMAGE_CLASSIFICATION = "image_classification"
LANGUAGE_MODEL = "language_model"


@dataclass(frozen=True)
class WorkloadSpec:
    """What one built-in workload is: how to build its model and what it eats.

    ``input_shape`` is per sample: ``(channels, height, width)`` for images, ``(seq_len,)`` for a
    language model. ``num_classes`` is set for image classification, ``vocab_size`` for a language
    model (the other is ``None``).
    """

    name: str
    task: str
    default_batch_size: int
    input_shape: tuple[int, ...]
    builder: Callable[[WorkloadSpec], nn.Module] = field(repr=False, compare=False)
    num_classes: int | None = None
    vocab_size: int | None = None
    description: str = ""
    # Extra model hyper-parameters (GPT layer count, width, ...), read by ``builder``.
    config: tuple[tuple[str, int], ...] = ()

    def build(self) -> nn.Module:
        """A freshly, randomly initialised model on the CPU."""
        return self.builder(self)

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy; for an LM over every position of ``(batch, seq, vocab)`` logits."""
        if self.task == LANGUAGE_MODEL:
            return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))
        return F.cross_entropy(output, target)

    @property
    def is_language_model(self) -> bool:
        """True for token-in, logits-out workloads."""
        return self.task == LANGUAGE_MODEL

    @property
    def image_size(self) -> tuple[int, int] | None:
        """``(height, width)`` of an image workload, ``None`` for a language model."""
        if self.task != IMAGE_CLASSIFICATION:
            return None
        return (self.input_shape[1], self.input_shape[2])

    @property
    def seq_len(self) -> int | None:
        """Tokens per sample of a language model, ``None`` for an image workload."""
        return self.input_shape[0] if self.task == LANGUAGE_MODEL else None

    def to_dict(self) -> dict:
        """JSON-ready description (for a run's effective config)."""
        return {
            "name": self.name,
            "task": self.task,
            "default_batch_size": self.default_batch_size,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
            "vocab_size": self.vocab_size,
            **dict(self.config),
        }


# ---------------------------------------------------------------------------------------------
# GPT-2-style decoder-only language model
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTConfig:
    """GPT-2 hyper-parameters; the defaults are GPT-2 small (124M parameters)."""

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask (fused SDPA kernel where available)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise UsageError(
                f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}: pick a width that is"
            )
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.proj.is_residual_proj = True
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    """Position-wise feed-forward block, 4x expansion with GELU."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.proj.is_residual_proj = True
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer LM: ``forward(idx: (B, T) int64) -> logits (B, T, vocab)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as in GPT-2
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2 init: N(0, 0.02); residual projections scaled by 1/sqrt(2 * n_layer).
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "is_residual_proj", False):
                std /= math.sqrt(2 * self.cfg.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        if t > self.cfg.block_size:
            raise UsageError(
                f"sequence of {t} tokens exceeds the model's context of {self.cfg.block_size}: "
                f"use a sequence length <= {self.cfg.block_size}"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _build_gpt(spec: WorkloadSpec) -> nn.Module:
    cfg = dict(spec.config)
    return GPT(
        GPTConfig(
            vocab_size=spec.vocab_size,
            block_size=spec.input_shape[0],
            n_layer=cfg["n_layer"],
            n_head=cfg["n_head"],
            n_embd=cfg["n_embd"],
        )
    )


# ---------------------------------------------------------------------------------------------
# Image classifiers
# ---------------------------------------------------------------------------------------------


class TinyCNN(nn.Module):
    """Four conv layers and a linear head: trains at hundreds of samples/s on a laptop CPU."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3):
        super().__init__()

        def conv(c_in: int, c_out: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(c_in, c_out, 3, stride=2, padding=1, bias=False),
                nn.BatchNorm2d(c_out),
                nn.ReLU(inplace=True),
            )

        self.features = nn.Sequential(
            conv(in_channels, 16), conv(16, 32), conv(32, 64), conv(64, 128)
        )
        self.head = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _build_tiny_cnn(spec: WorkloadSpec) -> nn.Module:
    return TinyCNN(num_classes=spec.num_classes, in_channels=spec.input_shape[0])


def _torchvision_builder(arch: str) -> Callable[[WorkloadSpec], nn.Module]:
    def build(spec: WorkloadSpec) -> nn.Module:
        import torchvision.models as tvm

        kwargs = {}
        if arch.startswith("vit_"):
            kwargs["image_size"] = spec.input_shape[1]
        return getattr(tvm, arch)(weights=None, num_classes=spec.num_classes, **kwargs)

    build.__name__ = f"build_{arch}"
    return build


def _image_spec(name: str, batch: int, description: str, builder=None) -> WorkloadSpec:
    return WorkloadSpec(
        name=name,
        task=IMAGE_CLASSIFICATION,
        default_batch_size=batch,
        input_shape=(3, 224, 224),
        num_classes=1000,
        builder=builder or _torchvision_builder(name),
        description=description,
    )


def _gpt_spec(name, batch, seq_len, vocab, n_layer, n_head, n_embd, description) -> WorkloadSpec:
    return WorkloadSpec(
        name=name,
        task=LANGUAGE_MODEL,
        default_batch_size=batch,
        input_shape=(seq_len,),
        vocab_size=vocab,
        builder=_build_gpt,
        description=description,
        config=(("n_layer", n_layer), ("n_head", n_head), ("n_embd", n_embd)),
    )


_REGISTRY: dict[str, WorkloadSpec] = {
    s.name: s
    for s in (
        WorkloadSpec(
            name="tiny_cnn",
            task=IMAGE_CLASSIFICATION,
            default_batch_size=32,
            input_shape=(3, 64, 64),
            num_classes=10,
            builder=_build_tiny_cnn,
            description="4-layer CNN on 64x64 images, 10 classes (CPU demos)",
        ),
        _image_spec("resnet18", 256, "ResNet-18, ImageNet 224x224, 1000 classes"),
        _image_spec("resnet50", 128, "ResNet-50, ImageNet 224x224, 1000 classes"),
        _image_spec("mobilenet_v3_small", 256, "MobileNetV3-Small, ImageNet 224x224"),
        _image_spec("vgg16", 64, "VGG-16, ImageNet 224x224, 1000 classes"),
        _image_spec("vit_b_16", 64, "ViT-B/16, ImageNet 224x224, 1000 classes"),
        _gpt_spec("gpt2", 8, 1024, 50257, 12, 12, 768, "GPT-2 small (124M), seq 1024"),
        _gpt_spec("gpt2_tiny", 16, 256, 8192, 4, 4, 256, "4-layer GPT, d=256, seq 256 (CPU demos)"),
    )
}


def list_workloads() -> list[WorkloadSpec]:
    """All built-in workloads, in registry order."""
    return list(_REGISTRY.values())


def get_workload(name: str) -> WorkloadSpec:
    """The workload called ``name``; :class:`UsageError` listing the valid names otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UsageError(
            f"unknown workload {name!r}; choose one of: {', '.join(_REGISTRY)}"
        ) from None
