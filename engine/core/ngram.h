/* Prompt-lookup drafting (prefix ngram_): an index over one request's tokens (prompt +
 * output) that proposes the tokens which followed the most recent earlier occurrence of
 * the request's current suffix. The output of summarising, extracting, quoting and
 * editing copies its input, so such a proposal is often what the target would say; it
 * costs no model pass.
 *
 * Structure: one open-addressing hash table keyed by (n, the n tokens ending at position
 * e) for every n in [min_n, max_n], holding e + 1 (where the continuation starts); a later
 * occurrence overwrites an earlier one, so a lookup finds the most recent. An n-gram ending
 * at e is entered once token e + 1 exists (its continuation is known), so the suffix that
 * ends the history never finds itself. Appending a token costs max_n - min_n + 1 inserts of
 * at most max_n tokens hashed each: O(1) per token, whatever the history's length.
 * Entries are never removed, so the table (>= 2 x the n-grams it can ever hold) needs no
 * tombstones and stays at most half full.
 *
 * Lookup: for n from max_n down to min_n, the suffix's n-gram is looked up and confirmed
 * by comparing tokens (a hash match alone is not trusted); the first confirmed n wins (the
 * longest match), and up to k tokens from its continuation are proposed (fewer where the
 * history ends). No confirmed match: no draft.
 *
 * Ownership: the caller keeps the token array; the index keeps positions into it, so the
 * array passed to every call must be the same sequence, only ever appended to. */
#ifndef SPECD_NGRAM_H
#define SPECD_NGRAM_H

#include <stdint.h>

#define NGRAM_MAX_N 16

typedef struct ngram_index ngram_index;

/* An index for a sequence of at most capacity tokens, n-grams of min_n..max_n tokens
 * (1 <= min_n <= max_n <= NGRAM_MAX_N). NULL on bad arguments or out of memory. */
ngram_index *ngram_create(int min_n, int max_n, int capacity);
void ngram_destroy(ngram_index *ix);

/* Enter every n-gram whose continuation lies in tokens[0..n) and that is not in yet
 * (n only grows between calls; n <= capacity). */
void ngram_update(ngram_index *ix, const int32_t *tokens, int n);

/* Propose up to k tokens continuing tokens[0..n) (ngram_update(ix, tokens, n) first).
 * Writes them to out and returns how many (0: no match). *match_n, when given, receives
 * the length of the n-gram matched (0 without a match). */
int ngram_draft(const ngram_index *ix, const int32_t *tokens, int n, int k, int32_t *out, int *match_n);

/* Hash-table slots probed so far by updates (tests: the cost of an update is bounded). */
uint64_t ngram_probes(const ngram_index *ix);

#endif
