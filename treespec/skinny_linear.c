/* y [N, O] = x [N, K] · w [O, K]ᵀ (+ b [O]) for the few rows of a decoding or tree pass on an AVX2 CPU
 * (treespec/native_linear.py builds and loads it; why: its module docstring).
 *
 * Every weight row is read from memory once per call, whatever N: the weight rows are split over the threads,
 * and each block of OB = 2 rows is multiplied against up to NB = 6 input rows at a time, whose 8-float slices
 * stay in registers while the weight streams past (2 × 6 = 12 accumulators of the 16 AVX registers). The first
 * pass over a block reads it from memory, later passes (N > 6) from L1. Each output is one dot product over K,
 * summed across its register at the end. K must be a multiple of 8 (the caller checks). */
#include <immintrin.h>

#define OB 2           /* weight rows per block */
#define NB 6           /* input rows per pass over a block */
#define AHEAD (2 * OB) /* weight rows prefetched ahead of the block being read */

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* rows o0 .. o0 + R − 1 of w against input rows n0 .. n0 + C − 1 */
#define BLOCK(R, C)                                                                                           \
    static inline void block_##R##_##C(const float *x, const float *w, const float *b, float *y, long K,    \
                                       long O, long o0, long n0, int prefetch) {                            \
        __m256 acc[R][C];                                                                                    \
        for (int i = 0; i < R; i++)                                                                          \
            for (int j = 0; j < C; j++) acc[i][j] = _mm256_setzero_ps();                                     \
        for (long k = 0; k < K; k += 8) {                                                                    \
            __m256 xs[C];                                                                                    \
            for (int j = 0; j < C; j++) xs[j] = _mm256_loadu_ps(x + (n0 + j) * K + k);                      \
            if (prefetch)                                                                                    \
                for (int i = 0; i < R; i++) _mm_prefetch((const char *)(w + (o0 + i + AHEAD) * K + k),      \
                                                         _MM_HINT_T0);                                       \
            for (int i = 0; i < R; i++) {                                                                    \
                __m256 ws = _mm256_loadu_ps(w + (o0 + i) * K + k);                                           \
                for (int j = 0; j < C; j++) acc[i][j] = _mm256_fmadd_ps(ws, xs[j], acc[i][j]);              \
            }                                                                                                \
        }                                                                                                    \
        for (int i = 0; i < R; i++)                                                                          \
            for (int j = 0; j < C; j++) y[(n0 + j) * O + o0 + i] = sum8(acc[i][j]) + (b ? b[o0 + i] : 0.0f); \
    }

BLOCK(2, 1) BLOCK(2, 2) BLOCK(2, 3) BLOCK(2, 4) BLOCK(2, 5) BLOCK(2, 6)
BLOCK(1, 1) BLOCK(1, 2) BLOCK(1, 3) BLOCK(1, 4) BLOCK(1, 5) BLOCK(1, 6)

/* every input row against weight rows o0 .. o0 + OB − 1 (two_rows) or row o0 alone */
static void rows_of(const float *x, const float *w, const float *b, float *y, long N, long K, long O, long o0,
                    int two_rows) {
    for (long n = 0; n < N; n += NB) {
        long c = N - n < NB ? N - n : NB;
        int prefetch = o0 + AHEAD < O; /* later passes too: measured faster at 8 and 16 rows */
        if (two_rows) {
            switch (c) {
            case 1: block_2_1(x, w, b, y, K, O, o0, n, prefetch); break;
            case 2: block_2_2(x, w, b, y, K, O, o0, n, prefetch); break;
            case 3: block_2_3(x, w, b, y, K, O, o0, n, prefetch); break;
            case 4: block_2_4(x, w, b, y, K, O, o0, n, prefetch); break;
            case 5: block_2_5(x, w, b, y, K, O, o0, n, prefetch); break;
            default: block_2_6(x, w, b, y, K, O, o0, n, prefetch); break;
            }
        } else {
            switch (c) {
            case 1: block_1_1(x, w, b, y, K, O, o0, n, 0); break;
            case 2: block_1_2(x, w, b, y, K, O, o0, n, 0); break;
            case 3: block_1_3(x, w, b, y, K, O, o0, n, 0); break;
            case 4: block_1_4(x, w, b, y, K, O, o0, n, 0); break;
            case 5: block_1_5(x, w, b, y, K, O, o0, n, 0); break;
            default: block_1_6(x, w, b, y, K, O, o0, n, 0); break;
            }
        }
    }
}

/* the entry point: x, w, y contiguous float32; b may be NULL; threads: OpenMP threads (torch's count) */
void skinny_linear(const float *x, const float *w, const float *b, float *y, long N, long K, long O, int threads) {
    long blocks = O / OB;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long block = 0; block < blocks; block++) rows_of(x, w, b, y, N, K, O, block * OB, 1);
    for (long o = blocks * OB; o < O; o++) rows_of(x, w, b, y, N, K, O, o, 0);
}
