/* The work of a decoding step between its products, for Llama-family layers: one new position per
 * row. Written out as torch ops it is about forty small calls a layer (the norm's seven, the
 * rotation's dozen, the cache write, the attention, the adds), each costing more to dispatch
 * than to compute; here it is three calls a layer.
 *
 *   twinkle_add_rms_norm     hidden += add (optional), out = hidden / rms(hidden) * weight
 *   twinkle_decode_attention the rotary embedding of q and k, k and v written into the cache at
 *                            position `length`, softmax(q k^T * scale) v over positions 0..length
 *   twinkle_silu_mul         gate = silu(gate) * up
 *
 * Every sum runs in a fixed order on one thread, so no result depends on the thread count. */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

/* e^x for x in [-87, 88] (clamped there) within 2 ulp: 2^n e^r with n = round(x / ln 2),
 * r = x - n ln 2 (ln 2 in two parts) and Cephes' degree-7 polynomial for e^r. Written out
 * because libm's expf is a call per element, which keeps the loops around it scalar. */
static inline float exp_clamped(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x); /* (fminf, rintf: the loops stay scalar) */
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float e = p * r * r + r + 1.0f;
    union {
        int32_t bits;
        float value;
    } scale = {((int32_t)n + 127) << 23};
    return e * scale.value;
}

/* HF's LlamaRMSNorm in fp32: x * (mean(x^2) + eps)^-1/2, times the weight */
void twinkle_add_rms_norm(float *hidden, const float *add, const float *weight, float eps, float *out,
                          int rows, long dim) {
    for (int r = 0; r < rows; r++) {
        float *h = hidden + r * dim;
        if (add)
            for (long i = 0; i < dim; i++) h[i] += add[r * dim + i];
        float ss = 0.f;
        for (long i = 0; i < dim; i++) ss += h[i] * h[i];
        float inv = 1.f / sqrtf(ss / (float)dim + eps);
        for (long i = 0; i < dim; i++) out[r * dim + i] = weight[i] * (h[i] * inv);
    }
}

static void silu_mul(float *restrict gate, const float *restrict up, long from, long to) {
    for (long i = from; i < to; i++) {
        float g = gate[i];
        gate[i] = g / (1.f + exp_clamped(-g)) * up[i];
    }
}

#define SILU_CHUNK 8192L /* elements per thread's share, so small gates stay on one thread */

void twinkle_silu_mul(float *gate, const float *up, long n, int threads) {
    long chunks = (n + SILU_CHUNK - 1) / SILU_CHUNK;
#pragma omp parallel for num_threads(threads) schedule(static) if (chunks > 1)
    for (long c = 0; c < chunks; c++) silu_mul(gate, up, c * SILU_CHUNK, c + 1 < chunks ? (c + 1) * SILU_CHUNK : n);
}

/* HF's apply_rotary_pos_emb for one head: x * cos + rotate_half(x) * sin, rotate_half(x) being
 * (-x[half:], x[:half]) */
static void rotate(const float *x, const float *cos, const float *sin, int dim, float *out) {
    int half = dim / 2;
    for (int i = 0; i < half; i++) {
        out[i] = x[i] * cos[i] - x[i + half] * sin[i];
        out[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
    }
}

/* q (rows, heads, dim), k and v (rows, kv_heads, dim): this position's projections. cos, sin
 * (rows, dim). keys, values (rows, kv_heads, capacity, dim): the cache, positions < length
 * filled. mask (rows, length + 1) int64, 0 where a position is hidden, or NULL. out (rows, heads,
 * dim). Returns -1 when scratch memory cannot be had (nothing is written). */
int twinkle_decode_attention(const float *q, const float *k, const float *v, const float *cos,
                             const float *sin, float *keys, float *values, const long long *mask,
                             float *out, int rows, int heads, int kv_heads, int dim, long length,
                             long capacity, float scale, int threads) {
    int group = heads / kv_heads, tasks = rows * kv_heads, failed = 0;
    long seen = length + 1;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (seen + 2 * dim));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
            float *query = scores + seen, *acc = query + dim;
#pragma omp for schedule(static)
            for (int t = 0; t < tasks; t++) {
                int r = t / kv_heads, g = t % kv_heads;
                const float *c = cos + (long)r * dim, *s = sin + (long)r * dim;
                float *kc = keys + ((long)r * kv_heads + g) * capacity * dim;
                float *vc = values + ((long)r * kv_heads + g) * capacity * dim;
                rotate(k + ((long)r * kv_heads + g) * dim, c, s, dim, kc + length * dim);
                const float *vn = v + ((long)r * kv_heads + g) * dim;
                for (int i = 0; i < dim; i++) vc[length * dim + i] = vn[i];
                const long long *m = mask ? mask + (long)r * seen : NULL;
                for (int h = g * group; h < (g + 1) * group; h++) {
                    rotate(q + ((long)r * heads + h) * dim, c, s, dim, query);
                    float top = -INFINITY;
                    for (long p = 0; p < seen; p++) {
                        const float *kp = kc + p * dim;
                        float dot = 0.f;
                        for (int i = 0; i < dim; i++) dot += query[i] * kp[i];
                        scores[p] = dot * scale;
                        if ((!m || m[p]) && scores[p] > top) top = scores[p];
                    }
                    float total = 0.f;
#pragma omp simd reduction(+ : total)
                    for (long p = 0; p < seen; p++) {
                        float e = (!m || m[p]) ? exp_clamped(scores[p] - top) : 0.f;
                        scores[p] = e;
                        total += e;
                    }
                    for (int i = 0; i < dim; i++) acc[i] = 0.f;
                    for (long p = 0; p < seen; p++) {
                        const float *vp = vc + p * dim;
                        float e = scores[p];
                        for (int i = 0; i < dim; i++) acc[i] += e * vp[i];
                    }
                    float *o = out + ((long)r * heads + h) * dim;
                    for (int i = 0; i < dim; i++) o[i] = acc[i] / total;
                }
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
