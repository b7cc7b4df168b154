// Safetensors checkpoints: a single file or a sharded set (model.safetensors.index.json),
// memory-mapped read-only. Every header field is validated against the file before any
// tensor is handed out; every error names the file and the tensor.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/tensor.h"
#include "worker/input_limits.h"

namespace strata {

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t begin = 0;  // byte offsets relative to the start of the data section
  uint64_t end = 0;
};

// The layout of a safetensors file: its tensors, sorted by offset, and where the data
// section begins (8 + header length).
struct SafetensorsLayout {
  uint64_t data_begin = 0;
  std::vector<SafetensorsTensor> tensors;
};

// Parses and validates the `size` bytes of a whole safetensors file (`path` names it in
// messages). Throws InputError naming the file (and tensor) on: fewer than 8 bytes; a header
// length past the end of the file or above limits.safetensors_header_bytes; a header that is
// not a JSON object starting with '{', nests deeper than a header can or has more tensors than
// limits.safetensors_tensors; an entry without dtype/shape/data_offsets; an unsupported dtype;
// a rank or a dimension above its limit or negative; offsets reversed or not matching the
// shape's byte size; and a data section the tensors do not cover exactly (the format allows
// no overlaps, no gaps and no bytes after the last tensor: a truncated file, a byte inserted
// into the data or a header length shortened into its padding all show up here).
SafetensorsLayout parse_safetensors(const std::string& path, const unsigned char* bytes,
                                    uint64_t size, const InputLimits& limits = {});

// The weight_map of a model.safetensors.index.json (`text`, read from `index_path`): tensor
// name -> shard file name. Throws InputError naming the index for malformed JSON, a missing
// weight_map, more entries than limits.safetensors_tensors, or a shard that is not a string
// naming a file of the model directory (no '/', not "." or "..").
std::map<std::string, std::string> parse_safetensors_index(const std::string& index_path,
                                                           std::string_view text,
                                                           const InputLimits& limits = {});

class SafetensorsFile {
 public:
  // Maps `path` and validates it with parse_safetensors.
  static std::unique_ptr<SafetensorsFile> open(const std::string& path,
                                               const InputLimits& limits = {});
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const SafetensorsTensor* find(std::string_view name) const;
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }
  // A host view into the mapping (valid while this object lives).
  Tensor view(const SafetensorsTensor& t) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  const char* data_ = nullptr;  // start of the data section
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
};

// All tensors of a checkpoint directory: `model.safetensors`, or the shards listed in
// `model.safetensors.index.json` ("weight_map": tensor name -> shard file name).
class SafetensorsArchive {
 public:
  // Throws InputError when the directory has neither file, a file is invalid (see
  // parse_safetensors), or the index is malformed: larger than limits.json_file_bytes, more
  // entries than limits.safetensors_tensors, a shard name that is not a plain file name in
  // `dir`, a shard that is missing, a tensor mapped to a shard that does not contain it, or a
  // tensor the index does not list that two shards both hold.
  static SafetensorsArchive open_dir(const std::string& dir, const InputLimits& limits = {});

  struct Entry {
    const SafetensorsFile* file = nullptr;
    const SafetensorsTensor* tensor = nullptr;
  };
  // nullptr fields when absent.
  Entry find(std::string_view name) const;
  std::vector<std::string> names() const;
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, Entry, std::less<>> entries_;
};

// Writes tensors as one safetensors file (header padded to 8 bytes, data in the given
// order). Used by tests and by `strata` to export dummy models.
struct TensorToWrite {
  std::string name;
  Tensor tensor;  // host; dtype f32/f16/bf16/i32
};
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace strata
