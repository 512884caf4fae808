// The process-wide fold cache of csrc/fold_cache.h (one instance for the CPU and CUDA kernels) and
// vd::conv_bn_silu_fold_cache, its counters as seen from Python (vd::conv_bn_silu_winograd_cache: the Winograd
// weights' cache's).
#include <torch/library.h>

#include <vector>

#include "../fold_cache.h"

namespace vd {

FoldCache& fold_cache() {
  // Never destroyed: freeing CUDA tensors after the CUDA runtime has shut down at exit can crash.
  static FoldCache* cache = new FoldCache();
  return *cache;
}

FoldCache& tap_rows_cache() {
  static FoldCache* cache = new FoldCache();
  return *cache;
}

FoldCache& conv_wino_cache() {
  static FoldCache* cache = new FoldCache();
  return *cache;
}

namespace {
std::vector<int64_t> stats_of(FoldCache& cache, bool clear) {
  auto s = cache.stats(clear);
  return {s[0], s[1], s[2]};
}
std::vector<int64_t> fold_cache_stats(bool clear) { return stats_of(fold_cache(), clear); }
std::vector<int64_t> wino_cache_stats(bool clear) { return stats_of(conv_wino_cache(), clear); }
}  // namespace

// No tensor arguments: the composite key is the one every call dispatches to.
TORCH_LIBRARY_IMPL(vd, CompositeImplicitAutograd, m) {
  m.impl("conv_bn_silu_fold_cache", &fold_cache_stats);
  m.impl("conv_bn_silu_winograd_cache", &wino_cache_stats);
}

}  // namespace vd
