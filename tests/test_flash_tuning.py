"""The tile explorer launches the same kernels the autotuned path runs: with explicit tiles it
must produce the autotuned path's outputs. Runs under the Triton interpreter in a subprocess
(TRITON_INTERPRET must be set before triton is imported)."""

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import torch
    from systems import flash_tuning as t
    from systems.attention.flash_triton import FlashVariant, flash_backward_triton, flash_forward_triton

    x = t.make_inputs(batch=2, seq=48, d=16, dtype="fp16", device="cpu")
    o_ref, lse_ref = flash_forward_triton(x.q, x.k, x.v, True)
    dq_ref, dk_ref, dv_ref = flash_backward_triton(x.q, x.k, x.v, x.o, x.lse, x.do, True)

    # capture the kernels' outputs: launch() allocates them, so read them back from its closure
    def outputs(kernel, cfg):
        fn = t.launch(kernel, x, cfg)
        fn()
        cells = {name: c.cell_contents for name, c in zip(fn.__code__.co_freevars, fn.__closure__)}
        return cells

    fwd = outputs("fwd", (16, 16, 4, 1))
    torch.testing.assert_close(fwd["o"], o_ref, rtol=0, atol=0)
    # the explorer's D = rowsum(O * dO) comes from torch, the backward's from its own kernel: the
    # sums round differently (fp32), which moves fp16 gradients by at most about one fp32 ulp of D
    dkdv = outputs("dkdv", (16, 32, 4, 1))
    torch.testing.assert_close(dkdv["dk"], dk_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(dkdv["dv"], dv_ref, rtol=0, atol=0)  # dV does not use D
    dq = outputs("dq", (32, 16, 4, 1))
    torch.testing.assert_close(dq["dq"], dq_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(dq["delta"], x.delta, rtol=0, atol=1e-5)  # the dQ kernel's D, fp32 sums
    # the whole atomic backward with the interpreter's tiles reproduces the public atomic path
    # exactly (the interpreter runs the programs, and so the atomic adds, in one fixed order)
    dq_at, dk_at, dv_at = flash_backward_triton(x.q, x.k, x.v, x.o, x.lse, x.do, True,
                                                variant=FlashVariant(backward="atomic"))
    atomic = outputs("atomic", (16, 32, 4, 1))
    for name, want in (("dq", dq_at), ("dk", dk_at), ("dv", dv_at)):
        torch.testing.assert_close(atomic[name], want, rtol=0, atol=0)
    torch.testing.assert_close(atomic["dq"], dq_ref, rtol=0, atol=2e-3)  # fp16 dQ: rounding of other sums

    # --compare-backward's pieces that run without a GPU: the check (fp32, which the interpreter's
    # numpy dots compute exactly to rounding) and the table
    checks = t.check_backwards(cases=[((2, 40, 16), 40, True)], dtype="fp32", device="cpu", tol=1e-5)
    assert [r["impl"] for r in checks] == ["triton_split", "triton_atomic", "triton_tma"], checks
    assert all(r["status"] == "ok" for r in checks), checks
    fake = [dict(kind="time", status="ok", batch=1, heads=1, seq=4096, d=64, impl=impl, fwd_ms=ms, bwd_ms=2 * ms,
                 e2e_ms=3 * ms) for impl, ms in (("sdpa_cudnn", 1.0), ("triton_atomic", 0.5))]
    table = t.compare_table(fake)
    assert "0.50x" in table and "triton_atomic  bwd: 2.000" in table, table
    rows = t.host_overhead(shapes=((1, 32, 16),), dtype="fp16", calls=1, device="cpu")
    assert [r["path"] for r in rows] == ["public_fwd", "public_fwd_bwd", "kernel_fwd", "sdpa_flash_fwd_bwd"]
    # the plans those calls chose, as --compare-backward records them
    plans = t.stored_plans()
    assert {"fwd", "dq", "dkdv", "atomic"} <= {r["kernel"] for r in plans}, plans
    assert all(r["kind"] == "plan" and "num_warps" in r for r in plans), plans
    print("OK")
""")


@pytest.mark.slow
def test_explicit_tiles_reproduce_the_autotuned_kernels():
    # the interpreter runs one config per kernel, the same tiles as above
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
