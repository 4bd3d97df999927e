/* Tool calls in model output (prefix tc_): an incremental parser that splits generated
 * text into content and OpenAI tool calls, for the formats of the families specd serves:
 *
 *   hermes       Hermes / Qwen2.5 / Qwen3: <tool_call>{"name": N, "arguments": A}</tool_call>,
 *                several in a row;
 *   llama3_json  Llama 3.x: {"name": N, "parameters": A} at the start of the output or after
 *                <|python_tag|>, several separated by ';';
 *   mistral      [TOOL_CALLS][{"name": N, "arguments": A}, ...] and the newer
 *                [TOOL_CALLS]N[ARGS]A (one call per marker).
 *
 * "arguments" and "parameters" are both accepted as the arguments key; A is any JSON value,
 * reported as the model wrote it (its bytes), so arguments stream as they are generated.
 *
 * Contract (tested byte by byte in tests/test_toolcall.c): the result depends only on the
 * text, never on how it was cut into feeds. Streaming and non-streaming responses run
 * the same parser, so streamed deltas always reassemble to the non-streamed message.
 *   - A call is committed once its name has been read (the name must be a declared tool
 *     for llama3_json's bare-JSON form, which has no tag to show intent). Before that the
 *     parser holds the text back; if the text turns out not to be a call (no JSON object,
 *     no name, an unknown name in the bare form, an unterminated call at the end) it is
 *     given back as content, byte for byte.
 *   - After the commit, arguments bytes are reported as a JSON scanner accepts them. A call
 *     whose JSON breaks after its name keeps what was read; the text from the break on is
 *     content. A call cut off by the end of the output keeps its partial arguments. A
 *     call object without an arguments key gets "{}".
 *   - Text that could be the start of a marker ("<tool_" at the end) is held back until the
 *     next bytes decide, so no marker leaks into content. Whitespace between content and a
 *     call, between calls, and after the last call is dropped.
 *   - max_calls > 0 keeps only the first max_calls calls (parallel_tool_calls: false);
 *     later calls are parsed and dropped.
 *
 * Ownership: the parser copies what it needs from its config. Pointers returned by
 * tc_take_content and JSON returned by the builders belong to the caller as stated. */
#ifndef SPECD_TOOLCALL_H
#define SPECD_TOOLCALL_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

typedef enum { TC_NONE = 0, TC_HERMES, TC_LLAMA3_JSON, TC_MISTRAL } tc_format;

/* "none", "hermes", "llama3_json", "mistral" -> 0 and *f; "auto" -> 0 and *f = -1 (the
 * caller detects); anything else -> -1. */
int tc_format_parse(const char *name, int *f);
const char *tc_format_name(tc_format f);
/* The text that opens a format's calls ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>"),
 * NULL for TC_NONE. Where a tokenizer has it as a special token, decoding must keep
 * special tokens for the parser to see it. */
const char *tc_marker(tc_format f);
/* The format a chat template teaches its model, from the template's source: hermes when it
 * writes <tool_call>, mistral for [TOOL_CALLS], llama3_json for <|python_tag|> or the
 * {"name": ..., "parameters": ...} instruction; TC_NONE otherwise (or src NULL). */
tc_format tc_detect(const char *template_src);

typedef struct {
    tc_format format;
    int max_calls;          /* 0 = no limit */
    json_t *tools;          /* the request's tools (borrowed while creating): names for the
                             * llama3_json bare form */
    uint64_t id_seed;       /* 0: random call ids; else a reproducible sequence (tests) */
    /* Forced calls (tool_choice required / a named function), whose output constrained
     * decoding holds to tc_forced_schema: forced_array: the output is a JSON array of
     * {"name", "parameters"}; forced_name: the output is that function's arguments. The
     * format then only decides the ids' form; no text is content. */
    int forced_array;
    const char *forced_name;
} tc_config;

/* The JSON Schema (text, malloc'd) a forced call's output must follow: name given: the
 * tool's parameters ({"type": "object"} when it has none); else an array of 1 to
 * max_calls (0 = any) objects {"name": one tool's name, "parameters": its parameters}.
 * NULL when the tools name no function (or name is not among them). */
char *tc_forced_schema(json_t *tools, const char *name, int max_calls);

typedef struct tc_parser tc_parser;

/* NULL on allocation failure or format TC_NONE. */
tc_parser *tc_parser_new(const tc_config *cfg);
void tc_parser_free(tc_parser *p);

/* Feed generated text; final: no more text will come (flushes everything held). Returns 0
 * or SPECD_ENOMEM. After a final feed, further feeds are ignored. */
int tc_feed(tc_parser *p, const char *s, size_t n, int final);

/* Content produced by the feeds since the last take; *s stays valid until the next feed. */
void tc_take_content(tc_parser *p, const char **s, size_t *n);

/* Streaming: delta.tool_calls entries for what changed since the last call (new ref), or
 * NULL when nothing did. A call's first entry carries index, id, type and function.name
 * (and the arguments read so far); later ones index and an arguments fragment. */
json_t *tc_take_deltas(tc_parser *p);

/* Calls committed so far. */
int tc_n_calls(const tc_parser *p);
/* message.tool_calls: [{"id", "type": "function", "function": {"name", "arguments"}}]
 * (new ref; an empty array when there are none). */
json_t *tc_calls_json(const tc_parser *p);

#endif
