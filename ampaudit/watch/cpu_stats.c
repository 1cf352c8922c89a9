/* The raw statistics row on the CPU in one pass (see stats.py for what the row means):
 * counts[k] += how many |x| have top 10 fp32 bits k (8 exponent bits, 2 mantissa bits),
 * *overflow += how many |x| >= the fp32 value with bits over_bits (Inf included, NaN not),
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
#define BLOCK 512   /* elements whose bins are computed (vectorised) before they are counted */

/* Loaders: |x| as fp32 bits in an int32 (all below 2**31, so signed compares work and the
 * compiler can vectorise them), every NaN made the canonical quiet NaN - signalling ones
 * too, which a top-bits histogram would otherwise count as Inf. */
static inline int32_t quiet(int32_t a) {
    return a > 0x7f800000 ? 0x7fc00000 : a;
}

static inline int32_t f32_abs(const void *x, int64_t i) {
    return quiet(((const int32_t *)x)[i] & 0x7fffffff);
}

static inline int32_t bf16_abs(const void *x, int64_t i) {
    return quiet((int32_t)(((const uint16_t *)x)[i] & 0x7fffu) << 16);
}

/* float16 through a table of all 32768 magnitudes (filled by ampaudit_init, called once at
 * load): exact, every float16 being a float32, and faster than converting each element. */
static int32_t half_table[32768];

static inline int32_t f16_abs(const void *x, int64_t i) {
    return half_table[((const uint16_t *)x)[i] & 0x7fff];
}

void ampaudit_init(void) {
    for (int32_t h = 0; h < 32768; h++) {
        int32_t e = h >> 10, m = h & 0x3ff, sub_bits;
        float sub = (float)m * 0x1p-24f; /* exponent 0: m * 2**-24 */
        memcpy(&sub_bits, &sub, sizeof sub_bits);
        half_table[h] = e == 31 ? (m ? 0x7fc00000 : 0x7f800000) : e ? (h << 13) + (112 << 23) : sub_bits;
    }
}

/* The bin: the top 10 bits, except that subnormals too small to reach bin 1 go there rather
 * than into bin 0, which holds exact zeros only. */
static inline int32_t key(int32_t a) {
    int32_t k = a >> 21, nonzero = a != 0;
    return k > nonzero ? k : nonzero;
}

/* One piece, a block at a time: first the bins and the finite max of the block (a loop the
 * compiler vectorises), then the counting, over four lanes of counts so that runs of equal
 * bins do not serialise on one counter. A macro rather than a function pointer so that each
 * loader is inlined. */
#define PIECE_BODY(LOAD)                                                   \
    uint32_t c[4][1024];                                                   \
    int16_t keys[BLOCK];                                                   \
    int32_t peak = 0;                                                      \
    int64_t over = 0;                                                      \
    memset(c, 0, sizeof c);                                                \
    for (int64_t b = lo; b < hi; b += BLOCK) {                             \
        int len = hi - b < BLOCK ? (int)(hi - b) : BLOCK;                  \
        int32_t block_over = 0; /* int32: the loop stays vectorised */   \
        for (int j = 0; j < len; j++) {                                    \
            int32_t a = LOAD(x, b + j);                                    \
            keys[j] = (int16_t)key(a);                                     \
            int32_t finite = a < 0x7f800000 ? a : 0;                       \
            peak = finite > peak ? finite : peak;                          \
            block_over += a >= over_bits; /* NaN too: taken out below */   \
        }                                                                  \
        over += block_over;                                                \
        int j = 0;                                                         \
        for (; j + 4 <= len; j += 4) {                                     \
            c[0][keys[j]]++;                                               \
            c[1][keys[j + 1]]++;                                           \
            c[2][keys[j + 2]]++;                                           \
            c[3][keys[j + 3]]++;                                           \
        }                                                                  \
        for (; j < len; j++) c[0][keys[j]]++;                              \
    }                                                                      \
    for (int k = 0; k < 1024; k++)                                         \
        counts[k] += (int64_t)c[0][k] + c[1][k] + c[2][k] + c[3][k];      \
    /* every NaN is the quiet one, in bin 1022: one compare, not two */  \
    *overflow += over - c[0][1022] - c[1][1022] - c[2][1022] - c[3][1022];\
    if ((uint32_t)peak > *maxbits) *maxbits = (uint32_t)peak;

/* The entry points: split into pieces, on OpenMP threads when there are several. */
#define DEFINE_ROWS(NAME, LOAD)                                                                  \
    static void NAME##_piece(const void *x, int64_t lo, int64_t hi, int64_t *counts,           \
                             int64_t *overflow, uint32_t *maxbits, int32_t over_bits) {         \
        PIECE_BODY(LOAD)                                                                         \
    }                                                                                            \
    void NAME(const void *x, int64_t n, int64_t *counts, int64_t *overflow, uint32_t *maxbits,   \
              uint32_t over_bits, int threads) {                                                 \
        int64_t pieces = (n + PIECE - 1) / PIECE;                                                \
        int32_t over_at = over_bits > 0x7f800000u ? 0x7f800000 : (int32_t)over_bits;             \
        if (threads < 2 || pieces < 2) {                                                         \
            for (int64_t p = 0; p < pieces; p++)                                                 \
                NAME##_piece(x, p * PIECE, p < pieces - 1 ? (p + 1) * PIECE : n, counts,         \
                             overflow, maxbits, over_at);                                        \
            return;                                                                              \
        }                                                                                        \
        _Pragma("omp parallel num_threads(threads)")                                             \
        {                                                                                        \
            int64_t local[1024], local_over = 0;                                                 \
            uint32_t peak = 0;                                                                   \
            memset(local, 0, sizeof local);                                                      \
            _Pragma("omp for schedule(static)")                                                  \
            for (int64_t p = 0; p < pieces; p++)                                                 \
                NAME##_piece(x, p * PIECE, p < pieces - 1 ? (p + 1) * PIECE : n, local,          \
                             &local_over, &peak, over_at);                                       \
            _Pragma("omp critical")                                                              \
            {                                                                                    \
                for (int k = 0; k < 1024; k++) counts[k] += local[k];                            \
                *overflow += local_over;                                                         \
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
