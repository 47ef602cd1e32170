// CRC-32C (Castagnoli) of fixed-size chunks of a host buffer, for jaxops.parallel.checkpoint.
//
// Chunk k covers bytes [k * chunk, min((k + 1) * chunk, size)). Each CRC is the standard CRC-32C
// (reflected polynomial 0x82F63B78, initial value and final xor 0xFFFFFFFF): "123456789" gives
// 0xE3069283. On x86-64 with SSE4.2 four chunks are computed at once with the crc32 instruction
// (four independent dependency chains hide its 3-cycle latency); elsewhere a table is used.
#ifndef JAXOPS_XLA_FFI_CHECKPOINT_CRC32C_H_
#define JAXOPS_XLA_FFI_CHECKPOINT_CRC32C_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace jaxops {

// The CRC-32C of each `chunk`-byte piece of data[0, size); chunk must be > 0.
std::vector<uint32_t> Crc32cChunks(const uint8_t* data, size_t size, size_t chunk);

// Whether the hardware (SSE4.2) path is used on this machine.
bool Crc32cHardware();

}  // namespace jaxops

#endif  // JAXOPS_XLA_FFI_CHECKPOINT_CRC32C_H_
