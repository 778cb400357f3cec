#include "planner.h"

#include <algorithm>
#include <iterator>
#include <map>
#include <vector>

namespace ggraph {

static size_t align_up(size_t n) {
  return (n + kPlanAlignment - 1) / kPlanAlignment * kPlanAlignment;
}

namespace {
// First-fit allocator over [0, high-water mark); free blocks kept sorted and merged.
class FreeList {
 public:
  size_t alloc(size_t size) {
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second >= size) {
        size_t offset = it->first;
        size_t rest = it->second - size;
        free_.erase(it);
        if (rest) free_[offset + size] = rest;
        return offset;
      }
    }
    // Grow, absorbing a free block that ends at the high-water mark.
    size_t offset = high_;
    if (!free_.empty()) {
      auto last = std::prev(free_.end());
      if (last->first + last->second == high_) {
        offset = last->first;
        free_.erase(last);
      }
    }
    high_ = offset + size;
    return offset;
  }
  void release(size_t offset, size_t size) {
    auto it = free_.emplace(offset, size).first;
    auto next = std::next(it);
    if (next != free_.end() && it->first + it->second == next->first) {
      it->second += next->second;
      free_.erase(next);
    }
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        free_.erase(it);
      }
    }
  }
  size_t high() const { return high_; }

 private:
  std::map<size_t, size_t> free_;  // offset -> size
  size_t high_ = 0;
};
}  // namespace

int norm_fold_reach(const std::vector<Tensor*>& nodes, int i) {
  const Tensor* norm = nodes[size_t(i)];
  if (norm->op != Op::RmsNorm || norm->ne[1] != 1 || norm->params[kNormGroup] != norm->ne[0])
    return i;
  const int n = static_cast<int>(nodes.size());
  int reach = i;
  std::vector<const Tensor*> level = {norm}, next;
  for (int depth = 0; depth < 3 && !level.empty(); ++depth) {
    next.clear();
    for (int j = i + 1; j < n; ++j) {
      const Tensor* t = nodes[size_t(j)];
      for (const Tensor* s : t->src) {
        if (s && std::find(level.begin(), level.end(), s) != level.end()) {
          next.push_back(t);
          reach = std::max(reach, j);
          break;
        }
      }
    }
    level.swap(next);
  }
  return reach;
}

void plan(Graph& graph, bool fold_room) {
  const auto& nodes = graph.nodes();
  const int n = static_cast<int>(nodes.size());
  std::vector<int> last_use(n, -1);
  for (const Tensor* t : nodes)
    for (const Tensor* s : t->src)
      if (s) last_use[s->index] = std::max(last_use[s->index], t->index);
  if (graph.output()) last_use[graph.output()->index] = n;  // never freed
  // Room for a backend to fold a decode step's norms into the products after them.
  for (int i = 0; fold_room && i < n; ++i) {
    const int reach = norm_fold_reach(nodes, i);
    if (reach == i) continue;
    const Tensor* in = nodes[size_t(i)]->src[0];
    auto keep = [&](const Tensor* s) {
      if (s) last_use[s->index] = std::max(last_use[s->index], reach);
    };
    keep(in);
    if (in->op == Op::Add && in->ne[1] == 1) {
      keep(in->src[0]);
      keep(in->src[1]);
    }
  }

  // A one-token rope (normal mode) of a product of a float model weight: the product's
  // activation stays allocated until the rope has run, so that a backend may rotate in the
  // product's epilogue while it still reads the activation (CUDA's MatVecRope over float
  // weights; quantized products read their own 8-bit copy of it).
  for (const Tensor* t : nodes) {
    const Tensor* p = t->src[0];
    if (t->op != Op::Rope || t->ne[1] != 1 || t->params[kRopeMode] != kRopeNormal || !p ||
        p->op != Op::MulMat || !p->src[1] || p->src[0]->storage != Storage::Weight)
      continue;
    const DType wt = p->src[0]->type;
    if (wt == DType::F32 || wt == DType::F16 || wt == DType::BF16)
      last_use[p->src[1]->index] = std::max(last_use[p->src[1]->index], t->index);
  }

  size_t input = 0;
  FreeList scratch;
  std::vector<std::vector<const Tensor*>> frees_after(n);
  for (Tensor* t : nodes) {
    if (t->storage == Storage::Input) {
      t->offset = input;
      input += align_up(t->nbytes());
    } else if (t->storage == Storage::Scratch) {
      t->offset = scratch.alloc(align_up(t->nbytes()));
      // A tensor nobody reads is freed right after it is written.
      int last = std::max(last_use[t->index], t->index);
      if (last < n) frees_after[last].push_back(t);
    }
    // Inputs of this node whose last reader it is become free once it has run.
    for (const Tensor* done : frees_after[t->index])
      scratch.release(done->offset, align_up(done->nbytes()));
  }
  graph.scratch_size = scratch.high();
  graph.input_size = input;
}

}  // namespace ggraph
