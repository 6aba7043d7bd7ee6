/* Causal attention of a packed row's short samples, forward and backward, fp32, on the CPU.

   A row holds samples end to end, each after a prefix it continues: the row's first tokens,
   or a prefix held once before a group of samples. A query of a sample sees its prefix and its
   own sample up to itself; a prefix query sees the prefix up to itself. Tensors are
   token-major: q and out (T, H, D), k and v (T, KV, D), all contiguous; lse (H, T). The
   caller lists the tasks: a segment (a prefix's own queries, or one sample) with some query
   heads of one key/value head. Threads (OpenMP, the pool torch already runs)
   take tasks longest first; a task's products go tile by tile (MR x NR, GCC's generic vectors)
   over blocks of QB queries, with the softmax over exactly the keys each query sees. In the
   backward each task writes its keys' gradients to its own rows of `slots`, and `reduce` adds
   them per key/value head in task order, so the result does not depend on which thread ran
   what, nor on how many there are. */

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int head;   /* first query head */
    int heads;  /* query heads, all of one key/value head */
    int start;  /* first query's position */
    int count;  /* queries */
    int seen;   /* prefix keys the queries see before their own (0 for a prefix's own task) */
    int from;   /* position of the first of those prefix keys */
    int slot;   /* backward: the first row of this task's key gradients in `slots` */
} Task;

typedef struct {
    const float *q, *k, *v, *out, *grad_out, *lse_in;
    float *o, *lse, *grad_q, *grad_k, *grad_v, *slots;
    int T, H, KV, D;
    float scale;
    const Task *tasks;
    int n_tasks;
    atomic_int next;
    int failed;
} Job;

/* exp(x) for x <= 0 from 2^n * 2^f, |f| <= 1/2, a degree-7 Taylor polynomial: relative error
   ~1e-8 before rounding; branch-free, so the loops calling it vectorise. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    float t = x * 1.44269504088896341f;
    float n = __builtin_roundf(t);
    float f = (t - n) * 0.69314718055994531f;
    float p = 1.0f + f * (1.0f + f * (0.5f + f * (1.6666667e-1f + f * (4.1666668e-2f +
              f * (8.3333338e-3f + f * (1.3888889e-3f + f * 1.9841270e-4f))))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* position of a task's key j: its prefix's `seen` keys, then the task's own */
static inline int key_position(const Task *t, int j) {
    return j < t->seen ? t->from + j : t->start + j - t->seen;
}

#ifdef __AVX512F__
#define LANES 16 /* floats in a vector: GCC's generic vectors, lowered to whatever the CPU has */
#define MR 8     /* rows of a product's tile: MR x NR / LANES accumulators in registers */
#else
#define LANES 8
#define MR 4
#endif
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef float uvec __attribute__((vector_size(LANES * sizeof(float)), aligned(sizeof(float)), may_alias));
#define NR 16 /* columns of a product's tile */
#define QB 64 /* queries whose scores are held at once (a multiple of MR): 64 x 1000 keys, 256 KB */

static inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

/* A task's matrices, padded: queries to a multiple of MR, keys to one of NR (and MR), zeros
   beyond the real ones. */
typedef struct {
    const Task *t;
    int n, np, cp, D; /* keys, keys padded, queries padded, head dim */
} Shape;

static Shape shape_of(const Job *job, const Task *t) {
    Shape s = {t, t->seen + t->count, 0, round_up(t->count, MR), job->D};
    s.np = round_up(round_up(s.n, NR), MR);
    return s;
}

/* query i sees keys [0, seen + i]: a tile of rows from i0 needs the keys its last row sees */
static inline int keys_of_tile(const Shape *s, int i0) {
    const int last = s->t->seen + i0 + MR;
    return last < s->n ? last : s->n;
}

enum { SCORES, VALUES, KEYS };

/* C[i, :] (+)= sum over k of A[i, k] * B[k, :], rows in tiles of MR, columns in tiles of NR; A
   read at a[i * ars + k * acs], B's rows contiguous at stride brs, C's at crs. The queries are
   a block of `block` from query `first`; what a tile covers follows the causal pattern (`kind`):
   SCORES  Q K^T or dO V^T (block x np, sum over D): the columns of the keys the tile sees;
   VALUES  P V or dS K (block x D, sum over keys): the keys the tile sees;
   KEYS    dS^T Q or P^T dO (np x D, sum over the block's queries): the queries that see the
           tile's keys (a key j of the sample's own is seen by the queries i >= j - seen).
   Everything is padded, so no tile runs past an edge. */
static void product(int kind, const Shape *s, int first, int block, const float *a, long ars, long acs,
                    const float *b, long brs, float *c, long crs, int accumulate) {
    const int rows = kind == KEYS ? keys_of_tile(s, first + block - MR) : block;
    for (int i0 = 0; i0 < rows; i0 += MR) {
        int cols = s->D, k_lo = 0, k_hi;
        if (kind == SCORES) {
            cols = round_up(keys_of_tile(s, first + i0), NR);
            k_hi = s->D;
        } else if (kind == VALUES) {
            k_hi = keys_of_tile(s, first + i0);
        } else {
            k_lo = i0 - s->t->seen - first > 0 ? i0 - s->t->seen - first : 0;
            k_hi = block;
            if (k_lo >= k_hi) continue;
        }
        for (int j0 = 0; j0 < cols; j0 += NR) {
            vec acc[MR][NR / LANES];
            for (int r = 0; r < MR; r++)
                for (int v = 0; v < NR / LANES; v++)
                    acc[r][v] = accumulate ? (vec)*(const uvec *)(c + (i0 + r) * crs + j0 + v * LANES) : (vec){0};
            for (int k = k_lo; k < k_hi; k++) {
                const float *bk = b + k * brs + j0;
                vec bv[NR / LANES];
                for (int v = 0; v < NR / LANES; v++) bv[v] = *(const uvec *)(bk + v * LANES);
                for (int r = 0; r < MR; r++) {
                    const float ar = a[(i0 + r) * ars + k * acs];
                    for (int v = 0; v < NR / LANES; v++) acc[r][v] += ar * bv[v];
                }
            }
            for (int r = 0; r < MR; r++)
                for (int v = 0; v < NR / LANES; v++) *(uvec *)(c + (i0 + r) * crs + j0 + v * LANES) = acc[r][v];
        }
    }
}

/* the task's keys of `src` (token-major, KV heads) into (np x D) rows and, if asked, (D x np)
   columns; padding zero */
static void gather_keys(const Job *job, const Shape *s, const float *src, float *rows, float *cols) {
    const int D = s->D;
    memset(rows, 0, (size_t)s->np * D * sizeof(float));
    const int kv = s->t->head / (job->H / job->KV);
    for (int j = 0; j < s->n; j++)
        memcpy(rows + (size_t)j * D, src + ((size_t)key_position(s->t, j) * job->KV + kv) * D, D * sizeof(float));
    if (cols)
        for (int d = 0; d < D; d++)
            for (int j = 0; j < s->np; j++) cols[(size_t)d * s->np + j] = rows[(size_t)j * D + d];
}

/* the task's queries of head h from `src` (token-major, H heads) into (cp x D), padding zero */
static void gather_queries(const Job *job, const Shape *s, const float *src, int h, float *rows) {
    const int D = s->D;
    memset(rows, 0, (size_t)s->cp * D * sizeof(float));
    for (int i = 0; i < s->t->count; i++)
        memcpy(rows + (size_t)i * D, src + ((size_t)(s->t->start + i) * job->H + h) * D, D * sizeof(float));
}

static void scatter_queries(const Job *job, const Shape *s, const float *rows, int h, float *dst) {
    const int D = s->D;
    for (int i = 0; i < s->t->count; i++)
        memcpy(dst + ((size_t)(s->t->start + i) * job->H + h) * D, rows + (size_t)i * D, D * sizeof(float));
}

static size_t scratch_floats(int n, int count, int D) {
    const int np = round_up(round_up(n, NR), MR), cp = round_up(count, MR);
    return (size_t)6 * np * D + (size_t)4 * cp * D + (size_t)2 * (cp < QB ? cp : QB) * np;
}

static void forward_task(Job *job, const Task *t, float *scratch) {
    const Shape s = shape_of(job, t);
    const int D = s.D;
    float *kr = scratch, *kt = kr + (size_t)s.np * D, *vr = kt + (size_t)s.np * D;
    float *qr = vr + (size_t)s.np * D, *orows = qr + (size_t)s.cp * D, *p = orows + (size_t)s.cp * D;
    gather_keys(job, &s, job->k, kr, kt);
    gather_keys(job, &s, job->v, vr, NULL);
    for (int h = t->head; h < t->head + t->heads; h++) {
        gather_queries(job, &s, job->q, h, qr);
        for (int first = 0; first < s.cp; first += QB) {
            const int block = s.cp - first < QB ? s.cp - first : QB;
            product(SCORES, &s, first, block, qr + (size_t)first * D, D, 1, kt, s.np, p, s.np, 0);
            for (int i = first; i < first + block; i++) {
                float *pi = p + (size_t)(i - first) * s.np;
                const int keys = i < t->count ? t->seen + i + 1 : 0;
                float m = -INFINITY, sum = 0.0f;
                for (int j = 0; j < keys; j++) m = pi[j] > m ? pi[j] : m;
                for (int j = 0; j < keys; j++) {
                    pi[j] = exp_neg((pi[j] - m) * job->scale);
                    sum += pi[j];
                }
                const float inv = keys ? 1.0f / sum : 0.0f;
                for (int j = 0; j < keys; j++) pi[j] *= inv;
                for (int j = keys; j < s.np; j++) pi[j] = 0.0f;
                if (keys) job->lse[(size_t)h * job->T + t->start + i] = m * job->scale + logf(sum);
            }
            product(VALUES, &s, first, block, p, s.np, 1, vr, D, orows + (size_t)first * D, D, 0);
        }
        scatter_queries(job, &s, orows, h, job->o);
    }
}

static void backward_task(Job *job, const Task *t, float *scratch) {
    const Shape s = shape_of(job, t);
    const int D = s.D;
    float *kr = scratch, *kt = kr + (size_t)s.np * D, *vr = kt + (size_t)s.np * D;
    float *vt = vr + (size_t)s.np * D, *gk = vt + (size_t)s.np * D, *gv = gk + (size_t)s.np * D;
    float *qr = gv + (size_t)s.np * D, *dor = qr + (size_t)s.cp * D, *gq = dor + (size_t)s.cp * D;
    float *orows = gq + (size_t)s.cp * D, *p = orows + (size_t)s.cp * D;
    float *ds = p + (size_t)(s.cp < QB ? s.cp : QB) * s.np;
    gather_keys(job, &s, job->k, kr, kt);
    gather_keys(job, &s, job->v, vr, vt);
    memset(gk, 0, (size_t)2 * s.np * D * sizeof(float));
    for (int h = t->head; h < t->head + t->heads; h++) {
        gather_queries(job, &s, job->q, h, qr);
        gather_queries(job, &s, job->grad_out, h, dor);
        gather_queries(job, &s, job->out, h, orows);
        for (int first = 0; first < s.cp; first += QB) {
            const int block = s.cp - first < QB ? s.cp - first : QB;
            const float *qb = qr + (size_t)first * D, *dob = dor + (size_t)first * D;
            product(SCORES, &s, first, block, qb, D, 1, kt, s.np, p, s.np, 0);
            product(SCORES, &s, first, block, dob, D, 1, vt, s.np, ds, s.np, 0);
            for (int i = first; i < first + block; i++) {
                float *pi = p + (size_t)(i - first) * s.np, *dsi = ds + (size_t)(i - first) * s.np;
                const int keys = i < t->count ? t->seen + i + 1 : 0;
                float delta = 0.0f;
                for (int d = 0; d < D; d++) delta += dor[(size_t)i * D + d] * orows[(size_t)i * D + d];
                const float lse = keys ? job->lse_in[(size_t)h * job->T + t->start + i] : 0.0f;
                for (int j = 0; j < keys; j++) {
                    pi[j] = exp_neg(pi[j] * job->scale - lse);
                    dsi[j] = pi[j] * (dsi[j] - delta) * job->scale;
                }
                for (int j = keys; j < s.np; j++) pi[j] = dsi[j] = 0.0f;
            }
            product(VALUES, &s, first, block, ds, s.np, 1, kr, D, gq + (size_t)first * D, D, 0);
            product(KEYS, &s, first, block, ds, 1, s.np, qb, D, gk, D, 1);
            product(KEYS, &s, first, block, p, 1, s.np, dob, D, gv, D, 1);
        }
        scatter_queries(job, &s, gq, h, job->grad_q);
    }
    /* this task's share of its keys' gradients, added up by `reduce` */
    float *slot = job->slots + (size_t)t->slot * 2 * D;
    memcpy(slot, gk, (size_t)s.n * D * sizeof(float));
    memcpy(slot + (size_t)s.n * D, gv, (size_t)s.n * D * sizeof(float));
}

static int longest(const Job *job, int keys) {
    int most = 1;
    for (int i = 0; i < job->n_tasks; i++) {
        const Task *t = &job->tasks[i];
        const int n = keys ? t->seen + t->count : t->count;
        most = n > most ? n : most;
    }
    return most;
}

static void *worker(void *arg) {
    Job *job = arg;
    float *scratch = malloc(scratch_floats(longest(job, 1), longest(job, 0), job->D) * sizeof(float));
    if (!scratch) {
        job->failed = 1;
        return NULL;
    }
    for (;;) {
        const int i = atomic_fetch_add(&job->next, 1);
        if (i >= job->n_tasks) break;
        if (job->grad_out)
            backward_task(job, &job->tasks[i], scratch);
        else
            forward_task(job, &job->tasks[i], scratch);
    }
    free(scratch);
    return NULL;
}

static int run(Job *job, int threads) {
    atomic_init(&job->next, 0);
    job->failed = 0;
#pragma omp parallel num_threads(threads)
    worker(job);
    return job->failed ? -1 : 0;
}

/* grad_k and grad_v: each key/value head's tasks' slots added in task order, whichever thread
   ran them, so the result is the same for any number of threads */
static void reduce(Job *job, int threads) {
    const int D = job->D, group = job->H / job->KV;
#pragma omp parallel for num_threads(threads) schedule(static, 1)
    for (int kv = 0; kv < job->KV; kv++) {
        for (int i = 0; i < job->n_tasks; i++) {
            const Task *t = &job->tasks[i];
            if (t->head / group != kv) continue;
            const int n = t->seen + t->count;
            const float *gk = job->slots + (size_t)t->slot * 2 * D, *gv = gk + (size_t)n * D;
            for (int j = 0; j < n; j++) {
                const size_t row = ((size_t)key_position(t, j) * job->KV + kv) * D;
                for (int d = 0; d < D; d++) {
                    job->grad_k[row + d] += gk[(size_t)j * D + d];
                    job->grad_v[row + d] += gv[(size_t)j * D + d];
                }
            }
        }
    }
}

/* floats in the vectors this build runs: 16 where the CPU has AVX-512, else 8 */
int twinkle_attention_lanes(void) { return LANES; }

int twinkle_attention_forward(const float *q, const float *k, const float *v, float *out, float *lse,
                              int T, int H, int KV, int D, float scale, const int *tasks,
                              int n_tasks, int threads) {
    Job job = {.q = q, .k = k, .v = v, .o = out, .lse = lse, .T = T, .H = H, .KV = KV, .D = D,
               .scale = scale, .tasks = (const Task *)tasks, .n_tasks = n_tasks};
    return run(&job, threads);
}

/* grad_k and grad_v zero on entry; slots: 2 * D floats for each key of each task */
int twinkle_attention_backward(const float *q, const float *k, const float *v, const float *out,
                               const float *lse, const float *grad_out, float *grad_q, float *grad_k,
                               float *grad_v, float *slots, int T, int H, int KV, int D,
                               float scale, const int *tasks, int n_tasks, int threads) {
    Job job = {.q = q, .k = k, .v = v, .out = out, .lse_in = lse, .grad_out = grad_out,
               .grad_q = grad_q, .grad_k = grad_k, .grad_v = grad_v, .slots = slots,
               .T = T, .H = H, .KV = KV, .D = D, .scale = scale,
               .tasks = (const Task *)tasks, .n_tasks = n_tasks};
    if (run(&job, threads)) return -1;
    reduce(&job, threads);
    return 0;
}
