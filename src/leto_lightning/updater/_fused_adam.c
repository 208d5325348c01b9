/* One pass of a chunk transaction's Adam update: the math, the tier-1 parity delta and the
 * pages' new checksums, block by block while each block is in cache (updater/fused_adam.py).
 *
 * The math is torch.optim's single-tensor Adam/AdamW, element by element, with each operation
 * rounded the way torch's CPU kernels round it (checked against torch at import, fused_adam.py):
 *
 *   param.mul_(1 - lr * wd)                     p = p * decay                    (AdamW)
 *   grad = grad.add(param, alpha=wd)            g = fma(p, wd, g)                (Adam, L2)
 *   exp_avg.lerp_(grad, 1 - beta1)              m = fma(w, g - m, m)   (|w| < 0.5, else
 *                                                   fma(w - 1, g - m, g))
 *   exp_avg_sq.mul_(beta2)                      v = v * beta2
 *     .addcmul_(grad, grad, value=1 - beta2)    v = fma((1 - beta2) * g, g, v)
 *   denom = (exp_avg_sq.sqrt() / bc2_sqrt)      d = sqrt(v) / bc2_sqrt + eps     (sqrt: the
 *     .add_(eps)                                    function torch's kernel calls, passed in)
 *   param.addcdiv_(exp_avg, denom, -step_size)  p = p + (-step_size * m) / d
 *
 * Compiled with -ffp-contract=off: the compiler must not fuse what torch keeps separate.
 * Every element is independent, so doing all operations on one block before the next block
 * gives the bits torch gives doing each operation on the whole tensor.
 *
 * The parity delta folds old ^ new of every element into its page's XOR parity page (tier-1
 * groups with one parity page), in the loop that writes the new value.
 *
 * A Python extension module only so setuptools builds and installs it; fused_adam.py calls
 * leto_adam_chunk through ctypes (which releases the GIL).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

typedef uint64_t (*leto_crc_fn)(uint64_t crc, const unsigned char *buf, uint64_t len);
typedef void (*leto_sqrt_fn)(int n, const float *in, float *out);

enum { HP_DECAY, HP_L2, HP_W1, HP_BETA2, HP_C2, HP_BC2_SQRT, HP_EPS, HP_NEG_STEP, HP_N };
#ifndef BLOCK
#define BLOCK 4096 /* elements per block: 16 KiB of each of the ~10 streams, in L2 (measured best) */
#endif
#ifndef SAVE_BLOCKS
#define SAVE_BLOCKS 8 /* blocks saved, then one fence: ~4 ms less per 25 M params than a fence a block */
#endif
#ifndef ENCODE_BLOCK
#define ENCODE_BLOCK 65536 /* bytes per page and block of the gradient encode: 8 streams in L2 */
#endif

#define KERNEL_TARGETS __attribute__((target_clones("avx512f", "avx2,fma", "default")))

/* The bits of a float, for the parity delta (memcpy: no aliasing between the two views). */
static inline uint32_t bits_of(float x)
{
    uint32_t b;
    memcpy(&b, &x, sizeof b);
    return b;
}

/* The loops that write a value, one per formula: ``old`` is the element's value before,
 * FRESH the expression of the new one. With ``par`` (the parity words of the same elements) the
 * delta old ^ new is folded in while both are in registers. The kinds of one block may share a
 * parity page (retained/groups.py), so each loop is its own function: restrict holds per call. */
#define WRITE_LOOP(dst, par, n, FRESH)                                              \
    do {                                                                          \
        if (par)                                                                  \
            for (int64_t i = 0; i < (n); i++) {                                   \
                float old = (dst)[i], fresh = (FRESH);                            \
                (dst)[i] = fresh;                                                 \
                (par)[i] ^= bits_of(old) ^ bits_of(fresh);                        \
            }                                                                     \
        else                                                                      \
            for (int64_t i = 0; i < (n); i++) {                                   \
                float old = (dst)[i];                                             \
                (dst)[i] = (FRESH);                                               \
            }                                                                     \
    } while (0)

#define INLINE static inline __attribute__((always_inline))

INLINE void lerp_m(float *restrict m, const float *restrict g, uint32_t *restrict par, int64_t n, float w)
{
    if (fabsf(w) < 0.5f)
        WRITE_LOOP(m, par, n, fmaf(w, g[i] - old, old));
    else
        WRITE_LOOP(m, par, n, fmaf(w - 1.0f, g[i] - old, g[i]));
}

INLINE void square_v(float *restrict v, const float *restrict g, uint32_t *restrict par, int64_t n, float beta2,
                     float c2)
{
    WRITE_LOOP(v, par, n, fmaf(c2 * g[i], g[i], old * beta2));
}

INLINE void step_p(float *restrict p, const float *restrict m, const float *restrict d, uint32_t *restrict par,
                   int64_t n, float decay, float bc2, float eps, float neg_step)
{
    if (decay != 1.0f)
        WRITE_LOOP(p, par, n, old * decay + (neg_step * m[i]) / (d[i] / bc2 + eps));
    else
        WRITE_LOOP(p, par, n, old + (neg_step * m[i]) / (d[i] / bc2 + eps));
}

/* One piece's elements of a block. ``par``: the parity words of the same elements of each
 * kind (param, exp_avg, exp_avg_sq), or all NULL. The param is written once, in the last loop:
 * torch's decoupled decay (mul_) and addcdiv_ are two roundings there, kept two. */
KERNEL_TARGETS
static void adam_range(float *restrict p, float *restrict m, float *restrict v, const float *restrict g_in,
                       uint32_t *const par[3], float *restrict scratch, int64_t n, const float *hp,
                       leto_sqrt_fn vsqrt)
{
    const float *g = g_in;
    if (hp[HP_L2] != 0.0f) { /* Adam's L2 penalty: grad.add(param, alpha=wd), a new tensor */
        const float l2 = hp[HP_L2];
        for (int64_t i = 0; i < n; i++)
            scratch[i] = fmaf(p[i], l2, g_in[i]);
        g = scratch;
    }
    lerp_m(m, g, par[1], n, hp[HP_W1]);
    square_v(v, g, par[2], n, hp[HP_BETA2], hp[HP_C2]);
    float *d = scratch + BLOCK;
    vsqrt((int)n, v, d);
    step_p(p, m, d, par[0], n, hp[HP_DECAY], hp[HP_BC2_SQRT], hp[HP_EPS], hp[HP_NEG_STEP]);
}

KERNEL_TARGETS
static void xor_into(uint8_t *restrict parity, const uint8_t *restrict src, int64_t bytes)
{
    uint64_t *restrict par = (uint64_t *)parity;
    const uint64_t *restrict a = (const uint64_t *)src;
    for (int64_t i = 0; i < bytes / 8; i++)
        par[i] ^= a[i];
}

/* The undo copy of a block: with non-temporal stores where the CPU has them, because nothing
 * reads it back unless a crash needs it -- plain stores would first read every destination line
 * into cache and push the parity pages the next blocks need out of it. */
static void save_block(float *restrict dst, const float *restrict src, int64_t n)
{
#if defined(__x86_64__)
    if (((uintptr_t)dst & 15) == 0 && (n & 3) == 0) {
        for (int64_t i = 0; i < n; i += 4)
            _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
        return;
    }
#endif
    memcpy(dst, src, (size_t)n * sizeof(float));
}

static void saved_fence(void)
{
#if defined(__x86_64__)
    _mm_sfence(); /* non-temporal stores are weakly ordered: complete them before the count */
#endif
}

/* Elements [begin, end) of one chunk (chunk_elems = n_pages * page_elems per kind; kinds
 * param, exp_avg, exp_avg_sq). ``pieces``: n_pieces sorted, disjoint [start, stop) ranges with
 * HP_N hyper-parameters each (per piece: its own step). ``parity``: 3 * n_pages parity page
 * pointers (kind-major) or NULL; ``crcs``: 3 * n_pages running checksums, 0 at a page's start.
 *
 * ``progress`` NULL: the undo copies (up, um, uv) already hold the chunk's old contents.
 * Otherwise the kernel saves them itself as it goes, while the blocks are in cache: it copies
 * the next SAVE_BLOCKS blocks of every kind, then stores the count of bytes per kind whose undo
 * copy is complete in *progress, and only then modifies those blocks. A process killed at any
 * instruction leaves every byte at or past *progress untouched, and every byte before it in the
 * undo copy (recovery.restore_in_flight restores exactly those). Returns 0, or -1 on bad
 * arguments. */
int leto_adam_chunk(int64_t begin, int64_t end, int64_t page_elems, int n_pages,
                    float *p, float *m, float *v, const float *g,
                    float *up, float *um, float *uv, int64_t *progress,
                    uint8_t *const *parity, uint64_t *crcs,
                    int n_pieces, const int64_t *pieces, const float *hp,
                    leto_crc_fn crc, leto_sqrt_fn vsqrt)
{
    if (begin < 0 || end < begin || end > page_elems * n_pages || page_elems <= 0 || !crc || !vsqrt)
        return -1;
    float scratch[2 * BLOCK] __attribute__((aligned(64)));
    float *data[3] = {p, m, v};
    float *undo[3] = {up, um, uv};
    int k = 0;
    while (k < n_pieces && pieces[2 * k + 1] <= begin)
        k++;
    int64_t saved = begin; /* elements of every kind whose undo copy is complete */
    for (int64_t start = begin; start < end;) {
        int64_t page = start / page_elems;
        int64_t stop = start + BLOCK;
        if (stop > end) stop = end;
        if (stop > (page + 1) * page_elems) stop = (page + 1) * page_elems;
        int64_t bytes = (stop - start) * (int64_t)sizeof(float);
        int64_t off = (start - page * page_elems) * (int64_t)sizeof(float);
        if (progress && stop > saved) {
            int64_t upto = saved + SAVE_BLOCKS * BLOCK < end ? saved + SAVE_BLOCKS * BLOCK : end;
            for (int kind = 0; kind < 3; kind++)
                save_block(undo[kind] + saved, data[kind] + saved, upto - saved);
            saved_fence();
            /* sequentially consistent: the copies above are stored before it, the math below after */
            __atomic_store_n(progress, upto * (int64_t)sizeof(float), __ATOMIC_SEQ_CST);
            saved = upto;
        }
        for (int j = k; j < n_pieces && pieces[2 * j] < stop; j++) {
            int64_t a = pieces[2 * j] > start ? pieces[2 * j] : start;
            int64_t b = pieces[2 * j + 1] < stop ? pieces[2 * j + 1] : stop;
            if (a >= b)
                continue;
            uint32_t *par[3] = {NULL, NULL, NULL};
            for (int kind = 0; kind < 3 && parity; kind++)
                par[kind] = (uint32_t *)(parity[kind * n_pages + page] + off) + (a - start);
            adam_range(p + a, m + a, v + a, g + a, par, scratch, b - a, hp + (int64_t)HP_N * j, vsqrt);
        }
        while (k < n_pieces && pieces[2 * k + 1] <= stop)
            k++;
        for (int kind = 0; kind < 3; kind++)
            crcs[kind * n_pages + page] = crc(crcs[kind * n_pages + page], (const uint8_t *)(data[kind] + start),
                                              (uint64_t)bytes);
        start = stop;
    }
    return 0;
}

/* The XOR parity of n_pages pages of page_bytes each (a tier-1 group with one parity page) and
 * each page's CRC-64, block by block: every data byte is read from memory once. */
int leto_xor_encode_crc(int n_pages, const uint8_t *const *pages, uint8_t *parity, int64_t page_bytes,
                        uint64_t *crcs, leto_crc_fn crc)
{
    if (n_pages < 1 || page_bytes <= 0 || page_bytes % 8 || !crc)
        return -1;
    for (int j = 0; j < n_pages; j++)
        crcs[j] = 0;
    for (int64_t off = 0; off < page_bytes; off += ENCODE_BLOCK) {
        int64_t bytes = page_bytes - off < ENCODE_BLOCK ? page_bytes - off : ENCODE_BLOCK;
        memcpy(parity + off, pages[0] + off, (size_t)bytes);
        crcs[0] = crc(crcs[0], pages[0] + off, (uint64_t)bytes);
        for (int j = 1; j < n_pages; j++) {
            xor_into(parity + off, pages[j] + off, bytes);
            crcs[j] = crc(crcs[j], pages[j] + off, (uint64_t)bytes);
        }
    }
    return 0;
}

/* A correctly rounded square root, for builds of torch whose kernel is not MKL's vsSqrt (the
 * import-time check decides whether it is what torch computes). */
KERNEL_TARGETS
void leto_sqrt_exact(int n, const float *in, float *out)
{
    for (int i = 0; i < n; i++)
        out[i] = sqrtf(in[i]);
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused_adam",
                                    "leto_adam_chunk and leto_xor_encode_crc, called through ctypes (updater/fused_adam.py)", -1,
                                    NULL, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fused_adam(void) { return PyModule_Create(&module); }
