/* The serving loop's private state, shared by its three parts (see loop.h):
 *   loop.c          inbound queue, admission, engine steps and their overlap, drain;
 *   loop_output.c   output processing: tokens -> text, stop strings, logprobs, SSE chunks,
 *                   final bodies (per stream, in parallel on the output pool);
 *   loop_clients.c  client liveness, cancels, request and drain deadlines.
 *
 * Threads: everything here belongs to the loop thread, except that during output
 * processing the pool's threads work on disjoint sets of jobs (a job's choices all go to
 * one partition) and touch only those jobs' choices and channels, the metrics (locked) and
 * their partition's scratch. While a step runs (l->stepping) the engine belongs to the step
 * thread: the loop calls no engine function then; aborts wait in l->deferred. */
#ifndef SPECD_LOOP_INTERNAL_H
#define SPECD_LOOP_INTERNAL_H

#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>

#include "engine/threadpool.h"
#include "server/loop.h"

#define LOOP_N_BUCKETS 1024
#define LOOP_DETOK_CAP 65536
#define LOOP_TICK_MS 100

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
    int n_out;
    long long spec_verify, spec_draft, spec_accept;
    double t_last;
};

/* What output processing decided for one event; applied on the loop thread. */
typedef enum { OUT_NONE = 0, OUT_STOP, OUT_FINAL, OUT_FAIL } out_verdict;

typedef struct {
    loop_choice *c;
    const engine_event *ev;
    out_verdict verdict;
} out_item;

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
    uint64_t *cancels;
    int n_cancels, cap_cancels;
    uint64_t *deferred;                /* engine requests to abort once no step runs */
    int n_deferred, cap_deferred;
    int stepping, step_rc, handles_open;
    engine_output out;                 /* filled by the running step */
    double drain_deadline, last_deadline_check;
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
};

/* loop.c */
loop_job *loop_find_job(loop *l, uint64_t id);
void loop_release_job(loop *l, loop_job *job);
void loop_abort_choices(loop *l, loop_job *job);
/* Abort one engine request now, or once the running step has returned. */
void loop_abort_req(loop *l, uint64_t req_id);
void loop_pump(loop *l);

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

#endif
