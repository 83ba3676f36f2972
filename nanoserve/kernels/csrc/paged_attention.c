/* Paged attention on the CPU, reading keys and values where they live in the block pool.
 *
 * Every query token t of a step (a decode, or one token of a prefill chunk) belongs to sequence
 * seq[t] (t itself when seq is NULL, as for decodes) and has ctx[t] keys up to and including its own
 * position; it attends keys max(0, ctx[t] - window) .. ctx[t] - 1 of that sequence, found through its block table: position p is row table[p / bs] * bs + p % bs of the
 * layer's [rows, kv_heads, d] cache. Nothing is gathered: each key and value row is read once per
 * (token, kv head) and used by all the query heads that share it (GQA).
 *
 * The softmax is online, CHUNK keys at a time (the flash-attention recurrence): the chunk's scores,
 * the new running max, rescale what was accumulated, add the chunk. A chunk of scores in a small
 * array lets the compiler vectorise the exponentials.
 *
 * Work items are (token, kv head) pairs, shared by OpenMP threads. Built by
 * nanoserve/kernels/cpu_attention.py with the machine's C compiler and loaded with ctypes after torch,
 * so that libgomp.so.1 resolves to torch's own copy: one thread pool, sized by torch.set_num_threads,
 * instead of a second pool whose threads would fight torch's spinning ones for the cores.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 64
#define AHEAD 16     /* keys to prefetch ahead: the rows of one (token, kv head) are strided, which
                        hardware prefetchers follow poorly (1.5x from DRAM, measured on 1 and 2 threads) */
#define MAX_GROUP 16   /* query heads per kv head */
#define MAX_D 256      /* head dim */

static inline float load(const void *base, int64_t i, int bf16) {
    if (!bf16) return ((const float *)base)[i];
    uint32_t u = (uint32_t)((const uint16_t *)base)[i] << 16;   /* bf16 is the top half of an fp32 */
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline __attribute__((always_inline)) void attend(
        const float *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
        const int32_t *seq, const int32_t *ctx, float *out, int64_t heads, int64_t kv_heads, int64_t d,
        int64_t block_size, int64_t table_width, int64_t window, float scale, int64_t begin, int64_t end,
        int bf16) {
    const int64_t group = heads / kv_heads;
    #pragma omp parallel for schedule(dynamic, 4)
    for (int64_t item = begin; item < end; item++) {
        float qs[MAX_GROUP][MAX_D], acc[MAX_GROUP][MAX_D], scores[MAX_GROUP][CHUNK];
        float m[MAX_GROUP], l[MAX_GROUP];
        const int64_t t = item / kv_heads, g = item % kv_heads;
        const int32_t *table = block_tables + (seq ? (int64_t)seq[t] : t) * table_width;
        const int64_t last = ctx[t] - 1;
        const int64_t first = (window > 0 && last - window + 1 > 0) ? last - window + 1 : 0;
        for (int64_t h = 0; h < group; h++) {
            const float *qh = q + (t * heads + g * group + h) * d;
            for (int64_t i = 0; i < d; i++) { qs[h][i] = qh[i] * scale; acc[h][i] = 0.f; }
            m[h] = -1e30f;                                 /* finite: built with -ffast-math */
            l[h] = 0.f;
        }
        for (int64_t c0 = first; c0 <= last; c0 += CHUNK) {
            const int64_t n = (last - c0 + 1 < CHUNK) ? last - c0 + 1 : CHUNK;
            for (int64_t j = 0; j < n; j++) {            /* scores of the chunk's keys */
                const int64_t p = c0 + j;
                const int64_t row = ((int64_t)table[p / block_size] * block_size + p % block_size) * kv_heads + g;
                if (p + AHEAD <= last) {                     /* the rows AHEAD keys on, K now and V for later */
                    const int64_t pa = p + AHEAD;
                    const int64_t ra = ((int64_t)table[pa / block_size] * block_size + pa % block_size) * kv_heads + g;
                    for (int64_t i = 0; i < d; i += (bf16 ? 32 : 16)) {
                        __builtin_prefetch(bf16 ? (const void *)((const uint16_t *)k_cache + ra * d + i) : (const void *)((const float *)k_cache + ra * d + i));
                    }
                }
                for (int64_t h = 0; h < group; h++) {
                    float s = 0.f;
                    for (int64_t i = 0; i < d; i++) s += qs[h][i] * load(k_cache, row * d + i, bf16);
                    scores[h][j] = s;
                }
            }
            for (int64_t h = 0; h < group; h++) {        /* online softmax update */
                float mx = m[h];
                for (int64_t j = 0; j < n; j++) mx = scores[h][j] > mx ? scores[h][j] : mx;
                const float correction = expf(m[h] - mx);
                float sum = 0.f;
                for (int64_t j = 0; j < n; j++) { scores[h][j] = expf(scores[h][j] - mx); sum += scores[h][j]; }
                l[h] = l[h] * correction + sum;
                m[h] = mx;
                for (int64_t i = 0; i < d; i++) acc[h][i] *= correction;
            }
            for (int64_t j = 0; j < n; j++) {            /* weighted values */
                const int64_t p = c0 + j;
                const int64_t row = ((int64_t)table[p / block_size] * block_size + p % block_size) * kv_heads + g;
                if (j + AHEAD < n) {
                    const int64_t pa = p + AHEAD;
                    const int64_t ra = ((int64_t)table[pa / block_size] * block_size + pa % block_size) * kv_heads + g;
                    for (int64_t i = 0; i < d; i += (bf16 ? 32 : 16)) {
                        __builtin_prefetch(bf16 ? (const void *)((const uint16_t *)v_cache + ra * d + i) : (const void *)((const float *)v_cache + ra * d + i));
                    }
                }
                for (int64_t h = 0; h < group; h++) {
                    const float w = scores[h][j];
                    for (int64_t i = 0; i < d; i++) acc[h][i] += w * load(v_cache, row * d + i, bf16);
                }
            }
        }
        for (int64_t h = 0; h < group; h++) {
            float *oh = out + (t * heads + g * group + h) * d;
            for (int64_t i = 0; i < d; i++) oh[i] = acc[h][i] / l[h];
        }
    }
}

#define ARGS const float *q, const void *k, const void *v, const int32_t *tables, const int32_t *seq, \
    const int32_t *ctx, float *out, int64_t heads, int64_t kv_heads, int64_t d, int64_t block_size,  \
    int64_t table_width, int64_t window, float scale, int64_t begin, int64_t end
#define CALL q, k, v, tables, seq, ctx, out, heads, kv_heads, d, block_size, table_width, window, scale, begin, end

void paged_attention_f32(ARGS) { attend(CALL, 0); }
void paged_attention_bf16(ARGS) { attend(CALL, 1); }
int64_t max_group(void) { return MAX_GROUP; }
int64_t max_head_dim(void) { return MAX_D; }
