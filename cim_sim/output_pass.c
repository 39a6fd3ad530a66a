/* The analog arrays' output pass, hand-vectorized: product planes -> ADC steps, output noise, ADC
 * clip and round, each row's peak. The reference is _output_stage_eager in analog.py; this computes
 * the same floats bit for bit (built with -ffp-contract=off, every product and sum rounded as
 * there). torch.compile's version of that function runs the noise table's lookup as a scalar loop
 * and stores the noisy product before a second loop; here it is one AVX-512 or AVX2 gather per
 * vector and one pass. The one-column-at-a-time path serves row tails and tests: on a CPU without
 * AVX2, output_pass.py leaves the pass to torch.compile. Built and loaded by output_pass.py. */

#include <math.h>
#include <stdint.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HILT_X86 1
#include <immintrin.h>
#endif

/* lowbias32's mixer, as devices._hash32 computes it on int32 */
static inline uint32_t mix(uint32_t x) {
    x = (x ^ (x >> 16)) * 0x21F0AAADu;
    x = (x ^ (x >> 15)) * 0xD35A2D97u;
    return x ^ (x >> 15);
}

typedef struct {
    const int32_t *planes;  /* (chips, rows, 2n): coarse then fine products; or NULL */
    const float *values;    /* (chips, rows, n) float products when planes is NULL */
    int64_t chip_stride, row_stride;  /* of planes or values, in elements (columns are contiguous) */
    const float *scale;     /* (chips, n): each column's scale (integer planes only) */
    const int32_t *keys;    /* (chips, 2): each chip's noise keys */
    const float *table;     /* 65536 quantiles of N(0, 1) */
    float noise_scale, levels;
    int noise, adc;
    int64_t chips, rows, n;
    float *out;             /* (chips, rows, n) */
    float *peak;            /* (chips, rows): max |noisy product| per row (adc only) */
} Pass;

static const float INV_FINE = (float)(1.0 / 254); /* analog.FINE */

/* where row cr (chip-major) of planes or values starts */
static inline int64_t row_start(const Pass *p, int64_t cr) {
    return (cr / p->rows) * p->chip_stride + (cr % p->rows) * p->row_stride;
}

/* columns j0..n-1 of one row, one at a time; returns the running peak */
static float row_scalar(const Pass *p, int64_t cr, int64_t j0, float peak, int *nan) {
    int64_t c = cr / p->rows, n = p->n;
    uint32_t k0 = (uint32_t)p->keys[2 * c], k1 = (uint32_t)p->keys[2 * c + 1];
    uint32_t base = (uint32_t)((cr % p->rows) * n);
    const int32_t *pl = p->planes ? p->planes + row_start(p, cr) : 0;
    const float *pv = p->planes ? 0 : p->values + row_start(p, cr);
    float *o = p->out + cr * n;
    for (int64_t j = j0; j < n; j++) {
        float v = pl ? ((float)pl[j] + (float)pl[n + j] * INV_FINE) * p->scale[c * n + j] : pv[j];
        if (p->noise) v = v + p->noise_scale * p->table[mix(mix((base + (uint32_t)j) ^ k0) ^ k1) >> 16];
        if (p->adc) {
            float a = fabsf(v);
            if (a != a) *nan = 1;
            else if (a > peak) peak = a;
            v = nearbyintf(v < -p->levels ? -p->levels : (v > p->levels ? p->levels : v));
        }
        o[j] = v;
    }
    return peak;
}

#ifdef HILT_X86
__attribute__((target("avx512f"))) static inline __m512i mix16(__m512i x) {
    x = _mm512_mullo_epi32(_mm512_xor_si512(x, _mm512_srli_epi32(x, 16)), _mm512_set1_epi32(0x21F0AAAD));
    x = _mm512_mullo_epi32(_mm512_xor_si512(x, _mm512_srli_epi32(x, 15)), _mm512_set1_epi32((int)0xD35A2D97u));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
}

__attribute__((target("avx512f"))) static float row_avx512(const Pass *p, int64_t cr, int *nan) {
    int64_t c = cr / p->rows, n = p->n, j = 0;
    __m512i k0 = _mm512_set1_epi32(p->keys[2 * c]), k1 = _mm512_set1_epi32(p->keys[2 * c + 1]);
    __m512i index = _mm512_add_epi32(_mm512_set1_epi32((int32_t)((cr % p->rows) * n)),
                                     _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __m512 inv = _mm512_set1_ps(INV_FINE), ns = _mm512_set1_ps(p->noise_scale);
    __m512 hi = _mm512_set1_ps(p->levels), lo = _mm512_set1_ps(-p->levels), peak = _mm512_setzero_ps();
    __mmask16 nans = 0;
    float *o = p->out + cr * n;
    for (; j + 16 <= n; j += 16, index = _mm512_add_epi32(index, _mm512_set1_epi32(16))) {
        __m512 v;
        if (p->planes) {
            const int32_t *pl = p->planes + row_start(p, cr) + j;
            __m512 coarse = _mm512_cvtepi32_ps(_mm512_loadu_si512(pl));
            __m512 fine = _mm512_cvtepi32_ps(_mm512_loadu_si512(pl + n));
            v = _mm512_mul_ps(_mm512_add_ps(coarse, _mm512_mul_ps(fine, inv)), _mm512_loadu_ps(p->scale + c * n + j));
        } else {
            v = _mm512_loadu_ps(p->values + row_start(p, cr) + j);
        }
        if (p->noise) {
            __m512i h = mix16(_mm512_xor_si512(mix16(_mm512_xor_si512(index, k0)), k1));
            v = _mm512_add_ps(v, _mm512_mul_ps(ns, _mm512_i32gather_ps(_mm512_srli_epi32(h, 16), p->table, 4)));
        }
        if (p->adc) {
            __m512 a = _mm512_abs_ps(v);
            nans |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
            peak = _mm512_max_ps(peak, a);
            /* max(lo, v) then min(hi, .): a NaN v is the second operand, so it stays NaN, as torch's clamp */
            v = _mm512_roundscale_ps(_mm512_min_ps(hi, _mm512_max_ps(lo, v)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        }
        _mm512_storeu_ps(o + j, v);
    }
    *nan |= nans != 0;
    return row_scalar(p, cr, j, _mm512_reduce_max_ps(peak), nan);
}

__attribute__((target("avx2"))) static inline __m256i mix8(__m256i x) {
    x = _mm256_mullo_epi32(_mm256_xor_si256(x, _mm256_srli_epi32(x, 16)), _mm256_set1_epi32(0x21F0AAAD));
    x = _mm256_mullo_epi32(_mm256_xor_si256(x, _mm256_srli_epi32(x, 15)), _mm256_set1_epi32((int)0xD35A2D97u));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
}

__attribute__((target("avx2"))) static float row_avx2(const Pass *p, int64_t cr, int *nan) {
    int64_t c = cr / p->rows, n = p->n, j = 0;
    __m256i k0 = _mm256_set1_epi32(p->keys[2 * c]), k1 = _mm256_set1_epi32(p->keys[2 * c + 1]);
    __m256i index = _mm256_add_epi32(_mm256_set1_epi32((int32_t)((cr % p->rows) * n)),
                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 inv = _mm256_set1_ps(INV_FINE), ns = _mm256_set1_ps(p->noise_scale);
    __m256 hi = _mm256_set1_ps(p->levels), lo = _mm256_set1_ps(-p->levels), peak = _mm256_setzero_ps();
    __m256 sign = _mm256_set1_ps(-0.0f), nans = _mm256_setzero_ps();
    float *o = p->out + cr * n;
    for (; j + 8 <= n; j += 8, index = _mm256_add_epi32(index, _mm256_set1_epi32(8))) {
        __m256 v;
        if (p->planes) {
            const int32_t *pl = p->planes + row_start(p, cr) + j;
            __m256 coarse = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)pl));
            __m256 fine = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(pl + n)));
            v = _mm256_mul_ps(_mm256_add_ps(coarse, _mm256_mul_ps(fine, inv)), _mm256_loadu_ps(p->scale + c * n + j));
        } else {
            v = _mm256_loadu_ps(p->values + row_start(p, cr) + j);
        }
        if (p->noise) {
            __m256i h = mix8(_mm256_xor_si256(mix8(_mm256_xor_si256(index, k0)), k1));
            v = _mm256_add_ps(v, _mm256_mul_ps(ns, _mm256_i32gather_ps(p->table, _mm256_srli_epi32(h, 16), 4)));
        }
        if (p->adc) {
            __m256 a = _mm256_andnot_ps(sign, v);
            nans = _mm256_or_ps(nans, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
            peak = _mm256_max_ps(peak, a);
            v = _mm256_round_ps(_mm256_min_ps(hi, _mm256_max_ps(lo, v)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        }
        _mm256_storeu_ps(o + j, v);
    }
    *nan |= _mm256_movemask_ps(nans) != 0;
    float lanes[8], m = 0.0f;
    _mm256_storeu_ps(lanes, peak);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
    return row_scalar(p, cr, j, m, nan);
}
#endif

/* The widest instruction set this CPU runs: 2 AVX-512, 1 AVX2, 0 neither (one column at a time). */
int hilt_output_pass_isa(void) {
#ifdef HILT_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return 2;
    if (__builtin_cpu_supports("avx2")) return 1;
#endif
    return 0;
}

/* One pass over every row of every chip, rows in parallel. isa: as hilt_output_pass_isa, or lower. */
void hilt_output_pass(const int32_t *planes, const float *values, int64_t chip_stride, int64_t row_stride,
                      const float *scale, const int32_t *keys, const float *table, float noise_scale, float levels,
                      int noise, int adc, int64_t chips, int64_t rows, int64_t n, float *out, float *peak, int isa) {
    Pass p = {planes, values, chip_stride, row_stride, scale, keys, table, noise_scale, levels, noise, adc, chips,
              rows, n, out, peak};
    int64_t total = chips * rows;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) if (total * n >= 65536)
#endif
    for (int64_t cr = 0; cr < total; cr++) {
        int nan = 0;
        float m;
#ifdef HILT_X86
        if (isa == 2) m = row_avx512(&p, cr, &nan);
        else if (isa == 1) m = row_avx2(&p, cr, &nan);
        else
#endif
            m = row_scalar(&p, cr, 0, 0.0f, &nan);
        if (adc) peak[cr] = nan ? NAN : m;
    }
}
