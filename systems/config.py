"""Model hyperparameters: one dataclass and the named sizes of the CS336 handouts."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace


@dataclass
class ModelConfig:
    d_model: int
    d_ff: int
    n_layers: int
    n_heads: int
    vocab_size: int = 10_000
    context_length: int = 2048  # longest sequence the model accepts (RoPE table size)
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    attn_impl: str = "naive"  # see systems.attention.BACKENDS
    # Q, K, V as one (3 d_model, d_model) weight and SwiGLU's W1, W3 as one (2 d_ff, d_model):
    # one GEMM each instead of three and two, for fewer, larger kernels. Same parameter count,
    # same arithmetic (up to rounding order), each block initialised as its own Linear; the state
    # dicts differ (qkv_proj, w13), and systems.model's fuse/unfuse_projections_state_dict convert them.
    fused_projections: bool = False
    # with fused_projections, on CUDA: q, k, v split from the fused output and q, k rotated by one
    # Triton pass each way (systems.kernels.rope_qkv) instead of PyTorch ops; the same arithmetic
    qkv_rope_kernel: bool = False
    name: str = "custom"
    d_head: int = field(init=False)

    def __post_init__(self) -> None:
        for name in ("d_model", "d_ff", "n_layers", "n_heads", "vocab_size", "context_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.fused_projections, bool):
            raise ValueError(f"fused_projections must be True or False, got {self.fused_projections!r}")
        if self.qkv_rope_kernel and not self.fused_projections:
            raise ValueError("qkv_rope_kernel rotates the fused QKV projection's output: set fused_projections=True")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        self.d_head = self.d_model // self.n_heads
        if self.d_head % 2:
            raise ValueError(f"RoPE needs an even head dimension, got d_head={self.d_head}")

    @property
    def n_params(self) -> int:
        """Parameter count in closed form (embedding + blocks + final norm + untied head)."""
        d, f = self.d_model, self.d_ff
        block = 4 * d * d + 3 * d * f + 2 * d
        return 2 * self.vocab_size * d + self.n_layers * block + d

    def with_(self, **changes) -> "ModelConfig":
        """A copy with some fields changed (re-validated)."""
        init_names = {f.name for f in fields(self) if f.init}
        unknown = set(changes) - init_names
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
        return replace(self, **changes)


PRESETS: dict[str, dict] = {
    # tiny size every test uses: runs a train step on a laptop CPU in milliseconds
    "debug": dict(d_model=64, d_ff=192, n_layers=2, n_heads=4, vocab_size=512, context_length=256),
    "small": dict(d_model=768, d_ff=3072, n_layers=12, n_heads=12),
    "medium": dict(d_model=1024, d_ff=4096, n_layers=24, n_heads=16),
    "large": dict(d_model=1280, d_ff=5120, n_layers=36, n_heads=20),
    # the 2025 handout's xl; the 2026 handout's xl is the 2025 handout's 2.7B
    "xl-2025": dict(d_model=1600, d_ff=6400, n_layers=48, n_heads=25),
    "2.7B": dict(d_model=2560, d_ff=10240, n_layers=32, n_heads=32),
    "10B": dict(d_model=4608, d_ff=12288, n_layers=50, n_heads=36),
    # the 2026 leaderboard configuration (a Qwen-like 8B shape)
    "8B": dict(d_model=4096, d_ff=11008, n_layers=34, n_heads=32, vocab_size=151_936,
               context_length=32_768),
}

def check_choice(name: str, value, allowed) -> None:
    """The one check of an option against its allowed values: a one-line ValueError that lists them."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(str, allowed))}; got {value!r}")


HANDOUTS = ("2025", "2026")
DEFAULT_HANDOUT = "2026"
# Each handout's Table 1: its own size names, smallest first, and the preset each one is. The
# two tables share small, medium and large; "xl" names a different model in each.
HANDOUT_TABLES: dict[str, dict[str, str]] = {
    "2025": {"small": "small", "medium": "medium", "large": "large", "xl": "xl-2025", "2.7B": "2.7B"},
    "2026": {"small": "small", "medium": "medium", "large": "large", "xl": "2.7B", "10B": "10B"},
}


def check_handout(handout: str | int) -> str:
    """The handout's name as a string ("2026"): a papermill or -p value may arrive as the int 2026."""
    check_choice("handout", str(handout), HANDOUTS)
    return str(handout)


def handout_sizes(handout: str = DEFAULT_HANDOUT) -> dict[str, str]:
    """The handout's size names (its Table 1, smallest first) -> preset names."""
    return dict(HANDOUT_TABLES[check_handout(handout)])


def preset_of(size: str, handout: str = DEFAULT_HANDOUT) -> str:
    """The preset a size name means in a handout: "xl" is "xl-2025" in 2025 and "2.7B" in 2026;
    preset names (and "debug", "8B") pass through."""
    table = handout_sizes(handout)
    if size in table:
        return table[size]
    if size in PRESETS:
        return size
    raise ValueError(f"unknown model size {size!r} for the {handout} handout; choose one of "
                     f"{', '.join([*table, *(p for p in PRESETS if p not in table.values())])}")


def size_label(preset: str, handout: str = DEFAULT_HANDOUT) -> str:
    """The handout's name for a preset ("2.7B" is "xl" in 2026), else the preset's own name."""
    names = {p: name for name, p in handout_sizes(handout).items()}
    return names.get(preset, preset)


def size_and_preset(preset: str, handout: str = DEFAULT_HANDOUT) -> str:
    """The handout's name with the preset beside it where they differ: "xl (2.7B)" in 2026, "xl
    (xl-2025)" in 2025, else the preset alone."""
    name = size_label(preset, handout)
    return name if name == preset else f"{name} ({preset})"


def get_config(name: str, **overrides) -> ModelConfig:
    """The named preset, optionally with some fields overridden."""
    if name == "xl":
        raise ValueError("'xl' names two sizes: 'xl-2025' (1600/6400/48/25, the 2025 handout's xl) and '2.7B' "
                         "(2560/10240/32/32, the 2026 handout's xl); choose one, or preset_of('xl', handout)")
    if name not in PRESETS:
        raise ValueError(f"unknown model size {name!r}; choose one of {', '.join(PRESETS)}")
    return ModelConfig(name=name, **{**PRESETS[name], **overrides})
