// The sampling chain of SamplingParams (sampling.h) on the device, with sampling_math.h's
// arithmetic, so that it picks the CPU Sampler's token bit for bit. Two launches, one block per
// tile of 1024 token ids:
//   1. sample_scan: NaN becomes -inf, the penalties apply, and each token's order key
//      (sample_key) goes to the workspace; each tile leaves its statistics (largest key, tokens
//      above -inf and at +inf, the raw logits' log-sum-exp) and a histogram of its keys' top 11
//      bits (sign, exponent, two mantissa bits).
//   2. sample_pick: every block merges the statistics and, from the top digit down, as much of
//      the histograms as bounds the cuts: the lowest top digit a kept token can have. Where the
//      tokens above that bound are few, each block copies those of its tile, in id order, to the
//      workspace, and the last block to finish gathers them into a list in shared memory and
//      makes the cuts and the draw there (a list of at most 256 is sorted outright). With no cut
//      but min-p's, every block weighs its tile for the draw and the last one finds the token.
//      Otherwise one block makes the cuts over the whole vocabulary.
// Each cut of the order is a (key, id) threshold found by radix selection (histograms of counts
// or integer masses by the key's next digit narrow it down to one key; the tie among the tokens
// of that key goes by id, in a scan in id order), and the draw is a scan of the integer weights
// in id order. Everything after the float weights is integer arithmetic, so the order in which
// threads add never changes the result.
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <string>
#include <thread>
#include <utility>

#include "cuda/device_util.cuh"
#include "cuda/graph_executor.h"
#include "cuda/kernels.cuh"
#include "sampling_math.h"

#if __has_include(<curand_kernel.h>)
#include <curand_kernel.h>
#define GGRAPH_HAVE_CURAND 1
#endif

namespace ggraph::cuda {

namespace {

namespace sw = sample_word;

// Small blocks over many tiles: every instruction of a block's threads takes its SM's issue
// slots, so a tile's fixed work (reductions, barriers) costs less spread over more blocks.
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
// A tile: four consecutive ids a thread, the threads in order. sample_scan and sample_pick take
// one a block; one block's passes over the whole vocabulary load kGroup tiles at once.
constexpr int kTile = 4 * kThreads;
constexpr int kGroup = 4;
// Radix digits of the 32-bit key, from the top: 11, 11 and 10 bits.
constexpr int kTopBits = 11;
constexpr int kBins = 1 << kTopBits;
constexpr int kTopShift = 32 - kTopBits;
// The most tokens the shared-memory list holds.
constexpr int kListCap = 3072;

constexpr uint32_t kKeyNegInf = 0x007FFFFFu;  // sample_key(-inf)
constexpr uint32_t kKeyPosInf = 0xFF800000u;  // sample_key(+inf)
constexpr uint32_t kKeyZero = 0x80000000u;    // sample_key(0)

// What sample_scan leaves of a tile (and sample_pick, the length of its part of the list and
// its top-p mass).
struct TileStats {
  unsigned long long best;  // the largest key (high word) with the lowest id (~id, low word)
  unsigned long long mass;
  float raw_m, raw_s;  // log-sum-exp of the raw logits: max and sum of exp(x - max)
  uint32_t valid, pos_inf, raw_pos_inf, listed;
};

// The workspace (sample_work_bytes).
struct Work {
  uint32_t* keys;  // [n_tiles * kTile], -inf keys past n_vocab; sample_pick compacts in place
  int32_t* ids;    // [n_tiles * kTile]: the ids of the compacted keys
  TileStats* tiles;
  uint32_t* counts;            // [n_tiles][kBins]: the tiles' top-digit histograms
  unsigned long long* masses;  // [n_tiles][kBins]: their top-p masses by top digit
  unsigned* ticket;            // sample_pick's blocks done
};

// The statistics of all tiles.
struct Totals {
  uint64_t best;
  uint32_t valid, pos_inf, raw_pos_inf;
  float raw_m, raw_s;
};

// What the first passes leave for the cuts: each a radix selection begun from the top digit.
struct Plan {
  float max;  // the (penalized) maximum
  float temperature;
  int32_t top_k;
  float top_p;
  bool inf_mode;  // the maximum is +inf
  bool use_k;     // top-k cuts (else the other filters keep a subset of what it keeps)
  uint32_t k_prefix;
  uint64_t k_acc;
  bool use_p;       // top-p cuts
  bool p_from_top;  // the tiles' mass histograms have given its target and top digit
  uint32_t p_prefix;
  uint64_t p_acc, p_target;
  uint32_t floor_key;  // min-p
  uint64_t seed, draw;
  int low;  // the lowest top digit of a kept token
};

struct Shared {
  unsigned long long hist[kBins];  // radix histograms: counts or masses
  union {
    struct {
      uint32_t key[kListCap];
      int32_t id[kListCap];
    } list;                          // tokens in id order
    uint32_t penalty_counts[kTile];  // sample_scan: the tile's ids in the penalty window
  };
  unsigned long long buf[2][kWarps];  // block reductions and scans take them in turn
  unsigned long long win[32];         // 32 digits of the tiles' histograms
  const void* win_of;                 // which histograms, from which digit down
  int32_t win_at;
  unsigned long long found_acc;
  int32_t found_digit;
  int32_t found_id;
  Totals totals;
};

// The logit a key stands for (zero for both zeros).
__device__ __forceinline__ float work_of(uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key);
}

__device__ __forceinline__ float clean(float x) { return isnan(x) ? -INFINITY : x; }

// The chain's rule for an infinite maximum: 0 for +inf, -inf for the rest.
__device__ __forceinline__ uint32_t inf_rule(uint32_t key) {
  return key == kKeyPosInf ? kKeyZero : kKeyNegInf;
}

// ---- Block-wide reductions and scans ---------------------------------------------------------

__device__ __forceinline__ void lse_combine(float& m, float& s, float m2, float s2) {
  const float mx = fmaxf(m, m2);
  if (mx == -INFINITY) return;
  s = s * __expf(m - mx) + s2 * __expf(m2 - mx);
  m = mx;
}

__device__ __forceinline__ void warp_lse(float& m, float& s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    lse_combine(m, s, __shfl_xor_sync(kFullMask, m, o), __shfl_xor_sync(kFullMask, s, o));
  }
}

__device__ __forceinline__ uint64_t warp_inclusive_scan(uint64_t v) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint64_t u = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

// Block-wide sums, maxima and scans of 64-bit integers.
class BlockOps {
 public:
  explicit __device__ BlockOps(Shared& s) : s_(s) {}

  // The sum (or maximum) of v over the threads, in every thread.
  __device__ uint64_t sum(uint64_t v) {
    return reduce(v, [](uint64_t a, uint64_t b) { return a + b; });
  }
  __device__ uint64_t max(uint64_t v) {
    return reduce(v, [](uint64_t a, uint64_t b) { return a > b ? a : b; });
  }

  // The sum of v over the threads before this one; *total: over all of them.
  __device__ uint64_t exclusive_scan(uint64_t v, uint64_t* total) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const uint64_t incl = warp_inclusive_scan(v);
    unsigned long long* buf = next();
    if (lane == 31) buf[warp] = incl;
    __syncthreads();
    const uint64_t w = warp_inclusive_scan(lane < kWarps ? buf[lane] : 0);
    *total = __shfl_sync(kFullMask, w, 31);
    const uint64_t before = __shfl_sync(kFullMask, w, (warp + 31) % 32);
    return (warp > 0 ? before : 0) + incl - v;
  }

 private:
  // Two buffers in turn: a thread that writes one has passed a barrier that every thread reached
  // after reading it the time before.
  __device__ unsigned long long* next() {
    parity_ ^= 1;
    return s_.buf[parity_];
  }

  // Identity 0: both sums and maxima of unsigned values.
  template <typename Op>
  __device__ uint64_t reduce(uint64_t v, Op op) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, o));
    unsigned long long* buf = next();
    if (threadIdx.x % 32 == 0) buf[threadIdx.x / 32] = v;
    __syncthreads();
    v = threadIdx.x % 32 < kWarps ? buf[threadIdx.x % 32] : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, o));
    return v;
  }

  Shared& s_;
  int parity_ = 0;
};

// Adds v to a 64-bit counter in shared memory with 32-bit atomics (a 64-bit one is a compare-and-
// swap loop there): the low word, then the high word with the low word's carry.
__device__ __forceinline__ void atomic_add_u64(unsigned long long* a, uint64_t v) {
  unsigned* w = reinterpret_cast<unsigned*>(a);
  const unsigned lo = uint32_t(v);
  const unsigned old = atomicAdd(w, lo);
  const unsigned hi = uint32_t(v >> 32) + (old + lo < old ? 1u : 0u);
  if (hi != 0) atomicAdd(w + 1, hi);
}

// ---- Where the tokens come from --------------------------------------------------------------

// The keys in the workspace, padded with -inf keys to whole tiles; inf_mode applies inf_rule.
struct KeySource {
  static constexpr int kGroupTiles = kGroup;
  const uint32_t* keys;
  int n_tiles;
  bool inf_mode;

  __device__ int tiles() const { return n_tiles; }
  __device__ void load(int t0, uint32_t (&k)[kGroupTiles][4], int32_t (&id)[kGroupTiles][4]) const {
    uint4 v[kGroupTiles];
#pragma unroll
    for (int j = 0; j < kGroupTiles; ++j) {
      v[j] = make_uint4(kKeyNegInf, kKeyNegInf, kKeyNegInf, kKeyNegInf);
      if (t0 + j < n_tiles) {
        v[j] = reinterpret_cast<const uint4*>(keys)[(t0 + j) * kThreads + threadIdx.x];
      }
    }
#pragma unroll
    for (int j = 0; j < kGroupTiles; ++j) {
      k[j][0] = v[j].x;
      k[j][1] = v[j].y;
      k[j][2] = v[j].z;
      k[j][3] = v[j].w;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        id[j][e] = (t0 + j) * kTile + 4 * int(threadIdx.x) + e;
        if (inf_mode) k[j][e] = inf_rule(k[j][e]);
      }
    }
  }
};

// The list in shared memory, in id order, four consecutive entries a thread each step; past its
// end, -inf keys.
struct ListSource {
  static constexpr int kGroupTiles = 1;
  const uint32_t* key;
  const int32_t* ids;
  int n;

  __device__ int tiles() const { return (n + kTile - 1) / kTile; }
  __device__ void load(int t0, uint32_t (&k)[1][4], int32_t (&id)[1][4]) const {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int pos = t0 * kTile + 4 * int(threadIdx.x) + e;
      k[0][e] = pos < n ? key[pos] : kKeyNegInf;
      id[0][e] = pos < n ? ids[pos] : -1;
    }
  }
};

template <class Src, class F>
__device__ void for_each(const Src& src, F&& f) {
  constexpr int G = Src::kGroupTiles;
  for (int t0 = 0; t0 < src.tiles(); t0 += G) {
    uint32_t k[G][4];
    int32_t id[G][4];
    src.load(t0, k, id);
#pragma unroll
    for (int j = 0; j < G; ++j) {
      if (t0 + j >= src.tiles()) break;
#pragma unroll
      for (int e = 0; e < 4; ++e) f(k[j][e], id[j][e]);
    }
  }
}

// ---- Sets of tokens and their weights --------------------------------------------------------

__device__ __forceinline__ bool at_or_before(uint32_t key, int32_t id, uint32_t cut_key,
                                             int32_t cut_id) {
  return key > cut_key || (key == cut_key && id <= cut_id);
}

// The tokens that top-k and top-p keep (those at or before each cut in the order), min-p keeps
// (key >= floor_key; the default drops only -inf), and, when eq_key is set, of that key alone.
struct Filter {
  uint32_t k_key = 0;
  int32_t k_id = INT32_MAX;
  uint32_t p_key = 0;
  int32_t p_id = INT32_MAX;
  uint32_t floor_key = kKeyNegInf + 1;
  uint32_t eq_key = 0;

  __device__ bool has(uint32_t key, int32_t id) const {
    return key >= floor_key && at_or_before(key, id, k_key, k_id) &&
           at_or_before(key, id, p_key, p_id) && (eq_key == 0 || key == eq_key);
  }
};

struct CountWeight {
  __device__ uint64_t operator()(uint32_t) const { return 1; }
};
// top-p's probability mass.
struct MassWeight {
  float max;
  __device__ uint64_t operator()(uint32_t key) const {
    return sample_mass(exp_nonpositive(sample_add(work_of(key), -max)));
  }
};
// The draw's weight.
struct DrawWeight {
  float max, temperature;
  __device__ uint64_t operator()(uint32_t key) const {
    return sample_mass(exp_nonpositive(sample_div(sample_add(work_of(key), -max), temperature)));
  }
};

// ---- Selection -------------------------------------------------------------------------------

// The digit of hist (nbins bins, a multiple of kThreads; the largest digit first in the order) in
// which the running weight, starting from acc, reaches target; acc then adds the bins above it.
// False (acc as it was) when every bin together stays short.
__device__ bool find_digit(BlockOps& ops, Shared& s, const unsigned long long* hist, int nbins,
                           uint64_t target, uint64_t& acc, int& digit) {
  const int per = nbins / kThreads;
  const int top = nbins - 1 - per * int(threadIdx.x);  // this thread's digits: top down
  uint64_t mine = 0;
  for (int i = 0; i < per; ++i) mine += hist[top - i];
  uint64_t total;
  uint64_t above = acc + ops.exclusive_scan(mine, &total);
  if (above < target && target <= above + mine) {
    for (int i = 0; i < per; ++i) {
      const uint64_t h = hist[top - i];
      if (target <= above + h) {
        s.found_digit = top - i;
        s.found_acc = above;
        break;
      }
      above += h;
    }
  }
  __syncthreads();
  if (acc + total < target) return false;
  digit = s.found_digit;
  acc = s.found_acc;
  return true;
}

// The key at which the running weight of f's members, in the order, reaches target. prefix's
// first `bits` bits are known already, and acc holds the weight of the members before them; on
// return prefix is the key and acc the weight of the members before it. False when the members'
// weight with keys of that prefix stays short.
template <class Src, class Weight>
__device__ bool select_key(BlockOps& ops, Shared& s, const Src& src, const Filter& f,
                           const Weight& weight, uint64_t target, uint32_t& prefix, int bits,
                           uint64_t& acc) {
  while (bits < 32) {
    const int width = bits == 0 ? kTopBits : min(kTopBits, 32 - bits);
    const int shift = 32 - bits - width;
    const uint64_t high = uint64_t(prefix) >> (32 - bits);  // the known bits (none: 0)
    for (int i = threadIdx.x; i < (1 << width); i += kThreads) s.hist[i] = 0;
    __syncthreads();
    for_each(src, [&](uint32_t key, int32_t id) {
      if (f.has(key, id) && (uint64_t(key) >> (32 - bits)) == high) {
        atomic_add_u64(&s.hist[(key >> shift) & ((1u << width) - 1)], weight(key));
      }
    });
    __syncthreads();
    int digit;
    if (!find_digit(ops, s, s.hist, 1 << width, target, acc, digit)) return false;
    prefix |= uint32_t(digit) << shift;
    bits += width;
  }
  return true;
}

// The first of f's members, in id order, at which their running weight reaches target; -1 when
// their whole weight stays short.
template <class Src, class Weight>
__device__ int32_t find_by_id(BlockOps& ops, Shared& s, const Src& src, const Filter& f,
                              const Weight& weight, uint64_t target) {
  constexpr int G = Src::kGroupTiles;
  uint64_t acc = 0;
  for (int t0 = 0; t0 < src.tiles(); t0 += G) {
    uint32_t k[G][4];
    int32_t id[G][4];
    src.load(t0, k, id);
    uint64_t part[G];
    uint64_t mine = 0;
#pragma unroll
    for (int j = 0; j < G; ++j) {
      part[j] = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (f.has(k[j][e], id[j][e])) part[j] += weight(k[j][e]);
      }
      mine += part[j];
    }
    const uint64_t group = G == 1 ? 0 : ops.sum(mine);
    if (G > 1 && acc + group < target) {
      acc += group;
      continue;
    }
#pragma unroll
    for (int j = 0; j < G; ++j) {
      uint64_t tile;
      const uint64_t before = acc + ops.exclusive_scan(part[j], &tile);
      if (before < target && target <= before + part[j]) {
        uint64_t run = before;
        int32_t found = -1;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (found < 0 && f.has(k[j][e], id[j][e])) {
            run += weight(k[j][e]);
            if (run >= target) found = id[j][e];
          }
        }
        s.found_id = found;
      }
      if (acc + tile >= target) {
        __syncthreads();
        return s.found_id;
      }
      acc += tile;
    }
  }
  return -1;
}

template <class Src, class Weight>
__device__ uint64_t total_weight(BlockOps& ops, const Src& src, const Filter& f,
                                 const Weight& weight) {
  uint64_t sum = 0;
  for_each(src, [&](uint32_t key, int32_t id) {
    if (f.has(key, id)) sum += weight(key);
  });
  return ops.sum(sum);
}

// ---- The cuts and the draw -------------------------------------------------------------------

__device__ uint64_t top_p_target(float top_p, uint64_t total) {
  return static_cast<uint64_t>(ceil(__dmul_rn(double(top_p), double(total))));
}

// The token the draw picks, from the tokens of src (every token of the chain's cuts among them).
template <class Src>
__device__ int32_t finish(Shared& s, const Src& src, const Plan& p) {
  BlockOps ops(s);
  const MassWeight mass{p.max};
  Filter f;
  if (p.use_k) {
    uint32_t key = p.k_prefix;
    uint64_t acc = p.k_acc;
    select_key(ops, s, src, f, CountWeight{}, uint64_t(p.top_k), key, kTopBits, acc);
    Filter ties = f;
    ties.eq_key = key;
    f.k_id = find_by_id(ops, s, src, ties, CountWeight{}, uint64_t(p.top_k) - acc);
    f.k_key = key;
  }
  if (p.use_p) {
    uint32_t key = 0;
    uint64_t acc = 0, target = 0;
    bool found;
    if (p.p_from_top) {
      key = p.p_prefix;
      acc = p.p_acc;
      target = p.p_target;
      found = select_key(ops, s, src, f, mass, target, key, kTopBits, acc);
    } else {
      target = top_p_target(p.top_p, total_weight(ops, src, f, mass));
      found = select_key(ops, s, src, f, mass, target, key, 0, acc);
    }
    if (found) {
      // Equal keys, equal masses: the tie is the j-th of the key in id order.
      const uint64_t w = mass(key);
      Filter ties = f;
      ties.eq_key = key;
      f.p_id = find_by_id(ops, s, src, ties, CountWeight{}, (target - acc + w - 1) / w);
      f.p_key = key;
    }
  }
  f.floor_key = p.floor_key;
  const DrawWeight dw{p.max, p.temperature};
  const uint64_t total = total_weight(ops, src, f, dw);
  const double u = philox_uniform(p.seed, p.draw);
  const uint64_t scaled = static_cast<uint64_t>(__dmul_rn(u, __ull2double_rn(total)));
  const uint64_t r = scaled < total - 1 ? scaled : total - 1;
  return find_by_id(ops, s, src, f, dw, r + 1);
}

// The cuts and the draw over the list when it is at most kThreads long: each token finds its
// place in the order by counting those before it, and the cuts become prefixes of the sorted
// list.
__device__ int32_t finish_sorted(Shared& s, int n, const Plan& p) {
  BlockOps ops(s);
  const int i = threadIdx.x;
  uint32_t key = i < n ? s.list.key[i] : kKeyNegInf;
  int32_t id = i < n ? s.list.id[i] : -1;
  int place = 0;
  if (i < n) {
    // The list is in id order: among equal keys, those listed before come first.
    for (int j = 0; j < n; ++j) {
      const uint32_t other = s.list.key[j];
      place += other > key || (other == key && j < i);
    }
  }
  __syncthreads();
  if (i < n) {
    s.list.key[place] = key;
    s.list.id[place] = id;
  }
  __syncthreads();
  // Thread i holds the i-th token of the order; the list is a prefix of the order, so top-k keeps
  // its first top_k.
  key = i < n ? s.list.key[i] : kKeyNegInf;
  id = i < n ? s.list.id[i] : -1;
  int kept = p.use_k ? min(p.top_k, n) : n;
  if (p.use_p) {
    const uint64_t m = i < kept ? MassWeight{p.max}(key) : 0;
    uint64_t total;
    const uint64_t before = ops.exclusive_scan(m, &total);
    const uint64_t target = p.p_from_top ? p.p_target : top_p_target(p.top_p, total);
    const bool crossing = i < kept && before < target && target <= before + m;
    const uint64_t last = ops.max(crossing ? uint64_t(i) + 1 : 0);
    if (last > 0) kept = int(last);
  }
  kept = int(ops.sum(i < kept && key >= p.floor_key));  // min-p keeps a prefix too
  // The draw, in id order among the kept: each adds the weights of the kept with lower ids.
  const uint64_t d = i < kept ? DrawWeight{p.max, p.temperature}(key) : 0;
  const uint64_t total = ops.sum(d);
  const double u = philox_uniform(p.seed, p.draw);
  const uint64_t scaled = static_cast<uint64_t>(__dmul_rn(u, __ull2double_rn(total)));
  const uint64_t r = scaled < total - 1 ? scaled : total - 1;
  s.hist[i] = d;
  __syncthreads();
  if (i < kept) {
    uint64_t below = 0;
    for (int j = 0; j < kept; ++j) below += s.list.id[j] < id ? s.hist[j] : 0;
    if (below <= r && r < below + d) s.found_id = id;
  }
  __syncthreads();
  return s.found_id;
}

// Stable compaction of one tile: this thread's members among its four (key, id) go to out_key /
// out_id from base + (the members of the threads before), in order; returns the tile's count.
__device__ int compact_tile(BlockOps& ops, const uint32_t (&k)[4], const int32_t (&id)[4],
                            const bool (&member)[4], uint32_t* out_key, int32_t* out_id, int base) {
  const int mine = int(member[0]) + member[1] + member[2] + member[3];
  uint64_t total;
  int pos = base + int(ops.exclusive_scan(uint64_t(mine), &total));
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    if (member[e]) {
      out_key[pos] = k[e];
      out_id[pos] = id[e];
      ++pos;
    }
  }
  return int(total);
}

// Copies src's keys above -inf with top digit at least low into the list, in id order; returns
// how many.
__device__ int build_list(Shared& s, const KeySource& src, int low) {
  BlockOps ops(s);
  int n = 0;
  for (int t0 = 0; t0 < src.tiles(); t0 += kGroup) {
    uint32_t k[kGroup][4];
    int32_t id[kGroup][4];
    src.load(t0, k, id);
#pragma unroll
    for (int j = 0; j < kGroup; ++j) {
      if (t0 + j >= src.tiles()) break;
      bool member[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        member[e] = k[j][e] > kKeyNegInf && int(k[j][e] >> kTopShift) >= low;
      }
      n += compact_tile(ops, k[j], id[j], member, s.list.key, s.list.id, n);
    }
  }
  __syncthreads();
  return n;
}

// ---- Merging the tiles -----------------------------------------------------------------------

// The config's draw index (the draw of a chain's first step).
__device__ __forceinline__ uint64_t config_draw(const int32_t* c) {
  return (uint64_t(uint32_t(c[sw::kDrawHi])) << 32) | uint32_t(c[sw::kDrawLo]);
}

// Whether a chain goes on after a step sampled `token`: it is a token (not -1) and none of the
// config's stop ids.
__device__ __forceinline__ bool goes_on_after(const int32_t* config, int32_t token) {
  bool go = token >= 0;
  const int n_stop = min(config[sw::kNStop], sw::kMaxStop);
  for (int i = 0; i < n_stop; ++i) go = go && config[sw::kStop + i] != token;
  return go;
}

// Config words as the kernels read them.
struct Config {
  float temperature, top_p, min_p, log_min_p, repeat, frequency, presence;
  int32_t top_k, last_n, n_history;
  uint64_t seed, draw;

  __device__ explicit Config(const int32_t* c, int step) {
    temperature = __int_as_float(c[sw::kTemperature]);
    top_k = c[sw::kTopK];
    top_p = __int_as_float(c[sw::kTopP]);
    min_p = __int_as_float(c[sw::kMinP]);
    log_min_p = __int_as_float(c[sw::kLogMinP]);
    repeat = __int_as_float(c[sw::kRepeatPenalty]);
    frequency = __int_as_float(c[sw::kFrequencyPenalty]);
    presence = __int_as_float(c[sw::kPresencePenalty]);
    last_n = c[sw::kPenaltyLastN];
    n_history = c[sw::kNHistory];
    seed = (uint64_t(uint32_t(c[sw::kSeedHi])) << 32) | uint32_t(c[sw::kSeedLo]);
    draw = config_draw(c) + step;
  }
  __device__ bool greedy() const { return sample_is_greedy(temperature, top_k); }
};

// One warp: the statistics of all tiles, merged in a fixed order (every warp finds the same).
__device__ Totals warp_merge_tiles(const TileStats* tiles, int n_tiles) {
  uint64_t best = 0, counts = 0;
  uint32_t raw_pos_inf = 0;
  float m = -INFINITY, s = 0.0f;
  for (int g = threadIdx.x % 32; g < n_tiles; g += 32) {
    const TileStats t = tiles[g];
    best = t.best > best ? t.best : best;
    counts += (uint64_t(t.valid) << 32) | t.pos_inf;
    raw_pos_inf += t.raw_pos_inf;
    lse_combine(m, s, t.raw_m, t.raw_s);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t b = __shfl_xor_sync(kFullMask, best, o);
    best = b > best ? b : best;
    counts += __shfl_xor_sync(kFullMask, counts, o);
    raw_pos_inf += __shfl_xor_sync(kFullMask, raw_pos_inf, o);
  }
  warp_lse(m, s);
  Totals r;
  r.best = best;
  r.valid = uint32_t(counts >> 32);
  r.pos_inf = uint32_t(counts);
  r.raw_pos_inf = raw_pos_inf;
  r.raw_m = m;
  r.raw_s = s;
  return r;
}

// All threads: the digits w, w - 1, ..., w - 31 of the tiles' histograms hist ([n_tiles][kBins])
// summed into s.win (win[i] holds digit w - i; 0 below digit 0). In inf_mode the histogram is
// n_pos_inf at sample_key(0)'s digit alone.
template <typename T>
__device__ void merge_window(Shared& s, const T* hist, int n_tiles, int w, bool inf_mode,
                             uint32_t n_pos_inf) {
  if (s.win_at == w && s.win_of == static_cast<const void*>(hist)) return;  // merged already
  const int i = threadIdx.x % 32, g0 = threadIdx.x / 32;
  const int d = w - i;
  uint64_t sum = 0;
  if (inf_mode) {
    sum = g0 == 0 && d == int(kKeyZero >> kTopShift) ? n_pos_inf : 0;
  } else if (d >= 0) {
    for (int g = g0; g < n_tiles; g += kWarps) sum += __ldcg(&hist[size_t(g) * kBins + d]);
  }
  __syncthreads();  // the window before is read
  s.hist[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    uint64_t total = 0;
    for (int g = 0; g < kWarps; ++g) total += s.hist[g * 32 + i];
    s.win[i] = total;
    if (i == 0) {
      s.win_at = w;
      s.win_of = hist;
    }
  }
  __syncthreads();
}

// All threads (each warp finds the same): the top digit in which the running weight of the
// tiles' histograms, from digit `top` down, reaches target, and in acc the weight above it;
// false when it never does.
template <typename T>
__device__ bool find_top_digit(Shared& s, const T* hist, int n_tiles, int top, bool inf_mode,
                               uint32_t n_pos_inf, uint64_t target, uint64_t& acc, int& digit) {
  const int lane = threadIdx.x % 32;
  for (int w = top; w >= 0; w -= 32) {
    merge_window(s, hist, n_tiles, w, inf_mode, n_pos_inf);
    const uint64_t v = s.win[lane];
    const uint64_t incl = warp_inclusive_scan(v);
    const unsigned hit = __ballot_sync(kFullMask, acc + incl - v < target && target <= acc + incl);
    if (hit) {
      const int l = __ffs(hit) - 1;
      digit = w - l;
      acc += __shfl_sync(kFullMask, incl - v, l);
      return true;
    }
    acc += __shfl_sync(kFullMask, incl, 31);
  }
  return false;
}

// All threads: how many tokens above -inf have a top digit of at least low (counted from digit
// `top` down), or cap + 1 once there are more than cap.
__device__ uint32_t count_from_top(Shared& s, const uint32_t* counts, int n_tiles, int top,
                                   bool inf_mode, uint32_t n_pos_inf, int low, uint32_t cap) {
  const int lane = threadIdx.x % 32;
  uint64_t n = 0;
  for (int w = top; w >= low && n <= cap; w -= 32) {
    merge_window(s, counts, n_tiles, w, inf_mode, n_pos_inf);
    uint64_t v = w - lane >= low ? s.win[lane] : 0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
    n += v;
  }
  return n <= cap ? uint32_t(n) : cap + 1;
}

// Where a step's sample goes: entry `step` of the chain's token words (k_total tokens, then their
// log-probabilities), and the handle of the next step's conditional node (0: none).
struct Out {
  const int32_t* config;
  int32_t* tokens;
  int step, k_total;
  cudaGraphConditionalHandle next;
};

// tokens[step] and the log-probability under the raw logits, as the CPU's Sample op gives it:
// with +inf among them, 0 for those and -inf for the rest; NaN without a token (one thread).
// The next entry reads kSkipped until its step runs, and that step runs only if this token is
// not one of the config's stop ids and the config's limit allows it.
__device__ void write_token(const float* logits, const Totals& t, int32_t token, const Out& o) {
  float logprob = __int_as_float(0x7FC00000);  // NaN
  if (token >= 0) {
    const float raw = clean(logits[token]);
    if (t.raw_pos_inf > 0) {
      logprob = raw == INFINITY ? 0.0f : -INFINITY;
    } else {
      logprob = (raw - t.raw_m) - logf(t.raw_s);
    }
  }
  o.tokens[o.step] = token;
  o.tokens[o.k_total + o.step] = __float_as_int(logprob);
  if (o.step + 1 < o.k_total) o.tokens[o.step + 1] = sw::kSkipped;
  if (o.next) {
    const int limit = o.config[sw::kLimit];
    const bool go = goes_on_after(o.config, token) && (limit <= 0 || o.step + 1 < limit);
    cudaGraphSetConditional(o.next, go ? 1u : 0u);
  }
}

// ---- The kernels -----------------------------------------------------------------------------

// One tile a block: the keys, with the penalties, and the tile's statistics and histogram.
__global__ void __launch_bounds__(kThreads)
    sample_scan(const float* logits, int n_vocab, const int32_t* config, const int32_t* tokens,
                int step, Work work) {
  __shared__ Shared s;
  pdl_begin();
  const int tid = threadIdx.x;
  const int tile = blockIdx.x;
  const int base = tile * kTile;
  if (tile == 0 && tid == 0) *work.ticket = 0;
  const Config c(config, step);
  const bool greedy = c.greedy();

  // The penalty window: the last last_n ids of the config's history, then this chain's tokens.
  const int history = c.n_history + step;
  const int window = c.last_n < 0 ? history : min(history, c.last_n);
  const bool penalize =
      window > 0 && !(c.repeat == 1.0f && c.frequency == 0.0f && c.presence == 0.0f);
  uint32_t* hist = reinterpret_cast<uint32_t*>(s.hist);
  if (!greedy) {
    for (int i = tid; i < kBins; i += kThreads) hist[i] = 0;
  }
  int bad_id = 0;
  if (penalize) {
    for (int i = tid; i < kTile; i += kThreads) s.penalty_counts[i] = 0;
    __syncthreads();
    for (int i = history - window + tid; i < history; i += kThreads) {
      const int32_t id = i < c.n_history ? config[sw::kHeader + i] : tokens[i - c.n_history];
      if (id < 0 || id >= n_vocab) {
        bad_id = 1;
      } else if (id >= base && id < base + kTile) {
        atomicAdd(&s.penalty_counts[id - base], 1u);
      }
    }
  }
  // An id of the window out of range is the CPU sampler's error: no token (every tile sees it).
  const bool no_token = __syncthreads_or(bad_id);

  float x[4];
  const int first = base + 4 * tid;
  if ((reinterpret_cast<uintptr_t>(logits) & 15) == 0 && first + 3 < n_vocab) {
    const float4 v = reinterpret_cast<const float4*>(logits)[first / 4];
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
  } else {
#pragma unroll
    for (int e = 0; e < 4; ++e) x[e] = first + e < n_vocab ? logits[first + e] : -INFINITY;
  }
  uint32_t k[4];
  uint64_t best = 0;
  uint32_t valid = 0, pos_inf = 0, raw_pos_inf = 0;
  float raw_m = -INFINITY, raw_s = 0.0f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    float v = clean(x[e]);
    if (v == INFINITY) {
      ++raw_pos_inf;
    } else if (v > -INFINITY) {
      lse_combine(raw_m, raw_s, v, 1.0f);
    }
    if (penalize) {
      const uint32_t count = s.penalty_counts[4 * tid + e];
      if (count > 0) {
        v = v > 0.0f ? sample_div(v, c.repeat) : sample_mul(v, c.repeat);
        v = clean(sample_add(
            v, -sample_add(sample_mul(static_cast<float>(count), c.frequency), c.presence)));
      }
    }
    k[e] = sample_key(v);
    if (first + e < n_vocab) {
      const uint64_t b = (uint64_t(k[e]) << 32) | (0xFFFFFFFFu - uint32_t(first + e));
      best = b > best ? b : best;
      valid += k[e] > kKeyNegInf;
      pos_inf += k[e] == kKeyPosInf;
      if (!greedy && k[e] > kKeyNegInf) atomicAdd(&hist[k[e] >> kTopShift], 1u);
    }
  }
  reinterpret_cast<uint4*>(work.keys)[tile * kThreads + tid] = make_uint4(k[0], k[1], k[2], k[3]);

  // The tile's statistics: each warp's, then warp 0 merges them.
  uint64_t counts = (uint64_t(valid) << 40) | (uint64_t(pos_inf) << 20) | raw_pos_inf;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t b = __shfl_xor_sync(kFullMask, best, o);
    best = b > best ? b : best;
    counts += __shfl_xor_sync(kFullMask, counts, o);
  }
  warp_lse(raw_m, raw_s);
  const int lane = tid % 32, warp = tid / 32;
  if (lane == 0) {
    s.buf[0][warp] = best;
    s.buf[1][warp] = counts;
    s.win[warp] = (uint64_t(__float_as_uint(raw_m)) << 32) | __float_as_uint(raw_s);
  }
  __syncthreads();
  if (warp == 0) {
    best = lane < kWarps ? s.buf[0][lane] : 0;
    counts = lane < kWarps ? s.buf[1][lane] : 0;
    raw_m = lane < kWarps ? __uint_as_float(uint32_t(s.win[lane] >> 32)) : -INFINITY;
    raw_s = lane < kWarps ? __uint_as_float(uint32_t(s.win[lane])) : 0.0f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const uint64_t b = __shfl_xor_sync(kFullMask, best, o);
      best = b > best ? b : best;
      counts += __shfl_xor_sync(kFullMask, counts, o);
    }
    warp_lse(raw_m, raw_s);
    if (lane == 0) {
      TileStats t;
      t.best = best;
      t.mass = 0;
      t.raw_m = raw_m;
      t.raw_s = raw_s;
      t.valid = no_token ? 0 : uint32_t(counts >> 40);
      t.pos_inf = uint32_t(counts >> 20) & 0xFFFFF;
      t.raw_pos_inf = uint32_t(counts) & 0xFFFFF;
      t.listed = 0;
      work.tiles[tile] = t;
    }
  }
  if (!greedy) {
    for (int i = tid; i < kBins; i += kThreads) work.counts[size_t(tile) * kBins + i] = hist[i];
  }
}

// The ways sample_pick goes on from its plan.
enum Route {
  kList,       // every block lists its tile's reachable tokens
  kDraw,       // no cut but min-p's: every block weighs its tile for the draw
  kWhole,      // block 0 makes the cuts over the whole vocabulary
  kMassFirst,  // top-p over every token: its masses by top digit first
};

// The cuts and the draw over the list, in the last block.
__device__ void finish_list(Shared& s, int n, const Plan& p, const float* logits, const Out& o) {
  const int32_t token =
      n <= kThreads ? finish_sorted(s, n, p) : finish(s, ListSource{s.list.key, s.list.id, n}, p);
  if (threadIdx.x == 0) write_token(logits, s.totals, token, o);
}

// One block a tile: the plan of the cuts, this tile's part of the list, and, in the last block
// (or block 0, when the list would not hold every token the cuts reach), the cuts and the draw.
__global__ void __launch_bounds__(kThreads, 1)
    sample_pick(const float* logits, int n_vocab, const int32_t* config, int32_t* tokens, int step,
                int k_total, Work work, cudaGraphConditionalHandle next) {
  __shared__ Shared s;
  pdl_begin();
  const Out out{config, tokens, step, k_total, next};
  const int tid = threadIdx.x;
  const int tile = blockIdx.x;
  const int n_tiles = gridDim.x;

  if (tid == 0) s.win_of = nullptr;
  __syncthreads();
  // The plan: every warp finds the same.
  const Config c(config, step);
  Totals t = warp_merge_tiles(work.tiles, n_tiles);
  if (t.valid == 0 || c.greedy()) {
    if (tile == 0 && tid == 0) {
      const int32_t token = t.valid == 0 ? -1 : int32_t(0xFFFFFFFFu - uint32_t(t.best));
      write_token(logits, t, token, out);
    }
    return;
  }
  Plan p = {};
  p.inf_mode = uint32_t(t.best >> 32) == kKeyPosInf;
  if (p.inf_mode) {
    t.valid = t.pos_inf;
    t.best = (uint64_t(kKeyZero) << 32) | uint32_t(t.best);
  }
  const int top = int(t.best >> (32 + kTopShift));
  p.max = work_of(uint32_t(t.best >> 32));
  p.temperature = c.temperature;
  p.top_k = c.top_k;
  p.top_p = c.top_p;
  p.seed = c.seed;
  p.draw = c.draw;
  const bool min_p_on = c.min_p > 0.0f;
  p.floor_key =
      min_p_on ? sample_key(fmaxf(-FLT_MAX, sample_add(p.max, c.log_min_p))) : kKeyNegInf + 1;
  const int floor_digit = int(p.floor_key >> kTopShift);
  const bool top_k_on = c.top_k > 0 && c.top_k < n_vocab && uint32_t(c.top_k) < t.valid;
  if (top_k_on) {
    int digit = 0;
    find_top_digit(s, work.counts, n_tiles, top, p.inf_mode, t.pos_inf, uint64_t(c.top_k), p.k_acc,
                   digit);
    p.k_prefix = uint32_t(digit) << kTopShift;
    p.low = digit;
    // Without top-p, a min-p floor above that digit keeps a subset of what top-k keeps.
    if (c.top_p >= 1.0f && min_p_on) p.low = max(p.low, floor_digit);
    p.use_k = p.low == digit;
    p.use_p = c.top_p < 1.0f;
  } else if (min_p_on) {
    p.low = floor_digit;
  }
  Route route = kMassFirst;
  if (top_k_on || c.top_p >= 1.0f) {
    const uint32_t n_list = p.low == 0 ? t.valid
                                       : count_from_top(s, work.counts, n_tiles, top, p.inf_mode,
                                                        t.pos_inf, p.low, kListCap);
    route = n_list <= kListCap ? kList : !p.use_k && c.top_p >= 1.0f ? kDraw : kWhole;
  }
  if (tid == 0) s.totals = t;
  const KeySource all{work.keys, n_tiles, p.inf_mode};
  const KeySource mine{work.keys + size_t(tile) * kTile, 1, p.inf_mode};
  if (route == kWhole) {
    if (tile != 0) return;
    const int32_t token = finish(s, all, p);
    if (tid == 0) write_token(logits, t, token, out);
    return;
  }
  BlockOps ops(s);
  if (route == kList) {
    // This tile's part of the list, in place.
    uint32_t k[kGroup][4];
    int32_t id[kGroup][4];
    mine.load(0, k, id);
    bool member[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      id[0][e] += tile * kTile;
      member[e] = k[0][e] > kKeyNegInf && int(k[0][e] >> kTopShift) >= p.low;
    }
    __syncthreads();  // every key read before any is overwritten
    const int listed = compact_tile(ops, k[0], id[0], member, work.keys + size_t(tile) * kTile,
                                    work.ids + size_t(tile) * kTile, 0);
    if (tid == 0) work.tiles[tile].listed = uint32_t(listed);
    if (!last_block_ticket(work.ticket, gridDim.x)) return;
    // The tiles' parts in tile order make the list in id order.
    int n = 0;
    for (int g0 = 0; g0 < n_tiles; g0 += kThreads) {
      const uint32_t count = g0 + tid < n_tiles ? __ldcg(&work.tiles[g0 + tid].listed) : 0;
      uint64_t chunk;
      s.hist[tid] = n + ops.exclusive_scan(count, &chunk);  // where tile g0 + tid's part goes
      __syncthreads();
      const int tiles = min(kThreads, n_tiles - g0);
      for (int at = n + tid; at < n + int(chunk); at += kThreads) {
        // The last tile whose part starts at or before `at` holds it.
        int lo = 0, hi = tiles - 1;
        while (lo < hi) {
          const int mid = (lo + hi + 1) / 2;
          if (int(s.hist[mid]) <= at) {
            lo = mid;
          } else {
            hi = mid - 1;
          }
        }
        const size_t from = size_t(g0 + lo) * kTile + (at - int(s.hist[lo]));
        s.list.key[at] = __ldcg(&work.keys[from]);
        s.list.id[at] = __ldcg(&work.ids[from]);
      }
      __syncthreads();
      n += int(chunk);
    }
    finish_list(s, n, p, logits, out);
    return;
  }

  if (route == kDraw) {
    Filter f;
    f.floor_key = p.floor_key;
    const DrawWeight dw{p.max, p.temperature};
    const uint64_t mine_total = total_weight(ops, mine, f, dw);
    if (tid == 0) work.tiles[tile].mass = mine_total;
    if (!last_block_ticket(work.ticket, gridDim.x)) return;
    uint64_t total = 0;
    for (int g = tid; g < n_tiles; g += kThreads) total += __ldcg(&work.tiles[g].mass);
    total = ops.sum(total);
    const double u = philox_uniform(p.seed, p.draw);
    const uint64_t scaled = static_cast<uint64_t>(__dmul_rn(u, __ull2double_rn(total)));
    const uint64_t r = scaled < total - 1 ? scaled : total - 1;
    // The tile whose weights take the running sum past r, then the token within it.
    uint64_t acc = 0;
    for (int g0 = 0; g0 < n_tiles; g0 += kThreads) {
      const uint64_t w = g0 + tid < n_tiles ? __ldcg(&work.tiles[g0 + tid].mass) : 0;
      uint64_t chunk;
      const uint64_t before = acc + ops.exclusive_scan(w, &chunk);
      if (before <= r && r < before + w) {
        s.found_digit = g0 + tid;
        s.found_acc = before;
      }
      __syncthreads();
      if (acc + chunk > r) break;
      acc += chunk;
    }
    const int g = s.found_digit;
    const KeySource that{work.keys + size_t(g) * kTile, 1, p.inf_mode};
    const int32_t token = g * kTile + find_by_id(ops, s, that, f, dw, r + 1 - s.found_acc);
    if (tid == 0) write_token(logits, t, token, out);
    return;
  }

  // kMassFirst: top-p over every token needs the tiles' masses by top digit first.
  {
    const MassWeight mass{p.max};
    for (int i = tid; i < kBins; i += kThreads) s.hist[i] = 0;
    __syncthreads();
    uint64_t sum = 0;
    for_each(mine, [&](uint32_t key, int32_t) {
      if (key > kKeyNegInf) {
        const uint64_t m = mass(key);
        atomic_add_u64(&s.hist[key >> kTopShift], m);
        sum += m;
      }
    });
    sum = ops.sum(sum);
    for (int i = tid; i < kBins; i += kThreads) work.masses[size_t(tile) * kBins + i] = s.hist[i];
    if (tid == 0) work.tiles[tile].mass = sum;
  }
  if (!last_block_ticket(work.ticket, gridDim.x)) return;
  {
    uint64_t total = 0;
    for (int g = tid % 32; g < n_tiles; g += 32) total += __ldcg(&work.tiles[g].mass);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(kFullMask, total, o);
    p.p_target = top_p_target(p.top_p, total);
  }
  int digit = 0;
  if (find_top_digit(s, work.masses, n_tiles, top, false, 0, p.p_target, p.p_acc, digit)) {
    p.p_prefix = uint32_t(digit) << kTopShift;
    p.p_from_top = true;
    p.low = max(p.low, digit);
    // A min-p floor above that digit keeps tokens that all come before the crossing.
    p.use_p = p.low == digit;
  }
  const uint32_t n_list = p.low == 0 ? t.valid
                                     : count_from_top(s, work.counts, n_tiles, top, p.inf_mode,
                                                      t.pos_inf, p.low, kListCap);
  if (n_list > kListCap) {
    const int32_t token = finish(s, all, p);
    if (tid == 0) write_token(logits, t, token, out);
    return;
  }
  const int n = build_list(s, all, p.low);
  finish_list(s, n, p, logits, out);
}

// ---- A chain loop's round ---------------------------------------------------------------------

constexpr int kLoopThreads = 256;

// A word to the host through mapped memory while the kernel runs (HostWordWay), and one from it.
__device__ __forceinline__ void host_word_store(int32_t* p, int32_t v, HostWordWay way) {
  __threadfence_system();  // the writes before it, first
  if (way == kHostWordVolatile)
    *static_cast<volatile int32_t*>(p) = v;
  else
    asm volatile("st.relaxed.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
  if (way != kHostWordStore) __threadfence_system();
}
__device__ __forceinline__ int32_t host_word_load(const int32_t* p) {
  int32_t v;
  asm volatile("ld.relaxed.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__global__ void __launch_bounds__(kLoopThreads) chain_loop_round(ChainLoopArgs a) {
  __shared__ int go_shared;
  pdl_begin();
  const int tid = threadIdx.x;
  const int made = a.control[1];
  if (tid == 0) {
    bool go = --a.control[0] > 0;
    for (int j = 0; j < a.k; ++j) go = go && goes_on_after(a.config, a.tokens[j]);
    // Rounds were asked for within the capacity; a full buffer ends the loop all the same.
    go = go && made + 2 * a.k <= a.capacity;
    // The host's word, read over the bus at system scope: a halt asked for ends the loop here.
    if (a.halt) go = go && host_word_load(a.halt) == 0;
    go_shared = go;
    if (a.host) {
      // The round's words to the host, then the count that covers them.
      for (int j = 0; j < a.k; ++j) {
        a.host[loop_token_word(made + j)] = a.tokens[j];
        a.host[loop_logprob_word(a.capacity, made + j)] = a.tokens[a.k_total + j];
      }
      host_word_store(a.host, made + a.k + (go ? 0 : kLoopEnded), kLoopHostWord);
    }
  }
  for (int j = tid; j < a.k; j += kLoopThreads) {
    a.out[loop_token_word(made + j)] = a.tokens[j];
    a.out[loop_logprob_word(a.capacity, made + j)] = a.tokens[a.k_total + j];
  }
  __syncthreads();
  const bool go = go_shared;
  if (tid == 0) {
    a.control[1] = made + a.k;
    a.out[0] = made + a.k;
  }
  if (go) {
    if (tid == 0) {
      *a.first = a.tokens[a.k - 1];
      const uint64_t draw = config_draw(a.config) + uint64_t(a.k);
      a.config[sw::kDrawLo] = int32_t(uint32_t(draw));
      a.config[sw::kDrawHi] = int32_t(uint32_t(draw >> 32));
      if (a.config[sw::kLimit] > 0) a.config[sw::kLimit] -= a.k;
    }
    if (tid < a.k) *a.positions[tid] += a.k;
    if (tid < kMaxKvSlots) a.record[tid] += a.k;
    // The history: the newest history_cap of its ids and the round's tokens.
    if (a.history_cap > 0) {
      int32_t* h = a.config + sw::kHeader;
      const int n = a.config[sw::kNHistory];
      const int drop = max(0, n + a.k - a.history_cap);
      __syncthreads();  // every thread has read n before thread 0 rewrites it
      // In place, a block-wide chunk at a time: each chunk's reads come before its writes, and
      // later chunks read only above what earlier ones wrote.
      for (int base = 0; base < n - drop; base += kLoopThreads) {
        const int i = base + tid;
        const int32_t v = i < n - drop ? h[i + drop] : 0;
        __syncthreads();
        if (i < n - drop) h[i] = v;
        __syncthreads();
      }
      for (int j = tid; j < a.k; j += kLoopThreads)
        if (n - drop + j >= 0 && n - drop + j < a.history_cap) h[n - drop + j] = a.tokens[j];
      if (tid == 0) a.config[sw::kNHistory] = min(n + a.k, a.history_cap);
    }
  }
  if (tid == 0 && a.loop) cudaGraphSetConditional(a.loop, go ? 1u : 0u);
  if (tid > 0 && tid < a.k && a.steps[tid]) cudaGraphSetConditional(a.steps[tid], 0u);
}

#ifdef GGRAPH_HAVE_CURAND
__global__ void philox_pairs_kernel(uint64_t seed, uint64_t first, int n, uint32_t* ours,
                                    uint32_t* theirs) {
  pdl_begin();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const uint64_t c = first + uint64_t(i);
  const Philox4 r = philox4x32_10({{uint32_t(c), uint32_t(c >> 32), 0u, 0u}}, uint32_t(seed),
                                  uint32_t(seed >> 32));
  curandStatePhilox4_32_10_t state;
  curand_init(seed, 0, 4 * first, &state);
  uint4 t = {};
  for (int j = 0; j <= i; ++j) t = curand4(&state);
  for (int w = 0; w < 4; ++w) ours[4 * i + w] = r.v[w];
  theirs[4 * i + 0] = t.x;
  theirs[4 * i + 1] = t.y;
  theirs[4 * i + 2] = t.z;
  theirs[4 * i + 3] = t.w;
}
#endif

size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

// The workspace's parts, at offsets from its start.
Work work_at(void* base, int n_vocab) {
  const size_t tiles = static_cast<size_t>(ceil_div(n_vocab, kTile));
  uint8_t* p = static_cast<uint8_t*>(base);
  Work w;
  w.keys = reinterpret_cast<uint32_t*>(p);
  p += align_up(tiles * kTile * sizeof(uint32_t));
  w.ids = reinterpret_cast<int32_t*>(p);
  p += align_up(tiles * kTile * sizeof(int32_t));
  w.tiles = reinterpret_cast<TileStats*>(p);
  p += align_up(tiles * sizeof(TileStats));
  w.counts = reinterpret_cast<uint32_t*>(p);
  p += align_up(tiles * kBins * sizeof(uint32_t));
  w.masses = reinterpret_cast<unsigned long long*>(p);
  p += align_up(tiles * kBins * sizeof(unsigned long long));
  w.ticket = reinterpret_cast<unsigned*>(p);
  return w;
}

}  // namespace

size_t sample_work_bytes(int n_vocab) {
  const Work w = work_at(nullptr, n_vocab);
  return reinterpret_cast<uintptr_t>(w.ticket) + 256;
}

void launch_sample(Launcher& l, const float* logits, int n_vocab, const int32_t* config,
                   int32_t* tokens, int step, int k_total, void* work,
                   cudaGraphConditionalHandle next) {
  const Work w = work_at(work, n_vocab);
  const dim3 grid(static_cast<unsigned>(ceil_div(n_vocab, kTile)));
  l(sample_scan, grid, dim3(kThreads), 0, logits, n_vocab, config,
    static_cast<const int32_t*>(tokens), step, w);
  l(sample_pick, grid, dim3(kThreads), 0, logits, n_vocab, config, tokens, step, k_total, w, next);
}

void launch_chain_loop_round(Launcher& l, const ChainLoopArgs& args) {
  l(chain_loop_round, dim3(1), dim3(kLoopThreads), 0, args);
}

namespace {

// A round of loop_words_late_rounds: the round's number to the host (the `way` way), then a wait
// of at most `limit` cycles for the host to acknowledge it. state: the rounds so far, the rounds
// asked, the rounds whose acknowledgement did not come in time.
__global__ void ping_round(int32_t* host, int32_t* state, long long limit, HostWordWay way,
                           cudaGraphConditionalHandle loop) {
  pdl_begin();
  const int r = ++state[0];
  host_word_store(host, r, way);
  const long long t0 = clock64();
  int32_t ack = 0;
  do {
    ack = host_word_load(host + 1);
  } while (ack < r && clock64() - t0 < limit);
  if (ack < r) ++state[2];
  if (loop) cudaGraphSetConditional(loop, r < state[1] ? 1u : 0u);
}

// A conditional step of loop_words_late_rounds's executor loop: lets the next step run.
__global__ void ping_step(cudaGraphConditionalHandle next) {
  pdl_begin();
  if (threadIdx.x == 0 && next) cudaGraphSetConditional(next, 1u);
}

}  // namespace

int loop_words_late_rounds(int rounds, RoundsAs as, HostWordWay way) {
  void* mapped = nullptr;
  GGRAPH_CUDA_CHECK(cudaHostAlloc(&mapped, 2 * sizeof(int32_t), cudaHostAllocMapped));
  volatile int32_t* host = static_cast<volatile int32_t*>(mapped);
  host[0] = host[1] = 0;
  int32_t* host_dev = nullptr;
  int32_t* state = nullptr;
  cudaStream_t stream = nullptr, body_stream = nullptr;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::atomic<bool> done{false};
  // The host's side: acknowledges each count it sees.
  std::thread acker([&] {
    int32_t acked = 0;
    while (!done.load(std::memory_order_relaxed)) {
      const int32_t c = host[0];
      if (c > acked) host[1] = acked = c;
    }
  });
  int late = -1;
  try {
    GGRAPH_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&host_dev), mapped, 0));
    GGRAPH_CUDA_CHECK(cudaMalloc(&state, 3 * sizeof(int32_t)));
    const int32_t init[3] = {0, rounds, 0};
    GGRAPH_CUDA_CHECK(cudaMemcpy(state, init, sizeof(init), cudaMemcpyHostToDevice));
    GGRAPH_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    int clock_khz = 0, device = 0;
    GGRAPH_CUDA_CHECK(cudaGetDevice(&device));
    GGRAPH_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
    const long long limit = 100LL * clock_khz;  // 100 ms of cycles
    if (as == RoundsAs::kKernels) {
      for (int r = 0; r < rounds; ++r)
        ping_round<<<1, 1, 0, stream>>>(host_dev, state, limit, way, 0);
    } else if (as == RoundsAs::kExecutorLoop) {
      // As launch_graph lays out a chain loop: each step's kernel opens the next step's
      // conditional node, and the round's kernel (not programmatic) follows the steps.
      GraphExecutor executor(stream, GraphMode::Patch, false, true);
      if (!executor.runs_loops()) throw DeviceError("loop_words_late_rounds: no loops here");
      constexpr int kSteps = 4;
      executor.run(
          1,
          [&](Launcher& l) {
            l.open_loop();
            for (int j = 0; j < kSteps; ++j) {
              const bool gated = j + 1 < kSteps;
              l(ping_step, dim3(1), dim3(32), 0,
                gated ? l.step_handle(j + 1) : cudaGraphConditionalHandle(0));
              if (gated) l.open_step(j + 1);
            }
            l.end_steps();
            const bool pdl = std::exchange(l.pdl, false);
            l(ping_round, dim3(1), dim3(1), 0, host_dev, state, limit, way, l.loop_handle());
            l.pdl = pdl;
            l.close_loop();
          },
          [](int) { return std::string("the loop words' test rounds"); });
      GGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream));
    } else {
      // As a chain loop runs: a WHILE node whose body the round's kernel ends.
      GGRAPH_CUDA_CHECK(cudaGraphCreate(&graph, 0));
      cudaGraphConditionalHandle h = 0;
      GGRAPH_CUDA_CHECK(cudaGraphConditionalHandleCreate(&h, graph, 1, cudaGraphCondAssignDefault));
      const cudaGraph_t loop =
          StepGate::add_conditional_node(graph, nullptr, 0, h, cudaGraphCondTypeWhile);
      GGRAPH_CUDA_CHECK(cudaStreamCreateWithFlags(&body_stream, cudaStreamNonBlocking));
      GGRAPH_CUDA_CHECK(cudaStreamBeginCaptureToGraph(body_stream, loop, nullptr, nullptr, 0,
                                                      cudaStreamCaptureModeThreadLocal));
      ping_round<<<1, 1, 0, body_stream>>>(host_dev, state, limit, way, h);
      cudaGraph_t body = nullptr;
      GGRAPH_CUDA_CHECK(cudaStreamEndCapture(body_stream, &body));
      GGRAPH_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      GGRAPH_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    }
    GGRAPH_CUDA_CHECK(cudaStreamSynchronize(stream));
    int32_t out[3] = {};
    GGRAPH_CUDA_CHECK(cudaMemcpy(out, state, sizeof(out), cudaMemcpyDeviceToHost));
    late = out[0] == rounds ? out[2] : -1;
  } catch (...) {
    done = true;
    acker.join();
    throw;
  }
  done = true;
  acker.join();
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  if (body_stream) cudaStreamDestroy(body_stream);
  if (stream) cudaStreamDestroy(stream);
  cudaFree(state);
  cudaFreeHost(mapped);
  return late;
}

bool philox_against_curand(uint64_t seed, uint64_t first, int n, uint32_t* ours, uint32_t* theirs) {
#ifdef GGRAPH_HAVE_CURAND
  uint32_t* d = nullptr;
  const size_t words = static_cast<size_t>(n) * 4;
  GGRAPH_CUDA_CHECK(cudaMalloc(&d, 2 * words * sizeof(uint32_t)));
  philox_pairs_kernel<<<ceil_div(n, 128), 128>>>(seed, first, n, d, d + words);
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaMemcpy(ours, d, words * 4, cudaMemcpyDeviceToHost);
  if (err == cudaSuccess) err = cudaMemcpy(theirs, d + words, words * 4, cudaMemcpyDeviceToHost);
  cudaFree(d);
  GGRAPH_CUDA_CHECK(err);
  return true;
#else
  return false;
#endif
}

}  // namespace ggraph::cuda
