/* Client liveness and deadlines of the serving loop (see loop_internal.h): cancels posted
 * by MHD threads, clients that hung up while their job waits, request timeouts and the
 * drain deadline. Loop thread only; engine aborts go through loop_abort_req, so these may
 * run while a step is in flight. */
#include <stdlib.h>
#include <string.h>

#include "server/log.h"
#include "server/loop_internal.h"

static void end_unanswered(loop *l, loop_job *job) {
    job->cancelled = 1;
    loop_abort_choices(l, job);
    for (int k = 0; k < job->n_choices; k++)
        if (!job->choices[k].done) metrics_request_finished(l->m, "abort");
    loop_log_job(l, job, 499);  /* nginx's "client closed request" */
}

void loop_process_cancels(loop *l) {
    for (int i = 0; i < l->n_cancels; i++) {
        uint64_t id = l->cancels[i];
        loop_job *job = loop_find_job(l, id);
        if (!job) {  /* maybe still waiting for admission */
            loop_job **pp = &l->wait_head, *prev = NULL;
            while (*pp && (*pp)->id != id) prev = *pp, pp = &(*pp)->next;
            if (!*pp) continue;
            job = *pp;
            *pp = job->next;
            if (l->wait_tail == job) l->wait_tail = prev;
            loop_give_seats(l, job);
            loop_job_free(job);
            continue;
        }
        end_unanswered(l, job);
        loop_release_job(l, job);
    }
    l->n_cancels = 0;
}

/* The client of a job is gone: end it without a reply. */
static void client_gone(loop *l, loop_job *job) {
    end_unanswered(l, job);
    sse_chan_close(job->chan, 499);  /* resumes a parked connection so MHD can clean it up */
    loop_release_job(l, job);
}

/* MHD does not watch a suspended connection, so a client that hangs up while its request
 * waits (queued, or a non-streaming reply) would go unnoticed until the reply. One poll()
 * over the sockets of all in-flight jobs, every LOOP_TICK_MS, finds them. A socket stays
 * open while its job is in the table: MHD never closes a suspended connection, and the
 * handler that submitted the job has not returned before it suspends.
 *
 * Half-close: a FIN from the client (POLLRDHUP) reads the same whether it only stopped
 * sending (HTTP/1.1 allows that) or closed the socket. A stream keeps its request on a
 * FIN: its next chunk tells the two apart (a closed client answers it with a reset, MHD
 * then ends the connection and the job is cancelled). A non-streaming reply writes
 * nothing until its end, so there a FIN still cancels, as nginx's proxy does by default. */
static void check_clients(loop *l) {
    if (!l->n_jobs) return;
    if (l->n_jobs > l->cap_pfd) {
        int cap = l->n_jobs * 2;
        struct pollfd *p = realloc(l->pfd, (size_t)cap * sizeof *p);
        loop_job **j = realloc(l->pfd_job, (size_t)cap * sizeof *j);
        if (p) l->pfd = p;
        if (j) l->pfd_job = j;
        if (!p || !j) return;
        l->cap_pfd = cap;
    }
    int n = 0;
    for (int b = 0; b < LOOP_N_BUCKETS; b++)
        for (loop_job *j = l->buckets[b]; j; j = j->hnext)
            if (j->fd >= 0 && n < l->cap_pfd) {
                l->pfd[n] = (struct pollfd){.fd = j->fd, .events = POLLRDHUP};
                l->pfd_job[n++] = j;
            }
    if (poll(l->pfd, (nfds_t)n, 0) <= 0) return;
    for (int i = 0; i < n; i++) {
        short ev = l->pfd[i].revents;
        int gone = ev & (POLLHUP | POLLERR | POLLNVAL);
        if ((ev & POLLRDHUP) && !l->pfd_job[i]->req->stream) gone = 1;
        if (gone) client_gone(l, l->pfd_job[i]);
    }
}

/* Request timeouts and the drain deadline, at most every LOOP_TICK_MS. */
void loop_check_deadlines(loop *l) {
    double now = loop_now();
    if (now - l->last_deadline_check < LOOP_TICK_MS * 1e-3) return;
    l->last_deadline_check = now;
    check_clients(l);
    int past_drain = atomic_load(&l->state) == LOOP_DRAINING && now > l->drain_deadline;
    if (l->cfg.request_timeout <= 0 && !past_drain) return;
    for (int b = 0; b < LOOP_N_BUCKETS; b++) {
        for (loop_job *j = l->buckets[b], *n; j; j = n) {
            n = j->hnext;
            if (past_drain)
                loop_fail_job(l, j, 503, "server_error", "server is shutting down (drain timeout)");
            else if (now - j->t_arrival > l->cfg.request_timeout)
                loop_fail_job(l, j, 504, "timeout", "request exceeded the server's request_timeout");
        }
    }
}

/* ---- backpressure --------------------------------------------------------------------- */

static void set_paused(loop *l, loop_job *job, int paused) {
    job->paused = paused;
    l->n_paused += paused ? 1 : -1;
    job->t_paused = loop_now();
    for (int i = 0; i < job->n_choices; i++)
        if (job->choices[i].in_engine) loop_pause_req(l, job->choices[i].req_id, paused);
}

void loop_check_backlog(loop *l, loop_job *job) {
    if (job->paused || !job->req->stream) return;
    size_t unread = sse_chan_unread(job->chan);
    if (unread > l->cfg.stream_buffer_bytes ||
        (unread > LOOP_BACKLOG_MIN && sse_total_unread() > l->cfg.total_buffer_bytes)) {
        log_msg(LOG_DEBUG, "%s: %zu bytes unread by the client; paused", job->rid, unread);
        set_paused(l, job, 1);
    }
}

/* Paused jobs whose client caught up (down to half the cap) resume; those paused for
 * longer than stall_timeout end: the client gets nothing more, the KV is freed. */
void loop_check_paused(loop *l) {
    if (!l->n_paused) return;
    double now = loop_now();
    size_t total = sse_total_unread();
    for (int b = 0; b < LOOP_N_BUCKETS; b++) {
        for (loop_job *j = l->buckets[b], *n; j; j = n) {
            n = j->hnext;
            if (!j->paused) continue;
            size_t unread = sse_chan_unread(j->chan);
            if (unread <= l->cfg.stream_buffer_bytes / 2 && total <= l->cfg.total_buffer_bytes / 10 * 9) {
                set_paused(l, j, 0);
            } else if (l->cfg.stall_timeout > 0 && now - j->t_paused > l->cfg.stall_timeout) {
                log_msg(LOG_WARN, "%s: the client read nothing for %.0fs (%zu bytes unread); request ended",
                        j->rid, now - j->t_paused, unread);
                end_unanswered(l, j);
                sse_chan_discard(j->chan);
                sse_chan_close(j->chan, 200);
                loop_release_job(l, j);
            }
        }
    }
}
