/* A logged step's Stats rows as the text of its log line (log_text.py; the rows and the log
 * row's format: layout.py, stats_merge.LOG_ROW, decode.log_rows), in one pass: Python's JSON
 * encoder spends about 60 ns on each of a step's thousands of counts, and the dicts and lists
 * it encodes cost as much again to build.
 *
 * Row order[i] (float64, `width` apart) is written after text i (texts[text_at[i]] up to
 * texts[text_at[i + 1]]); text n follows the last. A row is "[" its `hist` fields - counts as
 * integers, a magnitude field (magnitude[f] != 0) as the next of `floats`, a JSON array of
 * `size` bytes that Python's json wrote ("[1.5, Infinity, ...]": no number's text holds a
 * comma) -,
 * its first nonzero exponent - 127 of the `exponents` after the fields (-127: none), and its
 * counts from there to its last nonzero one, ", " between them, "]". A count is a float64
 * holding an integer: written as torch's .to(int64) reads it.
 */
#include <stdint.h>
#include <string.h>

static char *put_text(char *o, const char *s, int64_t n) {
    memcpy(o, s, (size_t)n);
    return o + n;
}

static char *put_int(char *o, int64_t v) {
    char digits[24];
    int n = 0;
    uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    do {
        digits[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0) *o++ = '-';
    while (n) *o++ = digits[--n];
    return o;
}

/* The bytes written, or -1 where `cap` would not hold them. */
int64_t ampaudit_log_rows(const double *rows, int64_t width, int64_t n, const int64_t *order, int32_t hist,
                          int32_t exponents, const unsigned char *magnitude, const char *texts,
                          const int64_t *text_at, const char *floats, int64_t size, char *out,
                          int64_t cap) {
    /* the most a row can take: a sign and 19 digits, and ", ", per number */
    const int64_t row_max = 2 + (int64_t)(hist + 1 + exponents) * 22;
    char *o = out, *end = out + cap;
    const char *f = floats + 1, *floats_end = floats + size - 1; /* the next float's text; the "]" */
    for (int64_t i = 0; i <= n; i++) {
        int64_t text = text_at[i + 1] - text_at[i];
        if (end - o < text) return -1;
        o = put_text(o, texts + text_at[i], text);
        if (i == n) break;
        const double *row = rows + order[i] * width;
        if (end - o < row_max + (floats_end - f)) return -1;
        *o++ = '[';
        for (int32_t k = 0; k < hist; k++) {
            if (k) o = put_text(o, ", ", 2);
            if (magnitude[k]) {
                const char *stop = f;
                while (stop < floats_end && *stop != ',') stop++;
                o = put_text(o, f, stop - f);
                f = stop < floats_end ? stop + 2 : stop; /* past ", " */
            } else {
                o = put_int(o, (int64_t)row[k]);
            }
        }
        const double *counts = row + hist;
        int32_t lo = 0, hi = exponents; /* the run of counts: [lo, hi) */
        while (lo < exponents && counts[lo] == 0) lo++;
        while (hi > lo && counts[hi - 1] == 0) hi--;
        o = put_text(o, ", ", 2);
        o = put_int(o, lo < hi ? lo - 127 : -127);
        for (int32_t e = lo; e < hi; e++) {
            o = put_text(o, ", ", 2);
            o = put_int(o, (int64_t)counts[e]);
        }
        *o++ = ']';
    }
    return o - out;
}
