"""Helpers the Triton kernel tests share (as torch.testing serves torch's): whether Triton is
importable, running a test file's interpreter cases in a subprocess, and compiling a kernel for
an H100 without a GPU."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from systems.measure.devices import triton_interpreting as interpreting

REPO = Path(__file__).resolve().parent.parent



def have_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def relative_error(got, want) -> float:
    """||got - want|| / ||want|| in float64 (||got|| where want is all zero): one number per tensor
    that a backward returning zeros (1.0) or rotating the wrong way (order 1) cannot pass at a
    bound set for bf16 rounding, where an elementwise atol as large as the values themselves can."""
    got, want = got.double(), want.double()
    scale = want.norm()
    return float((got - want).norm() / scale) if scale > 0 else float(got.norm())


def run_interpreter_cases(test_file: str | Path, *, keyword: str = "interp_", min_passed: int) -> str:
    """Run the tests of ``test_file`` whose names contain ``keyword`` with TRITON_INTERPRET=1 set
    before triton is imported (a fresh process: the variable is read at import). Raises
    AssertionError with the output's tail unless they pass and at least ``min_passed`` ran."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", keyword,
                           str(test_file)], env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= min_passed, tail
    return proc.stdout


def compile_for_h100(fn, *, signature: dict, constexprs: dict, aligned_args: tuple[int, ...], num_warps: int,
                     num_stages: int | None = None):
    """A jit'ed kernel compiled for sm_90 without a GPU (Triton ships the compiler and ptxas): its
    ``.asm`` (PTX, cubin) and ``.metadata`` (``shared``: bytes of shared memory per block, which a
    launch on a GPU checks against the device's limit). Skips the calling test where Triton has no
    NVIDIA backend or another offline-compile API."""
    import pytest

    pytest.importorskip("triton.backends.nvidia")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned_args}  # as the launcher specialises them
    try:
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    except TypeError as exc:
        pytest.skip(f"Triton's ASTSource API differs: {exc}")
    options = {"num_warps": num_warps, **({"num_stages": num_stages} if num_stages is not None else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_ptx_for_h100(fn, *, signature: dict, constexprs: dict, aligned_args: tuple[int, ...],
                         num_warps: int) -> str:
    """PTX of a jit'ed kernel compiled for sm_90 (``compile_for_h100``): catches what the
    interpreter lets through (non-constexpr globals, type errors)."""
    return compile_for_h100(fn, signature=signature, constexprs=constexprs, aligned_args=aligned_args,
                            num_warps=num_warps).asm["ptx"]


__all__ = ["REPO", "compile_for_h100", "compile_ptx_for_h100", "have_triton", "interpreting", "run_interpreter_cases"]
