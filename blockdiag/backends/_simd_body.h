/* The kernels of _simd.c for one element type: included once per type, with T, VL (lanes
 * per vector), V and M (vector and mask types), the intrinsics and the name suffix SFX
 * defined by the includer. */
#define CAT2(a, b) a##_##b
#define CAT(a, b) CAT2(a, b)
/* At most 4 vectors of columns per tile: 4 x 6 accumulators plus 4 weight vectors fit the
   32 vector registers. */
#define MAXNV 4
#define MASK(n) ((M)(((n) >= VL) ? (M)~(M)0 : (M)((1u << (n)) - 1u)))

/* The register tiles take their rows (rr) and vectors of columns (nv) as compile-time
   constants: DISPATCH(C, ROWS1) turns the runtime pair into C(R, NV), a case of a switch,
   for rr up to 8 (or up to 16 with one vector, where ROWS1 is ROWS16) and nv up to MAXNV. */
#define ROWS8(C, NV) switch (rr) { C(1, NV) C(2, NV) C(3, NV) C(4, NV) C(5, NV) C(6, NV) C(7, NV) C(8, NV) }
#define ROWS16(C, NV) switch (rr) { C(1, NV) C(2, NV) C(3, NV) C(4, NV) C(5, NV) C(6, NV) C(7, NV) C(8, NV) \
                                    C(9, NV) C(10, NV) C(11, NV) C(12, NV) C(13, NV) C(14, NV) C(15, NV) C(16, NV) }
#define DISPATCH(C, ROWS1) switch (nv) { case 1: ROWS1(C, 1) break; case 2: ROWS8(C, 2) break; \
                                         case 3: ROWS8(C, 3) break; case 4: ROWS8(C, 4) break; }

/* C[r, n] (n < nw) = (bias[n]) + sum_k A[r*lda + k] * P[k*ldp + n],  r < RR; NV = ceil(nw/VL).
   RR and NV are compile-time constants at every call (tile_any's switch), so the RR x NV
   accumulators live in registers. P's rows are zero-padded to whole vectors so its loads
   need no mask: masked weight loads halved the speed in the prototype. */
INL void CAT(tile, SFX)(const T* a, int64_t lda, const T* p, int64_t ldp, int64_t K,
                        const T* bias, T* c, int64_t ldc, int64_t nw, const int RR, const int NV)
{
    V acc[8][MAXNV];
    M mk[MAXNV];
    for (int j = 0; j < NV; j++) {
        mk[j] = MASK(nw - j * VL);
        V b0 = bias ? VLOADM(mk[j], bias + j * VL) : VZERO;
        for (int r = 0; r < RR; r++) acc[r][j] = b0;
    }
    for (int64_t k = 0; k < K; k++) {
        V w[MAXNV];
        for (int j = 0; j < NV; j++) w[j] = VLOAD(p + k * ldp + j * VL);
        for (int r = 0; r < RR; r++) {
            V s = VSET1(a[r * lda + k]);
            for (int j = 0; j < NV; j++) acc[r][j] = VFMA(s, w[j], acc[r][j]);
        }
    }
    for (int r = 0; r < RR; r++)
        for (int j = 0; j < NV; j++) VSTOREM(c + r * ldc + j * VL, mk[j], acc[r][j]);
}

/* The tiles of groups g0..g1 for one row tile, when a group's columns are one chunk (N <= MAXNV
   vectors): RR and NV are constants over the whole run of groups, so the group loop runs inside
   one specialised function instead of a call and two switches per group. */
INL void CAT(tile_groups, SFX)(const T* a, int64_t lda, const T* p, int64_t sp, int64_t ldp, int64_t K,
                               const T* bias, T* c, int64_t ldc, int64_t N, int64_t g0, int64_t g1,
                               const int RR, const int NV)
{
    for (int64_t g = g0; g < g1; g++)
        CAT(tile, SFX)(a + g * K, lda, p + g * sp, ldp, K, bias ? bias + g * N : 0, c + g * N, ldc, N, RR, NV);
}

/* Rows per tile: as many independent accumulator chains as the registers allow. */
#define RTILE(nv) ((nv) <= 2 ? 8 : 6)

static void CAT(tile_any, SFX)(const T* a, int64_t lda, const T* p, int64_t ldp, int64_t K,
                               const T* bias, T* c, int64_t ldc, int64_t nw, int rr, int nv)
{
#define CASE_R(R, NVC) case R: CAT(tile, SFX)(a, lda, p, ldp, K, bias, c, ldc, nw, R, NVC); break;
    DISPATCH(CASE_R, ROWS8)
#undef CASE_R
}

static void CAT(tile_groups_any, SFX)(const T* a, int64_t lda, const T* p, int64_t sp, int64_t ldp, int64_t K,
                                     const T* bias, T* c, int64_t ldc, int64_t N, int64_t g0, int64_t g1,
                                     int rr, int nv)
{
#define CASE_R(R, NVC) case R: CAT(tile_groups, SFX)(a, lda, p, sp, ldp, K, bias, c, ldc, N, g0, g1, R, NVC); break;
    DISPATCH(CASE_R, ROWS8)
#undef CASE_R
}

/* Y[n, g*N + j] = bias[g*N + j] + sum_k X[n, g*K + k] * P[g*sp + k*ldp + j] */
static void CAT(bdmm, SFX)(const T* x, int64_t ldx, const T* pk, int64_t sp, int64_t ldp, const T* bias,
                           T* y, int64_t ldy, int64_t rows, int64_t G, int64_t K, int64_t N, int nthreads)
{
    int64_t nchunks = (N + MAXNV * VL - 1) / (MAXNV * VL);
    int nvmax = (int)(((N < MAXNV * VL ? N : MAXNV * VL) + VL - 1) / VL);
    int64_t rt = RTILE(nvmax);
    int64_t ntiles = (rows + rt - 1) / rt;
    /* Groups in chunks whose weights fit in L2 (about 256 KiB): each chunk's weights stay
       cached while every row tile passes over them. */
    int64_t wbytes = sp * (int64_t)sizeof(T);
    int64_t gc = (256 * 1024) / (wbytes > 0 ? wbytes : 1);
    if (gc < 1) gc = 1;
    if (gc > G) gc = G;
    int64_t ngc = (G + gc - 1) / gc;
    #pragma omp parallel for collapse(2) schedule(static) num_threads(nthreads)
    for (int64_t cg = 0; cg < ngc; cg++)
        for (int64_t t = 0; t < ntiles; t++) {
            int64_t r0 = t * rt;
            int rr = (int)(rows - r0 < rt ? rows - r0 : rt);
            int64_t g1 = (cg + 1) * gc < G ? (cg + 1) * gc : G;
            if (nchunks == 1) {
                CAT(tile_groups_any, SFX)(x + r0 * ldx, ldx, pk, sp, ldp, K, bias, y + r0 * ldy, ldy, N,
                                          cg * gc, g1, rr, nvmax);
                continue;
            }
            for (int64_t g = cg * gc; g < g1; g++)
                for (int64_t ch = 0; ch < nchunks; ch++) {
                    int64_t n0 = ch * MAXNV * VL;
                    int64_t nw = N - n0 < MAXNV * VL ? N - n0 : MAXNV * VL;
                    int nv = (int)((nw + VL - 1) / VL);
                    CAT(tile_any, SFX)(x + r0 * ldx + g * K, ldx, pk + g * sp + n0, ldp, K,
                                       bias ? bias + g * N + n0 : 0, y + r0 * ldy + g * N + n0, ldy, nw, rr, nv);
                }
        }
}

/* P[g][k][0:np] = trans ? w[g][:, k] : w[g][k, :], zero padded: w is [G][trans ? N : K][trans ? K : N].
   One pass over the weight per call; parallel above 4096 elements, where the serial
   transpose cost more than the product at small batches (B=32, 150x10 G=16: 46 -> 35 us). */
static T* CAT(pack, SFX)(const T* w, int64_t G, int64_t K, int64_t N, int trans, int64_t np, int nthreads)
{
    T* p = (T*)malloc((size_t)(G * K * np) * sizeof(T));
    if (!p) return 0;
    #pragma omp parallel for schedule(static) num_threads(nthreads) if (G * K * np > 4096)
    for (int64_t g = 0; g < G; g++) {
        T* pg = p + g * K * np;
        const T* wg = w + g * K * N;
        if (trans) {
            for (int64_t k = 0; k < K; k++)
                for (int64_t j = N; j < np; j++) pg[k * np + j] = 0;
            for (int64_t j = 0; j < N; j++)
                for (int64_t k = 0; k < K; k++) pg[k * np + j] = wg[j * K + k];
        } else {
            for (int64_t k = 0; k < K; k++) {
                memcpy(pg + k * np, wg + k * N, (size_t)N * sizeof(T));
                for (int64_t j = N; j < np; j++) pg[k * np + j] = 0;
            }
        }
    }
    return p;
}

/* forward: w is [G][O][I] contiguous; y = x @ blockdiag(w)^T + bias. Returns 0, or -1 when out of memory. */
int CAT(bd_forward, SFX)(const T* x, int64_t ldx, const T* w, const T* bias, T* y, int64_t ldy,
                         int64_t rows, int64_t G, int64_t I, int64_t O, int nthreads)
{
    int64_t np = (O + VL - 1) / VL * VL;
    T* p = CAT(pack, SFX)(w, G, I, O, 1, np, nthreads);
    if (!p) return -1;
    CAT(bdmm, SFX)(x, ldx, p, I * np, np, bias, y, ldy, rows, G, I, O, nthreads);
    free(p);
    return 0;
}

/* input gradient: gx[n, g*I+i] = sum_o gy[n, g*O+o] w[g][o][i] */
int CAT(bd_grad_input, SFX)(const T* gy, int64_t ldgy, const T* w, T* gx, int64_t ldgx,
                            int64_t rows, int64_t G, int64_t I, int64_t O, int nthreads)
{
    int64_t np = (I + VL - 1) / VL * VL;
    T* p = CAT(pack, SFX)(w, G, O, I, 0, np, nthreads);
    if (!p) return -1;
    CAT(bdmm, SFX)(gy, ldgy, p, O * np, np, 0, gx, ldgx, rows, G, O, I, nthreads);
    free(p);
    return 0;
}

/* gw[o][i] (+)= sum_n gy[n*ldgy + o] x[n*ldx + i], o < RR, i < iw;  gb[o] (+)= sum_n gy[n*ldgy + o] */
INL void CAT(wtile, SFX)(const T* gy, int64_t ldgy, const T* x, int64_t ldx, int64_t n0, int64_t n1,
                         T* gw, int64_t ldgw, int64_t iw, T* gb, int first, const int RR, const int NV)
{
    V acc[16][MAXNV];
    M mk[MAXNV];
    /* RR may exceed one vector in float64 (16 rows, 8 lanes): the bias sums take two. */
    M mb0 = MASK(RR), mb1 = MASK(RR > VL ? RR - VL : 0);
    V sb0 = (gb && !first) ? VLOADM(mb0, gb) : VZERO;
    V sb1 = (gb && !first && RR > VL) ? VLOADM(mb1, gb + VL) : VZERO;
    for (int j = 0; j < NV; j++) {
        mk[j] = MASK(iw - j * VL);
        for (int r = 0; r < RR; r++) acc[r][j] = first ? VZERO : VLOADM(mk[j], gw + r * ldgw + j * VL);
    }
    for (int64_t n = n0; n < n1; n++) {
        V xv[MAXNV];
        for (int j = 0; j < NV; j++) xv[j] = VLOADM(mk[j], x + n * ldx + j * VL);
        const T* gr = gy + n * ldgy;
        if (gb) {
            sb0 = VADD(sb0, VLOADM(mb0, gr));
            if (RR > VL) sb1 = VADD(sb1, VLOADM(mb1, gr + VL));
        }
        for (int r = 0; r < RR; r++) {
            V s = VSET1(gr[r]);
            for (int j = 0; j < NV; j++) acc[r][j] = VFMA(s, xv[j], acc[r][j]);
        }
    }
    for (int r = 0; r < RR; r++)
        for (int j = 0; j < NV; j++) VSTOREM(gw + r * ldgw + j * VL, mk[j], acc[r][j]);
    if (gb) {
        VSTOREM(gb, mb0, sb0);
        if (RR > VL) VSTOREM(gb + VL, mb1, sb1);
    }
}

/* Output rows per weight-gradient tile: up to 16 with one vector of columns, so a 10-row
   block is one tile and x is read once per group, not twice. */
#define WRTILE(nv) ((nv) == 1 ? 16 : (nv) == 2 ? 8 : 6)

static void CAT(wtile_any, SFX)(const T* gy, int64_t ldgy, const T* x, int64_t ldx, int64_t n0, int64_t n1,
                                T* gw, int64_t ldgw, int64_t iw, T* gb, int first, int rr, int nv)
{
#define CASE_R(R, NVC) case R: CAT(wtile, SFX)(gy, ldgy, x, ldx, n0, n1, gw, ldgw, iw, gb, first, R, NVC); break;
    DISPATCH(CASE_R, ROWS16)
#undef CASE_R
}

/* The weight-gradient tiles of groups g0..g1 over rows n0..n1, when a group is one tile (O <= its
   rows, I <= MAXNV vectors): as tile_groups, the group loop runs inside one specialised function. */
INL void CAT(wtile_groups, SFX)(const T* gy, int64_t ldgy, const T* x, int64_t ldx, int64_t n0, int64_t n1,
                                T* gw, T* gb, int first, int64_t I, int64_t O, int64_t g0, int64_t g1,
                                const int RR, const int NV)
{
    for (int64_t g = g0; g < g1; g++)
        CAT(wtile, SFX)(gy + g * O, ldgy, x + g * I, ldx, n0, n1, gw + g * O * I, I, I, gb ? gb + g * O : 0,
                        first, RR, NV);
}

static void CAT(wtile_groups_any, SFX)(const T* gy, int64_t ldgy, const T* x, int64_t ldx, int64_t n0,
                                       int64_t n1, T* gw, T* gb, int first, int64_t I, int64_t O, int64_t g0,
                                       int64_t g1, int rr, int nv)
{
#define CASE_R(R, NVC) case R: CAT(wtile_groups, SFX)(gy, ldgy, x, ldx, n0, n1, gw, gb, first, I, O, g0, g1, R, NVC); break;
    DISPATCH(CASE_R, ROWS16)
#undef CASE_R
}

/* weight and bias gradients: gw[g][o][i] = sum_n gy[n, g*O+o] x[n, g*I+i], gb[g*O+o] = sum_n gy[n, g*O+o].
   gb may be NULL. The bias sums ride along with each output tile's first column chunk. */
void CAT(bd_grad_weight, SFX)(const T* gy, int64_t ldgy, const T* x, int64_t ldx, T* gw, T* gb,
                              int64_t rows, int64_t G, int64_t I, int64_t O, int nthreads)
{
    if (rows <= 0) {
        memset(gw, 0, (size_t)(G * O * I) * sizeof(T));
        if (gb) memset(gb, 0, (size_t)(G * O) * sizeof(T));
        return;
    }
    int64_t ichunks = (I + MAXNV * VL - 1) / (MAXNV * VL);
    int nvmax = (int)(((I < MAXNV * VL ? I : MAXNV * VL) + VL - 1) / VL);
    int64_t rt = WRTILE(nvmax);
    int64_t otiles = (O + rt - 1) / rt;
    int64_t items = G * otiles * ichunks;
    #pragma omp parallel num_threads(nthreads)
    {
        int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        int64_t a = items * tid / nt, b = items * (tid + 1) / nt;
        if (a < b) {
            /* Each thread owns a contiguous run of (group, output tile, column chunk) items,
               so no two threads write the same gradient. It walks the rows in blocks of 16-64
               (its band of x and gy, about 256 KiB, stays cached while all its items pass over
               the block) and its items in column order within a block, so consecutive items
               read neighbouring columns of the same rows. Running each item over all rows
               instead (strided by a whole row, a new cache line per row) took 10.2 ms at
               B=2048 G=256 10x10, against 1.9-2.0 ms in these blocks (prototype, bare kernel). */
            int64_t ga = a / (otiles * ichunks), gz = (b - 1) / (otiles * ichunks) + 1;
            int64_t band = (gz - ga) * (I + O) * (int64_t)sizeof(T) + 128;
            int64_t rb = (256 * 1024) / band;
            if (rb < 16) rb = 16;
            if (rb > 64) rb = 64;
            for (int64_t n0 = 0; n0 < rows; n0 += rb) {
                int64_t n1 = n0 + rb < rows ? n0 + rb : rows;
                if (otiles == 1 && ichunks == 1) {
                    CAT(wtile_groups_any, SFX)(gy, ldgy, x, ldx, n0, n1, gw, gb, n0 == 0, I, O, a, b, (int)O, nvmax);
                    continue;
                }
                for (int64_t it = a; it < b; it++) {
                    int64_t g = it / (otiles * ichunks), rem = it % (otiles * ichunks);
                    int64_t ot = rem / ichunks, ch = rem % ichunks;
                    int64_t o0 = ot * rt;
                    int rr = (int)(O - o0 < rt ? O - o0 : rt);
                    int64_t i0 = ch * MAXNV * VL;
                    int64_t iw = I - i0 < MAXNV * VL ? I - i0 : MAXNV * VL;
                    int nv = (int)((iw + VL - 1) / VL);
                    CAT(wtile_any, SFX)(gy + g * O + o0, ldgy, x + g * I + i0, ldx, n0, n1,
                                        gw + (g * O + o0) * I + i0, I, iw,
                                        (gb && ch == 0) ? gb + g * O + o0 : 0, n0 == 0, rr, nv);
                }
            }
        }
    }
}
#undef CAT2
#undef CAT
#undef MAXNV
#undef MASK
#undef ROWS8
#undef ROWS16
#undef DISPATCH
#undef RTILE
#undef WRTILE
