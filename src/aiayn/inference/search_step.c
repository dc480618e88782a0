/* A beam search step's work between the model and the bookkeeping, for aiayn's `--int8` engine
 * (aiayn/inference/native.py builds and calls it; aiayn/inference/steps.py says what each
 * step is). At a serving lane's few sentences a step is a few dozen tiny tensor operations
 * here, each costing more in PyTorch's or NumPy's dispatch than in its arithmetic; one call
 * does them all. The choices are those of the operations they replace (steps.py's `expand`
 * and `next_logits`): the same float32 sums, the same candidates, and among equal scores the
 * earlier candidate first (topk leaves that order open). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifndef _WIN32
#include <poll.h>
#endif

/* The columns a step must not choose, set to -inf in place in the (rows, cols) logits: the
 * `never` columns of every row (PAD, BOS), and with n > 0 the repetition guard's: every
 * token that would complete an n-gram already in the row's (rows, t) `history` (the row's
 * last n - 1 tokens were followed by it before; steps.py's ban_repeated_ngrams). Rows with
 * `skip` set (a target prefix gives their token) keep the guard's columns. `to_column`
 * (NULL: column = id) maps a token id to its column of a restricted output layer; PAD
 * completes only a joined row's padding and is never a column. */
void mask_step(float *logits, long rows, long cols, const long *never, long n_never,
               const int64_t *history, long t, long n, const uint8_t *skip,
               const int64_t *to_column, int64_t pad) {
  for (long r = 0; r < rows; r++) {
    float *row = logits + r * cols;
    for (long i = 0; i < n_never; i++) row[never[i]] = -INFINITY;
    if (n <= 0 || t < n || (skip && skip[r])) continue;
    const int64_t *h = history + r * t, *last = h + t - n + 1;
    for (long s = 0; s + n <= t; s++) {
      long i = 0;
      while (i < n - 1 && h[s + i] == last[i]) i++;
      if (i < n - 1 || h[s + n - 1] == pad) continue;
      const int64_t column = to_column ? to_column[h[s + n - 1]] : h[s + n - 1];
      if (column >= 0 && column < cols) row[column] = -INFINITY;
    }
  }
}

/* One beam step's choice for A sentences of K beams (steps.py's `expand` after the best
 * `width` log-probabilities of each row): candidate (k, j) of sentence a scores
 * scores[a, k] + best[a K + k, j]; its C best, best first, are the step's candidates, and the
 * first K of them that do not end in EOS (then EOS ones, where fewer remain) stay alive.
 * Writes per sentence one row of `host`, (A, 3 C + 3 K) doubles: the candidates' scores,
 * beams and tokens, then the survivors' (doubles hold the float32 scores and the ids
 * exactly), and the survivors' scores and tokens as the next step reads them. `ids` (NULL:
 * token = column) maps a column to its token id. Returns -1 where C exceeds its room. */
#define MAX_CANDIDATES 256
int beam_choose(const float *best, const int64_t *columns, long A, long K, long width,
                const float *scores, const int64_t *ids, int64_t eos, long C, double *host,
                float *alive_scores, int64_t *alive_tokens) {
  if (C > MAX_CANDIDATES || C > K * width || K > C) return -1;
  float value[MAX_CANDIDATES];
  long index[MAX_CANDIDATES];
  for (long a = 0; a < A; a++) {
    long kept = 0;  /* the C best so far, sorted: a later equal value goes after */
    for (long c = 0; c < K * width; c++) {
      const float x = scores[a * K + c / width] + best[a * K * width + c];
      if (kept == C && !(x > value[C - 1])) continue;
      long at = kept < C ? kept++ : C - 1;
      for (; at > 0 && x > value[at - 1]; at--) {
        value[at] = value[at - 1];
        index[at] = index[at - 1];
      }
      value[at] = x;
      index[at] = c;
    }
    double *out = host + a * (3 * C + 3 * K);
    long alive = 0;
    for (int eos_pass = 0; eos_pass < 2; eos_pass++) {
      for (long i = 0; i < C; i++) {
        const int64_t column = columns[a * K * width + index[i]];
        const int64_t token = ids ? ids[column] : column;
        if (!eos_pass) {
          out[i] = value[i];
          out[C + i] = (double)(index[i] / width);
          out[2 * C + i] = (double)token;
        }
        if ((token == eos) != eos_pass || alive == K) continue;
        out[3 * C + alive] = value[i];
        out[3 * C + K + alive] = (double)(index[i] / width);
        out[3 * C + 2 * K + alive] = (double)token;
        alive_scores[a * K + alive] = value[i];
        alive_tokens[a * K + alive] = token;
        alive++;
      }
    }
  }
  return 0;
}

/* A decoding step's input, (rows, d): each row's token embedding times sqrt(d_model) plus the
 * sinusoid of its position (model.py's TokenEmbedding and PositionalEncoding, which a step
 * would call through half a dozen tensor operations): the same floats, a product and then a
 * sum (contraction into one fused multiply-add, which rounds once, is off here). Returns -1
 * where a token id or a position lies outside its table. */
__attribute__((optimize("fp-contract=off")))
int embed_step(const float *embedding, long vocab, float scale, const float *table, long positions,
               const int64_t *ids, const int64_t *position, long rows, long d, float *out) {
  for (long r = 0; r < rows; r++)
    if (ids[r] < 0 || ids[r] >= vocab || position[r] < 0 || position[r] >= positions) return -1;
  for (long r = 0; r < rows; r++) {
    const float *e = embedding + ids[r] * d, *p = table + position[r] * d;
    float *y = out + r * d;
    for (long i = 0; i < d; i++) {
      const float scaled = e[i] * scale;
      y[i] = scaled + p[i];
    }
  }
  return 0;
}

/* What a beam search fixes for all its steps (int8.py fills it): the columns masked, the
 * ids of the columns, and how many candidates a step takes. */
typedef struct {
  const long *never;          /* columns never chosen (PAD, BOS) */
  long n_never;
  long n_gram;                /* the repetition guard's n (0: no guard) */
  const int64_t *to_column;   /* token id -> column (NULL: the same) */
  const int64_t *ids;         /* column -> token id (NULL: the same) */
  int64_t eos, pad;
  long width, candidates;     /* each row's best log-probabilities; each sentence's candidates */
} Choice;

int decoder_step(const void *decoder, const void *steps, const int64_t *tokens, const int64_t *start,
                 long rows, float *logits, int wide);
void top_log_softmax(const float *x, long rows, long n, long k, float *value, long *column, int wide);
void move_step(void *steps, long position, const int64_t *ancestry, long ancestry_row, long written);

/* Each row's slots in a cache's store after a beam step's choice (cache.py's Store.reorder of
 * the rows the choice follows, every sentence kept): row a K + k follows its parent p = a K +
 * beam_of(a, k) (host, beam_choose's), whose positions j < written lie in slots ancestry[p][j]
 * and every later one, this step's included, in slot p. followed: (A K, length + 1). */
static void follow_beams(const double *host, long A, long K, long C, const int64_t *ancestry,
                         long ancestry_row, long written, long length, int64_t *followed) {
  for (long a = 0; a < A; a++)
    for (long k = 0; k < K; k++) {
      const long parent = a * K + (long)host[a * (3 * C + 3 * K) + 3 * C + K + k];
      int64_t *out = followed + (a * K + k) * (length + 1);
      long j = 0;
      if (ancestry)
        for (; j < written; j++) out[j] = ancestry[parent * ancestry_row + j];
      for (; j <= length; j++) out[j] = parent;
    }
}

/* Whether nothing ends at this step (steps.py's `settle` would move nothing): no sentence has
 * EOS among its K best candidates, and each keeps a live (finite) beam. */
static int quiet(const double *host, long A, long K, long C, int64_t eos) {
  for (long a = 0; a < A; a++) {
    const double *out = host + a * (3 * C + 3 * K);
    int live = 0;
    for (long k = 0; k < K; k++) {
      if ((int64_t)out[2 * C + k] == eos) return 0;
      live |= isfinite(out[3 * C + k]);
    }
    if (!live) return 0;
  }
  return 1;
}

/* The rows' (A K, t) history and log-probability totals after the choice, every sentence
 * going on (steps.py's Rows.follow): row a K + k is its parent's, then its survivor's token
 * and score. next_history, next_totals: (A K, t + 1). */
static void follow_rows(const double *host, long A, long K, long C, const int64_t *history,
                        const double *totals, long t, int64_t *next_history, double *next_totals) {
  for (long a = 0; a < A; a++) {
    const double *out = host + a * (3 * C + 3 * K);
    for (long k = 0; k < K; k++) {
      const long parent = a * K + (long)out[3 * C + K + k], row = a * K + k;
      for (long j = 0; j < t; j++) {
        next_history[row * (t + 1) + j] = history[parent * t + j];
        next_totals[row * (t + 1) + j] = totals[parent * t + j];
      }
      next_history[row * (t + 1) + t] = (int64_t)out[3 * C + 2 * K + k];
      next_totals[row * (t + 1) + t] = out[3 * C + k];
    }
  }
}

/* A whole beam step of A sentences of K beams in one call: the decoder's step from each row's
 * newest token to its `cols` logits (layers.c's decoder_step, over the decoder's places
 * `steps`), the columns it may not choose (mask_step, with each row's (A K, t) `history`),
 * each row's best `width` log-probabilities (top_log_softmax) and the sentence's choice
 * (beam_choose, writing `host`, `alive_scores` and `alive_tokens`): the work of
 * steps.py's next_logits and expand, the same kernels in the same order (but for the final
 * LayerNorm, layers.c's rather than PyTorch's: equal up to rounding). With `followed`, also
 * the cache's slot table after the choice (follow_beams: `ancestry`, its row stride and
 * `written` columns are the store's before the step, `length` its positions then). With
 * `next_history`, also the rows' history and `totals` after it, every row following its
 * beam (follow_rows: what they become where every sentence goes on). Returns 0, or with
 * `next_history` 1 where nothing ends at this step (quiet); -1 where scratch could not be
 * allocated, -2 where a token or position lies outside its table, -3 where the candidates
 * exceed beam_choose's room. */
int beam_step(const void *decoder, const void *steps, long cols, const Choice *c, const int64_t *tokens,
              const int64_t *start, long A, long K, const int64_t *history, long t, const float *scores,
              double *host, float *alive_scores, int64_t *alive_tokens, const int64_t *ancestry,
              long ancestry_row, long written, long length, int64_t *followed, const double *totals,
              int64_t *next_history, double *next_totals, int wide) {
  const long rows = A * K;
  float *logits = malloc(sizeof(float) * rows * cols + 64);
  float *best = malloc(sizeof(float) * rows * c->width + 64);
  int64_t *columns = malloc(sizeof(int64_t) * rows * c->width + 64);
  int failed = !logits || !best || !columns ? -1 : 0;
  if (!failed) failed = decoder_step(decoder, steps, tokens, start, rows, logits, wide);
  if (!failed) {
    mask_step(logits, rows, cols, c->never, c->n_never, history, t, c->n_gram, NULL, c->to_column, c->pad);
    top_log_softmax(logits, rows, cols, c->width, best, (long *)columns, wide);
    if (beam_choose(best, columns, A, K, c->width, scores, c->ids, c->eos, c->candidates, host,
                    alive_scores, alive_tokens))
      failed = -3;
    else {
      if (followed)
        follow_beams(host, A, K, c->candidates, ancestry, ancestry_row, written, length, followed);
      if (next_history) {
        follow_rows(host, A, K, c->candidates, history, totals, t, next_history, next_totals);
        failed = quiet(host, A, K, c->candidates, c->eos);
      }
    }
  }
  free(logits);
  free(best);
  free(columns);
  return failed;
}

/* Whether every sentence goes on after a step at which hypotheses end (steps.py's `settle` would
 * finish them and find no sentence done): each keeps a live beam, and the EOS candidates among
 * its K best leave it under K finished with the `finished` it had. Then records them, each
 * sentence's in its candidates' order as settle takes them, and counts them in `finished`:
 * `ended` gets (sentence, t, score) and `ended_ids`, `ended_totals` (rows of `width`) the
 * history and totals of the beam it ends, before the step (t columns); `n_ended` counts
 * them. Else records nothing (so too where the A K records' room would not hold them: never
 * with `finished` counts that are not negative). */
static int ends_quietly(const double *host, long A, long K, long C, int64_t eos, int64_t *finished,
                        const int64_t *history, const double *totals, long t, long width,
                        long *n_ended, double *ended, int64_t *ended_ids, double *ended_totals) {
  long all = 0;
  for (long a = 0; a < A; a++) {
    const double *out = host + a * (3 * C + 3 * K);
    long live = 0, ends = 0;
    for (long k = 0; k < K; k++) {
      live |= isfinite(out[3 * C + k]);
      ends += (int64_t)out[2 * C + k] == eos && isfinite(out[k]);
    }
    if (!live || finished[a] + ends >= K) return 0;
    all += ends;
  }
  if (*n_ended + all > A * K) return 0;
  for (long a = 0; a < A; a++) {
    const double *out = host + a * (3 * C + 3 * K);
    for (long k = 0; k < K; k++) {
      if ((int64_t)out[2 * C + k] != eos || !isfinite(out[k])) continue;
      const long parent = a * K + (long)out[C + k], n = (*n_ended)++;
      ended[3 * n] = (double)a;
      ended[3 * n + 1] = (double)t;
      ended[3 * n + 2] = out[k];
      memcpy(ended_ids + n * width, history + parent * t, sizeof(int64_t) * t);
      memcpy(ended_totals + n * width, totals + parent * t, sizeof(double) * t);
      finished[a]++;
    }
  }
  return 1;
}

/* Whether `wake` (a file descriptor; -1: none) has something to read, without waiting. */
static int readable(int wake) {
#ifndef _WIN32
  if (wake >= 0) {
    struct pollfd fd = {wake, POLLIN, 0};
    return poll(&fd, 1, 0) > 0;
  }
#endif
  (void)wake;
  return 0;
}

/* Up to `most` whole beam steps in one call, each beam_step's with `totals` (the rows
 * followed): the next is taken while the last ended nothing (quiet) and nothing has arrived
 * on `wake`. Between two steps a serving lane's Python did nothing but hand each step's
 * answer to the next (steps.py's go_on), ~50 us a step at its few rows. The arguments are
 * beam_step's for the first step; the steps' own answers go, in turns, to the two halves of
 * `tables` (each (A K, length + most): the slot tables followed), `histories` and
 * `all_totals` (each (A K, t + most)), every answer laid out as beam_step's (step i's at
 * half i % 2, of length + i + 1 and t + i + 1 columns), `host`, `alive_scores` and
 * `alive_tokens` those of the last step. `steps` moves with them (move_step). Sets `taken`
 * to the steps taken (1 to most); returns the last one's beam_step answer (a failure stops
 * there). With `finished` ((A,) the hypotheses each sentence has finished), a step at which
 * hypotheses end but every sentence goes on (ends_quietly) counts as quiet too, its hypotheses
 * recorded in `ended`, `ended_ids` and `ended_totals` (room for A K, rows of t + most). */
int beam_steps(const void *decoder, void *steps, long cols, const Choice *c, const int64_t *tokens,
               const int64_t *start, long A, long K, const int64_t *history, long t, const float *scores,
               double *host, float *alive_scores, int64_t *alive_tokens, const int64_t *ancestry,
               long ancestry_row, long written, long length, int64_t *tables, const double *totals,
               int64_t *histories, double *all_totals, long most, int wake, int wide, long *taken,
               int64_t *finished, long *n_ended, double *ended, int64_t *ended_ids, double *ended_totals) {
  const long rows = A * K, table = rows * (length + most), row = rows * (t + most);
  int64_t *next_tokens = malloc(sizeof(int64_t) * rows + 64);
  float *next_scores = malloc(sizeof(float) * A * K + 64);
  int answer = -1;
  long i = 0;
  while (next_tokens && next_scores && i < most) {
    const long h = i % 2; /* this step's half of the answers' buffers */
    answer = beam_step(decoder, steps, cols, c, tokens, start, A, K, history, t + i, scores, host,
                       alive_scores, alive_tokens, ancestry, ancestry_row, written, length + i,
                       tables + h * table, totals, histories + h * row, all_totals + h * row, wide);
    if (answer == 0 && finished)
      answer = ends_quietly(host, A, K, c->candidates, c->eos, finished, history, totals, t + i,
                            t + most, n_ended, ended, ended_ids, ended_totals);
    i++;
    if (answer != 1 || i == most || readable(wake)) break;
    memcpy(next_tokens, alive_tokens, sizeof(int64_t) * rows);
    memcpy(next_scores, alive_scores, sizeof(float) * rows);
    tokens = next_tokens, scores = next_scores;
    history = histories + h * row, totals = all_totals + h * row;
    ancestry = tables + h * table, ancestry_row = written = length + i;
    move_step(steps, length + i, ancestry, ancestry_row, written);
  }
  *taken = i;
  free(next_tokens);
  free(next_scores);
  return answer;
}
