/* The bench's copy counter: a library preloaded (LD_PRELOAD) into a client's process that
 * counts the bytes the process copies in user space (memcpy, memmove, mempcpy and their
 * _chk forms) and the bytes it hands to or takes from the kernel (read, write, send, recv and
 * their vector and message forms; a successful call's return value), while counting is on.
 *
 * It is never imported. The counters live in a 4 KiB file the environment names
 * (HMA_COPY_COUNTERS), mapped shared, so the Python side turns counting on and reads the
 * totals with a plain mmap (hma_redis/tools/bench/copies.py: its layout is COUNTERS below).
 * Without that variable, or when the file cannot be mapped, nothing is counted; every call
 * still reaches the C library's own function.
 *
 * Calls that reach the C library through its PLT are seen (Python, redis-py's hiredis, the
 * C job, LMCache's native client); copies a compiler inlines or a library does with loops
 * of its own (e.g. torch's copy kernels) are not. Built by setup.py (optional, like _wire).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

/* The mapped file, in 64-bit words (copies.py reads the same offsets). */
enum { ON, COPIED_BYTES, COPY_CALLS, KERNEL_IN_BYTES, KERNEL_OUT_BYTES, COUNTERS };

static volatile uint64_t unmapped[COUNTERS];
static volatile uint64_t *counters = unmapped;

typedef void *(*copy_fn)(void *, const void *, size_t);
typedef ssize_t (*io_fn)(int, void *, size_t);
typedef ssize_t (*out_fn)(int, const void *, size_t);
typedef ssize_t (*iov_fn)(int, const struct iovec *, int);
typedef ssize_t (*recv_fn)(int, void *, size_t, int);
typedef ssize_t (*send_fn)(int, const void *, size_t, int);
typedef ssize_t (*recvfrom_fn)(int, void *, size_t, int, struct sockaddr *, socklen_t *);
typedef ssize_t (*sendto_fn)(int, const void *, size_t, int, const struct sockaddr *, socklen_t);
typedef ssize_t (*recvmsg_fn)(int, struct msghdr *, int);
typedef ssize_t (*sendmsg_fn)(int, const struct msghdr *, int);

static copy_fn real_memcpy, real_memmove, real_mempcpy;
static io_fn real_read;
static out_fn real_write;
static iov_fn real_readv, real_writev;
static recv_fn real_recv;
static send_fn real_send;
static recvfrom_fn real_recvfrom;
static sendto_fn real_sendto;
static recvmsg_fn real_recvmsg;
static sendmsg_fn real_sendmsg;

/* Before the real functions are known (dlsym may copy while it resolves them): a byte loop
 * the compiler must not turn back into a call to memmove (it would be this library's). */
__attribute__((optimize("no-tree-loop-distribute-patterns"))) static void *
early_move(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    if (d < s) {
        for (size_t i = 0; i < n; i++)
            d[i] = s[i];
    } else {
        for (size_t i = n; i > 0; i--)
            d[i - 1] = s[i - 1];
    }
    return dst;
}

static inline void count_copy(size_t n)
{
    if (counters[ON]) {
        __atomic_fetch_add(&counters[COPIED_BYTES], n, __ATOMIC_RELAXED);
        __atomic_fetch_add(&counters[COPY_CALLS], 1, __ATOMIC_RELAXED);
    }
}

static inline ssize_t count_io(ssize_t got, int word)
{
    if (got > 0 && counters[ON])
        __atomic_fetch_add(&counters[word], (uint64_t)got, __ATOMIC_RELAXED);
    return got;
}

static void *next(const char *name)
{
    return dlsym(RTLD_NEXT, name);
}

/* The C library's functions and the counters' mapping, once per process: from the
 * constructor, or from the first read/write/send/recv if another library's constructor calls
 * one before it runs. Copies never wait for it: until it is done they use early_move. */
static pthread_once_t resolved = PTHREAD_ONCE_INIT;

static void resolve(void)
{
    real_memmove = (copy_fn)next("memmove");
    real_memcpy = (copy_fn)next("memcpy");
    real_mempcpy = (copy_fn)next("mempcpy");
    real_read = (io_fn)next("read");
    real_write = (out_fn)next("write");
    real_readv = (iov_fn)next("readv");
    real_writev = (iov_fn)next("writev");
    real_recv = (recv_fn)next("recv");
    real_send = (send_fn)next("send");
    real_recvfrom = (recvfrom_fn)next("recvfrom");
    real_sendto = (sendto_fn)next("sendto");
    real_recvmsg = (recvmsg_fn)next("recvmsg");
    real_sendmsg = (sendmsg_fn)next("sendmsg");
    const char *path = getenv("HMA_COPY_COUNTERS");
    if (path == NULL || *path == '\0')
        return;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return;
    /* A file shorter than the counters would fault (SIGBUS) on the first count: not used. */
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < (off_t)sizeof(unmapped)) {
        close(fd);
        return;
    }
    void *map = mmap(NULL, COUNTERS * sizeof(uint64_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (map != MAP_FAILED)
        counters = map;
}

__attribute__((constructor)) static void copycount_init(void)
{
    pthread_once(&resolved, resolve);
}

#define ENSURE(fn)                               \
    do {                                         \
        if (fn == NULL)                          \
            pthread_once(&resolved, resolve);    \
    } while (0)

/* ---------------------------------------------------------------- copies in user space */

void *memcpy(void *dst, const void *src, size_t n)
{
    count_copy(n);
    return real_memcpy ? real_memcpy(dst, src, n) : early_move(dst, src, n);
}

void *memmove(void *dst, const void *src, size_t n)
{
    count_copy(n);
    return real_memmove ? real_memmove(dst, src, n) : early_move(dst, src, n);
}

void *mempcpy(void *dst, const void *src, size_t n)
{
    count_copy(n);
    if (real_mempcpy)
        return real_mempcpy(dst, src, n);
    return (unsigned char *)early_move(dst, src, n) + n;
}

/* The _chk forms (fortified callers): the bound checked here, the copy counted once. */
void *__memcpy_chk(void *dst, const void *src, size_t n, size_t dstlen)
{
    if (n > dstlen)
        abort();
    return memcpy(dst, src, n);
}

void *__memmove_chk(void *dst, const void *src, size_t n, size_t dstlen)
{
    if (n > dstlen)
        abort();
    return memmove(dst, src, n);
}

void *__mempcpy_chk(void *dst, const void *src, size_t n, size_t dstlen)
{
    if (n > dstlen)
        abort();
    return mempcpy(dst, src, n);
}

/* ----------------------------------------------------- bytes to and from the kernel */

ssize_t read(int fd, void *buf, size_t n)
{
    ENSURE(real_read);
    return count_io(real_read(fd, buf, n), KERNEL_IN_BYTES);
}

ssize_t write(int fd, const void *buf, size_t n)
{
    ENSURE(real_write);
    return count_io(real_write(fd, buf, n), KERNEL_OUT_BYTES);
}

ssize_t readv(int fd, const struct iovec *iov, int count)
{
    ENSURE(real_readv);
    return count_io(real_readv(fd, iov, count), KERNEL_IN_BYTES);
}

ssize_t writev(int fd, const struct iovec *iov, int count)
{
    ENSURE(real_writev);
    return count_io(real_writev(fd, iov, count), KERNEL_OUT_BYTES);
}

ssize_t recv(int fd, void *buf, size_t n, int flags)
{
    ENSURE(real_recv);
    return count_io(real_recv(fd, buf, n, flags), KERNEL_IN_BYTES);
}

ssize_t send(int fd, const void *buf, size_t n, int flags)
{
    ENSURE(real_send);
    return count_io(real_send(fd, buf, n, flags), KERNEL_OUT_BYTES);
}

ssize_t recvfrom(int fd, void *buf, size_t n, int flags, struct sockaddr *addr, socklen_t *len)
{
    ENSURE(real_recvfrom);
    return count_io(real_recvfrom(fd, buf, n, flags, addr, len), KERNEL_IN_BYTES);
}

ssize_t sendto(int fd, const void *buf, size_t n, int flags, const struct sockaddr *addr,
               socklen_t len)
{
    ENSURE(real_sendto);
    return count_io(real_sendto(fd, buf, n, flags, addr, len), KERNEL_OUT_BYTES);
}

ssize_t recvmsg(int fd, struct msghdr *msg, int flags)
{
    ENSURE(real_recvmsg);
    return count_io(real_recvmsg(fd, msg, flags), KERNEL_IN_BYTES);
}

ssize_t sendmsg(int fd, const struct msghdr *msg, int flags)
{
    ENSURE(real_sendmsg);
    return count_io(real_sendmsg(fd, msg, flags), KERNEL_OUT_BYTES);
}
