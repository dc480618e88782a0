/* The layers of section 3.1 in one call each, the int8 engine's work: an encoder layer over
 * whole sentences (`encoder_layer`, a sentence's encoding when it joins a search) and a decoder
 * layer for one new position per row (`decoder_layer_step`, every step of a search).
 * aiayn/inference/int8.py calls them through native.py. At the few rows of a step, or the
 * few dozen of one sentence, a layer's arithmetic is a few microseconds; computed module by
 * module from Python it took ~0.3 ms a decoder layer and ~0.8 ms an encoder layer, most of it
 * in calls, views and allocations (docs/translating.md#int8-decoding). The same kernels do
 * the products, attention and QK-norm as the modules do (int8_linear.c's product,
 * step_attention.c's attention and QK-norm); only the layer norm and the residual additions
 * are computed here rather than by PyTorch (and the encoder's attention by step_attention.c
 * rather than PyTorch's fused kernel: the same formula, equal up to rounding).
 *
 *   pre-norm:  x = x + SelfAttn(LN1(x)); x = x + CrossAttn(LN2(x), memory); x = x + FFN(LN3(x))
 *   post-norm: x = LN1(x + SelfAttn(x)); x = LN2(x + CrossAttn(x, memory)); x = LN3(x + FFN(x))
 *   FFN(x) = max(0, x W1 + b1) W2 + b2                                   (eq. 2)
 *   (an encoder layer: the same without CrossAttn, its FFN's norm the second)
 *
 * A sentence joining a search goes from its source ids to every decoder layer's memory keys
 * and values in one call too (`encode_memory`: the encoder, its final layer_norm, and each
 * layer's `memory_kv`).
 *
 * Self-attention's new key and value of each row are written, as float16, into its own slot
 * of the cache's store at `position` (aiayn/cache.py: Store, position-major), then read with
 * the row's ancestry, as the Python path writes and reads them. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int int8_linear(const float *x, long m, long k, const int8_t *packed, const int32_t *sums,
                const float *s, const float *b, long n, long width, float *y, int wide);
int step_attention(const float *q, long q_row, long rows, long group, long heads, long d,
                   const void *k, long k_row, long k_head, long k_pos,
                   const void *v, long v_row, long v_head, long v_pos, long n_keys, int half,
                   const int64_t *ancestry, long ancestry_row, long written,
                   const uint8_t *mask, long mask_row, float *out, long out_row, int wide);
void rms_norm(float *x, long rows, long d, const float *g, float eps);

typedef struct { /* a packed product, native.PackedInt8's tensors */
  const int8_t *packed;
  const int32_t *sums;
  const float *scales, *bias;
  long n, k, width;
} Product;

typedef struct { /* one layer's fixed weights (int8.py fills it); an encoder layer's: qkv,
                   self_out, ff1 and ff2, its two norms first, no cross-attention */
  Product qkv, self_out, cross_q, cross_out, ff1, ff2;
  const float *norm_gain[3], *norm_bias[3]; /* the three sublayers' LayerNorms */
  const float *q_norm, *k_norm;             /* self-attention's QK-norm gains (d_k), or NULL */
  const float *cross_q_norm;                /* cross-attention's query gain, or NULL */
  long cross_q_whole;                       /* 1: that gain spans d_model, else d_k */
  long d_model, heads, d_ff, norm_first;
  float norm_eps, qk_eps;
} Layer;

typedef struct { /* where a step reads and writes: the cache and the masks */
  uint16_t *keys, *values;    /* the store's (L, R, H, d_k) float16 */
  long slot_row, slot_pos;    /* their strides: a row's slot, a position */
  long position;              /* where this step's key and value go */
  const int64_t *ancestry;    /* (rows, written) slots of the earlier positions, or NULL */
  long ancestry_row, written;
  const uint8_t *self_mask;   /* (rows or 1, position + 1) may-attend, or NULL */
  long self_mask_row;
  const void *cross_k, *cross_v; /* the memory's K/V, (sets, H, S, d_k) by the strides below
                                    (encode_memory writes them position-major), float16 or float32 */
  long ck_row, ck_head, ck_pos, cv_row, cv_head, cv_pos, sources, group, cross_half;
  const uint8_t *src_mask;    /* (sets or 1, S) may-attend, or NULL */
  long src_mask_row;
} Step;

/* y = (x - mean) / sqrt(var + eps) * g + b over each row of d values (torch.nn.LayerNorm's,
 * up to rounding); d a multiple of 8; y may be x. */
void layer_norm(const float *x, long rows, long d, const float *g, const float *b, float eps,
                       float *y) {
  for (long r = 0; r < rows; r++) {
    const float *a = x + r * d;
    float *o = y + r * d;
    __m256 total = _mm256_setzero_ps();
    for (long c = 0; c < d; c += 8) total = _mm256_add_ps(total, _mm256_loadu_ps(a + c));
    float lanes[8], mean = 0.0f, var = 0.0f;
    _mm256_storeu_ps(lanes, total);
    for (int i = 0; i < 8; i++) mean += lanes[i];
    mean /= (float)d;
    const __m256 m = _mm256_set1_ps(mean);
    __m256 squares = _mm256_setzero_ps();
    for (long c = 0; c < d; c += 8) {
      const __m256 e = _mm256_sub_ps(_mm256_loadu_ps(a + c), m);
      squares = _mm256_fmadd_ps(e, e, squares);
    }
    _mm256_storeu_ps(lanes, squares);
    for (int i = 0; i < 8; i++) var += lanes[i];
    const __m256 factor = _mm256_set1_ps(1.0f / sqrtf(var / (float)d + eps));
    for (long c = 0; c < d; c += 8)
      _mm256_storeu_ps(o + c, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(a + c), m),
                                                            factor),
                                              _mm256_loadu_ps(g + c), _mm256_loadu_ps(b + c)));
  }
}

static int product(const Product *p, const float *x, long m, float *y, int wide) {
  return int8_linear(x, m, p->k, p->packed, p->sums, p->scales, p->bias, p->n, p->width, y, wide);
}

static void add(float *x, const float *y, long count) { /* x += y */
  long i = 0;
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < count; i++) x[i] += y[i];
}

static void to_half(const float *x, long count, uint16_t *y) { /* round to nearest even */
  for (long i = 0; i < count; i += 8)
    _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
}

/* The sublayer's input: LN(x) before it (pre-norm), x itself after (post-norm). */
static const float *sublayer_input(const Layer *L, int i, const float *x, long rows, float *h) {
  if (!L->norm_first) return x;
  layer_norm(x, rows, L->d_model, L->norm_gain[i], L->norm_bias[i], L->norm_eps, h);
  return h;
}

/* x += y, then LN(x) after it (post-norm). */
static void residual(const Layer *L, int i, float *x, const float *y, long rows) {
  add(x, y, rows * L->d_model);
  if (!L->norm_first) layer_norm(x, rows, L->d_model, L->norm_gain[i], L->norm_bias[i], L->norm_eps, x);
}

/* The position-wise feed-forward sublayer (norm i) on x, in place: h (rows x d_model) and
 * wide_out (rows x d_ff) are scratch. Returns 0, or -1 where a product failed. */
static int feed_forward(const Layer *L, int i, float *x, long rows, float *h, float *wide_out, int wide) {
  const float *in = sublayer_input(L, i, x, rows, h);
  if (product(&L->ff1, in, rows, wide_out, wide)) return -1;
  const __m256 zero = _mm256_setzero_ps();
  for (long j = 0; j < rows * L->d_ff; j += 8)
    _mm256_storeu_ps(wide_out + j, _mm256_max_ps(_mm256_loadu_ps(wide_out + j), zero));
  if (product(&L->ff2, wide_out, rows, h, wide)) return -1;
  residual(L, i, x, h, rows);
  return 0;
}

/* x (rows x d_model, row-major): the layer's input, its output on return. Returns 0, or -1
 * where scratch could not be allocated (x is then unchanged or partly updated: the caller
 * fails the step). wide: the AVX-512 paths of the product and the attention (avx512()). */
int decoder_layer_step(const Layer *L, const Step *s, float *x, long rows, int wide) {
  const long d = L->d_model, H = L->heads, dk = d / H;
  const long widest = 3 * d > L->d_ff ? 3 * d : L->d_ff;
  float *scratch = malloc(sizeof(float) * rows * (2 * d + widest) + 64);
  if (!scratch) return -1;
  float *h = scratch, *att = h + rows * d, *wide_out = att + rows * d;
  int failed = 0;

  /* masked self-attention over the positions so far and this one */
  const float *in = sublayer_input(L, 0, x, rows, h);
  failed |= product(&L->qkv, in, rows, wide_out, wide); /* (rows, 3d): q | k | v */
  for (long r = 0; r < rows && !failed; r++) {
    float *qkv = wide_out + r * 3 * d;
    if (L->q_norm) rms_norm(qkv, H, dk, L->q_norm, L->qk_eps);
    if (L->k_norm) rms_norm(qkv + d, H, dk, L->k_norm, L->qk_eps);
    to_half(qkv + d, d, s->keys + s->position * s->slot_pos + r * s->slot_row);
    to_half(qkv + 2 * d, d, s->values + s->position * s->slot_pos + r * s->slot_row);
  }
  failed = failed || step_attention(wide_out, 3 * d, rows, 1, H, dk, s->keys, s->slot_row, dk, s->slot_pos,
                                    s->values, s->slot_row, dk, s->slot_pos, s->position + 1, 1,
                                    s->ancestry, s->ancestry_row, s->written, s->self_mask,
                                    s->self_mask_row, att, d, wide);
  failed = failed || product(&L->self_out, att, rows, h, wide);
  if (!failed) residual(L, 0, x, h, rows);

  /* encoder-decoder attention over the memory's keys and values */
  if (!failed) {
    in = sublayer_input(L, 1, x, rows, h);
    failed = product(&L->cross_q, in, rows, wide_out, wide);
  }
  if (!failed && L->cross_q_norm) {
    if (L->cross_q_whole) rms_norm(wide_out, rows, d, L->cross_q_norm, L->qk_eps);
    else rms_norm(wide_out, rows * H, dk, L->cross_q_norm, L->qk_eps);
  }
  failed = failed || step_attention(wide_out, d, rows, s->group, H, dk, s->cross_k, s->ck_row, s->ck_head,
                                    s->ck_pos, s->cross_v, s->cv_row, s->cv_head, s->cv_pos, s->sources,
                                    (int)s->cross_half, 0, 0, 0, s->src_mask, s->src_mask_row, att, d, wide);
  failed = failed || product(&L->cross_out, att, rows, h, wide);
  if (!failed) residual(L, 1, x, h, rows);

  failed = failed || feed_forward(L, 2, x, rows, h, wide_out, wide);
  free(scratch);
  return failed ? -1 : 0;
}

/* x (sets x length rows of d_model, row-major: `sets` sentences padded to `length`): the
 * encoder layer's input, its output on return. mask: (sets, length) bytes, nonzero where a
 * key may be seen (not padding). Padded positions are computed too, as the modules compute
 * them (nothing reads them). Returns 0, or -1 as decoder_layer_step. */
int encoder_layer(const Layer *L, float *x, long sets, long length, const uint8_t *mask, int wide) {
  const long d = L->d_model, H = L->heads, dk = d / H, rows = sets * length;
  const long widest = 3 * d > L->d_ff ? 3 * d : L->d_ff;
  float *scratch = malloc(sizeof(float) * rows * (2 * d + widest) + 64);
  if (!scratch) return -1;
  float *h = scratch, *att = h + rows * d, *wide_out = att + rows * d;

  /* self-attention over the sentence's own positions, padding masked */
  const float *in = sublayer_input(L, 0, x, rows, h);
  int failed = product(&L->qkv, in, rows, wide_out, wide); /* (rows, 3d): q | k | v */
  for (long r = 0; r < rows && !failed; r++) {
    if (L->q_norm) rms_norm(wide_out + r * 3 * d, H, dk, L->q_norm, L->qk_eps);
    if (L->k_norm) rms_norm(wide_out + r * 3 * d + d, H, dk, L->k_norm, L->qk_eps);
  }
  /* a sentence's rows are one key set: its `length` keys one row (3d) apart */
  failed = failed || step_attention(wide_out, 3 * d, rows, length, H, dk, wide_out + d, length * 3 * d,
                                    dk, 3 * d, wide_out + 2 * d, length * 3 * d, dk, 3 * d, length, 0,
                                    0, 0, 0, mask, length, att, d, wide);
  failed = failed || product(&L->self_out, att, rows, h, wide);
  if (!failed) residual(L, 0, x, h, rows);
  failed = failed || feed_forward(L, 1, x, rows, h, wide_out, wide);
  free(scratch);
  return failed ? -1 : 0;
}

/* The memory's cross-attention keys and values for one decoder layer, as a step reads them,
 * computed once when sentences join a search: kv = memory W_kv^T + b (the layer's fused
 * product, k | v), each head's key RMS-normalised with k_gain (QK-norm; NULL: none), both
 * rounded to float16 into k and v, (rows, d_model) each: rows = sentences x source positions,
 * so (n, S, heads, d_k). The same kernels and roundings as the modules' memory_kv (product,
 * rms_norm, float16 to nearest even), in one call: a sentence joining a serving lane spent
 * ~0.25 ms in those modules' calls. Returns 0, or -1 where scratch could not be allocated. */
int memory_kv(const Product *kv, const float *memory, long rows, long heads, const float *k_gain,
              float eps, uint16_t *k, uint16_t *v, int wide) {
  const long d = kv->n / 2;
  float *y = malloc(sizeof(float) * rows * 2 * d + 64);
  if (!y) return -1;
  int failed = product(kv, memory, rows, y, wide);
  for (long r = 0; r < rows && !failed; r++) {
    if (k_gain) rms_norm(y + r * 2 * d, heads, d / heads, k_gain, eps);
    to_half(y + r * 2 * d, d, k + r * d);
    to_half(y + r * 2 * d + d, d, v + r * d);
  }
  free(y);
  return failed;
}

typedef struct { /* the decoder around its layers (int8.py fills it): a step from tokens to logits */
  const Layer *layers;
  long n_layers;
  const float *embedding, *table; /* the target embedding (vocab, d) and sinusoid (positions, d) */
  long vocab, positions;
  float scale;                    /* sqrt(d_model) */
  const float *norm_gain, *norm_bias; /* the final LayerNorm (pre-norm), or NULL (post-norm) */
  float norm_eps;
  Product output;                 /* the output layer's allowed rows */
} Decoder;

int embed_step(const float *embedding, long vocab, float scale, const float *table, long positions,
               const int64_t *ids, const int64_t *position, long rows, long d, float *out);

/* A decoding step of the whole decoder, one new token per row, to its logits (rows x
 * output.n): embedding and position (row r's position counts from start[r], the step at which
 * it joined; start NULL: from 0 for every row), each layer's decoder_layer_step with its own
 * places (steps[l]; their self-attention masks are made here from start: row r sees the keys
 * from start[r] on, as KVCache.self_mask; their position and slot table are steps[0]'s, as
 * every store of one cache holds the same slots: cache.py's KVCache.reorder), the final
 * LayerNorm and the output product.
 * Returns 0, -1 where scratch could not be allocated, -2 where a token or position lies
 * outside its table. */
int decoder_step(const Decoder *D, const Step *steps, const int64_t *tokens, const int64_t *start,
                 long rows, float *logits, int wide) {
  const long d = D->layers[0].d_model, keys = steps[0].position + 1;
  float *x = malloc(sizeof(float) * rows * d + 64);
  int64_t *position = malloc(sizeof(int64_t) * rows + 64);
  uint8_t *mask = start ? malloc(rows * keys + 64) : NULL;
  int failed = !x || !position || (start && !mask) ? -1 : 0;
  for (long r = 0; r < rows && !failed; r++) {
    position[r] = steps[0].position - (start ? start[r] : 0);
    if (mask)
      for (long j = 0; j < keys; j++) mask[r * keys + j] = j >= start[r];
  }
  if (!failed && embed_step(D->embedding, D->vocab, D->scale, D->table, D->positions, tokens, position,
                            rows, d, x))
    failed = -2;
  for (long l = 0; l < D->n_layers && !failed; l++) {
    Step s = steps[l];
    s.position = steps[0].position;
    s.ancestry = steps[0].ancestry;
    s.ancestry_row = steps[0].ancestry_row;
    s.written = steps[0].written;
    if (mask) {
      s.self_mask = mask;
      s.self_mask_row = keys;
    }
    failed = decoder_layer_step(&D->layers[l], &s, x, rows, wide);
  }
  if (!failed && D->norm_gain) layer_norm(x, rows, d, D->norm_gain, D->norm_bias, D->norm_eps, x);
  if (!failed) failed = product(&D->output, x, rows, logits, wide);
  free(x);
  free(position);
  free(mask);
  return failed;
}

/* A step's places moved to the next position (search_step.c's beam_steps): layer 0's
 * position and slot table, which decoder_step reads for every layer. */
void move_step(Step *steps, long position, const int64_t *ancestry, long ancestry_row, long written) {
  steps[0].position = position;
  steps[0].ancestry = ancestry;
  steps[0].ancestry_row = ancestry_row;
  steps[0].written = written;
}

typedef struct { /* the encoder and the decoder's memory products (int8.py fills it): from a
                    joining sentence's ids to the cross-attention K/V each decoder layer reads */
  const Layer *layers;            /* the encoder's */
  long n_layers;
  const float *embedding, *table; /* the source embedding (vocab, d) and sinusoid (positions, d) */
  long vocab, positions;
  float scale;                    /* sqrt(d_model) */
  const float *norm_gain, *norm_bias; /* the encoder's final LayerNorm (pre-norm), or NULL */
  float norm_eps;
  const Product *kv;              /* each decoder layer's cross-attention K/V product */
  const float *const *k_gain;     /* and its keys' QK-norm gain (NULL: none) */
  long n_decoder, heads;
  float qk_eps;
} Memory;

/* Sentences joining a search, from their (sets, length) source ids (padded; mask as
 * encoder_layer's) to the cross-attention K/V every decoder layer keeps: the embedding and
 * position, each encoder layer (encoder_layer), the final LayerNorm (layer_norm, as int8.py's
 * encode computes it too: the same floats) and each decoder layer's memory_kv into
 * k[l] and v[l], (sets, length, d_model) float16 each. One call where the modules' path made
 * a dozen from Python (~0.2 ms of a joining sentence at a serving lane). Returns 0, -1 where
 * scratch could not be allocated, -2 where an id lies outside the embedding or the sentence
 * beyond the positions. */
int encode_memory(const Memory *M, const int64_t *ids, long sets, long length, const uint8_t *mask,
                  uint16_t *const *k, uint16_t *const *v, int wide) {
  const long d = M->layers[0].d_model, rows = sets * length;
  float *x = malloc(sizeof(float) * rows * d + 64);
  int64_t *position = malloc(sizeof(int64_t) * rows + 64);
  int failed = !x || !position ? -1 : 0;
  for (long r = 0; r < rows && !failed; r++) position[r] = r % length;
  if (!failed && embed_step(M->embedding, M->vocab, M->scale, M->table, M->positions, ids, position, rows,
                            d, x))
    failed = -2;
  for (long l = 0; l < M->n_layers && !failed; l++) failed = encoder_layer(&M->layers[l], x, sets, length, mask, wide);
  if (!failed && M->norm_gain) layer_norm(x, rows, d, M->norm_gain, M->norm_bias, M->norm_eps, x);
  for (long l = 0; l < M->n_decoder && !failed; l++)
    failed = memory_kv(&M->kv[l], x, rows, M->heads, M->k_gain[l], M->qk_eps, k[l], v[l], wide);
  free(x);
  free(position);
  return failed;
}
