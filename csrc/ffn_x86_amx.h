/*
 * ffn_x86_amx.h (private, included once by ffn_x86.c after
 * ffn_x86_int4.h and ffn_x86_mxfp4.h): compressed-tensors int4 (groups of
 * a multiple of 32) and MXFP4 in bfloat16 calls of more than one token
 * with AMX tiles, on CPUs with AMX-TILE and AMX-INT8 where the OS grants
 * the tile state. Their sums are the vector kernels' (see ffn_x86_int4.h
 * and ffn_x86_mxfp4.h): the same exact integers per chunk or half block,
 * the same float operations after them, so the same bits as a token
 * alone.
 *
 * int4 with a scale per chunk of 128 inputs below, then int4 with a scale
 * per quarter of one, then MXFP4.
 *
 * A tile product C[m][n] += sum over k of A[m][k] B[k / 4][4n + k % 4]
 * multiplies 8-bit integers. A: 16 rows' nibbles of a chunk less their
 * zero point, as signed bytes, the low nibbles (inputs 0, 2, ..., 126) in
 * one tile and the high ones in another. B: 16 tokens' inputs of the chunk
 * in the columns A's bytes hold, each 16-bit input a = 256 h + l split
 * into its signed high byte h and unsigned low byte l. Per chunk,
 * D = sum (q - z) a = 256 (A h) + (A l), both exact in 32 bits (signed by
 * signed, then signed by unsigned bytes), then the int4 kernel's
 * a = fma(float(D), S * 2^-k, a) with the 16 tokens in a vector's lanes.
 *
 * Tiles of int4 by chunks (QA_CONFIG): 0 and 1 the sums of h and l, 2
 * and 3 the weights (low and high nibbles), 4 to 7 the inputs (h of the
 * even and odd columns, then l). By quarters and MXFP4's half blocks
 * (QQ_CONFIG), K = 32: 0 and 1 the sums, 2 the weights, 4 and 5 the
 * inputs' h and l. */

#if COLI_AMX

#ifndef ARCH_GET_XCOMP_PERM
#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#endif
enum { QA_XTILEDATA = 18 };

/* Whether calls of more than one token may use AMX: the CPU has it,
 * COLIBRI_KERNEL_AMX is not 0, and the OS grants this process the tile
 * state (asked the first time; Linux keeps the grant per process). */
int coli_ffn_amx_usable(void) {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8")) return 0;
    const char *env = getenv("COLIBRI_KERNEL_AMX");
    if (env && strcmp(env, "0") == 0) return 0;
    unsigned long bits = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bits) == 0 && (bits >> QA_XTILEDATA) & 1) return 1;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, QA_XTILEDATA) == 0;
}

/* The tile configuration: palette 1, tiles 0-7 of 16 rows of 64 bytes
 * (colsb, little-endian 16-bit, at 16 + 2i; rows at 48 + i). Constant
 * data, not built on the stack: GCC's _tile_loadconfig tells the compiler
 * it reads 8 bytes, so the stores of a built one may be dropped. */
static const uint8_t QA_CONFIG[64] __attribute__((aligned(64))) = {
    1,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,
    64, 0,  64, 0,  64, 0,  64, 0,  64, 0,  64, 0,  64, 0,  64, 0,
    0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,
    16, 16, 16, 16, 16, 16, 16, 16, 0,  0,  0,  0,  0,  0,  0,  0};

AMX static void qa_configure(void) { _tile_loadconfig(QA_CONFIG); }

/* A panel of rows [p0, p1): the first n rows' bytes (past p1, the first
 * row again, computed and not stored). */
static void qa_panel_rows(const uint8_t *data, int64_t row_bytes, int64_t p0, int64_t p1, int n,
                          const uint8_t **rows) {
    for (int m = 0; m < n; m++) rows[m] = data + (p0 + m < p1 ? p0 + m : p0) * row_bytes;
}

/* Group g of I16_ROWS rows of the panel [p0, p1): its first row (past p1,
 * the panel's first) and how many of its rows there are. */
static int64_t qa_group(int64_t p0, int64_t p1, int g, int *nr) {
    int64_t og = p0 + I16_ROWS * g < p1 ? p0 + I16_ROWS * g : p0;
    *nr = p1 - og < I16_ROWS ? (int)(p1 - og) : I16_ROWS;
    return og;
}

/* The scales and zero points of n groups of rows' params at ps. */
static void qa_int4_views(const QsInfo *q, const float *ps, int n, const float **s, const int32_t **z) {
    for (int g = 0; g < n; g++) {
        s[g] = ps + g * 2 * q->st;
        z[g] = (const int32_t *)(s[g] + q->st);
    }
}

/* A panel of int4 rows [p0, p1): its first n rows' bytes, and the params
 * of its n / I16_ROWS groups of rows at ps (2 st floats each). */
static void qa_int4_panel(const QsInfo *q, int64_t p0, int64_t p1, int n, const uint8_t **rows, float *ps) {
    qa_panel_rows(q->m->data, q->row_bytes, p0, p1, n, rows);
    for (int g = 0, nr; g < n / I16_ROWS; g++) {
        int64_t og = qa_group(p0, p1, g, &nr);
        qs_params(q, og, nr, ps + g * 2 * q->st, 1);
    }
}

/* Elements 0 .. 15 of two vectors of 16-bit integers, interleaved. */
static const int16_t QA_PAIRS[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                     8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};

/* The inputs' tiles: per block of 16 tokens and chunk, 4 KiB: A's even
 * columns' h, its odd columns' h, then the same of l. A's low-nibble
 * column k is input 2k of the chunk, its high-nibble column input 2k + 1;
 * in Q128 order input 4i + s is at 32s + i, so the even columns take
 * vectors 0 and 2, the odd ones 1 and 3, element pairs interleaved. Row kk
 * of a tile holds token n's four inputs of columns 4kk .. 4kk + 3 at 4n.
 * Chunks of 128 (K = 64 tiles): each part a 1 KiB tile of 16 rows. With
 * quarters (K = 32: a quarter's 16 even and 16 odd columns), the h and the
 * l of quarter j are 8-row tiles: rows 4j .. 4j + 3 of the even part,
 * then of the odd part. Tokens past the call are zero. */
AMX static void qa_inputs(const QsInfo *q, const int16_t *xq, int64_t ldq, int tokens, uint8_t *b) {
    const __m512i first = _mm512_loadu_si512(QA_PAIRS), second = _mm512_add_epi16(first, _mm512_set1_epi16(16));
    const __m512i kk = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i by_quarter = _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(kk, 2), 9),
                                                _mm512_slli_epi32(_mm512_and_si512(kk, _mm512_set1_epi32(3)), 6));
    const __m512i rows[2] = {q->quarters ? by_quarter : _mm512_slli_epi32(kk, 6),
                             q->quarters ? _mm512_add_epi32(by_quarter, _mm512_set1_epi32(256))
                                         : _mm512_add_epi32(_mm512_slli_epi32(kk, 6), _mm512_set1_epi32(QA_TILE))};
    const int blocks = (tokens + QA_TOKENS - 1) / QA_TOKENS;
    memset(b, 0, (size_t)blocks * (size_t)q->chunks * 4 * QA_TILE);
    for (int t = 0; t < tokens; t++)
        for (int64_t c = 0; c < q->chunks; c++) {
            const int16_t *x = xq + t * ldq + 128 * c;
            uint8_t *tiles = b + ((t / QA_TOKENS) * q->chunks + c) * 4 * QA_TILE + 4 * (t % QA_TOKENS);
            for (int odd = 0; odd < 2; odd++) {
                __m512i u = _mm512_loadu_si512(x + 32 * odd), v = _mm512_loadu_si512(x + 32 * odd + 64);
                __m512i pairs[2] = {_mm512_permutex2var_epi16(u, first, v), _mm512_permutex2var_epi16(u, second, v)};
                __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(pairs[0], 8))),
                                               _mm512_cvtepi16_epi8(_mm512_srai_epi16(pairs[1], 8)), 1);
                __m512i l = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(pairs[0])),
                                               _mm512_cvtepi16_epi8(pairs[1]), 1);
                _mm512_i32scatter_epi32(tiles, rows[odd], h, 1);
                _mm512_i32scatter_epi32(tiles + 2 * QA_TILE, rows[odd], l, 1);
            }
        }
}

/* Chunk c of the 16 rows at rows as A's two tiles at a (low nibbles, then
 * high), each nibble less its zero point (z: the rows' groups', in S's
 * order): signed bytes. */
AMX INLINE void qa_decode(const QsInfo *q, const uint8_t *const *rows, const int32_t *const *z, int64_t c,
                          int prefetch, uint8_t *a) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    _Pragma("GCC unroll 16") for (int m = 0; m < QA_ROWS; m++) {
        const uint8_t *src = rows[m] + 64 * c;
        __m512i v = c < q->whole ? _mm512_loadu_si512(src) : _mm512_maskz_loadu_epi8(q->tail, src);
        __m512i zb = _mm512_set1_epi8((char)z[m / I16_ROWS][4 * c + m % I16_ROWS]);
        if (prefetch) ffn_prefetch2((const char *)src, 256);  /* the panel's rows four chunks on */
        _mm512_storeu_si512(a + 64 * m, _mm512_sub_epi8(_mm512_and_si512(v, mask), zb));
        _mm512_storeu_si512(a + QA_TILE + 64 * m, _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), mask), zb));
    }
}

/* Chunk c's sums of a tile of rows (the h and l tiles at p: D = 256 h + l)
 * into its acc (16 rows' vectors of 16 tokens): a = fma(float(D), S *
 * 2^-k, a) (s: the four groups of rows' S; x: the tokens' 2^-k). */
AMX INLINE void qa_add(const int32_t *p, const float *const *s, int64_t c, __m512 x, float *acc) {
    _Pragma("GCC unroll 16") for (int m = 0; m < QA_ROWS; m++) {
        __m512i v = _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(p + 16 * m), 8),
                                     _mm512_loadu_si512(p + QA_ROWS * QA_TOKENS + 16 * m));
        __m512 sv = _mm512_set1_ps(s[m / I16_ROWS][4 * c + m % I16_ROWS]);
        _mm512_storeu_ps(acc + 16 * m, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(sv, x),
                                                      _mm512_loadu_ps(acc + 16 * m)));
    }
}

/* One tile of rows and chunk: the products of A (at a) with the input
 * tiles loaded, into the sums at p. */
AMX INLINE void qa_multiply(const uint8_t *a, int32_t *p) {
    _tile_loadd(2, a, 64);
    _tile_loadd(3, a + QA_TILE, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_dpbssd(0, 2, 4);
    _tile_dpbssd(0, 3, 5);
    _tile_dpbsud(1, 2, 6);
    _tile_dpbsud(1, 3, 7);
    _tile_stored(0, p, 64);
    _tile_stored(1, p + QA_ROWS * QA_TOKENS, 64);
}

/* Rows [n0, n1) for tokens tokens (in: qi_prepare's and the chunk tables;
 * b: qa_inputs' tiles; ps: QA_PANEL * 4 groups of rows' params; acc:
 * QA_PANEL * 1 KiB floats; w: QA_BUFS weight tiles' pairs, then QA_BUFS
 * sums' pairs, 2 KiB each). Panel after panel of rows, chunk after chunk,
 * the panel's tiles of rows one after another, software-pipelined: a tile
 * is decoded QA_LAG steps before it multiplies and its sums added QA_LAG
 * steps after (a tile load waits for the stores before it to reach L1,
 * and vector loads for the tile stores). */
AMX static void qa_rows(const QsInfo *q, int64_t n0, int64_t n1, const ColiFfnTask *task, const QiInputs *in,
                        const uint8_t *b, float *ps, float *acc, uint8_t *w) {
    enum { PR = QA_PANEL * QA_ROWS, GROUPS = PR / I16_ROWS, SUMS = 2 * QA_ROWS * QA_TOKENS };
    int32_t *sums = (int32_t *)(w + QA_BUFS * 2 * QA_TILE);
    const float *s[GROUPS];
    const int32_t *z[GROUPS];
    qa_int4_views(q, ps, GROUPS, s, z);
    qa_configure();
    for (int64_t p0 = n0; p0 < n1; p0 += PR) {
        const int64_t p1 = p0 + PR < n1 ? p0 + PR : n1, tiles = (p1 - p0 + QA_ROWS - 1) / QA_ROWS;
        const uint8_t *rows[PR];
        qa_int4_panel(q, p0, p1, PR, rows, ps);
        for (int t0 = 0; t0 < task->tokens; t0 += QA_TOKENS) {
            const int nt = task->tokens - t0 < QA_TOKENS ? task->tokens - t0 : QA_TOKENS, first = t0 == 0;
            const __mmask16 mine = (__mmask16)((1u << nt) - 1);
            const int64_t steps = q->chunks * tiles;  /* (chunk, tile of rows) after one another */
            memset(acc, 0, sizeof(float) * (size_t)(tiles * QA_ROWS * QA_TOKENS));
            for (int64_t k = 0; k < QA_LAG && k < steps; k++)
                qa_decode(q, rows + (k % tiles) * QA_ROWS, z + (k % tiles) * (QA_ROWS / I16_ROWS), k / tiles, first,
                          w + (k % QA_BUFS) * 2 * QA_TILE);
            for (int64_t k = 0; k < steps + QA_LAG; k++) {
                if (k < steps) {
                    if (k % tiles == 0) {
                        const uint8_t *bt = b + ((t0 / QA_TOKENS) * q->chunks + k / tiles) * 4 * QA_TILE;
                        _tile_loadd(4, bt, 64);
                        _tile_loadd(5, bt + QA_TILE, 64);
                        _tile_loadd(6, bt + 2 * QA_TILE, 64);
                        _tile_loadd(7, bt + 3 * QA_TILE, 64);
                    }
                    qa_multiply(w + (k % QA_BUFS) * 2 * QA_TILE, sums + (k % QA_BUFS) * SUMS);
                }
                int64_t kd = k + QA_LAG;  /* decoded QA_LAG steps ahead */
                if (kd < steps)
                    qa_decode(q, rows + (kd % tiles) * QA_ROWS, z + (kd % tiles) * (QA_ROWS / I16_ROWS), kd / tiles,
                              first, w + (kd % QA_BUFS) * 2 * QA_TILE);
                int64_t ka = k - QA_LAG;  /* added QA_LAG steps behind */
                if (ka >= 0) {
                    int64_t ca = ka / tiles, ia = ka % tiles;
                    qa_add(sums + (ka % QA_BUFS) * SUMS, s + ia * (QA_ROWS / I16_ROWS), ca,
                           _mm512_maskz_loadu_ps(mine, in->sxt + ca * in->tp + t0), acc + ia * QA_ROWS * QA_TOKENS);
                }
            }
            for (int64_t i = 0; i < tiles; i++) {  /* rows by token: a vector store per token */
                float by_token[QA_TOKENS * QA_ROWS];
                int64_t left = p1 - p0 - QA_ROWS * i;
                __mmask16 rows_left = left >= QA_ROWS ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
                for (int m = 0; m < QA_ROWS; m++)
                    for (int t = 0; t < QA_TOKENS; t++) by_token[QA_ROWS * t + m] = acc[QA_ROWS * (QA_ROWS * i + m) + t];
                for (int t = 0; t < nt; t++)
                    _mm512_mask_storeu_ps(task->dst + (t0 + t) * task->ld_dst + p0 + QA_ROWS * i, rows_left,
                                          _mm512_loadu_ps(by_token + QA_ROWS * t));
            }
        }
    }
    _tile_release();
}

/* ---- int4 with quarters (groups of 32, 64, 96, ...: a scale per 32
 * inputs): K = 32 tiles, one per quarter: A 16 rows of 32 bytes (the
 * quarter's low nibbles, then its high ones, less their zero point), B 8
 * rows, C a quarter's sums; per (row, token) the four quarter positions'
 * sums a_j. */

/* Tiles 0-1 the sums (16 x 64 bytes), 2 A (16 x 32), 4-5 B's h and l
 * (8 x 64). */
static const uint8_t QQ_CONFIG[64] __attribute__((aligned(64))) = {
    1,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,
    64, 0,  64, 0,  32, 0,  32, 0,  64, 0,  64, 0,  64, 0,  64, 0,
    0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,  0,
    16, 16, 16, 16, 8,  8,  8,  8,  0,  0,  0,  0,  0,  0,  0,  0};

/* One K = 32 tile product (QQ_CONFIG): A (16 rows of 32 bytes, 64 apart)
 * at a with B's h and l tiles (8 rows of 64 bytes) at bh and bl, into the
 * h and l sums at p (16 rows of 16 int32 each). */
AMX INLINE void qq_multiply(const uint8_t *a, const uint8_t *bh, const uint8_t *bl, int32_t *p) {
    _tile_loadd(2, a, 64);
    _tile_loadd(4, bh, 64);
    _tile_loadd(5, bl, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_dpbssd(0, 2, 4);
    _tile_dpbsud(1, 2, 5);
    _tile_stored(0, p, 64);
    _tile_stored(1, p + QA_ROWS * QA_TOKENS, 64);
}

/* Chunk c of the 16 rows as four A tiles at a: quarters 0 and 1 side by
 * side in 16 rows of 64 bytes, then quarters 2 and 3 (a tile: 32 bytes
 * of each row, loaded with a stride of 64). */
AMX INLINE void qq_decode(const QsInfo *q, const uint8_t *const *rows, const int32_t *const *z, int64_t c,
                          uint8_t *a) {
    const __m512i mask = _mm512_set1_epi8(0x0f);
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    _Pragma("GCC unroll 16") for (int m = 0; m < QA_ROWS; m++) {
        const uint8_t *src = rows[m] + 64 * c;
        __m512i v = c < q->whole ? _mm512_loadu_si512(src) : _mm512_maskz_loadu_epi8(q->tail, src);
        __m512i lo = _mm512_and_si512(v, mask), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
        const int32_t *zr = z[m / I16_ROWS] + 16 * c + m % I16_ROWS;  /* quarter j's at 4j */
        for (int h = 0; h < 2; h++) {
            __m512i zb = _mm512_mask_blend_epi8((__mmask64)0xffffffff00000000ull, _mm512_set1_epi8((char)zr[8 * h]),
                                                _mm512_set1_epi8((char)zr[8 * h + 4]));
            __m512i w = _mm512_permutex2var_epi64(lo, h ? second : first, hi);
            _mm512_storeu_si512(a + QA_TILE * h + 64 * m, _mm512_sub_epi8(w, zb));
        }
    }
}

/* Chunk c's quarter sums of a tile of rows (quarter j's h and l tiles at
 * p + 2j KiB) into its acc (16 rows' four vectors of 16 tokens, quarter j's
 * at 16 (4m + j)): a_j = fma(float(D), S_j * 2^-k, a_j). */
AMX INLINE void qq_add(const int32_t *p, const float *const *s, int64_t c, __m512 x, float *acc) {
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++)
        _Pragma("GCC unroll 16") for (int m = 0; m < QA_ROWS; m++) {
            const int32_t *pj = p + 2 * QA_ROWS * QA_TOKENS * j + 16 * m;
            __m512i v = _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(pj), 8),
                                         _mm512_loadu_si512(pj + QA_ROWS * QA_TOKENS));
            __m512 sv = _mm512_set1_ps(s[m / I16_ROWS][16 * c + 4 * j + m % I16_ROWS]);
            float *a = acc + 16 * (4 * m + j);
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(sv, x), _mm512_loadu_ps(a)));
        }
}

/* Rows [n0, n1) for more than one token, groups not a multiple of 128 (as
 * qa_rows; ps: 4 groups of rows' params; acc: 4 KiB floats; w: QA_BUFS
 * chunks' A tiles (2 KiB), then QA_BUFS chunks' sums (8 KiB)). One tile of
 * rows at a time: a chunk's B tiles are reloaded per quarter. */
AMX static void qq_rows(const QsInfo *q, int64_t n0, int64_t n1, const ColiFfnTask *task, const QiInputs *in,
                        const uint8_t *b, float *ps, float *acc, uint8_t *w) {
    enum { GROUPS = QA_ROWS / I16_ROWS, SUMS = 8 * QA_ROWS * QA_TOKENS };
    int32_t *sums = (int32_t *)(w + QA_BUFS * 2 * QA_TILE);
    const float *s[GROUPS];
    const int32_t *z[GROUPS];
    qa_int4_views(q, ps, GROUPS, s, z);
    _tile_loadconfig(QQ_CONFIG);
    for (int64_t p0 = n0; p0 < n1; p0 += QA_ROWS) {
        const int64_t p1 = p0 + QA_ROWS < n1 ? p0 + QA_ROWS : n1;
        const uint8_t *rows[QA_ROWS];
        qa_int4_panel(q, p0, p1, QA_ROWS, rows, ps);
        for (int t0 = 0; t0 < task->tokens; t0 += QA_TOKENS) {
            const int nt = task->tokens - t0 < QA_TOKENS ? task->tokens - t0 : QA_TOKENS;
            const __mmask16 mine = (__mmask16)((1u << nt) - 1);
            memset(acc, 0, sizeof(float) * 4 * QA_ROWS * QA_TOKENS);
            for (int64_t c = 0; c < QA_LAG && c < q->chunks; c++) qq_decode(q, rows, z, c, w + (c % QA_BUFS) * 2 * QA_TILE);
            for (int64_t c = 0; c < q->chunks + QA_LAG; c++) {
                if (c < q->chunks) {
                    const uint8_t *a = w + (c % QA_BUFS) * 2 * QA_TILE;
                    const uint8_t *bt = b + ((t0 / QA_TOKENS) * q->chunks + c) * 4 * QA_TILE;
                    int32_t *p = sums + (c % QA_BUFS) * SUMS;
                    for (int j = 0; j < 4; j++)
                        qq_multiply(a + QA_TILE * (j / 2) + 32 * (j % 2), bt + 512 * j, bt + 2 * QA_TILE + 512 * j,
                                    p + 2 * QA_ROWS * QA_TOKENS * j);
                }
                if (c + QA_LAG < q->chunks) qq_decode(q, rows, z, c + QA_LAG, w + ((c + QA_LAG) % QA_BUFS) * 2 * QA_TILE);
                int64_t ca = c - QA_LAG;
                if (ca >= 0)
                    qq_add(sums + (ca % QA_BUFS) * SUMS, s, ca, _mm512_maskz_loadu_ps(mine, in->sxt + ca * in->tp + t0), acc);
            }
            for (int64_t m = 0; m < p1 - p0; m++)
                for (int t = 0; t < nt; t++) {
                    const float *a = acc + 16 * 4 * m + t;
                    task->dst[(t0 + t) * task->ld_dst + p0 + m] = (a[0] + a[16]) + (a[32] + a[48]);
                }
        }
    }
    _tile_release();
}

/* ---- MXFP4: tiles of K = 32 (QQ_CONFIG), one per half block (its own
 * scale): A 16 rows of the half's twice-e2m1 values as signed bytes
 * (looked up with vpshufb), the half's even inputs then its odd ones; in
 * EO64 order those are the block's quantised inputs 0-15, 32-47 (first
 * half), 16-31, 48-63 (second), so B's two 8-row tiles of a half are the
 * rows of a 16-row tile in that column order. */

/* The quantised inputs of a block in A's column order (vpermi2w of its two
 * halves): columns 0-31, then 32-63. */
static const int16_t MA_COLUMNS[64] = {
    0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15, 32, 33, 34, 35, 36, 37,
    38, 39, 40, 41, 42, 43, 44, 45, 46, 47, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27,
    28, 29, 30, 31, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63};

/* The inputs' tiles: per block of 16 tokens and block of inputs, two 1 KiB
 * tiles (h, l), as qa_inputs' for int4. */
AMX static void ma_inputs(const MiInfo *d, const int16_t *xq, int tokens, uint8_t *b) {
    const __m512i first = _mm512_loadu_si512(MA_COLUMNS), second = _mm512_loadu_si512(MA_COLUMNS + 32);
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(64));
    const int blocks = (tokens + QA_TOKENS - 1) / QA_TOKENS;
    memset(b, 0, (size_t)blocks * (size_t)d->blocks * 2 * QA_TILE);
    for (int t = 0; t < tokens; t++)
        for (int64_t u = 0; u < d->blocks; u++) {
            const int16_t *x = xq + t * d->ldq + 64 * u;
            uint8_t *tiles = b + ((t / QA_TOKENS) * d->blocks + u) * 2 * QA_TILE + 4 * (t % QA_TOKENS);
            __m512i lo = _mm512_loadu_si512(x), hi = _mm512_loadu_si512(x + 32);
            __m512i cols[2] = {_mm512_permutex2var_epi16(lo, first, hi), _mm512_permutex2var_epi16(lo, second, hi)};
            __m512i h = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(_mm512_srai_epi16(cols[0], 8))),
                                           _mm512_cvtepi16_epi8(_mm512_srai_epi16(cols[1], 8)), 1);
            __m512i l = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi16_epi8(cols[0])),
                                           _mm512_cvtepi16_epi8(cols[1]), 1);
            _mm512_i32scatter_epi32(tiles, rows, h, 1);
            _mm512_i32scatter_epi32(tiles + QA_TILE, rows, l, 1);
        }
}

/* Block u of the 16 rows at rows as two A tiles at a: row m's first half
 * block at 64m, its second at 64m + 32 (a tile: 32 bytes of each row,
 * loaded with a stride of 64). */
AMX INLINE void ma_decode(const MiInfo *d, const uint8_t *const *rows, int64_t u, uint8_t *a) {
    const __m512i mask = _mm512_set1_epi8(0x0f), tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)MI_E2M1_X2_I8));
    _Pragma("GCC unroll 16") for (int m = 0; m < QA_ROWS; m++) {
        __m256i v = mi_bytes(rows[m], u, u < d->whole);
        __m512i n = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1), mask);
        /* 128-bit blocks: low nibbles 0-15, 16-31, high 0-15, 16-31 -> halves in order */
        __m512i w = _mm512_shuffle_epi8(tab, n);
        _mm512_storeu_si512(a + 64 * m, _mm512_shuffle_i64x2(w, w, _MM_SHUFFLE(3, 1, 2, 0)));
    }
}

/* Block u's half-block sums of a tile of rows (half h's h and l tiles at
 * p + 2h KiB) into its acc (16 rows' vectors of 16 tokens): c = fma(float(P),
 * S_h * 2^-k, c), the first half then the second (S: the four groups of
 * rows' scales). */
AMX INLINE void ma_add(const int32_t *p, const float *const *S, int64_t u, __m512 x, float *acc) {
    _Pragma("GCC unroll 16") for (int m = 0; m < QA_ROWS; m++) {
        __m512 c = _mm512_loadu_ps(acc + 16 * m);
        for (int h = 0; h < 2; h++) {
            const int32_t *ph = p + 2 * QA_ROWS * QA_TOKENS * h + 16 * m;
            __m512i v = _mm512_add_epi32(_mm512_slli_epi32(_mm512_loadu_si512(ph), 8),
                                         _mm512_loadu_si512(ph + QA_ROWS * QA_TOKENS));
            __m512 sv = _mm512_set1_ps(S[m / I16_ROWS][4 * (2 * u + h) + m % I16_ROWS]);
            c = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_mul_ps(sv, x), c);
        }
        _mm512_storeu_ps(acc + 16 * m, c);
    }
}

/* Rows [n0, n1) for more than one token: tiles of 16 rows, K = 32 (a half
 * block; QQ_CONFIG), block after block, software-pipelined as qa_rows (S:
 * the rows' scales, 4 groups; acc: 1 KiB floats; w: QA_BUFS blocks' A
 * tiles (1 KiB), then QA_BUFS blocks' sums (4 KiB)). */
AMX static void ma_rows(const MiInfo *d, int64_t n0, int64_t n1, const ColiFfnTask *task, const float *sxt,
                        int64_t tp, const uint8_t *b, float *S, float *acc, uint8_t *w) {
    enum { GROUPS = QA_ROWS / I16_ROWS, SUMS = 4 * QA_ROWS * QA_TOKENS };
    int32_t *sums = (int32_t *)(w + QA_BUFS * QA_TILE);
    const float *s[GROUPS];
    for (int g = 0; g < GROUPS; g++) s[g] = S + g * d->st;
    _tile_loadconfig(QQ_CONFIG);
    for (int64_t p0 = n0; p0 < n1; p0 += QA_ROWS) {
        const int64_t p1 = p0 + QA_ROWS < n1 ? p0 + QA_ROWS : n1;
        const uint8_t *rows[QA_ROWS];
        qa_panel_rows(d->m->data, d->row_bytes, p0, p1, QA_ROWS, rows);
        for (int g = 0, nr; g < GROUPS; g++) {
            int64_t og = qa_group(p0, p1, g, &nr);
            mi_params(d, og, nr, S + g * d->st);
        }
        for (int t0 = 0; t0 < task->tokens; t0 += QA_TOKENS) {
            const int nt = task->tokens - t0 < QA_TOKENS ? task->tokens - t0 : QA_TOKENS;
            const __mmask16 mine = (__mmask16)((1u << nt) - 1);
            memset(acc, 0, sizeof(float) * QA_ROWS * QA_TOKENS);
            for (int64_t u = 0; u < QA_LAG && u < d->blocks; u++) ma_decode(d, rows, u, w + (u % QA_BUFS) * QA_TILE);
            for (int64_t u = 0; u < d->blocks + QA_LAG; u++) {
                if (u < d->blocks) {
                    const uint8_t *a = w + (u % QA_BUFS) * QA_TILE;
                    const uint8_t *bt = b + ((t0 / QA_TOKENS) * d->blocks + u) * 2 * QA_TILE;
                    int32_t *p = sums + (u % QA_BUFS) * SUMS;
                    for (int h = 0; h < 2; h++)
                        qq_multiply(a + 32 * h, bt + 512 * h, bt + QA_TILE + 512 * h, p + 2 * QA_ROWS * QA_TOKENS * h);
                }
                if (u + QA_LAG < d->blocks) ma_decode(d, rows, u + QA_LAG, w + ((u + QA_LAG) % QA_BUFS) * QA_TILE);
                int64_t ua = u - QA_LAG;
                if (ua >= 0) ma_add(sums + (ua % QA_BUFS) * SUMS, s, ua, _mm512_maskz_loadu_ps(mine, sxt + ua * tp + t0), acc);
            }
            for (int64_t m = 0; m < p1 - p0; m++)
                for (int t = 0; t < nt; t++) task->dst[(t0 + t) * task->ld_dst + p0 + m] = acc[16 * m + t];
        }
    }
    _tile_release();
}

#else
int coli_ffn_amx_usable(void) { return 0; }
#endif /* COLI_AMX */

#undef I16_ENTRIES
#undef VNNI
