// FC1 of a gated MLP with its scaled activation in the epilogue (the bf16 forward only).
//
// A plain forward writes h = x @ w1[g] ([rows, 2F], gate columns first) and the scaled
// activation kernel then reads all of h back to write a = act(gate, linear) * scale[row]
// ([rows, F]): 1.5 bytes of traffic per byte of h, in a memory-bound kernel of its own
// (0.19-0.22 ms a step at T = 65536, 2F = 4096 on the H200; README.md, "Not built yet").
// Here the GEMM writes both h and a from its accumulators.
//
// What makes the combine register-local: each CTA tile of 2T columns (T = 128 for the
// cooperative 128 x 256 kernel, 64 for the ping-pong 128 x 128 one) holds the gate columns
// [T j, T j + T) and the matching linear columns [F + T j, F + T j + T) instead of 2T
// consecutive columns of h, so column c of the gate and column c of the linear half meet
// in one accumulator tile, and wgmma's m64 layout gives both to the same thread
// (GatedTileMainloop).
//
//   - The mainloop loads B (w1[g], N-major) with 64-column TMA boxes per k-block (the
//     128-byte swizzle caps a box at 64 bf16 columns). GatedTileMainloop only renames
//     their coordinates: box c of tile j starts at column T j + 64 (c % (T / 64)) +
//     F (c / (T / 64)) instead of 2T j + 64 c. Same descriptors, same shared-memory
//     layout, same MMAs.
//   - GatedEpilogueArray (CUTLASS's DefaultEpilogueArray is its model) computes, for each
//     gate column, act(gate, linear) * scale[row], and writes every accumulator to h at its
//     real column and the activation to act. Both values come from the bf16-rounded
//     accumulators, so act is bit-identical to scaled_activation(h, scales) of the same h
//     (the tests hold it to that). A transpose within each quad of lanes gives each lane
//     16-byte vectors of one row, which it stores from registers, or, with
//     JAXFUSE_GROUPED_GEMM_GATED_STORES=tma (not yet the default: the staged stores have not
//     run on a GPU), stages: each warp stages its 16 rows x 16 gate columns of gate,
//     linear and act in a shared-memory buffer of its own (two, alternating) and one lane
//     hands them to the TMA unit as three 2-D bulk stores, so the warps go back to the MMAs
//     while the stores drain (stores straight from registers stalled the cooperative
//     kernel's warps: the session-56 profile had the gated kernel 360 us slower than FC1
//     alone at T = 65536, against ~90 us of extra bytes). A warp whose 16 rows run past
//     its group's end stores from registers (a TMA box cannot stop at a group's last row).
#pragma once

#include <cstdint>

#include <cuda.h>
#include <cuda_bf16.h>

#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/tensor.hpp"
#include "cutlass/cuda_host_adapter.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/dispatch_policy.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "internal.cuh"
#include "jaxfuse/activation.h"

namespace jaxfuse::grouped_gemm::detail {

// The TMA box width of the B loads (the 128-byte swizzle's 64 bf16 columns).
inline constexpr int kGatedBoxColumns = 64;

// One staged store: a warp's 16 rows of an m64 accumulator atom by 16 gate columns (a block
// pair), for h's gate half, its linear half and act; the TMA store box of each.
inline constexpr int kStageRows = 16;
inline constexpr int kStageColumns = 16;
// Both kernels run two consumer warp groups (warps 4-11; warp group 0 is the producer).
inline constexpr int kConsumerWarps = 8;
inline constexpr int kStageBuffers = 2;  // per warp: one filled while the other drains

struct alignas(128) GatedStageBuffer {
  __nv_bfloat16 gate[kStageRows * kStageColumns];
  __nv_bfloat16 linear[kStageRows * kStageColumns];
  __nv_bfloat16 act[kStageRows * kStageColumns];
};
static_assert(sizeof(GatedStageBuffer) % 128 == 0 && kStageColumns * 2 % 16 == 0,
              "TMA store sources 128-byte aligned, boxes of whole 16 bytes");

// The builder's SM90 pointer-array mainloop (bf16, B N-major, CTA tiles of 2 T columns, T =
// 128 or 64) loading tile j's B columns as gate [T j, +T) then linear [F + T j, +T),
// F = N / 2.
template <class Base>
struct GatedTileMainloop : Base {
  using Base::Base;
  using typename Base::Params;
  using TileShape = typename Base::TileShape;
  static constexpr int kHalfTile = cute::size<1>(TileShape{}) / 2;
  static_assert(kHalfTile % kGatedBoxColumns == 0, "a half tile is whole TMA boxes");

  // gB_nkl as the kernel expects it, (BLK_N, BLK_K, n, k, l) of TMA coordinates, with the
  // tile's N mode split as (64 columns of a box, boxes of a half, 2 halves).
  template <class ProblemShape_MNKL>
  CUTLASS_DEVICE auto load_init(ProblemShape_MNKL const& problem_shape_mnkl,
                                Params const& mainloop_params) const {
    using namespace cute;
    auto stock = Base::load_init(problem_shape_mnkl, mainloop_params);
    const int32_t n = get<1>(problem_shape_mnkl);
    const int32_t k = get<2>(problem_shape_mnkl);
    const int32_t half = n / 2;
    Tensor mB_nkl = mainloop_params.tma_load_b.get_tma_tensor(make_shape(n, k, 1));
    constexpr int kBlockK = size<2>(TileShape{});
    auto layout = make_layout(
        make_shape(make_shape(Int<kGatedBoxColumns>{}, Int<kHalfTile / kGatedBoxColumns>{}, _2{}),
                   Int<kBlockK>{}, half / kHalfTile, ceil_div(k, kBlockK), _1{}),
        make_stride(make_stride(E<0>{}, Int<kGatedBoxColumns>{} * E<0>{}, half * E<0>{}),
                    E<1>{}, Int<kHalfTile>{} * E<0>{}, Int<kBlockK>{} * E<1>{}, _0{}));
    Tensor gB_nkl = make_tensor(mB_nkl.data(), layout);
    return make_tuple(get<0>(stock), gB_nkl);
  }
};

// What the gated epilogue writes besides h (host-built, passed by value to the kernel: the
// descriptors are read by the TMA unit from the kernel's parameters).
struct GatedEpilogueParams {
  cute::TmaDescriptor h_store;     // all of h [m, n], box kStageRows x kStageColumns
  cute::TmaDescriptor act_store;   // all of act [m, n / 2], the same box
  ActivationParams activation;     // kSwiglu or kClampedSwiglu
  const void* scales = nullptr;    // [m] float32 or bf16: the row's activation scale
  bool scales_f32 = true;
  bool tma_stores = false;         // staged TMA stores where a warp's rows allow (else all
                                   // from registers; TuningOptions::gated_tma_stores)
  bool stores_encoded = false;     // both descriptors built (only for tma_stores)
  const __nv_bfloat16* h = nullptr;  // h's row 0 (a group's first row is found from its
                                     // ptr_D, so the setup kernel needs no new array)
  __nv_bfloat16* act = nullptr;    // [m, n / 2]
  int64_t columns = 0;             // n = 2F
};

// A 2-D TMA store descriptor of a row-major bf16 [rows, columns] array, box kStageRows x
// kStageColumns, no swizzle (host). False where the driver refuses it.
inline bool EncodeStageStore(cute::TmaDescriptor* descriptor, const void* base, int64_t rows,
                             int64_t columns) {
  if (base == nullptr || rows <= 0 || columns <= 0) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(columns), static_cast<cuuint64_t>(rows)};
  const cuuint64_t row_stride_bytes[1] = {static_cast<cuuint64_t>(columns) * 2};
  const cuuint32_t box[2] = {kStageColumns, kStageRows};
  const cuuint32_t element_strides[2] = {1, 1};
  return CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
             descriptor, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims,
             row_stride_bytes, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
             CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_NONE,
             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Pointer-array epilogue: h (group pointers ptr_D, row-major [rows, n]) and the scaled
// activation, from a tile of T gate and T linear columns (GatedTileMainloop's): the
// cooperative kernel's 128 x 256 or the ping-pong kernel's 128 x 128. Run through
// GatedEpilogueAdapter (below).
class GatedEpilogueArray {
 public:
  using EpilogueSchedule = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementD = cutlass::bfloat16_t;
  using ElementC = void;
  using ElementOutput = ElementD;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using StrideD = cute::Stride<int64_t, cute::_1, cute::_0>*;
  using StrideC = StrideD;
  using InternalStrideD = cute::remove_pointer_t<StrideD>;
  using InternalStrideC = InternalStrideD;
  // GemmUniversalAdapter names one; nothing calls it.
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<ElementD, 1, float, float>;

  // Each consumer warp's staging buffers.
  struct SharedStorage {
    GatedStageBuffer buffers[kConsumerWarps][kStageBuffers];
  };

  struct Arguments {
    ElementD** ptr_D = nullptr;  // [G]: group g's first row of h (the setup kernel's array)
    StrideD dD = nullptr;        // unused: h's leading dimension is `gated.columns`
    GatedEpilogueParams gated;
  };
  using Params = Arguments;

  // From the setup arrays (gemm_common.cuh's MakeArguments calls it): h's group pointers,
  // and the activation's inputs and output (none while only the workspace is sized).
  static void FillArguments(Arguments& args, const GemmArrays& arrays) {
    args.ptr_D = reinterpret_cast<ElementD**>(arrays.ptr_d);
    args.dD = nullptr;
    if (arrays.gated == nullptr) return;
    const GatedEpilogue& gated = *arrays.gated;
    args.gated.activation = gated.activation;
    args.gated.scales = gated.scales;
    args.gated.scales_f32 = gated.scales_f32;
    args.gated.h = static_cast<const __nv_bfloat16*>(arrays.out);
    args.gated.act = static_cast<__nv_bfloat16*>(gated.act_out);
    args.gated.columns = arrays.columns;
    args.gated.tma_stores = ActiveTuningOptions().gated_tma_stores;
    // Two driver calls per launch: only where the staged stores will read the descriptors.
    args.gated.stores_encoded =
        args.gated.tma_stores &&
        EncodeStageStore(&args.gated.h_store, arrays.out, arrays.rows, arrays.columns) &&
        EncodeStageStore(&args.gated.act_store, gated.act_out, arrays.rows, arrays.columns / 2);
  }

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args,
                                                  void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*,
                                              cudaStream_t, cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.gated.columns % 256 == 0 && args.gated.h != nullptr &&
           args.gated.act != nullptr && args.gated.scales != nullptr &&
           (!args.gated.tma_stores || args.gated.stores_encoded);
  }

  // `params` is the kernel's own (grid-constant) parameter: the TMA stores name its
  // descriptors by address, so it is kept by reference, not copied.
  CUTLASS_HOST_DEVICE explicit GatedEpilogueArray(Params const& params) : params_(&params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine,
            class FrgLayout, class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_mnk,
                                 BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx,
                                 char* shared_storage) {
    using namespace cute;
    // wgmma's C fragment per warp group, m64nN atoms (N = the tile's 256 or 128 columns)
    // stacked MMA_M times along M: value i of lane t is row t / 4 + 8 ((i / 2) % 2) + 64 m
    // (plus the warp's 16 and, cooperative, the warp group's 64), m = i / (N / 2), and
    // column 8 ((i / 4) % (N / 8)) + 2 (t % 4) + i % 2. So the 4 lanes of a quad hold the
    // same rows, a warp holds 16 consecutive rows of each atom, and the linear partner of a
    // gate value (the first N / 16 column blocks) is value i + N / 4. A host-side CuTe check
    // of partition_C over every thread confirmed it for both kernels (session 55); the GPU
    // tests compare every column.
    constexpr int kTileN = size<1>(BlockShapeMNK{});
    constexpr int kHalf = kTileN / 2;
    constexpr int kBlocks = kHalf / 8;              // gate column blocks of 8
    constexpr int kPerAtom = kTileN / 2;            // values per m64 atom and thread
    constexpr int kAtoms = size(FrgLayout{}) / kPerAtom;
    static_assert(kHalf % kStageColumns == 0 && kAtoms * kPerAtom == size(FrgLayout{}),
                  "accumulator fragment of m64 atoms with a gate and a linear half");
    // Every call stages an even number of block pairs, so each call starts on buffer 0,
    // whose last store (the previous call's last but one) wait_group.read<1> covers.
    static_assert(kBlocks / 2 % kStageBuffers == 0, "whole rounds of the stage buffers");

    const int32_t rows = get<0>(problem_shape_mnkl);
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord_mnkl;
    const GatedEpilogueParams& gated = params_->gated;
    const int64_t columns = gated.columns;
    const int64_t half = columns / 2;
    const int64_t gate_col0 = static_cast<int64_t>(n_coord) * kHalf;
    // The scheduler pads a group's F / kHalf column tiles to a multiple of the cluster's
    // (gemm_bf16_fwd_gated.cu runs a 1x1 cluster for odd counts; kept as a guard): a tile
    // past the gate half would write other columns.
    if (gate_col0 >= half) return;
    const auto* h_group = reinterpret_cast<const __nv_bfloat16*>(params_->ptr_D[l_coord]);
    // The group's first row of the whole [m, n] h, hence of act and scales.
    const int64_t group_row0 = (h_group - gated.h) / columns;
    const int64_t tile_row0 = static_cast<int64_t>(m_coord) * size<0>(BlockShapeMNK{});

    Tensor tile_coords = make_identity_tensor(take<0, 2>(blk_shape_mnk));  // (BLK_M, BLK_N)
    Tensor thread_coords = tiled_mma.get_thread_slice(thread_idx).partition_C(tile_coords);
    const int lane = threadIdx.x % 32;
    const int quad_lane = lane & 3;
    // Warps 4-11 (the consumers) get buffers 4-7, 0-3.
    GatedStageBuffer* buffers = reinterpret_cast<SharedStorage*>(shared_storage)
                                    ->buffers[threadIdx.x / 32 % kConsumerWarps];
    int staged = 0;  // block pairs this warp has staged in this call
    CUTLASS_PRAGMA_UNROLL
    for (int atom = 0; atom < kAtoms; ++atom) {
      const int base = atom * kPerAtom;
      // This thread's two rows in the atom (values base and base + 2).
      float scale[2];
      int64_t row[2];
      bool valid[2];
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int64_t tile_row = tile_row0 + get<0>(thread_coords(base + 2 * r));
        valid[r] = tile_row < rows;
        row[r] = group_row0 + (valid[r] ? tile_row : 0);
        scale[r] = gated.scales_f32
                       ? static_cast<const float*>(gated.scales)[row[r]]
                       : __bfloat162float(static_cast<const __nv_bfloat16*>(gated.scales)[row[r]]);
      }
      // After the quad transpose (ActivationVectors), lane q of a quad holds row q / 2 of
      // the quad's two (lane / 4 and lane / 4 + 8 of the warp's 16), block b + q % 2.
      const int my_row = quad_lane >> 1;
      const int64_t warp_row0 = tile_row0 + get<0>(thread_coords(base)) - (lane >> 2);
      if (gated.tma_stores && warp_row0 + kStageRows <= rows) {
        // All 16 rows of the warp are the group's: staged TMA stores.
        const int stage_row = (lane >> 2) + 8 * my_row;
        const int stage_col = 8 * (quad_lane & 1);
        const int32_t box_row = static_cast<int32_t>(group_row0 + warp_row0);
        CUTLASS_PRAGMA_UNROLL
        for (int block = 0; block < kBlocks; block += 2, ++staged) {
          uint32_t gate[4], linear[4], act[4];
          ActivationVectors<kTileN>(accumulators, base, block, scale, quad_lane, gate, linear,
                                    act);
          GatedStageBuffer& buffer = buffers[staged % kStageBuffers];
          // The buffer's previous store has read it (the lane that issued it waits).
          if (lane == 0) cute::tma_store_wait<kStageBuffers - 1>();
          __syncwarp();
          const int offset = stage_row * kStageColumns + stage_col;
          *reinterpret_cast<uint4*>(buffer.gate + offset) =
              make_uint4(gate[0], gate[1], gate[2], gate[3]);
          *reinterpret_cast<uint4*>(buffer.linear + offset) =
              make_uint4(linear[0], linear[1], linear[2], linear[3]);
          *reinterpret_cast<uint4*>(buffer.act + offset) =
              make_uint4(act[0], act[1], act[2], act[3]);
          cute::tma_store_fence();  // the writes, visible to the TMA unit
          __syncwarp();
          if (lane == 0) {
            const int32_t box_col = static_cast<int32_t>(gate_col0 + 8 * block);
            cute::SM90_TMA_STORE_2D::copy(&gated.h_store, buffer.gate, box_col, box_row);
            cute::SM90_TMA_STORE_2D::copy(&gated.h_store, buffer.linear,
                                          box_col + static_cast<int32_t>(half), box_row);
            cute::SM90_TMA_STORE_2D::copy(&gated.act_store, buffer.act, box_col, box_row);
            cute::tma_store_arrive();
          }
        }
      } else {
        // Register stores (the group ends within the warp's rows, or the staged stores are
        // off): 16-byte stores, rows past the group's end skipped.
        const bool my_valid = valid[my_row];
        __nv_bfloat16* h_out =
            const_cast<__nv_bfloat16*>(gated.h) + row[my_row] * columns + gate_col0;
        __nv_bfloat16* act_out = gated.act + row[my_row] * half + gate_col0;
        CUTLASS_PRAGMA_UNROLL
        for (int block = 0; block < kBlocks; block += 2) {
          uint32_t gate[4], linear[4], act[4];
          ActivationVectors<kTileN>(accumulators, base, block, scale, quad_lane, gate, linear,
                                    act);
          if (my_valid) {
            const int64_t col = 8 * (block + (quad_lane & 1));
            *reinterpret_cast<uint4*>(h_out + col) =
                make_uint4(gate[0], gate[1], gate[2], gate[3]);
            *reinterpret_cast<uint4*>(h_out + half + col) =
                make_uint4(linear[0], linear[1], linear[2], linear[3]);
            *reinterpret_cast<uint4*>(act_out + col) = make_uint4(act[0], act[1], act[2], act[3]);
          }
        }
      }
    }
  }

  // Before the kernel's shared memory goes: every staged store has read its buffer (the
  // issuing lane of each warp waits; GatedEpilogueAdapter::store_tail).
  CUTLASS_DEVICE static void DrainStagedStores() {
    if (threadIdx.x % 32 == 0) cute::tma_store_wait<0>();
    __syncwarp();
  }

 private:
  // Gate column blocks (block, block + 1) of one m64 atom (values from `base`) as this lane's
  // three 16-byte vectors after the quad transpose: h's gate and linear columns (bf16) and
  // act(gate, linear) * scale, row quad_lane / 2 of the quad's two, block + quad_lane % 2.
  // A quad (4 lanes) holds 8 consecutive columns of a row per column block, 2 per lane. Per
  // pair of blocks, a 4 x 4 transpose across the quad (slot s = 2 r + db) gives each lane the
  // 8 columns of one row and block: whole 32-byte sectors instead of 4-byte pieces.
  template <int kTileN, class Accumulators>
  CUTLASS_DEVICE void ActivationVectors(Accumulators const& accumulators, int base, int block,
                                        const float (&scale)[2], int quad_lane,
                                        uint32_t (&gate)[4], uint32_t (&linear)[4],
                                        uint32_t (&act)[4]) const {
    constexpr int kPartner = kTileN / 4;
    const ActivationParams& activation = params_->gated.activation;
    const bool clamped = activation.kind == Activation::kClampedSwiglu;
    CUTLASS_PRAGMA_UNROLL
    for (int slot = 0; slot < 4; ++slot) {
      const int r = slot >> 1;
      const int i = base + 4 * (block + (slot & 1)) + 2 * r;  // values i, i + 1
      const __nv_bfloat162 g2 = __floats2bfloat162_rn(accumulators(i), accumulators(i + 1));
      const __nv_bfloat162 l2 = __floats2bfloat162_rn(accumulators(i + kPartner),
                                                      accumulators(i + kPartner + 1));
      const float2 g = __bfloat1622float2(g2);
      const float2 l = __bfloat1622float2(l2);
      const float2 a =
          clamped ? make_float2(ClampedSwigluForward(activation, g.x, l.x) * scale[r],
                                ClampedSwigluForward(activation, g.y, l.y) * scale[r])
                  : make_float2(SwigluForward(g.x, l.x) * scale[r],
                                SwigluForward(g.y, l.y) * scale[r]);
      const __nv_bfloat162 a2 = __float22bfloat162_rn(a);
      gate[slot] = reinterpret_cast<const uint32_t&>(g2);
      linear[slot] = reinterpret_cast<const uint32_t&>(l2);
      act[slot] = reinterpret_cast<const uint32_t&>(a2);
    }
    QuadTranspose(gate, quad_lane);
    QuadTranspose(linear, quad_lane);
    QuadTranspose(act, quad_lane);
  }

  // values[s] of quad lane j becomes lane s's values[j] (a 4 x 4 transpose in two
  // butterfly steps: slots and lanes differing in bit 0, then in bit 1).
  CUTLASS_DEVICE static void QuadTranspose(uint32_t (&values)[4], int quad_lane) {
    CUTLASS_PRAGMA_UNROLL
    for (int bit = 1; bit <= 2; bit <<= 1) {
      const bool upper = (quad_lane & bit) != 0;
      CUTLASS_PRAGMA_UNROLL
      for (int low = 0; low < 4; ++low) {
        if (low & bit) continue;
        const int high = low | bit;
        const uint32_t sent = upper ? values[low] : values[high];
        const uint32_t received = __shfl_xor_sync(0xffffffffu, sent, bit);
        if (upper) {
          values[low] = received;
        } else {
          values[high] = received;
        }
      }
    }
  }

  Params const* params_;
};

// CUTLASS's adapter of a register epilogue to the SM90 warp-specialized kernels, with two
// changes: no per-group TMA descriptors in shared memory (the base would reserve the
// epilogue's SharedStorage again for them: its staging buffers twice; h and act each have
// one descriptor for all rows), and store_tail drains the staged stores before the kernel's
// shared memory is released (the ping-pong kernel calls it after every tile, the
// cooperative one once at the end).
template <class EpilogueOp>
class GatedEpilogueAdapter
    : public cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<EpilogueOp> {
  using Base = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<EpilogueOp>;

 public:
  using Base::Base;
  using typename Base::LoadPipeline;
  using typename Base::LoadPipelineState;
  using typename Base::StorePipeline;
  using typename Base::StorePipelineState;
  using Params = typename EpilogueOp::Params;
  struct TensorMapStorage {};

  CUTLASS_DEVICE auto load_init(Params const&, TensorMapStorage&, int32_t, int32_t) {
    return cute::make_tuple(nullptr);
  }
  CUTLASS_DEVICE auto store_init(Params const&, TensorMapStorage&, int32_t, int32_t, int32_t) {
    return cute::make_tuple(nullptr);
  }
  template <bool IsLoad, class ProblemShapeMNKL>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage&, Params const&,
                                                cute::TmaDescriptor const*, ProblemShapeMNKL,
                                                int32_t, int32_t) {}
  template <bool IsLoad>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(TensorMapStorage&, cute::TmaDescriptor const*,
                                                  int32_t) {}
  CUTLASS_DEVICE auto store_tail(LoadPipeline, LoadPipelineState load_state, StorePipeline,
                                 StorePipelineState store_state) {
    EpilogueOp::DrainStagedStores();
    return cute::make_tuple(load_state, store_state);
  }
};

}  // namespace jaxfuse::grouped_gemm::detail
