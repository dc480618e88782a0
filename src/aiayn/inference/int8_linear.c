/* y = x W^T + b in int8 on an x86 CPU with AVX2: aiayn's `--int8` product for every linear
 * layer of the decoder and its output layer (aiayn/inference/native.py builds and calls it).
 *
 * W is quantized once, each output row j on its own scale: W_jk ~ s_j q_jk with q_jk in
 * [-63, 63] (7 bits). Each row of x is quantized at every call on its own scale, to 7 bits
 * as well: x_ik ~ t_i (u_ik - 64) with u_ik in [1, 127]. Then
 *     y_ij = s_j t_i (sum_k u_ik q_jk - 64 sum_k q_jk) + b_j,
 * the sum computed exactly in integers and the column sums kept with the packed weights.
 * A row's result depends on that row's values alone, whatever the rows beside it (a
 * translation can still differ between batches, rarely: rounding to integers can turn fp32's
 * last-bit differences before the product into another integer).
 *
 * The integer products run on AVX2's vpmaddubsw (32 u8 x s8 products a call, summed in pairs
 * into 16-bit lanes, saturating) and vpmaddwd (pairs of 16-bit lanes summed into 32 bits).
 * Both run on the same two ports, and 7 bits on each side let one vpmaddwd serve two
 * vpmaddubsw: a pair is at most 2 * 127 * 63 = 16,002, so two groups' pairs add in 16 bits
 * (32,004 < 32,767) before widening. 1.1-1.2x the speed of 8-bit inputs (which need a
 * vpmaddwd for each), at the cost of a quarter more rounding (2.0% against 1.6% of a
 * product's size on random rows; the same BLEU on dev: docs/translating.md#int8-decoding).
 *
 * Where the CPU has AVX-512 VNNI (AMD Zen 4 and later, Intel Ice Lake and later), one
 * vpdpbusd does all of that for 64 products: the same integer sums, so the same floats as the
 * AVX2 path to the last bit (the epilogue is the same operations per element), in a quarter of
 * the instructions. The caller chooses the path (`avx512` says whether this CPU has it).
 *
 * Packed layout: panels of 16 output rows; a panel holds, for each group of 4 input columns,
 * 64 bytes: rows 0-7 (4 bytes each, the group's 4 weights), then rows 8-15 (one 512-bit
 * vector: VNNI's operand as it is); the columns padded with zero weights to a multiple of 8
 * (two groups a pass). */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PANEL 16 /* output rows per panel: two vectors of 8 */
#define TILE 4   /* rows of x per tile: 2 x 4 accumulators, 16 registers in all */
#define LEVELS 63 /* x_ik ~ t_i (u_ik - ZERO), |u_ik - ZERO| <= LEVELS: 7 bits */
#define ZERO 64
#define BLOCK 32 /* panels per pass over the rows of x: 512 output columns, whose weights stay in
                    the L2 cache while every row reads them, and whose results each row writes
                    side by side */

/* Row i of x (n columns) as bytes u (padded with ZERO, a zero, to `width`) and its scale. */
static void quantize_row(const float *x, long n, long width, uint8_t *u, float *scale) {
  __m256 top = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  long k = 0;
  for (; k + 8 <= n; k += 8) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(x + k), magnitude));
  float lanes[8], largest = 0.0f;
  _mm256_storeu_ps(lanes, top);
  for (int i = 0; i < 8; i++) largest = lanes[i] > largest ? lanes[i] : largest;
  for (; k < n; k++) largest = fabsf(x[k]) > largest ? fabsf(x[k]) : largest;
  const float s = largest > 0.0f ? largest / (float)LEVELS : 1.0f;
  *scale = s;
  const __m256 inverse = _mm256_set1_ps(1.0f / s);
  const __m256i offset = _mm256_set1_epi32(ZERO);
  for (k = 0; k + 8 <= n; k += 8) {  /* round to nearest, + ZERO: in [1, 2 ZERO - 1] */
    __m256i q = _mm256_add_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), inverse)), offset);
    int32_t v[8];
    _mm256_storeu_si256((__m256i *)v, q);
    for (int i = 0; i < 8; i++) u[k + i] = (uint8_t)v[i];
  }
  for (; k < n; k++) u[k] = (uint8_t)(lrintf(x[k] / s) + ZERO);
  for (; k < width; k++) u[k] = ZERO;
}

#define ACCUMULATE(r)                                                                  \
  if (rows > r) {                                                                      \
    const __m256i a = _mm256_set1_epi32(*(const int32_t *)(u + r * width + 4 * g));    \
    const __m256i c = _mm256_set1_epi32(*(const int32_t *)(u + r * width + 4 * g + 4)); \
    acc##r##0 = _mm256_add_epi32(acc##r##0, _mm256_madd_epi16(_mm256_add_epi16(          \
        _mm256_maddubs_epi16(a, w0), _mm256_maddubs_epi16(c, x0)), ones));             \
    acc##r##1 = _mm256_add_epi32(acc##r##1, _mm256_madd_epi16(_mm256_add_epi16(          \
        _mm256_maddubs_epi16(a, w1), _mm256_maddubs_epi16(c, x1)), ones));             \
  }
#define STORE(r)                                                                       \
  if (rows > r) {                                                                      \
    const __m256 t = _mm256_set1_ps(scales[r]);                                        \
    float out[PANEL];                                                                  \
    _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(           \
        _mm256_sub_epi32(acc##r##0, sum0)), t), s0, b0));                              \
    _mm256_storeu_ps(out + 8, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(       \
        _mm256_sub_epi32(acc##r##1, sum1)), t), s1, b1));                              \
    memcpy(y + r * ldy, out, sizeof(float) * columns);                                 \
  }

/* y[0:rows, 0:columns] of one panel for up to TILE rows of u; width a multiple of 8. */
static inline __attribute__((always_inline)) void tile(
    const uint8_t *u, const float *scales, long width, const int rows, const int8_t *panel,
    const int32_t *sums, const float *s, const float *b, float *y, long ldy, long columns) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc00 = _mm256_setzero_si256(), acc01 = acc00, acc10 = acc00, acc11 = acc00,
          acc20 = acc00, acc21 = acc00, acc30 = acc00, acc31 = acc00;
  for (long g = 0; g < width / 4; g += 2) {  /* two groups of 4 columns a pass */
    const __m256i w0 = _mm256_loadu_si256((const __m256i *)(panel + g * 64));
    const __m256i w1 = _mm256_loadu_si256((const __m256i *)(panel + g * 64 + 32));
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)(panel + g * 64 + 64));
    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(panel + g * 64 + 96));
    ACCUMULATE(0) ACCUMULATE(1) ACCUMULATE(2) ACCUMULATE(3)
  }
  /* ZERO sum_k q_jk (ZERO = 2^6), and s_j, b_j of the panel's rows */
  const __m256i sum0 = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)sums), 6);
  const __m256i sum1 = _mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(sums + 8)), 6);
  const __m256 s0 = _mm256_loadu_ps(s), s1 = _mm256_loadu_ps(s + 8);
  const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
  STORE(0) STORE(1) STORE(2) STORE(3)
}

static void any_tile(const uint8_t *u, const float *scales, long width, int rows, const int8_t *panel,
                     const int32_t *sums, const float *s, const float *b, float *y, long ldy, long columns) {
  switch (rows) {  /* one copy of the loop per row count: the accumulators stay in registers */
    case 4: tile(u, scales, width, 4, panel, sums, s, b, y, ldy, columns); break;
    case 3: tile(u, scales, width, 3, panel, sums, s, b, y, ldy, columns); break;
    case 2: tile(u, scales, width, 2, panel, sums, s, b, y, ldy, columns); break;
    default: tile(u, scales, width, 1, panel, sums, s, b, y, ldy, columns); break;
  }
}

/* The same tile with AVX-512 VNNI: a panel's 16 rows in one vector, two groups of 4 columns a
 * pass on accumulators of their own (8 chains for 4 rows, vpdpbusd's latency hidden), added
 * before the epilogue. Compiled for those instructions alone; called only where the CPU has them. */
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")))
#define ACCUMULATE_VNNI(r)                                                                          \
  if (rows > r) {                                                                                   \
    even##r = _mm512_dpbusd_epi32(even##r, _mm512_set1_epi32(*(const int32_t *)(u + r * width + 4 * g)), w0); \
    odd##r = _mm512_dpbusd_epi32(odd##r, _mm512_set1_epi32(*(const int32_t *)(u + r * width + 4 * g + 4)), w1); \
  }
#define STORE_VNNI(r)                                                                               \
  if (rows > r) {                                                                                   \
    const __m512i acc = _mm512_sub_epi32(_mm512_add_epi32(even##r, odd##r), sum);                   \
    _mm512_mask_storeu_ps(y + r * ldy, mask, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(acc),  \
        _mm512_set1_ps(scales[r])), s16, b16));                                                     \
  }

static inline __attribute__((always_inline)) VNNI void tile_vnni(
    const uint8_t *u, const float *scales, long width, const int rows, const int8_t *panel,
    const int32_t *sums, const float *s, const float *b, float *y, long ldy, long columns) {
  __m512i even0 = _mm512_setzero_si512(), even1 = even0, even2 = even0, even3 = even0,
          odd0 = even0, odd1 = even0, odd2 = even0, odd3 = even0;
  for (long g = 0; g < width / 4; g += 2) {
    const __m512i w0 = _mm512_loadu_si512((const void *)(panel + g * 64));
    const __m512i w1 = _mm512_loadu_si512((const void *)(panel + g * 64 + 64));
    ACCUMULATE_VNNI(0) ACCUMULATE_VNNI(1) ACCUMULATE_VNNI(2) ACCUMULATE_VNNI(3)
  }
  const __m512i sum = _mm512_slli_epi32(_mm512_loadu_si512((const void *)sums), 6);
  const __m512 s16 = _mm512_loadu_ps(s), b16 = _mm512_loadu_ps(b);
  const __mmask16 mask = (__mmask16)((1u << columns) - 1);
  STORE_VNNI(0) STORE_VNNI(1) STORE_VNNI(2) STORE_VNNI(3)
}

static VNNI void any_tile_vnni(const uint8_t *u, const float *scales, long width, int rows,
                               const int8_t *panel, const int32_t *sums, const float *s, const float *b,
                               float *y, long ldy, long columns) {
  switch (rows) {
    case 4: tile_vnni(u, scales, width, 4, panel, sums, s, b, y, ldy, columns); break;
    case 3: tile_vnni(u, scales, width, 3, panel, sums, s, b, y, ldy, columns); break;
    case 2: tile_vnni(u, scales, width, 2, panel, sums, s, b, y, ldy, columns); break;
    default: tile_vnni(u, scales, width, 1, panel, sums, s, b, y, ldy, columns); break;
  }
}

/* 1 where this CPU runs aiayn's AVX-512 paths (F, BW, VL and VNNI: AMD Zen 4 and later, Intel
 * Ice Lake and later), this product's and step_attention.c's, else 0. */
int avx512(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

/* y (m x n, row-major) = x (m x k, row-major) W^T + b for W packed as above: `width` = k
 * rounded up to 8, `panels` * 16 >= n; sums, s and b hold panels * 16 values (b zeros where
 * the layer has none). Returns 0, or -1 where the quantized rows' scratch (m x width bytes
 * and m scales) could not be allocated. wide: 1 for the AVX-512 VNNI path (where avx512()
 * says so), 0 for AVX2's; both give the same floats. */
int int8_linear(const float *x, long m, long k, const int8_t *packed, const int32_t *sums,
                const float *s, const float *b, long n, long width, float *y, int wide) {
  uint8_t *u = malloc(m * width + 32);
  float *scales = malloc(sizeof(float) * (m + 1));
  if (!u || !scales) {
    free(u);
    free(scales);
    return -1;
  }
  for (long i = 0; i < m; i++) quantize_row(x + i * k, k, width, u + i * width, scales + i);
  const long panels = (n + PANEL - 1) / PANEL;
  for (long first = 0; first < panels; first += BLOCK) {
    const long last = panels < first + BLOCK ? panels : first + BLOCK;
    for (long i = 0; i < m; i += TILE)
      for (long p = first; p < last; p++) {
        const long columns = n - p * PANEL < PANEL ? n - p * PANEL : PANEL;
        (wide ? any_tile_vnni : any_tile)(u + i * width, scales + i, width, m - i < TILE ? (int)(m - i) : TILE,
                                          packed + p * width * PANEL, sums + p * PANEL, s + p * PANEL,
                                          b + p * PANEL, y + i * n + p * PANEL, n, columns);
      }
  }
  free(u);
  free(scales);
  return 0;
}
