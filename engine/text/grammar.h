/* Constrained decoding (prefixes grammar_, vocab_trie_, matcher_): a grammar compiled from
 * JSON, a JSON Schema, a regex, a list of choices or a GBNF text, and a matcher that says
 * which tokens of the vocabulary keep the output inside the grammar.
 *
 * Model. Everything compiles to one form: rules, each a DFA over bytes whose edges are
 * bytes (through byte classes) or calls of other rules (only where a rule is recursive:
 * JSON nesting, recursive $ref, GBNF rules; everything else is inlined). The matcher is a
 * byte-level pushdown automaton: its state is a small set of stacks, each a DFA state on
 * top of return states. A token mask is one walk over a byte trie of the vocabulary
 * (vocab_trie), depth first, so a prefix shared by many tokens is matched once.
 *
 * What each kind accepts (the exact keyword policy of JSON Schema is in
 * grammar_schema.c's header and in README's "Structured outputs"):
 *   GRAMMAR_JSON         any JSON object (response_format json_object); spec unused.
 *   GRAMMAR_JSON_SCHEMA  spec: a JSON Schema (text). Properties come in schema order;
 *                        keywords that would change validity and are not implemented
 *                        are a compile error naming the keyword and where it is.
 *   GRAMMAR_REGEX        spec: a regex, matched in full (^ and $ optional): literals,
 *                        [classes], \d \w \s (and negations), ., groups, |, ? * + {m,n}.
 *   GRAMMAR_CHOICE       spec: a JSON array of strings; the output is one of them.
 *   GRAMMAR_GBNF         spec: llama.cpp GBNF (root ::= ...).
 * Whitespace inside JSON is bounded (none, one space, or one newline and at most 20
 * spaces/tabs between two tokens of JSON) and numbers have at most 16 integer and 16
 * fraction digits, so a small model cannot run on without end inside a document.
 *
 * Ownership and threads: a grammar is immutable after compile and reference counted
 * (grammar_ref / grammar_unref, atomic), so one compile can serve many requests on any
 * thread. A vocab_trie is immutable after build and shared read-only. A matcher belongs
 * to one request and is used by one thread at a time; it keeps its buffers, so masks and
 * accepts do not allocate (except rare growth of its frame arena). */
#ifndef SPECD_GRAMMAR_H
#define SPECD_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

#include "engine/text/tokenizer.h"

typedef enum {
    GRAMMAR_NONE = 0,
    GRAMMAR_JSON,          /* any JSON object */
    GRAMMAR_JSON_SCHEMA,   /* spec: JSON Schema text */
    GRAMMAR_REGEX,         /* spec: regex */
    GRAMMAR_CHOICE,        /* spec: JSON array of strings */
    GRAMMAR_GBNF,          /* spec: GBNF grammar text */
} grammar_kind;

typedef struct grammar grammar;
typedef struct vocab_trie vocab_trie;
typedef struct matcher matcher;

/* Compile spec (len bytes, need not be NUL-terminated) of the given kind. Returns a
 * grammar with one reference, or NULL with a one-line message in err (what is wrong and
 * where, e.g. "schema /properties/age: 'multipleOf' is not supported"). Thread safe; the
 * last 32 grammars compiled are kept by (kind, spec) and shared, so a schema sent with
 * every request compiles once. */
grammar *grammar_compile(grammar_kind kind, const char *spec, size_t len, char *err, size_t errlen);
grammar *grammar_ref(grammar *g);     /* returns g */
void grammar_unref(grammar *g);       /* frees at the last reference; NULL is fine */
/* Size of the compiled form (DFA states, rules), for logs and benchmarks. */
int grammar_n_states(const grammar *g);
int grammar_n_rules(const grammar *g);
/* Name of a kind ("json_schema", ...) for messages. */
const char *grammar_kind_name(grammar_kind k);

/* The vocabulary as byte strings in a trie. n_vocab is the model's vocabulary size (the
 * mask has n_vocab bits; ids the tokenizer lacks are never allowed). Special tokens are
 * never allowed, except the eos ids (n_eos of them), allowed exactly when the grammar is
 * complete. NULL + message on failure. */
vocab_trie *vocab_trie_build(const tok_tokenizer *t, int n_vocab, const int32_t *eos, int n_eos,
                             char *err, size_t errlen);
void vocab_trie_free(vocab_trie *v);
int vocab_trie_n_vocab(const vocab_trie *v);
int vocab_trie_n_nodes(const vocab_trie *v);
/* Bytes of the longest token (the trie's depth). */
int vocab_trie_max_bytes(const vocab_trie *v);
/* Mask words: (n_vocab + 31) / 32; bit i of word i/32 is token i. */
static inline size_t vocab_mask_words(int n_vocab) { return ((size_t)n_vocab + 31) / 32; }

/* Make now what the grammar's first matcher over a vocabulary whose tokens have at most
 * max_token_bytes bytes would make (the states' mask classes, shared by its matchers:
 * milliseconds for a large schema), so that a request thread pays it, not the engine's.
 * 0, or SPECD_ENOMEM (then the first matcher tries again). */
int grammar_prepare_masks(grammar *g, int max_token_bytes);

/* A matcher at the start of the grammar; takes a reference on g. NULL if out of memory. */
matcher *matcher_new(grammar *g, const vocab_trie *v);
void matcher_free(matcher *m);

/* Fill mask (vocab_mask_words bits) with the tokens that may come next: a token is set
 * when all its bytes keep the matcher valid; the eos ids are set when the grammar is
 * complete here. Returns how many tokens other than eos are set. */
int matcher_fill_mask(matcher *m, uint32_t *mask);
/* Benchmarks and tests: with enabled 0, every mask is a full trie scan (the cost of a
 * state's first visit) instead of a copy of a recent mask of the same state. */
void matcher_set_cache(matcher *m, int enabled);
/* The same, keeping only tokens after which the grammar can still end within max_dist
 * bytes (the shortest way to the end, matcher_distance). With max_dist = tokens left - 1,
 * a request near max_tokens is steered to close its document (single-byte tokens exist
 * for the closing bytes in byte-level vocabularies), so the output stays valid. Not
 * cached: use it only near the end. */
int matcher_fill_mask_within(matcher *m, uint32_t *mask, int max_dist);
/* Bytes on the shortest way from here to the end of the grammar (0 when complete). */
int matcher_distance(const matcher *m);
/* The same after bytes s (the state is not changed); -1 if s is not accepted. */
int matcher_distance_after(matcher *m, const char *s, size_t n);
/* Advance by one token. An eos id is accepted when the grammar is complete (the matcher
 * is then finished). Returns 0, or SPECD_EINVAL (and the state is unchanged) when the
 * token is not allowed. */
int matcher_accept_token(matcher *m, int32_t id);
/* Advance by raw bytes, all or nothing (SPECD_EINVAL leaves the state unchanged). */
int matcher_accept_bytes(matcher *m, const char *s, size_t n);
/* Whether bytes s would be accepted from here (the state is not changed). */
int matcher_check_bytes(matcher *m, const char *s, size_t n);
/* A matcher's committed state, to come back to after trying tokens ahead of the output
 * (speculative drafts): matcher_save copies it, matcher_restore puts it back (on the same
 * matcher). NULL / SPECD_ENOMEM when out of memory. */
typedef struct matcher_saved matcher_saved;
matcher_saved *matcher_saved_new(void);
void matcher_saved_free(matcher_saved *s);
void matcher_save(const matcher *m, matcher_saved *s);
void matcher_restore(matcher *m, const matcher_saved *s);
/* The output so far is a complete sentence of the grammar (eos is allowed). */
int matcher_accepting(const matcher *m);
/* Complete and nothing may follow (or eos was accepted): the request can stop now. */
int matcher_done(const matcher *m);

#endif
