// moetune's CPU kernels: products of fp32 activations with bf16 or fp16 weights, computed in fp32.
//
// Why: on CPUs without AVX512_BF16/AMX, oneDNN emulates bf16 products and they run no faster than
// fp32 ones while reading half the bytes, so the engine used to widen every weight to fp32 and
// decode read twice the bytes it needs. These kernels widen 16 weights at a time in registers (a
// shift for bf16, vcvtph2ps for fp16) and accumulate in fp32: the arithmetic of an fp32 product on
// the stored weights, at the memory traffic of the stored dtype.
//
// Ops (namespace moetune):
//   linear(x[T,K] f32, w[N,K] bf16|f16|f32, bias[N] f32?) -> [T,N] f32
//   linear_int8(x[T,K] f32, q[N,K] int8, scales[N]) -> [T,N] f32 (int8 experts, per-row scales)
//   moe(h[T,H] f32, w13[E,2I,H], w2[E,H,I], ids[T,k] i64 (-1 = skipped), gates[T,k] f32) -> [T,H] f32
//   moe_list: moe with the experts given as lists of per-expert [2I,H] and [H,I] tensors
//   (undefined entries for experts no token routes to); moe_list_int8 the same for int8 experts with
//   per-row scales (quant.QWeight's int8 scheme).
// and the small fp32 steps between the products, fused so that a decode step of one token is a few
// calls per layer rather than ~100 (each PyTorch op costs microseconds of dispatch on a slow core):
//   rmsnorm(x[R,D], w[D], eps), add_rmsnorm_(x += delta, then rmsnorm)
//   qk_rope(qkv[T, Q+2KV], ...) -> q[T,Hq,d], k[T,KV,d], v[T,KV,d]: q/k norms, clipping, rotary
//   route(logits[T,E], k, renorm) -> (gates[T,k], ids[T,k]): softmax, top-k, renormalisation
//   decode_attention(q[B,Hq,d], kcache, vcache[S,KV,L,d], slots[B], lens[B], window, scale) -> [B,Hq,d]
//
// Built on first use by engine/kernels/__init__.py with the system C++ compiler and -march=native;
// threads come from PyTorch's OpenMP pool (torch.set_num_threads).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <cstdint>
#include <vector>

namespace {

struct Bf16 { using elem = uint16_t; };
struct F16 { using elem = uint16_t; };
struct I8 { using elem = int8_t; };  // int8 weights, one fp32 scale per row applied by the caller

inline float widen(uint16_t v, Bf16) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline float widen(uint16_t v, F16) { return static_cast<float>(c10::Half(v, c10::Half::from_bits())); }
inline float widen(int8_t v, I8) { return static_cast<float>(v); }

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kMaxTok = 4;  // tokens per register tile: 4 rows x 4 tokens = 16 accumulators
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
inline vec wload(const uint16_t* p, Bf16) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline vec wload(const uint16_t* p, F16) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline vec wload(const int8_t* p, I8) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kLanes = 8;
constexpr int kMaxTok = 2;  // 4 x 2 accumulators of the 16 ymm registers
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
inline vec wload(const uint16_t* p, Bf16) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline vec wload(const uint16_t* p, F16) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline vec wload(const int8_t* p, I8) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
constexpr const char* kIsa = "avx2";
#else
constexpr int kLanes = 1;
constexpr int kMaxTok = 4;
using vec = float;
inline vec vzero() { return 0.f; }
inline vec vload(const float* p) { return *p; }
inline vec vfma(vec a, vec b, vec c) { return a * b + c; }
inline float vsum(vec a) { return a; }
inline vec wload(const uint16_t* p, Bf16 t) { return widen(*p, t); }
inline vec wload(const uint16_t* p, F16 t) { return widen(*p, t); }
inline vec wload(const int8_t* p, I8 t) { return widen(*p, t); }
constexpr const char* kIsa = "scalar";
#endif

// s[r * NT + t] = dot(w[r][0:K], x[t][0:K]) for NR weight rows and NT activation rows.
template <typename WT, int NR, int NT>
inline void dots(const typename WT::elem* const* w, const float* const* x, int64_t K, float* s) {
  vec acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    // One prefetch per 64-byte line: the same line of the next tile's rows (rows are contiguous, K
    // apart), so each row's stream is in flight a tile ahead. Measured on the 2-core Ice Lake: 15-17
    // -> 19-24 GB/s; a fixed 1 KiB ahead gained nothing (it lands in rows already being read).
    if ((k & 31) == 0)
      for (int r = 0; r < NR; ++r) __builtin_prefetch(w[r] + k + NR * K);
    vec xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = vload(x[t] + k);
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
      for (int t = 0; t < NT; ++t) s[r * NT + t] += wk * x[t][k];
    }
}

template <typename WT, int NR, int NT, typename Sink>
inline void tile(const typename WT::elem* const* w, const float* const* x, int64_t K, int64_t r, int64_t t, Sink& sink) {
  float s[NR * NT];
  dots<WT, NR, NT>(w, x, K, s);
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NT; ++j) sink(r + i, t + j, s[i * NT + j]);
}

template <typename WT, int NR, typename Sink>
inline void row_block(const typename WT::elem* const* w, const float* const* xs, int64_t n_tok, int64_t K, int64_t r,
                      Sink& sink) {
  int64_t t = 0;
  for (; t + kMaxTok <= n_tok; t += kMaxTok) tile<WT, NR, kMaxTok>(w, xs + t, K, r, t, sink);
  switch (n_tok - t) {
    case 1: tile<WT, NR, 1>(w, xs + t, K, r, t, sink); break;
    case 2: if constexpr (kMaxTok > 2) tile<WT, NR, 2>(w, xs + t, K, r, t, sink); break;
    case 3: if constexpr (kMaxTok > 3) tile<WT, NR, 3>(w, xs + t, K, r, t, sink); break;
    default: break;
  }
}

// sink(row, token, dot(W[row], xs[token])) for rows [r0, r1) of a row-major [*, K] weight with stride ldw.
template <typename WT, typename Sink>
void rows_times_tokens(const typename WT::elem* W, int64_t ldw, int64_t r0, int64_t r1, const float* const* xs,
                       int64_t n_tok, int64_t K, Sink& sink) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const typename WT::elem* w[4] = {W + r * ldw, W + (r + 1) * ldw, W + (r + 2) * ldw, W + (r + 3) * ldw};
    row_block<WT, 4>(w, xs, n_tok, K, r, sink);
  }
  for (; r < r1; ++r) {
    const typename WT::elem* w[1] = {W + r * ldw};
    row_block<WT, 1>(w, xs, n_tok, K, r, sink);
  }
}

inline float dotf(const float* a, const float* b, int64_t n) {
  vec acc = vzero();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = vfma(vload(a + i), vload(b + i), acc);
  float s = vsum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline const uint16_t* bits(const at::Tensor& w) { return static_cast<const uint16_t*>(w.data_ptr()); }

void check_weight(const at::Tensor& w, const char* what) {
  TORCH_CHECK(w.device().is_cpu(), "moetune::", what, ": weights must be on the CPU");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf, "moetune::", what,
              ": weights must be bfloat16 or float16, got ", w.scalar_type());
  TORCH_CHECK(w.is_contiguous(), "moetune::", what, ": weights must be contiguous");
}

void check_act(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "moetune::", what, ": activations must be a contiguous 2-D float32 CPU tensor");
}

// y[t, r] = scale[r] * dot(W[r], x[t]) + bias[r] (scale and bias optional).
template <typename WT>
void linear_impl(const at::Tensor& x, const at::Tensor& w, const float* scale, const float* bias, at::Tensor& y) {
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<const float*> xs(T);
  for (int64_t t = 0; t < T; ++t) xs[t] = xp + t * K;
  const auto* W = static_cast<const typename WT::elem*>(w.data_ptr());
  const int64_t block = 16;
  const int64_t n_blocks = (N + block - 1) / block;
  at::parallel_for(0, n_blocks, 1, [&](int64_t b0, int64_t b1) {
    auto sink = [&](int64_t r, int64_t t, float v) {
      yp[t * N + r] = (scale ? v * scale[r] : v) + (bias ? bias[r] : 0.f);
    };
    rows_times_tokens<WT>(W, K, b0 * block, std::min(N, b1 * block), xs.data(), T, K, sink);
  });
}

// int8 weights quantized per output row: y = x @ (q * scale[:, None]).T, in fp32 (activations are
// not rounded, unlike PyTorch's packed int8 kernel, which takes bf16 activations).
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  check_act(x, "linear_int8");
  TORCH_CHECK(q.scalar_type() == at::kChar && q.dim() == 2 && q.is_contiguous() && q.device().is_cpu() &&
                  q.size(1) == x.size(1),
              "moetune::linear_int8: weights must be a contiguous int8 [N, ", x.size(1), "] CPU tensor, got ",
              q.sizes());
  at::Tensor s = scales.to(at::kFloat).contiguous();
  TORCH_CHECK(s.numel() == q.size(0), "moetune::linear_int8: ", q.size(0), " rows but ", s.numel(), " scales");
  at::Tensor y = at::empty({x.size(0), q.size(0)}, x.options());
  linear_impl<I8>(x, q, s.data_ptr<float>(), nullptr, y);
  return y;
}

// fp32 weights (routers: small, kept in fp32): one dot per row and token; PyTorch's GEMM spends
// ~90 us on the threading of a 1x1024x64 product that reads 256 KiB.
void linear_f32(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& y) {
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 32, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t t = 0; t < T; ++t) yp[t * N + r] = dotf(xp + t * K, wp + r * K, K) + (bias ? bias[r] : 0.f);
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  check_act(x, "linear");
  if (w.scalar_type() == at::kFloat) {  // routers
    TORCH_CHECK(w.is_contiguous() && w.device().is_cpu(), "moetune::linear: weights must be contiguous on the CPU");
  } else {
    check_weight(w, "linear");
  }
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1), "moetune::linear: shapes ", x.sizes(), " and ",
              w.sizes(), " do not match");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == w.size(0),
                "moetune::linear: bias must be a contiguous float32 vector of ", w.size(0));
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  if (w.scalar_type() == at::kFloat)
    linear_f32(x, w, b, y);
  else if (w.scalar_type() == at::kBFloat16)
    linear_impl<Bf16>(x, w, nullptr, b, y);
  else
    linear_impl<F16>(x, w, nullptr, b, y);
  return y;
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// The routed experts of T tokens: tokens grouped by expert (counting sort), then
//   phase 1: for each expert and block of its rows, gate and up products of its tokens -> act
//   phase 2: for each block of output rows, every expert's down product of its tokens, weighted
//            by the gate and summed per token (a thread owns its output rows: no races).
// Row scales of int8 experts (empty for float weights): s13[e] has 2I entries, s2[e] H.
using Scales = std::vector<std::vector<float>>;

template <typename WT>
at::Tensor moe_impl(const at::Tensor& h, const std::vector<const void*>& w13v, const std::vector<const void*>& w2v,
                    int64_t inter, const at::Tensor& ids, const at::Tensor& gates, const Scales& s13 = {},
                    const Scales& s2 = {}) {
  using elem = typename WT::elem;
  std::vector<const elem*> w13(w13v.size()), w2(w2v.size());
  for (size_t e = 0; e < w13v.size(); ++e) {
    w13[e] = static_cast<const elem*>(w13v[e]);
    w2[e] = static_cast<const elem*>(w2v[e]);
  }
  const bool scaled = !s13.empty();
  const int64_t T = h.size(0), H = h.size(1), k = ids.size(1), E = static_cast<int64_t>(w13.size());
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* gw = gates.data_ptr<float>();
  const float* hp = h.data_ptr<float>();
  std::vector<int64_t> offset(E + 1, 0);
  for (int64_t p = 0; p < T * k; ++p)
    if (id[p] >= 0) {
      TORCH_CHECK(id[p] < E && w13[id[p]] != nullptr, "moetune::moe: token routed to expert ", id[p],
                  " which has no weights");
      ++offset[id[p] + 1];
    }
  for (int64_t e = 0; e < E; ++e) offset[e + 1] += offset[e];
  const int64_t P = offset[E];
  std::vector<int64_t> fill(offset.begin(), offset.end() - 1), tok(P);
  std::vector<float> gate(P);
  for (int64_t p = 0; p < T * k; ++p)
    if (id[p] >= 0) {
      int64_t slot = fill[id[p]]++;
      tok[slot] = p / k;
      gate[slot] = gw[p];
    }
  std::vector<const float*> xs(P);
  for (int64_t p = 0; p < P; ++p) xs[p] = hp + tok[p] * H;
  std::vector<float> act(P * inter);
  std::vector<const float*> as(P);
  for (int64_t p = 0; p < P; ++p) as[p] = act.data() + p * inter;

  // Phase 1 work items: (expert, block of gate/up rows).
  const int64_t rb = 32;
  struct Item { int64_t e, r0, r1; };
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e)
    if (offset[e + 1] > offset[e])
      for (int64_t r = 0; r < inter; r += rb) items.push_back({e, r, std::min(inter, r + rb)});
  const int n_threads = at::get_num_threads();
  const int64_t n_items = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(n_threads) if (n_threads > 1 && n_items > 1)
  for (int64_t it = 0; it < n_items; ++it) {
    const Item& item = items[it];
    const int64_t p0 = offset[item.e], n = offset[item.e + 1] - p0, rows = item.r1 - item.r0;
    std::vector<float> g(rows * n);
    const float* sc = scaled ? s13[item.e].data() : nullptr;
    auto gate_sink = [&](int64_t r, int64_t t, float v) { g[(r - item.r0) * n + t] = sc ? v * sc[r] : v; };
    rows_times_tokens<WT>(w13[item.e], H, item.r0, item.r1, xs.data() + p0, n, H, gate_sink);
    auto up_sink = [&](int64_t r, int64_t t, float v) {
      const int64_t i = r - inter;
      act[(p0 + t) * inter + i] = silu(g[(i - item.r0) * n + t]) * (sc ? v * sc[r] : v);
    };
    rows_times_tokens<WT>(w13[item.e], H, inter + item.r0, inter + item.r1, xs.data() + p0, n, H, up_sink);
  }

  at::Tensor out = at::zeros({T, H}, h.options());
  float* op = out.data_ptr<float>();
  const int64_t ob = 16;
  at::parallel_for(0, (H + ob - 1) / ob, 1, [&](int64_t b0, int64_t b1) {
    const int64_t r0 = b0 * ob, r1 = std::min(H, b1 * ob);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t p0 = offset[e], n = offset[e + 1] - p0;
      if (n == 0) continue;
      const float* sc = scaled ? s2[e].data() : nullptr;
      auto sink = [&](int64_t r, int64_t t, float v) {
        op[tok[p0 + t] * H + r] += gate[p0 + t] * (sc ? v * sc[r] : v);
      };
      rows_times_tokens<WT>(w2[e], inter, r0, r1, as.data() + p0, n, inter, sink);
    }
  });
  return out;
}

void check_routes(const at::Tensor& h, const at::Tensor& ids, const at::Tensor& gates) {
  check_act(h, "moe");
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 2 && ids.size(0) == h.size(0) && ids.is_contiguous(),
              "moetune::moe: ids must be a contiguous int64 [T, k] tensor");
  TORCH_CHECK(gates.scalar_type() == at::kFloat && gates.sizes() == ids.sizes() && gates.is_contiguous(),
              "moetune::moe: gates must be a contiguous float32 tensor shaped like ids");
}

at::Tensor moe(const at::Tensor& h, const at::Tensor& w13, const at::Tensor& w2, const at::Tensor& ids,
               const at::Tensor& gates) {
  check_routes(h, ids, gates);
  check_weight(w13, "moe");
  check_weight(w2, "moe");
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type(), "moetune::moe: w13 and w2 dtypes differ");
  const int64_t E = w13.size(0), inter = w2.size(2), H = h.size(1);
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(1) == 2 * inter && w13.size(2) == H &&
                  w2.size(0) == E && w2.size(1) == H,
              "moetune::moe: expert shapes ", w13.sizes(), " and ", w2.sizes(), " do not fit hidden size ", H);
  std::vector<const void*> a(E), b(E);
  for (int64_t e = 0; e < E; ++e) {
    a[e] = bits(w13) + e * 2 * inter * H;
    b[e] = bits(w2) + e * H * inter;
  }
  return w13.scalar_type() == at::kBFloat16 ? moe_impl<Bf16>(h, a, b, inter, ids, gates)
                                            : moe_impl<F16>(h, a, b, inter, ids, gates);
}

using OptTensors = c10::List<std::optional<at::Tensor>>;

std::vector<float> scale_vector(const at::Tensor& s, int64_t n, int64_t e) {
  TORCH_CHECK(s.defined() && s.numel() == n && s.is_contiguous() &&
                  (s.scalar_type() == at::kBFloat16 || s.scalar_type() == at::kFloat),
              "moetune::moe_list_int8: expert ", e, " needs ", n, " contiguous bf16 or fp32 scales");
  std::vector<float> out(n);
  if (s.scalar_type() == at::kFloat) {
    std::copy(s.data_ptr<float>(), s.data_ptr<float>() + n, out.begin());
  } else {  // widened here: an at::to per expert and call costs more than the expert's int8 product
    const uint16_t* b = bits(s);
    for (int64_t i = 0; i < n; ++i) out[i] = widen(b[i], Bf16{});
  }
  return out;
}

// Experts given per expert (None where no token routes), float weights, or int8 with row scales.
at::Tensor moe_list_impl(const at::Tensor& h, const OptTensors& w13_list, const OptTensors& w2_list,
                         const at::Tensor& ids, const at::Tensor& gates, const OptTensors* s13_list,
                         const OptTensors* s2_list) {
  check_routes(h, ids, gates);
  TORCH_CHECK(w13_list.size() == w2_list.size() && !w13_list.empty(),
              "moetune::moe_list: w13 and w2 lists differ in length");
  const int64_t E = static_cast<int64_t>(w13_list.size()), H = h.size(1);
  std::vector<at::Tensor> w13(E), w2(E);
  for (int64_t e = 0; e < E; ++e) {
    std::optional<at::Tensor> a = w13_list.get(e), b = w2_list.get(e);
    if (a.has_value() && b.has_value()) {
      w13[e] = *a;
      w2[e] = *b;
    }
  }
  std::vector<const void*> a(E, nullptr), b(E, nullptr);
  Scales s13, s2;
  if (s13_list) {
    TORCH_CHECK(static_cast<int64_t>(s13_list->size()) == E && static_cast<int64_t>(s2_list->size()) == E,
                "moetune::moe_list_int8: one scale entry per expert");
    s13.resize(E);
    s2.resize(E);
  }
  int64_t inter = -1;
  at::ScalarType dtype = at::kBFloat16;
  for (int64_t e = 0; e < E; ++e) {
    if (!w13[e].defined() || !w2[e].defined()) continue;
    if (s13_list) {
      TORCH_CHECK(w13[e].scalar_type() == at::kChar && w2[e].scalar_type() == at::kChar && w13[e].is_contiguous() &&
                      w2[e].is_contiguous() && w13[e].device().is_cpu() && w2[e].device().is_cpu(),
                  "moetune::moe_list_int8: expert ", e, " weights must be contiguous int8 CPU tensors");
    } else {
      check_weight(w13[e], "moe_list");
      check_weight(w2[e], "moe_list");
    }
    if (inter < 0) {
      inter = w2[e].size(1);
      dtype = w13[e].scalar_type();
    }
    TORCH_CHECK(w13[e].scalar_type() == dtype && w2[e].scalar_type() == dtype,
                "moetune::moe_list: experts of one call must share a dtype");
    TORCH_CHECK(w13[e].dim() == 2 && w13[e].size(0) == 2 * inter && w13[e].size(1) == H && w2[e].dim() == 2 &&
                    w2[e].size(0) == H && w2[e].size(1) == inter,
                "moetune::moe_list: expert ", e, " has shapes ", w13[e].sizes(), " and ", w2[e].sizes());
    a[e] = w13[e].data_ptr();
    b[e] = w2[e].data_ptr();
    if (s13_list) {
      std::optional<at::Tensor> sa = s13_list->get(e), sb = s2_list->get(e);
      s13[e] = scale_vector(sa.value_or(at::Tensor()), 2 * inter, e);
      s2[e] = scale_vector(sb.value_or(at::Tensor()), H, e);
    }
  }
  if (inter < 0) return at::zeros({h.size(0), H}, h.options());
  if (s13_list) return moe_impl<I8>(h, a, b, inter, ids, gates, s13, s2);
  return dtype == at::kBFloat16 ? moe_impl<Bf16>(h, a, b, inter, ids, gates)
                                : moe_impl<F16>(h, a, b, inter, ids, gates);
}

at::Tensor moe_list(const at::Tensor& h, const OptTensors& w13, const OptTensors& w2, const at::Tensor& ids,
                    const at::Tensor& gates) {
  return moe_list_impl(h, w13, w2, ids, gates, nullptr, nullptr);
}

at::Tensor moe_list_int8(const at::Tensor& h, const OptTensors& q13, const OptTensors& s13, const OptTensors& q2,
                         const OptTensors& s2, const at::Tensor& ids, const at::Tensor& gates) {
  return moe_list_impl(h, q13, q2, ids, gates, &s13, &s2);
}

// ------------------------------------------------------------------------------ small fused steps

inline void rms_row(const float* x, const float* w, float eps, int64_t D, float* out) {
  double ss = 0.0;  // double: the sum of squares of thousands of activations, as one rounding
  for (int64_t i = 0; i < D; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = 1.f / std::sqrt(static_cast<float>(ss / D) + eps);
  for (int64_t i = 0; i < D; ++i) out[i] = w[i] * (x[i] * inv);
}

void check_vec(const at::Tensor& w, int64_t n, const char* what) {
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == n && w.device().is_cpu(),
              "moetune::", what, ": weight must be a contiguous float32 vector of ", n);
}

at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu() && x.dim() >= 1,
              "moetune::rmsnorm: x must be a contiguous float32 CPU tensor");
  const int64_t D = x.size(-1), R = D ? x.numel() / D : 0;
  check_vec(w, D, "rmsnorm");
  at::Tensor out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) rms_row(xp + r * D, wp, static_cast<float>(eps), D, op + r * D);
  });
  return out;
}

at::Tensor add_rmsnorm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, double eps) {
  check_act(x, "add_rmsnorm_");
  check_act(delta, "add_rmsnorm_");
  TORCH_CHECK(x.sizes() == delta.sizes(), "moetune::add_rmsnorm_: shapes differ");
  const int64_t R = x.size(0), D = x.size(1);
  check_vec(w, D, "add_rmsnorm_");
  at::Tensor out = at::empty_like(x);
  float *xp = x.data_ptr<float>(), *op = out.data_ptr<float>();
  const float *dp = delta.data_ptr<float>(), *wp = w.data_ptr<float>();
  at::parallel_for(0, R, 64, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      for (int64_t i = 0; i < D; ++i) xp[r * D + i] += dp[r * D + i];
      rms_row(xp + r * D, wp, static_cast<float>(eps), D, op + r * D);
    }
  });
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

std::tuple<at::Tensor, at::Tensor, at::Tensor> qk_rope(const at::Tensor& qkv, int64_t n_heads, int64_t n_kv,
                                                        int64_t d, const std::optional<at::Tensor>& q_norm,
                                                        const std::optional<at::Tensor>& k_norm,
                                                        const std::string& norm, double eps, double clip,
                                                        const at::Tensor& cos, const at::Tensor& sin) {
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
  at::Tensor q = at::empty({T, n_heads, d}, qkv.options());
  at::Tensor k = at::empty({T, n_kv, d}, qkv.options());
  at::Tensor v = at::empty({T, n_kv, d}, qkv.options());
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
  return {q, k, v};
}

std::tuple<at::Tensor, at::Tensor> route(const at::Tensor& logits, int64_t k, bool renorm) {
  check_act(logits, "route");
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= E, "moetune::route: k=", k, " with ", E, " experts");
  at::Tensor gates = at::empty({T, k}, logits.options());
  at::Tensor ids = at::empty({T, k}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  float* gp = gates.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const float* row = lp + t * E;
    float mx = row[0];
    for (int64_t e = 1; e < E; ++e) mx = std::max(mx, row[e]);
    std::vector<float> p(E);
    float sum = 0.f;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(row[e] - mx));
    std::vector<int64_t> order(E);
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
  return {gates, ids};
}

// x[i] = exp(x[i] - shift), returning the sum. With AVX-512: exp(r) = 2^n * p(r'), n = round(r log2 e),
// r' = r - n ln 2 in [-ln2/2, ln2/2], p the degree-6 Taylor polynomial (relative error ~1e-7).
inline float exp_shifted(float* x, int64_t n, float shift) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  const __m512 vshift = _mm512_set1_ps(shift), log2e = _mm512_set1_ps(1.44269504088896341f),
               ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f),
               lo = _mm512_set1_ps(-87.3f);
  const float c[7] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720};
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    __m512 r = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vshift), lo);
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(r, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_fnmadd_ps(k, ln2_hi, r);
    r = _mm512_fnmadd_ps(k, ln2_lo, r);
    __m512 p = _mm512_set1_ps(c[6]);
    for (int j = 5; j >= 0; --j) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c[j]));
    p = _mm512_scalef_ps(p, k);
    _mm512_storeu_ps(x + i, p);
    acc = _mm512_add_ps(acc, p);
  }
  sum = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) sum += (x[i] = std::exp(x[i] - shift));
  return sum;
}

// One query token per sequence against its cached keys and values, read in place from the cache:
// for each (sequence, KV head), the query heads of its group over positions [max(0, len-window), len).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& slots,
                            const at::Tensor& lens, int64_t window, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3, "moetune::decode_attention: q");
  TORCH_CHECK(kc.scalar_type() == at::kFloat && kc.is_contiguous() && kc.dim() == 4 && vc.sizes() == kc.sizes() &&
                  vc.is_contiguous(),
              "moetune::decode_attention: caches must be contiguous float32 [slots, KV, L, d]");
  const int64_t B = q.size(0), Hq = q.size(1), d = q.size(2), KV = kc.size(1), L = kc.size(2);
  TORCH_CHECK(kc.size(3) == d && Hq % KV == 0, "moetune::decode_attention: head shapes");
  TORCH_CHECK(slots.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && slots.numel() == B &&
                  lens.numel() == B && slots.is_contiguous() && lens.is_contiguous(),
              "moetune::decode_attention: slots and lens must be int64 vectors of ", B);
  const int64_t group = Hq / KV;
  at::Tensor out = at::empty_like(q);
  const float *qp = q.data_ptr<float>(), *kp = kc.data_ptr<float>(), *vp = vc.data_ptr<float>();
  const int64_t *sp = slots.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sp[b] >= 0 && sp[b] < kc.size(0) && lp[b] >= 1 && lp[b] <= L, "moetune::decode_attention: slot ",
                sp[b], " length ", lp[b], " outside the cache");
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * KV, 1, [&](int64_t a, int64_t z) {
    std::vector<float> w;
    for (int64_t bh = a; bh < z; ++bh) {
      const int64_t b = bh / KV, g = bh % KV, len = lp[b];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const float* K = kp + ((sp[b] * KV + g) * L) * d;
      const float* V = vp + ((sp[b] * KV + g) * L) * d;
      w.resize(len - lo);
      for (int64_t hq = g * group; hq < (g + 1) * group; ++hq) {
        const float* qh = qp + (b * Hq + hq) * d;
        float mx = -INFINITY;
        for (int64_t j = lo; j < len; ++j) {
          w[j - lo] = dotf(qh, K + j * d, d) * sc;
          mx = std::max(mx, w[j - lo]);
        }
        const float sum = exp_shifted(w.data(), static_cast<int64_t>(w.size()), mx);
        float* oh = op + (b * Hq + hq) * d;
        for (int64_t i = 0; i < d; ++i) oh[i] = 0.f;
        for (int64_t j = lo; j < len; ++j) {
          const float p = w[j - lo] / sum;
          for (int64_t i = 0; i < d; ++i) oh[i] += p * V[j * d + i];
        }
      }
    }
  });
  return out;
}

std::string isa() { return kIsa; }

}  // namespace

TORCH_LIBRARY(moetune, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? bias=None) -> Tensor", &linear);
  m.def("linear_int8(Tensor x, Tensor q, Tensor scales) -> Tensor", &linear_int8);
  m.def("moe(Tensor h, Tensor w13, Tensor w2, Tensor ids, Tensor gates) -> Tensor", &moe);
  m.def("moe_list(Tensor h, Tensor?[] w13, Tensor?[] w2, Tensor ids, Tensor gates) -> Tensor", &moe_list);
  m.def("moe_list_int8(Tensor h, Tensor?[] q13, Tensor?[] s13, Tensor?[] q2, Tensor?[] s2, Tensor ids, "
        "Tensor gates) -> Tensor", &moe_list_int8);
  m.def("rmsnorm(Tensor x, Tensor w, float eps) -> Tensor", &rmsnorm);
  m.def("add_rmsnorm_(Tensor(a!) x, Tensor delta, Tensor w, float eps) -> Tensor", &add_rmsnorm_);
  m.def("qk_rope(Tensor qkv, int n_heads, int n_kv, int head_dim, Tensor? q_norm, Tensor? k_norm, str norm, "
        "float eps, float clip, Tensor cos, Tensor sin) -> (Tensor, Tensor, Tensor)", &qk_rope);
  m.def("route(Tensor logits, int k, bool renorm) -> (Tensor, Tensor)", &route);
  m.def("decode_attention(Tensor q, Tensor kc, Tensor vc, Tensor slots, Tensor lens, int window, float scale) "
        "-> Tensor", &decode_attention);
  m.def("isa() -> str", &isa);
}
