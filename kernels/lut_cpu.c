/* The lookup-table matmul y = x @ dequant(W).T on the CPU, reading hilt's packed codes as stored
 * (kernels/packing.py), or at 1-2 bits interleaved in place (see "pair tables"):
 * W[n, k] = codebook[code[n, k]] * scale[n, k / B] (+ offset[n, k / B]).
 * The reference is lut_matmul_reference in lut_matmul.py; built and loaded by lut_cpu.py.
 *
 * Decode is bound by memory, so the aim is to read each packed byte once and spend few
 * instructions per weight. The vector paths dequantize in registers: per block, the codebook
 * (replicated to 16 entries) times the block's scale (plus offset) is one register, and a code is
 * looked up with one permute (AVX-512 _mm512_permutexvar_ps: 16 entries; AVX2
 * _mm256_permutevar8x32_ps: 8, two and a blend for 4 bits). The permutes read only the low 4 (3)
 * bits of each lane, so codes need no masking: lane i holds code byte i, and the codes inside the
 * byte are reached by shifting the whole vector. That visits a byte's codes in "phases" (code j of
 * 16 bytes at once), so x is reordered once per call to match: within each chunk of L * cpb weights
 * (L lanes, cpb codes per lane unit), xp[j * L + i] = x[i * cpb + j]. The result is the same sum
 * in another order. 8-bit codes are gathered from the codebook, or converted when it is uniform
 * (integers). The scalar path takes every format (any width, any block) on any CPU. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HILT_X86 1
#include <immintrin.h>
#endif

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };
enum { Q8_ROWS = 4 }; /* rows of bfloat16 x the int8 path takes (decode); more go the float32 way */

/* The weight as lut_cpu.py passes it (ctypes Structure of the same fields). */
typedef struct {
    const uint8_t *codes;  /* (N, row_bytes) */
    int64_t row_bytes;
    const void *book;      /* (levels,) or, per block, (N, nb, levels) */
    int32_t book_dt, per_block;
    const void *scales;    /* (N, nb) */
    const void *offsets;   /* (N, nb) or NULL */
    int32_t scales_dt, offsets_dt;
    int32_t bits;
    int32_t interleaved;   /* 1: rows in tiles of 16, codes and scales interleaved (see "pair tables") */
    int64_t block, K, N, nb;
} LutWeight;

/* What one call derives from it once: per-layer codebooks as float32 registers' contents. */
typedef struct {
    LutWeight w;
    int levels, lanes, cpb, uniform;
    float base, step;
    float tab16[16];  /* codebook replicated to 16 entries (entry i: level i mod levels) */
    float book[256];  /* per-layer codebook as float32 */
    /* the bfloat16 path (bfloat16 x, AVX-512 BF16): see "bfloat16 path" below */
    int bf, cpw, bf_groups;
    uint16_t tab32[32]; /* per-layer codebook as bfloat16, entry i: level i mod levels */
    /* the pair-table path (1-2 bits, bfloat16 x): see "pair tables" below */
    int pt;
    int64_t n16;        /* rows in whole tiles of 16 */
    float digit[4][16]; /* digit[j][e]: the level of code j of nibble e */
    /* the int8 path (bfloat16 x on AVX2 without AVX-512): see "int8 path" below */
    int q8;
    float q8_step;       /* the codebook's int8 step: level i ~ q8_step * q8_book[i] */
    int8_t q8_book[16];
} Wt;

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff, u;
    float f;
    if (e == 0) {
        f = (float)m * (1.0f / 16777216.0f); /* subnormal: m * 2^-24 */
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (e == 31) {
        u = sign | 0x7f800000u | (m << 13);
    } else {
        u = sign | ((e + 112) << 23) | (m << 13);
    }
    memcpy(&f, &u, 4);
    return f;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's .to(bfloat16) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

static inline float load_f(const void *p, int dt, int64_t i) {
    if (dt == DT_F16) return f16_to_f32(((const uint16_t *)p)[i]);
    if (dt == DT_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

static inline float scale_at(const Wt *w, int64_t n, int64_t b) { return load_f(w->w.scales, w->w.scales_dt, n * w->w.nb + b); }
static inline float offset_at(const Wt *w, int64_t n, int64_t b) {
    return w->w.offsets ? load_f(w->w.offsets, w->w.offsets_dt, n * w->w.nb + b) : 0.0f;
}

/* code k of a row: bits [k*bits, (k+1)*bits) of the row's little-endian bit stream */
static inline unsigned code_at(const uint8_t *row, int64_t k, int bits) {
    int64_t bit = k * bits, p = bit >> 3;
    int sh = (int)(bit & 7);
    unsigned v = row[p] >> sh;
    if (sh + bits > 8) v |= (unsigned)row[p + 1] << (8 - sh); /* only when the code crosses a byte */
    return v & ((1u << bits) - 1);
}

/* codes per lane unit: a byte holds 8/bits codes; 3-bit codes come in groups of 8 in 3 bytes */
static int codes_per_unit(int bits) { return bits == 3 ? 8 : 8 / bits; }

static void setup(Wt *t, const LutWeight *w, int isa) {
    t->w = *w;
    t->levels = 1 << w->bits;
    t->cpb = (w->bits <= 4 || w->bits == 8) ? codes_per_unit(w->bits) : 1;
    t->uniform = 0;
    if (!w->per_block) {
        for (int c = 0; c < t->levels; c++) t->book[c] = load_f(w->book, w->book_dt, c);
        for (int i = 0; i < 16; i++) t->tab16[i] = t->book[i & (t->levels - 1)];
        /* a uniform codebook (every integer format): level c is base + c * step, exactly */
        t->base = t->book[0];
        t->step = t->levels > 1 ? t->book[1] - t->book[0] : 0.0f;
        t->uniform = 1;
        for (int c = 0; c < t->levels; c++) t->uniform &= t->book[c] == t->base + (float)c * t->step;
    }
    /* the vector width this weight's blocks allow: a chunk of lanes * cpb weights must lie in one block */
    int vec = (w->bits >= 1 && w->bits <= 4) || (w->bits == 8 && !w->per_block);
    t->lanes = 1;
    if (vec && isa >= 2 && w->block % (16 * t->cpb) == 0) t->lanes = 16;
    else if (vec && isa >= 1 && w->block % (8 * t->cpb) == 0) t->lanes = 8;
    if (t->lanes == 1) t->cpb = 1;
    /* bfloat16 path: one codebook per layer, 1-4 bits, chunks of 32 word lanes that split into whole
     * blocks (or lie in one), each block a whole number of float32 lanes (2 * cpw codes). With offsets,
     * only a codebook exact in bfloat16 (integers): the offset term is added apart, so a rounded level
     * would be compared with |W|, not with the larger |level * scale|. */
    t->bf = 0;
    t->cpw = w->bits == 3 ? 4 : (w->bits >= 1 && w->bits <= 4 ? 8 / w->bits : 1);
    const int64_t chunk = 32 * (int64_t)t->cpw, B = w->block;
    if (isa >= 3 && !w->per_block && w->bits >= 1 && w->bits <= 4 && B % (2 * t->cpw) == 0 &&
        (B % chunk == 0 || chunk % B == 0)) {
        int exact = 1;
        for (int c = 0; c < t->levels; c++) exact &= bf16_to_f32(f32_to_bf16(t->book[c])) == t->book[c];
        t->bf = !w->offsets || exact;
        t->bf_groups = chunk > B ? (int)(chunk / B) : 1;
        for (int i = 0; i < 32; i++) t->tab32[i] = f32_to_bf16(t->book[i & (t->levels - 1)]);
    }
    /* pair-table path: 1-2 bits on the bfloat16 path without offsets, whole 16-row tiles, units of
     * 16 / bits columns inside a block */
    const int unit = w->bits >= 1 && w->bits <= 2 ? 16 / w->bits : 0;
    t->pt = t->bf && unit && !w->offsets && B % unit == 0 && w->N >= 16;
    t->n16 = w->N / 16 * 16;
    /* int8 path: 2-, 4- and symmetric 8-bit codes, one codebook per layer, no offsets, blocks of whole 64-code chunks, on AVX2
     * (wider CPUs keep their float32 and bfloat16 paths) */
    t->q8 = isa == 1 && (w->bits == 4 || w->bits == 2 || w->bits == 8) && !w->per_block && !w->offsets &&
            B % 64 == 0 && w->K % 64 == 0 && !w->interleaved;
    if (w->bits == 8) { /* symmetric integers: code c is level (c - 128) * step, an int8 as it is */
        t->q8 &= t->uniform && t->base + 128.0f * t->step == 0.0f;
        t->q8_step = t->step;
    } else if (t->q8) {
        float most = 0.0f;
        for (int c = 0; c < 16; c++) most = fabsf(t->tab16[c]) > most ? fabsf(t->tab16[c]) : most;
        t->q8_step = most > 0.0f ? most / 127.0f : 0.0f;
        for (int c = 0; c < 16; c++) t->q8_book[c] = (int8_t)(most > 0.0f ? lrintf(t->tab16[c] / t->q8_step) : 0);
    }
    if (t->pt)
        for (int j = 0; j < 4 / w->bits; j++)
            for (int e = 0; e < 16; e++) t->digit[j][e] = t->book[(e >> (j * w->bits)) & (t->levels - 1)];
}

/* Row n of an interleaved weight gathered into natural order (its codes and scales), so the per-row paths
 * read it as row 0 of `v`; rows past the whole tiles are stored as they are. */
typedef struct {
    Wt v;
    uint8_t *buf;
} RowView;

static int view_open(RowView *rv, const Wt *w) {
    rv->buf = NULL;
    if (!w->w.interleaved) return 0;
    rv->v = *w;
    rv->v.w.interleaved = 0;
    rv->buf = (uint8_t *)malloc((size_t)(w->w.row_bytes + 4 * w->w.nb + 8));
    rv->v.w.codes = rv->buf;
    rv->v.w.scales = rv->buf + ((w->w.row_bytes + 7) / 8) * 8;
    return rv->buf == NULL;
}

static const Wt *view_row(RowView *rv, const Wt *w, int64_t *n) {
    if (!w->w.interleaved || *n >= w->n16) return w;
    const int64_t t = *n / 16, i = *n % 16, words = w->w.row_bytes / 2, nb = w->w.nb;
    const uint16_t *tile = (const uint16_t *)(w->w.codes + t * 16 * w->w.row_bytes);
    uint16_t *row = (uint16_t *)rv->buf;
    for (int64_t j = 0; j < words; j++) row[j] = tile[j * 16 + i];
    const size_t sz = w->w.scales_dt == DT_F32 ? 4 : 2;
    const uint8_t *sc = (const uint8_t *)w->w.scales;
    for (int64_t b = 0; b < nb; b++)
        memcpy((uint8_t *)rv->v.w.scales + b * sz, sc + ((t * nb + b) * 16 + i) * sz, sz);
    *n = 0;
    return &rv->v;
}

/* ---------------------------------------------------------------- portable path (any format) */

/* res[m] = sum_k x[m, k] W[n, k] for m < M (x natural order, row stride ldx) */
static void row_scalar(const Wt *w, int64_t n, const float *x, int64_t ldx, int64_t M, float *res) {
    const int bits = w->w.bits, levels = w->levels;
    const int64_t B = w->w.block;
    const uint8_t *row = w->w.codes + n * w->w.row_bytes;
    float tab[256];
    const int use_tab = levels <= B; /* a table per block pays off when it has fewer entries than the block */
    for (int64_t m = 0; m < M; m++) res[m] = 0.0f;
    for (int64_t b = 0; b < w->w.nb; b++) {
        const float s = scale_at(w, n, b), o = offset_at(w, n, b);
        const int64_t bk = w->w.per_block ? (n * w->w.nb + b) * levels : 0;
        if (use_tab)
            for (int c = 0; c < levels; c++)
                tab[c] = (w->w.per_block ? load_f(w->w.book, w->w.book_dt, bk + c) : w->book[c]) * s + o;
        for (int64_t k = b * B; k < (b + 1) * B; k++) {
            unsigned c = code_at(row, k, bits);
            float v = use_tab ? tab[c] : (w->w.per_block ? load_f(w->w.book, w->w.book_dt, bk + c) : w->book[c]) * s + o;
            for (int64_t m = 0; m < M; m++) res[m] += x[m * ldx + k] * v;
        }
    }
}

static void dequant_scalar(const Wt *w, int64_t n, float *out) {
    const int bits = w->w.bits, levels = w->levels;
    const int64_t B = w->w.block;
    const uint8_t *row = w->w.codes + n * w->w.row_bytes;
    for (int64_t b = 0; b < w->w.nb; b++) {
        const float s = scale_at(w, n, b), o = offset_at(w, n, b);
        const int64_t bk = w->w.per_block ? (n * w->w.nb + b) * levels : 0;
        for (int64_t k = b * B; k < (b + 1) * B; k++) {
            unsigned c = code_at(row, k, bits);
            out[k] = (w->w.per_block ? load_f(w->w.book, w->w.book_dt, bk + c) : w->book[c]) * s + o;
        }
    }
}

/* a per-block codebook replicated to 16 entries (scalar: bfloat16/float32 books, or 2 levels) */
static void block_book16(const Wt *w, int64_t n, int64_t b, float *tab) {
    const int64_t bk = (n * w->w.nb + b) * w->levels;
    for (int i = 0; i < 16; i++) tab[i] = load_f(w->w.book, w->w.book_dt, bk + (i & (w->levels - 1)));
}

#ifdef HILT_X86
#define T512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define T256 __attribute__((target("avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))

/* 8 lanes of 3-bit codes: lane i = bytes 3i..3i+2 of p (24 bytes read, none beyond) */
INLINE T256 __m256i load3_8(const uint8_t *p) {
    const __m128i pick = _mm_setr_epi8(0, 1, 2, -1, 3, 4, 5, -1, 6, 7, 8, -1, 9, 10, 11, -1);
    __m128i a = _mm_loadu_si128((const __m128i *)p), b = _mm_loadl_epi64((const __m128i *)(p + 16));
    __m128i lo = _mm_shuffle_epi8(a, pick), hi = _mm_shuffle_epi8(_mm_alignr_epi8(b, a, 12), pick);
    return _mm256_set_m128i(hi, lo);
}

INLINE T512 __m512 book512(const Wt *w, int64_t n, int64_t b) {
    const int L = w->levels;
    const int64_t bk = (n * w->w.nb + b) * L;
    if (w->w.book_dt == DT_F16) { /* the stored dtype: converted in registers */
        const uint16_t *h = (const uint16_t *)w->w.book + bk;
        if (L == 16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h));
        if (L == 8) {
            __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
            return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v)));
        }
        if (L == 4) return _mm512_broadcast_f32x4(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)h)));
    }
    float tab[16];
    block_book16(w, n, b, tab);
    return _mm512_loadu_ps(tab);
}

/* The weight vector of phase j of a chunk (codes in v, the block's values in t; 8 bits: t, u the
 * scale and offset terms). */
INLINE T512 __m512 look512(const Wt *w, __m512i v, __m512 t, __m512 u, int j, const int BITS) {
    if (BITS == 8)
        return w->uniform ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), t, u)
                          : _mm512_fmadd_ps(_mm512_i32gather_ps(v, w->book, 4), t, u);
    return _mm512_permutexvar_ps(_mm512_srli_epi32(v, j * BITS), t);
}

INLINE T512 __m512i codes512(const uint8_t *p, const int BITS) {
    if (BITS == 3) return _mm512_inserti64x4(_mm512_castsi256_si512(load3_8(p)), load3_8(p + 24), 1);
    return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
}

/* one chunk into the accumulators: phase j of it adds to chain (first + j) mod CH of each row of x.
 * Several chains: an FMA's latency is 4 cycles, so one chain per row of x would bound decode at one
 * vector of weights per 4 cycles */
INLINE T512 void chunk512(const Wt *w, const uint8_t *p, const float *xk, int64_t ldx, __m512 t, __m512 u,
                          __m512 *acc, const int MT, const int CH, const int first, const int BITS) {
    const int cpb = BITS == 3 ? 8 : 8 / BITS;
    __m512i v = codes512(p, BITS);
#pragma GCC unroll 8
    for (int j = 0; j < cpb; j++) {
        __m512 wv = look512(w, v, t, u, j, BITS);
#pragma GCC unroll 8
        for (int m = 0; m < MT; m++)
            acc[m * CH + (first + j) % CH] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xk + m * ldx + j * 16), acc[m * CH + (first + j) % CH]);
    }
}

INLINE T512 void block_values512(const Wt *w, int64_t n, int64_t b, __m512 *book, __m512 *t, __m512 *u, const int BITS,
                                  const int PB) {
    const __m512 s = _mm512_set1_ps(scale_at(w, n, b)), o = _mm512_set1_ps(offset_at(w, n, b));
    *t = s;
    *u = o;
    if (BITS == 8) {
        if (w->uniform) { /* level c * step + base, scaled: c * (step s) + (base s + o) */
            *t = _mm512_mul_ps(_mm512_set1_ps(w->step), s);
            *u = _mm512_fmadd_ps(_mm512_set1_ps(w->base), s, o);
        }
    } else {
        if (PB) *book = book512(w, n, b);
        *t = _mm512_fmadd_ps(*book, s, o); /* this block's 16 weight values */
    }
}

/* One output row against MT rows of the reordered x (row stride ldx): res[m] for m < MT. */
INLINE T512 void body512(const Wt *w, int64_t n, const float *xp, int64_t ldx, float *res, const int MT,
                         const int BITS, const int PB) {
    const int cpb = BITS == 3 ? 8 : 8 / BITS, chunk = 16 * cpb;
    const int CH = MT >= 8 ? 1 : (8 / MT < 4 ? 8 / MT : 4); /* at most 8 accumulators */
    const int U = CH > cpb ? CH / cpb : 1;                   /* chunks per step to fill the chains */
    const int64_t B = w->w.block;
    const int unrolled = (B / chunk) % U == 0;
    const uint8_t *row = w->w.codes + n * w->w.row_bytes;
    __m512 acc[8];
    for (int i = 0; i < MT * CH; i++) acc[i] = _mm512_setzero_ps();
    __m512 book = _mm512_loadu_ps(BITS == 8 ? w->book : w->tab16), t, u;
    for (int64_t b = 0; b < w->w.nb; b++) {
        block_values512(w, n, b, &book, &t, &u, BITS, PB);
        int64_t k0 = b * B;
        if (U == 2 && unrolled)
            for (; k0 < (b + 1) * B; k0 += 2 * chunk) {
                chunk512(w, row + ((k0 * BITS) >> 3), xp + k0, ldx, t, u, acc, MT, CH, 0, BITS);
                chunk512(w, row + (((k0 + chunk) * BITS) >> 3), xp + k0 + chunk, ldx, t, u, acc, MT, CH, cpb, BITS);
            }
        for (; k0 < (b + 1) * B; k0 += chunk)
            chunk512(w, row + ((k0 * BITS) >> 3), xp + k0, ldx, t, u, acc, MT, CH, 0, BITS);
    }
    for (int m = 0; m < MT; m++) {
        __m512 a = acc[m * CH];
        for (int c = 1; c < CH; c++) a = _mm512_add_ps(a, acc[m * CH + c]);
        res[m] = _mm512_reduce_add_ps(a);
    }
}

INLINE T512 void dq512(const Wt *w, int64_t n, float *out, const int BITS, const int PB) {
    const int cpb = BITS == 3 ? 8 : 8 / BITS, chunk = 16 * cpb;
    const int64_t B = w->w.block;
    const uint8_t *row = w->w.codes + n * w->w.row_bytes;
    __m512 book = _mm512_loadu_ps(BITS == 8 ? w->book : w->tab16), t, u;
    for (int64_t b = 0; b < w->w.nb; b++) {
        block_values512(w, n, b, &book, &t, &u, BITS, PB);
        for (int64_t k0 = b * B; k0 < (b + 1) * B; k0 += chunk) {
            __m512i v = codes512(row + ((k0 * BITS) >> 3), BITS);
            for (int j = 0; j < cpb; j++) _mm512_storeu_ps(out + k0 + j * 16, look512(w, v, t, u, j, BITS));
        }
    }
}

/* AVX2: 8 lanes. 4-bit codes index 16 entries: two 8-entry permutes, the code's bit 3 picks one. */
typedef struct { __m256 lo, hi; } Tab256;

INLINE T256 Tab256 book256(const Wt *w, int64_t n, int64_t b) {
    Tab256 r;
    const int L = w->levels;
    const int64_t bk = (n * w->w.nb + b) * L;
    if (w->w.book_dt == DT_F16 && L >= 8) {
        const uint16_t *h = (const uint16_t *)w->w.book + bk;
        r.lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
        r.hi = L == 16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + 8))) : r.lo;
        return r;
    }
    float tab[16];
    block_book16(w, n, b, tab);
    r.lo = _mm256_loadu_ps(tab);
    r.hi = _mm256_loadu_ps(tab + 8);
    return r;
}

INLINE T256 __m256 look256(__m256i v, __m256 lo, __m256 hi, const int BITS) {
    if (BITS < 4) return _mm256_permutevar8x32_ps(lo, v);
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, v), _mm256_permutevar8x32_ps(hi, v),
                            _mm256_castsi256_ps(_mm256_slli_epi32(v, 28)));
}

INLINE T256 __m256 wv256(const Wt *w, __m256i v, __m256 tlo, __m256 thi, int j, const int BITS) {
    if (BITS == 8)
        return w->uniform ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), tlo, thi)
                          : _mm256_fmadd_ps(_mm256_i32gather_ps(w->book, v, 4), tlo, thi);
    return look256(_mm256_srli_epi32(v, j * BITS), tlo, thi, BITS);
}

INLINE T256 __m256i codes256(const uint8_t *p, const int BITS) {
    return BITS == 3 ? load3_8(p) : _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

INLINE T256 void chunk256(const Wt *w, const uint8_t *p, const float *xk, int64_t ldx, __m256 tlo, __m256 thi,
                          __m256 *acc, const int MT, const int CH, const int first, const int BITS) {
    const int cpb = BITS == 3 ? 8 : 8 / BITS;
    __m256i v = codes256(p, BITS);
#pragma GCC unroll 8
    for (int j = 0; j < cpb; j++) {
        __m256 wv = wv256(w, v, tlo, thi, j, BITS);
#pragma GCC unroll 4
        for (int m = 0; m < MT; m++)
            acc[m * CH + (first + j) % CH] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xk + m * ldx + j * 8), acc[m * CH + (first + j) % CH]);
    }
}

INLINE T256 void block_values256(const Wt *w, int64_t n, int64_t b, Tab256 *book, __m256 *tlo, __m256 *thi, const int BITS,
                                  const int PB) {
    const __m256 s = _mm256_set1_ps(scale_at(w, n, b)), o = _mm256_set1_ps(offset_at(w, n, b));
    *tlo = s;
    *thi = o;
    if (BITS == 8) {
        if (w->uniform) {
            *tlo = _mm256_mul_ps(_mm256_set1_ps(w->step), s);
            *thi = _mm256_fmadd_ps(_mm256_set1_ps(w->base), s, o);
        }
    } else {
        if (PB) *book = book256(w, n, b);
        *tlo = _mm256_fmadd_ps(book->lo, s, o);
        *thi = _mm256_fmadd_ps(book->hi, s, o);
    }
}

INLINE T256 void body256(const Wt *w, int64_t n, const float *xp, int64_t ldx, float *res, const int MT,
                         const int BITS, const int PB) {
    const int cpb = BITS == 3 ? 8 : 8 / BITS, chunk = 8 * cpb;
    const int CH = MT >= 4 ? 1 : 4 / MT; /* 16 registers: at most 4 accumulators */
    const int U = CH > cpb ? CH / cpb : 1;
    const int64_t B = w->w.block;
    const int unrolled = (B / chunk) % U == 0;
    const uint8_t *row = w->w.codes + n * w->w.row_bytes;
    __m256 acc[4];
    for (int i = 0; i < MT * CH; i++) acc[i] = _mm256_setzero_ps();
    Tab256 book;
    book.lo = _mm256_loadu_ps(BITS == 8 ? w->book : w->tab16);
    book.hi = _mm256_loadu_ps(w->tab16 + 8);
    __m256 tlo, thi;
    for (int64_t b = 0; b < w->w.nb; b++) {
        block_values256(w, n, b, &book, &tlo, &thi, BITS, PB);
        int64_t k0 = b * B;
        if (U == 2 && unrolled)
            for (; k0 < (b + 1) * B; k0 += 2 * chunk) {
                chunk256(w, row + ((k0 * BITS) >> 3), xp + k0, ldx, tlo, thi, acc, MT, CH, 0, BITS);
                chunk256(w, row + (((k0 + chunk) * BITS) >> 3), xp + k0 + chunk, ldx, tlo, thi, acc, MT, CH, cpb, BITS);
            }
        for (; k0 < (b + 1) * B; k0 += chunk)
            chunk256(w, row + ((k0 * BITS) >> 3), xp + k0, ldx, tlo, thi, acc, MT, CH, 0, BITS);
    }
    for (int m = 0; m < MT; m++) {
        __m256 a = acc[m * CH];
        for (int c = 1; c < CH; c++) a = _mm256_add_ps(a, acc[m * CH + c]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        res[m] = _mm_cvtss_f32(h);
    }
}

INLINE T256 void dq256(const Wt *w, int64_t n, float *out, const int BITS, const int PB) {
    const int cpb = BITS == 3 ? 8 : 8 / BITS, chunk = 8 * cpb;
    const int64_t B = w->w.block;
    const uint8_t *row = w->w.codes + n * w->w.row_bytes;
    Tab256 book;
    book.lo = _mm256_loadu_ps(BITS == 8 ? w->book : w->tab16);
    book.hi = _mm256_loadu_ps(w->tab16 + 8);
    __m256 tlo, thi;
    for (int64_t b = 0; b < w->w.nb; b++) {
        block_values256(w, n, b, &book, &tlo, &thi, BITS, PB);
        for (int64_t k0 = b * B; k0 < (b + 1) * B; k0 += chunk) {
            __m256i v = codes256(row + ((k0 * BITS) >> 3), BITS);
            for (int j = 0; j < cpb; j++) _mm256_storeu_ps(out + k0 + j * 8, wv256(w, v, tlo, thi, j, BITS));
        }
    }
}

/* each (tile height, width) pair as its own function, so the loops above unroll on constants */
#define BITS_SWITCH(F, ...)                                                  \
    if (w->w.per_block) switch (w->w.bits) {                                 \
        case 1: F(__VA_ARGS__, 1, 1); break;                                 \
        case 2: F(__VA_ARGS__, 2, 1); break;                                 \
        case 3: F(__VA_ARGS__, 3, 1); break;                                 \
        default: F(__VA_ARGS__, 4, 1); break; /* per-block 8-bit: scalar */  \
        }                                                                    \
    else switch (w->w.bits) {                                                \
        case 1: F(__VA_ARGS__, 1, 0); break;                                 \
        case 2: F(__VA_ARGS__, 2, 0); break;                                 \
        case 3: F(__VA_ARGS__, 3, 0); break;                                 \
        case 4: F(__VA_ARGS__, 4, 0); break;                                 \
        default: F(__VA_ARGS__, 8, 0); break;                                \
        }
#define TILE512(MT) \
    static T512 void tile512_##MT(const Wt *w, int64_t n, const float *xp, int64_t ldx, float *res) { \
        BITS_SWITCH(body512, w, n, xp, ldx, res, MT) }
#define TILE256(MT) \
    static T256 void tile256_##MT(const Wt *w, int64_t n, const float *xp, int64_t ldx, float *res) { \
        BITS_SWITCH(body256, w, n, xp, ldx, res, MT) }
TILE512(1) TILE512(2) TILE512(3) TILE512(4) TILE512(5) TILE512(6) TILE512(7) TILE512(8)
TILE256(1) TILE256(2) TILE256(3) TILE256(4)

typedef void (*TileFn)(const Wt *, int64_t, const float *, int64_t, float *);
static const TileFn TILES512[9] = {0, tile512_1, tile512_2, tile512_3, tile512_4, tile512_5, tile512_6, tile512_7, tile512_8};
static const TileFn TILES256[5] = {0, tile256_1, tile256_2, tile256_3, tile256_4};

static T512 void dequant512(const Wt *w, int64_t n, float *out) { BITS_SWITCH(dq512, w, n, out) }
static T256 void dequant256(const Wt *w, int64_t n, float *out) { BITS_SWITCH(dq256, w, n, out) }
#endif

#ifdef HILT_X86
/* ---------------------------------------------------------------- bfloat16 path
 * For bfloat16 x on CPUs with AVX-512 BF16, per-layer codebooks of 1-4 bits. The codebook, rounded to
 * bfloat16 (a relative error of at most 2^-8 per weight, which error_ratio's bound for bfloat16 x
 * allows), is one register of 32 words, and 32 weights are looked up by one vpermw and multiplied
 * and added by one vdpbf16ps: half the instructions per weight of the float32 path. Word lane i holds
 * code byte i of a chunk (3 bits: 4 codes of a 24-bit group), phase j its j-th code; vpermw reads the
 * low 5 bits of a lane and the table repeats every `levels` entries, so higher codes need no mask. The
 * block scale is applied to the chunk's float32 sums (float32 lane l: word lanes 2l, 2l + 1), one
 * scale per group of lanes when a chunk spans several blocks; offsets add offset * sum(x over the
 * block) at the end of the row. */
#define TBF __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")))

INLINE TBF __m512i codesbf(const uint8_t *p, const int BITS) {
    if (BITS == 3) { /* 16 dwords of 8 codes: low word codes 0-3 (bits 0-11), high word codes 4-7 */
        __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(load3_8(p)), load3_8(p + 24), 1);
        return _mm512_mask_blend_epi16(0xAAAAAAAAu, v, _mm512_slli_epi32(v, 4));
    }
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
}

/* scale_at in registers (F16C): the software conversion and its call cost as much as a chunk's arithmetic */
INLINE TBF float scale_bf(const Wt *w, int64_t n, int64_t b) {
    const int64_t i = n * w->w.nb + b;
    if (w->w.scales_dt == DT_F16) return _cvtsh_ss(((const uint16_t *)w->w.scales)[i]);
    if (w->w.scales_dt == DT_BF16) return bf16_to_f32(((const uint16_t *)w->w.scales)[i]);
    return ((const float *)w->w.scales)[i];
}

/* float32 lane l: the scale of block b0 + l * G / 16 (G blocks in the chunk) */
INLINE TBF __m512 chunk_scales(const Wt *w, int64_t n, int64_t b0, const int G) {
    /* in registers: a masked load of scalars just stored would wait on store forwarding; a tail chunk's
     * blocks past the row's end get scale 0 (their x is 0) */
    __m512 r = _mm512_set1_ps(scale_bf(w, n, b0));
    for (int g = 1; g < G; g++)
        r = _mm512_mask_mov_ps(r, (__mmask16)(0xFFFFu << (g * 16 / G)),
                               _mm512_set1_ps(b0 + g < w->w.nb ? scale_bf(w, n, b0 + g) : 0.0f));
    return r;
}

INLINE TBF void bodybf(const Wt *w, int64_t n, const uint16_t *xp, int64_t ldx, const float *xsum, float *res,
                       const int MT, const int BITS, const int G) {
    const int cpw = BITS == 3 ? 4 : 8 / BITS, chunk = 32 * cpw;
    const int64_t K = w->w.K, B = w->w.block;
    const uint8_t *row = w->w.codes + n * w->w.row_bytes;
    const __m512i tab = _mm512_loadu_si512((const void *)w->tab32);
    __m512 acc[4], sv = _mm512_setzero_ps();
    for (int m = 0; m < MT; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        if (G > 1 || k0 % B == 0) sv = chunk_scales(w, n, k0 / B, G);
        __m512i v;
        if (k0 + chunk <= K) v = codesbf(row + ((k0 * BITS) >> 3), BITS);
        else { /* the row's last, partial chunk (blocks smaller than a chunk): its codes zero-padded */
            uint8_t tail[64] = {0};
            memcpy(tail, row + ((k0 * BITS) >> 3), (size_t)(((K - k0) * BITS) >> 3));
            v = codesbf(tail, BITS);
        }
        __m512 blk[4];
        for (int m = 0; m < MT; m++) blk[m] = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int j = 0; j < cpw; j++) {
            __m512i wv = _mm512_permutexvar_epi16(j ? _mm512_srli_epi16(v, j * BITS) : v, tab);
#pragma GCC unroll 4
            for (int m = 0; m < MT; m++)
                blk[m] = _mm512_dpbf16_ps(blk[m], (__m512bh)wv,
                                          (__m512bh)_mm512_loadu_si512((const void *)(xp + m * ldx + k0 + j * 32)));
        }
        for (int m = 0; m < MT; m++) acc[m] = _mm512_fmadd_ps(blk[m], sv, acc[m]);
    }
    for (int m = 0; m < MT; m++) {
        float r = _mm512_reduce_add_ps(acc[m]);
        if (w->w.offsets)
            for (int64_t b = 0; b < w->w.nb; b++) r += offset_at(w, n, b) * xsum[m * w->w.nb + b];
        res[m] = r;
    }
}

#define GROUPS_SWITCH(MT, BITS)                                                      \
    switch (w->bf_groups) {                                                          \
    case 1: bodybf(w, n, xp, ldx, xsum, res, MT, BITS, 1); break;                   \
    case 2: bodybf(w, n, xp, ldx, xsum, res, MT, BITS, 2); break;                   \
    case 4: bodybf(w, n, xp, ldx, xsum, res, MT, BITS, 4); break;                   \
    default: bodybf(w, n, xp, ldx, xsum, res, MT, BITS, w->bf_groups); break;       \
    }
#define TILEBF(MT)                                                                                      \
    static TBF void tilebf_##MT(const Wt *w, int64_t n, const uint16_t *xp, int64_t ldx, const float *xsum, \
                                float *res) {                                                           \
        switch (w->w.bits) {                                                                            \
        case 1: GROUPS_SWITCH(MT, 1) break;                                                             \
        case 2: GROUPS_SWITCH(MT, 2) break;                                                             \
        case 3: GROUPS_SWITCH(MT, 3) break;                                                             \
        default: GROUPS_SWITCH(MT, 4) break;                                                            \
        }                                                                                               \
    }
TILEBF(1) TILEBF(2) TILEBF(3) TILEBF(4)
typedef void (*TileBfFn)(const Wt *, int64_t, const uint16_t *, int64_t, const float *, float *);
static const TileBfFn TILESBF[5] = {0, tilebf_1, tilebf_2, tilebf_3, tilebf_4};

/* Decode (M = 1): R rows of W at once, each with two chains (even and odd phases). One row alone
 * waits on its vdpbf16ps chain every phase; 2R independent chains keep the unit busy, and each
 * phase's x is loaded once for all R rows. */
INLINE TBF void rowsbf(const Wt *w, int64_t n0, const uint16_t *xp, const float *xsum, float *res, const int R,
                       const int BITS, const int G) {
    const int cpw = BITS == 3 ? 4 : 8 / BITS, chunk = 32 * cpw;
    const int64_t K = w->w.K, B = w->w.block, rb = w->w.row_bytes;
    const uint8_t *row = w->w.codes + n0 * rb;
    const __m512i tab = _mm512_loadu_si512((const void *)w->tab32);
    __m512 acc[4], sv[4];
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) acc[r] = sv[r] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < K; k0 += chunk) {
        if (G > 1 || k0 % B == 0)
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) sv[r] = chunk_scales(w, n0 + r, k0 / B, G);
        const int64_t at = (k0 * BITS) >> 3;
        /* the next group's codes at the same place: the hardware prefetcher alone leaves the unit waiting
         * (measured 1.3-1.6x faster on 576-4096 wide layers; a prefetch past the last row is harmless) */
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) _mm_prefetch((const char *)(row + (r + R) * rb + at), _MM_HINT_T0);
        __m512i v[4];
        if (k0 + chunk <= K) {
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) v[r] = codesbf(row + r * rb + at, BITS);
        } else { /* the row's last, partial chunk: its codes zero-padded */
            #pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                uint8_t tail[64] = {0};
                memcpy(tail, row + r * rb + at, (size_t)(((K - k0) * BITS) >> 3));
                v[r] = codesbf(tail, BITS);
            }
        }
        __m512 blk[4][2];
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) blk[r][0] = blk[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int j = 0; j < cpw; j++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xp + k0 + j * 32));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                __m512i wv = _mm512_permutexvar_epi16(j ? _mm512_srli_epi16(v[r], j * BITS) : v[r], tab);
                blk[r][j & 1] = _mm512_dpbf16_ps(blk[r][j & 1], (__m512bh)wv, xv);
            }
        }
        #pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(_mm512_add_ps(blk[r][0], blk[r][1]), sv[r], acc[r]);
    }
    #pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        float s = _mm512_reduce_add_ps(acc[r]);
        if (w->w.offsets)
            for (int64_t b = 0; b < w->w.nb; b++) s += offset_at(w, n0 + r, b) * xsum[b];
        res[r] = s;
    }
}

#define ROWS_GROUPS(R, BITS)                                               \
    switch (w->bf_groups) {                                                \
    case 1: rowsbf(w, n0, xp, xsum, res, R, BITS, 1); break;               \
    case 2: rowsbf(w, n0, xp, xsum, res, R, BITS, 2); break;               \
    case 4: rowsbf(w, n0, xp, xsum, res, R, BITS, 4); break;               \
    default: rowsbf(w, n0, xp, xsum, res, R, BITS, w->bf_groups); break;   \
    }
#define ROWSBF(R)                                                                                               \
    static TBF void rowsbf_##R(const Wt *w, int64_t n0, const uint16_t *xp, const float *xsum, float *res) { \
        switch (w->w.bits) {                                                                                \
        case 1: ROWS_GROUPS(R, 1) break;                                                                    \
        case 2: ROWS_GROUPS(R, 2) break;                                                                    \
        case 3: ROWS_GROUPS(R, 3) break;                                                                    \
        default: ROWS_GROUPS(R, 4) break;                                                                   \
        }                                                                                                   \
    }
ROWSBF(1) ROWSBF(2) ROWSBF(3) ROWSBF(4)
typedef void (*RowsBfFn)(const Wt *, int64_t, const uint16_t *, const float *, float *);
static const RowsBfFn ROWSBF_FNS[5] = {0, rowsbf_1, rowsbf_2, rowsbf_3, rowsbf_4};

/* ---------------------------------------------------------------- pair tables (1-2 bits, bfloat16 x)
 * After T-MAC: instead of looking up weights, look up sums of activations. A nibble of 2-bit codes is
 * two weights (4 1-bit codes: four), so for each group of 4 / bits columns the 16 possible sums
 * sum_j level(code j) * x[k + j] are computed once per call (float32, rounded to bfloat16: at most
 * 2^-8 relative, as the bfloat16 path's rounded codebook) and every row looks its nibble up. For the
 * lookup to serve 16 rows at once the rows must share a table, so the weight is interleaved: rows in
 * tiles of 16, and within a tile, per unit of 16 / bits columns (two code bytes a row), the 16 rows'
 * two bytes side by side (32 bytes: word lanes 2i and 2i + 1 are row i's bytes A and B); scales in
 * tiles too, (tile, block, row in tile). A unit's low nibbles index table "lo" (entries 0-15: the
 * columns of A's low nibble, 16-31: B's low nibble; the odd lanes get + 16), high nibbles table "hi",
 * so one vpermw and one vdpbf16ps (against ones, summing lanes 2i and 2i + 1 into float32 lane i =
 * row i) take 64 weights at 2 bits, 128 at 1 bit: the bfloat16 path takes 32. Rows come out in float32
 * lanes, so no horizontal sum is left either. */

/* tabs[u * 64 ...]: unit u's tables lo and hi for one row of x */
INLINE TBF void pt_tables(const Wt *w, const uint16_t *x, uint16_t *tabs, const int BITS) {
    const int g = 4 / BITS, U = 16 / BITS;
    const int64_t units = w->w.K / U;
    __m512 d[4];
    for (int j = 0; j < g; j++) d[j] = _mm512_loadu_ps(w->digit[j]);
    for (int64_t u = 0; u < units; u++) {
        const uint16_t *xu = x + u * U;
        __m512 s[4];
#pragma GCC unroll 4
        for (int q = 0; q < 4; q++) {
            s[q] = _mm512_mul_ps(d[0], _mm512_set1_ps(bf16_to_f32(xu[q * g])));
#pragma GCC unroll 4
            for (int j = 1; j < g; j++) s[q] = _mm512_fmadd_ps(d[j], _mm512_set1_ps(bf16_to_f32(xu[q * g + j])), s[q]);
        }
        /* low 16 words from the second operand: lo = (A low, B low), hi = (A high, B high) */
        _mm512_storeu_si512((void *)(tabs + u * 64), (__m512i)_mm512_cvtne2ps_pbh(s[2], s[0]));
        _mm512_storeu_si512((void *)(tabs + u * 64 + 32), (__m512i)_mm512_cvtne2ps_pbh(s[3], s[1]));
    }
}

/* float32 lanes: the scales of rows 16t..16t+15 for block b, from the interleaved scales */
INLINE TBF __m512 pt_scales(const Wt *w, int64_t t, int64_t b) {
    const int64_t at = (t * w->w.nb + b) * 16;
    if (w->w.scales_dt == DT_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w->w.scales + at)));
    if (w->w.scales_dt == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w->w.scales + at))), 16));
    return _mm512_loadu_ps((const float *)w->w.scales + at);
}

/* res[tt * 16 + i] = row 16 (t0 + tt) + i of W times x (its tables), for TT tiles sharing the tables */
INLINE TBF void pt_tiles(const Wt *w, int64_t t0, const uint16_t *tabs, float *res, const int BITS, const int TT) {
    const int U = 16 / BITS;
    const int64_t nb = w->w.nb, upb = w->w.block / U, tile = 16 * w->w.row_bytes;
    const uint8_t *c = w->w.codes + t0 * tile;
    const __m512i low = _mm512_set1_epi16(0x0F), odd = _mm512_set1_epi32(0x00100000);
    const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);
    __m512 acc[4];
#pragma GCC unroll 4
    for (int tt = 0; tt < TT; tt++) acc[tt] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512 lo[4], hi[4];
#pragma GCC unroll 4
        for (int tt = 0; tt < TT; tt++) lo[tt] = hi[tt] = _mm512_setzero_ps();
        for (int64_t u = b * upb; u < (b + 1) * upb; u++) {
            const __m512i tl = _mm512_loadu_si512((const void *)(tabs + u * 64));
            const __m512i th = _mm512_loadu_si512((const void *)(tabs + u * 64 + 32));
#pragma GCC unroll 4
            for (int tt = 0; tt < TT; tt++) {
                const uint8_t *p = c + tt * tile + u * 32;
                if ((u & 1) == 0) _mm_prefetch((const char *)(p + TT * tile), _MM_HINT_T0);
                const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
                const __m512i il = _mm512_ternarylogic_epi32(v, low, odd, 0xEA); /* (v & 15) | odd */
                const __m512i ih = _mm512_or_si512(_mm512_srli_epi16(v, 4), odd);
                lo[tt] = _mm512_dpbf16_ps(lo[tt], (__m512bh)_mm512_permutexvar_epi16(il, tl), ones);
                hi[tt] = _mm512_dpbf16_ps(hi[tt], (__m512bh)_mm512_permutexvar_epi16(ih, th), ones);
            }
        }
#pragma GCC unroll 4
        for (int tt = 0; tt < TT; tt++) acc[tt] = _mm512_fmadd_ps(_mm512_add_ps(lo[tt], hi[tt]), pt_scales(w, t0 + tt, b), acc[tt]);
    }
#pragma GCC unroll 4
    for (int tt = 0; tt < TT; tt++) _mm512_storeu_ps(res + tt * 16, acc[tt]);
}

#define PT_TILES(TT)                                                                                   \
    static TBF void pt_tiles_##TT(const Wt *w, int64_t t0, const uint16_t *tabs, float *res) {         \
        if (w->w.bits == 1) pt_tiles(w, t0, tabs, res, 1, TT);                                          \
        else pt_tiles(w, t0, tabs, res, 2, TT);                                                         \
    }
PT_TILES(1) PT_TILES(2) PT_TILES(4)
static TBF void pt_tables_any(const Wt *w, const uint16_t *x, uint16_t *tabs) {
    if (w->w.bits == 1) pt_tables(w, x, tabs, 1);
    else pt_tables(w, x, tabs, 2);
}
#endif

/* ---------------------------------------------------------------- entry points */

/* The widest vector path this CPU runs: 3 AVX-512 with BF16 (and BW, VL), 2 AVX-512, 1 AVX2 (with FMA and F16C), 0 neither. */
int hilt_lut_isa(void) {
#ifdef HILT_X86
    __builtin_cpu_init();
    int base = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    if (base && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16"))
        return 3;
    if (base && __builtin_cpu_supports("avx512f")) return 2;
    if (base) return 1;
#endif
    return 0;
}

/* sizeof(LutWeight): lut_cpu.py checks its ctypes mirror against it when it loads the library */
int64_t hilt_lut_struct_size(void) { return (int64_t)sizeof(LutWeight); }

/* Lanes of the path a weight takes under isa (16, 8; 1: the portable path), and its codes per lane
 * unit: what the caller reorders x by for hilt_lut_dequant's column order. */
int hilt_lut_layout(const LutWeight *lw, int isa, int *cpb) {
    Wt w;
    setup(&w, lw, isa);
    *cpb = w.cpb;
    return w.lanes;
}

/* 1 where bfloat16 x takes the bfloat16 path under isa (one vpermw and one vdpbf16ps per 32 weights) */
int hilt_lut_bf16_path(const LutWeight *lw, int isa) {
    Wt w;
    setup(&w, lw, isa);
    return w.bf;
}

/* 1 where this weight interleaved takes the pair-table path for bfloat16 x under isa */
int hilt_lut_pair_path(const LutWeight *lw, int isa) {
    Wt w;
    setup(&w, lw, isa);
    return w.pt;
}

/* xp (M, K) float32 = x (M, K) reordered for lanes and cpb (see the top), converted from x_dt */
static void prepare_x(const void *x, int x_dt, int64_t M, int64_t K, int lanes, int cpb, float *xp) {
    const int64_t chunk = (int64_t)lanes * cpb;
    for (int64_t m = 0; m < M; m++)
        for (int64_t c = 0; c < K; c += chunk)
            for (int64_t i = 0; i < lanes; i++)
                for (int64_t j = 0; j < cpb; j++)
                    xp[m * K + c + j * lanes + i] = load_f(x, x_dt, m * K + c + i * cpb + j);
}

static void row_any(const Wt *w, int64_t n, const float *xp, int64_t K, int64_t M, float *res) {
#ifdef HILT_X86
    if (w->lanes == 16 || w->lanes == 8) {
        const int most = w->lanes == 16 ? 8 : 4;
        const TileFn *tiles = w->lanes == 16 ? TILES512 : TILES256;
        for (int64_t m0 = 0; m0 < M; m0 += most) {
            int64_t h = M - m0 < most ? M - m0 : most;
            tiles[h](w, n, xp + m0 * K, K, res + m0);
        }
        return;
    }
#endif
    for (int64_t m0 = 0; m0 < M; m0 += 16) row_scalar(w, n, xp + m0 * K, K, M - m0 < 16 ? M - m0 : 16, res + m0);
}

static void store_out(void *out, int out_dt, int64_t i, float v) {
    if (out_dt == DT_BF16) ((uint16_t *)out)[i] = f32_to_bf16(v);
    else ((float *)out)[i] = v;
}

#ifdef HILT_X86
/* the bfloat16 path (w->bf): x bfloat16 (M, K) reordered into word lanes, sums of x per block for offsets */
/* rows n_from.. of W (the pair-table path takes the whole tiles before them) */
static int matmul_bf16(const Wt *w, const uint16_t *x, int64_t M, const float *bias, void *out, int out_dt, int threads,
                       int64_t n_from) {
    const int64_t K = w->w.K, N = w->w.N, nb = w->w.nb, B = w->w.block, chunk = 32 * (int64_t)w->cpw;
    const int64_t Kp = (K + chunk - 1) / chunk * chunk; /* rows of xp padded with zeros to whole chunks */
    uint16_t *xp = (uint16_t *)calloc((size_t)(M * Kp > 0 ? M * Kp : 1), sizeof(uint16_t));
    float *xsum = (float *)malloc(sizeof(float) * (size_t)(M * nb > 0 ? M * nb : 1));
    if (!xp || !xsum) {
        free(xp);
        free(xsum);
        return 1;
    }
    for (int64_t m = 0; m < M; m++) {
        for (int64_t c = 0; c < K; c += chunk)
            for (int64_t i = 0; i < 32; i++)
                for (int64_t j = 0; j < w->cpw; j++)
                    if (c + i * w->cpw + j < K) xp[m * Kp + c + j * 32 + i] = x[m * K + c + i * w->cpw + j];
        for (int64_t b = 0; w->w.offsets && b < nb; b++) { /* only offsets use them */
            float s = 0.0f;
            for (int64_t k = b * B; k < (b + 1) * B; k++) s += bf16_to_f32(x[m * K + k]);
            xsum[m * nb + b] = s;
        }
    }
    int64_t work = (N - n_from) * K * (M < 4 ? M : 4);
    (void)threads;
    (void)work;
    if (M == 1) {
        const int64_t groups = (N - n_from + 3) / 4;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (work >= 65536 && threads > 1)
#endif
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = n_from + g * 4, h = N - n0 < 4 ? N - n0 : 4;
            float res[4];
            ROWSBF_FNS[h](w, n0, xp, xsum, res);
            for (int64_t r = 0; r < h; r++) store_out(out, out_dt, n0 + r, res[r] + (bias ? bias[n0 + r] : 0.0f));
        }
        free(xp);
        free(xsum);
        return 0;
    }
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (work >= 65536 && threads > 1)
#endif
    for (int64_t n = n_from; n < N; n++) {
        float res[4];
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            int64_t h = M - m0 < 4 ? M - m0 : 4;
            TILESBF[h](w, n, xp + m0 * Kp, Kp, xsum + m0 * nb, res);
            for (int64_t m = 0; m < h; m++) store_out(out, out_dt, (m0 + m) * N + n, res[m] + (bias ? bias[n] : 0.0f));
        }
    }
    free(xp);
    free(xsum);
    return 0;
}

/* the pair-table path (w->pt, interleaved): tables per row of x, then tiles of 16 rows, four at a time
 * where they can share the tables' loads; the rows past the whole tiles take the bfloat16 path */
static int matmul_pt(const Wt *w, const uint16_t *x, int64_t M, const float *bias, void *out, int out_dt, int threads) {
    const int64_t K = w->w.K, N = w->w.N, per_x = K / (16 / w->w.bits) * 64, tiles = w->n16 / 16;
    uint16_t *tabs = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(M * per_x > 0 ? M * per_x : 1));
    if (!tabs) return 1;
    for (int64_t m = 0; m < M; m++) pt_tables_any(w, x + m * K, tabs + m * per_x);
    const int64_t pairs = (tiles + 3) / 4, work = w->n16 * K * M;
    (void)threads;
    (void)work;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (work >= 65536 && threads > 1)
#endif
    for (int64_t p = 0; p < pairs; p++) {
        const int64_t t0 = 4 * p, h = tiles - t0 < 4 ? tiles - t0 : 4;
        float res[64];
        for (int64_t m = 0; m < M; m++) {
            if (h == 4) pt_tiles_4(w, t0, tabs + m * per_x, res);
            else if (h >= 2) {
                pt_tiles_2(w, t0, tabs + m * per_x, res);
                if (h == 3) pt_tiles_1(w, t0 + 2, tabs + m * per_x, res + 32);
            } else pt_tiles_1(w, t0, tabs + m * per_x, res);
            for (int64_t r = 0; r < 16 * h; r++) {
                const int64_t n = 16 * t0 + r;
                store_out(out, out_dt, m * N + n, res[r] + (bias ? bias[n] : 0.0f));
            }
        }
    }
    free(tabs);
    return w->n16 < N ? matmul_bf16(w, x, M, bias, out, out_dt, threads, w->n16) : 0;
}
#endif

#ifdef HILT_X86
/* The int8 path (bfloat16 x, 2-, 4- and symmetric 8-bit codes, AVX2 without AVX-512): as llama.cpp's CPU matmuls do, x is rounded
 * to int8 in chunks of 64 columns (step = the chunk's largest |x| / 127) and the layer's 16 levels to int8
 * (step = the largest |level| / 127); 64 codes are two vpshufb lookups of the int8 levels and two
 * vpmaddubsw against x, summed in int32 and scaled once per chunk. Against the float32 path it trades the
 * rounding of x and of the levels, each at most half its step (tests/test_lut_cpu.py bounds the error by
 * exactly that), for about a third of the instructions per weight. x with a NaN or an infinity takes the
 * float32 path (they must propagate). 2-bit codes take it the same way (16 code bytes a chunk, four
 * phases, two to a register); symmetric 8-bit codes are int8 levels already (no rounding of the weight).
 * Per chunk of 64 columns, xq holds phase after phase: the columns of code 0 of
 * every code byte, then of code 1, ... (4 bits: the 32 even columns, then the 32 odd ones). */
#define TQ8 __attribute__((target("avx2,fma")))

/* 1 when x had a NaN or infinity (nothing usable then) */
static int q8_prepare_x(const uint16_t *x, int64_t K, int bits, int8_t *xq, float *xs) {
    const int cpb = 8 / bits, bytes = 64 / cpb;
    for (int64_t c = 0; c < K; c += 64) {
        float most = 0.0f, v[64];
        for (int i = 0; i < 64; i++) {
            v[i] = bf16_to_f32(x[c + i]);
            if (!isfinite(v[i])) return 1;
            most = fabsf(v[i]) > most ? fabsf(v[i]) : most;
        }
        /* below 1e-30 (denormal steps) the chunk counts as zeros */
        const float step = most >= 1e-30f ? most / 127.0f : 0.0f, inv = most >= 1e-30f ? 127.0f / most : 0.0f;
        xs[c / 64] = step;
        for (int i = 0; i < bytes; i++)
            for (int p = 0; p < cpb; p++) xq[c + p * bytes + i] = (int8_t)lrintf(v[i * cpb + p] * inv);
    }
    return 0;
}

/* the chunk's 64 codes as int8 levels, in xq's order, two registers of 32 */
INLINE TQ8 void q8_levels(const uint8_t *p, __m256i book, int bits, __m256i *first, __m256i *second) {
    if (bits == 8) { /* c - 128, the signed level */
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        *first = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)p), flip);
        *second = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(p + 32)), flip);
    } else if (bits == 4) {
        const __m256i low = _mm256_set1_epi8(0x0f), codes = _mm256_loadu_si256((const __m256i *)p);
        *first = _mm256_shuffle_epi8(book, _mm256_and_si256(codes, low));
        *second = _mm256_shuffle_epi8(book, _mm256_and_si256(_mm256_srli_epi16(codes, 4), low));
    } else { /* 2 bits: phases 0 and 1 in the first register's halves, 2 and 3 in the second's */
        const __m128i three = _mm_set1_epi8(3), b = _mm_loadu_si128((const __m128i *)p);
        const __m256i c01 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 2), three), _mm_and_si128(b, three));
        const __m256i c23 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 6), three),
                                             _mm_and_si128(_mm_srli_epi16(b, 4), three));
        *first = _mm256_shuffle_epi8(book, c01);
        *second = _mm256_shuffle_epi8(book, c23);
    }
}

static TQ8 float q8_row(const Wt *w, int64_t n, const int8_t *xq, const float *xs) {
    const int64_t K = w->w.K, per_block = w->w.block / 64, chunk_bytes = 8 * w->w.bits;
    const uint8_t *row = w->w.codes + n * w->w.row_bytes;
    const __m256i book = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)w->q8_book));
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t c = 0; c < K / 64; c++) {
        const float scale = scale_at(w, n, c / per_block) * w->q8_step * xs[c];
        __m256i we, wo;
        q8_levels(row + chunk_bytes * c, book, w->w.bits, &we, &wo);
        const __m256i xe = _mm256_loadu_si256((const __m256i *)(xq + 64 * c));
        const __m256i xo = _mm256_loadu_si256((const __m256i *)(xq + 64 * c + 32));
        /* |w| (unsigned) times x with w's sign: pairs of products stay within int16 (2 * 128 * 127) */
        const __m256i pe = _mm256_maddubs_epi16(_mm256_sign_epi8(we, we), _mm256_sign_epi8(xe, we));
        const __m256i po = _mm256_maddubs_epi16(_mm256_sign_epi8(wo, wo), _mm256_sign_epi8(xo, wo));
        const __m256i sum = _mm256_add_epi32(_mm256_madd_epi16(pe, ones), _mm256_madd_epi16(po, ones));
        if (c & 1) acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(scale), acc1);
        else acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(scale), acc0);
    }
    const __m256 a = _mm256_add_ps(acc0, acc1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* 0 done; 1 no scratch; 2 x not finite (the caller takes the float32 path) */
static int matmul_q8(const Wt *w, const uint16_t *x, int64_t M, const float *bias, void *out, int out_dt, int threads) {
    const int64_t K = w->w.K, N = w->w.N;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K > 0 ? M * K : 1));
    float *xs = (float *)malloc(sizeof(float) * (size_t)(M * K / 64 > 0 ? M * K / 64 : 1));
    if (!xq || !xs) {
        free(xq);
        free(xs);
        return 1;
    }
    for (int64_t m = 0; m < M; m++)
        if (q8_prepare_x(x + m * K, K, w->w.bits, xq + m * K, xs + m * (K / 64))) {
            free(xq);
            free(xs);
            return 2;
        }
    const int64_t work = N * K * M;
    (void)threads;
    (void)work;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(threads) if (work >= 65536 && threads > 1)
#endif
    for (int64_t n = 0; n < N; n++)
        for (int64_t m = 0; m < M; m++)
            store_out(out, out_dt, m * N + n, q8_row(w, n, xq + m * K, xs + m * (K / 64)) + (bias ? bias[n] : 0.0f));
    free(xq);
    free(xs);
    return 0;
}
#endif

/* 1 where bfloat16 x of at most Q8_ROWS rows takes the int8 path under isa */
int hilt_lut_int8_path(const LutWeight *lw, int isa) {
    Wt w;
    setup(&w, lw, isa);
    return w.q8;
}

/* out (M, N) in out_dt = x (M, K) in x_dt @ W.T (+ bias float32 (N,)); rows of W on `threads`
 * threads. Returns 0, or 1 when scratch memory could not be had. */
int hilt_lut_matmul(const LutWeight *lw, const void *x, int x_dt, int64_t M, const float *bias, void *out, int out_dt,
                    int isa, int threads) {
    Wt w;
    setup(&w, lw, isa);
    const int64_t K = lw->K, N = lw->N;
#ifdef HILT_X86
    if (x_dt == DT_BF16 && lw->interleaved && w.pt) return matmul_pt(&w, (const uint16_t *)x, M, bias, out, out_dt, threads);
    if (x_dt == DT_BF16 && !lw->interleaved && w.bf) return matmul_bf16(&w, (const uint16_t *)x, M, bias, out, out_dt, threads, 0);
    if (x_dt == DT_BF16 && w.q8 && M <= Q8_ROWS) {
        int r = matmul_q8(&w, (const uint16_t *)x, M, bias, out, out_dt, threads);
        if (r != 2) return r;
    }
#endif
    float *xp = (float *)malloc(sizeof(float) * (size_t)(M * K > 0 ? M * K : 1));
    if (!xp) return 1;
    prepare_x(x, x_dt, M, K, w.lanes, w.cpb, xp);
    int64_t work = N * K * (M < 4 ? M : 4);
    int failed = 0;
    (void)threads;
    (void)work;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if (work >= 65536 && threads > 1) reduction(| : failed)
#endif
    {
        RowView rv;
        failed |= view_open(&rv, &w);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t n = 0; n < N; n++) {
            if (failed) continue;
            float res[64];
            int64_t nv = n;
            const Wt *wv = view_row(&rv, &w, &nv);
            for (int64_t m0 = 0; m0 < M; m0 += 64) {
                int64_t h = M - m0 < 64 ? M - m0 : 64;
                row_any(wv, nv, xp + m0 * K, K, h, res);
                for (int64_t m = 0; m < h; m++) store_out(out, out_dt, (m0 + m) * N + n, res[m] + (bias ? bias[n] : 0.0f));
            }
        }
        free(rv.buf);
    }
    free(xp);
    return failed;
}

/* Several weights on the same x (a layer's q, k and v; gate and up): count weights, each output (M, N_i)
 * to its own buffer in out_dt, biases[i] NULL or float32 (N_i,). One call where there were count: the
 * per-call cost outside the kernel (the caller's, ctypes') is paid once. Returns 0, or 1 (scratch). */
int hilt_lut_matmul_many(const LutWeight *lws, int count, const void *x, int x_dt, int64_t M,
                         const float *const *biases, void *const *outs, int out_dt, int isa, int threads) {
    int failed = 0;
    for (int i = 0; i < count; i++)
        failed |= hilt_lut_matmul(lws + i, x, x_dt, M, biases ? biases[i] : NULL, outs[i], out_dt, isa, threads);
    return failed;
}

/* out (row1 - row0, K) float32: rows [row0, row1) of W, columns in the order of the path isa picks
 * for this weight (hilt_lut_layout): what a BLAS call multiplies with x reordered the same way. */
static void dequant_row(const Wt *w, int64_t n, float *o) {
#ifdef HILT_X86
    if (w->lanes == 16) { dequant512(w, n, o); return; }
    if (w->lanes == 8) { dequant256(w, n, o); return; }
#endif
    dequant_scalar(w, n, o);
}

int hilt_lut_dequant(const LutWeight *lw, int64_t row0, int64_t row1, float *out, int isa, int threads) {
    Wt w;
    setup(&w, lw, isa);
    const int64_t K = lw->K;
    int failed = 0;
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if ((row1 - row0) * K >= 65536 && threads > 1) reduction(| : failed)
#endif
    {
        RowView rv;
        failed |= view_open(&rv, &w);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t n = row0; n < row1; n++) {
            if (failed) continue;
            int64_t nv = n;
            const Wt *wv = view_row(&rv, &w, &nv);
            dequant_row(wv, nv, out + (n - row0) * K);
        }
        free(rv.buf);
    }
    return failed;
}

#ifdef HILT_X86
/* n floats to bfloat16, rounded to nearest even (as torch's .to(bfloat16)), 16 at a time */
static __attribute__((target("avx512f,avx512bf16,avx512vl"))) void to_bf16_512(const float *in, uint16_t *out, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(in + i)));
    for (; i < n; i++) out[i] = f32_to_bf16(in[i]);
}
#endif

/* A row from the paths' column order (within each chunk of lanes * cpb columns, element j * lanes + i
 * holds column i * cpb + j) back to column order: output element r of a chunk is input element
 * (r % cpb) * lanes + r / cpb. The indices are made once per call. */
typedef struct {
    int lanes, cpb, chunk;
    uint16_t idx[4][32]; /* output vector o, word p: the source word, modulo 64 */
    uint32_t upper[4];   /* bit p: the source is in the chunk's upper 64 words */
} Unorder;

static void unorder_init(Unorder *u, int lanes, int cpb) {
    u->lanes = lanes;
    u->cpb = cpb;
    u->chunk = lanes * cpb;
    for (int o = 0; o < 4; o++) {
        u->upper[o] = 0;
        for (int p = 0; p < 32; p++) {
            const int r = 32 * o + p, q = (r % cpb) * lanes + r / cpb;
            u->idx[o][p] = (uint16_t)(q & 63);
            if (q >= 64) u->upper[o] |= 1u << p;
        }
    }
}

static void unorder_bf16(const Unorder *u, const float *in, uint16_t *out, int64_t K) {
    for (int64_t c = 0; c < K; c += u->chunk)
        for (int i = 0; i < u->lanes; i++)
            for (int j = 0; j < u->cpb; j++) out[c + i * u->cpb + j] = f32_to_bf16(in[c + j * u->lanes + i]);
}

#ifdef HILT_X86
/* The same, rounding and reordering in registers, a chunk of 32, 64 or 128 at a time: each 32 floats
 * become one register of words (vcvtne2ps2bf16), permuted within one, two or (128: two pairs, blended
 * where the source is in the upper half) four registers. */
INLINE TBF void unorder_chunks(const Unorder *u, const float *in, uint16_t *out, int64_t K, const int CHUNK) {
    const int outs = CHUNK / 32;
    __m512i ix[4];
    for (int o = 0; o < outs; o++) ix[o] = _mm512_loadu_si512((const void *)u->idx[o]);
    for (int64_t c = 0; c < K; c += CHUNK) {
        __m512i v[4];
        for (int q = 0; q < outs; q++)
            v[q] = (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(in + c + 32 * q + 16), _mm512_loadu_ps(in + c + 32 * q));
        for (int o = 0; o < outs; o++) {
            __m512i r;
            if (CHUNK == 32) r = _mm512_permutexvar_epi16(ix[o], v[0]);
            else if (CHUNK == 64) r = _mm512_permutex2var_epi16(v[0], ix[o], v[1]);
            else r = _mm512_mask_blend_epi16((__mmask32)u->upper[o], _mm512_permutex2var_epi16(v[0], ix[o], v[1]),
                                             _mm512_permutex2var_epi16(v[2], ix[o], v[3]));
            _mm512_storeu_si512((void *)(out + c + 32 * o), r);
        }
    }
}

static TBF int unorder_bf16_512(const Unorder *u, const float *in, uint16_t *out, int64_t K) {
    switch (u->chunk) {
    case 32: unorder_chunks(u, in, out, K, 32); return 1;
    case 64: unorder_chunks(u, in, out, K, 64); return 1;
    case 128: unorder_chunks(u, in, out, K, 128); return 1;
    default: return 0;
    }
}
#endif

/* As hilt_lut_dequant, in bfloat16 and in column order (the prefill path of bfloat16 x, which then
 * multiplies x as it is): each row dequantized in float32 into a buffer that stays in cache, then
 * rounded and put in column order. Returns 0, or 1 when a buffer could not be had. */
int hilt_lut_dequant_bf16(const LutWeight *lw, int64_t row0, int64_t row1, uint16_t *out, int isa, int threads) {
    Wt w;
    setup(&w, lw, isa);
    const int64_t K = lw->K;
    const int reorder = w.lanes > 1 && w.cpb > 1;
    Unorder u;
    unorder_init(&u, w.lanes, w.cpb);
    int failed = 0;
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads) if ((row1 - row0) * K >= 65536 && threads > 1) reduction(| : failed)
#endif
    {
        float *buf = (float *)malloc(sizeof(float) * (size_t)(K > 0 ? K : 1));
        RowView rv;
        failed |= !buf | view_open(&rv, &w);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t n = row0; n < row1; n++) {
            if (failed) continue;
            uint16_t *o = out + (n - row0) * K;
            int64_t nv = n;
            const Wt *wv = view_row(&rv, &w, &nv);
            dequant_row(wv, nv, buf);
#ifdef HILT_X86
            if (isa >= 3 && (reorder ? unorder_bf16_512(&u, buf, o, K) : (to_bf16_512(buf, o, K), 1))) continue;
#endif
            if (reorder) unorder_bf16(&u, buf, o, K);
            else
                for (int64_t k = 0; k < K; k++) o[k] = f32_to_bf16(buf[k]);
        }
        free(buf);
        free(rv.buf);
    }
    return failed;
}
