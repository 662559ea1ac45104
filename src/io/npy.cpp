#include "io/npy.h"

#include <bit>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "core/error.h"
#include "core/file_util.h"

namespace meshtune {

static_assert(std::endian::native == std::endian::little, "npy io assumes a little-endian host");

namespace {

const char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;

// A tiny parser for the Python dict literal in an .npy header, e.g.
// {'descr': '<f4', 'fortran_order': False, 'shape': (3, 12), }
// Only the value kinds numpy writes are understood: strings, True/False, and tuples of ints.
struct HeaderParser {
  const std::string& path;
  const std::string& text;
  size_t pos = 0;

  [[noreturn]] void error(const std::string& what) const {
    fail("file ", path, ": malformed .npy header (", what, " at offset ", pos, "): ", text);
  }
  void skip_space() {
    while (pos < text.size() && (text[pos] == ' ' || text[pos] == '\t' || text[pos] == '\n' || text[pos] == '\r')) ++pos;
  }
  bool accept(char c) {
    skip_space();
    if (pos < text.size() && text[pos] == c) { ++pos; return true; }
    return false;
  }
  void expect(char c) {
    if (!accept(c)) error(std::string("expected '") + c + "'");
  }
  std::string parse_string() {
    skip_space();
    if (pos >= text.size() || (text[pos] != '\'' && text[pos] != '"')) error("expected a string");
    char quote = text[pos++];
    size_t end = text.find(quote, pos);
    if (end == std::string::npos) error("unterminated string");
    std::string s = text.substr(pos, end - pos);
    pos = end + 1;
    return s;
  }
  bool parse_bool() {
    skip_space();
    if (text.compare(pos, 4, "True") == 0) { pos += 4; return true; }
    if (text.compare(pos, 5, "False") == 0) { pos += 5; return false; }
    error("expected True or False");
  }
  int64_t parse_int() {
    skip_space();
    size_t start = pos;
    int64_t v = 0;
    while (pos < text.size() && text[pos] >= '0' && text[pos] <= '9') {
      if (v > (std::numeric_limits<int64_t>::max() - 9) / 10) error("dimension too large");
      v = v * 10 + (text[pos] - '0');
      ++pos;
    }
    if (pos == start) error("expected a non-negative integer");
    // Python 2 era files may write long literals such as 3L.
    if (pos < text.size() && text[pos] == 'L') ++pos;
    return v;
  }
  Shape parse_shape() {
    Shape shape;
    expect('(');
    if (accept(')')) return shape;  // () is a 0-d array
    while (true) {
      shape.push_back(parse_int());
      if (accept(')')) break;
      expect(',');
      if (accept(')')) break;  // (3,) or a trailing comma
    }
    return shape;
  }
};

struct Header {
  std::string descr;
  bool fortran_order = false;
  Shape shape;
};

Header parse_header(const std::string& path, const std::string& text) {
  HeaderParser p{path, text};
  Header h;
  bool have_descr = false, have_order = false, have_shape = false;
  p.expect('{');
  while (!p.accept('}')) {
    std::string key = p.parse_string();
    p.expect(':');
    if (key == "descr") {
      p.skip_space();
      // Structured dtypes are lists; they are not supported.
      if (p.pos < text.size() && text[p.pos] == '[') fail("file ", path, ": unsupported .npy dtype (structured array)");
      h.descr = p.parse_string();
      have_descr = true;
    } else if (key == "fortran_order") {
      h.fortran_order = p.parse_bool();
      have_order = true;
    } else if (key == "shape") {
      h.shape = p.parse_shape();
      have_shape = true;
    } else {
      p.error("unexpected key '" + key + "'");
    }
    if (!p.accept(',')) {
      p.expect('}');
      break;
    }
  }
  if (!have_descr || !have_order || !have_shape) p.error("missing 'descr', 'fortran_order' or 'shape'");
  return h;
}

bool descr_to_dtype(const std::string& descr, DType* dt) {
  if (descr == "<f4") { *dt = DType::F32; return true; }
  if (descr == "<f2") { *dt = DType::F16; return true; }
  if (descr == "<i4") { *dt = DType::I32; return true; }
  if (descr == "<i8") { *dt = DType::I64; return true; }
  // One-byte types have no byte order; numpy writes '|' but accept '<' too.
  if (descr == "|b1" || descr == "<b1") { *dt = DType::BOOL; return true; }
  if (descr == "|u1" || descr == "<u1") { *dt = DType::U8; return true; }
  if (descr == "|i1" || descr == "<i1") { *dt = DType::I8; return true; }
  return false;
}

const char* dtype_to_descr(DType dt) {
  switch (dt) {
    case DType::F32: return "<f4";
    case DType::F16: return "<f2";
    case DType::I32: return "<i4";
    case DType::I64: return "<i8";
    case DType::BOOL: return "|b1";
    case DType::U8: return "|u1";
    case DType::I8: return "|i1";
    case DType::BF16: return nullptr;  // numpy has no bfloat16
  }
  return nullptr;
}

}  // namespace

HostTensor read_npy(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) fail_not_found("file ", path, ": not found or not a regular file");
  const uint64_t file_size = std::filesystem::file_size(path, ec);
  if (ec) fail("file ", path, ": cannot get size: ", ec.message());
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("file ", path, ": cannot open for reading");

  // Preamble: magic, major, minor, then the header length (u16 in 1.0, u32 in 2.0/3.0).
  unsigned char pre[kMagicLen + 2];
  if (file_size < sizeof(pre) || !in.read(reinterpret_cast<char*>(pre), sizeof(pre)) ||
      std::memcmp(pre, kMagic, kMagicLen) != 0) {
    fail("file ", path, ": not a .npy file (bad magic)");
  }
  const int major = pre[kMagicLen], minor = pre[kMagicLen + 1];
  size_t len_bytes = 0;
  if (major == 1) len_bytes = 2;
  else if (major == 2 || major == 3) len_bytes = 4;
  else fail("file ", path, ": unsupported .npy version ", major, ".", minor);

  unsigned char len_buf[4] = {0, 0, 0, 0};
  if (file_size < sizeof(pre) + len_bytes || !in.read(reinterpret_cast<char*>(len_buf), std::streamsize(len_bytes))) {
    fail("file ", path, ": truncated .npy header");
  }
  const uint64_t header_len = uint64_t(len_buf[0]) | uint64_t(len_buf[1]) << 8 | uint64_t(len_buf[2]) << 16 |
                              uint64_t(len_buf[3]) << 24;
  const uint64_t data_offset = sizeof(pre) + len_bytes + header_len;
  if (data_offset > file_size) fail("file ", path, ": truncated .npy header (", header_len, " bytes declared)");
  std::string header_text(header_len, '\0');
  if (!in.read(header_text.data(), std::streamsize(header_len))) fail("file ", path, ": cannot read .npy header");

  Header h = parse_header(path, header_text);
  DType dtype;
  if (!descr_to_dtype(h.descr, &dtype)) {
    fail("file ", path, ": unsupported .npy dtype '", h.descr,
         "' (supported: <f4 <f2 <i4 <i8 |b1 |u1, little-endian)");
  }
  if (h.fortran_order) fail("file ", path, ": Fortran-order .npy arrays are not supported");

  // Compare the declared size against the bytes the file really holds before allocating, with
  // overflow-safe arithmetic (a hostile header could declare an enormous shape).
  const uint64_t available = file_size - data_offset;
  uint64_t count = 1;
  bool too_big = false;
  for (int64_t d : h.shape) {
    if (d == 0) { count = 0; too_big = false; break; }
    if (too_big) continue;
    if (uint64_t(d) > available / (count * dtype_size(dtype))) too_big = true;
    else count *= uint64_t(d);
  }
  const uint64_t nbytes = count * dtype_size(dtype);
  if (too_big || nbytes > available) {
    fail("file ", path, ": data shorter than the header says: shape ", shape_str(h.shape), " of ", h.descr,
         " needs ", too_big ? std::string("more") : std::to_string(nbytes), " bytes, file has ", available);
  }

  HostTensor t = HostTensor::allocate(dtype, h.shape);
  if (nbytes > 0 && !in.read(reinterpret_cast<char*>(t.mutable_as<std::byte>()), std::streamsize(nbytes))) {
    fail("file ", path, ": cannot read ", nbytes, " bytes of .npy data");
  }
  return t;
}

void write_npy(const std::string& path, const HostTensor& tensor) {
  const char* descr = dtype_to_descr(tensor.dtype);
  if (!descr) fail("file ", path, ": cannot write dtype ", dtype_name(tensor.dtype), " to .npy");
  for (int64_t d : tensor.shape) {
    if (d < 0) fail("file ", path, ": cannot write negative dimension in shape ", shape_str(tensor.shape));
  }
  const size_t nbytes = tensor.nbytes();
  if (nbytes > 0 && !tensor.data) fail("file ", path, ": tensor has no data");

  // shape_str gives "(3,)" for 1-d and "()" for 0-d, as Python's tuple repr does.
  std::string header = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': " +
                       shape_str(tensor.shape) + ", }";
  // Pad with spaces and end with '\n' so that magic + version + length + header is a multiple of
  // 64 bytes, as numpy does (keeps the data aligned for memory mapping).
  const size_t preamble = kMagicLen + 2 + 2;
  size_t total = preamble + header.size() + 1;
  total = (total + 63) / 64 * 64;
  header.append(total - preamble - header.size() - 1, ' ');
  header.push_back('\n');
  if (header.size() > 0xffff) fail("file ", path, ": .npy header too long for format 1.0");

  write_stream_atomically(path, [&](std::FILE* out) {
    const unsigned char version_and_len[4] = {1, 0, (unsigned char)(header.size() & 0xff),
                                              (unsigned char)(header.size() >> 8)};
    std::fwrite(kMagic, 1, kMagicLen, out);
    std::fwrite(version_and_len, 1, 4, out);
    std::fwrite(header.data(), 1, header.size(), out);
    if (nbytes > 0) std::fwrite(tensor.data, 1, nbytes, out);
  });
}

}  // namespace meshtune
