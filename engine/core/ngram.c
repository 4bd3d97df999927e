/* Prompt-lookup n-gram index; see ngram.h for the structure and its costs. */
#include "engine/core/ngram.h"

#include <stdlib.h>
#include <string.h>

typedef struct {
    uint32_t key;                /* 0: empty (a key is only a filter: lookups compare tokens) */
    int32_t pos;                 /* continuation start: the n-gram ends at pos - 1 */
} ngram_entry;

struct ngram_index {
    int min_n, max_n, capacity;
    int next_end;                /* n-grams ending before this position are entered */
    uint64_t mask;               /* table size - 1 (a power of two) */
    uint64_t probes;
    ngram_entry *tab;
};

/* Key of the n tokens t[0..n): FNV-style mixing with the length folded in, finished by a
 * splitmix avalanche; never 0 (the empty mark). */
static uint32_t ngram_key(const int32_t *t, int n) {
    uint64_t h = 0xcbf29ce484222325ULL ^ (uint64_t)n;
    for (int i = 0; i < n; i++) h = (h ^ (uint32_t)t[i]) * 0x100000001b3ULL;
    h ^= h >> 30;
    h *= 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebULL;
    h ^= h >> 31;
    return (uint32_t)(h >> 32) | 1;
}

ngram_index *ngram_create(int min_n, int max_n, int capacity) {
    if (min_n < 1 || max_n < min_n || max_n > NGRAM_MAX_N || capacity < 1) return NULL;
    ngram_index *ix = calloc(1, sizeof *ix);
    if (!ix) return NULL;
    ix->min_n = min_n;
    ix->max_n = max_n;
    ix->capacity = capacity;
    /* at most capacity n-grams of each length: twice that many slots, rounded up */
    uint64_t need = 2 * (uint64_t)capacity * (uint64_t)(max_n - min_n + 1), size = 16;
    while (size < need) size <<= 1;
    ix->mask = size - 1;
    if (!(ix->tab = calloc(size, sizeof *ix->tab))) {
        free(ix);
        return NULL;
    }
    return ix;
}

void ngram_destroy(ngram_index *ix) {
    if (!ix) return;
    free(ix->tab);
    free(ix);
}

static void ngram_insert(ngram_index *ix, uint32_t key, int32_t pos) {
    for (uint64_t i = (key >> 1) & ix->mask;; i = (i + 1) & ix->mask) {
        ix->probes++;
        ngram_entry *en = &ix->tab[i];
        if (en->key == 0 || en->key == key) {   /* a later occurrence replaces the earlier */
            en->key = key;
            en->pos = pos;
            return;
        }
    }
}

void ngram_update(ngram_index *ix, const int32_t *tokens, int n) {
    if (n > ix->capacity) n = ix->capacity;
    /* the n-gram ending at e is entered once its continuation e + 1 exists */
    for (int e = ix->next_end; e + 1 < n; e++)
        for (int len = ix->min_n; len <= ix->max_n && len <= e + 1; len++)
            ngram_insert(ix, ngram_key(tokens + e + 1 - len, len), e + 1);
    if (n - 1 > ix->next_end) ix->next_end = n - 1;
}

static int32_t ngram_find(const ngram_index *ix, uint32_t key) {
    for (uint64_t i = (key >> 1) & ix->mask;; i = (i + 1) & ix->mask) {
        const ngram_entry *en = &ix->tab[i];
        if (en->key == 0) return -1;
        if (en->key == key) return en->pos;
    }
}

int ngram_draft(const ngram_index *ix, const int32_t *tokens, int n, int k, int32_t *out, int *match_n) {
    if (match_n) *match_n = 0;
    if (k < 1) return 0;
    for (int len = ix->max_n < n ? ix->max_n : n; len >= ix->min_n; len--) {
        const int32_t *suffix = tokens + n - len;
        int32_t p = ngram_find(ix, ngram_key(suffix, len));
        if (p < len || p >= n || memcmp(tokens + p - len, suffix, (size_t)len * sizeof *suffix)) continue;
        /* The continuation may run into the suffix itself (a repeating stretch with period
         * n - p): past the end of the history it repeats what was just proposed. */
        int period = n - p;
        for (int j = 0; j < k; j++) out[j] = p + j < n ? tokens[p + j] : out[j - period];
        if (match_n) *match_n = len;
        return k;
    }
    return 0;
}

uint64_t ngram_probes(const ngram_index *ix) { return ix->probes; }
