/* jansson helpers for config files (see json_util.h). */
#include "engine/model/json_util.h"
#include "engine/core/err.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

int ju_load_file(const char *path, json_t **out, char *err, size_t errlen) {
    json_error_t je;
    FILE *fp = fopen(path, "rb");
    *out = NULL;
    if (!fp) return specd_errf(err, errlen, SPECD_EIO, "%s: %s", path, strerror(errno));
    json_t *j = json_loadf(fp, JSON_REJECT_DUPLICATES, &je);
    fclose(fp);
    if (!j)
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: bad JSON: %s (line %d, column %d)",
                          path, je.text, je.line, je.column);
    *out = j;
    return 0;
}

static json_t *lookup(const json_t *obj, const char *key) {
    json_t *v = json_is_object(obj) ? json_object_get(obj, key) : NULL;
    return (v && !json_is_null(v)) ? v : NULL;
}

int ju_int(const json_t *obj, const char *key, int64_t *out, const char *file, char *err,
           size_t errlen) {
    json_t *v = lookup(obj, key);
    if (!v) return JU_ABSENT;
    if (!json_is_integer(v))
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: \"%s\" must be an integer", file, key);
    *out = (int64_t)json_integer_value(v);
    return 0;
}

int ju_num(const json_t *obj, const char *key, double *out, const char *file, char *err,
           size_t errlen) {
    json_t *v = lookup(obj, key);
    if (!v) return JU_ABSENT;
    if (!json_is_number(v))
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: \"%s\" must be a number", file, key);
    *out = json_number_value(v);
    return 0;
}

int ju_bool(const json_t *obj, const char *key, int *out, const char *file, char *err,
            size_t errlen) {
    json_t *v = lookup(obj, key);
    if (!v) return JU_ABSENT;
    if (!json_is_boolean(v))
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: \"%s\" must be true or false", file,
                          key);
    *out = json_is_true(v);
    return 0;
}

int ju_str(const json_t *obj, const char *key, const char **out, const char *file, char *err,
           size_t errlen) {
    json_t *v = lookup(obj, key);
    if (!v) return JU_ABSENT;
    if (!json_is_string(v))
        return specd_errf(err, errlen, SPECD_EFORMAT, "%s: \"%s\" must be a string", file, key);
    *out = json_string_value(v);
    return 0;
}
