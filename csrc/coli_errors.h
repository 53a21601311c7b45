/*
 * coli_errors.h (private): the error codes every part of the core returns,
 * and the helper that writes a failure's message.
 *
 * The codes are public through coli_store.h, which includes this header;
 * build_ffi.py copies the anonymous enums below into the cffi cdef (the
 * Python side maps the codes to exceptions), so they stay plain enums cdef
 * can parse. The reader and the store's own files include this header, not
 * the store's public one.
 */
#ifndef COLI_ERRORS_H
#define COLI_ERRORS_H

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

/* Error codes: a reserved negative range (-1 is the wrappers' NULL-store code). */
enum {
    COLI_OK = 0,
    COLI_EINVAL = -1,       /* NULL or malformed argument */
    COLI_ENOTFOUND = -2,    /* no such layer or expert */
    COLI_EFULL = -3,        /* every slot of the layer stayed leased until the timeout */
    COLI_EIO = -4,          /* a read failed or the file was too short */
    COLI_ENOMEM = -5,       /* an allocation failed */
    COLI_ECONFIG = -6,      /* the configuration is inconsistent */
    COLI_ELEASE = -7,       /* lease misuse, e.g. lookup into a view holding a lease */
    COLI_ETHREAD = -8,      /* a thread or lock could not be created */
    COLI_ETIMEOUT = -9,     /* a wait for idle ended at its timeout */
    COLI_ECLOSED = -10,     /* the store was closed with coli_store_close */
    COLI_EAGAIN = -11       /* coli_store_lookup_resident: not a hit now; do a full lookup */
};

enum {
    COLI_ERR_LEN = 512      /* a message buffer of this many bytes holds any message the core writes */
};

/* Writes the message (snprintf, truncated to err_len) into err, if any, and
 * returns code, so a failure is one statement: return coli_fail(...). */
__attribute__((format(printf, 4, 5)))
static inline int coli_fail(char *err, size_t err_len, int code, const char *fmt, ...) {
    if (err && err_len > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, err_len, fmt, ap);
        va_end(ap);
    }
    return code;
}

#endif /* COLI_ERRORS_H */
