// Re-layout kernels: batched 2-D transposes that convert the type and pad with zeros
// (transpose_pad, which can also sum each source slice: the bias gradient out of grad_y's
// re-layout), and the variant for sources contiguous along c (transpose_pairs).
#include "knn_common.cuh"

namespace knnconv {

// *sum += the sum of `value` over the CTA (kTransposeThreads threads, all of which call it),
// one fp32 atomic per CTA.
__device__ __forceinline__ void add_block_sum(float* sum, float value) {
  __shared__ float warp_sums[kTransposeThreads / kWarp];
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  if (threadIdx.x % kWarp == 0) warp_sums[threadIdx.x / kWarp] = value;
  __syncthreads();
  if (threadIdx.x == 0) {
    float block_sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kTransposeThreads / kWarp; ++w) block_sum += warp_sums[w];
    atomicAdd(sum, block_sum);
  }
}

// dst[z*dst_stride_z + c*dst_stride_c + a] = src[z*src_stride_z + a*src_stride_a + c*src_stride_c]:
// a batch of 2-D transposes through a shared tile of kTransposeElements, converting the type
// and writing zeros wherever (z, a, c) lies past the source extents. The tile spans
// 2^log_tile_c source columns by kTransposeElements / 2^log_tile_c rows: the host narrows it
// to a small extent (a few nodes, cells or batch rows) so no thread idles on a 32x32 tile that
// is mostly outside the tensor, and reads along c and writes along a stay coalesced.
// Grid: (c tiles, CTAs along a, z); a CTA strides over the a tiles. With z_sums, also
// z_sums[z] += the sum of source slice z, one fp32 atomic per CTA: the bias gradient comes out
// of grad_y's re-layout without another pass over it, and the host keeps the CTAs along a
// few, since same-address atomics serialise (8 per tile cost conv1's step 1.4 ms).
// Eight CTAs per SM (a full SM of threads, ~29 registers): a memory-bound copy needs every
// load in flight it can get; left free, ptxas took 48 registers and five CTAs per SM, and the
// large re-layouts ran ~30% slower.
template <typename TIn, typename TOut>
__global__ void __launch_bounds__(kTransposeThreads, 8)
    transpose_pad(const TIn* __restrict__ src, TOut* __restrict__ dst, int src_z, int src_a,
                  int src_c, long long src_stride_z, long long src_stride_a, long long src_stride_c,
                  int dst_a, int dst_c, long long dst_stride_z, long long dst_stride_c,
                  float* __restrict__ z_sums, int log_tile_c) {
  // One padding float per tile row: column reads of the store phase avoid bank conflicts.
  __shared__ float tile[2 * kTransposeElements];
  const int tile_c = 1 << log_tile_c, pitch = tile_c + 1;
  const int log_tile_a = kLogTransposeElements - log_tile_c;
  const int c0 = blockIdx.x << log_tile_c;
  const int z = blockIdx.z;
  const TIn* src_z_base = src + z * src_stride_z;
  TOut* dst_z_base = dst + z * dst_stride_z;
  float slice_sum = 0.0f;
  // A 64-bit row index: with an int one, ptxas spilled a register of the unrolled loops.
  const long long a_step = static_cast<long long>(gridDim.y) << log_tile_a;
  for (long long a0 = static_cast<long long>(blockIdx.y) << log_tile_a; a0 < dst_a;
       a0 += a_step) {
    // Every load of the tile is issued before the first shared store: loaded and stored one
    // at a time, a thread kept one load in flight, the re-layouts ran latency bound at ~1 TB/s
    // (Nsight Compute: 16% of DRAM throughput at 91% occupancy), and the odd-stride x re-layout
    // that still takes this kernel stayed there (0.97 TB/s).
    float values[kTransposeElements / kTransposeThreads];
#pragma unroll
    for (int k = 0; k < kTransposeElements / kTransposeThreads; ++k) {
      const int e = threadIdx.x + k * kTransposeThreads;
      const int i = e >> log_tile_c, j = e & (tile_c - 1);
      const long long a = a0 + i;
      const int c = c0 + j;
      values[k] = 0.0f;
      if (z < src_z && a < src_a && c < src_c) {
        values[k] = to_float(src_z_base[a * src_stride_a + c * src_stride_c]);
      }
    }
#pragma unroll
    for (int k = 0; k < kTransposeElements / kTransposeThreads; ++k) {
      const int e = threadIdx.x + k * kTransposeThreads;
      tile[(e >> log_tile_c) * pitch + (e & (tile_c - 1))] = values[k];
      slice_sum += values[k];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < kTransposeElements; e += kTransposeThreads) {
      const int j = e >> log_tile_a, i = e & ((1 << log_tile_a) - 1);
      const int c = c0 + j;
      const long long a = a0 + i;
      if (c < dst_c && a < dst_a) {
        dst_z_base[c * dst_stride_c + a] = from_float<TOut>(tile[i * pitch + j]);
      }
    }
    __syncthreads();
  }
  if (z_sums != nullptr && z < src_z) add_block_sum(z_sums + z, slice_sum);
}

// dst[z, c, a] = src[z, a, c] like transpose_pad, for 32 x 32-or-wider problems whose rows
// allow two-element accesses (the host checks: src contiguous along c, dst along a, even
// strides, pointers aligned to two elements): each thread loads pairs of c (one 32- or 64-bit
// load each) and writes pairs of a (one store each) through a kPairsTile x kPairsTile tile.
// transpose_pad moved conv1's grad_y at ~1 TB/s (see its loads); this kernel moves it at 2.87
// TB/s on an H200. Grid and z_sums as transpose_pad. Eight loads in flight per thread: with
// 2-byte sources they fit the 48 registers of five CTAs per SM without spilling on sm_80 and
// sm_90 (NVRTC 13.0 and nvcc); 4-byte sources hold twice the bits, and nvcc 13.0 spills at 48
// on sm_120, so those and sm_100+ get four CTAs.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
constexpr int kPairsMinBlocksNarrow = 4;
#else
constexpr int kPairsMinBlocksNarrow = 5;
#endif
template <typename TIn, typename TOut>
__global__ void __launch_bounds__(kTransposeThreads, sizeof(TIn) == 2 ? kPairsMinBlocksNarrow : 4)
    transpose_pairs(const TIn* __restrict__ src, TOut* __restrict__ dst, int src_z, int src_a,
                    int src_c, long long src_stride_z, long long src_stride_a, int dst_a,
                    int dst_c, long long dst_stride_z, long long dst_stride_c,
                    float* __restrict__ z_sums) {
  constexpr int kTile = kPairsTile, kPitch = kTile + 1, kRowsPerPass = kTransposeThreads / kWarp;
  __shared__ float tile[kTile * kPitch];
  const int lane = threadIdx.x % kWarp, row = threadIdx.x / kWarp;
  const int c0 = blockIdx.x * kTile;
  const int z = blockIdx.z;
  const TIn* src_z_base = src + z * src_stride_z;
  TOut* dst_z_base = dst + z * dst_stride_z;
  float slice_sum = 0.0f;
  const long long a_step = static_cast<long long>(gridDim.y) * kTile;
  for (long long a0 = static_cast<long long>(blockIdx.y) * kTile; a0 < dst_a; a0 += a_step) {
    // All pair loads first, then the rare odd last column, then the shared stores (see
    // transpose_pad): one load in flight per thread kept this kernel latency bound.
    PairWord<TIn> loaded[kTile / kRowsPerPass];
    const int c = c0 + 2 * lane;
#pragma unroll
    for (int k = 0; k < kTile / kRowsPerPass; ++k) {
      const long long a = a0 + row + k * kRowsPerPass;
      loaded[k] = 0;  // all-zero bits are +0 in every element type
      if (z < src_z && a < src_a && c + 1 < src_c) {
        loaded[k] = *reinterpret_cast<const PairWord<TIn>*>(src_z_base + a * src_stride_a + c);
      }
    }
    if (c + 1 == src_c) {
#pragma unroll
      for (int k = 0; k < kTile / kRowsPerPass; ++k) {
        const long long a = a0 + row + k * kRowsPerPass;
        if (z < src_z && a < src_a) {
          loaded[k] = make_pair_word(src_z_base[a * src_stride_a + c], from_float<TIn>(0.0f));
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kTile / kRowsPerPass; ++k) {
      const int i = row + k * kRowsPerPass, j = 2 * lane;
      const float first = to_float(pair_element<TIn>(loaded[k], 0));
      const float second = to_float(pair_element<TIn>(loaded[k], 1));
      tile[i * kPitch + j] = first;
      tile[i * kPitch + j + 1] = second;
      slice_sum += first + second;
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kTile / kRowsPerPass; ++k) {
      const int j = row + k * kRowsPerPass, i = 2 * lane;
      const int c = c0 + j;
      const long long a = a0 + i;
      if (c < dst_c && a < dst_a) {
        TOut* at = dst_z_base + c * dst_stride_c + a;
        const TOut first = from_float<TOut>(tile[i * kPitch + j]);
        if (a + 1 < dst_a) {
          *reinterpret_cast<PairWord<TOut>*>(at) =
              make_pair_word(first, from_float<TOut>(tile[(i + 1) * kPitch + j]));
        } else {
          *at = first;
        }
      }
    }
    __syncthreads();
  }
  if (z_sums != nullptr && z < src_z) add_block_sum(z_sums + z, slice_sum);
}

}  // namespace knnconv
