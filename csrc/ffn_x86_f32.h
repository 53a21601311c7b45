/*
 * ffn_x86_f32.h (private, included twice by ffn_x86.c): the float32
 * kernels of one x86 path, written once over that path's vector: L lanes
 * of type VF (VI for integers), functions named with SFX, compiled with
 * the path's target attribute TGT. The including file defines those and
 * the vector helpers used below (vload, vfma, lookup16, widen_bytes, ...);
 * the end of this file undefines them.
 *
 * Sums (the sequence every loop below performs, see ffn_internal.h):
 *
 *   DOT (stored (out, in); int4 and MXFP4 in EO64 order, plain in input
 *   order). A row's weights, in the kernel's order, are vectors n = 0, 1,
 *   ... of L; vector n adds w * x into chain n mod 4 of the (token,
 *   output) (an FMA per lane), in increasing n; the result is the lane tree
 *   of (c0 + c1) + (c2 + c3). A weight is its value rounded once: (q - z)
 *   * s, e2m1 * 2^e, fp8 * its block scale.
 *
 *   GROUPED (GPTQ, AWQ without act order; one lane per output). Per group
 *   g of consecutive inputs: p = 0, then p = fma(q_k, x_k, p) over its
 *   inputs in order (q_k the stored nibble), then
 *   acc = fma(p - z_g * xs_g, s_g, acc), the first product rounded in an
 *   FMA (xs_g: coli_ffn_group_sum of the token's inputs of the group).
 *
 *   SINGLE (GPTQ with act order, plain and FP8 stored (in, out)): one
 *   running sum per output, acc = fma(w_k, x_k, acc) in input order, w_k =
 *   q_k * s_g(k) (exact) or the plain value times its scale; act order then
 *   takes acc = fma(-(z_g s_g), X_g, acc) group after group (X_g: the sum
 *   of the token's inputs of group g, in input order).
 *
 * Batches of at most COLI_FFN_STREAM_TOKENS tokens stream the weights in
 * stored order (rows of a DOT matrix one after another; whole stored rows
 * of the thread's outputs for the others, act order: of a panel of them
 * at a time, ax_act_panel). Larger batches decode rows into a tile once
 * and run the token blocks over it.
 */

#define FN2(name, sfx) name##_##sfx
#define FN1(name, sfx) FN2(name, sfx)
#define FN(name) FN1(name, SFX)

enum { FN(VPB) = COLI_FFN_BLOCK / L };  /* vectors per block of 64 inputs */

/* ------------------------------------------------------------ DOT */

/* What a DOT row decodes from: a nibble matrix's group tables, or a plain
 * one's element size. slow: a row the vector decoders cannot take (an
 * int4 group not a multiple of 32 inputs, FP8 scale blocks narrower than
 * a vector), decoded by the scalar code into a row buffer instead. */
typedef struct {
    const ColiFfnMat *m;
    int nibbles, slow, eb;
    ColiTensorFormat f;         /* the element type of a plain matrix (FP8 blocks: e4m3) */
    int64_t row_bytes, blocks;
    int block_bytes;            /* stored bytes of a block of 64 inputs */
} FN(DotInfo);

static FN(DotInfo) FN(dot_info)(const ColiFfnMat *m) {
    FN(DotInfo) d;
    memset(&d, 0, sizeof d);
    d.m = m;
    d.nibbles = m->format == COLI_TENSOR_INT4_BLOCK || m->format == COLI_TENSOR_FP4_NATIVE_BLOCK;
    d.eb = d.nibbles ? 0 : x86_elem_bytes(m->format);
    d.f = m->format == COLI_TENSOR_FP8_E4M3_BLOCK ? COLI_TENSOR_F8_E4M3 : m->format;
    d.slow = d.nibbles ? m->group % 32 != 0
                       : m->format == COLI_TENSOR_FP8_E4M3_BLOCK && m->block_columns % L != 0;
    d.row_bytes = d.nibbles ? m->n_in / 2 : m->n_in * d.eb;
    d.blocks = (m->n_in + COLI_FFN_BLOCK - 1) / COLI_FFN_BLOCK;
    d.block_bytes = d.nibbles ? COLI_FFN_BLOCK / 2 : COLI_FFN_BLOCK * d.eb;
    return d;
}

static const ColiTensorFormat FN(KIND_FORMAT)[N_KINDS] = {
    COLI_TENSOR_INT4_BLOCK, COLI_TENSOR_F32, COLI_TENSOR_F16, COLI_TENSOR_BF16,
    COLI_TENSOR_F8_E4M3, COLI_TENSOR_F8_E5M2};

/* A block's bytes, copied into pad when the row ends inside it. */
static const uint8_t *FN(block_src)(const uint8_t *src, int64_t k0, int64_t n_in, int nibbles,
                                    int eb, uint8_t *pad) {
    if (k0 + COLI_FFN_BLOCK <= n_in) return src;
    memset(pad, 0, COLI_FFN_BLOCK * 4);
    memcpy(pad, src, (size_t)(nibbles ? (n_in - k0) / 2 : (n_in - k0) * eb));
    return pad;
}

/* Walks row O of a nibble matrix (groups a multiple of 32 inputs) block by
 * block: BODY runs with w[VPB] (the block's vectors) and b. The group's
 * table changes where a count of inputs runs out, not by division. */
#define NIB_WALK(D, O, BODY)                                                                 \
    do {                                                                                     \
        const ColiFfnMat *m_ = (D)->m;                                                       \
        const uint8_t *src_ = m_->data + (O) * (D)->row_bytes;                               \
        int64_t g_ = 0, left_ = m_->group;                                                   \
        TAB16 tab_ = FN(nibble_table)(m_, (O), 0);                                           \
        for (int64_t b = 0; b < (D)->blocks; b++, src_ += 32) {                              \
            uint8_t pad_[COLI_FFN_BLOCK * 4];                                                \
            const uint8_t *p_ = FN(block_src)(src_, b * COLI_FFN_BLOCK, m_->n_in, 1, 0, pad_); \
            ffn_prefetch2((const char *)src_, COLI_FFN_PREFETCH);                            \
            TAB16 th_[2];                                                                    \
            UNROLL for (int h_ = 0; h_ < 2; h_++) {                                          \
                th_[h_] = tab_;                                                              \
                left_ -= 32;                                                                 \
                if (left_ == 0 && g_ + 1 < m_->groups) {                                     \
                    tab_ = FN(nibble_table)(m_, (O), ++g_);                                  \
                    left_ = m_->group;                                                       \
                }                                                                            \
            }                                                                                \
            VF w[FN(VPB)];                                                                   \
            UNROLL for (int v_ = 0; v_ < FN(VPB); v_++) {                                    \
                int even_ = v_ * L < 32, j_ = even_ ? v_ * L : v_ * L - 32;                  \
                VI q_ = widen_bytes(p_ + j_);                                                \
                w[v_] = lookup16(th_[j_ >= 16], even_ ? q_ : vsrli(q_, 4));                  \
            }                                                                                \
            BODY                                                                             \
        }                                                                                    \
    } while (0)

/* Walks row O of a plain matrix of format F (FP8 blocks: F e4m3 and
 * scaled per run of block_columns, a multiple of L) the same way. */
#define PLAIN_WALK(D, O, F, BODY)                                                            \
    do {                                                                                     \
        const ColiFfnMat *m_ = (D)->m;                                                       \
        const int eb_ = x86_elem_bytes(F);                                                   \
        const uint8_t *src_ = m_->data + (O) * (D)->row_bytes;                               \
        const int scaled_ = m_->format == COLI_TENSOR_FP8_E4M3_BLOCK;                        \
        const float *srow_ = NULL;                                                           \
        int64_t left_ = 0;                                                                   \
        VF sc_ = vset1(1.0f);                                                                \
        if (scaled_) {                                                                       \
            srow_ = (const float *)m_->scales + ((O) / m_->block_rows) *                     \
                    ((m_->cols + m_->block_columns - 1) / m_->block_columns);                \
            sc_ = vset1(*srow_);                                                             \
            left_ = m_->block_columns;                                                       \
        }                                                                                    \
        for (int64_t b = 0; b < (D)->blocks; b++, src_ += COLI_FFN_BLOCK * eb_) {            \
            uint8_t pad_[COLI_FFN_BLOCK * 4];                                                \
            const uint8_t *p_ = FN(block_src)(src_, b * COLI_FFN_BLOCK, m_->n_in, 0, eb_, pad_); \
            UNROLL for (int i_ = 0; i_ < eb_; i_++)                                          \
                ffn_prefetch2((const char *)src_ + 64 * i_, COLI_FFN_PREFETCH);              \
            VF w[FN(VPB)];                                                                   \
            UNROLL for (int v_ = 0; v_ < FN(VPB); v_++) {                                    \
                w[v_] = plain_vec(F, p_ + v_ * L * eb_);                                     \
                if (scaled_) {                                                               \
                    w[v_] = vmul(w[v_], sc_);                                                \
                    left_ -= L;                                                              \
                    if (left_ == 0 && b * COLI_FFN_BLOCK + (v_ + 1) * L < m_->n_in) {       \
                        sc_ = vset1(*++srow_);                                               \
                        left_ = m_->block_columns;                                           \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
            BODY                                                                             \
        }                                                                                    \
    } while (0)

/* Either walk for a kind known at compile time. */
#define ROW_WALK(KIND, D, O, BODY)                                                           \
    do {                                                                                     \
        if (KIND == K_NIB) NIB_WALK(D, O, BODY);                                             \
        else PLAIN_WALK(D, O, FN(KIND_FORMAT)[KIND], BODY);                                  \
    } while (0)

/* Row o decoded by the scalar code into buf, in the kernel's order. */
static void FN(dot_slow_row)(const FN(DotInfo) *d, int64_t o, float *buf, float *natural) {
    const ColiFfnMat *m = d->m;
    int order = d->nibbles ? COLI_FFN_ORDER_EO64 : COLI_FFN_ORDER_PLAIN;
    coli_ffn_dot_row(m, o, natural);
    memset(buf, 0, sizeof(float) * (size_t)(d->blocks * COLI_FFN_BLOCK));
    for (int64_t k = 0; k < m->n_in; k++) buf[coli_ffn_pos(order, k)] = natural[k];
}

TGT INLINE float FN(dot_result)(VF c0, VF c1, VF c2, VF c3) {
    return vtree(vadd(vadd(c0, c1), vadd(c2, c3)));
}

/* Streaming: rows one after another, TB tokens, rows of one kind. */
#define DOT_STREAM(KIND, TB)                                                                 \
    TGT static void FN(dot_stream_##KIND##_##TB)(const FN(DotInfo) *d, int64_t n0, int64_t n1, \
                                                 const ColiFfnTask *task, int t0, float *buf) { \
        const float *x = (const float *)task->x + t0 * task->ldx;                            \
        const int64_t ldx = task->ldx;                                                       \
        float *dst = task->dst + t0 * task->ld_dst;                                          \
        const int64_t ld_dst = task->ld_dst;                                                 \
        for (int64_t o = n0; o < n1; o++) {                                                  \
            VF c[TB][4];                                                                     \
            UNROLL for (int t = 0; t < TB; t++)                                              \
                UNROLL for (int j = 0; j < 4; j++) c[t][j] = vzero();                        \
            if (d->slow) {                                                                   \
                FN(dot_slow_row)(d, o, buf, buf + d->blocks * COLI_FFN_BLOCK);               \
                for (int64_t b = 0; b < d->blocks; b++)                                      \
                    UNROLL for (int v = 0; v < FN(VPB); v++)                                 \
                        UNROLL for (int t = 0; t < TB; t++)                                  \
                            c[t][v % 4] = vfma(vload(buf + b * COLI_FFN_BLOCK + v * L),      \
                                               vload(x + t * ldx + b * COLI_FFN_BLOCK + v * L), \
                                               c[t][v % 4]);                                 \
            } else {                                                                         \
                ROW_WALK(KIND, d, o, {                                                       \
                    UNROLL for (int v = 0; v < FN(VPB); v++)                                 \
                        UNROLL for (int t = 0; t < TB; t++)                                  \
                            c[t][v % 4] = vfma(w[v], vload(x + t * ldx + b * COLI_FFN_BLOCK  \
                                                           + v * L), c[t][v % 4]);           \
                });                                                                          \
            }                                                                                \
            UNROLL for (int t = 0; t < TB; t++)                                              \
                dst[t * ld_dst + o] = FN(dot_result)(c[t][0], c[t][1], c[t][2], c[t][3]);    \
        }                                                                                    \
    }
#define DOT_STREAMS(KIND) DOT_STREAM(KIND, 1) DOT_STREAM(KIND, 2) DOT_STREAM(KIND, 3) DOT_STREAM(KIND, 4)
DOT_STREAMS(K_NIB)
DOT_STREAMS(K_F32)
DOT_STREAMS(K_F16)
DOT_STREAMS(K_BF16)
DOT_STREAMS(K_E4M3)
DOT_STREAMS(K_E5M2)
#undef DOT_STREAMS
#undef DOT_STREAM

typedef void (*FN(DotStreamFn))(const FN(DotInfo) *d, int64_t n0, int64_t n1,
                                const ColiFfnTask *task, int t0, float *buf);
#define DOT_ROW_OF(KIND) \
    {FN(dot_stream_##KIND##_1), FN(dot_stream_##KIND##_2), FN(dot_stream_##KIND##_3), FN(dot_stream_##KIND##_4)}
static const FN(DotStreamFn) FN(DOT_STREAMS)[N_KINDS][4] = {
    DOT_ROW_OF(K_NIB), DOT_ROW_OF(K_F32), DOT_ROW_OF(K_F16), DOT_ROW_OF(K_BF16),
    DOT_ROW_OF(K_E4M3), DOT_ROW_OF(K_E5M2)};
#undef DOT_ROW_OF

/* Tile: one row decoded into row (the kernel's order), per kind. */
#define DOT_DECODE(KIND)                                                                     \
    TGT static void FN(dot_decode_##KIND)(const FN(DotInfo) *d, int64_t o, float *row) {    \
        ROW_WALK(KIND, d, o, {                                                               \
            UNROLL for (int v = 0; v < FN(VPB); v++) vstore(row + b * COLI_FFN_BLOCK + v * L, w[v]); \
        });                                                                                  \
    }
DOT_DECODE(K_NIB)
DOT_DECODE(K_F32)
DOT_DECODE(K_F16)
DOT_DECODE(K_BF16)
DOT_DECODE(K_E4M3)
DOT_DECODE(K_E5M2)
#undef DOT_DECODE
static void (*const FN(DOT_DECODES)[N_KINDS])(const FN(DotInfo) *, int64_t, float *) = {
    FN(dot_decode_K_NIB), FN(dot_decode_K_F32), FN(dot_decode_K_F16), FN(dot_decode_K_BF16),
    FN(dot_decode_K_E4M3), FN(dot_decode_K_E5M2)};

enum { FN(TILE_ROWS) = DOT_ROWS };

/* Tile: chain j of TB tokens over four decoded rows (tile rows of ld
 * floats), into acc[t][r][j]. */
#define DOT_TILE(TB)                                                                         \
    TGT static void FN(dot_tile_##TB)(const float *tile, int64_t ld, int64_t nvec,           \
                                      const float *x, int64_t ldx, float *acc) {             \
        UNROLL for (int j = 0; j < 4; j++) {                                                 \
            VF a[TB][FN(TILE_ROWS)];                                                         \
            UNROLL for (int t = 0; t < TB; t++)                                              \
                UNROLL for (int r = 0; r < FN(TILE_ROWS); r++) a[t][r] = vzero();            \
            for (int64_t v = j; v < nvec; v += 4) {                                          \
                VF w[FN(TILE_ROWS)];                                                         \
                UNROLL for (int r = 0; r < FN(TILE_ROWS); r++) w[r] = vload(tile + r * ld + v * L); \
                UNROLL for (int t = 0; t < TB; t++) {                                        \
                    VF xv = vload(x + t * ldx + v * L);                                      \
                    UNROLL for (int r = 0; r < FN(TILE_ROWS); r++) a[t][r] = vfma(w[r], xv, a[t][r]); \
                }                                                                            \
            }                                                                                \
            UNROLL for (int t = 0; t < TB; t++)                                              \
                UNROLL for (int r = 0; r < FN(TILE_ROWS); r++)                               \
                    vstore(acc + ((t * FN(TILE_ROWS) + r) * 4 + j) * L, a[t][r]);            \
        }                                                                                    \
    }
DOT_TILE(1)
DOT_TILE(2)
DOT_TILE(3)
DOT_TILE(4)
#undef DOT_TILE

static size_t FN(dot_scratch)(const ColiFfnMat *m, int64_t n0, int64_t n1, int tokens) {
    (void)n0, (void)n1;
    int64_t row = coli_ffn_round_up(m->n_in, COLI_FFN_BLOCK);
    int64_t tile = tokens <= COLI_FFN_STREAM_TOKENS ? 2 * row : FN(TILE_ROWS) * row + m->n_in;
    return sizeof(float) * (size_t)(tile + 4 * FN(TILE_ROWS) * 4 * L);
}

TGT static void FN(dot_tiled)(const FN(DotInfo) *d, int64_t n0, int64_t n1, const ColiFfnTask *task) {
    int64_t ld = d->blocks * COLI_FFN_BLOCK, nvec = ld / L;
    float *tile = (float *)task->scratch, *natural = tile + FN(TILE_ROWS) * ld;
    float *acc = natural + d->m->n_in;
    for (int64_t p0 = n0; p0 < n1; p0 += FN(TILE_ROWS)) {
        int nr = n1 - p0 < FN(TILE_ROWS) ? (int)(n1 - p0) : FN(TILE_ROWS);
        for (int r = 0; r < FN(TILE_ROWS); r++) {
            float *row = tile + r * ld;
            if (r >= nr) {
                memset(row, 0, sizeof(float) * (size_t)ld);
            } else if (d->slow) {
                FN(dot_slow_row)(d, p0 + r, row, natural);
            } else {
                FN(DOT_DECODES)[coli_ffn_row_kind(d->m)](d, p0 + r, row);
            }
        }
        for (int t0 = 0; t0 < task->tokens; t0 += 4) {
            int tb = task->tokens - t0 < 4 ? task->tokens - t0 : 4;
            const float *x = (const float *)task->x + t0 * task->ldx;
            switch (tb) {
            case 1: FN(dot_tile_1)(tile, ld, nvec, x, task->ldx, acc); break;
            case 2: FN(dot_tile_2)(tile, ld, nvec, x, task->ldx, acc); break;
            case 3: FN(dot_tile_3)(tile, ld, nvec, x, task->ldx, acc); break;
            default: FN(dot_tile_4)(tile, ld, nvec, x, task->ldx, acc); break;
            }
            for (int t = 0; t < tb; t++)
                for (int r = 0; r < nr; r++) {
                    const float *a = acc + (t * FN(TILE_ROWS) + r) * 4 * L;
                    task->dst[(t0 + t) * task->ld_dst + p0 + r] =
                        FN(dot_result)(vload(a), vload(a + L), vload(a + 2 * L), vload(a + 3 * L));
                }
        }
    }
}

TGT static void FN(dot_run)(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task) {
    FN(DotInfo) d = FN(dot_info)(m);
    if (task->tokens > COLI_FFN_STREAM_TOKENS) {
        FN(dot_tiled)(&d, n0, n1, task);
        return;
    }
    float *buf = (float *)task->scratch;
    const FN(DotStreamFn) *fns = FN(DOT_STREAMS)[coli_ffn_row_kind(m)];
    for (int t0 = 0; t0 < task->tokens; t0 += STREAM_TB) {
        int tb = task->tokens - t0 < STREAM_TB ? task->tokens - t0 : STREAM_TB;
        fns[tb - 1](&d, n0, n1, task, t0, buf);
    }
}

/* ------------------------------------------------------------ AXPY: GPTQ, AWQ, plain (in, out) */

/* A range of outputs of a matrix stored (in, out), as L-lane vectors of
 * sums. GPTQ and plain: vector v holds outputs c0 + vL ... in order. AWQ:
 * a segment of L words is 8L outputs, its vector n the words' nibble n
 * (outputs 8i + order[n]); sums are kept in that order (ax_index). */
typedef struct {
    const ColiFfnMat *m;
    int awq, gptq, grouped, eb;
    ColiTensorFormat f;
    int64_t c0, n;              /* the range's first output and its size */
    int64_t nv, ldp;            /* vectors of sums, and their floats */
    int64_t ahead;              /* prefetch this many stored rows ahead */
} FN(AxInfo);

static FN(AxInfo) FN(ax_info)(const ColiFfnMat *m, int64_t n0, int64_t n1) {
    FN(AxInfo) a;
    memset(&a, 0, sizeof a);
    a.m = m;
    a.awq = m->format == COLI_TENSOR_INT4_AWQ;
    a.gptq = m->format == COLI_TENSOR_INT4_GPTQ;
    a.grouped = (a.awq || a.gptq) && !m->g_idx;
    a.eb = a.awq || a.gptq ? 4 : x86_elem_bytes(m->format);
    a.f = m->format == COLI_TENSOR_FP8_E4M3_BLOCK ? COLI_TENSOR_F8_E4M3 : m->format;
    a.c0 = n0;
    a.n = n1 - n0;
    a.nv = a.awq ? (a.n + 8 * L - 1) / (8 * L) * 8 : (a.n + L - 1) / L;
    a.ldp = a.nv * L;
    int64_t bytes = a.awq ? a.n / 2 : a.n * a.eb;  /* of a stored row, this range's */
    a.ahead = bytes >= COLI_FFN_PREFETCH ? 1 : (COLI_FFN_PREFETCH + bytes - 1) / bytes;
    return a;
}

/* Where output c0 + c's sum is kept. */
static int64_t FN(ax_index)(const FN(AxInfo) *a, int64_t c) {
    if (!a->awq) return c;
    int64_t word = c / 8;
    return (word / L) * 8 * L + COLI_AWQ_NIBBLE[c % 8] * L + word % L;
}

/* Lanes of vector v that hold outputs (the rest are padding). */
static int FN(ax_lanes)(const FN(AxInfo) *a, int64_t v) {
    int64_t units = a->awq ? (a->n + 7) / 8 : a->n, first = a->awq ? (v / 8) * L : v * L;
    return units - first < L ? (int)(units - first) : L;
}

/* Per-output zero points then scales of group g, in sum order (zeros past
 * the range's end), 2 * ldp floats. */
/* Per-output zero points then scales of group g, in sum order (zeros past
 * the range's end), 2 * ldp floats. GPTQ's whole vectors at once, the rest
 * one by one. */
TGT static void FN(ax_params)(const FN(AxInfo) *a, int64_t g, float *zs) {
    const ColiFfnMat *m = a->m;
    memset(zs, 0, sizeof(float) * (size_t)(2 * a->ldp));
    const uint8_t *zrow = m->zeros + g * (m->n_out / 8) * 4;
    int64_t s0 = g * m->n_out + a->c0, c = 0;
    const float zb = (float)m->zero_plus_one;
    for (; a->gptq && c + L <= a->n && m->scale_format != COLI_SCALE_UE8M0; c += L) {
        vstore(zs + c, vadd(vzeros8(zrow + 4 * ((a->c0 + c) / 8)), vset1(zb)));
        vstore(zs + a->ldp + c, vload_scales(m->scale_format, m->scales, s0 + c));
    }
    for (; c < a->n; c++) {
        int64_t i = FN(ax_index)(a, c), col = a->c0 + c;
        int nib = a->awq ? COLI_AWQ_NIBBLE[col % 8] : (int)(col % 8);
        zs[i] = (float)(((zrow[4 * (col / 8) + nib / 2] >> (4 * (nib & 1))) & 0xf) + m->zero_plus_one);
        uint16_t h;
        switch (m->scale_format) {
        case COLI_SCALE_F16:
            memcpy(&h, m->scales + 2 * (s0 + c), sizeof h);
            zs[a->ldp + i] = _cvtsh_ss(h);
            break;
        case COLI_SCALE_BF16:
        case COLI_SCALE_F32: zs[a->ldp + i] = coli_ffn_scale_at(m, s0 + c); break;
        default: zs[a->ldp + i] = coli_ffn_scale(m, s0 + c); break;
        }
    }
}

/* Stored row r's bytes under sum vector v (GPTQ: word row r). */
TGT INLINE const uint8_t *FN(ax_at)(const FN(AxInfo) *a, int64_t r, int64_t v) {
    const ColiFfnMat *m = a->m;
    if (a->awq) return m->data + (r * (m->n_out / 8) + a->c0 / 8 + (v / 8) * L) * 4;
    return m->data + (r * m->n_out + a->c0 + v * L) * a->eb;
}

TGT INLINE VI FN(ax_words)(const FN(AxInfo) *a, int64_t r, int64_t v) {
    return vload_words(FN(ax_at)(a, r, v), FN(ax_lanes)(a, v));
}

/* Prefetches row r + ahead under vector v, once per cache line. */
TGT INLINE void FN(ax_prefetch)(const FN(AxInfo) *a, int64_t r, int64_t v) {
    if (a->awq ? v % 8 : (v * L * a->eb) % 64) return;
    _mm_prefetch((const char *)FN(ax_at)(a, r + a->ahead, v), _MM_HINT_T0);
}

/* Nibble j of each word, as float. */
/* 2^23 and nibble j of each word: 2^23 + q, exactly (see nib_biased). */
enum { FN(AX_BIAS) = 1 << 23 };
TGT INLINE VF FN(ax_nib)(VI words, int j) {
    return vsub(nib_biased(words, j), vset1((float)FN(AX_BIAS)));
}

/* A plain matrix's input k to vector v, times its scales. */
TGT INLINE VF FN(ax_plain)(const FN(AxInfo) *a, int64_t k, int64_t v) {
    const ColiFfnMat *m = a->m;
    int lanes = FN(ax_lanes)(a, v);
    const uint8_t *src = FN(ax_at)(a, k, v);
    uint8_t pad[4 * L];
    if (lanes < L) {
        memset(pad, 0, sizeof pad);
        memcpy(pad, src, (size_t)(lanes * a->eb));
        src = pad;
    }
    VF w = plain_vec(a->f, src);
    if (m->format == COLI_TENSOR_FP8_E4M3_BLOCK)
        w = vmul(w, vset1(x86_fp8_scale(m, k, a->c0 + v * L)));
    return w;
}

/* SINGLE weight of input k to vector v (zg: its group's parameters). */
TGT INLINE VF FN(ax_weight)(const FN(AxInfo) *a, int64_t k, int64_t v, const float *zg) {
    if (!a->gptq) return FN(ax_plain)(a, k, v);
    /* act order: q s, exact (4 and 11 bits); z s comes off per group (ax_correct) */
    return vmul(FN(ax_nib)(FN(ax_words)(a, k / 8, v), (int)(k % 8)), vload(zg + a->ldp + v * L));
}

/* GROUPED, streaming: inputs [k0, k1) of one group into p (TB rows of ldp).
 * GPTQ walks word rows, AWQ four input rows at a time, each across every
 * vector of the range. */
#define AX_GROUP_STREAM(TB)                                                                  \
    TGT static void FN(ax_group_stream_##TB)(const FN(AxInfo) *a, int64_t k0, int64_t k1,  \
                                             int64_t v0, const float *x, int64_t ldx,       \
                                             float *p) {                                     \
        int64_t ldp = a->ldp;                                                                \
        for (int64_t k = k0; k < k1;) {                                                      \
            int64_t r = a->gptq ? k / 8 : k;                                                 \
            int j0 = a->gptq ? (int)(k % 8) : 0;                                             \
            int j1 = a->gptq ? (int)(k1 - 8 * r < 8 ? k1 - 8 * r : 8) : (k1 - k < 4 ? 1 : 4); \
            for (int64_t v = v0; v < a->nv; v++) {                                           \
                FN(ax_prefetch)(a, r, v);                                                    \
                VF q[8];                                                                     \
                int nq = j1 - j0;                                                            \
                if (a->gptq) {                                                               \
                    VI words = FN(ax_words)(a, r, v);                                        \
                    if (nq == 8) {                                                           \
                        UNROLL for (int j = 0; j < 8; j++) q[j] = FN(ax_nib)(words, j);      \
                    } else {                                                                 \
                        for (int j = j0; j < j1; j++) q[j - j0] = FN(ax_nib)(words, j);      \
                    }                                                                        \
                } else {                                                                     \
                    for (int j = 1; j < nq; j++) FN(ax_prefetch)(a, r + j, v);               \
                    for (int j = 0; j < nq; j++)                                             \
                        q[j] = FN(ax_nib)(FN(ax_words)(a, r + j, v), (int)(v % 8));          \
                }                                                                            \
                const float *xk = x + (a->gptq ? 8 * r + j0 : k);                            \
                UNROLL for (int t = 0; t < TB; t++) {                                        \
                    VF s = vload(p + t * ldp + v * L);                                       \
                    if (nq == 8) {                                                           \
                        UNROLL for (int j = 0; j < 8; j++) s = vfma(q[j], vset1(xk[t * ldx + j]), s); \
                    } else if (nq == 4) {                                                    \
                        UNROLL for (int j = 0; j < 4; j++) s = vfma(q[j], vset1(xk[t * ldx + j]), s); \
                    } else {                                                                 \
                        for (int j = 0; j < nq; j++) s = vfma(q[j], vset1(xk[t * ldx + j]), s); \
                    }                                                                        \
                    vstore(p + t * ldp + v * L, s);                                          \
                }                                                                            \
            }                                                                                \
            k = a->gptq ? 8 * r + j1 : k + j1;                                               \
        }                                                                                    \
    }
AX_GROUP_STREAM(1)
AX_GROUP_STREAM(2)
AX_GROUP_STREAM(3)
AX_GROUP_STREAM(4)
#undef AX_GROUP_STREAM

TGT static void FN(ax_group_stream_tail)(const FN(AxInfo) *a, int64_t k0, int64_t k1, int64_t v0,
                                         const float *x, int64_t ldx, float *p, int tb) {
    switch (tb) {
    case 1: FN(ax_group_stream_1)(a, k0, k1, v0, x, ldx, p); break;
    case 2: FN(ax_group_stream_2)(a, k0, k1, v0, x, ldx, p); break;
    case 3: FN(ax_group_stream_3)(a, k0, k1, v0, x, ldx, p); break;
    default: FN(ax_group_stream_4)(a, k0, k1, v0, x, ldx, p); break;
    }
}

/* GROUPED, streaming, whole words and vectors (GPTQ with groups of 8k
 * inputs, AWQ): the same sums as ax_group_stream without a per-vector
 * lane count or mask; vectors past nvf (a partial one) go the slow way. */
#define AX_FAST_STREAM(TB)                                                                   \
    TGT static void FN(ax_fast_stream_##TB)(const FN(AxInfo) *a, int64_t k0, int64_t k1,   \
                                            int64_t nvf, const float *x, int64_t ldx, float *p) { \
        const ColiFfnMat *m = a->m;                                                          \
        int64_t ldp = a->ldp;                                                                \
        if (a->gptq) {                                                                       \
            const int64_t rs = m->n_out * 4;                                                 \
            for (int64_t r = k0 / 8; r < k1 / 8; r++) {                                      \
                const uint8_t *row = m->data + r * rs + a->c0 * 4;                           \
                const float *xk = x + 8 * r;                                                 \
                for (int64_t v = 0; v < nvf; v++) {                                          \
                    if ((v * L * 4) % 64 == 0)                                               \
                        _mm_prefetch((const char *)row + v * L * 4 + a->ahead * rs, _MM_HINT_T0); \
                    VI words = vload_words(row + v * L * 4, L);                              \
                    VF q[8];                                                                 \
                    UNROLL for (int j = 0; j < 8; j++) q[j] = FN(ax_nib)(words, j);          \
                    UNROLL for (int t = 0; t < TB; t++) {                                    \
                        VF s = vload(p + t * ldp + v * L);                                   \
                        UNROLL for (int j = 0; j < 8; j++) s = vfma(q[j], vset1(xk[t * ldx + j]), s); \
                        vstore(p + t * ldp + v * L, s);                                      \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
            return;                                                                          \
        }                                                                                    \
        const int64_t rs = m->n_out / 2;                                                     \
        for (int64_t k = k0; k < k1; k += 4) {                                               \
            int nr = k1 - k < 4 ? (int)(k1 - k) : 4;                                         \
            const uint8_t *row = m->data + k * rs + a->c0 / 2;                               \
            for (int64_t sg = 0; sg < nvf / 8; sg++) {                                       \
                VI w[4];                                                                     \
                for (int i = 0; i < nr; i++) {                                               \
                    _mm_prefetch((const char *)row + (i + a->ahead) * rs + sg * L * 4, _MM_HINT_T0); \
                    w[i] = vload_words(row + i * rs + sg * L * 4, L);                        \
                }                                                                            \
                UNROLL for (int n = 0; n < 8; n++) {                                         \
                    float *pv = p + (8 * sg + n) * L;                                        \
                    if (nr == 4) {                                                           \
                        VF q[4];                                                             \
                        UNROLL for (int i = 0; i < 4; i++) q[i] = FN(ax_nib)(w[i], n);       \
                        UNROLL for (int t = 0; t < TB; t++) {                                \
                            VF s = vload(pv + t * ldp);                                      \
                            UNROLL for (int i = 0; i < 4; i++)                               \
                                s = vfma(q[i], vset1(x[t * ldx + k + i]), s);                \
                            vstore(pv + t * ldp, s);                                         \
                        }                                                                    \
                    } else {                                                                 \
                        for (int i = 0; i < nr; i++) {                                       \
                            VF q = FN(ax_nib)(w[i], n);                                      \
                            UNROLL for (int t = 0; t < TB; t++)                              \
                                vstore(pv + t * ldp, vfma(q, vset1(x[t * ldx + k + i]),      \
                                                          vload(pv + t * ldp)));             \
                        }                                                                    \
                    }                                                                        \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }
AX_FAST_STREAM(1)
AX_FAST_STREAM(2)
AX_FAST_STREAM(3)
AX_FAST_STREAM(4)
#undef AX_FAST_STREAM

/* SINGLE, streaming: every input added into acc (TB rows of ldp); zs: the
 * act-order parameters of every group (2 * ldp floats each), or NULL. */
#define AX_SINGLE_STREAM(TB)                                                                 \
    TGT static void FN(ax_single_stream_##TB)(const FN(AxInfo) *a, int64_t v0, const float *x, \
                                              int64_t ldx, float *acc, const float *zs) {    \
        const ColiFfnMat *m = a->m;                                                          \
        int64_t ldp = a->ldp;                                                                \
        for (int64_t k = 0; k < m->n_in; k++) {                                              \
            const float *zg = a->gptq ? zs + 2 * ldp * coli_ffn_group_of(m, k) : NULL;      \
            int64_t r = a->gptq ? k / 8 : k;                                                 \
            for (int64_t v = v0; v < a->nv; v++) {                                           \
                if (!a->gptq || k % 8 == 0) FN(ax_prefetch)(a, r, v);                        \
                VF w = FN(ax_weight)(a, k, v, zg);                                           \
                UNROLL for (int t = 0; t < TB; t++)                                          \
                    vstore(acc + t * ldp + v * L, vfma(w, vset1(x[t * ldx + k]),             \
                                                       vload(acc + t * ldp + v * L)));       \
            }                                                                                \
        }                                                                                    \
    }
AX_SINGLE_STREAM(1)
AX_SINGLE_STREAM(2)
AX_SINGLE_STREAM(3)
AX_SINGLE_STREAM(4)
#undef AX_SINGLE_STREAM

/* SINGLE GPTQ with act order, whole vectors: a word row's eight inputs
 * from one load, each weight q s with its own group's scales (the same sums
 * as ax_single_stream); stored rows streamed in order, so that cold weights
 * stream at the memory's rate. */
#define AX_ACT_STREAM(TB)                                                                    \
    TGT static void FN(ax_act_stream_##TB)(const FN(AxInfo) *a, int64_t nvf, const float *x, \
                                           int64_t ldx, float *acc, const float *zs) {       \
        const ColiFfnMat *m = a->m;                                                          \
        const int64_t ldp = a->ldp, rs = m->n_out * 4;                                       \
        for (int64_t r = 0; r < m->n_in / 8; r++) {                                          \
            const uint8_t *row = m->data + r * rs + a->c0 * 4;                               \
            const float *sg[8];                                                              \
            VF xb[TB][8];                                                                    \
            UNROLL for (int j = 0; j < 8; j++) {                                             \
                sg[j] = zs + 2 * ldp * coli_ffn_group_of(m, 8 * r + j) + ldp;                \
                UNROLL for (int t = 0; t < TB; t++) xb[t][j] = vset1(x[t * ldx + 8 * r + j]); \
            }                                                                                \
            for (int64_t v = 0; v < nvf; v++) {                                              \
                if ((v * L * 4) % 64 == 0)                                                   \
                    ffn_prefetch2((const char *)row + v * L * 4, a->ahead * rs);             \
                VI words = vload_words(row + v * L * 4, L);                                  \
                VF w[8];                                                                     \
                UNROLL for (int j = 0; j < 8; j++) w[j] = vmul(FN(ax_nib)(words, j), vload(sg[j] + v * L)); \
                UNROLL for (int t = 0; t < TB; t++) {                                        \
                    VF s = vload(acc + t * ldp + v * L);                                     \
                    UNROLL for (int j = 0; j < 8; j++) s = vfma(w[j], xb[t][j], s);          \
                    vstore(acc + t * ldp + v * L, s);                                        \
                }                                                                            \
            }                                                                                \
        }                                                                                    \
    }
AX_ACT_STREAM(1)
AX_ACT_STREAM(2)
AX_ACT_STREAM(3)
AX_ACT_STREAM(4)
#undef AX_ACT_STREAM

/* acc = fma(p - z * xs, s, acc) for every token of a group. */
TGT static void FN(ax_flush)(const FN(AxInfo) *a, const float *zs, const float *xs, int64_t ldxs,
                             int64_t g, int tokens, const float *p, float *acc) {
    int64_t ldp = a->ldp;
    for (int t = 0; t < tokens; t++) {
        VF xsv = vset1(xs[t * ldxs + g]);
        for (int64_t v = 0; v < a->nv; v++) {
            VF d = vfnmadd(vload(zs + v * L), xsv, vload(p + t * ldp + v * L));
            vstore(acc + t * ldp + v * L,
                   vfma(d, vload(zs + ldp + v * L), vload(acc + t * ldp + v * L)));
        }
    }
}

/* Through a tile: a panel of at most 8 vectors, inputs in chunks of
 * AX_CHUNK decoded once (q, or SINGLE weights) and run for every token:
 * four tokens by AX_NV / 2 vectors at a time, the rest two or one by AX_NV
 * (four by half the vectors: fewer loads per FMA, measured faster). */
enum { FN(AX_CHUNK) = 64, FN(AX_PANEL) = 8 };

/* TB tokens by NV vectors of the tile (panel rows of PANEL vectors): each
 * sum takes its inputs in order, one FMA each. */
#define AX_TILE(TB, NV)                                                                      \
    TGT static void FN(ax_tile_##TB)(const float *tile, int kc, const float *x, int64_t ldx, \
                                     float *sums, int64_t ldp) {                             \
        VF s[TB][NV];                                                                        \
        UNROLL for (int t = 0; t < TB; t++)                                                  \
            UNROLL for (int v = 0; v < NV; v++) s[t][v] = vload(sums + t * ldp + v * L);     \
        for (const float *tj = tile, *xj = x; xj < x + kc; tj += FN(AX_PANEL) * L, xj++) {   \
            VF w[NV];                                                                        \
            UNROLL for (int v = 0; v < NV; v++) w[v] = vload(tj + v * L);                    \
            UNROLL for (int t = 0; t < TB; t++) {                                            \
                VF xv = vset1(xj[t * ldx]);                                                  \
                UNROLL for (int v = 0; v < NV; v++) s[t][v] = vfma(w[v], xv, s[t][v]);       \
            }                                                                                \
        }                                                                                    \
        UNROLL for (int t = 0; t < TB; t++)                                                  \
            UNROLL for (int v = 0; v < NV; v++) vstore(sums + t * ldp + v * L, s[t][v]);     \
    }
AX_TILE(1, AX_NV)
AX_TILE(2, AX_NV)
AX_TILE(4, AX_NV / 2)
#undef AX_TILE

TGT static void FN(ax_decode_tile)(const FN(AxInfo) *a, int64_t k0, int kc, const float *zs,
                                   float *tile) {
    const ColiFfnMat *m = a->m;
    if (a->grouped && a->nv == FN(AX_PANEL) && FN(ax_lanes)(a, a->nv - 1) == L &&
        (a->awq || (k0 % 8 == 0 && kc % 8 == 0))) {  /* whole words, the fast way */
        for (int j = 0; j < kc; j += a->gptq ? 8 : 1) {
            const uint8_t *row = a->gptq ? m->data + ((k0 + j) / 8 * m->n_out + a->c0) * 4
                                         : m->data + (k0 + j) * (m->n_out / 2) + a->c0 / 2;
            if (a->gptq) {
                UNROLL for (int v = 0; v < FN(AX_PANEL); v++) {
                    VI words = vload_words(row + v * L * 4, L);
                    UNROLL for (int i = 0; i < 8; i++)
                        vstore(tile + ((j + i) * FN(AX_PANEL) + v) * L, FN(ax_nib)(words, i));
                }
            } else {
                VI words = vload_words(row, L);
                UNROLL for (int n = 0; n < 8; n++)
                    vstore(tile + (j * FN(AX_PANEL) + n) * L, FN(ax_nib)(words, n));
            }
        }
        return;
    }
    if (a->gptq && !a->grouped && a->nv == FN(AX_PANEL) && FN(ax_lanes)(a, a->nv - 1) == L &&
        k0 % 8 == 0 && kc % 8 == 0) {  /* act order, whole words: each word once */
        for (int j = 0; j < kc; j += 8) {
            const uint8_t *row = m->data + ((k0 + j) / 8 * m->n_out + a->c0) * 4;
            const float *sg[8];
            UNROLL for (int i = 0; i < 8; i++)
                sg[i] = zs + 2 * a->ldp * coli_ffn_group_of(m, k0 + j + i) + a->ldp;
            UNROLL for (int v = 0; v < FN(AX_PANEL); v++) {
                if ((v * L * 4) % 64 == 0) ffn_prefetch2((const char *)row + v * L * 4, a->ahead * m->n_out * 4);
                VI words = vload_words(row + v * L * 4, L);
                UNROLL for (int i = 0; i < 8; i++)  /* as ax_weight */
                    vstore(tile + ((j + i) * FN(AX_PANEL) + v) * L,
                           vmul(FN(ax_nib)(words, i), vload(sg[i] + v * L)));
            }
        }
        return;
    }
    for (int j = 0; j < kc; j++) {
        int64_t k = k0 + j;
        const float *zg = a->gptq && !a->grouped ? zs + 2 * a->ldp * coli_ffn_group_of(a->m, k) : NULL;
        for (int64_t v = 0; v < FN(AX_PANEL); v++) {
            VF w = vzero();
            if (v >= a->nv) {
                /* padding: a partial panel */
            } else if (a->grouped) {
                w = FN(ax_nib)(FN(ax_words)(a, a->gptq ? k / 8 : k, v),
                               (int)(a->gptq ? k % 8 : v % 8));
            } else {
                w = FN(ax_weight)(a, k, v, zg);
            }
            vstore(tile + (j * FN(AX_PANEL) + v) * L, w);
        }
    }
}

TGT static void FN(ax_tile_tokens)(const float *tile, int kc, const float *x, int64_t ldx,
                                   int tokens, float *sums, int64_t ldp) {
    int t4 = tokens / 4 * 4;  /* blocks of four tokens by half the vectors, then the rest */
    for (int v0 = 0; v0 < FN(AX_PANEL); v0 += AX_NV / 2)
        for (int t = 0; t < t4; t += 4)
            FN(ax_tile_4)(tile + v0 * L, kc, x + t * ldx, ldx, sums + t * ldp + v0 * L, ldp);
    for (int v0 = 0; v0 < FN(AX_PANEL); v0 += AX_NV)
        for (int t = t4; t < tokens;) {
            if (tokens - t >= 2) {
                FN(ax_tile_2)(tile + v0 * L, kc, x + t * ldx, ldx, sums + t * ldp + v0 * L, ldp);
                t += 2;
            } else {
                FN(ax_tile_1)(tile + v0 * L, kc, x + t * ldx, ldx, sums + t * ldp + v0 * L, ldp);
                t++;
            }
        }
}

/* Scratch: acc and p (tokens x ldp each), the parameters, a tile; act
 * order: the tokens' group sums. */
static size_t FN(ax_scratch)(const ColiFfnMat *m, int64_t n0, int64_t n1, int tokens) {
    int64_t ldp = tokens <= COLI_FFN_STREAM_TOKENS ? FN(ax_info)(m, n0, n1).ldp
                                                   : FN(AX_PANEL) * L;
    int64_t zs = 2 * ldp * (m->g_idx ? m->groups : 1), xg = m->g_idx ? tokens * m->groups : 0;
    return sizeof(float) * (size_t)(2 * ldp * tokens + zs + FN(AX_CHUNK) * FN(AX_PANEL) * L + xg);
}

/* Act order: each token's sum of the inputs of each group, in input order. */
static void FN(ax_group_inputs)(const ColiFfnMat *m, const ColiFfnTask *task, float *X) {
    const float *x = (const float *)task->x;
    memset(X, 0, sizeof(float) * (size_t)(task->tokens * m->groups));
    for (int t = 0; t < task->tokens; t++)
        for (int64_t k = 0; k < m->n_in; k++) X[t * m->groups + coli_ffn_group_of(m, k)] += x[t * task->ldx + k];
}

/* Act order: the groups' z s X off every sum, group after group (zs: z s
 * then s per group; X: ax_group_inputs'). */
TGT static void FN(ax_correct)(const FN(AxInfo) *a, const float *zs, const float *X, int tokens,
                               float *acc) {
    const ColiFfnMat *m = a->m;
    for (int64_t g = 0; g < m->groups; g++)
        for (int t = 0; t < tokens; t++) {
            VF xg = vset1(X[t * m->groups + g]);
            for (int64_t v = 0; v < a->nv; v++)
                vstore(acc + t * a->ldp + v * L, vfnmadd(vload(zs + 2 * a->ldp * g + v * L), xg,
                                                         vload(acc + t * a->ldp + v * L)));
        }
}

/* Sums of one range (the thread's, streaming; a panel, tiled) into dst (X:
 * act order's group sums of the inputs). */
TGT static void FN(ax_sums)(const FN(AxInfo) *a, const ColiFfnTask *task, int tiled, const float *X) {
    const ColiFfnMat *m = a->m;
    int64_t ldp = a->ldp;
    int tokens = task->tokens;
    const float *x = (const float *)task->x;
    float *acc = (float *)task->scratch, *p = acc + ldp * tokens, *zs = p + ldp * tokens;
    float *tile = zs + 2 * ldp * (m->g_idx ? m->groups : 1);
    memset(acc, 0, sizeof(float) * (size_t)(ldp * tokens));
    if (m->g_idx)  /* act order: z s (exact: 5 and 11 bits) and s per group */
        for (int64_t g = 0; g < m->groups; g++) {
            float *zg = zs + 2 * a->ldp * g;
            FN(ax_params)(a, g, zg);
            for (int64_t v = 0; v < a->nv; v++)
                vstore(zg + v * L, vmul(vload(zg + v * L), vload(zg + a->ldp + v * L)));
        }
    int64_t groups = a->grouped ? m->groups : 1;
    for (int64_t g = 0; g < groups; g++) {
        int64_t k0 = a->grouped ? g * m->group : 0;
        int64_t k1 = a->grouped && k0 + m->group < m->n_in ? k0 + m->group : m->n_in;
        float *sums = a->grouped ? p : acc;
        if (a->grouped) memset(p, 0, sizeof(float) * (size_t)(ldp * tokens));
        for (int t0 = 0; !tiled && t0 < tokens; t0 += STREAM_TB) {
            int tb = tokens - t0 < STREAM_TB ? tokens - t0 : STREAM_TB;
            const float *xt = x + t0 * task->ldx;
            float *s = sums + t0 * ldp;
            if (a->grouped) {
                /* Whole vectors (AWQ: whole segments) and words the fast way,
                 * a partial vector at the range's end the general way. */
                int64_t nvf = a->awq ? FN(ax_lanes)(a, a->nv - 1) == L ? a->nv : a->nv - 8
                                     : a->n / L;
                int fast = !a->gptq || (k0 % 8 == 0 && k1 % 8 == 0);
                if (!fast) nvf = 0;
                switch (tb) {
                case 1: FN(ax_fast_stream_1)(a, k0, k1, nvf, xt, task->ldx, s); break;
                case 2: FN(ax_fast_stream_2)(a, k0, k1, nvf, xt, task->ldx, s); break;
                case 3: FN(ax_fast_stream_3)(a, k0, k1, nvf, xt, task->ldx, s); break;
                default: FN(ax_fast_stream_4)(a, k0, k1, nvf, xt, task->ldx, s); break;
                }
                if (nvf < a->nv) FN(ax_group_stream_tail)(a, k0, k1, nvf, xt, task->ldx, s, tb);
            } else {
                int64_t nvf = a->gptq ? a->n / L : 0;  /* act order: whole vectors first */
                if (nvf) switch (tb) {
                    case 1: FN(ax_act_stream_1)(a, nvf, xt, task->ldx, s, zs); break;
                    case 2: FN(ax_act_stream_2)(a, nvf, xt, task->ldx, s, zs); break;
                    case 3: FN(ax_act_stream_3)(a, nvf, xt, task->ldx, s, zs); break;
                    default: FN(ax_act_stream_4)(a, nvf, xt, task->ldx, s, zs); break;
                    }
                if (nvf < a->nv) switch (tb) {
                    case 1: FN(ax_single_stream_1)(a, nvf, xt, task->ldx, s, zs); break;
                    case 2: FN(ax_single_stream_2)(a, nvf, xt, task->ldx, s, zs); break;
                    case 3: FN(ax_single_stream_3)(a, nvf, xt, task->ldx, s, zs); break;
                    default: FN(ax_single_stream_4)(a, nvf, xt, task->ldx, s, zs); break;
                    }
            }
        }
        for (int64_t k = k0; tiled && k < k1; k += FN(AX_CHUNK)) {
            int kc = k1 - k < FN(AX_CHUNK) ? (int)(k1 - k) : FN(AX_CHUNK);
            FN(ax_decode_tile)(a, k, kc, zs, tile);
            FN(ax_tile_tokens)(tile, kc, x + k, task->ldx, tokens, sums, ldp);
        }
        if (a->grouped) {
            FN(ax_params)(a, g, zs);
            FN(ax_flush)(a, zs, task->xs, task->ldxs, g, tokens, p, acc);
        }
    }
    if (m->g_idx) FN(ax_correct)(a, zs, X, tokens, acc);
    for (int t = 0; t < tokens; t++)
        for (int64_t c = 0; c < a->n; c++)
            task->dst[t * task->ld_dst + a->c0 + c] = acc[t * ldp + FN(ax_index)(a, c)];
}

/* Act order, streaming: outputs per panel, so that the panel's scales of
 * every group (a word row's eight inputs each read their group's) stay in
 * L2, 256 KiB of them (Mixtral's shape, one thread: about 0.8x the time of
 * the whole range at once; 16-32 KiB, for L1, measured slower: a panel's
 * slice of each stored row gets short), whole 64-byte lines of a row. */
static int64_t FN(ax_act_panel)(const ColiFfnMat *m) {
    int64_t w = ((int64_t)256 << 10) / (4 * m->groups) / 16 * 16;
    return w < 16 ? 16 : w;
}

TGT static void FN(ax_run)(const ColiFfnMat *m, int64_t n0, int64_t n1, const ColiFfnTask *task) {
    int tiled = task->tokens > COLI_FFN_STREAM_TOKENS;
    size_t used = FN(ax_scratch)(m, n0, n1, task->tokens);
    float *X = m->g_idx ? (float *)(task->scratch + used) - task->tokens * m->groups : NULL;
    if (X) FN(ax_group_inputs)(m, task, X);
    if (!tiled) {
        int64_t w = m->g_idx ? FN(ax_act_panel)(m) : n1 - n0;
        for (int64_t c = n0; c < n1; c += w) {
            FN(AxInfo) a = FN(ax_info)(m, c, c + w < n1 ? c + w : n1);
            FN(ax_sums)(&a, task, 0, X);
        }
        return;
    }
    for (int64_t c = n0; c < n1; c += FN(AX_PANEL) * L) {
        FN(AxInfo) a = FN(ax_info)(m, c, c + FN(AX_PANEL) * L < n1 ? c + FN(AX_PANEL) * L : n1);
        a.ldp = FN(AX_PANEL) * L;  /* the tile's sums: whole panels */
        FN(ax_sums)(&a, task, 1, X);
    }
}

#undef FN
#undef FN1
#undef FN2
/* The including file's parameters, for the next path's. */
#undef SFX
#undef L
#undef VF
#undef VI
#undef TAB16
#undef tab_zero
#undef TGT
#undef DOT_ROWS
#undef STREAM_TB
#undef AX_NV
#undef vzero
#undef vset1
#undef vload
#undef vstore
#undef vadd
#undef vsub
#undef vmul
#undef vfma
#undef vfnmadd
#undef vtree
#undef vsrli
#undef widen_bytes
#undef lookup16
#undef nib_biased
#undef vzeros8
#undef vload_scales
#undef vload_words
#undef plain_vec
