"""KV-cached inference of the built-in GPT (:class:`gpulens.workloads.models.GPT`) for serving.

The cache holds, per layer, keys and values of shape ``(slots, heads, capacity, head_dim)``.
Active sequences always sit in slots ``0..n-1`` (the service moves the last one into a freed
slot), so a decode step reads plain slices, never a gathered copy. Sequences of one step have
different lengths: a boolean mask lets each query attend to its own positions ``0..length``
only, so a short sequence never sees a longer one's stale or padded entries. ``capacity`` grows
by doubling up to the model's context, so memory follows the longest sequence served.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

START_CAPACITY = 64


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query per sequence over its cached keys: two small matmuls. (The fused SDPA kernels
    cost a few ms a call on the CPU for a single masked query over a sliced cache.)"""
    scores = (q @ k.transpose(-2, -1)).float() * (q.size(-1) ** -0.5)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    return weights.to(v.dtype) @ v


class CachedGPT:
    """Prefill and one-token decode over a GPT module's own weights (no copy of them)."""

    def __init__(self, gpt: nn.Module, slots: int, device: torch.device, dtype: torch.dtype):
        self.gpt = gpt
        cfg = gpt.cfg
        self.context = cfg.block_size
        self.vocab_size = cfg.vocab_size
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.slots = slots
        self.device, self.dtype = device, dtype
        self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._grow(min(START_CAPACITY, self.context))

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def _grow(self, need: int) -> None:
        if need <= self.capacity:
            return
        cap = min(self.context, max(need, 2 * self.capacity))
        shape = (self.slots, self.n_head, cap, self.head_dim)
        for i in range(len(self.gpt.blocks)):
            k, v = (torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(2))
            if self.capacity:
                k[:, :, : self.capacity] = self.k[i]
                v[:, :, : self.capacity] = self.v[i]
                self.k[i], self.v[i] = k, v
            else:
                self.k.append(k)
                self.v.append(v)
        self.capacity = cap

    def move(self, src: int, dst: int) -> None:
        """Copy slot ``src``'s cache into slot ``dst`` (compaction after a sequence ends)."""
        for k, v in zip(self.k, self.v, strict=True):
            k[dst] = k[src]
            v[dst] = v[src]

    # ------------------------------------------------------------------------ the forward
    def _split(self, block: nn.Module, h: torch.Tensor):
        b, t, c = h.shape
        q, k, v = block.attn.qkv(h).split(c, dim=2)
        return tuple(
            z.view(b, t, self.n_head, self.head_dim).transpose(1, 2).to(self.dtype)
            for z in (q, k, v)
        )

    def _out(self, block: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = y.shape
        y = y.transpose(1, 2).reshape(b, t, self.n_head * self.head_dim)
        x = x + block.attn.proj(y)
        return x + block.mlp(block.ln_2(x))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.gpt.lm_head(self.gpt.ln_f(h)).float()

    def prefill(self, prompts: list[list[int]], slots: list[int]) -> torch.Tensor:
        """Run the prompts (right-padded into one batch, causal) into ``slots``; the logits at
        each prompt's last position, ``(len(prompts), vocab)``."""
        lengths = [len(p) for p in prompts]
        t = max(lengths)
        self._grow(t)
        ids = torch.zeros((len(prompts), t), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(self.device, non_blocking=True)
        where = torch.tensor(slots, device=self.device)
        gpt = self.gpt
        x = gpt.wte(ids) + gpt.wpe(torch.arange(t, device=self.device))
        for i, block in enumerate(gpt.blocks):
            q, k, v = self._split(block, block.ln_1(x))
            # right padding is harmless under a causal mask: a real position sees no later one
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            self.k[i][where, :, :t] = k
            self.v[i][where, :, :t] = v
            x = self._out(block, x, y)
        last = torch.tensor(lengths, device=self.device) - 1
        return self._logits(x[torch.arange(len(prompts), device=self.device), last])

    def decode(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """One token for each of the sequences in slots ``0..n-1``: ``tokens[i]`` at position
        ``lengths[i]`` (its K/V written there); the next-token logits ``(n, vocab)``."""
        n = tokens.numel()
        t = int(lengths.max()) + 1
        self._grow(t)
        gpt = self.gpt
        rows = torch.arange(n, device=self.device)
        x = (gpt.wte(tokens) + gpt.wpe(lengths)).unsqueeze(1)  # (n, 1, C)
        # query i attends to keys 0..lengths[i]: not to padding, nor to another sequence's past
        mask = (torch.arange(t, device=self.device)[None, :] <= lengths[:, None])[:, None, None]
        for i, block in enumerate(gpt.blocks):
            q, k, v = self._split(block, block.ln_1(x))
            self.k[i][rows, :, lengths] = k[:, :, 0]
            self.v[i][rows, :, lengths] = v[:, :, 0]
            y = _attend(q, self.k[i][:n, :, :t], self.v[i][:n, :, :t], mask)
            x = self._out(block, x, y)
        return self._logits(x[:, 0])
