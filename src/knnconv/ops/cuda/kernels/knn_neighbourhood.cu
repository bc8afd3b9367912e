// Per-channel neighbourhood kernels: KNN pooling and depthwise KNN convolution.
//
// Row layouts: x [rows, Nin] and y [rows, Nout] with rows = B*C (channel c = row % C), the
// storage of a contiguous [B, C, N] tensor. Channels-last layouts (the *_channels_last pooling
// kernels): x [B, Nin, C] and y [B, Nout, C], the storage a [B, C, N] tensor has when it is
// the transposed view of a [B, N, C] buffer, as knnconv's convolution returns it.
// knn [K, Nout] int32 (Nin marks a padding neighbour); cells [K, Nout] int32, the kernel cell
// of each slot; the reversed graph (pair_start [Nin + 1], pair_node / pair_cell [pairs]) lists
// the real (output node, cell) pairs that read each input node (a pooling's "cell" is the
// slot itself, which a max's choice code names), so every gradient with respect to x is a
// gather: atomic-free and deterministic. Rows (or, channels-last, batch
// elements) are walked with a grid-stride loop over gridDim.y (B*C may exceed its 65535
// limit); accumulation is in fp32.
#include "knn_common.cuh"

namespace knnconv {

// kPoolMaxRelu: the max of ReLU(x), which is ReLU of the max: the max, then outputs of at most
// 0 set to 0 with no gradient (ReLU's is 0 there), so max's backward serves it.
enum PoolMode { kPoolMax = 0, kPoolAvg = 1, kPoolSum = 2, kPoolMaxRelu = 3 };

// The reduction a pooling mode computes (max for kPoolMaxRelu), and whether ReLU follows it.
template <int kMode>
constexpr int kReduction = kMode == kPoolMaxRelu ? kPoolMax : kMode;
template <int kMode>
constexpr bool kThenRelu = kMode == kPoolMaxRelu;

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

// A max window's choice: one byte per output that tells its backward where the gradient
// goes, so that the backward reads neither x nor y where the max is one neighbour's (it used
// to compare x with y at every pair, which more than doubled the bytes it moved):
//   code < kChoiceTied: the only real neighbour slot holding the max;
//   kChoiceTied: no gradient (no real neighbour, a NaN max, or max_relu's output of at most 0);
//   kChoiceTied + t, t >= 2: t real neighbour slots tie for the max; the backward finds them
//   by comparing x with y and sends each gy / t, like torch.amax.
// The host refuses max windows of K > 127 (t and the slot must fit under the flag).
constexpr unsigned kChoiceTied = 0x80;

__device__ __forceinline__ unsigned char choice_code(int ties, int slot) {
  return static_cast<unsigned char>(ties == 1 ? slot : kChoiceTied + ties);
}

// One step of a max over a window at slot s: best, its tie count and the last slot holding
// the running max (the only one when ties ends at 1), with NaN absorbing. Once best is NaN
// every comparison is false, so it stays NaN with 0 ties: no gradient.
__device__ __forceinline__ void max_step(float value, int s, float& best, int& ties,
                                         int& slot) {
  if (value > best) {
    best = value;
    ties = 1;
  } else if (value == best) {
    ++ties;
  } else if (value != value) {
    best = value;
    ties = 0;
  }
  if (value == best) slot = s;
}

// y[r, n] = max / mean / sum of x[r, knn[k, n]] over the real neighbours k of n (0 when there
// is none; kPoolMaxRelu: see PoolMode); for max also choices[r, n], the window's choice code
// (choice_code).
template <typename T, int kMode>
__global__ void knn_pool_forward(const T* __restrict__ x, const int* __restrict__ knn,
                                 T* __restrict__ y, unsigned char* __restrict__ choices,
                                 int rows, int nin, int nout, int k) {
  const int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= nout) return;
  for (int r = blockIdx.y; r < rows; r += gridDim.y) {
    const T* row = x + static_cast<size_t>(r) * nin;
    float best = __int_as_float(0xff800000), total = 0.0f;  // -inf
    int real = 0, equal = 0, slot = 0;
    for (int s = 0; s < k; ++s) {
      const int m = knn[s * nout + n];
      if (m == nin) continue;
      const float v = to_float(row[m]);
      ++real;
      if constexpr (kReduction<kMode> == kPoolMax) {
        max_step(v, s, best, equal, slot);
      } else {
        total += v;
      }
    }
    float out;
    if constexpr (kReduction<kMode> == kPoolMax) {
      out = real > 0 ? best : 0.0f;
      if (kThenRelu<kMode> && out <= 0.0f) {  // NaN compares false: it stays
        out = 0.0f;
        equal = 0;
      }
      choices[static_cast<size_t>(r) * nout + n] = choice_code(equal, slot);
    } else {
      out = kMode == kPoolAvg ? total / static_cast<float>(real > 0 ? real : 1) : total;
    }
    y[static_cast<size_t>(r) * nout + n] = from_float<T>(out);
  }
}

// What a window whose maxima tie (code = kChoiceTied + t, code > kChoiceTied) sends the input
// read at one of its slots: gy / t where that input, *own, is the max, *pooled, else 0. The
// only place a max's backward reads x and y. __fdividef is within 2 ulp of float.
template <typename T>
__device__ __forceinline__ float tied_share(unsigned code, float gradient, const T* own,
                                            const T* pooled) {
  return to_float(__ldg(own)) == to_float(__ldg(pooled))
             ? __fdividef(gradient, static_cast<float>(code - kChoiceTied))
             : 0.0f;
}

// dx[r, m] = sum over the pairs (n, slot) reading m of gy[r, n] * share, share = 1 (sum),
// 1/count[n] (avg, as scale[n]) or, for max, what choices[r, n] sends to the slot: 1 where it
// is the slot, 1/t where t slots tie and x[r, m] is the max y[r, n], 0 otherwise.
template <typename T, int kMode>
__global__ void knn_pool_backward(const T* __restrict__ gy, const T* __restrict__ x,
                                  const T* __restrict__ y,
                                  const unsigned char* __restrict__ choices,
                                  const float* __restrict__ scale,
                                  const int* __restrict__ pair_start,
                                  const int* __restrict__ pair_node,
                                  const int* __restrict__ pair_slot, T* __restrict__ dx,
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
        const unsigned code = choices[out_row + n];
        if (code == static_cast<unsigned>(pair_slot[j])) {
          total += to_float(gy[out_row + n]);
        } else if (code > kChoiceTied) {
          total += tied_share(code, to_float(gy[out_row + n]),
                              x + static_cast<size_t>(r) * nin + m, y + out_row + n);
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

// Two half-width elements in one 32-bit register, with packed max, compare and fma: the
// channels-last max pooling of half and bfloat16 steps two channels per instruction. (Those
// kernels issued an instruction per channel per step and were bound by issue, not by memory:
// ncu showed 85% SM and 13% memory throughput on fovi's AlexNet pooling.)
template <typename T>
struct PackedPair {
  static constexpr bool kExists = false;
};
template <>
struct PackedPair<__half> {
  static constexpr bool kExists = true;
  using type = __half2;
};
template <>
struct PackedPair<__nv_bfloat16> {
  static constexpr bool kExists = true;
  using type = __nv_bfloat162;
};

__device__ __forceinline__ __half2 pair_of(__half value) { return __half2half2(value); }
__device__ __forceinline__ __nv_bfloat162 pair_of(__nv_bfloat16 value) {
  return __bfloat162bfloat162(value);
}
__device__ __forceinline__ float2 to_float2(__half2 pair) { return __half22float2(pair); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 pair) {
  return __bfloat1622float2(pair);
}

// kPairs packed pairs (2 * kPairs consecutive elements) from an address aligned to their
// size, in one load.
template <int kPairs, typename Pair>
__device__ __forceinline__ void load_pairs(const void* at, Pair (&pairs)[kPairs]) {
  using Word = typename VectorWord<4 * kPairs>::type;
  const Word word = __ldg(reinterpret_cast<const Word*>(at));
  const Pair* packed = reinterpret_cast<const Pair*>(&word);
#pragma unroll
  for (int p = 0; p < kPairs; ++p) pairs[p] = packed[p];
}

// max_step on a packed pair at slot s: the tie count is kept in T, exact for the at most 127
// neighbours the host allows; the slot in each 16-bit half of `slots` (s_pair: s in both
// halves), set where the value equals the running max, as max_step sets it. NaN absorbs as
// in max_step: a NaN value or best makes the next best NaN, which equals nothing, so ties = 0.
template <typename Pair>
__device__ __forceinline__ void max_step_pair(Pair value, unsigned s_pair, Pair& best,
                                              Pair& ties, unsigned& slots) {
  const Pair next = __hmax2_nan(best, value);
  const unsigned at_max = __heq2_mask(value, next);
  ties = __hfma2(ties, __heq2(best, next), __heq2(value, next));
  slots = (slots & ~at_max) | (s_pair & at_max);
  best = next;
}

// One thread's running reduction over a window, for one batch element and kVector channels:
// start, add each real neighbour's channel run (at its slot s), store y (and for max the
// choice codes) with `real` the number of real neighbours (0: y = 0, no gradient).
template <typename T, int kMode, int kVector,
          bool kPacked = kMode == kPoolMax && PackedPair<T>::kExists && kVector % 2 == 0>
struct PoolWindow;

// Max on packed pairs.
template <typename T, int kVector>
struct PoolWindow<T, kPoolMax, kVector, true> {
  using Pair = typename PackedPair<T>::type;
  static constexpr int kPairs = kVector / 2;
  Pair best[kPairs], ties[kPairs];
  unsigned slots[kPairs];

  __device__ __forceinline__ void start() {
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
      best[p] = pair_of(from_float<T>(__int_as_float(0xff800000)));  // -inf
      ties[p] = pair_of(from_float<T>(0.0f));
      slots[p] = 0;
    }
  }
  __device__ __forceinline__ void add(const T* at, int s) {
    Pair values[kPairs];
    load_pairs(at, values);
    const unsigned s_pair = static_cast<unsigned>(s) * 0x10001u;
#pragma unroll
    for (int p = 0; p < kPairs; ++p) max_step_pair(values[p], s_pair, best[p], ties[p], slots[p]);
  }
  __device__ __forceinline__ void store(T* y_at, unsigned char* choices_at, int real,
                                        bool relu) const {
    const T* bests = reinterpret_cast<const T*>(best);
    const T* counts = reinterpret_cast<const T*>(ties);
    T pooled[kVector];
    unsigned char codes[kVector];
#pragma unroll
    for (int e = 0; e < kVector; ++e) {
      const bool zero = real == 0 || (relu && to_float(bests[e]) <= 0.0f);  // NaN stays
      pooled[e] = zero ? from_float<T>(0.0f) : bests[e];
      const int slot = (slots[e / 2] >> (16 * (e % 2))) & 0xffff;
      codes[e] = choice_code(zero ? 0 : static_cast<int>(to_float(counts[e])), slot);
    }
    store_vector(y_at, pooled);
    store_vector(choices_at, codes);
  }
};

// Max element by element (float, or a single channel per run).
template <typename T, int kVector>
struct PoolWindow<T, kPoolMax, kVector, false> {
  float best[kVector];
  int ties[kVector], slots[kVector];

  __device__ __forceinline__ void start() {
#pragma unroll
    for (int e = 0; e < kVector; ++e) {
      best[e] = __int_as_float(0xff800000);  // -inf
      ties[e] = slots[e] = 0;
    }
  }
  __device__ __forceinline__ void add(const T* at, int s) {
    T values[kVector];
    load_vector(at, values);
#pragma unroll
    for (int e = 0; e < kVector; ++e) max_step(to_float(values[e]), s, best[e], ties[e], slots[e]);
  }
  __device__ __forceinline__ void store(T* y_at, unsigned char* choices_at, int real,
                                        bool relu) const {
    T pooled[kVector];
    unsigned char codes[kVector];
#pragma unroll
    for (int e = 0; e < kVector; ++e) {
      const bool zero = real == 0 || (relu && best[e] <= 0.0f);  // NaN stays
      pooled[e] = from_float<T>(zero ? 0.0f : best[e]);
      codes[e] = choice_code(zero ? 0 : ties[e], slots[e]);
    }
    store_vector(y_at, pooled);
    store_vector(choices_at, codes);
  }
};

// Sum and average, in float.
template <typename T, int kMode, int kVector>
struct PoolWindow<T, kMode, kVector, false> {
  float total[kVector];

  __device__ __forceinline__ void start() {
#pragma unroll
    for (int e = 0; e < kVector; ++e) total[e] = 0.0f;
  }
  __device__ __forceinline__ void add(const T* at, int) {
    T values[kVector];
    load_vector(at, values);
#pragma unroll
    for (int e = 0; e < kVector; ++e) total[e] += to_float(values[e]);
  }
  __device__ __forceinline__ void store(T* y_at, unsigned char*, int real, bool) const {
    const float count = kMode == kPoolAvg ? static_cast<float>(real > 0 ? real : 1) : 1.0f;
    T pooled[kVector];
#pragma unroll
    for (int e = 0; e < kVector; ++e) pooled[e] = from_float<T>(total[e] / count);
    store_vector(y_at, pooled);
  }
};

// The channels-last pooling: y[b, n, c] (and for max choices[b, n, c]) as knn_pool_forward
// defines them, on x [B, Nin, C]. One thread per (node n, run of kVector channels), channels
// fastest, and kBatch batch elements, batch groups over gridDim.y: the threads serving one
// node read each neighbour's channel run as consecutive vectors of one row of x, so every
// gather is coalesced, and every table entry a thread loads serves its kBatch elements, whose
// loads are independent. C is a multiple of kVector and x, y aligned to kVector elements (the
// host picks kVector so, and kBatch: POOL_BATCH in neighbourhood.py). Offsets within an image
// are ints: the host keeps Nin * C and Nout * C within one.
template <typename T, int kMode, int kVector, int kBatch>
__global__ void knn_pool_forward_channels_last(const T* __restrict__ x,
                                               const int* __restrict__ knn, T* __restrict__ y,
                                               unsigned char* __restrict__ choices, int batch,
                                               int channels, int nin, int nout, int k) {
  const int runs = channels / kVector;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= nout * runs) return;
  const int n = i / runs;
  const int c = (i - n * runs) * kVector;
  const size_t in_image = static_cast<size_t>(nin) * channels;
  const size_t out_image = static_cast<size_t>(nout) * channels;
  for (int b0 = blockIdx.y * kBatch; b0 < batch; b0 += gridDim.y * kBatch) {
    const int group = min(kBatch, batch - b0);
    const T* images = x + static_cast<size_t>(b0) * in_image + c;
    PoolWindow<T, kReduction<kMode>, kVector> windows[kBatch];
#pragma unroll
    for (int g = 0; g < kBatch; ++g) windows[g].start();
    int real = 0;
    for (int s = 0; s < k; ++s) {
      const int m = knn[s * nout + n];
      if (m == nin) continue;
      ++real;
      const int row = m * channels;
#pragma unroll
      for (int g = 0; g < kBatch; ++g) {
        if (g < group) windows[g].add(images + g * in_image + row, s);
      }
    }
    const size_t out = static_cast<size_t>(b0) * out_image + n * channels + c;
#pragma unroll
    for (int g = 0; g < kBatch; ++g) {
      if (g < group) {
        windows[g].store(y + out + g * out_image, choices + out + g * out_image, real,
                         kThenRelu<kMode>);
      }
    }
  }
}

// The float sums of a thread's gradient over kVector channels, stored as dx.
template <typename T, int kVector>
struct GradientSums {
  float total[kVector];

  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int e = 0; e < kVector; ++e) total[e] = 0.0f;
  }
  __device__ __forceinline__ void store(T* dx_at) const {
    T grad[kVector];
#pragma unroll
    for (int e = 0; e < kVector; ++e) grad[e] = from_float<T>(total[e]);
    store_vector(dx_at, grad);
  }
};

// One thread's gradient of one batch element's x over kVector channels: start (for max,
// where its own x lies), add the gradient each pair (output node, slot) reading it sends
// (share: 1, or avg's 1/count), store dx. For max what the node's choice codes send to the
// slot: its gradient where the code is the slot, a tie share where the code counts ties and
// x is the max (the only case that reads x and y), nothing elsewhere.
template <typename T, int kMode, int kVector,
          bool kPacked = kMode == kPoolMax && PackedPair<T>::kExists && kVector % 2 == 0>
struct PoolGradient : GradientSums<T, kVector> {
  using GradientSums<T, kVector>::total;
  const T* own = nullptr;

  __device__ __forceinline__ void start(const T* x_at) {
    own = x_at;
    this->clear();
  }
  __device__ __forceinline__ void add(const T* gy_at, const T* y_at,
                                      const unsigned char* choices_at, float share, int slot) {
    T grads[kVector];
    load_vector(gy_at, grads);
    if constexpr (kMode == kPoolMax) {
      unsigned char codes[kVector];
      load_vector(choices_at, codes);
#pragma unroll
      for (int e = 0; e < kVector; ++e) {
        if (codes[e] == slot) {
          total[e] += to_float(grads[e]);
        } else if (codes[e] > kChoiceTied) {
          total[e] += tied_share(codes[e], to_float(grads[e]), own + e, y_at + e);
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < kVector; ++e) total[e] += to_float(grads[e]) * share;
    }
  }
};

// kVector choice codes (bytes) as 32-bit words, four codes a word, from an address aligned to
// their size in one load; a run of two fills the low half of one word.
template <int kVector>
__device__ __forceinline__ void load_codes(const unsigned char* at,
                                           unsigned (&words)[(kVector + 3) / 4]) {
  if constexpr (kVector >= 4) {
    const VectorOf<unsigned char, kVector> word =
        __ldg(reinterpret_cast<const VectorOf<unsigned char, kVector>*>(at));
    const unsigned* packed = reinterpret_cast<const unsigned*>(&word);
#pragma unroll
    for (int w = 0; w < kVector / 4; ++w) words[w] = packed[w];
  } else {
    words[0] = __ldg(reinterpret_cast<const VectorOf<unsigned char, kVector>*>(at));
  }
}

// Max on packed pairs: four codes are compared with the slot in one instruction, each match
// widened to a 16-bit mask of its channel's gradient bits, and the gradient masked to +0
// elsewhere (a product with 0 would turn an infinite or NaN gradient some other input
// receives into NaN here). Tied codes, rare, take the element-wise path.
template <typename T, int kVector>
struct PoolGradient<T, kPoolMax, kVector, true> : GradientSums<T, kVector> {
  using GradientSums<T, kVector>::total;
  using Pair = typename PackedPair<T>::type;
  static constexpr int kPairs = kVector / 2;
  static constexpr int kWords = (kVector + 3) / 4;
  const T* own = nullptr;

  __device__ __forceinline__ void start(const T* x_at) {
    own = x_at;
    this->clear();
  }
  __device__ __forceinline__ void add(const T* gy_at, const T* y_at,
                                      const unsigned char* choices_at, float, int slot) {
    unsigned grads[kPairs], words[kWords], matches[kWords];
    load_pairs(gy_at, grads);
    load_codes<kVector>(choices_at, words);
    const unsigned slot4 = static_cast<unsigned>(slot) * 0x01010101u;
    unsigned tied = 0;
#pragma unroll
    for (int w = 0; w < kWords; ++w) {
      matches[w] = __vcmpeq4(words[w], slot4);
      tied |= __vcmpgtu4(words[w], kChoiceTied * 0x01010101u);
    }
#pragma unroll
    for (int p = 0; p < kPairs; ++p) {
      const unsigned mask = __byte_perm(matches[p / 2], 0, p % 2 ? 0x3322 : 0x1100);
      const unsigned bits = grads[p] & mask;
      const float2 sent = to_float2(*reinterpret_cast<const Pair*>(&bits));
      total[2 * p] += sent.x;
      total[2 * p + 1] += sent.y;
    }
    if (tied) {
      const unsigned char* codes = reinterpret_cast<const unsigned char*>(words);
      const T* gradients = reinterpret_cast<const T*>(grads);
#pragma unroll
      for (int e = 0; e < kVector; ++e) {
        if (codes[e] > kChoiceTied) {
          total[e] += tied_share(codes[e], to_float(gradients[e]), own + e, y_at + e);
        }
      }
    }
  }
};

// The channels-last gradient: dx[b, m, c] as knn_pool_backward defines it, with gy, y and
// choices [B, Nout, C], x and dx [B, Nin, C]. One thread per (input node m, run of kVector
// channels), channels fastest, and kBatch batch elements: each pair reading m is one
// coalesced vector read of gy (and of the choice codes for max) per run and batch element.
template <typename T, int kMode, int kVector, int kBatch>
__global__ void knn_pool_backward_channels_last(
    const T* __restrict__ gy, const T* __restrict__ x, const T* __restrict__ y,
    const unsigned char* __restrict__ choices, const float* __restrict__ scale,
    const int* __restrict__ pair_start, const int* __restrict__ pair_node,
    const int* __restrict__ pair_slot, T* __restrict__ dx, int batch, int channels, int nin,
    int nout) {
  const int runs = channels / kVector;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= nin * runs) return;  // the host keeps Nin * C within an int
  const int m = i / runs;
  const int c = (i - m * runs) * kVector;
  const int first = pair_start[m], last = pair_start[m + 1];
  const size_t in_image = static_cast<size_t>(nin) * channels;
  const size_t out_image = static_cast<size_t>(nout) * channels;
  for (int b0 = blockIdx.y * kBatch; b0 < batch; b0 += gridDim.y * kBatch) {
    const int group = min(kBatch, batch - b0);
    const size_t in = static_cast<size_t>(b0) * in_image + m * channels + c;
    const size_t outs = static_cast<size_t>(b0) * out_image + c;
    PoolGradient<T, kMode, kVector> gradients[kBatch];
#pragma unroll
    for (int g = 0; g < kBatch; ++g) {
      if (g < group) gradients[g].start(x + in + g * in_image);
    }
    for (int j = first; j < last; ++j) {
      const int n = pair_node[j];
      const float share = kMode == kPoolAvg ? scale[n] : 1.0f;
      const int slot = kMode == kPoolMax ? pair_slot[j] : 0;
      const int row = n * channels;
#pragma unroll
      for (int g = 0; g < kBatch; ++g) {
        const size_t at = outs + g * out_image + row;
        if (g < group) gradients[g].add(gy + at, y + at, choices + at, share, slot);
      }
    }
#pragma unroll
    for (int g = 0; g < kBatch; ++g) {
      if (g < group) gradients[g].store(dx + in + g * in_image);
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
