// A probe of Hopper's warpgroup MMA on shared-memory operands (sm_90a), for
// scripts/probe_wgmma.py: one warpgroup computes C[64 x 64] = A[64 x K] * B[64 x K]^T in fp32
// from fp16 operands staged in shared memory in the no-swizzle core-matrix layout (each core
// matrix 8 rows x 16 bytes, its rows contiguous), with wgmma.mma_async m64n64k16 steps along
// K. The byte offsets between core matrices adjacent along K and along M (or N) are kernel
// arguments, and `k_offset_field` says which descriptor field gets the K one, so one launch per
// convention shows which the hardware follows, for A staged K-major and M-major (the layout of
// a batch-contiguous operand, read with wgmma's transpose flag); the accumulator layout of the
// store (warp w holds rows 16w.., lane l rows l/4 and l/4 + 8, columns 8j + 2*(l%4) and the
// next) is checked by the same comparison.
#include <cuda_fp16.h>
#include <cstdint>

namespace {

constexpr int kM = 64, kN = 64, kStepK = 16;

__device__ __forceinline__ uint64_t descriptor(const void* shared, int leading_bytes,
                                               int stride_bytes) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  uint64_t d = 0;
  d |= static_cast<uint64_t>((address >> 4) & 0x3FFF);
  d |= static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16;
  d |= static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32;
  return d;  // base offset 0, no swizzle
}

// Element (row, k) of a [rows x 16] step tile: core matrix (row / 8, k / 8), whose 16-byte
// rows run along K (K-major) or along the rows (M-major).
__device__ __forceinline__ int core_offset(int row, int k, int k_core_bytes,
                                           int row_core_bytes, bool m_major) {
  const int within = m_major ? (k % 8) * 16 + (row % 8) * 2 : (row % 8) * 16 + (k % 8) * 2;
  return (row / 8) * row_core_bytes + (k / 8) * k_core_bytes + within;
}

// kTransA = 1: A staged M-major (core-matrix rows run along M), as a batch-contiguous
// operand would be.
template <int kTransA>
__device__ __forceinline__ void mma_64x64x16(float (&d)[32], uint64_t a, uint64_t b,
                                             int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, p, 1, 1, %35, 0;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]),
        "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]),
        "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]),
        "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate), "n"(kTransA));
}

}  // namespace

// a [64 x k] and b [64 x k] row-major fp16 (k a multiple of 16, at most 128), c [64 x 64]
// fp32. One CTA of 128 threads. B is staged K-major, its core matrices k_core_bytes /
// row_core_bytes apart, the K one in the descriptor field k_offset_field names (0: leading,
// 1: stride); A the same way, or M-major with a_m_major, then with its own offsets and field.
extern "C" __global__ void __launch_bounds__(128)
    probe_wgmma(const __half* a, const __half* b, float* c, int k, int k_core_bytes,
                int row_core_bytes, int k_offset_field, int a_m_major, int a_k_core_bytes,
                int a_row_core_bytes, int a_k_offset_field) {
  __shared__ __align__(128) unsigned char tiles[2 * 8 * kM * kStepK * sizeof(__half)];
  const int steps = k / kStepK;
  const int step_bytes = kM * kStepK * sizeof(__half);  // 2 KB: 8 x 2 core matrices
  unsigned char* a_tiles = tiles;
  unsigned char* b_tiles = tiles + steps * step_bytes;
  for (int i = threadIdx.x; i < kM * k; i += blockDim.x) {
    const int row = i / k, col = i % k, step = col / kStepK, kk = col % kStepK;
    const int a_at = step * step_bytes + (a_m_major ? core_offset(row, kk, a_k_core_bytes,
                                                                  a_row_core_bytes, true)
                                                    : core_offset(row, kk, k_core_bytes,
                                                                  row_core_bytes, false));
    *reinterpret_cast<__half*>(a_tiles + a_at) = a[i];
    *reinterpret_cast<__half*>(b_tiles + step * step_bytes +
                               core_offset(row, kk, k_core_bytes, row_core_bytes, false)) = b[i];
  }
  // generic-proxy writes made visible to the asynchronous proxy wgmma reads through
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();

  float d[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) d[i] = 0.0f;
  // the K-direction offset in the leading field (field 0) or the stride one
  auto fields = [](int along_k, int along_rows, int field, int* leading, int* stride) {
    *leading = field == 0 ? along_k : along_rows;
    *stride = field == 0 ? along_rows : along_k;
  };
  int a_leading, a_stride, b_leading, b_stride;
  if (a_m_major) {
    fields(a_k_core_bytes, a_row_core_bytes, a_k_offset_field, &a_leading, &a_stride);
  } else {
    fields(k_core_bytes, row_core_bytes, k_offset_field, &a_leading, &a_stride);
  }
  fields(k_core_bytes, row_core_bytes, k_offset_field, &b_leading, &b_stride);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  for (int s = 0; s < steps; ++s) {
    const uint64_t a_desc = descriptor(a_tiles + s * step_bytes, a_leading, a_stride);
    const uint64_t b_desc = descriptor(b_tiles + s * step_bytes, b_leading, b_stride);
    if (a_m_major) {
      mma_64x64x16<1>(d, a_desc, b_desc, s > 0);
    } else {
      mma_64x64x16<0>(d, a_desc, b_desc, s > 0);
    }
  }
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    const int row = warp * 16 + lane / 4, col = j * 8 + 2 * (lane % 4);
    c[row * kN + col] = d[4 * j];
    c[row * kN + col + 1] = d[4 * j + 1];
    c[(row + 8) * kN + col] = d[4 * j + 2];
    c[(row + 8) * kN + col + 1] = d[4 * j + 3];
  }
}
