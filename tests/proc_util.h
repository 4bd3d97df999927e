/* Test helpers for tests that start processes and sockets: a monotonic clock in ms, a
 * free loopback port, and a bounded waitpid. Header-only (static functions); include it
 * after <cmocka.h>, since free_port asserts. */
#ifndef SPECD_TEST_PROC_UTIL_H
#define SPECD_TEST_PROC_UTIL_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int64_t ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A loopback TCP port that was free a moment ago. */
static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t l = sizeof a;
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &l), 0);
    close(fd);
    return ntohs(a.sin_port);
}

/* Exit status of pid, waiting at most timeout_ms (-1 if it did not end). */
static int wait_exit(pid_t pid, int timeout_ms, int *status) {
    int64_t end = ms() + timeout_ms;
    while (ms() < end) {
        if (waitpid(pid, status, WNOHANG) == pid) return 0;
        usleep(5000);
    }
    return -1;
}

#endif
