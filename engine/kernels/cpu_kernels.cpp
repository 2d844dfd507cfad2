// moetune's CPU kernels: products of fp32 activations with bf16 or fp16 weights, computed in fp32.
//
// Why: on CPUs without AVX512_BF16/AMX, oneDNN emulates bf16 products and they run no faster than
// fp32 ones while reading half the bytes, so the engine used to widen every weight to fp32 and
// decode read twice the bytes it needs. These kernels widen 16 weights at a time in registers (a
// shift for bf16, vcvtph2ps for fp16) and accumulate in fp32: the arithmetic of an fp32 product on
// the stored weights, at the memory traffic of the stored dtype.
//
// Ops (namespace moetune):
//   linear(x[T,K] f32, w[N,K] bf16|f16, bias[N] f32?) -> [T,N] f32
//   moe(h[T,H] f32, w13[E,2I,H], w2[E,H,I], ids[T,k] i64 (-1 = skipped), gates[T,k] f32) -> [T,H] f32
//   moe_list: moe with the experts given as lists of per-expert [2I,H] and [H,I] tensors
//   (undefined entries for experts no token routes to).
//
// Built on first use by engine/kernels/__init__.py with the system C++ compiler and -march=native;
// threads come from PyTorch's OpenMP pool (torch.set_num_threads).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kPrefetch = 512;  // weights ahead of the current one

struct Bf16 {};
struct F16 {};

inline float widen(uint16_t v, Bf16) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline float widen(uint16_t v, F16) { return static_cast<float>(c10::Half(v, c10::Half::from_bits())); }

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
constexpr const char* kIsa = "scalar";
#endif

// s[r * NT + t] = dot(w[r][0:K], x[t][0:K]) for NR weight rows and NT activation rows.
template <typename WT, int NR, int NT>
inline void dots(const uint16_t* const* w, const float* const* x, int64_t K, float* s) {
  vec acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    if ((k & 31) == 0)  // one prefetch per 64-byte line of each row, 1 KiB ahead: more reads in flight
      for (int r = 0; r < NR; ++r) __builtin_prefetch(w[r] + k + kPrefetch);
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
inline void tile(const uint16_t* const* w, const float* const* x, int64_t K, int64_t r, int64_t t, Sink& sink) {
  float s[NR * NT];
  dots<WT, NR, NT>(w, x, K, s);
  for (int i = 0; i < NR; ++i)
    for (int j = 0; j < NT; ++j) sink(r + i, t + j, s[i * NT + j]);
}

template <typename WT, int NR, typename Sink>
inline void row_block(const uint16_t* const* w, const float* const* xs, int64_t n_tok, int64_t K, int64_t r,
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
void rows_times_tokens(const uint16_t* W, int64_t ldw, int64_t r0, int64_t r1, const float* const* xs,
                       int64_t n_tok, int64_t K, Sink& sink) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const uint16_t* w[4] = {W + r * ldw, W + (r + 1) * ldw, W + (r + 2) * ldw, W + (r + 3) * ldw};
    row_block<WT, 4>(w, xs, n_tok, K, r, sink);
  }
  for (; r < r1; ++r) {
    const uint16_t* w[1] = {W + r * ldw};
    row_block<WT, 1>(w, xs, n_tok, K, r, sink);
  }
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

template <typename WT>
void linear_impl(const at::Tensor& x, const at::Tensor& w, const float* bias, at::Tensor& y) {
  const int64_t T = x.size(0), K = x.size(1), N = w.size(0);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  std::vector<const float*> xs(T);
  for (int64_t t = 0; t < T; ++t) xs[t] = xp + t * K;
  const uint16_t* W = bits(w);
  const int64_t block = 16;
  const int64_t n_blocks = (N + block - 1) / block;
  at::parallel_for(0, n_blocks, 1, [&](int64_t b0, int64_t b1) {
    auto sink = [&](int64_t r, int64_t t, float v) { yp[t * N + r] = v + (bias ? bias[r] : 0.f); };
    rows_times_tokens<WT>(W, K, b0 * block, std::min(N, b1 * block), xs.data(), T, K, sink);
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  check_act(x, "linear");
  check_weight(w, "linear");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1), "moetune::linear: shapes ", x.sizes(), " and ",
              w.sizes(), " do not match");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == w.size(0),
                "moetune::linear: bias must be a contiguous float32 vector of ", w.size(0));
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  if (w.scalar_type() == at::kBFloat16)
    linear_impl<Bf16>(x, w, b, y);
  else
    linear_impl<F16>(x, w, b, y);
  return y;
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

// The routed experts of T tokens: tokens grouped by expert (counting sort), then
//   phase 1: for each expert and block of its rows, gate and up products of its tokens -> act
//   phase 2: for each block of output rows, every expert's down product of its tokens, weighted
//            by the gate and summed per token (a thread owns its output rows: no races).
template <typename WT>
at::Tensor moe_impl(const at::Tensor& h, const std::vector<const uint16_t*>& w13, const std::vector<const uint16_t*>& w2,
                    int64_t inter, const at::Tensor& ids, const at::Tensor& gates) {
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
    auto gate_sink = [&](int64_t r, int64_t t, float v) { g[(r - item.r0) * n + t] = v; };
    rows_times_tokens<WT>(w13[item.e], H, item.r0, item.r1, xs.data() + p0, n, H, gate_sink);
    auto up_sink = [&](int64_t r, int64_t t, float v) {
      const int64_t i = r - inter;
      act[(p0 + t) * inter + i] = silu(g[(i - item.r0) * n + t]) * v;
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
      auto sink = [&](int64_t r, int64_t t, float v) { op[tok[p0 + t] * H + r] += gate[p0 + t] * v; };
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
  std::vector<const uint16_t*> a(E), b(E);
  for (int64_t e = 0; e < E; ++e) {
    a[e] = bits(w13) + e * 2 * inter * H;
    b[e] = bits(w2) + e * H * inter;
  }
  return w13.scalar_type() == at::kBFloat16 ? moe_impl<Bf16>(h, a, b, inter, ids, gates)
                                            : moe_impl<F16>(h, a, b, inter, ids, gates);
}

using OptTensors = c10::List<std::optional<at::Tensor>>;

at::Tensor moe_list(const at::Tensor& h, const OptTensors& w13_list, const OptTensors& w2_list,
                    const at::Tensor& ids, const at::Tensor& gates) {
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
  std::vector<const uint16_t*> a(E, nullptr), b(E, nullptr);
  int64_t inter = -1;
  at::ScalarType dtype = at::kBFloat16;
  for (int64_t e = 0; e < E; ++e) {
    if (!w13[e].defined() || !w2[e].defined()) continue;
    check_weight(w13[e], "moe_list");
    check_weight(w2[e], "moe_list");
    if (inter < 0) {
      inter = w2[e].size(1);
      dtype = w13[e].scalar_type();
    }
    TORCH_CHECK(w13[e].scalar_type() == dtype && w2[e].scalar_type() == dtype,
                "moetune::moe_list: experts of one call must share a dtype");
    TORCH_CHECK(w13[e].dim() == 2 && w13[e].size(0) == 2 * inter && w13[e].size(1) == H && w2[e].dim() == 2 &&
                    w2[e].size(0) == H && w2[e].size(1) == inter,
                "moetune::moe_list: expert ", e, " has shapes ", w13[e].sizes(), " and ", w2[e].sizes());
    a[e] = bits(w13[e]);
    b[e] = bits(w2[e]);
  }
  if (inter < 0) return at::zeros({h.size(0), H}, h.options());
  return dtype == at::kBFloat16 ? moe_impl<Bf16>(h, a, b, inter, ids, gates)
                                : moe_impl<F16>(h, a, b, inter, ids, gates);
}

std::string isa() { return kIsa; }

}  // namespace

TORCH_LIBRARY(moetune, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? bias=None) -> Tensor", &linear);
  m.def("moe(Tensor h, Tensor w13, Tensor w2, Tensor ids, Tensor gates) -> Tensor", &moe);
  m.def("moe_list(Tensor h, Tensor?[] w13, Tensor?[] w2, Tensor ids, Tensor gates) -> Tensor", &moe_list);
  m.def("isa() -> str", &isa);
}
