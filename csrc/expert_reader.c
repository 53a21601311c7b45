/*
 * expert_reader.c: file opening, source validation, read plans and reads.
 */
#define _GNU_SOURCE               /* O_DIRECT */
#include "expert_reader.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "coli_formats.h"

#define RUN_ALIGN 64u             /* buffered runs keep their file offset's alignment mod this */
#define MERGE_GAP 4096u           /* ranges this close in a file are read as one run, gap included */

static uint64_t round_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

void coli_files_close(ColiFileSet *files) {
    if (!files) return;
    for (int i = 0; i < files->n; i++) {
        if (files->fds && files->fds[i] >= 0) close(files->fds[i]);
        if (files->paths) free(files->paths[i]);
    }
    free(files->fds);
    free(files->paths);
    free(files->sizes);
    memset(files, 0, sizeof(*files));
}

int coli_files_open(ColiFileSet *files, const char *const *paths, int n,
                    bool direct, char *err, size_t err_len) {
    memset(files, 0, sizeof(*files));
    if (n <= 0 || !paths)
        return coli_fail(err, err_len, COLI_ECONFIG, "config lists no files");
    files->fds = malloc(sizeof(int) * (size_t)n);
    files->paths = calloc((size_t)n, sizeof(char *));
    files->sizes = calloc((size_t)n, sizeof(uint64_t));
    if (!files->fds || !files->paths || !files->sizes) {
        free(files->fds); free(files->paths); free(files->sizes);
        memset(files, 0, sizeof(*files));
        return coli_fail(err, err_len, COLI_ENOMEM, "out of memory opening %d files", n);
    }
    for (int i = 0; i < n; i++) files->fds[i] = -1;
    files->n = n;
    for (int i = 0; i < n; i++) {
        if (!paths[i]) {
            coli_files_close(files);
            return coli_fail(err, err_len, COLI_ECONFIG, "file %d has a NULL path", i);
        }
        files->paths[i] = strdup(paths[i]);
        if (!files->paths[i]) {
            coli_files_close(files);
            return coli_fail(err, err_len, COLI_ENOMEM, "out of memory copying path %s", paths[i]);
        }
        int fd = -1;
        if (direct) {
            fd = open(paths[i], O_RDONLY | O_CLOEXEC | O_DIRECT);
            if (fd < 0 && errno == EINVAL) files->direct_fallback = true;
        }
        if (fd < 0 && (!direct || errno == EINVAL))
            fd = open(paths[i], O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            int e = errno;
            coli_files_close(files);
            return coli_fail(err, err_len, COLI_EIO, "cannot open %s: %s (errno %d)",
                             paths[i], strerror(e), e);
        }
        files->fds[i] = fd;
        struct stat st;
        if (fstat(fd, &st) != 0) {
            int e = errno;
            coli_files_close(files);
            return coli_fail(err, err_len, COLI_EIO, "cannot stat %s: %s (errno %d)",
                             paths[i], strerror(e), e);
        }
        files->sizes[i] = (uint64_t)st.st_size;
    }
    files->direct = direct && !files->direct_fallback;
    return COLI_OK;
}

void coli_files_tune(ColiFileSet *files, uint64_t read_chunk, bool advise) {
    if (read_chunk > (1ull << 40)) read_chunk = 1ull << 40;   /* no overflow rounding up */
    /* A multiple of the O_DIRECT alignment, so that a file opened with
     * O_DIRECT beside refusing ones still gets aligned preads. */
    files->read_chunk = round_up(read_chunk, COLI_IO_ALIGN);
    files->willneed = advise && !files->direct;
    if (!files->willneed) return;
    for (int i = 0; i < files->n; i++)   /* advice is a hint: a refusal changes nothing */
        if (files->fds[i] >= 0) (void)posix_fadvise(files->fds[i], 0, 0, POSIX_FADV_RANDOM);
}

/* files NULL: a check without files (only the range's own sum). */
static int check_range(const ColiFileSet *files, int file, uint64_t off, uint64_t len,
                       const char *what, const char *part, char *err, size_t err_len) {
    uint64_t end;
    if (!files)
        return __builtin_add_overflow(off, len, &end)
                   ? coli_fail(err, err_len, COLI_ECONFIG, "%s %s: offset %llu + %llu bytes overflow",
                               what, part, (unsigned long long)off, (unsigned long long)len)
                   : COLI_OK;
    if (file < 0 || file >= files->n)
        return coli_fail(err, err_len, COLI_ECONFIG, "%s %s: file index %d out of range (%d files)",
                         what, part, file, files->n);
    if (__builtin_add_overflow(off, len, &end) || end > files->sizes[file])
        return coli_fail(err, err_len, COLI_ECONFIG,
                         "%s %s: bytes [%llu, %llu) lie past the end of %s (%llu bytes)",
                         what, part, (unsigned long long)off, (unsigned long long)off + len,
                         files->paths[file], (unsigned long long)files->sizes[file]);
    return COLI_OK;
}

/* Checks a scaled tensor's scales: their format, block grid and size. */
static int check_scales(const ColiTensorSource *t, const ColiFormatInfo *f, const char *what,
                        char *err, size_t err_len) {
    const ColiScaleInfo *sc = coli_scale_info(t->scale_format);
    if (!sc)
        return coli_fail(err, err_len, COLI_ECONFIG, "%s: unknown scale format %d",
                         what, (int)t->scale_format);
    if (!coli_format_takes(f, t->scale_format))
        return coli_fail(err, err_len, COLI_ECONFIG, "%s: format %s cannot take %s scales",
                         what, f->name, sc->name);
    if (t->scale_format == COLI_SCALE_NONE) return COLI_OK;
    if (t->block_rows == 0 || t->block_columns == 0)
        return coli_fail(err, err_len, COLI_ECONFIG, "%s: scaled tensor with a zero block size", what);
    uint64_t blocks = ((uint64_t)t->rows + t->block_rows - 1) / t->block_rows *
                      (((uint64_t)t->columns + t->block_columns - 1) / t->block_columns);
    uint64_t scale_expect = blocks * sc->bytes;
    if (t->scale_nbytes != scale_expect)
        return coli_fail(err, err_len, COLI_ECONFIG,
                         "%s: %llu scale bytes, %llu expected for %u x %u blocks",
                         what, (unsigned long long)t->scale_nbytes,
                         (unsigned long long)scale_expect, t->block_rows, t->block_columns);
    return COLI_OK;
}

int coli_check_tensor(const ColiFileSet *files, const ColiTensorSource *t,
                      const char *what, char *err, size_t err_len) {
    if (t->rows <= 0 || t->columns <= 0)
        return coli_fail(err, err_len, COLI_ECONFIG, "%s: shape %lld x %lld is not positive",
                         what, (long long)t->rows, (long long)t->columns);
    const ColiFormatInfo *f = coli_format_info(t->format);
    if (!f)
        return coli_fail(err, err_len, COLI_ECONFIG, "%s: unknown format %d", what, (int)t->format);
    if (f->packing == COLI_PACK_REFUSED)
        return coli_fail(err, err_len, COLI_ECONFIG,
                         "%s: format %d (%s) is not supported by this store (no checkpoint format maps to it)",
                         what, (int)t->format, f->name);
    uint64_t expect;
    if (!coli_format_bytes(f, t->rows, t->columns, &expect))
        return coli_fail(err, err_len, COLI_ECONFIG, "%s: format %s cannot hold %lld x %lld (oversized, or not whole words)",
                         what, f->name, (long long)t->rows, (long long)t->columns);
    if (t->nbytes != expect)
        return coli_fail(err, err_len, COLI_ECONFIG,
                         "%s: %llu bytes do not match format %s of shape %lld x %lld (%llu expected)",
                         what, (unsigned long long)t->nbytes, f->name,
                         (long long)t->rows, (long long)t->columns, (unsigned long long)expect);
    int rc = check_range(files, t->file, t->offset, t->nbytes, what, "data", err, err_len);
    if (rc == COLI_OK) rc = check_scales(t, f, what, err, err_len);
    if (rc || t->scale_format == COLI_SCALE_NONE) return rc;
    return check_range(files, t->scale_file, t->scale_offset, t->scale_nbytes, what, "scales",
                       err, err_len);
}

static bool all_zero(const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i]) return false;
    return true;
}

#define KNOWN_FLAGS (COLI_SOURCE_FUSED_GATE_UP | COLI_SOURCE_IN_OUT | COLI_SOURCE_INTERLEAVED | \
                     COLI_SOURCE_ZERO_PLUS_ONE)

/* What extra part k is to the kernels: a known kind, of a role the expert
 * has, and no second part of its kind and role. (A bias's format is the
 * kernel's to check, when it computes.) */
static int check_part_use(const ColiExpertSource *src, int k, const char *what, char *err,
                          size_t err_len) {
    const ColiPartSource *p = &src->parts[k];
    bool fused = (src->flags & COLI_SOURCE_FUSED_GATE_UP) != 0;
    if (p->kind < COLI_PART_OTHER || p->kind > COLI_PART_G_IDX)
        return coli_fail(err, err_len, COLI_ECONFIG, "%s: unknown kind %d", what, p->kind);
    if (p->kind == COLI_PART_OTHER) return COLI_OK;
    if (p->role < 0 || p->role > 2 || (fused && p->role == 1))
        return coli_fail(err, err_len, COLI_ECONFIG, "%s: role %d is not a matrix of the expert",
                         what, p->role);
    for (int j = 0; j < k; j++)
        if (src->parts[j].kind == p->kind && src->parts[j].role == p->role)
            return coli_fail(err, err_len, COLI_ECONFIG, "%s: part %d is already of kind %d for "
                             "role %d", what, j, p->kind, p->role);
    return COLI_OK;
}

int coli_check_expert(const ColiFileSet *files, const ColiExpertSource *src,
                      char *err, size_t err_len) {
    char what[96];
    const ColiTensorSource *t[3] = {&src->gate, &src->up, &src->down};
    static const char *const names[3] = {"gate", "up", "down"};
    bool fused = (src->flags & COLI_SOURCE_FUSED_GATE_UP) != 0;
    if (src->flags & ~(uint32_t)KNOWN_FLAGS)
        return coli_fail(err, err_len, COLI_ECONFIG, "layer %d expert %d: unknown flags 0x%x",
                         src->layer, src->expert, (unsigned)src->flags);
    if ((src->flags & COLI_SOURCE_INTERLEAVED) && !fused)
        return coli_fail(err, err_len, COLI_ECONFIG, "layer %d expert %d: interleaved without a "
                         "fused gate_up", src->layer, src->expert);
    for (int r = 0; r < 3; r++) {
        snprintf(what, sizeof what, "layer %d expert %d %s", src->layer, src->expert,
                 r == 0 && fused ? "gate_up" : names[r]);
        if (r == 1 && fused) {
            if (!all_zero(t[r], sizeof *t[r]))
                return coli_fail(err, err_len, COLI_ECONFIG,
                                 "%s: must be zeroed when gate holds the fused gate_up", what);
            continue;
        }
        int rc = coli_check_tensor(files, t[r], what, err, err_len);
        if (rc) return rc;
    }
    if (src->n_parts < 0 || src->n_parts > COLI_MAX_PARTS || (src->n_parts > 0 && !src->parts))
        return coli_fail(err, err_len, COLI_ECONFIG,
                         "layer %d expert %d: %d extra parts (0..%d, with a parts array)",
                         src->layer, src->expert, src->n_parts, (int)COLI_MAX_PARTS);
    for (int k = 0; k < src->n_parts; k++) {
        snprintf(what, sizeof what, "layer %d expert %d part %d", src->layer, src->expert, k);
        if (src->parts[k].nbytes == 0)
            return coli_fail(err, err_len, COLI_ECONFIG, "%s: empty", what);
        int rc = check_range(files, src->parts[k].file, src->parts[k].offset, src->parts[k].nbytes,
                             what, "bytes", err, err_len);
        if (rc == COLI_OK) rc = check_part_use(src, k, what, err, err_len);
        if (rc) return rc;
    }
    return COLI_OK;
}

typedef struct {
    int file;
    uint64_t offset, length;
    int role;                     /* 0..2 gate/up/down; 3 + k: extra part k */
    bool scales;
} Range;

int coli_plan_expert(const ColiExpertSource *src, bool direct,
                     ColiReadPlan *plan, char *err, size_t err_len) {
    const ColiTensorSource *roles[3] = {&src->gate, &src->up, &src->down};
    Range r[COLI_MAX_RUNS];
    int n = 0;
    memset(plan, 0, sizeof(*plan));
    for (int i = 0; i < 3; i++) {
        const ColiTensorSource *t = roles[i];
        if (i == 1 && (src->flags & COLI_SOURCE_FUSED_GATE_UP)) continue;  /* up lives in gate */
        r[n++] = (Range){t->file, t->offset, t->nbytes, i, false};
        plan->payload += t->nbytes;
        if (t->scale_format != COLI_SCALE_NONE) {
            r[n++] = (Range){t->scale_file, t->scale_offset, t->scale_nbytes, i, true};
            plan->payload += t->scale_nbytes;
        }
    }
    for (int k = 0; k < src->n_parts; k++) {
        r[n++] = (Range){src->parts[k].file, src->parts[k].offset, src->parts[k].nbytes, 3 + k, false};
        plan->payload += src->parts[k].nbytes;
    }
    plan->n_parts = src->n_parts;
    for (int i = 1; i < n; i++) {   /* insertion sort by (file, offset): n <= COLI_MAX_RUNS */
        Range x = r[i];
        int j = i - 1;
        while (j >= 0 && (r[j].file > x.file || (r[j].file == x.file && r[j].offset > x.offset))) {
            r[j + 1] = r[j];
            j--;
        }
        r[j + 1] = x;
    }
    uint64_t cursor = 0;
    int run = -1;
    uint64_t run_end = 0, run_base = 0;   /* file offset where the run's bytes start in the slot */
    for (int i = 0; i < n; i++) {
        if (run >= 0 && r[i].file == r[i - 1].file && r[i].offset < run_end)
            return coli_fail(err, err_len, COLI_ECONFIG,
                             "layer %d expert %d: tensors overlap in file %d at offset %llu",
                             src->layer, src->expert, r[i].file, (unsigned long long)r[i].offset);
        /* A small gap (a quantised checkpoint's weight_shape between a
         * weight and its scales) costs less read along than a second read. */
        bool extend = run >= 0 && r[i].file == plan->runs[run].file && r[i].offset - run_end <= MERGE_GAP;
        if (!extend) {
            if (run >= 0) cursor = plan->runs[run].slot_offset + plan->runs[run].length;
            run++;
            ColiReadRun *rr = &plan->runs[run];
            rr->file = r[i].file;
            run_base = direct ? r[i].offset / COLI_IO_ALIGN * COLI_IO_ALIGN : r[i].offset;
            rr->file_offset = run_base;
            rr->slot_offset = direct ? round_up(cursor, COLI_IO_ALIGN)
                                     : round_up(cursor, RUN_ALIGN) + r[i].offset % RUN_ALIGN;
        }
        ColiReadRun *rr = &plan->runs[run];
        run_end = r[i].offset + r[i].length;
        rr->needed = run_end - run_base;
        rr->length = direct ? round_up(rr->needed, COLI_IO_ALIGN) : rr->needed;
        uint64_t at = rr->slot_offset + (r[i].offset - run_base);
        if (r[i].role >= 3) plan->part_at[r[i].role - 3] = at;
        else if (r[i].scales) plan->scales_at[r[i].role] = at;
        else plan->data_at[r[i].role] = at;
    }
    plan->n_runs = run + 1;
    plan->footprint = plan->runs[run].slot_offset + plan->runs[run].length;
    return COLI_OK;
}

#ifdef COLI_TEST_CONTROL
/* The errno a test build's injected fault gives this read, or 0. */
static int injected_fault(const ColiFileSet *files) {
    ColiReadFault *fault = files->fault;
    uint64_t cur = fault ? atomic_load(&fault->countdown) : 0;
    while (cur != 0) {
        if (atomic_compare_exchange_weak(&fault->countdown, &cur, cur - 1))
            return cur == 1 ? atomic_load(&fault->errno_value) : 0;
    }
    return 0;
}
#endif

/* Tells the kernel that bytes [from, from + len) of run rr (clipped to the
 * run) are wanted now: it starts their reads without waiting for them. */
static void advise_willneed(int fd, const ColiReadRun *rr, uint64_t from, uint64_t len) {
    if (from >= rr->length) return;
    if (len > rr->length - from) len = rr->length - from;
    (void)posix_fadvise(fd, (off_t)(rr->file_offset + from), (off_t)len, POSIX_FADV_WILLNEED);
}

/* Copies what the page cache holds of [off, off + len) without waiting for
 * the disk: the bytes copied, 0 when none are cached or it cannot tell. */
static ssize_t read_cached(int fd, unsigned char *dst, size_t len, off_t off) {
#ifdef RWF_NOWAIT
    struct iovec iov = {dst, len};
    ssize_t got = preadv2(fd, &iov, 1, off, RWF_NOWAIT);
    if (got > 0) return got;
#else
    (void)fd; (void)dst; (void)len; (void)off;
#endif
    return 0;
}

int coli_read_expert(const ColiFileSet *files, const ColiReadPlan *plan,
                     unsigned char *slot, const ColiReadPacer *pacer,
                     uint64_t *bytes_read, char *err, size_t err_len) {
    *bytes_read = 0;
    /* O_DIRECT reads go in one call: the block layer splits it and keeps
     * the pieces in flight together. Buffered ones go in chunks, so that the
     * copy of one overlaps the disk's read of the next. */
    uint64_t chunk = files->direct ? 0 : files->read_chunk;
    for (int i = 0; i < plan->n_runs; i++) {
        const ColiReadRun *rr = &plan->runs[i];
        int fd = files->fds[rr->file];
        uint64_t done = 0, pause_at = 0;
        /* With advice, chunks are read from the page cache only (no wait)
         * while they are all there: a warm file costs no advice (WILLNEED
         * over cached pages only costs time). At the first chunk that is
         * not, WILLNEED the rest of the run (or of the pacer chunk) and go
         * on with plain preads, advising each later pacer chunk. */
        bool probe = files->willneed;
        while (done < rr->length) {
            ssize_t got;
            uint64_t want = rr->length - done;
            if (pacer) {
                if (done >= pause_at) {
                    if (!pacer->pause(pacer->ctx)) return COLI_READ_STOPPED;
                    pause_at = done + pacer->chunk;
                    /* Ask for this pacer chunk only: a paced read keeps at
                     * most one chunk ahead of a demand read on the disk. */
                    if (files->willneed && !probe) advise_willneed(fd, rr, done, pacer->chunk);
                }
                if (want > pause_at - done) want = pause_at - done;
            }
            if (chunk && want > chunk) want = chunk;
            unsigned char *dst = slot + rr->slot_offset + done;
            off_t at = (off_t)(rr->file_offset + done);
#ifdef COLI_TEST_CONTROL
            int fault = injected_fault(files);
#else
            const int fault = 0;  /* the product has no fault to inject: the branch folds away */
#endif
            if (fault) {
                errno = fault;
                got = -1;
            } else if (probe) {
                got = read_cached(fd, dst, want, at);
                if ((uint64_t)got < want) {
                    probe = false;
                    uint64_t from = done + (uint64_t)got;
                    advise_willneed(fd, rr, from, pacer ? pause_at - from : rr->length - from);
                    if (got == 0) got = pread(fd, dst, want, at);
                }
            } else {
                got = pread(fd, dst, want, at);
            }
            if (got < 0) {
                int e = errno;
                if (e == EINTR) continue;
                return coli_fail(err, err_len, COLI_EIO,
                                 "reading %llu bytes of %s at offset %llu failed: %s (errno %d)",
                                 (unsigned long long)(rr->length - done), files->paths[rr->file],
                                 (unsigned long long)(rr->file_offset + done), strerror(e), e);
            }
            if (got == 0) break;  /* end of file */
            done += (uint64_t)got;
            *bytes_read += (uint64_t)got;
        }
        if (done < rr->needed)
            return coli_fail(err, err_len, COLI_EIO,
                             "reading %s at offset %llu: the file ends after %llu of %llu bytes "
                             "(truncated since the store opened it?)",
                             files->paths[rr->file], (unsigned long long)rr->file_offset,
                             (unsigned long long)done, (unsigned long long)rr->needed);
    }
    return COLI_OK;
}
