#include "worker/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "kernels/error.h"

namespace strata {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

constexpr uint64_t kHeaderLenBytes = 8;
constexpr const char* kMetadataKey = "__metadata__";
constexpr const char* kSupportedDTypes = "F32, F16, BF16, I32";

struct DTypeName {
  const char* name;
  DType dtype;
};
constexpr DTypeName kDTypeNames[] = {
    {"F32", DType::kF32}, {"F16", DType::kF16}, {"BF16", DType::kBF16}, {"I32", DType::kI32}};

// Safetensors names dtypes in upper case; parse_dtype's lower-case aliases are not valid here.
std::optional<DType> safetensors_dtype(std::string_view s) {
  for (const auto& d : kDTypeNames)
    if (s == d.name) return d.dtype;
  return std::nullopt;
}

const char* safetensors_dtype_name(DType t) {
  for (const auto& d : kDTypeNames)
    if (t == d.dtype) return d.name;
  return "?";
}

// The format is little-endian regardless of the host.
uint64_t read_le64(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

std::string le64_bytes(uint64_t v) {
  std::string s(kHeaderLenBytes, '\0');
  for (size_t i = 0; i < kHeaderLenBytes; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xffu);
  return s;
}

const json& field(const std::string& path, const std::string& name, const json& entry,
                  const char* key) {
  auto it = entry.find(key);
  if (it == entry.end())
    fail_input("{}: tensor '{}': missing \"{}\" (an entry needs dtype, shape and data_offsets)",
               path, name, key);
  return *it;
}

DType parse_entry_dtype(const std::string& path, const std::string& name, const json& v) {
  if (!v.is_string()) fail_input("{}: tensor '{}': dtype {} is not a string", path, name, v.dump());
  const auto& s = v.get_ref<const std::string&>();
  auto dtype = safetensors_dtype(s);
  if (!dtype)
    fail_input("{}: tensor '{}': unsupported dtype \"{}\" (supported: {})", path, name, s,
               kSupportedDTypes);
  return *dtype;
}

Shape parse_entry_shape(const std::string& path, const std::string& name, const json& v,
                        const InputLimits& limits) {
  if (!v.is_array()) fail_input("{}: tensor '{}': shape {} is not an array", path, name, v.dump());
  const std::string where = fmt::format("{}: tensor '{}'", path, name);
  limits.check(&InputLimits::tensor_rank, static_cast<int64_t>(v.size()), where, "shape rank");
  Shape shape;
  for (const json& d : v) {
    // Values above INT64_MAX parse as unsigned and would wrap in int64_t.
    const bool ok =
        d.is_number_integer() &&
        (d.is_number_unsigned() ? d.get<uint64_t>() <= INT64_MAX : d.get<int64_t>() >= 0);
    if (!ok)
      fail_input(
          "{}: tensor '{}': shape {} dimension {} is {}; dimensions must be non-negative "
          "integers",
          path, name, v.dump(), shape.rank, d.dump());
    limits.check(&InputLimits::tensor_dim, d.get<int64_t>(), where,
                 fmt::format("shape {} dimension {}", v.dump(), shape.rank));
    shape.dims[static_cast<size_t>(shape.rank++)] = d.get<int64_t>();
  }
  return shape;
}

// The shape's byte size, rejecting shapes whose size does not fit in 64 bits.
uint64_t shape_bytes(const std::string& path, const std::string& name, const Shape& shape,
                     DType dtype) {
  uint64_t bytes = dtype_size(dtype);
  for (int i = 0; i < shape.rank; ++i) {
    if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(shape[i]), &bytes))
      fail_input("{}: tensor '{}': shape {} is too large", path, name, shape.str());
  }
  return bytes;
}

void parse_entry_offsets(const std::string& path, const std::string& name, const json& v,
                         SafetensorsTensor& t) {
  auto non_negative = [](const json& x) {
    return x.is_number_unsigned() || (x.is_number_integer() && x.get<int64_t>() >= 0);
  };
  if (!v.is_array() || v.size() != 2 || !non_negative(v[0]) || !non_negative(v[1]))
    fail_input("{}: tensor '{}': data_offsets {} must be two non-negative integers", path, name,
               v.dump());
  t.begin = v[0].get<uint64_t>();
  t.end = v[1].get<uint64_t>();
  if (t.begin > t.end)
    fail_input("{}: tensor '{}': data_offsets [{}, {}] begin after end", path, name, t.begin,
               t.end);
}

SafetensorsTensor parse_entry(const std::string& path, const std::string& name, const json& entry,
                              uint64_t data_size, const InputLimits& limits) {
  if (!entry.is_object())
    fail_input("{}: tensor '{}': entry {} is not an object", path, name, entry.dump());
  SafetensorsTensor t;
  t.name = name;
  t.dtype = parse_entry_dtype(path, name, field(path, name, entry, "dtype"));
  t.shape = parse_entry_shape(path, name, field(path, name, entry, "shape"), limits);
  parse_entry_offsets(path, name, field(path, name, entry, "data_offsets"), t);
  const uint64_t want = shape_bytes(path, name, t.shape, t.dtype);
  if (t.end - t.begin != want)
    fail_input("{}: tensor '{}': data_offsets [{}, {}] span {} bytes but {} shape {} needs {}",
               path, name, t.begin, t.end, t.end - t.begin, safetensors_dtype_name(t.dtype),
               t.shape.str(), want);
  if (t.end > data_size)
    fail_input(
        "{}: tensor '{}': data_offsets [{}, {}] end past the data section of {} bytes "
        "(file truncated?)",
        path, name, t.begin, t.end, data_size);
  return t;
}

// The format allows neither overlaps (tensors aliasing each other's data) nor gaps: sorted by
// offset, each tensor begins where the previous one ended, and the last one ends where the
// data section does (as the reference implementation checks). Bytes that belong to no tensor
// are how a corrupt file shows itself: a byte inserted into the data, or a header length
// shortened into the header's own space padding (still valid JSON, every offset shifted).
void check_coverage(const std::string& path, std::vector<SafetensorsTensor>& tensors,
                    uint64_t data_size) {
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t cursor = 0;
  const SafetensorsTensor* prev = nullptr;
  for (const auto& t : tensors) {
    if (t.begin < cursor)
      fail_input("{}: tensor '{}' data_offsets [{}, {}] overlap tensor '{}' data_offsets [{}, {}]",
                 path, t.name, t.begin, t.end, prev->name, prev->begin, prev->end);
    if (t.begin > cursor)
      fail_input(
          "{}: bytes [{}, {}) of the data section belong to no tensor: tensor '{}' begins at {} "
          "but {} (the format allows no gaps)",
          path, cursor, t.begin, t.name, t.begin,
          prev ? fmt::format("tensor '{}' ends at {}", prev->name, prev->end)
               : std::string("the data section begins at 0"));
    cursor = t.end;
    prev = &t;
  }
  if (cursor != data_size)
    fail_input(
        "{}: the data section is {} bytes but the tensors end at byte {}: {} bytes at its end "
        "belong to no tensor (a corrupt file: bytes inserted into the data, or a header length "
        "that does not match the header)",
        path, data_size, cursor, data_size - cursor);
}

json parse_json(const std::string& path, const char* what, const char* first, const char* last,
                const json::parser_callback_t& guard = nullptr) {
  json j;
  try {
    j = json::parse(first, last, guard);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for 1e400
    fail_input("{}: {} is not valid JSON: {}", path, what, e.what());
  }
  if (!j.is_object()) fail_input("{}: {} is not a JSON object", path, what);
  return j;
}

// Bounds a header while it is parsed, so a hostile one cannot build a large document first:
// a header is an object of entries (keys at depth 1) holding objects of scalars and short
// arrays (values at depth 3); deeper nesting, more tensors than the limit or longer arrays
// stop the parse.
json::parser_callback_t header_guard(const std::string& path, const InputLimits& limits) {
  struct State {
    int64_t tensors = 0, elements = 0;
    std::string name, key;
  };
  auto st = std::make_shared<State>();
  return [st, &path, &limits](int depth, json::parse_event_t ev, json& parsed) {
    using E = json::parse_event_t;
    if (ev == E::key && depth == 1) {
      st->name = parsed.get<std::string>();
      if (st->name != kMetadataKey)
        limits.check(&InputLimits::safetensors_tensors, ++st->tensors, path, "tensor count");
    } else if (ev == E::key && depth == 2) {
      st->key = parsed.get<std::string>();
    } else if ((ev == E::object_start || ev == E::array_start) && depth > 2) {
      fail_input("{}: tensor '{}': \"{}\" nests deeper than a safetensors header can", path,
                 st->name, st->key);
    } else if (ev == E::array_start) {
      st->elements = 0;
    } else if (ev == E::value && depth == 3) {
      const std::string where = fmt::format("{}: tensor '{}'", path, st->name);
      if (st->key == "shape")
        limits.check(&InputLimits::tensor_rank, ++st->elements, where, "shape rank");
      else if (++st->elements > 2)
        fail_input("{}: \"{}\" holds more than 2 values (data_offsets holds two)", where, st->key);
    }
    return true;
  };
}

// The tensors of a header, sorted by offset (the order of their data in the file).
std::vector<SafetensorsTensor> parse_header(const std::string& path, const char* header,
                                            uint64_t header_len, uint64_t data_size,
                                            const InputLimits& limits) {
  // The format: the header "MUST begin with a { character"; this also keeps a top-level
  // array of a million numbers from being parsed before it is refused.
  if (header_len == 0 || header[0] != '{')
    fail_input("{}: header does not begin with '{{' (not a safetensors file?)", path);
  const json j =
      parse_json(path, "header", header, header + header_len, header_guard(path, limits));
  std::vector<SafetensorsTensor> tensors;
  for (const auto& [name, entry] : j.items()) {
    if (name == kMetadataKey) continue;
    tensors.push_back(parse_entry(path, name, entry, data_size, limits));
  }
  check_coverage(path, tensors, data_size);
  return tensors;
}

struct FileDescriptor {
  int fd;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

SafetensorsLayout parse_safetensors(const std::string& path, const unsigned char* bytes,
                                    uint64_t size, const InputLimits& limits) {
  if (size < kHeaderLenBytes)
    fail_input("{}: file is {} bytes, shorter than the 8-byte header length", path, size);
  const uint64_t header_len = read_le64(bytes);
  if (header_len > size - kHeaderLenBytes)
    fail_input("{}: header length {} past end of file ({} bytes after the length field)", path,
               header_len, size - kHeaderLenBytes);
  limits.check(&InputLimits::safetensors_header_bytes, static_cast<int64_t>(header_len), path,
               "header length");
  SafetensorsLayout layout;
  layout.data_begin = kHeaderLenBytes + header_len;
  layout.tensors = parse_header(path, reinterpret_cast<const char*>(bytes) + kHeaderLenBytes,
                                header_len, size - layout.data_begin, limits);
  return layout;
}

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path,
                                                       const InputLimits& limits) {
  std::unique_ptr<SafetensorsFile> f(new SafetensorsFile());  // unmaps on any throw below
  f->path_ = path;
  const FileDescriptor fd{::open(path.c_str(), O_RDONLY | O_CLOEXEC)};
  if (fd.fd < 0) fail_input("{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0 || !S_ISREG(st.st_mode)) fail_input("{}: not a regular file", path);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < kHeaderLenBytes)
    fail_input("{}: file is {} bytes, shorter than the 8-byte header length", path, size);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.fd, 0);
  if (p == MAP_FAILED) fail_input("{}: cannot mmap {} bytes: {}", path, size, std::strerror(errno));
  f->map_ = p;
  f->map_size_ = size;
  const auto* bytes = static_cast<const unsigned char*>(f->map_);
  SafetensorsLayout layout = parse_safetensors(path, bytes, size, limits);
  f->data_ = reinterpret_cast<const char*>(bytes) + layout.data_begin;
  f->tensors_ = std::move(layout.tensors);
  for (size_t i = 0; i < f->tensors_.size(); ++i) f->index_.emplace(f->tensors_[i].name, i);
  return f;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

Tensor SafetensorsFile::view(const SafetensorsTensor& t) const {
  Tensor v;
  // The mapping is read-only: writing through this pointer faults.
  v.data = const_cast<char*>(data_ + t.begin);
  v.dtype = t.dtype;
  v.shape = t.shape;
  v.device = Device::kHost;
  return v;
}

namespace {

// A shard must be a file of the model directory: a name with a separator or an absolute path
// would let an index read any file of the machine.
void check_shard_name(const std::string& index_path, const std::string& name,
                      const std::string& shard) {
  const bool plain = !shard.empty() && shard != "." && shard != ".." &&
                     shard.find('/') == std::string::npos && shard.find('\0') == std::string::npos;
  if (!plain)
    fail_input("{}: weight_map tensor '{}': shard \"{}\" is not a file name in the model directory",
               index_path, name, shard);
}

}  // namespace

std::map<std::string, std::string> parse_safetensors_index(const std::string& index_path,
                                                           std::string_view text,
                                                           const InputLimits& limits) {
  const json j = parse_json(index_path, "index", text.data(), text.data() + text.size());
  auto wm = j.find("weight_map");
  if (wm == j.end() || !wm->is_object())
    fail_input("{}: \"weight_map\" is missing or not an object", index_path);
  limits.check(&InputLimits::safetensors_tensors, static_cast<int64_t>(wm->size()), index_path,
               "weight_map entries");
  std::map<std::string, std::string> out;
  for (const auto& [name, shard] : wm->items()) {
    if (!shard.is_string())
      fail_input("{}: weight_map tensor '{}': shard {} is not a string", index_path, name,
                 shard.dump());
    check_shard_name(index_path, name, shard.get_ref<const std::string&>());
    out.emplace(name, shard.get<std::string>());
  }
  return out;
}

SafetensorsArchive SafetensorsArchive::open_dir(const std::string& dir, const InputLimits& limits) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) fail_input("{}: directory does not exist", dir);
  if (!fs::is_directory(dir, ec)) fail_input("{}: not a directory", dir);
  SafetensorsArchive a;
  a.dir_ = dir;
  const std::string index_path = (fs::path(dir) / "model.safetensors.index.json").string();
  const fs::path single_path = fs::path(dir) / "model.safetensors";

  std::map<std::string, std::string> weight_map;
  std::map<std::string, const SafetensorsFile*> shards;  // in weight_map order, opened once
  if (fs::exists(index_path, ec)) {
    const std::string text = read_file_bounded(index_path, limits, &InputLimits::json_file_bytes,
                                               "model.safetensors.index.json");
    weight_map = parse_safetensors_index(index_path, text, limits);
    for (const auto& [name, shard] : weight_map) {
      if (shards.count(shard)) continue;
      const fs::path shard_path = fs::path(dir) / shard;
      if (!fs::exists(shard_path, ec))
        fail_input("{}: shard '{}' (tensor '{}') does not exist: {}", index_path, shard, name,
                   shard_path.string());
      a.files_.push_back(SafetensorsFile::open(shard_path.string(), limits));
      shards.emplace(shard, a.files_.back().get());
    }
  } else if (fs::exists(single_path, ec)) {
    a.files_.push_back(SafetensorsFile::open(single_path.string(), limits));
  } else {
    fail_input("{}: no model.safetensors or model.safetensors.index.json", dir);
  }

  for (const auto& [name, shard] : weight_map) {
    const SafetensorsFile* file = shards.at(shard);
    const SafetensorsTensor* t = file->find(name);
    if (t == nullptr)
      fail_input("{}: tensor '{}' is mapped to shard '{}', but {} does not contain it", index_path,
                 name, shard, file->path());
    a.entries_.emplace(name, Entry{file, t});
  }
  // Tensors the index does not list are still reachable, unless two shards both hold one:
  // then nothing says which copy is meant.
  for (const auto& file : a.files_) {
    for (const auto& t : file->tensors()) {
      if (weight_map.count(t.name)) continue;
      const auto [it, added] = a.entries_.emplace(t.name, Entry{file.get(), &t});
      if (!added)
        fail_input("{}: tensor '{}' is in both {} and {}, and the index does not say which to use",
                   index_path, t.name, it->second.file->path(), file->path());
    }
  }
  return a;
}

SafetensorsArchive::Entry SafetensorsArchive::find(std::string_view name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? Entry{} : it->second;
}

std::vector<std::string> SafetensorsArchive::names() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& [name, entry] : entries_) out.push_back(name);
  return out;
}

namespace {

std::string build_header(const std::vector<TensorToWrite>& tensors,
                         const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    STRATA_CHECK(t.name != kMetadataKey && !header.contains(t.name),
                 "tensor name '{}' is reserved or repeated", t.name);
    STRATA_CHECK(t.tensor.data != nullptr || t.tensor.bytes() == 0, "tensor '{}' has no data",
                 t.name);
    STRATA_CHECK(t.tensor.device == Device::kHost, "tensor '{}' is {}, not on the host", t.name,
                 t.tensor.describe());
    json shape = json::array();
    for (int i = 0; i < t.tensor.shape.rank; ++i) shape.push_back(t.tensor.shape[i]);
    const uint64_t bytes = t.tensor.bytes();
    header[t.name] = {{"dtype", safetensors_dtype_name(t.tensor.dtype)},
                      {"shape", shape},
                      {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  if (!metadata.empty()) header[kMetadataKey] = metadata;
  std::string s = header.dump();
  // Padding keeps the data section 8-byte aligned in the mapping.
  s.append((kHeaderLenBytes - s.size() % kHeaderLenBytes) % kHeaderLenBytes, ' ');
  return s;
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  const std::string header = build_header(tensors, metadata);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) fail(ErrorKind::kFailed, "{}: cannot create: {}", path, std::strerror(errno));
  out << le64_bytes(header.size()) << header;
  for (const auto& t : tensors)
    out.write(static_cast<const char*>(t.tensor.data),
              static_cast<std::streamsize>(t.tensor.bytes()));
  out.close();
  if (!out) fail(ErrorKind::kFailed, "{}: cannot write: {}", path, std::strerror(errno));
}

}  // namespace strata
