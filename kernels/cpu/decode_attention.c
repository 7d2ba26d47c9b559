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

/* Scratch memory of one thread: the query row widened to fp32, the output accumulators, the
 * softmax sums, the scores (grown to the longest context it meets) and V_TILE widened K or V
 * rows. */
typedef struct {
    float *qf, *acc, *sums, *scores, *kv_row;
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

/* Sequence s's decode row: scores, softmax and weighted sum, every head. Always inlined with
 * constant `head_dim`, `bf16` (the query and output) and `kind` (the cache), so that the loops
 * are vectorized for each case. */
__attribute__((always_inline)) static inline void attend_sequence(
    const decode_args *a, int s, scratch *t, int head_dim, int bf16, int kind) {
    const int num_kv_heads = a->num_kv_heads, group = a->group, q_heads = num_kv_heads * group;
    const int64_t width = (int64_t)q_heads * head_dim; /* one token's query or output row */
    const int64_t kv_width = (int64_t)num_kv_heads * head_dim;
    const int len = a->seq_lens[s];
    const int window_start = (a->window > 0 && len > a->window) ? len - a->window : 0;
    const int chunk_start = (a->chunk > 0 && len > 0) ? (len - 1) / a->chunk * a->chunk : 0;
    const int start = window_start > chunk_start ? window_start : chunk_start;
    const int n = len - start;
    const int64_t row = a->q_rows ? a->q_rows[s] : s;
    const int64_t q_first = row * a->q_stride, first = row * width;
    if (n <= 0) {
        for (int64_t i = 0; i < width; i++) {
            if (bf16)
                ((uint16_t *)a->out)[first + i] = 0;
            else
                ((float *)a->out)[first + i] = 0.0f;
        }
        return;
    }
    if ((int64_t)q_heads * n > t->capacity) {
        t->capacity = (int64_t)q_heads * n;
        free(t->scores);
        t->scores = malloc(sizeof(float) * t->capacity);
    }
    float *restrict qf = t->qf, *restrict acc = t->acc, *restrict scores = t->scores;
    for (int64_t i = 0; i < width; i++) {
        qf[i] = load(a->q, q_first + i, bf16);
        acc[i] = 0.0f;
    }
    const int32_t *table = a->block_tables + (int64_t)s * a->table_stride;
    /* Token by token, every head: a block's K (then V) rows are read in memory order. */
    for (int p = start; p < len; p++) {
        const int64_t token = token_at(a, table, p);
        if (p + PREFETCH_TOKENS < len) {
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
            scores[(int64_t)head * n + (p - start)] = dot * a->scale;
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
        t->sums[head] = sum;
    }
    /* V in tiles of V_TILE tokens: each accumulator element is loaded and stored once a tile
     * (summing the tile's tokens in order in a register), not once a token. */
    for (int p0 = start; p0 < len; p0 += V_TILE) {
        const int count = len - p0 < V_TILE ? len - p0 : V_TILE;
        const float *rows[V_TILE];
        for (int j = 0; j < count; j++) {
            const int64_t token = token_at(a, table, p0 + j);
            rows[j] = row_f32(a->v_cache, token, kv_width, t->kv_row + j * kv_width, kind,
                              a->v_scales, head_dim, a->e5m2);
        }
        for (int head = 0; head < q_heads; head++) {
            const int64_t offset = (int64_t)(head / group) * head_dim;
            const float *w = scores + (int64_t)head * n + (p0 - start);
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
    for (int head = 0; head < q_heads; head++) {
        const float sum = t->sums[head];
        for (int d = 0; d < head_dim; d++) {
            const int64_t i = (int64_t)head * head_dim + d;
            if (bf16)
                ((uint16_t *)a->out)[first + i] = f32_to_bf16(acc[i] / sum);
            else
                ((float *)a->out)[first + i] = acc[i] / sum;
        }
    }
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
 * Sequences are spread over num_threads OpenMP threads; the common head sizes get loops of
 * their own. */
#define DEFINE_KERNEL(NAME, BF16, KIND)                                                              \
    void NAME(const void *q, int64_t q_stride, const int64_t *q_rows, const void *k_cache,     \
              const void *v_cache, int64_t block_stride, int64_t token_stride, int block_size, \
              int num_kv_heads, int group, int head_dim, const int32_t *block_tables,          \
              int64_t table_stride, const int32_t *seq_lens, int num_seqs, float scale,        \
              int window, int chunk, void *out, int num_threads, const float *k_scales,         \
              const float *v_scales, int e5m2) {                                               \
        const decode_args a = {q,          q_stride,     q_rows,       k_cache,      v_cache, \
                               block_stride, token_stride, block_size, num_kv_heads, group,   \
                               block_tables, table_stride, seq_lens,   scale,        window,  \
                               chunk,      out,          k_scales,     v_scales,     e5m2};    \
        const int64_t width = (int64_t)num_kv_heads * group * head_dim;                        \
        _Pragma("omp parallel num_threads(num_threads)") {                                     \
            scratch t = {malloc(sizeof(float) * width), malloc(sizeof(float) * width),         \
                         malloc(sizeof(float) * num_kv_heads * group), NULL,                   \
                         malloc(sizeof(float) * V_TILE * num_kv_heads * head_dim), 0};         \
            _Pragma("omp for schedule(dynamic, 1)") for (int s = 0; s < num_seqs; s++) {       \
                if (head_dim == 64)                                                            \
                    attend_sequence(&a, s, &t, 64, BF16, KIND);                                      \
                else if (head_dim == 128)                                                      \
                    attend_sequence(&a, s, &t, 128, BF16, KIND);                                     \
                else                                                                           \
                    attend_sequence(&a, s, &t, head_dim, BF16, KIND);                                \
            }                                                                                  \
            free(t.qf);                                                                        \
            free(t.acc);                                                                       \
            free(t.sums);                                                                      \
            free(t.scores);                                                                    \
            free(t.kv_row);                                                                    \
        }                                                                                      \
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
