#include <functional>
#include <map>

#include "model.h"

namespace ggraph {

std::unique_ptr<Model> load_model(const GGUFFile& file, Backend& backend) {
  static const std::map<std::string,
                        std::function<std::unique_ptr<Model>(const GGUFFile&, Backend&)>>
      loaders = {{"gemma3", load_gemma3},
                 {"llama", load_llama},
                 {"phi3", load_phi3},
                 {"qwen2", load_qwen2},
                 {"qwen3", load_qwen3}};
  const std::string arch = file.get_string("general.architecture");
  auto it = loaders.find(arch);
  if (it == loaders.end()) {
    std::string known;
    for (const auto& kv : loaders) known += (known.empty() ? "" : ", ") + kv.first;
    throw GGUFError("unsupported architecture '" + arch + "' (supported: " + known + ")");
  }
  return it->second(file, backend);
}

}  // namespace ggraph
