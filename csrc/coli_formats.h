/*
 * coli_formats.h (private): what each tensor format and scale format of
 * tensor.h is, in one table (coli_formats.c), one record per enum value.
 *
 * The reader checks a tensor's bytes, its scales and their block grid
 * against its record; nothing else in the core switches over formats.
 * Adding a format: append its value to ColiTensorFormat (tensor.h), give it
 * a record in FORMATS (its packing, bits and the scales it takes), and test
 * it. The refused legacy values (Q8_ROW, Q4_ROW, Q2_ROW, INT8_BLOCK) keep
 * their numbers and a record that refuses them.
 */
#ifndef COLI_FORMATS_H
#define COLI_FORMATS_H

#include <stdbool.h>
#include <stdint.h>

#include "tensor.h"

/* How a format lays a rows x columns matrix out in bytes. */
typedef enum {
    COLI_PACK_REFUSED = 0,        /* a legacy value the store refuses: no checkpoint maps to it */
    COLI_PACK_ROWS,               /* row-major elements of `bits` bits, each row whole bytes,
                                   * sub-byte elements low bits first */
    COLI_PACK_WORDS_DOWN_COLUMNS, /* little-endian int32 words of 32 / bits elements down each
                                   * column: rows must be a multiple of 32 / bits */
    COLI_PACK_WORDS_ALONG_ROWS    /* int32 words of 32 / bits elements along each row: columns
                                   * must be a multiple of 32 / bits */
} ColiPacking;

/* A format's compute kernel entry. The kernels define it and point their
 * formats' records at theirs; a format without one has NULL. */
typedef struct ColiFormatKernel ColiFormatKernel;

/* One tensor format. */
typedef struct {
    const char *name;             /* as docs and messages name it, e.g. "int4_gptq" */
    ColiPacking packing;
    uint8_t bits;                 /* bits per element */
    uint32_t scales;              /* the ColiScaleFormat values it takes, as COLI_SCALE_BIT() bits */
    const ColiFormatKernel *kernel;  /* KERNEL ENTRY: its compute kernel, or NULL */
} ColiFormatInfo;

/* One scale format. */
typedef struct {
    const char *name;
    uint8_t bytes;                /* per scale; 0 for COLI_SCALE_NONE */
} ColiScaleInfo;

#define COLI_SCALE_BIT(sf) (1u << (unsigned)(sf))

/* The record of format f, or NULL for a value that is no format. */
const ColiFormatInfo *coli_format_info(ColiTensorFormat f);

/* The record of scale format sf, or NULL for a value that is no scale format. */
const ColiScaleInfo *coli_scale_info(ColiScaleFormat sf);

/* Bytes a rows x columns tensor of format f takes, into *out. False for a
 * refused format, a non-positive shape, a shape its words cannot pack, or
 * an overflow (out untouched). */
bool coli_format_bytes(const ColiFormatInfo *f, int64_t rows, int64_t columns, uint64_t *out);

/* Whether format f takes scales of format sf (COLI_SCALE_NONE: unscaled). */
static inline bool coli_format_takes(const ColiFormatInfo *f, ColiScaleFormat sf) {
    return (unsigned)sf < 32 && (f->scales & COLI_SCALE_BIT(sf)) != 0;
}

#endif /* COLI_FORMATS_H */
