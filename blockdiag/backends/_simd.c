/* blockdiag's own block-diagonal kernels: register-blocked SIMD, OpenMP over torch's threads.
 *
 * One kernel body (_simd_body.h) in three variants, one per instruction set, chosen when
 * compiling by defining one of
 *   BD_ISA_AVX512  AVX-512F (16 floats a vector, 32 registers, masked loads and stores);
 *   BD_ISA_AVX2    AVX2 + FMA, x86-64-v3 (8 floats, 16 registers; _mm256_maskload for partial
 *                  loads, 128/64/32-bit pieces for partial stores);
 *   BD_ISA_NEON    aarch64 Advanced SIMD (4 floats, 32 registers; no masks: partial vectors
 *                  go through a small zero-padded buffer);
 * without one, the best the compiler's target flags allow. Compiled on the machine that runs
 * them (cc -O3 <the variant's flags> -fopenmp, see simd.py; without OpenMP, when the compiler
 * lacks it, every kernel runs on one thread) and called through ctypes with pointers into
 * torch's tensors. Every matrix is row-major with
 * unit column stride and a leading dimension of the caller's choosing, so column slices of
 * wider tensors are read and written in place.
 *
 * For the block-diagonal product with G blocks w[g] of shape [O, I]:
 *   forward       y[n, g*O + o]  = bias[g*O + o] + sum_i x[n, g*I + i] * w[g][o][i]
 *   input grad    gx[n, g*I + i] = sum_o gy[n, g*O + o] * w[g][o][i]
 *   weight grad   gw[g][o][i]    = sum_n gy[n, g*O + o] * x[n, g*I + i]
 *   bias grad     gb[g*O + o]    = sum_n gy[n, g*O + o]
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if !defined(BD_ISA_AVX512) && !defined(BD_ISA_AVX2) && !defined(BD_ISA_NEON)
#if defined(__AVX512F__)
#define BD_ISA_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define BD_ISA_AVX2
#elif defined(__aarch64__)
#define BD_ISA_NEON
#else
#error "blockdiag's simd kernels need AVX-512F, AVX2 and FMA, or aarch64 (the compiler's target has none)"
#endif
#endif

#if defined(BD_ISA_AVX512)
#ifndef __AVX512F__
#error "the avx512 variant needs AVX-512F (the compiler, with these flags, reports this target lacks it)"
#endif
#define BD_ISA_NAME "avx512"
#include <immintrin.h>
#elif defined(BD_ISA_AVX2)
#if !defined(__AVX2__) || !defined(__FMA__)
#error "the avx2 variant needs AVX2 and FMA (compile with -mavx2 -mfma)"
#endif
#define BD_ISA_NAME "avx2"
#include <immintrin.h>
#elif defined(BD_ISA_NEON)
#ifndef __aarch64__
#error "the neon variant needs an aarch64 target"
#endif
#define BD_ISA_NAME "neon"
#include <arm_neon.h>
#endif

#ifdef _OPENMP
#include <omp.h>
#else
/* A compiler without OpenMP: the pragmas are ignored and every kernel runs on one thread. */
static inline int omp_get_num_threads(void) { return 1; }
static inline int omp_get_thread_num(void) { return 0; }
#endif

/* gcc's RTL global common-subexpression passes (-fgcse, and -fgcse-after-reload at -O3) spent
   most of the AVX2 variant's compile time, which a user waits through in the first call that
   runs simd, on kernels whose loads and sums are register tiles written out as intrinsics:
   nothing there for them to find, and the kernels ran no slower without them (see the
   changelog). clang has no such passes. */
#if defined(BD_ISA_AVX2) && defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("no-gcse", "no-gcse-after-reload")
#endif

/* Bumped whenever an exported signature or return convention changes; simd.py refuses a
 * library with another. 2: every entry point checks its arguments and returns a code. */
int bd_abi_version(void) { return 2; }

/* The variant compiled ("avx512", "avx2" or "neon"), and whether it runs on OpenMP threads
 * (0: serial, the compiler had no OpenMP). */
const char* bd_isa(void) { return BD_ISA_NAME; }
int bd_openmp(void)
{
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* Return codes of the exported entry points. Every argument is checked before anything is
 * read or written; simd.py turns a non-zero code into a BlockDiagError naming the argument
 * and the values it passed. k is the argument's 1-based position in the signature.
 *    0           done
 *   -1           out of memory: the packed weight panels could not be allocated
 *   -(100 + k)   argument k is a null pointer for a non-empty matrix (the bias and the bias
 *                gradient are optional: null means none)
 *   -(200 + k)   argument k is a negative size, or a thread count below 1
 *   -(300 + k)   argument k, a leading dimension, is below its matrix's width: an output with
 *                more than one row needs at least its width, an input at least its width or
 *                exactly 0 (every row reads the same row); none may be negative
 *   -(400 + k)   argument k makes an element count or a byte offset overflow (beyond INT64_MAX)
 */
#define BD_ENOMEM (-1)
#define BD_ENULL(k) (-(100 + (k)))
#define BD_ESIZE(k) (-(200 + (k)))
#define BD_ELD(k) (-(300 + (k)))
#define BD_EOVERFLOW(k) (-(400 + (k)))

/* The sizes of a call: rows, G, I, O (arguments kr, kg, ki, ko) at least 0, nthreads (kt) at
   least 1, and G*I, G*O, G*O*I (returned) with their byte sizes within int64. */
static int bd_sizes(int64_t rows, int kr, int64_t G, int kg, int64_t I, int ki, int64_t O, int ko,
                    int nthreads, int kt, int64_t es, int64_t* gi, int64_t* go, int64_t* goi)
{
    int64_t bytes;
    if (rows < 0) return BD_ESIZE(kr);
    if (G < 0) return BD_ESIZE(kg);
    if (I < 0) return BD_ESIZE(ki);
    if (O < 0) return BD_ESIZE(ko);
    if (nthreads < 1) return BD_ESIZE(kt);
    if (__builtin_mul_overflow(G, I, gi) || __builtin_mul_overflow(*gi, es, &bytes)) return BD_EOVERFLOW(ki);
    if (__builtin_mul_overflow(G, O, go) || __builtin_mul_overflow(*go, es, &bytes)) return BD_EOVERFLOW(ko);
    if (__builtin_mul_overflow(*go, I, goi) || __builtin_mul_overflow(*goi, es, &bytes)) return BD_EOVERFLOW(ki);
    /* The packed panels round a side up to whole vectors (at most 16 lanes) and are held once
       per thread: keep that product within int64 too. */
    if (__builtin_mul_overflow(O + 16, I + 16, &bytes) || __builtin_mul_overflow(bytes, es * nthreads, &bytes))
        return BD_EOVERFLOW(kt);
    return 0;
}

/* A row-major matrix of rows x width elements of es bytes at p (argument kp) with leading
   dimension ld (argument kl); out: it is written. */
static int bd_matrix(const void* p, int kp, int64_t ld, int kl, int64_t rows, int64_t width, int out, int64_t es)
{
    int64_t last;
    if (ld < 0) return BD_ELD(kl);
    if (rows == 0 || width == 0) return 0;
    if (!p) return BD_ENULL(kp);
    if (rows > 1 && ld < width && (out || ld != 0)) return BD_ELD(kl);
    /* The byte offset of the end of the last row: (rows - 1) * ld + width elements. */
    if (__builtin_mul_overflow(rows - 1, ld, &last) || __builtin_add_overflow(last, width, &last)
        || __builtin_mul_overflow(last, es, &last))
        return BD_EOVERFLOW(kl);
    return 0;
}

/* The threads a product of `rows` rows over `goi` weights (G*O*I) runs on: the caller's alone
   below BD_SERIAL_MACS multiply-adds, as torch's own ops stay on the calling thread below their
   grain size. Waking the pool costs more than such a product, and a pool once started makes the
   process unsafe to fork: the child of a later fork hangs in its first parallel region (the
   pool's threads are not in the child). A single small call (the self-check's products, a
   one-row forward) left such a pool behind, where torch's own small ops leave none. */
#define BD_SERIAL_MACS 32768
static int bd_threads(int64_t rows, int64_t goi, int nthreads)
{
    int64_t macs;
    if (nthreads > 1 && !__builtin_mul_overflow(rows, goi, &macs) && macs < BD_SERIAL_MACS) return 1;
    return nthreads;
}

#define INL static inline __attribute__((always_inline))

/* The macro sets, one per instruction set and element type. MASK(n) is the mask of the first
   n lanes (n >= 0; all lanes from n >= VL on). */
#if defined(BD_ISA_AVX512)

#define MASK(n) ((M)(((n) >= VL) ? (M)~(M)0 : (M)((1u << (n)) - 1u)))
#define T float
#define VL 16
#define V __m512
#define M __mmask16
#define VZERO _mm512_setzero_ps()
#define VLOADM(m, p) _mm512_maskz_loadu_ps(m, p)
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSET1(s) _mm512_set1_ps(s)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSTOREM(p, m, v) _mm512_mask_storeu_ps(p, m, v)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define IT int32_t
#define IV __m512i
#define IVLOAD(p) _mm512_loadu_si512(p)
#define VPERM2(a, i, b) _mm512_permutex2var_ps(a, i, b)
#define SFX f32
#define DOTMAXO 10
#include "_simd_body.h"

#define MASK(n) ((M)(((n) >= VL) ? (M)~(M)0 : (M)((1u << (n)) - 1u)))
#define T double
#define VL 8
#define V __m512d
#define M __mmask8
#define VZERO _mm512_setzero_pd()
#define VLOADM(m, p) _mm512_maskz_loadu_pd(m, p)
#define VLOAD(p) _mm512_loadu_pd(p)
#define VSET1(s) _mm512_set1_pd(s)
#define VFMA(a, b, c) _mm512_fmadd_pd(a, b, c)
#define VADD(a, b) _mm512_add_pd(a, b)
#define VSTOREM(p, m, v) _mm512_mask_storeu_pd(p, m, v)
#define VSTORE(p, v) _mm512_storeu_pd(p, v)
#define IT int64_t
#define IV __m512i
#define IVLOAD(p) _mm512_loadu_si512(p)
#define VPERM2(a, i, b) _mm512_permutex2var_pd(a, i, b)
#define SFX f64
#define DOTMAXO 5
#include "_simd_body.h"

#elif defined(BD_ISA_AVX2)
/* 16 registers: at most 3 vectors of columns per tile (4 rows x 3 + 3 weights + 1 broadcast),
   6 rows with 2 and 8 with 1; the weight gradient's tiles likewise (12 rows with one vector);
   dot tiles of RR x NO accumulators plus RR inputs and one weight.

   The mask is the lane count. Partial loads are _mm256_maskload (its mask from a table), but
   partial stores are 128-, 64- and 32-bit stores of the vector's pieces, not
   _mm256_maskstore: on AMD Zen a masked store to memory costs tens of cycles, and the forward
   product of 10x10 blocks, whose every output row ends in a 2-lane store, ran slower than
   bmm_fm with it. Whole vectors take plain loads and stores. */
static const int32_t bd_mask32[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
static const int64_t bd_mask64[8] = {-1, -1, -1, -1, 0, 0, 0, 0};
INL __m256 bd_loadm_ps(int m, const float* p)
{
    if (m >= 8) return _mm256_loadu_ps(p);
    return _mm256_maskload_ps(p, _mm256_loadu_si256((const __m256i*)(bd_mask32 + 8 - m)));
}
INL void bd_storem_ps(float* p, int m, __m256 v)
{
    if (m >= 8) {
        _mm256_storeu_ps(p, v);
        return;
    }
    __m128 h = _mm256_castps256_ps128(v);
    if (m >= 4) {
        _mm_storeu_ps(p, h);
        h = _mm256_extractf128_ps(v, 1);
        p += 4;
        m -= 4;
    }
    if (m >= 2) {
        _mm_storel_pi((__m64*)p, h);
        h = _mm_movehl_ps(h, h);
        p += 2;
        m -= 2;
    }
    if (m >= 1) _mm_store_ss(p, h);
}
INL __m256d bd_loadm_pd(int m, const double* p)
{
    if (m >= 4) return _mm256_loadu_pd(p);
    return _mm256_maskload_pd(p, _mm256_loadu_si256((const __m256i*)(bd_mask64 + 4 - m)));
}
INL void bd_storem_pd(double* p, int m, __m256d v)
{
    if (m >= 4) {
        _mm256_storeu_pd(p, v);
        return;
    }
    __m128d h = _mm256_castpd256_pd128(v);
    if (m >= 2) {
        _mm_storeu_pd(p, h);
        h = _mm256_extractf128_pd(v, 1);
        p += 2;
        m -= 2;
    }
    if (m >= 1) _mm_store_sd(p, h);
}

#define MAXNV 3
#define RTILE(nv) ((nv) == 1 ? 8 : (nv) == 2 ? 6 : 4)
#define WRTILE(nv) ((nv) == 1 ? 12 : (nv) == 2 ? 6 : 4)
#define DRT(no) ((no) <= 2 ? 4 : (no) <= 4 ? 3 : (no) <= 6 ? 2 : 1)
#define MASK(n) ((int)((n) < 0 ? 0 : (n) < VL ? (n) : VL))
#define T float
#define VL 8
#define V __m256
#define M int
#define VZERO _mm256_setzero_ps()
#define VLOADM(m, p) bd_loadm_ps(m, p)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSET1(s) _mm256_set1_ps(s)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VSTOREM(p, m, v) bd_storem_ps(p, m, v)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define SFX f32
#include "_simd_body.h"

#define MAXNV 3
#define RTILE(nv) ((nv) == 1 ? 8 : (nv) == 2 ? 6 : 4)
#define WRTILE(nv) ((nv) == 1 ? 12 : (nv) == 2 ? 6 : 4)
#define DRT(no) ((no) <= 2 ? 4 : (no) <= 4 ? 3 : (no) <= 6 ? 2 : 1)
#define MASK(n) ((int)((n) < 0 ? 0 : (n) < VL ? (n) : VL))
#define T double
#define VL 4
#define V __m256d
#define M int
#define VZERO _mm256_setzero_pd()
#define VLOADM(m, p) bd_loadm_pd(m, p)
#define VLOAD(p) _mm256_loadu_pd(p)
#define VSET1(s) _mm256_set1_pd(s)
#define VFMA(a, b, c) _mm256_fmadd_pd(a, b, c)
#define VADD(a, b) _mm256_add_pd(a, b)
#define VSTOREM(p, m, v) bd_storem_pd(p, m, v)
#define VSTORE(p, v) _mm256_storeu_pd(p, v)
#define SFX f64
#include "_simd_body.h"

#elif defined(BD_ISA_NEON)
/* No masked loads or stores: a partial vector of n < VL lanes goes through a zero-padded
   buffer (only the tails of rows and the bias sums take this path). The mask is the lane
   count. 32 registers: AVX-512's tiling. */
INL float32x4_t bd_loadm_f32(int m, const float* p)
{
    if (m >= 4) return vld1q_f32(p);
    float t[4] = {0, 0, 0, 0};
    for (int i = 0; i < m; i++) t[i] = p[i];
    return vld1q_f32(t);
}
INL void bd_storem_f32(float* p, int m, float32x4_t v)
{
    if (m >= 4) {
        vst1q_f32(p, v);
        return;
    }
    float t[4];
    vst1q_f32(t, v);
    for (int i = 0; i < m; i++) p[i] = t[i];
}
INL float64x2_t bd_loadm_f64(int m, const double* p)
{
    if (m >= 2) return vld1q_f64(p);
    double t[2] = {0, 0};
    if (m == 1) t[0] = p[0];
    return vld1q_f64(t);
}
INL void bd_storem_f64(double* p, int m, float64x2_t v)
{
    if (m >= 2) vst1q_f64(p, v);
    else if (m == 1) p[0] = vgetq_lane_f64(v, 0);
}

#define MASK(n) ((int)((n) < VL ? (n) : VL))
#define T float
#define VL 4
#define V float32x4_t
#define M int
#define VZERO vdupq_n_f32(0.0f)
#define VLOADM(m, p) bd_loadm_f32(m, p)
#define VLOAD(p) vld1q_f32(p)
#define VSET1(s) vdupq_n_f32(s)
#define VFMA(a, b, c) vfmaq_f32(c, a, b)
#define VADD(a, b) vaddq_f32(a, b)
#define VSTOREM(p, m, v) bd_storem_f32(p, m, v)
#define VSTORE(p, v) vst1q_f32(p, v)
#define SFX f32
#include "_simd_body.h"

#define MASK(n) ((int)((n) < VL ? (n) : VL))
#define T double
#define VL 2
#define V float64x2_t
#define M int
#define VZERO vdupq_n_f64(0.0)
#define VLOADM(m, p) bd_loadm_f64(m, p)
#define VLOAD(p) vld1q_f64(p)
#define VSET1(s) vdupq_n_f64(s)
#define VFMA(a, b, c) vfmaq_f64(c, a, b)
#define VADD(a, b) vaddq_f64(a, b)
#define VSTOREM(p, m, v) bd_storem_f64(p, m, v)
#define VSTORE(p, v) vst1q_f64(p, v)
#define SFX f64
#include "_simd_body.h"
#endif
