/* The CPU engine's attention kernels: decode attention over the paged KV cache (one query token
 * per sequence, the cache read in place, no gather, fp32 math), and the write of a step's new
 * K/V rows to their slots. Built and called by kernels/cpu_decode_attention.py, which documents
 * the measurements; this file holds the arithmetic and the layouts.
 *
 * Per sequence, for each query head g (of KV head g / group):
 *     scores[g][p] = scale * dot(q[g], k[p])          p in the sequence's context (window, chunk)
 *     w[g][p]      = exp(scores[g][p] - max_p scores[g])
 *     out[g]       = sum_p w[g][p] * v[p] / sum_p w[g][p]
 * K and V rows are found through the block table: token p lives in block table[p / block_size]
 * at offset p % block_size. bf16 caches and queries are widened to fp32 on load, and the output
 * is rounded to bf16 (nearest even) on store. A quantized cache (one-byte codes, int8 or fp8)
 * is read as code * scale, the code widened exactly to fp32 (int8 by a cast, fp8 e4m3 or
 * e5m2 by its bits), with the fp32 scale of the token's KV head (scales laid out as the codes
 * without their head_dim lanes).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef union {
    uint32_t u;
    float f;
} bits32;

static inline float bf16_to_f32(uint16_t h) {
    bits32 c;
    c.u = (uint32_t)h << 16;
    return c.f;
}

static inline uint16_t f32_to_bf16(float f) {
    bits32 c;
    c.f = f;
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40u); /* NaN stays NaN */
    c.u += 0x7fffu + ((c.u >> 16) & 1u);
    return (uint16_t)(c.u >> 16);
}

/* fp8 codes widened exactly, without a table (branch-free, so the loops vectorize): e4m3
 * (bias 7, no infinities, 0x7f/0xff NaN) and e5m2 (bias 15, IEEE-like). */
static inline float e4m3_to_f32(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80u) << 24, e = (b >> 3) & 0xfu, m = b & 7u;
    const uint32_t nan = (e == 15u && m == 7u) ? 0x7fc00000u : 0u;
    const uint32_t u = (sign | ((e + 120u) << 23) | (m << 20)) | nan;
    float normal, sub = (float)m * 0x1p-9f;
    memcpy(&normal, &u, sizeof normal);
    sub = sign ? -sub : sub;
    return e ? normal : sub;
}

static inline float e5m2_to_f32(uint8_t b) {
    const uint32_t sign = (uint32_t)(b & 0x80u) << 24, e = (b >> 2) & 0x1fu, m = b & 3u;
    const uint32_t u = sign | ((e == 31u ? 0xffu : e + 112u) << 23) | (m << 21);
    float normal, sub = (float)m * 0x1p-16f;
    memcpy(&normal, &u, sizeof normal);
    sub = sign ? -sub : sub;
    return e ? normal : sub;
}

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* e^x for x <= 0 (Cephes' expf: range reduction by ln 2 in two parts, a degree-6 polynomial),
 * written without calls or branches so that the compiler vectorizes the loops using it. Below
 * -87.3 the result is clamped near FLT_MIN instead of flushing to 0; NaN stays NaN. */
static inline float exp_nonpositive(float x) {
    x = x < -87.3f ? -87.3f : x;
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float n = (x * 1.44269504088896341f + shifter) - shifter;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    bits32 c;
    c.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * c.f;
}

/* What every sequence's work reads: the arguments of the exported kernels (see there). */
typedef struct {
    const void *q;
    int64_t q_stride;
    const int64_t *q_rows;
    const void *k_cache, *v_cache;
    int64_t block_stride, token_stride;
    int block_size, num_kv_heads, group;
    const int32_t *block_tables;
    int64_t table_stride;
    const int32_t *seq_lens;
    float scale;
    int window, chunk;
    void *out;
    const float *k_scales, *v_scales; /* a quantized cache's scales (NULL otherwise) */
    int e5m2;                         /* fp8 codes: e5m2 (1) or e4m3 (0) */
} decode_args;

/* What a cache holds: fp32 or bf16 values, or one-byte codes with scales (int8 or fp8). */
enum { CACHE_F32 = 0, CACHE_BF16 = 1, CACHE_INT8 = 2, CACHE_FP8 = 3 };

static inline int cache_bytes(int kind) {
    return kind >= CACHE_INT8 ? 1 : kind == CACHE_BF16 ? 2 : 4;
}

enum { V_TILE = 8 };          /* tokens a V accumulation pass reads together */
enum { PREFETCH_TOKENS = 4 }; /* how far ahead the K pass asks for K and V rows */
/* A row attending more positions is split into pieces of this many (the last one shorter),
 * each a work item of its own, merged in order: a fixed split, so a row's sums do not depend
 * on the thread count or on which rows share its step. */
enum { PIECE_TOKENS = 1024 };

/* Ask for a token's K or V row (every KV head) ahead of its use: the rows of a sequence lie in
 * blocks scattered over the cache, which the hardware prefetcher does not foresee. */
__attribute__((always_inline)) static inline void prefetch_row(
    const void *cache, int64_t at, int64_t count, int kind) {
    const char *first = (const char *)cache + at * cache_bytes(kind);
    const int64_t bytes = count * cache_bytes(kind);
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(first + offset);
}

/* Where token p of a sequence (block table `table`) starts in a cache, in elements. */
__attribute__((always_inline)) static inline int64_t token_at(
    const decode_args *a, const int32_t *table, int p) {
    return (int64_t)table[p / a->block_size] * a->block_stride +
           (int64_t)(p % a->block_size) * a->token_stride;
}

/* Scratch memory of one thread: the query row widened to fp32, the output accumulators, each
 * head's top score and softmax sum, the scores (grown to the longest piece it meets) and V_TILE
 * widened K or V rows. */
typedef struct {
    float *qf, *acc, *tops, *sums, *scores, *kv_row;
    int64_t capacity;
} scratch;

/* A token's K or V row (every KV head) as fp32: in place for fp32 caches, widened once into
 * `buffer` for bf16 ones (rather than once per query head reading it), and for codes each KV
 * head's lanes code * that head's scale (`scales`: the cache's, indexed as the codes without
 * their head_dim lanes). */
__attribute__((always_inline)) static inline const float *row_f32(
    const void *cache, int64_t at, int64_t count, float *buffer, int kind, const float *scales,
    int head_dim, int e5m2) {
    if (kind == CACHE_F32) return (const float *)cache + at;
    if (kind == CACHE_BF16) {
        const uint16_t *source = (const uint16_t *)cache + at;
#pragma omp simd
        for (int64_t i = 0; i < count; i++) buffer[i] = bf16_to_f32(source[i]);
        return buffer;
    }
    const float *row_scales = scales + at / head_dim;
    for (int64_t h = 0; h < count / head_dim; h++) {
        const float s = row_scales[h];
        float *bh = buffer + h * head_dim;
        if (kind == CACHE_INT8) {
            const int8_t *ch = (const int8_t *)cache + at + h * head_dim;
#pragma omp simd
            for (int d = 0; d < head_dim; d++) bh[d] = (float)ch[d] * s;
        } else {
            const uint8_t *ch = (const uint8_t *)cache + at + h * head_dim;
            if (e5m2) {
#pragma omp simd
                for (int d = 0; d < head_dim; d++) bh[d] = e5m2_to_f32(ch[d]) * s;
            } else {
#pragma omp simd
                for (int d = 0; d < head_dim; d++) bh[d] = e4m3_to_f32(ch[d]) * s;
            }
        }
    }
    return buffer;
}

/* The first position sequence s's row attends, of its `len`: the latest `window` tokens only
 * (0: all), none before its chunk's start (len - 1) / chunk * chunk (0: no chunks). */
static inline int first_position(const decode_args *a, int len) {
    const int window_start = (a->window > 0 && len > a->window) ? len - a->window : 0;
    const int chunk_start = (a->chunk > 0 && len > 0) ? (len - 1) / a->chunk * a->chunk : 0;
    return window_start > chunk_start ? window_start : chunk_start;
}

/* Positions [begin, end) (end > begin) of sequence s's decode row, every head: scores, each
 * head's top score tops[h], and acc[h] = sum_p exp(score_p - tops[h]) v_p with its sum
 * sums[h] = sum_p exp(score_p - tops[h]), not yet divided. Always inlined with constant
 * `head_dim`, `bf16` (the query) and `kind` (the cache), so that the loops are vectorized for
 * each case. */
__attribute__((always_inline)) static inline void attend_range(
    const decode_args *a, int s, scratch *t, int begin, int end, float *restrict acc,
    float *restrict tops, float *restrict sums, int head_dim, int bf16, int kind) {
    const int num_kv_heads = a->num_kv_heads, group = a->group, q_heads = num_kv_heads * group;
    const int64_t width = (int64_t)q_heads * head_dim; /* one token's query or output row */
    const int64_t kv_width = (int64_t)num_kv_heads * head_dim;
    const int n = end - begin;
    const int64_t row = a->q_rows ? a->q_rows[s] : s;
    const int64_t q_first = row * a->q_stride;
    if ((int64_t)q_heads * n > t->capacity) {
        t->capacity = (int64_t)q_heads * n;
        free(t->scores);
        t->scores = malloc(sizeof(float) * t->capacity);
    }
    float *restrict qf = t->qf, *restrict scores = t->scores;
    for (int64_t i = 0; i < width; i++) {
        qf[i] = load(a->q, q_first + i, bf16);
        acc[i] = 0.0f;
    }
    const int32_t *table = a->block_tables + (int64_t)s * a->table_stride;
    /* Token by token, every head: a block's K (then V) rows are read in memory order. */
    for (int p = begin; p < end; p++) {
        const int64_t token = token_at(a, table, p);
        if (p + PREFETCH_TOKENS < end) {
            const int64_t at = token_at(a, table, p + PREFETCH_TOKENS);
            prefetch_row(a->k_cache, at, kv_width, kind);
            prefetch_row(a->v_cache, at, kv_width, kind);
        }
        const float *restrict k =
            row_f32(a->k_cache, token, kv_width, t->kv_row, kind, a->k_scales, head_dim,
                    a->e5m2);
        for (int head = 0; head < q_heads; head++) {
            const float *kh = k + (int64_t)(head / group) * head_dim;
            const float *qh = qf + (int64_t)head * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int d = 0; d < head_dim; d++) dot += qh[d] * kh[d];
            scores[(int64_t)head * n + (p - begin)] = dot * a->scale;
        }
    }
    for (int head = 0; head < q_heads; head++) {
        float *sh = scores + (int64_t)head * n;
        float top = sh[0];
        for (int i = 1; i < n; i++) top = sh[i] > top ? sh[i] : top;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < n; i++) {
            const float e = exp_nonpositive(sh[i] - top);
            sh[i] = e;
            sum += e;
        }
        tops[head] = top;
        sums[head] = sum;
    }
    /* V in tiles of V_TILE tokens: each accumulator element is loaded and stored once a tile
     * (summing the tile's tokens in order in a register), not once a token. */
    for (int p0 = begin; p0 < end; p0 += V_TILE) {
        const int count = end - p0 < V_TILE ? end - p0 : V_TILE;
        const float *rows[V_TILE];
        for (int j = 0; j < count; j++) {
            const int64_t token = token_at(a, table, p0 + j);
            rows[j] = row_f32(a->v_cache, token, kv_width, t->kv_row + j * kv_width, kind,
                              a->v_scales, head_dim, a->e5m2);
        }
        for (int head = 0; head < q_heads; head++) {
            const int64_t offset = (int64_t)(head / group) * head_dim;
            const float *w = scores + (int64_t)head * n + (p0 - begin);
            float *ah = acc + (int64_t)head * head_dim;
            if (count == V_TILE) {
                const float *r0 = rows[0] + offset, *r1 = rows[1] + offset, *r2 = rows[2] + offset,
                            *r3 = rows[3] + offset, *r4 = rows[4] + offset, *r5 = rows[5] + offset,
                            *r6 = rows[6] + offset, *r7 = rows[7] + offset;
#pragma omp simd
                for (int d = 0; d < head_dim; d++) {
                    float sum = ah[d];
                    sum += w[0] * r0[d];
                    sum += w[1] * r1[d];
                    sum += w[2] * r2[d];
                    sum += w[3] * r3[d];
                    sum += w[4] * r4[d];
                    sum += w[5] * r5[d];
                    sum += w[6] * r6[d];
                    sum += w[7] * r7[d];
                    ah[d] = sum;
                }
            } else {
                for (int j = 0; j < count; j++) {
                    const float *r = rows[j] + offset;
#pragma omp simd
                    for (int d = 0; d < head_dim; d++) ah[d] += w[j] * r[d];
                }
            }
        }
    }
}

/* Row s of out: each head's acc / sums (zeros where `acc` is NULL: a row that attends
 * nothing), rounded to bf16 for a bf16 output. */
static void store_row(const decode_args *a, int s, const float *acc, const float *sums,
                      int head_dim, int bf16) {
    const int q_heads = a->num_kv_heads * a->group;
    const int64_t row = a->q_rows ? a->q_rows[s] : s;
    const int64_t first = row * (int64_t)q_heads * head_dim;
    for (int head = 0; head < q_heads; head++) {
        for (int d = 0; d < head_dim; d++) {
            const int64_t i = (int64_t)head * head_dim + d;
            const float x = acc ? acc[i] / sums[head] : 0.0f;
            if (bf16)
                ((uint16_t *)a->out)[first + i] = f32_to_bf16(x);
            else
                ((float *)a->out)[first + i] = x;
        }
    }
}

/* Sequence s's pieces first .. first + parts - 1 (acc, tops, sums of each, in order) merged
 * into its row of out: each head's pieces rescaled to the largest top and summed, in order. */
static void merge_pieces(const decode_args *a, int s, int first, int parts, const float *acc,
                         const float *tops, const float *sums, float *merged, float *total,
                         int head_dim, int bf16) {
    const int q_heads = a->num_kv_heads * a->group;
    const int64_t width = (int64_t)q_heads * head_dim;
    for (int head = 0; head < q_heads; head++) {
        float top = tops[(int64_t)first * q_heads + head];
        for (int i = 1; i < parts; i++) {
            const float t = tops[(int64_t)(first + i) * q_heads + head];
            top = t > top ? t : top;
        }
        float *mh = merged + (int64_t)head * head_dim;
        for (int d = 0; d < head_dim; d++) mh[d] = 0.0f;
        total[head] = 0.0f;
        for (int i = 0; i < parts; i++) {
            const int64_t piece = first + i;
            const float w = exp_nonpositive(tops[piece * q_heads + head] - top);
            const float *ah = acc + piece * width + (int64_t)head * head_dim;
            for (int d = 0; d < head_dim; d++) mh[d] += w * ah[d];
            total[head] += w * sums[piece * q_heads + head];
        }
    }
    store_row(a, s, merged, total, head_dim, bf16);
}

/* attend_range, dispatched to its copies for the common head sizes. */
#define ATTEND_RANGE(A, S, T, BEGIN, END, ACC, TOPS, SUMS, HEAD_DIM, BF16, KIND)                 \
    do {                                                                                         \
        if ((HEAD_DIM) == 64)                                                                    \
            attend_range(A, S, T, BEGIN, END, ACC, TOPS, SUMS, 64, BF16, KIND);                  \
        else if ((HEAD_DIM) == 128)                                                              \
            attend_range(A, S, T, BEGIN, END, ACC, TOPS, SUMS, 128, BF16, KIND);                 \
        else                                                                                     \
            attend_range(A, S, T, BEGIN, END, ACC, TOPS, SUMS, HEAD_DIM, BF16, KIND);            \
    } while (0)

/* A call's work items: sequence s's pieces are items first[s] .. first[s + 1] - 1 (one for a
 * row of at most PIECE_TOKENS positions, or none), seq[i] the sequence of item i; a split row's
 * pieces leave their acc [width], tops and sums [q_heads] in the buffers (NULL when no row is
 * split). */
typedef struct {
    int count, *seq, *first;
    float *acc, *tops, *sums;
} pieces;

static pieces plan_pieces(const decode_args *a, int num_seqs, int q_heads, int64_t width) {
    pieces plan = {0, NULL, malloc(sizeof(int) * (num_seqs + 1)), NULL, NULL, NULL};
    for (int s = 0; s < num_seqs; s++) {
        const int n = a->seq_lens[s] - first_position(a, a->seq_lens[s]);
        plan.first[s] = plan.count;
        plan.count += n > PIECE_TOKENS ? (n + PIECE_TOKENS - 1) / PIECE_TOKENS : 1;
    }
    plan.first[num_seqs] = plan.count;
    plan.seq = malloc(sizeof(int) * (plan.count > 0 ? plan.count : 1));
    for (int s = 0; s < num_seqs; s++)
        for (int i = plan.first[s]; i < plan.first[s + 1]; i++) plan.seq[i] = s;
    if (plan.count > num_seqs) {
        plan.acc = malloc(sizeof(float) * plan.count * width);
        plan.tops = malloc(sizeof(float) * plan.count * q_heads);
        plan.sums = malloc(sizeof(float) * plan.count * q_heads);
    }
    return plan;
}

static void free_pieces(pieces *plan) {
    free(plan->seq);
    free(plan->first);
    free(plan->acc);
    free(plan->tops);
    free(plan->sums);
}

/* The exported kernels, one per query type (fp32, bf16) and cache kind, called through ctypes:
 *   q [T, Hq, D] with rows q_stride elements apart; sequence s's row is q_rows[s] (NULL: s);
 *   k_cache, v_cache [num_blocks, block_size, Hkv, D], blocks block_stride and tokens
 *   token_stride elements apart (a token's Hkv * D elements contiguous);
 *   group = Hq / Hkv; block_tables [S, *] int32 (rows table_stride apart); seq_lens [S] int32;
 *   window: the latest `window` tokens only (0: all); chunk: chunked local attention, the row
 *   (at len - 1) sees no token before its chunk's start (len - 1) / chunk * chunk (0: none);
 *   out [T, Hq, D] contiguous: the rows of
 *   the S sequences are written, others left alone; for a cache of codes, k_scales and
 *   v_scales [num_blocks, block_size, Hkv] (strides the codes' over head_dim; NULL for the
 *   others) and e5m2 (fp8 codes: 1 for e5m2, 0 for e4m3).
 * Rows, and the PIECE_TOKENS pieces of longer ones (merged after), are spread over num_threads
 * OpenMP threads; the common head sizes get loops of their own. */
#define DEFINE_KERNEL(NAME, BF16, KIND)                                                        \
    void NAME(const void *q, int64_t q_stride, const int64_t *q_rows, const void *k_cache,     \
              const void *v_cache, int64_t block_stride, int64_t token_stride, int block_size, \
              int num_kv_heads, int group, int head_dim, const int32_t *block_tables,          \
              int64_t table_stride, const int32_t *seq_lens, int num_seqs, float scale,        \
              int window, int chunk, void *out, int num_threads, const float *k_scales,        \
              const float *v_scales, int e5m2) {                                               \
        const decode_args a = {q,          q_stride,     q_rows,       k_cache,      v_cache, \
                               block_stride, token_stride, block_size, num_kv_heads, group,   \
                               block_tables, table_stride, seq_lens,   scale,        window,  \
                               chunk,      out,          k_scales,     v_scales,     e5m2};    \
        const int q_heads = num_kv_heads * group;                                              \
        const int64_t width = (int64_t)q_heads * head_dim;                                     \
        pieces plan = plan_pieces(&a, num_seqs, q_heads, width);                               \
        _Pragma("omp parallel num_threads(num_threads)") {                                     \
            scratch t = {malloc(sizeof(float) * width),   malloc(sizeof(float) * width),       \
                         malloc(sizeof(float) * q_heads), malloc(sizeof(float) * q_heads),     \
                         NULL, malloc(sizeof(float) * V_TILE * num_kv_heads * head_dim), 0};   \
            _Pragma("omp for schedule(dynamic, 1)") for (int i = 0; i < plan.count; i++) {    \
                const int s = plan.seq[i], first = plan.first[s];                              \
                const int parts = plan.first[s + 1] - first, len = seq_lens[s];                \
                const int begin = first_position(&a, len) + (i - first) * PIECE_TOKENS;        \
                const int end = begin + PIECE_TOKENS < len ? begin + PIECE_TOKENS : len;       \
                if (begin >= end) {                                                            \
                    store_row(&a, s, NULL, NULL, head_dim, BF16);                              \
                } else if (parts == 1) {                                                       \
                    ATTEND_RANGE(&a, s, &t, begin, end, t.acc, t.tops, t.sums, head_dim, BF16, \
                                 KIND);                                                        \
                    store_row(&a, s, t.acc, t.sums, head_dim, BF16);                           \
                } else {                                                                       \
                    ATTEND_RANGE(&a, s, &t, begin, end, plan.acc + i * width,                  \
                                 plan.tops + (int64_t)i * q_heads,                             \
                                 plan.sums + (int64_t)i * q_heads, head_dim, BF16, KIND);      \
                }                                                                              \
            }                                                                                  \
            _Pragma("omp for schedule(dynamic, 1)") for (int s = 0; s < num_seqs; s++) {      \
                const int parts = plan.first[s + 1] - plan.first[s];                           \
                if (parts > 1)                                                                 \
                    merge_pieces(&a, s, plan.first[s], parts, plan.acc, plan.tops, plan.sums,  \
                                 t.acc, t.sums, head_dim, BF16);                               \
            }                                                                                  \
            free(t.qf);                                                                        \
            free(t.acc);                                                                       \
            free(t.tops);                                                                      \
            free(t.sums);                                                                      \
            free(t.scores);                                                                    \
            free(t.kv_row);                                                                    \
        }                                                                                      \
        free_pieces(&plan);                                                                    \
    }

DEFINE_KERNEL(paged_decode_f32, 0, CACHE_F32)
DEFINE_KERNEL(paged_decode_bf16, 1, CACHE_BF16)
DEFINE_KERNEL(paged_decode_int8_f32, 0, CACHE_INT8)
DEFINE_KERNEL(paged_decode_int8_bf16, 1, CACHE_INT8)
DEFINE_KERNEL(paged_decode_fp8_f32, 0, CACHE_FP8)
DEFINE_KERNEL(paged_decode_fp8_bf16, 1, CACHE_FP8)

/* The step's new K and V rows into the caches: token t's rows (k + t * k_stride, v + t *
 * v_stride elements; `row` elements each, contiguous) go to slot slots[t] of caches laid out as
 * contiguous `row`-element token rows; slot -1 is skipped. Returns how many slots were out of
 * [0, num_slots) and skipped too (the caller raises). */
int write_kv_rows(const void *k, int64_t k_stride, const void *v, int64_t v_stride,
                  void *k_cache, void *v_cache, const int64_t *slots, int num_tokens,
                  int64_t num_slots, int64_t row, int element_size) {
    int refused = 0;
    const size_t bytes = (size_t)row * element_size;
    for (int t = 0; t < num_tokens; t++) {
        const int64_t slot = slots[t];
        if (slot == -1) continue;
        if (slot < 0 || slot >= num_slots) {
            refused++;
            continue;
        }
        memcpy((char *)k_cache + slot * bytes, (const char *)k + t * k_stride * element_size,
               bytes);
        memcpy((char *)v_cache + slot * bytes, (const char *)v + t * v_stride * element_size,
               bytes);
    }
    return refused;
}
