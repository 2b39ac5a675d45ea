"""systems.measure.profiler: kernel names and categories (on real H100 kernel names), trace parsing
and attribution, the kernel / category / range tables, and the nsys CSV parser."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from systems.measure import profiler as P
from tests.fixtures.traces import MM, MUL, SOFTMAX, write_cuda_trace

FIXTURES = Path(__file__).parents[1] / "fixtures"
# every kernel torch.profiler recorded in train steps of our model on an H100 (see the file's "source")
REAL = json.loads((FIXTURES / "kernels" / "h100_train_step_kernels.json").read_text())["kernels"]

# real names from that recording, the ones the old parser broke on included
SOFTMAX_FWD = ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 9, false, false>"
               "(float*, float const*, int, int, int, bool const*, int, bool)")
FOREACH_MUL = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
               "TensorListMetadata<1>, at::native::(anonymous namespace)::BinaryOpScalarFunctor<float, 1, 1, 0>, "
               "std::multiplies<float>, float>(at::native::(anonymous namespace)::TensorListMetadata<1>, "
               "at::native::(anonymous namespace)::BinaryOpScalarFunctor<float, 1, 1, 0>, std::multiplies<float>, float)")
FOREACH_SQRT = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
                "TensorListMetadata<2>, at::native::(anonymous namespace)::UnaryOpFunctor<float, 2, 1, 1>, "
                "at::native::Sqrt<float> >(at::native::(anonymous namespace)::TensorListMetadata<2>, "
                "at::native::(anonymous namespace)::UnaryOpFunctor<float, 2, 1, 1>, at::native::Sqrt<float>)")
MASKED_FILL = ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::masked_fill_kernel"
               "(at::TensorIterator&, c10::Scalar const&)::{lambda()#1}::operator()() const::{lambda()#7}::operator()() "
               "const::{lambda(float, bool)#1}, std::array<char*, 3ul> >(int, at::native::(anonymous namespace)::"
               "masked_fill_kernel(at::TensorIterator&, c10::Scalar const&)::{lambda()#1}::operator()() const::"
               "{lambda()#7}::operator()() const::{lambda(float, bool)#1}, std::array<char*, 3ul>)")
CUTLASS = ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x128_8x4_nt_align1>"
           "(cutlass_80_simt_sgemm_128x128_8x4_nt_align1::Params)")
INDEX_BWD = ("void (anonymous namespace)::indexing_backward_kernel<float, 4>(long const*, long const*, float const*, "
             "float*, long, long, long, long, bool)")
SCATTER_ADD = ("void at::native::_scatter_gather_elementwise_kernel<128, 8, at::native::_cuda_scatter_gather_internal_"
               "kernel<true, float, long>::operator()<at::native::ReduceAdd>(at::TensorIterator&, long, long, long, "
               "at::native::ReduceAdd const&)::{lambda(int)#1}>(int, at::native::_cuda_scatter_gather_internal_kernel"
               "<true, float, long>::operator()<at::native::ReduceAdd>(at::TensorIterator&, long, long, long, "
               "at::native::ReduceAdd const&)::{lambda(int)#1})")
ADD = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >"
       "(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>)")


def test_the_real_names_are_in_the_recording():
    for name in (SOFTMAX_FWD, FOREACH_MUL, FOREACH_SQRT, MASKED_FILL, CUTLASS, INDEX_BWD, ADD, SCATTER_ADD):
        assert name in REAL, name[:80]


# ----------------------------------------------------------------------------- categories and names


@pytest.mark.parametrize("name, category", [
    ("sm90_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x32_execute_kernel__5x_cublas", "matmul"),
    ("ampere_sgemm_128x64_tn", "matmul"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("void splitKreduce_kernel<32, 16, int, float, float, float, float, true, false, false>(...)", "matmul"),
    ("aten::mm", "matmul"),
    ("aten::bmm", "matmul"),
    ("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, false, false>(...)", "reduction/softmax"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float>>>(T3)",
     "reduction/softmax"),
    ("aten::_softmax", "reduction/softmax"),
    ("aten::mean", "reduction/softmax"),
    ("Memcpy DtoD (Device -> Device)", "copy/memset"),
    ("void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda(...)>(int, T3)", "copy/memset"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char *, 1>>()",
     "copy/memset"),
    ("aten::copy_", "copy/memset"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
     "at::native::binary_internal::MulFunctor<float>>, std::array<char *, 3>>(int, T2, T3)", "elementwise"),
    ("aten::mul", "elementwise"),
    ("aten::add_", "elementwise"),
    ("aten::masked_fill_", "elementwise"),
    # an optimizer's multi-tensor kernel is elementwise work: the optimizer-step range, not the
    # category, says it belongs to the optimizer (this row said "optimizer" before the ranges did)
    ("void multi_tensor_apply_kernel<TensorListMetadata<4>, AdamFunctor<float>>(...)", "elementwise"),
    (FOREACH_MUL, "elementwise"),
    (FOREACH_SQRT, "elementwise"),
    ("aten::_foreach_mul_", "elementwise"),
    ("aten::lerp_", "elementwise"),
    ("void at::native::indexing_backward_kernel<float, 4>(const long *, ...)", "other"),
    ("aten::index", "other"),
    # embedding backward, the loss's gather and scatter-add: data movement by index, not a reduction
    (INDEX_BWD, "other"),
    ("void at::native::vectorized_gather_kernel<16, long>(char*, char*, long*, int, long, long, long, long, bool)",
     "other"),
    (SCATTER_ADD, "other"),
    (CUTLASS, "matmul"),
    (SOFTMAX_FWD, "reduction/softmax"),
    ("aten::unsqueeze", "other"),
])
def test_categorize(name, category):
    assert P.categorize(name) == category


def test_short_kernel_name():
    mul = ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, "
           "at::native::binary_internal::MulFunctor<float>>, std::array<char *, 3>>(int, T2, T3)")
    assert P.short_kernel_name(mul) == "vectorized_elementwise_kernel [MulFunctor]"
    assert P.short_kernel_name("aten::mm") == "aten::mm"
    assert P.short_kernel_name("ampere_sgemm_128x64_tn") == "ampere_sgemm_128x64_tn"


@pytest.mark.parametrize("name, short", [
    # an anonymous namespace used to end the name at its "(": the softmax came out blank and the
    # foreach kernels as "at::native::"
    (SOFTMAX_FWD, "softmax_warp_forward"),
    (FOREACH_MUL, "multi_tensor_apply_kernel [BinaryOpScalar multiplies]"),
    (FOREACH_SQRT, "multi_tensor_apply_kernel [UnaryOp Sqrt]"),
    (MASKED_FILL, "vectorized_elementwise_kernel [masked_fill_kernel]"),
    (CUTLASS, "cutlass_80_simt_sgemm_128x128_8x4_nt_align1"),
    (INDEX_BWD, "indexing_backward_kernel"),
    (ADD, "vectorized_elementwise_kernel [CUDAFunctor_add]"),
    ("Memset (Device)", "Memset (Device)"),
])
def test_short_kernel_name_on_real_names(name, short):
    assert P.short_kernel_name(name) == short


XMMA_TN_64 = "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize64x64x8_stage3_warpsize1x4x1_ffma_aligna4_alignc4_execute_kernel__5x_cublas"


def test_kernel_family_drops_the_tile_configuration():
    assert P.kernel_family(XMMA_TN_64) == P.kernel_family(XMMA_TN_64.replace("64x64x8", "128x128x8")) \
        == "sm80_xmma_gemm_…_tn"
    assert P.kernel_family("cutlass_80_simt_sgemm_256x128_8x4_nn_align1") == "cutlass_80_simt_sgemm_…_nn"
    assert P.kernel_family(P.short_kernel_name(CUTLASS)) == "cutlass_80_simt_sgemm_…_nt"  # a recorded name
    assert P.kernel_family("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT") == "nvjet_tst_…"
    for name in ("aten::mm", "vectorized_elementwise_kernel [MulFunctor]"):
        assert P.kernel_family(name) == name
    assert P.kernel_layout(XMMA_TN_64.replace("_tn_", "_nt_")) == "nt" and P.kernel_layout("aten::mm") is None


def test_every_real_name_gets_a_label_and_a_category():
    for name, phases in REAL.items():
        short = P.short_kernel_name(name)
        # a label is a name, never empty or a bare namespace
        assert short.strip() and not short.endswith("::") and "(anonymous" not in short, name[:120]
        assert len(short) < len(name) or "void " not in name
        if phases == ["optimizer step"]:
            # our AdamW's _foreach kernels, by what they compute
            assert P.categorize(name) == "elementwise", name[:120]
    softmax = [n for n in REAL if "softmax" in n]
    assert softmax and all(P.categorize(n) == "reduction/softmax" for n in softmax)
    gemms = [n for n in REAL if "gemm" in n or n.startswith("nvjet")]
    assert gemms and all(P.categorize(n) == "matmul" for n in gemms)
    # each distinct foreach update keeps a distinct label (the op is part of it)
    foreach = [n for n in REAL if "multi_tensor_apply_kernel" in n]
    assert len({P.short_kernel_name(n) for n in foreach}) == len(foreach) == 6


# ----------------------------------------------------------------------------- a synthetic CUDA trace


def test_cuda_trace_parse_attribute_and_tables(tmp_path):
    path = tmp_path / "cuda.json.gz"
    write_cuda_trace(path)
    items, ranges = P.parse_trace(P.load_trace(path))
    assert set(items["device"]) == {"cuda"}
    assert set(items["kind"]) == {"kernel", "memcpy"}
    items = P.attribute(items, ranges)
    assert len(items) == 12  # the kernel outside every step is dropped
    # the phase column names the range each kernel ran in; the category says what it computes
    mul = items[items["name"] == MUL]
    assert sorted(mul["phase"]) == ["forward", "forward", "optimizer step", "optimizer step"]
    assert set(mul["category"]) == {"elementwise"}
    assert set(items.loc[items["name"] == MM, "phase"]) == {"forward", "backward"}
    assert set(items.loc[items["name"] == SOFTMAX, "kernel"]) == {"softmax_warp_forward"}
    # a range rule, where asked for, overrides the category inside its range only
    ruled = P.attribute(*P.parse_trace(path), range_categories={"optimizer step": "optimizer"})
    assert set(ruled.loc[ruled["optimizer step"], "category"]) == {"optimizer"}
    assert "optimizer" not in set(ruled.loc[~ruled["optimizer step"], "category"])

    opt = P.kernel_table(items, ranges="optimizer step", n_steps=2)
    assert list(opt["category"]) == ["elementwise"] and opt.loc[0, "instances_per_step"] == 1
    cats = P.category_table(items, n_steps=2).set_index("category")
    assert list(cats.index) == list(P.CATEGORIES)
    # step kernel time: 100 + 40 + 10 + 200 + 10 + 30 us per step (the first step's mul is 15 us)
    assert cats["ms_per_step"].sum() == pytest.approx((100 + 40 + 15 + 200 + 10 + 30 + 100 + 40 + 5 + 200 + 10 + 30)
                                                      / 2 / 1e3)
    assert cats.loc["elementwise", "ms_per_step"] == pytest.approx((15 + 30 + 5 + 30) / 2 / 1e3)
    with pytest.raises(ValueError, match="unknown range"):
        P.kernel_table(items, ranges="decode")


# ----------------------------------------------------------------------------- nsys CSV


def test_nsys_parser_current_format_with_preamble():
    df = P.parse_nsys_kern_sum((FIXTURES / "nsys" / "cuda_gpu_kern_sum_2024.csv").read_text(), n_steps=3)
    assert list(df.columns) == list(P.kernel_table(pd.DataFrame(columns=["name", "category", "dur"])).columns)
    assert len(df) == 6
    assert df.loc[0, "category"] == "matmul"
    assert df.loc[0, "total_ms"] == pytest.approx(50.0)
    assert df.loc[0, "instances"] == 150 and df.loc[0, "instances_per_step"] == 50
    assert df.loc[0, "mean_us"] == pytest.approx(333.3333, rel=1e-4)
    assert df["share"].sum() == pytest.approx(1.0)
    # quoted names keep their commas
    soft = df[df["category"] == "reduction/softmax"]
    assert any(n.startswith("void (anonymous namespace)::softmax_warp_forward<float, float, float, 10,")
               for n in soft["name"])
    assert set(df["category"]) == {"matmul", "reduction/softmax", "elementwise", "copy/memset", "other"}
    assert (df["total_ms"].diff().dropna() <= 0).all()
    assert "softmax_warp_forward" in set(df["kernel"])


def test_nsys_parser_old_format():
    df = P.parse_nsys_kern_sum((FIXTURES / "nsys" / "gpukernsum_2021.csv").read_text())
    assert len(df) == 3
    assert df.loc[0, "name"] == "ampere_sgemm_128x64_tn"
    assert df.loc[0, "share"] == pytest.approx(0.7)
    assert df.loc[0, "mean_us"] == pytest.approx(233.3333, rel=1e-4)  # the old 'Average' column, in ns
    assert list(df["category"]) == ["matmul", "reduction/softmax", "copy/memset"]
    assert df.loc[2, "kernel"] == "unrolled_elementwise_kernel [FillFunctor]"


def test_nsys_parser_header_first_line():
    df = P.parse_nsys_kern_sum((FIXTURES / "nsys" / "cuda_gpu_kern_sum_no_preamble.csv").read_text())
    assert list(df["category"]) == ["matmul", "elementwise"]
    assert df["total_ms"].sum() == pytest.approx(2.0)


def test_nsys_parser_rejects_other_text():
    with pytest.raises(ValueError, match="Time"):
        P.parse_nsys_kern_sum("Generating SQLite file\nSKIPPED: report.sqlite does not contain CUDA kernel data.\n")
