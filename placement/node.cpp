#include "placement/node.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "kernels/error.h"

namespace strata {
namespace {

double gib(int64_t bytes) {
  return static_cast<double>(bytes) / (1 << 30);
}

std::string size_str(int64_t bytes) {
  return bytes < 0 ? "-" : fmt::format("{:.2f} GiB", gib(bytes));
}

// A node file's key with '_' read as '-' (both spellings of the flags' names).
std::string key_name(std::string k) {
  std::replace(k.begin(), k.end(), '_', '-');
  return k;
}

int64_t read_size(const nlohmann::json& v, const std::string& where) {
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return v.get<int64_t>();
  if (v.is_string()) return parse_size(v.get<std::string>(), where.c_str());
  fail_input("{}: {} is not a size (bytes, or a string such as \"2GiB\")", where, v.dump());
}

double read_rate(const nlohmann::json& v, const std::string& where) {
  if (!v.is_number() || !(v.get<double>() > 0))
    fail_input("{}: {} is not a rate in GB/s (a positive number)", where, v.dump());
  return v.get<double>();
}

std::string read_text(const nlohmann::json& v, const std::string& where) {
  if (!v.is_string() || v.get<std::string>().empty())
    fail_input("{}: {} is not a non-empty string", where, v.dump());
  return v.get<std::string>();
}

void check_device(const std::string& d, const std::string& where) {
  const bool cuda_n = d.starts_with("cuda:") && d.size() > 5 &&
                      std::all_of(d.begin() + 5, d.end(), [](char c) { return std::isdigit(c); });
  if (d != "auto" && d != "cpu" && d != "host" && d != "cuda" && !cuda_n)
    fail_input("{}: device '{}' is none of auto, cpu, host, cuda, cuda:N", where, d);
}

NodeEntry read_entry(const nlohmann::json& e, const std::string& where) {
  if (!e.is_object()) fail_input("{}: not an object of node settings", where);
  NodeEntry n;
  NodeBudget& b = n.budget;
  for (const auto& [raw, v] : e.items()) {
    const std::string k = key_name(raw);
    const std::string field = fmt::format("{}, {}", where, raw);
    if (k == "rank") {
      if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > (1 << 20))
        fail_input("{}: {} is not a worker rank (1 or more; rank 0 coordinates)", field, v.dump());
      n.rank = v.get<int>();
    } else if (k == "host") {
      n.host = read_text(v, field);
    } else if (k == "device") {
      b.device = read_text(v, field);
      check_device(b.device, field);
    } else if (k == "gpu-mem") {
      b.gpu_mem = read_size(v, field);
    } else if (k == "cpu-mem") {
      b.cpu_mem = read_size(v, field);
    } else if (k == "disk-mem") {
      b.disk_mem = read_size(v, field);
    } else if (k == "disk-dir") {
      b.disk_dir = read_text(v, field);
    } else if (k == "threads") {
      if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > 4096)
        fail_input("{}: {} is not a thread count (1 to 4096)", field, v.dump());
      b.threads = v.get<int>();
    } else if (k == "memory-read-gbs") {
      b.memory_read_gbs = read_rate(v, field);
    } else if (k == "disk-read-gbs") {
      b.disk_read_gbs = read_rate(v, field);
    } else if (k == "host-to-device-gbs") {
      b.host_to_device_gbs = read_rate(v, field);
    } else if (k == "device-memory-gbs") {
      b.device_memory_gbs = read_rate(v, field);
    } else {
      fail_input(
          "{}: unknown key '{}' (known: rank, host, device, gpu-mem, cpu-mem, disk-mem, disk-dir, "
          "threads, memory-read-gbs, disk-read-gbs, host-to-device-gbs, device-memory-gbs)",
          where, raw);
    }
  }
  if ((n.rank < 0) == n.host.empty())
    fail_input("{}: give either \"rank\" (one worker rank) or \"host\" (every rank on it)", where);
  return n;
}

// A YAML value as JSON: a number where it reads as one, else the text (quotes removed).
nlohmann::json yaml_scalar(std::string v) {
  if (v.size() >= 2 && (v.front() == '"' || v.front() == '\'') && v.back() == v.front())
    return v.substr(1, v.size() - 2);
  if (!v.empty() && (std::isdigit(static_cast<unsigned char>(v[0])) || v[0] == '-')) {
    const auto parsed = nlohmann::json::parse(v, nullptr, false);
    if (parsed.is_number()) return parsed;
  }
  return v;
}

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

// YAML's block list of flat maps (optionally under "nodes:"), the only YAML a node file
// needs: "- rank: 1" starts an entry, "key: value" lines continue it, '#' comments.
nlohmann::json parse_yaml_nodes(const std::string& text, const std::string& source) {
  nlohmann::json list = nlohmann::json::array();
  std::istringstream in(text);
  int line_no = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_no;
    if (const auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::string t = trim(line);
    if (t.empty() || t == "nodes:") continue;
    const bool starts = t.starts_with("- ") || t == "-";
    if (starts) {
      list.push_back(nlohmann::json::object());
      t = trim(t.substr(1));
      if (t.empty()) continue;
    }
    const auto colon = t.find(':');
    if (list.empty() || colon == std::string::npos || colon == 0)
      fail_input("{}:{}: '{}' is not a 'key: value' line of a '- ' entry (YAML node list)", source,
                 line_no, trim(line));
    list.back()[trim(t.substr(0, colon))] = yaml_scalar(trim(t.substr(colon + 1)));
  }
  return list;
}

}  // namespace

NodeBudget NodeBudget::overridden_by(const NodeBudget& o) const {
  NodeBudget b = *this;
  if (!o.device.empty()) b.device = o.device;
  if (o.gpu_mem >= 0) b.gpu_mem = o.gpu_mem;
  if (o.cpu_mem >= 0) b.cpu_mem = o.cpu_mem;
  if (o.disk_mem >= 0) b.disk_mem = o.disk_mem;
  if (!o.disk_dir.empty()) b.disk_dir = o.disk_dir;
  if (o.threads > 0) b.threads = o.threads;
  for (auto m : {&NodeBudget::memory_read_gbs, &NodeBudget::disk_read_gbs,
                 &NodeBudget::host_to_device_gbs, &NodeBudget::device_memory_gbs})
    if (o.*m > 0) b.*m = o.*m;
  return b;
}

nlohmann::json NodeBudget::to_json() const {
  return {{"device", device},
          {"gpu_mem", gpu_mem},
          {"cpu_mem", cpu_mem},
          {"disk_mem", disk_mem},
          {"disk_dir", disk_dir},
          {"threads", threads},
          {"memory_read_gbs", memory_read_gbs},
          {"disk_read_gbs", disk_read_gbs},
          {"host_to_device_gbs", host_to_device_gbs},
          {"device_memory_gbs", device_memory_gbs}};
}

std::string NodeBudget::str() const {
  return fmt::format("NodeBudget(device {}, gpu {}, cpu {}, disk {} in {}, threads {})",
                     device.empty() ? "-" : device, size_str(gpu_mem), size_str(cpu_mem),
                     size_str(disk_mem), disk_dir.empty() ? "-" : disk_dir, threads);
}

NodeFile NodeFile::parse(const std::string& text, const std::string& source) {
  const std::string t = trim(text);
  nlohmann::json j;
  if (t.starts_with("[") || t.starts_with("{")) {
    j = nlohmann::json::parse(t, nullptr, false);
    if (j.is_discarded()) fail_input("{}: not valid JSON", source);
    if (j.is_object()) {
      if (!j.contains("nodes") || j.size() != 1)
        fail_input("{}: a JSON object must hold one key, \"nodes\" (a list of entries)", source);
      j = j["nodes"];
    }
    if (!j.is_array()) fail_input("{}: \"nodes\" is not a list of entries", source);
  } else {
    j = parse_yaml_nodes(text, source);
  }
  NodeFile f;
  f.path = source;
  std::set<int> ranks;
  std::set<std::string> hosts;
  for (size_t i = 0; i < j.size(); ++i) {
    const std::string where = fmt::format("{}: entry {}", source, i + 1);
    NodeEntry e = read_entry(j[i], where);
    if (e.rank >= 0 && !ranks.insert(e.rank).second)
      fail_input("{}: rank {} has an entry already", where, e.rank);
    if (!e.host.empty() && !hosts.insert(e.host).second)
      fail_input("{}: host '{}' has an entry already", where, e.host);
    f.entries.push_back(std::move(e));
  }
  if (f.entries.empty()) fail_input("{}: no node entries", source);
  return f;
}

NodeFile NodeFile::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail_input("--nodes: cannot read node file '{}'", path);
  std::stringstream text;
  text << in.rdbuf();
  return parse(text.str(), path);
}

const NodeEntry* NodeFile::find(int rank, const std::string& host) const {
  for (const NodeEntry& e : entries)
    if (e.rank == rank) return &e;
  for (const NodeEntry& e : entries)
    if (!e.host.empty() && e.host == host) return &e;
  return nullptr;
}

int NodeFile::max_rank() const {
  int m = 0;
  for (const NodeEntry& e : entries) m = std::max(m, e.rank);
  return m;
}

nlohmann::json NodeInventory::to_json() const {
  return {{"rank", rank},
          {"host", host},
          {"device_compute", device_compute},
          {"compute", compute},
          {"threads", threads},
          {"isa", isa},
          {"ranks_on_host", ranks_on_host},
          {"nccl_key", nccl_key},
          {"device_free_bytes", device_free_bytes},
          {"host_available_bytes", host_available_bytes},
          {"disk_dir", disk_dir},
          {"disk_free_bytes", disk_free_bytes},
          {"o_direct", o_direct},
          {"memory_read_gbs", memory_read_gbs},
          {"disk_read_gbs", disk_read_gbs},
          {"host_to_device_gbs", host_to_device_gbs},
          {"device_memory_gbs", device_memory_gbs},
          {"budget", budget.to_json()}};
}

NodeInventory NodeInventory::from_json(const nlohmann::json& j, const std::string& source) {
  auto at = [&](const char* key) -> const nlohmann::json& {
    if (!j.is_object() || !j.contains(key))
      fail_input("{}: node inventory without \"{}\"", source, key);
    return j.at(key);
  };
  try {
    NodeInventory n;
    n.rank = at("rank").get<int>();
    n.host = at("host").get<std::string>();
    n.device_compute = at("device_compute").get<bool>();
    n.compute = at("compute").get<std::string>();
    n.threads = at("threads").get<int>();
    n.isa = at("isa").get<std::string>();
    n.ranks_on_host = at("ranks_on_host").get<int>();
    n.nccl_key = at("nccl_key").get<int>();
    n.device_free_bytes = at("device_free_bytes").get<int64_t>();
    n.host_available_bytes = at("host_available_bytes").get<int64_t>();
    n.disk_dir = at("disk_dir").get<std::string>();
    n.disk_free_bytes = at("disk_free_bytes").get<int64_t>();
    n.o_direct = at("o_direct").get<bool>();
    n.memory_read_gbs = at("memory_read_gbs").get<double>();
    n.disk_read_gbs = at("disk_read_gbs").get<double>();
    n.host_to_device_gbs = at("host_to_device_gbs").get<double>();
    n.device_memory_gbs = at("device_memory_gbs").get<double>();
    const nlohmann::json& b = at("budget");
    NodeBudget& nb = n.budget;
    nb.device = b.at("device").get<std::string>();
    nb.gpu_mem = b.at("gpu_mem").get<int64_t>();
    nb.cpu_mem = b.at("cpu_mem").get<int64_t>();
    nb.disk_mem = b.at("disk_mem").get<int64_t>();
    nb.disk_dir = b.at("disk_dir").get<std::string>();
    nb.threads = b.at("threads").get<int>();
    nb.memory_read_gbs = b.at("memory_read_gbs").get<double>();
    nb.disk_read_gbs = b.at("disk_read_gbs").get<double>();
    nb.host_to_device_gbs = b.at("host_to_device_gbs").get<double>();
    nb.device_memory_gbs = b.at("device_memory_gbs").get<double>();
    return n;
  } catch (const nlohmann::json::exception& e) {
    fail_input("{}: node inventory: {}", source, e.what());
  }
}

std::string NodeInventory::str() const {
  return fmt::format(
      "rank {} on {}: {}, {} rank(s) on the host; device free {}, host available {}, disk free {} "
      "in {}{}; memory read {:.1f} GB/s, disk read {:.2f} GB/s, host->device {:.1f} GB/s, device "
      "memory {:.1f} GB/s; {}",
      rank, host, compute, ranks_on_host, size_str(device_free_bytes),
      size_str(host_available_bytes), size_str(disk_free_bytes), disk_dir,
      o_direct ? " (O_DIRECT)" : " (buffered)", memory_read_gbs, disk_read_gbs, host_to_device_gbs,
      device_memory_gbs, budget.str());
}

std::string StageNode::str() const {
  return fmt::format(
      "{}: {} compute, budgets gpu {} / cpu {} / disk {}, reads {:.1f} GB/s "
      "compute, {:.2f} GB/s disk",
      name, device_compute ? "device" : "host", size_str(budgets.gpu), size_str(budgets.cpu),
      size_str(budgets.disk), compute_read_gbs, disk_read_gbs);
}

namespace {

// A given budget that is more than the node has: refused naming the node.
void check_given(int64_t given, int64_t has, const char* option, const char* what,
                 const NodeInventory& n) {
  if (given < 0 || has < 0 || given <= has) return;
  fail_input("rank {} on {}: {} {:.2f} GiB is more than its {:.2f} GiB of {}", n.rank, n.host,
             option, gib(given), gib(has), what);
}

int64_t share(int64_t has, int ranks) {
  return has < 0 ? -1 : has / std::max(ranks, 1);
}

}  // namespace

StageNode stage_node(const NodeInventory& n) {
  const NodeBudget& b = n.budget;
  const bool real_device = n.device_compute && n.device_free_bytes >= 0;
  if (real_device) check_given(b.gpu_mem, n.device_free_bytes, "gpu-mem", "free device memory", n);
  check_given(b.cpu_mem, n.host_available_bytes, "cpu-mem", "available host memory", n);
  check_given(b.disk_mem, n.disk_free_bytes, "disk-mem",
              fmt::format("free space in {}", n.disk_dir).c_str(), n);
  StageNode s;
  s.rank = n.rank;
  s.name = fmt::format("rank {} on {} ({})", n.rank, n.host, n.compute);
  s.device_compute = n.device_compute;
  s.nccl_key = n.nccl_key;
  s.disk_dir = n.disk_dir;
  // Unset budgets: what the node has, shared by the ranks on it (a stand-in device's memory
  // is the host's, counted there).
  s.budgets.gpu = !n.device_compute ? -1
                  : b.gpu_mem >= 0  ? b.gpu_mem
                  : real_device     ? n.device_free_bytes
                                    : -1;
  s.budgets.cpu = b.cpu_mem >= 0 ? b.cpu_mem : share(n.host_available_bytes, n.ranks_on_host);
  s.budgets.disk = b.disk_mem >= 0 ? b.disk_mem : share(n.disk_free_bytes, n.ranks_on_host);
  const double memory = b.memory_read_gbs > 0 ? b.memory_read_gbs : n.memory_read_gbs;
  const double device = b.device_memory_gbs > 0 ? b.device_memory_gbs : n.device_memory_gbs;
  s.compute_read_gbs = real_device && device > 0 ? device : memory;
  s.disk_read_gbs = b.disk_read_gbs > 0 ? b.disk_read_gbs : n.disk_read_gbs;
  s.host_to_device_gbs = b.host_to_device_gbs > 0 ? b.host_to_device_gbs : n.host_to_device_gbs;
  return s;
}

double decode_step_seconds(const StagePlacement& p, const StageNode& node) {
  auto rate = [](double gbs) { return (gbs > 0 ? gbs : 1.0) * 1e9; };
  const WeightPlacement& w = p.weights;
  const KvPlacement& kv = p.cache;
  const auto n = static_cast<double>(w.tiers.size());
  const double weights =
      static_cast<double>(w.fixed_bytes) + n * static_cast<double>(w.layer_bytes);
  const double cache =
      2.0 * static_cast<double>(kv.layer_bytes) * static_cast<double>(kv.tiers.size());
  const double from_disk = static_cast<double>(w.disk_bytes()) +
                           2.0 * static_cast<double>(kv.layer_bytes) * kv.count(Tier::kDisk);
  // Every weight layer off the device crosses to it, those from disk too.
  const double to_device =
      static_cast<double>(w.streamed_layers()) * static_cast<double>(w.layer_bytes);
  const double compute = (weights + cache) / rate(node.compute_read_gbs);
  const double io = from_disk / rate(node.disk_read_gbs) +
                    (to_device > 0 ? to_device / rate(node.host_to_device_gbs) : 0.0);
  return std::max(compute, io);
}

}  // namespace strata
