/* e^x for 16 float32 lanes on AVX-512, shared by treespec's native kernels (packed_linear.c's gated MLP,
 * few_query_attention.c's softmax): the Cephes expf polynomial on [−ln2/2, ln2/2], scaled by 2^n
 * (_mm512_scalef_ps); exactly 0 below −87.3 (where float32's e^x is denormal or zero: masked keys, −inf or float32's
 * min, weigh exactly 0), +inf or near it above 88.7. Within ~2 ulp of expf elsewhere. */
#ifndef TREESPEC_VECTOR_EXP_H
#define TREESPEC_VECTOR_EXP_H
#include <immintrin.h>

static inline __m512 exp512(__m512 x) {
    const __m512 lowest = _mm512_set1_ps(-87.33654f);
    __mmask16 keep = _mm512_cmp_ps_mask(x, lowest, _CMP_GE_OQ); /* false for −inf and NaN too */
    x = _mm512_min_ps(_mm512_max_ps(x, lowest), _mm512_set1_ps(88.72283f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

#endif
