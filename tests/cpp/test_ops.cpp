// Each CPU op against a naive float64 reference on random inputs of several shapes.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend.h"
#include "graph.h"
#include "planner.h"
#include "quant.h"

namespace ggraph {
namespace {

std::vector<float> randn(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Runs a one-output graph on a fresh CPU backend.
std::vector<float> run(Graph& g, int n_threads = 2) {
  plan(g);
  auto be = make_cpu_backend(n_threads);
  be->reserve(g.scratch_size, g.input_size);
  std::vector<float> out(g.output()->n_elements(), NAN);
  be->compute(g, out.data());
  return out;
}

// ||a - b|| / ||b||
double rel_err(const std::vector<float>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// An F32 scratch tensor holding given values: the sum of a weight-like leaf and nothing else
// would need a copy op, so tests feed activations through get_rows of an F32 table.
Tensor* activations(Graph& g, const std::vector<float>& x, int64_t ne0, int64_t ne1,
                    std::vector<int32_t>& ids) {
  ids.resize(ne1);
  for (int64_t i = 0; i < ne1; ++i) ids[i] = int32_t(i);
  Tensor* table = g.weight(DType::F32, ne0, ne1, const_cast<float*>(x.data()), "x");
  return g.get_rows(table, g.input_i32(ne1, ids.data(), "ids"));
}

struct Shape {
  int64_t ne0, ne1;
};
const Shape kShapes[] = {{32, 1}, {64, 3}, {576, 7}, {96, 17}};

TEST(CpuOps, RmsNormMatchesReference) {
  std::mt19937 rng(1);
  for (Shape s : kShapes) {
    auto x = randn(s.ne0 * s.ne1, rng, 3.0f);
    Graph g;
    std::vector<int32_t> ids;
    g.set_output(g.rms_norm(activations(g, x, s.ne0, s.ne1, ids), 1e-5f));
    auto out = run(g);
    std::vector<double> ref(x.size());
    for (int64_t j = 0; j < s.ne1; ++j) {
      double ss = 0;
      for (int64_t i = 0; i < s.ne0; ++i) ss += double(x[j * s.ne0 + i]) * x[j * s.ne0 + i];
      const double scale = 1.0 / std::sqrt(ss / s.ne0 + 1e-5);
      for (int64_t i = 0; i < s.ne0; ++i) ref[j * s.ne0 + i] = x[j * s.ne0 + i] * scale;
    }
    EXPECT_LT(rel_err(out, ref), 1e-6) << s.ne0 << "x" << s.ne1;
  }
}

TEST(CpuOps, AddMulSwigluMatchReferenceWithBroadcast) {
  std::mt19937 rng(2);
  for (Shape s : kShapes) {
    for (bool broadcast : {false, true}) {
      const int64_t b_cols = broadcast ? 1 : s.ne1;
      auto a = randn(s.ne0 * s.ne1, rng), b = randn(s.ne0 * b_cols, rng);
      for (int which = 0; which < 3; ++which) {
        if (which == 2 && broadcast) continue;  // swiglu takes equal shapes
        Graph g;
        std::vector<int32_t> ia, ib;
        Tensor* ta = activations(g, a, s.ne0, s.ne1, ia);
        Tensor* tb = activations(g, b, s.ne0, b_cols, ib);
        g.set_output(which == 0 ? g.add(ta, tb) : which == 1 ? g.mul(ta, tb) : g.swiglu(ta, tb));
        auto out = run(g);
        std::vector<double> ref(a.size());
        for (int64_t j = 0; j < s.ne1; ++j)
          for (int64_t i = 0; i < s.ne0; ++i) {
            const double x = a[j * s.ne0 + i], y = b[(broadcast ? 0 : j) * s.ne0 + i];
            ref[j * s.ne0 + i] = which == 0   ? x + y
                                 : which == 1 ? x * y
                                              : x / (1 + std::exp(-x)) * y;
          }
        EXPECT_LT(rel_err(out, ref), 1e-6) << "op " << which << " " << s.ne0 << "x" << s.ne1;
      }
    }
  }
}

// Relative error bound of a mul_mat per weight type: float weights are exact up to float32
// accumulation; quantized weights meet 8-bit activations (about 2^-8 relative per element).
double mul_mat_bound(DType t) {
  switch (t) {
    case DType::F32:
      return 1e-5;
    case DType::F16:
    case DType::BF16:
      return 1e-5;
    default:
      return 2e-2;
  }
}

TEST(CpuOps, MulMatEveryTypeMatchesReference) {
  std::mt19937 rng(3);
  const DType types[] = {DType::F32,  DType::F16,  DType::BF16,
                         DType::Q8_0, DType::Q4_0, DType::Q4_1};
  const struct {
    int64_t k, n, t;
  } shapes[] = {{32, 1, 1}, {64, 17, 3}, {576, 33, 7}, {1536, 40, 1}, {256, 5, 33}};
  for (DType type : types) {
    for (auto s : shapes) {
      auto wf = randn(s.k * s.n, rng, 0.1f);
      std::vector<uint8_t> wq(row_size(type, s.k) * s.n);
      for (int64_t r = 0; r < s.n; ++r)
        quantize_row(type, wf.data() + r * s.k, wq.data() + r * row_size(type, s.k), s.k);
      // The reference multiplies the weights as stored (dequantized) in float64.
      std::vector<float> wd(wf.size());
      for (int64_t r = 0; r < s.n; ++r)
        dequantize_row(type, wq.data() + r * row_size(type, s.k), wd.data() + r * s.k, s.k);
      auto x = randn(s.k * s.t, rng);
      Graph g;
      std::vector<int32_t> ids;
      Tensor* w = g.weight(type, s.k, s.n, wq.data(), "w");
      g.set_output(g.mul_mat(w, activations(g, x, s.k, s.t, ids)));
      auto out = run(g);
      std::vector<double> ref(s.n * s.t);
      for (int64_t c = 0; c < s.t; ++c)
        for (int64_t r = 0; r < s.n; ++r) {
          double acc = 0;
          for (int64_t i = 0; i < s.k; ++i) acc += double(wd[r * s.k + i]) * x[c * s.k + i];
          ref[c * s.n + r] = acc;
        }
      EXPECT_LT(rel_err(out, ref), mul_mat_bound(type))
          << type_name(type) << " k=" << s.k << " n=" << s.n << " t=" << s.t;
    }
  }
}

TEST(CpuOps, GetRowsDequantizesEveryType) {
  std::mt19937 rng(4);
  const DType types[] = {DType::F32,  DType::F16,  DType::BF16,
                         DType::Q8_0, DType::Q4_0, DType::Q4_1};
  for (DType type : types) {
    const int64_t k = 64, n = 11;
    auto wf = randn(k * n, rng);
    std::vector<uint8_t> wq(row_size(type, k) * n);
    for (int64_t r = 0; r < n; ++r)
      quantize_row(type, wf.data() + r * k, wq.data() + r * row_size(type, k), k);
    std::vector<int32_t> ids = {3, 0, 10, 3, 7};
    Graph g;
    g.set_output(g.get_rows(g.weight(type, k, n, wq.data(), "t"),
                            g.input_i32(int64_t(ids.size()), ids.data(), "ids")));
    auto out = run(g);
    std::vector<double> ref;
    std::vector<float> row(k);
    for (int32_t id : ids) {
      dequantize_row(type, wq.data() + id * row_size(type, k), row.data(), k);
      ref.insert(ref.end(), row.begin(), row.end());
    }
    EXPECT_EQ(rel_err(out, ref), 0.0) << type_name(type);
  }
}

void rope_reference(const std::vector<float>& x, const std::vector<int32_t>& pos, int n_head,
                    int hd, int n_dims, int mode, double base, std::vector<double>& out) {
  const int64_t width = int64_t(n_head) * hd;
  out.assign(x.begin(), x.end());
  for (size_t t = 0; t < pos.size(); ++t)
    for (int h = 0; h < n_head; ++h)
      for (int i = 0; i < n_dims / 2; ++i) {
        const double theta = pos[t] * std::pow(base, -2.0 * i / n_dims);
        const int a = mode == kRopeNeox ? i : 2 * i;
        const int b = mode == kRopeNeox ? i + n_dims / 2 : 2 * i + 1;
        const double x0 = x[t * width + h * hd + a], x1 = x[t * width + h * hd + b];
        out[t * width + h * hd + a] = x0 * std::cos(theta) - x1 * std::sin(theta);
        out[t * width + h * hd + b] = x0 * std::sin(theta) + x1 * std::cos(theta);
      }
}

TEST(CpuOps, RopeBothModesMatchReference) {
  std::mt19937 rng(5);
  const struct { int n_head, hd, n_dims; } cases[] = {{4, 64, 64}, {3, 32, 16}, {9, 64, 64}};
  for (int mode : {kRopeNormal, kRopeNeox}) {
    for (auto c : cases) {
      std::vector<int32_t> pos = {0, 1, 5, 100, 4095};
      auto x = randn(size_t(c.n_head) * c.hd * pos.size(), rng);
      Graph g;
      std::vector<int32_t> ids;
      Tensor* xt = activations(g, x, int64_t(c.n_head) * c.hd, int64_t(pos.size()), ids);
      g.set_output(g.rope(xt, g.input_i32(int64_t(pos.size()), pos.data(), "pos"), c.n_head, c.hd,
                          c.n_dims, mode, 10000.0f));
      auto out = run(g);
      std::vector<double> ref;
      rope_reference(x, pos, c.n_head, c.hd, c.n_dims, mode, 10000.0, ref);
      EXPECT_LT(rel_err(out, ref), 1e-5) << "mode " << mode << " n_dims " << c.n_dims;
    }
  }
}

// Causal GQA attention over a cache that already holds `n_past` rows, against float64 on the
// values as the cache stores them; returns the relative error against float64 on the values
// before they were stored (the cache format's own error). window > 0: the query at position p
// sees keys p - window + 1 .. p only. A Q8_0 cache needs heads of whole 32-blocks: other head
// sizes are skipped for it (Context refuses them).
double check_attention(DType cache_type, int n_head, int n_head_kv, int hd, int n_past, int n_tok,
                       std::mt19937& rng, int window = 0) {
  if (hd % type_traits(cache_type).block_size != 0) return 0.0;
  const int n_ctx = n_past + n_tok + 5;
  const int64_t kv_w = int64_t(n_head_kv) * hd;
  const size_t row = row_size(cache_type, kv_w);
  std::vector<uint8_t> kc(row * n_ctx), vc(row * n_ctx);
  auto k_all = randn(kv_w * (n_past + n_tok), rng), v_all = randn(kv_w * (n_past + n_tok), rng);
  for (int p = 0; p < n_past; ++p) {  // the earlier positions, already in the cache
    quantize_row(cache_type, k_all.data() + p * kv_w, kc.data() + p * row, kv_w);
    quantize_row(cache_type, v_all.data() + p * kv_w, vc.data() + p * row, kv_w);
  }
  auto q = randn(size_t(n_head) * hd * n_tok, rng);
  std::vector<float> k_new(k_all.begin() + n_past * kv_w, k_all.end());
  std::vector<float> v_new(v_all.begin() + n_past * kv_w, v_all.end());
  Graph g;
  std::vector<int32_t> iq, ik, iv;
  Tensor* kt = g.kv_cache(cache_type, kv_w, n_ctx, kc.data(), "k");
  Tensor* vt = g.kv_cache(cache_type, kv_w, n_ctx, vc.data(), "v");
  g.kv_store(kt, activations(g, k_new, kv_w, n_tok, ik), n_past);
  g.kv_store(vt, activations(g, v_new, kv_w, n_tok, iv), n_past);
  const float scale = 1.0f / std::sqrt(float(hd));
  g.set_output(g.attention(activations(g, q, int64_t(n_head) * hd, n_tok, iq), kt, vt, n_head,
                           n_head_kv, hd, scale, n_past + n_tok, n_past, window));
  auto out = run(g);
  // Reference on the values as the cache stores them.
  std::vector<float> kr(k_all.size()), vr(v_all.size());
  for (int p = 0; p < n_past + n_tok; ++p) {
    std::vector<uint8_t> tmp(row);
    quantize_row(cache_type, k_all.data() + p * kv_w, tmp.data(), kv_w);
    dequantize_row(cache_type, tmp.data(), kr.data() + p * kv_w, kv_w);
    quantize_row(cache_type, v_all.data() + p * kv_w, tmp.data(), kv_w);
    dequantize_row(cache_type, tmp.data(), vr.data() + p * kv_w, kv_w);
  }
  auto reference = [&](const std::vector<float>& kv_k, const std::vector<float>& kv_v) {
    std::vector<double> ref(q.size());
    for (int t = 0; t < n_tok; ++t)
      for (int h = 0; h < n_head; ++h) {
        const int hk = h / (n_head / n_head_kv), len = n_past + t + 1;
        const int first = window > 0 ? std::max(0, len - window) : 0;
        std::vector<double> s(len, 0.0);
        double mx = -INFINITY, sum = 0;
        for (int p = first; p < len; ++p) {
          double d = 0;
          for (int i = 0; i < hd; ++i)
            d += double(q[(t * n_head + h) * hd + i]) * kv_k[p * kv_w + hk * hd + i];
          s[p] = d * scale;
          mx = std::max(mx, s[p]);
        }
        for (int p = first; p < len; ++p) sum += (s[p] = std::exp(s[p] - mx));
        for (int i = 0; i < hd; ++i) {
          double acc = 0;
          for (int p = first; p < len; ++p) acc += s[p] * kv_v[p * kv_w + hk * hd + i];
          ref[(t * n_head + h) * hd + i] = acc / sum;
        }
      }
    return ref;
  };
  EXPECT_LT(rel_err(out, reference(kr, vr)), 1e-5)
      << type_name(cache_type) << " heads " << n_head << "/" << n_head_kv << " head_dim " << hd
      << " past " << n_past << " tokens " << n_tok << " window " << window;
  return rel_err(out, reference(k_all, v_all));
}

TEST(CpuOps, AttentionCausalGqaMatchesReference) {
  std::mt19937 rng(6);
  for (DType ct : {DType::F32, DType::F16, DType::Q8_0}) {
    check_attention(ct, 4, 4, 32, 0, 1, rng);
    check_attention(ct, 9, 3, 64, 0, 7, rng);
    check_attention(ct, 8, 2, 64, 37, 1, rng);
    check_attention(ct, 6, 1, 16, 100, 13, rng);
    check_attention(ct, 8, 1, 256, 3, 4, rng);  // head_dim 256 with 8 query heads a KV head
    check_attention(ct, 4, 1, 128, 9, 2, rng);
    // Several chunks of 256 keys (split, then merged): decode and short batches at depth, a
    // window across chunk boundaries, and a window that leaves whole chunks empty.
    check_attention(ct, 9, 3, 64, 700, 1, rng);
    check_attention(ct, 8, 2, 32, 600, 3, rng, 300);
    check_attention(ct, 4, 1, 64, 1000, 2, rng, 100);
    check_attention(ct, 6, 6, 16, 511, 1, rng);
    // Prompts at depth: tasks of 16 tokens over chunks, a block's tokens ending in different
    // chunks, with and without a window.
    check_attention(ct, 9, 3, 64, 300, 40, rng);
    check_attention(ct, 8, 2, 32, 230, 37, rng, 100);
  }
}

// Each run of `group` elements divided by its rms: the per-head q/k norms of Qwen 3 and Gemma 3.
TEST(CpuOps, GroupedRmsNormMatchesReference) {
  std::mt19937 rng(8);
  const struct {
    int64_t ne0, ne1, group;
  } cases[] = {{256, 3, 64}, {1024, 5, 256}, {512, 1, 128}, {96, 4, 32}, {64, 2, 64}};
  for (auto c : cases) {
    auto x = randn(c.ne0 * c.ne1, rng, 3.0f);
    // Heads of very different sizes: a norm over the whole column would not rescale each alike.
    for (int64_t i = 0; i < c.ne0 * c.ne1; ++i)
      if ((i / c.group) % 2) x[i] *= 20.0f;
    Graph g;
    std::vector<int32_t> ids;
    g.set_output(g.rms_norm(activations(g, x, c.ne0, c.ne1, ids), 1e-6f, c.group));
    auto out = run(g);
    std::vector<double> ref(x.size());
    for (int64_t s = 0; s < c.ne0 * c.ne1; s += c.group) {
      double ss = 0;
      for (int64_t i = 0; i < c.group; ++i) ss += double(x[s + i]) * x[s + i];
      const double scale = 1.0 / std::sqrt(ss / c.group + 1e-6);
      for (int64_t i = 0; i < c.group; ++i) ref[s + i] = x[s + i] * scale;
    }
    EXPECT_LT(rel_err(out, ref), 1e-6) << c.ne0 << "x" << c.ne1 << " group " << c.group;
  }
}

// A per-head weight (shorter src1) repeats along the column, with and without column broadcast.
TEST(CpuOps, AddMulRepeatAShorterOperandAlongTheColumn) {
  std::mt19937 rng(9);
  const struct {
    int64_t ne0, ne1, nb0;
  } cases[] = {{256, 3, 64}, {1024, 2, 256}, {96, 5, 32}, {64, 1, 64}, {128, 7, 128}};
  for (auto c : cases) {
    for (bool per_column : {false, true}) {
      const int64_t b_cols = per_column ? c.ne1 : 1;
      auto a = randn(c.ne0 * c.ne1, rng), b = randn(c.nb0 * b_cols, rng);
      for (bool add : {false, true}) {
        Graph g;
        std::vector<int32_t> ia, ib;
        Tensor* ta = activations(g, a, c.ne0, c.ne1, ia);
        Tensor* tb = activations(g, b, c.nb0, b_cols, ib);
        g.set_output(add ? g.add(ta, tb) : g.mul(ta, tb));
        auto out = run(g);
        std::vector<double> ref(a.size());
        for (int64_t j = 0; j < c.ne1; ++j)
          for (int64_t i = 0; i < c.ne0; ++i) {
            const double x = a[j * c.ne0 + i];
            const double y = b[(per_column ? j : 0) * c.nb0 + i % c.nb0];
            ref[j * c.ne0 + i] = add ? x + y : x * y;
          }
        EXPECT_LT(rel_err(out, ref), 1e-7)
            << (add ? "add " : "mul ") << c.ne0 << "x" << c.ne1 << " by " << c.nb0 << "x" << b_cols;
      }
    }
  }
}

TEST(CpuOps, ElementwiseRefusesAnOperandThatDoesNotDivideTheColumn) {
  std::vector<float> a(96 * 2, 1.0f), b(64, 1.0f);
  Graph g;
  std::vector<int32_t> ia, ib;
  Tensor* ta = activations(g, a, 96, 2, ia);
  Tensor* tb = activations(g, b, 64, 1, ib);
  EXPECT_ANY_THROW(g.add(ta, tb));
  EXPECT_ANY_THROW(g.rms_norm(ta, 1e-6f, 64));
}

// GeGLU with the tanh-approximated GELU (ggml's gelu), over the range where the approximation
// and its saturation both matter.
TEST(CpuOps, GegluMatchesTanhGeluReference) {
  std::mt19937 rng(10);
  for (Shape s : kShapes) {
    auto gate = randn(s.ne0 * s.ne1, rng, 4.0f), up = randn(s.ne0 * s.ne1, rng);
    Graph g;
    std::vector<int32_t> ig, iu;
    g.set_output(
        g.geglu(activations(g, gate, s.ne0, s.ne1, ig), activations(g, up, s.ne0, s.ne1, iu)));
    auto out = run(g);
    std::vector<double> ref(gate.size());
    const double c = std::sqrt(2.0 / M_PI);
    for (size_t i = 0; i < gate.size(); ++i) {
      const double x = gate[i];
      ref[i] = 0.5 * x * (1.0 + std::tanh(c * (x + 0.044715 * x * x * x))) * up[i];
    }
    EXPECT_LT(rel_err(out, ref), 1e-6) << s.ne0 << "x" << s.ne1;
  }
}

TEST(CpuOps, SoftcapMatchesReferenceAndRefusesBadCaps) {
  std::mt19937 rng(11);
  for (float cap : {30.0f, 1.0f, 50.0f}) {
    auto x = randn(576 * 3, rng, 40.0f);  // values far past the cap saturate
    Graph g;
    std::vector<int32_t> ids;
    g.set_output(g.softcap(activations(g, x, 576, 3, ids), cap));
    auto out = run(g);
    std::vector<double> ref(x.size());
    for (size_t i = 0; i < x.size(); ++i) ref[i] = cap * std::tanh(double(x[i]) / cap);
    EXPECT_LT(rel_err(out, ref), 1e-6) << "cap " << cap;
    for (size_t i = 0; i < out.size(); ++i) ASSERT_LE(std::fabs(out[i]), cap) << i;
  }
  Graph g;
  std::vector<float> x(64, 1.0f);
  std::vector<int32_t> ids;
  Tensor* t = activations(g, x, 64, 1, ids);
  EXPECT_ANY_THROW(g.softcap(t, 0.0f));
  EXPECT_ANY_THROW(g.softcap(t, -30.0f));
  EXPECT_ANY_THROW(g.softcap(t, INFINITY));
  EXPECT_ANY_THROW(g.softcap(t, NAN));
}

TEST(CpuOps, ScaledGetRowsMultipliesEveryGatheredValue) {
  std::mt19937 rng(12);
  for (DType type : {DType::F32, DType::Q8_0, DType::Q4_0}) {
    const int64_t k = 640, n = 9;
    auto wf = randn(k * n, rng);
    std::vector<uint8_t> wq(row_size(type, k) * n);
    for (int64_t r = 0; r < n; ++r)
      quantize_row(type, wf.data() + r * k, wq.data() + r * row_size(type, k), k);
    std::vector<int32_t> ids = {8, 0, 4, 4};
    const float scale = std::sqrt(640.0f);
    Graph g;
    g.set_output(g.get_rows(g.weight(type, k, n, wq.data(), "t"),
                            g.input_i32(int64_t(ids.size()), ids.data(), "ids"), scale));
    auto out = run(g);
    std::vector<double> ref;
    std::vector<float> row(k);
    for (int32_t id : ids) {
      dequantize_row(type, wq.data() + id * row_size(type, k), row.data(), k);
      for (float v : row) ref.push_back(double(v) * std::sqrt(640.0));
    }
    EXPECT_LT(rel_err(out, ref), 1e-7) << type_name(type);
  }
}

// Sliding windows shorter than the context (the mask shows), as long as it (no-op) and longer;
// GQA ratios 1 to 8 and head sizes 64 to 256 (attention never assumes n_embd / n_head).
TEST(CpuOps, WindowedAttentionMatchesReference) {
  std::mt19937 rng(13);
  for (DType ct : {DType::F32, DType::F16, DType::Q8_0}) {
    check_attention(ct, 4, 4, 64, 0, 9, rng, 4);      // prompt past a window of 4
    check_attention(ct, 4, 2, 128, 30, 1, rng, 8);    // decode step, 23 keys outside
    check_attention(ct, 8, 2, 256, 20, 13, rng, 16);  // prompt after a past, crossing the edge
    check_attention(ct, 8, 1, 256, 5, 3, rng, 512);   // window longer than the context
    check_attention(ct, 16, 2, 64, 40, 1, rng, 41);   // window exactly the context
    check_attention(ct, 16, 2, 128, 40, 1, rng, 40);  // one key short of it
    check_attention(ct, 8, 8, 128, 0, 17, rng, 1);    // a window of one: attend to itself
    check_attention(ct, 32, 4, 64, 64, 5, rng, 32);
  }
}

// What a cache format costs attention, against float64 on the values before they were stored
// (keys, values and queries N(0, 1), scores N(0, 1) after the 1/sqrt(head_dim) scale). F16
// rounds each value by at most 2^-11 relative (rms about 3e-4); the output's relative error is of
// that order, from V directly and from K through the softmax weights: bound 2e-3. Q8_0 rounds to
// a step of amax/127 per 32 values, amax about 2.1 sigma for 32 normal values, so an rms error
// of 2.1 / 127 / sqrt(12) = 0.5% of sigma a value; through V and through K's scores, about 0.7%
// of the output: bound 2e-2. Q8_0's error is also checked to be there (above F16's bound): the
// cache really holds 8-bit values.
TEST(CpuOps, AttentionErrorOfEachCacheFormatIsWithinItsRoundingBound) {
  const struct {
    int n_head, n_head_kv, hd, n_past, n_tok;
  } cases[] = {{9, 3, 64, 0, 7}, {9, 3, 64, 700, 1}, {8, 2, 128, 300, 4}, {8, 1, 256, 40, 2}};
  std::mt19937 rng(14);
  for (const auto& c : cases) {
    const double f32 =
        check_attention(DType::F32, c.n_head, c.n_head_kv, c.hd, c.n_past, c.n_tok, rng);
    const double f16 =
        check_attention(DType::F16, c.n_head, c.n_head_kv, c.hd, c.n_past, c.n_tok, rng);
    const double q8 =
        check_attention(DType::Q8_0, c.n_head, c.n_head_kv, c.hd, c.n_past, c.n_tok, rng);
    EXPECT_LT(f32, 1e-5) << "head_dim " << c.hd << " past " << c.n_past;
    EXPECT_LT(f16, 2e-3) << "head_dim " << c.hd << " past " << c.n_past;
    EXPECT_LT(q8, 2e-2) << "head_dim " << c.hd << " past " << c.n_past;
    EXPECT_GT(q8, 2e-3) << "head_dim " << c.hd << " past " << c.n_past;
  }
}

TEST(CpuOps, ThreadCountDoesNotChangeResults) {
  std::mt19937 rng(7);
  const int64_t k = 576, n = 200, t = 9;
  auto wf = randn(k * n, rng, 0.1f);
  std::vector<uint8_t> wq(row_size(DType::Q4_1, k) * n);
  for (int64_t r = 0; r < n; ++r)
    quantize_row(DType::Q4_1, wf.data() + r * k, wq.data() + r * row_size(DType::Q4_1, k), k);
  auto x = randn(k * t, rng);
  std::vector<float> results[2];
  for (int threads : {1, 2}) {
    Graph g;
    std::vector<int32_t> ids;
    g.set_output(
        g.mul_mat(g.weight(DType::Q4_1, k, n, wq.data(), "w"), activations(g, x, k, t, ids)));
    results[threads - 1] = run(g, threads);
  }
  EXPECT_EQ(results[0], results[1]);
}

TEST(CpuOps, PaddingTokensOfAPoolBatchStoreNothingAndLeaveTheOthersAlone) {
  // Two sequences of 4 rows of 8 in a pool; a batch of three tokens, the middle one padding
  // (sequence -1), as a batch padded to its size class carries.
  const int64_t width = 8, rows = 4;
  std::vector<float> pool(size_t(width * rows * 2), 7.0f);
  std::vector<float> x = {1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
  std::vector<int32_t> slots = {1, -1, 0, 2, 0, 3};  // sequences, then positions
  std::vector<int32_t> ids;
  Graph g;
  Tensor* p = g.kv_pool(DType::F32, width, int(rows), 2, pool.data(), "pool");
  Tensor* xs = activations(g, x, width, 3, ids);
  g.set_output(g.kv_store_seqs(p, xs, g.input_i32(6, slots.data(), "slots")));
  run(g);
  for (int64_t r = 0; r < rows * 2; ++r) {
    const float want = r == 1 * rows + 2 ? 1.0f : r == 0 * rows + 3 ? 3.0f : 7.0f;
    for (int64_t i = 0; i < width; ++i) EXPECT_EQ(pool[size_t(r * width + i)], want) << r;
  }
}

TEST(Planner, EqualTopologiesGetEqualOffsetsAndLiveTensorsNeverOverlap) {
  std::vector<float> w(64 * 64, 0.5f), table(64 * 10, 1.0f);
  std::vector<int32_t> ids = {1, 2, 3};
  auto build = [&](Graph& g) {
    Tensor* x = g.get_rows(g.weight(DType::F32, 64, 10, table.data(), "t"),
                           g.input_i32(3, ids.data(), "ids"));
    for (int i = 0; i < 4; ++i)
      x = g.add(x, g.mul_mat(g.weight(DType::F32, 64, 64, w.data(), "w"), g.rms_norm(x, 1e-5f)));
    g.set_output(x);
    plan(g);
  };
  Graph a, b;
  build(a);
  build(b);
  ASSERT_EQ(a.nodes().size(), b.nodes().size());
  for (size_t i = 0; i < a.nodes().size(); ++i)
    EXPECT_EQ(a.nodes()[i]->offset, b.nodes()[i]->offset);
  // A node's output never overlaps an input it reads.
  for (const Tensor* t : a.nodes()) {
    if (t->storage != Storage::Scratch) continue;
    for (const Tensor* s : t->src) {
      if (!s || s->storage != Storage::Scratch) continue;
      const bool disjoint =
          t->offset + t->nbytes() <= s->offset || s->offset + s->nbytes() <= t->offset;
      EXPECT_TRUE(disjoint) << op_name(t->op) << " overlaps its input " << op_name(s->op);
    }
  }
  EXPECT_LT(a.scratch_size, size_t(20) * 64 * 3 * 4 + 20 * kPlanAlignment);
}

// A one-column norm after a residual add, its weight, and the products of its result: with
// fold_room the add's inputs and result stay allocated through the products' readers (a fold
// reads them there); without it the planner takes their room back as soon as it may.
TEST(Planner, KeepsANormsInputsForAFoldOnlyWhenAsked) {
  std::vector<float> w(64 * 64, 0.5f), table(64 * 10, 1.0f), wn(64, 1.0f);
  std::vector<int32_t> id1 = {1}, id2 = {2};
  for (bool fold_room : {false, true}) {
    Graph g;
    Tensor* t = g.weight(DType::F32, 64, 10, table.data(), "t");
    Tensor* x = g.get_rows(t, g.input_i32(1, id1.data(), "id1"));
    Tensor* y = g.get_rows(t, g.input_i32(1, id2.data(), "id2"));
    Tensor* a = g.add(x, y);
    Tensor* r = g.rms_norm(a, 1e-5f);
    Tensor* m = g.mul(r, g.weight(DType::F32, 64, 1, wn.data(), "wn"));
    Tensor* p = g.mul_mat(g.weight(DType::F32, 64, 64, w.data(), "w"), m);
    Tensor* q = g.mul_mat(g.weight(DType::F32, 64, 64, w.data(), "w2"), m);
    g.set_output(g.add(g.add(p, q), g.get_rows(t, g.input_i32(1, id1.data(), "id3"))));
    plan(g, fold_room);
    const int reach = norm_fold_reach(g.nodes(), r->index);
    ASSERT_GT(reach, q->index);
    bool overlapped = false;
    for (int j = r->index + 1; j <= reach; ++j) {
      const Tensor* n = g.nodes()[size_t(j)];
      if (n->storage != Storage::Scratch) continue;
      for (const Tensor* kept : {x, y, a})
        overlapped |=
            n->offset < kept->offset + kept->nbytes() && kept->offset < n->offset + n->nbytes();
    }
    EXPECT_EQ(overlapped, !fold_room) << "fold_room " << fold_room;
  }
}

}  // namespace
}  // namespace ggraph
