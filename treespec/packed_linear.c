/* y [N, O] = x [N, K] · w [O, K]ᵀ (+ b [O]) on an AVX-512 CPU, from a weight packed once into panels of 16 output
 * rows: wp [P, K, 16], P = ⌈O / 16⌉, wp[p, k, i] = w[16p + i, k] (zero past O). treespec/native_linear.py packs it
 * and calls ``packed_linear``; why it exists: that module's docstring.
 *
 * Each thread takes whole panels. For each k it loads the panel's 16 weights (one cache line) and adds them, times
 * x[n, k] broadcast, into one 16-wide accumulator per input row: up to 16 rows in 16 of the 32 AVX-512 registers,
 * no horizontal sums. So every weight is read from memory once per call in one sequential stream (the next lines
 * prefetched), and the arithmetic of up to 16 rows runs while it streams, instead of after it as in a kernel that
 * re-reads a weight block once per handful of rows (the breakdown: results/notes/2026-12-05-tree-pass-breakdown.md).
 * More than 16 rows go in groups of 16 over the same panel, which is then in L1.
 *
 * Each output is the sum over k in order 0 .. K − 1 of one FMA chain, whatever N is and whichever group the row is
 * in: a row's result has the same bits in a one-token pass, a tree pass and a prefill.
 *
 * A VM's two threads may sit on one core complex or on two. Apart, every activation one thread wrote and the other
 * reads crosses between the complexes slowly, line by line, and a 16-token pass makes hundreds of such hand-offs.
 * So up to 16 rows, each thread transposes the input rows itself rather than half of them for both; and over one
 * row, whole panels of output go to memory with streaming stores rather than into the writer's cache, from where the
 * next op (torch's, on the main thread) would fetch half of them across (measured: results/smollm2_states/). */
#include <stdlib.h>
#include <omp.h>

#ifdef __AVX512F__
#include <immintrin.h>

#include "vector_exp.h"

#define PANEL 16     /* output rows per panel: one 512-bit register of float32 */
#define PF_LINES 32  /* the panel's k-lines prefetched into L1 ahead (2 KB): measured against 0, 8, 16, 64 and 128 */
#define PF_L2_LINES 256 /* ... and into L2 further ahead (16 KB): faster at 1-16 rows than without (and than 128, 512) */

/* a group of C rows, transposed to xt [K, C] (one base address, constant offsets), against panel p → y [C, O];
 * ``stream``: whole panels with streaming stores (y 64-byte aligned, O a multiple of 16) */
#define PANEL_ROWS(C)                                                                                          \
    static void panel_##C(const float *xt, const float *wp, const float *b, float *y, long K, long O, long p, \
                          __mmask16 keep, int stream) {                                                       \
        const float *w = wp + p * K * PANEL;                                                                  \
        __m512 acc[C];                                                                                        \
        _Pragma("GCC unroll 16") for (int j = 0; j < C; j++) acc[j] = _mm512_setzero_ps();                  \
        for (long k = 0; k < K; k++) {                                                                        \
            _mm_prefetch((const char *)(w + (k + PF_LINES) * PANEL), _MM_HINT_T0);                           \
            _mm_prefetch((const char *)(w + (k + PF_L2_LINES) * PANEL), _MM_HINT_T1);                        \
            __m512 ws = _mm512_loadu_ps(w + k * PANEL);                                                       \
            _Pragma("GCC unroll 16") for (int j = 0; j < C; j++)                                              \
                acc[j] = _mm512_fmadd_ps(ws, _mm512_set1_ps(xt[k * C + j]), acc[j]);                          \
        }                                                                                                     \
        __m512 bias = b ? _mm512_maskz_loadu_ps(keep, b + p * PANEL) : _mm512_setzero_ps();                  \
        if (stream && keep == (__mmask16)0xFFFF) {                                                            \
            _Pragma("GCC unroll 16") for (int j = 0; j < C; j++)                                              \
                _mm512_stream_ps(y + j * O + p * PANEL, _mm512_add_ps(acc[j], bias));                         \
        } else {                                                                                              \
            _Pragma("GCC unroll 16") for (int j = 0; j < C; j++)                                              \
                _mm512_mask_storeu_ps(y + j * O + p * PANEL, keep, _mm512_add_ps(acc[j], bias));              \
        }                                                                                                     \
    }

PANEL_ROWS(1) PANEL_ROWS(2) PANEL_ROWS(3) PANEL_ROWS(4) PANEL_ROWS(5) PANEL_ROWS(6) PANEL_ROWS(7) PANEL_ROWS(8)
PANEL_ROWS(9) PANEL_ROWS(10) PANEL_ROWS(11) PANEL_ROWS(12) PANEL_ROWS(13) PANEL_ROWS(14) PANEL_ROWS(15)
PANEL_ROWS(16)

typedef void (*panel_fn)(const float *, const float *, const float *, float *, long, long, long, __mmask16, int);
static const panel_fn PANELS[PANEL + 1] = {0,        panel_1,  panel_2,  panel_3,  panel_4,  panel_5,
                                           panel_6,  panel_7,  panel_8,  panel_9,  panel_10, panel_11,
                                           panel_12, panel_13, panel_14, panel_15, panel_16};

int packed_linear_built(void) { return 1; }

/* x [rows, K] → xt [K, rows] for k in [k0, k1) */
static void transpose(const float *x, float *xt, long rows, long K, long k0, long k1) {
    for (long k = k0; k < k1; k++)
        for (long j = 0; j < rows; j++) xt[k * rows + j] = x[j * K + k];
}

/* a gated MLP's panel p: gate and up products of a group's rows (C ≤ 16) through their panels, then
 * y = silu(gate) · up, SiLU as x / (1 + e^−x) */
static void gated_panel(int C, const float *xt, const float *wg, const float *wu, float *y, long K, long O, long p,
                        __mmask16 keep, int stream) {
    float gate[PANEL * PANEL] __attribute__((aligned(64))), up[PANEL * PANEL] __attribute__((aligned(64)));
    PANELS[C](xt, wg + p * K * PANEL, 0, gate, K, PANEL, 0, (__mmask16)0xFFFF, 0);
    PANELS[C](xt, wu + p * K * PANEL, 0, up, K, PANEL, 0, (__mmask16)0xFFFF, 0);
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int j = 0; j < C; j++) {
        __m512 g = _mm512_load_ps(gate + j * PANEL);
        __m512 h = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)))),
                                 _mm512_load_ps(up + j * PANEL));
        if (stream && keep == (__mmask16)0xFFFF)
            _mm512_stream_ps(y + j * O + p * PANEL, h);
        else
            _mm512_mask_storeu_ps(y + j * O + p * PANEL, keep, h);
    }
}

/* y [N, O] = x · wpᵀ (+ b), or with wu a gated MLP's y = silu(x · wpᵀ) · (x · wuᵀ) (b unused) */
static int product(const float *x, const float *wp, const float *wu, const float *b, float *y, long N, long K, long O,
                   int threads) {
    long panels = (O + PANEL - 1) / PANEL, groups = (N + PANEL - 1) / PANEL;
    int own = groups == 1, stream = N > 1 && O % PANEL == 0 && ((size_t)y & 63) == 0; /* one row: a few lines */
    /* group g at xt + g·16K, as [K, rows of the group]; up to 16 rows, one such copy per thread */
    float *xts = malloc(sizeof(float) * N * K * (own ? threads : 1));
    if (!xts) return -1;
#pragma omp parallel num_threads(threads)
    {
        float *xt = xts;
        if (own) { /* one group: this thread's own copy (the module comment) */
            xt = xts + omp_get_thread_num() * N * K;
            transpose(x, xt, N, K, 0, K);
        } else { /* a prefill's groups: split over the threads (done by one, it showed in a call's time) */
#pragma omp for schedule(static)
            for (long k0 = 0; k0 < K; k0 += 64)
                for (long g = 0; g < groups; g++)
                    transpose(x + g * PANEL * K, xt + g * PANEL * K, N - g * PANEL < PANEL ? N - g * PANEL : PANEL,
                              K, k0, k0 + 64 < K ? k0 + 64 : K);
        }
#pragma omp for schedule(static)
        for (long p = 0; p < panels; p++) {
            long left = O - p * PANEL;
            __mmask16 keep = left >= PANEL ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
            for (long g = 0; g < groups; g++) {
                long rows = N - g * PANEL < PANEL ? N - g * PANEL : PANEL;
                if (wu)
                    gated_panel((int)rows, xt + g * PANEL * K, wp, wu, y + g * PANEL * O, K, O, p, keep, stream);
                else
                    PANELS[rows](xt + g * PANEL * K, wp, b, y + g * PANEL * O, K, O, p, keep, stream);
            }
        }
        if (stream) _mm_sfence(); /* the streamed lines are visible before the caller reads y */
    }
    free(xts);
    return 0;
}

/* the entry points: x, wp (wg, wu), y contiguous float32, b NULL or [O]; return 0, or −1 where memory ran out */
int packed_linear(const float *x, const float *wp, const float *b, float *y, long N, long K, long O, int threads) {
    return product(x, wp, 0, b, y, N, K, O, threads);
}

int packed_gated(const float *x, const float *wg, const float *wu, float *y, long N, long K, long O, int threads) {
    return product(x, wg, wu, 0, y, N, K, O, threads);
}

#else /* no AVX-512 here: the library still loads, and says so */
int packed_linear_built(void) { return 0; }

/* never called: native_linear.packed_available() is False; the symbol is there for the loader */
int packed_linear(const float *x, const float *wp, const float *b, float *y, long N, long K, long O, int threads) {
    (void)x, (void)wp, (void)b, (void)y, (void)N, (void)K, (void)O, (void)threads;
    return -2;
}

int packed_gated(const float *x, const float *wg, const float *wu, float *y, long N, long K, long O, int threads) {
    (void)x, (void)wg, (void)wu, (void)y, (void)N, (void)K, (void)O, (void)threads;
    return -2;
}
#endif
