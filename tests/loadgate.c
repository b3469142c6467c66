/*
 * A real slow load for tests: preloaded into llama-server (LD_PRELOAD), it holds the
 * engine's opening of any file whose name ends in ".gguf" (fopen, fopen64, open, open64,
 * openat: what gguf_init_from_file and the model loader's llama_file go through) while
 * the gate file LOADGATE_FILE exists, then lets the open go on. The engine is then
 * exactly where a big model on a slow SD card keeps it: listening, its model not loaded.
 * While it holds, the file LOADGATE_FILE.held exists (written before the wait, so a test
 * knows the engine reached its model), removed when the open goes on.
 * The wait is bounded (LOADGATE_MAX_S, default 600 s) so that a test that dies never
 * leaves an engine held for ever. It does nothing in any other program (the front's
 * Python opens the same .gguf to read its header) or with LOADGATE_FILE unset.
 * Built by the tests with `cc -shared -fPIC -O2 -o loadgate.so loadgate.c -ldl`.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

extern char *program_invocation_short_name;

static const char *gate;
static long max_wait_ms = 600L * 1000L;

__attribute__((constructor)) static void loadgate_init(void) {
    const char *max_s = getenv("LOADGATE_MAX_S");
    if (strcmp(program_invocation_short_name, "llama-server") != 0) {
        return;
    }
    gate = getenv("LOADGATE_FILE");
    if (gate != NULL && gate[0] == '\0') {
        gate = NULL;
    }
    if (max_s != NULL) {
        long s = strtol(max_s, NULL, 10);
        if (s >= 0 && s <= 3600) {
            max_wait_ms = s * 1000L;
        }
    }
}

static void *next(const char *name) {
    return dlsym(RTLD_NEXT, name);
}

/* LOADGATE_FILE.held: there while an open is held (created with the real open). */
static void mark_held(int held) {
    char marker[4096];
    int (*real_open)(const char *, int, ...) = (int (*)(const char *, int, ...))next("open");
    int fd;
    if ((size_t)snprintf(marker, sizeof marker, "%s.held", gate) >= sizeof marker) {
        return;
    }
    if (!held) {
        unlink(marker);
        return;
    }
    if (real_open != NULL && (fd = real_open(marker, O_WRONLY | O_CREAT | O_CLOEXEC, 0600)) >= 0) {
        close(fd);
    }
}

static void hold(const char *path) {
    size_t n;
    long waited = 0;
    const struct timespec step = {0, 20L * 1000L * 1000L}; /* 20 ms */
    if (gate == NULL || path == NULL) {
        return;
    }
    n = strlen(path);
    if (n < 5 || strcmp(path + n - 5, ".gguf") != 0 || access(gate, F_OK) != 0) {
        return;
    }
    mark_held(1);
    while (access(gate, F_OK) == 0 && waited < max_wait_ms) {
        nanosleep(&step, NULL);
        waited += 20;
    }
    mark_held(0);
}

FILE *fopen(const char *path, const char *mode) {
    FILE *(*real)(const char *, const char *) = (FILE * (*)(const char *, const char *)) next("fopen");
    if (real == NULL) {
        errno = ENOSYS;
        return NULL;
    }
    hold(path);
    return real(path, mode);
}

FILE *fopen64(const char *path, const char *mode) {
    FILE *(*real)(const char *, const char *) =
        (FILE * (*)(const char *, const char *)) next("fopen64");
    if (real == NULL) {
        errno = ENOSYS;
        return NULL;
    }
    hold(path);
    return real(path, mode);
}

/* open's mode argument is there only with O_CREAT or O_TMPFILE. */
static mode_t mode_of(int flags, va_list ap) {
    return (flags & (O_CREAT | O_TMPFILE)) ? (mode_t)va_arg(ap, int) : 0;
}

int open(const char *path, int flags, ...) {
    int (*real)(const char *, int, ...) = (int (*)(const char *, int, ...))next("open");
    va_list ap;
    mode_t mode;
    va_start(ap, flags);
    mode = mode_of(flags, ap);
    va_end(ap);
    if (real == NULL) {
        errno = ENOSYS;
        return -1;
    }
    hold(path);
    return real(path, flags, mode);
}

int open64(const char *path, int flags, ...) {
    int (*real)(const char *, int, ...) = (int (*)(const char *, int, ...))next("open64");
    va_list ap;
    mode_t mode;
    va_start(ap, flags);
    mode = mode_of(flags, ap);
    va_end(ap);
    if (real == NULL) {
        errno = ENOSYS;
        return -1;
    }
    hold(path);
    return real(path, flags, mode);
}

int openat(int dirfd, const char *path, int flags, ...) {
    int (*real)(int, const char *, int, ...) = (int (*)(int, const char *, int, ...))next("openat");
    va_list ap;
    mode_t mode;
    va_start(ap, flags);
    mode = mode_of(flags, ap);
    va_end(ap);
    if (real == NULL) {
        errno = ENOSYS;
        return -1;
    }
    hold(path);
    return real(dirfd, path, flags, mode);
}
