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

namespace strata {

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
  uint64_t begin = 0;  // byte offsets relative to the start of the data section
  uint64_t end = 0;
};

class SafetensorsFile {
 public:
  // Maps and validates `path`. Throws InputError naming the file (and tensor) on: a file
  // shorter than the 8-byte header length, a header length past end of file, a header that
  // is not a JSON object, an entry without dtype/shape/data_offsets, an unknown or
  // unsupported dtype, a negative dimension, offsets out of range / reversed / not matching
  // the shape's byte size, overlapping tensors, and data past the end of the file
  // (truncated file).
  static std::unique_ptr<SafetensorsFile> open(const std::string& path);
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
  // Throws InputError when the directory has neither file, the index is malformed, names a
  // shard that is missing, or maps a tensor to a shard that does not contain it.
  static SafetensorsArchive open_dir(const std::string& dir);

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
