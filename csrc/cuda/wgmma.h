// Hopper (sm_90a) warpgroup matrix multiply: thin wrappers over the PTX of wgmma.mma_async and its
// shared-memory descriptors, TMA, mbarriers and clusters, for the kernels that use them. Compiled only for the
// arch-specific target (__CUDA_ARCH_FEAT_SM90_ALL); callers guard their use the same way.
//
// Operand layouts used here: both shared-memory operands in the 128-byte swizzle (a row of 64
// 16-bit elements is one 128-byte line; its 16-byte chunk j is stored at chunk j ^ (row % 8); every
// 8-row group is a 1024-byte, 1024-aligned atom). A K-major operand (rows = M or N, the 64
// elements = K) steps K by adding 32 bytes per 16 elements to the start address; an MN-major B
// (rows = K, the 64 elements = N) steps K by 16 rows, i.e. 2048 bytes, and its N atoms of 64 lie
// `lbo` bytes apart.
#pragma once
#include <cstdint>

namespace vd {
namespace wgmma {

// Shared-memory matrix descriptor: start address, leading / stride byte offsets (all >> 4),
// 128-byte swizzle (mode 1 in bits 62-63).
__device__ __forceinline__ uint64_t desc_sw128(uint32_t saddr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((saddr & 0x3FFFFu) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFFu) << 16) |
         (static_cast<uint64_t>((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Generic-proxy writes to shared memory (cp.async, st.shared) made visible to the async proxy that
// wgmma reads through; each writing thread runs it before the barrier that publishes the tile.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keeps the compiler from moving reads or writes of accumulator registers across wgmma issue/wait.
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for fragments of A an in-flight wgmma reads from registers.
template <int M, int N>
__device__ __forceinline__ void fence_regs(unsigned (&d)[M][N]) {
#pragma unroll
  for (int i = 0; i < M; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) asm volatile("" : "+r"(d[i][j])::"memory");
}

#define VD_ACC8(d, i) \
  "+f"(d[(i) + 0]), "+f"(d[(i) + 1]), "+f"(d[(i) + 2]), "+f"(d[(i) + 3]), "+f"(d[(i) + 4]), "+f"(d[(i) + 5]), \
      "+f"(d[(i) + 6]), "+f"(d[(i) + 7])

// The accumulator lists of the asm statements below.
#define VD_R16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define VD_R32 VD_R16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define VD_R64 VD_R32 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define VD_R80 VD_R64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79"
#define VD_R128 VD_R64 ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, " \
  "%81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, "   \
  "%102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, "   \
  "%120, %121, %122, %123, %124, %125, %126, %127"
#define VD_D16(d) VD_ACC8(d, 0), VD_ACC8(d, 8)
#define VD_D32(d) VD_D16(d), VD_ACC8(d, 16), VD_ACC8(d, 24)
#define VD_D64(d) VD_D32(d), VD_ACC8(d, 32), VD_ACC8(d, 40), VD_ACC8(d, 48), VD_ACC8(d, 56)
#define VD_D80(d) VD_D64(d), VD_ACC8(d, 64), VD_ACC8(d, 72)
#define VD_D128(d) VD_D64(d), VD_ACC8(d, 64), VD_ACC8(d, 72), VD_ACC8(d, 80), VD_ACC8(d, 88), VD_ACC8(d, 96), \
      VD_ACC8(d, 104), VD_ACC8(d, 112), VD_ACC8(d, 120)
// Both operands from shared memory (operands DA, DB): SHAPE and TYPES name the instruction, FLAGS its
// scale and transpose immediates; scale-d from SC (0: d is overwritten); the accumulator operands last (a
// list with commas once expanded).
#define VD_SS_ASM(SHAPE, TYPES, RLIST, DA, DB, SC, FLAGS, ...)                                        \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SC ", 0;\n"                                       \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPES " {" RLIST "}, " DA ", " DB           \
               ", p, " FLAGS ";\n}\n"                                                                   \
               : __VA_ARGS__                                                                           \
               : "l"(da), "l"(db), "r"(scale_d))
// TY: bf16 or f16 (the A and B element type). The transpose flags TR are "0, 0" for both K-major, "1, 1"
// for both MN-major, "0, 1" for a K-major A and an MN-major B.
#define VD_SS(N, TY, RLIST, DLIST, DA, DB, SC, TR) \
  VD_SS_ASM("m64n" #N "k16", #TY "." #TY, RLIST, DA, DB, SC, "1, 1, " TR, DLIST)
// TF32 (fp32 registers or shared memory read as TF32): the PTX form takes no transpose flags, both operands
// K-major. Raw float32 words from the copy engine lose their low 13 mantissa bits (truncation).
#define VD_SS_TF32(N, RLIST, DLIST, DA, DB, SC) \
  VD_SS_ASM("m64n" #N "k8", "tf32.tf32", RLIST, DA, DB, SC, "1, 1", DLIST)
// A from registers (ALIST: its four operands), B from shared memory MN-major (trans-b = 1), always
// accumulating (the predicate operand SC is set from a constant 1).
#define VD_RS(N, TY, RLIST, DLIST, ALIST, DESC, SC)                                                   \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SC ", 0;\n"                                       \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TY "." #TY " {" RLIST "}, {" ALIST "}, " DESC \
               ", p, 1, 1, 1;\n}\n"                                                                      \
               : DLIST                                                                                 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1))

// d (64 x 128, f32) = (scale_d ? d : 0) + A (64 x 16, shared, K-major) * B (16 x 128, shared, K-major).
template <bool kBf16>
__device__ __forceinline__ void mma_m64n128k16_ss(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (kBf16) VD_SS(128, bf16, VD_R64, VD_D64(d), "%64", "%65", "%66", "0, 0");
  else VD_SS(128, f16, VD_R64, VD_D64(d), "%64", "%65", "%66", "0, 0");
}

// d (64 x 160, f32) = (scale_d ? d : 0) + A (64 x 16, shared, K-major) * B (16 x 160, shared, K-major):
// conv_bn_silu's 160-channel tiles (320, 640 and 1280 channels are whole multiples).
template <bool kBf16>
__device__ __forceinline__ void mma_m64n160k16_ss(float (&d)[80], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (kBf16) VD_SS(160, bf16, VD_R80, VD_D80(d), "%80", "%81", "%82", "0, 0");
  else VD_SS(160, f16, VD_R80, VD_D80(d), "%80", "%81", "%82", "0, 0");
}

// d (64 x 256, f32) = (scale_d ? d : 0) + A (64 x 16, shared, K-major) * B (16 x 256, shared, K-major):
// conv_bn_silu's 256-channel tiles (A read once for 256 columns: less shared-memory traffic a product).
template <bool kBf16>
__device__ __forceinline__ void mma_m64n256k16_ss(float (&d)[128], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (kBf16) VD_SS(256, bf16, VD_R128, VD_D128(d), "%128", "%129", "%130", "0, 0");
  else VD_SS(256, f16, VD_R128, VD_D128(d), "%128", "%129", "%130", "0, 0");
}

// d (64 x N, f32) = (scale_d ? d : 0) + A (64 x 16, shared, K-major) * B (16 x N, shared, K-major),
// N = 32 or 64 (the backward's S, dP tiles).
template <bool kBf16>
__device__ __forceinline__ void mma_m64n64k16_ss(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (kBf16) VD_SS(64, bf16, VD_R32, VD_D32(d), "%32", "%33", "%34", "0, 0");
  else VD_SS(64, f16, VD_R32, VD_D32(d), "%32", "%33", "%34", "0, 0");
}
template <bool kBf16>
__device__ __forceinline__ void mma_m64n32k16_ss(float (&d)[16], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (kBf16) VD_SS(32, bf16, VD_R16, VD_D16(d), "%16", "%17", "%18", "0, 0");
  else VD_SS(32, f16, VD_R16, VD_D16(d), "%16", "%17", "%18", "0, 0");
}

// d (64 x 64, f32) = (scale_d ? d : 0) + A (64 x 16, shared, MN-major) * B (16 x 64, shared, MN-major):
// the fused backward's dQ = dS K, with dS stored transposed (rows = keys) and K as stored (rows = keys).
template <bool kBf16>
__device__ __forceinline__ void mma_m64n64k16_ss_mn(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (kBf16) VD_SS(64, bf16, VD_R32, VD_D32(d), "%32", "%33", "%34", "1, 1");
  else VD_SS(64, f16, VD_R32, VD_D32(d), "%32", "%33", "%34", "1, 1");
}

// d (64 x 128, f32) = (scale_d ? d : 0) + A (64 x 16, shared, K-major) * B (16 x 128, shared, MN-major):
// temporal_conv's weight rows times frame rows of x (pixels contiguous).
template <bool kBf16>
__device__ __forceinline__ void mma_m64n128k16_ss_kmn(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (kBf16) VD_SS(128, bf16, VD_R64, VD_D64(d), "%64", "%65", "%66", "0, 1");
  else VD_SS(128, f16, VD_R64, VD_D64(d), "%64", "%65", "%66", "0, 1");
}

// The same at N = 64: a last pixel block of at most 64 pixels.
template <bool kBf16>
__device__ __forceinline__ void mma_m64n64k16_ss_kmn(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {
  if constexpr (kBf16) VD_SS(64, bf16, VD_R32, VD_D32(d), "%32", "%33", "%34", "0, 1");
  else VD_SS(64, f16, VD_R32, VD_D32(d), "%32", "%33", "%34", "0, 1");
}

// d (64 x 64, f32) += A (64 x 16, registers) * B (16 x 64, shared, MN-major).
template <bool kBf16>
__device__ __forceinline__ void mma_m64n64k16_rs(float (&d)[32], const unsigned (&a)[4], uint64_t db) {
  if constexpr (kBf16) VD_RS(64, bf16, VD_R32, VD_D32(d), "%32, %33, %34, %35", "%36", "%37");
  else VD_RS(64, f16, VD_R32, VD_D32(d), "%32, %33, %34, %35", "%36", "%37");
}

// d (64 x 128, f32) += A (64 x 16, registers) * B (16 x 128, shared, MN-major).
template <bool kBf16>
__device__ __forceinline__ void mma_m64n128k16_rs(float (&d)[64], const unsigned (&a)[4], uint64_t db) {
  if constexpr (kBf16) VD_RS(128, bf16, VD_R64, VD_D64(d), "%64, %65, %66, %67", "%68", "%69");
  else VD_RS(128, f16, VD_R64, VD_D64(d), "%64, %65, %66, %67", "%68", "%69");
}

// TF32 (attention rounds its operands first; conv_bn_silu's come raw from the copy engine).
// d (64 x 64, f32) = (scale_d ? d : 0) + A (64 x 8, shared) * B (8 x 64, shared).
__device__ __forceinline__ void mma_m64n64k8_tf32_ss(float (&d)[32], uint64_t da, uint64_t db, int scale_d) {
  VD_SS_TF32(64, VD_R32, VD_D32(d), "%32", "%33", "%34");
}
// The same at N = 128, 160 or 256: conv_bn_silu's float32 tiles.
__device__ __forceinline__ void mma_m64n128k8_tf32_ss(float (&d)[64], uint64_t da, uint64_t db, int scale_d) {
  VD_SS_TF32(128, VD_R64, VD_D64(d), "%64", "%65", "%66");
}
__device__ __forceinline__ void mma_m64n160k8_tf32_ss(float (&d)[80], uint64_t da, uint64_t db, int scale_d) {
  VD_SS_TF32(160, VD_R80, VD_D80(d), "%80", "%81", "%82");
}
__device__ __forceinline__ void mma_m64n256k8_tf32_ss(float (&d)[128], uint64_t da, uint64_t db, int scale_d) {
  VD_SS_TF32(256, VD_R128, VD_D128(d), "%128", "%129", "%130");
}
// d (64 x 64, f32) = (scale_d ? d : 0) + A (64 x 8, registers: rows g / g + 8 of each warp's 16, columns
// tig / tig + 4) * B (8 x 64, shared).
__device__ __forceinline__ void mma_m64n64k8_tf32_rs(float (&d)[32], const unsigned (&a)[4], uint64_t db, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {" VD_R32 "}, {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
               : VD_D32(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

// d (64 x 128, f32) = (scale_d ? d : 0) + A (64 x 8, registers, TF32) * B (8 x 128, shared, K-major): as below.
__device__ __forceinline__ void mma_m64n128k8_tf32_rs(float (&d)[64], const unsigned (&a)[4], uint64_t db, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32 {" VD_R64 "}, {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
               : VD_D64(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

// d (64 x 160, f32) = (scale_d ? d : 0) + A (64 x 8, registers, TF32) * B (8 x 160, shared, K-major):
// temporal_conv's float32 products, x's pixels as the rows of A (loaded from its pixel-contiguous boxes), the
// weight rows as B.
__device__ __forceinline__ void mma_m64n160k8_tf32_rs(float (&d)[80], const unsigned (&a)[4], uint64_t db, int scale_d) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %85, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n160k8.f32.tf32.tf32 {" VD_R80 "}, {%80, %81, %82, %83}, %84, p, 1, 1;\n}\n"
               : VD_D80(d)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(scale_d));
}

#undef VD_SS_TF32
#undef VD_RS
#undef VD_SS
#undef VD_SS_ASM
#undef VD_D128
#undef VD_D80
#undef VD_D64
#undef VD_D32
#undef VD_D16
#undef VD_R128
#undef VD_R80
#undef VD_R64
#undef VD_R32
#undef VD_R16
#undef VD_ACC8

// ---- mbarriers (shared::cta), the bulk tensor copy engine (TMA) and register reallocation ----

// barrier.cluster arrive (release) / wait (acquire); a block barrier where there are no clusters.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
#else
  __syncthreads();
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}
// The shared::cluster address of `local` (a shared::cta address) in the CTA of rank `rank` of the cluster.
__device__ __forceinline__ uint32_t cluster_map(uint32_t local, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(local), "r"(rank));
  return r;
}

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes initialized barriers visible to the other threads and to the copy engine.
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\nfence.proxy.async.shared::cta;\n" ::: "memory");
}
// A producer / consumer ring of `stages` stages: full[st] at bar + 8 st (one arrival, the producer's, plus the
// copies' bytes), empty[st] at bar + 8 (stages + st) (`consumers` arrivals); run by one thread before a
// __syncthreads.
__device__ __forceinline__ void init_stage_ring(uint32_t bar, int stages, uint32_t consumers) {
  for (int st = 0; st < stages; ++st) {
    mbar_init(bar + 8 * st, 1);
    mbar_init(bar + 8 * (stages + st), consumers);
  }
  mbar_init_fence();
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
// Arrives on a barrier of another CTA of the cluster (its shared::cluster address, from cluster_map). The default
// semantics (release at CTA scope): a cluster-scope release cost a fence an arrival and slowed a multicast ring 2-4x.
__device__ __forceinline__ void mbar_arrive_cluster(uint32_t remote_bar) {
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote_bar) : "memory");
}
// Arrives and announces `bytes` of copies that will complete on this phase.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
// Waits until the phase of the given parity has completed (a fresh barrier: parity 1 passes at once).
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred P1;\nLAB_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// A 4-D box of a tensor map into shared memory, completing on the barrier (tx bytes).
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n" ::"r"(dst),
      "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}
// tma_load_4d with an L2 cache policy (createpolicy) for the bytes read.
__device__ __forceinline__ void tma_load_4d_hint(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1, int c2,
                                                 int c3, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, %3, "
      "%4, %5}], [%6], %7;\n" ::"r"(dst),
      "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "l"(policy)
      : "memory");
}
// The same box written to the same offset of every CTA of the cluster in `mask` (bit r: rank r), each completing
// its bytes on its own barrier at offset `bar`.
__device__ __forceinline__ void tma_load_4d_multicast(uint32_t dst, const void* tmap, uint32_t bar, int c0, int c1,
                                                      int c2, int c3, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, {%2, "
      "%3, %4, %5}], [%6], %7;\n" ::"r"(dst),
      "l"(tmap), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "h"(mask)
      : "memory");
}
// An im2col box of a 4-D tensor map (C, W, H, N) into shared memory, completing on the barrier: the map's
// pixels-per-column positions from (w, h, n) on, each shifted by the offsets (ow, oh), c0 on in C.
__device__ __forceinline__ void tma_load_im2col_4d(uint32_t dst, const void* tmap, uint32_t bar, int c0, int w, int h,
                                                   int n, uint16_t ow, uint16_t oh) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.im2col.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, "
      "%5}], [%6], {%7, %8};\n" ::"r"(dst),
      "l"(tmap), "r"(c0), "r"(w), "r"(h), "r"(n), "r"(bar), "h"(ow), "h"(oh)
      : "memory");
}
// `bytes` (a multiple of 16) of contiguous global memory into shared memory, completing on the barrier.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
// bulk_load with an L2 cache policy (createpolicy) for the bytes read.
__device__ __forceinline__ void bulk_load_hint(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar,
                                               uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::"r"(
          dst),
      "l"(src), "r"(bytes), "r"(bar), "l"(policy)
      : "memory");
}
// `bytes` (a multiple of 16) of float32 in shared memory added element-wise into global memory by the
// copy engine (atomic per element); tracked in this thread's bulk async-group.
__device__ __forceinline__ void bulk_reduce_add_f32(float* dst, uint32_t src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
               "r"(bytes)
               : "memory");
}
// A 4-D box of shared memory (laid out as the tensor map's box, swizzle included) into global memory;
// parts of the box outside the tensor are not written. Tracked in this thread's bulk async-group.
__device__ __forceinline__ void tma_store_4d(const void* tmap, uint32_t src, int c0, int c1, int c2, int c3) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(tmap),
               "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(src)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// Waits until this thread's bulk groups have finished reading their shared-memory sources.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
// Waits until this thread's bulk groups have completed (their writes performed).
__device__ __forceinline__ void bulk_wait() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Named CTA barriers (ids 1..15; 0 is __syncthreads) over `n` threads (a multiple of 32): sync waits for
// the n arrivals, arrive counts this thread's without waiting. Both order the thread's earlier
// shared-memory accesses before the barrier's completion for the participating threads.
__device__ __forceinline__ void named_sync(int id, int n) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int n) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(n) : "memory");
}

template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

}  // namespace wgmma
}  // namespace vd
