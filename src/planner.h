// Fixed-offset memory planning: every intermediate gets an offset in one scratch buffer,
// computed from the graph's shape alone, so equal topologies get equal addresses.
#pragma once

#include "graph.h"

namespace ggraph {

constexpr size_t kPlanAlignment = 256;

// Assigns Tensor::offset for scratch tensors and inputs; sets graph.scratch_size/input_size.
// Scratch is reused once a tensor's last reader has run; the output is never reused.
void plan(Graph& graph);

}  // namespace ggraph
