// What the gather-GEMM kernels (knn_gemm.cu, knn_gemm_channels_last.cu) share: their
// occupancy target, wmma fragment loads from shared memory, the warp tile of accumulators,
// biased stores and the layout of their shared memory.
#pragma once

#include "knn_common.cuh"
#include "knn_entry_walk.cuh"
#include "knn_mma.cuh"

namespace knnconv {

// Kernels ask for kResidentThreads per SM in their launch bounds (at most 128 registers a
// thread): a stated occupancy target; without one, ptxas chose 40-80 registers for some tiles
// and spilled.
constexpr int kResidentThreads = 512;

using namespace nvcuda;

// wmma::load_matrix_sync's bfloat16 overloads emit wmma.load with a generic address (the
// __half ones get .shared inferred), which ptxas cannot lower to ldmatrix: bf16 ran 1.22x (a
// training step replayed as a CUDA graph) to 1.31x (forward) slower than fp16 on the same tiles. Every
// fragment here is staged in shared memory, so the bf16 loads spell the state space out.
template <typename Fragment, typename T>
__device__ __forceinline__ void load_shared_fragment(Fragment& fragment, const T* shared,
                                                     unsigned ldm) {
  wmma::load_matrix_sync(fragment, shared, ldm);
}

#define KNNCONV_BF16_SHARED_LOAD(USE, LAYOUT)                                                 \
  __device__ __forceinline__ void load_shared_fragment(                                      \
      wmma::fragment<wmma::matrix_##USE, kFrag, kFrag, kFrag, __nv_bfloat16,                   \
                     wmma::LAYOUT##_major>& fragment,                                         \
      const __nv_bfloat16* shared, unsigned ldm) {                                            \
    static_assert(sizeof(fragment.x) == 4 * sizeof(unsigned), "4 registers of 2 x bf16");      \
    unsigned* bits = reinterpret_cast<unsigned*>(&fragment.x[0]);                             \
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared));        \
    asm volatile("wmma.load." #USE ".sync.aligned." #LAYOUT                                 \
                 ".m16n16k16.shared.bf16 {%0, %1, %2, %3}, [%4], %5;"                        \
                 : "=r"(bits[0]), "=r"(bits[1]), "=r"(bits[2]), "=r"(bits[3])                 \
                 : "r"(address), "r"(ldm)                                                     \
                 : "memory");                                                                 \
  }
KNNCONV_BF16_SHARED_LOAD(a, row)
KNNCONV_BF16_SHARED_LOAD(a, col)
KNNCONV_BF16_SHARED_LOAD(b, row)
KNNCONV_BF16_SHARED_LOAD(b, col)
#undef KNNCONV_BF16_SHARED_LOAD

template <typename T, int kRowsM, int kColsN, int kWarpsM, int kWarpsN>
struct WarpTile {
  static constexpr int kFragsM = kRowsM / kWarpsM / kFrag;
  static constexpr int kFragsN = kColsN / kWarpsN / kFrag;
  static_assert(kFragsM * kWarpsM * kFrag == kRowsM, "M tile must split into 16-row warp fragments");
  static_assert(kFragsN * kWarpsN * kFrag == kColsN, "N tile must split into 16-col warp fragments");
  wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float> acc[kFragsM][kFragsN];

  __device__ void zero() {
#pragma unroll
    for (int i = 0; i < kFragsM; ++i)
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) wmma::fill_fragment(acc[i][j], 0.0f);
  }

  // One 16-deep step: a_at(i) / b_at(j) point at the fragments of this warp's row i / column j.
  template <typename LayoutA, typename LayoutB, typename AAt, typename BAt>
  __device__ void multiply(AAt a_at, BAt b_at, int lda, int ldb) {
    wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, T, LayoutA> a[kFragsM];
    wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, T, LayoutB> b[kFragsN];
#pragma unroll
    for (int i = 0; i < kFragsM; ++i) load_shared_fragment(a[i], a_at(i), lda);
#pragma unroll
    for (int j = 0; j < kFragsN; ++j) load_shared_fragment(b[j], b_at(j), ldb);
#pragma unroll
    for (int i = 0; i < kFragsM; ++i)
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
  }

  // Hands every accumulator element to emit(row, col, value), row/col relative to the warp's
  // first fragment, through a 16x16 per-warp scratch. kRowFastest picks which index runs
  // across consecutive lanes, so the caller's global accesses are the coalesced ones.
  template <bool kRowFastest, typename Emit>
  __device__ void drain(float* scratch, Emit emit) {
    const int lane = threadIdx.x % kWarp;
#pragma unroll
    for (int i = 0; i < kFragsM; ++i)
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) {
        wmma::store_matrix_sync(scratch, acc[i][j], kFrag,
                                kRowFastest ? wmma::mem_col_major : wmma::mem_row_major);
        __syncwarp();
#pragma unroll
        for (int e = lane; e < kFrag * kFrag; e += kWarp) {
          const int slow = e / kFrag, fast = e % kFrag;
          emit(i * kFrag + (kRowFastest ? fast : slow), j * kFrag + (kRowFastest ? slow : fast),
               scratch[e]);
        }
        __syncwarp();
      }
  }

  // Hands each accumulator row to emit(row, col, values) in chunks of kChunk consecutive
  // columns (one chunk per lane per fragment), so the caller can store 16 bytes at once.
  template <typename Emit>
  __device__ void drain_row_chunks(float* scratch, Emit emit) {
    static_assert(kFrag * kFrag == kWarp * kChunk, "one chunk per lane per fragment");
    const int lane = threadIdx.x % kWarp;
    const int row = lane / (kFrag / kChunk), col = (lane % (kFrag / kChunk)) * kChunk;
#pragma unroll
    for (int i = 0; i < kFragsM; ++i)
#pragma unroll
      for (int j = 0; j < kFragsN; ++j) {
        wmma::store_matrix_sync(scratch, acc[i][j], kFrag, wmma::mem_row_major);
        __syncwarp();
        emit(i * kFrag + row, j * kFrag + col, scratch + row * kFrag + col);
        __syncwarp();
      }
  }
};

// to[e] = values[e] + bias[j + e] for the e < kChunk with j + e < extent (one 16-byte store
// where the whole chunk is in range and aligned: extent a multiple of kChunk). The bias comes
// in the compute dtype T or, sparing the caller a conversion, in float32; none when null.
template <typename T, typename TOut>
__device__ __forceinline__ void store_biased_chunk(TOut* to, const float* values, const void* bias,
                                                   int bias_is_float32, int j, int extent) {
  auto bias_at = [&](int at) -> float {
    if (bias == nullptr) return 0.0f;
    return bias_is_float32 ? static_cast<const float*>(bias)[at]
                           : to_float(static_cast<const T*>(bias)[at]);
  };
  if (extent % kChunk == 0) {
    float biased[kChunk];
#pragma unroll
    for (int e = 0; e < kChunk; ++e) biased[e] = values[e] + bias_at(j + e);
    store_chunk(to, biased);
  } else {
    for (int e = 0; e < kChunk && j + e < extent; ++e) {
      to[e] = from_float<TOut>(values[e] + bias_at(j + e));
    }
  }
}

extern __shared__ __align__(128) unsigned char shared_raw[];

// The opening every staged gather-GEMM kernel shares: where this thread's warp sits in the
// CTA's kWarpsM x kWarpsN grid of warps, and the CTA's shared memory: kStages buffers of an A
// and a B tile, then what the kernel keeps behind them (one scratch per warp for the wmma
// kernels, tables and bias columns for those storing from registers).
template <typename T, int kStages, int kAElems, int kBElems, int kWarpsN>
struct GemmCta {
  int warp_m;
  int warp_n;
  T* a;
  T* b;
  unsigned char* behind;
  float* scratch;
  __device__ GemmCta() {
    const int warp = threadIdx.x / kWarp;
    warp_m = warp / kWarpsN;
    warp_n = warp % kWarpsN;
    a = reinterpret_cast<T*>(shared_raw);
    b = a + kStages * kAElems;
    behind = reinterpret_cast<unsigned char*>(b + kStages * kBElems);
    scratch = reinterpret_cast<float*>(behind) + warp * kFrag * kFrag;
  }
};

}  // namespace knnconv
