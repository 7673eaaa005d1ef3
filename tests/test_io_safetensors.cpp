// safetensors: round trips of every dtype (raw and through fourbit tensors), byte-identical output
// to the reference implementation's test vectors, atomic writes under a simulated crash, and every
// malformed-header rejection with its message.
#include "io/safetensors.h"

#include "io_test_util.h"

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <random>

namespace fourbit::io {
namespace {

using test::TempDir;

constexpr StDType kAllStDTypes[] = {
    StDType::kBool,   StDType::kU8,  StDType::kI8,     StDType::kF8E5M2, StDType::kF8E4M3,
    StDType::kF8E8M0, StDType::kF4,  StDType::kF6E2M3, StDType::kF6E3M2, StDType::kI16,
    StDType::kU16,    StDType::kF16, StDType::kBF16,   StDType::kI32,    StDType::kU32,
    StDType::kF32,    StDType::kF64, StDType::kI64,    StDType::kU64,    StDType::kC64};

constexpr DType kAllDTypes[] = {DType::kF64,  DType::kF32,  DType::kBF16,   DType::kF16,
                                DType::kE4M3, DType::kE5M2, DType::kE8M0,   DType::kE2M1x2,
                                DType::kU8,   DType::kU16,  DType::kI32,    DType::kU32,
                                DType::kI64};

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = (uint8_t)rng();
  return v;
}

// A file from a header string and a data section (the length prefix computed).
std::vector<uint8_t> make_file(const std::string& header, const std::vector<uint8_t>& data = {}) {
  std::string s(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(s.data(), &n, 8);
  s += header;
  s.append(data.begin(), data.end());
  return std::vector<uint8_t>(s.begin(), s.end());
}

std::string reject_message(const std::vector<uint8_t>& bytes) {
  return test::error_of([&] { SafetensorsFile::from_bytes(bytes, "bad.safetensors"); });
}

TEST(Safetensors, DTypeNamesAndSizes) {
  for (StDType t : kAllStDTypes) EXPECT_EQ(st_dtype_from_name(st_dtype_name(t)), t) << st_dtype_name(t);
  EXPECT_EQ(st_dtype_name(StDType::kF8E4M3), "F8_E4M3");
  EXPECT_EQ(st_dtype_bits(StDType::kBF16), 16);
  EXPECT_EQ(st_dtype_bits(StDType::kF4), 4);
  EXPECT_FALSE(st_dtype_from_name("F128").has_value());
  EXPECT_FALSE(st_dtype_from_name("f32").has_value());
  for (DType t : kAllDTypes) EXPECT_EQ(to_fourbit_dtype(from_fourbit_dtype(t)), t);
  EXPECT_FALSE(to_fourbit_dtype(StDType::kI8).has_value());
  EXPECT_FALSE(to_fourbit_dtype(StDType::kBool).has_value());
}

TEST(Safetensors, RoundTripEveryDtypeThroughAFile) {
  TempDir dir;
  SafetensorsWriter w;
  std::vector<std::vector<uint8_t>> payloads;
  uint32_t seed = 1;
  for (StDType t : kAllStDTypes) {
    // 12 elements: whole bytes for the 4- and 6-bit types too.
    payloads.push_back(random_bytes((size_t)(12 * st_dtype_bits(t) / 8), seed++));
    w.add(fmt::format("t.{}", st_dtype_name(t)), t, {3, 4}, payloads.back());
  }
  const std::vector<uint8_t> four = random_bytes(4, 99);
  w.add("scalar", StDType::kF32, {}, four);
  w.add("empty", StDType::kF64, {0, 5}, std::span<const uint8_t>());
  w.set_metadata("format", "pt");
  w.set_metadata("note", "ünïcode ✓ and \"quotes\"\n");
  const std::string path = dir.file("all.safetensors");
  w.write(path);
  EXPECT_EQ(test::read_bytes(path), w.serialize());

  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.path(), path);
  EXPECT_EQ(f.tensors().size(), std::size(kAllStDTypes) + 2);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("note"), "ünïcode ✓ and \"quotes\"\n");
  for (size_t i = 0; i < std::size(kAllStDTypes); ++i) {
    const StTensor& t = f.get(fmt::format("t.{}", st_dtype_name(kAllStDTypes[i])));
    EXPECT_EQ(t.dtype, kAllStDTypes[i]);
    EXPECT_EQ(t.shape, (std::vector<int64_t>{3, 4}));
    EXPECT_EQ(t.numel(), 12);
    ASSERT_EQ(t.bytes.size(), payloads[i].size());
    EXPECT_EQ(0, std::memcmp(t.bytes.data(), payloads[i].data(), payloads[i].size()));
  }
  EXPECT_EQ(f.get("scalar").shape.size(), 0u);
  EXPECT_EQ(f.get("scalar").numel(), 1);
  EXPECT_EQ(f.get("empty").bytes.size(), 0u);
  EXPECT_EQ(f.get("empty").shape_str(), "[0, 5]");

  // Tensors are packed largest element first: every byte-sized type starts at a multiple of its
  // size, in the file (the data section starts 8-byte aligned) and in memory (mmap is page aligned).
  const uint8_t* file_start = f.tensors().front().bytes.data();
  for (const StTensor& t : f.tensors()) {
    const int bytes = st_dtype_bits(t.dtype) / 8;
    if (bytes >= 1 && st_dtype_bits(t.dtype) % 8 == 0 && !t.bytes.empty()) {
      EXPECT_EQ((uintptr_t)t.bytes.data() % (uintptr_t)bytes, 0u) << t.name;
      EXPECT_EQ((t.bytes.data() - file_start) % bytes, 0) << t.name;
    }
  }
  EXPECT_EQ((uintptr_t)file_start % 8, 0u);
}

TEST(Safetensors, RoundTripEveryFourbitDtypeThroughTensors) {
  TempDir dir;
  SafetensorsWriter w;
  std::vector<Tensor> originals;
  uint32_t seed = 7;
  for (DType t : kAllDTypes) {
    const Shape shape{2, 3, 4};
    Tensor x = Tensor::empty(shape, t, Device::kCpu);
    const std::vector<uint8_t> bytes = random_bytes((size_t)x.nbytes(), seed++);
    std::memcpy(x.data(), bytes.data(), bytes.size());
    originals.push_back(x);
    w.add(std::string(dtype_name(t)), x);
  }
  const std::string path = dir.file("tensors.safetensors");
  w.write(path);
  const SafetensorsFile f = SafetensorsFile::open(path);
  for (size_t i = 0; i < std::size(kAllDTypes); ++i) {
    const std::string name(dtype_name(kAllDTypes[i]));
    EXPECT_EQ(f.get(name).dtype, from_fourbit_dtype(kAllDTypes[i]));
    const Tensor y = f.to_tensor(name);
    EXPECT_EQ(y.dtype(), kAllDTypes[i]);
    EXPECT_TRUE(y.shape() == originals[i].shape()) << y.shape().str();
    ASSERT_EQ(y.nbytes(), originals[i].nbytes());
    EXPECT_EQ(0, std::memcmp(y.data(), originals[i].data(), (size_t)y.nbytes())) << name;

    Tensor z = Tensor::zeros(originals[i].shape(), kAllDTypes[i], Device::kCpu);
    f.copy_into(name, z);
    EXPECT_EQ(0, std::memcmp(z.data(), originals[i].data(), (size_t)z.nbytes())) << name;
  }
  // copy_into names what differs.
  Tensor wrong = Tensor::zeros(Shape{2, 3, 5}, DType::kF32, Device::kCpu);
  EXPECT_ERROR_CONTAINS(f.copy_into("f32", wrong), path, "'f32'", "f32 (2, 3, 4)",
                        "destination is f32 (2, 3, 5)");
}

// The reference implementation's own test vectors (huggingface/safetensors, safetensors/src/
// tensor.rs: test_serialization, test_serialization_forced_alignement, test_empty): our writer
// produces the same bytes.
TEST(Safetensors, WriterMatchesTheReferenceBytes) {
  const float values[] = {0.f, 1.f, 2.f, 3.f, 4.f, 5.f};
  std::vector<uint8_t> data(sizeof(values));
  std::memcpy(data.data(), values, sizeof(values));
  {
    SafetensorsWriter w;
    w.add("attn.0", StDType::kF32, {1, 2, 3}, data);
    EXPECT_EQ(w.serialize(),
              make_file(R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})", data));
  }
  {
    SafetensorsWriter w;
    w.add("attn0", StDType::kF32, {1, 1, 2, 3}, data);
    EXPECT_EQ(w.serialize(),
              make_file(R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})"
                        "       ", data));
  }
  {
    SafetensorsWriter w;
    EXPECT_EQ(w.serialize(), make_file("{}      "));
    w.set_metadata("framework", "pt");
    EXPECT_EQ(w.serialize(), make_file(R"({"__metadata__":{"framework":"pt"}})" "     "));
  }
}

TEST(Safetensors, WriterRefusesBadInput) {
  SafetensorsWriter w;
  const std::vector<uint8_t> eight(8);
  w.add("a", StDType::kF32, {2}, eight);
  EXPECT_ERROR_CONTAINS(w.add("a", StDType::kF32, {2}, eight), "'a' added twice");
  EXPECT_ERROR_CONTAINS(w.add("b", StDType::kF32, {3}, eight), "'b'", "needs 12 bytes, 8 given");
  EXPECT_ERROR_CONTAINS(w.add("", StDType::kU8, {8}, eight), "invalid tensor name");
  EXPECT_ERROR_CONTAINS(w.add("__metadata__", StDType::kU8, {8}, eight), "invalid tensor name");
  EXPECT_ERROR_CONTAINS(w.add(std::string("bad\xff"), StDType::kU8, {8}, eight), "invalid tensor name");
  EXPECT_ERROR_CONTAINS(w.add("c", StDType::kU8, {-8}, eight), "negative dimension");
  EXPECT_ERROR_CONTAINS(w.add("d", StDType::kF4, {3}, std::span<const uint8_t>(eight).first(1)),
                        "not a whole number of bytes");
  Tensor t = Tensor::zeros(Shape{4, 4}, DType::kF32, Device::kCpu);
  TensorView strided = t.view();
  strided.shape = Shape{4, 2};
  strided.strides = Shape{4, 2};
  EXPECT_ERROR_CONTAINS(w.add("e", strided), "not contiguous");
  TempDir dir;
  EXPECT_ERROR_CONTAINS(w.write(dir.file("missing/x.safetensors")), "cannot create a temporary file",
                        "missing");
}

// A crash part-way through a write leaves the previous file as it was.
class SafetensorsAtomicWrite : public ::testing::Test {
 protected:
  void SetUp() override {
    path = dir.file("model.safetensors");
    previous_payload = random_bytes(64, 5);
    SafetensorsWriter w;
    w.add("weights", StDType::kF32, {16}, previous_payload);
    w.set_metadata("step", "100");
    w.write(path);
    previous = test::read_bytes(path);
    next_a = random_bytes(4096, 6);
    next_b = random_bytes(4096, 7);
    next.add("a", StDType::kF32, {1024}, next_a);
    next.add("b", StDType::kF32, {1024}, next_b);
    next.set_metadata("step", "200");
  }
  void expect_previous_intact() {
    EXPECT_EQ(test::read_bytes(path), previous);
    const SafetensorsFile f = SafetensorsFile::open(path);
    EXPECT_EQ(f.metadata().at("step"), "100");
    EXPECT_EQ(0, std::memcmp(f.get("weights").bytes.data(), previous_payload.data(), 64));
  }

  TempDir dir;
  std::string path;
  std::vector<uint8_t> previous, previous_payload, next_a, next_b;
  SafetensorsWriter next;
};

TEST_F(SafetensorsAtomicWrite, AnExceptionMidWriteKeepsThePreviousFileAndRemovesTheTemporary) {
  int writes = 0;
  AtomicWriteOptions crash;
  crash.after_write = [&](int64_t bytes_written) {
    if (++writes == 2) {  // the header and the first tensor are in the temporary file
      EXPECT_GT(bytes_written, 4096);
      throw Error("simulated crash");
    }
  };
  EXPECT_ERROR_CONTAINS(next.write(path, crash), "simulated crash");
  expect_previous_intact();
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"model.safetensors"});
  next.write(path);  // and a later write goes through
  EXPECT_EQ(SafetensorsFile::open(path).metadata().at("step"), "200");
}

TEST_F(SafetensorsAtomicWrite, AProcessKilledMidWriteLeavesOnlyAStaleTemporary) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    AtomicWriteOptions die;
    die.after_write = [](int64_t bytes_written) {
      if (bytes_written > 4096) ::_exit(42);  // killed with the temporary half written
    };
    try {
      next.write(path, die);
    } catch (...) {
    }
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  ASSERT_EQ(WEXITSTATUS(status), 42);
  expect_previous_intact();
  const std::vector<std::string> names = dir.entries();
  ASSERT_EQ(names.size(), 2u);
  EXPECT_EQ(names[0].rfind(".model.safetensors.tmp.", 0), 0u) << names[0];
  EXPECT_EQ(names[1], "model.safetensors");
  // The stale temporary is not a valid file (it was cut off), and nothing reads it by default.
  EXPECT_LT(test::read_bytes(dir.file(names[0])).size(), next.serialize().size());
}

TEST(Safetensors, LookupErrors) {
  SafetensorsWriter w;
  const std::vector<uint8_t> bytes(7 * 8);
  w.add("i8", StDType::kI8, {8}, std::span<const uint8_t>(bytes).first(8));
  w.add("rank7", StDType::kU8, {1, 1, 1, 1, 1, 1, 8}, std::span<const uint8_t>(bytes).first(8));
  const std::vector<uint8_t> file = w.serialize();
  const SafetensorsFile f = SafetensorsFile::from_bytes(file, "lookup.safetensors");
  EXPECT_FALSE(f.contains("nope"));
  EXPECT_ERROR_CONTAINS(f.get("nope"), "lookup.safetensors", "no tensor 'nope'");
  EXPECT_ERROR_CONTAINS(f.to_tensor("i8"), "lookup.safetensors", "'i8' is I8",
                        "fourbit tensors do not hold");
  EXPECT_ERROR_CONTAINS(f.to_tensor("rank7"), "'rank7' has 7 dimensions", "at most 6");
  TempDir dir;
  EXPECT_ERROR_CONTAINS(SafetensorsFile::open(dir.file("absent.safetensors")), "cannot open",
                        "absent.safetensors");
  EXPECT_ERROR_CONTAINS(SafetensorsFile::open(dir.path()), "is not a regular file");
}

// ------------------------------------------------------------------------------------------------
// Malformed files: each rejected with a message naming the file, the tensor and the problem.

struct Malformed {
  const char* what;
  std::vector<uint8_t> bytes;
  std::vector<std::string> message;  // substrings
};

std::vector<Malformed> malformed_cases() {
  const std::vector<uint8_t> d8(8), d12(12), d16(16);
  auto u64 = [](uint64_t n, const std::string& rest = "") {
    std::string s(8, '\0');
    std::memcpy(s.data(), &n, 8);
    s += rest;
    return std::vector<uint8_t>(s.begin(), s.end());
  };
  auto one = [](const std::string& entry, const std::vector<uint8_t>& data = std::vector<uint8_t>(8)) {
    return make_file(R"({"t":)" + entry + "}", data);
  };
  std::string dims65 = "1";
  for (int i = 1; i < 65; ++i) dims65 += ",1";
  return {
      {"empty file", {}, {"0 bytes long", "shorter than the 8-byte header length"}},
      {"7 bytes", {1, 2, 3, 4, 5, 6, 7}, {"7 bytes long"}},
      {"header length over 100 MB", u64(100'000'001, "{}"), {"header length 100000001 exceeds"}},
      {"header length 2^64-1", u64(~uint64_t{0}, "{}"), {"exceeds the 100000000 byte limit"}},
      {"header past the end", u64(64, "{}"), {"header length 64 runs past the end of the file (10 bytes"}},
      {"empty header", u64(0), {"the JSON header is empty"}},
      {"header not an object", make_file("[]"), {"does not start with '{'"}},
      {"leading space", make_file(" {}"), {"does not start with '{'"}},
      {"invalid UTF-8", make_file("{\"t\xc3\x28\":1}"), {"not valid UTF-8 (byte 3"}},
      {"overlong UTF-8", make_file("{\"\xc0\xaf\":1}"), {"not valid UTF-8"}},
      {"truncated JSON", make_file(R"({"t":{"dtype":)"), {"does not parse"}},
      {"trailing garbage", make_file("{} x"), {"does not parse"}},
      {"NUL padding", make_file(std::string("{}\0\0", 4)), {"holds a NUL byte (byte 2 of the header)"}},
      {"NUL then more JSON", make_file(std::string("{}\0{\"t\":1}", 10)), {"holds a NUL byte"}},
      {"duplicate tensor",
       make_file(R"({"t":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"t":{"dtype":"U8","shape":[8],"data_offsets":[8,16]}})", d16),
       {"tensor 't' appears twice"}},
      {"duplicate field", one(R"({"dtype":"U8","dtype":"I8","shape":[8],"data_offsets":[0,8]})"),
       {"tensor 't': key 'dtype' appears twice"}},
      {"duplicate metadata", make_file(R"({"__metadata__":{},"__metadata__":{}})"), {"'__metadata__' appears twice"}},
      {"nested shape", one(R"({"dtype":"U8","shape":[[8]],"data_offsets":[0,8]})"), {"tensor 't' nests deeper"}},
      {"65 dimensions", one(R"({"dtype":"U8","shape":[)" + dims65 + R"(],"data_offsets":[0,1]})", std::vector<uint8_t>(1)),
       {"tensor 't' holds an array of more than 64 values"}},
      {"entry not an object", one("1"), {"tensor 't': its entry is a JSON number, not an object"}},
      {"no dtype", one(R"({"shape":[8],"data_offsets":[0,8]})"), {"tensor 't': no 'dtype'"}},
      {"no shape", one(R"({"dtype":"U8","data_offsets":[0,8]})"), {"tensor 't': no 'shape'"}},
      {"no offsets", one(R"({"dtype":"U8","shape":[8]})"), {"tensor 't': no 'data_offsets'"}},
      {"dtype not a string", one(R"({"dtype":8,"shape":[8],"data_offsets":[0,8]})"), {"'dtype' is a JSON number"}},
      {"unknown dtype", one(R"({"dtype":"F128","shape":[8],"data_offsets":[0,8]})"),
       {"tensor 't': unknown dtype 'F128'", "known: BOOL, U8"}},
      {"shape not an array", one(R"({"dtype":"U8","shape":8,"data_offsets":[0,8]})"), {"'shape' is a JSON number, not an array"}},
      {"negative dimension", one(R"({"dtype":"U8","shape":[-8],"data_offsets":[0,8]})"), {"'shape' [-8] holds -8"}},
      {"fractional dimension", one(R"({"dtype":"U8","shape":[8.0],"data_offsets":[0,8]})"), {"holds 8.0"}},
      {"string dimension", one(R"({"dtype":"U8","shape":["8"],"data_offsets":[0,8]})"), {"holds \"8\""}},
      {"dimension over int64", one(R"({"dtype":"U8","shape":[9223372036854775808,0],"data_offsets":[0,0]})"),
       {"not a non-negative 64-bit integer"}},
      {"element count overflow", one(R"({"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,8]})"),
       {"tensor 't': shape [4294967296, 4294967296] has more elements than 2^64"}},
      {"byte size overflow", one(R"({"dtype":"F32","shape":[4611686018427387904],"data_offsets":[0,8]})"),
       {"overflows 64 bits of size"}},
      {"odd F4 count", one(R"({"dtype":"F4","shape":[3],"data_offsets":[0,1]})", std::vector<uint8_t>(1)),
       {"packed 4-bit type F4 is not a whole number of bytes"}},
      {"offsets not a pair", one(R"({"dtype":"U8","shape":[8],"data_offsets":[0,8,8]})"), {"'data_offsets' is [0,8,8], not [begin, end]"}},
      {"negative offset", one(R"({"dtype":"U8","shape":[8],"data_offsets":[-1,7]})"), {"'data_offsets' is [-1,7]"}},
      {"offsets reversed", one(R"({"dtype":"U8","shape":[0],"data_offsets":[8,0]})"), {"data_offsets [8, 0] end before they begin"}},
      {"size mismatch", one(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})"),
       {"tensor 't': data_offsets [0, 8] hold 8 bytes, but shape [3] of F32 needs 12"}},
      {"past the data", one(R"({"dtype":"U8","shape":[8],"data_offsets":[4,12]})"),
       {"data_offsets [4, 12] run past the end of the data section (8 bytes"}},
      {"huge offsets", one(R"({"dtype":"U8","shape":[8],"data_offsets":[18446744073709551608,18446744073709551615]})"),
       {"hold 7 bytes, but shape [8] of U8 needs 8"}},
      {"overlap",
       make_file(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})", d12),
       {"tensor 'b' (bytes [4, 12]) overlaps tensor 'a' (bytes [0, 8])"}},
      {"same range twice",
       make_file(R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"I8","shape":[8],"data_offsets":[0,8]}})", d8),
       {"overlaps"}},
      {"hole",
       make_file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[8,12]}})", d12),
       {"bytes [4, 8] of the data section belong to no tensor (a hole before tensor 'b')"}},
      {"hole at the start", one(R"({"dtype":"U8","shape":[4],"data_offsets":[4,8]})"), {"bytes [0, 4] of the data section belong to no tensor"}},
      {"trailing data", one(R"({"dtype":"U8","shape":[4],"data_offsets":[0,4]})"),
       {"the data section has 4 bytes after the last tensor's end (offset 4)"}},
      {"data without tensors", make_file("{}", d8), {"8 bytes after the last tensor's end (offset 0)"}},
      {"metadata not an object", make_file(R"({"__metadata__":[]})"), {"'__metadata__' is a JSON array"}},
      {"metadata value not a string", make_file(R"({"__metadata__":{"step":100}})"),
       {"'__metadata__' value 'step' is a JSON number", "holds only strings"}},
      {"control characters in a name", make_file("{\"a\\nb\":1}"), {"tensor 'a\\x0ab'"}},
  };
}

TEST(Safetensors, RejectsEveryMalformedHeaderWithAClearMessage) {
  for (const Malformed& c : malformed_cases()) {
    SCOPED_TRACE(c.what);
    const std::string msg = reject_message(c.bytes);
    EXPECT_EQ(msg.rfind("bad.safetensors: not a valid safetensors file: ", 0), 0u) << msg;
    for (const std::string& part : c.message) {
      EXPECT_NE(msg.find(part), std::string::npos) << "message: " << msg << "\nmissing: " << part;
    }
  }
}

TEST(Safetensors, RejectsAMalformedFileOnDiskNamingIt) {
  TempDir dir;
  const std::string path = dir.file("truncated.safetensors");
  SafetensorsWriter w;
  const std::vector<uint8_t> data(64);
  w.add("w", StDType::kF32, {16}, data);
  std::vector<uint8_t> bytes = w.serialize();
  bytes.resize(bytes.size() - 1);
  test::write_bytes(path, bytes);
  EXPECT_ERROR_CONTAINS(SafetensorsFile::open(path), path + ": not a valid safetensors file: ",
                        "tensor 'w'", "run past the end of the data section (63 bytes");
}

TEST(Safetensors, AcceptsWhatTheSpecAllows) {
  // Any key order, tensors in any header order, zero-size tensors anywhere, unknown entry fields,
  // trailing whitespace in the header, an empty file with no tensors.
  const std::vector<uint8_t> data = {1, 2, 3, 4, 5, 6};
  const SafetensorsFile f = SafetensorsFile::from_bytes(
      make_file(R"({"z":{"data_offsets":[0,2],"shape":[2],"dtype":"U8"},"e":{"dtype":"F32","shape":[0],"data_offsets":[2,2]},)"
                R"("a":{"dtype":"I16","shape":[2],"data_offsets":[2,6],"extra":"ignored"}}    )",
                data),
      "ok.safetensors");
  ASSERT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.tensors()[0].name, "z");  // offset order
  EXPECT_EQ(f.get("a").bytes[0], 3);
  EXPECT_EQ(f.get("e").bytes.size(), 0u);
  EXPECT_TRUE(SafetensorsFile::from_bytes(make_file("{}"), "e").tensors().empty());
}

}  // namespace
}  // namespace fourbit::io
