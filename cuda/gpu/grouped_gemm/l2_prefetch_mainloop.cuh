// A grouped mainloop that pulls the next group's operands into L2 while this one computes.
//
// With many small groups (512 rows: 64 output tiles per group in the forward, 512 in the
// wgrad) the CTAs of a persistent grid cross a group boundary every one to four tiles, and
// every crossing starts on operands nobody has read yet: Nsight Compute's stall sampling of
// the 64 x 512 wgrad (grouped GEMM README, "Where the warps stall") found a tile's first
// k-block missing from shared memory for 32% of tiles, close to the 26% that start a new
// group, against 0.15% for the other k-blocks. The producer warp, as it moves to group g
// (tensormaps_perform_update, once per group change), issues cp.async.bulk.prefetch.L2 for
// its share of group g + 1's A and B, so that the wave of CTAs reaching g + 1 a few tiles
// later reads them from L2 instead of all missing to DRAM at once.
//
// Only where a group is short: at most kMaxWavesPerGroup waves of tiles (CTAs) per group,
// so that two groups' operands (the one being computed, the one prefetched) sit in L2 and
// a large group (8 x 8192 rows) is never streamed in ahead of use. Params::l2_prefetch (from
// Arguments, GemmArrays::l2_prefetch, JAXFUSE_GROUPED_GEMM_L2_PREFETCH) turns it off at run
// time, so one build can A/B it. Everything else is the base collective's.
#pragma once

#include <cstdint>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"

namespace jaxfuse::grouped_gemm::detail {

// This thread's piece of [begin, begin + bytes) split into `parts` pieces of a multiple of
// 16 bytes (the bulk prefetch's granule; a piece's tail short of one is left out).
CUTLASS_DEVICE void PrefetchL2Piece(const char* begin, int64_t bytes, int part, int parts) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int64_t piece = ((bytes + parts - 1) / parts + 15) & ~int64_t{15};
  const int64_t start = piece * part;
  if (piece <= 0 || start >= bytes) return;
  const int64_t size = (bytes - start < piece ? bytes - start : piece) & ~int64_t{15};
  if (size <= 0) return;
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(begin + start),
               "r"(static_cast<uint32_t>(size))
               : "memory");
#endif
}

template <class Base>
struct L2PrefetchMainloop : Base {
  using typename Base::TileShape;
  using UnderlyingShape = cute::Shape<int, int, int>;  // M, N, K of one group
  static constexpr int kMaxWavesPerGroup = 4;

  struct Arguments : Base::Arguments {
    bool l2_prefetch = false;
  };
  struct Params : Base::Params {
    UnderlyingShape const* problem_shapes = nullptr;  // [num_groups], on the device
    int num_groups = 0;
    bool l2_prefetch = false;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args,
                                        void* workspace) {
    Params params;
    static_cast<typename Base::Params&>(params) =
        Base::to_underlying_arguments(problem_shapes, args, workspace);
    params.problem_shapes = problem_shapes.problem_shapes;
    params.num_groups = problem_shapes.groups();
    params.l2_prefetch = args.l2_prefetch;
    return params;
  }

  // Elements one operand of a group spans in memory: `outer` rows (or columns) of the
  // leading dimension `ld`, the last one `inner` long.
  CUTLASS_DEVICE static int64_t Span(int64_t outer, int64_t inner, int64_t ld) {
    return outer > 0 && inner > 0 ? (outer - 1) * ld + inner : 0;
  }

  // Group `group`'s A (M x K) and B (N x K) byte ranges, each split over `parts` CTAs of 32
  // lanes; this lane issues piece part * 32 + lane of both.
  CUTLASS_DEVICE static void PrefetchGroup(Params const& params, int group, int part, int parts) {
    using namespace cute;
    const UnderlyingShape shape = params.problem_shapes[group];
    const int64_t m = get<0>(shape), n = get<1>(shape), k = get<2>(shape);
    if (m <= 0 || n <= 0 || k <= 0) return;
    // A stride <ld, 1, 0> is K-major (rows of M, ld apart); <1, ld, 0> M-major.
    using StrideA = cute::remove_pointer_t<typename Base::StrideA>;
    using StrideB = cute::remove_pointer_t<typename Base::StrideB>;
    constexpr bool kAKMajor = cute::is_static<decltype(get<1>(StrideA{}))>::value;
    constexpr bool kBKMajor = cute::is_static<decltype(get<1>(StrideB{}))>::value;
    const StrideA stride_a = params.dA[group];
    const StrideB stride_b = params.dB[group];
    const int64_t lda = kAKMajor ? get<0>(stride_a) : get<1>(stride_a);
    const int64_t ldb = kBKMajor ? get<0>(stride_b) : get<1>(stride_b);
    const int64_t a_elements = kAKMajor ? Span(m, k, lda) : Span(k, m, lda);
    const int64_t b_elements = kBKMajor ? Span(n, k, ldb) : Span(k, n, ldb);
    const int lane = static_cast<int>(threadIdx.x % 32);
    PrefetchL2Piece(reinterpret_cast<const char*>(params.ptr_A[group]),
                    a_elements * cute::sizeof_bits_v<typename Base::InternalElementA> / 8,
                    part * 32 + lane, parts * 32);
    PrefetchL2Piece(reinterpret_cast<const char*>(params.ptr_B[group]),
                    b_elements * cute::sizeof_bits_v<typename Base::InternalElementB> / 8,
                    part * 32 + lane, parts * 32);
  }

  // Called by the whole producer warp when it moves to group `next_batch` (the kernel's
  // first group included).
  template <class TensorMapStorage, class TensorMaps, class ProblemShape_MNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage& shared_tensormaps,
                                                Params const& params,
                                                TensorMaps const& input_tensormaps,
                                                ProblemShape_MNKL problem_shape_mnkl,
                                                int32_t next_batch) {
    Base::tensormaps_perform_update(shared_tensormaps, params, input_tensormaps,
                                    problem_shape_mnkl, next_batch);
    if (!params.l2_prefetch || next_batch + 1 >= params.num_groups) return;
    using namespace cute;
    const int64_t tiles_m = (get<0>(problem_shape_mnkl) + size<0>(TileShape{}) - 1) / size<0>(TileShape{});
    const int64_t tiles_n = (get<1>(problem_shape_mnkl) + size<1>(TileShape{}) - 1) / size<1>(TileShape{});
    const int64_t tiles = tiles_m * tiles_n;
    const int ctas = static_cast<int>(gridDim.x * gridDim.y * gridDim.z);
    if (tiles <= 0 || tiles > int64_t{kMaxWavesPerGroup} * ctas) return;
    // The CTAs entering this group hold consecutive tiles of it, so their indices modulo
    // min(tiles, ctas) cover every part once (all of them where the group has more tiles
    // than there are CTAs).
    const int parts = static_cast<int>(tiles < ctas ? tiles : ctas);
    const int cta = static_cast<int>(blockIdx.x + blockIdx.y * gridDim.x);
    PrefetchGroup(params, next_batch + 1, cta % parts, parts);
  }
};

}  // namespace jaxfuse::grouped_gemm::detail
