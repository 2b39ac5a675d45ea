"""Fused training-step kernels: LM head + cross-entropy (fused_linear_ce) and AdamW (fused_adamw)."""
