// CPU kernels for vd::fused_attention and vd::strided_attention, forward and backward.
//
// Flash-style: scores are formed one (query block x key block) tile at a time and folded into an
// online softmax, so the (Lq, Lk) matrix never exists. Each tile of q, k, v (and of grad_out) is
// packed into a contiguous buffer of the accumulation type (float; double for float64 inputs) and
// every tile product runs through one register-blocked, vectorised micro-kernel (gemm_tile); the
// tensors themselves are read in place through their strides, transposed (B, N, H, D) views and
// expanded (stride-0) masks included.
//
// Every output element is produced by one task, in a fixed order that does not depend on the
// thread count: results are bitwise reproducible.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "../attention.h"

namespace vd {
namespace {

constexpr const char* kFusedOp = "vd::fused_attention";
constexpr const char* kFusedBwdOp = "vd::fused_attention_backward";
constexpr const char* kStridedOp = "vd::strided_attention";
constexpr const char* kStridedBwdOp = "vd::strided_attention_backward";

// Tile sizes: a query block is one parallel task of the forward and of the dq pass, a key block
// one task of the dk/dv pass; at head_dim 256 the packed tiles of one task stay within a typical L2.
constexpr int64_t kBlockQ = 64;
constexpr int64_t kBlockK = 64;

// A (batch, heads, rows, cols) tensor addressed through its element strides.
template <typename T>
struct Strided4 {
  T* data;
  int64_t sb, sh, sr, sc;
  T* row(int64_t b, int64_t h, int64_t r) const { return data + b * sb + h * sh + r * sr; }
};

template <typename T>
Strided4<const T> reader(const at::Tensor& t) {
  return {t.const_data_ptr<T>(), t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

template <typename T>
Strided4<T> writer(const at::Tensor& t) {
  return {t.mutable_data_ptr<T>(), t.stride(0), t.stride(1), t.stride(2), t.stride(3)};
}

// The attention mask, already expanded to (B, H, Lq, Lk) (broadcast dims have stride 0).
enum class MaskKind { kNone, kBool, kSameAsQ, kFloat32 };

struct MaskRef {
  MaskKind kind = MaskKind::kNone;
  const void* data = nullptr;
  int64_t sb = 0, sh = 0, sr = 0, sc = 0;
};

MaskRef mask_ref(const at::Tensor& mask, const at::Tensor& q) {
  MaskRef m;
  if (!mask.defined()) return m;
  m.kind = mask.scalar_type() == at::kBool           ? MaskKind::kBool
           : mask.scalar_type() == q.scalar_type() ? MaskKind::kSameAsQ
                                                   : MaskKind::kFloat32;
  m.data = mask.const_data_ptr();
  m.sb = mask.stride(0);
  m.sh = mask.stride(1);
  m.sr = mask.stride(2);
  m.sc = mask.stride(3);
  return m;
}

// dst[r * ld_r + c * ld_c] = src(b, h, r0 + r, c) for nr rows of D columns.
template <typename scalar_t, typename acc_t>
inline void pack_tile(const Strided4<const scalar_t>& src, int64_t b, int64_t h, int64_t r0, int64_t nr,
                      int64_t D, acc_t* dst, int64_t ld_r, int64_t ld_c) {
  for (int64_t r = 0; r < nr; ++r) {
    const scalar_t* p = src.row(b, h, r0 + r);
    for (int64_t c = 0; c < D; ++c) dst[r * ld_r + c * ld_c] = static_cast<acc_t>(p[c * src.sc]);
  }
}

// dst[r * D + c] = src(b, h, r0 + r, c): nr rows, row-major.
template <typename scalar_t, typename acc_t>
void pack_rows(const Strided4<const scalar_t>& src, int64_t b, int64_t h, int64_t r0, int64_t nr,
               int64_t D, acc_t* dst) {
  pack_tile(src, b, h, r0, nr, D, dst, D, int64_t(1));
}

// dst[c * kBlockK + r] = src(b, h, r0 + r, c): the transposed tile, the B operand of Q K^T.
template <typename scalar_t, typename acc_t>
void pack_cols(const Strided4<const scalar_t>& src, int64_t b, int64_t h, int64_t r0, int64_t nr,
               int64_t D, acc_t* dst) {
  pack_tile(src, b, h, r0, nr, D, dst, int64_t(1), kBlockK);
}

// dst(b, h, r0 + r, c) = src[r * D + c] * mul.
template <typename scalar_t, typename acc_t>
void store_rows(const Strided4<scalar_t>& dst, int64_t b, int64_t h, int64_t r0, int64_t nr,
                int64_t D, const acc_t* src, acc_t mul) {
  for (int64_t r = 0; r < nr; ++r) {
    scalar_t* p = dst.row(b, h, r0 + r);
    for (int64_t c = 0; c < D; ++c) p[c * dst.sc] = static_cast<scalar_t>(src[r * D + c] * mul);
  }
}

// The products sum over p in chunks of kChunk, each chunk from zero and then added to C. For the
// head_dim-long dot products of the scores this cuts fp32 rounding error about 3x against one
// running sum (at head_dim 256, below that of PyTorch's own fp32 matmul).
constexpr int64_t kChunk = 16;

// gemm_tile's remainder rows [i0, i1) and columns [j0, j1), summed in the same order.
template <typename acc_t>
void gemm_edge(int64_t i0, int64_t i1, int64_t j0, int64_t j1, int64_t k, const acc_t* A,
               int64_t a_rs, int64_t a_cs, const acc_t* B, int64_t ldb, acc_t* C, int64_t ldc,
               bool accumulate) {
  for (int64_t i = i0; i < i1; ++i) {
    acc_t* c = C + i * ldc;
    for (int64_t j = j0; j < j1; ++j) {
      acc_t sum = accumulate ? c[j] : acc_t(0);
      for (int64_t p0 = 0; p0 < k; p0 += kChunk) {
        acc_t t = 0;
        for (int64_t p = p0; p < std::min(k, p0 + kChunk); ++p)
          t += A[i * a_rs + p * a_cs] * B[p * ldb + j];
        sum += t;
      }
      c[j] = sum;
    }
  }
}

// One kMR x kNR block of C = [C +] A B, the chunk sums held in registers. With GCC/Clang it is
// written with 16-byte vector extensions (plain SSE2 on x86-64, NEON on aarch64; no ISA flags
// needed), which the compiler keeps in registers where plain loops spill through memory.
constexpr int64_t kMR = 4;
template <typename acc_t>
constexpr int64_t kNR = 2 * 16 / sizeof(acc_t);  // two 16-byte vectors per row

#if defined(__GNUC__)
template <typename acc_t>
struct Vec16 {
  typedef acc_t type __attribute__((vector_size(16)));
};

template <typename acc_t>
inline void gemm_block(int64_t k, const acc_t* A, int64_t a_rs, int64_t a_cs, const acc_t* B,
                       int64_t ldb, acc_t* C, int64_t ldc, bool accumulate) {
  using vec = typename Vec16<acc_t>::type;
  constexpr int64_t W = 16 / sizeof(acc_t);
  for (int64_t p0 = 0; p0 < k; p0 += kChunk) {
    vec t[kMR][2] = {};
    for (int64_t p = p0; p < std::min(k, p0 + kChunk); ++p) {
      vec b[2];
      std::memcpy(&b[0], B + p * ldb, 16);
      std::memcpy(&b[1], B + p * ldb + W, 16);
      for (int64_t r = 0; r < kMR; ++r) {
        const acc_t a = A[r * a_rs + p * a_cs];
        t[r][0] += a * b[0];
        t[r][1] += a * b[1];
      }
    }
    for (int64_t r = 0; r < kMR; ++r)
      for (int64_t u = 0; u < 2; ++u) {
        vec c = {};
        if (accumulate || p0 > 0) std::memcpy(&c, C + r * ldc + u * W, 16);
        c += t[r][u];
        std::memcpy(C + r * ldc + u * W, &c, 16);
      }
  }
}
#else
template <typename acc_t>
inline void gemm_block(int64_t k, const acc_t* A, int64_t a_rs, int64_t a_cs, const acc_t* B,
                       int64_t ldb, acc_t* C, int64_t ldc, bool accumulate) {
  constexpr int64_t NR = kNR<acc_t>;
  for (int64_t p0 = 0; p0 < k; p0 += kChunk) {
    acc_t t[kMR][NR] = {};
    for (int64_t p = p0; p < std::min(k, p0 + kChunk); ++p)
      for (int64_t r = 0; r < kMR; ++r) {
        const acc_t a = A[r * a_rs + p * a_cs];
        for (int64_t j = 0; j < NR; ++j) t[r][j] += a * B[p * ldb + j];
      }
    for (int64_t r = 0; r < kMR; ++r)
      for (int64_t j = 0; j < NR; ++j)
        C[r * ldc + j] = ((accumulate || p0 > 0) ? C[r * ldc + j] : acc_t(0)) + t[r][j];
  }
}
#endif

// C (m x n, row stride ldc) = [C +] A B, A (m x k) addressed as A[i * a_rs + p * a_cs] (so A may
// be a transposed tile), B (k x n) row-major with row stride ldb. Every product of the kernels goes
// through here. Each C element is summed in the same order on the block and edge paths.
template <typename acc_t>
void gemm_tile(int64_t m, int64_t n, int64_t k, const acc_t* A, int64_t a_rs, int64_t a_cs,
               const acc_t* B, int64_t ldb, acc_t* C, int64_t ldc, bool accumulate) {
  constexpr int64_t NR = kNR<acc_t>;
  int64_t i0 = 0;
  for (; i0 + kMR <= m; i0 += kMR) {
    int64_t j0 = 0;
    for (; j0 + NR <= n; j0 += NR)
      gemm_block(k, A + i0 * a_rs, a_rs, a_cs, B + j0, ldb, C + i0 * ldc + j0, ldc, accumulate);
    if (j0 < n) gemm_edge(i0, i0 + kMR, j0, n, k, A, a_rs, a_cs, B, ldb, C, ldc, accumulate);
  }
  if (i0 < m) gemm_edge(i0, m, int64_t(0), n, k, A, a_rs, a_cs, B, ldb, C, ldc, accumulate);
}

// S = scale * Q K^T + mask for query rows i0.. and keys j0.. (a masked-out bool entry gives -inf).
// Forward and backward both form scores here, so the backward's P matches the forward's lse.
template <typename scalar_t, typename acc_t>
void score_tile(const acc_t* Q, const acc_t* Kt, int64_t bq, int64_t bk, int64_t D, acc_t scale,
                const MaskRef& mask, int64_t b, int64_t h, int64_t i0, int64_t j0, acc_t* S) {
  gemm_tile(bq, bk, D, Q, D, int64_t(1), Kt, kBlockK, S, kBlockK, false);
  constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
  for (int64_t i = 0; i < bq; ++i) {
    acc_t* s = S + i * kBlockK;
    for (int64_t j = 0; j < bk; ++j) s[j] *= scale;
    if (mask.kind == MaskKind::kNone) continue;
    const int64_t off = b * mask.sb + h * mask.sh + (i0 + i) * mask.sr + j0 * mask.sc;
    switch (mask.kind) {
      case MaskKind::kBool: {
        const bool* m = static_cast<const bool*>(mask.data) + off;
        for (int64_t j = 0; j < bk; ++j)
          if (!m[j * mask.sc]) s[j] = kNegInf;
        break;
      }
      case MaskKind::kSameAsQ: {
        const scalar_t* m = static_cast<const scalar_t*>(mask.data) + off;
        for (int64_t j = 0; j < bk; ++j) s[j] += static_cast<acc_t>(m[j * mask.sc]);
        break;
      }
      case MaskKind::kFloat32: {
        const float* m = static_cast<const float*>(mask.data) + off;
        for (int64_t j = 0; j < bk; ++j) s[j] += static_cast<acc_t>(m[j * mask.sc]);
        break;
      }
      case MaskKind::kNone:
        break;
    }
  }
}

// P = exp(S - lse) in place; rows with lse = -inf (every key masked out) get P = 0.
template <typename acc_t>
void probs_tile(acc_t* S, const acc_t* lse, int64_t bq, int64_t bk) {
  for (int64_t i = 0; i < bq; ++i) {
    acc_t* s = S + i * kBlockK;
    if (std::isinf(lse[i]) && lse[i] < 0) {
      std::fill(s, s + bk, acc_t(0));
      continue;
    }
    for (int64_t j = 0; j < bk; ++j) s[j] = std::exp(s[j] - lse[i]);
  }
}

struct Dims {
  int64_t B, H, Lq, Lk, D;
};

Dims dims_of(const at::Tensor& q, const at::Tensor& k) {
  return {q.size(0), q.size(1), q.size(2), k.size(2), q.size(3)};
}

int64_t num_blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

// Tasks per parallel chunk: enough work to be worth waking a thread, so that small problems
// (and the many tiny calls of a gradcheck) run inline. Results do not depend on the split.
int64_t grain_for(int64_t flops_per_task) {
  constexpr int64_t kMinChunkFlops = int64_t(1) << 17;
  return std::max<int64_t>(1, kMinChunkFlops / std::max<int64_t>(1, flops_per_task));
}

// Forward into out (B, H, Lq, D) and lse (B, H, Lq); k and v may be any strided views.
void attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& mask, double scale_d, const at::Tensor& out,
                       const at::Tensor& lse) {
  const Dims s = dims_of(q, k);
  if (s.B * s.H == 0) return;
  const MaskRef mref = mask_ref(mask, q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "fused_attention_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto Qr = reader<scalar_t>(q), Kr = reader<scalar_t>(k), Vr = reader<scalar_t>(v);
    const auto Ow = writer<scalar_t>(out);
    acc_t* lse_p = lse.mutable_data_ptr<acc_t>();
    const acc_t scale = static_cast<acc_t>(scale_d);
    const int64_t D = s.D, nqb = num_blocks(s.Lq, kBlockQ);
    constexpr acc_t kNegInf = -std::numeric_limits<acc_t>::infinity();
    const int64_t grain = grain_for(4 * std::min(kBlockQ, s.Lq) * s.Lk * D);
    at::parallel_for(0, s.B * s.H * nqb, grain, [&](int64_t t0, int64_t t1) {
      std::vector<acc_t> Q(kBlockQ * D), Kt(D * kBlockK), V(kBlockK * D), S(kBlockQ * kBlockK),
          O(kBlockQ * D), m(kBlockQ), l(kBlockQ);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / (s.H * nqb), h = (t / nqb) % s.H, i0 = (t % nqb) * kBlockQ;
        const int64_t bq = std::min(kBlockQ, s.Lq - i0);
        pack_rows(Qr, b, h, i0, bq, D, Q.data());
        std::fill(O.begin(), O.end(), acc_t(0));
        std::fill(m.begin(), m.end(), kNegInf);
        std::fill(l.begin(), l.end(), acc_t(0));
        for (int64_t j0 = 0; j0 < s.Lk; j0 += kBlockK) {
          const int64_t bk = std::min(kBlockK, s.Lk - j0);
          pack_cols(Kr, b, h, j0, bk, D, Kt.data());
          pack_rows(Vr, b, h, j0, bk, D, V.data());
          score_tile<scalar_t>(Q.data(), Kt.data(), bq, bk, D, scale, mref, b, h, i0, j0, S.data());
          // Online softmax: rescale each row's running sums to its new max, then O += P V.
          for (int64_t i = 0; i < bq; ++i) {
            acc_t* srow = S.data() + i * kBlockK;
            const acc_t m_new = std::max(m[i], *std::max_element(srow, srow + bk));
            if (m_new == kNegInf) {  // every key so far masked out: this tile adds nothing
              std::fill(srow, srow + bk, acc_t(0));
              continue;
            }
            const acc_t alpha = std::exp(m[i] - m_new);  // 0 while m[i] is still -inf
            for (int64_t j = 0; j < bk; ++j) srow[j] = std::exp(srow[j] - m_new);
            acc_t sum = 0;
            for (int64_t j = 0; j < bk; ++j) sum += srow[j];
            l[i] = l[i] * alpha + sum;
            m[i] = m_new;
            if (alpha != acc_t(1)) {
              acc_t* o = O.data() + i * D;
              for (int64_t d = 0; d < D; ++d) o[d] *= alpha;
            }
          }
          gemm_tile(bq, D, bk, S.data(), kBlockK, int64_t(1), V.data(), D, O.data(), D, true);
        }
        // Normalise; a fully masked row (l = 0) is defined as out = 0, lse = -inf.
        for (int64_t i = 0; i < bq; ++i) {
          const bool empty = l[i] == acc_t(0);
          const acc_t inv = empty ? acc_t(0) : acc_t(1) / l[i];
          acc_t* o = O.data() + i * D;
          for (int64_t d = 0; d < D; ++d) o[d] *= inv;
          lse_p[(b * s.H + h) * s.Lq + i0 + i] = empty ? kNegInf : m[i] + std::log(l[i]);
        }
        store_rows(Ow, b, h, i0, bq, D, O.data(), acc_t(1));
      }
    });
  });
}

// Backward, written into dq, dk, dv (views of the caller's choosing: the strided op passes
// row-strided views of zero-filled dk, dv). Two race-free passes that recompute P from lse:
// dk, dv per key block (each task owns its keys), dq per query block.
void attention_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse_in,
                        const at::Tensor& mask, double scale_d,
                        const std::optional<at::Tensor>& grad_lse_in, const at::Tensor& dq,
                        const at::Tensor& dk, const at::Tensor& dv) {
  const Dims s = dims_of(q, k);
  if (s.B * s.H == 0) return;
  const MaskRef mref = mask_ref(mask, q);
  const at::Tensor lse = lse_in.contiguous();
  const at::Tensor grad_lse = grad_lse_in.has_value() ? grad_lse_in->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "fused_attention_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto Qr = reader<scalar_t>(q), Kr = reader<scalar_t>(k), Vr = reader<scalar_t>(v);
    const auto dOr = reader<scalar_t>(grad_out), Or = reader<scalar_t>(out);
    const auto dQw = writer<scalar_t>(dq), dKw = writer<scalar_t>(dk), dVw = writer<scalar_t>(dv);
    const acc_t* lse_p = lse.const_data_ptr<acc_t>();
    const acc_t* glse_p = grad_lse.defined() ? grad_lse.const_data_ptr<acc_t>() : nullptr;
    const acc_t scale = static_cast<acc_t>(scale_d);
    const int64_t D = s.D, BH = s.B * s.H;
    const int64_t nqb = num_blocks(s.Lq, kBlockQ), nkb = num_blocks(s.Lk, kBlockK);

    // Delta_i = rowsum(dO_i * O_i) - grad_lse_i, so that dS = P * (dP - Delta) also carries the
    // gradient of lse (d lse_i / d S_ij = P_ij).
    std::vector<acc_t> delta(BH * s.Lq);
    at::parallel_for(0, BH * s.Lq, grain_for(2 * D), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t b = r / (s.H * s.Lq), h = (r / s.Lq) % s.H, i = r % s.Lq;
        const scalar_t* go = dOr.row(b, h, i);
        const scalar_t* o = Or.row(b, h, i);
        acc_t acc = 0;
        for (int64_t d = 0; d < D; ++d)
          acc += static_cast<acc_t>(go[d * dOr.sc]) * static_cast<acc_t>(o[d * Or.sc]);
        delta[r] = acc - (glse_p ? glse_p[r] : acc_t(0));
      }
    });

    // Scores of one tile turned into P (in S) and dS (in dP); returns nothing, fills both.
    auto tile_grads = [&](const acc_t* Q, const acc_t* dO, const acc_t* Kt, const acc_t* Vt,
                          int64_t b, int64_t h, int64_t i0, int64_t bq, int64_t j0, int64_t bk,
                          acc_t* S, acc_t* dP) {
      const int64_t row0 = (b * s.H + h) * s.Lq + i0;
      score_tile<scalar_t>(Q, Kt, bq, bk, D, scale, mref, b, h, i0, j0, S);
      probs_tile(S, lse_p + row0, bq, bk);
      gemm_tile(bq, bk, D, dO, D, int64_t(1), Vt, kBlockK, dP, kBlockK, false);
      for (int64_t i = 0; i < bq; ++i) {
        const acc_t* p = S + i * kBlockK;
        acc_t* dp = dP + i * kBlockK;
        const acc_t dl = delta[row0 + i];
        for (int64_t j = 0; j < bk; ++j) dp[j] = p[j] * (dp[j] - dl);
      }
    };

    // Pass 1: dv = P^T dO and dk = scale * dS^T Q, one task per (b, h, key block).
    at::parallel_for(0, BH * nkb, grain_for(8 * s.Lq * std::min(kBlockK, s.Lk) * D), [&](int64_t t0, int64_t t1) {
      std::vector<acc_t> Q(kBlockQ * D), dO(kBlockQ * D), Kt(D * kBlockK), Vt(D * kBlockK),
          S(kBlockQ * kBlockK), dP(kBlockQ * kBlockK), dK(kBlockK * D), dV(kBlockK * D);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / (s.H * nkb), h = (t / nkb) % s.H, j0 = (t % nkb) * kBlockK;
        const int64_t bk = std::min(kBlockK, s.Lk - j0);
        pack_cols(Kr, b, h, j0, bk, D, Kt.data());
        pack_cols(Vr, b, h, j0, bk, D, Vt.data());
        std::fill(dK.begin(), dK.end(), acc_t(0));
        std::fill(dV.begin(), dV.end(), acc_t(0));
        for (int64_t i0 = 0; i0 < s.Lq; i0 += kBlockQ) {
          const int64_t bq = std::min(kBlockQ, s.Lq - i0);
          pack_rows(Qr, b, h, i0, bq, D, Q.data());
          pack_rows(dOr, b, h, i0, bq, D, dO.data());
          tile_grads(Q.data(), dO.data(), Kt.data(), Vt.data(), b, h, i0, bq, j0, bk, S.data(),
                     dP.data());
          // dV += P^T dO and dK += dS^T Q (transposed reads of the tiles).
          gemm_tile(bk, D, bq, S.data(), int64_t(1), kBlockK, dO.data(), D, dV.data(), D, true);
          gemm_tile(bk, D, bq, dP.data(), int64_t(1), kBlockK, Q.data(), D, dK.data(), D, true);
        }
        store_rows(dKw, b, h, j0, bk, D, dK.data(), scale);
        store_rows(dVw, b, h, j0, bk, D, dV.data(), acc_t(1));
      }
    });

    // Pass 2: dq = scale * dS K, one task per (b, h, query block).
    at::parallel_for(0, BH * nqb, grain_for(6 * std::min(kBlockQ, s.Lq) * s.Lk * D), [&](int64_t t0, int64_t t1) {
      std::vector<acc_t> Q(kBlockQ * D), dO(kBlockQ * D), K(kBlockK * D), Kt(D * kBlockK),
          Vt(D * kBlockK), S(kBlockQ * kBlockK), dP(kBlockQ * kBlockK), dQ(kBlockQ * D);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t b = t / (s.H * nqb), h = (t / nqb) % s.H, i0 = (t % nqb) * kBlockQ;
        const int64_t bq = std::min(kBlockQ, s.Lq - i0);
        pack_rows(Qr, b, h, i0, bq, D, Q.data());
        pack_rows(dOr, b, h, i0, bq, D, dO.data());
        std::fill(dQ.begin(), dQ.end(), acc_t(0));
        for (int64_t j0 = 0; j0 < s.Lk; j0 += kBlockK) {
          const int64_t bk = std::min(kBlockK, s.Lk - j0);
          pack_rows(Kr, b, h, j0, bk, D, K.data());
          pack_cols(Kr, b, h, j0, bk, D, Kt.data());
          pack_cols(Vr, b, h, j0, bk, D, Vt.data());
          tile_grads(Q.data(), dO.data(), Kt.data(), Vt.data(), b, h, i0, bq, j0, bk, S.data(),
                     dP.data());
          gemm_tile(bq, D, bk, dP.data(), kBlockK, int64_t(1), K.data(), D, dQ.data(), D, true);
        }
        store_rows(dQw, b, h, i0, bq, D, dQ.data(), scale);
      }
    });
  });
}

at::Tensor new_output(const at::Tensor& like_rows, const at::Tensor& q) {
  return at::empty({q.size(0), q.size(1), like_rows.size(2), q.size(3)}, q.options());
}

at::Tensor new_lse(const at::Tensor& q) {
  return at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(compute_dtype(q)));
}

std::tuple<at::Tensor, at::Tensor> fused_attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                                       const at::Tensor& v,
                                                       const std::optional<at::Tensor>& attn_mask,
                                                       std::optional<double> scale, bool compute_lse) {
  check_attention(q, k, v, kFusedOp);
  const double sc = attention_scale(scale, q.size(3), kFusedOp);
  const at::Tensor mask = expand_attention_mask(attn_mask, q, k, kFusedOp);
  at::Tensor out = new_output(q, q);
  at::Tensor lse = new_lse(q);
  attention_forward(q, k, v, mask, sc, out, lse);
  if (!compute_lse) return {out, at::empty({q.size(0), q.size(1), 0}, lse.options())};  // the same math, lse dropped
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& attn_mask,
    std::optional<double> scale, const std::optional<at::Tensor>& grad_lse) {
  check_attention(q, k, v, kFusedBwdOp);
  check_attention_backward(grad_out, q, out, lse, grad_lse, kFusedBwdOp);
  const double sc = attention_scale(scale, q.size(3), kFusedBwdOp);
  const at::Tensor mask = expand_attention_mask(attn_mask, q, k, kFusedBwdOp);
  at::Tensor dq = new_output(q, q), dk = new_output(k, q), dv = new_output(k, q);
  attention_backward(grad_out, q, k, v, out, lse, mask, sc, grad_lse, dq, dk, dv);
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor> strided_attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& v, int64_t stride,
                                                         std::optional<double> scale) {
  check_attention(q, k, v, kStridedOp);
  check_stride(stride, kStridedOp);
  const double sc = attention_scale(scale, q.size(3), kStridedOp);
  at::Tensor out = new_output(q, q);
  at::Tensor lse = new_lse(q);
  attention_forward(q, every_stride_key(k, stride), every_stride_key(v, stride), at::Tensor(), sc,
                    out, lse);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> strided_attention_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, int64_t stride, std::optional<double> scale,
    const std::optional<at::Tensor>& grad_lse) {
  check_attention(q, k, v, kStridedBwdOp);
  check_stride(stride, kStridedBwdOp);
  check_attention_backward(grad_out, q, out, lse, grad_lse, kStridedBwdOp);
  const double sc = attention_scale(scale, q.size(3), kStridedBwdOp);
  // Skipped keys get no gradient: the kernel writes only the attended rows of zero-filled dk, dv.
  at::Tensor dq = new_output(q, q), dk = at::zeros({q.size(0), q.size(1), k.size(2), q.size(3)}, q.options()),
             dv = at::zeros_like(dk);
  attention_backward(grad_out, q, every_stride_key(k, stride), every_stride_key(v, stride), out,
                     lse, at::Tensor(), sc, grad_lse, dq, every_stride_key(dk, stride),
                     every_stride_key(dv, stride));
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY_IMPL(vd, CPU, m) {
  m.impl("fused_attention", &fused_attention_cpu);
  m.impl("fused_attention_backward", &fused_attention_backward_cpu);
  m.impl("strided_attention", &strided_attention_cpu);
  m.impl("strided_attention_backward", &strided_attention_backward_cpu);
}

}  // namespace vd
