"""The Transformer LM: reference parameter counts, causality, RoPE, dtypes through RMSNorm, input
errors, fused projections against the unfused model (the attention backends themselves:
tests/attention/)."""

import math

import pytest
import torch

from systems.attention import get_backend
from systems.config import PRESETS, ModelConfig, get_config
from systems.model import (Embedding, Linear, RMSNorm, RotaryEmbedding, TransformerLM, fuse_projections_state_dict,
                           unfuse_projections_state_dict)

# Counts of the CS336 reference implementation (untied head, no biases, RMSNorm gains only).
REFERENCE_PARAMS = {"small": 128_625_408, "medium": 423_183_360, "large": 969_411_840,
                    "xl-2025": 1_998_235_200, "2.7B": 3_406_809_600}


@pytest.mark.parametrize("size", sorted(REFERENCE_PARAMS))
def test_parameter_counts_match_reference(size):
    cfg = get_config(size)
    with torch.device("meta"):
        model = TransformerLM(cfg)
    assert model.n_params() == REFERENCE_PARAMS[size]
    assert cfg.n_params == REFERENCE_PARAMS[size]  # the closed form agrees with the modules


def test_the_readmes_parameter_counts_are_the_presets():
    import re
    from pathlib import Path

    readme = " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())
    stated = dict(re.findall(r"`([\w.-]+)`(?: has)? ([\d.]+[MB])(?= parameters|,| and| \()", readme))
    assert set(stated) == set(PRESETS) - {"debug"}, "README.md lists the presets' parameter counts"
    for size, text in stated.items():
        number, unit = text[:-1], 1e6 if text.endswith("M") else 1e9
        decimals = len(number.partition(".")[2])
        assert f"{get_config(size).n_params / unit:.{decimals}f}" == number, (size, text)  # at the digits shown


@pytest.mark.parametrize("size", sorted(PRESETS))
def test_every_preset_builds_and_closed_form_agrees(size):
    cfg = get_config(size)
    with torch.device("meta"):
        assert TransformerLM(cfg).n_params() == cfg.n_params


def test_public_module_signatures():
    lin = Linear(3, 5, device="cpu", dtype=torch.float64)
    assert lin.weight.shape == (5, 3) and lin.weight.dtype == torch.float64
    x = torch.randn(2, 3, dtype=torch.float64)
    torch.testing.assert_close(lin(x), x @ lin.weight.T)
    emb = Embedding(10, 4)
    assert emb(torch.tensor([[1, 2]])).shape == (1, 2, 4)
    norm = RMSNorm(4, eps=1e-5)
    y = torch.randn(3, 4)
    torch.testing.assert_close(norm(y), y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5))
    # with a gain, against float64 written another way (the row's norm over sqrt(d)): fp32's
    # default tolerance covers the model's fp32 rounding
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
    y64, g64 = y.double(), norm.weight.detach().double()
    rms = torch.linalg.vector_norm(y64, dim=-1, keepdim=True) / 2.0  # sqrt(d) = 2
    torch.testing.assert_close(norm(y), (g64 * y64 / torch.sqrt(rms**2 + 1e-5)).float())


@pytest.mark.parametrize("impl", ["naive", "sdpa"])
def test_causal_masking(impl):
    """Changing a later token must leave every earlier position's logits unchanged."""
    torch.manual_seed(0)
    model = TransformerLM(get_config("debug", attn_impl=impl)).eval()
    tokens = torch.randint(0, 512, (2, 24))
    changed = tokens.clone()
    changed[:, 17] = (changed[:, 17] + 1) % 512
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :17], b[:, :17])
    assert not torch.allclose(a[:, 17:], b[:, 17:])


def test_rope_matches_complex_rotation():
    """Adjacent pairs as complex numbers, multiplied by exp(i * pos * theta^(-2k/d))."""
    d, seq, theta = 16, 11, 10_000.0
    rope = RotaryEmbedding(d, context_length=32, theta=theta)
    x = torch.randn(3, seq, d, dtype=torch.float64)
    pos = torch.arange(seq)
    out = rope(x.float(), pos).double()
    z = torch.view_as_complex(x.reshape(3, seq, d // 2, 2).contiguous())
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ref = torch.view_as_real(z * torch.polar(torch.ones(seq, d // 2, dtype=torch.float64),
                                             pos[:, None].double() * freqs)).reshape(3, seq, d)
    # fp32 angles for positions up to 10 have error ~1e-6
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_invalid_hyperparameters_raise_clear_errors():
    with pytest.raises(ValueError, match="divisible by n_heads"):
        ModelConfig(d_model=64, d_ff=128, n_layers=1, n_heads=5)
    with pytest.raises(ValueError, match="unknown model size"):
        get_config("huge")
    with pytest.raises(ValueError, match="unknown attention"):
        get_backend("magic")
    with pytest.raises(ValueError, match="positive integer"):
        ModelConfig(d_model=0, d_ff=128, n_layers=1, n_heads=1)


def test_context_longer_than_maximum_raises():
    model = TransformerLM(get_config("debug", context_length=16))
    with pytest.raises(ValueError, match="exceeds the model's context_length 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize("bad", [-1, 512, 10**6])
def test_token_ids_outside_the_vocabulary_are_a_clear_error(bad):
    # -1 indexed the last embedding row silently, and 512 raised the indexing's own IndexError
    model = TransformerLM(get_config("debug"))
    tokens = torch.zeros(2, 8, dtype=torch.long)
    tokens[1, 3] = bad
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 512\)"):
        model(tokens)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 512\)"):
        model.hidden_states(tokens)  # the fused loss's path reads the embeddings the same way


def test_token_ids_must_be_integers():
    model = TransformerLM(get_config("debug"))
    with pytest.raises(ValueError, match="integer tensor"):
        model(torch.zeros(1, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_token_id_check_does_not_synchronise():
    # the range check is a device assert: the forward is queued without waiting for the GPU
    model = TransformerLM(get_config("debug"), device="cuda")
    tokens = torch.randint(0, 512, (2, 64), device="cuda")
    model(tokens)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call inside raises
    try:
        model(tokens)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rmsnorm_returns_its_inputs_dtype(dtype):
    # the gain stays fp32; the CS336 reference returns (weight * normalized).to(input dtype)
    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 2.0)
    x = torch.randn(3, 8).to(dtype)
    out = norm(x)
    assert out.dtype == dtype
    xf = x.float()
    want = (norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5))).to(dtype)
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_model_with_only_matmul_weights_in_fp16_runs():
    # mixed precision applied by casting the Linear and Embedding weights alone (what FSDP-style
    # hooks do) keeps the RMSNorm gains fp32: the norms must hand their Linears fp16, or the
    # matmul fails with "expected m1 and m2 to have the same dtype"
    from systems.model import Embedding

    model = TransformerLM(get_config("debug"))
    for module in model.modules():
        if isinstance(module, (Linear, Embedding)):
            module.weight.data = module.weight.data.half()
    logits = model(torch.randint(0, 512, (2, 16)))
    assert logits.dtype == torch.float16 and torch.isfinite(logits.float()).all()


# ----------------------------------------------------------------------------- fused projections


def _unfused_and_fused(**overrides):
    """The debug model, and a fused debug model holding the same weights (converted)."""
    torch.manual_seed(0)
    unfused = TransformerLM(get_config("debug", **overrides))
    fused = TransformerLM(get_config("debug", fused_projections=True, **overrides))
    fused.load_state_dict(fuse_projections_state_dict(unfused.state_dict()))
    return unfused, fused


def test_fused_projections_give_the_unfused_logits_and_gradients():
    unfused, fused = _unfused_and_fused()
    tokens = torch.randint(0, 512, (2, 48))
    targets = torch.randint(0, 512, (2, 48))
    a, b = unfused(tokens), fused(tokens)
    # fp32 on both: the same dot products, but a (n, 3d) GEMM may block its reduction otherwise
    # than three (n, d) ones: a few fp32 ulps per matmul, far below 1e-5 on logits of order 1
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for logits in (a, b):
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    grads = unfuse_projections_state_dict({n: p.grad for n, p in fused.named_parameters()})
    want = {n: p.grad for n, p in unfused.named_parameters()}
    assert grads.keys() == want.keys()
    for name, grad in want.items():
        # gradients sum more products than the logits (over batch and sequence too), and x's
        # gradient comes out of one GEMM instead of three added: 1e-4 relative
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_projection_state_dicts_round_trip_exactly():
    unfused, fused = _unfused_and_fused()
    sd, fsd = unfused.state_dict(), fused.state_dict()
    assert {k for k in fsd if "qkv_proj" in k or "w13" in k} and not {k for k in fsd if ".q_proj" in k or ".w1." in k}
    for start, there_and_back in ((sd, unfuse_projections_state_dict(fuse_projections_state_dict(sd))),
                                  (fsd, fuse_projections_state_dict(unfuse_projections_state_dict(fsd)))):
        assert there_and_back.keys() == start.keys()
        assert all(torch.equal(there_and_back[k], start[k]) for k in start)
    # a state dict already in the target layout passes through
    assert fuse_projections_state_dict(fsd).keys() == fsd.keys()
    assert unfuse_projections_state_dict(sd).keys() == sd.keys()


@pytest.mark.parametrize("size", sorted(PRESETS))
def test_fused_projections_keep_the_parameter_count(size):
    cfg = get_config(size, fused_projections=True)
    with torch.device("meta"):
        assert TransformerLM(cfg).n_params() == cfg.n_params == get_config(size).n_params


def test_each_fused_block_is_initialised_as_its_own_linear():
    # a trunc_normal_ cut at +-3 std has std * sqrt(1 - 6 phi(3) / (Phi(3) - Phi(-3))) = 0.9866 std
    cut = math.sqrt(1 - 6 * math.exp(-4.5) / math.sqrt(2 * math.pi) / math.erf(3 / math.sqrt(2)))
    cfg = get_config("debug", fused_projections=True)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    for layer in model.layers:
        for weight, blocks in ((layer.attn.qkv_proj.weight, 3), (layer.ffn.w13.weight, 2)):
            out, fan_in = weight.shape[0] // blocks, weight.shape[1]
            right = math.sqrt(2 / (fan_in + out)) * cut  # the separate Linear's
            wrong = math.sqrt(2 / (fan_in + blocks * out)) * cut  # the fused shape's
            # each block holds >= 64 x 64 = 4096 draws: the sample std's relative error is about
            # 1/sqrt(2 * 4096) = 1.1%, so 5% passes reliably, and the fused shape's std (0.71 of the
            # right one for qkv, 0.76 for the debug model's w13) lies far outside it
            assert abs(wrong / right - 1) > 4 * 0.05
            for block in weight.detach().chunk(blocks):
                assert block.std().item() == pytest.approx(right, rel=0.05)
    # one seed, the same draws as the separate Linears, in order: layer 0's attention (the draws
    # before it are the same; the fused FFN then draws w1, w3, w2 against the unfused w1, w2, w3)
    torch.manual_seed(0)
    unfused = TransformerLM(get_config("debug"))
    q, k, v = model.layers[0].attn.qkv_proj.weight.chunk(3)
    attn = unfused.layers[0].attn
    for block, separate in ((q, attn.q_proj), (k, attn.k_proj), (v, attn.v_proj)):
        assert torch.equal(block, separate.weight)


def test_a_state_dict_of_the_other_layout_is_refused_with_the_conversion_to_use():
    unfused, fused = _unfused_and_fused()
    with pytest.raises(ValueError, match="convert it with systems.model.fuse_projections_state_dict"):
        fused.load_state_dict(unfused.state_dict())
    with pytest.raises(ValueError, match="convert it with systems.model.unfuse_projections_state_dict"):
        unfused.load_state_dict(fused.state_dict())
    partial = {k: v for k, v in unfused.state_dict().items() if not k.endswith("k_proj.weight")}
    with pytest.raises(ValueError, match="lacks layers.0.attn.k_proj.weight"):
        fuse_projections_state_dict(partial)
    with pytest.raises(ValueError, match="fused_projections must be True or False"):
        get_config("debug", fused_projections="yes")
    with pytest.raises(ValueError, match="stacked must be a positive integer dividing out_features"):
        Linear(4, 6, stacked=4)


def test_rope_is_bit_identical_to_rotating_each_pair_and_stacking_the_halves():
    # the textbook form the module replaced (docs/training_step_notes.md, entry 17): the same
    # products and sums, so equal to the last bit in eager mode, in fp32 and in bf16
    d, seq = 64, 40
    rope = RotaryEmbedding(d, context_length=seq)
    inv_freq = 10_000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    pos = torch.arange(seq)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, seq, d).to(dtype)
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        cos, sin = angles.cos(), angles.sin()
        ref = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).to(dtype)
        assert torch.equal(rope(x, pos), ref)
