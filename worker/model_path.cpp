#include "worker/model_path.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string_view>
#include <vector>

#include "kernels/error.h"
#include "kernels/tunables.h"
#include "worker/dummy.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

const std::string* value_of(const std::optional<std::string>& v) {
  return v && !v->empty() ? &*v : nullptr;
}

// A leading "~" is HOME, as Python's os.path.expanduser has it.
std::string expand_home(const std::string& path, const HubEnvironment& env) {
  const std::string* home = value_of(env.home);
  if (home != nullptr && (path == "~" || path.starts_with("~/"))) return *home + path.substr(1);
  return path;
}

// One half of a repo id as the hub allows it: letters, digits, '-', '_', '.', neither
// starting nor ending with '-' or '.', no "--" (the cache's separator) and no "..".
bool repo_part(std::string_view s) {
  if (s.empty() || s.size() > 96) return false;
  for (const char c : s)
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '-' && c != '_' && c != '.')
      return false;
  const auto edge = [](char c) { return c == '-' || c == '.'; };
  return !edge(s.front()) && !edge(s.back()) && s.find("--") == std::string_view::npos &&
         s.find("..") == std::string_view::npos;
}

// A revision: a branch or tag name (which may hold '/', as refs/pr/1) or a commit hash; it
// names a file under refs/ or a folder under snapshots/, so it may not climb out of them.
bool revision_ok(std::string_view rev) {
  if (rev.empty() || rev.front() == '/' || rev.back() == '/') return false;
  for (const auto& part : fs::path(rev))
    if (part == "." || part == ".." || part.empty()) return false;
  return std::none_of(rev.begin(), rev.end(), [](char c) {
    return std::isspace(static_cast<unsigned char>(c)) || c == '\\';
  });
}

struct HubName {
  std::string org, name;
  std::optional<std::string> revision;
  std::string id() const { return org + "/" + name; }
  std::string folder() const { return "models--" + org + "--" + name; }
};

std::optional<HubName> parse_hub_name(const std::string& spec) {
  const size_t at = spec.find('@');
  const std::string_view id = std::string_view(spec).substr(0, at);
  const size_t slash = id.find('/');
  if (slash == std::string_view::npos) return std::nullopt;
  HubName n{std::string(id.substr(0, slash)), std::string(id.substr(slash + 1)), std::nullopt};
  if (!repo_part(n.org) || !repo_part(n.name)) return std::nullopt;
  if (at != std::string::npos) {
    n.revision = spec.substr(at + 1);
    if (!revision_ok(*n.revision)) return std::nullopt;
  }
  return n;
}

// The names under `dir` (files under refs/, recursively: "main", "refs/pr/1"; or the
// folders under snapshots/), sorted, for messages.
std::vector<std::string> listing(const fs::path& dir, bool files) {
  std::vector<std::string> out;
  std::error_code ec;
  if (files) {
    for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != decltype(it)();
         it.increment(ec))
      if (it->is_regular_file(ec)) out.push_back(it->path().lexically_relative(dir).string());
  } else {
    for (auto it = fs::directory_iterator(dir, ec); !ec && it != decltype(it)(); it.increment(ec))
      if (it->is_directory(ec)) out.push_back(it->path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string joined(const std::vector<std::string>& names) {
  if (names.empty()) return "none";
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

// What a repo folder holds, for a message that has to say which revisions there are.
std::string holdings(const fs::path& repo) {
  return "refs/: " + joined(listing(repo / "refs", true)) +
         "; snapshots/: " + joined(listing(repo / "snapshots", false));
}

// A repo folder of the hub cache (models--ORG--NAME): snapshots/ and no model of its own.
bool is_repo_folder(const fs::path& dir) {
  std::error_code ec;
  return fs::is_directory(dir / "snapshots", ec) && !fs::exists(dir / "config.json", ec);
}

// Every file of a snapshot is a link into blobs/; one whose blob is gone is an interrupted
// or pruned download, which would otherwise surface as a "missing" config.json or shard.
void check_snapshot(const std::string& spec, const fs::path& snapshot) {
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(snapshot, ec); !ec && it != decltype(it)();
       it.increment(ec)) {
    if (!it->is_symlink(ec) || fs::exists(it->path(), ec)) continue;
    fail_input(
        "model '{}': {} is a link to {}, which does not exist (an interrupted download? "
        "fetch the model again)",
        spec, it->path().string(), fs::read_symlink(it->path(), ec).string());
  }
}

std::string read_ref(const fs::path& file) {
  std::ifstream in(file);
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  return s;
}

// The snapshot folder of `revision` in a repo folder: the commit refs/REVISION names, or
// the snapshot called REVISION. No revision: refs/main, else the only snapshot.
fs::path snapshot_of(const std::string& spec, const fs::path& repo,
                     const std::optional<std::string>& revision) {
  std::error_code ec;
  const fs::path snapshots = repo / "snapshots";
  const std::string rev = revision.value_or("main");
  fs::path snapshot;
  if (fs::is_regular_file(repo / "refs" / rev, ec)) {
    const std::string commit = read_ref(repo / "refs" / rev);
    snapshot = snapshots / commit;
    if (commit.empty() || !revision_ok(commit) || !fs::is_directory(snapshot, ec))
      fail_input(
          "model '{}': {} names commit '{}', which has no folder in {} (an interrupted "
          "download? {})",
          spec, (repo / "refs" / rev).string(), commit, snapshots.string(), holdings(repo));
  } else if (fs::is_directory(snapshots / rev, ec)) {
    snapshot = snapshots / rev;
  } else if (!revision) {
    const std::vector<std::string> all = listing(snapshots, false);
    if (all.size() != 1)
      fail_input(
          "model '{}': {} has no refs/main and {} snapshots; name one as ORG/NAME@REV or "
          "pass its snapshots/REV folder ({})",
          spec, repo.string(), all.size(), holdings(repo));
    snapshot = snapshots / all.front();
  } else {
    fail_input("model '{}': no revision '{}' in {} ({})", spec, rev, repo.string(), holdings(repo));
  }
  check_snapshot(spec, snapshot);
  return snapshot;
}

// A repo folder in the cache whose name differs from `folder` only in case, for a hint.
std::string case_hint(const fs::path& cache, const std::string& folder) {
  const auto lower = [](std::string s) {
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
  };
  for (const std::string& other : listing(cache, false))
    if (other != folder && lower(other) == lower(folder)) {
      const std::string_view id =
          std::string_view(other).substr(std::string_view("models--").size());
      const size_t sep = id.find("--");
      return fmt::format("; it holds {}/{}, and names are case-sensitive", id.substr(0, sep),
                         id.substr(sep + 2));
    }
  return "";
}

}  // namespace

HubEnvironment HubEnvironment::from_process() {
  return HubEnvironment{foreign_variable("HF_HUB_CACHE"), foreign_variable("HUGGINGFACE_HUB_CACHE"),
                        foreign_variable("HF_HOME"), foreign_variable("XDG_CACHE_HOME"),
                        foreign_variable("HOME")};
}

HubCache hub_cache(const HubEnvironment& env) {
  if (const std::string* v = value_of(env.hf_hub_cache))
    return {expand_home(*v, env), "HF_HUB_CACHE=" + *v};
  if (const std::string* v = value_of(env.huggingface_hub_cache))
    return {expand_home(*v, env), "HUGGINGFACE_HUB_CACHE=" + *v};
  if (const std::string* v = value_of(env.hf_home))
    return {expand_home(*v, env) + "/hub", "HF_HOME=" + *v + ", its hub/"};
  if (const std::string* v = value_of(env.xdg_cache_home))
    return {expand_home(*v, env) + "/huggingface/hub",
            "XDG_CACHE_HOME=" + *v + ", its huggingface/hub/"};
  if (const std::string* v = value_of(env.home))
    return {*v + "/.cache/huggingface/hub",
            "the default ~/.cache/huggingface/hub: HF_HUB_CACHE and HF_HOME are unset"};
  return {"", "HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME and HOME are all unset"};
}

bool is_hub_name(const std::string& spec) {
  return parse_hub_name(spec).has_value();
}

std::string resolve_model_path(const std::string& spec, const HubEnvironment& env) {
  if (spec.empty() || is_dummy_model(spec)) return spec;
  std::error_code ec;
  if (fs::exists(spec, ec))  // a folder, a snapshot folder or a file: the path wins
    return is_repo_folder(spec) ? snapshot_of(spec, spec, std::nullopt).string() : spec;
  const std::optional<HubName> name = parse_hub_name(spec);
  if (!name) return spec;
  const HubCache cache = hub_cache(env);
  const std::string folder = fs::absolute(spec, ec).string();
  if (cache.dir.empty())
    fail_input(
        "model '{}': no folder {}, and no Hugging Face hub cache to look in ({}). Strata "
        "does not download models: pass a model folder",
        spec, folder, cache.why);
  const fs::path repo = fs::path(cache.dir) / name->folder();
  if (!fs::is_directory(repo, ec))
    fail_input(
        "model '{}' not found: looked for the folder {} and for {} in the Hugging Face "
        "hub cache ({}{}). Strata does not download models: fetch it first (hf download "
        "{}) or pass its folder",
        spec, folder, repo.string(), cache.why, case_hint(cache.dir, name->folder()), name->id());
  return snapshot_of(spec, repo, name->revision).string();
}

std::string resolve_model_path(const std::string& spec) {
  return resolve_model_path(spec, HubEnvironment::from_process());
}

}  // namespace strata
