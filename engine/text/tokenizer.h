/* Tokenizer (prefix tok_): encode / decode exactly as HF tokenizers does, loaded from a
 * tokenizer.json (+ tokenizer_config.json beside it) or from GGUF metadata
 * (tokenizer.ggml.*). Models: byte-level BPE (GPT-2, Llama-3, Qwen2/3, SmolLM, and every
 * GGUF pre-tokenizer family: engine/text/tok_gguf.c) and SentencePiece-style BPE with byte
 * fallback (Llama-2, Phi-3, Mistral, TinyLlama, Gemma 4).
 *
 * Ownership: a tok_tokenizer is immutable after creation and safe to use from many
 * threads at once (encode/decode keep their state on the stack or in the caller's
 * buffers). Returned arrays are malloc'd and owned by the caller. */
#ifndef SPECD_TOKENIZER_H
#define SPECD_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

typedef struct tok_tokenizer tok_tokenizer;

/* path: a checkpoint directory (reads tokenizer.json + tokenizer_config.json), a
 * tokenizer.json file, or a .gguf file. NULL + message on failure. */
tok_tokenizer *tok_load(const char *path, char *err, size_t errlen);
void tok_free(tok_tokenizer *t);

int tok_vocab_size(const tok_tokenizer *t);
int tok_bos_id(const tok_tokenizer *t);          /* -1 if none */
int tok_eos_id(const tok_tokenizer *t);          /* -1 if none */
int tok_pad_id(const tok_tokenizer *t);          /* -1 if none */
int tok_add_bos(const tok_tokenizer *t);         /* whether encode(add_special=1) adds BOS */
/* Text of special tokens as the chat template needs them ("" when absent). */
const char *tok_bos_token(const tok_tokenizer *t);
const char *tok_eos_token(const tok_tokenizer *t);
/* The chat template shipped with the tokenizer (tokenizer_config.json chat_template or
 * GGUF tokenizer.chat_template); NULL if none. */
const char *tok_chat_template(const tok_tokenizer *t);
/* Id of an exact token string (added tokens included), -1 if absent. */
int tok_token_id(const tok_tokenizer *t, const char *s, size_t len);
/* Whether an id is a special/control token (skipped by decode with skip_special). */
int tok_is_special(const tok_tokenizer *t, int id);
/* The bytes one token stands for in decoded text (byte-level mapped back, the
 * SentencePiece word mark as a space, <0xNN> as that byte), before decode joins pieces
 * (so without the first-token space strip some decoders apply). *bytes points into the
 * tokenizer. Constrained decoding matches these. SPECD_EINVAL for an id out of range. */
int tok_token_bytes(const tok_tokenizer *t, int id, const char **bytes, size_t *len);

/* Encode UTF-8 text. add_special: add BOS/EOS as the tokenizer's config says.
 * Special tokens written in the text are matched (as HF does by default).
 * Returns the number of ids (>= 0) and sets *ids (malloc'd), or a negative code
 * (SPECD_EUTF8 for invalid UTF-8, with a message). */
int tok_encode(const tok_tokenizer *t, const char *text, size_t len, int add_special,
               int32_t **ids, char *err, size_t errlen);

/* Decode ids to UTF-8 text (malloc'd, NUL-terminated, *len set). skip_special drops
 * special tokens. Bytes that do not form valid UTF-8 become U+FFFD, as HF does. */
int tok_decode(const tok_tokenizer *t, const int32_t *ids, size_t n, int skip_special,
               char **text, size_t *len);

/* Incremental detokenizer for streaming: feed ids one at a time, get back only the text
 * that is final (never a partial UTF-8 character, and never text a later token could
 * still change). The concatenation of every piece plus tok_stream_flush() equals
 * tok_decode() of all ids. */
typedef struct tok_stream tok_stream;
tok_stream *tok_stream_new(const tok_tokenizer *t, int skip_special);
void tok_stream_free(tok_stream *s);
/* Appends the newly final text to out (buffer of cap bytes), returns bytes written or a
 * negative code if cap is too small. */
int tok_stream_push(tok_stream *s, int32_t id, char *out, size_t cap);
int tok_stream_flush(tok_stream *s, char *out, size_t cap);

#endif
