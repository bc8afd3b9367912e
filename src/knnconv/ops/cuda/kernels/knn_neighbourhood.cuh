// Per-channel neighbourhood kernels: KNN pooling and depthwise KNN convolution.
//
// Layouts: x [rows, Nin] and y [rows, Nout] with rows = B*C (channel c = row % C);
// knn [K, Nout] int32 (Nin marks a padding neighbour); cells [K, Nout] int32, the kernel cell
// of each slot; the reversed graph (pair_start [Nin + 1], pair_node / pair_cell [pairs]) lists
// the real (output node, cell) pairs that read each input node, so every gradient with
// respect to x is a gather: atomic-free and deterministic. Rows are walked with a grid-stride
// loop over gridDim.y (B*C may exceed its 65535 limit); accumulation is in fp32.
#pragma once

namespace knnconv {

enum PoolMode { kPoolMax = 0, kPoolAvg = 1, kPoolSum = 2 };

// y[r, n] = max / mean / sum of x[r, knn[k, n]] over the real neighbours k of n (0 when there
// is none); for max also ties[r, n] = how many real neighbours equal the max (0 when the
// output is NaN or has no real neighbour), so the backward can share the gradient between
// tied maxima like torch.amax.
template <typename T, int kMode>
__global__ void knn_pool_forward(const T* __restrict__ x, const int* __restrict__ knn,
                                 T* __restrict__ y, int* __restrict__ ties, int rows, int nin,
                                 int nout, int k) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= nout) return;
  for (int r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* row = x + static_cast<size_t>(r) * nin;
    float best = __int_as_float(0xff800000), total = 0.0f;  // -inf
    int real = 0, equal = 0;
    bool nan_seen = false;
    for (int s = 0; s < k; ++s) {
      const int m = knn[s * nout + n];
      if (m == nin) continue;
      const float v = to_float(row[m]);
      ++real;
      if (kMode == kPoolMax) {
        if (v != v) {
          nan_seen = true;
        } else if (v > best) {
          best = v;
          equal = 1;
        } else if (v == best) {
          ++equal;
        }
      } else {
        total += v;
      }
    }
    float out;
    if (kMode == kPoolMax) {
      out = nan_seen ? __int_as_float(0x7fffffff) : (real > 0 ? best : 0.0f);
      ties[static_cast<size_t>(r) * nout + n] = (nan_seen || real == 0) ? 0 : equal;
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
                                  const T* __restrict__ y, const int* __restrict__ ties,
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
      if (kMode == kPoolMax) {
        const int tied = ties[out_row + n];
        if (tied > 0 && x[static_cast<size_t>(r) * nin + m] == y[out_row + n]) {
          total += to_float(gy[out_row + n]) / static_cast<float>(tied);
        }
      } else if (kMode == kPoolAvg) {
        total += to_float(gy[out_row + n]) * scale[n];
      } else {
        total += to_float(gy[out_row + n]);
      }
    }
    dx[static_cast<size_t>(r) * nin + m] = from_float<T>(total);
  }
}

// y[r, n] = bias[c] + sum over the real neighbours k of x[r, knn[k, n]] * w[c, cells[k, n]].
template <typename T>
__global__ void knn_depthwise_forward(const T* __restrict__ x, const T* __restrict__ w,
                                      const T* __restrict__ bias, const int* __restrict__ knn,
                                      const int* __restrict__ cells, T* __restrict__ y,
                                      int rows, int channels, int nin, int nout, int k, int v) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= nout) return;
  for (int r = blockIdx.y; r < rows; r += gridDim.y) {
    const int c = r % channels;
    const T* row = x + static_cast<size_t>(r) * nin;
    float total = bias == nullptr ? 0.0f : to_float(bias[c]);
    for (int s = 0; s < k; ++s) {
      const int m = knn[s * nout + n];
      if (m == nin) continue;
      total += to_float(row[m]) * to_float(w[c * v + cells[s * nout + n]]);
    }
    y[static_cast<size_t>(r) * nout + n] = from_float<T>(total);
  }
}

// dx[r, m] = sum over the (node n, cell u) pairs reading m of gy[r, n] * w[c, u].
template <typename T, typename TGrad>
__global__ void knn_depthwise_grad_input(const T* __restrict__ gy, const T* __restrict__ w,
                                         const int* __restrict__ pair_start,
                                         const int* __restrict__ pair_node,
                                         const int* __restrict__ pair_cell,
                                         TGrad* __restrict__ dx, int rows, int channels, int nin,
                                         int nout, int v) {
  const int m = blockIdx.x * blockDim.x + threadIdx.x;
  if (m >= nin) return;
  const int first = pair_start[m], last = pair_start[m + 1];
  for (int r = blockIdx.y; r < rows; r += gridDim.y) {
    const int c = r % channels;
    const size_t out_row = static_cast<size_t>(r) * nout;
    float total = 0.0f;
    for (int j = first; j < last; ++j) {
      total += to_float(gy[out_row + pair_node[j]]) * to_float(w[c * v + pair_cell[j]]);
    }
    dx[static_cast<size_t>(r) * nin + m] = from_float<TGrad>(total);
  }
}

// dw[c, u] += sum over the block's nodes n, their real slots k in cell u and every b of
// x[b, c, knn[k, n]] * gy[b, c, n]: one thread per (node, slot) sums over the batch in a
// register, then adds into a shared per-cell sum (V floats), and the block adds those with
// one fp32 atomic per cell. Grid: (node chunks, channels); dw must be zeroed.
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
    const int n = first + e / k, s = e % k;
    const int m = knn[s * nout + n];
    if (m == nin) continue;
    const T* x_at = x + static_cast<size_t>(c) * nin + m;
    const T* gy_at = gy + static_cast<size_t>(c) * nout + n;
    float total = 0.0f;
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
