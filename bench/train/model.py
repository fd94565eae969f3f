"""A small GPT-style decoder and a seeded synthetic token stream for the reference trainer.

Nothing here is tuned for speed: the model exists to give the optimizer realistic parameter
shapes (embeddings, attention and MLP matrices, layer norms, biases) and a loss that goes down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "PRESETS", "preset", "SyntheticTokens", "count_params"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Shape of the decoder. The LM head is untied from the embedding."""

    vocab_size: int
    """Tokens in the vocabulary."""
    d_model: int
    """Width of the residual stream."""
    n_layers: int
    """Transformer blocks."""
    n_heads: int
    """Attention heads per block; must divide ``d_model``."""
    max_seq_len: int
    """Longest sequence the learned position embedding covers."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of ``d_model``."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r}: expected an int >= 1")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.n_heads={self.n_heads} does not divide d_model={self.d_model}: "
                "expected d_model to be a multiple of n_heads"
            )

    @property
    def num_params(self) -> int:
        """Parameter count of :class:`GPT` built from this config (no model needed)."""
        d, h = self.d_model, self.d_model * self.mlp_ratio
        block = (2 * 2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * h + h) + (h * d + d)
        embeddings = self.vocab_size * d + self.max_seq_len * d
        head = 2 * d + d * self.vocab_size
        return embeddings + self.n_layers * block + head


#: Named model sizes. ``tiny`` is for tests (fast on one CPU core); the others for benchmarks.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, max_seq_len=64),
    "small": GPTConfig(vocab_size=8192, d_model=256, n_layers=8, n_heads=4, max_seq_len=256),
    "50m": GPTConfig(vocab_size=16384, d_model=512, n_layers=12, n_heads=8, max_seq_len=512),
    "125m": GPTConfig(vocab_size=24576, d_model=768, n_layers=12, n_heads=12, max_seq_len=1024),
    "350m": GPTConfig(vocab_size=24576, d_model=1024, n_layers=24, n_heads=16, max_seq_len=1024),
}


def preset(name: str) -> GPTConfig:
    """The config of a named size; raises ``ValueError`` naming the choices."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"model size {name!r} is not known: expected one of {sorted(PRESETS)}") from None


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # chunk(3) and -1 heads: under tensor parallel (bench.train._parallel) qkv's output is this
        # rank's q, k and v columns of its heads; unsharded, the same views as split(d) / n_heads
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=2)
        q, k, v = (y.view(b, t, -1, d // self.n_heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer: token + position embedding, pre-norm blocks, untied LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: N(0, 0.02), residual projections scaled by depth, zero biases.
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02
                if name.endswith(("proj.weight", "out.weight")):
                    std /= math.sqrt(2 * self.cfg.n_layers)
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for ``idx`` (batch, seq); with ``targets``, the mean cross-entropy loss (fp32)."""
        t = idx.shape[1]
        if t > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.cfg.max_seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def count_params(model: nn.Module) -> int:
    """Number of trainable elements."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


#: Distinct tokens the synthetic task uses (at most the vocabulary).
TASK_TOKENS = 64


class SyntheticTokens:
    """Seeded, learnable token batches: a noisy walk through a fixed random successor table.

    The walk stays on ``min(vocab_size, task_tokens)`` tokens chosen by ``seed``: with probability
    ``1 - noise`` the next token is ``succ[token]``, else uniform over those tokens. The table
    depends only on ``seed`` (same task on every rank); the stream depends on ``seed`` and
    ``stream`` (use the rank, so ranks see different data). Why a small token set: a walk over
    the whole vocabulary (8192 successors for the ``small`` preset) is not learnable in the
    README's 40 steps of 2 x 16 tokens, and its loss rose; on 64 tokens the loss falls from
    ``log(vocab)`` within a few dozen steps (the model first learns which tokens occur, then
    their successors), for every preset.
    """

    def __init__(
        self, *, vocab_size: int, batch_size: int, seq_len: int, seed: int, stream: int = 0,
        noise: float = 0.1, task_tokens: int = TASK_TOKENS, device: torch.device | str = "cpu",
    ) -> None:
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise={noise!r}: expected a float in [0, 1]")
        if isinstance(task_tokens, bool) or not isinstance(task_tokens, int) or task_tokens < 1:
            raise ValueError(f"task_tokens={task_tokens!r}: expected an int >= 1")
        table_gen = torch.Generator().manual_seed(seed)
        n = min(vocab_size, task_tokens)
        self._tokens = torch.randperm(vocab_size, generator=table_gen)[:n]
        self._succ = torch.randperm(n, generator=table_gen)  # over indices into self._tokens
        self._gen = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * (stream + 1))
        self.vocab_size, self.batch_size, self.seq_len = vocab_size, batch_size, seq_len
        self.noise, self.task_tokens = noise, n
        self.device = torch.device(device)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch, seq_len) int64 on the device; targets are shifted by one."""
        b, t, g, n = self.batch_size, self.seq_len + 1, self._gen, self.task_tokens
        index = torch.empty(b, t, dtype=torch.long)
        index[:, 0] = torch.randint(n, (b,), generator=g)
        jump = torch.rand(b, t, generator=g) < self.noise
        rand = torch.randint(n, (b, t), generator=g)
        for i in range(1, t):
            index[:, i] = torch.where(jump[:, i], rand[:, i], self._succ[index[:, i - 1]])
        tokens = self._tokens[index].to(self.device, non_blocking=True)
        return tokens[:, :-1], tokens[:, 1:]
