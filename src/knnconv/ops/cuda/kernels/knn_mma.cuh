// Warp-level tensor-core products on explicit fragments: ldmatrix from shared memory and
// mma.sync.m16n8k16 with fp32 accumulators, whose register layout (unlike wmma's) is known, so
// an epilogue stores results straight from registers.
#pragma once

#include "knn_common.cuh"

namespace knnconv {

// Four 8x8 matrices of 16-bit elements, transposed: lane i gives the address of row i % 8 of
// matrix i / 8 (16 contiguous bytes); register j receives, for matrix j, the elements of
// rows 2*(lane%4) and 2*(lane%4)+1 in column lane/4.
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* shared_row) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// d += a * b on one m16n8k16 tile, fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4],
                                          const unsigned (&b)[2]);

#define KNN_MMA_16816(TYPE, PTX_TYPE)                                                         \
  template <>                                                                                 \
  __device__ __forceinline__ void mma_16816<TYPE>(float (&d)[4], const unsigned (&a)[4],      \
                                                  const unsigned (&b)[2]) {                   \
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 "       \
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"          \
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                             \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));         \
  }
KNN_MMA_16816(__half, "f16")
KNN_MMA_16816(__nv_bfloat16, "bf16")
#undef KNN_MMA_16816

// Four 8x8 matrices of 16-bit elements: lane i gives the address of row i % 8 of matrix i / 8;
// register j receives, for matrix j, the elements of row lane/4, columns 2*(lane%4) and the
// next.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* shared_row) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(shared_row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// The fp32 bias of a CTA's kColumns output columns first.. in shared memory, zero past
// `extent` or without a bias (bias in fp32, or in T when !bias_is_float32). Read after the
// CTA's next __syncthreads.
template <typename T, int kColumns, int kThreads>
__device__ __forceinline__ void stage_bias(float* to, const void* bias, int bias_is_float32,
                                           int first, int extent) {
  for (int j = threadIdx.x; j < kColumns; j += kThreads) {
    const int o = first + j;
    to[j] = bias == nullptr || o >= extent ? 0.0f
            : bias_is_float32 ? static_cast<const float*>(bias)[o]
                              : to_float(static_cast<const T*>(bias)[o]);
  }
}

// One warp's kRows x kCols block of C = A * B from operands staged in shared memory: B as
// [k][n] (rows of n contiguous), A as [k][m] (kAKMajor) or [m][k]; m16n8 fp32 accumulator
// tiles. Lane l holds, of tile (i, j), rows i*16 + l/4 (values 0, 1) and i*16 + l/4 + 8
// (values 2, 3), columns j*8 + 2*(l%4) and the next.
template <typename T, int kRows, int kCols, bool kAKMajor>
struct MmaTile {
  static constexpr int kTilesM = kRows / 16;
  static constexpr int kTilesN = kCols / 8;
  static_assert(kTilesM * 16 == kRows && kCols % 16 == 0, "warp block of 16 x 16 multiples");
  float acc[kTilesM][kTilesN][4];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kTilesM; ++i)
#pragma unroll
      for (int j = 0; j < kTilesN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.0f;
  }

  // One 16-deep step: a points at this warp's first row of A at k0 (A[k0][m0], or A[m0][k0]),
  // b at B[k0][its first column]; lda / ldb are the row pitches in elements (each row start
  // 16-byte aligned).
  __device__ __forceinline__ void multiply(const T* a, int lda, const T* b, int ldb) {
    const int lane = threadIdx.x % 32;
    const int matrix = lane >> 3, row = lane & 7;
    unsigned a_frag[kTilesM][4];
    // A's matrices in register order: (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), ...
    if constexpr (kAKMajor) {
      const T* a_row = a + ((matrix >> 1) * 8 + row) * lda + (matrix & 1) * 8;
#pragma unroll
      for (int i = 0; i < kTilesM; ++i) ldmatrix_x4_trans(a_frag[i], a_row + i * 16);
    } else {
      const T* a_row = a + ((matrix & 1) * 8 + row) * lda + (matrix >> 1) * 8;
#pragma unroll
      for (int i = 0; i < kTilesM; ++i) ldmatrix_x4(a_frag[i], a_row + i * 16 * lda);
    }
    // B's: (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15): two n8 tiles
    // at a time, used as they arrive, so few B registers are live beside the accumulators
    const T* b_row = b + ((matrix & 1) * 8 + row) * ldb + (matrix >> 1) * 8;
#pragma unroll
    for (int j = 0; j < kTilesN; j += 2) {
      unsigned r[4];
      ldmatrix_x4_trans(r, b_row + j * 8);
      const unsigned first[2] = {r[0], r[1]}, second[2] = {r[2], r[3]};
#pragma unroll
      for (int i = 0; i < kTilesM; ++i) {
        mma_16816<T>(acc[i][j], a_frag[i], first);
        mma_16816<T>(acc[i][j + 1], a_frag[i], second);
      }
    }
  }

  // out[r * row_stride + c] = acc + bias for this warp's rows first_row.. (those < rows) and
  // columns first_col.. (those < extent), straight from the registers: a column pair is one
  // aligned word where `extent` is even. bias: the fp32 bias of the warp's first column on.
  template <typename TOut>
  __device__ __forceinline__ void store(TOut* out, size_t row_stride, int first_row, int rows,
                                        int first_col, int extent, const float* bias) const {
    const int lane = threadIdx.x % 32;
    const bool pairs = extent % 2 == 0;
#pragma unroll
    for (int i = 0; i < kTilesM; ++i)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = first_row + i * 16 + half * 8 + lane / 4;
        if (r >= rows) continue;
        TOut* row = out + r * row_stride;
#pragma unroll
        for (int j = 0; j < kTilesN; ++j) {
          const int tile_col = j * 8 + 2 * (lane % 4), c = first_col + tile_col;
          const float2 bias_pair = *reinterpret_cast<const float2*>(bias + tile_col);
          const float v0 = acc[i][j][2 * half] + bias_pair.x;
          const float v1 = acc[i][j][2 * half + 1] + bias_pair.y;
          if (pairs) {
            if (c < extent) {
              *reinterpret_cast<PairWord<TOut>*>(row + c) =
                  make_pair_word(from_float<TOut>(v0), from_float<TOut>(v1));
            }
          } else {
            if (c < extent) row[c] = from_float<TOut>(v0);
            if (c + 1 < extent) row[c + 1] = from_float<TOut>(v1);
          }
        }
      }
  }
};

}  // namespace knnconv
