/* blockdiag's own block-diagonal kernels: register-blocked AVX-512, OpenMP over torch's threads.
 *
 * Compiled on the machine that runs them (cc -O3 -march=native -fopenmp, see simd.py) and
 * called through ctypes with pointers into torch's tensors. Every matrix is row-major with
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
#include <immintrin.h>
#include <omp.h>

#ifndef __AVX512F__
#error "blockdiag's simd kernels need AVX-512F (the compiler, with -march=native, reports this CPU lacks it)"
#endif

/* Bumped whenever an exported signature or return convention changes; simd.py refuses a
 * library with another. 2: every entry point checks its arguments and returns a code. */
int bd_abi_version(void) { return 2; }

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

#define INL static inline __attribute__((always_inline))

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
#include "_simd_body.h"
#undef T
#undef VL
#undef V
#undef M
#undef VZERO
#undef VLOADM
#undef VLOAD
#undef VSET1
#undef VFMA
#undef VADD
#undef VSTOREM
#undef VSTORE
#undef IT
#undef IV
#undef IVLOAD
#undef VPERM2
#undef SFX

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
#include "_simd_body.h"
