// Speed of the CPU mat-mul kernels: mat-vec bandwidth, tile throughput and a SmolLM2-135M-shaped
// pass over every weight matrix, for decode (one column) and for a 512-token prompt.
//
//   ggraph_bench_quant [--scalar | --avx2] [--quick]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "quant.h"
#include "quant_impl.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace {

using ggraph::DType;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// CPU time of the calling thread: on a machine shared with other work, time spent descheduled
// does not count against single-threaded kernels.
double thread_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// Seconds per call of fn: the fastest of batches of about 50 ms within min_s seconds, measured in
// wall time or in this thread's CPU time.
double time_per_call(const std::function<void()>& fn, double min_s, bool cpu_time = true) {
  fn();
  const auto start = Clock::now();
  double best = 1e30;
  do {
    int reps = 0;
    const auto t0 = Clock::now();
    const double c0 = thread_seconds();
    double elapsed = 0;
    do {
      fn();
      ++reps;
      elapsed = cpu_time ? thread_seconds() - c0 : seconds_since(t0);
    } while (elapsed < 0.05);
    best = std::min(best, elapsed / reps);
  } while (seconds_since(start) < min_s);
  return best;
}

struct Matrix {
  DType type;
  int64_t k, rows;
  size_t stride;
  std::vector<uint8_t> data;
};

// Offsets of the f16 fields of formats ggraph has no quantizer for (ggml's block structs).
std::vector<int> half_fields(DType type) {
  switch (type) {
    case DType::Q5_0:
    case DType::IQ4_NL:
    case DType::IQ4_XS:
    case DType::Q6_K:
      return {type == DType::Q6_K ? 208 : 0};
    case DType::Q5_1:
    case DType::Q4_K:
    case DType::Q5_K:
      return {0, 2};
    case DType::Q2_K:
      return {80, 82};
    case DType::Q3_K:
      return {108};
    default:
      return {};
  }
}

bool has_quantizer(DType type) {
  return type == DType::F32 || type == DType::F16 || type == DType::BF16 || type == DType::Q8_0 ||
         type == DType::Q4_0 || type == DType::Q4_1;
}

Matrix random_matrix(DType type, int64_t k, int64_t rows, std::mt19937& rng) {
  Matrix m{type, k, rows, ggraph::row_size(type, k), {}};
  m.data.resize(m.stride * rows);
  if (!has_quantizer(type)) {
    // Random quants with small finite scales: speed does not depend on the values.
    const auto& traits = ggraph::type_traits(type);
    std::uniform_int_distribution<int> byte(0, 255);
    for (uint8_t& b : m.data) b = static_cast<uint8_t>(byte(rng));
    const uint16_t scale = ggraph::f32_to_f16(1e-3f);
    for (size_t off = 0; off < m.data.size(); off += traits.type_size) {
      for (int h : half_fields(type)) std::memcpy(m.data.data() + off + h, &scale, 2);
    }
    return m;
  }
  std::normal_distribution<float> dist(0.0f, 0.05f);
  std::vector<float> row(k);
  for (int64_t r = 0; r < rows; ++r) {
    for (float& v : row) v = dist(rng);
    ggraph::quantize_row(type, row.data(), m.data.data() + r * m.stride, k);
  }
  return m;
}

struct Activations {
  size_t stride;
  std::vector<uint8_t> data;
};

Activations prepared(DType type, int64_t k, int64_t n_cols, std::mt19937& rng) {
  Activations a{ggraph::act_row_size(type, k), {}};
  a.data.resize(a.stride * n_cols);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> col(k);
  for (int64_t c = 0; c < n_cols; ++c) {
    for (float& v : col) v = dist(rng);
    ggraph::prepare_act(type, col.data(), a.data.data() + c * a.stride, k);
  }
  return a;
}

// Reading 256 MB with plain 64-bit adds: the memory bandwidth one thread gets right now, to judge
// the memory-bound mat-vec numbers against (other work on the machine lowers both).
void bench_stream(double min_s) {
  std::vector<uint64_t> buf((size_t(256) << 20) / 8, 1);
  uint64_t sink = 0;
  const double t = time_per_call(
      [&] {
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        for (size_t i = 0; i < buf.size(); i += 4) {
          s0 += buf[i];
          s1 += buf[i + 1];
          s2 += buf[i + 2];
          s3 += buf[i + 3];
        }
        sink += s0 + s1 + s2 + s3;
      },
      min_s);
  std::printf("  plain read of 256 MB                        %7.2f GB/s  (checksum %llu)\n",
              double(buf.size() * 8) / t / 1e9, (unsigned long long)(sink % 10));
}

#if defined(__x86_64__) && defined(__GNUC__)
// The 8-bit dot instructions' own rates on this core, 8 independent chains: the ceilings of
// the tiles, to judge their GFLOP/s against. Each steps function returns a checksum of its
// chains: their first lanes summed.
constexpr int kVnniChains = 8, kVnniSteps = 1 << 16;
template <typename Lane, typename V>
int first_lanes(const V (&acc)[kVnniChains]) {
  int sum = 0;
  for (const V& v : acc) {
    Lane lane;
    std::memcpy(&lane, &v, sizeof lane);
    sum += lane;
  }
  return sum;
}
// The AVX512-VNNI tiles': vpdpbusd on 512-bit registers, 64 multiply-adds each.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) int vnni_steps(int seed) {
  __m512i acc[kVnniChains];
  for (int j = 0; j < kVnniChains; ++j) acc[j] = _mm512_set1_epi32(seed + j);
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  for (int i = 0; i < kVnniSteps; ++i) {
    for (int j = 0; j < kVnniChains; ++j) acc[j] = _mm512_dpbusd_epi32(acc[j], a, b);
    asm volatile(""
                 : "+v"(acc[0]), "+v"(acc[1]), "+v"(acc[2]), "+v"(acc[3]), "+v"(acc[4]),
                   "+v"(acc[5]), "+v"(acc[6]), "+v"(acc[7]));
  }
  return first_lanes<int32_t>(acc);
}
// The AVX2 tiles': vpmaddubsw (32 byte products summed in pairs) with its 16-bit add; an AVX2
// tile also widens, scales and unpacks between these.
__attribute__((target("avx2"))) int maddubs_steps(int seed) {
  __m256i acc[kVnniChains];
  for (int j = 0; j < kVnniChains; ++j) acc[j] = _mm256_set1_epi16(short(seed + j));
  const __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5);
  for (int i = 0; i < kVnniSteps; ++i) {
    for (int j = 0; j < kVnniChains; ++j)
      acc[j] = _mm256_add_epi16(acc[j], _mm256_maddubs_epi16(a, b));
    asm volatile(""
                 : "+x"(acc[0]), "+x"(acc[1]), "+x"(acc[2]), "+x"(acc[3]), "+x"(acc[4]),
                   "+x"(acc[5]), "+x"(acc[6]), "+x"(acc[7]));
  }
  return first_lanes<int16_t>(acc);
}
// Times `steps` (multiply-adds a chain's step: macs) and prints its rate after `label`.
void bench_dot_peak(const char* label, int (*steps)(int), int macs, double min_s) {
  int sink = 0;
  const double t = time_per_call([&] { sink += steps(sink & 1); }, min_s);
  std::printf("  %s %7.1f GFLOP/s  (checksum %d)\n", label,
              2.0 * macs * kVnniChains * kVnniSteps / t / 1e9, sink % 10);
}
void bench_vnni_peak(double min_s) {
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bw")) return;
  bench_dot_peak("8-bit dots (vpdpbusd, 512 bits), the tiles' ceiling ", vnni_steps, 64, min_s);
}
void bench_maddubs_peak(double min_s) {
  if (!__builtin_cpu_supports("avx2")) return;
  bench_dot_peak("8-bit dots (vpmaddubsw, 256 bits), the AVX2 tiles' ceiling", maddubs_steps, 32,
                 min_s);
}
#else
void bench_vnni_peak(double) {}
void bench_maddubs_peak(double) {}
#endif

// Mat-vec over `copies` distinct matrices in turn, so that with enough copies the weights come
// from memory as in decoding a model larger than the last-level cache.
void bench_matvec(DType type, int64_t k, int64_t rows, int copies, double min_s,
                  std::mt19937& rng) {
  std::vector<Matrix> ms;
  for (int i = 0; i < copies; ++i) ms.push_back(random_matrix(type, k, rows, rng));
  Activations a = prepared(type, k, 1, rng);
  std::vector<float> out(rows);
  int next = 0;
  const double t = time_per_call(
      [&] {
        const Matrix& m = ms[next];
        next = (next + 1) % copies;
        ggraph::mul_mat_tile(type, k, m.data.data(), m.stride, int(rows), a.data.data(), a.stride,
                             1, out.data(), rows);
      },
      min_s);
  const double bytes = double(ms[0].data.size());
  std::printf("  matvec %-6s k=%-5lld rows=%-6lld %-6s %7.2f GB/s  %8.1f us\n",
              ggraph::type_name(type), (long long)k, (long long)rows,
              copies > 1 ? "memory" : "cache", bytes / t / 1e9, t * 1e6);
}

// Tiles of tile_rows x n_cols over a k x rows matrix and 64 columns, as the CPU backend calls them.
void bench_tiles(DType type, int64_t k, int64_t rows, int tile_rows, int n_cols, double min_s,
                 std::mt19937& rng) {
  const int64_t total_cols = 64;
  Matrix m = random_matrix(type, k, rows, rng);
  Activations a = prepared(type, k, total_cols, rng);
  std::vector<float> out(rows * total_cols);
  const double t = time_per_call(
      [&] {
        for (int64_t r = 0; r < rows; r += tile_rows) {
          const int nr = int(std::min<int64_t>(tile_rows, rows - r));
          for (int64_t c = 0; c < total_cols; c += n_cols) {
            const int nc = int(std::min<int64_t>(n_cols, total_cols - c));
            ggraph::mul_mat_tile(type, k, m.data.data() + r * m.stride, m.stride, nr,
                                 a.data.data() + c * a.stride, a.stride, nc,
                                 out.data() + c * rows + r, rows);
          }
        }
      },
      min_s);
  std::printf("  tiles  %-6s k=%-5lld rows=%-5lld tile %2dx%d  %7.1f GFLOP/s\n",
              ggraph::type_name(type), (long long)k, (long long)rows, tile_rows, n_cols,
              2.0 * k * rows * total_cols / t / 1e9);
}

// The weight matrices of SmolLM2-135M: 30 layers of q, k, v, o, gate, up, down in Q4_1 and the
// tied 49152 x 576 Q8_0 output matrix. Only the mat-muls are timed, split over threads by rows.
struct ModelWeights {
  std::vector<Matrix> ms;
  // Weights (k x rows) of all the matrices.
  int64_t params() const {
    int64_t n = 0;
    for (const Matrix& m : ms) n += m.k * m.rows;
    return n;
  }
};

ModelWeights smollm2_weights(std::mt19937& rng) {
  ModelWeights w;
  for (int l = 0; l < 30; ++l) {
    w.ms.push_back(random_matrix(DType::Q4_1, 576, 576, rng));
    w.ms.push_back(random_matrix(DType::Q4_1, 576, 192, rng));
    w.ms.push_back(random_matrix(DType::Q4_1, 576, 192, rng));
    w.ms.push_back(random_matrix(DType::Q4_1, 576, 576, rng));
    w.ms.push_back(random_matrix(DType::Q4_1, 576, 1536, rng));
    w.ms.push_back(random_matrix(DType::Q4_1, 576, 1536, rng));
    w.ms.push_back(random_matrix(DType::Q4_1, 1536, 576, rng));
  }
  w.ms.push_back(random_matrix(DType::Q8_0, 576, 49152, rng));
  return w;
}

// One pass over all matrices with n_cols columns on n_threads threads (each thread takes a
// contiguous share of every matrix's rows; a barrier-free split, as the weights dominate).
double model_pass(const ModelWeights& w, int n_cols, int n_threads, int tile_rows, int tile_cols,
                  bool with_output, std::mt19937& rng) {
  Activations a576 = prepared(DType::Q4_1, 576, n_cols, rng);
  Activations a1536 = prepared(DType::Q4_1, 1536, n_cols, rng);
  std::vector<float> out(size_t(49152) * n_cols);
  auto run = [&](int tid) {
    for (size_t i = 0; i < w.ms.size(); ++i) {
      const Matrix& m = w.ms[i];
      if (!with_output && m.rows == 49152) continue;
      const Activations& a = m.k == 576 ? a576 : a1536;
      const int64_t r0 = m.rows * tid / n_threads, r1 = m.rows * (tid + 1) / n_threads;
      if (tile_rows == 0) {
        ggraph::mul_mat_tile(m.type, m.k, m.data.data() + r0 * m.stride, m.stride, int(r1 - r0),
                             a.data.data(), a.stride, n_cols, out.data() + r0, m.rows);
        continue;
      }
      for (int64_t r = r0; r < r1; r += tile_rows) {
        const int nr = int(std::min<int64_t>(tile_rows, r1 - r));
        for (int c = 0; c < n_cols; c += tile_cols) {
          const int nc = std::min(tile_cols, n_cols - c);
          ggraph::mul_mat_tile(m.type, m.k, m.data.data() + r * m.stride, m.stride, nr,
                               a.data.data() + c * a.stride, a.stride, nc,
                               out.data() + c * m.rows + r, m.rows);
        }
      }
    }
  };
  auto once = [&] {
    std::vector<std::thread> threads;
    for (int t = 1; t < n_threads; ++t) threads.emplace_back(run, t);
    run(0);
    for (std::thread& t : threads) t.join();
  };
  // One thread: its CPU time; several: wall time, which is what a token costs.
  return time_per_call(once, n_cols == 1 ? 3.0 : 6.0, /*cpu_time=*/n_threads == 1);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--scalar") == 0) ggraph::force_scalar_kernels(true);
    if (std::strcmp(argv[i], "--avx2") == 0) {
      if (!ggraph::quant_impl::cpu_supports(ggraph::quant_impl::avx2_kernels())) {
        std::fprintf(stderr, "AVX2 kernels are not available on this CPU or build\n");
        return 1;
      }
      ggraph::quant_impl::use_kernels(ggraph::quant_impl::avx2_kernels());
    }
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
  }
  const double min_s = quick ? 0.2 : 1.0;
  std::mt19937 rng(1234);
  std::printf("kernels: %s\n", ggraph::cpu_features());

  std::printf("mat-vec, 1 thread (weight bytes / thread CPU time):\n");
  bench_stream(min_s);
  const int copies_small = 128;  // 128 x 0.55 MB: well past the last-level cache
  bench_matvec(DType::Q4_1, 576, 1536, 1, min_s, rng);
  bench_matvec(DType::Q4_1, 576, 1536, copies_small, min_s, rng);
  bench_matvec(DType::Q4_1, 1536, 576, 1, min_s, rng);
  bench_matvec(DType::Q4_1, 1536, 576, copies_small, min_s, rng);
  bench_matvec(DType::Q8_0, 576, 49152, 3, min_s, rng);
  bench_matvec(DType::Q4_0, 4096, 11008, 2, min_s, rng);
  bench_matvec(DType::F16, 576, 1536, 1, min_s, rng);
  bench_matvec(DType::F32, 576, 1536, 1, min_s, rng);

  std::printf("mat-vec of every format, 4096 x 11008 from memory, 1 thread:\n");
  for (DType t : {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::IQ4_NL,
                  DType::Q2_K, DType::Q3_K, DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_XS}) {
    bench_matvec(t, 4096, 11008, 2, min_s, rng);
  }

  std::printf("tiles of every format, 1 thread (k=1536, 576 rows, tiles 64x4 and 64x8):\n");
  bench_vnni_peak(min_s);
  bench_maddubs_peak(min_s);
  for (DType t : {DType::Q4_0, DType::Q5_0, DType::Q8_0, DType::IQ4_NL, DType::Q2_K, DType::Q3_K,
                  DType::Q4_K, DType::Q5_K, DType::Q6_K, DType::IQ4_XS}) {
    for (int nc : {4, 8}) bench_tiles(t, 1536, 576, 64, nc, min_s, rng);
  }

  std::printf("tiles, 1 thread (64 columns, 2*k*rows*cols / thread CPU time):\n");
  for (DType t : {DType::Q4_1, DType::Q4_0, DType::Q8_0}) {
    for (int nc : {1, 2, 4, 6, 8}) bench_tiles(t, 576, 1536, 64, nc, min_s, rng);
  }
  for (int nc : {4, 8}) bench_tiles(DType::Q4_1, 1536, 576, 64, nc, min_s, rng);
  for (int nr : {16, 32}) bench_tiles(DType::Q4_1, 576, 1536, nr, 4, min_s, rng);
  for (DType t : {DType::F32, DType::F16, DType::BF16})
    bench_tiles(t, 576, 1536, 64, 6, min_s, rng);
  if (quick) return 0;

  std::printf(
      "SmolLM2-135M mat-muls only (30 x q,k,v,o,gate,up,down Q4_1 + output Q8_0);\n"
      "1 thread: its CPU time, 2 threads: wall time (other work on the machine slows it):\n");
  ModelWeights w = smollm2_weights(rng);
  for (int threads : {1, 2}) {
    const double t = model_pass(w, 1, threads, 0, 1, true, rng);
    std::printf(
        "  decode, %d thread(s), each thread's rows in one call: %6.2f ms/token = %6.1f tok/s\n",
        threads, t * 1e3, 1.0 / t);
  }
  for (int threads : {1, 2}) {
    for (int tile_rows : {16, 64, 256}) {
      const double t = model_pass(w, 1, threads, tile_rows, 1, true, rng);
      std::printf("  decode, %d thread(s), calls of %3d rows: %6.2f ms/token = %6.1f tok/s\n",
                  threads, tile_rows, t * 1e3, 1.0 / t);
    }
  }
  // A decode batch's products read each weight once a step, where the tiles above reuse a
  // block's weights from the cache over the column groups: the gap between the two is what the
  // weights' trip from memory costs the tiles.
  for (int threads : {1, 2}) {
    for (int tile_rows : {0, 64}) {
      const double t = model_pass(w, 8, threads, tile_rows, 8, true, rng);
      std::printf("  decode batch of 8, %d thread(s), %s: %6.2f ms/step = %6.1f GFLOP/s\n", threads,
                  tile_rows ? "calls of 64 rows  " : "each thread's rows", t * 1e3,
                  2.0 * 8 * double(w.params()) / t / 1e9);
    }
  }
  const int prompt_tiles[][2] = {{16, 4}, {64, 4}, {64, 8}, {64, 512}};
  for (const auto& tile : prompt_tiles) {
    const double t = model_pass(w, 512, 2, tile[0], tile[1], false, rng);
    std::printf("  prompt 512, 2 threads, tiles %dx%d, no output matrix: %6.1f tok/s\n", tile[0],
                tile[1], 512 / t);
  }
  return 0;
}
