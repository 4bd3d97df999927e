/* Internals shared by the tokenizer's files (tokenizer.c, tok_bpe.c, tok_text.c,
 * tok_json.c, tok_gguf.c). Not a public interface: only tokenizer.h is.
 *
 * The tokenizer is one pipeline whatever file it came from, the shape HF tokenizers
 * uses: added tokens are split out of the raw text first, every other segment goes
 * through normalizer steps, pre-tokenizer steps, then the BPE model; decode maps each
 * id to a byte piece and joins them with the decoder's rules. The loaders (tokenizer.json
 * or GGUF) only fill this struct. */
#ifndef SPECD_TOK_INTERNAL_H
#define SPECD_TOK_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/text/tokenizer.h"

/* ---- growable byte buffer ---- */
typedef struct {
    char *p;
    size_t len, cap;
} tok_buf;
int tok_buf_reserve(tok_buf *b, size_t extra);
int tok_buf_put(tok_buf *b, const void *s, size_t n);
void tok_buf_free(tok_buf *b);

/* ---- string -> id map (open addressing; keys live in the caller's string table) ---- */
typedef struct {
    uint32_t *slots;   /* id + 1, 0 = empty */
    uint32_t mask;
    const char *const *strs;   /* strs[id], lens[id]: the keys */
    const uint32_t *lens;
} tok_strmap;
int tok_strmap_init(tok_strmap *m, size_t n_keys, const char *const *strs,
                    const uint32_t *lens);
/* Adds id (its key is strs[id]); keeps the first id when a key repeats. */
void tok_strmap_add(tok_strmap *m, uint32_t id);
int tok_strmap_get(const tok_strmap *m, const char *s, size_t len); /* -1 if absent */
void tok_strmap_free(tok_strmap *m);

/* ---- (left id, right id) -> (rank, merged id) ---- */
typedef struct {
    uint64_t key;      /* (left << 32 | right) + 1; 0 = empty */
    int32_t rank, id;
} tok_merge_slot;
typedef struct {
    tok_merge_slot *slots;
    uint64_t mask;
    size_t n;
} tok_mergemap;
int tok_mergemap_init(tok_mergemap *m, size_t n);
/* Keeps the first (lowest-rank) entry for a pair given twice. */
void tok_mergemap_add(tok_mergemap *m, int32_t a, int32_t b, int32_t rank, int32_t id);
void tok_mergemap_free(tok_mergemap *m);

/* ---- normalizers and pre-tokenizers ---- */
enum { TOK_NORM_NFC, TOK_NORM_NFD, TOK_NORM_NFKC, TOK_NORM_NFKD, TOK_NORM_PREPEND,
       TOK_NORM_REPLACE, TOK_NORM_LOWERCASE };
typedef struct {
    int kind;
    char *a, *b;          /* PREPEND: a = text; REPLACE: a = pattern, b = content */
    size_t alen, blen;
} tok_norm;

enum { TOK_SPLIT_ISOLATED, TOK_SPLIT_REMOVED, TOK_SPLIT_MERGED_PREV, TOK_SPLIT_MERGED_NEXT,
       TOK_SPLIT_CONTIGUOUS };
enum { TOK_PRE_SPLIT, TOK_PRE_BYTELEVEL, TOK_PRE_METASPACE };
enum { TOK_PREPEND_ALWAYS, TOK_PREPEND_FIRST, TOK_PREPEND_NEVER };
typedef struct {
    int kind;
    pcre2_code *re;       /* SPLIT (also ByteLevel with use_regex) */
    int behavior, invert;
    int add_prefix_space; /* BYTELEVEL */
    char repl[8];         /* METASPACE replacement (UTF-8) */
    size_t repl_len;
    int prepend_scheme, split;
} tok_pre;

/* ---- the tokenizer ---- */
typedef struct {
    int32_t id;
    uint32_t len;
    char *s;              /* content, raw text (owned) */
    int lstrip, rstrip, single_word, special;
} tok_added;

/* How decode joins pieces (see tokenizer.c: decode). */
enum { TOK_STRIP_NONE, TOK_STRIP_FUSED, TOK_STRIP_FIRST_TOKEN };

struct tok_tokenizer {
    /* vocabulary: model tokens and added tokens, by id (holes have len 0, str "") */
    int n_vocab;
    const char **tok_str;   /* token as the model spells it (byte-level: mapped chars) */
    uint32_t *tok_len;
    uint32_t *tok_off;      /* into str_blob while loading; tok_finish sets tok_str */
    tok_buf str_blob;
    uint8_t *is_special;
    tok_strmap vocab;       /* model vocabulary only (not added tokens) */

    /* model */
    int bytelevel;          /* initial symbols are bytes mapped GPT-2 style */
    int byte_fallback, ignore_merges, fuse_unk;
    int spm_split;          /* no token has U+2581 after another char: BPE may run on each
                               U+2581-started word alone, as no merge can cross */
    int unk_id;
    int32_t byte_sym[256];  /* bytelevel: id of each byte's mapped char; else <0xNN> id */
    tok_mergemap merges;
    /* Pre-tokens (as the model sees them: raw bytes for byte-level) whose BPE is known, at
     * load, to be exactly one vocab token: encode looks them up instead of merging. Exact
     * by construction, since BPE of a string depends on nothing but the string. */
    tok_strmap direct;
    const char **direct_key;

    tok_norm *norms;
    int n_norms;
    tok_pre *pres;
    int n_pres;
    /* the pre-tokenizer is one Isolated regex split (no-op ByteLevel steps aside, but none
     * before it: the split would see mapped chars): encode runs it inline, piece by piece,
     * instead of materializing every piece */
    const pcre2_code *fast_re;
    int fast_none;          /* no pre-tokenizer step at all: the segment is one piece */

    tok_added *added;       /* sorted by content length, longest first */
    int n_added;
    int16_t added_first[256];  /* index of the first added token starting with a byte, -1 */

    /* specials added by encode(add_special=1) */
    int32_t prefix_ids[4], suffix_ids[4];
    int n_prefix, n_suffix;
    int bos_id, eos_id, pad_id;
    char *bos_str, *eos_str, *chat_template;

    /* decoder: per-id piece bytes (already mapped back from byte-level / ▁) */
    char *piece_blob;
    uint32_t *piece_off, *piece_len;
    int16_t *piece_byte;     /* byte_fallback: 0..255 for <0xNN> tokens, else -1 */
    int dec_bytelevel, dec_byte_fallback;
    char dec_from[8], dec_to[8];   /* Replace / Metaspace: dec_from -> dec_to per token */
    size_t dec_from_len, dec_to_len;
    int dec_strip, dec_strip_n;  /* TOK_STRIP_*, how many leading spaces */
};

/* tok_text.c: UTF-8, byte-level map, normalizers, pre-tokenizers. */
uint32_t tok_byte_cp(int b);                           /* GPT-2 byte -> char */
int tok_cp_to_byte(uint32_t cp);                       /* -1 if not a mapped char */
size_t tok_utf8_encode(uint32_t cp, char *out);
/* Length of a valid UTF-8 sequence at s (n bytes left), 0 if invalid or truncated. */
size_t tok_utf8_valid_len(const unsigned char *s, size_t n);
/* Offset of the first invalid byte, or n if all valid. */
size_t tok_utf8_check(const char *s, size_t n);
/* 1 when s is valid UTF-8 except, maybe, for a sequence the end cuts short. */
int tok_utf8_prefix_ok(const char *s, size_t n);
/* Append s as UTF-8 with invalid sequences replaced by U+FFFD (one per maximal invalid
 * subpart, as Rust's String::from_utf8_lossy). If hold is set, a truncated but valid so
 * far sequence at the end is not converted; returns how many bytes were consumed. */
size_t tok_utf8_lossy(const char *s, size_t n, int hold, tok_buf *out);
int tok_normalize(const tok_tokenizer *t, const char *s, size_t n, tok_buf *out);
pcre2_code *tok_regex_compile(const char *pat, size_t len, int literal, char *err,
                              size_t errlen);

/* pcre2_match on valid UTF-8, falling back from the JIT when its stack runs out. */
int tok_regex_match(const pcre2_code *re, const char *s, size_t n, size_t pos,
                    pcre2_match_data *md);

typedef struct { size_t off, len; int first; } tok_piece;
typedef struct {
    tok_piece *v;
    size_t n, cap;
} tok_pieces;
/* Runs the pre-tokenizer steps on buf->p[0..len): pieces index into buf (which may grow
 * when a step rewrites text). first: the segment starts the input (Metaspace "first"). */
int tok_pretokenize(const tok_tokenizer *t, tok_buf *buf, int first, tok_pieces *out,
                    pcre2_match_data *md);
void tok_pieces_free(tok_pieces *p);

/* tok_bpe.c: BPE over one pre-token. ids is appended to. */
typedef struct {
    int32_t *v;
    size_t n, cap;
} tok_ids;
int tok_ids_push(tok_ids *ids, int32_t id);
typedef struct tok_bpe_scratch tok_bpe_scratch;
/* cache: keep a per-scratch cache of short pieces (pays off on long texts only). */
tok_bpe_scratch *tok_bpe_scratch_new(int cache);
void tok_bpe_scratch_free(tok_bpe_scratch *s);
int tok_bpe_piece(const tok_tokenizer *t, const char *s, size_t n, tok_bpe_scratch *sc,
                  tok_ids *out);
/* The same through a per-scratch cache of short pieces (long texts repeat words). */
int tok_bpe_piece_cached(const tok_tokenizer *t, const char *s, size_t n, tok_bpe_scratch *sc,
                         tok_ids *out);
/* Fills t->direct (needs pieces, byte_sym and merges ready); in_model[id]: id is a
 * model vocabulary entry. */
int tok_build_direct(tok_tokenizer *t, const uint8_t *in_model);
/* Turns merge strings "a b" (or a/b given apart) into the merge map. */
int tok_add_merge(tok_tokenizer *t, const char *a, size_t alen, const char *b, size_t blen,
                  int32_t rank);

/* Loaders and shared helpers (tokenizer.c). */
int tok_load_json(tok_tokenizer *t, const char *json_path, const char *config_path,
                  char *err, size_t errlen);
int tok_load_gguf(tok_tokenizer *t, const char *path, char *err, size_t errlen);
int tok_alloc_vocab(tok_tokenizer *t, int n);
int tok_set_token(tok_tokenizer *t, int id, const char *s, size_t len);
/* Freezes token strings (tok_str valid from here on) and creates the empty vocab map;
 * the loader then adds model ids with tok_strmap_add and merges with tok_add_merge. */
int tok_index_vocab(tok_tokenizer *t);
int tok_finish(tok_tokenizer *t, char *err, size_t errlen);
int tok_set_added(tok_tokenizer *t, tok_added *v, int n, char *err, size_t errlen);

#endif
