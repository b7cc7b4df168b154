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
#include <sstream>

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

Shape parse_entry_shape(const std::string& path, const std::string& name, const json& v) {
  if (!v.is_array()) fail_input("{}: tensor '{}': shape {} is not an array", path, name, v.dump());
  if (v.size() > static_cast<size_t>(kMaxDims))
    fail_input("{}: tensor '{}': shape {} has rank {}, more than the supported {}", path, name,
               v.dump(), v.size(), kMaxDims);
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
                              uint64_t data_size) {
  if (!entry.is_object())
    fail_input("{}: tensor '{}': entry {} is not an object", path, name, entry.dump());
  SafetensorsTensor t;
  t.name = name;
  t.dtype = parse_entry_dtype(path, name, field(path, name, entry, "dtype"));
  t.shape = parse_entry_shape(path, name, field(path, name, entry, "shape"));
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

// Overlapping tensors would alias each other's data. Empty tensors own no bytes, so they
// cannot overlap anything.
void check_no_overlap(const std::string& path, std::vector<SafetensorsTensor>& tensors) {
  std::sort(tensors.begin(), tensors.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  const SafetensorsTensor* prev = nullptr;
  for (const auto& t : tensors) {
    if (t.begin == t.end) continue;
    if (prev != nullptr && t.begin < prev->end)
      fail_input("{}: tensor '{}' data_offsets [{}, {}] overlap tensor '{}' data_offsets [{}, {}]",
                 path, t.name, t.begin, t.end, prev->name, prev->begin, prev->end);
    prev = &t;
  }
}

json parse_json(const std::string& path, const char* what, const char* first, const char* last) {
  json j;
  try {
    j = json::parse(first, last);
  } catch (const json::parse_error& e) {
    fail_input("{}: {} is not valid JSON: {}", path, what, e.what());
  }
  if (!j.is_object()) fail_input("{}: {} is not a JSON object", path, what);
  return j;
}

// The tensors of a header, sorted by offset (the order of their data in the file).
std::vector<SafetensorsTensor> parse_header(const std::string& path, const char* header,
                                            uint64_t header_len, uint64_t data_size) {
  const json j = parse_json(path, "header", header, header + header_len);
  std::vector<SafetensorsTensor> tensors;
  for (const auto& [name, entry] : j.items()) {
    if (name == kMetadataKey) continue;
    tensors.push_back(parse_entry(path, name, entry, data_size));
  }
  check_no_overlap(path, tensors);
  return tensors;
}

struct FileDescriptor {
  int fd;
  ~FileDescriptor() {
    if (fd >= 0) ::close(fd);
  }
};

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail_input("{}: cannot open: {}", path, std::strerror(errno));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

std::unique_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
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
  const uint64_t header_len = read_le64(bytes);
  if (header_len > size - kHeaderLenBytes)
    fail_input("{}: header length {} past end of file ({} bytes after the length field)", path,
               header_len, size - kHeaderLenBytes);
  const char* header = reinterpret_cast<const char*>(bytes) + kHeaderLenBytes;
  f->data_ = header + header_len;
  const uint64_t data_size = size - kHeaderLenBytes - header_len;

  f->tensors_ = parse_header(path, header, header_len, data_size);
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

// weight_map: tensor name -> shard file name.
std::map<std::string, std::string> parse_weight_map(const std::string& index_path) {
  const std::string text = read_text_file(index_path);
  const json j = parse_json(index_path, "index", text.data(), text.data() + text.size());
  auto wm = j.find("weight_map");
  if (wm == j.end() || !wm->is_object())
    fail_input("{}: \"weight_map\" is missing or not an object", index_path);
  std::map<std::string, std::string> out;
  for (const auto& [name, shard] : wm->items()) {
    if (!shard.is_string())
      fail_input("{}: weight_map tensor '{}': shard {} is not a string", index_path, name,
                 shard.dump());
    out.emplace(name, shard.get<std::string>());
  }
  return out;
}

}  // namespace

SafetensorsArchive SafetensorsArchive::open_dir(const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(dir, ec)) fail_input("{}: directory does not exist", dir);
  if (!fs::is_directory(dir, ec)) fail_input("{}: not a directory", dir);
  SafetensorsArchive a;
  a.dir_ = dir;
  const fs::path index_path = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single_path = fs::path(dir) / "model.safetensors";

  std::map<std::string, std::string> weight_map;
  std::map<std::string, const SafetensorsFile*> shards;  // in weight_map order, opened once
  if (fs::exists(index_path, ec)) {
    weight_map = parse_weight_map(index_path.string());
    for (const auto& [name, shard] : weight_map) {
      if (shards.count(shard)) continue;
      const fs::path shard_path = fs::path(dir) / shard;
      if (!fs::exists(shard_path, ec))
        fail_input("{}: shard '{}' (tensor '{}') does not exist: {}", index_path.string(), shard,
                   name, shard_path.string());
      a.files_.push_back(SafetensorsFile::open(shard_path.string()));
      shards.emplace(shard, a.files_.back().get());
    }
  } else if (fs::exists(single_path, ec)) {
    a.files_.push_back(SafetensorsFile::open(single_path.string()));
  } else {
    fail_input("{}: no model.safetensors or model.safetensors.index.json", dir);
  }

  for (const auto& [name, shard] : weight_map) {
    const SafetensorsFile* file = shards.at(shard);
    const SafetensorsTensor* t = file->find(name);
    if (t == nullptr)
      fail_input("{}: tensor '{}' is mapped to shard '{}', but {} does not contain it",
                 index_path.string(), name, shard, file->path());
    a.entries_.emplace(name, Entry{file, t});
  }
  // Tensors missing from weight_map are still reachable; weight_map entries take precedence.
  for (const auto& file : a.files_)
    for (const auto& t : file->tensors()) a.entries_.emplace(t.name, Entry{file.get(), &t});
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
