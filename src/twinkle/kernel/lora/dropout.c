/* LoRA dropout masks from a counter-based hash: element i of a tensor is kept when
 * mix(mix(i ^ k0) + k1) >= drop_below, with (k0, k1) the two halves of a 64-bit seed and mix
 * a 32-bit integer finaliser (two multiply-xorshift rounds). The same seed gives the same mask
 * on any thread count, and dropout.py computes the identical mask with torch ops. */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

static inline uint32_t mix(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352dU;
    x ^= x >> 15;
    x *= 0x846ca68bU;
    x ^= x >> 16;
    return x;
}

/* out[i] = x[i] * scale where kept, else x[i] * 0 (out may be x); n < 2^32 */
void twinkle_dropout_f32(const float *x, float *out, int64_t n, uint64_t seed, uint32_t drop_below,
                         float scale, int threads) {
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
#pragma omp parallel for num_threads(threads) schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) {
        const uint32_t h = mix(mix((uint32_t)i ^ k0) + k1);
        out[i] = x[i] * (h >= drop_below ? scale : 0.0f); /* as nn.Dropout: NaN stays NaN */
    }
}

/* An adapter's down product through its mask: low[t, j] = sum_h a[j, h] * x[t, h] * keep(t, h)
 * * scale, for x (T, H), a (R, H); low's element (t, j) at low[t * lt + j * lr]. Each row is
 * masked into a scratch row once and multiplied by the R rows of a (in cache), so neither the
 * masked x nor its mask is ever written out. Rows are split between threads; each sum runs
 * in h order, so the result does not depend on the thread count. Returns 1 without memory. */
int twinkle_lora_masked_down_f32(const float *x, const float *a, float *low, int64_t T, int64_t H,
                                 int64_t R, int64_t lt, int64_t lr, uint64_t seed,
                                 uint32_t drop_below, float scale, int threads) {
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *xm = (float *)malloc(sizeof(float) * (size_t)H);
        if (!xm) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (!xm) continue;
            const float *xr = x + t * H;
            const uint32_t base = (uint32_t)(t * H);
            for (int64_t h = 0; h < H; h++) {
                const uint32_t k = mix(mix((base + (uint32_t)h) ^ k0) + k1);
                xm[h] = xr[h] * (k >= drop_below ? scale : 0.0f);
            }
            for (int64_t j = 0; j < R; j++) {
                const float *ar = a + j * H;
                float s = 0.0f;
                for (int64_t h = 0; h < H; h++) s += ar[h] * xm[h];
                low[t * lt + j * lr] = s;
            }
        }
        free(xm);
    }
    return failed;
}

/* Its backward on the adapter's side, in one pass over x: with g_low (T, R) the gradient of low
 * (element (t, j) at g[t * gt + j * gr]), grad_a[j, h] = sum_t g_low[t, j] * x[t, h] * m(t, h)
 * (written, when grad_a is not NULL) and grad_x[t, h] += m(t, h) * sum_j g_low[t, j] * a[j, h]
 * (added, when grad_x is not NULL), m = keep * scale. Columns are split between threads, and
 * each column's sum over t runs in t order: the result does not depend on the thread count. */
int twinkle_lora_masked_up_grad_f32(const float *x, const float *a, const float *g, int64_t gt,
                                    int64_t gr, float *grad_a, float *grad_x, int64_t T, int64_t H,
                                    int64_t R, uint64_t seed, uint32_t drop_below, float scale,
                                    int threads) {
    const uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        const int n = omp_get_num_threads(), id = omp_get_thread_num();
        const int64_t blocks = (H + 15) / 16;
        const int64_t h0 = (blocks * id / n) * 16, h1 = (blocks * (id + 1) / n) * 16 < H ? (blocks * (id + 1) / n) * 16 : H;
        const int64_t w = h1 - h0;
        float *buf = (float *)malloc(sizeof(float) * (size_t)(3 * (w > 0 ? w : 1) + R));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        } else if (w > 0) {
            float *mk = buf, *xm = buf + w, *acc = buf + 2 * w, *gl = buf + 3 * w;
            if (grad_a)
                for (int64_t j = 0; j < R; j++)
                    for (int64_t h = 0; h < w; h++) grad_a[j * H + h0 + h] = 0.0f;
            for (int64_t t = 0; t < T; t++) {
                const uint32_t base = (uint32_t)(t * H + h0);
                for (int64_t h = 0; h < w; h++) {
                    const uint32_t k = mix(mix((base + (uint32_t)h) ^ k0) + k1);
                    mk[h] = k >= drop_below ? scale : 0.0f;
                }
                for (int64_t j = 0; j < R; j++) gl[j] = g[t * gt + j * gr];
                if (grad_a) {
                    const float *xr = x + t * H + h0;
                    for (int64_t h = 0; h < w; h++) xm[h] = xr[h] * mk[h];
                    for (int64_t j = 0; j < R; j++) {
                        const float gj = gl[j];
                        float *ga = grad_a + j * H + h0;
                        for (int64_t h = 0; h < w; h++) ga[h] += gj * xm[h];
                    }
                }
                if (grad_x) {
                    for (int64_t h = 0; h < w; h++) acc[h] = 0.0f;
                    for (int64_t j = 0; j < R; j++) {
                        const float gj = gl[j];
                        const float *ar = a + j * H + h0;
                        for (int64_t h = 0; h < w; h++) acc[h] += gj * ar[h];
                    }
                    float *gx = grad_x + t * H + h0;
                    for (int64_t h = 0; h < w; h++) gx[h] += acc[h] * mk[h];
                }
            }
        }
        free(buf);
    }
    return failed;
}
