/* Response channel between the loop (writer) and an HTTP connection (reader), prefix sse_.
 *
 * One channel per API request. The loop pushes bytes (SSE events, or a whole JSON body for
 * non-streaming requests) and finally closes it with an HTTP status; the MHD side pulls
 * them out. When the reader finds it empty it parks: sse_chan_pull calls the channel's
 * `park` hook (MHD_suspend_connection) while holding the channel lock, and the next push
 * or close calls `wake` (MHD_resume_connection) under the same lock. Parking and waking
 * are therefore strictly ordered: wake is never called on a connection that is not
 * suspended, and no data is missed. No polling, no thread blocks.
 *
 * After sse_chan_detach (the connection is gone), pushes are dropped and wake is never
 * called again. The channel is reference counted: the loop and the connection each hold a
 * reference; the last sse_chan_unref frees it. */
#ifndef SPECD_SSE_H
#define SPECD_SSE_H

#include <stddef.h>
#include <sys/types.h>

typedef struct sse_chan sse_chan;
typedef void (*sse_hook)(void *arg);

/* New channel with one reference. */
sse_chan *sse_chan_new(void);
void sse_chan_ref(sse_chan *c);
void sse_chan_unref(sse_chan *c);

/* Bind the reader's hooks (may be called again with other hooks before any park). */
void sse_chan_bind(sse_chan *c, sse_hook park, sse_hook wake, void *arg);

/* Writer. Return 0, SPECD_ENOMEM, or SPECD_ECANCELED when the reader is gone. */
int sse_chan_push(sse_chan *c, const void *data, size_t len);
/* Push the last bytes and close in one step (one wake): for whole non-streaming bodies. */
int sse_chan_push_close(sse_chan *c, const void *data, size_t len, int status);
/* No more data; status is the HTTP status for non-streaming replies. Idempotent. */
void sse_chan_close(sse_chan *c, int status);

/* Reader. Copies up to max bytes. Returns the count (> 0), or 0 after parking (nothing
 * yet), or -1 when closed and drained. Never parks when park is NULL (returns 0). */
ssize_t sse_chan_pull(sse_chan *c, void *buf, size_t max);
/* For non-streaming replies: if closed, hands over the whole buffer (malloc'd, caller
 * frees; may be NULL when empty) + status and returns 1; else parks and returns 0. */
int sse_chan_take_if_closed(sse_chan *c, char **data, size_t *len, int *status);
/* The reader is gone: drop future pushes, never wake again. */
void sse_chan_detach(sse_chan *c);
/* Bytes pushed and not yet pulled: of one channel, and of all channels together (the
 * output memory that clients which read slowly pin). */
size_t sse_chan_unread(sse_chan *c);
/* Drop the unread bytes (a client that stopped reading gets none of them). */
void sse_chan_discard(sse_chan *c);
size_t sse_total_unread(void);
int sse_chan_detached(sse_chan *c);
int sse_chan_closed(sse_chan *c);

#endif
