// Building blocks shared by the KNN-convolution kernels: 16-byte staging of gathered rows
// into shared memory (cp.async or synchronous), and dtype conversion.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

namespace knnconv {

// Every staged row is a run of 16-byte chunks: 8 elements of a 2-byte type.
constexpr int kChunk = 8;
// Row padding of every shared-memory tile, in elements: one chunk, which staggers rows
// across banks and keeps every 16-row fragment offset 32-byte aligned for wmma.
constexpr int kPad = 8;
constexpr int kWarp = 32;
constexpr int kFrag = 16;
// transpose_pad: a tile of 2^10 elements, moved by 256 threads.
constexpr int kLogTransposeElements = 10;
constexpr int kTransposeElements = 1 << kLogTransposeElements;
constexpr int kTransposeThreads = 256;
// transpose_pairs: square tiles of this many elements a side.
constexpr int kPairsTile = 64;

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(gmem));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// cp.async of 16 bytes that writes zeros instead where !valid (gmem is then not read, but
// must still be a mapped address).
__device__ __forceinline__ void cp_async_16_or_zero(void* smem, const void* gmem, bool valid) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(gmem),
               "r"(valid ? 16 : 0));
}

template <bool kAsync>
__device__ __forceinline__ void copy_chunk(void* smem, const void* gmem) {
  if constexpr (kAsync) {
    cp_async_16(smem, gmem);
  } else {
    *reinterpret_cast<uint4*>(smem) = __ldg(reinterpret_cast<const uint4*>(gmem));
  }
}

// Calls chunk(row, col) for this thread's share of the 16-byte chunks of a kRows x kWidth
// tile (col in elements), the threads of the CTA taking consecutive chunks.
template <int kRows, int kWidth, int kThreads, typename Chunk>
__device__ __forceinline__ void for_each_chunk(Chunk chunk) {
  static_assert(kWidth % kChunk == 0, "staged rows must be whole 16-byte chunks");
  constexpr int kChunksPerRow = kWidth / kChunk;
  constexpr int kChunks = kRows * kChunksPerRow;
#pragma unroll
  for (int i = 0; i < (kChunks + kThreads - 1) / kThreads; ++i) {
    const int index = i * kThreads + static_cast<int>(threadIdx.x);
    if (kChunks % kThreads == 0 || index < kChunks) {
      chunk(index / kChunksPerRow, (index % kChunksPerRow) * kChunk);
    }
  }
}

// Copies kRows rows of kWidth elements into shared memory rows of pitch kPitch.
// row_start(r) gives the global element offset of the first element of row r.
template <typename T, int kRows, int kWidth, int kPitch, int kThreads, bool kAsync, typename RowStart>
__device__ __forceinline__ void stage_rows(T* smem, const T* __restrict__ base, RowStart row_start) {
  for_each_chunk<kRows, kWidth, kThreads>([&](int row, int col) {
    copy_chunk<kAsync>(smem + row * kPitch + col, base + row_start(row) + col);
  });
}

// Like stage_rows, for operands whose chunks may lie outside them: chunk_start(r, col)
// gives the global element offset of row r's elements col.. col+kChunk-1, or -1 for a chunk
// to fill with zeros.
template <typename T, int kRows, int kWidth, int kPitch, int kThreads, bool kAsync,
          typename ChunkStart>
__device__ __forceinline__ void stage_chunks_or_zero(T* smem, const T* __restrict__ base,
                                                     ChunkStart chunk_start) {
  for_each_chunk<kRows, kWidth, kThreads>([&](int row, int col) {
    const long long start = chunk_start(row, col);
    T* to = smem + row * kPitch + col;
    if constexpr (kAsync) {
      cp_async_16_or_zero(to, base + (start < 0 ? 0 : start), start >= 0);
    } else if (start >= 0) {
      *reinterpret_cast<uint4*>(to) = __ldg(reinterpret_cast<const uint4*>(base + start));
    } else {
      *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
    }
  });
}

template <typename T>
__device__ __forceinline__ T from_float(float value);

template <>
__device__ __forceinline__ __half from_float<__half>(float value) {
  return __float2half_rn(value);
}

template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) {
  return __float2bfloat16_rn(value);
}

template <>
__device__ __forceinline__ float from_float<float>(float value) {
  return value;
}

template <typename T>
__device__ __forceinline__ float to_float(T value) {
  return static_cast<float>(value);
}

// Stores kChunk consecutive values with 16-byte vector stores.
template <typename TOut>
__device__ __forceinline__ void store_chunk(TOut* out, const float* values) {
  constexpr int kPerVector = 16 / sizeof(TOut);
#pragma unroll
  for (int v = 0; v < kChunk; v += kPerVector) {
    uint4 packed;
    TOut* scalars = reinterpret_cast<TOut*>(&packed);
#pragma unroll
    for (int e = 0; e < kPerVector; ++e) scalars[e] = from_float<TOut>(values[v + e]);
    *reinterpret_cast<uint4*>(out + v) = packed;
  }
}

// Two consecutive elements as one machine word, so that they move in one aligned load or
// store and occupy one register until split: a two-member struct was split into 16-bit
// registers on load (NVRTC 13.0 then spilled one to the stack) and stored as two 16-bit stores.
template <int kBytes>
struct WordOfSize;
template <>
struct WordOfSize<4> {
  using type = unsigned int;
};
template <>
struct WordOfSize<8> {
  using type = unsigned long long;
};
template <typename T>
using PairWord = typename WordOfSize<2 * sizeof(T)>::type;

template <typename T>
__device__ __forceinline__ PairWord<T> make_pair_word(T first, T second) {
  PairWord<T> low = 0, high = 0;
  memcpy(&low, &first, sizeof(T));  // the GPU is little-endian: first is the low half
  memcpy(&high, &second, sizeof(T));
  return low | (high << (8 * sizeof(T)));
}

template <typename T>
__device__ __forceinline__ T pair_element(PairWord<T> word, int which) {
  const PairWord<T> bits = word >> (which * 8 * sizeof(T));
  T value;
  memcpy(&value, &bits, sizeof(T));
  return value;
}

// The software pipeline every kernel runs over its contraction tiles [first, last):
// kStages shared-memory buffers, tile t+kStages-1 in flight while tile t is multiplied.
// load(t, stage) and compute(stage) are called for t = first, first + 1, ... in order.
template <int kStages, typename Load, typename Compute>
__device__ __forceinline__ void pipeline(int first, int last, Load load, Compute compute) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (first + s < last) load(first + s, s);
    cp_async_commit();
  }
  for (int tile = first; tile < last; ++tile) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // tile is visible to all, and every warp is done with the slot reloaded next
    const int ahead = tile + kStages - 1;
    if (ahead < last) load(ahead, (ahead - first) % kStages);
    cp_async_commit();
    compute((tile - first) % kStages);
  }
}

}  // namespace knnconv
