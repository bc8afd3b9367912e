// Hopper (sm_90a) variants of the channels-last gather: warpgroup MMA (wgmma.mma_async) on
// operand tiles in shared memory, compiled only for sm_90a (build.py). The layouts, tables and
// results are knn_gather_cl's (knn_gemm_channels_last.cu); only how a tile is staged and multiplied differs.
//
// Operand tiles are staged in wgmma's no-swizzle core-matrix layout: a core matrix is 8 rows
// of 16 contiguous bytes (8 elements), 128 bytes in all. Per 16-deep K step, a tile is
// (rows / 8) x 2 core matrices: the two along K 128 bytes apart (the descriptor's leading
// offset), consecutive 8-row groups 256 bytes apart (its stride offset); steps follow one
// another. bench/results/wgmma_probe.json checks this convention on an H200, for A staged
// K-major (the batch rows, channels contiguous) and M-major (read transposed, as B is here:
// the weight's rows run along the produced channels).
#include "knn_common.cuh"
#include "knn_entry_walk.cuh"
#include "knn_mma.cuh"

namespace knnconv {

constexpr int kCoreBytes = 128;  // one core matrix: 8 rows of 16 bytes
constexpr int kGroupBytes = 2 * kCoreBytes;  // an 8-row group of one 16-deep step
constexpr int kWarpgroup = 128;

// The shared-memory matrix descriptor of a no-swizzle tile starting at `tile`: its leading
// offset steps to the next core matrix along K, its stride offset to the next 8-row group.
__device__ __forceinline__ unsigned long long core_matrix_descriptor(const void* tile) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(tile));
  return static_cast<unsigned long long>((address >> 4) & 0x3FFF) |
         static_cast<unsigned long long>(kCoreBytes >> 4) << 16 |
         static_cast<unsigned long long>(kGroupBytes >> 4) << 32;
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile whose rows run along K: step
// chunk / 2, core matrix (row / 8, chunk % 2).
template <int kRows>
__device__ __forceinline__ int k_major_offset(int row, int chunk) {
  return (chunk / 2) * kRows * 16 * 2 + (row / 8) * kGroupBytes + (chunk % 2) * kCoreBytes +
         (row % 8) * 16;
}

// Byte offset of chunk `chunk` (along N) of row `row` (along K) in a tile whose rows run
// along N (an MN-major operand): step row / 16, core matrix (chunk, (row % 16) / 8).
template <int kCols>
__device__ __forceinline__ int n_major_offset(int row, int chunk) {
  return (row / 16) * kCols * 16 * 2 + chunk * kGroupBytes + ((row % 16) / 8) * kCoreBytes +
         (row % 8) * 16;
}

// One thread's share of the cp.async copies that stage a [kRows x kChunks] tile of 16-byte
// chunks, tile after tile. Where each chunk comes from (relative to the tile's origin in
// global memory) and where it lands are the same for every tile, so they are worked out once:
// staging a tile is then one address add and one copy a chunk. Thread pairs take two chunks
// of one row (one 32-byte sector of global memory) and a warp sixteen consecutive rows, which
// land in 512 contiguous bytes of either core-matrix layout: no bank conflicts.
template <int kRows, int kChunks, int kThreads>
struct CoreMatrixCopies {
  static_assert(kChunks % 2 == 0 && (kRows * kChunks) % kThreads == 0, "whole chunk pairs");
  static constexpr int kCount = kRows * kChunks / kThreads;
  long long from[kCount];  // element offset from the tile's origin; -1: the chunk is zeros
  int to[kCount];          // byte offset in the staged tile

  // source(row, chunk): the element offset, or -1; place(row, chunk): the byte offset
  template <typename Source, typename Place>
  __device__ __forceinline__ CoreMatrixCopies(int thread, Source source, Place place) {
#pragma unroll
    for (int p = 0; p < kCount; ++p) {
      const int i = p * kThreads + thread;
      const int row = (i / 2) % kRows, chunk = (i / (2 * kRows)) * 2 + i % 2;
      from[p] = source(row, chunk);
      to[p] = place(row, chunk);
    }
  }

  template <typename T>
  __device__ __forceinline__ void issue(unsigned char* tile, const T* origin) const {
#pragma unroll
    for (int p = 0; p < kCount; ++p) {
      cp_async_16_or_zero(tile + to[p], origin + (from[p] < 0 ? 0 : from[p]), from[p] >= 0);
    }
  }
};

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Pins accumulator registers in place around asynchronous MMAs: without it ptxas may move
// them between an MMA's issue and its retirement, and inserts a wait for every MMA.
template <int kRows, int kCols>
__device__ __forceinline__ void fence_operands(float (&acc)[kRows][kCols]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i)
#pragma unroll
    for (int j = 0; j < kCols; ++j) asm volatile("" : "+f"(acc[i][j])::"memory");
}
// cp.async's writes (the generic proxy) made visible to wgmma's reads (the async proxy)
__device__ __forceinline__ void fence_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// acc += A * B for one 16-deep step of a warpgroup: A [64 x 16] K-major, B [16 x kN] read
// transposed (N-major), fp32 accumulators in MmaTile<T, 16, kN>'s layout (warp w of the
// warpgroup holds rows 16w..16w+15).
template <typename T, int kN>
struct Wgmma;

// The operand lists of m64nNk16: N / 2 accumulators a thread (%0 .. %(N/2 - 1)), then the two
// descriptors (DESCRIPTORS below). Each list extends the narrower one.
#define KNN_ACC8(i) "+f"(acc[i][0]), "+f"(acc[i][1]), "+f"(acc[i][2]), "+f"(acc[i][3]), \
    "+f"(acc[i + 1][0]), "+f"(acc[i + 1][1]), "+f"(acc[i + 1][2]), "+f"(acc[i + 1][3])
#define KNN_ACC_64 KNN_ACC8(0), KNN_ACC8(2), KNN_ACC8(4), KNN_ACC8(6)
#define KNN_ACC_128 KNN_ACC_64, KNN_ACC8(8), KNN_ACC8(10), KNN_ACC8(12), KNN_ACC8(14)
#define KNN_ACC_256 KNN_ACC_128, KNN_ACC8(16), KNN_ACC8(18), KNN_ACC8(20), KNN_ACC8(22), \
    KNN_ACC8(24), KNN_ACC8(26), KNN_ACC8(28), KNN_ACC8(30)
#define KNN_REGS_64 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, " \
    "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31"
#define KNN_REGS_128 KNN_REGS_64 ", " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, " \
    "%44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, " \
    "%56, %57, %58, %59, %60, %61, %62, %63"
#define KNN_REGS_256 KNN_REGS_128 ", " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, " \
    "%76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, " \
    "%88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, " \
    "%100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, " \
    "%124, %125, %126, %127"

#define KNN_WGMMA(TYPE, PTX_TYPE, N, DESCRIPTORS)                                             \
  template <>                                                                                 \
  struct Wgmma<TYPE, N> {                                                                     \
    static __device__ __forceinline__ void step(float (&acc)[N / 8][4], unsigned long long a, \
                                                unsigned long long b) {                       \
      asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." PTX_TYPE "." PTX_TYPE   \
                   " {" KNN_REGS_##N "}, " DESCRIPTORS ", 1, 1, 1, 0, 1;\n"                  \
                   : KNN_ACC_##N                                                              \
                   : "l"(a), "l"(b));                                                         \
    }                                                                                         \
  };
#define KNN_WGMMA_BOTH_TYPES(N, DESCRIPTORS)    \
  KNN_WGMMA(__half, "f16", N, DESCRIPTORS)      \
  KNN_WGMMA(__nv_bfloat16, "bf16", N, DESCRIPTORS)

KNN_WGMMA_BOTH_TYPES(64, "%32, %33")
KNN_WGMMA_BOTH_TYPES(128, "%64, %65")
KNN_WGMMA_BOTH_TYPES(256, "%128, %129")
#undef KNN_WGMMA_BOTH_TYPES
#undef KNN_WGMMA
#undef KNN_REGS_256
#undef KNN_REGS_128
#undef KNN_REGS_64
#undef KNN_ACC_256
#undef KNN_ACC_128
#undef KNN_ACC_64
#undef KNN_ACC8

__device__ __forceinline__ unsigned shared_address(const void* pointer) {
  return static_cast<unsigned>(__cvta_generic_to_shared(pointer));
}
__device__ __forceinline__ void mbarrier_init(unsigned long long* barrier, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)),
               "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(unsigned long long* barrier) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];\n" ::"r"(
                   shared_address(barrier)) : "memory");
}
// Waits until the barrier's phase of this parity (0 for its first phase) has completed.
__device__ __forceinline__ void mbarrier_wait(unsigned long long* barrier, int parity) {
  unsigned done;
  do {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n"
        "}\n"
        : "=r"(done)
        : "r"(shared_address(barrier)), "r"(parity)
        : "memory");
  } while (!done);
}

// knn_gather_cl on warpgroup MMA: out[b, n, j] = bias[j] + sum_e sum_i act[b, entry_row[e], i]
// * cells[entry_cell[e], i, j] (arguments as knn_gather_cl's), warp-specialised: the last
// warpgroup stages the tiles of the CTA's walk with cp.async into kStages buffers, and each of
// the kConsumers warpgroups before it multiplies its 64 batch rows of every tile, sharing the
// staged weight tile, and stores its rows of each node as the node's last tile is done.
//
// Two mbarriers a buffer: `full` completes when each staging thread's copies into it have
// landed (every staging thread waits for its own copies, kStages - 2 tiles behind the newest,
// and fences them for the tensor cores' reads before arriving), `empty` when every consumer has
// retired its products on it (a consumer releases a tile's buffer once it has issued the next
// tile's products, or at the node's end). Tile t uses buffer t % kStages, in that buffer's
// phase t / kStages. Staging kStages - 2 tiles ahead leaves the consumers, which hold one
// buffer while the next is multiplied, a free buffer: no deadlock.
template <typename T, typename TOut, int kTileN, int kTileK, int kConsumers, int kStages>
__global__ void __launch_bounds__((kConsumers + 1) * kWarpgroup, 1)
    knn_gather_cl_wgmma(const T* __restrict__ act, long long act_batch_stride, int width,
                        const T* __restrict__ cells, int n_pitch,
                        const int* __restrict__ entry_start, const int* __restrict__ entry_row,
                        const int* __restrict__ entry_cell, const void* __restrict__ bias,
                        int bias_is_float32, TOut* __restrict__ out, int batch, int n_extent,
                        int nodes, int nodes_per_cta) {
  constexpr int kThreads = (kConsumers + 1) * kWarpgroup;
  constexpr int kTileM = 64 * kConsumers;
  constexpr int kABytes = kTileM * kTileK * 2, kBBytes = kTileK * kTileN * 2;
  constexpr int kAStepBytes = kTileM * 16 * 2, kBStepBytes = kTileN * 16 * 2;
  constexpr int kAhead = kStages - 2;  // tiles a staging thread has in flight
  static_assert(kTileK % 16 == 0 && kTileN % 16 == 0, "16-deep steps, whole chunk pairs");
  static_assert(kStages >= 3, "the consumers hold a buffer while staging runs a tile ahead");
  extern __shared__ __align__(128) unsigned char shared_raw[];
  unsigned char* const a_tiles = shared_raw;
  unsigned char* const b_tiles = shared_raw + kStages * kABytes;
  float* const bias_of = reinterpret_cast<float*>(b_tiles + kStages * kBBytes);
  unsigned long long* const full = reinterpret_cast<unsigned long long*>(bias_of + kTileN);
  unsigned long long* const empty = full + kStages;
  const int warpgroup = threadIdx.x / kWarpgroup;

  const int j0 = blockIdx.y * kTileN;
  const int b0 = blockIdx.z * kTileM;
  const int first_node = blockIdx.x * nodes_per_cta;
  EntryWalk walk(entry_start, entry_row, entry_cell, first_node, nodes_per_cta, nodes,
                 width / kTileK);
  stage_bias<T, kTileN, kThreads>(bias_of, bias, bias_is_float32, j0, n_extent);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full + s, kWarpgroup);
      mbarrier_init(empty + s, kConsumers * kWarpgroup);
    }
  }
  __syncthreads();

  auto produce = [&]() {
    const int tid = threadIdx.x - kConsumers * kWarpgroup;
    // the batch rows of an input row, and the weight rows of a cell's channel tile
    const CoreMatrixCopies<kTileM, kTileK / kChunk, kWarpgroup> rows(
        tid,
        [&](int r, int chunk) -> long long {
          const int b = b0 + r;
          return b < batch ? b * act_batch_stride + chunk * kChunk : -1;
        },
        k_major_offset<kTileM>);
    const CoreMatrixCopies<kTileK, kTileN / kChunk, kWarpgroup> weights(
        tid,
        [&](int r, int chunk) -> long long {
          return static_cast<long long>(r) * n_pitch + j0 + chunk * kChunk;
        },
        n_major_offset<kTileN>);
    auto land = [&](int tile) {  // this thread's copies of `tile` are done: publish them
      fence_async_shared();
      mbarrier_arrive(full + tile % kStages);
    };
    for (int tile = 0; tile < walk.tiles; ++tile) {
      const int stage = tile % kStages;
      if (tile >= kStages) mbarrier_wait(empty + stage, (tile / kStages - 1) & 1);
      const EntryWalk::Step step = walk.next_load();
      const long long channel = step.channel_tile * kTileK;
      rows.issue(a_tiles + stage * kABytes, act + step.row * width + channel);
      weights.issue(b_tiles + stage * kBBytes,
                    cells + (static_cast<long long>(step.cell) * width + channel) * n_pitch);
      cp_async_commit();
      if (tile >= kAhead) {
        cp_async_wait<kAhead>();
        land(tile - kAhead);
      }
    }
    cp_async_wait<0>();
    for (int tile = max(0, walk.tiles - kAhead); tile < walk.tiles; ++tile) land(tile);
  };
  auto consume = [&]() {
    MmaTile<T, 16, kTileN, false> tile;  // the accumulators, in the layout its store reads
    const int warp_in_group = (threadIdx.x % kWarpgroup) / kWarp;
    const unsigned char* const a_group = a_tiles + warpgroup * 8 * kGroupBytes;
    int tile_index = 0, held = -1;  // held: the buffer whose products may still be in flight
    tile.zero();
    for (int node = first_node; node < walk.last_node; ++node) {
      const int node_tiles =
          (entry_start[node + 1] - entry_start[node]) * walk.tiles_per_entry;
      for (int t = 0; t < node_tiles; ++t, ++tile_index) {
        const int stage = tile_index % kStages;
        mbarrier_wait(full + stage, (tile_index / kStages) & 1);
        fence_operands(tile.acc[0]);
        wgmma_fence();
#pragma unroll
        for (int s = 0; s < kTileK / 16; ++s) {
          Wgmma<T, kTileN>::step(
              tile.acc[0], core_matrix_descriptor(a_group + stage * kABytes + s * kAStepBytes),
              core_matrix_descriptor(b_tiles + stage * kBBytes + s * kBStepBytes));
        }
        wgmma_commit();
        wgmma_wait<1>();
        fence_operands(tile.acc[0]);
        if (held >= 0) mbarrier_arrive(empty + held);
        held = stage;
      }
      wgmma_wait<0>();  // the node's last products, before its accumulators are read
      fence_operands(tile.acc[0]);
      if (held >= 0) mbarrier_arrive(empty + held);
      held = -1;
      tile.store(out + static_cast<size_t>(node) * n_extent,
                 static_cast<size_t>(nodes) * n_extent,
                 b0 + warpgroup * 64 + warp_in_group * 16, batch, j0, n_extent, bias_of);
      tile.zero();
    }
  };
  if (warpgroup == kConsumers) {
    produce();
  } else {
    consume();
  }
}

}  // namespace knnconv
