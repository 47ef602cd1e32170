// CUDA handlers of the FP8 quantization family: quantize (per-tensor, 1 x G row groups or G x G
// tiles, optionally with a transposed copy), amax (the per-tensor amax that current scaling runs
// first) and quantize_split_transpose (the per-expert transposed layout of grouped GEMMs). The
// kernels and their designs live in quantize_kernels.cuh and split_kernels.cuh (building blocks in
// kernel_util.cuh), the math in fp8.h and the contracts in checks.h.
//
// Three layers, as in jax's examples/ffi:
//   1. Templated kernels over F (the fp8 format traits E4M3 / E5M2), T (x's dtype) and kVec
//      (elements per load: 16 bytes of T, or 1 for the scalar fallback): quantize_kernels.cuh and
//      split_kernels.cuh.
//   2. Typed implementations (QuantizeTyped<F, T>, AmaxTyped<T>, SplitTransposeTyped<F, T>) that
//      pick the kernels, launch them on the XLA stream and turn launch failures into errors.
//   3. One dispatch per handler: validates with checks.h, then DispatchFloat / DispatchTypes
//      turn the runtime dtypes of x and of the fp8 output into T and F (the only dtype switches).
//
// Nothing synchronizes with the host; grids are capped and the kernels loop over their work.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "xla_ffi/common/cuda_util.cuh"
#include "xla_ffi/common/cuda_vec.cuh"
#include "xla_ffi/common/ffi_util.h"
#include "xla_ffi/common/math.h"
#include "xla_ffi/fp8/checks.h"
#include "xla_ffi/fp8/fp8.h"
#include "xla_ffi/fp8/handlers.h"
#include "xla_ffi/fp8/kernel_util.cuh"
#include "xla_ffi/fp8/quantize_kernels.cuh"
#include "xla_ffi/fp8/split_kernels.cuh"

namespace jaxops::fp8 {
namespace {

// Grid caps besides kMaxGridCtas; the kernels loop (grid-stride), so the caps only bound the
// launch.
constexpr int64_t kAmaxMaxCtas = 2048;      // Kernels that atomicMax amax: one atomic per CTA.
constexpr int64_t kTailMaxCtas = 4096;      // Rows of K zeroed at once by the tail kernel.
constexpr int64_t kSplitTargetCtas = 2048;  // Panels x K chunks the split kernel aims for.
constexpr int64_t kMaxGridY = 65535;        // Hardware limit of gridDim.y.

// ---------------------------------------------------------------------------------------------
// Typed implementations.

struct QuantizeBuffers {
  const void* x = nullptr;
  const float* scale_in = nullptr;  // per-tensor: the scale (1 element)
  uint8_t* data = nullptr;
  float* scale = nullptr;
  uint8_t* data_t = nullptr;  // nullptr: no transpose
  float* scale_t = nullptr;   // nullptr: none
  float* amax = nullptr;      // per-tensor only
};

template <typename F, int kVec, typename T>
ffi::Error LaunchRows(cudaStream_t stream, RowsArgs<T> a) {
  // G / kVec is 4 to 32 on the vector path (G in {32, 64, 128}, kVec 4 or 8), so 2 to 16 lanes.
  a.lanes = kVec > 1 ? a.group / (kRowsPacks * kVec) : std::min(kWarpSize, a.group);
  a.lanes_log2 = Log2(a.lanes);
  const int64_t slots = a.rows * a.kgroups * a.lanes;
  const ffi::ErrorOr<int64_t> resident =
      ResidentCtas<Fp8RowsKernel<F, kVec, T>, kThreads>("fp8 quantize");
  if (resident.has_error()) return resident.error();
  Fp8RowsKernel<F, kVec, T>
      <<<GridCtas(slots, kThreads, resident.value()), kThreads, 0, stream>>>(a);
  return LastLaunchError("fp8 quantize rows kernel");
}

template <typename F, int kVec, typename T, int kBatch>
ffi::Error LaunchTiles(cudaStream_t stream, const TileArgs<T>& a) {
  const bool shared_codes = SharesCodes(a);
  const int64_t g = a.tile;
  const size_t shared_bytes =
      static_cast<size_t>(TileBytes<T>(g, g) + (shared_codes ? g * (g + kCodePad) : 0));
  auto kernel = Fp8TileKernel<F, kVec, T, kBatch>;
  if (auto e = ReserveDynamicShared("fp8 quantize", kernel, shared_bytes); e.failure()) return e;
  // One wave of resident CTAs walks the tiles (a partial last wave of CTAs that each take a fixed
  // share would leave SMs idle); the shared memory, so the occupancy, depends on G and the code
  // tile: one cache key per (G, code tile).
  const int key = 2 * (Log2(a.tile) - Log2(kMinTile)) + (shared_codes ? 1 : 0);
  const ffi::ErrorOr<int64_t> resident =
      ResidentCtas<Fp8TileKernel<F, kVec, T, kBatch>, kThreads>("fp8 quantize", shared_bytes, key);
  if (resident.has_error()) return resident.error();
  const int64_t tiles = a.batch * a.mtiles * a.ktiles;
  const int64_t max_ctas =
      std::min(resident.value(), a.mode == kPerTensor ? kAmaxMaxCtas : kMaxGridCtas);
  kernel<<<GridCtas(tiles, 1, max_ctas), kThreads, shared_bytes, stream>>>(a);
  return LastLaunchError("fp8 quantize tile kernel");
}

// G = 128 tiles whose shared memory already holds residency to kBigTileMinCtas CTAs per SM or
// fewer (with the code tile, or float32) take the batched-load instance (kBigTileLoadBatch), which
// costs nothing in occupancy there; the rest load one pack at a time (40 registers: 16-bit G = 128
// tiles without the code tile fit 6 CTAs per SM).
template <typename F, int kVec, typename T>
ffi::Error LaunchTilesSized(cudaStream_t stream, const TileArgs<T>& a) {
  const bool shared_codes = SharesCodes(a);
  if (a.tile == kMaxTile && (shared_codes || sizeof(T) == 4)) {
    return LaunchTiles<F, kVec, T, kBigTileLoadBatch>(stream, a);
  }
  return LaunchTiles<F, kVec, T, 1>(stream, a);
}

template <typename F, typename T>
ffi::Error LaunchTilesVectorized(cudaStream_t stream, TileArgs<T> a) {
  a.data_words = a.k % 4 == 0 && IsAligned(a.data, 4);
  a.data_t_words = a.data_t != nullptr && a.m % 4 == 0 && IsAligned(a.data_t, 4);
  if (Vectorizable<T>(a.k, {a.x})) return LaunchTilesSized<F, kVecElems<T>>(stream, a);
  return LaunchTilesSized<F, 1>(stream, a);
}

// Zeroes the amax output, whose bits the kernels then atomicMax in place.
ffi::Error ZeroAmax(const char* op, uint32_t* amax, cudaStream_t stream) {
  return FillAsync((std::string(op) + ": zeroing amax").c_str(), amax, 0, sizeof(uint32_t), stream);
}

// Fp8PerTensorKernel<F> over the a.n elements of a.x: 16-byte loads when x (and data) are
// 16-byte aligned (the kernel takes the tail after the last whole pack one element at a time), on
// at most one wave of resident CTAs.
template <typename F, int kVec, typename T>
ffi::Error LaunchPerTensorWith(cudaStream_t stream, const FlatArgs<T>& a) {
  const ffi::ErrorOr<int64_t> resident =
      ResidentCtas<Fp8PerTensorKernel<F, kVec, T>, kThreads>("fp8 quantize");
  if (resident.has_error()) return resident.error();
  const int64_t cap = std::min(resident.value(), kAmaxMaxCtas);
  Fp8PerTensorKernel<F, kVec, T>
      <<<GridCtas(CeilDiv(a.n, kVec * kFlatPacks), kThreads, cap), kThreads, 0, stream>>>(a);
  return ffi::Error::Success();
}

template <typename F, typename T>
ffi::Error LaunchPerTensor(cudaStream_t stream, const FlatArgs<T>& a, const char* what) {
  const bool vector = IsAligned(a.x, 16) && IsAligned(a.data, 16);
  ffi::Error launched = vector ? LaunchPerTensorWith<F, kVecElems<T>>(stream, a)
                               : LaunchPerTensorWith<F, 1>(stream, a);
  if (launched.failure()) return launched;
  return LastLaunchError(what);
}

// amax of n elements of x into *amax (one float), on the stream.
template <typename T>
ffi::Error AmaxTyped(cudaStream_t stream, const T* x, int64_t n, float* amax_out) {
  FlatArgs<T> a;
  a.x = x;
  a.amax = reinterpret_cast<uint32_t*>(amax_out);
  a.n = n;
  if (auto e = ZeroAmax("fp8 amax", a.amax, stream); e.failure()) return e;
  if (n == 0) return ffi::Error::Success();
  return LaunchPerTensor<void>(stream, a, "fp8 amax kernel");
}

// Per-tensor: one pass that quantizes with scale_in[0] and measures amax.
template <typename F, typename T>
ffi::Error PerTensorTyped(cudaStream_t stream, const QuantizeShape& s, const QuantizeBuffers& buf) {
  const T* x = static_cast<const T*>(buf.x);
  const int64_t n = s.batch * s.m * s.k;
  uint32_t* amax = reinterpret_cast<uint32_t*>(buf.amax);
  if (auto e = ZeroAmax("fp8 quantize", amax, stream); e.failure()) return e;
  if (!s.transpose || n == 0) {
    // An empty x still gets its CTA: it writes scale[0].
    FlatArgs<T> a;
    a.x = x;
    a.data = buf.data;
    a.scale = buf.scale;
    a.scale_in = buf.scale_in;
    a.amax = amax;
    a.n = n;
    return LaunchPerTensor<F>(stream, a, "fp8 quantize per-tensor kernel");
  }
  TileArgs<T> a;
  a.x = x;
  a.data = buf.data;
  a.data_t = buf.data_t;
  a.scale = buf.scale;
  a.scale_in = buf.scale_in;
  a.amax = amax;
  a.batch = s.batch;
  a.m = s.m;
  a.k = s.k;
  a.mtiles = CeilDiv(s.m, kPerTensorTile);
  a.ktiles = CeilDiv(s.k, kPerTensorTile);
  a.tile = kPerTensorTile;
  a.tile_log2 = kPerTensorTileLog2;
  a.mode = kPerTensor;
  return LaunchTilesVectorized<F>(stream, a);
}

template <typename F, typename T>
ffi::Error QuantizeTyped(cudaStream_t stream, const QuantizeShape& s, const QuantizeBuffers& buf,
                         float amax_floor, bool pow2_scale) {
  if (s.mode == kPerTensor) return PerTensorTyped<F, T>(stream, s, buf);
  // Block modes: an empty x has empty scales too; nothing to write.
  if (s.batch == 0 || s.m == 0 || s.k == 0) return ffi::Error::Success();
  const T* x = static_cast<const T*>(buf.x);
  const int group = static_cast<int>(s.group);
  if (s.mode == kRows && !s.transpose) {
    RowsArgs<T> a;
    a.x = x;
    a.data = buf.data;
    a.scale = buf.scale;
    a.rows = s.batch * s.m;
    a.m = s.m;
    a.k = s.k;
    a.kgroups = CeilDiv(s.k, s.group);
    a.group = group;
    a.grid = s.scale;
    a.amax_floor = amax_floor;
    a.pow2_scale = pow2_scale;
    if (Vectorizable<T>(s.k, {x, buf.data})) return LaunchRows<F, kVecElems<T>>(stream, a);
    return LaunchRows<F, 1>(stream, a);
  }
  TileArgs<T> a;
  a.x = x;
  a.data = buf.data;
  a.data_t = s.transpose ? buf.data_t : nullptr;
  a.scale = buf.scale;
  a.scale_t = s.transpose ? buf.scale_t : nullptr;
  a.batch = s.batch;
  a.m = s.m;
  a.k = s.k;
  a.mtiles = CeilDiv(s.m, s.group);
  a.ktiles = CeilDiv(s.k, s.group);
  a.tile = group;
  a.tile_log2 = Log2(group);
  a.mode = s.mode;
  a.grid = s.scale;
  a.grid_t = s.scale_t;
  a.amax_floor = amax_floor;
  a.pow2_scale = pow2_scale;
  return LaunchTilesVectorized<F>(stream, a);
}

template <typename F, typename T>
ffi::Error SplitTransposeTyped(cudaStream_t stream, const SplitShape& s, SplitArgs<T> a) {
  Fp8SplitOffsetsKernel<<<1, kScanThreads, 0, stream>>>(
      a.group_sizes, s.experts, s.m, static_cast<int>(s.group), a.col_offsets, a.scale_offsets);
  if (auto e = LastLaunchError("fp8 quantize_split_transpose offsets kernel"); e.failure()) {
    return e;
  }
  if (s.k == 0) return ffi::Error::Success();  // data_t and scale_t are empty
  a.m = s.m;
  a.k = s.k;
  a.experts = s.experts;
  a.columns = s.columns;
  a.scale_columns = s.scale_columns;
  a.group = static_cast<int>(s.group);
  a.group_log2 = Log2(a.group);
  a.ktiles = CeilDiv(s.k, kSplitTileCols);
  if (s.m > 0 && s.scale_columns > 0) {
    // Enough CTAs to fill the GPU: split K into chunks when there are few panels.
    const int64_t chunks = std::clamp<int64_t>(CeilDiv(kSplitTargetCtas, s.scale_columns), 1,
                                               std::min(a.ktiles, kMaxGridY));
    a.tiles_per_chunk = CeilDiv(a.ktiles, chunks);
    const dim3 grid(static_cast<unsigned>(s.scale_columns),
                    static_cast<unsigned>(CeilDiv(a.ktiles, a.tiles_per_chunk)));
    if (Vectorizable<T>(s.k, {a.x})) {
      Fp8SplitPanelKernel<F, kVecElems<T>, T><<<grid, kThreads, 0, stream>>>(a);
    } else {
      Fp8SplitPanelKernel<F, 1, T><<<grid, kThreads, 0, stream>>>(a);
    }
    if (auto e = LastLaunchError("fp8 quantize_split_transpose panel kernel"); e.failure()) {
      return e;
    }
  }
  if (s.columns == 0 && s.scale_columns == 0) return ffi::Error::Success();
  Fp8SplitTailKernel<<<GridCtas(s.k, 1, kTailMaxCtas), kThreads, 0, stream>>>(
      a.data_t, a.scale_t, a.col_offsets, a.scale_offsets, s.experts, s.k, s.columns,
      s.scale_columns);
  return LastLaunchError("fp8 quantize_split_transpose tail kernel");
}

// ---------------------------------------------------------------------------------------------
// Dispatch.

// launch(TypeTag<T>{}, TypeTag<F>{}) for x's dtype T (float, __nv_bfloat16 or __half) and the
// fp8 format F of the output (E4M3 or E5M2): checks.h's SwitchTypes with CUDA's types.
template <typename Launch>
ffi::Error DispatchTypes(const char* op, ffi::DataType x_dtype, ffi::DataType fp8_dtype,
                         Launch&& launch) {
  return SwitchTypes<float, __nv_bfloat16, __half>(op, x_dtype, fp8_dtype, launch,
                                                   [](ffi::Error error) { return error; });
}

ffi::Error Fp8QuantizeCudaDispatch(cudaStream_t stream, ffi::AnyBuffer x,
                                   ffi::Buffer<ffi::F32> scale_in, ffi::Result<ffi::AnyBuffer> data,
                                   ffi::Result<ffi::Buffer<ffi::F32>> scale,
                                   ffi::Result<ffi::AnyBuffer> data_t,
                                   ffi::Result<ffi::Buffer<ffi::F32>> scale_t,
                                   ffi::Result<ffi::Buffer<ffi::F32>> amax, int32_t block_mode,
                                   int32_t group, bool transpose, bool col_tma, bool pow2_scale,
                                   float amax_floor) {
  const auto shape = CheckQuantize(x, scale_in, *data, *scale, *data_t, *scale_t, *amax, block_mode,
                                   group, transpose, col_tma, amax_floor);
  if (shape.has_error()) return shape.error();
  QuantizeBuffers buf;
  buf.x = x.untyped_data();
  buf.scale_in = scale_in.typed_data();
  buf.data = static_cast<uint8_t*>(data->untyped_data());
  buf.scale = scale->typed_data();
  buf.data_t = static_cast<uint8_t*>(data_t->untyped_data());
  buf.scale_t = scale_t->typed_data();
  buf.amax = amax->typed_data();
  return DispatchTypes("fp8 quantize", x.element_type(), data->element_type(),
                       [&](auto x_tag, auto f_tag) -> ffi::Error {
                         using T = typename decltype(x_tag)::type;
                         using F = typename decltype(f_tag)::type;
                         return QuantizeTyped<F, T>(stream, *shape, buf, amax_floor, pow2_scale);
                       });
}

ffi::Error Fp8AmaxCudaDispatch(cudaStream_t stream, ffi::AnyBuffer x,
                               ffi::Result<ffi::Buffer<ffi::F32>> amax) {
  if (auto e = CheckAmax(x, *amax); e.failure()) return e;
  return DispatchFloat("fp8 amax", "x", x.element_type(), [&](auto x_tag) -> ffi::Error {
    using T = typename decltype(x_tag)::type;
    return AmaxTyped(stream, static_cast<const T*>(x.untyped_data()), ElementCount(x),
                     amax->typed_data());
  });
}

ffi::Error Fp8QuantizeSplitTransposeCudaDispatch(cudaStream_t stream, ffi::AnyBuffer x,
                                                 ffi::Buffer<ffi::S32> group_sizes,
                                                 ffi::Result<ffi::AnyBuffer> data_t,
                                                 ffi::Result<ffi::Buffer<ffi::F32>> scale_t,
                                                 ffi::Result<ffi::Buffer<ffi::S32>> col_offsets,
                                                 ffi::Result<ffi::Buffer<ffi::S32>> scale_offsets,
                                                 int32_t group, bool pow2_scale, float amax_floor) {
  const auto shape = CheckSplitTranspose(x, group_sizes, *data_t, *scale_t, *col_offsets,
                                         *scale_offsets, group, amax_floor);
  if (shape.has_error()) return shape.error();
  return DispatchTypes("fp8 quantize_split_transpose", x.element_type(), data_t->element_type(),
                       [&](auto x_tag, auto f_tag) -> ffi::Error {
                         using T = typename decltype(x_tag)::type;
                         using F = typename decltype(f_tag)::type;
                         SplitArgs<T> a;
                         a.x = static_cast<const T*>(x.untyped_data());
                         a.group_sizes = group_sizes.typed_data();
                         a.data_t = static_cast<uint8_t*>(data_t->untyped_data());
                         a.scale_t = scale_t->typed_data();
                         a.col_offsets = col_offsets->typed_data();
                         a.scale_offsets = scale_offsets->typed_data();
                         a.amax_floor = amax_floor;
                         a.pow2_scale = pow2_scale;
                         return SplitTransposeTyped<F, T>(stream, *shape, a);
                       });
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Handler symbols (see handlers.h).

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    Fp8QuantizeCuda, Fp8QuantizeCudaDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA compute stream
        .Arg<ffi::AnyBuffer>()         // x [..., M, K]: f32 / bf16 / f16, viewed as [batch, M, K]
        .Arg<ffi::Buffer<ffi::F32>>()  // scale_in [1] per-tensor (the scale) or [0]
        .Ret<ffi::AnyBuffer>()         // data: float8_e4m3fn / float8_e5m2, x's shape
        .Ret<ffi::Buffer<ffi::F32>>()  // scale: ScaleGrid of the mode, or 1 element per-tensor
        .Ret<ffi::AnyBuffer>()         // data_t [..., K, M] or [0]
        .Ret<ffi::Buffer<ffi::F32>>()  // scale_t: ScaleGrid of the transpose, or [0]
        .Ret<ffi::Buffer<ffi::F32>>()  // amax [] per-tensor, or [0]
        .Attr<int32_t>("block_mode")   // BlockMode: 0 per-tensor, 1 rows, 2 tiles
        .Attr<int32_t>("group")        // G: 32, 64 or 128
        .Attr<bool>("transpose")       // also write data_t / scale_t
        .Attr<bool>("col_tma")         // column-major scales padded to 4 rows
        .Attr<bool>("pow2_scale")      // round scales up to powers of two
        .Attr<float>("amax_floor"),    // lower bound of amax
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    Fp8AmaxCuda, Fp8AmaxCudaDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA compute stream
        .Arg<ffi::AnyBuffer>()                     // x, any shape: f32 / bf16 / f16
        .Ret<ffi::Buffer<ffi::F32>>(),             // amax []: largest finite |x|, 0 if none
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    Fp8QuantizeSplitTransposeCuda, Fp8QuantizeSplitTransposeCudaDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA compute stream
        .Arg<ffi::AnyBuffer>()                     // x [M, K]: f32 / bf16 / f16
        .Arg<ffi::Buffer<ffi::S32>>()              // group_sizes [E] (clamped on device)
        .Ret<ffi::AnyBuffer>()                     // data_t: float8 [K, SplitColumns(M, E)]
        .Ret<ffi::Buffer<ffi::F32>>()              // scale_t [K, SplitScaleColumns(M, E, G)]
        .Ret<ffi::Buffer<ffi::S32>>()              // col_offsets [E + 1]
        .Ret<ffi::Buffer<ffi::S32>>()              // scale_offsets [E + 1]
        .Attr<int32_t>("group")                    // G: 32, 64 or 128
        .Attr<bool>("pow2_scale")                  // round scales up to powers of two
        .Attr<float>("amax_floor"),                // lower bound of amax
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxops::fp8
