// DirectFile: aligned O_DIRECT round trips, alignment preconditions, short reads as errors,
// scratch files removed on close.
#include <gtest/gtest.h>

#include <filesystem>

#include "kernels/error.h"
#include "kernels/tensor.h"
#include "worker/direct_file.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

char* aligned(Buffer& b) {
  return reinterpret_cast<char*>(align_up(reinterpret_cast<uintptr_t>(b.data())));
}

fs::path scratch(const std::string& name) {
  fs::create_directories(STRATA_TEST_TMP);
  return fs::path(STRATA_TEST_TMP) / name;
}

TEST(DirectFile, RoundTripsAlignedBlocksAtOffsets) {
  DirectFile f = DirectFile::create(scratch("roundtrip.bin").string());
  Buffer wb(3 * kDirectAlignment + kDirectAlignment), rb(3 * kDirectAlignment + kDirectAlignment);
  char* w = aligned(wb);
  char* r = aligned(rb);
  for (size_t i = 0; i < 3 * kDirectAlignment; ++i) w[i] = static_cast<char>((i * 7 + 3) & 0xff);
  f.write(w, 2 * kDirectAlignment, kDirectAlignment);  // leave a hole at block 0
  f.write(w + 2 * kDirectAlignment, kDirectAlignment, 0);
  f.sync();
  f.read(r, 2 * kDirectAlignment, kDirectAlignment);
  EXPECT_EQ(0, std::memcmp(r, w, 2 * kDirectAlignment));
  f.read(r, kDirectAlignment, 0);
  EXPECT_EQ(0, std::memcmp(r, w + 2 * kDirectAlignment, kDirectAlignment));
}

TEST(DirectFile, RejectsMisalignedTransfers) {
  DirectFile f = DirectFile::create(scratch("misaligned.bin").string());
  Buffer b(2 * kDirectAlignment);
  char* p = aligned(b);
  EXPECT_THROW(f.write(p + 1, kDirectAlignment, 0), Error);
  EXPECT_THROW(f.write(p, 100, 0), Error);
  EXPECT_THROW(f.write(p, kDirectAlignment, 512), Error);
}

TEST(DirectFile, ReadPastEndNamesFileAndOffset) {
  const fs::path path = scratch("short.bin");
  DirectFile f = DirectFile::create(path.string());
  Buffer b(2 * kDirectAlignment);
  char* p = aligned(b);
  f.write(p, kDirectAlignment, 0);
  try {
    f.read(p, kDirectAlignment, 8 * kDirectAlignment);
    FAIL() << "read past the end must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("short.bin"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::to_string(8 * kDirectAlignment)), std::string::npos)
        << e.what();
  }
}

TEST(DirectFile, UnlinkOnCloseRemovesTheFile) {
  const fs::path path = scratch("scratch.bin");
  {
    DirectFile f = DirectFile::create(path.string());
    f.unlink_on_close();
    EXPECT_TRUE(fs::exists(path));
    DirectFile moved = std::move(f);  // ownership (and the unlink) moves with it
  }
  EXPECT_FALSE(fs::exists(path));
}

TEST(DirectFile, CreateInMissingDirectoryIsAnInputError) {
  EXPECT_THROW(DirectFile::create("/nonexistent-dir/x.bin"), InputError);
}

}  // namespace
}  // namespace strata
