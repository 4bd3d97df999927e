/* Connection guard (prefix guard_): the limits a reverse proxy operator expects in front of
 * an open port, for the HTTP library's connections.
 *
 * - Receive deadline: a request must arrive whole (headers and body) within
 *   recv_timeout seconds of the connection opening or of the previous reply on it. The
 *   library's own idle timeout restarts on every byte, so a client dripping one byte at
 *   a time would hold a connection for ever; a watchdog thread shuts such sockets down
 *   (shutdown(2), so the library sees the end of the stream and closes the connection
 *   itself: the descriptor is never closed behind its back). An idle kept-alive
 *   connection counts as receiving its next request, so it is closed after the same time.
 * - Connection cap: guard_over_cap says when more than max_connections are open; the
 *   caller answers 503 with Retry-After and closes (the library's hard limit sits a little
 *   above, so such clients get an answer rather than silence).
 * Per-address limits are the library's (MHD_OPTION_PER_IP_CONNECTION_LIMIT).
 *
 * Threads: every function may be called from any thread; one mutex guards the list. */
#ifndef SPECD_GUARD_H
#define SPECD_GUARD_H

typedef struct guard guard;
typedef struct guard_conn guard_conn;

/* recv_timeout <= 0: no deadline. Starts the watchdog thread. NULL on failure. */
guard *guard_create(double recv_timeout, int max_connections);
void guard_destroy(guard *g);   /* stops the watchdog; connections still listed are freed */

/* A connection opened on socket fd (NULL when out of memory: then it is not guarded). */
guard_conn *guard_open(guard *g, int fd);
void guard_close(guard *g, guard_conn *c);
/* Its request has arrived whole (no deadline until the reply is done) / its reply is done
 * (the next request's deadline starts now). */
void guard_received(guard *g, guard_conn *c);
void guard_replied(guard *g, guard_conn *c);

int guard_over_cap(guard *g);

#endif
