// CUDA handlers of the MoE token permutation family: route (the permuted layout of moe.h),
// permute, unpermute and the unpermute backward. The kernels and their designs live in
// kernels.cuh, the layout arithmetic in moe.h and the contracts in checks.h; route and permute
// give the CPU handlers' (cpu.cc) results bit for bit.
//
// Three layers, as in jax's examples/ffi:
//   1. Kernels: the route kernels over int32 indices, the permute kernel over the word it moves
//      rows with (raw bytes), and the unpermute kernels over T (the float dtype) and kVec
//      (elements per access: 16 bytes of T, or 1 for the scalar fallback): kernels.cuh.
//   2. Implementations (RouteImpl, PermuteImpl, UnpermuteTyped<T>, UnpermuteBwdTyped<T>) that
//      pick the access width, launch on the XLA stream and turn launch failures into errors.
//   3. One dispatch per handler: validates with checks.h, then switches once on the dtype.
//
// Nothing synchronizes with the host: every count stays on the device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "xla_ffi/common/cuda_util.cuh"
#include "xla_ffi/common/cuda_vec.cuh"
#include "xla_ffi/common/ffi_util.h"
#include "xla_ffi/common/math.h"
#include "xla_ffi/moe/checks.h"
#include "xla_ffi/moe/handlers.h"
#include "xla_ffi/moe/kernels.cuh"
#include "xla_ffi/moe/moe.h"

namespace jaxops::moe {
namespace {

// ---------------------------------------------------------------------------------------------
// Implementations: launch configuration and launches.

// CTA size of a row kernel for rows of `accesses` accesses: up to kRowUnroll accesses per thread.
int RowThreads(int64_t accesses) {
  return static_cast<int>(std::clamp<int64_t>(NextPowerOfTwo(CeilDiv(accesses, kRowUnroll)),
                                              kMinRowThreads, kMaxRowThreads));
}

ffi::Error RouteImpl(cudaStream_t stream, const RouteShape& s, const RouteArgs& a) {
  if (auto e = FillAsync("moe route: filling source with -1", a.source, 0xff,
                         s.rows * static_cast<int64_t>(sizeof(int32_t)), stream);
      e.failure()) {
    return e;
  }
  // chunks >= 1 and experts >= 1 (CheckRoute): the first three kernels always have work.
  const unsigned walk_ctas = GridCtas(s.chunks, kRouteWarps);
  MoeRouteCountKernel<<<walk_ctas, kRouteThreads, 0, stream>>>(a);
  if (auto e = LastLaunchError("moe route count kernel"); e.failure()) return e;
  // Experts per prefix CTA: all of them up to a warp's width.
  const int width = static_cast<int>(std::min<int64_t>(kWarpSize, NextPowerOfTwo(s.experts)));
  MoeRouteChunkPrefixKernel<<<GridCtas(s.experts, width), kPrefixThreads, 0, stream>>>(a, width);
  if (auto e = LastLaunchError("moe route chunk prefix kernel"); e.failure()) return e;
  MoeRouteOffsetsKernel<<<1, kScanThreads, 0, stream>>>(a);
  if (auto e = LastLaunchError("moe route offsets kernel"); e.failure()) return e;
  if (s.slots == 0) return ffi::Error::Success();
  MoeRoutePlaceKernel<<<walk_ctas, kRouteThreads, 0, stream>>>(a);
  return LastLaunchError("moe route place kernel");
}

template <typename Word>
ffi::Error LaunchPermute(cudaStream_t stream, PermuteArgs a, int64_t row_bytes) {
  a.row_words = row_bytes / static_cast<int64_t>(sizeof(Word));
  const int threads = RowThreads(std::max(a.row_words, a.scale_columns));
  MoePermuteKernel<Word><<<GridCtas(a.rows, 1), threads, 0, stream>>>(a);
  return LastLaunchError("moe permute kernel");
}

// Moves rows of row_bytes bytes with the widest word that the row length and both base pointers
// allow.
ffi::Error PermuteImpl(cudaStream_t stream, const PermuteArgs& a, int64_t row_bytes) {
  if (a.rows == 0) return ffi::Error::Success();
  auto fits = [&](int64_t bytes) {
    return row_bytes % bytes == 0 && IsAligned(a.tokens, static_cast<uintptr_t>(bytes)) &&
           IsAligned(a.out, static_cast<uintptr_t>(bytes));
  };
  if (fits(16)) return LaunchPermute<uint4>(stream, a, row_bytes);
  if (fits(8)) return LaunchPermute<uint2>(stream, a, row_bytes);
  if (fits(4)) return LaunchPermute<unsigned int>(stream, a, row_bytes);
  if (fits(2)) return LaunchPermute<unsigned short>(stream, a, row_bytes);
  return LaunchPermute<unsigned char>(stream, a, row_bytes);
}

// Launches an unpermute kernel, one CTA per row of `hidden` elements of T (grid-stride over
// `rows` rows): vector_kernel (16-byte accesses) when `vectorized`, else scalar_kernel.
template <typename T, typename Args>
ffi::Error LaunchRowKernel(void (*vector_kernel)(Args), void (*scalar_kernel)(Args),
                           bool vectorized, int64_t rows, int64_t hidden, const Args& a,
                           cudaStream_t stream, const char* what) {
  if (vectorized) {
    vector_kernel<<<GridCtas(rows, 1), RowThreads(hidden / kVecElems<T>), 0, stream>>>(a);
  } else {
    scalar_kernel<<<GridCtas(rows, 1), RowThreads(hidden), 0, stream>>>(a);
  }
  return LastLaunchError(what);
}

template <typename T>
ffi::Error UnpermuteTyped(cudaStream_t stream, const UnpermuteArgs<T>& a) {
  if (a.tokens == 0 || a.hidden == 0) return ffi::Error::Success();  // out is empty
  return LaunchRowKernel<T>(MoeUnpermuteKernel<kVecElems<T>, T>, MoeUnpermuteKernel<1, T>,
                            Vectorizable<T>(a.hidden, {a.expert_out, a.out}), a.tokens, a.hidden, a,
                            stream, "moe unpermute kernel");
}

template <typename T>
ffi::Error UnpermuteBwdTyped(cudaStream_t stream, const UnpermuteBwdArgs<T>& a) {
  // Slots that no row holds keep d_probs = 0 (with hidden == 0 every dot product is 0, too).
  if (auto e = FillAsync("moe unpermute_bwd: zeroing d_probs", a.d_probs, 0,
                         a.slots * static_cast<int64_t>(sizeof(float)), stream);
      e.failure()) {
    return e;
  }
  if (a.rows == 0 || a.hidden == 0) return ffi::Error::Success();  // d_expert is empty
  return LaunchRowKernel<T>(MoeUnpermuteBwdKernel<kVecElems<T>, T>, MoeUnpermuteBwdKernel<1, T>,
                            Vectorizable<T>(a.hidden, {a.d_out, a.expert_out, a.d_expert}), a.rows,
                            a.hidden, a, stream, "moe unpermute_bwd kernel");
}

// ---------------------------------------------------------------------------------------------
// Dispatch.

// The permute's one dtype switch: the bytes of a token element (rows are moved as raw bytes).
ffi::Error TokenElementBytes(ffi::DataType dtype, int64_t* bytes) {
  switch (dtype) {
    case ffi::DataType::F32:
      *bytes = 4;
      return ffi::Error::Success();
    case ffi::DataType::BF16:
    case ffi::DataType::F16:
      *bytes = 2;
      return ffi::Error::Success();
    case ffi::DataType::F8E4M3FN:
    case ffi::DataType::F8E5M2:
      *bytes = 1;
      return ffi::Error::Success();
    default:
      return InvalidArgument(
          std::string("moe permute: tokens dtype must be float32, bfloat16, float16, "
                      "float8_e4m3fn or float8_e5m2, got ") +
          DataTypeName(dtype));
  }
}

ffi::Error MoeRouteCudaDispatch(
    cudaStream_t stream, ffi::Buffer<ffi::S32> ids, ffi::Result<ffi::Buffer<ffi::S32>> row_map,
    ffi::Result<ffi::Buffer<ffi::S32>> source, ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
    ffi::Result<ffi::Buffer<ffi::S32>> group_offsets, ffi::Result<ffi::Buffer<ffi::S32>> num_rows,
    ffi::Result<ffi::Buffer<ffi::S32>> dropped, ffi::Result<ffi::Buffer<ffi::S32>> workspace,
    int64_t align, int64_t capacity) {
  const auto shape = CheckRoute(ids, *row_map, static_cast<int64_t>(source->element_count()),
                                static_cast<int64_t>(group_sizes->element_count()),
                                static_cast<int64_t>(group_offsets->element_count()),
                                static_cast<int64_t>(num_rows->element_count()),
                                static_cast<int64_t>(dropped->element_count()),
                                static_cast<int64_t>(workspace->element_count()), align, capacity);
  if (shape.has_error()) return shape.error();
  RouteArgs a;
  a.ids = ids.typed_data();
  a.row_map = row_map->typed_data();
  a.source = source->typed_data();
  a.group_sizes = group_sizes->typed_data();
  a.group_offsets = group_offsets->typed_data();
  a.num_rows = num_rows->typed_data();
  a.dropped = dropped->typed_data();
  a.workspace = workspace->typed_data();
  a.slots = shape->slots;
  a.experts = shape->experts;
  a.chunks = shape->chunks;
  a.chunk_slots = shape->chunk_slots;
  a.align = shape->align;
  a.capacity = shape->capacity;
  return RouteImpl(stream, *shape, a);
}

ffi::Error MoePermuteCudaDispatch(cudaStream_t stream, ffi::AnyBuffer tokens,
                                  ffi::Buffer<ffi::S32> source, ffi::Buffer<ffi::S32> row_map,
                                  ffi::AnyBuffer scales, ffi::Buffer<ffi::F32> probs,
                                  ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::AnyBuffer> out_scales,
                                  ffi::Result<ffi::Buffer<ffi::F32>> out_probs) {
  const auto shape = CheckPermute(tokens, static_cast<int64_t>(source.element_count()), row_map,
                                  scales, static_cast<int64_t>(probs.element_count()), *out,
                                  *out_scales, static_cast<int64_t>(out_probs->element_count()));
  if (shape.has_error()) return shape.error();
  int64_t element_bytes = 0;
  if (auto e = TokenElementBytes(tokens.element_type(), &element_bytes); e.failure()) return e;
  PermuteArgs a;
  a.tokens = tokens.untyped_data();
  a.source = source.typed_data();
  a.row_map = row_map.typed_data();
  a.scales = shape->has_scales ? static_cast<const float*>(scales.untyped_data()) : nullptr;
  a.probs = shape->has_probs ? probs.typed_data() : nullptr;
  a.out = out->untyped_data();
  a.out_scales = shape->has_scales ? static_cast<float*>(out_scales->untyped_data()) : nullptr;
  a.out_probs = shape->has_probs ? out_probs->typed_data() : nullptr;
  a.rows = shape->rows;
  a.slots = shape->tokens * shape->top_k;
  a.top_k = shape->top_k;
  a.scale_columns = shape->has_scales ? shape->scale_columns : 0;
  return PermuteImpl(stream, a, shape->hidden * element_bytes);
}

ffi::Error MoeUnpermuteCudaDispatch(cudaStream_t stream, ffi::AnyBuffer expert_out,
                                    ffi::Buffer<ffi::S32> row_map, ffi::Buffer<ffi::F32> probs,
                                    ffi::Result<ffi::AnyBuffer> out) {
  const auto shape =
      CheckUnpermute(expert_out, row_map, static_cast<int64_t>(probs.element_count()), *out);
  if (shape.has_error()) return shape.error();
  return DispatchFloat("moe unpermute", "expert_out", expert_out.element_type(),
                       [&](auto tag) -> ffi::Error {
                         using T = typename decltype(tag)::type;
                         UnpermuteArgs<T> a;
                         a.expert_out = static_cast<const T*>(expert_out.untyped_data());
                         a.row_map = row_map.typed_data();
                         a.probs = shape->has_probs ? probs.typed_data() : nullptr;
                         a.out = static_cast<T*>(out->untyped_data());
                         a.tokens = shape->tokens;
                         a.top_k = shape->top_k;
                         a.rows = shape->rows;
                         a.hidden = shape->hidden;
                         return UnpermuteTyped(stream, a);
                       });
}

ffi::Error MoeUnpermuteBwdCudaDispatch(cudaStream_t stream, ffi::AnyBuffer d_out,
                                       ffi::AnyBuffer expert_out, ffi::Buffer<ffi::S32> source,
                                       ffi::Buffer<ffi::F32> probs,
                                       ffi::Result<ffi::AnyBuffer> d_expert,
                                       ffi::Result<ffi::Buffer<ffi::F32>> d_probs) {
  const auto shape = CheckUnpermuteBwd(
      d_out, expert_out, static_cast<int64_t>(source.element_count()), probs, *d_expert, *d_probs);
  if (shape.has_error()) return shape.error();
  return DispatchFloat("moe unpermute_bwd", "d_out", d_out.element_type(),
                       [&](auto tag) -> ffi::Error {
                         using T = typename decltype(tag)::type;
                         UnpermuteBwdArgs<T> a;
                         a.d_out = static_cast<const T*>(d_out.untyped_data());
                         a.expert_out = static_cast<const T*>(expert_out.untyped_data());
                         a.source = source.typed_data();
                         a.probs = probs.typed_data();
                         a.d_expert = static_cast<T*>(d_expert->untyped_data());
                         a.d_probs = d_probs->typed_data();
                         a.slots = shape->tokens * shape->top_k;
                         a.top_k = shape->top_k;
                         a.rows = shape->rows;
                         a.hidden = shape->hidden;
                         return UnpermuteBwdTyped(stream, a);
                       });
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Handler symbols (see handlers.h).

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeRouteCuda, MoeRouteCudaDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA compute stream
        .Arg<ffi::Buffer<ffi::S32>>()              // expert_ids [T, K]
        .Ret<ffi::Buffer<ffi::S32>>()              // row_map [T, K]
        .Ret<ffi::Buffer<ffi::S32>>()              // source [R]
        .Ret<ffi::Buffer<ffi::S32>>()              // group_sizes [E]
        .Ret<ffi::Buffer<ffi::S32>>()              // group_offsets [E+1]
        .Ret<ffi::Buffer<ffi::S32>>()              // num_rows []
        .Ret<ffi::Buffer<ffi::S32>>()              // dropped [E]
        .Ret<ffi::Buffer<ffi::S32>>()              // workspace [C, E]: per-chunk counts
        .Attr<int64_t>("align")                    // group row multiple
        .Attr<int64_t>("capacity"),                // slots/expert or -1
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoePermuteCuda, MoePermuteCudaDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA compute stream
        .Arg<ffi::AnyBuffer>()                     // tokens [T, H]
        .Arg<ffi::Buffer<ffi::S32>>()              // source [R]
        .Arg<ffi::Buffer<ffi::S32>>()              // row_map [T, K]
        .Arg<ffi::AnyBuffer>()                     // scales f32 [T, S] | [0]
        .Arg<ffi::Buffer<ffi::F32>>()              // probs [T, K] | [0]
        .Ret<ffi::AnyBuffer>()                     // out [R, H]
        .Ret<ffi::AnyBuffer>()                     // out_scales [R, S] | [0]
        .Ret<ffi::Buffer<ffi::F32>>(),             // out_probs [R] | [0]
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeUnpermuteCuda, MoeUnpermuteCudaDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA compute stream
        .Arg<ffi::AnyBuffer>()                     // expert_out [R, H]
        .Arg<ffi::Buffer<ffi::S32>>()              // row_map [T, K]
        .Arg<ffi::Buffer<ffi::F32>>()              // probs [T, K] | [0]
        .Ret<ffi::AnyBuffer>(),                    // out [T, H]
    {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    MoeUnpermuteBwdCuda, MoeUnpermuteBwdCudaDispatch,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream: the XLA compute stream
        .Arg<ffi::AnyBuffer>()                     // d_out [T, H]
        .Arg<ffi::AnyBuffer>()                     // expert_out [R, H]
        .Arg<ffi::Buffer<ffi::S32>>()              // source [R]
        .Arg<ffi::Buffer<ffi::F32>>()              // probs [T, K]
        .Ret<ffi::AnyBuffer>()                     // d_expert [R, H]
        .Ret<ffi::Buffer<ffi::F32>>(),             // d_probs [T, K]
    {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxops::moe
