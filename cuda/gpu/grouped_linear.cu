// CUDA handler for the grouped GEMM forms (see jaxfuse/grouped_linear.h): decodes the FFI
// buffers into a grouped_gemm::Problem and enqueues the CUTLASS SM90 kernels of
// cuda/gpu/grouped_gemm/. Group offsets stay on the device; the setup kernel reads them
// there. No host sync, no allocation (the workspace is an FFI result): command-buffer
// compatible, and a CUDA-graph replay after the sizes change on the device is correct.
#include <cuda_runtime.h>

#include "jaxfuse/ffi_common.h"
#include "jaxfuse/grouped_gemm.h"
#include "jaxfuse/grouped_linear.h"
#include "occupancy.cuh"

namespace jaxfuse {
namespace {

namespace gg = grouped_gemm;

bool ToElementType(ffi::DataType type, gg::ElementType* element) {
  switch (type) {
    case ffi::DataType::BF16: *element = gg::ElementType::kBF16; return true;
    case ffi::DataType::F16: *element = gg::ElementType::kF16; return true;
    case ffi::DataType::F8E4M3FN: *element = gg::ElementType::kFloat8E4M3; return true;
    case ffi::DataType::F8E5M2: *element = gg::ElementType::kFloat8E5M2; return true;
    default: return false;
  }
}

// `columnwise`: the FP8 wgrad on column-wise copies made from `columnwise_rows` rows.
// `gated`: the bf16 forward with a gated activation in its epilogue (GroupedGemmGatedCuda).
ffi::Error Run(cudaStream_t stream, int32_t device, const ffi::AnyBuffer& a,
               const ffi::AnyBuffer& b, const ffi::AnyBuffer& offsets,
               const ffi::AnyBuffer* a_scale_inv, const ffi::AnyBuffer* b_scale_inv,
               ffi::AnyBuffer out, ffi::AnyBuffer workspace, int32_t form,
               bool fast_accumulation, bool columnwise = false,
               int64_t columnwise_rows = 0, bool block_scaling = false,
               const gg::GatedEpilogue* gated = nullptr) {
  GroupedProblem shape;
  const bool fp8 = a_scale_inv != nullptr;  // FP8 forward takes the weight K-major
  if (auto error = columnwise
                       ? ParseColumnwiseWgrad(a, b, offsets, out, columnwise_rows, &shape)
                       : ParseGroupedProblem(a, b, offsets, out, form, &shape, fp8 && form == 0);
      error.failure()) {
    return error;
  }
  if (fp8 && !columnwise && form == static_cast<int32_t>(GroupedForm::kWgrad)) {
    return InvalidArgument("FP8 grouped GEMM: the wgrad form reads column-wise copies; call "
                           "jaxfuse_grouped_gemm_fp8_wgrad");
  }
  if (auto error = CheckFastAccumulation(form, a.element_type(), fast_accumulation);
      error.failure()) {
    return error;
  }
  if (block_scaling) {
    if (auto error = columnwise ? CheckColumnwiseBlockScales(shape, *a_scale_inv, *b_scale_inv)
                                : CheckBlockScales(shape, *a_scale_inv, *b_scale_inv);
        error.failure()) {
      return error;
    }
  }
  gg::Problem problem{};
  problem.form = static_cast<gg::Form>(form);
  if (!ToElementType(a.element_type(), &problem.a_type) ||
      !ToElementType(b.element_type(), &problem.b_type) ||
      !ToElementType(out.element_type(), &problem.out_type)) {
    return InvalidArgument("grouped GEMM on CUDA takes bfloat16, float16 or FP8 inputs, got ",
                           DataTypeName(a.element_type()), " x ",
                           DataTypeName(b.element_type()), " -> ",
                           DataTypeName(out.element_type()));
  }
  problem.m = shape.m;
  problem.k = shape.k;
  problem.n = shape.n;
  problem.num_groups = static_cast<int>(shape.groups);
  problem.group_offsets = offsets.typed_data<int32_t>();
  problem.a = a.untyped_data();
  problem.b = b.untyped_data();
  problem.out = out.untyped_data();
  problem.a_scale_inv = a_scale_inv ? static_cast<const float*>(a_scale_inv->untyped_data()) : nullptr;
  problem.b_scale_inv = b_scale_inv ? static_cast<const float*>(b_scale_inv->untyped_data()) : nullptr;
  problem.fast_accumulation = fast_accumulation;
  problem.columnwise = columnwise;
  problem.block_scaling = block_scaling;
  problem.workspace = workspace.untyped_data();
  problem.workspace_bytes = workspace.size_bytes();
  problem.gated = gated;
  if (!gg::IsSupported(problem)) {
    return InvalidArgument("grouped GEMM form ", form, " not supported for these dtypes/shapes "
                           "(k, n must be multiples of 8 for 16-bit and 16 for FP8 inputs; "
                           "the FP8 wgrad takes an e4m3 x and an e4m3 or e5m2 dy; the "
                           "blockwise forms take an e4m3 weight and an e4m3 x or an e4m3 or "
                           "e5m2 dy): m=",
                           shape.m, " k=", shape.k, " n=", shape.n, " G=", shape.groups);
  }
  const int sm_count = gpu::SmCount(device);
  const size_t needed = gg::WorkspaceBytes(problem, sm_count);
  if (needed > problem.workspace_bytes) {
    return Internal("grouped GEMM workspace too small: ", problem.workspace_bytes, " < ", needed,
                    " bytes for ", sm_count, " SMs");
  }
  if (const cudaError_t status = gg::Run(problem, sm_count, stream); status != cudaSuccess) {
    return Internal("grouped GEMM failed: ", cudaGetErrorString(status));
  }
  return ffi::Error::Success();
}

ffi::Error GroupedGemmCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer a,
                           ffi::AnyBuffer b, ffi::AnyBuffer offsets,
                           ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> workspace, int32_t form) {
  return Run(stream, device, a, b, offsets, nullptr, nullptr, *out, *workspace, form,
             /*fast_accumulation=*/false);
}

ffi::Error GroupedGemmFp8Cuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer a,
                              ffi::AnyBuffer b, ffi::AnyBuffer offsets,
                              ffi::AnyBuffer a_scale_inv, ffi::AnyBuffer b_scale_inv,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> workspace, int32_t form,
                              bool fast_accumulation) {
  return Run(stream, device, a, b, offsets, &a_scale_inv, &b_scale_inv, *out, *workspace, form,
             fast_accumulation);
}

// The FP8 wgrads on column-wise copies: per-group scales, or (kBlockScaling) 128 x 1 blocks.
template <bool kBlockScaling>
ffi::Error GroupedGemmFp8WgradCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer a,
                                   ffi::AnyBuffer b, ffi::AnyBuffer offsets,
                                   ffi::AnyBuffer a_scale_inv, ffi::AnyBuffer b_scale_inv,
                                   ffi::Result<ffi::AnyBuffer> out,
                                   ffi::Result<ffi::AnyBuffer> workspace, int64_t rows) {
  return Run(stream, device, a, b, offsets, &a_scale_inv, &b_scale_inv, *out, *workspace,
             static_cast<int32_t>(GroupedForm::kWgrad), /*fast_accumulation=*/false,
             /*columnwise=*/true, rows, kBlockScaling);
}

ffi::Error GroupedGemmFp8BlockwiseCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer a,
                                       ffi::AnyBuffer b, ffi::AnyBuffer offsets,
                                       ffi::AnyBuffer a_scale_inv, ffi::AnyBuffer b_scale_inv,
                                       ffi::Result<ffi::AnyBuffer> out,
                                       ffi::Result<ffi::AnyBuffer> workspace, int32_t form) {
  return Run(stream, device, a, b, offsets, &a_scale_inv, &b_scale_inv, *out, *workspace, form,
             /*fast_accumulation=*/false, /*columnwise=*/false, /*columnwise_rows=*/0,
             /*block_scaling=*/true);
}

// FC1 of a gated MLP: h = x @ w[g] and its scaled activation from one kernel
// (grouped_gemm.h, GatedEpilogue).
ffi::Error GroupedGemmGatedCuda(cudaStream_t stream, int32_t device, ffi::AnyBuffer x,
                                ffi::AnyBuffer w, ffi::AnyBuffer offsets, ffi::AnyBuffer scales,
                                ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::AnyBuffer> act,
                                ffi::Result<ffi::AnyBuffer> workspace, int32_t activation,
                                float limit, float alpha, float linear_offset) {
  if (x.element_type() != ffi::DataType::BF16 || w.element_type() != ffi::DataType::BF16) {
    return InvalidArgument("gated grouped GEMM: x and w must be bfloat16, got ",
                           DataTypeName(x.element_type()), " and ",
                           DataTypeName(w.element_type()));
  }
  const auto kind = static_cast<Activation>(activation);
  if (kind != Activation::kSwiglu && kind != Activation::kClampedSwiglu) {
    return InvalidArgument("gated grouped GEMM: activation must be swiglu (0) or clamped_swiglu "
                           "(2), got ", activation);
  }
  const auto h_dims = h->dimensions();
  const auto act_dims = act->dimensions();
  const auto scales_dims = scales.dimensions();
  if (h_dims.size() != 2 || act_dims.size() != 2 || scales_dims.size() != 1 ||
      act_dims[0] != h_dims[0] || 2 * act_dims[1] != h_dims[1] || scales_dims[0] != h_dims[0]) {
    return InvalidArgument("gated grouped GEMM: expected h [m, 2F], act [m, F] and scales [m]");
  }
  if (h_dims[1] % 256 != 0) {
    return InvalidArgument("gated grouped GEMM: 2F (w.shape[2]) must be a multiple of 256, got ",
                           h_dims[1]);
  }
  const bool scales_f32 = scales.element_type() == ffi::DataType::F32;
  if (!scales_f32 && scales.element_type() != ffi::DataType::BF16) {
    return InvalidArgument("gated grouped GEMM: scales must be float32 or bfloat16, got ",
                           DataTypeName(scales.element_type()));
  }
  if (act->element_type() != ffi::DataType::BF16) {
    return InvalidArgument("gated grouped GEMM: act must be bfloat16");
  }
  gg::GatedEpilogue gated;
  gated.activation.kind = kind;
  gated.activation.limit = limit;
  gated.activation.alpha = alpha;
  gated.activation.linear_offset = linear_offset;
  gated.scales = scales.untyped_data();
  gated.scales_f32 = scales_f32;
  gated.act_out = act->untyped_data();
  return Run(stream, device, x, w, offsets, nullptr, nullptr, *h, *workspace,
             static_cast<int32_t>(GroupedForm::kForward), /*fast_accumulation=*/false,
             /*columnwise=*/false, /*columnwise_rows=*/0, /*block_scaling=*/false, &gated);
}

}  // namespace

// Workspace the CUDA handler needs (for the Python wrapper, which sizes the scratch result).
size_t GroupedGemmWorkspaceBytes(int32_t form, int32_t a_type, int32_t b_type, int64_t m,
                                 int64_t k, int64_t n, int64_t groups, int sm_count,
                                 bool fast_accumulation, bool block_scaling, bool gated) {
  gg::Problem problem{};
  gg::GatedEpilogue gated_epilogue;  // only its presence matters for the workspace
  if (gated) problem.gated = &gated_epilogue;
  problem.fast_accumulation = fast_accumulation;
  problem.block_scaling = block_scaling;
  problem.form = static_cast<gg::Form>(form);
  problem.a_type = static_cast<gg::ElementType>(a_type);
  problem.b_type = static_cast<gg::ElementType>(b_type);
  problem.out_type = problem.a_type == gg::ElementType::kF16 ? gg::ElementType::kF16
                                                             : gg::ElementType::kBF16;
  // Every FP8 wgrad (per-group or blockwise) reads the column-wise copies.
  problem.columnwise = form == static_cast<int32_t>(GroupedForm::kWgrad) &&
                       (problem.a_type == gg::ElementType::kFloat8E4M3 ||
                        problem.a_type == gg::ElementType::kFloat8E5M2);
  problem.m = m;
  problem.k = k;
  problem.n = n;
  problem.num_groups = static_cast<int>(groups);
  return gg::WorkspaceBytes(problem, sm_count);
}

}  // namespace jaxfuse

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGroupedGemmCuda, jaxfuse::GroupedGemmCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // a: x [m, k] (fwd, wgrad) or dy [m, n] (dgrad)
                                  .Arg<ffi::AnyBuffer>()  // b: w [G, k, n] (fwd, dgrad) or dy [m, n] (wgrad)
                                  .Arg<ffi::AnyBuffer>()  // group_offsets: int32 [G + 1], on the device
                                  .Ret<ffi::AnyBuffer>()  // out: y [m, n], dx [m, k] or dw [G, k, n]
                                  .Ret<ffi::AnyBuffer>()  // workspace: uint8 scratch (setup arrays + CUTLASS)
                                  .Attr<int32_t>("form"), // 0 forward, 1 dgrad, 2 wgrad
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGroupedGemmFp8Cuda, jaxfuse::GroupedGemmFp8Cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // a: FP8 x [m, k] (fwd) or dy [m, n] (dgrad)
                                  .Arg<ffi::AnyBuffer>()  // b: FP8 w^T [G, n, k] (fwd) or w [G, k, n] (dgrad)
                                  .Arg<ffi::AnyBuffer>()  // group_offsets: int32 [G + 1]
                                  .Arg<ffi::AnyBuffer>()  // a_scale_inv: float32 [G]
                                  .Arg<ffi::AnyBuffer>()  // b_scale_inv: float32 [G]
                                  .Ret<ffi::AnyBuffer>()  // out: bf16 y [m, n] or dx [m, k]
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<int32_t>("form")  // 0 forward, 1 dgrad
                                  .Attr<bool>("fast_accumulation"),  // forward only: FP8 accumulator
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGroupedGemmFp8WgradCuda,
                              jaxfuse::GroupedGemmFp8WgradCuda</*kBlockScaling=*/false>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // a: x^T e4m3 [k, W], column-wise copy
                                  .Arg<ffi::AnyBuffer>()  // b: dy^T e4m3|e5m2 [n, W], column-wise copy
                                  .Arg<ffi::AnyBuffer>()  // group_offsets: int32 [G + 1]
                                  .Arg<ffi::AnyBuffer>()  // a_scale_inv: float32 [G]
                                  .Arg<ffi::AnyBuffer>()  // b_scale_inv: float32 [G]
                                  .Ret<ffi::AnyBuffer>()  // out: bf16 dw [G, k, n]
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<int64_t>("rows"), // m: rows the copies were made from
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGroupedGemmFp8BlockwiseCuda,
                              jaxfuse::GroupedGemmFp8BlockwiseCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // a: e4m3 x [m, k] (fwd) or e4m3|e5m2 dy [m, n] (dgrad)
                                  .Arg<ffi::AnyBuffer>()  // b: e4m3 w^T [G, n, k] (fwd) or w [G, k, n] (dgrad)
                                  .Arg<ffi::AnyBuffer>()  // group_offsets: int32 [G + 1]
                                  .Arg<ffi::AnyBuffer>()  // a_scale_inv: float32 [m, ceil(kc / 128)]
                                  .Arg<ffi::AnyBuffer>()  // b_scale_inv: float32 [G, ceil(nc / 128), ceil(kc / 128)]
                                  .Ret<ffi::AnyBuffer>()  // out: bf16 y [m, n] or dx [m, k]
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<int32_t>("form"), // 0 forward, 1 dgrad
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGroupedGemmFp8BlockwiseWgradCuda,
                              jaxfuse::GroupedGemmFp8WgradCuda</*kBlockScaling=*/true>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // a: x^T e4m3 [k, W], column-wise copy
                                  .Arg<ffi::AnyBuffer>()  // b: dy^T e4m3|e5m2 [n, W], column-wise copy
                                  .Arg<ffi::AnyBuffer>()  // group_offsets: int32 [G + 1]
                                  .Arg<ffi::AnyBuffer>()  // a_scale_inv: float32 [S, k], S = ColumnwiseScaleRows(rows, G)
                                  .Arg<ffi::AnyBuffer>()  // b_scale_inv: float32 [S, n]
                                  .Ret<ffi::AnyBuffer>()  // out: bf16 dw [G, k, n]
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<int64_t>("rows"), // m: rows the copies were made from
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxfuseGroupedGemmGatedCuda, jaxfuse::GroupedGemmGatedCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // x: bf16 [m, H]
                                  .Arg<ffi::AnyBuffer>()  // w: bf16 [G, H, 2F], gate columns first
                                  .Arg<ffi::AnyBuffer>()  // group_offsets: int32 [G + 1], on the device
                                  .Arg<ffi::AnyBuffer>()  // scales: float32 or bf16 [m]
                                  .Ret<ffi::AnyBuffer>()  // h: bf16 [m, 2F] = x @ w[g] per group
                                  .Ret<ffi::AnyBuffer>()  // act: bf16 [m, F] = act(h) * scales
                                  .Ret<ffi::AnyBuffer>()  // workspace
                                  .Attr<int32_t>("activation")  // 0 swiglu, 2 clamped_swiglu
                                  .Attr<float>("limit")         // clamped_swiglu's parameters
                                  .Attr<float>("alpha")
                                  .Attr<float>("linear_offset"),
                              {ffi::Traits::kCmdBufferCompatible});
