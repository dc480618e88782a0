/* Attention of one new query per row, the decoder's work at every step of a search: aiayn's
 * `--int8` engine calls it (aiayn/inference/native.py builds and calls it) where PyTorch's
 * scaled_dot_product_attention spends most of its time on setup at this size (one query,
 * a head of 64 values, a few dozen keys).
 *
 *     out_r = softmax(q_r K^T / sqrt(d_k)) V      (Attention Is All You Need, eq. 1)
 *
 * for each row r and head h, over the keys that row may see. `group` rows in a row share
 * one set of keys (a beam search's beams share their sentence's encoder memory, which
 * cross-attention reads once for all of them); self-attention has a set per row (group 1).
 * Keys and values may be float32 or float16 (the int8 engine keeps float16: half the bytes).
 *
 * rms_norm is QK-norm's x / rms(x) * g over each head (or whole query) of each row, in place,
 * torch.nn.RMSNorm's values up to rounding; log_softmax and top_log_softmax are the search's
 * log-probabilities of the next piece, the whole row or its k best. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* e^x, x <= 0 (softmax's shifted scores), given n = round(x / ln 2): x = n ln 2 + r with
 * |r| <= ln 2 / 2, e^r by its Taylor polynomial of degree 7 (relative error below 2e-7), 2^n
 * by the exponent bits; W is 256 or 512, the vector's width (one text for both widths: the
 * same operations, lane for lane the same values). */
#define EXP_FROM(W, x, n)                                                                \
  ({                                                                                     \
    /* r = x - n ln 2, ln 2 in two parts so that the product is exact */                 \
    __m##W r = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(0.693359375f), x);                 \
    r = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(-2.12194440e-4f), r);                     \
    __m##W p = _mm##W##_set1_ps(1.0f / 5040.0f);                                         \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.0f / 720.0f));                        \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.0f / 120.0f));                        \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.0f / 24.0f));                         \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.0f / 6.0f));                          \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(0.5f));                                 \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.0f));                                 \
    p = _mm##W##_fmadd_ps(p, r, _mm##W##_set1_ps(1.0f));                                 \
    _mm##W##_mul_ps(p, _mm##W##_castsi##W##_ps(_mm##W##_slli_epi32(                      \
        _mm##W##_add_epi32(_mm##W##_cvtps_epi32(n), _mm##W##_set1_epi32(127)), 23)));     \
  })

/* e^x for 8 floats, x <= 0. Below -87 it is 0, as expf's result underflows there. */
static inline __m256 exp_nonpositive(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm256_andnot_ps(underflow, EXP_FROM(256, x, n));
}

static inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline float max8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* The 8 sums of a[i] (8 vectors) in one vector, lane i. */
static inline __m256 sums8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                           __m256 a6, __m256 a7) {
  const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
  const __m256 b2 = _mm256_hadd_ps(a4, a5), b3 = _mm256_hadd_ps(a6, a7);
  const __m256 c0 = _mm256_hadd_ps(b0, b1), c1 = _mm256_hadd_ps(b2, b3);
  /* c0 lanes: (0 1 2 3 | 0 1 2 3) halves, c1 the same for 4-7 */
  return _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
}

/* Keys and values are float32 or float16 (half the memory a step reads; F16C converts 8 at a
 * time): the products below are written once for each, as dots_f32 / dots_f16 and so on. */
static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load_f16(const uint16_t *p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* s[j] = q . k_j for j < n, k_j at k + at[j], d a multiple of the vector's width: 8 keys at a
 * time on accumulators of their own, each narrowed to 8 lanes (`narrow`) before their sums.
 * Written once for AVX2's 8-lane vectors and AVX-512's 16-lane ones (below). */
#define DOTS(name, vec, width, zero, loadq, fmadd, narrow, type, load, target)           \
  static target void name(const float *q, const type *k, const long *at, long n, long d, float *s) { \
    long j = 0;                                                                         \
    for (; j + 8 <= n; j += 8) {                                                        \
      vec a0 = zero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;  \
      const type *k0 = k + at[j], *k1 = k + at[j + 1], *k2 = k + at[j + 2], *k3 = k + at[j + 3], \
                 *k4 = k + at[j + 4], *k5 = k + at[j + 5], *k6 = k + at[j + 6],          \
                 *k7 = k + at[j + 7];                                                   \
      for (long c = 0; c < d; c += width) {                                             \
        const vec qc = loadq(q + c);                                                    \
        a0 = fmadd(qc, load(k0 + c), a0);                                               \
        a1 = fmadd(qc, load(k1 + c), a1);                                               \
        a2 = fmadd(qc, load(k2 + c), a2);                                               \
        a3 = fmadd(qc, load(k3 + c), a3);                                               \
        a4 = fmadd(qc, load(k4 + c), a4);                                               \
        a5 = fmadd(qc, load(k5 + c), a5);                                               \
        a6 = fmadd(qc, load(k6 + c), a6);                                               \
        a7 = fmadd(qc, load(k7 + c), a7);                                               \
      }                                                                                 \
      _mm256_storeu_ps(s + j, sums8(narrow(a0), narrow(a1), narrow(a2), narrow(a3), narrow(a4), \
                                    narrow(a5), narrow(a6), narrow(a7)));               \
    }                                                                                   \
    for (; j < n; j++) {                                                                \
      vec a = zero();                                                                   \
      for (long c = 0; c < d; c += width) a = fmadd(loadq(q + c), load(k + at[j] + c), a); \
      s[j] = sum8(narrow(a));                                                           \
    }                                                                                   \
  }
static inline __m256 same8(__m256 a) { return a; }
DOTS(dots_f32, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, same8, float,
     load_f32, )
DOTS(dots_f16, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, same8, uint16_t,
     load_f16, )

/* out = sum_j w_j v_j for j < n, v_j at v + at[j], skipping the j of weight 0 (masked keys,
 * whose values are never read); d a multiple of 8, at most 128. Even and odd keys add into
 * accumulators of their own, summed at the end: each chain of dependent additions is half as
 * long (their latency, not the products, bounds this loop). The body is compiled for d = 64,
 * every Transformer preset's d_k, with the accumulators in registers, and for any d. */
#define WEIGHTED_SUM(name, vec, width, zero, set1, fmadd, add, store, type, load, target)     \
  static inline __attribute__((always_inline)) target void name##_body(                  \
      const float *w, const type *v, const long *at, long n, const long vectors, float *out) { \
    vec even[128 / width], odd[128 / width];                                             \
    for (long c = 0; c < vectors; c++) even[c] = odd[c] = zero();                        \
    long j = 0;                                                                          \
    for (; j + 2 <= n; j += 2) {                                                         \
      if (w[j] != 0.0f) {                                                                \
        const vec wj = set1(w[j]);                                                       \
        for (long c = 0; c < vectors; c++) even[c] = fmadd(wj, load(v + at[j] + width * c), even[c]); \
      }                                                                                  \
      if (w[j + 1] != 0.0f) {                                                            \
        const vec wj = set1(w[j + 1]);                                                   \
        for (long c = 0; c < vectors; c++) odd[c] = fmadd(wj, load(v + at[j + 1] + width * c), odd[c]); \
      }                                                                                  \
    }                                                                                    \
    if (j < n && w[j] != 0.0f) {                                                         \
      const vec wj = set1(w[j]);                                                         \
      for (long c = 0; c < vectors; c++) even[c] = fmadd(wj, load(v + at[j] + width * c), even[c]); \
    }                                                                                    \
    for (long c = 0; c < vectors; c++) store(out + width * c, add(even[c], odd[c]));     \
  }                                                                                      \
  static target void name(const float *w, const type *v, const long *at, long n, long d, float *out) { \
    if (d == 64)                                                                         \
      name##_body(w, v, at, n, 64 / width, out);                                         \
    else                                                                                 \
      name##_body(w, v, at, n, d / width, out);                                          \
  }
WEIGHTED_SUM(weighted_sum_f32, __m256, 8, _mm256_setzero_ps, _mm256_set1_ps, _mm256_fmadd_ps,
             _mm256_add_ps, _mm256_storeu_ps, float, load_f32, )
WEIGHTED_SUM(weighted_sum_f16, __m256, 8, _mm256_setzero_ps, _mm256_set1_ps, _mm256_fmadd_ps,
             _mm256_add_ps, _mm256_storeu_ps, uint16_t, load_f16, )

/* The same two products on AVX-512 (where avx512() in int8_linear.c says the CPU has it, and
 * d is a multiple of 16): a head's 64 values in 4 vectors instead of 8, half the instructions;
 * the same values up to float rounding (the sums run in another order). */
#define WIDE __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
static inline WIDE __m512 load16_f32(const float *p) { return _mm512_loadu_ps(p); }
static inline WIDE __m512 load16_f16(const uint16_t *p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
static inline WIDE __m256 halves(__m512 a) {  /* lanes i and i + 8 added */
  return _mm256_add_ps(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}

DOTS(dots_f32_wide, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps, halves,
     float, load16_f32, WIDE)
DOTS(dots_f16_wide, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps, halves,
     uint16_t, load16_f16, WIDE)

#define WIDE_SUM(name, type, load) WEIGHTED_SUM(name, __m512, 16, _mm512_setzero_ps, _mm512_set1_ps, \
                                       _mm512_fmadd_ps, _mm512_add_ps, _mm512_storeu_ps, type, load, WIDE)
WIDE_SUM(weighted_sum_f32_wide, float, load16_f32)
WIDE_SUM(weighted_sum_f16_wide, uint16_t, load16_f16)

/* The keys a row's softmax reads: from its first visible key rounded down to a multiple of 8
 * to its last visible one rounded up to a multiple of 8 (at most n), every key when there is no
 * mask. A serving lane's rows see only the cache's columns from where their sentence joined,
 * and cross-attention only its own source, not the padding to the longest: the keys outside
 * are masked, and would cost their products and exponentials for nothing. Whole blocks of 8
 * from a multiple of 8 leave every sum as it was to the bit (of finite scores): the blocks keep
 * their places, and what falls out added zeros (and skipped weights) to its lanes. No visible
 * key: an empty window. */
static void window(const uint8_t *visible, long n, long *first, long *end) {
  *first = 0;
  *end = n;
  if (!visible) return;
  long lo = 0, hi = n;
  while (lo < n && !visible[lo]) lo++;
  while (hi > lo && !visible[hi - 1]) hi--;
  *first = lo & ~7L;
  *end = hi == lo ? *first : ((hi + 7) & ~7L) < n ? ((hi + 7) & ~7L) : n;
}

/* Row r, head h: q at q + r * q_row + h * d. Its key j of head h is at k + slot * k_row +
 * h * k_head + j * k_pos (v alike, with v's strides), where slot is its key set r / group,
 * or, given `ancestry` (group 1: a cache that keeps each position where it was written),
 * ancestry[r * ancestry_row + j] for j < written, r itself after. mask (NULL: every key
 * visible) holds one byte per key of each key set, at mask + (r / group) * mask_row + j,
 * nonzero where the key may be seen; masked keys are never read beyond their product with q
 * (a cache's unwritten positions may hold anything). k and v: float16 where `half`, else
 * float32; strides in elements. out at out + r * out_row + h * d. A row that may see no key
 * gets zeros. d: a multiple of 8, at most 128. wide: 1 for the AVX-512 products where d is a
 * multiple of 16 (the caller asks where avx512() says so). Returns 0, or -1 where its scratch
 * (n_keys floats and 2 n_keys offsets) could not be allocated. */
int step_attention(const float *q, long q_row, long rows, long group, long heads, long d,
                    const void *k, long k_row, long k_head, long k_pos,
                    const void *v, long v_row, long v_head, long v_pos, long n_keys, int half,
                    const int64_t *ancestry, long ancestry_row, long written,
                    const uint8_t *mask, long mask_row, float *out, long out_row, int wide) {
  float *scores = malloc(sizeof(float) * (n_keys + 8));
  long *at = malloc(sizeof(long) * 2 * (n_keys + 1));
  if (!scores || !at) {
    free(scores);
    free(at);
    return -1;
  }
  wide = wide && d % 16 == 0;
  void (*dots_f16_at)(const float *, const uint16_t *, const long *, long, long, float *) =
      wide ? dots_f16_wide : dots_f16;
  void (*dots_f32_at)(const float *, const float *, const long *, long, long, float *) =
      wide ? dots_f32_wide : dots_f32;
  void (*sum_f16_at)(const float *, const uint16_t *, const long *, long, long, float *) =
      wide ? weighted_sum_f16_wide : weighted_sum_f16;
  void (*sum_f32_at)(const float *, const float *, const long *, long, long, float *) =
      wide ? weighted_sum_f32_wide : weighted_sum_f32;
  const float scale = 1.0f / sqrtf((float)d);
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  long *at_v = at + n_keys;
  long placed = -1; /* the key set whose offsets at and at_v hold */
  long first = 0, end = n_keys; /* its window: the keys from `first` to `end` (see window()) */
  for (long r = 0; r < rows; r++) {
    const long s = r / group;
    const uint8_t *visible = mask ? mask + s * mask_row : 0;
    if (ancestry || s != placed) { /* a group's rows share one set's offsets: placed once */
      window(visible, n_keys, &first, &end);
      long j = first;
      if (ancestry)
        for (; j < written && j < end; j++) {
          const long slot = ancestry[r * ancestry_row + j];
          at[j] = slot * k_row + j * k_pos;
          at_v[j] = slot * v_row + j * v_pos;
        }
      /* the rest one stride apart: additions (a product per key, vectorized as 64-bit
         multiplications emulated, took most of this function's time) */
      for (long kj = s * k_row + j * k_pos, vj = s * v_row + j * v_pos; j < end;
           j++, kj += k_pos, vj += v_pos) {
        at[j] = kj;
        at_v[j] = vj;
      }
      placed = s;
    }
    for (long h = 0; h < heads; h++) {
      float *o = out + r * out_row + h * d;
      if (half)
        dots_f16_at(q + r * q_row + h * d, (const uint16_t *)k + h * k_head, at + first, end - first, d,
                    scores + first);
      else
        dots_f32_at(q + r * q_row + h * d, (const float *)k + h * k_head, at + first, end - first, d,
                    scores + first);
      /* scale, mask, and the largest score (softmax's shift) */
      __m256 top = minus_inf;
      long j = first;
      const __m256 scale8 = _mm256_set1_ps(scale);
      for (; j + 8 <= end; j += 8) {
        __m256 x = _mm256_mul_ps(_mm256_loadu_ps(scores + j), scale8);
        if (visible) {
          const __m128i bytes = _mm_loadl_epi64((const __m128i *)(visible + j));
          const __m256 seen = _mm256_castsi256_ps(_mm256_cmpgt_epi32(
              _mm256_cvtepu8_epi32(bytes), _mm256_setzero_si256()));
          x = _mm256_blendv_ps(minus_inf, x, seen);
        }
        _mm256_storeu_ps(scores + j, x);
        top = _mm256_max_ps(top, x);
      }
      float largest = max8(top);
      for (; j < end; j++) {
        scores[j] = (!visible || visible[j]) ? scores[j] * scale : -INFINITY;
        largest = scores[j] > largest ? scores[j] : largest;
      }
      if (largest == -INFINITY) {  /* nothing to attend to */
        for (long c = 0; c < d; c += 8) _mm256_storeu_ps(o + c, _mm256_setzero_ps());
        continue;
      }
      /* w_j = e^(x_j - max) / sum */
      const __m256 shift = _mm256_set1_ps(largest);
      __m256 total8 = _mm256_setzero_ps();
      for (j = first; j + 8 <= end; j += 8) {
        const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(scores + j), shift));
        _mm256_storeu_ps(scores + j, e);
        total8 = _mm256_add_ps(total8, e);
      }
      float total = sum8(total8);
      for (; j < end; j++) {
        scores[j] = scores[j] == -INFINITY ? 0.0f : expf(scores[j] - largest);
        total += scores[j];
      }
      const float inverse = 1.0f / total;
      if (half)
        sum_f16_at(scores + first, (const uint16_t *)v + h * v_head, at_v + first, end - first, d, o);
      else
        sum_f32_at(scores + first, (const float *)v + h * v_head, at_v + first, end - first, d, o);
      const __m256 inverse8 = _mm256_set1_ps(inverse);
      for (long c = 0; c < d; c += 8) _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(o + c), inverse8));
    }
  }
  free(scores);
  free(at);
  return 0;
}

/* x / sqrt(mean(x^2) + eps) * g over each of `rows` runs of d values, in place; d a multiple of 8. */
void rms_norm(float *x, long rows, long d, const float *g, float eps) {
  for (long r = 0; r < rows; r++) {
    float *y = x + r * d;
    __m256 squares = _mm256_setzero_ps();
    for (long c = 0; c < d; c += 8) {
      const __m256 v = _mm256_loadu_ps(y + c);
      squares = _mm256_fmadd_ps(v, v, squares);
    }
    const __m256 factor = _mm256_set1_ps(1.0f / sqrtf(sum8(squares) / (float)d + eps));
    for (long c = 0; c < d; c += 8)
      _mm256_storeu_ps(y + c, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(y + c), factor),
                                            _mm256_loadu_ps(g + c)));
  }
}

/* max + log(sum_j e^(x_j - max)) of n values whose largest is `largest` (finite): what log
 * softmax subtracts from each. */
static float log_sum_exp(const float *a, long n, float largest) {
  const __m256 shift = _mm256_set1_ps(largest);
  __m256 total8 = _mm256_setzero_ps();
  long j = 0;
  for (; j + 8 <= n; j += 8)
    total8 = _mm256_add_ps(total8, exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(a + j), shift)));
  float total = sum8(total8);
  for (; j < n; j++) total += expf(a[j] - largest);
  return largest + logf(total);
}

/* e^x for 16 floats, x <= 0: exp_nonpositive's operations, lane for lane the same values. */
static inline WIDE __m512 exp16_nonpositive(__m512 x) {
  const __m512 low = _mm512_set1_ps(-87.0f);
  const __mmask16 kept = _mm512_cmp_ps_mask(x, low, _CMP_NLT_UQ); /* not below -87, as there */
  x = _mm512_max_ps(x, low);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_maskz_mov_ps(kept, EXP_FROM(512, x, n));
}

/* log_sum_exp on AVX-512: 16 exponentials at a time, the same ones; the sum's order, so its
 * last bit, differs from the AVX2 one's. */
static WIDE float log_sum_exp_wide(const float *a, long n, float largest) {
  const __m512 shift = _mm512_set1_ps(largest);
  __m512 total16 = _mm512_setzero_ps();
  long j = 0;
  for (; j + 16 <= n; j += 16)
    total16 = _mm512_add_ps(total16, exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(a + j), shift)));
  if (j < n) { /* the last n - j < 16 values, the lanes past them 0 */
    const __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
    const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, a + j), shift));
    total16 = _mm512_add_ps(total16, _mm512_maskz_mov_ps(tail, e));
  }
  return largest + logf(_mm512_reduce_add_ps(total16));
}

/* y = x - max - log(sum_j e^(x_j - max)) over each of `rows` rows of n values (log softmax:
 * a search's log-probabilities of the next piece), y may be x; -inf stays -inf, and a row
 * of -inf alone gives -inf. wide: the sum of exponentials on AVX-512 (where avx512() says so). */
void log_softmax(const float *x, long rows, long n, float *y, int wide) {
  for (long r = 0; r < rows; r++) {
    const float *a = x + r * n;
    float *b = y + r * n;
    __m256 top = _mm256_set1_ps(-INFINITY);
    long j = 0;
    for (; j + 8 <= n; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(a + j));
    float largest = max8(top);
    for (; j < n; j++) largest = a[j] > largest ? a[j] : largest;
    if (largest == -INFINITY) {
      for (j = 0; j < n; j++) b[j] = -INFINITY;
      continue;
    }
    const float offset = wide ? log_sum_exp_wide(a, n, largest) : log_sum_exp(a, n, largest);
    const __m256 offset8 = _mm256_set1_ps(offset);
    for (j = 0; j + 8 <= n; j += 8) _mm256_storeu_ps(b + j, _mm256_sub_ps(_mm256_loadu_ps(a + j), offset8));
    for (; j < n; j++) b[j] = a[j] - offset;
  }
}

/* Put a[j] among the k best so far (value[0] largest), if it is larger than the last. */
static inline void keep_best(float x, long j, long k, float *value, long *column) {
  if (!(x > value[k - 1])) return;
  long i = k - 1;
  for (; i > 0 && x > value[i - 1]; i--) {
    value[i] = value[i - 1];
    column[i] = column[i - 1];
  }
  value[i] = x;
  column[i] = j;
}

/* keep_best over a[j..] 8 (or 16) values a compare, from j (a multiple of 8) for as many as
 * whole vectors cover: where it stopped. */
static long scan(const float *a, long j, long n, long k, float *v, long *c) {
  __m256 bar = _mm256_set1_ps(v[k - 1]);
  for (; j + 8 <= n; j += 8) {
    int above = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(a + j), bar, _CMP_GT_OQ));
    if (!above) continue;
    for (; above; above &= above - 1) keep_best(a[j + __builtin_ctz(above)], j + __builtin_ctz(above), k, v, c);
    bar = _mm256_set1_ps(v[k - 1]);
  }
  return j;
}

static WIDE long scan_wide(const float *a, long j, long n, long k, float *v, long *c) {
  __m512 bar = _mm512_set1_ps(v[k - 1]);
  for (; j + 16 <= n; j += 16) {
    unsigned above = _mm512_cmp_ps_mask(_mm512_loadu_ps(a + j), bar, _CMP_GT_OQ);
    if (!above) continue;
    for (; above; above &= above - 1) keep_best(a[j + __builtin_ctz(above)], j + __builtin_ctz(above), k, v, c);
    bar = _mm512_set1_ps(v[k - 1]);
  }
  return scan(a, j, n, k, v, c);  /* 8 more, where they remain */
}

/* The k largest log-probabilities of each row of x (rows x n), largest first, and their
 * columns, 1 <= k <= n: log_softmax's values (the same floats) and then topk, without writing
 * the n log-probabilities. One pass finds the k largest x_j: the first k, then any value
 * above the k-th best so far (few, after the first hundred: a vector compare skips the rest);
 * their largest is the max the sum of exponentials needs. Among equal values the first
 * column wins (topk's order among ties is not fixed). NaN, a broken model's logit, is never
 * ranked (topk puts it first). wide: the scan and the sum on AVX-512 (where avx512() says so);
 * log_softmax with the same `wide` gives the same floats. */
void top_log_softmax(const float *x, long rows, long n, long k, float *value, long *column,
                     int wide) {
  for (long r = 0; r < rows; r++) {
    const float *a = x + r * n;
    float *v = value + r * k;
    long *c = column + r * k;
    for (long i = 0; i < k; i++) {
      v[i] = -INFINITY;
      c[i] = i;
    }
    for (long i = 0; i < k; i++) {  /* the first k, -inf or not, sorted in */
      long at = i;
      for (; at > 0 && a[i] > v[at - 1]; at--) {
        v[at] = v[at - 1];
        c[at] = c[at - 1];
      }
      v[at] = a[i];
      c[at] = i;
    }
    long j = k;
    for (; j < n && j % 8; j++) keep_best(a[j], j, k, v, c);
    j = wide ? scan_wide(a, j, n, k, v, c) : scan(a, j, n, k, v, c);
    for (; j < n; j++) keep_best(a[j], j, k, v, c);
    if (v[0] == -INFINITY) continue;  /* a row of -inf alone: -inf */
    const float offset = wide ? log_sum_exp_wide(a, n, v[0]) : log_sum_exp(a, n, v[0]);
    for (long i = 0; i < k; i++) v[i] -= offset;
  }
}
