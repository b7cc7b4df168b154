// The stories260K reference fixtures (shared/models/stories260K/reference): greedy ids and
// full logits from llama2.c, an implementation independent of Strata.
#pragma once

#include <cstdint>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace strata::testing {

struct StoriesReference {
  std::string name;
  std::string prompt;
  std::string text;
  std::vector<int32_t> prompt_ids;
  std::vector<int32_t> output_ids;
  std::vector<float> logits;  // [n_positions, vocab]
  int32_t vocab = 0;

  std::vector<int32_t> sequence() const {
    std::vector<int32_t> s = prompt_ids;
    s.insert(s.end(), output_ids.begin(), output_ids.end());
    return s;
  }
};

inline std::string stories_dir() {
  return STRATA_MODEL_DIR;
}

inline std::vector<StoriesReference> load_stories_references() {
  const std::string ref_dir = stories_dir() + "/reference";
  std::ifstream in(ref_dir + "/greedy.jsonl");
  std::vector<StoriesReference> out;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    StoriesReference r;
    r.name = j["name"];
    r.prompt = j["prompt"];
    r.text = j["text"];
    r.prompt_ids = j["prompt_ids"].get<std::vector<int32_t>>();
    r.output_ids = j["output_ids"].get<std::vector<int32_t>>();
    r.vocab = j["vocab_size"];
    const size_t n =
        static_cast<size_t>(j["n_positions"].get<int>()) * static_cast<size_t>(r.vocab);
    r.logits.resize(n);
    std::ifstream lf(ref_dir + "/" + j["logits_file"].get<std::string>(), std::ios::binary);
    lf.read(reinterpret_cast<char*>(r.logits.data()),
            static_cast<std::streamsize>(n * sizeof(float)));
    if (!lf) r.logits.clear();
    out.push_back(std::move(r));
  }
  return out;
}

}  // namespace strata::testing
