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

/* Bumped whenever an exported signature changes; simd.py refuses a library with another. */
int bd_abi_version(void) { return 1; }

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
