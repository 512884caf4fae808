// CUDA kernels for vd::group_norm_silu, with the semantics of csrc/cpu/group_norm_silu.cpp.
//
// Both layouts are read in place (csrc/layout.h):
//   NC*  (contiguous):    a (n, c) row is S contiguous elements, a group is cpg * S contiguous ones;
//                         work is split into chunks handled by one warp each ("rows" kernels).
//   N*C  (channels_last): each spatial position holds C contiguous channels; a block walks a range
//                         of positions with its threads laid over the channels ("cols" kernels).
// Statistics: each lane runs Welford states over a few vectors in float (double for fp64); those
// states are merged with Chan's formula in double, so a group of millions of elements keeps its
// variance even when the mean dwarfs the spread. The mean is handed on as a float pair (hi, lo) and
// x - mean is taken as (x - hi) - lo, which keeps it exact to float rounding where x is close to the
// mean. Partial states are written per chunk and merged in a fixed order: results are deterministic
// (no atomics), and so are the backward's per-channel sums and grad_weight / grad_bias.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <string>
#include <tuple>
#include <type_traits>

#include "../activation.h"
#include "../norm.h"
#include "hopper.h"
#include "launch.h"
#include "wgmma.h"

namespace vd {
namespace {

constexpr const char* kOp = kGroupNormOp;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
// Vectors each lane handles per chunk in the "rows" kernels, and rows each thread walks per block in
// the "cols" kernels: enough work per partial state that the partial buffers stay small.
constexpr int kVecsPerLane = 8;
// The 16-bit and float statistics kernel's chunks: kStatBatches batches of kVecsPerLane vectors a lane (fewer,
// longer warps: the per-chunk Welford merges in double and the launch of each block weigh less).
constexpr int kStatBatches = 4;
// Rows a thread of the 16-bit "cols" statistics kernel loads at a time.
constexpr int kColBatch = 4;
constexpr int kRowsPerThread = 32;

// 16-byte vectors: 8 halves, 4 floats or 2 doubles.
template <typename T>
constexpr int max_vec() {
  return 16 / static_cast<int>(sizeof(T));
}


template <typename T>
struct Welford {
  T mean, m2, n;
};

template <typename T>
__device__ __forceinline__ Welford<T> combine(const Welford<T>& a, const Welford<T>& b) {
  if (b.n == T(0)) return a;
  if (a.n == T(0)) return b;
  const T n = a.n + b.n;
  const T wb = b.n / n;
  const T delta = b.mean - a.mean;
  return {a.mean + delta * wb, a.m2 + b.m2 + delta * delta * a.n * wb, n};
}

// Tree merge across the warp with `merge`; lane 0 ends up with the whole warp's state. The order is
// fixed.
template <typename T, typename Merge>
__device__ __forceinline__ Welford<T> warp_combine(Welford<T> s, Merge merge) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    Welford<T> t{__shfl_down_sync(kFullMask, s.mean, o), __shfl_down_sync(kFullMask, s.m2, o),
                 __shfl_down_sync(kFullMask, s.n, o)};
    s = merge(s, t);
  }
  return s;
}

template <typename T>
__device__ __forceinline__ Welford<T> warp_combine(Welford<T> s) {
  return warp_combine(s, [](const Welford<T>& a, const Welford<T>& b) { return combine(a, b); });
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(kFullMask, v, o);
  return v;
}

// VEC running Welford states that see one value each per push: they share the count, so a push
// costs one division for the whole vector. Float input takes a batch of up to U vectors at a time instead
// (add): the batch's loads are independent, its mean and squared deviations are taken two-pass in registers,
// and one Chan merge a batch joins them (one division a batch for all VEC slots): Welford's precision without
// the push's chain of dependent updates, which held a lane to one load in flight (as it did for 16-bit input).
template <typename T, int VEC>
struct LaneWelford {
  T mean[VEC], m2[VEC];
  int n = 0;
  __device__ LaneWelford() {
#pragma unroll
    for (int j = 0; j < VEC; ++j) mean[j] = m2[j] = T(0);
  }
  __device__ __forceinline__ void push(const T (&v)[VEC]) {
    ++n;
    const T inv = T(1) / T(n);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const T d = v[j] - mean[j];
      mean[j] += d * inv;
      m2[j] += d * (v[j] - mean[j]);
    }
  }
  // The first cnt (1 <= cnt <= U) of raw (T = float).
  template <int U>
  __device__ __forceinline__ void add(const Vec<float, VEC> (&raw)[U], int cnt) {
    const float inv = 1.f / static_cast<float>(cnt);
    const int nn = n + cnt;
    const float wb = static_cast<float>(cnt) / static_cast<float>(nn), wq = static_cast<float>(n) * wb;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float sum = 0.f;
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (k < cnt) sum += raw[k].v[j];
      const float bm = sum * inv;
      float q = 0.f;
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (k < cnt) {
          const float d = raw[k].v[j] - bm;
          q = fmaf(d, d, q);
        }
      const float delta = bm - mean[j];
      mean[j] = fmaf(delta, wb, mean[j]);
      m2[j] += fmaf(delta * delta, wq, q);
    }
    n = nn;
  }
  __device__ __forceinline__ Welford<double> get(int j) const {
    return {static_cast<double>(mean[j]), static_cast<double>(m2[j]), static_cast<double>(n)};
  }
};

// VEC sums of x - pivot and of its square (16-bit input): the statistics kernels' per-thread state where
// loads must stay independent (the Welford push above chains each update on the last). n counts pushes.
template <int VEC>
struct ShiftedSums {
  float piv[VEC], s1[VEC], s2[VEC];
  int n = 0;
  __device__ ShiftedSums() {
#pragma unroll
    for (int j = 0; j < VEC; ++j) piv[j] = s1[j] = s2[j] = 0.f;
  }
  template <typename scalar_t>
  __device__ __forceinline__ void add(const Vec<scalar_t, VEC>& raw) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float d = static_cast<float>(raw.v[j]) - piv[j];
      s1[j] += d;
      s2[j] = fmaf(d, d, s2[j]);
    }
    ++n;
  }
};

template <int VEC, typename scalar_t, typename acc_t>
__device__ __forceinline__ void load_vec(const scalar_t* p, acc_t (&v)[VEC]) {
  const Vec<scalar_t, VEC> raw = *reinterpret_cast<const Vec<scalar_t, VEC>*>(p);
#pragma unroll
  for (int j = 0; j < VEC; ++j) v[j] = static_cast<acc_t>(raw.v[j]);
}

template <int VEC, typename scalar_t, typename acc_t>
__device__ __forceinline__ void store_vec(scalar_t* p, const acc_t (&v)[VEC]) {
  Vec<scalar_t, VEC> raw;
#pragma unroll
  for (int j = 0; j < VEC; ++j) raw.v[j] = static_cast<scalar_t>(v[j]);
  *reinterpret_cast<Vec<scalar_t, VEC>*>(p) = raw;
}

// One warp visits the flat range [lo, hi): fv(i) for each VEC-aligned vector starting at i, fs(i)
// for the single elements before the first and after the last aligned vector. The host only picks
// VEC > 1 when every array involved starts 16-byte aligned, so alignment is a property of i.
template <int VEC, typename FV, typename FS>
__device__ __forceinline__ void warp_visit(int64_t lo, int64_t hi, int lane, FV&& fv, FS&& fs) {
  int64_t a0 = hi, a1 = hi;
  if constexpr (VEC > 1) {
    const int64_t mis = lo % VEC;
    a0 = mis ? lo + (VEC - mis) : lo;
    if (a0 > hi) a0 = hi;
    a1 = a0 + (hi - a0) / VEC * VEC;
  }
  for (int64_t i = lo + lane; i < a0; i += 32) fs(i);
  for (int64_t i = a0 + static_cast<int64_t>(lane) * VEC; i < a1; i += 32 * VEC) fv(i);
  for (int64_t i = a1 + lane; i < hi; i += 32) fs(i);
}

// warp_visit with whole batches first: fb(i) for the lane's U vectors at i + k * 32 * VEC (k < U), where lo is
// aligned, so a kernel can issue all of a batch's loads before it uses any; then the rest as warp_visit.
template <int VEC, int U, typename FB, typename FV, typename FS>
__device__ __forceinline__ void warp_visit_batched(int64_t lo, int64_t hi, int lane, FB&& fb, FV&& fv, FS&& fs) {
  int64_t i0 = lo;
  if (VEC > 1 && lo % VEC == 0) {
    constexpr int64_t kBatch = static_cast<int64_t>(32) * VEC * U;
    for (; i0 + kBatch <= hi; i0 += kBatch) fb(i0 + static_cast<int64_t>(lane) * VEC);
  }
  warp_visit<VEC>(i0, hi, lane, fv, fs);
}

// Channel c's group: a 32-bit division (C < 2^31), an int64 one costs a few dozen instructions a channel.
__device__ __forceinline__ int64_t group_of(int64_t c, int64_t cpg) {
  return static_cast<int64_t>(static_cast<uint32_t>(c) / static_cast<uint32_t>(cpg));
}

// Per (n, c) parameters of z = (x - mean) * (rstd * gamma) + beta; the mean is mean + mean_lo.
template <typename acc_t>
struct ChannelParams {
  acc_t mean, mean_lo, rstd, gamma, beta;
  template <typename A>
  __device__ __forceinline__ ChannelParams(const A& a, int64_t n, int64_t c) {
    const int64_t ng = n * a.G + group_of(c, a.cpg);
    mean = a.mean[ng];
    mean_lo = a.mean_lo[ng];
    rstd = a.rstd[ng];
    gamma = a.w ? static_cast<acc_t>(a.w[c]) : acc_t(1);
    beta = a.b ? static_cast<acc_t>(a.b[c]) : acc_t(0);
  }
};

template <typename acc_t>
__device__ __forceinline__ acc_t centered(acc_t x, acc_t mean, acc_t mean_lo) {
  return (x - mean) - mean_lo;
}

// ---------------------------------------------------------------------------------------------
// Problem description shared by the kernels.
template <typename scalar_t, typename acc_t>
struct GNArgs {
  const scalar_t* x;
  const scalar_t* dy;     // backward only
  scalar_t* out;          // y (forward) or dx (backward)
  const scalar_t* w;      // nullptr: gamma = 1
  const scalar_t* b;      // nullptr: beta = 0
  const acc_t* mean;      // (N * G) mean rounded to acc_t
  const acc_t* mean_lo;   // (N * G) the rest of the mean
  const acc_t* rstd;      // (N * G)
  const acc_t* m1;        // (N * G) backward: group means of dxhat
  const acc_t* m2;        // (N * G) backward: group means of dxhat * xhat
  int64_t N, C, G, S, cpg;
  int64_t F;              // NC*: 1; frames-major: the frames, S is then one frame's H * W
  // "rows" split: items of CH elements; P items per row (or per group for the statistics).
  int64_t CH, P, items;
  // "cols" split: TCV vector columns per block tile, R row lanes, RB positions per block.
  int TCV, R;
  int64_t ctiles, RB;
  bool silu;
  // The second pass (apply, dx) walks its blocks last to first: the first pass (statistics, gradient sums) read
  // x first to last, so its last reads are still in L2 when the second starts.
  bool reverse;
};

// This CTA's block of the grid, counted from the end where a.reverse (the two-pass kernels' second pass).
template <typename A>
__device__ __forceinline__ int64_t pass_block(const A& a) {
  return a.reverse ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
}

// Block decomposition of the "cols" kernels: blockIdx.x -> (n, p, column tile).
struct ColBlock {
  int64_t n, p, ct, cv;  // cv: this thread's vector column
  int rowlane;
  bool active;
  int64_t s0, s1;        // positions [s0, s1) of this block, walked from s0 + rowlane in steps of R
};

template <typename A>
__device__ __forceinline__ ColBlock col_block(const A& a, int vec) {
  ColBlock cb;
  int64_t blk = pass_block(a);
  cb.ct = blk % a.ctiles;
  blk /= a.ctiles;
  cb.p = blk % a.P;
  cb.n = blk / a.P;
  const int tid = threadIdx.x;
  cb.rowlane = tid / a.TCV;
  cb.cv = cb.ct * a.TCV + tid % a.TCV;
  cb.active = cb.rowlane < a.R && cb.cv * vec < a.C;
  cb.s0 = cb.p * a.RB;
  cb.s1 = cb.s0 + a.RB < a.S ? cb.s0 + a.RB : a.S;
  return cb;
}

// ---------------------------------------------------------------------------------------------
// Statistics: partial Welford states, then one merge per (n, g).

// NC*: item w covers chunk p of group ng's cpg * S contiguous elements; frames-major: chunk p of frame f
// of group (n, g), whose cpg * S elements (S = H * W) are contiguous.
template <typename scalar_t, typename acc_t, int VEC>
__global__ void __launch_bounds__(kThreads) stats_rows_kernel(GNArgs<scalar_t, acc_t> a,
                                                              Welford<double>* __restrict__ part) {
  const int lane = threadIdx.x & 31;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (w >= a.items) return;  // uniform per warp
  const int64_t M = a.cpg * a.S;  // a run: a group (NC*) or one frame of a group (frames-major)
  const int64_t run = w / a.P, p = w % a.P;
  const int64_t lo = run * M + p * a.CH;
  const int64_t hi = lo + a.CH < (run + 1) * M ? lo + a.CH : (run + 1) * M;
  Welford<double> single{0.0, 0.0, 0.0};
  auto push_single = [&](int64_t i) {
    single = combine(single, Welford<double>{static_cast<double>(a.x[i]), 0.0, 1.0});
  };
  Welford<double> s;
  if constexpr (sizeof(scalar_t) == 2 && VEC > 1) {
    // 16-bit input: shifted sums of x - pivot (pivot: the chunk's first element, one sample of the
    // group, so the sums stay near the data's spread), a lane's vectors loaded 8 at a time; the
    // Welford push below divides once a vector and chains every update on the last, which held the
    // loads one at a time (the kernel read at 36-38 % of the DRAM rate).
    const float pivot = static_cast<float>(a.x[lo]);
    ShiftedSums<VEC> ss;
#pragma unroll
    for (int j = 0; j < VEC; ++j) ss.piv[j] = pivot;
    // Whole batches of kVecsPerLane vectors a lane (all of a chunk but a run's last), then the rest.
    constexpr int64_t kBatch = 32 * VEC * kVecsPerLane;
    int64_t i0 = lo;
    if (lo % VEC == 0) {
      for (; i0 + kBatch <= hi; i0 += kBatch) {
        Vec<scalar_t, VEC> raw[kVecsPerLane];
#pragma unroll
        for (int k = 0; k < kVecsPerLane; ++k)
          raw[k] = *reinterpret_cast<const Vec<scalar_t, VEC>*>(a.x + i0 + (k * 32 + lane) * VEC);
#pragma unroll
        for (int k = 0; k < kVecsPerLane; ++k) ss.add(raw[k]);
      }
    }
    warp_visit<VEC>(
        i0, hi, lane, [&](int64_t i) { ss.add(*reinterpret_cast<const Vec<scalar_t, VEC>*>(a.x + i)); }, push_single);
    s = single;
    if (ss.n > 0) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const double n = ss.n, d1 = ss.s1[j];
        s = combine(s, Welford<double>{pivot + d1 / n, static_cast<double>(ss.s2[j]) - d1 * d1 / n, n});
      }
    }
  } else if constexpr (std::is_same_v<scalar_t, float> && VEC > 1) {
    // float input: the same batches of loads, merged a batch at a time (LaneWelford::add). Pivoted sums
    // would do at this rate too, but their error grows with the pivot's distance from the mean (a spike as
    // a chunk's first element), which float outputs would carry; the batched merge keeps Welford's bound.
    LaneWelford<float, VEC> bw;
    constexpr int64_t kBatch = 32 * VEC * kVecsPerLane;
    int64_t i0 = lo;
    if (lo % VEC == 0) {
      for (; i0 + kBatch <= hi; i0 += kBatch) {
        Vec<float, VEC> raw[kVecsPerLane];
#pragma unroll
        for (int k = 0; k < kVecsPerLane; ++k)
          raw[k] = *reinterpret_cast<const Vec<float, VEC>*>(a.x + i0 + (k * 32 + lane) * VEC);
        bw.add(raw, kVecsPerLane);
      }
    }
    warp_visit<VEC>(
        i0, hi, lane,
        [&](int64_t i) {
          const Vec<float, VEC> raw[1] = {*reinterpret_cast<const Vec<float, VEC>*>(a.x + i)};
          bw.add(raw, 1);
        },
        push_single);
    s = single;
    if (bw.n > 0) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) s = combine(s, bw.get(j));
    }
  } else {
    LaneWelford<acc_t, VEC> lw;
    warp_visit<VEC>(
        lo, hi, lane,
        [&](int64_t i) {
          acc_t v[VEC];
          load_vec<VEC>(a.x + i, v);
          lw.push(v);
        },
        push_single);
    s = single;
#pragma unroll
    for (int j = 0; j < VEC; ++j) s = combine(s, lw.get(j));
  }
  s = warp_combine(s);
  if (lane == 0) {
    // Runs are in memory order (n, f, g); a group's F * P states go together, frame by frame.
    int64_t slot = w;
    if (a.F > 1) {
      const int64_t g = run % a.G, nf = run / a.G;
      slot = ((nf / a.F * a.G + g) * a.F + nf % a.F) * a.P + p;
    }
    part[slot] = s;
  }
}

// A thread's rows of a "cols" block, kColBatch at a time: f(raw, cnt) for each batch of cnt (1..kColBatch) rows
// first, first + step, ... (< end) of the vector column at base (rows ld elements apart). DEPTH = 0: plain loads
// of each batch, issued only after the last batch is summed; the registers held no more than a batch (64 bytes) a
// thread in flight, 46 KB an SM at three CTAs, while 4.2 TB/s over 132 SMs asks ~32 KB an SM a microsecond of
// latency. DEPTH > 0: each batch copied with cp.async into the thread's own slots of a ring of DEPTH batches in
// shared memory (thread tid's row k of slot b at ring[(b * kColBatch + k) * kThreads + tid]: a warp's copies and
// reads conflict-free), the next DEPTH - 1 batches in flight while one is summed. The thread reads back only its own
// copies: no barrier; a slot is refilled only after the values read from it were used (a data dependence orders it).
template <int DEPTH, typename T, int VEC, typename F>
__device__ __forceinline__ void stats_col_batches(const T* base, int64_t first, int64_t end, int64_t step,
                                                  int64_t ld, uint4* ring, F&& f) {
  using V = Vec<T, VEC>;
  static_assert(sizeof(V) == 16, "16-byte vectors");
  if constexpr (DEPTH == 0) {
    for (int64_t s = first; s < end; s += kColBatch * step) {
      V raw[kColBatch];
      int cnt = 0;
#pragma unroll
      for (int k = 0; k < kColBatch; ++k) {
        const int64_t r = s + k * step;
        if (r < end) {
          raw[k] = *reinterpret_cast<const V*>(base + r * ld);
          ++cnt;
        }
      }
      f(raw, cnt);
    }
  } else {
    if (first >= end) return;
    // Counts in 32 bits: a thread walks at most 1024 rows.
    const int rows = static_cast<int>((end - first + step - 1) / step);
    const int batches = (rows + kColBatch - 1) / kColBatch;
    const int64_t row_step = step * ld;
    const T* next = base + first * ld;
    V* mine = reinterpret_cast<V*>(ring) + threadIdx.x;
    constexpr int kSlot = kColBatch * kThreads;
    // Batch b into slot b % DEPTH; a group committed for every b (empty past the end), so that wait_group's count
    // always means the same batches.
    auto issue = [&](int b) {
      if (b < batches) {
        V* slot = mine + (b % DEPTH) * kSlot;
        const int left = rows - b * kColBatch;
#pragma unroll
        for (int k = 0; k < kColBatch; ++k)
          if (k < left) cp_async16(slot + k * kThreads, next + k * row_step, true);
        next += kColBatch * row_step;
      }
      cp_async_commit();
    };
#pragma unroll
    for (int b = 0; b < DEPTH - 1; ++b) issue(b);
    for (int b = 0; b < batches; ++b) {
      issue(b + DEPTH - 1);
      cp_async_wait<DEPTH - 1>();
      const V* slot = mine + (b % DEPTH) * kSlot;
      const int cnt = rows - b * kColBatch < kColBatch ? rows - b * kColBatch : kColBatch;
      V raw[kColBatch];
#pragma unroll
      for (int k = 0; k < kColBatch; ++k)
        if (k < cnt) raw[k] = slot[k * kThreads];
      f(raw, cnt);
    }
  }
}

// The cols statistics' shared memory a block: DEPTH batches of kColBatch 16-byte rows a thread (the copies' ring),
// which the per-thread states reuse once every thread has summed its rows.
template <typename acc_t, int VEC, int DEPTH>
constexpr size_t stats_cols_smem() {
  const size_t ring = static_cast<size_t>(DEPTH) * kColBatch * kThreads * 16;
  const size_t states = kThreads * VEC * 2 * sizeof(acc_t) + kThreads * sizeof(int);
  return DEPTH == 0 ? 0 : (ring > states ? ring : states);
}

// N*C: one state per (n, g, p, column tile), stored at part[((n * G + g) * P + p) * ctiles + ct]; a group
// outside a tile leaves its slot as the caller zeroed it. DEPTH: stats_col_batches's (> 0: 16-bit and float only,
// stats_cols_smem<acc_t, VEC, DEPTH>() bytes of dynamic shared memory).
template <typename scalar_t, typename acc_t, int VEC, int DEPTH = 0>
__global__ void __launch_bounds__(kThreads, 3) stats_cols_kernel(GNArgs<scalar_t, acc_t> a,
                                                              Welford<double>* __restrict__ part) {
  static_assert(DEPTH == 0 || (VEC > 1 && (sizeof(scalar_t) == 2 || std::is_same_v<scalar_t, float>)),
                "the copies' ring: 16-byte vectors of 16-bit or float input");
  acc_t* sh_mean;
  acc_t* sh_m2;
  int* sh_n;
  uint4* ring = nullptr;
  if constexpr (DEPTH > 0) {
    extern __shared__ uint4 stats_cols_dyn[];
    ring = stats_cols_dyn;
    sh_mean = reinterpret_cast<acc_t*>(stats_cols_dyn);
    sh_m2 = sh_mean + kThreads * VEC;
    sh_n = reinterpret_cast<int*>(sh_m2 + kThreads * VEC);
  } else {
    __shared__ acc_t st_mean[kThreads * VEC];
    __shared__ acc_t st_m2[kThreads * VEC];
    __shared__ int st_n[kThreads];
    sh_mean = st_mean;
    sh_m2 = st_m2;
    sh_n = st_n;
  }
  const ColBlock cb = col_block(a, VEC);
  const int tid = threadIdx.x;
  // Every thread's states are stored after all have summed (with DEPTH > 0 they reuse the ring).
  auto states_after_ring = [&]() {
    if constexpr (DEPTH > 0) __syncthreads();
  };
  if constexpr (sizeof(scalar_t) == 2 && VEC > 1) {
    // 16-bit input: shifted sums about the thread's first row, rows loaded kColBatch at a time (as in
    // stats_rows_kernel; the Welford push held one load in flight). Few enough registers for 3 blocks
    // an SM: at 8 rows (128 registers, 2 blocks) 640-channel frames-major input ran 8 % slower.
    ShiftedSums<VEC> ss;
    if (cb.active && cb.s0 + cb.rowlane < cb.s1) {
      const scalar_t* base = a.x + cb.n * a.S * a.C + cb.cv * VEC;
      const Vec<scalar_t, VEC> first = *reinterpret_cast<const Vec<scalar_t, VEC>*>(base + (cb.s0 + cb.rowlane) * a.C);
#pragma unroll
      for (int j = 0; j < VEC; ++j) ss.piv[j] = static_cast<float>(first.v[j]);
      stats_col_batches<DEPTH, scalar_t, VEC>(base, cb.s0 + cb.rowlane, cb.s1, a.R, a.C, ring,
                                              [&](const Vec<scalar_t, VEC>(&raw)[kColBatch], int cnt) {
#pragma unroll
                                                for (int k = 0; k < kColBatch; ++k) {
                                                  if (k >= cnt) break;
                                                  ss.add(raw[k]);
                                                }
                                              });
    }
    states_after_ring();
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float mean_d = ss.n > 0 ? ss.s1[j] / ss.n : 0.f;
      sh_mean[tid * VEC + j] = ss.piv[j] + mean_d;
      sh_m2[tid * VEC + j] = ss.n > 0 ? fmaxf(ss.s2[j] - ss.s1[j] * mean_d, 0.f) : 0.f;
    }
    sh_n[tid] = ss.n;
  } else if constexpr (std::is_same_v<scalar_t, float> && VEC > 1) {
    // float input: rows loaded kColBatch at a time, merged a batch at a time (LaneWelford::add).
    LaneWelford<float, VEC> bw;
    if (cb.active) {
      const float* base = a.x + cb.n * a.S * a.C + cb.cv * VEC;
      stats_col_batches<DEPTH, float, VEC>(base, cb.s0 + cb.rowlane, cb.s1, a.R, a.C, ring,
                                           [&](const Vec<float, VEC>(&raw)[kColBatch], int cnt) { bw.add(raw, cnt); });
    }
    states_after_ring();
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      sh_mean[tid * VEC + j] = bw.mean[j];
      sh_m2[tid * VEC + j] = bw.m2[j];
    }
    sh_n[tid] = bw.n;
  } else {
    LaneWelford<acc_t, VEC> lw;
    if (cb.active) {
      for (int64_t s = cb.s0 + cb.rowlane; s < cb.s1; s += a.R) {
        acc_t v[VEC];
        load_vec<VEC>(a.x + (cb.n * a.S + s) * a.C + cb.cv * VEC, v);
        lw.push(v);
      }
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      sh_mean[tid * VEC + j] = lw.mean[j];
      sh_m2[tid * VEC + j] = lw.m2[j];
    }
    sh_n[tid] = cb.active ? lw.n : 0;
  }
  __syncthreads();
  // One state per group of the tile: a warp per group merges its channels' row lanes (in a fixed order),
  // so the block writes G states, not C (per-channel states were 12 / RB of the bytes read, and their
  // merge, K = cpg * P states a group, ran a tenth of the whole op at 960 channels).
  const int64_t c0 = cb.ct * a.TCV * VEC, c1 = c0 + a.TCV * VEC < a.C ? c0 + a.TCV * VEC : a.C;
  const int lane = tid & 31;
  for (int64_t g = c0 / a.cpg + tid / 32; g * a.cpg < c1; g += kWarps) {
    const int64_t gc0 = g * a.cpg > c0 ? g * a.cpg : c0, gc1 = (g + 1) * a.cpg < c1 ? (g + 1) * a.cpg : c1;
    const int pairs = static_cast<int>(gc1 - gc0) * a.R;
    Welford<double> st{0.0, 0.0, 0.0};
    for (int q = lane; q < pairs; q += 32) {
      const int cc = static_cast<int>(gc0 - c0) + q / a.R, r = q % a.R;
      const int t = r * a.TCV + cc / VEC, slot = t * VEC + cc % VEC;
      st = combine(st, Welford<double>{static_cast<double>(sh_mean[slot]), static_cast<double>(sh_m2[slot]),
                                       static_cast<double>(sh_n[t])});
    }
    st = warp_combine(st);
    if (lane == 0) part[((cb.n * a.G + g) * a.P + cb.p) * a.ctiles + cb.ct] = st;
  }
}

// One block per (n, g) merges the K partial states part[ng * K, (ng + 1) * K): thread t the states t, t + 256,
// ..., then the warps, then warp 0 the 8 warps' states (a fixed order). A warp a group ran K / 32 dependent
// double-precision merges a lane, with 64 warps in all on two-sample frames-major input: 0.11 ms.
template <typename acc_t>
__global__ void __launch_bounds__(kThreads) stats_finalize_kernel(const Welford<double>* __restrict__ part,
                                                                  int64_t K, double eps,
                                                                  acc_t* __restrict__ mean,
                                                                  acc_t* __restrict__ mean_lo,
                                                                  acc_t* __restrict__ rstd) {
  __shared__ Welford<double> sh[kWarps];
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int64_t ng = blockIdx.x;
  Welford<double> s{0.0, 0.0, 0.0};
  for (int64_t j = threadIdx.x; j < K; j += kThreads) s = combine(s, part[ng * K + j]);
  s = warp_combine(s);
  if (lane == 0) sh[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    s = sh[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) s = combine(s, sh[w]);
    const double var = s.n > 0.0 && s.m2 > 0.0 ? s.m2 / s.n : 0.0;
    const acc_t hi = static_cast<acc_t>(s.mean);
    mean[ng] = hi;
    mean_lo[ng] = static_cast<acc_t>(s.mean - static_cast<double>(hi));
    rstd[ng] = static_cast<acc_t>(1.0 / sqrt(var + eps));
  }
}

// ---------------------------------------------------------------------------------------------
// Forward: y = silu((x - mean) * rstd * gamma + beta).

template <typename scalar_t, typename acc_t, int VEC>
__global__ void __launch_bounds__(kThreads) apply_rows_kernel(GNArgs<scalar_t, acc_t> a) {
  const int lane = threadIdx.x & 31;
  const int64_t w = pass_block(a) * kWarps + threadIdx.x / 32;
  if (w >= a.items) return;
  const int64_t row = w / a.P, p = w % a.P;
  const int64_t lo = row * a.S + p * a.CH;
  const int64_t hi = lo + a.CH < (row + 1) * a.S ? lo + a.CH : (row + 1) * a.S;
  const ChannelParams<acc_t> cp(a, row / (a.C * a.F), row % a.C);  // rows are (n, f, c) in memory order
  const acc_t sc = cp.rstd * cp.gamma;
  auto f = [&](acc_t v) {
    const acc_t z = centered(v, cp.mean, cp.mean_lo) * sc + cp.beta;
    return a.silu ? silu_fast(z) : z;
  };
  warp_visit<VEC>(
      lo, hi, lane,
      [&](int64_t i) {
        acc_t v[VEC];
        load_vec<VEC>(a.x + i, v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) v[j] = f(v[j]);
        store_vec<VEC>(a.out + i, v);
      },
      [&](int64_t i) { a.out[i] = static_cast<scalar_t>(f(static_cast<acc_t>(a.x[i]))); });
}

// U rows of x loaded before any is used, BLOCKS CTAs an SM (apply_cols_choice picks them). With one row a load
// (16-byte vectors), six blocks an SM (at most 40 registers; 16-bit input spills 32 bytes of its channel values)
// had been 5-22 % faster than 4 on the two-pass shapes, 8 (32 registers, more spills) slower; with 59 registers
// (four blocks, one load in flight a thread) the 960-channel pass ran at 62 % of the DRAM rate (ncu). The mean's
// low part joins the shift, (x - mean - lo) * sc + beta = (x - mean) * sc + (beta - lo * sc): three values a
// channel, not four.
template <typename scalar_t, typename acc_t, int VEC, int U = 1, int BLOCKS = 6>
__global__ void __launch_bounds__(kThreads, BLOCKS) apply_cols_kernel(GNArgs<scalar_t, acc_t> a) {
  const ColBlock cb = col_block(a, VEC);
  if (!cb.active) return;  // no barrier below
  acc_t mu[VEC], sc[VEC], be[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const ChannelParams<acc_t> cp(a, cb.n, cb.cv * VEC + j);
    mu[j] = cp.mean;
    sc[j] = cp.rstd * cp.gamma;
    be[j] = cp.beta - cp.mean_lo * sc[j];
  }
  const int64_t first = cb.s0 + cb.rowlane, step = static_cast<int64_t>(a.R) * a.C;
  const scalar_t* xp = a.x + (cb.n * a.S + first) * a.C + cb.cv * VEC;
  scalar_t* yp = a.out + (xp - a.x);
  auto row = [&](const Vec<scalar_t, VEC>& raw, scalar_t* y) {
    acc_t v[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const acc_t z = (static_cast<acc_t>(raw.v[j]) - mu[j]) * sc[j] + be[j];
      v[j] = a.silu ? silu_fast(z) : z;
    }
    store_vec<VEC>(y, v);
  };
  int64_t s = first;
  if constexpr (U > 1) {
    for (; s + (U - 1) * a.R < cb.s1; s += U * a.R, xp += U * step, yp += U * step) {
      Vec<scalar_t, VEC> raw[U];
#pragma unroll
      for (int k = 0; k < U; ++k) raw[k] = *reinterpret_cast<const Vec<scalar_t, VEC>*>(xp + k * step);
#pragma unroll
      for (int k = 0; k < U; ++k) row(raw[k], yp + k * step);
    }
  }
  for (; s < cb.s1; s += a.R, xp += step, yp += step) row(*reinterpret_cast<const Vec<scalar_t, VEC>*>(xp), yp);
}

// ---------------------------------------------------------------------------------------------
// Backward. dz = dy * silu'(z) (dy without SiLU), xhat = (x - mean) * rstd; per (n, c) sums of dz
// and dz * xhat give grad_bias / grad_weight and the group means m1, m2 of dxhat = dz * gamma and
// dxhat * xhat; then dx = rstd * (dxhat - m1 - xhat * m2).

// Vectors of x and of dy a lane loads before it uses any in version 1's backward rows kernels: two for 16-bit
// input, four for float (16 elements a lane). One at a time (37-40 registers), the frames-major (2, 320, 14, 72, 128)
// backward took 0.383 ms bf16 / 0.462 ms fp32 of device time; batches of 2 / 4 / 8 vectors (60 / 78 / 118 registers,
// fewer CTAs an SM as they grow) 0.292 / 0.316 / 0.393 ms bf16 and 0.418 / 0.400 / 0.462 ms fp32 (H200).
template <int VEC>
constexpr int grad_batch() {
  return VEC >= 8 ? 2 : 4;
}

// A lane's batch of U vectors of x and of dy at i + k * 32 * VEC (warp_visit_batched), every load issued first.
template <typename scalar_t, int VEC, int U>
__device__ __forceinline__ void load_batch(const scalar_t* x, const scalar_t* dy, int64_t i,
                                           Vec<scalar_t, VEC> (&xr)[U], Vec<scalar_t, VEC> (&dr)[U]) {
#pragma unroll
  for (int k = 0; k < U; ++k) {
    xr[k] = *reinterpret_cast<const Vec<scalar_t, VEC>*>(x + i + k * 32 * VEC);
    dr[k] = *reinterpret_cast<const Vec<scalar_t, VEC>*>(dy + i + k * 32 * VEC);
  }
}

// Version 1's channels_last backward kernels: three CTAs an SM (at most 80 registers), U rows of x and of dy loaded
// before any is used (grad_col_batch).
constexpr int kGradColsCtas = 3;

// A thread's rows first, first + R, ... (< s1) of x and dy, `step` elements apart from xp and dp: U rows of each
// loaded before any is used, f(x row, dy row) on every row in order (the last rows one at a time).
template <int U, int VEC, typename scalar_t, typename F>
__device__ __forceinline__ void col_rows_batched(const scalar_t* xp, const scalar_t* dp, int64_t first, int64_t s1,
                                                 int R, int64_t step, F&& f) {
  using V = Vec<scalar_t, VEC>;
  int64_t s = first;
  for (; s + (U - 1) * R < s1; s += U * R, xp += U * step, dp += U * step) {
    V xr[U], dr[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      xr[k] = *reinterpret_cast<const V*>(xp + k * step);
      dr[k] = *reinterpret_cast<const V*>(dp + k * step);
    }
#pragma unroll
    for (int k = 0; k < U; ++k) f(xr[k], dr[k]);
  }
  for (; s < s1; s += R, xp += step, dp += step) f(*reinterpret_cast<const V*>(xp), *reinterpret_cast<const V*>(dp));
}

template <typename acc_t>
struct Sum2 {
  acc_t dz, dzx;
};

// d silu / dz on the special-function unit (ex2 and rcp approximations, a few float ulp): 16-bit data, whose
// rounding is far coarser; float keeps silu_grad.
__device__ __forceinline__ float silu_grad_fast(float z) {
  float e, s;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(z * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(1.f + e));
  return s * fmaf(z, 1.f - s, 1.f);
}

// dy * silu'(z) as every backward kernel takes it: silu_grad_fast for 16-bit data, silu_grad for float. Version 1's
// 16-bit kernels with silu_grad spent their issue slots on its division and exponential (1.2-1.3x slower, H200).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t silu_dz(acc_t dy, acc_t z) {
  if constexpr (sizeof(scalar_t) == 2 && std::is_same_v<acc_t, float>) return dy * silu_grad_fast(z);
  else return dy * silu_grad(z);
}

// Where the backward's lean kernels apply: 16-bit data summed in float (LEAN template arguments, grad_lean).
template <typename scalar_t, typename acc_t>
constexpr bool kCanLean = sizeof(scalar_t) == 2 && std::is_same_v<acc_t, float>;

// f(std::true_type) where the lean kernels apply and lean is asked for, else f(std::false_type): one dispatch for the
// LEAN template argument of every backward kernel the host picks.
template <typename scalar_t, typename acc_t, typename F>
auto with_lean(bool lean, F&& f) {
  if constexpr (kCanLean<scalar_t, acc_t>) {
    if (lean) return f(std::true_type{});
  }
  return f(std::false_type{});
}

// The same for 16-bit data in three instructions after the two approximations instead of four:
// dy * s * (1 + z * (1 - s)) as q = z - z * s, ds = dy * s, ds + ds * q (the lean kernels).
__device__ __forceinline__ float silu_dz_lean(float dy, float z) {
  float e, s;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(z * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(1.f + e));
  const float q = fmaf(-z, s, z), ds = dy * s;
  return fmaf(ds, q, ds);
}

// xc: x - mean (see centered()).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void grad_terms(acc_t xc, acc_t dy, acc_t rstd, acc_t sc, acc_t beta, bool silu,
                                           acc_t& dz, acc_t& xhat) {
  dz = silu ? silu_dz<scalar_t>(dy, xc * sc + beta) : dy;
  xhat = xc * rstd;
}

// f(silu) with SiLU a compile-time constant: the branch taken once, outside f's loops (version 1's channels_last
// kernels). With the flag tested on every element they ran 3-7 % slower at 16-byte vectors (bf16 (28, 960, 72, 128)
// 893 vs 843 us, fp32 1405 vs 1369; H200); not measured at the chosen eight rows a load. Version 1's rows kernels keep
// the flag in their loops: hoisted, bf16 frames-major (2, 320, 14, 72, 128) took 243 us against 218.
template <typename F>
__device__ __forceinline__ void with_silu(bool silu, F&& f) {
  if (silu) f(std::true_type{});
  else f(std::false_type{});
}

// NC*: item w covers chunk p of row (n, c) (frames-major: of row (n, f, c), rows in memory order); partial
// sums at part[w] = part[row * P + p].
// LEAN (16-bit input): the mean folded into z's shift, sums of dz * x moved to the mean at the end, silu_dz_lean.
template <typename scalar_t, typename acc_t, int VEC, bool LEAN = false>
__global__ void __launch_bounds__(kThreads) grad_sums_rows_kernel(GNArgs<scalar_t, acc_t> a,
                                                                  Sum2<acc_t>* __restrict__ part) {
  constexpr bool kLean = LEAN && kCanLean<scalar_t, acc_t>;
  const int lane = threadIdx.x & 31;
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (w >= a.items) return;
  const int64_t row = w / a.P, p = w % a.P;
  const int64_t lo = row * a.S + p * a.CH;
  const int64_t hi = lo + a.CH < (row + 1) * a.S ? lo + a.CH : (row + 1) * a.S;
  const ChannelParams<acc_t> cp(a, row / (a.C * a.F), row % a.C);
  const acc_t sc = cp.rstd * cp.gamma, bx = fma(-cp.mean, sc, fma(-cp.mean_lo, sc, cp.beta));
  acc_t sdz = 0, sdzx = 0;
  auto acc = [&](acc_t x, acc_t dy) {
    if constexpr (kLean) {  // sums of dz and dz * x
      const float dz = a.silu ? silu_dz_lean(dy, fmaf(x, sc, bx)) : dy;
      sdz += dz;
      sdzx = fmaf(dz, x, sdzx);
    } else {
      acc_t dz, xhat;
      grad_terms<scalar_t>(centered(x, cp.mean, cp.mean_lo), dy, cp.rstd, sc, cp.beta, a.silu, dz, xhat);
      sdz += dz;
      sdzx += dz * xhat;
    }
  };
  auto one = [&](int64_t i) {
    acc_t x[VEC], dy[VEC];
    load_vec<VEC>(a.x + i, x);
    load_vec<VEC>(a.dy + i, dy);
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc(x[j], dy[j]);
  };
  auto single = [&](int64_t i) { acc(static_cast<acc_t>(a.x[i]), static_cast<acc_t>(a.dy[i])); };
  // A lane's vectors of a chunk a batch at a time (the sums in the same order as one at a time).
  constexpr int U = grad_batch<VEC>();
  warp_visit_batched<VEC, U>(
      lo, hi, lane,
      [&](int64_t i) {
        Vec<scalar_t, VEC> xr[U], dr[U];
        load_batch(a.x, a.dy, i, xr, dr);
#pragma unroll
        for (int k = 0; k < U; ++k)
#pragma unroll
          for (int j = 0; j < VEC; ++j) acc(static_cast<acc_t>(xr[k].v[j]), static_cast<acc_t>(dr[k].v[j]));
      },
      one, single);
  sdz = warp_sum(sdz);
  sdzx = warp_sum(sdzx);
  if (kLean) sdzx = cp.rstd * fma(-cp.mean_lo, sdz, fma(-cp.mean, sdz, sdzx));  // sum dz * xhat
  if (lane == 0) part[w] = Sum2<acc_t>{sdz, sdzx};
}

// N*C: partial sums per (n, c, p) at part[(n * C + c) * P + p]. Three values a channel in registers
// (z = (x - mean) * sc + (beta - lo * sc); the sum of dz * (x - mean) becomes that of dz * xhat at the end),
// and three blocks an SM (80 registers): at five values and 98 registers (two blocks) the 960-channel pass
// read at 1.3 TB/s (0.74 ms), now 0.56 ms; at four blocks (64 registers) the spills made it slower again.
// LEAN (16-bit input): the mean folded into z's shift, sums of dz * x moved to the mean at the end, silu_dz_lean.
template <typename scalar_t, typename acc_t, int VEC, int U, bool LEAN = false>
__global__ void __launch_bounds__(kThreads, kGradColsCtas)
    grad_sums_cols_kernel(GNArgs<scalar_t, acc_t> a, Sum2<acc_t>* __restrict__ part) {
  constexpr bool kLean = LEAN && kCanLean<scalar_t, acc_t>;
  __shared__ acc_t sh_dz[kThreads * VEC];
  __shared__ acc_t sh_dzx[kThreads * VEC];
  const ColBlock cb = col_block(a, VEC);
  acc_t sdz[VEC], sdzx[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) sdz[j] = sdzx[j] = acc_t(0);
  if (cb.active) {
    acc_t mu[VEC], sc[VEC], be[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const ChannelParams<acc_t> cp(a, cb.n, cb.cv * VEC + j);
      mu[j] = cp.mean;
      sc[j] = cp.rstd * cp.gamma;
      be[j] = cp.beta - cp.mean_lo * sc[j];
      if constexpr (kLean) be[j] = fmaf(-mu[j], sc[j], be[j]);  // z = x * sc + be
    }
    const int64_t first = cb.s0 + cb.rowlane, step = static_cast<int64_t>(a.R) * a.C;
    const int64_t off = (cb.n * a.S + first) * a.C + cb.cv * VEC;
    const scalar_t* xp = a.x + off;
    const scalar_t* dp = a.dy + off;
    with_silu(a.silu, [&](auto silu) {
      col_rows_batched<U, VEC>(xp, dp, first, cb.s1, a.R, step,
                               [&](const Vec<scalar_t, VEC>& xr, const Vec<scalar_t, VEC>& dr) {
#pragma unroll
                                 for (int j = 0; j < VEC; ++j) {
                                   const acc_t dy = static_cast<acc_t>(dr.v[j]);
                                   if constexpr (kLean) {
                                     const float xf = static_cast<float>(xr.v[j]);
                                     const float dz = silu ? silu_dz_lean(dy, fmaf(xf, sc[j], be[j])) : dy;
                                     sdz[j] += dz;
                                     sdzx[j] = fmaf(dz, xf, sdzx[j]);
                                   } else {
                                     const acc_t xm = static_cast<acc_t>(xr.v[j]) - mu[j];
                                     const acc_t dz = silu ? silu_dz<scalar_t>(dy, xm * sc[j] + be[j]) : dy;
                                     sdz[j] += dz;
                                     sdzx[j] += dz * xm;
                                   }
                                 }
                               });
    });
    // sum dz * xhat = rstd * (sum dz * (x - mean) - lo * sum dz)
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const ChannelParams<acc_t> cp(a, cb.n, cb.cv * VEC + j);
      if constexpr (kLean) sdzx[j] = fmaf(-cp.mean, sdz[j], sdzx[j]);  // sum dz * x to sum dz * (x - mean)
      sdzx[j] = cp.rstd * (sdzx[j] - cp.mean_lo * sdz[j]);
    }
  }
  const int tid = threadIdx.x;
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    sh_dz[tid * VEC + j] = sdz[j];
    sh_dzx[tid * VEC + j] = sdzx[j];
  }
  __syncthreads();
  for (int cc = tid; cc < a.TCV * VEC; cc += kThreads) {
    const int64_t c = cb.ct * a.TCV * VEC + cc;
    if (c >= a.C) continue;
    acc_t t_dz = 0, t_dzx = 0;
    for (int r = 0; r < a.R; ++r) {
      const int slot = (r * a.TCV + cc / VEC) * VEC + cc % VEC;
      t_dz += sh_dz[slot];
      t_dzx += sh_dzx[slot];
    }
    part[(cb.n * a.C + c) * a.P + cb.p] = Sum2<acc_t>{t_dz, t_dzx};
  }
}

// A warp per (n, c) sums its F * P partial sums: sums[n * C + c] = sum over f, p of part[((n * F + f) * C + c) * P + p]
// (F = 1 but for frames-major rows).
// (One thread a group looping over cpg * P partials took 1.1 of the 2.8 ms of the channels_last backward
// at (28, 960, 72, 128): 896 threads with 4320 dependent loads each.)
template <typename acc_t>
__global__ void __launch_bounds__(kThreads) grad_partials_kernel(const Sum2<acc_t>* __restrict__ part, int64_t NC,
                                                                 int64_t C, int64_t F, int64_t P,
                                                                 Sum2<acc_t>* __restrict__ sums) {
  const int lane = threadIdx.x & 31;
  const int64_t nc = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (nc >= NC) return;
  const int64_t n = nc / C, c = nc % C;
  acc_t dz = 0, dzx = 0;
  for (int64_t j = lane; j < F * P; j += 32) {
    const Sum2<acc_t> v = part[((n * F + j / P) * C + c) * P + j % P];
    dz += v.dz;
    dzx += v.dzx;
  }
  dz = warp_sum(dz);
  dzx = warp_sum(dzx);
  if (lane == 0) sums[nc] = Sum2<acc_t>{dz, dzx};
}

// Threads [0, NG) compute m1, m2 of group (n, g); threads [NG, NG + C) grad_weight / grad_bias of
// channel c (summed over n), written as out_t (the parameters' dtype where the launcher allows it).
// sums holds one sum per (n, c).
template <typename scalar_t, typename acc_t, typename out_t>
__global__ void __launch_bounds__(kThreads) grad_reduce_kernel(GNArgs<scalar_t, acc_t> a,
                                                               const Sum2<acc_t>* __restrict__ sums,
                                                               acc_t* __restrict__ m1,
                                                               acc_t* __restrict__ m2,
                                                               out_t* __restrict__ dw,
                                                               out_t* __restrict__ db) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t NG = a.N * a.G;
  if (t < NG) {
    const int64_t n = t / a.G, g = t % a.G;
    acc_t s1 = 0, s2 = 0;
    for (int64_t c = g * a.cpg; c < (g + 1) * a.cpg; ++c) {
      const acc_t gamma = a.w ? static_cast<acc_t>(a.w[c]) : acc_t(1);
      const Sum2<acc_t> v = sums[n * a.C + c];
      s1 += gamma * v.dz;
      s2 += gamma * v.dzx;
    }
    const acc_t M = static_cast<acc_t>(a.cpg * a.S * a.F);
    m1[t] = s1 / M;
    m2[t] = s2 / M;
  } else if (t < NG + a.C) {
    const int64_t c = t - NG;
    acc_t dz = 0, dzx = 0;
    for (int64_t n = 0; n < a.N; ++n) {
      const Sum2<acc_t> v = sums[n * a.C + c];
      dz += v.dz;
      dzx += v.dzx;
    }
    dw[c] = static_cast<out_t>(dzx);
    db[c] = static_cast<out_t>(dz);
  }
}

template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t dx_of(acc_t xc, acc_t dy, acc_t rstd, acc_t gamma, acc_t sc, acc_t beta,
                                       acc_t m1, acc_t m2, bool silu) {
  acc_t dz, xhat;
  grad_terms<scalar_t>(xc, dy, rstd, sc, beta, silu, dz, xhat);
  return rstd * (dz * gamma - m1 - xhat * m2);
}

// FM: frames-major x and dy read in place (rows (n, f, c)), dx written to its contiguous rows (n, c, f).
// LEAN (16-bit input): dx = sc * dz + D * x + E and z = x * sc + bx, the mean folded into E and bx; silu_dz_lean.
template <typename scalar_t, typename acc_t, int VEC, bool FM, bool LEAN = false>
__global__ void __launch_bounds__(kThreads) dx_rows_kernel(GNArgs<scalar_t, acc_t> a) {
  constexpr bool kLean = LEAN && kCanLean<scalar_t, acc_t>;
  const int lane = threadIdx.x & 31;
  const int64_t w = pass_block(a) * kWarps + threadIdx.x / 32;
  if (w >= a.items) return;
  const int64_t row = w / a.P, p = w % a.P;
  const int64_t lo = row * a.S + p * a.CH;
  const int64_t hi = lo + a.CH < (row + 1) * a.S ? lo + a.CH : (row + 1) * a.S;
  const int64_t n = FM ? row / (a.C * a.F) : row / a.C, c = row % a.C, ng = n * a.G + c / a.cpg;
  const int64_t shift = FM ? ((n * a.C + c) * a.F + (row / a.C) % a.F - row) * a.S : 0;
  const ChannelParams<acc_t> cp(a, n, c);
  const acc_t sc = cp.rstd * cp.gamma, m1 = a.m1[ng], m2 = a.m2[ng];
  const acc_t bx = fma(-cp.mean, sc, fma(-cp.mean_lo, sc, cp.beta)), D = -cp.rstd * cp.rstd * m2;
  const acc_t E = fma(-D, cp.mean, fma(-D, cp.mean_lo, -cp.rstd * m1));
  auto f = [&](acc_t x, acc_t dy) {
    if constexpr (kLean) {
      const float dz = a.silu ? silu_dz_lean(dy, fmaf(x, sc, bx)) : dy;
      return fmaf(dz, sc, fmaf(x, D, E));
    } else {
      return dx_of<scalar_t>(centered(x, cp.mean, cp.mean_lo), dy, cp.rstd, cp.gamma, sc, cp.beta, m1, m2, a.silu);
    }
  };
  auto one = [&](int64_t i) {
    acc_t x[VEC], dy[VEC];
    load_vec<VEC>(a.x + i, x);
    load_vec<VEC>(a.dy + i, dy);
#pragma unroll
    for (int j = 0; j < VEC; ++j) x[j] = f(x[j], dy[j]);
    store_vec<VEC>(a.out + i + shift, x);
  };
  auto single = [&](int64_t i) {
    a.out[i + shift] = static_cast<scalar_t>(f(static_cast<acc_t>(a.x[i]), static_cast<acc_t>(a.dy[i])));
  };
  constexpr int U = grad_batch<VEC>();
  warp_visit_batched<VEC, U>(
      lo, hi, lane,
      [&](int64_t i) {
        Vec<scalar_t, VEC> xr[U], dr[U];
        load_batch(a.x, a.dy, i, xr, dr);
#pragma unroll
        for (int k = 0; k < U; ++k) {
          Vec<scalar_t, VEC> o;
#pragma unroll
          for (int j = 0; j < VEC; ++j)
            o.v[j] = static_cast<scalar_t>(f(static_cast<acc_t>(xr[k].v[j]), static_cast<acc_t>(dr[k].v[j])));
          *reinterpret_cast<Vec<scalar_t, VEC>*>(a.out + i + shift + k * 32 * VEC) = o;
        }
      },
      one, single);
}

// dx = rstd * (dz * gamma - m1 - xhat * m2) with xhat = (x - mean - lo) * rstd, written per channel as
// sc * dz + B + D * (x - mean) (sc = rstd * gamma, as in z): five values a channel in registers (eight before, 104 registers and two
// blocks an SM), three blocks an SM (0.75 -> 0.54 ms at (28, 960, 72, 128)).
template <typename scalar_t, typename acc_t, int VEC, int U, bool LEAN = false>
__global__ void __launch_bounds__(kThreads, kGradColsCtas) dx_cols_kernel(GNArgs<scalar_t, acc_t> a) {
  // LEAN (16-bit input): the mean folded into z's shift and dx's constant, silu_dz_lean.
  constexpr bool kLean = LEAN && kCanLean<scalar_t, acc_t>;
  const ColBlock cb = col_block(a, VEC);
  if (!cb.active) return;
  acc_t mu[VEC], sc[VEC], be[VEC], cbb[VEC], cd[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    const int64_t c = cb.cv * VEC + j, ng = cb.n * a.G + group_of(c, a.cpg);
    const ChannelParams<acc_t> cp(a, cb.n, c);
    const acc_t m1 = a.m1[ng], m2 = a.m2[ng];
    mu[j] = cp.mean;
    sc[j] = cp.rstd * cp.gamma;
    be[j] = cp.beta - cp.mean_lo * sc[j];
    cd[j] = -cp.rstd * cp.rstd * m2;
    cbb[j] = -cp.rstd * m1 - cd[j] * cp.mean_lo;
    if constexpr (kLean) {  // z = x * sc + be, dx = sc * dz + cd * x + cbb
      be[j] = fmaf(-mu[j], sc[j], be[j]);
      cbb[j] = fmaf(-cd[j], mu[j], cbb[j]);
    }
  }
  const int64_t first = cb.s0 + cb.rowlane, step = static_cast<int64_t>(a.R) * a.C;
  const int64_t off = (cb.n * a.S + first) * a.C + cb.cv * VEC;
  const scalar_t* xp = a.x + off;
  const scalar_t* dp = a.dy + off;
  scalar_t* op = a.out + off;
  with_silu(a.silu, [&](auto silu) {
    // dx's rows in the order they are visited, op one row further each time.
    col_rows_batched<U, VEC>(xp, dp, first, cb.s1, a.R, step,
                             [&](const Vec<scalar_t, VEC>& xr, const Vec<scalar_t, VEC>& dr) {
                               acc_t v[VEC];
#pragma unroll
                               for (int j = 0; j < VEC; ++j) {
                                 const acc_t dy = static_cast<acc_t>(dr.v[j]);
                                 if constexpr (kLean) {
                                   const float xf = static_cast<float>(xr.v[j]);
                                   const float dz = silu ? silu_dz_lean(dy, fmaf(xf, sc[j], be[j])) : dy;
                                   v[j] = fmaf(sc[j], dz, fmaf(cd[j], xf, cbb[j]));
                                 } else {
                                   const acc_t xm = static_cast<acc_t>(xr.v[j]) - mu[j];
                                   const acc_t dz = silu ? silu_dz<scalar_t>(dy, xm * sc[j] + be[j]) : dy;
                                   v[j] = sc[j] * dz + cbb[j] + cd[j] * xm;
                                 }
                               }
                               store_vec<VEC>(op, v);
                               op += step;
                             });
  });
}

// ---------------------------------------------------------------------------------------------
// Version 3 forward, NC* and frames-major with 16-byte vectors: one read of x, one write of y. A
// group is F segments of cpg * S contiguous elements (F = 1 for NC*; for a frames-major (B, C, F, H, W)
// view of (B, F, C, H, W) memory, one segment per frame at stride C * S). Its M = F * cpg * S elements
// are split over a cluster of K CTAs (K = 1 without clusters); each thread holds up to V vectors of its
// CTA's part in registers from the load to the store.
// Statistics: each thread takes the mean and the sum of squared deviations of its own elements (two
// passes over its registers, no barrier between them) on d = x - pivot, pivot the group's first
// element, so that a mean which dwarfs the spread costs no precision; the per-thread states are merged
// with Chan's formula (warp tree, warps in order, then the cluster's CTAs in rank order through
// distributed shared memory): one cluster exchange, the same bits in every CTA.
// The store pass computes z = (x - pivot) * a_c + b_c with per-channel a_c = rstd * gamma_c and
// b_c = beta_c - mean_d * a_c from shared memory, SiLU on the special-function unit, and packs pairs.
// Version 2 spent ~44 issue slots per element (precise expf and division, per-element packing, a
// second cluster exchange) and was issue-bound at 29 % of DRAM bandwidth (ncu, H200); this one ~15.

constexpr int kFusedThreads = 256;
constexpr int kFusedWarps = kFusedThreads / 32;

// Where a forward leaves each group's statistics for the backward (group_norm_silu_forward; p == nullptr: not
// asked for): p is (3, NG), the mean's high part, its low part and rstd (norm.h), written once a group.
struct StatsOut {
  float* p;
  int64_t NG;
  // Group ng, mean = pivot + m: TwoSum splits it into a float and its rounding error, exact whichever is larger.
  __device__ __forceinline__ void write(int64_t ng, float pivot, float m, float rstd) const {
    const float hi = __fadd_rn(pivot, m), bv = __fsub_rn(hi, pivot);
    p[ng] = hi;
    p[NG + ng] = __fadd_rn(__fsub_rn(pivot, __fsub_rn(hi, bv)), __fsub_rn(m, bv));
    p[2 * NG + ng] = rstd;
  }
};

template <typename scalar_t>
struct FusedArgs {
  const scalar_t* x;
  scalar_t* out;
  const scalar_t* w;  // nullptr: gamma = 1
  const scalar_t* b;  // nullptr: beta = 0
  int64_t G;
  int64_t nstride;    // elements between samples
  int64_t fstride;    // elements between a group's segments (F > 1)
  int cpg, S, seg, M; // seg = cpg * S, M = F * seg < 2^31: the host only takes groups of a few MB
  at::cuda::detail::IntDivider<unsigned> div_S, div_cpg;  // multiply-shift division by S and cpg
  int step_f, step_c, step_r;  // (threads a CTA) * VEC elements as (segments, channels, offset)
  int K;              // CTAs per group (the cluster size)
  int part;           // vectors per CTA; the last CTA of a group may hold fewer
  double eps;
  bool silu;
  StatsOut stats;     // the forward's statistics (versions 3, 4 and 6), when asked for
};

using wgmma::cluster_arrive;
using wgmma::cluster_map;
using wgmma::cluster_wait;

// *p in the shared memory of the cluster's CTA of rank r.
template <typename T>
__device__ __forceinline__ T cluster_load(T* p, unsigned r) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return *cooperative_groups::this_cluster().map_shared_rank(p, r);
#else
  return *p;
#endif
}

// Chan's merge in float with the approximate reciprocal (the statistics' weights need no more).
__device__ __forceinline__ Welford<float> combine_f(const Welford<float>& a, const Welford<float>& b) {
  const float n = a.n + b.n;
  const float wb = n > 0.f ? __fdividef(b.n, n) : 0.f;
  const float delta = b.mean - a.mean;
  return {a.mean + delta * wb, a.m2 + b.m2 + delta * delta * a.n * wb, n};
}

__device__ __forceinline__ Welford<float> warp_combine_f(Welford<float> s) {
  return warp_combine(s, [](const Welford<float>& a, const Welford<float>& b) { return combine_f(a, b); });
}

// Merges every thread's state over the cluster; returns the whole group's (mean, m2, n) in every
// thread, the same bits in every CTA. sh_warp: WARPS slots, sh_cta: this CTA's slot (read by the other
// CTAs after the barrier).
template <int WARPS>
__device__ __forceinline__ Welford<float> cluster_combine(Welford<float> s, int K, Welford<float>* sh_warp,
                                                          Welford<float>* sh_cta) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  s = warp_combine_f(s);
  if (lane == 0) sh_warp[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    Welford<float> t = sh_warp[0];
#pragma unroll
    for (int i = 1; i < WARPS; ++i) t = combine_f(t, sh_warp[i]);
    *sh_cta = t;
  }
  cluster_arrive();
  cluster_wait();
  Welford<float> t = lane < K ? cluster_load(sh_cta, lane) : Welford<float>{0.f, 0.f, 0.f};
  t = warp_combine_f(t);
  return {__shfl_sync(kFullMask, t.mean, 0), __shfl_sync(kFullMask, t.m2, 0), __shfl_sync(kFullMask, t.n, 0)};
}

// Element j of a 16-byte vector as float, on the raw bits: c10's Half / BFloat16 types in an array
// held across the kernel make ptxas put the whole buffer on the stack.
template <typename scalar_t>
__device__ __forceinline__ float elt_to_float(const uint4& r, int j) {
  const unsigned w = (&r.x)[j * static_cast<int>(sizeof(scalar_t)) / 4];
  if constexpr (std::is_same_v<scalar_t, float>) {
    return __uint_as_float(w);
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    return __uint_as_float(j % 2 ? w & 0xffff0000u : w << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(j % 2 ? w >> 16 : w & 0xffffu)));
  }
}

// Elements 2i and 2i + 1 (one for float) of the output vector from floats: one packing conversion.
template <typename scalar_t>
__device__ __forceinline__ void store_pair(uint4& r, int i, float lo, float hi) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    (&r.x)[2 * i] = __float_as_uint(lo);
    (&r.x)[2 * i + 1] = __float_as_uint(hi);
  } else if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
    (&r.x)[i] = *reinterpret_cast<const unsigned*>(&p);
  } else {
    const __half2 p = __floats2half2_rn(lo, hi);
    (&r.x)[i] = *reinterpret_cast<const unsigned*>(&p);
  }
}

// Position of a group's element e = (f * cpg + c) * S + r: segment f, channel c, offset r; stepped
// by a fixed stride without divisions.
struct GroupPos {
  int f, c, r;
  template <typename A>
  __device__ __forceinline__ GroupPos(unsigned e, const A& a) {
    const auto row = a.div_S.divmod(e);
    const auto fc = a.div_cpg.divmod(row.div);
    f = fc.div;
    c = fc.mod;
    r = row.mod;
  }
  template <typename A>
  __device__ __forceinline__ void advance(const A& a) {
    r += a.step_r;
    c += a.step_c;
    f += a.step_f;
    if (r >= a.S) {
      r -= a.S;
      ++c;
    }
    if (c >= a.cpg) {
      c -= a.cpg;
      ++f;
    }
  }
  __device__ __forceinline__ int64_t offset(int64_t fstride, int S) const {
    return f * fstride + static_cast<int64_t>(c * S + r);
  }
};

// GroupPos with the element offset from the group's start kept alongside, for loops that step a fixed
// number of vectors: the offset f * fstride + c * S + r costs ~20 instructions a vector rebuilt from (f, c, r)
// (64-bit products), ~6 stepped. FM: frames-major groups (F > 1), whose offset jumps fstride - seg from one
// segment to the next; for F = 1 the offset is the element index.
template <bool FM>
struct GroupWalk {
  int c, r;
  int64_t off;
  template <typename A>
  __device__ __forceinline__ GroupWalk(unsigned e, const A& a) {
    const GroupPos p(e, a);
    c = p.c;
    r = p.r;
    off = p.offset(a.fstride, a.S);
  }
  // step = (threads a CTA) * VEC elements, as a.step_{f,c,r}.
  template <typename A>
  __device__ __forceinline__ void advance(const A& a, int step) {
    r += a.step_r;
    c += a.step_c;
    if (r >= a.S) {
      r -= a.S;
      ++c;
    }
    off += step;
    if constexpr (FM) {
      int df = a.step_f;
      if (c >= a.cpg) {
        c -= a.cpg;
        ++df;
      }
      off += static_cast<int64_t>(df) * (a.fstride - a.seg);
    }
  }
};

// This CTA's share of its group (versions 3 and 4): group g of sample n starts at element base; the CTA
// of cluster rank r holds vectors [v0, v0 + part), v0 = r * part, of it; thread t those at v0 + t + k * THREADS,
// mine of them.
struct ClusterPart {
  int64_t g, base;
  int v0, mine;
};

template <int THREADS, int VEC, typename A>
__device__ __forceinline__ ClusterPart cluster_part(const A& a) {
  const int tid = threadIdx.x;
  const int64_t ng = blockIdx.x / a.K;
  const int rank = static_cast<int>(blockIdx.x % a.K);
  const int64_t g = ng % a.G;
  const int Mv = a.M / VEC;
  const int v0 = rank * a.part;
  const int v1 = v0 + a.part < Mv ? v0 + a.part : Mv;
  return {g, (ng / a.G) * a.nstride + g * a.seg, v0, v1 - v0 > tid ? (v1 - v0 - tid + THREADS - 1) / THREADS : 0};
}

// The per-channel table of group g from its statistics st (of x - pivot): sh_chan[c] = a_c = rstd * gamma_c and
// sh_chan[cpg + c] = b_c = beta_c - shift * a_c, then a block barrier; rank 0 also leaves the statistics for the
// backward where asked (versions 3 and 4: a cluster a group, group blockIdx.x / K).
template <int THREADS, typename A>
__device__ __forceinline__ void fill_channel_table(const A& a, int64_t g, const Welford<float>& st, float pivot,
                                                   float shift, float* sh_chan) {
  const float rstd = rsqrtf(__fdividef(st.m2, st.n) + static_cast<float>(a.eps));
  if (a.stats.p && threadIdx.x == 0 && blockIdx.x % a.K == 0) a.stats.write(blockIdx.x / a.K, pivot, st.mean, rstd);
  const int64_t c0 = g * a.cpg;
  for (int c = threadIdx.x; c < a.cpg; c += THREADS) {
    const float ac = rstd * (a.w ? static_cast<float>(a.w[c0 + c]) : 1.f);
    sh_chan[c] = ac;
    sh_chan[a.cpg + c] = fmaf(-shift, ac, a.b ? static_cast<float>(a.b[c0 + c]) : 0.f);
  }
  __syncthreads();
}

template <int V>
constexpr int fused_min_blocks() {
  // Register budget per thread (65536 / (256 * blocks)): data are 4 registers per vector; V = 8 needs
  // 78 (at 64 it spills), so 3 CTAs an SM hold up to 96 KB of x, over twice what hides DRAM latency.
  return V <= 4 ? 6 : 3;
}

// One output vector: y = act((x - pivot) * a_c + b_c) for the input vector `in` at group position p, or
// without SHIFT y = act(x * a_c + b_c) (b_c then holds the pivot's share); SILU and SHIFT as template
// arguments keep the choices out of the per-element code.
template <typename scalar_t, bool SILU, bool SHIFT = true, typename A, typename P>
__device__ __forceinline__ uint4 norm_vec(const uint4& in, const P& p, const A& a, float pivot,
                                          const float* sh_chan) {
  constexpr int VEC = max_vec<scalar_t>();
  auto f = [&](float x, float ac, float bc) {
    const float z = fmaf(SHIFT ? x - pivot : x, ac, bc);
    return SILU ? silu_fast(z) : z;
  };
  uint4 o;
  if (a.S % VEC == 0) {  // a vector never straddles two channels
    const float ac = sh_chan[p.c], bc = sh_chan[a.cpg + p.c];
#pragma unroll
    for (int j = 0; j < VEC; j += 2)
      store_pair<scalar_t>(o, j / 2, f(elt_to_float<scalar_t>(in, j), ac, bc), f(elt_to_float<scalar_t>(in, j + 1), ac, bc));
  } else {
    // Within one segment (the host asks seg % VEC == 0), channel by channel.
    int cj = p.c, rj = p.r;
    float y[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      y[j] = f(elt_to_float<scalar_t>(in, j), sh_chan[cj], sh_chan[a.cpg + cj]);
      if (++rj == a.S) {
        rj = 0;
        ++cj;
      }
    }
#pragma unroll
    for (int j = 0; j < VEC; j += 2) store_pair<scalar_t>(o, j / 2, y[j], y[j + 1]);
  }
  return o;
}

// The store pass of fused_rows_kernel, from the registers.
template <typename scalar_t, int V, bool SILU>
__device__ __forceinline__ void store_pass(const FusedArgs<scalar_t>& a, const uint4 (&buf)[V], int mine,
                                           int64_t base, int v0, float pivot, const float* sh_chan) {
  constexpr int VEC = max_vec<scalar_t>();
  const int tid = threadIdx.x;
  // Positions again, from laundered inputs: otherwise the compiler keeps the load pass's V offsets
  // live through the statistics (spilling under the register budget).
  unsigned e0 = (v0 + tid) * VEC;
  asm volatile("" : "+r"(e0));
  GroupPos p(e0, a);
#pragma unroll
  for (int k = 0; k < V; ++k) {
    if (k < mine)
      *reinterpret_cast<uint4*>(a.out + base + p.offset(a.fstride, a.S)) =
          norm_vec<scalar_t, SILU>(buf[k], p, a, pivot, sh_chan);
    p.advance(a);
  }
}

template <typename scalar_t, int V>
__global__ void __launch_bounds__(kFusedThreads, fused_min_blocks<V>())
    fused_rows_kernel(FusedArgs<scalar_t> a) {
  constexpr int VEC = max_vec<scalar_t>();
  extern __shared__ float sh_chan[];  // [0, cpg): a_c = rstd * gamma, [cpg, 2 cpg): b_c
  __shared__ Welford<float> sh_warp[kFusedWarps];
  __shared__ Welford<float> sh_cta;

  const int tid = threadIdx.x;
  const auto [g, base, v0, mine] = cluster_part<kFusedThreads, VEC>(a);
  uint4 buf[V];
  {
    GroupPos p(static_cast<unsigned>((v0 + tid) * VEC), a);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      if (k < mine) buf[k] = *reinterpret_cast<const uint4*>(a.x + base + p.offset(a.fstride, a.S));
      p.advance(a);
    }
  }
  const float pivot = static_cast<float>(a.x[base]);

  // This thread's mean of d and sum of squared deviations.
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < V; ++k)
    if (k < mine) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) s += elt_to_float<scalar_t>(buf[k], j) - pivot;
    }
  const float n = static_cast<float>(mine * VEC);
  const float m = mine ? s / n : 0.f;
  float q = 0.f;
#pragma unroll
  for (int k = 0; k < V; ++k)
    if (k < mine) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float d = (elt_to_float<scalar_t>(buf[k], j) - pivot) - m;
        q = fmaf(d, d, q);
      }
    }
  const Welford<float> st = cluster_combine<kFusedWarps>({m, q, n}, a.K, sh_warp, &sh_cta);
  // Done reading the other CTAs' shared memory; the matching wait is just before exit, so no CTA
  // leaves while its state may still be read.
  cluster_arrive();

  fill_channel_table<kFusedThreads>(a, g, st, pivot, st.mean, sh_chan);

  if (a.silu) store_pass<scalar_t, V, true>(a, buf, mine, base, v0, pivot, sh_chan);
  else store_pass<scalar_t, V, false>(a, buf, mine, base, v0, pivot, sh_chan);
  cluster_wait();
}


// ---------------------------------------------------------------------------------------------
// Version 4 forward ("l2"), NC* and frames-major with 16-byte vectors: x is read twice but leaves
// DRAM once. Version 3 holds a CTA's part of the group in registers, so a CTA issues its loads once
// and then waits through the reduction and its stores: at 3 CTAs an SM the DRAM pipe idles between
// those phases (45-54 % of the copy rate). Here the cluster's K CTAs stream their parts twice
// through the cache: pass 1 reads with an L2 evict-last hint and reduces, pass 2 reads the same lines
// back with evict-first (they are still in L2: a part is at most 96 KB, so the resident parts stay
// well inside the 50 MB L2), normalizes and stores with evict-first. Each thread keeps U vectors in
// flight per step in both passes, and two CTAs at different phases share an SM. Statistics: shifted
// sums over each batch of U vectors (about the batch's first element), closed into a (mean, m2, n)
// state of x - pivot and merged with Chan's formula, threads and CTAs in a fixed order: every CTA of
// the cluster gets the same bits. Loops run whole batches without per-vector predicates, then the
// rest: the first version of this kernel (per-vector predicates, two-pass batches) spent 42
// instructions an element and was issue-bound (ncu: issue 75 %, DRAM 34 %); this one ~27.

constexpr int kL2Threads = 512;  // two CTAs an SM
constexpr int kL2Unroll = 8;
// A CTA's part: 2 CTAs an SM keep at most 132 * 2 * 96 KB = 25 MB of x waiting in L2 for pass 2.
constexpr int64_t kL2PartBytes = 96 * 1024;

// L2 eviction-priority policies (sm_80+) and the loads / stores that carry them: pass 1 reads with
// `keep` (evict-last), pass 2 reads and stores with `drop` (evict-first).
struct L2Policies {
  uint64_t keep = 0, drop = 0;
};

__device__ __forceinline__ L2Policies l2_policies() {
  L2Policies p;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p.keep));
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p.drop));
#endif
  return p;
}

__device__ __forceinline__ uint4 load_hint(const void* ptr, uint64_t policy) {
  uint4 r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("ld.global.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(ptr), "l"(policy));
#else
  (void)policy;
  r = *reinterpret_cast<const uint4*>(ptr);
#endif
  return r;
}

__device__ __forceinline__ void store_hint(void* ptr, const uint4& v, uint64_t policy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("st.global.L1::no_allocate.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;"
               :
               : "l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "l"(policy)
               : "memory");
#else
  (void)policy;
  *reinterpret_cast<uint4*>(ptr) = v;
#endif
}

// Shifted sums of one vector's elements: d = x - shift, s1 += d, s2 += d * d.
template <typename scalar_t>
__device__ __forceinline__ void add_vec(const uint4& r, float shift, float& s1, float& s2) {
#pragma unroll
  for (int j = 0; j < max_vec<scalar_t>(); ++j) {
    const float d = elt_to_float<scalar_t>(r, j) - shift;
    s1 += d;
    s2 = fmaf(d, d, s2);
  }
}

// Closes a batch of shifted sums over n elements into st (statistics of x - pivot).
__device__ __forceinline__ void close_batch(Welford<float>& st, float s1, float s2, float n, float shift, float pivot) {
  const float m = __fdividef(s1, n);
  st = combine_f(st, {(shift - pivot) + m, fmaxf(fmaf(-s1, m, s2), 0.f), n});
}

template <typename scalar_t, bool SILU>
__global__ void __launch_bounds__(kL2Threads, 2) l2_rows_kernel(FusedArgs<scalar_t> a) {
  constexpr int THREADS = kL2Threads;
  constexpr int VEC = max_vec<scalar_t>();
  constexpr int U = kL2Unroll;
  // 16-bit inputs fold the pivot into b_c (z = x * a_c + b_c): the rounding this adds, 2^-24 of |mean| /
  // std, is 2^-16 of what the input format's own rounding already carries. fp32 keeps x - pivot.
  constexpr bool kShift = sizeof(scalar_t) > 2;
  extern __shared__ float sh_chan[];  // [0, cpg): a_c = rstd * gamma, [cpg, 2 cpg): b_c
  __shared__ Welford<float> sh_warp[THREADS / 32];
  __shared__ Welford<float> sh_cta;

  const int tid = threadIdx.x;
  const auto [g, base, v0, mine] = cluster_part<THREADS, VEC>(a);
  const int full = mine / U * U;  // vectors in whole batches of U
  const unsigned e0 = static_cast<unsigned>((v0 + tid) * VEC);
  const float pivot = static_cast<float>(a.x[base]);
  const auto [keep, drop] = l2_policies();

  // Pass 1: batches of U vectors (all loads in flight, then shifted sums about the batch's first
  // element), then the remaining vectors as one more batch.
  Welford<float> st{0.f, 0.f, 0.f};
  {
    GroupPos p(e0, a);
    int k = 0;
    for (; k < full; k += U) {
      uint4 buf[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        buf[u] = load_hint(a.x + base + p.offset(a.fstride, a.S), keep);
        p.advance(a);
      }
      const float shift = elt_to_float<scalar_t>(buf[0], 0);
      float s1 = 0.f, s2 = 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u) add_vec<scalar_t>(buf[u], shift, s1, s2);
      close_batch(st, s1, s2, static_cast<float>(U * VEC), shift, pivot);
    }
    if (k < mine) {
      float shift = 0.f, s1 = 0.f, s2 = 0.f;
      for (int i = k; i < mine; ++i) {
        const uint4 r = load_hint(a.x + base + p.offset(a.fstride, a.S), keep);
        p.advance(a);
        if (i == k) shift = elt_to_float<scalar_t>(r, 0);
        add_vec<scalar_t>(r, shift, s1, s2);
      }
      close_batch(st, s1, s2, static_cast<float>((mine - k) * VEC), shift, pivot);
    }
  }
  st = cluster_combine<THREADS / 32>(st, a.K, sh_warp, &sh_cta);
  cluster_arrive();  // done reading the other CTAs' shared memory; the wait is just before exit

  fill_channel_table<THREADS>(a, g, st, pivot, kShift ? st.mean : st.mean + pivot, sh_chan);

  // Pass 2: the same vectors again (from L2), normalized and stored; whole batches, then the rest.
  {
    GroupPos p(e0, a);
    int k = 0;
    for (; k < full; k += U) {
      uint4 buf[U];
      const GroupPos p0 = p;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        buf[u] = load_hint(a.x + base + p.offset(a.fstride, a.S), drop);
        p.advance(a);
      }
      GroupPos q = p0;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        store_hint(a.out + base + q.offset(a.fstride, a.S),
                   norm_vec<scalar_t, SILU, kShift>(buf[u], q, a, pivot, sh_chan), drop);
        q.advance(a);
      }
    }
    for (; k < mine; ++k) {
      const int64_t off = base + p.offset(a.fstride, a.S);
      store_hint(a.out + off, norm_vec<scalar_t, SILU, kShift>(load_hint(a.x + off, drop), p, a, pivot, sh_chan),
                 drop);
      p.advance(a);
    }
  }
  cluster_wait();
}

// ---------------------------------------------------------------------------------------------
// Version 6 forward ("smem"), NC* and frames-major with 16-byte vectors, sm_90: x read once from DRAM
// into shared memory by the copy engine, y written once. Version 4 spends ~27 instructions an element
// (two passes of loads with their addresses, per-batch sums) and runs at 60-63 % of the copy rate,
// issue-bound. Here persistent clusters of K CTAs walk groups; each CTA's part of a group (<= 48 KB)
// lands in one of 2-4 shared-memory stages through bulk copies (no load instructions, no registers
// held), so while the CTA reduces and stores one group the next ones are already in flight. Two CTAs an
// SM: a CTA's barriers and reductions (serial latency: with one CTA of 512 threads an SM this design ran
// at 46 % of the copy rate) overlap the other's element work.
// Statistics from shared memory on d = x - pivot (the CTA's first element): 16-bit inputs take one pass
// of shifted sums (cluster_sums_pivoted); fp32 each thread's mean, then its squared deviations (two
// reads), merged with Chan's formula (cluster_combine_pivoted). Either way over the warp, the CTA and the
// cluster's CTAs in rank order (the pivots reconciled to rank 0's), so every CTA gets the same bits. Then
// z = x * a_c + b_c (16-bit inputs fold the pivot into b_c, as version 4) with SiLU, stored with 16-byte
// stores; the stage goes back to the copy engine after a block barrier.

// Two CTAs an SM of 256 threads (512 threads, or four CTAs with half the parts: measured no faster).
constexpr int kSmemThreads = 256;
constexpr int kSmemMaxStages = 4;
constexpr int64_t kSmemPartBytes = 48 * 1024;  // the part size K (up to 16) grows to stay under
constexpr int64_t kSmemDataBytes = 96 * 1024;  // stages * stage stride
// Parts over kSmemPartBytes (at K = 16) get one stage of up to this size: a CTA's next load then waits for
// its apply, but the SM's other CTA overlaps it. Measured against the two-pass kernels (H200): fp32
// (28, 960, 72, 128), 1.1 MB groups, 544 vs 722 us; bf16 frames-major (2, 640, 14, 36, 64), 1.3 MB, 66 vs 83.
constexpr int64_t kSmemBigPartBytes = kSmemDataBytes;
constexpr int64_t kSmemMaxCpg = kSmemThreads;  // a thread a channel: gamma and beta held in registers

template <typename scalar_t>
struct SmemArgs {
  FusedArgs<scalar_t> f;  // shape and pointers; f.part: vectors a CTA (the last rank's may be fewer)
  int64_t groups;         // N * G
  int stages;
  int stage_bytes;        // the stride between stages (a multiple of 128)
};

// The cluster exchange of version 6, without cluster barriers: a barrier's release is a GPU-scope memory
// fence (MEMBAR.ALL.GPU) that waits for the CTA's outstanding stores of y, every group (ncu: 0.7 stall
// cycles an instruction on it). Instead thread 0 writes the CTA's value into slot `rank` of every CTA's
// buffer with st.async, which completes bytes on that CTA's mbarrier; each CTA waits on its own. Buffers
// and barriers alternate by iteration parity: a CTA can only send group it + 2's value after every CTA
// sent it + 1's, i.e. after they all finished reading group it's slots.
struct ClusterExchange {
  float4 (*slots)[16];  // [parity][source rank]: clusters of up to 16
  uint64_t* bars;      // [parity], arrival count 1, K * 16 bytes a phase
  int K, rank;
};

// The backward's exchange of m1 and m2 for group iteration it (versions 7 and 10). Exchange indices must run
// consecutively, so that buffers alternate: a CTA sends index e + 2 only after every CTA sent e + 1, i.e. read e's
// slots. Given the forward's statistics it is the group's only exchange (index it); else the statistics' exchange
// takes 2 it and this one 2 it + 1.
__device__ __forceinline__ int64_t grad_exchange_index(bool stats_given, int64_t it) {
  return stats_given ? it : 2 * it + 1;
}

// Returns, in lane l < K of every warp, rank l's value of iteration it (zeros in the other lanes).
__device__ __forceinline__ float4 cluster_exchange(const ClusterExchange& x, float4 v, int64_t it) {
  const int b = static_cast<int>(it & 1);
  const int lane = threadIdx.x & 31;
  if (x.K == 1) {  // no cluster (st.async needs a cluster of two or more): a shared slot and a block barrier
    if (threadIdx.x == 0) x.slots[b][0] = v;
    __syncthreads();
    return lane == 0 ? x.slots[b][0] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const uint32_t bar = static_cast<uint32_t>(__cvta_generic_to_shared(&x.bars[b]));
  if (threadIdx.x == 0) {
    wgmma::mbar_expect_tx(bar, static_cast<uint32_t>(x.K) * 16u);
    const uint32_t slot = static_cast<uint32_t>(__cvta_generic_to_shared(&x.slots[b][x.rank]));
    for (int r = 0; r < x.K; ++r)
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n"
                   :
                   : "r"(cluster_map(slot, r)), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(cluster_map(bar, r))
                   : "memory");
  }
  wgmma::mbar_wait(bar, static_cast<uint32_t>(it >> 1) & 1u);
  return lane < x.K ? x.slots[b][lane] : make_float4(0.f, 0.f, 0.f, 0.f);
}

// The merge over a cluster's ranks, lane r < K holding rank r's r = (mean of x - pivot_r, m2, n, pivot_r) (zeros in
// the other lanes): the group's (mean of x - pivot0, m2, n) in every lane, pivot0 rank 0's pivot, the same bits in
// every CTA. Rank r's mean relative to rank 0's pivot is mean + (pivot_r - pivot_0); a rank with no elements
// (n = 0) carries weight 0.
__device__ __forceinline__ Welford<float> ranks_combine_pivoted(const float4 r, float& pivot0) {
  pivot0 = __shfl_sync(kFullMask, r.w, 0);
  Welford<float> t{r.z > 0.f ? r.x + (r.w - pivot0) : 0.f, r.y, r.z};
  t = warp_combine_f(t);
  return {__shfl_sync(kFullMask, t.mean, 0), __shfl_sync(kFullMask, t.m2, 0), __shfl_sync(kFullMask, t.n, 0)};
}

// The same for shifted sums, lane r < K holding rank r's (sum of x - pivot_r, sum of its square, n, pivot_r):
// each rank's sums moved to rank 0's pivot, added in a fixed order (xor butterflies).
__device__ __forceinline__ Welford<float> ranks_sums_pivoted(const float4 r, int K, float& pivot0) {
  const int lane = threadIdx.x & 31;
  pivot0 = __shfl_sync(kFullMask, r.w, 0);
  const float dl = lane < K ? r.w - pivot0 : 0.f;
  float S1 = fmaf(r.z, dl, r.x), S2 = fmaf(dl, fmaf(r.z, dl, 2.f * r.x), r.y), N = r.z;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    S1 += __shfl_xor_sync(kFullMask, S1, o);
    S2 += __shfl_xor_sync(kFullMask, S2, o);
    N += __shfl_xor_sync(kFullMask, N, o);
  }
  const float mean = __fdividef(S1, N);
  return {mean, fmaxf(fmaf(-S1, mean, S2), 0.f), N};
}

// This CTA's statistics as (mean of x - pivot, m2, n, pivot): what the cluster's CTAs exchange.
template <int THREADS>
__device__ __forceinline__ Welford<float> cluster_combine_pivoted(const float4 mine, const ClusterExchange& x,
                                                                  int64_t it, Welford<float>* sh_warp, float& pivot0) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  Welford<float> s = warp_combine_f({mine.x, mine.y, mine.z});
  if (lane == 0) sh_warp[warp] = s;
  __syncthreads();
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  if (threadIdx.x == 0) {
    Welford<float> t = sh_warp[0];
#pragma unroll
    for (int i = 1; i < THREADS / 32; ++i) t = combine_f(t, sh_warp[i]);
    v = make_float4(t.mean, t.m2, t.n, mine.w);
  }
  return ranks_combine_pivoted(cluster_exchange(x, v, it), pivot0);  // thread 0's value is sent
}

// 16-bit inputs: the CTA's shifted sums s1 = sum(x - pivot), s2 = sum((x - pivot)^2) over n elements, summed
// over the CTA and then the cluster's CTAs (each rank's sums moved to rank 0's pivot first), all in a
// fixed order (xor butterflies give every lane the same bits): the group's (mean of x - pivot_0, m2, n).
// Plain sums cost ~4x fewer instructions a thread than Chan's merges; the price is cancellation in
// m2 = S2 - S1^2 / n when the pivot lies far out in the group's spread (a relative error of about
// 6e-8 * (1 + ((pivot - mean) / std)^2): 6e-6 for a pivot 10 spreads out, below 16-bit rounding).
template <int THREADS>
__device__ __forceinline__ Welford<float> cluster_sums_pivoted(float s1, float s2, float n, float pivot,
                                                               const ClusterExchange& x, int64_t it, float2* sh_warp,
                                                               float& pivot0) {
  constexpr int WARPS = THREADS / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    s1 += __shfl_xor_sync(kFullMask, s1, o);
    s2 += __shfl_xor_sync(kFullMask, s2, o);
  }
  if (lane == 0) sh_warp[warp] = make_float2(s1, s2);
  __syncthreads();
  float2 t = make_float2(0.f, 0.f);
  if (warp == 0) {
    t = lane < WARPS ? sh_warp[lane] : t;
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      t.x += __shfl_xor_sync(kFullMask, t.x, o);
      t.y += __shfl_xor_sync(kFullMask, t.y, o);
    }
  }
  // thread 0's value is sent
  return ranks_sums_pivoted(cluster_exchange(x, make_float4(t.x, t.y, n, pivot), it), x.K, pivot0);
}

// The ring of shared-memory stages of versions 6 and 7. start: thread 0 initializes the stages' barriers and the
// cluster exchange's and issues the first stages' loads; every CTA's exchange barriers are ready before any CTA
// of the cluster sends to them. release: after a block barrier (every thread is done with the stage) thread 0
// hands it back to the copy engine for iteration it + stages.
struct StageRing {
  int stage = 0;
  uint32_t parity = 0;
  // bars: a stage's barriers, at bar0 + 8 * (stage * bars + i) (version 7's chunks; one elsewhere).
  template <typename Issue>
  __device__ __forceinline__ void start(uint32_t bar0, int stages, uint64_t* xbars, Issue&& issue, int bars = 1) {
    if (threadIdx.x == 0) {
      for (int s = 0; s < stages * bars; ++s) wgmma::mbar_init(bar0 + 8 * s, 1);
      for (int b = 0; b < 2; ++b) wgmma::mbar_init(static_cast<uint32_t>(__cvta_generic_to_shared(&xbars[b])), 1);
      wgmma::mbar_init_fence();
      for (int s = 0; s < stages; ++s) issue(s, s);
    }
    cluster_arrive();
    cluster_wait();
  }
  template <typename Issue>
  __device__ __forceinline__ void release(int64_t it, int stages, Issue&& issue) {
    __syncthreads();
    if (threadIdx.x == 0) issue(it + stages, stage);
    advance(stages);
  }
  // The next stage, when the caller has issued this one's next item itself.
  __device__ __forceinline__ void advance(int stages) {
    if (++stage == stages) {
      stage = 0;
      parity ^= 1;
    }
  }
};

// Version 6's statistics of a CTA's part in shared memory (nv vectors at buf), over the cluster through
// exchange `it` of xch: the group's (mean of x - pivot0, m2, n), pivot0 rank 0's first element.
template <typename scalar_t, int THREADS>
__device__ __forceinline__ Welford<float> smem_part_stats(const uint4* buf, int nv, const ClusterExchange& xch,
                                                          int64_t it, Welford<float>* sh_warp, float2* sh_sums,
                                                          float& pivot0) {
  constexpr int VEC = max_vec<scalar_t>();
  const int tid = threadIdx.x;
  // Statistics of d = x - pivot, pivot the CTA's first element.
  const float pivot = nv > 0 ? elt_to_float<scalar_t>(buf[0], 0) : 0.f;
  Welford<float> st;
  // f(x0 - c, x1 - c) on the element pairs of this thread's vectors (two accumulators each for latency).
  auto pairs = [&](float c, auto&& f) {
#pragma unroll 2
    for (int k = tid; k < nv; k += THREADS) {
      const uint4 r = buf[k];
#pragma unroll
      for (int j = 0; j < VEC; j += 2) f(elt_to_float<scalar_t>(r, j) - c, elt_to_float<scalar_t>(r, j + 1) - c);
    }
  };
  if constexpr (sizeof(scalar_t) == 2) {  // one pass of shifted sums
    float s1a = 0.f, s1b = 0.f, s2a = 0.f, s2b = 0.f;
    pairs(pivot, [&](float d0, float d1) {
      s1a += d0;
      s1b += d1;
      s2a = fmaf(d0, d0, s2a);
      s2b = fmaf(d1, d1, s2b);
    });
    st = cluster_sums_pivoted<THREADS>(s1a + s1b, s2a + s2b, static_cast<float>(nv * VEC), pivot, xch, it, sh_sums,
                                       pivot0);
  } else {  // fp32: each thread's mean, then its squared deviations; Chan's merges (robust to any pivot)
    const int mine = nv > tid ? (nv - tid + THREADS - 1) / THREADS : 0;
    float s0 = 0.f, s1 = 0.f;
    pairs(pivot, [&](float d0, float d1) {
      s0 += d0;
      s1 += d1;
    });
    const float n = static_cast<float>(mine * VEC);
    const float m = mine ? (s0 + s1) / n : 0.f;
    const float c = pivot + m;  // x - c: the deviation about this thread's mean, to float rounding of c
    float q0 = 0.f, q1 = 0.f;
    pairs(c, [&](float d0, float d1) {
      q0 = fmaf(d0, d0, q0);
      q1 = fmaf(d1, d1, q1);
    });
    st = cluster_combine_pivoted<THREADS>(make_float4(m, q0 + q1, n, pivot), xch, it, sh_warp, pivot0);
  }
  return st;
}

template <typename scalar_t, bool SILU, bool FM>
__global__ void __launch_bounds__(kSmemThreads, 2) smem_rows_kernel(const SmemArgs<scalar_t> sa) {
  constexpr int THREADS = kSmemThreads;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int VEC = max_vec<scalar_t>();
  constexpr bool kShift = sizeof(scalar_t) > 2;
  const FusedArgs<scalar_t>& a = sa.f;
  extern __shared__ __align__(128) unsigned char smem[];  // [stages][stage_bytes], channel table, barriers
  float* sh_chan = reinterpret_cast<float*>(smem + static_cast<size_t>(sa.stages) * sa.stage_bytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(sh_chan + 2 * ((a.cpg + 1) / 2 * 2));
  __shared__ Welford<float> sh_warp[THREADS / 32];
  __shared__ float2 sh_sums[THREADS / 32];
  __shared__ float4 sh_slots[2][16];  // cluster_exchange's buffers and barriers
  __shared__ uint64_t sh_xbars[2];

  const int tid = threadIdx.x, K = a.K;
  const int rank = static_cast<int>(blockIdx.x % K);
  const int64_t cluster = blockIdx.x / K, nclusters = gridDim.x / K;
  const int Mv = a.M / VEC;
  const int v0 = rank * a.part;
  const int nv = max(0, min(v0 + a.part, Mv) - v0);  // this CTA's vectors of every group
  const int stages = sa.stages;
  const uint32_t smem0 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(full));

  // Thread 0 hands the copy engine iteration it's part: one bulk copy per segment it touches.
  auto issue = [&](int64_t it, int stage) {
    const int64_t ng = cluster + it * nclusters;
    if (ng >= sa.groups || nv == 0) return;
    const int64_t base = (ng / a.G) * a.nstride + (ng % a.G) * a.seg;
    const uint32_t bar = bar0 + 8 * stage;
    wgmma::mbar_expect_tx(bar, static_cast<uint32_t>(nv) * 16u);
    uint32_t dst = smem0 + static_cast<uint32_t>(stage) * sa.stage_bytes;
    int e = v0 * VEC;
    const int e1 = (v0 + nv) * VEC;
    while (e < e1) {
      const int f = e / a.seg, within = e - f * a.seg;
      const int len = min(a.seg - within, e1 - e);
      const uint32_t bytes = static_cast<uint32_t>(len) * sizeof(scalar_t);
      wgmma::bulk_load(dst, a.x + base + f * a.fstride + within, bytes, bar);
      dst += bytes;
      e += len;
    }
  };

  const ClusterExchange xch{sh_slots, sh_xbars, K, rank};
  StageRing ring;
  ring.start(bar0, stages, sh_xbars, issue);

  for (int64_t it = 0;; ++it) {
    const int stage = ring.stage;
    const int64_t ng = cluster + it * nclusters;
    if (ng >= sa.groups) break;
    const int64_t g = ng % a.G, base = (ng / a.G) * a.nstride + g * a.seg;
    const uint4* buf = reinterpret_cast<const uint4*>(smem + static_cast<size_t>(stage) * sa.stage_bytes);
    // This group's gamma and beta, in flight while the statistics are taken.
    float gw = 1.f, gb = 0.f;
    if (tid < a.cpg) {
      if (a.w) gw = static_cast<float>(a.w[g * a.cpg + tid]);
      if (a.b) gb = static_cast<float>(a.b[g * a.cpg + tid]);
    }
    if (nv > 0) wgmma::mbar_wait(bar0 + 8 * stage, ring.parity);

    float pivot0;
    const Welford<float> st = smem_part_stats<scalar_t, THREADS>(buf, nv, xch, it, sh_warp, sh_sums, pivot0);
    {
      const float rstd = rsqrtf(__fdividef(st.m2, st.n) + static_cast<float>(a.eps));
      const float shift = kShift ? st.mean : st.mean + pivot0;
      if (tid < a.cpg) {
        sh_chan[tid] = rstd * gw;
        sh_chan[a.cpg + tid] = fmaf(-shift, rstd * gw, gb);
      }
      if (a.stats.p && tid == 0 && rank == 0) a.stats.write(ng, pivot0, st.mean, rstd);
      __syncthreads();
    }

    // Normalize, SiLU and store this CTA's vectors.
    {
      GroupWalk<FM> p(static_cast<unsigned>((v0 + tid) * VEC), a);
      scalar_t* out = a.out + base;
#pragma unroll 4
      for (int k = tid; k < nv; k += THREADS) {
        const uint4 in = buf[k];  // one 16-byte shared load (a reference into the stage compiled to four)
        *reinterpret_cast<uint4*>(out + p.off) = norm_vec<scalar_t, SILU, kShift>(in, p, a, pivot0, sh_chan);
        p.advance(a, THREADS * VEC);
      }
    }
    ring.release(it, stages, issue);
  }
  // No CTA leaves while another's sends to it may be in flight.
  cluster_arrive();
  cluster_wait();
#endif
}

// ---------------------------------------------------------------------------------------------
// Version 12 forward ("stream"), NC* and frames-major groups past version 6's clusters, sm_90: x read once from
// DRAM, y written once, in one launch. The two-pass kernels read x twice (67 % of the copy figure at best), and
// the designs that held a whole group on chip (version 9: the grid as one cluster; version 11: a lag through L2)
// coupled every CTA to the slowest one at each group. Here a group's segments are cut into tiles of up to
// kStreamTileBytes, numbered group by group, and one CTA an SM runs with specialised warps:
//   producer (one thread): whenever a stage of its ring is free, takes the next tile number from a device-wide
//     counter and bulk-copies the tile into the stage. A slow SM takes fewer tiles instead of holding back the
//     groups it has a part of (the prototype's best fixed round robin ran 2-25 % slower);
//   reducers (4 warps): each tile's statistics (each thread's sums about its first element, taken as offsets from
//     the tile's first element and merged with Chan's formula), written to the tile's slot in global memory: four
//     words (pivot, mean offset, m2, n), each nonzero once written (a zero is stored as -0), so no fence is needed;
//   merger (1 warp): at each new group of the CTA's tiles, waits for the group's slots, merges them in a fixed
//     order about the first tile's pivot (the same bits in every CTA) and fills a channel table (scale, shift) and the
//     group's statistics (written by the CTA holding the group's first tile);
//   normalizers (8 warps): y = act((x - pivot) * scale + shift) from the stage (16-bit: x * scale + shift, the
//     pivot in the shift), 16-byte stores; the stage goes back to the producer when they, the reducers and the
//     merger are done with it.
// Every thread that reads a stage or a table arrives on its barrier itself (one arrival a warp after __syncwarp
// left racecheck reporting the reads as racing the next fill). Nothing waits for another CTA's normalizers: a
// table waits only for reducers, which read stages that are already loaded. Tiles are taken in increasing order,
// so every tile below the last one taken is held by a running CTA and gets reduced; the rings of the resident
// grid (P * stages tiles) hold more than a group's Q tiles (the host checks), so the grid cannot fill with
// tiles of a group that is still being taken.

constexpr int kStreamTileBytes = 32 * 1024;  // a stage, at most (StreamArgs::stage_bytes)
constexpr int kStreamMaxStages = 8;
constexpr int kStreamReduceWarps = 4;
constexpr int kStreamNormWarps = 8;
constexpr int kStreamThreads = 32 * (2 + kStreamReduceWarps + kStreamNormWarps);
constexpr int kStreamTabs = 8;              // channel tables in flight (groups merged ahead of the normalizers)
constexpr int kStreamMaxCpg = 64;
constexpr int kStreamMaxSlotsPerLane = 16;  // the merger's lanes hold a group's slots: Q <= 512
constexpr int kStreamReduceBar = 1;         // named barrier of the reducers (0 is __syncthreads)

template <typename scalar_t>
struct StreamArgs {
  const scalar_t* x;
  scalar_t* out;
  const scalar_t* w;  // nullptr: gamma = 1
  const scalar_t* b;  // nullptr: beta = 0
  int64_t nstride;    // elements between samples
  int64_t fstride;    // elements between a group's segments (frames-major), else unused
  int64_t tiles;      // N * G * Q
  int G, cpg, Qs, Q;  // groups a sample, channels a group, tiles a segment, tiles a group
  int seg, S;         // elements of a segment (cpg * S) and of a channel in it; seg < 2^31
  int te;             // elements a tile (whole vectors; a segment's last tile may hold fewer)
  int stages, stage_bytes;  // the ring: stages * stage_bytes bytes of dynamic shared memory, te <= a stage
  float eps;
  uint4* slots;       // a slot a tile, zeroed before the launch
  unsigned* counter;  // the next tile to take, zeroed before the launch
  StatsOut stats;
};

// A float as a slot word that is never 0 (0 means "not written yet"): +0 is stored as -0.
__device__ __forceinline__ unsigned slot_word(float v) {
  const unsigned u = __float_as_uint(v);
  return u == 0u ? 0x80000000u : u;
}

__device__ __forceinline__ void st_relaxed_v4(uint4* p, const uint4& v) {
  asm volatile("st.relaxed.gpu.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}
__device__ __forceinline__ uint4 ld_relaxed_v4(const uint4* p) {
  uint4 v;
  asm volatile("ld.relaxed.gpu.global.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ bool slot_ready(const uint4& v) {
  return v.x != 0u && v.y != 0u && v.z != 0u && v.w != 0u;
}

// Where tile t lies: its group (-1: no more tiles), its index in the group, its first element and its element
// count; o is its offset in its segment. The producer works it out once and leaves it beside the stage.
struct StreamTile {
  int64_t g, first;
  int q, o, n;
};

// Where each role is in the ring: tile k sits in stage k % stages on lap k / stages (the parity its barriers wait
// for). Stepped rather than divided: the stage count is an argument, and a division a tile sat on every role's path.
struct RingStep {
  int s = 0;
  uint32_t lap = 0;
  __device__ __forceinline__ void next(int stages) {
    if (++s == stages) {
      s = 0;
      lap ^= 1u;
    }
  }
};

template <typename scalar_t>
__device__ __forceinline__ StreamTile stream_tile(const StreamArgs<scalar_t>& a, int64_t t) {
  StreamTile tl;
  tl.g = t / a.Q;
  tl.q = static_cast<int>(t - tl.g * a.Q);
  const int f = tl.q / a.Qs, qs = tl.q - f * a.Qs;
  const int64_t n_ = tl.g / a.G, gi = tl.g - n_ * a.G;
  tl.o = qs * a.te;
  tl.n = min(a.te, a.seg - tl.o);
  tl.first = n_ * a.nstride + f * a.fstride + gi * a.seg + tl.o;
  return tl;
}

template <typename scalar_t, bool SILU>
__device__ __forceinline__ void stream_rows(const StreamArgs<scalar_t>& a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int VEC = max_vec<scalar_t>();
  constexpr int TV = kStreamTileBytes / 16;  // 16-byte vectors a tile, at most
  // 16-bit x: the pivot folded into each channel's shift (y = x * scale + shift; the float rounding that adds,
  // ~2^-24 of |pivot * scale|, is far under x's own) and the normalizers' channel worked out once a run of it.
  // Float keeps x - pivot; its channel is worked out once a tile where the tile lies in one channel, else a vector
  // (a channel once a run, as 16-bit x has it, measured 3 % slower on its VAE row).
  constexpr bool kShift = sizeof(scalar_t) > 2;
  extern __shared__ __align__(128) unsigned char smem[];  // [a.stages][a.stage_bytes]
  __shared__ __align__(8) uint64_t full[kStreamMaxStages], empty[kStreamMaxStages];
  __shared__ __align__(8) uint64_t tfull[kStreamTabs], tempty[kStreamTabs];
  __shared__ StreamTile tinfo[kStreamMaxStages];       // the tile in each stage; g = -1: no more tiles
  __shared__ float2 ctab[kStreamTabs][kStreamMaxCpg];  // a group's (scale, shift) a channel
  __shared__ float tpivot[kStreamTabs];
  __shared__ Welford<float> red[2][kStreamReduceWarps];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  auto bar = [](const uint64_t& b) { return static_cast<uint32_t>(__cvta_generic_to_shared(&b)); };
  auto stage = [&](int s) {
    return reinterpret_cast<const uint4*>(smem + static_cast<size_t>(s) * a.stage_bytes);
  };
  if (tid == 0) {
    for (int s = 0; s < a.stages; ++s) {
      wgmma::mbar_init(bar(full[s]), 1);
      wgmma::mbar_init(bar(empty[s]), kStreamThreads - 32);  // every thread that reads it: all but the producer's
    }
    for (int e = 0; e < kStreamTabs; ++e) {
      wgmma::mbar_init(bar(tfull[e]), 32);
      wgmma::mbar_init(bar(tempty[e]), 32 * kStreamNormWarps);
    }
    wgmma::mbar_init_fence();
  }
  __syncthreads();

  if (warp == 0) {  // producer
    if (lane == 0) {
      const uint64_t drop = l2_policies().drop;  // x is read once: keep L2 for the slots and y
      RingStep ring;
      for (int k = 0;; ++k) {
        const int s = ring.s;
        if (k >= a.stages) wgmma::mbar_wait(bar(empty[s]), ring.lap ^ 1u);
        ring.next(a.stages);
        const int64_t t = atomicAdd(a.counter, 1u);
        if (t >= a.tiles) {
          tinfo[s].g = -1;
          wgmma::mbar_arrive(bar(full[s]));
          break;
        }
        const StreamTile tl = stream_tile(a, t);
        tinfo[s] = tl;
        const uint32_t bytes = static_cast<uint32_t>(tl.n) * sizeof(scalar_t);
        wgmma::mbar_expect_tx(bar(full[s]), bytes);
        wgmma::bulk_load_hint(static_cast<uint32_t>(__cvta_generic_to_shared(stage(s))), a.x + tl.first, bytes,
                              bar(full[s]), drop);
      }
    }
    return;
  }

  if (warp == 1) {  // merger
    int m = -1;
    int64_t gprev = -1;
    for (RingStep ring;; ring.next(a.stages)) {
      const int s = ring.s;
      wgmma::mbar_wait(bar(full[s]), ring.lap);
      const int64_t g = tinfo[s].g;
      const bool first = tinfo[s].q == 0;
      wgmma::mbar_arrive(bar(empty[s]));
      if (g < 0) break;
      if (g == gprev) continue;
      gprev = g;
      ++m;
      const int e = m % kStreamTabs;
      if (m >= kStreamTabs) wgmma::mbar_wait(bar(tempty[e]), (m / kStreamTabs - 1) & 1);
      const uint4* sl = a.slots + g * a.Q;
      const int c0 = static_cast<int>(g % a.G) * a.cpg;
      float gam[kStreamMaxCpg / 32], bet[kStreamMaxCpg / 32];
#pragma unroll
      for (int i = 0; i < kStreamMaxCpg / 32; ++i) {
        const int c = lane + 32 * i;
        gam[i] = c < a.cpg && a.w ? static_cast<float>(a.w[c0 + c]) : 1.f;
        bet[i] = c < a.cpg && a.b ? static_cast<float>(a.b[c0 + c]) : 0.f;
      }
      // One lane waits for the group's last tile (mostly the last one reduced), then the warp reads them all.
      if (lane == 0) {
        while (!slot_ready(ld_relaxed_v4(sl + a.Q - 1))) __nanosleep(256);
      }
      __syncwarp();
      uint4 v[kStreamMaxSlotsPerLane];
#pragma unroll
      for (int i = 0; i < kStreamMaxSlotsPerLane; ++i)
        if (lane + 32 * i < a.Q) v[i] = ld_relaxed_v4(sl + lane + 32 * i);
#pragma unroll
      for (int i = 0; i < kStreamMaxSlotsPerLane; ++i)
        if (lane + 32 * i < a.Q)
          while (!slot_ready(v[i])) {
            __nanosleep(128);
            v[i] = ld_relaxed_v4(sl + lane + 32 * i);
          }
      // Every tile's mean as an offset from the first tile's pivot, then Chan's merge in a fixed order (each lane's
      // tiles j = lane + 32 i in turn, then the warp's tree).
      const float pivot = __shfl_sync(kFullMask, __uint_as_float(v[0].x), 0);
      Welford<float> acc{0.f, 0.f, 0.f};
#pragma unroll
      for (int i = 0; i < kStreamMaxSlotsPerLane; ++i)
        if (lane + 32 * i < a.Q)
          acc = combine_f(acc, Welford<float>{(__uint_as_float(v[i].x) - pivot) + __uint_as_float(v[i].y),
                                              __uint_as_float(v[i].z), __uint_as_float(v[i].w)});
      acc = warp_combine_f(acc);
      const float mo = __shfl_sync(kFullMask, acc.mean, 0);
      const float var = __shfl_sync(kFullMask, acc.m2, 0) / __shfl_sync(kFullMask, acc.n, 0);
      const float rstd = rsqrtf(fmaxf(var, 0.f) + a.eps);
#pragma unroll
      for (int i = 0; i < kStreamMaxCpg / 32; ++i) {
        const int c = lane + 32 * i;
        if (c < a.cpg) {
          const float sc = gam[i] * rstd, sh = bet[i] - mo * sc;
          ctab[e][c] = make_float2(sc, kShift ? sh : fmaf(-pivot, sc, sh));
        }
      }
      if (lane == 0) {
        tpivot[e] = pivot;
        if (a.stats.p != nullptr && first) a.stats.write(g, pivot, mo, rstd);
      }
      wgmma::mbar_arrive(bar(tfull[e]));
    }
    return;
  }

  if (warp < 2 + kStreamReduceWarps) {  // reducers
    constexpr int RT = 32 * kStreamReduceWarps;
    const int rt = tid - 64, rw = warp - 2;
    RingStep ring;
    for (int k = 0;; ++k, ring.next(a.stages)) {
      const int s = ring.s;
      wgmma::mbar_wait(bar(full[s]), ring.lap);
      const StreamTile tl = tinfo[s];
      if (tl.g < 0) break;
      const uint4* st = stage(s);
      const int nv = tl.n / VEC;
      // One pass of sums about the thread's first element (two passes over the stage measured 15-17 % slower
      // on the whole kernel: the reducers are on its critical path), then as offsets from the tile's first.
      const float tp = elt_to_float<scalar_t>(st[0], 0);
      const float pt = rt < nv ? elt_to_float<scalar_t>(st[rt], 0) : tp;
      float s1 = 0.f, s2 = 0.f, cnt = 0.f;
#pragma unroll 4
      for (int i = 0; i < TV / RT; ++i) {
        const int vi = rt + i * RT;
        if (vi < nv) {
          const uint4 r = st[vi];
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float d = elt_to_float<scalar_t>(r, j) - pt;
            s1 += d;
            s2 = fmaf(d, d, s2);
          }
          cnt += VEC;
        }
      }
      wgmma::mbar_arrive(bar(empty[s]));  // done with the stage (its slot below is not)
      const float mt = cnt > 0.f ? s1 / cnt : 0.f;
      const Welford<float> w = warp_combine_f(Welford<float>{(pt - tp) + mt, fmaxf(s2 - s1 * mt, 0.f), cnt});
      const int b = k & 1;  // red[] alternates: one barrier a tile
      if (lane == 0) red[b][rw] = w;
      wgmma::named_sync(kStreamReduceBar, RT);
      if (rt == 0) {
        Welford<float> tw = red[b][0];
#pragma unroll
        for (int i = 1; i < kStreamReduceWarps; ++i) tw = combine_f(tw, red[b][i]);
        st_relaxed_v4(a.slots + tl.g * a.Q + tl.q,
                      make_uint4(slot_word(tp), slot_word(tw.mean), slot_word(tw.m2), slot_word(tw.n)));
      }
    }
    return;
  }

  // normalizers
  constexpr int NT = 32 * kStreamNormWarps, VPT = TV / NT;
  static_assert(TV % NT == 0, "a tile is whole vectors of every normalizer thread");
  const int nt = tid - 32 * (2 + kStreamReduceWarps);
  const float inv_S = 1.f / static_cast<float>(a.S);
  int m = -1, e = 0;
  int64_t gprev = -1;
  for (RingStep ring;; ring.next(a.stages)) {
    const int s = ring.s;
    wgmma::mbar_wait(bar(full[s]), ring.lap);
    const StreamTile tl = tinfo[s];
    if (tl.g < 0) break;
    if (tl.g != gprev) {
      if (m >= 0) wgmma::mbar_arrive(bar(tempty[e]));  // done with the last group's table
      ++m;
      gprev = tl.g;
      e = m % kStreamTabs;
      wgmma::mbar_wait(bar(tfull[e]), (m / kStreamTabs) & 1);
    }
    const float pivot = tpivot[e];  // unused for 16-bit x (kShift)
    const uint4* st = stage(s);
    const int nv = tl.n / VEC;
    uint4* y = reinterpret_cast<uint4*>(a.out + tl.first);
    uint4 r[VPT];
#pragma unroll
    for (int i = 0; i < VPT; ++i)
      if (nt + i * NT < nv) r[i] = st[nt + i * NT];
    // A vector's channel (the host asks S % VEC == 0, so a vector never straddles two): a float estimate of o / S,
    // corrected once (enough while o / S < cpg <= kStreamMaxCpg: the estimate is off by far less than one).
    auto channel = [&](int o) {
      int c = __float2int_rz(__int2float_rz(o) * inv_S);
      if (c * a.S > o) --c;
      else if ((c + 1) * a.S <= o) ++c;
      return c;
    };
    auto norm = [&](const uint4& v, float2 ss) {
      uint4 out;
#pragma unroll
      for (int j = 0; j < VEC; j += 2) {
        const float x0 = elt_to_float<scalar_t>(v, j), x1 = elt_to_float<scalar_t>(v, j + 1);
        float z0 = fmaf(kShift ? x0 - pivot : x0, ss.x, ss.y);
        float z1 = fmaf(kShift ? x1 - pivot : x1, ss.x, ss.y);
        if (SILU) {
          z0 = silu_fast(z0);
          z1 = silu_fast(z1);
        }
        store_pair<scalar_t>(out, j / 2, z0, z1);
      }
      return out;
    };
    if constexpr (kShift) {
      // Float: a tile within one channel (most of them: a channel of a large group is many tiles) takes one
      // (scale, shift), the others each vector's own channel.
      const int c0 = channel(tl.o);
      if ((c0 + 1) * a.S >= tl.o + tl.n) {
        const float2 ss = ctab[e][c0];
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
          const int vi = nt + i * NT;
          if (vi < nv) __stcs(y + vi, norm(r[i], ss));
        }
      } else {
#pragma unroll
        for (int i = 0; i < VPT; ++i) {
          const int vi = nt + i * NT;
          if (vi < nv) __stcs(y + vi, norm(r[i], ctab[e][channel(tl.o + vi * VEC)]));
        }
      }
    } else {
      // 16-bit: the channel and its (scale, shift) worked out at the thread's first vector and again only where a
      // vector passes the channel's end (the thread's offsets grow).
      int next = 0;  // where the next channel starts: 0 until the first vector
      float2 ss = make_float2(0.f, 0.f);
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        const int vi = nt + i * NT;
        if (vi < nv) {
          const int o = tl.o + vi * VEC;
          if (o >= next) {
            const int c = channel(o);
            next = (c + 1) * a.S;
            ss = ctab[e][c];
          }
          __stcs(y + vi, norm(r[i], ss));
        }
      }
    }
    wgmma::mbar_arrive(bar(empty[s]));
  }
#endif
}

// The arguments stay in the parameter block (__grid_constant__), each role reading those it uses where it uses them.
// Passed by value, nvcc loaded all of them into registers at the start, for every role (it did so for this block of
// 128 bytes, not for one of 136): 16-bit x 3-5 % slower (H200, bf16 VAE (14, 128, 576, 1024) 1240 against 1192 us).
template <typename scalar_t, bool SILU>
__global__ void __launch_bounds__(kStreamThreads, 1)
    stream_rows_kernel(const __grid_constant__ StreamArgs<scalar_t> a) {
  stream_rows<scalar_t, SILU>(a);
}

// ---------------------------------------------------------------------------------------------
// Version 13 forward ("stream" on channels_last), sm_90: version 12's ring, tile counter and specialised warps over
// channels_last blocks, for the rows version 8 cannot hold on chip (float32 960 channels at 72 x 128: 138 KB parts;
// the two-pass kernels read x twice). A block is gb groups of one sample: rows of W = gb * cpg channels, C apart; a
// tile is R rows of a block, brought in by one tensor copy (a box of W channels by R rows; several boxes where R >
// 256) into a ring of 4 stages filling the shared memory left (a bulk copy a row, 68 a tile, ran 7 % slower: 789 us
// against 733, and L2 prefetches of later tiles from the producer, more copies still, 55 % slower).
//   reducers (4 warps): per channel, each thread's sums about its first row; per group of the tile, those states
//     merged in a fixed order into the group's slot (pivot: the tile's first element of the group), stored relaxed,
//     each word nonzero once written (as version 12's);
//   counter (1 warp): counts each of the CTA's tiles on its block's counter once the reducers are done with it; the
//     one that counts a block's last tile hands the block to its CTA's
//   folders (4 warps): each merges some of the block's groups, a group's Q slots in slot order (waiting for any not
//     yet visible), and publishes the group's (pivot, mean offset, rstd) as one record, with the statistics for the
//     backward. Version 12's mergers read every slot of every group their CTA touches; here that would be a block's
//     Q tiles times gb groups, for nearly every block;
//   merger (1 warp): at each new block of the CTA's tiles, fetches gamma and beta, waits for the block's gb records
//     and fills a channel table;
//   normalizers (8 warps): each thread keeps one column of VEC channels, loads their (scale, shift) and pivots once
//     a block and hands the table back at once, then normalizes its rows of every tile of the block.
// Each step that took a wait off a block's completion mattered (H200, (28, 960, 72, 128) fp32, µs a call): counting
// and merging in the reducers (a fence and an atomic's round trip a group a tile; gb 8) 1542; one warp counting and
// folding (gb 4) 1719; the merger's gamma and beta in one round trip 1350; counting apart from folding 844 (likely:
// the CTA busy folding counted the next block last and folded it too); two folder warps, one load round a group, 768
// against the two-pass kernels' 777; tensor copies 733; 4 stages of the 209 KB the static arrays leave 684; four
// folder warps, a group each, 666 against 701 with two (bench/notes/norm_and_elementwise.md). Slower: the CTA that
// takes a block's last tile folding it at once (no counting; the folders wait on the slots), 821 against 716 us; each
// CTA's merger reading its blocks' slots itself (no counter, folders or records), 826 against 701.
// No wait depends on a normalizer of another CTA (records wait only for reducers, which read loaded stages), and
// tiles are taken in increasing order: as in version 12, the resident rings holding more than a block's Q tiles
// (the host checks) keeps the grid from filling with tiles of a block still being taken.

constexpr int kStreamColsMaxW = 256;  // channels a block
constexpr int kStreamColsMaxGb = 16;  // groups a block (a lane a group polls, merges)
constexpr int kStreamColsTabs = 4;    // channel tables in flight
constexpr int kStreamColsFoldWarps = 4;  // at most; StreamColsArgs::folders of them fold
constexpr int kStreamColsThreads = kStreamThreads + 32 * (1 + kStreamColsFoldWarps);  // + the counter and folders
constexpr int kStreamColsJobs = 8;       // blocks counted out, waiting for the folders
constexpr int kStreamColsStages = 4;
constexpr int kStreamColsMaxStages = 8;  // the ring cut finer (VD_GROUP_NORM_STREAM_COLS_STAGES)
constexpr int64_t kStreamColsMaxRing = 224 * 1024;

template <typename scalar_t>
struct StreamColsArgs {
  const scalar_t* x;
  scalar_t* out;
  const scalar_t* w;  // nullptr: gamma = 1
  const scalar_t* b;  // nullptr: beta = 0
  int64_t C;          // channels: elements between rows
  int64_t S;          // rows (spatial positions) a sample
  int64_t tiles;      // N * NB * Q
  int NB, gb, cpg, W, WV;  // blocks a sample, groups a block, channels a group and a block, vectors a row
  int Q, R;           // tiles a block, rows a tile (a block's last tile may hold fewer)
  int stages, stage_bytes;  // the ring: stages * stage_bytes bytes of dynamic shared memory
  int rbox;                 // rows a tensor-copy box (boxes of W channels; 0: a bulk copy a row instead)
  float eps;
  uint4* slots;       // [N * G][Q]: group ng's (pivot, mean offset, m2, n) in each tile of its block
  unsigned* done;     // [N * NB]: tiles counted a block
  uint4* fin;         // [N * G]: (pivot, mean offset, rstd, 1) once the group is merged
  unsigned* counter;  // the next tile to take; all four zeroed before the launch
  StatsOut stats;
  int folders;        // folder warps that fold (1 to kStreamColsFoldWarps; the others exit)
};

// Tile t: its block (n * NB + b; -1: no more tiles), its index q in the block, its first element and its rows.
struct StreamColsTile {
  int64_t blk, first;
  int q, rows;
};

template <typename scalar_t>
__device__ __forceinline__ StreamColsTile stream_cols_tile(const StreamColsArgs<scalar_t>& a, int64_t t) {
  StreamColsTile tl;
  tl.blk = t / a.Q;
  tl.q = static_cast<int>(t - tl.blk * a.Q);
  const int64_t n = tl.blk / a.NB, r0 = static_cast<int64_t>(tl.q) * a.R;
  tl.rows = static_cast<int>(min(static_cast<int64_t>(a.R), a.S - r0));
  tl.first = (n * a.S + r0) * a.C + (tl.blk - n * a.NB) * a.W;
  return tl;
}

template <typename scalar_t, bool SILU>
__global__ void __launch_bounds__(kStreamColsThreads, 1)
    stream_cols_kernel(const StreamColsArgs<scalar_t> a, const __grid_constant__ CUtensorMap tx) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int VEC = max_vec<scalar_t>();
  constexpr int RT = 32 * kStreamReduceWarps, NT = 32 * kStreamNormWarps;
  extern __shared__ __align__(128) unsigned char smem[];  // [a.stages][a.stage_bytes]
  __shared__ __align__(8) uint64_t full[kStreamColsMaxStages], empty[kStreamColsMaxStages],
      rdone[kStreamColsMaxStages];
  __shared__ __align__(8) uint64_t tfull[kStreamColsTabs], tempty[kStreamColsTabs];
  __shared__ __align__(8) uint64_t jfull[kStreamColsJobs], jempty[kStreamColsJobs];
  __shared__ int64_t job[kStreamColsJobs];                   // the block to fold; -1: no more
  __shared__ StreamColsTile tinfo[kStreamColsMaxStages];
  __shared__ float2 ctab[kStreamColsTabs][kStreamColsMaxW];  // (scale, shift) a channel of the block
  __shared__ float tpiv[kStreamColsTabs][kStreamColsMaxGb];  // a group's pivot
  __shared__ float2 cst[2][RT * VEC];                         // per row set and channel: (mean offset, m2)
  __shared__ float ccnt[2][RT];                               // rows a row set
  __shared__ float tpg[2][kStreamColsMaxGb];                  // the tile's pivot a group
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  auto bar = [](const uint64_t& b) { return static_cast<uint32_t>(__cvta_generic_to_shared(&b)); };
  auto stage = [&](int s) {
    return reinterpret_cast<const uint4*>(smem + static_cast<size_t>(s) * a.stage_bytes);
  };
  if (tid == 0) {
    for (int s = 0; s < a.stages; ++s) {
      wgmma::mbar_init(bar(full[s]), 1);
      // Every thread that reads it: all but the producer and the folders.
      wgmma::mbar_init(bar(empty[s]), kStreamColsThreads - 32 * (1 + kStreamColsFoldWarps));
      wgmma::mbar_init(bar(rdone[s]), kStreamReduceWarps);        // the reducers' slots of the tile are stored
    }
    for (int e = 0; e < kStreamColsTabs; ++e) {
      wgmma::mbar_init(bar(tfull[e]), 32);
      wgmma::mbar_init(bar(tempty[e]), NT);
    }
    for (int e = 0; e < kStreamColsJobs; ++e) {
      wgmma::mbar_init(bar(jfull[e]), 1);
      wgmma::mbar_init(bar(jempty[e]), 32 * a.folders);  // every folder thread that read job[e]
    }
    wgmma::mbar_init_fence();
  }
  __syncthreads();

  if (warp == 0) {  // producer: lane 0 takes the tile, every lane copies rows
    const uint64_t drop = l2_policies().drop;
    const uint32_t row_bytes = static_cast<uint32_t>(a.W) * sizeof(scalar_t);
    for (int k = 0;; ++k) {
      const int s = k % a.stages;
      int64_t t = 0;
      if (lane == 0) {
        if (k >= a.stages) wgmma::mbar_wait(bar(empty[s]), (k / a.stages - 1) & 1);
        t = atomicAdd(a.counter, 1u);
      }
      t = __shfl_sync(kFullMask, t, 0);
      if (t >= a.tiles) {
        if (lane == 0) {
          tinfo[s].blk = -1;
          wgmma::mbar_arrive(bar(full[s]));
        }
        break;
      }
      const StreamColsTile tl = stream_cols_tile(a, t);
      const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(stage(s)));
      if (a.rbox > 0) {
        // Tensor copies of rbox rows. A block's last tile: its last box runs past the sample, and the zeros the copy
        // engine writes for those rows (counted in the bytes) land in rows no one reads.
        if (lane == 0) {
          tinfo[s] = tl;
          const int nbox = (tl.rows + a.rbox - 1) / a.rbox;
          wgmma::mbar_expect_tx(bar(full[s]), static_cast<uint32_t>(nbox * a.rbox) * row_bytes);
          const int n = static_cast<int>(tl.blk / a.NB), c0 = static_cast<int>(tl.blk - int64_t{n} * a.NB) * a.W;
          for (int i = 0; i < nbox; ++i)
            wgmma::tma_load_4d_hint(dst + static_cast<uint32_t>(i * a.rbox) * row_bytes, &tx, bar(full[s]), c0,
                                    tl.q * a.R + i * a.rbox, n, 0, drop);
        }
      } else {
        if (lane == 0) {
          tinfo[s] = tl;
          wgmma::mbar_expect_tx(bar(full[s]), static_cast<uint32_t>(tl.rows) * row_bytes);
        }
        __syncwarp();
        for (int r = lane; r < tl.rows; r += 32)
          wgmma::bulk_load_hint(dst + r * row_bytes, a.x + tl.first + static_cast<int64_t>(r) * a.C, row_bytes,
                                bar(full[s]), drop);
      }
    }
    return;
  }

  if (warp == 1) {  // merger
    int m = -1;
    int64_t bprev = -1;
    for (int k = 0;; ++k) {
      const int s = k % a.stages;
      wgmma::mbar_wait(bar(full[s]), (k / a.stages) & 1);
      const int64_t blk = tinfo[s].blk;
      wgmma::mbar_arrive(bar(empty[s]));
      if (blk < 0) break;
      if (blk == bprev) continue;
      bprev = blk;
      ++m;
      const int e = m % kStreamColsTabs;
      if (m >= kStreamColsTabs) wgmma::mbar_wait(bar(tempty[e]), (m / kStreamColsTabs - 1) & 1);
      // gamma and beta first (independent of the records; one round trip for the block's W channels): the merger
      // fills a table for nearly every block, and a round trip a 32 channels made it the kernel's slowest role.
      const int c0 = static_cast<int>(blk % a.NB) * a.W;
      float gam[kStreamColsMaxW / 32], bet[kStreamColsMaxW / 32];
#pragma unroll
      for (int i = 0; i < kStreamColsMaxW / 32; ++i) {
        const int c = lane + 32 * i;
        gam[i] = c < a.W && a.w ? static_cast<float>(a.w[c0 + c]) : 1.f;
        bet[i] = c < a.W && a.b ? static_cast<float>(a.b[c0 + c]) : 0.f;
      }
      uint4 f = make_uint4(0u, 0u, 0u, 0u);
      if (lane < a.gb) {
        const uint4* p = a.fin + blk * a.gb + lane;
        f = ld_relaxed_v4(p);
        while (!slot_ready(f)) {
          __nanosleep(64);
          f = ld_relaxed_v4(p);
        }
        tpiv[e][lane] = __uint_as_float(f.x);
      }
#pragma unroll
      for (int i = 0; i < kStreamColsMaxW / 32; ++i) {  // every lane shuffles (a source lane a group)
        const int c = lane + 32 * i, gi = min(c, a.W - 1) / a.cpg;
        const float mo = __uint_as_float(__shfl_sync(kFullMask, f.y, gi));
        const float rstd = __uint_as_float(__shfl_sync(kFullMask, f.z, gi));
        if (c < a.W) {
          const float sc = gam[i] * rstd;
          ctab[e][c] = make_float2(sc, bet[i] - mo * sc);
        }
      }
      wgmma::mbar_arrive(bar(tfull[e]));
    }
    return;
  }

  if (warp < 2 + kStreamReduceWarps) {  // reducers
    const int rt = tid - 64, rw = warp - 2;
    const int RS = RT / a.WV, col = rt % a.WV, rs = rt / a.WV;  // row sets of one column a thread
    const bool active = rs < RS;
    for (int k = 0;; ++k) {
      const int s = k % a.stages;
      wgmma::mbar_wait(bar(full[s]), (k / a.stages) & 1);
      const StreamColsTile tl = tinfo[s];
      if (tl.blk < 0) break;
      const uint4* st = stage(s);
      const scalar_t* se = reinterpret_cast<const scalar_t*>(st);
      const int b = k & 1;  // the tile's shared arrays alternate: one barrier a tile
      if (rt < a.gb) tpg[b][rt] = static_cast<float>(se[rt * a.cpg]);
      if (active) {
        // Sums about the thread's first row, channel by channel (the loads are independent of the sums).
        float p[VEC], s1[VEC], s2[VEC];
        float cnt = 0.f;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          p[j] = 0.f;
          s1[j] = 0.f;
          s2[j] = 0.f;
        }
        if (rs < tl.rows) {
          const uint4 r0 = st[rs * a.WV + col];
#pragma unroll
          for (int j = 0; j < VEC; ++j) p[j] = elt_to_float<scalar_t>(r0, j);
        }
#pragma unroll 4
        for (int r = rs; r < tl.rows; r += RS) {
          const uint4 v = st[r * a.WV + col];
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const float d = elt_to_float<scalar_t>(v, j) - p[j];
            s1[j] += d;
            s2[j] = fmaf(d, d, s2[j]);
          }
          cnt += 1.f;
        }
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const int c = col * VEC + j;
          const float tp = static_cast<float>(se[(c / a.cpg) * a.cpg]);
          const float mt = cnt > 0.f ? s1[j] / cnt : 0.f;
          cst[b][rs * a.W + c] =
              cnt > 0.f ? make_float2((p[j] - tp) + mt, fmaxf(s2[j] - s1[j] * mt, 0.f)) : make_float2(0.f, 0.f);
        }
        if (col == 0) ccnt[b][rs] = cnt;
      }
      wgmma::mbar_arrive(bar(empty[s]));  // done with the stage
      wgmma::named_sync(kStreamReduceBar, RT);
      const int ns = a.cpg * RS;  // channel states a group
      for (int gi = rw; gi < a.gb; gi += kStreamReduceWarps) {
        Welford<float> acc{0.f, 0.f, 0.f};
        for (int i = lane; i < ns; i += 32) {  // a fixed order: row set by row set, channel by channel
          const int r = i / a.cpg, c = gi * a.cpg + (i - r * a.cpg);
          const float2 v = cst[b][r * a.W + c];
          acc = combine_f(acc, Welford<float>{v.x, v.y, ccnt[b][r]});
        }
        acc = warp_combine_f(acc);
        if (lane == 0)
          st_relaxed_v4(a.slots + (tl.blk * a.gb + gi) * a.Q + tl.q,
                        make_uint4(slot_word(tpg[b][gi]), slot_word(acc.mean), slot_word(acc.m2), slot_word(acc.n)));
      }
      __syncwarp();
      if (lane == 0) wgmma::mbar_arrive(bar(rdone[s]));  // after this lane's stores (their visibility: see the folder)
    }
    return;
  }

  if (warp == 2 + kStreamReduceWarps + kStreamNormWarps) {  // counter
    int j = 0;  // fold jobs posted
    for (int k = 0;; ++k) {
      const int s = k % a.stages;
      wgmma::mbar_wait(bar(full[s]), (k / a.stages) & 1);
      const int64_t blk = tinfo[s].blk;
      if (blk >= 0) {
        // The stage goes back only after the reducers' arrival is consumed: they cannot lap rdone's phases.
        wgmma::mbar_wait(bar(rdone[s]), (k / a.stages) & 1);
        wgmma::mbar_arrive(bar(empty[s]));
        unsigned old = 0;
        if (lane == 0) old = atomicAdd(a.done + blk, 1u);
        old = __shfl_sync(kFullMask, old, 0);
        if (old + 1 != static_cast<unsigned>(a.Q)) continue;
      }
      // The block's last tile (or the end): a job for the folder.
      const int e = j % kStreamColsJobs;
      if (j >= kStreamColsJobs) wgmma::mbar_wait(bar(jempty[e]), (j / kStreamColsJobs - 1) & 1);
      if (lane == 0) {
        job[e] = blk;
        wgmma::mbar_arrive(bar(jfull[e]));
      }
      ++j;
      if (blk < 0) break;
    }
    return;
  }

  if (warp >= 3 + kStreamReduceWarps + kStreamNormWarps) {  // folders: warp fw folds groups fw, fw + F, ...
    const int fw = warp - (3 + kStreamReduceWarps + kStreamNormWarps);
    if (fw >= a.folders) return;
    for (int j = 0;; ++j) {
      const int e = j % kStreamColsJobs;
      wgmma::mbar_wait(bar(jfull[e]), (j / kStreamColsJobs) & 1);
      const int64_t blk = job[e];
      wgmma::mbar_arrive(bar(jempty[e]));  // each reader itself (as version 12's readers of a stage)
      if (blk < 0) break;
      // Group gi's Q slots, lane l holding q = l, l + 32, ... (all loads first), merged in that order about the
      // first tile's pivot, then over the warp's tree: a fixed order, the same bits whichever CTA folds.
      for (int gi = fw; gi < a.gb; gi += a.folders) {
        const int64_t ng = blk * a.gb + gi;
        const uint4* sl = a.slots + ng * a.Q;
        uint4 v[kStreamMaxSlotsPerLane];
#pragma unroll
        for (int i = 0; i < kStreamMaxSlotsPerLane; ++i)
          if (lane + 32 * i < a.Q) v[i] = ld_relaxed_v4(sl + lane + 32 * i);
#pragma unroll
        for (int i = 0; i < kStreamMaxSlotsPerLane; ++i)
          if (lane + 32 * i < a.Q)
            while (!slot_ready(v[i])) {  // counted, so stored; maybe not yet visible here
              __nanosleep(32);
              v[i] = ld_relaxed_v4(sl + lane + 32 * i);
            }
        const float pivot = __shfl_sync(kFullMask, __uint_as_float(v[0].x), 0);
        Welford<float> g{0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < kStreamMaxSlotsPerLane; ++i)
          if (lane + 32 * i < a.Q)
            g = combine_f(g, Welford<float>{(__uint_as_float(v[i].x) - pivot) + __uint_as_float(v[i].y),
                                            __uint_as_float(v[i].z), __uint_as_float(v[i].w)});
        g = warp_combine_f(g);
        if (lane == 0) {
          const float rstd = rsqrtf(fmaxf(g.m2 / g.n, 0.f) + a.eps);
          st_relaxed_v4(a.fin + ng, make_uint4(slot_word(pivot), slot_word(g.mean), slot_word(rstd), 1u));
          if (a.stats.p != nullptr) a.stats.write(ng, pivot, g.mean, rstd);
        }
      }
    }
    return;
  }

  // normalizers
  const int nt = tid - 32 * (2 + kStreamReduceWarps);
  const int NS = NT / a.WV, col = nt % a.WV, rs = nt / a.WV;  // row sets of one column a thread
  const bool active = rs < NS;
  float piv[VEC], sc[VEC], sh[VEC];
  int m = -1;
  int64_t bprev = -1;
  for (int k = 0;; ++k) {
    const int s = k % a.stages;
    wgmma::mbar_wait(bar(full[s]), (k / a.stages) & 1);
    const StreamColsTile tl = tinfo[s];
    if (tl.blk < 0) break;
    if (tl.blk != bprev) {  // the block's table into registers, then straight back to the merger
      ++m;
      bprev = tl.blk;
      const int e = m % kStreamColsTabs;
      wgmma::mbar_wait(bar(tfull[e]), (m / kStreamColsTabs) & 1);
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const int c = active ? col * VEC + j : 0;
        const float2 t = ctab[e][c];
        piv[j] = tpiv[e][c / a.cpg];
        sc[j] = t.x;
        sh[j] = t.y;
      }
      wgmma::mbar_arrive(bar(tempty[e]));
    }
    if (active) {
      const uint4* st = stage(s);
      scalar_t* y = a.out + tl.first + col * VEC;
      for (int r0 = rs; r0 < tl.rows; r0 += 4 * NS) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u)
          if (r0 + u * NS < tl.rows) v[u] = st[(r0 + u * NS) * a.WV + col];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int r = r0 + u * NS;
          if (r < tl.rows) {
            uint4 o;
#pragma unroll
            for (int j = 0; j < VEC; j += 2) {
              float z0 = fmaf(elt_to_float<scalar_t>(v[u], j) - piv[j], sc[j], sh[j]);
              float z1 = fmaf(elt_to_float<scalar_t>(v[u], j + 1) - piv[j + 1], sc[j + 1], sh[j + 1]);
              if (SILU) {
                z0 = silu_fast(z0);
                z1 = silu_fast(z1);
              }
              store_pair<scalar_t>(o, j / 2, z0, z1);
            }
            __stcs(reinterpret_cast<uint4*>(y + static_cast<int64_t>(r) * a.C), o);
          }
        }
      }
    }
    wgmma::mbar_arrive(bar(empty[s]));
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Version 7: the backward of NC* input with each group on chip (sm_90). The two-pass backward moves x three
// times and dy twice (statistics; per-channel sums of dz and dz * xhat; dx) and ran at 12-34 % of the copy
// rate. Here, as in version 6, persistent clusters of K CTAs walk the groups, and a CTA's part of a group,
// of x and of dy, lands in a shared-memory stage through two bulk copies; everything else reads the stage:
//   1. the statistics of x, as version 6 (a cluster exchange);
//   2. the sums of dz and dz * (x - mean) per channel: a warp a run of up to 32 vectors of one channel, the
//      run's sums to shared memory, then a thread a channel adds its runs in order (no atomics: the same
//      bits every call). That thread writes the CTA's sums to the workspace (grad_weight / grad_bias) and
//      its share of m1 = mean(dz * gamma) and m2 = mean(dz * gamma * xhat); a second exchange gives every
//      CTA the group's. With SiLU it also writes dz over dy in the stage (grad_keep_dz);
//   3. dx = rstd * (dz * gamma - m1 - xhat * m2), 16-byte stores.
// grad_params_kernel then adds the CTAs' sums over samples and ranks (fixed order). Two CTAs an SM with stages of
// up to 48 KB (one of up to 96 KB), or three with up to 36 KB (one of up to 72 KB) where that keeps the cluster as
// small, or at twice the cluster where two CTAs' last round of groups would leave the device mostly idle
// (backward_smem). A part lands in chunks (two by default), each completing its own barrier, so the sums'
// pass starts on the first while the second lands; where a CTA holds a single stage, dx runs a chunk at a time and
// each chunk is refilled with the CTA's next group as soon as every thread is done with it, so the next load
// overlaps this group's dx instead of waiting for all of it.

// A stage holds x's part and dy's; stages * stage_bytes <= 2 * grad_stage_bytes<BLOCKS>(), BLOCKS CTAs an SM:
// 2 with stages of up to 48 KB, 3 with up to 36 KB (registers capped at 85 a thread).
template <int BLOCKS>
constexpr int64_t grad_stage_bytes() {
  return BLOCKS == 3 ? 36 * 1024 : 48 * 1024;
}
constexpr int kGradMaxStages = 4;
constexpr int kGradMaxChunks = 8;           // barriers a stage (SmemGradArgs::chunks)
constexpr int kGradMinChunkVectors = 128;   // 2 KB of x and of dy a chunk at least
constexpr int kGradRun = 32;     // vectors a run at least (a vector a lane)
constexpr int kGradMaxRunV = 4;  // vectors a lane a run at most (SmemGradArgs::run_v)

template <typename scalar_t>
struct SmemGradArgs {
  FusedArgs<scalar_t> f;  // x, out = dx, w, b, the shape (F = 1); f.part: vectors a CTA
  const scalar_t* dy;
  float2* sums;           // [N * G][K][cpg]: each CTA's (sum dz, sum dz * xhat) per channel of its group
  int64_t groups;         // N * G
  int stages;
  int stage_bytes;        // the stride between stages: x's part, then dy's at dy_off (multiples of 128)
  int dy_off;
  int max_runs;
  bool keep_dz;           // kDzFlag kernels: SiLU's dz kept (grad_keep_dz)
  const float* stats;     // the forward's statistics (3, groups: norm.h), or nullptr: taken here from x
  int chunks;             // barriers a stage: a part lands in chunks of chunk_v vectors (of x and of dy), each
  int chunk_v;            // with its own barrier, so the sums' pass starts on the first while the rest land
  bool early;             // dx a chunk at a time, the next group's chunk issued as each is done (one-stage plans)
  int run_v;              // vectors a lane a run of the sums' pass (1..kGradMaxRunV; grad_run_v)
};

// A 16-byte store as one instruction (the compiler split a plain uint4 store into four 4-byte ones here).
template <typename T>
__device__ __forceinline__ void store_v4(T* p, const uint4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// With SiLU, dz kept (the sums' pass writes dz over dy in the stage, the dx pass reads it back; grad_keep_dz) or
// evaluated again: fixed at compile time (kDzKeep / kDzRecompute) for 16-bit input, where that measured 5-7 %
// faster than the run-time flag on the UNet / VAE shapes (H200, bf16); decided by sa.keep_dz (kDzFlag) for
// float, whose kernel compiled with the choice fixed took 93 registers and ran 383 us against 306 at
// (14, 512, 72, 128) (not profiled).
enum GradDz { kDzRecompute = 0, kDzKeep = 1, kDzFlag = 2 };

template <typename scalar_t, bool SILU, int BLOCKS, int DZ, int THREADS = kSmemThreads, bool LEAN = false>
__global__ void __launch_bounds__(THREADS, BLOCKS) smem_grad_kernel(const SmemGradArgs<scalar_t> sa) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int WARPS = THREADS / 32;
  const bool kKeep = SILU && (DZ == kDzKeep || (DZ == kDzFlag && sa.keep_dz));
  // Lean (16-bit; dz kept, or no SiLU): the pivot folded into z's shift and dx's constant (x itself in the
  // products; the runs' sums of dz * x moved to the pivot per run), silu_dz_lean.
  constexpr bool kLean = LEAN && (!SILU || DZ == kDzKeep) && kCanLean<scalar_t, float>;
  constexpr int VEC = max_vec<scalar_t>();
  const FusedArgs<scalar_t>& a = sa.f;
  // [stages][stage_bytes], then gamma_c and beta_c of the group, the runs' sums, the barriers.
  extern __shared__ __align__(128) unsigned char smem[];
  float* sh_gamma = reinterpret_cast<float*>(smem + static_cast<size_t>(sa.stages) * sa.stage_bytes);
  float* sh_beta = sh_gamma + a.cpg;
  float2* sh_runs = reinterpret_cast<float2*>(sh_gamma + 2 * a.cpg);
  uint64_t* full = reinterpret_cast<uint64_t*>(sh_runs + sa.max_runs);
  __shared__ Welford<float> sh_warp[WARPS];
  __shared__ float2 sh_sums[WARPS];
  __shared__ float4 sh_slots[2][16];
  __shared__ uint64_t sh_xbars[2];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32, K = a.K;
  const int rank = static_cast<int>(blockIdx.x % K);
  const int64_t cluster = blockIdx.x / K, nclusters = gridDim.x / K;
  const int Mv = a.M / VEC, Sv = a.S / VEC;
  const int v0 = rank * a.part;
  const int nv = max(0, min(v0 + a.part, Mv) - v0);
  const int stages = sa.stages;
  const uint32_t smem0 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(full));

  // The part's channels: channel c0 + j of the group covers part vectors [seg_lo(j), seg_hi(j)), cut into runs
  // of run_len (run_v vectors a lane) from seg_lo(j); its first run is first_run(j). The same for every group.
  const int run_v = sa.run_v, run_len = run_v * 32;
  const int c0 = v0 / Sv;
  const int nseg = nv > 0 ? (v0 + nv - 1) / Sv - c0 + 1 : 0;
  const int len0 = min((c0 + 1) * Sv, v0 + nv) - v0;
  const int runs0 = (len0 + run_len - 1) / run_len, runs_full = (Sv + run_len - 1) / run_len;
  auto seg_lo = [&](int j) { return j == 0 ? 0 : len0 + (j - 1) * Sv; };
  auto seg_hi = [&](int j) { return min(len0 + j * Sv, nv); };
  auto first_run = [&](int j) { return j == 0 ? 0 : runs0 + (j - 1) * runs_full; };
  auto runs_of = [&](int j) { return j == 0 ? runs0 : runs_full; };
  const int nruns = nseg > 0 ? first_run(nseg - 1) + (seg_hi(nseg - 1) - seg_lo(nseg - 1) + run_len - 1) / run_len : 0;
  // f(run, its first vector, its segment's end, channel) for runs r = warp, warp + WARPS, ..., (segment, run of
  // it) stepped without divisions.
  auto for_runs = [&](auto&& f) {
    int j = 0, q = warp;
    for (int r = warp; r < nruns; r += WARPS, q += WARPS) {
      while (q >= runs_of(j)) q -= runs_of(j++);
      f(r, seg_lo(j) + q * run_len + lane, seg_hi(j), c0 + j);
    }
  };

  // Thread 0 hands the copy engine iteration it's parts of x and dy (contiguous: F = 1), chunk by chunk: chunk i
  // (vectors [i * chunk_v, min((i + 1) * chunk_v, nv))) of x and of dy complete barrier (stage, i).
  const int chunks = sa.chunks, chunk_v = sa.chunk_v;
  auto issue_chunk = [&](int64_t it, int stage, int i) {
    const int64_t ng = cluster + it * nclusters;
    const int k = i * chunk_v;
    if (ng >= sa.groups || k >= nv) return;
    const int64_t off = (ng / a.G) * a.nstride + (ng % a.G) * a.seg + static_cast<int64_t>(v0 + k) * VEC;
    const uint32_t dst = smem0 + static_cast<uint32_t>(stage) * sa.stage_bytes + 16u * k;
    const uint32_t bar = bar0 + 8 * (stage * chunks + i), bytes = static_cast<uint32_t>(min(chunk_v, nv - k)) * 16u;
    wgmma::mbar_expect_tx(bar, 2 * bytes);
    wgmma::bulk_load(dst, a.x + off, bytes, bar);
    wgmma::bulk_load(dst + sa.dy_off, sa.dy + off, bytes, bar);
  };
  auto issue = [&](int64_t it, int stage) {
    for (int i = 0; i * chunk_v < nv; ++i) issue_chunk(it, stage, i);
  };

  const ClusterExchange xch{sh_slots, sh_xbars, K, rank};
  StageRing ring;
  ring.start(bar0, stages, sh_xbars, issue, chunks);

  auto sum_lanes = [](float& u, float& v) {  // xor butterflies: every lane ends with the same bits
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      u += __shfl_xor_sync(kFullMask, u, o);
      v += __shfl_xor_sync(kFullMask, v, o);
    }
  };
  auto dz_of = [](float dy, float z) {
    if constexpr (!SILU) return dy;
    else return silu_dz<scalar_t>(dy, z);
  };

  for (int64_t it = 0;; ++it) {
    const int stage = ring.stage;
    const int64_t ng = cluster + it * nclusters;
    if (ng >= sa.groups) break;
    const int64_t g = ng % a.G;
    const int64_t base = (ng / a.G) * a.nstride + g * a.seg + static_cast<int64_t>(v0) * VEC;
    const uint4* xb = reinterpret_cast<const uint4*>(smem + static_cast<size_t>(stage) * sa.stage_bytes);
    uint4* db = reinterpret_cast<uint4*>(smem + static_cast<size_t>(stage) * sa.stage_bytes + sa.dy_off);
    // This group's gamma and beta, a thread a channel (the statistics' block barrier orders the writes before
    // every read). Loading them an iteration ahead measured 1 % slower on all four UNet / VAE shapes.
    if (tid < a.cpg) {
      sh_gamma[tid] = a.w ? static_cast<float>(a.w[g * a.cpg + tid]) : 1.f;
      sh_beta[tid] = a.b ? static_cast<float>(a.b[g * a.cpg + tid]) : 0.f;
    }
    // Each thread waits for the chunks it reads itself, in order: landed(k) returns once vector k's chunk (and
    // every one before it) has landed. Every chunk it waits on was issued (k < nv).
    int landed_chunks = 0, landed_end = 0;
    auto landed = [&](int k) {
      while (k >= landed_end) {
        wgmma::mbar_wait(bar0 + 8 * (stage * chunks + landed_chunks), ring.parity);
        ++landed_chunks;
        landed_end += chunk_v;
      }
    };
    // 1. Statistics. Below, xd = x - pivot0 (exact for x near pivot0) and x - mean = xd - md: z = xd * sc + bd
    // with sc = rstd * gamma_c, bd = beta_c - md * sc. The forward's where given (pivot0 the mean's high part,
    // md its low part; one exchange a group), else from the stage (exchange 2 it).
    float pivot0, rstd, md;
    if (sa.stats) {  // loaded ahead of the stage's wait; the sums' pass waits for each run's chunks
      pivot0 = sa.stats[ng];
      md = sa.stats[sa.groups + ng];
      rstd = sa.stats[2 * sa.groups + ng];
      __syncthreads();  // gamma and beta written
    } else {
      landed(nv - 1);
      const Welford<float> st = smem_part_stats<scalar_t, THREADS>(xb, nv, xch, 2 * it, sh_warp, sh_sums, pivot0);
      rstd = rsqrtf(__fdividef(st.m2, st.n) + static_cast<float>(a.eps));
      md = st.mean;
    }

    // 2. Sums of dz and dz * xd a run.
    for_runs([&](int r, int k, int hi, int c) {
      landed(min(hi, k - lane + run_len) - 1);  // the run's last vector (the same in every lane)
      const float sc = rstd * sh_gamma[c], bd = fmaf(-md, sc, sh_beta[c]), bx = fmaf(-pivot0, sc, bd);
      float sdz = 0.f, sdzx = 0.f;
#pragma unroll 2
      for (int v = 0; v < run_v; ++v, k += 32) {
        if (k < hi) {
          const uint4 xr = xb[k], dr = db[k];
          float dz[VEC];
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            if constexpr (kLean) {  // sums of dz and dz * x
              const float xf = elt_to_float<scalar_t>(xr, e);
              const float dyf = elt_to_float<scalar_t>(dr, e);
              dz[e] = SILU ? silu_dz_lean(dyf, fmaf(xf, sc, bx)) : dyf;
              sdz += dz[e];
              sdzx = fmaf(dz[e], xf, sdzx);
            } else {
              const float xd = elt_to_float<scalar_t>(xr, e) - pivot0;
              dz[e] = dz_of(elt_to_float<scalar_t>(dr, e), fmaf(xd, sc, bd));
              sdz += dz[e];
              sdzx = fmaf(dz[e], xd, sdzx);
            }
          }
          if (kKeep) {  // dz in x's dtype, as eager's silu backward hands it on
            uint4 o;
#pragma unroll
            for (int e = 0; e < VEC; e += 2) store_pair<scalar_t>(o, e / 2, dz[e], dz[e + 1]);
            db[k] = o;
          }
        }
      }
      sum_lanes(sdz, sdzx);
      if (kLean) sdzx = fmaf(-pivot0, sdz, sdzx);  // the run's sum of dz * (x - pivot0)
      if (lane == 0) sh_runs[r] = make_float2(sdz, sdzx);
    });
    __syncthreads();

    // A thread a channel (its runs in order; a warp a channel with a lane a run was 8 % slower at 1280
    // channels, where runs are few): the CTA's sums (sum dz * xhat = rstd * (sum dz * xd - md * sum dz)) to the
    // workspace, zeros for the group's channels outside the part, and its shares of m1 and m2.
    float t1 = 0.f, t2 = 0.f;
    if (tid < a.cpg) {
      const int j = tid - c0;
      float sdz = 0.f, sdzx = 0.f;
      if (j >= 0 && j < nseg) {
        const int r1 = j + 1 < nseg ? first_run(j + 1) : nruns;
        for (int r = first_run(j); r < r1; ++r) {
          const float2 v = sh_runs[r];
          sdz += v.x;
          sdzx += v.y;
        }
        sdzx = rstd * fmaf(-md, sdz, sdzx);
      }
      sa.sums[(ng * K + rank) * a.cpg + tid] = make_float2(sdz, sdzx);
      const float gc = sh_gamma[tid];
      t1 = gc * sdz;
      t2 = gc * sdzx;
    }
    sum_lanes(t1, t2);
    if (lane == 0) sh_sums[warp] = make_float2(t1, t2);
    __syncthreads();
    float2 t = make_float2(0.f, 0.f);
    if (warp == 0) {
      if (lane < WARPS) t = sh_sums[lane];
      sum_lanes(t.x, t.y);
    }
    const int64_t xe = grad_exchange_index(sa.stats != nullptr, it);
    const float4 rv = cluster_exchange(xch, make_float4(t.x, t.y, 0.f, 0.f), xe);  // thread 0's is sent
    float m1 = rv.x, m2 = rv.y;  // zeros in lanes >= K
    sum_lanes(m1, m2);
    const float inv_m = 1.f / static_cast<float>(a.M);
    // dx = sc_c * dz + B + D * (x - mean) = sc_c * dz + D * xd + (B - D * md)
    const float D = -rstd * rstd * m2 * inv_m, Bd = fmaf(-D, md, -rstd * m1 * inv_m), Bx = fmaf(-D, pivot0, Bd);
    landed(nv - 1);  // dx reads any vector: this thread waits for the chunks it has not (all landed by now)

    // 3. dx: a run at a time where channels are long (sc and bd once a run), else thread-strided vectors.
    // dx_vec: one vector's dx from its x and dz (or dy) in the stage, stored at out.
    auto dx_vec = [&](const uint4* xp, const uint4* dp, scalar_t* out, float sc, float bd) {
      const uint4 xr = *xp, dr = *dp;
      uint4 o;
#pragma unroll
      for (int e = 0; e < VEC; e += 2) {
        float d[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (kLean) {  // dx = sc * dz + D * x + (Bd - D * pivot0)
            d[h] = fmaf(elt_to_float<scalar_t>(dr, e + h), sc, fmaf(elt_to_float<scalar_t>(xr, e + h), D, Bx));
          } else {
            const float xd = elt_to_float<scalar_t>(xr, e + h) - pivot0;
            const float dz = kKeep ? elt_to_float<scalar_t>(dr, e + h)
                                   : dz_of(elt_to_float<scalar_t>(dr, e + h), fmaf(xd, sc, bd));
            d[h] = fmaf(dz, sc, fmaf(xd, D, Bd));
          }
        }
        store_pair<scalar_t>(o, e / 2, d[0], d[1]);
      }
      store_v4(out, o);
    };
    scalar_t* const out0 = a.out + base;
    // dx of vectors lo + tid, lo + tid + THREADS, ... below hi (the channel stepped, not divided out). Stepping the
    // channel and the pointers from the last vector, two vectors a step, took ~10 instructions a vector besides the
    // arithmetic against ~26 here (SASS, sm_90a, bf16) and measured 0-1 % slower (H200, bf16 and fp32 NCHW rows).
    auto dx_strided = [&](int lo, int hi) {
      GroupPos p(static_cast<unsigned>((v0 + lo + tid) * VEC), a);
      for (int k = lo + tid; k < hi; k += THREADS) {
        const float sc = rstd * sh_gamma[p.c], bd = fmaf(-md, sc, sh_beta[p.c]);
        dx_vec(xb + k, db + k, out0 + static_cast<int64_t>(k) * VEC, sc, bd);
        p.advance(a);
      }
    };
    // Early refills (the host sets them for one-stage plans only): chunk by chunk, each refilled with this stage's
    // next item once every thread is done with it.
    if (sa.early) {
      for (int i = 0, lo = 0; lo < nv; ++i, lo += chunk_v) {
        dx_strided(lo, min(lo + chunk_v, nv));
        if (kKeep) wgmma::fence_proxy_async();  // dz's stores before the copy engine refills the chunk
        __syncthreads();
        if (tid == 0) issue_chunk(it + stages, stage, i);
      }
      if (nv == 0) __syncthreads();
      ring.advance(stages);
      continue;
    }
    if (Sv >= 4 * kGradRun) {  // long channels: dx by the sums' runs (the channel's scale once a run)
      for_runs([&](int, int k, int hi, int c) {
        const float sc = rstd * sh_gamma[c], bd = fmaf(-md, sc, sh_beta[c]);
        const uint4 *xp = xb + k, *dp = db + k;
        scalar_t* out = out0 + static_cast<int64_t>(k) * VEC;
#pragma unroll 2
        for (int v = 0; v < run_v; ++v, k += 32, xp += 32, dp += 32, out += 32 * VEC)
          if (k < hi) dx_vec(xp, dp, out, sc, bd);
      });
    } else {
      dx_strided(0, nv);
    }
    if (kKeep) wgmma::fence_proxy_async();  // dz's stores before the copy engine refills the stage
    ring.release(it, stages, issue);
  }
  cluster_arrive();  // no CTA leaves while another's sends to it may be in flight
  cluster_wait();
#endif
}

// grad_weight / grad_bias of version 7: a warp a channel adds the CTAs' sums over samples and ranks (lanes over
// them, then a fixed tree), written as out_t.
template <typename out_t>
__global__ void __launch_bounds__(kThreads) grad_params_kernel(const float2* __restrict__ sums, int64_t N, int64_t G,
                                                               int K, int cpg, out_t* __restrict__ dw,
                                                               out_t* __restrict__ db) {
  const int lane = threadIdx.x & 31;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (c >= G * cpg) return;
  const int64_t g = c / cpg, cl = c % cpg;
  float sdz = 0.f, sdzx = 0.f;
  for (int64_t i = lane; i < N * K; i += 32) {
    const float2 v = sums[(((i / K) * G + g) * K + i % K) * cpg + cl];
    sdz += v.x;
    sdzx += v.y;
  }
  sdz = warp_sum(sdz);
  sdzx = warp_sum(sdzx);
  if (lane == 0) {
    dw[c] = static_cast<out_t>(sdzx);
    db[c] = static_cast<out_t>(sdz);
  }
}

// ---------------------------------------------------------------------------------------------
// Version 5 forward ("l2", N*C): channels_last x streamed twice through L2, as version 4 does for NC*.
// In channels_last memory a group is cpg channels at each of S positions: cpg * elt bytes (20-160 on
// the UNet shapes) of every C-channel row, too narrow to read alone. A cluster of K CTAs takes a block
// of gb whole groups of one sample (W = gb * cpg channels: whole 16-byte vectors, and at least 128 bytes
// where the groups allow), each CTA a range of positions. Thread t owns vector column t % TCV of the
// block and walks rows t / TCV, + R, ...: its VEC channels never change, so it keeps per-channel sums in
// registers, shifted by the channel's value at the sample's first position (the same shift in every
// CTA). The sums go through shared memory (thread rows in order), then across the cluster (ranks in
// order, distributed shared memory): every CTA ends with the same per-channel sums, closes them into
// per-channel (mean, m2), the mean taken relative to the group's pivot (its first value), and merges
// those per group (equal counts: an exact merge), so all CTAs hold the same bits, with no atomics. Pass 1 reads with evict-last, pass 2 reads the rows back with evict-first,
// normalizes with the thread's VEC (a_c, b_c) pairs held in registers and stores with evict-first.
// Version 1's cols kernels (two launches, x read twice from DRAM, Welford with a division per vector)
// ran at 18-37 % of the copy rate on the UNet shapes.

// One output vector of the channels_last kernels (versions 5 and 8), a thread's VEC channels' a_c, b_c in
// registers: y = act(x * a_c + b_c), or with SHIFT act((x - shift_c) * a_c + b_c).
template <typename scalar_t, bool SILU, bool SHIFT, int VEC>
__device__ __forceinline__ uint4 norm_cols_vec(const uint4& v, const float (&ca)[VEC], const float (&cb)[VEC],
                                               const float (&shift)[VEC]) {
  uint4 o;
#pragma unroll
  for (int j = 0; j < VEC; j += 2) {
    float z0 = fmaf(SHIFT ? elt_to_float<scalar_t>(v, j) - shift[j] : elt_to_float<scalar_t>(v, j), ca[j], cb[j]);
    float z1 = fmaf(SHIFT ? elt_to_float<scalar_t>(v, j + 1) - shift[j + 1] : elt_to_float<scalar_t>(v, j + 1),
                    ca[j + 1], cb[j + 1]);
    if (SILU) {
      z0 = silu_fast(z0);
      z1 = silu_fast(z1);
    }
    store_pair<scalar_t>(o, j / 2, z0, z1);
  }
  return o;
}

constexpr int kColsThreads = 512;  // two CTAs an SM
constexpr int kColsUnroll = 4;
constexpr int kColsMaxTCV = 64;  // vector columns a block row: at least 8 rows of threads

template <typename scalar_t>
struct ColsArgs {
  const scalar_t* x;
  scalar_t* out;
  const scalar_t* w;  // nullptr: gamma = 1
  const scalar_t* b;  // nullptr: beta = 0
  int64_t C;          // channels: the row length
  int64_t S;          // positions a sample
  int64_t rows;       // positions a CTA (the last CTAs of a cluster may get fewer, or none)
  int blocks;         // group blocks a sample (G / gb)
  int cpg, gb, W;     // channels a group, groups a block, channels a block
  int TCV, R;         // vector columns of a block row, thread rows a CTA (R * TCV <= threads)
  int K;              // CTAs a block (the cluster size)
  float eps;
  StatsOut stats;     // the forward's statistics, when asked for
};

// Shared memory of l2_cols_kernel, in floats: per-thread-row sums (2 R W), the CTA's per-channel sums
// (2 W, read by the cluster), per-channel mean and m2 (2 W), the a_c / b_c table (2 W), per-group mean
// and rstd (2 gb).
inline size_t cols_smem_bytes(int R, int W, int gb) {
  return (2 * static_cast<size_t>(R) * W + 6 * static_cast<size_t>(W) + 2 * gb) * sizeof(float);
}

template <typename scalar_t, bool SILU>
__global__ void __launch_bounds__(kColsThreads, 2) l2_cols_kernel(ColsArgs<scalar_t> a) {
  constexpr int VEC = max_vec<scalar_t>();
  constexpr int U = kColsUnroll;
  // As in version 4: 16-bit inputs fold the mean into b_c, fp32 keeps x - shift.
  constexpr bool kShift = sizeof(scalar_t) > 2;
  extern __shared__ float sh[];
  const int W = a.W, RW = a.R * a.W;
  float* sh_p1 = sh;
  float* sh_p2 = sh + RW;
  float* sh_c1 = sh + 2 * RW;
  float* sh_c2 = sh_c1 + W;
  float* sh_mu = sh_c2 + W;
  float* sh_m2 = sh_mu + W;
  float* sh_a = sh_m2 + W;
  float* sh_b = sh_a + W;
  float* sh_g = sh_b + W;  // [0, gb): group mean, [gb, 2 gb): rstd

  const int tid = threadIdx.x;
  const int64_t cid = blockIdx.x / a.K;
  const int rank = static_cast<int>(blockIdx.x % a.K);
  const int64_t n = cid / a.blocks;
  const int blk = static_cast<int>(cid % a.blocks);
  const int col = tid % a.TCV, trow = tid / a.TCV;
  const bool active = trow < a.R;
  const int64_t cb = static_cast<int64_t>(blk) * W;  // the block's first channel
  const int64_t sample = n * a.S * a.C;
  const int64_t r0 = rank * a.rows;
  const int64_t r1 = r0 + a.rows < a.S ? r0 + a.rows : a.S;
  // This thread's rows r0 + trow + k * R, k < cnt; whole batches of U first, then the rest.
  const int64_t mine = active && r1 > r0 + trow ? (r1 - r0 - trow + a.R - 1) / a.R : 0;
  const int cnt = static_cast<int>(mine);
  const int full = cnt / U * U;
  const int64_t step = static_cast<int64_t>(a.R) * a.C;
  const scalar_t* xt = a.x + sample + (r0 + trow) * a.C + cb + col * VEC;
  scalar_t* yt = a.out + sample + (r0 + trow) * a.C + cb + col * VEC;
  const auto [keep, drop] = l2_policies();

  float shift[VEC], s1[VEC], s2[VEC];
  {
    const uint4 v = active ? load_hint(a.x + sample + cb + col * VEC, keep) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      shift[j] = elt_to_float<scalar_t>(v, j);
      s1[j] = 0.f;
      s2[j] = 0.f;
    }
  }
  auto add = [&](const uint4& v) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float d = elt_to_float<scalar_t>(v, j) - shift[j];
      s1[j] += d;
      s2[j] = fmaf(d, d, s2[j]);
    }
  };

  // Pass 1.
  {
    const scalar_t* p = xt;
    int k = 0;
    for (; k < full; k += U) {
      uint4 buf[U];
#pragma unroll
      for (int u = 0; u < U; ++u) buf[u] = load_hint(p + u * step, keep);
#pragma unroll
      for (int u = 0; u < U; ++u) add(buf[u]);
      p += U * step;
    }
    for (; k < cnt; ++k, p += step) add(load_hint(p, keep));
  }
  if (active) {
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      sh_p1[trow * W + col * VEC + j] = s1[j];
      sh_p2[trow * W + col * VEC + j] = s2[j];
    }
  }
  __syncthreads();
  for (int c = tid; c < W; c += kColsThreads) {
    float t1 = 0.f, t2 = 0.f;
    for (int r = 0; r < a.R; ++r) {
      t1 += sh_p1[r * W + c];
      t2 += sh_p2[r * W + c];
    }
    sh_c1[c] = t1;
    sh_c2[c] = t2;
  }
  cluster_arrive();  // the CTA sums are written (release) ...
  cluster_wait();    // ... and every CTA's are visible (acquire)
  const float count = static_cast<float>(a.S);
  for (int c = tid; c < W; c += kColsThreads) {
    float t1 = 0.f, t2 = 0.f;
    for (int r = 0; r < a.K; ++r) {
      t1 += cluster_load(sh_c1 + c, r);
      t2 += cluster_load(sh_c2 + c, r);
    }
    // Means relative to the group's pivot (its first channel at the first position): a mean that
    // dwarfs the spread would lose the spread's digits as an absolute float.
    const float m = t1 / count;
    const float pivot = static_cast<float>(a.x[sample + cb + c / a.cpg * a.cpg]);
    sh_mu[c] = (static_cast<float>(a.x[sample + cb + c]) - pivot) + m;
    sh_m2[c] = fmaxf(fmaf(-t1, m, t2), 0.f);
  }
  cluster_arrive();  // done reading the other CTAs' shared memory; the wait is just before exit
  __syncthreads();
  for (int q = tid; q < a.gb; q += kColsThreads) {
    const float* mu = sh_mu + q * a.cpg;
    const float* m2 = sh_m2 + q * a.cpg;
    float mean = 0.f;
    for (int c = 0; c < a.cpg; ++c) mean += mu[c];
    mean /= static_cast<float>(a.cpg);
    float M2 = 0.f;
    for (int c = 0; c < a.cpg; ++c) {
      const float d = mu[c] - mean;
      M2 += fmaf(count * d, d, m2[c]);
    }
    sh_g[q] = mean;  // relative to the pivot
    sh_g[a.gb + q] = rsqrtf(M2 / (count * static_cast<float>(a.cpg)) + a.eps);
    if (a.stats.p && rank == 0)
      a.stats.write(cid * a.gb + q, static_cast<float>(a.x[sample + cb + q * a.cpg]), mean, sh_g[a.gb + q]);
  }
  __syncthreads();
  for (int c = tid; c < W; c += kColsThreads) {
    const int q = c / a.cpg;
    const float ac = sh_g[a.gb + q] * (a.w ? static_cast<float>(a.w[cb + c]) : 1.f);
    const float beta = a.b ? static_cast<float>(a.b[cb + c]) : 0.f;
    // fp32: z = (x - pivot) * a_c + b_c (one pivot a group, so equal inputs of a group give equal
    // outputs without affine); 16-bit: z = x * a_c + b_c, the pivot folded into b_c.
    const float pivot = static_cast<float>(a.x[sample + cb + q * a.cpg]);
    sh_a[c] = ac;
    sh_b[c] = fmaf(kShift ? -sh_g[q] : -(pivot + sh_g[q]), ac, beta);
    sh_mu[c] = pivot;  // read by the group merge above, before the last barrier
  }
  __syncthreads();

  // Pass 2.
  float ca[VEC], cbias[VEC];
#pragma unroll
  for (int j = 0; j < VEC; ++j) {
    ca[j] = active ? sh_a[col * VEC + j] : 0.f;
    cbias[j] = active ? sh_b[col * VEC + j] : 0.f;
    if (kShift) shift[j] = active ? sh_mu[col * VEC + j] : 0.f;
  }
  auto norm = [&](const uint4& v) { return norm_cols_vec<scalar_t, SILU, kShift>(v, ca, cbias, shift); };
  {
    const scalar_t* p = xt;
    scalar_t* q = yt;
    int k = 0;
    for (; k < full; k += U) {
      uint4 buf[U];
#pragma unroll
      for (int u = 0; u < U; ++u) buf[u] = load_hint(p + u * step, drop);
#pragma unroll
      for (int u = 0; u < U; ++u) store_hint(q + u * step, norm(buf[u]), drop);
      p += U * step;
      q += U * step;
    }
    for (; k < cnt; ++k, p += step, q += step) store_hint(q, norm(load_hint(p, drop)), drop);
  }
  cluster_wait();
}

// ---------------------------------------------------------------------------------------------
// Version 8 forward ("smem", N*C), sm_90: channels_last x read once from DRAM into shared memory, y written
// once. Version 5 streams each block of gb groups twice through L2 and ran at 47-49 % of the copy rate. Here,
// as version 6 does for NC*, persistent clusters of K CTAs walk the blocks (n, gb whole groups; the block as
// version 5 picks it); a CTA's range of positions of a block, rows of W channels W * elt bytes apart by C * elt,
// lands in a shared-memory stage through tensor copies (boxes of W channels by <= 256 rows), <= 48 KB in a
// ring of stages, or one stage of <= 96 KB at K = 16; the next blocks are in flight while a CTA reduces and
// stores one (one stage, 16-bit: box by box as its rows are stored), and two CTAs an SM overlap each other's
// barriers.
// Thread t owns vector column t % TCV of the stage and rows t / TCV, + R, ...: its VEC channels never change.
// Statistics: per-channel sums in registers about the group's pivot (the CTA's first row at the group's first
// channel), folded into the (<= 3) groups its vector touches, then per group over the CTA's threads (a warp a
// group, a fixed order) and over the cluster's ranks: each CTA sends its gb values to every CTA of the cluster
// (st.async), and every CTA merges them in rank order (pivots reconciled to rank 0's), so all get the same bits.
// 16-bit input: shifted sums; fp32: each thread's per-channel mean, then its squared deviations (two reads of
// the stage), Chan's merges. Then z = x * a_c + b_c (fp32: (x - pivot) * a_c + b_c) with the thread's VEC
// (a_c, b_c) in registers, SiLU, 16-byte stores.

constexpr int kSmemColsThreads = 256;
constexpr int kSmemColsSlots = 3;  // groups a thread's vector may touch: the host asks 2 * cpg >= VEC

template <typename scalar_t>
struct SmemColsArgs {
  scalar_t* out;
  const scalar_t* w;  // nullptr: gamma = 1
  const scalar_t* b;  // nullptr: beta = 0
  int64_t C;          // channels: the row length
  int64_t items;      // blocks over all samples: N * blocks
  int S;              // positions a sample
  int rows;           // positions a CTA (nbox boxes of rbox rows; the last ranks may hold fewer, or none)
  int rbox;           // rows a tensor-copy box
  int blocks;         // group blocks a sample (G / gb)
  int cpg, gb, W;     // channels a group, groups a block, channels a block
  int TCV, R;         // vector columns of a block row, thread rows (R * TCV <= threads)
  int ns;             // group slots a thread: the most groups one vector column touches
  int K;              // CTAs a block (the cluster size)
  int stages, stage_bytes;
  float eps;
  StatsOut stats;     // version 8: the forward's statistics, when asked for
};

// Dynamic shared memory of smem_cols_kernel (byte offsets): the stages, their barriers and the exchange's two,
// group states (float4 [threads, or 8 * TCV folded over warps][ns]), per-group pivots (float [gb]), the exchange's
// slots (float4 [2][K][gb]), per-channel gamma / beta and (a_c, b_c) (float2 [W] each).
struct SmemColsLayout {
  int bars, states, slots, params, chan, pivots, bytes;
  __host__ __device__ SmemColsLayout(int stages, int stage_bytes, int ns, int gb, int K, int W, int TCV, bool fold) {
    bars = stages * stage_bytes;
    states = bars + ((stages + 2) * 8 + 15) / 16 * 16;
    slots = states + (fold ? kSmemColsThreads / 32 * TCV : kSmemColsThreads) * ns * 16;
    params = slots + 2 * K * gb * 16;
    chan = params + W * 8;
    pivots = chan + W * 8;
    bytes = pivots + gb * 4 + 128;  // + slack to align the stages to 128 bytes
  }
};

// Group q's value v of a block exchange (buffer b) to every rank of the cluster: lane r < K of the calling warp sends
// it to rank r's slot [b][rank][q] (st.async, completing bytes on rank r's barrier xbar); at K = 1 lane 0 writes it.
__device__ __forceinline__ void cols_send(const float4& v, int q, int b, int gb, int K, int rank, float4* sh_slots,
                                          uint32_t xbar) {
  const int lane = threadIdx.x & 31;
  if (K == 1) {
    if (lane == 0) sh_slots[(b * K) * gb + q] = v;
  } else if (lane < K) {
    const uint32_t slot = static_cast<uint32_t>(__cvta_generic_to_shared(&sh_slots[(b * K + rank) * gb + q]));
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n"
                 :
                 : "r"(cluster_map(slot, lane)), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(cluster_map(xbar, lane))
                 : "memory");
  }
}

// Version 8's statistics of a block in a stage (its forward's and the backward's): each channel's group pivot (the
// stage's first row at the group's first channel) into piv; the thread's states of its <= NS groups into sh_state;
// a warp a group merges the CTA's threads in a fixed order and sends the result to every rank (exchange e: slots
// and barrier by e's parity); then a warp a group merges the ranks in order and calls group(q, st, pivot0) with
// group q's (mean of x - pivot0, m2, n), the same bits in every CTA. before() runs ahead of the block barrier that
// publishes the states. FOLD: the states are folded over each warp's rows first (TCV divides 32).
template <bool FOLD, typename scalar_t, typename Before, typename Group>
__device__ __forceinline__ void cols_block_stats(const SmemColsArgs<scalar_t>& a, const unsigned char* st_bytes,
                                                 bool active, int cnt, int valid, int q0, unsigned slots,
                                                 float4* sh_state, float4* sh_slots, uint64_t* xbars, int64_t e,
                                                 float (&piv)[max_vec<scalar_t>()], Before&& before, Group&& group) {
  constexpr int THREADS = kSmemColsThreads, VEC = max_vec<scalar_t>(), NS = kSmemColsSlots;
  constexpr bool kShift = sizeof(scalar_t) > 2;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32, K = a.K;
  const int rank = static_cast<int>(blockIdx.x % K);
  const uint4* buf = reinterpret_cast<const uint4*>(st_bytes);
  auto slot_of = [&](int j) { return static_cast<int>((slots >> (2 * j)) & 3u); };
  // v if channel j is in slot s, else 0: g[s] += in_slot(...) in every slot (g[slot_of(j)] += v compiled to a
  // dynamically indexed array on the stack).
  auto in_slot = [&](int j, int s, float v) { return slot_of(j) == s ? v : 0.f; };
  // Each channel's group pivot: the stage's first row at the group's first channel.
  {
    float pg[NS];
#pragma unroll
    for (int s = 0; s < NS; ++s) {
      const int q = min(q0 + s, a.gb - 1);
      pg[s] = valid > 0 ? static_cast<float>(reinterpret_cast<const scalar_t*>(st_bytes)[q * a.cpg]) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) piv[j] = slot_of(j) == 0 ? pg[0] : slot_of(j) == 1 ? pg[1] : pg[2];
  }
  // This thread's per-group states into sh_state[tid * ns + slot]: 16-bit (sum of x - pivot, of its square),
  // fp32 (mean of x - pivot, m2, n).
  float4 g[NS];
#pragma unroll
  for (int s = 0; s < NS; ++s) g[s] = make_float4(0.f, 0.f, 0.f, 0.f);
  auto pass = [&](auto&& f) {
#pragma unroll 4
    for (int k = 0; k < cnt; ++k) {
      const uint4 v = buf[tid + k * a.R * a.TCV];
#pragma unroll
      for (int j = 0; j < VEC; ++j) f(j, elt_to_float<scalar_t>(v, j));
    }
  };
  if constexpr (!kShift) {
    float s1[VEC], s2[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) s1[j] = s2[j] = 0.f;
    pass([&](int j, float x) {
      const float d = x - piv[j];
      s1[j] += d;
      s2[j] = fmaf(d, d, s2[j]);
    });
#pragma unroll
    for (int j = 0; j < VEC; ++j)
#pragma unroll
      for (int s = 0; s < NS; ++s) {
        g[s].x += in_slot(j, s, s1[j]);
        g[s].y += in_slot(j, s, s2[j]);
      }
  } else {
    float m[VEC], q[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) m[j] = q[j] = 0.f;
    pass([&](int j, float x) { m[j] += x - piv[j]; });
    const float inv = cnt > 0 ? 1.f / static_cast<float>(cnt) : 0.f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) m[j] *= inv;
    pass([&](int j, float x) {
      const float d = (x - piv[j]) - m[j];
      q[j] = fmaf(d, d, q[j]);
    });
    // Channels of a slot have equal counts: mean = their means' mean, m2 = sum m2 + cnt * sum (m_j - mean)^2.
#pragma unroll
    for (int j = 0; j < VEC; ++j)
#pragma unroll
      for (int s = 0; s < NS; ++s) {
        g[s].x += in_slot(j, s, m[j]);
        g[s].z += in_slot(j, s, 1.f);
      }
#pragma unroll
    for (int s = 0; s < NS; ++s) g[s].x = g[s].z > 0.f ? g[s].x / g[s].z : 0.f;
#pragma unroll
    for (int j = 0; j < VEC; ++j)
#pragma unroll
      for (int s = 0; s < NS; ++s) {
        const float d = m[j] - g[s].x;
        g[s].y += in_slot(j, s, fmaf(static_cast<float>(cnt) * d, d, q[j]));
      }
#pragma unroll
    for (int s = 0; s < NS; ++s) g[s].z *= static_cast<float>(cnt);
  }
  if constexpr (FOLD) {
    // Lane = (thread row in the warp) * TCV + column: fold the warp's rows of each column (xor butterflies, a fixed
    // order) and keep one state a (warp, column), 32 / TCV times fewer bytes (three CTAs an SM then fit).
    for (int o = a.TCV; o < 32; o *= 2)
#pragma unroll
      for (int s = 0; s < NS; ++s) {
        const float4 t = make_float4(__shfl_xor_sync(kFullMask, g[s].x, o), __shfl_xor_sync(kFullMask, g[s].y, o),
                                     __shfl_xor_sync(kFullMask, g[s].z, o), 0.f);
        if constexpr (!kShift) {
          g[s].x += t.x;
          g[s].y += t.y;
        } else {
          const Welford<float> m = combine_f({g[s].x, g[s].y, g[s].z}, {t.x, t.y, t.z});
          g[s] = make_float4(m.mean, m.m2, m.n, 0.f);
        }
      }
    if (lane < a.TCV) {
#pragma unroll
      for (int s = 0; s < NS; ++s)
        if (s < a.ns) sh_state[(warp * a.TCV + lane) * a.ns + s] = g[s];
    }
  } else if (active) {
#pragma unroll
    for (int s = 0; s < NS; ++s)
      if (s < a.ns) sh_state[tid * a.ns + s] = g[s];
  }
  before();
  __syncthreads();

  // A warp a group: its threads' states in a fixed order, then the cluster exchange (lane r sends to rank r).
  const int b = static_cast<int>(e & 1);
  const uint32_t xbar = static_cast<uint32_t>(__cvta_generic_to_shared(&xbars[b]));
  if (tid == 0 && K > 1) wgmma::mbar_expect_tx(xbar, static_cast<uint32_t>(K * a.gb) * 16u);
  for (int q = warp; q < a.gb; q += THREADS / 32) {
    // Lane l: state rows l, l + 32 (thread rows, R <= 64, or warps once folded), the columns lo..hi whose vectors
    // touch group q.
    const int lo = q * a.cpg / VEC, hi = ((q + 1) * a.cpg - 1) / VEC;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    Welford<float> w{0.f, 0.f, 0.f};
    for (int tr = lane; tr < (FOLD ? THREADS / 32 : a.R); tr += 32)
      for (int c = lo; c <= hi; ++c) {
        const float4 t = sh_state[(tr * a.TCV + c) * a.ns + (q - c * VEC / a.cpg)];
        if constexpr (!kShift) {
          v.x += t.x;
          v.y += t.y;
        } else {
          w = combine_f(w, {t.x, t.y, t.z});
        }
      }
    const float pivot = valid > 0 ? static_cast<float>(reinterpret_cast<const scalar_t*>(st_bytes)[q * a.cpg]) : 0.f;
    if constexpr (!kShift) {
#pragma unroll
      for (int o = 16; o > 0; o /= 2) {
        v.x += __shfl_xor_sync(kFullMask, v.x, o);
        v.y += __shfl_xor_sync(kFullMask, v.y, o);
      }
      v.z = static_cast<float>(valid) * static_cast<float>(a.cpg);
    } else {
      w = warp_combine_f(w);
      v = make_float4(__shfl_sync(kFullMask, w.mean, 0), __shfl_sync(kFullMask, w.m2, 0),
                      __shfl_sync(kFullMask, w.n, 0), 0.f);
    }
    v.w = pivot;
    cols_send(v, q, b, a.gb, K, rank, sh_slots, xbar);
  }
  if (K == 1) __syncthreads();
  else wgmma::mbar_wait(xbar, static_cast<uint32_t>(e >> 1) & 1u);
  // Every rank's values of each group, merged in rank order: the group's (mean of x - pivot0, m2, n) and pivot0.
  for (int q = warp; q < a.gb; q += THREADS / 32) {
    const float4 r = lane < K ? sh_slots[(b * K + lane) * a.gb + q] : make_float4(0.f, 0.f, 0.f, 0.f);
    float pivot0;
    const Welford<float> st = kShift ? ranks_combine_pivoted(r, pivot0) : ranks_sums_pivoted(r, K, pivot0);
    group(q, st, pivot0);
  }
}

// CTAS: the CTAs an SM it is built for (2, or 3 where the CTA fits 75 KB); FOLD: the group states folded over warps
// (TCV divides 32), which leaves room for parts of up to ~72 KB at three CTAs an SM (unfolded: ~64 KB).
template <typename scalar_t, bool SILU, int CTAS, bool FOLD>
__global__ void __launch_bounds__(kSmemColsThreads, CTAS)
    smem_cols_kernel(const SmemColsArgs<scalar_t> a, const __grid_constant__ CUtensorMap tx) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int VEC = max_vec<scalar_t>();
  constexpr bool kShift = sizeof(scalar_t) > 2;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  // Tensor copies land on 128-byte boundaries (the host adds the slack).
  unsigned char* smem = smem_raw + ((128u - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 127u)) & 127u);
  const SmemColsLayout lay(a.stages, a.stage_bytes, a.ns, a.gb, a.K, a.W, a.TCV, FOLD);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + lay.bars);
  uint64_t* xbars = full + a.stages;
  float4* sh_state = reinterpret_cast<float4*>(smem + lay.states);
  float4* sh_slots = reinterpret_cast<float4*>(smem + lay.slots);  // [parity][source rank][group]
  float2* sh_params = reinterpret_cast<float2*>(smem + lay.params);  // gamma, beta of the block's channels
  float2* sh_chan = reinterpret_cast<float2*>(smem + lay.chan);      // a_c, b_c
  float* sh_pivot = reinterpret_cast<float*>(smem + lay.pivots);     // each group's pivot0 (fp32's shift)

  const int tid = threadIdx.x, lane = tid & 31, K = a.K;
  const int rank = static_cast<int>(blockIdx.x % K);
  const int64_t cluster = blockIdx.x / K, nclusters = gridDim.x / K;
  const int col = tid % a.TCV, trow = tid / a.TCV;
  const bool active = trow < a.R;
  const int r0 = rank * a.rows;
  const int valid = max(0, min(a.rows, a.S - r0));  // this CTA's positions of every block
  const int cnt = active && valid > trow ? (valid - trow + a.R - 1) / a.R : 0;  // this thread's rows
  const int boxes = (valid + a.rbox - 1) / a.rbox;  // boxes wholly past the sample are not loaded
  const uint32_t box_bytes = static_cast<uint32_t>(a.rbox * a.W) * sizeof(scalar_t);
  const uint32_t smem0 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(full));
  // This thread's channels c0 + j of the block and the group slot of each (2 bits a channel): group q0 + slot.
  const int c0 = col * VEC, q0 = c0 / a.cpg;
  unsigned slots = 0;
#pragma unroll
  for (int j = 0; j < VEC; ++j) slots |= static_cast<unsigned>((c0 + j) / a.cpg - q0) << (2 * j);
  auto slot_of = [&](int j) { return static_cast<int>((slots >> (2 * j)) & 3u); };

  // Item `it`'s boxes [i0, i1) into `stage`; i0 == 0 arms the stage's barrier for all of them.
  auto issue_boxes = [&](int64_t it, int stage, int i0, int i1) {
    const int64_t item = cluster + it * nclusters;
    if (item >= a.items || boxes == 0) return;
    const int n = static_cast<int>(item / a.blocks), blk = static_cast<int>(item % a.blocks);
    const uint32_t bar = bar0 + 8 * stage;
    if (i0 == 0) wgmma::mbar_expect_tx(bar, static_cast<uint32_t>(boxes) * box_bytes);
    for (int i = i0; i < i1; ++i)
      wgmma::tma_load_4d(smem0 + static_cast<uint32_t>(stage * a.stage_bytes) + i * box_bytes, &tx, bar, blk * a.W,
                         r0 + i * a.rbox, n, 0);
  };
  auto issue = [&](int64_t it, int stage) { issue_boxes(it, stage, 0, boxes); };
  // One stage of several boxes (16-bit): each box's copy of the next item goes out as soon as the CTA has stored
  // its rows of it, so the next load overlaps this item's stores. 4-8 % faster at 92 KB parts; float32 ran 4 %
  // slower at those (its two-pass statistics), so it keeps the whole-stage release.
  const bool rolling = !kShift && a.stages == 1 && boxes > 1;

  StageRing ring;
  ring.start(bar0, a.stages, xbars, issue);

  for (int64_t it = 0;; ++it) {
    const int stage = ring.stage;
    const int64_t item = cluster + it * nclusters;
    if (item >= a.items) break;
    const int64_t n = item / a.blocks;
    const int blk = static_cast<int>(item % a.blocks);
    const unsigned char* st_bytes = smem + static_cast<size_t>(stage) * a.stage_bytes;
    const uint4* buf = reinterpret_cast<const uint4*>(st_bytes);
    // Thread t < W loads gamma and beta of the block's channel t, in flight while the statistics are taken
    // (each thread loading its own VEC channels' held 16 more registers through the kernel: 128 with SiLU).
    float pw = 1.f, pb = 0.f;
    if (tid < a.W) {
      const int64_t c = static_cast<int64_t>(blk) * a.W + tid;
      if (a.w) pw = static_cast<float>(a.w[c]);
      if (a.b) pb = static_cast<float>(a.b[c]);
    }
    if (valid > 0) wgmma::mbar_wait(bar0 + 8 * stage, ring.parity);

    float piv[VEC];
    cols_block_stats<FOLD, scalar_t>(
        a, st_bytes, active, cnt, valid, q0, slots, sh_state, sh_slots, xbars, it, piv,
        [&] {
          if (tid < a.W) sh_params[tid] = make_float2(pw, pb);
        },
        [&](int q, const Welford<float>& st, float pivot0) {
          // The group's channels' a_c = rstd * gamma_c and b_c: 16-bit z = x * a_c + b_c (the pivot folded into
          // b_c), fp32 z = (x - pivot0) * a_c + b_c.
          const float rstd = rsqrtf(__fdividef(st.m2, st.n) + a.eps), shift = kShift ? st.mean : st.mean + pivot0;
          for (int c = q * a.cpg + lane; c < (q + 1) * a.cpg; c += 32) {
            const float2 p = sh_params[c];
            const float ac = rstd * p.x;
            sh_chan[c] = make_float2(ac, fmaf(-shift, ac, p.y));
          }
          if (lane == 0) sh_pivot[q] = pivot0;
          if (a.stats.p && lane == 0 && rank == 0) a.stats.write(item * a.gb + q, pivot0, st.mean, rstd);
        });
    __syncthreads();

    // Normalize, SiLU and store this thread's rows.
    float ca[VEC], cb[VEC];
#pragma unroll
    for (int j = 0; j < VEC; j += 2) {
      const float4 p = reinterpret_cast<const float4*>(sh_chan)[(c0 + j) / 2];
      ca[j] = p.x;
      cb[j] = p.y;
      ca[j + 1] = p.z;
      cb[j + 1] = p.w;
    }
    if constexpr (kShift) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) piv[j] = sh_pivot[q0 + slot_of(j)];
    }
    scalar_t* y = a.out + (n * a.S + r0 + trow) * a.C + static_cast<int64_t>(blk) * a.W + c0;
    const int64_t step = static_cast<int64_t>(a.R) * a.C;
    auto store_rows = [&](int k0, int k1) {
#pragma unroll 2
      for (int k = k0; k < k1; ++k) {
        const uint4 v = buf[tid + k * a.R * a.TCV];
        *reinterpret_cast<uint4*>(y) = norm_cols_vec<scalar_t, SILU, kShift>(v, ca, cb, piv);
        y += step;
      }
    };
    if (!rolling) {
      store_rows(0, cnt);
      ring.release(it, a.stages, issue);
    } else {
      // Box i holds rows [i * rbox, (i + 1) * rbox): this thread's rows trow + k * R of it end at k1.
      int k0 = 0;
      for (int i = 0; i < boxes; ++i) {
        const int k1 = min(cnt, max(0, ((i + 1) * a.rbox - trow + a.R - 1) / a.R));
        store_rows(k0, k1);
        k0 = k1;
        __syncthreads();
        if (tid == 0) issue_boxes(it + 1, 0, i, i + 1);
      }
      ring.advance(1);
    }
  }
  // No CTA leaves while another's sends to it may be in flight.
  cluster_arrive();
  cluster_wait();
#endif
}

// ---------------------------------------------------------------------------------------------
// Version 10: the backward of channels_last input with each block on chip (sm_90). Version 1's cols kernels move x
// three times and dy twice (statistics; per-channel sums; dx) and ran the channels_last UNet / VAE rows at 12-27 % of
// the copy rate (bf16). Here version 8's persistent clusters walk the blocks (n, gb whole groups), a CTA's rows of a
// block of x and of dy land in one stage (two tensor copies a box), and everything else reads the stage:
//   1. the statistics, as version 8 (cols_block_stats, exchange 2 it): each channel's sc_c = rstd * gamma_c and
//      bd_c = beta_c - md * sc_c, so that z = (x - pivot0) * sc_c + bd_c;
//   2. per channel, the sums of dz and dz * (x - pivot0): over the thread's rows in registers (its VEC channels never
//      change), then over the CTA's thread rows through shared memory in a fixed order (a thread a channel and
//      slice of rows, then a thread a channel). That thread writes the CTA's sums to the workspace (version 7's
//      layout: grad_params_kernel adds them) and its gamma-weighted shares of m1 and m2; a warp a group adds the
//      group's and sends them to every rank (exchange 2 it + 1; it given the statistics), and every CTA adds the
//      ranks' in order;
//   3. dx = sc_c * dz + D * (x - pivot0) + Bd (dz evaluated again), 16-byte stores.
template <typename scalar_t>
struct SmemColsGradArgs {
  SmemColsArgs<scalar_t> f;  // out = dx; a stage holds x's rows, then dy's at dy_off
  float2* sums;              // [N * G][K][cpg]: each CTA's (sum dz, sum dz * xhat) per channel, as version 7's
  int dy_off;                // a multiple of 128 bytes
  const float* stats;        // the forward's statistics (3, N * G: norm.h), or nullptr: taken here from x
};

// Dynamic shared memory of smem_cols_grad_kernel (byte offsets): the stages, their barriers and the exchange's two, a
// scratch area (version 8's per-thread group states, then the per-(thread row, channel) sums, float2 [R][W]), the
// exchange's slots (float4 [2][K][gb]), gamma / beta and (sc_c, bd_c) (float2 [W] each), each group's (rstd, md,
// pivot0) and (D, Bd) (float4 [gb] each).
struct SmemColsGradLayout {
  int bars, scratch, slots, params, chan, gstat, gcoef, bytes;
  __host__ __device__ SmemColsGradLayout(int stages, int stage_bytes, int ns, int gb, int K, int W, int vec) {
    bars = stages * stage_bytes;
    scratch = bars + ((stages + 2) * 8 + 15) / 16 * 16;
    const int states = kSmemColsThreads * ns * 16, table = kSmemColsThreads * vec * 8;  // R * W <= threads * vec
    slots = scratch + (states > table ? states : table);
    params = slots + 2 * K * gb * 16;
    chan = params + W * 8;
    gstat = chan + W * 8;
    gcoef = gstat + gb * 16;
    bytes = gcoef + gb * 16 + 128;  // + slack to align the stages to 128 bytes
  }
};

template <typename scalar_t, bool SILU>
__global__ void __launch_bounds__(kSmemColsThreads, 2)
    smem_cols_grad_kernel(const SmemColsGradArgs<scalar_t> ga, const __grid_constant__ CUtensorMap tx,
                          const __grid_constant__ CUtensorMap tdy) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int THREADS = kSmemColsThreads, WARPS = THREADS / 32, VEC = max_vec<scalar_t>();
  const SmemColsArgs<scalar_t>& a = ga.f;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((128u - (static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) & 127u)) & 127u);
  const SmemColsGradLayout lay(a.stages, a.stage_bytes, a.ns, a.gb, a.K, a.W, VEC);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + lay.bars);
  uint64_t* xbars = full + a.stages;
  float4* sh_state = reinterpret_cast<float4*>(smem + lay.scratch);
  float2* sh_tab = reinterpret_cast<float2*>(smem + lay.scratch);    // [R][W] after the statistics
  float4* sh_slots = reinterpret_cast<float4*>(smem + lay.slots);    // [parity][source rank][group]
  float2* sh_params = reinterpret_cast<float2*>(smem + lay.params);  // gamma, beta of the block's channels
  float2* sh_chan = reinterpret_cast<float2*>(smem + lay.chan);      // sc_c, bd_c
  float4* sh_gstat = reinterpret_cast<float4*>(smem + lay.gstat);    // rstd, md, pivot0
  float4* sh_gcoef = reinterpret_cast<float4*>(smem + lay.gcoef);    // D, Bd

  const int tid = threadIdx.x, lane = tid & 31, warp = tid / 32, K = a.K;
  const int rank = static_cast<int>(blockIdx.x % K);
  const int64_t cluster = blockIdx.x / K, nclusters = gridDim.x / K;
  const int col = tid % a.TCV, trow = tid / a.TCV;
  const bool active = trow < a.R;
  const int r0 = rank * a.rows;
  const int valid = max(0, min(a.rows, a.S - r0));  // this CTA's positions of every block
  const int cnt = active && valid > trow ? (valid - trow + a.R - 1) / a.R : 0;  // this thread's rows
  const int boxes = (valid + a.rbox - 1) / a.rbox;  // boxes wholly past the sample are not loaded
  const uint32_t box_bytes = static_cast<uint32_t>(a.rbox * a.W) * sizeof(scalar_t);
  const uint32_t smem0 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t bar0 = static_cast<uint32_t>(__cvta_generic_to_shared(full));
  const int c0 = col * VEC, q0 = c0 / a.cpg;
  unsigned slots = 0;
#pragma unroll
  for (int j = 0; j < VEC; ++j) slots |= static_cast<unsigned>((c0 + j) / a.cpg - q0) << (2 * j);
  auto slot_of = [&](int j) { return static_cast<int>((slots >> (2 * j)) & 3u); };
  const int64_t G = static_cast<int64_t>(a.blocks) * a.gb;

  auto issue = [&](int64_t it, int stage) {
    const int64_t item = cluster + it * nclusters;
    if (item >= a.items || boxes == 0) return;
    const int n = static_cast<int>(item / a.blocks), blk = static_cast<int>(item % a.blocks);
    const uint32_t bar = bar0 + 8 * stage, dst = smem0 + static_cast<uint32_t>(stage * a.stage_bytes);
    wgmma::mbar_expect_tx(bar, 2u * static_cast<uint32_t>(boxes) * box_bytes);
    for (int i = 0; i < boxes; ++i) {
      wgmma::tma_load_4d(dst + i * box_bytes, &tx, bar, blk * a.W, r0 + i * a.rbox, n, 0);
      wgmma::tma_load_4d(dst + ga.dy_off + i * box_bytes, &tdy, bar, blk * a.W, r0 + i * a.rbox, n, 0);
    }
  };
  auto dz_of = [](float dy, float z) {
    if constexpr (!SILU) return dy;
    else return silu_dz<scalar_t>(dy, z);
  };
  auto sum_lanes = [](float& u, float& v) {  // xor butterflies: every lane ends with the same bits
#pragma unroll
    for (int o = 16; o > 0; o /= 2) {
      u += __shfl_xor_sync(kFullMask, u, o);
      v += __shfl_xor_sync(kFullMask, v, o);
    }
  };

  StageRing ring;
  ring.start(bar0, a.stages, xbars, issue);

  for (int64_t it = 0;; ++it) {
    const int stage = ring.stage;
    const int64_t item = cluster + it * nclusters;
    if (item >= a.items) break;
    const int64_t n = item / a.blocks;
    const int blk = static_cast<int>(item % a.blocks);
    const unsigned char* st_bytes = smem + static_cast<size_t>(stage) * a.stage_bytes;
    const uint4* xb = reinterpret_cast<const uint4*>(st_bytes);
    const uint4* db = reinterpret_cast<const uint4*>(st_bytes + ga.dy_off);
    float pw = 1.f, pb = 0.f;
    if (tid < a.W) {
      const int64_t c = static_cast<int64_t>(blk) * a.W + tid;
      if (a.w) pw = static_cast<float>(a.w[c]);
      if (a.b) pb = static_cast<float>(a.b[c]);
    }
    if (valid > 0) wgmma::mbar_wait(bar0 + 8 * stage, ring.parity);

    // 1. Statistics: a warp a group writes its channels' sc_c, bd_c and its (rstd, md, pivot0), x - mean = (x -
    // pivot0) - md. The forward's where given (pivot0 the mean's high part, md its low part; one exchange a group),
    // else version 8's from the stage (exchange 2 it).
    float piv[VEC];
    auto group = [&](int q, float rstd, float md, float pivot0) {
      for (int c = q * a.cpg + lane; c < (q + 1) * a.cpg; c += 32) {
        const float2 p = sh_params[c];
        const float sc = rstd * p.x;
        sh_chan[c] = make_float2(sc, fmaf(-md, sc, p.y));
      }
      if (lane == 0) sh_gstat[q] = make_float4(rstd, md, pivot0, 0.f);
    };
    if (ga.stats) {
      if (tid < a.W) sh_params[tid] = make_float2(pw, pb);
      __syncthreads();
      const int64_t NG = a.items * a.gb;
      for (int q = warp; q < a.gb; q += WARPS) {
        const int64_t ng = item * a.gb + q;  // as version 8 writes them
        group(q, ga.stats[2 * NG + ng], ga.stats[NG + ng], ga.stats[ng]);
      }
    } else {
      cols_block_stats<false, scalar_t>(
          a, st_bytes, active, cnt, valid, q0, slots, sh_state, sh_slots, xbars, 2 * it, piv,
          [&] {
            if (tid < a.W) sh_params[tid] = make_float2(pw, pb);
          },
          [&](int q, const Welford<float>& st, float pivot0) {
            group(q, rsqrtf(__fdividef(st.m2, st.n) + a.eps), st.mean, pivot0);
          });
    }
    __syncthreads();
    float sc[VEC], bd[VEC];
#pragma unroll
    for (int j = 0; j < VEC; j += 2) {
      const float4 p = reinterpret_cast<const float4*>(sh_chan)[(c0 + j) / 2];
      sc[j] = p.x;
      bd[j] = p.y;
      sc[j + 1] = p.z;
      bd[j + 1] = p.w;
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) piv[j] = sh_gstat[q0 + slot_of(j)].z;  // the group's pivot0 (rank 0's)

    // 2. This thread's sums of dz and dz * (x - pivot0) a channel, then the CTA's, in a fixed order.
    {
      float sdz[VEC], sdx[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) sdz[j] = sdx[j] = 0.f;
#pragma unroll 2
      for (int k = 0; k < cnt; ++k) {
        const int i = tid + k * a.R * a.TCV;
        const uint4 xr = xb[i], dr = db[i];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          const float xd = elt_to_float<scalar_t>(xr, j) - piv[j];
          const float dz = dz_of(elt_to_float<scalar_t>(dr, j), fmaf(xd, sc[j], bd[j]));
          sdz[j] += dz;
          sdx[j] = fmaf(dz, xd, sdx[j]);
        }
      }
      if (active) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) sh_tab[trow * a.W + c0 + j] = make_float2(sdz[j], sdx[j]);
      }
    }
    __syncthreads();
    // Thread (slice q, channel c) adds rows q, q + Q, ... into row q; then thread c adds the slices.
    const int Q = THREADS / a.W, nq = min(Q, a.R);
    {
      const int c = tid % a.W, q = tid / a.W;
      if (q < nq) {
        float2 t = sh_tab[q * a.W + c];
        for (int r = q + Q; r < a.R; r += Q) {
          const float2 u = sh_tab[r * a.W + c];
          t.x += u.x;
          t.y += u.y;
        }
        sh_tab[q * a.W + c] = t;
      }
    }
    __syncthreads();
    if (tid < a.W) {
      float2 t = sh_tab[tid];
      for (int q = 1; q < nq; ++q) {
        const float2 u = sh_tab[q * a.W + tid];
        t.x += u.x;
        t.y += u.y;
      }
      const int qg = tid / a.cpg;
      const float4 gs = sh_gstat[qg];
      const float sdzx = gs.x * fmaf(-gs.y, t.x, t.y);  // sum dz * xhat = rstd * (sum dz * xd - md * sum dz)
      ga.sums[((n * G + static_cast<int64_t>(blk) * a.gb + qg) * K + rank) * a.cpg + tid % a.cpg] =
          make_float2(t.x, sdzx);
      const float gc = sh_params[tid].x;
      sh_tab[tid] = make_float2(gc * t.x, gc * sdzx);  // this CTA's shares of m1, m2 (times M)
    }
    __syncthreads();

    // A warp a group sends the group's shares to every rank; then every rank's, added in rank order, give m1, m2
    // and dx = sc_c * dz + D * xd + Bd, D = -rstd^2 * m2 / M, Bd = -D * md - rstd * m1 / M.
    {
      const int64_t e = grad_exchange_index(ga.stats != nullptr, it);
      const int b = static_cast<int>(e & 1);
      const uint32_t xbar = static_cast<uint32_t>(__cvta_generic_to_shared(&xbars[b]));
      if (tid == 0 && K > 1) wgmma::mbar_expect_tx(xbar, static_cast<uint32_t>(K * a.gb) * 16u);
      for (int q = warp; q < a.gb; q += WARPS) {
        float t1 = 0.f, t2 = 0.f;
        for (int c = q * a.cpg + lane; c < (q + 1) * a.cpg; c += 32) {
          const float2 u = sh_tab[c];
          t1 += u.x;
          t2 += u.y;
        }
        sum_lanes(t1, t2);
        cols_send(make_float4(t1, t2, 0.f, 0.f), q, b, a.gb, K, rank, sh_slots, xbar);
      }
      if (K == 1) __syncthreads();
      else wgmma::mbar_wait(xbar, static_cast<uint32_t>(e >> 1) & 1u);
      const float inv_m = 1.f / (static_cast<float>(a.S) * static_cast<float>(a.cpg));
      for (int q = warp; q < a.gb; q += WARPS) {
        const float4 r = lane < K ? sh_slots[(b * K + lane) * a.gb + q] : make_float4(0.f, 0.f, 0.f, 0.f);
        float m1 = r.x, m2 = r.y;
        sum_lanes(m1, m2);
        if (lane == 0) {
          const float4 gs = sh_gstat[q];
          const float D = -gs.x * gs.x * m2 * inv_m;
          sh_gcoef[q] = make_float4(D, fmaf(-D, gs.y, -gs.x * m1 * inv_m), 0.f, 0.f);
        }
      }
      __syncthreads();
    }

    // 3. dx.
    {
      float D[VEC], Bd[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const float4 gc = sh_gcoef[q0 + slot_of(j)];
        D[j] = gc.x;
        Bd[j] = gc.y;
      }
      scalar_t* y = a.out + (n * a.S + r0 + trow) * a.C + static_cast<int64_t>(blk) * a.W + c0;
      const int64_t step = static_cast<int64_t>(a.R) * a.C;
#pragma unroll 2
      for (int k = 0; k < cnt; ++k) {
        const int i = tid + k * a.R * a.TCV;
        const uint4 xr = xb[i], dr = db[i];
        uint4 o;
#pragma unroll
        for (int j = 0; j < VEC; j += 2) {
          float d[2];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const float xd = elt_to_float<scalar_t>(xr, j + h) - piv[j + h];
            const float dz = dz_of(elt_to_float<scalar_t>(dr, j + h), fmaf(xd, sc[j + h], bd[j + h]));
            d[h] = fmaf(dz, sc[j + h], fmaf(xd, D[j + h], Bd[j + h]));
          }
          store_pair<scalar_t>(o, j / 2, d[0], d[1]);
        }
        store_v4(y, o);
        y += step;
      }
    }
    ring.release(it, a.stages, issue);
  }
  // No CTA leaves while another's sends to it may be in flight.
  cluster_arrive();
  cluster_wait();
#endif
}

// ---------------------------------------------------------------------------------------------
// Host side.

// The device's L2 size in bytes.
inline int64_t l2_cache_bytes(int device) {
  int v = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrL2CacheSize, device));
  return v;
}

// The "cols" kernels' tiling of C / vec vector columns: TCV columns a block (at most kThreads), R rows of threads,
// ctiles column tiles.
struct ColsTiling {
  int64_t TCV, R, ctiles;
};

inline ColsTiling cols_tiling(int64_t C, int vec) {
  const int64_t CV = C / vec, TCV = std::min<int64_t>(CV, kThreads);
  return {TCV, kThreads / TCV, ceil_div(CV, TCV)};
}

// Fills the split fields of a: "rows" chunks over runs of `run` elements, or the "cols" tiling.
template <typename A>
void plan(A& a, int vec, int64_t run, bool channels_last, int vecs_per_lane = kVecsPerLane,
          int rows_per_thread = kRowsPerThread) {
  if (!channels_last) {
    a.CH = static_cast<int64_t>(32) * vec * vecs_per_lane;
    a.P = ceil_div(run, a.CH);
    a.items = ceil_div(a.N * a.F * a.C * a.S, run) * a.P;  // runs * chunks per run
  } else {
    const ColsTiling t = cols_tiling(a.C, vec);
    a.TCV = static_cast<int>(t.TCV);
    a.R = static_cast<int>(t.R);
    a.ctiles = t.ctiles;
    a.RB = static_cast<int64_t>(a.R) * rows_per_thread;
    a.P = ceil_div(a.S, a.RB);
    a.items = a.N * a.P * a.ctiles;  // blocks
  }
}

// Rows a thread of a "cols" kernel: 128, halved (down to kRowsPerThread) while the blocks would be fewer than
// min_blocks_per_sm an SM: a block's fixed part spreads over the most rows that still keep every SM busy.
template <typename A>
int cols_rows_per_thread(const A& a, int vec, int device, double min_blocks_per_sm) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  const ColsTiling t = cols_tiling(a.C, vec);
  int rows = 128;
  while (rows > kRowsPerThread && a.N * ceil_div(a.S, t.R * rows) * t.ctiles < min_blocks_per_sm * sms) rows /= 2;
  return rows;
}

// The cols statistics' rows a thread: ~1.75 blocks an SM. A block's fixed part (its first row's pivots, the merge
// into per-group states, the stores): at 32 rows 960-channel (28, 960, 72, 128) input took 0.210 ms, at 128 0.157;
// with too few blocks (two-sample frames-major input) 64 rows beat 128 (0.038 vs 0.045 ms) by keeping every SM busy.
// Then, given the blocks resident on the device (slots; 0: unknown) and at most kStatsColFillRounds rounds of them,
// fewer rows a thread so the blocks fill whole rounds: 128 rows gave (28, 960, 72, 128) 1008 blocks on 396 slots, a
// last round 55 % full (H200, the kernel's µs, power of two -> filled: bf16 157.5 -> 153.5, fp32 276.6 -> 268.5;
// bf16 channels_last_3d (2, 1280, 14, 18, 32), 0.64 rounds, 29.4 -> 27.6). At 10 and 20 rounds filling lost (the
// VAE's (14, 128, 576, 1024): bf16 564.6 -> 567.2, fp32 1010.8 -> 1043.2), so the rule stops at 8 (8-10: not measured).
// VD_GROUP_NORM_STATS_COL_FILL=0 keeps it always; VD_GROUP_NORM_STATS_COL_ROWS=n pins n rows (1-1024).
constexpr int64_t kStatsColFillRounds = 8;

// The power-of-two rows a thread both rules below start from.
template <typename A>
int stats_cols_pow2(const A& a, int vec, int device) {
  return cols_rows_per_thread(a, vec, device, 1.75);
}

// Batches in flight a thread of the cols statistics (stats_col_batches's DEPTH): 3 for 16-bit input, 4 for float,
// where the blocks make at least kStatsColRingRounds rounds of the device's slots at the power-of-two rows; plain
// loads (0) otherwise. Kernel µs (H200; plain / ring of 3 / ring of 4 batches):
// - bf16 (28, 960, 72, 128), 2.6 rounds: 152.5 / 145.2 / 146.8; (32, 960, 64, 96), 1.9 rounds: 114.8 / 112.4 / 114.4;
//   (14, 128, 576, 1024), 10 rounds: 559.4 / 507.5 / 504.3 (fp16 545.5 / 495.5 / 492.4).
// - fp32 (28, 960, 72, 128): 268.8 / 250.5 / 245.4; (14, 512, 72, 128), 1.3 rounds: 80.9 / 77.8 / 77.9.
// - Under a round the ring's first batches cost more than the bytes it keeps in flight gain: bf16 (16, 960, 64, 96),
//   0.97 rounds: 62.6 / 62.8 / 64.5; (14, 512, 72, 128), 0.64 rounds: 48.6 / 49.3 / 50.2.
// VD_GROUP_NORM_STATS_COL_DEPTH=0|3|4 pins it.
template <typename scalar_t>
constexpr int stats_col_ring_depth() {
  return sizeof(scalar_t) == 2 ? 3 : 4;
}
constexpr double kStatsColRingRounds = 1.0;

// slots: the statistics kernel's blocks resident on the device (0: unknown); rows: stats_cols_pow2's.
template <typename scalar_t, typename A>
int stats_cols_depth(const A& a, int vec, int64_t slots, int rows) {
  const std::string e = env_str("VD_GROUP_NORM_STATS_COL_DEPTH");
  if (!e.empty()) return std::atoi(e.c_str());
  if (slots <= 0) return 0;
  const ColsTiling t = cols_tiling(a.C, vec);
  const double blocks = static_cast<double>(a.N * t.ctiles * ceil_div(a.S, t.R * rows));
  return blocks >= kStatsColRingRounds * slots ? stats_col_ring_depth<scalar_t>() : 0;
}

// slots and rows: as stats_cols_depth's.
template <typename A>
int stats_cols_rows(const A& a, int vec, int64_t slots, int rows) {
  const int64_t pinned = env_int("VD_GROUP_NORM_STATS_COL_ROWS", 0);
  if (pinned >= 1 && pinned <= 1024) return static_cast<int>(pinned);
  if (slots <= 0 || env_str("VD_GROUP_NORM_STATS_COL_FILL") == "0") return rows;
  const ColsTiling t = cols_tiling(a.C, vec);
  const int64_t columns = a.N * t.ctiles;
  const int64_t rounds = ceil_div(columns * ceil_div(a.S, t.R * rows), slots);
  if (rounds > kStatsColFillRounds) return rows;
  // The most blocks a sample-column that whole rounds hold (at least the current count, as rounds were rounded up).
  const int64_t P = rounds * slots / columns;
  // Not under kRowsPerThread, cols_rows_per_thread's floor: a block's fixed part and the finalize's merge per state
  // (bf16 channels_last_3d (2, 320, 14, 32, 32), 0.38 rounds at 32 rows, filled at 13 rows: the call 25.4 -> 26.6 us).
  return static_cast<int>(std::clamp<int64_t>(ceil_div(a.S, t.R * P), std::min(rows, kRowsPerThread), rows));
}

// grad_weight / grad_bias in the parameters' dtypes (x's where absent), for both backward paths. The reduce kernel
// (write(dw, db), pointers of x's dtype or acc_t) writes them straight when both share one of those; otherwise it
// writes acc_t sums into the scratch() elements the caller reserves in its workspace, converted afterwards.
template <typename scalar_t, typename acc_t>
struct ParamGrads {
  at::ScalarType wdtype, bdtype;
  bool direct_x() const { return wdtype == bdtype && wdtype == c10::CppTypeToScalarType<scalar_t>::value; }
  bool direct_acc() const {
    return wdtype == bdtype && wdtype == c10::CppTypeToScalarType<acc_t>::value && !direct_x();
  }
  int64_t scratch(int64_t C) const { return direct_x() || direct_acc() ? 0 : 2 * C; }
  // ws: the caller's acc_t workspace, its scratch at element off.
  template <typename Write>
  void run(const at::Tensor& ws, int64_t off, int64_t C, Write&& write, at::Tensor& dw, at::Tensor& db) const {
    if (direct_x() || direct_acc()) {
      dw = at::empty({C}, ws.options().dtype(wdtype));
      db = at::empty({C}, ws.options().dtype(bdtype));
      if (direct_x()) write(dw.mutable_data_ptr<scalar_t>(), db.mutable_data_ptr<scalar_t>());
      else write(dw.mutable_data_ptr<acc_t>(), db.mutable_data_ptr<acc_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      acc_t* p = ws.mutable_data_ptr<acc_t>() + off;
      write(p, p + C);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      dw = ws.narrow(0, off, C).to(wdtype, false, /*copy=*/true);
      db = ws.narrow(0, off + C, C).to(bdtype, false, /*copy=*/true);
    }
  }
};

template <typename scalar_t>
struct Launcher {
  using acc_t = at::opmath_type<scalar_t>;
  using Args = GNArgs<scalar_t, acc_t>;
  static constexpr int kVec = max_vec<scalar_t>();

  // VEC > 1 needs every array 16-byte aligned and, for N*C, whole vectors of channels.
  static bool can_vectorize(const Args& a, bool channels_last, std::initializer_list<const void*> ptrs) {
    for (const void* p : ptrs)
      if (p && !aligned16(p)) return false;
    return !channels_last || a.C % kVec == 0;
  }

  // The cols statistics' kernel, its dynamic shared memory and its blocks resident on the device (0: unknown).
  using ColsKernel = void (*)(Args, Welford<double>*);
  struct ColsStats {
    ColsKernel kernel;
    size_t smem;
    int64_t slots;
  };

  // The copies' ring of `depth` batches (stats_col_batches) where 16-bit or float input and the device take it;
  // otherwise cols unchanged (plain loads).
  static void cols_stats_ring(ColsStats& cols, int depth, int device, int sms) {
    if constexpr (sizeof(scalar_t) == 2 || std::is_same_v<scalar_t, float>) {
      ColsKernel k = nullptr;
      size_t smem = 0;
      switch (depth) {
        case 3: k = stats_cols_kernel<scalar_t, acc_t, kVec, 3>, smem = stats_cols_smem<acc_t, kVec, 3>(); break;
        case 4: k = stats_cols_kernel<scalar_t, acc_t, kVec, 4>, smem = stats_cols_smem<acc_t, kVec, 4>(); break;
        default: return;
      }
      // resident_clusters at K = 1: allows the kernel all the opt-in shared memory, 0 without sm_90 code.
      const int resident = resident_clusters(k, 1, device, kThreads, smem);
      if (resident < sms) return;
      cols = ColsStats{k, smem, resident};
    }
  }

  // mean (hi, lo) and rstd per (n, g), 3 * N * G values of acc_t, a points at them afterwards; the
  // returned buffer holds them (and the partial states before them: one allocation, host time counts on
  // the small shapes), or out does where given (the forward's statistics output).
  static at::Tensor stats(Args& a, bool channels_last, bool vec, double eps, const at::TensorOptions& opts,
                          int device, cudaStream_t stream, acc_t* out = nullptr) {
    const int v = vec ? kVec : 1;
    Args s = a;
    ColsStats cols{vec ? stats_cols_kernel<scalar_t, acc_t, kVec> : stats_cols_kernel<scalar_t, acc_t, 1>, 0, 0};
    const int pow2 = channels_last ? stats_cols_pow2(s, v, device) : 0;
    if (channels_last) {
      int sms = 0;
      C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
      cols.slots = int64_t{resident_blocks(cols.kernel, device, kThreads, 0)} * sms;
      if (vec) cols_stats_ring(cols, stats_cols_depth<scalar_t>(s, v, cols.slots, pow2), device, sms);
    }
    // 16-bit and float "rows" statistics: chunks of kStatBatches batches (stats_rows_kernel)
    plan(s, v, s.cpg * s.S, channels_last, sizeof(scalar_t) <= 4 && vec ? kVecsPerLane * kStatBatches : kVecsPerLane,
         channels_last ? stats_cols_rows(s, v, cols.slots, pow2) : kRowsPerThread);
    const int64_t K = channels_last ? s.P * s.ctiles : s.F * s.P;
    const int64_t NG = s.N * s.G;
    // cols: a group's slot of a column tile it does not reach stays zero (n = 0, skipped by the merge).
    const int64_t n_part = NG * K * 3;  // doubles
    at::Tensor buf = at::empty({n_part + ceil_div(3 * NG * static_cast<int64_t>(sizeof(acc_t)), int64_t{8})},
                               opts.dtype(at::kDouble));
    auto* pp = reinterpret_cast<Welford<double>*>(buf.mutable_data_ptr<double>());
    if (channels_last && s.ctiles > 1)
      C10_CUDA_CHECK(cudaMemsetAsync(pp, 0, n_part * sizeof(double), stream));
    acc_t* mean = out ? out : reinterpret_cast<acc_t*>(buf.mutable_data_ptr<double>() + n_part);
    const unsigned blocks = grid_of(channels_last ? s.items : ceil_div(s.items, kWarps), kOp);
    if (!channels_last) {
      if (vec) stats_rows_kernel<scalar_t, acc_t, kVec><<<blocks, kThreads, 0, stream>>>(s, pp);
      else stats_rows_kernel<scalar_t, acc_t, 1><<<blocks, kThreads, 0, stream>>>(s, pp);
    } else {
      cols.kernel<<<blocks, kThreads, cols.smem, stream>>>(s, pp);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    stats_finalize_kernel<acc_t><<<grid_of(NG, kOp), kThreads, 0, stream>>>(
        pp, K, eps, mean, mean + NG, mean + 2 * NG);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    a.mean = mean;
    a.mean_lo = mean + NG;
    a.rstd = mean + 2 * NG;
    return buf;
  }
};

// Version 2's split of a group of M elements (vectors of vec) over a cluster of K CTAs of V vectors per
// thread, or K = 0 where it does not apply. The smallest K at V <= 8 keeps clusters easy to place;
// V = 12 with K = 8 stretches to groups of 393 KB (bf16) before the two-pass path takes over.
struct FusedPlan {
  int K = 0, V = 0, part = 0;
};

// Per-channel scale and shift live in dynamic shared memory: 2 * cpg floats.
constexpr int64_t kFusedMaxCpg = 4096;

FusedPlan plan_fused(int64_t M, int64_t seg, int64_t cpg, int vec) {
  FusedPlan p;
  // Whole vectors per segment keep a vector inside one segment (and every vector 16-byte aligned).
  if (seg % vec != 0 || cpg > kFusedMaxCpg) return p;
  const int64_t Mv = M / vec;
  for (int K = 1; K <= 8; K *= 2) {
    const int64_t part = ceil_div(Mv, K);
    if (part <= kFusedThreads * 8) {
      p.K = K;
      p.V = part <= kFusedThreads * 4 ? 4 : 8;
      p.part = static_cast<int>(part);
      return p;
    }
  }
  const int64_t part = ceil_div(Mv, 8);
  if (part <= kFusedThreads * 12) {
    p.K = 8;
    p.V = 12;
    p.part = static_cast<int>(part);
  }
  return p;
}

// Whether `kernel` can run in clusters of K CTAs on `device` (K = 1: no cluster, any device runs it).
template <typename Kernel>
bool cluster_ok(Kernel kernel, int K, int device, int threads, size_t smem) {
  return K == 1 || resident_clusters(kernel, K, device, threads, smem) > 0;
}

// Which forward kernels may run. VD_GROUP_NORM_KERNEL=smem|stream|l2|onchip|twopass restricts the choice to one
// family (benchmarks compare them in one process); unset: as measured (bench/notes/norm_and_elementwise.md),
// version 6 (version 8 for channels_last) first, then version 12 (NC* groups past version 6, and frames-major
// groups version 6 would hold in one stage a CTA; version 13 for float32 channels_last larger than the L2 past
// version 8, or where version 8 would hold one stage at two CTAs an SM), then
// version 4 (for 16-bit NC* x only where x fits the L2), version 3 first for inputs under kSmallBytes, then
// version 1.
enum class GNKernels { kAny, kSmem, kStream, kL2, kOnChip, kTwoPass };
// Under this many bytes of x, version 3's shorter CTAs beat version 4 by 1-2 us (H200).
constexpr int64_t kSmallBytes = 16 << 20;

GNKernels gn_kernels() {
  const char* e = std::getenv("VD_GROUP_NORM_KERNEL");
  if (e == nullptr) return GNKernels::kAny;
  const std::string v(e);
  if (v == "smem") return GNKernels::kSmem;
  if (v == "stream") return GNKernels::kStream;
  if (v == "l2") return GNKernels::kL2;
  if (v == "onchip") return GNKernels::kOnChip;
  if (v == "twopass") return GNKernels::kTwoPass;
  return GNKernels::kAny;
}

// The arguments of versions 3 and 4 for `threads` threads a CTA and K CTAs a group of part vectors each.
template <typename scalar_t>
FusedArgs<scalar_t> fused_args(const GNShape& s, int64_t F, const scalar_t* x, scalar_t* out, const scalar_t* w,
                               const scalar_t* b, double eps, bool silu, int threads, int K, int64_t part) {
  constexpr int kVec = max_vec<scalar_t>();
  const int64_t cpg = s.C / s.G, S = s.S / F, seg = cpg * S;
  FusedArgs<scalar_t> a{};
  a.x = x;
  a.out = out;
  a.w = w;
  a.b = b;
  a.G = s.G;
  a.nstride = s.C * s.S;
  a.fstride = s.C * S;
  a.cpg = static_cast<int>(cpg);
  a.S = static_cast<int>(S);
  a.seg = static_cast<int>(seg);
  a.M = static_cast<int>(F * seg);
  a.div_S = at::cuda::detail::IntDivider<unsigned>(static_cast<unsigned>(S));
  a.div_cpg = at::cuda::detail::IntDivider<unsigned>(static_cast<unsigned>(cpg));
  const int64_t step = static_cast<int64_t>(threads) * kVec;
  a.step_r = static_cast<int>(step % S);
  a.step_c = static_cast<int>(step / S % cpg);
  a.step_f = static_cast<int>(step / S / cpg);
  a.K = K;
  a.part = static_cast<int>(part);
  a.eps = eps;
  a.silu = silu;
  return a;
}

// Runs version 4 when the shape, dtype and alignment allow it; false leaves the work to the others.
// F: the frames of a frames-major x (its groups are F segments), else 1.
template <typename scalar_t>
bool forward_l2(const GNShape& s, int64_t F, const scalar_t* x, scalar_t* out, const scalar_t* w, const scalar_t* b,
                double eps, bool silu, bool vec, StatsOut stats, int device, cudaStream_t stream) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return false;  // float statistics only; fp64 keeps the double-precision path
  } else {
    constexpr int kVec = max_vec<scalar_t>();
    if (s.channels_last || !vec) return false;
    const int64_t cpg = s.C / s.G, seg = cpg * (s.S / F), M = F * seg;
    if (seg % kVec != 0 || cpg > kFusedMaxCpg) return false;
    // The smallest cluster (up to 16 CTAs) whose parts fit kL2PartBytes. Larger groups go elsewhere:
    // clusters of 16 CTAs that each hold one SM (parts up to 192 KB, 21 MB in L2) measured slower
    // than the two-pass path (0.20-0.22 vs 0.196 ms on (2, 320, 14, 72, 128) frames-major, H200).
    const int64_t bytes = M * static_cast<int64_t>(sizeof(scalar_t));
    int K = 1;
    while (K < 16 && ceil_div(bytes, K) > kL2PartBytes) K *= 2;
    if (ceil_div(bytes, K) > kL2PartBytes) return false;
    const size_t smem = 2 * cpg * sizeof(float);
    auto kernel = silu ? l2_rows_kernel<scalar_t, true> : l2_rows_kernel<scalar_t, false>;
    if (!cluster_ok(kernel, K, device, kL2Threads, smem)) return false;
    auto a = fused_args(s, F, x, out, w, b, eps, silu, kL2Threads, K, ceil_div(M / kVec, K));
    a.stats = stats;
    launch_clusters(kOp, kernel, a, s.N * s.G, K, kL2Threads, smem, stream);
    return true;
  }
}

template <typename scalar_t>
bool forward_stream(const GNShape& s, int64_t F, const scalar_t* x, scalar_t* out, const scalar_t* w,
                    const scalar_t* b, double eps, bool silu, bool vec, StatsOut stats, int device,
                    cudaStream_t stream, bool pinned);

// Runs version 6 when the shape, dtype, alignment and device allow it; false leaves the work to the others.
// chain (the family not pinned): frames-major groups version 6 would hold in one stage a CTA go to version 12 where
// it runs them.
template <typename scalar_t>
bool forward_smem(const GNShape& s, int64_t F, const scalar_t* x, scalar_t* out, const scalar_t* w, const scalar_t* b,
                  double eps, bool silu, bool vec, StatsOut stats, int device, cudaStream_t stream, bool chain) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return false;
  } else {
    constexpr int kVec = max_vec<scalar_t>();
    if (s.channels_last || !vec) return false;
    const int64_t cpg = s.C / s.G, seg = cpg * (s.S / F), M = F * seg, Mv = M / kVec;
    if (seg % kVec != 0) return false;
    // The smallest cluster whose parts fit kSmemPartBytes; a part of >= 1536 vectors once K > 1, so every
    // rank holds some of the group. Clusters of 16 (not portable; resident_clusters allows them) take groups
    // of 384-768 KB, which otherwise go to the two-pass kernels; past that, parts of up to kSmemBigPartBytes
    // in a single stage (groups up to 1.5 MB).
    int K = 1;
    while (K < 16 && ceil_div(Mv, K) * 16 > kSmemPartBytes) K *= 2;
    const int64_t part = ceil_div(Mv, K);
    if (part * 16 > kSmemBigPartBytes || cpg > kSmemMaxCpg) return false;
    const int64_t stage_bytes = ceil_div(part * 16, 128) * 128;
    const int stages = static_cast<int>(std::min<int64_t>(kSmemMaxStages, kSmemDataBytes / stage_bytes));
    // One stage a CTA (groups of 768 KB to 1.5 MB, clusters of 16): a CTA's next group waits for its stores. For
    // frames-major groups version 12's ring measured faster; contiguous ones it was not (H200, µs, version 6 /
    // version 12: frames-major 1.3 MB (2, 1280, 14, 18, 32) fp32 68.5 / 58.5, (2, 640, 14, 36, 64) bf16 66.2 / 61.1,
    // fp16 68.3 / 60.4; contiguous (28, 960, 72, 128) fp32 543 / 620, (14, 256, 144, 256) fp32 296 / 301,
    // (14, 512, 144, 256) bf16 316 / 314).
    if (chain && F > 1 && stages == 1 &&
        forward_stream<scalar_t>(s, F, x, out, w, b, eps, silu, vec, stats, device, stream, true))
      return true;
    const size_t smem = stages * stage_bytes + 2 * ceil_div(cpg, 2) * 2 * sizeof(float) + stages * sizeof(uint64_t);
    const int threads = kSmemThreads;
    // Frames-major groups step their output offset across segments; contiguous ones need not.
    auto kernel = silu ? (F > 1 ? smem_rows_kernel<scalar_t, true, true> : smem_rows_kernel<scalar_t, true, false>)
                       : (F > 1 ? smem_rows_kernel<scalar_t, false, true> : smem_rows_kernel<scalar_t, false, false>);
    const int clusters = resident_clusters(kernel, K, device, threads, smem);
    if (clusters == 0) return false;
    SmemArgs<scalar_t> a{};
    a.f = fused_args(s, F, x, out, w, b, eps, silu, threads, K, part);
    a.f.stats = stats;
    a.groups = s.N * s.G;
    a.stages = stages;
    a.stage_bytes = static_cast<int>(stage_bytes);
    launch_clusters(kOp, kernel, a, std::min<int64_t>(a.groups, clusters), K, threads, smem, stream);
    return true;
  }
}

// Groups over version 6's largest cluster (16 parts of kSmemBigPartBytes) go to version 12 unless pinned there
// (forward_stream); frames-major ones from 768 KB (forward_smem).
constexpr int64_t kStreamMinGroupBytes = 16 * kSmemBigPartBytes;

// The CTAs of `kernel` (one an SM's worth, clusters of 1) resident at once; 0 where the device cannot launch
// cooperatively, as versions 12 and 13 need (a CTA waits for tiles other CTAs hold).
template <typename Kernel>
int cooperative_ctas(Kernel kernel, int device, int threads, size_t smem) {
  int coop = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&coop, cudaDevAttrCooperativeLaunch, device));
  return coop ? resident_clusters(kernel, 1, device, threads, smem) : 0;
}

// `bytes` of device memory from the caching allocator, zeroed on the stream (tile counters, slots, records).
inline at::Tensor zeroed_workspace(int64_t bytes, int device, cudaStream_t stream) {
  at::Tensor ws = at::empty({bytes}, at::TensorOptions().device(at::kCUDA, device).dtype(at::kByte));
  C10_CUDA_CHECK(cudaMemsetAsync(ws.mutable_data_ptr(), 0, bytes, stream));
  return ws;
}

// A cooperative launch of `grid` CTAs (every CTA resident at once), as versions 12 and 13 need.
template <typename Kernel, typename... Args>
void launch_cooperative(Kernel kernel, int64_t grid, int threads, size_t smem, cudaStream_t stream,
                        const Args&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute at{};
  at.id = cudaLaunchAttributeCooperative;
  at.val.cooperative = 1;
  cfg.attrs = &at;
  cfg.numAttrs = 1;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Channels_last float32 input larger than the L2 that version 8 declines, or would hold in one stage at two CTAs an
// SM, runs version 13: 12-17 % faster than the two-pass kernels at 960 channels on the H200, 7-15 % faster than
// version 8 at 320 and 640 channels (bench/notes/norm_and_elementwise.md). VD_GROUP_NORM_STREAM_COLS=0 leaves it to
// those. Read on every call.
inline bool stream_cols_on() { return env_str("VD_GROUP_NORM_STREAM_COLS") != "0"; }

#if defined(VD_SM90A)
inline bool cols_tensor_map(CUtensorMap* m, const at::Tensor& t, const GNShape& s, int64_t W, int64_t rbox);
#endif

// Runs version 13 (channels_last, sm_90) when the shape, dtype, alignment and device allow it; false leaves the work
// to the others. Unpinned it runs only where stream_cols_on() (called where version 8 declined, or by
// forward_smem_cols in its place).
template <typename scalar_t>
bool forward_stream_cols(const GNShape& s, const at::Tensor& xt, scalar_t* out, const scalar_t* w, const scalar_t* b,
                         double eps, bool silu, bool vec, StatsOut stats, int device, cudaStream_t stream,
                         bool pinned) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return false;
  } else {
    constexpr int kVec = max_vec<scalar_t>();
    constexpr int64_t kElt = sizeof(scalar_t);
    // vec: x and out 16-byte aligned, C whole vectors (rows start on 16 bytes).
    if (!s.channels_last || !vec || s.S >= (int64_t{1} << 31)) return false;
    if (!pinned && (kElt != 4 || !stream_cols_on() || s.N * s.S * s.C * kElt <= l2_cache_bytes(device)))
      return false;
    const int64_t cpg = s.C / s.G;
    auto kernel = silu ? stream_cols_kernel<scalar_t, true> : stream_cols_kernel<scalar_t, false>;
    // The ring: all the shared memory the static arrays leave (209 KB in float32 on sm_90), in 4 stages. A tile waits
    // in its stage for its block's table, so the ring's bytes set the rate: at (28, 960, 72, 128) fp32 on the H200,
    // 192 / 200 / 209 KB in 4 stages 716 / 698 / 684 us; 192 KB in 3 / 6 / 8 stages 749 / 733 / 800 us, 209 KB in 5 /
    // 6 stages 682 / 695. VD_GROUP_NORM_STREAM_COLS_RING_KB and VD_GROUP_NORM_STREAM_COLS_STAGES (2-8) set others
    // (benchmarks).
    const int64_t room = std::min<int64_t>(kernel_max_dynamic_smem(kernel, device), kStreamColsMaxRing) / 1024;
    if (room < 64) return false;
    const int64_t ring = std::clamp<int64_t>(env_int("VD_GROUP_NORM_STREAM_COLS_RING_KB", room), 64, room) * 1024;
    const int stages = static_cast<int>(std::clamp<int64_t>(
        env_int("VD_GROUP_NORM_STREAM_COLS_STAGES", kStreamColsStages), 2, kStreamColsMaxStages));
    const int64_t stage_bytes = ring / stages / 128 * 128;
    const size_t smem = static_cast<size_t>(ring);
    const int P = cooperative_ctas(kernel, device, kStreamColsThreads, smem);
    if (P == 0) return false;
    // Blocks of gb groups (dividing G) with rows of whole vectors, whose Q tiles the resident rings hold twice over
    // (a block's table waits for all of its tiles; the rings must also hold the next block's): the widest whose
    // gb * Q slots are at most 512, else the narrowest. A block's table waits for its fold: a bound of 1024 took 8
    // groups at (32, 960, 64, 96) in 4 stages, 669 us against 542 with 4 groups in 6. A folder warp holds a group's
    // Q <= 512 slots. VD_GROUP_NORM_STREAM_COLS_SLOTS sets the bound (benchmarks compare block widths).
    const int64_t fold_slots = env_int("VD_GROUP_NORM_STREAM_COLS_SLOTS", 512);
    // A tile's rows come in tensor copies of W channels: one box where the stage holds <= 256 rows (the copy engine's
    // limit), else boxes of rbox rows, each on a 128-byte boundary, and tiles of whole boxes.
    auto tile_rows = [&](int64_t row_bytes) {  // (the most rows a tile, rbox; 0: one box)
      const int64_t cap = stage_bytes / row_bytes;
      if (cap <= 256) return std::make_pair(cap, int64_t{0});
      const int64_t unit = 128 / std::gcd<int64_t>(row_bytes, 128), rbox = 256 / unit * unit;
      return std::make_pair(cap / rbox * rbox, rbox);
    };
    int64_t gb = 0, Q = 0;
    for (int64_t g = std::min<int64_t>(s.G, kStreamColsMaxGb); g >= 1; --g) {
      const int64_t W = g * cpg;
      if (s.G % g != 0 || W > kStreamColsMaxW || W % kVec != 0) continue;
      if (W * kElt > stage_bytes) continue;
      const int64_t q = ceil_div(s.S, tile_rows(W * kElt).first);
      if (2 * q > int64_t{P} * stages || q > 32 * kStreamMaxSlotsPerLane) continue;
      gb = g;
      Q = q;
      if (g * q <= fold_slots) break;
    }
    if (gb == 0) return false;
    const int64_t W = gb * cpg, NB = s.G / gb, NG = s.N * s.G;
    int64_t R = ceil_div(s.S, Q), rbox = tile_rows(W * kElt).second;
    if (rbox > 0) {
      R = ceil_div(R, rbox) * rbox;  // <= the most rows a tile: a multiple of rbox
      Q = ceil_div(s.S, R);
    } else {
      rbox = R;
    }
    const int64_t tiles = s.N * NB * Q;
    if (!pinned && W * kElt < 128) return false;  // narrow rows: a copy of a few sectors a row
    if (tiles + P >= (int64_t{1} << 32)) return false;
    // VD_GROUP_NORM_STREAM_COLS_COPY=rows: a bulk copy a row instead (benchmarks; where there is no tensor map, only
    // pinned: 68 copies a tile ran 7 % slower at (28, 960, 72, 128), more on narrower rows).
    CUtensorMap tx{};
    const bool rows = env_str("VD_GROUP_NORM_STREAM_COLS_COPY") == "rows";
    bool map = false;
#if defined(VD_SM90A)
    // Box coordinates are 32-bit: a block's last box starts before S and may end R rows past it.
    map = !rows && s.N <= std::numeric_limits<int>::max() && s.S + R <= std::numeric_limits<int>::max() &&
          cols_tensor_map(&tx, xt, s, W, rbox);
#endif
    if (!map && !rows && !pinned) return false;
    const scalar_t* x = xt.const_data_ptr<scalar_t>();
    // Slots, group records, block counters and the tile counter, zeroed on the stream.
    const int64_t bytes = (NG * Q + NG) * static_cast<int64_t>(sizeof(uint4)) + (s.N * NB + 1) * int64_t{4};
    const at::Tensor ws = zeroed_workspace(bytes, device, stream);
    StreamColsArgs<scalar_t> a{};
    a.x = x;
    a.out = out;
    a.w = w;
    a.b = b;
    a.C = s.C;
    a.S = s.S;
    a.tiles = tiles;
    a.NB = static_cast<int>(NB);
    a.gb = static_cast<int>(gb);
    a.cpg = static_cast<int>(cpg);
    a.W = static_cast<int>(W);
    a.WV = static_cast<int>(W / kVec);
    a.Q = static_cast<int>(Q);
    a.R = static_cast<int>(R);
    a.stages = stages;
    a.stage_bytes = static_cast<int>(stage_bytes);
    a.rbox = map ? static_cast<int>(rbox) : 0;
    a.eps = static_cast<float>(eps);
    a.slots = reinterpret_cast<uint4*>(ws.mutable_data_ptr());
    a.fin = a.slots + NG * Q;
    a.done = reinterpret_cast<unsigned*>(a.fin + NG);
    a.counter = a.done + s.N * NB;
    a.stats = stats;
    // A folder warp folds a block's groups one after another, each a round trip for its slots: at (28, 960, 72, 128)
    // fp32 on the H200 (4 groups a block), 1 / 2 / 4 folders 809 / 701 / 666 us. VD_GROUP_NORM_STREAM_COLS_FOLDERS
    // sets fewer (benchmarks).
    a.folders = static_cast<int>(std::clamp<int64_t>(
        env_int("VD_GROUP_NORM_STREAM_COLS_FOLDERS", kStreamColsFoldWarps), 1, kStreamColsFoldWarps));
    // Cooperative: every CTA resident at once (a CTA waits for blocks whose tiles others hold).
    launch_cooperative(kernel, std::min<int64_t>(P, tiles), kStreamColsThreads, smem, stream, a, tx);
    return true;
  }
}

// Runs version 12 when the shape, dtype, alignment and device allow it; false leaves the work to the others.
// F: the frames of a frames-major x (its groups are F segments), else 1. pinned: also groups version 6 would take.
template <typename scalar_t>
bool forward_stream(const GNShape& s, int64_t F, const scalar_t* x, scalar_t* out, const scalar_t* w,
                    const scalar_t* b, double eps, bool silu, bool vec, StatsOut stats, int device,
                    cudaStream_t stream, bool pinned) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return false;
  } else {
    constexpr int kVec = max_vec<scalar_t>();
    if (s.channels_last || !vec) return false;
    const int64_t cpg = s.C / s.G, S = s.S / F, seg = cpg * S;
    const int64_t group_bytes = F * seg * static_cast<int64_t>(sizeof(scalar_t));
    // Every dtype past version 6. 16-bit contiguous groups once waited for 4 MB, where version 12 lost to the
    // two-pass kernels below it ((14, 128, 640, 640), 3.3 MB groups, bf16 1087 / 1115 µs, two-pass / version 12);
    // since its 16-bit normalizers it wins there (H200, µs: (14, 256, 288, 512), 2.4 MB, bf16 787 / 630, fp16 768 /
    // 623; (14, 128, 640, 640) bf16 1084 / 883, fp16 1059 / 872).
    if (!pinned && group_bytes <= kStreamMinGroupBytes) return false;
    // A vector never straddles two channels; segments and tiles start on 16 bytes.
    if (S % kVec != 0 || cpg > kStreamMaxCpg || seg >= (int64_t{1} << 31)) return false;
    auto kernel = silu ? stream_rows_kernel<scalar_t, true> : stream_rows_kernel<scalar_t, false>;
    // The ring, in stages of up to kStreamTileBytes (a tile a stage), by how many rounds of the grid a group's 32 KB
    // tiles make: 6 stages of 32 KB under 1.5 rounds; from 1.5 rounds all the shared memory the static arrays leave
    // (222 KB on sm_90) in 7 stages, in 8 for float32 from 2 rounds. H200, µs, 192 KB in 6 / 222 KB in 7 / in 8:
    //   fp32 3.3 rounds (2, 192, 576, 1024) 677 / 654 / 593; 2.2 rounds (14, 128, 576, 1024) 2669 / 2495 / 2411 and
    //   (8, 128, 576, 1024) 1527 / 1428 / 1383; 1.5 rounds (14, 128, 640, 640) 1540 / 1543 / 1558; 1.1 rounds
    //   (14, 256, 288, 512) 1152 / 1194 / 1243;
    //   bf16 2.2 rounds (14, 256, 576, 1024) 2609 / 2471 / 2485; 1.6 rounds (14, 192, 576, 1024) 1791 / 1739 / 1788;
    //   1.1 rounds (14, 128, 576, 1024) 1324 / 1351 / 1385; under a round (frames-major (2, 320 or 640, 14, ...),
    //   fp32) 6 and 7 within 1 %, 8 slower.
    // VD_GROUP_NORM_STREAM_RING_KB and VD_GROUP_NORM_STREAM_STAGES set others (benchmarks).
    const int64_t room =
        std::min<int64_t>(kernel_max_dynamic_smem(kernel, device), kStreamMaxStages * kStreamTileBytes) / 1024;
    if (room < 64) return false;
    // A ring's stages, and the tiles a stage cuts: te elements (whole vectors, as even as they allow: a segment of
    // 2.25 tiles makes three of 0.75), a group's F segments of ceil(seg / te).
    constexpr int64_t kElt = sizeof(scalar_t);
    const int64_t vecs = seg / kVec, room_bytes = room * 1024;
    auto stage_of = [](int64_t ring_bytes, int64_t n) {
      return std::min<int64_t>(ring_bytes / n / 128 * 128, kStreamTileBytes);
    };
    auto tile_of = [&](int64_t sb) { return kVec * ceil_div(vecs, ceil_div(seg, sb / kElt)); };
    // Finer stages only while a group stays within the merger's slots.
    auto holds = [&](int64_t n) {
      return F * ceil_div(seg, tile_of(stage_of(room_bytes, n))) <= 32 * kStreamMaxSlotsPerLane;
    };
    const int64_t q32 = F * ceil_div(seg, kStreamTileBytes / kElt), filled = ceil_div(room_bytes, kStreamTileBytes);
    const int64_t p32 = cooperative_ctas(kernel, device, kStreamThreads, static_cast<size_t>(room_bytes));
    int64_t ring_kb = 6 * kStreamTileBytes / 1024, nst = 6;
    if (sizeof(scalar_t) == 4 && q32 >= 2 * p32 && holds(8)) ring_kb = room, nst = 8;
    else if (2 * q32 >= 3 * p32 && holds(filled)) ring_kb = room, nst = filled;
    const int64_t ring = std::clamp<int64_t>(env_int("VD_GROUP_NORM_STREAM_RING_KB", ring_kb), 64, room) * 1024;
    const int stages =
        static_cast<int>(std::clamp<int64_t>(env_int("VD_GROUP_NORM_STREAM_STAGES", nst), 2, kStreamMaxStages));
    const int64_t stage_bytes = stage_of(ring, stages), te = tile_of(stage_bytes), Qs = ceil_div(seg, te);
    const int64_t Q = F * Qs, tiles = s.N * s.G * Q;
    const size_t smem = static_cast<size_t>(stages) * stage_bytes;
    const int P = cooperative_ctas(kernel, device, kStreamThreads, smem);
    // The merger holds a group's slots in registers; the resident rings must hold more than a group's tiles.
    if (P == 0 || Q > 32 * kStreamMaxSlotsPerLane || int64_t{P} * stages <= Q ||
        tiles + P >= (int64_t{1} << 32))
      return false;
    // The tiles' slots and the tile counter, zeroed on the stream (a slot of zeros: not written yet).
    const int64_t bytes = (tiles + 1) * static_cast<int64_t>(sizeof(uint4));
    const at::Tensor ws = zeroed_workspace(bytes, device, stream);
    StreamArgs<scalar_t> a{};
    a.x = x;
    a.out = out;
    a.w = w;
    a.b = b;
    a.nstride = s.C * s.S;
    a.fstride = s.C * S;
    a.tiles = tiles;
    a.G = static_cast<int>(s.G);
    a.cpg = static_cast<int>(cpg);
    a.Qs = static_cast<int>(Qs);
    a.te = static_cast<int>(te);
    a.stages = stages;
    a.stage_bytes = static_cast<int>(stage_bytes);
    a.Q = static_cast<int>(Q);
    a.seg = static_cast<int>(seg);
    a.S = static_cast<int>(S);
    a.eps = static_cast<float>(eps);
    a.slots = reinterpret_cast<uint4*>(ws.mutable_data_ptr());
    a.counter = reinterpret_cast<unsigned*>(a.slots + tiles);
    a.stats = stats;
    // Cooperative: every CTA resident at once (a CTA waits for groups whose tiles others hold).
    launch_cooperative(kernel, std::min<int64_t>(P, tiles), kStreamThreads, smem, stream, a);
    return true;
  }
}

// The two-pass kernels' second pass (forward apply, backward dx) walks x last to first (GNArgs::reverse);
// VD_GROUP_NORM_APPLY_ORDER=memory keeps first to last (benchmarks compare both in one process).
bool apply_reversed() { return env_str("VD_GROUP_NORM_APPLY_ORDER") != "memory"; }

// Which backward runs: VD_GROUP_NORM_BACKWARD=twopass keeps version 1's kernels, smem2 pins two CTAs an SM, smem3
// takes three wherever the cluster need not grow (benchmarks compare); unset: version 7 where it applies, three CTAs
// an SM where the cluster need not grow and the stages' rule in backward_smem holds. Unless smem2, backward_smem's
// round-fill rule may also take three CTAs at twice the cluster (VD_GROUP_NORM_BACKWARD_FILL=0: not).
int grad_backward_choice() {
  const char* e = std::getenv("VD_GROUP_NORM_BACKWARD");
  const std::string v = e ? e : "";
  return v == "twopass" ? 0 : v == "smem2" ? 2 : v == "smem3" ? 4 : 3;
}

// Version 1's channels_last backward (grad_sums_cols_kernel, dx_cols_kernel), H200, 2026-11-29:
// - Vectors of 8 bytes for 16-bit input (four channels a thread), 16 for float: four channels' five parameters leave
//   registers for eight rows of x and of dy in flight at three CTAs an SM; eight channels held one row (bf16
//   (28, 960, 72, 128) channels_last 843 -> 701 us at 64 rows a thread, 687 at 128).
// - Rows a load (grad_col_batch): eight for 16-bit, four for float, two for double; VD_GROUP_NORM_BACKWARD_COL_BATCH=1
//   pins one (the sums keep their order: the same bits).
// - Rows a thread (grad_col_rows): 128, halved (down to 32) while there would be fewer than five blocks an SM; a
//   block's parameters and its partial sums then weigh less a row (bf16 (28, 960, 72, 128): 761 us at 32, 696 at 64,
//   687 at 128), but too few blocks leave SMs idle at the end (bf16 (14, 512, 72, 128): 219 us at 128 rows, 3.8
//   blocks an SM; 198 at 64). VD_GROUP_NORM_BACKWARD_COL_ROWS=32|64|128 pins it.
template <typename scalar_t>
constexpr int grad_col_vec() {
  return sizeof(scalar_t) == 2 ? 4 : max_vec<scalar_t>();
}

template <typename scalar_t>
constexpr int grad_col_batch() {
  return sizeof(scalar_t) == 2 ? 8 : sizeof(scalar_t) == 4 ? 4 : 2;
}

template <typename A>
int grad_col_rows(const A& a, int vec, int device) {
  const int64_t pinned = env_int("VD_GROUP_NORM_BACKWARD_COL_ROWS", 0);
  if (pinned == 32 || pinned == 64 || pinned == 128) return static_cast<int>(pinned);
  return cols_rows_per_thread(a, vec, device, 5.0);
}

// The pair for aligned input (vec) or not, grad_col_batch rows a load or one (VD_GROUP_NORM_BACKWARD_COL_BATCH=1).
template <typename scalar_t, typename acc_t>
struct ColsGradKernels {
  void (*sums)(GNArgs<scalar_t, acc_t>, Sum2<acc_t>*);
  void (*dx)(GNArgs<scalar_t, acc_t>);
};

template <typename scalar_t, typename acc_t, int VEC, int U, bool LEAN = false>
ColsGradKernels<scalar_t, acc_t> cols_grad_pair() {
  return {grad_sums_cols_kernel<scalar_t, acc_t, VEC, U, LEAN>, dx_cols_kernel<scalar_t, acc_t, VEC, U, LEAN>};
}

template <typename scalar_t, typename acc_t, bool LEAN>
ColsGradKernels<scalar_t, acc_t> cols_grad_kernels_of(bool vec) {
  constexpr int V = grad_col_vec<scalar_t>();
  if (!vec) return cols_grad_pair<scalar_t, acc_t, 1, 1, LEAN>();
  if (env_int("VD_GROUP_NORM_BACKWARD_COL_BATCH", 0) == 1) return cols_grad_pair<scalar_t, acc_t, V, 1, LEAN>();
  return cols_grad_pair<scalar_t, acc_t, V, grad_col_batch<scalar_t>(), LEAN>();
}

template <typename scalar_t, typename acc_t>
ColsGradKernels<scalar_t, acc_t> cols_grad_kernels(bool vec, bool lean) {
  return with_lean<scalar_t, acc_t>(
      lean, [&](auto ln) { return cols_grad_kernels_of<scalar_t, acc_t, decltype(ln)::value>(vec); });
}

// Whether version 7 keeps dz = dy * silu'(z) from its sums' pass for dx (in x's dtype, as eager's SiLU backward
// hands it to the norm's: 5-10 % faster on the UNet / VAE shapes) or, with VD_GROUP_NORM_BACKWARD_DZ=recompute,
// evaluates it again in float (half the dx rounding error); read on every call.
bool grad_keep_dz() {
  const char* e = std::getenv("VD_GROUP_NORM_BACKWARD_DZ");
  return e == nullptr || std::string(e) != "recompute";
}

// Version 7's kernel for SiLU or not, dz kept or not (see GradDz); for 16-bit input, lean or not (with SiLU where dz
// is kept) and, with SiLU and dz kept, THREADS a CTA (256, or 384 at two CTAs an SM).
template <typename scalar_t, int BLOCKS, int THREADS = kSmemThreads>
auto grad_kernel(bool silu, bool keep, bool lean) {
  static_assert(THREADS == kSmemThreads || sizeof(scalar_t) == 2, "384 threads: 16-bit input only");
  if constexpr (sizeof(scalar_t) > 2) {
    return silu ? smem_grad_kernel<scalar_t, true, BLOCKS, kDzFlag> : smem_grad_kernel<scalar_t, false, BLOCKS, kDzFlag>;
  } else {
    auto kept = lean ? smem_grad_kernel<scalar_t, true, BLOCKS, kDzKeep, THREADS, true>
                     : smem_grad_kernel<scalar_t, true, BLOCKS, kDzKeep, THREADS, false>;
    if constexpr (THREADS != kSmemThreads) {
      return kept;  // callers take 384 threads only with SiLU and dz kept
    } else {
      auto plain = lean ? smem_grad_kernel<scalar_t, false, BLOCKS, kDzRecompute, THREADS, true>
                        : smem_grad_kernel<scalar_t, false, BLOCKS, kDzRecompute>;
      return !silu ? plain : (keep ? kept : smem_grad_kernel<scalar_t, true, BLOCKS, kDzRecompute>);
    }
  }
}

// The 16-bit backward kernels' lean form (the mean folded into z's shift and dx's constant, silu_dz_lean: 3-4 fewer
// instructions an element) unless VD_GROUP_NORM_BACKWARD_LEAN=0; version 7 at two CTAs an SM with SiLU and dz kept
// at 384 threads a CTA unless VD_GROUP_NORM_BACKWARD_THREADS=256 (more warps to hide the per-group passes' latency;
// at three CTAs an SM, 384 would cap registers at 56). Both read on every call (switches for a same-process A/B).
inline bool grad_lean() { return env_str("VD_GROUP_NORM_BACKWARD_LEAN") != "0"; }
// Version 7's chunks a part (SmemGradArgs::chunks), 2 unless VD_GROUP_NORM_BACKWARD_CHUNKS=1..8 (read on every call).
// Same-process A/B, H200, device us, one chunk without refills / two with / four with (early): fp32 (28, 320, 72,
// 128) 369.8 / 339.8 / 378.0, (28, 640, 36, 64) 189.1 / 174.6 / 188.7, (14, 512, 72, 128) 282.5 / 268.3 / 283.6;
// bf16 (28, 320, 72, 128) 163.6 / 160.4 / 170.8, (28, 960, 72, 128) 474.8 / 476.1 / 508.4. Every chunk costs two
// more bulk copies and a barrier wait a thread: eight took 10-27 % longer than one.
inline int grad_chunks() {
  return static_cast<int>(std::clamp<int64_t>(env_int("VD_GROUP_NORM_BACKWARD_CHUNKS", 2), 1, kGradMaxChunks));
}
// Version 7's one-stage plans refill each chunk as dx is done with it (SmemGradArgs::early) unless
// VD_GROUP_NORM_BACKWARD_EARLY=0; read on every call.
inline bool grad_early() { return env_str("VD_GROUP_NORM_BACKWARD_EARLY") != "0"; }
// Version 7's choice of three CTAs an SM at twice the cluster where rounds fill better (backward_smem), unless
// VD_GROUP_NORM_BACKWARD_FILL=0 (benchmarks compare); read on every call.
inline bool grad_fill_rule() { return env_str("VD_GROUP_NORM_BACKWARD_FILL") != "0"; }
inline int grad_threads() { return env_int("VD_GROUP_NORM_BACKWARD_THREADS", 384) == 256 ? kSmemThreads : 384; }
// Version 7's vectors a lane a run of the sums' pass, for channels of Sv vectors. Each run costs ~70 instructions a
// lane besides its vectors (the wait check, the channel's scale, the butterflies, the store), so runs are long: the
// most vectors a lane, up to kGradMaxRunV, whose runs cut a whole channel evenly (one run, or a last run over half
// full: 1152 → 9 × 128, 288 → 3 × 96, 576 → 6 × 96 rather than 4 × 128 + 64) with at most 1.5 times the fewest runs;
// where none does (144, 800), the fewest runs, of equal length in whole vectors a lane but the last (96 + 48, 6 × 128
// + 32; not measured at 800). A part's first and last channels may be cut short by the part's edges. Runs are dealt
// to the warps in turn, and runs of unequal length gave some warps the short ones every time: bf16 (28, 640, 36, 64),
// 288 vectors a channel as 128 + 128 + 32 over 12 warps, gained nothing. VD_GROUP_NORM_BACKWARD_RUN=2 gives the
// earlier rule (two a lane for channels of >= 128 vectors, else one), =fewest the fewest runs alone (benchmarks
// compare); read on every call.
inline int grad_run_v(int64_t Sv) {
  const std::string pin = env_str("VD_GROUP_NORM_BACKWARD_RUN");
  if (pin == "2") return Sv >= 4 * kGradRun ? 2 : 1;
  auto fewest = [&](int64_t rv) {  // the fewest vectors a lane that keep the runs of rv vectors a lane
    return ceil_div(Sv, ceil_div(Sv, rv * kGradRun) * kGradRun);
  };
  if (pin != "fewest") {
    const int64_t least = ceil_div(Sv, int64_t{kGradMaxRunV} * kGradRun);
    for (int64_t rv = kGradMaxRunV; rv >= 1; --rv) {
      const int64_t v = fewest(rv), runs = ceil_div(Sv, v * kGradRun), last = Sv - (runs - 1) * v * kGradRun;
      if (2 * runs > 3 * least) break;
      if (runs == 1 || 2 * last > v * kGradRun) return static_cast<int>(v);
    }
  }
  return static_cast<int>(fewest(kGradMaxRunV));
}
// Version 7's smallest cluster, VD_GROUP_NORM_BACKWARD_MIN_K=1|2|4|8|16 (default 1; benchmarks compare), read on
// every call.
inline int grad_min_k() {
  const int64_t k = env_int("VD_GROUP_NORM_BACKWARD_MIN_K", 1);
  return k == 2 || k == 4 || k == 8 || k == 16 ? static_cast<int>(k) : 1;
}

// Version 7's launch plan at BLOCKS CTAs an SM: the smallest cluster from min_k up to 16 whose parts of x and dy fit
// a stage; K = 0 where none does or the device cannot place it.
struct GradPlan {
  int K = 0, stages = 0, max_runs = 0, clusters = 0;
  int64_t part = 0, stage_bytes = 0;
  size_t smem = 0;
};

template <typename scalar_t, int BLOCKS, typename Kernel>
GradPlan plan_grad(Kernel kernel, int64_t cpg, int64_t S, int device, int threads = kSmemThreads, int min_k = 1) {
  constexpr int kVec = max_vec<scalar_t>();
  GradPlan p;
  const int64_t Mv = cpg * S / kVec;
  auto stage_of = [](int64_t part) { return 2 * ceil_div(part * 16, 128) * 128; };
  // At two CTAs an SM, the smallest cluster whose part fits one stage of up to 96 KB (x groups of up to 768 KB at
  // K = 16): fewer, larger parts spread the per-group work (two exchanges, five block barriers) over more bytes,
  // and the SM's other CTA overlaps a CTA's single stage. Against the smallest cluster with parts of <= 48 KB in
  // two stages (H200, same-process A/B, us): bf16 (28, 320, 72, 128) 190.5 vs 219.3, (28, 640, 36, 64) 103.8 vs
  // 114.7, (14, 512, 72, 128) 168.8 vs 178.1; fp32 (28, 320, 72, 128) 410.6 vs 499.4, (28, 640, 36, 64) 210.6 vs
  // 237.3. Three CTAs an SM: one stage of up to 72 KB (backward_smem takes it where two CTAs an SM do not split
  // the group finer, or at twice their cluster by its round-fill rule).
  const int64_t limit = 2 * grad_stage_bytes<BLOCKS>();
  int K = min_k;
  while (K < 16 && stage_of(ceil_div(Mv, K)) > limit) K *= 2;
  p.part = ceil_div(Mv, K);
  p.stage_bytes = stage_of(p.part);
  if (p.stage_bytes > limit) return p;
  p.stages = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kGradMaxStages, 2 * grad_stage_bytes<BLOCKS>() / p.stage_bytes)));
  p.max_runs = static_cast<int>(ceil_div(p.part, int64_t{kGradRun}) + ceil_div(p.part, S / kVec) + 2);
  p.smem = p.stages * p.stage_bytes + 2 * cpg * sizeof(float) + p.max_runs * sizeof(float2) +
           p.stages * kGradMaxChunks * sizeof(uint64_t);
  p.clusters = resident_clusters(kernel, K, device, threads, p.smem);
  if (p.clusters > 0) p.K = K;
  return p;
}

// A plan's time in units of an SM's time a vector: rounds (a cluster takes a group a round) * vectors a part * the
// busiest SM's CTAs (the clusters at work, as the device holds them, spread over its SMs). Counts the last round,
// part empty, as a whole one.
inline int64_t grad_plan_cost(const GradPlan& p, int64_t groups, int sms) {
  const int64_t clusters = p.clusters, busy = std::min(groups, clusters) * p.K;
  return ceil_div(groups, clusters) * p.part * ceil_div(busy, int64_t{sms});
}

// Versions 7 and 10: one float workspace for the CTAs' per-channel sums ([N * G][K][cpg] float2) and grad_weight /
// grad_bias's scratch; run(sums) launches the kernel that writes the sums, then grad_params_kernel adds them.
template <typename scalar_t, typename Run>
void on_chip_param_grads(const GNShape& s, int K, const at::Tensor& like, at::ScalarType wdtype,
                         at::ScalarType bdtype, cudaStream_t stream, at::Tensor& dw, at::Tensor& db, Run&& run) {
  const int64_t cpg = s.C / s.G;
  const ParamGrads<scalar_t, float> pg{wdtype, bdtype};
  const int64_t n_sums = s.N * s.G * K * cpg * 2;
  at::Tensor ws = at::empty({n_sums + pg.scratch(s.C)}, like.options().dtype(at::kFloat));
  float2* sums = reinterpret_cast<float2*>(ws.mutable_data_ptr<float>());
  run(sums);
  const unsigned blocks = grid_of(ceil_div(s.C, int64_t{kWarps}), kOp);
  pg.run(ws, n_sums, s.C, [&](auto* dwp, auto* dbp) {
    using out_t = std::remove_pointer_t<decltype(dwp)>;
    grad_params_kernel<out_t><<<blocks, kThreads, 0, stream>>>(sums, s.N, s.G, K, static_cast<int>(cpg), dwp, dbp);
  }, dw, db);
}

// Runs version 7 when the shape, dtype, alignment and device allow it, with grad_weight / grad_bias in the
// parameters' dtypes (wdtype, bdtype); false (nothing launched) leaves the work to version 1.
template <typename scalar_t>
bool backward_smem(const GNShape& s, const scalar_t* x, const scalar_t* dy, scalar_t* dx, const scalar_t* w,
                   const scalar_t* b, double eps, bool silu, bool vec, const float* stats, const at::Tensor& like,
                   at::ScalarType wdtype, at::ScalarType bdtype, cudaStream_t stream, at::Tensor& dw,
                   at::Tensor& db) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return false;
  } else {
    constexpr int kVec = max_vec<scalar_t>();
    const int choice = grad_backward_choice();
    if (s.channels_last || !vec || choice == 0) return false;
    const int64_t cpg = s.C / s.G;
    if (s.S % kVec != 0 || cpg > kSmemThreads) return false;
    const int device = like.get_device();
    const bool keep = grad_keep_dz();
    const bool lean = grad_lean();
    auto kernel = grad_kernel<scalar_t, 2>(silu, keep, lean);
    const int min_k = grad_min_k();
    GradPlan p = plan_grad<scalar_t, 2>(kernel, cpg, s.S, device, kSmemThreads, min_k);
    if (p.K == 0) return false;
    int threads = kSmemThreads;
    bool three = false;
    // Three CTAs an SM where the cluster stays as small: with 2-4 stages of up to 36 KB where two CTAs an SM would
    // take K = 1 with x and dy of a group within 36 KB (measured when both took parts of <= 48 KB (H200, bf16):
    // (14, 512, 72, 128) 0.209 vs 0.243 ms at K = 16; where K doubled, the exchanges cost more than the extra CTAs
    // gave: 0.302 vs 0.250 ms at (28, 320, 72, 128)); with one stage of up to 72 KB where two CTAs an SM take a
    // single stage too (same-process A/B, H200, us: bf16 (28, 960, 72, 128) 493 vs 582, (14, 512, 72, 128) 134 vs
    // 149; fp16 488 vs 578, 132 vs 149).
    if (choice >= 3) {
      auto kernel3 = grad_kernel<scalar_t, 3>(silu, keep, lean);
      const GradPlan p3 = plan_grad<scalar_t, 3>(kernel3, cpg, s.S, device, kSmemThreads, min_k);
      if (p3.K == p.K && (p3.stages > 1 || p.stages == 1 || choice == 4)) {
        p = p3;
        kernel = kernel3;
        three = true;
      }
      // A one-stage plan at two CTAs an SM whose last round leaves many clusters idle: three CTAs an SM at twice
      // the cluster (grad_fill_rule), from K = 1 where that costs 3 % less by grad_plan_cost or no more with two
      // CTAs' last round under half full (an SM left with one CTA a stage does not keep its loads going; three
      // CTAs' rounds of half the bytes take time closer to their groups), from K >= 2 where it costs 10 % less
      // (the larger cluster's exchanges cost what grad_plan_cost leaves out). Same-process A/B, H200, us, two CTAs
      // / three: bf16 (N, 1280, 18, 32) (K = 1) N = 2 13.2 / 11.7, 16 37.6 / 38.3, 20 49.3 / 44.5, 24 50.4 / 52.0,
      // 26 55.1 / 54.0, 28 62.7 / 57.1, 32 63.9 / 65.0; fp32 (28, 1280, 16, 16) 58.1 / 49.7; from K = 4, bf16
      // (2, 320, 72, 128) 23.8 / 21.2, (28, 320, 72, 128) 160.6 / 168.8 (the model's 5 % gain a loss); fp32 from
      // K = 8, (2, 320, 72, 128) 44.4 / 38.6; from K = 4, (28, 640, 36, 64) 172.4 / 175.5.
      // p is the 256-thread plan; 16-bit input with SiLU runs it at 384 threads below, with the same shared memory
      // and clusters.
      if (!three && p.stages == 1 && p.K < 16 && grad_fill_rule()) {
        const GradPlan q = plan_grad<scalar_t, 3>(kernel3, cpg, s.S, device, kSmemThreads, 2 * p.K);
        if (q.K == 2 * p.K && q.stages == 1) {
          const int sms = sm_count();  // the current device: the op's guard holds x's
          const int64_t groups = s.N * s.G, cp = grad_plan_cost(p, groups, sms), cq = grad_plan_cost(q, groups, sms);
          const int64_t last = groups % p.clusters;  // groups in p's last round, 0 where it is full
          const bool half_empty = last > 0 && 2 * last < p.clusters;
          const bool k1 = p.K == 1;
          if (100 * cq < (k1 ? 97 : 90) * cp || (k1 && cq <= cp && half_empty)) {
            p = q;
            kernel = kernel3;
            three = true;
          }
        }
      }
    }
    // Two CTAs an SM, 16-bit input with SiLU and dz kept: 384 threads a CTA (grad_threads; same-process A/B, H200,
    // bf16, us, lean kernels: (28, 320, 72, 128) 162.7 vs 167.6, (28, 640, 36, 64) 89.0 vs 94.7, (28, 1280, 18, 32)
    // 61.9 vs 63.5). Where three CTAs an SM are taken, 384 threads at two lost: (14, 512, 72, 128) 140.5 vs 130.1,
    // (28, 960, 72, 128) 538.8 vs 469.9.
    if constexpr (sizeof(scalar_t) == 2) {
      if (!three && silu && keep && grad_threads() == 384) {
        auto kernel384 = grad_kernel<scalar_t, 2, 384>(silu, keep, lean);
        const GradPlan p384 = plan_grad<scalar_t, 2>(kernel384, cpg, s.S, device, 384, min_k);
        if (p384.K == p.K) {
          p = p384;
          kernel = kernel384;
          threads = 384;
        }
      }
    }
    const int K = p.K;

    SmemGradArgs<scalar_t> a{};
    a.f = fused_args(s, 1, x, dx, w, b, eps, silu, threads, K, p.part);
    a.dy = dy;
    a.groups = s.N * s.G;
    a.stages = p.stages;
    a.stage_bytes = static_cast<int>(p.stage_bytes);
    a.dy_off = static_cast<int>(p.stage_bytes / 2);
    a.max_runs = p.max_runs;
    a.keep_dz = keep;
    a.stats = stats;
    // Chunks a part (grad_chunks), none under kGradMinChunkVectors vectors.
    const int64_t chunks = std::clamp<int64_t>(p.part / kGradMinChunkVectors, 1, grad_chunks());
    a.chunk_v = static_cast<int>(ceil_div(p.part, chunks));
    a.chunks = static_cast<int>(ceil_div(p.part, int64_t{a.chunk_v}));
    a.early = p.stages == 1 && grad_early();
    a.run_v = grad_run_v(s.S / kVec);
    on_chip_param_grads<scalar_t>(s, K, like, wdtype, bdtype, stream, dw, db, [&](float2* sums) {
      a.sums = sums;
      launch_clusters(kOp, kernel, a, std::min<int64_t>(a.groups, p.clusters), K, threads, p.smem, stream);
    });
    return true;
  }
}

// The group block of versions 5 and 8 (channels_last): the fewest whole groups that make whole vectors and a row
// of >= 128 bytes (as far as kColsMaxTCV vectors allow); 0 where no block makes whole vectors.
inline int64_t cols_block(const GNShape& s, int vec, int64_t elt) {
  const int64_t cpg = s.C / s.G;
  int64_t gb = 0;
  for (int64_t d = 1; d <= s.G; ++d) {
    if (s.G % d != 0 || d * cpg % vec != 0) continue;
    if (d * cpg / vec > kColsMaxTCV) break;
    gb = d;
    if (d * cpg * elt >= 128) break;
  }
  return gb;
}

// Runs version 5 (channels_last) when the shape, dtype and alignment allow it; false leaves the work to
// version 1's cols kernels.
template <typename scalar_t>
bool forward_l2_cols(const GNShape& s, const scalar_t* x, scalar_t* out, const scalar_t* w, const scalar_t* b,
                     double eps, bool silu, bool vec, StatsOut stats, int device, cudaStream_t stream) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return false;
  } else {
    constexpr int kVec = max_vec<scalar_t>();
    constexpr int64_t kElt = sizeof(scalar_t);
    if (!s.channels_last || !vec) return false;  // vec: 16-byte aligned, whole vectors of channels
    const int64_t cpg = s.C / s.G, gb = cols_block(s, kVec, kElt);
    if (gb == 0) return false;
    const int64_t W = gb * cpg, TCV = W / kVec, R = kColsThreads / TCV, blocks = s.G / gb;
    // The smallest cluster whose parts fit kL2PartBytes (as version 4; larger blocks keep version 1),
    // then larger ones while there are fewer than two CTAs an SM and each thread keeps a row or more.
    int64_t K = 1;
    while (K < 16 && ceil_div(s.S, K) * W * kElt > kL2PartBytes) K *= 2;
    if (ceil_div(s.S, K) * W * kElt > kL2PartBytes) return false;
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    while (K < 16 && s.N * blocks * K < 2 * sms && ceil_div(s.S, 2 * K) >= R) K *= 2;
    const size_t smem = cols_smem_bytes(static_cast<int>(R), static_cast<int>(W), static_cast<int>(gb));
    auto kernel = silu ? l2_cols_kernel<scalar_t, true> : l2_cols_kernel<scalar_t, false>;
    if (!cluster_ok(kernel, static_cast<int>(K), device, kColsThreads, smem)) return false;
    ColsArgs<scalar_t> a{};
    a.x = x;
    a.out = out;
    a.w = w;
    a.b = b;
    a.C = s.C;
    a.S = s.S;
    a.rows = ceil_div(s.S, K);
    a.blocks = static_cast<int>(blocks);
    a.cpg = static_cast<int>(cpg);
    a.gb = static_cast<int>(gb);
    a.W = static_cast<int>(W);
    a.TCV = static_cast<int>(TCV);
    a.R = static_cast<int>(R);
    a.K = static_cast<int>(K);
    a.eps = static_cast<float>(eps);
    a.stats = stats;
    launch_clusters(kOp, kernel, a, s.N * blocks, static_cast<int>(K), kColsThreads, smem, stream);
    return true;
  }
}

// The tensor-copy boxes of versions 8 and 10 for a CTA's `need` rows of row_bytes: as few boxes as cover the rows,
// each of <= 256 rows and a multiple of 128 bytes (tensor copies land on 128-byte boundaries); rows = boxes * rbox.
struct ColsBoxes {
  int64_t rbox, rows;
};
inline ColsBoxes cols_boxes(int64_t need, int64_t row_bytes) {
  const int64_t unit = 128 / std::gcd<int64_t>(row_bytes, 128);
  for (int64_t nbox = ceil_div(need, int64_t{256});; ++nbox) {
    const int64_t rbox = ceil_div(ceil_div(need, nbox), unit) * unit;
    if (rbox <= 256) return {rbox, nbox * rbox};
  }
}

// How the copy engine fills an L2 miss of versions 8 and 10: 64 bytes. A box row is W * elt bytes (128-240 on the
// UNet shapes) of a C * elt row, mostly not on a 256-byte boundary, and 256-byte fills fetched the neighbouring
// blocks' bytes too (fp32 (28, 320, 72, 128): 261 us a call with 256-byte fills, 243 with 64-byte ones).
// VD_GROUP_NORM_L2_PROMOTION=none|64|128|256 pins one (benchmarks compare them in one process).
inline CUtensorMapL2promotion cols_promotion() {
  const char* e = std::getenv("VD_GROUP_NORM_L2_PROMOTION");
  const std::string v = e ? e : "";
  return v == "none"  ? CU_TENSOR_MAP_L2_PROMOTION_NONE
         : v == "64"  ? CU_TENSOR_MAP_L2_PROMOTION_L2_64B
         : v == "128" ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
         : v == "256" ? CU_TENSOR_MAP_L2_PROMOTION_L2_256B
                      : CU_TENSOR_MAP_L2_PROMOTION_L2_64B;
}

// The 4-D map (C, S, N, 1) of channels_last t for boxes of W channels by rbox rows (versions 8 and 10).
inline bool cols_tensor_map(CUtensorMap* m, const at::Tensor& t, const GNShape& s, int64_t W, int64_t rbox) {
  const uint32_t box[4] = {static_cast<uint32_t>(W), static_cast<uint32_t>(rbox), 1, 1};
  return tensor_map_4d(m, t, {s.C, s.S, s.N, 1}, {s.C, s.S * s.C, s.N * s.S * s.C}, box, CU_TENSOR_MAP_SWIZZLE_NONE,
                       cols_promotion());
}

// Group slots a thread's vector of version 8 / 10 may touch: the most groups one vector column of a block spans.
inline int cols_slots(int64_t TCV, int64_t cpg, int vec) {
  int ns = 1;
  for (int64_t c = 0; c < TCV; ++c) ns = std::max<int>(ns, static_cast<int>((c * vec + vec - 1) / cpg - c * vec / cpg + 1));
  return ns;
}

// Rounds of blocks over version 8's resident clusters from which 16-bit one-stage parts of rows off 32-byte sectors
// go to the two-pass kernels (forward_smem_cols).
constexpr int64_t kSmemColsTwoPassRounds = 10;

// VD_GROUP_NORM_THREE_CTAS=0: version 8 keeps two CTAs an SM (benchmarks compare both in one process).
inline bool three_ctas_allowed() {
  const char* e = std::getenv("VD_GROUP_NORM_THREE_CTAS");
  return e == nullptr || std::string(e) != "0";
}

// Runs version 8 (channels_last, sm_90) when the shape, dtype, alignment and device allow it; false leaves the
// work to version 5 and then version 1. two_pass (null when the family is pinned): set where version 8 declines
// because the two-pass kernels are faster, which version 5 is not either.
template <typename scalar_t>
bool forward_smem_cols(const GNShape& s, const at::Tensor& x, scalar_t* out, const scalar_t* w, const scalar_t* b,
                       double eps, bool silu, bool vec, StatsOut stats, int device, cudaStream_t stream,
                       bool* two_pass) {
#if defined(VD_SM90A)
  if constexpr (std::is_same_v<scalar_t, double>) {
    return false;
  } else {
    constexpr int kVec = max_vec<scalar_t>();
    constexpr int64_t kElt = sizeof(scalar_t);
    // vec: 16-byte aligned, whole vectors of channels (so rows are 16-byte multiples, as tensor copies need).
    if (!s.channels_last || !vec || s.S > std::numeric_limits<int>::max() / 2 || s.N > std::numeric_limits<int>::max())
      return false;
    const int64_t cpg = s.C / s.G, gb = cols_block(s, kVec, kElt);
    // A thread's vector touches at most kSmemColsSlots groups when 2 * cpg >= VEC.
    if (gb == 0 || 2 * cpg < kVec) return false;
    const int64_t W = gb * cpg, TCV = W / kVec, R = kSmemColsThreads / TCV, row_bytes = W * kElt;
    if (W > 256) return false;  // a tensor-copy box is at most 256 elements wide
    const int ns = cols_slots(TCV, cpg, kVec);
    // The smallest cluster (up to 16) whose parts fit kSmemPartBytes, then larger ones while there are fewer
    // than two CTAs an SM and each thread keeps a row or more (as version 5); past 16 x 48 KB, one stage of up
    // to kSmemBigPartBytes a CTA.
    const int64_t items = s.N * (s.G / gb);
    int K = 1;
    while (K < 16 && ceil_div(s.S, K) * row_bytes > kSmemPartBytes) K *= 2;
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    while (K < 16 && items * K < 2 * sms && ceil_div(s.S, 2 * K) >= R) K *= 2;
    const auto [rbox, rows] = cols_boxes(ceil_div(s.S, int64_t{K}), row_bytes);
    const int64_t part = rows * row_bytes;
    if (part > kSmemBigPartBytes) return false;
    const int64_t stage_bytes = ceil_div(part, int64_t{128}) * 128;
    const int stages = part <= kSmemPartBytes
                           ? static_cast<int>(std::min<int64_t>(kSmemMaxStages, kSmemDataBytes / stage_bytes))
                           : 1;
    // fp32 parts in one stage whose rows are not whole 32-byte sectors (cpg 30 or 60: 240-byte rows, every other
    // block's starting mid-sector) ran 6-19 % slower than the two-pass kernels at 960 channels (H200: 700 vs 587 us
    // at (32, 960, 64, 96); 437 vs 411 at three CTAs an SM), version 5 in between (675); in a ring of stages (1920
    // channels at 32 x 48) version 8 stays ahead.
    if (two_pass != nullptr && kElt == 4 && stages == 1 && row_bytes % 32 != 0) {
      *two_pass = true;
      return false;
    }
    SmemColsLayout lay(stages, static_cast<int>(stage_bytes), ns, static_cast<int>(gb), K, static_cast<int>(W),
                       static_cast<int>(TCV), false);
    auto kernel = silu ? smem_cols_kernel<scalar_t, true, 2, false> : smem_cols_kernel<scalar_t, false, 2, false>;
    int clusters = resident_clusters(kernel, K, device, kSmemColsThreads, lay.bytes);
    // One stage a CTA: its next block's load waits for this one's stores, and the SM's other CTA is all that
    // overlaps them. A part of up to ~72 KB with the group states folded over warps (TCV divides 32), ~64 KB with
    // them unfolded (e.g. 10 vector columns at 320 channels), leaves room for a third CTA (<= 80 registers) where
    // the device places more clusters that way (sm_90: 228 KB an SM, 1 KB reserved a CTA).
    // VD_GROUP_NORM_THREE_CTAS=0 keeps two.
    bool three = false;
    if (stages == 1 && three_ctas_allowed()) {
      const bool fold = 32 % TCV == 0;
      const SmemColsLayout lay3(1, static_cast<int>(stage_bytes), ns, static_cast<int>(gb), K, static_cast<int>(W),
                                static_cast<int>(TCV), fold);
      auto kernel3 = fold ? (silu ? smem_cols_kernel<scalar_t, true, 3, true> : smem_cols_kernel<scalar_t, false, 3, true>)
                          : (silu ? smem_cols_kernel<scalar_t, true, 3, false> : smem_cols_kernel<scalar_t, false, 3, false>);
      const int clusters3 = resident_clusters(kernel3, K, device, kSmemColsThreads, lay3.bytes);
      if (clusters3 > clusters) {
        lay = lay3;
        kernel = kernel3;
        clusters = clusters3;
        three = true;
      }
    }
    // fp32 parts in one stage at two CTAs an SM: version 13's ring measured faster where it runs (float32 input
    // larger than the L2; H200, µs, version 8 / version 13: (28, 320, 72, 128) 243 / 226, (28, 640, 72, 128)
    // 482 / 409, (28, 320, 64, 128) 217 / 202, (8, 320, 72, 128) 82.7 / 74.6). With three CTAs an SM version 8 stays
    // ahead ((14, 512, 72, 128) 156 / 160). VD_GROUP_NORM_THREE_CTAS=0 keeps version 8 at two CTAs here too.
    if (two_pass != nullptr && kElt == 4 && stages == 1 && !three && three_ctas_allowed() &&
        forward_stream_cols<scalar_t>(s, x, out, w, b, eps, silu, vec, stats, device, stream, false))
      return true;
    if (clusters == 0) return false;
    // 16-bit parts in one stage with such rows: the two-pass kernels pass version 8 where its clusters walk many
    // rounds of blocks (H200, bf16 / fp16 960 channels, µs, version 8 / two-pass: (32, 960, 64, 96) 333 / 311,
    // (28, 960, 64, 96) 286 / 277, (32, 960, 64, 64) 223 / 220; with fewer blocks version 8 stays ahead:
    // (16, 960, 64, 96) 160 / 162, (16, 960, 64, 64) 113 / 116, (8, 960, 64, 96) 87 / 92).
    if (two_pass != nullptr && kElt == 2 && stages == 1 && row_bytes % 32 != 0 &&
        items >= kSmemColsTwoPassRounds * clusters) {
      *two_pass = true;
      return false;
    }
    CUtensorMap tx;
    if (!cols_tensor_map(&tx, x, s, W, rbox)) return false;
    SmemColsArgs<scalar_t> a{};
    a.out = out;
    a.w = w;
    a.b = b;
    a.C = s.C;
    a.items = items;
    a.S = static_cast<int>(s.S);
    a.rows = static_cast<int>(rows);
    a.rbox = static_cast<int>(rbox);
    a.blocks = static_cast<int>(s.G / gb);
    a.cpg = static_cast<int>(cpg);
    a.gb = static_cast<int>(gb);
    a.W = static_cast<int>(W);
    a.TCV = static_cast<int>(TCV);
    a.R = static_cast<int>(R);
    a.ns = ns;
    a.K = K;
    a.stages = stages;
    a.stage_bytes = static_cast<int>(stage_bytes);
    a.eps = static_cast<float>(eps);
    a.stats = stats;
    launch_clusters(kOp, kernel, a, std::min<int64_t>(items, clusters), K, kSmemColsThreads, lay.bytes, stream, tx);
    return true;
  }
#else
  return false;
#endif
}

// Per-CTA shared memory of version 10: two CTAs an SM (228 KB, 1 KB of it reserved a CTA).
constexpr int64_t kColsGradSmem = 112 * 1024;

// Runs version 10 (channels_last backward, sm_90) when the shape, dtype, alignment and device allow it, with
// grad_weight / grad_bias in the parameters' dtypes; false (nothing launched) leaves the work to version 1.
template <typename scalar_t>
bool backward_smem_cols(const GNShape& s, const at::Tensor& x, const at::Tensor& dy, scalar_t* dx, const scalar_t* w,
                        const scalar_t* b, double eps, bool silu, bool vec, const float* stats,
                        at::ScalarType wdtype, at::ScalarType bdtype, cudaStream_t stream, at::Tensor& dw,
                        at::Tensor& db) {
#if defined(VD_SM90A)
  if constexpr (std::is_same_v<scalar_t, double>) {
    return false;
  } else {
    constexpr int kVec = max_vec<scalar_t>();
    constexpr int64_t kElt = sizeof(scalar_t);
    if (!s.channels_last || !vec || grad_backward_choice() == 0 || s.S > std::numeric_limits<int>::max() / 2 ||
        s.N > std::numeric_limits<int>::max())
      return false;
    const int64_t cpg = s.C / s.G;
    if (2 * cpg < kVec) return false;  // a thread's vector touches at most kSmemColsSlots groups
    const int device = x.get_device();
    // The widest block (version 8's, or fewer groups) whose rows of x and dy fit one stage at the smallest
    // cluster (up to 16) with room left for the rest: x and dy of a block take twice version 8's bytes.
    struct Geom {
      int64_t gb = 0, W = 0, TCV = 0, R = 0, rbox = 0, rows = 0, part = 0;
      int K = 0, ns = 1;
    } best;
    auto geom = [&](int64_t gb, int K) {
      Geom g;
      g.gb = gb;
      g.W = gb * cpg;
      g.TCV = g.W / kVec;
      g.R = kSmemColsThreads / g.TCV;
      g.K = K;
      g.ns = cols_slots(g.TCV, cpg, kVec);
      const ColsBoxes bx = cols_boxes(ceil_div(s.S, int64_t{K}), g.W * kElt);
      g.rbox = bx.rbox;
      g.rows = bx.rows;
      g.part = g.rows * g.W * kElt;  // a multiple of 128 bytes
      return g;
    };
    auto layout = [&](const Geom& g, int stages) {
      return SmemColsGradLayout(stages, static_cast<int>(2 * g.part), g.ns, static_cast<int>(g.gb), g.K,
                                static_cast<int>(g.W), kVec);
    };
    for (int64_t gb = cols_block(s, kVec, kElt); gb >= 1 && best.K == 0; --gb) {
      if (s.G % gb != 0 || gb * cpg % kVec != 0 || gb * cpg > 256) continue;
      for (int K = 1; K <= 16; K *= 2) {
        const Geom g = geom(gb, K);
        if (layout(g, 1).bytes <= kColsGradSmem) {
          best = g;
          break;
        }
      }
    }
    // Blocks over 16 CTAs (one stage of ~90 KB each, e.g. (28, 320, 72, 128)) stay with version 1: float 755 vs 600
    // us there, 465 vs 471 at (14, 512, 72, 128); bf16 296 vs 238 and 208 vs 195 since version 1's 8-byte vectors
    // and 8-row loads (H200). At 8 CTAs and fewer this version wins: bf16 (28, 640, 36, 64) 126 vs 150 us.
    if (best.K == 0 || best.K == 16) return false;
    // Larger clusters while there are fewer than two CTAs an SM and each thread keeps a row or more (as version 8).
    const int64_t items = s.N * (s.G / best.gb);
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    while (best.K < 16 && items * best.K < 2 * sms && ceil_div(s.S, int64_t{2 * best.K}) >= best.R)
      best = geom(best.gb, 2 * best.K);
    const int64_t stage_bytes = 2 * best.part;
    const int64_t other = layout(best, 1).bytes - stage_bytes;
    const int stages = static_cast<int>(
        std::max<int64_t>(1, std::min<int64_t>(kSmemMaxStages, (kColsGradSmem - other) / stage_bytes)));
    const SmemColsGradLayout lay = layout(best, stages);
    auto kernel = silu ? smem_cols_grad_kernel<scalar_t, true> : smem_cols_grad_kernel<scalar_t, false>;
    const int clusters = resident_clusters(kernel, best.K, device, kSmemColsThreads, lay.bytes);
    if (clusters == 0) return false;
    CUtensorMap tx, tdy;
    if (!cols_tensor_map(&tx, x, s, best.W, best.rbox) || !cols_tensor_map(&tdy, dy, s, best.W, best.rbox)) return false;
    SmemColsGradArgs<scalar_t> a{};
    SmemColsArgs<scalar_t>& f = a.f;
    f.out = dx;
    f.w = w;
    f.b = b;
    f.C = s.C;
    f.items = items;
    f.S = static_cast<int>(s.S);
    f.rows = static_cast<int>(best.rows);
    f.rbox = static_cast<int>(best.rbox);
    f.blocks = static_cast<int>(s.G / best.gb);
    f.cpg = static_cast<int>(cpg);
    f.gb = static_cast<int>(best.gb);
    f.W = static_cast<int>(best.W);
    f.TCV = static_cast<int>(best.TCV);
    f.R = static_cast<int>(best.R);
    f.ns = best.ns;
    f.K = best.K;
    f.stages = stages;
    f.stage_bytes = static_cast<int>(stage_bytes);
    f.eps = static_cast<float>(eps);
    a.dy_off = static_cast<int>(best.part);
    a.stats = stats;
    on_chip_param_grads<scalar_t>(s, best.K, x, wdtype, bdtype, stream, dw, db, [&](float2* sums) {
      a.sums = sums;
      launch_clusters(kOp, kernel, a, std::min<int64_t>(items, clusters), best.K, kSmemColsThreads, lay.bytes, stream,
                      tx, tdy);
    });
    return true;
  }
#else
  return false;
#endif
}

// Runs version 3 when the shape, dtype and alignment allow it; false leaves the work to version 1.
template <typename scalar_t>
bool forward_fused(const GNShape& s, int64_t F, const scalar_t* x, scalar_t* out, const scalar_t* w,
                   const scalar_t* b, double eps, bool silu, bool vec, StatsOut stats, int device,
                   cudaStream_t stream) {
  if constexpr (std::is_same_v<scalar_t, double>) {
    return false;
  } else {
    constexpr int kVec = max_vec<scalar_t>();
    if (s.channels_last || !vec) return false;
    const int64_t cpg = s.C / s.G, S = s.S / F, seg = cpg * S;
    const FusedPlan p = plan_fused(F * seg, seg, cpg, kVec);
    if (p.K == 0) return false;
    auto kernel = p.V == 4 ? fused_rows_kernel<scalar_t, 4>
                : p.V == 8 ? fused_rows_kernel<scalar_t, 8>
                           : fused_rows_kernel<scalar_t, 12>;
    // The occupancy query asks for the most shared memory any launch of this kernel does.
    if (!cluster_ok(kernel, p.K, device, kFusedThreads, 2 * kFusedMaxCpg * sizeof(float))) return false;
    auto a = fused_args(s, F, x, out, w, b, eps, silu, kFusedThreads, p.K, p.part);
    a.stats = stats;
    launch_clusters(kOp, kernel, a, s.N * s.G, p.K, kFusedThreads, 2 * cpg * sizeof(float), stream);
    return true;
  }
}

// Version 1's channels_last forward apply (apply_cols_kernel), H200, 2026-11-29: for 16-bit input, rows loaded eight
// at a time in 8-byte vectors (four channels a thread), four CTAs an SM. Against one 16-byte row a load at six CTAs
// (bf16, device us of the apply kernel): (28, 960, 72, 128) 318 -> 248, (14, 128, 576, 1024) 1258 -> 1017,
// channels_last_3d (2, 320, 14, 72, 128) 113 -> 84; the outputs are the same bits. VD_GROUP_NORM_APPLY_COL_BATCH=1
// keeps one row a load. Float keeps one: four rows a load at four CTAs measured mixed (whole op, us: (14, 128, 576,
// 1024) 3051 -> 3127, (2, 320, 14, 72, 128) 275 -> 270, (2, 320, 14, 32, 32) 50.6 -> 43.3).
template <typename scalar_t, typename acc_t>
struct ApplyCols {
  void (*kernel)(GNArgs<scalar_t, acc_t>);
  int vec;  // elements a vector, for plan()
};

template <typename scalar_t, typename acc_t>
ApplyCols<scalar_t, acc_t> apply_cols_choice(bool vec) {
  constexpr int V = max_vec<scalar_t>();
  if (!vec) return {apply_cols_kernel<scalar_t, acc_t, 1>, 1};
  if constexpr (sizeof(scalar_t) == 2) {
    if (env_int("VD_GROUP_NORM_APPLY_COL_BATCH", 0) != 1) return {apply_cols_kernel<scalar_t, acc_t, 4, 8, 4>, 4};
  }
  return {apply_cols_kernel<scalar_t, acc_t, V>, V};
}

template <typename scalar_t>
GNArgs<scalar_t, at::opmath_type<scalar_t>> make_args(const GNShape& s, const at::Tensor& w, const at::Tensor& b,
                                                      bool silu) {
  GNArgs<scalar_t, at::opmath_type<scalar_t>> a{};
  a.N = s.N;
  a.C = s.C;
  a.G = s.G;
  a.F = 1;
  a.S = s.S;
  a.cpg = s.C / s.G;
  a.w = w.defined() ? w.const_data_ptr<scalar_t>() : nullptr;
  a.b = b.defined() ? b.const_data_ptr<scalar_t>() : nullptr;
  a.silu = silu;
  return a;
}

// The forward; every kernel family also writes the statistics into stats ((3, N, G), norm.h) when it is defined.
at::Tensor forward_cuda(const at::Tensor& x_in, const GNShape& s, const std::optional<at::Tensor>& weight,
                        const std::optional<at::Tensor>& bias, double eps, bool silu, const at::Tensor& stats) {
  const c10::cuda::CUDAGuard guard(x_in.device());
  at::Tensor out = group_norm_output(x_in, s);
  if (x_in.numel() == 0) return out;
  // Frames-major memory is read and written in place; everything else in the layout rule's format.
  at::Tensor x = s.frames_major ? x_in : x_in.contiguous(layout_memory_format(x_in));
  // Like the CPU kernel, weight and bias are used in x's dtype.
  at::Tensor w = group_norm_param(weight, x), b = group_norm_param(bias, x);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "group_norm_silu_cuda", [&] {
    using L = Launcher<scalar_t>;
    using acc_t = typename L::acc_t;
    auto a = make_args<scalar_t>(s, w, b, silu);
    a.x = x.const_data_ptr<scalar_t>();
    a.out = out.mutable_data_ptr<scalar_t>();
    const bool vec = L::can_vectorize(a, s.channels_last, {a.x, a.out});
    acc_t* const st = stats.defined() ? stats.mutable_data_ptr<acc_t>() : nullptr;
    // The float-statistics families (not taken for float64 x) write float statistics.
    const StatsOut so{std::is_same_v<acc_t, float> ? reinterpret_cast<float*>(st) : nullptr, s.N * s.G};
    if (s.frames_major) {  // version 1 walks (n, f, c) rows of H * W elements
      a.F = x.size(2);
      a.S = s.S / a.F;
    }
    const GNKernels use = gn_kernels();
    const bool any = use == GNKernels::kAny;
    // Version 8 / 6 ("smem") first; then version 5 for channels_last, version 4 otherwise; version 3 (NC* and
    // frames-major only) first for small inputs, and offered once.
    auto l2 = [&] {
      return s.channels_last
                 ? forward_l2_cols<scalar_t>(s, a.x, a.out, a.w, a.b, eps, silu, vec, so, x.get_device(), stream)
                 : forward_l2<scalar_t>(s, a.F, a.x, a.out, a.w, a.b, eps, silu, vec, so, x.get_device(), stream);
    };
    auto onchip = [&] {
      return forward_fused<scalar_t>(s, a.F, a.x, a.out, a.w, a.b, eps, silu, vec, so, x.get_device(), stream);
    };
    bool two_pass = false;  // version 8 declined for the two-pass kernels: version 5 is skipped too
    auto smem = [&] {
      return s.channels_last
                 ? forward_smem_cols<scalar_t>(s, x, a.out, a.w, a.b, eps, silu, vec, so, x.get_device(), stream,
                                               any ? &two_pass : nullptr)
                 : forward_smem<scalar_t>(s, a.F, a.x, a.out, a.w, a.b, eps, silu, vec, so, x.get_device(), stream,
                                          any);
    };
    if ((any || use == GNKernels::kSmem) && smem()) return;
    auto streamed = [&] {
      const bool pinned = use == GNKernels::kStream;
      return s.channels_last
                 ? forward_stream_cols<scalar_t>(s, x, a.out, a.w, a.b, eps, silu, vec, so, x.get_device(), stream,
                                                 pinned)
                 : forward_stream<scalar_t>(s, a.F, a.x, a.out, a.w, a.b, eps, silu, vec, so, x.get_device(), stream,
                                            pinned);
    };
    if ((any || use == GNKernels::kStream) && streamed()) return;
    const bool small = x.numel() * static_cast<int64_t>(sizeof(scalar_t)) < kSmallBytes;
    if (any && small && onchip()) return;
    // Version 4 (NC*) keeps each group in L2 between its passes, but issue-bound it lost to the two-pass
    // kernels (16-bit statistics at the read rate) on every input larger than the L2: 0.434 vs 0.388 ms at
    // (28, 960, 72, 128), 0.099 vs 0.083 on 83 MB frames-major input; it still wins on 41 MB (0.046 vs 0.049).
    // float input: it lost to the two-pass kernels (batched float statistics) in the L2 too: 1.018 vs 0.721
    // ms at (28, 960, 72, 128), 0.091 vs 0.075 on 41 MB frames-major input (2, 1280, 14, 18, 32).
    const bool l2_first = s.channels_last || sizeof(scalar_t) == 8 ||
                          (sizeof(scalar_t) == 2 &&
                           x.numel() * static_cast<int64_t>(sizeof(scalar_t)) <= l2_cache_bytes(x.get_device()));
    if (((any && l2_first && !two_pass) || use == GNKernels::kL2) && l2()) return;
    if (((any && !small) || use == GNKernels::kOnChip) && onchip()) return;
    const at::Tensor buf = L::stats(a, s.channels_last, vec, eps, x.options(), x.get_device(), stream, st);
    const ApplyCols<scalar_t, acc_t> ac = apply_cols_choice<scalar_t, acc_t>(vec);
    plan(a, s.channels_last ? ac.vec : vec ? L::kVec : 1, a.S, s.channels_last);
    a.reverse = apply_reversed();
    const unsigned blocks = grid_of(s.channels_last ? a.items : ceil_div(a.items, kWarps), kOp);
    if (!s.channels_last) {
      if (vec) apply_rows_kernel<scalar_t, acc_t, L::kVec><<<blocks, kThreads, 0, stream>>>(a);
      else apply_rows_kernel<scalar_t, acc_t, 1><<<blocks, kThreads, 0, stream>>>(a);
    } else {
      ac.kernel<<<blocks, kThreads, 0, stream>>>(a);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor group_norm_silu_cuda(const at::Tensor& x, int64_t num_groups, const std::optional<at::Tensor>& weight,
                                const std::optional<at::Tensor>& bias, double eps, bool silu) {
  const GNShape s = check_group_norm(x, num_groups, weight, bias, eps);
  return forward_cuda(x, s, weight, bias, eps, silu, at::Tensor());
}

std::tuple<at::Tensor, at::Tensor> group_norm_silu_forward_cuda(const at::Tensor& x, int64_t num_groups,
                                                                const std::optional<at::Tensor>& weight,
                                                                const std::optional<at::Tensor>& bias, double eps,
                                                                bool silu) {
  const GNShape s = check_group_norm(x, num_groups, weight, bias, eps);
  at::Tensor stats = group_norm_stats_output(x, s);
  at::Tensor out = forward_cuda(x, s, weight, bias, eps, silu, stats);
  return {out, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_silu_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x_in, int64_t num_groups, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool silu, const std::optional<at::Tensor>& stats_in) {
  GNShape s = check_group_norm(x_in, num_groups, weight, bias, eps);
  check_group_norm_grad_out(grad_out, x_in);
  if (stats_in.has_value()) check_group_norm_stats(*stats_in, x_in, s);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto fmt = layout_memory_format(x_in);
  // Frames-major x and grad_out (what SVD's temporal blocks pass and get back) are read in place, as
  // rows (n, f, c); dx keeps the op's contiguous layout. Copying both took 0.45 of the 0.86 ms at
  // (2, 320, 14, 72, 128).
  const bool in_place = s.frames_major && frames_major_layout(grad_out);
  at::Tensor x = in_place ? x_in : x_in.contiguous(fmt);
  at::Tensor dy = in_place ? grad_out : grad_out.contiguous(fmt);
  at::Tensor dx = at::empty(x.sizes(), x.options().memory_format(fmt));
  const auto wdtype = weight.has_value() ? weight->scalar_type() : x.scalar_type();
  const auto bdtype = bias.has_value() ? bias->scalar_type() : wdtype;
  if (x.numel() == 0)
    return {dx, at::zeros({s.C}, x.options().dtype(wdtype)), at::zeros({s.C}, x.options().dtype(bdtype))};
  at::Tensor w = group_norm_param(weight, x), b = group_norm_param(bias, x);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor dw, db;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "group_norm_silu_backward_cuda", [&] {
    using L = Launcher<scalar_t>;
    using acc_t = typename L::acc_t;
    auto a = make_args<scalar_t>(s, w, b, silu);
    a.x = x.const_data_ptr<scalar_t>();
    a.dy = dy.const_data_ptr<scalar_t>();
    a.out = dx.mutable_data_ptr<scalar_t>();
    if (in_place) {
      a.F = x.size(2);
      a.S = s.S / a.F;
    }
    // In place, dx's rows move by whole rows of S: vectors need S a multiple of the vector.
    const bool vec = L::can_vectorize(a, s.channels_last, {a.x, a.dy, a.out}) && (!in_place || a.S % L::kVec == 0);
    // The forward's statistics as the float kernels read them (versions 7 and 10 take float input only).
    const float* stats_f = stats_in.has_value() && std::is_same_v<acc_t, float>
                               ? reinterpret_cast<const float*>(stats_in->const_data_ptr<acc_t>())
                               : nullptr;
    if (!in_place && backward_smem<scalar_t>(s, a.x, a.dy, a.out, a.w, a.b, eps, silu, vec, stats_f, x, wdtype,
                                             bdtype, stream, dw, db))
      return;
    if (!in_place && backward_smem_cols<scalar_t>(s, x, dy, a.out, a.w, a.b, eps, silu, vec, stats_f, wdtype, bdtype,
                                                  stream, dw, db))
      return;
    const int64_t NG = s.N * s.G;
    // The forward's statistics where given: version 1 then reads x twice, not three times.
    at::Tensor stats;
    if (stats_in.has_value()) {
      const acc_t* st = stats_in->const_data_ptr<acc_t>();
      a.mean = st;
      a.mean_lo = st + NG;
      a.rstd = st + 2 * NG;
    } else {
      stats = L::stats(a, s.channels_last, vec, eps, x.options(), x.get_device(), stream);
    }

    // Per (n, c) partial sums of dz and dz * xhat, their sums per (n, c) and the group means m1, m2 in one
    // workspace: allocations and launches are most of the host time on the small shapes.
    const int v = !vec ? 1 : s.channels_last ? grad_col_vec<scalar_t>() : L::kVec;
    plan(a, v, a.S, s.channels_last, kVecsPerLane,
         s.channels_last ? grad_col_rows(a, v, x.get_device()) : kRowsPerThread);
    const int64_t n_part = s.N * s.C * a.F * a.P * 2, n_sums = s.N * s.C * 2;
    const ParamGrads<scalar_t, acc_t> pg{wdtype, bdtype};
    at::Tensor ws = at::empty({n_part + n_sums + 2 * NG + pg.scratch(s.C)},
                              x.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    acc_t* wp = ws.mutable_data_ptr<acc_t>();
    auto* pp = reinterpret_cast<Sum2<acc_t>*>(wp);
    auto* sp = reinterpret_cast<Sum2<acc_t>*>(wp + n_part);
    acc_t* m1 = wp + n_part + n_sums;
    acc_t* m2 = m1 + NG;
    const unsigned blocks = grid_of(s.channels_last ? a.items : ceil_div(a.items, kWarps), kOp);
    const bool lean = grad_lean();  // the lean kernels where they apply (with_lean)
    const auto ck = cols_grad_kernels<scalar_t, acc_t>(vec, lean);
    if (!s.channels_last) {
      with_lean<scalar_t, acc_t>(lean, [&](auto ln) {
        constexpr bool LN = decltype(ln)::value;
        if (vec) grad_sums_rows_kernel<scalar_t, acc_t, L::kVec, LN><<<blocks, kThreads, 0, stream>>>(a, pp);
        else grad_sums_rows_kernel<scalar_t, acc_t, 1, LN><<<blocks, kThreads, 0, stream>>>(a, pp);
      });
    } else {
      ck.sums<<<blocks, kThreads, 0, stream>>>(a, pp);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    grad_partials_kernel<acc_t><<<grid_of(ceil_div(s.N * s.C, kWarps), kOp), kThreads, 0, stream>>>(
        pp, s.N * s.C, s.C, a.F, a.P, sp);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const unsigned reduce_blocks = grid_of(ceil_div(NG + s.C, kThreads), kOp);
    pg.run(ws, n_part + n_sums + 2 * NG, s.C, [&](auto* dwp, auto* dbp) {
      using out_t = std::remove_pointer_t<decltype(dwp)>;
      grad_reduce_kernel<scalar_t, acc_t, out_t><<<reduce_blocks, kThreads, 0, stream>>>(a, sp, m1, m2, dwp, dbp);
    }, dw, db);
    a.m1 = m1;
    a.m2 = m2;
    a.reverse = apply_reversed();
    if (!s.channels_last) {
      with_lean<scalar_t, acc_t>(lean, [&](auto ln) {
        constexpr bool LN = decltype(ln)::value;
        if (in_place) {
          if (vec) dx_rows_kernel<scalar_t, acc_t, L::kVec, true, LN><<<blocks, kThreads, 0, stream>>>(a);
          else dx_rows_kernel<scalar_t, acc_t, 1, true, LN><<<blocks, kThreads, 0, stream>>>(a);
        } else {
          if (vec) dx_rows_kernel<scalar_t, acc_t, L::kVec, false, LN><<<blocks, kThreads, 0, stream>>>(a);
          else dx_rows_kernel<scalar_t, acc_t, 1, false, LN><<<blocks, kThreads, 0, stream>>>(a);
        }
      });
    } else {
      ck.dx<<<blocks, kThreads, 0, stream>>>(a);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {dx, dw, db};
}

}  // namespace

TORCH_LIBRARY_IMPL(vd, CUDA, m) {
  m.impl("group_norm_silu", &group_norm_silu_cuda);
  m.impl("group_norm_silu_forward", &group_norm_silu_forward_cuda);
  m.impl("group_norm_silu_backward", &group_norm_silu_backward_cuda);
}

}  // namespace vd
