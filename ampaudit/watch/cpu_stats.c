/* The raw statistics row on the CPU in one pass (see stats.py for what the row means):
 * counts[k] += how many |x| have top 10 fp32 bits k (8 exponent bits, 2 mantissa bits),
 * *maxbits = max(*maxbits, fp32 bits of the largest finite |x|).
 *
 * torch has no fused CPU op for this; built from torch ops it takes six passes and a serial
 * bincount. ampaudit compiles this file on first use (cpu_kernel.py) and falls back to the
 * torch ops when no C compiler is around. OpenMP, when the compiler has it, splits tensors of
 * more than one piece across torch's own thread pool (the soname resolves to the libgomp
 * torch already loaded).
 */
#include <stdint.h>
#include <string.h>

#define PIECE 65536 /* elements per task: per-lane counts stay far below 2**32 */

/* Loaders: |x| as fp32 bits, every NaN made the canonical quiet NaN (signalling ones too,
 * which the torch ops would count as Inf when their payload sits in the low bits). */
static inline uint32_t quiet(uint32_t a) {
    return a > 0x7f800000u ? 0x7fc00000u : a;
}

static inline uint32_t f32_abs(const void *x, int64_t i) {
    return quiet(((const uint32_t *)x)[i] & 0x7fffffffu);
}

static inline uint32_t bf16_abs(const void *x, int64_t i) {
    return quiet((uint32_t)(((const uint16_t *)x)[i] & 0x7fffu) << 16);
}

/* Exact: every float16 is a float32. */
static inline uint32_t f16_abs(const void *x, int64_t i) {
    uint32_t h = ((const uint16_t *)x)[i] & 0x7fffu, e = h >> 10, m = h & 0x3ffu;
    if (e == 0x1f) return m ? 0x7fc00000u : 0x7f800000u;
    if (e) return ((e + 112u) << 23) | (m << 13);
    if (!m) return 0;
    uint32_t shift = 0; /* subnormal: m * 2**-24, normalised */
    while (!(m & 0x400u)) { m <<= 1; shift++; }
    return ((113u - shift) << 23) | ((m & 0x3ffu) << 13);
}

/* One piece: four lanes of counts so that runs of equal bins do not serialise on one
 * counter. A macro rather than a function pointer so that each loader is inlined. */
#define PIECE_BODY(LOAD)                                                          \
    uint32_t c[4][1024];                                                          \
    uint32_t m0 = 0, m1 = 0, m2 = 0, m3 = 0;                                      \
    memset(c, 0, sizeof c);                                                       \
    int64_t i = lo;                                                               \
    for (; i + 4 <= hi; i += 4) {                                                 \
        uint32_t a0 = LOAD(x, i), a1 = LOAD(x, i + 1);                            \
        uint32_t a2 = LOAD(x, i + 2), a3 = LOAD(x, i + 3);                        \
        c[0][key(a0)]++; c[1][key(a1)]++; c[2][key(a2)]++; c[3][key(a3)]++;      \
        m0 = finite_max(m0, a0); m1 = finite_max(m1, a1);                         \
        m2 = finite_max(m2, a2); m3 = finite_max(m3, a3);                         \
    }                                                                             \
    for (; i < hi; i++) {                                                         \
        uint32_t a = LOAD(x, i);                                                  \
        c[0][key(a)]++;                                                           \
        m0 = finite_max(m0, a);                                                   \
    }                                                                             \
    for (int k = 0; k < 1024; k++)                                                \
        counts[k] += (int64_t)c[0][k] + c[1][k] + c[2][k] + c[3][k];             \
    m0 = finite_max(finite_max(m0, m1), finite_max(m2, m3));                      \
    *maxbits = m0 > *maxbits ? m0 : *maxbits;

/* The bin: the top 10 bits, except that subnormals too small to reach bin 1 go there rather
 * than into bin 0, which holds exact zeros only. */
static inline uint32_t key(uint32_t a) {
    uint32_t k = a >> 21;
    return k | (k == 0 && a != 0);
}

/* Inf and NaN (bits >= 0x7f800000) do not count for the finite max. */
static inline uint32_t finite_max(uint32_t m, uint32_t a) {
    a = a < 0x7f800000u ? a : 0;
    return a > m ? a : m;
}

/* The entry points: split into pieces, on OpenMP threads when there are several. */
#define DEFINE_ROWS(NAME, LOAD)                                                                  \
    static void NAME##_piece(const void *x, int64_t lo, int64_t hi, int64_t *counts,           \
                             uint32_t *maxbits) {                                                \
        PIECE_BODY(LOAD)                                                                         \
    }                                                                                            \
    void NAME(const void *x, int64_t n, int64_t *counts, uint32_t *maxbits, int threads) {     \
        int64_t pieces = (n + PIECE - 1) / PIECE;                                                \
        if (threads < 2 || pieces < 2) {                                                         \
            for (int64_t p = 0; p < pieces; p++)                                                 \
                NAME##_piece(x, p * PIECE, p < pieces - 1 ? (p + 1) * PIECE : n, counts, maxbits); \
            return;                                                                              \
        }                                                                                        \
        _Pragma("omp parallel num_threads(threads)")                                             \
        {                                                                                        \
            int64_t local[1024];                                                                 \
            uint32_t peak = 0;                                                                   \
            memset(local, 0, sizeof local);                                                      \
            _Pragma("omp for schedule(static)")                                                  \
            for (int64_t p = 0; p < pieces; p++)                                                 \
                NAME##_piece(x, p * PIECE, p < pieces - 1 ? (p + 1) * PIECE : n, local, &peak);  \
            _Pragma("omp critical")                                                              \
            {                                                                                    \
                for (int k = 0; k < 1024; k++) counts[k] += local[k];                            \
                if (peak > *maxbits) *maxbits = peak;                                            \
            }                                                                                    \
        }                                                                                        \
    }

DEFINE_ROWS(ampaudit_rows_f32, f32_abs)
DEFINE_ROWS(ampaudit_rows_f16, f16_abs)
DEFINE_ROWS(ampaudit_rows_bf16, bf16_abs)

int ampaudit_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}
