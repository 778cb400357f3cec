// The Python binding: thin wrappers over Context, Tokenizer and the sampler.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>

#include "backend.h"
#include "context.h"
#include "cpu/thread_pool.h"
#include "generation.h"
#include "quant.h"
#include "sampling.h"
#include "tokenizer.h"

namespace py = pybind11;
using namespace ggraph;

namespace {

py::str utf8(const std::string& s) {
  return py::reinterpret_steal<py::str>(PyUnicode_DecodeUTF8(s.data(), s.size(), "replace"));
}

py::object metadata_value(const GGUFValue& v) {
  switch (v.type) {
    case GGUFType::UINT8:
    case GGUFType::UINT16:
    case GGUFType::UINT32:
    case GGUFType::UINT64:
      return py::int_(v.u);
    case GGUFType::INT8:
    case GGUFType::INT16:
    case GGUFType::INT32:
    case GGUFType::INT64:
      return py::int_(v.i);
    case GGUFType::FLOAT32:
    case GGUFType::FLOAT64:
      return py::float_(v.f);
    case GGUFType::BOOL:
      return py::bool_(v.b);
    case GGUFType::STRING:
      return utf8(v.str);
    case GGUFType::ARRAY: {
      // Vocabularies run to 10^5 entries: large arrays are summarized.
      if (v.arr.size() > 256)
        return py::str("[" + std::to_string(v.arr.size()) + " x " + gguf_type_name(v.arr_type) +
                       "]");
      py::list out;
      for (const auto& e : v.arr) out.append(metadata_value(e));
      return py::object(std::move(out));
    }
  }
  return py::none();
}

py::dict metadata_dict(const GGUFFile& f) {
  py::dict d;
  for (const auto& kv : f.metadata()) d[py::str(kv.first)] = metadata_value(kv.second);
  return d;
}

std::vector<int32_t> to_ids(const py::handle& tokens, const char* what) {
  std::vector<int32_t> ids;
  if (py::isinstance<py::str>(tokens) || py::isinstance<py::bytes>(tokens))
    throw ArgumentError(std::string(what) + ": expected a sequence of token ids, got text");
  for (const py::handle& t : tokens) {
    if (!py::isinstance<py::int_>(t) && !py::hasattr(t, "__index__"))
      throw ArgumentError(std::string(what) + ": expected integer token ids, found " +
                          std::string(py::str(py::type::of(t).attr("__name__"))));
    long long v = 0;
    try {
      v = py::reinterpret_borrow<py::object>(t).cast<long long>();
    } catch (const py::cast_error&) {
      if (py::hasattr(t, "__len__"))  // a row of a 2-D array, a nested list
        throw ArgumentError(std::string(what) +
                            ": expected a flat (1-D) sequence of token ids, found an element "
                            "that is itself a sequence: " +
                            std::string(py::str(t)));
      throw ArgumentError(std::string(what) + ": token id " + std::string(py::str(t)) +
                          " is out of range");
    }
    if (v < INT32_MIN || v > INT32_MAX)
      throw ArgumentError(std::string(what) + ": token id " + std::to_string(v) +
                          " is out of range");
    ids.push_back(int32_t(v));
  }
  return ids;
}

std::vector<Generation*> generations_of(const py::list& generations) {
  std::vector<Generation*> gens;
  for (const py::handle& g : generations) gens.push_back(g.cast<Generation*>());
  return gens;
}

// Generation i takes the logits at rows[i] and presamples its next token: on several threads,
// one pool for the process, one loop at a time (two models' engines may call at once).
void feed_rows(const std::vector<Generation*>& gens, const std::vector<const float*>& rows,
               size_t n_vocab) {
  auto one = [&](int i) {
    gens[size_t(i)]->feed(rows[size_t(i)], n_vocab);
    gens[size_t(i)]->presample();
  };
  if (gens.size() == 1) {
    one(0);
  } else if (!gens.empty()) {
    static ThreadPool pool(std::max(1, std::min(8, default_thread_count())));
    static std::mutex busy;
    std::lock_guard<std::mutex> hold(busy);
    pool.parallel_for(static_cast<int>(gens.size()), one);
  }
}

// The tokens deferred generations left (a sampled token each, or a prompt's chunk), evaluated
// in decode_batch steps of at most decode_batch_span() tokens, and each generation fed its last
// token's row; the logits go into a block of the backend's host pool (page-locked on CUDA)
// while there is one.
void decode_pending(Context& ctx, const std::vector<Generation*>& gens) {
  std::vector<int> seqs;
  std::vector<int32_t> tokens;
  std::vector<Generation*> owner;  // the generation whose last token each token is, or null
  for (Generation* g : gens) {
    const std::vector<int32_t>& p = g->pending_tokens();
    for (size_t j = 0; j < p.size(); ++j) {
      seqs.push_back(g->sequence());
      tokens.push_back(p[j]);
      owner.push_back(j + 1 == p.size() ? g : nullptr);
    }
  }
  if (tokens.empty()) return;
  const size_t n_vocab = size_t(ctx.n_vocab()), span = ctx.decode_batch_span();
  const size_t bytes =
      ctx.decode_batch_rows(std::min(span, tokens.size())) * n_vocab * sizeof(float);
  std::shared_ptr<HostPool> pool = ctx.backend().host_pool();
  struct Block {
    std::shared_ptr<HostPool> pool;
    void* p;
    ~Block() {
      if (p) pool->give(p);
    }
  } block{pool, pool ? pool->take(bytes) : nullptr};
  std::vector<float> own;
  float* data = static_cast<float*>(block.p);
  if (!data) {
    own.resize(bytes / sizeof(float));
    data = own.data();
  }
  for (size_t start = 0; start < tokens.size(); start += span) {
    const size_t m = std::min(span, tokens.size() - start);
    // Only each sequence's last token in the call gives logits (a prompt's others need none):
    // row r is the r-th of those tokens.
    ctx.decode_batch(seqs.data() + start, tokens.data() + start, m, data, /*repeats=*/true,
                     /*last_only=*/true);
    std::vector<Generation*> fed;
    std::vector<const float*> rows;
    size_t r = 0;
    for (size_t i = 0; i < m; ++i) {
      if (i + 1 < m && seqs[start + i + 1] == seqs[start + i]) continue;  // not its last here
      if (owner[start + i]) {
        fed.push_back(owner[start + i]);
        rows.push_back(data + r * n_vocab);
      }
      ++r;
    }
    feed_rows(fed, rows, n_vocab);
  }
}

// One step of each deferred generation (advance_batch's and step_batch's).
struct AdvanceStep {
  std::string text;
  GeneratedToken tok;
  bool more = false;
  std::exception_ptr error;
};
std::vector<AdvanceStep> advance_all(Context& ctx, const std::vector<Generation*>& gens) {
  std::vector<AdvanceStep> steps(gens.size());
  for (size_t i = 0; i < gens.size(); ++i) {
    try {
      ctx.select_sequence(gens[i]->sequence());
      steps[i].more = gens[i]->next(&steps[i].text, &steps[i].tok);
    } catch (...) {
      steps[i].error = std::current_exception();
    }
  }
  return steps;
}

// An uninitialized float array of `shape` in the memory the context's backend writes outputs
// into fastest (its HostPool's, page-locked on CUDA), which goes back to the pool when the
// array and its views are gone; ordinary memory where the backend has no pool or it is out.
py::array_t<float> host_array(Context& c, std::vector<py::ssize_t> shape) {
  std::shared_ptr<HostPool> pool = c.backend().host_pool();
  size_t bytes = sizeof(float);
  for (py::ssize_t d : shape) bytes *= size_t(d);
  void* block = pool ? pool->take(bytes) : nullptr;
  if (!block) return py::array_t<float>(shape);
  struct Owner {
    std::shared_ptr<HostPool> pool;
    void* block;
  };
  auto owner = std::make_unique<Owner>(Owner{pool, block});
  py::capsule base;
  try {
    base = py::capsule(owner.get(), [](void* p) {
      auto* o = static_cast<Owner*>(p);
      o->pool->give(o->block);
      delete o;
    });
  } catch (...) {
    pool->give(block);
    throw;
  }
  owner.release();  // the capsule's now
  return py::array_t<float>(shape, static_cast<float*>(block), base);
}

class PyTokenizer {
 public:
  explicit PyTokenizer(const std::string& path) : file_(GGUFFile::open(path)) {
    tok_ = Tokenizer::from_gguf(*file_);
  }
  const Tokenizer& get() const { return *tok_; }

 private:
  std::unique_ptr<GGUFFile> file_;
  std::unique_ptr<Tokenizer> tok_;
};

std::vector<int32_t> tokenize(const Tokenizer& tok, const std::string& text, py::object add_bos,
                              bool special) {
  const bool bos = add_bos.is_none() ? tok.add_bos_default() : add_bos.cast<bool>();
  py::gil_scoped_release release;
  return tok.tokenize(text, bos, special);
}

std::string detokenize(const Tokenizer& tok, const py::handle& ids, bool render_special) {
  std::vector<int32_t> v = to_ids(ids, "detokenize");
  check_token_ids(v.data(), v.size(), tok.n_vocab(), "detokenize");
  return tok.detokenize(v, render_special);
}

// The sampling keywords that sample(), validate_sampling() and Sampler() share, each optional
// with SamplingParams' default. `skip` names one more keyword the caller reads itself.
SamplingParams sampling_params(const py::kwargs& kw, const char* what, const char* skip = "") {
  SamplingParams p;
  for (const auto& item : kw) {
    const std::string key = py::str(item.first);
    const py::handle v = item.second;
    if (key == skip) continue;
    try {
      if (key == "temperature") {
        p.temperature = v.cast<float>();
      } else if (key == "top_k") {
        p.top_k = v.cast<int32_t>();
      } else if (key == "top_p") {
        p.top_p = v.cast<float>();
      } else if (key == "min_p") {
        p.min_p = v.cast<float>();
      } else if (key == "repeat_penalty") {
        p.repeat_penalty = v.cast<float>();
      } else if (key == "frequency_penalty") {
        p.frequency_penalty = v.cast<float>();
      } else if (key == "presence_penalty") {
        p.presence_penalty = v.cast<float>();
      } else if (key == "penalty_last_n") {
        p.penalty_last_n = v.cast<int32_t>();
      } else if (key == "seed") {
        if (!v.is_none()) {
          const long long seed = v.cast<long long>();
          if (seed < 0) throw ArgumentError("seed must be >= 0, got " + std::to_string(seed));
          p.seed = uint64_t(seed);
        }
      } else {
        throw py::type_error(std::string(what) + "() got an unexpected keyword argument '" + key +
                             "'");
      }
    } catch (const py::cast_error&) {
      const bool integer = key == "top_k" || key == "penalty_last_n" || key == "seed";
      throw py::type_error(std::string(what) + "(): '" + key + "' expects " +
                           (integer ? "an integer in range" : "a number") + ", got " +
                           std::string(py::str(py::repr(v))));
    }
  }
  validate(p);
  return p;
}

// Text methods shared by Tokenizer and Context (whose tokenizer is loaded on first use).
template <typename Cls, typename GetTokenizer>
void bind_text(Cls& cls, GetTokenizer tok) {
  using T = typename Cls::type;
  cls.def(
         "tokenize",
         [tok](const T& o, const std::string& text, py::object add_bos, bool special) {
           return tokenize(tok(o), text, add_bos, special);
         },
         py::arg("text"), py::arg("add_bos") = py::none(), py::arg("special") = false)
      .def(
          "detokenize",
          [tok](const T& o, const py::handle& ids, bool render_special) {
            return utf8(detokenize(tok(o), ids, render_special));
          },
          py::arg("ids"), py::arg("render_special") = false)
      .def(
          "token_to_piece",
          [tok](const T& o, int32_t id, bool render_special) {
            const Tokenizer& t = tok(o);
            check_token_ids(&id, 1, t.n_vocab(), "token_to_piece");
            return py::bytes(t.token_to_piece(id, render_special));
          },
          py::arg("id"), py::arg("render_special") = false)
      .def(
          "decode_stream", [tok](const T& o) { return std::make_unique<StreamDecoder>(tok(o)); },
          py::keep_alive<0, 1>())
      .def_property_readonly("bos_id", [tok](const T& o) { return tok(o).bos_id(); })
      .def_property_readonly("eos_id", [tok](const T& o) { return tok(o).eos_id(); })
      .def("is_end_of_generation",
           [tok](const T& o, int32_t id) { return tok(o).is_end_of_generation(id); });
}

}  // namespace

namespace {

// The module's exception types (set when it loads).
PyObject* g_gguf_error = nullptr;
PyObject* g_device_error = nullptr;
PyObject* g_cancelled = nullptr;

// The Python exception type of one of the engine's errors, its message in *msg; null for any
// other exception.
PyObject* error_type(std::exception_ptr p, std::string* msg) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const GGUFError& e) {
    *msg = e.what();
    return g_gguf_error;
  } catch (const DeviceError& e) {
    *msg = e.what();
    return g_device_error;
  } catch (const ArgumentError& e) {
    *msg = e.what();
    return PyExc_ValueError;
  } catch (const Cancelled& e) {
    *msg = e.what();
    return g_cancelled;
  } catch (...) {
  }
  return nullptr;
}

// An exception as a Python exception object, to be returned rather than raised: the engine's
// errors as the translator raises them, any other std::exception as a RuntimeError.
py::object error_object(std::exception_ptr p) {
  std::string msg;
  PyObject* type = error_type(p, &msg);
  if (!type) {
    type = PyExc_RuntimeError;
    try {
      std::rethrow_exception(p);
    } catch (const std::exception& e) {
      msg = e.what();
    } catch (...) {
      msg = "unknown error";
    }
  }
  py::str text = py::reinterpret_steal<py::str>(
      PyUnicode_DecodeUTF8(msg.data(), Py_ssize_t(msg.size()), "backslashreplace"));
  if (!text) throw py::error_already_set();
  return py::reinterpret_borrow<py::object>(type)(text);
}

// advance_all's steps as Python values: (step, n_generated, stop_reason) a generation, step
// next()'s (text, id, logprob, top), None once it is over, or its exception as an object.
py::list advance_results(const std::vector<Generation*>& gens,
                         const std::vector<AdvanceStep>& steps) {
  py::list out;
  for (size_t i = 0; i < gens.size(); ++i) {
    const AdvanceStep& s = steps[i];
    py::object step = py::none();
    if (s.error) {
      step = error_object(s.error);
    } else if (s.more) {
      py::list top;
      for (const auto& t : s.tok.top) top.append(py::make_tuple(t.first, t.second));
      step = py::make_tuple(utf8(s.text), s.tok.id, s.tok.logprob, top);
    }
    const char* reason = stop_reason_name(gens[i]->stop_reason());
    out.append(py::make_tuple(step, gens[i]->n_generated(),
                              *reason ? py::object(py::str(reason)) : py::none()));
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "ggraph engine (C++/CUDA)";
  static py::exception<GGUFError> gguf_error(m, "GGUFError", PyExc_ValueError);
  static py::exception<DeviceError> device_error(m, "DeviceError", PyExc_RuntimeError);
  static py::exception<Cancelled> cancelled(m, "Cancelled", PyExc_RuntimeError);
  g_gguf_error = gguf_error.ptr();
  g_device_error = device_error.ptr();
  g_cancelled = cancelled.ptr();
  // Messages may quote bytes from the file that are not UTF-8: they are decoded with
  // backslash escapes, so that an error is always its own type with a readable message.
  py::register_exception_translator([](std::exception_ptr p) {
    std::string msg;
    PyObject* type = error_type(p, &msg);
    if (!type) std::rethrow_exception(p);  // not ours: pybind11's own translation
    PyObject* text = PyUnicode_DecodeUTF8(msg.data(), Py_ssize_t(msg.size()), "backslashreplace");
    if (!text) return;  // the decode's own error stands
    PyErr_SetObject(type, text);
    Py_DECREF(text);
  });

  m.def("build_info", [] {
    py::dict d;
    d["version"] = GGRAPH_VERSION;
    d["cuda_compiled"] = cuda_compiled();
    py::list archs;
#ifdef GGRAPH_CUDA_ARCHS
    std::string a = GGRAPH_CUDA_ARCHS;
    size_t start = 0;
    while (start <= a.size()) {
      size_t end = a.find(',', start);
      if (end == std::string::npos) end = a.size();
      if (end > start) archs.append(a.substr(start, end - start));
      start = end + 1;
    }
#endif
    d["cuda_archs"] = archs;
    py::list feats;
    std::string f = cpu_features();
    size_t start2 = 0;
    while (start2 < f.size()) {
      size_t end = f.find(' ', start2);
      if (end == std::string::npos) end = f.size();
      if (end > start2) feats.append(f.substr(start2, end - start2));
      start2 = end + 1;
    }
    d["cpu_features"] = feats;
    return d;
  });

  // For the format tests: ggraph's decoder of one row, compared there with gguf-py's.
  m.def(
      "_dequantize",
      [](const std::string& type_name, const py::bytes& data, int64_t n) {
        const DType t = type_from_name(type_name);
        const std::string_view bytes = data;
        const size_t want = row_size(t, n);
        if (bytes.size() != want) {
          throw ArgumentError(std::to_string(n) + " " + type_name + " elements: expected " +
                              std::to_string(want) + " bytes, got " + std::to_string(bytes.size()));
        }
        py::array_t<float> out(n);
        dequantize_row(t, bytes.data(), out.mutable_data(), n);
        return out;
      },
      py::arg("type_name"), py::arg("data"), py::arg("n"));

  m.def("devices", [] {
    py::list out;
    for (const DeviceInfo& d : cuda_devices()) {
      py::dict e;
      e["index"] = d.index;
      e["name"] = d.name;
      e["total_memory"] = d.total_memory;
      e["free_memory"] = d.free_memory;
      e["compute_capability"] = py::make_tuple(d.cc_major, d.cc_minor);
      e["multiprocessors"] = d.multiprocessors;
      out.append(e);
    }
    return out;
  });

  m.def(
      "read_metadata",
      [](const std::string& path) {
        auto f = GGUFFile::open(path);
        py::dict info;
        info["metadata"] = metadata_dict(*f);
        info["version"] = f->version();
        py::list tensors;
        for (const auto& t : f->tensors()) {
          std::vector<int64_t> shape(t.ne, t.ne + t.n_dims);
          tensors.append(py::make_tuple(t.name, type_name(t.type), shape, t.nbytes));
        }
        info["tensors"] = tensors;
        return info;
      },
      py::arg("path"), "Reads a GGUF file's metadata and tensor table without loading weights.");

  m.def("check_model_file", &check_model_file, py::arg("path"),
        "Why ggraph cannot run the file (the first unsupported architecture, format or key), or "
        "'' when it can.");

  py::class_<PyTokenizer> tokenizer(m, "Tokenizer");
  tokenizer.def(py::init<const std::string&>(), py::arg("path"))
      .def_property_readonly("n_vocab", [](const PyTokenizer& t) { return t.get().n_vocab(); });
  bind_text(tokenizer, [](const PyTokenizer& t) -> const Tokenizer& { return t.get(); });

  py::class_<StreamDecoder>(m, "StreamDecoder")
      .def("push", [](StreamDecoder& d, int32_t id) { return utf8(d.push(id)); })
      .def("flush", [](StreamDecoder& d) { return utf8(d.flush()); });

  // Sampling keywords (see sampling_params): temperature, top_k, top_p, min_p, repeat_penalty,
  // frequency_penalty, presence_penalty, penalty_last_n, seed.
  m.def(
      "sample",
      [](py::array_t<float, py::array::c_style | py::array::forcecast> logits,
         const py::kwargs& kw) {
        if (logits.ndim() != 1 || logits.shape(0) == 0)
          throw ArgumentError("logits: expected a non-empty 1-D array, got shape with " +
                              std::to_string(logits.ndim()) + " dimensions");
        SamplingParams p = sampling_params(kw, "sample", "history");
        py::object history = py::none();
        if (kw.contains("history")) history = kw["history"];
        std::vector<int32_t> hist =
            history.is_none() ? std::vector<int32_t>{} : to_ids(history, "history");
        return sample_once(p, logits.data(), int32_t(logits.shape(0)), hist.data(), hist.size());
      },
      py::arg("logits"));

  // Validation as a plain function: the Python side checks parameters before constructing,
  // so that a bad value is reported without unwinding through a constructor. Returns how many
  // of the latest tokens the penalties read (0: none; a call that samples needs no history).
  m.def("validate_sampling", [](const py::kwargs& kw) {
    return sample_history_window(sampling_params(kw, "validate_sampling"),
                                 std::numeric_limits<int>::max());
  });

  py::class_<Sampler>(m, "Sampler")
      .def(py::init([](const py::kwargs& kw) {
        return std::make_unique<Sampler>(sampling_params(kw, "Sampler"));
      }))
      .def(
          "sample",
          [](Sampler& s, py::array_t<float, py::array::c_style | py::array::forcecast> logits,
             const std::vector<int32_t>& history) {
            if (logits.ndim() != 1 || logits.shape(0) == 0)
              throw ArgumentError("logits: expected a non-empty 1-D array");
            return s.sample(logits.data(), int32_t(logits.shape(0)), history.data(),
                            history.size());
          },
          py::arg("logits"), py::arg("history") = std::vector<int32_t>{});

  // Deferred generations of one context take their rows of a decode_batch's logits (feed) and
  // presample their next tokens (Generation::presample), on several threads and with the GIL
  // released once for all: a server's step hands every running request its logits and samples
  // them at once. The caller holds the context for the call.
  m.def(
      "feed_batch",
      [](const py::list& generations,
         py::array_t<float, py::array::c_style | py::array::forcecast> logits) {
        std::vector<Generation*> gens = generations_of(generations);
        if (logits.ndim() != 2 || size_t(logits.shape(0)) != gens.size())
          throw ArgumentError("feed_batch: expected logits of " + std::to_string(gens.size()) +
                              " rows, one a generation");
        const size_t n_vocab = size_t(logits.shape(1));
        std::vector<const float*> rows;
        for (size_t i = 0; i < gens.size(); ++i) rows.push_back(logits.data() + i * n_vocab);
        py::gil_scoped_release release;
        feed_rows(gens, rows, n_vocab);
      },
      py::arg("generations"), py::arg("logits"));

  // Deferred generations of one context a step each (Generation::next, each with its own
  // sequence selected), with the GIL released once for all: a server's step advances every
  // running request at once. The caller holds the context for the call. For each generation,
  // (step, n_generated, stop_reason): step as next() gives it, or the exception it raised (an
  // exception object, returned: the others' steps stand).
  m.def(
      "advance_batch",
      [](Context& ctx, const py::list& generations) {
        std::vector<Generation*> gens = generations_of(generations);
        std::vector<AdvanceStep> steps;
        {
          py::gil_scoped_release release;
          steps = advance_all(ctx, gens);
        }
        return advance_results(gens, steps);
      },
      py::arg("context"), py::arg("generations"));

  // A server's whole step, with the GIL released once: the tokens the generations left (a
  // sampled token each, new prompts' chunks) evaluated together in decode_batch steps, each
  // generation's next token sampled from its row (feed_batch's), then every generation
  // advanced (advance_batch's). Each generation must be on a sequence of its own. Returns (the
  // steps as advance_batch gives them, None), or (None, the exception) where a decode failed:
  // then no generation has stepped, but those whose tokens an earlier decode call took were fed
  // (the caller drops them all).
  m.def(
      "step_batch",
      [](Context& ctx, const py::list& generations) {
        std::vector<Generation*> gens = generations_of(generations);
        std::vector<char> taken(size_t(ctx.n_seq_max()), 0);
        for (const Generation* g : gens)
          if (taken[size_t(g->sequence())]++)
            throw ArgumentError("step_batch: two generations on sequence " +
                                std::to_string(g->sequence()) + "; each needs its own");
        std::vector<AdvanceStep> steps;
        std::exception_ptr failed;
        {
          py::gil_scoped_release release;
          try {
            decode_pending(ctx, gens);
          } catch (...) {
            failed = std::current_exception();
          }
          if (!failed) steps = advance_all(ctx, gens);
        }
        if (failed) return py::tuple(py::make_tuple(py::none(), error_object(failed)));
        return py::tuple(py::make_tuple(advance_results(gens, steps), py::none()));
      },
      py::arg("context"), py::arg("generations"));

  // One generation over a context (generation.h): next() gives (text, token id, logprob, top)
  // for each step, None once the generation is over.
  py::class_<Generation>(m, "Generation")
      .def(py::init([](Context& c, const py::handle& prompt, int max_tokens,
                       std::vector<std::string> stop, bool logprobs, int top_logprobs,
                       bool ignore_eos, int chain, const py::kwargs& kw) {
             GenerateOptions o;
             o.chain = chain;
             o.max_tokens = max_tokens;
             o.stop = std::move(stop);
             o.logprobs = logprobs;
             o.top_logprobs = top_logprobs;
             o.ignore_eos = ignore_eos;
             o.sampling = sampling_params(kw, "generate");
             return std::make_unique<Generation>(c, to_ids(prompt, "generate"), std::move(o));
           }),
           py::keep_alive<1, 2>(), py::arg("context"), py::arg("prompt"),
           py::arg("max_tokens") = 128, py::arg("stop") = std::vector<std::string>{},
           py::arg("logprobs") = true, py::arg("top_logprobs") = 0, py::arg("ignore_eos") = false,
           py::arg("chain") = kAutoChain)
      .def("next",
           [](Generation& g) -> py::object {
             std::string text;
             GeneratedToken tok;
             bool more = false;
             bool interrupted = false;
             auto check_signals = [&] {
               py::gil_scoped_acquire acquire;
               interrupted = PyErr_CheckSignals() != 0;
               return interrupted;
             };
             try {
               py::gil_scoped_release release;
               more = g.next(&text, &tok, check_signals);
             } catch (const Cancelled&) {
               if (interrupted) throw py::error_already_set();
               throw;
             }
             if (!more) return py::none();
             py::list top;
             for (const auto& t : tok.top) top.append(py::make_tuple(t.first, t.second));
             return py::make_tuple(utf8(text), tok.id, tok.logprob, top);
           })
      .def_property_readonly("stop_reason",
                             [](const Generation& g) -> py::object {
                               const char* r = stop_reason_name(g.stop_reason());
                               if (*r == 0) return py::none();
                               return py::str(r);
                             })
      .def_property_readonly("n_generated", &Generation::n_generated)
      .def_property_readonly("cached_tokens", &Generation::cached_tokens)
      .def("close", &Generation::close)
      .def("settle", &Generation::settle, py::call_guard<py::gil_scoped_release>())
      .def("set_defer", &Generation::set_defer, py::arg("defer"))
      .def("set_prefill_chunk", &Generation::set_prefill_chunk, py::arg("tokens"))
      .def_property_readonly("pending_token", &Generation::pending_token)
      .def_property_readonly("pending_tokens", &Generation::pending_tokens);

  py::class_<Context> context(m, "Context");
  context
      .def(py::init([](const std::string& path, const std::string& device, int n_ctx, int n_threads,
                       int n_batch, const std::string& cuda_graphs, bool cuda_graph_debug,
                       bool use_mmap, const std::string& kv_type, bool allow_longer_context,
                       int n_seq_max, bool swa_full) {
             ContextOptions o;
             o.device = device;
             o.n_ctx = n_ctx;
             o.n_threads = n_threads;
             o.n_batch = n_batch;
             o.cuda_graphs = cuda_graphs;
             o.cuda_graph_debug = cuda_graph_debug;
             o.use_mmap = use_mmap;
             o.kv_type = kv_type;
             o.allow_longer_context = allow_longer_context;
             o.n_seq_max = n_seq_max;
             o.swa_full = swa_full;
             py::gil_scoped_release release;
             return std::make_unique<Context>(path, o);
           }),
           py::arg("path"), py::arg("device") = "auto", py::arg("n_ctx") = kDefaultContext,
           py::arg("n_threads") = 0, py::arg("n_batch") = 512, py::arg("cuda_graphs") = "patch",
           py::arg("cuda_graph_debug") = false, py::arg("use_mmap") = true,
           py::arg("kv_type") = ContextOptions().kv_type, py::arg("allow_longer_context") = false,
           py::arg("n_seq_max") = 1, py::arg("swa_full") = false)
      .def("open_sequence", &Context::open_sequence)
      .def("close_sequence", &Context::close_sequence, py::arg("id"))
      .def("select_sequence", &Context::select_sequence, py::arg("id"))
      .def_property_readonly("sequence", &Context::sequence)
      .def_property_readonly("n_seq_max", &Context::n_seq_max)
      .def_property_readonly("kv_bytes", &Context::kv_bytes)
      .def_property_readonly("n_seq_open", &Context::n_seq_open)
      .def(
          "decode_batch",
          [](Context& c, const py::handle& seqs, const py::handle& tokens) {
            std::vector<int32_t> ids = to_ids(tokens, "decode_batch");
            std::vector<int32_t> sq32 = to_ids(seqs, "decode_batch");
            if (sq32.size() != ids.size())
              throw ArgumentError("decode_batch: " + std::to_string(sq32.size()) +
                                  " sequences for " + std::to_string(ids.size()) + " tokens");
            std::vector<int> sq(sq32.begin(), sq32.end());
            // The logits go straight into the array's memory (not zeroed first: every row the
            // caller sees is written); the padding rows past the batch stay out of its view.
            const auto n = py::ssize_t(ids.size()), n_vocab = py::ssize_t(c.n_vocab());
            py::array_t<float> out =
                host_array(c, {py::ssize_t(c.decode_batch_rows(ids.size())), n_vocab});
            float* data = out.mutable_data();
            {
              py::gil_scoped_release release;
              c.decode_batch(sq.data(), ids.data(), ids.size(), data);
            }
            return py::array_t<float>({n, n_vocab}, data, out);
          },
          py::arg("seqs"), py::arg("tokens"))
      .def(
          "eval",
          [](Context& c, const py::handle& tokens, bool all_logits, int64_t cancel_epoch) {
            std::vector<int32_t> ids = to_ids(tokens, "eval");
            std::vector<float> logits;
            // Ctrl-C stops a long input between chunks: the pending signal's KeyboardInterrupt
            // is raised, and the context is as it was.
            bool interrupted = false;
            auto check_signals = [&] {
              py::gil_scoped_acquire acquire;
              interrupted = PyErr_CheckSignals() != 0;
              return interrupted;
            };
            // Cancels after the count the caller read before it waited for the model stop it
            // (Context::cancel_epoch); without one, those made before this call are stale.
            if (cancel_epoch >= 0)
              c.arm_cancel(uint64_t(cancel_epoch));
            else
              c.clear_cancel();
            try {
              py::gil_scoped_release release;
              logits = c.eval(ids.data(), ids.size(), all_logits, check_signals);
            } catch (const Cancelled&) {
              if (interrupted) throw py::error_already_set();
              throw;
            }
            const py::ssize_t n_vocab = c.n_vocab();
            auto* heap = new std::vector<float>(std::move(logits));
            py::capsule owner(heap, [](void* p) { delete static_cast<std::vector<float>*>(p); });
            if (all_logits)
              return py::array_t<float>({py::ssize_t(ids.size()), n_vocab}, heap->data(), owner);
            return py::array_t<float>({n_vocab}, heap->data(), owner);
          },
          py::arg("tokens"), py::arg("all_logits") = false, py::arg("cancel_epoch") = -1)
      .def("cancel_epoch", &Context::cancel_epoch, py::arg("seq"))
      .def_property_readonly("max_state_bytes", &Context::max_state_bytes)
      .def("reset", &Context::reset)
      .def("rewind", &Context::rewind, py::arg("n"))
      .def_property_readonly("tokens", [](const Context& c) { return c.tokens(); })
      .def("embed",
           [](Context& c, const py::handle& tokens) {
             std::vector<int32_t> ids = to_ids(tokens, "embed");
             std::vector<float> out;
             {
               py::gil_scoped_release release;
               out = c.embed(ids.data(), ids.size());
             }
             py::array_t<float> a({py::ssize_t(ids.size()), py::ssize_t(c.n_embd())});
             std::copy(out.begin(), out.end(), a.mutable_data());
             return a;
           })
      .def("save_state",
           [](const Context& c) {
             std::vector<uint8_t> s;
             {
               py::gil_scoped_release release;
               s = c.save_state();
             }
             return py::bytes(reinterpret_cast<const char*>(s.data()), s.size());
           })
      .def("load_state",
           [](Context& c, const py::buffer& data) {
             const py::buffer_info b = data.request();
             if (b.ndim != 1 || b.itemsize != 1) throw ArgumentError("load_state: expected bytes");
             py::gil_scoped_release release;
             c.load_state(static_cast<const uint8_t*>(b.ptr), size_t(b.size));
           })
      .def("load_state_file",
           [](Context& c, int fd, const std::string& path) {
             py::gil_scoped_release release;
             c.load_state_file(fd, path);
           })
      .def(
          "copy_prefix",
          [](Context& c, int from, int n) {
            py::gil_scoped_release release;
            c.copy_prefix(from, n);
          },
          py::arg("from_seq"), py::arg("n"))
      .def("cancel", &Context::cancel, py::arg("seq") = 0)
      .def_property_readonly("n_past", &Context::n_past)
      .def_property_readonly("n_ctx", &Context::n_ctx)
      .def_property_readonly("n_ctx_train", &Context::n_ctx_train)
      .def_property_readonly("kv_type", &Context::kv_type)
      .def_property_readonly("n_vocab", &Context::n_vocab)
      .def_property_readonly("device", &Context::device)
      .def_property_readonly("backend_name", [](Context& c) { return c.backend().name(); })
      .def_property_readonly("metadata", [](const Context& c) { return metadata_dict(c.file()); })
      .def_property_readonly("n_layer", [](const Context& c) { return c.model().n_layer; })
      .def_property_readonly("weight_bytes",
                             [](const Context& c) { return c.model().weight_bytes; })
      .def_property_readonly("graph_stats", [](Context& c) { return c.backend().stats(); })
      .def("reset_graph_stats", [](Context& c) { c.backend().reset_stats(); })
      .def("cuda_graph_handle", [](Context& c) { return c.backend().graph_handle(); })
      .def("dump_cuda_graph",
           [](Context& c, const std::string& path) { c.backend().dump_graph(path); })
      .def("debug_corrupt_next_patch", [](Context& c) { c.backend().debug_corrupt_next_patch(); });
  bind_text(context, [](const Context& c) -> const Tokenizer& { return c.tokenizer(); });
}
