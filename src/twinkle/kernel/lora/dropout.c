/* LoRA dropout masks from a counter-based hash: element i of a tensor is kept when
 * mix(mix(i ^ k0) + k1) >= drop_below, with (k0, k1) the two halves of a 64-bit seed and mix
 * a 32-bit integer finaliser (two multiply-xorshift rounds). The same seed gives the same mask
 * on any thread count, and dropout.py computes the identical mask with torch ops. */
#include <stdint.h>

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
