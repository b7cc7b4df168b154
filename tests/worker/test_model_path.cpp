// Models where users keep them (worker/model_path.h): a fake Hugging Face hub cache built
// as huggingface_hub lays one out — blobs/ holding the files, snapshots/REV/ holding
// relative symlinks into ../../blobs/, refs/NAME holding a commit — from stories260K's own
// files, one-file and sharded. A snapshot must give the very logits of the plain folder, and
// ORG/NAME must find the snapshot refs/main names, through each variable that places the cache.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "kernels/cpu_backend.h"
#include "kernels/error.h"
#include "kernels/tunables.h"
#include "support/input_error.h"
#include "support/scoped_variable.h"
#include "support/stories_reference.h"
#include "worker/dummy.h"
#include "worker/loader.h"
#include "worker/model.h"
#include "worker/model_path.h"
#include "worker/safetensors.h"
#include "worker/scoring.h"
#include "worker/tokenizer.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

template <typename Fn>
std::string error_of(Fn fn) {
  return testing::input_error(fn);
}

// Sets (or, with nullptr, unsets) one variable for a test's length.
struct ScopedVariable : testing::ScopedVariable {
  ScopedVariable(const std::string& name, const char* value)
      : testing::ScopedVariable(name, value, foreign_variable(name.c_str())) {}
};

// The five variables that place the cache, all cleared, then `hf_hub_cache` / `hf_home`.
struct ScopedHubVariables {
  ScopedVariable a, b, c, d;
  ScopedHubVariables(const char* hf_hub_cache, const char* hf_home)
      : a("HF_HUB_CACHE", hf_hub_cache),
        b("HUGGINGFACE_HUB_CACHE", nullptr),
        c("HF_HOME", hf_home),
        d("XDG_CACHE_HOME", nullptr) {}
};

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A blob's name: huggingface_hub uses the file's etag (a sha256 or git sha1); any content
// hash does, so FNV-1a of the bytes in hex.
std::string blob_name(const std::string& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : bytes) h = (h ^ ch) * 1099511628211ull;
  char out[17];
  std::snprintf(out, sizeof(out), "%016llx", static_cast<unsigned long long>(h));
  return std::string(out) + "00000000000000000000000000";
}

constexpr const char* kStoriesFiles[] = {"config.json", "generation_config.json", "tokenizer.model",
                                         "tokenizer_config.json"};

// stories260K split in two shards with its index, in `dir` (the layers' first half with the
// embedding, the rest with the final norm).
void write_sharded_stories(const fs::path& dir) {
  fs::create_directories(dir);
  auto src =
      SafetensorsFile::open((fs::path(testing::stories_dir()) / "model.safetensors").string());
  std::vector<TensorToWrite> shard[2];
  json weight_map = json::object();
  const size_t n = src->tensors().size();
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const auto& t = src->tensors()[i];
    const int s = i < n / 2 ? 0 : 1;
    shard[s].push_back(TensorToWrite{t.name, src->view(t)});
    weight_map[t.name] = fmt::format("model-0000{}-of-00002.safetensors", s + 1);
    total += static_cast<int64_t>(t.end - t.begin);
  }
  ASSERT_FALSE(shard[0].empty());
  ASSERT_FALSE(shard[1].empty());
  for (int s = 0; s < 2; ++s)
    write_safetensors((dir / fmt::format("model-0000{}-of-00002.safetensors", s + 1)).string(),
                      shard[s]);
  std::ofstream(dir / "model.safetensors.index.json")
      << json{{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}}.dump(2);
}

// A hub cache under the test's temp folder: `hub` is the cache, `home` the HF_HOME above it.
struct FakeHub {
  fs::path home, hub;
  explicit FakeHub(const std::string& name)
      : home(fs::path(STRATA_TEST_TMP) / "model_path" / name), hub(home / "hub") {
    fs::remove_all(home);
    fs::create_directories(hub);
  }
  fs::path repo(const std::string& id) const {
    const size_t slash = id.find('/');
    return hub / ("models--" + id.substr(0, slash) + "--" + id.substr(slash + 1));
  }
  // Snapshot `commit` of repo `id` holding `files` (name -> the file to store), each a blob
  // with a relative link to it, as huggingface_hub writes them.
  fs::path snapshot(const std::string& id, const std::string& commit,
                    const std::map<std::string, fs::path>& files) const {
    const fs::path r = repo(id);
    const fs::path snap = r / "snapshots" / commit;
    fs::create_directories(r / "blobs");
    fs::create_directories(snap);
    for (const auto& [name, from] : files) {
      const std::string bytes = file_bytes(from);
      const std::string blob = blob_name(bytes);
      if (!fs::exists(r / "blobs" / blob)) fs::copy_file(from, r / "blobs" / blob);
      fs::create_symlink(fs::path("../../blobs") / blob, snap / name);
    }
    return snap;
  }
  void ref(const std::string& id, const std::string& name, const std::string& commit) const {
    fs::create_directories((repo(id) / "refs" / name).parent_path());
    std::ofstream(repo(id) / "refs" / name) << commit;  // no newline, as huggingface_hub writes
  }
};

std::map<std::string, fs::path> stories_files(bool sharded, const fs::path& shards) {
  std::map<std::string, fs::path> files;
  for (const char* f : kStoriesFiles) files[f] = fs::path(testing::stories_dir()) / f;
  if (sharded) {
    write_sharded_stories(shards);
    for (const char* f : {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                          "model.safetensors.index.json"})
      files[f] = shards / f;
  } else {
    files["model.safetensors"] = fs::path(testing::stories_dir()) / "model.safetensors";
  }
  return files;
}

// Teacher-forced logits of the first reference sequence, the model loaded from `spec`.
std::vector<float> logits_of(const std::string& spec) {
  LoadedModel m = load_model(spec);
  CpuBackend backend(1);
  Model model(m.config, std::move(m.weights), backend, 128);
  return teacher_forced_logits(model, testing::load_stories_references().front().sequence(), 128);
}

const char* kOld = "0123456789abcdef0123456789abcdef01234567";
const char* kNew = "fedcba9876543210fedcba9876543210fedcba98";

// Repo `id` with two snapshots: kOld (a config whose BOS id differs, so a wrong pick shows)
// and kNew (stories260K as it is); refs/main names kNew, refs/v1 kOld.
void two_snapshots(const FakeHub& h, const std::string& id) {
  const fs::path edited = h.home / "old-config.json";
  json cfg = json::parse(file_bytes(fs::path(testing::stories_dir()) / "config.json"));
  cfg["bos_token_id"] = 7;
  std::ofstream(edited) << cfg.dump(2);
  auto old_files = stories_files(false, {});
  old_files["config.json"] = edited;
  h.snapshot(id, kOld, old_files);
  h.snapshot(id, kNew, stories_files(false, {}));
  h.ref(id, "main", kNew);
  h.ref(id, "v1", kOld);
}

TEST(HubCache, PrecedenceIsHuggingFaceHubs) {
  HubEnvironment e;
  e.home = "/home/u";
  EXPECT_EQ(hub_cache(e).dir, "/home/u/.cache/huggingface/hub");
  e.xdg_cache_home = "/xdg";
  EXPECT_EQ(hub_cache(e).dir, "/xdg/huggingface/hub");
  e.hf_home = "~/hf";  // a leading ~ is HOME
  EXPECT_EQ(hub_cache(e).dir, "/home/u/hf/hub");
  e.huggingface_hub_cache = "/legacy";
  EXPECT_EQ(hub_cache(e).dir, "/legacy");
  e.hf_hub_cache = "/cache";
  EXPECT_EQ(hub_cache(e).dir, "/cache");
  EXPECT_EQ(hub_cache(e).why, "HF_HUB_CACHE=/cache");
  e.hf_hub_cache = "";  // empty counts as unset
  EXPECT_EQ(hub_cache(e).dir, "/legacy");
  EXPECT_EQ(hub_cache(HubEnvironment{}).dir, "");
}

TEST(HubCache, HubNamesAndPaths) {
  for (const char* yes : {"meta-llama/Llama-3.2-1B", "Qwen/Qwen2.5-0.5B@main", "a/b@refs/pr/1",
                          "HuggingFaceTB/SmolLM2-135M@0123abc", "a_b/c.d"})
    EXPECT_TRUE(is_hub_name(yes)) << yes;
  for (const char* no : {"gpt2", "a/b/c", "./a", "../a", "/abs/dir", "a/", "/a/b", "dummy:opt-125m",
                         "a--b/c", "a/-b", "a/b.", "a/b@", "a/b@../x", "a/b@x/../../y", "a b/c"})
    EXPECT_FALSE(is_hub_name(no)) << no;
}

TEST(ModelPath, FoldersAndDummiesAreUntouched) {
  HubEnvironment e;
  e.hf_hub_cache = "/no/such/cache";
  EXPECT_EQ(resolve_model_path(testing::stories_dir(), e), testing::stories_dir());
  EXPECT_EQ(resolve_model_path("dummy:opt-125m", e), "dummy:opt-125m");
  EXPECT_EQ(resolve_model_path("dummy:org/name", e), "dummy:org/name");
  EXPECT_EQ(resolve_model_path("", e), "");
  // Not a path and not a hub name: left for the loader to refuse as before.
  EXPECT_EQ(resolve_model_path("/no/such/model", e), "/no/such/model");
}

// A snapshot folder, its files links into blobs/, loads to the very logits of the folder.
TEST(ModelPath, SnapshotFolderGivesTheFoldersLogits) {
  FakeHub h("snapshot");
  const fs::path one = h.snapshot("strata-test/stories260K", kNew, stories_files(false, {}));
  const fs::path sharded =
      h.snapshot("strata-test/stories260K-sharded", kNew, stories_files(true, h.home / "shards"));
  ASSERT_TRUE(fs::is_symlink(one / "model.safetensors"));
  ASSERT_TRUE(fs::is_symlink(sharded / "model-00002-of-00002.safetensors"));
  EXPECT_EQ(resolve_model_path(one.string(), HubEnvironment{}), one.string());

  const std::vector<float> want = logits_of(testing::stories_dir());
  ASSERT_FALSE(want.empty());
  EXPECT_EQ(logits_of(one.string()), want);
  EXPECT_EQ(logits_of(sharded.string()), want);
  // The tokenizer is read through its link too, and so is the config's BOS id.
  LoadedModel m = load_model(sharded.string());
  EXPECT_EQ(m.tokenizer->kind(), "sentencepiece");
  EXPECT_EQ(m.tokenizer->encode("Once upon a time", true),
            testing::load_stories_references().front().prompt_ids);
}

TEST(ModelPath, RepoFolderTakesRefsMainOrItsOnlySnapshot) {
  FakeHub h("repo");
  two_snapshots(h, "strata-test/stories260K");
  const fs::path repo = h.repo("strata-test/stories260K");
  EXPECT_EQ(resolve_model_path(repo.string(), HubEnvironment{}),
            (repo / "snapshots" / kNew).string());
  EXPECT_EQ(load_spec_config(repo.string(), DType::kF32).bos_token_id, 1);

  // Without refs/main: the only snapshot, or a refusal listing them when there are two.
  fs::remove(repo / "refs" / "main");
  const std::string msg = error_of([&] { resolve_model_path(repo.string(), HubEnvironment{}); });
  EXPECT_NE(msg.find("no refs/main and 2 snapshots"), std::string::npos) << msg;
  EXPECT_NE(msg.find(kOld), std::string::npos) << msg;
  EXPECT_NE(msg.find("refs/: v1"), std::string::npos) << msg;
  fs::remove_all(repo / "snapshots" / kOld);
  EXPECT_EQ(resolve_model_path(repo.string(), HubEnvironment{}),
            (repo / "snapshots" / kNew).string());
}

// ORG/NAME through HF_HUB_CACHE and through HF_HOME, in the process's own environment, as
// the engine's commands read it: the config, then the whole model, sharded too.
TEST(ModelPath, OrgNameFromTheCacheTheEnvironmentNames) {
  FakeHub h("orgname");
  two_snapshots(h, "strata-test/stories260K");
  h.snapshot("strata-test/stories260K-sharded", kNew, stories_files(true, h.home / "shards"));
  h.ref("strata-test/stories260K-sharded", "main", kNew);
  const std::string want = (h.repo("strata-test/stories260K") / "snapshots" / kNew).string();
  const std::vector<float> logits = logits_of(testing::stories_dir());
  {
    ScopedHubVariables v(h.hub.c_str(), "/no/such/hf-home");
    EXPECT_EQ(resolve_model_path("strata-test/stories260K"), want);
    EXPECT_EQ(load_spec_config("strata-test/stories260K", DType::kF32).bos_token_id, 1);
    EXPECT_EQ(logits_of("strata-test/stories260K-sharded"), logits);
  }
  {
    ScopedHubVariables v(nullptr, h.home.c_str());
    EXPECT_EQ(resolve_model_path("strata-test/stories260K"), want);
    EXPECT_EQ(logits_of("strata-test/stories260K"), logits);
    EXPECT_EQ(Tokenizer::open("strata-test/stories260K", {})->kind(), "sentencepiece");
  }
  {
    ScopedHubVariables v(nullptr, nullptr);
    ScopedVariable xdg("XDG_CACHE_HOME", (h.home / "xdg").c_str());
    fs::create_directories(h.home / "xdg");
    fs::create_directory_symlink(h.hub, h.home / "xdg" / "huggingface");
    // XDG_CACHE_HOME/huggingface is the HF home, so the cache is its hub/: the link above
    // makes XDG/huggingface the cache itself, one level short.
    EXPECT_NE(error_of([] { resolve_model_path("strata-test/stories260K"); }).find("not found"),
              std::string::npos);
    fs::remove(h.home / "xdg" / "huggingface");
    fs::create_directories(h.home / "xdg" / "huggingface");
    fs::create_directory_symlink(h.hub, h.home / "xdg" / "huggingface" / "hub");
    EXPECT_EQ(resolve_model_path("strata-test/stories260K"),
              (h.home / "xdg" / "huggingface" / "hub" / "models--strata-test--stories260K" /
               "snapshots" / kNew)
                  .string());
  }
}

TEST(ModelPath, RevisionIsARefOrACommit) {
  FakeHub h("revision");
  two_snapshots(h, "strata-test/stories260K");
  HubEnvironment e;
  e.hf_hub_cache = h.hub.string();
  const fs::path snaps = h.repo("strata-test/stories260K") / "snapshots";
  EXPECT_EQ(resolve_model_path("strata-test/stories260K@main", e), (snaps / kNew).string());
  EXPECT_EQ(resolve_model_path("strata-test/stories260K@v1", e), (snaps / kOld).string());
  EXPECT_EQ(resolve_model_path(std::string("strata-test/stories260K@") + kOld, e),
            (snaps / kOld).string());
  h.ref("strata-test/stories260K", "refs/pr/1", kOld);  // a PR revision lives under refs/refs/
  EXPECT_EQ(resolve_model_path("strata-test/stories260K@refs/pr/1", e), (snaps / kOld).string());
  const std::string msg = error_of([&] { resolve_model_path("strata-test/stories260K@v9", e); });
  EXPECT_NE(msg.find("no revision 'v9'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("refs/: main, refs/pr/1, v1"), std::string::npos) << msg;
  EXPECT_NE(msg.find(kNew), std::string::npos) << msg;
  // A ref naming a commit that has no snapshot (an interrupted download).
  h.ref("strata-test/stories260K", "main", "00000000000000000000000000000000deadbeef");
  EXPECT_NE(error_of([&] { resolve_model_path("strata-test/stories260K", e); })
                .find("names commit '00000000000000000000000000000000deadbeef', which has no "
                      "folder"),
            std::string::npos);
}

TEST(ModelPath, MissingNameIsRefusedSayingWhereItLooked) {
  FakeHub h("missing");
  two_snapshots(h, "strata-test/stories260K");
  HubEnvironment e;
  e.hf_hub_cache = h.hub.string();
  e.hf_home = "/elsewhere";
  const std::string msg = error_of([&] { resolve_model_path("strata-test/nope", e); });
  EXPECT_NE(msg.find("model 'strata-test/nope' not found"), std::string::npos) << msg;
  EXPECT_NE(msg.find((fs::current_path() / "strata-test/nope").string()), std::string::npos) << msg;
  EXPECT_NE(msg.find((h.hub / "models--strata-test--nope").string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("HF_HUB_CACHE=" + h.hub.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("Strata does not download"), std::string::npos) << msg;
  // A name differing only in case is pointed at.
  const std::string cased = error_of([&] { resolve_model_path("strata-test/Stories260K", e); });
  EXPECT_NE(cased.find("it holds strata-test/stories260K"), std::string::npos) << cased;
  // No cache at all (not even HOME).
  const std::string none =
      error_of([] { resolve_model_path("strata-test/nope", HubEnvironment{}); });
  EXPECT_NE(none.find("HOME are all unset"), std::string::npos) << none;
  // And through the engine's own path, with the process's environment.
  ScopedHubVariables v(h.hub.c_str(), nullptr);
  EXPECT_NE(error_of([] { load_model("strata-test/nope"); }).find("not found"), std::string::npos);
}

TEST(ModelPath, AnExistingFolderWinsOverTheHubName) {
  FakeHub h("folder-wins");
  two_snapshots(h, "strata-test/stories260K");
  const fs::path work = h.home / "work";
  fs::create_directories(work / "strata-test");
  fs::create_directory_symlink(testing::stories_dir(), work / "strata-test" / "stories260K");
  HubEnvironment e;
  e.hf_hub_cache = h.hub.string();
  const fs::path cwd = fs::current_path();
  fs::current_path(work);
  const std::string got = resolve_model_path("strata-test/stories260K", e);
  const std::string rev = resolve_model_path("strata-test/stories260K@v1", e);
  fs::current_path(cwd);
  EXPECT_EQ(got, "strata-test/stories260K");
  EXPECT_EQ(rev, (h.repo("strata-test/stories260K") / "snapshots" / kOld).string());
}

TEST(ModelPath, ALinkToAMissingBlobIsNamed) {
  FakeHub h("dangling");
  const fs::path snap = h.snapshot("strata-test/stories260K", kNew, stories_files(false, {}));
  h.ref("strata-test/stories260K", "main", kNew);
  const fs::path target = fs::read_symlink(snap / "model.safetensors");
  fs::remove(snap / target);  // the blob, pruned
  HubEnvironment e;
  e.hf_hub_cache = h.hub.string();
  const std::string msg = error_of([&] { resolve_model_path("strata-test/stories260K", e); });
  EXPECT_NE(msg.find((snap / "model.safetensors").string() + " is a link to " + target.string()),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("interrupted download"), std::string::npos) << msg;
}

}  // namespace
}  // namespace strata
