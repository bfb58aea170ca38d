/* Attention of a few new queries (a tree or chain pass: 2-64 tokens) against a cache, on an AVX-512 CPU, reading
 * grouped key/value heads in place (GQA). treespec/gqa_attention.py calls it; why it exists: that module's docstring.
 *
 *   out[b, i, h, :] = softmax_j(scale · q[b, h, i, :] · k[b, h / G, j, :] + mask[b, j, i]) · v[b, h / G, j, :]
 *
 * q [B, H, Q, D], k and v [B, KV, S, D] with any strides but a unit one in D (a preallocated cache's views); mask
 * additive, TRANSPOSED [B or 1, S, Q] contiguous, or NULL; out [B, Q, H, D] contiguous (the layout transformers wants
 * back). G = H / KV query heads share each key/value head.
 *
 * The rows of one key/value head's group (G heads × Q queries, row r = head r / Q, query r % Q) go in blocks of 16,
 * one row per lane of a 512-bit register. Scores: per key, one FMA per d of the block's transposed queries with the
 * key's element broadcast, so a block's 16 scores of a key land in one register with no horizontal sum, and the
 * softmax over keys is lane-wise (max, exp, sum). Then P · V with D in lanes: per key, V's row from L1 against up
 * to 16 / (D / 16) rows' broadcast probabilities. Keys and values are read once per block from L2, where torch's
 * flash kernel tiles for long queries (what it saves: results/few_query_attention/). */
#include <math.h>
#include <stdlib.h>

#ifdef __AVX512F__
#include <immintrin.h>

#include "vector_exp.h"

#define LANES 16
#define KEYS 8 /* keys per score step: 8 accumulators, 9 loads per 8 FMAs */

/* P · V for C = D / 16 registers per row, for R rows (R · C = 16 accumulators) of a block from its row t0: p [S, 16]
 * (lane = row of the block), each row's output to out at its (query, head) with 1 / sum applied */
#define PV(C, R)                                                                                                \
    static void pv_##C(const float *p, const float *v, long vss, long S, const float *inv, const long *dest,    \
                       int t0, int rows, float *out) {                                                         \
        __m512 acc[R][C];                                                                                       \
        _Pragma("GCC unroll 16") for (int t = 0; t < R; t++)                                                    \
            _Pragma("GCC unroll 16") for (int c = 0; c < C; c++) acc[t][c] = _mm512_setzero_ps();              \
        for (long j = 0; j < S; j++) {                                                                          \
            __m512 vj[C];                                                                                       \
            _Pragma("GCC unroll 16") for (int c = 0; c < C; c++) vj[c] = _mm512_loadu_ps(v + j * vss + 16 * c); \
            _Pragma("GCC unroll 16") for (int t = 0; t < R; t++) {                                              \
                __m512 pj = _mm512_set1_ps(p[j * LANES + t0 + t]);                                             \
                _Pragma("GCC unroll 16") for (int c = 0; c < C; c++) acc[t][c] = _mm512_fmadd_ps(pj, vj[c], acc[t][c]); \
            }                                                                                                   \
        }                                                                                                       \
        for (int t = 0; t < R && t0 + t < rows; t++) {                                                          \
            __m512 scale = _mm512_set1_ps(inv[t0 + t]);                                                         \
            _Pragma("GCC unroll 16") for (int c = 0; c < C; c++)                                                \
                _mm512_storeu_ps(out + dest[t0 + t] + 16 * c, _mm512_mul_ps(acc[t][c], scale));                \
        }                                                                                                       \
    }

PV(1, 16) PV(2, 8) PV(4, 4) PV(8, 2) PV(16, 1)

int few_query_attention_built(void) { return 1; }

/* one block's scores and softmax weights: qt [D, 16] its queries transposed, into p [S, 16] (unnormalised) and inv
 * (1 / each row's sum) */
static void weights(const float *qt, const float *kb, long kss, const float *mb, long Q, __m512i idx, __mmask16 live,
                    long S, long D, float scale, float *p, float *inv) {
    __m512 vscale = _mm512_set1_ps(scale), best = _mm512_set1_ps(-INFINITY);
    long j = 0;
    for (; j + KEYS <= S; j += KEYS) {
        __m512 acc[KEYS];
        _Pragma("GCC unroll 8") for (int t = 0; t < KEYS; t++) acc[t] = _mm512_setzero_ps();
        for (long d = 0; d < D; d++) {
            __m512 qd = _mm512_load_ps(qt + d * LANES);
            _Pragma("GCC unroll 8") for (int t = 0; t < KEYS; t++)
                acc[t] = _mm512_fmadd_ps(qd, _mm512_set1_ps(kb[(j + t) * kss + d]), acc[t]);
        }
        _Pragma("GCC unroll 8") for (int t = 0; t < KEYS; t++) {
            __m512 s = _mm512_mul_ps(acc[t], vscale);
            if (mb) s = _mm512_add_ps(s, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, idx, mb + (j + t) * Q, 4));
            _mm512_store_ps(p + (j + t) * LANES, s);
            best = _mm512_max_ps(best, s);
        }
    }
    for (; j < S; j++) {
        __m512 acc = _mm512_setzero_ps();
        for (long d = 0; d < D; d++)
            acc = _mm512_fmadd_ps(_mm512_load_ps(qt + d * LANES), _mm512_set1_ps(kb[j * kss + d]), acc);
        __m512 s = _mm512_mul_ps(acc, vscale);
        if (mb) s = _mm512_add_ps(s, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, idx, mb + j * Q, 4));
        _mm512_store_ps(p + j * LANES, s);
        best = _mm512_max_ps(best, s);
    }
    __m512 total = _mm512_setzero_ps();
    for (j = 0; j < S; j++) {
        __m512 w = exp512(_mm512_sub_ps(_mm512_load_ps(p + j * LANES), best));
        _mm512_store_ps(p + j * LANES, w);
        total = _mm512_add_ps(total, w);
    }
    _mm512_storeu_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), total));
}

/* the entry point; strides in floats (sb, sh, ss: batch, head, token); returns 0, −1 where memory ran out, −2 for a
 * head size it does not take (a multiple of 16 up to 256)
 *
 * Two steps over the threads: each block's weights (one item per block), then P · V in items of R rows per block,
 * so that the 9 blocks of a SmolLM2 layer's 16-token pass do not leave one of two threads idle for a fifth. */
int few_query_attention(const float *q, long qsb, long qsh, long qsq, const float *k, long ksb, long ksh, long kss,
                        const float *v, long vsb, long vsh, long vss, const float *mask, long msb, float *out, long B,
                        long H, long KV, long Q, long S, long D, float scale, int threads) {
    long C = D / 16;
    if (D % 16 != 0 || (C & (C - 1)) != 0 || C > 16) return -2;
    long G = H / KV, R = G * Q, blocks = (R + LANES - 1) / LANES, units = B * KV * blocks, per = 16 / C;
    float *p = aligned_alloc(64, sizeof(float) * units * S * LANES);   /* [units, S, 16]: scores, then weights */
    float *inv = malloc(sizeof(float) * units * LANES);
    long *dest = malloc(sizeof(long) * units * LANES);                   /* each row's output offset */
    int *rows = malloc(sizeof(int) * units);
    int failed = !p || !inv || !dest || !rows;
#pragma omp parallel num_threads(threads) if (!failed)
    {
        float *qt = aligned_alloc(64, sizeof(float) * D * LANES); /* [D, 16]: a block's queries, transposed */
        if (!qt) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (long u = 0; u < units; u++) {
            if (failed) continue;
            long b = u / (KV * blocks), g = (u / blocks) % KV, r0 = (u % blocks) * LANES;
            rows[u] = R - r0 < LANES ? (int)(R - r0) : LANES;
            int query[LANES];
            for (int l = 0; l < LANES; l++) {
                long r = r0 + (l < rows[u] ? l : 0), h = g * G + r / Q, i = r % Q;
                query[l] = (int)i;
                dest[u * LANES + l] = (b * Q + i) * H * D + h * D;
                const float *qrow = q + b * qsb + h * qsh + i * qsq;
                for (long d = 0; d < D; d++) qt[d * LANES + l] = l < rows[u] ? qrow[d] : 0.0f;
            }
            weights(qt, k + b * ksb + g * ksh, kss, mask ? mask + b * msb : 0, Q, _mm512_loadu_si512(query),
                    (__mmask16)((1u << rows[u]) - 1u), S, D, scale, p + u * S * LANES, inv + u * LANES);
        }
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < units * (LANES / per); item++) {
            long u = item / (LANES / per), b = u / (KV * blocks), g = (u / blocks) % KV;
            int t0 = (int)(item % (LANES / per)) * (int)per;
            if (failed || t0 >= rows[u]) continue;
            const float *vb = v + b * vsb + g * vsh, *pu = p + u * S * LANES;
            switch (C) {
            case 1: pv_1(pu, vb, vss, S, inv + u * LANES, dest + u * LANES, t0, rows[u], out); break;
            case 2: pv_2(pu, vb, vss, S, inv + u * LANES, dest + u * LANES, t0, rows[u], out); break;
            case 4: pv_4(pu, vb, vss, S, inv + u * LANES, dest + u * LANES, t0, rows[u], out); break;
            case 8: pv_8(pu, vb, vss, S, inv + u * LANES, dest + u * LANES, t0, rows[u], out); break;
            default: pv_16(pu, vb, vss, S, inv + u * LANES, dest + u * LANES, t0, rows[u], out); break;
            }
        }
        free(qt);
    }
    free(p), free(inv), free(dest), free(rows);
    return failed ? -1 : 0;
}

#else /* no AVX-512 here: the library still loads, and says so */
int few_query_attention_built(void) { return 0; }

/* never called: gqa_attention's native path is off where few_query_attention_built() is 0 */
int few_query_attention(const float *q, long qsb, long qsh, long qsq, const float *k, long ksb, long ksh, long kss,
                        const float *v, long vsb, long vsh, long vss, const float *mask, long msb, float *out, long B,
                        long H, long KV, long Q, long S, long D, float scale, int threads) {
    (void)q, (void)qsb, (void)qsh, (void)qsq, (void)k, (void)ksb, (void)ksh, (void)kss, (void)v, (void)vsb, (void)vsh;
    (void)vss, (void)mask, (void)msb, (void)out, (void)B, (void)H, (void)KV, (void)Q, (void)S, (void)D, (void)scale;
    (void)threads;
    return -2;
}
#endif
