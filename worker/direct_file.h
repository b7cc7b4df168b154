// A file read and written around the page cache (O_DIRECT), so a memory budget is a real
// budget and disk bandwidth is what the disk gives. Buffers, offsets and sizes must be
// multiples of kDirectAlignment. Where the filesystem refuses O_DIRECT (tmpfs), the file
// falls back to buffered I/O and says so through direct().
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace strata {

constexpr size_t kDirectAlignment = 4096;

inline size_t align_up(size_t n, size_t a = kDirectAlignment) {
  return (n + a - 1) / a * a;
}

class DirectFile {
 public:
  // Creates (truncating) or opens `path` for reading and writing.
  static DirectFile create(const std::string& path);
  DirectFile() = default;
  DirectFile(DirectFile&& o) noexcept;
  DirectFile& operator=(DirectFile&& o) noexcept;
  DirectFile(const DirectFile&) = delete;
  DirectFile& operator=(const DirectFile&) = delete;
  ~DirectFile();

  // Whole-buffer transfers; a short transfer or an error throws with path, offset, size.
  void write(const void* buf, size_t bytes, uint64_t offset) const;
  void read(void* buf, size_t bytes, uint64_t offset) const;

  // read() on an I/O thread: the error as text (empty when it succeeded) instead of a throw,
  // which the thread hands to the one waiting for the data, and the seconds it took.
  std::string read_noexcept(void* buf, size_t bytes, uint64_t offset, double& seconds) const;

  void sync() const;  // fdatasync: data on the device, whatever the mode
  bool direct() const { return direct_; }
  const std::string& path() const { return path_; }
  // Deletes the file when this object goes (scratch files of the disk tier).
  void unlink_on_close() { unlink_ = true; }

 private:
  void check_aligned(const void* buf, size_t bytes, uint64_t offset, const char* op) const;
  int fd_ = -1;
  bool direct_ = false;
  bool unlink_ = false;
  std::string path_;
};

// A sequential write then read of `bytes` (rounded up to whole `chunk`s) in `chunk`-byte
// requests, to a scratch file under `dir` that goes when done: what a disk tier gets from the
// disk (strata profile, a node's inventory). The write's time counts until the data is on
// the device (fdatasync).
struct DirectIoTimes {
  size_t bytes = 0;
  bool o_direct = false;  // false: the filesystem refused O_DIRECT and the page cache served
  double write_s = 0, read_s = 0;
};
DirectIoTimes time_direct_io(const std::string& dir, size_t bytes, size_t chunk);

}  // namespace strata
