/* Test helpers: where the shared fixtures live and small JSON readers for golden files.
 * Header-only (static functions) so each test binary stays one translation unit. */
#ifndef SPECD_TEST_FIXTURES_H
#define SPECD_TEST_FIXTURES_H

#include <jansson.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static inline const char *fixtures_dir(void) {
    const char *d = getenv("SPECD_FIXTURES");
    return d && *d ? d : "../shared/fixtures";
}

/* "<fixtures>/<rel>" in a static buffer (one at a time). */
static inline const char *fixture_path(const char *rel) {
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/%s", fixtures_dir(), rel);
    return buf;
}

static inline json_t *fixture_json(const char *rel) {
    json_error_t je;
    json_t *j = json_load_file(fixture_path(rel), 0, &je);
    if (!j) fprintf(stderr, "cannot read %s: %s (line %d)\n", fixture_path(rel), je.text, je.line);
    return j;
}

/* A whole file, NUL-terminated (malloc'd; NULL if unreadable); *len its size if len. */
static inline char *read_all(const char *path, size_t *len) {
    if (len) *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (p && fread(p, 1, (size_t)n, f) != (size_t)n) {
        free(p);
        p = NULL;
    }
    fclose(f);
    if (p) p[n] = 0;
    if (len) *len = (size_t)n;
    return p;
}

/* JSON array of ints -> malloc'd int32 array. */
static inline int32_t *json_ids(const json_t *a, int *n) {
    *n = (int)json_array_size(a);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(*n > 0 ? *n : 1));
    for (int i = 0; i < *n; i++) ids[i] = (int32_t)json_integer_value(json_array_get(a, (size_t)i));
    return ids;
}

/* max |a - ref| / max |ref| over n floats. */
static inline double rel_err(const float *a, const float *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - ref[i], r = ref[i];
        if (d < 0) d = -d;
        if (r < 0) r = -r;
        if (d > num) num = d;
        if (r > den) den = r;
    }
    return den > 0 ? num / den : num;
}

/* max |a - ref| / max |ref| over n floats, ref a JSON array. */
static inline double rel_err_json(const float *a, const json_t *ref, int n) {
    double num = 0, den = 0;
    for (int i = 0; i < n; i++) {
        double r = json_number_value(json_array_get(ref, (size_t)i));
        double d = a[i] - r;
        if (d < 0) d = -d;
        if (r < 0) r = -r;
        if (d > num) num = d;
        if (r > den) den = r;
    }
    return den > 0 ? num / den : num;
}

#endif
