/* Reasoning sections in model output (prefix rp_): an incremental splitter of
 * <think>...</think> into reasoning_content and content, for DeepSeek-R1 and Qwen3 style
 * models.
 *
 * Where the output starts matters: R1's template (and Qwen3's thinking-only models) put
 * "<think>\n" into the prompt, so the output starts inside the reasoning and holds only
 * "</think>"; Qwen3 with enable_thinking false renders an empty "<think>\n\n</think>" into
 * the prompt, so the output is all content. rp_prompt_state reads that from the rendered
 * prompt's end. Then:
 *   - prompt opened a section: reasoning until </think> (a leading <think> is dropped);
 *   - prompt closed one: everything is content;
 *   - neither: an output starting with <think> is reasoning until </think>; otherwise
 *     deepseek_r1 treats the output as reasoning until </think> (R1 always reasons first)
 *     and qwen3 treats it as content.
 * Output that ends inside the reasoning (no </think>) is all reasoning. Whitespace next to
 * the tags (after <think>, before and after </think>) is dropped, as the templates do when
 * they render a past turn.
 *
 * Like the tool-call parser (toolcall.h), the result depends only on the text, not on how
 * it was cut into feeds; a suffix that may be the start of a tag is held back. */
#ifndef SPECD_REASONING_H
#define SPECD_REASONING_H

#include <stddef.h>

typedef enum { RP_NONE = 0, RP_DEEPSEEK_R1, RP_QWEN3 } rp_mode;
typedef enum { RP_PROMPT_NEUTRAL = 0, RP_PROMPT_OPEN, RP_PROMPT_CLOSED } rp_prompt;

/* "none", "deepseek_r1", "qwen3" -> 0 and *m; else -1. */
int rp_mode_parse(const char *name, rp_mode *m);
const char *rp_mode_name(rp_mode m);

/* From the rendered prompt: ends (whitespace aside) with "<think>" -> OPEN, with
 * "</think>" -> CLOSED, else NEUTRAL. */
rp_prompt rp_prompt_state(const char *prompt, size_t len);

typedef struct rp_parser rp_parser;

/* NULL on allocation failure or mode RP_NONE. */
rp_parser *rp_parser_new(rp_mode mode, rp_prompt prompt);
void rp_parser_free(rp_parser *p);

/* Feed generated text; final: nothing more will come. 0 or SPECD_ENOMEM. */
int rp_feed(rp_parser *p, const char *s, size_t n, int final);
/* Reasoning and content produced since the last take (valid until the next feed). */
void rp_take(rp_parser *p, const char **reasoning, size_t *rlen, const char **content, size_t *clen);

#endif
