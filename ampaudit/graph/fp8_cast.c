/* One fp8 cast of a GEMM operand, emulated in one pass (what graph/fp8_casts.py's torch ops
 * do in seven): each element scaled (x * s; MX's block scales: x / s, then clamped to +-fmax,
 * counting what the clamp cut), rounded to the fp8 format exactly as torch's .to(float8_*)
 * rounds, and dequantized into out (q / s; MX: q * s) - the value the emulated GEMM reads.
 * Counts: nonzero x, nonzero q (their difference is what the cast flushed), saturated.
 *
 * Rounding, on |v|'s fp32 bits a: to nearest, ties to even, at the format's mantissa width
 * (23 - shift bits) where v is normal in fp8 - an integer add and mask, a carry moving into
 * the exponent as it should - and to a multiple of the format's smallest subnormal below its
 * smallest normal ((|v| + magic) - magic, magic = that subnormal * 2^23: the fp32 add rounds
 * there). Past the format's max: float8_e4m3fn saturates to +-448 (Inf too), float8_e5m2
 * becomes Inf; NaN stays NaN. Compiled without -ffast-math (core/native.py): the magic add
 * must not be folded away.
 *
 * x and out share one dense layout, walked in memory order as `outer` runs of `inner`
 * elements; element (o, i) has its scale at scale[o * so + i * si] (so/si 0 where the scale
 * is broadcast: a per-tensor scale, a scale per row or per column).
 */
#include <stdint.h>
#include <string.h>

#include "native_simd.h" /* SIMD_CLONES */

typedef struct {
    uint32_t shift;      /* 23 - the format's mantissa bits */
    uint32_t min_normal; /* fp32 bits of the format's smallest normal */
    float magic;         /* its smallest subnormal * 2^23 */
    uint32_t max_bits;   /* fp32 bits of its max */
    uint32_t over_bits;  /* what a larger magnitude becomes: the max (e4m3fn) or Inf (e5m2) */
    float fmax;
    int clamp;           /* MX: divide by the scale, clamp, multiply back */
} Format;

static inline uint32_t bits_of(float f) {
    uint32_t a;
    memcpy(&a, &f, sizeof a);
    return a;
}

static inline float float_of(uint32_t a) {
    float f;
    memcpy(&f, &a, sizeof f);
    return f;
}

static inline float round_fp8(float v, const Format *f) {
    uint32_t b = bits_of(v), sign = b & 0x80000000u, a = b & 0x7fffffffu;
    uint32_t half = (1u << (f->shift - 1)) - 1u + ((a >> f->shift) & 1u);
    uint32_t normal = (a + half) & ~((1u << f->shift) - 1u);
    uint32_t sub = bits_of((float_of(a) + f->magic) - f->magic);
    uint32_t r = a < f->min_normal ? sub : normal;
    r = r > f->max_bits ? f->over_bits : r;
    r = a > 0x7f800000u ? 0x7fc00000u : r; /* NaN */
    return float_of(r | sign);
}

/* Rows [lo, hi) of the walk; counts[0..2] += nonzero x, nonzero q, saturated. */
SIMD_CLONES static void cast_rows(const float *x, float *out, int64_t lo, int64_t hi, int64_t inner,
                                  const float *scale, int64_t so, int64_t si, const Format *f,
                                  int64_t *counts) {
    int64_t nz_x = 0, nz_q = 0, sat = 0;
    const float fmax = f->fmax;
    for (int64_t o = lo; o < hi; o++) {
        const float *row = x + o * inner, *s = scale + o * so;
        float *dst = out + o * inner;
        if (f->clamp) {
            for (int64_t i = 0; i < inner; i++) {
                float si_ = s[i * si], v = row[i] / si_;
                float m = v < 0 ? -v : v;
                sat += m > fmax;
                v = v > fmax ? fmax : v < -fmax ? -fmax : v;
                float q = round_fp8(v, f);
                nz_x += (bits_of(row[i]) & 0x7fffffffu) != 0;
                nz_q += (bits_of(q) & 0x7fffffffu) != 0;
                dst[i] = q * si_;
            }
        } else if (si == 0) { /* one scale for the run: the loop vectorises */
            const float s0 = s[0];
            for (int64_t i = 0; i < inner; i++) {
                float q = round_fp8(row[i] * s0, f);
                nz_x += (bits_of(row[i]) & 0x7fffffffu) != 0;
                nz_q += (bits_of(q) & 0x7fffffffu) != 0;
                dst[i] = q / s0;
            }
        } else if (si == 1) {
            for (int64_t i = 0; i < inner; i++) {
                float q = round_fp8(row[i] * s[i], f);
                nz_x += (bits_of(row[i]) & 0x7fffffffu) != 0;
                nz_q += (bits_of(q) & 0x7fffffffu) != 0;
                dst[i] = q / s[i];
            }
        } else {
            for (int64_t i = 0; i < inner; i++) {
                float s1 = s[i * si], q = round_fp8(row[i] * s1, f);
                nz_x += (bits_of(row[i]) & 0x7fffffffu) != 0;
                nz_q += (bits_of(q) & 0x7fffffffu) != 0;
                dst[i] = q / s1;
            }
        }
    }
    counts[0] += nz_x;
    counts[1] += nz_q;
    counts[2] += sat;
}

#define CHUNK 32768 /* elements a thread takes at least: below, threads cost more than they save */

void ampaudit_fp8_cast(const float *x, float *out, int64_t outer, int64_t inner, const float *scale,
                       int64_t so, int64_t si, uint32_t shift, uint32_t min_normal, float magic,
                       uint32_t max_bits, uint32_t over_bits, float fmax, int clamp, int64_t *counts,
                       int threads) {
    Format f = {shift, min_normal, magic, max_bits, over_bits, fmax, clamp};
    int64_t n = outer * inner, parts = n / CHUNK;
    if (parts > threads) parts = threads;
    if (parts > outer) parts = outer;
    if (parts < 2) {
        cast_rows(x, out, 0, outer, inner, scale, so, si, &f, counts);
        return;
    }
    int64_t nz_x = 0, nz_q = 0, sat = 0;
    _Pragma("omp parallel for num_threads(parts) schedule(static) reduction(+:nz_x, nz_q, sat)")
    for (int64_t p = 0; p < parts; p++) {
        int64_t local[3] = {0, 0, 0};
        cast_rows(x, out, outer * p / parts, outer * (p + 1) / parts, inner, scale, so, si, &f, local);
        nz_x += local[0];
        nz_q += local[1];
        sat += local[2];
    }
    counts[0] += nz_x;
    counts[1] += nz_q;
    counts[2] += sat;
}

/* The same cast with its scales computed here from the amaxes, as graph/fp8_casts.py's torch ops
 * compute them (the torch ops' half dozen small ops a scale cost more than the cast of a small
 * operand). `gran`: 0 one scale for the tensor (from `amax` where it is >= 0, else x's own),
 * 1 one per outer run, 2 one per inner index (along the outer dim), 3 MX blocks of 32 along the
 * inner dim, 4 MX blocks of 32 along the outer dim (a last block shorter: as torch's zero padding,
 * which changes no amax and no count).
 *
 * A scale: fp32((1 / max(amax, 1e-12)) * fmax) in double (torch's fmax / t is t.reciprocal() *
 * fmax), rounded down to a power of two where `pow2` (torch: exp2(floor(log2(s)))). MX:
 * 2^clamp(floor(log2(amax)) - emax, -127, 127), 2^-127 where amax is 0. floor(log2(a)) is a's
 * binary exponent, except that torch's float32 log2 rounds up to the next integer values up to
 * 5.2e-6 below a power of two (1-88 ulps, more the larger the exponent): within 2^-14 of one,
 * floorf(log2f(a)) decides - libm's log2f, which torch's scalar path calls, and which gave the
 * floor its vector path (Sleef) gives on every fp32 value within 2^14 ulps of every power of
 * two (8.9M, measured, glibc). A non-finite amax: the kernel declines (returns 1, counts
 * untouched) and the caller takes the torch ops. Returns 0 when done. */
#include <float.h>
#include <math.h>
#include <stdlib.h>

static inline int floor_log2(float a) { /* a finite, > 0 */
    int k;
    float m = frexpf(a, &k); /* a = m 2^k, m in [0.5, 1) */
    if (m != 0.5f && (m > 1.0f - 0x1p-14f || m < 0.5f + 0x1p-15f)) return (int)floorf(log2f(a));
    return k - 1;
}

static inline int tensor_scale(float amax, double fmax, int pow2, float *scale) {
    if (!(amax <= FLT_MAX)) return 0; /* inf or NaN */
    double d = amax < 1e-12 ? 1e-12 : (double)amax;
    float s = (float)((1.0 / d) * fmax);
    if (pow2) {
        s = ldexpf(1.0f, floor_log2(s));
    }
    *scale = s;
    return 1;
}

static inline int mx_scale(float amax, int emax, float *scale) {
    if (!(amax <= FLT_MAX)) return 0;
    int e = -127;
    if (amax > 0) e = floor_log2(amax) - emax;
    e = e < -127 ? -127 : e > 127 ? 127 : e;
    *scale = ldexpf(1.0f, e);
    return 1;
}

/* |x|'s max as fp32 bits (their order is the magnitudes'; a NaN's are above inf's) */
SIMD_CLONES static uint32_t run_amax(const float *x, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = bits_of(x[i]) & 0x7fffffffu;
        m = a > m ? a : m;
    }
    return m;
}

SIMD_CLONES static void column_amax(const float *x, int64_t lo, int64_t hi, int64_t inner, uint32_t *m) {
    for (int64_t o = lo; o < hi; o++) {
        const float *row = x + o * inner;
        for (int64_t i = 0; i < inner; i++) {
            uint32_t a = bits_of(row[i]) & 0x7fffffffu;
            m[i] = a > m[i] ? a : m[i];
        }
    }
}

/* MX: n elements divided by their scales (a power of two: multiplied by its inverse, exactly the
 * same), clamped, rounded and multiplied back; the scale one for all (ss 0) or one each (ss 1) */
static inline void cast_mx_run(const float *x, float *dst, int64_t n, const float *s, int64_t ss, const Format *f,
                               int64_t *nz_x, int64_t *nz_q, int64_t *sat) {
    const float fmax = f->fmax;
    int64_t a = 0, b = 0, c = 0;
    for (int64_t i = 0; i < n; i++) {
        float s1 = s[i * ss], v = x[i] * (1.0f / s1);
        float m = v < 0 ? -v : v;
        c += m > fmax;
        v = v > fmax ? fmax : v < -fmax ? -fmax : v;
        float q = round_fp8(v, f);
        a += (bits_of(x[i]) & 0x7fffffffu) != 0;
        b += (bits_of(q) & 0x7fffffffu) != 0;
        dst[i] = q * s1;
    }
    *nz_x += a;
    *nz_q += b;
    *sat += c;
}

/* MX blocks along the inner dim (`along_inner`: scale[o * ceil(inner / 32) + i / 32]) or the outer
 * (scale[(o / 32) * inner + i]) */
SIMD_CLONES static void cast_blocks(const float *x, float *out, int64_t outer, int64_t inner, const float *scale,
                                    int along_inner, const Format *f, int64_t *counts) {
    int64_t nz_x = 0, nz_q = 0, sat = 0, blocks = (inner + 31) / 32;
    for (int64_t o = 0; o < outer; o++) {
        const float *row = x + o * inner;
        float *dst = out + o * inner;
        if (along_inner) {
            for (int64_t b = 0; b < blocks; b++) {
                int64_t lo = b * 32, len = inner - lo < 32 ? inner - lo : 32;
                cast_mx_run(row + lo, dst + lo, len, scale + o * blocks + b, 0, f, &nz_x, &nz_q, &sat);
            }
        } else {
            cast_mx_run(row, dst, inner, scale + (o / 32) * inner, 1, f, &nz_x, &nz_q, &sat);
        }
    }
    counts[0] += nz_x;
    counts[1] += nz_q;
    counts[2] += sat;
}

float ampaudit_fp8_error_norm(const float *x, const float *v, int64_t n);

/* `norm` (where not NULL): the 2-norm of x - out once cast, as ampaudit_fp8_error_norm gives it
 * (the same call: x and out share one dense layout), while both are in the cache - the fp8
 * measurement's error of each cast, without a call of its own. */
int ampaudit_fp8_cast_amax(const float *x, float *out, int64_t outer, int64_t inner, int gran, float amax,
                           int pow2, int emax, uint32_t shift, uint32_t min_normal, float magic, uint32_t max_bits,
                           uint32_t over_bits, float fmax, int64_t *counts, int threads, float *norm) {
    Format f = {shift, min_normal, magic, max_bits, over_bits, fmax, gran >= 3};
    int64_t n = outer * inner, blocks_in = (inner + 31) / 32, groups = (outer + 31) / 32;
    int64_t size = gran == 0 ? 1 : gran == 1 ? outer : gran == 2 ? inner : gran == 3 ? outer * blocks_in
                                                                                     : groups * inner;
    float one, *scale = size == 1 ? &one : malloc(size * sizeof(float));
    uint32_t *m = gran == 2 || gran == 4 ? calloc(inner, sizeof(uint32_t)) : NULL;
    int ok = scale != NULL && (m != NULL || !(gran == 2 || gran == 4));
    int64_t parts = n / CHUNK < threads ? n / CHUNK : threads;
    if (ok && gran == 0) {
        uint32_t a = 0;
        if (amax < 0 && parts >= 2) { /* the tensor's amax, in parallel: a multi-MB activation's */
            _Pragma("omp parallel for num_threads(parts) schedule(static) reduction(max:a)")
            for (int64_t p = 0; p < parts; p++) {
                uint32_t r = run_amax(x + n * p / parts, n * (p + 1) / parts - n * p / parts);
                a = r > a ? r : a;
            }
        } else if (amax < 0) {
            a = run_amax(x, n);
        }
        ok = tensor_scale(amax >= 0 ? amax : float_of(a), fmax, pow2, scale);
    } else if (ok && gran == 1) {
        _Pragma("omp parallel for num_threads(parts < 2 ? 1 : parts) schedule(static) if(parts >= 2)")
        for (int64_t o = 0; o < outer; o++) scale[o] = float_of(run_amax(x + o * inner, inner));
        for (int64_t o = 0; o < outer && ok; o++) ok = tensor_scale(scale[o], fmax, pow2, scale + o);
    } else if (ok && gran == 2) {
        column_amax(x, 0, outer, inner, m);
        for (int64_t i = 0; i < inner && ok; i++) ok = tensor_scale(float_of(m[i]), fmax, pow2, scale + i);
    } else if (ok && gran == 3) {
        for (int64_t o = 0; o < outer && ok; o++)
            for (int64_t b = 0; b < blocks_in && ok; b++) {
                int64_t lo = b * 32, len = inner - lo < 32 ? inner - lo : 32;
                ok = mx_scale(float_of(run_amax(x + o * inner + lo, len)), emax, scale + o * blocks_in + b);
            }
    } else if (ok && gran == 4) {
        for (int64_t g = 0; g < groups && ok; g++) {
            memset(m, 0, inner * sizeof(uint32_t));
            column_amax(x, g * 32, (g + 1) * 32 < outer ? (g + 1) * 32 : outer, inner, m);
            for (int64_t i = 0; i < inner && ok; i++) ok = mx_scale(float_of(m[i]), emax, scale + g * inner + i);
        }
    }
    if (ok) {
        int64_t local[3] = {0, 0, 0};
        if (gran >= 3)
            cast_blocks(x, out, outer, inner, scale, gran == 3, &f, local);
        else
            ampaudit_fp8_cast(x, out, outer, inner, scale, gran == 1, gran == 2, shift, min_normal, magic, max_bits,
                              over_bits, fmax, 0, local, threads);
        counts[0] += local[0];
        counts[1] += local[1];
        counts[2] += local[2];
        if (norm != NULL) *norm = ampaudit_fp8_error_norm(x, out, n);
    }
    if (scale != &one) free(scale);
    free(m);
    return !ok;
}

/* One operand's summary for the fp8 measurement, in one pass: |x|'s max per outer run
 * (outer_amax), per inner index (inner_amax) and in all (amax), its nonzero elements, and its
 * k-th smallest |x| (0-based: graph/fp8_measure.py's 99.9th percentile, the element torch's topk
 * finds) - the smallest of its n - k largest, kept in a min-heap that a run whose max does not
 * pass the heap's least skips. Magnitudes as fp32 bits: their order is the floats'. */
static void sift_down(uint32_t *h, int64_t m, uint32_t v) { /* the root replaced by v */
    int64_t i = 0;
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= m) break;
        if (c + 1 < m && h[c + 1] < h[c]) c++;
        if (h[c] >= v) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = v;
}

SIMD_CLONES static uint32_t run_summary(const float *row, int64_t inner, uint32_t *inner_m, int64_t *nz) {
    uint32_t m = 0;
    int64_t z = 0;
    for (int64_t i = 0; i < inner; i++) {
        uint32_t a = bits_of(row[i]) & 0x7fffffffu;
        m = a > m ? a : m;
        inner_m[i] = a > inner_m[i] ? a : inner_m[i];
        z += a != 0;
    }
    *nz += z;
    return m;
}

int ampaudit_fp8_summary(const float *x, int64_t outer, int64_t inner, float *outer_amax, float *inner_amax,
                         int64_t k, int64_t *nonzero, float *kth, float *amax) {
    int64_t n = outer * inner, top = n - k, nz = 0; /* the kth smallest: the least of the top largest */
    uint32_t *heap = calloc(top, sizeof(uint32_t)), *inner_m = calloc(inner, sizeof(uint32_t)), all = 0;
    if (heap == NULL || inner_m == NULL) {
        free(heap);
        free(inner_m);
        return 1;
    }
    for (int64_t o = 0; o < outer; o++) {
        const float *row = x + o * inner;
        uint32_t m = run_summary(row, inner, inner_m, &nz);
        outer_amax[o] = float_of(m);
        all = m > all ? m : all;
        if (m <= heap[0]) continue; /* the heap starts with zeros: no magnitude is below them */
        for (int64_t i = 0; i < inner; i++) {
            uint32_t a = bits_of(row[i]) & 0x7fffffffu;
            if (a > heap[0]) sift_down(heap, top, a);
        }
    }
    for (int64_t i = 0; i < inner; i++) inner_amax[i] = float_of(inner_m[i]);
    *nonzero = nz;
    *kth = float_of(heap[0]);
    *amax = float_of(all);
    free(heap);
    free(inner_m);
    return 0;
}

/* A 1-D array of amaxes (each >= 0), for the fp8 measurement's outlier tokens and channels: its
 * lower median (torch.median's), how many exceed fp32(ratio * median) (the comparison torch
 * makes of the float32 tensors), and its least positive element (inf where none is). */
static uint32_t select_kth(uint32_t *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (hi > lo) {
        uint32_t p0 = a[lo], p1 = a[lo + (hi - lo) / 2], p2 = a[hi]; /* the median of three: the pivot */
        uint32_t p = p0 < p1 ? (p1 < p2 ? p1 : p0 < p2 ? p2 : p0) : (p0 < p2 ? p0 : p1 < p2 ? p2 : p1);
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] < p) i++;
            while (a[j] > p) j--;
            if (i <= j) {
                uint32_t t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        if (k <= j)
            hi = j;
        else if (k >= i)
            lo = i;
        else
            return a[k];
    }
    return a[k];
}

int ampaudit_fp8_spread(const float *amax, int64_t n, float ratio, float *median, int64_t *over,
                        float *least_positive) {
    uint32_t *a = malloc(n * sizeof(uint32_t)), least = 0x7f800000u;
    if (a == NULL || n == 0) {
        free(a);
        return 1;
    }
    for (int64_t i = 0; i < n; i++) {
        a[i] = bits_of(amax[i]) & 0x7fffffffu;
        least = a[i] != 0 && a[i] < least ? a[i] : least;
    }
    float m = float_of(select_kth(a, n, (n - 1) / 2)), threshold = ratio * m;
    int64_t c = 0;
    for (int64_t i = 0; i < n; i++) c += amax[i] > threshold;
    *median = m;
    *over = c;
    *least_positive = float_of(least);
    free(a);
    return 0;
}

/* The 2-norm of x - v (of x where v is NULL), n elements each in memory order, summed as torch's
 * CPU norm sums a dense float32 tensor (its AVX2 kernel, binary_kernel_reduce_lastdim): eight
 * lanes, each adding its elements' squares (a product, then a sum: not fused); the lanes added in
 * order; then the remaining elements, four at a time squared and added in order, the last 1-3
 * each by one fused multiply-add; sqrtf. x - v is float32's subtraction, as torch.sub's. What the
 * fp8 measurement took as torch.sub then torch.linalg.vector_norm: two passes and a temporary.
 * graph/fp8_native.py compares it with torch's on first use and keeps torch's where they differ
 * (another build of torch, another CPU): the products and sums must not be fused by the compiler. */
#if defined(__clang__)
#define NO_CONTRACT
#elif defined(__GNUC__)
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#else
#define NO_CONTRACT
#endif

NO_CONTRACT float ampaudit_fp8_error_norm(const float *x, const float *v, int64_t n) {
#if defined(__clang__)
#pragma clang fp contract(off)
#endif
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t d = 0, body = n - n % 8;
    if (v != NULL) {
        for (; d < body; d += 8)
            for (int j = 0; j < 8; j++) {
                float e = x[d + j] - v[d + j], p = e * e;
                acc[j] = acc[j] + p;
            }
    } else {
        for (; d < body; d += 8)
            for (int j = 0; j < 8; j++) {
                float e = x[d + j], p = e * e;
                acc[j] = acc[j] + p;
            }
    }
    float b = acc[0];
    for (int j = 1; j < 8; j++) b = b + acc[j];
    for (; n - d >= 4; d += 4)
        for (int j = 0; j < 4; j++) {
            float e = v != NULL ? x[d + j] - v[d + j] : x[d + j], p = e * e;
            b = b + p;
        }
    for (; d < n; d++) {
        float e = v != NULL ? x[d] - v[d] : x[d];
        b = fmaf(e, e, b);
    }
    return sqrtf(b);
}
