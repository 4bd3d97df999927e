/* safetensors reader (see safetensors.h). The JSON header is parsed with jansson; every
 * number in it is checked (integers, non-negative, inside the file, size matches shape)
 * with overflow-safe arithmetic before a pointer into the mapping is formed. */
#include "engine/model/safetensors.h"
#include "engine/core/err.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* A header bigger than this is not a checkpoint we want to parse (the format's own
 * reference implementation uses the same 100 MB cap). */
#define ST_MAX_HEADER (100u * 1024 * 1024)

struct st_file {
    char path[4096];
    void *map;
    size_t size;
    int64_t n;
    st_tensor *tensors;     /* sorted by name */
    char *names;            /* all names, NUL-separated */
};

static const struct { const char *name; st_dtype t; size_t size; } dtypes[] = {
    {"F32", ST_F32, 4}, {"F16", ST_F16, 2}, {"BF16", ST_BF16, 2}, {"F64", ST_F64, 8},
    {"I64", ST_I64, 8}, {"I32", ST_I32, 4}, {"I16", ST_I16, 2}, {"I8", ST_I8, 1},
    {"U8", ST_U8, 1}, {"BOOL", ST_BOOL, 1}, {"F8_E4M3", ST_F8_E4M3, 1},
    {"F8_E5M2", ST_F8_E5M2, 1},
};
#define N_DTYPES (sizeof dtypes / sizeof dtypes[0])

const char *st_dtype_name(st_dtype t) {
    for (size_t i = 0; i < N_DTYPES; i++)
        if (dtypes[i].t == t) return dtypes[i].name;
    return "unknown";
}

size_t st_dtype_size(st_dtype t) {
    for (size_t i = 0; i < N_DTYPES; i++)
        if (dtypes[i].t == t) return dtypes[i].size;
    return 0;
}

static int cmp_tensor(const void *a, const void *b) {
    return strcmp(((const st_tensor *)a)->name, ((const st_tensor *)b)->name);
}

/* A JSON integer that is >= 0; jansson keeps integers as json_int_t (long long). */
static int get_uint(json_t *v, uint64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return -1;
    *out = (uint64_t)json_integer_value(v);
    return 0;
}

static int parse_entry(st_file *f, const char *name, json_t *obj, st_tensor *t, size_t data_size,
                       char *err, size_t errlen) {
    if (!json_is_object(obj))
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: tensor %s: entry is not an object",
                          f->path, name);
    json_t *jd = json_object_get(obj, "dtype"), *js = json_object_get(obj, "shape");
    json_t *jo = json_object_get(obj, "data_offsets");
    if (!json_is_string(jd))
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: tensor %s: missing dtype", f->path, name);
    size_t k;
    for (k = 0; k < N_DTYPES; k++)
        if (!strcmp(json_string_value(jd), dtypes[k].name)) break;
    if (k == N_DTYPES)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: tensor %s: unknown dtype \"%.32s\"",
                          f->path, name, json_string_value(jd));
    t->dtype = dtypes[k].t;
    if (!json_is_array(js) || json_array_size(js) > ST_MAX_DIMS)
        return specd_errf(err, errlen, SPECD_EFORMAT,
                          "%s: tensor %s: shape must be an array of at most %d integers",
                          f->path, name, ST_MAX_DIMS);
    t->ndim = (int)json_array_size(js);
    uint64_t numel = 1;
    for (int i = 0; i < t->ndim; i++) {
        uint64_t d;
        if (get_uint(json_array_get(js, (size_t)i), &d) || d > (uint64_t)INT64_MAX)
            return specd_errf(err, errlen, SPECD_EFORMAT,
                              "%s: tensor %s: shape[%d] is not a non-negative integer",
                              f->path, name, i);
        t->shape[i] = (int64_t)d;
        if (d && numel > UINT64_MAX / d)
            return specd_errf(err, errlen, SPECD_EFORMAT, "%s: tensor %s: shape overflows",
                              f->path, name);
        numel *= d;
    }
    uint64_t b, e;
    if (!json_is_array(jo) || json_array_size(jo) != 2 || get_uint(json_array_get(jo, 0), &b) ||
        get_uint(json_array_get(jo, 1), &e) || b > e)
        return specd_errf(err, errlen, SPECD_EFORMAT,
                          "%s: tensor %s: data_offsets must be [begin, end] with begin <= end",
                          f->path, name);
    if (e > data_size)
        return specd_errf(err, errlen, SPECD_EFORMAT,
                          "%s: truncated: tensor %s: data_offsets end %llu is beyond the data "
                          "section (%zu bytes)",
                          f->path, name, (unsigned long long)e, data_size);
    if (numel > UINT64_MAX / dtypes[k].size || e - b != numel * dtypes[k].size)
        return specd_errf(err, errlen, SPECD_EFORMAT,
                          "%s: tensor %s: data_offsets span %llu bytes but shape x %s needs %llu",
                          f->path, name, (unsigned long long)(e - b), dtypes[k].name,
                          (unsigned long long)(numel * dtypes[k].size));
    t->nbytes = (size_t)(e - b);
    t->data = (const uint8_t *)f->map + (f->size - data_size) + b;
    return 0;
}

static int parse_header(st_file *f, char *err, size_t errlen) {
    uint64_t hlen;
    json_t *root = NULL;
    int rc;
    if (f->size < 8)
        return specd_errf(err, errlen, SPECD_EFORMAT,
                          "%s: truncated: %zu bytes, the header length alone needs 8", f->path,
                          f->size);
    memcpy(&hlen, f->map, 8);
    if (hlen > ST_MAX_HEADER)
        return specd_errf(err, errlen, SPECD_EFORMAT,
                          "%s: bad header length %llu (limit %u)", f->path,
                          (unsigned long long)hlen, ST_MAX_HEADER);
    if (hlen > f->size - 8)
        return specd_errf(err, errlen, SPECD_EFORMAT,
                          "%s: truncated: JSON header of %llu bytes, file has %zu", f->path,
                          (unsigned long long)hlen, f->size);
    json_error_t je;
    root = json_loadb((const char *)f->map + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: bad JSON header: %s at byte %d",
                          f->path, je.text, je.position);
    if (!json_is_object(root)) {
        rc = specd_errf(err, errlen, SPECD_EFORMAT, "%s: JSON header is not an object", f->path);
        goto out;
    }
    size_t data_size = f->size - 8 - (size_t)hlen;
    size_t n = 0, names_len = 0;
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (!strcmp(key, "__metadata__")) continue;
        n++;
        names_len += strlen(key) + 1;
    }
    f->tensors = calloc(n ? n : 1, sizeof *f->tensors);
    f->names = malloc(names_len ? names_len : 1);
    if (!f->tensors || !f->names) {
        rc = specd_errf(err, errlen, SPECD_ENOMEM, "%s: out of memory", f->path);
        goto out;
    }
    char *np = f->names;
    f->n = 0;
    json_object_foreach(root, key, val) {
        if (!strcmp(key, "__metadata__")) continue;
        st_tensor *t = &f->tensors[f->n];
        size_t kl = strlen(key) + 1;
        memcpy(np, key, kl);
        t->name = np;
        np += kl;
        if ((rc = parse_entry(f, key, val, t, data_size, err, errlen))) goto out;
        f->n++;
    }
    qsort(f->tensors, (size_t)f->n, sizeof *f->tensors, cmp_tensor);
    rc = 0;
out:
    json_decref(root);
    return rc;
}

st_file *st_open(const char *path, char *err, size_t errlen) {
    st_file *f = calloc(1, sizeof *f);
    int fd = -1;
    struct stat st;
    if (!f) {
        specd_errf(err, errlen, SPECD_ENOMEM, "%s: out of memory", path);
        return NULL;
    }
    snprintf(f->path, sizeof f->path, "%s", path);
    fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0 || fstat(fd, &st) < 0) {
        specd_errf(err, errlen, SPECD_EIO, "%s: %s", path, strerror(errno));
        goto fail;
    }
    if (!S_ISREG(st.st_mode)) {
        specd_errf(err, errlen, SPECD_EIO, "%s: not a regular file", path);
        goto fail;
    }
    f->size = (size_t)st.st_size;
    if (f->size < 8) {
        specd_errf(err, errlen, SPECD_EFORMAT,
                   "%s: truncated: %zu bytes, the header length alone needs 8", path, f->size);
        goto fail;
    }
    f->map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        specd_errf(err, errlen, SPECD_EIO, "%s: mmap: %s", path, strerror(errno));
        goto fail;
    }
    close(fd);
    fd = -1;
    if (parse_header(f, err, errlen)) goto fail;
    return f;
fail:
    if (fd >= 0) close(fd);
    st_close(f);
    return NULL;
}

void st_close(st_file *f) {
    if (!f) return;
    if (f->map) munmap(f->map, f->size);
    free(f->tensors);
    free(f->names);
    free(f);
}

const char *st_path(const st_file *f) { return f->path; }
int64_t st_n_tensors(const st_file *f) { return f->n; }

const st_tensor *st_tensor_at(const st_file *f, int64_t i) {
    return (i < 0 || i >= f->n) ? NULL : &f->tensors[i];
}

const st_tensor *st_find(const st_file *f, const char *name) {
    st_tensor key = { .name = name };
    return bsearch(&key, f->tensors, (size_t)f->n, sizeof *f->tensors, cmp_tensor);
}
