// Per-channel neighbourhood kernels: KNN pooling and depthwise KNN convolution.
//
// Row layouts: x [rows, Nin] and y [rows, Nout] with rows = B*C (channel c = row % C), the
// storage of a contiguous [B, C, N] tensor. Channels-last layouts (the *_channels_last pooling
// kernels): x [B, Nin, C] and y [B, Nout, C], the storage a [B, C, N] tensor has when it is
// the transposed view of a [B, N, C] buffer, as knnconv's convolution returns it.
// knn [K, Nout] int32 (Nin marks a padding neighbour); cells [K, Nout] int32, the kernel cell
// of each slot; the reversed graph (pair_start [Nin + 1], pair_node / pair_cell [pairs]) lists
// the real (output node, cell) pairs that read each input node, so every gradient with
// respect to x is a gather: atomic-free and deterministic. Rows (or, channels-last, batch
// elements) are walked with a grid-stride loop over gridDim.y (B*C may exceed its 65535
// limit); accumulation is in fp32.
#include "knn_common.cuh"

namespace knnconv {

enum PoolMode { kPoolMax = 0, kPoolAvg = 1, kPoolSum = 2 };

// The word one load or store of kBytes moves: a run of consecutive elements read in one
// instruction, so a warp reading channel runs of one node issues few wide, coalesced accesses.
template <int kBytes>
struct VectorWord;
template <>
struct VectorWord<1> { using type = unsigned char; };
template <>
struct VectorWord<2> { using type = unsigned short; };
template <>
struct VectorWord<4> { using type = unsigned int; };
template <>
struct VectorWord<8> { using type = uint2; };
template <>
struct VectorWord<16> { using type = uint4; };

template <typename T, int kVector>
using VectorOf = typename VectorWord<sizeof(T) * kVector>::type;

// kVector consecutive elements from an address aligned to their total size, in one load.
template <int kVector, typename T>
__device__ __forceinline__ void load_vector(const T* __restrict__ at, T (&values)[kVector]) {
  const VectorOf<T, kVector> word = __ldg(reinterpret_cast<const VectorOf<T, kVector>*>(at));
  const T* scalars = reinterpret_cast<const T*>(&word);
#pragma unroll
  for (int e = 0; e < kVector; ++e) values[e] = scalars[e];
}

template <int kVector, typename T>
__device__ __forceinline__ void store_vector(T* __restrict__ at, const T (&values)[kVector]) {
  VectorOf<T, kVector> word;
  T* scalars = reinterpret_cast<T*>(&word);
#pragma unroll
  for (int e = 0; e < kVector; ++e) scalars[e] = values[e];
  *reinterpret_cast<VectorOf<T, kVector>*>(at) = word;
}

// One step of a max over a window: best and its tie count, with NaN absorbing. Once best is
// NaN every comparison is false, so it stays NaN with 0 ties, and the backward, which only
// sends gradient where ties > 0, gives that window none.
__device__ __forceinline__ void max_step(float value, float& best, int& ties) {
  if (value > best) {
    best = value;
    ties = 1;
  } else if (value == best) {
    ++ties;
  } else if (value != value) {
    best = value;
    ties = 0;
  }
}

// y[r, n] = max / mean / sum of x[r, knn[k, n]] over the real neighbours k of n (0 when there
// is none); for max also ties[r, n] = how many real neighbours equal the max (0 when the
// output is NaN or has no real neighbour), so the backward can share the gradient between
// tied maxima like torch.amax. Ties are uint8: the host refuses max windows of K > 255.
template <typename T, int kMode>
__global__ void knn_pool_forward(const T* __restrict__ x, const int* __restrict__ knn,
                                 T* __restrict__ y, unsigned char* __restrict__ ties, int rows,
                                 int nin, int nout, int k) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= nout) return;
  for (int r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* row = x + static_cast<size_t>(r) * nin;
    float best = __int_as_float(0xff800000), total = 0.0f;  // -inf
    int real = 0, equal = 0;
    for (int s = 0; s < k; ++s) {
      const int m = knn[s * nout + n];
      if (m == nin) continue;
      const float v = to_float(row[m]);
      ++real;
      if constexpr (kMode == kPoolMax) {
        max_step(v, best, equal);
      } else {
        total += v;
      }
    }
    float out;
    if constexpr (kMode == kPoolMax) {
      out = real > 0 ? best : 0.0f;
      ties[static_cast<size_t>(r) * nout + n] = static_cast<unsigned char>(equal);
    } else {
      out = kMode == kPoolAvg ? total / static_cast<float>(real > 0 ? real : 1) : total;
    }
    y[static_cast<size_t>(r) * nout + n] = from_float<T>(out);
  }
}

// dx[r, m] = sum over the nodes n reading m of gy[r, n] * share, share = 1 (sum), 1/count[n]
// (avg, as scale[n]) or, for max, 1/ties[r, n] when x[r, m] is the max y[r, n] and 0 otherwise.
template <typename T, int kMode>
__global__ void knn_pool_backward(const T* __restrict__ gy, const T* __restrict__ x,
                                  const T* __restrict__ y, const unsigned char* __restrict__ ties,
                                  const float* __restrict__ scale,
                                  const int* __restrict__ pair_start,
                                  const int* __restrict__ pair_node, T* __restrict__ dx,
                                  int rows, int nin, int nout) {
  const int m = blockIdx.x * blockDim.x + threadIdx.x;
  if (m >= nin) return;
  const int first = pair_start[m], last = pair_start[m + 1];
  for (int r = blockIdx.y; r < rows; r += gridDim.y) {
    const size_t out_row = static_cast<size_t>(r) * nout;
    float total = 0.0f;
    for (int j = first; j < last; ++j) {
      const int n = pair_node[j];
      if constexpr (kMode == kPoolMax) {
        const int tied = ties[out_row + n];
        if (tied > 0 && to_float(x[static_cast<size_t>(r) * nin + m]) == to_float(y[out_row + n])) {
          total += to_float(gy[out_row + n]) / static_cast<float>(tied);
        }
      } else if constexpr (kMode == kPoolAvg) {
        total += to_float(gy[out_row + n]) * scale[n];
      } else {
        total += to_float(gy[out_row + n]);
      }
    }
    dx[static_cast<size_t>(r) * nin + m] = from_float<T>(total);
  }
}

// The channels-last pooling kernels give each thread kPoolBatch batch elements: every table
// entry it loads serves them all, and their loads of x (or grad_y) are independent, in flight
// together. One batch element per thread left each thread a few dependent loads and the grid
// tens of thousands of short blocks: 17-30% of the copy bandwidth on fovi's pooling layers.
constexpr int kPoolBatch = 4;

// The channels-last pooling: y[b, n, c] (and for max ties[b, n, c]) as knn_pool_forward
// defines them, on x [B, Nin, C]. One thread per (node n, run of kVector channels), channels
// fastest, and kPoolBatch batch elements, batch groups over gridDim.y: the threads serving
// one node read each neighbour's channel run as consecutive vectors of one row of x, so every
// gather is coalesced. C is a multiple of kVector and x, y aligned to kVector elements (the
// host picks kVector so).
template <typename T, int kMode, int kVector>
__global__ void knn_pool_forward_channels_last(const T* __restrict__ x,
                                               const int* __restrict__ knn, T* __restrict__ y,
                                               unsigned char* __restrict__ ties, int batch,
                                               int channels, int nin, int nout, int k) {
  const int runs = channels / kVector;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= nout * runs) return;  // the host keeps Nout * C within an int
  const int n = i / runs;
  const int c = (i - n * runs) * kVector;
  const size_t in_image = static_cast<size_t>(nin) * channels;
  for (int b0 = blockIdx.y * kPoolBatch; b0 < batch; b0 += gridDim.y * kPoolBatch) {
    const int group = min(kPoolBatch, batch - b0);
    const T* images = x + static_cast<size_t>(b0) * in_image + c;
    float best[kPoolBatch][kVector], total[kPoolBatch][kVector];
    int equal[kPoolBatch][kVector];
#pragma unroll
    for (int g = 0; g < kPoolBatch; ++g) {
#pragma unroll
      for (int e = 0; e < kVector; ++e) {
        best[g][e] = __int_as_float(0xff800000);  // -inf
        total[g][e] = 0.0f;
        equal[g][e] = 0;
      }
    }
    int real = 0;
    for (int s = 0; s < k; ++s) {
      const int m = knn[s * nout + n];
      if (m == nin) continue;
      ++real;
#pragma unroll
      for (int g = 0; g < kPoolBatch; ++g) {
        if (g >= group) break;
        T values[kVector];
        load_vector(images + g * in_image + static_cast<size_t>(m) * channels, values);
#pragma unroll
        for (int e = 0; e < kVector; ++e) {
          if constexpr (kMode == kPoolMax) {
            max_step(to_float(values[e]), best[g][e], equal[g][e]);
          } else {
            total[g][e] += to_float(values[e]);
          }
        }
      }
    }
    const float count = kMode == kPoolAvg ? static_cast<float>(real > 0 ? real : 1) : 1.0f;
#pragma unroll
    for (int g = 0; g < kPoolBatch; ++g) {
      if (g >= group) break;
      const size_t out = (static_cast<size_t>(b0 + g) * nout + n) * channels + c;
      T pooled[kVector];
      if constexpr (kMode == kPoolMax) {
        unsigned char tied[kVector];
#pragma unroll
        for (int e = 0; e < kVector; ++e) {
          pooled[e] = from_float<T>(real > 0 ? best[g][e] : 0.0f);
          tied[e] = static_cast<unsigned char>(equal[g][e]);
        }
        store_vector(ties + out, tied);
      } else {
#pragma unroll
        for (int e = 0; e < kVector; ++e) pooled[e] = from_float<T>(total[g][e] / count);
      }
      store_vector(y + out, pooled);
    }
  }
}

// The channels-last gradient: dx[b, m, c] as knn_pool_backward defines it, with gy, y and
// ties [B, Nout, C], x and dx [B, Nin, C]. One thread per (input node m, run of kVector
// channels), channels fastest, and kPoolBatch batch elements: each pair reading m is one
// coalesced vector read of gy (and of y and ties for max) per run and batch element.
template <typename T, int kMode, int kVector>
__global__ void knn_pool_backward_channels_last(
    const T* __restrict__ gy, const T* __restrict__ x, const T* __restrict__ y,
    const unsigned char* __restrict__ ties, const float* __restrict__ scale,
    const int* __restrict__ pair_start, const int* __restrict__ pair_node, T* __restrict__ dx,
    int batch, int channels, int nin, int nout) {
  const int runs = channels / kVector;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= nin * runs) return;  // the host keeps Nin * C within an int
  const int m = i / runs;
  const int c = (i - m * runs) * kVector;
  const int first = pair_start[m], last = pair_start[m + 1];
  const size_t in_image = static_cast<size_t>(nin) * channels;
  const size_t out_image = static_cast<size_t>(nout) * channels;
  for (int b0 = blockIdx.y * kPoolBatch; b0 < batch; b0 += gridDim.y * kPoolBatch) {
    const int group = min(kPoolBatch, batch - b0);
    const size_t in = (static_cast<size_t>(b0) * nin + m) * channels + c;
    const size_t outs = static_cast<size_t>(b0) * out_image + c;
    T own[kPoolBatch][kVector];
    float total[kPoolBatch][kVector];
#pragma unroll
    for (int g = 0; g < kPoolBatch; ++g) {
      if constexpr (kMode == kPoolMax) {
        if (g < group) load_vector(x + in + g * in_image, own[g]);
      }
#pragma unroll
      for (int e = 0; e < kVector; ++e) total[g][e] = 0.0f;
    }
    for (int j = first; j < last; ++j) {
      const int n = pair_node[j];
      const float share = kMode == kPoolAvg ? scale[n] : 1.0f;
#pragma unroll
      for (int g = 0; g < kPoolBatch; ++g) {
        if (g >= group) break;
        const size_t at = outs + g * out_image + static_cast<size_t>(n) * channels;
        T grads[kVector];
        load_vector(gy + at, grads);
        if constexpr (kMode == kPoolMax) {
          T pooled[kVector];
          unsigned char tied[kVector];
          load_vector(y + at, pooled);
          load_vector(ties + at, tied);
#pragma unroll
          for (int e = 0; e < kVector; ++e) {
            if (tied[e] > 0 && to_float(own[g][e]) == to_float(pooled[e])) {
              total[g][e] += to_float(grads[e]) / static_cast<float>(tied[e]);
            }
          }
        } else {
#pragma unroll
          for (int e = 0; e < kVector; ++e) total[g][e] += to_float(grads[e]) * share;
        }
      }
    }
#pragma unroll
    for (int g = 0; g < kPoolBatch; ++g) {
      if (g >= group) break;
      T grad[kVector];
#pragma unroll
      for (int e = 0; e < kVector; ++e) grad[e] = from_float<T>(total[g][e]);
      store_vector(dx + in + g * in_image, grad);
    }
  }
}

// The depthwise gathers: each thread sums kDepthwiseRows batch elements of one channel, so
// every table entry and weight it loads serves that many outputs (a thread per row loaded
// both once per output). Row groups g = (batch group) * C + c are walked with a grid-stride
// loop over gridDim.y; batch group b0 = (g / C) * kDepthwiseRows.
constexpr int kDepthwiseRows = 4;

__device__ __forceinline__ int depthwise_row_groups(int batch, int channels) {
  return channels * ((batch + kDepthwiseRows - 1) / kDepthwiseRows);
}

// Row group g: its channel c, its first batch element b0 and how many it has (the batch's
// last group may be partial).
struct DepthwiseRows {
  int c, b0, count;
  __device__ __forceinline__ DepthwiseRows(int g, int channels, int batch)
      : c(g % channels),
        b0((g / channels) * kDepthwiseRows),
        count(min(kDepthwiseRows, batch - (g / channels) * kDepthwiseRows)) {}
  // Where element (b0, c, 0) of a contiguous [B, C, n] tensor is.
  __device__ __forceinline__ size_t offset(int channels, int n) const {
    return (static_cast<size_t>(b0) * channels + c) * n;
  }
};

// out[i * stride] = total[i] for the group's rows.
template <typename T>
__device__ __forceinline__ void store_depthwise_rows(T* out, size_t stride,
                                                     const float (&total)[kDepthwiseRows],
                                                     int count) {
#pragma unroll
  for (int i = 0; i < kDepthwiseRows; ++i) {
    if (i < count) out[i * stride] = from_float<T>(total[i]);
  }
}

// y[b, c, n] = bias[c] + sum over the real neighbours k of x[b, c, knn[k, n]] * w[c, cells[k, n]].
template <typename T>
__global__ void knn_depthwise_forward(const T* __restrict__ x, const T* __restrict__ w,
                                      const T* __restrict__ bias, const int* __restrict__ knn,
                                      const int* __restrict__ cells, T* __restrict__ y,
                                      int batch, int channels, int nin, int nout, int k, int v) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= nout) return;
  const int groups = depthwise_row_groups(batch, channels);
  const size_t x_stride = static_cast<size_t>(channels) * nin;
  const size_t y_stride = static_cast<size_t>(channels) * nout;
  for (int g = blockIdx.y; g < groups; g += gridDim.y) {
    const DepthwiseRows rows(g, channels, batch);
    const T* x_rows = x + rows.offset(channels, nin);
    float total[kDepthwiseRows];
    const float start = bias == nullptr ? 0.0f : to_float(bias[rows.c]);
#pragma unroll
    for (int i = 0; i < kDepthwiseRows; ++i) total[i] = start;
    for (int s = 0; s < k; ++s) {
      const int m = knn[s * nout + n];
      if (m == nin) continue;
      const float weight = to_float(w[rows.c * v + cells[s * nout + n]]);
#pragma unroll
      for (int i = 0; i < kDepthwiseRows; ++i) {
        if (i < rows.count) total[i] += to_float(x_rows[i * x_stride + m]) * weight;
      }
    }
    store_depthwise_rows(y + rows.offset(channels, nout) + n, y_stride, total, rows.count);
  }
}

// dx[b, c, m] = sum over the (node n, cell u) pairs reading m of gy[b, c, n] * w[c, u].
template <typename T, typename TGrad>
__global__ void knn_depthwise_grad_input(const T* __restrict__ gy, const T* __restrict__ w,
                                         const int* __restrict__ pair_start,
                                         const int* __restrict__ pair_node,
                                         const int* __restrict__ pair_cell,
                                         TGrad* __restrict__ dx, int batch, int channels, int nin,
                                         int nout, int v) {
  const int m = blockIdx.x * blockDim.x + threadIdx.x;
  if (m >= nin) return;
  const int first = pair_start[m], last = pair_start[m + 1];
  const int groups = depthwise_row_groups(batch, channels);
  const size_t gy_stride = static_cast<size_t>(channels) * nout;
  const size_t dx_stride = static_cast<size_t>(channels) * nin;
  for (int g = blockIdx.y; g < groups; g += gridDim.y) {
    const DepthwiseRows rows(g, channels, batch);
    const T* gy_rows = gy + rows.offset(channels, nout);
    float total[kDepthwiseRows] = {};
    for (int j = first; j < last; ++j) {
      const int n = pair_node[j];
      const float weight = to_float(w[rows.c * v + pair_cell[j]]);
#pragma unroll
      for (int i = 0; i < kDepthwiseRows; ++i) {
        if (i < rows.count) total[i] += to_float(gy_rows[i * gy_stride + n]) * weight;
      }
    }
    store_depthwise_rows(dx + rows.offset(channels, nin) + m, dx_stride, total, rows.count);
  }
}

// dw[c, u] += sum over the block's nodes n, their real slots k in cell u and every b of
// x[b, c, knn[k, n]] * gy[b, c, n]: one thread per (node, slot) sums over the batch in a
// register, then adds into a shared per-cell sum (V floats), and the block adds those with
// one fp32 atomic per cell. Nodes run fastest across threads: a warp reads one slot of
// consecutive nodes, so its table, gy and (neighbouring nodes having nearby neighbours) x
// loads coalesce. Grid: (node chunks, channels); dw must be zeroed.
template <typename T>
__global__ void knn_depthwise_grad_weight(const T* __restrict__ x, const T* __restrict__ gy,
                                          const int* __restrict__ knn,
                                          const int* __restrict__ cells, float* __restrict__ dw,
                                          int batch, int channels, int nin, int nout, int k,
                                          int v, int nodes_per_block) {
  extern __shared__ float cell_sums[];
  for (int u = threadIdx.x; u < v; u += blockDim.x) cell_sums[u] = 0.0f;
  __syncthreads();
  const int c = blockIdx.y;
  const int first = blockIdx.x * nodes_per_block;
  const int nodes = min(nodes_per_block, nout - first);
  const size_t x_stride = static_cast<size_t>(channels) * nin;
  const size_t gy_stride = static_cast<size_t>(channels) * nout;
  for (int e = threadIdx.x; e < nodes * k; e += blockDim.x) {
    const int n = first + e % nodes, s = e / nodes;
    const int m = knn[s * nout + n];
    if (m == nin) continue;
    const T* x_at = x + static_cast<size_t>(c) * nin + m;
    const T* gy_at = gy + static_cast<size_t>(c) * nout + n;
    float total = 0.0f;
#pragma unroll 4
    for (int b = 0; b < batch; ++b) {
      total += to_float(x_at[b * x_stride]) * to_float(gy_at[b * gy_stride]);
    }
    atomicAdd(cell_sums + cells[s * nout + n], total);
  }
  __syncthreads();
  for (int u = threadIdx.x; u < v; u += blockDim.x) {
    if (cell_sums[u] != 0.0f) atomicAdd(dw + c * v + u, cell_sums[u]);
  }
}

}  // namespace knnconv
