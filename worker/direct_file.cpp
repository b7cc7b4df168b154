#include "worker/direct_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <utility>

#include "kernels/clock.h"
#include "kernels/error.h"
#include "kernels/tensor.h"

namespace strata {

DirectFile DirectFile::create(const std::string& path) {
  DirectFile f;
  f.path_ = path;
  f.fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT, 0600);
  f.direct_ = f.fd_ >= 0;
  if (f.fd_ < 0 && errno == EINVAL) f.fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
  if (f.fd_ < 0) fail_input("cannot create '{}': {}", path, std::strerror(errno));
  return f;
}

DirectFile::DirectFile(DirectFile&& o) noexcept
    : fd_(std::exchange(o.fd_, -1)),
      direct_(o.direct_),
      unlink_(std::exchange(o.unlink_, false)),
      path_(std::move(o.path_)) {}

DirectFile& DirectFile::operator=(DirectFile&& o) noexcept {
  if (this != &o) {
    this->~DirectFile();
    fd_ = std::exchange(o.fd_, -1);
    direct_ = o.direct_;
    unlink_ = std::exchange(o.unlink_, false);
    path_ = std::move(o.path_);
  }
  return *this;
}

DirectFile::~DirectFile() {
  if (fd_ >= 0) ::close(fd_);
  if (unlink_ && !path_.empty()) ::unlink(path_.c_str());
  fd_ = -1;
}

void DirectFile::check_aligned(const void* buf, size_t bytes, uint64_t offset,
                               const char* op) const {
  STRATA_CHECK(reinterpret_cast<uintptr_t>(buf) % kDirectAlignment == 0 &&
                   bytes % kDirectAlignment == 0 && offset % kDirectAlignment == 0,
               "{} of {}: buffer {}, {} bytes at offset {} must be {}-byte aligned", op, path_, buf,
               bytes, offset, kDirectAlignment);
}

void DirectFile::write(const void* buf, size_t bytes, uint64_t offset) const {
  check_aligned(buf, bytes, offset, "write");
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pwrite(fd_, static_cast<const char*>(buf) + done, bytes - done,
                               static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      fail(ErrorKind::kFailed, "write of {} bytes at offset {} to '{}' failed: {}", bytes, offset,
           path_, n < 0 ? std::strerror(errno) : "no progress (disk full?)");
    done += static_cast<size_t>(n);
  }
}

void DirectFile::sync() const {
  if (::fdatasync(fd_) != 0)
    fail(ErrorKind::kFailed, "fdatasync of '{}' failed: {}", path_, std::strerror(errno));
}

void DirectFile::read(void* buf, size_t bytes, uint64_t offset) const {
  check_aligned(buf, bytes, offset, "read");
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pread(fd_, static_cast<char*>(buf) + done, bytes - done,
                              static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      fail(ErrorKind::kFailed, "read of {} bytes at offset {} from '{}' failed: {}", bytes, offset,
           path_, n < 0 ? std::strerror(errno) : "end of file");
    done += static_cast<size_t>(n);
  }
}

std::string DirectFile::read_noexcept(void* buf, size_t bytes, uint64_t offset,
                                      double& seconds) const {
  const double t0 = now_s();
  std::string error;
  try {
    read(buf, bytes, offset);
  } catch (const std::exception& e) {
    error = e.what();
  }
  seconds = now_s() - t0;
  return error;
}

DirectIoTimes time_direct_io(const std::string& dir, size_t bytes, size_t chunk) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(dir)) fail_input("--disk-dir '{}' is not a directory", dir);
  DirectIoTimes t;
  t.bytes = align_up(bytes, chunk);
  DirectFile f = DirectFile::create(
      (fs::path(dir) / fmt::format("strata-io-probe-{}.bin", getpid())).string());
  f.unlink_on_close();
  t.o_direct = f.direct();
  Buffer buf(chunk + kDirectAlignment);
  auto* p = reinterpret_cast<char*>(align_up(reinterpret_cast<uintptr_t>(buf.data())));
  std::iota(reinterpret_cast<uint8_t*>(p), reinterpret_cast<uint8_t*>(p) + chunk, uint8_t{0});
  auto t0 = std::chrono::steady_clock::now();
  for (size_t off = 0; off < t.bytes; off += chunk) f.write(p, chunk, off);
  f.sync();  // buffered fallback: count the time to reach the disk
  t.write_s = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  for (size_t off = 0; off < t.bytes; off += chunk) f.read(p, chunk, off);
  t.read_s = seconds_since(t0);
  return t;
}

}  // namespace strata
