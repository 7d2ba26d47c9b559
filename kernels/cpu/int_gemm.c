/* The CPU's product of activations by 4- or 8-bit integer weights, read as codes (no dequantized
 * copy): y[M, N] = x[M, K] @ W^T (+ bias), w[n, k] = (q[k, n] - zero[g, n]) * scale[g, n],
 * g = k / group_size. Built and called by kernels/cpu/int_gemm.py, which documents the layout's
 * repacking and the measurements; this file holds the arithmetic.
 *
 * The weight arrives repacked into tiles of LANES = 16 output columns, one fp32 lane per column
 * (one AVX-512 register, or two AVX2 ones), each tile's K codes contiguous:
 *
 *     tiles  [T][K / pack][LANES] uint32   word (t, r, c): codes k = r*pack .. r*pack+pack-1 of
 *                                          column n = t*LANES + c, low bits first
 *     scales [T][G][LANES] fp32            zeros [T][G][LANES] uint8, or NULL: 2^(bits-1)
 *
 * so a thread streams its tiles' bytes front to back. Per tile and group g, for each row m:
 *
 *     dot[m]  = sum_{k in g} x[m, k] * q[k]        (16 columns at once, fp32)
 *     y[m]   += scale[g] * (dot[m] - zero[g] * xsum[m, g])
 *
 * with xsum[m, g] = sum_{k in g} x[m, k] computed once per call: the zero and scale are applied
 * once per group, not per code. A group's codes are unpacked once and multiplied by up to
 * ROWS_IN_REGISTERS rows whose accumulators stay in registers (4 rows: 8 AVX2 registers of the
 * 16). Vectors are GCC's vector extensions (gcc and clang): -march=native makes them AVX-512,
 * AVX2 pairs or SSE quadruples from one source. 16 columns rather than 8 measured 1.3-1.6x
 * faster at 1 and 4 rows on the 2-core AMD box (each broadcast input feeds two AVX2 FMAs, or
 * one AVX-512 FMA twice as wide).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { LANES = 16 };            /* output columns per tile */
enum { ROWS_IN_REGISTERS = 4 }; /* row accumulators a group's unpacked codes feed at once */

typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef uint8_t vb __attribute__((vector_size(LANES)));

static inline vi load_words(const uint32_t *p) {
    vi v;
    memcpy(&v, p, sizeof v); /* an unaligned vector load */
    return v;
}

static inline vf load_floats(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline vf splat(float f) { return (vf){0} + f; }

/* The zero points of a tile's group as floats (NULL zeros: the symmetric 2^(bits-1)). */
static inline vf load_zeros(const uint8_t *zeros, int64_t at, int bits) {
    if (zeros == NULL) return splat((float)(1 << (bits - 1)));
    vb z;
    memcpy(&z, zeros + at, sizeof z);
    return __builtin_convertvector(z, vf);
}

/* dot[i] += sum over the group's words of x[i, k] * q[k] for ROWS rows (x rows ``stride``
 * apart, starting at the group's first input), ``words`` words of BITS-bit codes.
 *
 * Each row's sum runs in CHAINS = ROWS_IN_REGISTERS / rows independent accumulators (code j of
 * a word goes to chain j % CHAINS), added at the group's end: one row's multiply-adds would
 * otherwise form one dependency chain, each waiting the FMA's latency (4 cycles) for the last,
 * where 4 rows give 4 chains. Measured on the 2-core AMD box: docs/measurements/cpu-kernels.md. */
static inline __attribute__((always_inline)) void group_dots(
    const uint32_t *tile_words, int words, const float *x, int64_t stride, int rows, int bits,
    vf *dot) {
    enum { MAX_CHAINS = ROWS_IN_REGISTERS };
    const int pack = 32 / bits;
    const int chains = ROWS_IN_REGISTERS / rows;
    const vi mask = (vi){0} + ((1 << bits) - 1);
    vf part[ROWS_IN_REGISTERS][MAX_CHAINS];
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < chains; c++) part[i][c] = splat(0.0f);
    for (int r = 0; r < words; r++) {
        const vi w = load_words(tile_words + (int64_t)r * LANES);
#pragma GCC unroll 8
        for (int j = 0; j < pack; j++) {
            const vf q = __builtin_convertvector((w >> (bits * j)) & mask, vf);
            const int k = r * pack + j;
            for (int i = 0; i < rows; i++) part[i][j % chains] += splat(x[i * stride + k]) * q;
        }
    }
    for (int i = 0; i < rows; i++)
        for (int c = 0; c < chains; c++) dot[i] += part[i][c];
}

/* A tile's outputs ``acc[M][LANES]`` for rows in chunks of up to ROWS_IN_REGISTERS; ROWS and
 * BITS are constants where this is inlined, so the loops over them unroll. */
static inline __attribute__((always_inline)) void tile_chunk(
    const uint32_t *tile_words, const float *tile_scales, const uint8_t *zeros, int64_t zero_at,
    const float *x, int64_t x_stride, const float *xsum, int num_groups, int group_words,
    int group_size, int rows, int bits, float *acc) {
    for (int g = 0; g < num_groups; g++) {
        vf dot[ROWS_IN_REGISTERS];
        for (int i = 0; i < rows; i++) dot[i] = splat(0.0f);
        group_dots(tile_words + (int64_t)g * group_words * LANES, group_words,
                   x + (int64_t)g * group_size, x_stride, rows, bits, dot);
        const vf scale = load_floats(tile_scales + (int64_t)g * LANES);
        const vf zero = load_zeros(zeros, zero_at + (int64_t)g * LANES, bits);
        for (int i = 0; i < rows; i++) {
            vf a = load_floats(acc + i * LANES);
            a += scale * (dot[i] - zero * splat(xsum[(int64_t)i * num_groups + g]));
            memcpy(acc + i * LANES, &a, sizeof a);
        }
    }
}

#define CHUNK_CASE(R, B)                                                                        \
    case R:                                                                                     \
        tile_chunk(tile_words, tile_scales, zeros, zero_at, x, x_stride, xsum, num_groups,       \
                   group_words, group_size, R, B, acc);                                         \
        break;

#define CHUNK_SWITCH(B)                                                                         \
    switch (rows) { CHUNK_CASE(1, B) CHUNK_CASE(2, B) CHUNK_CASE(3, B) CHUNK_CASE(4, B) }

static void tile_rows(const uint32_t *tile_words, const float *tile_scales, const uint8_t *zeros,
                      int64_t zero_at, const float *x, int64_t x_stride, const float *xsum,
                      int num_groups, int group_words, int group_size, int rows, int bits,
                      float *acc) {
    if (bits == 4) {
        CHUNK_SWITCH(4)
    } else {
        CHUNK_SWITCH(8)
    }
}

/* y[m, n] = sum_k x[m, k] * w[n, k] + bias[n] (module comment), fp32.
 *   x: [M, K] rows x_stride apart; tiles, scales, zeros: the tiled weight (T = ceil(N / LANES));
 *   bias: [N] or NULL; y: [M, N] rows y_stride apart. Tiles are spread over the threads.
 * Returns 0, or -1 when a scratch allocation failed (y then incomplete). */
int int_gemm_f32(const float *x, int64_t x_stride, int M, int K, const uint32_t *tiles,
                 const float *scales, const uint8_t *zeros, int N, int bits, int group_size,
                 const float *bias, float *y, int64_t y_stride, int num_threads) {
    const int pack = 32 / bits;
    const int num_groups = K / group_size;
    const int group_words = group_size / pack;
    const int num_tiles = (N + LANES - 1) / LANES;
    float *xsum = malloc(sizeof(float) * (size_t)M * (size_t)num_groups);
    if (xsum == NULL) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t mg = 0; mg < (int64_t)M * num_groups; mg++) {
            const float *row = x + (mg / num_groups) * x_stride + (mg % num_groups) * group_size;
            float s = 0.0f;
            for (int k = 0; k < group_size; k++) s += row[k];
            xsum[mg] = s;
        }
        /* implicit barrier: every xsum is written before any tile reads it */
        float *acc = malloc(sizeof(float) * LANES * (size_t)M);
        if (acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < num_tiles; t++) {
            if (acc == NULL) continue;
            const int64_t n0 = t * LANES;
            const int width = N - n0 < LANES ? (int)(N - n0) : LANES;
            for (int m = 0; m < M; m++)
                for (int c = 0; c < LANES; c++)
                    acc[m * LANES + c] = bias != NULL && c < width ? bias[n0 + c] : 0.0f;
            const uint32_t *tile_words = tiles + t * (int64_t)(K / pack) * LANES;
            const float *tile_scales = scales + t * (int64_t)num_groups * LANES;
            const int64_t zero_at = t * (int64_t)num_groups * LANES;
            for (int m0 = 0; m0 < M; m0 += ROWS_IN_REGISTERS) {
                const int rows = M - m0 < ROWS_IN_REGISTERS ? M - m0 : ROWS_IN_REGISTERS;
                tile_rows(tile_words, tile_scales, zeros, zero_at, x + m0 * x_stride, x_stride,
                          xsum + (int64_t)m0 * num_groups, num_groups, group_words, group_size,
                          rows, bits, acc + m0 * LANES);
            }
            for (int m = 0; m < M; m++)
                memcpy(y + m * y_stride + n0, acc + m * LANES, sizeof(float) * (size_t)width);
        }
        free(acc);
    }
    free(xsum);
    return failed ? -1 : 0;
}
