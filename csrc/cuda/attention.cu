// CUDA kernels for vd::fused_attention, vd::strided_attention and their backward.
//
// out = softmax(q k^T * scale + mask) v over (B, H, L, D), lse = logsumexp of the scaled, masked
// scores (natural log). q / k / v / grad_out / out are read through their strides, the mask through
// its expanded (stride-0 broadcast) view. A fully masked row gives out = 0, lse = -inf and no
// gradient. strided_attention runs the same kernels on the k[:, :, ::stride] / v[:, :, ::stride]
// views, and its backward writes dk / dv through the matching views of zero-filled gradients.
//
// Forward, these kernels:
//   short: fp16/bf16 with q_len, kv_len <= 32 (temporal attention over frames): a warp per (b, h)
//         problem, tensor cores, the next problem prefetched with cp.async; memory-bound by design. On
//         Hopper without a mask at head_dim <= 64 the copy engine moves the problems instead (short_tma).
//   rows: a block per (b, h, 16 query rows), key/value tiles of 32 staged in shared memory, a warp
//         per query row with one key per lane and the online softmax in registers. Serves
//         float32/float64, head dims that are not multiples of 8 and the short cases above misses.
//   mma:  flash-style tiles (64 queries x 64 keys, 32 keys for head_dim > 128) for fp16/bf16 on the
//         tensor cores (mma.sync m16n8k16, float accumulators), K/V tiles double-buffered with
//         cp.async. Serves long sequences off Hopper, and head_dim > 128.
//   wgmma: the same loop on Hopper (sm_90a builds on compute capability 9.0, head_dim <= 128):
//         warpgroup MMA, K/V streamed by the bulk tensor copy engine from a producer warp.
//   tf32: float32 on the tensor cores as three TF32 products (float32-level accuracy): the mma.sync
//         loop and a short kernel (compute capability 8.0+), and on Hopper a wgmma kernel (head_dim <= 64).
//         Short float32 problems of 17-32 rows run plain FMA on the CUDA cores instead (a warp a problem).
// Backward, recomputing P from lse:
//   short: fp16/bf16 with q_len, kv_len <= 32 and head_dim <= 128, % 8 == 0: a warp per (b, h)
//         problem, tensor cores, one launch;
//   fused: fp16/bf16 with head_dim <= 64 on Hopper: a prep kernel (delta), one kernel for all five
//         products (tiles of 192 keys x 64 queries or 128 x 128, whichever pads less), a finish kernel;
//   wgmma: fp16/bf16 with head_dim <= 128 and % 8 == 0 on Hopper (the deterministic pair): one kernel
//         for dq (which also computes delta = rowsum(dO * O) - grad_lse) and one for dk / dv, warpgroup
//         MMA fed by the bulk tensor copy engine;
// otherwise one kernel for delta, then
//   mma:  fp16/bf16 with head_dim <= 128 and % 8 == 0: tensor cores, one kernel for dq (a block per
//         64 query rows) and one for dk / dv (a block per 64 key rows);
//   rows: everything else: one kernel for dq (a warp per query row) and one for dk / dv (a warp per
//         key row) on the CUDA cores.
// Deterministic except the fused Hopper backward, whose dq sums by atomic adds (deterministic mode and
// VD_ATTENTION_BACKWARD=pair run the pair instead).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>

#include "../attention.h"
#include "hopper.h"
#include "launch.h"
#include "wgmma.h"

namespace vd {
namespace {

constexpr const char* kFusedOp = "vd::fused_attention";
constexpr const char* kFusedBwdOp = "vd::fused_attention_backward";
constexpr const char* kStridedOp = "vd::strided_attention";
constexpr const char* kStridedBwdOp = "vd::strided_attention_backward";

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// "rows" kernels: 4 warps x 4 rows = 16 rows per block; tiles of 32 rows of the other operand.
constexpr int kRowThreads = 128;
constexpr int kRowWarps = kRowThreads / 32;
constexpr int kRowsPerWarp = 4;
constexpr int kRowBlock = kRowWarps * kRowsPerWarp;
constexpr int kTile = 32;

template <typename T>
__device__ __forceinline__ T neg_inf() {
  return -std::numeric_limits<T>::infinity();
}
// 2^x in one MUFU op (flushes subnormal results to 0; 2^-inf = 0): the softmax's exponentials.
__device__ __forceinline__ float ex2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float exp_(float x) { return expf(x); }
__device__ __forceinline__ double exp_(double x) { return exp(x); }
__device__ __forceinline__ float log_(float x) { return logf(x); }
__device__ __forceinline__ double log_(double x) { return log(x); }

template <typename T>
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

// A (B, H, L, D) operand read (or written) through its strides, in elements. vec: rows can be read
// in 16-byte vectors (unit stride along D, D and the other strides multiples of the vector, aligned).
template <typename T>
struct View4 {
  T* p;
  int64_t sb, sh, sl, sd;
  bool vec;
  __device__ __forceinline__ T* head(int64_t b, int64_t h) const { return p + b * sb + h * sh; }
};

template <typename T>
View4<T> view_of(const at::Tensor& t) {
  T* p;
  if constexpr (std::is_const_v<T>) p = t.const_data_ptr<std::remove_const_t<T>>();
  else p = t.mutable_data_ptr<T>();
  constexpr int64_t V = 16 / sizeof(T);
  bool vec = t.stride(3) == 1 && t.size(3) % V == 0 && reinterpret_cast<uintptr_t>(p) % 16 == 0;
  for (int i = 0; i < 3; ++i) vec = vec && (t.size(i) == 1 || t.stride(i) % V == 0);
  return {p, t.stride(0), t.stride(1), t.stride(2), t.stride(3), vec};
}

enum MaskKind : int { kNoMask = 0, kBoolMask = 1, kFloatMask = 2, kInputTypeMask = 3 };

// The expanded (B, H, Lq, Lk) mask; bool True = keep, float masks are added to the scores.
struct MaskView {
  const void* p;
  int kind;
  int64_t sb, sh, sq, sk;
};

// Additive value of the mask at element offset off (relative to p).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ acc_t mask_add(const MaskView& m, int64_t off) {
  if (m.kind == kBoolMask) return static_cast<const bool*>(m.p)[off] ? acc_t(0) : neg_inf<acc_t>();
  if (m.kind == kFloatMask) return static_cast<acc_t>(static_cast<const float*>(m.p)[off]);
  return static_cast<acc_t>(static_cast<const scalar_t*>(m.p)[off]);
}

template <typename scalar_t, typename acc_t>
struct AttnArgs {
  View4<const scalar_t> q, k, v;
  View4<const scalar_t> dout, o;  // backward: grad_out and the forward's out
  MaskView mask;
  scalar_t* out;                  // forward: contiguous (B, H, Lq, D)
  acc_t* lse_out;                 // forward: (B, H, Lq); nullptr from short_forward when compute_lse=False
  const acc_t* lse;               // backward: contiguous (B, H, Lq)
  const acc_t* grad_lse;          // backward: contiguous (B, H, Lq) or nullptr
  acc_t* delta;                   // backward: rowsum(dO * O) - grad_lse, (B, H, Lq)
  scalar_t* dq;                   // backward: contiguous (B, H, Lq, D)
  float* lse_delta;               // backward, Hopper pair: (lse in log2 units, delta) a query, (B * H, Lq_pad)
  int64_t Lq_pad;                 // Lq rounded up to 64 (128: WgFusedPairTile); the padding holds (+inf, 0)
  View4<scalar_t> dk, dv;         // backward: written through their strides
  int64_t B, H, Lq, Lk;
  int D;
  int ld;  // row stride of the "rows" kernels' shared-memory tiles
  acc_t scale;
};

// Shared-memory rows of the "rows" kernels hold acc_t with a row stride ld (host: smem_ld) whose
// 16-byte vectors map an 8-lane phase onto distinct banks when each lane reads its own row.
// Dot products over nv 16-byte vectors; the columns past D up to the vector are zero.
__device__ __forceinline__ float dot(const float* __restrict__ a, const float* __restrict__ b, int nv) {
  const float4* a4 = reinterpret_cast<const float4*>(a);
  const float4* b4 = reinterpret_cast<const float4*>(b);
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  for (int i = 0; i < nv; ++i) {
    const float4 x = a4[i], y = b4[i];
    s0 += x.x * y.x;
    s1 += x.y * y.y;
    s2 += x.z * y.z;
    s3 += x.w * y.w;
  }
  return (s0 + s1) + (s2 + s3);
}
__device__ __forceinline__ double dot(const double* __restrict__ a, const double* __restrict__ b, int nv) {
  const double2* a2 = reinterpret_cast<const double2*>(a);
  const double2* b2 = reinterpret_cast<const double2*>(b);
  double s0 = 0.0, s1 = 0.0;
  for (int i = 0; i < nv; ++i) {
    const double2 x = a2[i], y = b2[i];
    s0 += x.x * y.x;
    s1 += x.y * y.y;
  }
  return s0 + s1;
}

// Stages rows [r0, min(r0 + rows, L)) of a (b, h) slice into shared memory as acc_t (row stride ld)
// and zeroes the columns from D to the next 16-byte vector. Rows past L are left alone: no lane
// reads them.
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void stage_rows(acc_t* dst, int ld, const View4<const scalar_t>& t, const scalar_t* src,
                                           int64_t r0, int rows, int64_t L, int D) {
  const int n = static_cast<int>(L - r0 < rows ? L - r0 : rows);
  constexpr int V = 16 / sizeof(scalar_t);
  if (t.vec) {
    const int cpr = D / V;
    for (int e = threadIdx.x; e < n * cpr; e += blockDim.x) {
      const int r = e / cpr, c = e - r * cpr;
      const Vec<scalar_t, V> raw = *reinterpret_cast<const Vec<scalar_t, V>*>(src + (r0 + r) * t.sl + c * V);
#pragma unroll
      for (int j = 0; j < V; ++j) dst[r * ld + c * V + j] = static_cast<acc_t>(raw.v[j]);
    }
  } else {
    for (int e = threadIdx.x; e < n * D; e += blockDim.x) {
      const int r = e / D, d = e - r * D;
      dst[r * ld + d] = static_cast<acc_t>(src[(r0 + r) * t.sl + d * t.sd]);
    }
  }
  constexpr int V2 = 16 / sizeof(acc_t);
  const int pad = (D + V2 - 1) / V2 * V2 - D;
  for (int e = threadIdx.x; e < n * pad; e += blockDim.x) dst[(e / pad) * ld + D + e % pad] = acc_t(0);
}

// Dynamic shared memory, aligned for any acc_t.
__device__ __forceinline__ unsigned char* dyn_smem() {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  return smem_raw;
}

// ---------------------------------------------------------------------------------------------
// Forward, "rows" kernel. DPL: output dims per lane (head_dim <= 32 * DPL).
template <typename scalar_t, typename acc_t, int DPL>
__global__ void __launch_bounds__(kRowThreads) attn_fwd_rows_kernel(const AttnArgs<scalar_t, acc_t> a) {
  const int D = a.D, ld = a.ld, nv = (D * static_cast<int>(sizeof(acc_t)) + 15) / 16;
  acc_t* Qs = reinterpret_cast<acc_t*>(dyn_smem());  // [kRowBlock][ld]
  acc_t* Ks = Qs + kRowBlock * ld;                    // [kTile][ld]: lane j reads row j
  acc_t* Vs = Ks + kTile * ld;                        // [kTile][ld]

  const int64_t nqb = (a.Lq + kRowBlock - 1) / kRowBlock;
  const int64_t bh = blockIdx.x / nqb, q0 = (blockIdx.x % nqb) * kRowBlock;
  const int64_t b = bh / a.H, h = bh % a.H;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const scalar_t* qh = a.q.head(b, h);
  const scalar_t* kh = a.k.head(b, h);
  const scalar_t* vh = a.v.head(b, h);
  const int64_t moff = b * a.mask.sb + a.mask.sh * h;

  stage_rows(Qs, ld, a.q, qh, q0, kRowBlock, a.Lq, D);

  acc_t m[kRowsPerWarp], l[kRowsPerWarp], o[kRowsPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    m[r] = neg_inf<acc_t>();
    l[r] = 0;
#pragma unroll
    for (int t = 0; t < DPL; ++t) o[r][t] = 0;
  }

  for (int64_t k0 = 0; k0 < a.Lk; k0 += kTile) {
    const int nk = static_cast<int>(a.Lk - k0 < kTile ? a.Lk - k0 : kTile);
    __syncthreads();  // the previous tile is no longer read
    stage_rows(Ks, ld, a.k, kh, k0, kTile, a.Lk, D);
    stage_rows(Vs, ld, a.v, vh, k0, kTile, a.Lk, D);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int row = warp * kRowsPerWarp + r;
      const int64_t i = q0 + row;
      if (i >= a.Lq) continue;  // uniform per warp
      acc_t s = neg_inf<acc_t>();
      if (lane < nk) {
        s = dot(Qs + row * ld, Ks + lane * ld, nv) * a.scale;
        if (a.mask.kind != kNoMask) s += mask_add<scalar_t, acc_t>(a.mask, moff + i * a.mask.sq + (k0 + lane) * a.mask.sk);
      }
      const acc_t m_new = max(m[r], warp_max(s));
      // A row with no finite score so far keeps m = -inf; exponentiate against 0 to avoid inf - inf.
      const acc_t m_use = m_new == neg_inf<acc_t>() ? acc_t(0) : m_new;
      const acc_t p = exp_(s - m_use);
      const acc_t corr = exp_(m[r] - m_use);
      m[r] = m_new;
      l[r] = l[r] * corr + warp_sum(p);
#pragma unroll
      for (int t = 0; t < DPL; ++t) o[r][t] *= corr;
      for (int j = 0; j < nk; ++j) {
        const acc_t pj = __shfl_sync(kFullMask, p, j);
        const acc_t* vr = Vs + j * ld;
#pragma unroll
        for (int t = 0; t < DPL; ++t) {
          const int d = lane + 32 * t;
          if (d < D) o[r][t] += pj * vr[d];
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t i = q0 + warp * kRowsPerWarp + r;
    if (i >= a.Lq) continue;
    const acc_t inv = l[r] > acc_t(0) ? acc_t(1) / l[r] : acc_t(0);
    scalar_t* orow = a.out + (bh * a.Lq + i) * D;
#pragma unroll
    for (int t = 0; t < DPL; ++t) {
      const int d = lane + 32 * t;
      if (d < D) orow[d] = static_cast<scalar_t>(o[r][t] * inv);
    }
    if (lane == 0) a.lse_out[bh * a.Lq + i] = l[r] > acc_t(0) ? m[r] + log_(l[r]) : neg_inf<acc_t>();
  }
}

// ---------------------------------------------------------------------------------------------
// Forward, tensor-core kernel (fp16 / bf16). Needs head_dim % 8 == 0, unit stride along D and
// 16-byte aligned rows (the host makes a copy otherwise). DP: head_dim padded to 64 / 128 / 256.

// From a shared-space address (the copy-engine kernels address their slots that way) or a pointer.
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) { ldmatrix_x4(r, smem_addr(p)); }
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) { ldmatrix_x4_trans(r, smem_addr(p)); }

template <typename scalar_t>
struct MmaTraits;

template <>
struct MmaTraits<at::BFloat16> {
  static __device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&v);
  }
};

template <>
struct MmaTraits<at::Half> {
  static __device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static __device__ __forceinline__ unsigned pack(float lo, float hi) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&v);
  }
};

// Epilogue of the tensor-core kernels. This thread holds rows row0 and row0 + 8 in the m16n8
// accumulator layout: columns 8j + 2 tig and + 1 of them in o[4j + 2rr] and o[4j + 2rr + 1] (rr: which
// row), their running max m_r (log2 units) and partial sums l_r, which the 4 lanes of its quad add up.
// Writes out / l (0 for an empty row) into the contiguous output and lse (natural log).
template <typename scalar_t, int N>
__device__ __forceinline__ void store_rows(const AttnArgs<scalar_t, float>& a, const float (&o)[N], const float (&m_r)[2],
                                           const float (&l_r)[2], int64_t bh, int64_t row0, int tig) {
  using MT = MmaTraits<scalar_t>;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    float l = l_r[rr];
    l += __shfl_xor_sync(kFullMask, l, 1);
    l += __shfl_xor_sync(kFullMask, l, 2);
    const int64_t row = row0 + rr * 8;
    if (row >= a.Lq) continue;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    scalar_t* orow = a.out + (bh * a.Lq + row) * a.D;
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
      const int d = j * 8 + 2 * tig;
      if (d < a.D) {  // D even: d + 1 < D too, and the pair is aligned
        if constexpr (std::is_same_v<scalar_t, float>) {
          *reinterpret_cast<float2*>(orow + d) = make_float2(o[4 * j + 2 * rr] * inv, o[4 * j + 2 * rr + 1] * inv);
        } else {
          *reinterpret_cast<unsigned*>(orow + d) = MT::pack(o[4 * j + 2 * rr] * inv, o[4 * j + 2 * rr + 1] * inv);
        }
      }
    }
    if (tig == 0) a.lse_out[bh * a.Lq + row] = l > 0.f ? (m_r[rr] + log2f(l)) * kLn2 : neg_inf<float>();
  }
}

// Scores of a tile of 8 NT keys in the m16n8 accumulator layout, in log2 units: scaled, the mask added
// (rows past Lq read none), keys at or past Lk at -inf; mx gets this thread's maxima of its two rows.
template <typename scalar_t, int NT>
__device__ __forceinline__ void scale_mask_scores(const AttnArgs<scalar_t, float>& a, float (&s)[NT][4], float (&mx)[2],
                                                  int64_t key0, int64_t row0, int64_t moff, float sl2, int tig) {
  mx[0] = mx[1] = neg_inf<float>();
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t key = key0 + j * 8 + 2 * tig + (e & 1);
      const int64_t row = row0 + (e >> 1) * 8;
      float x = s[j][e] * sl2;
      if (key >= a.Lk) {
        x = neg_inf<float>();
      } else if (a.mask.kind != kNoMask && row < a.Lq) {
        x += mask_add<scalar_t, float>(a.mask, moff + row * a.mask.sq + key * a.mask.sk) * kLog2e;
      }
      s[j][e] = x;
      mx[e >> 1] = fmaxf(mx[e >> 1], x);
    }
  }
}

// Online-softmax step for this thread's two rows: the quad's tile maxima mx update the running max m_r;
// corr rescales the old sums l_r (here) and outputs (caller); the exponentials subtract m_use, which is
// 0 while a row has no finite score (so fully masked rows give exp2(-inf) = 0, never NaN).
__device__ __forceinline__ void online_max(float (&mx)[2], float (&m_r)[2], float (&l_r)[2], float (&corr)[2],
                                           float (&m_use)[2]) {
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(kFullMask, mx[rr], 1));
    mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(kFullMask, mx[rr], 2));
    const float m_new = fmaxf(m_r[rr], mx[rr]);
    m_use[rr] = m_new == neg_inf<float>() ? 0.f : m_new;
    corr[rr] = exp2f(m_r[rr] - m_use[rr]);
    m_r[rr] = m_new;
    l_r[rr] *= corr[rr];
  }
}

constexpr int kMmaThreads = 128;  // 4 warps x 16 query rows
constexpr int kMmaRows = 64;

template <int DP>
struct MmaTile {
  static constexpr int BM = kMmaRows;
  static constexpr int BN = DP <= 128 ? 64 : 32;  // keys per tile
  static constexpr int LDS = DP + 8;              // padded row: ldmatrix rows fall in distinct banks
  static constexpr size_t smem_bytes = static_cast<size_t>(BM + 4 * BN) * LDS * 2;  // Q + 2 x (K, V)
};

template <typename scalar_t, int DP>
__global__ void __launch_bounds__(kMmaThreads) attn_fwd_mma_kernel(const AttnArgs<scalar_t, float> a) {
  using T = MmaTile<DP>;
  constexpr int BM = T::BM, BN = T::BN, LDS = T::LDS;
  constexpr int CH = DP / 8;   // 16-byte chunks per row
  constexpr int NT = BN / 8;   // 8-key column tiles of S
  constexpr int KS = DP / 16;  // k-steps of Q K^T
  constexpr int DT = DP / 8;   // 8-dim column tiles of O
  constexpr bool kQInRegs = DP <= 128;
  using MT = MmaTraits<scalar_t>;

  scalar_t* Qs = reinterpret_cast<scalar_t*>(dyn_smem());  // [BM][LDS]
  scalar_t* Ks = Qs + BM * LDS;                             // [2][BN][LDS]
  scalar_t* Vs = Ks + 2 * BN * LDS;                         // [2][BN][LDS]

  const int D = a.D;
  const int64_t nqb = (a.Lq + BM - 1) / BM;
  const int64_t bh = blockIdx.x / nqb, q0 = (blockIdx.x % nqb) * BM;
  const int64_t b = bh / a.H, h = bh % a.H;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, tig = lane & 3;
  const scalar_t* qh = a.q.head(b, h);
  const scalar_t* kh = a.k.head(b, h);
  const scalar_t* vh = a.v.head(b, h);
  const int64_t moff = b * a.mask.sb + a.mask.sh * h;

  for (int e = tid; e < BM * CH; e += kMmaThreads) {
    const int r = e / CH, c = e % CH;
    const bool ok = q0 + r < a.Lq && c * 8 < D;
    cp_async16(Qs + r * LDS + c * 8, ok ? qh + (q0 + r) * a.q.sl + c * 8 : qh, ok);
  }
  auto load_kv = [&](int buf, int64_t k0) {
    for (int e = tid; e < BN * CH; e += kMmaThreads) {
      const int r = e / CH, c = e % CH;
      const bool ok = k0 + r < a.Lk && c * 8 < D;
      cp_async16(Ks + (buf * BN + r) * LDS + c * 8, ok ? kh + (k0 + r) * a.k.sl + c * 8 : kh, ok);
      cp_async16(Vs + (buf * BN + r) * LDS + c * 8, ok ? vh + (k0 + r) * a.v.sl + c * 8 : vh, ok);
    }
  };
  load_kv(0, 0);
  cp_async_commit();

  float o[DT][4];
#pragma unroll
  for (int j = 0; j < DT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  // This thread holds rows g and g + 8 of the warp's 16: running max (log2 units) and partial sum.
  float m_r[2] = {neg_inf<float>(), neg_inf<float>()}, l_r[2] = {0.f, 0.f};
  const float sl2 = a.scale * kLog2e;
  const int64_t row_base = q0 + warp * 16 + g;

  cp_async_wait_all();
  __syncthreads();

  unsigned qf[kQInRegs ? KS : 1][4];
  // A fragments of Q: matrices (rows 0-7 | 8-15) x (dims 0-7 | 8-15) of the warp's 16 rows.
  auto q_frag = [&](unsigned (&f)[4], int ks) {
    ldmatrix_x4(f, Qs + (warp * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * LDS + ks * 16 + (lane / 16) * 8);
  };
  if constexpr (kQInRegs) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) q_frag(qf[ks], ks);
  }

  const int64_t nkt = (a.Lk + BN - 1) / BN;
  for (int64_t t = 0; t < nkt; ++t) {
    const int buf = static_cast<int>(t & 1);
    if (t + 1 < nkt) load_kv(buf ^ 1, (t + 1) * BN);  // overlaps with this tile's math
    cp_async_commit();
    const scalar_t* Kt = Ks + buf * BN * LDS;
    const scalar_t* Vt = Vs + buf * BN * LDS;

    // S = Q K^T for 16 rows x BN keys.
    float s[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      unsigned af[4];
      if constexpr (kQInRegs) {
#pragma unroll
        for (int x = 0; x < 4; ++x) af[x] = qf[ks][x];
      } else {
        q_frag(af, ks);
      }
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        // B fragments of key tiles j, j + 1: K rows are the n index, dims the k index.
        unsigned bf[4];
        ldmatrix_x4(bf, Kt + (j * 8 + (lane / 16) * 8 + (lane % 8)) * LDS + ks * 16 + ((lane / 8) % 2) * 8);
        MT::mma(s[j], af, bf[0], bf[1]);
        MT::mma(s[j + 1], af, bf[2], bf[3]);
      }
    }

    // Scale, mask and bounds, in log2 units; then the online softmax per row.
    float mx[2], corr[2], m_use[2];
    scale_mask_scores(a, s, mx, t * BN, row_base, moff, sl2, tig);
    online_max(mx, m_r, l_r, corr, m_use);
#pragma unroll
    for (int j = 0; j < DT; ++j) {
      o[j][0] *= corr[0];
      o[j][1] *= corr[0];
      o[j][2] *= corr[1];
      o[j][3] *= corr[1];
    }
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float p = exp2f(s[j][e] - m_use[e >> 1]);
        s[j][e] = p;
        l_r[e >> 1] += p;
      }
    }

    // O += P V: the S accumulators of key tiles 2kk, 2kk + 1 are the A fragment of k-step kk.
#pragma unroll
    for (int kk = 0; kk < BN / 16; ++kk) {
      const unsigned pa[4] = {MT::pack(s[2 * kk][0], s[2 * kk][1]), MT::pack(s[2 * kk][2], s[2 * kk][3]),
                              MT::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                              MT::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int j = 0; j < DT; j += 2) {
        unsigned vb[4];
        ldmatrix_x4_trans(vb, Vt + (kk * 16 + ((lane / 8) % 2) * 8 + (lane % 8)) * LDS + j * 8 + (lane / 16) * 8);
        MT::mma(o[j], pa, vb[0], vb[1]);
        MT::mma(o[j + 1], pa, vb[2], vb[3]);
      }
    }

    cp_async_wait_all();
    __syncthreads();  // next tile landed; everyone is done with this one
  }

  store_rows(a, reinterpret_cast<const float(&)[4 * DT]>(o), m_r, l_r, bh, row_base, tig);
}

// ---------------------------------------------------------------------------------------------
// Forward, Hopper kernel (sm_90a; fp16 / bf16, head_dim <= 128 and % 8 == 0): the flash loop on
// warpgroup MMA (wgmma), warp-specialised. Warpgroup 0 is the producer: one thread streams Q once and
// the K/V tiles of 128 keys through a ring of kStages shared-memory stages with the bulk tensor copy
// engine (TMA: the 128-byte swizzle wgmma reads, rows past the sequence zero-filled), signalling "full"
// mbarriers with the byte count; it gives most of its registers to the consumers (setmaxnreg).
// Warpgroups 1..WG each own 64 query rows: S = Q K^T (64 x 128) from shared memory into registers,
// the online softmax on those accumulators, O += P V with P straight from registers (the accumulator
// layout of S is the A-fragment layout of the second product), then an "empty" arrival frees the
// stage. No CTA-wide barrier after the start, so the consumer warpgroups drift apart and one's softmax
// overlaps another's matrix work. WG = 3 at head_dim 64, 2 at 128 (64 + 64 float accumulators).
template <int DP>
struct WgTile {
  static constexpr int WG = DP <= 64 ? 3 : 2;                     // consumer warpgroups
  static constexpr int threads = 128 * (WG + 1);
  static constexpr int regs_producer = 24;
  static constexpr int regs_consumer = DP <= 64 ? 160 : 240;      // 24 * 128 + regs * 128 * WG <= 65536
  static constexpr int BM = 64 * WG;
  static constexpr int BN = 128;
  static constexpr int kStages = 2;
  static constexpr int q_bytes = BM * DP * 2;                     // one of the two query buffers
  static constexpr int kv_bytes = BN * DP * 2;                    // one stage of K (or V)
  static constexpr int bar_off = 2 * q_bytes + 2 * kStages * kv_bytes;  // then the mbarriers
  static constexpr size_t smem_bytes = bar_off + 8 * (4 + 4 * kStages) + 1024;  // + slack to align to 1024
};

// The Hopper kernels' mbarriers at bar (8 bytes each): one array of S per entry of counts (its arrival
// count), in order.
template <int S, int N>
__device__ __forceinline__ void init_barriers(uint32_t bar, const int (&counts)[N]) {
  for (int k = 0; k < N; ++k)
    for (int st = 0; st < S; ++st) wgmma::mbar_init(bar + 8 * (k * S + st), counts[k]);
  wgmma::mbar_init_fence();
}

// A tile the producer thread loads (a query tile, or a K or V tile where the two have barriers of their
// own): DP dims (boxes of EPL elements) x BM rows of (b, h) from row r0 into dst, completing on bar.
template <int DP, int BM, int EPL>
__device__ __forceinline__ void load_tile(uint32_t dst, const CUtensorMap* map, uint32_t bar, uint32_t bytes, int64_t r0,
                                          int h, int b) {
  wgmma::mbar_expect_tx(bar, bytes);
  for (int c = 0; c < DP / EPL; ++c) wgmma::tma_load_4d(dst + c * BM * 128, map, bar, c * EPL, int(r0), h, b);
}

// The producer thread's streaming loop: n tiles of BC rows of two operands (tensor maps m1, m2) into
// stages of stage_bytes at s1 and s2, tile t in stage t % S once the consumers have freed it (empty), all
// completing on full; extra(t, st) issues any further copies of the tile, their bytes in extra_bytes.
// EPL: elements in a 128-byte box row (64 in 16 bits, 32 in fp32). u0: tiles this thread streamed
// before (a persistent kernel's stage counter runs on across its work items).
template <int DP, int BC, int S, int EPL = 64, typename Full, typename Empty, typename Extra>
__device__ __forceinline__ void stream_tiles(const CUtensorMap* m1, const CUtensorMap* m2, uint32_t s1, uint32_t s2,
                                             uint32_t stage_bytes, int64_t n, int h, int b, Full full, Empty empty,
                                             uint32_t extra_bytes, Extra&& extra, int64_t u0 = 0) {
  for (int64_t t = 0; t < n; ++t) {
    const int st = static_cast<int>((u0 + t) % S);
    wgmma::mbar_wait(empty(st), static_cast<uint32_t>(((u0 + t) / S) & 1) ^ 1u);
    wgmma::mbar_expect_tx(full(st), 2 * stage_bytes + extra_bytes);
    const int r0 = static_cast<int>(t * BC);
    for (int c = 0; c < DP / EPL; ++c) {
      wgmma::tma_load_4d(s1 + st * stage_bytes + c * BC * 128, m1, full(st), c * EPL, r0, h, b);
      wgmma::tma_load_4d(s2 + st * stage_bytes + c * BC * 128, m2, full(st), c * EPL, r0, h, b);
    }
    extra(t, st);
  }
}

// kOverlap (head_dim 96-128): each warpgroup issues S = Q K^T of tile t + 1 and O += P V of tile t back to
// back and runs tile t + 1's softmax while P V is on the tensor cores (FlashAttention-3's intra-warpgroup
// overlap); K and V then have barriers of their own, as K is done with a tile before V is.
template <typename scalar_t, int DP, bool kOverlap = false>
__global__ void __launch_bounds__(WgTile<DP>::threads, 1)
    attn_fwd_wgmma_kernel(const AttnArgs<scalar_t, float> a, const __grid_constant__ CUtensorMap tq,
                          const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = WgTile<DP>;
  constexpr int BM = T::BM, BN = T::BN, S = T::kStages;
  constexpr int NS = BN / 2;  // S accumulators a thread
  constexpr int NO = DP / 2;  // O accumulators a thread
  constexpr bool kBf16 = std::is_same_v<scalar_t, at::BFloat16>;
  using MT = MmaTraits<scalar_t>;

  // Tiles are [DP / 64][rows][128 B], swizzled; each starts on a 1024-byte boundary.
  const uint32_t raw_addr = smem_addr(dyn_smem());
  const uint32_t sQ = (raw_addr + 1023u) & ~1023u;  // two query buffers
  const uint32_t sK = sQ + 2 * T::q_bytes, sV = sK + S * T::kv_bytes;
  // q_full[2], q_empty[2], then full[S], empty[S] (K and V together) or, overlapped, K's full[S],
  // empty[S] and V's full[S], empty[S].
  const uint32_t bar = sQ + T::bar_off;
  auto q_full = [&](int qb) { return bar + 8 * qb; };
  auto q_empty = [&](int qb) { return bar + 8 * (2 + qb); };
  auto full = [&](int st) { return bar + 8 * (4 + st); };
  auto empty = [&](int st) { return bar + 8 * (4 + S + st); };
  auto full_v = [&](int st) { return bar + 8 * (4 + 2 * S + st); };
  auto empty_v = [&](int st) { return bar + 8 * (4 + 3 * S + st); };

  // Persistent: a CTA takes work items (bh, query block) blockIdx.x, + gridDim.x, ...; the producer loads
  // the next item's Q (the other buffer) and first K/V tiles while the consumers finish this one, so the
  // fixed part of a short item (pipeline fill, epilogue) overlaps (576 tokens: 5 key tiles an item).
  const int64_t nqb = (a.Lq + BM - 1) / BM, nwork = a.B * a.H * nqb;
  const int tid = threadIdx.x, wg = tid / 128;
  const int64_t nkt = (a.Lk + BN - 1) / BN;

  if (tid == 0) {
    init_barriers<2>(bar, {1, 4 * T::WG});            // q_full, q_empty: one arrival per consumer warp
    init_barriers<S>(bar + 32, {1, 4 * T::WG});       // full, empty
    if constexpr (kOverlap) init_barriers<S>(bar + 32 + 16 * S, {1, 4 * T::WG});  // V's full, empty
  }
  __syncthreads();

  if (wg == 0) {
    wgmma::setmaxnreg_dec<T::regs_producer>();
    if (tid == 0) {
      int64_t u = 0;  // K/V tiles streamed so far
      int li = 0;     // work items so far
      for (int64_t w = blockIdx.x; w < nwork; w += gridDim.x, ++li) {
        const int64_t bh = w / nqb, q0 = (w % nqb) * BM;
        const int b = static_cast<int>(bh / a.H), h = static_cast<int>(bh % a.H), qb = li & 1;
        wgmma::mbar_wait(q_empty(qb), static_cast<uint32_t>(((li >> 1) & 1) ^ 1));
        load_tile<DP, BM, 64>(sQ + qb * T::q_bytes, &tq, q_full(qb), T::q_bytes, q0, h, b);
        if constexpr (kOverlap) {
          for (int64_t t = 0; t < nkt; ++t) {
            const int st = static_cast<int>((u + t) % S);
            const uint32_t par = static_cast<uint32_t>(((u + t) / S) & 1) ^ 1u;
            const int64_t r0 = t * BN;
            wgmma::mbar_wait(empty(st), par);
            load_tile<DP, BN, 64>(sK + st * T::kv_bytes, &tk, full(st), T::kv_bytes, r0, h, b);
            wgmma::mbar_wait(empty_v(st), par);
            load_tile<DP, BN, 64>(sV + st * T::kv_bytes, &tv, full_v(st), T::kv_bytes, r0, h, b);
          }
        } else {
          stream_tiles<DP, BN, S>(&tk, &tv, sK, sV, T::kv_bytes, nkt, h, b, full, empty, 0, [](int64_t, int) {}, u);
        }
        u += nkt;
      }
    }
    return;
  }
  wgmma::setmaxnreg_inc<T::regs_consumer>();

  const int cw = wg - 1, warp = (tid / 32) % 4, lane = tid % 32;
  const int g = lane >> 2, tig = lane & 3;
  const float sl2 = a.scale * kLog2e;
  // Descriptors of the tiles' first k-step; a step adds its byte offset >> 4 to the start address.
  const uint64_t dk0 = wgmma::desc_sw128(sK, 16, 1024);
  const uint64_t dv0 = wgmma::desc_sw128(sV, BN * 128, 1024);

  int64_t u = 0;
  int li = 0;
  for (int64_t w = blockIdx.x; w < nwork; w += gridDim.x, ++li) {
    const int64_t bh = w / nqb, q0 = (w % nqb) * BM;
    const int b = static_cast<int>(bh / a.H), h = static_cast<int>(bh % a.H), qb = li & 1;
    const int64_t moff = b * a.mask.sb + a.mask.sh * h;

    float o[NO];
#pragma unroll
    for (int i = 0; i < NO; ++i) o[i] = 0.f;
    // This thread holds rows g and g + 8 of its warp's 16: running max (log2 units) and partial sum.
    float m_r[2] = {neg_inf<float>(), neg_inf<float>()}, l_r[2] = {0.f, 0.f};
    const int64_t row_base = q0 + cw * 64 + warp * 16 + g;
    const uint64_t dq0 = wgmma::desc_sw128(sQ + qb * T::q_bytes + cw * 64 * 128, 16, 1024);

    // S = Q K^T of the tile in stage st (issued, not waited for): K-steps of 16 dims, 32 bytes apart
    // inside a 128-byte line, lines of 64 dims apart.
    auto q_desc = [&](int ks) { return dq0 + (((ks / 4) * BM * 128 + (ks % 4) * 32) >> 4); };
    auto k_desc = [&](int ks, int st) { return dk0 + ((st * T::kv_bytes + (ks / 4) * BN * 128 + (ks % 4) * 32) >> 4); };
    auto issue_qk = [&](float (&s)[NS], int st) {
#pragma unroll
      for (int ks = 0; ks < DP / 16; ++ks) wgmma::mma_m64n128k16_ss<kBf16>(s, q_desc(ks), k_desc(ks, st), ks);
      wgmma::commit();
    };
    // The same over the tile's first 64 keys only (a last tile of at most BN / 2 keys). Its own
    // accumulators: written into half of s's, ptxas serializes every product of the kernel (C7511).
    auto issue_qk_half = [&](float (&s)[NS / 2], int st) {
#pragma unroll
      for (int ks = 0; ks < DP / 16; ++ks) wgmma::mma_m64n64k16_ss<kBf16>(s, q_desc(ks), k_desc(ks, st), ks);
      wgmma::commit();
    };
    // O += P V: V's tile is the MN-major B operand; K-steps of 16 keys are 2048 bytes apart. hv: a
    // tile of at most 64 keys (only P's first 64 columns; a constant where inlined, as in softmax, pack).
    auto issue_pv = [&](const unsigned (&pa)[BN / 16][4], int st, bool hv) {
#pragma unroll
      for (int kk = 0; kk < (hv ? BN / 32 : BN / 16); ++kk) {
        const uint64_t dv = dv0 + ((st * T::kv_bytes + kk * 16 * 128) >> 4);
        if constexpr (DP == 64) wgmma::mma_m64n64k16_rs<kBf16>(o, pa[kk], dv);
        else wgmma::mma_m64n128k16_rs<kBf16>(o, pa[kk], dv);
      }
      wgmma::commit();
    };
    // The online softmax of tile t's scores per row (4 lanes share a row), in log2 units: s becomes the
    // unnormalised probabilities, l_r gains their sums, corr is what O must be multiplied by. Interior
    // tiles without a mask take the row max of the raw scores and one FMA + ex2 an element; the last
    // tile, masks and a non-positive scale scale and mask every element first.
    // hv: only s[0, NS / 2) holds scores (the keys past them are past Lk).
    auto softmax = [&](float (&s)[NS], int64_t t, float (&corr)[2], bool hv) {
      const int NV = hv ? NS / 2 : NS;
      const int64_t k0 = t * BN;
      const bool plain = k0 + BN <= a.Lk && a.mask.kind == kNoMask && sl2 > 0.f;
      float mx[2] = {neg_inf<float>(), neg_inf<float>()};
      if (plain) {
#pragma unroll
        for (int i = 0; i < NV; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
      } else {
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          const int64_t key = k0 + (i / 4) * 8 + 2 * tig + (i & 1);
          const int rr = (i >> 1) & 1;
          float x = s[i] * sl2;
          if (key >= a.Lk) {
            x = neg_inf<float>();
          } else if (a.mask.kind != kNoMask && row_base + rr * 8 < a.Lq) {
            x += mask_add<scalar_t, float>(a.mask, moff + (row_base + rr * 8) * a.mask.sq + key * a.mask.sk) * kLog2e;
          }
          s[i] = x;
          mx[rr] = fmaxf(mx[rr], x);
        }
      }
      const float f = plain ? sl2 : 1.f;  // what s still has to be multiplied by
      float m_use[2];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(kFullMask, mx[rr], 1));
        mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(kFullMask, mx[rr], 2));
        const float m_new = fmaxf(m_r[rr], mx[rr] * f);
        m_use[rr] = m_new == neg_inf<float>() ? 0.f : m_new;
        corr[rr] = ex2_approx(m_r[rr] - m_use[rr]);
        m_r[rr] = m_new;
        l_r[rr] *= corr[rr];
      }
#pragma unroll
      for (int i = 0; i < NV; i += 2) {
        const int rr = (i >> 1) & 1;
        s[i] = ex2_approx(fmaf(s[i], f, -m_use[rr]));
        s[i + 1] = ex2_approx(fmaf(s[i + 1], f, -m_use[rr]));
        l_r[rr] += s[i] + s[i + 1];
      }
    };
    auto pack = [&](const float (&s)[NS], unsigned (&pa)[BN / 16][4], bool hv) {
      const int NV = hv ? NS / 2 : NS;
#pragma unroll
      for (int i = 0; i < NV; i += 2) pa[i / 8][(i / 2) % 4] = MT::pack(s[i], s[i + 1]);
    };
    auto rescale = [&](const float (&corr)[2]) {
#pragma unroll
      for (int i = 0; i < NO; ++i) o[i] *= corr[(i >> 1) & 1];
    };
    auto phase = [&](int64_t t) { return static_cast<uint32_t>(((u + t) / S) & 1); };
    auto stage = [&](int64_t t) { return static_cast<int>((u + t) % S); };

    wgmma::mbar_wait(q_full(qb), static_cast<uint32_t>((li >> 1) & 1));
    if constexpr (!kOverlap) {
      // A last tile of at most 64 keys (576 = 4 x 128 + 64) runs at N = 64: half the products and softmax.
      auto step = [&](int64_t t, bool hv) {
        const int st = stage(t);
        wgmma::mbar_wait(full(st), phase(t));
        float s[NS], corr[2];
        unsigned pa[BN / 16][4];
        wgmma::fence();
        if (hv) {
          float sh[NS / 2];
          issue_qk_half(sh, st);
          wgmma::wait<0>();
          wgmma::fence_regs(sh);
#pragma unroll
          for (int i = 0; i < NS / 2; ++i) s[i] = sh[i];
        } else {
          issue_qk(s, st);
          wgmma::wait<0>();
          wgmma::fence_regs(s);
        }
        softmax(s, t, corr, hv);
        rescale(corr);
        pack(s, pa, hv);
        wgmma::fence_regs(o);
        wgmma::fence();
        issue_pv(pa, st, hv);
        wgmma::wait<0>();
        wgmma::fence_regs(o);
        if (lane == 0) wgmma::mbar_arrive(empty(st));  // this warp is done reading the stage
      };
      const bool last_half = a.Lk - (nkt - 1) * BN <= BN / 2;
      const int64_t nfull = last_half ? nkt - 1 : nkt;
      for (int64_t t = 0; t < nfull; ++t) step(t, false);
      if (last_half) step(nkt - 1, true);
    } else {
      // Tile t's P V runs while tile t + 1's softmax does: P (pa) and O stay untouched until the
      // wait for it; then O is rescaled by the new tile's correction and the new P packed.
      float s[NS], corr[2];
      unsigned pa[BN / 16][4];
      wgmma::mbar_wait(full(stage(0)), phase(0));
      wgmma::fence();
      issue_qk(s, stage(0));
      wgmma::wait<0>();
      wgmma::fence_regs(s);
      if (lane == 0) wgmma::mbar_arrive(empty(stage(0)));  // K's stage is free again
      softmax(s, 0, corr, false);
      pack(s, pa, false);
      for (int64_t t = 1; t < nkt; ++t) {
        const int st = stage(t), sp = stage(t - 1);
        wgmma::mbar_wait(full(st), phase(t));
        wgmma::mbar_wait(full_v(sp), phase(t - 1));
        wgmma::fence_regs(o);
        wgmma::fence();
        issue_qk(s, st);
        issue_pv(pa, sp, false);
        wgmma::wait<1>();  // groups complete in order: S of tile t is done, P V may not be
        wgmma::fence_regs(s);
        if (lane == 0) wgmma::mbar_arrive(empty(st));
        softmax(s, t, corr, false);
        wgmma::wait<0>();
        wgmma::fence_regs(o);
        wgmma::fence_regs(pa);
        wgmma::fence_regs(s);
        if (lane == 0) wgmma::mbar_arrive(empty_v(sp));
        rescale(corr);
        pack(s, pa, false);
      }
      const int sl = stage(nkt - 1);
      wgmma::mbar_wait(full_v(sl), phase(nkt - 1));
      wgmma::fence_regs(o);
      wgmma::fence();
      issue_pv(pa, sl, false);
      wgmma::wait<0>();
      wgmma::fence_regs(o);
      if (lane == 0) wgmma::mbar_arrive(empty_v(sl));
    }
    u += nkt;
    if (lane == 0) wgmma::mbar_arrive(q_empty(qb));  // and with this item's Q
    store_rows(a, o, m_r, l_r, bh, row_base, tig);
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Forward, "short" kernel: fp16/bf16 with q_len, kv_len <= 32 (temporal attention over frames).
// Each (b, h) problem is a few KB, so the kernel is bound by moving q, k, v and o once. A warp owns
// a problem at a time with no block barriers: it prefetches its next problem's q, k, v with
// cp.async into the other half of its own double buffer while it computes this one on the tensor
// cores (S = Q K^T and O = P V as mma.sync m16n8k16 over 16-row tiles, a plain softmax in
// registers: all keys are on chip). The output goes through shared memory so that global stores
// are whole 16-byte vectors. Persistent warps stride over the problems. Larger tiles drop the
// prefetch and keep 16 warps per SM instead (see ShortTile).
// LP: q_len and kv_len padded to 16 or 32; DP: head_dim padded to 64 or 128.
template <int LP, int DP>
struct ShortTile {
  static constexpr int LDS = DP + 8;  // padded row: ldmatrix rows fall in distinct banks
  static constexpr int stage_elems = 3 * LP * LDS;  // Q, K, V
  static constexpr size_t stage_bytes = static_cast<size_t>(stage_elems) * 2;
  // 16 warps per SM (4 blocks of about 56 KB) carry more bytes in flight than fewer warps with
  // a prefetch each: the double buffer is used only where two stages fit in that budget.
  static constexpr int stages = 2 * stage_bytes <= 14 * 1024 ? 2 : 1;
  static constexpr size_t warp_bytes = stages * stage_bytes;
  static constexpr int warps = warp_bytes <= 14 * 1024 ? 4 : warp_bytes <= 28 * 1024 ? 2 : 1;
  static constexpr int problems = warps;  // a warp a problem
  static constexpr size_t smem_bytes = warps * warp_bytes;
};

__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

template <typename scalar_t, int LP, int DP>
__global__ void __launch_bounds__(ShortTile<LP, DP>::warps * 32)
    attn_fwd_short_kernel(const AttnArgs<scalar_t, float> a) {
  using T = ShortTile<LP, DP>;
  constexpr int LDS = T::LDS;
  constexpr int MT = LP / 16;  // 16-row query tiles
  constexpr int NT = LP / 8;   // 8-key column tiles of S
  constexpr int KS = DP / 16;  // k-steps of Q K^T
  constexpr int DT = DP / 8;   // 8-dim column tiles of O
  using MT_ = MmaTraits<scalar_t>;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, tig = lane & 3;
  constexpr int S = T::stages;
  scalar_t* buf = reinterpret_cast<scalar_t*>(dyn_smem()) + static_cast<size_t>(warp) * S * T::stage_elems;

  // Rows past q_len / kv_len and dims past head_dim stay zero for the whole kernel: loads only
  // ever write the valid part, so padded keys contribute exactly 0 (and never 0 * garbage).
  {
    uint4* z = reinterpret_cast<uint4*>(buf);
    for (int e = lane; e < S * T::stage_elems / 8; e += 32) z[e] = make_uint4(0, 0, 0, 0);
  }
  __syncwarp();

  const int D = a.D, CH = D / 8;
  const int Lq = static_cast<int>(a.Lq), Lk = static_cast<int>(a.Lk);
  const int64_t P = a.B * a.H;
  const int64_t step = static_cast<int64_t>(gridDim.x) * T::warps;

  // Chunk loops run over the padded tile (a trip count known at compile time) with a predicate.
  constexpr int DCH = DP / 8;
  auto load = [&](int st, int64_t p) {
    const int64_t b = p / a.H, h = p - b * a.H;
    const scalar_t* qh = a.q.head(b, h);
    const scalar_t* kh = a.k.head(b, h);
    const scalar_t* vh = a.v.head(b, h);
    scalar_t* Qs = buf + st * T::stage_elems;
    scalar_t* Ks = Qs + LP * LDS;
    scalar_t* Vs = Ks + LP * LDS;
#pragma unroll
    for (int e = lane; e < LP * DCH; e += 32) {
      const int r = e / DCH, c = e % DCH;
      if (c < CH) {
        if (r < Lq) cp_async16(Qs + r * LDS + c * 8, qh + r * a.q.sl + c * 8, true);
        if (r < Lk) {
          cp_async16(Ks + r * LDS + c * 8, kh + r * a.k.sl + c * 8, true);
          cp_async16(Vs + r * LDS + c * 8, vh + r * a.v.sl + c * 8, true);
        }
      }
    }
  };

  const float sl2 = a.scale * kLog2e;
  int64_t p = static_cast<int64_t>(blockIdx.x) * T::warps + warp;
  if (S == 2 && p < P) load(0, p);
  cp_async_commit();
  for (int it = 0; p < P; ++it, p += step) {
    const int st = S == 2 ? it & 1 : 0;
    if constexpr (S == 2) {
      if (p + step < P) load(st ^ 1, p + step);
      cp_async_commit();
      cp_async_wait_one();  // this problem's group has landed (the prefetch may still be in flight)
    } else {
      load(0, p);
      cp_async_commit();
      cp_async_wait_all();
    }
    __syncwarp();

    scalar_t* Qs = buf + st * T::stage_elems;
    const scalar_t* Ks = Qs + LP * LDS;
    const scalar_t* Vs = Ks + LP * LDS;
    const int64_t moff = a.mask.kind == kNoMask ? 0 : (p / a.H) * a.mask.sb + (p % a.H) * a.mask.sh;

#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      if (mt * 16 >= Lq) break;
      float s[NT][4];
#pragma unroll
      for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        if (ks * 16 >= D) break;
        unsigned af[4];
        ldmatrix_x4(af, Qs + (mt * 16 + (lane % 8) + ((lane / 8) % 2) * 8) * LDS + ks * 16 + (lane / 16) * 8);
#pragma unroll
        for (int j = 0; j < NT; j += 2) {
          unsigned bf[4];
          ldmatrix_x4(bf, Ks + (j * 8 + (lane / 16) * 8 + (lane % 8)) * LDS + ks * 16 + ((lane / 8) % 2) * 8);
          MT_::mma(s[j], af, bf[0], bf[1]);
          MT_::mma(s[j + 1], af, bf[2], bf[3]);
        }
      }

      // Scale, mask and bounds in log2 units; every key is here, so a plain softmax per row.
      float mx[2] = {neg_inf<float>(), neg_inf<float>()};
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = j * 8 + 2 * tig + (e & 1);
          const int row = mt * 16 + g + (e >> 1) * 8;
          float x = s[j][e] * sl2;
          if (key >= Lk) {
            x = neg_inf<float>();
          } else if (a.mask.kind != kNoMask && row < Lq) {
            x += mask_add<scalar_t, float>(a.mask, moff + row * a.mask.sq + key * a.mask.sk) * kLog2e;
          }
          s[j][e] = x;
          mx[e >> 1] = fmaxf(mx[e >> 1], x);
        }
      }
      float l[2] = {0.f, 0.f};
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(kFullMask, mx[rr], 1));
        mx[rr] = fmaxf(mx[rr], __shfl_xor_sync(kFullMask, mx[rr], 2));
      }
      const float m_use[2] = {mx[0] == neg_inf<float>() ? 0.f : mx[0], mx[1] == neg_inf<float>() ? 0.f : mx[1]};
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float pe = exp2f(s[j][e] - m_use[e >> 1]);
          s[j][e] = pe;
          l[e >> 1] += pe;
        }
      }
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        l[rr] += __shfl_xor_sync(kFullMask, l[rr], 1);
        l[rr] += __shfl_xor_sync(kFullMask, l[rr], 2);
      }

      // O = P V: the S accumulators of key tiles 2kk, 2kk + 1 are the A fragment of k-step kk.
      float o[DT][4];
#pragma unroll
      for (int j = 0; j < DT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < LP / 16; ++kk) {
        if (kk * 16 >= Lk) break;
        const unsigned pa[4] = {MT_::pack(s[2 * kk][0], s[2 * kk][1]), MT_::pack(s[2 * kk][2], s[2 * kk][3]),
                                MT_::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                MT_::pack(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int j = 0; j < DT; j += 2) {
          if (j * 8 >= D) break;
          unsigned vb[4];
          ldmatrix_x4_trans(vb, Vs + (kk * 16 + ((lane / 8) % 2) * 8 + (lane % 8)) * LDS + j * 8 + (lane / 16) * 8);
          MT_::mma(o[j], pa, vb[0], vb[1]);
          MT_::mma(o[j + 1], pa, vb[2], vb[3]);
        }
      }

      // Normalise into this tile's Q rows (no longer read) as the staging area for the stores.
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int row = mt * 16 + g + rr * 8;
        if (row >= Lq) continue;
        const float inv = l[rr] > 0.f ? 1.f / l[rr] : 0.f;
#pragma unroll
        for (int j = 0; j < DT; ++j) {
          const int d = j * 8 + 2 * tig;
          if (d < D)
            *reinterpret_cast<unsigned*>(Qs + row * LDS + d) = MT_::pack(o[j][2 * rr] * inv, o[j][2 * rr + 1] * inv);
        }
        if (tig == 0 && a.lse_out != nullptr)  // nullptr: compute_lse=False
          a.lse_out[p * Lq + row] = l[rr] == 0.f ? neg_inf<float>() : (mx[rr] + log2f(l[rr])) * kLn2;  // NaN stays
      }
    }
    __syncwarp();
    scalar_t* orow = a.out + p * Lq * D;
#pragma unroll
    for (int e = lane; e < LP * DCH; e += 32) {
      const int r = e / DCH, c = e % DCH;
      if (r < Lq && c < CH)
        *reinterpret_cast<uint4*>(orow + r * D + c * 8) = *reinterpret_cast<const uint4*>(Qs + r * LDS + c * 8);
    }
    __syncwarp();  // the staging reads are done before this stage is refilled
  }
  cp_async_wait_all();
}

// ---------------------------------------------------------------------------------------------
// Forward, short problems on Hopper (sm_90a): fp16 / bf16, q_len and kv_len <= 32, head_dim <= 64, no mask.
// The cp.async kernel above spends ~1850 warp instructions on a 25-frame problem (loads and stores a
// 16-byte chunk a lane at a time, with their index arithmetic and predicates) and is issue-bound there
// (bench/notes/attention.md, version 14). Here the copy engine moves whole problems: one lane issues a
// 4-D box of Q, K and V each (64 dims x LP rows, 128-byte swizzle, rows past the length read as zeros)
// into one of the warp's two stages, completing on the stage's barrier, and stores O with one box from
// the warp's own staging slot (rows past q_len are not written). Each warp runs its own pipeline (no
// block barriers): the next problem loads while this one is computed as in the kernel above.
// LP: q_len and kv_len padded to 16 or 32. Per warp: two stages of Q, K and V slots and an O slot, each LP
// rows of 128 bytes starting on a 1024-byte boundary, so the copy engine's 128-byte swizzle puts 16-byte
// chunk c of row r at c ^ (r % 8). Two stages at 8 (LP 32) or 16 (LP 16) warps an SM measured fastest
// (bench/notes/attention.md, version 14: three or four stages with fewer warps, nine or ten warps with O
// staged in Q's slot or slots of exactly q_len / kv_len rows were all slower).
template <int LP>
struct ShortTmaTile {
  static constexpr int slot = LP * 128;                  // LP rows of 64 16-bit dims
  static constexpr int warp_bytes = 7 * slot;            // Q, K, V of two stages; O
  static constexpr int warps = std::min(16, 224 * 1024 / warp_bytes);  // one CTA an SM
  static constexpr size_t smem_bytes = static_cast<size_t>(warps) * warp_bytes + 1024 + warps * 16;
};

template <typename scalar_t, int LP>
__global__ void __launch_bounds__(ShortTmaTile<LP>::warps * 32, 1)
    attn_fwd_short_tma_kernel(const AttnArgs<scalar_t, float> a, const __grid_constant__ CUtensorMap tq,
                              const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                              const __grid_constant__ CUtensorMap to) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = ShortTmaTile<LP>;
  constexpr int MT = LP / 16, NT = LP / 8, SLOT = T::slot;
  using MT_ = MmaTraits<scalar_t>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, tig = lane & 3;
  const int H = static_cast<int>(a.H), Lq = static_cast<int>(a.Lq), Lk = static_cast<int>(a.Lk);
  const int P = static_cast<int>(a.B * a.H);  // the host keeps B * H below INT_MAX / 2

  const uint32_t base = (smem_addr(dyn_smem()) + 1023u) & ~1023u;
  const uint32_t wbase = base + warp * T::warp_bytes, sO = wbase + 6 * SLOT;
  const uint32_t bar = base + T::warps * T::warp_bytes + warp * 16;
  if (lane == 0) {
    for (int st = 0; st < 2; ++st) wgmma::mbar_init(bar + 8 * st, 1);
    wgmma::mbar_init_fence();
  }
  __syncwarp();

  const int step = gridDim.x * T::warps;
  auto issue = [&](int st, int b, int h) {  // lane 0: Q, K and V of problem (b, h) into stage st
    const uint32_t q = wbase + st * 3 * SLOT, full = bar + 8 * st;
    wgmma::mbar_expect_tx(full, 3 * SLOT);
    wgmma::tma_load_4d(q, &tq, full, 0, 0, h, b);
    wgmma::tma_load_4d(q + SLOT, &tk, full, 0, 0, h, b);
    wgmma::tma_load_4d(q + 2 * SLOT, &tv, full, 0, 0, h, b);
  };

  // ldmatrix rows of a lane: Q and V rows 16 t + 8 mid + lane % 8, K rows 16 t + 8 hi + lane % 8; each is
  // lane % 8 modulo 8, which is its swizzle key.
  const int r7 = lane & 7, hi = lane >> 4, mid = (lane >> 3) & 1;
  const uint32_t a_row = (8 * mid + r7) * 128, b_row = (8 * hi + r7) * 128;
  auto at = [&](uint32_t row_addr, int chunk) { return row_addr + ((chunk ^ r7) << 4); };
  // Scale, and -inf for keys past kv_len (zeros on chip), in one fma.
  const float sl2 = a.scale * kLog2e;
  float kbias[NT][2];
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int c = 0; c < 2; ++c) kbias[j][c] = j * 8 + 2 * tig + c < Lk ? 0.f : neg_inf<float>();

  // (b, h) of this problem and of the next: steps of `step` problems without a division.
  int p = blockIdx.x * T::warps + warp;
  int b = p / H, h = p - b * H;
  const int step_b = step / H, step_h = step - step_b * H;
  auto advance = [&](int& pb, int& ph) {
    pb += step_b;
    ph += step_h;
    if (ph >= H) ph -= H, ++pb;
  };
  if (lane == 0 && p < P) issue(0, b, h);
#pragma unroll 1
  for (int it = 0; p < P; ++it, p += step) {
    const int st = it & 1;
    int nb = b, nh = h;
    advance(nb, nh);
    if (lane == 0 && p + step < P) issue(st ^ 1, nb, nh);  // that stage's reads ended last iteration
    wgmma::mbar_wait(bar + 8 * st, (it >> 1) & 1);
    const uint32_t sQ = wbase + st * 3 * SLOT, sK = sQ + SLOT, sV = sK + SLOT;

    // S = Q K^T for every 16-row tile (rows past q_len are zeros; their output is never stored).
    float s[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < NT; ++j) s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      unsigned af[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) ldmatrix_x4(af[mt], at(sQ + mt * 16 * 128 + a_row, 2 * ks + hi));
#pragma unroll
      for (int j = 0; j < NT; j += 2) {
        unsigned bf[4];
        ldmatrix_x4(bf, at(sK + j * 8 * 128 + b_row, 2 * ks + mid));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          MT_::mma(s[mt][j], af[mt], bf[0], bf[1]);
          MT_::mma(s[mt][j + 1], af[mt], bf[2], bf[3]);
        }
      }
    }

    // A plain softmax a row (every key is on chip), in log2 units.
    float mx[MT][2], l[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      mx[mt][0] = mx[mt][1] = neg_inf<float>();
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[mt][j][e] = fmaf(s[mt][j][e], sl2, kbias[j][e & 1]);
          mx[mt][e >> 1] = fmaxf(mx[mt][e >> 1], s[mt][j][e]);
        }
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        mx[mt][rr] = fmaxf(mx[mt][rr], __shfl_xor_sync(kFullMask, mx[mt][rr], 1));
        mx[mt][rr] = fmaxf(mx[mt][rr], __shfl_xor_sync(kFullMask, mx[mt][rr], 2));
      }
      l[mt][0] = l[mt][1] = 0.f;
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float m = mx[mt][e >> 1];
          s[mt][j][e] = ex2_approx(s[mt][j][e] - (m == neg_inf<float>() ? 0.f : m));
          l[mt][e >> 1] += s[mt][j][e];
        }
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        l[mt][rr] += __shfl_xor_sync(kFullMask, l[mt][rr], 1);
        l[mt][rr] += __shfl_xor_sync(kFullMask, l[mt][rr], 2);
      }
    }

    // O = P V: the S accumulators of key tiles 2kk, 2kk + 1 are the A fragment of k-step kk.
    float o[MT][8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int j = 0; j < 8; ++j) o[mt][j][0] = o[mt][j][1] = o[mt][j][2] = o[mt][j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < LP / 16; ++kk) {
      unsigned pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        pa[mt][0] = MT_::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
        pa[mt][1] = MT_::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
        pa[mt][2] = MT_::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
        pa[mt][3] = MT_::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
      }
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        unsigned vb[4];
        ldmatrix_x4_trans(vb, at(sV + kk * 16 * 128 + a_row, j + hi));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          MT_::mma(o[mt][j], pa[mt], vb[0], vb[1]);
          MT_::mma(o[mt][j + 1], pa[mt], vb[2], vb[3]);
        }
      }
    }

    if (lane == 0) wgmma::bulk_wait_read();  // the last problem's O store has read the staging slot
    __syncwarp();
    // Normalised rows into the staging slot (its rows past q_len are never stored); row % 8 = g.
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int row = mt * 16 + g + rr * 8;
        float inv;  // l >= 1 (the row's largest term is 1) unless the row is empty
        asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(inv) : "f"(l[mt][rr]));
        inv = l[mt][rr] > 0.f ? inv : 0.f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const unsigned v = MT_::pack(o[mt][j][2 * rr] * inv, o[mt][j][2 * rr + 1] * inv);
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sO + row * 128 + ((j ^ g) << 4) + tig * 4), "r"(v) : "memory");
        }
        if (tig == 0 && row < Lq && a.lse_out != nullptr)  // nullptr: compute_lse=False
          a.lse_out[static_cast<int64_t>(p) * Lq + row] =
              l[mt][rr] == 0.f ? neg_inf<float>() : (mx[mt][rr] + log2f(l[mt][rr])) * kLn2;  // NaN stays
      }
    wgmma::fence_proxy_async();  // the staging writes, visible to the copy engine
    __syncwarp();
    if (lane == 0) {
      wgmma::tma_store_4d(&to, sO, 0, 0, h, b);
      wgmma::bulk_commit();
    }
    b = nb, h = nh;
  }
  if (lane == 0) wgmma::bulk_wait();
#endif
}

// ---------------------------------------------------------------------------------------------
// Forward, fp32 on tensor cores (compute capability 8.0+; head_dim <= 128 and % 4 == 0): 3xTF32.
// Each fp32 operand x is split into a TF32 head and tail, hi = tf32(x) and lo = tf32(x - hi), and a
// product is lo*hi + hi*lo + hi*hi (lo*lo lies below fp32 rounding): fp32-level accuracy at a third
// of the TF32 tensor-core rate, still several times fp32 FMA on the CUDA cores. Two kernels share the
// 16-row tile step below: a flash loop for long sequences and a warp-per-problem one for short ones.

// Known edge, left on purpose: above the largest TF32 value (2^128 - 2^118) rounding turns a finite x
// into an infinite head whose tail x - hi is NaN. Clamping x first costs 7-11 % of every fp32 call
// (the B-operand splits sit in the inner loops), for inputs within 0.05 % of FLT_MAX.
__device__ __forceinline__ void split_tf32(float x, unsigned& hi, unsigned& lo) {
  hi = tf32_of(x);
  lo = tf32_of(x - __uint_as_float(hi));
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();  // the host never launches these kernels below compute capability 8.0
#endif
}
// c += a b at fp32 accuracy, a pre-split, b split here; the small terms first.
__device__ __forceinline__ void mma_3xtf32(float (&c)[4], const unsigned (&ah)[4], const unsigned (&al)[4], float b0,
                                           float b1) {
  unsigned bh0, bl0, bh1, bl1;
  split_tf32(b0, bh0, bl0);
  split_tf32(b1, bh1, bl1);
  mma_tf32(c, al, bh0, bh1);
  mma_tf32(c, ah, bl0, bl1);
  mma_tf32(c, ah, bh0, bh1);
}

// One warp: its 16 query rows (Qw, row stride LDS floats) against 8 * NT keys (Kt, Vt: sequence rows
// key0 ...) folded into the online-softmax state, in the m16n8 accumulator layout: this thread owns
// rows row0 and row0 + 8, columns 8j + 2 tig and + 1. Keys at or past Lk drop out.
// m16n8k8 A fragments hold columns tig and tig + 4 where S's accumulators hold 2 tig and 2 tig + 1:
// P V runs over the keys of a tile in the order (0, 2, 4, 6, 1, 3, 5, 7) — P needs no shuffle, and
// V is read in the same order.
// Scores of a tile of 8 NT keys (m16n8 accumulator layout) in log2 units with this thread's row maxima:
// interior tiles without a mask skip the per-element bound and mask code of scale_mask_scores.
template <int NT>
__device__ __forceinline__ void scale_scores(const AttnArgs<float, float>& a, float (&s)[NT][4], float (&mx)[2],
                                             int64_t key0, int64_t row0, int64_t moff, float sl2, int tig) {
  if (a.mask.kind == kNoMask && key0 + 8 * NT <= a.Lk) {
    mx[0] = mx[1] = neg_inf<float>();
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[j][e] *= sl2;
        mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
      }
    }
  } else {
    scale_mask_scores(a, s, mx, key0, row0, moff, sl2, tig);
  }
}

// P of one 8-key group as a 3xTF32 A fragment (head ph, tail pl) for P V, its exponentials added to l_r:
// logical column tig is key 2 tig, tig + 4 is key 2 tig + 1 (the accumulators of S, unshuffled).
__device__ __forceinline__ void p_fragment_tf32(const float (&s)[4], const float (&m_use)[2], float (&l_r)[2],
                                                unsigned (&ph)[4], unsigned (&pl)[4]) {
  const int order[4] = {0, 2, 1, 3};
#pragma unroll
  for (int x = 0; x < 4; ++x) {
    const float p = exp2f(s[order[x]] - m_use[x & 1]);
    l_r[x & 1] += p;
    split_tf32(p, ph[x], pl[x]);
  }
}

template <int NT, int DP, int LDS>
__device__ __forceinline__ void tf32_tile(const AttnArgs<float, float>& a, const float* Qw, const float* Kt,
                                          const float* Vt, float (&o)[DP / 8][4], float (&m_r)[2], float (&l_r)[2],
                                          int64_t key0, int64_t row0, int64_t moff, float sl2) {
  const int lane = threadIdx.x % 32, g = lane >> 2, tig = lane & 3;
  // The tensor cores' float accumulation does not round to nearest: a long chain of mma additions
  // drifts (measured 30 ulps over 1000 keys). Each chain here stays short — S per 32 dims, P V per
  // key tile — and the partial sums are added with ordinary (rounded) float adds.
  float s[NT][4], sp[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
  for (int ks = 0; ks < DP / 8; ++ks) {
    if (ks * 8 >= a.D) break;
    if (ks % 4 == 0) {
#pragma unroll
      for (int j = 0; j < NT; ++j) sp[j][0] = sp[j][1] = sp[j][2] = sp[j][3] = 0.f;
    }
    // A: (rows 0-7 | 8-15) x (dims 0-3 | 4-7) of this k-step, one 32-bit word per thread.
    unsigned qa[4], qh[4], ql[4];
    ldmatrix_x4(qa, Qw + ((lane % 8) + ((lane / 8) % 2) * 8) * LDS + ks * 8 + (lane / 16) * 4);
#pragma unroll
    for (int x = 0; x < 4; ++x) split_tf32(__uint_as_float(qa[x]), qh[x], ql[x]);
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      unsigned kb[4];  // B of key tiles j, j + 1: K rows are the n index, dims the k index
      ldmatrix_x4(kb, Kt + (j * 8 + (lane / 16) * 8 + (lane % 8)) * LDS + ks * 8 + ((lane / 8) % 2) * 4);
      mma_3xtf32(sp[j], qh, ql, __uint_as_float(kb[0]), __uint_as_float(kb[1]));
      mma_3xtf32(sp[j + 1], qh, ql, __uint_as_float(kb[2]), __uint_as_float(kb[3]));
    }
    if (ks % 4 == 3 || (ks + 1) * 8 >= a.D) {
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] += sp[j][e];
    }
  }

  float mx[2], corr[2], m_use[2];
  scale_scores(a, s, mx, key0, row0, moff, sl2, tig);
  online_max(mx, m_r, l_r, corr, m_use);
  float pv[DP / 8][4];
#pragma unroll
  for (int n = 0; n < DP / 8; ++n) pv[n][0] = pv[n][1] = pv[n][2] = pv[n][3] = 0.f;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    unsigned ph[4], pl[4];
    p_fragment_tf32(s[j], m_use, l_r, ph, pl);
    const float* vr = Vt + (j * 8 + 2 * tig) * LDS + g;
#pragma unroll
    for (int n = 0; n < DP / 8; ++n) {
      if (n * 8 >= a.D) break;
      mma_3xtf32(pv[n], ph, pl, vr[n * 8], vr[LDS + n * 8]);
    }
  }
#pragma unroll
  for (int n = 0; n < DP / 8; ++n) {
    o[n][0] = fmaf(o[n][0], corr[0], pv[n][0]);
    o[n][1] = fmaf(o[n][1], corr[0], pv[n][1]);
    o[n][2] = fmaf(o[n][2], corr[1], pv[n][2]);
    o[n][3] = fmaf(o[n][3], corr[1], pv[n][3]);
  }
}

template <int DP>
struct Tf32Tile {
  static constexpr int BM = kMmaRows;  // 4 warps x 16 query rows
  static constexpr int BN = 32;        // keys per tile: 4 blocks an SM at head_dim 64, 2 at 128
  static constexpr int LDS = DP + 4;   // padded row: ldmatrix rows and the V reads fall in distinct banks
  static constexpr size_t smem_bytes = static_cast<size_t>(BM + 4 * BN) * LDS * sizeof(float);  // Q + 2 x (K, V)
};

// Long sequences: the mma.sync kernel's flash loop (64 query rows a block, double-buffered cp.async
// key tiles) on the 3xTF32 tile step.
template <int DP>
__global__ void __launch_bounds__(kMmaThreads) attn_fwd_tf32_kernel(const AttnArgs<float, float> a) {
  using T = Tf32Tile<DP>;
  constexpr int BM = T::BM, BN = T::BN, LDS = T::LDS, CH = DP / 4;
  float* Qs = reinterpret_cast<float*>(dyn_smem());  // [BM][LDS]
  float* Ks = Qs + BM * LDS;                         // [2][BN][LDS]
  float* Vs = Ks + 2 * BN * LDS;                     // [2][BN][LDS]

  const int D = a.D;
  const int64_t nqb = (a.Lq + BM - 1) / BM;
  const int64_t bh = blockIdx.x / nqb, q0 = (blockIdx.x % nqb) * BM;
  const int64_t b = bh / a.H, h = bh % a.H;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const float* qh = a.q.head(b, h);
  const float* kh = a.k.head(b, h);
  const float* vh = a.v.head(b, h);
  const int64_t moff = b * a.mask.sb + a.mask.sh * h;

  for (int e = tid; e < BM * CH; e += kMmaThreads) {
    const int r = e / CH, c = e % CH;
    const bool ok = q0 + r < a.Lq && c * 4 < D;
    cp_async16(Qs + r * LDS + c * 4, ok ? qh + (q0 + r) * a.q.sl + c * 4 : qh, ok);
  }
  auto load_kv = [&](int buf, int64_t k0) {
    for (int e = tid; e < BN * CH; e += kMmaThreads) {
      const int r = e / CH, c = e % CH;
      const bool ok = k0 + r < a.Lk && c * 4 < D;
      cp_async16(Ks + (buf * BN + r) * LDS + c * 4, ok ? kh + (k0 + r) * a.k.sl + c * 4 : kh, ok);
      cp_async16(Vs + (buf * BN + r) * LDS + c * 4, ok ? vh + (k0 + r) * a.v.sl + c * 4 : vh, ok);
    }
  };
  load_kv(0, 0);
  cp_async_commit();

  float o[DP / 8][4];
#pragma unroll
  for (int n = 0; n < DP / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m_r[2] = {neg_inf<float>(), neg_inf<float>()}, l_r[2] = {0.f, 0.f};
  const float sl2 = a.scale * kLog2e;
  const int64_t row_base = q0 + warp * 16 + lane / 4;

  cp_async_wait_all();
  __syncthreads();
  const int64_t nkt = (a.Lk + BN - 1) / BN;
  for (int64_t t = 0; t < nkt; ++t) {
    const int buf = static_cast<int>(t & 1);
    if (t + 1 < nkt) load_kv(buf ^ 1, (t + 1) * BN);  // overlaps with this tile's math
    cp_async_commit();
    tf32_tile<BN / 8, DP, LDS>(a, Qs + warp * 16 * LDS, Ks + buf * BN * LDS, Vs + buf * BN * LDS, o, m_r, l_r, t * BN,
                               row_base, moff, sl2);
    cp_async_wait_all();
    __syncthreads();  // next tile landed; everyone is done with this one
  }
  store_rows(a, reinterpret_cast<const float(&)[4 * (DP / 8)]>(o), m_r, l_r, bh, row_base, lane & 3);
}

// Short sequences (q_len, kv_len <= 32: temporal attention) are bound by moving q, k, v and o once:
// as in the fp16 / bf16 short kernel, a (b, h) problem at a time sits in its owners' shared memory and
// persistent blocks stride over the problems, loading with cp.async. 16-row problems: a warp each,
// 4 a block, no block barriers; 16 warps an SM keep ~150 KB of loads in flight. 32-row problems carry
// 4x the tensor-core work (3xTF32) and twice the bytes: a warp per 16-row tile, the two sharing K and
// V, so the work a problem waits on is halved and twice the warps fit beside the loads.
template <int LP, int DP>
struct Tf32ShortTile {
  static constexpr int LDS = DP + 4;
  static constexpr int wpp = LP / 16;               // warps a problem
  static constexpr int problem_elems = 3 * LP * LDS;  // Q, K, V
  static constexpr size_t problem_bytes = static_cast<size_t>(problem_elems) * sizeof(float);
  static constexpr int problems = wpp > 1 ? 1 : problem_bytes <= 13 * 1024 ? 4 : problem_bytes <= 26 * 1024 ? 2 : 1;
  static constexpr int warps = problems * wpp;
  static constexpr size_t smem_bytes = problems * problem_bytes;  // <= ~52 KB: 4 blocks an SM
};

template <int LP, int DP>
__global__ void __launch_bounds__(Tf32ShortTile<LP, DP>::warps * 32)
    attn_fwd_tf32_short_kernel(const AttnArgs<float, float> a) {
  using T = Tf32ShortTile<LP, DP>;
  constexpr int LDS = T::LDS, DCH = DP / 4, WPP = T::wpp;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int slot = warp / WPP, mt = warp % WPP;  // the block's problem slot; this warp's 16-row tile
  const int t = mt * 32 + lane;                  // thread index among the problem's owners
  // Owners of a problem meet at a warp barrier, or a block barrier where the block is one problem.
  auto sync = [] {
    if constexpr (WPP == 1) __syncwarp();
    else __syncthreads();
  };
  float* Qs = reinterpret_cast<float*>(dyn_smem()) + static_cast<size_t>(slot) * T::problem_elems;
  float* Ks = Qs + LP * LDS;
  float* Vs = Ks + LP * LDS;
  // Rows past the lengths and dims past head_dim stay zero for the whole kernel (loads only write
  // the valid part): padded keys give scores of exactly 0 before the bound check drops them.
  for (int e = t; e < T::problem_elems; e += 32 * WPP) Qs[e] = 0.f;
  sync();

  const int D = a.D, CH = D / 4;
  const int Lq = static_cast<int>(a.Lq), Lk = static_cast<int>(a.Lk);
  const int64_t P = a.B * a.H;
  const int64_t step = static_cast<int64_t>(gridDim.x) * T::problems;
  const float sl2 = a.scale * kLog2e;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * T::problems + slot; p < P; p += step) {
    const int64_t b = p / a.H, h = p - b * a.H;
    const float* qh = a.q.head(b, h);
    const float* kh = a.k.head(b, h);
    const float* vh = a.v.head(b, h);
#pragma unroll
    for (int e = t; e < LP * DCH; e += 32 * WPP) {
      const int r = e / DCH, c = e % DCH;
      if (c < CH) {
        if (r < Lq) cp_async16(Qs + r * LDS + c * 4, qh + r * a.q.sl + c * 4, true);
        if (r < Lk) {
          cp_async16(Ks + r * LDS + c * 4, kh + r * a.k.sl + c * 4, true);
          cp_async16(Vs + r * LDS + c * 4, vh + r * a.v.sl + c * 4, true);
        }
      }
    }
    cp_async_commit();
    cp_async_wait_all();
    sync();
    if (mt * 16 < Lq) {
      const int64_t moff = a.mask.kind == kNoMask ? 0 : b * a.mask.sb + h * a.mask.sh;
      float o[DP / 8][4];
#pragma unroll
      for (int n = 0; n < DP / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
      float m_r[2] = {neg_inf<float>(), neg_inf<float>()}, l_r[2] = {0.f, 0.f};
      const int64_t row0 = mt * 16 + lane / 4;
      tf32_tile<LP / 8, DP, LDS>(a, Qs + mt * 16 * LDS, Ks, Vs, o, m_r, l_r, 0, row0, moff, sl2);
      store_rows(a, reinterpret_cast<const float(&)[4 * (DP / 8)]>(o), m_r, l_r, p, row0, lane & 3);
    }
    sync();  // every owner is done reading before the next problem's loads land
  }
}

// fp32 short problems of 17-32 rows on the CUDA cores. Padded to 32 rows, the 3xTF32 kernel above runs
// three products of 32 x 32 (61 % of them useful at 25 rows) and is bound by them rather than by its
// copies; plain FMA runs each product once (bench/notes/attention.md, version 11). A warp per (b, h)
// problem: lanes r and r + 16 own query rows r and r + 16, the lower half-warp the even 4-dim chunks, the
// upper the odd ones, so each K / V float4 read from shared memory (two addresses a warp: broadcasts)
// feeds 8 FMAs; one shuffle a score adds the halves, and both halves then run the softmax of both rows
// (no further exchange). The kernel is bound by issue (FMA ~65 % of it) and latency, so:
// - NL, the rows of Q, K and V held, is a compile-time count: max(q_len, kv_len) rounded up to 4, or 25
//   exact (SVD-XT's frames); the key loops are unrolled with no per-group branch, and keys below KMIN
//   are known present (no bound check);
// - the key loops are software-pipelined by hand (over_keys): each shared-memory load lands under the
//   previous group's FMAs;
// - rows are unpadded (Q's 16-byte chunks XOR-swizzled by row instead, so that 8 lanes reading their own
//   rows hit distinct banks): 19 KB a warp at 25 rows and head_dim 64, 12 warps an SM (blocks of 4).
// One stage of Q, K and V a warp; the next problem's Q and K are issued once the scores are done and its
// V once P V is, so each copy lands under half a problem's math. Rows past the lengths and dims past
// head_dim stay zero (loads only write the valid part): padded keys and dims multiply zeros. The output
// goes from registers to global memory (at head_dim % 8 == 0 a store instruction writes whole 32-byte
// sectors of 16 rows).
template <int DP, int NL>
struct Fp32ShortTile {
  static constexpr int LDS = DP;  // row stride of Q, K and V
  static constexpr int tile_elems = NL * LDS;
  static constexpr int warp_elems = 3 * tile_elems;
  // 4-warp blocks where three fit an SM's 228 KB (12 warps at head_dim 64 and <= 25 rows; 10 warps an SM
  // ran 15 % slower), their registers then held to 168; else 2.
  static constexpr int warps = DP <= 64 && NL <= 25 ? 4 : 2;
  static constexpr int min_blocks = warps == 4 ? 3 : 1;
  static constexpr int problems = warps;  // a warp a problem
  static constexpr size_t smem_bytes = static_cast<size_t>(warps) * warp_elems * sizeof(float);
};

__device__ __forceinline__ float4 lds4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float dot4(const float4& q, const float4& k, float s) {
  return fmaf(q.w, k.w, fmaf(q.z, k.z, fmaf(q.y, k.y, fmaf(q.x, k.x, s))));
}
__device__ __forceinline__ void fma4(float4& o, float p, const float4& v) {
  o.x = fmaf(p, v.x, o.x);
  o.y = fmaf(p, v.y, o.y);
  o.z = fmaf(p, v.z, o.z);
  o.w = fmaf(p, v.w, o.w);
}
// Keys j < NL in groups of 4, software-pipelined by hand: the next group's shared-memory loads are issued
// before this group's FMAs, and a compiler-only fence keeps later groups' loads from being hoisted as well
// (all NL float4s in registers: spills, or lost occupancy). use(j, x) consumes x = load(j).
template <int NL, typename Load, typename Use>
__device__ __forceinline__ void over_keys(Load&& load, Use&& use) {
  constexpr int NG = (NL + 3) / 4;
  float4 buf[2][4];
#pragma unroll
  for (int x = 0; x < 4; ++x)
    if (x < NL) buf[0][x] = load(x);
#pragma unroll
  for (int g = 0; g < NG; ++g) {
#pragma unroll
    for (int x = 0; x < 4; ++x)
      if (4 * (g + 1) + x < NL) buf[(g + 1) & 1][x] = load(4 * (g + 1) + x);
    asm volatile("" ::: "memory");
#pragma unroll
    for (int x = 0; x < 4; ++x)
      if (4 * g + x < NL) use(4 * g + x, buf[g & 1][x]);
  }
}

template <int DP, int NL, int KMIN>
__global__ void __launch_bounds__(Fp32ShortTile<DP, NL>::warps * 32, Fp32ShortTile<DP, NL>::min_blocks)
    attn_fwd_fp32_short_kernel(const AttnArgs<float, float> a) {
  using T = Fp32ShortTile<DP, NL>;
  constexpr int LDS = T::LDS, DCH = DP / 4;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int hf = lane >> 4, ra = lane & 15, rb = ra + 16;  // this lane's half and its two query rows
  float* Qs = reinterpret_cast<float*>(dyn_smem()) + static_cast<size_t>(warp) * T::warp_elems;
  float* Ks = Qs + T::tile_elems;
  float* Vs = Ks + T::tile_elems;
  // Rows past the lengths and dims past head_dim stay zero for the whole kernel (loads only write the
  // valid part): a half's chunk past head_dim and the padded keys multiply zeros.
  for (int e = lane; e < T::warp_elems / 4; e += 32) reinterpret_cast<float4*>(Qs)[e] = make_float4(0.f, 0.f, 0.f, 0.f);
  __syncwarp();

  const int D = a.D, CH = D / 4, ND8 = (D + 7) / 8;  // 8-dim steps t: chunk 2 t + hf of each half
  const int Lq = static_cast<int>(a.Lq), Lk = static_cast<int>(a.Lk);
  const int64_t P = a.B * a.H;
  const int64_t step = static_cast<int64_t>(gridDim.x) * T::warps;
  const int64_t step_b = step / a.H, step_h = step - step_b * a.H;  // the stride in (b, h)
  const float sl2 = a.scale * kLog2e;
  // This lane's Q rows in shared memory (rb past NL reads row NL - 1: computed, never stored).
  const int qb_row = min(rb, NL - 1);
  // Chunk 2 t + hf of row r sits at element (r LDS + 4 (hf ^ r % 8)) ^ 8 t (bit 0 of 2 t is clear, and
  // LDS, a power of 2, exceeds both 8 t and 4 (hf ^ r % 8)).
  static_assert((LDS & (LDS - 1)) == 0 && LDS >= 64, "the swizzle's XOR form needs a power-of-2 row stride");
  const int qa_i = ra * LDS + 4 * (hf ^ (ra & 7)), qb_i = qb_row * LDS + 4 * (hf ^ (qb_row & 7));

  // Rows [0, n) of a (b, h) slice into a tile: lane l copies 16-byte chunk l % DCH of rows l / DCH,
  // + 32 / DCH, ...; chunks past head_dim are skipped. Q's chunk c of row r lands at chunk c ^ (r % 8).
  auto copy_rows = [&](float* dst, const float* src, int64_t sl, int n, bool swz) {
    constexpr int RS = 32 / DCH;
    const int c = lane % DCH, r0 = lane / DCH;
    if (c >= CH) return;
    src += r0 * sl + 4 * c;
#pragma unroll 4
    for (int r = r0; r < n; r += RS, src += RS * sl) cp_async16(dst + r * LDS + 4 * (swz ? c ^ (r & 7) : c), src, true);
  };

  int64_t p = static_cast<int64_t>(blockIdx.x) * T::warps + warp;
  int64_t b = p / a.H, h = p - b * a.H;
  if (p < P) {
    copy_rows(Qs, a.q.head(b, h), a.q.sl, Lq, true);
    copy_rows(Ks, a.k.head(b, h), a.k.sl, Lk, false);
  }
  cp_async_commit();
  if (p < P) copy_rows(Vs, a.v.head(b, h), a.v.sl, Lk, false);
  cp_async_commit();
  for (; p < P; p += step) {
    const int64_t pn = p + step;
    int64_t bn = b + step_b, hn = h + step_h;
    if (hn >= a.H) {
      hn -= a.H;
      ++bn;
    }
    cp_async_wait_one();  // this problem's Q and K have landed (its V may still be in flight)
    __syncwarp();

    // This half's partial scores of rows ra (sa) and rb (sb).
    float sa[NL], sb[NL];
#pragma unroll
    for (int j = 0; j < NL; ++j) sa[j] = sb[j] = 0.f;
#pragma unroll 1
    for (int t = 0; t < ND8; ++t) {
      const float4 qa = lds4(Qs + (qa_i ^ (8 * t))), qb = lds4(Qs + (qb_i ^ (8 * t)));
      const float* kc = Ks + 4 * hf + 8 * t;
      over_keys<NL>([&](int j) { return lds4(kc + j * LDS); },
                    [&](int j, const float4& kv) {
                      sa[j] = dot4(qa, kv, sa[j]);
                      sb[j] = dot4(qb, kv, sb[j]);
                    });
    }
#pragma unroll
    for (int j = 0; j < NL; ++j) {
      sa[j] += __shfl_xor_sync(kFullMask, sa[j], 16);
      sb[j] += __shfl_xor_sync(kFullMask, sb[j], 16);
    }
    __syncwarp();  // Q and K are read: the next problem's may land
    if (pn < P) {
      copy_rows(Qs, a.q.head(bn, hn), a.q.sl, Lq, true);
      copy_rows(Ks, a.k.head(bn, hn), a.k.sl, Lk, false);
    }
    cp_async_commit();

    // Scale, mask and bounds in log2 units as the tensor-core kernels do; every key is here, so a plain
    // softmax: p = 2^(s cs - m) with m the row max of s cs. A row with no finite score exponentiates
    // against 0: p = 0, l = 0 (out 0, lse -inf).
    float ma, mb, cs;
    if (a.mask.kind == kNoMask) {
      // s stays unscaled (cs = sl2, folded into the exponent's FMA: one op a score fewer): the max of
      // s sl2 is sl2 times the max of s, or of its min where sl2 < 0 (rounding is monotone).
      float xa = sl2 >= 0.f ? neg_inf<float>() : -neg_inf<float>(), xb = xa;
      if (sl2 >= 0.f) {
#pragma unroll
        for (int j = 0; j < NL; ++j)
          if (j < KMIN || j < Lk) {
            xa = fmaxf(xa, sa[j]);
            xb = fmaxf(xb, sb[j]);
          }
      } else {
#pragma unroll
        for (int j = 0; j < NL; ++j)
          if (j < KMIN || j < Lk) {
            xa = fminf(xa, sa[j]);
            xb = fminf(xb, sb[j]);
          }
      }
      ma = xa * sl2;
      mb = xb * sl2;
      cs = sl2;
    } else {
      const int64_t moff = b * a.mask.sb + h * a.mask.sh;
#pragma unroll
      for (int j = 0; j < NL; ++j) {
        float xa = neg_inf<float>(), xb = neg_inf<float>();
        if (j < KMIN || j < Lk) {  // rows past q_len are never stored: no mask read
          xa = sa[j] * sl2;
          xb = sb[j] * sl2;
          if (ra < Lq) xa += mask_add<float, float>(a.mask, moff + ra * a.mask.sq + j * a.mask.sk) * kLog2e;
          if (rb < Lq) xb += mask_add<float, float>(a.mask, moff + rb * a.mask.sq + j * a.mask.sk) * kLog2e;
        }
        sa[j] = xa;
        sb[j] = xb;
      }
      ma = mb = neg_inf<float>();
#pragma unroll
      for (int j = 0; j < NL; ++j) {
        ma = fmaxf(ma, sa[j]);
        mb = fmaxf(mb, sb[j]);
      }
      cs = 1.f;
    }
    const float ua = ma == neg_inf<float>() ? 0.f : ma, ub = mb == neg_inf<float>() ? 0.f : mb;
    float la = 0.f, lb = 0.f;
    // One MUFU op an exponential (exp2f adds a range fix-up for subnormal results: p < 2^-126 of the
    // row's largest, flushed to 0 here). Keys past kv_len get p = 0.
#pragma unroll
    for (int j = 0; j < NL; ++j) {
      sa[j] = j < KMIN || j < Lk ? ex2_approx(fmaf(sa[j], cs, -ua)) : 0.f;
      sb[j] = j < KMIN || j < Lk ? ex2_approx(fmaf(sb[j], cs, -ub)) : 0.f;
      la += sa[j];
      lb += sb[j];
    }

    cp_async_wait_one();  // this problem's V has landed (the next Q and K may still be in flight)
    __syncwarp();
    const float ia = la > 0.f ? 1.f / la : 0.f, ib = lb > 0.f ? 1.f / lb : 0.f;
    // This lane's rows at its chunk 2 t + hf, advanced by 8 dims a step; rows past q_len are not stored.
    const bool st_a = ra < Lq, st_b = rb < Lq;
    float* oa = a.out + (p * Lq + ra) * D + 4 * hf;
    float* ob = oa + 16 * D;
#pragma unroll 1
    for (int t = 0; t < ND8; ++t, oa += 8, ob += 8) {
      const int c = 2 * t + hf;
      const float* vc = Vs + 4 * hf + 8 * t;
      float4 acc_a = make_float4(0.f, 0.f, 0.f, 0.f), acc_b = acc_a;
      over_keys<NL>([&](int j) { return lds4(vc + j * LDS); },
                    [&](int j, const float4& vv) {
                      fma4(acc_a, sa[j], vv);
                      fma4(acc_b, sb[j], vv);
                    });
      if (st_a && c < CH)
        *reinterpret_cast<float4*>(oa) = make_float4(acc_a.x * ia, acc_a.y * ia, acc_a.z * ia, acc_a.w * ia);
      if (st_b && c < CH)
        *reinterpret_cast<float4*>(ob) = make_float4(acc_b.x * ib, acc_b.y * ib, acc_b.z * ib, acc_b.w * ib);
    }
    // lse: the lower half writes row ra, the upper row rb (both hold both).
    const int row = hf ? rb : ra;
    const float l = hf ? lb : la, m = hf ? mb : ma;
    if (row < Lq) a.lse_out[p * Lq + row] = l > 0.f ? (m + log2f(l)) * kLn2 : neg_inf<float>();
    __syncwarp();  // V is read: the next problem's may land
    if (pn < P) copy_rows(Vs, a.v.head(bn, hn), a.v.sl, Lk, false);
    cp_async_commit();
    b = bn;
    h = hn;
  }
  cp_async_wait_all();
}

// The fp32 short kernel's buckets (max(q_len, kv_len) > 16): f(DP, NL, KMIN) with DP = head_dim padded to
// 64 or 128, NL rows = max(q_len, kv_len) rounded up to 4 (25 exact where both are <= 25 and kv_len is 25)
// and KMIN keys known present.
template <typename F>
void dispatch_fp32_short(int64_t Lq, int64_t Lk, int64_t D, F&& f) {
  const int64_t L = std::max(Lq, Lk);
  auto by_rows = [&](auto dp) {
    using std::integral_constant;
    if constexpr (decltype(dp)::value == 64) {
      if (Lk == 25 && Lq <= 25) return f(dp, integral_constant<int, 25>{}, integral_constant<int, 25>{});
    }
    if (L <= 20) f(dp, integral_constant<int, 20>{}, integral_constant<int, 1>{});
    else if (L <= 24) f(dp, integral_constant<int, 24>{}, integral_constant<int, 1>{});
    else if (L <= 28) f(dp, integral_constant<int, 28>{}, integral_constant<int, 1>{});
    else f(dp, integral_constant<int, 32>{}, integral_constant<int, 1>{});
  };
  if (D <= 64) by_rows(std::integral_constant<int, 64>{});
  else by_rows(std::integral_constant<int, 128>{});
}

// fp32 on Hopper (sm_90a builds on compute capability 9.0, head_dim <= 64): the 3xTF32 products on
// warpgroup MMA, which runs TF32 at ~4x the rate mma.sync reaches here (bench/notes/attention.md,
// version 9). TF32 wgmma reads both shared-memory operands K-major only and takes no rounding, so the
// operands are split in shared memory before the products: Q once by its warpgroup, each K / V tile by
// warps 1-3 of the producer warpgroup ("splitters") while the consumers work on the previous tile.
// K is rounded in place with its tails beside it; V lands as stored and is written transposed
// ([keys / 32][head_dim][128 B]: K-major for O += P V), its keys within each 8 in the order
// (0, 2, 4, 6, 1, 3, 5, 7), so that P's A fragment is the S accumulators' registers as they are (the
// mma.sync kernel's trick). Per tile and warpgroup: S = Ql Kh + Qh Kl + Qh Kh (small terms first),
// the online softmax in fp32 with exp2f, P split in registers, P V into fresh accumulators added
// to O with rounded FMAs (the tensor cores' accumulation drifts over long chains: version 5d).
struct WgTf32Tile {
  static constexpr int DP = 64;
  static constexpr int WG = 2;  // consumer warpgroups
  static constexpr int threads = 128 * (WG + 1);
  static constexpr int regs_producer = 56, regs_consumer = 224;  // 56 + 2 * 224 <= 512
  static constexpr int BM = 64 * WG, BN = 64, kStages = 2;
  static constexpr int kSplitters = 96;  // warps 1-3 of the producer warpgroup
  static constexpr int q_bytes = BM * DP * 4;
  static constexpr int kv_bytes = BN * DP * 4;  // one stage of one operand
  // [Q hi][Q lo][K hi x S][V as landed x S][K lo x S][V^T hi x S][V^T lo x S], then the mbarriers
  static constexpr int bar_off = 2 * q_bytes + 5 * kStages * kv_bytes;
  static constexpr size_t smem_bytes = bar_off + 8 * (1 + 3 * kStages) + 1024;  // + slack to align to 1024
};

__device__ __forceinline__ float4 split4_tf32(float4& x) {  // x becomes its TF32 head; returns the tails
  unsigned h, l;
  float4 lo;
  split_tf32(x.x, h, l), x.x = __uint_as_float(h), lo.x = __uint_as_float(l);
  split_tf32(x.y, h, l), x.y = __uint_as_float(h), lo.y = __uint_as_float(l);
  split_tf32(x.z, h, l), x.z = __uint_as_float(h), lo.z = __uint_as_float(l);
  split_tf32(x.w, h, l), x.w = __uint_as_float(h), lo.w = __uint_as_float(l);
  return lo;
}
// Vectors i0, i0 + step, ... < n of hi rounded in place, their tails into lo (elementwise: any swizzle
// is the same for both).
__device__ __forceinline__ void split_in_place(float4* hi, float4* lo, int n, int i0, int step) {
  for (int i = i0; i < n; i += step) {
    float4 x = hi[i];
    lo[i] = split4_tf32(x);
    hi[i] = x;
  }
}

__global__ void __launch_bounds__(WgTf32Tile::threads, 1)
    attn_fwd_tf32_wgmma_kernel(const AttnArgs<float, float> a, const __grid_constant__ CUtensorMap tq,
                               const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = WgTf32Tile;
  constexpr int DP = T::DP, BM = T::BM, BN = T::BN, S = T::kStages;

  // Tiles are [DP / 32][rows][128 B] in the 128-byte swizzle (16-byte chunk j of row r at j ^ (r % 8)),
  // each on a 1024-byte boundary.
  unsigned char* raw = dyn_smem();
  const uint32_t raw_addr = smem_addr(raw);
  const uint32_t sQh = (raw_addr + 1023u) & ~1023u, sQl = sQh + T::q_bytes;
  const uint32_t sK = sQl + T::q_bytes, sV = sK + S * T::kv_bytes, sKl = sV + S * T::kv_bytes;
  const uint32_t sVh = sKl + S * T::kv_bytes, sVl = sVh + S * T::kv_bytes;
  unsigned char* base = raw + (sQh - raw_addr);  // generic pointer to sQh
  auto ptr = [&](uint32_t addr) { return reinterpret_cast<float*>(base + (addr - sQh)); };
  const uint32_t bar = sQh + T::bar_off;  // q_full, full[S], split[S], empty[S]
  auto full = [&](int st) { return bar + 8 * (1 + st); };
  auto split = [&](int st) { return bar + 8 * (1 + S + st); };
  auto empty = [&](int st) { return bar + 8 * (1 + 2 * S + st); };

  const int64_t nqb = (a.Lq + BM - 1) / BM;
  const int64_t bh = blockIdx.x / nqb, q0 = (blockIdx.x % nqb) * BM;
  const int b = static_cast<int>(bh / a.H), h = static_cast<int>(bh % a.H);
  const int tid = threadIdx.x, wg = tid / 128;
  const int64_t nkt = (a.Lk + BN - 1) / BN;

  if (tid == 0) {
    init_barriers<1>(bar, {1});
    init_barriers<S>(bar + 8, {1, T::kSplitters, 4 * T::WG});  // full, split, empty
  }
  __syncthreads();

  if (wg == 0) {
    wgmma::setmaxnreg_dec<T::regs_producer>();
    if (tid == 0) {
      load_tile<DP, BM, 32>(sQh, &tq, bar, T::q_bytes, q0, h, b);
      stream_tiles<DP, BN, S, 32>(&tk, &tv, sK, sV, T::kv_bytes, nkt, h, b, full, empty, 0, [](int64_t, int) {});
    } else if (tid >= 32) {
      const int sid = tid - 32;
      for (int64_t t = 0; t < nkt; ++t) {
        const int st = static_cast<int>(t % S);
        wgmma::mbar_wait(full(st), static_cast<uint32_t>((t / S) & 1));
        // The tile's previous readers are done: the copy into this stage waited for them (empty).
        split_in_place(reinterpret_cast<float4*>(ptr(sK + st * T::kv_bytes)),
                       reinterpret_cast<float4*>(ptr(sKl + st * T::kv_bytes)), T::kv_bytes / 16, sid, T::kSplitters);
        // V: item i is head_dim column d (lanes: consecutive d, one 128-byte row of V per read) and the
        // chunk ch of 4 permuted keys: key (ch / 2) * 8 + 2 j + ch % 2 at position 4 ch + j.
        const float* vr = ptr(sV + st * T::kv_bytes);
        float* vh = ptr(sVh + st * T::kv_bytes);
        float* vl = ptr(sVl + st * T::kv_bytes);
        for (int i = sid; i < DP * BN / 4; i += T::kSplitters) {
          const int d = i % DP, ch = i / DP;
          float4 x;
          float* xs = &x.x;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int r = (ch / 2) * 8 + 2 * j + ch % 2;
            xs[j] = vr[(d / 32) * BN * 32 + r * 32 + ((((d % 32) / 4) ^ (r % 8)) * 4) + d % 4];
          }
          const float4 lo = split4_tf32(x);
          const int o = (ch / 8) * DP * 32 + d * 32 + ((ch % 8) ^ (d % 8)) * 4;
          *reinterpret_cast<float4*>(vh + o) = x;
          *reinterpret_cast<float4*>(vl + o) = lo;
        }
        wgmma::fence_proxy_async();  // the writes above are read by wgmma (the async proxy)
        wgmma::mbar_arrive(split(st));
      }
    }
    return;
  }
  wgmma::setmaxnreg_inc<T::regs_consumer>();

  const int cw = wg - 1, ct = tid % 128, warp = ct / 32, lane = tid % 32;
  const int g = lane >> 2, tig = lane & 3;
  const int64_t moff = b * a.mask.sb + a.mask.sh * h;

  // This warpgroup's 64 query rows: rounded in place, tails beside them; then visible to its wgmma.
  wgmma::mbar_wait(bar, 0);
#pragma unroll
  for (int c = 0; c < DP / 32; ++c) {
    const uint32_t off = c * BM * 128 + cw * 64 * 128;
    split_in_place(reinterpret_cast<float4*>(ptr(sQh + off)), reinterpret_cast<float4*>(ptr(sQl + off)), 64 * 128 / 16, ct,
                   128);
  }
  wgmma::fence_proxy_async();
  wgmma::named_sync(1 + cw, 128);

  float o[DP / 2];
#pragma unroll
  for (int i = 0; i < DP / 2; ++i) o[i] = 0.f;
  float m_r[2] = {neg_inf<float>(), neg_inf<float>()}, l_r[2] = {0.f, 0.f};
  const float sl2 = a.scale * kLog2e;
  const int64_t row_base = q0 + cw * 64 + warp * 16 + g;
  const uint64_t dqh = wgmma::desc_sw128(sQh + cw * 64 * 128, 16, 1024);
  const uint64_t dql = wgmma::desc_sw128(sQl + cw * 64 * 128, 16, 1024);
  const uint64_t dkh = wgmma::desc_sw128(sK, 16, 1024), dkl = wgmma::desc_sw128(sKl, 16, 1024);
  const uint64_t dvh = wgmma::desc_sw128(sVh, 16, 1024), dvl = wgmma::desc_sw128(sVl, 16, 1024);

  for (int64_t t = 0; t < nkt; ++t) {
    const int st = static_cast<int>(t % S);
    const uint32_t stage = st * T::kv_bytes;
    wgmma::mbar_wait(split(st), static_cast<uint32_t>((t / S) & 1));

    // S: K-steps of 8 dims, 32 bytes apart inside a 128-byte line, lines of 32 dims apart.
    float s[BN / 8][4];
    float(&sf)[BN / 2] = reinterpret_cast<float(&)[BN / 2]>(s);
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < DP / 8; ++ks) {
      const uint32_t qa = ((ks / 4) * BM * 128 + (ks % 4) * 32) >> 4;
      const uint32_t kb = (stage + (ks / 4) * BN * 128 + (ks % 4) * 32) >> 4;
      wgmma::mma_m64n64k8_tf32_ss(sf, dql + qa, dkh + kb, ks);
      wgmma::mma_m64n64k8_tf32_ss(sf, dqh + qa, dkl + kb, 1);
      wgmma::mma_m64n64k8_tf32_ss(sf, dqh + qa, dkh + kb, 1);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_regs(sf);

    const int64_t k0 = t * BN;
    float mx[2], corr[2], m_use[2];
    scale_scores(a, s, mx, k0, row_base, moff, sl2, tig);
    online_max(mx, m_r, l_r, corr, m_use);
    // P of key group j as the A fragment (rows g, g + 8 of the warp's 16).
    unsigned ph[BN / 8][4], pl[BN / 8][4];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) p_fragment_tf32(s[j], m_use, l_r, ph[j], pl[j]);

    // P V: V^T's K-steps of 8 keys are 32 bytes apart, lines of 32 keys DP * 128 bytes apart.
    float pv[DP / 2];
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < BN / 8; ++kk) {
      const uint32_t vb = (stage + (kk / 4) * DP * 128 + (kk % 4) * 32) >> 4;
      wgmma::mma_m64n64k8_tf32_rs(pv, pl[kk], dvh + vb, kk);
      wgmma::mma_m64n64k8_tf32_rs(pv, ph[kk], dvl + vb, 1);
      wgmma::mma_m64n64k8_tf32_rs(pv, ph[kk], dvh + vb, 1);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_regs(pv);
    if (lane == 0) wgmma::mbar_arrive(empty(st));  // this warp is done reading the stage
#pragma unroll
    for (int i = 0; i < DP / 2; ++i) o[i] = fmaf(o[i], corr[(i >> 1) & 1], pv[i]);
  }

  store_rows(a, o, m_r, l_r, bh, row_base, tig);
#endif
}

// ---------------------------------------------------------------------------------------------
// Backward.

// delta[bh, i] = sum_d dO * O - grad_lse: a warp per row.
template <typename scalar_t, typename acc_t>
__global__ void __launch_bounds__(kRowThreads) attn_bwd_delta_kernel(const AttnArgs<scalar_t, acc_t> a) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= a.B * a.H * a.Lq) return;  // uniform per warp
  const int64_t bh = row / a.Lq, i = row % a.Lq, b = bh / a.H, h = bh % a.H;
  const scalar_t* dr = a.dout.head(b, h) + i * a.dout.sl;
  const scalar_t* orow = a.o.head(b, h) + i * a.o.sl;
  acc_t s = 0;
  for (int d = lane; d < a.D; d += 32)
    s += static_cast<acc_t>(dr[d * a.dout.sd]) * static_cast<acc_t>(orow[d * a.o.sd]);
  s = warp_sum(s);
  if (lane == 0) a.delta[row] = s - (a.grad_lse ? a.grad_lse[row] : acc_t(0));
}

// P and dS of score (i, j) given the dot products q.k and dO.v; P = 0 where masked, past the end
// or on a fully masked row (lse = -inf).
template <typename scalar_t, typename acc_t>
__device__ __forceinline__ void p_ds(const AttnArgs<scalar_t, acc_t>& a, bool valid, acc_t qk, acc_t dov,
                                     acc_t lse, acc_t delta, int64_t mask_off, acc_t& p, acc_t& ds) {
  p = 0;
  ds = 0;
  if (!valid || lse == neg_inf<acc_t>()) return;
  acc_t s = qk * a.scale;
  if (a.mask.kind != kNoMask) s += mask_add<scalar_t, acc_t>(a.mask, mask_off);
  p = exp_(s - lse);
  ds = p * (dov - delta);
}

// dq = scale * sum_j dS_ij k_j: a block per (b, h, 16 query rows), key tiles through shared memory.
template <typename scalar_t, typename acc_t, int DPL>
__global__ void __launch_bounds__(kRowThreads) attn_bwd_dq_kernel(const AttnArgs<scalar_t, acc_t> a) {
  const int D = a.D, ld = a.ld, nv = (D * static_cast<int>(sizeof(acc_t)) + 15) / 16;
  acc_t* Qs = reinterpret_cast<acc_t*>(dyn_smem());  // [kRowBlock][ld]
  acc_t* dOs = Qs + kRowBlock * ld;                   // [kRowBlock][ld]
  acc_t* Ks = dOs + kRowBlock * ld;                   // [kTile][ld]
  acc_t* Vs = Ks + kTile * ld;                        // [kTile][ld]

  const int64_t nqb = (a.Lq + kRowBlock - 1) / kRowBlock;
  const int64_t bh = blockIdx.x / nqb, q0 = (blockIdx.x % nqb) * kRowBlock;
  const int64_t b = bh / a.H, h = bh % a.H;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t moff = b * a.mask.sb + a.mask.sh * h;

  stage_rows(Qs, ld, a.q, a.q.head(b, h), q0, kRowBlock, a.Lq, D);
  stage_rows(dOs, ld, a.dout, a.dout.head(b, h), q0, kRowBlock, a.Lq, D);
  acc_t lse[kRowsPerWarp], delta[kRowsPerWarp], dq[kRowsPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t i = q0 + warp * kRowsPerWarp + r;
    lse[r] = i < a.Lq ? a.lse[bh * a.Lq + i] : neg_inf<acc_t>();
    delta[r] = i < a.Lq ? a.delta[bh * a.Lq + i] : acc_t(0);
#pragma unroll
    for (int t = 0; t < DPL; ++t) dq[r][t] = 0;
  }

  for (int64_t k0 = 0; k0 < a.Lk; k0 += kTile) {
    const int nk = static_cast<int>(a.Lk - k0 < kTile ? a.Lk - k0 : kTile);
    __syncthreads();
    stage_rows(Ks, ld, a.k, a.k.head(b, h), k0, kTile, a.Lk, D);
    stage_rows(Vs, ld, a.v, a.v.head(b, h), k0, kTile, a.Lk, D);
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int row = warp * kRowsPerWarp + r;
      const int64_t i = q0 + row;
      if (i >= a.Lq || lse[r] == neg_inf<acc_t>()) continue;  // uniform per warp
      acc_t p, ds;
      const bool valid = lane < nk;
      const acc_t qk = valid ? dot(Qs + row * ld, Ks + lane * ld, nv) : acc_t(0);
      const acc_t dov = valid ? dot(dOs + row * ld, Vs + lane * ld, nv) : acc_t(0);
      p_ds(a, valid, qk, dov, lse[r], delta[r], moff + i * a.mask.sq + (k0 + lane) * a.mask.sk, p, ds);
      for (int j = 0; j < nk; ++j) {
        const acc_t dsj = __shfl_sync(kFullMask, ds, j);
        const acc_t* kr = Ks + j * ld;
#pragma unroll
        for (int t = 0; t < DPL; ++t) {
          const int d = lane + 32 * t;
          if (d < D) dq[r][t] += dsj * kr[d];
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t i = q0 + warp * kRowsPerWarp + r;
    if (i >= a.Lq) continue;
    scalar_t* out = a.dq + (bh * a.Lq + i) * D;
#pragma unroll
    for (int t = 0; t < DPL; ++t) {
      const int d = lane + 32 * t;
      if (d < D) out[d] = static_cast<scalar_t>(dq[r][t] * a.scale);
    }
  }
}

// dv = sum_i P_ij dO_i, dk = scale * sum_i dS_ij q_i: a block per (b, h, 16 key rows), query tiles
// (q, dO, lse, delta) through shared memory, a warp per key row and one query per lane.
template <typename scalar_t, typename acc_t, int DPL>
__global__ void __launch_bounds__(kRowThreads) attn_bwd_dkdv_kernel(const AttnArgs<scalar_t, acc_t> a) {
  const int D = a.D, ld = a.ld, nv = (D * static_cast<int>(sizeof(acc_t)) + 15) / 16;
  acc_t* Kb = reinterpret_cast<acc_t*>(dyn_smem());  // [kRowBlock][ld]
  acc_t* Vb = Kb + kRowBlock * ld;                    // [kRowBlock][ld]
  acc_t* Qt = Vb + kRowBlock * ld;                    // [kTile][ld]
  acc_t* dOt = Qt + kTile * ld;                       // [kTile][ld]
  acc_t* lse_t = dOt + kTile * ld;                    // [kTile]
  acc_t* delta_t = lse_t + kTile;                     // [kTile]

  const int64_t nkb = (a.Lk + kRowBlock - 1) / kRowBlock;
  const int64_t bh = blockIdx.x / nkb, k0 = (blockIdx.x % nkb) * kRowBlock;
  const int64_t b = bh / a.H, h = bh % a.H;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t moff = b * a.mask.sb + a.mask.sh * h;

  stage_rows(Kb, ld, a.k, a.k.head(b, h), k0, kRowBlock, a.Lk, D);
  stage_rows(Vb, ld, a.v, a.v.head(b, h), k0, kRowBlock, a.Lk, D);
  acc_t dk[kRowsPerWarp][DPL], dv[kRowsPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
#pragma unroll
    for (int t = 0; t < DPL; ++t) dk[r][t] = dv[r][t] = 0;

  for (int64_t q0 = 0; q0 < a.Lq; q0 += kTile) {
    const int nq = static_cast<int>(a.Lq - q0 < kTile ? a.Lq - q0 : kTile);
    __syncthreads();
    stage_rows(Qt, ld, a.q, a.q.head(b, h), q0, kTile, a.Lq, D);
    stage_rows(dOt, ld, a.dout, a.dout.head(b, h), q0, kTile, a.Lq, D);
    if (threadIdx.x < kTile) {
      const int64_t i = q0 + threadIdx.x;
      lse_t[threadIdx.x] = i < a.Lq ? a.lse[bh * a.Lq + i] : neg_inf<acc_t>();
      delta_t[threadIdx.x] = i < a.Lq ? a.delta[bh * a.Lq + i] : acc_t(0);
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int row = warp * kRowsPerWarp + r;
      const int64_t j = k0 + row;
      if (j >= a.Lk) continue;  // uniform per warp
      const bool valid = lane < nq;
      const acc_t qk = valid ? dot(Qt + lane * ld, Kb + row * ld, nv) : acc_t(0);
      const acc_t dov = valid ? dot(dOt + lane * ld, Vb + row * ld, nv) : acc_t(0);
      acc_t p, ds;
      p_ds(a, valid, qk, dov, lse_t[lane], delta_t[lane], moff + (q0 + lane) * a.mask.sq + j * a.mask.sk, p, ds);
      for (int i = 0; i < nq; ++i) {
        const acc_t pi = __shfl_sync(kFullMask, p, i);
        const acc_t dsi = __shfl_sync(kFullMask, ds, i);
        const acc_t* qr = Qt + i * ld;
        const acc_t* dor = dOt + i * ld;
#pragma unroll
        for (int t = 0; t < DPL; ++t) {
          const int d = lane + 32 * t;
          if (d < D) {
            dv[r][t] += pi * dor[d];
            dk[r][t] += dsi * qr[d];
          }
        }
      }
    }
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t j = k0 + warp * kRowsPerWarp + r;
    if (j >= a.Lk) continue;
    scalar_t* dkr = a.dk.head(b, h) + j * a.dk.sl;
    scalar_t* dvr = a.dv.head(b, h) + j * a.dv.sl;
#pragma unroll
    for (int t = 0; t < DPL; ++t) {
      const int d = lane + 32 * t;
      if (d < D) {
        dkr[d * a.dk.sd] = static_cast<scalar_t>(dk[r][t] * a.scale);
        dvr[d * a.dv.sd] = static_cast<scalar_t>(dv[r][t]);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward on the tensor cores (fp16 / bf16, head_dim <= 128 and % 8 == 0): FlashAttention-2's
// recomputation from lse, in two kernels so that no gradient is accumulated by atomics
// (deterministic, no float workspace):
//   dkdv: a block per (b, h, 64 keys), a warp per 16 keys; query tiles (q, dO, lse, delta) stream
//         through shared memory, double-buffered: S^T = K Q^T, P^T = exp(S^T - lse), dP^T = V dO^T,
//         dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q.
//   dq:   a block per (b, h, 64 queries), a warp per 16 queries; key tiles stream: S = Q K^T,
//         dP = dO V^T, dS = P (dP - delta), dQ += dS K.
// Both recompute S and dP: seven products per (query, key) pair where FlashAttention-2 has five, the
// price of determinism. P and dS enter their products rounded to the input type, as in the forward.
template <int DP>
struct BwdTile {
  static constexpr int BR = 64;                  // rows a block owns (keys in dkdv, queries in dq)
  static constexpr int BC = DP <= 64 ? 64 : 32;  // rows of each streamed tile
  static constexpr int LDS = DP + 8;             // padded row, as MmaTile
  static constexpr bool kFragsInRegs = DP <= 64; // dq: the warp's own Q / dO fragments stay in registers
  // dk / dv read their K / V fragments from shared memory at every tile instead: at head_dim 64
  // that brings the kernel to 168 registers, 3 blocks an SM (2 with them in registers: 8 % slower).
  static constexpr int dkdv_min_blocks = DP <= 64 ? 3 : 1;
  // Two resident [BR] operands, two double-buffered [BC] operands, and (dkdv) lse / delta per stage.
  static constexpr size_t smem_bytes = static_cast<size_t>(2 * BR + 4 * BC) * LDS * 2 + 4 * BC * sizeof(float);
};

// A fragments (m16 x k16) of rows row0 .. row0 + 15 of a [rows][LDS] tile, k-step ks.
template <int LDS, typename scalar_t>
__device__ __forceinline__ void a_frag(unsigned (&f)[4], const scalar_t* tile, int row0, int lane, int ks) {
  ldmatrix_x4(f, tile + (row0 + (lane % 8) + ((lane / 8) % 2) * 8) * LDS + ks * 16 + (lane / 16) * 8);
}
// B fragments (k16 x n8) of n-tiles j, j + 1 where the tile's rows are the n index (b[0..1], b[2..3]).
template <int LDS, typename scalar_t>
__device__ __forceinline__ void rows_b_frag(unsigned (&f)[4], const scalar_t* tile, int lane, int j, int ks) {
  ldmatrix_x4(f, tile + (j * 8 + (lane / 16) * 8 + (lane % 8)) * LDS + ks * 16 + ((lane / 8) % 2) * 8);
}
// B fragments where the tile's rows are the k index (k-step kk) and its columns the n index.
template <int LDS, typename scalar_t>
__device__ __forceinline__ void cols_b_frag(unsigned (&f)[4], const scalar_t* tile, int lane, int j, int kk) {
  ldmatrix_x4_trans(f, tile + (kk * 16 + ((lane / 8) % 2) * 8 + (lane % 8)) * LDS + j * 8 + (lane / 16) * 8);
}
// Rows [r0, r0 + rows) of a (b, h) slice into a [rows][LDS] tile with cp.async; rows past L and dims
// past D are zero-filled.
template <int DP, int LDS, typename scalar_t>
__device__ __forceinline__ void load_tile(scalar_t* dst, const scalar_t* src, int64_t sl, int64_t r0, int rows, int64_t L,
                                          int D) {
  constexpr int CH = DP / 8;
  for (int e = threadIdx.x; e < rows * CH; e += blockDim.x) {
    const int r = e / CH, c = e % CH;
    const bool ok = r0 + r < L && c * 8 < D;
    cp_async16(dst + r * LDS + c * 8, ok ? src + (r0 + r) * sl + c * 8 : src, ok);
  }
}
// The A fragment of k-step kk of a product whose left operand is a 16-row accumulator tile x (P, dS, or
// their transposes): the m16n8 accumulators of 8-column tiles 2kk, 2kk + 1, packed to the input type.
template <typename scalar_t, int NT>
__device__ __forceinline__ void pack_a_frag(unsigned (&f)[4], const float (&x)[NT][4], int kk) {
  using MT = MmaTraits<scalar_t>;
  f[0] = MT::pack(x[2 * kk][0], x[2 * kk][1]);
  f[1] = MT::pack(x[2 * kk][2], x[2 * kk][3]);
  f[2] = MT::pack(x[2 * kk + 1][0], x[2 * kk + 1][1]);
  f[3] = MT::pack(x[2 * kk + 1][2], x[2 * kk + 1][3]);
}

// The backward's paired products over head dims: s = A1 B1^T and dp = A2 B2^T for 16 rows, whose A
// fragments a1(f, ks) / a2(f, ks) give, against the 8 NT rows of the [rows][LDS] tiles B1, B2 (S with
// dP, or S^T with dP^T). kBound: stop at the last k-step holding dims below D.
template <int LDS, int KS, bool kBound, int NT, typename scalar_t, typename FragA1, typename FragA2>
__device__ __forceinline__ void paired_products(float (&s)[NT][4], float (&dp)[NT][4], FragA1&& a1, FragA2&& a2,
                                                const scalar_t* B1, const scalar_t* B2, int lane, int D) {
  using MT = MmaTraits<scalar_t>;
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] = dp[j][e] = 0.f;
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    if (kBound && ks * 16 >= D) break;
    unsigned f1[4], f2[4];
    a1(f1, ks);
    a2(f2, ks);
#pragma unroll
    for (int j = 0; j < NT; j += 2) {
      unsigned b1[4], b2[4];
      rows_b_frag<LDS>(b1, B1, lane, j, ks);
      MT::mma(s[j], f1, b1[0], b1[1]);
      MT::mma(s[j + 1], f1, b1[2], b1[3]);
      rows_b_frag<LDS>(b2, B2, lane, j, ks);
      MT::mma(dp[j], f2, b2[0], b2[1]);
      MT::mma(dp[j + 1], f2, b2[2], b2[3]);
    }
  }
}

template <typename scalar_t, int DP>
__global__ void __launch_bounds__(kMmaThreads, BwdTile<DP>::dkdv_min_blocks) attn_bwd_dkdv_mma_kernel(const AttnArgs<scalar_t, float> a) {
  using T = BwdTile<DP>;
  constexpr int BR = T::BR, BC = T::BC, LDS = T::LDS;
  constexpr int NT = BC / 8, KS = DP / 16, DT = DP / 8;
  using MT = MmaTraits<scalar_t>;

  scalar_t* Ks = reinterpret_cast<scalar_t*>(dyn_smem());  // [BR][LDS]
  scalar_t* Vs = Ks + BR * LDS;                             // [BR][LDS]
  scalar_t* Qs = Vs + BR * LDS;                             // [2][BC][LDS]
  scalar_t* dOs = Qs + 2 * BC * LDS;                        // [2][BC][LDS]
  float* lse_s = reinterpret_cast<float*>(dOs + 2 * BC * LDS);  // [2][BC], log2 units
  float* delta_s = lse_s + 2 * BC;                               // [2][BC]

  const int D = a.D;
  const int64_t nkb = (a.Lk + BR - 1) / BR;
  const int64_t bh = blockIdx.x / nkb, k0 = (blockIdx.x % nkb) * BR;
  const int64_t b = bh / a.H, h = bh % a.H;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, tig = lane & 3;
  const scalar_t* qh = a.q.head(b, h);
  const scalar_t* doh = a.dout.head(b, h);
  const int64_t moff = b * a.mask.sb + a.mask.sh * h;

  load_tile<DP, LDS>(Ks, a.k.head(b, h), a.k.sl, k0, BR, a.Lk, D);
  load_tile<DP, LDS>(Vs, a.v.head(b, h), a.v.sl, k0, BR, a.Lk, D);
  auto load_q = [&](int buf, int64_t q0) {
    load_tile<DP, LDS>(Qs + buf * BC * LDS, qh, a.q.sl, q0, BC, a.Lq, D);
    load_tile<DP, LDS>(dOs + buf * BC * LDS, doh, a.dout.sl, q0, BC, a.Lq, D);
    for (int r = tid; r < BC; r += kMmaThreads) {
      const int64_t i = q0 + r;
      float l2 = std::numeric_limits<float>::infinity(), dl = 0.f;
      if (i < a.Lq) {
        const float lse = a.lse[bh * a.Lq + i];
        if (lse != neg_inf<float>()) l2 = lse * kLog2e;
        dl = a.delta[bh * a.Lq + i];
      }
      lse_s[buf * BC + r] = l2;
      delta_s[buf * BC + r] = dl;
    }
  };
  load_q(0, 0);
  cp_async_commit();

  float dk[DT][4], dv[DT][4];
#pragma unroll
  for (int j = 0; j < DT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;
  const float sl2 = a.scale * kLog2e;
  const int64_t key_base = k0 + warp * 16 + g;   // this thread's key rows: key_base and key_base + 8
  const bool live = k0 + warp * 16 < a.Lk;       // uniform per warp: it has keys

  cp_async_wait_all();
  __syncthreads();

  const int64_t nqt = (a.Lq + BC - 1) / BC;
  for (int64_t t = 0; t < nqt; ++t) {
    const int buf = static_cast<int>(t & 1);
    if (t + 1 < nqt) load_q(buf ^ 1, (t + 1) * BC);  // overlaps with this tile's math
    cp_async_commit();
    const scalar_t* Qt = Qs + buf * BC * LDS;
    const scalar_t* dOt = dOs + buf * BC * LDS;
    const float* lt = lse_s + buf * BC;
    const float* dlt = delta_s + buf * BC;
    if (live) {
      // S^T = K Q^T and dP^T = V dO^T for the warp's 16 keys x BC queries.
      float s[NT][4], dp[NT][4];
      paired_products<LDS, KS, false>(
          s, dp, [&](unsigned (&f)[4], int ks) { a_frag<LDS>(f, Ks, warp * 16, lane, ks); },
          [&](unsigned (&f)[4], int ks) { a_frag<LDS>(f, Vs, warp * 16, lane, ks); }, Qt, dOt, lane, D);
      // P^T and dS^T: element e of tile j is (key key_base + 8 (e >> 1), query q0 + 8 j + 2 tig + (e & 1)).
      const int64_t q0 = t * BC;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = j * 8 + 2 * tig + (e & 1);
          float x = s[j][e] * sl2;
          if (a.mask.kind != kNoMask) {
            const int64_t key = key_base + (e >> 1) * 8, i = q0 + c;
            if (key < a.Lk && i < a.Lq) x += mask_add<scalar_t, float>(a.mask, moff + i * a.mask.sq + key * a.mask.sk) * kLog2e;
          }
          const float p = exp2f(x - lt[c]);
          s[j][e] = p;
          dp[j][e] = p * (dp[j][e] - dlt[c]);
        }
      }
      // dV += P^T dO and dK += dS^T Q: the accumulators of query tiles 2kk, 2kk + 1 are the A
      // fragments of k-step kk (as P in the forward).
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) {
        unsigned pa[4], da[4];
        pack_a_frag<scalar_t>(pa, s, kk);
        pack_a_frag<scalar_t>(da, dp, kk);
#pragma unroll
        for (int j = 0; j < DT; j += 2) {
          unsigned ob[4], qb[4];
          cols_b_frag<LDS>(ob, dOt, lane, j, kk);
          MT::mma(dv[j], pa, ob[0], ob[1]);
          MT::mma(dv[j + 1], pa, ob[2], ob[3]);
          cols_b_frag<LDS>(qb, Qt, lane, j, kk);
          MT::mma(dk[j], da, qb[0], qb[1]);
          MT::mma(dk[j + 1], da, qb[2], qb[3]);
        }
      }
    }
    cp_async_wait_all();
    __syncthreads();  // next tile landed; everyone is done with this one
  }

  // dk / dv rows key_base and key_base + 8 through their views (unit stride along D).
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int64_t key = key_base + rr * 8;
    if (key >= a.Lk) continue;
    scalar_t* dkr = a.dk.head(b, h) + key * a.dk.sl;
    scalar_t* dvr = a.dv.head(b, h) + key * a.dv.sl;
#pragma unroll
    for (int j = 0; j < DT; ++j) {
      const int d = j * 8 + 2 * tig;
      if (d < D) {
        *reinterpret_cast<unsigned*>(dkr + d) = MT::pack(dk[j][2 * rr] * a.scale, dk[j][2 * rr + 1] * a.scale);
        *reinterpret_cast<unsigned*>(dvr + d) = MT::pack(dv[j][2 * rr], dv[j][2 * rr + 1]);
      }
    }
  }
}

template <typename scalar_t, int DP>
__global__ void __launch_bounds__(kMmaThreads) attn_bwd_dq_mma_kernel(const AttnArgs<scalar_t, float> a) {
  using T = BwdTile<DP>;
  constexpr int BR = T::BR, BC = T::BC, LDS = T::LDS;
  constexpr int NT = BC / 8, KS = DP / 16, DT = DP / 8;
  using MT = MmaTraits<scalar_t>;

  scalar_t* Qs = reinterpret_cast<scalar_t*>(dyn_smem());  // [BR][LDS]
  scalar_t* dOs = Qs + BR * LDS;                            // [BR][LDS]
  scalar_t* Ks = dOs + BR * LDS;                            // [2][BC][LDS]
  scalar_t* Vs = Ks + 2 * BC * LDS;                         // [2][BC][LDS]

  const int D = a.D;
  const int64_t nqb = (a.Lq + BR - 1) / BR;
  const int64_t bh = blockIdx.x / nqb, q0 = (blockIdx.x % nqb) * BR;
  const int64_t b = bh / a.H, h = bh % a.H;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane >> 2, tig = lane & 3;
  const scalar_t* kh = a.k.head(b, h);
  const scalar_t* vh = a.v.head(b, h);
  const int64_t moff = b * a.mask.sb + a.mask.sh * h;

  load_tile<DP, LDS>(Qs, a.q.head(b, h), a.q.sl, q0, BR, a.Lq, D);
  load_tile<DP, LDS>(dOs, a.dout.head(b, h), a.dout.sl, q0, BR, a.Lq, D);
  auto load_kv = [&](int buf, int64_t k0) {
    load_tile<DP, LDS>(Ks + buf * BC * LDS, kh, a.k.sl, k0, BC, a.Lk, D);
    load_tile<DP, LDS>(Vs + buf * BC * LDS, vh, a.v.sl, k0, BC, a.Lk, D);
  };
  load_kv(0, 0);
  cp_async_commit();

  const float sl2 = a.scale * kLog2e;
  const int64_t row_base = q0 + warp * 16 + g;  // this thread's rows: row_base and row_base + 8
  const bool live = q0 + warp * 16 < a.Lq;      // uniform per warp
  float lse2[2], delta[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int64_t i = row_base + rr * 8;
    lse2[rr] = std::numeric_limits<float>::infinity();  // P = 0: past Lq or a fully masked row
    delta[rr] = 0.f;
    if (i < a.Lq) {
      const float lse = a.lse[bh * a.Lq + i];
      if (lse != neg_inf<float>()) lse2[rr] = lse * kLog2e;
      delta[rr] = a.delta[bh * a.Lq + i];
    }
  }
  float dq[DT][4];
#pragma unroll
  for (int j = 0; j < DT; ++j) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.f;

  cp_async_wait_all();
  __syncthreads();
  unsigned qf[T::kFragsInRegs ? KS : 1][4], of[T::kFragsInRegs ? KS : 1][4];
  if constexpr (T::kFragsInRegs) {
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      a_frag<LDS>(qf[ks], Qs, warp * 16, lane, ks);
      a_frag<LDS>(of[ks], dOs, warp * 16, lane, ks);
    }
  }

  const int64_t nkt = (a.Lk + BC - 1) / BC;
  for (int64_t t = 0; t < nkt; ++t) {
    const int buf = static_cast<int>(t & 1);
    if (t + 1 < nkt) load_kv(buf ^ 1, (t + 1) * BC);
    cp_async_commit();
    const scalar_t* Kt = Ks + buf * BC * LDS;
    const scalar_t* Vt = Vs + buf * BC * LDS;
    if (live) {
      // S = Q K^T and dP = dO V^T for the warp's 16 queries x BC keys.
      float s[NT][4], dp[NT][4];
      auto frag = [&](unsigned (&f)[4], const unsigned (&regs)[T::kFragsInRegs ? KS : 1][4], const scalar_t* tile,
                      int ks) {
        if constexpr (T::kFragsInRegs) {
#pragma unroll
          for (int x = 0; x < 4; ++x) f[x] = regs[ks][x];
        } else {
          a_frag<LDS>(f, tile, warp * 16, lane, ks);
        }
      };
      paired_products<LDS, KS, false>(
          s, dp, [&](unsigned (&f)[4], int ks) { frag(f, qf, Qs, ks); },
          [&](unsigned (&f)[4], int ks) { frag(f, of, dOs, ks); }, Kt, Vt, lane, D);
      // dS: element e of tile j is (row row_base + 8 (e >> 1), key k0 + 8 j + 2 tig + (e & 1)); keys
      // past Lk read zero rows of K and V but must still get P = 0.
      const int64_t k0 = t * BC;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t key = k0 + j * 8 + 2 * tig + (e & 1);
          const int rr = e >> 1;
          float x = s[j][e] * sl2;
          if (key >= a.Lk) {
            x = neg_inf<float>();
          } else if (a.mask.kind != kNoMask) {
            const int64_t i = row_base + rr * 8;
            if (i < a.Lq) x += mask_add<scalar_t, float>(a.mask, moff + i * a.mask.sq + key * a.mask.sk) * kLog2e;
          }
          const float p = exp2f(x - lse2[rr]);
          dp[j][e] = p * (dp[j][e] - delta[rr]);
        }
      }
      // dQ += dS K: K's rows (keys) are the k index.
#pragma unroll
      for (int kk = 0; kk < BC / 16; ++kk) {
        unsigned da[4];
        pack_a_frag<scalar_t>(da, dp, kk);
#pragma unroll
        for (int j = 0; j < DT; j += 2) {
          unsigned kb[4];
          cols_b_frag<LDS>(kb, Kt, lane, j, kk);
          MT::mma(dq[j], da, kb[0], kb[1]);
          MT::mma(dq[j + 1], da, kb[2], kb[3]);
        }
      }
    }
    cp_async_wait_all();
    __syncthreads();
  }

#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int64_t i = row_base + rr * 8;
    if (i >= a.Lq) continue;
    scalar_t* out = a.dq + (bh * a.Lq + i) * D;
#pragma unroll
    for (int j = 0; j < DT; ++j) {
      const int d = j * 8 + 2 * tig;
      if (d < D) *reinterpret_cast<unsigned*>(out + d) = MT::pack(dq[j][2 * rr] * a.scale, dq[j][2 * rr + 1] * a.scale);
    }
  }
}


// ---------------------------------------------------------------------------------------------
// Backward, Hopper kernels (sm_90a; fp16 / bf16, head_dim <= 128 and % 8 == 0): the two deterministic
// kernels above on warpgroup MMA, warp-specialised as the forward's. Warpgroup 0 is the producer:
// one thread loads the block's resident operands once and streams tiles of BC rows of the other two
// through a ring of shared-memory stages with the copy engine (128-byte swizzle, rows past the
// sequence zero-filled); in dkdv each query tile's (lse, delta) pairs come with it by a bulk copy.
// Warpgroups 1..WG each own 64 rows of the block and run, per tile, the two products
// from shared memory into registers, the elementwise step on the accumulators, and the gradient
// products with the A operand straight from registers (P^T / dS^T or dS packed to the input type):
//   dkdv (64 keys a warpgroup): S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q;
//   dq   (64 queries a warpgroup): S = Q K^T, dP = dO V^T, dQ += dS K.
// Q, dO (dkdv) and K (dq) serve as the K-major B operand of the first products and as the MN-major B
// of the gradient products from the same swizzled tile. dq runs first and computes delta for its rows
// from O and dO (no separate launch), and writes (lse in log2 units, delta) pairs for dkdv.
// Their shared-memory layout (the fused kernel's tiles add their buffers after it): [K][V] resident, BR rows
// each, [Q stages][dO stages] of BC rows, (lse2, delta) per stage, then the mbarriers.
template <int DP, int BR_, int BC_, int S_>
struct WgBwdLayout {
  static constexpr int BR = BR_;                          // resident rows a block owns
  static constexpr int BC = BC_;                          // rows of a streamed tile
  static constexpr int kStages = S_;
  static constexpr int r_bytes = BR * DP * 2;             // one resident operand
  static constexpr int c_bytes = BC * DP * 2;             // one streamed operand, one stage
  static constexpr int vec_off = 2 * r_bytes + 2 * kStages * c_bytes;  // dkdv: (lse2, delta) [kStages][BC]
  static constexpr int vec_bytes = BC * 8;                               // one stage of them
  static constexpr int bar_off = vec_off + kStages * vec_bytes;
  static constexpr int bar_end = bar_off + 8 * (1 + 2 * kStages);      // mbarriers: resident, full[S], empty[S]
};

template <int DP, int BC_, int WG_ = 2, int S_ = 2>
struct WgBwdTile : WgBwdLayout<DP, 64 * WG_, BC_, S_> {
  static constexpr int WG = WG_;                          // consumer warpgroups (2 or 3)
  static constexpr int threads = 128 * (WG + 1);
  // At launch 168 (WG 2) or 128 (WG 3) registers a thread; the producer gives most of its back.
  static constexpr int regs_producer = WG == 2 ? 40 : 24;
  static constexpr int regs_consumer = WG == 2 ? 232 : 160;  // producer * 128 + consumer * 128 WG <= 65536
  // + slack to align to 1024.
  static constexpr size_t smem_bytes = WgBwdLayout<DP, 64 * WG_, BC_, S_>::bar_end + 1024;
};

// d (64 x N) (+)= A B^T with both operands from shared memory (K-major); N = 32 / 64 / 128.
template <bool kBf16, int N>
__device__ __forceinline__ void wg_mma_ss(float (&d)[N / 2], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (N == 32) wgmma::mma_m64n32k16_ss<kBf16>(d, da, db, scale_d);
  else if constexpr (N == 64) wgmma::mma_m64n64k16_ss<kBf16>(d, da, db, scale_d);
  else wgmma::mma_m64n128k16_ss<kBf16>(d, da, db, scale_d);
}
// d (64 x N) += A (registers) B (shared, MN-major); N = 64 / 128.
template <bool kBf16, int N>
__device__ __forceinline__ void wg_mma_rs(float (&d)[N / 2], const unsigned (&a)[4], uint64_t db) {
  if constexpr (N == 64) wgmma::mma_m64n64k16_rs<kBf16>(d, a, db);
  else wgmma::mma_m64n128k16_rs<kBf16>(d, a, db);
}

// A tile's first two products, x1 = A1 B1^T and x2 = A2 B2^T (64 x BC each): A from the block's resident
// [DP / 64][BR][128 B] tiles at this warpgroup's rows, B from the stage's [DP / 64][BC][128 B] tiles
// (descriptors of their first k-step); waits for both.
template <bool kBf16, int DP, int BR, int BC>
__device__ __forceinline__ void wg_paired_ss(float (&x1)[BC / 2], float (&x2)[BC / 2], uint64_t a1, uint64_t b1, uint64_t a2,
                                             uint64_t b2, uint32_t stage) {
  wgmma::fence();
#pragma unroll
  for (int ks = 0; ks < DP / 16; ++ks) {
    const uint32_t ra = (ks / 4) * BR * 128 + (ks % 4) * 32;
    const uint32_t cb = stage + (ks / 4) * BC * 128 + (ks % 4) * 32;
    wg_mma_ss<kBf16, BC>(x1, a1 + (ra >> 4), b1 + (cb >> 4), ks);
    wg_mma_ss<kBf16, BC>(x2, a2 + (ra >> 4), b2 + (cb >> 4), ks);
  }
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::fence_regs(x1);
  wgmma::fence_regs(x2);
}

// Stores a 64 x DP accumulator tile's rows row0 and row0 + 8 (this thread's, m64 layout) times `mul`
// into rows of `base` (row stride sl, unit stride along D), rows below L only.
template <typename scalar_t, int DP>
__device__ __forceinline__ void wg_store_rows(scalar_t* base, int64_t sl, const float (&x)[DP / 2], float mul,
                                              int64_t row0, int64_t L, int D, int tig) {
  using MT = MmaTraits<scalar_t>;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int64_t r = row0 + rr * 8;
    if (r >= L) continue;
    scalar_t* p = base + r * sl;
#pragma unroll
    for (int j = 0; j < DP / 8; ++j) {
      const int d = j * 8 + 2 * tig;
      if (d < D) *reinterpret_cast<unsigned*>(p + d) = MT::pack(x[4 * j + 2 * rr] * mul, x[4 * j + 2 * rr + 1] * mul);
    }
  }
}

// P^T and dS^T of a dk/dv tile, packed to the input type as the A operands of dV += P^T dO and dK += dS^T Q,
// from the S^T and dP^T accumulators (element 4j + e is (key key_base + 8 ((e >> 1) & 1), query
// q0 + 8j + 2 tig + (e & 1))) and the tile's (lse2, delta) pairs lt. kill_keys: keys at or past Lk (zero
// rows of K and V) get dS = 0, which the fused kernel's dQ needs (P there is exp(-lse), not 0).
// kMask: the caller branches once a tile (a.mask.kind != kNoMask), so the unmasked code runs as one
// contiguous block (a test per element spread it over the masked code's length: instruction-cache misses).
template <typename scalar_t, int BC, bool kMask>
__device__ __forceinline__ void wg_bwd_pt_dst(const AttnArgs<scalar_t, float>& a, const float (&s)[BC / 2],
                                              const float (&dp)[BC / 2], const float* lt, int64_t key_base, int64_t q0,
                                              int64_t moff, float sl2, int tig, bool kill_keys, unsigned (&pa)[BC / 16][4],
                                              unsigned (&da)[BC / 16][4]) {
  using MT = MmaTraits<scalar_t>;
#pragma unroll
  for (int j = 0; j < BC / 8; ++j) {
    const float4 ld = *reinterpret_cast<const float4*>(lt + 2 * (j * 8 + 2 * tig));  // (lse2, delta) x 2 queries
    const float2 l2 = make_float2(ld.x, ld.z), d2 = make_float2(ld.y, ld.w);
    float p[4], ds[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t key = key_base + ((e >> 1) & 1) * 8;
      float x = s[4 * j + e] * sl2;
      if constexpr (kMask) {
        const int64_t i = q0 + j * 8 + 2 * tig + (e & 1);
        if (key < a.Lk && i < a.Lq) x += mask_add<scalar_t, float>(a.mask, moff + i * a.mask.sq + key * a.mask.sk) * kLog2e;
      }
      p[e] = ex2_approx(x - ((e & 1) ? l2.y : l2.x));
      ds[e] = p[e] * (dp[4 * j + e] - ((e & 1) ? d2.y : d2.x));
      if (kill_keys && key >= a.Lk) ds[e] = 0.f;
    }
    pa[j / 2][(j % 2) * 2] = MT::pack(p[0], p[1]);
    pa[j / 2][(j % 2) * 2 + 1] = MT::pack(p[2], p[3]);
    da[j / 2][(j % 2) * 2] = MT::pack(ds[0], ds[1]);
    da[j / 2][(j % 2) * 2 + 1] = MT::pack(ds[2], ds[3]);
  }
}

// This thread's dS^T values (key rows key_row and key_row + 8 of the block) into a [BC / 64][BR][128 B]
// buffer at buf with the 128-byte swizzle (query chunk j of key row r at chunk j ^ (r % 8)), fenced for the
// tensor cores' reads.
template <int BR, int BC>
__device__ __forceinline__ void wg_store_dst(uint32_t buf, const unsigned (&da)[BC / 16][4], int key_row, int tig) {
#pragma unroll
  for (int j = 0; j < BC / 8; ++j) {
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
      const uint32_t row = key_row + 8 * rr;
      const uint32_t addr = buf + (j / 8) * BR * 128 + row * 128 + (((j % 8) ^ (row & 7)) << 4) + 4 * tig;
      asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(da[j / 2][(j % 2) * 2 + rr]) : "memory");
    }
  }
  wgmma::fence_proxy_async();
}

// dV += P^T dO, dK += dS^T Q over a stage's BC queries (K-steps of 16, 2048 bytes apart; B descriptors dom,
// dqm of the stage's first step), issued and committed as one group, not waited for.
template <bool kBf16, int DP, int BC>
__device__ __forceinline__ void wg_issue_dvdk(float (&dv)[DP / 2], float (&dk)[DP / 2], const unsigned (&pa)[BC / 16][4],
                                              const unsigned (&da)[BC / 16][4], uint64_t dom, uint64_t dqm, uint32_t stage) {
  wgmma::fence_regs(dk);
  wgmma::fence_regs(dv);
  wgmma::fence();
#pragma unroll
  for (int kk = 0; kk < BC / 16; ++kk) {
    const uint32_t off = stage + kk * 16 * 128;
    wg_mma_rs<kBf16, DP>(dv, pa[kk], dom + (off >> 4));
    wg_mma_rs<kBf16, DP>(dk, da[kk], dqm + (off >> 4));
  }
  wgmma::commit();
}

// A warpgroup's 64 x 64 float32 dQ part into its staging buffer (sdq; stage_dq its generic address) in
// the accumulator's fragment order, once the previous bulk copy from it has read it, then added into the
// global accumulator at dst by one bulk reduce-add of the copy engine (named barrier bar: this warpgroup).
__device__ __forceinline__ void wg_reduce_dq(float* dst, float4* stage_dq, uint32_t sdq, const float (&dq)[32], int tw,
                                             int bar) {
  if (tw == 0) wgmma::bulk_wait_read();
  wgmma::named_sync(bar, 128);
#pragma unroll
  for (int j = 0; j < 8; ++j) stage_dq[j * 128 + tw] = make_float4(dq[4 * j], dq[4 * j + 1], dq[4 * j + 2], dq[4 * j + 3]);
  wgmma::fence_proxy_async();
  wgmma::named_sync(bar, 128);
  if (tw == 0) {
    wgmma::bulk_reduce_add_f32(dst, sdq, 64 * 64 * 4);
    wgmma::bulk_commit();
  }
}

// The fused Hopper backward (head_dim <= 64): one kernel runs all five products. A block owns BR = 64 WG
// keys with K and V resident and streams query tiles of 64 rows (Q, dO and their (lse2, delta) pairs) as
// the dkdv kernel above does; per tile each warpgroup computes S^T and dP^T for its 64 keys, then
// dV += P^T dO and dK += dS^T Q from registers, and also stores dS^T to shared memory. Warpgroup
// t % WG then takes the whole block's dS^T and K for the tile's dQ part, dQ_t += dS (64 x BR) K (BR x D),
// stages it in shared memory and adds it to a float32 accumulator in global memory with one bulk
// reduce-add of the copy engine (atomic per element, so the sum order, and dQ's last bits, vary between
// runs; torch.use_deterministic_algorithms keeps the deterministic pair). Named barriers hand each dS^T
// buffer over (ready: every warpgroup has written its rows; free: its reader has finished), one buffer
// per warpgroup so the reader of tile t is always warpgroup t % WG and the others run ahead.
// attn_bwd_prep_kernel computes the (lse2, delta) pairs and zeroes the accumulator first;
// attn_bwd_dq_finish_kernel scales and converts it to dq.
template <int DP, int WG_, int S_>
struct WgFusedTile : WgBwdTile<DP, 64, WG_, S_> {
  using Base = WgBwdTile<DP, 64, WG_, S_>;
  static constexpr bool kDqAll = false;  // one reader warpgroup a tile
  static constexpr int ds_off = (Base::bar_end + 1023) / 1024 * 1024;
  static constexpr int ds_bytes = Base::BR * 64 * 2;    // one dS^T buffer: BR key rows of 64 queries
  static constexpr int dq_off = ds_off + WG_ * ds_bytes;
  static constexpr int dq_bytes = 64 * DP * 4;          // one warpgroup's dQ staging (float32)
  static constexpr size_t smem_bytes = dq_off + WG_ * dq_bytes + 1024;
  // Named barrier ids: ready[WG], free[WG], then one per warpgroup.
  static constexpr int bar_ready = 1, bar_free = 1 + WG_, bar_wg = 1 + 2 * WG_;
  static_assert(bar_wg + WG_ <= 16, "named barriers");
};

// The fused backward in FlashAttention-3's layout (head_dim <= 64): two consumer warpgroups with 240
// registers, 128 keys a block, query tiles of 128 rows, so S^T / dP^T run at N = 128 (half the wgmma
// instructions of 64-row tiles, each tile's fixed costs over twice the work). Each warpgroup computes dQ
// for 64 of the tile's queries over the block's 128 keys (no reader hand-over): both write their dS^T rows
// into the tile's buffer (two, alternating by tile parity), one named barrier of both, then dQ's product
// runs on the tensor cores while dV / dK finish. The query rows are padded to 128 (Lq_pad).
template <int DP, int S_>
struct WgFusedPairTile : WgBwdLayout<DP, 128, 128, S_> {
  static_assert(DP == 64, "two 64 x 128 S^T / dP^T accumulators and dK, dV, dQ fit 240 registers at head_dim 64");
  using Base = WgBwdLayout<DP, 128, 128, S_>;
  static constexpr int WG = 2, threads = 128 * (WG + 1);
  static constexpr int regs_producer = 24, regs_consumer = 240;  // 24 * 128 + 240 * 256 <= 65536
  static constexpr bool kDqAll = true;
  static constexpr int ds_off = (Base::bar_end + 1023) / 1024 * 1024;
  static constexpr int ds_bytes = Base::BR * Base::BC * 2;  // one dS^T buffer: [BC / 64 query atoms][BR key rows][128 B]
  static constexpr int dq_off = ds_off + 2 * ds_bytes;
  static constexpr int dq_bytes = 64 * DP * 4;  // one warpgroup's dQ staging (float32)
  static constexpr size_t smem_bytes = dq_off + WG * dq_bytes + 1024;
  static constexpr int bar_ready = 1, bar_wg = 2;  // named barriers: both warpgroups; then one each
};

// The dQ accumulator's layout: per (b, h) and 64-row query tile, DP / 64 chunks of 64 x 64 floats, each
// in the m64n64 accumulator order of the warpgroup that writes it: float4 j (0..7) of thread tw (0..127)
// at float4 index j * 128 + tw (conflict-free 16-byte shared-memory stores, one contiguous bulk copy).
// Its elements are (row (tw / 32) * 16 + (tw % 32) / 4 (+8 for .z, .w), column 8 j + 2 (tw % 4) (+1)).

// The dk/dv block of the Hopper backward: the pair's dk/dv kernel (kDq false, tile WgBwdTile) and the
// fused kernel (kDq true, tile WgFusedTile, which also computes dQ as described above).
template <typename scalar_t, int DP, typename T, bool kDq>
__device__ __forceinline__ void wg_dkdv_block(const AttnArgs<scalar_t, float>& a, float* __restrict__ dq_acc,
                                              const CUtensorMap& tk, const CUtensorMap& tv, const CUtensorMap& tq,
                                              const CUtensorMap& tdo) {
  constexpr int BR = T::BR, BC = T::BC, S = T::kStages, WG = T::WG;
  // dQ by every warpgroup each tile (WgFusedPairTile), else by one reader a tile.
  constexpr bool kAll = [] {  // only the fused tiles (kDq) have kDqAll
    if constexpr (kDq) return T::kDqAll;
    else return false;
  }();
  constexpr int NS = BC / 2, NA = DP / 2;  // S^T (dP^T) and dK (dV) accumulators a thread
  constexpr bool kBf16 = std::is_same_v<scalar_t, at::BFloat16>;

  // [K][V] resident, [Q stages][dO stages], then (lse2, delta) per stage and the mbarriers; fused: then
  // the dS^T buffers and the dQ staging.
  unsigned char* raw = dyn_smem();
  const uint32_t raw_addr = smem_addr(raw);
  const uint32_t sK = (raw_addr + 1023u) & ~1023u, sV = sK + T::r_bytes;
  const uint32_t sQ = sV + T::r_bytes, sO = sQ + S * T::c_bytes, sL = sK + T::vec_off;
  const float* ld_s = reinterpret_cast<const float*>(raw + (sK - raw_addr) + T::vec_off);  // [S][BC][2]
  const uint32_t bar = sK + T::bar_off;  // kv_full, full[S], empty[S]
  auto full = [&](int st) { return bar + 8 * (1 + st); };
  auto empty = [&](int st) { return bar + 8 * (1 + S + st); };

  const int64_t nkb = (a.Lk + BR - 1) / BR;
  const int64_t bh = blockIdx.x / nkb, k0 = (blockIdx.x % nkb) * BR;
  const int b = static_cast<int>(bh / a.H), h = static_cast<int>(bh % a.H);
  const int tid = threadIdx.x, wg = tid / 128;
  const int64_t nqt = kDq ? a.Lq_pad / BC : (a.Lq + BC - 1) / BC;  // the same count (Lq_pad % BC == 0)

  if (tid == 0) {
    init_barriers<1>(bar, {1});
    init_barriers<S>(bar + 8, {1, 128 * WG});  // empty: every consumer thread (each read the stage's pairs)
  }
  __syncthreads();

  if (wg == 0) {
    wgmma::setmaxnreg_dec<T::regs_producer>();
    if (tid == 0) {
      wgmma::mbar_expect_tx(bar, 2 * T::r_bytes);
      for (int c = 0; c < DP / 64; ++c) {
        wgmma::tma_load_4d(sK + c * BR * 128, &tk, bar, c * 64, int(k0), h, b);
        wgmma::tma_load_4d(sV + c * BR * 128, &tv, bar, c * 64, int(k0), h, b);
      }
      // With each tile its (lse2, delta) pairs: 16-byte aligned, inside the padded rows (Lq_pad % BC == 0).
      stream_tiles<DP, BC, S>(&tq, &tdo, sQ, sO, T::c_bytes, nqt, h, b, full, empty, T::vec_bytes, [&](int64_t t, int st) {
        wgmma::bulk_load(sL + st * T::vec_bytes, a.lse_delta + 2 * (bh * a.Lq_pad + static_cast<int>(t * BC)), T::vec_bytes,
                          full(st));
      });
    }
    return;
  }
  wgmma::setmaxnreg_inc<T::regs_consumer>();

  const int cw = wg - 1, tw = tid % 128, warp = (tid / 32) % 4, lane = tid % 32;
  const int g = lane >> 2, tig = lane & 3;
  const int64_t moff = b * a.mask.sb + a.mask.sh * h;
  const float sl2 = a.scale * kLog2e;
  const int key_row = cw * 64 + warp * 16 + g;  // this thread's keys in the block: key_row, key_row + 8
  const int64_t key_base = k0 + key_row;
  // Fused: keys past Lk (zero rows of K, V) must get dS = 0 (their P is not 0).
  const bool key_bound = kDq && k0 + BR > a.Lk;

  float dk[NA], dv[NA];
#pragma unroll
  for (int i = 0; i < NA; ++i) dk[i] = dv[i] = 0.f;
  // A: this warpgroup's 64 rows of K / V (K-major); B: the Q / dO tile, K-major for S^T / dP^T and
  // MN-major (atoms of 64 dims BC * 128 bytes apart) for dK / dV.
  const uint64_t dka = wgmma::desc_sw128(sK + cw * 64 * 128, 16, 1024);
  const uint64_t dva = wgmma::desc_sw128(sV + cw * 64 * 128, 16, 1024);
  const uint64_t dqk = wgmma::desc_sw128(sQ, 16, 1024), dok = wgmma::desc_sw128(sO, 16, 1024);
  const uint64_t dqm = wgmma::desc_sw128(sQ, BC * 128, 1024), dom = wgmma::desc_sw128(sO, BC * 128, 1024);

  wgmma::mbar_wait(bar, 0);
  for (int64_t t = 0; t < nqt; ++t) {
    const int st = static_cast<int>(t % S);
    const uint32_t stage = st * T::c_bytes;
    wgmma::mbar_wait(full(st), static_cast<uint32_t>((t / S) & 1));

    float s[NS], dp[NS];
    wg_paired_ss<kBf16, DP, BR, BC>(s, dp, dka, dqk, dva, dok, stage);

    unsigned pa[BC / 16][4], da[BC / 16][4];
    if (a.mask.kind == kNoMask)
      wg_bwd_pt_dst<scalar_t, BC, false>(a, s, dp, ld_s + st * 2 * BC, key_base, t * BC, moff, sl2, tig, key_bound, pa, da);
    else
      wg_bwd_pt_dst<scalar_t, BC, true>(a, s, dp, ld_s + st * 2 * BC, key_base, t * BC, moff, sl2, tig, key_bound, pa, da);

    if constexpr (kAll) {
      // dS^T into this tile's buffer ([BC / 64][BR][128 B], 128-byte swizzle: query chunk j of key row r
      // at chunk j ^ (r % 8)). Its last readers, both warpgroups' dQ of tile t - 2, finished before they
      // reached tile t - 1's barrier, which this warpgroup has passed.
      const uint32_t buf = sK + T::ds_off + static_cast<uint32_t>(t & 1) * T::ds_bytes;
      wg_store_dst<BR, BC>(buf, da, key_row, tig);
      // dV += P^T dO, dK += dS^T Q, then, once both warpgroups' dS^T rows are in, dQ for this warpgroup's
      // 64 queries: dS (A: the buffer's atom cw, MN-major) times K (B: MN-major) over the block's keys; both
      // groups in flight together.
      wg_issue_dvdk<kBf16, DP, BC>(dv, dk, pa, da, dom, dqm, stage);
      wgmma::named_sync(T::bar_ready, 128 * WG);
      float dq[32];
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < BR / 16; ++kk)
        wgmma::mma_m64n64k16_ss_mn<kBf16>(dq, wgmma::desc_sw128(buf + cw * BR * 128 + kk * 2048, 16, 1024),
                                          wgmma::desc_sw128(sK + kk * 2048, BR * 128, 1024), kk);
      wgmma::commit();
      wgmma::wait<1>();
      wgmma::fence_regs(dk);
      wgmma::fence_regs(dv);
      wgmma::mbar_arrive(empty(st));  // the stage's last reader was dV / dK
      wgmma::wait<0>();
      wgmma::fence_regs(dq);
      const uint32_t sdq = sK + T::dq_off + cw * T::dq_bytes;
      wg_reduce_dq(dq_acc + (bh * a.Lq_pad + t * BC + cw * 64) * DP, reinterpret_cast<float4*>(raw + (sdq - raw_addr)), sdq,
                   dq, tw, T::bar_wg + cw);
      continue;
    }

    const int rd = static_cast<int>(t % WG);  // fused: the warpgroup that reads this tile's dS^T buffer
    uint32_t ds_buf = 0;
    if constexpr (kDq && !kAll) {
      ds_buf = sK + T::ds_off + rd * T::ds_bytes;
      // dS^T into the reader's buffer (128-byte swizzle: query chunk j of key row r at chunk j ^ (r % 8)),
      // once its reader has finished the tile WG earlier.
      if (t >= WG && cw != rd) wgmma::named_sync(T::bar_free + rd, 128 * WG);
      wg_store_dst<BR, BC>(ds_buf, da, key_row, tig);
      if (cw != rd) wgmma::named_arrive(T::bar_ready + rd, 128 * WG);
    }

    wg_issue_dvdk<kBf16, DP, BC>(dv, dk, pa, da, dom, dqm, stage);
    wgmma::wait<0>();
    wgmma::fence_regs(dk);
    wgmma::fence_regs(dv);
    // Done with the stage. Every thread arrives: an arrival releases only the arriving thread's own
    // reads (here of the stage's (lse2, delta) pairs) before the copy engine rewrites them.
    wgmma::mbar_arrive(empty(st));
    if constexpr (kDq && !kAll) {
      if (cw != rd) continue;

      // This warpgroup's tile: dQ_t = dS K over the block's BR keys (A = the dS^T buffer, rows = keys,
      // MN-major; B = K, MN-major), 64 head dims at a time. dV / dK are done first: their A registers are
      // free for dQ's accumulators (within 160 registers at WG = 3; overlapping them made ptxas serialize
      // every wgmma of the kernel, 25.7 vs 22.6 ms on spatial-9216).
      wgmma::named_sync(T::bar_ready + rd, 128 * WG);
#pragma unroll
      for (int c = 0; c < DP / 64; ++c) {
        float dq[32];
        wgmma::fence();
#pragma unroll
        for (int kk = 0; kk < BR / 16; ++kk)
          wgmma::mma_m64n64k16_ss_mn<kBf16>(dq, wgmma::desc_sw128(ds_buf + kk * 2048, 16, 1024),
                                            wgmma::desc_sw128(sK + c * BR * 128 + kk * 2048, BR * 128, 1024), kk);
        wgmma::commit();
        wgmma::wait<0>();
        wgmma::fence_regs(dq);
        if (c == DP / 64 - 1 && t + WG < nqt) wgmma::named_arrive(T::bar_free + rd, 128 * WG);
        const uint32_t sdq = sK + T::dq_off + cw * T::dq_bytes + c * 64 * 64 * 4;
        wg_reduce_dq(dq_acc + (bh * a.Lq_pad + t * BC) * DP + c * 64 * 64, reinterpret_cast<float4*>(raw + (sdq - raw_addr)),
                     sdq, dq, tw, T::bar_wg + cw);
      }
    }
  }
  if (kDq && tw == 0) wgmma::bulk_wait();

  wg_store_rows<scalar_t, DP>(a.dk.head(b, h), a.dk.sl, dk, a.scale, key_base, a.Lk, a.D, tig);
  wg_store_rows<scalar_t, DP>(a.dv.head(b, h), a.dv.sl, dv, 1.f, key_base, a.Lk, a.D, tig);
}

template <typename scalar_t, int DP, int BC, int WG, int S_>
__global__ void __launch_bounds__(WgBwdTile<DP, BC, WG, S_>::threads, 1)
    attn_bwd_dkdv_wgmma_kernel(const AttnArgs<scalar_t, float> a, const __grid_constant__ CUtensorMap tk,
                               const __grid_constant__ CUtensorMap tv, const __grid_constant__ CUtensorMap tq,
                               const __grid_constant__ CUtensorMap tdo) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  wg_dkdv_block<scalar_t, DP, WgBwdTile<DP, BC, WG, S_>, false>(a, nullptr, tk, tv, tq, tdo);
#endif
}

// T: WgFusedTile (one reader a tile) or WgFusedPairTile (FlashAttention-3's layout).
template <typename scalar_t, int DP, typename T>
__global__ void __launch_bounds__(T::threads, 1)
    attn_bwd_fused_wgmma_kernel(const AttnArgs<scalar_t, float> a, float* __restrict__ dq_acc,
                                const __grid_constant__ CUtensorMap tk, const __grid_constant__ CUtensorMap tv,
                                const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tdo) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  wg_dkdv_block<scalar_t, DP, T, true>(a, dq_acc, tk, tv, tq, tdo);
#endif
}

template <typename scalar_t, int DP, int BC, int WG, int S_>
__global__ void __launch_bounds__(WgBwdTile<DP, BC, WG, S_>::threads, 1)
    attn_bwd_dq_wgmma_kernel(const AttnArgs<scalar_t, float> a, const __grid_constant__ CUtensorMap tq,
                             const __grid_constant__ CUtensorMap tdo, const __grid_constant__ CUtensorMap tk,
                             const __grid_constant__ CUtensorMap tv) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = WgBwdTile<DP, BC, WG, S_>;
  constexpr int BR = T::BR, S = T::kStages;
  constexpr int NS = BC / 2, NA = DP / 2;  // S (dP) and dQ accumulators a thread
  constexpr bool kBf16 = std::is_same_v<scalar_t, at::BFloat16>;
  using MT = MmaTraits<scalar_t>;

  // [Q][dO] resident, [K stages][V stages], then the mbarriers.
  const uint32_t raw_addr = smem_addr(dyn_smem());
  const uint32_t sQ = (raw_addr + 1023u) & ~1023u, sO = sQ + T::r_bytes;
  const uint32_t sK = sO + T::r_bytes, sV = sK + S * T::c_bytes;
  const uint32_t bar = sQ + T::bar_off;  // q_full, full[S], empty[S]
  auto full = [&](int st) { return bar + 8 * (1 + st); };
  auto empty = [&](int st) { return bar + 8 * (1 + S + st); };

  const int64_t nqb = (a.Lq + BR - 1) / BR;
  const int64_t bh = blockIdx.x / nqb, q0 = (blockIdx.x % nqb) * BR;
  const int b = static_cast<int>(bh / a.H), h = static_cast<int>(bh % a.H);
  const int tid = threadIdx.x, wg = tid / 128;
  const int64_t nkt = (a.Lk + BC - 1) / BC;

  if (tid == 0) {
    init_barriers<1>(bar, {1});
    init_barriers<S>(bar + 8, {1, 4 * T::WG});
  }
  __syncthreads();

  if (wg == 0) {
    wgmma::setmaxnreg_dec<T::regs_producer>();
    if (tid == 0) {
      wgmma::mbar_expect_tx(bar, 2 * T::r_bytes);
      for (int c = 0; c < DP / 64; ++c) {
        wgmma::tma_load_4d(sQ + c * BR * 128, &tq, bar, c * 64, int(q0), h, b);
        wgmma::tma_load_4d(sO + c * BR * 128, &tdo, bar, c * 64, int(q0), h, b);
      }
      stream_tiles<DP, BC, S>(&tk, &tv, sK, sV, T::c_bytes, nkt, h, b, full, empty, 0, [](int64_t, int) {});
    }
    return;
  }
  wgmma::setmaxnreg_inc<T::regs_consumer>();

  const int cw = wg - 1, warp = (tid / 32) % 4, lane = tid % 32;
  const int g = lane >> 2, tig = lane & 3;
  const int64_t moff = b * a.mask.sb + a.mask.sh * h;
  const float sl2 = a.scale * kLog2e;
  const int64_t row_base = q0 + cw * 64 + warp * 16 + g;  // this thread's rows: row_base, row_base + 8
  // delta = rowsum(dO * O) - grad_lse for this thread's two rows, the 4 lanes of a quad splitting each
  // row's 16-byte chunks; written with lse2 for the dkdv kernel that runs next (rows up to Lq_pad: the
  // padding gets (+inf, 0), so P = 0 there).
  float lse2[2], delta[2];
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int64_t i = row_base + rr * 8;
    lse2[rr] = std::numeric_limits<float>::infinity();  // P = 0: past Lq or a fully masked row
    float part = 0.f;
    if (i < a.Lq) {
      const float lse = a.lse[bh * a.Lq + i];
      if (lse != neg_inf<float>()) lse2[rr] = lse * kLog2e;
      const scalar_t* orow = a.o.head(b, h) + i * a.o.sl;
      const scalar_t* drow = a.dout.head(b, h) + i * a.dout.sl;
      for (int c = tig * 8; c < a.D; c += 32) {
        const Vec<scalar_t, 8> ov = *reinterpret_cast<const Vec<scalar_t, 8>*>(orow + c);
        const Vec<scalar_t, 8> dv8 = *reinterpret_cast<const Vec<scalar_t, 8>*>(drow + c);
#pragma unroll
        for (int e = 0; e < 8; ++e) part += static_cast<float>(ov.v[e]) * static_cast<float>(dv8.v[e]);
      }
    }
    part += __shfl_xor_sync(kFullMask, part, 1);
    part += __shfl_xor_sync(kFullMask, part, 2);
    delta[rr] = i < a.Lq ? part - (a.grad_lse ? a.grad_lse[bh * a.Lq + i] : 0.f) : 0.f;
    if (tig == 0 && i < a.Lq_pad)
      *reinterpret_cast<float2*>(a.lse_delta + 2 * (bh * a.Lq_pad + i)) = make_float2(lse2[rr], delta[rr]);
  }
  float dq[NA];
#pragma unroll
  for (int i = 0; i < NA; ++i) dq[i] = 0.f;
  const uint64_t dqa = wgmma::desc_sw128(sQ + cw * 64 * 128, 16, 1024);
  const uint64_t doa = wgmma::desc_sw128(sO + cw * 64 * 128, 16, 1024);
  const uint64_t dkk = wgmma::desc_sw128(sK, 16, 1024), dvk = wgmma::desc_sw128(sV, 16, 1024);
  const uint64_t dkm = wgmma::desc_sw128(sK, BC * 128, 1024);

  wgmma::mbar_wait(bar, 0);
  for (int64_t t = 0; t < nkt; ++t) {
    const int st = static_cast<int>(t % S);
    const uint32_t stage = st * T::c_bytes;
    wgmma::mbar_wait(full(st), static_cast<uint32_t>((t / S) & 1));

    float s[NS], dp[NS];
    wg_paired_ss<kBf16, DP, BR, BC>(s, dp, dqa, dkk, doa, dvk, stage);

    // dS: element 4j + e is (row row_base + 8 ((e >> 1) & 1), key k0 + 8j + 2 tig + (e & 1)); keys past
    // Lk read zero rows of K and V but must still get P = 0.
    const int64_t k0 = t * BC;
    const bool plain = k0 + BC <= a.Lk && a.mask.kind == kNoMask;
    unsigned da[BC / 16][4];
#pragma unroll
    for (int j = 0; j < BC / 8; ++j) {
      float ds[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int rr = (e >> 1) & 1;
        float x = s[4 * j + e] * sl2;
        if (!plain) {
          const int64_t key = k0 + j * 8 + 2 * tig + (e & 1);
          if (key >= a.Lk) {
            x = neg_inf<float>();
          } else if (a.mask.kind != kNoMask) {
            const int64_t i = row_base + rr * 8;
            if (i < a.Lq) x += mask_add<scalar_t, float>(a.mask, moff + i * a.mask.sq + key * a.mask.sk) * kLog2e;
          }
        }
        ds[e] = ex2_approx(x - lse2[rr]) * (dp[4 * j + e] - delta[rr]);
      }
      da[j / 2][(j % 2) * 2] = MT::pack(ds[0], ds[1]);
      da[j / 2][(j % 2) * 2 + 1] = MT::pack(ds[2], ds[3]);
    }

    // dQ += dS K: K's tile as the MN-major B; K-steps of 16 keys, 2048 bytes apart.
    wgmma::fence_regs(dq);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < BC / 16; ++kk) wg_mma_rs<kBf16, DP>(dq, da[kk], dkm + ((stage + kk * 16 * 128) >> 4));
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_regs(dq);
    if (lane == 0) wgmma::mbar_arrive(empty(st));
  }

  wg_store_rows<scalar_t, DP>(a.dq + bh * a.Lq * a.D, a.D, dq, a.scale, row_base, a.Lq, a.D, tig);
#endif
}

// Before the fused backward: per query row (padded to Lq_pad) the pair (lse in log2 units, delta =
// rowsum(dO * O) - grad_lse) — (+inf, 0) past Lq or on a fully masked row, so P = 0 there — and the
// row's share of the dQ accumulator zeroed. DP / 8 threads a row, one 16-byte vector of O and dO each.
template <typename scalar_t, int DP>
__global__ void __launch_bounds__(256) attn_bwd_prep_kernel(const AttnArgs<scalar_t, float> a, float* __restrict__ dq_acc) {
  constexpr int TPR = DP / 8;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x) / TPR;
  const int c = (threadIdx.x % TPR) * 8;
  const bool live = row < a.B * a.H * a.Lq_pad;  // no early return: the whole warp shuffles below
  const int64_t bh = row / a.Lq_pad, i = row % a.Lq_pad;
  const int b = static_cast<int>(bh / a.H), h = static_cast<int>(bh % a.H);
  float part = 0.f;
  if (live && i < a.Lq && c < a.D) {
    const Vec<scalar_t, 8> ov = *reinterpret_cast<const Vec<scalar_t, 8>*>(a.o.head(b, h) + i * a.o.sl + c);
    const Vec<scalar_t, 8> dv8 = *reinterpret_cast<const Vec<scalar_t, 8>*>(a.dout.head(b, h) + i * a.dout.sl + c);
#pragma unroll
    for (int e = 0; e < 8; ++e) part += static_cast<float>(ov.v[e]) * static_cast<float>(dv8.v[e]);
  }
#pragma unroll
  for (int o = 1; o < TPR; o *= 2) part += __shfl_xor_sync(kFullMask, part, o);
  if (!live) return;
  float4* z = reinterpret_cast<float4*>(dq_acc + row * DP + c);
  z[0] = make_float4(0.f, 0.f, 0.f, 0.f);
  z[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (c == 0) {
    float lse2 = std::numeric_limits<float>::infinity(), delta = 0.f;
    if (i < a.Lq) {
      const float lse = a.lse[bh * a.Lq + i];
      if (lse != neg_inf<float>()) lse2 = lse * kLog2e;
      delta = part - (a.grad_lse ? a.grad_lse[bh * a.Lq + i] : 0.f);
    }
    *reinterpret_cast<float2*>(a.lse_delta + 2 * row) = make_float2(lse2, delta);
  }
}

// After it: dq = scale * the accumulator, rows below Lq and columns below D, from its fragment order
// (above); one float4 (two pairs of two rows) a thread.
template <typename scalar_t, int DP>
__global__ void __launch_bounds__(256) attn_bwd_dq_finish_kernel(const AttnArgs<scalar_t, float> a, const float* __restrict__ dq_acc) {
  using MT = MmaTraits<scalar_t>;
  const int64_t f = static_cast<int64_t>(blockIdx.x) * 256 + threadIdx.x;  // float4 index
  if (f >= a.B * a.H * a.Lq_pad * DP / 4) return;
  const float4 x = reinterpret_cast<const float4*>(dq_acc)[f];
  const int64_t tile = f / (DP * 16);  // 64 rows x DP floats = DP * 16 float4
  const int within = static_cast<int>(f % (DP * 16));
  const int chunk = within / 1024, j = (within % 1024) / 128, tw = within % 128;
  const int64_t bh = tile / (a.Lq_pad / 64);
  const int64_t r = (tile % (a.Lq_pad / 64)) * 64 + (tw / 32) * 16 + (tw % 32) / 4;
  const int d = chunk * 64 + 8 * j + 2 * (tw % 4);
  if (d >= a.D) return;
  scalar_t* out = a.dq + bh * a.Lq * a.D + d;
  if (r < a.Lq) *reinterpret_cast<unsigned*>(out + r * a.D) = MT::pack(x.x * a.scale, x.y * a.scale);
  if (r + 8 < a.Lq) *reinterpret_cast<unsigned*>(out + (r + 8) * a.D) = MT::pack(x.z * a.scale, x.w * a.scale);
}

// Backward, short sequences (fp16 / bf16, q_len and kv_len <= 32, head_dim <= 128 and % 8 == 0; the
// temporal attention over frames): a warp per (b, h) problem, persistent, q, k, v and dO staged once
// in shared memory. delta = rowsum(P * dP) - grad_lse from the recomputed P (equal to rowsum(dO * O),
// without reading O or a separate launch). Two passes over the staged tiles: query rows (S, dP, dS,
// dQ = dS K), then key rows (S^T, dP^T, dS^T, dV = P^T dO, dK = dS^T Q); the second recomputes its
// products rather than transposing P and dS through shared memory. Memory-bound by design.
template <int LP, int DP>
struct ShortBwdTile {
  static constexpr int LDS = DP + 8;
  static constexpr int tile_elems = 4 * LP * LDS;  // Q, K, V, dO
  static constexpr size_t warp_bytes = static_cast<size_t>(tile_elems) * 2 + 2 * LP * sizeof(float);  // + lse, delta
  static constexpr int warps = warp_bytes <= 14 * 1024 ? 4 : warp_bytes <= 28 * 1024 ? 2 : 1;
  static constexpr int problems = warps;  // a warp a problem
  static constexpr size_t smem_bytes = warps * warp_bytes;
};

template <typename scalar_t, int LP, int DP>
__global__ void __launch_bounds__(ShortBwdTile<LP, DP>::warps * 32)
    attn_bwd_short_kernel(const AttnArgs<scalar_t, float> a) {
  using T = ShortBwdTile<LP, DP>;
  constexpr int LDS = T::LDS, NT = LP / 8, KS = DP / 16, DT = DP / 8, DCH = DP / 8;
  using MT = MmaTraits<scalar_t>;
  static_assert(T::warp_bytes % 16 == 0, "warp regions stay 16-byte aligned");

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, tig = lane & 3;
  unsigned char* base = dyn_smem() + static_cast<size_t>(warp) * T::warp_bytes;
  scalar_t* Qs = reinterpret_cast<scalar_t*>(base);  // [LP][LDS] each
  scalar_t* Ks = Qs + LP * LDS;
  scalar_t* Vs = Ks + LP * LDS;
  scalar_t* dOs = Vs + LP * LDS;
  float* lse_s = reinterpret_cast<float*>(dOs + LP * LDS);  // [LP] log2 units; +inf: P = 0
  float* delta_s = lse_s + LP;                               // [LP]

  // Rows past q_len / kv_len, dims past head_dim and delta past q_len stay zero for the whole kernel:
  // loads only ever write the valid part.
  {
    uint4* z = reinterpret_cast<uint4*>(base);
    for (int e = lane; e < static_cast<int>(T::warp_bytes / 16); e += 32) z[e] = make_uint4(0, 0, 0, 0);
  }
  __syncwarp();

  const int D = a.D, CH = D / 8;
  const int Lq = static_cast<int>(a.Lq), Lk = static_cast<int>(a.Lk);
  const int64_t P = a.B * a.H;
  const int64_t step = static_cast<int64_t>(gridDim.x) * T::warps;
  const float sl2 = a.scale * kLog2e;

  for (int64_t p = static_cast<int64_t>(blockIdx.x) * T::warps + warp; p < P; p += step) {
    const int64_t b = p / a.H, h = p - b * a.H;
    {
      const scalar_t* qh = a.q.head(b, h);
      const scalar_t* kh = a.k.head(b, h);
      const scalar_t* vh = a.v.head(b, h);
      const scalar_t* oh = a.dout.head(b, h);
#pragma unroll
      for (int e = lane; e < LP * DCH; e += 32) {
        const int r = e / DCH, c = e % DCH;
        if (c < CH) {
          if (r < Lq) {
            cp_async16(Qs + r * LDS + c * 8, qh + r * a.q.sl + c * 8, true);
            cp_async16(dOs + r * LDS + c * 8, oh + r * a.dout.sl + c * 8, true);
          }
          if (r < Lk) {
            cp_async16(Ks + r * LDS + c * 8, kh + r * a.k.sl + c * 8, true);
            cp_async16(Vs + r * LDS + c * 8, vh + r * a.v.sl + c * 8, true);
          }
        }
      }
      cp_async_commit();
      if (lane < Lq) {
        const float lse = a.lse[p * Lq + lane];
        lse_s[lane] = lse == neg_inf<float>() ? std::numeric_limits<float>::infinity() : lse * kLog2e;
      } else if (lane < LP) {
        lse_s[lane] = std::numeric_limits<float>::infinity();
      }
      cp_async_wait_all();
      __syncwarp();
    }
    const int64_t moff = a.mask.kind == kNoMask ? 0 : b * a.mask.sb + h * a.mask.sh;

    // Pass 1, query rows: S = Q K^T, dP = dO V^T, delta, dS, dQ = dS K.
#pragma unroll
    for (int mt = 0; mt < LP / 16; ++mt) {
      if (mt * 16 >= Lq) break;
      float s[NT][4], dp[NT][4];
      paired_products<LDS, KS, true>(
          s, dp, [&](unsigned (&f)[4], int ks) { a_frag<LDS>(f, Qs, mt * 16, lane, ks); },
          [&](unsigned (&f)[4], int ks) { a_frag<LDS>(f, dOs, mt * 16, lane, ks); }, Ks, Vs, lane, D);
      const int row0 = mt * 16 + g;
      const float l2[2] = {lse_s[row0], lse_s[row0 + 8]};
      float dsum[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = j * 8 + 2 * tig + (e & 1);
          const int row = row0 + (e >> 1) * 8;
          float x = s[j][e] * sl2;
          if (key >= Lk) {
            x = neg_inf<float>();
          } else if (a.mask.kind != kNoMask && row < Lq) {
            x += mask_add<scalar_t, float>(a.mask, moff + row * a.mask.sq + key * a.mask.sk) * kLog2e;
          }
          const float pe = exp2f(x - l2[e >> 1]);
          s[j][e] = pe;
          dsum[e >> 1] += pe * dp[j][e];
        }
      }
      float delta[2];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        dsum[rr] += __shfl_xor_sync(kFullMask, dsum[rr], 1);
        dsum[rr] += __shfl_xor_sync(kFullMask, dsum[rr], 2);
        const int row = row0 + rr * 8;
        delta[rr] = dsum[rr] - (a.grad_lse != nullptr && row < Lq ? a.grad_lse[p * Lq + row] : 0.f);
        if (tig == 0 && row < Lq) delta_s[row] = delta[rr];
      }
#pragma unroll
      for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dp[j][e] = s[j][e] * (dp[j][e] - delta[e >> 1]);
      float dq[DT][4];
#pragma unroll
      for (int j = 0; j < DT; ++j) dq[j][0] = dq[j][1] = dq[j][2] = dq[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < LP / 16; ++kk) {
        if (kk * 16 >= Lk) break;
        unsigned da[4];
        pack_a_frag<scalar_t>(da, dp, kk);
#pragma unroll
        for (int j = 0; j < DT; j += 2) {
          if (j * 8 >= D) break;
          unsigned kb[4];
          cols_b_frag<LDS>(kb, Ks, lane, j, kk);
          MT::mma(dq[j], da, kb[0], kb[1]);
          MT::mma(dq[j + 1], da, kb[2], kb[3]);
        }
      }
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int row = row0 + rr * 8;
        if (row >= Lq) continue;
        scalar_t* out = a.dq + (p * Lq + row) * D;
#pragma unroll
        for (int j = 0; j < DT; ++j) {
          const int d = j * 8 + 2 * tig;
          if (d < D) *reinterpret_cast<unsigned*>(out + d) = MT::pack(dq[j][2 * rr] * a.scale, dq[j][2 * rr + 1] * a.scale);
        }
      }
    }
    __syncwarp();  // delta_s is written

    // Pass 2, key rows: S^T = K Q^T, dP^T = V dO^T, dS^T, dV = P^T dO, dK = dS^T Q.
#pragma unroll
    for (int mk = 0; mk < LP / 16; ++mk) {
      if (mk * 16 >= Lk) break;
      float s[NT][4], dp[NT][4];
      paired_products<LDS, KS, true>(
          s, dp, [&](unsigned (&f)[4], int ks) { a_frag<LDS>(f, Ks, mk * 16, lane, ks); },
          [&](unsigned (&f)[4], int ks) { a_frag<LDS>(f, Vs, mk * 16, lane, ks); }, Qs, dOs, lane, D);
      const int key0 = mk * 16 + g;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int c = j * 8 + 2 * tig + (e & 1);  // query
          const int key = key0 + (e >> 1) * 8;
          float x = s[j][e] * sl2;
          if (a.mask.kind != kNoMask && key < Lk && c < Lq)
            x += mask_add<scalar_t, float>(a.mask, moff + c * a.mask.sq + key * a.mask.sk) * kLog2e;
          const float pe = exp2f(x - lse_s[c]);
          s[j][e] = pe;
          dp[j][e] = pe * (dp[j][e] - delta_s[c]);
        }
      }
      float dk[DT][4], dv[DT][4];
#pragma unroll
      for (int j = 0; j < DT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk[j][e] = dv[j][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < LP / 16; ++kk) {
        if (kk * 16 >= Lq) break;
        unsigned pa[4], da[4];
        pack_a_frag<scalar_t>(pa, s, kk);
        pack_a_frag<scalar_t>(da, dp, kk);
#pragma unroll
        for (int j = 0; j < DT; j += 2) {
          if (j * 8 >= D) break;
          unsigned ob[4], qb[4];
          cols_b_frag<LDS>(ob, dOs, lane, j, kk);
          MT::mma(dv[j], pa, ob[0], ob[1]);
          MT::mma(dv[j + 1], pa, ob[2], ob[3]);
          cols_b_frag<LDS>(qb, Qs, lane, j, kk);
          MT::mma(dk[j], da, qb[0], qb[1]);
          MT::mma(dk[j + 1], da, qb[2], qb[3]);
        }
      }
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {
        const int key = key0 + rr * 8;
        if (key >= Lk) continue;
        scalar_t* dkr = a.dk.head(b, h) + key * a.dk.sl;
        scalar_t* dvr = a.dv.head(b, h) + key * a.dv.sl;
#pragma unroll
        for (int j = 0; j < DT; ++j) {
          const int d = j * 8 + 2 * tig;
          if (d < D) {
            *reinterpret_cast<unsigned*>(dkr + d) = MT::pack(dk[j][2 * rr] * a.scale, dk[j][2 * rr + 1] * a.scale);
            *reinterpret_cast<unsigned*>(dvr + d) = MT::pack(dv[j][2 * rr], dv[j][2 * rr + 1]);
          }
        }
      }
    }
    __syncwarp();  // every read of this problem's tiles is done before the next problem's loads
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

// Opts the kernel into more than the default 48 KiB of dynamic shared memory when it needs it.
template <typename Kernel>
void set_smem(Kernel kernel, size_t bytes, const char* op) {
  if (bytes <= 48 * 1024) return;
  int dev = 0, max_optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  TORCH_CHECK(bytes <= static_cast<size_t>(max_optin), op, ": needs ", bytes,
              " bytes of shared memory per block for this dtype and head_dim; the device allows ", max_optin);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// head_dim bucket -> outputs per lane of the "rows" kernels.
template <typename F>
void dispatch_dpl(int64_t D, F&& f) {
  if (D <= 64) f(std::integral_constant<int, 2>{});
  else if (D <= 128) f(std::integral_constant<int, 4>{});
  else f(std::integral_constant<int, 8>{});
}

MaskView mask_view(const at::Tensor& mask, const at::Tensor& q) {
  MaskView m{nullptr, kNoMask, 0, 0, 0, 0};
  if (!mask.defined()) return m;
  m.p = mask.const_data_ptr();
  m.kind = mask.scalar_type() == at::kBool ? kBoolMask
           : mask.scalar_type() == at::kFloat && q.scalar_type() != at::kFloat ? kFloatMask
                                                                                 : kInputTypeMask;
  m.sb = mask.stride(0);
  m.sh = mask.stride(1);
  m.sq = mask.stride(2);
  m.sk = mask.stride(3);
  return m;
}

// Row stride of the "rows" kernels' tiles: a whole number of 16-byte vectors, an odd number of them
// (so 8 lanes reading 8 rows hit distinct banks), at least D.
template <typename acc_t>
int smem_ld(int64_t D) {
  constexpr int64_t V = 16 / sizeof(acc_t);
  return static_cast<int>((D + 2 * V - 1) / (2 * V) * (2 * V) + V);
}

// The tensor-core kernels read 16-byte chunks of rows: unit stride along D, every row start aligned.
bool mma_layout_ok(const at::Tensor& t) {
  if (t.stride(3) != 1 || reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 != 0) return false;
  const int64_t per16 = 16 / static_cast<int64_t>(t.element_size());
  for (int i = 0; i < 3; ++i)
    if (t.size(i) > 1 && t.stride(i) % per16 != 0) return false;
  return true;
}

at::Tensor mma_ready(const at::Tensor& t) {
  if (mma_layout_ok(t)) return t;
  at::Tensor c = at::empty(t.sizes(), t.options());
  c.copy_(t);
  return c;
}

template <typename scalar_t, typename acc_t>
AttnArgs<scalar_t, acc_t> base_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& mask, double scale) {
  AttnArgs<scalar_t, acc_t> a{};
  a.q = view_of<const scalar_t>(q);
  a.k = view_of<const scalar_t>(k);
  a.v = view_of<const scalar_t>(v);
  a.mask = mask_view(mask, q);
  a.B = q.size(0);
  a.H = q.size(1);
  a.Lq = q.size(2);
  a.Lk = k.size(2);
  a.D = static_cast<int>(q.size(3));
  a.ld = smem_ld<acc_t>(a.D);
  a.scale = static_cast<acc_t>(scale);
  return a;
}

// Which forward kernel serves long fp16 / bf16 sequences. VD_ATTENTION_KERNEL=mma keeps the mma.sync
// kernel on Hopper too (benchmarks compare the two in one process); read on every call.
bool wgmma_allowed() {
  const char* e = std::getenv("VD_ATTENTION_KERNEL");
  return e == nullptr || std::string(e) != "mma";
}

// Whether the Hopper forward at head_dim > 64 overlaps P V with the next tile's softmax (see
// attn_fwd_wgmma_kernel); VD_ATTENTION_OVERLAP=0 keeps the serial loop (benchmarks compare the two in one
// process); read on every call. At head_dim 64 the loop stays serial: three consumer warpgroups leave
// 160 registers a thread, and the overlapped loop's second score tile spilled and ran 2-6 % slower.
bool wgmma_overlap() {
  const char* e = std::getenv("VD_ATTENTION_OVERLAP");
  return e == nullptr || std::string(e) != "0";
}

#if defined(VD_SM90A)
// A (B, H, L, D) fp16 / bf16 / fp32 operand as a 4-D tensor map (D, L, H, B) with boxes of 128 bytes of
// dims (64 or 32) x rows in the 128-byte swizzle; out-of-range rows and dims read as zeros. False where
// the copy engine cannot take the layout (strides must be positive multiples of 16 bytes).
bool make_tensor_map(CUtensorMap* m, const at::Tensor& t, int rows) {
  return tensor_map_4d(m, t, {t.size(3), t.size(2), t.size(1), t.size(0)}, {t.stride(2), t.stride(1), t.stride(0)},
                       {static_cast<uint32_t>(128 / t.element_size()), static_cast<uint32_t>(rows), 1, 1});
}
#endif

// The Hopper kernel: fp16 / bf16, head_dim <= 128 and % 8 == 0, at least one full query tile of a
// warpgroup and more keys than the short kernel takes. Returns false where another kernel is used.
template <typename scalar_t>
bool wgmma_forward(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& mask, double scale, at::Tensor& out, at::Tensor& lse, cudaStream_t stream) {
#if defined(VD_SM90A)
  if constexpr (std::is_same_v<scalar_t, at::Half> || std::is_same_v<scalar_t, at::BFloat16>) {
    const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2), D = q.size(3);
    if (D % 8 != 0 || D > 128 || Lk <= kTile || Lq < 64 || !wgmma_allowed() || !device_is_sm90a()) return false;
    if (B > std::numeric_limits<int>::max() || H > std::numeric_limits<int>::max() ||
        Lk > std::numeric_limits<int>::max() - 128 || Lq > std::numeric_limits<int>::max() - 256) {
      return false;  // the copy engine's coordinates are 32-bit
    }
    const at::Tensor q2 = mma_ready(q), k2 = mma_ready(k), v2 = mma_ready(v);
    auto run = [&](auto tile, auto kernel) {
      using T = decltype(tile);
      CUtensorMap tq, tk, tv;
      if (!make_tensor_map(&tq, q2, T::BM) || !make_tensor_map(&tk, k2, T::BN) || !make_tensor_map(&tv, v2, T::BN)) {
        return false;
      }
      auto a = base_args<scalar_t, float>(q2, k2, v2, mask, scale);
      a.out = out.mutable_data_ptr<scalar_t>();
      a.lse_out = lse.mutable_data_ptr<float>();
      set_smem(kernel, T::smem_bytes, op);
      const int64_t work = B * H * ceil_div(Lq, T::BM);  // items; the grid strides over them
      kernel<<<persistent_blocks(kernel, T::threads, T::smem_bytes, work), T::threads, T::smem_bytes, stream>>>(a, tq, tk, tv);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return true;
    };
    if (D <= 64) return run(WgTile<64>{}, attn_fwd_wgmma_kernel<scalar_t, 64, false>);
    if (!wgmma_overlap()) return run(WgTile<128>{}, attn_fwd_wgmma_kernel<scalar_t, 128, false>);
    return run(WgTile<128>{}, attn_fwd_wgmma_kernel<scalar_t, 128, true>);
  }
#endif
  return false;
}

// Tensor cores for fp16 / bf16 once there is more than one key tile and a few query rows to
// share it; returns false where the "rows" kernel is used instead.
template <typename scalar_t>
bool mma_forward(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const at::Tensor& mask, double scale, at::Tensor& out, at::Tensor& lse, cudaStream_t stream) {
  if constexpr (!std::is_same_v<scalar_t, at::Half> && !std::is_same_v<scalar_t, at::BFloat16>) {
    return false;
  } else {
    const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2), D = q.size(3);
    if (D % 8 != 0 || Lk <= kTile || Lq <= kRowBlock) return false;
    const at::Tensor q2 = mma_ready(q), k2 = mma_ready(k), v2 = mma_ready(v);
    auto a = base_args<scalar_t, float>(q2, k2, v2, mask, scale);
    a.out = out.mutable_data_ptr<scalar_t>();
    a.lse_out = lse.mutable_data_ptr<float>();
    const unsigned blocks = grid_of(B * H * ceil_div(Lq, kMmaRows), op);
    auto launch = [&](auto kernel, size_t smem) {
      set_smem(kernel, smem, op);
      kernel<<<blocks, kMmaThreads, smem, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (D <= 64) launch(attn_fwd_mma_kernel<scalar_t, 64>, MmaTile<64>::smem_bytes);
    else if (D <= 128) launch(attn_fwd_mma_kernel<scalar_t, 128>, MmaTile<128>::smem_bytes);
    else launch(attn_fwd_mma_kernel<scalar_t, 256>, MmaTile<256>::smem_bytes);
    return true;
  }
}

// Launches a persistent short-sequence kernel whose tile T gives warps and problems a block and its
// shared memory, over `problems` (b, h) problems.
template <typename T, typename Kernel, typename Args>
void launch_persistent(Kernel kernel, const Args& a, int64_t problems, const char* op, cudaStream_t stream) {
  constexpr int threads = T::warps * 32;
  set_smem(kernel, T::smem_bytes, op);
  const unsigned blocks = persistent_blocks(kernel, threads, T::smem_bytes, ceil_div(problems, T::problems));
  kernel<<<blocks, threads, T::smem_bytes, stream>>>(a);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The short kernels' (q_len, kv_len) and head_dim buckets: f(LP, DP) with LP 16 when both lengths
// are <= 16, else 32, and DP 64 or 128.
template <typename F>
void dispatch_short(int64_t Lq, int64_t Lk, int64_t D, F&& f) {
  const bool l16 = Lq <= 16 && Lk <= 16;
  if (l16 && D <= 64) f(std::integral_constant<int, 16>{}, std::integral_constant<int, 64>{});
  else if (l16) f(std::integral_constant<int, 16>{}, std::integral_constant<int, 128>{});
  else if (D <= 64) f(std::integral_constant<int, 32>{}, std::integral_constant<int, 64>{});
  else f(std::integral_constant<int, 32>{}, std::integral_constant<int, 128>{});
}

// Which kernel serves fp16 / bf16 short problems on Hopper: the copy-engine one, or with
// VD_ATTENTION_SHORT=cpasync the cp.async one (benchmarks compare the two in one process); read on every call.
bool short_tma_allowed() {
  const char* e = std::getenv("VD_ATTENTION_SHORT");
  return e == nullptr || std::string(e) != "cpasync";
}

// The copy-engine short kernel (sm_90a): head_dim <= 64, no mask, B * H well within int (the kernel
// steps its problem index in int). Returns false where the cp.async kernel is used instead.
template <typename scalar_t>
bool short_tma_forward(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& mask, const AttnArgs<scalar_t, float>& a, at::Tensor& out, cudaStream_t stream) {
#if defined(VD_SM90A)
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2), D = q.size(3);
  if (mask.defined() || D > 64 || B * H > std::numeric_limits<int>::max() / 2 || !short_tma_allowed() ||
      !device_is_sm90a()) {
    return false;
  }
  bool ran = false;
  dispatch_short(Lq, Lk, D, [&](auto lp, auto) {  // the row bucket of the cp.async kernel (D <= 64 here)
    constexpr int LP = decltype(lp)::value;
    using T = ShortTmaTile<LP>;
    CUtensorMap tq, tk, tv, to;
    if (!make_tensor_map(&tq, q, LP) || !make_tensor_map(&tk, k, LP) || !make_tensor_map(&tv, v, LP) ||
        !make_tensor_map(&to, out, LP)) {
      return;
    }
    auto kernel = attn_fwd_short_tma_kernel<scalar_t, LP>;
    set_smem(kernel, T::smem_bytes, op);
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(sm_count(), ceil_div(B * H, T::warps)));
    kernel<<<blocks, T::warps * 32, T::smem_bytes, stream>>>(a, tq, tk, tv, to);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    ran = true;
  });
  return ran;
#else
  return false;
#endif
}

// The short-sequence tensor-core kernel: fp16 / bf16, q_len and kv_len <= 32, head_dim <= 128 and a
// multiple of 8. Returns false where another kernel is used.
template <typename scalar_t>
bool short_forward(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& mask, double scale, at::Tensor& out, at::Tensor& lse, bool compute_lse,
                   cudaStream_t stream) {
  if constexpr (!std::is_same_v<scalar_t, at::Half> && !std::is_same_v<scalar_t, at::BFloat16>) {
    return false;
  } else {
    const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2), D = q.size(3);
    if (D % 8 != 0 || D > 128 || Lq > 32 || Lk > 32) return false;
    const at::Tensor q2 = mma_ready(q), k2 = mma_ready(k), v2 = mma_ready(v);
    auto a = base_args<scalar_t, float>(q2, k2, v2, mask, scale);
    a.out = out.mutable_data_ptr<scalar_t>();
    // Without compute_lse these kernels skip the lse: at 25 frames its 4-byte row stores cost 2.5 % of
    // the copy-engine kernel's time, three times their share of the bytes (bench/notes/attention.md, version 16).
    a.lse_out = compute_lse ? lse.mutable_data_ptr<float>() : nullptr;
    const int64_t P = B * H;
    if (short_tma_forward<scalar_t>(op, q2, k2, v2, mask, a, out, stream)) return true;
    dispatch_short(Lq, Lk, D, [&](auto lp, auto dp) {
      constexpr int LP = decltype(lp)::value, DP = decltype(dp)::value;
      launch_persistent<ShortTile<LP, DP>>(attn_fwd_short_kernel<scalar_t, LP, DP>, a, P, op, stream);
    });
    return true;
  }
}

// Which kernel serves fp32 short problems of 17-32 rows: the CUDA-core FMA one, or with
// VD_ATTENTION_FP32_SHORT=tf32 the 3xTF32 one (benchmarks compare the two in one process); read on every call.
bool fp32_short_fma_allowed() {
  const char* e = std::getenv("VD_ATTENTION_FP32_SHORT");
  return e == nullptr || std::string(e) != "tf32";
}

// fp32 with head_dim <= 128 and % 4 == 0, compute capability 8.0+: on tensor cores (3xTF32), except
// short problems of 17-32 rows (the CUDA-core FMA kernel; see fp32_short_fma_allowed). Returns false
// where the "rows" kernel is used instead (fp64, other head dims, older devices).
bool tf32_forward(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                  double scale, at::Tensor& out, at::Tensor& lse, cudaStream_t stream) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2), D = q.size(3);
  if (q.scalar_type() != at::kFloat || D % 4 != 0 || D > 128) return false;
  if (compute_capability() < 80) return false;
  const at::Tensor q2 = mma_ready(q), k2 = mma_ready(k), v2 = mma_ready(v);
  auto a = base_args<float, float>(q2, k2, v2, mask, scale);
  a.out = out.mutable_data_ptr<float>();
  a.lse_out = lse.mutable_data_ptr<float>();
  if (Lq <= 32 && Lk <= 32) {
    const int64_t P = B * H;
    // Up to 16 rows the 3xTF32 kernel is bound by its copies; past 16 its padded products bind it
    // (bench/notes/attention.md, version 11) and the FMA kernel serves, unless VD_ATTENTION_FP32_SHORT=tf32.
    if (std::max(Lq, Lk) > 16 && fp32_short_fma_allowed()) {
      dispatch_fp32_short(Lq, Lk, D, [&](auto dp, auto nl, auto kmin) {
        constexpr int DP = decltype(dp)::value, NL = decltype(nl)::value, KMIN = decltype(kmin)::value;
        launch_persistent<Fp32ShortTile<DP, NL>>(attn_fwd_fp32_short_kernel<DP, NL, KMIN>, a, P, op, stream);
      });
      return true;
    }
    dispatch_short(Lq, Lk, D, [&](auto lp, auto dp) {
      constexpr int LP = decltype(lp)::value, DP = decltype(dp)::value;
      launch_persistent<Tf32ShortTile<LP, DP>>(attn_fwd_tf32_short_kernel<LP, DP>, a, P, op, stream);
    });
    return true;
  }
#if defined(VD_SM90A)
  // Hopper: the wgmma kernel (head_dim <= 64, a full query tile of a warpgroup, coordinates the copy
  // engine's 32-bit fields reach); VD_ATTENTION_KERNEL=mma keeps the mma.sync one.
  constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
  if (D <= 64 && Lq >= 64 && wgmma_allowed() && device_is_sm90a() && B <= kMaxInt && H <= kMaxInt &&
      Lk <= kMaxInt - 128 && Lq <= kMaxInt - 256) {
    using T = WgTf32Tile;
    CUtensorMap tq, tk, tv;
    if (make_tensor_map(&tq, q2, T::BM) && make_tensor_map(&tk, k2, T::BN) && make_tensor_map(&tv, v2, T::BN)) {
      set_smem(attn_fwd_tf32_wgmma_kernel, T::smem_bytes, op);
      attn_fwd_tf32_wgmma_kernel<<<grid_of(B * H * ceil_div(Lq, T::BM), op), T::threads, T::smem_bytes, stream>>>(
          a, tq, tk, tv);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return true;
    }
  }
#endif
  const unsigned blocks = grid_of(B * H * ceil_div(Lq, kMmaRows), op);
  auto launch = [&](auto kernel, size_t smem) {
    set_smem(kernel, smem, op);
    kernel<<<blocks, kMmaThreads, smem, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (D <= 64) launch(attn_fwd_tf32_kernel<64>, Tf32Tile<64>::smem_bytes);
  else launch(attn_fwd_tf32_kernel<128>, Tf32Tile<128>::smem_bytes);
  return true;
}

// Which backward serves fp16 / bf16. VD_ATTENTION_BACKWARD=rows keeps the CUDA-core kernels, =mma the
// mma.sync pair on Hopper too, =pair the deterministic Hopper pair where the fused kernel would run
// (benchmarks and tests compare them in one process); read on every call.
std::string backward_choice() {
  const char* e = std::getenv("VD_ATTENTION_BACKWARD");
  return e == nullptr ? std::string() : std::string(e);
}
bool mma_backward_allowed() { return backward_choice() != "rows"; }
bool wgmma_backward_allowed() {
  const std::string c = backward_choice();
  return c != "rows" && c != "mma";
}

// What both tensor-core backward paths need: head_dim <= 128 and % 8 == 0, dk / dv views that take
// 4-byte stores along D, and no VD_ATTENTION_BACKWARD=rows.
bool tensor_core_backward_ok(int64_t D, const at::Tensor& dk, const at::Tensor& dv) {
  return D % 8 == 0 && D <= 128 && mma_layout_ok(dk) && mma_layout_ok(dv) && mma_backward_allowed();
}

// Their kernel arguments from mma_ready operands; delta / grad_lse are set by the caller.
template <typename scalar_t>
AttnArgs<scalar_t, float> tensor_core_backward_args(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v, const at::Tensor& mask, double scale,
                                                    const at::Tensor& lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv) {
  auto a = base_args<scalar_t, float>(q, k, v, mask, scale);
  a.dout = view_of<const scalar_t>(grad_out);
  a.lse = lse.const_data_ptr<float>();
  a.dq = dq.mutable_data_ptr<scalar_t>();
  a.dk = view_of<scalar_t>(dk);
  a.dv = view_of<scalar_t>(dv);
  return a;
}

// The tensor-core backward: fp16 / bf16, head_dim <= 128 and % 8 == 0, dk / dv views that take
// 4-byte stores along D. delta is already computed. Returns false where the "rows" kernels run.
template <typename scalar_t>
bool mma_backward(const char* op, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, const at::Tensor& mask, double scale, const at::Tensor& lse,
                  const at::Tensor& delta, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, cudaStream_t stream) {
  if constexpr (!std::is_same_v<scalar_t, at::Half> && !std::is_same_v<scalar_t, at::BFloat16>) {
    return false;
  } else {
    const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2), D = q.size(3);
    if (!tensor_core_backward_ok(D, dk, dv)) return false;
    const at::Tensor q2 = mma_ready(q), k2 = mma_ready(k), v2 = mma_ready(v), go2 = mma_ready(grad_out);
    auto a = tensor_core_backward_args<scalar_t>(go2, q2, k2, v2, mask, scale, lse, dq, dk, dv);
    a.delta = delta.mutable_data_ptr<float>();
    auto run = [&](auto tile, auto dq_kernel, auto dkdv_kernel) {
      using T = decltype(tile);
      set_smem(dq_kernel, T::smem_bytes, op);
      dq_kernel<<<grid_of(B * H * ceil_div(Lq, T::BR), op), kMmaThreads, T::smem_bytes, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      set_smem(dkdv_kernel, T::smem_bytes, op);
      dkdv_kernel<<<grid_of(B * H * ceil_div(Lk, T::BR), op), kMmaThreads, T::smem_bytes, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (D <= 64) run(BwdTile<64>{}, attn_bwd_dq_mma_kernel<scalar_t, 64>, attn_bwd_dkdv_mma_kernel<scalar_t, 64>);
    else run(BwdTile<128>{}, attn_bwd_dq_mma_kernel<scalar_t, 128>, attn_bwd_dkdv_mma_kernel<scalar_t, 128>);
    return true;
  }
}

// The Hopper backward pair: sm_90a builds on compute capability 9.0, fp16 / bf16, head_dim <= 128 and
// % 8 == 0, lengths the copy engine's 32-bit coordinates reach. The dq kernel computes delta (from out
// and grad_out, minus grad_lse) and writes it with lse for the dkdv kernel: no separate launch. Returns
// false where the mma.sync pair runs instead.
template <typename scalar_t>
bool wgmma_backward(const char* op, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, const at::Tensor& out, const at::Tensor& mask, double scale,
                    const at::Tensor& lse, const at::Tensor& grad_lse, at::Tensor& dq, at::Tensor& dk,
                    at::Tensor& dv, cudaStream_t stream) {
#if defined(VD_SM90A)
  if constexpr (std::is_same_v<scalar_t, at::Half> || std::is_same_v<scalar_t, at::BFloat16>) {
    const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2), D = q.size(3);
    if (!tensor_core_backward_ok(D, dk, dv) || !wgmma_backward_allowed() || !device_is_sm90a()) return false;
    constexpr int64_t kMaxInt = std::numeric_limits<int>::max();
    if (B > kMaxInt || H > kMaxInt || Lk > kMaxInt - 256 || Lq > kMaxInt - 256) return false;
    const at::Tensor q2 = mma_ready(q), k2 = mma_ready(k), v2 = mma_ready(v), go2 = mma_ready(grad_out);
    const at::Tensor o2 = mma_ready(out);  // rows read in 16-byte vectors; kept alive past the launches
    auto a = tensor_core_backward_args<scalar_t>(go2, q2, k2, v2, mask, scale, lse, dq, dk, dv);
    // head_dim <= 64: the fused kernel (five products, dQ summed by the copy engine's atomic adds),
    // unless the caller asked for deterministic algorithms or VD_ATTENTION_BACKWARD=pair, with one of two
    // tiles: 192 keys a block and 64-query tiles (three warpgroups, one dQ reader a tile), or 128 keys and
    // 128-query tiles (two warpgroups, dQ by both). Both run at the same rate where neither pads
    // (bench/notes/attention.md, version 15), so the one with less padded work runs, 192 on a tie (a few
    // per cent ahead there over lengths 384-2304); VD_ATTENTION_BACKWARD=fused192 / fused128 pins one.
    using F192 = WgFusedTile<64, 3, 2>;
    using F128 = WgFusedPairTile<64, 2>;
    auto padded = [](int64_t n, int64_t tile) { return ceil_div(n, tile) * tile; };
    const std::string choice = backward_choice();
    const bool fused = D <= 64 && !at::globalContext().deterministicAlgorithms() && choice != "pair";
    const bool fused128 = choice == "fused128" ||
                          (choice != "fused192" && padded(Lk, F128::BR) * padded(Lq, F128::BC) <
                                                       padded(Lk, F192::BR) * padded(Lq, F192::BC));
    // (lse2, delta) pairs, written by the pair's dq kernel for its dk/dv kernel (BR of both tiles is a multiple
    // of 64: dq's blocks cover the padding) or by the fused path's prep kernel (rows padded to its tile).
    a.Lq_pad = padded(Lq, fused && fused128 ? F128::BC : 64);
    at::Tensor lse_delta = at::empty({B * H * a.Lq_pad * 2}, q.options().dtype(at::kFloat));
    a.lse_delta = lse_delta.mutable_data_ptr<float>();
    a.o = view_of<const scalar_t>(o2);
    a.grad_lse = grad_lse.defined() ? grad_lse.const_data_ptr<float>() : nullptr;
    // A kernel with tile T over L rows: resident operands r1, r2 (blocks of BR rows), c1, c2 streamed (tiles
    // of BC rows). dkdv and the fused kernel: K / V resident, Q / dO streamed; dq: the other way round.
    using Maps = CUtensorMap[4];
    auto maps = [&](auto tile, Maps& m, const at::Tensor& r1, const at::Tensor& r2, const at::Tensor& c1,
                    const at::Tensor& c2) {
      using T = decltype(tile);
      return make_tensor_map(&m[0], r1, T::BR) && make_tensor_map(&m[1], r2, T::BR) && make_tensor_map(&m[2], c1, T::BC) &&
             make_tensor_map(&m[3], c2, T::BC);
    };
    auto launch = [&](auto tile, auto kernel, int64_t L, const Maps& m, auto... extra) {
      using T = decltype(tile);
      set_smem(kernel, T::smem_bytes, op);
      kernel<<<grid_of(B * H * ceil_div(L, T::BR), op), T::threads, T::smem_bytes, stream>>>(a, extra..., m[0], m[1], m[2], m[3]);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    Maps mq, mk;
    // The fused path: prep, the kernel of tile F, finish. Version 8's three warpgroups and two stages were
    // measured against two warpgroups (128 keys, 64-query tiles) and three stages.
    auto fused_path = [&](auto tile) {
      using F = decltype(tile);
      if (!maps(F{}, mk, k2, v2, q2, go2)) return false;
      at::Tensor dq_acc = at::empty({B * H * a.Lq_pad * 64}, q.options().dtype(at::kFloat));
      float* acc = dq_acc.mutable_data_ptr<float>();
      const int64_t rows = B * H * a.Lq_pad;
      attn_bwd_prep_kernel<scalar_t, 64><<<grid_of(ceil_div(rows * 8, 256), op), 256, 0, stream>>>(a, acc);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      launch(F{}, attn_bwd_fused_wgmma_kernel<scalar_t, 64, F>, Lk, mk, acc);
      attn_bwd_dq_finish_kernel<scalar_t, 64><<<grid_of(ceil_div(rows * 16, 256), op), 256, 0, stream>>>(a, acc);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return true;
    };
    if (fused && (fused128 ? fused_path(F128{}) : fused_path(F192{}))) return true;
    // The deterministic pair. Measured on the H200 (bench/notes/attention.md, version 7): three consumer
    // warpgroups where the registers allow it. dq: 64 queries x 64 keys a warpgroup; dkdv at head_dim 64:
    // 32 queries a tile (dK + dV + S^T + dP^T within 160 registers), 4 stages; at 128 dK + dV alone take
    // 128 registers: two warpgroups, 32 queries a tile.
    auto pair = [&](auto dq_tile, auto dq_kernel, auto dkdv_tile, auto dkdv_kernel) {
      if (!maps(dq_tile, mq, q2, go2, k2, v2) || !maps(dkdv_tile, mk, k2, v2, q2, go2)) return false;
      launch(dq_tile, dq_kernel, Lq, mq);
      launch(dkdv_tile, dkdv_kernel, Lk, mk);
      return true;
    };
    if (D <= 64) {
      return pair(WgBwdTile<64, 64, 3>{}, attn_bwd_dq_wgmma_kernel<scalar_t, 64, 64, 3, 2>, WgBwdTile<64, 32, 3, 4>{},
                  attn_bwd_dkdv_wgmma_kernel<scalar_t, 64, 32, 3, 4>);
    }
    return pair(WgBwdTile<128, 64, 3>{}, attn_bwd_dq_wgmma_kernel<scalar_t, 128, 64, 3, 2>, WgBwdTile<128, 32>{},
                attn_bwd_dkdv_wgmma_kernel<scalar_t, 128, 32, 2, 2>);
  }
#endif
  return false;
}

// The short-sequence backward: fp16 / bf16, q_len and kv_len <= 32, head_dim <= 128 and % 8 == 0.
// Needs no delta launch. Returns false where another backward runs.
template <typename scalar_t>
bool short_backward(const char* op, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, const at::Tensor& mask, double scale, const at::Tensor& lse,
                    const at::Tensor& grad_lse, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, cudaStream_t stream) {
  if constexpr (!std::is_same_v<scalar_t, at::Half> && !std::is_same_v<scalar_t, at::BFloat16>) {
    return false;
  } else {
    const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2), D = q.size(3);
    if (Lq > 32 || Lk > 32 || !tensor_core_backward_ok(D, dk, dv)) return false;
    const at::Tensor q2 = mma_ready(q), k2 = mma_ready(k), v2 = mma_ready(v), go2 = mma_ready(grad_out);
    auto a = tensor_core_backward_args<scalar_t>(go2, q2, k2, v2, mask, scale, lse, dq, dk, dv);
    a.grad_lse = grad_lse.defined() ? grad_lse.const_data_ptr<float>() : nullptr;
    const int64_t P = B * H;
    dispatch_short(Lq, Lk, D, [&](auto lp, auto dp) {
      constexpr int LP = decltype(lp)::value, DP = decltype(dp)::value;
      launch_persistent<ShortBwdTile<LP, DP>>(attn_bwd_short_kernel<scalar_t, LP, DP>, a, P, op, stream);
    });
    return true;
  }
}

// q, k, v already validated; mask undefined or expanded to (B, H, Lq, Lk).
// Without compute_lse the returned lse is empty, (B, H, 0); the fp16 / bf16 short kernels skip it, every
// other kernel (the fp32 short ones included) writes into a buffer that is dropped.
std::tuple<at::Tensor, at::Tensor> attention_forward(const char* op, const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v, const at::Tensor& mask, double scale,
                                                     bool compute_lse = true) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  at::Tensor out = at::empty({B, H, Lq, D}, q.options());
  at::Tensor lse = at::empty({B, H, Lq}, q.options().dtype(compute_dtype(q)));
  auto result = [&]() -> std::tuple<at::Tensor, at::Tensor> {
    return {out, compute_lse ? lse : at::empty({B, H, 0}, lse.options())};
  };
  if (B * H == 0) return result();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "fused_attention_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    if (short_forward<scalar_t>(op, q, k, v, mask, scale, out, lse, compute_lse, stream)) return;
    if (wgmma_forward<scalar_t>(op, q, k, v, mask, scale, out, lse, stream)) return;
    if (mma_forward<scalar_t>(op, q, k, v, mask, scale, out, lse, stream)) return;
    if (tf32_forward(op, q, k, v, mask, scale, out, lse, stream)) return;
    auto a = base_args<scalar_t, acc_t>(q, k, v, mask, scale);
    a.out = out.mutable_data_ptr<scalar_t>();
    a.lse_out = lse.mutable_data_ptr<acc_t>();
    const size_t smem = static_cast<size_t>(kRowBlock + 2 * kTile) * a.ld * sizeof(acc_t);
    const unsigned blocks = grid_of(B * H * ceil_div(Lq, kRowBlock), op);
    dispatch_dpl(D, [&](auto dpl) {
      auto kernel = attn_fwd_rows_kernel<scalar_t, acc_t, decltype(dpl)::value>;
      set_smem(kernel, smem, op);
      kernel<<<blocks, kRowThreads, smem, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return result();
}

// Writes dq (returned, contiguous) and dk / dv into the given (B, H, Lk, D) views.
at::Tensor attention_backward(const char* op, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                              const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse_in,
                              const at::Tensor& mask, double scale, const std::optional<at::Tensor>& grad_lse_in,
                              at::Tensor& dk, at::Tensor& dv) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2), D = q.size(3);
  at::Tensor dq = at::empty({B, H, Lq, D}, q.options());
  if (B * H == 0) return dq;
  const auto acc_type = compute_dtype(q);
  const at::Tensor lse = lse_in.to(acc_type).contiguous();
  const at::Tensor grad_lse = grad_lse_in.has_value() ? grad_lse_in->to(acc_type).contiguous() : at::Tensor();
  at::Tensor delta = at::empty({B, H, Lq}, q.options().dtype(acc_type));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "fused_attention_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    auto a = base_args<scalar_t, acc_t>(q, k, v, mask, scale);
    a.dout = view_of<const scalar_t>(grad_out);
    a.o = view_of<const scalar_t>(out);
    a.lse = lse.const_data_ptr<acc_t>();
    a.grad_lse = grad_lse.defined() ? grad_lse.const_data_ptr<acc_t>() : nullptr;
    a.delta = delta.mutable_data_ptr<acc_t>();
    a.dq = dq.mutable_data_ptr<scalar_t>();
    a.dk = view_of<scalar_t>(dk);
    a.dv = view_of<scalar_t>(dv);

    if (short_backward<scalar_t>(op, grad_out, q, k, v, mask, scale, lse, grad_lse, dq, dk, dv, stream)) return;
    if (wgmma_backward<scalar_t>(op, grad_out, q, k, v, out, mask, scale, lse, grad_lse, dq, dk, dv, stream)) return;
    attn_bwd_delta_kernel<scalar_t, acc_t><<<grid_of(ceil_div(B * H * Lq, kRowWarps), op), kRowThreads, 0, stream>>>(a);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (mma_backward<scalar_t>(op, grad_out, q, k, v, mask, scale, lse, delta, dq, dk, dv, stream)) return;

    const size_t smem = (static_cast<size_t>(2 * kRowBlock + 2 * kTile) * a.ld + 2 * kTile) * sizeof(acc_t);
    dispatch_dpl(D, [&](auto dpl) {
      constexpr int DPL = decltype(dpl)::value;
      auto dq_kernel = attn_bwd_dq_kernel<scalar_t, acc_t, DPL>;
      set_smem(dq_kernel, smem, op);
      dq_kernel<<<grid_of(B * H * ceil_div(Lq, kRowBlock), op), kRowThreads, smem, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      auto dkdv_kernel = attn_bwd_dkdv_kernel<scalar_t, acc_t, DPL>;
      set_smem(dkdv_kernel, smem, op);
      dkdv_kernel<<<grid_of(B * H * ceil_div(Lk, kRowBlock), op), kRowThreads, smem, stream>>>(a);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return dq;
}

std::tuple<at::Tensor, at::Tensor> fused_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                        const std::optional<at::Tensor>& attn_mask,
                                                        std::optional<double> scale, bool compute_lse) {
  check_attention(q, k, v, kFusedOp);
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor mask = expand_attention_mask(attn_mask, q, k, kFusedOp);
  return attention_forward(kFusedOp, q, k, v, mask, attention_scale(scale, q.size(3), kFusedOp), compute_lse);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_attention_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask, std::optional<double> scale,
    const std::optional<at::Tensor>& grad_lse) {
  check_attention(q, k, v, kFusedBwdOp);
  check_attention_backward(grad_out, q, out, lse, grad_lse, kFusedBwdOp);
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor mask = expand_attention_mask(attn_mask, q, k, kFusedBwdOp);
  at::Tensor dk = at::empty(k.sizes(), q.options());
  at::Tensor dv = at::empty(v.sizes(), q.options());
  at::Tensor dq = attention_backward(kFusedBwdOp, grad_out, q, k, v, out, lse, mask, attention_scale(scale, q.size(3), kFusedBwdOp),
                                     grad_lse, dk, dv);
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor> strided_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                          int64_t stride, std::optional<double> scale) {
  check_attention(q, k, v, kStridedOp);
  check_stride(stride, kStridedOp);
  const c10::cuda::CUDAGuard guard(q.device());
  return attention_forward(kStridedOp, q, every_stride_key(k, stride), every_stride_key(v, stride), at::Tensor(),
                           attention_scale(scale, q.size(3), kStridedOp));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> strided_attention_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, int64_t stride, std::optional<double> scale, const std::optional<at::Tensor>& grad_lse) {
  check_attention(q, k, v, kStridedBwdOp);
  check_stride(stride, kStridedBwdOp);
  check_attention_backward(grad_out, q, out, lse, grad_lse, kStridedBwdOp);
  const c10::cuda::CUDAGuard guard(q.device());
  // Keys off the stride get no gradient: zero-filled, the kernel writes the strided rows.
  at::Tensor dk = at::zeros(k.sizes(), q.options());
  at::Tensor dv = at::zeros(v.sizes(), q.options());
  at::Tensor dk_s = every_stride_key(dk, stride), dv_s = every_stride_key(dv, stride);
  at::Tensor dq = attention_backward(kStridedBwdOp, grad_out, q, every_stride_key(k, stride), every_stride_key(v, stride),
                                     out, lse, at::Tensor(), attention_scale(scale, q.size(3), kStridedBwdOp), grad_lse, dk_s, dv_s);
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(vd, CUDA, m) {
  m.impl("fused_attention", &fused_attention_cuda);
  m.impl("fused_attention_backward", &fused_attention_backward_cuda);
  m.impl("strided_attention", &strided_attention_cuda);
  m.impl("strided_attention_backward", &strided_attention_backward_cuda);
}

}  // namespace vd
