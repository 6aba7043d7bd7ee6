/* A decoding step's products: y = x @ w.T (+ b) for a few rows of x (at most MAX_ROWS), w dense
 * row-major (n, k) fp32. Such a product reads every weight once and does little arithmetic on
 * it, so it runs at the rate the weights stream from memory: each thread takes a contiguous
 * run of w's rows, reads each once, and multiplies it by every row of x (which stays in L1).
 *
 * Vectors of 8 floats through GCC's vector extensions (one AVX2 register, half an AVX-512 one,
 * two NEON ones). One row of x: four weight rows at a time, one accumulator each, so four
 * independent FMA chains hide the FMA latency. Several rows of x: one weight row at a time, one
 * accumulator per row of x. Every output is one thread's sum over fixed vector lanes in a fixed
 * order, then the lanes, then the tail of k past the last multiple of 8: the result does not
 * depend on the thread count. */
#include <omp.h>

#define MAX_ROWS 8
typedef float v8 __attribute__((vector_size(32), aligned(4)));
#define LOAD(p) (*(const v8 *)(p))

static inline float lanes(v8 v) {
    float s = 0.f;
    for (int i = 0; i < 8; i++) s += v[i];
    return s;
}

static inline float tail(const float *x, const float *w, long from, long k) {
    float s = 0.f;
    for (long i = from; i < k; i++) s += x[i] * w[i];
    return s;
}

/* four outputs j..j+3 for one row of x */
static inline void four(const float *x, const float *w, long k, long k8, float *y) {
    const float *w0 = w, *w1 = w + k, *w2 = w + 2 * k, *w3 = w + 3 * k;
    v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (long i = 0; i < k8; i += 8) {
        v8 xv = LOAD(x + i);
        a0 += LOAD(w0 + i) * xv;
        a1 += LOAD(w1 + i) * xv;
        a2 += LOAD(w2 + i) * xv;
        a3 += LOAD(w3 + i) * xv;
    }
    y[0] = lanes(a0) + tail(x, w0, k8, k);
    y[1] = lanes(a1) + tail(x, w1, k8, k);
    y[2] = lanes(a2) + tail(x, w2, k8, k);
    y[3] = lanes(a3) + tail(x, w3, k8, k);
}

/* output j for R rows of x (R a constant in each copy, so the accumulators stay in registers) */
#define ROWS(R)                                                                                   \
    static inline void rows##R(const float *x, const float *wj, long k, long k8, long n, float *y) { \
        v8 a[R];                                                                                  \
        for (int r = 0; r < R; r++) a[r] = (v8){0};                                               \
        for (long i = 0; i < k8; i += 8) {                                                        \
            v8 wv = LOAD(wj + i);                                                                 \
            for (int r = 0; r < R; r++) a[r] += wv * LOAD(x + r * k + i);                         \
        }                                                                                         \
        for (int r = 0; r < R; r++) y[r * n] = lanes(a[r]) + tail(x + r * k, wj, k8, k);          \
    }
ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)

static void output(int rows, const float *x, const float *wj, long k, long k8, long n, float *y) {
    switch (rows) {
    case 1: rows1(x, wj, k, k8, n, y); break;
    case 2: rows2(x, wj, k, k8, n, y); break;
    case 3: rows3(x, wj, k, k8, n, y); break;
    case 4: rows4(x, wj, k, k8, n, y); break;
    case 5: rows5(x, wj, k, k8, n, y); break;
    case 6: rows6(x, wj, k, k8, n, y); break;
    case 7: rows7(x, wj, k, k8, n, y); break;
    default: rows8(x, wj, k, k8, n, y); break;
    }
}

/* x (rows, k), w (n, k), bias (n) or NULL, y (rows, n); all contiguous. Returns -1 for more
 * than MAX_ROWS rows (nothing written). */
int twinkle_gemv_f32(const float *x, const float *w, const float *bias, float *y, int rows, long k,
                     long n, int threads) {
    if (rows < 1 || rows > MAX_ROWS) return -1;
    long k8 = k & ~7L, blocks = (n + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long b = 0; b < blocks; b++) {
        long j = 4 * b, end = j + 4 < n ? j + 4 : n;
        if (rows == 1 && end - j == 4) {
            four(x, w + j * k, k, k8, y + j);
        } else {
            for (long jj = j; jj < end; jj++) output(rows, x, w + jj * k, k, k8, n, y + jj);
        }
        if (bias)
            for (int r = 0; r < rows; r++)
                for (long jj = j; jj < end; jj++) y[r * n + jj] += bias[jj];
    }
    return 0;
}

int twinkle_gemv_max_rows(void) { return MAX_ROWS; }
