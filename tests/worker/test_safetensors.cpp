#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <string>
#include <vector>

#include "kernels/error.h"
#include "worker/safetensors.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(STRATA_TEST_TMP) / (std::string(info->test_suite_name()) + "." + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (size_t i = 0; i < 8; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xffu);
  return s;
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

// A safetensors file with a hand-written header and `data_bytes` zero bytes of data.
void write_raw(const std::string& path, const std::string& header, size_t data_bytes) {
  write_bytes(path, le64(header.size()) + header + std::string(data_bytes, '\0'));
}

// The InputError message `f` throws; a test failure when it throws nothing.
template <typename F>
std::string input_error(F&& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected InputError";
  return "";
}

void expect_mentions(const std::string& message, std::initializer_list<std::string> parts) {
  for (const auto& part : parts)
    EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
}

std::string open_error(const std::string& path) {
  return input_error([&] { SafetensorsFile::open(path); });
}

template <typename T>
TensorToWrite tensor(const std::string& name, DType dtype, Shape shape, std::vector<T>& values) {
  TensorToWrite t{name, Tensor{values.data(), dtype, shape, Device::kHost}};
  EXPECT_EQ(t.tensor.bytes(), values.size() * sizeof(T));
  return t;
}

void expect_same(const SafetensorsFile& file, const TensorToWrite& want) {
  const SafetensorsTensor* t = file.find(want.name);
  ASSERT_NE(t, nullptr) << want.name;
  const Tensor v = file.view(*t);
  EXPECT_EQ(v.dtype, want.tensor.dtype) << want.name;
  EXPECT_EQ(v.shape, want.tensor.shape) << want.name;
  EXPECT_EQ(v.device, Device::kHost) << want.name;
  ASSERT_EQ(v.bytes(), want.tensor.bytes()) << want.name;
  if (v.bytes() > 0) {
    EXPECT_EQ(std::memcmp(v.data, want.tensor.data, v.bytes()), 0) << want.name;
  }
}

// The JSON header of a safetensors file, as written.
std::string read_header(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  unsigned char len[8] = {};
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len[i];
  std::string header(n, '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  return header;
}

TEST_F(SafetensorsTest, RoundTripAllDTypesAndMetadata) {
  std::vector<float> f32 = {1.5f, -2.f, 3.25f, 0.f, 1e-3f, 7.f};
  std::vector<uint16_t> f16, bf16;
  for (float x : {0.5f, -1.f, 2.f, 65504.f}) f16.push_back(f32_to_f16(x));
  for (float x : {0.5f, -1.f, 3.f, 1e30f}) bf16.push_back(f32_to_bf16(x));
  std::vector<int32_t> i32 = {-7, 0, 42};
  std::vector<float> empty;
  const std::vector<TensorToWrite> tensors = {
      tensor("w.f32", DType::kF32, {2, 3}, f32), tensor("w.f16", DType::kF16, {4}, f16),
      tensor("w.bf16", DType::kBF16, {2, 2}, bf16), tensor("ids", DType::kI32, {3}, i32),
      tensor("empty", DType::kF32, {0, 5}, empty)};
  const std::string file = path("model.safetensors");
  write_safetensors(file, tensors, {{"format", "pt"}});

  auto st = SafetensorsFile::open(file);
  EXPECT_EQ(st->path(), file);
  EXPECT_EQ(st->tensors().size(), tensors.size());
  for (const auto& t : tensors) expect_same(*st, t);
  EXPECT_EQ(st->find("__metadata__"), nullptr);
  EXPECT_EQ(st->find("absent"), nullptr);

  const std::string header = read_header(file);
  EXPECT_EQ(header.size() % 8, 0u);
  EXPECT_NE(header.find(R"("__metadata__":{"format":"pt"})"), std::string::npos) << header;
}

TEST_F(SafetensorsTest, OpenDirSingleFile) {
  std::vector<float> a = {1.f, 2.f};
  const std::vector<TensorToWrite> tensors = {tensor("a", DType::kF32, {2}, a)};
  write_safetensors(path("model.safetensors"), tensors);
  const auto archive = SafetensorsArchive::open_dir(dir_.string());
  EXPECT_EQ(archive.names(), std::vector<std::string>{"a"});
  const auto e = archive.find("a");
  ASSERT_NE(e.file, nullptr);
  expect_same(*e.file, tensors[0]);
  EXPECT_EQ(archive.find("b").tensor, nullptr);
}

TEST_F(SafetensorsTest, ShardedIndexRoundTrip) {
  std::vector<float> a = {1.f, 2.f, 3.f, 4.f};
  std::vector<uint16_t> b = {f32_to_bf16(1.f), f32_to_bf16(-2.f)};
  std::vector<float> c = {9.f};
  std::vector<int32_t> extra = {5, 6};
  const std::vector<TensorToWrite> shard1 = {tensor("a", DType::kF32, {2, 2}, a)};
  const std::vector<TensorToWrite> shard2 = {tensor("b", DType::kBF16, {2}, b),
                                             tensor("c", DType::kF32, {1}, c),
                                             tensor("extra", DType::kI32, {2}, extra)};
  write_safetensors(path("model-00001-of-00002.safetensors"), shard1);
  write_safetensors(path("model-00002-of-00002.safetensors"), shard2);
  write_bytes(path("model.safetensors.index.json"),
              R"({"metadata": {"total_size": 28}, "weight_map": {
                    "a": "model-00001-of-00002.safetensors",
                    "b": "model-00002-of-00002.safetensors",
                    "c": "model-00002-of-00002.safetensors"}})");

  const auto archive = SafetensorsArchive::open_dir(dir_.string());
  EXPECT_EQ(archive.dir(), dir_.string());
  EXPECT_EQ(archive.names(), (std::vector<std::string>{"a", "b", "c", "extra"}));
  for (const auto* shard : {&shard1, &shard2}) {
    for (const auto& t : *shard) {
      const auto e = archive.find(t.name);
      ASSERT_NE(e.file, nullptr) << t.name;
      EXPECT_EQ(e.tensor, e.file->find(t.name));
      expect_same(*e.file, t);
    }
  }
  EXPECT_EQ(archive.find("a").file->path(), path("model-00001-of-00002.safetensors"));
  // Both tensors of shard 2 come from one opened file.
  EXPECT_EQ(archive.find("b").file, archive.find("c").file);
}

TEST_F(SafetensorsTest, RejectsTruncatedFile) {
  std::vector<float> w(64, 1.f);
  const std::string file = path("model.safetensors");
  write_safetensors(file, {tensor("x.weight", DType::kF32, {64}, w)});
  fs::resize_file(file, fs::file_size(file) - 16);
  expect_mentions(open_error(file), {file, "'x.weight'", "[0, 256]", "240 bytes", "truncated"});
}

TEST_F(SafetensorsTest, RejectsHeaderLengthPastEndOfFile) {
  const std::string file = path("model.safetensors");
  write_bytes(file, le64(1000) + R"({"a":1})");
  expect_mentions(open_error(file), {file, "header length 1000 past end of file", "7 bytes"});
}

TEST_F(SafetensorsTest, RejectsAbsurdHeaderLength) {
  const std::string file = path("model.safetensors");
  write_bytes(file, le64(~uint64_t{0}) + "{}");
  expect_mentions(open_error(file), {file, "header length 18446744073709551615 past end of file"});
}

TEST_F(SafetensorsTest, RejectsFileShorterThanHeaderLength) {
  const std::string file = path("model.safetensors");
  write_bytes(file, "abcde");
  expect_mentions(open_error(file), {file, "5 bytes", "8-byte header length"});
}

TEST_F(SafetensorsTest, RejectsMissingFile) {
  const std::string file = path("nope.safetensors");
  expect_mentions(open_error(file), {file, "cannot open"});
}

TEST_F(SafetensorsTest, RejectsHeaderNotJson) {
  const std::string file = path("model.safetensors");
  write_raw(file, "{\"a\": not json}", 0);
  expect_mentions(open_error(file), {file, "header is not valid JSON"});
}

// Found by fuzz_safetensors_index: nlohmann reports a number too large for a double as
// out_of_range, not parse_error; it escaped as an error naming no file.
TEST_F(SafetensorsTest, RejectsNumberTooLargeForJson) {
  const std::string file = path("model.safetensors");
  write_raw(file, R"({"a": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 0]}})", 0);
  expect_mentions(open_error(file), {file, "header is not valid JSON", "number overflow"});
  const std::string index = path("model.safetensors.index.json");
  expect_mentions(input_error([&] { parse_safetensors_index(index, R"({"weight_map": 1e999})"); }),
                  {index, "index is not valid JSON"});
}

TEST_F(SafetensorsTest, RejectsHeaderNotObject) {
  const std::string file = path("model.safetensors");
  write_raw(file, "[1, 2, 3]", 0);
  expect_mentions(open_error(file), {file, "header does not begin with '{'"});
}

TEST_F(SafetensorsTest, RejectsEntryMissingField) {
  const std::string file = path("model.safetensors");
  write_raw(file, R"({"x.weight": {"dtype": "F32", "data_offsets": [0, 4]}})", 4);
  expect_mentions(open_error(file), {file, "'x.weight'", "missing \"shape\""});
}

TEST_F(SafetensorsTest, RejectsNegativeDimension) {
  const std::string file = path("model.safetensors");
  write_raw(file, R"({"x.weight": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 0]}})", 0);
  expect_mentions(open_error(file), {file, "'x.weight'", "is -1", "non-negative"});
}

TEST_F(SafetensorsTest, RejectsDataOffsetsOutOfRange) {
  const std::string file = path("model.safetensors");
  // The data section holds 16 bytes: enough for "a" but not for "b" at offset 16.
  write_raw(file,
            R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}})",
            16);
  expect_mentions(open_error(file), {file, "'b'", "[16, 32]", "past the data section of 16 bytes"});
}

TEST_F(SafetensorsTest, RejectsReversedDataOffsets) {
  const std::string file = path("model.safetensors");
  write_raw(file, R"({"a": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})", 16);
  expect_mentions(open_error(file), {file, "'a'", "[8, 4]", "begin after end"});
}

TEST_F(SafetensorsTest, RejectsOverlappingOffsets) {
  const std::string file = path("model.safetensors");
  write_raw(file,
            R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})",
            24);
  expect_mentions(open_error(file), {file, "'a'", "'b'", "overlap"});
}

TEST_F(SafetensorsTest, RejectsOffsetsNotMatchingShape) {
  const std::string file = path("model.safetensors");
  write_raw(file, R"({"x.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 8]}})", 16);
  expect_mentions(open_error(file), {file, "'x.weight'", "span 8 bytes", "needs 16"});
}

TEST_F(SafetensorsTest, RejectsUnknownDType) {
  const std::string file = path("model.safetensors");
  write_raw(file, R"({"x.weight": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]}})", 16);
  expect_mentions(open_error(file), {file, "'x.weight'", "\"F64\"", "F32, F16, BF16, I32"});
}

// Failure 1 of issue 10: corrupt files that parse. The format requires the tensors to cover
// the data section exactly: no byte before, between or after them.
TEST_F(SafetensorsTest, RejectsByteInsertedIntoData) {
  std::vector<float> a(4, 1.f), b(4, 2.f);
  const std::string file = path("model.safetensors");
  write_safetensors(file, {tensor("a", DType::kF32, {4}, a), tensor("b", DType::kF32, {4}, b)});
  const uint64_t data_begin = 8 + read_header(file).size();
  std::ifstream in(file, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  bytes.insert(data_begin + 5, 1, '\x7f');  // one byte inside tensor a's data
  write_bytes(file, bytes);
  // Two tensors of 4 f32 end at byte 32; the data section now holds 33.
  expect_mentions(open_error(file),
                  {file, "data section is 33 bytes", "tensors end at byte 32", "1 bytes"});
}

TEST_F(SafetensorsTest, RejectsHeaderLengthShortenedIntoItsPadding) {
  std::vector<float> a(4, 1.f);
  const std::string file = path("model.safetensors");
  write_safetensors(file, {tensor("a", DType::kF32, {4}, a)});
  const std::string header = read_header(file);
  const size_t pad = header.size() - header.find_last_not_of(' ') - 1;
  ASSERT_GT(pad, 0u) << "the writer pads the header to 8 bytes; this one needs padding: " << header;
  // The shorter length still ends on the closing '}': valid JSON whose data begins `pad`
  // bytes early, inside the old padding.
  std::ifstream in(file, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  bytes.replace(0, 8, le64(header.size() - pad));
  write_bytes(file, bytes);
  expect_mentions(open_error(file), {file, fmt::format("data section is {} bytes", 16 + pad),
                                     "tensors end at byte 16"});
}

TEST_F(SafetensorsTest, RejectsGapBetweenTensors) {
  const std::string file = path("model.safetensors");
  write_raw(file,
            R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "b": {"dtype": "F32", "shape": [4], "data_offsets": [20, 36]}})",
            36);
  expect_mentions(open_error(file), {file, "bytes [16, 20)", "'b' begins at 20", "'a' ends at 16"});
}

TEST_F(SafetensorsTest, RejectsDataBeforeFirstTensor) {
  const std::string file = path("model.safetensors");
  write_raw(file, R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [4, 20]}})", 20);
  expect_mentions(open_error(file), {file, "bytes [0, 4)", "'a' begins at 4"});
}

TEST_F(SafetensorsTest, EmptyTensorsMayShareAnOffset) {
  const std::string file = path("model.safetensors");
  write_raw(file,
            R"({"e": {"dtype": "F32", "shape": [0], "data_offsets": [16, 16]},
                "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                "z": {"dtype": "F16", "shape": [0, 3], "data_offsets": [16, 16]}})",
            16);
  EXPECT_EQ(SafetensorsFile::open(file)->tensors().size(), 3u);
}

TEST_F(SafetensorsTest, RejectsHeaderThatDoesNotBeginWithBrace) {
  const std::string file = path("model.safetensors");
  write_raw(file, R"( {"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}})", 0);
  expect_mentions(open_error(file), {file, "does not begin with '{'"});
}

// Failure 3: every size a file controls has a limit, checked before it is used.
TEST_F(SafetensorsTest, RejectsHeaderAboveLimit) {
  InputLimits limits;
  limits.safetensors_header_bytes = 16;
  const std::string file = path("model.safetensors");
  const std::string header = R"({"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}})";
  write_raw(file, header, 0);
  expect_mentions(input_error([&] { SafetensorsFile::open(file, limits); }),
                  {file, fmt::format("header length = {}", header.size()), "limit of 16",
                   "safetensors_header_bytes"});
}

TEST_F(SafetensorsTest, RejectsMoreTensorsThanLimit) {
  InputLimits limits;
  limits.safetensors_tensors = 2;
  const std::string file = path("model.safetensors");
  write_raw(file,
            R"({"__metadata__": {"format": "pt"},
                "a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
                "b": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
                "c": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}})",
            0);
  expect_mentions(input_error([&] { SafetensorsFile::open(file, limits); }),
                  {file, "tensor count = 3", "limit of 2", "safetensors_tensors"});
  limits.safetensors_tensors = 3;  // __metadata__ is not a tensor
  EXPECT_EQ(SafetensorsFile::open(file, limits)->tensors().size(), 3u);
}

TEST_F(SafetensorsTest, RejectsRankAboveLimit) {
  const std::string file = path("model.safetensors");
  write_raw(file, R"({"x": {"dtype": "F32", "shape": [1, 1, 1, 1, 1], "data_offsets": [0, 4]}})",
            4);
  expect_mentions(open_error(file), {file, "'x'", "shape rank = 5", "limit of 4", "tensor_rank"});
}

TEST_F(SafetensorsTest, RejectsDimensionAboveLimit) {
  const std::string file = path("model.safetensors");
  // 2^26 + 1 elements along one dimension; the default limit is 2^26 = 67108864.
  write_raw(file, R"({"x": {"dtype": "F32", "shape": [0, 67108865], "data_offsets": [0, 0]}})", 0);
  expect_mentions(open_error(file),
                  {file, "'x'", "dimension 1 = 67108865", "limit of 67108864", "tensor_dim"});
}

TEST_F(SafetensorsTest, RejectsNestingDeeperThanAHeader) {
  const std::string file = path("model.safetensors");
  write_raw(file, R"({"x": {"dtype": "F32", "shape": [[1]], "data_offsets": [0, 4]}})", 4);
  expect_mentions(open_error(file), {file, "'x'", "\"shape\" nests deeper"});
  write_raw(file, R"({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4, 4]}})", 4);
  expect_mentions(open_error(file), {file, "'x'", "\"data_offsets\" holds more than 2"});
}

// The index path: every shard is checked like a single file, and the index itself is bounded.
TEST_F(SafetensorsTest, RejectsCorruptShardOfIndex) {
  std::vector<float> a(4, 1.f), b(4, 2.f);
  write_safetensors(path("s1.safetensors"), {tensor("a", DType::kF32, {4}, a)});
  write_safetensors(path("s2.safetensors"), {tensor("b", DType::kF32, {4}, b)});
  write_bytes(path("model.safetensors.index.json"),
              R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})");
  ASSERT_EQ(SafetensorsArchive::open_dir(dir_.string()).names().size(), 2u);
  std::ofstream(path("s2.safetensors"), std::ios::binary | std::ios::app).put('\0');
  expect_mentions(input_error([&] { SafetensorsArchive::open_dir(dir_.string()); }),
                  {path("s2.safetensors"), "data section is 17 bytes", "tensors end at byte 16"});
}

TEST_F(SafetensorsTest, RejectsShardOutsideTheModelDirectory) {
  const std::string index = path("model.safetensors.index.json");
  for (const char* shard : {"../model.safetensors", "/etc/passwd", "sub/x.safetensors", ".."}) {
    write_bytes(index, fmt::format(R"({{"weight_map": {{"a": "{}"}}}})", shard));
    expect_mentions(input_error([&] { SafetensorsArchive::open_dir(dir_.string()); }),
                    {index, "'a'", shard, "not a file name in the model directory"});
  }
}

TEST_F(SafetensorsTest, RejectsUnlistedTensorInTwoShards) {
  std::vector<float> a(1, 1.f), x(1, 2.f);
  write_safetensors(path("s1.safetensors"),
                    {tensor("a", DType::kF32, {1}, a), tensor("x", DType::kF32, {1}, x)});
  write_safetensors(path("s2.safetensors"), {tensor("x", DType::kF32, {1}, x)});
  const std::string index = path("model.safetensors.index.json");
  write_bytes(index, R"({"weight_map": {"a": "s1.safetensors", "x": "s2.safetensors"}})");
  // x is in both shards but listed: the index decides.
  EXPECT_EQ(SafetensorsArchive::open_dir(dir_.string()).find("x").file->path(),
            path("s2.safetensors"));
  // y is in both shards and not listed: nothing says which copy is meant.
  std::vector<float> y(1, 3.f);
  write_safetensors(path("s1.safetensors"),
                    {tensor("a", DType::kF32, {1}, a), tensor("y", DType::kF32, {1}, y)});
  write_safetensors(path("s2.safetensors"),
                    {tensor("x", DType::kF32, {1}, x), tensor("y", DType::kF32, {1}, y)});
  expect_mentions(input_error([&] { SafetensorsArchive::open_dir(dir_.string()); }),
                  {index, "'y'", path("s1.safetensors"), path("s2.safetensors")});
}

TEST_F(SafetensorsTest, RejectsIndexAboveLimits) {
  std::vector<float> a(1, 1.f);
  write_safetensors(path("s1.safetensors"), {tensor("a", DType::kF32, {1}, a)});
  const std::string index = path("model.safetensors.index.json");
  const std::string text = R"({"weight_map": {"a": "s1.safetensors"}})";
  write_bytes(index, text);
  InputLimits limits;
  limits.json_file_bytes = 10;
  expect_mentions(input_error([&] { SafetensorsArchive::open_dir(dir_.string(), limits); }),
                  {index, fmt::format("= {}", text.size()), "limit of 10", "json_file_bytes"});
  limits = InputLimits{};
  limits.safetensors_tensors = 0;
  expect_mentions(input_error([&] { SafetensorsArchive::open_dir(dir_.string(), limits); }),
                  {index, "weight_map entries = 1", "limit of 0"});
}

TEST_F(SafetensorsTest, RejectsMissingIndexShard) {
  std::vector<float> a = {1.f};
  write_safetensors(path("shard-1.safetensors"), {tensor("a", DType::kF32, {1}, a)});
  const std::string index = path("model.safetensors.index.json");
  write_bytes(index, R"({"weight_map": {"a": "shard-1.safetensors", "b": "shard-2.safetensors"}})");
  expect_mentions(input_error([&] { SafetensorsArchive::open_dir(dir_.string()); }),
                  {index, "'shard-2.safetensors'", "'b'", "does not exist"});
}

TEST_F(SafetensorsTest, RejectsIndexTensorAbsentFromShard) {
  std::vector<float> a = {1.f};
  write_safetensors(path("shard-1.safetensors"), {tensor("a", DType::kF32, {1}, a)});
  const std::string index = path("model.safetensors.index.json");
  write_bytes(index, R"({"weight_map": {"a": "shard-1.safetensors", "b": "shard-1.safetensors"}})");
  expect_mentions(input_error([&] { SafetensorsArchive::open_dir(dir_.string()); }),
                  {index, "'b'", "'shard-1.safetensors'", "does not contain it"});
}

TEST_F(SafetensorsTest, RejectsIndexWithoutWeightMap) {
  const std::string index = path("model.safetensors.index.json");
  write_bytes(index, R"({"metadata": {}})");
  expect_mentions(input_error([&] { SafetensorsArchive::open_dir(dir_.string()); }),
                  {index, "\"weight_map\""});
}

TEST_F(SafetensorsTest, RejectsMissingDirectory) {
  const std::string dir = path("no-such-dir");
  expect_mentions(input_error([&] { SafetensorsArchive::open_dir(dir); }), {dir, "does not exist"});
}

TEST_F(SafetensorsTest, RejectsDirectoryWithoutModel) {
  expect_mentions(input_error([&] { SafetensorsArchive::open_dir(dir_.string()); }),
                  {dir_.string(), "no model.safetensors or model.safetensors.index.json"});
}

TEST_F(SafetensorsTest, WriteToUnwritablePathFails) {
  std::vector<float> a = {1.f};
  const std::string file = path("no-such-dir/model.safetensors");
  try {
    write_safetensors(file, {tensor("a", DType::kF32, {1}, a)});
    ADD_FAILURE() << "expected Error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kFailed);
    expect_mentions(e.what(), {file});
  }
}

}  // namespace
}  // namespace strata
