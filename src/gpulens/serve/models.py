"""What ``gpulens serve`` can serve: the built-in workloads plus two models that only serving
needs, each with the tensors it takes and gives (its v2 metadata).

- ``identity``: FP32 ``[-1, 16]`` in, the same out. No compute: the server's own overhead.
- ``bert_base``: a BERT-base-sized encoder (12 layers, 768 wide, 12 heads, 30522-token vocabulary,
  sequence 128) from ``torch.nn.TransformerEncoder`` with a 2-class head on the first token;
  INT64 token ids ``[-1, 128]`` in, FP32 logits ``[-1, 2]`` out.
- image classifiers of the registry: FP32 ``[-1, C, H, W]`` in, FP32 logits ``[-1, classes]`` out.
- language models of the registry: INT64 ``[-1, seq]`` in, the last position's FP32 logits
  ``[-1, vocab]`` out (the next-token distribution; the full ``seq x vocab`` would be 200 MB a
  sample for GPT-2); they are also generative tenants (``generative``): OpenAI-compatible
  ``/v1/completions`` with token streaming (:mod:`~gpulens.serve.openai_api`). ``gpt`` is
  GPT-2 small (``gpt2``), ``gpt_tiny`` the 4-layer ``gpt2_tiny``.

Names match with ``-`` or ``_`` (``bert-base`` is ``bert_base``). Randomly initialised, nothing
downloaded, like the training registry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from gpulens.errors import UsageError
from gpulens.workloads.models import get_workload, list_workloads

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: name, v2 datatype and per-sample shape (the batch dim excluded);
    ``max_value``: INT64 inputs take ids in ``[0, max_value)`` (a vocabulary)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    max_value: int | None = None

    def metadata(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": [-1, *self.shape]}


@dataclass(frozen=True)
class ServeModelSpec:
    """A servable model: how to build it (random weights, on the CPU) and its tensors."""

    workload: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    builder: Callable[[], nn.Module] = field(repr=False, compare=False)
    description: str = ""
    generative: bool = False  # a language model: /v1/completions too

    def build(self) -> nn.Module:
        return self.builder()


class LastTokenLogits(nn.Module):
    """A language model's logits at the last position: ``(B, T) -> (B, vocab)``."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm(idx)[:, -1, :]


class BertClassifier(nn.Module):
    """A BERT-base-sized post-LayerNorm encoder with a classification head on the first token."""

    def __init__(self, vocab: int = 30522, seq_len: int = 128, layers: int = 12,
                 hidden: int = 768, heads: int = 12, classes: int = 2):  # fmt: skip
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(seq_len, hidden)
        self.norm = nn.LayerNorm(hidden)
        layer = nn.TransformerEncoderLayer(
            hidden, heads, 4 * hidden, dropout=0.0, activation="gelu", batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.size(1), device=ids.device)
        x = self.encoder(self.norm(self.tok(ids) + self.pos(pos)))
        return self.head(x[:, 0])


BERT_SEQ, BERT_VOCAB, BERT_CLASSES = 128, 30522, 2
IDENTITY_WIDTH = 16

_SERVE_ONLY: dict[str, ServeModelSpec] = {
    "identity": ServeModelSpec(
        "identity",
        (TensorSpec("input", "FP32", (IDENTITY_WIDTH,)),),
        (TensorSpec("output", "FP32", (IDENTITY_WIDTH,)),),
        nn.Identity,
        "FP32 [-1,16] returned as is (the server's own overhead)",
    ),
    "bert_base": ServeModelSpec(
        "bert_base",
        (TensorSpec("input_ids", "INT64", (BERT_SEQ,), max_value=BERT_VOCAB),),
        (TensorSpec("logits", "FP32", (BERT_CLASSES,)),),
        BertClassifier,
        "BERT-base-sized encoder (12x768), INT64 ids [-1,128], 2-class logits",
    ),
}


def _from_registry(name: str) -> ServeModelSpec:
    spec = get_workload(name)
    if spec.is_language_model:
        return ServeModelSpec(
            spec.name,
            (TensorSpec("input_ids", "INT64", spec.input_shape, max_value=spec.vocab_size),),
            (TensorSpec("logits", "FP32", (spec.vocab_size,)),),
            lambda: LastTokenLogits(spec.build()),
            spec.description,
            generative=True,
        )
    return ServeModelSpec(
        spec.name,
        (TensorSpec("input", "FP32", spec.input_shape),),
        (TensorSpec("logits", "FP32", (spec.num_classes,)),),
        spec.build,
        spec.description,
    )


# short names of the built-in language models, as the generative tenant's docs use them
ALIASES = {"gpt": "gpt2", "gpt_small": "gpt2", "gpt_tiny": "gpt2_tiny"}


def servable_names() -> list[str]:
    return [*_SERVE_ONLY, *(w.name for w in list_workloads()), *ALIASES]


def get_serve_model(name: str) -> ServeModelSpec:
    """The servable model ``name`` (``-`` and ``_`` alike); a usage error listing them else."""
    key = name.strip().replace("-", "_")
    key = ALIASES.get(key, key)
    if key in _SERVE_ONLY:
        return _SERVE_ONLY[key]
    try:
        return _from_registry(key)
    except UsageError:
        raise UsageError(
            f"unknown model {name!r} for gpulens serve; choose one of: "
            f"{', '.join(servable_names())}"
        ) from None
