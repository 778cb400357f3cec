// Kernel timings of the CUDA backend: device-to-device copy bandwidth (the ceiling), mat-vec
// bandwidth per weight format at the 7B FFN shapes, tiled mat-mul throughput at a 512-token
// prompt, and attention. Weights rotate over enough copies to exceed the L2 cache, so mat-vec
// figures are DRAM bandwidth. Prints one table; the command is the row's reproduction.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda/blas.h"
#include "cuda/device_util.cuh"
#include "cuda/kernels.cuh"
#include "quant.h"

namespace {

using ggraph::DType;
namespace gc = ggraph::cuda;

#define CHECK(expr) GGRAPH_CUDA_CHECK(expr)

struct Events {
  cudaEvent_t start, stop;
  Events() {
    CHECK(cudaEventCreate(&start));
    CHECK(cudaEventCreate(&stop));
  }
  ~Events() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  // Milliseconds of the work fn enqueues, averaged over iters (after warm-up runs).
  template <typename Fn>
  double time_ms(cudaStream_t s, int iters, Fn fn) {
    for (int i = 0; i < 3; ++i) fn(i);
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaEventRecord(start, s));
    for (int i = 0; i < iters; ++i) fn(i);
    CHECK(cudaEventRecord(stop, s));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    return ms / iters;
  }
  // The same with the iters launches replayed from one CUDA graph: no host launch cost and the
  // shortest gap between kernels, so closer to the kernels' own time.
  template <typename Fn>
  double graph_ms(cudaStream_t s, int iters, Fn fn) {
    cudaGraph_t g = nullptr;
    cudaGraphExec_t x = nullptr;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < iters; ++i) fn(i);
    CHECK(cudaStreamEndCapture(s, &g));
    CHECK(cudaGraphInstantiate(&x, g, 0));
    CHECK(cudaGraphLaunch(x, s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaEventRecord(start, s));
    CHECK(cudaGraphLaunch(x, s));
    CHECK(cudaEventRecord(stop, s));
    CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, start, stop));
    cudaGraphExecDestroy(x);
    cudaGraphDestroy(g);
    return ms / iters;
  }
};

// A weight as the backend uploads it: quantized types in the split layout.
void* device_copy_of(const std::vector<uint8_t>& host, DType t) {
  void* p = nullptr;
  CHECK(cudaMalloc(&p, host.size() + gc::kWeightPadding));
  CHECK(cudaMemcpy(p, host.data(), host.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemset(static_cast<uint8_t*>(p) + host.size(), 0, gc::kWeightPadding));
  if (gc::is_quantized(t)) {
    void* raw = p;
    const int64_t n_blocks = int64_t(host.size() / gc::block_bytes(t));
    const size_t split = gc::split_bytes(gc::split_format(t), size_t(n_blocks));
    CHECK(cudaMalloc(&p, split + gc::kWeightPadding));
    CHECK(cudaMemset(static_cast<uint8_t*>(p) + split, 0, gc::kWeightPadding));
    gc::launch_split_weight(t, static_cast<const uint8_t*>(raw), static_cast<uint8_t*>(p), 0,
                            n_blocks, n_blocks, nullptr);
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaFree(raw));
  }
  return p;
}

// Copies of a weight on the device, enough of them (400 MB, more than 6x the L2) that a
// product reading one after another comes from memory.
std::vector<void*> copies_past_l2(const std::vector<uint8_t>& host, DType t) {
  const double mb = host.size() / 1e6;
  std::vector<void*> w(int(std::max<double>(2, 400.0 / mb + 1)));
  for (auto& p : w) p = device_copy_of(host, t);
  return w;
}

// Random weights of a format with sane scales (the values do not change the timing).
std::vector<uint8_t> random_weights(DType t, int64_t k, int64_t n, std::mt19937& rng) {
  const size_t bytes = gc::row_bytes(t, k) * n;
  std::vector<uint8_t> w(bytes);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& b : w) b = uint8_t(byte(rng));
  const uint16_t scale = ggraph::f32_to_f16(0.01f);
  if (t == DType::F16 || t == DType::BF16) {
    auto* h = reinterpret_cast<uint16_t*>(w.data());
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (size_t i = 0; i < bytes / 2; ++i)
      h[i] = t == DType::F16 ? ggraph::f32_to_f16(u(rng)) : ggraph::f32_to_bf16(u(rng));
  } else if (t == DType::F32) {
    auto* f = reinterpret_cast<float*>(w.data());
    for (size_t i = 0; i < bytes / 4; ++i) f[i] = float(byte(rng)) / 255.f - 0.5f;
  } else {
    // The block's f16 scale (Q6_K's and Q3_K's are its last two bytes, Q2_K's d and dmin its
    // last four), and minimum where it has one.
    const size_t bb = gc::block_bytes(t);
    const size_t at = t == DType::Q6_K || t == DType::Q3_K ? bb - 2 : t == DType::Q2_K ? bb - 4 : 0;
    const bool has_min = t == DType::Q4_1 || t == DType::Q5_1 || t == DType::Q4_K ||
                         t == DType::Q5_K || t == DType::Q2_K;
    for (size_t off = 0; off < bytes; off += bb) {
      std::memcpy(&w[off + at], &scale, 2);
      if (has_min) std::memcpy(&w[off + at + 2], &scale, 2);
    }
  }
  return w;
}

float* device_randn(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> h(n);
  for (auto& v : h) v = d(rng);
  float* p = nullptr;
  CHECK(cudaMalloc(&p, n * sizeof(float)));
  CHECK(cudaMemcpy(p, h.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  return p;
}

double copy_tb_s(cudaStream_t s) {
  const size_t bytes = size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  CHECK(cudaMalloc(&a, bytes));
  CHECK(cudaMalloc(&b, bytes));
  CHECK(cudaMemset(a, 1, bytes));
  Events ev;
  const double ms = ev.time_ms(
      s, 20, [&](int) { CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s)); });
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / (ms * 1e-3) / 1e12;  // bytes read plus bytes written
}

struct KN {
  int64_t k, n;
};

// A prompt product's buffers, k x n weights against `cols` columns: random activations, their
// half form (what the tiled kernel and cuBLAS read) and the output.
struct PromptBuffers {
  float* x = nullptr;
  float* dst = nullptr;
  uint8_t* half = nullptr;
  PromptBuffers(gc::Launcher& l, KN sh, int cols, std::mt19937& rng) {
    x = device_randn(size_t(sh.k) * cols, rng);
    CHECK(cudaMalloc(&dst, size_t(sh.n) * cols * sizeof(float)));
    CHECK(cudaMalloc(&half, gc::act_half_bytes(sh.k, cols)));
    gc::launch_act_to_half(l, x, sh.k, cols, half);
  }
  PromptBuffers(const PromptBuffers&) = delete;
  PromptBuffers& operator=(const PromptBuffers&) = delete;
  ~PromptBuffers() {
    cudaFree(x);
    cudaFree(dst);
    cudaFree(half);
  }
};

// ---- the cost of a kernel boundary against a grid-wide barrier (#14's persistent decode) ----

// One decode step's worth of tiny kernels: a block an SM, each adding to its own slot after the
// previous kernel (programmatic dependent launch, as the backend launches).
__global__ void boundary_kernel(float* x, float v) {
  gc::pdl_begin();
  if (threadIdx.x == 0) x[blockIdx.x] += v;
}

// All phases in one kernel of a block an SM (co-resident: a cooperative launch), the phases
// separated by a barrier over the grid: an arrival counter and a generation the last arrival
// advances, which the others spin on.
__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned* generation) {
  __syncthreads();
  if (threadIdx.x == 0) {
    volatile unsigned* gen = generation;
    const unsigned g = *gen;
    __threadfence();
    if (atomicAdd(count, 1u) == gridDim.x - 1) {
      *count = 0;
      __threadfence();
      atomicAdd(generation, 1u);
    } else {
      while (*gen == g) {
      }
    }
    __threadfence();
  }
  __syncthreads();
}

__global__ void barrier_kernel(float* x, int phases, unsigned* count, unsigned* generation) {
  for (int p = 0; p < phases; ++p) {
    // Each phase reads what another block wrote in the one before, as a layer's ops would.
    if (threadIdx.x == 0) x[blockIdx.x] += __ldcg(x + (blockIdx.x + 1) % gridDim.x) * 0.0f + 1.0f;
    grid_barrier(count, generation);
  }
}

// ---- a cluster's barrier against a kernel boundary (#14: a decode resident in one cluster) ----

// `phases` steps of each cluster: in each, every block hands w values to every block of its
// cluster through distributed shared memory (an all-gather of w * cluster-size values, as a
// layer's phase would hand its outputs on), waits at the cluster's barrier and reads what it
// got. Two slot arrays in turn, so that a phase's stores never land on values still being read:
// a block stores into the array of phase p only after the barrier of phase p - 1, which the
// others pass only once they have read the array's values of phase p - 2.
__global__ void cluster_phases_kernel(float* x, int phases, int w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  __shared__ float slots[2][1024];
  const int rank = static_cast<int>(cluster.block_rank());
  const int n = static_cast<int>(cluster.num_blocks()), t = threadIdx.x;
  const bool on = t < w * n;
  float v = static_cast<float>(rank + t);
  for (int p = 0; p < phases; ++p) {
    if (on) cluster.map_shared_rank(slots[p & 1], t / w)[rank * w + t % w] = v;
    cluster.sync();
    if (on) v = slots[p & 1][(t + 1) % (w * n)] * 0.5f + 1.0f;
  }
  x[blockIdx.x * blockDim.x + t] = v;
#else
  (void)x, (void)phases, (void)w;
#endif
}

// ---- a decode step resident in one cluster (#14): SmolLM2's layer shapes, 8-bit weights ----
//
// Thirty layers of five phases (norm and q/k/v; an attention stand-in; o and the residual; norm,
// gate/up and the gated unit; down and the residual), each a product of a slice of rows a block
// from the weights in its shared memory, its outputs handed to every block of the cluster
// through distributed shared memory, then the cluster's barrier. Every block keeps the whole
// residual stream and works its norms out itself; each slice of weights is requested (16-byte
// asynchronous copies) a phase or two before it is used, into one of two buffers. 8-bit weights
// and activations (one scale a vector) by dp4a: the bytes are twice Q4_1's, the work of a
// phase that of a quantized product. What it measures is the step's time without the output
// product, against today's chain of kernels.
namespace cl {
constexpr int kC = 16, kThreads = 512, kWarps = kThreads / 32, kLayers = 30;
constexpr int kEmbd = 576, kFf = 1536, kQkv = 960;
constexpr int kQkvRows = kQkv / kC, kORows = kEmbd / kC, kGuRows = 2 * kFf / kC;
constexpr int kDownRows = kEmbd / kC;
constexpr int64_t kQkvBytes = int64_t(kQkv) * kEmbd, kOBytes = int64_t(kEmbd) * kEmbd;
constexpr int64_t kGuBytes = int64_t(2 * kFf) * kEmbd, kDownBytes = int64_t(kEmbd) * kFf;
constexpr int64_t kLayerBytes = kQkvBytes + kOBytes + kGuBytes + kDownBytes;
constexpr int kBuf0 = kGuRows * kEmbd, kBuf1 = kDownRows * kFf;  // q/k/v or gate/up; o or down
constexpr size_t kSmem = kBuf0 + kBuf1 + (kEmbd + kQkv + kFf + kGuRows + 32) * sizeof(float) + kFf;
static_assert(kQkvRows * kEmbd <= kBuf0 && kORows * kEmbd <= kBuf1, "buffers hold the slices");
static_assert(kQkvRows % 4 == 0 && kORows % 4 == 0 && kGuRows % 4 == 0, "four rows a warp");
}  // namespace cl

__global__ void __launch_bounds__(cl::kThreads)
    cluster_layers_kernel(const int8_t* w, float* out, int stream) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace cl;
  namespace cg = cooperative_groups;
  const cg::cluster_group cluster = cg::this_cluster();
  extern __shared__ __align__(16) uint8_t smem[];
  int8_t* buf0 = reinterpret_cast<int8_t*>(smem);
  int8_t* buf1 = buf0 + kBuf0;
  float* x = reinterpret_cast<float*>(buf1 + kBuf1);  // the residual stream, whole in every block
  float* g = x + kEmbd;                               // q, k, v
  float* h = g + kQkv;                                // the attention's or the gated unit's out
  float* tmp = h + kFf;                               // this block's rows of a product
  float* red = tmp + kGuRows;                         // block reductions
  int8_t* a8 = reinterpret_cast<int8_t*>(red + 32);   // a product's 8-bit input
  const int rank = static_cast<int>(cluster.block_rank()), t = threadIdx.x;
  const int warp = t / 32, lane = t % 32;
  for (int i = t; i < kEmbd; i += kThreads) x[i] = 0.01f * static_cast<float>(i % 7);
  // A block's slice of a product of `bytes` in layer l (at `at` in the layer) into dst.
  auto fetch = [&](int8_t* dst, int l, int64_t at, int64_t bytes) {
    if (l < kLayers && stream) {
      const int8_t* src = w + l * kLayerBytes + at + rank * (bytes / kC);
      for (int64_t i = t * 16; i < bytes / kC; i += kThreads * 16) gc::cp_async16(dst + i, src + i);
    }
    gc::cp_async_commit();  // an empty group past the last layer keeps the counts
  };
  auto block_reduce = [&](float v, bool max) {
    for (int o = 16; o > 0; o /= 2) {
      const float u = __shfl_xor_sync(0xffffffffu, v, o);
      v = max ? fmaxf(v, u) : v + u;
    }
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < kWarps ? red[lane] : 0.0f;  // neutral for both: the maxima are of magnitudes
    for (int o = 16; o > 0; o /= 2) {
      const float u = __shfl_xor_sync(0xffffffffu, v, o);
      v = max ? fmaxf(v, u) : v + u;
    }
    __syncthreads();
    return v;
  };
  // n values (RMS-normalized where rms) as 8-bit a8 with one scale, which it returns.
  auto quantize = [&](const float* in, int n, bool rms) {
    float ss = 0.0f, mx = 0.0f;
    for (int i = t; i < n; i += kThreads) ss += in[i] * in[i], mx = fmaxf(mx, fabsf(in[i]));
    const float r = rms ? rsqrtf(block_reduce(ss, false) / n + 1e-5f) : 1.0f;
    mx = block_reduce(mx, true) * r;
    const float scale = mx > 0.0f ? mx / 127.0f : 1.0f, inv = r / scale;
    for (int i = t; i < n; i += kThreads) a8[i] = static_cast<int8_t>(__float2int_rn(in[i] * inv));
    __syncthreads();
    return scale;
  };
  // Rows [0, rows) of a slice of rows of k bytes in buf against a8, four rows a warp at a time
  // (their sums side by side): tmp[row].
  auto matvec = [&](const int8_t* buf, int rows, int k, float scale) {
    constexpr int R = 4;
    const uint4* ar = reinterpret_cast<const uint4*>(a8);
    for (int r0 = warp * R; r0 < rows; r0 += kWarps * R) {
      int acc[R] = {};
      for (int c = lane; c < k / 16; c += 32) {
        const uint4 av = ar[c];
#pragma unroll
        for (int j = 0; j < R; ++j) {
          const uint4 wv = reinterpret_cast<const uint4*>(buf + (r0 + j) * k)[c];
          acc[j] = __dp4a(static_cast<int>(wv.x), static_cast<int>(av.x), acc[j]);
          acc[j] = __dp4a(static_cast<int>(wv.y), static_cast<int>(av.y), acc[j]);
          acc[j] = __dp4a(static_cast<int>(wv.z), static_cast<int>(av.z), acc[j]);
          acc[j] = __dp4a(static_cast<int>(wv.w), static_cast<int>(av.w), acc[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < R; ++j) acc[j] = gc::warp_sum_int(acc[j]);
      if (lane == 0) {
#pragma unroll
        for (int j = 0; j < R; ++j)
          tmp[r0 + j] = static_cast<float>(acc[j]) * scale * (1.0f / 4096.0f);
      }
    }
    __syncthreads();
  };
  // This block's n values of tmp to every block's dst[rank * n + j].
  auto gather = [&](float* dst, int n) {
    for (int i = t; i < n * kC; i += kThreads) {
      const int d = i % kC, j = i / kC;
      cluster.map_shared_rank(dst, d)[rank * n + j] = tmp[j];
    }
    cluster.sync();
  };
  fetch(buf0, 0, 0, kQkvBytes);
  fetch(buf1, 0, kQkvBytes, kOBytes);
  cluster.sync();  // every block has started before any store into another's memory
  for (int l = 0; l < kLayers; ++l) {
    gc::cp_async_wait<1>();  // q/k/v's slice; o's may still come
    __syncthreads();
    matvec(buf0, kQkvRows, kEmbd, quantize(x, kEmbd, true));
    fetch(buf0, l, kQkvBytes + kOBytes, kGuBytes);
    gather(g, kQkvRows);
    for (int j = t; j < kORows; j += kThreads)  // the attention's stand-in at depth 0
      tmp[j] = g[rank * kORows + j] + 0.5f * g[(rank * kORows + j + kEmbd) % kQkv];
    __syncthreads();
    gather(h, kORows);
    gc::cp_async_wait<1>();  // o's slice; gate/up's may still come
    __syncthreads();
    matvec(buf1, kORows, kEmbd, quantize(h, kEmbd, false));
    fetch(buf1, l, kQkvBytes + kOBytes + kGuBytes, kDownBytes);
    for (int j = t; j < kORows; j += kThreads) tmp[j] += x[rank * kORows + j];
    __syncthreads();
    gather(x, kORows);
    gc::cp_async_wait<1>();  // gate/up's slice; down's may still come
    __syncthreads();
    matvec(buf0, kGuRows, kEmbd, quantize(x, kEmbd, true));
    fetch(buf0, l + 1, 0, kQkvBytes);
    for (int j = t; j < kGuRows / 2; j += kThreads)
      tmp[j] = tmp[j] / (1.0f + __expf(-tmp[j])) * tmp[kGuRows / 2 + j];
    __syncthreads();
    gather(h, kGuRows / 2);
    gc::cp_async_wait<1>();  // down's slice; the next q/k/v's may still come
    __syncthreads();
    matvec(buf1, kDownRows, kFf, quantize(h, kFf, false));
    fetch(buf1, l + 1, kQkvBytes, kOBytes);
    for (int j = t; j < kDownRows; j += kThreads) tmp[j] += x[rank * kDownRows + j];
    __syncthreads();
    gather(x, kDownRows);
  }
  gc::cp_async_wait<0>();
  for (int i = t; i < kEmbd; i += kThreads) out[rank * kEmbd + i] = x[i];
#else
  (void)w, (void)out, (void)stream;
#endif
}

// The launch of one cluster of c blocks of `threads` threads (cfg.gridDim: more clusters).
struct ClusterLaunch {
  cudaLaunchAttribute attr = {};
  cudaLaunchConfig_t cfg = {};
  ClusterLaunch(int c, int threads, size_t smem, cudaStream_t s) {
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = c;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    cfg.blockDim = dim3(threads);
    cfg.gridDim = dim3(c);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
  }
  ClusterLaunch(const ClusterLaunch&) = delete;  // cfg points at attr
  ClusterLaunch& operator=(const ClusterLaunch&) = delete;
};

// Whether a comma-separated list in the environment variable `name` (unset: everything) holds
// `item`.
bool env_lists(const char* name, const std::string& item) {
  const char* e = std::getenv(name);
  if (!e) return true;
  const std::string list = std::string(",") + e + ",";
  return list.find("," + item + ",") != std::string::npos;
}

}  // namespace

// Sections to run: matvec, decode, matmul, gemm, attention, launch, barrier, cluster; all of them
// by default. The decode section's formats and column counts may be narrowed, to measure: e.g.
// BENCH_TYPES=Q4_0 BENCH_COLS=32,64.
int main(int argc, char** argv) {
  auto want = [&](const char* section) {
    if (argc < 2) return true;
    for (int i = 1; i < argc; ++i)
      if (std::strcmp(argv[i], section) == 0) return true;
    return false;
  };
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  gc::prepare_kernels();
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  gc::Launcher l;
  l.stream = s;
  // Launched as the backend launches them: with programmatic dependent launch on sm_90+.
  l.pdl = gc::use_programmatic_launch(prop);
  std::printf("programmatic dependent launch: %s\n", l.pdl ? "on" : "off");
  std::mt19937 rng(1);
  Events ev;

  std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20);
  const double copy = copy_tb_s(s);
  std::printf("device-to-device copy: %.2f TB/s (read + write)\n\n", copy);

  // ---- mat-vec -----------------------------------------------------------------------------
  if (want("matvec")) {
    std::printf(
        "| mat-vec | k x n | cols | weight MB | us | GB/s | %% of copy | us (graph) | %% of copy "
        "(graph) |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|\n");
    const KN shapes[] = {{4096, 11008}, {11008, 4096}, {4096, 4096}, {576, 1536}};
    const DType types[] = {DType::Q4_0,   DType::Q4_1,   DType::Q8_0, DType::Q4_K, DType::Q5_K,
                           DType::Q6_K,   DType::Q5_0,   DType::Q5_1, DType::Q2_K, DType::Q3_K,
                           DType::IQ4_NL, DType::IQ4_XS, DType::F16,  DType::BF16};
    for (DType t : types) {
      for (KN sh : shapes) {
        if (sh.k % gc::block_elems(t) != 0) continue;  // 576 is no multiple of a K-quant block
        const auto host = random_weights(t, sh.k, sh.n, rng);
        const double mb = host.size() / 1e6;
        const std::vector<void*> w = copies_past_l2(host, t);
        const int copies = int(w.size());
        for (int cols : {1, 2, 4, 8}) {
          const bool q = gc::is_quantized(t);
          // One column of a quantized type: every kernel shape (rows per warp, pieces in
          // flight), the automatic choice first.
          // Each with every way of overlapping the launch before it (MatVecConfig::overlap).
          std::vector<gc::MatVecConfig> configs = {{0, 0}};
          if (q && cols == 1) {
            const gc::MatVecConfig shapes_[] = {{0, 0},    {1, 4, 1}, {2, 4, 1}, {4, 2, 1},
                                                {4, 2, 2}, {4, 2, 4}, {2, 4, 2}, {2, 2, 4}};
            for (gc::MatVecConfig c : shapes_) {
              for (int o = 0; o < 4; ++o) {
                c.overlap = o;
                configs.push_back(c);
              }
            }
          }
          for (const gc::MatVecConfig& c : configs) {
            gc::set_mat_vec_config(c);
            float* x = device_randn(size_t(sh.k) * cols, rng);
            float* dst = nullptr;
            CHECK(cudaMalloc(&dst, size_t(sh.n) * cols * sizeof(float)));
            uint8_t* ws = nullptr;
            CHECK(cudaMalloc(&ws, gc::act_q8_bytes(sh.k, cols)));
            if (q) gc::launch_quantize_act(l, x, sh.k, cols, ws);
            auto mv = [&](int i) {
              gc::MatVecPart part{w[i % copies], sh.n, dst, /*fixed=*/true};
              gc::launch_mat_vec(l, t, &part, 1, sh.k, x, ws, cols);
            };
            const double ms = ev.time_ms(s, 200, mv);
            const double gms = ev.graph_ms(s, 200, mv);
            std::string shape = c.rows ? std::to_string(c.rows) + "x" + std::to_string(c.unroll) +
                                             "/" + std::to_string(c.ksplit)
                                       : "";
            if (c.overlap >= 0) shape += (c.rows ? " o" : "o") + std::to_string(c.overlap);
            if (!shape.empty()) shape = " (" + shape + ")";
            std::printf("| %s%s | %lldx%lld | %d | %.1f | %.2f | %.0f | %.0f | %.2f | %.0f |\n",
                        gc::dtype_name(t), shape.c_str(), (long long)sh.k, (long long)sh.n, cols,
                        mb, ms * 1e3, host.size() / (ms * 1e-3) / 1e9,
                        100.0 * host.size() / (ms * 1e-3) / (copy * 1e12), gms * 1e3,
                        100.0 * host.size() / (gms * 1e-3) / (copy * 1e12));
            cudaFree(x);
            cudaFree(dst);
            cudaFree(ws);
          }
          gc::set_mat_vec_config({0, 0});
        }
        for (void* p : w) cudaFree(p);
      }
    }
    {
      float* x = device_randn(4096, rng);
      uint8_t* ws = nullptr;
      CHECK(cudaMalloc(&ws, gc::act_q8_bytes(4096, 1)));
      const double ms =
          ev.time_ms(s, 200, [&](int) { gc::launch_quantize_act(l, x, 4096, 1, ws); });
      std::printf("\nactivation quantization, k 4096, 1 column: %.2f us per launch\n", ms * 1e3);
      cudaFree(x);
      cudaFree(ws);
    }
  }

  // ---- decode batches: each product kernel of a few columns ------------------------------------
  if (want("decode")) {
    std::printf(
        "\n| decode product | k x n | cols | kernel | us (graph) | GB/s | %% of copy |\n"
        "|---|---|---|---|---|---|---|\n");
    const KN shapes[] = {{4096, 4096}, {4096, 11008}, {11008, 4096}, {576, 1536}};
    for (DType t : {DType::Q4_0, DType::Q4_1, DType::Q4_K}) {
      if (!env_lists("BENCH_TYPES", gc::dtype_name(t))) continue;
      for (KN sh : shapes) {
        if (sh.k % gc::block_elems(t) != 0) continue;
        const auto host = random_weights(t, sh.k, sh.n, rng);
        const std::vector<void*> w = copies_past_l2(host, t);
        const int copies = int(w.size());
        for (int cols : {2, 4, 8, 16, 32, 64}) {
          if (!env_lists("BENCH_COLS", std::to_string(cols))) continue;
          float* x = device_randn(size_t(sh.k) * cols, rng);
          // Room for three products' outputs, partials and counters: a launch of three parts
          // (q, k and v) is measured too.
          float* dst = nullptr;
          CHECK(cudaMalloc(&dst, size_t(3) * sh.n * cols * sizeof(float)));
          // The workspaces of every kind: activations, partials, counters (zeroed).
          uint8_t* ws = nullptr;
          CHECK(cudaMalloc(
              &ws, std::max({gc::act_q8_bytes(sh.k, cols), gc::act_q8_tiles_bytes(sh.k, cols),
                             gc::act_half_bytes(sh.k, cols)})));
          float* partials = nullptr;
          unsigned* counters = nullptr;
          CHECK(cudaMalloc(&partials, size_t(3 * 8) * sh.n * cols * sizeof(float)));
          CHECK(cudaMalloc(&counters, size_t(3) * sh.n * sizeof(unsigned)));
          CHECK(cudaMemset(counters, 0, size_t(3) * sh.n * sizeof(unsigned)));
          auto report = [&](const std::string& kernel, double ms, int parts = 1) {
            const double bytes = double(host.size()) * parts;
            std::printf("| %s | %lldx%lld%s | %d | %s | %.2f | %.0f | %.0f |\n", gc::dtype_name(t),
                        (long long)sh.k, (long long)sh.n,
                        parts > 1 ? (" x" + std::to_string(parts)).c_str() : "", cols,
                        kernel.c_str(), ms * 1e3, bytes / (ms * 1e-3) / 1e9,
                        100.0 * bytes / (ms * 1e-3) / (copy * 1e12));
          };
          if (cols <= gc::kMatVecMaxCols) {
            gc::launch_quantize_act(l, x, sh.k, cols, ws);
            report("mat-vec", ev.graph_ms(s, 200, [&](int i) {
              gc::MatVecPart part{w[i % copies], sh.n, dst, /*fixed=*/true};
              gc::launch_mat_vec(l, t, &part, 1, sh.k, x, ws, cols);
            }));
          }
          const std::pair<gc::MatMulQ, const char*> kinds[] = {{gc::MatMulQ::Int8, "int8"},
                                                               {gc::MatMulQ::Int8Warp, "int8 warp"},
                                                               {gc::MatMulQ::Half, "half"}};
          for (auto [kind, name] : kinds) {
            gc::set_mat_mul_q_everywhere(kind);
            if (gc::mat_mul_q_kind(t, sh.k, cols) != kind) continue;
            if (kind == gc::MatMulQ::Int8) gc::launch_quantize_act(l, x, sh.k, cols, ws);
            if (kind == gc::MatMulQ::Int8Warp) gc::launch_quantize_act_tiles(l, x, sh.k, cols, ws);
            if (kind == gc::MatMulQ::Half) gc::launch_act_to_half(l, x, sh.k, cols, ws, false);
            report(name, ev.graph_ms(s, 200, [&](int i) {
              const gc::MatMulQPart part{w[i % copies], sh.n, dst};
              gc::launch_mat_mul_q(l, t, &part, 1, sh.k, ws, cols, partials, counters);
            }));
            // Several products of the activation in one launch, as the 7B shape's layers launch
            // them: q, k and v (4096 x 4096 three times), gate and up (4096 x 11008 twice).
            const int n_parts = sh.n == 4096 ? 3 : 2;
            if (sh.k == 4096 && cols >= 8)
              report(name,
                     ev.graph_ms(s, 200,
                                 [&](int i) {
                                   gc::MatMulQPart parts[3];
                                   for (int p = 0; p < n_parts; ++p)
                                     parts[p] = {w[(n_parts * i + p) % copies], sh.n,
                                                 dst + size_t(p) * sh.n * cols};
                                   gc::launch_mat_mul_q(l, t, parts, n_parts, sh.k, ws, cols,
                                                        partials, counters);
                                 }),
                     n_parts);
          }
          gc::set_mat_mul_q_everywhere(gc::MatMulQ::None);
          cudaFree(x);
          cudaFree(dst);
          cudaFree(ws);
          cudaFree(partials);
          cudaFree(counters);
        }
        for (void* p : w) cudaFree(p);
      }
    }
  }

  // ---- tiled mat-mul ------------------------------------------------------------------------
  if (want("matmul")) {
    std::printf("\n| mat-mul | k x n | cols | us | TFLOP/s |\n|---|---|---|---|---|\n");
    for (DType t :
         {DType::Q4_0, DType::Q4_1, DType::Q8_0, DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::Q5_0,
          DType::Q2_K, DType::Q3_K, DType::IQ4_NL, DType::IQ4_XS, DType::F16}) {
      for (KN sh : {KN{4096, 4096}, KN{4096, 11008}, KN{11008, 4096}, KN{576, 1536}}) {
        if (sh.k % gc::block_elems(t) != 0) continue;
        const int cols = 512;
        const auto host = random_weights(t, sh.k, sh.n, rng);
        void* w = device_copy_of(host, t);
        const PromptBuffers b(l, sh, cols, rng);
        const double ms = ev.time_ms(
            s, 20, [&](int) { gc::launch_mat_mul_tc(l, t, w, sh.n, sh.k, b.half, cols, b.dst); });
        std::printf("| %s | %lldx%lld | %d | %.1f | %.1f |\n", gc::dtype_name(t), (long long)sh.k,
                    (long long)sh.n, cols, ms * 1e3, 2.0 * sh.k * sh.n * cols / (ms * 1e-3) / 1e12);
        cudaFree(w);
      }
    }
  }

  // ---- F16 and BF16 prompt products: the tiled kernel against cuBLAS -------------------------
  if (want("gemm")) {
    std::string why;
    const auto blas = gc::Blas::create(s, &why);
    if (!blas) std::printf("\ncuBLAS: not usable (%s)\n", why.c_str());
    std::printf(
        "\n| prompt product | k x n | cols | tiled us | cuBLAS us | tiled TFLOP/s | cuBLAS TFLOP/s "
        "|\n|---|---|---|---|---|---|---|\n");
    // The 1B F16 shape's products (q, kv, o, gate/up, down), the 7B shape's, SmolLM2's.
    const KN kns[] = {{2048, 2048}, {2048, 512},   {2048, 8192},  {8192, 2048},
                      {4096, 4096}, {4096, 11008}, {11008, 4096}, {576, 1536}};
    for (DType t : {DType::F16, DType::BF16}) {
      for (KN sh : kns) {
        const auto host = random_weights(t, sh.k, sh.n, rng);
        void* w = device_copy_of(host, t);
        for (int cols : {16, 32, 64, 128, 512, 2048}) {
          const PromptBuffers b(l, sh, cols, rng);
          // cuBLAS reads BF16 weights against bfloat16 activations.
          uint8_t* wb = nullptr;
          CHECK(cudaMalloc(&wb, gc::act_half_bytes(sh.k, cols)));
          gc::launch_act_to_half(l, b.x, sh.k, cols, wb, t == DType::BF16);
          const int reps = cols >= 512 ? 20 : 100;
          const double tiled = ev.time_ms(s, reps, [&](int) {
            gc::launch_mat_mul_tc(l, t, w, sh.n, sh.k, b.half, cols, b.dst);
          });
          const double cub =
              blas ? ev.time_ms(s, reps,
                                [&](int) {
                                  blas->gemm(l, t, w, sh.k, sh.n, sh.k, wb,
                                             gc::act_half_pitch(sh.k), cols, b.dst, sh.n);
                                })
                   : 0.0;
          const double flop = 2.0 * sh.k * sh.n * cols;
          std::printf("| %s | %lldx%lld | %d | %.1f | %.1f | %.1f | %.1f |\n", gc::dtype_name(t),
                      (long long)sh.k, (long long)sh.n, cols, tiled * 1e3, cub * 1e3,
                      flop / (tiled * 1e-3) / 1e12, cub > 0 ? flop / (cub * 1e-3) / 1e12 : 0.0);
          cudaFree(wb);
        }
        cudaFree(w);
      }
    }
    // Quantized weights: the tiled kernel against decoding to half a chunk of rows at a time
    // (launch_dequant_half) and cuBLAS, as the backend runs them.
    std::printf(
        "\n| prompt product | k x n | cols | tiled us | decode + cuBLAS us | tiled TFLOP/s | "
        "decode + cuBLAS TFLOP/s | decode alone us |\n|---|---|---|---|---|---|---|---|\n");
    for (DType t : {DType::Q4_0, DType::Q8_0, DType::Q4_K, DType::Q6_K}) {
      for (KN sh : {KN{4096, 4096}, KN{4096, 11008}, KN{11008, 4096}, KN{2048, 8192}}) {
        if (sh.k % gc::block_elems(t) != 0) continue;
        const auto host = random_weights(t, sh.k, sh.n, rng);
        void* w = device_copy_of(host, t);
        const int64_t kp = gc::act_half_pitch(sh.k), chunk = gc::dequant_chunk_rows(sh.k);
        uint8_t* deq = nullptr;
        CHECK(cudaMalloc(&deq, size_t(std::min<int64_t>(chunk, sh.n) * kp * 2)));
        for (int cols : {16, 32, 64, 128, 512, 2048}) {
          const PromptBuffers b(l, sh, cols, rng);
          const int reps = cols >= 512 ? 20 : 100;
          const double tiled = ev.time_ms(s, reps, [&](int) {
            gc::launch_mat_mul_tc(l, t, w, sh.n, sh.k, b.half, cols, b.dst);
          });
          const double cub =
              blas ? ev.time_ms(s, reps,
                                [&](int) {
                                  for (int64_t r0 = 0; r0 < sh.n; r0 += chunk) {
                                    const int64_t rows = std::min<int64_t>(chunk, sh.n - r0);
                                    gc::launch_dequant_half(l, t, w, sh.n, sh.k, r0, rows, deq);
                                    blas->gemm(l, DType::F16, deq, kp, rows, sh.k, b.half, kp, cols,
                                               b.dst + r0, sh.n);
                                  }
                                })
                   : 0.0;
          const double dec = ev.time_ms(s, reps, [&](int) {
            for (int64_t r0 = 0; r0 < sh.n; r0 += chunk)
              gc::launch_dequant_half(l, t, w, sh.n, sh.k, r0, std::min<int64_t>(chunk, sh.n - r0),
                                      deq);
          });
          const double flop = 2.0 * sh.k * sh.n * cols;
          std::printf("| %s | %lldx%lld | %d | %.1f | %.1f | %.1f | %.1f | %.1f |\n",
                      gc::dtype_name(t), (long long)sh.k, (long long)sh.n, cols, tiled * 1e3,
                      cub * 1e3, flop / (tiled * 1e-3) / 1e12,
                      cub > 0 ? flop / (cub * 1e-3) / 1e12 : 0.0, dec * 1e3);
        }
        cudaFree(deq);
        cudaFree(w);
      }
    }
  }

  // ---- attention --------------------------------------------------------------------------
  if (want("attention")) {
    std::printf(
        "\n| attention | heads | head_dim | tokens | n_kv | us | TFLOP/s |\n"
        "|---|---|---|---|---|---|---|\n");
    struct A {
      int n_head, n_head_kv, hd;
    };
    for (A a : {A{32, 32, 128}, A{32, 8, 128}, A{9, 3, 64}, A{4, 1, 256}}) {
      const int n_ctx = 4096;
      const size_t kv_elems = size_t(n_ctx) * a.n_head_kv * a.hd;
      std::vector<uint16_t> kv_host(kv_elems);
      std::normal_distribution<float> d(0.f, 1.f);
      for (auto& h : kv_host) h = ggraph::f32_to_f16(d(rng));
      void *kc = nullptr, *vc = nullptr;
      CHECK(cudaMalloc(&kc, kv_elems * 2));
      CHECK(cudaMalloc(&vc, kv_elems * 2));
      CHECK(cudaMemcpy(kc, kv_host.data(), kv_elems * 2, cudaMemcpyHostToDevice));
      CHECK(cudaMemcpy(vc, kv_host.data(), kv_elems * 2, cudaMemcpyHostToDevice));
      float* part = nullptr;
      unsigned* counters = nullptr;
      CHECK(cudaMalloc(&part, gc::attn_partials_bytes(a.n_head, a.hd, 1)));
      CHECK(cudaMalloc(&counters, gc::attn_counters_bytes(a.n_head, 1)));
      CHECK(cudaMemset(counters, 0, gc::attn_counters_bytes(a.n_head, 1)));
      for (int tokens : {1, 512, 4096}) {
        float* q = device_randn(size_t(a.n_head) * a.hd * tokens, rng);
        float* out = nullptr;
        CHECK(cudaMalloc(&out, size_t(a.n_head) * a.hd * tokens * sizeof(float)));
        for (int n_kv : {128, 512, 1024, 4096}) {
          if (tokens > 1 && n_kv < tokens) continue;
          gc::AttentionArgs args;
          args.q = q;
          args.k_cache = kc;
          args.v_cache = vc;
          args.out = out;
          args.n_head = a.n_head;
          args.n_head_kv = a.n_head_kv;
          args.head_dim = a.hd;
          args.scale = 0.1f;
          args.n_tokens = tokens;
          args.n_kv = n_kv;
          args.first_pos = n_kv - tokens;
          args.cache_rows = n_ctx;
          args.partials = part;
          args.counters = counters;
          const double ms = ev.time_ms(s, 50, [&](int) { gc::launch_attention(l, args); });
          // Two products of head_dim multiply-adds per visible (query, key) pair.
          const double pairs = double(tokens) * (n_kv - tokens) + double(tokens) * (tokens + 1) / 2;
          std::printf("| %s | %d/%d | %d | %d | %d | %.1f | %.1f |\n",
                      tokens == 1 ? "decode" : "prompt", a.n_head, a.n_head_kv, a.hd, tokens, n_kv,
                      ms * 1e3, 4.0 * a.hd * a.n_head * pairs / (ms * 1e9));
        }
        cudaFree(q);
        cudaFree(out);
      }
      cudaFree(kc);
      cudaFree(vc);
      cudaFree(part);
      cudaFree(counters);
    }
  }

  // ---- launch cost of a tiny kernel ----------------------------------------------------------
  if (want("launch")) {
    float* x = device_randn(576, rng);
    gc::NormArgs a;
    a.src = x;
    a.dst = x;
    const double ms = ev.time_ms(s, 1000, [&](int) { gc::launch_rms_norm(l, a, 576, 1, 1e-5f); });
    std::printf("\nback-to-back tiny kernel (rms_norm 576x1): %.2f us per launch\n", ms * 1e3);
    cudaFree(x);
  }
  if (want("barrier")) {
    // A SmolLM2 decode step launches 274 kernels: that many boundaries, against that many
    // barriers inside one kernel of a block an SM.
    constexpr int kPhases = 274;
    const int blocks = prop.multiProcessorCount;
    float* x = nullptr;
    unsigned* sync = nullptr;
    CHECK(cudaMalloc(&x, blocks * sizeof(float)));
    CHECK(cudaMalloc(&sync, 2 * sizeof(unsigned)));
    CHECK(cudaMemset(x, 0, blocks * sizeof(float)));
    CHECK(cudaMemset(sync, 0, 2 * sizeof(unsigned)));
    const double graph = ev.graph_ms(
        s, kPhases, [&](int) { l(boundary_kernel, dim3(blocks), dim3(256), 0, x, 1.0f); });
    int phases = kPhases;
    unsigned* count = sync;
    unsigned* generation = sync + 1;
    void* args[] = {&x, &phases, &count, &generation};
    const double one = ev.time_ms(s, 20, [&](int) {
      CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(barrier_kernel), dim3(blocks),
                                        dim3(256), args, 0, s));
    });
    std::printf("\n%d kernels of %d blocks replayed from a graph: %.2f us a boundary\n", kPhases,
                blocks, graph * 1e3);
    std::printf("one kernel of %d blocks with %d grid barriers: %.2f us a barrier\n", blocks,
                kPhases, one * 1e3 / kPhases);
    cudaFree(x);
    cudaFree(sync);
  }
  if (want("cluster") && prop.major >= 9) {
    // The same 274 phases inside one kernel, each a cluster's barrier after an all-gather
    // through distributed shared memory: one cluster, and as many as the GPU holds at once, of
    // blocks of 128 and of 1,024 threads.
    constexpr int kPhases = 274, kMaxThreads = 1024;
    const int max_blocks = 2 * prop.multiProcessorCount;  // two blocks of 1,024 threads an SM
    float* x = nullptr;
    CHECK(cudaMalloc(&x, static_cast<size_t>(max_blocks) * kMaxThreads * sizeof(float) * 8));
    CHECK(cudaFuncSetAttribute(cluster_phases_kernel,
                               cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    std::printf("\n");
    for (int threads : {128, kMaxThreads}) {
      for (int c : {2, 8, 16}) {
        ClusterLaunch launch(c, threads, 0, s);
        cudaLaunchConfig_t& cfg = launch.cfg;
        int most = 0;
        if (cudaOccupancyMaxActiveClusters(&most, cluster_phases_kernel, &cfg) != cudaSuccess ||
            most < 1) {
          cudaGetLastError();
          std::printf("clusters of %d blocks: not launchable here\n", c);
          continue;
        }
        most = std::min(most, max_blocks * 8 / c);
        for (int clusters : {1, most}) {
          cfg.gridDim = dim3(c * clusters);
          for (int w : {1, std::min(576, threads) / c}) {
            auto run = [&](int phases) {
              return ev.time_ms(s, 20, [&](int) {
                CHECK(cudaLaunchKernelEx(&cfg, cluster_phases_kernel, x, phases, w));
              });
            };
            const double per = (run(kPhases) - run(1)) / (kPhases - 1);
            std::printf(
                "%d cluster(s) of %d blocks of %d threads, %d values a block to each a phase: "
                "%.2f us a phase\n",
                clusters, c, threads, w, per * 1e3);
          }
        }
      }
    }
    cudaFree(x);
  }
  if (want("cluster") && prop.major >= 9) {
    // SmolLM2's 30 layers in one cluster of 16 blocks (cluster_layers_kernel).
    const size_t bytes = static_cast<size_t>(cl::kLayers * cl::kLayerBytes);
    int8_t* w = nullptr;
    float* out = nullptr;
    CHECK(cudaMalloc(&w, bytes));
    CHECK(cudaMalloc(&out, cl::kC * cl::kEmbd * sizeof(float)));
    CHECK(cudaMemset(w, 1, bytes));
    CHECK(cudaFuncSetAttribute(cluster_layers_kernel,
                               cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    CHECK(cudaFuncSetAttribute(cluster_layers_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(cl::kSmem)));
    ClusterLaunch launch(cl::kC, cl::kThreads, cl::kSmem, s);
    const cudaLaunchConfig_t& cfg = launch.cfg;
    for (int stream : {1, 0}) {
      const double ms = ev.time_ms(s, 20, [&](int) {
        CHECK(cudaLaunchKernelEx(&cfg, cluster_layers_kernel, static_cast<const int8_t*>(w), out,
                                 stream));
      });
      std::printf(
          "%d SmolLM2-shaped layers in one cluster of %d blocks (8-bit weights, %.1f MB%s, no "
          "output product): %.1f us a step, %.2f us a layer (%.2f us a phase)\n",
          cl::kLayers, cl::kC, bytes / 1e6, stream ? "" : ", not read: the same in shared memory",
          ms * 1e3, ms * 1e3 / cl::kLayers, ms * 1e3 / cl::kLayers / 5);
    }
    cudaFree(w);
    cudaFree(out);
  }
  CHECK(cudaStreamDestroy(s));
  return 0;
}
