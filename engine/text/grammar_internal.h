/* Internals shared by the grammar's files (grammar.c: builder, NFA -> DFA, compile;
 * grammar_regex.c; grammar_schema.c; grammar_gbnf.c; grammar_match.c: vocab trie and
 * matcher). Not a public interface: only grammar.h is.
 *
 * Front ends build an NFA over bytes out of fragments (gfrag: an entry and an exit state).
 * A fragment is built into a contiguous range of states and edges (s0.., e0..), which is
 * what gb_copy duplicates for counted repetition: so build a fragment, then combine it,
 * and never build an unrelated fragment in between before copying the first. Edges are
 * epsilon, a byte set, or a call of a rule (used for recursion only). */
#ifndef SPECD_GRAMMAR_INTERNAL_H
#define SPECD_GRAMMAR_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/text/grammar.h"

/* ---- NFA builder ---- */

typedef struct { uint32_t w[8]; } gbyteset;

static inline void gbs_add(gbyteset *s, int b) { s->w[b >> 5] |= 1u << (b & 31); }
static inline int gbs_has(const gbyteset *s, int b) { return (s->w[b >> 5] >> (b & 31)) & 1; }
static inline void gbs_range(gbyteset *s, int lo, int hi) {
    for (int b = lo; b <= hi; b++) gbs_add(s, b);
}

enum { GE_EPS = -1, GE_BYTES = -2 };   /* gedge.rule: these, or a rule id (a call) */

typedef struct {
    int32_t from, to, rule;
    gbyteset set;                      /* GE_BYTES */
} gedge;

typedef struct {
    int32_t in, out;                   /* entry and exit states */
    int32_t s0, e0;                    /* first state and edge of the fragment's range */
} gfrag;

typedef struct {
    int32_t n_states;
    gedge *edges;
    int32_t n_edges, cap_edges;
    struct { int32_t start, accept; } *rules;
    int32_t n_rules, cap_rules;
    char *err;
    size_t errlen;
    int failed;                        /* an error was recorded (the first one is kept) */
} gbuild;

/* Record an error (the first wins); returns -1. */
int gb_fail(gbuild *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

int32_t gb_state(gbuild *b);
void gb_eps(gbuild *b, int32_t from, int32_t to);
gfrag gb_empty(gbuild *b);
gfrag gb_set(gbuild *b, const gbyteset *s);
gfrag gb_byte(gbuild *b, int c);
gfrag gb_lit(gbuild *b, const char *s, size_t n);
gfrag gb_call(gbuild *b, int32_t rule);
gfrag gb_seq(gbuild *b, gfrag a, gfrag c);
gfrag gb_alt(gbuild *b, gfrag a, gfrag c);
gfrag gb_opt(gbuild *b, gfrag a);
gfrag gb_star(gbuild *b, gfrag a);
gfrag gb_plus(gbuild *b, gfrag a);
/* a{min,max}; max < 0: unbounded. Consumes a (its states become the first copy). */
gfrag gb_repeat(gbuild *b, gfrag a, int min, int max);
/* Any UTF-8 encoded code point in the sorted, disjoint ranges lo[i]..hi[i] (surrogates
 * are skipped). */
gfrag gb_codepoints(gbuild *b, const uint32_t *lo, const uint32_t *hi, int n);

/* A new rule (its body is set later with gb_rule_set); returns its id. */
int32_t gb_rule(gbuild *b);
void gb_rule_set(gbuild *b, int32_t rule, gfrag body);

/* NFA size limits: a front end stops early when it exceeds them (message recorded). */
#define GB_MAX_STATES 400000
#define GB_MAX_DFA_STATES 200000
#define GRAMMAR_DIST_INF (1 << 28)
static inline int32_t gdist_add(int32_t a, int32_t b) {
    return a >= GRAMMAR_DIST_INF || b >= GRAMMAR_DIST_INF || a + b >= GRAMMAR_DIST_INF ? GRAMMAR_DIST_INF : a + b;
}

/* ---- front ends: fill rule 0 (the root) and maybe more; 0 or -1 (error recorded) ---- */

/* The regex in full, into a fragment. json_string: the regex describes a JSON string's
 * content (a "pattern"): bytes that JSON must escape are left out of every class. */
int grammar_regex_frag(gbuild *b, const char *re, size_t len, int json_string, gfrag *out);
int grammar_build_regex(gbuild *b, const char *spec, size_t len);
/* A [class] body (s starts after '['; *used: bytes read, the closing ']' included). */
int grammar_class_frag(gbuild *b, const char *s, size_t len, size_t *used, gfrag *out);
/* One JSON string character as JSON writes it (escapes included), and whitespace between
 * JSON tokens (bounded: see grammar.h). */
gfrag grammar_json_char(gbuild *b);
gfrag grammar_json_ws(gbuild *b);
int grammar_build_schema(gbuild *b, const char *spec, size_t len);
int grammar_build_json(gbuild *b);
int grammar_build_gbnf(gbuild *b, const char *spec, size_t len);

/* ---- the compiled grammar ---- */

enum {
    GS_FINAL = 1,      /* the rule may end here */
    GS_FINALX = 2,     /* may end here, counting calls of rules that may match nothing */
    GS_HASOUT = 4,     /* some byte or call leaves this state */
    GS_SIMPLE = 8,     /* no calls and not final: a byte step is one table lookup */
    GS_PLAINLOOP = 16, /* every plain byte (grammar_plain_byte) leads back to this state */
    GS_TEXTLOOP = 32,  /* every text character (grammar_text_step) leads back here */
};

/* Printable ASCII but the quote and backslash: what most tokens of text are made of, and
 * what a JSON string takes as itself. A trie subtree of plain bytes only is accepted whole
 * from a GS_PLAINLOOP state (see grammar_match.c). */
static inline int grammar_plain_byte(int c) { return c >= 0x20 && c < 0x7F && c != '"' && c != '\\'; }

/* Text as a JSON string holds it unescaped: plain bytes and well-formed UTF-8 characters
 * (no overlong forms, no surrogates, at most U+10FFFF). A recognizer over bytes: state 0
 * is a character boundary, others are inside a character; returns the next state or -1. */
static inline int grammar_text_step(int u, int b) {
    switch (u) {
    case 0:
        if (grammar_plain_byte(b)) return 0;
        if (b >= 0xC2 && b <= 0xDF) return 1;
        if (b == 0xE0) return 4;
        if (b == 0xED) return 5;
        if (b >= 0xE1 && b <= 0xEF) return 2;
        if (b == 0xF0) return 6;
        if (b >= 0xF1 && b <= 0xF3) return 3;
        if (b == 0xF4) return 7;
        return -1;
    case 1: case 2: case 3: return b >= 0x80 && b <= 0xBF ? u - 1 : -1;
    case 4: return b >= 0xA0 && b <= 0xBF ? 1 : -1;
    case 5: return b >= 0x80 && b <= 0x9F ? 1 : -1;
    case 6: return b >= 0x90 && b <= 0xBF ? 2 : -1;
    case 7: return b >= 0x80 && b <= 0x8F ? 2 : -1;
    }
    return -1;
}

/* States that read every byte string of up to L bytes alike (Moore's refinement stopped
 * after L rounds; a state with calls is a class of its own): a matcher whose states map
 * to the same classes has the same mask when no token is longer than L bytes. */
typedef struct {
    int L;
    int32_t cls[];             /* (n_states) */
} grammar_mask_classes;

/* The classes for tokens of up to L bytes (malloc'd; NULL: out of memory). */
grammar_mask_classes *grammar_mask_classes_make(const grammar *g, int L);

/* Masks every matcher of a grammar may reuse (grammar_match.c): keyed by mask-class state
 * keys, for one vocabulary trie at a time; requests under one schema meet the same states
 * (a title's first characters, a field's opening quote), so one computes and the rest copy.
 * An entry being computed is pending: a matcher that wants the same mask meanwhile (another
 * row of the same step, on another mask thread) waits for it instead of walking too. */
#define GRAMMAR_SHARED_MASKS 64
typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t done;       /* a pending entry was filled, or the cache was taken over */
    uint64_t trie_id;          /* the vocabulary trie the masks are over (0: none yet) */
    uint64_t gen;              /* bumped when another trie takes the cache over */
    int n;
    uint64_t tick;
    struct {
        int32_t *key;          /* (klen) */
        int klen, count, pending;
        uint64_t used;
        uint32_t *mask;
    } e[GRAMMAR_SHARED_MASKS];
} grammar_mask_cache;

/* Frees a cache's entries (the caller holds its lock, or is its grammar's last user). */
void grammar_mask_cache_clear(grammar_mask_cache *c);

struct grammar {
    atomic_int refs;
    _Atomic(grammar_mask_classes *) mclasses;   /* made by the first matcher (grammar_match.c) */
    grammar_mask_cache shared;                  /* used with mclasses only */
    grammar_kind kind;
    int n_cls;
    uint8_t cls[256];          /* byte -> byte class */
    int32_t n_states;
    int32_t *trans;            /* (n_states, n_cls): next state or -1 */
    int32_t *call_off;         /* (n_states + 1) into call_rule / call_to */
    int32_t *call_rule, *call_to;
    uint8_t *flags;            /* GS_* per state */
    int32_t *dist;             /* bytes on the shortest way from a state to its rule's end
                                * (GRAMMAR_DIST_INF: none) */
    int32_t n_rules;
    int32_t *rule_start;       /* DFA start state of each rule */
    int32_t root;              /* rule_start[0] */
};

#endif
