// Fused SGD and Adam/AdamW steps on a multi-tensor grid (multi_tensor.h): read the (half) grads, unscale, update the
// master and its state, write the half model copy. When the overflow flag is set every block returns at once: the skip
// is decided on the device, with no host sync (the caller advances Adam's step counts by 1 - flag, on the device too).
#pragma once
#include "multi_tensor.h"
#include "state8_bits.h"
#include "kernel_keys.h"

namespace mixedprec {

// How a functor finds each master (bf16_bits.h): an fp32 param (and its optional half copy in the `out` list), a bf16
// param with its int16 low halves in the `out` list's place (split), or a bf16 param rounded stochastically.
enum MasterMode { kFp32 = 0, kSplit = 1, kStochastic = 2 };

// The param list's element: the fp32 master itself, or the raw bits of a bf16 param.
template <int Mode> using ParamBits = std::conditional_t<Mode == kFp32, float, uint16_t>;

// The fp32 masters of elements i..i+W-1. With a half model copy `o`, an element of o that is not its master's rounding
// (which every write of mixedprec leaves there) was edited through `.data` (a WGAN critic's clamp): o's value becomes
// the master. Split and stochastic bf16 masters need no such read: the bf16 param is their high half.
template <int Mode, int W, typename O>
MIXEDPREC_HD void load_masters(const ParamBits<Mode>* p, const int16_t* lo, const O* o, int64_t i, float (&x)[W]) {
  ParamBits<Mode> bits[W];
  load<W>(p, i, bits);
  if constexpr (Mode == kFp32) {
    MIXEDPREC_UNROLL for (int j = 0; j < W; ++j) x[j] = bits[j];
    if (o) {
      O half[W];
      load<W>(o, i, half);
      MIXEDPREC_UNROLL for (int j = 0; j < W; ++j) {
        const float edited = to_float(half[j]);
        if (to_float(static_cast<O>(x[j])) != edited) x[j] = edited;
      }
    }
  }
  else if constexpr (Mode == kSplit) {
    int16_t low[W];
    load<W>(lo, i, low);
    MIXEDPREC_UNROLL for (int j = 0; j < W; ++j) x[j] = join_bf16(bits[j], low[j]);
  } else { MIXEDPREC_UNROLL for (int j = 0; j < W; ++j) x[j] = bits_float((uint32_t)bits[j] << 16); }
}

// Store the fp32 masters x of elements i..i+W-1 (and their half copy `o`, when given), split or rounded per Mode.
template <int Mode, int W, typename O>
MIXEDPREC_HD void store_masters(const float (&x)[W], ParamBits<Mode>* p, int16_t* lo, O* o, uint64_t seed, int64_t i) {
  if constexpr (Mode == kFp32) {
    store<W>(p, i, x);
    if (o) {
      O half[W];
      MIXEDPREC_UNROLL for (int j = 0; j < W; ++j) half[j] = static_cast<O>(x[j]);
      store<W>(o, i, half);
    }
  } else {
    uint16_t hi[W];
    if constexpr (Mode == kSplit) {
      int16_t low[W];
      MIXEDPREC_UNROLL for (int j = 0; j < W; ++j) split_bf16(x[j], hi[j], low[j]);
      store<W>(lo, i, low);
    } else {
      MIXEDPREC_UNROLL for (int j = 0; j < W; ++j) hi[j] = round_stochastic(x[j], rounding_bits(seed, (uint64_t)(i + j)));
    }
    store<W>(p, i, hi);
  }
}

// How a functor finds the optimizer state: fp32 tensors, or bf16 ones (raw bits) rounded stochastically on the way back,
// with a seed per tensor and state list, from an index space of its own per list (bf16_bits.h), or 8-bit codes with a
// scale per kQBlock elements, rounded alike (state8_bits.h; the first list signed int8, the second unsigned uint8).
enum StateMode { kStateFp32 = 0, kStateBf16 = 1, kState8 = 2 };
template <int SMode> using StateBits = std::conditional_t<SMode == kStateFp32, float, std::conditional_t<SMode == kStateBf16, uint16_t, uint8_t>>;

template <int SMode, int W> MIXEDPREC_HD void load_state(const StateBits<SMode>* s, int64_t i, float (&x)[W]) {
  if constexpr (SMode == kStateFp32) load<W>(s, i, x);
  else {
    uint16_t bits[W];
    load<W>(s, i, bits);
    MIXEDPREC_UNROLL for (int j = 0; j < W; ++j) x[j] = bits_float((uint32_t)bits[j] << 16);
  }
}

template <int SMode, int W> MIXEDPREC_HD void store_state(const float (&x)[W], StateBits<SMode>* s, uint64_t seed, int64_t i) {
  if constexpr (SMode == kStateFp32) store<W>(s, i, x);
  else {
    uint16_t bits[W];
    MIXEDPREC_UNROLL for (int j = 0; j < W; ++j) bits[j] = round_stochastic(x[j], rounding_bits(seed, (uint64_t)(i + j)));
    store<W>(s, i, bits);
  }
}

// 8-bit state: the quantisation blocks that start in the chunk [begin, end) (a block may run past the chunk's end: it
// belongs to the chunk it starts in), one per warp at a time, as body(first, lane in the warp of the call's first
// lane).
template <typename Body> MIXEDPREC_HD void walk_qblocks(const Lane& lane, int64_t begin, int64_t end, Body&& body) {
  const int64_t first = (begin + kQBlock - 1) / kQBlock * kQBlock;
  const int64_t warps = lane.threads < kWarp ? 1 : lane.threads / kWarp;
  for (int64_t q = first + (int64_t)(lane.thread / kWarp) * kQBlock; q < end; q += warps * kQBlock)
    body(q, lane.thread % kWarp);
}

static_assert(kQPerLane * kWarp == kQBlock && kQPerLane % kPack == 0,
              "a warp's lanes cover a quantisation block in whole packs");

MIXEDPREC_HD uint32_t magnitude_bits(float x) { return float_bits(x) & 0x7fffffffu; }

// The lists of the tensor that a lane's block steps, and the block's element range in it: grads, params, optimizer state
// (up to two), low halves or half copy.
template <typename G, typename O, int Mode, int SMode> struct StepLists {
  int64_t begin, end;                          // declared before slot, whose initializer sets them
  int slot;
  const G* g; ParamBits<Mode>* p; StateBits<SMode>* s0; StateBits<SMode>* s1; int16_t* lo; O* o; uint64_t seed, sseed0, sseed1;
  float* q0; float* q1;                        // 8-bit state: the scales of each list, after the low halves or half copy
  int64_t numel;
  template <typename Table>
  MIXEDPREC_HD StepLists(const Table& t, const Lane& lane, int64_t chunk, int states, bool has_s0, bool has_out, const int64_t* seeds,
                         const int64_t* state_seeds)
      : slot(block_range(t, lane, chunk, begin, end)),
        g(static_cast<const G*>(t.addr[0][slot])), p(static_cast<ParamBits<Mode>*>(t.addr[1][slot])),
        s0(has_s0 ? static_cast<StateBits<SMode>*>(t.addr[2][slot]) : nullptr),
        s1(states > 1 ? static_cast<StateBits<SMode>*>(t.addr[3][slot]) : nullptr),
        lo(Mode == kSplit ? static_cast<int16_t*>(t.addr[2 + states][slot]) : nullptr),
        o(Mode == kFp32 && has_out ? static_cast<O*>(t.addr[2 + states][slot]) : nullptr),
        seed(Mode == kStochastic ? (uint64_t)seeds[t.global_index[slot]] : 0),
        sseed0(SMode != kStateFp32 && has_s0 ? (uint64_t)state_seeds[(int64_t)t.global_index[slot] * states] : 0),
        sseed1(SMode != kStateFp32 && states > 1 ? (uint64_t)state_seeds[(int64_t)t.global_index[slot] * states + 1] : 0),
        q0(SMode == kState8 && has_s0 ? static_cast<float*>(t.addr[3 + states][slot]) : nullptr),
        q1(SMode == kState8 && states > 1 ? static_cast<float*>(t.addr[4 + states][slot]) : nullptr), numel(t.numel[slot]) {}
  MIXEDPREC_HD int head() const { return pack_head(g, p, s0, s1, lo, o); }

  // 8-bit state: step the quantisation block at qb with a warp, kQPerLane elements a lane, and the functor's
  // `update(g, master, state...)` (one state list: SGD's buffer, signed; two: Adam's m signed and v unsigned), which
  // updates the decoded state in place and returns the new master. A block's scale depends on all its new values: each
  // lane keeps its new values in registers, the warp agrees on each list's largest magnitude (warp_max), and each lane
  // encodes and writes its own. Every input is read once, in coalesced packs (lane l's packs at qb + 4l and
  // qb + 128 + 4l) when the block is whole and every list aligned at its start, else element by element (lane l's at
  // qb + l + 32j).
  template <int N, typename Update> MIXEDPREC_HD void step_qblock8(int64_t qb, int wl0, Update&& update) const {
    static_assert(SMode == kState8 && (N == 1 || N == 2), "8-bit state, one or two lists");
    StateBits<SMode>* const codes[2] = {s0, s1};
    float* const scales[2] = {q0, q1};
    const uint64_t sseeds[2] = {sseed0, sseed1};
    const int64_t qe = qb + kQBlock < numel ? qb + kQBlock : numel;
    const bool packed = qe - qb == kQBlock && head() == 0;
    float sc[N], nsc[N];
    MIXEDPREC_UNROLL for (int k = 0; k < N; ++k) sc[k] = scales[k][qb / kQBlock];
    float master[kLanesPerCall][kQPerLane], st[kLanesPerCall][N][kQPerLane];
    uint32_t most[kLanesPerCall][N];
    auto lane_items = [&](int wl, auto&& item) {          // item(width, j, i): the lane's items j.. at element i..
      if (packed) {
        MIXEDPREC_UNROLL for (int j = 0; j < kQPerLane; j += kPack)
          item(Width<kPack>(), j, qb + (int64_t)j * kWarp + wl * kPack);
      } else {
        MIXEDPREC_UNROLL for (int j = 0; j < kQPerLane; ++j) {
          const int64_t i = qb + (int64_t)j * kWarp + wl;
          if (i < qe) item(Width<1>(), j, i);
        }
      }
    };
    for (int c = 0; c < kLanesPerCall; ++c) {
      MIXEDPREC_UNROLL for (int k = 0; k < N; ++k) most[c][k] = 0;
      lane_items(wl0 + c, [&](auto width, int j, int64_t i) {
        constexpr int W = decltype(width)::value;
        G gs[W];
        float p0[W];
        StateBits<SMode> cs[N][W];
        load<W>(g, i, gs);
        load_masters<Mode, W>(p, lo, o, i, p0);
        MIXEDPREC_UNROLL for (int k = 0; k < N; ++k) load<W>(codes[k], i, cs[k]);
        MIXEDPREC_UNROLL for (int e = 0; e < W; ++e) {
          float s[N];
          MIXEDPREC_UNROLL for (int k = 0; k < N; ++k) s[k] = q8_decode(cs[k][e], sc[k], k == 0);
          if constexpr (N == 1) master[c][j + e] = update(to_float(gs[e]), p0[e], s[0]);
          else master[c][j + e] = update(to_float(gs[e]), p0[e], s[0], s[1]);
          MIXEDPREC_UNROLL for (int k = 0; k < N; ++k) {
            st[c][k][j + e] = s[k];
            most[c][k] = most[c][k] > magnitude_bits(s[k]) ? most[c][k] : magnitude_bits(s[k]);
          }
        }
      });
    }
    warp_max<N>(most);
    MIXEDPREC_UNROLL for (int k = 0; k < N; ++k) nsc[k] = q8_scale(most[0][k]);
    for (int c = 0; c < kLanesPerCall; ++c) {
      lane_items(wl0 + c, [&](auto width, int j, int64_t i) {
        constexpr int W = decltype(width)::value;
        StateBits<SMode> cs[N][W];
        float p1[W];
        MIXEDPREC_UNROLL for (int e = 0; e < W; ++e) {
          p1[e] = master[c][j + e];
          MIXEDPREC_UNROLL for (int k = 0; k < N; ++k)
            cs[k][e] = q8_encode(st[c][k][j + e], nsc[k], rounding_bits(sseeds[k], (uint64_t)(i + e)), k == 0);
        }
        MIXEDPREC_UNROLL for (int k = 0; k < N; ++k) store<W>(codes[k], i, cs[k]);
        store_masters<Mode, W>(p1, p, lo, o, seed, i);
      });
    }
    if (wl0 == 0) { MIXEDPREC_UNROLL for (int k = 0; k < N; ++k) scales[k][qb / kQBlock] = nsc[k]; }
  }
};

template <typename G, typename O, int Mode, int SMode> struct SgdFunctor {
  static constexpr uint32_t kKey = kernel_key(kSgdKernel, DtypeCode<G>::value, DtypeCode<O>::value, Mode, SMode);
  using Table = TensorTable<SMode == kState8 ? 5 : 4>;
  using Args = ArgList<float, float, float, float, float, float, bool, bool, bool, bool, bool, const int64_t*, const int64_t*>;
  static constexpr bool kWarpWide = SMode == kState8;       // 8-bit state: a warp steps each quantisation block
  template <typename Table>
  MIXEDPREC_HD void operator()(const Lane& lane, int64_t chunk, const int* noop, Table& t, float inv_scale, float lr, float momentum, float damp,
                               float wd, float decay, bool decoupled, bool nesterov, bool first_run, bool has_buf, bool has_out,
                               const int64_t* seeds, const int64_t* state_seeds) const {
    if (*noop) return;
    const StepLists<G, O, Mode, SMode> l(t, lane, chunk, 1, has_buf, has_out, seeds, state_seeds);
    auto update = [&](float g, float p0, float& m) {           // one element: the new master, and the new buffer in m
      float gi = mul_rn(g, inv_scale);
      if (wd != 0.f) gi = add_rn(gi, mul_rn(wd, p0));
      if (l.s0) {
        m = first_run ? gi : add_rn(mul_rn(m, momentum), mul_rn(damp, gi));
        gi = nesterov ? add_rn(gi, mul_rn(momentum, m)) : m;
      }
      const float pv = decoupled ? mul_rn(p0, decay) : p0;
      return sub_rn(pv, mul_rn(lr, gi));
    };
    if constexpr (SMode == kState8) {                       // the update ignores the decoded buffer on the first run
      walk_qblocks(lane, l.begin, l.end, [&](int64_t qb, int wl) { l.template step_qblock8<1>(qb, wl, update); });
    } else {
      walk(lane, l.begin, l.end, l.head(), [&](auto width, int64_t i) {
        constexpr int W = decltype(width)::value;
        G gs[W];
        float p0[W], m[W], p1[W];
        load<W>(l.g, i, gs);
        load_masters<Mode, W>(l.p, l.lo, l.o, i, p0);
        if (l.s0 && !first_run) load_state<SMode, W>(l.s0, i, m);
        MIXEDPREC_UNROLL for (int j = 0; j < W; ++j) p1[j] = update(to_float(gs[j]), p0[j], m[j]);
        if (l.s0) store_state<SMode, W>(m, l.s0, l.sseed0, i);
        store_masters<Mode, W>(p1, l.p, l.lo, l.o, l.seed, i);
      });
    }
  }
};

// The scalars arrive as the host computes them (in double, rounded once to float), as the reference's Python scalars do;
// the per-step factors come from each tensor's own step count (t.scalar[slot], beside the params) plus one; the caller
// advances the counts afterwards, on the device, unless the flag is set.
template <typename G, typename O, int Mode, int SMode> struct AdamFunctor {
  static constexpr uint32_t kKey = kernel_key(kAdamKernel, DtypeCode<G>::value, DtypeCode<O>::value, Mode, SMode);
  using Table = TensorTable<SMode == kState8 ? 7 : 5, true>;
  using Args = ArgList<float, double, double, double, float, float, float, float, float, float, bool, bool, const int64_t*,
                       const int64_t*>;
  static constexpr bool kWarpWide = SMode == kState8;
  template <typename Table>
  MIXEDPREC_HD void operator()(const Lane& lane, int64_t chunk, const int* noop, Table& t, float inv_scale, double lr, double beta1, double beta2,
                               float omb1, float b2, float omb2, float eps, float l2, float decay, bool decoupled, bool has_out,
                               const int64_t* seeds, const int64_t* state_seeds) const {
    if (*noop) return;
    const StepLists<G, O, Mode, SMode> l(t, lane, chunk, 2, true, has_out, seeds, state_seeds);
    const double s = (double)*t.scalar[l.slot] + 1.0;         // this step's count; the caller advances it afterwards
    const float step_size = (float)(lr / (1.0 - pow(beta1, s)));
    const float bc2_sqrt = (float)sqrt(1.0 - pow(beta2, s));
    auto update = [&](float g, float p0, float& m, float& v) {  // one element: the new master, and the new moments in m and v
      float gi = mul_rn(g, inv_scale);
      float pv = p0;
      if (decoupled) pv = mul_rn(pv, decay);
      else if (l2 != 0.f) gi = add_rn(gi, mul_rn(l2, pv));
      m = add_rn(m, mul_rn(omb1, sub_rn(gi, m)));
      v = add_rn(mul_rn(v, b2), mul_rn(mul_rn(omb2, gi), gi));
      const float denom = add_rn(div_rn(sqrt_rn(v), bc2_sqrt), eps);
      return sub_rn(pv, mul_rn(step_size, div_rn(m, denom)));
    };
    if constexpr (SMode == kState8) {
      walk_qblocks(lane, l.begin, l.end, [&](int64_t qb, int wl) { l.template step_qblock8<2>(qb, wl, update); });
    } else {
      walk(lane, l.begin, l.end, l.head(), [&](auto width, int64_t i) {
        constexpr int W = decltype(width)::value;
        G gs[W];
        float pv[W], m[W], v[W];
        load<W>(l.g, i, gs);
        load_masters<Mode, W>(l.p, l.lo, l.o, i, pv);
        load_state<SMode, W>(l.s0, i, m);
        load_state<SMode, W>(l.s1, i, v);
        MIXEDPREC_UNROLL for (int j = 0; j < W; ++j) pv[j] = update(to_float(gs[j]), pv[j], m[j], v[j]);
        store_state<SMode, W>(m, l.s0, l.sseed0, i);
        store_state<SMode, W>(v, l.s1, l.sseed1, i);
        store_masters<Mode, W>(pv, l.p, l.lo, l.o, l.seed, i);
      });
    }
  }
};

}  // namespace mixedprec

namespace mixedprec {

// The step functor a key names (kernel_keys.h): step_kernel.cu builds the kernel of one key, and every dispatch checks
// that a functor's key names that very functor.
template <uint32_t Key>
using StepFunctorOf = std::conditional_t<
    key_kind(Key) == kSgdKernel,
    SgdFunctor<DtypeOf<key_a(Key)>, DtypeOf<key_b(Key)>, (int)key_mode(Key), (int)key_smode(Key)>,
    AdamFunctor<DtypeOf<key_a(Key)>, DtypeOf<key_b(Key)>, (int)key_mode(Key), (int)key_smode(Key)>>;

// Every step kernel a dispatch can ask for: SGD and Adam, grads of each float type, fp32 masters with a half copy of
// each type (or none: float) or bf16 masters split or rounded (no copy: float), and state of each kind.
template <typename Visit> constexpr void for_each_step_key(Visit&& visit) {
  for (uint32_t kind : {(uint32_t)kSgdKernel, (uint32_t)kAdamKernel})
    for (uint32_t g = 0; g < kDtypeCodes; ++g)
      for (uint32_t mode : {(uint32_t)kFp32, (uint32_t)kSplit, (uint32_t)kStochastic})
        for (uint32_t o = 0; o < (mode == kFp32 ? kDtypeCodes : 1); ++o)
          for (uint32_t smode : {(uint32_t)kStateFp32, (uint32_t)kStateBf16, (uint32_t)kState8}) visit(kernel_key(kind, g, o, mode, smode));
}

}  // namespace mixedprec
