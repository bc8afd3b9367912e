// Channels-last gather-GEMM kernels: the operands are read where the layers keep them,
// [B, N, C] with the channels contiguous, so neither x nor grad_y is re-laid out. A node's
// contraction runs over its entries (the real neighbours, or in reverse the (output node,
// cell) pairs that read it) times the channels of each entry, kTileK channels of one entry
// per contraction tile; every staged row is a run of 16-byte chunks along the channels.
//
//   act  [B, rows, width] (batch stride act_batch_stride): x for the forward, grad_y for dx
//   cells [V, width, n_pitch]: the weight by cell, cells[v, i, j] = W's entry for the
//        contracted channel i of cell v and the produced channel j, zero past the N extent
//   node n's entries: entry_start[n] <= e < entry_start[n + 1], each reading act row
//        entry_row[e] through cell entry_cell[e]
//
#include "knn_gemm.cuh"

namespace knnconv {

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
  const GemmCta<T, kStages, kAElems, kBElems, kWarpsN> cta;
  float* const bias_of = reinterpret_cast<float*>(cta.behind);
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
        cta.a + stage * kAElems, act, [&](int r, int col) -> long long {
          const int b = b0 + r;
          return b < batch ? b * act_batch_stride + step.row * width + i0 + col : -1;
        });
    stage_rows<T, kTileK, kTileN, kBPitch, kThreads, kAsync>(
        cta.b + stage * kBElems, cells,
        [&](int r) { return (cell_row + i0 + r) * n_pitch + j0; });
  };
  // Each step first stores the nodes whose entries all come before its tile; one step past
  // the last tile stores the rest. One call site of the store: a second inlined copy of the
  // drain made ptxas spill.
  auto compute = [&](int stage) {
    while (walk.node_done()) {
      tile.store(out + static_cast<size_t>(walk.next_done_node()) * n_extent,
                 static_cast<size_t>(nodes) * n_extent, b0 + cta.warp_m * kWarpRows, batch,
                 j0 + cta.warp_n * kWarpCols, n_extent, bias_of + cta.warp_n * kWarpCols);
      tile.zero();
    }
    if (!walk.take_tile()) return;
    const T* a = cta.a + stage * kAElems + cta.warp_m * kWarpRows * kAPitch;
    const T* b = cta.b + stage * kBElems + cta.warp_n * kWarpCols;
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
  const GemmCta<T, kStages, kAElems, kBElems, kWarpsN> cta;
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
        cta.a + stage * kAElems, x, [&](int r, int col) -> long long {
          const int b = k0 + r;
          return b < batch ? b * x_batch_stride + x_row + col : -1;
        });
    stage_chunks_or_zero<T, kTileK, kTileN, kBPitch, kThreads, kAsync>(
        cta.b + stage * kBElems, grad_y, [&](int r, int col) -> long long {
          const int b = k0 + r;
          return b < batch && j0 + col < cout ? b * grad_batch_stride + grad_row + col : -1;
        });
  };
  auto compute = [&](int stage) {
    const T* a = cta.a + stage * kAElems;
    const T* b = cta.b + stage * kBElems;
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += kFrag) {
      tile.template multiply<wmma::col_major, wmma::row_major>(
          [&](int i) { return a + kk * kAPitch + (cta.warp_m * Tile::kFragsM + i) * kFrag; },
          [&](int j) { return b + kk * kBPitch + (cta.warp_n * Tile::kFragsN + j) * kFrag; },
          kAPitch, kBPitch);
    }
  };
  pipeline<kStages>(first, last, load, compute);

  const int row0 = i0 + cta.warp_m * Tile::kFragsM * kFrag;
  const int col0 = j0 + cta.warp_n * Tile::kFragsN * kFrag;
  float* cell = grad_cells + static_cast<size_t>(entry_cell[entry]) * cin * n_pitch;
  tile.template drain<false>(cta.scratch, [&](int r, int c, float value) {
    atomicAdd(cell + static_cast<size_t>(row0 + r) * n_pitch + col0 + c, value);
  });
}

}  // namespace knnconv
