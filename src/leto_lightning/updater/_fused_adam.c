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
 * The parity delta folds old ^ new of every page into its one XOR parity page (tier-1 groups
 * with one parity page).
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
#ifndef ENCODE_BLOCK
#define ENCODE_BLOCK 65536 /* bytes per page and block of the gradient encode: 8 streams in L2 */
#endif

#define KERNEL_TARGETS __attribute__((target_clones("avx512f", "avx2,fma", "default")))

KERNEL_TARGETS
static void adam_range(float *restrict p, float *restrict m, float *restrict v, const float *restrict g_in,
                       float *restrict scratch, int64_t n, const float *hp, leto_sqrt_fn vsqrt)
{
    const float decay = hp[HP_DECAY], l2 = hp[HP_L2], w = hp[HP_W1], beta2 = hp[HP_BETA2], c2 = hp[HP_C2];
    const float bc2 = hp[HP_BC2_SQRT], eps = hp[HP_EPS], neg_step = hp[HP_NEG_STEP];
    const float *g = g_in;
    if (l2 != 0.0f) { /* Adam's L2 penalty: grad.add(param, alpha=wd), a new tensor */
        for (int64_t i = 0; i < n; i++)
            scratch[i] = fmaf(p[i], l2, g_in[i]);
        g = scratch;
    }
    if (decay != 1.0f)
        for (int64_t i = 0; i < n; i++)
            p[i] = p[i] * decay;
    if (fabsf(w) < 0.5f)
        for (int64_t i = 0; i < n; i++)
            m[i] = fmaf(w, g[i] - m[i], m[i]);
    else
        for (int64_t i = 0; i < n; i++)
            m[i] = fmaf(w - 1.0f, g[i] - m[i], g[i]);
    for (int64_t i = 0; i < n; i++) {
        float vi = v[i] * beta2;
        v[i] = fmaf(c2 * g[i], g[i], vi);
    }
    float *d = scratch + BLOCK;
    vsqrt((int)n, v, d);
    for (int64_t i = 0; i < n; i++) {
        float di = d[i] / bc2;
        di = di + eps;
        float num = neg_step * m[i];
        p[i] = p[i] + num / di;
    }
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
 * Otherwise the kernel saves them itself, block by block, while the block is in cache: it
 * copies a block of every kind, then stores the count of bytes per kind whose undo copy is
 * complete in *progress, and only then modifies the block. A process killed at any instruction
 * leaves every byte at or past *progress untouched, and every byte before it in the undo copy
 * (recovery.restore_in_flight restores exactly those). Returns 0, or -1 on bad arguments. */
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
    for (int64_t start = begin; start < end;) {
        int64_t page = start / page_elems;
        int64_t stop = start + BLOCK;
        if (stop > end) stop = end;
        if (stop > (page + 1) * page_elems) stop = (page + 1) * page_elems;
        int64_t bytes = (stop - start) * (int64_t)sizeof(float);
        int64_t off = (start - page * page_elems) * (int64_t)sizeof(float);
        if (progress) {
            for (int kind = 0; kind < 3; kind++)
                save_block(undo[kind] + start, data[kind] + start, stop - start);
            saved_fence();
            /* sequentially consistent: the copies above are stored before it, the math below after */
            __atomic_store_n(progress, stop * (int64_t)sizeof(float), __ATOMIC_SEQ_CST);
        }
        /* the delta old ^ new in two folds, old before the math and new after: the parity and
         * data blocks stay in L1 between them, and the undo copy is never read back */
        for (int kind = 0; kind < 3 && parity; kind++)
            xor_into(parity[kind * n_pages + page] + off, (const uint8_t *)(data[kind] + start), bytes);
        for (int j = k; j < n_pieces && pieces[2 * j] < stop; j++) {
            int64_t a = pieces[2 * j] > start ? pieces[2 * j] : start;
            int64_t b = pieces[2 * j + 1] < stop ? pieces[2 * j + 1] : stop;
            if (a < b)
                adam_range(p + a, m + a, v + a, g + a, scratch, b - a, hp + (int64_t)HP_N * j, vsqrt);
        }
        while (k < n_pieces && pieces[2 * k + 1] <= stop)
            k++;
        for (int kind = 0; kind < 3; kind++) {
            const uint8_t *fresh = (const uint8_t *)(data[kind] + start);
            if (parity)
                xor_into(parity[kind * n_pages + page] + off, fresh, bytes);
            crcs[kind * n_pages + page] = crc(crcs[kind * n_pages + page], fresh, (uint64_t)bytes);
        }
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
