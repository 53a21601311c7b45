/*
 * expert_reader.h (private): where an expert's bytes are and how to read them.
 *
 * At store creation every expert gets a read plan: its tensor ranges sorted
 * by file and offset, ranges that touch in the file, or lie at most 4 KiB
 * apart, merged into one read, and each tensor's place in slot memory. A load
 * then reads each merged run (one in total when gate, up and down are
 * adjacent, as they are in every checkpoint we have seen): with O_DIRECT in
 * one pread, through the page cache in chunks (coli_files_tune).
 *
 * Nothing here locks: a plan is immutable after creation and a load writes
 * only into the slot memory its caller owns.
 */
#ifndef COLI_EXPERT_READER_H
#define COLI_EXPERT_READER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "coli_errors.h"
#include "coli_sources.h"   /* ColiTensorSource, ColiExpertSource */

#define COLI_IO_ALIGN 4096u       /* O_DIRECT alignment of offsets, lengths and buffers */
#define COLI_MAX_RUNS (COLI_ROLE_PARTS + COLI_MAX_PARTS)  /* gate, up, down, their scales, extra parts */

typedef struct {
    int file;                     /* index into the model's files */
    uint64_t file_offset;         /* where the read starts (aligned with direct I/O) */
    uint64_t length;              /* bytes asked of pread */
    uint64_t needed;              /* bytes that must arrive: the rest is alignment padding past EOF */
    uint64_t slot_offset;         /* where the read lands in slot memory */
} ColiReadRun;

typedef struct {
    ColiReadRun runs[COLI_MAX_RUNS];
    int n_runs;
    uint64_t footprint;           /* slot bytes this expert occupies */
    uint64_t payload;             /* bytes of its tensors and scales */
    uint64_t data_at[3];          /* slot offset of gate, up, down data */
    uint64_t scales_at[3];        /* slot offset of their scales */
    uint64_t part_at[COLI_MAX_PARTS];  /* slot offset of each extra part */
    int n_parts;                  /* extra parts of the expert */
} ColiReadPlan;

#ifdef COLI_TEST_CONTROL
/* Test builds: an injected read fault. The nth read from now (counted over
 * every thread) fails with errno_value; 0 disarms. */
typedef struct {
    _Atomic uint64_t countdown;
    _Atomic int errno_value;
} ColiReadFault;
#endif

/* The model's open files. */
typedef struct {
    int n;
    int *fds;                     /* -1 when not open */
    char **paths;
    uint64_t *sizes;
    bool direct_fallback;         /* O_DIRECT was asked for and refused */
    bool direct;                  /* every file is open with O_DIRECT */
    /* How buffered reads (no O_DIRECT) go; coli_files_tune sets them. */
    uint64_t read_chunk;          /* bytes per pread; 0: one pread per run */
    bool willneed;                /* POSIX_FADV_WILLNEED over a run before reading it */
#ifdef COLI_TEST_CONTROL
    ColiReadFault *fault;         /* test builds: the fault every read asks (NULL: none) */
#endif
} ColiFileSet;

/* Opens every path read-only (O_DIRECT when direct, falling back to the page
 * cache where the file system refuses it). On failure nothing stays open. */
int coli_files_open(ColiFileSet *files, const char *const *paths, int n,
                    bool direct, char *err, size_t err_len);
/* How buffered reads go (O_DIRECT reads always take one pread per run):
 * in preads of read_chunk bytes (0: one per run), and, when advise is set,
 * with the files' readahead off (POSIX_FADV_RANDOM: a miss reads its own
 * bytes, not the neighbours'). Chunks are then taken from the page cache
 * only (preadv2 RWF_NOWAIT) while they are all there; at the first one that
 * is not, POSIX_FADV_WILLNEED over the rest of the run starts its reads at
 * once, so the disk fetches the next chunks while the first ones are
 * copied, and plain preads follow. Advice the file system refuses is
 * ignored. */
void coli_files_tune(ColiFileSet *files, uint64_t read_chunk, bool advise);
/* Closes and frees; safe on a zeroed or half-opened set. */
void coli_files_close(ColiFileSet *files);

/* Checks one tensor's source against its format and shape, and its byte
 * ranges against the files (files NULL: a check without files, as for a
 * replay store or a plan). what names it in messages ("layer 3 expert 5
 * gate"). */
int coli_check_tensor(const ColiFileSet *files, const ColiTensorSource *t,
                      const char *what, char *err, size_t err_len);

/* Checks every tensor and extra part of an expert (coli_check_tensor for
 * each present role), its flags and its part count. */
int coli_check_expert(const ColiFileSet *files, const ColiExpertSource *src,
                      char *err, size_t err_len);

/* Builds the read plan of an expert that passed coli_check_expert. */
int coli_plan_expert(const ColiExpertSource *src, bool direct,
                     ColiReadPlan *plan, char *err, size_t err_len);

/* Paces a background read: it is issued in chunks of `chunk` bytes (a
 * multiple of COLI_IO_ALIGN) and pause(ctx) runs before each one, so that
 * the caller can hold it back while more urgent reads use the disk, or stop
 * it (pause returns false) when its bytes are no longer wanted. */
typedef struct {
    uint64_t chunk;
    bool (*pause)(void *ctx);
    void *ctx;
} ColiReadPacer;

#define COLI_READ_STOPPED 1       /* coli_read_expert: the pacer stopped the read */

/* Reads every run of plan into slot memory: buffered runs as coli_files_tune
 * says, O_DIRECT runs in one pread each; a pacer, when not NULL, also splits
 * the run into its chunks and is asked before each. Returns COLI_OK, a negative COLI_E* code, or
 * COLI_READ_STOPPED. *bytes_read gets the bytes that arrived, also on
 * failure. A failure names file, offset and errno. */
int coli_read_expert(const ColiFileSet *files, const ColiReadPlan *plan,
                     unsigned char *slot, const ColiReadPacer *pacer,
                     uint64_t *bytes_read, char *err, size_t err_len);

#endif /* COLI_EXPERT_READER_H */
