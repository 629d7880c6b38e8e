/* Fused single-pass CPU dequantization kernels, bit-exact with gguf-py 0.19 (gguf.quants).
 *
 * One function per GGML type (F32's a copy): llmd_dq_<type>(src, dst, n_blocks, kvalues, stream)
 * reads n_blocks whole blocks of the type (uint8, exactly as stored in the file) and writes
 * n_blocks * block_size float32 values. Each value is produced in one pass, with the float operations
 * of gguf-py's numpy code in its order: every float16 scale widened to float32 first, a sub-block
 * scale one rounded product (d * sc), then one product per value and, for types with a minimum, one
 * add or subtract. The build passes
 * -ffp-contract=off (no fused multiply-add: it would round once where gguf-py rounds twice) and no
 * fast-math flag. Integer work (nibble unpacking, offsets) is exact.
 *
 * Called from Python through ctypes (which releases the GIL): a whole tensor goes to
 * llmd_dq_parallel (_dequant_pool.c), which shares its chunks among threads. Kernels only read `src`
 * (it may be a read-only file mapping). Tables that are format constants (the IQ4 non-linear values) are passed in by the caller
 * from the gguf package rather than copied here. llmd_dq_layout() reports the block and byte sizes
 * these kernels assume, and the loader checks them against gguf's GGML_QUANT_SIZES.
 *
 * The Python module init below exists only so that the shared object can be built and located as an
 * extension module; it exposes no Python functions.
 */
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h> /* every x86-64: non-temporal stores */
#endif

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
/* One clone per ISA level, picked at load time (the default clone runs on any x86-64). */
#define LLMD_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define LLMD_CLONES
#endif

#define QK_K 256

/* float16 (little-endian bytes) -> float32, exactly as numpy widens it: subnormals become normal
 * floats, inf stays inf, a NaN keeps its payload and its quiet bit as it was (a signalling NaN stays
 * signalling; the product with the quant then quiets it, in gguf-py as here). */
static inline float f16_at(const uint8_t *p) {
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    float f;
    if (exp == 0) {
        f = (float)mant * 5.9604644775390625e-8f; /* mant * 2^-24: exact */
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint32_t u32_at(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Q4_K / Q5_K: 6-bit sub-block scale and min number j (0..7) from the 12 packed bytes. */
static inline void scale_min_k4(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 2) & 0x30);
        *m = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
    }
}

/* The block functions are plain loops that GCC vectorizes at -O2 (setup.py; -O3's loop versioning
 * and cost model made several of them 3-8x slower here). Each inner loop has constant shifts and
 * contiguous bytes in and floats out; `restrict` tells the compiler the output never overlaps the
 * input. Integer quants become floats exactly (small integers), so (float)q - 8 style offsets equal
 * gguf-py's int8 arithmetic followed by a conversion. */

/* ------------------------------------------------------------------ legacy types (32 values) */

/* Q8_0: d f16 | qs int8[32];  x = q * d */
static inline void blk_q8_0(const uint8_t *restrict src, float *restrict dst, const float *kv) {
    const float d = f16_at(src);
    const int8_t *q = (const int8_t *)(src + 2);
    for (int i = 0; i < 32; i++) dst[i] = (float)q[i] * d;
}

/* Q4_0: d f16 | qs[16] (value i: low nibble of qs[i], value 16+i: high nibble);  x = d * (q - 8) */
static inline void blk_q4_0(const uint8_t *restrict src, float *restrict dst, const float *kv) {
    const float d = f16_at(src);
    const uint8_t *q = src + 2;
    for (int i = 0; i < 16; i++) dst[i] = d * (float)((int)(q[i] & 0x0f) - 8);
    for (int i = 0; i < 16; i++) dst[i + 16] = d * (float)((int)(q[i] >> 4) - 8);
}

/* Q4_1: d f16 | m f16 | qs[16];  x = d * q + m */
static inline void blk_q4_1(const uint8_t *restrict src, float *restrict dst, const float *kv) {
    const float d = f16_at(src), m = f16_at(src + 2);
    const uint8_t *q = src + 4;
    for (int i = 0; i < 16; i++) dst[i] = d * (float)(q[i] & 0x0f) + m;
    for (int i = 0; i < 16; i++) dst[i + 16] = d * (float)(q[i] >> 4) + m;
}

/* Q5_0: d f16 | qh u32 (bit i: fifth bit of value i) | qs[16] (nibbles as Q4_0);  x = d * (q - 16) */
static inline void blk_q5_0(const uint8_t *restrict src, float *restrict dst, const float *kv) {
    const float d = f16_at(src);
    const uint32_t qh = u32_at(src + 2);
    const uint8_t *q = src + 6;
    for (int i = 0; i < 16; i++) {
        const int lo = (q[i] & 0x0f) | (int)(((qh >> i) & 1u) << 4);
        const int hi = (q[i] >> 4) | (int)(((qh >> (i + 16)) & 1u) << 4);
        dst[i] = d * (float)(lo - 16);
        dst[i + 16] = d * (float)(hi - 16);
    }
}

/* Q5_1: d f16 | m f16 | qh u32 | qs[16];  x = d * q + m */
static inline void blk_q5_1(const uint8_t *restrict src, float *restrict dst, const float *kv) {
    const float d = f16_at(src), m = f16_at(src + 2);
    const uint32_t qh = u32_at(src + 4);
    const uint8_t *q = src + 8;
    for (int i = 0; i < 16; i++) {
        const int lo = (q[i] & 0x0f) | (int)(((qh >> i) & 1u) << 4);
        const int hi = (q[i] >> 4) | (int)(((qh >> (i + 16)) & 1u) << 4);
        dst[i] = d * (float)lo + m;
        dst[i + 16] = d * (float)hi + m;
    }
}

/* IQ4_NL: d f16 | qs[16] (nibbles as Q4_0);  x = d * kvalues[q] */
static inline void blk_iq4_nl(const uint8_t *restrict src, float *restrict dst, const float *kv) {
    const float d = f16_at(src);
    const uint8_t *q = src + 2;
    for (int i = 0; i < 16; i++) dst[i] = d * kv[q[i] & 0x0f];
    for (int i = 0; i < 16; i++) dst[i + 16] = d * kv[q[i] >> 4];
}

/* ------------------------------------------------------------------ K types (256 values) */

/* Q2_K: scales[16] (low nibble scale, high nibble min) | qs[64] | d f16 | dmin f16.
 * Value i = 128a + 32s + l is bits 2s..2s+1 of qs[32a + l], in sub-block j = i / 16;
 * x = (d * sc) * q - (dmin * m). */
static inline void blk_q2_k(const uint8_t *restrict src, float *restrict dst, const float *kv) {
    const uint8_t *scales = src, *qs = src + 16;
    const float d = f16_at(src + 80), dmin = f16_at(src + 82);
    uint8_t v[QK_K];
    for (int a = 0; a < 2; a++) {
        const uint8_t *q = qs + 32 * a;
        uint8_t *o = v + 128 * a;
        for (int l = 0; l < 32; l++) o[l] = q[l] & 3;
        for (int l = 0; l < 32; l++) o[32 + l] = (q[l] >> 2) & 3;
        for (int l = 0; l < 32; l++) o[64 + l] = (q[l] >> 4) & 3;
        for (int l = 0; l < 32; l++) o[96 + l] = q[l] >> 6;
    }
    for (int j = 0; j < 16; j++) {
        const float dl = d * (float)(scales[j] & 0x0f), ml = dmin * (float)(scales[j] >> 4);
        for (int l = 0; l < 16; l++) dst[16 * j + l] = dl * (float)v[16 * j + l] - ml;
    }
}

/* Q3_K: hmask[32] | qs[64] | scales[12] (6-bit, offset 32) | d f16. Value i = 128a + 32s + l:
 * low bits 2s..2s+1 of qs[32a + l], and bit i / 32 of hmask[l], which subtracts 4 when clear; the
 * scale of sub-block j = i / 16 is nibble j / 8 of scales[j % 8] with bits 2(j / 4).. of
 * scales[8 + j % 4] above it; x = (d * sc) * q. */
static inline void blk_q3_k(const uint8_t *restrict src, float *restrict dst, const float *kv) {
    const uint8_t *hmask = src, *qs = src + 32, *sb = src + 96;
    const float d = f16_at(src + 108);
    int8_t v[QK_K];
    for (int a = 0; a < 2; a++) {
        const uint8_t *q = qs + 32 * a;
        int8_t *o = v + 128 * a;
        for (int l = 0; l < 32; l++) o[l] = (int8_t)(q[l] & 3);
        for (int l = 0; l < 32; l++) o[32 + l] = (int8_t)((q[l] >> 2) & 3);
        for (int l = 0; l < 32; l++) o[64 + l] = (int8_t)((q[l] >> 4) & 3);
        for (int l = 0; l < 32; l++) o[96 + l] = (int8_t)(q[l] >> 6);
    }
    for (int g = 0; g < 8; g++) {
        int8_t *o = v + 32 * g;
        for (int l = 0; l < 32; l++) o[l] -= (int8_t)((((hmask[l] >> g) & 1) ^ 1) << 2);
    }
    for (int j = 0; j < 16; j++) {
        const int lo = (sb[j % 8] >> (4 * (j / 8))) & 0x0f;
        const int hi = (sb[8 + j % 4] >> (2 * (j / 4))) & 0x03;
        const float dl = d * (float)((lo | (hi << 4)) - 32);
        for (int l = 0; l < 16; l++) dst[16 * j + l] = dl * (float)v[16 * j + l];
    }
}

/* Q4_K / Q5_K: the scale (d * sc) and min (dmin * m) of each of the 8 sub-blocks, as gguf-py
 * rounds them. */
static inline void k4_scales(const uint8_t *src, float dl[8], float ml[8]) {
    const float d = f16_at(src), dmin = f16_at(src + 2);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        scale_min_k4(src + 4, j, &sc, &m);
        dl[j] = d * (float)sc;
        ml[j] = dmin * (float)m;
    }
}

/* Q4_K: d f16 | dmin f16 | scales[12] | qs[128]. Sub-blocks 2c and 2c + 1 (32 values each) are the
 * low and high nibbles of qs[32c .. 32c + 31]; x = (d * sc) * q - (dmin * m). */
static inline void blk_q4_k(const uint8_t *restrict src, float *restrict dst, const float *kv) {
    float dl[8], ml[8];
    k4_scales(src, dl, ml);
    for (int c = 0; c < 4; c++) {
        const uint8_t *q = src + 16 + 32 * c;
        float *o = dst + 64 * c;
        const float d0 = dl[2 * c], n0 = ml[2 * c], d1 = dl[2 * c + 1], n1 = ml[2 * c + 1];
        for (int l = 0; l < 32; l++) o[l] = d0 * (float)(q[l] & 0x0f) - n0;
        for (int l = 0; l < 32; l++) o[32 + l] = d1 * (float)(q[l] >> 4) - n1;
    }
}

/* Q5_K: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]. As Q4_K, with bit j of qh[l] as the
 * fifth bit of value l of sub-block j. (Kept apart from Q4_K: one function with an optional qh
 * stopped GCC from vectorizing either loop, 0.14 -> 0.56 ns per value.) */
static inline void blk_q5_k(const uint8_t *restrict src, float *restrict dst, const float *kv) {
    const uint8_t *qh = src + 16;
    float dl[8], ml[8];
    k4_scales(src, dl, ml);
    for (int c = 0; c < 4; c++) {
        const uint8_t *q = src + 48 + 32 * c;
        float *o = dst + 64 * c;
        const float d0 = dl[2 * c], n0 = ml[2 * c], d1 = dl[2 * c + 1], n1 = ml[2 * c + 1];
        const int b0 = 2 * c, b1 = 2 * c + 1;
        for (int l = 0; l < 32; l++) o[l] = d0 * (float)((q[l] & 0x0f) | (((qh[l] >> b0) & 1) << 4)) - n0;
        for (int l = 0; l < 32; l++) o[32 + l] = d1 * (float)((q[l] >> 4) | (((qh[l] >> b1) & 1) << 4)) - n1;
    }
}

/* Q6_K: ql[128] | qh[64] | scales int8[16] | d f16. In half a = 0, 1 (128 values, l = 0..31):
 * value 32t + l takes nibble t / 2 of ql[64a + 32(t % 2) + l] and bits 2t..2t+1 of qh[32a + l],
 * offset 32; x = (d * scales[i / 16]) * q. */
static inline void blk_q6_k(const uint8_t *restrict src, float *restrict dst, const float *kv) {
    const uint8_t *ql = src, *qh = src + 128;
    const int8_t *scales = (const int8_t *)(src + 192);
    const float d = f16_at(src + 208);
    int8_t v[QK_K];
    for (int a = 0; a < 2; a++) {
        const uint8_t *lo = ql + 64 * a, *hi = qh + 32 * a;
        int8_t *o = v + 128 * a;
        for (int l = 0; l < 32; l++) o[l] = (int8_t)((lo[l] & 0x0f) | ((hi[l] & 3) << 4)) - 32;
        for (int l = 0; l < 32; l++) o[32 + l] = (int8_t)((lo[32 + l] & 0x0f) | (((hi[l] >> 2) & 3) << 4)) - 32;
        for (int l = 0; l < 32; l++) o[64 + l] = (int8_t)((lo[l] >> 4) | (((hi[l] >> 4) & 3) << 4)) - 32;
        for (int l = 0; l < 32; l++) o[96 + l] = (int8_t)((lo[32 + l] >> 4) | ((hi[l] >> 6) << 4)) - 32;
    }
    for (int j = 0; j < 16; j++) {
        const float dl = d * (float)scales[j];
        for (int l = 0; l < 16; l++) dst[16 * j + l] = dl * (float)v[16 * j + l];
    }
}

/* IQ4_XS: d f16 | scales_h u16 | scales_l[4] | qs[128]. Sub-block j (32 values): 6-bit scale from
 * nibble j % 2 of scales_l[j / 2] and bits 2j..2j+1 of scales_h, offset 32; value p is nibble p / 16
 * of qs[16j + p % 16]; x = (d * sc) * kvalues[q]. */
static inline void blk_iq4_xs(const uint8_t *restrict src, float *restrict dst, const float *kv) {
    const float d = f16_at(src);
    const uint32_t sh = (uint32_t)src[2] | ((uint32_t)src[3] << 8);
    const uint8_t *sl = src + 4, *qs = src + 8;
    for (int j = 0; j < 8; j++) {
        const int lo = (sl[j / 2] >> (4 * (j % 2))) & 0x0f, hi = (sh >> (2 * j)) & 3;
        const float dl = d * (float)((lo | (hi << 4)) - 32);
        const uint8_t *q = qs + 16 * j;
        float *o = dst + 32 * j;
        for (int p = 0; p < 16; p++) o[p] = dl * kv[q[p] & 0x0f];
        for (int p = 0; p < 16; p++) o[p + 16] = dl * kv[q[p] >> 4];
    }
}

/* ------------------------------------------------------------------ drivers */

/* Copy n floats (a multiple of 4) from the aligned tmp to the 16-byte aligned dst with
 * non-temporal stores: the written lines go to memory without first being read into the cache.
 * Unrolled: the loop's own add/compare/branch per 16 bytes made the demo's streamed Q8_0 embedding
 * 18.4-19.2 ms instead of 15.8-16.2 (2 threads, bench/RESULTS.md). */
static inline void stream_copy(float *restrict dst, const float *restrict tmp, int n) {
#if defined(__SSE2__)
#pragma GCC unroll 8
    for (int i = 0; i < n; i += 4) _mm_stream_ps(dst + i, _mm_load_ps(tmp + i));
#else
    memcpy(dst, tmp, (size_t)n * sizeof(float));
#endif
}

static inline void stream_fence(void) {
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* llmd_dq_<name>(src, dst, n_blocks, kvalues, stream): n_blocks blocks of TS bytes -> n_blocks * BS
 * floats. kvalues: the 16 IQ4 values (int8) for the IQ4 types, else NULL. stream != 0 (asked for
 * outputs far larger than the cache, which no reader would find there anyway): each block is decoded
 * into an L1 buffer and streamed out with non-temporal stores, saving the read-for-ownership of
 * every output line. */
#define LLMD_DRIVER(name, TS, BS)                                                                   \
    LLMD_CLONES void llmd_dq_##name(const uint8_t *src, float *dst, int64_t n_blocks,             \
                                    const int8_t *kvalues, int stream) {                          \
        float kv[16] = {0};                                                                       \
        if (kvalues)                                                                              \
            for (int i = 0; i < 16; i++) kv[i] = (float)kvalues[i];                               \
        if (!stream || ((uintptr_t)dst & 15u)) {                                                  \
            for (int64_t b = 0; b < n_blocks; b++) blk_##name(src + b * TS, dst + b * BS, kv);    \
            return;                                                                               \
        }                                                                                         \
        float tmp[BS] __attribute__((aligned(64)));                                               \
        for (int64_t b = 0; b < n_blocks; b++) {                                                  \
            blk_##name(src + b * TS, tmp, kv);                                                    \
            stream_copy(dst + b * BS, tmp, BS);                                                   \
        }                                                                                         \
        stream_fence();                                                                           \
    }

LLMD_DRIVER(q8_0, 34, 32)
LLMD_DRIVER(q4_0, 18, 32)
LLMD_DRIVER(q4_1, 20, 32)
LLMD_DRIVER(q5_0, 22, 32)
LLMD_DRIVER(q5_1, 24, 32)
LLMD_DRIVER(iq4_nl, 18, 32)
LLMD_DRIVER(q2_k, 84, 256)
LLMD_DRIVER(q3_k, 110, 256)
LLMD_DRIVER(q4_k, 144, 256)
LLMD_DRIVER(q5_k, 176, 256)
LLMD_DRIVER(q6_k, 210, 256)
LLMD_DRIVER(iq4_xs, 136, 256)

/* F32: the stored bytes, copied (every bit kept, NaN payloads included, as the torch kernel's byte
 * copy does). A native kernel so that the demo's 109 small norm vectors take the one-ctypes-call
 * path instead of torch ops (17.7 -> 11.4 us a call, bench/RESULTS.md); huge outputs are
 * streamed like the other types' (the source may have any alignment). */
void llmd_dq_f32(const uint8_t *src, float *dst, int64_t n_blocks, const int8_t *kvalues, int stream) {
    (void)kvalues;
#if defined(__SSE2__)
    if (stream && !((uintptr_t)dst & 15u)) {
        const int64_t n4 = n_blocks & ~(int64_t)3;
        for (int64_t i = 0; i < n4; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps((const float *)(src + 4 * i)));
        memcpy(dst + n4, src + 4 * n4, (size_t)(n_blocks - n4) * 4);
        stream_fence();
        return;
    }
#endif
    memcpy(dst, src, (size_t)n_blocks * 4);
}

/* The calling convention of the exported functions (their arguments, and llmd_dq_parallel's in
 * _dequant_pool.c); bumped with every change, so that a stale build is refused, not misread. */
int llmd_dq_abi(void) { return 4; }

/* The layouts assumed above, for the loader to check against gguf's GGML_QUANT_SIZES:
 * "name:block_size:type_size" separated by spaces. */
const char *llmd_dq_layout(void) {
    return "F32:1:4 Q8_0:32:34 Q4_0:32:18 Q4_1:32:20 Q5_0:32:22 Q5_1:32:24 IQ4_NL:32:18 "
           "Q2_K:256:84 Q3_K:256:110 Q4_K:256:144 Q5_K:256:176 Q6_K:256:210 IQ4_XS:256:136";
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_dequant_native",
                                    "Native dequantization kernels (called through ctypes).", -1, NULL};

PyMODINIT_FUNC PyInit__dequant_native(void) { return PyModule_Create(&module); }
