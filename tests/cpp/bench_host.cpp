// Host-side cost of one decode step's bookkeeping, without a GPU: building and planning the
// graph, and walking its CUDA launches in record mode (everything, or only the KV nodes').
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
  cuda::DeviceBuffers buf{};
  buf.scratch = scratch.data();
  buf.input = input.data();
  buf.act = act.data();
  buf.act_bytes = act.size();
  buf.attn = reinterpret_cast<float*>(attn.data());
  buf.attn_bytes = attn.size();
  std::vector<cuda::KernelLaunch> rec;
  rec.reserve(4096);
  std::vector<uint8_t> kv_nodes(g.nodes().size(), 0);
  for (const Tensor* t : g.nodes())
    kv_nodes[size_t(t->index)] = t->op == Op::Attention || t->op == Op::Rope;
  const char* names[] = {"walk only", "record all launches", "record KV nodes' launches"};
  for (int mode = 0; mode < 3; ++mode) {
    const int iters = 2000;
    t0 = Clock::now();
    for (int i = 0; i < iters; ++i) {
      rec.clear();
      cuda::Launcher l;
      l.execute = false;
      l.record = mode == 0 ? nullptr : &rec;
      l.record_only = mode == 2 ? &kv_nodes : nullptr;
      cuda::launch_graph(g, buf, l);
    }
    std::printf("launch_graph, %s: %.1f us (%zu launches recorded of %zu graph nodes)\n",
                names[mode], us_since(t0, iters), rec.size(), g.nodes().size());
  }
  return 0;
}
