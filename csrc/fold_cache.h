// A small cache of folded conv + BatchNorm parameters (w' = w * s, b' = (b - mean) * s + beta; on CUDA s and
// b' only, s applied to the output, and the weight only where it needed a layout copy), so inference calls
// with unchanged parameters skip the per-call fold. Shared by the CPU and CUDA kernels; the one instance
// lives in csrc/cpu/fold_cache.cpp.
#pragma once
#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>

#include <array>
#include <cstdint>
#include <list>
#include <mutex>
#include <optional>

namespace vd {

// One parameter as the fold saw it. It still matches a tensor only while that is the same live
// TensorImpl (weak reference: the cache neither keeps it alive nor confuses it with a new tensor at a
// reused address), not written in place since (version counter) and on the same data (`p.data = t`
// swaps the storage without bumping the version).
struct TensorStamp {
  std::optional<c10::weak_intrusive_ptr<c10::TensorImpl>> impl;  // empty: an absent optional tensor
  uint32_t version = 0;
  const void* data = nullptr;

  static TensorStamp of(const at::Tensor* t) {
    TensorStamp s;
    if (t == nullptr || !t->defined()) return s;
    s.impl.emplace(t->getIntrusivePtr());
    s.version = t->_version();
    s.data = t->const_data_ptr();
    return s;
  }
  bool matches(const at::Tensor* t) const {
    if (t == nullptr || !t->defined()) return !impl.has_value();
    // expired() first: a dead impl's address may belong to a new tensor by now.
    return impl.has_value() && !impl->expired() && impl->_unsafe_get_target() == t->unsafeGetTensorImpl() &&
           version == t->_version() && data == t->const_data_ptr();
  }
  bool alive() const { return !impl.has_value() || !impl->expired(); }
};

constexpr size_t kFoldParams = 6;  // weight, bias, bn_weight, bn_bias, bn_mean, bn_var

struct FoldKey {
  std::array<TensorStamp, kFoldParams> params;
  at::ScalarType dtype;
  c10::Device device;
  at::MemoryFormat format;
  double eps;
  int64_t stream;  // folded on this stream: another stream could read it before the fold finished

  bool matches(const std::array<const at::Tensor*, kFoldParams>& ts, at::ScalarType dt, c10::Device dev,
               at::MemoryFormat fmt, double e, int64_t st) const {
    if (dt != dtype || dev != device || fmt != format || e != eps || st != stream) return false;
    for (size_t i = 0; i < kFoldParams; ++i)
      if (!params[i].matches(ts[i])) return false;
    return true;
  }
  bool alive() const {
    for (const auto& p : params)
      if (!p.alive()) return false;
    return true;
  }
};

struct FoldValue {
  at::Tensor weight;     // Folded::weight (w', or w's unscaled layout copy); undefined: the caller's weight as it is
  at::Tensor shift;      // b', acc dtype
  at::Tensor out_scale;  // s where the output takes it (Folded::out_scale), else undefined
  at::Tensor scale_shift;  // Folded::scale_shift
};

class FoldCache {
 public:
  static constexpr size_t kCapacity = 256;  // entries; a UNet has a few dozen conv + BN layers

  std::optional<FoldValue> find(const std::array<const at::Tensor*, kFoldParams>& ts, at::ScalarType dt,
                                c10::Device dev, at::MemoryFormat fmt, double eps, int64_t stream) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->first.matches(ts, dt, dev, fmt, eps, stream)) {
        entries_.splice(entries_.begin(), entries_, it);  // most recently used first
        ++hits_;
        return entries_.front().second;
      }
    }
    ++misses_;
    return std::nullopt;
  }

  // The entry for these parameters, or make()'s value, kept under their stamps.
  template <typename Make>
  FoldValue find_or_insert(const std::array<const at::Tensor*, kFoldParams>& ts, at::ScalarType dt,
                           c10::Device dev, at::MemoryFormat fmt, double eps, int64_t stream, Make make) {
    if (auto hit = find(ts, dt, dev, fmt, eps, stream)) return *hit;
    FoldValue v = make();
    FoldKey key{{}, dt, dev, fmt, eps, stream};
    for (size_t i = 0; i < kFoldParams; ++i) key.params[i] = TensorStamp::of(ts[i]);
    insert(std::move(key), v);
    return v;
  }

  void insert(FoldKey key, FoldValue value) {
    std::lock_guard<std::mutex> lock(mu_);
    // Entries of dead tensors can never match again, nor can older versions of this same weight.
    const c10::TensorImpl* w = key.params[0].impl->_unsafe_get_target();
    entries_.remove_if([&](const std::pair<FoldKey, FoldValue>& e) {
      return !e.first.alive() || (e.first.params[0].impl->_unsafe_get_target() == w &&
                                  e.first.device == key.device && e.first.dtype == key.dtype &&
                                  e.first.format == key.format && e.first.eps == key.eps &&
                                  e.first.stream == key.stream);
    });
    entries_.emplace_front(std::move(key), std::move(value));
    while (entries_.size() > kCapacity) entries_.pop_back();
  }

  // [hits, misses, entries]; clear drops the entries and zeroes the counters.
  std::array<int64_t, 3> stats(bool clear) {
    std::lock_guard<std::mutex> lock(mu_);
    std::array<int64_t, 3> r{hits_, misses_, static_cast<int64_t>(entries_.size())};
    if (clear) {
      entries_.clear();
      hits_ = misses_ = 0;
    }
    return r;
  }

 private:
  std::mutex mu_;
  std::list<std::pair<FoldKey, FoldValue>> entries_;
  int64_t hits_ = 0, misses_ = 0;
};

FoldCache& fold_cache();
// The same cache kind for temporal_conv's tap-major weight copies (tap_rows; the key's first parameter is
// the weight, the others absent).
FoldCache& tap_rows_cache();
// And for conv_bn_silu's Winograd weights U (16, C_out, C_in), keyed by the weight as the op reads it.
FoldCache& conv_wino_cache();

// Whether a call may use a cache of this kind: `allowed` by the device (see FoldCachePolicy), not the
// training path (the kernel cannot see the caller's grad mode — an autograd.Function runs its forward under
// no_grad, and inference keeps parameters that require grad — so an x that requires grad marks it, as does
// a parameter that requires grad under grad mode), and no inference tensor among the parameters (no version
// counter: an in-place update could not be seen).
inline bool fold_cacheable(const at::Tensor& x, const std::array<const at::Tensor*, kFoldParams>& ps, bool allowed) {
  if (!allowed || x.requires_grad() || !(x.device().is_cpu() || x.device().is_cuda())) return false;
  for (const at::Tensor* t : ps)
    if (t != nullptr && (t->is_inference() || (t->requires_grad() && at::GradMode::is_enabled()))) return false;
  return true;
}

struct Folded;
using FoldFn = Folded (*)(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                          const at::Tensor& bn_weight, const at::Tensor& bn_bias, const at::Tensor& bn_mean,
                          const at::Tensor& bn_var, double eps, at::MemoryFormat fmt);

// What the device kernel allows: no cache while a CUDA graph is being captured (a replay would keep
// reading the captured fold after the parameters change), and the stream the fold runs on.
struct FoldCachePolicy {
  bool allowed;
  int64_t stream;
  // What the cache keeps of a fold (nullptr: the fold itself). CUDA: a copy outside the caching allocator
  // (keep_outside_pools, csrc/cuda/launch.h).
  at::Tensor (*keep)(const at::Tensor&) = nullptr;
  // The forward's fold (nullptr: conv_gemm.h's fold_bn). CUDA: s and b' in one small kernel, s applied to the
  // output and the weight left unscaled (bn_vectors_cuda): what every replay of a captured graph runs.
  FoldFn fold = nullptr;
};

}  // namespace vd
