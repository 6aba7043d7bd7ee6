/* LoRA products of a packed row whose consecutive runs of tokens belong to different adapters:
 * for each run i and each token t in [starts[i], ends[i]),
 *     out[t, :] += scales[i] * (x[t, :] @ A_i.T) @ B_i.T
 * with x (T, K) and out (T, N) row-major, A_i (r_i, K) the adapter's down weight and B_i (N, r_i)
 * its up weight, both row-major. Done run by run with torch, each run costs two BLAS calls on a
 * few hundred tokens and a rank of a few rows, which libraries run at a small fraction of the
 * machine's rate; here one call does every run of a layer.
 *
 * The threads first write each B_i transposed, Bt_i (r_i, N), into scratch (a transposing copy in
 * torch costs more than the products of a short run). The tokens are cut into blocks of TB,
 * aligned to each run's start (a run's last block may be shorter), and each thread takes a
 * contiguous range of blocks, about an equal share of the work (a block's work grows with its
 * run's rank). For a block, the shrink step computes low = x @ A.T two tokens by four rows of A
 * at a time (eight accumulators: eight independent FMA chains) and keeps it, scaled, in a small
 * array; the expand step then adds low @ Bt to the block's rows of out, sixteen columns at a
 * time, each vector of Bt loaded once for the block's tokens and multiplied by each token's
 * low[j] broadcast.
 *
 * Vectors of 8 floats through GCC's vector extensions. Sums: low[t, j] is the sum over fixed
 * vector lanes of k in order, then the lanes, then the tail of k past the last multiple of 8,
 * times the scale; out[t, n] gets the sum over j in order (starting from zero), added once.
 * Blocks and the code path of each token depend only on the runs, never on the thread count or
 * how blocks are split, so the result does not depend on the thread count. */
#include <omp.h>
#include <stdlib.h>

#define MAX_RANK 128 /* rows of A per run at most; segments.py refuses more */
#define TB 4         /* tokens per block */
typedef float v8 __attribute__((vector_size(32), aligned(4)));
#define LOAD(p) (*(const v8 *)(p))
#define STORE(p, v) (*(v8 *)(p) = (v))
/* A loaded vector kept in a register: GCC otherwise folds the load into each FMA that uses it,
 * and loading the same vector again for each sets the rate, not the FMAs. */
#if defined(__x86_64__)
#define KEEP(v) __asm__("" : "+x"(v))
#elif defined(__aarch64__)
#define KEEP(v) __asm__("" : "+w"(v))
#else
#define KEEP(v) ((void)0)
#endif

static inline float lanes(v8 v) {
    float s = 0.f;
    for (int i = 0; i < 8; i++) s += v[i];
    return s;
}

static inline float tail(const float *x, const float *a, long from, long k) {
    float s = 0.f;
    for (long i = from; i < k; i++) s += x[i] * a[i];
    return s;
}

/* low[t * MAX_RANK + j] = scale * x_t . a_j for T consecutive tokens of x and R consecutive rows
 * of a (T and R constants in each copy, so the accumulators stay in registers) */
#define SHRINK(T, R)                                                                               \
    static inline void shrink##T##x##R(const float *x, const float *a, long k, long k8, float scale, \
                                       float *low) {                                               \
        v8 acc[T][R];                                                                              \
        for (int t = 0; t < T; t++)                                                                \
            for (int r = 0; r < R; r++) acc[t][r] = (v8){0};                                       \
        for (long i = 0; i < k8; i += 8) {                                                         \
            v8 av[R];                                                                              \
            for (int r = 0; r < R; r++) {                                                          \
                av[r] = LOAD(a + r * k + i);                                                       \
                KEEP(av[r]);                                                                       \
            }                                                                                      \
            for (int t = 0; t < T; t++) {                                                          \
                v8 xv = LOAD(x + t * k + i);                                                       \
                KEEP(xv);                                                                          \
                for (int r = 0; r < R; r++) acc[t][r] += xv * av[r];                               \
            }                                                                                      \
        }                                                                                          \
        for (int t = 0; t < T; t++)                                                                \
            for (int r = 0; r < R; r++)                                                            \
                low[t * MAX_RANK + r] = scale * (lanes(acc[t][r]) + tail(x + t * k, a + r * k, k8, k)); \
    }
SHRINK(2, 4) SHRINK(2, 1) SHRINK(1, 4) SHRINK(1, 1)

/* the block's low: tokens two at a time, then one; rows of A four at a time, then one */
static void shrink(const float *x, const float *a, long k, int tokens, int rank, float scale, float *low) {
    long k8 = k & ~7L;
    int r4 = rank & ~3;
    int t = 0;
    for (; t + 2 <= tokens; t += 2) {
        int j = 0;
        for (; j < r4; j += 4) shrink2x4(x + t * k, a + j * k, k, k8, scale, low + t * MAX_RANK + j);
        for (; j < rank; j++) shrink2x1(x + t * k, a + j * k, k, k8, scale, low + t * MAX_RANK + j);
    }
    for (; t < tokens; t++) {
        int j = 0;
        for (; j < r4; j += 4) shrink1x4(x + t * k, a + j * k, k, k8, scale, low + t * MAX_RANK + j);
        for (; j < rank; j++) shrink1x1(x + t * k, a + j * k, k, k8, scale, low + t * MAX_RANK + j);
    }
}

/* out[t, :] += low[t, :] @ bt for T consecutive tokens (T a constant in each copy) */
#define EXPAND(T)                                                                                  \
    static void expand##T(float *out, const float *bt, long n, int rank, const float *low) {       \
        long n16 = n & ~15L, n8 = n & ~7L, c = 0;                                                  \
        for (; c < n16; c += 16) {                                                                 \
            v8 s0[T], s1[T];                                                                       \
            for (int t = 0; t < T; t++) s0[t] = s1[t] = (v8){0};                                   \
            for (int j = 0; j < rank; j++) {                                                       \
                v8 b0 = LOAD(bt + j * n + c), b1 = LOAD(bt + j * n + c + 8);                       \
                KEEP(b0);                                                                          \
                KEEP(b1);                                                                          \
                for (int t = 0; t < T; t++) {                                                      \
                    float l = low[t * MAX_RANK + j];                                               \
                    s0[t] += l * b0;                                                               \
                    s1[t] += l * b1;                                                               \
                }                                                                                  \
            }                                                                                      \
            for (int t = 0; t < T; t++) {                                                          \
                STORE(out + t * n + c, LOAD(out + t * n + c) + s0[t]);                             \
                STORE(out + t * n + c + 8, LOAD(out + t * n + c + 8) + s1[t]);                     \
            }                                                                                      \
        }                                                                                          \
        for (; c < n8; c += 8) {                                                                   \
            v8 s0[T];                                                                              \
            for (int t = 0; t < T; t++) s0[t] = (v8){0};                                           \
            for (int j = 0; j < rank; j++) {                                                       \
                v8 b0 = LOAD(bt + j * n + c);                                                      \
                KEEP(b0);                                                                          \
                for (int t = 0; t < T; t++) s0[t] += low[t * MAX_RANK + j] * b0;                   \
            }                                                                                      \
            for (int t = 0; t < T; t++) STORE(out + t * n + c, LOAD(out + t * n + c) + s0[t]);     \
        }                                                                                          \
        for (; c < n; c++)                                                                         \
            for (int t = 0; t < T; t++) {                                                          \
                float s = 0.f;                                                                     \
                for (int j = 0; j < rank; j++) s += low[t * MAX_RANK + j] * bt[j * n + c];        \
                out[t * n + c] += s;                                                               \
            }                                                                                      \
    }
EXPAND(1) EXPAND(2) EXPAND(3) EXPAND(4)

static void expand(int tokens, float *out, const float *bt, long n, int rank, const float *low) {
    switch (tokens) {
    case 1: expand1(out, bt, n, rank, low); break;
    case 2: expand2(out, bt, n, rank, low); break;
    case 3: expand3(out, bt, n, rank, low); break;
    default: expand4(out, bt, n, rank, low); break;
    }
}

static inline long blocks_of(long start, long end) { return (end - start + TB - 1) / TB; }

/* The first block at or past `target` of the work: a block of run i counts ranks[i] (its
 * products' size, but for K + N, the same for every run); before[i] sums the runs before i. */
static long block_at(long target, int nruns, const long *first, const long *before, const int *ranks) {
    for (int i = 0; i < nruns; i++)
        if (first[i + 1] > first[i] && target < before[i + 1])
            return first[i] + (target - before[i] + ranks[i] - 1) / ranks[i];
    return first[nruns];
}

/* out (T, N), x (T, K); per run i: tokens [starts[i], ends[i]), a_ptrs[i] (ranks[i], K),
 * b_ptrs[i] (N, ranks[i]), scales[i]; all row-major and contiguous. The runs must not overlap
 * (a block of one run and one of another may run on two threads at once), and out must not
 * overlap x. Returns -1 for a run out of [0, T] or a rank outside [0, MAX_RANK], -2 without
 * memory; nothing written then. */
int twinkle_lora_segments_f32(float *out, const float *x, long T, long K, long N, int nruns,
                              const long *starts, const long *ends, const float *const *a_ptrs,
                              const float *const *b_ptrs, const int *ranks, const float *scales,
                              int threads) {
    if (nruns <= 0) return 0;
    for (int i = 0; i < nruns; i++)
        if (starts[i] < 0 || ends[i] > T || ranks[i] < 0 || ranks[i] > MAX_RANK) return -1;
    /* first[i], before[i]: the blocks and the work before run i's; at[i]: where its Bt starts in
     * the scratch (runs without blocks get none) */
    long *first = malloc((size_t)(3 * nruns + 2) * sizeof *first);
    if (!first) return -2;
    long *before = first + nruns + 1, *at = before + nruns + 1;
    first[0] = before[0] = 0;
    long floats = 0;
    for (int i = 0; i < nruns; i++) {
        long b = ends[i] > starts[i] && ranks[i] > 0 ? blocks_of(starts[i], ends[i]) : 0;
        first[i + 1] = first[i] + b;
        before[i + 1] = before[i] + b * ranks[i];
        at[i] = floats;
        if (b) floats += (long)ranks[i] * N;
    }
    long total = first[nruns], work = before[nruns];
    float *scratch = total ? malloc((size_t)(floats > 0 ? floats : 1) * sizeof *scratch) : NULL;
    if (!scratch) { /* no work, or no memory */
        free(first);
        return total ? -2 : 0;
    }
    if (threads < 1) threads = 1;
    if (threads > total) threads = (int)total;
#pragma omp parallel num_threads(threads)
    {
        for (int i = 0; i < nruns; i++) {
            if (first[i + 1] == first[i]) continue;
            const float *b = b_ptrs[i];
            float *bt = scratch + at[i];
            long r = ranks[i];
#pragma omp for schedule(static) nowait
            for (long c = 0; c < N; c += 64) {
                long to = c + 64 < N ? c + 64 : N;
                for (long j = 0; j < r; j++)
                    for (long n = c; n < to; n++) bt[j * N + n] = b[n * r + j];
            }
        }
#pragma omp barrier
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        /* contiguous ranges of blocks of about equal work (every block's own arithmetic is the
         * same whichever thread runs it) */
        long from = block_at(work * id / nt, nruns, first, before, ranks);
        long to = block_at(work * (id + 1) / nt, nruns, first, before, ranks);
        float low[TB * MAX_RANK];
        int run = 0;
        while (run < nruns && first[run + 1] <= from) run++;
        for (long u = from; u < to; u++) {
            while (first[run + 1] <= u) run++;
            long t0 = starts[run] + (u - first[run]) * TB;
            int tokens = (int)(ends[run] - t0 < TB ? ends[run] - t0 : TB);
            shrink(x + t0 * K, a_ptrs[run], K, tokens, ranks[run], scales[run], low);
            expand(tokens, out + t0 * N, scratch + at[run], N, ranks[run], low);
        }
    }
    free(scratch);
    free(first);
    return 0;
}

int twinkle_lora_segments_max_rank(void) { return MAX_RANK; }
