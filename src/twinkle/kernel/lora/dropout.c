/* LoRA dropout masks from a counter-based hash: element i of a tensor is kept when
 * mix(mix(i ^ k0) + k1) >= drop_below, with (k0, k1) the two halves of a 64-bit seed and mix
 * a 32-bit integer finaliser (two multiply-xorshift rounds). The same seed gives the same mask
 * on any thread count, and dropout.py computes the identical mask with torch ops.
 *
 * The kernels work on vectors of VW floats (one AVX-512 register, or two AVX2 ones) through
 * GCC's vector extensions, and keep their sums in registers: a sum over a row of x needs eight
 * independent accumulators to run at the FMA units' rate rather than at one FMA's latency. No
 * result depends on how rows or columns are split between threads: every sum runs in a fixed
 * order over fixed vector lanes. */
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define VW 16
typedef float vf __attribute__((vector_size(4 * VW)));
typedef uint32_t vu __attribute__((vector_size(4 * VW)));
typedef int32_t vi __attribute__((vector_size(4 * VW)));

/* Rows of A (or columns of the product) handled together; VW-float accumulators per row. */
#define JB 8

/* The finaliser, written once for a word and for a vector of words (the same operations). */
#define MIX(x) ((x) ^= (x) >> 16, (x) *= 0x7feb352dU, (x) ^= (x) >> 15, (x) *= 0x846ca68bU, (x) ^= (x) >> 16)

static inline uint32_t mix(uint32_t x) { return MIX(x); }

static inline vu vmix(vu x) { return MIX(x); }

static inline vf load(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

static inline vu lanes(void) {
    vu v;
    for (int l = 0; l < VW; l++) v[l] = (uint32_t)l;
    return v;
}

/* The factor for elements base .. base + VW - 1: scale where kept, else 0. */
static inline vf vfactor(uint32_t base, vu iota, uint32_t k0, uint32_t k1, uint32_t drop_below,
                         vf vscale) {
    const vu h = vmix(vmix((iota + base) ^ k0) + k1);
    const vi keep = h >= drop_below;
    return (vf)((vu)vscale & (vu)keep);
}

static inline float factor(uint32_t i, uint32_t k0, uint32_t k1, uint32_t drop_below, float scale) {
    return mix(mix(i ^ k0) + k1) >= drop_below ? scale : 0.0f;
}

/* The kept lanes of a keep vector (-1 where kept) as the low VW bits of a word. */
static inline uint32_t keep_bits(vi keep) {
#if defined(__AVX512F__)
    const __m512i k = (__m512i)keep;
    return (uint32_t)_mm512_test_epi32_mask(k, k);
#else
    uint32_t w = 0;
    for (int l = 0; l < VW; l++) w |= (uint32_t)(keep[l] & 1) << l;
    return w;
#endif
}

/* The factor for the VW elements whose keep bits are word: scale where kept, else 0. */
static inline vf bits_factor(uint32_t word, vu lane_bit, vf vscale) {
    const vi keep = (((vu){0} + word) & lane_bit) != 0;
    return (vf)((vu)vscale & (vu)keep);
}

static inline float hsum(vf v) {
    float s = 0.0f;
    for (int l = 0; l < VW; l++) s += v[l];
    return s;
}

/* out[i] = x[i] * scale where kept, else x[i] * 0 (out may be x); n < 2^32 */
void twinkle_dropout_f32(const float *x, float *out, int64_t n, uint64_t seed, uint32_t drop_below,
                         float scale, int threads) {
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    const int64_t blocks = n / VW;
    const vu iota = lanes();
    const vf vscale = (vf){0} + scale;
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 65536)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t i = b * VW;
        store(out + i, load(x + i) * vfactor((uint32_t)i, iota, k0, k1, drop_below, vscale));
    }
    for (int64_t i = blocks * VW; i < n; i++) /* as nn.Dropout: NaN stays NaN */
        out[i] = x[i] * factor((uint32_t)i, k0, k1, drop_below, scale);
}

/* The masked row t of x, x[t, h] * m(t, h), into xm (H floats); where bits is not NULL, the
 * row's keep bits into it, bit l of word b for element b * VW + l (the last word zero-padded). */
static inline void mask_row(const float *xr, float *xm, uint16_t *bits, int64_t H, uint32_t base,
                            vu iota, uint32_t k0, uint32_t k1, uint32_t drop_below, float scale) {
    const vf vscale = (vf){0} + scale;
    int64_t h = 0;
    for (; h + VW <= H; h += VW) {
        const vu hv = vmix(vmix((iota + (base + (uint32_t)h)) ^ k0) + k1);
        const vi keep = hv >= drop_below;
        store(xm + h, load(xr + h) * (vf)((vu)vscale & (vu)keep));
        if (bits) bits[h / VW] = (uint16_t)keep_bits(keep);
    }
    uint32_t word = 0;
    for (int64_t l = 0; h + l < H; l++) {
        const float m = factor(base + (uint32_t)(h + l), k0, k1, drop_below, scale);
        xm[h + l] = xr[h + l] * m;
        word |= (uint32_t)(m != 0.0f) << l;
    }
    if (bits && h < H) bits[h / VW] = (uint16_t)word;
}

/* s0[j] = sum_h a[j, h] * u[h] and s1[j] = sum_h a[j, h] * w[h] for j < nj <= JB: two rows
 * against up to JB rows of a, 2 * JB accumulators. */
static inline void dots(const float *u, const float *w, const float *a, int64_t H, int nj,
                        float *s0, float *s1) {
    vf c0[JB], c1[JB];
    for (int j = 0; j < JB; j++) c0[j] = c1[j] = (vf){0};
    int64_t h = 0;
    if (nj == JB) {
        for (; h + VW <= H; h += VW) {
            const vf x0 = load(u + h), x1 = load(w + h);
            for (int j = 0; j < JB; j++) {
                const vf av = load(a + j * H + h);
                c0[j] += av * x0;
                c1[j] += av * x1;
            }
        }
    } else {
        for (; h + VW <= H; h += VW) {
            const vf x0 = load(u + h), x1 = load(w + h);
            for (int j = 0; j < nj; j++) {
                const vf av = load(a + j * H + h);
                c0[j] += av * x0;
                c1[j] += av * x1;
            }
        }
    }
    for (int j = 0; j < nj; j++) {
        float t0 = hsum(c0[j]), t1 = hsum(c1[j]);
        for (int64_t k = h; k < H; k++) {
            t0 += a[j * H + k] * u[k];
            t1 += a[j * H + k] * w[k];
        }
        s0[j] = t0;
        s1[j] = t1;
    }
}

/* The down products of n adapters that share their input, each through its own mask:
 * low[t, j] = sum_h a[j, h] * x[t, h] * keep_i(t, h) * scale_i for x (T, H) and a (n * R, H),
 * the n adapters' A stacked (rank R each), i = j / R the adapter of row j; low's element (t, j)
 * at low[t * lt + j * lr]. Adapter i's mask comes from seeds[i], drop_below[i] and scales[i].
 * Rows are taken two at a time: each is masked into a scratch row (in L1) and both are
 * multiplied by the adapter's rows of a together, so a's loads serve two rows and the masked x
 * is never written out; the two rows of x stay in L1 for the n masks. Where bits is not NULL,
 * the masks go to it as bits, (n, T, (H + VW - 1) / VW) words (mask_row), for the backward
 * below to read instead of hashing again. Rows are split between threads in pairs. Returns 1
 * without memory. */
int twinkle_lora_masked_down_f32(const float *x, const float *a, float *low, int64_t T, int64_t H,
                                 int64_t R, int64_t lt, int64_t lr, int n, const uint64_t *seeds,
                                 const uint32_t *drop_below, const float *scales, uint16_t *bits,
                                 int threads) {
    const int64_t words = (H + VW - 1) / VW;
    const vu iota = lanes();
    const int64_t pairs = (T + 1) / 2;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *xm = (float *)malloc(sizeof(float) * (size_t)(2 * H));
        if (!xm) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            if (!xm) continue;
            const int64_t t = 2 * p;
            const int two = t + 1 < T;
            for (int i = 0; i < n; i++) {
                const uint32_t k0 = (uint32_t)seeds[i], k1 = (uint32_t)(seeds[i] >> 32);
                uint16_t *rows = bits ? bits + ((int64_t)i * T + t) * words : NULL;
                mask_row(x + t * H, xm, rows, H, (uint32_t)(t * H), iota, k0, k1, drop_below[i],
                         scales[i]);
                if (two)
                    mask_row(x + (t + 1) * H, xm + H, rows ? rows + words : NULL, H,
                             (uint32_t)((t + 1) * H), iota, k0, k1, drop_below[i], scales[i]);
                const float *second = two ? xm + H : xm;
                for (int64_t j0 = i * R; j0 < (i + 1) * R; j0 += JB) {
                    const int nj = (i + 1) * R - j0 < JB ? (int)((i + 1) * R - j0) : JB;
                    float s0[JB], s1[JB];
                    dots(xm, second, a + j0 * H, H, nj, s0, s1);
                    for (int j = 0; j < nj; j++) {
                        low[t * lt + (j0 + j) * lr] = s0[j];
                        if (two) low[(t + 1) * lt + (j0 + j) * lr] = s1[j];
                    }
                }
            }
        }
        free(xm);
    }
    return failed;
}

/* How far ahead in a row the backward prefetches: four blocks. */
#define PREFETCH (4 * VW)

/* Rows t0 .. t1 - 1 of one column block [h, h + VW) of the backward below, for rows j0 ..
 * j0 + nj - 1 of a: A's gradient for the block is read from grad_a, added to in t order and
 * written back. */
static inline void up_grad_block(const float *x, const float *a, const float *g, int64_t gt,
                                 int64_t gr, float *grad_a, float *grad_x, int64_t t0, int64_t t1,
                                 int64_t H, int64_t h, int64_t j0, int nj, uint32_t k0, uint32_t k1,
                                 uint32_t drop_below, vf vscale, vu iota, const uint16_t *bits,
                                 vu lane_bit) {
    const int64_t words = (H + VW - 1) / VW;
    vf ga[JB], av[JB];
    for (int j = 0; j < JB; j++) {
        ga[j] = grad_a && j < nj ? load(grad_a + (j0 + j) * H + h) : (vf){0};
        av[j] = j < nj ? load(a + (j0 + j) * H + h) : (vf){0};
    }
    for (int64_t t = t0; t < t1; t++) {
        /* the row's later blocks: a tile's rows are a page apart, too far for the hardware's
         * prefetcher, and the walk down a block column would wait on each */
        __builtin_prefetch(x + t * H + h + PREFETCH, 0, 3);
        if (grad_x) __builtin_prefetch(grad_x + t * H + h + PREFETCH, 1, 3);
        const vf m = bits ? bits_factor(bits[t * words + h / VW], lane_bit, vscale)
                          : vfactor((uint32_t)(t * H + h), iota, k0, k1, drop_below, vscale);
        const float *gl = g + t * gt + j0 * gr;
        if (grad_a) {
            const vf xm = load(x + t * H + h) * m;
            for (int j = 0; j < nj; j++) ga[j] += gl[j * gr] * xm;
        }
        if (grad_x) {
            vf acc = (vf){0};
            for (int j = 0; j < nj; j++) acc += gl[j * gr] * av[j];
            float *gx = grad_x + t * H + h;
            store(gx, load(gx) + acc * m);
        }
    }
    if (grad_a)
        for (int j = 0; j < nj; j++) store(grad_a + (j0 + j) * H + h, ga[j]);
}

/* The same for one column h < H past the last whole block. */
static void up_grad_column(const float *x, const float *a, const float *g, int64_t gt, int64_t gr,
                           float *grad_a, float *grad_x, int64_t t0, int64_t t1, int64_t H,
                           int64_t h, int64_t R, uint32_t k0, uint32_t k1, uint32_t drop_below,
                           float scale, const uint16_t *bits) {
    const int64_t words = (H + VW - 1) / VW;
    for (int64_t t = t0; t < t1; t++) {
        const float m = bits ? ((bits[t * words + h / VW] >> (h % VW)) & 1 ? scale : 0.0f)
                             : factor((uint32_t)(t * H + h), k0, k1, drop_below, scale);
        const float *gl = g + t * gt;
        if (grad_a) {
            const float xm = x[t * H + h] * m;
            for (int64_t j = 0; j < R; j++) grad_a[j * H + h] += gl[j * gr] * xm;
        }
        if (grad_x) {
            for (int64_t j0 = 0; j0 < R; j0 += JB) { /* grouped as the blocks group them */
                float acc = 0.0f;
                for (int64_t j = j0; j < R && j < j0 + JB; j++) acc += gl[j * gr] * a[j * H + h];
                grad_x[t * H + h] += acc * m;
            }
        }
    }
}

/* Rows per tile of the backward: a tile's rows of x stay in L2 while its column blocks pass. */
#define TT 32

/* Their backward on the adapters' side, in one pass over x: with g_low (T, n * R) the gradient
 * of low (element (t, j) at g[t * gt + j * gr]), grad_a[j, h] = sum_t g_low[t, j] * x[t, h] *
 * m_i(t, h) (written, when grad_a is not NULL) and grad_x[t, h] += sum_i m_i(t, h) * sum_j
 * g_low[t, j] * a[j, h], j over adapter i's rows (added, when grad_x is not NULL), m_i = keep_i
 * * scale_i, the masks read from bits where it is not NULL (as masked_down wrote them) and
 * hashed from the seeds otherwise. Column blocks of VW are split between threads, the last
 * H % VW columns going to the last thread. Each thread walks its columns a tile of rows at a
 * time, holding a block of A and of A's gradient in registers over the tile's rows (the tile's
 * block of x stays in L1 for the n adapters); each sum over t runs in t order and grad_x's
 * additions come in adapter order, so the result does not depend on the thread count. */
int twinkle_lora_masked_up_grad_f32(const float *x, const float *a, const float *g, int64_t gt,
                                    int64_t gr, float *grad_a, float *grad_x, int64_t T, int64_t H,
                                    int64_t R, int n, const uint64_t *seeds,
                                    const uint32_t *drop_below, const float *scales,
                                    const uint16_t *bits, int threads) {
    const vu iota = lanes(), lane_bit = ((vu){0} + 1) << iota;
    const int64_t blocks = H / VW, words = (H + VW - 1) / VW;
#pragma omp parallel num_threads(threads)
    {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t b0 = blocks * id / nt, b1 = blocks * (id + 1) / nt;
        const int64_t h0 = b0 * VW, h1 = id == nt - 1 ? H : b1 * VW;
        if (grad_a)
            for (int64_t j = 0; j < n * R; j++)
                memset(grad_a + j * H + h0, 0, sizeof(float) * (size_t)(h1 - h0));
        for (int64_t t0 = 0; t0 < T; t0 += TT) {
            const int64_t t1 = t0 + TT < T ? t0 + TT : T;
            for (int64_t b = b0; b < b1; b++)
                for (int i = 0; i < n; i++) {
                    const uint32_t k0 = (uint32_t)seeds[i], k1 = (uint32_t)(seeds[i] >> 32);
                    const vf vscale = (vf){0} + scales[i];
                    const uint16_t *own = bits ? bits + (int64_t)i * T * words : NULL;
                    for (int64_t j0 = i * R; j0 < (i + 1) * R; j0 += JB)
                        up_grad_block(x, a, g, gt, gr, grad_a, grad_x, t0, t1, H, b * VW, j0,
                                      (i + 1) * R - j0 < JB ? (int)((i + 1) * R - j0) : JB, k0, k1,
                                      drop_below[i], vscale, iota, own, lane_bit);
                }
            for (int64_t h = b1 * VW; h < h1; h++)
                for (int i = 0; i < n; i++)
                    up_grad_column(x, a + i * R * H, g + i * R * gr, gt, gr,
                                   grad_a ? grad_a + i * R * H : NULL, grad_x, t0, t1, H, h, R,
                                   (uint32_t)seeds[i], (uint32_t)(seeds[i] >> 32), drop_below[i],
                                   scales[i], bits ? bits + (int64_t)i * T * words : NULL);
        }
    }
    return 0;
}
