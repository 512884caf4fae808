// CUDA kernels for vd::conv_bn_silu. The forward applies BatchNorm as s and b' on the convolution's output
// (bn_vectors_cuda), the weight unscaled. On Hopper (sm_90a), fp16 / bf16 (or float32 as TF32) channels_last input
// with stride 1: one implicit-GEMM kernel (wgmma + TMA) with the scale, bias and SiLU in its epilogue. Elsewhere
// the convolution runs through ATen (cuDNN) with the shared code of csrc/conv_gemm.h and the scale + bias + SiLU
// epilogue is one in-place pass over the output; the backward (the weight folded, as on CPU) runs dz = g * silu'(z)
// as another.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#include "../activation.h"
#include "../conv_gemm.h"
#include "hopper.h"
#include "launch.h"
#include "wgmma.h"

namespace vd {
namespace {

// Channel of flat element i: NCHW planes of S elements, or NHWC rows of C elements.
__device__ __forceinline__ int64_t channel_of(int64_t i, int64_t C, int64_t S, bool channels_last) {
  return channels_last ? i % C : (i / S) % C;
}

// y <- act(y * scale[c] + shift[c]): y is the convolution with the unscaled weight (see bn_vectors_cuda), in
// x's dtype as eager's conv -> BN has it (a float16 conv(x, w) past 65504 is inf here as there).
template <typename scalar_t, typename acc_t>
__global__ void bias_act_kernel(scalar_t* __restrict__ y, const acc_t* __restrict__ scale,
                                const acc_t* __restrict__ shift, int64_t n, int64_t C, int64_t S,
                                bool channels_last, bool silu) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t c = channel_of(i, C, S, channels_last);
    const acc_t z = static_cast<acc_t>(y[i]) * scale[c] + shift[c];
    y[i] = static_cast<scalar_t>(silu ? silu_fast(z) : z);
  }
}

// The same pass on 16-byte vectors of V elements that share a channel run: V consecutive channels of an
// NHWC row (C % V == 0) or V positions of one NCHW plane (S % V == 0). The scalar kernel's 64-bit
// division per element made it issue-bound (~25 % of the copy rate on the UNet shapes). NHWC reads the V
// channels' s and b' as vectors too (scale and shift aligned to V elements: the host checks), where one load
// each an element made the pass load-bound.
template <typename scalar_t, typename acc_t, int V, bool kSilu, bool kChannelsLast>
__global__ void bias_act_vec_kernel(scalar_t* __restrict__ y, const acc_t* __restrict__ scale,
                                    const acc_t* __restrict__ shift, int64_t nv, int64_t C, int64_t sv) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < nv; v += stride) {
    Vec<scalar_t, V> x = reinterpret_cast<const Vec<scalar_t, V>*>(y)[v];
    // NHWC: sv = C / V vectors a row, the vector's first channel; NCHW: sv = S / V vectors a plane.
    const int64_t c0 = kChannelsLast ? (v % sv) * V : (v / sv) % C;
    Vec<acc_t, V> m, b;
    if constexpr (kChannelsLast) {
      m = *reinterpret_cast<const Vec<acc_t, V>*>(scale + c0);
      b = *reinterpret_cast<const Vec<acc_t, V>*>(shift + c0);
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) m.v[j] = scale[c0], b.v[j] = shift[c0];
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      const acc_t z = static_cast<acc_t>(x.v[j]) * m.v[j] + b.v[j];
      x.v[j] = static_cast<scalar_t>(kSilu ? silu_fast(z) : z);
    }
    reinterpret_cast<Vec<scalar_t, V>*>(y)[v] = x;
  }
}

// y (the folded conv without bias) <- dz = g * silu'(y + shift).
template <typename scalar_t, typename acc_t>
__global__ void grad_z_kernel(scalar_t* __restrict__ y, const scalar_t* __restrict__ g,
                              const acc_t* __restrict__ shift, int64_t n, int64_t C, int64_t S,
                              bool channels_last) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const acc_t z = static_cast<acc_t>(y[i]) + shift[channel_of(i, C, S, channels_last)];
    y[i] = static_cast<scalar_t>(static_cast<acc_t>(g[i]) * silu_grad(z));
  }
}

unsigned grid_for(int64_t n, int threads) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, 65535)));
}

// The forward's BatchNorm fold: s = gamma / sqrt(var + eps) and b' = (b - mean) * s + beta, one small kernel,
// and s applied to the convolution's output (the kernels' epilogue, or the scale + bias + SiLU pass after
// cuDNN), not to the weight: the weight is read as it is where it is in the op's layout (else one layout copy,
// cached with the vectors). Under CUDA-graph capture there is no cache and every replay folds: a weight fold was a pass
// over the weight (0.022 ms at 1280 channels bf16 in one kernel, 0.14 ms as ATen's five), this one C_out
// threads. float32 arithmetic in the order of conv_gemm.h's fold_bn (explicitly rounded steps, no
// contraction; 1 / sqrt correctly rounded). Cached calls fold here too, so they and graph replays agree.
struct FoldVec {  // a per-channel vector: any float dtype, any stride; p == nullptr: absent
  const void* p;
  int64_t stride;
  int type;  // 0 float32, 1 float16, 2 bfloat16, 3 float64
};
struct FoldVecs {
  FoldVec bias, gamma, beta, mean, var;
};
__device__ __forceinline__ float load_vec(const FoldVec& v, int64_t c) {
  const int64_t i = c * v.stride;
  switch (v.type) {
    case 1: return __half2float(static_cast<const __half*>(v.p)[i]);
    case 2: return __bfloat162float(static_cast<const __nv_bfloat16*>(v.p)[i]);
    case 3: return static_cast<float>(static_cast<const double*>(v.p)[i]);
    default: return static_cast<const float*>(v.p)[i];
  }
}

// scale, shift: C_out floats each; scale_shift: both, interleaved by channel (Folded::scale_shift).
__global__ void bn_vectors_kernel(int64_t C_out, FoldVecs v, float eps, float* __restrict__ scale,
                                  float* __restrict__ shift, float2* __restrict__ scale_shift) {
  const int64_t co = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (co >= C_out) return;
  const float sc = __fmul_rn(load_vec(v.gamma, co), __frcp_rn(__fsqrt_rn(__fadd_rn(load_vec(v.var, co), eps))));
  const float m = load_vec(v.mean, co);
  const float bm = v.bias.p != nullptr ? __fsub_rn(load_vec(v.bias, co), m) : -m;
  const float sh = __fadd_rn(__fmul_rn(bm, sc), load_vec(v.beta, co));
  scale[co] = sc;
  shift[co] = sh;
  scale_shift[co] = make_float2(sc, sh);
}

FoldVec fold_vec(const at::Tensor* t) {
  if (t == nullptr) return {nullptr, 0, 0};
  const auto d = t->scalar_type();
  return {t->const_data_ptr(), t->stride(0),
          d == at::kHalf ? 1 : d == at::kBFloat16 ? 2 : d == at::kDouble ? 3 : 0};
}

// Folded{weight: w in the op's layout (w itself where it is already), out_scale: s, shift: b'} for the
// forward; float64 input computes s and b' in float64 through ATen.
Folded bn_vectors_cuda(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       const at::Tensor& bn_weight, const at::Tensor& bn_bias, const at::Tensor& bn_mean,
                       const at::Tensor& bn_var, double eps, at::MemoryFormat fmt) {
  const int64_t C_out = weight.size(0);
  Folded f;
  f.weight = weight.contiguous(fmt);
  if (x.scalar_type() == at::kDouble) {
    const auto acc = at::kDouble;
    f.out_scale = (bn_weight.to(acc) * (bn_var.to(acc) + eps).rsqrt()).contiguous();
    const at::Tensor bm = bias.has_value() ? bias->to(acc) - bn_mean.to(acc) : -bn_mean.to(acc);
    f.shift = (bm * f.out_scale + bn_bias.to(acc)).contiguous();
    return f;
  }
  f.out_scale = at::empty({C_out}, x.options().dtype(at::kFloat));
  f.shift = at::empty({C_out}, x.options().dtype(at::kFloat));
  f.scale_shift = at::empty({C_out, 2}, x.options().dtype(at::kFloat));
  if (C_out == 0) return f;
  const FoldVecs v{fold_vec(bias.has_value() ? &*bias : nullptr), fold_vec(&bn_weight), fold_vec(&bn_bias),
                   fold_vec(&bn_mean), fold_vec(&bn_var)};
  bn_vectors_kernel<<<grid_of(ceil_div(C_out, 128), kConvBnSiluOp), 128, 0, c10::cuda::getCurrentCUDAStream()>>>(
      C_out, v, static_cast<float>(eps), f.out_scale.mutable_data_ptr<float>(), f.shift.mutable_data_ptr<float>(),
      reinterpret_cast<float2*>(f.scale_shift.mutable_data_ptr<float>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return f;
}

void bias_act_cuda_(at::Tensor& y, const at::Tensor& scale, const at::Tensor& shift, bool silu,
                    const ConvShape& s) {
  const int64_t n = y.numel();
  if (n == 0) return;
  TORCH_INTERNAL_ASSERT(scale.defined(), "conv_bn_silu: the CUDA forward applies s to the output");
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "conv_bn_silu_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor sh = shift.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
    at::Tensor sc = scale.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
    constexpr int V = 16 / sizeof(scalar_t);
    const int64_t S = s.H_out * s.W_out;
    auto aligned_vec = [](const at::Tensor& t) {
      return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % (sizeof(acc_t) * V) == 0;
    };
    if (aligned16(y.const_data_ptr()) &&
        (s.channels_last ? s.C_out % V == 0 && aligned_vec(sc) && aligned_vec(sh) : S % V == 0)) {
      const int64_t nv = n / V, sv = s.channels_last ? s.C_out / V : S / V;
      auto launch = [&](auto kernel) {
        kernel<<<grid_for(nv, 256), 256, 0, stream>>>(y.mutable_data_ptr<scalar_t>(), sc.const_data_ptr<acc_t>(),
                                                      sh.const_data_ptr<acc_t>(), nv, s.C_out, sv);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      if (s.channels_last) {
        if (silu) launch(bias_act_vec_kernel<scalar_t, acc_t, V, true, true>);
        else launch(bias_act_vec_kernel<scalar_t, acc_t, V, false, true>);
      } else {
        if (silu) launch(bias_act_vec_kernel<scalar_t, acc_t, V, true, false>);
        else launch(bias_act_vec_kernel<scalar_t, acc_t, V, false, false>);
      }
      return;
    }
    bias_act_kernel<scalar_t, acc_t><<<grid_for(n, 256), 256, 0, stream>>>(
        y.mutable_data_ptr<scalar_t>(), sc.const_data_ptr<acc_t>(), sh.const_data_ptr<acc_t>(), n, s.C_out,
        s.H_out * s.W_out, s.channels_last, silu);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// Returns sum(dz) per output channel in float (double for float64); dz is written into y when silu.
at::Tensor grad_z_cuda_(at::Tensor& y, const at::Tensor& g, const at::Tensor& shift, bool silu,
                        const ConvShape& s) {
  const auto acc = compute_dtype(g);
  if (!silu) return g.sum({0, 2, 3}, /*keepdim=*/false, acc);
  const int64_t n = y.numel();
  auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "conv_bn_silu_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    at::Tensor sh = shift.to(c10::CppTypeToScalarType<acc_t>::value).contiguous();
    grad_z_kernel<scalar_t, acc_t><<<grid_for(n, 256), 256, 0, stream>>>(
        y.mutable_data_ptr<scalar_t>(), g.const_data_ptr<scalar_t>(), sh.const_data_ptr<acc_t>(), n,
        s.C_out, s.H_out * s.W_out, s.channels_last);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y.sum({0, 2, 3}, /*keepdim=*/false, acc);
}

// ---- Hopper: the convolution, BatchNorm and SiLU as one implicit GEMM ----
// out[p, co] = silu(s[co] sum_{r, s, ci} x[n, h + r dil - pad, w + s dil - pad, ci] w[co, r, s, ci] + b'[co])
// for each output pixel p = (n, h, w), NHWC (s and b' from bn_vectors_cuda; w as the caller holds it). GEMM
// rows (M) are output pixels, columns (N) output channels, K the taps times input channels, both operands
// K-major: a tile is BM (128 or 64) consecutive pixels x BN channels (CbsTile), its K loop one tap and 128
// bytes of input channels a stage (64 fp16 / bf16, 32 float32). The copy engine loads the weight rows (the
// weight is channels_last: (C_out, kH, kW, C_in)) and, in its im2col mode, the tile's BM input pixels for
// the tap in one box (the walk over output positions crosses rows and images; positions in the padding read
// zeros), so there is no im2col buffer and no bounds test in the loop. Two consumer warpgroups (64 pixels
// each, or at BM = 64 half the channels each) run wgmma m64nNk16 (k8 TF32 for float32); one producer thread
// streams the stages (two copies a stage: with one box a row segment its per-stage work was the bottleneck,
// the consumers waiting on it two thirds of the time).
//
// Work is split stream-K: the tiles' K steps, laid end to end, are cut into one even range per CTA (one
// CTA an SM), so no last wave runs half empty (the UNet shapes have 90-432 tiles on 132 SMs). A tile cut
// between CTAs is finished by the CTA that holds its first K step (its owner, which reaches it last in its
// range): the others reach their part of it first, store their partial sums (fp32, one slot a CTA) and
// count themselves in the tile's flag; the owner waits for the count, adds the slots and runs the epilogue.
// Only owners wait, and on CTAs that run before any waiting, so every CTA must be resident at once: the
// grid is at most one CTA an SM. With two or more waves of tiles, all but the last one to two run whole
// tiles first, data-parallel (a wave on neighbouring tiles keeps its operands in L2; one range a CTA over
// hundreds of tiles had the CTAs on all of them at once: 28 x 1280 x 18 x 32, 733 against 647 us), and
// only the rest is cut stream-K.
// Every pixel tile re-reads the whole weight: in clusters, the CTAs of cm consecutive pixel tiles of one
// channel tile (all of them where there are 2-8 of 64, else pairs) share each weight stage, loaded once, in
// slices by the first CTAs, multicast into all, and refilled only when every CTA's consumers have handed it
// back; the clusters' K steps are cut as above.
#if defined(VD_SM90A)
struct CbsArgs {
  const float2* scale_shift;  // (s, b') of each output channel (Folded::scale_shift)
  float* ws;           // partial sums: a slot of BM x BN floats a CTA
  int* flags;          // 2 a tile (one a consumer warpgroup): partial slots stored so far; zeroed by the host
  int64_t units;       // tiles x iters: the K steps of all tiles (cm > 1: groups x channel tiles x iters)
  int64_t dp;          // whole tiles each CTA (cluster) takes first, data-parallel (see CbsWalk)
  int64_t P;           // output pixels, N x H_out x W_out
  int n_nt, iters, chunks, kW;  // channel tiles; K steps a tile (taps x chunks); chunks of BK channels of C_in
  int C_out, H_out, W_out, BW;  // BW: the row segment (pixels) of an output box; divides W_out and 64
  int pad_h, pad_w, dil_h, dil_w;
  int silu;
  float* out;  // the output where it is float32 (written from registers; fp16 / bf16 go through `to`)
  int cm;      // CTAs a cluster (>= 2: one a pixel tile of a group of cm, the weight multicast to all; units
               // then count groups x channel tiles x iters) or 1 (no cluster)
  int bslices;  // CTAs of a cluster that load a slice of the weight stage each (BN / bslices rows)
  int wbatch;   // 1: a weight for each image (the Winograd products: image n is product n, its own weight)
};

// BN: 128, 160 or 256 output channels a tile (256: m64n256k16 reads the warpgroup's pixel rows once for 256
// channels, 10 KB of shared memory a 128-cycle product against 12 KB for two m64n128k16; and half the L2
// reads a product). E: the element size. A stage is 128 bytes of channels a row (BK = 64 fp16 / bf16 or 32
// float32, read as TF32), so both layouts and the four 32-byte K steps a stage are the same for all types.
//
// BM: 128 pixels a tile (each consumer warpgroup 64 of them, all BN channels) or 64 (both warpgroups on the
// same 64 pixels, BN / 2 channels each; BN 128 or 256): small problems, where the 128-pixel tiles are few and
// each is cut between several CTAs, waste fewer rows in a partial last tile and cut each tile fewer times
// (and 16-bit 256-channel problems of 8-15 tiles of 128, in pairs: see the choice below). Or 256 at BN = 128
// (each consumer warpgroup 128 pixels, two m64 products a K step on the same weight rows: twice the products a
// stage for its fixed cost, as cuDNN's 256 x 128 tiles; see the choice below).
template <int BN_, int E, int BM_ = 128>
struct CbsTile {
  static_assert(BM_ == 128 || BN_ != 160, "64-pixel tiles split 128 or 256 channels");
  static_assert(BM_ != 256 || BN_ == 128, "256-pixel tiles hold 128 channels (128 accumulators a thread)");
  static constexpr int BM = BM_, BN = BN_, BK = 128 / E;
  static constexpr int WN = BM == 64 ? BN / 2 : BN;  // the channels of a consumer warpgroup
  static constexpr int MB = BM == 256 ? 2 : 1;       // its blocks of 64 pixels (one m64 product each)
  static constexpr int a_bytes = BM * 128;  // BM pixel rows of BK channels
  static constexpr int b_bytes = BN * 128;  // BN weight rows of BK channels
  static constexpr int stage_bytes = a_bytes + b_bytes;
  // The epilogue's staging (fp16 / bf16; float32 is stored from registers: its boxes would not fit beside
  // the stages): per consumer warpgroup WN / 64 blocks of 64 pixels x 64 channels (128-byte rows, 128-byte
  // swizzle) and, at WN = 160, a block of 64 pixels x 32 channels (64-byte rows and swizzle).
  // At WN = 256 (16-bit 128 x 256 tiles) the boxes are staged in two rounds of 128 channels: 32 KB a
  // warpgroup instead of 64 leaves room for a fourth stage of 48 KB (three before).
  static constexpr int blk_bytes = 64 * 128, full_blks = WN / 64, tail = WN % 64;  // tail: 0 or 32 channels
  static constexpr int rounds = E != 4 && WN == 256 ? 2 : 1, round_blks = full_blks / rounds;
  static constexpr int wg_out_bytes = E == 4 ? 0 : round_blks * blk_bytes + (tail ? 4096 : 0);
  // As many stages as fit in the 227 KB beside the staging.
  static constexpr int kStages = (227 * 1024 - 1024 - 2 * wg_out_bytes) / (stage_bytes + 16) < 8
                                     ? (227 * 1024 - 1024 - 2 * wg_out_bytes) / (stage_bytes + 16)
                                     : 8;
  static constexpr int out_off = kStages * stage_bytes;
  static constexpr int bar_off = out_off + 2 * wg_out_bytes;
  static constexpr size_t smem_bytes = bar_off + 16 * kStages + 1024;  // + slack to align to 1024
  static constexpr int kAcc = WN / 2;  // accumulator floats a thread, a block of 64 pixels
};

// The part of a tile a CTA works on next: from K step v of its range [v, v1), tile t's steps [k0, k1).
struct CbsPart {
  int64_t t;
  int k0, k1;
};
__device__ __forceinline__ CbsPart cbs_part(const CbsArgs& a, int64_t v, int64_t v1) {
  const int64_t t = v / a.iters;
  const int k0 = static_cast<int>(v - t * a.iters);
  return {t, k0, static_cast<int>(min(static_cast<int64_t>(a.iters), k0 + (v1 - v)))};
}

// The parts of CTA (cluster) g in order: first a.dp whole tiles g, g + G, g + 2G, ... (data-parallel waves:
// the CTAs of a wave on neighbouring tiles, so its operands stay in L2; a stream-K range per CTA over
// hundreds of tiles spreads the CTAs over all of them at once), then its even share of the remaining tiles'
// K steps, stream-K: [sk0 + g U' / G, sk0 + (g + 1) U' / G) with U' = units - sk0.
struct CbsWalk {
  int64_t i, dp, v, v1;
  int G, g;
  __device__ __forceinline__ bool next(const CbsArgs& a, CbsPart& p) {
    if (i < dp) {
      p = {i++ * G + g, 0, a.iters};
      return true;
    }
    if (v >= v1) return false;
    p = cbs_part(a, v, v1);
    v += p.k1 - p.k0;
    return true;
  }
};
__device__ __forceinline__ int64_t cbs_sk0(const CbsArgs& a, int G) { return a.dp * G * a.iters; }
__device__ __forceinline__ CbsWalk cbs_walk(const CbsArgs& a, int G, int g) {
  const int64_t sk0 = cbs_sk0(a, G), u = a.units - sk0;
  return {0, a.dp, sk0 + g * u / G, sk0 + (g + 1) * u / G, G, g};
}

// The CTA whose range holds K step v: ranges are [g U / G, (g + 1) U / G).
__device__ __forceinline__ int cbs_cta_of(int64_t v, int64_t units, int G) {
  int g = static_cast<int>(((v + 1) * G + units - 1) / units) - 1;
  while (g + 1 < G && (static_cast<int64_t>(g + 1) * units) / G <= v) ++g;
  while (g > 0 && (static_cast<int64_t>(g) * units) / G > v) --g;
  return g;
}

// (n, h, w) of output pixel p.
struct CbsPix {
  int n, h, w;
};
__device__ __forceinline__ CbsPix cbs_pix(const CbsArgs& a, int64_t p) {
  const int64_t hw = static_cast<int64_t>(a.H_out) * a.W_out;
  const int64_t n = p / hw, r = p - n * hw;
  const int h = static_cast<int>(r / a.W_out);
  return {static_cast<int>(n), h, static_cast<int>(r - static_cast<int64_t>(h) * a.W_out)};
}
// The next row segment: BW pixels on.
__device__ __forceinline__ void cbs_next(const CbsArgs& a, CbsPix& q) {
  q.w += a.BW;
  if (q.w == a.W_out) {
    q.w = 0;
    if (++q.h == a.H_out) q.h = 0, ++q.n;
  }
}

__device__ __forceinline__ void red_release_add(int* p, int v) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;\n" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ int ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// MC: in clusters of a.cm CTAs on a.cm consecutive pixel tiles of one channel tile, each weight stage loaded
// once a cluster (multicast); the kernels without it are compiled for cm = 1.
template <typename scalar_t, int BN, int BM, bool MC = false>
__global__ void __launch_bounds__(384, 1)
    conv_bn_silu_wgmma_kernel(const CbsArgs a, const __grid_constant__ CUtensorMap tw,
                              const __grid_constant__ CUtensorMap tx, const __grid_constant__ CUtensorMap to,
                              const __grid_constant__ CUtensorMap to32) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = CbsTile<BN, sizeof(scalar_t), BM>;
  constexpr int S = T::kStages, NACC = T::kAcc, MB = T::MB;
  constexpr bool kBf16 = std::is_same_v<scalar_t, at::BFloat16>, kTf32 = std::is_same_v<scalar_t, float>;
  extern __shared__ __align__(16) unsigned char cbs_smem[];
  const uint32_t base = (static_cast<uint32_t>(__cvta_generic_to_shared(cbs_smem)) + 1023u) & ~1023u;
  const uint32_t bar = base + T::bar_off;
  auto sA = [&](int st) { return base + st * T::stage_bytes; };
  auto sB = [&](int st) { return base + st * T::stage_bytes + T::a_bytes; };
  auto full = [&](int st) { return bar + 8 * st; };
  auto empty = [&](int st) { return bar + 8 * (S + st); };
  // G, g: the clusters and this CTA's (CTAs where cm = 1); rank: its pixel tile in the cluster.
  const int tid = threadIdx.x, wg = tid / 128, cm = MC ? a.cm : 1, G = gridDim.x / cm, g = blockIdx.x / cm;
  const int rank = MC ? blockIdx.x % cm : 0;
  // empty: one arrival per consumer warp of every CTA writing into the stage (the cluster's, with multicast)
  if (tid == 0) wgmma::init_stage_ring(bar, S, 8 * cm);
  if (cm > 1) {
    wgmma::cluster_arrive();  // the barriers initialized in every CTA before any copy or arrival targets them
    wgmma::cluster_wait();
  } else {
    __syncthreads();
  }
  // Tile t of a part as the tile this CTA computes; where cm > 1 a part's t is (pixel tile group, channel
  // tile) and this CTA takes pixel tile `rank` of the group.
  auto tile_of = [&](int64_t t) { return cm > 1 ? ((t / a.n_nt) * cm + rank) * a.n_nt + t % a.n_nt : t; };
  const int slice_rows = T::BN / a.bslices;

  if (wg == 0) {
    // The producer needs few registers, the consumers' accumulators many (64-pixel tiles: fewer). In clusters
    // at 128 pixels the producer's 40 leave ptxas 12-24 bytes of spill (100 in float32 256 x 128).
    wgmma::setmaxnreg_dec<MC && BM == 64 ? 56 : 40>();
    if (tid == 0) {
      uint32_t u = 0;  // stages filled so far (runs on across tiles)
      CbsWalk walk = cbs_walk(a, G, g);
      for (CbsPart part; walk.next(a, part);) {
        const auto [tp, k0, k1] = part;
        const int64_t t = tile_of(tp);
        const int nt = static_cast<int>(t % a.n_nt);
        const CbsPix q = cbs_pix(a, (t / a.n_nt) * T::BM);  // the tile's first output pixel
        const int w0 = q.w - a.pad_w, h0 = q.h - a.pad_h;  // its position at tap (0, 0)
        const int wb = a.wbatch ? q.n : 0;  // the weight's batch (a tile never spans two images there)
        int tap = k0 / a.chunks, c = k0 - tap * a.chunks;
        int r = tap / a.kW, s = tap - r * a.kW;
#pragma unroll 1  // unrolled (by S where it is a power of 2), the producer's 40 registers spill
        for (int k = k0; k < k1; ++k, ++u) {
          const int st = static_cast<int>(u % S);
          wgmma::mbar_wait(empty(st), ((u / S) & 1) ^ 1u);
          wgmma::mbar_expect_tx(full(st), T::stage_bytes);
          if (cm == 1)
            wgmma::tma_load_4d(sB(st), &tw, full(st), c * T::BK, tap, nt * T::BN, wb);
          else if (rank < a.bslices)  // this CTA's slice of the weight rows, into every CTA of the cluster
            wgmma::tma_load_4d_multicast(sB(st) + rank * slice_rows * 128, &tw, full(st), c * T::BK, tap,
                                         nt * T::BN + rank * slice_rows, wb, static_cast<uint16_t>((1u << cm) - 1));
          wgmma::tma_load_im2col_4d(sA(st), &tx, full(st), c * T::BK, w0, h0, q.n,
                                    static_cast<uint16_t>(s * a.dil_w), static_cast<uint16_t>(r * a.dil_h));
          if (++c == a.chunks) {
            c = 0, ++tap;
            if (++s == a.kW) s = 0, ++r;
          }
        }
      }
    }
    if (cm > 1) {  // no CTA leaves while the cluster's copies and arrivals may still target its shared memory
      wgmma::cluster_arrive();
      wgmma::cluster_wait();
    }
    return;
  }

  wgmma::setmaxnreg_inc<MC && BM == 64 ? 224 : 232>();
  // The consumer warpgroup's index through a shuffle, so the compiler sees it uniform (ptxas C7518).
  const int cw = __shfl_sync(kFullMask, wg - 1, 0), warp = (tid / 32) % 4, lane = tid % 32, tw_id = tid % 128;
  const int gq = lane >> 2, tig = lane & 3;
  const bool leader = warp == 0 && lane == 0;
  const uint32_t sOut = base + T::out_off + cw * T::wg_out_bytes;
  float4* ws = reinterpret_cast<float4*>(a.ws);
  uint32_t u = 0;
  // A consumed stage goes back to every CTA that writes into it: lane r of each consumer warp tells rank r.
  auto release = [&](int st) {
    if (cm == 1) {
      if (lane == 0) wgmma::mbar_arrive(empty(st));
    } else if (lane < cm) {
      wgmma::mbar_arrive_cluster(wgmma::cluster_map(empty(st), lane));
    }
  };
  CbsWalk walk = cbs_walk(a, G, g);
  for (CbsPart part; walk.next(a, part);) {
    const auto [tp, k0, k1] = part;
    const int64_t t = tile_of(tp);
    float acc[MB][NACC];
    int prev = -1;  // the stage whose products may still be reading shared memory
    for (int k = k0; k < k1; ++k, ++u) {
      const int st = static_cast<int>(u % S);
      wgmma::mbar_wait(full(st), (u / S) & 1);
      // K steps of 32 bytes in both operands' 128-byte rows: 16 channels (k16) or 8 float32 (k8, TF32).
      const uint64_t da = wgmma::desc_sw128(sA(st) + (BM == 64 ? 0 : cw * MB * 64 * 128), 16, 1024);
      const uint64_t db = wgmma::desc_sw128(sB(st) + (BM == 64 ? cw * T::WN * 128 : 0), 16, 1024);
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int mb = 0; mb < MB; ++mb) {  // the warpgroup's blocks of 64 pixels rows (64 x 128 bytes) apart
          const uint64_t dak = da + ((mb * 64 * 128 + kk * 32) >> 4), dbk = db + ((kk * 32) >> 4);
          const int scale = k > k0 || kk > 0;
          if constexpr (kTf32) {
            if constexpr (T::WN == 256) wgmma::mma_m64n256k8_tf32_ss(acc[mb], dak, dbk, scale);
            else if constexpr (T::WN == 160) wgmma::mma_m64n160k8_tf32_ss(acc[mb], dak, dbk, scale);
            else if constexpr (T::WN == 128) wgmma::mma_m64n128k8_tf32_ss(acc[mb], dak, dbk, scale);
            else wgmma::mma_m64n64k8_tf32_ss(acc[mb], dak, dbk, scale);
          } else {
            if constexpr (T::WN == 256) wgmma::mma_m64n256k16_ss<kBf16>(acc[mb], dak, dbk, scale);
            else if constexpr (T::WN == 160) wgmma::mma_m64n160k16_ss<kBf16>(acc[mb], dak, dbk, scale);
            else if constexpr (T::WN == 128) wgmma::mma_m64n128k16_ss<kBf16>(acc[mb], dak, dbk, scale);
            else wgmma::mma_m64n64k16_ss<kBf16>(acc[mb], dak, dbk, scale);
          }
        }
      }
      wgmma::commit();
      wgmma::wait<1>();  // the previous stage's products are done: hand it back
      if (prev >= 0) release(prev);
      prev = st;
    }
    wgmma::wait<0>();
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) wgmma::fence_regs(acc[mb]);
    if (prev >= 0) release(prev);

    // This warpgroup's slot of this CTA's partial sums: float4 j of block mb of thread i at (mb * NACC / 4 + j)
    // * 128 + i. (cluster g's CTA of rank `rank` where cm > 1.)
    auto slot = [&](int cta) {
      return ws + ((static_cast<int64_t>(cta) * cm + rank) * 2 + cw) * (MB * NACC / 4) * 128 + tw_id;
    };
    if (k0 > 0) {  // the tile's owner is an earlier CTA: hand it this part (only a CTA's first stream-K part can be)
      float4* dst = slot(g);
#pragma unroll
      for (int mb = 0; mb < MB; ++mb)
#pragma unroll
        for (int j = 0; j < NACC / 4; ++j)
          __stcg(dst + (mb * NACC / 4 + j) * 128,
                 make_float4(acc[mb][4 * j], acc[mb][4 * j + 1], acc[mb][4 * j + 2], acc[mb][4 * j + 3]));
      __threadfence();
      wgmma::named_sync(1 + cw, 128);
      if (leader) red_release_add(a.flags + 2 * t + cw, 1);
      continue;
    }
    if (k1 < a.iters) {  // the owner of a tile cut between CTAs: the later ones' parts
      const int64_t sk0 = cbs_sk0(a, G);  // (only stream-K tiles are cut)
      const int last = cbs_cta_of(tp * a.iters + a.iters - 1 - sk0, a.units - sk0, G);
      if (leader)
        while (ld_acquire(a.flags + 2 * t + cw) < last - g) __nanosleep(64);
      wgmma::named_sync(1 + cw, 128);
      for (int c = g + 1; c <= last; ++c) {
        const float4* src = slot(c);
#pragma unroll
        for (int mb = 0; mb < MB; ++mb)
#pragma unroll
          for (int j = 0; j < NACC / 4; ++j) {
            const float4 p = __ldcg(src + (mb * NACC / 4 + j) * 128);
            float* d = acc[mb] + 4 * j;
            d[0] += p.x, d[1] += p.y, d[2] += p.z, d[3] += p.w;
          }
      }
    }

    // Epilogue: s, b' and SiLU on each of the warpgroup's blocks of 64 pixels x WN channels, staged as the output
    // map's boxes (64 channels x BW pixels, 128-byte swizzle) and written by the copy engine while the
    // warpgroup goes on (to its next block or tile); the staging is refilled only after the copy engine has
    // read the previous boxes.
    const int nt = static_cast<int>(t % a.n_nt);
    const int64_t mw0 = (t / a.n_nt) * T::BM + (BM == 64 ? 0 : cw * MB * 64);  // the warpgroup's first pixel
    const int cn = nt * T::BN + (BM == 64 ? cw * T::WN : 0);                  // and channel
    // 16-bit: lane l holds (s, b') of channels cn + 32 c + l, all loaded at once; the stores below take each
    // quad's pair by shuffles. One load a channel pair in the loop below was one exposed L2 latency each (the
    // compiler kept no registers to batch them beside the accumulators): 160-channel tiles ran 12 % slower.
    static_assert(T::WN % 32 == 0, "whole warps of channels");
    float2 ssv[kTf32 ? 1 : T::WN / 32];
    if constexpr (!kTf32) {
#pragma unroll
      for (int c = 0; c < T::WN / 32; ++c) {
        const int ch = cn + 32 * c + lane;
        ssv[c] = ch < a.C_out ? a.scale_shift[ch] : make_float2(0.f, 0.f);
      }
    }
#pragma unroll
    for (int mb = 0; mb < MB; ++mb) {
      const int64_t mw = mw0 + mb * 64;  // the block's first pixel
      if (mw >= a.P) break;
      if constexpr (kTf32) {  // float32: each quad's 8 channels are 32 contiguous bytes of a pixel's row
#pragma unroll
        for (int j = 0; j < T::WN / 8; ++j) {
          const int co = cn + 8 * j + 2 * tig;
          if (co >= a.C_out) continue;
          // (s, b') of channels co and co + 1 (co even: 16-byte aligned)
          const float4 e = *reinterpret_cast<const float4*>(a.scale_shift + co);
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) {
            const int64_t p = mw + warp * 16 + gq + 8 * rr;
            float x0 = fmaf(acc[mb][4 * j + 2 * rr], e.x, e.y), x1 = fmaf(acc[mb][4 * j + 2 * rr + 1], e.z, e.w);
            if (a.silu) x0 = silu_fast(x0), x1 = silu_fast(x1);
            if (p < a.P) *reinterpret_cast<float2*>(a.out + p * a.C_out + co) = make_float2(x0, x1);
          }
        }
        continue;
      }
      // The block's first output box, found once (a 64-bit division) before any round holds the registers.
      const CbsPix q0 = cbs_pix(a, mw);
      const int segs = static_cast<int>(min(static_cast<int64_t>(64), a.P - mw)) / a.BW;
#pragma unroll
      for (int rd = 0; rd < T::rounds; ++rd) {  // blocks [rd, rd + 1) x round_blks (and the tail) a round
        if (leader) wgmma::bulk_wait_read();  // the copy engine has read the staging's previous boxes
        wgmma::named_sync(1 + cw, 128);
#pragma unroll
        for (int j = 0; j < T::WN / 8; ++j) {
          const int sb = j / 8 - rd * T::round_blks;  // the block's place in the staging
          if (j / 8 < T::full_blks && (sb < 0 || sb >= T::round_blks)) continue;  // another round's
          // channels cn + 8 j + 2 tig and the next from the lanes that loaded them (ssv[j / 4]: j is unrolled)
          const int l0 = (8 * j) % 32 + 2 * tig;
          const float s0 = __shfl_sync(kFullMask, ssv[j / 4].x, l0), b0 = __shfl_sync(kFullMask, ssv[j / 4].y, l0);
          const float s1 = __shfl_sync(kFullMask, ssv[j / 4].x, l0 + 1);
          const float b1 = __shfl_sync(kFullMask, ssv[j / 4].y, l0 + 1);
#pragma unroll
          for (int rr = 0; rr < 2; ++rr) {
            const int r = warp * 16 + gq + 8 * rr;  // the pixel row; r % 8 == gq
            float x0 = fmaf(acc[mb][4 * j + 2 * rr], s0, b0), x1 = fmaf(acc[mb][4 * j + 2 * rr + 1], s1, b1);
            if (a.silu) x0 = silu_fast(x0), x1 = silu_fast(x1);
            const uint32_t pk = pack_pair<scalar_t>(x0, x1);
            // 16-byte chunk j % 8 of the pixel's row, swizzled: 128-byte rows (chunk ^ row % 8), or in the
            // 32-channel block 64-byte rows (chunk ^ (row / 2) % 4)
            const uint32_t addr = j / 8 < T::full_blks
                                      ? sOut + sb * T::blk_bytes + r * 128 + (((j % 8) ^ gq) << 4) + 4 * tig
                                      : sOut + sb * T::blk_bytes + r * 64 + (((j % 8) ^ ((r >> 1) & 3)) << 4) + 4 * tig;
            asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(pk) : "memory");
          }
        }
        wgmma::fence_proxy_async();  // the generic-proxy writes above, before the copy engine reads them
        wgmma::named_sync(1 + cw, 128);
        if (leader) {
          const int b1 = rd + 1 < T::rounds ? (rd + 1) * T::round_blks : T::full_blks + (T::tail ? 1 : 0);
          for (int blk = rd * T::round_blks; blk < b1; ++blk) {
            const int c0 = cn + blk * 64;
            if (c0 >= a.C_out) break;
            const uint32_t sb = sOut + (blk - rd * T::round_blks) * T::blk_bytes;
            CbsPix q = q0;
            for (int seg = 0; seg < segs; ++seg) {
              if (blk < T::full_blks)
                wgmma::tma_store_4d(&to, sb + seg * a.BW * 128, c0, q.w, q.h, q.n);
              else
                wgmma::tma_store_4d(&to32, sb + seg * a.BW * 64, c0, q.w, q.h, q.n);
              cbs_next(a, q);
            }
          }
          wgmma::bulk_commit();
        }
      }
    }
  }
  // The copy engine must have finished with the staging buffers before the CTA's shared memory goes.
  if (tid % 128 == 0) wgmma::bulk_wait();
  if (cm > 1) {
    wgmma::cluster_arrive();
    wgmma::cluster_wait();
  }
#endif
}
#endif

// VD_CONV_BN_SILU_KERNEL: "cudnn" keeps the cuDNN convolution and the scale + bias + SiLU pass on Hopper too,
// "wgmma" takes the Hopper kernel wherever it applies (no choice by shape); benchmarks and tests compare
// them. VD_CONV_BN_SILU_TILE=128|160|256 pins the channel tile (of 128 pixels), 64x128|64x256 64-pixel tiles,
// 256x128 256-pixel tiles of 128 channels;
// VD_CONV_BN_SILU_CLUSTER=0 runs no clusters, =2..8 pins clusters of that many CTAs (other values: the choice).

#if defined(VD_SM90A)
// cm >= 2: clusters of cm CTAs on cm consecutive pixel tiles, the weight stage loaded once a cluster.
// wbatch > 1: f.weight holds wbatch weights, (wbatch, C_out, kH, kW, C_in), and image n of x is convolved with
// weight n (s.N == wbatch; no tile may span two images: H_out * W_out a multiple of the pixel tiles in a cluster).
template <int BN, int BM>
bool launch_conv_wgmma(const at::Tensor& x, const Folded& f, const ConvShape& s, bool silu, at::Tensor& y,
                       int cm = 1, int64_t wbatch = 1) {
  using T = CbsTile<BN, 2, BM>;  // the tile geometry is the same for all element sizes
  const int BK = 128 / static_cast<int>(x.element_size());
  const bool f32 = x.scalar_type() == at::kFloat;
  const at::Tensor& w = f.weight;
  const int64_t taps = s.kH * s.kW;
  const int BW = s.W_out % 64 == 0 ? 64 : s.W_out % 32 == 0 ? 32 : s.W_out % 16 == 0 ? 16 : 8;
  // The im2col walk: output position (w, h) reads input (w - pad + s dil, h - pad + r dil) at tap (r, s).
  const int lower[2] = {static_cast<int>(-s.padding[1]), static_cast<int>(-s.padding[0])};
  const int upper[2] = {static_cast<int>(s.padding[1] - (s.kW - 1) * s.dilation[1]),
                        static_cast<int>(s.padding[0] - (s.kH - 1) * s.dilation[0])};
  // The CTAs of a cluster that each multicast a slice of the weight rows (whole 8-row swizzle atoms).
  int bslices = cm >= 8 ? 8 : cm >= 4 ? 4 : cm >= 2 ? 2 : 1;
  while ((T::BN / 8) % bslices != 0) bslices /= 2;  // 160 channels: 20 atoms, 4 slices at most
  CUtensorMap tw, tx, to{}, to32{};
  if (!tensor_map_4d(&tw, w, {s.C_in, taps, s.C_out, wbatch}, {s.C_in, taps * s.C_in, s.C_out * taps * s.C_in},
                     {static_cast<uint32_t>(BK), 1, static_cast<uint32_t>(T::BN / bslices), 1}) ||
      !im2col_map_4d(&tx, x, {s.C_in, s.W, s.H, s.N}, {x.stride(3), x.stride(2), x.stride(0)}, lower, upper,
                     BK, T::BM))
    return false;
  if (!f32 &&  // float32 output is written from registers
      (!tensor_map_4d(&to, y, {s.C_out, s.W_out, s.H_out, s.N}, {y.stride(3), y.stride(2), y.stride(0)},
                     {64, static_cast<uint32_t>(BW), 1, 1}) ||
      !tensor_map_4d(&to32, y, {s.C_out, s.W_out, s.H_out, s.N}, {y.stride(3), y.stride(2), y.stride(0)},
                     {32, static_cast<uint32_t>(BW), 1, 1}, CU_TENSOR_MAP_SWIZZLE_64B)))
    return false;

  CbsArgs a{};
  a.scale_shift = reinterpret_cast<const float2*>(f.scale_shift.const_data_ptr<float>());
  a.out = f32 ? y.mutable_data_ptr<float>() : nullptr;
  a.P = s.N * s.H_out * s.W_out;
  a.n_nt = static_cast<int>(ceil_div(s.C_out, T::BN));
  a.chunks = static_cast<int>(ceil_div(s.C_in, BK));
  a.iters = static_cast<int>(taps) * a.chunks;
  a.kW = static_cast<int>(s.kW);
  // The tiles, counted in whole groups of cm pixel tiles (a last group's tiles past P compute zeros, unstored).
  const int64_t groups = ceil_div(ceil_div(a.P, T::BM), cm), tiles = groups * cm * a.n_nt;
  TORCH_INTERNAL_ASSERT(cm >= 1 && cm <= 8, "clusters of 1-8 CTAs");
  a.cm = cm;
  a.bslices = bslices;
  a.units = groups * a.n_nt * a.iters;
  a.C_out = static_cast<int>(s.C_out);
  a.H_out = static_cast<int>(s.H_out);
  a.W_out = static_cast<int>(s.W_out);
  a.BW = BW;
  a.pad_h = static_cast<int>(s.padding[0]);
  a.pad_w = static_cast<int>(s.padding[1]);
  a.dil_h = static_cast<int>(s.dilation[0]);
  a.dil_w = static_cast<int>(s.dilation[1]);
  a.silu = silu ? 1 : 0;
  a.wbatch = wbatch > 1 ? 1 : 0;
  TORCH_INTERNAL_ASSERT(wbatch == 1 || (wbatch == s.N && (s.H_out * s.W_out) % (cm * T::BM) == 0));

  auto stream = c10::cuda::getCurrentCUDAStream();
  auto launch = [&](auto kernel, size_t smem) {
    int64_t G = 0;  // clusters (CTAs where cm = 1)
    if (cm > 1) {
      int device = 0;
      C10_CUDA_CHECK(cudaGetDevice(&device));
      const int clusters = resident_clusters(kernel, cm, device, 384, smem);
      if (clusters == 0) return false;
      G = std::min<int64_t>(clusters, a.units);
    } else {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      G = persistent_blocks(kernel, 384, smem, a.units);
    }
    // All but the last one to two waves of tiles whole, data-parallel, the rest stream-K (the hybrid of the
    // stream-K paper); VD_CONV_BN_SILU_DP=0: stream-K over all tiles.
    const int64_t waves = groups * a.n_nt / G;
    a.dp = waves >= 2 && env_str("VD_CONV_BN_SILU_DP") != "0" ? waves - 1 : 0;
    // One partial slot a CTA (BM x BN floats), then the tiles' flags (zeroed on the stream: graph-safe).
    const int64_t slot_floats = static_cast<int64_t>(T::BM) * T::BN;
    at::Tensor ws = at::empty({G * cm * slot_floats + 2 * tiles}, x.options().dtype(at::kFloat));
    a.ws = ws.mutable_data_ptr<float>();
    a.flags = reinterpret_cast<int*>(a.ws + G * cm * slot_floats);
    C10_CUDA_CHECK(cudaMemsetAsync(a.flags, 0, 2 * tiles * sizeof(int), stream));
    launch_clusters(kConvBnSiluOp, kernel, a, G, cm, 384, smem, stream, tw, tx, to, to32);
    return true;
  };
  if (cm > 1) {
    if (f32) return launch(conv_bn_silu_wgmma_kernel<float, BN, BM, true>, CbsTile<BN, 4, BM>::smem_bytes);
    if (x.scalar_type() == at::kBFloat16)
      return launch(conv_bn_silu_wgmma_kernel<at::BFloat16, BN, BM, true>, T::smem_bytes);
    return launch(conv_bn_silu_wgmma_kernel<at::Half, BN, BM, true>, T::smem_bytes);
  }
  if (f32) return launch(conv_bn_silu_wgmma_kernel<float, BN, BM>, CbsTile<BN, 4, BM>::smem_bytes);
  if (x.scalar_type() == at::kBFloat16) return launch(conv_bn_silu_wgmma_kernel<at::BFloat16, BN, BM>, T::smem_bytes);
  return launch(conv_bn_silu_wgmma_kernel<at::Half, BN, BM>, T::smem_bytes);
}
#endif

#if defined(VD_SM90A)
// ---- Winograd F(2 x 2, 3 x 3) for 3 x 3 convolutions with padding 1 (stride and dilation 1) ----
// Each 2 x 2 block of outputs ("tile" p = (n, th, tw), P = N ceil(H / 2) ceil(W / 2) of them) is
// A^T [ (G g G^T) * (B^T d B) ] A summed over input channels, d the 4 x 4 input patch at (2 th - 1, 2 tw - 1) and g
// the 3 x 3 weight: 16 products a tile where the direct convolution takes 36. The 16 positions k = 4 i + j of the
// transformed patch are 16 independent GEMMs, M_k (P x C_out) = V_k (P x C_in) U_k^T, U_k (C_out x C_in), run
// as one launch of the implicit-GEMM kernel above with the 16 as its images (a 1 x 1 convolution, each image with
// its own weight). Three passes: V from x, the products, y = silu(s A^T M A + b') from M. The transforms are
// additions (B, A: 0 / +-1; G: +-1/2, exact), in float32; V and U are rounded to the operand type (16-bit, or
// TF32 to nearest in float32), M is written in x's dtype. The rows of each V_k and M_k are padded to Pb, a
// multiple of the GEMM's pixel tiles, so no tile spans two products; V's padding rows are zeros.
// Error: relative RMS about 2.5x the exactly rounded result's in bf16 / fp16 (bench/notes/conv.md).

template <typename scalar_t>
__device__ __forceinline__ scalar_t to_operand(float f) {
  if constexpr (std::is_same_v<scalar_t, float>) return __uint_as_float(tf32_of(f));
  else return static_cast<scalar_t>(f);
}

// U (16, C_out, C_in) from w (C_out, C_in, 3, 3), any strides: u_k = (G g G^T)_ij with rows of G
// (1, 0, 0), (1/2, 1/2, 1/2), (1/2, -1/2, 1/2), (0, 0, 1).
template <typename scalar_t>
__global__ void wino_weight_kernel(const scalar_t* __restrict__ w, int64_t s0, int64_t s1, int64_t s2, int64_t s3,
                                   scalar_t* __restrict__ u, int64_t C_out, int64_t C_in) {
  const int64_t n = C_out * C_in, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const int64_t co = i / C_in, ci = i - co * C_in;
    const scalar_t* g = w + co * s0 + ci * s1;
    float t[4][3];  // G g
#pragma unroll
    for (int c = 0; c < 3; ++c) {
      const float g0 = static_cast<float>(g[c * s3]), g1 = static_cast<float>(g[s2 + c * s3]);
      const float g2 = static_cast<float>(g[2 * s2 + c * s3]);
      t[0][c] = g0, t[1][c] = 0.5f * (g0 + g1 + g2), t[2][c] = 0.5f * (g0 - g1 + g2), t[3][c] = g2;
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const float v[4] = {t[r][0], 0.5f * (t[r][0] + t[r][1] + t[r][2]), 0.5f * (t[r][0] - t[r][1] + t[r][2]),
                          t[r][2]};
#pragma unroll
      for (int c = 0; c < 4; ++c) u[((4 * r + c) * C_out + co) * C_in + ci] = to_operand<scalar_t>(v[c]);
    }
  }
}

// V (16, Pb, C) from x (N, H, W, C) channels_last: a thread does 4 channels of one tile (8- or 16-byte loads
// and stores, coalesced along the channels); B^T d B: (d0 - d2, d1 + d2, d2 - d1, d1 - d3) along each axis.
// The 16 loads are issued together from clamped addresses and the padding zeroed after. This pass writes 4x
// what it reads: with plain stores it ran at ~2.2 TB/s (bf16, H200; the output pass, reading 4x what it writes,
// at ~4); streaming stores (st.global.cs) took 7-9 % off the whole call (conv_tiles_*_20261129T0721*:
// 28 x 1280 x 18 x 32 bf16 469 -> 437 us, float32 1043 -> 946; 9 x 16 bf16 150 -> 138). V stored tile-major
// (Pb, 16, C_in), each thread's 16 stores contiguous, gained nothing there (470, 1040, 152).
template <typename scalar_t>
__global__ void wino_input_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ v, int64_t P, int64_t Pb,
                                  int64_t C, int H, int W, int TH, int TW) {
  using V4 = Vec<scalar_t, 4>;
  const int64_t cg = C / 4, n_items = Pb * cg, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_items; i += stride) {
    const int64_t p = i / cg, c = (i - p * cg) * 4;
    const bool live = p < P;  // rows past P: zeros (read from tile 0, then masked)
    const int64_t pl = live ? p : 0;
    const int64_t n = pl / (static_cast<int64_t>(TH) * TW);
    const int r = static_cast<int>(pl - n * TH * TW), th = r / TW, tw = r - th * TW;
    int rows[4], cols[4];
    bool rv[4], cv[4];
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int h = 2 * th - 1 + a, w = 2 * tw - 1 + a;
      rv[a] = live && h >= 0 && h < H, cv[a] = w >= 0 && w < W;
      rows[a] = min(max(h, 0), H - 1), cols[a] = min(max(w, 0), W - 1);
    }
    V4 e[4][4];
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int b = 0; b < 4; ++b)
        e[a][b] = *reinterpret_cast<const V4*>(x + ((n * H + rows[a]) * W + cols[b]) * C + c);
    float t[4][4][4];  // [row of the patch][column of B^T d B along the row][channel]
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        float d[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) d[b] = rv[a] && cv[b] ? static_cast<float>(e[a][b].v[q]) : 0.f;
        t[a][0][q] = d[0] - d[2], t[a][1][q] = d[1] + d[2], t[a][2][q] = d[2] - d[1], t[a][3][q] = d[1] - d[3];
      }
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      V4 o[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float t0 = t[0][b][q], t1 = t[1][b][q], t2 = t[2][b][q], t3 = t[3][b][q];
        o[0].v[q] = to_operand<scalar_t>(t0 - t2), o[1].v[q] = to_operand<scalar_t>(t1 + t2);
        o[2].v[q] = to_operand<scalar_t>(t2 - t1), o[3].v[q] = to_operand<scalar_t>(t1 - t3);
      }
#pragma unroll
      for (int a = 0; a < 4; ++a) {  // streaming stores (evict first): see above
        scalar_t* dst = v + ((4 * a + b) * Pb + p) * C + c;
        if constexpr (sizeof(V4) == 16) __stcs(reinterpret_cast<uint4*>(dst), *reinterpret_cast<const uint4*>(&o[a]));
        else __stcs(reinterpret_cast<uint2*>(dst), *reinterpret_cast<const uint2*>(&o[a]));
      }
    }
  }
}

// y (N, H, W, C) channels_last from M (16, Pb, C): A^T m A with A^T rows (1, 1, 1, 0), (0, 1, -1, -1), then
// s, b' and SiLU (scale_shift: (s, b') pairs by channel); outputs past H or W (odd sizes) are not stored.
template <typename scalar_t>
__global__ void wino_output_kernel(const scalar_t* __restrict__ m, scalar_t* __restrict__ y,
                                   const float4* __restrict__ scale_shift, int64_t P, int64_t Pb, int64_t C, int H,
                                   int W, int TH, int TW, bool silu) {
  using V4 = Vec<scalar_t, 4>;
  const int64_t cg = C / 4, n_items = P * cg, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n_items; i += stride) {
    const int64_t p = i / cg, c = (i - p * cg) * 4;
    float s[2][4][4];  // A^T m: [output row][column of m][channel]
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      float e[4][4];
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        const V4 v = *reinterpret_cast<const V4*>(m + ((4 * a + b) * Pb + p) * C + c);
#pragma unroll
        for (int q = 0; q < 4; ++q) e[a][q] = static_cast<float>(v.v[q]);
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) s[0][b][q] = e[0][q] + e[1][q] + e[2][q], s[1][b][q] = e[1][q] - e[2][q] - e[3][q];
    }
    const float4 ss01 = scale_shift[c / 2], ss23 = scale_shift[c / 2 + 1];
    const float sc[4] = {ss01.x, ss01.z, ss23.x, ss23.z}, sh[4] = {ss01.y, ss01.w, ss23.y, ss23.w};
    const int64_t n = p / (static_cast<int64_t>(TH) * TW);
    const int r = static_cast<int>(p - n * TH * TW), th = r / TW, tw = r - th * TW;
#pragma unroll
    for (int a = 0; a < 2; ++a) {
      const int h = 2 * th + a;
      if (h >= H) break;
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const int wc = 2 * tw + b;
        if (wc >= W) break;
        V4 o;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const float z = b == 0 ? s[a][0][q] + s[a][1][q] + s[a][2][q] : s[a][1][q] - s[a][2][q] - s[a][3][q];
          const float zz = fmaf(z, sc[q], sh[q]);
          o.v[q] = static_cast<scalar_t>(silu ? silu_fast(zz) : zz);
        }
        *reinterpret_cast<V4*>(y + ((n * H + h) * W + wc) * C + c) = o;
      }
    }
  }
}

// fn(scalar_t()) for the Winograd path's types: fp16, bf16, float32 (TF32).
template <typename Fn>
void wino_dispatch(at::ScalarType t, Fn&& fn) {
  if (t == at::kHalf) fn(at::Half());
  else if (t == at::kBFloat16) fn(at::BFloat16());
  else if (t == at::kFloat) fn(float());
  else TORCH_INTERNAL_ASSERT(false, "conv_bn_silu: the Winograd path takes fp16, bf16 or float32");
}

// P: the 2 x 2 blocks of outputs (the Winograd tiles).
inline int64_t wino_blocks(const ConvShape& s) { return s.N * ceil_div(s.H_out, 2) * ceil_div(s.W_out, 2); }

// Pb: the tile rows of each product padded to whole GEMM tiles: 128 rows where C_out is a multiple of 256
// (tiles of 128 x 256, run in pairs where Pb is a multiple of 256), else 256 (tiles of 256 x 128).
inline int64_t wino_rows(const ConvShape& s) {
  const int64_t unit = s.C_out % 256 == 0 ? 128 : 256;
  return ceil_div(wino_blocks(s), unit) * unit;
}

// Whether the Winograd path can run: 3 x 3, padding 1, stride and dilation 1 (the caller has checked groups,
// layout, dtype and alignment), C_out a multiple of 128 (the GEMM's channel tiles), the counts within the
// GEMM's 32-bit coordinates, and V and M (16 Pb (C_in + C_out) elements) under 8 GiB.
inline bool wino_possible(const ConvShape& s, int64_t es, int64_t c_out_unit = 128) {
  if (s.kH != 3 || s.kW != 3 || s.padding[0] != 1 || s.padding[1] != 1 || s.dilation[0] != 1 ||
      s.dilation[1] != 1 || s.H_out != s.H || s.W_out != s.W || s.C_out % c_out_unit != 0 || s.C_in % 8 != 0)
    return false;
  const int64_t Pb = wino_rows(s), kMax = std::numeric_limits<int>::max() / 2;
  return Pb <= kMax && s.H <= kMax && s.W <= kMax && 16 * Pb * (s.C_in + s.C_out) * es <= (int64_t{8} << 30);
}

// By shape (unpinned): where the products are most of the work (the transforms move ~16 (C_in + C_out) bytes a
// tile for 32 C_in C_out products) and fill the GPU: C_in and C_out of 1024 or more and at least 1024 tiles (2048
// in float32). H200, device us, Winograd against the direct path (conv_tiles_*_20261129T0656*): bf16
// 28 x 1280 x 18 x 32 (4032 tiles) 476 against 594, 28 x 1280 x 9 x 16 (1120) 165 against 167, 28 x 640 x 36 x 64
// 667 against 608; float32 (TF32) 1013 against 1345, 339 against 302, 1340 against 1223.
// Under CUDA-graph capture nothing is cached and every replay transforms the weight again (reads the weight,
// writes 16/9 of it: 82 MB at 1280 channels in bf16), so 16-bit needs 2048 tiles there too: graphs of
// 28 x 1280 x 9 x 16 (1120 tiles) bf16 ran 0.1959 ms against inductor's 0.1871 (ops_bf16_…T071226), the direct
// kernel 0.1924 against 0.1911 (version 8's run); at 4032 tiles 0.5624 against 0.7123.
inline bool wino_wanted(const ConvShape& s, bool fp32, bool capturing) {
  const int64_t tiles = wino_blocks(s);
  return s.C_in >= 1024 && s.C_out >= 1024 && tiles >= (fp32 || capturing ? 2048 : 1024);
}

// U for f.weight (cached like the fold: by the weight's identity and version, not under capture or where the
// call may be training) and the GEMM's (s, b') = (1, 0) pairs.
std::pair<at::Tensor, at::Tensor> wino_weight(const at::Tensor& x, const at::Tensor& w) {
  auto make = [&] {
    const int64_t C_out = w.size(0), C_in = w.size(1);
    at::Tensor u = at::empty({16, C_out, C_in}, w.options().memory_format(at::MemoryFormat::Contiguous));
    at::Tensor ones = at::stack({at::ones({C_out}, x.options().dtype(at::kFloat)),
                                 at::zeros({C_out}, x.options().dtype(at::kFloat))}, 1);
    auto stream = c10::cuda::getCurrentCUDAStream();
    wino_dispatch(w.scalar_type(), [&](auto z) {
      using scalar_t = decltype(z);
      wino_weight_kernel<scalar_t><<<grid_for(C_out * C_in, 256), 256, 0, stream>>>(
          w.const_data_ptr<scalar_t>(), w.stride(0), w.stride(1), w.stride(2), w.stride(3),
          u.mutable_data_ptr<scalar_t>(), C_out, C_in);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
    return FoldValue{u, at::Tensor(), at::Tensor(), ones.contiguous()};
  };
  const FoldValue v = cached_weight_copy(conv_wino_cache(), x, w, 0.0, make);
  return {v.weight, v.scale_shift};
}

// V (16, Pb, C_in) from x by wino_input_kernel on the current stream (both Winograd paths' first pass).
at::Tensor wino_input(const at::Tensor& x, const ConvShape& s, int64_t Pb) {
  const int64_t TH = ceil_div(s.H, 2), TW = ceil_div(s.W, 2);
  at::Tensor v = at::empty({16, Pb, s.C_in}, x.options().memory_format(at::MemoryFormat::Contiguous));
  auto stream = c10::cuda::getCurrentCUDAStream();
  wino_dispatch(x.scalar_type(), [&](auto z) {
    using scalar_t = decltype(z);
    wino_input_kernel<scalar_t><<<grid_for(Pb * (s.C_in / 4), 256), 256, 0, stream>>>(
        x.const_data_ptr<scalar_t>(), v.mutable_data_ptr<scalar_t>(), wino_blocks(s), Pb, s.C_in,
        static_cast<int>(s.H), static_cast<int>(s.W), static_cast<int>(TH), static_cast<int>(TW));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return v;
}

at::Tensor conv_bn_silu_winograd(const at::Tensor& x, const Folded& f, const ConvShape& s, bool silu) {
  const int64_t TH = ceil_div(s.H, 2), TW = ceil_div(s.W, 2), P = wino_blocks(s), Pb = wino_rows(s);
  const auto [u, ones] = wino_weight(x, f.weight);
  const at::Tensor v = wino_input(x, s, Pb);
  at::Tensor m = at::empty({16, Pb, s.C_out}, x.options().memory_format(at::MemoryFormat::Contiguous));
  // The products as a 1 x 1 convolution of 16 images of 1 x Pb pixels (V and M as channels_last NCHW views).
  ConvShape g = s;
  g.N = 16, g.H = g.H_out = 1, g.W = g.W_out = Pb, g.kH = g.kW = 1;
  g.padding = {0, 0}, g.stride = {1, 1}, g.dilation = {1, 1};
  const at::Tensor vx = v.as_strided({16, s.C_in, 1, Pb}, {Pb * s.C_in, 1, Pb * s.C_in, s.C_in});
  at::Tensor my = m.as_strided({16, s.C_out, 1, Pb}, {Pb * s.C_out, 1, Pb * s.C_out, s.C_out});
  Folded fg;
  fg.weight = u;
  fg.scale_shift = ones;
  at::Tensor y = at::empty({s.N, s.C_out, s.H, s.W}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  auto stream = c10::cuda::getCurrentCUDAStream();
  bool ok = true;
  wino_dispatch(x.scalar_type(), [&](auto z) {
    using scalar_t = decltype(z);
    // 256-channel tiles where C_out fills them, in pairs (the direct kernel's choice at 28 x 1280) where Pb
    // allows and clusters are not turned off (VD_CONV_BN_SILU_CLUSTER=0); else tiles of 256 pixels x 128 channels.
    const bool pairs = Pb % 256 == 0 && env_str("VD_CONV_BN_SILU_CLUSTER") != "0";
    ok = s.C_out % 256 == 0 ? launch_conv_wgmma<256, 128>(vx, fg, g, false, my, pairs ? 2 : 1, 16)
                            : launch_conv_wgmma<128, 256>(vx, fg, g, false, my, 1, 16);
    if (!ok) return;
    wino_output_kernel<scalar_t><<<grid_for(P * (s.C_out / 4), 256), 256, 0, stream>>>(
        m.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(),
        reinterpret_cast<const float4*>(f.scale_shift.const_data_ptr<float>()), P, Pb, s.C_out,
        static_cast<int>(s.H), static_cast<int>(s.W), static_cast<int>(TH), static_cast<int>(TW), silu);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return ok ? y : at::Tensor();
}

// ---- Winograd F(2 x 2, 3 x 3) with the output transform in the products' kernel ----
// The three-pass path above writes M (16 products a tile, 4x y's bytes) and reads it back: in float32 that is
// 2 x 335 MB at 28 x 1280 x 18 x 32, and its GEMM's epilogue (K = C_in only) is not overlapped. Here one CTA
// computes all 16 products of its 128 tiles x 64 output channels in turn, each into a temporary accumulator
// (K = C_in), and adds it with the signs of A^T (.) A into the four outputs' accumulators, kept in registers
// (4 x 32 + 32 floats a thread); then s, b' and SiLU, and y is stored. M never leaves the SM. The 64-channel
// tiles (m64n64 products) read A (V's tile rows) twice as often a product as 128-channel ones; V's stage is
// loaded once a cluster of cm CTAs on neighbouring channel tiles (multicast), so a CTA reads 128 / cm + 64 rows
// from L2 a K step.
struct WfArgs {
  const float2* scale_shift;  // (s, b') of each output channel
  void* out;                  // y (N, H, W, C_out) channels_last, x's dtype
  int64_t P;                  // tiles of 2 x 2 outputs
  int H, W, TH, TW;           // output size and tiles along each
  int C_out, n_nt, chunks, cm;
  int silu;
  // The tail: CTAs from `whole` on take the last `rem` tiles in two halves of K (CTA whole + h * rem + r: half h
  // of tile whole + r). Each half stores its sums (part_sums) and counts itself (part_count, zeroed); the second
  // to finish adds the other's and runs the epilogue.
  int64_t whole;
  int rem;
  float4* part_sums;
  int* part_count;
};
__device__ __forceinline__ int atom_add_acq_rel(int* p, int v) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], %2;\n" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
}

template <typename scalar_t>
struct WfTile {
  static constexpr int BM = 128, BN = 64, BK = 128 / static_cast<int>(sizeof(scalar_t));
  static constexpr int a_bytes = BM * 128, b_bytes = BN * 128, stage_bytes = a_bytes + b_bytes;
  static constexpr int kStages = 8;
  static constexpr int bar_off = kStages * stage_bytes;
  static constexpr size_t smem_bytes = bar_off + 16 * kStages + 16 + 1024;  // + the halves' flags, + slack to align
};

// fn(std::integral_constant<int, 0>), ..., fn(std::integral_constant<int, N - 1>): a loop whose index is a
// compile-time constant in each copy.
template <typename Fn, int... I>
__device__ __forceinline__ void static_for_(Fn&& fn, std::integer_sequence<int, I...>) {
  (fn(std::integral_constant<int, I>()), ...);
}
template <int N, typename Fn>
__device__ __forceinline__ void static_for(Fn&& fn) {
  static_for_(fn, std::make_integer_sequence<int, N>());
}

// A^T's rows (1, 1, 1, 0) and (0, 1, -1, -1): the sign product k = 4 i + j adds to output (r, c) with.
__host__ __device__ constexpr int wf_sign(int r, int c, int k) {
  constexpr int at[2][4] = {{1, 1, 1, 0}, {0, 1, -1, -1}};
  return at[r][k / 4] * at[c][k % 4];
}

template <typename scalar_t, bool MC>
__global__ void __launch_bounds__(384, 1)
    wino_fused_kernel(const WfArgs a, const __grid_constant__ CUtensorMap tv, const __grid_constant__ CUtensorMap tu) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = WfTile<scalar_t>;
  constexpr int S = T::kStages;
  constexpr bool kBf16 = std::is_same_v<scalar_t, at::BFloat16>, kTf32 = std::is_same_v<scalar_t, float>;
  extern __shared__ __align__(16) unsigned char wf_smem[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(wf_smem)), base = (raw + 1023u) & ~1023u;
  const uint32_t bar = base + T::bar_off;
  auto sA = [&](int st) { return base + st * T::stage_bytes; };
  auto sB = [&](int st) { return base + st * T::stage_bytes + T::a_bytes; };
  auto full = [&](int st) { return bar + 8 * st; };
  auto empty = [&](int st) { return bar + 8 * (S + st); };
  // CTA b < whole: tile b; else half h of tile whole + r (see WfArgs). Tile t: pixel tile t / n_nt, channel tile
  // t % n_nt; a cluster is cm neighbouring channel tiles (n_nt, whole and rem multiples of cm).
  const int tid = threadIdx.x, wg = tid / 128, cm = MC ? a.cm : 1, rank = MC ? blockIdx.x % cm : 0;
  // (half, r) are found again where needed: kept live through the products, they spilled.
  auto tail = [&](int& half, int& r) {
    half = -1, r = 0;
    if (blockIdx.x < a.whole) return;
    half = static_cast<int>((blockIdx.x - a.whole) / a.rem), r = static_cast<int>((blockIdx.x - a.whole) % a.rem);
  };
  int half, r;
  tail(half, r);
  const int64_t tile = half < 0 ? blockIdx.x : a.whole + r;
  const int c0 = half == 1 ? a.chunks / 2 : 0, c1 = half == 0 ? a.chunks / 2 : a.chunks;
  const int64_t pt = tile / a.n_nt;
  const int nt = static_cast<int>(tile % a.n_nt);
  if (tid == 0) wgmma::init_stage_ring(bar, S, 8 * cm);  // empty: every consumer warp of the cluster
  if (cm > 1) {
    wgmma::cluster_arrive();
    wgmma::cluster_wait();
  } else {
    __syncthreads();
  }

  if (wg == 0) {
    wgmma::setmaxnreg_dec<40>();
    if (tid == 0) {
      const int arows = T::BM / cm;  // the rows of V's stage this CTA loads for the cluster
      uint32_t u = 0;
#pragma unroll 1
      for (int k = 0; k < 16; ++k)
#pragma unroll 1
        for (int c = c0; c < c1; ++c, ++u) {
          const int st = static_cast<int>(u % S);
          wgmma::mbar_wait(empty(st), ((u / S) & 1) ^ 1u);
          wgmma::mbar_expect_tx(full(st), T::stage_bytes);
          wgmma::tma_load_4d(sB(st), &tu, full(st), c * T::BK, nt * T::BN, k, 0);
          if (cm == 1)
            wgmma::tma_load_4d(sA(st), &tv, full(st), c * T::BK, static_cast<int>(pt * T::BM), k, 0);
          else
            wgmma::tma_load_4d_multicast(sA(st) + rank * arows * 128, &tv, full(st), c * T::BK,
                                         static_cast<int>(pt * T::BM) + rank * arows, k, 0,
                                         static_cast<uint16_t>((1u << cm) - 1));
        }
    }
    if (cm > 1) {  // no CTA leaves while the cluster's copies and arrivals may still target its shared memory
      wgmma::cluster_arrive();
      wgmma::cluster_wait();
    }
    return;
  }

  wgmma::setmaxnreg_inc<232>();
  const int cw = __shfl_sync(kFullMask, wg - 1, 0), warp = (tid / 32) % 4, lane = tid % 32;
  const int gq = lane >> 2, tig = lane & 3;
  auto release = [&](int st) {
    if (cm == 1) {
      if (lane == 0) wgmma::mbar_arrive(empty(st));
    } else if (lane < cm) {
      wgmma::mbar_arrive_cluster(wgmma::cluster_map(empty(st), lane));
    }
  };
  const int n_c = c1 - c0;  // the K steps of each product
  float y[4][32], acc[32];  // y[2 r + c]: output (r, c) of each tile; acc: the current product
#pragma unroll
  for (int q = 0; q < 4; ++q)
#pragma unroll
    for (int e = 0; e < 32; ++e) y[q][e] = 0.f;
  uint32_t u = 0;
  static_for<16>([&](auto kc) {
    constexpr int k = decltype(kc)::value;
    int prev = -1;
#pragma unroll 1
    for (int c = 0; c < n_c; ++c, ++u) {
      const int st = static_cast<int>(u % S);
      wgmma::mbar_wait(full(st), (u / S) & 1);
      const uint64_t da = wgmma::desc_sw128(sA(st) + cw * 64 * 128, 16, 1024);
      const uint64_t db = wgmma::desc_sw128(sB(st), 16, 1024);
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {  // 32-byte K steps of the 128-byte rows
        const uint64_t dak = da + ((kk * 32) >> 4), dbk = db + ((kk * 32) >> 4);
        const int scale = c > 0 || kk > 0;
        if constexpr (kTf32) wgmma::mma_m64n64k8_tf32_ss(acc, dak, dbk, scale);
        else wgmma::mma_m64n64k16_ss<kBf16>(acc, dak, dbk, scale);
      }
      wgmma::commit();
      wgmma::wait<1>();
      if (prev >= 0) release(prev);
      prev = st;
    }
    wgmma::wait<0>();
    wgmma::fence_regs(acc);
    if (prev >= 0) release(prev);
    static_for<4>([&](auto qc) {
      constexpr int q = decltype(qc)::value, sg = wf_sign(q / 2, q % 2, k);
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        if constexpr (sg > 0) y[q][e] += acc[e];
        else if constexpr (sg < 0) y[q][e] -= acc[e];
      }
    });
  });

  // A half of a tail tile: store this warpgroup's sums, count; the second half to get here adds the other's
  // (x + y == y + x: the result does not depend on which) and runs the epilogue, the first is done.
  bool finish = true;
  tail(half, r);
  if (half >= 0) {
    const int tw = tid % 128;
    auto sums = [&](int h) { return a.part_sums + ((static_cast<int64_t>(r) * 2 + h) * 2 + cw) * 32 * 128 + tw; };
    float4* mine = sums(half);
#pragma unroll
    for (int j = 0; j < 32; ++j)  // float4 j: y[j / 8][4 (j % 8) ...]
      __stcg(mine + j * 128, make_float4(y[j / 8][4 * (j % 8)], y[j / 8][4 * (j % 8) + 1], y[j / 8][4 * (j % 8) + 2],
                                         y[j / 8][4 * (j % 8) + 3]));
    __threadfence();
    wgmma::named_sync(1 + cw, 128);
    volatile int* flag = reinterpret_cast<volatile int*>(wf_smem + (bar + 16 * S - raw)) + cw;
    if (tw == 0) *flag = atom_add_acq_rel(a.part_count + 2 * r + cw, 1);
    wgmma::named_sync(1 + cw, 128);
    finish = *flag == 1;
    if (finish) {
      const float4* other = sums(1 - half);
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        const float4 o = __ldcg(other + j * 128);
        y[j / 8][4 * (j % 8)] += o.x, y[j / 8][4 * (j % 8) + 1] += o.y;
        y[j / 8][4 * (j % 8) + 2] += o.z, y[j / 8][4 * (j % 8) + 3] += o.w;
      }
    }
  }

  // Epilogue: thread (warp, gq, tig) holds tiles warp * 16 + gq + 8 rr of the warpgroup's 64 and channels
  // 8 j + 2 tig (+ 1) of the 64; each quad's 8 channels are contiguous in a pixel's row.
  const int64_t t0 = ((half < 0 ? blockIdx.x : a.whole + r) / a.n_nt) * T::BM + cw * 64 + warp * 16 + gq;
  int64_t pix[2][4];  // the row (element offset / C_out) of output (r, c) of each of the thread's two tiles; -1: none
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int64_t t = t0 + 8 * rr;
    const int64_t n = t / (static_cast<int64_t>(a.TH) * a.TW);
    const int ti = static_cast<int>(t - n * a.TH * a.TW), th = ti / a.TW, tw = ti - th * a.TW;  // in the image
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int h = 2 * th + q / 2, w = 2 * tw + q % 2;
      pix[rr][q] = t < a.P && h < a.H && w < a.W ? (n * a.H + h) * a.W + w : -1;
    }
  }
  scalar_t* out = static_cast<scalar_t*>(a.out);
#pragma unroll
  for (int j = 0; j < 8 && finish; ++j) {
    const int co = nt * T::BN + 8 * j + 2 * tig;
    const float4 e = *reinterpret_cast<const float4*>(a.scale_shift + co);  // (s, b') of co and co + 1
#pragma unroll
    for (int rr = 0; rr < 2; ++rr)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (pix[rr][q] < 0) continue;
        float x0 = fmaf(y[q][4 * j + 2 * rr], e.x, e.y), x1 = fmaf(y[q][4 * j + 2 * rr + 1], e.z, e.w);
        if (a.silu) x0 = silu_fast(x0), x1 = silu_fast(x1);
        scalar_t* dst = out + pix[rr][q] * a.C_out + co;
        if constexpr (kTf32) *reinterpret_cast<float2*>(dst) = make_float2(x0, x1);
        else *reinterpret_cast<uint32_t*>(dst) = pack_pair<scalar_t>(x0, x1);
      }
  }
  if (cm > 1) {
    wgmma::cluster_arrive();
    wgmma::cluster_wait();
  }
#endif
}

// Clusters of the fused kernel: VD_CONV_WINO_FUSED_CLUSTER=1|2|4 pins (where the channel tiles divide into them,
// else the next smaller); by shape pairs where the channel tiles are even and there are 16 or more pixel tiles,
// else none. H200, float32, us a call (conv_tiles_fp32_…T083047), clusters of 4 / 2 / 1: 28 x 1280 x 18 x 32 (32
// pixel tiles) 987 / 918 / 984; 28 x 640 x 36 x 64 (126) - / 1033 / 1125; 28 x 1280 x 9 x 16 (9) 326 / 332 / 281.
inline int wf_cluster(int64_t n_pt, int64_t n_nt) {
  const std::string pin = env_str("VD_CONV_WINO_FUSED_CLUSTER");
  const int want = pin == "1" ? 1 : pin == "2" ? 2 : pin == "4" ? 4 : n_pt >= 16 ? 2 : 1;
  for (int cm = want; cm > 1; cm /= 2)
    if (n_nt % cm == 0) return cm;
  return 1;
}

// The fused kernel's last round in halves of K: its tiles (tiles mod resident) where they fill at most half the
// resident CTAs, else 0. At 28 x 1280 x 9 x 16 (180 tiles on 132 SMs) a whole tile took 130 us in the first round
// and 108 in the second, of 48 tiles: the halves cut the call from 271 to 239 us (H200, conv_tiles_fp32_…T095803).
inline int64_t wf_halved(int64_t tiles, int64_t resident) {
  const int64_t rem = tiles % resident;
  return 2 * rem <= resident ? rem : 0;
}

// By shape (unpinned; float32 as TF32): C_in and C_out of 640 or more and a grid, the last round in halves of K
// (see conv_bn_silu_winograd_fused), of at least half the SMs; under CUDA-graph capture, where the weight is
// transformed in every replay, also 1024 tiles of 2 x 2 outputs or more. H200, us a call against the op's choice
// without it (conv_tiles_fp32_…T100233): 2 x 1280 x 18 x 32 (60 tiles, 120 CTAs) 89.7 against the direct kernel's
// 111.1; 2 x 640 x 36 x 64 (90) 80.6 against 105.3; 14 x 1280 x 9 x 16 (100) 132.2 against cuDNN's 163.6; but 2 x 1280
// x 9 x 16 (20 tiles, 40 CTAs) 78.8 against 49.1 (ops_fp32_…T100318). Graphs (same JSON): 28 x 1280 x 9 x 16 (1120
// tiles of 2 x 2) 0.3085 ms against cuDNN's 0.3415; 2 x 1280 x 18 x 32 (288) 0.1466 against the direct kernel's
// 0.1175. 16-bit stays on the three-pass path: m64n64k16 products ask shared memory for twice the bytes a clock that
// it delivers (bf16, conv_tiles_bf16_…T083102, clusters of 4 / 2 / 1 against the op's choice: 558 / 497 / 513
// against 438; - / 616 / 625 against 611; 180 / 183 / 152 against 138).
inline bool wf_wanted(const ConvShape& s, bool capturing) {
  const int64_t blocks = wino_blocks(s), sms = sm_count();
  const int64_t tiles = ceil_div(blocks, 128) * (s.C_out / 64);
  return s.C_in >= 640 && s.C_out >= 640 && 2 * (tiles + wf_halved(tiles, sms)) >= sms &&
         (!capturing || blocks >= 1024);
}

// The fused path (see above): V from x, then one kernel for the products, the output transform, s, b' and SiLU.
// Needs C_out a multiple of 64. Returns an undefined tensor where a cluster cannot be placed.
at::Tensor conv_bn_silu_winograd_fused(const at::Tensor& x, const Folded& f, const ConvShape& s, bool silu) {
  using T = WfTile<float>;  // BM and BN are the same for all element sizes
  const int64_t TH = ceil_div(s.H, 2), TW = ceil_div(s.W, 2), P = wino_blocks(s), Pb = ceil_div(P, T::BM) * T::BM;
  const int64_t n_nt = s.C_out / T::BN, es = x.element_size(), BK = 128 / es;
  const at::Tensor u = wino_weight(x, f.weight).first;
  const at::Tensor v = wino_input(x, s, Pb);
  at::Tensor y = at::empty({s.N, s.C_out, s.H, s.W}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  const int cm = wf_cluster(Pb / T::BM, n_nt);
  CUtensorMap tv, tu;
  if (!tensor_map_4d(&tv, v, {s.C_in, Pb, 16, 1}, {s.C_in, Pb * s.C_in, 16 * Pb * s.C_in},
                     {static_cast<uint32_t>(BK), static_cast<uint32_t>(T::BM / cm), 1, 1}) ||
      !tensor_map_4d(&tu, u, {s.C_in, s.C_out, 16, 1}, {s.C_in, s.C_out * s.C_in, 16 * s.C_out * s.C_in},
                     {static_cast<uint32_t>(BK), static_cast<uint32_t>(T::BN), 1, 1}))
    return {};
  WfArgs a{};
  a.scale_shift = reinterpret_cast<const float2*>(f.scale_shift.const_data_ptr<float>());
  a.out = y.mutable_data_ptr();
  a.P = P;
  a.H = static_cast<int>(s.H), a.W = static_cast<int>(s.W), a.TH = static_cast<int>(TH), a.TW = static_cast<int>(TW);
  a.C_out = static_cast<int>(s.C_out);
  a.n_nt = static_cast<int>(n_nt);
  a.chunks = static_cast<int>(ceil_div(s.C_in, BK));
  a.cm = cm;
  a.silu = silu ? 1 : 0;
  auto stream = c10::cuda::getCurrentCUDAStream();
  bool ok = true;
  wino_dispatch(x.scalar_type(), [&](auto z) {
    using scalar_t = decltype(z);
    auto launch = [&](auto kernel) {
      const size_t smem = WfTile<scalar_t>::smem_bytes;
      const int64_t resident = resident_clusters(kernel, cm, x.get_device(), 384, smem) * cm;
      const int64_t tiles = Pb / T::BM * n_nt;
      if (resident == 0) return false;
      // The last round in halves (wf_halved) where its tiles make whole clusters and C_in two K steps or more;
      // VD_CONV_WINO_FUSED_SPLIT=0: whole.
      const int64_t rem = wf_halved(tiles, resident);
      const bool split = env_str("VD_CONV_WINO_FUSED_SPLIT") != "0" && rem > 0 && rem % cm == 0 && a.chunks >= 2;
      at::Tensor sums, count;
      a.whole = split ? tiles - rem : tiles;
      a.rem = split ? static_cast<int>(rem) : 1;
      if (split) {
        sums = at::empty({rem * 2 * 2 * 32 * 128 * 4}, x.options().dtype(at::kFloat));
        count = at::zeros({rem * 2}, x.options().dtype(at::kInt));
        a.part_sums = reinterpret_cast<float4*>(sums.data_ptr<float>());
        a.part_count = count.data_ptr<int>();
      }
      launch_clusters(kConvBnSiluOp, kernel, a, (tiles + (split ? rem : 0)) / cm, cm, 384, smem, stream, tv, tu);
      return true;
    };
    ok = cm > 1 ? launch(wino_fused_kernel<scalar_t, true>) : launch(wino_fused_kernel<scalar_t, false>);
  });
  return ok ? y : at::Tensor();
}
#endif

// The Hopper kernel for fp16 / bf16 channels_last x, or float32 where cuDNN's convolutions may run TF32
// (torch.backends.cudnn.allow_tf32, on by default: eager's float32 convolution runs TF32 then too), groups
// 1, stride 1, C_in and C_out multiples of 8 (16-byte rows for the copy engine) and W_out a multiple of 8
// (whole output boxes). Returns an undefined tensor where the cuDNN path is used instead.
at::Tensor conv_bn_silu_wgmma(const at::Tensor& x, const Folded& f, const ConvShape& s, bool silu) {
#if defined(VD_SM90A)
  const auto dt = x.scalar_type();
  const std::string choice = env_str("VD_CONV_BN_SILU_KERNEL");
  const bool tf32 = dt == at::kFloat && at::globalContext().allowTF32CuDNN();
  if ((dt != at::kHalf && dt != at::kBFloat16 && !tf32) || !s.channels_last || s.groups != 1 || s.stride[0] != 1 ||
      s.stride[1] != 1 || s.C_in % 8 != 0 || s.C_out % 8 != 0 || choice == "cudnn" || !device_is_sm90a())
    return {};
  const at::Tensor& w = f.weight;
  if (!x.is_contiguous(at::MemoryFormat::ChannelsLast) || !w.is_contiguous(at::MemoryFormat::ChannelsLast) ||
      w.scalar_type() != dt || !aligned16(x.const_data_ptr()) || !aligned16(w.const_data_ptr()) ||
      !f.scale_shift.defined() || !aligned16(f.scale_shift.const_data_ptr()))
    return {};
  const std::string tile = env_str("VD_CONV_BN_SILU_TILE"), cluster = env_str("VD_CONV_BN_SILU_CLUSTER");
  // Winograd F(2 x 2, 3 x 3) by shape where nothing is pinned (VD_CONV_BN_SILU_ALGO=winograd: wherever it can
  // run; =direct: never).
  // =winograd_fused: its fused variant wherever that can run (C_out a multiple of 64); by shape, float32 only.
  const std::string algo = env_str("VD_CONV_BN_SILU_ALGO");
  const bool by_shape = choice.empty() && tile.empty() && algo.empty();
  const bool capturing = stream_capturing();
  if ((algo == "winograd_fused" || (by_shape && tf32 && wf_wanted(s, capturing))) &&
      wino_possible(s, x.element_size(), 64)) {
    at::Tensor y = conv_bn_silu_winograd_fused(x, f, s, silu);
    if (y.defined()) return y;
  }
  if (algo != "direct" && algo != "winograd_fused" && wino_possible(s, x.element_size()) &&
      (algo == "winograd" || (by_shape && wino_wanted(s, tf32, capturing)))) {
    at::Tensor y = conv_bn_silu_winograd(x, f, s, silu);
    if (y.defined()) return y;
  }
  if (s.W_out % 8 != 0) return {};  // the direct kernel stores whole boxes of 8 pixels or more
  const int64_t kMax = std::numeric_limits<int>::max() / 2;
  if (s.W + s.W_out > kMax || s.H + s.H_out > kMax || s.N > kMax || s.C_in > kMax || s.C_out > kMax ||
      s.kH * s.kW * ceil_div(s.C_in, 32) > kMax || s.padding[0] > kMax || s.padding[1] > kMax ||
      s.dilation[0] * s.kH > 65535 || s.dilation[1] * s.kW > 65535)
    return {};  // the copy engine's coordinates and the loop counters are 32-bit, the im2col offsets 16-bit
  // Chosen by shape unless pinned. Fewer than 8 pixel tiles of 128 cut each tile between several CTAs.
  // With 3-4 of them (2 x 1280 x 9 x 16: 288 pixels), 64-pixel tiles of 256 channels (bf16 on the H200: 33.6
  // us against 40.2 for cuDNN's convolution with the bias + SiLU pass; at 384 pixels 35.1 against 45.6); with
  // fewer they tie with cuDNN, with more cuDNN was ahead (768 pixels: 37.4 against 45.7-51.4 us): cuDNN there,
  // and where C_out is not a multiple of 256. float32 there only in clusters (without: 60.2 against cuDNN's 54.5).
  // Otherwise the channel tile: 256 where C_out fills it (m64n256k16: the least shared-memory traffic a
  // product), else 160 where C_out is a multiple of 160 (320, 640: no empty columns), else 128; where a last
  // 128-channel tile would be at most half full, cuDNN again.
  // With 2-8 pixel tiles of 64, the CTAs of one channel tile's pixel tiles run as a cluster and load each weight
  // stage once (multicast; VD_CONV_BN_SILU_CLUSTER=0 turns it off): the weight, re-read from L2 by every pixel
  // tile, held them to ~6 TB/s of L2 reads. In clusters (H200, 1280 channels, device us against cuDNN's path):
  // 16-bit at 3-8 such tiles (144-512 pixels) 23.1-33.4 against 24.2-46.2; float32 at 3-5 (144, 288 pixels)
  // 37.5 / 45.4 against 45.3 / 56.1, at 6 and 8 behind or level (52.9 / 55.9 against 47.1 / 57.0), at 2 behind
  // (36.2 against 30.4): cuDNN there.
  // With 8 or more tiles of 128, pairs of neighbouring pixel tiles run as clusters (each weight stage loaded
  // once a pair) where that measured ahead (H200, 2-28 images of 72x128 .. 8x8, device us): float32 at every
  // tile (2 x 640 x 36 x 64: 103-106 against 117-119 alone; 28 x 1280 x 18 x 32: 1273 against 1464), 16-bit
  // at 256 channels (8 x 1280 x 18 x 32: 184 against 190; 28 x: 620 against 647); 16-bit 160-channel tiles
  // within 3 % either way: alone. 256-channel problems of 8-15 such tiles run 64-pixel tiles in pairs where
  // those pairs (x channel tiles) fill at most 3/4 of a wave of pairs in 16-bit; in float32 at most 1/2, or 3/4
  // at an odd count of tiles of 128 (whose pairs of 128 x 256 leave a tenth of their work past the pixels):
  // 2 x 1280 x 18 x 32 (9 tiles, 45 of 66 pairs) bf16 59.2 against 62.6 in pairs of 128 x 256, float32 109.5
  // against 119.3; 2 x 512 x 24 x 32 (24) bf16 22.6 against 28.2, float32 34.1 against 39.9; behind at
  // 2 x 1280 x 24 x 32 (12 tiles, 60: bf16 75.0 against 69.1, float32 136.9 against 125.3), float32 2 x 1280 x 16
  // x 32 (8 tiles, 40: 111.4 against 95.7), and past a wave (3 x 1280 x 18 x 32, 70: bf16 92.6 against 79.8).
  // Where C_out is an odd multiple of 128 (384, 640, ...) and the tiles of 256 x 128 fill two waves or more,
  // those (each warpgroup two m64 products a K step: twice the work a stage for its fixed cost), alone:
  // 28 x 640 x 36 x 64 bf16 619.5 against 652.5 us for 160-channel tiles, float32 1218.0 against 1305.8;
  // 14 x 640 x 36 x 64 317.8 against 339.1, float32 625.9 against 672.5; at 320 channels (a last tile of 64
  // channels) behind, at 1280 behind 128 x 256 pairs.
  const int64_t tiles128 = ceil_div(s.N * s.H_out * s.W_out, 128), tiles64 = ceil_div(s.N * s.H_out * s.W_out, 64);
  const bool few = tiles128 < 8, clusters = cluster != "0";
  const bool take_few = s.C_out % 256 == 0 && (tf32       ? clusters && tiles64 >= 3 && tiles64 <= 5
                                               : clusters ? tiles64 >= 3 && tiles64 <= 8
                                                          : tiles128 >= 3 && tiles128 <= 4);
  if (choice != "wgmma" && tile.empty() && few && !take_few) return {};
  // float32 at multiples of 256 channels from 14 tiles of 128: cuDNN's TF32 convolution (256 x 128 x 32 tiles)
  // was ahead (H200, device us, the cuDNN path against our best tile): 28 x 1280 x 18 x 32 1147 against 1229,
  // 28 x 1280 x 9 x 16 302 against 330, 3 x 1280 x 18 x 32 145.5 against 157.5; at 9-12 tiles behind
  // (2 x 1280 x 18 x 32: 172.5 against 109.5, 2 x 1280 x 24 x 32: 172.3 against 125.3).
  if (choice != "wgmma" && tile.empty() && tf32 && s.C_out % 256 == 0 && tiles128 >= 14) return {};
  const bool pinned64 = tile.rfind("64x", 0) == 0;
  const int64_t mid_units = ceil_div(tiles64, 2) * (s.C_out / 256), wave = sm_count() / 2;  // pairs
  const bool mid = clusters && tile.empty() && s.C_out % 256 == 0 && tiles128 >= 8 && tiles128 < 16 &&
                   (tf32 && tiles128 % 2 == 0 ? 2 * mid_units <= wave : 4 * mid_units <= 3 * wave);
  const bool small = pinned64 || (tile.empty() && (few || mid));  // 64-pixel tiles
  const bool wide = tile == "256x128" || (tile.empty() && !small && s.C_out >= 384 && s.C_out % 256 == 128 &&
                                          ceil_div(tiles128, 2) * (s.C_out / 128) >= 2 * sm_count());
  const std::string tn = pinned64 ? tile.substr(3) : wide ? "128" : tile;
  const int bn = tn == "128" || tn == "256" || (tn == "160" && !small) ? std::stoi(tn)
                 : s.C_out % 256 == 0                                ? 256
                 : s.C_out % 160 == 0 && !small                      ? 160
                                                                     : 128;
  if (choice != "wgmma" && bn == 128 && s.C_out > 128 && s.C_out % 128 != 0 && s.C_out % 128 <= 64) return {};
  at::Tensor y = at::empty({s.N, s.C_out, s.H_out, s.W_out}, x.options().memory_format(at::MemoryFormat::ChannelsLast));
  // VD_CONV_BN_SILU_CLUSTER=2..8 pins clusters of that many pixel tiles (at most the pixel tiles) at any size
  // the kernel runs (the choice may still pick cuDNN: VD_CONV_BN_SILU_KERNEL=wgmma forces the kernel).
  const int pin = cluster.size() == 1 && cluster[0] >= '2' && cluster[0] <= '8' ? cluster[0] - '0' : 0;
  const int64_t ptiles = small ? tiles64 : wide ? ceil_div(tiles128, 2) : tiles128;
  const bool pairs = mid || (!small && !wide && clusters && tile.empty() && (tf32 || bn == 256));
  const int cm = pin > 0                                          ? static_cast<int>(std::min<int64_t>(pin, ptiles))
                 : small && clusters && tiles64 >= 2 && tiles64 <= 8 ? static_cast<int>(tiles64)
                 : pairs                                             ? 2
                                                                     : 1;
  const bool ok = wide        ? launch_conv_wgmma<128, 256>(x, f, s, silu, y, cm)
                  : small     ? (bn == 256 ? launch_conv_wgmma<256, 64>(x, f, s, silu, y, cm)
                                           : launch_conv_wgmma<128, 64>(x, f, s, silu, y, cm))
                  : bn == 256 ? launch_conv_wgmma<256, 128>(x, f, s, silu, y, cm)
                  : bn == 160 ? launch_conv_wgmma<160, 128>(x, f, s, silu, y, cm)
                              : launch_conv_wgmma<128, 128>(x, f, s, silu, y, cm);
  return ok ? y : at::Tensor();
#else
  (void)x, (void)f, (void)s, (void)silu;
  return {};
#endif
}

at::Tensor conv_bn_silu_cuda(const at::Tensor& x, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, const at::Tensor& bn_weight,
                             const at::Tensor& bn_bias, const at::Tensor& bn_mean,
                             const at::Tensor& bn_var, double eps, at::IntArrayRef stride,
                             at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups,
                             bool silu) {
  c10::cuda::CUDAGuard guard(x.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const FoldCachePolicy policy{!stream_capturing(), static_cast<int64_t>(stream.id()), keep_outside_pools,
                               bn_vectors_cuda};
  return conv_bn_silu_forward(x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps, stride,
                              padding, dilation, groups, silu, bias_act_cuda_, conv_bn_silu_wgmma, policy);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv_bn_silu_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& bn_weight, const at::Tensor& bn_bias,
    const at::Tensor& bn_mean, const at::Tensor& bn_var, double eps, at::IntArrayRef stride,
    at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups, bool silu) {
  c10::cuda::CUDAGuard guard(x.device());
  return conv_bn_silu_backward(grad_out, x, weight, bias, bn_weight, bn_bias, bn_mean, bn_var, eps,
                               stride, padding, dilation, groups, silu, grad_z_cuda_);
}

}  // namespace

TORCH_LIBRARY_IMPL(vd, CUDA, m) {
  m.impl("conv_bn_silu", &conv_bn_silu_cuda);
  m.impl("conv_bn_silu_backward", &conv_bn_silu_backward_cuda);
}

}  // namespace vd
