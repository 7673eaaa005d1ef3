// safetensors writer and validating reader (see safetensors.h for the format and the checks).
#include "io/safetensors.h"

#include "core/check.h"
#include "io/mapped_file.h"
#include "io/utf8.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <bit>
#include <cstring>
#include <limits>
#include <set>
#include <unordered_set>

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; fourbit's reader and writer assume a "
              "little-endian host");

namespace fourbit::io {

using detail::printable;

namespace {

struct StDTypeInfo {
  StDType dtype;
  std::string_view name;
  int bits;
};

constexpr StDTypeInfo kStDTypes[] = {
    {StDType::kBool, "BOOL", 8},       {StDType::kU8, "U8", 8},
    {StDType::kI8, "I8", 8},           {StDType::kF8E5M2, "F8_E5M2", 8},
    {StDType::kF8E4M3, "F8_E4M3", 8},  {StDType::kF8E8M0, "F8_E8M0", 8},
    {StDType::kF4, "F4", 4},           {StDType::kF6E2M3, "F6_E2M3", 6},
    {StDType::kF6E3M2, "F6_E3M2", 6},  {StDType::kI16, "I16", 16},
    {StDType::kU16, "U16", 16},        {StDType::kF16, "F16", 16},
    {StDType::kBF16, "BF16", 16},      {StDType::kI32, "I32", 32},
    {StDType::kU32, "U32", 32},        {StDType::kF32, "F32", 32},
    {StDType::kF64, "F64", 64},        {StDType::kI64, "I64", 64},
    {StDType::kU64, "U64", 64},        {StDType::kC64, "C64", 64},
};

const StDTypeInfo& info(StDType t) {
  for (const StDTypeInfo& i : kStDTypes)
    if (i.dtype == t) return i;
  throw Error(fmt::format("unknown safetensors dtype code {}", (int)t));
}

std::string known_dtype_names() {
  std::string s;
  for (const StDTypeInfo& i : kStDTypes) s += fmt::format("{}{}", s.empty() ? "" : ", ", i.name);
  return s;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += fmt::format("{}{}", i ? ", " : "", shape[i]);
  return s + "]";
}

// Bytes of a tensor of `shape` and `dtype`, or an error message. Multiplies in the order of the
// dimensions with overflow checks (as the reference implementation does).
std::optional<uint64_t> tensor_bytes(StDType dtype, const std::vector<int64_t>& shape,
                                     std::string* why) {
  uint64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      *why = fmt::format("shape {} has a negative dimension", shape_text(shape));
      return std::nullopt;
    }
    if (__builtin_mul_overflow(numel, (uint64_t)d, &numel)) {
      *why = fmt::format("shape {} has more elements than 2^64", shape_text(shape));
      return std::nullopt;
    }
  }
  uint64_t bits = 0;
  if (__builtin_mul_overflow(numel, (uint64_t)st_dtype_bits(dtype), &bits)) {
    *why = fmt::format("shape {} of {} overflows 64 bits of size", shape_text(shape),
                       st_dtype_name(dtype));
    return std::nullopt;
  }
  if (bits % 8 != 0) {
    *why = fmt::format("shape {} of the packed {}-bit type {} is not a whole number of bytes",
                       shape_text(shape), st_dtype_bits(dtype), st_dtype_name(dtype));
    return std::nullopt;
  }
  return bits / 8;
}

}  // namespace

std::string_view st_dtype_name(StDType t) { return info(t).name; }
int st_dtype_bits(StDType t) { return info(t).bits; }

std::optional<StDType> st_dtype_from_name(std::string_view name) {
  for (const StDTypeInfo& i : kStDTypes)
    if (i.name == name) return i.dtype;
  return std::nullopt;
}

std::optional<DType> to_fourbit_dtype(StDType t) {
  switch (t) {
    case StDType::kF64: return DType::kF64;
    case StDType::kF32: return DType::kF32;
    case StDType::kBF16: return DType::kBF16;
    case StDType::kF16: return DType::kF16;
    case StDType::kF8E4M3: return DType::kE4M3;
    case StDType::kF8E5M2: return DType::kE5M2;
    case StDType::kF8E8M0: return DType::kE8M0;
    case StDType::kF4: return DType::kE2M1x2;
    case StDType::kU8: return DType::kU8;
    case StDType::kU16: return DType::kU16;
    case StDType::kI32: return DType::kI32;
    case StDType::kU32: return DType::kU32;
    case StDType::kI64: return DType::kI64;
    default: return std::nullopt;
  }
}

StDType from_fourbit_dtype(DType t) {
  switch (t) {
    case DType::kF64: return StDType::kF64;
    case DType::kF32: return StDType::kF32;
    case DType::kBF16: return StDType::kBF16;
    case DType::kF16: return StDType::kF16;
    case DType::kE4M3: return StDType::kF8E4M3;
    case DType::kE5M2: return StDType::kF8E5M2;
    case DType::kE8M0: return StDType::kF8E8M0;
    case DType::kE2M1x2: return StDType::kF4;
    case DType::kU8: return StDType::kU8;
    case DType::kU16: return StDType::kU16;
    case DType::kI32: return StDType::kI32;
    case DType::kU32: return StDType::kU32;
    case DType::kI64: return StDType::kI64;
  }
  throw Error(fmt::format("dtype {} has no safetensors type", (int)t));
}

// ------------------------------------------------------------------------------------------------
// Writer

void SafetensorsWriter::add(std::string name, StDType dtype, std::vector<int64_t> shape,
                            std::span<const uint8_t> bytes) {
  if (name.empty() || name == "__metadata__" || !detail::is_valid_utf8(name)) {
    throw Error(fmt::format("safetensors writer: invalid tensor name {} (names must be non-empty "
                            "UTF-8 and not '__metadata__')", printable(name)));
  }
  for (const Entry& e : entries_) {
    if (e.name == name) {
      throw Error(fmt::format("safetensors writer: tensor {} added twice", printable(name)));
    }
  }
  std::string why;
  const std::optional<uint64_t> expected = tensor_bytes(dtype, shape, &why);
  if (!expected) throw Error(fmt::format("safetensors writer: tensor {}: {}", printable(name), why));
  if (*expected != bytes.size()) {
    throw Error(fmt::format("safetensors writer: tensor {}: shape {} of {} needs {} bytes, {} given",
                            printable(name), shape_text(shape), st_dtype_name(dtype), *expected,
                            bytes.size()));
  }
  entries_.push_back({std::move(name), dtype, std::move(shape), bytes});
}

void SafetensorsWriter::add(std::string name, const TensorView& tensor) {
  if (tensor.device != Device::kCpu || !tensor.is_contiguous()) {
    throw Error(fmt::format("safetensors writer: tensor {} is {}{}; copy it to a contiguous host "
                            "tensor first (Tensor::to(Device::kCpu))", printable(name),
                            tensor.describe(), tensor.is_contiguous() ? "" : ", not contiguous"));
  }
  std::vector<int64_t> shape(tensor.shape.dims.begin(), tensor.shape.dims.begin() + tensor.shape.ndim);
  const auto* p = static_cast<const uint8_t*>(tensor.data);
  add(std::move(name), from_fourbit_dtype(tensor.dtype), std::move(shape),
      std::span<const uint8_t>(p, (size_t)tensor.nbytes()));
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
  if (!detail::is_valid_utf8(key) || !detail::is_valid_utf8(value)) {
    throw Error(fmt::format("safetensors writer: metadata {} is not valid UTF-8", printable(key)));
  }
  metadata_[std::move(key)] = std::move(value);
}

std::vector<const SafetensorsWriter::Entry*> SafetensorsWriter::ordered() const {
  std::vector<const Entry*> order;
  for (const Entry& e : entries_) order.push_back(&e);
  // Largest elements first: every tensor then starts at a multiple of its element size.
  std::sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    const int ba = st_dtype_bits(a->dtype), bb = st_dtype_bits(b->dtype);
    return ba != bb ? ba > bb : a->name < b->name;
  });
  return order;
}

std::string SafetensorsWriter::header_bytes() const {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  uint64_t offset = 0;
  for (const Entry* e : ordered()) {
    header[e->name] = {{"dtype", st_dtype_name(e->dtype)},
                       {"shape", e->shape},
                       {"data_offsets", {offset, offset + e->bytes.size()}}};
    offset += e->bytes.size();
  }
  std::string json = header.dump();
  json.resize((json.size() + 7) / 8 * 8, ' ');  // the data section starts 8-byte aligned
  std::string out(8, '\0');
  const uint64_t n = json.size();
  std::memcpy(out.data(), &n, 8);
  return out + json;
}

std::vector<uint8_t> SafetensorsWriter::serialize() const {
  const std::string header = header_bytes();
  std::vector<uint8_t> out(header.begin(), header.end());
  for (const Entry* e : ordered()) out.insert(out.end(), e->bytes.begin(), e->bytes.end());
  return out;
}

void SafetensorsWriter::write(const std::string& path, const AtomicWriteOptions& options) const {
  AtomicFile file(path, options);
  file.write(header_bytes());
  for (const Entry* e : ordered()) {
    if (!e->bytes.empty()) file.write(e->bytes.data(), (int64_t)e->bytes.size());
  }
  file.commit();
}

// ------------------------------------------------------------------------------------------------
// Reader

int64_t StTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // validated: fits in 64 bits
  return n;
}

std::string StTensor::shape_str() const { return shape_text(shape); }

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  MappedFile mapped = MappedFile::open(path);
  SafetensorsFile f;
  f.path_ = path;
  f.keep_alive_ = mapped.keep_alive();
  f.bytes_ = mapped.bytes();
  f.parse();
  return f;
}

SafetensorsFile SafetensorsFile::from_bytes(std::span<const uint8_t> bytes, std::string name) {
  SafetensorsFile f;
  f.path_ = std::move(name);
  f.bytes_ = bytes;
  f.parse();
  return f;
}

namespace {

using json = nlohmann::json;

// Structure limits enforced while parsing, before the DOM grows: a safetensors header is an
// object (depth 0) of objects (depth 1) holding two arrays of integers or strings (depth 2).
constexpr int kMaxRank = 64;

class HeaderParseGuard {
 public:
  explicit HeaderParseGuard(const std::string& file) : file_(file) {}

  bool operator()(int depth, json::parse_event_t event, json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth >= 3) fail(fmt::format("{} nests deeper than a safetensors header can", where()));
        if (depth == 1) entry_keys_.clear();
        if (depth == 2) values_ = 0;
        break;
      case json::parse_event_t::key: {
        const std::string& key = parsed.get_ref<const std::string&>();
        if (depth == 1) {
          if (!top_keys_.insert(key).second) {
            fail(fmt::format("{} appears twice in the header",
                             key == "__metadata__" ? "'__metadata__'" : "tensor " + printable(key)));
          }
          entry_ = key;
        } else if (depth == 2 && !entry_keys_.insert(key).second) {
          fail(fmt::format("{}: key {} appears twice", where(), printable(key)));
        }
        break;
      }
      case json::parse_event_t::value:
        if (depth == 3 && ++values_ > kMaxRank) {
          fail(fmt::format("{} holds an array of more than {} values", where(), kMaxRank));
        }
        break;
      default:
        break;
    }
    return true;
  }

 private:
  std::string where() const {
    if (entry_.empty()) return "the header";
    return entry_ == "__metadata__" ? "'__metadata__'" : "tensor " + printable(entry_);
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw Error(fmt::format("{}: not a valid safetensors file: {}", file_, what));
  }

  const std::string& file_;
  std::unordered_set<std::string> top_keys_;
  std::unordered_set<std::string> entry_keys_;
  std::string entry_;
  int values_ = 0;
};

struct ParsedEntry {
  std::string name;
  StDType dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;
};

[[noreturn]] void reject(const std::string& file, const std::string& what) {
  throw Error(fmt::format("{}: not a valid safetensors file: {}", file, what));
}
[[noreturn]] void reject_tensor(const std::string& file, const std::string& name,
                                const std::string& what) {
  throw Error(fmt::format("{}: not a valid safetensors file: tensor {}: {}", file, printable(name), what));
}

}  // namespace

void SafetensorsFile::parse() {
  const std::string& file = path_;
  const uint64_t file_bytes = bytes_.size();
  if (file_bytes < 8) {
    reject(file, fmt::format("it is {} bytes long, shorter than the 8-byte header length (truncated?)",
                     file_bytes));
  }
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes_.data(), 8);
  if (header_len > (uint64_t)kSafetensorsMaxHeaderBytes) {
    reject(file, fmt::format("header length {} exceeds the {} byte limit (corrupt, or not a safetensors "
                     "file)", header_len, kSafetensorsMaxHeaderBytes));
  }
  if (header_len > file_bytes - 8) {
    reject(file, fmt::format("header length {} runs past the end of the file ({} bytes; truncated?)",
                     header_len, file_bytes));
  }
  const std::string_view header(reinterpret_cast<const char*>(bytes_.data()) + 8, header_len);
  if (header.empty() || header[0] != '{') {
    reject(file, header.empty() ? std::string("the JSON header is empty")
                        : "the JSON header does not start with '{'");
  }
  // JSON has no raw NUL (nlohmann's parser would stop there, ignoring what follows).
  if (const size_t nul = header.find('\0'); nul != std::string_view::npos) {
    reject(file, fmt::format("the JSON header holds a NUL byte (byte {} of the header)", nul));
  }
  if (const size_t bad = detail::find_invalid_utf8(header); bad != std::string_view::npos) {
    reject(file, fmt::format("the JSON header is not valid UTF-8 (byte {} of the header)", bad));
  }
  json root;
  try {
    root = json::parse(header.begin(), header.end(), HeaderParseGuard(file));
  } catch (const json::exception& e) {
    reject(file, fmt::format("the JSON header does not parse: {}", e.what()));
  }
  if (!root.is_object()) reject(file, "the JSON header is not an object");

  const uint64_t data_bytes = file_bytes - 8 - header_len;
  std::vector<ParsedEntry> entries;
  entries.reserve(root.size());
  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) {
        reject(file, fmt::format("'__metadata__' is a JSON {}, not an object of strings", value.type_name()));
      }
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string()) {
          reject(file, fmt::format("'__metadata__' value {} is a JSON {}; safetensors metadata holds only "
                           "strings", printable(mk), mv.type_name()));
        }
        metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    if (!value.is_object()) reject_tensor(file, key, fmt::format("its entry is a JSON {}, not an object", value.type_name()));
    ParsedEntry e;
    e.name = key;

    const auto dtype_it = value.find("dtype");
    if (dtype_it == value.end()) reject_tensor(file, key, "no 'dtype'");
    if (!dtype_it->is_string()) reject_tensor(file, key, fmt::format("'dtype' is a JSON {}, not a string", dtype_it->type_name()));
    const std::string& dtype_name = dtype_it->get_ref<const std::string&>();
    const std::optional<StDType> dtype = st_dtype_from_name(dtype_name);
    if (!dtype) reject_tensor(file, key, fmt::format("unknown dtype {} (known: {})", printable(dtype_name), known_dtype_names()));
    e.dtype = *dtype;

    const auto shape_it = value.find("shape");
    if (shape_it == value.end()) reject_tensor(file, key, "no 'shape'");
    if (!shape_it->is_array()) reject_tensor(file, key, fmt::format("'shape' is a JSON {}, not an array", shape_it->type_name()));
    for (const json& d : *shape_it) {
      if (!d.is_number_unsigned() ||
          d.get<uint64_t>() > (uint64_t)std::numeric_limits<int64_t>::max()) {
        reject_tensor(file, key, fmt::format("'shape' {} holds {}, not a non-negative 64-bit integer", shape_it->dump(),
                        d.dump()));
      }
      e.shape.push_back((int64_t)d.get<uint64_t>());
    }

    const auto offsets_it = value.find("data_offsets");
    if (offsets_it == value.end()) reject_tensor(file, key, "no 'data_offsets'");
    if (!offsets_it->is_array() || offsets_it->size() != 2 || !(*offsets_it)[0].is_number_unsigned() ||
        !(*offsets_it)[1].is_number_unsigned()) {
      reject_tensor(file, key, fmt::format("'data_offsets' is {}, not [begin, end] with non-negative integers",
                      offsets_it->dump()));
    }
    e.begin = (*offsets_it)[0].get<uint64_t>();
    e.end = (*offsets_it)[1].get<uint64_t>();
    if (e.begin > e.end) reject_tensor(file, key, fmt::format("data_offsets [{}, {}] end before they begin", e.begin, e.end));

    std::string why;
    const std::optional<uint64_t> need = tensor_bytes(e.dtype, e.shape, &why);
    if (!need) reject_tensor(file, key, why);
    if (e.end - e.begin != *need) {
      reject_tensor(file, key, fmt::format("data_offsets [{}, {}] hold {} bytes, but shape {} of {} needs {}", e.begin,
                      e.end, e.end - e.begin, shape_text(e.shape), dtype_name, *need));
    }
    if (e.end > data_bytes) {
      reject_tensor(file, key, fmt::format("data_offsets [{}, {}] run past the end of the data section ({} bytes; "
                      "truncated file?)", e.begin, e.end, data_bytes));
    }
    entries.push_back(std::move(e));
  }

  // The tensors must tile the data section: sorted by offset, each begins where the previous ends.
  std::sort(entries.begin(), entries.end(), [](const ParsedEntry& a, const ParsedEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  const ParsedEntry* previous = nullptr;
  for (const ParsedEntry& e : entries) {
    if (e.begin < covered) {
      reject(file, fmt::format("tensor {} (bytes [{}, {}]) overlaps tensor {} (bytes [{}, {}])",
                       printable(e.name), e.begin, e.end, printable(previous->name), previous->begin,
                       previous->end));
    }
    if (e.begin > covered) {
      reject(file, fmt::format("bytes [{}, {}] of the data section belong to no tensor (a hole before "
                       "tensor {})", covered, e.begin, printable(e.name)));
    }
    covered = e.end;
    previous = &e;
  }
  if (covered != data_bytes) {
    reject(file, fmt::format("the data section has {} bytes after the last tensor's end (offset {}): "
                     "tensors must cover it exactly", data_bytes - covered, covered));
  }

  const uint8_t* data = bytes_.data() + 8 + header_len;
  tensors_.reserve(entries.size());
  for (ParsedEntry& e : entries) {
    index_.emplace(e.name, tensors_.size());
    tensors_.push_back({std::move(e.name), e.dtype, std::move(e.shape),
                        std::span<const uint8_t>(data + e.begin, e.end - e.begin)});
  }
}

const StTensor* SafetensorsFile::find(std::string_view name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const StTensor& SafetensorsFile::get(std::string_view name) const {
  if (const StTensor* t = find(name)) return *t;
  throw Error(fmt::format("{}: no tensor {} (the file holds {} tensors{})", path_, printable(name),
                          tensors_.size(),
                          tensors_.empty() ? "" : ", e.g. " + printable(tensors_.front().name)));
}

namespace {

Shape to_shape(const std::string& file, const StTensor& t) {
  if (t.shape.size() > (size_t)kMaxDims) {
    throw Error(fmt::format("{}: tensor {} has {} dimensions; fourbit tensors hold at most {}", file,
                            printable(t.name), t.shape.size(), kMaxDims));
  }
  Shape s;
  for (int64_t d : t.shape) s.dims[s.ndim++] = d;
  return s;
}

DType fourbit_dtype_of(const std::string& file, const StTensor& t) {
  const std::optional<DType> dt = to_fourbit_dtype(t.dtype);
  if (!dt) {
    throw Error(fmt::format("{}: tensor {} is {}, which fourbit tensors do not hold (read its "
                            "bytes through tensors()/get() instead)", file, printable(t.name),
                            st_dtype_name(t.dtype)));
  }
  return *dt;
}

}  // namespace

Tensor SafetensorsFile::to_tensor(std::string_view name) const {
  const StTensor& t = get(name);
  Tensor out = Tensor::empty(to_shape(path_, t), fourbit_dtype_of(path_, t), Device::kCpu);
  FOURBIT_CHECK(out.nbytes() == (int64_t)t.bytes.size(), "{}: tensor {}: {} bytes vs {}", path_,
                printable(t.name), out.nbytes(), t.bytes.size());
  if (!t.bytes.empty()) std::memcpy(out.data(), t.bytes.data(), t.bytes.size());
  return out;
}

void SafetensorsFile::copy_into(std::string_view name, const TensorView& dst) const {
  const StTensor& t = get(name);
  const DType dtype = fourbit_dtype_of(path_, t);
  const Shape shape = to_shape(path_, t);
  if (dst.dtype != dtype || !(dst.shape == shape)) {
    throw Error(fmt::format("{}: tensor {} is {} {}, but the destination is {}", path_,
                            printable(t.name), dtype_name(dtype), shape.str(), dst.describe()));
  }
  if (!dst.is_contiguous()) {
    throw Error(fmt::format("{}: tensor {}: the destination ({}) is not contiguous", path_,
                            printable(t.name), dst.describe()));
  }
  const TensorView src = TensorView::contiguous(const_cast<uint8_t*>(t.bytes.data()), dtype, shape,
                                                Device::kCpu);
  if (!t.bytes.empty()) copy_tensor(dst, src);
}

}  // namespace fourbit::io
