/* Output processing of the serving loop (see loop_internal.h): one step's engine events
 * become text (incremental detokenization that never splits a character), stop-string
 * matching with hold-back, logprobs, and SSE chunks or a final JSON body.
 *
 * Two phases per step:
 *   1. in parallel on the output pool: each partition takes the events of its jobs (job id
 *      modulo the partition count, so one job's choices stay on one thread) and does all
 *      the text work, pushing chunks into the jobs' channels; it only records what ended
 *      (a verdict per event);
 *   2. on the loop thread, in event order: verdicts are applied (finish chunks, final
 *      bodies, job release, engine aborts - applied when the running step returns).
 * A step with few events is processed on the loop thread alone (waking the pool would
 * cost more than it saves).
 * Host time of both phases is summed per generated token (loop_host_us_per_token). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/core/err.h"
#include "server/log.h"
#include "server/loop_internal.h"
#include "server/sbuf.h"

static void push_json(loop_job *job, json_t *v) {
    size_t len;
    char *ev = api_sse_event(v, &len);
    json_decref(v);
    if (ev) sse_chan_push(job->chan, ev, len);
    free(ev);
}

int loop_output_init(loop *l, int threads) {
    if (threads < 1) threads = 1;
    l->pool = tp_create(threads);
    l->n_parts = threads > 1 ? threads * 4 : 1;  /* several per thread: uneven jobs balance */
    l->detok = calloc((size_t)l->n_parts, sizeof *l->detok);
    if (!l->pool || !l->detok) return SPECD_ENOMEM;
    for (int i = 0; i < l->n_parts; i++)
        if (!(l->detok[i] = malloc(LOOP_DETOK_CAP))) return SPECD_ENOMEM;
    return 0;
}

void loop_output_free(loop *l) {
    if (l->pool) tp_destroy(l->pool);
    for (int i = 0; l->detok && i < l->n_parts; i++) free(l->detok[i]);
    free(l->detok);
    free(l->items);
}

/* Send text (and this step's logprobs, stolen) of a choice to the client. A stream gets a
 * chunk for every step that produced tokens, even when their text is empty (held back,
 * partial character, no tokenizer): the write is also how a vanished client is noticed
 * (a parked MHD connection sees no disconnects), so it must happen per step. */
/* Streamed chat text through the choice's parsers (reasoning, then tool calls in what is
 * left): the delta of what they let out. */
static json_t *parsed_delta(loop_choice *c, const char *s, size_t n, int final) {
    json_t *d = json_object();
    const char *cs = s;
    size_t cn = n;
    if (c->rp) {
        const char *rs;
        size_t rn;
        rp_feed(c->rp, s, n, final);
        rp_take(c->rp, &rs, &rn, &cs, &cn);
        if (rn) json_object_set_new(d, "reasoning_content", json_stringn(rs, rn));
    }
    json_t *calls = NULL;
    if (c->tc) {
        tc_feed(c->tc, cs, cn, final);
        tc_take_content(c->tc, &cs, &cn);
        calls = tc_take_deltas(c->tc);
    }
    if (cn) json_object_set_new(d, "content", json_stringn(cs, cn));
    if (calls) json_object_set_new(d, "tool_calls", calls);
    return d;
}

/* Events (an array, stolen) as SSE on the job's stream. */
static void push_events(loop_job *job, json_t *ev) {
    json_t *e;
    size_t i, len;
    json_array_foreach(ev, i, e) {
        char *sse = api_rstream_sse(e, &len);
        if (sse) sse_chan_push(job->chan, sse, len);
        free(sse);
    }
    json_decref(ev);
}

/* Responses / Messages events of a chat delta (stolen), pushed as SSE; a step that
 * produced none still writes a comment line (the liveness write, see emit). */
static void push_resp_events(loop_choice *c, json_t *delta, int keepalive) {
    json_t *ev = json_array();
    if (c->ms) api_mstream_feed(c->ms, delta, ev);
    else api_rstream_feed(c->rs, delta, ev);
    json_decref(delta);
    if (!json_array_size(ev) && keepalive) sse_chan_push(c->job->chan, ":\n\n", 3);
    push_events(c->job, ev);
}

/* A chat delta of plain text (no parsers). */
static json_t *text_delta(const char *s, size_t n) {
    json_t *d = json_object();
    if (n) json_object_set_new(d, "content", json_stringn(s, n));
    return d;
}

static void emit(loop *l, loop_choice *c, const char *s, size_t n, json_t *lp, int had_tokens) {
    loop_job *job = c->job;
    api_request *r = job->req;
    if ((c->rs || c->ms) && r->stream) {
        json_decref(lp);
        push_resp_events(c, c->rp || c->tc ? parsed_delta(c, s, n, 0) : text_delta(s, n), had_tokens);
        return;
    }
    if (r->stream && (c->rp || c->tc)) {
        json_t *d = parsed_delta(c, s, n, 0);
        if (!json_object_size(d)) {
            if (!lp && !had_tokens) {
                json_decref(d);
                return;
            }
            json_object_set_new(d, "content", json_string(""));   /* one write per step */
        }
        push_json(job, api_chat_delta_chunk(job->rid, job->created, l->cfg.model_name, c->index, d, NULL, lp,
                                            r->include_usage));
        return;
    }
    if (r->stream) {
        if (!n && !lp && !had_tokens) return;
        push_json(job, api_chunk_json(r->kind, job->rid, job->created, l->cfg.model_name, c->index, 0, s,
                                      n, NULL, lp, r->include_usage));
        return;
    }
    json_decref(lp);
    sbuf_append(&c->text, &c->tlen, &c->tcap, s, n);
}

static api_usage job_usage(loop *l, loop_job *job) {
    api_usage u = {0, 0, l->spec, 0, 0, 0, l->drafter, 0};
    for (int p = 0; p < job->n_prompts; p++) u.prompt_tokens += job->n_prompt_ids[p];
    for (int i = 0; i < job->n_choices; i++) {
        loop_choice *c = &job->choices[i];
        u.completion_tokens += c->n_out;
        u.draft_tokens += c->spec_draft;
        u.accepted_tokens += c->spec_accept;
        u.verify_steps += c->spec_verify;
        u.decode_steps += c->spec_decode;
    }
    return u;
}

static void send_error_body(loop_job *job) {
    api_error e;
    api_fail(&e, job->error_status, job->error_type, NULL, NULL, "%s", job->error_msg);
    json_t *v = job->req->messages_api ? api_msg_error_json(&e) : api_error_json(&e);
    if (job->req->stream && job->req->messages_api) {   /* an error event ends the stream */
        size_t len;
        char *sse = api_rstream_sse(v, &len);
        json_decref(v);
        if (sse) sse_chan_push(job->chan, sse, len);
        free(sse);
        sse_chan_close(job->chan, 200);
        return;
    }
    if (job->req->stream) {
        push_json(job, v);
        sse_chan_push(job->chan, API_SSE_DONE, strlen(API_SSE_DONE));
        sse_chan_close(job->chan, 200);
        return;
    }
    char *s = json_dumps(v, JSON_COMPACT);
    json_decref(v);
    sse_chan_push_close(job->chan, s ? s : "", s ? strlen(s) : 0, job->error_status);
    free(s);
}

/* "stop" becomes "tool_calls" when the output held calls, except for a named function
 * forced by tool_choice (OpenAI answers "stop" there, and vLLM does too). */
static const char *shown_finish(const loop_choice *c, const char *reason) {
    if (c->tc && tc_n_calls(c->tc) && reason && !strcmp(reason, "stop") &&
        c->job->req->tool_choice != API_TOOL_NAMED)
        return "tool_calls";
    return reason;
}

/* A non-streamed chat message through the choice's parsers, all text at once: content
 * (null when empty and calls or reasoning came out), reasoning_content, tool_calls; the
 * finish as shown_finish says. */
static json_t *parsed_message(loop_choice *c, const char **finish) {
    const char *cs = c->text ? c->text : "", *rs = "";
    size_t cn = c->tlen, rn = 0;
    if (c->rp) {   /* rs stays valid: rp is fed no more */
        rp_feed(c->rp, cs, cn, 1);
        rp_take(c->rp, &rs, &rn, &cs, &cn);
    }
    if (c->tc) {
        tc_feed(c->tc, cs, cn, 1);
        tc_take_content(c->tc, &cs, &cn);
    }
    int calls = c->tc ? tc_n_calls(c->tc) : 0;
    json_t *m = json_object();
    json_object_set_new(m, "role", json_string("assistant"));
    json_object_set_new(m, "content", cn || !(calls || rn) ? json_stringn(cs, cn) : json_null());
    if (c->rp) json_object_set_new(m, "reasoning_content", rn ? json_stringn(rs, rn) : json_null());
    if (calls) json_object_set_new(m, "tool_calls", tc_calls_json(c->tc));
    *finish = shown_finish(c, *finish);
    return m;
}

/* POST /v1/responses and /v1/messages: the response object or message (non-streamed), or
 * the closing events; the stop string that matched goes to the Messages API. */
static void send_translated(loop_job *job, const api_usage *u) {
    loop_choice *c = &job->choices[0];
    const char *finish = c->finish;
    if (!job->req->stream) {
        json_t *m = c->rp || c->tc ? parsed_message(c, &finish) : text_delta(c->text, c->tlen);
        if (c->ms) api_mstream_feed(c->ms, m, NULL);
        else api_rstream_feed(c->rs, m, NULL);
        json_decref(m);
    } else {
        finish = shown_finish(c, finish);
    }
    json_t *ev = job->req->stream ? json_array() : NULL, *out;
    if (c->ms) {
        const int k = c->stop_hit;
        out = api_mstream_close(c->ms, finish, k > 0 && k <= job->req->n_stop ? job->req->stop[k - 1] : NULL,
                                u->prompt_tokens, u->completion_tokens, ev);
    } else {
        out = api_rstream_close(c->rs, finish, u->prompt_tokens, u->completion_tokens, ev);
    }
    if (job->req->stream) {
        push_events(job, ev);
        json_decref(out);
        sse_chan_close(job->chan, 200);
        return;
    }
    char *s = json_dumps(out, JSON_COMPACT);
    json_decref(out);
    sse_chan_push_close(job->chan, s ? s : "", s ? strlen(s) : 0, s ? 200 : 500);
    free(s);
}

static void send_success(loop *l, loop_job *job) {
    api_request *r = job->req;
    api_usage u = job_usage(l, job);
    if (job->n_choices && (job->choices[0].rs || job->choices[0].ms)) {
        send_translated(job, &u);
        return;
    }
    if (r->stream) {
        if (r->include_usage) push_json(job, api_usage_chunk_json(r->kind, job->rid, job->created, l->cfg.model_name, &u));
        sse_chan_push(job->chan, API_SSE_DONE, strlen(API_SSE_DONE));
        sse_chan_close(job->chan, 200);
        return;
    }
    json_t *choices = json_array();
    for (int i = 0; i < job->n_choices; i++) {
        loop_choice *c = &job->choices[i];
        json_t *lp = c->lp;
        c->lp = NULL;
        if (c->rp || c->tc) {
            const char *finish = c->finish;
            json_t *m = parsed_message(c, &finish);
            json_array_append_new(choices, api_chat_message_choice(c->index, m, finish, lp));
            continue;
        }
        json_t *ch = r->kind == API_CHAT ? api_chat_choice(c->index, c->text, c->tlen, c->finish, lp)
                                         : api_completion_choice(c->index, c->text, c->tlen, c->finish, lp);
        if (r->prompt_logprobs >= 0) {
            json_object_set_new(ch, "prompt_logprobs", c->prompt_lp ? c->prompt_lp : json_null());
            c->prompt_lp = NULL;
        }
        json_array_append_new(choices, ch);
    }
    json_t *v = api_response_json(r->kind, job->rid, job->created, l->cfg.model_name, choices, &u);
    char *s = json_dumps(v, JSON_COMPACT);
    json_decref(v);
    if (!s) {
        job->error_status = 500;
        snprintf(job->error_msg, sizeof job->error_msg, "could not serialise the response");
        send_error_body(job);
        return;
    }
    sse_chan_push_close(job->chan, s, strlen(s), 200);
    free(s);
}

void loop_log_job(loop *l, loop_job *job, int status) {
    api_usage u = job_usage(l, job);
    const char *finish = job->error_status ? "error" : job->cancelled ? "abort"
                                                      : job->n_choices ? job->choices[0].finish : NULL;
    log_request_line line = {job->rid, "POST", job->path, status, u.prompt_tokens, u.completion_tokens,
                             job->t_first > 0 ? job->t_first - job->t_arrival : -1.0,
                             loop_now() - job->t_arrival, finish, job->request_id[0] ? job->request_id : NULL};
    log_request(&line);
}

static void finish_job(loop *l, loop_job *job) {
    loop_abort_choices(l, job);
    loop_give_seats(l, job);
    if (job->error_status) send_error_body(job);
    else send_success(l, job);
    metrics_observe_e2e(l->m, loop_now() - job->t_arrival);
    loop_log_job(l, job, job->error_status ? job->error_status : 200);
    loop_release_job(l, job);
}

static void finish_choice(loop *l, loop_choice *c, const char *reason) {
    if (c->done) return;
    c->done = 1;
    c->finish = reason;
    loop_job *job = c->job;
    const char *shown = reason;
    if ((c->rs || c->ms) && job->req->stream && !job->error_status) {
        /* what the parsers still held; the closing events come with the usage */
        if (c->rp || c->tc) push_resp_events(c, parsed_delta(c, "", 0, 1), 0);
    } else if (job->req->stream && !job->error_status) {
        if (c->rp || c->tc) {   /* what the parsers still held, then the finish */
            json_t *d = parsed_delta(c, "", 0, 1);
            if (json_object_size(d))
                push_json(job, api_chat_delta_chunk(job->rid, job->created, l->cfg.model_name, c->index, d, NULL,
                                                    NULL, job->req->include_usage));
            else json_decref(d);
            shown = shown_finish(c, reason);
        }
        push_json(job, api_chunk_json(job->req->kind, job->rid, job->created, l->cfg.model_name, c->index,
                                      0, NULL, 0, shown, NULL, job->req->include_usage));
    }
    metrics_request_finished(l->m, reason);
    if (++job->n_done == job->n_choices) finish_job(l, job);
}

void loop_fail_job(loop *l, loop_job *job, int status, const char *type, const char *msg) {
    if (!job->error_status) {
        job->error_status = status;
        job->error_type = type;
        snprintf(job->error_msg, sizeof job->error_msg, "%s", msg);
    }
    loop_abort_choices(l, job);
    for (int i = 0; i < job->n_choices; i++)
        if (!job->choices[i].done) {
            job->choices[i].done = 1;
            job->choices[i].finish = "error";
            metrics_request_finished(l->m, "error");
        }
    job->n_done = job->n_choices;
    finish_job(l, job);
}

/* The chat output parsers the job asked for (tool calls, reasoning), per choice. Output
 * held to a grammar from its first token did not continue a <think> the prompt opened:
 * it holds reasoning only when it starts with <think> itself (the grammar's choice). */
static int make_parsers(loop_job *job, loop_choice *c) {
    if (job->req->kind != API_CHAT) return 0;
    int constrained = job->tool_grammar || job->req->sp.grammar;
    rp_mode mode = constrained && job->reasoning ? RP_QWEN3 : (rp_mode)job->reasoning;
    rp_prompt ps = constrained ? RP_PROMPT_NEUTRAL : (rp_prompt)job->think_prompt;
    if (mode && !(c->rp = rp_parser_new(mode, ps))) return SPECD_ENOMEM;
    if (job->tool_format) {
        tc_config cfg = {.format = (tc_format)job->tool_format, .max_calls = job->max_tool_calls,
                         .tools = job->req->tools, .forced_array = job->req->tool_choice == API_TOOL_REQUIRED,
                         .forced_name = job->req->tool_choice == API_TOOL_NAMED ? job->req->tool_name : NULL};
        if (!(c->tc = tc_parser_new(&cfg))) return SPECD_ENOMEM;
    }
    return 0;
}

void loop_output_start(loop *l, loop_job *job) {
    api_request *r = job->req;
    for (int i = 0; i < job->n_choices; i++)
        if (make_parsers(job, &job->choices[i]) ||
            (r->responses && !(job->choices[i].rs = api_rstream_new(job->rid, job->created, l->cfg.model_name,
                                                                    r->responses))) ||
            (r->messages_api && !(job->choices[i].ms = api_mstream_new(job->rid, l->cfg.model_name)))) {
            loop_fail_job(l, job, 500, "server_error", "out of memory");
            return;
        }
    if ((r->messages_api || r->responses) && r->stream) {   /* the opening events */
        json_t *ev = json_array();
        int in = 0;
        for (int p = 0; p < job->n_prompts; p++) in += job->n_prompt_ids[p];
        if (r->messages_api) api_mstream_open(job->choices[0].ms, in, ev);
        else api_rstream_open(job->choices[0].rs, ev);
        push_events(job, ev);
        return;
    }
    for (int i = 0; i < job->n_choices; i++) {
        loop_choice *c = &job->choices[i];
        const char *echo = job->echo_text ? job->echo_text[c->prompt] : NULL;
        size_t elen = echo ? job->echo_len[c->prompt] : 0;
        if (r->stream && r->kind == API_CHAT)
            push_json(job, api_chunk_json(r->kind, job->rid, job->created, l->cfg.model_name, c->index, 1, "", 0,
                                          NULL, NULL, r->include_usage));
        if (echo && r->echo) {
            c->offset = (long long)elen;
            /* with logprobs, a stream's echo waits for the prompt's logprobs (prompt_output) */
            if (r->stream && r->logprobs >= 0) continue;
            if (r->stream)
                push_json(job, api_chunk_json(r->kind, job->rid, job->created, l->cfg.model_name, c->index, 0,
                                              echo, elen, NULL, NULL, r->include_usage));
            else sbuf_append(&c->text, &c->tlen, &c->tcap, echo, elen);
        }
    }
}

/* Text of one token for logprobs (not the streamed text: that comes from tok_stream). */
static void token_text(loop *l, int32_t id, char *buf, size_t cap, size_t *len) {
    char *t = NULL;
    size_t n = 0;
    if (l->tok && !tok_decode(l->tok, &id, 1, 0, &t, &n) && t && n < cap) {
        memcpy(buf, t, n);
        *len = n;
    } else {
        *len = (size_t)snprintf(buf, cap, "token_id:%d", (int)id);
    }
    free(t);
}

static void add_logprobs(loop *l, loop_choice *c, json_t *lp, const engine_token *t) {
    char tok[256], tops[ENGINE_MAX_TOP_LOGPROBS][256];
    const char *top_ptr[ENGINE_MAX_TOP_LOGPROBS];
    size_t tok_len, top_len[ENGINE_MAX_TOP_LOGPROBS];
    token_text(l, t->id, tok, sizeof tok, &tok_len);
    int n_top = t->n_top < ENGINE_MAX_TOP_LOGPROBS ? t->n_top : ENGINE_MAX_TOP_LOGPROBS;
    for (int i = 0; i < n_top; i++) {
        token_text(l, t->top_ids[i], tops[i], sizeof tops[i], &top_len[i]);
        top_ptr[i] = tops[i];
    }
    api_logprobs_add(lp, c->job->req->kind, tok, tok_len, t->logprob, n_top, top_ptr, top_len,
                     t->top_logprobs, c->offset + (long long)c->plen);
}

/* vLLM's prompt_logprobs entry of one prompt token: {"<id>": {logprob, rank,
 * decoded_token}} for the token and its top N (null for the first token). */
static json_t *prompt_lp_entry(loop *l, const engine_token *t, int top_n) {
    if (isnan(t->logprob)) return json_null();
    json_t *o = json_object();
    char key[16], text[256];
    size_t len;
    int n = t->n_top < top_n ? t->n_top : top_n;
    for (int i = -1; i < n; i++) {
        int32_t id = i < 0 ? t->id : t->top_ids[i];
        snprintf(key, sizeof key, "%d", (int)id);
        if (i >= 0 && json_object_get(o, key)) continue;   /* the prompt token is among the top */
        token_text(l, id, text, sizeof text, &len);
        json_object_set_new(o, key, json_pack("{s:f, s:i, s:s%}", "logprob", (double)(i < 0 ? t->logprob : t->top_logprobs[i]),
                                              "rank", i < 0 ? t->rank : i + 1, "decoded_token", text, len));
    }
    return o;
}

/* The event that ends the prompt brought its logprobs: the echoed prompt's logprobs
 * (completions with echo and logprobs: text offsets from 0, the first token's null; a
 * stream sends the echo now, with them) and vLLM's prompt_logprobs list. */
static void prompt_output(loop *l, loop_choice *c, const engine_event *ev) {
    loop_job *job = c->job;
    api_request *r = job->req;
    int n = ev->n_prompt_tokens;
    if (r->echo && r->logprobs >= 0) {
        json_t *lp = r->stream ? api_logprobs_new(r->kind) : json_incref(c->lp);
        engine_token t0 = {0};
        long long off = 0;
        for (int i = 0; i < n; i++) {
            const engine_token *t = &ev->prompt_tokens[i];
            t0 = *t;
            if (t0.n_top > r->logprobs) t0.n_top = r->logprobs;
            char text[256];
            size_t len;
            token_text(l, t->id, text, sizeof text, &len);
            c->offset = off;   /* add_logprobs' text_offset: offset + plen (plen is 0 here) */
            add_logprobs(l, c, lp, &t0);
            off += (long long)len;
        }
        const char *echo = job->echo_text ? job->echo_text[c->prompt] : NULL;
        size_t elen = echo ? job->echo_len[c->prompt] : 0;
        c->offset = (long long)elen;
        if (r->stream)
            push_json(job, api_chunk_json(r->kind, job->rid, job->created, l->cfg.model_name, c->index, 0,
                                          echo ? echo : "", elen, NULL, lp, r->include_usage));
        else json_decref(lp);
    }
    if (r->prompt_logprobs >= 0) {
        json_decref(c->prompt_lp);
        c->prompt_lp = json_array();
        for (int i = 0; i < n; i++)
            json_array_append_new(c->prompt_lp, prompt_lp_entry(l, &ev->prompt_tokens[i], r->prompt_logprobs));
    }
}

/* Emit what the stop strings allow; returns 1 when a stop string ended the choice. With
 * final set, nothing more will come, so nothing is held back. */
static int drain_pending(loop *l, loop_choice *c, json_t *lp, int final, int had_tokens) {
    api_request *r = c->job->req;
    size_t n = 0;
    int hit = api_stop_scan(c->pending, c->plen, r->stop, r->n_stop, &n);
    for (int i = 0; hit && !c->stop_hit && i < r->n_stop; i++)   /* the string that matched at n */
        if (c->plen - n >= strlen(r->stop[i]) && !memcmp(c->pending + n, r->stop[i], strlen(r->stop[i])))
            c->stop_hit = 1 + i;
    if (final && !hit) n = c->plen;
    if (n || lp || had_tokens) emit(l, c, c->pending, n, lp, had_tokens);
    c->offset += (long long)n;
    if (c->plen > n) memmove(c->pending, c->pending + n, c->plen - n);
    c->plen -= n;
    if (hit) c->plen = 0;
    return hit;
}

/* Phase 1 for one event: everything but ending the choice. detok is the partition's
 * scratch. Returns the verdict. */
static out_verdict process_event(loop *l, loop_choice *c, const engine_event *ev, char *detok, double now) {
    loop_job *job = c->job;
    api_request *r = job->req;
    c->spec_verify = ev->spec_verify_steps;
    c->spec_draft = ev->spec_draft_tokens;
    c->spec_accept = ev->spec_accepted_tokens;
    c->spec_decode = ev->spec_decode_steps;
    if (ev->n_tokens > 0) {
        if (job->t_first <= 0) {
            job->t_first = now;
            metrics_observe_ttft(l->m, now - job->t_arrival);
        } else if (c->n_out > 0) {
            metrics_observe_itl_n(l->m, (now - c->t_last) / ev->n_tokens, ev->n_tokens);
        }
        c->t_last = now;
    }
    if (ev->prompt_tokens) prompt_output(l, c, ev);
    json_t *lp = r->logprobs >= 0 ? (r->stream ? api_logprobs_new(r->kind) : json_incref(c->lp)) : NULL;
    int stopped = 0;
    for (int i = 0; i < ev->n_tokens && !stopped; i++) {
        const engine_token *t = &ev->tokens[i];
        c->n_out++;
        if (lp) add_logprobs(l, c, lp, t);
        int stop_token = job->drop_stop_text && l->tok && ev->finish == ENGINE_FINISH_STOP && i == ev->n_tokens - 1 &&
                         tok_is_special(l->tok, t->id);
        if (c->ts && !stop_token) {
            int w = tok_stream_push(c->ts, t->id, detok, LOOP_DETOK_CAP);
            if (w > 0 && sbuf_append(&c->pending, &c->plen, &c->pcap, detok, (size_t)w)) w = -1;
            if (w < 0) {
                json_decref(lp);
                return OUT_FAIL;
            }
        }
        /* Check after every token so tokens past a stop string are not counted. */
        if (r->n_stop && c->plen) {
            size_t dummy;
            stopped = api_stop_scan(c->pending, c->plen, r->stop, r->n_stop, &dummy);
        }
    }
    int final = ev->finish != ENGINE_RUNNING;
    if (final && c->ts && !stopped) {
        int w = tok_stream_flush(c->ts, detok, LOOP_DETOK_CAP);
        if (w > 0) sbuf_append(&c->pending, &c->plen, &c->pcap, detok, (size_t)w);
    }
    if (drain_pending(l, c, r->stream ? lp : (json_decref(lp), NULL), final, ev->n_tokens > 0 && !final))
        return OUT_STOP;
    return final ? OUT_FINAL : OUT_NONE;
}

typedef struct {
    loop *l;
    int n;
    double now;
} part_ctx;

static void process_part(void *arg, int part) {
    part_ctx *x = arg;
    loop *l = x->l;
    for (int i = 0; i < x->n; i++) {
        out_item *it = &l->items[i];
        if (it->c && (int)(it->c->job->id % (uint64_t)l->n_parts) == part)
            it->verdict = process_event(l, it->c, it->ev, l->detok[part], x->now);
    }
}

static double mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

void loop_output_process(loop *l, const engine_output *out) {
    if (!out->n_events) return;
    double t0 = mono_ns();
    if (out->n_events > l->cap_items) {
        int cap = out->n_events * 2;
        out_item *n = realloc(l->items, (size_t)cap * sizeof *n);
        if (!n) {  /* cannot track them: fail the jobs rather than lose their tokens */
            for (int i = 0; i < out->n_events; i++) {
                loop_job *job = loop_find_job(l, out->events[i].req_id >> 8);
                if (job) loop_fail_job(l, job, 500, "server_error", "out of memory");
            }
            return;
        }
        l->items = n;
        l->cap_items = cap;
    }
    /* Resolve events to live choices; engine errors end their jobs at once. */
    long long tokens = 0;
    for (int i = 0; i < out->n_events; i++) {
        const engine_event *ev = &out->events[i];
        out_item *it = &l->items[i];
        *it = (out_item){.ev = ev};
        loop_job *job = loop_find_job(l, ev->req_id >> 8);
        int idx = (int)(ev->req_id & 0xff);
        if (!job || idx >= job->n_choices) continue;  /* cancelled, or ended one step ago */
        loop_choice *c = &job->choices[idx];
        if (c->done) continue;                         /* its extra token: dropped */
        if (ev->finish != ENGINE_RUNNING) c->in_engine = 0;
        if (ev->finish == ENGINE_FINISH_ERROR) {
            loop_fail_job(l, job, 500, "server_error", "the engine failed while running this request");
            continue;
        }
        it->c = c;
        tokens += ev->n_tokens;
    }
    part_ctx x = {l, out->n_events, loop_now()};
    if (out->n_events >= LOOP_PARALLEL_EVENTS) tp_run(l->pool, process_part, &x, l->n_parts);
    else
        for (int p = 0; p < l->n_parts; p++) process_part(&x, p);
    /* Apply verdicts in event order (a job may end here; later items of it are skipped). */
    for (int i = 0; i < out->n_events; i++) {
        out_item *it = &l->items[i];
        if (!it->c) continue;
        /* job ids are never reused: a job found is live, so its choice pointer is too */
        loop_job *job = loop_find_job(l, it->ev->req_id >> 8);
        if (!job) continue;  /* released by an earlier item */
        if (it->verdict == OUT_NONE) {
            loop_check_backlog(l, job);
            continue;
        }
        loop_choice *c = it->c;
        if (it->verdict == OUT_FAIL) {
            loop_fail_job(l, job, 500, "server_error", "detokenization failed");
        } else if (it->verdict == OUT_STOP) {
            if (c->in_engine) {
                loop_abort_req(l, c->req_id);
                c->in_engine = 0;
            }
            finish_choice(l, c, "stop");
        } else {
            finish_choice(l, c, api_finish_reason(it->ev->finish));
        }
    }
    atomic_fetch_add(&l->host_ns, (long long)(mono_ns() - t0));
    atomic_fetch_add(&l->host_tokens, tokens);
}
