/*
 * A real leak for tests and benchmarks: preloaded into llama-server (LD_PRELOAD), it
 * leaks LEAKSHIM_BYTES of touched heap for every generation request the engine reads
 * ("POST /v1/chat/completions " or "POST /v1/completions " at the start of what one
 * recv(2) returned: cpp-httplib reads a request's head with recv into a 4 KiB buffer).
 * The memory is written, so it is resident anonymous memory (RssAnon, or VmSwap once
 * swapped out), exactly what a leaking engine holds. It does nothing in any other
 * program (the front's Python reads the same request lines) or with LEAKSHIM_BYTES
 * unset or 0. Built by the tests with `cc -shared -fPIC -O2 -o leakshim.so leakshim.c -ldl`.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>

extern char *program_invocation_short_name;

static ssize_t (*real_recv)(int, void *, size_t, int);
static size_t leak_bytes;
static int active;
static void *volatile sink; /* the last leak, so nothing is optimised away */
static const char *const heads[] = {"POST /v1/chat/completions ", "POST /v1/completions "};

__attribute__((constructor)) static void leakshim_init(void) {
    const char *bytes = getenv("LEAKSHIM_BYTES");
    real_recv = (ssize_t (*)(int, void *, size_t, int))dlsym(RTLD_NEXT, "recv");
    active = strcmp(program_invocation_short_name, "llama-server") == 0;
    leak_bytes = bytes != NULL ? (size_t)strtoull(bytes, NULL, 10) : 0;
    if (leak_bytes > ((size_t)1 << 30)) {
        leak_bytes = (size_t)1 << 30; /* a bound: one request never leaks more than 1 GiB */
    }
}

static void leak(void) {
    char *p = malloc(leak_bytes);
    if (p != NULL) {
        memset(p, 0xa5, leak_bytes);
        sink = p;
    }
}

ssize_t recv(int fd, void *buf, size_t len, int flags) {
    ssize_t n;
    size_t i;
    if (real_recv == NULL) {
        errno = ENOSYS;
        return -1;
    }
    n = real_recv(fd, buf, len, flags);
    if (!active || leak_bytes == 0 || n <= 0 || (flags & MSG_PEEK)) {
        return n;
    }
    for (i = 0; i < sizeof heads / sizeof heads[0]; i++) {
        size_t head = strlen(heads[i]);
        if ((size_t)n >= head && memcmp(buf, heads[i], head) == 0) {
            leak();
        }
    }
    return n;
}
