/* GGUF v2/v3 reader (see gguf.h) and the ggml block dequantizers the model loader uses.
 *
 * The file is mmapped read-only and parsed once, front to back, through a bounds-checked
 * cursor: every length, count and offset read from the file is checked against the bytes
 * that are left before it is used, with overflow-safe arithmetic, so a truncated or
 * hostile file gives a message and never an out-of-bounds read. After gguf_open succeeds
 * every accessor is a plain lookup into what was validated here.
 *
 * Byte order: GGUF is little-endian and so are the machines we build for (x86-64,
 * aarch64); values are read with memcpy because nothing in the file is aligned. */
#include "engine/model/gguf.h"
#include "engine/core/err.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32
/* Nesting allowed for arrays of arrays (the format permits it; nobody needs more). */
#define GGUF_MAX_ARRAY_DEPTH 4

typedef struct {
    const char *key; size_t key_len;
    gguf_type type;
    const uint8_t *val;      /* scalar: the value; string: its u64 length; array: header */
    /* arrays only */
    gguf_type elem_type;
    uint64_t n;
    const uint8_t *elems;    /* first element */
    const uint8_t **str_at;  /* string arrays: pointer to each element's u64 length */
} gguf_kv;

struct gguf {
    char path[4096];
    void *map;
    size_t size;
    uint32_t version;
    int64_t n_kv, n_tensors;
    gguf_kv *kv;
    gguf_tensor *tensors;
    size_t alignment;
};

/* ---- bounds-checked cursor ------------------------------------------------------------ */

typedef struct {
    const uint8_t *base;
    size_t size, pos;
    const char *path;
    char *err; size_t errlen;
} cursor;

static int cur_need(cursor *c, size_t n, const char *what) {
    if (n > c->size - c->pos)
        return specd_errf(c->err, c->errlen, SPECD_EFORMAT,
                          "%s: truncated: %s needs %zu bytes at offset %zu, file has %zu",
                          c->path, what, n, c->pos, c->size);
    return 0;
}

static int cur_read(cursor *c, void *dst, size_t n, const char *what) {
    int rc = cur_need(c, n, what);
    if (rc) return rc;
    memcpy(dst, c->base + c->pos, n);
    c->pos += n;
    return 0;
}

static int cur_u32(cursor *c, uint32_t *v, const char *what) { return cur_read(c, v, 4, what); }
static int cur_u64(cursor *c, uint64_t *v, const char *what) { return cur_read(c, v, 8, what); }

/* A GGUF string: u64 length then bytes (no NUL). */
static int cur_str(cursor *c, const char **s, size_t *len, const char *what) {
    uint64_t n;
    int rc = cur_u64(c, &n, what);
    if (rc) return rc;
    if (n > c->size - c->pos)
        return specd_errf(c->err, c->errlen, SPECD_EFORMAT,
                          "%s: truncated: %s string of %llu bytes at offset %zu, file has %zu",
                          c->path, what, (unsigned long long)n, c->pos, c->size);
    *s = (const char *)(c->base + c->pos);
    *len = (size_t)n;
    c->pos += (size_t)n;
    return 0;
}

/* Size in bytes of a fixed-size scalar type, 0 for string/array/unknown. */
static size_t scalar_size(uint32_t t) {
    switch (t) {
    case GGUF_T_UINT8: case GGUF_T_INT8: case GGUF_T_BOOL: return 1;
    case GGUF_T_UINT16: case GGUF_T_INT16: return 2;
    case GGUF_T_UINT32: case GGUF_T_INT32: case GGUF_T_FLOAT32: return 4;
    case GGUF_T_UINT64: case GGUF_T_INT64: case GGUF_T_FLOAT64: return 8;
    default: return 0;
    }
}

static int valid_type(uint32_t t) { return t <= GGUF_T_FLOAT64; }

/* Skip over one value of type t (used for array elements and nested arrays). */
static int skip_value(cursor *c, uint32_t t, int depth, const char *key) {
    if (!valid_type(t))
        return specd_errf(c->err, c->errlen, SPECD_EFORMAT,
                          "%s: key %s: unknown value type %u", c->path, key, t);
    if (t == GGUF_T_STRING) {
        const char *s; size_t n;
        return cur_str(c, &s, &n, key);
    }
    if (t == GGUF_T_ARRAY) {
        uint32_t et; uint64_t n;
        int rc;
        if (depth >= GGUF_MAX_ARRAY_DEPTH)
            return specd_errf(c->err, c->errlen, SPECD_EFORMAT,
                              "%s: key %s: arrays nested too deep", c->path, key);
        if ((rc = cur_u32(c, &et, key)) || (rc = cur_u64(c, &n, key))) return rc;
        if (!valid_type(et))
            return specd_errf(c->err, c->errlen, SPECD_EFORMAT,
                              "%s: key %s: unknown array element type %u", c->path, key, et);
        size_t es = scalar_size(et);
        if (es) {
            if (n > (c->size - c->pos) / es)
                return specd_errf(c->err, c->errlen, SPECD_EFORMAT,
                                  "%s: truncated: key %s array of %llu elements at offset %zu",
                                  c->path, key, (unsigned long long)n, c->pos);
            c->pos += (size_t)n * es;
            return 0;
        }
        for (uint64_t i = 0; i < n; i++)
            if ((rc = skip_value(c, et, depth + 1, key))) return rc;
        return 0;
    }
    int rc = cur_need(c, scalar_size(t), key);
    if (rc) return rc;
    c->pos += scalar_size(t);
    return 0;
}

/* ---- ggml type table ------------------------------------------------------------------ */

/* Block size (elements) and bytes per block. Includes types we cannot dequantize so that
 * files holding them still validate (a tokenizer only needs the metadata); the model
 * loader rejects those by name. */
typedef struct { int blck; size_t bytes; const char *name; } type_info;

static type_info ggml_info(int t) {
    switch (t) {
    case GGML_F32: return (type_info){1, 4, "F32"};
    case GGML_F16: return (type_info){1, 2, "F16"};
    case GGML_Q4_0: return (type_info){32, 18, "Q4_0"};
    case GGML_Q4_1: return (type_info){32, 20, "Q4_1"};
    case GGML_Q5_0: return (type_info){32, 22, "Q5_0"};
    case GGML_Q5_1: return (type_info){32, 24, "Q5_1"};
    case GGML_Q8_0: return (type_info){32, 34, "Q8_0"};
    case 9: return (type_info){32, 40, "Q8_1"};
    case 10: return (type_info){256, 84, "Q2_K"};
    case 11: return (type_info){256, 110, "Q3_K"};
    case GGML_Q4_K: return (type_info){256, 144, "Q4_K"};
    case GGML_Q5_K: return (type_info){256, 176, "Q5_K"};
    case GGML_Q6_K: return (type_info){256, 210, "Q6_K"};
    case 15: return (type_info){256, 292, "Q8_K"};
    case 16: return (type_info){256, 66, "IQ2_XXS"};
    case 17: return (type_info){256, 74, "IQ2_XS"};
    case 18: return (type_info){256, 98, "IQ3_XXS"};
    case 19: return (type_info){256, 50, "IQ1_S"};
    case 20: return (type_info){32, 18, "IQ4_NL"};
    case 21: return (type_info){256, 110, "IQ3_S"};
    case 22: return (type_info){256, 82, "IQ2_S"};
    case 23: return (type_info){256, 136, "IQ4_XS"};
    case 24: return (type_info){1, 1, "I8"};
    case 25: return (type_info){1, 2, "I16"};
    case 26: return (type_info){1, 4, "I32"};
    case 27: return (type_info){1, 8, "I64"};
    case 28: return (type_info){1, 8, "F64"};
    case 29: return (type_info){256, 56, "IQ1_M"};
    case GGML_BF16: return (type_info){1, 2, "BF16"};
    case 34: return (type_info){256, 54, "TQ1_0"};
    case 35: return (type_info){256, 66, "TQ2_0"};
    case 39: return (type_info){32, 17, "MXFP4"};
    default: return (type_info){0, 0, "unknown"};
    }
}

size_t ggml_row_size(ggml_type t, int64_t ne0) {
    type_info ti = ggml_info((int)t);
    if (!ti.blck || ne0 < 0 || ne0 % ti.blck) return 0;
    uint64_t blocks = (uint64_t)ne0 / (uint64_t)ti.blck;
    if (blocks > SIZE_MAX / ti.bytes) return 0;
    return (size_t)blocks * ti.bytes;
}

const char *ggml_type_name(ggml_type t) { return ggml_info((int)t).name; }

/* ---- parsing -------------------------------------------------------------------------- */

static int parse_kv(gguf *g, cursor *c, gguf_kv *kv) {
    int rc;
    uint32_t t;
    if ((rc = cur_str(c, &kv->key, &kv->key_len, "metadata key"))) return rc;
    char key[256];
    snprintf(key, sizeof key, "%.*s", (int)(kv->key_len < 200 ? kv->key_len : 200), kv->key);
    if ((rc = cur_u32(c, &t, key))) return rc;
    if (!valid_type(t))
        return specd_errf(c->err, c->errlen, SPECD_EFORMAT,
                          "%s: key %s: unknown value type %u", g->path, key, t);
    kv->type = (gguf_type)t;
    kv->val = c->base + c->pos;
    if (t != GGUF_T_ARRAY) return skip_value(c, t, 0, key);

    uint32_t et;
    if ((rc = cur_u32(c, &et, key)) || (rc = cur_u64(c, &kv->n, key))) return rc;
    if (!valid_type(et))
        return specd_errf(c->err, c->errlen, SPECD_EFORMAT,
                          "%s: key %s: unknown array element type %u", g->path, key, et);
    kv->elem_type = (gguf_type)et;
    kv->elems = c->base + c->pos;
    if (et == GGUF_T_STRING) {
        /* Each string element needs at least its 8-byte length: bounds n before malloc. */
        if (kv->n > (c->size - c->pos) / 8)
            return specd_errf(c->err, c->errlen, SPECD_EFORMAT,
                              "%s: truncated: key %s has %llu strings, file too short",
                              g->path, key, (unsigned long long)kv->n);
        kv->str_at = malloc((size_t)(kv->n ? kv->n : 1) * sizeof *kv->str_at);
        if (!kv->str_at)
            return specd_errf(c->err, c->errlen, SPECD_ENOMEM, "%s: key %s: out of memory",
                              g->path, key);
        for (uint64_t i = 0; i < kv->n; i++) {
            const char *s; size_t n;
            kv->str_at[i] = c->base + c->pos;
            if ((rc = cur_str(c, &s, &n, key))) return rc;
        }
        return 0;
    }
    /* Rewind to the array header and let skip_value validate its extent. */
    c->pos = (size_t)(kv->val - c->base);
    return skip_value(c, GGUF_T_ARRAY, 0, key);
}

static int parse_tensor_info(gguf *g, cursor *c, gguf_tensor *t, uint64_t *offset) {
    int rc;
    uint32_t nd, type;
    if ((rc = cur_str(c, &t->name, &t->name_len, "tensor name"))) return rc;
    char name[256];
    snprintf(name, sizeof name, "%.*s", (int)(t->name_len < 200 ? t->name_len : 200), t->name);
    if ((rc = cur_u32(c, &nd, name))) return rc;
    if (nd < 1 || nd > 4)
        return specd_errf(c->err, c->errlen, SPECD_EFORMAT,
                          "%s: tensor %s: %u dimensions (1..4 allowed)", g->path, name, nd);
    t->n_dims = (int)nd;
    for (int i = 0; i < 4; i++) t->ne[i] = 1;
    for (uint32_t i = 0; i < nd; i++) {
        uint64_t ne;
        if ((rc = cur_u64(c, &ne, name))) return rc;
        if (ne > (uint64_t)INT64_MAX)
            return specd_errf(c->err, c->errlen, SPECD_EFORMAT,
                              "%s: tensor %s: dimension %u too large", g->path, name, i);
        t->ne[i] = (int64_t)ne;
    }
    if ((rc = cur_u32(c, &type, name)) || (rc = cur_u64(c, offset, name))) return rc;
    t->type = (ggml_type)type;
    type_info ti = ggml_info((int)type);
    if (!ti.blck)
        return specd_errf(c->err, c->errlen, SPECD_EUNSUPPORTED,
                          "%s: tensor %s: unknown ggml type %u", g->path, name, type);
    size_t row = ggml_row_size(t->type, t->ne[0]);
    if (!row && t->ne[0] != 0)
        return specd_errf(c->err, c->errlen, SPECD_EFORMAT,
                          "%s: tensor %s: row length %lld is not a multiple of the %s block (%d)",
                          g->path, name, (long long)t->ne[0], ti.name, ti.blck);
    /* nbytes = row * ne1 * ne2 * ne3, overflow-checked. */
    size_t nbytes = row;
    for (int i = 1; i < 4; i++) {
        uint64_t d = (uint64_t)t->ne[i];
        if (d && nbytes > SIZE_MAX / d)
            return specd_errf(c->err, c->errlen, SPECD_EFORMAT,
                              "%s: tensor %s: size overflows", g->path, name);
        nbytes *= (size_t)d;
    }
    t->nbytes = nbytes;
    return 0;
}

static int name_eq(const char *a, size_t alen, const char *b, size_t blen) {
    return alen == blen && memcmp(a, b, alen) == 0;
}

static int parse(gguf *g, char *err, size_t errlen) {
    cursor c = { g->map, g->size, 0, g->path, err, errlen };
    char magic[4];
    uint64_t nt, nkv;
    int rc;
    if ((rc = cur_read(&c, magic, 4, "magic"))) return rc;
    if (memcmp(magic, GGUF_MAGIC, 4))
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: not a GGUF file (bad magic)", g->path);
    if ((rc = cur_u32(&c, &g->version, "version"))) return rc;
    if (g->version != 2 && g->version != 3)
        return specd_errf(err, errlen, SPECD_EUNSUPPORTED,
                          "%s: GGUF version %u not supported (2 and 3 are)", g->path, g->version);
    if ((rc = cur_u64(&c, &nt, "tensor count")) || (rc = cur_u64(&c, &nkv, "metadata count")))
        return rc;
    /* Every kv needs >= 12 bytes and every tensor info >= 24: bound before allocating. */
    size_t left = g->size - c.pos;
    if (nkv > left / 12 || nt > left / 24)
        return specd_errf(err, errlen, SPECD_EFORMAT,
                          "%s: truncated: header claims %llu keys and %llu tensors, file has %zu bytes",
                          g->path, (unsigned long long)nkv, (unsigned long long)nt, g->size);
    g->n_kv = (int64_t)nkv;
    g->n_tensors = (int64_t)nt;
    g->kv = calloc(nkv ? nkv : 1, sizeof *g->kv);
    g->tensors = calloc(nt ? nt : 1, sizeof *g->tensors);
    uint64_t *offsets = calloc(nt ? nt : 1, sizeof *offsets);
    if (!g->kv || !g->tensors || !offsets) {
        free(offsets);
        return specd_errf(err, errlen, SPECD_ENOMEM, "%s: out of memory", g->path);
    }

    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    for (uint64_t i = 0; i < nkv; i++) {
        gguf_kv *kv = &g->kv[i];
        if ((rc = parse_kv(g, &c, kv))) goto out;
        for (uint64_t j = 0; j < i; j++)
            if (name_eq(g->kv[j].key, g->kv[j].key_len, kv->key, kv->key_len)) {
                rc = specd_errf(err, errlen, SPECD_EFORMAT, "%s: duplicate key %.*s", g->path,
                                (int)(kv->key_len < 200 ? kv->key_len : 200), kv->key);
                goto out;
            }
        if (name_eq(kv->key, kv->key_len, "general.alignment", 17)) {
            uint32_t a;
            if (kv->type != GGUF_T_UINT32) {
                rc = specd_errf(err, errlen, SPECD_EFORMAT,
                                "%s: general.alignment must be uint32", g->path);
                goto out;
            }
            memcpy(&a, kv->val, 4);
            if (a == 0 || (a & (a - 1))) {
                rc = specd_errf(err, errlen, SPECD_EFORMAT,
                                "%s: general.alignment %u is not a power of two", g->path, a);
                goto out;
            }
            g->alignment = a;
        }
    }
    for (uint64_t i = 0; i < nt; i++) {
        if ((rc = parse_tensor_info(g, &c, &g->tensors[i], &offsets[i]))) goto out;
        for (uint64_t j = 0; j < i; j++)
            if (name_eq(g->tensors[j].name, g->tensors[j].name_len, g->tensors[i].name,
                        g->tensors[i].name_len)) {
                rc = specd_errf(err, errlen, SPECD_EFORMAT, "%s: duplicate tensor %.*s", g->path,
                                (int)(g->tensors[i].name_len < 200 ? g->tensors[i].name_len : 200),
                                g->tensors[i].name);
                goto out;
            }
    }

    /* Tensor data starts at the next multiple of the alignment after the directory. */
    size_t data_start = c.pos;
    if (data_start % g->alignment) data_start += g->alignment - data_start % g->alignment;
    if (nt && data_start > g->size) {
        rc = specd_errf(err, errlen, SPECD_EFORMAT,
                        "%s: truncated: tensor data would start at %zu, file has %zu bytes",
                        g->path, data_start, g->size);
        goto out;
    }
    for (uint64_t i = 0; i < nt; i++) {
        gguf_tensor *t = &g->tensors[i];
        int nl = (int)(t->name_len < 200 ? t->name_len : 200);
        if (offsets[i] % g->alignment) {
            rc = specd_errf(err, errlen, SPECD_EFORMAT,
                            "%s: tensor %.*s: offset %llu is not aligned to %zu", g->path, nl,
                            t->name, (unsigned long long)offsets[i], g->alignment);
            goto out;
        }
        size_t avail = g->size - data_start;
        if (offsets[i] > avail || t->nbytes > avail - offsets[i]) {
            rc = specd_errf(err, errlen, SPECD_EFORMAT,
                            "%s: truncated: tensor %.*s needs bytes [%llu, %llu) of the data "
                            "section, which has %zu",
                            g->path, nl, t->name, (unsigned long long)offsets[i],
                            (unsigned long long)offsets[i] + (unsigned long long)t->nbytes, avail);
            goto out;
        }
        t->data = (const uint8_t *)g->map + data_start + offsets[i];
    }
    rc = 0;
out:
    free(offsets);
    return rc;
}

gguf *gguf_open(const char *path, char *err, size_t errlen) {
    gguf *g = calloc(1, sizeof *g);
    int fd = -1;
    if (!g) {
        specd_errf(err, errlen, SPECD_ENOMEM, "%s: out of memory", path);
        return NULL;
    }
    snprintf(g->path, sizeof g->path, "%s", path);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        specd_errf(err, errlen, SPECD_EIO, "%s: %s", path, strerror(errno));
        goto fail;
    }
    struct stat st;
    if (fstat(fd, &st) < 0) {
        specd_errf(err, errlen, SPECD_EIO, "%s: %s", path, strerror(errno));
        goto fail;
    }
    if (!S_ISREG(st.st_mode)) {
        specd_errf(err, errlen, SPECD_EIO, "%s: not a regular file", path);
        goto fail;
    }
    if (st.st_size < 24) {
        specd_errf(err, errlen, SPECD_EFORMAT,
                   "%s: truncated: %lld bytes, a GGUF header needs 24", path, (long long)st.st_size);
        goto fail;
    }
    g->size = (size_t)st.st_size;
    g->map = mmap(NULL, g->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (g->map == MAP_FAILED) {
        g->map = NULL;
        specd_errf(err, errlen, SPECD_EIO, "%s: mmap: %s", path, strerror(errno));
        goto fail;
    }
    close(fd);
    fd = -1;
    if (parse(g, err, errlen)) goto fail;
    return g;
fail:
    if (fd >= 0) close(fd);
    gguf_close(g);
    return NULL;
}

void gguf_close(gguf *g) {
    if (!g) return;
    if (g->kv)
        for (int64_t i = 0; i < g->n_kv; i++) free(g->kv[i].str_at);
    free(g->kv);
    free(g->tensors);
    if (g->map) munmap(g->map, g->size);
    free(g);
}

uint32_t gguf_version(const gguf *g) { return g->version; }
int64_t gguf_n_kv(const gguf *g) { return g->n_kv; }
int64_t gguf_n_tensors(const gguf *g) { return g->n_tensors; }

/* ---- metadata accessors --------------------------------------------------------------- */

int gguf_find_key(const gguf *g, const char *key) {
    size_t n = strlen(key);
    for (int64_t i = 0; i < g->n_kv; i++)
        if (name_eq(g->kv[i].key, g->kv[i].key_len, key, n)) return (int)i;
    return SPECD_ENOTFOUND;
}

gguf_type gguf_key_type(const gguf *g, int idx) {
    if (idx < 0 || idx >= g->n_kv) return (gguf_type)-1;
    return g->kv[idx].type;
}

/* Read a numeric element at p of type t as int64/uint64/double. Returns 0, or
 * SPECD_EFORMAT for non-numeric types. */
static int read_num(const uint8_t *p, gguf_type t, int64_t *i, uint64_t *u, double *d, int *is_float) {
    *is_float = 0;
    switch (t) {
    case GGUF_T_UINT8: { uint8_t v; memcpy(&v, p, 1); *u = v; *i = v; break; }
    case GGUF_T_BOOL: { uint8_t v; memcpy(&v, p, 1); *u = v != 0; *i = v != 0; break; }
    case GGUF_T_INT8: { int8_t v; memcpy(&v, p, 1); *i = v; *u = (uint64_t)v; break; }
    case GGUF_T_UINT16: { uint16_t v; memcpy(&v, p, 2); *u = v; *i = v; break; }
    case GGUF_T_INT16: { int16_t v; memcpy(&v, p, 2); *i = v; *u = (uint64_t)v; break; }
    case GGUF_T_UINT32: { uint32_t v; memcpy(&v, p, 4); *u = v; *i = v; break; }
    case GGUF_T_INT32: { int32_t v; memcpy(&v, p, 4); *i = v; *u = (uint64_t)v; break; }
    case GGUF_T_UINT64: { uint64_t v; memcpy(&v, p, 8); *u = v; *i = (int64_t)v; break; }
    case GGUF_T_INT64: { int64_t v; memcpy(&v, p, 8); *i = v; *u = (uint64_t)v; break; }
    case GGUF_T_FLOAT32: { float v; memcpy(&v, p, 4); *d = v; *is_float = 1; return 0; }
    case GGUF_T_FLOAT64: { double v; memcpy(&v, p, 8); *d = v; *is_float = 1; return 0; }
    default: return SPECD_EFORMAT;
    }
    *d = (t == GGUF_T_UINT64) ? (double)*u : (double)*i;
    return 0;
}

static const gguf_kv *kv_get(const gguf *g, const char *key) {
    int i = gguf_find_key(g, key);
    return i < 0 ? NULL : &g->kv[i];
}

int gguf_get_u64(const gguf *g, const char *key, uint64_t *out) {
    const gguf_kv *kv = kv_get(g, key);
    int64_t i; uint64_t u; double d; int f;
    if (!kv) return SPECD_ENOTFOUND;
    if (read_num(kv->val, kv->type, &i, &u, &d, &f) || f) return SPECD_EFORMAT;
    /* A negative signed value is not a u64. */
    if ((kv->type == GGUF_T_INT8 || kv->type == GGUF_T_INT16 || kv->type == GGUF_T_INT32 ||
         kv->type == GGUF_T_INT64) && i < 0)
        return SPECD_EFORMAT;
    *out = u;
    return 0;
}

int gguf_get_i64(const gguf *g, const char *key, int64_t *out) {
    const gguf_kv *kv = kv_get(g, key);
    int64_t i; uint64_t u; double d; int f;
    if (!kv) return SPECD_ENOTFOUND;
    if (read_num(kv->val, kv->type, &i, &u, &d, &f) || f) return SPECD_EFORMAT;
    if (kv->type == GGUF_T_UINT64 && u > (uint64_t)INT64_MAX) return SPECD_EFORMAT;
    *out = i;
    return 0;
}

int gguf_get_f64(const gguf *g, const char *key, double *out) {
    const gguf_kv *kv = kv_get(g, key);
    int64_t i; uint64_t u; int f;
    if (!kv) return SPECD_ENOTFOUND;
    if (kv->type == GGUF_T_BOOL) return SPECD_EFORMAT;
    if (read_num(kv->val, kv->type, &i, &u, out, &f)) return SPECD_EFORMAT;
    return 0;
}

int gguf_get_bool(const gguf *g, const char *key, int *out) {
    const gguf_kv *kv = kv_get(g, key);
    if (!kv) return SPECD_ENOTFOUND;
    if (kv->type != GGUF_T_BOOL) return SPECD_EFORMAT;
    *out = kv->val[0] != 0;
    return 0;
}

int gguf_get_str(const gguf *g, const char *key, const char **s, size_t *len) {
    const gguf_kv *kv = kv_get(g, key);
    uint64_t n;
    if (!kv) return SPECD_ENOTFOUND;
    if (kv->type != GGUF_T_STRING) return SPECD_EFORMAT;
    memcpy(&n, kv->val, 8);
    *s = (const char *)kv->val + 8;
    *len = (size_t)n;
    return 0;
}

int gguf_get_arr(const gguf *g, const char *key, gguf_type *elem_type, uint64_t *n) {
    const gguf_kv *kv = kv_get(g, key);
    if (!kv) return SPECD_ENOTFOUND;
    if (kv->type != GGUF_T_ARRAY) return SPECD_EFORMAT;
    *elem_type = kv->elem_type;
    *n = kv->n;
    return 0;
}

int gguf_arr_str(const gguf *g, const char *key, uint64_t i, const char **s, size_t *len) {
    const gguf_kv *kv = kv_get(g, key);
    uint64_t n;
    if (!kv) return SPECD_ENOTFOUND;
    if (kv->type != GGUF_T_ARRAY || kv->elem_type != GGUF_T_STRING) return SPECD_EFORMAT;
    if (i >= kv->n) return SPECD_ERANGE;
    memcpy(&n, kv->str_at[i], 8);
    *s = (const char *)kv->str_at[i] + 8;
    *len = (size_t)n;
    return 0;
}

/* Pointer to numeric element i of an array key, with its type; <0 on error. */
static int arr_elem(const gguf *g, const char *key, uint64_t i, const uint8_t **p, gguf_type *t) {
    const gguf_kv *kv = kv_get(g, key);
    if (!kv) return SPECD_ENOTFOUND;
    if (kv->type != GGUF_T_ARRAY) return SPECD_EFORMAT;
    size_t es = scalar_size(kv->elem_type);
    if (!es) return SPECD_EFORMAT;
    if (i >= kv->n) return SPECD_ERANGE;
    *p = kv->elems + (size_t)i * es;
    *t = kv->elem_type;
    return 0;
}

int gguf_arr_i64(const gguf *g, const char *key, uint64_t i, int64_t *out) {
    const uint8_t *p; gguf_type t;
    int64_t v; uint64_t u; double d; int f;
    int rc = arr_elem(g, key, i, &p, &t);
    if (rc) return rc;
    if (read_num(p, t, &v, &u, &d, &f) || f) return SPECD_EFORMAT;
    *out = v;
    return 0;
}

int gguf_arr_f64(const gguf *g, const char *key, uint64_t i, double *out) {
    const uint8_t *p; gguf_type t;
    int64_t v; uint64_t u; int f;
    int rc = arr_elem(g, key, i, &p, &t);
    if (rc) return rc;
    if (read_num(p, t, &v, &u, out, &f)) return SPECD_EFORMAT;
    return 0;
}

/* ---- tensors -------------------------------------------------------------------------- */

const gguf_tensor *gguf_tensor_at(const gguf *g, int64_t i) {
    if (i < 0 || i >= g->n_tensors) return NULL;
    return &g->tensors[i];
}

const gguf_tensor *gguf_find_tensor(const gguf *g, const char *name) {
    size_t n = strlen(name);
    for (int64_t i = 0; i < g->n_tensors; i++)
        if (name_eq(g->tensors[i].name, g->tensors[i].name_len, name, n)) return &g->tensors[i];
    return NULL;
}

/* ---- dequantization ------------------------------------------------------------------- */
/* Written from the block layouts of ggml's quantization formats. Every block starts with
 * fp16 scale(s) except Q6_K, whose scale is last. Byte layouts:
 *   Q8_0 (32):  d, int8 q[32]                    x = d*q
 *   Q4_0 (32):  d, u8 qs[16]                     x[j] = d*(lo(qs[j])-8), x[j+16] = d*(hi-8)
 *   Q4_1 (32):  d, m, u8 qs[16]                  x = d*nibble + m (same order as Q4_0)
 *   Q4_K (256): d, dmin, u8 scales[12], u8 qs[128]; eight 32-element sub-blocks with 6-bit
 *               scale and min packed in scales[]; x = d*sc*nibble - dmin*m
 *   Q6_K (256): u8 ql[128], u8 qh[64], int8 sc[16], d; 6-bit q = low 4 bits from ql, high
 *               2 from qh, minus 32; sixteen 16-element groups, x = d*sc*q */

float ggml_fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);            /* inf / NaN (payload kept) */
    } else if (exp == 0) {
        if (!man) {
            bits = sign;                                     /* signed zero */
        } else {                                             /* subnormal: normalise */
            int e = -1;
            do { man <<= 1; e++; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float rd_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return ggml_fp16_to_f32(h);
}

static void deq_q8_0(const uint8_t *b, float *y) {
    float d = rd_f16(b);
    for (int j = 0; j < 32; j++) y[j] = d * (float)(int8_t)b[2 + j];
}

static void deq_q4_0(const uint8_t *b, float *y) {
    float d = rd_f16(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((qs[j] & 0xf) - 8);
        y[j + 16] = d * (float)((qs[j] >> 4) - 8);
    }
}

static void deq_q4_1(const uint8_t *b, float *y) {
    float d = rd_f16(b), m = rd_f16(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(qs[j] & 0xf) + m;
        y[j + 16] = d * (float)(qs[j] >> 4) + m;
    }
}

/* Q5_0 / Q5_1: 32 values; the low 4 bits as in Q4_0 / Q4_1, the fifth bit of value j in
 * bit j of the 32-bit qh. Q5_0 is centred at 16, Q5_1 has a min. */
static void deq_q5(const uint8_t *b, float *y, int has_min) {
    float d = rd_f16(b), m = has_min ? rd_f16(b + 2) : 0.f;
    const uint8_t *p = b + (has_min ? 4 : 2), *qs = p + 4;
    uint32_t qh = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
    int off = has_min ? 0 : 16;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0xf) | (int)((qh >> j) & 1) << 4;
        int hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        y[j] = d * (float)(lo - off) + m;
        y[j + 16] = d * (float)(hi - off) + m;
    }
}

/* Sub-block j's 6-bit scale and min: the first four live in the low 6 bits of bytes 0..7;
 * the last four take 4 bits from bytes 8..11 and their top 2 bits from the spare high
 * bits of bytes 0..7. */
static void k4_scale_min(int j, const uint8_t *s, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

static void deq_q4_k(const uint8_t *b, float *y) {
    float d = rd_f16(b), dmin = rd_f16(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    /* Each 32 bytes of qs hold two sub-blocks: low nibbles then high nibbles. */
    for (int sb = 0; sb < 8; sb += 2, q += 32, y += 64) {
        int sc1, m1, sc2, m2;
        k4_scale_min(sb, scales, &sc1, &m1);
        k4_scale_min(sb + 1, scales, &sc2, &m2);
        float d1 = d * (float)sc1, mn1 = dmin * (float)m1;
        float d2 = d * (float)sc2, mn2 = dmin * (float)m2;
        for (int l = 0; l < 32; l++) y[l] = d1 * (float)(q[l] & 0xf) - mn1;
        for (int l = 0; l < 32; l++) y[32 + l] = d2 * (float)(q[l] >> 4) - mn2;
    }
}

/* Q5_K: Q4_K's layout (d, dmin, 12 bytes of scales and mins, 128 bytes of nibbles) plus
 * 32 bytes qh after the scales: the fifth bit of element l of sub-block pair k (+0 for
 * the low-nibble sub-block, +1 for the high one) is bit 2k (2k+1) of qh[l]. */
static void deq_q5_k(const uint8_t *b, float *y) {
    float d = rd_f16(b), dmin = rd_f16(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *q = b + 48;
    for (int sb = 0; sb < 8; sb += 2, q += 32, y += 64) {
        int sc1, m1, sc2, m2;
        k4_scale_min(sb, scales, &sc1, &m1);
        k4_scale_min(sb + 1, scales, &sc2, &m2);
        float d1 = d * (float)sc1, mn1 = dmin * (float)m1;
        float d2 = d * (float)sc2, mn2 = dmin * (float)m2;
        for (int l = 0; l < 32; l++) y[l] = d1 * (float)((q[l] & 0xf) | ((qh[l] >> sb) & 1) << 4) - mn1;
        for (int l = 0; l < 32; l++) y[32 + l] = d2 * (float)((q[l] >> 4) | ((qh[l] >> (sb + 1)) & 1) << 4) - mn2;
    }
}

static void deq_q6_k(const uint8_t *b, float *y) {
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = rd_f16(b + 208);
    /* Two halves of 128 elements; in each, element l (+32, +64, +96) takes its low bits
     * from ql[l] / ql[l+32] (low or high nibble) and its high bits from qh[l]. */
    for (int half = 0; half < 2; half++, ql += 64, qh += 32, sc += 8, y += 128) {
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = (int)((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
            int q2 = (int)((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
            int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
    }
}

int ggml_dequantize(ggml_type t, const void *src, float *dst, int64_t n) {
    const uint8_t *p = src;
    type_info ti = ggml_info((int)t);
    if (n < 0 || !ti.blck || n % ti.blck) return ti.blck ? SPECD_EINVAL : SPECD_EUNSUPPORTED;
    int64_t nb = n / ti.blck;
    switch (t) {
    case GGML_F32:
        memcpy(dst, src, (size_t)n * 4);
        return 0;
    case GGML_F16:
        for (int64_t i = 0; i < n; i++) dst[i] = rd_f16(p + 2 * i);
        return 0;
    case GGML_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            uint32_t bits;
            memcpy(&h, p + 2 * i, 2);
            bits = (uint32_t)h << 16;
            memcpy(&dst[i], &bits, 4);
        }
        return 0;
    case GGML_Q8_0: for (int64_t i = 0; i < nb; i++) deq_q8_0(p + i * 34, dst + i * 32); return 0;
    case GGML_Q4_0: for (int64_t i = 0; i < nb; i++) deq_q4_0(p + i * 18, dst + i * 32); return 0;
    case GGML_Q4_1: for (int64_t i = 0; i < nb; i++) deq_q4_1(p + i * 20, dst + i * 32); return 0;
    case GGML_Q4_K: for (int64_t i = 0; i < nb; i++) deq_q4_k(p + i * 144, dst + i * 256); return 0;
    case GGML_Q5_0: for (int64_t i = 0; i < nb; i++) deq_q5(p + i * 22, dst + i * 32, 0); return 0;
    case GGML_Q5_1: for (int64_t i = 0; i < nb; i++) deq_q5(p + i * 24, dst + i * 32, 1); return 0;
    case GGML_Q5_K: for (int64_t i = 0; i < nb; i++) deq_q5_k(p + i * 176, dst + i * 256); return 0;
    case GGML_Q6_K: for (int64_t i = 0; i < nb; i++) deq_q6_k(p + i * 210, dst + i * 256); return 0;
    default: return SPECD_EUNSUPPORTED;
    }
}
