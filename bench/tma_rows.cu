// Microbenchmark: do Hopper bulk tensor copies (TMA) whose box rows start 16 bytes into a 32-byte sector run
// slower than boxes whose rows start on a 32-byte boundary?
//
// Build (sm_90a only; the program refuses other devices):
//   mkdir -p build && nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a bench/tma_rows.cu -o build/tma_rows -lcuda
// Run (from the repository root; the JSON path is optional):
//   build/tma_rows [out.json]
// Default JSON path: bench/results/tma_rows_<device name, spaces as _>_<UTC yyyymmddThhmmss>.json
//
// Data: a float32 buffer of P pixel rows of C = 960 floats (3840-byte rows, P = 279552, about 1 GiB, far larger
// than L2), value (row * 31 + col * 7) % 8191 at (row, col), seen through a 2-D tensor map: dims {C, P}, row
// stride C * 4 bytes, box {W, R}, SWIZZLE_NONE, INTERLEAVE_NONE, OOB fill none, L2 promotion per case.
//
// Kernel: persistent (SMs x CTAs per SM), one producer thread (warp 0) issuing box loads into a ring of S
// shared-memory stages guarded by full / empty mbarriers, four consumer warps that wait on the full barrier,
// read and check a few words of the stage (the values are known) and release it.
//
// Kinds of case (one line of output each, and one JSON entry):
//   baseline_dram  float4 streaming read of the whole 1 GiB (the copy-read ceiling for DRAM cases)
//   baseline_l2    float4 streaming read of an 8 MiB region, 128 times (ceiling for the l2 cases)
//   column         one column of W channels from channel c0, every pixel block of R rows ({c0, r * R});
//                  a timed run walks n such columns, c0 + 64 k (k = 0..n-1, 256 bytes apart, so the start
//                  byte % 256 is the same in all of them), in an order that leaves >= 4 columns between
//                  neighbours, so no column is read from L2 left behind by the previous one.
//   all_blocks     every channel block c0 = c_off + W * b of every pixel block (the group-norm kernel's
//                  pattern: neighbouring boxes share the 32-byte sectors at their edges)
//   l2             a column over only the first 32768 rows (<= 16 MiB of L2 lines), read 128 times in one
//                  launch after a warm-up: the copy engine's own rate without DRAM
// Bandwidth = payload bytes (W * 4 per row read) / median time; "sect" = bytes of the 32-byte sectors the rows
// span / median time; % = payload GB/s over the matching baseline.
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

namespace {

constexpr int kC = 960;                 // floats a pixel row
constexpr int kConsumerWarps = 4;
constexpr int kThreads = 32 * (1 + kConsumerWarps);
constexpr int kMaxCols = 32;            // column starts one launch may walk
constexpr int kMaxStages = 8;
constexpr int kCheckWords = 4;          // words each consumer thread reads and checks a stage
constexpr uint32_t kValueMod = 8191;

__host__ __device__ inline float cell_value(uint32_t row, uint32_t col) {
  return static_cast<float>((row * 31u + col * 7u) % kValueMod);
}

// ---- PTX wrappers: mbarriers (shared::cta) and the bulk tensor copy engine ----

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes initialized barriers visible to the other threads and to the copy engine.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives and announces `bytes` of copies that will complete on this phase.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint32_t bar, uint32_t parity) {
  uint32_t ok;
  asm volatile(
      "{\n.reg .pred P1;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%1], %2;\n"
      "selp.u32 %0, 1, 0, P1;\n}\n"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
// Waits until the phase of the given parity has completed (a fresh barrier: parity 1 passes at once). Traps after
// 2 s instead of hanging (a copy that never completes its bytes), so the host sees a launch failure.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  const uint64_t t0 = global_ns();
  for (;;) {
    for (int i = 0; i < 64; ++i)
      if (mbar_try_wait(bar, parity)) return;
    if (global_ns() - t0 > 2000000000ull) {
      printf("tma_rows: mbarrier wait timed out (block %d thread %d parity %u)\n", blockIdx.x, threadIdx.x, parity);
      __trap();
    }
  }
}
__device__ __forceinline__ void prefetch_tensormap(const void* tmap) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(tmap) : "memory");
}
// A 2-D box of a tensor map into shared memory, completing on the barrier (tx bytes).
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(tmap), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

// ---- kernels ----

// What one launch walks: passes x ncols x nblk boxes {cols[col], rb * R}. Column-major order (all pixel blocks of a
// column, then the next column) or row-major (all columns of a pixel block, then the next block).
struct Work {
  int cols[kMaxCols];
  int ncols, nblk, passes, row_major;
  int W, R, rows;      // box {W, R}; rows: the tensor map's dim 1 (rows past it read as zeros)
  int stages;
  uint32_t box_bytes;  // W * 4 * R: the bytes a box completes on its barrier
  uint32_t stage_bytes;
  int check_step;      // word stride of the checked words in a stage
};

__global__ void fill_kernel(float* __restrict__ x, long long n) {
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<long long>(gridDim.x) * blockDim.x)
    x[i] = cell_value(static_cast<uint32_t>(i / kC), static_cast<uint32_t>(i % kC));
}

// Item q of a pass: its box column and row block (row_major: columns fastest).
__device__ __forceinline__ void work_item(const Work& w, int q, int& col, int& rb) {
  col = w.row_major ? q % w.ncols : q / w.nblk;
  rb = w.row_major ? q / w.ncols : q % w.nblk;
}

__global__ void __launch_bounds__(kThreads) tma_stream(const __grid_constant__ CUtensorMap tmap,
                                                       const __grid_constant__ Work w, float* __restrict__ sink,
                                                       unsigned long long* __restrict__ bad) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  __shared__ float red[kConsumerWarps];
  const uint32_t raw = smem_u32(smem_raw);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const uint32_t full0 = base, empty0 = base + 8u * w.stages, data = base + 1024u;
  const unsigned char* data_ptr = smem_raw + (data - raw);
  const int S = w.stages;
  const int per_pass = w.ncols * w.nblk;
  const int total = w.passes * per_pass;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  if (threadIdx.x == 0) {
    for (int st = 0; st < S; ++st) {
      mbar_init(full0 + 8u * st, 1);
      mbar_init(empty0 + 8u * st, kConsumerWarps);
    }
    mbar_init_fence();
    prefetch_tensormap(&tmap);
  }
  __syncthreads();

  if (warp == 0) {
    if (lane == 0) {
      int st = 0;
      uint32_t ph = 0;
      for (int i = blockIdx.x; i < total; i += gridDim.x) {
        int col, rb;
        work_item(w, i % per_pass, col, rb);
        mbar_wait(empty0 + 8u * st, ph ^ 1u);
        mbar_expect_tx(full0 + 8u * st, w.box_bytes);
        tma_load_2d(data + st * w.stage_bytes, &tmap, full0 + 8u * st, w.cols[col], rb * w.R);
        if (++st == S) {
          st = 0;
          ph ^= 1u;
        }
      }
    }
    return;
  }

  // Consumers: thread t of 128 reads words (t + 128 k) * check_step of each stage and checks them.
  const int t = threadIdx.x - 32;
  const int words = w.W * w.R;
  float acc = 0.f;
  unsigned long long nbad = 0;
  int st = 0;
  uint32_t ph = 0;
  for (int i = blockIdx.x; i < total; i += gridDim.x) {
    int col, rb;
    work_item(w, i % per_pass, col, rb);
    mbar_wait(full0 + 8u * st, ph);
    const float* s = reinterpret_cast<const float*>(data_ptr + st * w.stage_bytes);
#pragma unroll
    for (int k = 0; k < kCheckWords; ++k) {
      const int j = ((t + 128 * k) * w.check_step) % words;
      const float v = s[j];
      const int row = rb * w.R + j / w.W, c = w.cols[col] + j % w.W;
      const float want = row < w.rows ? cell_value(row, c) : 0.f;
      nbad += v != want;
      acc += v;
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(empty0 + 8u * st);
    if (++st == S) {
      st = 0;
      ph ^= 1u;
    }
  }
  for (int o = 16; o > 0; o /= 2) {
    acc += __shfl_xor_sync(0xffffffffu, acc, o);
    nbad += __shfl_xor_sync(0xffffffffu, nbad, o);
  }
  if (lane == 0) {
    red[warp - 1] = acc;
    if (nbad) atomicAdd(bad, nbad);
  }
  asm volatile("bar.sync 1, %0;\n" ::"r"(32 * kConsumerWarps) : "memory");
  if (t == 0) {
    float s = 0.f;
    for (int k = 0; k < kConsumerWarps; ++k) s += red[k];
    sink[blockIdx.x] = s;
  }
#else
  __trap();  // built for sm_90a only
#endif
}

// The copy-read ceiling: float4 loads cached in L2 only, four in flight a thread, `passes` times over the region.
__global__ void __launch_bounds__(256) stream_read(const float4* __restrict__ p, long long n4, int passes,
                                                   float* __restrict__ sink) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  float acc = 0.f;
  for (int pass = 0; pass < passes; ++pass) {
    for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < n4; i += 4 * stride) {
      float4 v[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        v[k] = i + k * stride < n4 ? __ldcg(p + i + k * stride) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int k = 0; k < 4; ++k) acc += v[k].x + v[k].y + v[k].z + v[k].w;
    }
  }
  __shared__ float red[8];
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int k = 0; k < static_cast<int>(blockDim.x / 32); ++k) s += red[k];
    sink[blockIdx.x] = s;
  }
}

// ---- host ----

struct Result {
  std::string kind, status = "ok", promo = "-";
  int W = 0, c0 = 0, R = 0, stages = 0, ctas_per_sm = 0, grid = 0, ncols = 0, passes = 0;
  long long rows = 0;
  double payload = 0, sectors = 0, fetch = 0;  // bytes a timed run: payload, 32-byte sectors spanned, promotion
                                               // granules spanned (max(32, promotion) bytes)
  double frac16 = 0;                           // fraction of box rows starting at byte 16 mod 32
  double med = 0, mn = 0, mx = 0;              // ms a timed run
  double gbps = 0, sgbps = 0, pct = 0;
  unsigned long long bad = 0, checked = 0;
};

std::vector<Result> g_results;
std::string g_json_path, g_device, g_date;
int g_driver = 0, g_runtime = 0;
FILE* g_json = nullptr;
std::chrono::steady_clock::time_point g_t0;

void write_json(const char* error);

[[noreturn]] void fatal(const char* what, const char* file, int line, const char* msg) {
  char buf[1024];
  snprintf(buf, sizeof buf, "%s:%d: %s: %s", file, line, what, msg);
  fprintf(stderr, "FATAL %s\n", buf);
  write_json(buf);
  exit(1);
}
#define CK(call)                                                                                  \
  do {                                                                                            \
    const cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) fatal(#call, __FILE__, __LINE__, (std::string(cudaGetErrorName(e_)) + \
                                                            " (" + cudaGetErrorString(e_) + ")")  \
                                                               .c_str());                         \
  } while (0)

const char* promo_name(CUtensorMapL2promotion p) {
  switch (p) {
    case CU_TENSOR_MAP_L2_PROMOTION_NONE: return "NONE";
    case CU_TENSOR_MAP_L2_PROMOTION_L2_64B: return "64B";
    case CU_TENSOR_MAP_L2_PROMOTION_L2_128B: return "128B";
    default: return "256B";
  }
}
int promo_bytes(CUtensorMapL2promotion p) {
  switch (p) {
    case CU_TENSOR_MAP_L2_PROMOTION_NONE: return 32;
    case CU_TENSOR_MAP_L2_PROMOTION_L2_64B: return 64;
    case CU_TENSOR_MAP_L2_PROMOTION_L2_128B: return 128;
    default: return 256;
  }
}
// Granules of g bytes that [start, start + len) spans.
long long span(long long start, long long len, long long g) { return (start + len - 1) / g - start / g + 1; }

void write_json(const char* error) {
  if (g_json == nullptr) return;
  FILE* f = g_json;
  g_json = nullptr;
  fprintf(f, "{\n  \"benchmark\": \"tma_rows\",\n  \"device\": \"%s\",\n  \"cuda_driver_version\": %d,\n", g_device.c_str(),
          g_driver);
  fprintf(f, "  \"cuda_runtime_version\": %d,\n  \"date_utc\": \"%s\",\n", g_runtime, g_date.c_str());
  fprintf(f, "  \"row_floats\": %d,\n  \"row_bytes\": %d,\n", kC, kC * 4);
  fprintf(f, "  \"total_seconds\": %.2f,\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - g_t0).count());
  if (error) {
    std::string e(error);
    for (auto& ch : e)
      if (ch == '"' || ch == '\\') ch = '\'';
    fprintf(f, "  \"error\": \"%s\",\n", e.c_str());
  }
  fprintf(f, "  \"cases\": [\n");
  for (size_t i = 0; i < g_results.size(); ++i) {
    const Result& r = g_results[i];
    fprintf(f,
            "    {\"kind\": \"%s\", \"status\": \"%s\", \"box_w\": %d, \"row_bytes\": %d, \"c0\": %d, "
            "\"start_mod32\": %d, \"R\": %d, \"promotion\": \"%s\", \"stages\": %d, \"ctas_per_sm\": %d, "
            "\"grid\": %d, \"rows\": %lld, \"columns\": %d, \"passes\": %d, \"payload_bytes\": %.0f, "
            "\"sector_bytes\": %.0f, \"promotion_granule_bytes\": %.0f, \"frac_rows_mod16\": %.4f, "
            "\"median_ms\": %.5f, \"min_ms\": %.5f, \"max_ms\": %.5f, \"payload_gbps\": %.1f, \"sector_gbps\": %.1f, "
            "\"pct_of_baseline\": %.1f, \"checked_words\": %llu, \"bad_words\": %llu}%s\n",
            r.kind.c_str(), r.status.c_str(), r.W, r.W * 4, r.c0, (r.c0 * 4) % 32, r.R, r.promo.c_str(), r.stages,
            r.ctas_per_sm, r.grid, r.rows, r.ncols, r.passes, r.payload, r.sectors, r.fetch, r.frac16, r.med, r.mn,
            r.mx, r.gbps, r.sgbps, r.pct, r.checked, r.bad, i + 1 < g_results.size() ? "," : "");
  }
  fprintf(f, "  ],\n  \"ratios_mod16_over_mod0\": [\n");
  bool first = true;
  for (const Result& a : g_results) {
    if (a.status != "ok" || (a.kind != "column" && a.kind != "l2" && a.kind != "all_blocks") || (a.c0 * 4) % 32 != 0)
      continue;
    for (const Result& b : g_results) {
      if (b.status != "ok" || b.kind != a.kind || b.W != a.W || b.R != a.R || b.promo != a.promo ||
          (b.c0 * 4) % 32 != 16)
        continue;
      fprintf(f,
              "%s    {\"kind\": \"%s\", \"row_bytes\": %d, \"R\": %d, \"promotion\": \"%s\", \"gbps_mod0\": %.1f, "
              "\"gbps_mod16\": %.1f, \"ratio\": %.3f}",
              first ? "" : ",\n", a.kind.c_str(), a.W * 4, a.R, a.promo.c_str(), a.gbps, b.gbps, b.gbps / a.gbps);
      first = false;
    }
  }
  fprintf(f, "\n  ]\n}\n");
  fclose(f);
  fprintf(stderr, "wrote %s\n", g_json_path.c_str());
}

PFN_cuTensorMapEncodeTiled_v12000 g_encode = nullptr;
PFN_cuGetErrorName_v6000 g_errname = nullptr;

template <typename Fn>
Fn driver_entry(const char* name) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q{};
  CK(cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q));
  return q == cudaDriverEntryPointSuccess ? reinterpret_cast<Fn>(p) : nullptr;
}

// The 2-D map {C, rows} over x with box {W, R}; on failure prints the parameters and returns the driver's error.
std::string encode_map(CUtensorMap* m, float* x, long long rows, int W, int R, CUtensorMapL2promotion promo) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(kC), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(kC) * 4};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(W), static_cast<cuuint32_t>(R)};
  const cuuint32_t unit[2] = {1, 1};
  const CUresult r = g_encode(m, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, x, dims, strides, box, unit,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, promo,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r == CUDA_SUCCESS) return "";
  const char* name = nullptr;
  if (g_errname == nullptr || g_errname(r, &name) != CUDA_SUCCESS || name == nullptr) name = "unknown";
  fprintf(stderr,
          "  cuTensorMapEncodeTiled failed: %s (%d): FLOAT32 rank 2, base %p (%% 16 = %llu), dims {%d, %lld}, "
          "strides {%d} bytes, box {%d, %d} (inner %d bytes), elementStrides {1, 1}, INTERLEAVE_NONE, "
          "SWIZZLE_NONE, promotion %s, OOB fill NONE\n",
          name, static_cast<int>(r), static_cast<void*>(x),
          static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(x) % 16), kC, rows, kC * 4, W, R, W * 4,
          promo_name(promo));
  return std::string("encode_failed: ") + name;
}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

constexpr int kWarmup = 2, kReps = 11;
int g_sms = 0;
size_t g_optin = 0;
float* g_x = nullptr;
float* g_sink = nullptr;
unsigned long long* g_bad = nullptr;
long long g_P = 0;
double g_base_dram = 0, g_base_l2 = 0;
cudaEvent_t g_ev0, g_ev1;

template <typename Launch>
void time_it(Result& r, Launch&& launch) {
  for (int i = 0; i < kWarmup; ++i) launch();
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  CK(cudaMemset(g_bad, 0, sizeof(unsigned long long)));
  std::vector<float> ms;
  for (int i = 0; i < kReps; ++i) {
    CK(cudaEventRecord(g_ev0));
    launch();
    CK(cudaEventRecord(g_ev1));
    CK(cudaEventSynchronize(g_ev1));
    CK(cudaGetLastError());
    float t = 0;
    CK(cudaEventElapsedTime(&t, g_ev0, g_ev1));
    ms.push_back(t);
  }
  CK(cudaMemcpy(&r.bad, g_bad, sizeof r.bad, cudaMemcpyDeviceToHost));
  r.med = median(ms);
  r.mn = *std::min_element(ms.begin(), ms.end());
  r.mx = *std::max_element(ms.begin(), ms.end());
  r.gbps = r.payload / (r.med * 1e6);
  r.sgbps = r.sectors / (r.med * 1e6);
}

void print_header() {
  printf("%-13s %5s %3s %5s %4s %5s %3s %4s %9s %8s %8s %6s %s\n", "kind", "rowB", "c0", "mod32", "R", "promo", "st",
         "cta", "ms(med)", "GB/s", "sectGB/s", "%base", "bad/checked");
}
void print_row(const Result& r) {
  if (r.status != "ok") {
    printf("%-13s %5d %3d %5d %4d %5s  SKIP %s\n", r.kind.c_str(), r.W * 4, r.c0, (r.c0 * 4) % 32, r.R,
           r.promo.c_str(), r.status.c_str());
  } else {
    printf("%-13s %5d %3d %5d %4d %5s %3d %4d %9.4f %8.1f %8.1f %6.1f %llu/%llu\n", r.kind.c_str(), r.W * 4, r.c0,
           (r.c0 * 4) % 32, r.R, r.promo.c_str(), r.stages, r.ctas_per_sm, r.med, r.gbps, r.sgbps, r.pct, r.bad,
           r.checked);
  }
  fflush(stdout);
}

// kind: "column" (cols = c0 + 64 k, column-major), "all_blocks" (cols = c0 + W b, row-major) or "l2" (one column
// over 32768 rows, 128 passes).
void run_tma_case(const char* kind, int wbytes, int c0, int R, CUtensorMapL2promotion promo) {
  Result r;
  r.kind = kind;
  r.W = wbytes / 4;
  r.c0 = c0;
  r.R = R;
  r.promo = promo_name(promo);
  const bool l2 = r.kind == "l2", all = r.kind == "all_blocks";
  const int W = r.W;
  r.rows = l2 ? 32768 : g_P;

  Work w{};
  w.W = W;
  w.R = R;
  w.rows = static_cast<int>(r.rows);
  w.nblk = static_cast<int>((r.rows + R - 1) / R);
  w.passes = l2 ? 128 : 1;
  w.row_major = all ? 1 : 0;
  std::vector<int> cols;
  if (l2) {
    cols.push_back(c0);
  } else if (all) {
    for (int c = c0; c + W <= kC; c += W) cols.push_back(c);
  } else {
    // Columns 256 bytes apart; the same count for every c0 in [0, 6] so the classes walk the same columns.
    const int n = (kC - 6 - W) / 64 + 1;
    // Visit k = (m * i) % n with the multiplier that puts neighbouring columns furthest apart in the order.
    int best_m = 1, best_d = 0;
    for (int m = 2; m < n; ++m) {
      int inv = 0;
      for (int x = 1; x < n; ++x)
        if ((m * x) % n == 1) inv = x;
      if (inv == 0) continue;  // not coprime with n
      const int d = std::min(inv, n - inv);
      if (d > best_d) best_d = d, best_m = m;
    }
    for (int i = 0; i < n; ++i) cols.push_back(c0 + 64 * ((best_m * i) % n));
  }
  if (static_cast<int>(cols.size()) > kMaxCols) {
    fprintf(stderr, "internal: %zu columns > %d\n", cols.size(), kMaxCols);
    exit(1);
  }
  w.ncols = static_cast<int>(cols.size());
  for (int i = 0; i < w.ncols; ++i) w.cols[i] = cols[i];
  r.ncols = w.ncols;
  r.passes = w.passes;

  // Bytes a timed run: payload, the 32-byte sectors and promotion granules the box rows span (row starts are
  // 256-byte aligned: C * 4 = 15 * 256).
  const long long rows_read = r.rows;  // every row is in some box (rows of boxes past the map are not fetched)
  long long mod16 = 0;
  for (int c : cols) {
    r.payload += static_cast<double>(W) * 4 * rows_read;
    r.sectors += static_cast<double>(span(4LL * c, 4LL * W, 32)) * 32 * rows_read;
    r.fetch += static_cast<double>(span(4LL * c, 4LL * W, promo_bytes(promo))) * promo_bytes(promo) * rows_read;
    mod16 += (4 * c) % 32 == 16;
  }
  r.payload *= w.passes;
  r.sectors *= w.passes;
  r.fetch *= w.passes;
  r.frac16 = static_cast<double>(mod16) / cols.size();

  CUtensorMap map;
  const std::string err = encode_map(&map, g_x, r.rows, W, R, promo);
  if (!err.empty()) {
    r.status = err;
    g_results.push_back(r);
    print_row(r);
    return;
  }

  // Stages and CTAs an SM: about 192 KB of stages an SM, 2-8 stages a CTA, two CTAs an SM where two of 2 stages fit.
  w.box_bytes = static_cast<uint32_t>(W) * 4u * R;
  w.stage_bytes = (w.box_bytes + 1023u) & ~1023u;
  const size_t budget = 192 * 1024;
  int ctas = 2 * 2 * static_cast<size_t>(w.stage_bytes) <= budget ? 2 : 1;
  w.stages = static_cast<int>(std::min<size_t>(kMaxStages, std::max<size_t>(2, budget / ctas / w.stage_bytes)));
  const size_t smem = 2048 + static_cast<size_t>(w.stages) * w.stage_bytes;
  if (smem > g_optin) {
    r.status = "smem_too_large";
    g_results.push_back(r);
    print_row(r);
    return;
  }
  int fit = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, tma_stream, kThreads, smem));
  if (fit < 1) {
    r.status = "does_not_fit";
    g_results.push_back(r);
    print_row(r);
    return;
  }
  ctas = std::min(ctas, fit);
  const int words = W * R;
  w.check_step = std::max(1, words / (128 * kCheckWords));
  r.stages = w.stages;
  r.ctas_per_sm = ctas;
  r.grid = g_sms * ctas;
  r.checked = static_cast<unsigned long long>(w.passes) * w.ncols * w.nblk * 128ull * kCheckWords * kReps;

  time_it(r, [&] { tma_stream<<<r.grid, kThreads, smem>>>(map, w, g_sink, g_bad); });
  r.pct = 100.0 * r.gbps / (l2 ? g_base_l2 : g_base_dram);
  g_results.push_back(r);
  print_row(r);
}

void run_baseline(const char* kind, long long bytes, int passes) {
  Result r;
  r.kind = kind;
  r.passes = passes;
  r.payload = r.sectors = r.fetch = static_cast<double>(bytes) * passes;
  int per_sm = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, stream_read, 256, 0));
  r.grid = g_sms * std::max(per_sm, 1);
  r.ctas_per_sm = std::max(per_sm, 1);
  const long long n4 = bytes / 16;
  time_it(r, [&] { stream_read<<<r.grid, 256>>>(reinterpret_cast<const float4*>(g_x), n4, passes, g_sink); });
  r.pct = 100.0;
  g_results.push_back(r);
  printf("%-13s %8.1f MB x %3d passes: median %.4f ms, %.1f GB/s (min %.4f max %.4f ms)\n", kind, bytes / 1e6, passes,
         r.med, r.gbps, r.mn, r.mx);
  fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  g_t0 = std::chrono::steady_clock::now();
  int dev = 0;
  CK(cudaGetDevice(&dev));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, dev));
  CK(cudaDriverGetVersion(&g_driver));
  CK(cudaRuntimeGetVersion(&g_runtime));
  g_device = prop.name;
  std::string dev_us = g_device;
  for (auto& ch : dev_us)
    if (ch == ' ') ch = '_';
  char stamp[32], date[32];
  const time_t now = time(nullptr);
  struct tm utc {};
  gmtime_r(&now, &utc);
  strftime(stamp, sizeof stamp, "%Y%m%dT%H%M%S", &utc);
  strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &utc);
  g_date = date;
  g_json_path = argc > 1 ? argv[1] : "bench/results/tma_rows_" + dev_us + "_" + stamp + ".json";

  printf("device %s (sm_%d%d, %d SMs, L2 %.1f MB), driver %d, runtime %d, %s\n", prop.name, prop.major, prop.minor,
         prop.multiProcessorCount, prop.l2CacheSize / 1e6, g_driver, g_runtime, date);
  if (prop.major != 9 || prop.minor != 0) {
    fprintf(stderr, "this program is built for sm_90a and needs a compute capability 9.0 device\n");
    return 1;
  }
  g_json = fopen(g_json_path.c_str(), "w");  // opened first: a bad path fails before the run, not after it
  if (g_json == nullptr) {
    fprintf(stderr, "cannot open %s for writing: %s\n", g_json_path.c_str(), strerror(errno));
    return 1;
  }

  g_encode = driver_entry<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled");
  g_errname = driver_entry<PFN_cuGetErrorName_v6000>("cuGetErrorName");
  if (g_encode == nullptr) fatal("driver_entry", __FILE__, __LINE__, "no cuTensorMapEncodeTiled in this driver");

  g_sms = prop.multiProcessorCount;
  cudaFuncAttributes fa{};
  CK(cudaFuncGetAttributes(&fa, tma_stream));
  g_optin = prop.sharedMemPerBlockOptin - fa.sharedSizeBytes;  // the kernel's static shared memory counts too
  CK(cudaFuncSetAttribute(tma_stream, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(g_optin)));
  g_P = ((1LL << 30) / (kC * 4)) / 256 * 256;  // 279552 rows: 1.07e9 bytes
  const long long bytes = g_P * kC * 4;
  CK(cudaMalloc(&g_x, bytes));
  CK(cudaMalloc(&g_sink, sizeof(float) * 16 * 1024));
  CK(cudaMalloc(&g_bad, sizeof(unsigned long long)));
  CK(cudaEventCreate(&g_ev0));
  CK(cudaEventCreate(&g_ev1));
  fill_kernel<<<g_sms * 8, 256>>>(g_x, g_P * kC);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  printf("buffer: %lld rows x %d floats = %.3f GB; tensor map dims {%d, %lld}, row stride %d bytes\n", g_P, kC,
         bytes / 1e9, kC, g_P, kC * 4);
  printf("%d warm-up + %d timed runs a case; GB/s = 1e9 bytes/s\n\n", kWarmup, kReps);

  run_baseline("baseline_dram", bytes, 1);
  g_base_dram = g_results.back().gbps;
  run_baseline("baseline_l2", 8LL << 20, 128);
  g_base_l2 = g_results.back().gbps;
  printf("\n");
  print_header();

  const CUtensorMapL2promotion promos[3] = {CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_64B,
                                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B};
  // Box row bytes (W * 4). The driver refuses inner box sizes that are not a multiple of 16 bytes (120).
  const int widths[3] = {128, 240, 256};
  const int Rs[3] = {32, 128, 256};

  // L2-resident: the copy engine's own rate (c0 = 0 and 4: row start byte % 32 = 0 and 16), promotion 64B.
  for (int wb : widths)
    for (int R : Rs)
      for (int c0 : {0, 4}) run_tma_case("l2", wb, c0, R, CU_TENSOR_MAP_L2_PROMOTION_L2_64B);
  // DRAM, one column: start byte % 32 = 0 and 16.
  for (int wb : widths)
    for (int R : Rs)
      for (auto p : promos)
        for (int c0 : {0, 4}) run_tma_case("column", wb, c0, R, p);
  // DRAM, every channel block (c0 = c_off + W b): c_off = 0 and 4.
  for (int wb : widths)
    for (int R : Rs)
      for (auto p : promos)
        for (int c0 : {0, 4}) run_tma_case("all_blocks", wb, c0, R, p);
  // Start bytes 8 and 24 mod 32 are not measured: on an H200 (driver 13000, 2026-11-29) such a box never completed
  // its bytes (the barrier wait timed out): box starts must be 16-byte aligned in memory, as the map's base is.

  // Summary: the hypothesis holds where mod16 / mod0 is well below 1 (e.g. ~0.6) at the same row bytes, R and
  // promotion, in the column and all_blocks kinds, while the l2 kind shows the same ratio or not.
  printf("\nratio of GB/s, start byte %% 32 = 16 over 0 (all_blocks: c_off 4 over 0), same kind / rowB / R / promo:\n");
  printf("%-13s %5s %4s %5s %9s %9s %7s\n", "kind", "rowB", "R", "promo", "GB/s@0", "GB/s@16", "16/0");
  for (const Result& a : g_results) {
    if (a.status != "ok" || a.kind == "baseline_dram" || a.kind == "baseline_l2" || (a.c0 * 4) % 32 != 0) continue;
    double g16 = 0;
    for (const Result& b : g_results)
      if (b.status == "ok" && b.kind == a.kind && b.W == a.W && b.R == a.R && b.promo == a.promo &&
          (b.c0 * 4) % 32 == 16)
        g16 = b.gbps;
    printf("%-13s %5d %4d %5s %9.1f %9.1f %7.3f\n", a.kind.c_str(), a.W * 4, a.R, a.promo.c_str(), a.gbps, g16,
           g16 > 0 ? g16 / a.gbps : 0.0);
  }
  unsigned long long bad = 0;
  for (const Result& r : g_results) bad += r.bad;
  printf("\nbad words over all cases: %llu%s\n", bad, bad ? "  (DATA MISMATCH: see bad_words in the JSON)" : "");
  printf("total %.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - g_t0).count());
  write_json(nullptr);
  return bad ? 2 : 0;
}
