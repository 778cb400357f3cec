// Every CUDA op against a float64 reference computed here from the dequantized inputs, and
// against the CPU backend on the same one-op graph: every weight format, shapes that are not
// multiples of the block or tile sizes, batches on both sides of the mat-vec/tiled switch.
// Scratch and workspaces are poisoned (NaN bytes) before every run. Skips without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "backend.h"
#include "cuda/blas.h"
#include "cuda/cuda_backend.h"
#include "cuda/kernels.cuh"
#include "cuda/weight_layout.h"
#include "graph.h"
#include "planner.h"
#include "quant.h"
#include "sampling.h"

namespace ggraph {
namespace {

std::string gpu_absent_reason() {
  if (!cuda_compiled()) return "this build has no CUDA backend";
  if (cuda_devices().empty()) return "no CUDA device is present";
  return "";
}

#define REQUIRE_GPU()                                \
  do {                                               \
    const std::string reason_ = gpu_absent_reason(); \
    if (!reason_.empty()) GTEST_SKIP() << reason_;   \
  } while (0)

std::vector<float> randn(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// ||a - b|| / ||b||; infinite when a holds a non-finite value.
template <typename T>
double rel_err(const std::vector<float>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    if (!std::isfinite(a[i])) return INFINITY;
    num += (double(a[i]) - double(b[i])) * (double(a[i]) - double(b[i]));
    den += double(b[i]) * double(b[i]);
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// Builds a graph's nodes on a backend (weights go through its upload_weight) and returns the
// output tensor. Host data the graph points at must outlive the run.
using Build = std::function<Tensor*(Graph&, Backend&)>;

std::vector<float> run_on(Backend& be, const Build& build) {
  Graph g;
  Tensor* out = build(g, be);
  g.set_output(out);
  plan(g, be.folds_norms());
  be.reserve(g.scratch_size, g.input_size);
  if (be.is_cuda()) cuda_poison_buffers(be, 0xFF);
  std::vector<float> result(out->n_elements(), NAN);
  be.compute(g, result.data());
  return result;
}

Tensor* upload(Graph& g, Backend& be, DType type, int64_t ne0, int64_t ne1, const void* host,
               const std::string& name) {
  const size_t bytes = row_size(type, ne0) * ne1;
  return g.weight(type, ne0, ne1, be.upload_weight(host, bytes, type, ne0, ne1, name), name);
}

// n standard normal values as F16 bits (cache rows the same on both backends).
std::vector<uint16_t> randn_f16(size_t n, std::mt19937& rng) {
  const std::vector<float> v = randn(n, rng);
  std::vector<uint16_t> h(n);
  for (size_t i = 0; i < n; ++i) h[i] = f32_to_f16(v[i]);
  return h;
}

// An F16 KV cache [w, n_ctx] with the given contents, uploaded through the backend.
Tensor* f16_cache(Graph& g, Backend& be, const std::vector<uint16_t>& data, int64_t w,
                  int64_t n_ctx, const std::string& name) {
  void* p = be.upload_weight(data.data(), data.size() * 2, DType::F16, w, n_ctx, name);
  return g.kv_cache(DType::F16, w, n_ctx, p, name);
}

// A pool of n_seq F16 KV caches of `rows` rows [w] with the given contents.
Tensor* f16_pool(Graph& g, Backend& be, const std::vector<uint16_t>& data, int64_t w, int rows,
                 int n_seq, const std::string& name) {
  void* p = be.alloc_kv(data.size() * 2);
  be.kv_from_host(p, data.data(), data.size() * 2);
  return g.kv_pool(DType::F16, w, rows, n_seq, p, name);
}

// An F32 scratch tensor holding x: get_rows of an F32 table with ids 0..ne1-1.
Tensor* activations(Graph& g, Backend& be, const std::vector<float>& x, int64_t ne0, int64_t ne1,
                    std::vector<int32_t>& ids) {
  ids.resize(ne1);
  for (int64_t i = 0; i < ne1; ++i) ids[i] = int32_t(i);
  Tensor* table = upload(g, be, DType::F32, ne0, ne1, x.data(), "x");
  return g.get_rows(table, g.input_i32(ne1, ids.data(), "ids"));
}

// Quantizes n rows of k floats; returns the bytes and, in deq, the values they decode to.
std::vector<uint8_t> quantize(DType t, const std::vector<float>& w, int64_t k, int64_t n,
                              std::vector<float>& deq) {
  const size_t rb = row_size(t, k);
  std::vector<uint8_t> q(rb * n);
  deq.resize(size_t(k) * n);
  for (int64_t r = 0; r < n; ++r) {
    quantize_row(t, w.data() + r * k, q.data() + r * rb, k);
    dequantize_row(t, q.data() + r * rb, deq.data() + r * k, k);
  }
  return q;
}

const DType kAllTypes[] = {DType::F32,  DType::F16,  DType::BF16,
                           DType::Q8_0, DType::Q4_0, DType::Q4_1};

// What CudaOps::check does, for the helpers that build and check a case.
using CheckFn = std::function<void(const Build&, const std::vector<double>&, double, double,
                                   const std::string&, double)>;

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    REQUIRE_GPU();
    CudaOptions o;
    o.graphs = "off";
    cuda_ = make_cuda_backend(o);
    cpu_ = make_cpu_backend(2);
  }

  // Runs build on both backends; checks CUDA against the reference and against the CPU.
  // Errors are relative to ||ref||, or to `scale` when given (for sums that may cancel).
  void check(const Build& build, const std::vector<double>& ref, double bound_ref, double bound_cpu,
             const std::string& what, double scale = 0) {
    const std::vector<float> gpu = run_on(*cuda_, build);
    const std::vector<float> cpu = run_on(*cpu_, build);
    ASSERT_EQ(gpu.size(), ref.size()) << what;
    double ref_norm = 0;
    for (double v : ref) ref_norm += v * v;
    const double f = scale > 0 ? std::sqrt(ref_norm) / scale : 1.0;
    EXPECT_LT(rel_err(gpu, ref) * f, bound_ref) << "CUDA vs float64 reference: " << what;
    EXPECT_LT(rel_err(gpu, cpu) * f, bound_cpu) << "CUDA vs CPU: " << what;
  }

  // check as a function the case helpers below take.
  CheckFn checker() {
    return [this](const Build& b, const std::vector<double>& r, double br, double bc,
                  const std::string& w, double scale) { check(b, r, br, bc, w, scale); };
  }

  std::unique_ptr<Backend> cuda_, cpu_;
};

// A switch of the CUDA backend (one of its test hooks: sets it, returns the setting it replaced)
// set for a scope.
template <bool (*kSet)(bool)>
struct Switched {
  bool was;
  explicit Switched(bool on) : was(kSet(on)) {}
  ~Switched() { kSet(was); }
};

// ---- get_rows -------------------------------------------------------------------------------

TEST_F(CudaOps, GetRowsDequantizesEveryType) {
  std::mt19937 rng(11);
  for (DType t : kAllTypes) {
    const bool q = type_traits(t).block_size > 1;
    for (int64_t ne0 : {int64_t(32), int64_t(96), int64_t(576), int64_t(q ? 4096 : 33)}) {
      const int64_t n_rows = 37;
      auto table = randn(size_t(ne0) * n_rows, rng);
      std::vector<float> deq;
      auto bytes = quantize(t, table, ne0, n_rows, deq);
      for (int n_ids : {1, 7, 33}) {
        std::vector<int32_t> ids(n_ids);
        std::uniform_int_distribution<int32_t> pick(0, int32_t(n_rows - 1));
        for (auto& id : ids) id = pick(rng);
        std::vector<double> ref;
        for (int32_t id : ids)
          ref.insert(ref.end(), deq.begin() + id * ne0, deq.begin() + (id + 1) * ne0);
        check(
            [&](Graph& g, Backend& be) {
              return g.get_rows(upload(g, be, t, ne0, n_rows, bytes.data(), "table"),
                                g.input_i32(n_ids, ids.data(), "ids"));
            },
            ref, 1e-6, 1e-6, std::string(type_name(t)) + " ne0 " + std::to_string(ne0));
      }
    }
  }
}

TEST_F(CudaOps, GetRowsRejectsAnIdOutOfRangeAndStaysUsable) {
  std::vector<float> table(64 * 4, 1.0f);
  std::vector<int32_t> ids = {0, 4};
  Build bad = [&](Graph& g, Backend& be) {
    return g.get_rows(upload(g, be, DType::F32, 64, 4, table.data(), "t"),
                      g.input_i32(2, ids.data(), "ids"));
  };
  EXPECT_THROW(run_on(*cuda_, bad), ArgumentError);
  ids[1] = 3;
  const auto out = run_on(*cuda_, bad);
  for (float v : out) EXPECT_EQ(v, 1.0f);
}

// ---- rms_norm, add, mul, swiglu --------------------------------------------------------------

struct Shape {
  int64_t ne0, ne1;
};
// Norm rows of one to eight elements a thread (kNormRegElems = 8192 at most), and past them.
const Shape kShapes[] = {{32, 1},   {64, 3},   {576, 7},  {96, 33},   {1536, 1}, {4096, 2},
                         {4097, 1}, {8192, 1}, {8224, 1}, {12288, 2}, {8, 512}};

std::vector<double> rms_norm_ref(const std::vector<float>& x, Shape s, float eps) {
  std::vector<double> ref(x.size());
  for (int64_t j = 0; j < s.ne1; ++j) {
    double ss = 0;
    for (int64_t i = 0; i < s.ne0; ++i) ss += double(x[j * s.ne0 + i]) * x[j * s.ne0 + i];
    const double scale = 1.0 / std::sqrt(ss / s.ne0 + eps);
    for (int64_t i = 0; i < s.ne0; ++i) ref[j * s.ne0 + i] = x[j * s.ne0 + i] * scale;
  }
  return ref;
}

TEST_F(CudaOps, RmsNormAloneAndFusedWithItsWeight) {
  std::mt19937 rng(12);
  for (Shape s : kShapes) {
    auto x = randn(size_t(s.ne0) * s.ne1, rng, 3.0f);
    std::vector<int32_t> ids;
    const auto norm = rms_norm_ref(x, s, 1e-5f);
    check([&](Graph& g,
              Backend& be) { return g.rms_norm(activations(g, be, x, s.ne0, s.ne1, ids), 1e-5f); },
          norm, 1e-6, 1e-6, "rms_norm " + std::to_string(s.ne0) + "x" + std::to_string(s.ne1));
    // Followed by a multiply with a broadcast weight (fused on CUDA) or a per-column one.
    for (bool broadcast : {true, false}) {
      const int64_t w_cols = broadcast ? 1 : s.ne1;
      auto w = randn(size_t(s.ne0) * w_cols, rng);
      std::vector<double> ref(norm.size());
      for (int64_t j = 0; j < s.ne1; ++j)
        for (int64_t i = 0; i < s.ne0; ++i)
          ref[j * s.ne0 + i] = norm[j * s.ne0 + i] * w[(broadcast ? 0 : j) * s.ne0 + i];
      std::vector<int32_t> wids;
      check(
          [&](Graph& g, Backend& be) {
            // The weight first, so that the multiply follows the norm and may fuse with it
            // (a computed weight is loaded only after waiting for the kernel before).
            Tensor* wt = broadcast ? upload(g, be, DType::F32, s.ne0, 1, w.data(), "w")
                                   : activations(g, be, w, s.ne0, w_cols, wids);
            Tensor* n = g.rms_norm(activations(g, be, x, s.ne0, s.ne1, ids), 1e-5f);
            return g.mul(n, wt);
          },
          ref, 1e-6, 1e-6, "rms_norm*w " + std::to_string(s.ne0) + "x" + std::to_string(s.ne1));
    }
  }
}

// One decode column of 2,048 to 8,192 values normalized over a cluster of blocks (sm_90+, the
// test hook; elsewhere the one-block kernel): alone, and as a layer has it, the residual add, the
// norm with its weight and a Q8_0 mat-vec reading the norm's 8-bit form.
TEST_F(CudaOps, RmsNormOfWideColumnsOverClustersOfBlocks) {
  struct Restore {
    int64_t was = cuda::set_norm_cluster_min_width(2048);
    ~Restore() { cuda::set_norm_cluster_min_width(was); }
  } restore;
  std::mt19937 rng(30);
  // One column (a decode step), and a decode batch's few, a cluster each: the 8-bit form for
  // the mat-vec (3 columns), the column tiles for the warp-pipelined product (8 and 16).
  for (int64_t cols : {1, 3, 8, 16}) {
    for (int64_t ne0 : {2048, 4096, 6144, 8192}) {
      const Shape s{ne0, cols};
      const size_t n = size_t(ne0 * cols);
      auto x = randn(n, rng, 3.0f), b = randn(n, rng), w = randn(size_t(ne0), rng);
      std::vector<int32_t> ix, ib;
      const std::string what = std::to_string(ne0) + " x " + std::to_string(cols);
      check([&](Graph& g,
                Backend& be) { return g.rms_norm(activations(g, be, x, ne0, cols, ix), 1e-5f); },
            rms_norm_ref(x, s, 1e-5f), 1e-6, 1e-6, "rms_norm " + what);
      std::vector<float> sum(n);
      for (size_t i = 0; i < n; ++i) sum[i] = x[i] + b[i];
      auto normed = rms_norm_ref(sum, s, 1e-5f);
      for (size_t i = 0; i < normed.size(); ++i) normed[i] *= w[i % size_t(ne0)];
      const int64_t n_out = 64;
      std::vector<float> deq;
      const auto wq =
          quantize(DType::Q8_0, randn(size_t(ne0) * n_out, rng, 0.05f), ne0, n_out, deq);
      std::vector<double> ref(size_t(n_out * cols));
      for (int64_t c = 0; c < cols; ++c)
        for (int64_t j = 0; j < n_out; ++j)
          for (int64_t i = 0; i < ne0; ++i)
            ref[c * n_out + j] += double(deq[j * ne0 + i]) * normed[c * ne0 + i];
      check(
          [&](Graph& g, Backend& be) {
            Tensor* wt = upload(g, be, DType::F32, ne0, 1, w.data(), "norm_w");
            Tensor* h =
                g.add(activations(g, be, x, ne0, cols, ix), activations(g, be, b, ne0, cols, ib));
            Tensor* nm = g.mul(g.rms_norm(h, 1e-5f), wt);
            return g.mul_mat(upload(g, be, DType::Q8_0, ne0, n_out, wq.data(), "wq"), nm);
          },
          ref, 2e-2, 1e-3, "add + rms_norm*w + Q8_0 product " + what);
    }
  }
}

// Gemma's post-norm before the residual add and the next pre-norm: res = x + rms_norm(a) * w1,
// h = rms_norm(res) * w2. CUDA runs the four as one kernel for one column that fits in
// registers; wider rows and several columns take the separate kernels. Both outputs checked.
TEST_F(CudaOps, PostNormResidualAddAndPreNorm) {
  std::mt19937 rng(27);
  for (Shape s : {Shape{64, 1}, Shape{640, 1}, Shape{4096, 1}, Shape{8192, 1}, Shape{8224, 1},
                  Shape{576, 3}}) {
    auto x = randn(size_t(s.ne0) * s.ne1, rng, 2.0f), a = randn(size_t(s.ne0) * s.ne1, rng, 5.0f);
    auto w1 = randn(size_t(s.ne0), rng), w2 = randn(size_t(s.ne0), rng);
    const auto na = rms_norm_ref(a, s, 1e-6f);
    std::vector<float> res(x.size());
    for (size_t i = 0; i < x.size(); ++i) res[i] = float(x[i] + na[i] * w1[i % s.ne0]);
    const auto nr = rms_norm_ref(res, s, 1e-5f);
    for (bool with_res : {false, true}) {
      std::vector<double> ref(x.size());
      for (size_t i = 0; i < ref.size(); ++i)
        ref[i] = nr[i] * w2[i % s.ne0] + (with_res ? double(res[i]) : 0.0);
      std::vector<int32_t> xi, ai;
      check(
          [&](Graph& g, Backend& be) {
            Tensor* w1t = upload(g, be, DType::F32, s.ne0, 1, w1.data(), "w1");
            Tensor* w2t = upload(g, be, DType::F32, s.ne0, 1, w2.data(), "w2");
            Tensor* xt = activations(g, be, x, s.ne0, s.ne1, xi);
            Tensor* at = activations(g, be, a, s.ne0, s.ne1, ai);
            Tensor* r = g.add(xt, g.mul(g.rms_norm(at, 1e-6f), w1t));
            Tensor* h = g.mul(g.rms_norm(r, 1e-5f), w2t);
            return with_res ? g.add(h, r) : h;
          },
          ref, 2e-6, 2e-6,
          "post-norm " + std::to_string(s.ne0) + "x" + std::to_string(s.ne1) +
              (with_res ? " + residual" : ""));
    }
  }
}

TEST_F(CudaOps, NormUsedTwiceIsNotFusedAway) {
  std::mt19937 rng(13);
  const Shape s = {576, 3};
  auto x = randn(size_t(s.ne0) * s.ne1, rng);
  auto w = randn(size_t(s.ne0), rng);
  const auto norm = rms_norm_ref(x, s, 1e-6f);
  std::vector<double> ref(norm.size());
  for (size_t i = 0; i < ref.size(); ++i) ref[i] = norm[i] * w[i % s.ne0] + norm[i];
  std::vector<int32_t> ids;
  check(
      [&](Graph& g, Backend& be) {
        Tensor* n = g.rms_norm(activations(g, be, x, s.ne0, s.ne1, ids), 1e-6f);
        return g.add(g.mul(n, upload(g, be, DType::F32, s.ne0, 1, w.data(), "w")), n);
      },
      ref, 1e-6, 1e-6, "norm*w + norm");
}

TEST_F(CudaOps, AddMulSwigluWithBroadcast) {
  std::mt19937 rng(14);
  for (Shape s : kShapes) {
    for (bool broadcast : {false, true}) {
      const int64_t b_cols = broadcast ? 1 : s.ne1;
      auto a = randn(size_t(s.ne0) * s.ne1, rng), b = randn(size_t(s.ne0) * b_cols, rng);
      for (int which = 0; which < 3; ++which) {
        if (which == 2 && broadcast) continue;
        std::vector<double> ref(a.size());
        for (int64_t j = 0; j < s.ne1; ++j)
          for (int64_t i = 0; i < s.ne0; ++i) {
            const double x = a[j * s.ne0 + i], y = b[(broadcast ? 0 : j) * s.ne0 + i];
            ref[j * s.ne0 + i] = which == 0   ? x + y
                                 : which == 1 ? x * y
                                              : x / (1 + std::exp(-x)) * y;
          }
        std::vector<int32_t> ia, ib;
        check(
            [&](Graph& g, Backend& be) {
              Tensor* ta = activations(g, be, a, s.ne0, s.ne1, ia);
              Tensor* tb = activations(g, be, b, s.ne0, b_cols, ib);
              return which == 0 ? g.add(ta, tb) : which == 1 ? g.mul(ta, tb) : g.swiglu(ta, tb);
            },
            ref, 1e-6, 1e-6,
            "op " + std::to_string(which) + " " + std::to_string(s.ne0) + "x" +
                std::to_string(s.ne1) + (broadcast ? " broadcast" : ""));
      }
    }
  }
}

// ---- mul_mat ----------------------------------------------------------------------------------

// Error bounds (relative, whole output) per path. Mat-vec (<= 8 columns): float weights in
// float32; quantized weights against activations quantized to 8 bits (as the CPU does).
// Tiled (> 8 columns), cuBLAS and the half tensor-core kernel (any columns): activations and
// dequantized weights rounded to half, fp32 accumulation. The 8-bit activations of the mat-vec
// and int8 tensor-core paths carry more error than the half ones.
double mul_mat_bound(DType t, int64_t k, int64_t cols) {
  const bool quantized = type_traits(t).block_size > 1;
  const cuda::MatMulQ kind = cuda::mat_mul_q_kind(t, k, cols);
  if (kind == cuda::MatMulQ::Half) return 3e-3;
  if (cols <= 8 || kind == cuda::MatMulQ::Int8 || kind == cuda::MatMulQ::Int8Warp)
    return quantized ? 2e-2 : 1e-5;
  return 3e-3;
}

// The product, and in *scale the size of its terms: sqrt(sum over outputs of sum_k (w x)^2),
// which is what quantization errors scale with (a single short dot product may cancel).
std::vector<double> mul_mat_ref(const std::vector<float>& w, const std::vector<float>& x, int64_t k,
                                int64_t n, int64_t t, double* scale) {
  std::vector<double> ref(size_t(n) * t);
  double sq = 0;
  for (int64_t c = 0; c < t; ++c)
    for (int64_t r = 0; r < n; ++r) {
      double acc = 0;
      for (int64_t i = 0; i < k; ++i) {
        const double term = double(w[r * k + i]) * x[c * k + i];
        acc += term;
        sq += term * term;
      }
      ref[c * n + r] = acc;
    }
  *scale = std::sqrt(sq);
  return ref;
}

void check_mul_mat(DType t, int64_t k, int64_t n, int64_t cols, std::mt19937& rng,
                   const CheckFn& check) {
  auto wf = randn(size_t(k) * n, rng, 0.05f);
  std::vector<float> deq;
  auto bytes = quantize(t, wf, k, n, deq);
  auto x = randn(size_t(k) * cols, rng);
  double scale = 0;
  const auto ref = mul_mat_ref(deq, x, k, n, cols, &scale);
  const double bound = mul_mat_bound(t, k, cols);
  const bool quantized = type_traits(t).block_size > 1;
  std::vector<int32_t> ids;
  check(
      [&](Graph& g, Backend& be) {
        return g.mul_mat(upload(g, be, t, k, n, bytes.data(), "w"),
                         activations(g, be, x, k, cols, ids));
      },
      // The CPU quantizes activations to 8 bits on both paths, so against it the tiled path
      // differs by the CPU's own error.
      ref, bound, quantized ? 3e-2 : 2 * bound,
      std::string(type_name(t)) + " k " + std::to_string(k) + " n " + std::to_string(n) + " cols " +
          std::to_string(cols),
      scale);
}

// Random blocks of a format whose f16 fields (the scales, at the start or end of a block) are
// small, so that products stay finite; the other bytes (quants, sub-block scales) are random.
// Float formats get random values (random bits would hold infinities and NaNs).
std::vector<uint8_t> random_blocks(DType t, int64_t k, int64_t n, std::mt19937& rng) {
  const TypeTraits& tr = type_traits(t);
  if (tr.block_size == 1) {
    std::vector<float> deq;
    return quantize(t, randn(size_t(k) * n, rng, 0.05f), k, n, deq);
  }
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<uint8_t> bytes(row_size(t, k) * n);
  for (auto& v : bytes) v = uint8_t(byte(rng));
  const size_t nblocks = bytes.size() / tr.type_size;
  for (size_t b = 0; b < nblocks; ++b) {
    uint8_t* blk = bytes.data() + b * tr.type_size;
    const uint16_t small = f32_to_f16(0.001f * float(1 + byte(rng) % 8));
    const bool scale_last = t == DType::Q6_K || t == DType::Q2_K || t == DType::Q3_K;
    uint8_t* d = scale_last ? blk + tr.type_size - (t == DType::Q2_K ? 4 : 2) : blk;
    std::memcpy(d, &small, 2);
    if (t == DType::Q2_K || t == DType::Q4_K || t == DType::Q5_K || t == DType::Q4_1 ||
        t == DType::Q5_1)
      std::memcpy(d + 2, &small, 2);
  }
  return bytes;
}

// Products of random blocks of format t against the float64 product of their decoded values,
// and against the CPU (which computes on the blocks).
void check_random_blocks(DType t, int64_t k, int64_t n, int64_t cols, std::mt19937& rng,
                         const CheckFn& check) {
  const std::vector<uint8_t> bytes = random_blocks(t, k, n, rng);
  std::vector<float> deq(size_t(k) * n);
  for (int64_t r = 0; r < n; ++r)
    dequantize_row(t, bytes.data() + r * row_size(t, k), deq.data() + r * k, k);
  auto x = randn(size_t(k) * cols, rng);
  double scale = 0;
  const auto ref = mul_mat_ref(deq, x, k, n, cols, &scale);
  std::vector<int32_t> ids;
  check(
      [&](Graph& g, Backend& be) {
        Tensor* w =
            g.weight(t, k, n, be.upload_weight(bytes.data(), bytes.size(), t, k, n, "w"), "w");
        return g.mul_mat(w, activations(g, be, x, k, cols, ids));
      },
      ref, 2e-2, cols <= 8 ? 2e-2 : 3e-2,
      std::string(type_name(t)) + " k " + std::to_string(k) + " n " + std::to_string(n) + " cols " +
          std::to_string(cols),
      scale);
}

const DType kKernelOnlyTypes[] = {DType::Q5_0, DType::Q5_1,   DType::Q2_K,
                                  DType::Q3_K, DType::Q4_K,   DType::Q5_K,
                                  DType::Q6_K, DType::IQ4_NL, DType::IQ4_XS};

TEST_F(CudaOps, MulMatEveryTypeShapeAndBatch) {
  std::mt19937 rng(15);
  const CheckFn chk = checker();
  // Odd k and n for every quantized mat-vec kernel: short rows (at most 64 pieces: k <= 2048
  // for 4-bit weights, k <= 1024 for Q8_0; activation in registers), middle ones, and long ones
  // (k 11008: warps split k); rows end mid-block.
  const Shape kn[] = {{32, 1},    {96, 7},    {160, 33},  {256, 3},   {512, 130},
                      {576, 257}, {800, 129}, {1024, 33}, {4096, 65}, {11008, 20}};
  for (DType t : kAllTypes) {
    for (Shape s : kn) {
      for (int64_t cols : {1, 2, 7, 8, 9, 33}) check_mul_mat(t, s.ne0, s.ne1, cols, rng, chk);
    }
    // Many rows, a count no block size divides.
    check_mul_mat(t, 256, 8197, 1, rng, chk);
  }
}

// Every shape of the quantized mat-vec kernel the dispatcher can be asked for (rows a warp,
// pieces in flight, warps sharing a row), not only the ones it picks by default: short rows
// that leave most lanes idle, rows that end mid-round, a last block with rows past the end.
TEST_F(CudaOps, MulMatEveryQuantizedKernelShape) {
  std::mt19937 rng(21);
  const CheckFn chk = checker();
  struct Reset {
    ~Reset() { cuda::set_mat_vec_config({}); }
  } reset;
  const cuda::MatVecConfig configs[] = {{1, 4, 1}, {2, 4, 1}, {4, 2, 1}, {4, 2, 2},
                                        {4, 2, 4}, {2, 4, 2}, {2, 2, 4}};
  for (const cuda::MatVecConfig& c : configs) {
    cuda::set_mat_vec_config(c);
    SCOPED_TRACE("rows " + std::to_string(c.rows) + " unroll " + std::to_string(c.unroll) +
                 " ksplit " + std::to_string(c.ksplit));
    for (DType t : {DType::Q4_0, DType::Q4_1, DType::Q8_0}) {
      for (Shape s : {Shape{96, 37}, Shape{4192, 37}, Shape{11008, 19}})
        check_mul_mat(t, s.ne0, s.ne1, 1, rng, chk);
    }
    for (DType t : kKernelOnlyTypes) {
      for (Shape s : {Shape{256, 37}, Shape{4352, 37}, Shape{10752, 19}})
        check_random_blocks(t, s.ne0, s.ne1, 1, rng, chk);
    }
  }
}

// Decode batches of 2 to 64 columns on each tensor-core kernel of cuda/matmul_q.cu (int8, its
// warp-pipelined form up to 16 columns, and weights decoded to half), every tile shape (1, 2, 4
// and 8 column tiles): rows that end mid-block, k whose last stage is partial (576, 4160) or
// whole, column counts that fill no tile, and few row blocks (37 rows), whose k splits over
// several blocks that meet through the attention's workspace.
TEST_F(CudaOps, MulMatDecodeBatchesOnTensorCores) {
  std::mt19937 rng(29);
  const CheckFn chk = checker();
  struct Reset {
    ~Reset() { cuda::set_mat_mul_q_everywhere(cuda::MatMulQ::None); }
  } reset;
  using cuda::MatMulQ;
  // A GPU that gives a block less shared memory than sm_90 (sm_86, sm_89: 99 KiB) leaves the
  // products of the widest tiles to the mat-vec or cuBLAS: the kernels' choices below hold
  // where every tile fits, and every product is checked either way.
  int dev = 0, smem = 0;
  ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev),
            cudaSuccess);
  const bool all_fit = smem >= (200 << 10);
  if (all_fit) {
    // The default's ranges.
    EXPECT_EQ(cuda::mat_mul_q_kind(DType::Q4_0, 4096, 4), MatMulQ::Int8Warp);
    EXPECT_EQ(cuda::mat_mul_q_kind(DType::Q4_0, 4096, 16), MatMulQ::Int8Warp);
    EXPECT_EQ(cuda::mat_mul_q_kind(DType::Q4_0, 576, 9), MatMulQ::Int8Warp);
    EXPECT_EQ(cuda::mat_mul_q_kind(DType::Q4_0, 4096, 17), MatMulQ::Half);
    EXPECT_EQ(cuda::mat_mul_q_kind(DType::Q4_0, 4096, 32), MatMulQ::Half);
    EXPECT_EQ(cuda::mat_mul_q_kind(DType::Q4_0, 576, 32), MatMulQ::Half);
  }
  EXPECT_EQ(cuda::mat_mul_q_kind(DType::Q4_0, 4096, 3), MatMulQ::None);  // the mat-vec
  EXPECT_EQ(cuda::mat_mul_q_kind(DType::Q4_0, 576, 3), MatMulQ::None);
  EXPECT_EQ(cuda::mat_mul_q_kind(DType::Q4_0, 576, 4), MatMulQ::Int8Warp);
  EXPECT_EQ(cuda::mat_mul_q_kind(DType::Q8_0, 576, 8), MatMulQ::Int8Warp);
  EXPECT_EQ(cuda::mat_mul_q_kind(DType::Q4_0, 576, 64), MatMulQ::None);  // cuBLAS
  for (MatMulQ kind : {MatMulQ::Int8, MatMulQ::Half, MatMulQ::Int8Warp}) {
    SCOPED_TRACE(kind == MatMulQ::Int8 ? "int8" : kind == MatMulQ::Half ? "half" : "warp");
    cuda::set_mat_mul_q_everywhere(kind);
    for (DType t : {DType::Q4_0, DType::Q4_1, DType::Q8_0}) {
      if (all_fit) {
        ASSERT_EQ(cuda::mat_mul_q_kind(t, 576, 2), kind);
      }
      // 4,096 rows or more take the half kernel's wide tiles from 17 columns on; 4,500 rows are
      // more row blocks than the resident warp kernel's blocks on an H100 or H200 (2 x 132),
      // so that its blocks take two or three each, the last a part one.
      for (Shape s : {Shape{64, 37}, Shape{576, 130}, Shape{4160, 37}, Shape{11008, 300},
                      Shape{256, 4160}, Shape{128, 4500}}) {
        for (int64_t cols : {2, 5, 8, 9, 16, 17, 33, 64})
          check_mul_mat(t, s.ne0, s.ne1, cols, rng, chk);
      }
    }
    for (Shape s : {Shape{256, 37}, Shape{4352, 70}}) {
      for (int64_t cols : {2, 8, 13, 32, 64})
        check_random_blocks(DType::Q4_K, s.ne0, s.ne1, cols, rng, chk);
    }
    if (kind == MatMulQ::Half) {
      // The wide tiles (on sm_90 the warpgroup kernel) over several stages of every format:
      // 4,160 rows of k = 1,024 and 1,280 (four and five stages, k split two ways).
      for (Shape s : {Shape{1024, 4160}, Shape{1280, 4160}}) {
        for (int64_t cols : {17, 64}) {
          check_mul_mat(DType::Q4_1, s.ne0, s.ne1, cols, rng, chk);
          check_random_blocks(DType::Q4_K, s.ne0, s.ne1, cols, rng, chk);
        }
      }
    }
    EXPECT_EQ(cuda::mat_mul_q_kind(DType::Q4_0, 576, cuda::kMatMulQMaxCols + 1), MatMulQ::None);
    EXPECT_EQ(cuda::mat_mul_q_kind(DType::Q4_0, 96, 8), MatMulQ::None);  // k not whole 64s
    EXPECT_EQ(cuda::mat_mul_q_kind(DType::Q6_K, 4096, 8), MatMulQ::None);
  }
  // Planned as on sm_86 and sm_89 (99 KiB a block): 17 to 64 columns take the half kernel's
  // narrow tiles, and the tiles that do not fit (Q8_0's at 32 columns) leave their products to
  // the mat-vec or cuBLAS.
  struct ResetSmem {
    ~ResetSmem() { cuda::set_block_smem_limit(0); }
  } reset_smem;
  cuda::set_block_smem_limit(99 << 10);
  cuda::set_mat_mul_q_everywhere(MatMulQ::Half);
  for (DType t : {DType::Q4_0, DType::Q4_1, DType::Q8_0}) {
    EXPECT_EQ(cuda::mat_mul_q_kind(t, 4096, 64), MatMulQ::Half) << type_name(t);
    EXPECT_EQ(cuda::mat_mul_q_kind(t, 4096, 32), t == DType::Q8_0 ? MatMulQ::None : MatMulQ::Half)
        << type_name(t);
    for (Shape s : {Shape{4160, 37}, Shape{11008, 300}, Shape{256, 4160}}) {
      for (int64_t cols : {17, 33, 64}) check_mul_mat(t, s.ne0, s.ne1, cols, rng, chk);
    }
  }
  check_random_blocks(DType::Q4_K, 4352, 70, 64, rng, chk);
}

// Three products of one activation (q, k and v; gate and up), which go out as one tensor-core
// launch: parts of different rows (the shorter broadcast over the longest in the sum that reads
// them all), rows that end mid-block, k split over the grid (few row blocks) or not, a first
// part whose partials end off a 16-byte boundary (301 rows, odd columns), on each kernel.
// Against the float64 sum of the three products and the CPU.
TEST_F(CudaOps, MulMatDecodeBatchProductsOfOneActivationInOneLaunch) {
  std::mt19937 rng(31);
  const CheckFn chk = checker();
  struct Reset {
    ~Reset() { cuda::set_mat_mul_q_everywhere(cuda::MatMulQ::None); }
  } reset;
  using cuda::MatMulQ;
  struct Rows {
    int64_t k, n0, n1;  // the first part's rows, the other two's (one divides the other)
  };
  for (MatMulQ kind : {MatMulQ::Int8, MatMulQ::Half, MatMulQ::Int8Warp}) {
    SCOPED_TRACE(kind == MatMulQ::Int8 ? "int8" : kind == MatMulQ::Half ? "half" : "warp");
    cuda::set_mat_mul_q_everywhere(kind);
    for (DType t : {DType::Q4_0, DType::Q8_0}) {
      for (Rows r : {Rows{576, 1200, 300}, Rows{4160, 256, 64}, Rows{4160, 4096, 1024},
                     Rows{4160, 301, 1204}}) {
        for (int64_t cols : {4, 9, 17, 33, 64}) {
          std::vector<float> deq[3];
          std::vector<uint8_t> bytes[3];
          const int64_t n[3] = {r.n0, r.n1, r.n1};
          for (int p = 0; p < 3; ++p)
            bytes[p] = quantize(t, randn(size_t(r.k) * n[p], rng, 0.05f), r.k, n[p], deq[p]);
          const auto x = randn(size_t(r.k) * cols, rng);
          const int big = r.n0 >= r.n1 ? 0 : 1;  // the part the others broadcast over
          const int64_t rows = n[big];
          std::vector<double> ref(size_t(rows) * cols, 0.0);
          double sq = 0;
          for (int p = 0; p < 3; ++p) {
            double scale = 0;
            const auto part = mul_mat_ref(deq[p], x, r.k, n[p], cols, &scale);
            sq += scale * scale;
            for (int64_t c = 0; c < cols; ++c)
              for (int64_t row = 0; row < rows; ++row)
                ref[c * rows + row] += part[c * n[p] + row % n[p]];
          }
          std::vector<int32_t> ids;
          chk(
              [&](Graph& g, Backend& be) {
                Tensor* a = activations(g, be, x, r.k, cols, ids);
                Tensor* out[3];
                for (int p = 0; p < 3; ++p)
                  out[p] = g.mul_mat(upload(g, be, t, r.k, n[p], bytes[p].data(), "w"), a);
                Tensor* sum = out[big];
                for (int p = 0; p < 3; ++p)
                  if (p != big) sum = g.add(sum, out[p]);
                return sum;
              },
              ref, mul_mat_bound(t, r.k, cols), 3e-2,
              std::string(type_name(t)) + " k " + std::to_string(r.k) + " n " +
                  std::to_string(r.n0) + "+" + std::to_string(r.n1) + "+" + std::to_string(r.n1) +
                  " cols " + std::to_string(cols),
              std::sqrt(sq));
        }
      }
    }
  }
}

TEST_F(CudaOps, MulMatFloatWeightsWithUnalignedK) {
  std::mt19937 rng(16);
  const CheckFn chk = checker();
  for (DType t : {DType::F32, DType::F16, DType::BF16}) {
    for (Shape s : {Shape{33, 5}, Shape{100, 17}, Shape{7, 3}, Shape{1030, 9}}) {
      for (int64_t cols : {1, 3, 8, 9, 40}) check_mul_mat(t, s.ne0, s.ne1, cols, rng, chk);
    }
  }
}

// A matrix computed by the kernel right before the product (not a model weight): the mat-vec
// must not load it before that kernel is done, as it may a weight's.
TEST_F(CudaOps, MulMatOfAMatrixComputedJustBefore) {
  std::mt19937 rng(19);
  const int64_t k = 256, n = 4096;
  for (int64_t cols : {1, 3}) {
    const auto xv = randn(size_t(k) * cols, rng), wv = randn(size_t(k) * n, rng);
    std::vector<int32_t> x_ids, w_ids;
    Build build = [&](Graph& g, Backend& be) {
      Tensor* x = activations(g, be, xv, k, cols, x_ids);
      Tensor* w = activations(g, be, wv, k, n, w_ids);  // the node right before the product
      return g.mul_mat(w, x);
    };
    const auto gpu = run_on(*cuda_, build);
    const auto cpu = run_on(*cpu_, build);
    EXPECT_LT(rel_err(gpu, cpu), 1e-5) << "cols " << cols;
  }
}

TEST_F(CudaOps, MulMatPromptBatches) {
  std::mt19937 rng(17);
  const CheckFn chk = checker();
  for (DType t : kAllTypes) {
    check_mul_mat(t, 576, 257, 512, rng, chk);
    check_mul_mat(t, 256, 130, 100, rng, chk);
  }
}

// Prompt products on each path (blas.h): the tiled kernel, and cuBLAS (F16 and BF16 weights as
// they are, quantized ones decoded to half a chunk of rows at a time), with k unaligned, batches
// that are no multiple of any tile, and a weight of more rows than one chunk holds.
TEST_F(CudaOps, MulMatPromptBatchesOnTiledKernelAndCublas) {
  std::mt19937 rng(23);
  const CheckFn chk = checker();
  struct Reset {
    ~Reset() { cuda::set_gemm_path(cuda::GemmPath::Auto); }
  } reset;
  ASSERT_LT(cuda::dequant_chunk_rows(11008), 3100);  // two chunks below
  for (cuda::GemmPath p : {cuda::GemmPath::Mma, cuda::GemmPath::Cublas}) {
    cuda::set_gemm_path(p);
    SCOPED_TRACE(p == cuda::GemmPath::Mma ? "tiled kernel" : "cuBLAS");
    for (DType t : {DType::F16, DType::BF16}) {
      check_mul_mat(t, 576, 257, 512, rng, chk);
      check_mul_mat(t, 1030, 67, 40, rng, chk);
      check_mul_mat(t, 33, 5, 9, rng, chk);
    }
    for (DType t : {DType::Q4_0, DType::Q4_1, DType::Q8_0}) {
      check_mul_mat(t, 576, 257, 100, rng, chk);
      check_mul_mat(t, 96, 33, 9, rng, chk);
    }
    check_mul_mat(DType::Q4_0, 11008, 3100, 16, rng, chk);
    for (DType t : kKernelOnlyTypes) check_random_blocks(t, 768, 130, 70, rng, chk);
  }
}

// q, k, v projections of one activation, in the llama graph's order (a rope after each of
// q and k) and with the three products first; CUDA may launch them as one grouped mat-vec when
// that moves no write over memory in use. GQA widths differ. Checked through attention.
// Without GQA (k as wide as q) the ropes and stores of a prompt go out in one launch, a token a
// block, k's rope in q's product's place.
TEST_F(CudaOps, AttentionBlockWithGroupedProjections) {
  std::mt19937 rng(18);
  const int n_head = 8, hd = 64, n_embd = n_head * hd;
  std::vector<std::pair<int, DType>> cases;
  for (int kv : {2, 8})
    for (DType t : {DType::Q4_1, DType::Q8_0, DType::F16}) cases.push_back({kv, t});
  for (const auto& c : cases) {
    const int n_head_kv = c.first, kv_w = n_head_kv * hd;
    const DType t = c.second;
    for (int n_tok : {1, 3, 12}) {
      for (bool products_first : {false, true}) {
        const int n_ctx = 64, n_past = 5;
        auto wq = randn(size_t(n_embd) * n_embd, rng, 0.05f);
        auto wk = randn(size_t(n_embd) * kv_w, rng, 0.05f);
        auto wv = randn(size_t(n_embd) * kv_w, rng, 0.05f);
        std::vector<float> dq, dk, dv;
        auto bq = quantize(t, wq, n_embd, n_embd, dq), bk = quantize(t, wk, n_embd, kv_w, dk);
        auto bv = quantize(t, wv, n_embd, kv_w, dv);
        auto x = randn(size_t(n_embd) * n_tok, rng);
        std::vector<int32_t> pos(n_tok), ids;
        for (int i = 0; i < n_tok; ++i) pos[i] = n_past + i;
        // Earlier cache rows: random F16 values, the same on both backends.
        const auto k16 = randn_f16(size_t(kv_w) * n_ctx, rng);
        const auto v16 = randn_f16(size_t(kv_w) * n_ctx, rng);
        Build build = [&](Graph& g, Backend& be) {
          Tensor* kc = f16_cache(g, be, k16, kv_w, n_ctx, "k");
          Tensor* vc = f16_cache(g, be, v16, kv_w, n_ctx, "v");
          Tensor* xt = activations(g, be, x, n_embd, n_tok, ids);
          Tensor* p = g.input_i32(n_tok, pos.data(), "pos");
          Tensor* wqt = upload(g, be, t, n_embd, n_embd, bq.data(), "wq");
          Tensor* wkt = upload(g, be, t, n_embd, kv_w, bk.data(), "wk");
          Tensor* wvt = upload(g, be, t, n_embd, kv_w, bv.data(), "wv");
          Tensor *q, *k, *v;
          if (products_first) {
            Tensor* qm = g.mul_mat(wqt, xt);
            Tensor* km = g.mul_mat(wkt, xt);
            v = g.mul_mat(wvt, xt);
            q = g.rope(qm, p, n_head, hd, hd, kRopeNormal, 10000.0f);
            k = g.rope(km, p, n_head_kv, hd, hd, kRopeNormal, 10000.0f);
          } else {
            q = g.rope(g.mul_mat(wqt, xt), p, n_head, hd, hd, kRopeNormal, 10000.0f);
            k = g.rope(g.mul_mat(wkt, xt), p, n_head_kv, hd, hd, kRopeNormal, 10000.0f);
            v = g.mul_mat(wvt, xt);
          }
          g.kv_store(kc, k, n_past);
          g.kv_store(vc, v, n_past);
          return g.attention(q, kc, vc, n_head, n_head_kv, hd, 1.0f / std::sqrt(float(hd)),
                             n_past + n_tok, n_past);
        };
        const auto gpu = run_on(*cuda_, build);
        const auto cpu = run_on(*cpu_, build);
        EXPECT_LT(rel_err(gpu, cpu), type_traits(t).block_size > 1 ? 3e-2 : 5e-3)
            << type_name(t) << " heads " << n_head << "/" << n_head_kv << " tokens " << n_tok
            << (products_first ? " products first" : "");
      }
    }
  }
}

// Qwen 3's and Gemma 3's attention input: q, k and v products of one activation, with v in
// another format (as K-quant mixes store it), per-head q/k norms, NeoX ropes and the K/V stores.
// In decode the three products go out in one launch and the norms ride with the ropes; short
// rows take the register-resident kernels, long ones the block kernels.
TEST_F(CudaOps, HeadNormsAndProductsOfTwoFormatsMatchTheCpu) {
  std::mt19937 rng(31);
  const int hd = 128;
  const std::pair<DType, DType> formats[] = {
      {DType::Q4_K, DType::Q6_K}, {DType::Q5_K, DType::Q6_K}, {DType::Q5_0, DType::Q8_0}};
  for (auto [qk_type, v_type] : formats) {
    for (int n_embd : {512, 1536, 2304}) {
      for (int n_tok : {1, 4}) {
        const int n_head = n_embd / hd, n_head_kv = n_embd == 2304 ? 2 : 1;
        const int kv_w = n_head_kv * hd, n_ctx = 64, n_past = 9;
        auto bq = random_blocks(qk_type, n_embd, n_embd, rng);
        auto bk = random_blocks(qk_type, n_embd, kv_w, rng);
        auto bv = random_blocks(v_type, n_embd, kv_w, rng);
        auto qn = randn(hd, rng, 0.3f), kn = randn(hd, rng, 0.3f);
        for (auto& v : qn) v += 1.0f;
        for (auto& v : kn) v += 1.0f;
        auto x = randn(size_t(n_embd) * n_tok, rng);
        std::vector<int32_t> pos(n_tok), ids;
        for (int i = 0; i < n_tok; ++i) pos[i] = n_past + i;
        const auto k16 = randn_f16(size_t(kv_w) * n_ctx, rng);
        const auto v16 = randn_f16(size_t(kv_w) * n_ctx, rng);
        Build build = [&](Graph& g, Backend& be) {
          Tensor* kc = f16_cache(g, be, k16, kv_w, n_ctx, "k");
          Tensor* vc = f16_cache(g, be, v16, kv_w, n_ctx, "v");
          Tensor* xt = activations(g, be, x, n_embd, n_tok, ids);
          Tensor* p = g.input_i32(n_tok, pos.data(), "pos");
          Tensor* q = g.mul_mat(upload(g, be, qk_type, n_embd, n_embd, bq.data(), "wq"), xt);
          Tensor* k = g.mul_mat(upload(g, be, qk_type, n_embd, kv_w, bk.data(), "wk"), xt);
          Tensor* v = g.mul_mat(upload(g, be, v_type, n_embd, kv_w, bv.data(), "wv"), xt);
          q = g.mul(g.rms_norm(q, 1e-6f, hd), upload(g, be, DType::F32, hd, 1, qn.data(), "qn"));
          k = g.mul(g.rms_norm(k, 1e-6f, hd), upload(g, be, DType::F32, hd, 1, kn.data(), "kn"));
          q = g.rope(q, p, n_head, hd, hd, kRopeNeox, 10000.0f);
          k = g.rope(k, p, n_head_kv, hd, hd, kRopeNeox, 10000.0f);
          g.kv_store(kc, k, n_past);
          g.kv_store(vc, v, n_past);
          return g.attention(q, kc, vc, n_head, n_head_kv, hd, 1.0f / std::sqrt(float(hd)),
                             n_past + n_tok, n_past);
        };
        const auto gpu = run_on(*cuda_, build);
        const auto cpu = run_on(*cpu_, build);
        EXPECT_LT(rel_err(gpu, cpu), 3e-2) << type_name(qk_type) << "+" << type_name(v_type)
                                           << " n_embd " << n_embd << " tokens " << n_tok;
      }
    }
  }
}

// Two llama decoder layers with real weights, CUDA against the CPU: every fusion the CUDA
// backend makes (residual add + norm + weight + 8-bit activations, swiglu + 8-bit
// activations, attention + 8-bit output, K/V stores, grouped mat-vecs; at 12 tokens the norms
// and swiglu handing their half form to the products) sits on this path. After
// a short past the decode attention runs one query head a block in one split; after a long one,
// both heads of a KV group a block over several splits and a reduce, which writes the 8-bit form.
TEST_F(CudaOps, DecoderLayersMatchTheCpu) {
  std::mt19937 rng(24);
  const int n_embd = 256, n_head = 4, n_head_kv = 2, hd = 64, n_ff = 512, n_vocab = 300;
  const int kv_w = n_head_kv * hd, n_ctx = 1024;
  for (DType t : {DType::Q4_1, DType::Q8_0, DType::F16}) {
    for (int n_past : {3, 900}) {
      for (int n_tok : {1, 5, 12}) {
        for (bool products_first : {false, true}) {
          struct Mat {
            std::vector<uint8_t> bytes;
            int64_t k, n;
          };
          auto mat = [&](int64_t k, int64_t n) {
            std::vector<float> deq;
            return Mat{quantize(t, randn(size_t(k) * n, rng, 0.05f), k, n, deq), k, n};
          };
          struct LayerW {
            Mat wq, wk, wv, wo, gate, up, down;
            std::vector<float> attn_norm, ffn_norm;
          };
          std::vector<LayerW> layers;
          for (int il = 0; il < 2; ++il) {
            layers.push_back({mat(n_embd, n_embd), mat(n_embd, kv_w), mat(n_embd, kv_w),
                              mat(n_embd, n_embd), mat(n_embd, n_ff), mat(n_embd, n_ff),
                              mat(n_ff, n_embd), randn(n_embd, rng, 0.3f),
                              randn(n_embd, rng, 0.3f)});
            for (auto& v : layers.back().attn_norm) v += 1.0f;
            for (auto& v : layers.back().ffn_norm) v += 1.0f;
          }
          std::vector<float> embd_f = randn(size_t(n_embd) * n_vocab, rng), deq;
          auto embd = quantize(DType::Q8_0, embd_f, n_embd, n_vocab, deq);
          auto out_norm = randn(n_embd, rng, 0.3f);
          Mat out = mat(n_embd, n_vocab);
          std::vector<std::vector<uint16_t>> caches;
          for (int c = 0; c < 4; ++c) {
            auto v = randn(size_t(kv_w) * n_ctx, rng);
            caches.emplace_back(v.size());
            for (size_t i = 0; i < v.size(); ++i) caches.back()[i] = f32_to_f16(v[i]);
          }
          std::vector<int32_t> tokens(n_tok), pos(n_tok);
          for (int i = 0; i < n_tok; ++i) tokens[i] = (i * 37 + 11) % n_vocab, pos[i] = n_past + i;
          Build build = [&](Graph& g, Backend& be) {
            auto w = [&](const Mat& m, const char* name) {
              return upload(g, be, t, m.k, m.n, m.bytes.data(), name);
            };
            auto f32 = [&](const std::vector<float>& v, const char* name) {
              return upload(g, be, DType::F32, int64_t(v.size()), 1, v.data(), name);
            };
            Tensor* p = g.input_i32(n_tok, pos.data(), "pos");
            Tensor* x = g.get_rows(upload(g, be, DType::Q8_0, n_embd, n_vocab, embd.data(), "embd"),
                                   g.input_i32(n_tok, tokens.data(), "tokens"));
            for (int il = 0; il < 2; ++il) {
              const LayerW& L = layers[il];
              Tensor* kc = f16_cache(g, be, caches[2 * il], kv_w, n_ctx, "k");
              Tensor* vc = f16_cache(g, be, caches[2 * il + 1], kv_w, n_ctx, "v");
              Tensor* h = g.mul(g.rms_norm(x, 1e-5f), f32(L.attn_norm, "attn_norm"));
              Tensor *q, *k, *v;
              if (products_first) {
                Tensor* qm = g.mul_mat(w(L.wq, "wq"), h);
                Tensor* km = g.mul_mat(w(L.wk, "wk"), h);
                v = g.mul_mat(w(L.wv, "wv"), h);
                q = g.rope(qm, p, n_head, hd, hd, kRopeNormal, 10000.0f);
                k = g.rope(km, p, n_head_kv, hd, hd, kRopeNormal, 10000.0f);
              } else {
                q = g.rope(g.mul_mat(w(L.wq, "wq"), h), p, n_head, hd, hd, kRopeNormal, 10000.0f);
                k = g.rope(g.mul_mat(w(L.wk, "wk"), h), p, n_head_kv, hd, hd, kRopeNormal,
                           10000.0f);
                v = g.mul_mat(w(L.wv, "wv"), h);
              }
              g.kv_store(kc, k, n_past);
              g.kv_store(vc, v, n_past);
              Tensor* attn =
                  g.attention(q, kc, vc, n_head, n_head_kv, hd, 0.125f, n_past + n_tok, n_past);
              x = g.add(x, g.mul_mat(w(L.wo, "wo"), attn));
              Tensor* f = g.mul(g.rms_norm(x, 1e-5f), f32(L.ffn_norm, "ffn_norm"));
              Tensor* ffn = g.swiglu(g.mul_mat(w(L.gate, "gate"), f), g.mul_mat(w(L.up, "up"), f));
              x = g.add(x, g.mul_mat(w(L.down, "down"), ffn));
            }
            x = g.mul(g.rms_norm(x, 1e-5f), f32(out_norm, "out_norm"));
            return g.mul_mat(w(out, "output"), x);
          };
          const auto gpu = run_on(*cuda_, build);
          const auto cpu = run_on(*cpu_, build);
          EXPECT_LT(rel_err(gpu, cpu), type_traits(t).block_size > 1 ? 5e-2 : 1e-2)
              << type_name(t) << " past " << n_past << " tokens " << n_tok
              << (products_first ? " products first" : "");
        }
      }
    }
  }
}

// ---- rope -------------------------------------------------------------------------------------

void rope_ref(const std::vector<float>& x, const std::vector<int32_t>& pos, int n_head, int hd,
              int n_dims, int mode, double base, std::vector<double>& out) {
  out.assign(x.begin(), x.end());
  for (size_t t = 0; t < pos.size(); ++t)
    for (int h = 0; h < n_head; ++h) {
      const size_t o = (t * n_head + h) * hd;
      for (int i = 0; i < n_dims / 2; ++i) {
        const double theta = pos[t] * std::pow(base, -2.0 * i / n_dims);
        const int a = mode == kRopeNeox ? i : 2 * i,
                  b = mode == kRopeNeox ? i + n_dims / 2 : 2 * i + 1;
        const double x0 = x[o + a], x1 = x[o + b];
        out[o + a] = x0 * std::cos(theta) - x1 * std::sin(theta);
        out[o + b] = x0 * std::sin(theta) + x1 * std::cos(theta);
      }
    }
}

TEST_F(CudaOps, RopeBothModesPartialRotationLargePositions) {
  std::mt19937 rng(19);
  const struct {
    int n_head, hd, n_dims;
  } cases[] = {{4, 64, 64}, {3, 32, 16}, {9, 64, 64}, {2, 128, 96}, {32, 128, 128}};
  for (int mode : {kRopeNormal, kRopeNeox}) {
    for (auto c : cases) {
      std::vector<int32_t> pos = {0, 1, 5, 100, 4095, 32767, 7};
      auto x = randn(size_t(c.n_head) * c.hd * pos.size(), rng);
      std::vector<double> ref;
      rope_ref(x, pos, c.n_head, c.hd, c.n_dims, mode, 10000.0, ref);
      std::vector<int32_t> ids;
      check(
          [&](Graph& g, Backend& be) {
            return g.rope(activations(g, be, x, int64_t(c.n_head) * c.hd, int64_t(pos.size()), ids),
                          g.input_i32(int64_t(pos.size()), pos.data(), "pos"), c.n_head, c.hd,
                          c.n_dims, mode, 10000.0f);
          },
          ref, 1e-6, 1e-5,
          "mode " + std::to_string(mode) + " hd " + std::to_string(c.hd) + " n_dims " +
              std::to_string(c.n_dims));
    }
  }
}

// Two ropes of the same positions next to each other (as q and k are): CUDA launches them as
// one kernel. Their sum against the sum of the two references.
TEST_F(CudaOps, TwoRopesOfTheSamePositions) {
  std::mt19937 rng(23);
  const int n_head = 6, hd = 64;
  for (int mode : {kRopeNormal, kRopeNeox}) {
    for (int n_dims : {64, 32}) {
      std::vector<int32_t> pos = {3, 0, 4100};
      const size_t len = size_t(n_head) * hd * pos.size();
      auto xa = randn(len, rng), xb = randn(len, rng);
      std::vector<double> ra, rb;
      rope_ref(xa, pos, n_head, hd, n_dims, mode, 10000.0, ra);
      rope_ref(xb, pos, n_head, hd, n_dims, mode, 10000.0, rb);
      for (size_t i = 0; i < len; ++i) ra[i] += rb[i];
      std::vector<int32_t> ids_a, ids_b;
      check(
          [&](Graph& g, Backend& be) {
            Tensor* p = g.input_i32(int64_t(pos.size()), pos.data(), "pos");
            Tensor* a = activations(g, be, xa, int64_t(n_head) * hd, int64_t(pos.size()), ids_a);
            Tensor* b = activations(g, be, xb, int64_t(n_head) * hd, int64_t(pos.size()), ids_b);
            Tensor* qa = g.rope(a, p, n_head, hd, n_dims, mode, 10000.0f);
            Tensor* qb = g.rope(b, p, n_head, hd, n_dims, mode, 10000.0f);
            return g.add(qa, qb);
          },
          ra, 1e-6, 1e-5, "two ropes, mode " + std::to_string(mode));
    }
  }
}

// ---- kv_store + attention
// ------------------------------------------------------------------------

struct AttnCase {
  int n_head, n_head_kv, hd, n_past, n_tok;
  int window = 0;         // > 0: each query sees its last `window` positions
  DType kv = DType::F16;  // the caches' type: F16 or Q8_0
  int ring = 0;           // > 0: the caches are rings of this many rows (position p in p % ring)
  int spare = 0;          // rows the caches hold past the keys (a cache sized for more)
};

// A KV cache [w, rows] of type t holding the given row bytes, made as a context makes one.
Tensor* kv_cache_with(Graph& g, Backend& be, DType t, const std::vector<uint8_t>& bytes, int64_t w,
                      int64_t rows, const std::string& name, bool ring = false) {
  void* p = be.alloc_kv(bytes.size());
  be.kv_from_host(p, bytes.data(), bytes.size());
  return g.kv_cache(t, w, rows, p, name, ring);
}

// Decode attention's bound against float64 over the cache's values: float products and sums on
// the lanes and on tensor cores (q and the probabilities each as two halves) alike, except that
// over a Q8_0 cache the tensor-core kernel decodes a tile into half, rounding each value's product
// of byte and scale (a relative 2^-12), and takes q and the probabilities as one half each (as
// much again).
double decode_attention_bound(int hd, DType kv) {
  return kv == DType::Q8_0 && cuda::decode_attention_mma(hd) ? 1e-3 : 2e-5;
}

// Cache rows of positions 0..n_past-1 already hold values (in a ring, the later positions over
// the earlier ones); kv_store writes the new rows; attention reads all.
void check_attention(const AttnCase& c, std::mt19937& rng, const CheckFn& check) {
  const int n_ctx = c.ring > 0 ? c.ring : c.n_past + c.n_tok + 7 + c.spare;
  const int64_t kv_w = int64_t(c.n_head_kv) * c.hd;
  auto k_all = randn(size_t(kv_w) * (c.n_past + c.n_tok), rng);
  auto v_all = randn(size_t(kv_w) * (c.n_past + c.n_tok), rng);
  // The caches' bytes (rows past n_past zero) and the values they hold: every row, the new
  // ones too, as the backends store them (Q8_0 quantized as the CPU quantizes, bit for bit).
  const size_t rb = row_size(c.kv, kv_w);
  std::vector<uint8_t> kb(rb * n_ctx, 0), vb(rb * n_ctx, 0);
  std::vector<double> kr(k_all.size()), vr(v_all.size());
  std::vector<uint8_t> row(rb);
  std::vector<float> back(kv_w);
  for (int p = 0; p < c.n_past + c.n_tok; ++p) {
    for (int kv = 0; kv < 2; ++kv) {
      const float* src = (kv ? v_all : k_all).data() + size_t(p) * kv_w;
      quantize_row(c.kv, src, row.data(), kv_w);
      dequantize_row(c.kv, row.data(), back.data(), kv_w);
      if (p < c.n_past)
        std::copy(row.begin(), row.end(), (kv ? vb : kb).begin() + rb * (p % n_ctx));
      for (int64_t i = 0; i < kv_w; ++i) (kv ? vr : kr)[size_t(p) * kv_w + i] = back[i];
    }
  }
  std::vector<float> k_new(k_all.begin() + kv_w * c.n_past, k_all.end());
  std::vector<float> v_new(v_all.begin() + kv_w * c.n_past, v_all.end());
  auto q = randn(size_t(c.n_head) * c.hd * c.n_tok, rng);
  const float scale = 1.0f / std::sqrt(float(c.hd));
  // Reference on the values as the cache holds them.
  std::vector<double> ref(q.size());
  for (int t = 0; t < c.n_tok; ++t)
    for (int h = 0; h < c.n_head; ++h) {
      const int hk = h / (c.n_head / c.n_head_kv), len = c.n_past + t + 1;
      const int first = c.window > 0 ? std::max(0, len - c.window) : 0;
      std::vector<double> s(len, -INFINITY);
      double mx = -INFINITY, sum = 0;
      for (int p = first; p < len; ++p) {
        double d = 0;
        for (int i = 0; i < c.hd; ++i)
          d += double(q[(size_t(t) * c.n_head + h) * c.hd + i]) * kr[p * kv_w + hk * c.hd + i];
        s[p] = d * scale;
        mx = std::max(mx, s[p]);
      }
      for (auto& v : s) sum += (v = std::exp(v - mx));
      for (int i = 0; i < c.hd; ++i) {
        double acc = 0;
        for (int p = first; p < len; ++p) acc += s[p] * vr[p * kv_w + hk * c.hd + i];
        ref[(size_t(t) * c.n_head + h) * c.hd + i] = acc / sum;
      }
    }
  // Prompt batches run on tensor cores, which take q and the probabilities as half (as
  // llama.cpp's flash attention does): a relative error of a few 1e-4. Decode: as
  // decode_attention_bound says.
  const double bound =
      c.n_tok > cuda::kDecodeAttnMaxTokens ? 2e-3 : decode_attention_bound(c.hd, c.kv);
  std::vector<int32_t> iq, ik, iv;
  check(
      [&](Graph& g, Backend& be) {
        Tensor* kt = kv_cache_with(g, be, c.kv, kb, kv_w, n_ctx, "k", c.ring > 0);
        Tensor* vt = kv_cache_with(g, be, c.kv, vb, kv_w, n_ctx, "v", c.ring > 0);
        g.kv_store(kt, activations(g, be, k_new, kv_w, c.n_tok, ik), c.n_past);
        g.kv_store(vt, activations(g, be, v_new, kv_w, c.n_tok, iv), c.n_past);
        return g.attention(activations(g, be, q, int64_t(c.n_head) * c.hd, c.n_tok, iq), kt, vt,
                           c.n_head, c.n_head_kv, c.hd, scale, c.n_past + c.n_tok, c.n_past,
                           c.window);
      },
      ref, bound, bound,
      std::string(type_name(c.kv)) + " window " + std::to_string(c.window) + " ring " +
          std::to_string(c.ring) + " heads " + std::to_string(c.n_head) + "/" +
          std::to_string(c.n_head_kv) + " hd " + std::to_string(c.hd) + " past " +
          std::to_string(c.n_past) + " tokens " + std::to_string(c.n_tok),
      0);
}

TEST_F(CudaOps, AttentionDecodeSplitsAndGqa) {
  std::mt19937 rng(20);
  const CheckFn chk = checker();
  const AttnCase cases[] = {
      {4, 4, 32, 0, 1},    {9, 3, 64, 0, 7},    {8, 2, 64, 37, 1},     {32, 32, 128, 300, 1},
      {9, 3, 64, 1000, 1}, {9, 3, 64, 1000, 8}, {16, 1, 64, 10, 1},    {2, 2, 256, 600, 2},
      {6, 1, 16, 100, 5},  {8, 8, 80, 3000, 1}, {12, 4, 96, 4500, 3},  {4, 2, 160, 70, 2},
      {8, 1, 192, 20, 1},  {32, 1, 64, 300, 1}, {40, 2, 128, 1000, 2}, {24, 1, 256, 130, 1}};
  for (const AttnCase& c : cases) check_attention(c, rng, chk);
}

TEST_F(CudaOps, AttentionPrompt) {
  std::mt19937 rng(21);
  const CheckFn chk = checker();
  const AttnCase cases[] = {{6, 1, 16, 100, 13},   {12, 4, 80, 5, 33},   {4, 1, 256, 50, 9},
                            {9, 3, 64, 0, 512},    {8, 2, 128, 0, 100},  {4, 4, 128, 40, 77},
                            {8, 2, 128, 300, 200}, {2, 1, 256, 70, 130}, {4, 2, 96, 1, 65}};
  for (const AttnCase& c : cases) check_attention(c, rng, chk);
}

// The lengths a long conversation passes through, 1 to 16,384 keys: decode steps (split over
// the cache) and prompt batches (the flash kernel), against float64.
TEST_F(CudaOps, AttentionAtContextLengthsUpTo16k) {
  std::mt19937 rng(24);
  const CheckFn chk = checker();
  std::vector<AttnCase> cases;
  for (int len : {1, 7, 511, 4096, 16384}) {
    cases.push_back({8, 2, 128, len - 1, 1});
    cases.push_back({9, 3, 64, len - 1, 1});
  }
  for (int len : {7, 511}) cases.push_back({8, 2, 128, 0, len});
  cases.push_back({4, 1, 128, 4096 - 511, 511});
  cases.push_back({4, 1, 128, 16384 - 64, 64});
  cases.push_back({4, 1, 256, 16384 - 40, 40, 512});
  for (const AttnCase& c : cases) check_attention(c, rng, chk);
}

// Few KV heads over caches within a cluster's pass: on sm_90+ the splits of a head group are a
// cluster of blocks that merge through distributed shared memory; the same cases with the cluster
// kernel off take the ticket merge through L2. Both against float64: one split in use of a long
// cache (the cluster's other blocks return; of its block's warps one, two or more hold keys),
// several, caches filling one pass of the cluster's blocks (4,096 keys at 64 dims, 2,048 at 128,
// 1,024 at 256) and longer ones (the ticket's either way), windows, rings, Q8_0, GQA groups and
// tokens of one batch.
TEST_F(CudaOps, AttentionDecodeClustersAndTicketMerges) {
  int major = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0), cudaSuccess);
  if (major >= 9) {
    EXPECT_TRUE(cuda::decode_attention_clusters()) << "an sm_90 build on sm_90+";
  }
  const Switched<cuda::set_decode_attention_cluster> clusters(true);
  std::mt19937 rng(28);
  const CheckFn chk = checker();
  const DType f16 = DType::F16, q8 = DType::Q8_0;
  const AttnCase cases[] = {{9, 3, 64, 20, 1, 0, f16, 0, 600},
                            {9, 3, 64, 50, 1, 0, f16, 0, 600},
                            {9, 3, 64, 100, 1, 0, f16, 0, 600},
                            {8, 2, 128, 200, 1, 0, f16, 0, 400},
                            {4, 1, 256, 100, 1, 0, f16, 0, 300},
                            {9, 3, 64, 1000, 1},
                            {9, 3, 64, 4088, 1},
                            {9, 3, 64, 9000, 1},
                            {9, 3, 64, 3000, 3},
                            {32, 8, 64, 2500, 1},
                            {8, 2, 128, 2040, 1},
                            {8, 2, 128, 5000, 2},
                            {4, 1, 256, 3000, 1, 512},
                            {4, 1, 256, 1000, 1},
                            {4, 1, 256, 1500, 1},
                            {4, 1, 256, 3000, 1, 512, f16, 1023},
                            {9, 3, 64, 4088, 1, 0, q8},
                            {8, 2, 128, 2000, 1, 0, q8},
                            {4, 1, 256, 1000, 1, 0, q8}};
  for (bool cluster : {true, false}) {
    cuda::set_decode_attention_cluster(cluster);
    for (const AttnCase& c : cases) check_attention(c, rng, chk);
  }
}

// Q8_0 caches: decode batches (staged in 16-, 8- or 4-byte units, decoded by each lane) and prompt
// batches (tiles decoded to half in shared memory), heads of 64, 128, 192 and 256, GQA and windows,
// and decode splits of one tile a warp and of several.
TEST_F(CudaOps, AttentionOverQ8Caches) {
  std::mt19937 rng(25);
  const CheckFn chk = checker();
  const DType q8 = DType::Q8_0;
  const AttnCase cases[] = {{9, 3, 64, 0, 1, 0, q8},           {9, 3, 64, 1000, 1, 0, q8},
                            {8, 2, 128, 37, 3, 0, q8},         {32, 32, 128, 300, 1, 0, q8},
                            {4, 1, 256, 600, 1, 512, q8},      {8, 1, 192, 20, 1, 0, q8},
                            {4, 2, 64, 4095, 1, 0, q8},        {9, 3, 64, 0, 512, 0, q8},
                            {8, 2, 128, 300, 200, 0, q8},      {4, 1, 256, 70, 130, 0, q8},
                            {2, 1, 256, 100, 600, 512, q8},    {4, 2, 192, 5, 70, 0, q8},
                            {4, 1, 128, 16384 - 64, 64, 0, q8}};
  for (const AttnCase& c : cases) check_attention(c, rng, chk);
  // Decode splits of several tiles a warp (the next tile's bytes in flight while this one's are
  // decoded): 2 to 4 tiles at 64, 128 and 256 dims.
  const AttnCase several[] = {{8, 2, 128, 16383, 1, 0, q8},
                              {32, 32, 128, 4000, 1, 0, q8},
                              {9, 3, 64, 16383, 1, 0, q8},
                              {4, 1, 256, 9000, 1, 0, q8}};
  for (const AttnCase& c : several) check_attention(c, rng, chk);
}

// On GPUs whose blocks take at most 99 KiB of shared memory (sm_86, sm_89; planned so here by the
// test hook), prompts over Q8_0 caches of 128 and 256 dims take tiles of half the keys, and
// decode batches fit as they are: Q8_0 and F16, prompts and decode steps, against float64.
TEST_F(CudaOps, AttentionOnBlocksOf99KiB) {
  struct Reset {  // those GPUs have no clusters either
    bool cluster = cuda::set_decode_attention_cluster(false);
    ~Reset() {
      cuda::set_block_smem_limit(0);
      cuda::set_decode_attention_cluster(cluster);
    }
  } reset;
  cuda::set_block_smem_limit(99 << 10);
  std::mt19937 rng(29);
  const CheckFn chk = checker();
  const DType f16 = DType::F16, q8 = DType::Q8_0;
  const AttnCase cases[] = {
      {8, 2, 128, 300, 200, 0, q8}, {4, 1, 256, 70, 130, 0, q8},  {2, 1, 256, 100, 600, 512, q8},
      {9, 3, 64, 0, 512, 0, q8},    {8, 2, 128, 3000, 1, 0, q8},  {4, 1, 256, 600, 1, 512, q8},
      {4, 1, 256, 50, 9, 0, f16},   {8, 2, 128, 40, 100, 0, f16}, {4, 2, 192, 5, 70, 0, q8}};
  for (const AttnCase& c : cases) check_attention(c, rng, chk);
}

// A window shorter than, equal to and longer than the context; decode batches (split over long
// pasts, the split count following the window) and prompt batches; head_dim up to 256.
TEST_F(CudaOps, AttentionWindowed) {
  std::mt19937 rng(22);
  const CheckFn chk = checker();
  const AttnCase cases[] = {
      {4, 1, 256, 600, 1, 512}, {4, 1, 256, 3000, 1, 512},  {9, 3, 64, 1000, 8, 100},
      {8, 2, 128, 40, 1, 64},   {8, 8, 64, 10, 1, 512},     {4, 1, 256, 700, 40, 512},
      {6, 1, 16, 100, 33, 7},   {12, 4, 80, 5, 33, 16},     {4, 2, 128, 4500, 3, 1},
      {8, 1, 192, 300, 1, 300}, {2, 1, 256, 100, 600, 512}, {4, 2, 64, 0, 300, 40}};
  for (const AttnCase& c : cases) check_attention(c, rng, chk);
}

// Sliding-window rings (window + batch - 1 rows, as a context allocates them): decode and prompt
// batches whose keys and new rows wrap around the ring's end, F16 and Q8_0, rings shorter than
// a decode tile.
TEST_F(CudaOps, AttentionOverRings) {
  std::mt19937 rng(26);
  const CheckFn chk = checker();
  const DType f16 = DType::F16, q8 = DType::Q8_0;
  const AttnCase cases[] = {
      {4, 1, 256, 3000, 1, 512, f16, 1023}, {9, 3, 64, 1000, 8, 100, f16, 107},
      {4, 1, 256, 700, 40, 512, f16, 551},  {6, 1, 16, 100, 33, 7, f16, 39},
      {4, 2, 64, 50, 1, 5, f16, 8},         {8, 2, 128, 4500, 3, 64, f16, 70},
      {4, 1, 256, 600, 1, 512, q8, 515},    {2, 1, 256, 1000, 600, 512, q8, 1111},
      {4, 2, 64, 77, 2, 5, q8, 6},          {8, 2, 128, 4500, 1, 64, q8, 64},
      {8, 4, 128, 3000, 3, 100, q8, 102},   {8, 2, 128, 700, 40, 512, q8, 551}};
  for (const AttnCase& c : cases) check_attention(c, rng, chk);
}

// One token of each of several sequences whose caches lie in one pool (kv_store_seqs and
// attention_seqs, a decode batch's ops): each token writes and attends over its own sequence's
// rows, at its own position; pools of rings too.
struct PoolCase {
  int n_head, n_head_kv, hd, n_seq, rows;
  std::vector<int> seqs, positions;  // each token's sequence and position
  int window = 0;
  bool ring = false;
  DType kv = DType::F16;
};

void check_attention_seqs(const PoolCase& c, std::mt19937& rng, const CheckFn& check) {
  const int n_tok = int(c.seqs.size());
  const int64_t kv_w = int64_t(c.n_head_kv) * c.hd;
  const size_t rb = row_size(c.kv, kv_w);
  // Every position up to each token's, per sequence (rows of later positions over earlier ones
  // in a ring): the values as the cache holds them, by (sequence, position).
  int max_pos = 0;
  for (int p : c.positions) max_pos = std::max(max_pos, p);
  const size_t per_seq = size_t(max_pos + 1) * kv_w;
  auto k_all = randn(per_seq * c.n_seq, rng);
  auto v_all = randn(per_seq * c.n_seq, rng);
  std::vector<uint8_t> kb(rb * c.rows * c.n_seq, 0), vb(rb * c.rows * c.n_seq, 0);
  std::vector<double> kr(k_all.size()), vr(v_all.size());
  std::vector<uint8_t> row(rb);
  std::vector<float> back(kv_w);
  std::vector<float> k_new(size_t(n_tok) * kv_w), v_new(size_t(n_tok) * kv_w);
  for (int s = 0; s < c.n_seq; ++s) {
    int pos_s = -1;  // this sequence's token position, if it has one
    for (int i = 0; i < n_tok; ++i)
      if (c.seqs[i] == s) pos_s = c.positions[i];
    for (int p = 0; p <= max_pos; ++p)
      for (int kv = 0; kv < 2; ++kv) {
        const float* src = (kv ? v_all : k_all).data() + (size_t(s) * (max_pos + 1) + p) * kv_w;
        quantize_row(c.kv, src, row.data(), kv_w);
        dequantize_row(c.kv, row.data(), back.data(), kv_w);
        for (int64_t i = 0; i < kv_w; ++i)
          (kv ? vr : kr)[(size_t(s) * (max_pos + 1) + p) * kv_w + i] = back[i];
        if (p < pos_s || (pos_s < 0 && p < c.rows)) {
          const size_t r = size_t(s) * c.rows + size_t(c.ring ? p % c.rows : p);
          std::copy(row.begin(), row.end(), (kv ? vb : kb).begin() + rb * r);
        }
      }
  }
  for (int i = 0; i < n_tok; ++i) {
    const size_t at = (size_t(c.seqs[i]) * (max_pos + 1) + c.positions[i]) * kv_w;
    std::copy(k_all.begin() + at, k_all.begin() + at + kv_w, k_new.begin() + size_t(i) * kv_w);
    std::copy(v_all.begin() + at, v_all.begin() + at + kv_w, v_new.begin() + size_t(i) * kv_w);
  }
  auto q = randn(size_t(c.n_head) * c.hd * n_tok, rng);
  const float scale = 1.0f / std::sqrt(float(c.hd));
  std::vector<double> ref(q.size());
  for (int t = 0; t < n_tok; ++t)
    for (int h = 0; h < c.n_head; ++h) {
      const int hk = h / (c.n_head / c.n_head_kv), len = c.positions[t] + 1;
      const int first = c.window > 0 ? std::max(0, len - c.window) : 0;
      const size_t base = size_t(c.seqs[t]) * (max_pos + 1) * kv_w;
      std::vector<double> sc(len, -INFINITY);
      double mx = -INFINITY, sum = 0;
      for (int p = first; p < len; ++p) {
        double d = 0;
        for (int i = 0; i < c.hd; ++i)
          d += double(q[(size_t(t) * c.n_head + h) * c.hd + i]) *
               kr[base + size_t(p) * kv_w + hk * c.hd + i];
        sc[p] = d * scale;
        mx = std::max(mx, sc[p]);
      }
      for (auto& v : sc) sum += (v = std::exp(v - mx));
      for (int i = 0; i < c.hd; ++i) {
        double acc = 0;
        for (int p = first; p < len; ++p)
          acc += sc[p] * vr[base + size_t(p) * kv_w + hk * c.hd + i];
        ref[(size_t(t) * c.n_head + h) * c.hd + i] = acc / sum;
      }
    }
  const double bound = decode_attention_bound(c.hd, c.kv);
  std::vector<int32_t> slots(2 * size_t(n_tok)), iq, ik, iv;
  for (int i = 0; i < n_tok; ++i) slots[i] = c.seqs[i], slots[n_tok + i] = c.positions[i];
  check(
      [&](Graph& g, Backend& be) {
        auto pool = [&](const std::vector<uint8_t>& bytes, const char* name) {
          void* p = be.alloc_kv(bytes.size());
          be.kv_from_host(p, bytes.data(), bytes.size());
          return g.kv_pool(c.kv, kv_w, c.rows, c.n_seq, p, name, c.ring);
        };
        Tensor* kp = pool(kb, "k_pool");
        Tensor* vp = pool(vb, "v_pool");
        Tensor* sl = g.input_i32(2 * n_tok, slots.data(), "slots");
        g.kv_store_seqs(kp, activations(g, be, k_new, kv_w, n_tok, ik), sl);
        g.kv_store_seqs(vp, activations(g, be, v_new, kv_w, n_tok, iv), sl);
        return g.attention_seqs(activations(g, be, q, int64_t(c.n_head) * c.hd, n_tok, iq), kp, vp,
                                sl, c.n_head, c.n_head_kv, c.hd, scale, c.window);
      },
      ref, bound, bound,
      std::string(type_name(c.kv)) + " pool of " + std::to_string(c.n_seq) + " x " +
          std::to_string(c.rows) + (c.ring ? " (rings)" : "") + ", " + std::to_string(n_tok) +
          " tokens, heads " + std::to_string(c.n_head) + "/" + std::to_string(c.n_head_kv) +
          " hd " + std::to_string(c.hd),
      0);
}

TEST_F(CudaOps, AttentionOverSequencePools) {
  std::mt19937 rng(27);
  const CheckFn chk = checker();
  const DType f16 = DType::F16, q8 = DType::Q8_0;
  const PoolCase cases[] = {{9, 3, 64, 4, 64, {2, 0, 3}, {5, 0, 40}, 0, false, f16},
                            {8, 2, 128, 3, 600, {1, 2, 0}, {300, 7, 599}, 0, false, q8},
                            {4,
                             4,
                             64,
                             12,
                             40,
                             {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11},
                             {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 39}},
                            {4, 1, 256, 2, 530, {1, 0}, {2000, 4}, 512, true},
                            {4, 2, 64, 3, 8, {0, 2}, {50, 3}, 8, true, q8},
                            // One query head a KV head: the lanes' kernel, at 128 dims (16-key
                            // tiles) and 256: one key, part of a tile, splits.
                            {2, 2, 128, 5, 300, {4, 1, 3, 0}, {299, 2, 150, 40}, 0, false, q8},
                            {3, 3, 128, 4, 300, {2, 0, 3, 1}, {260, 0, 33, 129}, 0, false, f16},
                            {2, 2, 256, 3, 100, {0, 2}, {99, 10}}};
  for (const PoolCase& c : cases) check_attention_seqs(c, rng, chk);
}

// A decode batch's attention over pools and the product that reads it, CUDA against the CPU:
// with more than 8 sequences the attention hands its output's half form to the product, from
// one split (short sequences) and from the merge of several (long ones).
TEST_F(CudaOps, DecodeBatchAttentionHandsItsHalfFormToTheProduct) {
  std::mt19937 rng(43);
  const int n_head = 8, n_head_kv = 2, hd = 64, n_embd = n_head * hd, kv_w = n_head_kv * hd;
  const int n_seq = 16, rows = 4096;
  const auto k16 = randn_f16(size_t(kv_w) * rows * n_seq, rng);
  const auto v16 = randn_f16(size_t(kv_w) * rows * n_seq, rng);
  std::vector<float> dw;
  const auto bw =
      quantize(DType::Q4_0, randn(size_t(n_embd) * n_embd, rng, 0.05f), n_embd, n_embd, dw);
  for (int n_tok : {12, 16}) {
    std::vector<int32_t> slots(2 * size_t(n_tok)), ids;
    for (int i = 0; i < n_tok; ++i) {
      slots[i] = (i * 7) % n_seq;
      slots[n_tok + i] = i % 2 ? 2000 + int(rng() % 2000) : int(rng() % 100);
    }
    auto q = randn(size_t(n_embd) * n_tok, rng);
    Build build = [&](Graph& g, Backend& be) {
      Tensor* kp = f16_pool(g, be, k16, kv_w, rows, n_seq, "k_pool");
      Tensor* vp = f16_pool(g, be, v16, kv_w, rows, n_seq, "v_pool");
      Tensor* sl = g.input_i32(2 * n_tok, slots.data(), "slots");
      Tensor* a = g.attention_seqs(activations(g, be, q, n_embd, n_tok, ids), kp, vp, sl, n_head,
                                   n_head_kv, hd, 1.0f / std::sqrt(float(hd)));
      return g.mul_mat(upload(g, be, DType::Q4_0, n_embd, n_embd, bw.data(), "wo"), a);
    };
    const auto gpu = run_on(*cuda_, build);
    const auto cpu = run_on(*cpu_, build);
    EXPECT_LT(rel_err(gpu, cpu), 3e-2) << n_tok << " tokens";
  }
}

// A decode batch's attention input over KV pools, CUDA against the CPU: q, k and v products of
// one activation, the ropes, the K/V stores by slots, the attention. Without GQA the ropes and
// both stores are one launch (a token a block, k's rope where q's product was); with it, not.
TEST_F(CudaOps, DecodeBatchRopesAndStoresMatchTheCpu) {
  std::mt19937 rng(41);
  const int n_head = 4, hd = 64, n_embd = n_head * hd, n_seq = 32, rows = 64;
  for (int n_head_kv : {4, 1}) {
    const int kv_w = n_head_kv * hd;
    for (DType t : {DType::Q4_0, DType::F16}) {
      for (int n_tok : {3, 12, 16, 32}) {
        std::vector<float> dq, dk, dv;
        auto bq = quantize(t, randn(size_t(n_embd) * n_embd, rng, 0.05f), n_embd, n_embd, dq);
        auto bk = quantize(t, randn(size_t(n_embd) * kv_w, rng, 0.05f), n_embd, kv_w, dk);
        auto bv = quantize(t, randn(size_t(n_embd) * kv_w, rng, 0.05f), n_embd, kv_w, dv);
        auto x = randn(size_t(n_embd) * n_tok, rng);
        // Each token a sequence of its own at its own position, the pools' other rows random.
        std::vector<int32_t> seqs(n_seq), pos(n_tok), slots(2 * size_t(n_tok)), ids;
        for (int i = 0; i < n_seq; ++i) seqs[i] = i;
        std::shuffle(seqs.begin(), seqs.end(), rng);
        for (int i = 0; i < n_tok; ++i) {
          pos[i] = int(rng() % (rows - 1));
          slots[i] = seqs[i];
          slots[n_tok + i] = pos[i];
        }
        const auto k16 = randn_f16(size_t(kv_w) * rows * n_seq, rng);
        const auto v16 = randn_f16(size_t(kv_w) * rows * n_seq, rng);
        Build build = [&](Graph& g, Backend& be) {
          Tensor* kp = f16_pool(g, be, k16, kv_w, rows, n_seq, "k_pool");
          Tensor* vp = f16_pool(g, be, v16, kv_w, rows, n_seq, "v_pool");
          Tensor* xt = activations(g, be, x, n_embd, n_tok, ids);
          Tensor* p = g.input_i32(n_tok, pos.data(), "pos");
          Tensor* sl = g.input_i32(2 * n_tok, slots.data(), "slots");
          Tensor* q = g.mul_mat(upload(g, be, t, n_embd, n_embd, bq.data(), "wq"), xt);
          Tensor* k = g.mul_mat(upload(g, be, t, n_embd, kv_w, bk.data(), "wk"), xt);
          Tensor* v = g.mul_mat(upload(g, be, t, n_embd, kv_w, bv.data(), "wv"), xt);
          q = g.rope(q, p, n_head, hd, hd, kRopeNormal, 10000.0f);
          k = g.rope(k, p, n_head_kv, hd, hd, kRopeNormal, 10000.0f);
          g.kv_store_seqs(kp, k, sl);
          g.kv_store_seqs(vp, v, sl);
          return g.attention_seqs(q, kp, vp, sl, n_head, n_head_kv, hd,
                                  1.0f / std::sqrt(float(hd)));
        };
        const auto gpu = run_on(*cuda_, build);
        const auto cpu = run_on(*cpu_, build);
        EXPECT_LT(rel_err(gpu, cpu), t == DType::F16 ? 5e-3 : 3e-2)
            << type_name(t) << " heads " << n_head << "/" << n_head_kv << " tokens " << n_tok;
      }
    }
  }
}

// A decode batch's layer with rows of 2,048 (warp-pipelined products from 4 columns) whose
// products' activations come in column tiles from their producers (the norms, the attention over
// pools, the glu), against the same layer with the tiles quantized by launches of their own
// (GGRAPH_CUDA_TILE_OUTPUT=0): bit for bit, since both quantize the same floats; at 6 and 12
// tokens the last tile's padding columns, left unwritten (poisoned), reach no result. v in Q5_0
// reads the norm's plain 8-bit form up to 8 tokens (which then writes no tiles), its half form
// beyond. Both against the CPU too.
TEST_F(CudaOps, DecodeBatchTilesFromTheProducersEqualTheQuantizeLaunch) {
  struct Restore {
    bool before = cuda::set_tile_output(true);
    ~Restore() { cuda::set_tile_output(before); }
  } restore;
  std::mt19937 rng(47);
  const int n_embd = 2048, n_head = 16, n_head_kv = 4, hd = 128, n_ff = 2048, n_vocab = 256;
  const int kv_w = n_head_kv * hd, n_seq = 16, rows = 256;
  std::vector<float> deq;
  auto mat = [&](DType t, const std::vector<float>& w, int64_t k, int64_t n) {
    return quantize(t, w, k, n, deq);
  };
  const auto wq = mat(DType::Q4_0, randn(size_t(n_embd) * n_embd, rng, 0.05f), n_embd, n_embd);
  const auto wk = mat(DType::Q4_0, randn(size_t(n_embd) * kv_w, rng, 0.05f), n_embd, kv_w);
  const auto wo = mat(DType::Q4_0, randn(size_t(n_embd) * n_embd, rng, 0.05f), n_embd, n_embd);
  const auto gate = mat(DType::Q4_0, randn(size_t(n_embd) * n_ff, rng, 0.05f), n_embd, n_ff);
  const auto up = mat(DType::Q4_0, randn(size_t(n_embd) * n_ff, rng, 0.05f), n_embd, n_ff);
  const auto down = mat(DType::Q4_0, randn(size_t(n_ff) * n_embd, rng, 0.05f), n_ff, n_embd);
  const auto out = mat(DType::Q8_0, randn(size_t(n_embd) * n_vocab, rng, 0.05f), n_embd, n_vocab);
  const auto embd = mat(DType::Q8_0, randn(size_t(n_embd) * n_vocab, rng), n_embd, n_vocab);
  std::vector<float> attn_norm = randn(n_embd, rng, 0.3f), ffn_norm = randn(n_embd, rng, 0.3f),
                     out_norm = randn(n_embd, rng, 0.3f);
  for (auto* v : {&attn_norm, &ffn_norm, &out_norm})
    for (float& x : *v) x += 1.0f;
  const auto k16 = randn_f16(size_t(kv_w) * rows * n_seq, rng);
  const auto v16 = randn_f16(size_t(kv_w) * rows * n_seq, rng);
  std::vector<int32_t> seqs(n_seq);
  for (int i = 0; i < n_seq; ++i) seqs[i] = i;
  std::shuffle(seqs.begin(), seqs.end(), rng);
  for (DType v_type : {DType::Q4_0, DType::Q5_0}) {
    const auto wv = random_blocks(v_type, n_embd, kv_w, rng);
    for (int n_tok : {6, 12, 16}) {
      std::vector<int32_t> tokens(n_tok), pos(n_tok), slots(2 * size_t(n_tok));
      for (int i = 0; i < n_tok; ++i) {
        tokens[i] = (i * 37 + 11) % n_vocab;
        pos[i] = int(rng() % (rows - 1));
        slots[i] = seqs[i];
        slots[n_tok + i] = pos[i];
      }
      Build build = [&](Graph& g, Backend& be) {
        auto w = [&](DType t, const std::vector<uint8_t>& m, int64_t k, int64_t n,
                     const char* name) { return upload(g, be, t, k, n, m.data(), name); };
        auto f32 = [&](const std::vector<float>& v, const char* name) {
          return upload(g, be, DType::F32, int64_t(v.size()), 1, v.data(), name);
        };
        Tensor* kp = f16_pool(g, be, k16, kv_w, rows, n_seq, "k_pool");
        Tensor* vp = f16_pool(g, be, v16, kv_w, rows, n_seq, "v_pool");
        Tensor* p = g.input_i32(n_tok, pos.data(), "pos");
        Tensor* sl = g.input_i32(2 * n_tok, slots.data(), "slots");
        Tensor* x = g.get_rows(w(DType::Q8_0, embd, n_embd, n_vocab, "embd"),
                               g.input_i32(n_tok, tokens.data(), "tokens"));
        Tensor* h = g.mul(g.rms_norm(x, 1e-5f), f32(attn_norm, "attn_norm"));
        Tensor* q = g.mul_mat(w(DType::Q4_0, wq, n_embd, n_embd, "wq"), h);
        Tensor* k = g.mul_mat(w(DType::Q4_0, wk, n_embd, kv_w, "wk"), h);
        Tensor* v = g.mul_mat(w(v_type, wv, n_embd, kv_w, "wv"), h);
        q = g.rope(q, p, n_head, hd, hd, kRopeNormal, 10000.0f);
        k = g.rope(k, p, n_head_kv, hd, hd, kRopeNormal, 10000.0f);
        g.kv_store_seqs(kp, k, sl);
        g.kv_store_seqs(vp, v, sl);
        Tensor* a =
            g.attention_seqs(q, kp, vp, sl, n_head, n_head_kv, hd, 1.0f / std::sqrt(float(hd)));
        x = g.add(x, g.mul_mat(w(DType::Q4_0, wo, n_embd, n_embd, "wo"), a));
        Tensor* f = g.mul(g.rms_norm(x, 1e-5f), f32(ffn_norm, "ffn_norm"));
        Tensor* ffn = g.swiglu(g.mul_mat(w(DType::Q4_0, gate, n_embd, n_ff, "gate"), f),
                               g.mul_mat(w(DType::Q4_0, up, n_embd, n_ff, "up"), f));
        x = g.add(x, g.mul_mat(w(DType::Q4_0, down, n_ff, n_embd, "down"), ffn));
        x = g.mul(g.rms_norm(x, 1e-5f), f32(out_norm, "out_norm"));
        return g.mul_mat(w(DType::Q8_0, out, n_embd, n_vocab, "output"), x);
      };
      const std::string what =
          std::string("v ") + type_name(v_type) + ", " + std::to_string(n_tok) + " tokens";
      cuda::set_tile_output(true);
      const auto tiles = run_on(*cuda_, build);
      cuda::set_tile_output(false);
      const auto apart = run_on(*cuda_, build);
      const auto cpu = run_on(*cpu_, build);
      ASSERT_EQ(tiles.size(), apart.size()) << what;
      EXPECT_EQ(std::memcmp(tiles.data(), apart.data(), tiles.size() * sizeof(float)), 0) << what;
      EXPECT_LT(rel_err(tiles, cpu), 5e-2) << what;
      EXPECT_LT(rel_err(apart, cpu), 5e-2) << what;
    }
  }
}

// ---- the ops Gemma, Qwen and Phi add --------------------------------------------------------

TEST_F(CudaOps, PerHeadNormWithItsWeightAndRepeatedBroadcast) {
  std::mt19937 rng(23);
  for (int64_t hd : {int64_t(64), int64_t(128), int64_t(256)}) {
    for (int64_t n_head : {int64_t(1), int64_t(4), int64_t(9)}) {
      for (int64_t n_tok : {int64_t(1), int64_t(5)}) {
        const int64_t w = hd * n_head;
        auto x = randn(size_t(w) * n_tok, rng, 2.0f);
        auto wt = randn(size_t(hd), rng);
        const Shape heads = {hd, n_head * n_tok};
        const auto norm = rms_norm_ref(x, heads, 1e-6f);
        std::vector<double> ref(norm.size()), add_ref(norm.size());
        for (size_t i = 0; i < ref.size(); ++i) {
          ref[i] = norm[i] * wt[i % hd];
          add_ref[i] = double(x[i]) + wt[i % hd];
        }
        std::vector<int32_t> ids;
        const std::string what = std::to_string(n_head) + " heads of " + std::to_string(hd) +
                                 " x " + std::to_string(n_tok);
        check(
            [&](Graph& g, Backend& be) {
              Tensor* weight = upload(g, be, DType::F32, hd, 1, wt.data(), "w");
              return g.mul(g.rms_norm(activations(g, be, x, w, n_tok, ids), 1e-6f, hd), weight);
            },
            ref, 1e-6, 1e-6, "per-head norm*w, " + what);
        check(
            [&](Graph& g, Backend& be) {
              Tensor* weight = upload(g, be, DType::F32, hd, 1, wt.data(), "w");
              return g.add(activations(g, be, x, w, n_tok, ids), weight);
            },
            add_ref, 1e-6, 1e-6, "repeated add, " + what);
      }
    }
  }
}

TEST_F(CudaOps, GegluSoftcapAndScaledRows) {
  std::mt19937 rng(24);
  for (Shape s : {Shape{64, 1}, Shape{2048, 1}, Shape{2048, 7}, Shape{96, 33}}) {
    auto a = randn(size_t(s.ne0) * s.ne1, rng, 3.0f), b = randn(size_t(s.ne0) * s.ne1, rng);
    std::vector<double> geglu(a.size()), capped(a.size()), scaled(a.size());
    for (size_t i = 0; i < a.size(); ++i) {
      const double x = a[i];
      geglu[i] = 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x))) * b[i];
      capped[i] = 2.5 * std::tanh(x / 2.5);
      scaled[i] = x * 25.3;
    }
    std::vector<int32_t> ia, ib;
    const std::string what = std::to_string(s.ne0) + "x" + std::to_string(s.ne1);
    check(
        [&](Graph& g, Backend& be) {
          return g.geglu(activations(g, be, a, s.ne0, s.ne1, ia),
                         activations(g, be, b, s.ne0, s.ne1, ib));
        },
        geglu, 1e-5, 1e-5, "geglu " + what);
    check([&](Graph& g,
              Backend& be) { return g.softcap(activations(g, be, a, s.ne0, s.ne1, ia), 2.5f); },
          capped, 1e-6, 1e-6, "softcap " + what);
    ia.resize(s.ne1);
    for (int64_t i = 0; i < s.ne1; ++i) ia[i] = int32_t(i);
    check(
        [&](Graph& g, Backend& be) {
          return g.get_rows(upload(g, be, DType::F32, s.ne0, s.ne1, a.data(), "t"),
                            g.input_i32(s.ne1, ia.data(), "ids"), 25.3f);
        },
        scaled, 1e-6, 1e-6, "scaled get_rows " + what);
  }
}

// The formats with kernels of their own beside Q4_0/Q4_1/Q8_0 (no quantizer here: random
// blocks): every mat-vec path (short rows in registers, long rows, several columns) and the tiles.
TEST_F(CudaOps, MulMatFiveBitSixBitKAndIQ4Quants) {
  std::mt19937 rng(26);
  const CheckFn chk = checker();
  for (DType t : kKernelOnlyTypes) {
    const bool k_quant = type_traits(t).block_size == 256;
    const Shape kn[] = {{256, 7},
                        {768, 33},
                        {2048, 130},
                        {k_quant ? 4352 : 4128, 65},
                        {k_quant ? 11008 - 11008 % 256 : 11008, 19}};
    for (Shape s : kn) {
      for (int64_t cols : {1, 2, 7, 8, 9, 40}) check_random_blocks(t, s.ne0, s.ne1, cols, rng, chk);
    }
    check_random_blocks(t, 256, 8197, 1, rng, chk);
    if (!k_quant) check_random_blocks(t, 96, 37, 1, rng, chk);  // rows shorter than a round
  }
}

// ---- determinism, memory errors, devices
// ---------------------------------------------------------

TEST_F(CudaOps, RepeatedRunsAreBitwiseEqual) {
  std::mt19937 rng(22);
  const int64_t k = 4096, n = 1000;
  auto wf = randn(size_t(k) * n, rng, 0.05f);
  std::vector<float> deq;
  auto bytes = quantize(DType::Q4_0, wf, k, n, deq);
  for (int64_t cols : {1, 5, 64}) {
    auto x = randn(size_t(k) * cols, rng);
    std::vector<int32_t> ids;
    Build b = [&](Graph& g, Backend& be) {
      return g.mul_mat(upload(g, be, DType::Q4_0, k, n, bytes.data(), "w"),
                       activations(g, be, x, k, cols, ids));
    };
    const auto first = run_on(*cuda_, b);
    const auto second = run_on(*cuda_, b);
    EXPECT_EQ(0, std::memcmp(first.data(), second.data(), first.size() * sizeof(float)))
        << "cols " << cols;
  }
}

TEST_F(CudaOps, OutOfMemoryIsADeviceErrorAndTheBackendStaysUsable) {
  const size_t huge = size_t(1) << 50;  // 1 PiB
  std::vector<uint8_t> small(16);
  try {
    cuda_->alloc_kv(huge);
    FAIL() << "allocating 1 PiB succeeded";
  } catch (const DeviceError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("out of device memory"), std::string::npos) << msg;
    EXPECT_NE(msg.find("MiB free of"), std::string::npos) << msg;
  }
  EXPECT_THROW(cuda_->reserve(huge, 16), DeviceError);
  std::mt19937 rng(23);
  Shape s = {64, 2};
  auto x = randn(size_t(s.ne0) * s.ne1, rng);
  std::vector<int32_t> ids;
  const auto out = run_on(*cuda_, [&](Graph& g, Backend& be) {
    return g.rms_norm(activations(g, be, x, s.ne0, s.ne1, ids), 1e-5f);
  });
  EXPECT_LT(rel_err(out, rms_norm_ref(x, s, 1e-5f)), 1e-6);
}

TEST(CudaDevices, ListsUsableGpus) {
  REQUIRE_GPU();
  for (const DeviceInfo& d : cuda_devices()) {
    EXPECT_FALSE(d.name.empty());
    EXPECT_GT(d.total_memory, d.free_memory);
    EXPECT_GT(d.multiprocessors, 0);
    EXPECT_GE(d.cc_major, 5);
  }
  CudaOptions o;
  o.device = int(cuda_devices().size());
  EXPECT_THROW(make_cuda_backend(o), DeviceError);
  o.device = 0;
  o.graphs = "sometimes";
  EXPECT_THROW(make_cuda_backend(o), ArgumentError);
}

// ---- Launch plan (host only: no GPU needed)
// ------------------------------------------------------
//
// launch_graph with launches recorded and not executed: what the CUDA graph executor relies on.

// Two llama-style layers at the given batch and cache position, weights at fake device addresses.
// Weights at made-up device addresses, for graphs that are planned but never run.
struct FakeWeights {
  uintptr_t next = 0x100000;
  void* alloc(size_t bytes) {
    void* p = reinterpret_cast<void*>(next);
    next += (bytes + 4095) / 4096 * 4096 + 4096;
    return p;
  }
  Tensor* weight(Graph& g, DType t, int64_t ne0, int64_t ne1, const char* name) {
    return g.weight(t, ne0, ne1, alloc(row_size(t, ne0) * ne1), name);
  }
};

struct LayerGraph {
  Graph g;
  std::vector<int32_t> tokens, positions;
  Tensor *wq = nullptr, *wk = nullptr, *wv = nullptr, *gate = nullptr, *up = nullptr;
  Tensor *down = nullptr, *attn_norm_mul = nullptr, *attention = nullptr, *wo = nullptr;
  Tensor* glu = nullptr;
  Tensor *rope_q = nullptr, *rope_k = nullptr, *store_k = nullptr, *store_v = nullptr;

  // q/k head norms (Qwen 3, Gemma 3) after the products, when set
  Tensor *q_norm = nullptr, *k_norm = nullptr;

  // head_norms: per-head q/k norms before the ropes; v_type: v's format (q and k are Q4_1);
  // first_mode: the ropes' mode with the products first; rope_factors: a factors leaf (Llama
  // 3's) made between the products and the ropes, as the model builder makes it.
  LayerGraph(int n_tokens, int n_past, bool products_first = false, bool head_norms = false,
             DType qk_type = DType::Q4_1, DType v_type = DType::Q4_1, int first_mode = kRopeNeox,
             bool rope_factors = false) {
    const int n_embd = 576, n_head = 9, n_head_kv = 3, hd = 64, n_ff = 1536, n_ctx = 1024;
    FakeWeights fw;
    auto fake = [&](size_t bytes) { return fw.alloc(bytes); };
    auto weight = [&](DType t, int64_t ne0, int64_t ne1, const char* name) {
      return fw.weight(g, t, ne0, ne1, name);
    };
    tokens.assign(n_tokens, 1);
    positions.resize(n_tokens);
    for (int i = 0; i < n_tokens; ++i) positions[i] = n_past + i;
    Tensor* tok = g.input_i32(n_tokens, tokens.data(), "tokens");
    Tensor* pos = g.input_i32(n_tokens, positions.data(), "positions");
    Tensor* x = g.get_rows(weight(DType::Q8_0, n_embd, 49152, "tok_embd"), tok);
    for (int il = 0; il < 2; ++il) {
      Tensor* kc =
          g.kv_cache(DType::F16, n_head_kv * hd, n_ctx, fake(n_ctx * n_head_kv * hd * 2), "k");
      Tensor* vc =
          g.kv_cache(DType::F16, n_head_kv * hd, n_ctx, fake(n_ctx * n_head_kv * hd * 2), "v");
      // The norm weights' leaves come between the residual add and the norm, as a model builder
      // may leave them.
      Tensor* attn_norm_w = weight(DType::F32, n_embd, 1, "attn_norm");
      Tensor* h = g.mul(g.rms_norm(x, 1e-5f), attn_norm_w);
      attn_norm_mul = h;
      Tensor* wqt = weight(qk_type, n_embd, n_embd, "wq");
      Tensor* wkt = weight(qk_type, n_embd, n_head_kv * hd, "wk");
      Tensor* wvt = weight(v_type, n_embd, n_head_kv * hd, "wv");
      Tensor *q, *k, *v;
      if (products_first || head_norms) {
        wq = g.mul_mat(wqt, h);
        wk = g.mul_mat(wkt, h);
        wv = v = g.mul_mat(wvt, h);
        Tensor *qn = wq, *kn = wk;
        if (head_norms) {
          q_norm = g.rms_norm(wq, 1e-6f, hd);
          qn = g.mul(q_norm, weight(DType::F32, hd, 1, "q_norm"));
          k_norm = g.rms_norm(wk, 1e-6f, hd);
          kn = g.mul(k_norm, weight(DType::F32, hd, 1, "k_norm"));
        }
        Tensor* freqs = rope_factors ? weight(DType::F32, hd / 2, 1, "rope_freqs") : nullptr;
        q = g.rope(qn, pos, n_head, hd, hd, first_mode, 10000.0f, freqs);
        k = g.rope(kn, pos, n_head_kv, hd, hd, first_mode, 10000.0f, freqs);
      } else {
        q = g.rope(wq = g.mul_mat(wqt, h), pos, n_head, hd, hd, kRopeNormal, 10000.0f);
        k = g.rope(wk = g.mul_mat(wkt, h), pos, n_head_kv, hd, hd, kRopeNormal, 10000.0f);
        wv = v = g.mul_mat(wvt, h);
      }
      rope_q = q;
      rope_k = k;
      store_k = g.kv_store(kc, k, n_past);
      store_v = g.kv_store(vc, v, n_past);
      attention = g.attention(q, kc, vc, n_head, n_head_kv, hd, 0.125f, n_past + n_tokens, n_past);
      wo = g.mul_mat(weight(DType::Q4_1, n_embd, n_embd, "wo"), attention);
      x = g.add(x, wo);
      Tensor* ffn_norm_w = weight(DType::F32, n_embd, 1, "ffn_norm");
      Tensor* f = g.mul(g.rms_norm(x, 1e-5f), ffn_norm_w);
      gate = g.mul_mat(weight(DType::Q4_1, n_embd, n_ff, "gate"), f);
      up = g.mul_mat(weight(DType::Q4_1, n_embd, n_ff, "up"), f);
      glu = g.swiglu(gate, up);
      down = g.mul_mat(weight(DType::Q4_1, n_ff, n_embd, "down"), glu);
      x = g.add(x, down);
    }
    g.set_output(g.mul_mat(weight(DType::Q8_0, n_embd, 49152, "output"), x));
    plan(g);
  }

  static int32_t* record() { return reinterpret_cast<int32_t*>(uintptr_t(0x7400000000)); }

  std::vector<cuda::KernelLaunch> launches() const { return launches_of_graph(g); }

  // The launches a planned graph makes, recorded without running (fake device addresses), with
  // the backend's rope angle tables given (or none).
  static std::vector<cuda::KernelLaunch> launches_of_graph(
      const Graph& g, const std::vector<cuda::RopeTable>& rope_tables = {}) {
    cuda::validate_graph(g);
    cuda::DeviceBuffers buf;
    buf.rope_tables = rope_tables.data();
    buf.n_rope_tables = static_cast<int>(rope_tables.size());
    buf.scratch = reinterpret_cast<uint8_t*>(uintptr_t(0x7000000000));
    buf.input = reinterpret_cast<uint8_t*>(uintptr_t(0x7100000000));
    buf.act = reinterpret_cast<uint8_t*>(uintptr_t(0x7200000000));
    buf.attn = reinterpret_cast<float*>(uintptr_t(0x7300000000));
    buf.attn_counters = reinterpret_cast<unsigned*>(uintptr_t(0x7500000000));
    buf.kv_record = record();
    std::vector<cuda::KernelLaunch> rec;
    cuda::Launcher l;
    l.execute = false;
    l.record = &rec;
    cuda::KvLayout kv;
    cuda::kv_layout(g, &kv);
    cuda::launch_graph(g, kv, buf, l);
    return rec;
  }
};

int launches_of(const std::vector<cuda::KernelLaunch>& rec, const Tensor* t) {
  return int(std::count_if(rec.begin(), rec.end(),
                           [&](const cuda::KernelLaunch& k) { return k.node == t->index; }));
}

// The launches at each node of a plan, as (node, launches) pairs.
void expect_launches(const std::vector<cuda::KernelLaunch>& rec,
                     std::initializer_list<std::pair<const Tensor*, int>> want) {
  for (const auto& [t, n] : want)
    EXPECT_EQ(launches_of(rec, t), n) << op_name(t->op) << " node " << t->index << " " << t->name;
}

// The launches at q's, k's and v's product nodes of a layer's plan.
void expect_qkv_launches(const LayerGraph& lg, int q, int k, int v) {
  const auto rec = lg.launches();
  EXPECT_EQ(launches_of(rec, lg.wq), q);
  EXPECT_EQ(launches_of(rec, lg.wk), k);
  EXPECT_EQ(launches_of(rec, lg.wv), v);
}

// The norm's fold into the products after it (NormFold) off for a test's scope.
struct NormFoldOff : Switched<cuda::set_norm_fold> {
  NormFoldOff() : Switched(false) {}
};

TEST(CudaLaunchPlan, DecodeGroupsProductsOfOneActivationAndFusesTheNormWeight) {
  {
    // (With the norm's own launch: NormFoldedIntoItsProductsEqualsTheNormsLaunch has the fold.)
    NormFoldOff off;
    LayerGraph lg(1, 20, /*products_first=*/true);
    const auto rec = lg.launches();
    // The residual add before the second layer's norm launches the norm too, which multiplies
    // by its weight and quantizes for the mat-vecs; q's node then launches q, k and v together.
    const Tensor* residual_add = lg.attn_norm_mul->src[0]->src[0];
    ASSERT_EQ(residual_add->op, Op::Add);
    EXPECT_EQ(launches_of(rec, residual_add), 1);
    EXPECT_EQ(launches_of(rec, lg.attn_norm_mul->src[0]), 0);
    EXPECT_EQ(launches_of(rec, lg.attn_norm_mul), 0);
    expect_launches(rec, {{lg.wq, 1}, {lg.wk, 0}, {lg.wv, 0}});
    // Then the ropes of q and k, with the K and V stores, in one launch at q's rope.
    expect_launches(rec, {{lg.rope_q, 1}, {lg.rope_k, 0}, {lg.store_k, 0}, {lg.store_v, 0}});
    // The attention writes its output's 8-bit form too: the output projection is one launch.
    expect_launches(rec, {{lg.attention, 1}, {lg.wo, 1}});
  }
  {
    // A split attention (a long context) is one launch too: the last split of each head
    // merges the partials and writes both forms.
    LayerGraph lg(1, 900);
    const auto rec = lg.launches();
    EXPECT_EQ(launches_of(rec, lg.attention), 1);
    EXPECT_EQ(launches_of(rec, lg.wo), 1);
  }
  {
    // In the llama order, gate and up are adjacent: one launch for both, reading the 8-bit
    // activation that the FFN norm wrote, with the glu in its epilogue (MatVecGlu); down reads
    // the 8-bit form that the epilogue wrote (no launch of its own). With the epilogue off, the
    // glu is a launch that writes that form.
    for (bool on : {true, false}) {
      const Switched<cuda::set_glu_epilogue> glu(on);
      LayerGraph lg(1, 20);
      const auto rec = lg.launches();
      expect_launches(rec, {{lg.gate, 1}, {lg.up, 0}, {lg.glu, on ? 0 : 1}, {lg.down, 1}});
    }
    // Several tokens keep the glu's launch.
    LayerGraph lg(4, 20);
    EXPECT_EQ(launches_of(lg.launches(), lg.glu), 1);
  }
  {
    // A prompt of 32 tokens takes the half kernel, on the half form the norm writes beside its
    // output: no conversion launch, and q, k and v in one launch. (Up to 16 columns take the
    // warp-pipelined int8 kernel; from 65, the tiled path or cuBLAS, a launch a product.)
    expect_qkv_launches(LayerGraph(32, 0, true), 1, 0, 0);
    expect_qkv_launches(LayerGraph(96, 0, true), 1, 1, 1);
  }
  {
    // A batch of 16 takes the warp-pipelined int8 products, which read the activation in column
    // tiles: the norm writes them beside its output, and q, k and v are one launch; so are
    // gate and up (the FFN norm's tiles); down reads the glu's. The attention of 16 tokens of one
    // sequence (the prompt kernels) writes no 8-bit form: the output projection quantizes its
    // tiles first.
    LayerGraph lg(16, 0, true);
    const auto rec = lg.launches();
    expect_launches(
        rec,
        {{lg.wq, 1}, {lg.wk, 0}, {lg.wv, 0}, {lg.gate, 1}, {lg.up, 0}, {lg.down, 1}, {lg.wo, 2}});
  }
  {
    // Without the producers' tiles (GGRAPH_CUDA_TILE_OUTPUT=0), the first product of each
    // activation quantizes its tiles first.
    const bool before = cuda::set_tile_output(false);
    LayerGraph lg(16, 0, true);
    const auto rec = lg.launches();
    cuda::set_tile_output(before);
    expect_launches(rec,
                    {{lg.wq, 2}, {lg.wk, 0}, {lg.wv, 0}, {lg.gate, 2}, {lg.up, 0}, {lg.down, 2}});
  }
  {
    // v in a format the int8 kernels do not take reads the half form the norm wrote, beside the
    // column tiles of q and k, kept apart: no conversion launch for any of the three; q and k
    // share a launch.
    expect_qkv_launches(LayerGraph(16, 0, true, false, DType::Q4_1, DType::Q5_0), 1, 0, 1);
  }
}

// The rope epilogues off for a test's scope.
struct RopeEpilogueOff : Switched<cuda::set_rope_epilogue> {
  RopeEpilogueOff() : Switched(false) {}
};
// A build's output and its K and V caches (`bytes` each at k_mem and v_mem, which the build sets)
// as a run on `be` leaves them, with the rope epilogues as they are and then off.
struct EpilogueRuns {
  std::vector<float> out, out_apart;
  std::vector<uint8_t> k, v, k_apart, v_apart;
};
EpilogueRuns with_and_without_rope_epilogue(Backend& be, const Build& build, void* const& k_mem,
                                            void* const& v_mem, size_t bytes) {
  auto run = [&](std::vector<uint8_t>& k_out, std::vector<uint8_t>& v_out) {
    auto out = run_on(be, build);
    k_out.resize(bytes);
    v_out.resize(bytes);
    be.kv_to_host(k_out.data(), k_mem, bytes);
    be.kv_to_host(v_out.data(), v_mem, bytes);
    return out;
  };
  EpilogueRuns r;
  r.out = run(r.k, r.v);
  RopeEpilogueOff off;
  r.out_apart = run(r.k_apart, r.v_apart);
  return r;
}
// The warp-pipelined products' rope epilogue on for a test's scope (whatever
// GGRAPH_CUDA_WARP_ROPE_EPILOGUE says).
struct WarpRopeEpilogueOn : Switched<cuda::set_warp_rope_epilogue> {
  WarpRopeEpilogueOn() : Switched(true) {}
};

// A decode batch's layer over KV pools (the model builder's order: q, k and v products, the
// ropes, the K/V stores by slots, the attention), planned but not run; the products', the
// ropes' and the stores' nodes. v_type: v's format (the others are Q4_0).
struct SeqsLayer {
  Graph g;
  std::vector<int32_t> tokens, positions, slots;
  Tensor *wq = nullptr, *wv = nullptr, *wo = nullptr;
  Tensor *rope_q = nullptr, *rope_k = nullptr, *store_k = nullptr, *store_v = nullptr;

  SeqsLayer(int n_tokens, int n_head_kv, DType v_type = DType::Q4_0) {
    const int n_embd = 4096, n_head = 32, hd = 128, rows = 512, n_seq = 64;
    const int kv_w = n_head_kv * hd;
    FakeWeights fw;
    auto fake = [&](size_t bytes) { return fw.alloc(bytes); };
    auto weight = [&](DType t, int64_t ne0, int64_t ne1, const char* name) {
      return fw.weight(g, t, ne0, ne1, name);
    };
    tokens.assign(n_tokens, 1);
    positions.assign(n_tokens, 5);
    slots.assign(2 * size_t(n_tokens), 0);
    Tensor* tok = g.input_i32(n_tokens, tokens.data(), "tokens");
    Tensor* pos = g.input_i32(n_tokens, positions.data(), "positions");
    Tensor* sl = g.input_i32(2 * n_tokens, slots.data(), "slots");
    Tensor* x = g.get_rows(weight(DType::Q8_0, n_embd, 32000, "tok_embd"), tok);
    for (int il = 0; il < 2; ++il) {
      Tensor* h = g.mul(g.rms_norm(x, 1e-5f), weight(DType::F32, n_embd, 1, "attn_norm"));
      Tensor* q = wq = g.mul_mat(weight(DType::Q4_0, n_embd, n_embd, "wq"), h);
      Tensor* k = g.mul_mat(weight(DType::Q4_0, n_embd, kv_w, "wk"), h);
      Tensor* v = wv = g.mul_mat(weight(v_type, n_embd, kv_w, "wv"), h);
      rope_q = g.rope(q, pos, n_head, hd, hd, kRopeNormal, 10000.0f);
      rope_k = g.rope(k, pos, n_head_kv, hd, hd, kRopeNormal, 10000.0f);
      const size_t pool_bytes = size_t(rows) * n_seq * kv_w * 2;
      Tensor* kp = g.kv_pool(DType::F16, kv_w, rows, n_seq, fake(pool_bytes), "k_pool");
      Tensor* vp = g.kv_pool(DType::F16, kv_w, rows, n_seq, fake(pool_bytes), "v_pool");
      store_k = g.kv_store_seqs(kp, rope_k, sl);
      store_v = g.kv_store_seqs(vp, v, sl);
      Tensor* a = g.attention_seqs(rope_q, kp, vp, sl, n_head, n_head_kv, hd, 0.088f);
      wo = g.mul_mat(weight(DType::Q4_0, n_embd, n_embd, "wo"), a);
      x = g.add(x, wo);
    }
    g.set_output(g.mul_mat(weight(DType::Q8_0, n_embd, 32000, "output"), x));
    plan(g);
  }

  std::vector<cuda::KernelLaunch> launches() const { return LayerGraph::launches_of_graph(g); }
};

// Quantized matrices are read in the layout model weights are uploaded in, and before the wait
// for the kernel before: a product of a quantized KV cache (GGUF's blocks, written by the step)
// is refused by name; the same product of a weight plans.
TEST(CudaLaunchPlan, RefusesProductsOfQuantizedMatricesThatAreNotWeights) {
  for (bool cached : {true, false}) {
    Graph g;
    FakeWeights fw;
    std::vector<int32_t> tokens(17, 1);
    Tensor* tok = g.input_i32(17, tokens.data(), "tokens");
    Tensor* x = g.get_rows(fw.weight(g, DType::F32, 256, 100, "tok_embd"), tok);
    Tensor* m =
        cached ? g.kv_cache(DType::Q8_0, 256, 64, fw.alloc(row_size(DType::Q8_0, 256) * 64), "k")
               : fw.weight(g, DType::Q8_0, 256, 64, "w");
    g.set_output(g.mul_mat(m, x));
    plan(g);
    if (cached) {
      try {
        cuda::validate_graph(g);
        ADD_FAILURE() << "a product of a Q8_0 KV cache was accepted";
      } catch (const ArgumentError& e) {
        EXPECT_NE(std::string(e.what()).find("must be a model weight"), std::string::npos)
            << e.what();
      }
    } else {
      EXPECT_NO_THROW(cuda::validate_graph(g));
    }
  }
}

// Decode batches of rows of 4,096 take the warp-pipelined products from 4 columns on, whose
// column tiles the producers write: the norm for q, k and v, the attention over the pools (the
// decode kernels, at any count) for the output projection; each product is one launch. Where a
// mat-vec reads the norm too (v in Q5_0, up to 8 columns), the norm writes the mat-vec's plain
// 8-bit form and the first product quantizes the tiles itself.
TEST(CudaLaunchPlan, DecodeBatchProducersWriteTheProductsColumnTiles) {
  for (int n_tokens : {4, 16}) {
    SeqsLayer lg(n_tokens, 8);
    const auto rec = lg.launches();
    // q, k and v in one launch at q's node.
    EXPECT_EQ(launches_of(rec, lg.wq), 1) << n_tokens;
    EXPECT_EQ(launches_of(rec, lg.wv), 0) << n_tokens;
    EXPECT_EQ(launches_of(rec, lg.wo), 1) << n_tokens;
  }
  // v in another format: q and k share a launch after the tiles' quantization; v goes alone.
  SeqsLayer mixed(4, 8, DType::Q5_0);
  const auto rec = mixed.launches();
  EXPECT_EQ(launches_of(rec, mixed.wq), 2);
  EXPECT_EQ(launches_of(rec, mixed.wv), 1);
  EXPECT_EQ(launches_of(rec, mixed.wo), 1);
}

// Decode batches on the half kernel (17 to 64 columns): q, k and v go out as one launch, whose
// grid covers all three products' row blocks; GGRAPH_CUDA_MMQ_GROUP=0 would launch each alone.
TEST(CudaLaunchPlan, DecodeBatchProductsOfOneActivationShareALaunch) {
  for (int n_tokens : {32, 64}) {
    SeqsLayer lg(n_tokens, 8);
    const auto rec = lg.launches();
    EXPECT_EQ(launches_of(rec, lg.wq), 1) << n_tokens;
    EXPECT_EQ(launches_of(rec, lg.wv), 0) << n_tokens;
    EXPECT_EQ(launches_of(rec, lg.wo), 1) << n_tokens;
  }
}

// Decode batches: the ropes of q and k and both stores into the pools go out in one launch (a
// token a block, which reads its rows first), k's rope in q's product's place; where k is
// narrower than q (GQA), that place would hold other tokens' rows, and they do not pair. (Batches
// of 4 to 16 on the warp-pipelined kernel take them into the products' epilogue instead: the
// next test; here that is off.)
TEST(CudaLaunchPlan, DecodeBatchRotatesAndStoresInOneLaunch) {
  RopeEpilogueOff off;
  for (int n_tokens : {1, 2, 16, 64}) {
    SeqsLayer lg(n_tokens, 32);
    const auto rec = lg.launches();
    // The planner's choice this relies on: k's rope where q's product was.
    if (n_tokens > 1) {
      EXPECT_EQ(lg.rope_k->offset, lg.rope_q->src[0]->offset) << n_tokens;
    }
    EXPECT_EQ(launches_of(rec, lg.rope_q), 1) << n_tokens;
    EXPECT_EQ(launches_of(rec, lg.rope_k), 0) << n_tokens;
    EXPECT_EQ(launches_of(rec, lg.store_k), 0) << n_tokens;
    EXPECT_EQ(launches_of(rec, lg.store_v), 0) << n_tokens;
    // A token a column of blocks; of several tokens, each token's 32 heads (of q, k and V
    // alike) shared by a few blocks, about 128 in all.
    for (const cuda::KernelLaunch& k : rec) {
      if (k.node == lg.rope_q->index) {
        EXPECT_EQ(int(k.grid.x), n_tokens);
        if (n_tokens == 1) {
          EXPECT_EQ(k.grid.y, 1u);
        } else {
          EXPECT_GE(k.grid.y, 2u) << n_tokens;
          EXPECT_LE(int(k.grid.y) * n_tokens, 128) << n_tokens;
          EXPECT_EQ(32 % k.grid.y, 0u) << n_tokens;
        }
      }
    }
  }
  // GQA: k's narrower rows over q's product would be other tokens' rows, but only k's store
  // reads them: k is rotated into its pool alone, in the same launch.
  for (int n_tokens : {2, 16, 64}) {
    SeqsLayer gqa(n_tokens, 8);
    const auto rec = gqa.launches();
    EXPECT_EQ(launches_of(rec, gqa.rope_q), 1) << n_tokens;
    EXPECT_EQ(launches_of(rec, gqa.rope_k), 0) << n_tokens;
    EXPECT_EQ(launches_of(rec, gqa.store_k), 0) << n_tokens;
    EXPECT_EQ(launches_of(rec, gqa.store_v), 0) << n_tokens;
    for (const cuda::KernelLaunch& k : rec) {
      if (k.node == gqa.rope_q->index) {
        EXPECT_EQ(k.grid.y, 1u) << n_tokens;
      }
    }
  }
}

// Decode batches of 4 to 16 tokens on the warp-pipelined kernel: q, k and v in one launch that
// rotates q and k and stores K and V into the pools itself (MatMulQRope); no ropes' or stores'
// launch, with or without GQA. Past 16 (the half kernel) the ropes' launch stays.
TEST(CudaLaunchPlan, DecodeBatchOnTheWarpKernelRotatesAndStoresInTheProductsEpilogue) {
  WarpRopeEpilogueOn on;
  for (int n_kv : {32, 8}) {
    for (int n_tokens : {4, 8, 16, 32}) {
      SeqsLayer lg(n_tokens, n_kv);
      const auto rec = lg.launches();
      const int ropes = n_tokens <= 16 ? 0 : 1;
      EXPECT_EQ(launches_of(rec, lg.wq), 1) << n_tokens << " tokens, " << n_kv << " KV heads";
      EXPECT_EQ(launches_of(rec, lg.rope_q), ropes) << n_tokens << " tokens, " << n_kv;
      EXPECT_EQ(launches_of(rec, lg.rope_k), 0) << n_tokens << " tokens, " << n_kv;
      EXPECT_EQ(launches_of(rec, lg.store_k), 0) << n_tokens << " tokens, " << n_kv;
      EXPECT_EQ(launches_of(rec, lg.store_v), 0) << n_tokens << " tokens, " << n_kv;
    }
  }
}

// Decode batches and prompts: the residual add launches the norm after it too, whose result
// takes the place of the product the add consumed (the planner's choice), since a block a
// column reads its column before it writes.
TEST(CudaLaunchPlan, ResidualAddLaunchesTheNormOfSeveralColumns) {
  for (int n_tokens : {16, 64}) {
    LayerGraph lg(n_tokens, 0);
    const auto rec = lg.launches();
    const Tensor* norm = lg.attn_norm_mul->src[0];
    const Tensor* residual_add = norm->src[0];
    ASSERT_EQ(residual_add->op, Op::Add);
    EXPECT_EQ(launches_of(rec, residual_add), 1) << n_tokens;
    EXPECT_EQ(launches_of(rec, norm), 0) << n_tokens;
    EXPECT_EQ(launches_of(rec, lg.attn_norm_mul), 0) << n_tokens;
  }
}

TEST(CudaLaunchPlan, HeadNormsRideWithTheRopesOfOneToken) {
  {
    // Decode: the q and k head norms go into the ropes' launch (with the K and V stores).
    LayerGraph lg(1, 20, false, /*head_norms=*/true);
    const auto rec = lg.launches();
    EXPECT_EQ(launches_of(rec, lg.q_norm), 0);
    EXPECT_EQ(launches_of(rec, lg.k_norm), 0);
    for (const Tensor* t : lg.g.nodes()) {
      if (t->op == Op::Mul && (t->src[0] == lg.q_norm || t->src[0] == lg.k_norm)) {
        EXPECT_EQ(launches_of(rec, t), 0);
      }
    }
    EXPECT_EQ(launches_of(rec, lg.rope_q), 1);
    EXPECT_EQ(launches_of(rec, lg.rope_k), 0);
    EXPECT_EQ(launches_of(rec, lg.store_k), 0);
  }
  {
    // A prompt keeps them apart: one launch each (the norm with its weight).
    LayerGraph lg(16, 0, false, /*head_norms=*/true);
    const auto rec = lg.launches();
    EXPECT_EQ(launches_of(rec, lg.q_norm), 1);
    EXPECT_EQ(launches_of(rec, lg.k_norm), 1);
  }
}

TEST(CudaLaunchPlan, ProductsOfTwoFormatsShareALaunchInDecode) {
  {
    // q and k in Q5_0, v in Q8_0 (a K-quant mix's fallbacks): one launch at q.
    expect_qkv_launches(LayerGraph(1, 20, true, false, DType::Q5_0, DType::Q8_0), 1, 0, 0);
  }
  {
    // A pair without a mixed kernel: q and k together, v apart.
    expect_qkv_launches(LayerGraph(1, 20, true, false, DType::Q4_1, DType::Q8_0), 1, 0, 1);
  }
}

// The values a KV record launch writes: its by-value slots.
std::vector<int32_t> record_values(const cuda::KernelLaunch& k) {
  cuda::KvSlots v;
  std::memcpy(&v, k.args + k.arg_offset[0], sizeof v);
  return std::vector<int32_t>(v.v, v.v + cuda::kMaxKvSlots);
}

// Whether an argument of the launch is p, or a struct argument holds it.
bool holds_pointer(const cuda::KernelLaunch& k, const void* p) {
  for (int a = 0; a < k.n_args; ++a)
    for (size_t at = 0; at + sizeof p <= k.arg_size[a]; at += sizeof p)
      if (std::memcmp(k.args + k.arg_offset[a] + at, &p, sizeof p) == 0) return true;
  return false;
}

// One token's q, k and v products (one format), grouped in one launch, take their ropes and
// K/V stores into that launch's epilogue, in the model builder's order (the products first,
// then a rope factors leaf or none, the ropes, the stores); otherwise the ropes' launch stays.
TEST(CudaLaunchPlan, RopeEpilogueTakesTheRopesAndStoresOfOneToken) {
  auto normal = [](bool factors, DType v_type = DType::Q4_1, int n_tokens = 1,
                   DType qk_type = DType::Q4_1) {
    return LayerGraph(n_tokens, 20, true, false, qk_type, v_type, kRopeNormal, factors);
  };
  // Launches of the products (q's node launches them together) and of the ropes and stores.
  auto count = [](const LayerGraph& lg) {
    const auto rec = lg.launches();
    return std::make_pair(
        launches_of(rec, lg.wq) + launches_of(rec, lg.wk) + launches_of(rec, lg.wv),
        launches_of(rec, lg.rope_q) + launches_of(rec, lg.rope_k) + launches_of(rec, lg.store_k) +
            launches_of(rec, lg.store_v));
  };
  for (bool factors : {false, true}) {
    EXPECT_EQ(count(normal(factors)), std::make_pair(1, 0)) << "factors " << factors;
  }
  // v in the other format of a pair that one launch takes (a K-quant mix's fallbacks).
  EXPECT_EQ(count(normal(false, DType::Q8_0, 1, DType::Q5_0)), std::make_pair(1, 0));
  // Float weights, as a model's layer plans them.
  EXPECT_EQ(count(normal(false, DType::F16, 1, DType::F16)), std::make_pair(1, 0));
  EXPECT_EQ(count(normal(true, DType::BF16, 1, DType::BF16)), std::make_pair(1, 0));
  // Several tokens too where the warp-pipelined kernel takes their products (4 to 16 tokens,
  // MatMulQRope), not on the kernels past it, nor with that epilogue switched off.
  {
    WarpRopeEpilogueOn on;
    EXPECT_EQ(count(normal(false, DType::Q4_1, 4)), std::make_pair(1, 0));
    EXPECT_GE(count(normal(false, DType::Q4_1, 32)).second, 1);
    cuda::set_warp_rope_epilogue(false);
    EXPECT_GE(count(normal(false, DType::Q4_1, 4)).second, 1);
  }
  // Not where the ropes are NeoX's (pairs of rows half a head apart) or v is in a format no
  // launch pairs with q's (the products go out in two launches); nor when it is off.
  EXPECT_EQ(count(LayerGraph(1, 20, true)), std::make_pair(1, 1));
  EXPECT_EQ(count(normal(false, DType::Q8_0)).second, 1);
  RopeEpilogueOff off;
  EXPECT_EQ(count(normal(true)), std::make_pair(1, 1));
}

// Rope launches and the q/k/v epilogues read the backend's angle table of their configuration
// (base, scale, factors, rotated dimensions): one token's epilogue, a NeoX rope's launch, a
// prompt chunk's warp-pipelined epilogue; none with another configuration's table only, nor with
// the tables switched off.
TEST(CudaLaunchPlan, RopesReadTheAngleTableOfTheirConfiguration) {
  WarpRopeEpilogueOn warp;
  const Switched<cuda::set_rope_table> tables_on(true);
  const auto* fake = reinterpret_cast<float2*>(uintptr_t(0x7600000000));
  auto table = [&](float base) {
    cuda::RopeTable t;
    t.freq_base = base;
    t.n_dims = 64;
    t.rows = 1024;
    t.data = const_cast<float2*>(fake);
    return t;
  };
  // Launches whose arguments hold the table's address, at the nodes of one layer's products and
  // ropes.
  auto reading = [&](const LayerGraph& lg, const std::vector<cuda::RopeTable>& tables) {
    int n = 0;
    for (const cuda::KernelLaunch& k : LayerGraph::launches_of_graph(lg.g, tables)) {
      for (int at = 0; at + 8 <= k.arg_bytes; at += 8)
        if (std::memcmp(k.args + at, &fake, 8) == 0) {
          ++n;
          break;
        }
    }
    return n;
  };
  struct Case {
    const char* what;
    LayerGraph lg;
  };
  Case cases[] = {
      {"one token, normal ropes (the q/k/v epilogue)",
       LayerGraph(1, 20, true, false, DType::Q4_1, DType::Q4_1, kRopeNormal)},
      {"one token, NeoX ropes (their launch)", LayerGraph(1, 20, true)},
      {"four tokens, normal ropes (the warp-pipelined epilogue)",
       LayerGraph(4, 20, true, false, DType::Q4_1, DType::Q4_1, kRopeNormal)},
  };
  for (const Case& c : cases) {
    // Two layers, each with its rope launch or epilogue.
    EXPECT_EQ(reading(c.lg, {table(10000.0f)}), 2) << c.what;
    EXPECT_EQ(reading(c.lg, {table(500000.0f)}), 0) << c.what;
    const Switched<cuda::set_rope_table> off(false);
    EXPECT_EQ(reading(c.lg, {table(10000.0f)}), 0) << c.what << " (tables off)";
  }
}

// One token's gate and up products (one quantized format) take the glu after them into their
// launch's epilogue (MatVecGlu) where the rows kernel takes them (rows of up to 64 pieces): not
// for longer rows, nor for two tokens, nor where something else reads gate, nor when it is off.
TEST(CudaLaunchPlan, GluEpilogueTakesTheGluOfOneToken) {
  auto glu_launches = [](DType type, int n_embd, int n_ff, int n_tokens = 1,
                         bool gate_read = false) {
    Graph g;
    FakeWeights fw;
    std::vector<int32_t> tokens(n_tokens, 1);
    Tensor* x = g.get_rows(fw.weight(g, DType::F32, n_embd, 16, "embd"),
                           g.input_i32(n_tokens, tokens.data(), "tokens"));
    Tensor* gate = g.mul_mat(fw.weight(g, type, n_embd, n_ff, "gate"), x);
    Tensor* up = g.mul_mat(fw.weight(g, type, n_embd, n_ff, "up"), x);
    Tensor* glu = g.swiglu(gate, up);
    Tensor* down = g.mul_mat(fw.weight(g, type, n_ff, n_embd, "down"), glu);
    g.set_output(gate_read ? g.add(down, g.mul_mat(fw.weight(g, type, n_ff, n_embd, "w"), gate))
                           : down);
    plan(g);
    return launches_of(LayerGraph::launches_of_graph(g), glu);
  };
  EXPECT_EQ(glu_launches(DType::Q4_1, 576, 1536), 0);
  EXPECT_EQ(glu_launches(DType::Q4_0, 2048, 8192), 0);
  EXPECT_EQ(glu_launches(DType::Q8_0, 1024, 4096), 0);
  EXPECT_EQ(glu_launches(DType::Q4_0, 4096, 11008), 1);
  EXPECT_EQ(glu_launches(DType::Q8_0, 2048, 8192), 1);
  EXPECT_EQ(glu_launches(DType::Q4_1, 576, 1536, 2), 1);
  EXPECT_EQ(glu_launches(DType::Q4_1, 576, 1536, 1, true), 1);
  {
    const Switched<cuda::set_glu_epilogue> off(false);
    EXPECT_EQ(glu_launches(DType::Q4_1, 576, 1536), 1);
  }
  // A glu whose products read an earlier fused glu's result keeps its launch: its 8-bit input
  // lies in the region the epilogue writes. The fused launch reads apart from where it writes.
  Graph g;
  FakeWeights fw;
  std::vector<int32_t> tokens(1, 1);
  Tensor* x = g.get_rows(fw.weight(g, DType::F32, 576, 16, "embd"),
                         g.input_i32(1, tokens.data(), "tokens"));
  auto ffn = [&](Tensor* in, int64_t k, int64_t n) {
    Tensor* gate = g.mul_mat(fw.weight(g, DType::Q4_1, k, n, "gate"), in);
    Tensor* up = g.mul_mat(fw.weight(g, DType::Q4_1, k, n, "up"), in);
    return g.swiglu(gate, up);
  };
  Tensor* glu1 = ffn(x, 576, 1536);
  Tensor* glu2 = ffn(glu1, 1536, 576);
  g.set_output(g.mul_mat(fw.weight(g, DType::Q4_1, 576, 576, "down"), glu2));
  plan(g);
  const auto rec = LayerGraph::launches_of_graph(g);
  EXPECT_EQ(launches_of(rec, glu1), 0);
  EXPECT_EQ(launches_of(rec, glu2), 1);
  int fused = 0;
  for (const auto& k : rec) {
    if (k.func != reinterpret_cast<const void*>(rec[0].func) && k.n_args == 9 &&
        k.arg_size[8] == sizeof(cuda::MatVecGlu)) {
      uint64_t in = 0;
      cuda::MatVecGlu glu;
      std::memcpy(&in, k.args + k.arg_offset[4], sizeof in);
      std::memcpy(&glu, k.args + k.arg_offset[8], sizeof glu);
      EXPECT_NE(in, reinterpret_cast<uintptr_t>(glu.qs));
      ++fused;
    }
  }
  EXPECT_EQ(fused, 1);
}

// The rope epilogue against the ropes' launch, on the GPU: the attention over the caches it
// writes and the caches' bytes equal, bit for bit, those of the products, ropes and stores
// launched apart. Every kernel shape it takes (rows held in registers at one and two pieces a
// lane; blocks of rows with two and four warps a row, and one; float weights, two rows a warp),
// partial rotation, rope factors and a ring (its position past the angle table's rows: worked
// out); F16 and Q8_0 caches (the groups of 32 values quantized by the warp whose pair came last).
TEST_F(CudaOps, RopeEpilogueOfTheQkvProductsEqualsTheRopesLaunch) {
  struct Case {
    DType type;
    int n_embd, n_head, n_head_kv, hd, n_dims;
    bool factors;
    int ring;                   // > 0: a ring of this many rows
    DType v_type = DType::F32;  // v's format where it differs (a K-quant mix)
    DType kv = DType::F16;      // the caches' type
  };
  const Case cases[] = {
      {DType::Q4_1, 576, 9, 3, 64, 64, false, 0},
      {DType::Q4_0, 2048, 32, 8, 64, 64, true, 0},
      {DType::Q4_0, 4096, 32, 8, 128, 128, false, 0},
      {DType::Q8_0, 4096, 32, 32, 128, 96, false, 0},
      {DType::Q6_K, 4096, 32, 8, 128, 128, true, 0},
      {DType::Q4_K, 1536, 12, 2, 128, 128, false, 70},
      // Two formats in one launch: blocks of rows, and rows in registers at one and two
      // pieces a lane.
      {DType::Q4_K, 4096, 32, 8, 128, 128, true, 0, DType::Q6_K},
      {DType::Q5_K, 1536, 12, 2, 128, 128, false, 0, DType::Q6_K},
      {DType::Q5_0, 576, 9, 3, 64, 64, false, 0, DType::Q8_0},
      // Q8_0 caches: each kernel shape again, and a ring.
      {DType::Q4_1, 576, 9, 3, 64, 64, false, 0, DType::F32, DType::Q8_0},
      {DType::Q4_0, 4096, 32, 32, 128, 128, false, 0, DType::F32, DType::Q8_0},
      {DType::Q8_0, 4096, 32, 32, 128, 96, false, 0, DType::F32, DType::Q8_0},
      {DType::Q6_K, 4096, 32, 8, 128, 128, true, 0, DType::F32, DType::Q8_0},
      {DType::Q4_K, 1536, 12, 2, 128, 128, false, 70, DType::F32, DType::Q8_0},
      {DType::Q4_K, 4096, 32, 8, 128, 128, true, 0, DType::Q6_K, DType::Q8_0},
      {DType::Q5_0, 576, 9, 3, 64, 64, false, 0, DType::Q8_0, DType::Q8_0},
      // Float weights (two rows a warp), F16 and Q8_0 caches.
      {DType::F16, 2048, 32, 8, 64, 64, true, 0},
      {DType::BF16, 576, 9, 3, 64, 64, false, 70},
      {DType::F32, 1536, 12, 2, 128, 96, false, 0},
      {DType::F16, 576, 9, 3, 64, 64, false, 0, DType::F32, DType::Q8_0},
      {DType::BF16, 4096, 32, 32, 128, 128, false, 70, DType::F32, DType::Q8_0},
  };
  // Each case with the rows kernels' angles taken after their sums and while their loads are on
  // their way (MatVecRope::early_angle), each from the backend's angle table and worked out:
  // the same inputs, and every one of the four the same bits (the table's angles are the
  // worked-out ones).
  std::vector<float> first_out;
  std::vector<uint8_t> first_k, first_v;
  for (int run = 0; run < 4 * int(std::size(cases)); ++run) {
    const Case& c = cases[run / 4];
    std::mt19937 rng(41 + run / 4);
    const Switched<cuda::set_rope_angle_early> early(run % 2 == 1);
    const Switched<cuda::set_rope_table> table(run % 4 < 2);
    const int kv_w = c.n_head_kv * c.hd, n_past = c.ring > 0 ? 1000 : 37;
    const int rows = c.ring > 0 ? c.ring : n_past + 8, window = c.ring > 0 ? 64 : 0;
    const std::string what = std::string(type_name(c.type)) + "/" + type_name(c.v_type) +
                             " n_embd " + std::to_string(c.n_embd) + " hd " + std::to_string(c.hd) +
                             " cache " + type_name(c.kv) + (run % 2 ? " (angles early)" : "") +
                             (run % 4 < 2 ? " (angle table)" : "");
    auto bq = random_blocks(c.type, c.n_embd, c.n_embd, rng);
    auto bk = random_blocks(c.type, c.n_embd, kv_w, rng);
    const DType v_type = c.v_type == DType::F32 ? c.type : c.v_type;
    auto bv = random_blocks(v_type, c.n_embd, kv_w, rng);
    auto x = randn(size_t(c.n_embd), rng);
    auto factors = randn(size_t(c.n_dims / 2), rng, 0.5f);
    for (auto& f : factors) f = 1.0f + std::fabs(f);
    std::vector<int32_t> pos = {n_past}, ids;
    // The caches' earlier rows: random values in the cache's type.
    const size_t row_bytes = row_size(c.kv, kv_w);
    std::vector<uint8_t> k0(row_bytes * rows), v0(k0.size());
    for (auto* cache : {&k0, &v0}) {
      const auto vals = randn(size_t(kv_w) * rows, rng);
      for (int r = 0; r < rows; ++r)
        quantize_row(c.kv, vals.data() + size_t(r) * kv_w, cache->data() + r * row_bytes, kv_w);
    }
    void *k_mem = nullptr, *v_mem = nullptr;
    Tensor* rope_q = nullptr;
    Build build = [&](Graph& g, Backend& be) {
      Tensor* kc = kv_cache_with(g, be, c.kv, k0, kv_w, rows, "k", c.ring > 0);
      Tensor* vc = kv_cache_with(g, be, c.kv, v0, kv_w, rows, "v", c.ring > 0);
      k_mem = kc->data;
      v_mem = vc->data;
      Tensor* xt = activations(g, be, x, c.n_embd, 1, ids);
      Tensor* p = g.input_i32(1, pos.data(), "pos");
      Tensor* q = g.mul_mat(upload(g, be, c.type, c.n_embd, c.n_embd, bq.data(), "wq"), xt);
      Tensor* k = g.mul_mat(upload(g, be, c.type, c.n_embd, kv_w, bk.data(), "wk"), xt);
      Tensor* v = g.mul_mat(upload(g, be, v_type, c.n_embd, kv_w, bv.data(), "wv"), xt);
      Tensor* f = c.factors
                      ? upload(g, be, DType::F32, c.n_dims / 2, 1, factors.data(), "rope_freqs")
                      : nullptr;
      rope_q = q = g.rope(q, p, c.n_head, c.hd, c.n_dims, kRopeNormal, 10000.0f, f);
      k = g.rope(k, p, c.n_head_kv, c.hd, c.n_dims, kRopeNormal, 10000.0f, f);
      g.kv_store(kc, k, n_past);
      g.kv_store(vc, v, n_past);
      return g.attention(q, kc, vc, c.n_head, c.n_head_kv, c.hd, 1.0f / std::sqrt(float(c.hd)),
                         n_past + 1, n_past, window);
    };
    const EpilogueRuns runs =
        with_and_without_rope_epilogue(*cuda_, build, k_mem, v_mem, k0.size());
    const auto &fused = runs.out, &apart = runs.out_apart;
    const auto &kf = runs.k, &vf = runs.v, &ku = runs.k_apart, &vu = runs.v_apart;
    ASSERT_EQ(fused.size(), apart.size()) << what;
    EXPECT_EQ(std::memcmp(fused.data(), apart.data(), fused.size() * sizeof(float)), 0) << what;
    EXPECT_TRUE(kf == ku) << "K cache: " << what;
    EXPECT_TRUE(vf == vu) << "V cache: " << what;
    EXPECT_FALSE(kf == k0) << "the K store ran: " << what;
    EXPECT_FALSE(vf == v0) << "the V store ran: " << what;
    if (run % 4 == 0) {
      // Register-resident launches of fewer warps than row pairs (13: not whole blocks), which
      // walk their rows in several passes: each row's epilogue still runs once, so the same
      // bits (a Q8_0 group's ticket counts its pairs).
      struct WarpCap {
        int was = cuda::set_rows_kernel_warp_cap(13);
        ~WarpCap() { cuda::set_rows_kernel_warp_cap(was); }
      };
      const EpilogueRuns capped = [&] {
        const WarpCap cap;
        return with_and_without_rope_epilogue(*cuda_, build, k_mem, v_mem, k0.size());
      }();
      ASSERT_EQ(capped.out.size(), fused.size()) << what;
      EXPECT_EQ(std::memcmp(capped.out.data(), fused.data(), fused.size() * sizeof(float)), 0)
          << "13 warps: " << what;
      EXPECT_TRUE(capped.k == kf) << "K cache, 13 warps: " << what;
      EXPECT_TRUE(capped.v == vf) << "V cache, 13 warps: " << what;
    }
    if (run % 4 == 0) {
      first_out = fused;
      first_k = kf;
      first_v = vf;
    } else {
      ASSERT_EQ(fused.size(), first_out.size()) << what;
      EXPECT_EQ(std::memcmp(fused.data(), first_out.data(), fused.size() * sizeof(float)), 0)
          << "against the case's first run: " << what;
      EXPECT_TRUE(kf == first_k) << "K cache against the case's first run: " << what;
      EXPECT_TRUE(vf == first_v) << "V cache against the case's first run: " << what;
    }
    // Against the CPU, so that both paths being wrong alike would show: the K and V rows this
    // token stored. (Not the attention's output: these weights give scores in the tens of
    // thousands, whose argmax the two devices' rounding can flip.)
    run_on(*cpu_, build);
    std::vector<uint8_t> kc(k0.size()), vc(v0.size());
    cpu_->kv_to_host(kc.data(), k_mem, kc.size());
    cpu_->kv_to_host(vc.data(), v_mem, vc.size());
    auto stored_row = [&](const std::vector<uint8_t>& cache, const std::vector<uint8_t>& before,
                          const std::vector<uint8_t>& of) {
      std::vector<float> row;
      for (int r = 0; r < rows; ++r) {
        if (std::memcmp(cache.data() + r * row_bytes, before.data() + r * row_bytes, row_bytes)) {
          row.resize(row.size() + size_t(kv_w));
          dequantize_row(c.kv, of.data() + r * row_bytes, row.data() + row.size() - kv_w, kv_w);
        }
      }
      return row;
    };
    const auto k_cpu = stored_row(kc, k0, kc), v_cpu = stored_row(vc, v0, vc);
    ASSERT_EQ(k_cpu.size(), size_t(kv_w)) << "one K row stored on the CPU: " << what;
    ASSERT_EQ(v_cpu.size(), size_t(kv_w)) << "one V row stored on the CPU: " << what;
    EXPECT_LT(rel_err(stored_row(kc, k0, kf), k_cpu), 3e-2) << "K row: " << what;
    EXPECT_LT(rel_err(stored_row(vc, v0, vf), v_cpu), 3e-2) << "V row: " << what;
    // And the epilogue did take the ropes (the graph as the runs planned it).
    Graph g;
    g.set_output(build(g, *cuda_));
    plan(g);
    EXPECT_EQ(launches_of(LayerGraph::launches_of_graph(g), rope_q), 0) << what;
  }
}

// The norm folded into the products after it (NormFold) against the norm's own launch: two
// decode layers of one token and the output product (each norm with its weight; the residual
// adds; q, k and v with their ropes and stores; gate and up; down), the logits and both caches
// equal bit for bit with the fold on and off. Formats of one piece a 32 at rows of 18 to 32
// pieces fold every norm; a Q8_0 v (two pieces a 32) keeps the attention norms' launch, and so
// does a row of 48 pieces.
TEST_F(CudaOps, NormFoldedIntoItsProductsEqualsTheNormsLaunch) {
  const Switched<cuda::set_norm_fold> on(true);
  std::mt19937 rng(47);
  struct Case {
    DType type, v_type;
    int n_embd, n_head, n_head_kv, hd, n_ff;
    int folds;  // norms expected folded: 5 (two layers' two and the output's), 3, or 0
  };
  const Case cases[] = {
      {DType::Q4_1, DType::Q4_1, 576, 9, 3, 64, 1536, 5},
      {DType::Q4_K, DType::Q6_K, 768, 12, 4, 64, 2048, 5},
      {DType::IQ4_NL, DType::IQ4_NL, 1024, 8, 2, 128, 2048, 5},
      {DType::Q5_0, DType::Q8_0, 576, 9, 3, 64, 1536, 3},
      {DType::Q4_0, DType::Q4_0, 1536, 12, 2, 128, 4096, 0},
  };
  for (const Case& c : cases) {
    const int kv_w = c.n_head_kv * c.hd, n_past = 29, rows = 64, n_vocab = 3000;
    const std::string what = std::string(type_name(c.type)) + "/" + type_name(c.v_type) +
                             " n_embd " + std::to_string(c.n_embd);
    struct Layer {
      std::vector<uint8_t> q, k, v, o, gate, up, down;
      std::vector<float> attn_norm, ffn_norm;
    };
    auto norm_weight = [&]() {
      auto w = randn(size_t(c.n_embd), rng, 0.2f);
      for (auto& x : w) x += 1.0f;
      return w;
    };
    Layer layers[2];
    for (Layer& L : layers) {
      L.q = random_blocks(c.type, c.n_embd, c.n_embd, rng);
      L.k = random_blocks(c.type, c.n_embd, kv_w, rng);
      L.v = random_blocks(c.v_type, c.n_embd, kv_w, rng);
      L.o = random_blocks(c.type, c.n_embd, c.n_embd, rng);
      L.gate = random_blocks(c.type, c.n_embd, c.n_ff, rng);
      L.up = random_blocks(c.type, c.n_embd, c.n_ff, rng);
      L.down = random_blocks(c.type, c.n_ff, c.n_embd, rng);
      L.attn_norm = norm_weight();
      L.ffn_norm = norm_weight();
    }
    const auto out_w = random_blocks(c.type, c.n_embd, n_vocab, rng);
    const auto out_norm = norm_weight();
    auto x = randn(size_t(c.n_embd), rng);
    std::vector<int32_t> pos = {n_past}, ids;
    std::vector<uint8_t> k0(size_t(kv_w) * rows * 2), v0(k0.size());
    const auto k16 = randn_f16(size_t(kv_w) * rows, rng), v16 = randn_f16(k0.size() / 2, rng);
    std::memcpy(k0.data(), k16.data(), k0.size());
    std::memcpy(v0.data(), v16.data(), v0.size());
    void* k_mem[2] = {};
    void* v_mem[2] = {};
    std::vector<const Tensor*> norms;
    Build build = [&](Graph& g, Backend& be) {
      norms.clear();
      Tensor* p = g.input_i32(1, pos.data(), "pos");
      Tensor* h = activations(g, be, x, c.n_embd, 1, ids);
      auto norm = [&](Tensor* in, const std::vector<float>& w, const char* name) {
        Tensor* r = g.rms_norm(in, 1e-5f);
        norms.push_back(r);
        return g.mul(r, upload(g, be, DType::F32, c.n_embd, 1, w.data(), name));
      };
      auto mat = [&](DType t, int64_t k, int64_t n, const std::vector<uint8_t>& b, Tensor* a) {
        return g.mul_mat(upload(g, be, t, k, n, b.data(), "w"), a);
      };
      for (int il = 0; il < 2; ++il) {
        const Layer& L = layers[il];
        Tensor* kc = kv_cache_with(g, be, DType::F16, k0, kv_w, rows, "k");
        Tensor* vc = kv_cache_with(g, be, DType::F16, v0, kv_w, rows, "v");
        k_mem[il] = kc->data;
        v_mem[il] = vc->data;
        Tensor* a = norm(h, L.attn_norm, "attn_norm");
        Tensor* q = mat(c.type, c.n_embd, c.n_embd, L.q, a);
        Tensor* k = mat(c.type, c.n_embd, kv_w, L.k, a);
        Tensor* v = mat(c.v_type, c.n_embd, kv_w, L.v, a);
        q = g.rope(q, p, c.n_head, c.hd, c.hd, kRopeNormal, 10000.0f);
        k = g.rope(k, p, c.n_head_kv, c.hd, c.hd, kRopeNormal, 10000.0f);
        g.kv_store(kc, k, n_past);
        g.kv_store(vc, v, n_past);
        Tensor* att = g.attention(q, kc, vc, c.n_head, c.n_head_kv, c.hd,
                                  1.0f / std::sqrt(float(c.hd)), n_past + 1, n_past);
        h = g.add(h, mat(c.type, c.n_embd, c.n_embd, L.o, att));
        Tensor* f = norm(h, L.ffn_norm, "ffn_norm");
        Tensor* gate = mat(c.type, c.n_embd, c.n_ff, L.gate, f);
        Tensor* up = mat(c.type, c.n_embd, c.n_ff, L.up, f);
        h = g.add(h, mat(c.type, c.n_ff, c.n_embd, L.down, g.swiglu(gate, up)));
      }
      return mat(c.type, c.n_embd, n_vocab, out_w, norm(h, out_norm, "output_norm"));
    };
    auto run = [&](std::vector<uint8_t>(&caches)[4]) {
      auto out = run_on(*cuda_, build);
      for (int i = 0; i < 4; ++i) {
        caches[i].resize(k0.size());
        cuda_->kv_to_host(caches[i].data(), i < 2 ? k_mem[i] : v_mem[i - 2], k0.size());
      }
      return out;
    };
    std::vector<uint8_t> folded_kv[4], apart_kv[4];
    const auto folded = run(folded_kv);
    std::vector<float> apart;
    {
      const NormFoldOff off;
      apart = run(apart_kv);
    }
    ASSERT_EQ(folded.size(), apart.size()) << what;
    EXPECT_EQ(std::memcmp(folded.data(), apart.data(), folded.size() * sizeof(float)), 0) << what;
    for (int i = 0; i < 4; ++i) EXPECT_TRUE(folded_kv[i] == apart_kv[i]) << "cache " << i << what;
    EXPECT_FALSE(folded_kv[0] == k0) << "the K store ran: " << what;
    // Against the CPU, so that both paths being wrong alike would show.
    EXPECT_LT(rel_err(folded, run_on(*cpu_, build)), 5e-2) << what;
    // The norms the products took in (none launched), as the runs planned them.
    Graph g;
    g.set_output(build(g, *cuda_));
    plan(g, cuda_->folds_norms());
    const auto rec = LayerGraph::launches_of_graph(g);
    // (A norm with the residual add before it launches at the add's node.)
    int folded_norms = 0;
    for (const Tensor* r : norms) {
      const Tensor* in = r->src[0];
      folded_norms +=
          launches_of(rec, r) == 0 && (in->op != Op::Add || launches_of(rec, in) == 0) ? 1 : 0;
    }
    EXPECT_EQ(folded_norms, c.folds) << what;
  }
}

// The glu epilogue off for a test's scope.
struct GluEpilogueOff : Switched<cuda::set_glu_epilogue> {
  GluEpilogueOff() : Switched(false) {}
};

// A feed-forward block of one token (gate and up of x, their glu, down), built for both backends.
struct FeedForward {
  DType type, down_type;
  int n_embd, n_ff;
  bool gelu;
  std::vector<uint8_t> gate, up, down;
  std::vector<float> x;
  std::vector<int32_t> ids;  // the activations' (none), alive while a graph reads them
  Tensor* glu = nullptr;
  FeedForward(DType t, DType dt, int e, int f, bool g, std::mt19937& rng)
      : type(t), down_type(dt), n_embd(e), n_ff(f), gelu(g) {
    gate = random_blocks(type, n_embd, n_ff, rng);
    up = random_blocks(type, n_embd, n_ff, rng);
    down = random_blocks(down_type, n_ff, n_embd, rng);
    x = randn(size_t(n_embd), rng);
  }
  Build build() {
    return [this](Graph& g, Backend& be) {
      Tensor* a = activations(g, be, x, n_embd, 1, ids);
      Tensor* gt = g.mul_mat(upload(g, be, type, n_embd, n_ff, gate.data(), "gate"), a);
      Tensor* ut = g.mul_mat(upload(g, be, type, n_embd, n_ff, up.data(), "up"), a);
      glu = gelu ? g.geglu(gt, ut) : g.swiglu(gt, ut);
      return g.mul_mat(upload(g, be, down_type, n_ff, n_embd, down.data(), "down"), glu);
    };
  }
  std::string what() const {
    return std::string(type_name(type)) + "/" + type_name(down_type) + " " +
           std::to_string(n_embd) + "x" + std::to_string(n_ff) + (gelu ? " gelu" : " silu");
  }
};

// The gated unit in the epilogue of one token's gate and up products (MatVecGlu) against the
// glu's own launch: down's result equals, bit for bit, that of the products and the glu launched
// apart (so the gated unit's float and 8-bit forms do). Every kernel shape it takes: rows held
// in registers at one and two pieces a lane; SiLU and GELU; a down product of floats, which
// reads the float form. Longer rows keep the glu's launch.
TEST_F(CudaOps, GluEpilogueOfTheGateUpProductsEqualsTheGluLaunch) {
  std::mt19937 rng(53);
  struct Case {
    DType type, down_type;
    int n_embd, n_ff;
    bool gelu, fused;
  };
  const Case cases[] = {
      {DType::Q4_1, DType::Q4_1, 576, 1536, false, true},    // rows, a piece a lane
      {DType::Q4_K, DType::Q6_K, 768, 2048, true, true},     // rows, a piece a lane
      {DType::Q5_0, DType::Q8_0, 640, 2048, true, true},     // rows, a piece a lane
      {DType::Q4_0, DType::Q4_0, 2048, 1024, false, true},   // rows, two pieces a lane
      {DType::Q8_0, DType::F16, 1024, 512, false, true},     // rows, two pieces a lane
      {DType::Q4_0, DType::Q8_0, 4096, 1024, false, false},  // longer rows: not taken
  };
  for (const Case& c : cases) {
    FeedForward ff(c.type, c.down_type, c.n_embd, c.n_ff, c.gelu, rng);
    const Build build = ff.build();
    const auto fused = run_on(*cuda_, build);
    std::vector<float> apart;
    {
      GluEpilogueOff off;
      apart = run_on(*cuda_, build);
    }
    ASSERT_EQ(fused.size(), apart.size()) << ff.what();
    EXPECT_EQ(std::memcmp(fused.data(), apart.data(), fused.size() * sizeof(float)), 0)
        << ff.what();
    // Against the CPU, so that both paths being wrong alike would show (its K-quant products
    // quantize the activation in blocks of 256, not 32: a wider bar, as for the norm fold).
    EXPECT_LT(rel_err(fused, run_on(*cpu_, build)), 5e-2) << ff.what();
    // And the epilogue did take the glu (the graph as the runs planned it).
    Graph g;
    g.set_output(build(g, *cuda_));
    plan(g);
    EXPECT_EQ(launches_of(LayerGraph::launches_of_graph(g), ff.glu), c.fused ? 0 : 1) << ff.what();
  }
}

// The rope epilogue of several tokens' q, k and v products on the warp-pipelined kernel, against
// the ropes' and stores' launches: the attention output and the caches' bytes equal bit for bit.
// One sequence (a prompt chunk: rows from n_past on, and a ring that wraps) and a decode batch
// (each token a sequence of its own in a pool, one a padding token whose stores are skipped);
// one and two column tiles; with and without GQA; partial rotation and rope factors.
TEST_F(CudaOps, RopeEpilogueOfSeveralTokensOnTheWarpKernelEqualsTheRopesLaunch) {
  struct Reset {
    ~Reset() { cuda::set_mat_mul_q_everywhere(cuda::MatMulQ::None); }
  } reset;
  cuda::set_mat_mul_q_everywhere(cuda::MatMulQ::Int8Warp);
  WarpRopeEpilogueOn on;
  std::mt19937 rng(43);
  struct Case {
    DType type;
    int n_head, n_head_kv, hd, n_dims;
    bool factors, seqs;
    int ring;  // > 0 (one sequence): a ring of this many rows
  };
  const Case cases[] = {
      {DType::Q4_1, 9, 3, 64, 64, false, true, 0},   {DType::Q4_0, 8, 8, 128, 128, true, true, 0},
      {DType::Q8_0, 4, 2, 128, 96, false, false, 0}, {DType::Q4_0, 8, 2, 64, 64, true, false, 64},
      {DType::Q4_K, 4, 4, 64, 64, false, true, 0},
  };
  for (const Case& c : cases) {
    const int n_embd = c.n_head * c.hd, kv_w = c.n_head_kv * c.hd, n_seq = 20;
    auto bq = random_blocks(c.type, n_embd, n_embd, rng);
    auto bk = random_blocks(c.type, n_embd, kv_w, rng);
    auto bv = random_blocks(c.type, n_embd, kv_w, rng);
    auto factors = randn(size_t(c.n_dims / 2), rng, 0.5f);
    for (auto& f : factors) f = 1.0f + std::fabs(f);
    for (int n_tok : {4, 8, 13, 16}) {
      const std::string what = std::string(type_name(c.type)) + " heads " +
                               std::to_string(c.n_head) + "/" + std::to_string(c.n_head_kv) +
                               (c.seqs ? " seqs" : " one sequence") + " tokens " +
                               std::to_string(n_tok);
      const int n_past = c.ring > 0 ? 1010 : 29;  // a ring's rows wrap within the tokens
      const int rows = c.seqs ? 64 : c.ring > 0 ? c.ring : n_past + n_tok;
      const int window = c.ring > 0 ? 32 : 0;
      auto x = randn(size_t(n_embd) * n_tok, rng);
      std::vector<int32_t> pos(n_tok), slots(2 * size_t(n_tok)), ids;
      std::vector<int32_t> seqs(n_seq);
      for (int i = 0; i < n_seq; ++i) seqs[i] = i;
      std::shuffle(seqs.begin(), seqs.end(), rng);
      for (int i = 0; i < n_tok; ++i) {
        pos[i] = c.seqs ? int(rng() % (rows - 1)) : n_past + i;
        slots[i] = i == 1 ? -1 : seqs[i];  // token 1: a padding token
        slots[n_tok + i] = pos[i];
      }
      const size_t cache_elems = size_t(kv_w) * rows * (c.seqs ? n_seq : 1);
      const auto k16 = randn_f16(cache_elems, rng), v16 = randn_f16(cache_elems, rng);
      void *k_mem = nullptr, *v_mem = nullptr;
      Tensor* rope_q = nullptr;
      Build build = [&](Graph& g, Backend& be) {
        k_mem = be.alloc_kv(cache_elems * 2);
        v_mem = be.alloc_kv(cache_elems * 2);
        be.kv_from_host(k_mem, k16.data(), cache_elems * 2);
        be.kv_from_host(v_mem, v16.data(), cache_elems * 2);
        Tensor* xt = activations(g, be, x, n_embd, n_tok, ids);
        Tensor* p = g.input_i32(n_tok, pos.data(), "pos");
        Tensor* q = g.mul_mat(upload(g, be, c.type, n_embd, n_embd, bq.data(), "wq"), xt);
        Tensor* k = g.mul_mat(upload(g, be, c.type, n_embd, kv_w, bk.data(), "wk"), xt);
        Tensor* v = g.mul_mat(upload(g, be, c.type, n_embd, kv_w, bv.data(), "wv"), xt);
        Tensor* f = c.factors
                        ? upload(g, be, DType::F32, c.n_dims / 2, 1, factors.data(), "rope_freqs")
                        : nullptr;
        rope_q = q = g.rope(q, p, c.n_head, c.hd, c.n_dims, kRopeNormal, 10000.0f, f);
        k = g.rope(k, p, c.n_head_kv, c.hd, c.n_dims, kRopeNormal, 10000.0f, f);
        const float scale = 1.0f / std::sqrt(float(c.hd));
        if (c.seqs) {
          Tensor* kp = g.kv_pool(DType::F16, kv_w, rows, n_seq, k_mem, "k_pool");
          Tensor* vp = g.kv_pool(DType::F16, kv_w, rows, n_seq, v_mem, "v_pool");
          Tensor* sl = g.input_i32(2 * n_tok, slots.data(), "slots");
          g.kv_store_seqs(kp, k, sl);
          g.kv_store_seqs(vp, v, sl);
          return g.attention_seqs(q, kp, vp, sl, c.n_head, c.n_head_kv, c.hd, scale);
        }
        Tensor* kc = g.kv_cache(DType::F16, kv_w, rows, k_mem, "k", c.ring > 0);
        Tensor* vc = g.kv_cache(DType::F16, kv_w, rows, v_mem, "v", c.ring > 0);
        g.kv_store(kc, k, n_past);
        g.kv_store(vc, v, n_past);
        return g.attention(q, kc, vc, c.n_head, c.n_head_kv, c.hd, scale, n_past + n_tok, n_past,
                           window);
      };
      const EpilogueRuns runs =
          with_and_without_rope_epilogue(*cuda_, build, k_mem, v_mem, cache_elems * 2);
      const auto &fused = runs.out, &apart = runs.out_apart;
      const auto &kf = runs.k, &vf = runs.v, &ku = runs.k_apart, &vu = runs.v_apart;
      ASSERT_EQ(fused.size(), apart.size()) << what;
      // A padding token's output is unused (it attends to another sequence's rows).
      std::vector<float> f2 = fused, a2 = apart;
      if (c.seqs)
        for (size_t i = 0; i < size_t(n_embd); ++i) f2[n_embd + i] = a2[n_embd + i] = 0.0f;
      EXPECT_EQ(std::memcmp(f2.data(), a2.data(), f2.size() * sizeof(float)), 0) << what;
      EXPECT_TRUE(kf == ku) << "K cache: " << what;
      EXPECT_TRUE(vf == vu) << "V cache: " << what;
      std::vector<uint8_t> k0(cache_elems * 2);
      std::memcpy(k0.data(), k16.data(), k0.size());
      EXPECT_FALSE(kf == k0) << "the K store ran: " << what;
      if (!c.seqs) {
        EXPECT_LT(rel_err(fused, run_on(*cpu_, build)), 3e-2) << what;
      }
      Graph g;
      g.set_output(build(g, *cuda_));
      plan(g);
      EXPECT_EQ(launches_of(LayerGraph::launches_of_graph(g), rope_q), 0) << what;
    }
  }
}

TEST(CudaLaunchPlan, ConsecutiveDecodeStepsDifferOnlyInTheKvRecordsLaunch) {
  for (int n_tokens : {1, 4, 64}) {
    // Ropes after each product, products first (NeoX ropes), products first with normal ropes
    // (one token: the ropes and stores in the products' epilogue).
    for (int order = 0; order < 3; ++order) {
      const bool products_first = order > 0;
      const int mode = order == 2 ? kRopeNormal : kRopeNeox;
      LayerGraph a(n_tokens, 100, products_first, false, DType::Q4_1, DType::Q4_1, mode);
      LayerGraph b(n_tokens, 101, products_first, false, DType::Q4_1, DType::Q4_1, mode);
      const auto ra = a.launches(), rb = b.launches();
      ASSERT_EQ(ra.size(), rb.size());
      ASSERT_FALSE(ra.empty());
      // The first launch writes the record: the cache row and first query position (n_past),
      // then the attention length (n_past + n_tokens), slots in order of first use.
      EXPECT_EQ(ra[0].node, -1);
      for (int past : {100, 101}) {
        std::vector<int32_t> want(cuda::kMaxKvSlots, 0);
        want[0] = past;
        want[1] = past + n_tokens;
        EXPECT_EQ(record_values(past == 100 ? ra[0] : rb[0]), want) << "tokens " << n_tokens;
      }
      EXPECT_FALSE(ra[0].same_args(rb[0]));
      // Every other launch, the K/V stores' and the attention's included, reads the KV position
      // from the record: its arguments stay.
      for (size_t i = 1; i < ra.size(); ++i) {
        ASSERT_TRUE(ra[i].same_shape(rb[i])) << "launch " << i;
        ASSERT_EQ(ra[i].node, rb[i].node);
        EXPECT_TRUE(ra[i].same_args(rb[i]))
            << "launch " << i << " of " << op_name(a.g.nodes()[ra[i].node]->op)
            << " changed its arguments";
      }
      // Per layer, the launch with the K/V stores (a rope's or the products', where they ride
      // along) holds a pointer to the row's slot, and the attention's to the length's and first
      // position's.
      const int32_t* record = LayerGraph::record();
      int row_reads = 0, length_reads = 0;
      for (const auto& k : ra) {
        const Op op = k.node >= 0 ? a.g.nodes()[k.node]->op : Op::Leaf;
        if ((op == Op::Rope || op == Op::KvStore || op == Op::MulMat) && holds_pointer(k, record))
          ++row_reads;
        if (op == Op::Attention && holds_pointer(k, record + 1) && holds_pointer(k, record))
          ++length_reads;
      }
      EXPECT_EQ(row_reads, 2) << "tokens " << n_tokens << " order " << order;
      EXPECT_EQ(length_reads, 2) << "tokens " << n_tokens << " order " << order;
    }
  }
  // The attention grid depends on the cache size, not on the depth: a whole conversation has one
  // decode topology. Another batch launches other shapes: another topology.
  auto same_topology = [](const LayerGraph& x, const LayerGraph& y) {
    const auto rx = x.launches(), ry = y.launches();
    if (rx.size() != ry.size()) return false;
    for (size_t i = 0; i < rx.size(); ++i)
      if (!rx[i].same_shape(ry[i])) return false;
    return true;
  };
  EXPECT_TRUE(same_topology(LayerGraph(1, 200), LayerGraph(1, 201)));
  EXPECT_TRUE(same_topology(LayerGraph(1, 0), LayerGraph(1, 1000)));
  EXPECT_FALSE(same_topology(LayerGraph(1, 20), LayerGraph(2, 20)));
}

TEST(CudaLaunchPlan, AReusedGraphNeedsOnlyTheKvRecordsLaunch) {
  LayerGraph lg(1, 100);
  cuda::ReusePlan reuse;
  cuda::plan_reuse(lg.g, &reuse);
  EXPECT_EQ(reuse.kv.n_slots, 2);
  // The token ids' get_rows is checked again; per layer the K and V stores' rows and the
  // attention's length and first position are checked as values.
  EXPECT_EQ(reuse.recheck.size(), 1u);
  EXPECT_EQ(reuse.kv_checks.size(), 2u * 4u);
  // Every depth, almost to the end of the cache (1024 rows), reuses the launches.
  int n_past = 100;
  for (; n_past + 1 < 1000; ++n_past) {
    lg.g.shift_kv(1);
    ASSERT_TRUE(cuda::check_reused(lg.g, &reuse)) << "n_past " << n_past + 1;
    // What the backend hands the executor instead of a walk is the walk's first launch.
    std::vector<cuda::KernelLaunch> kv;
    cuda::Launcher l;
    l.execute = false;
    l.record = &kv;
    cuda::launch_kv_params(l, reuse.kv.values, LayerGraph::record());
    const auto full = lg.launches();
    ASSERT_EQ(kv.size(), 1u);
    ASSERT_TRUE(kv[0].same_shape(full[0]) && kv[0].same_args(full[0])) << "n_past " << n_past + 1;
  }
  // Values that were equal no longer are (the K/V stores would no longer launch together).
  lg.store_v->kv[0] += 5;
  EXPECT_FALSE(cuda::check_reused(lg.g, &reuse));
  EXPECT_EQ(reuse.kv.n_slots, 3);
  lg.store_v->kv[0] -= 5;
  EXPECT_FALSE(cuda::check_reused(lg.g, &reuse));
  // Rows past the end of the cache are refused before anything is launched, with
  // validate_node's message; the last row that fits is not.
  const int at = lg.store_v->kv[0];
  lg.g.shift_kv(1023 - at);
  EXPECT_TRUE(cuda::check_reused(lg.g, &reuse));
  lg.g.shift_kv(1);
  try {
    cuda::check_reused(lg.g, &reuse);
    ADD_FAILURE() << "row 1024 of a cache of 1024 was accepted";
  } catch (const ArgumentError& e) {
    EXPECT_NE(std::string(e.what()).find("outside a cache of 1024"), std::string::npos) << e.what();
  }
  // A negative length too.
  lg.g.shift_kv(-2000);
  EXPECT_THROW(cuda::check_reused(lg.g, &reuse), ArgumentError);
}

// A chain loop (Op::ChainLoop) of two steps: its round kernel is the last launch and reads the
// steps' inputs where they lie, the KV record and the token buffer; a loop whose last round would
// write past the cache is refused before anything is launched.
TEST(CudaLaunchPlan, AChainLoopsRoundIsItsLastLaunchOverTheStepsInputs) {
  constexpr int n_embd = 64, n_vocab = 256, n_ctx = 128, k = 2, k_total = 16, capacity = 16;
  Graph g;
  FakeWeights fw;
  Tensor* buffer = g.token_buffer(fw.alloc(2 * k_total * sizeof(int32_t)), k_total);
  std::vector<int32_t> config(sample_word::kHeader + 4, 0), first{1}, positions{10, 11};
  std::vector<int32_t> control{3, 0};
  Tensor* cfg = g.input_i32(int64_t(config.size()), config.data(), "sample_config");
  Tensor* first_id = g.input_i32(1, first.data(), "tokens");
  Tensor* kc = g.kv_cache(DType::F16, n_embd, n_ctx, fw.alloc(n_embd * n_ctx * 2), "k");
  Tensor* vc = g.kv_cache(DType::F16, n_embd, n_ctx, fw.alloc(n_embd * n_ctx * 2), "v");
  Tensor* table = fw.weight(g, DType::Q8_0, n_embd, n_vocab, "tok_embd");
  Tensor* out_w = fw.weight(g, DType::Q8_0, n_embd, n_vocab, "output");
  std::vector<Tensor*> pos;
  Tensor* last = nullptr;
  for (int j = 0; j < k; ++j) {
    Tensor* ids = j > 0 ? g.token_at(buffer, j - 1) : first_id;
    pos.push_back(g.input_i32(1, &positions[size_t(j)], "positions"));
    Tensor* x = g.get_rows(table, ids);
    Tensor* q = g.rope(x, pos.back(), 1, n_embd, n_embd, kRopeNeox, 10000.0f);
    g.kv_store(kc, q, 10 + j);
    g.kv_store(vc, x, 10 + j);
    Tensor* a = g.attention(q, kc, vc, 1, 1, n_embd, 0.125f, 11 + j, 10 + j);
    last = g.sample(g.mul_mat(out_w, a), cfg, buffer, j);
  }
  g.chain = k;
  Tensor* ctl = g.input_i32(2, control.data(), "loop_control");
  void* out = fw.alloc((1 + 2 * capacity) * sizeof(int32_t));
  Tensor* loop = g.chain_loop(last, cfg, first_id, ctl, pos, out, capacity);
  g.set_output(loop);
  plan(g);
  const auto rec = LayerGraph::launches_of_graph(g);
  ASSERT_FALSE(rec.empty());
  const cuda::KernelLaunch& round = rec.back();
  EXPECT_EQ(round.node, loop->index);
  EXPECT_EQ(launches_of(rec, loop), 1);
  ASSERT_EQ(round.n_args, 1);
  ASSERT_EQ(round.arg_size[0], sizeof(cuda::ChainLoopArgs));
  cuda::ChainLoopArgs a;
  std::memcpy(&a, round.args + round.arg_offset[0], sizeof(a));
  const uint8_t* input = reinterpret_cast<const uint8_t*>(uintptr_t(0x7100000000));
  auto at = [&](const Tensor* t) { return reinterpret_cast<const int32_t*>(input + t->offset); };
  EXPECT_EQ(a.tokens, buffer->data);
  EXPECT_EQ(a.k, k);
  EXPECT_EQ(a.k_total, k_total);
  EXPECT_EQ(a.config, at(cfg));
  EXPECT_EQ(a.history_cap, 4);
  EXPECT_EQ(a.first, at(first_id));
  for (int j = 0; j < k; ++j) EXPECT_EQ(a.positions[j], at(pos[size_t(j)])) << "step " << j;
  EXPECT_EQ(a.record, LayerGraph::record());
  EXPECT_EQ(a.control, at(ctl));
  EXPECT_EQ(a.out, out);
  EXPECT_EQ(a.capacity, capacity);
  EXPECT_EQ(a.loop, 0u);  // no gate when recording plainly: no WHILE node
  // The last round's KV values: the attention's length reaches the cache's end at a span of
  // n_ctx - 12 positions and no further.
  cuda::ReusePlan reuse;
  cuda::plan_reuse(g, &reuse);
  EXPECT_NO_THROW(cuda::check_kv_values(g, reuse, n_ctx - 12));
  EXPECT_THROW(cuda::check_kv_values(g, reuse, n_ctx - 11), ArgumentError);
}

TEST(CudaLaunchPlan, TheKvRecordHoldsABoundedNumberOfDistinctValues) {
  for (int n_values : {cuda::kMaxKvSlots, cuda::kMaxKvSlots + 1}) {
    Graph g;
    Tensor* cache = g.kv_cache(DType::F16, 64, 1024, reinterpret_cast<void*>(0x100000), "k");
    Tensor* x = g.weight(DType::F32, 64, 1, reinterpret_cast<void*>(0x200000), "x");
    for (int i = 0; i < n_values; ++i) g.kv_store(cache, x, i);
    cuda::KvLayout layout;
    if (n_values <= cuda::kMaxKvSlots) {
      EXPECT_NO_THROW(cuda::kv_layout(g, &layout));
    } else {
      EXPECT_THROW(cuda::kv_layout(g, &layout), ArgumentError);
    }
  }
}

// The decode grid is fixed by the cache's size, so that a graph captured at one depth runs at
// every other: enough splits to fill the GPU where the cache is long enough to give each split
// split_keys keys, and splits of at most kAttnMaxSplitKeys keys, never more than kMaxAttnSplits,
// and never fewer as the cache grows.
TEST(CudaLaunchPlan, SplitCountFollowsTheCacheSizeAndFillsTheGpu) {
  for (int split_keys : {64, cuda::kAttnMinSplitKeys})
    for (int kv_blocks : {1, 4, 32, 256, 1024, 2048}) {
      int last = 0;
      for (int max_keys : {1, 63, 64, 65, 127, 128, 129, 1000, 4096, 32768, 131072}) {
        const int s = cuda::attention_splits(max_keys, kv_blocks, split_keys);
        EXPECT_GE(s, 1);
        EXPECT_LE(s, cuda::kMaxAttnSplits);
        EXPECT_GE(s, last) << max_keys;
        EXPECT_LE((s - 1) * split_keys, max_keys) << "a split without keys";
        if (max_keys >= cuda::kMaxAttnSplits * split_keys) {
          EXPECT_TRUE(s == cuda::kMaxAttnSplits || s * kv_blocks >= cuda::kAttnTargetBlocks)
              << max_keys << " keys over " << kv_blocks << " blocks: " << s << " splits";
        }
        // However many blocks the batch fills the GPU with, no split of a long cache takes more
        // than kAttnMaxSplitKeys keys (up to kMaxAttnSplits splits).
        EXPECT_TRUE(s == cuda::kMaxAttnSplits ||
                    int64_t(s) * cuda::kAttnMaxSplitKeys >= int64_t(max_keys))
            << max_keys << " keys over " << kv_blocks << " blocks: " << s << " splits";
        last = s;
      }
    }
}

// The products' k splits at 32 and 64 columns (the half kernel's 128-row blocks, 16 stages of k
// 4096), as their partials' size shows: the split count that leaves the busiest SM least work,
// which the sweep of every count on an H200 found fastest for each of the 7B shape's launches
// (BENCHMARKS.md, "split-k plan"). q/k/v's 96 row blocks take 4 splits (3 by the old block
// target, 21-24% slower), gate/up's 172 take 2, and the 32 of the output and down products 8.
TEST(CudaLaunchPlan, ProductSplitsLeaveTheBusiestSmLeastWork) {
  struct Case {
    std::vector<int64_t> n;
    int64_t k;
    int splits;
  };
  const Case cases[] = {{{4096, 4096, 4096}, 4096, 4},
                        {{11008, 11008}, 4096, 2},
                        {{4096}, 4096, 8},
                        {{4096}, 11008, 8}};
  for (int64_t cols : {32, 64})
    for (const Case& c : cases) {
      ASSERT_EQ(cuda::mat_mul_q_kind(DType::Q4_0, c.k, cols), cuda::MatMulQ::Half);
      int64_t rows = 0;
      for (int64_t n : c.n) rows += n;
      const size_t bytes = cuda::mat_mul_q_partials_bytes(DType::Q4_0, c.n.data(),
                                                          static_cast<int>(c.n.size()), c.k, cols);
      EXPECT_EQ(bytes, size_t(c.splits) * cols * rows * sizeof(float))
          << rows << " rows, k " << c.k << ", " << cols << " columns";
    }
}

// The split weight layout the upload writes, on the host: every element of every block decodes
// from the split arrays to the CPU dequantizer's bits, whatever the block count, and the arrays
// take exactly the GGUF bytes (Q2_K and Q3_K: a 4-bit piece a 32 and their records).
TEST(CudaLaunchPlan, WeightSplitDecodesToTheCpusValues) {
  std::mt19937 rng(25);
  for (DType t :
       {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q2_K, DType::Q3_K,
        DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_NL, DType::IQ4_XS}) {
    const cuda::SplitFormat f = cuda::split_format(t);
    ASSERT_EQ(size_t(f.block_bytes), type_traits(t).type_size) << type_name(t);
    ASSERT_EQ(f.block_elems, type_traits(t).block_size) << type_name(t);
    for (int64_t n_blocks : {int64_t(1), int64_t(7), int64_t(96)}) {
      // Rows of one block each: the decode takes row 0 of a table whose arrays hold all.
      const std::vector<uint8_t> src = random_blocks(t, f.block_elems, n_blocks, rng);
      const size_t bytes = cuda::split_bytes(f, size_t(n_blocks));
      std::vector<uint8_t> dst(bytes, 0);
      for (int64_t i = 0; i < n_blocks; ++i)
        cuda::split_block(t, src.data() + i * f.block_bytes, size_t(i), size_t(n_blocks),
                          dst.data());
      const size_t hi = cuda::split_high_offset(f, size_t(n_blocks));
      const size_t sc = cuda::split_scales_offset(f, size_t(n_blocks));
      EXPECT_EQ(hi % 16, 0u);
      const size_t expanded = t == DType::Q2_K   ? size_t(n_blocks) * (8 * 16 + 20)
                              : t == DType::Q3_K ? size_t(n_blocks) * (8 * 16 + 18)
                                                 : src.size();
      EXPECT_EQ(bytes, expanded) << type_name(t);
      std::vector<float> want(size_t(f.block_elems) * n_blocks);
      dequantize_row(t, src.data(), want.data(), int64_t(want.size()));
      for (int64_t i = 0; i < int64_t(want.size()); ++i) {
        const float got = cuda::split_elem(t, dst.data(), dst.data() + hi, dst.data() + sc, i);
        ASSERT_EQ(std::memcmp(&got, &want[size_t(i)], 4), 0)
            << type_name(t) << " element " << i << " of " << n_blocks << " blocks: " << got
            << " against " << want[size_t(i)];
      }
    }
  }
}

// What the mat-vec does with a Q2_K or Q3_K piece (its integer dots with the activation quants and
// the record words it loads), on the host: against float64 products of the CPU's dequantized
// values with 8-bit activations, for every sub-block position of several blocks.
TEST(CudaLaunchPlan, HalfScaledPiecesDotAsTheCpusValues) {
  std::mt19937 rng(27);
  std::uniform_int_distribution<int> q8(-127, 127);
  auto u16 = [](const uint8_t* p) { return uint32_t(p[0]) | uint32_t(p[1]) << 8; };
  for (DType t : {DType::Q2_K, DType::Q3_K}) {
    const cuda::SplitFormat f = cuda::split_format(t);
    const int64_t n_blocks = 5;
    const std::vector<uint8_t> src = random_blocks(t, 256, n_blocks, rng);
    std::vector<uint8_t> dst(cuda::split_bytes(f, size_t(n_blocks)));
    for (int64_t i = 0; i < n_blocks; ++i)
      cuda::split_block(t, src.data() + i * f.block_bytes, size_t(i), size_t(n_blocks), dst.data());
    std::vector<float> w(size_t(256 * n_blocks));
    dequantize_row(t, src.data(), w.data(), int64_t(w.size()));
    const uint8_t* scales = dst.data() + cuda::split_scales_offset(f, size_t(n_blocks));
    for (int64_t piece = 0; piece < 8 * n_blocks; ++piece) {
      const int j = int(piece % 8);
      const uint8_t* q = dst.data() + piece * 16;
      const uint8_t* rec = scales + piece / 8 * f.scale_bytes;
      int a[32];
      for (int& v : a) v = q8(rng);
      const float d8 = 0.01f * float(1 + piece % 7);
      int lo = 0, hi16 = 0, sum_lo = 0, sum_hi = 0;
      for (int i = 0; i < 16; ++i) {
        lo += (q[i] & 15) * a[i];
        hi16 += (q[i] & 0xF0) * a[i + 16];
        sum_lo += a[i];
        sum_hi += a[i + 16];
      }
      // The words load_piece takes: the pair's scale bytes (Q3_K: with d above them); Q2_K's d
      // and dmin.
      const uint32_t r0 = u16(rec + 2 * j) | (t == DType::Q3_K ? u16(rec + 16) << 16 : 0u);
      const uint32_t r1 = t == DType::Q2_K ? u16(rec + 16) | u16(rec + 18) << 16 : 0u;
      const float got = cuda::half_scaled_piece_dot(t, lo, hi16, sum_lo, sum_hi, r0, r1, d8);
      double want = 0, scale = 0;
      for (int i = 0; i < 32; ++i) {
        want += double(w[size_t(piece * 32 + i)]) * a[i] * d8;
        scale += std::fabs(double(w[size_t(piece * 32 + i)]) * a[i] * d8);
      }
      ASSERT_NEAR(got, want, 1e-5 * scale + 1e-7) << type_name(t) << " piece " << piece;
      // The prompt tiles' dequantization from the same words.
      const cuda::HalfScales hs = cuda::half_scales(t, r0, r1);
      for (int i = 0; i < 32; ++i) {
        const int qi = i < 16 ? q[i] & 15 : q[i - 16] >> 4;
        const float v = float(qi) * hs.d[i / 16] + hs.m[i / 16];
        const float ref = w[size_t(piece * 32 + i)];
        ASSERT_NEAR(v, ref, 1e-6 * (std::fabs(ref) + 1e-3f)) << type_name(t) << " element " << i;
      }
    }
  }
}

// ---- Sampling (cuda/sample.cu) ----------------------------------------------------------------

// Random123's published known answer for Philox4x32-10 on the host; on the device, the same
// function against curand's Philox4_32_10, whose (n + 1)-th curand4() from a state initialized
// with (seed, subsequence 0, offset 4 first) is Philox of the counter first + n under the key seed.
TEST(CudaSample, PhiloxMatchesCurand) {
  const Philox4 zero = philox4x32_10({{0u, 0u, 0u, 0u}}, 0u, 0u);
  EXPECT_EQ(zero.v[0], 0x6627e8d5u);
  EXPECT_EQ(zero.v[1], 0xe169c58du);
  EXPECT_EQ(zero.v[2], 0xbc57ac4cu);
  EXPECT_EQ(zero.v[3], 0x9b00dbd8u);
  REQUIRE_GPU();
  const int n = 1000;
  std::vector<uint32_t> ours(4 * n), theirs(4 * n);
  for (uint64_t seed : {uint64_t(0), uint64_t(42), uint64_t(0x0123456789ABCDEFull)}) {
    // The second run's counters cross into their high word.
    for (uint64_t first : {uint64_t(0), uint64_t(0xFFFFFE00ull)}) {
      if (!cuda::philox_against_curand(seed, first, n, ours.data(), theirs.data())) {
        GTEST_SKIP() << "this build has no curand headers";
      }
      for (int i = 0; i < n; ++i) {
        const uint64_t c = first + uint64_t(i);
        const Philox4 host = philox4x32_10({{uint32_t(c), uint32_t(c >> 32), 0u, 0u}},
                                           uint32_t(seed), uint32_t(seed >> 32));
        for (int w = 0; w < 4; ++w) {
          ASSERT_EQ(ours[4 * i + w], theirs[4 * i + w])
              << "seed " << seed << ", counter " << c << ", word " << w;
          ASSERT_EQ(ours[4 * i + w], host.v[w])
              << "host and device, seed " << seed << ", counter " << c << ", word " << w;
        }
      }
    }
  }
}

// launch_sample's buffers: a row of logits, a config and a chain's token words; the workspace
// poisoned once (the kernels must not rely on what an earlier launch left there).
class SampleBuffers {
 public:
  SampleBuffers(int max_vocab, size_t max_words, int k) : k_(k) {
    GGRAPH_CUDA_CHECK(cudaMalloc(&logits_, sizeof(float) * size_t(max_vocab)));
    GGRAPH_CUDA_CHECK(cudaMalloc(&config_, sizeof(int32_t) * max_words));
    GGRAPH_CUDA_CHECK(cudaMalloc(&tokens_, sizeof(int32_t) * 2 * size_t(k)));
    const size_t work = cuda::sample_work_bytes(max_vocab);
    GGRAPH_CUDA_CHECK(cudaMalloc(&work_, work));
    GGRAPH_CUDA_CHECK(cudaMemset(work_, 0xFF, work));
  }
  ~SampleBuffers() {
    cudaFree(logits_);
    cudaFree(config_);
    cudaFree(tokens_);
    cudaFree(work_);
  }
  SampleBuffers(const SampleBuffers&) = delete;
  SampleBuffers& operator=(const SampleBuffers&) = delete;

  void upload(const std::vector<float>& logits) {
    GGRAPH_CUDA_CHECK(
        cudaMemcpy(logits_, logits.data(), sizeof(float) * logits.size(), cudaMemcpyHostToDevice));
  }
  // Steps 0..k-1 of a chain, one launch each: the k tokens, then their log-probabilities' bits.
  std::vector<int32_t> run(int n_vocab, const std::vector<int32_t>& config) {
    GGRAPH_CUDA_CHECK(cudaMemcpy(config_, config.data(), sizeof(int32_t) * config.size(),
                                 cudaMemcpyHostToDevice));
    GGRAPH_CUDA_CHECK(cudaMemset(tokens_, 0xFF, sizeof(int32_t) * 2 * size_t(k_)));
    cuda::Launcher l;
    for (int step = 0; step < k_; ++step) {
      cuda::launch_sample(l, logits_, n_vocab, config_, tokens_, step, k_, work_);
    }
    std::vector<int32_t> out(2 * size_t(k_));
    GGRAPH_CUDA_CHECK(
        cudaMemcpy(out.data(), tokens_, sizeof(int32_t) * out.size(), cudaMemcpyDeviceToHost));
    return out;
  }

 private:
  int k_;
  float* logits_ = nullptr;
  int32_t* config_ = nullptr;
  int32_t* tokens_ = nullptr;
  void* work_ = nullptr;
};

// Rows of logits of the kinds the chain treats apart: normal with sigma 1 and 8, rounded to 0.5
// (many ties), with NaN and -inf among them, with one or two +inf, all -inf but one, all NaN.
constexpr int kSampleRowKinds = 7;
const char* const kSampleRowNames[kSampleRowKinds] = {
    "normal(1)", "normal(8)", "rounded", "NaN and -inf", "+inf", "one finite", "all NaN"};

std::vector<float> sample_row(int kind, int n, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, kind == 1 ? 8.0f : kind == 2 ? 2.0f : 1.0f);
  std::vector<float> row(static_cast<size_t>(n));
  for (float& v : row) v = normal(rng);
  if (kind == 2) {
    for (float& v : row) v = std::round(v * 2.0f) / 2.0f;
  } else if (kind == 3) {
    for (int i = 0; i < n; i += 7) row[size_t(i)] = NAN;
    for (int i = 3; i < n; i += 11) row[size_t(i)] = -INFINITY;
  } else if (kind == 4) {
    row[size_t(n / 2)] = INFINITY;
    row[size_t(n / 3)] = INFINITY;
  } else if (kind == 5) {
    std::fill(row.begin(), row.end(), -INFINITY);
    row[size_t(n * 2 / 3)] = 1.5f;
  } else if (kind == 6) {
    std::fill(row.begin(), row.end(), NAN);
  }
  return row;
}

// Greedy; a grid of top_k (-1 standing for n_vocab + 5), top_p, min_p and temperatures; and the
// default chain, then top-p alone and greedy, under each penalty window.
std::vector<SamplingParams> sample_param_sets() {
  std::vector<SamplingParams> sets;
  SamplingParams greedy;
  greedy.temperature = 0.0f;
  sets.push_back(greedy);
  const float temperatures[] = {0.2f, 0.8f, 3.0f};
  int t = 0;
  for (int top_k : {1, 2, 40, 1000, 0, -1}) {
    for (float top_p : {0.3f, 0.95f, 1.0f}) {
      for (float min_p : {0.0f, 0.05f, 0.9f}) {
        SamplingParams p;
        p.top_k = top_k;
        p.top_p = top_p;
        p.min_p = min_p;
        p.temperature = temperatures[t++ % 3];
        sets.push_back(p);
      }
    }
  }
  for (int last_n : {0, 5, 64, -1}) {
    SamplingParams p;
    p.repeat_penalty = 1.3f;
    p.frequency_penalty = 0.2f;
    p.presence_penalty = 0.5f;
    p.penalty_last_n = last_n;
    sets.push_back(p);
    p.top_k = 0;
    p.min_p = 0.0f;
    sets.push_back(p);
    p.temperature = 0.0f;
    sets.push_back(p);
  }
  return sets;
}

std::string describe(const SamplingParams& p) {
  char buf[160];
  std::snprintf(buf, sizeof buf,
                "temperature %g top_k %d top_p %g min_p %g penalties %g/%g/%g last_n %d",
                p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.frequency_penalty,
                p.presence_penalty, p.penalty_last_n);
  return buf;
}

// Each step of a chain on the device against a CPU Sampler given the same logits, parameters,
// seed, draw index and history (the config's, then the tokens of the steps before): the same
// token every time, and the log-probability of a double-precision softmax of the raw logits.
TEST(CudaSample, TokensEqualTheCpuSamplers) {
  REQUIRE_GPU();
  const int n_ctx = 4096, k = 3, largest = 262144;
  const std::vector<SamplingParams> sets = sample_param_sets();
  SampleBuffers device(largest, sample_word::kHeader + n_ctx, k);
  std::mt19937 rng(2024);
  int compared = 0;
  for (int n_vocab : {1, 7, 1000, 49152, largest}) {
    for (int kind = 0; kind < kSampleRowKinds; ++kind) {
      const std::vector<float> row = sample_row(kind, n_vocab, rng);
      device.upload(row);
      // The raw logits' softmax in double (NaN as -inf), as token_logprob takes it.
      double max = -INFINITY, sum = 0.0;
      for (float v : row) max = std::isnan(v) ? max : std::max(max, double(v));
      for (float v : row) sum += std::isnan(v) || max == INFINITY ? 0.0 : std::exp(v - max);
      // The largest vocabulary takes every third parameter set, the large ones one seed.
      const size_t stride = n_vocab == largest ? 3 : 1;
      for (size_t si = 0; si < sets.size(); si += stride) {
        SamplingParams p = sets[si];
        if (p.top_k < 0) p.top_k = n_vocab + 5;
        for (int run = 0; run < (n_vocab > 1000 ? 1 : 2); ++run) {
          const uint64_t seed = run == 0 ? 42 : 0x0123456789ABCDEFull;
          const uint64_t draw = run == 0 ? 0 : 0xFFFFFFFEull;  // the chain's draws cross 2^32
          std::vector<int32_t> history(100);
          std::uniform_int_distribution<int32_t> some_id(0, std::min(n_vocab, 50) - 1);
          for (int32_t& id : history) id = some_id(rng);
          std::vector<int32_t> config(sample_word::kHeader + n_ctx);
          fill_sample_config(p, seed, draw, history.data(), history.size(),
                             sample_history_window(p, n_ctx), config.data());
          const std::vector<int32_t> got = device.run(n_vocab, config);
          for (int step = 0; step < k; ++step) {
            std::vector<int32_t> full = history;
            full.insert(full.end(), got.begin(), got.begin() + step);
            Sampler cpu(p);
            cpu.reseed(seed);
            cpu.set_draws(draw + uint64_t(step));
            int32_t want = -1;
            try {
              want = cpu.sample(row.data(), n_vocab, full.data(), full.size());
            } catch (const ArgumentError&) {
              // no logit above -inf: the kernel gives -1
            }
            const std::string what = "n_vocab " + std::to_string(n_vocab) + ", " +
                                     kSampleRowNames[kind] + ", " + describe(p) + ", run " +
                                     std::to_string(run) + ", step " + std::to_string(step);
            ++compared;
            ASSERT_EQ(got[size_t(step)], want) << what;
            float logprob;
            std::memcpy(&logprob, &got[size_t(k + step)], sizeof logprob);
            if (want < 0) {
              EXPECT_TRUE(std::isnan(logprob)) << what;
              continue;
            }
            const float raw = row[size_t(want)];
            if (max == INFINITY) {
              EXPECT_EQ(logprob, raw == INFINITY ? 0.0f : -INFINITY) << what;
            } else {
              EXPECT_NEAR(logprob, double(raw) - (max + std::log(sum)), 1e-4) << what;
            }
          }
        }
      }
      if (kind == 6) {
        SamplingParams p;
        std::vector<int32_t> config(sample_word::kHeader + n_ctx);
        fill_sample_config(p, 1, 0, nullptr, 0, 0, config.data());
        EXPECT_EQ(device.run(n_vocab, config)[0], -1) << "every logit NaN, n_vocab " << n_vocab;
      }
    }
  }
  EXPECT_GT(compared, 10000);
}

// A chain loop's round kernel (Op::ChainLoop) on words laid out as launch_graph lays them:
// what it appends, and what it moves on for the next round or leaves where the loop ends.
// What a chain loop's streamed tokens need: the host sees a round's words while the rounds run,
// and the device sees the host's word (the halt), as kernels and inside a graph's WHILE node.
TEST(CudaSample, TheHostSeesEachRoundsWordsWhileTheRoundsRun) {
  REQUIRE_GPU();
  // Every way, so that a failure tells which of them the host sees in time; the way the chain
  // loop's round kernel hands its count over must be one.
  const char* names[cuda::kHostWordWays] = {"a store", "a store fenced after", "a volatile store"};
  using cuda::RoundsAs;
  const std::pair<RoundsAs, const char*> shapes[] = {
      {RoundsAs::kKernels, "kernels one after the other"},
      {RoundsAs::kWhileNode, "a graph's WHILE node"},
      {RoundsAs::kExecutorLoop, "a chain loop's graph as the executor captures it"}};
  for (int w = 0; w < cuda::kHostWordWays; ++w) {
    const auto way = static_cast<cuda::HostWordWay>(w);
    for (const auto& [as, shape] : shapes) {
      const int late = cuda::loop_words_late_rounds(8, as, way);
      std::printf("  %s, %s: %d of 8 rounds late\n", names[w], shape, late);
      if (way == cuda::kLoopHostWord) {
        EXPECT_EQ(late, 0) << names[w] << ", " << shape;
      }
    }
  }
}

TEST(CudaSample, AChainLoopRoundAppendsItsTokensAndReadiesTheNext) {
  REQUIRE_GPU();
  namespace sw = sample_word;
  constexpr int k = 4, k_total = 16, cap = 6, capacity = 12;
  // Offsets of the regions in one device block.
  constexpr int kTokens = 0, kConfig = kTokens + 2 * k_total, kFirst = kConfig + sw::kHeader + cap;
  constexpr int kPositions = kFirst + 1, kRecord = kPositions + k;
  constexpr int kControl = kRecord + cuda::kMaxKvSlots, kOut = kControl + 2;
  constexpr int kWords = kOut + 1 + 2 * capacity;
  struct Case {
    const char* what;
    std::vector<int32_t> tokens;
    int rounds_left, made;
    bool next;          // whether the round readies another
    bool halt = false;  // the host's halt word set
    int limit = 0;      // the config's limit (0: none)
  };
  const Case cases[] = {
      {"a round of tokens", {5, 6, 7, 8}, 3, 0, true},
      {"a stop id among them", {5, 99, 7, 8}, 3, 0, false},
      {"a step skipped", {5, 6, sw::kSkipped, 8}, 3, 0, false},
      {"the last round asked", {5, 6, 7, 8}, 1, 0, false},
      {"a buffer without room for another", {5, 6, 7, 8}, 5, 8, false},
      {"the rounds before it", {5, 6, 7, 8}, 3, 4, true},
      {"a halt from the host", {5, 6, 7, 8}, 3, 4, false, true},
      {"a limit past the round", {5, 6, 7, 8}, 3, 4, true, false, 10},
      {"a limit within the round", {5, 6, sw::kSkipped, 8}, 1, 4, false, false, 2},
  };
  int32_t* dev = nullptr;
  GGRAPH_CUDA_CHECK(cudaMalloc(&dev, sizeof(int32_t) * kWords));
  // The words streamed to the host (laid out as out), then the host's halt word: mapped memory.
  const int halt_word = 1 + 2 * capacity;
  void* mapped = nullptr;
  GGRAPH_CUDA_CHECK(cudaHostAlloc(&mapped, sizeof(int32_t) * (halt_word + 1), cudaHostAllocMapped));
  int32_t* host = static_cast<int32_t*>(mapped);
  int32_t* host_dev = nullptr;
  GGRAPH_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), mapped, 0));
  for (const Case& c : cases) {
    std::fill(host, host + halt_word + 1, -7);
    host[halt_word] = c.halt ? 1 : 0;
    std::vector<int32_t> w(kWords, 0);
    for (int j = 0; j < k; ++j) {
      w[kTokens + j] = c.tokens[size_t(j)];
      w[kTokens + k_total + j] = 100 + j;
    }
    int32_t* config = &w[kConfig];
    config[sw::kNStop] = 1;
    config[sw::kStop] = 99;
    config[sw::kDrawLo] = -1;  // the draw carries into its high word
    config[sw::kDrawHi] = 2;
    config[sw::kNHistory] = 4;
    config[sw::kLimit] = c.limit;
    for (int i = 0; i < 4; ++i) config[sw::kHeader + i] = 1 + i;
    w[kFirst] = 4;
    for (int j = 0; j < k; ++j) w[kPositions + j] = 10 + j;
    for (int i = 0; i < cuda::kMaxKvSlots; ++i) w[kRecord + i] = 10 + i;
    w[kControl] = c.rounds_left;
    w[kControl + 1] = c.made;
    for (int i = 0; i < c.made; ++i) w[kOut + 1 + i] = 50 + i;
    GGRAPH_CUDA_CHECK(cudaMemcpy(dev, w.data(), sizeof(int32_t) * kWords, cudaMemcpyHostToDevice));
    cuda::ChainLoopArgs a;
    a.tokens = dev + kTokens;
    a.k = k;
    a.k_total = k_total;
    a.config = dev + kConfig;
    a.history_cap = cap;
    a.first = dev + kFirst;
    for (int j = 0; j < k; ++j) a.positions[j] = dev + kPositions + j;
    a.record = dev + kRecord;
    a.control = dev + kControl;
    a.out = dev + kOut;
    a.capacity = capacity;
    a.host = host_dev;
    a.halt = host_dev + halt_word;
    cuda::Launcher l;
    cuda::launch_chain_loop_round(l, a);
    GGRAPH_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<int32_t> got(kWords);
    GGRAPH_CUDA_CHECK(
        cudaMemcpy(got.data(), dev, sizeof(int32_t) * kWords, cudaMemcpyDeviceToHost));
    SCOPED_TRACE(c.what);
    // Appended whether or not another round follows.
    EXPECT_EQ(got[kOut], c.made + k);
    EXPECT_EQ(got[kControl], c.rounds_left - 1);
    EXPECT_EQ(got[kControl + 1], c.made + k);
    for (int i = 0; i < c.made; ++i) EXPECT_EQ(got[kOut + 1 + i], 50 + i);
    for (int j = 0; j < k; ++j) {
      EXPECT_EQ(got[kOut + 1 + c.made + j], c.tokens[size_t(j)]);
      EXPECT_EQ(got[kOut + 1 + capacity + c.made + j], 100 + j);
    }
    // The host's copy: the round's words, and the count with the end marked after a last round;
    // nothing else written.
    EXPECT_EQ(host[0], c.made + k + (c.next ? 0 : kLoopEnded));
    for (int i = 0; i < capacity; ++i) {
      const bool round = i >= c.made && i < c.made + k;
      EXPECT_EQ(host[1 + i], round ? c.tokens[size_t(i - c.made)] : -7) << "token word " << i;
      EXPECT_EQ(host[1 + capacity + i], round ? 100 + i - c.made : -7) << "logprob word " << i;
    }
    EXPECT_EQ(host[halt_word], c.halt ? 1 : 0);
    const int32_t* cfg = &got[kConfig];
    // A limit counts the rounds that go on off it.
    EXPECT_EQ(cfg[sw::kLimit], c.next && c.limit > 0 ? c.limit - k : c.limit);
    if (c.next) {
      EXPECT_EQ(got[kFirst], 8);
      for (int j = 0; j < k; ++j) EXPECT_EQ(got[kPositions + j], 14 + j);
      for (int i = 0; i < cuda::kMaxKvSlots; ++i) EXPECT_EQ(got[kRecord + i], 14 + i);
      EXPECT_EQ(cfg[sw::kDrawLo], 3);
      EXPECT_EQ(cfg[sw::kDrawHi], 3);
      // The newest six of the history and the round's tokens.
      EXPECT_EQ(cfg[sw::kNHistory], cap);
      const int32_t want[cap] = {3, 4, 5, 6, 7, 8};
      for (int i = 0; i < cap; ++i) EXPECT_EQ(cfg[sw::kHeader + i], want[i]) << "history " << i;
    } else {
      EXPECT_EQ(got[kFirst], 4);
      for (int j = 0; j < k; ++j) EXPECT_EQ(got[kPositions + j], 10 + j);
      for (int i = 0; i < cuda::kMaxKvSlots; ++i) EXPECT_EQ(got[kRecord + i], 10 + i);
      EXPECT_EQ(cfg[sw::kDrawLo], -1);
      EXPECT_EQ(cfg[sw::kNHistory], 4);
      for (int i = 0; i < 4; ++i) EXPECT_EQ(cfg[sw::kHeader + i], 1 + i);
    }
  }
  cudaFree(dev);
  cudaFreeHost(mapped);
}

}  // namespace
}  // namespace ggraph
