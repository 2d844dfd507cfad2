// moetune's CPU kernels: products of fp32 activations with weights kept as stored (bf16, fp16, int8
// with row scales, int4 with group scales), and the small fused steps of a decoder layer.
//
// Why: on CPUs without AVX512_BF16/AMX, oneDNN emulates bf16 products and they run no faster than
// fp32 ones while reading half the bytes, so the engine used to widen every weight to fp32 and
// decode read twice the bytes it needs. These kernels read the weights as stored and compute in
// fp32 (or, where a path says so, in int8/bf16 dot products with fp32 accumulation).
//
// One library, several instruction sets. The compute kernels below ("the variant body", the part of
// this file after `#else // MOETUNE_VARIANT_BODY`) are compiled once per ISA variant, each inside a
// `#pragma GCC target` region and its own namespace, by including this file into itself:
//   scalar        portable C++ (whatever -march the library is built for)
//   avx2          AVX2 + FMA + F16C: 8 fp32 lanes; int8 dot products with vpmaddubsw + vpmaddwd
//   avx_vnni      avx2 with AVX-VNNI's vpdpbusd (VEX, 256-bit) for the int8 dot products
//   avx512        AVX-512 F/BW/DQ/VL: 16 fp32 lanes; int8 dot products with vpmaddubsw (512-bit)
//   avx512_vnni   avx512 with vpdpbusd (512-bit)
//   avx512_bf16   avx512_vnni with vdpbf16ps: bf16 pair dot products (activations rounded to bf16)
//   amx           avx512_bf16 with AMX tiles: tdpbf16ps on 16 weight rows x 32 values x 16 tokens
// Decode attention is a variant's kernel too (`attend`: avx2 8 lanes, avx512 16; the others take their
// fallback's), run on the default variant (set_isa), so the tests check it on each variant the CPU runs.
// Headers and the ops' plumbing are compiled once, for the build's -march, so no inline function of a
// header is ever compiled for an instruction set the machine may lack. At load the best variant this
// CPU runs is picked from CPUID and XGETBV (isa()); every product op also takes an explicit path
// "variant:mode" (engine/kernels/__init__.py measures which path is fastest per precision and token
// count on this machine, and passes it):
//   f32     fp32 products on weights widened in registers (bf16: a shift; fp16: vcvtph2ps; int8: vpmovsxbd)
//   q8      activations quantized per token in blocks of 32 to int8 with an fp32 scale per block
//           (llama.cpp's q8_0), integer dot products per block, fp32 accumulation (int8 and int4 weights;
//           against int4 weights whose group is a multiple of 64, blocks of 64: int4_act_block)
//   q16     int8 weights: activations quantized per token in blocks of 32 to int16 (scale max / 32767),
//           the weights sign-extended to int16 in registers, vpmaddwd per block, fp32 accumulation
//   bf16dp  activations rounded to bf16, vdpbf16ps (bf16 weights; avx512_bf16 only)
//   tile    activations rounded to bf16, AMX tiles (bf16 weights; amx only): the weights are the A tiles,
//           read straight from their rows (no repacking), the tokens the B tiles, packed in pairs per call
//
// Weight formats (row-major, what the engine stores at load time; nothing is widened per step):
//   bf16 / fp16 [N, K]; int8 [N, K] with one bf16 or fp32 scale per row (w = q * s), or fp32 scales
//   [N, K/g], one per group of g values of a row (g a multiple of 32: runtime.dense_precision=int8);
//   int4 [N_pad, K/2] bytes, each row in chunks of 64 values in 32 bytes (value j in the low nibble,
//   j+32 in the high one), then, where K is 32 mod 64, a chunk of 32 values in 16 bytes (j low, j+16
//   high), with bf16 (scale, zero) [K/G, N_pad, 2] per group of G input channels:
//   w = (q - 8) * scale + zero (engine/moe/quant.py's int4 convention).
//
// Ops (namespace moetune):
//   linear(x[T,K] f32, w[N,K] bf16|f16|f32, bias[N] f32?) -> [T,N] f32 (the default variant, f32 mode)
//   linear_q(x, w, scales?, group, n_out, path, bias?) -> [T,n_out] f32: any weight format, any path
//   linear_int8(x[T,K] f32, q[N,K] int8, scales[N] or [N,K/g]) -> [T,N] f32 (the default variant's f32 mode)
//   moe(h[T,H] f32, w13[E,2I,H], w2[E,H,I], ids[T,k] i64 (-1 = skipped), gates[T,k] f32, path, s13?, s2?, group)
//     -> [T,H] f32: stacked experts in any weight format (int8/int4 with their stacked scales)
//   moe_list / moe_list_int8: moe with the experts as lists of per-expert tensors (None where unrouted)
//   moe_q(h, w13[], s13[], w2[], s2[], ids, gates, group, path): moe for any weight format and path
//   quantize_q8(x[T,K], group) -> (q int8 [T,K], d f32 [T,K/32], group sums f32 [T,K/group]): the
//     activations the q8 mode multiplies with (for tests and references; group 0: int8 weights, else int4
//     weights of that group, a block of 64 two equal d's); quantize_q16(x) -> (q int16, d):
//     the q16 mode's
//   quantize_int8(w[N,K] f32) -> (q int8 [N,K], s bf16 [N]); quantize_int4(w[N,K] f32, group, n_pad, pack)
//     -> (values or packed bytes uint8 [n_pad, K or K/2], (scale, zero) bf16 [K/group,n_pad,2]): weights
//     into the engine's formats, bit for bit as engine/moe/quant.py's PyTorch reference, in one pass
//   isa() -> the default variant; variants() -> (compiled, runnable here); set_isa(name | "auto");
//   attention_kernels(d, variant="") -> the variants whose kernels serve decode and prompt attention
//   cpu_features() -> what CPUID/XGETBV report (avx2, avx512_bf16, amx_tile, ...)
//   stream_read(buf f32, ahead=True) -> the sum of buf, read as decode products read weights (kStreams
//     streams far apart; ahead: a line of each at a time, prefetched as the products prefetch)
//   evict(t) -> t's bytes flushed from the caches (x86: true), so that the kernel paths are timed on
//     weights read from memory, as decode reads them
//   time_router(x[T,K] f32, w[N,K] f32, native, reps) -> seconds [reps] of a router's product as the fused
//     decode step runs it (native kernels or PyTorch's GEMM), each on weights evicted from the caches
// and the small fp32 steps between the products, fused so that a decode step of one token is a few
// calls per layer rather than ~100 (each PyTorch op costs microseconds of dispatch on a slow core):
//   rmsnorm(x[R,D], w[D], eps), add_rmsnorm_(x += delta, then rmsnorm)
//   qk_rope(qkv[T, Q+2KV], ...) -> q[T,Hq,d], k[T,KV,d], v[T,KV,d]: q/k norms, clipping, rotary
//   route(logits[T,E], k, renorm) -> (gates[T,k], ids[T,k]): softmax, top-k, renormalisation
//   decode_attention(q[B,Hq,d], kcache, vcache[S,KV,L,d] f32|bf16, slots[B], lens[B], window, scale, k?, v?)
//       (k, v [B,KV,d]: the step's rows, written into the caches at lens[b]-1 first)
//   prefill_attention(q[T,Hq,d], kcache, vcache, slot, past, window, scale, k[T,KV,d], v[T,KV,d]): one
//       sequence's T prompt tokens at positions past.., their rows written into the caches first, causal
//
// Built on first use by engine/kernels/__init__.py with the system C++ compiler (GCC: the variants
// use `#pragma GCC target`); threads come from PyTorch's OpenMP pool (torch.set_num_threads).

#ifndef MOETUNE_VARIANT_BODY
// ============================================================================== common part

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/add.h>
#include <ATen/ops/div.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softmax.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/topk.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#include <immintrin.h>
#define MT_X86 1
#else
#define MT_X86 0
#endif
#include <omp.h>
#if MT_X86 && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

// ISA variants, in the order of preference (higher = preferred where the CPU runs it).
#define MT_SCALAR 0
#define MT_AVX2 1
#define MT_AVXVNNI 2
#define MT_AVX512 3
#define MT_AVX512VNNI 4
#define MT_AVX512BF16 5
#define MT_AMX 6

namespace mt {

// Products of a few tokens read each thread's rows as kStreams streams far apart (see in_streams);
// stream_read reads memory the same way, for the rooflines' bandwidth.
constexpr int kStreams = 4;

inline float bf16_to_f(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float f16_to_f(uint16_t v) { return static_cast<float>(c10::Half(v, c10::Half::from_bits())); }
inline uint16_t f_to_bf16(float f) { return c10::BFloat16(f).x; }  // round to nearest even, as torch does

struct Bf16T { using elem = uint16_t; };
struct F16T { using elem = uint16_t; };
struct I8T { using elem = int8_t; };
inline float widen(uint16_t v, Bf16T) { return bf16_to_f(v); }
inline float widen(uint16_t v, F16T) { return f16_to_f(v); }
inline float widen(int8_t v, I8T) { return static_cast<float>(v); }

// What a product computes: weight format x arithmetic.
enum class Kind : int { Bf16F32, F16F32, I8F32, I8Q8, I8Q16, I4Q8, Bf16Dp, Bf16Tile };
// Kinds whose activations are quantized per block of 32 (a scale a block, in Act::d).
inline bool quantized_acts(Kind k) { return k == Kind::I8Q8 || k == Kind::I8Q16 || k == Kind::I4Q8; }
// Kinds that read the activations in blocks of 32 (other inner sizes take the f32 mode).
inline bool reads_blocks(Kind k) { return k == Kind::I8Q8 || k == Kind::I8Q16 || k == Kind::Bf16Dp || k == Kind::Bf16Tile; }

constexpr int64_t kQBlock = 32;  // activation values per int8/int16 scale (q8, q16 modes) and per int4 chunk

// One weight matrix.
struct Mat {
  const void* w = nullptr;
  int64_t ld = 0;                    // elements between rows (bytes for int4: K / 2)
  const uint16_t* sc16 = nullptr;    // int8: bf16 row scales [N]; int4: bf16 (scale, zero) [K/G, n_pad, 2]
  const float* sc32 = nullptr;       // int8: fp32 row scales [N], or with sg, fp32 group scales [N, K / sg]
  int64_t n_pad = 0;                 // int4: rows of the scale layout
  int64_t sg = 0;                    // int8: values per scale (0: one scale a row)
};

// (1 where the matrix has no scales: a group's slice, scaled by its caller)
inline float row_scale(const Mat& m, int64_t r) { return m.sc32 ? m.sc32[r] : m.sc16 ? bf16_to_f(m.sc16[r]) : 1.f; }
inline float group_scale(const Mat& m, int64_t r, int64_t g) { return m.sc32[r * (m.ld / m.sg) + g]; }
inline const float* group_scales(const Mat& m, int64_t r) { return m.sc32 + r * (m.ld / m.sg); }
// log2 of the int8 scale group where the q8 products apply its scales per block (a power of two), else -1.
inline int group_shift(const Mat& m) {
  return m.sg >= 32 && (m.sg & (m.sg - 1)) == 0 ? __builtin_ctzll(static_cast<unsigned long long>(m.sg)) : -1;
}

// One activation row in the forms the kinds read.
struct Act {
  const float* x = nullptr;     // fp32 [K]
  const int8_t* q = nullptr;    // q8: int8 [K]
  const int16_t* q16 = nullptr;  // q16: int16 [K]
  const float* d = nullptr;     // q8, q16: the scale of each block of 32, repeated 8 times ([K/32 * 8])
  const float* gs = nullptr;    // q8 for int4: exact sum of x over each weight group ([K/G])
  const float* gq = nullptr;    // q8 for int4: sum of the quantized x (q d) over each weight group ([K/G])
  const uint16_t* b = nullptr;  // bf16dp, tile: bf16 [K]
  const float* xs = nullptr;    // f32 mode with bf16 weights: x split per block of 32 (split_row), where K allows
};

// T activation rows prepared for one kind.
struct Prepared {
  std::vector<int8_t> q;
  std::vector<int16_t> q16;
  std::vector<float> d, gs, gq;
  std::vector<uint16_t> b;
  std::vector<float> xs;
  std::vector<Act> acts;
};

// Memory one call uses and drops, not zeroed: its thread's buffer for the slot, kept between calls where it
// is at most kKeepBytes (so a MoE layer's buffers cost neither zeroing nor page faults: zeroed vectors were
// 0.7 ms of a 128-token prefill layer's 11.5 on the AMX Xeon), else memory of its own, freed with it. A
// thread keeps at most kKeepBytes a slot; one call uses each slot once on each thread.
enum ScratchSlot : int {
  kPackedTokens, kPackedActs, kActivations, kSlotOutputs, kGateRows, kUpRows, kAttendWeights, kAttendKeys,
  kAttendValues, kScratchSlots
};
constexpr size_t kKeepBytes = size_t{32} << 20;

struct FreeBytes {
  void operator()(char* p) const { std::free(p); }
};
using Bytes = std::unique_ptr<char, FreeBytes>;

inline Bytes alloc_bytes(size_t bytes) {
  Bytes p(static_cast<char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
  if (!p) throw std::bad_alloc();
  return p;
}

template <typename T>
class Scratch {
 public:
  Scratch(ScratchSlot slot, int64_t n) {
    const size_t bytes = static_cast<size_t>(std::max<int64_t>(n, 1)) * sizeof(T);
    struct Kept {
      Bytes p;
      size_t bytes = 0;
    };
    thread_local Kept kept[kScratchSlots];
    Kept& k = kept[slot];
    if (bytes > kKeepBytes) {
      own_ = alloc_bytes(bytes);
      p_ = reinterpret_cast<T*>(own_.get());
      return;
    }
    if (k.bytes < bytes) {
      k.p = alloc_bytes(bytes);
      k.bytes = bytes;
    }
    p_ = reinterpret_cast<T*>(k.p.get());
  }
  T* data() const { return p_; }
  T& operator[](int64_t i) const { return p_[i]; }

 private:
  Bytes own_;
  T* p_ = nullptr;
};

// One row in blocks of `block` values (32, or 64: int4_act_block) to integers of Q, as many levels either
// side of 0 as Q holds (q8: int8, 127; q16: int16, 32767): d = max|x| / levels, q = round(x / d) (ties to
// even); d8 holds each block of 32's scale 8 times (a block of 64: its d for both halves).
template <typename Q>
inline void quantize_blocks(const float* x, int64_t K, Q* q, float* d8, int64_t block = kQBlock) {
  constexpr float kLevels = std::numeric_limits<Q>::max();
  for (int64_t b0 = 0; b0 < K; b0 += block) {
    const int64_t n = std::min(block, K - b0);
    const float* xb = x + b0;
    float amax = 0.f;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / kLevels, id = d > 0.f ? 1.f / d : 0.f;
    for (int64_t i = 0; i < n; ++i)
      q[b0 + i] = static_cast<Q>(std::max(-kLevels, std::min(kLevels, std::nearbyint(xb[i] * id))));
    for (int64_t j = b0 / kQBlock * 8; j < (b0 + n) / kQBlock * 8; ++j) d8[j] = d;
  }
}

// The activation block of the q8 mode against int4 weights of group G: 64 values (a chunk of the int4 layout,
// whose two halves' integer products then add up before one widening: dots_i4q8_256) where G is a multiple of
// 64, else 32 (a group of 32 takes its weight scale per half chunk). On the AVX2 EPYC (2026-12-08), one
// thread, 1 token, group 128, 1024 inputs, weights in cache: 9.5 -> 10.9 G weights/s; `engine eval`, int4
// experts of the medium preset against fp32 (top-1, mean KL): blocks of 64 alone cost group 128 6.82e-5 ->
// 6.86e-5, group 64 5.60e-5 -> 5.68e-5 (top-1 unchanged); with the -8 scale term on the quantized sums
// (dots_i4q8_256) group 128 0.9570, 6.82e-5 -> 0.9551, 6.67e-5; 64: 0.9668, 5.60e-5 -> 0.9707, 5.44e-5.
inline int64_t int4_act_block(int64_t G) { return G % 64 == 0 ? 64 : kQBlock; }

// q8: quantize_blocks to int8 (blocks of 32; int4_act_block for int4 weights), and for int4 weights the sums
// over each weight group of G of x (gs, exact) and of the quantized x (gq: q d), for the group's zero terms.
inline void quantize_row(const float* x, int64_t K, int64_t G, int8_t* q, float* d8, float* gs, float* gq) {
  quantize_blocks(x, K, q, d8, gs ? int4_act_block(G) : kQBlock);
  if (gs)
    for (int64_t g = 0; g < K / G; ++g) {
      float s = 0.f, sq = 0.f;
      for (int64_t i = 0; i < G; ++i) s += x[g * G + i];
      for (int64_t b = g * G / kQBlock; b < (g + 1) * G / kQBlock; ++b) {
        int32_t qs = 0;
        for (int64_t i = b * kQBlock; i < (b + 1) * kQBlock; ++i) qs += q[i];
        sq += float(qs) * d8[b * 8];
      }
      gs[g] = s;
      gq[g] = sq;
    }
}

// One row of K values (K % 32 == 0) split per block of 32: the block's 16 even-indexed values, then its 16
// odd-indexed ones. A bf16 weight pair read as one 32-bit lane is, as fp32, its even value shifted up 16 bits
// and its odd value masked (dots_bf16_split): one integer op per 8 or 16 weights where widening took two.
inline void split_row(const float* x, int64_t K, float* xs) {
  for (int64_t blk = 0; blk < K; blk += kQBlock)
    for (int64_t j = 0; j < kQBlock / 2; ++j) {
      xs[blk + j] = x[blk + 2 * j];
      xs[blk + kQBlock / 2 + j] = x[blk + 2 * j + 1];
    }
}

// Products whose activations prepare splits (split_row): bf16 weights in the f32 mode, K whole blocks of 32.
inline bool splits_rows(Kind k, int64_t K) { return k == Kind::Bf16F32 && K % kQBlock == 0; }

// Kinds whose activations prepare_rows rewrites (the rest read Act::x as given).
inline bool prepares_rows(Kind k, int64_t K) {
  return quantized_acts(k) || k == Kind::Bf16Dp || k == Kind::Bf16Tile || splits_rows(k, K);
}

// prepare in two parts: the buffers and each row's pointers for T rows (prepare_buffers), then rows [t0, t1)
// quantized or rounded for the kind (prepare_rows; rows apart may be prepared on threads apart).
void prepare_buffers(const float* x, int64_t T, int64_t K, Kind kind, int64_t G, Prepared& p) {
  p.acts.assign(T, Act{});
  for (int64_t t = 0; t < T; ++t) p.acts[t].x = x + t * K;
  if (quantized_acts(kind)) {
    const int64_t nb = K / kQBlock, ng = kind == Kind::I4Q8 ? K / G : 0;
    (kind == Kind::I8Q16 ? p.q16.resize(T * K) : p.q.resize(T * K));
    p.d.resize(T * nb * 8);
    p.gs.resize(T * ng);
    p.gq.resize(T * ng);
    for (int64_t t = 0; t < T; ++t) {
      if (kind == Kind::I8Q16) p.acts[t].q16 = p.q16.data() + t * K;
      else p.acts[t].q = p.q.data() + t * K;
      p.acts[t].d = p.d.data() + t * nb * 8;
      p.acts[t].gs = ng ? p.gs.data() + t * ng : nullptr;
      p.acts[t].gq = ng ? p.gq.data() + t * ng : nullptr;
    }
  } else if (kind == Kind::Bf16Dp || kind == Kind::Bf16Tile) {
    p.b.resize(T * K);
    for (int64_t t = 0; t < T; ++t) p.acts[t].b = p.b.data() + t * K;
  } else if (splits_rows(kind, K)) {
    p.xs.resize(T * K);
    for (int64_t t = 0; t < T; ++t) p.acts[t].xs = p.xs.data() + t * K;
  }
}

void prepare_rows(const float* x, int64_t t0, int64_t t1, int64_t K, Kind kind, int64_t G, Prepared& p) {
  if (kind == Kind::I8Q16) {
    for (int64_t t = t0; t < t1; ++t) quantize_blocks(x + t * K, K, p.q16.data() + t * K, p.d.data() + t * (K / kQBlock) * 8);
  } else if (kind == Kind::I8Q8 || kind == Kind::I4Q8) {
    const int64_t nb = K / kQBlock, ng = kind == Kind::I4Q8 ? K / G : 0;
    for (int64_t t = t0; t < t1; ++t)
      quantize_row(x + t * K, K, G, p.q.data() + t * K, p.d.data() + t * nb * 8, ng ? p.gs.data() + t * ng : nullptr,
                   ng ? p.gq.data() + t * ng : nullptr);
  } else if (kind == Kind::Bf16Dp || kind == Kind::Bf16Tile) {
    for (int64_t i = t0 * K; i < t1 * K; ++i) p.b[i] = f_to_bf16(x[i]);
  } else if (splits_rows(kind, K)) {
    for (int64_t t = t0; t < t1; ++t) split_row(x + t * K, K, p.xs.data() + t * K);
  }
}

void prepare(const float* x, int64_t T, int64_t K, Kind kind, int64_t G, Prepared& p) {
  prepare_buffers(x, T, K, kind, G, p);
  if (prepares_rows(kind, K))
    at::parallel_for(0, T, std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1)),
                     [&](int64_t a, int64_t b) { prepare_rows(x, a, b, K, kind, G, p); });
}

// Routed slots grouped by expert (counting sort): slot p of expert e is in [offset[e], offset[e+1]).
struct Routes {
  std::vector<int64_t> offset, tok;
  std::vector<float> gate;
  int64_t P = 0;
  std::vector<int64_t> fill;  // group_routes' next free slot of each expert
};

struct MoeJob {
  std::vector<Mat> w13, w2;  // per expert (w == nullptr: no weights)
  int64_t T = 0, H = 0, inter = 0, G = 0;
  int64_t small = 0;           // tile mode: experts with at most this many tokens take vdpbf16ps (Path)
  const Act* hacts = nullptr;  // per token, prepared for the kind
  const Routes* routes = nullptr;
};

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// A pause in a spin-wait (an item waiting on another thread's).
inline void spin_pause() {
#if MT_X86
  _mm_pause();
#endif
}

// Work items: each routed expert's rows [0, rows) (phase 1: gate/up rows; phase 2: down rows) in blocks
// of about `work` rows x tokens (at least 32 rows; work 0: blocks of 32 rows), so an expert with few tokens
// is one long run of rows and one with many is split (the schedule stays balanced).
struct ExpertRows { int64_t e, r0, r1; };
inline std::vector<ExpertRows> expert_runs(const Routes& R, int64_t E, int64_t rows, int64_t work) {
  std::vector<ExpertRows> items;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = R.offset[e + 1] - R.offset[e];
    if (n == 0) continue;
    const int64_t rb = std::min(rows, std::max<int64_t>(32, work / n / 32 * 32));
    for (int64_t r = 0; r < rows; r += rb) items.push_back({e, r, std::min(rows, r + rb)});
  }
  return items;
}

// How moe_kind splits its work among threads. The products read each expert's rows once for all its
// tokens; where an expert's tokens fit one token block of rows_times_tokens (kTokBlock) its rows are read
// best as long runs, which the prefetchers stream: each phase's items are runs of one expert's rows, about
// 4 items a thread's worth of rows x tokens each (expert_runs): at one token an expert, phase 1's items are
// an expert's gate and up rows, 2 x 384 rows x 2 KB (medium preset), phase 2's its down rows, 1024 x 768 B.
// Phase 2 then keeps each slot's down product apart and sums them per token in expert order. With more
// tokens than a block an expert's rows are read once per block, and small items (32 gate/up rows; 16
// output rows, every expert's down rows in turn, summed into the output as they come) keep the rows in
// cache across the blocks.
//
// History, medium-preset MoE layer on a 2-core AMD EPYC (AVX2), 2 threads:
// - Runs were first used up to 2 tokens an expert, short items above (phase 2's items were output rows,
//   each reading 128 rows x 768 B an expert, as 4 streams of 24 KB: too short for the prefetchers). Phase
//   2's items became an expert's down rows at one token; `engine bench`, prompt 128, 64 new tokens, paired
//   rounds, decode tok/s: batch 1 bf16 x1.06 (10 rounds), batch 2 x1.07 (4), int8 batch 1 x0.96 (noise).
// - Runs up to 64 tokens an expert (2026-12-04). `scripts/kernel_ops_bench.py --tokens T`, MoE medium,
//   GB/s read, medians of 3 interleaved rounds, short items -> runs: bf16 (f32 mode) at 32 tokens 14.0 ->
//   18.4; int8 (q8) at 8 tokens 15.2 -> 24.4, at 32 10.6 -> 12.4; int4 g128 at 8 tokens 7.1 -> 11.2, at
//   32 4.5 -> 6.1. Every expert at exactly n tokens, bf16, GFLOP/s over two rounds: n = 3 50-61 -> 80-93,
//   n = 4 56-72 -> 73-80, n = 8 72-87 -> 96-99, n = 16 94 -> 94-112; at n = 128 (two token blocks) runs
//   measured 96-101 against 103-106, so an expert with more tokens than a block keeps short items.
constexpr int64_t kTokBlock = 64;  // tokens rows_times_tokens multiplies each pass of rows with
struct Spans {
  bool runs = false;                   // items are runs of one expert's rows (expert_runs)
  int64_t work_up = 0, work_down = 0;  // rows x tokens an item, phase 1 and 2, where runs (else 0)
};
// The most tokens any of the E experts is routed.
inline int64_t most_tokens(const Routes& R, int64_t E) {
  int64_t most = 0;
  for (int64_t e = 0; e < E; ++e) most = std::max(most, R.offset[e + 1] - R.offset[e]);
  return most;
}

// most_run: the most tokens an expert may have for runs (kTokBlock for rows_times_tokens; moe_tile reads each
// block of rows once for all its tokens, so it takes runs up to kTileRunTokens).
inline Spans moe_spans(const Routes& R, int64_t E, int64_t inter, int64_t H, int n_threads,
                       int64_t most_run = kTokBlock) {
  const int64_t most = most_tokens(R, E);
  if (most == 0 || most > most_run) return {};
  const int64_t items = 4 * std::max(n_threads, 1);  // a few items a thread: the dynamic schedule balances
  return {true, (R.P * inter + items - 1) / items, (R.P * H + items - 1) / items};
}

// exp of each lane: exp(r) = 2^n * p(r'), n = round(r log2 e), r' = r - n ln 2 in [-ln2/2, ln2/2], p the
// degree-6 Taylor polynomial (relative error ~1e-7); r clamped to [-87.3, 88] (no denormals, no overflow).
// The 16-lane one is compiled for AVX-512 whatever the build's -march: the AVX-512 variants call it too.
#if MT_X86
__attribute__((target("avx512f"))) inline __m512 exp_lanes(__m512 r) {
  static constexpr float c[7] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720};
  r = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(r, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), r);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(c[6]);
  for (int j = 5; j >= 0; --j) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c[j]));
  return _mm512_scalef_ps(p, k);
}
// The 8-lane one likewise for AVX2 and FMA (the AVX2 variants' prefill kernel calls it); 2^n built in the
// exponent bits (-126 <= n <= 127 after the clamp).
__attribute__((target("avx2,fma"))) inline __m256 exp_lanes(__m256 r) {
  static constexpr float c[7] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720};
  r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(r, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), r);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(c[6]);
  for (int j = 5; j >= 0; --j) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c[j]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// x[i] = exp(x[i] - shift), returning the sum.
inline float exp_shifted(float* x, int64_t n, float shift) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  const __m512 vshift = _mm512_set1_ps(shift);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 p = exp_lanes(_mm512_sub_ps(_mm512_loadu_ps(x + i), vshift));
    _mm512_storeu_ps(x + i, p);
    acc = _mm512_add_ps(acc, p);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 vshift = _mm256_set1_ps(shift);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 p = exp_lanes(_mm256_sub_ps(_mm256_loadu_ps(x + i), vshift));
    _mm256_storeu_ps(x + i, p);
    acc = _mm256_add_ps(acc, p);
  }
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_hadd_ps(h, h);
  sum = _mm_cvtss_f32(_mm_hadd_ps(h, h));
#endif
  for (; i < n; ++i) sum += (x[i] = std::exp(x[i] - shift));
  return sum;
}

// g[i] = silu(g[i]) * u[i] = g u / (1 + exp(-g)): the experts' activation, 16 or 8 lanes at a time (a
// scalar std::exp per value: 1.74 ms of one core for a 128-token prefill layer's 393K values, 0.12 ms so).
inline void silu_mul(float* g, const float* u, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = exp_lanes(_mm512_sub_ps(_mm512_setzero_ps(), x));
    _mm512_storeu_ps(g + i, _mm512_div_ps(_mm512_mul_ps(x, _mm512_loadu_ps(u + i)), _mm512_add_ps(one, e)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(g + i);
    const __m256 e = exp_lanes(_mm256_sub_ps(_mm256_setzero_ps(), x));
    _mm256_storeu_ps(g + i, _mm256_div_ps(_mm256_mul_ps(x, _mm256_loadu_ps(u + i)), _mm256_add_ps(one, e)));
  }
#endif
  for (; i < n; ++i) g[i] = silu(g[i]) * u[i];
}

// Phase 1's end for one work item: the gate g and up u products of rows [r0, r0 + rows) for n tokens (both
// [rows, n]) -> act[t * inter + r] = silu(g) * u (act: the item's expert's first pair), as fp32, or as bf16
// (rounded as prepare rounds them) for the products that read bf16 activations (tile mode's second phase).
inline void put_act(float v, float* a) { *a = v; }
inline void put_act(float v, uint16_t* a) { *a = f_to_bf16(v); }
template <typename T>
inline void store_act(float* g, const float* u, int64_t r0, int64_t rows, int64_t n, int64_t inter, T* act) {
  silu_mul(g, u, rows * n);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t t = 0; t < n; ++t) put_act(g[r * n + t], act + t * inter + r0 + r);
}

// One (sequence, KV head) of decode attention (decode_attention_impl), as a variant compiles it: queries qg
// [group, d], cached K and V rows (fp32 or bf16) read over [lo, len), scale, out og [group, d], scratch w.
using AttendKernel = void (*)(const float*, const void*, const void*, int64_t, int64_t, int64_t, int64_t, float,
                              float*, float*);
// One block of query tokens of one KV head of prefill attention (prefill_attention_impl), as a variant
// compiles it: queries (row stride), transposed keys (stride, first position k0), fp32 values from position k0
// on, group, d, tokens, first token's position, window, scale, out, scratch.
using PrefillKernel = void (*)(const float*, int64_t, const float*, int64_t, int64_t, const float*, int64_t, int64_t,
                               int64_t, int64_t, int64_t, float, float*, float*);

#define MOETUNE_VARIANT_BODY 1
namespace v_scalar {
#define MT_ISA MT_SCALAR
#include "cpu_kernels.cpp"  // this file, its variant body
#undef MT_ISA
}  // namespace v_scalar
#if MT_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace v_avx2 {
#define MT_ISA MT_AVX2
#include "cpu_kernels.cpp"  // this file, its variant body
#undef MT_ISA
}  // namespace v_avx2
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace v_avx_vnni {
#define MT_ISA MT_AVXVNNI
#include "cpu_kernels.cpp"  // this file, its variant body
#undef MT_ISA
}  // namespace v_avx_vnni
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")
namespace v_avx512 {
#define MT_ISA MT_AVX512
#include "cpu_kernels.cpp"  // this file, its variant body
#undef MT_ISA
}  // namespace v_avx512
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
namespace v_avx512_vnni {
#define MT_ISA MT_AVX512VNNI
#include "cpu_kernels.cpp"  // this file, its variant body
#undef MT_ISA
}  // namespace v_avx512_vnni
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16")
namespace v_avx512_bf16 {
#define MT_ISA MT_AVX512BF16
#include "cpu_kernels.cpp"  // this file, its variant body
#undef MT_ISA
}  // namespace v_avx512_bf16
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16,amx-tile,amx-bf16")
namespace v_amx {
#define MT_ISA MT_AMX
#include "cpu_kernels.cpp"  // this file, its variant body
#undef MT_ISA
}  // namespace v_amx
#pragma GCC pop_options
#endif
#undef MOETUNE_VARIANT_BODY

// ------------------------------------------------------------------------------ CPU features

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false, os_avx = false;
  bool avx512f = false, avx512bw = false, avx512dq = false, avx512vl = false, os_avx512 = false;
  bool avx512_vnni = false, avx512_bf16 = false, avx_vnni = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false, os_amx = false;
};

CpuFeatures detect_cpu() {
  CpuFeatures f;
#if MT_X86
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28);
  uint64_t xcr0 = 0;
  if (osxsave) {
    uint32_t lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
  }
  f.os_avx = avx && (xcr0 & 0x6) == 0x6;                      // XMM and YMM state saved by the OS
  f.os_avx512 = f.os_avx && (xcr0 & 0xE0) == 0xE0;            // opmask, ZMM0-15 high halves, ZMM16-31
  f.os_amx = (xcr0 & (3ull << 17)) == (3ull << 17);           // XTILECFG and XTILEDATA
  if (__get_cpuid_max(0, nullptr) >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    f.avx2 = b & (1u << 5);
    f.avx512f = b & (1u << 16);
    f.avx512dq = b & (1u << 17);
    f.avx512bw = b & (1u << 30);
    f.avx512vl = b & (1u << 31);
    f.avx512_vnni = c & (1u << 11);
    f.amx_bf16 = d & (1u << 22);
    f.amx_tile = d & (1u << 24);
    f.amx_int8 = d & (1u << 25);
    __cpuid_count(7, 1, a, b, c, d);
    f.avx_vnni = a & (1u << 4);
    f.avx512_bf16 = a & (1u << 5);
  }
#endif
  return f;
}

const CpuFeatures& cpu() {
  static const CpuFeatures f = detect_cpu();
  return f;
}

using LinearFn = bool (*)(Kind, const Mat&, int64_t, int64_t, int64_t, const Act*, int64_t, const float*, float*);
using MoeFn = bool (*)(Kind, const MoeJob&, float*);
using AttendFn = AttendKernel (*)(int64_t d, bool bf16);  // nullptr: no kernel for that head size
using PrefillFn = PrefillKernel (*)(int64_t d);  // nullptr: no kernel for that head size

struct Variant {
  const char* name;
  LinearFn linear;
  MoeFn moe;
  AttendFn attend;
  PrefillFn prefill;
  bool (*runs)(const CpuFeatures&);
  int fallback;  // the variant whose kernels serve the kinds this one does not compile (-1: none)
};

bool runs_avx2(const CpuFeatures& f) { return f.os_avx && f.avx2 && f.fma && f.f16c; }
bool runs_avx512(const CpuFeatures& f) {
  return runs_avx2(f) && f.os_avx512 && f.avx512f && f.avx512bw && f.avx512dq && f.avx512vl;
}

// Linux hands a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA, since 5.16); without it the first tile instruction is a SIGILL. Asked once, at the first
// check; PyTorch's oneDNN asks the same for its own AMX kernels.
bool amx_permitted() {
#if MT_X86 && defined(__linux__)
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

bool runs_amx(const CpuFeatures& f) {
  return runs_avx512(f) && f.avx512_vnni && f.avx512_bf16 && f.amx_tile && f.amx_bf16 && f.os_amx && amx_permitted();
}

const std::vector<Variant>& all_variants() {
  static const std::vector<Variant> v = {
      {"scalar", &v_scalar::linear, &v_scalar::moe, &v_scalar::attend, &v_scalar::prefill, [](const CpuFeatures&) { return true; }, -1},
#if MT_X86
      {"avx2", &v_avx2::linear, &v_avx2::moe, &v_avx2::attend, &v_avx2::prefill, runs_avx2, -1},
      {"avx_vnni", &v_avx_vnni::linear, &v_avx_vnni::moe, &v_avx_vnni::attend, &v_avx_vnni::prefill,
       [](const CpuFeatures& f) { return runs_avx2(f) && f.avx_vnni; }, 1},
      {"avx512", &v_avx512::linear, &v_avx512::moe, &v_avx512::attend, &v_avx512::prefill, runs_avx512, -1},
      {"avx512_vnni", &v_avx512_vnni::linear, &v_avx512_vnni::moe, &v_avx512_vnni::attend, &v_avx512_vnni::prefill,
       [](const CpuFeatures& f) { return runs_avx512(f) && f.avx512_vnni; }, 3},
      {"avx512_bf16", &v_avx512_bf16::linear, &v_avx512_bf16::moe, &v_avx512_bf16::attend, &v_avx512_bf16::prefill,
       [](const CpuFeatures& f) { return runs_avx512(f) && f.avx512_vnni && f.avx512_bf16; }, 4},
      {"amx", &v_amx::linear, &v_amx::moe, &v_amx::attend, &v_amx::prefill, runs_amx, 5},
#endif
  };
  return v;
}

int best_variant() {
  const auto& vs = all_variants();
  for (int i = static_cast<int>(vs.size()) - 1; i > 0; --i)
    if (vs[i].runs(cpu())) return i;
  return 0;
}

int& default_variant() {
  static int v = best_variant();
  return v;
}

int variant_index(const std::string& name, bool must_run = true) {  // must_run: this CPU runs it, else refused
  const auto& vs = all_variants();
  for (size_t i = 0; i < vs.size(); ++i)
    if (name == vs[i].name) {
      TORCH_CHECK(!must_run || vs[i].runs(cpu()), "moetune: this CPU cannot run the ", name, " kernels");
      return static_cast<int>(i);
    }
  std::string known;
  for (const auto& v : vs) known += std::string(known.empty() ? "" : ", ") + v.name;
  TORCH_CHECK(false, "moetune: unknown ISA variant '", name, "' (compiled: ", known, ")");
  return 0;
}

// ------------------------------------------------------------------------------ paths and formats

enum class Fmt { F32, Bf16, F16, I8, I4 };

struct Path {
  int variant;
  Kind kind;
  int64_t small = 0;  // tile mode, MoE: experts routed at most this many tokens take vdpbf16ps ("tile/8")
};

const char* fmt_name(Fmt f) {
  switch (f) {
    case Fmt::F32: return "float32";
    case Fmt::Bf16: return "bfloat16";
    case Fmt::F16: return "float16";
    case Fmt::I8: return "int8";
    case Fmt::I4: return "int4";
  }
  return "?";
}

// "variant:mode", "variant" or "" (the default variant; mode f32, q8 for int4).
Path parse_path(const std::string& path, Fmt fmt) {
  std::string var = path, mode;
  const auto colon = path.find(':');
  if (colon != std::string::npos) {
    var = path.substr(0, colon);
    mode = path.substr(colon + 1);
  }
  Path p{var.empty() ? default_variant() : variant_index(var), Kind::Bf16F32};
  if (mode.empty()) mode = fmt == Fmt::I4 ? "q8" : "f32";
  const auto slash = mode.find('/');
  if (slash != std::string::npos && mode.substr(0, slash) == "tile") {
    const std::string n = mode.substr(slash + 1);
    TORCH_CHECK(!n.empty() && n.size() < 10 && n.find_first_not_of("0123456789") == std::string::npos,
                "moetune: path '", path, "': expected tile/<tokens>, got '", mode, "'");
    p.small = std::stoll(n);
    mode = "tile";
  }
  bool ok = true;
  if (fmt == Fmt::Bf16 && mode == "f32") p.kind = Kind::Bf16F32;
  else if (fmt == Fmt::Bf16 && mode == "bf16dp") p.kind = Kind::Bf16Dp;
  else if (fmt == Fmt::Bf16 && mode == "tile") p.kind = Kind::Bf16Tile;
  else if (fmt == Fmt::F16 && mode == "f32") p.kind = Kind::F16F32;
  else if (fmt == Fmt::I8 && mode == "f32") p.kind = Kind::I8F32;
  else if (fmt == Fmt::I8 && mode == "q8") p.kind = Kind::I8Q8;
  else if (fmt == Fmt::I8 && mode == "q16") p.kind = Kind::I8Q16;
  else if (fmt == Fmt::I4 && mode == "q8") p.kind = Kind::I4Q8;
  else ok = false;
  TORCH_CHECK(ok, "moetune: path '", path, "' has no mode '", mode, "' for ", fmt_name(fmt), " weights");
  return p;
}

void check_act(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "moetune::", what, ": activations must be a contiguous 2-D float32 CPU tensor");
}

void check_weight(const at::Tensor& w, const char* what) {
  TORCH_CHECK(w.device().is_cpu(), "moetune::", what, ": weights must be on the CPU");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf, "moetune::", what,
              ": weights must be bfloat16 or float16, got ", w.scalar_type());
  TORCH_CHECK(w.is_contiguous(), "moetune::", what, ": weights must be contiguous");
}

Fmt fmt_of(const at::Tensor& w) {
  switch (w.scalar_type()) {
    case at::kFloat: return Fmt::F32;
    case at::kBFloat16: return Fmt::Bf16;
    case at::kHalf: return Fmt::F16;
    case at::kChar: return Fmt::I8;
    case at::kByte: return Fmt::I4;
    default: TORCH_CHECK(false, "moetune: weights of dtype ", w.scalar_type(), " are not a known format");
  }
  return Fmt::F32;
}

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// A weight matrix of logical shape [n, K] in format fmt, with its scales, checked; returns the view.
Mat make_mat(const at::Tensor& w, const at::Tensor& s, Fmt fmt, int64_t n, int64_t K, int64_t G, Kind kind,
             const char* what) {
  TORCH_CHECK(w.device().is_cpu() && w.is_contiguous() && w.dim() == 2, "moetune::", what,
              ": weights must be a contiguous 2-D CPU tensor");
  Mat m;
  m.w = w.data_ptr();
  if (fmt == Fmt::I4) {
    TORCH_CHECK(G > 0 && G % kQBlock == 0 && K % G == 0, "moetune::", what, ": int4 group ", G,
                " must be a multiple of 32 dividing ", K);
    TORCH_CHECK(w.size(1) * 2 == K && w.size(0) >= n && w.size(0) % 16 == 0, "moetune::", what,
                ": int4 weights must be [rows padded to 16, K/2] bytes for ", n, " x ", K, ", got ", w.sizes());
    TORCH_CHECK(s.defined() && s.scalar_type() == at::kBFloat16 && s.is_contiguous() && s.dim() == 3 &&
                    s.size(0) == K / G && s.size(1) == w.size(0) && s.size(2) == 2,
                "moetune::", what, ": int4 scales must be contiguous bf16 [", K / G, ", ", w.size(0), ", 2]");
    m.ld = K / 2;
    m.sc16 = static_cast<const uint16_t*>(s.data_ptr());
    m.n_pad = w.size(0);
    return m;
  }
  TORCH_CHECK(w.size(0) == n && w.size(1) == K, "moetune::", what, ": weights ", w.sizes(), " are not [", n, ", ",
              K, "]");
  m.ld = K;
  if (fmt == Fmt::I8 && s.defined() && s.dim() == 2) {  // a scale per group of sg values of a row
    const int64_t groups = s.size(1), sg = groups > 0 && K % groups == 0 ? K / groups : 0;
    TORCH_CHECK(s.size(0) == n && sg > 0 && sg % kQBlock == 0 && s.is_contiguous() && s.scalar_type() == at::kFloat,
                "moetune::", what, ": int8 group scales must be contiguous fp32 [", n, ", K / group] with a group ",
                "of a multiple of 32 dividing ", K, ", got ", s.scalar_type(), " ", s.sizes());
    m.sc32 = s.data_ptr<float>();
    m.sg = sg;
  } else if (fmt == Fmt::I8) {
    TORCH_CHECK(s.defined() && s.numel() == n && s.is_contiguous() &&
                    (s.scalar_type() == at::kBFloat16 || s.scalar_type() == at::kFloat),
                "moetune::", what, ": int8 weights need ", n, " contiguous bf16 or fp32 row scales (or fp32 group ",
                "scales [", n, ", K / group])");
    if (s.scalar_type() == at::kFloat) m.sc32 = s.data_ptr<float>();
    else m.sc16 = static_cast<const uint16_t*>(s.data_ptr());
  }
  if (reads_blocks(kind))
    TORCH_CHECK(K % kQBlock == 0, "moetune::", what, ": the ",
                kind == Kind::I8Q8 ? "q8" : kind == Kind::I8Q16 ? "q16" : kind == Kind::Bf16Dp ? "bf16dp" : "tile",
                " mode needs an inner size divisible by 32, got ", K);
  return m;
}

// ------------------------------------------------------------------------------ linear ops

// fp32 weights (routers: small, kept in fp32): one dot per row and token; PyTorch's GEMM spends
// ~90 us on the threading of a 1x1024x64 product that reads 256 KiB (with sleeping OpenMP threads).
// Four rows a token at a time, each as 16 partial sums: independent chains, where one accumulator waited
// on its own FMA's latency (64 x 1024 router on the AMX Xeon, 2 threads, us: 1 token 6.9 -> 5.3,
// 8 tokens 28.1 -> 13.3, 32 tokens 100.7 -> 40.6).
constexpr int64_t kDotLanes = 16;
inline void dots4f(const float* x, const float* w, int64_t ld, int64_t nr, int64_t K, float* out) {
  float acc[4][kDotLanes] = {};
  const int64_t K0 = K / kDotLanes * kDotLanes;
  for (int64_t i = 0; i < K0; i += kDotLanes)
    for (int q = 0; q < 4; ++q) {
      if (q >= nr) break;
      const float* wq = w + q * ld + i;
#pragma omp simd
      for (int j = 0; j < kDotLanes; ++j) acc[q][j] += x[i + j] * wq[j];
    }
  for (int q = 0; q < nr; ++q) {
    float s = 0.f;
    for (int j = 0; j < kDotLanes; ++j) s += acc[q][j];
    for (int64_t i = K0; i < K; ++i) s += x[i] * w[q * ld + i];
    out[q] = s;
  }
}

void linear_f32(const float* xp, int64_t T, int64_t K, const float* wp, int64_t N, const float* bias, float* yp) {
  at::parallel_for(0, (N + 3) / 4, 8, [&](int64_t b0, int64_t b1) {
    float d[4];
    for (int64_t r = b0 * 4; r < std::min(N, b1 * 4); r += 4) {
      const int64_t nr = std::min<int64_t>(4, N - r);
      for (int64_t t = 0; t < T; ++t) {
        dots4f(xp + t * K, wp + r * K, K, nr, K, d);
        for (int64_t q = 0; q < nr; ++q) yp[t * N + r + q] = d[q] + (bias ? bias[r + q] : 0.f);
      }
    }
  });
}

const float* bias_ptr(const std::optional<at::Tensor>& bias, int64_t n) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
              "moetune::linear: bias must be a contiguous float32 vector of ", n);
  return bias->data_ptr<float>();
}

// A matrix resolved for one path: what linear_q checks and parses about it, done once (the fused decode step
// keeps one a matrix; linear_q resolves at each call).
struct Product {
  Mat m;
  Path p{0, Kind::Bf16F32};
  int64_t N = 0, K = 0, G = 0;
  const float* bias = nullptr;
  const float* f32 = nullptr;  // fp32 weights (routers): linear_f32's, no path
  std::string path;
};

Product resolve_product(const at::Tensor& w, const std::optional<at::Tensor>& scales, int64_t group, int64_t n_out,
                        int64_t K, const std::string& path, const std::optional<at::Tensor>& bias) {
  const Fmt fmt = fmt_of(w);
  TORCH_CHECK(w.dim() == 2 && (fmt == Fmt::I4 ? w.size(1) * 2 : w.size(1)) == K, "moetune::linear: inner size ", K,
              " and weights ", w.sizes(), " do not match");
  Product pr;
  pr.N = fmt == Fmt::I4 ? n_out : w.size(0);
  TORCH_CHECK(pr.N > 0 || fmt != Fmt::I4, "moetune::linear: int4 weights need n_out");
  pr.K = K;
  pr.G = group;
  pr.bias = bias_ptr(bias, pr.N);
  pr.path = path;
  if (fmt == Fmt::F32) {
    TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "moetune::linear: weights must be contiguous on the CPU");
    pr.f32 = w.data_ptr<float>();
    return pr;
  }
  if (fmt == Fmt::Bf16 || fmt == Fmt::F16) check_weight(w, "linear");
  pr.p = parse_path(path, fmt);
  pr.m = make_mat(w, scales.value_or(at::Tensor()), fmt, pr.N, K, group, pr.p.kind, "linear");
  return pr;
}

// y [T, N] = x [T, K] times the product's matrix (transposed); acts: buffers for the prepared activations.
void run_product(const Product& pr, const float* x, int64_t T, Prepared& acts, float* y) {
  if (pr.f32) {
    linear_f32(x, T, pr.K, pr.f32, pr.N, pr.bias, y);
    return;
  }
  prepare(x, T, pr.K, pr.p.kind, pr.G, acts);
  bool done = false;
  for (int v = pr.p.variant; v >= 0 && !done; v = all_variants()[v].fallback)
    done = all_variants()[v].linear(pr.p.kind, pr.m, pr.N, pr.K, pr.G, acts.acts.data(), T, pr.bias, y);
  TORCH_CHECK(done, "moetune::linear: the ", all_variants()[pr.p.variant].name, " kernels have no path '", pr.path, "'");
}

at::Tensor linear_q(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& scales, int64_t group,
                    int64_t n_out, const std::string& path, const std::optional<at::Tensor>& bias) {
  check_act(x, "linear");
  const Product pr = resolve_product(w, scales, group, n_out, x.size(1), path, bias);
  at::Tensor y = at::empty({x.size(0), pr.N}, x.options());
  Prepared acts;
  run_product(pr, x.data_ptr<float>(), x.size(0), acts, y.data_ptr<float>());
  return y;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  check_act(x, "linear");
  if (w.scalar_type() != at::kFloat) check_weight(w, "linear");
  return linear_q(x, w, std::nullopt, 0, 0, "", bias);
}

at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  check_act(x, "linear_int8");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() && q.device().is_cpu() &&
                  q.size(1) == x.size(1),
              "moetune::linear_int8: weights must be a contiguous int8 [N, ", x.size(1), "] CPU tensor, got ",
              q.sizes());
  TORCH_CHECK(scales.numel() == q.size(0) || (scales.dim() == 2 && scales.size(0) == q.size(0)), "moetune::linear_int8: ",
              q.size(0), " rows but scales ", scales.sizes());
  return linear_q(x, q, scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kBFloat16 ? scales
                                                                                                 : scales.to(at::kFloat),
                  0, 0, "", std::nullopt);
}

// The quantized activations prepare left in buffer v, as a [T, K] tensor of x's device and `dtype`.
template <typename V>
at::Tensor prepared_values(const std::vector<V>& v, const at::Tensor& x, at::ScalarType dtype) {
  at::Tensor t = at::empty({x.size(0), x.size(1)}, x.options().dtype(dtype));
  std::copy(v.begin(), v.end(), static_cast<V*>(t.data_ptr()));
  return t;
}

// The scale of each block of 32 that prepare kept 8 times over, once: [T, K / 32].
at::Tensor block_scales(const Prepared& p, const at::Tensor& x) {
  at::Tensor d = at::empty({x.size(0), x.size(1) / kQBlock}, x.options());
  for (int64_t i = 0; i < d.numel(); ++i) d.data_ptr<float>()[i] = p.d[i * 8];
  return d;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_q8(const at::Tensor& x, int64_t group) {
  check_act(x, "quantize_q8");
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kQBlock == 0 && (group == 0 || (group > 0 && K % group == 0)),
              "moetune::quantize_q8: inner size ", K, " must divide into blocks of 32 and groups of ", group);
  Prepared p;
  prepare(x.data_ptr<float>(), T, K, group ? Kind::I4Q8 : Kind::I8Q8, group ? group : kQBlock, p);
  at::Tensor gs = at::empty({T, group ? K / group : 0}, x.options());
  std::copy(p.gs.begin(), p.gs.end(), gs.data_ptr<float>());
  return {prepared_values(p.q, x, at::kChar), block_scales(p, x), gs};
}

std::tuple<at::Tensor, at::Tensor> quantize_q16(const at::Tensor& x) {
  check_act(x, "quantize_q16");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kQBlock == 0, "moetune::quantize_q16: inner size ", K, " must divide into blocks of 32");
  Prepared p;
  prepare(x.data_ptr<float>(), x.size(0), K, Kind::I8Q16, kQBlock, p);
  return {prepared_values(p.q16, x, at::kShort), block_scales(p, x)};
}

// ------------------------------------------------------------------------------ weight quantization
// The engine's integer weight formats from fp32 weights, bit for bit as engine/moe/quant.py's PyTorch
// reference computes them (the same fp32 operations in the same order, bf16 rounded to nearest even,
// values rounded half to even), in one pass over the weight instead of a dozen: quantizing every
// expert of a model is load time, and a tuner's reconfigure.

// Vector helpers (the build's -march: AVX2 where the machine has it, else the scalar loops, same bits).
inline void min_max(const float* x, int64_t n, float& lo, float& hi) {
  int64_t j = 0;
  lo = hi = x[0];
#if defined(__AVX2__)
  if (n >= 8) {
    __m256 vlo = _mm256_loadu_ps(x), vhi = vlo;
    for (j = 8; j + 8 <= n; j += 8) {
      const __m256 v = _mm256_loadu_ps(x + j);
      vlo = _mm256_min_ps(vlo, v);
      vhi = _mm256_max_ps(vhi, v);
    }
    alignas(32) float l[8], h[8];
    _mm256_store_ps(l, vlo);
    _mm256_store_ps(h, vhi);
    lo = l[0], hi = h[0];
    for (int i = 1; i < 8; ++i) lo = std::min(lo, l[i]), hi = std::max(hi, h[i]);
  }
#endif
  for (; j < n; ++j) lo = std::min(lo, x[j]), hi = std::max(hi, x[j]);
}

inline float abs_max(const float* x, int64_t n) {
  int64_t j = 0;
  float m = 0.f;
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 vm = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
  alignas(32) float t[8];
  _mm256_store_ps(t, vm);
  for (float v : t) m = std::max(m, v);
#endif
  for (; j < n; ++j) m = std::max(m, std::fabs(x[j]));
  return m;
}

// out[j] = clamp(round_half_even((x[j] - z) / s + add), lo, hi), as int8 or uint8 (T). With z = add = 0 it
// is round(x / s): x - 0 and y + 0 are x and y (a zero's sign aside, which rounding to an integer drops).
template <typename T>
inline void levels(const float* x, int64_t n, float z, float s, float add, float lo, float hi, T* out) {
  int64_t j = 0;
#if defined(__AVX2__)
  const __m256 vz = _mm256_set1_ps(z), vs = _mm256_set1_ps(s), va = _mm256_set1_ps(add);
  const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
  for (; j + 8 <= n; j += 8) {
    __m256 v = _mm256_add_ps(_mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(x + j), vz), vs), va);
    v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(vhi, _mm256_max_ps(vlo, v));
    const __m256i i32 = _mm256_cvtps_epi32(v);
    const __m128i i16 = _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    const __m128i i8 = std::is_signed<T>::value ? _mm_packs_epi16(i16, i16) : _mm_packus_epi16(i16, i16);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + j), i8);
  }
#endif
  for (; j < n; ++j) out[j] = static_cast<T>(std::min(hi, std::max(lo, std::nearbyint((x[j] - z) / s + add))));
}

// int8 with one bf16 scale a row: s = bf16(max(amax|w|, 1e-12) / 127), q = clamp(round(w / s), -127, 127).
std::tuple<at::Tensor, at::Tensor> quantize_int8(const at::Tensor& w) {
  check_act(w, "quantize_int8");
  const int64_t N = w.size(0), K = w.size(1);
  at::Tensor q = at::empty({N, K}, w.options().dtype(at::kChar));
  at::Tensor s = at::empty({N}, w.options().dtype(at::kBFloat16));
  const float* wp = w.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  uint16_t* sp = reinterpret_cast<uint16_t*>(s.data_ptr<at::BFloat16>());
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = wp + r * K;
      const uint16_t sb = f_to_bf16(std::max(abs_max(x, K), 1e-12f) / 127.f);
      levels<int8_t>(x, K, 0.f, bf16_to_f(sb), 0.f, -127.f, 127.f, qp + r * K);
      sp[r] = sb;
    }
  });
  return {q, s};
}

// Group-wise asymmetric int4 (tinygemm's convention): per group of `group` input channels,
// s = bf16(max((hi - lo) / 15, 1e-12)), z = bf16(lo + 8 s), q = clamp(round((w - z) / s + 8), 0, 15), so
// that w = (q - 8) s + z. Rows N..n_pad-1 are zero rows. Returns the values, and (s, z) as bf16
// [K / group, n_pad, 2]. `pack`: "values" (uint8 [n_pad, K], one value a byte), "plain" (uint8
// [n_pad, K/2], value 2i in the high nibble of byte i, 2i+1 in the low one: quant.py's int4_plain) or
// "native" (the int4 weight format of these kernels, see the header; K a multiple of 32).
std::tuple<at::Tensor, at::Tensor> quantize_int4(const at::Tensor& w, int64_t group, int64_t n_pad,
                                                 const std::string& pack) {
  check_act(w, "quantize_int4");
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(group > 0 && K % group == 0, "moetune::quantize_int4: in_features ", K,
              " must be a multiple of the group size ", group);
  TORCH_CHECK(n_pad >= N, "moetune::quantize_int4: n_pad ", n_pad, " is below the ", N, " rows");
  const int mode = pack == "values" ? 0 : pack == "plain" ? 1 : pack == "native" ? 2 : -1;
  TORCH_CHECK(mode >= 0, "moetune::quantize_int4: pack '", pack, "' is not one of values, plain, native");
  TORCH_CHECK(mode == 0 || K % (mode == 2 ? kQBlock : 2) == 0, "moetune::quantize_int4: in_features ", K,
              " cannot be packed as ", pack);
  const int64_t G = K / group, row_bytes = mode == 0 ? K : K / 2;
  at::Tensor q = at::empty({n_pad, row_bytes}, w.options().dtype(at::kByte));
  at::Tensor sz = at::empty({G, n_pad, 2}, w.options().dtype(at::kBFloat16));
  const float* wp = w.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  uint16_t* szp = reinterpret_cast<uint16_t*>(sz.data_ptr<at::BFloat16>());
  // A zero row: lo = hi = 0, s at its floor, z = 8 s, every value (0 - z) / s + 8 = 0.
  const uint16_t s0 = f_to_bf16(1e-12f), z0 = f_to_bf16(8.f * bf16_to_f(s0));
  at::parallel_for(0, n_pad, 16, [&](int64_t r0, int64_t r1) {
    std::vector<uint8_t> buf(mode == 0 ? 0 : K);
    for (int64_t r = r0; r < r1; ++r) {
      uint8_t* out = qp + r * row_bytes;
      uint8_t* v = mode == 0 ? out : buf.data();
      for (int64_t g = 0; g < G; ++g) {
        uint16_t sb = s0, zb = z0;
        if (r < N) {
          const float* x = wp + r * K + g * group;
          float lo, hi;
          min_max(x, group, lo, hi);
          sb = f_to_bf16(std::max((hi - lo) / 15.f, 1e-12f));
          zb = f_to_bf16(lo + 8.f * bf16_to_f(sb));
          levels<uint8_t>(x, group, bf16_to_f(zb), bf16_to_f(sb), 8.f, 0.f, 15.f, v + g * group);
        } else {
          std::memset(v + g * group, 0, group);
        }
        szp[(g * n_pad + r) * 2] = sb;
        szp[(g * n_pad + r) * 2 + 1] = zb;
      }
      if (mode == 1) {
        for (int64_t i = 0; i < K / 2; ++i) out[i] = static_cast<uint8_t>((v[2 * i] << 4) | v[2 * i + 1]);
      } else if (mode == 2) {
        int64_t c = 0;
        for (; c + 64 <= K; c += 64)
          for (int64_t j = 0; j < 32; ++j) out[c / 2 + j] = static_cast<uint8_t>(v[c + j] | (v[c + 32 + j] << 4));
        if (c < K)
          for (int64_t j = 0; j < 16; ++j) out[c / 2 + j] = static_cast<uint8_t>(v[c + j] | (v[c + 16 + j] << 4));
      }
    }
  });
  return {q, sz};
}

// ------------------------------------------------------------------------------ MoE ops

void check_routes(const at::Tensor& h, const at::Tensor& ids, const at::Tensor& gates) {
  check_act(h, "moe");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == h.size(0) && ids.is_contiguous(),
              "moetune::moe: ids must be a contiguous int64 [T, k] tensor");
  TORCH_CHECK(gates.scalar_type() == at::kFloat && gates.sizes() == ids.sizes() && gates.is_contiguous(),
              "moetune::moe: gates must be a contiguous float32 tensor shaped like ids");
}

// The routes of T tokens' k ids (-1: none) and gates, into r (its buffers reused).
void group_routes(const int64_t* id, const float* gw, int64_t T, int64_t k, const std::vector<Mat>& w13, Routes& r) {
  const int64_t E = static_cast<int64_t>(w13.size());
  r.offset.assign(E + 1, 0);
  for (int64_t p = 0; p < T * k; ++p)
    if (id[p] >= 0) {
      TORCH_CHECK(id[p] < E && w13[id[p]].w != nullptr, "moetune::moe: token routed to expert ", id[p],
                  " which has no weights");
      ++r.offset[id[p] + 1];
    }
  for (int64_t e = 0; e < E; ++e) r.offset[e + 1] += r.offset[e];
  r.P = r.offset[E];
  r.fill.assign(r.offset.begin(), r.offset.end() - 1);
  r.tok.resize(r.P);
  r.gate.resize(r.P);
  for (int64_t p = 0; p < T * k; ++p)
    if (id[p] >= 0) {
      const int64_t slot = r.fill[id[p]]++;
      r.tok[slot] = p / k;
      r.gate[slot] = gw[p];
    }
}

using OptTensors = c10::List<std::optional<at::Tensor>>;

inline at::Tensor get(const OptTensors& l, int64_t e) {
  if (e >= static_cast<int64_t>(l.size())) return at::Tensor();
  std::optional<at::Tensor> t = l.get(e);
  return t.has_value() ? *t : at::Tensor();
}

// What run_moe_into keeps between calls (the fused decode step: one set for every layer).
struct MoeBuffers {
  Routes routes;
  Prepared hp;
};

// out [T, H] = the routed experts of h [T, H] (ids, gates [T, k]), on the job's experts and path p.
void run_moe_into(const float* h, int64_t T, MoeJob& job, const Path& p, const int64_t* ids, const float* gates,
                  int64_t k, const std::string& path, MoeBuffers& buf, float* out) {
  job.T = T;
  group_routes(ids, gates, T, k, job.w13, buf.routes);
  prepare(h, T, job.H, p.kind, job.G, buf.hp);
  job.hacts = buf.hp.acts.data();
  job.routes = &buf.routes;
  job.small = p.small;
  std::memset(out, 0, sizeof(float) * T * job.H);
  bool done = false;
  for (int v = p.variant; v >= 0 && !done; v = all_variants()[v].fallback)
    done = all_variants()[v].moe(p.kind, job, out);
  TORCH_CHECK(done, "moetune::moe: the ", all_variants()[p.variant].name, " kernels have no path '", path, "'");
}

at::Tensor run_moe(const at::Tensor& h, MoeJob& job, const Path& p, const at::Tensor& ids, const at::Tensor& gates,
                   const std::string& path) {
  at::Tensor out = at::empty({job.T, job.H}, h.options());
  MoeBuffers buf;
  run_moe_into(h.data_ptr<float>(), job.T, job, p, ids.data_ptr<int64_t>(), gates.data_ptr<float>(), ids.size(1), path,
               buf, out.data_ptr<float>());
  return out;
}

// Experts given per expert (undefined where no token routes), in one format, on one path.
at::Tensor moe_q(const at::Tensor& h, const OptTensors& w13_list, const OptTensors& s13_list, const OptTensors& w2_list,
                 const OptTensors& s2_list, const at::Tensor& ids, const at::Tensor& gates, int64_t group,
                 const std::string& path) {
  check_routes(h, ids, gates);
  TORCH_CHECK(w13_list.size() == w2_list.size() && !w13_list.empty(),
              "moetune::moe: w13 and w2 lists differ in length");
  const int64_t E = static_cast<int64_t>(w13_list.size()), H = h.size(1), T = h.size(0);
  int64_t first = -1;
  for (int64_t e = 0; e < E && first < 0; ++e)
    if (get(w13_list, e).defined() && get(w2_list, e).defined()) first = e;
  if (first < 0) return at::zeros({T, H}, h.options());
  const Fmt fmt = fmt_of(get(w13_list, first));
  TORCH_CHECK(fmt != Fmt::F32, "moetune::moe: expert weights must be bf16, fp16, int8 or int4");
  const Path p = parse_path(path, fmt);
  const at::Tensor w2f = get(w2_list, first);
  const int64_t inter = fmt == Fmt::I4 ? w2f.size(1) * 2 : w2f.size(1);
  MoeJob job;
  job.T = T;
  job.H = H;
  job.inter = inter;
  job.G = group;
  job.w13.resize(E);
  job.w2.resize(E);
  for (int64_t e = 0; e < E; ++e) {
    const at::Tensor a = get(w13_list, e), b = get(w2_list, e);
    if (!a.defined() || !b.defined()) continue;
    TORCH_CHECK(fmt_of(a) == fmt && fmt_of(b) == fmt, "moetune::moe: experts of one call must share a dtype");
    if (fmt == Fmt::Bf16 || fmt == Fmt::F16) {
      check_weight(a, "moe");
      check_weight(b, "moe");
    }
    TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && (fmt == Fmt::I4 ? b.size(1) * 2 : b.size(1)) == inter,
                "moetune::moe: expert ", e, " has shapes ", a.sizes(), " and ", b.sizes());
    job.w13[e] = make_mat(a, get(s13_list, e), fmt, 2 * inter, H, group, p.kind, "moe");
    job.w2[e] = make_mat(b, get(s2_list, e), fmt, H, inter, group, p.kind, "moe");
  }
  return run_moe(h, job, p, ids, gates, path);
}

// Stacked experts: pointers into the two tensors (and their scales), no per-expert tensor objects.
//   bf16/fp16: w13 [E, 2I, H], w2 [E, H, I]
//   int8:      w13 [E, 2I, H], s13 [E, 2I]; w2 [E, H, I], s2 [E, H] (bf16 or fp32 row scales)
//   int4:      w13 [E, 2I padded to 16, H/2] bytes, s13 bf16 [E, H/G, 2I padded, 2]; w2 [E, H padded, I/2],
//              s2 [E, I/G, H padded, 2] (each expert's matrix in the native int4 layout, see the header)
// Expert 0 is checked as one matrix (make_mat); the others are the same shapes at fixed strides.
// stacked_job: the experts' job on `path` for activations of H values, checked (p: the parsed path); the
// fused decode step keeps one a layer, moe builds one a call.
MoeJob stacked_job(int64_t H, const at::Tensor& w13, const at::Tensor& w2, const std::string& path,
                   const std::optional<at::Tensor>& s13, const std::optional<at::Tensor>& s2, int64_t group, Path& p) {
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type(), "moetune::moe: w13 and w2 dtypes differ");
  const Fmt fmt = fmt_of(w13);
  TORCH_CHECK(fmt != Fmt::F32, "moetune::moe: expert weights must be bf16, fp16, int8 or int4");
  if (fmt == Fmt::Bf16 || fmt == Fmt::F16) {
    check_weight(w13, "moe");
    check_weight(w2, "moe");
  }
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0) && w13.is_contiguous() &&
                  w2.is_contiguous(),
              "moetune::moe: stacked experts must be contiguous [E, rows, cols] tensors, got ", w13.sizes(), " and ",
              w2.sizes());
  const bool scaled = fmt == Fmt::I8 || fmt == Fmt::I4;
  TORCH_CHECK(scaled == (s13.has_value() && s2.has_value()), "moetune::moe: ",
              scaled ? "int8/int4 experts need their scales" : "float experts take no scales");
  const int64_t E = w13.size(0);
  const int64_t inter = fmt == Fmt::I4 ? w2.size(2) * 2 : w2.size(2);
  p = parse_path(path, fmt);
  if (p.kind == Kind::Bf16Dp || p.kind == Kind::Bf16Tile)
    TORCH_CHECK(H % kQBlock == 0 && inter % kQBlock == 0, "moetune::moe: the ",
                p.kind == Kind::Bf16Dp ? "bf16dp" : "tile", " mode needs sizes divisible by 32, got ", H, " and ", inter);
  const at::Tensor a13 = scaled ? *s13 : at::Tensor(), a2 = scaled ? *s2 : at::Tensor();
  if (scaled)
    TORCH_CHECK(a13.size(0) == E && a2.size(0) == E && a13.is_contiguous() && a2.is_contiguous(),
                "moetune::moe: stacked scales must be contiguous with one entry per expert, got ", a13.sizes(), " and ",
                a2.sizes());
  MoeJob job;
  job.H = H;
  job.inter = inter;
  job.G = group;
  job.w13.resize(E);
  job.w2.resize(E);
  if (E == 0) return job;
  const Mat m13 = make_mat(w13.select(0, 0), scaled ? a13.select(0, 0) : at::Tensor(), fmt, 2 * inter, H, group,
                           p.kind, "moe");
  const Mat m2 = make_mat(w2.select(0, 0), scaled ? a2.select(0, 0) : at::Tensor(), fmt, H, inter, group, p.kind,
                          "moe");
  const int64_t wb = w13.element_size(), sb = scaled ? a13.element_size() : 0;
  for (int64_t e = 0; e < E; ++e) {
    Mat x = m13, y = m2;
    x.w = static_cast<const char*>(m13.w) + e * w13.stride(0) * wb;
    y.w = static_cast<const char*>(m2.w) + e * w2.stride(0) * wb;
    if (x.sc16) x.sc16 = reinterpret_cast<const uint16_t*>(reinterpret_cast<const char*>(m13.sc16) + e * a13.stride(0) * sb);
    if (y.sc16) y.sc16 = reinterpret_cast<const uint16_t*>(reinterpret_cast<const char*>(m2.sc16) + e * a2.stride(0) * sb);
    if (x.sc32) x.sc32 = m13.sc32 + e * a13.stride(0);
    if (y.sc32) y.sc32 = m2.sc32 + e * a2.stride(0);
    job.w13[e] = x;
    job.w2[e] = y;
  }
  return job;
}

at::Tensor moe(const at::Tensor& h, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& ids,
               const at::Tensor& gates, const std::string& path, const std::optional<at::Tensor>& s13,
               const std::optional<at::Tensor>& s2, int64_t group) {
  check_routes(h, ids, gates);
  Path p{};
  MoeJob job = stacked_job(h.size(1), w13, w2, path, s13, s2, group, p);
  job.T = h.size(0);
  if (job.w13.empty()) return at::zeros({job.T, job.H}, h.options());
  return run_moe(h, job, p, ids, gates, path);
}

at::Tensor moe_list(const at::Tensor& h, const OptTensors& w13, const OptTensors& w2, const at::Tensor& ids,
                    const at::Tensor& gates) {
  for (int64_t e = 0; e < static_cast<int64_t>(w13.size()); ++e) {
    const at::Tensor a = get(w13, e), b = get(w2, e);
    if (a.defined() && b.defined()) {
      check_weight(a, "moe_list");
      check_weight(b, "moe_list");
    }
  }
  return moe_q(h, w13, OptTensors(), w2, OptTensors(), ids, gates, 0, "");
}

at::Tensor moe_list_int8(const at::Tensor& h, const OptTensors& q13, const OptTensors& s13, const OptTensors& q2,
                         const OptTensors& s2, const at::Tensor& ids, const at::Tensor& gates) {
  TORCH_CHECK(s13.size() == q13.size() && s2.size() == q2.size(), "moetune::moe_list_int8: one scale entry per expert");
  for (int64_t e = 0; e < static_cast<int64_t>(q13.size()); ++e) {
    const at::Tensor a = get(q13, e), b = get(q2, e);
    if (a.defined() && b.defined())
      TORCH_CHECK(a.scalar_type() == at::kChar && b.scalar_type() == at::kChar, "moetune::moe_list_int8: expert ", e,
                  " weights must be contiguous int8 CPU tensors");
  }
  return moe_q(h, q13, s13, q2, s2, ids, gates, 0, "");
}

// ------------------------------------------------------------------------------ small fused steps

inline void rms_row(const float* x, const float* w, float eps, int64_t D, float* out) {
  // double: the sum of squares of thousands of activations, as one rounding (each square is exact in
  // double); in lanes, not one chain (32 rows of 1024 on the AMX Xeon: 40.5 -> 8.6 us)
  double ss = 0.0;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < D; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = 1.f / std::sqrt(static_cast<float>(ss / D) + eps);
  for (int64_t i = 0; i < D; ++i) out[i] = w[i] * (x[i] * inv);
}

void check_vec(const at::Tensor& w, int64_t n, const char* what) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == n && w.device().is_cpu(),
              "moetune::", what, ": weight must be a contiguous float32 vector of ", n);
}

// out [R, D] = rmsnorm(x) (checked by the caller).
void rmsnorm_into(const float* xp, const float* wp, int64_t R, int64_t D, double eps, float* op) {
  at::parallel_for(0, R, 64, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) rms_row(xp + r * D, wp, static_cast<float>(eps), D, op + r * D);
  });
}

at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu() && x.dim() >= 1,
              "moetune::rmsnorm: x must be a contiguous float32 CPU tensor");
  const int64_t D = x.size(-1), R = D ? x.numel() / D : 0;
  check_vec(w, D, "rmsnorm");
  at::Tensor out = at::empty_like(x);
  rmsnorm_into(x.data_ptr<float>(), w.data_ptr<float>(), R, D, eps, out.data_ptr<float>());
  return out;
}

// x [R, D] += delta; out = rmsnorm(x) (checked by the caller).
void add_rmsnorm_into(float* xp, const float* dp, const float* wp, int64_t R, int64_t D, double eps, float* op) {
  at::parallel_for(0, R, 64, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      for (int64_t i = 0; i < D; ++i) xp[r * D + i] += dp[r * D + i];
      rms_row(xp + r * D, wp, static_cast<float>(eps), D, op + r * D);
    }
  });
}

at::Tensor add_rmsnorm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, double eps) {
  check_act(x, "add_rmsnorm_");
  check_act(delta, "add_rmsnorm_");
  TORCH_CHECK(x.sizes() == delta.sizes(), "moetune::add_rmsnorm_: shapes differ");
  check_vec(w, x.size(1), "add_rmsnorm_");
  at::Tensor out = at::empty_like(x);
  add_rmsnorm_into(x.data_ptr<float>(), delta.data_ptr<float>(), w.data_ptr<float>(), x.size(0), x.size(1), eps,
                   out.data_ptr<float>());
  return out;
}

// Rotary embedding of one head in place: x*cos + rotate_half(x)*sin, rotate_half(x) = (-x2, x1).
inline void rope_head(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t h = d / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = x[i], b = x[i + h];
    x[i] = a * cos[i] - b * sin[i];
    x[i + h] = b * cos[i + h] + a * sin[i + h];
  }
}

// qk_rope into q [T, n_heads, d], k and v [T, n_kv, d] (contiguous fp32).
void qk_rope_into(const at::Tensor& qkv, int64_t n_heads, int64_t n_kv, int64_t d, const std::optional<at::Tensor>& q_norm,
                  const std::optional<at::Tensor>& k_norm, const std::string& norm, double eps, double clip,
                  const at::Tensor& cos, const at::Tensor& sin, at::Tensor& q, at::Tensor& k, at::Tensor& v) {
  check_act(qkv, "qk_rope");
  const int64_t T = qkv.size(0), Q = n_heads * d, KV = n_kv * d;
  TORCH_CHECK(qkv.size(1) == Q + 2 * KV, "moetune::qk_rope: qkv width ", qkv.size(1), " is not ", Q + 2 * KV);
  check_act(cos, "qk_rope");
  check_act(sin, "qk_rope");
  TORCH_CHECK(cos.size(0) == T && cos.size(1) == d && sin.sizes() == cos.sizes(), "moetune::qk_rope: cos/sin shape");
  TORCH_CHECK(norm == "none" || norm == "head" || norm == "full", "moetune::qk_rope: norm ", norm);
  const float *qw = nullptr, *kw = nullptr;
  if (norm != "none") {
    TORCH_CHECK(q_norm.has_value() && k_norm.has_value(), "moetune::qk_rope: norm weights missing");
    check_vec(*q_norm, norm == "head" ? d : Q, "qk_rope");
    check_vec(*k_norm, norm == "head" ? d : KV, "qk_rope");
    qw = q_norm->data_ptr<float>();
    kw = k_norm->data_ptr<float>();
  }
  const float* src = qkv.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const float e = static_cast<float>(eps), c = static_cast<float>(clip);
  at::parallel_for(0, T, 16, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) {
      const float* row = src + t * (Q + 2 * KV);
      float *qt = qp + t * Q, *kt = kp + t * KV, *vt = vp + t * KV;
      if (norm == "full") {
        rms_row(row, qw, e, Q, qt);
        rms_row(row + Q, kw, e, KV, kt);
      } else {
        std::copy(row, row + Q, qt);
        std::copy(row + Q, row + Q + KV, kt);
      }
      std::copy(row + Q + KV, row + Q + 2 * KV, vt);
      if (c > 0) {
        for (float* z : {qt, kt, vt}) {
          const int64_t n = z == qt ? Q : KV;
          for (int64_t i = 0; i < n; ++i) z[i] = std::min(c, std::max(-c, z[i]));
        }
      }
      for (int64_t hd = 0; hd < n_heads; ++hd) {
        if (norm == "head") rms_row(qt + hd * d, qw, e, d, qt + hd * d);
        rope_head(qt + hd * d, cp + t * d, sp + t * d, d);
      }
      for (int64_t hd = 0; hd < n_kv; ++hd) {
        if (norm == "head") rms_row(kt + hd * d, kw, e, d, kt + hd * d);
        rope_head(kt + hd * d, cp + t * d, sp + t * d, d);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_rope(const at::Tensor& qkv, int64_t n_heads, int64_t n_kv,
                                                        int64_t d, const std::optional<at::Tensor>& q_norm,
                                                        const std::optional<at::Tensor>& k_norm,
                                                        const std::string& norm, double eps, double clip,
                                                        const at::Tensor& cos, const at::Tensor& sin) {
  check_act(qkv, "qk_rope");
  const int64_t T = qkv.size(0);
  at::Tensor q = at::empty({T, n_heads, d}, qkv.options());
  at::Tensor k = at::empty({T, n_kv, d}, qkv.options());
  at::Tensor v = at::empty({T, n_kv, d}, qkv.options());
  qk_rope_into(qkv, n_heads, n_kv, d, q_norm, k_norm, norm, eps, clip, cos, sin, q, k, v);
  return {q, k, v};
}

// The top k of each of T rows of E logits, into gates [T, k] and ids [T, k] (1 <= k <= E).
void route_into(const float* lp, int64_t T, int64_t E, int64_t k, bool renorm, float* gp, int64_t* ip) {
  thread_local std::vector<float> p;
  thread_local std::vector<int64_t> order;
  p.resize(E);
  order.resize(E);
  for (int64_t t = 0; t < T; ++t) {
    const float* row = lp + t * E;
    float mx = row[0];
    for (int64_t e = 1; e < E; ++e) mx = std::max(mx, row[e]);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(row[e] - mx));
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    // Largest first; equal probabilities keep the lower expert id first.
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float kept = 0.f;
    for (int64_t j = 0; j < k; ++j) kept += p[order[j]] / sum;
    for (int64_t j = 0; j < k; ++j) {
      ip[t * k + j] = order[j];
      gp[t * k + j] = renorm ? (p[order[j]] / sum) / kept : p[order[j]] / sum;
    }
  }
}

std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& logits, int64_t k, bool renorm) {
  check_act(logits, "route");
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= E, "moetune::route: k=", k, " with ", E, " experts");
  at::Tensor gates = at::empty({T, k}, logits.options());
  at::Tensor ids = at::empty({T, k}, logits.options().dtype(at::kLong));
  route_into(logits.data_ptr<float>(), T, E, k, renorm, gates.data_ptr<float>(), ids.data_ptr<int64_t>());
  return {gates, ids};
}

// One query token per sequence against its cached keys and values, read in place from the cache
// (fp32, or bf16 with the kv_dtype knob): for each (sequence, KV head), the query heads of its group
// over positions [max(0, len-window), len).
template <typename C>
inline float cache_at(const C* p, int64_t i) {
  if constexpr (std::is_same_v<C, float>) return p[i];
  else return bf16_to_f(p[i]);
}

template <typename C>
inline float dot_cache(const float* q, const C* k, int64_t d) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * cache_at(k, i);
  return s;
}

// The vector kernels are each variant's `attend` (the variant body's "decode attention"); the scalar loop
// here serves head sizes none of them takes.
template <typename C>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const int64_t* sp,
                           const int64_t* lp, int64_t window, float sc, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), d = q.size(2), KV = kc.size(1), L = kc.size(2);
  const int64_t group = Hq / KV;
  const float* qp = q.data_ptr<float>();
  const C* kp = static_cast<const C*>(kc.data_ptr());
  const C* vp = static_cast<const C*>(vc.data_ptr());
  float* op = out.data_ptr<float>();
  // Each cached key and value row is read once for the whole group of query heads that share it.
  AttendKernel kernel = nullptr;  // the default variant's, else its fallbacks'; none: the scalar loop below
  for (int v = default_variant(); v >= 0 && !kernel; v = all_variants()[v].fallback)
    kernel = all_variants()[v].attend(d, !std::is_same_v<C, float>);
  const int nt = at::get_num_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1 && B * KV > 1)
  for (int64_t bh = 0; bh < B * KV; ++bh) {
    const int64_t b = bh / KV, g = bh % KV, len = lp[b];
    const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0, n = len - lo;
    const C* K = kp + ((sp[b] * KV + g) * L) * d;
    const C* V = vp + ((sp[b] * KV + g) * L) * d;
    const float* qg = qp + (b * Hq + g * group) * d;  // the group's query heads, [group, d]
    float* og = op + (b * Hq + g * group) * d;
    const Scratch<float> w(kAttendWeights, group * (n + 1));  // scores [group, n], then weights; group sums
    if (kernel) {
      kernel(qg, K, V, group, d, lo, len, sc, og, w.data());
      continue;
    }
    for (int64_t j = lo; j < len; ++j) {
      const C* kj = K + j * d;
      for (int64_t h = 0; h < group; ++h) w[h * n + j - lo] = dot_cache(qg + h * d, kj, d) * sc;
    }
    for (int64_t h = 0; h < group; ++h) {
      float* wh = w.data() + h * n;
      const float mx = *std::max_element(wh, wh + n);
      const float inv = 1.f / exp_shifted(wh, n, mx);
      for (int64_t j = 0; j < n; ++j) wh[j] *= inv;
    }
    for (int64_t i = 0; i < group * d; ++i) og[i] = 0.f;
    for (int64_t j = lo; j < len; ++j) {
      const C* vj = V + j * d;
      for (int64_t h = 0; h < group; ++h) {
        const float p = w[h * n + j - lo];
        float* oh = og + h * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) oh[i] += p * cache_at(vj, i);
      }
    }
  }
}

// The step's key and value rows k, v [B, KV, d] (fp32) written at position lens[b] - 1 of slot slots[b],
// rounded to the cache's dtype as torch's .to() rounds (the write the caller's advanced indexing did).
template <typename C>
void append_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& kc, at::Tensor& vc, const int64_t* sp,
               const int64_t* lp) {
  const int64_t B = k.size(0), KV = k.size(1), d = k.size(2), L = kc.size(2);
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  C* kd = static_cast<C*>(kc.data_ptr());
  C* vd = static_cast<C*>(vc.data_ptr());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < KV; ++g) {
      const int64_t src = (b * KV + g) * d, dst = ((sp[b] * KV + g) * L + lp[b] - 1) * d;
      for (int64_t i = 0; i < d; ++i) {
        if constexpr (std::is_same_v<C, float>) {
          kd[dst + i] = kp[src + i];
          vd[dst + i] = vp[src + i];
        } else {
          kd[dst + i] = f_to_bf16(kp[src + i]);
          vd[dst + i] = f_to_bf16(vp[src + i]);
        }
      }
    }
}

// decode_attention into out (shaped like q).
void decode_attention_into(const at::Tensor& q, at::Tensor& kc, at::Tensor& vc, const at::Tensor& slots,
                           const at::Tensor& lens, int64_t window, double scale, const c10::optional<at::Tensor>& k,
                           const c10::optional<at::Tensor>& v, at::Tensor& out) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3, "moetune::decode_attention: q");
  TORCH_CHECK((kc.scalar_type() == at::kFloat || kc.scalar_type() == at::kBFloat16) && kc.is_contiguous() &&
                  kc.dim() == 4 && vc.sizes() == kc.sizes() && vc.is_contiguous() &&
                  vc.scalar_type() == kc.scalar_type(),
              "moetune::decode_attention: caches must be contiguous float32 or bfloat16 [slots, KV, L, d]");
  const int64_t B = q.size(0), Hq = q.size(1), d = q.size(2), KV = kc.size(1), L = kc.size(2);
  TORCH_CHECK(kc.size(3) == d && Hq % KV == 0, "moetune::decode_attention: head shapes");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && slots.numel() == B &&
                  lens.numel() == B && slots.is_contiguous() && lens.is_contiguous(),
              "moetune::decode_attention: slots and lens must be int64 vectors of ", B);
  const int64_t *sp = slots.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sp[b] >= 0 && sp[b] < kc.size(0) && lp[b] >= 1 && lp[b] <= L, "moetune::decode_attention: slot ",
                sp[b], " length ", lp[b], " outside the cache");
  TORCH_CHECK(k.has_value() == v.has_value(), "moetune::decode_attention: k and v come together");
  if (k.has_value()) {
    for (const at::Tensor* t : {&*k, &*v})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == B &&
                      t->size(1) == KV && t->size(2) == d,
                  "moetune::decode_attention: k and v must be contiguous float32 [", B, ", ", KV, ", ", d, "]");
    if (kc.scalar_type() == at::kFloat)
      append_kv<float>(*k, *v, kc, vc, sp, lp);
    else
      append_kv<uint16_t>(*k, *v, kc, vc, sp, lp);
  }
  if (kc.scalar_type() == at::kFloat)
    decode_attention_impl<float>(q, kc, vc, sp, lp, window, static_cast<float>(scale), out);
  else
    decode_attention_impl<uint16_t>(q, kc, vc, sp, lp, window, static_cast<float>(scale), out);
}

// Prefill attention of one sequence's T new tokens (positions past .. past + T - 1 of cache slot `slot`): their
// keys and values k, v [T, KV, d] written into the caches first, then each token against the cached positions
// up to its own (from `window` back). The default variant's kernel (prefill) takes blocks of kPrefillTokens
// tokens of a KV head, the keys transposed once per KV head; a variant without one (or a head size it does
// not take) attends token by token as decode_attention does (the same lengths: past + 1 .. past + T).
constexpr int64_t kPrefillTokens = 16;

template <typename C>
void prefill_attention_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, int64_t slot, int64_t past,
                            int64_t window, float sc, const std::vector<int64_t>& slots,
                            const std::vector<int64_t>& lens, at::Tensor& out) {
  const int64_t T = q.size(0), Hq = q.size(1), d = q.size(2), KV = kc.size(1), L = kc.size(2), group = Hq / KV;
  PrefillKernel kernel = nullptr;
  for (int v = default_variant(); v >= 0 && !kernel; v = all_variants()[v].fallback)
    kernel = all_variants()[v].prefill(d);
  if (!kernel) {
    decode_attention_impl<C>(q, kc, vc, slots.data(), lens.data(), window, sc, out);
    return;
  }
  // The keys any token reads, [k0, past + T), transposed per KV head: ld columns, zeros past the last key (an
  // item's scores run 32 keys at a time from its first key on).
  const int64_t k0 = window > 0 ? std::max<int64_t>(0, past + 1 - window) : 0, n = past + T - k0;
  const int64_t ld = (n + 31 + 15) / 16 * 16;
  const Scratch<float> kt(kAttendKeys, KV * d * ld);
  // The kernel reads fp32 values: a bf16 cache's [k0, past + T) widened once per KV head, where every token's
  // outputs widened them again (AVX2, a bf16 cache, 128 tokens: 351-381 -> 303-337 us; AVX-512 the same).
  constexpr bool widen = !std::is_same_v<C, float>;
  const Scratch<float> vw(kAttendValues, widen ? KV * n * d : 0);
  const C* kp = static_cast<const C*>(kc.data_ptr()) + slot * KV * L * d;
  const C* vp = static_cast<const C*>(vc.data_ptr()) + slot * KV * L * d;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t blocks = (T + kPrefillTokens - 1) / kPrefillTokens, items = KV * blocks;
  const int nt = at::get_num_threads();
#pragma omp parallel num_threads(nt) if (nt > 1 && items > 1)
  {
#pragma omp for schedule(static)
    for (int64_t g = 0; g < KV; ++g) {
      float* t = kt.data() + g * d * ld;
      const C* K = kp + (g * L + k0) * d;
      for (int64_t j = 0; j < n; ++j)
        for (int64_t c = 0; c < d; ++c) t[c * ld + j] = cache_at(K, j * d + c);
      for (int64_t c = 0; c < d; ++c) std::fill(t + c * ld + n, t + (c + 1) * ld, 0.f);
      if constexpr (widen) {
        const C* V = vp + (g * L + k0) * d;
        float* vg = vw.data() + g * n * d;
        for (int64_t i = 0; i < n * d; ++i) vg[i] = cache_at(V, i);
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < items; ++it) {  // the last tokens' blocks (the most keys) first
      const int64_t b = blocks - 1 - it / KV, g = it % KV, t0 = b * kPrefillTokens;
      const int64_t m = std::min(kPrefillTokens, T - t0), p0 = past + t0;
      const int64_t lo = window > 0 ? std::max(k0, p0 + 1 - window) : k0, keys = p0 + m - lo;
      const Scratch<float> w(kAttendWeights, m * group * ((keys + 31) / 32 * 32 + 1));
      const float* V = widen ? vw.data() + g * n * d : reinterpret_cast<const float*>(vp + (g * L + k0) * d);
      kernel(qp + (t0 * Hq + g * group) * d, Hq * d, kt.data() + g * d * ld, ld, k0, V, group, d, m, p0, window, sc,
             op + (t0 * Hq + g * group) * d, w.data());
    }
  }
}

at::Tensor prefill_attention(const at::Tensor& q, at::Tensor kc, at::Tensor vc, int64_t slot, int64_t past,
                             int64_t window, double scale, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3, "moetune::prefill_attention: q");
  TORCH_CHECK((kc.scalar_type() == at::kFloat || kc.scalar_type() == at::kBFloat16) && kc.is_contiguous() &&
                  kc.dim() == 4 && vc.sizes() == kc.sizes() && vc.is_contiguous() &&
                  vc.scalar_type() == kc.scalar_type(),
              "moetune::prefill_attention: caches must be contiguous float32 or bfloat16 [slots, KV, L, d]");
  const int64_t T = q.size(0), Hq = q.size(1), d = q.size(2), KV = kc.size(1), L = kc.size(2);
  TORCH_CHECK(kc.size(3) == d && Hq % KV == 0, "moetune::prefill_attention: head shapes");
  TORCH_CHECK(slot >= 0 && slot < kc.size(0) && past >= 0 && past + T <= L, "moetune::prefill_attention: slot ",
              slot, " positions ", past, "..", past + T, " outside the cache");
  for (const at::Tensor* t : {&k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == T &&
                    t->size(1) == KV && t->size(2) == d,
                "moetune::prefill_attention: k and v must be contiguous float32 [", T, ", ", KV, ", ", d, "]");
  at::Tensor out = at::empty_like(q);
  if (T == 0) return out;
  std::vector<int64_t> slots(T, slot), lens(T);
  for (int64_t t = 0; t < T; ++t) lens[t] = past + t + 1;
  if (kc.scalar_type() == at::kFloat) {
    append_kv<float>(k, v, kc, vc, slots.data(), lens.data());
    prefill_attention_impl<float>(q, kc, vc, slot, past, window, static_cast<float>(scale), slots, lens, out);
  } else {
    append_kv<uint16_t>(k, v, kc, vc, slots.data(), lens.data());
    prefill_attention_impl<uint16_t>(q, kc, vc, slot, past, window, static_cast<float>(scale), slots, lens, out);
  }
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, at::Tensor kc, at::Tensor vc, const at::Tensor& slots,
                            const at::Tensor& lens, int64_t window, double scale, const c10::optional<at::Tensor>& k,
                            const c10::optional<at::Tensor>& v) {
  at::Tensor out = at::empty_like(q);
  decode_attention_into(q, kc, vc, slots, lens, window, scale, k, v, out);
  return out;
}

// ------------------------------------------------------------------------------ the fused decode step
// A decode-only step of every layer in one call (DecodeStack.step): the same products, norms, rotary,
// attention, routing and experts as the per-op path, called from C++ instead of Python. At one token a
// step runs ~12 ops a layer; from Python each costs its dispatch and the glue between them (about a
// fifth of a batch-1 step of the medium model on a 2-core vCPU), from here nothing but the op itself.
// The weights are registered once (add_attention, set_moe/set_mlp, set_int8), the KV caches whenever they are reallocated (set_cache).

inline std::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// A product on `path` ("variant:mode", or PyTorch's "torch:widen" / "torch:bf16"), fitted to the inner size
// as kernels._fit does: q8, bf16dp and tile read blocks of 32 activations, other inner sizes take f32. With
// `scales` the weights are int8 with one scale per row (runtime.dense_precision=int8) and `path` is native.
inline bool torch_path(const std::string& path) { return path.rfind("torch:", 0) == 0; }

// A native path fitted to inner size K.
std::string fitted_path(const std::string& path, int64_t K) {
  const auto colon = path.find(':');
  if (K % kQBlock && colon != std::string::npos) {
    const std::string mode = path.substr(colon + 1);
    if (mode == "q8" || mode == "q16" || mode == "bf16dp" || mode == "tile") return path.substr(0, colon) + ":f32";
  }
  return path;
}

at::Tensor linear_path(const at::Tensor& x, const at::Tensor& w, const std::string& path, const at::Tensor& bias,
                       const at::Tensor& scales = at::Tensor()) {
  const std::optional<at::Tensor> b = opt(bias);
  if (scales.defined()) TORCH_CHECK(!torch_path(path), "moetune::DecodeStack: int8 weights need a native path");
  if (path == "torch:widen") return at::linear(x, w.to(at::kFloat), b);
  if (path == "torch:bf16") {
    at::Tensor y = at::linear(x.to(w.scalar_type()), w).to(at::kFloat);
    return bias.defined() ? y.add_(bias) : y;
  }
  return linear_q(x, w, opt(scales), 0, w.size(0), fitted_path(path, x.size(1)), b);
}

// The SwiGLU MLP of dense layers and shared experts: silu(x W_g^T) * (x W_u^T), then W_d (as the per-op path).
at::Tensor mlp_path(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2, const std::string& path,
                    const at::Tensor& s13 = at::Tensor(), const at::Tensor& s2 = at::Tensor()) {
  const at::Tensor gu = linear_path(x, w13, path, at::Tensor(), s13);
  const int64_t d = gu.size(1) / 2;
  return linear_path(at::mul(at::silu(gu.narrow(1, 0, d)), gu.narrow(1, d, d)), w2, path, at::Tensor(), s2);
}

inline at::Tensor or_undefined(const std::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }

struct DecodeLayer {
  at::Tensor ln1, ln2, wqkv, bqkv, wo, bo, q_norm, k_norm;           // attention (undefined: absent)
  at::Tensor wqkv_s, wo_s, mlp_s13, mlp_s2, shared_s13, shared_s2;    // int8 dense weights' row scales
  at::Tensor router, w13, s13, w2, s2, shared_w13, shared_w2, shared_gate;  // MoE layers
  at::Tensor mlp_w13, mlp_w2;                                        // dense layers
  int64_t group = 0;
  // Resolved for the step's paths (DecodeStack::resolve): the native products and the experts' job.
  Product qkv, o, route;
  MoeJob experts;
  Path experts_path{};
};

// The fused step's phases, as DecodeStack.phase_seconds names them (kPhaseNames): where a step's time goes
// when the whole step is one native call and a profiler sees one op (scripts/decode_profile.py).
enum Phase { kNorms, kQkv, kRope, kAttention, kWo, kRouter, kRoute, kExperts, kShared, kMlp, kPhases };
constexpr const char* kPhaseNames[kPhases] = {"norms", "qkv",     "rope",    "attention", "wo",
                                              "router", "routing", "experts", "shared",    "mlp"};

// Seconds by phase, summed over the steps since it was switched on; off, no clock is read.
struct PhaseClock {
  bool on = false;
  int64_t steps = 0;
  double seconds[kPhases] = {};
  std::chrono::steady_clock::time_point last;
  void start() {
    if (on) last = std::chrono::steady_clock::now(), ++steps;
  }
  void mark(Phase ph) {  // the time since the last mark (or start) was phase ph's
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    seconds[ph] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

// What a step of T tokens writes, kept from step to step while T stays (DecodeStack::buffers).
struct StepBuffers {
  int64_t T = -1;
  at::Tensor h, qkv, q, k, v, att, o, logits, ids, gates, y;
};

struct DecodeStack : torch::CustomClassHolder {
  int64_t n_heads, n_kv, head_dim, window, top_k;
  double eps, clip, scale;
  std::string qk_norm;
  bool renorm;
  std::vector<DecodeLayer> layers;
  std::vector<at::Tensor> kc, vc;
  // The paths the layers are resolved for (while dense_ok / moe_ok), the step's buffers, the products' and experts'
  // scratch. A layer's ops then allocate nothing and dispatch nothing: each such call after a product had
  // streamed its weights through the caches cost about 5-15 us cold, most of a batch-1 step's serial time.
  std::string dense_at, moe_at;
  bool dense_ok = false, moe_ok = false;
  StepBuffers buf;
  Prepared acts;
  MoeBuffers moe_buf;
  // Routers' fp32 products run natively below this many tokens, on PyTorch's GEMM from it: the crossover
  // measured on this machine for the model's router shape (engine.calibrate.router_torch_tokens).
  int64_t router_torch_from = 33;
  PhaseClock clock;

  DecodeStack(int64_t n_heads, int64_t n_kv, int64_t head_dim, double eps, std::string qk_norm, double clip,
              int64_t window, double scale, int64_t top_k, bool renorm)
      : n_heads(n_heads), n_kv(n_kv), head_dim(head_dim), window(window), top_k(top_k), eps(eps), clip(clip),
        scale(scale), qk_norm(std::move(qk_norm)), renorm(renorm) {}

  // The layers' native products for dense_path (fitted to each inner size; torch paths: none, linear_path
  // runs them) and experts for moe_path, each resolved again only when its path changes.
  void resolve(const std::string& dense_path, const std::string& moe_path, int64_t H) {
    if (!dense_ok || dense_path != dense_at) {
      dense_ok = false;
      const bool native = !torch_path(dense_path);
      const int64_t Q = n_heads * head_dim;
      for (DecodeLayer& l : layers) {
        l.qkv = l.o = Product{};
        if (!native) continue;
        l.qkv = resolve_product(l.wqkv, opt(l.wqkv_s), 0, 0, H, fitted_path(dense_path, H), opt(l.bqkv));
        l.o = resolve_product(l.wo, opt(l.wo_s), 0, 0, Q, fitted_path(dense_path, Q), opt(l.bo));
      }
      dense_at = dense_path;
      dense_ok = true;
    }
    if (!moe_ok || moe_path != moe_at) {
      moe_ok = false;
      for (DecodeLayer& l : layers) {
        if (!l.router.defined()) continue;
        l.route = resolve_product(l.router, std::nullopt, 0, 0, H, "", std::nullopt);
        l.experts = stacked_job(H, l.w13, l.w2, moe_path, opt(l.s13), opt(l.s2), l.group, l.experts_path);
      }
      moe_at = moe_path;
      moe_ok = true;
    }
  }

  // The step's buffers for T tokens of x's width, allocated again only when T changes.
  void buffers(int64_t T, const at::Tensor& x) {
    if (buf.T == T) return;
    const int64_t H = x.size(1), Q = n_heads * head_dim, KV = n_kv * head_dim;
    int64_t E = 1;
    for (const DecodeLayer& l : layers) E = std::max<int64_t>(E, l.router.defined() ? l.router.size(0) : 1);
    const auto f = x.options();
    buf.h = at::empty({T, H}, f);
    buf.qkv = at::empty({T, Q + 2 * KV}, f);
    buf.q = at::empty({T, n_heads, head_dim}, f);
    buf.k = at::empty({T, n_kv, head_dim}, f);
    buf.v = at::empty({T, n_kv, head_dim}, f);
    buf.att = at::empty({T, n_heads, head_dim}, f);
    buf.o = at::empty({T, H}, f);
    buf.logits = at::empty({T, E}, f);
    buf.ids = at::empty({T, top_k}, f.dtype(at::kLong));
    buf.gates = at::empty({T, top_k}, f);
    buf.y = at::empty({T, H}, f);
    buf.T = T;  // last: a failed allocation leaves the buffers to be made again
  }

  // A dense product of h into out: the layer's resolved native product, else (torch paths) linear_path's.
  at::Tensor dense(const Product& pr, const at::Tensor& h, const at::Tensor& w, const at::Tensor& bias,
                   const at::Tensor& scales, const std::string& path, const at::Tensor& out) {
    if (pr.N == 0) return linear_path(h, w, path, bias, scales);
    run_product(pr, h.data_ptr<float>(), h.size(0), acts, out.data_ptr<float>());
    return out;
  }

  void add_attention(at::Tensor ln1, at::Tensor ln2, at::Tensor wqkv, std::optional<at::Tensor> bqkv, at::Tensor wo,
                     std::optional<at::Tensor> bo, std::optional<at::Tensor> q_norm, std::optional<at::Tensor> k_norm) {
    DecodeLayer l;
    l.ln1 = ln1;
    l.ln2 = ln2;
    l.wqkv = wqkv;
    l.bqkv = or_undefined(bqkv);
    l.wo = wo;
    l.bo = or_undefined(bo);
    l.q_norm = or_undefined(q_norm);
    l.k_norm = or_undefined(k_norm);
    layers.push_back(l);
    invalidate();
  }

  // The last added layer's experts (stacked, any format the moe op reads) and shared expert.
  void set_moe(at::Tensor router, at::Tensor w13, std::optional<at::Tensor> s13, at::Tensor w2,
               std::optional<at::Tensor> s2, int64_t group, std::optional<at::Tensor> shared_w13,
               std::optional<at::Tensor> shared_w2, std::optional<at::Tensor> shared_gate) {
    TORCH_CHECK(!layers.empty(), "moetune::DecodeStack: set_moe before add_attention");
    DecodeLayer& l = layers.back();
    l.router = router;
    l.w13 = w13;
    l.s13 = or_undefined(s13);
    l.w2 = w2;
    l.s2 = or_undefined(s2);
    l.group = group;
    l.shared_w13 = or_undefined(shared_w13);
    l.shared_w2 = or_undefined(shared_w2);
    l.shared_gate = or_undefined(shared_gate);
    invalidate();
  }

  void set_mlp(at::Tensor w13, at::Tensor w2) {
    TORCH_CHECK(!layers.empty(), "moetune::DecodeStack: set_mlp before add_attention");
    layers.back().mlp_w13 = w13;
    layers.back().mlp_w2 = w2;
    invalidate();
  }

  // The last added layer's dense matrices in int8 with one scale per row (runtime.dense_precision=int8):
  // name is wqkv, wo, mlp_w13, mlp_w2, shared_w13 or shared_w2.
  void set_int8(std::string name, at::Tensor q, at::Tensor scales) {
    TORCH_CHECK(!layers.empty(), "moetune::DecodeStack: set_int8 before add_attention");
    TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 &&
                    (scales.numel() == q.size(0) || (scales.dim() == 2 && scales.size(0) == q.size(0))),
                "moetune::DecodeStack.set_int8: ", name, ": int8 [N, K] weights and N row scales or [N, K / group] ",
                "group scales expected");
    DecodeLayer& l = layers.back();
    at::Tensor* slot[2] = {nullptr, nullptr};
    if (name == "wqkv") slot[0] = &l.wqkv, slot[1] = &l.wqkv_s;
    else if (name == "wo") slot[0] = &l.wo, slot[1] = &l.wo_s;
    else if (name == "mlp_w13") slot[0] = &l.mlp_w13, slot[1] = &l.mlp_s13;
    else if (name == "mlp_w2") slot[0] = &l.mlp_w2, slot[1] = &l.mlp_s2;
    else if (name == "shared_w13") slot[0] = &l.shared_w13, slot[1] = &l.shared_s13;
    else if (name == "shared_w2") slot[0] = &l.shared_w2, slot[1] = &l.shared_s2;
    TORCH_CHECK(slot[0] != nullptr, "moetune::DecodeStack.set_int8: no matrix named ", name);
    *slot[0] = q;
    *slot[1] = scales;
    invalidate();
  }

  void set_cache(std::vector<at::Tensor> k, std::vector<at::Tensor> v) {
    TORCH_CHECK(k.size() == layers.size() && v.size() == layers.size(), "moetune::DecodeStack: one cache a layer");
    kc = std::move(k);
    vc = std::move(v);
  }

  void invalidate() { dense_ok = moe_ok = false; }  // weights changed: resolve again at the next step

  // x [T, H] fp32, the residual stream, updated in place; cos/sin [T, d]; slots/lens [T] int64 (the
  // decode attention's). Returns the routed (ids, gates) of every MoE layer, [MoE layers, T, k], and the
  // tokens routed to each expert, [MoE layers, E] int64 (skipped slots, id -1, not counted): what the
  // engine's plans and statistics read, counted here: numpy's counting after a step that streamed the
  // weights through the caches ran cold (MoEDecoder._fused_decode has the figures).
  std::tuple<at::Tensor, at::Tensor, at::Tensor> step(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor slots,
                                                      at::Tensor lens, std::string dense_path, std::string moe_path) {
    check_act(x, "DecodeStack.step");
    TORCH_CHECK(kc.size() == layers.size(), "moetune::DecodeStack: set_cache first");
    const int64_t T = x.size(0), H = x.size(1);
    check_vec(layers[0].ln1, H, "DecodeStack.step");
    resolve(dense_path, moe_path, H);
    buffers(T, x);
    int64_t n_moe = 0, n_experts = 0;
    for (const auto& l : layers) {
      if (!l.router.defined()) continue;
      ++n_moe;
      n_experts = std::max(n_experts, l.router.size(0));
    }
    at::Tensor ids_out = at::empty({n_moe, T, top_k}, x.options().dtype(at::kLong));
    at::Tensor gates_out = at::empty({n_moe, T, top_k}, x.options());
    at::Tensor counts_out = at::zeros({n_moe, n_experts}, x.options().dtype(at::kLong));
    float* xp = x.data_ptr<float>();
    clock.start();
    rmsnorm_into(xp, layers[0].ln1.data_ptr<float>(), T, H, eps, buf.h.data_ptr<float>());
    clock.mark(kNorms);
    int64_t mi = 0;
    for (size_t i = 0; i < layers.size(); ++i) {
      DecodeLayer& l = layers[i];
      const at::Tensor qkv = dense(l.qkv, buf.h, l.wqkv, l.bqkv, l.wqkv_s, dense_path, buf.qkv);
      clock.mark(kQkv);
      qk_rope_into(qkv, n_heads, n_kv, head_dim, opt(l.q_norm), opt(l.k_norm), qk_norm, eps, clip, cos, sin, buf.q,
                   buf.k, buf.v);
      clock.mark(kRope);
      decode_attention_into(buf.q, kc[i], vc[i], slots, lens, window, scale, buf.k, buf.v, buf.att);
      clock.mark(kAttention);
      const at::Tensor o = dense(l.o, l.o.N ? buf.att : buf.att.view({T, n_heads * head_dim}), l.wo, l.bo, l.wo_s,
                                 dense_path, buf.o);
      clock.mark(kWo);
      add_rmsnorm_into(xp, o.data_ptr<float>(), l.ln2.data_ptr<float>(), T, H, eps, buf.h.data_ptr<float>());
      clock.mark(kNorms);
      at::Tensor y = buf.y;
      if (l.router.defined()) {
        const int64_t E = l.router.size(0);
        if (T < router_torch_from) {
          run_product(l.route, buf.h.data_ptr<float>(), T, acts, buf.logits.data_ptr<float>());
          clock.mark(kRouter);
          route_into(buf.logits.data_ptr<float>(), T, E, top_k, renorm, buf.gates.data_ptr<float>(),
                     buf.ids.data_ptr<int64_t>());
        } else {
          // From router_torch_from tokens the per-op path routes on PyTorch (GEMM, softmax, top-k,
          // renormalisation): the same ATen ops here give its bits on every CPU (the native softmax's
          // exp and sums differ from ATen's vectorised ones by an ulp on some, e.g. an AVX2 EPYC).
          const at::Tensor logits = at::linear(buf.h, l.router);
          clock.mark(kRouter);
          auto [w, ids] = at::topk(at::softmax(logits, -1, at::kFloat), top_k, -1);
          if (renorm) w = at::div(w, at::sum(w, -1, true));
          buf.gates.view({T, top_k}).copy_(w);
          buf.ids.view({T, top_k}).copy_(ids);
        }
        clock.mark(kRoute);
        if (l.experts.w13.empty()) y.zero_();
        else
          run_moe_into(buf.h.data_ptr<float>(), T, l.experts, l.experts_path, buf.ids.data_ptr<int64_t>(),
                       buf.gates.data_ptr<float>(), top_k, moe_path, moe_buf, y.data_ptr<float>());
        clock.mark(kExperts);
        if (l.shared_w13.defined()) {
          y = at::add(y, at::mul(at::sigmoid(at::linear(buf.h, l.shared_gate)), mlp_path(buf.h, l.shared_w13, l.shared_w2,
                                                                                         dense_path, l.shared_s13,
                                                                                         l.shared_s2)));
          clock.mark(kShared);
        }
        std::memcpy(ids_out.data_ptr<int64_t>() + mi * T * top_k, buf.ids.data_ptr<int64_t>(), T * top_k * sizeof(int64_t));
        std::memcpy(gates_out.data_ptr<float>() + mi * T * top_k, buf.gates.data_ptr<float>(), T * top_k * sizeof(float));
        int64_t* counts = counts_out.data_ptr<int64_t>() + mi * n_experts;
        for (const int64_t* id = buf.ids.data_ptr<int64_t>(), *end = id + T * top_k; id < end; ++id)
          if (*id >= 0) ++counts[*id];
        ++mi;
      } else {
        y = mlp_path(buf.h, l.mlp_w13, l.mlp_w2, dense_path, l.mlp_s13, l.mlp_s2);
        clock.mark(kMlp);
      }
      if (i + 1 < layers.size())
        add_rmsnorm_into(xp, y.data_ptr<float>(), layers[i + 1].ln1.data_ptr<float>(), T, H, eps, buf.h.data_ptr<float>());
      else
        x.add_(y);
      clock.mark(kNorms);
    }
    return {ids_out, gates_out, counts_out};
  }
};

// ------------------------------------------------------------------------------ ISA-specific ops
std::string isa() { return all_variants()[default_variant()].name; }

std::tuple<std::vector<std::string>, std::vector<std::string>> variants() {
  std::vector<std::string> compiled, runnable;
  for (const auto& v : all_variants()) {
    compiled.emplace_back(v.name);
    if (v.runs(cpu())) runnable.emplace_back(v.name);
  }
  return {compiled, runnable};
}

void set_isa(const std::string& name) { default_variant() = name == "auto" ? best_variant() : variant_index(name); }

// The variants whose kernels serve attention for head size d on `variant` (empty: the default one; any compiled
// one, runnable here or not), following its fallbacks as decode_attention and prefill_attention do: (decode,
// prompts), each "" where none has one (decode: decode_attention_impl's scalar loop; prompts: token by token).
std::vector<std::string> attention_kernels(int64_t d, const std::string& variant) {
  const int start = variant.empty() ? default_variant() : variant_index(variant, false);
  std::vector<std::string> out(2);
  for (int v = start; v >= 0 && out[0].empty(); v = all_variants()[v].fallback)
    if (all_variants()[v].attend(d, false)) out[0] = all_variants()[v].name;
  for (int v = start; v >= 0 && out[1].empty(); v = all_variants()[v].fallback)
    if (all_variants()[v].prefill(d)) out[1] = all_variants()[v].name;
  return out;
}

std::vector<std::string> cpu_features() {
  const CpuFeatures& f = cpu();
  std::vector<std::string> out;
  const std::pair<const char*, bool> all[] = {
      {"avx2", f.avx2},          {"fma", f.fma},           {"f16c", f.f16c},           {"os_avx", f.os_avx},
      {"avx512f", f.avx512f},    {"avx512bw", f.avx512bw}, {"avx512dq", f.avx512dq},   {"avx512vl", f.avx512vl},
      {"os_avx512", f.os_avx512}, {"avx512_vnni", f.avx512_vnni}, {"avx512_bf16", f.avx512_bf16},
      {"avx_vnni", f.avx_vnni},  {"amx_tile", f.amx_tile}, {"amx_bf16", f.amx_bf16},   {"amx_int8", f.amx_int8},
      {"os_amx", f.os_amx}};
  for (const auto& [name, on] : all)
    if (on) out.emplace_back(name);
  return out;
}

// The sum of buf (fp32, contiguous), read as the products of a few tokens read their weights: what the
// rooflines' read bandwidth is measured with (beside PyTorch's sum, one stream a thread), so that no
// product reads faster than its own access pattern alone. ahead: in runs of 2 MiB (a one-token product's
// chunk, 1024 bf16 rows of 1024) handed to the threads in turn, each run as kStreams streams far apart, a
// line of each at a time, each line prefetched into L2 2 KiB ahead (the next rows of the tiles,
// dots_bf16dp); else each thread's half as kStreams streams, 4 lines of each at a time, no prefetches (the
// read before 2026-12-06). On the AMX Xeon, 512 MiB, 2 threads, best of 5 after one, 3 alternated rounds of
// 3 measures, GB/s: without 36.8 / 35.3 / 35.9, 36.4 / 36.6 / 36.6, 36.2 / 35.8 / 36.6; ahead 38.2 / 39.2 /
// 40.4, 38.4 / 39.9 / 39.2, 37.0 / 37.1 / 37.4. engine.calibrate takes the faster.
double stream_read(const at::Tensor& buf, bool ahead) {
  TORCH_CHECK(buf.device().is_cpu() && buf.scalar_type() == at::kFloat && buf.is_contiguous(),
              "moetune::stream_read: a contiguous fp32 CPU tensor expected");
  constexpr int64_t kLine = 16, kBlock = 64, kRun = 512 << 10, kLead = 512;  // floats: line, block, run, lead
  const float* p = buf.data_ptr<float>();
  const int64_t n = buf.numel();
  const int nt = at::get_num_threads();
  std::vector<double> part(nt, 0.0);
#pragma omp parallel num_threads(nt)
  {
    const int t = omp_get_thread_num(), threads = omp_get_num_threads();
    float acc[kStreams][kBlock] = {};
    double sum = 0.0;
    if (ahead) {
      for (int64_t r0 = t * kRun; r0 < n; r0 += threads * kRun) {
        const int64_t r1 = std::min(n, r0 + kRun), h = (r1 - r0) / kStreams / kLine * kLine;
        for (int64_t i = 0; i < h; i += kLine)
          for (int s = 0; s < kStreams; ++s) {
            const float* q = p + r0 + s * h + i;
            __builtin_prefetch(q + kLead, 0, 2);  // past the buffer's end near it: a hint, never a fault
#pragma omp simd
            for (int64_t j = 0; j < kLine; ++j) acc[s][j] += q[j];
          }
        for (int64_t i = r0 + kStreams * h; i < r1; ++i) sum += p[i];
      }
    } else {
      const int64_t b0 = n * t / threads, b1 = n * (t + 1) / threads, h = (b1 - b0) / kStreams / kBlock * kBlock;
      for (int64_t i = 0; i < h; i += kBlock)
        for (int s = 0; s < kStreams; ++s) {
          const float* q = p + b0 + s * h + i;
#pragma omp simd
          for (int64_t j = 0; j < kBlock; ++j) acc[s][j] += q[j];
        }
      for (int64_t i = b0 + kStreams * h; i < b1; ++i) sum += p[i];
    }
    for (int s = 0; s < kStreams; ++s)
      for (int64_t j = 0; j < kBlock; ++j) sum += acc[s][j];
    part[t] = sum;
  }
  double total = 0.0;
  for (double v : part) total += v;
  return total;
}

// Flush t's bytes out of every cache level (clflush a line), so that the next read of t comes from memory,
// as a decode step reads its weights. True where done (x86); false elsewhere (the read may be a cache's).
bool evict(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "moetune::evict: a contiguous CPU tensor expected");
#if MT_X86
  const char* p = static_cast<const char*>(t.data_ptr());
  const int64_t n = t.numel() * t.element_size();
  for (int64_t i = 0; i < n; i += 64) _mm_clflush(p + i);
  if (n > 0) _mm_clflush(p + n - 1);
  _mm_mfence();
  return true;
#else
  return false;
#endif
}

// Seconds of `reps` fp32 products of x [T, K] by the router w [N, K] as the fused decode step runs them: on
// weights just evicted from the caches, right after a parallel region of the native kernels (the step's
// previous product's), with no dispatch around them; on the native kernels (run_product) or PyTorch's GEMM
// (at::linear). What engine.calibrate.router_torch_tokens compares. On the AMX Xeon (64 x 1024), the GEMM
// took 21.4 us at 1 token alone and 33.2 right after a native region, the native product 16.3 and 18.5; from
// Python, the native op's own dispatch (about 20 us a call) decided the comparison instead.
at::Tensor time_router(const at::Tensor& x, const at::Tensor& w, bool native, int64_t reps) {
  check_act(x, "time_router");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) == x.size(1),
              "moetune::time_router: w must be a contiguous float32 [N, ", x.size(1), "]");
  const int64_t T = x.size(0), N = w.size(0), K = w.size(1);
  const Product pr = resolve_product(w, std::nullopt, 0, 0, K, "", std::nullopt);
  at::Tensor y = at::empty({T, N}, x.options());
  at::Tensor out = at::empty({reps}, x.options().dtype(at::kDouble));
  double* sp = out.data_ptr<double>();
  Prepared acts;
  const at::Tensor before = at::empty({1 << 20}, x.options()).fill_(1.f);  // 4 MiB: the region's stream
  for (int64_t r = 0; r < reps; ++r) {
    evict(w);
    stream_read(before, true);
    const auto t0 = std::chrono::steady_clock::now();
    if (native) run_product(pr, x.data_ptr<float>(), T, acts, y.data_ptr<float>());
    else at::Tensor z = at::linear(x, w).contiguous();
    sp[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return out;
}

}  // namespace mt

TORCH_LIBRARY(moetune, m) {
  using namespace mt;
  m.def("linear(Tensor x, Tensor w, Tensor? bias=None) -> Tensor", &linear);
  m.def("linear_q(Tensor x, Tensor w, Tensor? scales, int group, int n_out, str path, Tensor? bias=None) -> Tensor",
        &linear_q);
  m.def("linear_int8(Tensor x, Tensor q, Tensor scales) -> Tensor", &linear_int8);
  m.def("quantize_q8(Tensor x, int group) -> (Tensor, Tensor, Tensor)", &quantize_q8);
  m.def("quantize_q16(Tensor x) -> (Tensor, Tensor)", &quantize_q16);
  m.def("quantize_int8(Tensor w) -> (Tensor, Tensor)", &quantize_int8);
  m.def("quantize_int4(Tensor w, int group, int n_pad, str pack) -> (Tensor, Tensor)", &quantize_int4);
  m.def("moe(Tensor h, Tensor w13, Tensor w2, Tensor ids, Tensor gates, str path='', Tensor? s13=None, "
        "Tensor? s2=None, int group=0) -> Tensor", &moe);
  m.def("moe_list(Tensor h, Tensor?[] w13, Tensor?[] w2, Tensor ids, Tensor gates) -> Tensor", &moe_list);
  m.def("moe_list_int8(Tensor h, Tensor?[] q13, Tensor?[] s13, Tensor?[] q2, Tensor?[] s2, Tensor ids, "
        "Tensor gates) -> Tensor", &moe_list_int8);
  m.def("moe_q(Tensor h, Tensor?[] w13, Tensor?[] s13, Tensor?[] w2, Tensor?[] s2, Tensor ids, Tensor gates, "
        "int group, str path) -> Tensor", &moe_q);
  m.def("rmsnorm(Tensor x, Tensor w, float eps) -> Tensor", &rmsnorm);
  m.def("add_rmsnorm_(Tensor(a!) x, Tensor delta, Tensor w, float eps) -> Tensor", &add_rmsnorm_);
  m.def("qk_rope(Tensor qkv, int n_heads, int n_kv, int head_dim, Tensor? q_norm, Tensor? k_norm, str norm, "
        "float eps, float clip, Tensor cos, Tensor sin) -> (Tensor, Tensor, Tensor)", &qk_rope);
  m.def("route(Tensor logits, int k, bool renorm) -> (Tensor, Tensor)", &route);
  m.def("decode_attention(Tensor q, Tensor(a!) kc, Tensor(b!) vc, Tensor slots, Tensor lens, int window, "
        "float scale, Tensor? k=None, Tensor? v=None) -> Tensor", &decode_attention);
  m.def("prefill_attention(Tensor q, Tensor(a!) kc, Tensor(b!) vc, int slot, int past, int window, float scale, "
        "Tensor k, Tensor v) -> Tensor", &prefill_attention);
  m.def("stream_read(Tensor buf, bool ahead=True) -> float", &stream_read);
  m.def("evict(Tensor t) -> bool", &evict);
  m.def("time_router(Tensor x, Tensor w, bool native, int reps) -> Tensor", &time_router);
  m.def("isa() -> str", &isa);
  m.def("variants() -> (str[], str[])", &variants);
  m.def("set_isa(str name) -> ()", &set_isa);
  m.def("attention_kernels(int d, str variant='') -> str[]", &attention_kernels);
  m.def("cpu_features() -> str[]", &cpu_features);
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, std::string, double, int64_t, double, int64_t, bool>())
      .def("add_attention", &DecodeStack::add_attention)
      .def("set_moe", &DecodeStack::set_moe)
      .def("set_mlp", &DecodeStack::set_mlp)
      .def("set_int8", &DecodeStack::set_int8)
      .def("set_cache", &DecodeStack::set_cache)
      .def("set_router_torch_from", [](const c10::intrusive_ptr<DecodeStack>& self, int64_t tokens) {
        TORCH_CHECK(tokens >= 1, "moetune::DecodeStack: router_torch_from must be at least 1, not ", tokens);
        self->router_torch_from = tokens;
      })
      .def("router_torch_from", [](const c10::intrusive_ptr<DecodeStack>& self) { return self->router_torch_from; })
      // Phase timers of the steps (off by default): set_timing(True) clears and starts them.
      .def("set_timing", [](const c10::intrusive_ptr<DecodeStack>& self, bool on) {
        self->clock = PhaseClock{};
        self->clock.on = on;
      })
      // (phase names, seconds summed over the timed steps, steps timed)
      .def("phase_seconds", [](const c10::intrusive_ptr<DecodeStack>& self) {
        std::vector<std::string> names(kPhaseNames, kPhaseNames + kPhases);
        std::vector<double> seconds(self->clock.seconds, self->clock.seconds + kPhases);
        return std::make_tuple(names, seconds, self->clock.steps);
      })
      .def("step", &DecodeStack::step);
}

#else  // MOETUNE_VARIANT_BODY
// ============================================================================== variant body
// Compiled once per ISA variant inside namespace mt::v_<variant>, with MT_ISA naming the variant.

constexpr int kPrefetchL2 = 2;  // __builtin_prefetch's locality for prefetcht1: weights prefetched into L2 (below)

// ---- the fp32 vector of the variant
#if MT_ISA >= MT_AVX512
constexpr int kLanes = 16;
constexpr int kNT = 4;  // tokens per register tile of the f32 mode: 4 rows x 4 tokens = 16 accumulators
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
inline vec wload(const uint16_t* p, Bf16T) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline vec wload(const uint16_t* p, F16T) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vec wload(const int8_t* p, I8T) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif MT_ISA >= MT_AVX2
constexpr int kLanes = 8;
constexpr int kNT = 3;  // 4 x 3 accumulators + 3 activations + 1 weight = the 16 ymm registers
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}
inline vec wload(const uint16_t* p, Bf16T) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline vec wload(const uint16_t* p, F16T) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vec wload(const int8_t* p, I8T) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#else
constexpr int kLanes = 1;
constexpr int kNT = 4;
using vec = float;
inline vec vzero() { return 0.f; }
inline vec vload(const float* p) { return *p; }
inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
inline float vsum(vec a) { return a; }
template <typename WT>
inline vec wload(const typename WT::elem* p, WT t) { return widen(*p, t); }
#endif

// ---- f32 mode: s[r * NT + t] = dot(w[r][0:K], x[t].x[0:K]) for NR weight rows and NT tokens.
template <typename WT, int NR, int NT>
inline void dots_f32(const typename WT::elem* const* w, const Act* x, int64_t K, int64_t ahead, float* s) {
  vec acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    // One prefetch per 64-byte line: the same line of the next tile's rows, so each row's stream is
    // in flight a tile ahead. Measured on a 2-core Ice Lake: 15-17 -> 19-24 GB/s.
    if ((k & 31) == 0)
      for (int r = 0; r < NR; ++r) __builtin_prefetch(w[r] + k + ahead, 0, kPrefetchL2);
    vec xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = vload(x[t].x + k);
    for (int r = 0; r < NR; ++r) {
      vec wv = wload(w[r] + k, WT{});
      for (int t = 0; t < NT; ++t) acc[r][t] = vfma(wv, xv[t], acc[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) s[r * NT + t] = vsum(acc[r][t]);
  for (; k < K; ++k)
    for (int r = 0; r < NR; ++r) {
      float wk = widen(w[r][k], WT{});
      for (int t = 0; t < NT; ++t) s[r * NT + t] += wk * x[t].x[k];
    }
}

// ---- f32 mode, bf16 weights, 1-2 tokens: dots_f32's products with half its integer ops. A 32-bit lane of
// bf16 weights holds a pair, the even one in its low half: shifted up 16 bits it is the even weight as fp32,
// its high half masked the odd one; the activations come split to match (Act::xs, split_row). Widening took
// two ops per 8 weights (vpmovzxwd, vpslld), this takes one: the products at 1-2 tokens were bound by them
// on a 2-core AMD EPYC (Zen 1, AVX2, whose 256-bit ops take two 128-bit halves): a 1024-wide bf16 product
// in cache ran 6 G weights/s a core, the memory's 26 GB/s asking 6.5. There, one thread, 1 token, 1024 x
// 1024 in cache: 6.1 -> 12.7 G weights/s; `kernel_ops_bench.py --precision bf16`, 3 rounds, GB/s at 1 token:
// lm head 20.4 -> 23.5, MoE medium 19.1 -> 21.6; at 2 tokens 14.5 -> 17.8, 18.9 -> 20.8; `engine compare-hf`
// batch 1, medium preset: bf16 39.5 -> 44.0 tok/s, int8 experts (bf16 dense) 53.7 -> 56.9 (2 rounds of 3
// each, old and new runs one after the other). At more tokens the widening is shared by the tile's tokens
// and dots_f32 goes on.
#if MT_ISA >= MT_AVX2
inline void wpair(const uint16_t* p, vec& even, vec& odd) {
#if MT_ISA >= MT_AVX512
  const __m512i v = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
#else
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
#endif
}

// s[r * NT + t] = dot(w[r][0:K], token t) from the tokens' split rows; K % 32 == 0. One token keeps the even
// and odd products in accumulators apart (two chains of FMAs a row, not one twice as long).
template <int NR, int NT>
inline void dots_bf16_split(const uint16_t* const* w, const Act* x, int64_t K, int64_t ahead, float* s) {
  constexpr int kSets = NT == 1 ? 2 : 1;
  constexpr int64_t kHalf = kQBlock / 2;
  vec acc[kSets][NR][NT];
  for (int c = 0; c < kSets; ++c)
    for (int r = 0; r < NR; ++r)
      for (int t = 0; t < NT; ++t) acc[c][r][t] = vzero();
  for (int64_t k = 0; k < K; k += kQBlock) {
    for (int r = 0; r < NR; ++r) __builtin_prefetch(w[r] + k + ahead, 0, kPrefetchL2);  // a block: 64 bytes
    for (int64_t h = 0; h < kHalf; h += kLanes) {  // 2 kLanes weights a load: two loads a block (AVX2), one (AVX-512)
      vec xe[NT], xo[NT];
      for (int t = 0; t < NT; ++t) {
        xe[t] = vload(x[t].xs + k + h);
        xo[t] = vload(x[t].xs + k + kHalf + h);
      }
      for (int r = 0; r < NR; ++r) {
        vec we, wo;
        wpair(w[r] + k + 2 * h, we, wo);
        for (int t = 0; t < NT; ++t) {
          acc[0][r][t] = vfma(we, xe[t], acc[0][r][t]);
          acc[kSets - 1][r][t] = vfma(wo, xo[t], acc[kSets - 1][r][t]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) s[r * NT + t] = vsum(kSets == 2 ? acc[0][r][t] + acc[kSets - 1][r][t] : acc[0][r][t]);
}
#endif

// ---- A few tokens (decode, an expert with 1-3 tokens): the products are bound by reading the weights,
// so they are written for the memory's sake.
//
// Streams. The rows were first read one after another, one sequential stream a thread (four accumulators
// along the row): on a 2-core AMD EPYC (AVX2) that took the lm head from 22.4 to 33.1 GB/s over 4-row
// tiles, whose four streams 1 row apart the hardware prefetchers follow worse. But one stream a core stays
// below what the memory delivers: the prefetchers keep too few lines of one stream in flight. kStreams
// streams far apart (each its own run of rows, so its own pages: in_streams) keep several in flight.
// Measured on a 2-core AMD EPYC (AVX2), a standalone 32000 x 1024 bf16 product, 2 threads, medians of 5:
// one stream 22.4 GB/s, 4 streams 256 rows apart 31.0 (torch's sum of the same bytes: 26.4); 2 streams
// 1.2x one, 8 no better than 4; rows adjacent in memory as 4 streams 16.6 (the prefetchers see one
// irregular stream). So rows_times_tokens gives one tile of tokens 4 rows far apart, each prefetched a row
// ahead. `scripts/kernel_ops_bench.py`, one stream -> 4 streams, 1 token, medians of 5, bf16: projection
// 18.4 -> 22.3, MoE small 20.6 -> 26.5, medium 21.2 -> 28.0 GB/s; int8 q8 (7): MoE medium 19.3 -> 23.6
// (measured with a one-token kernel of its own, two accumulators a row and 1 KB prefetches; the far-row
// tiles that replaced it measured the same: bf16 MoE medium 28.2 -> 32.0, int8 19.6 -> 20.3, 5 rounds).
// Reading the down rows of 4 experts side by side (each expert's rows one stream) in the MoE's second
// phase, rather than 4 streams within each expert's rows, measured no faster (MoE medium 30.5 -> 31.1
// GB/s, inside the noise) and was left out.
//
// Prefetches. Every weight prefetch goes to L2 (prefetcht1: kPrefetchL2), not L1: a prefetch into L1
// holds one of the core's few L1 miss buffers until its line arrives, which caps one core's stream at
// about (buffers x 64 B) / latency; L2 tracks several times as many misses. Medium-preset MoE layer (bf16
// weights, 8 of 64 experts a token), AVX512_BF16 EPYC, 2 threads, GB/s at 1 / 4 / 32 tokens, medians of
// 5 interleaved processes, L1 -> L2: f32 mode 15.6 / 14.3 / 12.3 -> 26.3 / 23.6 / 17.6, bf16dp 14.6 /
// 14.9 / 13.5 -> 19.7 / 19.1 / 18.0. One stream needed 4 KB ahead; several streams take a row ahead.

// Shared runs. A parallel region ends when its slowest thread does: with runs of rows handed out whole, the
// thread that took the last one was read alone while the other waited, about half a run at each region's
// end. A run's rows can instead be claimed in parts from a cursor of its own (an atomic count), by the
// thread that took the run and by any thread that finds no run left, so both read until the region's end.
// The same rows go through the same tiles either way (a row's bits do not depend on which thread reads it).
//
// Rows [r0, r1) of a product as kStreams streams, in stream_parts(r0, r1) parts (in_streams): each part but
// the last computes, for i in [p kPartRows, (p + 1) kPartRows), many(r0 + i, h), the rows r0 + i, r0 + i +
// h, ..., r0 + i + (kStreams - 1) h with h = (r1 - r0) / kStreams (64 KB of a 1024-wide bf16 matrix's 4
// streams); the last part one(r) for each row left over. Read whole, the parts go in order.
//
// Medium preset, batch 1, AMX Xeon, 2 threads, on a busy host (scripts/decode_profile.py --phases, 150
// steps, a build that timed each thread's end of each region, 3 alternated rounds): one thread's wait at the
// MoE's ends 57-74 -> 8-16 us a layer, at the dense products' ends 42-48 -> 17-26 us a product; whole steps
// (6 alternated rounds) 24.4-32.7 -> 24.0-27.5 ms, paired differences -5.2 to +0.1 ms, median -1.1. Each
// cursor has a line of its own: side by side in one line the claims of two threads contended, and the
// experts took 14.1-16.0 ms a step instead of 12.1-12.7.
constexpr int64_t kPartRows = 8;
inline int64_t stream_parts(int64_t r0, int64_t r1) { return ((r1 - r0) / kStreams + kPartRows - 1) / kPartRows + 1; }
template <typename Many, typename One>
inline void in_streams(int64_t r0, int64_t r1, int64_t p, const Many& many, const One& one) {
  const int64_t h = (r1 - r0) / kStreams, i0 = p * kPartRows;
  if (i0 < h)
    for (int64_t i = i0, i1 = std::min(h, i0 + kPartRows); i < i1; ++i) many(r0 + i, h);
  else
    for (int64_t r = r0 + kStreams * h; r < r1; ++r) one(r);
}
struct alignas(64) Cursor {  // a line of its own: threads claiming from runs side by side do not share it
  std::atomic<int64_t> next{0};
};
inline int64_t claim(Cursor* c) { return c->next.fetch_add(1, std::memory_order_relaxed); }

// ---- q8 mode: integer dot products per block of 32, scaled per block and accumulated in fp32.
#if MT_ISA >= MT_AVX2
struct V256 {  // one q8 block per integer vector
  using F = __m256;
  using I = __m256i;
  static constexpr int kValues = 32;
  static F fzero() { return _mm256_setzero_ps(); }
  static F fload(const float* p) { return _mm256_loadu_ps(p); }
  static F ffma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fmul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fadd(F a, F b) { return _mm256_add_ps(a, b); }
  static F fset(float v) { return _mm256_set1_ps(v); }
  static float fsum(F a) { return vsum256(a); }
  static __m128 fsum4(F a, F b, F c, F d) {  // lane i: the sum of the i-th vector's 8 lanes
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
  }
  static float vsum256(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
  }
  static I iload(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F i2f(I v) { return _mm256_cvtepi32_ps(v); }
  // 8 sums of 4 products of unsigned bytes u and signed bytes s (|u|, |s| <= 127: no saturation).
  static I dp(I u, I s) {
#if MT_ISA == MT_AVXVNNI
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#elif MT_ISA >= MT_AVX512VNNI
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
  }
  // dp(u1, s1) + dp(u2, s2), the pairs' sums added in int16 before the widening (no saturation where
  // every |u s| <= 15 x 127: int4 weights).
  static I dp2(I u1, I s1, I u2, I s2) {
#if MT_ISA == MT_AVXVNNI
    return _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u1, s1), u2, s2);
#elif MT_ISA >= MT_AVX512VNNI
    return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u1, s1), u2, s2);
#else
    return _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u1, s1), _mm256_maddubs_epi16(u2, s2)),
                             _mm256_set1_epi16(1));
#endif
  }
  static I iabs(I w) { return _mm256_abs_epi8(w); }
  static I isign(I x, I w) { return _mm256_sign_epi8(x, w); }  // x * sign(w)
  // The 64 values (0..15) of one int4 chunk of 32 bytes: byte j holds value j (low nibble) and value
  // j + 32 (high nibble), so a mask gives the first 32 in order, a shift and the mask the other 32.
  static I nibbles_lo(const uint8_t* p) { return _mm256_and_si256(iload(p), _mm256_set1_epi8(0x0F)); }
  static I nibbles_hi(const uint8_t* p) {
    return _mm256_and_si256(_mm256_srli_epi16(iload(p), 4), _mm256_set1_epi8(0x0F));
  }
  // The 32 values of the 16-byte tail chunk of a row whose length is 32 mod 64: j low, j + 16 high.
  static I nibbles32(const uint8_t* p) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
  }
};
#endif

#if MT_ISA >= MT_AVX512
struct V512 {  // two q8 blocks per integer vector
  using F = __m512;
  using I = __m512i;
  static constexpr int kValues = 64;
  static F fzero() { return _mm512_setzero_ps(); }
  static F fload(const float* p) { return _mm512_loadu_ps(p); }
  static F ffma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fmul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fadd(F a, F b) { return _mm512_add_ps(a, b); }
  static F fset(float v) { return _mm512_set1_ps(v); }
  static float fsum(F a) { return _mm512_reduce_add_ps(a); }
  static __m128 fsum4(F a, F b, F c, F d) { return V256::fsum4(half(a), half(b), half(c), half(d)); }
  static __m256 half(F a) {  // the sums of lanes i and i + 8
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
  }
  static I iload(const void* p) { return _mm512_loadu_si512(p); }
  static F i2f(I v) { return _mm512_cvtepi32_ps(v); }
  static I dp(I u, I s) {
#if MT_ISA >= MT_AVX512VNNI
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
  }
  static I iabs(I w) { return _mm512_abs_epi8(w); }
  static I isign(I x, I w) {  // no vpsignb for zmm: negate x where w < 0 (where w == 0, |w| is 0 anyway)
    return _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);
  }
  // The 64 values of one int4 chunk (32 bytes: j low nibble, j + 32 high), in order.
  static I nibbles(const uint8_t* p) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1),
                            _mm512_set1_epi8(0x0F));
  }
};
#endif

#if MT_ISA >= MT_AVX2
// int8 weights x q8 activations; K % V::kValues == 0. Products |w| * (x * sign(w)) keep vpmaddubsw's
// unsigned operand non-negative (llama.cpp's q8_0 AVX2 trick).
// GR: the weights have a scale per group of 2^gshift values (gs[r]: row r's), applied per block (the
// groups are multiples of the block); else the caller applies the row scales.
template <class V, int NR, int NT, bool GR = false>
inline void dots_i8q8(const int8_t* const* w, const Act* x, int64_t K, int64_t ahead, float* s,
                      const float* const* gs = nullptr, int gshift = 0) {
  typename V::F acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = V::fzero();
  for (int64_t k = 0; k < K; k += V::kValues) {
    if ((k & 63) == 0)
      for (int r = 0; r < NR; ++r) __builtin_prefetch(w[r] + k + ahead, 0, kPrefetchL2);
    typename V::I xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = V::iload(x[t].q + k);
    for (int r = 0; r < NR; ++r) {
      const typename V::I wv = V::iload(w[r] + k), aw = V::iabs(wv);
      if constexpr (GR) {
        const typename V::F sv = V::fset(gs[r][k >> gshift]);
        for (int t = 0; t < NT; ++t)
          acc[r][t] = V::ffma(V::i2f(V::dp(aw, V::isign(xv[t], wv))), V::fmul(V::fload(x[t].d + k / 4), sv), acc[r][t]);
      } else {
        for (int t = 0; t < NT; ++t)
          acc[r][t] = V::ffma(V::i2f(V::dp(aw, V::isign(xv[t], wv))), V::fload(x[t].d + k / 4), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) s[r * NT + t] = V::fsum(acc[r][t]);
}

// dots_i8q8 on the widest vector the variant has that K (and, with GR, the group of
// 2^gshift values) divides into blocks of.
inline bool i8q8_wide(int64_t K, bool grouped, int gshift) {
#if MT_ISA >= MT_AVX512
  return K % V512::kValues == 0 && (!grouped || (int64_t{1} << gshift) % V512::kValues == 0);
#else
  (void)K, (void)grouped, (void)gshift;
  return false;
#endif
}

template <int NR, int NT, bool GR = false>
inline void i8q8_dots(const int8_t* const* w, const Act* x, int64_t K, int64_t ahead, float* s,
                      const float* const* gs = nullptr, int gshift = 0) {
#if MT_ISA >= MT_AVX512
  if (i8q8_wide(K, GR, gshift)) return dots_i8q8<V512, NR, NT, GR>(w, x, K, ahead, s, gs, gshift);
#endif
  dots_i8q8<V256, NR, NT, GR>(w, x, K, ahead, s, gs, gshift);
}

// ---- q16 mode: int8 weights x activations quantized per block of 32 to int16 (scale max|x| / 32767): the
// weights sign-extended to int16 in registers (vpmovsxbw), vpmaddwd pairs into int32 per block, each block
// scaled and accumulated in fp32. The activations keep 15 bits a block where q8 keeps 7: the f32 mode's
// results to about 5 digits, at close to q8's speed where widening int8 to fp32 bounds the f32 mode.
// Measured first in a standalone C++ loop on a 2-core AVX2 EPYC (128 MB of int8 rows at one token, 4 far
// streams, 2 threads, GB/s): f32 widening 15.4 / 16.2, q8 21.3 / 23.6, q16 21.2 / 24.7 (2026-12-07).
// No int32 sum overflows: |x| <= 32767, |w| <= 127, 32 products a block (1.3e8 < 2^31).
struct Q16x256 {  // one block: two vectors of 16 int16, into 8 int32 lanes
  using V = V256;
  struct X {
    __m256i a, b;
  };
  using W = X;
  static X xload(const int16_t* p) { return {V::iload(p), V::iload(p + 16)}; }
  static W wload(const int8_t* p) {
    return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
  }
  static __m256i dot(const W& w, const X& x) {
    return _mm256_add_epi32(_mm256_madd_epi16(w.a, x.a), _mm256_madd_epi16(w.b, x.b));
  }
  static __m256 scale(const float* d8) { return _mm256_loadu_ps(d8); }  // the block's 8 copies
};

#if MT_ISA >= MT_AVX512
struct Q16x512 {  // one block: one vector of 32 int16, into 16 int32 lanes
  using V = V512;
  using X = __m512i;
  using W = __m512i;
  static X xload(const int16_t* p) { return _mm512_loadu_si512(p); }
  static W wload(const int8_t* p) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static __m512i dot(const W& w, const X& x) { return _mm512_madd_epi16(w, x); }
  static __m512 scale(const float* d8) { return _mm512_set1_ps(*d8); }
};
#endif

// int8 weights x q16 activations; K % 32 == 0. GR as dots_i8q8.
template <class Q, int NR, int NT, bool GR = false>
inline void dots_i8q16(const int8_t* const* w, const Act* x, int64_t K, int64_t ahead, float* s,
                       const float* const* gs = nullptr, int gshift = 0) {
  using V = typename Q::V;
  typename V::F acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = V::fzero();
  for (int64_t k = 0; k < K; k += kQBlock) {
    if ((k & 63) == 0)
      for (int r = 0; r < NR; ++r) __builtin_prefetch(w[r] + k + ahead, 0, kPrefetchL2);
    typename Q::X xv[NT];
    typename V::F dv[NT];
    for (int t = 0; t < NT; ++t) {
      xv[t] = Q::xload(x[t].q16 + k);
      dv[t] = Q::scale(x[t].d + k / 4);
    }
    for (int r = 0; r < NR; ++r) {
      const typename Q::W wv = Q::wload(w[r] + k);
      if constexpr (GR) {
        const typename V::F sv = V::fset(gs[r][k >> gshift]);
        for (int t = 0; t < NT; ++t) acc[r][t] = V::ffma(V::i2f(Q::dot(wv, xv[t])), V::fmul(dv[t], sv), acc[r][t]);
      } else {
        for (int t = 0; t < NT; ++t) acc[r][t] = V::ffma(V::i2f(Q::dot(wv, xv[t])), dv[t], acc[r][t]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) s[r * NT + t] = V::fsum(acc[r][t]);
}

template <int NR, int NT, bool GR = false>
inline void i8q16_dots(const int8_t* const* w, const Act* x, int64_t K, int64_t ahead, float* s,
                       const float* const* gs = nullptr, int gshift = 0) {
#if MT_ISA >= MT_AVX512
  dots_i8q16<Q16x512, NR, NT, GR>(w, x, K, ahead, s, gs, gshift);
#else
  dots_i8q16<Q16x256, NR, NT, GR>(w, x, K, ahead, s, gs, gshift);
#endif
}

// int4 weights x q8 activations. Rows: chunks of 64 values in 32 bytes (j low nibble, j + 32 high),
// then, where K is 32 mod 64, one chunk of 32 values in 16 bytes (j low, j + 16 high).
// dot over a group = scale * sum((q - 8) x) + zero * sum(x), x quantized (x_q = q8 d) in the first term:
// scale * sum(q x_q) from integer products (unsigned q: vpmaddubsw's unsigned operand), - 8 scale * sum(x_q)
// and zero * sum(x) from the group sums prepare keeps (gq, gs).
// The integer products of a block take the block's activation scale into the group's sum (gacc), and the
// group's weight scale multiplies that sum once, at the group's end (int4_group_end, which adds the group's
// zero terms too, for the tile's rows at once). Where G is a multiple of 64 the activations have one scale
// per 64-value chunk (int4_act_block), so a chunk's two halves' products add up in int16 (at most
// 2 x 2 x 15 x 127) before one widening to int32.
// Until 2026-12-08 every block of 32 took both scales and a widening of its own, each row's zero terms and
// scales were read and widened one by one, and the -8 scale term took the exact sum(x), which left
// scale * sum(q (x_q - x)) of rounding error (q in 0..15, RMS 8.8) where it is now scale * sum((q - 8)
// (x_q - x)) (RMS 4.6). On the AVX2 EPYC (int4 compute-bound there), one thread, 1 token, group 128,
// weights in cache, ns a row at 384 / 1024 inputs 44 / 108 -> 37 / 82-97 (int8 q16: 41 / 95);
// `scripts/kernel_ops_bench.py --precision int4`, 2 threads, MoE medium, GB/s at 1, 2, 8, 32 tokens:
// 6.1 -> 7.1, 6.7 -> 7.8, 5.8 -> 7.1, 2.4 -> 2.8 (group 32: 5.1 -> 5.5 at 1 token).

// The tile's row sums: acc (vectors, the groups' sums at their weight scales), z (lane r: row r's zero terms).
template <class V, int NR, int NT>
struct Int4Sums {
  static_assert(NR <= 4, "zero terms a lane per row");
  typename V::F acc[NR][NT], gacc[NR][NT];
  __m128 z[NT];
};

// Group g's end: for the NR rows at once (lane r: row r), its (scale, zero) pairs (one 32-bit word a row:
// scale in the low bf16, zero in the high one) as fp32, the zero terms zero x sum(x) - 8 scale x sum(q d)
// into z; each row's group sums (gacc) into acc at its weight scale, gacc starting again from zero.
template <class V, int NR, int NT>
__attribute__((always_inline)) inline void int4_group_end(Int4Sums<V, NR, NT>& sums, const uint16_t* const* sc,
                                                          int64_t n_pad, const Act* x, int64_t g) {
  int32_t word[4] = {0, 0, 0, 0};
  for (int r = 0; r < NR; ++r) std::memcpy(&word[r], sc[r] + g * n_pad * 2, 4);
  const __m128i v = _mm_setr_epi32(word[0], word[1], word[2], word[3]);
  const __m128 scale = _mm_castsi128_ps(_mm_slli_epi32(v, 16));
  const __m128 zero = _mm_castsi128_ps(_mm_and_si128(v, _mm_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
  const __m128 minus8 = _mm_mul_ps(_mm_set1_ps(-8.f), scale);
  for (int t = 0; t < NT; ++t)
    sums.z[t] = _mm_fmadd_ps(minus8, _mm_set1_ps(x[t].gq[g]),
                             _mm_fmadd_ps(zero, _mm_set1_ps(x[t].gs[g]), sums.z[t]));
  alignas(16) float sf[4];
  _mm_store_ps(sf, scale);
  for (int r = 0; r < NR; ++r) {
    const typename V::F sv = V::fset(sf[r]);
    for (int t = 0; t < NT; ++t) {
      sums.acc[r][t] = V::ffma(sums.gacc[r][t], sv, sums.acc[r][t]);
      sums.gacc[r][t] = V::fzero();
    }
  }
}

template <class V, int NR, int NT>
__attribute__((always_inline)) inline void int4_start(Int4Sums<V, NR, NT>& sums) {
  for (int t = 0; t < NT; ++t) {
    sums.z[t] = _mm_setzero_ps();
    for (int r = 0; r < NR; ++r) sums.acc[r][t] = sums.gacc[r][t] = V::fzero();
  }
}

// s[r * NT + t] = row r's sum for token t (4 rows: one 4-way reduction a token).
template <class V, int NR, int NT>
__attribute__((always_inline)) inline void int4_finish(const Int4Sums<V, NR, NT>& sums, float* s) {
  for (int t = 0; t < NT; ++t) {
    alignas(16) float out[4];
    if constexpr (NR == 4) {
      const __m128 rows = V::fsum4(sums.acc[0][t], sums.acc[1][t], sums.acc[2][t], sums.acc[3][t]);
      _mm_store_ps(out, _mm_add_ps(rows, sums.z[t]));
    } else {
      _mm_store_ps(out, sums.z[t]);
      for (int r = 0; r < NR; ++r) out[r] += V::fsum(sums.acc[r][t]);
    }
    for (int r = 0; r < NR; ++r) s[r * NT + t] = out[r];
  }
}

// 256-bit: any K % 32 == 0 and G % 32 == 0 (a group may end in the middle of a 64-value chunk);
// PAIRED: G % 64 == 0, one activation scale a chunk.
template <int NR, int NT, bool PAIRED>
inline void dots_i4q8_256(const uint8_t* const* w, const uint16_t* const* sc, int64_t n_pad, const Act* x, int64_t K,
                          int64_t G, int64_t ahead, float* s) {
  using V = V256;
  Int4Sums<V, NR, NT> sums;
  int4_start(sums);
  auto& gacc = sums.gacc;
  int64_t g = 0, left = G;  // the current group, its values not yet read
  const int64_t K64 = K / 64 * 64;
  for (int64_t k = 0; k < K64; k += 64) {
    if ((k & 127) == 0)
      for (int r = 0; r < NR; ++r) __builtin_prefetch(w[r] + k / 2 + ahead, 0, kPrefetchL2);
    __m256i xa[NT], xb[NT];
    __m256 da[NT], db[NT];
    for (int t = 0; t < NT; ++t) {
      xa[t] = V::iload(x[t].q + k);
      xb[t] = V::iload(x[t].q + k + 32);
      da[t] = V::fload(x[t].d + k / 4);
      db[t] = V::fload(x[t].d + k / 4 + 8);
    }
    if constexpr (PAIRED) {
      for (int r = 0; r < NR; ++r) {
        const __m256i lo = V::nibbles_lo(w[r] + k / 2), hi = V::nibbles_hi(w[r] + k / 2);
        for (int t = 0; t < NT; ++t) gacc[r][t] = V::ffma(V::i2f(V::dp2(lo, xa[t], hi, xb[t])), da[t], gacc[r][t]);
      }
      if ((left -= 64) == 0) int4_group_end(sums, sc, n_pad, x, g++), left = G;
    } else {
      for (int r = 0; r < NR; ++r) {  // values k .. k + 31
        const __m256i u = V::nibbles_lo(w[r] + k / 2);
        for (int t = 0; t < NT; ++t) gacc[r][t] = V::ffma(V::i2f(V::dp(u, xa[t])), da[t], gacc[r][t]);
      }
      if ((left -= 32) == 0) int4_group_end(sums, sc, n_pad, x, g++), left = G;
      for (int r = 0; r < NR; ++r) {  // values k + 32 .. k + 63
        const __m256i u = V::nibbles_hi(w[r] + k / 2);
        for (int t = 0; t < NT; ++t) gacc[r][t] = V::ffma(V::i2f(V::dp(u, xb[t])), db[t], gacc[r][t]);
      }
      if ((left -= 32) == 0) int4_group_end(sums, sc, n_pad, x, g++), left = G;
    }
  }
  if (K64 < K) {  // the 32-value tail chunk (not PAIRED: K % G == 0), the end of the last group
    for (int r = 0; r < NR; ++r) {
      const __m256i u = V::nibbles32(w[r] + K64 / 2);
      for (int t = 0; t < NT; ++t)
        gacc[r][t] = V::ffma(V::i2f(V::dp(u, V::iload(x[t].q + K64))), V::fload(x[t].d + K64 / 4), gacc[r][t]);
    }
    int4_group_end(sums, sc, n_pad, x, g);
  }
  int4_finish(sums, s);
}

#if MT_ISA >= MT_AVX512
// 512-bit: K % 64 == 0 and G % 64 == 0 (one 64-value chunk per vector, in one group).
template <int NR, int NT>
inline void dots_i4q8_512(const uint8_t* const* w, const uint16_t* const* sc, int64_t n_pad, const Act* x, int64_t K,
                          int64_t G, int64_t ahead, float* s) {
  using V = V512;
  Int4Sums<V, NR, NT> sums;
  int4_start(sums);
  auto& gacc = sums.gacc;
  int64_t g = 0, left = G;
  for (int64_t k = 0; k < K; k += 64) {
    if ((k & 127) == 0)
      for (int r = 0; r < NR; ++r) __builtin_prefetch(w[r] + k / 2 + ahead, 0, kPrefetchL2);
    __m512i xv[NT];
    __m512 dv[NT];
    for (int t = 0; t < NT; ++t) {
      xv[t] = V::iload(x[t].q + k);
      dv[t] = V::fload(x[t].d + k / 4);  // the two halves' scales (one value: G % 64 == 0), 8 copies each
    }
    for (int r = 0; r < NR; ++r) {
      const __m512i u = V::nibbles(w[r] + k / 2);
      for (int t = 0; t < NT; ++t) gacc[r][t] = V::ffma(V::i2f(V::dp(u, xv[t])), dv[t], gacc[r][t]);
    }
    if ((left -= 64) == 0) int4_group_end(sums, sc, n_pad, x, g++), left = G;
  }
  int4_finish(sums, s);
}
#endif
#else
// int8 weights x q8 (A = int8_t: Act::q) or q16 (A = int16_t: Act::q16) activations, block by block.
template <typename A, int NR, int NT>
inline void dots_i8q_scalar(const int8_t* const* w, const Act* x, int64_t K, float* s) {
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) {
      const A* q;
      if constexpr (std::is_same_v<A, int16_t>) q = x[t].q16;
      else q = x[t].q;
      float acc = 0.f;
      for (int64_t b = 0; b < K / kQBlock; ++b) {
        int32_t is = 0;
        for (int64_t j = b * kQBlock; j < (b + 1) * kQBlock; ++j) is += int32_t(w[r][j]) * int32_t(q[j]);
        acc += float(is) * x[t].d[b * 8];
      }
      s[r * NT + t] = acc;
    }
}

// The value at column j of an int4 row in the native layout (64-value chunks, then a 32-value tail).
inline int32_t int4_at(const uint8_t* row, int64_t K, int64_t j) {
  const int64_t K64 = K / 64 * 64;
  if (j < K64) {
    const uint8_t b = row[j / 64 * 32 + j % 32];
    return j % 64 < 32 ? b & 15 : b >> 4;
  }
  const int64_t i = j - K64;
  const uint8_t b = row[K64 / 2 + i % 16];
  return i < 16 ? b & 15 : b >> 4;
}

template <int NR, int NT>
inline void dots_i4q8_scalar(const uint8_t* const* w, const uint16_t* const* sc, int64_t n_pad, const Act* x,
                             int64_t K, int64_t G, float* s) {
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) {
      float acc = 0.f, z = 0.f;
      for (int64_t g = 0; g < K / G; ++g) {
        const uint16_t* p = sc[r] + g * n_pad * 2;
        const float sg = bf16_to_f(p[0]), zg = bf16_to_f(p[1]);
        z += zg * x[t].gs[g] - 8.f * sg * x[t].gq[g];
        for (int64_t b = g * G / kQBlock; b < (g + 1) * G / kQBlock; ++b) {
          int32_t is = 0;
          for (int64_t j = b * kQBlock; j < (b + 1) * kQBlock; ++j) is += int4_at(w[r], K, j) * int32_t(x[t].q[j]);
          acc += float(is) * x[t].d[b * 8] * sg;
        }
      }
      s[r * NT + t] = acc + z;
    }
}
#endif

#if MT_ISA >= MT_AVX512BF16
// bf16 weights x bf16-rounded activations: vdpbf16ps, 32 products per instruction into 16 fp32 lanes.
template <int NR, int NT>
inline void dots_bf16dp(const uint16_t* const* w, const Act* x, int64_t K, int64_t ahead, float* s) {
  __m512 acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    if ((k & 31) == 0)
      for (int r = 0; r < NR; ++r) __builtin_prefetch(w[r] + k + ahead, 0, kPrefetchL2);
    __m512i xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = _mm512_loadu_si512(x[t].b + k);
    for (int r = 0; r < NR; ++r) {
      const __m512i wv = _mm512_loadu_si512(w[r] + k);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wv, (__m512bh)xv[t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) s[r * NT + t] = _mm512_reduce_add_ps(acc[r][t]);
}
#endif

template <Kind KD>
constexpr int max_tokens() {
#if MT_ISA >= MT_AVX512
  return 4;
#elif MT_ISA >= MT_AVX2
  return KD == Kind::I8Q8 || KD == Kind::I8Q16 || KD == Kind::I4Q8 ? 2 : kNT;
#else
  return kNT;
#endif
}

// The activations of a token from inner index off on (an int8 weight group's slice).
inline Act act_slice(const Act& a, int64_t off) {
  Act s = a;
  if (a.x) s.x = a.x + off;
  if (a.q) s.q = a.q + off;
  if (a.q16) s.q16 = a.q16 + off;
  if (a.d) s.d = a.d + off / 4;  // 8 copies of each block's scale: index k / 4
  return s;
}

template <Kind KD, int NR, int NT>
inline void tile_dots(const Mat& m, int64_t r, int64_t step, const Act* x, int64_t K, int64_t G, float* s);

// int8 weights with a scale per group of m.sg values: each group's slice as an unscaled product, then
// scaled and summed.
template <Kind KD, int NR, int NT>
inline void tile_dots_grouped(const Mat& m, int64_t r, int64_t step, const Act* x, int64_t K, float* s) {
  for (int i = 0; i < NR * NT; ++i) s[i] = 0.f;
  Mat part = m;
  part.sg = 0;
  part.sc16 = nullptr;
  part.sc32 = nullptr;
  Act xs[NT];
  float d[NR * NT];
  for (int64_t g = 0; g < K / m.sg; ++g) {
    for (int t = 0; t < NT; ++t) xs[t] = act_slice(x[t], g * m.sg);
    part.w = static_cast<const int8_t*>(m.w) + g * m.sg;
    tile_dots<KD, NR, NT>(part, r, step, xs, m.sg, 0, d);
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < NT; ++j) s[i * NT + j] += d[i * NT + j] * group_scale(m, r + i * step, g);
  }
}

// s[i * NT + j] = dot(row r + i step of m, token j), for NR rows and NT tokens: rows next to each other
// (step 1), each prefetched a tile ahead, or NR streams step rows apart, each prefetched a row ahead.
template <Kind KD, int NR, int NT>
inline void tile_dots(const Mat& m, int64_t r, int64_t step, const Act* x, int64_t K, int64_t G, float* s) {
  const int64_t ahead = step == 1 ? NR * m.ld : m.ld;  // elements of a row (int4: bytes) to prefetch ahead
  if constexpr (KD == Kind::I8F32 || KD == Kind::I8Q8 || KD == Kind::I8Q16) {
    if (m.sg) {
#if MT_ISA >= MT_AVX2
      const int shift = group_shift(m);
      if (KD != Kind::I8F32 && shift >= 0) {  // the group's scale applied per block, in the same pass
        const int8_t* w[NR];
        const float* gs[NR];
        for (int i = 0; i < NR; ++i) {
          w[i] = static_cast<const int8_t*>(m.w) + (r + i * step) * m.ld;
          gs[i] = group_scales(m, r + i * step);
        }
        if constexpr (KD == Kind::I8Q16) i8q16_dots<NR, NT, true>(w, x, K, ahead, s, gs, shift);
        else i8q8_dots<NR, NT, true>(w, x, K, ahead, s, gs, shift);
        return;
      }
#endif
      tile_dots_grouped<KD, NR, NT>(m, r, step, x, K, s);
      return;
    }
  }
  if constexpr (KD == Kind::Bf16F32 || KD == Kind::F16F32 || KD == Kind::I8F32) {
    using WT = std::conditional_t<KD == Kind::Bf16F32, Bf16T, std::conditional_t<KD == Kind::F16F32, F16T, I8T>>;
    using E = typename WT::elem;
    const E* w[NR];
    for (int i = 0; i < NR; ++i) w[i] = static_cast<const E*>(m.w) + (r + i * step) * m.ld;
#if MT_ISA >= MT_AVX2
    if constexpr (KD == Kind::Bf16F32 && NT <= 2)
      if (x[0].xs != nullptr) {  // prepared split: K % 32 == 0 (splits_rows)
        dots_bf16_split<NR, NT>(w, x, K, ahead, s);
        return;
      }
#endif
    dots_f32<WT, NR, NT>(w, x, K, ahead, s);
    if constexpr (KD == Kind::I8F32)
      for (int i = 0; i < NR; ++i)
        for (int j = 0; j < NT; ++j) s[i * NT + j] *= row_scale(m, r + i * step);
  } else if constexpr (KD == Kind::I8Q8 || KD == Kind::I8Q16) {
    const int8_t* w[NR];
    for (int i = 0; i < NR; ++i) w[i] = static_cast<const int8_t*>(m.w) + (r + i * step) * m.ld;
#if MT_ISA >= MT_AVX2
    if constexpr (KD == Kind::I8Q16) i8q16_dots<NR, NT>(w, x, K, ahead, s);
    else i8q8_dots<NR, NT>(w, x, K, ahead, s);
#else
    dots_i8q_scalar<std::conditional_t<KD == Kind::I8Q16, int16_t, int8_t>, NR, NT>(w, x, K, s);
#endif
    for (int i = 0; i < NR; ++i)
      for (int j = 0; j < NT; ++j) s[i * NT + j] *= row_scale(m, r + i * step);
  } else if constexpr (KD == Kind::I4Q8) {
    const uint8_t* w[NR];
    const uint16_t* sc[NR];
    for (int i = 0; i < NR; ++i) {
      w[i] = static_cast<const uint8_t*>(m.w) + (r + i * step) * m.ld;
      sc[i] = m.sc16 + (r + i * step) * 2;
    }
#if MT_ISA >= MT_AVX512
    if (G % 64 == 0) dots_i4q8_512<NR, NT>(w, sc, m.n_pad, x, K, G, ahead, s);  // K % G == 0
    else dots_i4q8_256<NR, NT, false>(w, sc, m.n_pad, x, K, G, ahead, s);
#elif MT_ISA >= MT_AVX2
    if (G % 64 == 0) dots_i4q8_256<NR, NT, true>(w, sc, m.n_pad, x, K, G, ahead, s);
    else dots_i4q8_256<NR, NT, false>(w, sc, m.n_pad, x, K, G, ahead, s);
#else
    dots_i4q8_scalar<NR, NT>(w, sc, m.n_pad, x, K, G, s);
#endif
  } else {
#if MT_ISA >= MT_AVX512BF16
    const uint16_t* w[NR];
    for (int i = 0; i < NR; ++i) w[i] = static_cast<const uint16_t*>(m.w) + (r + i * step) * m.ld;
    dots_bf16dp<NR, NT>(w, x, K, ahead, s);
#endif
  }
}

template <Kind KD, int NR, int NT, typename Sink>
inline void tile(const Mat& m, int64_t r, int64_t step, const Act* x, int64_t t, int64_t K, int64_t G, Sink& sink) {
  float s[NR * NT];
  tile_dots<KD, NR, NT>(m, r, step, x + t, K, G, s);
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NT; ++j) sink(r + i * step, t + j, s[i * NT + j]);
}

template <Kind KD, int NR, typename Sink>
inline void row_block(const Mat& m, int64_t r, int64_t step, const Act* x, int64_t t0, int64_t t1, int64_t K, int64_t G,
                      Sink& sink) {
  constexpr int NT = max_tokens<KD>();
  int64_t t = t0;
  for (; t + NT <= t1; t += NT) tile<KD, NR, NT>(m, r, step, x, t, K, G, sink);
  switch (t1 - t) {
    case 1: tile<KD, NR, 1>(m, r, step, x, t, K, G, sink); break;
    case 2: if constexpr (NT > 2) tile<KD, NR, 2>(m, r, step, x, t, K, G, sink); break;
    case 3: if constexpr (NT > 3) tile<KD, NR, 3>(m, r, step, x, t, K, G, sink); break;
    default: break;
  }
}

// sink(row, token, dot(row of m, token)) for rows [r0, r1) and n_tok tokens; tokens in blocks of 64
// so that a block's activations stay in cache while the rows stream past. Up to far_tiles register tiles of
// tokens the rows are read as far-apart streams (below).
// With a cursor the call reads the parts it claims from it (shared runs, above), as every other thread that
// calls it with the same cursor; rows not read as far streams are one part, read whole by its claimer.
template <Kind KD, typename Sink>
void rows_times_tokens(const Mat& m, int64_t r0, int64_t r1, const Act* x, int64_t n_tok, int64_t K, int64_t G,
                       Sink& sink, int far_tiles = 1, Cursor* cursor = nullptr) {
  // One tile of tokens (one token too): its 4 rows far apart, as 4 streams (in_streams). bf16dp read one token's
  // rows as one stream until 2026-12-04: 4 streams took a 32000 x 1024 product at one token from 23.2-23.4 to
  // 26.3 GB/s (2-core Xeon with AMX, 2 runs) and a batch-1 decode from 47.3 / 45.3 / 44.0 to 50.6 / 48.4 /
  // 46.2 tok/s (3 paired runs, medians of 3; the same tokens). At 2-3 tokens,
  // `kernel_ops_bench.py`, 5 rounds (3 at 3 tokens), bf16: lm head 19.0 -> 27.3 GB/s at 2 tokens, 19.5 ->
  // 23.2 at 3; projection 16.6 -> 20.4, 15.0 -> 18.3; int8 q8 at 2 tokens: projection 12.7 -> 14.9, the
  // rest unchanged. int4 too since 2026-12-04 (it had measured no faster on the AVX2 EPYC, MoE medium at 1
  // token 12.6 -> 11.8 GB/s): on the AMX Xeon, whose int4 products at 1-2 tokens take the 256-bit avx_vnni
  // variant, int4 experts' batch-1 decode ran 65.7 / 59.4 / 63.3 -> 67.9 / 68.2 / 70.3 tok/s (3 paired
  // runs, medians of 3, the same tokens); batch 32 299.9 / 313.2 -> 313.8 / 289.1 (no change). Nor more
  // tokens: at 4 and 8 tokens (several tiles a row block) far rows were slower (lm head 19.9 -> 17.5, 12.6 -> 10.2), but in the MoE's runs of an expert's rows
  // (moe_kind passes far_tiles = 2) they were faster: AVX2, far rows to 2 tiles, 3 rounds, MoE medium at
  // 32 tokens (about 4 an expert) bf16 20.7 -> 22.1 GB/s, int8 q8 12.7 -> 14.3, at 8 tokens no different;
  // lm head at 4 and 6 tokens 19.7 -> 16.4, 13.0 -> 11.0 again. int8 groups that are not powers of two
  // go group by group in the tiles, far rows or not.
  if (n_tok <= far_tiles * max_tokens<KD>()) {
    static_assert(kStreams == 4, "tiles of 4 rows");
    auto many = [&](int64_t r, int64_t h) { row_block<KD, 4>(m, r, h, x, 0, n_tok, K, G, sink); };
    auto one = [&](int64_t r) { row_block<KD, 1>(m, r, 1, x, 0, n_tok, K, G, sink); };
    const int64_t parts = stream_parts(r0, r1);
    if (cursor == nullptr)
      for (int64_t p = 0; p < parts; ++p) in_streams(r0, r1, p, many, one);
    else
      for (int64_t p = claim(cursor); p < parts; p = claim(cursor)) in_streams(r0, r1, p, many, one);
    return;
  }
  if (cursor != nullptr && claim(cursor) != 0) return;
  for (int64_t t0 = 0; t0 < n_tok; t0 += kTokBlock) {
    const int64_t t1 = std::min(n_tok, t0 + kTokBlock);
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) row_block<KD, 4>(m, r, 1, x, t0, t1, K, G, sink);
    for (; r < r1; ++r) row_block<KD, 1>(m, r, 1, x, t0, t1, K, G, sink);
  }
}

// f(i) for i in [0, n) on PyTorch's threads, handed out in chunks of `chunk` as threads free up: on a
// shared machine a thread that loses its core delays the call by one chunk, not by its whole half
// (a static split, as at::parallel_for makes, waits for the slowest thread's share).
template <typename F>
inline void parallel_chunks(int64_t n, int64_t chunk, const F& f) {
  const int nt = at::get_num_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt) if (nt > 1 && n > chunk)
  for (int64_t c = 0; c < (n + chunk - 1) / chunk; ++c) f(c * chunk, std::min(n, (c + 1) * chunk));
}

// parallel_chunks with shared runs: f(r0, r1, cursor) for each chunk, each chunk's cursor shared by the thread
// that took it and, once every chunk is taken, by the others, which join the chunks still being read (the
// last n_threads taken: one a thread at most).
template <typename F>
inline void parallel_shared_chunks(int64_t n, int64_t chunk, const F& f) {
  const int nt = at::get_num_threads();
  const int64_t n_chunks = (n + chunk - 1) / chunk;
  std::unique_ptr<Cursor[]> cursors(new Cursor[n_chunks]());
  Cursor next;
#pragma omp parallel num_threads(nt) if (nt > 1 && n > chunk)
  {
    for (int64_t c = claim(&next); c < n_chunks; c = claim(&next)) f(c * chunk, std::min(n, (c + 1) * chunk), &cursors[c]);
    for (int64_t c = n_chunks - 1; c >= std::max<int64_t>(0, n_chunks - omp_get_num_threads()); --c)
      f(c * chunk, std::min(n, (c + 1) * chunk), &cursors[c]);
  }
}

template <Kind KD>
void linear_kind(const Mat& m, int64_t N, int64_t K, int64_t G, const Act* x, int64_t T, const float* bias, float* y) {
  auto sink = [&](int64_t r, int64_t t, float v) { y[t * N + r] = v + (bias ? bias[r] : 0.f); };
  // One token: long runs for the streams (a 32000 x 1024 bf16 lm head, chunks of up to 256 -> 1024 rows,
  // 3 interleaved rounds: 26.0-26.7 -> 28.2-34.1 GB/s), shared at the end; the dynamic schedule balances the rest.
  if (T == 1) {
    const int64_t chunk = std::clamp<int64_t>(N / (4 * at::get_num_threads()), 64, 1024);
    parallel_shared_chunks(N, chunk, [&](int64_t r0, int64_t r1, Cursor* c) {
      rows_times_tokens<KD>(m, r0, r1, x, T, K, G, sink, 1, c);
    });
    return;
  }
  parallel_chunks(N, 64, [&](int64_t r0, int64_t r1) { rows_times_tokens<KD>(m, r0, r1, x, T, K, G, sink); });
}

// The routed experts of T tokens (routes grouped by expert):
//   phase 1: for each expert and block of its rows, gate and up products of its tokens -> act
//   phase 2: the down products of each expert's tokens, weighted by the gate and summed per token in
//            expert order: per run of an expert's down rows into a buffer per slot, then summed per block
//            of output rows; or per block of output rows over every expert in turn (moe_spans). A thread
//            owns the rows it writes: no races.
// op[token] += gate * y[slot] for every slot (y [P, H]: each slot's down product, unweighted): each output
// row sums its slots in expert order (the order of moe_kind's short items' sums: the same bits), on the
// threads where there are many.
inline void sum_slots(const Routes& R, const float* y, int64_t H, float* op) {
  const int64_t P = R.P;
  parallel_chunks(H, P * H >= (1 << 16) ? 128 : H, [&](int64_t r0, int64_t r1) {
    for (int64_t p = 0; p < P; ++p) {
      float* o = op + R.tok[p] * H;
      const float gp = R.gate[p], *yp = y + p * H;
      for (int64_t r = r0; r < r1; ++r) o[r] += gp * yp[r];
    }
  });
}

template <Kind KD>
void moe_kind(const MoeJob& j, float* op) {
  const Routes& R = *j.routes;
  const int64_t P = R.P, H = j.H, inter = j.inter, E = static_cast<int64_t>(j.w13.size()), G = j.G;
  std::vector<Act> xs(P);
  for (int64_t p = 0; p < P; ++p) xs[p] = j.hacts[R.tok[p]];
  const Scratch<float> act(kActivations, P * inter);
  const int n_threads = at::get_num_threads();
  const Spans sp = moe_spans(R, E, inter, H, n_threads);
  const std::vector<ExpertRows> items = expert_runs(R, E, inter, sp.work_up);  // short items: 32 rows
  const int64_t n_items = static_cast<int64_t>(items.size());
  auto gate_up = [&](const ExpertRows& item) {  // an item of phase 1: its rows' gate and up products -> act
    const int64_t p0 = R.offset[item.e], n = R.offset[item.e + 1] - p0, rows = item.r1 - item.r0;
    const Scratch<float> g(kGateRows, rows * n), u(kUpRows, rows * n);
    auto gate_sink = [&](int64_t r, int64_t t, float v) { g[(r - item.r0) * n + t] = v; };
    rows_times_tokens<KD>(j.w13[item.e], item.r0, item.r1, xs.data() + p0, n, H, G, gate_sink, 2);
    auto up_sink = [&](int64_t r, int64_t t, float v) { u[(r - inter - item.r0) * n + t] = v; };
    rows_times_tokens<KD>(j.w13[item.e], inter + item.r0, inter + item.r1, xs.data() + p0, n, H, G, up_sink, 2);
    store_act(g.data(), u.data(), item.r0, rows, n, inter, act.data() + p0 * inter);
  };
  Prepared as;
  if (sp.runs) {
    // Runs of one expert's rows in both phases, in one parallel region: a thread goes on from the gate and up
    // items to the down items (each slot's product kept apart, Spans) without waiting for the other threads;
    // a down item waits only for its own expert's gate and up rows, whose last item prepares its activations.
    const std::vector<ExpertRows> down = expert_runs(R, E, H, sp.work_down);
    const int64_t n_down = static_cast<int64_t>(down.size());
    prepare_buffers(act.data(), P, inter, KD, G, as);
    std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[E]);  // gate/up items not done
    for (int64_t e = 0; e < E; ++e) left[e].store(0, std::memory_order_relaxed);
    for (const ExpertRows& item : items) left[item.e].fetch_add(1, std::memory_order_relaxed);
    const Scratch<float> y(kSlotOutputs, P * H);  // each slot's down product, unweighted
    // The down items' rows are shared runs: a thread with no item left joins the ones still being read.
    std::unique_ptr<Cursor[]> parts(new Cursor[n_down]());
    auto down_item = [&](int64_t d) {
      const ExpertRows& item = down[d];
      while (left[item.e].load(std::memory_order_acquire) != -1) spin_pause();
      const int64_t p0 = R.offset[item.e], n = R.offset[item.e + 1] - p0;
      auto sink = [&](int64_t r, int64_t t, float v) { y[(p0 + t) * H + r] = v; };
      rows_times_tokens<KD>(j.w2[item.e], item.r0, item.r1, as.acts.data() + p0, n, inter, G, sink, 2, &parts[d]);
    };
    Cursor next;
#pragma omp parallel num_threads(n_threads) if (n_threads > 1 && n_items + n_down > 1)
    {
      for (int64_t it = claim(&next); it < n_items + n_down; it = claim(&next)) {
        if (it >= n_items) {
          down_item(it - n_items);
          continue;
        }
        const ExpertRows& item = items[it];
        gate_up(item);
        if (left[item.e].fetch_sub(1, std::memory_order_acq_rel) == 1) {
          const int64_t p0 = R.offset[item.e];
          prepare_rows(act.data(), p0, R.offset[item.e + 1], inter, KD, G, as);
          left[item.e].store(-1, std::memory_order_release);  // -1: the expert's activations are ready
        }
      }
      for (int64_t d = n_down - 1; d >= std::max<int64_t>(0, n_down - omp_get_num_threads()); --d) down_item(d);
    }
    sum_slots(R, y.data(), H, op);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads) if (n_threads > 1 && n_items > 1)
  for (int64_t it = 0; it < n_items; ++it) gate_up(items[it]);
  prepare(act.data(), P, inter, KD, G, as);
  parallel_chunks(H, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t e = 0; e < E; ++e) {
      const int64_t p0 = R.offset[e], n = R.offset[e + 1] - p0;
      if (n == 0) continue;
      auto sink = [&](int64_t r, int64_t t, float v) { op[R.tok[p0 + t] * H + r] += R.gate[p0 + t] * v; };
      rows_times_tokens<KD>(j.w2[e], r0, r1, as.acts.data() + p0, n, inter, G, sink);
    }
  });
}


// ---- decode attention: one (sequence, KV head) of decode_attention, the query heads of its group
// against cached rows [lo, len) of K and V (fp32, or bf16 widened exactly). `attend` hands out the kernel for
// a head size, or nullptr where this variant has none: its fallback's, else the scalar loop in
// decode_attention_impl, serves it.
#if MT_ISA == MT_AVX2 || MT_ISA == MT_AVX512
// [p, p + bytes) into L2 (prefetcht1), a line at a time. An asm statement, not _mm_prefetch: GCC deletes a
// loop whose body is nothing but __builtin_prefetch (a hint it need not keep), and -O3 did so here: until
// 2026-12-05 every such loop in attend_rows but its first compiled to nothing (objdump: one prefetcht1 in
// each variant's attend_rows), so the blocks' prefetches below never ran. tests/engine/test_kernels.py
// counts them in the built library.
inline void prefetch_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) __asm__ volatile("prefetcht1 %0" : : "m"(c[i]));
}

// The cache rows come from memory (a batch-32 step reads the weights' 1.5 GB between two reads of a
// layer's cache), 4 KiB pages of a few positions each, where the prefetchers stop: each row is prefetched
// into L2 kAttendLead bytes before it is read, the keys in the scores' pass (a block's worth at a time) and
// the values in the outputs' pass (a row at a time), so that the prefetches go out as fast as the rows are
// read and the reads never wait on a burst of them.
//
// History (AMX Xeon, medium preset, 2 threads, 16 layers, fp32 cache; the attention phase of
// scripts/decode_profile.py --phases, ms a step):
// - Until 2026-12-05 the prefetch loops but the first compiled to nothing (prefetch_l2): the keys 32
//   positions ahead and each block's values during the scores, then whole items (an item's keys and values
//   all prefetched at its start where they fit 512 KiB): batch 32 12.30 / 10.47 / 10.11 over 3 rounds
//   (nothing / the blocks / whole items), batch 1 (2 rounds) 0.83 / 0.69 / 0.72, 0.80 / 0.70 / 0.73.
// - The lead (2026-12-06): whole items and the values prefetched with the keys against a 4 KiB lead for
//   each, the values in their own pass. Batch 1, about 230-330 positions, 3 alternated rounds: 0.591 / 0.564
//   / 0.569 -> 0.492 / 0.528 / 0.487, and again 0.580 / 0.588 / 0.595 -> 0.513 / 0.537 / 0.499; batch 32,
//   about 160-190 positions, 2 rounds: 9.53 / 9.70 -> 8.73 / 8.88. Leads of 2 KiB (0.53-0.55 ms at batch
//   1), 8 KiB (0.52-0.55) or 6 KiB (0.51-0.57) were no better; the values 3 KiB ahead measured as 4 KiB.
//   Keys and values split into 2 or 4 streams read in turn (the products' far streams): no faster. This
//   code against the code before, 3 more alternated rounds at batch 1: fp32 0.603 / 0.585 / 0.587 -> 0.520
//   / 0.513 / 0.549, a bf16 cache 0.468 / 0.503 / 0.459 -> 0.449 / 0.391 / 0.393. The AVX2 kernel (forced,
//   decode_attention alone, 16 layers from memory, medians of 15, 3 rounds): batch 1 at 300 positions 0.71-
//   0.80 -> 0.68-0.73 ms, batch 32 at 160 9.8-10.2 -> 9.8-10.1 (its values' pass is a head at a time).
constexpr int64_t kAttendLead = 4 << 10;  // bytes
// Rows of `row` bytes kAttendLead covers (at least one).
inline int64_t lead_rows(int64_t row) { return std::max<int64_t>(1, kAttendLead / row); }

// An item's first prefetches, its first keys and values kAttendLead deep; returns the lead in rows.
template <typename C>
inline int64_t prefetch_start(const C* K, const C* V, int64_t lo, int64_t n, int64_t d) {
  const int64_t row = d * static_cast<int64_t>(sizeof(C)), ahead = lead_rows(row);
  prefetch_l2(K + lo * d, std::min(ahead, n) * row);
  prefetch_l2(V + lo * d, std::min(ahead, n) * row);
  return ahead;
}

// The keys' prefetch of the block of `lanes` positions from j0: the block `ahead` rows on, up to len.
template <typename C>
inline void prefetch_keys(const C* K, int64_t j0, int64_t lanes, int64_t ahead, int64_t len, int64_t d) {
  if (j0 + ahead < len)
    prefetch_l2(K + (j0 + ahead) * d, std::min(lanes, len - j0 - ahead) * d * static_cast<int64_t>(sizeof(C)));
}

// The largest of x[0:n], 8 or 16 lanes at a time (std::max_element's compare chain was a fifth of an
// item's time, from L2).
inline float max_of(const float* x, int64_t n) {
  int64_t i = 0;
#if MT_ISA == MT_AVX512
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
  float mx = _mm512_reduce_max_ps(m);
#else
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  alignas(32) float l[8];
  _mm256_store_ps(l, m);
  float mx = *std::max_element(l, l + 8);
#endif
  for (; i < n; ++i) mx = std::max(mx, x[i]);
  return mx;
}

// The softmax of each head's scores w[h * n + j], in place; with `inv`, the exponentials alone, each head's
// 1 / sum in inv[h] (the caller scales the outputs instead of the n weights).
inline void softmax_rows(float* w, int64_t group, int64_t n, float* inv = nullptr) {
  for (int64_t h = 0; h < group; ++h) {
    float* wh = w + h * n;
    const float mx = max_of(wh, n);
    const float r = 1.f / exp_shifted(wh, n, mx);
    if (inv) inv[h] = r;
    else for (int64_t j = 0; j < n; ++j) wh[j] *= r;
  }
}
#endif

#if MT_ISA == MT_AVX512
// Sixteen fp32 lanes of cached keys or values (bf16: widened exactly).
inline __m512 cache16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 cache16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// The lanes of mask m alone (the 8 columns left where d % 16 == 8), the others 0.
inline __m512 cache16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 cache16(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Lane m = the sum of a[m]'s sixteen lanes: a transpose as a tree of adds (45 shuffles and adds for 16
// sums, against 4 reductions' worth a sum).
inline __m512 lane_sums16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // b[i], each 128-bit lane: (a[2i], a[2i+1], a[2i], a[2i+1]) partial sums
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // c[i], each 128-bit lane: a[4i .. 4i+3]'s sums over that lane
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// o[h][0:16 NV] = inv[h] x the sum over j < n of p[h][j] V[j d + 0:16 NV] for NH heads (p: head h's
// weights at p + h * ldp, o: head h's output at o + h * d): each row of V read once for the heads, NH x NV
// accumulators, added in row order. The last vector's columns are those of mask `last`.
// With `ahead`, row j + ahead of V (whole rows of d values: the first pass over the rows) is prefetched as row j is read.
// With `add`, the sums go on from what o holds (a part of the rows at a time); with inv null, unscaled.
template <int NH, int NV, typename C>
inline void weighted_rows16(const float* p, int64_t ldp, const C* V, int64_t n, int64_t d, const float* inv,
                            float* o, __mmask16 last, int64_t ahead, bool add = false) {
  __m512 acc[NH][NV];
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < NV; ++v)
      acc[h][v] = add ? _mm512_maskz_loadu_ps(v == NV - 1 ? last : 0xFFFF, o + h * d + 16 * v) : _mm512_setzero_ps();
  const int64_t row = d * static_cast<int64_t>(sizeof(C));
  for (int64_t j = 0; j < n; ++j) {
    if (ahead && j + ahead < n) prefetch_l2(V + (j + ahead) * d, row);
    __m512 vj[NV];
    for (int v = 0; v < NV - 1; ++v) vj[v] = cache16(V + j * d + 16 * v);
    vj[NV - 1] = last == 0xFFFF ? cache16(V + j * d + 16 * (NV - 1)) : cache16(V + j * d + 16 * (NV - 1), last);
    for (int h = 0; h < NH; ++h) {
      const __m512 pj = _mm512_set1_ps(p[h * ldp + j]);
      for (int v = 0; v < NV; ++v) acc[h][v] = _mm512_fmadd_ps(pj, vj[v], acc[h][v]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int v = 0; v < NV; ++v)
      _mm512_mask_storeu_ps(o + h * d + 16 * v, v == NV - 1 ? last : 0xFFFF,
                            inv ? _mm512_mul_ps(acc[h][v], _mm512_set1_ps(inv[h])) : acc[h][v]);
}

// Columns [c, c + 16 NV) of the outputs of every head (the last vector's: mask `last`), 4 heads at a time,
// over n rows of V (head h's weights at w + h * ldw); the first columns' first heads prefetch the rows `ahead`
// on (the pass that reads them from memory).
template <int NV, typename C>
inline void weighted_heads16(const float* w, int64_t ldw, int64_t n, const C* V, int64_t d, int64_t c, int64_t group,
                             const float* inv, float* og, int64_t ahead, __mmask16 last, bool add) {
  constexpr int NH = 4;  // at most 16 accumulators
  int64_t h = 0;
  auto at = [&](int64_t i) { return inv ? inv + i : nullptr; };
  for (; h + NH <= group; h += NH)
    weighted_rows16<NH, NV>(w + h * ldw, ldw, V + c, n, d, at(h), og + h * d + c, last, c == 0 && h == 0 ? ahead : 0,
                            add);
  for (; h < group; ++h)
    weighted_rows16<1, NV>(w + h * ldw, ldw, V + c, n, d, at(h), og + h * d + c, last, c == 0 && h == 0 ? ahead : 0,
                           add);
}

// Every column of the outputs og [group, d] of one query's heads (64 columns at a time, then 32, 16, 8) over
// n rows of V; `add` and a null inv as weighted_rows16 takes them.
template <typename C>
inline void weighted_outputs16(const float* w, int64_t ldw, int64_t n, const C* V, int64_t d, int64_t group,
                               const float* inv, float* og, int64_t ahead, bool add = false) {
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) weighted_heads16<4>(w, ldw, n, V, d, c, group, inv, og, ahead, 0xFFFF, add);
  if (c + 32 <= d) weighted_heads16<2>(w, ldw, n, V, d, c, group, inv, og, ahead, 0xFFFF, add), c += 32;
  if (c + 16 <= d) weighted_heads16<1>(w, ldw, n, V, d, c, group, inv, og, ahead, 0xFFFF, add), c += 16;
  if (c < d) weighted_heads16<1>(w, ldw, n, V, d, c, group, inv, og, ahead, 0xFF, add);
}

// Scores of 16 positions at a time (16 accumulators, summed together by lane_sums16), the softmax, then
// the outputs, each row of V read once for 4 heads, scaled by the softmax's 1 / sum at the end. Against the
// AVX2 kernel on the AMX Xeon (4 heads a KV head, d = 64, 160 positions, fp32, 16 layers, 2 threads, ms):
// batch 4 from L2 0.61 -> 0.47, batch 32 from memory 10.2 -> 8.8; in a batch-32 decode step 9.7 -> 9.5.
template <typename C>
void attend_rows(const float* qg, const C* K, const C* V, int64_t group, int64_t d, int64_t lo, int64_t len,
                 float sc, float* og, float* w) {
  const int64_t n = len - lo, ahead = prefetch_start(K, V, lo, n, d);
  for (int64_t j0 = lo; j0 < len; j0 += 16) {
    prefetch_keys(K, j0, 16, ahead, len, d);
    const C* kr[16];
    for (int64_t jj = 0; jj < 16; ++jj) kr[jj] = K + std::min(j0 + jj, len - 1) * d;  // past len: repeats
    const __mmask16 live = static_cast<__mmask16>((1u << std::min<int64_t>(16, len - j0)) - 1);
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = qg + h * d;
      __m512 acc[16];
      for (int jj = 0; jj < 16; ++jj) acc[jj] = _mm512_setzero_ps();
      int64_t c = 0;
      for (; c + 16 <= d; c += 16) {
        const __m512 qv = _mm512_loadu_ps(qh + c);
        for (int jj = 0; jj < 16; ++jj) acc[jj] = _mm512_fmadd_ps(qv, cache16(kr[jj] + c), acc[jj]);
      }
      if (c < d) {  // d % 16 == 8
        const __m512 qv = _mm512_maskz_loadu_ps(0xFF, qh + c);
        for (int jj = 0; jj < 16; ++jj) acc[jj] = _mm512_fmadd_ps(qv, cache16(kr[jj] + c, 0xFF), acc[jj]);
      }
      _mm512_mask_storeu_ps(w + h * n + (j0 - lo), live, _mm512_mul_ps(lane_sums16(acc), _mm512_set1_ps(sc)));
    }
  }
  float* inv = w + group * n;  // each head's 1 / sum of its exponentials
  softmax_rows(w, group, n, inv);
  weighted_outputs16(w, n, n, V + lo * d, d, group, inv, og, ahead);
}

#elif MT_ISA == MT_AVX2
// Eight fp32 lanes of cached keys or values (bf16: widened exactly).
inline __m256 cache8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 cache8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Lane m = the sum of a[m]'s eight lanes.
inline __m256 lane_sums8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// o[0:8 NV] = sum over j < n of p[j] V[j d + 0:8 NV]: NV independent accumulators, one FMA each per row,
// added in row order (the order the scalar loop adds in).
// With `ahead`, row j + ahead of V (whole rows: the first pass over them) is prefetched as row j is read.
// With `add`, the sums go on from what o holds (a part of the rows at a time).
template <int NV, typename C>
inline void weighted_rows(const float* p, const C* V, int64_t n, int64_t d, float* o, int64_t ahead, bool add) {
  __m256 acc[NV];
  for (int v = 0; v < NV; ++v) acc[v] = add ? _mm256_loadu_ps(o + 8 * v) : _mm256_setzero_ps();
  const int64_t row = d * static_cast<int64_t>(sizeof(C));
  for (int64_t j = 0; j < n; ++j) {
    if (ahead && j + ahead < n) prefetch_l2(V + (j + ahead) * d, row);
    const __m256 pj = _mm256_set1_ps(p[j]);
    const C* vj = V + j * d;
    for (int v = 0; v < NV; ++v) acc[v] = _mm256_fmadd_ps(pj, cache8(vj + 8 * v), acc[v]);
  }
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(o + 8 * v, acc[v]);
}

// Every column of the outputs og [group, d] of one query's heads (d % 8 == 0; 64 columns at a time, then 32,
// 16, 8), head by head, over n rows of V (head h's weights at w + h * ldw); the first head's first columns
// prefetch the rows `ahead` on (the pass that reads them from memory); `add` as weighted_rows takes it.
template <typename C>
inline void weighted_outputs8(const float* w, int64_t ldw, int64_t n, const C* V, int64_t d, int64_t group, float* og,
                              int64_t ahead, bool add = false) {
  for (int64_t h = 0; h < group; ++h) {
    const float* p = w + h * ldw;
    float* oh = og + h * d;
    int64_t c = 0;
    const int64_t first = h == 0 ? ahead : 0;
    for (; c + 64 <= d; c += 64) weighted_rows<8>(p, V + c, n, d, oh + c, c == 0 ? first : 0, add);
    if (c + 32 <= d) weighted_rows<4>(p, V + c, n, d, oh + c, c == 0 ? first : 0, add), c += 32;
    if (c + 16 <= d) weighted_rows<2>(p, V + c, n, d, oh + c, c == 0 ? first : 0, add), c += 16;
    if (c + 8 <= d) weighted_rows<1>(p, V + c, n, d, oh + c, c == 0 ? first : 0, add);
  }
}

// One (sequence, KV head) of decode attention, d % 8 == 0: scores of 8 positions at a time, 8 independent
// accumulators (one per position, reduced together by lane_sums8); then the softmax; then each head's
// output in chunks of up to 64 lanes, accumulated in registers across the positions. The scalar loop
// (decode_attention_impl) chains one accumulator per dot product, bound by the FMA latency: medium preset
// (4 heads a KV head, d = 64, 200 positions), one core of a 2-core AMD EPYC (AVX2): 13-20 -> 7-9 us an item.
template <typename C>
void attend_rows(const float* qg, const C* K, const C* V, int64_t group, int64_t d, int64_t lo, int64_t len,
                 float sc, float* og, float* w) {
  const int64_t n = len - lo, ahead = prefetch_start(K, V, lo, n, d);
  for (int64_t j0 = lo; j0 < len; j0 += 8) {
    prefetch_keys(K, j0, 8, ahead, len, d);
    const C* kr[8];
    for (int64_t jj = 0; jj < 8; ++jj) kr[jj] = K + std::min(j0 + jj, len - 1) * d;  // past len: repeats
    const int64_t nb = std::min<int64_t>(8, len - j0);
    for (int64_t h = 0; h < group; ++h) {
      const float* qh = qg + h * d;
      __m256 acc[8];
      for (int jj = 0; jj < 8; ++jj) acc[jj] = _mm256_setzero_ps();
      for (int64_t c = 0; c < d; c += 8) {
        const __m256 qv = _mm256_loadu_ps(qh + c);
        for (int jj = 0; jj < 8; ++jj) acc[jj] = _mm256_fmadd_ps(qv, cache8(kr[jj] + c), acc[jj]);
      }
      float s[8];
      _mm256_storeu_ps(s, _mm256_mul_ps(lane_sums8(acc), _mm256_set1_ps(sc)));
      std::copy(s, s + nb, w + h * n + (j0 - lo));
    }
  }
  softmax_rows(w, group, n);
  weighted_outputs8(w, n, n, V + lo * d, d, group, og, ahead);
}

#endif

#if MT_ISA == MT_AVX2 || MT_ISA == MT_AVX512
template <typename C>
void attend_kernel(const float* qg, const void* K, const void* V, int64_t group, int64_t d, int64_t lo, int64_t len,
                   float sc, float* og, float* w) {
  attend_rows(qg, static_cast<const C*>(K), static_cast<const C*>(V), group, d, lo, len, sc, og, w);
}

AttendKernel attend(int64_t d, bool bf16) {  // both kernels take 8 lanes at a time at least
  if (d % 8) return nullptr;
  return bf16 ? &attend_kernel<uint16_t> : &attend_kernel<float>;
}
#else
AttendKernel attend(int64_t, bool) { return nullptr; }
#endif

// ---- prefill attention: one item of prefill_attention, a block of m query tokens (positions p0 .. p0 + m - 1,
// q's rows ldq apart, the group's heads d apart in a row) of one KV head against its keys, transposed (kt:
// kt[c * ldk + j] = dimension c of the key at position k0 + j, zeros past the segment's last key) and its
// values V (fp32, from position k0 on: a bf16 cache's widened once), each token's keys up to its own position
// (and from `window` back), into o (laid out as q); w: scratch of m * group * (round_up(n, 32) + 1) floats, n =
// the item's keys.
// Attending token by token as decode does (each row's dot products reduced by lane_sums16) ran a 128-token
// prompt of the medium preset (16 heads, 4 KV heads, d = 64) in 362 us a layer against PyTorch's flash
// kernel's 461 (2 threads, AMX Xeon): the scores here are 8 query rows x 32 keys of register accumulators, a
// broadcast of a query value against two vectors of transposed keys, nothing to reduce. This kernel, the same
// prompt (the call against what the per-op path ran before it: index writes, the flash kernel, the copy out;
// medians of 30): 417 -> 192 us, a bf16 cache 464 -> 198, 512 tokens 4543 -> 2302, 2048 tokens 42875 ->
// 35727 (every row's scores held whole: 512 KiB an item, past the L2), 128 tokens after 384 1566 -> 978.
// The AVX2 kernel, the same driver with 8-lane parts (the same machine's AVX2 variant, set_isa, medians of 30,
// 3 runs; token by token as decode attends before it): 128 tokens 442-458 -> 305-377 us, 512 tokens 7063-7179
// -> 4001-4131, 2048 tokens 109465-112427 -> 59142-63850, 128 after 384 2962-2987 -> 1721-1778.
#if MT_ISA == MT_AVX512
constexpr int kScoreRows = 8;  // query rows a scores32 call takes: 16 accumulators

// s[r * lds + 0:32] = sc x the dots of query rows qr[r] (R of them) with 32 transposed keys at kt.
template <int R>
inline void scores32(const float* const* qr, const float* kt, int64_t ldk, int64_t d, float sc, float* s,
                     int64_t lds) {
  __m512 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; ++c) {
    const __m512 k0 = _mm512_loadu_ps(kt + c * ldk), k1 = _mm512_loadu_ps(kt + c * ldk + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 qv = _mm512_set1_ps(qr[r][c]);
      a[r][0] = _mm512_fmadd_ps(qv, k0, a[r][0]);
      a[r][1] = _mm512_fmadd_ps(qv, k1, a[r][1]);
    }
  }
  const __m512 vs = _mm512_set1_ps(sc);
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * lds, _mm512_mul_ps(a[r][0], vs));
    _mm512_storeu_ps(s + r * lds + 16, _mm512_mul_ps(a[r][1], vs));
  }
}

// One row's softmax over its keys [a, b) of s, in place: the exponentials (shifted by their max), zeros before a
// (read by the outputs; nothing past b is), 16 lanes at a time; returns 1 / their sum. exp_shifted's scalar tail
// (a row of 1 .. 128 keys: 7.5 of them on average) was a third of a 128-token prompt's attention on one thread,
// 181 of 578 us.
inline float softmax_span(float* s, int64_t a, int64_t b) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  auto live = [&](int64_t j) {  // lanes j .. j + 15 within [a, b)
    const __m512i at = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(j)));
    return static_cast<__mmask16>(_mm512_cmpge_epi32_mask(at, _mm512_set1_epi32(static_cast<int>(a))) &
                                  _mm512_cmplt_epi32_mask(at, _mm512_set1_epi32(static_cast<int>(b))));
  };
  const int64_t j0 = a / 16 * 16;
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t j = j0; j < b; j += 16) mx = _mm512_mask_max_ps(mx, live(j), mx, _mm512_loadu_ps(s + j));
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < j0; j += 16) _mm512_storeu_ps(s + j, _mm512_setzero_ps());
  for (int64_t j = j0; j < b; j += 16) {
    const __m512 e = _mm512_maskz_mov_ps(live(j), exp_lanes(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift)));
    _mm512_storeu_ps(s + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// One token's outputs o [group, d] summed on over n more rows of V (weights w, head h's at w + h * ldw).
inline void prefill_outputs(const float* w, int64_t ldw, int64_t n, const float* V, int64_t d, int64_t group,
                            float* o, bool add) {
  weighted_outputs16(w, ldw, n, V, d, group, nullptr, o, 0, add);
}

#elif MT_ISA == MT_AVX2
constexpr int kScoreRows = 6;  // query rows a scores32 call takes: 12 accumulators of the 16 registers

// s[r * lds + 0:16] = sc x the dots of query rows qr[r] (R of them) with 16 transposed keys at kt.
template <int R>
inline void scores16(const float* const* qr, const float* kt, int64_t ldk, int64_t d, float sc, float* s,
                     int64_t lds) {
  __m256 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; ++c) {
    const __m256 k0 = _mm256_loadu_ps(kt + c * ldk), k1 = _mm256_loadu_ps(kt + c * ldk + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 qv = _mm256_broadcast_ss(qr[r] + c);
      a[r][0] = _mm256_fmadd_ps(qv, k0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(qv, k1, a[r][1]);
    }
  }
  const __m256 vs = _mm256_set1_ps(sc);
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(s + r * lds, _mm256_mul_ps(a[r][0], vs));
    _mm256_storeu_ps(s + r * lds + 8, _mm256_mul_ps(a[r][1], vs));
  }
}

// As AVX-512's: 32 keys, as two halves of 16 (the 16 registers hold 6 rows x 16 keys).
template <int R>
inline void scores32(const float* const* qr, const float* kt, int64_t ldk, int64_t d, float sc, float* s,
                     int64_t lds) {
  scores16<R>(qr, kt, ldk, d, sc, s, lds);
  scores16<R>(qr, kt + 16, ldk, d, sc, s + 16, lds);
}

// As AVX-512's, 8 lanes at a time.
inline float softmax_span(float* s, int64_t a, int64_t b) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i va = _mm256_set1_epi32(static_cast<int>(a) - 1), vb = _mm256_set1_epi32(static_cast<int>(b));
  auto live = [&](int64_t j) {  // lanes j .. j + 7 within [a, b): all ones, else zeros
    const __m256i at = _mm256_add_epi32(lane, _mm256_set1_epi32(static_cast<int>(j)));
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(at, va), _mm256_cmpgt_epi32(vb, at)));
  };
  const int64_t j0 = a / 8 * 8;
  const __m256 lowest = _mm256_set1_ps(-INFINITY);
  __m256 mx = lowest;
  for (int64_t j = j0; j < b; j += 8)
    mx = _mm256_max_ps(mx, _mm256_blendv_ps(lowest, _mm256_loadu_ps(s + j), live(j)));
  alignas(32) float l[8];
  _mm256_store_ps(l, mx);
  const __m256 shift = _mm256_set1_ps(*std::max_element(l, l + 8));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < j0; j += 8) _mm256_storeu_ps(s + j, _mm256_setzero_ps());
  for (int64_t j = j0; j < b; j += 8) {
    const __m256 e = _mm256_and_ps(live(j), exp_lanes(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift)));
    _mm256_storeu_ps(s + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  _mm256_store_ps(l, sum);
  float total = 0.f;
  for (float x : l) total += x;
  return 1.f / total;
}

inline void prefill_outputs(const float* w, int64_t ldw, int64_t n, const float* V, int64_t d, int64_t group,
                            float* o, bool add) {
  weighted_outputs8(w, ldw, n, V, d, group, o, 0, add);
}
#endif

#if MT_ISA == MT_AVX512 || MT_ISA == MT_AVX2
// Flattened: every part inlined. GCC left weighted_rows16<4, 4> out of line once the outputs went through
// prefill_outputs, and the kernel ran 1.5x slower (2048 tokens 36.8-38.3 -> 55.6-59.9 ms).
__attribute__((flatten)) void prefill_rows(const float* q, int64_t ldq, const float* kt, int64_t ldk, int64_t k0,
                                          const float* V, int64_t group, int64_t d, int64_t m, int64_t p0,
                                          int64_t window, float sc, float* o, float* w) {
  const int64_t lo = window > 0 ? std::max(k0, p0 + 1 - window) : k0, n = p0 + m - lo;
  const int64_t lds = (n + 31) / 32 * 32, rows = m * group;
  float* inv = w + rows * lds;
  const float* qr[kScoreRows];
  auto row = [&](int64_t r) { return q + (r / group) * ldq + (r % group) * d; };
  for (int64_t j = 0; j < lds; j += 32) {
    const float* kj = kt + (lo - k0) + j;
    int64_t r = 0;
    for (; r + kScoreRows <= rows; r += kScoreRows) {
      for (int i = 0; i < kScoreRows; ++i) qr[i] = row(r + i);
      scores32<kScoreRows>(qr, kj, ldk, d, sc, w + r * lds + j, lds);
    }
    for (; r < rows; ++r) {
      qr[0] = row(r);
      scores32<1>(qr, kj, ldk, d, sc, w + r * lds + j, lds);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // each row's softmax over its own keys
    const int64_t pos = p0 + r / group;
    const int64_t a = window > 0 ? std::max(lo, pos + 1 - window) - lo : 0;
    inv[r] = softmax_span(w + r * lds, a, pos + 1 - lo);
  }
  // The outputs, 32 keys at a time (their values stay in L1 while every token's rows pass over them), each token
  // up to its own key, then scaled by 1 / sum. A token at a time over all its keys (a row of V from L2 for 4
  // heads' 16 FMAs) measured slower on AVX-512, in the same hour: the 128-token prompt 207 against 262 us, 2048
  // tokens 35073 against 53605.
  const float* Vlo = V + (lo - k0) * d;
  for (int64_t j0 = 0; j0 < n; j0 += 32)
    for (int64_t t = 0; t < m; ++t) {
      const int64_t nj = std::min<int64_t>(32, p0 + t + 1 - lo - j0);
      if (nj > 0) prefill_outputs(w + t * group * lds + j0, lds, nj, Vlo + j0 * d, d, group, o + t * ldq, j0 > 0);
    }
  for (int64_t t = 0; t < m; ++t)
    for (int64_t h = 0; h < group; ++h) {
      float* oh = o + t * ldq + h * d;
      const float r = inv[t * group + h];
      for (int64_t c = 0; c < d; ++c) oh[c] *= r;
    }
}

PrefillKernel prefill(int64_t d) { return d % 8 ? nullptr : &prefill_rows; }  // 8 lanes at a time at least
#else
PrefillKernel prefill(int64_t) { return nullptr; }
#endif

#if MT_ISA == MT_AMX
// ---- tile mode (AMX). The bf16 weights are the A tiles, loaded straight from their rows (16 rows x
// 32 values: one 64-byte line of each row); the tokens' activations, rounded to bf16, are the B tiles,
// packed per call in pairs of inner values (16 pairs x up to 16 tokens); tdpbf16ps accumulates fp32
// C tiles of 16 rows x up to 16 tokens. Each weight line is read once per 32 tokens, and one
// tdpbf16ps does 8192 products: at the token counts experts see in decode the products are bound by
// the weights' bytes, not by arithmetic, as they are on the vector paths.
//
// Tiles: 0-1 C (rows r..r+15, r+16..r+31) of token group a, 2-3 the same of group b; 4-5 A; 6-7 B.

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// One tile configuration for every block: C and B tiles 16 tokens wide whatever a token group holds (the
// columns past its tokens read the next values of the packed buffer, which has 16 values of slack at its end,
// and are never stored). Reconfigured per group (ldtilecfg when a group's count changed, twice a block of
// rows for an expert of, say, 114 tokens) it took 2.25 % of a 128-token prefill's MoE in `perf`; the real
// model's MoE layers on one prompt's routes (/tmp script, 3 alternating processes, ms for 16 layers):
// 97.97 / 96.72 / 97.30 -> 92.93 / 96.25 / 95.27; at 6 and 8 tokens an expert no different. Loaded at the
// first block; the tiles are released when the state goes out of scope (the thread's part of a call ends).
struct TileState {
  bool set = false;
  void shape() {
    if (set) return;
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = 16;
      c.colsb[t] = 64;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(c));  // the whole struct as the operand (GCC's macro names 8 bytes)
    set = true;
  }
  ~TileState() {
    if (set) _tile_release();
  }
};

// The n tokens' bf16 rows as B tiles: per group of 16 tokens (the last may hold fewer, ng), the pairs
// of inner values as uint32 [K/2][ng]; group g starts at bp + 16 g K/2.
// Written in order, read as up to 16 streams (a token at a time wrote a line per value: a MoE layer at 16
// tokens an expert spent 1.3 ms packing, serially).
inline void pack_tokens(const Act* x, int64_t n, int64_t K, uint32_t* bp) {
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t ng = std::min<int64_t>(16, n - t0);
    uint32_t* out = bp + t0 * K / 2;
    const uint32_t* src[16];
    for (int64_t t = 0; t < ng; ++t) src[t] = reinterpret_cast<const uint32_t*>(x[t0 + t].b);
    for (int64_t i = 0; i < K / 2; ++i)
      for (int64_t t = 0; t < ng; ++t) out[i * ng + t] = src[t][i];
  }
}

// Bytes a tile block prefetches into L2 while it runs: the rows the thread reads next (tile_rows).
struct Ahead {
  const char* p = nullptr;
  int64_t lines = 0;  // 64-byte lines from p
};
// Rows [r, r + rows) of the bf16 matrix m as an Ahead.
inline Ahead rows_ahead(const Mat& m, int64_t r, int64_t rows) {
  return {reinterpret_cast<const char*>(static_cast<const uint16_t*>(m.w) + r * m.ld), (rows * m.ld * 2 + 63) / 64};
}

// c[(g * 2 + h) * 256 + i * 16 + t] = dot(weight row r + 16 h + i, token t of group g), for NR blocks of
// 16 rows from w (ld values a row) and NG token groups b[g] of n[g] tokens; meanwhile `ahead` into L2. A
// function of its own: inlined into its callers, its sweep kept values on the stack (a 32000 x 512 product
// at 128 tokens, compute-bound, 3.1-3.4 -> 3.6-3.7 ms).
template <int NR, int NG>
__attribute__((noinline)) void tile_block(const uint16_t* w, int64_t ld, const uint32_t* const* b, const int* n,
                                          int64_t K, float* c, Ahead ahead) {
  const int64_t stride = ld * 2;
  __asm__ volatile("" ::: "memory");  // the packed tokens are in memory before the first tile load
  _tile_zero(0);
  if constexpr (NR > 1) _tile_zero(1);
  if constexpr (NG > 1) _tile_zero(2);
  if constexpr (NR > 1 && NG > 1) _tile_zero(3);
  // The next block's lines, spread over the inner sweep (tile_rows). 4 lines ahead a row (until 2026-12-05)
  // was slower than none: a tile product from memory at 4 / 16 / 32 tokens, 24576 x 1024 23.1 / 22.4 / 18.9
  // -> 23.9 / 23.8 / 20.1 GB/s, 65536 x 384 19.9 / 18.1 / 15.2 -> 22.0 / 20.6 / 15.7.
  const int64_t per_step = (ahead.lines + K / 32 - 1) / (K / 32);
  int64_t line = 0;
  for (int64_t k = 0; k < K; k += 32) {
    for (int64_t i = 0; i < per_step && line < ahead.lines; ++i, ++line)
      _mm_prefetch(ahead.p + line * 64, _MM_HINT_T1);
    _tile_loadd(6, b[0] + k / 2 * n[0], n[0] * 4);
    if constexpr (NG > 1) _tile_loadd(7, b[1] + k / 2 * n[1], n[1] * 4);
    _tile_loadd(4, w + k, stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NG > 1) _tile_dpbf16ps(2, 4, 7);
    if constexpr (NR > 1) {
      _tile_loadd(5, w + 16 * ld + k, stride);
      _tile_dpbf16ps(1, 5, 6);
      if constexpr (NG > 1) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (NR > 1) _tile_stored(1, c + 256, 64);
  if constexpr (NG > 1) _tile_stored(2, c + 512, 64);
  if constexpr (NR > 1 && NG > 1) _tile_stored(3, c + 768, 64);
  __asm__ volatile("" ::: "memory");  // and c is read only after the stores
}

// Column t of a stored 16 x 16 C tile (row i at c + 16 i): the 16 rows' dots with token t.
inline __m512 tile_column(const float* c, int t) {
  const __m512i rows = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  return _mm512_i32gather_ps(rows, c + t, 4);
}

// A put (tile_rows) that stores token t0 + t's 16 dots at out + (t0 + t) * ld + r, plus add (16 values)
// where given: a vector a token, not a scalar store a dot (a MoE layer at 16 tokens an expert, from memory:
// 11.2 -> 13.8 GB/s).
inline void put_columns(float* out, int64_t ld, int64_t r, int64_t t0, int ng, const float* c, const float* add) {
  const __m512 b = add ? _mm512_loadu_ps(add) : _mm512_setzero_ps();
  for (int t = 0; t < ng; ++t) _mm512_storeu_ps(out + (t0 + t) * ld + r, _mm512_add_ps(tile_column(c, t), b));
}

inline float dot_bf16(const uint16_t* w, const uint16_t* x, int64_t K) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + k), (__m512bh)_mm512_loadu_si512(x + k));
  return _mm512_reduce_add_ps(acc);
}

// The dots of rows [r0, r1) of the bf16 weight m and n tokens (bf16 rows x[t].b, packed as B tiles at
// bp): 32 rows and 32 tokens a tile block, then 16 rows, each 16 rows' C tile handed to put(row, first
// token, tokens, c) (c[i * 16 + t]: row + i, token + t); the last rows (fewer than 16) by vdpbf16ps, each
// dot to sink(row, token, dot). Each block of rows meets all the tokens before the next is read, so rows
// are read from memory once at any token count (the tokens outside, until 2026-12-05, read 1024 rows x 2 KB
// again per 32 tokens, from memory: a 49152 x 1024 product at 64 tokens 8.9 -> 7.2 ms).
//
// While a block runs (its first token group) it prefetches the next block's rows into L2: a block of 32 rows
// is 64 KB at K = 1024 and 24 KB at 384, read as 32 interleaved streams of 2 KB or 768 B, too short for the
// L2 streamer to get ahead of. The last block prefetches `after` (the rows the caller reads next), if any.
// Measured on the AMX Xeon (a C loop of the same tiles from memory, 16 tokens, 2 threads, GB/s, 2 runs):
// blocks of 32 rows 2 KB apart 26.2 / 25.8 -> 28.3 / 28.9, 768 B apart 23.7 / 23.9 -> 27.3 / 27.7; a
// vector read of the same bytes 28.5-29.2.
template <typename Sink, typename Put>
void tile_rows(const Mat& m, int64_t r0, int64_t r1, const Act* x, const uint32_t* bp, int64_t n, int64_t K,
               TileState& ts, Sink& sink, Put& put, Ahead after = {}) {
  const uint16_t* w = static_cast<const uint16_t*>(m.w);
  alignas(64) float c[4 * 256];
  auto block = [&](int64_t r, int nr, int64_t t0) {  // rows r.. (16 nr of them) x tokens t0.. (up to 32)
    const int na = static_cast<int>(std::min<int64_t>(16, n - t0));
    const int nb = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, n - t0 - 16)));
    ts.shape();
    const uint32_t* b[2] = {bp + t0 * K / 2, bp + (t0 + 16) * K / 2};
    const int ng[2] = {na, nb};
    const uint16_t* wr = w + r * m.ld;
    Ahead ahead;
    if (t0 == 0) {
      const int64_t next = std::min<int64_t>(32, r1 - (r + 16 * nr));
      ahead = next > 0 ? rows_ahead(m, r + 16 * nr, next) : after;
    }
    if (nr == 2) nb > 0 ? tile_block<2, 2>(wr, m.ld, b, ng, K, c, ahead) : tile_block<2, 1>(wr, m.ld, b, ng, K, c, ahead);
    else nb > 0 ? tile_block<1, 2>(wr, m.ld, b, ng, K, c, ahead) : tile_block<1, 1>(wr, m.ld, b, ng, K, c, ahead);
    for (int g = 0; g < (nb > 0 ? 2 : 1); ++g)
      for (int h = 0; h < nr; ++h) put(r + 16 * h, t0 + 16 * g, ng[g], c + (g * 2 + h) * 256);
  };
  int64_t r = r0;
  for (; r + 32 <= r1; r += 32)
    for (int64_t t0 = 0; t0 < n; t0 += 32) block(r, 2, t0);
  if (r + 16 <= r1) {
    for (int64_t t0 = 0; t0 < n; t0 += 32) block(r, 1, t0);
    r += 16;
  }
  for (; r < r1; ++r)
    for (int64_t t = 0; t < n; ++t) sink(r, t, dot_bf16(w + r * m.ld, x[t].b, K));
}

// Tokens t0.. (ng of them, a token group) of the C tile c (16 rows from r, row i at c + 16 i) as bf16 into
// B tiles of K = inter (pack_tokens' layout; the group's first token's at pk): each pair of rows is a line of
// ng pairs, rounded as cvtneps rounds.
inline void pack_tile_rows(const float* c, int64_t r, int64_t t0, int ng, int64_t inter, uint32_t* pk) {
  const __m512i pairs = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005,
                                          0x00160006, 0x00170007, 0x00180008, 0x00190009, 0x001a000a, 0x001b000b,
                                          0x001c000c, 0x001d000d, 0x001e000e, 0x001f000f);  // bf16 t, then 16 + t
  const __mmask16 k = static_cast<__mmask16>((1u << ng) - 1);
  uint32_t* out = pk + t0 * inter / 2 + r / 2 * ng;
  for (int i = 0; i < 8; ++i) {  // rows 2 i and 2 i + 1: uint32 t = (row 2 i, row 2 i + 1) of token t
    const __m512i two = (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(c + 32 * i + 16), _mm512_load_ps(c + 32 * i));
    _mm512_mask_storeu_epi32(out + i * ng, k, _mm512_permutexvar_epi16(pairs, two));
  }
}

// Phase 1 of moe_tile for rows [r0, r1) of one expert's gate and up halves (w13: gate rows, then up rows from
// inter on), its n tokens packed as B tiles at bp: the activations bf16(silu(gate_r . x_t) * (up_r . x_t)),
// packed as phase 2 reads them (B tiles of K = inter at pk, pack_tokens' layout). A block of 32 gate rows,
// then the same 32 up rows, each token group's dots kept in the tiles' stores (cg, cu) until both are done,
// and the activations packed from them. The gate block prefetches its up rows, the up block the next gate
// rows (or `after`). r0 and r1 are multiples of 32 (the tile mode's sizes are, and so are moe_tile's items).
// One tile_block of 16 gate rows with their 16 up rows (its two A tiles) read 5 % slower in a C loop of the
// tiles from memory (16 tokens, 2 threads, 3 rounds: 32.9-33.2 against 34.6-34.8 GB/s for 32 rows in a run)
// and the same in the MoE (medium preset, 128 tokens, alternated processes: 6.05-6.09 against 6.04-6.09
// ms); this way needs one prefetch range a block.
inline void tile_gate_up(const Mat& m, int64_t r0, int64_t r1, int64_t inter, const uint32_t* bp, int64_t n,
                         int64_t K, TileState& ts, uint32_t* pk, Ahead after = {}) {
  const uint16_t* w = static_cast<const uint16_t*>(m.w);
  alignas(64) float cg[4 * 256], cu[4 * 256];
  for (int64_t r = r0; r < r1; r += 32) {
    const Ahead next = r + 32 < r1 ? rows_ahead(m, r + 32, 32) : after;
    for (int64_t t0 = 0; t0 < n; t0 += 32) {
      const int na = static_cast<int>(std::min<int64_t>(16, n - t0));
      const int nb = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, n - t0 - 16)));
      ts.shape();
      const uint32_t* b[2] = {bp + t0 * K / 2, bp + (t0 + 16) * K / 2};
      const int ng[2] = {na, nb};
      const uint16_t *gate = w + r * m.ld, *up = w + (inter + r) * m.ld;
      const Ahead up_rows = t0 == 0 ? rows_ahead(m, inter + r, 32) : Ahead{};
      if (nb > 0) {
        tile_block<2, 2>(gate, m.ld, b, ng, K, cg, up_rows);
        tile_block<2, 2>(up, m.ld, b, ng, K, cu, t0 == 0 ? next : Ahead{});
      } else {
        tile_block<2, 1>(gate, m.ld, b, ng, K, cg, up_rows);
        tile_block<2, 1>(up, m.ld, b, ng, K, cu, t0 == 0 ? next : Ahead{});
      }
      for (int g = 0; g < (nb > 0 ? 2 : 1); ++g) {
        silu_mul(cg + g * 512, cu + g * 512, 512);  // both row tiles of token group g
        for (int h = 0; h < 2; ++h) pack_tile_rows(cg + (g * 2 + h) * 256, r + 16 * h, t0 + 16 * g, ng[g], inter, pk);
      }
    }
  }
}

void linear_tile(const Mat& m, int64_t N, int64_t K, const Act* x, int64_t T, const float* bias, float* y) {
  std::vector<uint32_t> bp(T * K / 2 + 16);  // + 16: the slack a B tile's last row reads (TileState)
  pack_tokens(x, T, K, bp.data());
  auto sink = [&](int64_t r, int64_t t, float v) { y[t * N + r] = v + (bias ? bias[r] : 0.f); };
  auto put = [&](int64_t r, int64_t t0, int ng, const float* c) { put_columns(y, N, r, t0, ng, c, bias ? bias + r : nullptr); };
  // Runs of up to 1024 rows, 4 a thread, as linear_kind's one-token products (AMX Xeon, GB/s from memory,
  // 2 interleaved runs, chunks of 64 rows -> runs: 32000 x 1024 at 32 tokens 19.6 / 20.5 -> 22.3 / 21.6,
  // at 4 tokens 22.7 / 23.6 -> 24.7 / 24.3; 1536 x 1024 at 32 17.5 / 17.8 -> 18.8 / 18.4).
  const int64_t chunk = std::clamp<int64_t>(N / (4 * at::get_num_threads()) / 32 * 32, 64, 1024);
  parallel_chunks(N, chunk, [&](int64_t r0, int64_t r1) {
    TileState ts;
    tile_rows(m, r0, r1, x, bp.data(), T, K, ts, sink, put);
  });
}

// moe_kind's two phases on tiles; each expert's tokens are packed once per phase.
// Phase 1 splits among threads as moe_kind splits it (Spans): each item's gate and up rows go through
// tile_gate_up, which writes the activations from the tiles (a pass over the gate rows and one over the up
// rows, each block's dots stored to scratch rows, then silu(g) * u from them, until 2026-12-06: medium preset
// MoE at 128 tokens, the script below, 7.47 -> 7.22 ms with phase 2 as it was).
// Up to how many tokens an expert moe_tile takes runs (Spans): tile_rows reads a block of rows once for all
// the tokens, so an expert of more tokens than kTokBlock needs no short items. A 128-token prompt always had
// an expert of more than 64 tokens (medium preset: 71-126 in the 16 layers of one).
constexpr int64_t kTileRunTokens = 256;
// Phase 2 gives each thread a part of the output rows (H): every expert's down rows of that part in turn,
// each product summed into the output as it comes (in expert order, whatever the threads), where each
// thread gets at least kTileDownRows rows. Otherwise (many threads, a narrow model) runs of one expert's down
// rows, each slot's product kept apart and summed per token (Spans), as moe_kind does. The part's output
// rows (T tokens x its rows x 4 B) are kept within kTileDownBytes (the L2 of the AMX Xeons), so they stay
// in cache across the experts. AMX Xeon, medium preset MoE, one process calling each way in turn on weights
// from memory (/tmp script, medians of 16-50 calls each), ms: at 128 tokens slots 6.98, parts of 512 rows
// 6.61, of 256 6.72 (no slot buffer of P x H floats written and read again, no sum); at 1024 tokens slots
// 21.95, parts of 128 / 256 / 512 rows 20.78 / 19.55 / 19.46; at 2048 (short items) parts of 32 rows (the
// parts until 2026-12-06) 48.8, of 128 / 256 / 512 44.9 / 44.3 / 44.0.
constexpr int64_t kTileDownRows = 128;
constexpr int64_t kTileDownBytes = int64_t{2} << 20;

void moe_tile(const MoeJob& j, float* op) {
  const Routes& R = *j.routes;
  const int64_t P = R.P, H = j.H, inter = j.inter, E = static_cast<int64_t>(j.w13.size());
  std::vector<Act> xs(P);
  for (int64_t p = 0; p < P; ++p) xs[p] = j.hacts[R.tok[p]];
  const Scratch<uint32_t> bp(kPackedTokens, P * std::max(H, inter) / 2 + 16);  // + 16: TileState's slack
  // Each expert's tokens as B tiles, where it runs on tiles, on the threads: serially this was 0.3 ms of a
  // 7 ms layer at 4 tokens an expert, and the other thread went to sleep meanwhile.
  auto pack = [&](const Act* acts, int64_t K) {
    parallel_chunks(E, 1, [&](int64_t e, int64_t) {
      const int64_t n = R.offset[e + 1] - R.offset[e];
      if (n > j.small) pack_tokens(acts + R.offset[e], n, K, bp.data() + R.offset[e] * K / 2);
    });
  };
  pack(xs.data(), H);
  // Phase 1's activations: packed as B tiles where the expert runs on tiles, else as bf16 rows.
  const Scratch<uint32_t> pk(kPackedActs, P * inter / 2 + 16);  // + 16: TileState's slack
  const Scratch<uint16_t> act(kActivations, P * inter);
  const int n_threads = at::get_num_threads();
  const Spans sp = moe_spans(R, E, inter, H, n_threads, kTileRunTokens);
  const std::vector<ExpertRows> items = expert_runs(R, E, inter, sp.work_up);  // short items: 32 rows
  const int64_t n_items = static_cast<int64_t>(items.size());
  // Short items (32 rows, where an expert has more tokens than a block) go 4 at a time to a thread, so that an
  // item's last block prefetches the next item's first; runs go one at a time, for the balance.
  const int64_t chunk = sp.runs ? 1 : 4, n_chunks = (n_items + chunk - 1) / chunk;
#pragma omp parallel num_threads(n_threads) if (n_threads > 1 && n_chunks > 1)
  {
    TileState ts;
#pragma omp for schedule(dynamic, 1)
    for (int64_t ci = 0; ci < n_chunks; ++ci)  // a chunk's items in order (the body keeps one indent)
    for (int64_t it = ci * chunk; it < std::min(n_items, (ci + 1) * chunk); ++it) {
      const ExpertRows& item = items[it];
      const int64_t p0 = R.offset[item.e], n = R.offset[item.e + 1] - p0, rows = item.r1 - item.r0;
      if (n <= j.small) {  // few tokens: vdpbf16ps streams the rows faster than the tiles (MoeJob::small)
        const Scratch<float> g(kGateRows, rows * n), u(kUpRows, rows * n);
        auto gate_sink = [&](int64_t r, int64_t t, float v) { g[(r - item.r0) * n + t] = v; };
        auto up_sink = [&](int64_t r, int64_t t, float v) { u[(r - inter - item.r0) * n + t] = v; };
        rows_times_tokens<Kind::Bf16Dp>(j.w13[item.e], item.r0, item.r1, xs.data() + p0, n, H, 0, gate_sink, 2);
        rows_times_tokens<Kind::Bf16Dp>(j.w13[item.e], inter + item.r0, inter + item.r1, xs.data() + p0, n, H, 0,
                                        up_sink, 2);
        store_act(g.data(), u.data(), item.r0, rows, n, inter, act.data() + p0 * inter);
        continue;
      }
      Ahead next;  // the next item's first block
      if (it + 1 < std::min(n_items, (ci + 1) * chunk)) next = rows_ahead(j.w13[items[it + 1].e], items[it + 1].r0, 32);
      tile_gate_up(j.w13[item.e], item.r0, item.r1, inter, bp.data() + p0 * H / 2, n, H, ts, pk.data() + p0 * inter / 2,
                   next);
    }
  }
  Prepared as;
  as.acts.assign(P, Act{});
  for (int64_t p = 0; p < P; ++p) as.acts[p].b = act.data() + p * inter;
  const int64_t part = std::min(H / n_threads, kTileDownBytes / (4 * std::max<int64_t>(j.T, 1))) / 32 * 32;
  if (sp.runs && part < kTileDownRows) {  // runs of one expert's down rows, each slot's product kept apart
    const std::vector<ExpertRows> down = expert_runs(R, E, H, sp.work_down);
    const Scratch<float> y(kSlotOutputs, P * H);  // each slot's down product, unweighted
    const int64_t n_down = static_cast<int64_t>(down.size());
#pragma omp parallel num_threads(n_threads) if (n_threads > 1 && n_down > 1)
    {
      TileState ts;
#pragma omp for schedule(dynamic, 1)
      for (int64_t it = 0; it < n_down; ++it) {
        const ExpertRows& item = down[it];
        const int64_t p0 = R.offset[item.e], n = R.offset[item.e + 1] - p0;
        auto sink = [&](int64_t r, int64_t t, float v) { y[(p0 + t) * H + r] = v; };
        auto put = [&](int64_t r, int64_t t0, int ng, const float* c) { put_columns(y.data() + p0 * H, H, r, t0, ng, c, nullptr); };
        if (n <= j.small)
          rows_times_tokens<Kind::Bf16Dp>(j.w2[item.e], item.r0, item.r1, as.acts.data() + p0, n, inter, 0, sink, 2);
        else
          tile_rows(j.w2[item.e], item.r0, item.r1, as.acts.data() + p0, pk.data() + p0 * inter / 2, n, inter, ts, sink, put);
      }
    }
    sum_slots(R, y.data(), H, op);
    return;
  }
  parallel_chunks(H, std::max<int64_t>(32, part), [&](int64_t r0, int64_t r1) {
    TileState ts;
    auto routed_from = [&](int64_t e) {  // the first expert from e on with tokens (E: none)
      while (e < E && R.offset[e + 1] == R.offset[e]) ++e;
      return e;
    };
    for (int64_t e = routed_from(0), next; e < E; e = next) {
      const int64_t p0 = R.offset[e], n = R.offset[e + 1] - p0;
      next = routed_from(e + 1);  // its first rows are prefetched while these run
      const Ahead after = next < E ? rows_ahead(j.w2[next], r0, std::min<int64_t>(32, r1 - r0)) : Ahead{};
      auto sink = [&](int64_t r, int64_t t, float v) { op[R.tok[p0 + t] * H + r] += R.gate[p0 + t] * v; };
      auto put = [&](int64_t r, int64_t t0, int ng, const float* c) {
        for (int t = 0; t < ng; ++t) {
          float* dst = op + R.tok[p0 + t0 + t] * H + r;
          _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_set1_ps(R.gate[p0 + t0 + t]), tile_column(c, t), _mm512_loadu_ps(dst)));
        }
      };
      if (n <= j.small) rows_times_tokens<Kind::Bf16Dp>(j.w2[e], r0, r1, as.acts.data() + p0, n, inter, 0, sink);
      else tile_rows(j.w2[e], r0, r1, as.acts.data() + p0, pk.data() + p0 * inter / 2, n, inter, ts, sink, put, after);
    }
  });
}
#endif

// Which kinds this variant compiles: a variant that differs from its fallback only in its int8 or
// bf16 dot products compiles only those (the common part falls back for the rest).
#if MT_ISA == MT_AVXVNNI || MT_ISA == MT_AVX512VNNI
#define MT_KINDS(X) X(I8Q8) X(I4Q8)
#elif MT_ISA == MT_AVX512BF16
#define MT_KINDS(X) X(Bf16Dp)
#else
#define MT_KINDS(X) X(Bf16F32) X(F16F32) X(I8F32) X(I8Q8) X(I8Q16) X(I4Q8)
#endif

#if MT_ISA == MT_AMX
// amx compiles the tile mode alone (its fallback, avx512_bf16, serves the rest).
bool linear(Kind kd, const Mat& m, int64_t N, int64_t K, int64_t, const Act* x, int64_t T, const float* bias,
            float* y) {
  if (kd != Kind::Bf16Tile) return false;
  linear_tile(m, N, K, x, T, bias, y);
  return true;
}

bool moe(Kind kd, const MoeJob& j, float* out) {
  if (kd != Kind::Bf16Tile) return false;
  if (most_tokens(*j.routes, static_cast<int64_t>(j.w13.size())) <= j.small)
    moe_kind<Kind::Bf16Dp>(j, out);  // every expert on vdpbf16ps
  else moe_tile(j, out);
  return true;
}
#else
bool linear(Kind kd, const Mat& m, int64_t N, int64_t K, int64_t G, const Act* x, int64_t T, const float* bias,
            float* y) {
  switch (kd) {
#define MT_CASE(k) case Kind::k: linear_kind<Kind::k>(m, N, K, G, x, T, bias, y); return true;
    MT_KINDS(MT_CASE)
#undef MT_CASE
    default: return false;
  }
}

bool moe(Kind kd, const MoeJob& j, float* out) {
  switch (kd) {
#define MT_CASE(k) case Kind::k: moe_kind<Kind::k>(j, out); return true;
    MT_KINDS(MT_CASE)
#undef MT_CASE
    default: return false;
  }
}
#endif
#undef MT_KINDS

#endif  // MOETUNE_VARIANT_BODY
