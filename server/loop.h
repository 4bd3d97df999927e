/* The serving loop (prefix loop_): a libuv loop thread that owns the engine and every
 * request's state.
 *
 * MHD threads build a loop_job (validated request + token ids + response channel) and
 * hand it over with loop_submit; a client that goes away is reported with loop_cancel.
 * Both only take the queue lock and uv_async_send. The loop thread admits jobs
 * (engine_add per choice) and runs engine_step on the libuv thread pool (never overlapping
 * add/abort/stats). With overlap on, step N+1 is queued before step N's outputs are
 * processed, so host work hides under the step; output processing (incremental
 * detokenization, stop strings with hold-back, logprobs, usage, SSE chunks or the final
 * JSON body into the job's sse_chan) runs per job on a pool of output threads. A choice
 * ended by a stop string is known one step late: the token of that extra step is dropped.
 *
 * Ownership: loop_submit takes the job (and its request, prompts and channel reference)
 * whether it succeeds or not. */
#ifndef SPECD_LOOP_H
#define SPECD_LOOP_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "engine/core/engine.h"
#include "server/api.h"
#include "server/metrics.h"
#include "server/sse.h"

typedef enum { LOOP_LOADING = 0, LOOP_READY, LOOP_DRAINING, LOOP_STOPPED } loop_state;

typedef struct loop loop;
typedef struct loop_choice loop_choice;

typedef struct loop_job {
    /* Filled by the HTTP side before loop_submit. */
    uint64_t id;                 /* set by loop_submit */
    api_request *req;            /* owned */
    int n_prompts;
    int32_t **prompt_ids;        /* [n_prompts] owned arrays */
    int *n_prompt_ids;           /* [n_prompts] */
    char **echo_text;            /* [n_prompts] prompt text for echo, or NULL */
    size_t *echo_len;
    sse_chan *chan;              /* owned reference */
    char rid[64];                /* "cmpl-..." / "chatcmpl-..." */
    long long created;
    double t_arrival;            /* loop_now() when the request arrived */
    char path[32];               /* for the log line */
    char request_id[72];         /* X-Request-Id, for the log line */
    int fd;                      /* client socket, -1 if unknown (see check_clients) */
    /* Chat output parsing, off when 0: tool_format a tc_format (toolcall.h) with at most
     * max_tool_calls calls (0 = any); reasoning an rp_mode and think_prompt the rp_prompt
     * the rendered prompt ended in (reasoning.h). */
    int tool_format, max_tool_calls, reasoning, think_prompt;
    int drop_stop_text;          /* special tokens kept for the parser: not the final one */
    /* tool_choice required / named: the grammar the output is held to (owned), used in
     * place of the request's own */
    grammar *tool_grammar;
    /* Loop-private from here on. */
    struct loop_job *next, *hnext;
    int seats;                   /* sequences counted in loop.inflight (loop_give_seats) */
    loop_choice *choices;
    int n_choices, n_done, n_admitted;
    int error_status;            /* != 0: the job failed with this HTTP status */
    char error_msg[512];
    const char *error_type;
    double t_first;
    int cancelled;
    int paused;                  /* backpressure: its sequences get no steps */
    double t_paused;
} loop_job;

typedef struct {
    int max_seq_len;
    int max_batch;
    int max_queued;              /* sequences allowed to wait beyond max_batch */
    double request_timeout;      /* 0 = none */
    const char *model_name;
    int overlap;                 /* queue step N+1 before processing step N's outputs */
    int output_threads;          /* threads for output processing (>= 1; the loop's own
                                  * thread is one of them) */
    /* Backpressure: a stream with more than stream_buffer_bytes unread (or with a backlog
     * while all streams together hold more than total_buffer_bytes) pauses its sequences
     * (KV kept, no steps) until it drains to half; paused longer than stall_timeout
     * seconds (0 = never), it is ended and its KV freed. */
    size_t stream_buffer_bytes;
    size_t total_buffer_bytes;
    double stall_timeout;
} loop_config;

/* Monotonic seconds. */
double loop_now(void);

/* Create on the given uv loop (not started). */
loop *loop_create(uv_loop_t *uv, const loop_config *cfg, metrics *m, char *err, size_t errlen);
/* Free after uv_run has returned. The engine is not destroyed. */
void loop_destroy(loop *l);

/* Hand over the loaded engine and turn READY (call from the loop thread before uv_run, or
 * any time while the loop thread is not running). */
void loop_set_engine(loop *l, engine *e);
loop_state loop_get_state(const loop *l);
int loop_engine_failed(const loop *l);

/* From any thread. 0 ok; SPECD_ESTATE when loading / draining (503); SPECD_ENOSPACE when
 * the queue is full (429); SPECD_ERANGE when its sequences (prompts x n) exceed
 * max_batch + max_queued, so it could never be admitted (400). The job is consumed either way (on error its channel is NOT
 * written: the caller replies). *id receives the job id (for loop_cancel). */
int loop_submit(loop *l, loop_job *job, uint64_t *id);
/* From any thread: the client of job id is gone. */
void loop_cancel(loop *l, uint64_t job_id);

/* From the loop thread (signal handler): stop admitting, let jobs finish for up to
 * timeout seconds, then fail the rest and stop the loop (uv_run returns). */
void loop_drain(loop *l, double timeout);

/* Free a job that was never submitted. */
void loop_job_free(loop_job *j);

#endif
