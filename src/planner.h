// Fixed-offset memory planning: every intermediate gets an offset in one scratch buffer,
// computed from the graph's shape alone, so equal topologies get equal addresses.
#pragma once

#include "graph.h"

namespace ggraph {

constexpr size_t kPlanAlignment = 256;

// Assigns Tensor::offset for scratch tensors and inputs; sets graph.scratch_size/input_size.
// Scratch is reused once a tensor's last reader has run; the output is never reused. The
// activation of a product of a float model weight (F32, F16, BF16) whose result a one-token rope
// of normal mode reads stays allocated until that rope has run (a backend may rotate in the
// product's epilogue, reading the activation as it writes the rope's result).
// With fold_room (a backend whose folds_norms() is true), a one-column norm's input, and the
// inputs of the residual add it reads, stay allocated until node norm_fold_reach has run: the
// backend may work the norm out inside the kernel of the products that read its weighted result
// (CUDA's NormFold), which reads them while it writes the products and what the products'
// readers would (their ropes and stores, in its epilogue).
void plan(Graph& graph, bool fold_room = false);

// For the one-column norm at nodes[i] (op RmsNorm over whole columns), the last of its readers,
// their readers and theirs (the weight multiply, the products, their ropes and stores); i
// itself where it is no such norm.
int norm_fold_reach(const std::vector<Tensor*>& nodes, int i);

}  // namespace ggraph
