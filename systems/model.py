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
    """y = x W^T with W shaped (out_features, in_features), no bias.

    ``stacked``: W stacks that many Linears of the same input, each of out_features / stacked
    outputs (one GEMM where there were several; the caller chunks y along its last dim). Each
    block is initialised as its own Linear would be: its std comes from its own fan-out.
    """

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None, *, stacked: int = 1):
        super().__init__()
        if not isinstance(stacked, int) or stacked < 1 or out_features % stacked:
            raise ValueError(f"stacked must be a positive integer dividing out_features ({out_features}), "
                             f"got {stacked!r}")
        self.in_features, self.out_features, self.stacked = in_features, out_features, stacked
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        block_out = out_features // stacked
        std = math.sqrt(2.0 / (in_features + block_out))
        # block by block, in order: a stacked Linear draws the values its separate Linears, built
        # one after another, would (an unstacked one is its own single block)
        for block in self.weight.chunk(stacked):  # (out, in) -> stacked x (out / stacked, in)
            nn.init.trunc_normal_(block, mean=0.0, std=std, a=-3 * std, b=3 * std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T

    def extra_repr(self) -> str:
        stacked = f", stacked={self.stacked}" if self.stacked > 1 else ""
        return f"in_features={self.in_features}, out_features={self.out_features}{stacked}"


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


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Each adjacent pair (x[2i], x[2i+1]) of the last dimension rotated by its angle, given
    ``cos`` (each angle's cosine twice) and ``sin`` (its sine, negated at even places), both
    broadcast against ``x``: x[2i] cos - x[2i+1] sin, x[2i+1] cos + x[2i] sin, computed in
    ``cos``'s dtype and returned in ``x``'s."""
    # (..., d) -> (..., d/2, 2), each pair reversed, -> (..., d)
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (x * cos + swapped * sin).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotates adjacent pairs (x[2i], x[2i+1]) by angle pos * theta^(-2i/d).

    Computed as ``x * cos + swap(x) * sin``, each pair's two elements swapped and the sine's sign
    alternating, rather than as the pair's halves rotated and stacked back together: the same
    products and sums (bit-identical in eager mode), without the stack, which is a concatenation.
    Compiled with per-block CUDA graphs, the 2025 xl's step ran 0.7-0.85 ms faster on an H100
    (docs/training_step_notes.md, entry 17)."""

    def __init__(self, d_head: int, context_length: int, theta: float = 10_000.0, device=None):
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, d_head, 2, device=device, dtype=torch.float32) / d_head)
        angles = torch.outer(torch.arange(context_length, device=device, dtype=torch.float32), inv_freq)
        # each pair's angle twice; the sine negative where it brings the pair's second element into
        # its first: x[2i] cos - x[2i+1] sin, x[2i+1] cos + x[2i] sin
        self.register_buffer("cos", angles.cos().repeat_interleave(2, dim=-1), persistent=False)  # (context, d_head)
        sin = angles.sin()
        self.register_buffer("sin", torch.stack((-sin, sin), dim=-1).flatten(-2), persistent=False)  # (context, d_head)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin at ``positions``, each (seq, d_head)."""
        return self.cos[positions], self.sin[positions]

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return rotate_pairs(x, *self.tables(positions))  # (..., seq, d_head)


def split_heads(t: torch.Tensor, n_heads: int) -> torch.Tensor:
    return t.unflatten(-1, (n_heads, -1)).transpose(-3, -2)  # (b, seq, d) -> (b, h, seq, d_head)


def qkv_heads(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, n_heads: int):
    """q and k rotated, and v, each (b, h, seq, d_head), from the fused projection's output
    (b, seq, 3d) by PyTorch ops; ``systems.kernels.rope_qkv`` computes the same in one Triton pass
    each way."""
    q, k, v = qkv.chunk(3, dim=-1)  # (b, seq, 3d) -> 3 x (b, seq, d) views
    return (rotate_pairs(split_heads(q, n_heads), cos, sin), rotate_pairs(split_heads(k, n_heads), cos, sin),
            split_heads(v, n_heads))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE on q and k. ``cfg.fused_projections``: q, k, v
    come from one ``qkv_proj`` (its rows: q's, then k's, then v's) instead of three Linears;
    ``cfg.qkv_rope_kernel``: on CUDA, split and rotated by ``systems.kernels.rope_qkv``."""

    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.attn_impl, self.fused = cfg.n_heads, cfg.attn_impl, cfg.fused_projections
        self.qkv_rope_kernel = cfg.qkv_rope_kernel
        if self.fused:
            self.qkv_proj = Linear(d, 3 * d, device=device, dtype=dtype, stacked=3)
        else:
            self.q_proj = Linear(d, d, device=device, dtype=dtype)
            self.k_proj = Linear(d, d, device=device, dtype=dtype)
            self.v_proj = Linear(d, d, device=device, dtype=dtype)
        self.output_proj = Linear(d, d, device=device, dtype=dtype)
        self.rope = RotaryEmbedding(cfg.d_head, cfg.context_length, cfg.rope_theta, device=device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope.tables(positions)
        h = self.n_heads
        if self.qkv_rope_kernel and x.is_cuda:  # (b, seq, 3d) -> 3 x (b, h, seq, d_head), q and k rotated
            from systems.kernels.rope_qkv import rope_qkv  # here: it imports Triton, which the model needs nowhere else

            q, k, v = rope_qkv(self.qkv_proj(x), cos, sin, n_heads=h)
        elif self.fused:
            q, k, v = qkv_heads(self.qkv_proj(x), cos, sin, n_heads=h)
        else:
            q = rotate_pairs(split_heads(self.q_proj(x), h), cos, sin)
            k = rotate_pairs(split_heads(self.k_proj(x), h), cos, sin)
            v = split_heads(self.v_proj(x), h)
        out = get_backend(self.attn_impl)(q, k, v, is_causal=True)  # (b, h, seq, d_head)
        return self.output_proj(out.transpose(-3, -2).flatten(-2))  # (b, h, seq, d_head) -> (b, seq, d)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x). ``fused``: w1 and w3 as one ``w13`` (its rows: w1's, then w3's)."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None, *, fused: bool = False):
        super().__init__()
        self.fused = fused
        # one seed gives the fused model the unfused one's attention weights but other FFN weights:
        # the unfused draws w1, w2, w3, the fused w1 and w3 (as w13), then w2. To start both from
        # the same weights, convert one's state dict (fuse_projections_state_dict) into the other
        if fused:
            self.w13 = Linear(d_model, 2 * d_ff, device=device, dtype=dtype, stacked=2)
            self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        else:
            self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
            self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
            self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.w13(x).chunk(2, dim=-1)  # (..., 2 d_ff) -> 2 x (..., d_ff) views
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(gate * torch.sigmoid(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.ln1 = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)
        self.attn = CausalSelfAttention(cfg, device=device, dtype=dtype)
        self.ln2 = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)
        self.ffn = SwiGLU(cfg.d_model, cfg.d_ff, device=device, dtype=dtype, fused=cfg.fused_projections)

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
        self.register_load_state_dict_pre_hook(_check_projection_layout)

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


# ----------------------------------------------------------------------------- projection layouts

# each fused projection (ModelConfig.fused_projections) and the separate ones its rows stack, in order
STACKED_PROJECTIONS: dict[str, tuple[str, ...]] = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "w13": ("w1", "w3")}
_FUSED_OF = {part: fused for fused, parts in STACKED_PROJECTIONS.items() for part in parts}


def _key_parts(key: str) -> tuple[str, str, str]:
    """"layers.0.attn.q_proj.weight" -> ("layers.0.attn", "q_proj", "weight")."""
    head, _, leaf = key.rpartition(".")
    owner, _, name = head.rpartition(".")
    return owner, name, leaf


def _key(owner: str, name: str, leaf: str) -> str:
    return f"{owner}.{name}.{leaf}" if owner else f"{name}.{leaf}"


def fuse_projections_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An unfused model's state dict in the fused layout: each q_proj, k_proj, v_proj weight triple
    becomes one qkv_proj weight, each w1, w3 pair one w13 (rows stacked in that order, new
    tensors); every other entry passes through, so a fused state dict comes back as it was. Any
    dict keyed by parameter names converts (gradients too)."""
    out = {}
    for key, value in state.items():
        owner, name, leaf = _key_parts(key)
        fused = _FUSED_OF.get(name)
        if fused is None:
            out[key] = value
            continue
        keys = [_key(owner, part, leaf) for part in STACKED_PROJECTIONS[fused]]
        missing = [k for k in keys if k not in state]
        if missing:
            raise ValueError(f"cannot fuse {key}: the state dict lacks {', '.join(missing)}; "
                             "pass a whole model's state dict")
        if key == keys[0]:
            out[_key(owner, fused, leaf)] = torch.cat([state[k] for k in keys])  # n x (out, in) -> (n * out, in)
    return out


def unfuse_projections_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A fused model's state dict in the unfused layout (the inverse of fuse_projections_state_dict):
    each qkv_proj weight splits into q_proj, k_proj, v_proj and each w13 into w1, w3, as views of
    the fused tensor; every other entry passes through."""
    out = {}
    for key, value in state.items():
        owner, name, leaf = _key_parts(key)
        parts = STACKED_PROJECTIONS.get(name)
        if parts is None:
            out[key] = value
            continue
        for part, block in zip(parts, value.chunk(len(parts))):  # (n * out, in) -> n x (out, in)
            out[_key(owner, part, leaf)] = block
    return out


def _check_projection_layout(module: TransformerLM, state_dict: dict, prefix: str, *_) -> None:
    """Loading a state dict of the other projection layout: one line naming the conversion, where
    torch's own error would list every missing and unexpected key."""
    fused = module.cfg.fused_projections
    other = set(_FUSED_OF) if fused else set(STACKED_PROJECTIONS)
    if any(key.startswith(prefix) and _key_parts(key)[1] in other for key in state_dict):
        convert = "fuse_projections_state_dict" if fused else "unfuse_projections_state_dict"
        raise ValueError(f"the state dict has {'un' if fused else ''}fused projections and the model "
                         f"{'fuses' if fused else 'does not fuse'} them (ModelConfig.fused_projections); "
                         f"convert it with systems.model.{convert} first")
