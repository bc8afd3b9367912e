// Gather-GEMM kernels on re-laid-out operands (x, grad_y and the weight transposed by
// knn_relayout.cu): each CTA column serves one node (the forward walks a few nodes per CTA
// where a node has few contraction tiles), gathered operand tiles, tensor-core products with
// fp32 accumulation (wmma, or explicit mma.sync fragments where the epilogue stores from
// registers: knn_mma.cuh).
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
#include "knn_gemm.cuh"

namespace knnconv {

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
  const GemmCta<T, kStages, kAElems, kBElems, kWarpsN> cta;
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
        cta.a + stage * kAElems, gt,
        [&](int r) { return slot_row(node_rows, k0, r) * bpad + b0; });
    stage_rows<T, kTileK, kTileN, kBPitch, kThreads, kAsync>(
        cta.b + stage * kBElems, wr,
        [&](int r) { return slot_row(cell_rows, k0, r) * cinpad + c0; });
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
  pipeline<kStages>(0, k_tiles, load, compute);  // a node without pairs stores zeros

  const int row0 = b0 + cta.warp_m * Tile::kFragsM * kFrag;
  const int col0 = c0 + cta.warp_n * Tile::kFragsN * kFrag;
  tile.drain_row_chunks(cta.scratch, [&](int r, int c, const float* values) {
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
  const GemmCta<T, kStages, kAElems, kBElems, kWarpsN> cta;
  WarpTile<T, kTileM, kTileN, kWarpsM, kWarpsN> tile;
  using Tile = decltype(tile);

  // The CTA walks nodes first_node.. in one pipeline (see knn_forward): k_tiles per node.
  const int first_node = blockIdx.x * nodes_per_cta;
  const int nodes = min(nodes_per_cta, nout - first_node);
  const int k_tiles = gpad / kTileK;
  const int p0 = blockIdx.y * kTileN;
  const int b0 = blockIdx.z * kTileM;
  const int row0 = b0 + cta.warp_m * Tile::kFragsM * kFrag;
  const int col0 = p0 + cta.warp_n * Tile::kFragsN * kFrag;
  auto store_node = [&](int node) {
    const int* in_rows = input_linear + static_cast<size_t>(node) * p64;
    tile.template drain<true>(cta.scratch, [&](int r, int c, float value) {
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
        cta.a + stage * kAElems, grad_rows,
        [&](int r) { return static_cast<long long>(k0 + r) * bpad + b0; });
    stage_rows<T, kTileN, kTileK, kBPitch, kThreads, kAsync>(
        cta.b + stage * kBElems, wt,
        [&](int r) { return static_cast<long long>(w_rows[p0 + r]) * wpad + k0; });
  };
  auto compute = [&](int stage) {
    const T* a = cta.a + stage * kAElems;
    const T* b = cta.b + stage * kBElems;
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += kFrag) {
      tile.template multiply<wmma::col_major, wmma::col_major>(
          [&](int i) { return a + kk * kAPitch + (cta.warp_m * Tile::kFragsM + i) * kFrag; },
          [&](int j) { return b + (cta.warp_n * Tile::kFragsN + j) * kFrag * kBPitch + kk; },
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
  const GemmCta<T, kStages, kAElems, kBElems, kWarpsN> cta;
  WarpTile<T, kTileM, kTileN, kWarpsM, kWarpsN> tile;
  using Tile = decltype(tile);

  const int node = blockIdx.x;
  const int p0 = (blockIdx.y % p_tiles) * kTileM;
  const int split = blockIdx.y / p_tiles;
  const int o0 = blockIdx.z * kTileN;
  const int first = split * k_tiles_per_split;
  const int last = min(first + k_tiles_per_split, bpad / kTileK);
  if (first >= last) return;
  int* in_rows = reinterpret_cast<int*>(reinterpret_cast<float*>(cta.behind) +
                                        kWarpsM * kWarpsN * kFrag * kFrag);
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
        cta.a + stage * kAElems, xt,
        [&](int r) { return static_cast<long long>(in_rows[r]) * bpad + k0; });
    if constexpr (kGradInPlace) {
      stage_chunks_or_zero<T, kTileK, kTileN, kBPitch, kThreads, kAsync>(
          cta.b + stage * kBElems, grad_rows, [&](int r, int col) -> long long {
            const int b = k0 + r;
            return b < batch && o0 + col < cout ? b * grad_batch_stride + o0 + col : -1;
          });
    } else {
      stage_rows<T, kTileN, kTileK, kBPitch, kThreads, kAsync>(
          cta.b + stage * kBElems, grad_rows,
          [&](int r) { return static_cast<long long>(o0 + r) * bpad + k0; });
    }
  };
  auto compute = [&](int stage) {
    const T* a = cta.a + stage * kAElems;
    const T* b = cta.b + stage * kBElems;
#pragma unroll
    for (int kk = 0; kk < kTileK; kk += kFrag) {
      if constexpr (kGradInPlace) {
        tile.template multiply<wmma::row_major, wmma::row_major>(
            [&](int i) { return a + (cta.warp_m * Tile::kFragsM + i) * kFrag * kAPitch + kk; },
            [&](int j) { return b + kk * kBPitch + (cta.warp_n * Tile::kFragsN + j) * kFrag; },
            kAPitch, kBPitch);
      } else {
        tile.template multiply<wmma::row_major, wmma::col_major>(
            [&](int i) { return a + (cta.warp_m * Tile::kFragsM + i) * kFrag * kAPitch + kk; },
            [&](int j) { return b + (cta.warp_n * Tile::kFragsN + j) * kFrag * kBPitch + kk; },
            kAPitch, kBPitch);
      }
    }
  };
  pipeline<kStages>(first, last, load, compute);

  const int row0 = cta.warp_m * Tile::kFragsM * kFrag;
  const int col0 = o0 + cta.warp_n * Tile::kFragsN * kFrag;
  tile.template drain<false>(cta.scratch, [&](int r, int c, float value) {
    const int p = row0 + r;
    if (in_rows[p] != pad_row) {
      atomicAdd(dwt + static_cast<size_t>(w_rows[p]) * cpad + col0 + c, value);
    }
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
  const GemmCta<T, kStages, kAElems, kBElems, kWarpsN> cta;
  int* const tables = reinterpret_cast<int*>(cta.behind);

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
        cta.a + stage * kAElems, xt + b0,
        [&](int r) { return static_cast<long long>(in_table[r]) * bpad; });
    stage_rows<T, kTileK, kTileN, kBPitch, kThreads, kAsync>(
        cta.b + stage * kBElems, wt + o0,
        [&](int r) { return static_cast<long long>(w_table[r]) * cpad; });
  };

  // the CTA's bias columns in fp32, behind the tables
  float* const bias_of = reinterpret_cast<float*>(tables + 2 * entries);
  stage_bias<T, kTileN, kThreads>(bias_of, bias, bias_is_float32, o0, cout);
  MmaTile<T, kWarpRows, kWarpCols, true> tile;
  auto store_node = [&](int node) {
    tile.store(y + static_cast<size_t>(node) * cout, static_cast<size_t>(nout) * cout,
               b0 + cta.warp_m * kWarpRows, batch, o0 + cta.warp_n * kWarpCols, cout,
               bias_of + cta.warp_n * kWarpCols);
  };

  const int k_tiles = slots / kTileK;
  int computed = 0, store_at = first_node;
  auto compute = [&](int stage) {
    const T* a = cta.a + stage * kAElems + cta.warp_m * kWarpRows;
    const T* b = cta.b + stage * kBElems + cta.warp_n * kWarpCols;
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

}  // namespace knnconv
