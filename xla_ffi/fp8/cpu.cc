// FP8 quantization CPU kernels. The math is fp8.h's; the contracts are checks.h's.
//
// Two work shapes, both split over the XLA FFI thread pool:
//   * Rows (1 x G groups without transpose, and per-tensor without transpose): each task owns a
//     range of rows (or of elements); a group's amax and its quantization run back to back
//     while the group is in L1.
//   * Panels (everything that transposes, and G x G tiles): a unit is a panel of up to G rows
//     times kChunkColumns columns of one batch entry (~64 KiB of x). Pass 1 takes the
//     per-column amax over the panel's rows (and the row groups' amax when needed); pass 2
//     writes the row-wise data, quantizes the column-scaled values into a scratch tile when the
//     transposed scales differ, and transposes bytes into data_t. Units are independent, so x
//     is read from memory once and every output is written once.
// Inner loops are integer and fp32 operations on contiguous spans (GCC vectorizes them) and are
// compiled for AVX-512, AVX2 and the baseline.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "xla/ffi/api/ffi.h"
#include "xla_ffi/common/cpu_dispatch.h"
#include "xla_ffi/common/cpu_memory.h"
#include "xla_ffi/common/cpu_parallel.h"
#include "xla_ffi/common/ffi_util.h"
#include "xla_ffi/common/host_float.h"
#include "xla_ffi/fp8/checks.h"
#include "xla_ffi/fp8/fp8.h"
#include "xla_ffi/fp8/handlers.h"

namespace jaxops::fp8 {
namespace {

// Columns per panel unit: a multiple of every G, so units never split a group.
constexpr int64_t kChunkColumns = 256;
// Elements per sub-block of the per-tensor row path (amax and quantize while in L1).
constexpr int64_t kSpan = 4096;
// Bytes of memory traffic of quantizing one element of type X: read it, write 1 byte per output.
template <typename X>
constexpr int64_t ElementBytes(int64_t outputs) {
  return static_cast<int64_t>(sizeof(X)) + outputs;
}

// ---------------------------------------------------------------------------------------------
// Numeric functions: one contiguous span.

template <typename X>
JAXOPS_CPU_CLONES uint32_t AmaxBits(const X* x, int64_t n) {
  uint32_t amax = 0;
  for (int64_t j = 0; j < n; ++j) amax = MaxBits(amax, FiniteAbsBits(HostType<X>::Load(x[j])));
  return amax;
}

// colmax[j] = max(colmax[j], |x[j]|) over finite values.
template <typename X>
JAXOPS_CPU_CLONES void ColumnAmax(const X* x, uint32_t* colmax, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    colmax[j] = MaxBits(colmax[j], FiniteAbsBits(HostType<X>::Load(x[j])));
  }
}

template <typename X, typename F>
JAXOPS_CPU_CLONES void QuantizeSpan(const X* x, float scale, uint8_t* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = Quantize<F>(HostType<X>::Load(x[j]), scale);
}

// out[j] = fp8(x[j] / scales[j]).
template <typename X, typename F>
JAXOPS_CPU_CLONES void QuantizeSpanColumns(const X* x, const float* scales, uint8_t* out,
                                           int64_t n) {
  for (int64_t j = 0; j < n; ++j) out[j] = Quantize<F>(HostType<X>::Load(x[j]), scales[j]);
}

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols, in 8 x 8 blocks.
void TransposeBytesScalar(const uint8_t* src, int64_t ld_src, int64_t rows, int64_t cols,
                          uint8_t* dst, int64_t ld_dst) {
  constexpr int64_t kBlock = 8;
  for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
    const int64_t c1 = std::min(cols, c0 + kBlock);
    for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
      const int64_t r1 = std::min(rows, r0 + kBlock);
      for (int64_t c = c0; c < c1; ++c) {
        for (int64_t r = r0; r < r1; ++r) dst[c * ld_dst + r] = src[r * ld_src + c];
      }
    }
  }
}

#if defined(__SSE2__)
// One 16 x 16 byte tile: dst[c * ld_dst + r] = src[r * ld_src + c] for r, c < 16, in four rounds of
// interleaves (bytes, then 2-, 4- and 8-byte units): 64 shuffles instead of 256 byte moves.
void TransposeTile16(const uint8_t* src, int64_t ld_src, uint8_t* dst, int64_t ld_dst) {
  __m128i a[16];
  __m128i b[16];
  for (int i = 0; i < 16; ++i) {
    a[i] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i * ld_src));
  }
  // b[2k], b[2k + 1]: columns 0-7 and 8-15 of rows 2k, 2k + 1 (byte pairs).
  for (int k = 0; k < 8; ++k) {
    b[2 * k] = _mm_unpacklo_epi8(a[2 * k], a[2 * k + 1]);
    b[2 * k + 1] = _mm_unpackhi_epi8(a[2 * k], a[2 * k + 1]);
  }
  // a[4k + q]: columns 4q .. 4q + 3 of rows 4k .. 4k + 3 (4-byte units).
  for (int k = 0; k < 4; ++k) {
    a[4 * k] = _mm_unpacklo_epi16(b[4 * k], b[4 * k + 2]);
    a[4 * k + 1] = _mm_unpackhi_epi16(b[4 * k], b[4 * k + 2]);
    a[4 * k + 2] = _mm_unpacklo_epi16(b[4 * k + 1], b[4 * k + 3]);
    a[4 * k + 3] = _mm_unpackhi_epi16(b[4 * k + 1], b[4 * k + 3]);
  }
  // b[8k + m]: columns 2m, 2m + 1 of rows 8k .. 8k + 7 (8-byte units).
  for (int k = 0; k < 2; ++k) {
    for (int q = 0; q < 4; ++q) {
      b[8 * k + 2 * q] = _mm_unpacklo_epi32(a[8 * k + q], a[8 * k + 4 + q]);
      b[8 * k + 2 * q + 1] = _mm_unpackhi_epi32(a[8 * k + q], a[8 * k + 4 + q]);
    }
  }
  // Column 2m and 2m + 1, rows 0 .. 15.
  for (int m = 0; m < 8; ++m) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * m) * ld_dst),
                     _mm_unpacklo_epi64(b[m], b[8 + m]));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (2 * m + 1) * ld_dst),
                     _mm_unpackhi_epi64(b[m], b[8 + m]));
  }
}
#endif

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols: 16 x 16 tiles with SSE2 where
// they fit, the edges in 8 x 8 blocks of single bytes.
void TransposeBytes(const uint8_t* src, int64_t ld_src, int64_t rows, int64_t cols, uint8_t* dst,
                    int64_t ld_dst) {
#if defined(__SSE2__)
  constexpr int64_t kTile16 = 16;
  const int64_t full_rows = rows / kTile16 * kTile16;
  const int64_t full_cols = cols / kTile16 * kTile16;
  for (int64_t c0 = 0; c0 < full_cols; c0 += kTile16) {
    for (int64_t r0 = 0; r0 < full_rows; r0 += kTile16) {
      TransposeTile16(src + r0 * ld_src + c0, ld_src, dst + c0 * ld_dst + r0, ld_dst);
    }
  }
  // The rest: rows from full_rows on (all columns), then columns from full_cols on.
  if (full_rows < rows) {
    TransposeBytesScalar(src + full_rows * ld_src, ld_src, rows - full_rows, cols, dst + full_rows,
                         ld_dst);
  }
  if (full_cols < cols) {
    TransposeBytesScalar(src + full_cols, ld_src, full_rows, cols - full_cols,
                         dst + full_cols * ld_dst, ld_dst);
  }
#else
  TransposeBytesScalar(src, ld_src, rows, cols, dst, ld_dst);
#endif
}

// Stores a scale and, for the last block row of a column-major grid, the zero padding after it.
void StoreScale(const ScaleGrid& grid, float* scales, int64_t b, int64_t r, int64_t c, float v) {
  const int64_t i = grid.Index(b, r, c);
  scales[i] = v;
  if (r == grid.rows - 1) std::fill_n(scales + i + 1, grid.PaddingAfterLastRow(), 0.0f);
}

void AtomicMax(std::atomic<uint32_t>& target, uint32_t v) {
  uint32_t current = target.load(std::memory_order_relaxed);
  while (v > current && !target.compare_exchange_weak(current, v, std::memory_order_relaxed)) {
  }
}

// ---------------------------------------------------------------------------------------------
// Typed implementations.

struct QuantizeParams {
  QuantizeShape shape;
  float amax_floor = 0.0f;
  bool pow2_scale = false;
  float scale_in = 0.0f;  // per-tensor
};

struct QuantizeOutputs {
  uint8_t* data = nullptr;
  float* scale = nullptr;
  uint8_t* data_t = nullptr;
  float* scale_t = nullptr;
  float* amax = nullptr;  // per-tensor
};

// 1 x G groups, no transpose: tasks own row ranges.
template <typename X, typename F>
ffi::Future QuantizeRows(ffi::ThreadPool& pool, const QuantizeParams& p, const X* x,
                         QuantizeOutputs out) {
  const QuantizeShape s = p.shape;
  const int64_t row_bytes = s.k * ElementBytes<X>(1);
  return ParallelFor(pool, s.batch * s.m, row_bytes, [=](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / s.m;
      const int64_t m = row % s.m;
      const X* xr = x + row * s.k;
      uint8_t* dr = out.data + row * s.k;
      for (int64_t kg = 0; kg * s.group < s.k; ++kg) {
        const int64_t k0 = kg * s.group;
        const int64_t n = std::min(s.group, s.k - k0);
        const float scale =
            ScaleFromAmax<F>(FromBits(AmaxBits(xr + k0, n)), p.amax_floor, p.pow2_scale);
        QuantizeSpan<X, F>(xr + k0, scale, dr + k0, n);
        StoreScale(s.scale, out.scale, b, m, kg, scale);
      }
    }
  });
}

// Per-tensor with a given scale, no transpose: element ranges; amax measured on the way.
template <typename X, typename F>
ffi::Future QuantizeTensor(ffi::ThreadPool& pool, const QuantizeParams& p, const X* x,
                           QuantizeOutputs out) {
  const int64_t n = p.shape.batch * p.shape.m * p.shape.k;
  const float scale = p.scale_in;
  auto amax = std::make_shared<std::atomic<uint32_t>>(0u);
  out.scale[0] = scale;
  auto body = [=](int64_t begin, int64_t end) {
    uint32_t local = 0;
    for (int64_t j = begin; j < end; j += kSpan) {
      const int64_t len = std::min(kSpan, end - j);
      local = MaxBits(local, AmaxBits(x + j, len));
      QuantizeSpan<X, F>(x + j, scale, out.data + j, len);
    }
    AtomicMax(*amax, local);
  };
  auto finish = [=] { out.amax[0] = FromBits(amax->load(std::memory_order_relaxed)); };
  return ParallelFor(pool, n, ElementBytes<X>(1), body, finish);
}

// Everything that transposes, and G x G tiles: independent panel units.
template <typename X, typename F>
ffi::Future QuantizePanels(ffi::ThreadPool& pool, const QuantizeParams& p, const X* x,
                           QuantizeOutputs out) {
  const QuantizeShape s = p.shape;
  const int64_t g = s.group;
  const int64_t panels = CeilDiv(s.m, g);
  const int64_t chunks = CeilDiv(s.k, kChunkColumns);
  const int64_t units = s.batch * panels * chunks;
  const int64_t unit_bytes = g * kChunkColumns * ElementBytes<X>(s.transpose ? 2 : 1);
  auto amax = std::make_shared<std::atomic<uint32_t>>(0u);
  if (s.mode == kPerTensor) out.scale[0] = p.scale_in;

  auto body = [=](int64_t begin, int64_t end) {
    std::vector<uint32_t> colmax(kChunkColumns);
    std::vector<float> col_scale(kChunkColumns);
    std::vector<uint8_t> scratch(s.mode == kRows ? g * kChunkColumns : 0);
    uint32_t local_amax = 0;
    for (int64_t u = begin; u < end; ++u) {
      const int64_t c = u % chunks;
      const int64_t mg = (u / chunks) % panels;
      const int64_t b = u / (chunks * panels);
      const int64_t m0 = mg * g;
      const int64_t k0 = c * kChunkColumns;
      const int64_t rows = std::min(g, s.m - m0);
      const int64_t cols = std::min(kChunkColumns, s.k - k0);
      const X* xp = x + (b * s.m + m0) * s.k + k0;
      uint8_t* dp = out.data + (b * s.m + m0) * s.k + k0;
      uint8_t* tp = out.data_t == nullptr ? nullptr : out.data_t + (b * s.k + k0) * s.m + m0;

      std::fill_n(colmax.data(), cols, 0u);
      for (int64_t i = 0; i < rows; ++i) ColumnAmax(xp + i * s.k, colmax.data(), cols);

      if (s.mode == kPerTensor) {
        for (int64_t j = 0; j < cols; ++j) local_amax = MaxBits(local_amax, colmax[j]);
        for (int64_t i = 0; i < rows; ++i) {
          QuantizeSpan<X, F>(xp + i * s.k, p.scale_in, dp + i * s.k, cols);
        }
      } else if (s.mode == kTiles) {
        for (int64_t j0 = 0; j0 < cols; j0 += g) {
          const int64_t n = std::min(g, cols - j0);
          uint32_t tile = 0;
          for (int64_t j = j0; j < j0 + n; ++j) tile = MaxBits(tile, colmax[j]);
          const float scale = ScaleFromAmax<F>(FromBits(tile), p.amax_floor, p.pow2_scale);
          const int64_t kg = (k0 + j0) / g;
          StoreScale(s.scale, out.scale, b, mg, kg, scale);
          if (tp != nullptr) StoreScale(s.scale_t, out.scale_t, b, kg, mg, scale);
          for (int64_t i = 0; i < rows; ++i) {
            QuantizeSpan<X, F>(xp + i * s.k + j0, scale, dp + i * s.k + j0, n);
          }
        }
      } else {  // kRows with transpose: row groups for data, column groups for data_t.
        for (int64_t i = 0; i < rows; ++i) {
          for (int64_t j0 = 0; j0 < cols; j0 += g) {
            const int64_t n = std::min(g, cols - j0);
            const X* xr = xp + i * s.k + j0;
            const float scale =
                ScaleFromAmax<F>(FromBits(AmaxBits(xr, n)), p.amax_floor, p.pow2_scale);
            QuantizeSpan<X, F>(xr, scale, dp + i * s.k + j0, n);
            StoreScale(s.scale, out.scale, b, m0 + i, (k0 + j0) / g, scale);
          }
        }
        for (int64_t j = 0; j < cols; ++j) {
          col_scale[j] = ScaleFromAmax<F>(FromBits(colmax[j]), p.amax_floor, p.pow2_scale);
          StoreScale(s.scale_t, out.scale_t, b, k0 + j, mg, col_scale[j]);
        }
        for (int64_t i = 0; i < rows; ++i) {
          QuantizeSpanColumns<X, F>(xp + i * s.k, col_scale.data(),
                                    scratch.data() + i * kChunkColumns, cols);
        }
        TransposeBytes(scratch.data(), kChunkColumns, rows, cols, tp, s.m);
        continue;
      }
      if (tp != nullptr) TransposeBytes(dp, s.k, rows, cols, tp, s.m);
    }
    if (s.mode == kPerTensor) AtomicMax(*amax, local_amax);
  };
  auto finish = [=] {
    if (s.mode == kPerTensor) out.amax[0] = FromBits(amax->load(std::memory_order_relaxed));
  };
  return ParallelFor(pool, units, unit_bytes, body, finish);
}

template <typename X, typename F>
ffi::Future QuantizeImpl(ffi::ThreadPool& pool, const QuantizeParams& p, const X* x,
                         QuantizeOutputs out) {
  const QuantizeShape& s = p.shape;
  if (s.mode == kRows && !s.transpose) return QuantizeRows<X, F>(pool, p, x, out);
  if (s.mode == kPerTensor && !s.transpose) return QuantizeTensor<X, F>(pool, p, x, out);
  return QuantizePanels<X, F>(pool, p, x, out);
}

template <typename X>
ffi::Future AmaxImpl(ffi::ThreadPool& pool, const X* x, int64_t n, float* amax_out) {
  auto amax = std::make_shared<std::atomic<uint32_t>>(0u);
  auto body = [=](int64_t begin, int64_t end) {
    AtomicMax(*amax, AmaxBits(x + begin, end - begin));
  };
  auto finish = [=] { amax_out[0] = FromBits(amax->load(std::memory_order_relaxed)); };
  return ParallelFor(pool, n, ElementBytes<X>(0), body, finish);
}

// Expert layout of quantize_split_transpose, computed on the calling thread (E entries).
struct SplitLayout {
  std::vector<int64_t> start;         // first row of expert e in x
  std::vector<int64_t> size;          // clamped row count
  std::vector<int64_t> col_offset;    // [E + 1]
  std::vector<int64_t> scale_offset;  // [E + 1]
  std::vector<int64_t> panel_expert;  // expert of each scale column (panel)
};

SplitLayout MakeSplitLayout(const SplitShape& s, const int32_t* group_sizes) {
  SplitLayout l;
  l.start.resize(s.experts);
  l.size.resize(s.experts);
  l.col_offset.assign(s.experts + 1, 0);
  l.scale_offset.assign(s.experts + 1, 0);
  int64_t row = 0;
  for (int64_t e = 0; e < s.experts; ++e) {
    const int64_t m = std::clamp<int64_t>(group_sizes[e], 0, s.m - row);
    l.start[e] = row;
    l.size[e] = m;
    row += m;
    l.col_offset[e + 1] = l.col_offset[e] + RoundUp(m, kSplitColumnAlign);
    l.scale_offset[e + 1] = l.scale_offset[e] + CeilDiv(m, s.group);
    for (int64_t p = 0; p < CeilDiv(m, s.group); ++p) l.panel_expert.push_back(e);
  }
  return l;
}

template <typename X, typename F>
ffi::Future SplitTransposeImpl(ffi::ThreadPool& pool, const SplitShape& s, const X* x,
                               std::shared_ptr<const SplitLayout> layout, float amax_floor,
                               bool pow2_scale, uint8_t* data_t, float* scale_t) {
  const int64_t g = s.group;
  const int64_t chunks = CeilDiv(s.k, kChunkColumns);
  const int64_t panels = static_cast<int64_t>(layout->panel_expert.size());
  // One extra panel index per chunk zeroes the columns after the last expert.
  const int64_t units = (panels + 1) * chunks;
  const int64_t unit_bytes = g * kChunkColumns * ElementBytes<X>(1);
  auto body = [=](int64_t begin, int64_t end) {
    const SplitLayout& l = *layout;
    std::vector<uint32_t> colmax(kChunkColumns);
    std::vector<float> col_scale(kChunkColumns);
    std::vector<uint8_t> scratch(g * kChunkColumns);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t c = u % chunks;
      const int64_t panel = u / chunks;
      const int64_t k0 = c * kChunkColumns;
      const int64_t cols = std::min(kChunkColumns, s.k - k0);
      if (panel == panels) {
        const int64_t used_cols = l.col_offset[s.experts];
        const int64_t used_scales = l.scale_offset[s.experts];
        for (int64_t j = k0; j < k0 + cols; ++j) {
          std::memset(data_t + j * s.columns + used_cols, 0, s.columns - used_cols);
          std::fill(scale_t + j * s.scale_columns + used_scales,
                    scale_t + (j + 1) * s.scale_columns, 0.0f);
        }
        continue;
      }
      const int64_t e = l.panel_expert[panel];
      const int64_t p = panel - l.scale_offset[e];
      const int64_t r0 = p * g;
      const int64_t rows = std::min(g, l.size[e] - r0);
      const X* xp = x + (l.start[e] + r0) * s.k + k0;

      std::fill_n(colmax.data(), cols, 0u);
      for (int64_t i = 0; i < rows; ++i) ColumnAmax(xp + i * s.k, colmax.data(), cols);
      for (int64_t j = 0; j < cols; ++j) {
        col_scale[j] = ScaleFromAmax<F>(FromBits(colmax[j]), amax_floor, pow2_scale);
        scale_t[(k0 + j) * s.scale_columns + panel] = col_scale[j];
      }
      for (int64_t i = 0; i < rows; ++i) {
        QuantizeSpanColumns<X, F>(xp + i * s.k, col_scale.data(),
                                  scratch.data() + i * kChunkColumns, cols);
      }
      uint8_t* tp = data_t + k0 * s.columns + l.col_offset[e] + r0;
      TransposeBytes(scratch.data(), kChunkColumns, rows, cols, tp, s.columns);
      if (r0 + rows == l.size[e]) {  // the expert's last panel zeroes its alignment padding
        const int64_t pad = l.col_offset[e + 1] - l.col_offset[e] - l.size[e];
        for (int64_t j = 0; j < cols; ++j) std::memset(tp + j * s.columns + rows, 0, pad);
      }
    }
  };
  return ParallelFor(pool, units, unit_bytes, body);
}

// ---------------------------------------------------------------------------------------------
// Dispatch: validation and the dtype switches.

// Returns fn(TypeTag<X>{}, TypeTag<F>{}) with the storage type X of x and the fp8 format F of
// the output: checks.h's SwitchTypes with the host types.
template <typename Fn>
ffi::Future DispatchTypes(const char* op, ffi::DataType x_type, ffi::DataType fp8_type, Fn fn) {
  return SwitchTypes<float, BFloat16, Float16>(
      op, x_type, fp8_type, fn, [](ffi::Error error) { return ReadyFuture(std::move(error)); });
}

ffi::Future QuantizeDispatch(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale_in,
                             ffi::Result<ffi::AnyBuffer> data,
                             ffi::Result<ffi::Buffer<ffi::F32>> scale,
                             ffi::Result<ffi::AnyBuffer> data_t,
                             ffi::Result<ffi::Buffer<ffi::F32>> scale_t,
                             ffi::Result<ffi::Buffer<ffi::F32>> amax, int32_t block_mode,
                             int32_t group, bool transpose, bool col_tma, bool pow2_scale,
                             float amax_floor) {
  auto shape = CheckQuantize(x, scale_in, *data, *scale, *data_t, *scale_t, *amax, block_mode,
                             group, transpose, col_tma, amax_floor);
  if (shape.has_error()) return ReadyFuture(shape.error());
  QuantizeParams params;
  params.shape = *shape;
  params.amax_floor = amax_floor;
  params.pow2_scale = pow2_scale;
  params.scale_in = shape->mode == kPerTensor ? scale_in.typed_data()[0] : 0.0f;
  QuantizeOutputs out;
  out.data = Out<uint8_t>(data);
  out.scale = scale->typed_data();
  out.data_t = transpose ? Out<uint8_t>(data_t) : nullptr;
  out.scale_t = transpose ? scale_t->typed_data() : nullptr;
  out.amax = amax->typed_data();
  if (ElementCount(x) == 0) {
    if (shape->mode == kPerTensor) {
      out.scale[0] = params.scale_in;
      out.amax[0] = 0.0f;
    }
    return ReadyFuture();
  }
  return DispatchTypes("fp8 quantize", x.element_type(), data->element_type(),
                       [&](auto x_tag, auto f_tag) {
                         using X = typename decltype(x_tag)::type;
                         using F = typename decltype(f_tag)::type;
                         return QuantizeImpl<X, F>(pool, params, In<X>(x), out);
                       });
}

ffi::Future AmaxDispatch(ffi::ThreadPool pool, ffi::AnyBuffer x,
                         ffi::Result<ffi::Buffer<ffi::F32>> amax) {
  if (auto e = CheckAmax(x, *amax); e.failure()) return ReadyFuture(std::move(e));
  return DispatchFloat("fp8 amax", "x", x.element_type(), [&](auto x_tag) {
    using X = typename decltype(x_tag)::type;
    return AmaxImpl(pool, In<X>(x), ElementCount(x), amax->typed_data());
  });
}

ffi::Future SplitTransposeDispatch(ffi::ThreadPool pool, ffi::AnyBuffer x,
                                   ffi::Buffer<ffi::S32> group_sizes,
                                   ffi::Result<ffi::AnyBuffer> data_t,
                                   ffi::Result<ffi::Buffer<ffi::F32>> scale_t,
                                   ffi::Result<ffi::Buffer<ffi::S32>> col_offsets,
                                   ffi::Result<ffi::Buffer<ffi::S32>> scale_offsets, int32_t group,
                                   bool pow2_scale, float amax_floor) {
  auto shape = CheckSplitTranspose(x, group_sizes, *data_t, *scale_t, *col_offsets, *scale_offsets,
                                   group, amax_floor);
  if (shape.has_error()) return ReadyFuture(shape.error());
  const int64_t experts = shape->experts;
  auto layout = std::make_shared<SplitLayout>(MakeSplitLayout(*shape, group_sizes.typed_data()));
  for (int64_t e = 0; e <= experts; ++e) {
    col_offsets->typed_data()[e] = static_cast<int32_t>(layout->col_offset[e]);
    scale_offsets->typed_data()[e] = static_cast<int32_t>(layout->scale_offset[e]);
  }
  if (shape->k == 0) return ReadyFuture();
  uint8_t* data = Out<uint8_t>(data_t);
  float* scales = scale_t->typed_data();
  return DispatchTypes("fp8 quantize_split_transpose", x.element_type(), data_t->element_type(),
                       [&](auto x_tag, auto f_tag) {
                         using X = typename decltype(x_tag)::type;
                         using F = typename decltype(f_tag)::type;
                         return SplitTransposeImpl<X, F>(pool, *shape, In<X>(x), layout, amax_floor,
                                                         pow2_scale, data, scales);
                       });
}

}  // namespace
}  // namespace jaxops::fp8

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8QuantizeCpu, jaxops::fp8::QuantizeDispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()             // pool
                                  .Arg<xla::ffi::AnyBuffer>()              // x [..., M, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::F32>>()  // scale_in [1] | [0]
                                  .Ret<xla::ffi::AnyBuffer>()              // data float8, x's shape
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // scale (ScaleGrid)
                                  .Ret<xla::ffi::AnyBuffer>()  // data_t [..., K, M] | [0]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // scale_t | [0]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // amax [] | [0]
                                  .Attr<int32_t>("block_mode")             // BlockMode
                                  .Attr<int32_t>("group")                  // G: 32, 64, 128
                                  .Attr<bool>("transpose")                 // write data_t
                                  .Attr<bool>("col_tma")                   // column-major scales
                                  .Attr<bool>("pow2_scale")                // scales 2^n
                                  .Attr<float>("amax_floor"));             // amax lower bound

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8AmaxCpu, jaxops::fp8::AmaxDispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()               // pool
                                  .Arg<xla::ffi::AnyBuffer>()                // x, any shape
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>());  // amax []

XLA_FFI_DEFINE_HANDLER_SYMBOL(Fp8QuantizeSplitTransposeCpu, jaxops::fp8::SplitTransposeDispatch,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()             // pool
                                  .Arg<xla::ffi::AnyBuffer>()              // x [M, K]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // group_sizes [E]
                                  .Ret<xla::ffi::AnyBuffer>()              // data_t [K, C]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // scale_t [K, S]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // col_offsets [E + 1]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // scale_offsets [E + 1]
                                  .Attr<int32_t>("group")                  // G: 32, 64, 128
                                  .Attr<bool>("pow2_scale")                // scales 2^n
                                  .Attr<float>("amax_floor"));             // amax lower bound
