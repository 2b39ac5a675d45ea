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
    from systems.attention.flash_triton import flash_backward_triton, flash_forward_triton

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
    rows = t.host_overhead(shapes=((1, 32, 16),), dtype="fp16", calls=1, device="cpu")
    assert [r["path"] for r in rows] == ["public_fwd", "public_fwd_bwd", "kernel_fwd", "sdpa_flash_fwd_bwd"]
    print("OK")
""")


@pytest.mark.slow
def test_explicit_tiles_reproduce_the_autotuned_kernels():
    # the interpreter runs one config per kernel, the same tiles as above
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
