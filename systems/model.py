"""The CS336 "basics" Transformer LM: pre-norm blocks, RoPE, SwiGLU, untied head, no biases.

Pure model code: no distributed, compile or profiling logic beyond named ranges inside
attention (systems.attention). Parallelism is applied from outside (systems.parallel.plan); the
one seam it uses here is ``TransformerLM.layer_runner``, which activation checkpointing sets.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from systems.attention import get_backend
from systems.config import ModelConfig


class Linear(nn.Module):
    """y = x W^T with W shaped (out_features, in_features), no bias."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        std = math.sqrt(2.0 / (in_features + out_features))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        nn.init.trunc_normal_(self.weight, mean=0.0, std=1.0, a=-3.0, b=3.0)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        check_token_ids(token_ids, self.weight.shape[0])
        return self.weight[token_ids]


def check_token_ids(token_ids: torch.Tensor, vocab_size: int) -> None:
    """Token ids must be integers in [0, vocab_size): indexing would wrap -1 to the last row
    silently. On a GPU the range check is an asynchronous device assert (no host synchronisation
    on the hot path; a failure surfaces at a later launch, as any device-side assert); on a CPU
    it is a plain ValueError."""
    if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
        raise ValueError(f"token ids must be an integer tensor, got dtype {token_ids.dtype}")
    if token_ids.numel() == 0:
        return
    message = f"token ids must lie in [0, {vocab_size}) (the vocabulary size)"
    if token_ids.is_cuda:
        torch._assert_async(((token_ids >= 0) & (token_ids < vocab_size)).all(), message)
    elif token_ids.device.type != "meta" and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
        raise ValueError(f"{message}; got ids from {int(token_ids.min())} to {int(token_ids.max())}")


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the mean of squares is taken in fp32: in fp16/bf16 it overflows or loses the small terms.
        # The result has the input's dtype whatever the gain's (the CS336 reference's
        # (weight * normalized).to(in_dtype)): a model whose matmul weights alone were cast to
        # fp16 (mixed precision applied by hooks) keeps feeding its Linears fp16.
        in_dtype = x.dtype
        x = x.float()
        rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return (self.weight * (x * rms)).to(in_dtype)


class RotaryEmbedding(nn.Module):
    """Rotates adjacent pairs (x[2i], x[2i+1]) by angle pos * theta^(-2i/d)."""

    def __init__(self, d_head: int, context_length: int, theta: float = 10_000.0, device=None):
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, d_head, 2, device=device, dtype=torch.float32) / d_head)
        angles = torch.outer(torch.arange(context_length, device=device, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)  # (context, d_head/2)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[positions], self.sin[positions]  # (seq, d_head/2)
        pairs = x.unflatten(-1, (-1, 2))  # (..., seq, d_head/2, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return rotated.flatten(-2).to(x.dtype)  # (..., seq, d_head)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.attn_impl = cfg.n_heads, cfg.attn_impl
        self.q_proj = Linear(d, d, device=device, dtype=dtype)
        self.k_proj = Linear(d, d, device=device, dtype=dtype)
        self.v_proj = Linear(d, d, device=device, dtype=dtype)
        self.output_proj = Linear(d, d, device=device, dtype=dtype)
        self.rope = RotaryEmbedding(cfg.d_head, cfg.context_length, cfg.rope_theta, device=device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(-1, (self.n_heads, -1)).transpose(-3, -2)  # (b, seq, d) -> (b, h, seq, d_head)

        q = self.rope(heads(self.q_proj(x)), positions)
        k = self.rope(heads(self.k_proj(x)), positions)
        v = heads(self.v_proj(x))
        out = get_backend(self.attn_impl)(q, k, v, is_causal=True)  # (b, h, seq, d_head)
        return self.output_proj(out.transpose(-3, -2).flatten(-2))  # (b, h, seq, d_head) -> (b, seq, d)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x)
        return self.w2(gate * torch.sigmoid(gate) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.ln1 = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)
        self.attn = CausalSelfAttention(cfg, device=device, dtype=dtype)
        self.ln2 = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)
        self.ffn = SwiGLU(cfg.d_model, cfg.d_ff, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), positions)
        return x + self.ffn(self.ln2(x))


class TransformerLM(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.token_embeddings = Embedding(cfg.vocab_size, cfg.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(TransformerBlock(cfg, device=device, dtype=dtype) for _ in range(cfg.n_layers))
        self.ln_final = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)
        self.lm_head = Linear(cfg.d_model, cfg.vocab_size, device=device, dtype=dtype)
        # how the blocks run: None runs them one after the other; systems.parallel.checkpoint sets
        # a runner that calls groups of them under activation checkpointing
        self.layer_runner = None

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(batch, seq) token ids -> (batch, seq, vocab) logits."""
        return self.lm_head(self.hidden_states(token_ids))

    def hidden_states(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(batch, seq) token ids -> (batch, seq, d_model), the normed input of the LM head
        (a fused head + loss takes it with ``lm_head.weight`` instead of the logits)."""
        seq_len = token_ids.shape[-1]
        if seq_len > self.cfg.context_length:
            raise ValueError(
                f"sequence length {seq_len} exceeds the model's context_length {self.cfg.context_length}"
            )
        positions = torch.arange(seq_len, device=token_ids.device)
        x = self.token_embeddings(token_ids)  # (batch, seq) -> (batch, seq, d_model)
        if self.layer_runner is None:
            for layer in self.layers:
                x = layer(x, positions)
        else:
            x = self.layer_runner(self.layers, x, positions)
        return self.ln_final(x)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
