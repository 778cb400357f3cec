// The C API's error paths: every failure is a code and a message, never a crash.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "ggraph.h"

namespace {

std::string temp_file(const std::string& name, const std::string& bytes) {
  std::string path = testing::TempDir() + name;
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
  return path;
}

TEST(CApi, LoadFailuresReturnNullWithAReason) {
  char err[256] = {};
  EXPECT_EQ(ggraph_load(nullptr, nullptr, err, sizeof err), nullptr);
  EXPECT_NE(std::string(err).find("NULL"), std::string::npos);

  EXPECT_EQ(ggraph_load("/nonexistent/dir/model.gguf", nullptr, err, sizeof err), nullptr);
  EXPECT_NE(std::string(err).find("/nonexistent/dir/model.gguf"), std::string::npos) << err;

  const std::string bad = temp_file("not_a_model.gguf", "this is not a gguf file, at all.....");
  EXPECT_EQ(ggraph_load(bad.c_str(), nullptr, err, sizeof err), nullptr);
  EXPECT_GT(std::string(err).size(), 0u);

  // A tiny error buffer is filled and terminated, never overrun.
  char small[8];
  std::memset(small, 'x', sizeof small);
  EXPECT_EQ(ggraph_load(bad.c_str(), nullptr, small, 4), nullptr);
  EXPECT_EQ(small[3], '\0');
  EXPECT_EQ(small[4], 'x');
}

// A params struct of a size this version does not know (an application built against another
// header, or one that did not start from ggraph_default_params) is refused before anything is
// read past its end.
TEST(CApi, ParamsOfAnUnknownSizeAreRefused) {
  char err[256];
  for (size_t size : {size_t(0), size_t(8), sizeof(ggraph_params) + 8}) {
    ggraph_params p = ggraph_default_params();
    p.size = size;
    EXPECT_EQ(ggraph_load("/nonexistent/model.gguf", &p, err, sizeof err), nullptr);
    EXPECT_NE(std::string(err).find("params->size " + std::to_string(size)), std::string::npos)
        << err;
  }
}

TEST(CApi, NullModelIsAnArgumentError) {
  const int32_t tok = 1;
  EXPECT_EQ(ggraph_eval(nullptr, &tok, 1, nullptr), GGRAPH_ERR_ARGUMENT);
  EXPECT_EQ(ggraph_sample(nullptr, nullptr), GGRAPH_ERR_ARGUMENT);
  EXPECT_EQ(ggraph_decode_batch(nullptr, &tok, 1, nullptr), GGRAPH_ERR_ARGUMENT);
  EXPECT_STREQ(ggraph_last_error(nullptr), "ggraph_decode_batch: seqs is NULL");
  ggraph_model* none[1] = {nullptr};
  EXPECT_EQ(ggraph_decode_batch(none, &tok, 1, nullptr), GGRAPH_ERR_ARGUMENT);
  EXPECT_EQ(ggraph_n_vocab(nullptr), 0);
  EXPECT_STREQ(ggraph_last_error(nullptr), "model is NULL");
  ggraph_reset(nullptr);
  ggraph_free(nullptr);
}

TEST(CApi, DefaultsAreSensible) {
  const ggraph_params p = ggraph_default_params();
  EXPECT_EQ(p.size, sizeof(ggraph_params));
  EXPECT_STREQ(p.device, "auto");
  EXPECT_EQ(p.n_ctx, -1);  // 2048, or the training length where shorter
  EXPECT_STREQ(p.cuda_graphs, "patch");
  EXPECT_STREQ(p.kv_type, "auto");
  EXPECT_EQ(p.allow_longer_context, 0);
  const ggraph_sampling s = ggraph_default_sampling();
  EXPECT_GT(s.temperature, 0.0f);
  EXPECT_GT(s.top_p, 0.0f);
}

}  // namespace
