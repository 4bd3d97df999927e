/* The serving loop's private state, shared by its three parts (see loop.h):
 *   loop.c          inbound queue, admission, processing published steps, drain;
 *   loop_engine.c   the engine thread: steps back to back, commands applied between;
 *   loop_output.c   output processing: tokens -> text, stop strings, logprobs, SSE chunks,
 *                   final bodies (per stream, in parallel on the output pool);
 *   loop_clients.c  client liveness, cancels, request and drain deadlines.
 *
 * Threads: everything here belongs to the loop thread, except that during output
 * processing the pool's threads work on disjoint sets of jobs (a job's choices all go to
 * one partition) and touch only those jobs' choices and channels, the metrics (locked) and
 * their partition's scratch. The engine belongs to the engine thread: the loop thread only
 * calls engine_prepare and posts commands (loop_engine_add, loop_abort_req) under emu. */
#ifndef SPECD_LOOP_INTERNAL_H
#define SPECD_LOOP_INTERNAL_H

#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>

#include "engine/core/threadpool.h"
#include "server/api_messages.h"
#include "server/api_responses.h"
#include "server/loop.h"
#include "server/reasoning.h"
#include "server/toolcall.h"

#define LOOP_N_BUCKETS 1024
#define LOOP_DETOK_CAP 65536
#define LOOP_TICK_MS 100
#define LOOP_PARALLEL_EVENTS 16   /* fewer events in a step: processed on the loop thread */
#define LOOP_BACKLOG_MIN 16384    /* over the total cap, streams with more unread than this pause */

struct loop_choice {
    loop_job *job;
    int index, prompt;
    uint64_t req_id;
    int in_engine, done;
    const char *finish;
    tok_stream *ts;
    char *pending;              /* decoded text not yet emitted (stop-string hold-back) */
    size_t plen, pcap;
    char *text;                 /* non-streaming: everything emitted (echo included) */
    size_t tlen, tcap;
    long long offset;           /* bytes of text produced so far (logprobs text_offset) */
    json_t *lp;                 /* non-streaming logprobs accumulator */
    json_t *prompt_lp;          /* vLLM's prompt_logprobs list, once the prompt is done */
    api_rstream *rs;            /* POST /v1/responses: its output items and events */
    api_mstream *ms;            /* POST /v1/messages: its content blocks and events */
    int stop_hit;               /* 1 + the index of the stop string that ended it (0: none) */
    rp_parser *rp;              /* streaming chat: reasoning split (NULL = off) */
    tc_parser *tc;              /* streaming chat: tool calls (NULL = off) */
    int n_out;
    long long spec_verify, spec_draft, spec_accept, spec_decode;
    double t_last;
};

/* What output processing decided for one event; applied on the loop thread. */
typedef enum { OUT_NONE = 0, OUT_STOP, OUT_FINAL, OUT_FAIL } out_verdict;

typedef struct {
    loop_choice *c;
    const engine_event *ev;
    out_verdict verdict;
} out_item;

/* A command for the engine thread, applied between steps in the order given. */
typedef enum { CMD_ADD = 0, CMD_ABORT, CMD_PAUSE, CMD_RESUME } loop_cmd_op;
typedef struct {
    loop_cmd_op op;
    engine_pending *add;               /* CMD_ADD */
    uint64_t req_id;
} loop_cmd;

/* One published step. */
typedef struct {
    engine_output out;
    int rc;
} loop_step;

struct loop {
    uv_loop_t *uv;
    uv_async_t async;
    uv_timer_t timer;
    uv_work_t work;
    loop_config cfg;
    metrics *m;
    engine *eng;
    const tok_tokenizer *tok;
    int spec;
    const char *drafter;        /* static string from the engine */
    _Atomic int state, failed, inflight;
    _Atomic uint64_t next_id;
    /* inbound, guarded by mu */
    pthread_mutex_t mu;
    loop_job *in_head, *in_tail;
    uint64_t *in_cancel;
    int n_in_cancel, cap_in_cancel;
    /* loop thread */
    loop_job *wait_head, *wait_tail;   /* submitted, not yet admitted */
    loop_job *buckets[LOOP_N_BUCKETS];
    int n_jobs;
    int n_paused;                      /* jobs paused by backpressure */
    uint64_t *cancels;
    int n_cancels, cap_cancels;
    int handles_open;
    double drain_deadline, last_deadline_check;
    /* engine thread; emu guards everything in this group */
    uv_async_t step_async;             /* a step was published */
    pthread_t eng_thread;
    int eng_started;
    pthread_mutex_t emu;
    pthread_cond_t ecv;                /* commands, a processed step, or quit */
    loop_cmd *cmds;
    int n_cmds, cap_cmds;
    loop_step pub[2];                  /* published, not yet processed (oldest at pub_head) */
    int pub_head, n_pub;
    int quit;
    engine_stats snap;                 /* after the last step or command batch */
    uint64_t *add_failed;              /* requests whose submit failed */
    int n_add_failed, cap_add_failed;
    struct pollfd *pfd;
    loop_job **pfd_job;
    int cap_pfd;
    /* output processing */
    tp_pool *pool;
    int n_parts;                       /* partitions of jobs (by id) over the pool */
    char **detok;                      /* [n_parts] LOOP_DETOK_CAP scratch each */
    out_item *items;
    int cap_items;
    _Atomic long long host_ns, host_tokens; /* output processing: wall ns, tokens */
    double out_wait_s;                 /* engine thread: had work, waited for the loop to take
                                        * its outputs (emu held) */
};

/* loop.c */
loop_job *loop_find_job(loop *l, uint64_t id);
/* The job's sequences leave loop.inflight, once: before its reply goes out, so that a
 * client sending its next request on the reply is not refused for seats about to be
 * freed (the engine aborts of loop_abort_choices are queued before, in order). */
void loop_give_seats(loop *l, loop_job *job);
void loop_release_job(loop *l, loop_job *job);
void loop_abort_choices(loop *l, loop_job *job);
void loop_pump(loop *l);

/* loop_engine.c (loop thread side) */
int loop_engine_start(loop *l);
void loop_engine_stop(loop *l);      /* joins the engine thread; idempotent */
/* Queue a prepared request (consumed, also on failure) / an abort, for the next gap
 * between steps. */
int loop_engine_add(loop *l, uint64_t req_id, engine_pending *p);
void loop_abort_req(loop *l, uint64_t req_id);
void loop_pause_req(loop *l, uint64_t req_id, int paused);
/* The oldest published step (1) or none (0); loop_engine_done once it is processed. */
int loop_engine_next(loop *l, loop_step *s);
void loop_engine_done(loop *l);
/* Latest engine stats and up to cap request ids whose submit failed (taken). */
int loop_engine_snapshot(loop *l, engine_stats *st, double *out_wait_s, uint64_t *failed, int cap);

/* loop_output.c */
int loop_output_init(loop *l, int threads);
void loop_output_free(loop *l);
/* Turn one step's events into text and chunks and apply the verdicts. */
void loop_output_process(loop *l, const engine_output *out);
/* Echo and the chat role chunk of a just-admitted job. */
void loop_output_start(loop *l, loop_job *job);
void loop_fail_job(loop *l, loop_job *job, int status, const char *type, const char *msg);
void loop_log_job(loop *l, loop_job *job, int status);

/* loop_clients.c */
void loop_process_cancels(loop *l);
void loop_check_deadlines(loop *l);
/* Backpressure: pause a job whose stream's unread output is over its cap (after output
 * was pushed); resume or end paused jobs (from pump). */
void loop_check_backlog(loop *l, loop_job *job);
void loop_check_paused(loop *l);

#endif
