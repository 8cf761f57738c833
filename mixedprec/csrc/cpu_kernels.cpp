// C++ CPU kernels of mixedprec's multi-tensor ops. Each op takes lists of tensors and runs one
// at::parallel_for over fixed-size chunks of all of them, so the whole model is one parallel loop.
// Half and bf16 are converted to float for the arithmetic, which follows the pure-PyTorch references
// in mixedprec/ops.py operation by operation (product rounded to fp32 before any add: no FMA; the build
// passes -ffp-contract=off). The loops use ATen's Vectorized<float>, 2 vectors (16 elements with AVX2) at a time,
// then a scalar tail; the build enables AVX2/F16C when the CPU has them.
// ATen's own headers only, not <torch/extension.h> (the whole C++ API and Python), which took most of the compile time.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>
#include "messages.h"
#include "bf16_bits.h"
#include "state8_bits.h"

namespace mixedprec {

constexpr int64_t kChunk = 1 << 16;   // elements per work unit

struct Span { int64_t tensor, begin, end; };

// Work units of at most kChunk elements over every tensor of `ts`, in order.
static std::vector<Span> spans_of(const std::vector<at::Tensor>& ts) {
  std::vector<Span> res;
  for (int64_t i = 0; i < (int64_t)ts.size(); ++i)
    for (int64_t b = 0, n = ts[i].numel(); b < n; b += kChunk) res.push_back({i, b, std::min(n, b + kChunk)});
  return res;
}

// The bindings (mixedprec.cpp) check the tensor pairs for every device before they dispatch here, and that every tensor
// of a call is on the first tensor's device; the CPU kernels only need that device to be the CPU.
static void require_cpu(const std::vector<at::Tensor>& ts, const char* op) {
  TORCH_CHECK(ts.empty() || ts[0].device().is_cpu(), msg(op, ": the CPU kernels take CPU tensors, got ", ts[0].device()));
}

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kStep = 2 * Vec::size();

// Streaming (non-temporal) stores, for outputs larger than the caches: they write whole lines to memory without reading
// each line first (the read-for-ownership of a normal store) and without evicting what the next op reads. Smaller outputs
// are stored normally, so that they stay in the cache for the op that reads them next. Python sets the threshold
// (ops.stream_min_bytes: twice the last-level cache). Only the AVX2 and AVX-512 builds stream; portable code never does.
static std::atomic<int64_t> g_stream_min_bytes{int64_t(64) << 20};
int64_t stream_min_bytes(int64_t set) {
  if (set >= 0) g_stream_min_bytes.store(set);
  return g_stream_min_bytes.load();
}
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kCanStream = true;
// One vector register of T to p, which is aligned to the register's size.
template <typename T> static void stream_store(T* p, const at::vec::Vectorized<T>& v) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) _mm512_stream_ps(p, v); else _mm512_stream_si512(reinterpret_cast<__m512i*>(p), v);
#else
  if constexpr (std::is_same_v<T, float>) _mm256_stream_ps(p, v); else _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
#endif
}
// Streaming stores are weakly ordered: each thread fences its own before the op returns and others read them.
static void stream_fence() { _mm_sfence(); }
#else
constexpr bool kCanStream = false;
template <typename T> static void stream_store(T* p, const at::vec::Vectorized<T>& v) { v.store(p); }
static void stream_fence() {}
#endif
// Whether the outputs `ts` are large enough to stream.
static bool streams(const std::vector<at::Tensor>& ts) {
  int64_t bytes = 0;
  for (const auto& t : ts) bytes += t.numel() * (int64_t)t.element_size();
  return kCanStream && bytes >= g_stream_min_bytes.load();
}
// How many elements of p come before the first address a vector register can be streamed to (at most n).
template <typename D> static int64_t unaligned_head(const D* p, int64_t n) {
  const auto off = reinterpret_cast<uintptr_t>(p) % sizeof(Vec);
  if (off % sizeof(D)) return n;                           // an odd address for its type (from_blob): no aligned element, store normally
  return std::min<int64_t>(n, off ? (sizeof(Vec) - off) / sizeof(D) : 0);
}

// Load and store 2 float vectors' worth of elements of T, converting half and bf16 to and from float.
template <typename T> struct VecIO {
  static void load(const T* p, Vec& a, Vec& b) { auto ab = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(p)); a = std::get<0>(ab); b = std::get<1>(ab); }
  static void store(T* p, const Vec& a, const Vec& b) { at::vec::convert_from_float<T>(a, b).store(p); }
  static void stream(T* p, const Vec& a, const Vec& b) { stream_store(p, at::vec::convert_from_float<T>(a, b)); }   // p aligned (unaligned_head)
};
template <> struct VecIO<float> {
  static void load(const float* p, Vec& a, Vec& b) { a = Vec::loadu(p); b = Vec::loadu(p + Vec::size()); }
  static void store(float* p, const Vec& a, const Vec& b) { a.store(p); b.store(p + Vec::size()); }
  static void stream(float* p, const Vec& a, const Vec& b) { stream_store(p, a); stream_store(p + Vec::size(), b); }
};
template <typename T> constexpr bool vectorizable = !std::is_same_v<T, double>;

// True if any lane of `acc` (a sum of x - x terms, 0 for finite x) is nan.
static bool any_nan(const Vec& acc) {
  float lanes[Vec::size()];
  acc.store(lanes);
  for (int i = 0; i < Vec::size(); ++i) if (lanes[i] != lanes[i]) return true;
  return false;
}

// dst = src * scale (Add: dst + src * scale) over n elements, true if any src is not finite. Stream: the vector part
// writes with streaming stores from dst's first aligned element on (the elements before it are stored one by one).
// Without Store, only the check: an in-place multiply by 1, which has nothing to write.
template <typename S, typename D, bool Add, bool Stream, bool Store = true>
static bool scale_span(const S* src, D* dst, int64_t n, float scale) {
  bool bad = false;
  auto one_by_one = [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      float x = static_cast<float>(src[i]);
      bad |= !std::isfinite(x);
      if constexpr (!Store) continue;
      float prod = x * scale;                              // rounded to fp32 before the add, as the reference does
      if (Add) dst[i] = static_cast<D>(static_cast<float>(dst[i]) + prod);
      else dst[i] = static_cast<D>(prod);
    }
  };
  int64_t i = 0;
  if constexpr (vectorizable<S> && vectorizable<D>) {
    if constexpr (Stream) { i = unaligned_head(dst, n); one_by_one(0, i); }
    const Vec vs(scale);
    Vec acc(0.f);
    for (; i + kStep <= n; i += kStep) {
      Vec a, b;
      VecIO<S>::load(src + i, a, b);
      acc = acc + (a - a) + (b - b);
      if constexpr (!Store) continue;
      Vec pa = a * vs, pb = b * vs;
      if (Add) { Vec da, db; VecIO<D>::load(dst + i, da, db); pa = da + pa; pb = db + pb; }
      if constexpr (Stream) VecIO<D>::stream(dst + i, pa, pb);
      else VecIO<D>::store(dst + i, pa, pb);
    }
    bad |= any_nan(acc);
  }
  one_by_one(i, n);
  return bad;
}

template <bool Add>
static at::Tensor scale_impl(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale, const char* op) {
  require_cpu(src, op);
  auto spans = spans_of(src);
  std::atomic<bool> found{false};
  const float sc = static_cast<float>(scale);
  const bool stream = !Add && streams(dst);                // an added-to dst is read anyway: nothing to save
  at::parallel_for(0, (int64_t)spans.size(), 1, [&](int64_t b, int64_t e) {
    bool bad = false;
    for (int64_t k = b; k < e; ++k) {
      const Span& s = spans[k];
      const at::Tensor &in = src[s.tensor], &out = dst[s.tensor];
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, in.scalar_type(), "mixedprec_scale_src", [&] {
        using S = scalar_t;
        const S* ip = in.data_ptr<S>() + s.begin;
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "mixedprec_scale_dst", [&] {
          scalar_t* dp = out.data_ptr<scalar_t>() + s.begin;
          // in place by 1: a check (of grads whose unscale the step does), nothing written
          if (!Add && (const void*)ip == (const void*)dp && in.scalar_type() == out.scalar_type() && sc == 1.0f) {
            bad |= scale_span<S, scalar_t, false, false, false>(ip, dp, s.end - s.begin, sc);
            return;
          }
          if constexpr (!Add && kCanStream) {                 // in place (src is dst): each line is read anyway, stored normally
            if (stream && (const void*)ip != (const void*)dp) { bad |= scale_span<S, scalar_t, false, true>(ip, dp, s.end - s.begin, sc); return; }
          }
          bad |= scale_span<S, scalar_t, Add, false>(ip, dp, s.end - s.begin, sc);
        });
      });
    }
    if (stream) stream_fence();
    if (bad) found.store(true, std::memory_order_relaxed);
  });
  return at::scalar_tensor(found.load(), at::TensorOptions().dtype(at::kBool));
}

at::Tensor scale_check_cpu(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale) {
  return scale_impl<false>(src, dst, scale, "scale_check_");
}

at::Tensor scale_add_check_cpu(const std::vector<at::Tensor>& src, const std::vector<at::Tensor>& dst, double scale) {
  return scale_impl<true>(src, dst, scale, "scale_add_check_");
}

// Global and per-tensor L2 norms. Sums of squares are accumulated in double per chunk, and the chunk sums
// are added in a fixed order, so the result does not depend on the number of threads.
std::vector<at::Tensor> l2norm_cpu(const std::vector<at::Tensor>& ts) {
  for (size_t i = 0; i < ts.size(); ++i) {
    TORCH_CHECK(ts[i].device().is_cpu(), msg("l2norm: the CPU kernels take CPU tensors (tensor ", i, ")"));
    TORCH_CHECK(ts[i].is_non_overlapping_and_dense(), msg("l2norm: tensor ", i, " is not dense; call .contiguous() first"));
  }
  auto spans = spans_of(ts);
  std::vector<double> partial(spans.size(), 0.0);
  at::parallel_for(0, (int64_t)spans.size(), 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const Span& s = spans[k];
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ts[s.tensor].scalar_type(), "mixedprec_l2norm", [&] {
        const scalar_t* p = ts[s.tensor].data_ptr<scalar_t>() + s.begin;
        const int64_t n = s.end - s.begin;
        double acc = 0.0;
        int64_t i = 0;
        if constexpr (vectorizable<scalar_t>) {
          constexpr int64_t kBlock = 64 * kStep;              // float lanes summed over short blocks, the blocks in double
          // The span's two halves are read side by side: two streams in flight, where one core reading one stream waits on
          // memory (on a 2-core AVX2-only EPYC, 0.80-0.96 of a copy's bandwidth from one stream, 1.01-1.19 from two)
          const int64_t half = (n / 2) / kBlock * kBlock;
          for (; i < half; i += kBlock) {
            Vec sa(0.f), sb(0.f), sc(0.f), sd(0.f);
            for (int64_t j = i; j < i + kBlock; j += kStep) {
              Vec a, b, c, d;
              VecIO<scalar_t>::load(p + j, a, b);
              VecIO<scalar_t>::load(p + half + j, c, d);
              sa = sa + a * a; sb = sb + b * b; sc = sc + c * c; sd = sd + d * d;
            }
            float lanes[4 * Vec::size()];
            sa.store(lanes); sb.store(lanes + Vec::size()); sc.store(lanes + 2 * Vec::size()); sd.store(lanes + 3 * Vec::size());
            for (float l : lanes) acc += l;
          }
          i = 2 * half;
          for (; i + kBlock <= n; i += kBlock) {
            Vec sa(0.f), sb(0.f);
            for (int64_t j = i; j < i + kBlock; j += kStep) { Vec a, b; VecIO<scalar_t>::load(p + j, a, b); sa = sa + a * a; sb = sb + b * b; }
            float lanes[2 * Vec::size()];
            sa.store(lanes); sb.store(lanes + Vec::size());
            for (float l : lanes) acc += l;
          }
        }
        for (; i < n; ++i) { double x = static_cast<double>(static_cast<float>(p[i])); acc += x * x; }
        partial[k] = acc;
      });
    }
  });
  auto per = at::zeros({(int64_t)ts.size()}, at::TensorOptions().dtype(at::kFloat));
  float* pp = per.data_ptr<float>();
  std::vector<double> sq(ts.size(), 0.0);
  for (size_t k = 0; k < spans.size(); ++k) sq[spans[k].tensor] += partial[k];
  double total = 0.0;
  for (size_t i = 0; i < ts.size(); ++i) { pp[i] = static_cast<float>(std::sqrt(sq[i])); total += sq[i]; }
  return {at::scalar_tensor(static_cast<float>(std::sqrt(total)), at::TensorOptions().dtype(at::kFloat)), per};
}

// The half (or fp32) model copy of fp32 masters, rounded to nearest even; with streaming stores (`stream`) from o's first
// aligned element on.
template <typename O> static void copy_out(const float* p, O* o, int64_t n, bool stream) {
  int64_t i = 0;
  if constexpr (vectorizable<O>) {
    if (stream && kCanStream) {
      for (const int64_t head = unaligned_head(o, n); i < head; ++i) o[i] = static_cast<O>(p[i]);
      for (; i + kStep <= n; i += kStep) VecIO<O>::stream(o + i, Vec::loadu(p + i), Vec::loadu(p + i + Vec::size()));
    }
    for (; i + kStep <= n; i += kStep) VecIO<O>::store(o + i, Vec::loadu(p + i), Vec::loadu(p + i + Vec::size()));
  }
  for (; i < n; ++i) o[i] = static_cast<O>(p[i]);
}

// Before each update: an element of the half model copy `o` that is not its fp32 master's rounding (which every write of
// mixedprec leaves there) was edited through `.data` (a WGAN critic's clamp), and its value becomes the master.
template <typename O> static void adopt_edits(float* p, const O* o, int64_t n) {
  int64_t i = 0;
  if constexpr (vectorizable<O>) {
    for (; i + kStep <= n; i += kStep) {
      Vec pv[2], ov[2], rv[2];
      VecIO<float>::load(p + i, pv[0], pv[1]);
      VecIO<O>::load(o + i, ov[0], ov[1]);
      if constexpr (std::is_same_v<O, float>) { rv[0] = pv[0]; rv[1] = pv[1]; }
      else {
        auto r = at::vec::convert_to_float<O>(at::vec::convert_from_float<O>(pv[0], pv[1]));
        rv[0] = std::get<0>(r); rv[1] = std::get<1>(r);
      }
      for (int h = 0; h < 2; ++h) Vec::blendv(ov[h], pv[h], rv[h] == ov[h]).store(p + i + h * Vec::size());
    }
  }
  for (; i < n; ++i) {
    const float edited = static_cast<float>(o[i]);
    if (static_cast<float>(static_cast<O>(p[i])) != edited) p[i] = edited;
  }
}

// Where the kernels find each master: an fp32 tensor (with an optional half model copy written in the same pass), or a bf16
// model param that is its own master, with its int16 low halves (split) or rounded stochastically (bf16_bits.h).
struct MasterStore {
  const std::vector<at::Tensor>& params;
  const std::vector<at::Tensor>& out;        // the half model copy of fp32 masters, or empty
  const std::vector<at::Tensor>& lows;       // split: the int16 low halves of bf16 params
  const int64_t* seeds;                      // stochastic rounding: one seed per tensor (bf16 params without lows)
  bool stream_out;                           // the half copy is written with streaming stores (streams(out))
  bool bf16() const { return !params.empty() && params[0].scalar_type() == at::kBFloat16; }
};

constexpr int64_t kBlock = 1024;              // elements of a bf16 master materialised in fp32 at a time (a multiple of kStep)

// Stochastic rounding of a block of n <= kBlock elements starting at element `first` of its tensor, as rounding_bits and
// round_stochastic (bf16_bits.h) compute it, with the key taken out of the loop: a block never crosses a multiple of 2^32
// elements, so the index's high half is one number and the loop vectorises in 32-bit lanes.
static void round_block_stochastic(const float* __restrict buf, uint16_t* __restrict out, int64_t n, uint64_t seed, uint64_t first) {
  const uint32_t key_lo = (uint32_t)seed, key_hi = (uint32_t)(seed >> 32) ^ (uint32_t)(first >> 32), base = (uint32_t)first;
  for (int64_t i = 0; i < n; ++i) out[i] = round_stochastic(buf[i], rounding_bits32(base + (uint32_t)i, key_lo, key_hi));
}

// The optimizer state of a step: up to two lists of fp32 tensors, or of bf16 tensors rounded stochastically on the way
// back with one seed per tensor and list (`seeds[tensor * lists + list]`, bf16_bits.h), or of 8-bit codes with their
// per-block scales (`scales[list * tensors + tensor]`; list 0 signed int8, list 1 unsigned uint8; state8_bits.h), rounded alike.
struct StateStore {
  std::vector<const std::vector<at::Tensor>*> lists;
  const int64_t* seeds;                      // bf16 and 8-bit state only
  const std::vector<at::Tensor>& scales;     // 8-bit state only
  at::ScalarType type() const { return !lists.empty() && !lists[0]->empty() ? (*lists[0])[0].scalar_type() : at::kFloat; }
  bool lean() const { return type() != at::kFloat; }
};

// Decode n <= kBlock elements of 8-bit state starting at a multiple of kQBlock of its tensor into fp32 (state8_bits.h).
template <bool Signed> static void decode_block8(const uint8_t* __restrict codes, const float* __restrict scales, float* __restrict out, int64_t n) {
  for (int64_t q = 0; q < n; q += kQBlock) {
    const int64_t e = std::min(n, q + kQBlock);
    const float sc = scales[q / kQBlock];
    for (int64_t i = q; i < e; ++i) out[i] = q8_decode(codes[i], sc, Signed);
  }
}

// Quantise a block of n <= kBlock fp32 state elements starting at element `first` (a multiple of kQBlock) of its
// tensor into 8-bit codes and one scale per kQBlock elements (state8_bits.h), rounded with the same random bits as
// round_block_stochastic. Each loop is branch-free, so that it vectorises.
template <bool Signed> static void encode_block8(const float* __restrict buf, uint8_t* __restrict codes, float* __restrict scales, int64_t n,
                                                 uint64_t seed, uint64_t first) {
  const uint32_t key_lo = (uint32_t)seed, key_hi = (uint32_t)(seed >> 32) ^ (uint32_t)(first >> 32), base = (uint32_t)first;
  for (int64_t q = 0; q < n; q += kQBlock) {
    const int64_t e = std::min(n, q + kQBlock);
    uint32_t most = 0;
    for (int64_t i = q; i < e; ++i) most = std::max(most, float_bits(buf[i]) & 0x7fffffffu);
    const float sc = q8_scale(most);
    scales[q / kQBlock] = sc;
    const uint32_t se = float_bits(sc) >> 23;
    if (!q8_coded(se)) { std::fill(codes + q, codes + e, uint8_t{0}); continue; }
    uint32_t wide[kQBlock];                   // the codes in 32-bit lanes, then narrowed: each loop vectorises cleanly
    for (int64_t i = q; i < e; ++i)
      wide[i - q] = q8_code(buf[i], se, rounding_bits32(base + (uint32_t)i, key_lo, key_hi), Signed);
    for (int64_t i = q; i < e; ++i) codes[i] = (uint8_t)wide[i - q];
  }
}

// Run `update(p, states, begin, n)` on fp32 masters and fp32 state over each span of tensor `s.tensor` (states[j]: list
// j's elements begin..begin+n-1): on the tensors themselves (then write the half copy), or, when the masters or the
// state are bf16 (or 8-bit), on block-sized fp32 buffers joined from them and split (or rounded) back after the update.
template <typename Update>
static void on_masters(const MasterStore& st, const StateStore& ss, const Span& s, Update update) {
  const int64_t t = s.tensor;
  const int k = (int)ss.lists.size();
  float* direct[2] = {nullptr, nullptr};
  if (!st.bf16() && !ss.lean()) {
    float* p = st.params[t].data_ptr<float>() + s.begin;
    for (int j = 0; j < k; ++j) direct[j] = (*ss.lists[j])[t].data_ptr<float>() + s.begin;
    if (st.out.empty()) { update(p, direct, s.begin, s.end - s.begin); return; }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st.out[t].scalar_type(), "mixedprec_step_out", [&] {
      scalar_t* o = st.out[t].data_ptr<scalar_t>() + s.begin;
      for (int64_t b = 0; b < s.end - s.begin; b += kBlock) {     // in blocks, so the copy is still in the cache for its update
        const int64_t n = std::min(kBlock, s.end - s.begin - b);
        float* states[2] = {direct[0] ? direct[0] + b : nullptr, direct[1] ? direct[1] + b : nullptr};
        adopt_edits(p + b, o + b, n);
        update(p + b, states, s.begin + b, n);
        copy_out(p + b, o + b, n, st.stream_out);
      }
    });
    return;
  }
  uint16_t* hi = st.bf16() ? reinterpret_cast<uint16_t*>(st.params[t].data_ptr<at::BFloat16>()) : nullptr;
  float* fp = st.bf16() ? nullptr : st.params[t].data_ptr<float>();
  int16_t* lo = st.lows.empty() ? nullptr : st.lows[t].data_ptr<int16_t>();
  const uint64_t seed = st.seeds ? (uint64_t)st.seeds[t] : 0;
  const bool q8 = ss.type() == at::kChar;
  uint16_t* sbits[2] = {nullptr, nullptr};
  uint8_t* codes[2] = {nullptr, nullptr};
  float* scales[2] = {nullptr, nullptr};
  for (int j = 0; j < k; ++j) {
    const at::Tensor& x = (*ss.lists[j])[t];
    if (q8) { codes[j] = static_cast<uint8_t*>(x.data_ptr()); scales[j] = ss.scales[j * ss.lists[j]->size() + t].data_ptr<float>(); }
    else if (ss.lean()) sbits[j] = reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>());
    else direct[j] = x.data_ptr<float>();
  }
  float buf[kBlock], sbuf[2][kBlock];
  for (int64_t b = s.begin; b < s.end; b += kBlock) {
    const int64_t n = std::min(kBlock, s.end - b);
    float* p = fp ? fp + b : buf;
    if (fp && !st.out.empty()) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st.out[t].scalar_type(), "mixedprec_step_adopt", [&] {
        adopt_edits(p, st.out[t].data_ptr<scalar_t>() + b, n);
      });
    }
    if (hi && lo) for (int64_t i = 0; i < n; ++i) buf[i] = join_bf16(hi[b + i], lo[b + i]);
    else if (hi) for (int64_t i = 0; i < n; ++i) buf[i] = bits_float((uint32_t)hi[b + i] << 16);
    float* states[2] = {nullptr, nullptr};
    for (int j = 0; j < k; ++j) {
      if (direct[j]) { states[j] = direct[j] + b; continue; }
      if (codes[j] && j == 0) decode_block8<true>(codes[j] + b, scales[j] + b / kQBlock, sbuf[j], n);
      else if (codes[j]) decode_block8<false>(codes[j] + b, scales[j] + b / kQBlock, sbuf[j], n);
      else for (int64_t i = 0; i < n; ++i) sbuf[j][i] = bits_float((uint32_t)sbits[j][b + i] << 16);
      states[j] = sbuf[j];
    }
    update(p, states, b, n);
    if (hi && lo) for (int64_t i = 0; i < n; ++i) split_bf16(buf[i], hi[b + i], lo[b + i]);
    else if (hi) round_block_stochastic(buf, hi + b, n, seed, (uint64_t)b);
    else if (!st.out.empty()) {
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st.out[t].scalar_type(), "mixedprec_step_out", [&] {
        copy_out(p, st.out[t].data_ptr<scalar_t>() + b, n, st.stream_out);
      });
    }
    for (int j = 0; j < k; ++j) {
      if (codes[j] && j == 0) encode_block8<true>(sbuf[j], codes[j] + b, scales[j] + b / kQBlock, n, (uint64_t)ss.seeds[t * k + j], (uint64_t)b);
      else if (codes[j]) encode_block8<false>(sbuf[j], codes[j] + b, scales[j] + b / kQBlock, n, (uint64_t)ss.seeds[t * k + j], (uint64_t)b);
      else if (sbits[j]) round_block_stochastic(sbuf[j], sbits[j] + b, n, (uint64_t)ss.seeds[t * k + j], (uint64_t)b);
    }
  }
}

static const int64_t* seeds_of(const std::optional<at::Tensor>& seeds) {
  return seeds.has_value() && seeds->defined() ? seeds->data_ptr<int64_t>() : nullptr;
}

// SGD on fp32 masters from (half) grads times `inv_scale`, as torch.optim.SGD computes it (L2 weight decay), or with
// decoupled weight decay (`decoupled`: the param times 1 - lr*wd first, as fastai's SGD); writes the half model copy in the same pass. Does nothing when `found_inf` is set.
void sgd_step_cpu(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& bufs,
                  const std::vector<at::Tensor>& out, const at::Tensor& found_inf, double inv_scale, double lr, double momentum,
                  double dampening, double weight_decay, bool nesterov, bool first_run, bool decoupled,
                  const std::vector<at::Tensor>& lows, const std::optional<at::Tensor>& seeds, const std::optional<at::Tensor>& state_seeds,
                  const std::vector<at::Tensor>& state_scales) {
  require_cpu(params, "sgd_step");
  if (found_inf.item<bool>()) return;
  auto spans = spans_of(params);
  const MasterStore store{params, out, lows, seeds_of(seeds), streams(out)};
  const StateStore states{!bufs.empty() ? std::vector<const std::vector<at::Tensor>*>{&bufs} : std::vector<const std::vector<at::Tensor>*>{},
                          seeds_of(state_seeds), state_scales};
  const float isc = inv_scale, flr = lr, mom = momentum, damp = 1.0 - dampening;
  const float wd = decoupled ? 0.0f : (float)weight_decay, decay = decoupled ? 1.0 - lr * weight_decay : 1.0f;
  at::parallel_for(0, (int64_t)spans.size(), 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const Span& s = spans[k];
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grads[s.tensor].scalar_type(), "mixedprec_sgd", [&] {
        on_masters(store, states, s, [&](float* p, float* const* st, int64_t begin, int64_t n) {
          const scalar_t* g = grads[s.tensor].data_ptr<scalar_t>() + begin;
          float* m = !bufs.empty() ? st[0] : nullptr;
          int64_t i = 0;
          if constexpr (vectorizable<scalar_t>) {
            const Vec visc(isc), vwd(wd), vmom(mom), vdamp(damp), vlr(flr), vdecay(decay);
            for (; i + kStep <= n; i += kStep) {
              Vec gv[2];
              VecIO<scalar_t>::load(g + i, gv[0], gv[1]);
              for (int h = 0; h < 2; ++h) {
                float* ph = p + i + h * Vec::size();
                Vec pv = Vec::loadu(ph), gi = gv[h] * visc;
                if (wd != 0) gi = gi + vwd * pv;
                if (m) {
                  float* mh = m + i + h * Vec::size();
                  Vec mv = first_run ? gi : Vec::loadu(mh) * vmom + vdamp * gi;
                  mv.store(mh);
                  gi = nesterov ? gi + vmom * mv : mv;
                }
                if (decoupled) pv = pv * vdecay;
                (pv - vlr * gi).store(ph);
              }
            }
          }
          for (; i < n; ++i) {
            float gi = static_cast<float>(g[i]) * isc;
            if (wd != 0) gi = gi + wd * p[i];
            if (m) {
              m[i] = first_run ? gi : m[i] * mom + damp * gi;
              gi = nesterov ? gi + mom * m[i] : m[i];
            }
            if (decoupled) p[i] = p[i] * decay;
            p[i] = p[i] - flr * gi;
          }
        });
      });
    }
    if (store.stream_out) stream_fence();
  });
}

// Adam (L2 weight decay) or AdamW (decoupled) on fp32 masters, as torch.optim.Adam/AdamW compute them. `steps[i]` is
// tensor i's fp32 step count before this step (torch keeps it as a 0-dim tensor in the state); the caller advances it afterwards.
void adam_step_cpu(const std::vector<at::Tensor>& grads, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& exp_avgs,
                   const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<at::Tensor>& out, const at::Tensor& found_inf,
                   const std::vector<at::Tensor>& steps, double inv_scale, double lr, double beta1, double beta2, double eps,
                   double weight_decay, bool decoupled, const std::vector<at::Tensor>& lows, const std::optional<at::Tensor>& seeds,
                   const std::optional<at::Tensor>& state_seeds, const std::vector<at::Tensor>& state_scales) {
  require_cpu(params, "adam_step");
  if (found_inf.item<bool>()) return;
  std::vector<float> step_size(params.size()), bc2_sqrt(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const double t = *steps[i].data_ptr<float>() + 1.0;    // this step's count (a CPU fp32 scalar: read, not dispatched)
    step_size[i] = lr / (1.0 - std::pow(beta1, t));
    bc2_sqrt[i] = std::sqrt(1.0 - std::pow(beta2, t));
  }
  auto spans = spans_of(params);
  const MasterStore store{params, out, lows, seeds_of(seeds), streams(out)};
  const StateStore states{{&exp_avgs, &exp_avg_sqs}, seeds_of(state_seeds), state_scales};
  const float isc = inv_scale, b1 = 1.0 - beta1, b2 = beta2, omb2 = 1.0 - beta2, fe = eps;
  const float decay = decoupled ? 1.0 - lr * weight_decay : 1.0f, l2 = decoupled ? 0.0f : (float)weight_decay;
  at::parallel_for(0, (int64_t)spans.size(), 1, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const Span& s = spans[k];
      const float ss = step_size[s.tensor], bc = bc2_sqrt[s.tensor];
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grads[s.tensor].scalar_type(), "mixedprec_adam", [&] {
        on_masters(store, states, s, [&](float* p, float* const* st, int64_t begin, int64_t n) {
          const scalar_t* g = grads[s.tensor].data_ptr<scalar_t>() + begin;
          float* m = st[0];
          float* v = st[1];
          int64_t i = 0;
          if constexpr (vectorizable<scalar_t>) {
            const Vec visc(isc), vdecay(decay), vl2(l2), vb1(b1), vb2(b2), vomb2(omb2), vbc(bc), veps(fe), vss(ss);
            for (; i + kStep <= n; i += kStep) {
              Vec gv[2];
              VecIO<scalar_t>::load(g + i, gv[0], gv[1]);
              for (int h = 0; h < 2; ++h) {
                const int64_t o = i + h * Vec::size();
                Vec pv = Vec::loadu(p + o), mv = Vec::loadu(m + o), vv = Vec::loadu(v + o), gi = gv[h] * visc;
                if (decoupled) pv = pv * vdecay;
                else if (l2 != 0) gi = gi + vl2 * pv;
                mv = mv + vb1 * (gi - mv);
                vv = vv * vb2 + vomb2 * gi * gi;
                Vec denom = vv.sqrt() / vbc + veps;
                pv = pv - vss * (mv / denom);
                pv.store(p + o); mv.store(m + o); vv.store(v + o);
              }
            }
          }
          for (; i < n; ++i) {
            float gi = static_cast<float>(g[i]) * isc;
            if (decoupled) p[i] = p[i] * decay;
            else if (l2 != 0) gi = gi + l2 * p[i];
            m[i] = m[i] + b1 * (gi - m[i]);
            v[i] = v[i] * b2 + omb2 * gi * gi;
            float denom = std::sqrt(v[i]) / bc + fe;
            p[i] = p[i] - ss * (m[i] / denom);
          }
        });
      });
    }
    if (store.stream_out) stream_fence();
  });
}

}  // namespace mixedprec
