"""The persistent copy the SM-bandwidth probe times: it must copy every row, through plain loads
and through TMA descriptors, whatever the number of programs (fewer programs than tiles, more
programs than tiles, a ragged last tile). Runs under the Triton interpreter in a subprocess
(TRITON_INTERPRET must be set before triton is imported)."""

import pytest
import torch

from systems.testing import have_triton, interpreting, run_interpreter_cases


@pytest.mark.skipif(not have_triton() or interpreting(), reason="spawns the interpreter run itself")
def test_copy_in_interpreter_subprocess():
    run_interpreter_cases(__file__, min_passed=6)


@pytest.mark.skipif(not interpreting(), reason="runs in the TRITON_INTERPRET=1 subprocess")
@pytest.mark.parametrize("tma", [False, True], ids=["plain", "tma"])
@pytest.mark.parametrize("rows,programs", [(70, 2), (64, 1), (33, 5)])
def test_interp_copy_moves_every_row(rows, programs, tma):
    from systems.bench import sm_bandwidth as b

    src = torch.randn(rows * b.ROW)
    dst = torch.zeros_like(src)
    b.copy(src, dst, programs=programs, tma=tma, warps=4, stages=1)
    torch.testing.assert_close(dst, src, rtol=0, atol=0)


def test_copy_and_main_refuse_bad_input(capsys):
    from systems.bench import sm_bandwidth as b

    with pytest.raises(ValueError, match="multiple of"):
        b.copy(torch.zeros(b.ROW + 1), torch.zeros(b.ROW + 1), programs=1, tma=False, warps=4, stages=1)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            b.main(["--sms", "8"])
        assert "needs CUDA" in capsys.readouterr().err
