// CPU kernels for vd::group_norm_silu: one pass for statistics, one fused normalize+affine+SiLU pass.
// Both NC* (contiguous) and N*C (channels_last) layouts are read in place.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "../norm.h"
#include "../activation.h"

namespace vd {
namespace {

// Per (n, g): mean and rstd, accumulated in double.
template <typename scalar_t>
void group_stats(const scalar_t* x, const GNShape& s, double eps, std::vector<double>& mean,
                 std::vector<double>& rstd) {
  const int64_t cpg = s.C / s.G;
  const double M = static_cast<double>(cpg * s.S);
  mean.assign(s.N * s.G, 0.0);
  rstd.assign(s.N * s.G, 0.0);
  if (!s.channels_last) {
    at::parallel_for(0, s.N * s.G, 1, [&](int64_t b, int64_t e) {
      for (int64_t ng = b; ng < e; ++ng) {
        const scalar_t* p = x + ng * cpg * s.S;
        double sum = 0, sq = 0;
        for (int64_t i = 0; i < cpg * s.S; ++i) {
          double v = static_cast<double>(p[i]);
          sum += v;
          sq += v * v;
        }
        double mu = sum / M;
        double var = std::max(0.0, sq / M - mu * mu);
        mean[ng] = mu;
        rstd[ng] = 1.0 / std::sqrt(var + eps);
      }
    });
  } else {
    at::parallel_for(0, s.N, 1, [&](int64_t b, int64_t e) {
      std::vector<double> sum(s.G), sq(s.G);
      for (int64_t n = b; n < e; ++n) {
        std::fill(sum.begin(), sum.end(), 0.0);
        std::fill(sq.begin(), sq.end(), 0.0);
        for (int64_t sp = 0; sp < s.S; ++sp) {
          const scalar_t* row = x + (n * s.S + sp) * s.C;
          for (int64_t c = 0; c < s.C; ++c) {
            double v = static_cast<double>(row[c]);
            sum[c / cpg] += v;
            sq[c / cpg] += v * v;
          }
        }
        for (int64_t g = 0; g < s.G; ++g) {
          double mu = sum[g] / M;
          double var = std::max(0.0, sq[g] / M - mu * mu);
          mean[n * s.G + g] = mu;
          rstd[n * s.G + g] = 1.0 / std::sqrt(var + eps);
        }
      }
    });
  }
}

// Per (n, c): z = (x - mean) * scale + beta, scale = rstd * gamma. Subtracting the mean first keeps
// a group with a tiny spread exact (folding the mean into a shift loses it to cancellation).
template <typename scalar_t>
void per_channel_affine(const GNShape& s, const std::vector<double>& rstd, const scalar_t* w,
                        const scalar_t* b, std::vector<double>& scale, std::vector<double>& beta) {
  const int64_t cpg = s.C / s.G;
  scale.resize(s.N * s.C);
  beta.resize(s.N * s.C);
  for (int64_t n = 0; n < s.N; ++n)
    for (int64_t c = 0; c < s.C; ++c) {
      const int64_t ng = n * s.G + c / cpg;
      scale[n * s.C + c] = rstd[ng] * (w ? static_cast<double>(w[c]) : 1.0);
      beta[n * s.C + c] = b ? static_cast<double>(b[c]) : 0.0;
    }
}

// The statistics as the ops exchange them (norm.h): the double mean split into high and low parts of the
// statistics' dtype, and rstd.
template <typename stat_t>
void write_stats(const std::vector<double>& mean, const std::vector<double>& rstd, at::Tensor& stats) {
  stat_t* p = stats.mutable_data_ptr<stat_t>();
  const int64_t NG = static_cast<int64_t>(mean.size());
  for (int64_t i = 0; i < NG; ++i) {
    const stat_t hi = static_cast<stat_t>(mean[i]);
    p[i] = hi;
    p[NG + i] = static_cast<stat_t>(mean[i] - static_cast<double>(hi));
    p[2 * NG + i] = static_cast<stat_t>(rstd[i]);
  }
}

template <typename stat_t>
void read_stats(const at::Tensor& stats, std::vector<double>& mean, std::vector<double>& rstd) {
  const stat_t* p = stats.const_data_ptr<stat_t>();
  const int64_t NG = stats.size(1) * stats.size(2);
  mean.resize(NG);
  rstd.resize(NG);
  for (int64_t i = 0; i < NG; ++i) {
    mean[i] = static_cast<double>(p[i]) + static_cast<double>(p[NG + i]);
    rstd[i] = static_cast<double>(p[2 * NG + i]);
  }
}

// The forward; writes the statistics into stats when it is defined.
at::Tensor forward_cpu(const at::Tensor& x_in, const GNShape& s, const std::optional<at::Tensor>& weight,
                       const std::optional<at::Tensor>& bias, double eps, bool silu, at::Tensor stats) {
  at::Tensor x = x_in.contiguous(layout_memory_format(x_in));
  at::Tensor out = at::empty_like(x);
  if (x.numel() == 0) return group_norm_answer(out, x_in, s);
  at::Tensor w = group_norm_param(weight, x), b = group_norm_param(bias, x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "group_norm_silu_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    std::vector<double> mean, rstd, scale, beta;
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    group_stats(xp, s, eps, mean, rstd);
    if (stats.defined()) {
      if (stats.scalar_type() == at::kDouble) write_stats<double>(mean, rstd, stats);
      else write_stats<float>(mean, rstd, stats);
    }
    per_channel_affine<scalar_t>(s, rstd, w.defined() ? w.const_data_ptr<scalar_t>() : nullptr,
                                 b.defined() ? b.const_data_ptr<scalar_t>() : nullptr, scale, beta);
    const int64_t cpg = s.C / s.G;
    // The double mean as a (hi, lo) pair of opmath values: x - mean stays accurate when the mean
    // dwarfs the group's spread (a float mean alone would round it away).
    auto apply = [&](scalar_t* dst, const scalar_t* src, double mu, opmath_t sc, opmath_t be) {
      const opmath_t hi = static_cast<opmath_t>(mu), lo = static_cast<opmath_t>(mu - static_cast<double>(hi));
      opmath_t z = ((static_cast<opmath_t>(*src) - hi) - lo) * sc + be;
      *dst = static_cast<scalar_t>(silu ? silu_fn(z) : z);
    };
    if (!s.channels_last) {
      at::parallel_for(0, s.N * s.C, 1, [&](int64_t b0, int64_t e0) {
        for (int64_t nc = b0; nc < e0; ++nc) {
          const double mu = mean[(nc / s.C) * s.G + (nc % s.C) / cpg];
          const opmath_t sc = scale[nc], be = beta[nc];
          for (int64_t i = 0; i < s.S; ++i) apply(op + nc * s.S + i, xp + nc * s.S + i, mu, sc, be);
        }
      });
    } else {
      at::parallel_for(0, s.N * s.S, 1, [&](int64_t b0, int64_t e0) {
        for (int64_t r = b0; r < e0; ++r) {
          const int64_t n = r / s.S;
          for (int64_t c = 0; c < s.C; ++c)
            apply(op + r * s.C + c, xp + r * s.C + c, mean[n * s.G + c / cpg], scale[n * s.C + c],
                  beta[n * s.C + c]);
        }
      });
    }
  });
  return group_norm_answer(out, x_in, s);
}

at::Tensor group_norm_silu_cpu(const at::Tensor& x, int64_t num_groups, const std::optional<at::Tensor>& weight,
                               const std::optional<at::Tensor>& bias, double eps, bool silu) {
  GNShape s = check_group_norm(x, num_groups, weight, bias, eps);
  return forward_cpu(x, s, weight, bias, eps, silu, at::Tensor());
}

std::tuple<at::Tensor, at::Tensor> group_norm_silu_forward_cpu(const at::Tensor& x, int64_t num_groups,
                                                               const std::optional<at::Tensor>& weight,
                                                               const std::optional<at::Tensor>& bias, double eps,
                                                               bool silu) {
  GNShape s = check_group_norm(x, num_groups, weight, bias, eps);
  at::Tensor stats = group_norm_stats_output(x, s);
  at::Tensor out = forward_cpu(x, s, weight, bias, eps, silu, stats);
  return {out, stats};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> group_norm_silu_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x_in, int64_t num_groups,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    bool silu, const std::optional<at::Tensor>& stats) {
  GNShape s = check_group_norm(x_in, num_groups, weight, bias, eps);
  check_group_norm_grad_out(grad_out, x_in);
  if (stats.has_value()) check_group_norm_stats(*stats, x_in, s);
  const auto fmt = layout_memory_format(x_in);
  at::Tensor x = x_in.contiguous(fmt);
  at::Tensor dy = grad_out.contiguous(fmt);
  at::Tensor dx = at::empty_like(x);
  const auto wdtype = weight.has_value() ? weight->scalar_type() : x.scalar_type();
  at::Tensor dw_acc = at::zeros({s.C}, x.options().dtype(at::kDouble));
  at::Tensor db_acc = at::zeros({s.C}, x.options().dtype(at::kDouble));
  if (x.numel() > 0) {
    at::Tensor w = group_norm_param(weight, x), b = group_norm_param(bias, x);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "group_norm_silu_backward_cpu", [&] {
      const scalar_t* xp = x.const_data_ptr<scalar_t>();
      const scalar_t* dyp = dy.const_data_ptr<scalar_t>();
      const scalar_t* wp = w.defined() ? w.const_data_ptr<scalar_t>() : nullptr;
      scalar_t* dxp = dx.mutable_data_ptr<scalar_t>();
      std::vector<double> mean, rstd, scale, beta;
      if (!stats.has_value()) group_stats(xp, s, eps, mean, rstd);
      else if (stats->scalar_type() == at::kDouble) read_stats<double>(*stats, mean, rstd);
      else read_stats<float>(*stats, mean, rstd);
      per_channel_affine<scalar_t>(s, rstd, wp, b.defined() ? b.const_data_ptr<scalar_t>() : nullptr,
                                   scale, beta);
      const int64_t cpg = s.C / s.G;
      // dz = dy * silu'(z); xhat = (x - mean) * rstd.
      auto dz_at = [&](int64_t idx, int64_t nc) {
        const int64_t ng = (nc / s.C) * s.G + (nc % s.C) / cpg;
        double z = (static_cast<double>(xp[idx]) - mean[ng]) * scale[nc] + beta[nc];
        double g = static_cast<double>(dyp[idx]);
        return silu ? g * silu_grad(z) : g;
      };
      auto xhat_at = [&](int64_t idx, int64_t n, int64_t c) {
        const int64_t ng = n * s.G + c / cpg;
        return (static_cast<double>(xp[idx]) - mean[ng]) * rstd[ng];
      };
      auto index = [&](int64_t n, int64_t c, int64_t sp) {
        return s.channels_last ? (n * s.S + sp) * s.C + c : (n * s.C + c) * s.S + sp;
      };
      // Pass 1: per (n, c) sums of dz and dz * xhat.
      std::vector<double> sdz(s.N * s.C, 0.0), sdzx(s.N * s.C, 0.0);
      at::parallel_for(0, s.N * s.C, 1, [&](int64_t b0, int64_t e0) {
        for (int64_t nc = b0; nc < e0; ++nc) {
          const int64_t n = nc / s.C, c = nc % s.C;
          double a = 0, bb = 0;
          for (int64_t sp = 0; sp < s.S; ++sp) {
            const int64_t idx = index(n, c, sp);
            double dz = dz_at(idx, nc);
            a += dz;
            bb += dz * xhat_at(idx, n, c);
          }
          sdz[nc] = a;
          sdzx[nc] = bb;
        }
      });
      // Group means of dxhat = dz * gamma and of dxhat * xhat.
      const double M = static_cast<double>(cpg * s.S);
      std::vector<double> m1(s.N * s.G, 0.0), m2(s.N * s.G, 0.0);
      double* dwp = dw_acc.mutable_data_ptr<double>();
      double* dbp = db_acc.mutable_data_ptr<double>();
      for (int64_t n = 0; n < s.N; ++n)
        for (int64_t c = 0; c < s.C; ++c) {
          const int64_t nc = n * s.C + c;
          const double gamma = wp ? static_cast<double>(wp[c]) : 1.0;
          m1[n * s.G + c / cpg] += gamma * sdz[nc] / M;
          m2[n * s.G + c / cpg] += gamma * sdzx[nc] / M;
          dwp[c] += sdzx[nc];
          dbp[c] += sdz[nc];
        }
      // Pass 2: dx = rstd * (dxhat - m1 - xhat * m2).
      at::parallel_for(0, s.N * s.C, 1, [&](int64_t b0, int64_t e0) {
        for (int64_t nc = b0; nc < e0; ++nc) {
          const int64_t n = nc / s.C, c = nc % s.C, ng = n * s.G + c / cpg;
          const double gamma = wp ? static_cast<double>(wp[c]) : 1.0;
          for (int64_t sp = 0; sp < s.S; ++sp) {
            const int64_t idx = index(n, c, sp);
            double dxhat = dz_at(idx, nc) * gamma;
            dxp[idx] = static_cast<scalar_t>(rstd[ng] * (dxhat - m1[ng] - xhat_at(idx, n, c) * m2[ng]));
          }
        }
      });
    });
  }
  return {dx, dw_acc.to(wdtype), db_acc.to(bias.has_value() ? bias->scalar_type() : wdtype)};
}

}  // namespace

TORCH_LIBRARY_IMPL(vd, CPU, m) {
  m.impl("group_norm_silu", &group_norm_silu_cpu);
  m.impl("group_norm_silu_forward", &group_norm_silu_forward_cpu);
  m.impl("group_norm_silu_backward", &group_norm_silu_backward_cpu);
}

}  // namespace vd
