// strata predict: S3's output-length predictor (coordinator/s3/length_predictor.h,
// docs/S3.md). `train` fits one on JSONL rows, `eval` measures it on rows it has not seen,
// `online` replays rows in order predicting each before learning it (the supervisor's
// retraining, evaluated prequentially).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "coordinator/s3/length_predictor.h"
#include "kernels/clock.h"
#include "kernels/error.h"
#include "launch/commands.h"
#include "worker/input_limits.h"
#include "worker/tokenizer.h"

namespace strata::cli {
namespace {

struct DataOptions {
  std::vector<std::string> files;
  std::string tokenizer;
  LengthFields fields;
  int64_t skip = 0;
  int64_t limit = -1;
};

struct PredictOptions {
  DataOptions data;
  LengthPredictorOptions model;
  int32_t epochs = 4;
  std::string model_path;  // train, online: where to write; eval, online: what to read
  std::string out;
  double confidence = 0.9;
  int64_t window = 200;
  std::string json_out;
};

// A tokenizer file or a model folder holding one. The predictor hashes ids and has no
// embedding table, so any number of tokens is accepted.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path) {
  return Tokenizer::open(path, InputLimits::from_env());
}

std::vector<LengthExample> read_data(const DataOptions& d) {
  const auto tok = load_tokenizer(d.tokenizer);
  std::vector<LengthExample> all;
  for (const std::string& file : d.files) {
    auto part = read_length_examples(file, *tok, d.fields, d.skip, d.limit);
    if (part.empty())
      fail_input("{}: no rows selected (--skip {}, --limit {})", file, d.skip,
                 d.limit < 0 ? "all" : std::to_string(d.limit));
    all.insert(all.end(), std::make_move_iterator(part.begin()),
               std::make_move_iterator(part.end()));
  }
  return all;
}

void write_json(const std::string& path, const std::string& json) {
  if (path.empty()) return;
  std::ofstream f(path, std::ios::trunc);
  f << json << '\n';
  f.close();
  if (!f) fail_input("--json {}: cannot write", path);
}

void add_data_options(CLI::App* cmd, DataOptions& d) {
  cmd->add_option("--data", d.files, "JSONL rows (repeatable; --skip / --limit apply to each)")
      ->required();
  cmd->add_option("--tokenizer", d.tokenizer,
                  "The served model's sentencepiece tokenizer.model, or its model folder")
      ->required();
  cmd->add_option("--prompt-field", d.fields.prompt,
                  "Prompt field (default: question, instruction, prompt or prompt_ids)");
  cmd->add_option("--output-field", d.fields.output,
                  "Output field: text or a token count (default: answer, output, completion, "
                  "output_len or output_tokens)");
  cmd->add_option("--skip", d.skip, "Rows to skip first (blank lines are not rows)")
      ->check(non_negative());
  cmd->add_option("--limit", d.limit, "Rows to read after --skip (default: all)")
      ->check(non_negative());
}

// The options of a new model; returned so that `online --model` can exclude them.
std::vector<CLI::Option*> add_model_options(CLI::App* cmd, LengthPredictorOptions& m) {
  return {
      cmd->add_option("--buckets", m.buckets.count, "Length buckets (S3: 10)"),
      cmd->add_option("--bucket-width", m.buckets.width,
                      "Output tokens per bucket (S3: max length / buckets); the last is open"),
      cmd->add_option("--hash-bits", m.hash_bits, "Hashed n-gram features: 2^N of them"),
      cmd->add_option("--ngram-order", m.ngram_order, "Token n-grams up to this order (1 to 3)"),
      cmd->add_option("--learning-rate", m.learning_rate, "AdaGrad's base step"),
      cmd->add_option("--l2", m.l2, "L2 penalty"),
      cmd->add_option("--adagrad-init", m.adagrad_init,
                      "AdaGrad's starting squared-gradient sum (0: plain AdaGrad)"),
      cmd->add_option("--seed", m.seed, "Shuffle order of the training passes"),
  };
}

int run_train(const PredictOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto examples = read_data(o.data);
  const double read_s = seconds_since(t0);
  LengthPredictor p(o.model);
  p.train(examples, o.epochs);
  const double train_s = seconds_since(t0) - read_s;
  p.save(o.out);
  std::printf(
      "trained on %zu examples, %d epochs (%s) in %.2f s (reading %.2f s); wrote %s (%ju bytes)\n",
      examples.size(), o.epochs, o.model.str().c_str(), train_s, read_s, o.out.c_str(),
      static_cast<uintmax_t>(std::filesystem::file_size(o.out)));
  return 0;
}

int run_eval(const PredictOptions& o) {
  const LengthPredictor p = LengthPredictor::load(o.model_path);
  const auto examples = read_data(o.data);
  const auto t0 = std::chrono::steady_clock::now();
  const LengthEval ev = p.evaluate(examples, o.confidence);
  const double eval_s = seconds_since(t0);
  std::printf("model %s: %s, learned from %jd examples\n%s", o.model_path.c_str(),
              p.options().buckets.str().c_str(), static_cast<intmax_t>(p.examples_learned()),
              ev.str().c_str());
  // S3 measures its predictor's latency (DistilBERT, 3.7 ms on an A100): this is ours.
  std::printf("predicted %jd prompts in %.3f s (%.1f us each, one thread)\n",
              static_cast<intmax_t>(ev.n), eval_s, 1e6 * eval_s / static_cast<double>(ev.n));
  write_json(o.json_out, ev.json());
  return 0;
}

// One window of the online replay.
struct Window {
  size_t from = 0, to = 0;
  int64_t right = 0, distance = 0, covered = 0;
  double reserved = 0;

  void add(const std::vector<double>& dist, int32_t output_len, const LengthBuckets& bk,
           double confidence) {
    const auto predicted =
        static_cast<int32_t>(std::max_element(dist.begin(), dist.end()) - dist.begin());
    const int32_t truth = bk.bucket_of(output_len);
    right += predicted == truth;
    distance += std::abs(predicted - truth);
    const int32_t r = reservation_from(dist, bk, confidence);
    covered += r >= output_len;
    reserved += r;
  }
  double share(double v) const { return v / static_cast<double>(to - from); }
  nlohmann::ordered_json json() const {
    return {{"from", from},
            {"to", to},
            {"accuracy", share(static_cast<double>(right))},
            {"mean_distance", share(static_cast<double>(distance))},
            {"reservation_cover", share(static_cast<double>(covered))},
            {"mean_reservation", share(reserved)}};
  }
  void print() const {
    std::printf("%8zu %8zu %8.2f%% %9.3f %8.2f%% %11.1f\n", from, to,
                100 * share(static_cast<double>(right)), share(static_cast<double>(distance)),
                100 * share(static_cast<double>(covered)), share(reserved));
  }
};

// Prequential: each row is predicted by the model as it stood before that row, then learned
// (the supervisor's retraining as requests complete), reported per window of rows.
int run_online(const PredictOptions& o) {
  LengthPredictor p =
      o.model_path.empty() ? LengthPredictor(o.model) : LengthPredictor::load(o.model_path);
  const auto examples = read_data(o.data);
  nlohmann::ordered_json windows = nlohmann::ordered_json::array();
  std::printf("%8s %8s %9s %9s %9s %11s\n", "from", "to", "accuracy", "distance", "cover",
              "reserved");
  int64_t right = 0;
  for (size_t start = 0; start < examples.size(); start += static_cast<size_t>(o.window)) {
    Window w{start, std::min(examples.size(), start + static_cast<size_t>(o.window))};
    for (size_t i = w.from; i < w.to; ++i) {
      w.add(p.distribution(examples[i].query()), examples[i].output_len, p.options().buckets,
            o.confidence);
      p.learn(examples[i].query(), examples[i].output_len);
    }
    right += w.right;
    windows.push_back(w.json());
    w.print();
  }
  const double accuracy = static_cast<double>(right) / static_cast<double>(examples.size());
  std::printf("overall prequential accuracy %.2f%% over %zu examples (%s)\n", 100 * accuracy,
              examples.size(), p.options().str().c_str());
  if (!o.out.empty()) p.save(o.out);
  nlohmann::ordered_json j;
  j["examples"] = examples.size();
  j["window"] = o.window;
  j["confidence"] = o.confidence;
  j["accuracy"] = accuracy;
  j["windows"] = windows;
  write_json(o.json_out, j.dump());
  return 0;
}

// The rows as requests whose output lengths are enforced as ../shared/datasets/README.md
// says (ignore_eos, max_new_tokens = the answer's length): S3's packing benchmark serves them.
int run_requests(const PredictOptions& o) {
  const std::vector<LengthExample> rows = read_data(o.data);
  std::ofstream f(o.out, std::ios::trunc);
  for (size_t i = 0; i < rows.size(); ++i) {
    nlohmann::ordered_json j;
    j["id"] = fmt::format("row-{}", o.data.skip + static_cast<int64_t>(i));
    j["prompt_ids"] = rows[i].prompt_ids;
    j["max_new_tokens"] = std::max(1, rows[i].output_len);
    j["ignore_eos"] = true;
    f << j.dump() << '\n';
  }
  f.close();
  if (!f) fail_input("--out {}: cannot write", o.out);
  std::fprintf(stderr, "%zu requests written to %s\n", rows.size(), o.out.c_str());
  return 0;
}

}  // namespace

Command add_predict(CLI::App& app) {
  auto o = std::make_shared<PredictOptions>();
  CLI::App* cmd = app.add_subcommand(
      "predict", "S3's output-length predictor: train, evaluate, replay online (docs/S3.md)");
  cmd->require_subcommand(1);

  CLI::App* train = cmd->add_subcommand("train", "Fit a predictor on JSONL rows and save it");
  add_data_options(train, o->data);
  add_model_options(train, o->model);
  train->add_option("--epochs", o->epochs, "Passes over the rows")->check(positive());
  train->add_option("--out", o->out, "Model file to write")->required();

  CLI::App* eval = cmd->add_subcommand("eval", "Accuracy, distance and reservation cover");
  add_data_options(eval, o->data);
  eval->add_option("--model", o->model_path, "Model file from predict train")->required();
  eval->add_option("--confidence", o->confidence, "Reserve up to this cumulative probability")
      ->check(CLI::Range(0.0, 1.0));
  eval->add_option("--json", o->json_out, "Also write the evaluation as JSON to this file");

  CLI::App* online = cmd->add_subcommand(
      "online", "Predict each row before learning it; accuracy per window of rows");
  add_data_options(online, o->data);
  const auto fresh = add_model_options(online, o->model);
  CLI::Option* start =
      online->add_option("--model", o->model_path, "Start from this model (default: a new one)");
  for (CLI::Option* f : fresh) start->excludes(f);
  online->add_option("--window", o->window, "Rows per reported window")->check(positive());
  online->add_option("--confidence", o->confidence, "Reserve up to this cumulative probability")
      ->check(CLI::Range(0.0, 1.0));
  online->add_option("--out", o->out, "Save the model after the last row");
  online->add_option("--json", o->json_out, "Also write the windows as JSON to this file");

  CLI::App* requests = cmd->add_subcommand(
      "requests", "The rows as requests with their true output lengths enforced (benchmarks)");
  add_data_options(requests, o->data);
  requests->add_option("--out", o->out, "JSONL request file to write")->required();

  return {cmd, [o, train, eval, requests] {
            if (train->parsed()) return run_train(*o);
            if (eval->parsed()) return run_eval(*o);
            if (requests->parsed()) return run_requests(*o);
            return run_online(*o);
          }};
}

}  // namespace strata::cli
