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
