// CRC-32C of chunks: SSE4.2 four-stream loop with a table fallback (see crc32c.h).
#include "xla_ffi/checkpoint/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <nmmintrin.h>
#define JAXOPS_CRC32C_X86 1
#endif

namespace jaxops {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // CRC-32C, reflected

std::array<uint32_t, 256> MakeTable() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t crc = i;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ ((crc & 1u) ? kPoly : 0u);
    table[i] = crc;
  }
  return table;
}

uint32_t Crc32cTable(const uint8_t* p, size_t n) {
  static const std::array<uint32_t, 256> table = MakeTable();
  uint32_t crc = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}

#ifdef JAXOPS_CRC32C_X86
inline uint64_t Load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

__attribute__((target("sse4.2"))) uint32_t Crc32cHw(const uint8_t* p, size_t n) {
  uint64_t crc = 0xFFFFFFFFu;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) crc = _mm_crc32_u64(crc, Load64(p + i));
  uint32_t crc32 = static_cast<uint32_t>(crc);
  for (; i < n; ++i) crc32 = _mm_crc32_u8(crc32, p[i]);
  return ~crc32;
}

// Four chunks of `n` bytes each starting at p, p + n, p + 2n, p + 3n.
__attribute__((target("sse4.2"))) void Crc32cHw4(const uint8_t* p, size_t n, uint32_t* out) {
  uint64_t c0 = 0xFFFFFFFFu, c1 = 0xFFFFFFFFu, c2 = 0xFFFFFFFFu, c3 = 0xFFFFFFFFu;
  const uint8_t* p1 = p + n;
  const uint8_t* p2 = p + 2 * n;
  const uint8_t* p3 = p + 3 * n;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    c0 = _mm_crc32_u64(c0, Load64(p + i));
    c1 = _mm_crc32_u64(c1, Load64(p1 + i));
    c2 = _mm_crc32_u64(c2, Load64(p2 + i));
    c3 = _mm_crc32_u64(c3, Load64(p3 + i));
  }
  uint32_t d0 = static_cast<uint32_t>(c0), d1 = static_cast<uint32_t>(c1);
  uint32_t d2 = static_cast<uint32_t>(c2), d3 = static_cast<uint32_t>(c3);
  for (; i < n; ++i) {
    d0 = _mm_crc32_u8(d0, p[i]);
    d1 = _mm_crc32_u8(d1, p1[i]);
    d2 = _mm_crc32_u8(d2, p2[i]);
    d3 = _mm_crc32_u8(d3, p3[i]);
  }
  out[0] = ~d0;
  out[1] = ~d1;
  out[2] = ~d2;
  out[3] = ~d3;
}
#endif

}  // namespace

bool Crc32cHardware() {
#ifdef JAXOPS_CRC32C_X86
  static const bool hw = __builtin_cpu_supports("sse4.2");
  return hw;
#else
  return false;
#endif
}

std::vector<uint32_t> Crc32cChunks(const uint8_t* data, size_t size, size_t chunk) {
  const size_t count = (size + chunk - 1) / chunk;
  std::vector<uint32_t> out(count);
  size_t k = 0;
#ifdef JAXOPS_CRC32C_X86
  if (Crc32cHardware()) {
    const size_t full = size / chunk;  // chunks of exactly `chunk` bytes
    for (; k + 4 <= full; k += 4) Crc32cHw4(data + k * chunk, chunk, out.data() + k);
    for (; k < count; ++k) {
      const size_t begin = k * chunk;
      out[k] = Crc32cHw(data + begin, (size - begin < chunk) ? size - begin : chunk);
    }
    return out;
  }
#endif
  for (; k < count; ++k) {
    const size_t begin = k * chunk;
    out[k] = Crc32cTable(data + begin, (size - begin < chunk) ? size - begin : chunk);
  }
  return out;
}

}  // namespace jaxops
