#include "placement/hardware.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/error.h"

namespace strata {

namespace {

// FlexGen's code (flexgen/utils.py) defines GB = 1 << 30 and fitted every bandwidth and
// capacity of its T4 cost model in those units, so the preset uses binary units too: the
// fitted constants only reproduce FlexGen's predictions in the units they were fitted in.
constexpr double kGiB = double(int64_t{1} << 30);
constexpr double kTera = 1e12;  // FlexGen's T

struct Field {
  const char* name;
  double HardwareSpec::*member;
  const char* unit;
  bool may_be_zero = false;
};

constexpr Field kFields[] = {
    {"gpu_mem", &HardwareSpec::gpu_mem, "bytes"},
    {"cpu_mem", &HardwareSpec::cpu_mem, "bytes"},
    {"disk_mem", &HardwareSpec::disk_mem, "bytes"},
    {"ctog_bdw", &HardwareSpec::ctog_bdw, "bytes/s"},
    {"gtoc_bdw_cache", &HardwareSpec::gtoc_bdw_cache, "bytes/s"},
    {"gtoc_bdw_hidden", &HardwareSpec::gtoc_bdw_hidden, "bytes/s"},
    {"dtoc_bdw", &HardwareSpec::dtoc_bdw, "bytes/s"},
    {"ctod_bdw_cache_prefill", &HardwareSpec::ctod_bdw_cache_prefill, "bytes/s"},
    {"ctod_bdw_other", &HardwareSpec::ctod_bdw_other, "bytes/s"},
    {"mm_flops_prefill", &HardwareSpec::mm_flops_prefill, "FLOP/s"},
    {"mm_flops_decode", &HardwareSpec::mm_flops_decode, "FLOP/s"},
    {"bmm_flops_prefill", &HardwareSpec::bmm_flops_prefill, "FLOP/s"},
    {"bmm_flops_decode", &HardwareSpec::bmm_flops_decode, "FLOP/s"},
    {"cpu_flops", &HardwareSpec::cpu_flops, "FLOP/s"},
    {"cpu_flops_c1", &HardwareSpec::cpu_flops_c1, "dimensionless", true},
    {"cpu_flops_c2", &HardwareSpec::cpu_flops_c2, "dimensionless", true},
    {"cpu_flops_c3", &HardwareSpec::cpu_flops_c3, "dimensionless", true},
};
constexpr const char* kOverlapField = "overlap_model";

std::string field_list() {
  std::string out;
  for (const Field& f : kFields) out += std::string(f.name) + ", ";
  return out + kOverlapField;
}

OverlapModel parse_overlap_model(const nlohmann::json& j, std::string_view source) {
  const auto it = j.find(kOverlapField);
  if (it == j.end())
    fail_input("{}: hardware field '{}' (\"paper\" or \"fitted\") is missing", source,
               kOverlapField);
  for (OverlapModel m : {OverlapModel::kPaper, OverlapModel::kFitted})
    if (it->is_string() && it->get<std::string>() == overlap_model_name(m)) return m;
  fail_input("{}: hardware field '{}' must be \"paper\" or \"fitted\", got {}", source,
             kOverlapField, it->dump());
}

bool known_field(std::string_view name) {
  for (const Field& f : kFields)
    if (name == f.name) return true;
  return name == kOverlapField;
}

}  // namespace

const char* overlap_model_name(OverlapModel m) {
  return m == OverlapModel::kPaper ? "paper" : "fitted";
}

HardwareSpec HardwareSpec::flexgen_t4() {
  HardwareSpec h;
  h.gpu_mem = 16 * kGiB;  // NVIDIA T4
  h.cpu_mem = 208 * kGiB;
  h.disk_mem = 1500 * kGiB;  // 1.5 TB NVMe, as FlexGen's cost model counts it
  h.ctog_bdw = 12.89 * kGiB;
  h.gtoc_bdw_cache = 0.97 * kGiB;
  h.gtoc_bdw_hidden = 4.82 * kGiB;
  h.dtoc_bdw = 0.473 * kGiB;
  h.ctod_bdw_cache_prefill = 0.746 * kGiB;
  h.ctod_bdw_other = 2.015 * kGiB;
  h.mm_flops_prefill = 21.24 * kTera;
  h.mm_flops_decode = 4.3 * kTera;
  h.bmm_flops_prefill = 9.97 * kTera;
  h.bmm_flops_decode = 0.079 * kTera;
  h.cpu_flops = 0.0123 * kTera;
  h.cpu_flops_c1 = 0.0168;
  h.cpu_flops_c2 = 0.0328;
  h.cpu_flops_c3 = 0.0621;
  h.overlap_model = OverlapModel::kFitted;
  return h;
}

double HardwareSpec::cpu_flops_for(double gbs, double h1) const {
  const double a = std::max(0.0, std::log2(64 / gbs));
  const double b = std::max(0.0, std::log2(4096 / h1));
  return cpu_flops * std::max(0.1, 1 + cpu_flops_c1 * a * b - cpu_flops_c2 * a - cpu_flops_c3 * b);
}

void HardwareSpec::validate(std::string_view source) const {
  for (const Field& f : kFields) {
    const double v = this->*f.member;
    if (!std::isfinite(v) || v < 0 || (v == 0 && !f.may_be_zero))
      fail_input("{}: hardware field '{}' must be a {} number ({}), got {}", source, f.name,
                 f.may_be_zero ? "non-negative" : "positive", f.unit, v);
  }
}

nlohmann::json HardwareSpec::to_json() const {
  nlohmann::json j = nlohmann::json::object();
  for (const Field& f : kFields) j[f.name] = this->*f.member;
  j[kOverlapField] = overlap_model_name(overlap_model);
  return j;
}

HardwareSpec HardwareSpec::from_json(const nlohmann::json& j, std::string_view source) {
  if (!j.is_object())
    fail_input("{}: hardware spec must be a JSON object with the fields {}, got a {}", source,
               field_list(), j.type_name());
  for (const auto& [key, value] : j.items())
    if (!known_field(key))
      fail_input("{}: unknown hardware field '{}'; the fields are {}", source, key, field_list());
  HardwareSpec h;
  for (const Field& f : kFields) {
    const auto it = j.find(f.name);
    if (it == j.end())
      fail_input("{}: hardware field '{}' ({}) is missing", source, f.name, f.unit);
    if (!it->is_number())
      fail_input("{}: hardware field '{}' must be a number ({}), got {} {}", source, f.name, f.unit,
                 it->type_name(), it->dump());
    h.*f.member = it->get<double>();
  }
  h.overlap_model = parse_overlap_model(j, source);
  h.validate(source);
  return h;
}

HardwareSpec HardwareSpec::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail_input("{}: cannot open hardware spec file", path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    fail_input("{}: not valid JSON: {}", path, e.what());
  }
  return from_json(j, path);
}

void HardwareSpec::save(const std::string& path) const {
  std::ofstream out(path);
  out << to_json().dump(2) << '\n';
  if (!out) fail_input("{}: cannot write hardware spec file", path);
}

std::string HardwareSpec::str() const {
  const double G = kGiB, T = kTera;
  return fmt::format(
      "HardwareSpec(mem GPU/CPU/disk = {:.1f}/{:.1f}/{:.1f} GiB, ctog={:.3f} GiB/s, "
      "gtoc={:.3f} (cache) / {:.3f} (hidden) GiB/s, dtoc={:.3f} GiB/s, ctod={:.3f} (cache, "
      "prefill) / {:.3f} GiB/s, mm={:.2f}/{:.2f} TFLOP/s, bmm={:.3f}/{:.3f} TFLOP/s "
      "(prefill/decode), cpu={:.4f} TFLOP/s (c1..c3 = {}, {}, {}), overlap model {})",
      gpu_mem / G, cpu_mem / G, disk_mem / G, ctog_bdw / G, gtoc_bdw_cache / G, gtoc_bdw_hidden / G,
      dtoc_bdw / G, ctod_bdw_cache_prefill / G, ctod_bdw_other / G, mm_flops_prefill / T,
      mm_flops_decode / T, bmm_flops_prefill / T, bmm_flops_decode / T, cpu_flops / T, cpu_flops_c1,
      cpu_flops_c2, cpu_flops_c3, overlap_model_name(overlap_model));
}

}  // namespace strata
