/* A self-contained check of blockdiag's simd kernels against a naive reference, for a variant
 * that cannot run in this process's Python (the aarch64 NEON variant, cross-compiled and run
 * under qemu-aarch64 by tests/test_simd_variants.py; any variant natively too):
 *
 *   aarch64-linux-gnu-gcc -O2 -static -fopenmp -DBD_ISA_NEON -I blockdiag/backends \
 *       -o harness tests/native/simd_harness.c && qemu-aarch64 ./harness
 *
 * It includes _simd.c itself, so it runs exactly the library's entry points. For float32 and
 * float64, block sides 1..70 (each side swept against a few of the other, so every tail width
 * of every vector and tile size is reached), with and without a bias, on 1 and 2 threads, and
 * with leading dimensions wider than the matrices (column slices), it checks the forward
 * product, the input gradient and the weight and bias gradients against a float64 loop, and
 * that nothing outside the outputs was written (guard values around and between the rows).
 * Prints one line per dtype and "ok" (exit 0), or the first mismatches (exit 1).
 */
#include "_simd.c"

#include <math.h>
#include <stdio.h>

static int failures = 0;

/* Deterministic values in [-1, 1). */
static uint64_t rng = 88172645463325252ull;
static double urand(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (double)(rng >> 11) / (double)(1ull << 53) * 2.0 - 1.0;
}

#define GUARD 12345.0

#define DEFINE_CHECK(T, SFXN, TOL)                                                                          \
    static void check_##SFXN(int64_t rows, int64_t G, int64_t I, int64_t O, int bias, int threads, int pad) \
    {                                                                                                        \
        int64_t ldx = G * I + pad, ldy = G * O + pad;                                                        \
        T* x = malloc(sizeof(T) * (size_t)(rows * ldx + 1));                                                 \
        T* w = malloc(sizeof(T) * (size_t)(G * O * I + 1));                                                  \
        T* b = malloc(sizeof(T) * (size_t)(G * O + 1));                                                      \
        T* gy = malloc(sizeof(T) * (size_t)(rows * ldy + 1));                                                \
        T* y = malloc(sizeof(T) * (size_t)(rows * ldy + 8));                                                 \
        T* gx = malloc(sizeof(T) * (size_t)(rows * ldx + 8));                                                \
        T* gw = malloc(sizeof(T) * (size_t)(G * O * I + 8));                                                 \
        T* gb = malloc(sizeof(T) * (size_t)(G * O + 8));                                                     \
        for (int64_t k = 0; k < rows * ldx; k++) x[k] = (T)urand();                                          \
        for (int64_t k = 0; k < G * O * I; k++) w[k] = (T)urand();                                           \
        for (int64_t k = 0; k < G * O; k++) b[k] = (T)urand();                                               \
        for (int64_t k = 0; k < rows * ldy; k++) gy[k] = (T)urand();                                         \
        for (int64_t k = 0; k < rows * ldy + 8; k++) y[k] = (T)GUARD;                                        \
        for (int64_t k = 0; k < rows * ldx + 8; k++) gx[k] = (T)GUARD;                                       \
        for (int64_t k = 0; k < G * O * I + 8; k++) gw[k] = (T)GUARD;                                        \
        for (int64_t k = 0; k < G * O + 8; k++) gb[k] = (T)GUARD;                                            \
        int e1 = bd_forward_##SFXN(x, ldx, w, bias ? b : 0, y, ldy, rows, G, I, O, threads);                 \
        int e2 = bd_grad_input_##SFXN(gy, ldy, w, gx, ldx, rows, G, I, O, threads);                         \
        int e3 = bd_grad_weight_##SFXN(gy, ldy, x, ldx, gw, bias ? gb : 0, rows, G, I, O, threads);          \
        double worst = 0;                                                                                    \
        const char* what = 0;                                                                                \
        int64_t at = -1;                                                                                     \
        if (e1 || e2 || e3) {                                                                                \
            what = "return code";                                                                            \
            worst = e1 ? e1 : e2 ? e2 : e3;                                                                  \
        }                                                                                                    \
        /* err: |got - want| / (1 + |want| scaled by the sum length) */                                      \
        for (int64_t n = 0; n < rows && !what; n++)                                                          \
            for (int64_t j = 0; j < ldy; j++) {                                                              \
                double got = y[n * ldy + j], want;                                                           \
                if (j >= G * O) {                                                                            \
                    if (got != GUARD) { what = "forward wrote outside its output"; at = n * ldy + j; }       \
                    continue;                                                                                \
                }                                                                                            \
                int64_t g = j / O, o = j % O;                                                                \
                want = bias ? b[j] : 0.0;                                                                    \
                for (int64_t i = 0; i < I; i++) want += (double)x[n * ldx + g * I + i] * w[(g * O + o) * I + i]; \
                double err = fabs(got - want) / (1.0 + fabs(want)) / (double)(I + 1);                       \
                if (!(err <= TOL)) { what = "forward"; at = n * ldy + j; worst = err; break; }               \
            }                                                                                                \
        for (int64_t n = 0; n < rows && !what; n++)                                                          \
            for (int64_t j = 0; j < ldx; j++) {                                                              \
                double got = gx[n * ldx + j], want = 0;                                                      \
                if (j >= G * I) {                                                                            \
                    if (got != GUARD) { what = "input gradient wrote outside its output"; at = n * ldx + j; } \
                    continue;                                                                                \
                }                                                                                            \
                int64_t g = j / I, i = j % I;                                                                \
                for (int64_t o = 0; o < O; o++) want += (double)gy[n * ldy + g * O + o] * w[(g * O + o) * I + i]; \
                double err = fabs(got - want) / (1.0 + fabs(want)) / (double)(O + 1);                        \
                if (!(err <= TOL)) { what = "input gradient"; at = n * ldx + j; worst = err; break; }        \
            }                                                                                                \
        for (int64_t k = 0; k < G * O * I && !what; k++) {                                                   \
            int64_t g = k / (O * I), o = (k / I) % O, i = k % I;                                             \
            double want = 0;                                                                                 \
            for (int64_t n = 0; n < rows; n++) want += (double)gy[n * ldy + g * O + o] * x[n * ldx + g * I + i]; \
            double err = fabs(gw[k] - want) / (1.0 + fabs(want)) / (double)(rows + 1);                       \
            if (!(err <= TOL)) { what = "weight gradient"; at = k; worst = err; }                            \
        }                                                                                                    \
        for (int64_t k = 0; k < G * O && bias && !what; k++) {                                               \
            double want = 0;                                                                                 \
            for (int64_t n = 0; n < rows; n++) want += gy[n * ldy + k];                                      \
            double err = fabs(gb[k] - want) / (1.0 + fabs(want)) / (double)(rows + 1);                       \
            if (!(err <= TOL)) { what = "bias gradient"; at = k; worst = err; }                              \
        }                                                                                                    \
        for (int64_t k = 0; k < 8 && !what; k++) {                                                           \
            if (y[rows * ldy + k] != GUARD || gx[rows * ldx + k] != GUARD || gw[G * O * I + k] != GUARD      \
                || gb[G * O + k] != GUARD)                                                                   \
                what = "a kernel wrote past the end of its output";                                          \
            if (!bias && gb[k] != GUARD) what = "the bias gradient was written without a bias";             \
        }                                                                                                    \
        if (what) {                                                                                          \
            if (failures < 20)                                                                               \
                printf("FAIL %s: %s at %lld (error %g) rows=%lld G=%lld I=%lld O=%lld bias=%d threads=%d pad=%d\n", \
                       #SFXN, what, (long long)at, worst, (long long)rows, (long long)G, (long long)I,       \
                       (long long)O, bias, threads, pad);                                                    \
            failures++;                                                                                      \
        }                                                                                                    \
        free(x); free(w); free(b); free(gy); free(y); free(gx); free(gw); free(gb);                          \
    }

DEFINE_CHECK(float, f32, 2e-6)
DEFINE_CHECK(double, f64, 1e-14)

/* The other side of a block swept over 1..70: a few fixed widths, and the same side. */
static const int64_t OTHER[] = {1, 3, 10, 17};

int main(int argc, char** argv)
{
    int64_t maxside = argc > 1 ? atoll(argv[1]) : 70;
    long long cases = 0;
    for (int d = 0; d < 2; d++) {
        int before = failures;
        long long n0 = cases;
        for (int64_t s = 1; s <= maxside; s++) {
            for (int k = 0; k <= 4; k++) {
                int64_t other = k < 4 ? OTHER[k] : s;
                /* rows reach partial row tiles and, past 64, several weight-gradient row blocks */
                int64_t rows = 1 + (s * 7 + k * 5) % 23 + (s % 10 == 0 ? 60 : 0);
                int64_t G = 1 + (s + k) % 3;
                int bias = (s + k) % 2, threads = 1 + (s + k / 2) % 2, pad = (s + k) % 3 == 0 ? 0 : 1 + k;
                for (int side = 0; side < 2; side++) {
                    int64_t I = side ? other : s, O = side ? s : other;
                    if (side && other == s) continue;
                    if (d == 0)
                        check_f32(rows, G, I, O, bias, threads, pad);
                    else
                        check_f64(rows, G, I, O, bias, threads, pad);
                    cases++;
                }
            }
        }
        printf("%s %s: %lld products (sides 1..%lld, forward, input, weight and bias gradients), %d failed\n",
               bd_isa(), d == 0 ? "float32" : "float64", cases - n0, (long long)maxside, failures - before);
    }
    printf("%s (openmp %d)\n", failures ? "FAILED" : "ok", bd_openmp());
    return failures ? 1 : 0;
}
