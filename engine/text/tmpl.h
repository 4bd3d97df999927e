/* Chat templates (prefix tmpl_): a Jinja2 interpreter big enough for the chat templates
 * real models ship, rendering exactly what HF transformers' apply_chat_template renders
 * (trim_blocks and lstrip_blocks on, as HF sets them).
 *
 * Inputs are jansson values, as HF passes them: messages (array of objects; content a
 * string or a list of parts), tools (array or NULL), and extra variables
 * (add_generation_prompt, bos_token, eos_token, ...).
 *
 * Ownership: a tmpl_template is immutable after parsing; rendering it from several
 * threads at once is safe. Returned strings are malloc'd and owned by the caller. */
#ifndef SPECD_TMPL_H
#define SPECD_TMPL_H

#include <stddef.h>
#include <time.h>
#include <jansson.h>

typedef struct tmpl_template tmpl_template;

/* Parse template source. NULL + message (with line number) on a syntax error. */
tmpl_template *tmpl_parse(const char *src, size_t len, char *err, size_t errlen);
void tmpl_free(tmpl_template *t);

/* Render with a context object whose keys become top-level variables, e.g.
 * {"messages": [...], "tools": [...], "add_generation_prompt": true,
 *  "bos_token": "<s>", "eos_token": "</s>"}.
 * On success returns 0 and sets *out (malloc'd, NUL-terminated) and *out_len.
 * If the template calls raise_exception(msg), returns SPECD_ETEMPLATE with
 * "TemplateError: msg" in err (the form HF's exception prints);
 * other render errors also return SPECD_ETEMPLATE with a message. */
int tmpl_render(const tmpl_template *t, json_t *context, char **out, size_t *out_len,
                char *err, size_t errlen);

/* Convenience for chat: builds the context from the pieces HF passes. tools may be NULL.
 * extra (may be NULL) is merged in (e.g. special tokens, enable_thinking). */
int tmpl_render_chat(const tmpl_template *t, json_t *messages, json_t *tools,
                     int add_generation_prompt, const char *bos_token,
                     const char *eos_token, json_t *extra, char **out, size_t *out_len,
                     char *err, size_t errlen);

/* tmpl_render with strftime_now() reporting `now` (local time) instead of the current
 * time, for reproducible renders. */
int tmpl_render_at(const tmpl_template *t, json_t *context, time_t now, char **out,
                   size_t *out_len, char *err, size_t errlen);

/* The context tmpl_render_chat renders with (new reference, NULL on allocation failure):
 * messages, tools (JSON null when NULL, as HF passes None), documents (null),
 * add_generation_prompt, bos_token / eos_token when non-NULL, then extra's keys. */
json_t *tmpl_chat_context(json_t *messages, json_t *tools, int add_generation_prompt,
                          const char *bos_token, const char *eos_token, json_t *extra);

#endif
