// CUDA kernels for vd::temporal_conv. On Hopper (sm_90a), fp16 / bf16 and float32 as TF32 (where cuDNN's
// switch allows it): one implicit-GEMM kernel (wgmma + TMA) that reads x in place, contiguous or frames-major,
// and skips the taps that fall in the padding. Elsewhere: the per-tap GEMMs of csrc/conv_gemm.h on cuBLAS, reading (B, C, F, H, W) through
// views. Both use the weight reordered to tap-major rows (a kernel below).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../conv_gemm.h"
#include "../fold_cache.h"
#include "hopper.h"
#include "launch.h"
#include "wgmma.h"

namespace vd {
namespace {

// out[o, t, c] = w[o, c, t]: one CTA per output channel o. Thread c reads its k consecutive elements
// w[o, c, 0..k) (a warp's reads cover one contiguous span; L1 serves the k passes) and writes them
// to the k rows, coalesced across c. No division per element: the first version's j / C made it
// issue-bound (8 us a call on SVD's 1280-channel weights). T carries the element's bits.
template <typename T>
__global__ void tap_rows_kernel(const T* __restrict__ w, T* __restrict__ out, int C, int k) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * C * k;
  const T* src = w + base;
  T* dst = out + base;
  for (int c = threadIdx.x; c < C; c += blockDim.x) {
    for (int t = 0; t < k; ++t) dst[static_cast<int64_t>(t) * C + c] = src[static_cast<int64_t>(c) * k + t];
  }
}

template <typename T>
void launch_tap_rows(const at::Tensor& w, at::Tensor& out, int64_t C_out, int C, int k) {
  tap_rows_kernel<T><<<grid_of(C_out, "temporal_conv"), 128, 0, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<const T*>(w.const_data_ptr()), static_cast<T*>(out.mutable_data_ptr()), C, k);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor tap_rows_cuda(const at::Tensor& weight) {
  const int64_t C_out = weight.size(0), C = weight.size(1), k = weight.size(2);
  // A row per CTA indexes in int; the element is copied as 2, 4 or 8 bytes.
  const int64_t esize = weight.element_size();
  if (C * k > std::numeric_limits<int>::max() || (esize != 2 && esize != 4 && esize != 8))
    return tap_rows_aten(weight);
  c10::cuda::CUDAGuard guard(weight.device());
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({C_out, k, C}, w.options());
  if (out.numel() == 0) return out;
  const int Ci = static_cast<int>(C), ki = static_cast<int>(k);
  if (esize == 2) launch_tap_rows<uint16_t>(w, out, C_out, Ci, ki);
  else if (esize == 4) launch_tap_rows<uint32_t>(w, out, C_out, Ci, ki);
  else launch_tap_rows<uint64_t>(w, out, C_out, Ci, ki);
  return out;
}

namespace {

// ---- Hopper: the whole convolution as one implicit GEMM ----
// For each sample b and output frame f:  out[b, :, f, p] = sum_t W_t (C_out x C_in) @ x[b, :, f + t - pad, p]
// (+ bias). A CTA tile is 128 output channels x 128 pixels of one (b, f); its K loop runs over the taps
// whose input frame exists and 64 input channels at a time. The copy engine loads the weight rows (A,
// K-major: input channels contiguous) and the frame's pixel rows of x (B, MN-major: pixels contiguous,
// one 64-pixel box per 128-byte swizzle atom) straight from x's own strides, so contiguous and
// frames-major x take the same path; boxes past H*W, C_in or C_out read as zeros. Persistent CTAs: one
// producer warp streams the stages across tiles, two consumer warpgroups (64 channels each) run
// wgmma m64n128k16 (m64n64k16 on a last block of <= 64 pixels) and write their tile from registers with
// the bias.
#if defined(VD_SM90A)
struct TcArgs {
  void* out;
  const void* bias;                     // C_out elements in x's dtype, or null
  int64_t out_sb, out_sc, out_sf;       // output strides (elements) of b, channel, frame; pixels stride 1
  // The Winograd kernel reads tiles as its units, full_tiles as its cluster items, and n_cb, n_pb and chunks in
  // its own sizes (160 channels, 64 pixels, 32 input channels): see temporal_conv_tf32_wino_kernel.
  int64_t tiles, full_tiles;            // all tiles; those of 128 pixels (the rest: a last block of <= 64)
  int C_out, HW, F, F_out, k, pad;
  int n_cb, n_pb, chunks;               // channel blocks of 128, pixel blocks of 128, input chunks of 64
  int half_pb;                          // 1 if the last pixel block has at most 64 pixels
  int sched_r;                          // TF32 kernel: the edge-first order's R (tc_edges_tile); 0: natural order
  int edge_lo, edge_hi;                 // output frames at the low / high end with fewer than k taps
};

struct TcTile {
  static constexpr int BM = 128, BN = 128, BK = 64, kStages = 5;
  static constexpr int a_bytes = BM * BK * 2;   // weight rows of a stage
  static constexpr int b_bytes = BK * BN * 2;   // two 64-pixel atoms of 64 channel rows
  // The TMA epilogue's staging: per consumer warpgroup two boxes of 64 pixels x 64 channels.
  static constexpr int box_bytes = 64 * 64 * 2, out_off = kStages * (a_bytes + b_bytes);
  static constexpr int bar_off = out_off + 2 * 2 * box_bytes;
  static constexpr size_t smem_bytes = bar_off + 16 * kStages + 1024;  // + slack to align to 1024
};

// Output frame f's taps [t0, t1): those that read existing frames (the others fall in the padding).
__host__ __device__ inline void tc_taps(const TcArgs& a, int f, int& t0, int& t1) {
  t0 = 0 > a.pad - f ? 0 : a.pad - f;
  t1 = a.k < a.F + a.pad - f ? a.k : a.F + a.pad - f;
}

// A tile: channel block, pixel block, output frame, sample; taps [t0, t1) read existing frames; half:
// the last pixel block of at most 64 pixels (one atom of x, products at N = 64).
struct TcWork {
  int cb, pb, f, b, t0, t1;
  bool half;
};

// Tile w: the 128-pixel tiles first, then those of a last block of <= 64 pixels (576 = 4 x 128 + 64
// pixels at SVD's 18 x 32), so the static round-robin ends on short tiles instead of a half-empty
// round of full ones. Channel block fastest (the CTAs at work share x's rows through L2). kShort: the
// kernel built for such shapes (the other one has no short tiles).
template <bool kShort>
__device__ __forceinline__ TcWork tc_work(const TcArgs& a, int64_t w) {
  TcWork t;
  t.half = kShort && w >= a.full_tiles;
  const int npb = t.half ? 1 : a.n_pb - a.half_pb;
  if (t.half) w -= a.full_tiles;
  t.cb = static_cast<int>(w % a.n_cb);
  int64_t r = w / a.n_cb;
  t.pb = t.half ? a.n_pb - 1 : static_cast<int>(r % npb);
  r /= npb;
  t.f = static_cast<int>(r % a.F_out);
  t.b = static_cast<int>(r / a.F_out);
  tc_taps(a, t.f, t.t0, t.t1);
  return t;
}

// Tile at position p of the TF32 kernel's edge-first order (p = r G + c: CTA c's r-th tile on a grid of G), as
// (cb, pb, f, b). The static round robin hands the first R = tiles % G CTAs one tile more than the others; at
// 1280 channels (672 tiles, 5.1 rounds) some of them drew two three-tap tiles more than the rest, a 16-tap makespan
// against 14.5 on average. Here they draw from a stream A of the cheapest tiles (the frames at either end, fewer
// taps), the others from stream B, the remaining tiles; both streams run through the tiles in order (channel block
// fastest: the CTAs at work still share x's rows through L2). Tiles are ordered with the edge frames' blocks of
// n_cb x n_pb tiles first (per sample: the edge_lo low ones, then the edge_hi high ones), then the inner frames'.
struct TcPos {
  int cb, pb, f, b;
};
// I: 32-bit unsigned in the kernel (the launcher keeps the tile count under 2^31), 64-bit on the host.
template <typename I>
__host__ __device__ inline TcPos tc_edges_tile(const TcArgs& a, I G, I p) {
  const I R = static_cast<I>(a.sched_r), tiles = static_cast<I>(a.tiles), r = p / G, c = p % G;
  const I i = c < R ? r * R + c : (tiles / G + 1) * R + r * (G - R) + (c - R);
  const I Q = static_cast<I>(a.n_cb) * static_cast<I>(a.n_pb), j = i / Q, q = i % Q;
  const I e = static_cast<I>(a.edge_lo + a.edge_hi), nb = tiles / Q / static_cast<I>(a.F_out);  // edge frames; samples
  TcPos t;
  t.cb = static_cast<int>(q % static_cast<I>(a.n_cb));
  t.pb = static_cast<int>(q / static_cast<I>(a.n_cb));
  if (j < e * nb) {
    const int idx = static_cast<int>(j % e);
    t.b = static_cast<int>(j / e);
    t.f = idx < a.edge_lo ? idx : a.F_out - a.edge_hi + (idx - a.edge_lo);
  } else {
    const I jj = j - e * nb, inner = static_cast<I>(a.F_out) - e;
    t.b = static_cast<int>(jj / inner);
    t.f = a.edge_lo + static_cast<int>(jj % inner);
  }
  return t;
}

// The TF32 kernel's tile at position w (sched_r = edge_lo = edge_hi = 0: tc_work's order).
__device__ __forceinline__ TcWork tc_tf32_work(const TcArgs& a, int64_t w) {
  const TcPos p = tc_edges_tile<uint32_t>(a, gridDim.x, static_cast<uint32_t>(w));
  TcWork t;
  t.cb = p.cb;
  t.pb = p.pb;
  t.f = p.f;
  t.b = p.b;
  t.half = false;
  tc_taps(a, t.f, t.t0, t.t1);
  return t;
}

// The TMA epilogue: the warpgroup stages its 64 channels x NP pixels, bias added and rounded, in its own
// shared-memory buffer as the output map's boxes (64 pixels x 64 channels, 128-byte swizzle), and one
// thread hands them to the copy engine; the warpgroup goes on to its next tile's products while they are
// written (the register epilogue kept the tensor cores idle for the whole store). The buffer is refilled
// only after the copy engine has read the previous tile's boxes. Boxes past C_out or H * W are clipped.
template <typename scalar_t, int NP>
__device__ __forceinline__ void tc_store_tma(const TcArgs& a, const TcWork& t, const float* acc, uint32_t sOut,
                                             const CUtensorMap* to, int cw, int warp, int lane) {
  const int g = lane >> 2, tig = lane & 3;
  const bool leader = warp == 0 && lane == 0;
  if (leader) wgmma::bulk_wait_read();
  wgmma::named_sync(1 + cw, 128);
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int r = warp * 16 + g + 8 * rr;  // the warpgroup's channel row; r % 8 == g
    const int co = t.cb * TcTile::BM + cw * 64 + r;
    const float bv = a.bias != nullptr && co < a.C_out
                         ? static_cast<float>(static_cast<const scalar_t*>(a.bias)[co]) : 0.f;
#pragma unroll
    for (int j = 0; j < NP / 8; ++j) {
      const uint32_t v = pack_pair<scalar_t>(acc[4 * j + 2 * rr] + bv, acc[4 * j + 2 * rr + 1] + bv);
      const uint32_t addr = sOut + (j / 8) * TcTile::box_bytes + r * 128 + (((j % 8) ^ g) << 4) + 4 * tig;
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
    }
  }
  wgmma::fence_proxy_async();  // the generic-proxy writes above, before the copy engine reads them
  wgmma::named_sync(1 + cw, 128);
  if (leader) {
#pragma unroll
    for (int box = 0; box < NP / 64; ++box)
      wgmma::tma_store_4d(to, sOut + box * TcTile::box_bytes, t.pb * TcTile::BN + 64 * box,
                          t.cb * TcTile::BM + cw * 64, t.f, t.b);
    wgmma::bulk_commit();
  }
}

// One consumer warpgroup's part of a tile of at most 64 pixels (64 channels x 64 pixels at N = 64): the
// K loop over the ready stages (u counts them across tiles, as the producer does), then the bias and the
// store from registers. The 128-pixel tiles keep the same steps inline in the kernel: as one function
// for both, the kernel's registers grew from 96 to 168 with spills, and the 320- and 640-channel shapes
// (no short tiles) ran 4-10 % slower.
template <typename scalar_t, bool kTma>
__device__ __forceinline__ void tc_half_tile(const TcArgs& a, const TcWork& t, uint32_t& u, uint32_t sA,
                                             uint32_t sB, uint32_t bar, uint32_t sOut, const CUtensorMap* to,
                                             int cw, int warp, int lane) {
  using T = TcTile;
  constexpr int S = T::kStages, NP = 64, NACC = NP / 2;
  constexpr bool kBf16 = std::is_same_v<scalar_t, at::BFloat16>;
  auto full = [&](int st) { return bar + 8 * st; };
  auto empty = [&](int st) { return bar + 8 * (S + st); };
  const int g = lane >> 2, tig = lane & 3;
  const int steps = max(0, t.t1 - t.t0) * a.chunks;
  const bool active = t.cb * T::BM + cw * 64 < a.C_out;  // this warpgroup's channels exist
  float acc[NACC];  // the first product overwrites it (scale-d 0); zeroed below if there is none
  int prev = -1;    // the stage whose products may still be reading shared memory
  for (int s = 0; s < steps; ++s, ++u) {
    const int st = static_cast<int>(u % S);
    wgmma::mbar_wait(full(st), (u / S) & 1);
    if (active) {
      // K steps of 16 channels: +32 bytes in the weight's 128-byte rows, +16 rows (2048 bytes) of x's.
      const uint64_t da = wgmma::desc_sw128(sA + st * T::a_bytes + cw * 64 * 128, 16, 1024);
      const uint64_t db = wgmma::desc_sw128(sB + st * T::b_bytes, T::b_bytes / 2, 1024);
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < T::BK / 16; ++kk)
        wgmma::mma_m64n64k16_ss_kmn<kBf16>(acc, da + ((kk * 32) >> 4), db + ((kk * 2048) >> 4), s > 0 || kk > 0);
      wgmma::commit();
      wgmma::wait<1>();  // the previous stage's products are done: hand it back
    }
    if (prev >= 0 && lane == 0) wgmma::mbar_arrive(empty(prev));
    prev = st;
  }
  wgmma::wait<0>();
  wgmma::fence_regs(acc);
  if (steps == 0) {  // every tap in the padding: the bias alone
#pragma unroll
    for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  }
  if (prev >= 0 && lane == 0) wgmma::mbar_arrive(empty(prev));
  if (!active) return;
  if constexpr (kTma) {
    tc_store_tma<scalar_t, NP>(a, t, acc, sOut, to, cw, warp, lane);
    return;
  }

  // Row g (+ 8) of the warp's 16 channels, columns 8 j + 2 tig (+ 1): pairs of adjacent pixels.
  scalar_t* out = static_cast<scalar_t*>(a.out);
  const int64_t obase = t.b * a.out_sb + t.f * a.out_sf;
  const int p0 = t.pb * T::BN + 2 * tig;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int co = t.cb * T::BM + cw * 64 + warp * 16 + g + 8 * rr;
    if (co >= a.C_out) continue;
    const float bv = a.bias != nullptr ? static_cast<float>(static_cast<const scalar_t*>(a.bias)[co]) : 0.f;
    scalar_t* row = out + obase + co * a.out_sc;
#pragma unroll
    for (int j = 0; j < NP / 8; ++j) {
      const int p = p0 + 8 * j;
      if (p >= a.HW) continue;  // HW is even: the pair is whole
      const float x0 = acc[4 * j + 2 * rr] + bv, x1 = acc[4 * j + 2 * rr + 1] + bv;
      if constexpr (kBf16)
        *reinterpret_cast<__nv_bfloat162*>(row + p) = __floats2bfloat162_rn(x0, x1);
      else
        *reinterpret_cast<__half2*>(row + p) = __floats2half2_rn(x0, x1);
    }
  }
}

// kShort: H * W ends in a block of at most 64 pixels (a separate build: the short-tile branch raises the
// kernel's registers from 96 to 162, and the shapes without short tiles keep the build without it).
// kTma: the TMA epilogue (tc_store_tma); without it each thread stores its pairs from registers.
template <typename scalar_t, bool kShort, bool kTma>
__global__ void __launch_bounds__(384, 1)
    temporal_conv_wgmma_kernel(const TcArgs a, const __grid_constant__ CUtensorMap tw,
                               const __grid_constant__ CUtensorMap tx, const __grid_constant__ CUtensorMap to) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = TcTile;
  constexpr int S = T::kStages;
  extern __shared__ __align__(16) unsigned char tc_smem[];
  const uint32_t sA = (static_cast<uint32_t>(__cvta_generic_to_shared(tc_smem)) + 1023u) & ~1023u;
  const uint32_t sB = sA + S * T::a_bytes, bar = sA + T::bar_off;
  // This consumer warpgroup's staging buffer for the TMA epilogue (two boxes).
  const uint32_t sOut = sA + T::out_off + (threadIdx.x / 128 == 2 ? 2 * T::box_bytes : 0);
  auto full = [&](int st) { return bar + 8 * st; };
  auto empty = [&](int st) { return bar + 8 * (S + st); };
  const int tid = threadIdx.x, wg = tid / 128;
  if (tid == 0) wgmma::init_stage_ring(bar, S, 8);  // empty: one arrival per consumer warp
  __syncthreads();

  if (wg == 0) {
    if (tid == 0) {
      uint32_t u = 0;  // stages filled so far (runs on across tiles)
      for (int64_t w = blockIdx.x; w < a.tiles; w += gridDim.x) {
        const TcWork t = tc_work<kShort>(a, w);
        const uint32_t bytes = T::a_bytes + (t.half ? T::b_bytes / 2 : T::b_bytes);
        for (int tap = t.t0; tap < t.t1; ++tap) {
          const int fi = t.f + tap - a.pad;
          for (int c = 0; c < a.chunks; ++c, ++u) {
            const int st = static_cast<int>(u % S);
            wgmma::mbar_wait(empty(st), ((u / S) & 1) ^ 1u);
            wgmma::mbar_expect_tx(full(st), bytes);
            wgmma::tma_load_4d(sA + st * T::a_bytes, &tw, full(st), c * T::BK, tap, t.cb * T::BM, 0);
            const uint32_t dst = sB + st * T::b_bytes;
            wgmma::tma_load_4d(dst, &tx, full(st), t.pb * T::BN, c * T::BK, fi, t.b);
            if (!t.half) wgmma::tma_load_4d(dst + T::b_bytes / 2, &tx, full(st), t.pb * T::BN + 64, c * T::BK, fi, t.b);
          }
        }
      }
    }
    return;
  }

  // The consumer warpgroup's index through a shuffle, so the compiler sees it uniform: a branch on it
  // around wgmma would otherwise serialize the products (ptxas C7518).
  const int cw = __shfl_sync(kFullMask, wg - 1, 0), warp = (tid / 32) % 4, lane = tid % 32;
  const int g = lane >> 2, tig = lane & 3;
  constexpr bool kBf16 = std::is_same_v<scalar_t, at::BFloat16>;
  scalar_t* out = static_cast<scalar_t*>(a.out);
  uint32_t u = 0;
  for (int64_t w = blockIdx.x; w < a.tiles; w += gridDim.x) {
    const TcWork t = tc_work<kShort>(a, w);
    if constexpr (kShort) {
      if (t.half) {  // a last block of <= 64 pixels
        tc_half_tile<scalar_t, kTma>(a, t, u, sA, sB, bar, sOut, &to, cw, warp, lane);
        continue;
      }
    }
    const int steps = max(0, t.t1 - t.t0) * a.chunks;
    const bool active = t.cb * T::BM + cw * 64 < a.C_out;  // this warpgroup's channels exist
    float acc[64];  // the first product overwrites it (scale-d 0); zeroed below if there is none
    int prev = -1;  // the stage whose products may still be reading shared memory
    for (int s = 0; s < steps; ++s, ++u) {
      const int st = static_cast<int>(u % S);
      wgmma::mbar_wait(full(st), (u / S) & 1);
      if (active) {
        // K steps of 16 channels: +32 bytes in the weight's 128-byte rows, +16 rows (2048 bytes) of x's.
        const uint64_t da = wgmma::desc_sw128(sA + st * T::a_bytes + cw * 64 * 128, 16, 1024);
        const uint64_t db = wgmma::desc_sw128(sB + st * T::b_bytes, T::b_bytes / 2, 1024);
        wgmma::fence();
#pragma unroll
        for (int kk = 0; kk < T::BK / 16; ++kk)
          wgmma::mma_m64n128k16_ss_kmn<kBf16>(acc, da + ((kk * 32) >> 4), db + ((kk * 2048) >> 4), s > 0 || kk > 0);
        wgmma::commit();
        wgmma::wait<1>();  // the previous stage's products are done: hand it back
      }
      if (prev >= 0 && lane == 0) wgmma::mbar_arrive(empty(prev));
      prev = st;
    }
    wgmma::wait<0>();
    wgmma::fence_regs(acc);
    if (steps == 0) {  // every tap in the padding: the bias alone
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.f;
    }
    if (prev >= 0 && lane == 0) wgmma::mbar_arrive(empty(prev));
    if (!active) continue;
    if constexpr (kTma) {
      tc_store_tma<scalar_t, T::BN>(a, t, acc, sOut, &to, cw, warp, lane);
      continue;
    }

    // Row g (+ 8) of the warp's 16 channels, columns 8 j + 2 tig (+ 1): pairs of adjacent pixels.
    const int64_t obase = t.b * a.out_sb + t.f * a.out_sf;
    const int p0 = t.pb * T::BN + 2 * tig;
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const int co = t.cb * T::BM + cw * 64 + warp * 16 + g + 8 * rr;
      if (co >= a.C_out) continue;
      const float bv = a.bias != nullptr ? static_cast<float>(static_cast<const scalar_t*>(a.bias)[co]) : 0.f;
      scalar_t* row = out + obase + co * a.out_sc;
#pragma unroll
      for (int j = 0; j < T::BN / 8; ++j) {
        const int p = p0 + 8 * j;
        if (p >= a.HW) continue;  // HW is even: the pair is whole
        const float x0 = acc[4 * j + 2 * rr] + bv, x1 = acc[4 * j + 2 * rr + 1] + bv;
        if constexpr (kBf16)
          *reinterpret_cast<__nv_bfloat162*>(row + p) = __floats2bfloat162_rn(x0, x1);
        else
          *reinterpret_cast<__half2*>(row + p) = __floats2half2_rn(x0, x1);
      }
    }
  }
  // The copy engine must have finished with the staging buffers before the CTA's shared memory goes.
  if (kTma && tid % 128 == 0) wgmma::bulk_wait();
#endif
}

// ---- Hopper, float32 with cuDNN's TF32 switch on (as the Conv3d it replaces): the same implicit GEMM on TF32 ----
// TF32 products read shared-memory operands K-major only, and x's frame rows are pixel-contiguous (MN-major), so
// the roles swap: A = x^T, 64 pixels a consumer warpgroup by 8 channels a step, loaded from the staged boxes into
// registers; B = the weight rows (K-major, as the copy engine lands them). A tile is 192 pixels (64 a consumer
// warpgroup, three of them) x BN = 160 (or 128: temporal_conv_tf32) output channels of one (b, f): float32 doubles
// the bytes a product reads, and 128 x 128 tiles (two warpgroups) were bound by L2 (ncu: 67 % of its throughput,
// the tensor cores ~60 % busy); 192 x 160 reads 28 % fewer bytes a product, and divides the UNet's pixel counts
// (576, 2304, 9216) and channel counts (320, 640, 1280) whole. The producer warpgroup hands registers to the
// consumers (setmaxnreg), though ptxas still allocates the consumers' code within 128 (the launch's 512 threads).
// Logical column tig of an A fragment is channel 2 tig of the step's 8 (tig + 4: 2 tig + 1), so a warp's four rows
// differ in their swizzle bits and its loads hit 32 banks (in natural order two rows share them: 2-way
// conflicts); the cached weight copy holds its channels in that order within each 8 (cached_tap_rows'
// kTf32Rows). A warpgroup whose 64 pixels lie past H * W skips its products.
template <int BN_>
struct TcTf32Tile {
  static constexpr int WG = 3, threads = 128 * (WG + 1);
  // 56 * 128 + 144 * 128 * WG <= 65536 (a cap); at 24 the producer's loop spilled 16 bytes (ptxas -v).
  static constexpr int regs_producer = 56, regs_consumer = 144;
  static constexpr int BM = 64 * WG, BN = BN_, BK = 32, kStages = 5;  // pixels, channels, input channels a stage
  static constexpr int x_bytes = BK * BM * 4;                      // BM / 32 boxes of 32 pixels x 32 channels
  static constexpr int w_bytes = BN * BK * 4;                      // BN weight rows of 32 channels
  static constexpr int bar_off = kStages * (x_bytes + w_bytes);
  static constexpr size_t smem_bytes = bar_off + 16 * kStages + 1024;  // + slack to align to 1024
};

template <int BN>
__global__ void __launch_bounds__(TcTf32Tile<BN>::threads, 1)
    temporal_conv_tf32_kernel(const TcArgs a, const __grid_constant__ CUtensorMap tw,
                              const __grid_constant__ CUtensorMap tx) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = TcTf32Tile<BN>;
  constexpr int S = T::kStages;
  extern __shared__ __align__(16) unsigned char tc_smem[];
  const uint32_t sX = (static_cast<uint32_t>(__cvta_generic_to_shared(tc_smem)) + 1023u) & ~1023u;
  const uint32_t sW = sX + S * T::x_bytes, bar = sX + T::bar_off;
  auto full = [&](int st) { return bar + 8 * st; };
  auto empty = [&](int st) { return bar + 8 * (S + st); };
  const int tid = threadIdx.x, wg = tid / 128;
  if (tid == 0) wgmma::init_stage_ring(bar, S, 4 * T::WG);  // empty: one arrival per consumer warp
  __syncthreads();

  if (wg == 0) {
    wgmma::setmaxnreg_dec<T::regs_producer>();
    if (tid == 0) {
      uint32_t u = 0;  // stages filled so far (runs on across tiles)
      for (int64_t w = blockIdx.x; w < a.tiles; w += gridDim.x) {
        const TcWork t = tc_tf32_work(a, w);
        for (int tap = t.t0; tap < t.t1; ++tap) {
          const int fi = t.f + tap - a.pad;
          for (int c = 0; c < a.chunks; ++c, ++u) {
            const int st = static_cast<int>(u % S);
            wgmma::mbar_wait(empty(st), ((u / S) & 1) ^ 1u);
            wgmma::mbar_expect_tx(full(st), T::x_bytes + T::w_bytes);
            wgmma::tma_load_4d(sW + st * T::w_bytes, &tw, full(st), c * T::BK, tap, t.cb * T::BN, 0);
#pragma unroll
            for (int i = 0; i < T::BM / 32; ++i)
              wgmma::tma_load_4d(sX + st * T::x_bytes + i * 4096, &tx, full(st), t.pb * T::BM + 32 * i, c * T::BK,
                                 fi, t.b);
          }
        }
      }
    }
    return;
  }
  wgmma::setmaxnreg_inc<T::regs_consumer>();

  // The consumer warpgroup's index through a shuffle, so the compiler sees it uniform (ptxas C7518).
  const int cw = __shfl_sync(kFullMask, wg - 1, 0), warp = (tid / 32) % 4, lane = tid % 32;
  const int g = lane >> 2, tig = lane & 3;
  // A rows g and g + 8 of a warp's 16 are its pixels 2 g and 2 g + 1: a thread's two pixels of a channel are
  // adjacent, one 8-byte load a channel, and its accumulators one 8-byte store (rows g, g + 8 as pixels g, g + 8
  // took twice the loads and 4-byte stores: 2.4-4.5 % slower). Byte offsets in a stage's x boxes of this thread's
  // A elements: rows (channels) 2 tig and 2 tig + 1 of each step of 8, pixels p, p + 1 (p = the warp's first + 2 g);
  // box p / 32, 128-byte swizzle (16-byte chunk index XOR row % 8). off[r]: row 2 tig + r; a step kk adds 8 rows
  // (1024 bytes). A half warp's 8-byte loads hit all 32 banks: its g span two chunks, which the four tig's rows
  // (0, 2, 4, 6 or 1, 3, 5, 7) swizzle apart.
  const int wp = cw * 64 + warp * 16 + 2 * g;  // this thread's first pixel in a tile
  uint32_t off[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = 2 * tig + r;
    off[r] = (wp >> 5) * 4096 + row * 128 + ((((wp & 31) >> 2) ^ row) << 4) + (wp & 3) * 4;
  }
  float* out = static_cast<float*>(a.out);
  uint32_t u = 0;
  for (int64_t w = blockIdx.x; w < a.tiles; w += gridDim.x) {
    const TcWork t = tc_tf32_work(a, w);
    const int steps = max(0, t.t1 - t.t0) * a.chunks;
    const bool active = t.pb * T::BM + cw * 64 < a.HW;  // this warpgroup's pixels exist
    float acc[T::BN / 2];  // the first product overwrites it (scale-d 0); zeroed below if there is none
    unsigned af[2][T::BK / 8][4];  // A fragments of two stages: a stage's are read until its products finish
    int prev = -1;  // the stage whose products may still be reading shared memory
    // One stage into fragment buffer B (a constant: the loop below runs two stages an iteration).
    auto stage = [&](int s, auto buf) {
      constexpr int B = decltype(buf)::value;
      const int st = static_cast<int>(u % S);
      wgmma::mbar_wait(full(st), (u / S) & 1);
      if (active) {
        const uint32_t xs = sX + st * T::x_bytes;
#pragma unroll
        for (int kk = 0; kk < T::BK / 8; ++kk) {
          const uint32_t base = xs + kk * 1024;
          asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n"
                       : "=r"(af[B][kk][0]), "=r"(af[B][kk][1]) : "r"(base + off[0]));
          asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n"
                       : "=r"(af[B][kk][2]), "=r"(af[B][kk][3]) : "r"(base + off[1]));
        }
        // K steps of 8 channels: +32 bytes in the weight's 128-byte rows.
        const uint64_t db = wgmma::desc_sw128(sW + st * T::w_bytes, 16, 1024);
        wgmma::fence();  // the fragments' registers (and the accumulators) before the products read them
#pragma unroll
        for (int kk = 0; kk < T::BK / 8; ++kk)
          if constexpr (BN == 160) wgmma::mma_m64n160k8_tf32_rs(acc, af[B][kk], db + ((kk * 32) >> 4), s > 0 || kk > 0);
          else wgmma::mma_m64n128k8_tf32_rs(acc, af[B][kk], db + ((kk * 32) >> 4), s > 0 || kk > 0);
        wgmma::commit();
        wgmma::wait<1>();  // the previous stage's products are done: its buffer and stage are free
      }
      if (prev >= 0 && lane == 0) wgmma::mbar_arrive(empty(prev));
      prev = st;
      ++u;
    };
    for (int s = 0; s < steps; s += 2) {
      stage(s, std::integral_constant<int, 0>{});
      if (s + 1 < steps) stage(s + 1, std::integral_constant<int, 1>{});
    }
    wgmma::wait<0>();
    wgmma::fence_regs(acc);
    if (steps == 0) {  // every tap in the padding: the bias alone
#pragma unroll
      for (int i = 0; i < T::BN / 2; ++i) acc[i] = 0.f;
    }
    if (prev >= 0 && lane == 0) wgmma::mbar_arrive(empty(prev));
    if (!active) continue;  // an idle warpgroup stores nothing

    // acc[4 j + 2 rr + e]: pixel p + rr, channel 8 j + 2 tig + e of the tile's BN. A warp's store covers 16
    // consecutive pixels (64 bytes) of 4 channels.
    const int64_t obase = t.b * a.out_sb + t.f * a.out_sf;
    const int p = t.pb * T::BM + wp;
    if (p >= a.HW) continue;  // H * W is a multiple of 8: the pair is whole
    const float* bias = static_cast<const float*>(a.bias);
#pragma unroll
    for (int j = 0; j < T::BN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int co = t.cb * T::BN + 8 * j + 2 * tig + e;
        if (co >= a.C_out) continue;
        const float bv = bias != nullptr ? bias[co] : 0.f;
        *reinterpret_cast<float2*>(out + obase + co * a.out_sc + p) =
            make_float2(acc[4 * j + e] + bv, acc[4 * j + 2 + e] + bv);
      }
    }
  }
#endif
}

// ---- Hopper, float32 (TF32), k = 3 and padding 1: Winograd F(2, 3) along the frames ----
// Two output frames y0 = y[2q], y1 = y[2q + 1] from the four input frames d0..d3 = x[2q - 1 .. 2q + 2] (zeros
// outside x) in four products instead of six: with the cached weight rows
//   G1 = w0, G2 = (w0 + w1 + w2) / 2, G3 = (w0 - w1 + w2) / 2, G4 = w2 (each C_out x C_in),
//   m1 = G1 (d0 - d2), m2 = G2 (d1 + d2), m3 = G3 (d2 - d1), m4 = G4 (d1 - d3),
//   y0 = m1 + m2 + m3, y1 = m2 - m3 - m4.
// At SVD's 14 frames, 40 direct products of a frame's worth become 28. The sums of frames are formed in registers,
// where x's fragments land anyway (TF32 products take x from registers, see temporal_conv_tf32_kernel). m2 feeds
// both outputs, so a unit keeps two accumulators and runs its K loop twice: pass A adds m2 into acc0 and m3 into
// acc1, then (acc0, acc1) = (acc0 + acc1, acc0 - acc1); pass B adds m1 into acc0 and -m4 into acc1. A stage of
// pass A holds 32 input channels of d1 and d2 with the rows of G2 and G3; one of pass B 16 channels of d0..d3 with
// the rows of G1 and G4 (one 128-byte row: 16 channels of each). Frames past either end are boxes outside x: the
// copy engine fills them with zeros. Non-finite x: an infinity can come out as NaN (the frames' sums and
// differences and the butterfly below meet +inf and -inf) where a direct convolution gives an infinity.
// A unit is 64 pixels x 160 output channels x 2 frames, one per consumer warpgroup, so both accumulators are
// m64n160 (80 registers each): products as large as the direct kernel's (an earlier version with 80-channel
// accumulators in 128 registers ran its tensor pipe at 41 %, latency-bound). 2 x 80 accumulators and the fragments
// need ~220 registers: the producer warpgroup hands its registers to the two consumer warpgroups (setmaxnreg, 56
// and 224 of the launch's 168 a thread; ptxas compiles each side to its count). The two warpgroups take two units
// of the same 160 channels and share the weight stages; in clusters of CM CTAs on the same channels, each CTA loads
// 1 / CM of a stage's weight rows into all of them (multicast: L2 traffic a product halved at CM = 2, measured
// slower; see temporal_conv_wino).
// x's boxes are read into registers at once, so their ring slots go back right after the loads; the weight rows
// stay in use until the products finish and have their own ring.
struct TcWinoTile {
  static constexpr int WG = 2, threads = 128 * (WG + 1);  // two consumer warpgroups, then the producer's
  // 56 * 128 + 224 * 128 * WG <= 168 * threads, what the launch allocates (the producer spilled at 40 or 24)
  static constexpr int regs_producer = 56, regs_consumer = 224;
  static constexpr int BN = 160;                          // output channels
  static constexpr int XS = 3, WS = 3;                    // x ring slots, weight ring slots
  // x per unit and stage: two 32-pixel columns of 8 KB, each one box: pass A (32 pixels, 32 channels, frames d1,
  // d2), pass B (32 pixels, 16 channels, frames d0..d3); rows of 128 bytes, frame-major, then channel.
  static constexpr int col_bytes = 8192, unit_bytes = 2 * col_bytes, x_bytes = WG * unit_bytes;
  static constexpr int mat_bytes = BN * 128;  // BN weight rows of 32 floats
  static constexpr int w_bytes = 2 * mat_bytes;
  static constexpr int bar_off = XS * x_bytes + WS * w_bytes;
  static constexpr size_t smem_bytes = bar_off + 16 * (XS + WS) + 1024;  // + slack to align to 1024
};

// Unit m of the Winograd kernel (pixel block of 64 fastest, then frame pair, then sample); a.tiles counts the
// units, a.full_tiles the (channel block, pair of units) items, a.n_pb the pixel blocks.
struct TcWinoUnit {
  int pb, q, b;
  bool on;
};
__device__ __forceinline__ TcWinoUnit tc_wino_unit(const TcArgs& a, int64_t m) {
  TcWinoUnit t;
  t.on = m < a.tiles;
  t.pb = static_cast<int>(m % a.n_pb);
  int64_t r = m / a.n_pb;
  const int Q = (a.F + 1) / 2;
  t.q = static_cast<int>(r % Q);
  t.b = static_cast<int>(r / Q);
  return t;
}

// The weight rows (cached_tap_rows' kWinoRows): (C_out, 4 C32) floats, C32 = 32 * ceil(C_in / 32); columns [0, C32)
// G2, [C32, 2 C32) G3, then per 16 input channels j: 16 of G1, 16 of G4 (2 C32 columns). Zero-padded past C_in.
// Pass A: a.chunks stages of 32 channels (tx2); pass B: 2 a.chunks stages of 16 (tx4). Items: cluster item i is
// channel block i % n_cb (the clusters at work at once share x's rows through L2) and unit pairs
// CM (i / n_cb) + rank; tw's box is BN / CM weight rows.
template <int CM>
__global__ void __launch_bounds__(TcWinoTile::threads, 1)
    temporal_conv_tf32_wino_kernel(const TcArgs a, const __grid_constant__ CUtensorMap tw,
                                   const __grid_constant__ CUtensorMap tx2, const __grid_constant__ CUtensorMap tx4) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = TcWinoTile;
  constexpr int XS = T::XS, WS = T::WS, RB = T::BN / CM;  // RB: weight rows this CTA loads a matrix
  extern __shared__ __align__(16) unsigned char tc_smem[];
  const uint32_t sX = (static_cast<uint32_t>(__cvta_generic_to_shared(tc_smem)) + 1023u) & ~1023u;
  const uint32_t sW = sX + XS * T::x_bytes, bar = sX + T::bar_off;
  auto full_x = [&](int i) { return bar + 8 * i; };
  auto empty_x = [&](int i) { return bar + 8 * (XS + i); };
  auto full_w = [&](int i) { return bar + 8 * (2 * XS + i); };
  auto empty_w = [&](int i) { return bar + 8 * (2 * XS + WS + i); };
  const int tid = threadIdx.x, wg = tid / 128, rank = CM > 1 ? static_cast<int>(blockIdx.x % CM) : 0;
  const int64_t G = gridDim.x / CM, g = blockIdx.x / CM;
  if (tid == 0) {
    // empty_w: one arrival per consumer warp of every CTA whose copies write the slot (the cluster's)
    for (int i = 0; i < XS; ++i) wgmma::mbar_init(full_x(i), 1), wgmma::mbar_init(empty_x(i), 4 * T::WG);
    for (int i = 0; i < WS; ++i) wgmma::mbar_init(full_w(i), 1), wgmma::mbar_init(empty_w(i), 4 * T::WG * CM);
    wgmma::mbar_init_fence();
  }
  if constexpr (CM > 1) {
    wgmma::cluster_arrive();  // every CTA's barriers initialized before any copy or arrival targets them
    wgmma::cluster_wait();
  } else {
    __syncthreads();
  }
  const int stages = 3 * a.chunks, c32 = 32 * a.chunks;
  const int64_t items = a.full_tiles;  // cluster items

  if (wg == T::WG) {  // the producer warpgroup: one thread issues the copies
    wgmma::setmaxnreg_dec<T::regs_producer>();
    if (tid == 128 * T::WG) {
      uint32_t u = 0;  // stages filled so far (runs on across items)
      for (int64_t i = g; i < items; i += G) {
        const int cb = static_cast<int>(i % a.n_cb);
        const int64_t pair = (i / a.n_cb) * CM + rank;
        const TcWinoUnit t0 = tc_wino_unit(a, 2 * pair), t1 = tc_wino_unit(a, 2 * pair + 1);
        const uint32_t xbytes = (t0.on ? T::unit_bytes : 0) + (t1.on ? T::unit_bytes : 0);
        for (int s = 0; s < stages; ++s, ++u) {
          const bool pass_a = s < a.chunks;
          const int xs = static_cast<int>(u % XS), ws = static_cast<int>(u % WS);
          wgmma::mbar_wait(empty_x(xs), ((u / XS) & 1) ^ 1u);
          if (xbytes > 0) {
            wgmma::mbar_expect_tx(full_x(xs), xbytes);
            const CUtensorMap* map = pass_a ? &tx2 : &tx4;
            const int ch = pass_a ? 32 * s : 16 * (s - a.chunks);
#pragma unroll
            for (int v = 0; v < T::WG; ++v) {
              const TcWinoUnit& t = v == 0 ? t0 : t1;
              if (!t.on) continue;
              const int fr = 2 * t.q + (pass_a ? 0 : -1);
#pragma unroll
              for (int col = 0; col < 2; ++col)
                wgmma::tma_load_4d(sX + xs * T::x_bytes + v * T::unit_bytes + col * T::col_bytes, map, full_x(xs),
                                   t.pb * 64 + 32 * col, ch, fr, t.b);
            }
          } else {
            wgmma::mbar_arrive(full_x(xs));  // no unit: the phase completes with no copies
          }
          wgmma::mbar_wait(empty_w(ws), ((u / WS) & 1) ^ 1u);
          const uint32_t wdst = sW + ws * T::w_bytes + rank * RB * 128;
          const int row0 = cb * T::BN + rank * RB;
          auto load_w = [&](uint32_t dst, int col) {
            constexpr uint16_t kAll = (1u << CM) - 1;  // every CTA of the cluster
            if constexpr (CM > 1)
              wgmma::tma_load_4d_multicast(dst, &tw, full_w(ws), col, 0, row0, 0, kAll);
            else
              wgmma::tma_load_4d(dst, &tw, full_w(ws), col, 0, row0, 0);
          };
          if (pass_a) {
            wgmma::mbar_expect_tx(full_w(ws), 2 * T::mat_bytes);
            load_w(wdst, 32 * s);
            load_w(wdst + T::mat_bytes, c32 + 32 * s);
          } else {
            wgmma::mbar_expect_tx(full_w(ws), T::mat_bytes);
            load_w(wdst, 2 * c32 + 32 * (s - a.chunks));
          }
        }
      }
    }
    if constexpr (CM > 1) {  // no CTA leaves while the cluster's copies and arrivals may still target its memory
      wgmma::cluster_arrive();
      wgmma::cluster_wait();
    }
    return;
  }

  wgmma::setmaxnreg_inc<T::regs_consumer>();

  // As temporal_conv_tf32_kernel: the consumer warpgroup's index made uniform; a thread's A rows are the pixels
  // 2 g8 and 2 g8 + 1 of its warp's 16; off[r]: the byte offset of channel row 2 tig + r of its 32-pixel column
  // (a K step of 8 channels is one 1024-byte swizzle atom).
  const int cw = __shfl_sync(kFullMask, wg, 0), warp = (tid / 32) % 4, lane = tid % 32;
  const int g8 = lane >> 2, tig = lane & 3;
  const int wp = warp * 16 + 2 * g8;
  uint32_t off[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = 2 * tig + r;
    off[r] = cw * T::unit_bytes + (wp >> 5) * T::col_bytes + row * 128 + ((((wp & 31) >> 2) ^ row) << 4) + (wp & 3) * 4;
  }
  // A weight slot goes back to every CTA whose copies write it: lane r of each consumer warp tells rank r.
  auto release_w = [&](int ws) {
    if constexpr (CM > 1) {
      if (lane < CM) wgmma::mbar_arrive_cluster(wgmma::cluster_map(empty_w(ws), lane));
    } else if (lane == 0) {
      wgmma::mbar_arrive(empty_w(ws));
    }
  };
  auto ld2 = [](unsigned (&v)[4], uint32_t addr0, uint32_t addr1) {
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(v[0]), "=r"(v[1]) : "r"(addr0));
    asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(v[2]), "=r"(v[3]) : "r"(addr1));
  };
  float* out = static_cast<float*>(a.out);
  uint32_t u = 0;
  for (int64_t i = g; i < items; i += G) {
    const int cb = static_cast<int>(i % a.n_cb);
    const TcWinoUnit t = tc_wino_unit(a, 2 * ((i / a.n_cb) * CM + rank) + cw);
    float acc0[T::BN / 2], acc1[T::BN / 2];  // pass A's first products overwrite them (scale-d 0)
    // Fragments of two K steps (8 channels each): [step & 1][accumulator][4]; a buffer is refilled once the
    // products of the step before the last (wait<1>) are done.
    unsigned af[2][2][4];
    int prev_w = -1;  // the weight slot whose products may still be reading it
    // One stage's K steps (4 in pass A, 2 in pass B) into both accumulators.
    auto steps = [&](auto pass_b, int s, uint32_t xb, uint32_t wb) {
      constexpr bool kB = decltype(pass_b)::value;
      const uint64_t db0 = wgmma::desc_sw128(wb, 16, 1024);
      // pass A: G3's rows in the slot's second block; pass B: G4's 16 channels 64 bytes into each row
      const uint64_t db1 = kB ? db0 + (64 >> 4) : wgmma::desc_sw128(wb + T::mat_bytes, 16, 1024);
      const int scale = kB || s > 0 ? 1 : 0;
#pragma unroll
      for (int kk = 0; kk < (kB ? 2 : 4); ++kk) {
        const int B = kk & 1;
        wgmma::wait<1>();  // the products that read buffer B (two steps back) are done
        if (kk == 1 && prev_w >= 0) {  // and with them the previous stage's last: its weight slot goes back
          release_w(prev_w);
          prev_w = -1;
        }
        // frame f's 8-channel rows of K step kk: pass A frames d1, d2 of 32 channels; pass B d0..d3 of 16
        auto at = [&](int f, int r) { return xb + f * (kB ? 2048 : 4096) + kk * 1024 + off[r]; };
        if constexpr (!kB) {
          ld2(af[B][0], at(0, 0), at(0, 1));  // d1
          ld2(af[B][1], at(1, 0), at(1, 1));  // d2
#pragma unroll
          for (int e = 0; e < 4; ++e) {  // d1 + d2 for G2, d2 - d1 for G3
            const float p = __uint_as_float(af[B][0][e]), q = __uint_as_float(af[B][1][e]);
            af[B][0][e] = __float_as_uint(p + q);
            af[B][1][e] = __float_as_uint(q - p);
          }
        } else {
          unsigned tmp[4];
          ld2(af[B][0], at(0, 0), at(0, 1));  // d0
          ld2(tmp, at(2, 0), at(2, 1));       // d2
#pragma unroll
          for (int e = 0; e < 4; ++e)  // d0 - d2 for G1
            af[B][0][e] = __float_as_uint(__uint_as_float(af[B][0][e]) - __uint_as_float(tmp[e]));
          ld2(af[B][1], at(3, 0), at(3, 1));  // d3
          ld2(tmp, at(1, 0), at(1, 1));       // d1
#pragma unroll
          for (int e = 0; e < 4; ++e)  // d3 - d1 for G4 (-m4 into acc1)
            af[B][1][e] = __float_as_uint(__uint_as_float(af[B][1][e]) - __uint_as_float(tmp[e]));
        }
        wgmma::fence_regs(af[B]);
        wgmma::fence();  // the fragments' registers (and the accumulators) before the products read them
        const uint64_t dk = (kk * 32) >> 4;
        wgmma::mma_m64n160k8_tf32_rs(acc0, af[B][0], db0 + dk, scale | (kk > 0));
        wgmma::mma_m64n160k8_tf32_rs(acc1, af[B][1], db1 + dk, scale | (kk > 0));
        wgmma::commit();
      }
    };
    auto stage = [&](auto pass_b, int s) {
      const int xs = static_cast<int>(u % XS), ws = static_cast<int>(u % WS);
      wgmma::mbar_wait(full_x(xs), (u / XS) & 1);
      wgmma::mbar_wait(full_w(ws), (u / WS) & 1);
      if (t.on) {
        steps(pass_b, s, sX + xs * T::x_bytes, sW + ws * T::w_bytes);
      } else if (prev_w >= 0) {
        release_w(prev_w);
        prev_w = -1;
      }
      __syncwarp();  // the warp's loads from the x slot are done
      if (lane == 0) wgmma::mbar_arrive(empty_x(xs));
      prev_w = ws;
      ++u;
    };
    for (int s = 0; s < a.chunks; ++s) stage(std::false_type{}, s);
    if (t.on) {  // pass A done: (m2, m3) -> (m2 + m3, m2 - m3)
      wgmma::wait<0>();
      wgmma::fence_regs(acc0);
      wgmma::fence_regs(acc1);
      // Each result written over an operand the other no longer needs: acc1 = p - m, then acc0 = 2 p - acc1
      // (p + m within an ulp of p or m). Written as the plain pair, ptxas kept both old values live and spilled.
#pragma unroll
      for (int e = 0; e < T::BN / 2; ++e) {
        acc1[e] = acc0[e] - acc1[e];
        acc0[e] = fmaf(2.f, acc0[e], -acc1[e]);
      }
      wgmma::fence_regs(acc0);
      wgmma::fence_regs(acc1);
    }
    for (int s = a.chunks; s < stages; ++s) stage(std::true_type{}, s);
    wgmma::wait<0>();
    wgmma::fence_regs(acc0);
    wgmma::fence_regs(acc1);
    release_w(prev_w);
    if (!t.on) continue;  // an idle warpgroup stores nothing

    // acc[4 j + 2 rr + e]: pixel p + rr, channel 8 j + 2 tig + e of the tile's BN; acc0 is frame 2q, acc1 2q + 1.
    const int p = t.pb * 64 + wp;
    if (p >= a.HW) continue;  // H * W is a multiple of 8: the pair is whole
    const float* bias = static_cast<const float*>(a.bias);
    const int f0 = 2 * t.q;
    const int64_t obase = t.b * a.out_sb + f0 * a.out_sf + p;
    const bool second = f0 + 1 < a.F_out;
#pragma unroll
    for (int j = 0; j < T::BN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int co = cb * T::BN + 8 * j + 2 * tig + e;
        if (co >= a.C_out) continue;
        const float bv = bias != nullptr ? bias[co] : 0.f;
        float* o = out + obase + co * a.out_sc;
        *reinterpret_cast<float2*>(o) = make_float2(acc0[4 * j + e] + bv, acc0[4 * j + 2 + e] + bv);
        if (second)
          *reinterpret_cast<float2*>(o + a.out_sf) = make_float2(acc1[4 * j + e] + bv, acc1[4 * j + 2 + e] + bv);
      }
    }
  }
  if constexpr (CM > 1) {
    wgmma::cluster_arrive();
    wgmma::cluster_wait();
  }
#endif
}

#endif

// tap_rows(weight) for the Hopper kernel, kept while the weight is unchanged (same tensor, version and
// data; fold_cacheable's rules): the reorder is a launch and ~9 us a call at 1280 channels, 3 % of the
// convolution. Not while a CUDA graph is captured (a replay would keep the captured copy after the weight
// changes).
// The rows' layouts: kTapRows (C_out, k, C_in); kTf32Rows, the TF32 kernel's copy, each 8 input channels of a row in
// the order 0, 2, 4, 6, 1, 3, 5, 7 (TcTf32Tile); kWinoRows, the Winograd kernel's (C_out, 4, C_in) rows G1..G4
// (TcWinoTile, k = 3) in the TF32 order, rounded to the nearest TF32 value (the products would truncate them).
// Each is cached apart from the others (the key's eps field tells them apart).
enum TapRowsLayout { kTapRows = 0, kTf32Rows = 1, kWinoRows = 2 };

at::Tensor cached_tap_rows(const at::Tensor& x, const at::Tensor& weight, TapRowsLayout layout = kTapRows) {
  // (C_out, r, C) rows in the TF32 kernels' order: channel 2 i + h of each 8 goes to position 4 h + i
  auto tf32_order = [](const at::Tensor& t) {
    const int64_t C_out = t.size(0), r = t.size(1), C = t.size(2);
    return t.view({C_out, r, C / 8, 4, 2}).transpose(3, 4).reshape({C_out, r, C});
  };
  auto make = [&] {
    at::Tensor w = tap_rows(weight);  // (C_out, k, C_in)
    if (layout == kTapRows) return w;
    if (layout == kTf32Rows) return tf32_order(w).contiguous();
    // kWinoRows, temporal_conv_tf32_wino_kernel's rows: see its comment
    const int64_t C_out = w.size(0), C = w.size(2), C32 = ceil_div(C, int64_t{32}) * 32;
    w = at::constant_pad_nd(w, {0, C32 - C});
    const at::Tensor w0 = w.select(1, 0), w1 = w.select(1, 1), w2 = w.select(1, 2);
    const at::Tensor s02 = w0 + w2;
    at::Tensor g = at::stack({(s02 + w1) * 0.5, (s02 - w1) * 0.5, w0, w2}, 1);  // G2, G3, G1, G4
    // round to nearest TF32 (10 mantissa bits): add half of the dropped part, clear it; not where that overflows
    const at::Tensor r = at::bitwise_and(g.view(at::kInt) + 0x1000, static_cast<int64_t>(~0x1FFF)).view(at::kFloat);
    g = tf32_order(at::where(at::isfinite(r) & at::isfinite(g), r, g));
    // G1 and G4 interleaved by 16 channels: (C_out, C32 / 16, 2, 16)
    auto by16 = [&](int i) { return g.select(1, i).reshape({C_out, C32 / 16, 16}); };
    const at::Tensor b = at::stack({by16(2), by16(3)}, 2);
    return at::cat({g.select(1, 0), g.select(1, 1), b.reshape({C_out, 2 * C32})}, 1).contiguous();
  };
  return cached_weight_copy(tap_rows_cache(), x, weight, static_cast<double>(layout), [&] { return FoldValue{make()}; })
      .weight;
}

// VD_TEMPORAL_CONV_KERNEL=gemm keeps the cuBLAS path on Hopper too (benchmarks and tests compare them).
bool temporal_wgmma_allowed() {
  const char* e = std::getenv("VD_TEMPORAL_CONV_KERNEL");
  return e == nullptr || std::string(e) != "gemm";
}

// VD_TEMPORAL_CONV_STORE=regs keeps the register epilogue of the Hopper kernel (benchmarks compare them).
bool temporal_tma_store() {
  const char* e = std::getenv("VD_TEMPORAL_CONV_STORE");
  return e == nullptr || std::string(e) != "regs";
}

#if defined(VD_SM90A)
// The kernels' arguments but the tile grid: bias_x keeps the bias in x's dtype (as the cuBLAS path adds it; no
// copy when it already is) alive for the launch.
TcArgs tc_args(const at::Tensor& out, const std::optional<at::Tensor>& bias, const TemporalConvShape& s,
               at::Tensor& bias_x) {
  TcArgs a{};
  a.out = out.data_ptr();
  if (bias.has_value()) {
    bias_x = bias->to(out.scalar_type()).contiguous();
    a.bias = bias_x.const_data_ptr();
  }
  a.out_sb = out.stride(0);
  a.out_sc = out.stride(1);
  a.out_sf = out.stride(2);
  a.C_out = static_cast<int>(s.C_out);
  a.HW = static_cast<int>(s.H * s.W);
  a.F = static_cast<int>(s.F);
  a.F_out = static_cast<int>(s.F_out);
  a.k = static_cast<int>(s.k);
  a.pad = static_cast<int>(s.padding);
  return a;
}

// The TF32 kernel's tile order on a grid of G CTAs: tc_edges_tile's where a model of the CTAs' makespan says it is
// shorter than the round robin's by 2 % or more: a tile costs its taps and 0.15 of a tap for its epilogue (the
// register stores of 192 x 160 floats against ~27 us a tap at 1280 channels). Only grids of at most 8 rounds are
// weighed (a few microseconds of host at most); past that the round robin's last round is a small share.
// VD_TEMPORAL_CONV_TF32_ORDER=rr|edges pins one (tests and benchmarks compare them).
void tf32_tile_order(TcArgs& a, int64_t G) {
  const int edge_lo = std::min(a.pad, a.F_out), edge_hi = std::max(0, a.F_out - std::max(a.pad, a.F_out - a.pad));
  a.sched_r = a.edge_lo = a.edge_hi = 0;  // tc_work's order
  const int64_t R = a.tiles % G;
  const std::string pin = env_str("VD_TEMPORAL_CONV_TF32_ORDER");
  if (pin == "rr" || a.tiles <= G || R == 0 || edge_lo + edge_hi == 0) return;
  TcArgs e = a;  // a: the round robin
  e.sched_r = static_cast<int>(R);
  e.edge_lo = edge_lo;
  e.edge_hi = edge_hi;
  if (pin != "edges") {
    if (a.tiles > 8 * G) return;
    auto cost = [&](int f) {
      int t0, t1;
      tc_taps(a, f, t0, t1);
      return std::max(0, t1 - t0) + 0.15;
    };
    std::vector<double> rr(G, 0.0), edges(G, 0.0);
    for (int64_t p = 0; p < a.tiles; ++p) {
      rr[p % G] += cost(tc_edges_tile<int64_t>(a, G, p).f);
      edges[p % G] += cost(tc_edges_tile<int64_t>(e, G, p).f);
    }
    if (*std::max_element(edges.begin(), edges.end()) > 0.98 * *std::max_element(rr.begin(), rr.end())) return;
  }
  a = e;
}

// The Winograd kernel (temporal_conv_tf32_wino_kernel) for k = 3, padding 1, one CTA a cluster: clusters of two
// multicasting the weight rows were 4-7 % slower at SVD's three UNet shapes (H200: 0.390 against 0.374 ms at 1280
// channels, 18 x 32 pixels; L2 at 63-66 % of its throughput either way). VD_TEMPORAL_CONV_WINO_CLUSTER=2 pins them
// (tests and benchmarks compare them).
bool temporal_conv_wino(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        at::Tensor& out, const TemporalConvShape& s) {
  using T = TcWinoTile;
  const int64_t HW = s.H * s.W;
  const at::Tensor w = cached_tap_rows(x, weight, kWinoRows);  // (C_out, 4 C32)
  at::Tensor bias_x;
  TcArgs a = tc_args(out, bias, s, bias_x);
  a.n_cb = static_cast<int>(ceil_div(s.C_out, T::BN));
  a.n_pb = static_cast<int>(ceil_div(HW, int64_t{64}));
  a.chunks = static_cast<int>(ceil_div(s.C_in, int64_t{32}));  // pass A's stages (pass B: twice as many)
  a.tiles = static_cast<int64_t>(a.n_pb) * ((s.F + 1) / 2) * s.B;  // units
  const int64_t pairs = ceil_div(a.tiles, int64_t{2});
  const std::string pin = env_str("VD_TEMPORAL_CONV_WINO_CLUSTER");
  const int cm = pin == "2" ? 2 : 1;
  a.full_tiles = a.n_cb * ceil_div(pairs, int64_t{cm});  // cluster items
  CUtensorMap tw, tx2, tx4;
  const int64_t cols = w.size(1);
  const uint32_t rows = T::BN / cm;  // a CTA's share of a stage's weight rows
  if (!tensor_map_4d(&tw, w, {cols, 1, s.C_out, 1}, {cols, cols, s.C_out * cols}, {32, 1, rows, 1}) ||
      !tensor_map_4d(&tx2, x, {HW, s.C_in, s.F, s.B}, {x.stride(1), x.stride(2), x.stride(0)}, {32, 32, 2, 1}) ||
      !tensor_map_4d(&tx4, x, {HW, s.C_in, s.F, s.B}, {x.stride(1), x.stride(2), x.stride(0)}, {32, 16, 4, 1}))
    return false;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  auto launch = [&](auto kernel, int K) {
    const int clusters = resident_clusters(kernel, K, x.get_device(), T::threads, T::smem_bytes);
    if (clusters == 0) return false;
    launch_clusters(kTemporalConvOp, kernel, a, std::min<int64_t>(clusters, a.full_tiles), K, T::threads,
                    T::smem_bytes, stream, tw, tx2, tx4);
    return true;
  };
  return cm == 2 ? launch(temporal_conv_tf32_wino_kernel<2>, 2) : launch(temporal_conv_tf32_wino_kernel<1>, 1);
}

// VD_TEMPORAL_CONV_TF32_ALGO=direct keeps the direct TF32 kernel where the Winograd one applies (tests and
// benchmarks compare them). The weight rows' columns (4 C_in rounded up to 32) are 32-bit copy coordinates.
bool temporal_wino_allowed(const TemporalConvShape& s) {
  const int64_t cols = 4 * ceil_div(s.C_in, int64_t{32}) * 32;
  return s.k == 3 && s.padding == 1 && cols <= std::numeric_limits<int>::max() &&
         env_str("VD_TEMPORAL_CONV_TF32_ALGO") != "direct";
}

// temporal_conv_wgmma's float32 half (its checks done): temporal_conv_tf32_kernel at BN = 160 output channels a tile,
// or 128 where that pads C_out to fewer channels (256, 512: the VAE's temporal decoder). 128 where it only fills the
// persistent grid's last round better was 7 % slower (H200: 0.527 against 0.491 ms at 1280 channels, 18 x 32
// pixels; 0.544 against 0.507 at 640, 36 x 64): 14 % more bytes a product, the same per-stage overheads.
bool temporal_conv_tf32(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        at::Tensor& out, const TemporalConvShape& s) {
  const int64_t HW = s.H * s.W;
  const at::Tensor w = cached_tap_rows(x, weight, kTf32Rows);  // (C_out, k, C_in)
  at::Tensor bias_x;
  TcArgs a = tc_args(out, bias, s, bias_x);  // half_pb 0: the TF32 kernel has no short tiles
  auto padded = [&](int64_t BN) { return ceil_div(s.C_out, BN) * BN; };
  // VD_TEMPORAL_CONV_TF32_TILE=128|160 pins the channels a tile (tests and benchmarks compare them).
  const std::string pin = env_str("VD_TEMPORAL_CONV_TF32_TILE");
  const bool narrow = pin == "128" || (pin != "160" && padded(128) < padded(160));
  auto launch = [&](auto bn_tag) {
    constexpr int BN = decltype(bn_tag)::value;
    using T = TcTf32Tile<BN>;
    a.n_cb = static_cast<int>(ceil_div(s.C_out, T::BN));
    a.n_pb = static_cast<int>(ceil_div(HW, T::BM));
    a.chunks = static_cast<int>(ceil_div(s.C_in, T::BK));
    a.tiles = static_cast<int64_t>(a.n_cb) * a.n_pb * s.F_out * s.B;
    if (a.tiles > std::numeric_limits<int>::max()) return false;  // tc_edges_tile's 32-bit positions
    auto kernel = temporal_conv_tf32_kernel<BN>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(T::smem_bytes)));
    const unsigned grid = persistent_blocks(kernel, T::threads, T::smem_bytes, a.tiles);
    tf32_tile_order(a, grid);
    CUtensorMap tw, tx;
    if (!tensor_map_4d(&tw, w, {s.C_in, s.k, s.C_out, 1}, {s.C_in, s.k * s.C_in, s.C_out * s.k * s.C_in},
                       {T::BK, 1, T::BN, 1}) ||
        !tensor_map_4d(&tx, x, {HW, s.C_in, s.F, s.B}, {x.stride(1), x.stride(2), x.stride(0)}, {32, T::BK, 1, 1}))
      return false;
    kernel<<<grid, T::threads, T::smem_bytes, c10::cuda::getCurrentCUDAStream()>>>(a, tw, tx);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return true;
  };
  return narrow ? launch(std::integral_constant<int, 128>{}) : launch(std::integral_constant<int, 160>{});
}
#endif

// The Hopper kernels for x that is contiguous or frames-major with H * W and C_in multiples of 8 (16-byte
// strides for the copy engine): fp16 / bf16, and float32 on TF32 tensor cores where cuDNN's convolutions may
// run TF32 (torch.backends.cudnn.allow_tf32, on by default: what eager's Conv3d does). Returns false where the
// cuBLAS path is used instead (float32 with the switch off: IEEE float32 GEMMs).
bool temporal_conv_wgmma(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                         at::Tensor& out, const TemporalConvShape& s) {
#if defined(VD_SM90A)
  const auto dt = x.scalar_type();
  const bool tf32 = dt == at::kFloat && at::globalContext().allowTF32CuDNN();
  if ((dt != at::kHalf && dt != at::kBFloat16 && !tf32) || s.channels_last || !temporal_wgmma_allowed() ||
      !device_is_sm90a())
    return false;
  const int64_t HW = s.H * s.W, kMax = std::numeric_limits<int>::max();
  if (HW % 8 != 0 || s.C_in % 8 != 0 || x.stride(4) != 1 || x.stride(3) != s.W || out.stride(4) != 1 ||
      out.stride(3) != s.W || !aligned16(x.const_data_ptr()) || !aligned16(out.const_data_ptr()))
    return false;
  if (HW > kMax - 256 || s.C_in > kMax - 128 || s.C_out > kMax - 256 || s.F > kMax || s.B > kMax ||
      s.F_out > kMax || s.k > kMax || s.padding > kMax / 2)
    return false;  // the copy engine's coordinates and the tile fields are 32-bit
  if (tf32 && temporal_wino_allowed(s) && temporal_conv_wino(x, weight, bias, out, s)) return true;
  if (tf32) return temporal_conv_tf32(x, weight, bias, out, s);
  const at::Tensor w = cached_tap_rows(x, weight);  // (C_out, k, C_in) contiguous
  CUtensorMap tw, tx, to{};
  if (!tensor_map_4d(&tw, w, {s.C_in, s.k, s.C_out, 1}, {s.C_in, s.k * s.C_in, s.C_out * s.k * s.C_in},
                     {64, 1, TcTile::BM, 1}) ||
      !tensor_map_4d(&tx, x, {HW, s.C_in, s.F, s.B}, {x.stride(1), x.stride(2), x.stride(0)}, {64, 64, 1, 1}))
    return false;
  // The output as (H * W, C_out, F_out, B), boxes of 64 pixels x 64 channels, for the TMA epilogue.
  const bool tma = temporal_tma_store() && tensor_map_4d(&to, out, {HW, s.C_out, s.F_out, s.B},
                                                         {out.stride(1), out.stride(2), out.stride(0)}, {64, 64, 1, 1});

  at::Tensor bias_x;
  TcArgs a = tc_args(out, bias, s, bias_x);
  a.n_cb = static_cast<int>(ceil_div(s.C_out, TcTile::BM));
  a.n_pb = static_cast<int>(ceil_div(HW, TcTile::BN));
  a.chunks = static_cast<int>(ceil_div(s.C_in, TcTile::BK));
  a.half_pb = HW % TcTile::BN != 0 && HW % TcTile::BN <= TcTile::BN / 2 ? 1 : 0;
  a.tiles = static_cast<int64_t>(a.n_cb) * a.n_pb * s.F_out * s.B;
  a.full_tiles = static_cast<int64_t>(a.n_cb) * (a.n_pb - a.half_pb) * s.F_out * s.B;

  const size_t smem = TcTile::smem_bytes;
  auto launch = [&](auto kernel) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    kernel<<<persistent_blocks(kernel, 384, smem, a.tiles), 384, smem, c10::cuda::getCurrentCUDAStream()>>>(a, tw, tx,
                                                                                                           to);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  auto pick = [&](auto tag, auto short_tiles) {
    using T = decltype(tag);
    constexpr bool kShort = decltype(short_tiles)::value;
    if (tma) launch(temporal_conv_wgmma_kernel<T, kShort, true>);
    else launch(temporal_conv_wgmma_kernel<T, kShort, false>);
  };
  if (dt == at::kBFloat16) {
    if (a.half_pb) pick(at::BFloat16{}, std::true_type{});
    else pick(at::BFloat16{}, std::false_type{});
  } else {
    if (a.half_pb) pick(at::Half{}, std::true_type{});
    else pick(at::Half{}, std::false_type{});
  }
  return true;
#else
  (void)x, (void)weight, (void)bias, (void)out, (void)s;
  return false;
#endif
}

at::Tensor temporal_conv_cuda(const at::Tensor& x, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, int64_t padding) {
  c10::cuda::CUDAGuard guard(x.device());
  const TemporalConvShape s = check_temporal_conv(x, weight, padding);
  check_vector(bias, s.C_out, x, kTemporalConvOp, "bias");
  at::Tensor out = temporal_output(x, s);
  if (out.numel() > 0 && !temporal_conv_wgmma(x, weight, bias, out, s)) temporal_conv_gemms(x, weight, bias, s, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> temporal_conv_backward_cuda(const at::Tensor& grad_out,
                                                                           const at::Tensor& x,
                                                                           const at::Tensor& weight,
                                                                           int64_t padding) {
  c10::cuda::CUDAGuard guard(x.device());
  return temporal_conv_backward(grad_out, x, weight, padding);
}

}  // namespace

TORCH_LIBRARY_IMPL(vd, CUDA, m) {
  m.impl("temporal_conv", &temporal_conv_cuda);
  m.impl("temporal_conv_backward", &temporal_conv_backward_cuda);
}

}  // namespace vd
