#include "blocks.h"

#include <cstdio>
#include <cstring>

namespace ggraph {

namespace {

std::string dims(int64_t ne0, int64_t ne1) {
  return std::to_string(ne0) + (ne1 > 1 ? "x" + std::to_string(ne1) : std::string());
}

std::string num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

}  // namespace

ModelLoader::ModelLoader(const GGUFFile& f, Backend& b, const std::string& a)
    : file(f), arch(a), backend_(b) {}

int64_t ModelLoader::size(const std::string& k) const {
  const int64_t v = file.get_int(key(k));
  if (v <= 0 || v > (int64_t(1) << 24))
    throw GGUFError("metadata " + key(k) + ": expected a positive size, found " +
                    std::to_string(v));
  return v;
}

int64_t ModelLoader::size(const std::string& k, int64_t fallback) const {
  return has(k) ? size(k) : fallback;
}

float ModelLoader::positive(const std::string& k, float fallback) const {
  if (!has(k)) return fallback;
  const double v = file.get_float(key(k));
  if (!(v > 0.0) || !std::isfinite(v) || !std::isfinite(float(v)))
    throw GGUFError("metadata " + key(k) + ": expected a finite positive number, found " + num(v));
  return float(v);
}

const GGUFTensorInfo& ModelLoader::find(const std::string& name) const {
  const GGUFTensorInfo* t = file.tensor(name);
  if (!t) throw GGUFError("tensor '" + name + "' is missing from the file");
  used_.insert(name);
  return *t;
}

void ModelLoader::check_all_used() const {
  size_t unused = 0;
  const GGUFTensorInfo* first = nullptr;
  for (const GGUFTensorInfo& t : file.tensors())
    if (!used_.count(t.name)) {
      ++unused;
      if (!first) first = &t;
    }
  if (first)
    throw GGUFError("tensor '" + first->name + "' is not used by " + arch + " with block_count " +
                    std::to_string(file.get_int(key("block_count"), 0)) + " (" +
                    std::to_string(unused) + " of the file's " +
                    std::to_string(file.tensors().size()) +
                    " tensors unused): expected exactly the tensors the architecture reads");
}

void ModelLoader::check_type(const GGUFTensorInfo& t) const {
  if (!type_traits(t.type).computable)
    throw GGUFError("tensor '" + t.name + "' has type " + type_name(t.type) +
                    ", which ggraph does not support (supported: " + computable_type_names() + ")");
}

Weight ModelLoader::upload(const GGUFTensorInfo& t, size_t offset, size_t bytes, int64_t ne0,
                           int64_t ne1, const std::string& name) {
  weight_bytes += bytes;
  void* data = backend_.upload_weight(t.data + offset, bytes, t.type, ne0, ne1, name);
  return Weight{t.type, ne0, ne1, data, name};
}

Weight ModelLoader::matrix(const std::string& name, int64_t ne0, int64_t ne1) {
  const GGUFTensorInfo& t = find(name);
  if (t.ne[0] != ne0 || t.ne[1] != ne1 || t.ne[2] != 1 || t.ne[3] != 1 || t.n_dims > 2)
    throw GGUFError("tensor '" + name + "': expected " + dims(ne0, ne1) + ", file has " +
                    t.shape_str());
  check_type(t);
  return upload(t, 0, t.nbytes, ne0, ne1, name);
}

Weight ModelLoader::vector(const std::string& name, int64_t n, bool optional) {
  if (optional && !has_tensor(name)) return Weight{};
  const GGUFTensorInfo& t = find(name);
  if (t.ne[0] != n || t.ne[1] != 1 || t.ne[2] != 1 || t.ne[3] != 1)
    throw GGUFError("tensor '" + name + "': expected " + std::to_string(n) + ", file has " +
                    t.shape_str());
  // Norm weights and biases are added or multiplied in F32, never through a mat-mul.
  if (t.type != DType::F32)
    throw GGUFError("tensor '" + name + "': norm weights and biases must be F32, file has " +
                    type_name(t.type));
  return upload(t, 0, t.nbytes, n, 1, name);
}

std::vector<Weight> ModelLoader::split_rows(const std::string& name, int64_t ne0,
                                            const std::vector<int64_t>& parts) {
  const GGUFTensorInfo& t = find(name);
  int64_t rows = 0;
  for (int64_t p : parts) rows += p;
  if (t.ne[0] != ne0 || t.ne[1] != rows || t.ne[2] != 1 || t.ne[3] != 1 || t.n_dims > 2)
    throw GGUFError("tensor '" + name + "': expected " + dims(ne0, rows) + ", file has " +
                    t.shape_str());
  check_type(t);
  const size_t row = t.nbytes / size_t(rows);
  std::vector<Weight> out;
  int64_t first = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string part =
        name + "[rows " + std::to_string(first) + ".." + std::to_string(first + parts[i] - 1) + "]";
    out.push_back(upload(t, size_t(first) * row, size_t(parts[i]) * row, ne0, parts[i], part));
    first += parts[i];
  }
  return out;
}

Hparams read_hparams(const ModelLoader& ld) {
  Hparams hp;
  // Mixture-of-experts files (Mixtral's expert_count) name their feed-forward tensors otherwise:
  // said so, rather than that a dense tensor is missing.
  if (ld.has("expert_count") && ld.file.get_int(ld.key("expert_count")) > 0)
    throw GGUFError("metadata " + ld.key("expert_count") + " " +
                    std::to_string(ld.file.get_int(ld.key("expert_count"))) +
                    ": mixture-of-experts models are not supported yet (expected a dense model)");
  hp.n_layer = int(ld.size("block_count"));
  hp.n_embd = int(ld.size("embedding_length"));
  hp.n_ff = int(ld.size("feed_forward_length"));
  hp.n_head = int(ld.size("attention.head_count"));
  hp.n_head_kv = int(ld.size("attention.head_count_kv", hp.n_head));
  hp.n_ctx_train = int(ld.size("context_length", 2048));
  if (hp.n_head % hp.n_head_kv != 0)
    throw GGUFError("metadata " + ld.key("attention.head_count") + " " + std::to_string(hp.n_head) +
                    " is not a multiple of head_count_kv " + std::to_string(hp.n_head_kv));
  if (ld.has("attention.key_length")) {
    // An explicit head size (Gemma 3, Qwen 3) need not be n_embd / n_head.
    hp.head_dim = int(ld.size("attention.key_length"));
    const int64_t v = ld.size("attention.value_length", hp.head_dim);
    if (v != hp.head_dim)
      throw GGUFError("metadata " + ld.key("attention.value_length") + ": expected " +
                      std::to_string(hp.head_dim) + " (the key_length; one head size serves " +
                      "keys and values), found " + std::to_string(v));
  } else {
    if (hp.n_embd % hp.n_head != 0)
      throw GGUFError("metadata " + ld.key("embedding_length") + " " + std::to_string(hp.n_embd) +
                      " is not a multiple of head_count " + std::to_string(hp.n_head) +
                      ", and the file gives no attention.key_length");
    hp.head_dim = hp.n_embd / hp.n_head;
  }
  hp.n_rot = int(ld.size("rope.dimension_count", hp.head_dim));
  if (hp.n_rot > hp.head_dim || hp.n_rot % 2)
    throw GGUFError("metadata " + ld.key("rope.dimension_count") + ": expected an even size " +
                    "at most the head size " + std::to_string(hp.head_dim) + ", found " +
                    std::to_string(hp.n_rot));
  hp.rope_base = ld.positive("rope.freq_base", 10000.0f);
  hp.norm_eps = ld.positive("attention.layer_norm_rms_epsilon", 1e-5f);
  if (ld.has("attention.sliding_window")) {
    const int64_t w = ld.file.get_int(ld.key("attention.sliding_window"));
    // 0 declares no window, as in llama.cpp.
    if (w < 0 || w > (int64_t(1) << 24))
      throw GGUFError("metadata " + ld.key("attention.sliding_window") +
                      ": expected a window of 0 (none) to 2^24 positions, found " +
                      std::to_string(w));
    hp.window = int(w);
  }
  // As llama.cpp reads them: the factor, or the older rope.scale_linear; a type of linear when
  // the file names none.
  const double factor = ld.file.get_float(ld.key("rope.scaling.factor"),
                                          ld.file.get_float(ld.key("rope.scale_linear"), 1.0));
  const std::string scaling = ld.file.get_string(ld.key("rope.scaling.type"), "linear");
  const bool unscaled = scaling == "none" || factor == 1.0 || factor == 0.0;
  if (!unscaled && (scaling != "linear" || !(factor > 0.0) || !std::isfinite(factor)))
    throw GGUFError("metadata " + ld.key("rope.scaling.type") + " '" + scaling + "' with factor " +
                    num(factor) + ": rope scaling is not supported yet (expected none, or " +
                    "linear with a finite positive factor)");
  if (!unscaled) hp.rope_scale = float(1.0 / factor);

  // Phi 3's long-context factors (chosen by context length, with an attention factor) change
  // every position's angles: refused rather than silently ignored. Llama 3.1's rope_freqs are
  // loaded by load_rope_freqs.
  for (const char* name : {"rope_factors_long.weight", "rope_factors_short.weight",
                           "blk.0.rope_factors_long.weight", "blk.0.rope_factors_short.weight"})
    if (ld.has_tensor(name))
      throw GGUFError(std::string("tensor '") + name +
                      "': rope frequency factors are not supported yet (expected a file " +
                      "without them)");
  const GGUFTensorInfo* embd = ld.file.tensor("token_embd.weight");
  if (!embd) throw GGUFError("tensor 'token_embd.weight' is missing from the file");
  hp.n_vocab = int(embd->ne[1]);
  if (ld.has("vocab_size") && ld.file.get_int(ld.key("vocab_size")) != hp.n_vocab)
    throw GGUFError("metadata " + ld.key("vocab_size") + " is " +
                    std::to_string(ld.file.get_int(ld.key("vocab_size"))) +
                    " but token_embd.weight has " + std::to_string(hp.n_vocab) + " rows");
  return hp;
}

void describe(Model& m, const Hparams& hp, const ModelLoader& ld) {
  m.arch = ld.arch;
  m.n_vocab = hp.n_vocab;
  m.n_embd = hp.n_embd;
  m.n_layer = hp.n_layer;
  m.kv_width = hp.kv_width();
  m.head_dim = hp.head_dim;
  m.n_ctx_train = hp.n_ctx_train;
  m.weight_bytes = ld.weight_bytes;
  m.layer_window.assign(size_t(hp.n_layer), hp.window);  // gemma3 sets its global layers' to 0
}

AttnWeights load_attention(ModelLoader& ld, const std::string& p, const Hparams& hp) {
  AttnWeights a;
  a.wq = ld.matrix(p + "attn_q.weight", hp.n_embd, hp.q_width());
  a.wk = ld.matrix(p + "attn_k.weight", hp.n_embd, hp.kv_width());
  a.wv = ld.matrix(p + "attn_v.weight", hp.n_embd, hp.kv_width());
  a.wo = ld.matrix(p + "attn_output.weight", hp.q_width(), hp.n_embd);
  return a;
}

FfnWeights load_feed_forward(ModelLoader& ld, const std::string& p, const Hparams& hp) {
  FfnWeights f;
  f.gate = ld.matrix(p + "ffn_gate.weight", hp.n_embd, hp.n_ff);
  f.up = ld.matrix(p + "ffn_up.weight", hp.n_embd, hp.n_ff);
  f.down = ld.matrix(p + "ffn_down.weight", hp.n_ff, hp.n_embd);
  return f;
}

Weight load_output(ModelLoader& ld, const Hparams& hp, const Weight& tok_embd) {
  return ld.has_tensor("output.weight") ? ld.matrix("output.weight", hp.n_embd, hp.n_vocab)
                                        : tok_embd;
}

GraphContext::GraphContext(Graph& graph, const Batch& b, const KvCache& cache, const Hparams& h)
    : g(graph), batch(b), kv(cache), hp(h) {
  tokens = b.token_ids ? b.token_ids : g.input_i32(b.n_tokens, b.tokens, "tokens");
  positions = b.position_ids ? b.position_ids : g.input_i32(b.n_tokens, b.positions, "positions");
  out_ids = g.input_i32(b.n_outputs, b.out_ids, "out_ids");
  if (b.n_seqs > 0) slots = g.input_i32(2 * b.n_seqs, b.slots, "slots");
  g.n_tokens = b.n_tokens;
  g.seqs = b.n_seqs > 0;
}

Tensor* GraphContext::weight(const Weight& w) {
  return g.weight(w.type, w.ne0, w.ne1, w.data, w.name);
}

Tensor* GraphContext::embeddings(const Weight& tok_embd, float scale) {
  return g.get_rows(weight(tok_embd), tokens, scale);
}

Tensor* GraphContext::norm(Tensor* x, const Weight& w) {
  Tensor* normed = g.rms_norm(x, hp.norm_eps);
  return g.mul(normed, weight(w));
}

Tensor* GraphContext::head_norm(Tensor* x, const Weight& w) {
  Tensor* normed = g.rms_norm(x, hp.norm_eps, hp.head_dim);
  return g.mul(normed, weight(w));
}

Tensor* GraphContext::attention(int il, Tensor* h, Tensor*& residual, const AttnWeights& w,
                                const AttnOptions& o) {
  // The three products of h first, then their ropes: a backend may run products of one input
  // together, and the two ropes together.
  Tensor* q = g.mul_mat(weight(w.wq), h);
  Tensor* k = g.mul_mat(weight(w.wk), h);
  Tensor* v = g.mul_mat(weight(w.wv), h);
  if (w.bq) q = g.add(q, weight(w.bq));
  if (w.bk) k = g.add(k, weight(w.bk));
  if (w.bv) v = g.add(v, weight(w.bv));
  if (w.q_norm) q = head_norm(q, w.q_norm);
  if (w.k_norm) k = head_norm(k, w.k_norm);
  // One leaf for both ropes' factors: a backend may rotate q and k in one launch.
  Tensor* freqs = o.rope_freqs ? weight(o.rope_freqs) : nullptr;
  q = g.rope(q, positions, hp.n_head, hp.head_dim, hp.n_rot, o.rope_mode, o.rope_base, freqs,
             o.rope_scale);
  k = g.rope(k, positions, hp.n_head_kv, hp.head_dim, hp.n_rot, o.rope_mode, o.rope_base, freqs,
             o.rope_scale);
  Tensor* attn = nullptr;
  if (batch.n_seqs > 0) {
    // A token of each sequence: column i goes to sequence slots[i]'s cache in the pool, and
    // attends over it.
    const KvCache& c = *batch.pool;
    Tensor* kp =
        g.kv_pool(c.type, c.width, c.rows[il], c.n_seq, c.k_pool[il], "k_pool", c.ring(il));
    Tensor* vp =
        g.kv_pool(c.type, c.width, c.rows[il], c.n_seq, c.v_pool[il], "v_pool", c.ring(il));
    g.kv_store_seqs(kp, k, slots);
    g.kv_store_seqs(vp, v, slots);
    attn =
        g.attention_seqs(q, kp, vp, slots, hp.n_head, hp.n_head_kv, hp.head_dim, o.scale, o.window);
    return attention_output(il, attn, residual, w);
  }
  Tensor* k_cache = g.kv_cache(kv.type, kv.width, kv.rows[il], kv.k[il], "k_cache", kv.ring(il));
  Tensor* v_cache = g.kv_cache(kv.type, kv.width, kv.rows[il], kv.v[il], "v_cache", kv.ring(il));
  const int n_kv = batch.n_past + batch.n_tokens;
  g.kv_store(k_cache, k, batch.n_past);
  g.kv_store(v_cache, v, batch.n_past);
  attn = g.attention(q, k_cache, v_cache, hp.n_head, hp.n_head_kv, hp.head_dim, o.scale, n_kv,
                     batch.n_past, o.window);
  return attention_output(il, attn, residual, w);
}

Tensor* GraphContext::attention_output(int il, Tensor* attn, Tensor*& residual,
                                       const AttnWeights& w) {
  if (il == hp.n_layer - 1 && batch.n_outputs < batch.n_tokens) {
    // Only the positions that produce logits go through the last layer's remainder.
    attn = g.get_rows(attn, out_ids);
    residual = g.get_rows(residual, out_ids);
  }
  return g.mul_mat(weight(w.wo), attn);
}

Tensor* GraphContext::feed_forward(Tensor* h, const FfnWeights& w, Activation act) {
  Tensor* gate = g.mul_mat(weight(w.gate), h);
  Tensor* up = g.mul_mat(weight(w.up), h);
  Tensor* hidden = act == Activation::Gelu ? g.geglu(gate, up) : g.swiglu(gate, up);
  return g.mul_mat(weight(w.down), hidden);
}

void GraphContext::logits(Tensor* x, const Weight& output_norm, const Weight& output,
                          float softcap) {
  Tensor* h = norm(x, output_norm);
  if (batch.embeddings) {
    g.set_output(h);
    return;
  }
  Tensor* out = g.mul_mat(weight(output), h);
  if (softcap > 0.0f) out = g.softcap(out, softcap);
  g.set_output(out);
}

Weight load_rope_freqs(ModelLoader& ld, const Hparams& hp) {
  Weight w = ld.vector("rope_freqs.weight", hp.n_rot / 2, /*optional=*/true);
  // Each pair's angle is divided by its factor: a factor of 0, below 0 or not finite gives NaN
  // or wrong positions.
  if (const GGUFTensorInfo* t = ld.file.tensor("rope_freqs.weight"))
    for (int64_t i = 0; i < t->ne[0]; ++i) {
      float f;
      std::memcpy(&f, t->data + i * sizeof(float), sizeof f);
      if (!(f > 0.0f) || !std::isfinite(f))
        throw GGUFError("tensor 'rope_freqs.weight': expected finite positive factors, found " +
                        num(f) + " at " + std::to_string(i));
    }
  return w;
}

std::unique_ptr<Model> load_pre_norm_decoder(const GGUFFile& file, Backend& backend,
                                             const std::string& arch, int rope_mode,
                                             const LoadLayer& load_layer) {
  auto m = std::make_unique<PreNormDecoder>();
  m->rope_mode = rope_mode;
  ModelLoader ld(file, backend, arch);
  m->hp = read_hparams(ld);
  const Hparams& hp = m->hp;
  m->tok_embd = ld.matrix("token_embd.weight", hp.n_embd, hp.n_vocab);
  for (int il = 0; il < hp.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    DecoderLayer L;
    L.attn_norm = ld.vector(p + "attn_norm.weight", hp.n_embd);
    load_layer(ld, hp, p, L);
    L.ffn_norm = ld.vector(p + "ffn_norm.weight", hp.n_embd);
    m->layers.push_back(L);
  }
  m->rope_freqs = load_rope_freqs(ld, hp);
  m->output_norm = ld.vector("output_norm.weight", hp.n_embd);
  m->output = load_output(ld, hp, m->tok_embd);
  ld.check_all_used();
  describe(*m, hp, ld);
  return m;
}

void load_standard_layer(ModelLoader& ld, const Hparams& hp, const std::string& prefix,
                         DecoderLayer& layer) {
  layer.attn = load_attention(ld, prefix, hp);
  layer.ffn = load_feed_forward(ld, prefix, hp);
}

void PreNormDecoder::build(Graph& g, const Batch& b, const KvCache& kv) const {
  GraphContext ctx(g, b, kv, hp);
  AttnOptions attn;
  attn.rope_mode = rope_mode;
  attn.rope_base = hp.rope_base;
  attn.scale = 1.0f / std::sqrt(float(hp.head_dim));
  attn.window = hp.window;
  attn.rope_scale = hp.rope_scale;
  attn.rope_freqs = rope_freqs;

  Tensor* x = ctx.embeddings(tok_embd);
  for (int il = 0; il < n_layer; ++il) {
    const DecoderLayer& L = layers[il];
    Tensor* h = ctx.norm(x, L.attn_norm);
    Tensor* attn_out = ctx.attention(il, h, x, L.attn, attn);
    x = g.add(x, attn_out);
    Tensor* f = ctx.norm(x, L.ffn_norm);
    x = g.add(x, ctx.feed_forward(f, L.ffn, Activation::Silu));
  }
  ctx.logits(x, output_norm, output);
}

}  // namespace ggraph
