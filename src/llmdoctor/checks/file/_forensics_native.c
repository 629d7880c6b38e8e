/* The forensics accumulator's two passes over a chunk of float32 values (checks/file/weight_moments.py
 * calls them through ctypes; the torch passes there compute the same quantities where this is not built).
 *
 * Summation order, fixed: each row of ROW consecutive values is summed in LANES float32 lane
 * accumulators (lane j takes values j, j + LANES, ...), the lanes are added in order 0..LANES-1 in
 * float32, and the row sums are added in order in float64. The lanes are plain arrays, so a
 * vectorizing compiler maps them onto SIMD registers without reordering any addition: every build
 * (and both ISA clones below) gives the same bits. -ffp-contract=off (setup.py) keeps each product
 * rounded on its own, as the rounding bound in weight_moments.py assumes.
 *
 * The Python module init below exists only so that the shared object can be built and located as an
 * extension module; it exposes no Python functions.
 */
#include <Python.h>
#include <math.h>
#include <stdint.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define LLMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define LLMD_CLONES
#endif

#define ROW 1024
#define LANES 16

/* x [n] -> out[0] min, out[1] max, out[2] sum (the order above), out[3] 1 if any value is inf or NaN
 * (then min, max and sum are meaningless). */
LLMD_CLONES void llmd_fx_scan(const float *x, int64_t n, double *out) {
    float mn[LANES], mx[LANES], bad[LANES];
    double total = 0.0;
    for (int j = 0; j < LANES; j++) { mn[j] = INFINITY; mx[j] = -INFINITY; bad[j] = 0.0f; }
    for (int64_t r = 0; r < n; r += ROW) {
        int64_t m = n - r < ROW ? n - r : ROW;
        float s[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= m; i += LANES) {
            for (int j = 0; j < LANES; j++) {
                float a = x[r + i + j];
                s[j] += a;
                mn[j] = a < mn[j] ? a : mn[j];
                mx[j] = a > mx[j] ? a : mx[j];
                bad[j] += a - a; /* 0 for a finite value, NaN for inf or NaN */
            }
        }
        for (int j = 0; i < m; i++, j++) { /* the row's tail, lane by lane */
            float a = x[r + i];
            s[j] += a;
            mn[j] = a < mn[j] ? a : mn[j];
            mx[j] = a > mx[j] ? a : mx[j];
            bad[j] += a - a;
        }
        float row = 0.0f;
        for (int j = 0; j < LANES; j++) row += s[j];
        total += (double)row;
    }
    float lo = INFINITY, hi = -INFINITY, b = 0.0f;
    for (int j = 0; j < LANES; j++) { lo = mn[j] < lo ? mn[j] : lo; hi = mx[j] > hi ? mx[j] : hi; b += bad[j]; }
    out[0] = lo; out[1] = hi; out[2] = total; out[3] = b == 0.0f ? 0.0 : 1.0;
}

/* x [n] (finite), c -> out[0..2] = sums of d^2, d^3, d^4 with d = x - c (each product rounded in float32),
 * in the order above. */
LLMD_CLONES void llmd_fx_central(const float *x, int64_t n, float c, double *out) {
    double t2 = 0.0, t3 = 0.0, t4 = 0.0;
    for (int64_t r = 0; r < n; r += ROW) {
        int64_t m = n - r < ROW ? n - r : ROW;
        float s2[LANES] = {0}, s3[LANES] = {0}, s4[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= m; i += LANES) {
            for (int j = 0; j < LANES; j++) {
                float d = x[r + i + j] - c;
                float d2 = d * d;
                s2[j] += d2;
                s3[j] += d2 * d;
                s4[j] += d2 * d2;
            }
        }
        for (int j = 0; i < m; i++, j++) {
            float d = x[r + i] - c;
            float d2 = d * d;
            s2[j] += d2;
            s3[j] += d2 * d;
            s4[j] += d2 * d2;
        }
        float a2 = 0.0f, a3 = 0.0f, a4 = 0.0f;
        for (int j = 0; j < LANES; j++) { a2 += s2[j]; a3 += s3[j]; a4 += s4[j]; }
        t2 += (double)a2; t3 += (double)a3; t4 += (double)a4;
    }
    out[0] = t2; out[1] = t3; out[2] = t4;
}

/* The float16 scale field of n consecutive blocks (at base + i * stride, little-endian): counts[code]
 * += 1 for each, and the jumps between adjacent blocks' log2 |scale|, lg[code] (NaN where the scale is
 * zero or not finite): state[0] is the previous block's lg (carried from the last chunk), state[1]
 * the sum of |lg_i - lg_i-1| over adjacent pairs both finite, added in block order in float64,
 * state[2] their number. */
void llmd_fx_codes16(const uint8_t *base, int64_t n, int64_t stride, const double *lg, int64_t *counts,
                     double *state) {
    double last = state[0], sum = state[1], jumps = state[2];
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *p = base + i * stride;
        uint16_t code = (uint16_t)(p[0] | (p[1] << 8));
        double g = lg[code];
        counts[code] += 1;
        double step = g - last;
        if (step == step) { /* both finite (NaN propagates) */
            sum += step < 0 ? -step : step;
            jumps += 1.0;
        }
        last = g;
    }
    state[0] = last; state[1] = sum; state[2] = jumps;
}

/* The sub-block codes of n K-quant blocks (block i's packed codes at base + i * stride), in the packing
 * of `kind`: 2 Q2_K, 3 Q3_K, 4 Q4_K and Q5_K, 6 Q6_K (checks/file/subblock_codes.py's SUBBLOCKS
 * and gguf/block_layout.py's subblock_codes say where they sit and what they mean; this is the same unpacking). For family f (0 the
 * scales, 1 the mins of kinds 2 and 4) of each block: zero[f] += 1 where its codes are all zero, else
 * hist[f * 256 + e] += 1 with e the block's largest code (kinds 2, 4) or smallest (3, 6), as an index
 * (Q6_K's signed bytes + 128); and where pinned[f * 256 + e] is 0 and first[f] is -1, first[f] = i.
 * One loop per packing, so that each is a straight run of byte operations. */
#define LLMD_FX_TALLY(f, e, any, i)                                                           \
    do {                                                                                      \
        if (any) {                                                                            \
            hist[(f) * 256 + (e)] += 1;                                                       \
            if (!pinned[(f) * 256 + (e)] && first[f] < 0) first[f] = (i);                     \
        } else {                                                                              \
            zero[f] += 1;                                                                     \
        }                                                                                     \
    } while (0)

LLMD_CLONES void llmd_fx_subblocks(const uint8_t *base, int64_t n, int64_t stride, int kind, const uint8_t *pinned,
                       int64_t *hist, int64_t *zero, int64_t *first) {
    if (kind == 2) { /* max of the low nibbles (scales) and of the high nibbles (mins) */
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *p = base + i * stride;
            int s = 0, m = 0;
            for (int j = 0; j < 16; j++) {
                int a = p[j] & 15, b = p[j] >> 4;
                s = a > s ? a : s;
                m = b > m ? b : m;
            }
            LLMD_FX_TALLY(0, s, s != 0, i);
            LLMD_FX_TALLY(1, m, m != 0, i);
        }
    } else if (kind == 4) { /* max of the 6-bit scales and of the 6-bit mins */
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *p = base + i * stride;
            int s = 0, m = 0;
            for (int j = 0; j < 4; j++) {
                int a = p[j] & 63, b = p[j + 4] & 63;
                int c = (p[j + 8] & 15) | ((p[j] >> 6) << 4), d = (p[j + 8] >> 4) | ((p[j + 4] >> 6) << 4);
                a = a > c ? a : c;
                b = b > d ? b : d;
                s = a > s ? a : s;
                m = b > m ? b : m;
            }
            LLMD_FX_TALLY(0, s, s != 0, i);
            LLMD_FX_TALLY(1, m, m != 0, i);
        }
    } else if (kind == 3) { /* min of the 6-bit codes (stored with +32) */
        for (int64_t i = 0; i < n; i++) {
            const uint8_t *p = base + i * stride;
            int s = 63, any = 0;
            for (int j = 0; j < 8; j++) {
                int h = p[8 + j % 4] >> (2 * (j / 4)); /* code j's high bits, and code j + 8's at +4 */
                int a = (p[j] & 15) | ((h & 3) << 4), b = (p[j] >> 4) | (((h >> 4) & 3) << 4);
                a = a < b ? a : b;
                s = a < s ? a : s;
                any |= p[j] | p[8 + j % 4];
            }
            LLMD_FX_TALLY(0, s, any != 0, i);
        }
    } else { /* 6: min of the signed bytes */
        for (int64_t i = 0; i < n; i++) {
            const int8_t *p = (const int8_t *)(base + i * stride);
            int s = 127, any = 0;
            for (int j = 0; j < 16; j++) {
                s = p[j] < s ? p[j] : s;
                any |= p[j];
            }
            LLMD_FX_TALLY(0, s + 128, any != 0, i);
        }
    }
}

/* llmd_fx_codes16 piece by piece over n blocks, piece_blocks at a time (the last piece may be shorter),
 * each piece's jumps counted from its own first block: out[4 p ..] = lg of piece p's first block, of
 * its last, the sum of |jumps| inside it and their number; counts as llmd_fx_codes16. block_scales.py
 * folds the pieces in order (ScaleStats.jitter), so one call per chunk gives what a call per piece does. */
void llmd_fx_codes16_pieces(const uint8_t *base, int64_t n, int64_t stride, const double *lg, int64_t *counts,
                            int64_t piece_blocks, double *out) {
    for (int64_t p = 0, b = 0; b < n; p++, b += piece_blocks) {
        int64_t nb = n - b < piece_blocks ? n - b : piece_blocks;
        const uint8_t *q = base + b * stride;
        double st[3] = {NAN, 0.0, 0.0};
        llmd_fx_codes16(q, nb, stride, lg, counts, st);
        out[4 * p] = lg[(uint16_t)(q[0] | (q[1] << 8))];
        out[4 * p + 1] = st[0];
        out[4 * p + 2] = st[1];
        out[4 * p + 3] = st[2];
    }
}

/* A dequantization kernel of gguf/_dequant_native.c: n_blocks blocks at src -> float32 at dst. */
typedef void (*llmd_fx_decoder)(const uint8_t *src, float *dst, int64_t n_blocks, const int8_t *kv, int stream);

/* A chunk of n_blocks blocks, piece by piece (piece_blocks at a time, the last maybe fewer): each piece
 * decoded by `decode` (with its table kv) into out (float32 [piece_blocks * block_size]), then scanned
 * (llmd_fx_scan) while it is in the cache, and where every value is finite and max |w| is 0 or lies in
 * [safe_lo, safe_hi], its sums about c = (float)(sum / n) taken (llmd_fx_central), as the accumulator's
 * per-piece path does (weight_moments.py: Moments.of). res[7 p ..] for piece p: min, max, sum, 1 if a value
 * is inf or NaN, then s2, s3, s4 (NaN where not taken: the caller does that piece its own way). One
 * call per chunk, so that verify's workers cross the GIL once per chunk, not several times per piece. */
void llmd_fx_pieces(llmd_fx_decoder decode, const int8_t *kv, const uint8_t *src, int64_t n_blocks,
                    int64_t type_size, int64_t block_size, int64_t piece_blocks, float *out, double safe_lo,
                    double safe_hi, double *res) {
    for (int64_t p = 0, b = 0; b < n_blocks; p++, b += piece_blocks) {
        int64_t nb = n_blocks - b < piece_blocks ? n_blocks - b : piece_blocks;
        int64_t n = nb * block_size;
        double *r = res + 7 * p;
        decode(src + b * type_size, out, nb, kv, 0);
        llmd_fx_scan(out, n, r);
        r[4] = r[5] = r[6] = NAN;
        if (r[3] == 0.0) {
            double m = -r[0] > r[1] ? -r[0] : r[1];
            if (m == 0.0 || (m >= safe_lo && m <= safe_hi)) llmd_fx_central(out, n, (float)(r[2] / (double)n), r + 4);
        }
    }
}

/* Bumped with every change of the functions above, so that a stale build is refused. */
int llmd_fx_abi(void) { return 4; }

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_forensics_native",
                                    "Forensics' moment passes (called through ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__forensics_native(void) { return PyModule_Create(&module); }
