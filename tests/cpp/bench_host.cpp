// Host-side cost of one decode step's bookkeeping, without a GPU: building and planning the
// graph, checking it, walking its CUDA launches in record mode, and what a step on the reused
// graph does instead in patch mode (recheck its KV nodes, record the KV record's launch).
//   ggraph_bench_host MODEL.gguf
#include <chrono>
#include <cstdio>
#include <vector>

#include "backend.h"
#include "cuda/kernels.cuh"
#include "cuda/launch.cuh"
#include "gguf.h"
#include "kv_cache.h"
#include "model.h"
#include "planner.h"

using namespace ggraph;
using Clock = std::chrono::steady_clock;

static double us_since(Clock::time_point t0, int iters) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / iters;
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s MODEL.gguf\n", argv[0]);
    return 2;
  }
  auto file = GGUFFile::open(argv[1]);
  auto backend = make_cpu_backend(1);  // weights stay in the file mapping: nothing runs
  auto model = load_model(*file, *backend);
  KvCache kv;
  kv.allocate(*backend, DType::F16, model->n_layer, model->kv_width, 1024);
  std::vector<int32_t> tokens = {1}, positions = {100}, out_ids = {0};
  Batch b;
  b.tokens = tokens.data();
  b.positions = positions.data();
  b.out_ids = out_ids.data();
  b.n_tokens = 1;
  b.n_outputs = 1;
  b.n_past = 100;

  const int build_iters = 200;
  auto t0 = Clock::now();
  for (int i = 0; i < build_iters; ++i) {
    Graph g;
    model->build(g, b, kv);
    plan(g);
  }
  std::printf("build + plan of a decode graph: %.1f us\n", us_since(t0, build_iters));

  Graph g;
  model->build(g, b, kv);
  plan(g);
  // Record mode never dereferences these: host buffers of plausible size stand in.
  std::vector<uint8_t> scratch(g.scratch_size + 4096), input(4096), act(64 << 20), attn(64 << 20);
  std::vector<unsigned> counters(1 << 16);
  cuda::DeviceBuffers buf{};
  buf.scratch = scratch.data();
  buf.input = input.data();
  buf.act = act.data();
  buf.act_bytes = act.size();
  buf.attn = reinterpret_cast<float*>(attn.data());
  buf.attn_bytes = attn.size();
  buf.attn_counters = counters.data();
  std::vector<int32_t> kv_record(cuda::kMaxKvSlots);
  buf.kv_record = kv_record.data();

  const int iters = 2000;
  t0 = Clock::now();
  for (int i = 0; i < iters; ++i) cuda::validate_graph(g);
  std::printf("validate_graph, every node: %.1f us (%zu graph nodes)\n", us_since(t0, iters),
              g.nodes().size());

  std::vector<cuda::KernelLaunch> rec;
  rec.reserve(4096);
  const char* names[] = {"walk only", "record all launches"};
  cuda::KvLayout layout;
  cuda::kv_layout(g, &layout);
  for (int mode = 0; mode < 2; ++mode) {
    t0 = Clock::now();
    for (int i = 0; i < iters; ++i) {
      rec.clear();
      cuda::Launcher l;
      l.execute = false;
      l.record = mode == 0 ? nullptr : &rec;
      cuda::launch_graph(g, layout, buf, l);
    }
    std::printf("launch_graph, %s: %.1f us (%zu launches recorded)\n", names[mode],
                us_since(t0, iters), rec.size());
  }

  // A step on the reused graph: Context shifts it to the next position; then (patch mode,
  // CudaBackend::compute) the checks of the nodes that read per-step values, the KV record's
  // values and its one launch, recorded for the executor to compare and patch.
  t0 = Clock::now();
  for (int i = 0; i < iters; ++i) g.shift_kv(i % 2 == 0 ? 1 : -1);
  std::printf("reused graph, shift_kv: %.2f us\n", us_since(t0, iters));
  cuda::ReusePlan reuse;
  cuda::plan_reuse(g, &reuse);
  bool kept = true;
  t0 = Clock::now();
  for (int i = 0; i < iters; ++i) {
    kept = cuda::check_reused(g, &reuse) && kept;
    rec.clear();
    cuda::Launcher l;
    l.execute = false;
    l.record = &rec;
    cuda::launch_kv_params(l, reuse.kv.values, buf.kv_record);
  }
  std::printf(
      "reused graph, checks + KV record's launch: %.2f us (%zu nodes rechecked, %zu KV values "
      "checked, %d KV slots, %zu launch recorded)\n",
      us_since(t0, iters), reuse.recheck.size(), reuse.kv_checks.size(), reuse.kv.n_slots,
      rec.size());
  if (!kept) {
    std::fprintf(stderr, "the reused graph needs a walk of its launches: not the fast path\n");
    return 1;
  }
  return 0;
}
