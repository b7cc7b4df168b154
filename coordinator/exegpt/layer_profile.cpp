#include "coordinator/exegpt/layer_profile.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/error.h"
#include "worker/input_limits.h"

namespace strata {
namespace {

using json = nlohmann::json;

// The interval [i, i + 1] of `v` to interpolate x in (the outermost one outside), and
// whether x lies outside [front, back].
size_t interval(const std::vector<double>& v, double x, bool& outside) {
  if (v.size() < 2) {
    outside = outside || x != v.front();
    return 0;
  }
  if (x < v.front() || x > v.back()) outside = true;
  const auto it = std::upper_bound(v.begin() + 1, v.end() - 1, x);
  return static_cast<size_t>(it - v.begin()) - 1;
}

double lerp(double x0, double x1, double y0, double y1, double x) {
  return x1 == x0 ? y0 : y0 + (y1 - y0) * (x - x0) / (x1 - x0);
}

void check_ascending(const std::vector<double>& v, const std::string& what) {
  if (v.empty()) fail_input("{}: no points", what);
  for (size_t i = 0; i < v.size(); ++i) {
    if (!std::isfinite(v[i])) fail_input("{}: point {} is not finite", what, i);
    if (i > 0 && !(v[i] > v[i - 1])) fail_input("{}: points not strictly ascending at {}", what, i);
  }
}

std::vector<int32_t> powers(int32_t from, int32_t factor, int32_t to) {
  std::vector<int32_t> out;
  for (int64_t v = from; v < to; v *= factor) out.push_back(static_cast<int32_t>(v));
  if (to >= 1 && (out.empty() || out.back() != to)) out.push_back(to);
  return out;
}

const json& field(const json& j, const char* name, const std::string& where) {
  if (!j.is_object() || !j.contains(name)) fail_input("{}: missing field '{}'", where, name);
  return j.at(name);
}

double number(const json& j, const char* name, const std::string& where) {
  const json& v = field(j, name, where);
  if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0)
    fail_input("{}: field '{}' must be a non-negative number", where, name);
  return v.get<double>();
}

std::string text(const json& j, const char* name, const std::string& where) {
  const json& v = field(j, name, where);
  if (!v.is_string()) fail_input("{}: field '{}' must be a string", where, name);
  return v.get<std::string>();
}

}  // namespace

TimeGrid::TimeGrid(std::vector<double> xs, std::vector<double> ys, std::vector<double> seconds)
    : xs_(std::move(xs)), ys_(std::move(ys)), t_(std::move(seconds)) {
  check_ascending(xs_, "time grid x");
  check_ascending(ys_, "time grid y");
  if (t_.size() != xs_.size() * ys_.size())
    fail_input("time grid: {} times for {} x {} points", t_.size(), xs_.size(), ys_.size());
  for (double t : t_)
    if (!(t >= 0) || !std::isfinite(t)) fail_input("time grid: time {} is not a duration", t);
}

TimeGrid TimeGrid::curve(std::vector<double> xs, std::vector<double> seconds) {
  return TimeGrid(std::move(xs), {0.0}, std::move(seconds));
}

double TimeGrid::at(double x, double y, bool* outside) const {
  STRATA_CHECK(!xs_.empty(), "query of an empty time grid");
  bool out = false;
  const size_t i = interval(xs_, x, out);
  const size_t j = interval(ys_, y, out);
  const size_t ny = ys_.size();
  auto t = [&](size_t a, size_t b) { return t_[a * ny + b]; };
  const size_t i1 = std::min(i + 1, xs_.size() - 1), j1 = std::min(j + 1, ny - 1);
  const double low = lerp(ys_[j], ys_[j1], t(i, j), t(i, j1), y);
  const double high = lerp(ys_[j], ys_[j1], t(i1, j), t(i1, j1), y);
  if (outside != nullptr) *outside = *outside || out;
  // Never a negative time, however far a line is extrapolated.
  return std::max(0.0, lerp(xs_[i], xs_[i1], low, high, x));
}

json TimeGrid::to_json() const {
  return {{"x", xs_}, {"y", ys_}, {"seconds", t_}};
}

TimeGrid TimeGrid::from_json(const json& j, const std::string& where) {
  try {
    return TimeGrid(field(j, "x", where).get<std::vector<double>>(),
                    field(j, "y", where).get<std::vector<double>>(),
                    field(j, "seconds", where).get<std::vector<double>>());
  } catch (const json::exception& e) {
    fail_input("{}: {}", where, e.what());
  } catch (const InputError& e) {
    fail_input("{}: {}", where, e.what());
  }
}

std::string ClusterProfile::key() const {
  return fmt::format("{}|{}|{}|{}", model, dtype, placement, fmt::join(hosts, ","));
}

json ClusterProfile::to_json() const {
  json ranks_j = json::array();
  for (const RankProfile& r : ranks)
    ranks_j.push_back({{"rank", r.rank},
                       {"host", r.host},
                       {"prefill", r.prefill.to_json()},
                       {"decode", r.decode.to_json()},
                       {"embed", r.embed.to_json()},
                       {"head", r.head.to_json()}});
  return {{"model", model},
          {"dtype", dtype},
          {"placement", placement},
          {"hosts", hosts},
          {"modelled", modelled},
          {"ranks", ranks_j},
          {"link", {{"latency_s", link.latency_s}, {"seconds_per_byte", link.seconds_per_byte}}},
          {"step_overhead_s", step_overhead_s},
          {"step_overhead_per_row_s", step_overhead_per_row_s}};
}

ClusterProfile ClusterProfile::from_json(const json& j, const std::string& source) {
  ClusterProfile p;
  p.source = source;
  p.model = text(j, "model", source);
  p.dtype = text(j, "dtype", source);
  p.placement = text(j, "placement", source);
  const json& hosts = field(j, "hosts", source);
  if (!hosts.is_array()) fail_input("{}: field 'hosts' must be an array", source);
  for (const json& h : hosts) {
    if (!h.is_string()) fail_input("{}: field 'hosts' must hold strings", source);
    p.hosts.push_back(h.get<std::string>());
  }
  p.modelled = j.value("modelled", false);
  const json& ranks = field(j, "ranks", source);
  if (!ranks.is_array() || ranks.empty())
    fail_input("{}: field 'ranks' must be a non-empty array", source);
  for (size_t i = 0; i < ranks.size(); ++i) {
    const std::string where = fmt::format("{}: ranks[{}]", source, i);
    RankProfile r;
    r.rank = static_cast<int32_t>(number(ranks[i], "rank", where));
    r.host = text(ranks[i], "host", where);
    r.prefill = TimeGrid::from_json(field(ranks[i], "prefill", where), where + ".prefill");
    r.decode = TimeGrid::from_json(field(ranks[i], "decode", where), where + ".decode");
    r.embed = TimeGrid::from_json(field(ranks[i], "embed", where), where + ".embed");
    r.head = TimeGrid::from_json(field(ranks[i], "head", where), where + ".head");
    p.ranks.push_back(std::move(r));
  }
  const json& link = field(j, "link", source);
  p.link.latency_s = number(link, "latency_s", source + ": link");
  p.link.seconds_per_byte = number(link, "seconds_per_byte", source + ": link");
  p.step_overhead_s = number(j, "step_overhead_s", source);
  if (j.contains("step_overhead_per_row_s"))
    p.step_overhead_per_row_s = number(j, "step_overhead_per_row_s", source);
  return p;
}

ClusterProfile ClusterProfile::load(const std::string& path) {
  const std::string body =
      read_file_bounded(path, InputLimits{}, &InputLimits::json_file_bytes, "layer profile");
  const json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) fail_input("{}: not JSON", path);
  return from_json(j, path);
}

void ClusterProfile::save(const std::string& path) const {
  namespace fs = std::filesystem;
  const fs::path p(path);
  if (p.has_parent_path()) fs::create_directories(p.parent_path());
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << to_json().dump(1) << "\n";
    if (!out) fail(ErrorKind::kFailed, "{}: cannot write the layer profile", tmp);
  }
  fs::rename(tmp, p);  // readers never see half a file
}

std::string ClusterProfile::str() const {
  return fmt::format("profile of {} ({}, placement {}, {} ranks on {}{})", model, dtype, placement,
                     ranks.size(), fmt::join(hosts, ", "), modelled ? ", modelled" : "");
}

NodeModel NodeModel::preset(const std::string& name) {
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  // Data-sheet peaks derated to what large GEMMs and streaming reads achieve (60% of dense
  // f16 tensor FLOP/s, 80% of memory bandwidth); links between nodes.
  if (name == "a40")
    return {"a40", 0.6 * 149.7e12, 0.8 * 696e9, 48 * kGiB, 12.5e9, 10e-6, 30e-6, true};
  if (name == "a100")
    return {"a100", 0.6 * 312e12, 0.8 * 2039e9, 80 * kGiB, 25e9, 5e-6, 20e-6, true};
  if (name == "h100")
    return {"h100", 0.6 * 989e12, 0.8 * 3350e9, 80 * kGiB, 50e9, 5e-6, 15e-6, true};
  fail_input("node '{}': not a preset (a40, a100, h100) nor a JSON file", name);
}

NodeModel NodeModel::host_worker(const std::string& name, double flops, double memory_bandwidth) {
  constexpr double kGiB = 1024.0 * 1024 * 1024;
  return {name, flops, memory_bandwidth, 16 * kGiB, 5e9, 20e-6, 50e-6, false};
}

NodeModel NodeModel::from_json(const json& j, const std::string& source) {
  NodeModel n;
  n.name = j.value("name", source);
  n.flops = number(j, "flops", source);
  n.memory_bandwidth = number(j, "memory_bandwidth", source);
  n.memory_bytes = number(j, "memory_bytes", source);
  n.link_bandwidth = number(j, "link_bandwidth", source);
  n.link_latency_s = number(j, "link_latency_s", source);
  n.layer_overhead_s = number(j, "layer_overhead_s", source);
  n.device = j.value("device", true);
  if (!(n.flops > 0 && n.memory_bandwidth > 0 && n.memory_bytes > 0 && n.link_bandwidth > 0))
    fail_input("{}: flops, memory_bandwidth, memory_bytes and link_bandwidth must be positive",
               source);
  return n;
}

NodeModel NodeModel::parse(const std::string& spec) {
  if (spec.find('/') == std::string::npos && spec.find(".json") == std::string::npos)
    return preset(spec);
  const std::string body =
      read_file_bounded(spec, InputLimits{}, &InputLimits::json_file_bytes, "node description");
  const json j = json::parse(body, nullptr, false);
  if (j.is_discarded()) fail_input("{}: not JSON", spec);
  return from_json(j, spec);
}

json NodeModel::to_json() const {
  return {{"name", name},
          {"flops", flops},
          {"memory_bandwidth", memory_bandwidth},
          {"memory_bytes", memory_bytes},
          {"link_bandwidth", link_bandwidth},
          {"link_latency_s", link_latency_s},
          {"layer_overhead_s", layer_overhead_s},
          {"device", device}};
}

std::string NodeModel::str() const {
  return fmt::format("node {}: {:.1f} TFLOP/s, {:.0f} GB/s memory, {:.1f} GiB, link {:.1f} GB/s",
                     name, flops / 1e12, memory_bandwidth / 1e9, memory_bytes / (1 << 30),
                     link_bandwidth / 1e9);
}

ProfileGrid ProfileGrid::for_limits(int32_t max_rows, int32_t max_seqs, int32_t max_context) {
  STRATA_CHECK(max_rows > 0 && max_seqs > 0 && max_context > 0, "profile limits {} {} {}", max_rows,
               max_seqs, max_context);
  ProfileGrid g;
  g.prefill_rows = powers(std::min(16, max_rows), 4, max_rows);
  g.prefill_lengths = powers(std::min(16, max_context), 4, max_context);
  g.decode_seqs = powers(1, 4, max_seqs);
  g.decode_contexts = powers(std::min(16, max_context), 4, max_context);
  g.embed_rows = powers(1, 16, max_rows);
  g.head_rows = powers(1, 4, max_seqs);
  return g;
}

int64_t ProfileGrid::points() const {
  return static_cast<int64_t>(prefill_rows.size() * prefill_lengths.size() +
                              decode_seqs.size() * decode_contexts.size() + embed_rows.size() +
                              head_rows.size());
}

namespace {

std::vector<double> as_doubles(const std::vector<int32_t>& v) {
  return {v.begin(), v.end()};
}

}  // namespace

ClusterProfile modelled_profile(const ModelShape& s, const std::string& model,
                                const NodeModel& node, int32_t workers, const ProfileGrid& g) {
  STRATA_CHECK(workers > 0, "workers {}", workers);
  const double wb = static_cast<double>(s.weight_bytes_per_elem);
  const double params = static_cast<double>(s.params_per_layer());
  const double q = static_cast<double>(s.q_width()), kv = static_cast<double>(s.kv_width());
  const double kv_bytes_per_pos = 2 * kv * 4;  // K and V, f32 (the engine's cache)
  auto roof = [&](double flops, double bytes) {
    return std::max(flops / node.flops, bytes / node.memory_bandwidth);
  };
  // A layer: every weight read once, 2 FLOPs per weight per row; causal attention over the
  // rows' contexts (QK^T and PV); the cache read for it and the new rows written.
  auto prefill = [&](double rows, double len) {
    return roof(2 * params * rows + 2 * rows * len * q, params * wb + rows * kv_bytes_per_pos * 2) +
           node.layer_overhead_s;
  };
  auto decode = [&](double seqs, double ctx) {
    return roof(2 * params * seqs + 4 * seqs * ctx * q,
                params * wb + seqs * ctx * kv_bytes_per_pos) +
           node.layer_overhead_s;
  };
  const double e = static_cast<double>(s.embed_width());
  auto embed = [&](double rows) {
    return rows * static_cast<double>(s.hidden) * (wb + 4) * (s.learned_positions ? 2 : 1) /
               node.memory_bandwidth +
           node.layer_overhead_s;
  };
  auto head = [&](double rows) {
    return roof(2 * static_cast<double>(s.vocab) * e * rows,
                static_cast<double>(s.vocab) * e * wb) +
           node.layer_overhead_s;
  };
  auto grid2 = [&](const std::vector<int32_t>& xs, const std::vector<int32_t>& ys, auto f) {
    std::vector<double> t;
    for (int32_t x : xs)
      for (int32_t y : ys) t.push_back(f(x, y));
    return TimeGrid(as_doubles(xs), as_doubles(ys), std::move(t));
  };
  auto grid1 = [&](const std::vector<int32_t>& xs, auto f) {
    std::vector<double> t;
    for (int32_t x : xs) t.push_back(f(x));
    return TimeGrid::curve(as_doubles(xs), std::move(t));
  };
  ClusterProfile p;
  p.model = model;
  p.dtype = fmt::format("{}-byte weights", s.weight_bytes_per_elem);
  p.placement = "resident";
  p.modelled = true;
  p.source = "modelled " + node.name;
  for (int32_t r = 1; r <= workers; ++r) {
    RankProfile rp;
    rp.rank = r;
    rp.host = fmt::format("{}-{}", node.name, r);
    rp.prefill = grid2(g.prefill_rows, g.prefill_lengths, prefill);
    rp.decode = grid2(g.decode_seqs, g.decode_contexts, decode);
    rp.embed = grid1(g.embed_rows, embed);
    rp.head = grid1(g.head_rows, head);
    p.hosts.push_back(rp.host);
    p.ranks.push_back(std::move(rp));
  }
  p.link = LinkProfile{node.link_latency_s, 1.0 / node.link_bandwidth};
  p.step_overhead_s = 2 * node.link_latency_s;
  return p;
}

}  // namespace strata
