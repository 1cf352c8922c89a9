/* The raw statistics row on the CPU in one pass (see layout.py and stats.py for what the row
 * means): bins[k] += how many |x| have fp32 bits k after a shift right by AMPAUDIT_BIN_SHIFT
 * (8 exponent bits, 2 mantissa bits), *overflow += how many |x| >= the fp32 value with bits
 * over_bits (Inf included, NaN not), *neginf += how many x are exactly -inf,
 * *maxbits = max(*maxbits, fp32 bits of the largest finite |x|), and where sumsq is not NULL
 * *sumsq += the sum of x^2 (a parameter gradient's squared norm).
 *
 * The row's layout is Python's (ampaudit/watch/layout.py): the caller passes a pointer to each
 * slot, and cpu_kernel.py compiles this file with -DAMPAUDIT_BIN_SHIFT from the layout and
 * checks ampaudit_bins() against it when it loads the library.
 *
 * torch has no fused CPU op for this; built from torch ops it takes seven passes and a serial
 * bincount. At a logged step's boundary two more loops (ampaudit_compact, ampaudit_step_buffer)
 * do what a few dozen small torch ops do on a GPU, whose per-op cost dominates a small model's
 * step on the CPU. ampaudit compiles this file on first use (cpu_kernel.py) and falls back to the
 * torch ops when no C compiler is around. OpenMP, when the compiler has it, splits tensors of
 * more than one piece across torch's own thread pool (the soname resolves to the libgomp
 * torch already loaded).
 */
#include <stdint.h>
#include <string.h>

#ifndef AMPAUDIT_BIN_SHIFT
#error "compile with -DAMPAUDIT_BIN_SHIFT=<layout.LAYOUT.bin_shift> (cpu_kernel.py does)"
#endif
#define NBINS (1 << (31 - AMPAUDIT_BIN_SHIFT))
#define QUIET_NAN 0x7fc00000
#define NAN_BIN (QUIET_NAN >> AMPAUDIT_BIN_SHIFT) /* where every NaN lands, once made quiet */
#define INF_BIN (0x7f800000 >> AMPAUDIT_BIN_SHIFT)  /* +-Inf, and nothing else */

#include "native_simd.h" /* SIMD_CLONES */

#define PIECE 65536 /* elements per task: a lane counts at most an eighth of a piece (and seven
                      * more per block), below 2**16: uint16 lanes, 16 KB for eight of them */
#define BLOCK 512   /* elements whose bins are computed (vectorised) before they are counted */

int ampaudit_bins(void) {
    return NBINS;
}

/* Each element is read once, as its raw bits (RAW), then turned into |x| as fp32 bits in an
 * int32 (ABS: all below 2**31, so signed compares work and the compiler can vectorise them),
 * every NaN made the canonical quiet NaN - signalling ones too, which a top-bits histogram
 * would otherwise count as Inf. -inf is one raw bit pattern per dtype (NEGINF). */
static inline int32_t quiet(int32_t a) {
    return a > 0x7f800000 ? QUIET_NAN : a;
}

static inline int32_t f32_raw(const void *x, int64_t i) {
    return ((const int32_t *)x)[i];
}

static inline int32_t f32_abs(int32_t r) {
    return quiet(r & 0x7fffffff);
}

#define F32_NEGINF ((int32_t)0xff800000u)

static inline int32_t h16_raw(const void *x, int64_t i) { /* float16 and bfloat16: 16 bits */
    return ((const uint16_t *)x)[i];
}

static inline int32_t bf16_abs(int32_t r) {
    return quiet((r & 0x7fff) << 16);
}

#define BF16_NEGINF 0xff80

/* float16 through a table of all 32768 magnitudes (filled by ampaudit_init, called once at
 * load): exact, every float16 being a float32, and faster than converting each element. */
static int32_t half_table[32768];

static inline int32_t f16_abs(int32_t r) {
    return half_table[r & 0x7fff];
}

#define F16_NEGINF 0xfc00

void ampaudit_init(void) {
    for (int32_t h = 0; h < 32768; h++) {
        int32_t e = h >> 10, m = h & 0x3ff, sub_bits;
        float sub = (float)m * 0x1p-24f; /* exponent 0: m * 2**-24 */
        memcpy(&sub_bits, &sub, sizeof sub_bits);
        half_table[h] = e == 31 ? (m ? 0x7fc00000 : 0x7f800000) : e ? (h << 13) + (112 << 23) : sub_bits;
    }
}

static inline float as_float(int32_t a) {
    float f;
    memcpy(&f, &a, sizeof f);
    return f;
}

/* Each element as a float, for its square: the sign and which NaN do not matter there. */
static inline float f32_value(const void *x, int64_t i) {
    return ((const float *)x)[i];
}

static inline float f16_value(const void *x, int64_t i) {
    return as_float(f16_abs(h16_raw(x, i)));
}

static inline float bf16_value(const void *x, int64_t i) {
    return as_float((int32_t)h16_raw(x, i) << 16);
}

/* The bin: the top 10 bits, except that subnormals too small to reach bin 1 go there rather
 * than into bin 0, which holds exact zeros only. */
static inline int32_t key(int32_t a) {
    int32_t k = a >> AMPAUDIT_BIN_SHIFT, nonzero = a != 0;
    return k > nonzero ? k : nonzero;
}

/* One piece, a block at a time: first the bins and the finite max of the block (a loop the
 * compiler vectorises), then the counting, over eight lanes of counts so that runs of equal
 * bins do not serialise on one counter. Only a block that held an Inf is read again, for
 * the sign of its infinities: -inf costs nothing where there is none. A macro rather than a
 * function pointer so that each loader is inlined. */
#define LANES(BIN) ((uint32_t)c[0][BIN] + c[1][BIN] + c[2][BIN] + c[3][BIN] + c[4][BIN] + c[5][BIN] + c[6][BIN] + c[7][BIN])
#define PIECE_BODY(RAW, ABS, NEGINF, SQUARED)                                       \
    uint16_t c[8][NBINS];                                                  \
    int16_t keys[BLOCK];                                                   \
    int32_t peak = 0;                                                      \
    int64_t over = 0, neg = 0;                                             \
    double squares = 0.0;                                                  \
    memset(c, 0, sizeof c);                                                \
    for (int64_t b = lo; b < hi; b += BLOCK) {                             \
        int len = hi - b < BLOCK ? (int)(hi - b) : BLOCK;                  \
        int32_t block_over = 0; /* int32: the loop stays vectorised */   \
        for (int j = 0; j < len; j++) {                                    \
            int32_t a = ABS(RAW(x, b + j));                                \
            keys[j] = (int16_t)key(a);                                     \
            int32_t finite = a < 0x7f800000 ? a : 0;                       \
            peak = finite > peak ? finite : peak;                          \
            block_over += a >= over_bits; /* NaN too: taken out below */   \
        }                                                                  \
        over += block_over;                                                \
        if (sumsq) { /* |x|^2 = x^2, NaN and Inf kept: what a dot product gives */ \
            double s = 0.0;                                                \
            _Pragma("omp simd reduction(+:s)")                             \
            for (int j = 0; j < len; j++) {                                \
                double v = SQUARED(x, b + j);                              \
                s += v * v;                                                \
            }                                                              \
            squares += s;                                                  \
        }                                                                  \
        uint32_t infs = LANES(INF_BIN);                                    \
        int j = 0;                                                         \
        for (; j + 8 <= len; j += 8) {                                     \
            c[0][keys[j]]++;                                               \
            c[1][keys[j + 1]]++;                                           \
            c[2][keys[j + 2]]++;                                           \
            c[3][keys[j + 3]]++;                                           \
            c[4][keys[j + 4]]++;                                           \
            c[5][keys[j + 5]]++;                                           \
            c[6][keys[j + 6]]++;                                           \
            c[7][keys[j + 7]]++;                                           \
        }                                                                  \
        for (; j < len; j++) c[0][keys[j]]++;                              \
        if (LANES(INF_BIN) != infs) /* an Inf in this block: which sign */ \
            for (j = 0; j < len; j++) neg += RAW(x, b + j) == NEGINF;      \
    }                                                                      \
    for (int k = 0; k < NBINS; k++) { /* the row's unused bins untouched */ \
        uint32_t n = LANES(k);                                             \
        if (n) bins[k] += (int64_t)n;                                      \
    }                                                                      \
    /* every NaN is the quiet one, in NAN_BIN: one compare, not two */     \
    *overflow += over - LANES(NAN_BIN);                                    \
    *neginf += neg;                                                        \
    if (sumsq) *sumsq += squares;                                          \
    if ((uint32_t)peak > *maxbits) *maxbits = (uint32_t)peak;

/* The entry points: split into pieces, on OpenMP threads when there are several. */
#define DEFINE_ROWS(NAME, RAW, ABS, NEGINF, SQUARED)                                                      \
    SIMD_CLONES static void NAME##_piece(const void *x, int64_t lo, int64_t hi, int64_t *bins,              \
                             int64_t *overflow, int64_t *neginf, uint32_t *maxbits,              \
                             int32_t over_bits, double *sumsq) {                                 \
        PIECE_BODY(RAW, ABS, NEGINF, SQUARED)                                                           \
    }                                                                                            \
    void NAME(const void *x, int64_t n, int64_t *bins, int64_t *overflow, int64_t *neginf,       \
              uint32_t *maxbits, uint32_t over_bits, float *sumsq, int threads) {                \
        int64_t pieces = (n + PIECE - 1) / PIECE;                                                \
        int32_t over_at = over_bits > 0x7f800000u ? 0x7f800000 : (int32_t)over_bits;             \
        double squares = 0.0, *want = sumsq ? &squares : 0;                                      \
        if (threads < 2 || pieces < 2) {                                                         \
            for (int64_t p = 0; p < pieces; p++)                                                 \
                NAME##_piece(x, p * PIECE, p < pieces - 1 ? (p + 1) * PIECE : n, bins,           \
                             overflow, neginf, maxbits, over_at, want);                          \
            if (sumsq) *sumsq += (float)squares;                                                 \
            return;                                                                              \
        }                                                                                        \
        _Pragma("omp parallel num_threads(threads)")                                             \
        {                                                                                        \
            int64_t local[NBINS], local_over = 0, local_neg = 0;                                 \
            uint32_t peak = 0;                                                                   \
            double local_sq = 0.0;                                                               \
            memset(local, 0, sizeof local);                                                      \
            _Pragma("omp for schedule(static)")                                                  \
            for (int64_t p = 0; p < pieces; p++)                                                 \
                NAME##_piece(x, p * PIECE, p < pieces - 1 ? (p + 1) * PIECE : n, local,          \
                             &local_over, &local_neg, &peak, over_at, want ? &local_sq : 0);     \
            _Pragma("omp critical")                                                              \
            {                                                                                    \
                for (int k = 0; k < NBINS; k++) bins[k] += local[k];                             \
                *overflow += local_over;                                                         \
                *neginf += local_neg;                                                            \
                squares += local_sq;                                                             \
                if (peak > *maxbits) *maxbits = peak;                                            \
            }                                                                                    \
        }                                                                                        \
        if (sumsq) *sumsq += (float)squares;                                                     \
    }

DEFINE_ROWS(ampaudit_rows_f32, f32_raw, f32_abs, F32_NEGINF, f32_value)
DEFINE_ROWS(ampaudit_rows_f16, h16_raw, f16_abs, F16_NEGINF, f16_value)
DEFINE_ROWS(ampaudit_rows_bf16, h16_raw, bf16_abs, BF16_NEGINF, bf16_value)

/* Only what a row needs to say whether its tensor held NaN, +inf or -inf (the Inf bin, the
 * NaN bin, the -inf slot; every other slot untouched): for tensors that are candidates for
 * the first non-finite value but in no statistics (a module's input gradient). Compares and
 * adds on the raw bits, no histogram: the compiler vectorises it, several times faster than
 * a row. MASK clears the sign, INF is +inf's bits: above it is NaN. */
#define DEFINE_NONFINITE(NAME, RAW, MASK, INF, NEGINF)                                          \
    SIMD_CLONES void NAME(const void *x, int64_t n, int64_t *bins, int64_t *neginf) {          \
        int64_t inf = 0, nan = 0, neg = 0;                                                      \
        for (int64_t b = 0; b < n; b += BLOCK) {                                                \
            int len = n - b < BLOCK ? (int)(n - b) : BLOCK;                                     \
            int32_t block_inf = 0, block_nan = 0;                                               \
            for (int j = 0; j < len; j++) {                                                     \
                int32_t a = RAW(x, b + j) & MASK;                                               \
                block_inf += a == INF;                                                          \
                block_nan += a > INF;                                                           \
            }                                                                                   \
            if (block_inf)                                                                      \
                for (int j = 0; j < len; j++) neg += RAW(x, b + j) == NEGINF;                   \
            inf += block_inf;                                                                   \
            nan += block_nan;                                                                   \
        }                                                                                       \
        bins[INF_BIN] += inf;                                                                   \
        bins[NAN_BIN] += nan;                                                                   \
        *neginf += neg;                                                                         \
    }

DEFINE_NONFINITE(ampaudit_nonfinite_f32, f32_raw, 0x7fffffff, 0x7f800000, F32_NEGINF)
DEFINE_NONFINITE(ampaudit_nonfinite_f16, h16_raw, 0x7fff, 0x7c00, F16_NEGINF)
DEFINE_NONFINITE(ampaudit_nonfinite_bf16, h16_raw, 0x7fff, 0x7f80, BF16_NEGINF)

/* A row whose counts are exact but whose magnitude histogram is estimated (watch's default for
 * activations and their gradients on the CPU, where the exact histogram's one scattered add
 * per element cost as much as reading the element: watch.md says why). One vectorised pass counts
 * what the verdicts read - zeros, the values below low_at (the audited dtype's smallest
 * normal, an exponent boundary), the max and the largest value below low_at - and one
 * element in about every `stride`, at a jittered stride (a fixed one would keep meeting the
 * same columns of a tensor whose row length it divides), is binned. Only a piece whose max
 * reaches over_at (rare in a healthy run) is read again, to count the values >= over_at, NaN,
 * Inf and -inf and find its finite max: the pass every tensor takes stays four reductions,
 * at the speed of reading memory. The sample's bins are
 * then scaled to the exact counts of their class (below low_at, and finite at or above it),
 * the rounding left over put in the class's fullest bin; a class the sample missed goes whole
 * into the bin of its largest value. So zero, underflow, Inf, NaN and every sum the summary
 * takes from the bins are exact, and only the shape within a class is sampled. */
enum { ZERO, LOW, NONFINITE, NAN_COUNT, OVER, NEG, TOTALS };
/* The sample is binned into this many histograms in turn, added up at the end: neighbouring
 * samples mostly share a bin, and increments of one bin wait on each other (the sample cost
 * 2.4 ns an element in one histogram). */
#define SAMPLE_LANES 4
/* The pass and the sample go a chunk at a time (8 KB of float32), the chunk's samples binned
 * while it is in the L1 cache: taken after the whole piece's pass, they came from L2 or beyond.
 * The same samples and bins; a 49,152-element float32 row 11.4 -> 9.7 us hot, its 4096 samples
 * 6.4 -> 4.5 us of it. */
#define SAMPLE_CHUNK (4 * BLOCK)

/* |x| as fp32 bits, NaN left as it is (above +Inf): the vectoriser gives up on the counting
 * loop with the select that makes it quiet. The sample's bins use the *_abs loaders. */
static inline int32_t f32_mag(int32_t r) {
    return r & 0x7fffffff;
}

static inline int32_t bf16_mag(int32_t r) {
    return (r & 0x7fff) << 16;
}

#define SAMPLED_PIECE(RAW, MAG, ABS, NEGINF)                                                   \
    int64_t t[TOTALS] = {0};                                                                   \
    int32_t zero = 0, low = 0, top = 0, small_top = 0; /* a piece's counts fit int32 */        \
    int64_t k = lo / stride + 1; /* the jitter: a hash of the sample's number, no chain */    \
    int64_t next = lo + stride / 2; /* the next sample */                                     \
    for (int64_t from = lo; from < hi; from += SAMPLE_CHUNK) {                                 \
        int64_t to = hi - from < SAMPLE_CHUNK ? hi : from + SAMPLE_CHUNK;                      \
        for (int64_t i = from; i < to; i++) { /* one loop, vectorised */                      \
            int32_t a = MAG(RAW(x, i)), small = a < low_at ? a : 0;                            \
            zero += a == 0;                                                                    \
            low += a < low_at;                                                                 \
            small_top = small > small_top ? small : small_top;                                 \
            top = a > top ? a : top;                                                           \
        }                                                                                      \
        for (; next < to; k++) { /* this chunk's samples, while it is in the L1 cache */       \
            sample[(k & (SAMPLE_LANES - 1)) * NBINS + key(ABS(RAW(x, next)))]++;               \
            next += stride / 2 + 1 + (int64_t)(((uint64_t)((uint32_t)k * 2654435769u) * (uint64_t)stride) >> 32); \
        }                                                                                      \
    }                                                                                          \
    if (top >= over_at) { /* rare: overflow or non-finite values, counted; the finite max */   \
        int32_t over = 0, bad = 0;                                                             \
        top = 0;                                                                               \
        for (int64_t i = lo; i < hi; i++) {                                                    \
            int32_t r = RAW(x, i), a = MAG(r), finite = a < 0x7f800000 ? a : 0;                \
            over += a >= over_at;                                                              \
            bad += a >= 0x7f800000;                                                            \
            t[NAN_COUNT] += a > 0x7f800000;                                                    \
            t[NEG] += r == NEGINF;                                                             \
            top = finite > top ? finite : top;                                                 \
        }                                                                                      \
        t[OVER] = over, t[NONFINITE] = bad;                                                    \
    }                                                                                          \
    t[ZERO] = zero, t[LOW] = low - zero;                                                       \
    for (int c = 0; c < TOTALS; c++) totals[c] += t[c];                                        \
    if (small_top > *low_peak) *low_peak = small_top;                                          \
    if (top > *peak) *peak = top;

/* The sample's bins [from, to) scaled to `total` values (see above). */
static void spread(const int32_t *sample, int from, int to, int64_t total, int fallback, int64_t *bins) {
    int64_t seen = 0, given = 0;
    int fullest = -1;
    for (int k = from; k < to; k++) seen += sample[k];
    if (!total)
        return;
    if (!seen) {
        bins[fallback] += total;
        return;
    }
    for (int k = from; k < to; k++) {
        if (!sample[k]) continue;
        int64_t c = (int64_t)((unsigned __int128)sample[k] * (uint64_t)total / (uint64_t)seen);
        bins[k] += c;
        given += c;
        if (fullest < 0 || sample[k] > sample[fullest]) fullest = k;
    }
    bins[fullest] += total - given;
}

/* The pieces on OpenMP threads when there are several, each thread's sample and totals added
 * up at its end; else in a plain loop (a parallel region costs microseconds even on one). */
#define SAMPLED_PIECES(PIECE_FN)                                                                         \
    if (threads < 2 || pieces < 2) {                                                                     \
        for (int64_t p = 0; p < pieces; p++)                                                             \
            PIECE_FN(x, p * PIECE, p < pieces - 1 ? (p + 1) * PIECE : n, stride, low_at, over_at, sample, \
                     totals, &peak, &low_peak);                                                          \
    } else {                                                                                             \
        _Pragma("omp parallel num_threads(threads)")                                                     \
        {                                                                                                \
            int32_t my_sample[SAMPLE_LANES * NBINS] = {0}, my_peak = 0, my_low_peak = 0;                 \
            int64_t my_totals[TOTALS] = {0};                                                             \
            _Pragma("omp for schedule(static)")                                                          \
            for (int64_t p = 0; p < pieces; p++)                                                         \
                PIECE_FN(x, p * PIECE, p < pieces - 1 ? (p + 1) * PIECE : n, stride, low_at, over_at,     \
                         my_sample, my_totals, &my_peak, &my_low_peak);                                  \
            _Pragma("omp critical")                                                                      \
            {                                                                                            \
                for (int k = 0; k < SAMPLE_LANES * NBINS; k++) sample[k] += my_sample[k];                \
                for (int k = 0; k < TOTALS; k++) totals[k] += my_totals[k];                              \
                if (my_peak > peak) peak = my_peak;                                                      \
                if (my_low_peak > low_peak) low_peak = my_low_peak;                                      \
            }                                                                                            \
        }                                                                                                \
    }

#define DEFINE_SAMPLED(NAME, RAW, MAG, ABS, NEGINF)                                                      \
    SIMD_CLONES static void NAME##_piece(const void *x, int64_t lo, int64_t hi, int64_t stride, int32_t low_at, \
                                         int32_t over_at, int32_t *sample, int64_t *totals, int32_t *peak, \
                                         int32_t *low_peak) {                                            \
        SAMPLED_PIECE(RAW, MAG, ABS, NEGINF)                                                             \
    }                                                                                                    \
    void NAME(const void *x, int64_t n, int64_t *bins, int64_t *overflow, int64_t *neginf, uint32_t *maxbits, \
              uint32_t over_bits, uint32_t low_bits, int64_t stride, int threads) {                      \
        int64_t pieces = (n + PIECE - 1) / PIECE, totals[TOTALS] = {0};                                  \
        int32_t lanes[SAMPLE_LANES * NBINS] = {0}, sample[NBINS], peak = 0, low_peak = 0;                \
        int32_t over_at = over_bits > 0x7f800000u ? 0x7f800000 : (int32_t)over_bits;                   \
        int32_t low_at = (int32_t)(low_bits & 0x7f800000u);                                              \
        {                                                                                                \
            int32_t *sample = lanes; /* the pieces bin into the lanes */                                 \
            SAMPLED_PIECES(NAME##_piece)                                                                 \
        }                                                                                                \
        for (int k = 0; k < NBINS; k++) /* at most n / stride + pieces each */                           \
            sample[k] = lanes[k] + lanes[NBINS + k] + lanes[2 * NBINS + k] + lanes[3 * NBINS + k];       \
        int low_end = key(low_at), low_seen = 0;                                                         \
        int64_t nan = totals[NAN_COUNT], inf = totals[NONFINITE] - nan;                                  \
        int64_t normal = n - totals[ZERO] - totals[LOW] - totals[NONFINITE];                             \
        for (int k = 1; k < low_end; k++) low_seen |= sample[k] != 0;                                    \
        bins[0] += totals[ZERO];                                                                         \
        bins[INF_BIN] += inf;                                                                            \
        bins[NAN_BIN] += nan;                                                                            \
        if (totals[LOW]) /* a sample with low values spreads them; else the largest's bin, found */     \
            spread(sample, 1, low_end, totals[LOW], low_seen ? 1 : key(low_peak), bins);              \
        spread(sample, low_end, INF_BIN, normal, key(peak), bins);                                       \
        *overflow += totals[OVER] - nan;                                                                 \
        *neginf += totals[NEG];                                                                          \
        if ((uint32_t)peak > *maxbits) *maxbits = (uint32_t)peak;                                        \
    }

DEFINE_SAMPLED(ampaudit_sampled_f32, f32_raw, f32_mag, f32_abs, F32_NEGINF)
DEFINE_SAMPLED(ampaudit_sampled_f16, h16_raw, f16_abs, f16_abs, F16_NEGINF)
DEFINE_SAMPLED(ampaudit_sampled_bf16, h16_raw, bf16_mag, bf16_abs, BF16_NEGINF)

int ampaudit_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Raw rows to the summary's Stats rows, what stats._compact does with torch ops, for the n
 * rows a step used: row r's counts (int64 bins, then the count slots) at counts + r * stride,
 * its finite absmax at absmax[r * astride]; out row r (width float64s) gets the fields at
 * the positions in field[] - numel, nan, inf, neginf, overflow, underflow, zero, absmax -
 * and from position hist on one count per fp32 exponent. Integer counts below 2**53 are exact
 * in float64, as in the torch ops: the rows are the same. */
#define PER_EXPONENT (NBINS / 256)
void ampaudit_compact(const int64_t *counts, int64_t stride, const float *absmax, int64_t astride, int64_t n,
                      int32_t overflow_slot, int32_t neginf_slot, int32_t normal_exponent, double *out,
                      int64_t width, const int32_t *field, int32_t hist) {
    for (int64_t r = 0; r < n; r++) {
        const int64_t *b = counts + r * stride;
        double *o = out + r * width;
        int64_t numel = 0, underflow = 0;
        for (int e = 0; e < 256; e++) {
            int64_t h = 0;
            for (int m = 0; m < PER_EXPONENT; m++) h += b[e * PER_EXPONENT + m];
            numel += h;
            if (e == 0) h -= b[0]; /* exponent 0 without the zeros: the fp32 subnormals */
            if (e < normal_exponent) underflow += h;
            o[hist + e] = (double)h;
        }
        int64_t nan = 0;
        for (int m = 1; m < PER_EXPONENT; m++) nan += b[NBINS - PER_EXPONENT + m];
        o[field[0]] = (double)numel;
        o[field[1]] = (double)nan;
        o[field[2]] = (double)b[NBINS - PER_EXPONENT];
        o[field[3]] = (double)b[neginf_slot];
        o[field[4]] = (double)b[overflow_slot];
        o[field[5]] = (double)underflow;
        o[field[6]] = (double)b[0];
        o[field[7]] = (double)absmax[r * astride];
    }
}

/* A logged step's buffer (reducer.StepReducer.step_buffer, there with torch ops) from the
 * Stats rows of the arena rows it used (rows, width float64s each): per (module, phase) key
 * the sum of its events' rows - each field in max_field[] (absmax) their largest instead -
 * then each parameter's row, its count over the loss scale (an int64 count slot; -1 without
 * a scale), and the first event that may be where a NaN was born (NO_EVENT if none; modes as
 * in reducer.bad_events, NULL: any non-finite). Sums of integer counts are exact in float64 in
 * any order, so the buffer is the torch ops' to the bit. Each parameter's norm is the square
 * root of its float32 sum of squares (sumsq: the extras' slot of its arena row) in float64,
 * correctly rounded as torch's is. The tail's scale and found-inf are the caller's. */
void ampaudit_step_buffer(const double *rows, int64_t width, const int64_t *event_row, const int64_t *event_key,
                          const int64_t *modes, int64_t n_events, int64_t n_keys, const int64_t *param_row,
                          int64_t n_params, const int64_t *counts, int64_t counts_stride, int32_t scaled_slot,
                          int32_t has_scale, const float *sumsq, int64_t sumsq_stride,
                          const int32_t *max_field, int32_t n_max, int32_t nan, int32_t inf, int32_t neginf,
                          double no_event, double *flat) {
    double *keys = flat, *params = flat + n_keys * width;
    double *norms = params + n_params * width, *scaled = norms + n_params, *first = scaled + n_params;
    unsigned char seen[n_keys > 0 ? n_keys : 1], summed[width];
    memset(keys, 0, (size_t)(n_keys * width) * sizeof(double));
    memset(seen, 0, sizeof seen);
    memset(summed, 1, sizeof summed);
    for (int32_t m = 0; m < n_max; m++) summed[max_field[m]] = 0;
    *first = no_event;
    for (int64_t i = 0; i < n_events; i++) {
        const double *row = rows + event_row[i] * width;
        double bad = row[nan] + row[inf];
        int64_t mode = modes ? modes[i] : 2; /* 0 never, 1 NaN or +inf (not a -inf mask), 2 any */
        if (*first == no_event && ((mode >= 1 && bad - row[neginf] > 0) || (mode == 2 && bad > 0)))
            *first = (double)i;
        int64_t k = event_key[i];
        if (k < 0) /* a candidate first non-finite only, in no row */
            continue;
        double *out = keys + k * width;
        for (int64_t c = 0; c < width; c++)
            if (summed[c]) out[c] += row[c];
        for (int32_t m = 0; m < n_max; m++) {
            int32_t c = max_field[m];
            out[c] = !seen[k] || row[c] > out[c] ? row[c] : out[c];
        }
        seen[k] = 1;
    }
    for (int64_t p = 0; p < n_params; p++) {
        int64_t r = param_row[p];
        memcpy(params + p * width, rows + r * width, (size_t)width * sizeof(double));
        scaled[p] = has_scale ? (double)counts[r * counts_stride + scaled_slot] : -1.0;
        double squares = (double)sumsq[r * sumsq_stride];
        /* >= 0: the compiler needs no errno path (no libm); NaN stays NaN, as its root would */
        norms[p] = squares >= 0.0 ? __builtin_sqrt(squares) : squares;
    }
}

/* conditions.update_steps on the CPU: the verdicts' state rows (n rows of ncols float64, the
 * columns at col[] in rule_api.COLUMNS' order: first, last, run_start, best_start, best_last,
 * count, seen, run_len, best_len, sum_value, sum_total, peak) updated by k logged steps in
 * order - cond, value and total are k x n - with the same float64 arithmetic as the torch ops
 * of conditions.update_rows, so the rows are theirs to the bit (NaN values included:
 * torch.maximum propagates NaN, so the peak does here). */
void ampaudit_update_rows(double *rows, int64_t n, int64_t ncols, const int32_t *col, const int64_t *steps,
                          int64_t k, int64_t prev, const unsigned char *cond, const double *value,
                          const double *total) {
    int32_t FIRST = col[0], LAST = col[1], RUN_START = col[2], BEST_START = col[3], BEST_LAST = col[4],
            COUNT = col[5], SEEN = col[6], RUN_LEN = col[7], BEST_LEN = col[8], SUM_VALUE = col[9],
            SUM_TOTAL = col[10], PEAK = col[11];
    for (int64_t s = 0; s < k; s++) {
        double step = (double)steps[s];
        for (int64_t i = 0; i < n; i++) {
            double *r = rows + i * ncols;
            int c = cond[s * n + i] != 0;
            double v = value[s * n + i], t = total[s * n + i];
            int extend = c && r[RUN_LEN] > 0 && r[LAST] == (double)prev;
            double run_len = c ? (extend ? r[RUN_LEN] + 1 : 1.0) : r[RUN_LEN];
            double run_start = c && !extend ? step : r[RUN_START];
            int better = c && run_len > r[BEST_LEN];
            if (c && r[FIRST] < 0) r[FIRST] = step;
            if (c) r[LAST] = step;
            r[RUN_START] = run_start;
            if (better) {
                r[BEST_START] = run_start;
                r[BEST_LAST] = step;
                r[BEST_LEN] = run_len;
            }
            r[COUNT] += c;
            r[SEEN] += 1;
            r[RUN_LEN] = run_len;
            r[SUM_VALUE] += c ? v : 0.0;
            r[SUM_TOTAL] += c ? t : 0.0;
            if (c) r[PEAK] = (r[PEAK] != r[PEAK] || v != v) ? r[PEAK] + v : (v > r[PEAK] ? v : r[PEAK]);
        }
        prev = steps[s];
    }
}

/* How many |x| * scale exceed max, in float32 as torch computes (x as float32, times the scale
 * as float32, compared with max): a parameter gradient's count over the loss scale. */
#define DEFINE_SCALED(NAME, RAW, ABS)                                                   \
    SIMD_CLONES static int64_t NAME(const void *x, int64_t n, float scale, float max) { \
        int64_t count = 0;                                                              \
        for (int64_t i = 0; i < n; i++) count += as_float(ABS(RAW(x, i))) * scale > max; \
        return count;                                                                   \
    }

DEFINE_SCALED(scaled_f32, f32_raw, f32_abs)
DEFINE_SCALED(scaled_f16, h16_raw, f16_abs)
DEFINE_SCALED(scaled_bf16, h16_raw, bf16_abs)

/* The parameter gradients' rows at a step boundary in one call: tensor t (dtype[t]: 0 float32,
 * 1 float16, 2 bfloat16; n[t] elements at x[t]) fills the row whose counts start at counts[t]
 * (the bins, then the count slots: overflow_slot, neginf_slot, scaled_slot) and whose extras
 * at extras[t] (absmax_slot, sumsq_slot) - the row ampaudit_rows_* fills with its sum of
 * squares, and with scale > 0 its count over the loss scale. */
void ampaudit_param_rows(int64_t count, const void *const *x, const int64_t *n, const int32_t *dtype,
                         int64_t *const *counts, float *const *extras, int32_t overflow_slot, int32_t neginf_slot,
                         int32_t scaled_slot, int32_t absmax_slot, int32_t sumsq_slot, uint32_t over_bits,
                         float scale, float max, int threads) {
    for (int64_t t = 0; t < count; t++) {
        int64_t *c = counts[t];
        float *e = extras[t];
        uint32_t *peak = (uint32_t *)(e + absmax_slot);
        if (dtype[t] == 0) {
            ampaudit_rows_f32(x[t], n[t], c, c + overflow_slot, c + neginf_slot, peak, over_bits, e + sumsq_slot, threads);
            if (scale > 0) c[scaled_slot] += scaled_f32(x[t], n[t], scale, max);
        } else if (dtype[t] == 1) {
            ampaudit_rows_f16(x[t], n[t], c, c + overflow_slot, c + neginf_slot, peak, over_bits, e + sumsq_slot, threads);
            if (scale > 0) c[scaled_slot] += scaled_f16(x[t], n[t], scale, max);
        } else {
            ampaudit_rows_bf16(x[t], n[t], c, c + overflow_slot, c + neginf_slot, peak, over_bits, e + sumsq_slot, threads);
            if (scale > 0) c[scaled_slot] += scaled_bf16(x[t], n[t], scale, max);
        }
    }
}
