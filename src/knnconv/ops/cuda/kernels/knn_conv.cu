// KNN-convolution kernels: each CTA column serves one node (the forward, the scatter and the
// channels-last gather walk a few nodes per CTA where a node has few contraction tiles),
// gathered operand tiles, tensor-core products with fp32 accumulation (wmma, or explicit
// mma.sync fragments where the epilogue stores from registers: knn_mma.cuh).
//
// Layouts (built by launch.py with transpose_pad / transpose_pairs; every padded extent is a
// multiple of the tiles using it; cpad pads Cout for the forward, gpad for the backward):
//   xt [Cin*Nin + 1, bpad]   x transposed; row Cin*Nin is zeros (the padding neighbour)
//   wt [Cin*V, cpad|gpad]    weight transposed, columns past Cout are zeros
//   gt [Nout, gpad, bpad]    grad_y with the batch contiguous, rows past Cout are zeros
//   wr [V, gpad, cinpad]     weight by cell: wr[v, o, c] = W[o, c*V + v]
// input_linear / weight_linear [Nout, P64] pick, for slot p of node n, the xt row and wt row.
// Each gathered row is contiguous along the axis that is not gathered, so every tile is
// staged as whole 16-byte chunks.
#include "knn_common.cuh"
#include "knn_entry_walk.cuh"
#include "knn_mma.cuh"
#include "knn_neighbourhood.cuh"

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

// Shared memory of a kernel: kStages buffers of an A and a B tile, then what the kernel keeps
// behind them: one scratch per warp for the wmma kernels, tables and bias columns for those
// storing from registers.
template <typename T, int kStages, int kAElems, int kBElems>
struct StageBuffers {
  T* a;
  T* b;
  unsigned char* behind;
  float* scratch;
  __device__ StageBuffers(unsigned char* raw, int warp) {
    a = reinterpret_cast<T*>(raw);
    b = a + kStages * kAElems;
    behind = reinterpret_cast<unsigned char*>(b + kStages * kBElems);
    scratch = reinterpret_cast<float*>(behind) + warp * kFrag * kFrag;
  }
};

// grad_input as a gathered product over the reversed graph: node n is an input node, its slots
// run over the (output node, cell) pairs in [pair_start[n], pair_start[n+1]) times `block`
// channels: slot j*block + o reads gt row input_rows[j]*block + o and Wr row
// weight_rows[j]*block + o; dx[b, n, c] = sum_s A[s, b] * B[s, c], M = batch, N = input
// channels. No atomics: each output element is written once. One node per CTA.
template <typename T, typename TOut, int kTileM, int kTileN, int kTileK, int kWarpsM,
          int kWarpsN, int kStages, bool kAsync>
__global__ void __launch_bounds__(kWarpsM* kWarpsN* kWarp,
                                  kResidentThreads / (kWarpsM * kWarpsN * kWarp))
    knn_grad_input(const T* __restrict__ gt, const T* __restrict__ wr,
                   const int* __restrict__ pair_node, const int* __restrict__ pair_cell,
                   const int* __restrict__ pair_start, TOut* __restrict__ dx, int batch,
                   int bpad, int cin, int cinpad, int nin, int block) {
  constexpr int kThreads = kWarpsM * kWarpsN * kWarp;
  constexpr int kAPitch = kTileM + kPad, kBPitch = kTileN + kPad;
  constexpr int kAElems = kTileK * kAPitch, kBElems = kTileK * kBPitch;
  extern __shared__ __align__(128) unsigned char shared_raw[];
  const int warp = threadIdx.x / kWarp;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  StageBuffers<T, kStages, kAElems, kBElems> smem(shared_raw, warp);
  WarpTile<T, kTileM, kTileN, kWarpsM, kWarpsN> tile;
  using Tile = decltype(tile);

  const int node = blockIdx.x;
  const int c0 = blockIdx.y * kTileN;
  const int b0 = blockIdx.z * kTileM;
  const int first_pair = pair_start[node];
  const int k_tiles = (pair_start[node + 1] - first_pair) * (block / kTileK);
  const int* node_rows = pair_node + first_pair;
  const int* cell_rows = pair_cell + first_pair;
  // Global row of slot k0 + r; a tile never straddles two pairs.
  auto slot_row = [&](const int* rows, int k0, int r) -> long long {
    return static_cast<long long>(rows[k0 / block]) * block + k0 % block + r;
  };

  tile.zero();
  auto load = [&](int tile_index, int stage) {
    const int k0 = tile_index * kTileK;
    stage_rows<T, kTileK, kTileM, kAPitch, kThreads, kAsync>(
        smem.a + stage * kAElems, gt,
        [&](int r) { return slot_row(node_rows, k0, r) * bpad + b0; });
    stage_rows<T, kTileK, kTileN, kBPitch, kThreads, kAsync>(
        smem.b + stage * kBElems, wr,
        [&](int r) { return slot_row(cell_rows, k0, r) * cinpad + c0; });
  };
  auto compute = [&](int stage) {
    const T* a = smem.a + stage * kAElems;
    const T* b = smem.b + stage * kBElems;
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += kFrag) {
      tile.template multiply<wmma::col_major, wmma::row_major>(
          [&](int i) { return a + kk * kAPitch + (warp_m * Tile::kFragsM + i) * kFrag; },
          [&](int j) { return b + kk * kBPitch + (warp_n * Tile::kFragsN + j) * kFrag; },
          kAPitch, kBPitch);
    }
  };
  pipeline<kStages>(0, k_tiles, load, compute);  // a node without pairs stores zeros

  const int row0 = b0 + warp_m * Tile::kFragsM * kFrag;
  const int col0 = c0 + warp_n * Tile::kFragsN * kFrag;
  tile.drain_row_chunks(smem.scratch, [&](int r, int c, const float* values) {
    const int b = row0 + r, channel = col0 + c;
    if (b >= batch || channel >= cin) return;
    store_biased_chunk<T>(dx + (static_cast<size_t>(b) * nin + node) * cin + channel, values,
                          nullptr, 0, channel, cin);
  });
}

// dxt[in(n,p), b] += sum_o gt[n, o, b] * wt[w(n,p), o]: M = batch, N = slots, K = Cout, the
// slot gradients scattered with fp32 atomics. Chosen over the reversed-graph gather for layers
// with few input channels, where the gather's N = Cin tile would be mostly padding.
template <typename T, int kTileM, int kTileN, int kTileK, int kWarpsM, int kWarpsN, int kStages,
          bool kAsync>
__global__ void __launch_bounds__(kWarpsM* kWarpsN* kWarp)
    knn_grad_input_scatter(const T* __restrict__ gt, const T* __restrict__ wt,
                           const int* __restrict__ input_linear,
                           const int* __restrict__ weight_linear, float* __restrict__ dxt,
                           int batch, int bpad, int gpad, int wpad, int p64, int pad_row,
                           int nout, int nodes_per_cta) {
  constexpr int kThreads = kWarpsM * kWarpsN * kWarp;
  constexpr int kAPitch = kTileM + kPad, kBPitch = kTileK + kPad;
  constexpr int kAElems = kTileK * kAPitch, kBElems = kTileN * kBPitch;
  extern __shared__ __align__(128) unsigned char shared_raw[];
  const int warp = threadIdx.x / kWarp;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  StageBuffers<T, kStages, kAElems, kBElems> smem(shared_raw, warp);
  WarpTile<T, kTileM, kTileN, kWarpsM, kWarpsN> tile;
  using Tile = decltype(tile);

  // The CTA walks nodes first_node.. in one pipeline (see knn_forward): k_tiles per node.
  const int first_node = blockIdx.x * nodes_per_cta;
  const int nodes = min(nodes_per_cta, nout - first_node);
  const int k_tiles = gpad / kTileK;
  const int p0 = blockIdx.y * kTileN;
  const int b0 = blockIdx.z * kTileM;
  const int row0 = b0 + warp_m * Tile::kFragsM * kFrag;
  const int col0 = p0 + warp_n * Tile::kFragsN * kFrag;
  auto store_node = [&](int node) {
    const int* in_rows = input_linear + static_cast<size_t>(node) * p64;
    tile.template drain<true>(smem.scratch, [&](int r, int c, float value) {
      const int b = row0 + r;
      const int row = in_rows[col0 + c];
      if (b < batch && row != pad_row) atomicAdd(dxt + static_cast<size_t>(row) * bpad + b, value);
    });
  };

  tile.zero();
  // load and compute each see t = 0, 1, ... in order: walk (node, k tile) without dividing.
  int load_tile = 0, load_node = first_node, compute_tile = 0, store_at = first_node;
  auto load = [&](int /*tile*/, int stage) {
    if (load_tile == k_tiles) {
      load_tile = 0;
      ++load_node;
    }
    const int k0 = load_tile++ * kTileK;
    const int* w_rows = weight_linear + static_cast<size_t>(load_node) * p64;
    const T* grad_rows = gt + static_cast<size_t>(load_node) * gpad * bpad;
    stage_rows<T, kTileK, kTileM, kAPitch, kThreads, kAsync>(
        smem.a + stage * kAElems, grad_rows,
        [&](int r) { return static_cast<long long>(k0 + r) * bpad + b0; });
    stage_rows<T, kTileN, kTileK, kBPitch, kThreads, kAsync>(
        smem.b + stage * kBElems, wt,
        [&](int r) { return static_cast<long long>(w_rows[p0 + r]) * wpad + k0; });
  };
  auto compute = [&](int stage) {
    const T* a = smem.a + stage * kAElems;
    const T* b = smem.b + stage * kBElems;
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += kFrag) {
      tile.template multiply<wmma::col_major, wmma::col_major>(
          [&](int i) { return a + kk * kAPitch + (warp_m * Tile::kFragsM + i) * kFrag; },
          [&](int j) { return b + (warp_n * Tile::kFragsN + j) * kFrag * kBPitch + kk; },
          kAPitch, kBPitch);
    }
    if (++compute_tile == k_tiles) {  // the node's last tile: scatter it, next node
      compute_tile = 0;
      store_node(store_at++);
      tile.zero();
    }
  };
  pipeline<kStages>(0, nodes * k_tiles, load, compute);
}

// dwt[w(n,p), o] += sum_b xt[in(n,p), b] * grad_y[b, o, n]: M = slots p, N = Cout, K = batch,
// the batch split into gridDim.y / p_tiles slices of k_tiles_per_split tiles each. grad_y is
// read from gt [Nout, cpad, bpad] (batch contiguous), or with kGradInPlace from grad_y itself
// in channels-last storage (element (b, o, n) at b * grad_batch_stride + n * cout + o; Cout a
// multiple of 8, 16-byte aligned rows), rows past the batch read as zeros. The CTA's slot rows
// are staged in shared memory first: each of its tiles reads them.
template <typename T, int kTileM, int kTileN, int kTileK, int kWarpsM, int kWarpsN, int kStages,
          bool kAsync, bool kGradInPlace>
__global__ void __launch_bounds__(kWarpsM* kWarpsN* kWarp)
    knn_grad_weight(const T* __restrict__ xt, const T* __restrict__ grad,
                    const int* __restrict__ input_linear, const int* __restrict__ weight_linear,
                    float* __restrict__ dwt, int bpad, int cpad, int p64, int pad_row,
                    int p_tiles, int k_tiles_per_split, long long grad_batch_stride, int cout,
                    int batch) {
  constexpr int kThreads = kWarpsM * kWarpsN * kWarp;
  constexpr int kAPitch = kTileK + kPad;
  constexpr int kBPitch = kGradInPlace ? kTileN + kPad : kTileK + kPad;
  constexpr int kAElems = kTileM * kAPitch;
  constexpr int kBElems = (kGradInPlace ? kTileK : kTileN) * kBPitch;
  extern __shared__ __align__(128) unsigned char shared_raw[];
  const int warp = threadIdx.x / kWarp;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  StageBuffers<T, kStages, kAElems, kBElems> smem(shared_raw, warp);
  WarpTile<T, kTileM, kTileN, kWarpsM, kWarpsN> tile;
  using Tile = decltype(tile);

  const int node = blockIdx.x;
  const int p0 = (blockIdx.y % p_tiles) * kTileM;
  const int split = blockIdx.y / p_tiles;
  const int o0 = blockIdx.z * kTileN;
  const int first = split * k_tiles_per_split;
  const int last = min(first + k_tiles_per_split, bpad / kTileK);
  if (first >= last) return;
  int* in_rows = reinterpret_cast<int*>(shared_raw + kStages * (kAElems + kBElems) * sizeof(T) +
                                        kWarpsM * kWarpsN * kFrag * kFrag * sizeof(float));
  int* w_rows = in_rows + kTileM;
  for (int i = threadIdx.x; i < kTileM; i += kThreads) {
    const size_t at = static_cast<size_t>(node) * p64 + p0 + i;
    in_rows[i] = input_linear[at];
    w_rows[i] = weight_linear[at];
  }
  __syncthreads();
  const T* grad_rows = kGradInPlace ? grad + static_cast<size_t>(node) * cout
                                    : grad + static_cast<size_t>(node) * cpad * bpad;

  tile.zero();
  auto load = [&](int k_tile, int stage) {
    const int k0 = k_tile * kTileK;
    stage_rows<T, kTileM, kTileK, kAPitch, kThreads, kAsync>(
        smem.a + stage * kAElems, xt,
        [&](int r) { return static_cast<long long>(in_rows[r]) * bpad + k0; });
    if constexpr (kGradInPlace) {
      stage_chunks_or_zero<T, kTileK, kTileN, kBPitch, kThreads, kAsync>(
          smem.b + stage * kBElems, grad_rows, [&](int r, int col) -> long long {
            const int b = k0 + r;
            return b < batch && o0 + col < cout ? b * grad_batch_stride + o0 + col : -1;
          });
    } else {
      stage_rows<T, kTileN, kTileK, kBPitch, kThreads, kAsync>(
          smem.b + stage * kBElems, grad_rows,
          [&](int r) { return static_cast<long long>(o0 + r) * bpad + k0; });
    }
  };
  auto compute = [&](int stage) {
    const T* a = smem.a + stage * kAElems;
    const T* b = smem.b + stage * kBElems;
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += kFrag) {
      if constexpr (kGradInPlace) {
        tile.template multiply<wmma::row_major, wmma::row_major>(
            [&](int i) { return a + (warp_m * Tile::kFragsM + i) * kFrag * kAPitch + kk; },
            [&](int j) { return b + kk * kBPitch + (warp_n * Tile::kFragsN + j) * kFrag; },
            kAPitch, kBPitch);
      } else {
        tile.template multiply<wmma::row_major, wmma::col_major>(
            [&](int i) { return a + (warp_m * Tile::kFragsM + i) * kFrag * kAPitch + kk; },
            [&](int j) { return b + (warp_n * Tile::kFragsN + j) * kFrag * kBPitch + kk; },
            kAPitch, kBPitch);
      }
    }
  };
  pipeline<kStages>(first, last, load, compute);

  const int row0 = warp_m * Tile::kFragsM * kFrag;
  const int col0 = o0 + warp_n * Tile::kFragsN * kFrag;
  tile.template drain<false>(smem.scratch, [&](int r, int c, float value) {
    const int p = row0 + r;
    if (in_rows[p] != pad_row) {
      atomicAdd(dwt + static_cast<size_t>(w_rows[p]) * cpad + col0 + c, value);
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Channels-last kernels: the operands are read where the layers keep them, [B, N, C] with the
// channels contiguous, so neither x nor grad_y is re-laid out. A node's contraction runs over
// its entries (the real neighbours, or in reverse the (output node, cell) pairs that read it)
// times the channels of each entry, kTileK channels of one entry per contraction tile; every
// staged row is a run of 16-byte chunks along the channels.
//
//   act  [B, rows, width] (batch stride act_batch_stride): x for the forward, grad_y for dx
//   cells [V, width, n_pitch]: the weight by cell, cells[v, i, j] = W's entry for the
//        contracted channel i of cell v and the produced channel j, zero past the N extent
//   node n's entries: entry_start[n] <= e < entry_start[n + 1], each reading act row
//        entry_row[e] through cell entry_cell[e]
//

// knn_gather_cl: out[b, n, j] = bias[j] + sum_e sum_i act[b, entry_row[e], i] *
// cells[entry_cell[e], i, j], M = batch, N = produced channels, K = (entry, channel). Each
// output element is written once, from the accumulator registers (as knn_forward does). A CTA
// walks nodes_per_cta consecutive nodes in one pipeline.
template <typename T, typename TOut, int kTileM, int kTileN, int kTileK, int kWarpsM,
          int kWarpsN, int kStages, bool kAsync>
__global__ void __launch_bounds__(kWarpsM* kWarpsN* kWarp,
                                  kResidentThreads / (kWarpsM * kWarpsN * kWarp))
    knn_gather_cl(const T* __restrict__ act, long long act_batch_stride, int width,
                  const T* __restrict__ cells, int n_pitch, const int* __restrict__ entry_start,
                  const int* __restrict__ entry_row, const int* __restrict__ entry_cell,
                  const void* __restrict__ bias, int bias_is_float32, TOut* __restrict__ out,
                  int batch, int n_extent, int nodes, int nodes_per_cta) {
  constexpr int kThreads = kWarpsM * kWarpsN * kWarp;
  constexpr int kAPitch = kTileK + kPad, kBPitch = kTileN + kPad;
  constexpr int kAElems = kTileM * kAPitch, kBElems = kTileK * kBPitch;
  constexpr int kWarpRows = kTileM / kWarpsM, kWarpCols = kTileN / kWarpsN;
  extern __shared__ __align__(128) unsigned char shared_raw[];
  const int warp = threadIdx.x / kWarp;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  StageBuffers<T, kStages, kAElems, kBElems> smem(shared_raw, warp);
  float* const bias_of = reinterpret_cast<float*>(smem.behind);
  MmaTile<T, kWarpRows, kWarpCols, false> tile;

  const int j0 = blockIdx.y * kTileN;
  const int b0 = blockIdx.z * kTileM;
  EntryWalk walk(entry_start, entry_row, entry_cell, blockIdx.x * nodes_per_cta, nodes_per_cta,
                 nodes, width / kTileK);
  stage_bias<T, kTileN, kThreads>(bias_of, bias, bias_is_float32, j0, n_extent);

  auto load = [&](int tile_index, int stage) {
    if (tile_index == walk.tiles) return;  // the pipeline's last step only stores (see below)
    const EntryWalk::Step step = walk.next_load();
    const long long cell_row = static_cast<long long>(step.cell) * width;
    const int i0 = step.channel_tile * kTileK;
    stage_chunks_or_zero<T, kTileM, kTileK, kAPitch, kThreads, kAsync>(
        smem.a + stage * kAElems, act, [&](int r, int col) -> long long {
          const int b = b0 + r;
          return b < batch ? b * act_batch_stride + step.row * width + i0 + col : -1;
        });
    stage_rows<T, kTileK, kTileN, kBPitch, kThreads, kAsync>(
        smem.b + stage * kBElems, cells,
        [&](int r) { return (cell_row + i0 + r) * n_pitch + j0; });
  };
  // Each step first stores the nodes whose entries all come before its tile; one step past
  // the last tile stores the rest. One call site of the store: a second inlined copy of the
  // drain made ptxas spill.
  auto compute = [&](int stage) {
    while (walk.node_done()) {
      tile.store(out + static_cast<size_t>(walk.next_done_node()) * n_extent,
                 static_cast<size_t>(nodes) * n_extent, b0 + warp_m * kWarpRows, batch,
                 j0 + warp_n * kWarpCols, n_extent, bias_of + warp_n * kWarpCols);
      tile.zero();
    }
    if (!walk.take_tile()) return;
    const T* a = smem.a + stage * kAElems + warp_m * kWarpRows * kAPitch;
    const T* b = smem.b + stage * kBElems + warp_n * kWarpCols;
#pragma unroll 2  // see knn_forward
    for (int kk = 0; kk < kTileK; kk += 16) tile.multiply(a + kk, kAPitch, b + kk * kBPitch,
                                                          kBPitch);
    walk.tile_multiplied();
  };
  tile.zero();
  pipeline<kStages>(0, walk.tiles + 1, load, compute);
}

// dW by cell: grad_cells[entry_cell[e], i, j] += sum_b x[b, entry_row[e], i] *
// grad_y[b, entry_node[e], j] over every entry e, M = input channels (kTileM of one entry),
// N = output channels, K = batch, accumulated with fp32 atomics. Grid: (entries x channel
// tiles, N tiles, batch slices of k_tiles_per_split tiles).
template <typename T, int kTileM, int kTileN, int kTileK, int kWarpsM, int kWarpsN, int kStages,
          bool kAsync>
__global__ void __launch_bounds__(kWarpsM* kWarpsN* kWarp,
                                  kResidentThreads / (kWarpsM * kWarpsN * kWarp))
    knn_grad_weight_cl(const T* __restrict__ x, long long x_batch_stride, int cin,
                       const T* __restrict__ grad_y, long long grad_batch_stride, int cout,
                       const int* __restrict__ entry_node, const int* __restrict__ entry_row,
                       const int* __restrict__ entry_cell, float* __restrict__ grad_cells,
                       int n_pitch, int batch, int k_tiles_per_split) {
  constexpr int kThreads = kWarpsM * kWarpsN * kWarp;
  constexpr int kAPitch = kTileM + kPad, kBPitch = kTileN + kPad;
  constexpr int kAElems = kTileK * kAPitch, kBElems = kTileK * kBPitch;
  extern __shared__ __align__(128) unsigned char shared_raw[];
  const int warp = threadIdx.x / kWarp;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  StageBuffers<T, kStages, kAElems, kBElems> smem(shared_raw, warp);
  WarpTile<T, kTileM, kTileN, kWarpsM, kWarpsN> tile;
  using Tile = decltype(tile);

  const int channel_tiles = cin / kTileM;
  const int entry = blockIdx.x / channel_tiles;
  const int i0 = (blockIdx.x % channel_tiles) * kTileM;
  const int j0 = blockIdx.y * kTileN;
  const int first = blockIdx.z * k_tiles_per_split;
  const int last = min(first + k_tiles_per_split, (batch + kTileK - 1) / kTileK);
  if (first >= last) return;
  const long long x_row = static_cast<long long>(entry_row[entry]) * cin + i0;
  const long long grad_row = static_cast<long long>(entry_node[entry]) * cout + j0;

  tile.zero();
  auto load = [&](int k_tile, int stage) {
    const int k0 = k_tile * kTileK;
    stage_chunks_or_zero<T, kTileK, kTileM, kAPitch, kThreads, kAsync>(
        smem.a + stage * kAElems, x, [&](int r, int col) -> long long {
          const int b = k0 + r;
          return b < batch ? b * x_batch_stride + x_row + col : -1;
        });
    stage_chunks_or_zero<T, kTileK, kTileN, kBPitch, kThreads, kAsync>(
        smem.b + stage * kBElems, grad_y, [&](int r, int col) -> long long {
          const int b = k0 + r;
          return b < batch && j0 + col < cout ? b * grad_batch_stride + grad_row + col : -1;
        });
  };
  auto compute = [&](int stage) {
    const T* a = smem.a + stage * kAElems;
    const T* b = smem.b + stage * kBElems;
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += kFrag) {
      tile.template multiply<wmma::col_major, wmma::row_major>(
          [&](int i) { return a + kk * kAPitch + (warp_m * Tile::kFragsM + i) * kFrag; },
          [&](int j) { return b + kk * kBPitch + (warp_n * Tile::kFragsN + j) * kFrag; },
          kAPitch, kBPitch);
    }
  };
  pipeline<kStages>(first, last, load, compute);

  const int row0 = i0 + warp_m * Tile::kFragsM * kFrag;
  const int col0 = j0 + warp_n * Tile::kFragsN * kFrag;
  float* cell = grad_cells + static_cast<size_t>(entry_cell[entry]) * cin * n_pitch;
  tile.template drain<false>(smem.scratch, [&](int r, int c, float value) {
    atomicAdd(cell + static_cast<size_t>(row0 + r) * n_pitch + col0 + c, value);
  });
}

// The forward from the re-laid-out x: y[b, n, o] = bias[o] + sum_s xt[input_rows[n*p64 + s], b]
// * wt[weight_rows[n*p64 + s], o] over each node's first `slots` slots (Cin*K rounded up to
// kTileK; the rest of P64 is padding), M = batch, N = output channels, K = slots. It serves
// layers the channels-last kernels do not (few input channels: an image's).
//
// A CTA walks nodes_per_cta consecutive nodes in one pipeline, their slot tables staged in
// shared memory first, `slots` entries a node, so tile t's table entries start at t * kTileK.
// Products run on explicit mma.sync fragments, and each node's results go from the
// accumulators straight to y in channels-last storage, the bias (staged once in shared
// memory) added in fp32.
template <typename T, typename TOut, int kTileM, int kTileN, int kTileK, int kWarpsM,
          int kWarpsN, int kStages, bool kAsync>
__global__ void __launch_bounds__(kWarpsM* kWarpsN* kWarp,
                                  kResidentThreads / (kWarpsM * kWarpsN * kWarp))
    knn_forward(const T* __restrict__ xt, const T* __restrict__ wt,
                const int* __restrict__ input_rows, const int* __restrict__ weight_rows,
                const void* __restrict__ bias, int bias_is_float32, TOut* __restrict__ y,
                int batch, int bpad, int cout, int cpad, int nout, int p64, int slots,
                int nodes_per_cta) {
  constexpr int kThreads = kWarpsM * kWarpsN * kWarp;
  constexpr int kAPitch = kTileM + kPad, kBPitch = kTileN + kPad;
  constexpr int kAElems = kTileK * kAPitch, kBElems = kTileK * kBPitch;
  constexpr int kWarpRows = kTileM / kWarpsM, kWarpCols = kTileN / kWarpsN;
  extern __shared__ __align__(128) unsigned char shared_raw[];
  const int warp = threadIdx.x / kWarp;
  const int warp_m = warp / kWarpsN, warp_n = warp % kWarpsN;
  StageBuffers<T, kStages, kAElems, kBElems> smem(shared_raw, warp);
  int* const tables = reinterpret_cast<int*>(smem.behind);

  // The batch tiles of a node group are consecutive CTAs: the CTAs running at once share few
  // nodes (their tables and weight rows) and read different batch columns of each xt row,
  // instead of all reading the same columns of every row. (bpad is a multiple of kTileM.)
  const int batch_tiles = bpad / kTileM;
  const int first_node = (blockIdx.x / batch_tiles) * nodes_per_cta;
  const int nodes = min(nodes_per_cta, nout - first_node);
  const int o0 = blockIdx.y * kTileN;
  const int b0 = (blockIdx.x % batch_tiles) * kTileM;
  const int entries = nodes * slots;
  for (int g = 0; g < nodes; ++g) {
    const int* from_in = input_rows + static_cast<size_t>(first_node + g) * p64;
    const int* from_w = weight_rows + static_cast<size_t>(first_node + g) * p64;
    for (int i = threadIdx.x; i < slots; i += kThreads) {
      tables[g * slots + i] = from_in[i];
      tables[entries + g * slots + i] = from_w[i];
    }
  }
  __syncthreads();

  auto load = [&](int tile, int stage) {
    const int* in_table = tables + tile * kTileK;
    const int* w_table = in_table + entries;
    stage_rows<T, kTileK, kTileM, kAPitch, kThreads, kAsync>(
        smem.a + stage * kAElems, xt + b0,
        [&](int r) { return static_cast<long long>(in_table[r]) * bpad; });
    stage_rows<T, kTileK, kTileN, kBPitch, kThreads, kAsync>(
        smem.b + stage * kBElems, wt + o0,
        [&](int r) { return static_cast<long long>(w_table[r]) * cpad; });
  };

  // the CTA's bias columns in fp32, behind the tables
  float* const bias_of = reinterpret_cast<float*>(tables + 2 * entries);
  stage_bias<T, kTileN, kThreads>(bias_of, bias, bias_is_float32, o0, cout);
  MmaTile<T, kWarpRows, kWarpCols, true> tile;
  auto store_node = [&](int node) {
    tile.store(y + static_cast<size_t>(node) * cout, static_cast<size_t>(nout) * cout,
               b0 + warp_m * kWarpRows, batch, o0 + warp_n * kWarpCols, cout,
               bias_of + warp_n * kWarpCols);
  };

  const int k_tiles = slots / kTileK;
  int computed = 0, store_at = first_node;
  auto compute = [&](int stage) {
    const T* a = smem.a + stage * kAElems + warp_m * kWarpRows;
    const T* b = smem.b + stage * kBElems + warp_n * kWarpCols;
    // two 16-deep steps unrolled: fully unrolled, ptxas hoisted the fragment loads of every
    // step and spilled the widest warp block (32 x 64)
#pragma unroll 2
    for (int kk = 0; kk < kTileK; kk += 16) tile.multiply(a + kk * kAPitch, kAPitch,
                                                          b + kk * kBPitch, kBPitch);
    if (++computed == k_tiles) {  // the node's last tile: store it, start the next
      computed = 0;
      store_node(store_at++);
      tile.zero();
    }
  };
  tile.zero();
  pipeline<kStages>(0, nodes * k_tiles, load, compute);
}

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
